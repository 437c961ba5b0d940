//! The node token on the collector's records, through the binary and the real Kafka: every raw
//! record carries the token file's content in `gpumedic.node-token`; a record spooled while Kafka
//! was unreachable leaves with the token current when it is sent, not the one of when it was
//! spooled; a token the kubelet rotates reaches the next records without a restart; and
//! `--require-node-token` refuses to start without the file. With `--node-auth-proof signature`
//! (the default), the token is published to the node-token directory and records carry its key id
//! and a signature that verifies under the token's key, the token itself only until the directory
//! has taken it.

mod common;

use std::time::Duration;

use common::CollectorEnv;
use gpumedic_runtime::kafka::node_proof::{NodeKey, directory_key};
use gpumedic_runtime::kafka::{Record, record_headers};
use gpumedic_schemas::topics;
use gpumedic_testkit as testkit;

/// Injects one Xid through the synthetic endpoint; its event id once it is spooled or published.
async fn inject(addr: std::net::SocketAddr) -> String {
    common::inject_ids(addr, r#"{"xid": 79}"#).await.swap_remove(0)
}

/// The raw record of event `id`.
async fn record_of(id: &str) -> Record {
    testkit::wait_for_event(topics::HEALTH_RAW, id, Duration::from_secs(60)).await.unwrap_or_else(|e| panic!("{e}"))
}

/// The node token header of the raw record of event `id`.
async fn token_of(id: &str) -> Vec<u8> {
    record_of(id).await.header(record_headers::NODE_TOKEN).expect("a node token header").to_vec()
}

/// Starts a collector for `node` with fault injection on, the proof flag `proof` set, and waits
/// until it is ready; the process and its injection address.
async fn start_with_addr(
    bootstrap: String,
    node: &str,
    state: &std::path::Path,
    token: &std::path::Path,
    proof: (&'static str, String),
) -> (testkit::ServiceProcess, std::net::SocketAddr) {
    let synthetic = testkit::free_local_addr().expect("a free port");
    let collector = CollectorEnv::new(bootstrap, node, state)
        .set("GPUMEDIC_SYNTHETIC_ADDR", synthetic.to_string())
        .set("GPUMEDIC_DELIVERY_TIMEOUT", "2s")
        .set("GPUMEDIC_NODE_TOKEN_FILE", token.display().to_string())
        .set("GPUMEDIC_REQUIRE_NODE_TOKEN", "true")
        .set(proof.0, proof.1)
        .start()
        .await;
    (collector, synthetic)
}

#[tokio::test]
async fn records_carry_the_token_of_when_they_are_sent() {
    let bootstrap = testkit::require_kafka().await.unwrap_or_else(|e| panic!("{e}"));
    let node = testkit::unique_name("token-node");
    let dir = common::scratch("collector-token");
    let (state, token) = (dir.join("state"), dir.join("token"));
    std::fs::write(&token, "token-of-the-outage\n").unwrap();

    // Kafka unreachable (nothing listens there): the event is spooled.
    let nowhere = testkit::free_local_addr().expect("a free port").to_string();
    let token_mode = ("GPUMEDIC_NODE_AUTH_PROOF", "token".to_owned());
    let (mut collector, addr) = start_with_addr(nowhere, &node, &state, &token, token_mode.clone()).await;
    let spooled = inject(addr).await;
    collector.terminate(Duration::from_secs(15)).await.expect("stops");

    // The kubelet rotated the token meanwhile; Kafka is back.
    std::fs::write(&token, "token-after-the-outage\n").unwrap();
    let (mut collector, addr) = start_with_addr(bootstrap.clone(), &node, &state, &token, token_mode).await;
    let direct = inject(addr).await;
    assert_eq!(token_of(&spooled).await, b"token-after-the-outage", "a spooled record leaves with today's token");
    assert_eq!(token_of(&direct).await, b"token-after-the-outage");

    // Rotated while running: a later record carries the new token, without a restart.
    std::fs::write(&token, "token-rotated-while-running\n").unwrap();
    let mut rotated = false;
    for _ in 0..40 {
        let id = inject(addr).await;
        if token_of(&id).await == b"token-rotated-while-running" {
            rotated = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    assert!(rotated, "the rotated token reached the records");
    collector.terminate(Duration::from_secs(15)).await.expect("stops");

    // Required and missing: a configuration error, exit 64.
    let stderr = common::refused(&["--node-token-file", "/nonexistent/gpumedic/token", "--require-node-token"]);
    assert!(stderr.contains("--node-token-file") && stderr.contains("/nonexistent/gpumedic/token"), "{stderr}");
    std::fs::remove_dir_all(&dir).ok();
}

#[tokio::test]
async fn signed_records_name_a_token_the_directory_holds() {
    let bootstrap = testkit::require_kafka().await.unwrap_or_else(|e| panic!("{e}"));
    let node = testkit::unique_name("signing-node");
    let directory = testkit::unique_name("node-tokens");
    let dir = common::scratch("collector-signing");
    let (state, token) = (dir.join("state"), dir.join("token"));
    std::fs::write(&token, "first-token\n").unwrap();
    let signature_mode = ("GPUMEDIC_NODE_TOKENS_TOPIC", directory.clone());
    let (mut collector, addr) = start_with_addr(bootstrap, &node, &state, &token, signature_mode).await;

    // Signed once the directory holds the token: until then a record may carry the token.
    let signed_with = |token: &'static [u8]| {
        let node = node.clone();
        move |r: &Record| {
            let key = NodeKey::of(token);
            r.header(record_headers::NODE_TOKEN).is_none()
                && r.header(record_headers::NODE_KEY_ID) == Some(key.id().as_bytes())
                && key.verify(
                    node.as_bytes(),
                    r.payload.as_deref().unwrap_or_default(),
                    r.header(record_headers::NODE_SIGNATURE).unwrap_or_default(),
                )
        }
    };
    let mut signed = false;
    for _ in 0..40 {
        let record = record_of(&inject(addr).await).await;
        if record.header(record_headers::NODE_TOKEN).is_none() {
            assert!(signed_with(b"first-token")(&record), "a record without the token is signed with its key");
            signed = true;
            break;
        }
        assert_eq!(record.header(record_headers::NODE_TOKEN), Some(&b"first-token"[..]));
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    assert!(signed, "records are signed once the directory took the token");
    let first = NodeKey::of(b"first-token");
    let entry = testkit::wait_for_record(
        &directory,
        |r| r.key.as_deref() == Some(directory_key(&node, first.id()).as_bytes()),
        Duration::from_secs(30),
    )
    .await
    .unwrap_or_else(|e| panic!("the directory holds the token: {e}"));
    assert_eq!(entry.payload.as_deref(), Some(&b"first-token"[..]));

    // Rotated: the new token reaches the directory, then the signatures.
    std::fs::write(&token, "second-token\n").unwrap();
    let mut rotated = false;
    for _ in 0..40 {
        let record = record_of(&inject(addr).await).await;
        if signed_with(b"second-token")(&record) {
            rotated = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    assert!(rotated, "records are signed with the rotated token's key");
    let second = NodeKey::of(b"second-token");
    testkit::wait_for_record(
        &directory,
        |r| r.key.as_deref() == Some(directory_key(&node, second.id()).as_bytes()),
        Duration::from_secs(30),
    )
    .await
    .unwrap_or_else(|e| panic!("the directory holds the rotated token: {e}"));
    collector.terminate(Duration::from_secs(15)).await.expect("stops");
    std::fs::remove_dir_all(&dir).ok();
}
