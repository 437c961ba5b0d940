//! The enricher against the testbed: ready on /readyz (partitions assigned, Kubernetes API
//! reachable), clean exit on SIGTERM, and a bad config refused with every problem listed.

use std::time::Duration;

use gpumedic_testkit as testkit;

const BIN: &str = env!("CARGO_BIN_EXE_gpumedic-enricher");

#[tokio::test]
async fn starts_reports_ready_and_stops_on_sigterm() {
    let bootstrap = testkit::require_kafka().await.unwrap_or_else(|e| panic!("{e}"));
    testkit::require_kubernetes().await.unwrap_or_else(|e| panic!("{e}"));
    testkit::assert_service_lifecycle(
        BIN,
        &[],
        &[
            ("GPUMEDIC_KAFKA_BOOTSTRAP", bootstrap),
            ("GPUMEDIC_GROUP", testkit::unique_name("enricher")),
            ("KUBECONFIG", testkit::kubeconfig_path().display().to_string()),
        ],
        Duration::from_secs(60),
        Duration::from_secs(10),
    )
    .await;
}

#[test]
fn invalid_config_lists_every_problem_and_exits_64() {
    let (code, stderr) = testkit::run_with_invalid_config(
        BIN,
        &[
            "--kafka-bootstrap",
            "nohost",
            "--kafka-option",
            "novalue",
            "--group",
            " ",
            "--raw-topic",
            "t",
            "--enriched-topic",
            "t",
            "--inventory-max-gpus",
            "0",
            "--inventory-max-age",
            "1m",
        ],
    );
    assert_eq!(code, Some(64), "{stderr}");
    for field in [
        "--kafka-bootstrap",
        "--kafka-option",
        "--group",
        "--enriched-topic",
        "--inventory-max-gpus",
        "--inventory-max-age",
    ] {
        assert!(stderr.contains(field), "{field} missing from: {stderr}");
    }
}
