//! The classifier's notable events, each with its log line and its metrics in one place, the
//! names of its metrics ([`names`]), and the kinds its failures are counted under.
//!
//! An event is a small type whose [`InternalEvent::emit`] writes the log line and updates the
//! counters together (the runtime's pattern, `gpumedic_runtime::events`). Plain debug logs stay
//! where they are.

use std::fmt::{Debug, Display};
use std::time::Duration;

pub(crate) use gpumedic_runtime::events::{InternalEvent, MetricLabel};

use crate::classifier::ClassifierError;
use crate::retention::Report;

/// The classifier's metric names. Dashboards and alerts (`k8s/components/`), the load tests and
/// the tests read them: they never change.
pub(crate) mod names {
    /// Verdicts published, by `rule`, `severity` and `recovery`.
    pub(crate) const VERDICTS_TOTAL: &str = "gpumedic_classifier_verdicts_total";
    /// Workload faults found (one job's errors on several nodes).
    pub(crate) const WORKLOAD_FAULTS_TOTAL: &str = "gpumedic_classifier_workload_faults_total";
    /// How long rebuilding the state of newly assigned partitions took.
    pub(crate) const REBUILD_SECONDS: &str = "gpumedic_classifier_rebuild_seconds";
    /// Nodes whose state this replica holds.
    pub(crate) const OWNED_NODES: &str = "gpumedic_classifier_owned_nodes";
    /// Nodes whose rules wait for time to pass.
    pub(crate) const NODES_AWAITING_TIME: &str = "gpumedic_classifier_nodes_awaiting_time";
    /// Where a batch's time goes, by `stage`.
    pub(crate) const BATCH_STAGE_SECONDS: &str = "gpumedic_classifier_batch_stage_seconds";
    /// Observations classified.
    pub(crate) const EVENTS_TOTAL: &str = "gpumedic_classifier_events_total";
    /// Event rows written.
    pub(crate) const RECORDED_EVENTS_TOTAL: &str = "gpumedic_classifier_recorded_events_total";
    /// Rollup rows written.
    pub(crate) const ROLLUPS_TOTAL: &str = "gpumedic_classifier_rollups_total";
    /// Closed rollups given up at stop, their write failing (`crate::rollups`).
    pub(crate) const ROLLUPS_LOST_TOTAL: &str = "gpumedic_classifier_rollups_lost_total";
    /// Events already recorded (redelivered).
    pub(crate) const DUPLICATE_EVENTS_TOTAL: &str = "gpumedic_classifier_duplicate_events_total";
    /// Events whose time was bounded by their record's.
    pub(crate) const CLOCK_SKEW_CLAMPED_TOTAL: &str = "gpumedic_classifier_clock_skew_clamped_total";
    /// Impossible observations refused, by `reason`.
    pub(crate) const INVALID_INPUTS_TOTAL: &str = "gpumedic_classifier_invalid_inputs_total";
    /// Parts found to be lemons, by `part`.
    pub(crate) const LEMONS_TOTAL: &str = "gpumedic_classifier_lemons_total";
    /// Rule reloads, by `result` (`ok`, `refused`).
    pub(crate) const RULE_RELOADS_TOTAL: &str = "gpumedic_classifier_rule_reloads_total";
    /// Events absorbed into a root incident, by `root` (`node`, `nvlink_domain`).
    pub(crate) const SYMPATHETIC_EVENTS_TOTAL: &str = "gpumedic_classifier_sympathetic_events_total";
    /// Retention runs, by `result`.
    pub(crate) const RETENTION_RUNS_TOTAL: &str = "gpumedic_classifier_retention_runs_total";
    /// Daily event partitions created.
    pub(crate) const EVENT_PARTITIONS_CREATED_TOTAL: &str = "gpumedic_classifier_event_partitions_created_total";
    /// Daily event partitions dropped.
    pub(crate) const EVENT_PARTITIONS_DROPPED_TOTAL: &str = "gpumedic_classifier_event_partitions_dropped_total";
    /// Expired rows deleted from the default event partition.
    pub(crate) const EXPIRED_EVENTS_DELETED_TOTAL: &str = "gpumedic_classifier_expired_events_deleted_total";
}

impl MetricLabel for ClassifierError {
    fn metric_label(&self) -> &'static str {
        match self {
            Self::Database(_) | Self::Query(_) => "postgres",
            Self::Migrate(_) => "migration",
            Self::Kafka(_) => "kafka",
            Self::Ownership(_) => "ownership",
        }
    }
}

