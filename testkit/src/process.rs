//! Service binaries started by tests: spawned with the testbed's addresses, polled on their
//! `/readyz`, stopped with SIGTERM; and the paths of the workspace's binaries.

use std::time::Duration;

use crate::http::http_get;
use crate::testbed::START_HINT;

/// A service binary started by a test: spawned with the testbed's addresses, polled on its
/// `/readyz`, stopped with SIGTERM. Killed if dropped while running.
pub struct ServiceProcess {
    child: std::process::Child,
    admin: std::net::SocketAddr,
    name: String,
}

impl ServiceProcess {
    /// Starts `binary` with `args`, `GPUMEDIC_ADMIN_ADDR` on a free local port, and `env`.
    pub fn start(binary: &str, args: &[&str], env: &[(&str, String)]) -> std::io::Result<Self> {
        let admin = free_local_addr()?;
        let mut cmd = std::process::Command::new(binary);
        cmd.args(args)
            .env("GPUMEDIC_ADMIN_ADDR", admin.to_string())
            .env("GPUMEDIC_LOG", "info")
            .stdin(std::process::Stdio::null());
        for (k, v) in env {
            cmd.env(k, v);
        }
        let child = cmd.spawn()?;
        Ok(Self { child, admin, name: binary.rsplit('/').next().unwrap_or(binary).to_owned() })
    }

    /// The admin server's address.
    pub fn admin_addr(&self) -> std::net::SocketAddr {
        self.admin
    }

    /// The process id (for sampling its memory from `/proc`).
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// The exit status, if the process has exited.
    pub fn try_wait(&mut self) -> std::io::Result<Option<std::process::ExitStatus>> {
        self.child.try_wait()
    }

    /// Polls `/readyz` until it answers 200 or `timeout` passes; the error carries the last answer.
    pub async fn wait_ready(&mut self, timeout: Duration) -> Result<(), String> {
        let deadline = tokio::time::Instant::now() + timeout;
        let mut last = String::from("no answer yet");
        while tokio::time::Instant::now() < deadline {
            if let Ok(Some(status)) = self.child.try_wait() {
                return Err(format!("{} exited with {status} before it was ready", self.name));
            }
            match http_get(self.admin, "/readyz").await {
                Ok((200, _)) => return Ok(()),
                Ok((code, body)) => last = format!("{code} {}", body.trim()),
                Err(e) => last = e.to_string(),
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        Err(format!("{} was not ready after {timeout:?}; last /readyz: {last}", self.name))
    }

    /// Sends SIGTERM and waits up to `timeout` for the process to exit; returns its status.
    pub async fn terminate(&mut self, timeout: Duration) -> Result<std::process::ExitStatus, String> {
        let pid = self.child.id().to_string();
        let sent = std::process::Command::new("kill").args(["-TERM", &pid]).status().map_err(|e| e.to_string())?;
        if !sent.success() {
            return Err(format!("kill -TERM {pid} failed"));
        }
        let deadline = tokio::time::Instant::now() + timeout;
        while tokio::time::Instant::now() < deadline {
            if let Some(status) = self.child.try_wait().map_err(|e| e.to_string())? {
                return Ok(status);
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        Err(format!("{} did not exit within {timeout:?} of SIGTERM", self.name))
    }
}

impl Drop for ServiceProcess {
    fn drop(&mut self) {
        if matches!(self.child.try_wait(), Ok(None)) {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

/// The lifecycle every service must have: started with the testbed's addresses it reports ready
/// on `/readyz` within `ready_within`, serves `/healthz` and `/metrics`, and on SIGTERM exits 0
/// within `deadline`. Panics with a readable message otherwise.
pub async fn assert_service_lifecycle(
    binary: &str,
    args: &[&str],
    env: &[(&str, String)],
    ready_within: Duration,
    deadline: Duration,
) {
    let mut env = env.to_vec();
    env.push(("GPUMEDIC_SHUTDOWN_DEADLINE", format!("{}ms", deadline.as_millis())));
    let mut process = ServiceProcess::start(binary, args, &env).expect("service binary starts");
    process.wait_ready(ready_within).await.unwrap_or_else(|e| panic!("{e}; {START_HINT} if it is not running"));
    let (code, body) = http_get(process.admin_addr(), "/healthz").await.expect("healthz answers");
    assert_eq!((code, body.trim()), (200, "ok"));
    let (code, body) = http_get(process.admin_addr(), "/metrics").await.expect("metrics answers");
    assert_eq!(code, 200);
    assert!(body.contains("_up"), "metrics should include the service's up gauge: {body}");
    // The process exits on its own within the deadline it was given, plus start-up slack.
    let status = process.terminate(deadline + Duration::from_secs(5)).await.unwrap_or_else(|e| panic!("{e}"));
    assert!(status.success(), "{binary} exited with {status} after SIGTERM");
}

/// Runs `binary` with invalid `args` and returns its exit code and stderr.
pub fn run_with_invalid_config(binary: &str, args: &[&str]) -> (Option<i32>, String) {
    let out = std::process::Command::new(binary)
        .args(args)
        .env_remove("GPUMEDIC_KAFKA_BOOTSTRAP")
        .env_remove("GPUMEDIC_DATABASE_URL")
        .env_remove("GPUMEDIC_NODE_NAME")
        .output()
        .expect("binary runs");
    (out.status.code(), String::from_utf8_lossy(&out.stderr).into_owned())
}

/// The path of workspace binary `name` (built next to the running test's own folder), for tests
/// that run several services. Fails with the command that builds them when it is missing.
pub fn workspace_binary(name: &str) -> Result<std::path::PathBuf, String> {
    let exe = std::env::current_exe().map_err(|e| e.to_string())?;
    // target/<profile>/deps/<test> -> target/<profile>/<name>
    let dir = exe.parent().and_then(|d| d.parent()).ok_or("the test binary has no parent folder")?;
    let path = dir.join(name);
    if path.is_file() {
        Ok(path)
    } else {
        Err(format!(
            "{} is missing: build the binaries first with `cargo build --workspace --bins` (scripts/test.sh does)",
            path.display()
        ))
    }
}

/// A local address with a port nobody listens on right now.
pub fn free_local_addr() -> std::io::Result<std::net::SocketAddr> {
    std::net::TcpListener::bind("127.0.0.1:0")?.local_addr()
}
