//! The collector against the testbed: ready on /readyz, clean exit on SIGTERM, and a bad config
//! refused with every problem listed.

use std::time::Duration;

use gpumedic_testkit as testkit;

const BIN: &str = env!("CARGO_BIN_EXE_gpumedic-collector");

#[tokio::test]
async fn starts_reports_ready_and_stops_on_sigterm() {
    let bootstrap = testkit::require_kafka().await.unwrap_or_else(|e| panic!("{e}"));
    // A state folder of its own: the spool and the ingest socket live there.
    let state = std::env::temp_dir().join(testkit::unique_name("collector-lifecycle"));
    testkit::assert_service_lifecycle(
        BIN,
        &[],
        &[
            ("GPUMEDIC_KAFKA_BOOTSTRAP", bootstrap),
            ("GPUMEDIC_NODE_NAME", testkit::unique_name("lifecycle-node")),
            ("GPUMEDIC_GPU_BACKEND", "simulated".into()),
            ("GPUMEDIC_KMSG_PATH", "off".into()),
            ("GPUMEDIC_STATE_DIR", state.display().to_string()),
        ],
        Duration::from_secs(60),
        Duration::from_secs(10),
    )
    .await;
    std::fs::remove_dir_all(&state).ok();
}

#[test]
fn invalid_config_lists_every_problem_and_exits_64() {
    let (code, stderr) = testkit::run_with_invalid_config(
        BIN,
        &[
            "--kafka-bootstrap",
            "nohost",
            "--node-name",
            "Bad_Name",
            "--log-format",
            "xml",
            "--shutdown-deadline",
            "soon",
        ],
    );
    assert_eq!(code, Some(64), "{stderr}");
    for field in ["--kafka-bootstrap", "--node-name", "--log-format", "--shutdown-deadline"] {
        assert!(stderr.contains(field), "{field} missing from: {stderr}");
    }
    assert!(stderr.contains("4 problems"), "{stderr}");
}
