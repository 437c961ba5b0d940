//! What a leadership term shares ([`Shared`]): the remediator, the producer, the fleet, the
//! status object; and the helpers every room uses to publish outcomes and persist the breaker.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use crate::error::TermError;
use gpumedic_runtime::admin::ReadyFlag;
use gpumedic_runtime::kafka::{self, HandleError, Producer};
use gpumedic_runtime::stage::Stage;
use gpumedic_schemas::{ActionOutcome, Codec, Record as _};
use tokio_util::sync::CancellationToken;

use crate::apply::Remediator;
use crate::control::StatusClient;
use crate::events::{BreakerReset, BreakerTripped, InternalEvent as _, OutcomePublished, PauseChanged};
use crate::fleet::Fleet;
use crate::safety::Gate;
use crate::window::Window;
use crate::{control, events, hooks, maintenance, plan};

/// What every part of a running remediator shares.
pub(crate) struct Shared {
    pub(crate) remediator: Remediator,
    pub(crate) producer: Producer,
    pub(crate) codec: Arc<Codec>,
    pub(crate) fleet: Fleet,
    pub(crate) status: StatusClient,
    /// The verdict topic in, the actions topic out, and the consumer group the leader joins.
    pub(crate) stage: Stage,
    pub(crate) actions_topic: String,
    pub(crate) max_verdict_age: Duration,
    pub(crate) max_in_flight: usize,
    pub(crate) windows: Vec<Window>,
    pub(crate) control_poll: Duration,
    pub(crate) maintenance_check: Duration,
    pub(crate) repair_check: Duration,
    /// The incident store the leader resyncs from; `None`: no resync.
    pub(crate) incident_database_url: Option<String>,
    /// How often the leader resyncs.
    pub(crate) resync_interval: Duration,
    /// The incidents this leader saw recover (see [`crate::resync::Recovered`]).
    pub(crate) recovered: std::sync::Mutex<crate::resync::Recovered>,
    /// One lock per node, held while a verdict or the resync acts on it (see [`NodeLocks`]).
    pub(crate) node_locks: NodeLocks,
    pub(crate) hooks: hooks::Hooks,
    pub(crate) lease_namespace: String,
    /// Turns ready once the leader's consumer has its partitions; a standby holds it ready.
    pub(crate) consuming: ReadyFlag,
    /// Whether the status object says the breaker is open, as last read or written.
    pub(crate) open_persisted: AtomicBool,
    /// The nodes of the breaker's ledger as last written to the status object.
    pub(crate) persisted_ledger: std::sync::Mutex<std::collections::BTreeSet<String>>,
    /// Serialises the leader's writes to the status object (a trip and a reset must not cross).
    pub(crate) status_writes: tokio::sync::Mutex<()>,
    /// The unreadable ladders already reported with an Event (node, annotation value).
    pub(crate) refused_ladders: std::sync::Mutex<std::collections::HashSet<(String, String)>>,
}

/// One lock per node: the verdict handler and the resync act on a node one at a time, so the
/// resync's "has this incident recovered?" and its act are one step against a recovery verdict
/// handled meanwhile. Without it a resync that read an incident open, and saw no recovery, could
/// re-apply the fault just after the recovery verdict released the node (the classifier publishes
/// a verdict before it writes it, so the store lags the topic), and the node would stay marked
/// until the next resync put it right.
///
/// The map keeps one entry per node ever locked: bounded by the managed fleet.
#[derive(Debug, Default)]
pub(crate) struct NodeLocks {
    locks: std::sync::Mutex<std::collections::HashMap<String, Arc<tokio::sync::Mutex<()>>>>,
}

impl NodeLocks {
    /// Waits for `node`'s lock; it is released when the guard drops.
    pub(crate) async fn lock(&self, node: &str) -> tokio::sync::OwnedMutexGuard<()> {
        let lock = {
            let mut locks = self.locks.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
            locks.entry(node.to_owned()).or_default().clone()
        };
        lock.lock_owned().await
    }
}

