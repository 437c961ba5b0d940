//! Signed raw records against the real apiserver and Kafka: collectors publish their Pod-bound
//! token once to the node-token directory and sign each record with the token's key
//! (`gpumedic_runtime::kafka::node_proof`). An enricher with `--node-auth=enforce` enriches A's
//! record signed with A's key, and B's record signed moments after B's token reached the
//! directory (it reads the directory to its end before refusing an unknown key id); it
//! dead-letters, with the reason: a record for B signed with A's key, A's record whose value was
//! changed after signing, a key id the directory never held, and a record signed with the key of
//! a forged token published to the directory.

use std::time::Duration;

use gpumedic_runtime::kafka::node_proof::{self, NodeKey, directory_key};
use gpumedic_runtime::kafka::{self, KafkaSettings, Producer, dlq_headers, publish, record_headers};
use gpumedic_runtime::testbed;
use gpumedic_schemas::health::{Component, Detail, Entity, Source, XidDetail};
use gpumedic_schemas::{EnrichedHealthEvent, HealthEvent};
use k8s_openapi::api::authentication::v1::TokenRequest;
use k8s_openapi::api::core::v1::{Namespace, Node, Pod, ServiceAccount};
use kube::api::{Api, DeleteParams, PostParams};
use serde_json::json;

const BIN: &str = env!("CARGO_BIN_EXE_gpumedic-enricher");
const COLLECTOR_SA: &str = "gpumedic-collector";

fn xid(node: &str, code: i32) -> HealthEvent {
    let detail = Detail::Xid(XidDetail {
        code,
        text: "GPU has fallen off the bus.".into(),
        pid: None,
        process: None,
        nvlink5: None,
        recovery_action: None,
    });
    HealthEvent::new(node, Source::KernelLog, Component::Gpu, Entity::default(), detail)
}

