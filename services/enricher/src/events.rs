//! The enricher's notable events, each with its log line and its metrics in one place, and the
//! names of its metrics ([`names`]).
//!
//! An event is a small type whose [`InternalEvent::emit`] writes the log line and updates the
//! counters together (the runtime's pattern, `gpumedic_runtime::events`). Plain debug logs stay
//! where they are.

use std::fmt::Display;
use std::time::Duration;

pub(crate) use gpumedic_runtime::events::InternalEvent;

/// The enricher's metric names. Dashboards and alerts (`k8s/components/`), the load tests and the
/// tests read them: they never change.
pub(crate) mod names {
    /// Events enriched and published.
    pub(crate) const EVENTS_TOTAL: &str = "gpumedic_enricher_events_total";
    /// Raw events an operator published for a node.
    pub(crate) const RECORDS_OPERATOR_TOTAL: &str = "gpumedic_enricher_records_operator_total";
    /// Raw records without a valid token of the node they claim, by `claimed_node` and `reason`.
    pub(crate) const RECORDS_UNAUTHENTICATED_TOTAL: &str = "gpumedic_enricher_records_unauthenticated_total";
    /// Events for nodes the cluster cache does not know.
    pub(crate) const UNKNOWN_NODE_EVENTS_TOTAL: &str = "gpumedic_enricher_unknown_node_events_total";
    /// Events whose GPU could not be resolved, by `reason`.
    pub(crate) const GPU_UNRESOLVED_TOTAL: &str = "gpumedic_enricher_gpu_unresolved_total";
    /// Nodes with a GPU inventory.
    pub(crate) const INVENTORY_NODES: &str = "gpumedic_enricher_inventory_nodes";
    /// Contradictions found in GPU inventories, by `kind`.
    pub(crate) const INVENTORY_CONFLICTS_TOTAL: &str = "gpumedic_enricher_inventory_conflicts_total";
    /// GPUs past the per-node cap left out of an inventory.
    pub(crate) const INVENTORY_GPUS_DROPPED_TOTAL: &str = "gpumedic_enricher_inventory_gpus_dropped_total";
    /// Inventories forgotten to make room.
    pub(crate) const INVENTORY_EVICTIONS_TOTAL: &str = "gpumedic_enricher_inventory_evictions_total";
    /// TokenReviews answered by the apiserver.
    pub(crate) const TOKEN_REVIEWS_TOTAL: &str = "gpumedic_enricher_token_reviews_total";
    /// Reviews held in the token cache.
    pub(crate) const TOKEN_CACHE_ENTRIES: &str = "gpumedic_enricher_token_cache_entries";
    /// Node keys held in the node-token directory.
    pub(crate) const DIRECTORY_ENTRIES: &str = "gpumedic_enricher_directory_entries";
    /// Node-token directory entries ignored.
    pub(crate) const DIRECTORY_ENTRIES_IGNORED_TOTAL: &str = "gpumedic_enricher_directory_entries_ignored_total";
    /// Failed watches of the cluster cache, by `resource`.
    pub(crate) const WATCH_FAILURES_TOTAL: &str = "gpumedic_enricher_watch_failures_total";
}

/// An operator published a raw event for a node; it is enriched.
pub(crate) struct OperatorRecord<'a, I: Display> {
    pub(crate) node: &'a str,
    pub(crate) event_id: &'a I,
}

impl<I: Display> InternalEvent for OperatorRecord<'_, I> {
    fn emit(self) {
        metrics::counter!(names::RECORDS_OPERATOR_TOTAL).increment(1);
        tracing::info!(node = %self.node, event_id = %self.event_id,
            "An operator published a raw event for a node; enriching it.");
    }
}

/// A raw record does not carry a valid token of the node it claims: it is dead-lettered (the
/// consumer loop logs that with the reason; this adds who was claimed, at debug).
pub(crate) struct RecordUnauthenticated<'a, I: Display, R: Display> {
    pub(crate) claimed_node: &'a str,
    /// The label: the claimed node when the cluster knows it, else `unknown`, so the label set
    /// stays bounded by the cluster's nodes.
    pub(crate) label: String,
    pub(crate) event_id: &'a I,
    pub(crate) reason: &'a R,
    pub(crate) reason_label: &'static str,
}

impl<I: Display, R: Display> InternalEvent for RecordUnauthenticated<'_, I, R> {
    fn emit(self) {
        metrics::counter!(names::RECORDS_UNAUTHENTICATED_TOTAL, "claimed_node" => self.label,
            "reason" => self.reason_label)
        .increment(1);
        tracing::debug!(claimed_node = %self.claimed_node, event_id = %self.event_id, reason = %self.reason,
            "A raw record does not carry a valid token of the node it claims; dead-lettering it.");
    }
}

/// An event names a node the cluster cache does not know; it is passed on marked.
pub(crate) struct UnknownNodeEvent<'a> {
    pub(crate) node: &'a str,
}

impl InternalEvent for UnknownNodeEvent<'_> {
    fn emit(self) {
        metrics::counter!(names::UNKNOWN_NODE_EVENTS_TOTAL).increment(1);
        tracing::debug!(node = %self.node, "Event for a node the cache does not know; passing it on marked.");
    }
}

/// A watch of the cluster cache failed; the cache serves what it holds and is not ready until it
/// has listed the resource again.
pub(crate) struct WatchFailed<'a> {
    pub(crate) resource: &'static str,
    pub(crate) error: &'a str,
    pub(crate) retry_in: Duration,
}

impl InternalEvent for WatchFailed<'_> {
    fn emit(self) {
        metrics::counter!(names::WATCH_FAILURES_TOTAL, "resource" => self.resource).increment(1);
        tracing::warn!(
            resource = self.resource,
            error = %self.error,
            retry_in_ms = self.retry_in.as_millis() as u64,
            "The watch of {} failed; the cluster cache serves what it holds and is not ready until it has listed them again.",
            self.resource
        );
    }
}
