//! The remediator's notable events, each with its log line and its metrics in one place, and the
//! names of its metrics ([`names`]).
//!
//! An event is a small type whose [`InternalEvent::emit`] writes the log line and updates the
//! counters together (the runtime's pattern, `gpumedic_runtime::events`). Plain debug logs stay
//! where they are.

use std::fmt::{Debug, Display};
use std::time::Duration;

pub(crate) use gpumedic_runtime::events::InternalEvent;

/// The remediator's metric names. Dashboards and alerts (`k8s/components/`) and the tests read
/// them: they never change.
pub(crate) mod names {
    /// 1 while this replica leads.
    pub(crate) const LEADER: &str = "gpumedic_remediator_leader";
    /// Leadership terms begun.
    pub(crate) const LEADERSHIP_TERMS_TOTAL: &str = "gpumedic_remediator_leadership_terms_total";
    /// Leadership terms that ended with the lease lost.
    pub(crate) const LEADERSHIP_LOST_TOTAL: &str = "gpumedic_remediator_leadership_lost_total";
    /// 1 while remediation is paused.
    pub(crate) const PAUSED: &str = "gpumedic_remediator_paused";
    /// 1 while the circuit breaker is open.
    pub(crate) const BREAKER_OPEN: &str = "gpumedic_remediator_breaker_open";
    /// Circuit breaker trips.
    pub(crate) const BREAKER_TRIPS_TOTAL: &str = "gpumedic_remediator_breaker_trips_total";
    /// Circuit breaker resets.
    pub(crate) const BREAKER_RESETS_TOTAL: &str = "gpumedic_remediator_breaker_resets_total";
    /// Action outcomes published, by `action` and `status`.
    pub(crate) const OUTCOMES_TOTAL: &str = "gpumedic_remediator_outcomes_total";
    /// Verdicts not acted on for their age, by `recovery`.
    pub(crate) const STALE_VERDICTS_TOTAL: &str = "gpumedic_remediator_stale_verdicts_total";
    /// Actions deferred, by `until`.
    pub(crate) const DEFERRED_TOTAL: &str = "gpumedic_remediator_deferred_total";
    /// Deferred actions dropped, by `reason`.
    pub(crate) const DEFERRED_REFUSED_TOTAL: &str = "gpumedic_remediator_deferred_refused_total";
    /// Resync runs, by `result`.
    pub(crate) const RESYNC_RUNS_TOTAL: &str = "gpumedic_remediator_resync_runs_total";
    /// How long a resync run took.
    pub(crate) const RESYNC_SECONDS: &str = "gpumedic_remediator_resync_seconds";
    /// Open incidents on the managed nodes at the last resync.
    pub(crate) const RESYNC_OPEN_INCIDENTS: &str = "gpumedic_remediator_resync_open_incidents";
    /// Incidents the resync left alone, by `reason`.
    pub(crate) const RESYNC_SKIPPED_TOTAL: &str = "gpumedic_remediator_resync_skipped_total";
    /// Actions the resync took, by `kind` and `result`.
    pub(crate) const RESYNC_ACTIONS_TOTAL: &str = "gpumedic_remediator_resync_actions_total";
    /// Repair ladders, by `result` (`started`, `remediated`, `failed`).
    pub(crate) const REPAIR_LADDERS_TOTAL: &str = "gpumedic_remediator_repair_ladders_total";
    /// Repair steps, by `action` and `result`.
    pub(crate) const REPAIR_STEPS_TOTAL: &str = "gpumedic_remediator_repair_steps_total";
    /// Validations (Jobs, webhook calls, resources), by `result`.
    pub(crate) const VALIDATIONS_TOTAL: &str = "gpumedic_remediator_validations_total";
    /// Burn-ins after a passed validation, by `result` (one of [`BURN_IN_RESULTS`]).
    pub(crate) const BURN_INS_TOTAL: &str = "gpumedic_remediator_burn_ins_total";
    /// The `result`s of [`BURN_INS_TOTAL`]: started, completed, interrupted (a new fault escalated
    /// the ladder), held (a fault on another GPU holds it), restarted (after such a fault).
    pub(crate) const BURN_IN_RESULTS: [&str; 5] = ["started", "completed", "interrupted", "held", "restarted"];
    /// Unreadable repair ladders ignored.
    pub(crate) const LADDERS_REFUSED_TOTAL: &str = "gpumedic_remediator_ladders_refused_total";
    /// Node writes refused because this replica could not prove it leads.
    pub(crate) const WRITES_REFUSED_NOT_LEADING_TOTAL: &str = "gpumedic_remediator_writes_refused_not_leading_total";
    /// GPU quarantines escalated to the whole node.
    pub(crate) const GPU_QUARANTINE_ESCALATIONS_TOTAL: &str = "gpumedic_remediator_gpu_quarantine_escalations_total";
    /// GPUs quarantined with a DeviceTaintRule.
    pub(crate) const GPU_QUARANTINES_TOTAL: &str = "gpumedic_remediator_gpu_quarantines_total";
    /// GPUs released (DeviceTaintRules deleted).
    pub(crate) const GPU_RELEASES_TOTAL: &str = "gpumedic_remediator_gpu_releases_total";
    /// A verdict's time in the remediator, by `stage`: `delivered` (from the verdict's record
    /// timestamp to its handling), `acted` (its handling, up to the outcome it publishes).
    pub(crate) const VERDICT_SECONDS: &str = "gpumedic_remediator_verdict_seconds";
    /// How long drains took, by `result` (`complete`, `incomplete`).
    pub(crate) const DRAIN_SECONDS: &str = "gpumedic_remediator_drain_seconds";
    /// Drains cut off by their deadline.
    pub(crate) const DRAINS_INCOMPLETE_TOTAL: &str = "gpumedic_remediator_drains_incomplete_total";
    /// Requests to the repair webhook, by `result`.
    pub(crate) const WEBHOOK_REQUESTS_TOTAL: &str = "gpumedic_remediator_webhook_requests_total";
    /// Managed GPU nodes.
    pub(crate) const GPU_NODES: &str = "gpumedic_remediator_gpu_nodes";
    /// Reads of a node the fleet watch's copies could not answer (not listed yet, or a node it
    /// has not delivered), each one an apiserver read instead.
    pub(crate) const NODE_CACHE_MISSES_TOTAL: &str = "gpumedic_remediator_node_cache_misses_total";
}