/// A verdict was published and acknowledged.
pub(crate) struct VerdictPublished<'a, V: Display, S: Debug, A: Debug> {
    pub(crate) node: &'a str,
    pub(crate) rule: &'a str,
    pub(crate) severity: &'a S,
    pub(crate) action: &'a A,
    pub(crate) recovery: bool,
    pub(crate) verdict_id: &'a V,
}

impl<V: Display, S: Debug, A: Debug> InternalEvent for VerdictPublished<'_, V, S, A> {
    fn emit(self) {
        tracing::info!(node = %self.node, rule = %self.rule, severity = ?self.severity, action = ?self.action,
            recovery = self.recovery, verdict_id = %self.verdict_id, "Verdict published.");
        // The rule is a label: rules are few (the rules directory's), and a dashboard shows
        // which of them decide.
        metrics::counter!(names::VERDICTS_TOTAL, "rule" => self.rule.to_owned(),
            "severity" => format!("{:?}", self.severity).to_lowercase(), "recovery" => self.recovery.to_string())
        .increment(1);
    }
}

/// One job's application errors on several nodes: a workload fault, no node action.
pub(crate) struct WorkloadFault<'a, V: Display, X: Debug> {
    pub(crate) workload: &'a str,
    pub(crate) nodes: usize,
    pub(crate) gpus: usize,
    pub(crate) xids: &'a X,
    pub(crate) verdict_id: &'a V,
}

impl<V: Display, X: Debug> InternalEvent for WorkloadFault<'_, V, X> {
    fn emit(self) {
        tracing::warn!(workload = %self.workload, nodes = self.nodes, gpus = self.gpus, xids = ?self.xids,
            verdict_id = %self.verdict_id, "Workload fault: one job's application errors on several nodes; no node action.");
        metrics::counter!(names::WORKLOAD_FAULTS_TOTAL).increment(1);
    }
}

/// The state of the nodes of newly assigned partitions was rebuilt from the database.
pub(crate) struct StateRebuilt<'a, P: Debug> {
    pub(crate) partitions: &'a P,
    pub(crate) nodes: usize,
    pub(crate) events: u64,
    pub(crate) open_incidents: usize,
    pub(crate) renamed: usize,
    pub(crate) restored: usize,
    pub(crate) elapsed: Duration,
}

impl<P: Debug> InternalEvent for StateRebuilt<'_, P> {
    fn emit(self) {
        let seconds = self.elapsed.as_secs_f64();
        tracing::info!(partitions = ?self.partitions, nodes = self.nodes, events = self.events,
            open_incidents = self.open_incidents, renamed = self.renamed, restored = self.restored, seconds,
            "Rebuilt the state of the nodes of newly assigned partitions.");
        metrics::histogram!(names::REBUILD_SECONDS).record(seconds);
    }
}

/// How long one stage of a batch took (`decode`, `classify`, `publish`, `write`).
pub(crate) struct BatchStage {
    pub(crate) stage: &'static str,
    pub(crate) elapsed: Duration,
}

impl InternalEvent for BatchStage {
    fn emit(self) {
        metrics::histogram!(names::BATCH_STAGE_SECONDS, "stage" => self.stage).record(self.elapsed.as_secs_f64());
    }
}

/// A batch that took longer than [`SlowBatch::THRESHOLD`] (or whose oldest record had waited that
/// long in Kafka), with where its time went: logged at
/// most once per [`SlowBatch::EVERY`], with the number of slow batches not logged since, so a
/// stall on the fault path can be told apart (waiting for the lock, a Postgres look-up, the
/// publish, the write) without a profiler.
pub(crate) struct SlowBatch<'a> {
    pub(crate) records: usize,
    pub(crate) total: Duration,
    /// How long its oldest record had waited in Kafka when the batch began.
    pub(crate) waited: Duration,
    /// Each step's name and time, in order.
    pub(crate) steps: &'a [(&'static str, Duration)],
}

impl SlowBatch<'_> {
    /// A batch slower than this is logged: ten times a healthy batch under load.
    pub(crate) const THRESHOLD: Duration = Duration::from_millis(250);
    /// At most one slow batch is logged per this interval.
    pub(crate) const EVERY: Duration = Duration::from_secs(10);
}

