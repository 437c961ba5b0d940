//! The enricher as a process against the real testbed: a raw event for a known node comes out
//! enriched with the node's labels, its GPU pods and the Xid catalog; an event for an unknown
//! node comes out marked; garbage bytes go to the dead-letter topic with the reason.

use std::time::Duration;

use gpumedic_runtime::kafka::{KafkaSettings, Producer, dlq_headers, publish, record_headers};
use gpumedic_runtime::testbed;
use gpumedic_schemas::health::{Component, Detail, Entity, Source, XidDetail};
use gpumedic_schemas::{EnrichedHealthEvent, HealthEvent, topics};
use k8s_openapi::api::core::v1::{Namespace, Node, Pod};
use kube::api::{Api, DeleteParams, PostParams};
use serde_json::json;

const BIN: &str = env!("CARGO_BIN_EXE_gpumedic-enricher");

fn xid_event(node: &str, code: i32) -> HealthEvent {
    let detail = Detail::Xid(XidDetail {
        code,
        text: "GPU has fallen off the bus.".into(),
        pid: None,
        process: None,
        nvlink5: None,
        recovery_action: None,
    });
    let entity = Entity { gpu_uuid: Some("GPU-11111111-2222-3333-4444-555555555555".into()), ..Default::default() };
    HealthEvent::new(node, Source::KernelLog, Component::Gpu, entity, detail)
}

async fn send(producer: &Producer, key: &str, payload: &[u8]) {
    publish(producer, topics::HEALTH_RAW, key, payload, &[]).await.expect("produced");
}

#[tokio::test]
async fn raw_events_come_out_enriched_and_garbage_is_dead_lettered() {
    let bootstrap = testbed::require_kafka().await.unwrap_or_else(|e| panic!("{e}"));
    let client = testbed::require_kubernetes().await.unwrap_or_else(|e| panic!("{e}"));
    let settings = KafkaSettings { bootstrap: bootstrap.clone(), options: vec![], schema_registry: None };
    settings
        .ensure_topics(&gpumedic_runtime::kafka::stage_topics(&[topics::HEALTH_RAW], &[topics::HEALTH_ENRICHED], 12))
        .await
        .expect("topics");

    // A labelled GPU node with a GPU pod on it.
    let node = testbed::unique_name("enr-node");
    let ns = testbed::unique_name("enr-ns");
    let nodes: Api<Node> = Api::all(client.clone());
    nodes
        .create(
            &PostParams::default(),
            &serde_json::from_value(json!({ "metadata": { "name": node, "labels": {
                "node.kubernetes.io/instance-type": "p5.48xlarge", "nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3",
                "topology.kubernetes.io/zone": "us-east-1a", "nvidia.com/cuda.driver-version.full": "570.86.15" } } }))
            .unwrap(),
        )
        .await
        .expect("node");
    let namespaces: Api<Namespace> = Api::all(client.clone());
    namespaces
        .create(&PostParams::default(), &serde_json::from_value(json!({ "metadata": { "name": ns } })).unwrap())
        .await
        .unwrap();
    let pods: Api<Pod> = Api::namespaced(client.clone(), &ns);
    pods.create(
        &PostParams::default(),
        &serde_json::from_value(json!({ "metadata": { "name": "trainer-0" }, "spec": { "nodeName": node,
            "containers": [{ "name": "c", "image": "x", "resources": { "limits": { "nvidia.com/gpu": "8" } } }] } }))
        .unwrap(),
    )
    .await
    .expect("pod");

    let mut enricher = testbed::ServiceProcess::start(
        BIN,
        &[],
        &[
            ("GPUMEDIC_KAFKA_BOOTSTRAP", bootstrap),
            // At the end of the shared topic: not behind every record earlier runs left there.
            ("GPUMEDIC_GROUP", testbed::group_at_end("enricher", &[topics::HEALTH_RAW]).await.expect("group")),
            ("GPUMEDIC_CLUSTER_NAME", "testbed".into()),
            ("KUBECONFIG", testbed::kubeconfig_path().display().to_string()),
        ],
    )
    .expect("enricher starts");
    enricher.wait_ready(Duration::from_secs(60)).await.unwrap_or_else(|e| panic!("{e}"));

    let producer = settings.producer("enricher-test").unwrap();
    let known = xid_event(&node, 79);
    let unknown_node = testbed::unique_name("enr-unknown");
    let unknown = xid_event(&unknown_node, 13);
    send(&producer, &node, &gpumedic_schemas::encode(&known).unwrap()).await;
    send(&producer, &unknown_node, &gpumedic_schemas::encode(&unknown).unwrap()).await;
    let garbage_key = format!("{node}-garbage");
    send(&producer, &garbage_key, b"\x07not avro at all").await;

    let out = testbed::wait_for_record(
        topics::HEALTH_ENRICHED,
        |r| r.key.as_deref() == Some(node.as_bytes()),
        Duration::from_secs(60),
    )
    .await
    .unwrap_or_else(|e| panic!("{e}"));
    let enriched: EnrichedHealthEvent = gpumedic_schemas::decode(out.payload.as_deref().unwrap()).expect("decodes");
    assert_eq!(enriched.event, known, "the raw event is carried unchanged");
    assert!(!enriched.node_unknown);
    assert_eq!(enriched.node_context.instance_type.as_deref(), Some("p5.48xlarge"));
    assert_eq!(enriched.node_context.gpu_product.as_deref(), Some("NVIDIA-H100-80GB-HBM3"));
    assert_eq!(enriched.node_context.driver_version.as_deref(), Some("570.86.15"));
    assert_eq!(enriched.node_context.cluster.as_deref(), Some("testbed"));
    assert_eq!(enriched.xid_catalog.as_ref().map(|c| c.name.as_str()), Some("GPU has fallen off the bus"));
    assert_eq!(enriched.workloads.len(), 1);
    assert_eq!(
        (enriched.workloads[0].namespace.as_str(), enriched.workloads[0].pod.as_str()),
        (ns.as_str(), "trainer-0")
    );
    assert!(out.header(record_headers::TRACEPARENT).is_some_and(|t| t.starts_with(b"00-")));
    assert_eq!(out.header(record_headers::EVENT_ID), Some(known.event_id.to_string().as_bytes()));

    let out = testbed::wait_for_record(
        topics::HEALTH_ENRICHED,
        |r| r.key.as_deref() == Some(unknown_node.as_bytes()),
        Duration::from_secs(60),
    )
    .await
    .unwrap_or_else(|e| panic!("{e}"));
    let enriched: EnrichedHealthEvent = gpumedic_schemas::decode(out.payload.as_deref().unwrap()).unwrap();
    assert!(enriched.node_unknown, "an unknown node is passed on, marked");
    assert!(enriched.workloads.is_empty());

    let dead = testbed::wait_for_record(
        &gpumedic_runtime::kafka::dead_letter_topic(topics::HEALTH_RAW),
        |r| r.key.as_deref() == Some(garbage_key.as_bytes()),
        Duration::from_secs(60),
    )
    .await
    .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(dead.payload.as_deref(), Some(&b"\x07not avro at all"[..]));
    let reason = String::from_utf8_lossy(dead.header(dlq_headers::REASON).unwrap()).into_owned();
    assert!(reason.starts_with("wrong_magic_byte"), "{reason}");
    assert_eq!(dead.header(dlq_headers::SERVICE), Some(&b"enricher"[..]));

    enricher.terminate(Duration::from_secs(15)).await.expect("stops on SIGTERM");
    nodes.delete(&node, &DeleteParams::default()).await.unwrap();
    namespaces.delete(&ns, &DeleteParams::default()).await.unwrap();
}