fn flag(on: bool) -> f64 {
    if on { 1.0 } else { 0.0 }
}

/// This replica took the lease and leads.
pub(crate) struct LeadershipGained<'a> {
    pub(crate) identity: &'a str,
}

impl InternalEvent for LeadershipGained<'_> {
    fn emit(self) {
        tracing::info!(identity = %self.identity, "Leading: this replica holds the lease and acts on verdicts.");
        metrics::gauge!(names::LEADER).set(1.0);
        metrics::counter!(names::LEADERSHIP_TERMS_TOTAL).increment(1);
    }
}

/// This replica lost the lease and stands by again.
pub(crate) struct LeadershipLost;

impl InternalEvent for LeadershipLost {
    fn emit(self) {
        tracing::warn!("Lost the lease: stopped acting and left the consumer group; standing by.");
        metrics::counter!(names::LEADERSHIP_LOST_TOTAL).increment(1);
    }
}

/// The circuit breaker tripped: no new quarantines until an operator resets it.
pub(crate) struct BreakerTripped<'a> {
    pub(crate) reason: &'a str,
}

impl InternalEvent for BreakerTripped<'_> {
    fn emit(self) {
        metrics::gauge!(names::BREAKER_OPEN).set(1.0);
        metrics::counter!(names::BREAKER_TRIPS_TOTAL).increment(1);
        tracing::error!(reason = %self.reason,
            "The circuit breaker tripped: no new quarantines until an operator runs `gpumedic breaker reset`.");
    }
}

