//! The enricher as a process against the real testbed, with the collector's own list of the pods
//! on an event's GPU (from the node's kubelet): an event that carries one is enriched with exactly
//! those pods, even when the `gpumedic.io/gpu-uuids` annotation says otherwise, and an empty list
//! means no pod; an event without one falls back to the annotation, as before.

mod common;

use std::time::Duration;

use common::Cluster;
use gpumedic_runtime::kafka::publish;
use gpumedic_schemas::health::GpuWorkload;
use gpumedic_schemas::{EnrichedHealthEvent, HealthEvent, topics};
use gpumedic_testkit as testkit;
use serde_json::json;

const GPU_A: &str = "GPU-aaaaaaaa-1b1b-1b1b-1b1b-0000000000aa";

fn xid_on_a(node: &str, workloads: Option<Vec<GpuWorkload>>) -> HealthEvent {
    let mut event = testkit::event(node).xid(79).text("GPU has fallen off the bus.").gpu(GPU_A).build();
    event.workloads = workloads;
    event
}

async fn enriched_of(event: &HealthEvent) -> EnrichedHealthEvent {
    common::enriched_of(event).await.1
}

fn pods(e: &EnrichedHealthEvent) -> Vec<(&str, &[String])> {
    let mut pods: Vec<(&str, &[String])> =
        e.workloads.iter().map(|w| (w.pod.as_str(), w.gpu_uuids.as_slice())).collect();
    pods.sort_unstable();
    pods
}

#[tokio::test]
async fn the_collectors_pods_win_over_the_annotation_and_without_them_the_annotation_is_used() {
    let settings = common::shared_topics().await;

    let node = testkit::unique_name("wl-node");
    let gpu_node = testkit::NodeBuilder::new(&node).capacity("nvidia.com/gpu", "8").allocatable("nvidia.com/gpu", "8");
    let cluster = Cluster::with_nodes("wl-ns", [gpu_node], &[]).await;
    let ns = cluster.ns.clone();
    // The annotation says GPU A is `annotated`'s; the kubelet (the collector's list) says it is
    // `assigned`'s, which has no annotation.
    for (pod, annotations) in [("annotated", json!({ "gpumedic.io/gpu-uuids": GPU_A })), ("assigned", json!({}))] {
        cluster.create_gpu_pod(pod, &node, "1", annotations).await;
    }

    let mut enricher = common::shared_topic_enricher(&settings, "enricher", &[]).await;

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
    cluster.delete().await;
}