/// A new leader's state: the pause and an open breaker from the status object, and the
/// quarantines still within the breaker's window from the nodes (gpumedic's taint and its
/// `timeAdded`), so a failover neither closes the breaker nor hands out a fresh budget.
pub(crate) async fn begin_term(shared: &Shared) -> Result<(), TermError> {
    let status = shared.status.read().await?;
    shared.remediator.set_paused(status.paused);
    events::paused(status.paused);
    // A page at a time, each node reduced to its quarantine time: a large fleet's whole Nodes
    // are never held at once.
    let from_taints = maintenance::map_nodes(&shared.remediator.client(), &shared.fleet.selector, |n| {
        Some((n.metadata.name.clone().unwrap_or_default(), quarantined_at(n)?))
    })
    .await?;
    // gpumedic's DeviceTaintRules are its GPU quarantines; a cluster that serves none has none.
    let gpus = crate::dra::quarantined_gpus(&shared.remediator.client()).await.unwrap_or_else(|e| {
        tracing::debug!(error = %e, "Found no DeviceTaintRules to count against the breaker.");
        Vec::new()
    });
    let now = Instant::now();
    let wall = chrono::Utc::now();
    let mut gate = lock_gate(&shared.remediator);
    let window = gate.breaker.window();
    // The shared ledger, and gpumedic's taints still on nodes (a ledger written before a crash may
    // lack the last quarantine): the later time of the two per node.
    let mut quarantined: std::collections::BTreeMap<String, Instant> = std::collections::BTreeMap::new();
    let from_taints = from_taints.into_iter().flatten();
    for (node, added) in status.quarantine_ledger.clone().into_iter().chain(from_taints) {
        let age = (wall - added).to_std().unwrap_or_default();
        if age < window {
            let at = now.checked_sub(age).unwrap_or(now);
            let entry = quarantined.entry(node).or_insert(at);
            *entry = (*entry).max(at);
        }
    }
    *shared.persisted_ledger.lock().unwrap_or_else(std::sync::PoisonError::into_inner) =
        status.quarantine_ledger.keys().cloned().collect();
    let trip = status
        .breaker_open
        .then(|| status.breaker_reason.clone().unwrap_or_else(|| "tripped under an earlier leader".to_owned()));
    tracing::info!(
        breaker_open = trip.is_some(),
        paused = status.paused,
        counted = quarantined.len(),
        "Loaded the breaker and pause state for this term."
    );
    gate.breaker.restore(trip, quarantined, now);
    let gpus = gpus.into_iter().filter_map(|(rule, created)| {
        let age = (wall - created).to_std().unwrap_or_default();
        (age < window).then(|| (rule, now.checked_sub(age).unwrap_or(now)))
    });
    gate.breaker.restore_gpus(gpus, now);
    shared.open_persisted.store(status.breaker_open, Ordering::Release);
    events::breaker_open(status.breaker_open);
    Ok(())
}

/// When gpumedic's taint went on `node`, if it carries one.
pub(crate) fn quarantined_at(node: &k8s_openapi::api::core::v1::Node) -> Option<chrono::DateTime<chrono::Utc>> {
    let taints = node.spec.as_ref()?.taints.as_ref()?;
    let taint = taints.iter().find(|t| t.key == plan::TAINT_KEY)?;
    let added = serde_json::to_value(taint).ok()?;
    chrono::DateTime::parse_from_rfc3339(added["timeAdded"].as_str()?).ok().map(|t| t.with_timezone(&chrono::Utc))
}

pub(crate) fn lock_gate(remediator: &Remediator) -> std::sync::MutexGuard<'_, Gate> {
    // The gate's state is a few maps updated in place; a panic elsewhere cannot leave it half
    // written, so a poisoned lock is still safe to use.
    remediator.gate().lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// Writes the breaker's ledger when it counts a quarantine the status object does not show yet
