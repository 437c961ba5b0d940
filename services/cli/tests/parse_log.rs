//! `gpumedic parse-log` on a real-looking syslog file and on stdin: one JSON object per event,
//! nothing for other lines.

use std::io::Write as _;
use std::process::{Command, Stdio};

const BIN: &str = env!("CARGO_BIN_EXE_gpumedic");

fn lines(stdout: &[u8]) -> Vec<serde_json::Value> {
    String::from_utf8_lossy(stdout).lines().map(|l| serde_json::from_str(l).expect("each line is JSON")).collect()
}

#[test]
fn prints_one_json_object_per_event_from_a_file() {
    let fixture = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/kern.log");
    let out = Command::new(BIN).args(["parse-log", fixture]).output().expect("runs");
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let events = lines(&out.stdout);
    assert_eq!(events.len(), 3, "{events:#?}");
    assert_eq!(events[0]["kind"], "xid");
    assert_eq!(events[0]["xid"], 79);
    assert_eq!(events[0]["pci_bus_id"], "0000:3b:00.0");
    assert!(events[0]["pid"].is_null());
    assert_eq!(events[1]["kind"], "sxid");
    assert_eq!(events[1]["sxid"], 12028);
    assert!(events[1]["message"].as_str().unwrap().contains("Engine instance 32"));
    assert_eq!(events[2]["xid"], 154);
    assert_eq!(events[2]["recovery_action"], "node_reboot_required");
}

#[test]
fn reads_stdin_and_survives_invalid_utf8() {
    let mut child =
        Command::new(BIN).arg("parse-log").stdin(Stdio::piped()).stdout(Stdio::piped()).spawn().expect("runs");
    let mut stdin = child.stdin.take().unwrap();
    stdin.write_all(b"\xff\xfe not text\n[ 1.0] NVRM: Xid (PCI:0000:07:00): 43, pid=2153, Ch 00000010\n").unwrap();
    drop(stdin);
    let out = child.wait_with_output().unwrap();
    assert!(out.status.success());
    let events = lines(&out.stdout);
    assert_eq!(events.len(), 1);
    assert_eq!((events[0]["xid"].as_u64(), events[0]["pid"].as_u64()), (Some(43), Some(2153)));
}

#[test]
fn missing_file_is_an_error() {
    let out = Command::new(BIN).args(["parse-log", "/nonexistent/kern.log"]).output().expect("runs");
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("cannot read"));
}
