//! The enricher as a process against the real testbed, with the collector's own list of the pods
//! on an event's GPU (from the node's kubelet): an event that carries one is enriched with exactly
//! those pods, even when the `gpumedic.io/gpu-uuids` annotation says otherwise, and an empty list
//! means no pod; an event without one falls back to the annotation, as before.

use std::time::Duration;

use gpumedic_runtime::kafka::{KafkaSettings, publish, record_headers};
use gpumedic_runtime::testbed;
use gpumedic_schemas::health::{Component, Detail, Entity, GpuWorkload, Source, XidDetail};
use gpumedic_schemas::{EnrichedHealthEvent, HealthEvent, topics};
use k8s_openapi::api::core::v1::{Namespace, Node, Pod};
use kube::api::{Api, DeleteParams, PostParams};
use serde_json::json;

const BIN: &str = env!("CARGO_BIN_EXE_gpumedic-enricher");
const GPU_A: &str = "GPU-aaaaaaaa-1b1b-1b1b-1b1b-0000000000aa";

fn xid_on_a(node: &str, workloads: Option<Vec<GpuWorkload>>) -> HealthEvent {
    let detail = Detail::Xid(XidDetail {
        code: 79,
        text: "GPU has fallen off the bus.".into(),
        pid: None,
        process: None,
        nvlink5: None,
        recovery_action: None,
    });
    let entity = Entity { gpu_uuid: Some(GPU_A.into()), ..Default::default() };
    let mut event = HealthEvent::new(node, Source::KernelLog, Component::Gpu, entity, detail);
    event.workloads = workloads;
    event
}

async fn enriched_of(event: &HealthEvent) -> EnrichedHealthEvent {
    let id = event.event_id.to_string();
    let out = testbed::wait_for_record(
        topics::HEALTH_ENRICHED,
        |r| r.header(record_headers::EVENT_ID) == Some(id.as_bytes()),
        Duration::from_secs(60),
    )
    .await
    .unwrap_or_else(|e| panic!("{e}"));
    gpumedic_schemas::decode(out.payload.as_deref().unwrap()).expect("decodes")
}

fn pods(e: &EnrichedHealthEvent) -> Vec<(&str, &[String])> {
    let mut pods: Vec<(&str, &[String])> =
        e.workloads.iter().map(|w| (w.pod.as_str(), w.gpu_uuids.as_slice())).collect();
    pods.sort_unstable();
    pods
}

#[tokio::test]
async fn the_collectors_pods_win_over_the_annotation_and_without_them_the_annotation_is_used() {
    let bootstrap = testbed::require_kafka().await.unwrap_or_else(|e| panic!("{e}"));
    let client = testbed::require_kubernetes().await.unwrap_or_else(|e| panic!("{e}"));
    let settings =
        KafkaSettings { bootstrap: bootstrap.clone(), options: vec![], schema_registry: None, topic_replication: None };
    settings
        .ensure_topics(&gpumedic_runtime::kafka::stage_topics(&[topics::HEALTH_RAW], &[topics::HEALTH_ENRICHED], 12))
        .await
        .expect("topics");

    let node = testbed::unique_name("wl-node");
    let ns = testbed::unique_name("wl-ns");
    let nodes: Api<Node> = Api::all(client.clone());
    nodes
        .create(
            &PostParams::default(),
            &serde_json::from_value(json!({ "metadata": { "name": node },
                "status": { "capacity": { "nvidia.com/gpu": "8" }, "allocatable": { "nvidia.com/gpu": "8" } } }))
            .unwrap(),
        )
        .await
        .expect("node");
    let namespaces: Api<Namespace> = Api::all(client.clone());
    namespaces
        .create(&PostParams::default(), &serde_json::from_value(json!({ "metadata": { "name": ns } })).unwrap())
        .await
        .unwrap();
    let pod_api: Api<Pod> = Api::namespaced(client.clone(), &ns);
    // The annotation says GPU A is `annotated`'s; the kubelet (the collector's list) says it is
    // `assigned`'s, which has no annotation.
    for (pod, annotations) in [("annotated", json!({ "gpumedic.io/gpu-uuids": GPU_A })), ("assigned", json!({}))] {
        pod_api
            .create(
                &PostParams::default(),
                &serde_json::from_value(json!({ "metadata": { "name": pod, "annotations": annotations },
                    "spec": { "nodeName": node, "containers": [{ "name": "c", "image": "x",
                        "resources": { "limits": { "nvidia.com/gpu": "1" } } }] } }))
                .unwrap(),
            )
            .await
            .expect("pod");
    }

    let mut enricher = testbed::ServiceProcess::start(
        BIN,
        &[],
        &[
            ("GPUMEDIC_KAFKA_BOOTSTRAP", bootstrap),
            ("GPUMEDIC_GROUP", testbed::group_at_end("enricher", &[topics::HEALTH_RAW]).await.expect("group")),
            ("KUBECONFIG", testbed::kubeconfig_path().display().to_string()),
        ],
    )
    .expect("enricher starts");
    enricher.wait_ready(Duration::from_secs(60)).await.unwrap_or_else(|e| panic!("{e}"));

    let held = |container: &str| GpuWorkload {
        namespace: ns.clone(),
        pod: "assigned".into(),
        container: container.into(),
        gpu_uuids: vec![GPU_A.into()],
    };
    // Two containers of one pod on the GPU: one pod in the enriched event.
    let carried = xid_on_a(&node, Some(vec![held("main"), held("sidecar")]));
    let none_on_it = xid_on_a(&node, Some(Vec::new()));
    let without = xid_on_a(&node, None);
    let producer = settings.producer("enricher-workloads-test").unwrap();
    for event in [&carried, &none_on_it, &without] {
        publish(&producer, topics::HEALTH_RAW, &node, &gpumedic_schemas::encode(event).unwrap(), &[])
            .await
            .expect("produced");
    }

    let enriched = enriched_of(&carried).await;
    assert_eq!(enriched.event, carried, "the raw event is carried unchanged, its list included");
    let a = vec![GPU_A.to_owned()];
    assert_eq!(pods(&enriched), [("assigned", a.as_slice())], "exactly the collector's pods");
    assert_eq!(enriched.workloads[0].namespace, ns);

    let enriched = enriched_of(&none_on_it).await;
    assert!(enriched.workloads.is_empty(), "the kubelet says no pod uses the GPU: {:?}", enriched.workloads);

    let enriched = enriched_of(&without).await;
    let none: &[String] = &[];
    assert_eq!(
        pods(&enriched),
        [("annotated", a.as_slice()), ("assigned", none)],
        "no list: the annotated pod, and the pod whose GPUs are unknown"
    );

    enricher.terminate(Duration::from_secs(15)).await.expect("stops");
    namespaces.delete(&ns, &DeleteParams::default()).await.ok();
    nodes.delete(&node, &DeleteParams::default()).await.ok();
}
