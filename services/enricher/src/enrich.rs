//! The enrich step itself: a pure function from a raw event and what the cluster knows to the
//! enriched event. No I/O, so it is benchmarked and tested without servers.

use std::collections::BTreeMap;

use chrono::{DateTime, Utc};
use gpumedic_schemas::enriched::{NodeContext, Workload, XidCatalogEntry};
use gpumedic_schemas::health::{Detail, GpuWorkload};
use gpumedic_schemas::{EnrichedHealthEvent, HealthEvent};

use crate::catalog::XidCatalog;
use crate::inventory::Resolution;

/// What the enricher's cache knows about one node.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct NodeInfo {
    /// Context fields derived from labels.
    pub context: NodeContext,
    /// GPU pods bound to the node.
    pub workloads: Vec<Workload>,
    /// The NVLink domain (clique) the node's GPUs belong to, from [`labels::GPU_CLIQUE`].
    pub nvlink_domain: Option<String>,
}

/// Well-known node labels the context is read from.
pub mod labels {
    /// Instance type (cloud providers and most installers set it).
    pub const INSTANCE_TYPE: &str = "node.kubernetes.io/instance-type";
    /// Availability zone.
    pub const ZONE: &str = "topology.kubernetes.io/zone";
    /// GPU product, from NVIDIA GPU Feature Discovery.
    pub const GPU_PRODUCT: &str = "nvidia.com/gpu.product";
    /// Full driver version, from GPU Feature Discovery (newer releases).
    pub const DRIVER_FULL: &str = "nvidia.com/cuda.driver-version.full";
    /// Driver version parts, from GPU Feature Discovery (older releases).
    pub const DRIVER_MAJOR: &str = "nvidia.com/cuda.driver.major";
    /// See [`DRIVER_MAJOR`].
    pub const DRIVER_MINOR: &str = "nvidia.com/cuda.driver.minor";
    /// See [`DRIVER_MAJOR`].
    pub const DRIVER_REV: &str = "nvidia.com/cuda.driver.rev";
    /// The NVLink domain of a multi-node NVLink system (GB200 NVL72), from GPU Feature Discovery:
    /// `<cluster UUID>.<clique id>`. Nodes with the same value share one NVLink fabric.
    pub const GPU_CLIQUE: &str = "nvidia.com/gpu.clique";
}

/// Builds a node's context from its labels: the well-known fields, plus the labels an operator
/// selected (`selected`), under cluster name `cluster`.
pub fn node_context(all: &BTreeMap<String, String>, selected: &[String], cluster: Option<&str>) -> NodeContext {
    let get = |k: &str| all.get(k).cloned();
    let driver_version = get(labels::DRIVER_FULL).or_else(|| {
        let major = get(labels::DRIVER_MAJOR)?;
        Some(match (get(labels::DRIVER_MINOR), get(labels::DRIVER_REV)) {
            (Some(minor), Some(rev)) if !rev.is_empty() => format!("{major}.{minor}.{rev}"),
            (Some(minor), _) => format!("{major}.{minor}"),
            _ => major,
        })
    });
    NodeContext {
        cluster: cluster.map(str::to_owned),
        instance_type: get(labels::INSTANCE_TYPE),
        zone: get(labels::ZONE),
        gpu_product: get(labels::GPU_PRODUCT),
        driver_version,
        labels: selected.iter().filter_map(|k| all.get(k).map(|v| (k.clone(), v.clone()))).collect(),
        // Not a label: the cache sets it from the Node's resources.
        expected_gpus: None,
    }
}