/// An operator reset the circuit breaker.
pub(crate) struct BreakerReset<'a> {
    pub(crate) by: &'a str,
    pub(crate) was_open: bool,
}

impl InternalEvent for BreakerReset<'_> {
    fn emit(self) {
        metrics::gauge!(names::BREAKER_OPEN).set(0.0);
        metrics::counter!(names::BREAKER_RESETS_TOTAL).increment(1);
        tracing::warn!(by = %self.by, was_open = self.was_open,
            "The circuit breaker was reset: closed, with a fresh quarantine budget.");
    }
}

/// The breaker's state as loaded or followed from the status object (no log: the caller says why).
pub(crate) fn breaker_open(open: bool) {
    metrics::gauge!(names::BREAKER_OPEN).set(flag(open));
}

/// The pause as loaded from the status object at the start of a term (logged with the term's state).
pub(crate) fn paused(paused: bool) {
    metrics::gauge!(names::PAUSED).set(flag(paused));
}

/// An operator paused or resumed remediation.
pub(crate) struct PauseChanged<'a, B: Debug, R: Debug> {
    pub(crate) paused: bool,
    pub(crate) by: &'a B,
    pub(crate) reason: &'a R,
}

impl<B: Debug, R: Debug> InternalEvent for PauseChanged<'_, B, R> {
    fn emit(self) {
        tracing::warn!(paused = self.paused, by = ?self.by, reason = ?self.reason, "{}",
            if self.paused { "Remediation paused: verdicts are reported, nothing is changed." } else { "Remediation resumed." });
        paused(self.paused);
    }
}

/// A verdict older than `--max-verdict-age` was not acted on.
pub(crate) struct VerdictStale<'a, V: Display> {
    pub(crate) node: &'a str,
    pub(crate) verdict_id: &'a V,
    pub(crate) age: Duration,
    pub(crate) recovery: bool,
}

impl<V: Display> InternalEvent for VerdictStale<'_, V> {
    fn emit(self) {
        tracing::warn!(node = %self.node, verdict_id = %self.verdict_id, age_seconds = self.age.as_secs(),
            "Did not act on a verdict older than --max-verdict-age; its outcome says stale.");
        metrics::counter!(names::STALE_VERDICTS_TOTAL, "recovery" => self.recovery.to_string()).increment(1);
    }
}

/// A verdict was handled: its outcome goes to the actions topic (counted there, by
/// [`OutcomePublished`]).
pub(crate) struct VerdictHandled<'a, V: Display, S: Debug> {
    pub(crate) node: &'a str,
    pub(crate) verdict_id: &'a V,
    pub(crate) status: &'a S,
    pub(crate) detail: &'a str,
}

impl<V: Display, S: Debug> InternalEvent for VerdictHandled<'_, V, S> {
    fn emit(self) {
        tracing::info!(node = %self.node, verdict_id = %self.verdict_id, status = ?self.status,
            detail = %self.detail, "Verdict handled.");
    }
}

/// A verdict was handled: how long it took to reach the remediator after the classifier
/// produced it, and how long acting on it took.
pub(crate) struct VerdictTimed {
    /// From the verdict record's timestamp to the start of its handling; `None` when the
    /// record carries no timestamp or the clocks disagree (a negative time).
    pub(crate) delivered: Option<std::time::Duration>,
    pub(crate) acted: std::time::Duration,
}

impl InternalEvent for VerdictTimed {
    fn emit(self) {
        if let Some(d) = self.delivered {
            metrics::histogram!(names::VERDICT_SECONDS, "stage" => "delivered").record(d.as_secs_f64());
        }
        metrics::histogram!(names::VERDICT_SECONDS, "stage" => "acted").record(self.acted.as_secs_f64());
    }
}

/// An action outcome is being published (counted; the verdict's handling is logged).
pub(crate) struct OutcomePublished {
    /// The action as the action record spells it.
    pub(crate) action: String,
    /// The status as the action record spells it (`applied`, `blocked_by_breaker`, `dry_run`, ...).
    pub(crate) status: String,
}

