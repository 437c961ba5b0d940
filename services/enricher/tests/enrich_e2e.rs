//! The enricher as a process against the real testbed: a raw event for a known node comes out
//! enriched with the node's labels, its expected GPU count, its GPU pods and the Xid catalog; after
//! the node's GPU inventory, a kernel-log Xid naming only a PCI bus id comes out with the GPU's
//! canonical identity and only the pods on that GPU, and one naming an unknown PCI id comes out
//! marked unresolved; an event for an unknown node comes out marked; garbage bytes go to the
//! dead-letter topic with the reason.

mod common;

use std::time::Duration;

use common::{Cluster, enriched_of};
use gpumedic_runtime::kafka::{Producer, dlq_headers, publish, record_headers};
use gpumedic_schemas::health::{Component, Detail, Entity, GpuIdentity, GpuInventoryDetail, Source};
use gpumedic_schemas::{EnrichedHealthEvent, HealthEvent, topics};
use gpumedic_testkit as testkit;
use serde_json::json;

const GPU_A: &str = "GPU-aaaaaaaa-1b1b-1b1b-1b1b-000000000000";
const GPU_B: &str = "GPU-bbbbbbbb-2a2a-2a2a-2a2a-000000000000";

fn xid_event(node: &str, code: i32) -> HealthEvent {
    let gpu = "GPU-11111111-2222-3333-4444-555555555555";
    testkit::event(node).xid(code).text("GPU has fallen off the bus.").gpu(gpu).build()
}

/// A kernel-log Xid: the kernel names the GPU by PCI bus id only.
fn kernel_xid(node: &str, pci: &str) -> HealthEvent {
    let mut event = xid_event(node, 48);
    event.entity = Entity { pci_bus_id: Some(pci.into()), ..Default::default() };
    event
}

/// The node's GPU inventory as the collector publishes it, PCI ids as NVML writes them.
fn inventory_event(node: &str) -> HealthEvent {
    let gpu = |index, uuid: &str, pci: &str| GpuIdentity {
        index: Some(index),
        uuid: Some(uuid.into()),
        pci_bus_id: Some(pci.into()),
        serial: Some(format!("165000000{index}")),
        product: Some("NVIDIA H100 80GB HBM3".into()),
        nvlink_domain: None,
    };
    let detail = Detail::GpuInventory(GpuInventoryDetail {
        gpus: vec![gpu(0, GPU_A, "00000000:1B:00.0"), gpu(1, GPU_B, "00000000:2A:00.0")],
        reason: GpuInventoryDetail::START.into(),
        expected: Some(2),
    });
    HealthEvent::new(node, Source::Nvml, Component::Node, Entity::default(), detail)
}

async fn send(producer: &Producer, key: &str, payload: &[u8]) {
    publish(producer, topics::HEALTH_RAW, key, payload, &[]).await.expect("produced");
}

fn pod_names(e: &EnrichedHealthEvent) -> Vec<&str> {
    let mut pods: Vec<&str> = e.workloads.iter().map(|w| w.pod.as_str()).collect();
    pods.sort_unstable();
    pods
}

