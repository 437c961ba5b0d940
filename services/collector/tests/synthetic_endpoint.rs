//! Fault injection through the collector binary: off unless enabled, loopback only (refused at
//! config with exit 64 otherwise), and when enabled it publishes synthetic events for the
//! collector's own node.

mod common;

use std::time::Duration;

use common::{CollectorEnv, post};
use gpumedic_schemas::health::Source;
use gpumedic_schemas::{HealthEvent, Kind, topics};
use gpumedic_testkit as testkit;

#[tokio::test]
async fn fault_injection_is_off_unless_enabled() {
    let bootstrap = testkit::require_kafka().await.unwrap_or_else(|e| panic!("{e}"));
    let state = std::env::temp_dir().join(testkit::unique_name("collector-synthetic-off"));
    let mut collector = CollectorEnv::new(bootstrap, &testkit::unique_name("syn-off"), &state).start().await;
    let (code, _) = post(collector.admin_addr(), "/v1/inject", r#"{"xid": 79}"#).await.expect("admin answers");
    assert_eq!(code, 404, "the admin server has no injection route");
    let (_, metrics) = testkit::http_get(collector.admin_addr(), "/metrics").await.expect("metrics");
    assert!(!metrics.contains("gpumedic_collector_synthetic_events_total"), "nothing was injected");
    collector.terminate(Duration::from_secs(15)).await.expect("stops");
    std::fs::remove_dir_all(&state).ok();
}

#[tokio::test]
async fn enabled_on_loopback_it_publishes_synthetic_events_for_its_own_node() {
    let bootstrap = testkit::require_kafka().await.unwrap_or_else(|e| panic!("{e}"));
    let node = testkit::unique_name("syn-on");
    let state = std::env::temp_dir().join(testkit::unique_name("collector-synthetic-on"));
    let addr = testkit::free_local_addr().expect("a free port");
    let mut collector =
        CollectorEnv::new(bootstrap, &node, &state).set("GPUMEDIC_SYNTHETIC_ADDR", addr.to_string()).start().await;

    let ids = common::inject_ids(addr, r#"{"xid": 79, "gpu_index": 1, "count": 2}"#).await;
    assert_eq!(ids.len(), 2);

    let (code, body) = post(addr, "/v1/inject", r#"{"xid": 79, "node": "another-node"}"#).await.expect("answers");
    assert_eq!(code, 400, "a caller cannot name a node: {body}");
    assert!(body.contains("error"), "{body}");
    // Without the simulated backend there is no simulated node to reboot or to lose a GPU.
    for body in [r#"{"reboot": true}"#, r#"{"fall_off_bus": true, "gpu_index": 0}"#] {
        let (code, answer) = post(addr, "/v1/inject", body).await.expect("answers");
        assert_eq!(code, 409, "{body}: {answer}");
        assert!(answer.contains("simulated GPU backend only"), "{answer}");
    }

    let record = testkit::wait_for_event(topics::HEALTH_RAW, &ids[1], Duration::from_secs(60))
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(record.key.as_deref(), Some(node.as_bytes()));
    let event: HealthEvent = gpumedic_schemas::decode(record.payload.as_deref().unwrap()).expect("decodes");
    assert!(event.synthetic);
    assert_eq!(event.source, Source::Synthetic);
    assert_eq!(event.kind, Kind::Xid);
    assert_eq!(event.node, node);
    assert_eq!(event.entity.gpu_index, Some(1));
    let host_boot = std::fs::read_to_string("/proc/sys/kernel/random/boot_id").expect("boot id");
    assert_eq!(event.boot_id.as_deref(), Some(host_boot.trim()), "stamped with the node's boot id");
    collector.terminate(Duration::from_secs(15)).await.expect("stops");
    std::fs::remove_dir_all(&state).ok();
}

#[test]
fn a_non_loopback_address_is_refused_with_exit_64() {
    let stderr = common::refused(&["--synthetic-addr", "0.0.0.0:9401"]);
    assert!(stderr.contains("--synthetic-addr") && stderr.contains("loopback"), "{stderr}");
}
