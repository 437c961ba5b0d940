//! `gpumedic hooks verify` and `gpumedic hooks sign` as a receiver's owner runs them: a request
//! signed as the remediator signs it is valid while fresh and refused as a replay once older than
//! the tolerance; `sign` makes requests `verify` accepts, with either key of a rotation.

use std::io::Write as _;
use std::process::{Command, Output, Stdio};

use gpumedic_remediator::hooks::{self, Key, Secret};
use gpumedic_testkit as testkit;

const BIN: &str = env!("CARGO_BIN_EXE_gpumedic");
const BODY: &str = r#"{"verdictId":"7b2c","node":"gpu-17","action":"reset_gpu","step":1}"#;

/// A folder of key files for one test.
struct Keys {
    dir: std::path::PathBuf,
}

impl Keys {
    fn new() -> Self {
        let dir = std::env::temp_dir().join(testkit::unique_name("hooks-cli"));
        std::fs::create_dir_all(&dir).unwrap();
        Self { dir }
    }

    /// Writes `secret` (with the newline a shell adds) and returns `--key-file ID=PATH`'s value.
    fn file(&self, id: &str, secret: &str) -> String {
        let path = self.dir.join(id);
        std::fs::write(&path, format!("{secret}\n")).unwrap();
        format!("{id}={}", path.display())
    }
}

impl Drop for Keys {
    fn drop(&mut self) {
        std::fs::remove_dir_all(&self.dir).ok();
    }
}

/// The raw request a receiver would dump, signed by `key` at `timestamp`.
fn request(key: &Key, timestamp: i64) -> Vec<u8> {
    let signed = hooks::sign(std::slice::from_ref(key), timestamp, BODY.as_bytes());
    let mut raw =
        String::from("POST /v1/repair HTTP/1.1\r\nHost: repair.example.com\r\nContent-Type: application/json\r\n");
    for (name, value) in signed.pairs() {
        raw.push_str(&format!("{name}: {value}\r\n"));
    }
    raw.push_str(&format!("Idempotency-Key: 7b2c:1\r\nContent-Length: {}\r\n\r\n{BODY}", BODY.len()));
    raw.into_bytes()
}

fn run(args: &[&str], stdin: &[u8]) -> Output {
    let mut child = Command::new(BIN)
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("gpumedic runs");
    // A command refused at its arguments exits without reading stdin; the pipe it closed is then
    // not a failure of the test, the exit status and messages below are what is checked.
    match child.stdin.take().unwrap().write_all(stdin) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => {}
        Err(e) => panic!("writing the request to gpumedic's stdin: {e}"),
    }
    child.wait_with_output().unwrap()
}

fn stdout(out: &Output) -> String {
    String::from_utf8_lossy(&out.stdout).into_owned()
}

#[test]
fn a_request_signed_ten_minutes_ago_is_refused_as_too_old_and_a_fresh_one_is_valid() {
    let keys = Keys::new();
    let key_file = keys.file("2026-12", "s3cret-shared-with-the-receiver");
    let key = Key::new("2026-12", Secret(b"s3cret-shared-with-the-receiver".to_vec())).unwrap();
    let now = chrono::Utc::now().timestamp();

    let replay = keys.dir.join("replay.http");
    std::fs::write(&replay, request(&key, now - 600)).unwrap();
    let args = ["hooks", "verify", "--key-file", &key_file, "--tolerance", "5m", "--request"];
    let out = run(&[&args[..], &[replay.to_str().unwrap()][..]].concat(), b"");
    assert_eq!(out.status.code(), Some(1), "{}{}", stdout(&out), String::from_utf8_lossy(&out.stderr));
    // Signed 600 s before `now`; the command reads its clock a moment later ("10m 1s ago" on a
    // busy machine).
    let said = stdout(&out);
    assert!(
        said.starts_with("refused: too old: signed 10m") && said.contains(" ago, more than the 5m tolerance"),
        "{said}"
    );

    let out = run(&[&args[..], &["-"][..]].concat(), &request(&key, now));
    assert_eq!(out.status.code(), Some(0), "{}{}", stdout(&out), String::from_utf8_lossy(&out.stderr));
    assert!(stdout(&out).starts_with("valid: key 2026-12, signed "), "{}", stdout(&out));
    assert!(stdout(&out).trim_end().ends_with(" ago"), "{}", stdout(&out));
}

#[test]
fn signed_requests_verify_with_either_rotation_key_and_a_changed_body_is_refused() {
    let keys = Keys::new();
    let (new, old) = (keys.file("2026-12", "new-secret"), keys.file("default", "old-secret"));
    let body = keys.dir.join("body.json");
    std::fs::write(&body, BODY).unwrap();
    let out = run(&["hooks", "sign", "--key-file", &new, "--key-file", &old, "--body", body.to_str().unwrap()], b"");
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let signed = out.stdout;
    assert!(signed.starts_with(b"POST / HTTP/1.1\r\n"), "{}", String::from_utf8_lossy(&signed));

    for (key_file, id) in [(&old, "default"), (&new, "2026-12")] {
        let out = run(&["hooks", "verify", "--key-file", key_file], &signed);
        assert!(out.status.success(), "{}", stdout(&out));
        assert!(stdout(&out).starts_with(&format!("valid: key {id}, ")), "{}", stdout(&out));
    }

    let tampered = String::from_utf8(signed.clone()).unwrap().replace("reset_gpu", "reboot_no");
    let out = run(&["hooks", "verify", "--key-file", &old], tampered.as_bytes());
    assert_eq!(out.status.code(), Some(1));
    assert!(stdout(&out).starts_with("refused: bad signature:"), "{}", stdout(&out));

    let out = run(&["hooks", "verify", "--key-file", &keys.file("other", "x")], &signed);
    assert_eq!(out.status.code(), Some(1));
    assert!(stdout(&out).starts_with("refused: unknown key id:"), "{}", stdout(&out));

    // A key file that is not ID=PATH is a usage problem, not a verdict on the request.
    let out = run(&["hooks", "verify", "--key-file", "no-equals-sign"], &signed);
    assert_eq!(out.status.code(), Some(64));
    assert!(String::from_utf8_lossy(&out.stderr).contains("--key-file"));
}
