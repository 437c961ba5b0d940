//! What stops one of a leadership term's tasks, or one step of it ([`TermError`]), and the kinds
//! the remediator's failures are counted under ([`MetricLabel`]).

use gpumedic_runtime::events::MetricLabel;
use gpumedic_runtime::kafka::{HandleError, KafkaError};
use gpumedic_runtime::postgres::PostgresError;

use crate::apply::ApplyError;
use crate::control::StatusError;
use crate::hooks::HookError;

/// What went wrong in a leader's task: loading or writing the term's state, acting on a node,
/// consuming verdicts, publishing an outcome, resyncing from the incident store.
#[derive(Debug, thiserror::Error)]
pub enum TermError {
    /// The status object (pause, breaker, ledger) could not be read or written.
    #[error(transparent)]
    Status(#[from] StatusError),
    /// The Kubernetes API refused or did not answer a read or write of the nodes.
    #[error("cannot read or write the nodes: {0}")]
    Nodes(#[from] kube::Error),
    /// A remediation could not be applied.
    #[error(transparent)]
    Apply(#[from] ApplyError),
    /// The verdict consumer could not join its group or commit.
    #[error(transparent)]
    Kafka(#[from] KafkaError),
    /// An action outcome could not be published.
    #[error("cannot publish an action outcome: {0}")]
    Publish(#[from] HandleError),
    /// The incident store could not be reached.
    #[error("cannot reach the incident store: {0}")]
    Incidents(#[from] PostgresError),
    /// The incident store refused or failed a query.
    #[error("cannot read the incident store: {0}")]
    IncidentQuery(#[from] sqlx::Error),
    /// A node's repair ladder changed under every attempt to write it.
    #[error("node {node} changed under every attempt to write its repair ladder")]
    LadderConflict {
        /// The node.
        node: String,
    },
    /// A repair hook (webhook or custom resource) could not be asked about a ladder.
    #[error(transparent)]
    Hook(#[from] HookError),
    /// A task of the term returned while the term went on.
    #[error("a leader task ended on its own")]
    TaskEnded,
    /// A task of the term panicked or was aborted.
    #[error("a leader task stopped: {0}")]
    TaskStopped(#[from] tokio::task::JoinError),
}

impl MetricLabel for TermError {
    fn metric_label(&self) -> &'static str {
        match self {
            Self::Status(_) => "status_object",
            Self::Nodes(_) => "kubernetes",
            Self::Apply(e) => e.metric_label(),
            Self::Kafka(_) => "kafka",
            Self::Publish(e) => e.metric_label(),
            Self::Incidents(_) | Self::IncidentQuery(_) => "postgres",
            Self::LadderConflict { .. } => "conflict",
            Self::Hook(_) => "hook",
            Self::TaskEnded | Self::TaskStopped(_) => "task",
        }
    }
}

impl MetricLabel for ApplyError {
    fn metric_label(&self) -> &'static str {
        match self {
            Self::NodeNotFound { .. } => "node_not_found",
            Self::Read { .. } => "read",
            Self::Patch { .. } => "patch",
            Self::Status { .. } => "status",
            Self::Conflict { .. } => "conflict",
            Self::Client(_) => "client",
            Self::Drain(_) => "drain",
            Self::Dra(_) => "dra",
            Self::Publish(_) => "publish",
            Self::Validation(_) => "validation",
            Self::NotLeading { .. } => "not_leading",
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn apply_failures_are_counted_by_what_failed() {
        let conflict = ApplyError::Conflict { node: "n".into(), attempts: 5 };
        assert_eq!(conflict.metric_label(), "conflict");
        assert_eq!(
            TermError::from(conflict).metric_label(),
            "conflict",
            "a term error counts the apply failure's kind"
        );
        assert_eq!(ApplyError::NotLeading { node: "n".into() }.metric_label(), "not_leading");
        assert_eq!(TermError::TaskEnded.metric_label(), "task");
    }

    #[test]
    fn a_retried_apply_failure_is_counted_under_its_own_kind() {
        let retried = HandleError::retry(ApplyError::Conflict { node: "n".into(), attempts: 5 });
        assert_eq!(retried.metric_label(), "conflict");
        assert_eq!(retried.to_string(), "transient failure: node n changed under every one of 5 attempts to write it");
    }
}
