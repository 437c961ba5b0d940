//! `gpumedic rules check` and `gpumedic inject` as operators run them.

use std::process::Command;
use std::time::Duration;

use gpumedic_schemas::{HealthEvent, topics};
use gpumedic_testkit as testkit;

const BIN: &str = env!("CARGO_BIN_EXE_gpumedic");

#[test]
fn rules_check_accepts_the_defaults_and_lists_every_problem_with_its_line() {
    let out = Command::new(BIN).args(["rules", "check"]).output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(String::from_utf8_lossy(&out.stdout).starts_with("ok: "));

    let dir = std::env::temp_dir().join(testkit::unique_name("rules-check"));
    std::fs::create_dir_all(&dir).unwrap();
    let bad = dir.join("bad.yaml");
    std::fs::write(
        &bad,
        "rules:\n  - id: a\n    version: 1\n    match: {kind: xid}\n    severity: catastrophic\n    action: none\n    clear: {evidence: {healthy: true}, quiet: 1h}\n  - id: b\n    version: 1\n    match: {kind: xid}\n    severity: info\n    action: explode\n    clear: {evidence: {healthy: true}, quiet: soon}\n",
    )
    .unwrap();
    let out = Command::new(BIN).args(["rules", "check"]).arg(&bad).output().unwrap();
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    let path = bad.display().to_string();
    for line in [5, 12, 13] {
        assert!(stderr.contains(&format!("{path}:{line}:")), "line {line} missing from:\n{stderr}");
    }
    std::fs::remove_dir_all(&dir).ok();
}

#[tokio::test]
async fn inject_publishes_a_synthetic_event_on_the_raw_topic() {
    let bootstrap = testkit::require_kafka().await.unwrap_or_else(|e| panic!("{e}"));
    let node = testkit::unique_name("inject-node");
    let out = Command::new(BIN).args(["topics", "create", "--kafka-bootstrap", &bootstrap]).output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let out = Command::new(BIN)
        .args(["inject", "--kafka-bootstrap", &bootstrap, "--node", &node, "--xid", "79", "--gpu-index", "3"])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let id = String::from_utf8_lossy(&out.stdout).trim().to_owned();
    let record = testkit::wait_for_record(
        topics::HEALTH_RAW,
        |r| r.key.as_deref() == Some(node.as_bytes()),
        Duration::from_secs(30),
    )
    .await
    .unwrap_or_else(|e| panic!("{e}"));
    let event: HealthEvent = gpumedic_schemas::decode(record.payload.as_deref().unwrap()).unwrap();
    assert_eq!(event.event_id.to_string(), id);
    assert!(event.synthetic);
    assert_eq!(event.entity.gpu_index, Some(3));
    assert!(matches!(event.detail, gpumedic_schemas::Detail::Xid(ref x) if x.code == 79));

    let out = Command::new(BIN).args(["inject", "--kafka-bootstrap", &bootstrap, "--node", &node]).output().unwrap();
    assert!(!out.status.success(), "nothing to inject is an error");
}
