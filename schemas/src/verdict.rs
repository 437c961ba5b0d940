//! The verdict (`Verdict`, `schemas/avro/verdict.avsc`): the classifier's decision about a node or
//! GPU. The public contract other systems subscribe to.

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};
use uuid::Uuid;

use crate::health::Entity;

/// The classifier's decision, published on [`VERDICTS`](crate::topics::VERDICTS) keyed by node
/// name.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Verdict {
    /// Deterministic id: the same incident step always has the same id.
    #[serde(with = "crate::serde_util::uuid_str")]
    pub verdict_id: Uuid,
    /// The incident the verdict belongs to.
    #[serde(with = "crate::serde_util::uuid_str")]
    pub incident_id: Uuid,
    /// Kubernetes node name; also the Kafka key.
    pub node: String,
    /// The affected part; empty for a node-wide verdict.
    pub entity: Entity,
    /// How bad it is.
    pub severity: Severity,
    /// The runbook rule that fired.
    pub rule_id: String,
    /// Its version.
    pub rule_version: i32,
    /// The recommended action.
    pub action: RecommendedAction,
    /// Name of the action when `action` is [`RecommendedAction::Custom`].
    pub custom_action: Option<String>,
    /// Why, for humans.
    pub reason: String,
    /// Event ids that led to the verdict.
    #[serde(with = "crate::serde_util::uuid_str::vec")]
    pub evidence: Vec<Uuid>,
    /// When the classifier issued it.
    #[serde(with = "crate::serde_util::micros")]
    pub issued_at: DateTime<Utc>,
    /// The verdict declares the incident recovered.
    pub recovery: bool,
    /// The action must not be taken before this time (e.g. a cloud maintenance window's start
    /// less a lead); `None`: at once. Schema version 2, as the two fields after it.
    #[serde(with = "crate::serde_util::micros::option")]
    pub not_before: Option<DateTime<Utc>>,
    /// The action may wait until the GPU has no workload or a maintenance window opens.
    pub deferrable: bool,
    /// For a workload fault: the workload (`namespace/Kind/name`) whose application errors were
    /// seen across nodes; no node action is recommended.
    pub workload: Option<String>,
}

/// How bad a condition is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Severity {
    /// A severity this reader does not know.
    Unknown,
    /// For the record (including recoveries).
    Info,
    /// Degraded or trending towards failure.
    Warning,
    /// The node or GPU must leave service.
    Critical,
}

/// A remediation step.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum RecommendedAction {
    /// An action this reader does not know.
    Unknown,
    /// Nothing to do.
    None,
    /// Watch, change nothing.
    Monitor,
    /// Mark unschedulable.
    Cordon,
    /// Cordon and evict the pods.
    Drain,
    /// Reset the GPU.
    ResetGpu,
    /// Reboot the node.
    RebootNode,
    /// Replace the node.
    ReplaceNode,
    /// Escalate to the vendor.
    ContactSupport,
    /// A site-specific action, named in `custom_action`.
    Custom,
    /// Run the GPU's diagnostics (DCGM) when it is free; no change to the node unless they fail
    /// (schema version 2).
    RunDiagnostics,
}