/// (expired entries go at the next write), so every leader shares one budget.
///
/// The writes are grouped: the ledger is read once the write lock is held, so in a mass failure
/// the remediations waiting for the lock find their entries written by the one before them and
/// write nothing (one write per wave instead of one per node; each write carries the whole
/// ledger, so at 1,000 quarantines one a node was most of the time they took).
async fn persist_ledger(shared: &Shared) -> Result<(), TermError> {
    if all_persisted(shared, &ledger_now(shared).1) {
        return Ok(());
    }
    let _writing = shared.status_writes.lock().await;
    let (ledger, nodes) = ledger_now(shared);
    if all_persisted(shared, &nodes) {
        return Ok(());
    }
    shared.status.patch(&control::ledger_patch(&ledger)).await?;
    *shared.persisted_ledger.lock().unwrap_or_else(std::sync::PoisonError::into_inner) = nodes;
    Ok(())
}

/// The breaker's ledger now, with wall-clock times, and its nodes.
fn ledger_now(
    shared: &Shared,
) -> (std::collections::BTreeMap<String, chrono::DateTime<chrono::Utc>>, std::collections::BTreeSet<String>) {
    let (now, wall) = (Instant::now(), chrono::Utc::now());
    let entries = lock_gate(&shared.remediator).breaker.ledger(now);
    let ledger: std::collections::BTreeMap<String, chrono::DateTime<chrono::Utc>> = entries
        .into_iter()
        .map(|(node, at)| {
            (node, wall - chrono::Duration::from_std(now.saturating_duration_since(at)).unwrap_or_default())
        })
        .collect();
    let nodes = ledger.keys().cloned().collect();
    (ledger, nodes)
}

/// Whether the status object holds every one of `nodes` in its ledger.
fn all_persisted(shared: &Shared, nodes: &std::collections::BTreeSet<String>) -> bool {
    nodes.is_subset(&shared.persisted_ledger.lock().unwrap_or_else(std::sync::PoisonError::into_inner))
}

/// Writes what the breaker counts (its ledger) and a trip the gate has that the status object
/// does not show yet. Called after every remediation, before its outcome is acknowledged, so
/// neither a quarantine counted nor a trip is lost to a crash or a failover.
pub(crate) async fn persist_trip(shared: &Shared) -> Result<(), TermError> {
    persist_ledger(shared).await?;
    if shared.open_persisted.load(Ordering::Acquire) {
        return Ok(());
    }
    let trip = {
        let mut gate = lock_gate(&shared.remediator);
        gate.breaker.trip().cloned().map(|t| (t.reason, gate.breaker.counted(Instant::now())))
    };
    let Some((reason, counted)) = trip else { return Ok(()) };
    let _writing = shared.status_writes.lock().await;
    shared.status.patch(&control::trip_patch(&reason, &control::now(), counted)).await?;
    shared.open_persisted.store(true, Ordering::Release);
    BreakerTripped { reason: &reason }.emit();
    record_status_event(
        shared,
        "CircuitBreakerTripped",
        &format!("No new quarantines until `gpumedic breaker reset`: {reason}"),
        true,
    )
    .await;
    Ok(())
}

/// Follows the status object while leading: the pause, a reset request, and a breaker the object
/// shows closed while this leader holds it open (re-written: only a reset closes it).
pub(crate) async fn watch_status(shared: Arc<Shared>, term: CancellationToken) -> Result<(), TermError> {
    loop {
        if let Err(e) = follow_status(&shared).await {
            tracing::warn!(error = %e, "Cannot read the status object; keeping the last pause and breaker state.");
        }
        tokio::select! {
            () = term.cancelled() => return Ok(()),
            () = tokio::time::sleep(shared.control_poll) => {}
        }
    }
}