#[tokio::test]
async fn raw_events_come_out_enriched_and_garbage_is_dead_lettered() {
    let settings = common::shared_topics().await;

    // A labelled GPU node with a GPU pod on it.
    let node = testkit::unique_name("enr-node");
    let gpu_node = testkit::NodeBuilder::new(&node)
        .label("node.kubernetes.io/instance-type", "p5.48xlarge")
        .label("nvidia.com/gpu.product", "NVIDIA-H100-80GB-HBM3")
        .label("topology.kubernetes.io/zone", "us-east-1a")
        .label("nvidia.com/cuda.driver-version.full", "570.86.15")
        .capacity("nvidia.com/gpu", "8")
        .allocatable("nvidia.com/gpu", "8");
    let cluster = Cluster::with_nodes("enr-ns", [gpu_node], &[]).await;
    let ns = cluster.ns.clone();
    cluster.create_gpu_pod("trainer-0", &node, "8", json!({})).await;
    // Two pods tied to one GPU each by the annotation.
    for (pod, uuid) in [("on-gpu-a", GPU_A), ("on-gpu-b", GPU_B)] {
        cluster.create_gpu_pod(pod, &node, "1", json!({ "gpumedic.io/gpu-uuids": uuid })).await;
    }

    let mut enricher =
        common::shared_topic_enricher(&settings, "enricher", &[("GPUMEDIC_CLUSTER_NAME", "testbed".into())]).await;

    let producer = settings.producer("enricher-test").unwrap();
    let known = xid_event(&node, 79);
    let unknown_node = testkit::unique_name("enr-unknown");
    let unknown = xid_event(&unknown_node, 13);
    send(&producer, &node, &gpumedic_schemas::encode(&known).unwrap()).await;
    send(&producer, &unknown_node, &gpumedic_schemas::encode(&unknown).unwrap()).await;
    let garbage_key = format!("{node}-garbage");
    send(&producer, &garbage_key, b"\x07not avro at all").await;
    // Then the node's inventory, and after it (same key, so same partition and in order) kernel-log
    // Xids naming a listed and an unlisted PCI id, in the kernel's form.
    let inventory = inventory_event(&node);
    let on_b = kernel_xid(&node, "0000:2a:00.0");
    let unlisted = kernel_xid(&node, "0000:99:00.0");
    for event in [&inventory, &on_b, &unlisted] {
        send(&producer, &node, &gpumedic_schemas::encode(event).unwrap()).await;
    }

    let (out, enriched) = enriched_of(&known).await;
    assert_eq!(enriched.event, known, "the raw event is carried unchanged");
    assert!(!enriched.node_unknown);
    assert_eq!(enriched.node_context.instance_type.as_deref(), Some("p5.48xlarge"));
    assert_eq!(enriched.node_context.gpu_product.as_deref(), Some("NVIDIA-H100-80GB-HBM3"));
    assert_eq!(enriched.node_context.driver_version.as_deref(), Some("570.86.15"));
    assert_eq!(enriched.node_context.cluster.as_deref(), Some("testbed"));
    assert_eq!(enriched.node_context.expected_gpus, Some(8), "the node's nvidia.com/gpu capacity");
    assert!(enriched.gpu.is_none());
    assert!(enriched.gpu_unresolved, "a GPU named before the node's first inventory is passed on, marked");
    assert_eq!(enriched.xid_catalog.as_ref().map(|c| c.name.as_str()), Some("GPU has fallen off the bus"));
    // Its UUID is on neither annotated pod; the pod whose GPUs are unknown may be on it.
    assert_eq!(enriched.workloads.len(), 1);
    assert_eq!(
        (enriched.workloads[0].namespace.as_str(), enriched.workloads[0].pod.as_str()),
        (ns.as_str(), "trainer-0")
    );
    assert!(out.header(record_headers::TRACEPARENT).is_some_and(|t| t.starts_with(b"00-")));
    assert_eq!(out.key.as_deref(), Some(node.as_bytes()));

    let (_, enriched) = enriched_of(&inventory).await;
    assert_eq!(enriched.event, inventory, "the inventory is passed on like any event");
    assert!(enriched.gpu.is_none() && !enriched.gpu_unresolved, "it names no one GPU");

    let (_, enriched) = enriched_of(&on_b).await;
    assert_eq!(enriched.event, on_b);
    let gpu = enriched.gpu.as_ref().expect("resolved from the inventory");
    assert_eq!(gpu.uuid.as_deref(), Some(GPU_B), "the canonical UUID");
    assert_eq!(gpu.index, Some(1));
    assert_eq!(gpu.pci_bus_id.as_deref(), Some("0000:2a:00.0"), "in the kernel log's normal form");
    assert_eq!(gpu.serial.as_deref(), Some("1650000001"));
    assert!(!enriched.gpu_unresolved);
    assert_eq!(pod_names(&enriched), ["on-gpu-b", "trainer-0"], "only the pods that may be on that GPU");

    let (_, enriched) = enriched_of(&unlisted).await;
    assert_eq!(enriched.event, unlisted, "passed on unchanged");
    assert!(enriched.gpu.is_none());
    assert!(enriched.gpu_unresolved, "a PCI id the inventory does not list is marked");
    assert_eq!(pod_names(&enriched), ["on-gpu-a", "on-gpu-b", "trainer-0"], "any pod may be on it");

    let (_, enriched) = enriched_of(&unknown).await;
    assert!(enriched.node_unknown, "an unknown node is passed on, marked");
    assert_eq!(enriched.node_context.expected_gpus, None);
    assert!(enriched.workloads.is_empty());

    let dead = common::shared_dead_letter(&garbage_key).await;
    assert_eq!(dead.payload.as_deref(), Some(&b"\x07not avro at all"[..]));
    let reason = String::from_utf8_lossy(dead.header(dlq_headers::REASON).unwrap()).into_owned();
    assert!(reason.starts_with("wrong_magic_byte"), "{reason}");
    assert_eq!(dead.header(dlq_headers::SERVICE), Some(&b"enricher"[..]));

    enricher.terminate(Duration::from_secs(15)).await.expect("stops on SIGTERM");
    cluster.delete().await;
}
