//! The remediator against the testbed: ready on /readyz (partitions assigned, Kubernetes API
//! reachable), clean exit on SIGTERM, and a bad config refused with every problem listed.

use std::time::Duration;

use gpumedic_testkit as testkit;

const BIN: &str = env!("CARGO_BIN_EXE_gpumedic-remediator");

#[tokio::test]
async fn starts_reports_ready_and_stops_on_sigterm() {
    let bootstrap = testkit::require_kafka().await.unwrap_or_else(|e| panic!("{e}"));
    testkit::require_kubernetes().await.unwrap_or_else(|e| panic!("{e}"));
    testkit::assert_service_lifecycle(
        BIN,
        &[],
        &[
            ("GPUMEDIC_KAFKA_BOOTSTRAP", bootstrap),
            ("GPUMEDIC_GROUP", testkit::unique_name("remediator")),
            ("KUBECONFIG", testkit::kubeconfig_path().display().to_string()),
            // Its own lease and status object, in a namespace the testbed always has.
            ("GPUMEDIC_LEASE_NAMESPACE", "default".into()),
            ("GPUMEDIC_LEASE_NAME", testkit::unique_name("lifecycle-lease")),
            ("GPUMEDIC_STATUS_CONFIGMAP", testkit::unique_name("lifecycle-status")),
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
            "--lease-duration",
            "4s",
            "--lease-renew",
            "3s",
            "--maintenance-window",
            "Caturday 01:00-02:00",
        ],
    );
    assert_eq!(code, Some(64), "{stderr}");
    for field in ["--kafka-bootstrap", "--kafka-option", "--group", "--lease-renew", "--maintenance-window"] {
        assert!(stderr.contains(field), "{field} missing from: {stderr}");
    }
}