pub(crate) async fn follow_status(shared: &Shared) -> Result<(), TermError> {
    let status = shared.status.read().await?;
    if status.paused != shared.remediator.paused() {
        PauseChanged { paused: status.paused, by: &status.paused_by, reason: &status.pause_reason }.emit();
        shared.remediator.set_paused(status.paused);
    }
    if status.reset_requested() {
        let by = status.reset_requested_by.clone().unwrap_or_else(|| "unknown".to_owned());
        let _writing = shared.status_writes.lock().await;
        let was_open = lock_gate(&shared.remediator).breaker.trip().is_some();
        lock_gate(&shared.remediator).breaker.reset();
        shared.status.patch(&control::reset_done_patch(&by, &control::now())).await?;
        shared.persisted_ledger.lock().unwrap_or_else(std::sync::PoisonError::into_inner).clear();
        shared.open_persisted.store(false, Ordering::Release);
        BreakerReset { by: &by, was_open }.emit();
        drop(_writing);
        record_status_event(
            shared,
            "CircuitBreakerReset",
            &format!("Reset by {by}; the quarantine budget starts afresh"),
            false,
        )
        .await;
        return Ok(());
    }
    shared.open_persisted.store(status.breaker_open, Ordering::Release);
    if status.breaker_open && lock_gate(&shared.remediator).breaker.trip().is_none() {
        // Opened by hand (`breaker: open`): honour it like a trip.
        let reason = status.breaker_reason.unwrap_or_else(|| "opened in the status object".to_owned());
        lock_gate(&shared.remediator).breaker.open(reason, Instant::now());
        events::breaker_open(true);
    }
    persist_trip(shared).await
}

/// An Event on the status object, so `kubectl describe configmap` tells the breaker's story.
pub(crate) async fn record_status_event(shared: &Shared, reason: &str, message: &str, warning: bool) {
    let settings = shared.remediator.settings();
    if let Err(e) = control::record_event(
        &shared.remediator.client(),
        &shared.lease_namespace,
        shared.status.name(),
        &settings.component,
        reason,
        message,
        warning,
    )
    .await
    {
        tracing::warn!(error = %e, %reason, "Could not record an Event on the status object.");
    }
}

/// Publishes `outcome` on the actions topic and waits for the acknowledgement.
pub(crate) async fn publish(shared: &Shared, outcome: &ActionOutcome, trace: Option<&[u8]>) -> Result<(), HandleError> {
    let status =
        serde_json::to_value(outcome.status).ok().and_then(|v| v.as_str().map(str::to_owned)).unwrap_or_default();
    // The label is the status as the action record spells it (blocked_by_breaker, dry_run, ...).
    let action =
        serde_json::to_value(outcome.action).ok().and_then(|v| v.as_str().map(str::to_owned)).unwrap_or_default();
    OutcomePublished { action, status }.emit();
    let bytes = shared.codec.encode(outcome).map_err(|e| HandleError::Invalid(e.to_string()))?;
    let id = outcome.verdict_id.to_string();
    let envelope = kafka::Envelope {
        topic: &shared.actions_topic,
        key: &outcome.node,
        id: &id,
        content_type: ActionOutcome::CONTENT_TYPE,
        incoming_trace: trace,
    };
    kafka::publish_record(&shared.producer, envelope, &bytes).await.map_err(|e| HandleError::Retry(Box::new(e)))
}

#[cfg(test)]
mod tests {
    use super::NodeLocks;
    use std::time::Duration;

    #[tokio::test]
    async fn a_node_is_acted_on_by_one_holder_at_a_time_and_other_nodes_do_not_wait() {
        let locks = NodeLocks::default();
        let held = locks.lock("node-a").await;
        // Another node's lock is free while node-a's is held.
        let other = tokio::time::timeout(Duration::from_secs(5), locks.lock("node-b")).await;
        assert!(other.is_ok(), "node-b waited for node-a's lock");
        // node-a's second holder waits until the first lets go.
        let second = tokio::time::timeout(Duration::from_millis(50), locks.lock("node-a")).await;
        assert!(second.is_err(), "node-a's lock was taken twice at once");
        drop(held);
        let second = tokio::time::timeout(Duration::from_secs(5), locks.lock("node-a")).await;
        assert!(second.is_ok(), "node-a's lock was not released with its guard");
    }
}