/// Joins `event` with the node's cached info (`None`: the cache does not know the node), the GPU
/// the event names as resolved from the node's inventory (`gpu`), and the Xid catalog.
///
/// Workloads: when the event carries the collector's list (`workloads`, from the node's kubelet,
/// present even when empty), exactly those pods, one entry per pod with the devices of its
/// containers, and the owner the cache knows for the pod. The kubelet's assignment is what the
/// device plugin actually gave each container, on the node, at the time of the event; the
/// annotation is what someone wrote on the pod, if anyone did. Otherwise the cache's pods are
/// narrowed to the affected GPU when the event names one (by the resolved UUID, so a kernel-log
/// fault that knows only the PCI bus id is narrowed too): the pods whose GPUs include it, plus the
/// pods whose GPUs are unknown (they may be on it); with no GPU named, every GPU pod on the node
/// is listed.
pub fn enrich(
    event: HealthEvent,
    node: Option<&NodeInfo>,
    gpu: Resolution<'_>,
    catalog: &XidCatalog,
    now: DateTime<Utc>,
) -> EnrichedHealthEvent {
    let xid_catalog = match &event.detail {
        Detail::Xid(x) => u32::try_from(x.code).ok().and_then(|code| catalog.get(code)).map(|e| XidCatalogEntry {
            name: e.name.clone(),
            immediate_action: e.immediate.clone(),
            investigatory_action: e.investigatory.clone(),
            catalog_version: Some(catalog.version.clone()),
        }),
        _ => None,
    };
    let (gpu, gpu_unresolved) = match gpu {
        Resolution::Resolved(g) => {
            let mut g = g.clone();
            // The inventory rarely knows the GPU's NVLink domain; the node's label does.
            if g.nvlink_domain.is_none() {
                g.nvlink_domain = node.and_then(|n| n.nvlink_domain.clone());
            }
            (Some(g), false)
        }
        Resolution::Unresolved(_) => (None, true),
        Resolution::NoGpu => (None, false),
    };
    // An unresolved event may still carry a UUID of its own (no inventory yet): pods are tied to
    // GPUs by UUID, so it narrows as well as a resolved one would.
    let uuid = gpu.as_ref().and_then(|g| g.uuid.as_deref()).or(event.entity.gpu_uuid.as_deref());
    // The collector's list wins, even empty: see the doc above.
    let workloads = match &event.workloads {
        Some(held) => from_collector(held, node),
        None => from_cache(node, uuid),
    };
    EnrichedHealthEvent {
        node_context: node.map(|n| n.context.clone()).unwrap_or_default(),
        node_unknown: node.is_none(),
        xid_catalog,
        workloads,
        enriched_at: now,
        event,
        gpu,
        gpu_unresolved,
    }
}

/// The collector's containers as the enriched event's pods: one entry per pod, with the devices
/// of all its containers on the GPU, and the owner the cache knows for the pod.
fn from_collector(held: &[GpuWorkload], node: Option<&NodeInfo>) -> Vec<Workload> {
    let mut pods: BTreeMap<(&str, &str), Vec<String>> = BTreeMap::new();
    for w in held {
        let devices = pods.entry((&w.namespace, &w.pod)).or_default();
        for id in &w.gpu_uuids {
            if !devices.contains(id) {
                devices.push(id.clone());
            }
        }
    }
    pods.into_iter()
        .map(|((namespace, pod), gpu_uuids)| {
            let known = node.and_then(|n| n.workloads.iter().find(|w| w.namespace == namespace && w.pod == pod));
            Workload {
                namespace: namespace.to_owned(),
                pod: pod.to_owned(),
                owner_kind: known.and_then(|w| w.owner_kind.clone()),
                owner_name: known.and_then(|w| w.owner_name.clone()),
                gpu_uuids,
            }
        })
        .collect()
}

/// The cache's pods of the node, narrowed to GPU `uuid` when the event names one.
fn from_cache(node: Option<&NodeInfo>, uuid: Option<&str>) -> Vec<Workload> {
    match (node, uuid) {
        (None, _) => Vec::new(),
        (Some(n), Some(uuid)) => n
            .workloads
            .iter()
            .filter(|w| w.gpu_uuids.is_empty() || w.gpu_uuids.iter().any(|g| g.eq_ignore_ascii_case(uuid)))
            .cloned()
            .collect(),
        (Some(n), None) => n.workloads.clone(),
    }
}

#[cfg(test)]
mod tests {
    use gpumedic_schemas::health::{Component, Entity, GpuIdentity, GpuInventoryDetail, Source, XidDetail};