impl InternalEvent for SlowBatch<'_> {
    fn emit(self) {
        use std::sync::Mutex;
        static LAST: Mutex<(Option<std::time::Instant>, u64)> = Mutex::new((None, 0));
        let mut last = LAST.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        let now = std::time::Instant::now();
        if last.0.is_some_and(|at| now.duration_since(at) < Self::EVERY) {
            last.1 += 1;
            return;
        }
        let unlogged = std::mem::take(&mut last.1);
        last.0 = Some(now);
        drop(last);
        let steps: Vec<String> = self.steps.iter().map(|(name, d)| format!("{name}={}ms", d.as_millis())).collect();
        tracing::warn!(
            records = self.records,
            total_ms = self.total.as_millis() as u64,
            waited_ms = self.waited.as_millis() as u64,
            steps = %steps.join(" "),
            slow_batches_not_logged = unlogged,
            "A batch took long; its steps follow."
        );
    }
}

/// A batch's observations are classified and recorded (counted; the hot path logs nothing).
pub(crate) struct BatchRecorded {
    pub(crate) observations: u64,
    pub(crate) rows: u64,
    pub(crate) duplicates: u64,
}

impl InternalEvent for BatchRecorded {
    fn emit(self) {
        metrics::counter!(names::EVENTS_TOTAL).increment(self.observations);
        metrics::counter!(names::RECORDED_EVENTS_TOTAL).increment(self.rows);
        metrics::counter!(names::DUPLICATE_EVENTS_TOTAL).increment(self.duplicates);
    }
}

/// Closed rollups written to `telemetry_rollups` (counted; the hot path logs nothing).
pub(crate) struct RollupsWritten {
    pub(crate) rollups: usize,
}

impl InternalEvent for RollupsWritten {
    fn emit(self) {
        metrics::counter!(names::ROLLUPS_TOTAL).increment(self.rollups as u64);
    }
}

/// Closed rollups given up: their write still failed when the classifier stopped.
pub(crate) struct RollupsLost<'a, E: Display> {
    pub(crate) rollups: usize,
    pub(crate) error: &'a E,
    /// The classifier is stopping (else the error is one no retry can mend).
    pub(crate) stopping: bool,
}

impl<E: Display> InternalEvent for RollupsLost<'_, E> {
    fn emit(self) {
        if self.stopping {
            tracing::warn!(rollups = self.rollups, error = %self.error,
                "Cannot write closed rollups and the classifier is stopping; they are lost (the events are still in Kafka).");
        } else {
            tracing::error!(rollups = self.rollups, error = %self.error,
                "Cannot write closed rollups, and retrying cannot mend what PostgreSQL refused; they are lost (the events are still in Kafka).");
        }
        metrics::counter!(names::ROLLUPS_LOST_TOTAL).increment(self.rollups as u64);
    }
}

/// An event said it happened after the record carrying it was written; it counts at the record's
/// time.
pub(crate) struct ClockSkewClamped<'a, I: Display, T: Display, R: Display> {
    pub(crate) node: &'a str,
    pub(crate) event_id: &'a I,
    pub(crate) observed_at: &'a T,
    pub(crate) record_time: &'a R,
}

impl<I: Display, T: Display, R: Display> InternalEvent for ClockSkewClamped<'_, I, T, R> {
    fn emit(self) {
        metrics::counter!(names::CLOCK_SKEW_CLAMPED_TOTAL).increment(1);
        tracing::warn!(node = %self.node, event_id = %self.event_id, observed_at = %self.observed_at,
            record_time = %self.record_time,
            "An event said it happened after the record carrying it was written; it counts at the record's time.");
    }
}

/// The engine refused an impossible observation before any rule.
pub(crate) struct InputRefused<'a, I: Display> {
    pub(crate) node: &'a str,
    pub(crate) event_id: &'a I,
    pub(crate) reason: &'static str,
}

impl<I: Display> InternalEvent for InputRefused<'_, I> {
    fn emit(self) {
        metrics::counter!(names::INVALID_INPUTS_TOTAL, "reason" => self.reason).increment(1);
        tracing::warn!(node = %self.node, event_id = %self.event_id, reason = %self.reason,
            "Refused an impossible observation before any rule.");
    }
}

/// A part is a lemon: it stays out of service until an operator replaces it.
pub(crate) struct LemonFound<'a, I: Display, G: Debug, A: Display> {
    pub(crate) part: &'static str,
    pub(crate) node: &'a str,
    pub(crate) gpu: &'a G,
    pub(crate) incident_id: &'a I,
    pub(crate) action: &'a A,
    pub(crate) reason: &'a str,
}

