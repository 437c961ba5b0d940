//! The enrich step itself: a pure function from a raw event and what the cluster knows to the
//! enriched event. No I/O, so it is benchmarked and tested without servers.

use std::collections::BTreeMap;

use chrono::{DateTime, Utc};
use gpumedic_schemas::enriched::{NodeContext, Workload, XidCatalogEntry};
use gpumedic_schemas::health::Detail;
use gpumedic_schemas::{EnrichedHealthEvent, HealthEvent};

use crate::catalog::XidCatalog;

/// What the enricher's cache knows about one node.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct NodeInfo {
    /// Context fields derived from labels.
    pub context: NodeContext,
    /// GPU pods bound to the node.
    pub workloads: Vec<Workload>,
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
    }
}

/// Joins `event` with the node's cached info (`None`: the cache does not know the node) and the
/// Xid catalog. Workloads are narrowed to the affected GPU when the event names one and a pod's
/// GPUs are known; otherwise every GPU pod on the node is listed.
pub fn enrich(
    event: HealthEvent,
    node: Option<&NodeInfo>,
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
    let workloads = match (node, event.entity.gpu_uuid.as_deref()) {
        (None, _) => Vec::new(),
        (Some(n), Some(uuid)) => {
            let on_gpu: Vec<Workload> =
                n.workloads.iter().filter(|w| w.gpu_uuids.iter().any(|g| g == uuid)).cloned().collect();
            if on_gpu.is_empty() { n.workloads.clone() } else { on_gpu }
        }
        (Some(n), None) => n.workloads.clone(),
    };
    EnrichedHealthEvent {
        node_context: node.map(|n| n.context.clone()).unwrap_or_default(),
        node_unknown: node.is_none(),
        xid_catalog,
        workloads,
        enriched_at: now,
        event,
    }
}