    use super::*;
    use crate::inventory::{InventoryCache, Unresolved};

    const A: &str = "GPU-aaaaaaaa-0000-0000-0000-000000000000";
    const B: &str = "GPU-bbbbbbbb-0000-0000-0000-000000000000";

    fn workload(pod: &str, gpus: &[&str]) -> Workload {
        Workload {
            namespace: "ml".into(),
            pod: pod.into(),
            owner_kind: None,
            owner_name: None,
            gpu_uuids: gpus.iter().map(|g| (*g).to_owned()).collect(),
        }
    }

    fn node() -> NodeInfo {
        NodeInfo {
            context: NodeContext { expected_gpus: Some(2), ..NodeContext::default() },
            workloads: vec![workload("on-a", &[A]), workload("on-b", &[B]), workload("unknown", &[])],
            nvlink_domain: None,
        }
    }

    /// A kernel-log Xid: the PCI bus id only, as the kernel writes it.
    fn kernel_xid(pci: &str) -> HealthEvent {
        let detail = Detail::Xid(XidDetail {
            code: 79,
            text: "GPU has fallen off the bus.".into(),
            pid: None,
            process: None,
            nvlink5: None,
            recovery_action: None,
        });
        let entity = Entity { pci_bus_id: Some(pci.into()), ..Entity::default() };
        HealthEvent::new("n", Source::KernelLog, Component::Gpu, entity, detail)
    }

    fn inventory() -> InventoryCache {
        let gpu = |index, uuid: &str, pci: &str| GpuIdentity {
            index: Some(index),
            uuid: Some(uuid.into()),
            pci_bus_id: Some(pci.into()),
            ..GpuIdentity::default()
        };
        let mut c = InventoryCache::default();
        let detail = GpuInventoryDetail {
            gpus: vec![gpu(0, A, "00000000:1B:00.0"), gpu(1, B, "00000000:2A:00.0")],
            reason: "start".into(),
            expected: Some(2),
        };
        c.apply("n", &detail, Utc::now());
        c
    }

    fn pods(e: &EnrichedHealthEvent) -> Vec<&str> {
        e.workloads.iter().map(|w| w.pod.as_str()).collect()
    }

    #[test]
    fn a_kernel_log_fault_gets_the_canonical_gpu_and_only_its_pods() {
        let inv = inventory();
        let event = kernel_xid("0000:2a:00.0");
        let gpu = inv.resolve("n", &event.entity, event.component, event.observed_at);
        let e = enrich(event.clone(), Some(&node()), gpu, &XidCatalog::embedded(), Utc::now());
        let g = e.gpu.as_ref().expect("resolved");
        assert_eq!((g.index, g.uuid.as_deref()), (Some(1), Some(B)));
        assert!(!e.gpu_unresolved);
        assert_eq!(e.event, event, "the raw event is carried unchanged");
        assert_eq!(pods(&e), ["on-b", "unknown"], "the pods on that GPU, and those whose GPUs are unknown");
        assert_eq!(e.node_context.expected_gpus, Some(2));
    }

