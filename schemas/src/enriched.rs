//! The enriched health event (`EnrichedHealthEvent`, `schemas/avro/enriched_health_event.avsc`):
//! a raw event joined with the node's context, the Xid catalog and the workloads on the node.

use std::collections::BTreeMap;

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};

use crate::health::{GpuIdentity, HealthEvent};

/// A raw health event with cluster context, published on
/// [`HEALTH_ENRICHED`](crate::topics::HEALTH_ENRICHED) keyed by node name.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct EnrichedHealthEvent {
    /// The raw event, unchanged.
    pub event: HealthEvent,
    /// What the cluster knows about the node.
    pub node_context: NodeContext,
    /// The node was not in the enricher's cache: context and workloads are unknown, not empty.
    pub node_unknown: bool,
    /// Catalog context for Xid events.
    pub xid_catalog: Option<XidCatalogEntry>,
    /// Pods using GPUs on the node (on the affected GPU when known).
    pub workloads: Vec<Workload>,
    /// When the enricher published this record.
    #[serde(with = "crate::serde_util::micros")]
    pub enriched_at: DateTime<Utc>,
    /// The canonical identity of the GPU the event names, resolved from the node's latest GPU
    /// inventory (schema version 2).
    pub gpu: Option<GpuIdentity>,
    /// The event names a GPU that the node's inventory could not resolve.
    pub gpu_unresolved: bool,
}

/// What the cluster knows about a node.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct NodeContext {
    /// Cluster name.
    pub cluster: Option<String>,
    /// Instance type.
    pub instance_type: Option<String>,
    /// Availability zone.
    pub zone: Option<String>,
    /// GPU product.
    pub gpu_product: Option<String>,
    /// NVIDIA driver version.
    pub driver_version: Option<String>,
    /// Node labels selected by configuration.
    pub labels: BTreeMap<String, String>,
    /// The node's `nvidia.com/gpu` capacity: how many GPUs it should have (schema version 2).
    pub expected_gpus: Option<i32>,
}

/// The Xid catalog's entry for an event's Xid.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct XidCatalogEntry {
    /// Short name of the Xid.
    pub name: String,
    /// Immediate action (meant to be automated).
    pub immediate_action: String,
    /// Investigatory action.
    pub investigatory_action: String,
    /// Version of the catalog table.
    pub catalog_version: Option<String>,
}

/// A pod that uses GPUs on the node.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Workload {
    /// Pod namespace.
    pub namespace: String,
    /// Pod name.
    pub pod: String,
    /// Kind of the top controlling owner.
    pub owner_kind: Option<String>,
    /// Name of that owner.
    pub owner_name: Option<String>,
    /// GPUs allocated to the pod, when known.
    pub gpu_uuids: Vec<String>,
}