impl<I: Display, G: Debug, A: Display> InternalEvent for LemonFound<'_, I, G, A> {
    fn emit(self) {
        metrics::counter!(names::LEMONS_TOTAL, "part" => self.part).increment(1);
        tracing::error!(node = %self.node, gpu = ?self.gpu, incident_id = %self.incident_id, action = %self.action,
            "A part is a lemon: it stays out of service until an operator replaces it. {}", self.reason);
    }
}

/// New rules were loaded; the state of unchanged rules is kept.
pub(crate) struct RulesReloaded<'a, D: Display> {
    pub(crate) dir: &'a D,
    pub(crate) rules: usize,
}

impl<D: Display> InternalEvent for RulesReloaded<'_, D> {
    fn emit(self) {
        metrics::counter!(names::RULE_RELOADS_TOTAL, "result" => "ok").increment(1);
        tracing::info!(dir = %self.dir, rules = self.rules, "Rules reloaded; state of unchanged rules kept.");
    }
}

/// New rules were refused for their problems; the rules in force stay.
pub(crate) struct RulesRefused<'a, D: Display> {
    pub(crate) dir: &'a D,
    pub(crate) problems: usize,
}

impl<D: Display> InternalEvent for RulesRefused<'_, D> {
    fn emit(self) {
        metrics::counter!(names::RULE_RELOADS_TOTAL, "result" => "refused").increment(1);
        tracing::warn!(dir = %self.dir, problems = self.problems, "New rules refused; the rules in force stay.");
    }
}

/// The retention job maintained the event partitions.
pub(crate) struct RetentionRan<'a> {
    pub(crate) report: &'a Report,
    pub(crate) retention: Duration,
}

impl InternalEvent for RetentionRan<'_> {
    fn emit(self) {
        let r = self.report;
        metrics::counter!(names::RETENTION_RUNS_TOTAL, "result" => "ok").increment(1);
        metrics::counter!(names::EVENT_PARTITIONS_CREATED_TOTAL).increment(r.created.len() as u64);
        metrics::counter!(names::EVENT_PARTITIONS_DROPPED_TOTAL).increment(r.dropped.len() as u64);
        metrics::counter!(names::EXPIRED_EVENTS_DELETED_TOTAL).increment(r.default_rows_deleted);
        let days = |v: &[chrono::NaiveDate]| v.iter().map(|d| d.to_string()).collect::<Vec<_>>().join(",");
        tracing::info!(created = %days(&r.created), dropped = %days(&r.dropped),
            default_rows_deleted = r.default_rows_deleted, sightings_deleted = r.sightings_deleted,
            rollups_deleted = r.rollups_deleted, retention_days = self.retention.as_secs() / 86_400,
            "Event partitions maintained.");
    }
}

/// A sympathetic error joined the root incident of its NVLink peer instead of opening its own.
pub(crate) struct SympatheticEvent<'a, I: Display, U: Display, G: Debug> {
    /// Where the root was: `node` (the same node) or `nvlink_domain` (another node of the domain).
    pub(crate) root: &'static str,
    pub(crate) node: &'a str,
    pub(crate) gpu: &'a G,
    pub(crate) event_id: &'a I,
    pub(crate) incident_id: &'a U,
    pub(crate) root_node: &'a str,
    pub(crate) root_gpu: &'a G,
}

impl<I: Display, U: Display, G: Debug> InternalEvent for SympatheticEvent<'_, I, U, G> {
    fn emit(self) {
        metrics::counter!(names::SYMPATHETIC_EVENTS_TOTAL, "root" => self.root).increment(1);
        tracing::info!(node = %self.node, gpu = ?self.gpu, event_id = %self.event_id, incident_id = %self.incident_id,
            root_node = %self.root_node, root_gpu = ?self.root_gpu, root = self.root,
            "A sympathetic error joined the root incident of its NVLink peer instead of opening its own.");
    }
}

/// The retention job failed; it tries again within the hour.
pub(crate) struct RetentionFailed<'a, E: Display> {
    pub(crate) error: &'a E,
}

impl<E: Display> InternalEvent for RetentionFailed<'_, E> {
    fn emit(self) {
        metrics::counter!(names::RETENTION_RUNS_TOTAL, "result" => "failed").increment(1);
        tracing::warn!(error = %self.error, "Cannot maintain the event partitions; retrying within the hour.");
    }
}