impl InternalEvent for OutcomePublished {
    fn emit(self) {
        metrics::counter!(names::OUTCOMES_TOTAL, "action" => self.action, "status" => self.status).increment(1);
    }
}

/// An action was deferred: the node is marked now, the rest waits for `until`.
pub(crate) struct ActionDeferred<'a, V: Display, U: Debug> {
    pub(crate) node: &'a str,
    pub(crate) verdict_id: &'a V,
    pub(crate) until: &'a U,
    pub(crate) waits_for: &'a str,
}

impl<V: Display, U: Debug> InternalEvent for ActionDeferred<'_, V, U> {
    fn emit(self) {
        tracing::info!(node = %self.node, verdict_id = %self.verdict_id, until = ?self.until, waits_for = %self.waits_for,
            "Deferred an action: the node is marked now, the rest waits.");
        let label = format!("{:?}", self.until).to_ascii_lowercase();
        metrics::counter!(names::DEFERRED_TOTAL, "until" => label).increment(1);
    }
}

/// A deferred action recorded on a node was dropped without being carried out.
pub(crate) enum DeferredActionRefused<'a> {
    /// Its record could not be read.
    Unreadable { node: &'a str, error: &'a dyn Display },
    /// Its record names another node.
    OtherNode { node: &'a str, names: &'a str },
}

impl InternalEvent for DeferredActionRefused<'_> {
    fn emit(self) {
        let reason = match self {
            Self::Unreadable { node, error } => {
                tracing::warn!(node = %node, error = %error, "Dropping an unreadable deferred action.");
                "unreadable"
            }
            Self::OtherNode { node, names } => {
                tracing::warn!(node = %node, names = %names, "Dropping a deferred action that names another node.");
                "other_node"
            }
        };
        metrics::counter!(names::DEFERRED_REFUSED_TOTAL, "reason" => reason).increment(1);
    }
}

/// A resync run did not finish (or could not reach the incident store).
pub(crate) struct ResyncFailed<'a, E: Display> {
    pub(crate) error: &'a E,
    /// Whether the incident store could not even be reached.
    pub(crate) unreachable: bool,
}

impl<E: Display> InternalEvent for ResyncFailed<'_, E> {
    fn emit(self) {
        if self.unreachable {
            tracing::warn!(error = %self.error, "Cannot reach the incident store; the resync waits for the next interval.");
        } else {
            tracing::warn!(error = %self.error, "The resync did not finish; the next interval tries again.");
        }
        metrics::counter!(names::RESYNC_RUNS_TOTAL, "result" => "failed").increment(1);
    }
}

/// A resync run finished.
pub(crate) struct ResyncFinished {
    pub(crate) elapsed: Duration,
}

impl InternalEvent for ResyncFinished {
    fn emit(self) {
        metrics::counter!(names::RESYNC_RUNS_TOTAL, "result" => "ok").increment(1);
        metrics::histogram!(names::RESYNC_SECONDS).record(self.elapsed.as_secs_f64());
    }
}

/// The resync could not act on an incident.
pub(crate) struct ResyncActionFailed<'a, I: Display, E: Display> {
    pub(crate) node: &'a str,
    pub(crate) incident: &'a I,
    pub(crate) kind: &'static str,
    pub(crate) error: &'a E,
}

impl<I: Display, E: Display> InternalEvent for ResyncActionFailed<'_, I, E> {
    fn emit(self) {
        tracing::warn!(node = %self.node, incident = %self.incident, error = %self.error,
            "The resync could not act on an incident; the next interval tries again.");
        metrics::counter!(names::RESYNC_ACTIONS_TOTAL, "kind" => self.kind, "result" => "failed").increment(1);
    }
}

/// A repair ladder started on a node.
pub(crate) struct LadderStarted<'a, I: Display> {
    pub(crate) node: &'a str,
    pub(crate) incident: &'a I,
    pub(crate) ladder: &'a str,
}

