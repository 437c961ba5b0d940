//! `gpumedic demo` run by a test as a newcomer runs it: its output collected line by line (and
//! echoed for the test log), waited on by text, signalled as Ctrl-C would.

use std::io::{BufRead as _, BufReader};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::{kubeconfig_path, workspace_binary};

/// A running `gpumedic demo`.
pub struct Demo {
    child: Child,
    lines: Arc<Mutex<Vec<String>>>,
}

impl Demo {
    /// Starts `gpumedic demo` with `args` on the testbed the tests use (the checkout's, or
    /// `GPUMEDIC_TESTBED`'s). Panics when the binary is not built.
    pub fn start(args: &[&str]) -> Self {
        let repo = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..");
        let mut cmd = Command::new(workspace_binary("gpumedic").unwrap_or_else(|e| panic!("{e}")));
        cmd.arg("demo")
            .args(args)
            .arg("--repo")
            .arg(&repo)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .stdin(Stdio::null());
        // compose/env names the testbed's folder from GPUMEDIC_TESTBED, else the checkout's
        // .testbed: the one whose kubeconfig the tests use.
        if std::env::var_os("GPUMEDIC_TESTBED").is_none()
            && let Some(dir) = kubeconfig_path().parent()
        {
            cmd.env("GPUMEDIC_TESTBED", dir);
        }
        let mut child = cmd.spawn().expect("gpumedic demo starts");
        let lines = Arc::new(Mutex::new(Vec::new()));
        for stream in [
            Box::new(child.stdout.take().expect("stdout")) as Box<dyn std::io::Read + Send>,
            Box::new(child.stderr.take().expect("stderr")),
        ] {
            let lines = Arc::clone(&lines);
            std::thread::spawn(move || {
                for line in BufReader::new(stream).lines().map_while(Result::ok) {
                    println!("demo| {line}");
                    lines.lock().expect("lines").push(line);
                }
            });
        }
        Self { child, lines }
    }

    /// Everything the demo printed so far, one line each.
    pub fn output(&self) -> String {
        self.lines.lock().expect("lines").join("\n")
    }

    /// Waits until a line contains `text` and returns that line; panics (after stopping the
    /// demo) past `timeout` or when the demo exits first.
    pub fn wait_for_line(&mut self, text: &str, timeout: Duration) -> String {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(line) = self.lines.lock().expect("lines").iter().find(|l| l.contains(text)) {
                return line.clone();
            }
            if let Ok(Some(st)) = self.child.try_wait() {
                panic!("the demo exited ({st}) before printing {text:?}:\n{}", self.output());
            }
            if Instant::now() > deadline {
                self.signal("TERM");
                let _ = self.child.wait();
                panic!("the demo did not print {text:?} within {timeout:?}:\n{}", self.output());
            }
            std::thread::sleep(Duration::from_millis(200));
        }
    }

    /// Sends the signal `name` (`INT`, `TERM`) to the demo.
    pub fn signal(&self, name: &str) {
        let _ = Command::new("kill").args([&format!("-{name}"), &self.child.id().to_string()]).status();
    }

    /// Waits for the exit; SIGTERM (the demo cleans up then too) past `timeout`, and a panic.
    pub fn wait(&mut self, timeout: Duration) -> std::process::ExitStatus {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(st) = self.child.try_wait().expect("wait") {
                // The reader threads finish with the pipes.
                std::thread::sleep(Duration::from_millis(300));
                return st;
            }
            if Instant::now() > deadline {
                self.signal("TERM");
                let _ = self.child.wait();
                panic!("the demo did not finish within {timeout:?}:\n{}", self.output());
            }
            std::thread::sleep(Duration::from_millis(500));
        }
    }

    /// The run id the demo announced (`run <id>: ...`).
    pub fn run_id(&self) -> String {
        let out = self.output();
        out.lines()
            .find_map(|l| l.trim().strip_prefix("run ").and_then(|r| r.split(':').next()).map(str::to_owned))
            .unwrap_or_else(|| panic!("the demo printed no run id:\n{out}"))
    }
}

impl Drop for Demo {
    /// A test that panics midway still stops the demo, which then removes what it created.
    fn drop(&mut self) {
        if matches!(self.child.try_wait(), Ok(None)) {
            self.signal("INT");
            let deadline = Instant::now() + Duration::from_secs(60);
            while matches!(self.child.try_wait(), Ok(None)) && Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(300));
            }
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}
