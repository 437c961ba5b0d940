//! Headless Chromium (Debian's `chromium`, installed by `compose/lib/install-chromium.sh`) driven
//! over the DevTools protocol on a pipe (`--remote-debugging-pipe`): JSON messages ending in a NUL
//! byte, commands on the browser's fd 3 and answers and events on its fd 4. The two fds are named
//! pipes that a shell hands to the browser, so no websocket client and no unsafe code are needed.

use std::io::{BufRead as _, BufReader, Write as _};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc::{Receiver, RecvTimeoutError};
use std::time::{Duration, Instant};

use base64::Engine as _;
use serde_json::{Value, json};

/// The Chromium binary: `$CHROMIUM`, else `chromium` on PATH. Panics with how to install it.
pub fn chromium() -> PathBuf {
    if let Some(p) = std::env::var_os("CHROMIUM") {
        return p.into();
    }
    for dir in std::env::var("PATH").unwrap_or_default().split(':') {
        for name in ["chromium", "chromium-browser"] {
            let p = Path::new(dir).join(name);
            if p.is_file() {
                return p;
            }
        }
    }
    panic!("Chromium is not installed: run compose/lib/install-chromium.sh (scripts/test.sh does), or set CHROMIUM");
}

/// Where the tests write their screenshots: `<target>/console-screenshots/`.
pub fn screenshot_dir() -> PathBuf {
    let exe = std::env::current_exe().expect("the test binary");
    // <target>/<profile>/deps/<test> -> <target>
    let target = exe.ancestors().nth(3).expect("the target folder").to_owned();
    let dir = target.join("console-screenshots");
    std::fs::create_dir_all(&dir).expect("the screenshot folder");
    dir
}

/// One headless browser with one page.
pub struct Browser {
    child: Child,
    commands: std::fs::File,
    answers: Receiver<Value>,
    next_id: u64,
    session: String,
    profile: PathBuf,
}

impl Drop for Browser {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.profile);
    }
}

impl Browser {
    /// Starts the browser and opens a blank page.
    pub fn start() -> Browser {
        let profile = std::env::temp_dir().join(format!("gpumedic-chromium-{}", uuid::Uuid::new_v4().simple()));
        std::fs::create_dir_all(&profile).expect("a profile folder");
        let (to_browser, from_browser) = (profile.join("in"), profile.join("out"));
        for fifo in [&to_browser, &from_browser] {
            let ok = Command::new("mkfifo").arg(fifo).status().expect("mkfifo").success();
            assert!(ok, "mkfifo {}", fifo.display());
        }
        let child = Command::new("sh")
            .arg("-c")
            .arg(
                "exec \"$0\" --headless --no-sandbox --disable-gpu --disable-dev-shm-usage --no-first-run \
                  --no-default-browser-check --hide-scrollbars --window-size=1400,1000 \
                  --user-data-dir=\"$1\" --remote-debugging-pipe about:blank 3<\"$2\" 4>\"$3\"",
            )
            .arg(chromium())
            .arg(profile.join("profile"))
            .arg(&to_browser)
            .arg(&from_browser)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(profile.join("chromium.log")).expect("log file"))
            .spawn()
            .expect("start chromium");
        // The same order as the shell opens them, so neither side waits for the other for ever.
        let commands = std::fs::OpenOptions::new().write(true).open(&to_browser).expect("the command pipe");
        let reader = std::fs::File::open(&from_browser).expect("the answer pipe");
        let (tx, answers) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let mut reader = BufReader::new(reader);
            let mut buf = Vec::new();
            while reader.read_until(0, &mut buf).is_ok_and(|n| n > 0) {
                buf.pop_if(|b| *b == 0);
                if let Ok(v) = serde_json::from_slice::<Value>(&buf)
                    && tx.send(v).is_err()
                {
                    return;
                }
                buf.clear();
            }
        });
        let mut b = Browser { child, commands, answers, next_id: 0, session: String::new(), profile };
        let targets = b.call("Target.getTargets", json!({}), false);
        let page = targets["targetInfos"]
            .as_array()
            .and_then(|ts| ts.iter().find(|t| t["type"] == "page"))
            .and_then(|t| t["targetId"].as_str())
            .map(str::to_owned)
            .unwrap_or_else(|| {
                b.call("Target.createTarget", json!({ "url": "about:blank" }), false)["targetId"]
                    .as_str()
                    .expect("a target id")
                    .to_owned()
            });
        let attached = b.call("Target.attachToTarget", json!({ "targetId": page, "flatten": true }), false);
        b.session = attached["sessionId"].as_str().expect("a session").to_owned();
        b.call("Page.enable", json!({}), true);
        b
    }

    /// Sends `method` (to the page when `page`, else to the browser) and waits for its result.
    pub fn call(&mut self, method: &str, params: Value, page: bool) -> Value {
        self.next_id += 1;
        let id = self.next_id;
        let mut message = json!({ "id": id, "method": method, "params": params });
        if page {
            message["sessionId"] = json!(self.session);
        }
        let mut bytes = serde_json::to_vec(&message).expect("JSON");
        bytes.push(0);
        self.commands.write_all(&bytes).and_then(|()| self.commands.flush()).expect("write to chromium");
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            match self.answers.recv_timeout(deadline.saturating_duration_since(Instant::now())) {
                Ok(v) if v["id"] == id => {
                    assert!(v.get("error").is_none(), "{method} failed: {v}");
                    return v["result"].clone();
                }
                Ok(_) => {}
                Err(RecvTimeoutError::Timeout) => panic!("chromium did not answer {method} within 30 s"),
                Err(RecvTimeoutError::Disconnected) => {
                    let log = std::fs::read_to_string(self.profile.join("chromium.log")).unwrap_or_default();
                    panic!("chromium closed the pipe during {method}; its log:\n{log}")
                }
            }
        }
    }

    /// Opens `url` and waits until its document has loaded.
    pub fn open(&mut self, url: &str) {
        self.call("Page.navigate", json!({ "url": url }), true);
        self.wait_for("document.readyState === 'complete'", Duration::from_secs(30));
    }

    /// The value of `expression` in the page.
    pub fn eval(&mut self, expression: &str) -> Value {
        let r = self.call("Runtime.evaluate", json!({ "expression": expression, "returnByValue": true }), true);
        r["result"]["value"].clone()
    }

    /// Waits until `expression` is true in the page; panics after `timeout`.
    pub fn wait_for(&mut self, expression: &str, timeout: Duration) {
        let deadline = Instant::now() + timeout;
        while Instant::now() < deadline {
            if self.eval(expression) == json!(true) {
                return;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        panic!("`{expression}` was not true within {timeout:?}; the page:\n{}", self.dom());
    }

    /// The page's DOM as HTML, as it is now.
    pub fn dom(&mut self) -> String {
        self.eval("document.documentElement.outerHTML").as_str().unwrap_or_default().to_owned()
    }

    /// A PNG of the whole page, written to `path`.
    pub fn screenshot(&mut self, path: &Path) {
        let r = self.call("Page.captureScreenshot", json!({ "format": "png", "captureBeyondViewport": true }), true);
        let png = base64::engine::general_purpose::STANDARD
            .decode(r["data"].as_str().expect("screenshot data"))
            .expect("base64 PNG");
        std::fs::write(path, png).expect("write the screenshot");
    }
}
