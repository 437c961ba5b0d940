//! The action outcome (`ActionOutcome`, `schemas/avro/action_outcome.avsc`): what the remediator
//! did about a verdict.

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};
use uuid::Uuid;

use crate::verdict::RecommendedAction;

/// What the remediator did, published on [`ACTIONS`](crate::topics::ACTIONS) keyed by node name.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ActionOutcome {
    /// The verdict acted on.
    #[serde(with = "crate::serde_util::uuid_str")]
    pub verdict_id: Uuid,
    /// Kubernetes node name; also the Kafka key.
    pub node: String,
    /// The action attempted.
    pub action: RecommendedAction,
    /// What happened.
    pub status: ActionStatus,
    /// Details for humans.
    pub detail: String,
    /// When the outcome was known.
    #[serde(with = "crate::serde_util::micros")]
    pub at: DateTime<Utc>,
}

/// Result of an action.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ActionStatus {
    /// A status this reader does not know.
    Unknown,
    /// Done.
    Applied,
    /// Would have been done (dry run).
    DryRun,
    /// The mode does not allow it.
    SkippedByMode,
    /// The circuit breaker or a rate limit held it.
    BlockedByBreaker,
    /// Already in the wanted state.
    AlreadyDone,
    /// Tried and failed.
    Failed,
}