/// A collector's Pod on `node` and its Pod-bound token (audience gpumedic), as the kubelet
/// projects it.
async fn collector_token(client: &kube::Client, ns: &str, node: &str) -> String {
    let pods: Api<Pod> = Api::namespaced(client.clone(), ns);
    let pod = pods
        .create(
            &PostParams::default(),
            &serde_json::from_value(json!({ "metadata": { "name": format!("collector-{node}") }, "spec": {
                "nodeName": node, "serviceAccountName": COLLECTOR_SA, "automountServiceAccountToken": false,
                "containers": [{ "name": "c", "image": "x" }] } }))
            .unwrap(),
        )
        .await
        .expect("pod");
    let sas: Api<ServiceAccount> = Api::namespaced(client.clone(), ns);
    let request: TokenRequest = serde_json::from_value(json!({ "spec": {
        "audiences": ["gpumedic"], "expirationSeconds": 3600,
        "boundObjectRef": { "kind": "Pod", "apiVersion": "v1", "name": pod.metadata.name, "uid": pod.metadata.uid } } }))
    .unwrap();
    let answer = sas.create_token_request(COLLECTOR_SA, &PostParams::default(), &request).await.expect("token request");
    answer.status.and_then(|s| s.token).expect("a token")
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

/// The dead-letter reason of `event`'s record.
async fn dead_letter_reason(dlq: &str, event: &HealthEvent) -> String {
    let id = event.event_id.to_string();
    let dead = testbed::wait_for_record(
        dlq,
        |r| r.header(record_headers::EVENT_ID) == Some(id.as_bytes()),
        Duration::from_secs(60),
    )
    .await
    .unwrap_or_else(|e| panic!("{} was not dead-lettered: {e}", event.node));
    String::from_utf8_lossy(dead.header(dlq_headers::REASON).expect("reason")).into_owned()
}

/// Waits for `event`'s enriched record and checks it is `event`'s.
async fn enriched(topic: &str, event: &HealthEvent, what: &str) {
    let id = event.event_id.to_string();
    let out = testbed::wait_for_record(
        topic,
        |r| r.header(record_headers::EVENT_ID) == Some(id.as_bytes()),
        Duration::from_secs(60),
    )
    .await
    .unwrap_or_else(|e| panic!("{what}: {e}"));
    let enriched: EnrichedHealthEvent = gpumedic_schemas::decode(out.payload.as_deref().unwrap()).unwrap();
    assert_eq!(&enriched.event, event, "{what}");
}

#[tokio::test]
async fn a_signed_record_is_enriched_only_under_the_key_of_its_nodes_token() {
    let bootstrap = testbed::require_kafka().await.unwrap_or_else(|e| panic!("{e}"));
    let client = testbed::require_kubernetes().await.unwrap_or_else(|e| panic!("{e}"));
    let raw = testbed::unique_name("nodesig-raw");
    let enriched_topic = testbed::unique_name("nodesig-enriched");
    let directory = testbed::unique_name("nodesig-tokens");
    let dlq = kafka::dead_letter_topic(&raw);
    let settings =
        KafkaSettings { bootstrap: bootstrap.clone(), options: vec![], schema_registry: None, topic_replication: None };
    settings
        .ensure_topics(&kafka::stage_topics(&[&raw], &[&enriched_topic], gpumedic_schemas::topics::DEFAULT_PARTITIONS))
        .await
        .expect("topics");
    settings.ensure_topics(&[node_proof::directory_topic(&directory)]).await.expect("directory topic");

    let ns = testbed::unique_name("nodesig");
    let (node_a, node_b) = (testbed::unique_name("nodesig-a"), testbed::unique_name("nodesig-b"));
    let nodes: Api<Node> = Api::all(client.clone());
    for n in [&node_a, &node_b] {
        nodes
            .create(&PostParams::default(), &serde_json::from_value(json!({ "metadata": { "name": n } })).unwrap())
            .await
            .expect("node");
    }
    let namespaces: Api<Namespace> = Api::all(client.clone());
    namespaces
        .create(&PostParams::default(), &serde_json::from_value(json!({ "metadata": { "name": ns } })).unwrap())
        .await
        .expect("namespace");
    let sas: Api<ServiceAccount> = Api::namespaced(client.clone(), &ns);
    sas.create(
        &PostParams::default(),
        &serde_json::from_value(json!({ "metadata": { "name": COLLECTOR_SA } })).unwrap(),
    )
    .await
    .expect("service account");
    let token_a = collector_token(&client, &ns, &node_a).await;
    let token_b = collector_token(&client, &ns, &node_b).await;
    // A token of the right shape signed by nothing, claiming the collector on B for an hour.
    let b64 = |s: String| {
        use base64::Engine as _;
        base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(s)
    };
    let exp = chrono::Utc::now().timestamp() + 3600;
    let forged = format!(
        "{}.{}.c2lnbmF0dXJl",
        b64(r#"{"alg":"RS256","kid":"forged"}"#.into()),
        b64(format!(r#"{{"aud":["gpumedic"],"exp":{exp},"sub":"system:serviceaccount:{ns}:{COLLECTOR_SA}"}}"#))
    );

    let producer = settings.producer("nodesig-test").unwrap();
    // A's token and the forged one are in the directory before the enricher starts; B's after.
    publish_token(&producer, &directory, &node_a, token_a.as_bytes()).await;
    publish_token(&producer, &directory, &node_b, forged.as_bytes()).await;
    let mut enricher = testbed::ServiceProcess::start(
        BIN,
        &[],
        &[
            ("GPUMEDIC_KAFKA_BOOTSTRAP", bootstrap),
            ("GPUMEDIC_GROUP", testbed::unique_name("nodesig-enricher")),
            ("GPUMEDIC_RAW_TOPIC", raw.clone()),
            ("GPUMEDIC_ENRICHED_TOPIC", enriched_topic.clone()),
            ("GPUMEDIC_NODE_TOKENS_TOPIC", directory.clone()),
            ("GPUMEDIC_NODE_AUTH", "enforce".into()),
            ("GPUMEDIC_COLLECTOR_SERVICE_ACCOUNT", format!("{ns}:{COLLECTOR_SA}")),
            ("KUBECONFIG", testbed::kubeconfig_path().display().to_string()),
        ],
    )
    .expect("enricher starts");
    enricher.wait_ready(Duration::from_secs(60)).await.unwrap_or_else(|e| panic!("{e}"));

    let good_a = xid(&node_a, 79);
    let b_with_a = xid(&node_b, 79);
    let a_changed = xid(&node_a, 79);
    let b_unknown = xid(&node_b, 79);
    let b_forged = xid(&node_b, 79);
    let good_b = xid(&node_b, 79);
    send(&producer, &raw, &good_a, token_a.as_bytes()).await;
    send(&producer, &raw, &b_with_a, token_a.as_bytes()).await;
    // Signed, then its value changed (another Xid) before it was produced.
    let key_a = NodeKey::of(token_a.as_bytes());
    let signed_value = gpumedic_schemas::encode(&a_changed).unwrap();
    let signature = key_a.sign(node_a.as_bytes(), &signed_value);
    let mut changed = a_changed.clone();
    changed.detail = xid(&node_a, 48).detail;
    send_signed(&producer, &raw, &changed, key_a.id(), &signature).await;
    send(&producer, &raw, &b_unknown, b"a-token-never-published").await;
    send(&producer, &raw, &b_forged, forged.as_bytes()).await;
    // B's collector publishes its token, then signs at once (after the acknowledgement).
    publish_token(&producer, &directory, &node_b, token_b.as_bytes()).await;
    send(&producer, &raw, &good_b, token_b.as_bytes()).await;

    enriched(&enriched_topic, &good_a, "A's record signed with A's key is enriched").await;
    enriched(&enriched_topic, &good_b, "B's record signed as soon as B's token was published is enriched").await;
    assert_eq!(
        dead_letter_reason(&dlq, &b_with_a).await,
        format!("node token for node {node_a}, record claims {node_b}")
    );
    assert_eq!(dead_letter_reason(&dlq, &changed).await, "node signature does not match the record");
    let unknown = NodeKey::of(b"a-token-never-published");
    assert_eq!(
        dead_letter_reason(&dlq, &b_unknown).await,
        format!("node key id {} unknown to the node-token directory", unknown.id())
    );
    let forged_reason = dead_letter_reason(&dlq, &b_forged).await;
    assert!(forged_reason.starts_with("node token invalid"), "a forged token in the directory: {forged_reason}");

    let (_, metrics) = testbed::http_get(enricher.admin_addr(), "/metrics").await.expect("metrics");
    for reason in ["unknown_key", "bad_signature"] {
        assert!(
            metrics.lines().any(|l| l.starts_with("gpumedic_enricher_records_unauthenticated_total{")
                && l.contains(&format!("reason=\"{reason}\""))
                && l.ends_with(" 1")),
            "{reason} counted once: {metrics}"
        );
    }

    enricher.terminate(Duration::from_secs(15)).await.expect("stops on SIGTERM");
    for n in [&node_a, &node_b] {
        nodes.delete(n, &DeleteParams::default()).await.unwrap();
    }
    namespaces.delete(&ns, &DeleteParams::default()).await.unwrap();
}