impl<I: Display> InternalEvent for LadderStarted<'_, I> {
    fn emit(self) {
        tracing::info!(node = %self.node, incident = %self.incident, ladder = %self.ladder, "Started a repair ladder.");
        metrics::counter!(names::REPAIR_LADDERS_TOTAL, "result" => "started").increment(1);
    }
}

/// A repair ladder ended with the node healthy again.
pub(crate) struct LadderRemediated<'a, V: Display> {
    pub(crate) node: &'a str,
    pub(crate) verdict_id: &'a V,
}

impl<V: Display> InternalEvent for LadderRemediated<'_, V> {
    fn emit(self) {
        metrics::counter!(names::REPAIR_LADDERS_TOTAL, "result" => "remediated").increment(1);
        tracing::info!(node = %self.node, verdict_id = %self.verdict_id,
            "A repair ladder ended: the node is healthy again.");
    }
}

/// A repair ladder failed on its last step: an operator must act.
pub(crate) struct LadderFailed<'a, V: Display> {
    pub(crate) node: &'a str,
    pub(crate) verdict_id: &'a V,
    pub(crate) detail: &'a str,
}

impl<V: Display> InternalEvent for LadderFailed<'_, V> {
    fn emit(self) {
        metrics::counter!(names::REPAIR_LADDERS_TOTAL, "result" => "failed").increment(1);
        tracing::error!(node = %self.node, verdict_id = %self.verdict_id, detail = %self.detail,
            "A repair ladder failed on its last step: an operator must act.");
    }
}

/// An unreadable repair ladder annotation was ignored.
pub(crate) struct LadderRefused<'a, E: Display> {
    pub(crate) node: &'a str,
    pub(crate) error: &'a E,
}

impl<E: Display> InternalEvent for LadderRefused<'_, E> {
    fn emit(self) {
        tracing::warn!(node = %self.node, error = %self.error, "Ignoring an unreadable repair ladder.");
        metrics::counter!(names::LADDERS_REFUSED_TOTAL).increment(1);
    }
}

/// A repair step started, succeeded or failed (counted; the ladder's outcome and Event tell it).
pub(crate) struct RepairStep {
    pub(crate) action: &'static str,
    pub(crate) result: &'static str,
}

impl InternalEvent for RepairStep {
    fn emit(self) {
        metrics::counter!(names::REPAIR_STEPS_TOTAL, "action" => self.action, "result" => self.result).increment(1);
    }
}

/// A validation Job started or passed (counted; its outcome and Event tell it).
pub(crate) struct Validation {
    pub(crate) result: &'static str,
}

impl InternalEvent for Validation {
    fn emit(self) {
        metrics::counter!(names::VALIDATIONS_TOTAL, "result" => self.result).increment(1);
    }
}

/// A validation Job failed: the repair ladder escalates.
pub(crate) struct ValidationFailed<'a> {
    pub(crate) node: &'a str,
    pub(crate) job: &'a str,
    pub(crate) summary: &'a str,
}

impl InternalEvent for ValidationFailed<'_> {
    fn emit(self) {
        metrics::counter!(names::VALIDATIONS_TOTAL, "result" => "failed").increment(1);
        tracing::warn!(node = %self.node, job = %self.job, summary = %self.summary,
            "The validation failed: the repair ladder escalates.");
    }
}

/// A burn-in started, completed, was held by another incident's fault, or restarted after it
/// (counted; its outcome and Event tell it).
pub(crate) struct BurnIn {
    pub(crate) result: &'static str,
}

impl InternalEvent for BurnIn {
    fn emit(self) {
        metrics::counter!(names::BURN_INS_TOTAL, "result" => self.result).increment(1);
    }
}

/// A new fault arrived during a node's burn-in: the repair ladder escalates.
pub(crate) struct BurnInInterrupted<'a> {
    pub(crate) node: &'a str,
    pub(crate) why: &'a str,
}

