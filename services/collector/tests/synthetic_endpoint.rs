//! Fault injection through the collector binary: off unless enabled, loopback only (refused at
//! config with exit 64 otherwise), and when enabled it publishes synthetic events for the
//! collector's own node.

use std::time::Duration;

use gpumedic_schemas::health::Source;
use gpumedic_schemas::{HealthEvent, Kind, topics};
use gpumedic_testkit as testkit;

const BIN: &str = env!("CARGO_BIN_EXE_gpumedic-collector");

/// A minimal HTTP/1.1 POST of a JSON body on loopback: status code and body.
async fn post(addr: std::net::SocketAddr, path: &str, body: &str) -> std::io::Result<(u16, String)> {
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
    let mut stream = tokio::net::TcpStream::connect(addr).await?;
    let request = format!(
        "POST {path} HTTP/1.1\r\nHost: {addr}\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    );
    stream.write_all(request.as_bytes()).await?;
    let mut raw = Vec::new();
    stream.read_to_end(&mut raw).await?;
    let text = String::from_utf8_lossy(&raw);
    let code = text.split_whitespace().nth(1).and_then(|c| c.parse().ok()).unwrap_or(0);
    Ok((code, text.split_once("\r\n\r\n").map(|(_, b)| b.to_owned()).unwrap_or_default()))
}

fn env(bootstrap: String, node: &str, state: &std::path::Path) -> Vec<(&'static str, String)> {
    vec![
        ("GPUMEDIC_KAFKA_BOOTSTRAP", bootstrap),
        ("GPUMEDIC_NODE_NAME", node.to_owned()),
        ("GPUMEDIC_GPU_BACKEND", "off".into()),
        ("GPUMEDIC_KMSG_PATH", "off".into()),
        ("GPUMEDIC_STATE_DIR", state.display().to_string()),
    ]
}

#[tokio::test]
async fn fault_injection_is_off_unless_enabled() {
    let bootstrap = testkit::require_kafka().await.unwrap_or_else(|e| panic!("{e}"));
    let state = std::env::temp_dir().join(testkit::unique_name("collector-synthetic-off"));
    let mut collector =
        testkit::ServiceProcess::start(BIN, &[], &env(bootstrap, &testkit::unique_name("syn-off"), &state))
            .expect("starts");
    collector.wait_ready(Duration::from_secs(60)).await.unwrap_or_else(|e| panic!("{e}"));
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
    let mut env = env(bootstrap, &node, &state);
    env.push(("GPUMEDIC_SYNTHETIC_ADDR", addr.to_string()));
    let mut collector = testkit::ServiceProcess::start(BIN, &[], &env).expect("starts");
    collector.wait_ready(Duration::from_secs(60)).await.unwrap_or_else(|e| panic!("{e}"));

    let mut answer = None;
    for _ in 0..50 {
        match post(addr, "/v1/inject", r#"{"xid": 79, "gpu_index": 1, "count": 2}"#).await {
            Ok(a) => {
                answer = Some(a);
                break;
            }
            Err(_) => tokio::time::sleep(Duration::from_millis(100)).await,
        }
    }
    let (code, body) = answer.expect("the endpoint answers");
    assert_eq!(code, 200, "{body}");
    let body: serde_json::Value = serde_json::from_str(&body).expect("JSON");
    let ids: Vec<String> =
        body["event_ids"].as_array().expect("ids").iter().map(|v| v.as_str().unwrap().to_owned()).collect();
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
    let (code, stderr) = testkit::run_with_invalid_config(
        BIN,
        &["--kafka-bootstrap", "127.0.0.1:19092", "--node-name", "n1", "--synthetic-addr", "0.0.0.0:9401"],
    );
    assert_eq!(code, Some(64), "{stderr}");
    assert!(stderr.contains("--synthetic-addr") && stderr.contains("loopback"), "{stderr}");
}
