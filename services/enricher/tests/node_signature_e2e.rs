//! Signed raw records against the real apiserver and Kafka: collectors publish their Pod-bound
//! token once to the node-token directory and sign each record with the token's key
//! (`gpumedic_runtime::kafka::node_proof`). An enricher with `--node-auth=enforce` enriches A's
//! record signed with A's key, and B's record signed moments after B's token reached the
//! directory (it reads the directory to its end before refusing an unknown key id); it
//! dead-letters, with the reason: a record for B signed with A's key, A's record whose value was
//! changed after signing, a key id the directory never held, and a record signed with the key of
//! a forged token published to the directory.

mod common;

use std::time::Duration;

use common::{Cluster, Topics, dead_letter_reason, refused};
use gpumedic_runtime::kafka::node_proof::{self, NodeKey, directory_key};
use gpumedic_runtime::kafka::{Producer, publish, record_headers};
use gpumedic_schemas::{EnrichedHealthEvent, HealthEvent};
use gpumedic_testkit as testkit;

fn xid(node: &str, code: i32) -> HealthEvent {
    testkit::event(node).xid(code).text("GPU has fallen off the bus.").build()
}

/// Publishes `token` to the directory as `node`'s, as the collector does.
async fn publish_token(producer: &Producer, directory: &str, node: &str, token: &[u8]) {
    let key = directory_key(node, NodeKey::of(token).id());
    publish(producer, directory, &key, token, &[]).await.expect("directory entry");
}

/// Produces `event` keyed by its node, with key id `id` and `signature`.
async fn send_signed(producer: &Producer, topic: &str, event: &HealthEvent, id: &str, signature: &[u8]) {
    let payload = gpumedic_schemas::encode(event).unwrap();
    let event_id = event.event_id.to_string();
    let headers: [(&str, &[u8]); 3] = [
        (record_headers::EVENT_ID, event_id.as_bytes()),
        (record_headers::NODE_KEY_ID, id.as_bytes()),
        (record_headers::NODE_SIGNATURE, signature),
    ];
    publish(producer, topic, &event.node, &payload, &headers).await.expect("produced");
}

/// Produces `event` signed with `token`'s key, as the collector does.
async fn send(producer: &Producer, topic: &str, event: &HealthEvent, token: &[u8]) {
    let key = NodeKey::of(token);
    let signature = key.sign(event.node.as_bytes(), &gpumedic_schemas::encode(event).unwrap());
    send_signed(producer, topic, event, key.id(), &signature).await;
}

/// Waits for `event`'s enriched record and checks it is `event`'s.
async fn enriched(topic: &str, event: &HealthEvent, what: &str) {
    let out = testkit::wait_for_event(topic, &event.event_id.to_string(), Duration::from_secs(60))
        .await
        .unwrap_or_else(|e| panic!("{what}: {e}"));
    let enriched: EnrichedHealthEvent = gpumedic_schemas::decode(out.payload.as_deref().unwrap()).unwrap();
    assert_eq!(&enriched.event, event, "{what}");
}

#[tokio::test]
async fn a_signed_record_is_enriched_only_under_the_key_of_its_nodes_token() {
    let topics = Topics::create("nodesig").await;
    let directory = testkit::unique_name("nodesig-tokens");
    topics.settings.ensure_topics(&[node_proof::directory_topic(&directory)]).await.expect("directory topic");
    let cluster = Cluster::create("nodesig", 2, &[common::COLLECTOR_SA]).await;
    let (node_a, node_b) = (cluster.nodes[0].clone(), cluster.nodes[1].clone());
    let token_a = cluster.collector_token(&node_a).await;
    let token_b = cluster.collector_token(&node_b).await;
    let forged = cluster.forged_token();

    let producer = topics.settings.producer("nodesig-test").unwrap();
    // A's token and the forged one are in the directory before the enricher starts; B's after.
    publish_token(&producer, &directory, &node_a, token_a.as_bytes()).await;
    publish_token(&producer, &directory, &node_b, forged.as_bytes()).await;
    let mut enricher =
        topics.enforcing_enricher(&cluster.ns, &[("GPUMEDIC_NODE_TOKENS_TOPIC", directory.clone())]).await;

    let good_a = xid(&node_a, 79);
    let b_with_a = xid(&node_b, 79);
    let a_changed = xid(&node_a, 79);
    let b_unknown = xid(&node_b, 79);
    let b_forged = xid(&node_b, 79);
    let good_b = xid(&node_b, 79);
    let raw = &topics.raw;
    send(&producer, raw, &good_a, token_a.as_bytes()).await;
    send(&producer, raw, &b_with_a, token_a.as_bytes()).await;
    // Signed, then its value changed (another Xid) before it was produced.
    let key_a = NodeKey::of(token_a.as_bytes());
    let signature = key_a.sign(node_a.as_bytes(), &gpumedic_schemas::encode(&a_changed).unwrap());
    let mut changed = a_changed.clone();
    changed.detail = xid(&node_a, 48).detail;
    send_signed(&producer, raw, &changed, key_a.id(), &signature).await;
    send(&producer, raw, &b_unknown, b"a-token-never-published").await;
    send(&producer, raw, &b_forged, forged.as_bytes()).await;
    // B's collector publishes its token, then signs at once (after the acknowledgement).
    publish_token(&producer, &directory, &node_b, token_b.as_bytes()).await;
    send(&producer, raw, &good_b, token_b.as_bytes()).await;

    enriched(&topics.enriched, &good_a, "A's record signed with A's key is enriched").await;
    enriched(&topics.enriched, &good_b, "B's record signed as soon as B's token was published is enriched").await;
    let dlq = &topics.dlq;
    assert_eq!(
        dead_letter_reason(dlq, &b_with_a).await,
        format!("node token for node {node_a}, record claims {node_b}")
    );
    assert_eq!(dead_letter_reason(dlq, &changed).await, "node signature does not match the record");
    let unknown = NodeKey::of(b"a-token-never-published");
    assert_eq!(
        dead_letter_reason(dlq, &b_unknown).await,
        format!("node key id {} unknown to the node-token directory", unknown.id())
    );
    let forged_reason = dead_letter_reason(dlq, &b_forged).await;
    assert!(forged_reason.starts_with("node token invalid"), "a forged token in the directory: {forged_reason}");

    let (_, metrics) = testkit::http_get(enricher.admin_addr(), "/metrics").await.expect("metrics");
    assert_eq!(refused(&metrics, Some(&node_b), "unknown_key"), 1.0, "{metrics}");
    assert_eq!(refused(&metrics, Some(&node_a), "bad_signature"), 1.0, "{metrics}");

    enricher.terminate(Duration::from_secs(15)).await.expect("stops on SIGTERM");
    cluster.delete().await;
}