impl InternalEvent for BurnInInterrupted<'_> {
    fn emit(self) {
        metrics::counter!(names::BURN_INS_TOTAL, "result" => "interrupted").increment(1);
        tracing::warn!(node = %self.node, why = %self.why,
            "A new fault arrived during the burn-in: the repair ladder escalates.");
    }
}

/// A node write was refused: this replica can no longer prove it holds the lease (the error it
/// returns tells the caller).
pub(crate) struct WriteRefusedNotLeading;

impl InternalEvent for WriteRefusedNotLeading {
    fn emit(self) {
        metrics::counter!(names::WRITES_REFUSED_NOT_LEADING_TOTAL).increment(1);
    }
}

/// A GPU quarantine became a node quarantine: too many of the node's GPUs would be out.
pub(crate) struct GpuQuarantineEscalated<'a> {
    pub(crate) node: &'a str,
    pub(crate) gpu: &'a str,
    pub(crate) quarantined: usize,
    pub(crate) total: usize,
}

impl InternalEvent for GpuQuarantineEscalated<'_> {
    fn emit(self) {
        tracing::info!(node = self.node, gpu = %self.gpu, quarantined = self.quarantined, total = self.total,
            "Escalated a GPU quarantine to the node: too many of its GPUs are out.");
        metrics::counter!(names::GPU_QUARANTINE_ESCALATIONS_TOTAL).increment(1);
    }
}

/// One GPU was quarantined with a DeviceTaintRule.
pub(crate) struct GpuQuarantined<'a, D: Display, I: Display> {
    pub(crate) node: &'a str,
    pub(crate) gpu: &'a str,
    pub(crate) device: &'a D,
    pub(crate) rule: &'a str,
    pub(crate) incident: &'a I,
}

impl<D: Display, I: Display> InternalEvent for GpuQuarantined<'_, D, I> {
    fn emit(self) {
        tracing::info!(node = self.node, gpu = self.gpu, device = %self.device, rule = self.rule,
            incident = %self.incident, "Quarantined one GPU with a DeviceTaintRule.");
        metrics::counter!(names::GPU_QUARANTINES_TOTAL).increment(1);
    }
}

/// GPUs were released: gpumedic's DeviceTaintRules deleted.
pub(crate) struct GpusReleased<'a, I: Display> {
    pub(crate) node: &'a str,
    pub(crate) rules: &'a [String],
    pub(crate) incident: &'a I,
}

impl<I: Display> InternalEvent for GpusReleased<'_, I> {
    fn emit(self) {
        tracing::info!(node = self.node, rules = ?self.rules, incident = %self.incident,
            "Released GPUs: deleted gpumedic's DeviceTaintRules.");
        metrics::counter!(names::GPU_RELEASES_TOTAL).increment(self.rules.len() as u64);
    }
}

/// A drain (of a node, or of one GPU's holders) finished or reached its deadline.
pub(crate) struct Drained<'a> {
    pub(crate) node: &'a str,
    /// The GPU's device, for a GPU's drain.
    pub(crate) device: Option<&'a str>,
    pub(crate) elapsed: Duration,
    /// What was left undrained, when the deadline cut it off.
    pub(crate) incomplete: Option<&'a str>,
}

impl InternalEvent for Drained<'_> {
    fn emit(self) {
        let result = if self.incomplete.is_some() { "incomplete" } else { "complete" };
        metrics::histogram!(names::DRAIN_SECONDS, "result" => result).record(self.elapsed.as_secs_f64());
        let Some(report) = self.incomplete else { return };
        match self.device {
            Some(device) => tracing::warn!(node = self.node, device = %device, report = %report,
                "The GPU's drain did not finish by its deadline; the resync drains again."),
            None => tracing::warn!(node = self.node, report = %report,
                "The drain did not finish by its deadline; the resync drains again."),
        }
        metrics::counter!(names::DRAINS_INCOMPLETE_TOTAL).increment(1);
    }
}
