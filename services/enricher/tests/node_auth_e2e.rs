//! Node authentication against the real apiserver and Kafka: in a namespace of its own, the
//! collector's ServiceAccount, Pods bound to nodes A and B, and Pod-bound tokens minted with
//! TokenRequest, as the kubelet mints the collector's. An enricher with `--node-auth=enforce`
//! enriches A's record carrying A's token, and dead-letters, with the reason and a count per
//! claimed node: a record for B carrying A's token, one whose key names another node than its
//! token, one with no token, a garbage and a forged token, the token of a Pod since deleted, and
//! a token of another ServiceAccount on node A. Nothing claimed for B is enriched except B's own
//! record with B's token, and an operator's (`--operator-service-account`, bound to no node),
//! which is counted.

mod common;

use std::time::Duration;

use common::{COLLECTOR_SA, Cluster, Topics, dead_letter_reason};
use gpumedic_runtime::kafka::{Producer, publish, record_headers};
use gpumedic_schemas::{EnrichedHealthEvent, HealthEvent};
use gpumedic_testkit as testkit;
use k8s_openapi::api::authentication::v1::TokenRequest;
use k8s_openapi::api::core::v1::{Pod, ServiceAccount};
use kube::api::{Api, DeleteParams, PostParams};
use serde_json::json;

fn xid(node: &str) -> HealthEvent {
    testkit::event(node).xid(79).text("GPU has fallen off the bus.").build()
}

async fn send(producer: &Producer, topic: &str, key: &str, event: &HealthEvent, token: Option<&[u8]>) {
    let payload = gpumedic_schemas::encode(event).unwrap();
    let id = event.event_id.to_string();
    let mut headers: Vec<(&str, &[u8])> = vec![(record_headers::EVENT_ID, id.as_bytes())];
    if let Some(t) = token {
        headers.push((record_headers::NODE_TOKEN, t));
    }
    publish(producer, topic, key, &payload, &headers).await.expect("produced");
}