    #[test]
    fn the_collectors_pods_win_over_the_cache_even_when_none() {
        let inv = inventory();
        let held = |pod: &str, container: &str, gpu: &str| GpuWorkload {
            namespace: "ml".into(),
            pod: pod.into(),
            container: container.into(),
            gpu_uuids: vec![gpu.into()],
        };
        let mut event = kernel_xid("0000:2a:00.0");
        // The kubelet says on-a's containers hold B (the annotation says A), and a pod the cache
        // does not know holds it too.
        event.workloads = Some(vec![held("on-a", "main", B), held("on-a", "sidecar", B), held("new", "c", B)]);
        let mut known = node();
        known.workloads[0].owner_kind = Some("Job".into());
        known.workloads[0].owner_name = Some("train".into());
        let gpu = inv.resolve("n", &event.entity, event.component, event.observed_at);
        let e = enrich(event.clone(), Some(&known), gpu, &XidCatalog::embedded(), Utc::now());
        assert_eq!(pods(&e), ["new", "on-a"], "exactly the collector's pods, one entry per pod");
        let on_a = &e.workloads[1];
        assert_eq!((on_a.owner_kind.as_deref(), on_a.owner_name.as_deref()), (Some("Job"), Some("train")));
        assert_eq!(on_a.gpu_uuids, [B]);
        assert_eq!(e.event, event, "the raw event is carried unchanged");

        // An empty list: the kubelet says no pod uses the GPU.
        event.workloads = Some(Vec::new());
        let gpu = inv.resolve("n", &event.entity, event.component, event.observed_at);
        assert!(enrich(event.clone(), Some(&node()), gpu, &XidCatalog::embedded(), Utc::now()).workloads.is_empty());

        // No list: the cache, narrowed to the GPU, as before.
        event.workloads = None;
        let gpu = inv.resolve("n", &event.entity, event.component, event.observed_at);
        let e = enrich(event, Some(&node()), gpu, &XidCatalog::embedded(), Utc::now());
        assert_eq!(pods(&e), ["on-b", "unknown"]);
    }

    #[test]
    fn a_resolved_gpu_carries_the_nodes_nvlink_domain() {
        let inv = inventory();
        let event = kernel_xid("0000:1b:00.0");
        let in_domain = NodeInfo { nvlink_domain: Some("a1b2c3d4-0000-4000-8000-000000000001.7".into()), ..node() };
        let gpu = inv.resolve("n", &event.entity, event.component, event.observed_at);
        let e = enrich(event.clone(), Some(&in_domain), gpu, &XidCatalog::embedded(), Utc::now());
        let g = e.gpu.as_ref().expect("resolved");
        assert_eq!(g.nvlink_domain.as_deref(), Some("a1b2c3d4-0000-4000-8000-000000000001.7"));
        // Without the label the domain stays unknown.
        let gpu = inv.resolve("n", &event.entity, event.component, event.observed_at);
        let e = enrich(event, Some(&node()), gpu, &XidCatalog::embedded(), Utc::now());
        assert_eq!(e.gpu.expect("resolved").nvlink_domain, None);
    }

    #[test]
    fn an_unresolved_reference_is_passed_on_marked_with_every_pod() {
        let inv = inventory();
        let event = kernel_xid("0000:99:00.0");
        let gpu = inv.resolve("n", &event.entity, event.component, event.observed_at);
        assert_eq!(gpu, Resolution::Unresolved(Unresolved::Unknown));
        let e = enrich(event.clone(), Some(&node()), gpu, &XidCatalog::embedded(), Utc::now());
        assert!(e.gpu.is_none() && e.gpu_unresolved);
        assert_eq!(e.event, event);
        assert_eq!(pods(&e), ["on-a", "on-b", "unknown"], "which GPU is unknown, so every pod may be hit");

        // No inventory yet, but the event carries its own UUID: pods are still narrowed by it.
        let mut nvml = kernel_xid("0000:1b:00.0");
        nvml.entity = Entity { gpu_uuid: Some(A.into()), ..Entity::default() };
        let empty = InventoryCache::default();
        let gpu = empty.resolve("n", &nvml.entity, nvml.component, nvml.observed_at);
        let e = enrich(nvml, Some(&node()), gpu, &XidCatalog::embedded(), Utc::now());
        assert!(e.gpu_unresolved);
        assert_eq!(pods(&e), ["on-a", "unknown"]);
    }

    #[test]
    fn an_event_naming_no_gpu_is_neither_resolved_nor_unresolved() {
        let mut event = kernel_xid("0000:1b:00.0");
        event.entity = Entity::default();
        event.component = Component::Node;
        let inv = inventory();
        let gpu = inv.resolve("n", &event.entity, event.component, event.observed_at);
        let e = enrich(event, Some(&node()), gpu, &XidCatalog::embedded(), Utc::now());
        assert!(e.gpu.is_none() && !e.gpu_unresolved);
        assert_eq!(e.workloads.len(), 3);
    }
}