#[tokio::test]
async fn a_record_is_enriched_only_with_a_token_of_the_collector_on_the_node_it_claims() {
    let topics = Topics::create("nodeauth").await;
    let (raw, enriched_topic, dlq) = (topics.raw.clone(), topics.enriched.clone(), topics.dlq.clone());
    let cluster = Cluster::create("nodeauth", 2, &[COLLECTOR_SA, "trainer", "operator"]).await;
    let (ns, client) = (cluster.ns.clone(), cluster.client.clone());
    let (node_a, node_b) = (cluster.nodes[0].clone(), cluster.nodes[1].clone());
    let sas: Api<ServiceAccount> = Api::namespaced(client.clone(), &ns);
    let pods: Api<Pod> = Api::namespaced(client.clone(), &ns);
    let on_a = cluster.create_pod("collector-a", &node_a, COLLECTOR_SA).await;
    let on_b = cluster.create_pod("collector-b", &node_b, COLLECTOR_SA).await;
    let gone = cluster.create_pod("collector-gone", &node_a, COLLECTOR_SA).await;
    let trainer = cluster.create_pod("trainer-a", &node_a, "trainer").await;
    let token_a = cluster.pod_token(COLLECTOR_SA, &on_a).await;
    let token_b = cluster.pod_token(COLLECTOR_SA, &on_b).await;
    let token_gone = cluster.pod_token(COLLECTOR_SA, &gone).await;
    let token_trainer = cluster.pod_token("trainer", &trainer).await;
    // An operator's token, as `kubectl create token operator --audience gpumedic` mints it.
    let operator_request: TokenRequest =
        serde_json::from_value(json!({ "spec": { "audiences": ["gpumedic"], "expirationSeconds": 600 } })).unwrap();
    let token_operator = sas
        .create_token_request("operator", &PostParams::default(), &operator_request)
        .await
        .expect("token request")
        .status
        .and_then(|s| s.token)
        .expect("a token");
    pods.delete("collector-gone", &DeleteParams { grace_period_seconds: Some(0), ..DeleteParams::default() })
        .await
        .expect("delete");
    // No kubelet finalizes it: gone once the apiserver no longer has it.
    for _ in 0..100 {
        if pods.get_opt("collector-gone").await.expect("get").is_none() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(pods.get_opt("collector-gone").await.expect("get").is_none(), "the pod is deleted");

    let mut enricher =
        topics.enforcing_enricher(&ns, &[("GPUMEDIC_OPERATOR_SERVICE_ACCOUNT", format!("{ns}:operator"))]).await;

    let producer = topics.settings.producer("nodeauth-test").unwrap();
    // A signed-by-nothing token of the right shape, claiming to be valid for an hour.
    let forged = cluster.forged_token();
    let good_a = xid(&node_a);
    let b_with_a = xid(&node_b);
    let key_b_token_a = xid(&node_a);
    let b_without = xid(&node_b);
    let b_garbage = xid(&node_b);
    let b_forged = xid(&node_b);
    let a_gone = xid(&node_a);
    let a_trainer = xid(&node_a);
    let unknown_node = testkit::unique_name("nodeauth-nowhere");
    let nowhere_with_a = xid(&unknown_node);
    let operator_b = xid(&node_b);
    let good_b = xid(&node_b);
    send(&producer, &raw, &node_a, &good_a, Some(token_a.as_bytes())).await;
    send(&producer, &raw, &node_b, &b_with_a, Some(token_a.as_bytes())).await;
    send(&producer, &raw, &node_b, &key_b_token_a, Some(token_a.as_bytes())).await;
    send(&producer, &raw, &node_b, &b_without, None).await;
    send(&producer, &raw, &node_b, &b_garbage, Some(b"garbage")).await;
    send(&producer, &raw, &node_b, &b_forged, Some(forged.as_bytes())).await;
    send(&producer, &raw, &node_a, &a_gone, Some(token_gone.as_bytes())).await;
    send(&producer, &raw, &node_a, &a_trainer, Some(token_trainer.as_bytes())).await;
    send(&producer, &raw, &unknown_node, &nowhere_with_a, Some(token_a.as_bytes())).await;
    send(&producer, &raw, &node_b, &operator_b, Some(token_operator.as_bytes())).await;
    // Last on B's key: once it is out, every record before it on that key has been handled.
    send(&producer, &raw, &node_b, &good_b, Some(token_b.as_bytes())).await;

    // A's record with A's token is enriched.
    let id = good_a.event_id.to_string();
    let out = testkit::wait_for_event(&enriched_topic, &id, Duration::from_secs(60))
        .await
        .unwrap_or_else(|e| panic!("A's own record is enriched: {e}"));
    let enriched: EnrichedHealthEvent = gpumedic_schemas::decode(out.payload.as_deref().unwrap()).unwrap();
    assert_eq!(enriched.event, good_a);

    // B's output is B's own record alone.
    let refused_ids: Vec<String> = [&b_with_a, &key_b_token_a, &b_without, &b_garbage, &b_forged, &a_gone, &a_trainer]
        .iter()
        .map(|e| e.event_id.to_string())
        .collect();
    let good_b_id = good_b.event_id.to_string();
    let mut leaked = Vec::new();
    testkit::wait_for_record(
        &enriched_topic,
        |r| {
            let id = String::from_utf8_lossy(r.header(record_headers::EVENT_ID).unwrap_or_default()).into_owned();
            if refused_ids.contains(&id) {
                leaked.push(id.clone());
            }
            id == good_b_id
        },
        Duration::from_secs(60),
    )
    .await
    .unwrap_or_else(|e| panic!("B's own record with B's token is enriched: {e}"));
    assert!(leaked.is_empty(), "records without a valid token of their node were enriched: {leaked:?}");
    let operator_id = operator_b.event_id.to_string();
    testkit::wait_for_event(&enriched_topic, &operator_id, Duration::from_secs(60))
        .await
        .unwrap_or_else(|e| panic!("the operator may speak for any node: {e}"));

    // Each refused record is dead-lettered with its reason.
    assert_eq!(
        dead_letter_reason(&dlq, &b_with_a).await,
        format!("node token for node {node_a}, record claims {node_b}")
    );
    assert_eq!(
        dead_letter_reason(&dlq, &key_b_token_a).await,
        format!("node token for node {node_a}, record claims {node_b}"),
        "the key must name the token's node as well"
    );
    assert_eq!(dead_letter_reason(&dlq, &b_without).await, "node token missing");
    let garbage = dead_letter_reason(&dlq, &b_garbage).await;
    assert!(garbage.starts_with("node token invalid"), "{garbage}");
    let forged_reason = dead_letter_reason(&dlq, &b_forged).await;
    assert!(forged_reason.starts_with("node token invalid"), "a token signed by nothing: {forged_reason}");
    let gone_reason = dead_letter_reason(&dlq, &a_gone).await;
    assert!(
        gone_reason.starts_with("node token invalid"),
        "the token of a deleted pod is no longer valid: {gone_reason}"
    );
    assert_eq!(
        dead_letter_reason(&dlq, &a_trainer).await,
        format!("node token not the collector's service account: system:serviceaccount:{ns}:trainer")
    );
    assert_eq!(
        dead_letter_reason(&dlq, &nowhere_with_a).await,
        format!("node token for node {node_a}, record claims {unknown_node}")
    );

    // Counted per claimed node; a node the cluster does not know is one label.
    let (_, metrics) = testkit::http_get(enricher.admin_addr(), "/metrics").await.expect("metrics");
    let count = |node: &str, reason: &str| common::refused(&metrics, Some(node), reason);
    // Labelled with the record's node field: the record keyed B but claiming A counts under A.
    assert_eq!(count(&node_b, "wrong_node"), 1.0, "{metrics}");
    assert_eq!(count(&node_a, "wrong_node"), 1.0);
    assert_eq!(count(&node_b, "missing"), 1.0);
    assert_eq!(count(&node_b, "invalid"), 2.0);
    assert_eq!(count(&node_a, "invalid"), 1.0);
    assert_eq!(count(&node_a, "not_collector"), 1.0);
    assert_eq!(count("unknown", "wrong_node"), 1.0);
    assert!(!metrics.contains(&unknown_node), "a claimed name the cluster does not know is not a label");
    assert!(metrics.lines().any(|l| l == "gpumedic_enricher_records_operator_total 1"), "{metrics}");

    enricher.terminate(Duration::from_secs(15)).await.expect("stops on SIGTERM");
    cluster.delete().await;
}
