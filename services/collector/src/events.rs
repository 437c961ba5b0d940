//! The collector's notable events, each with its log line and its metrics in one place, and the
//! names of its metrics ([`names`]).
//!
//! An event is a small type whose [`InternalEvent::emit`] writes the log line and updates the
//! counters together (the runtime's pattern, `gpumedic_runtime::events`). Plain debug logs, and
//! counters that say all there is to say, stay where they are, under the names here.

use std::fmt::{Debug, Display};
use std::time::Duration;

pub(crate) use gpumedic_runtime::events::InternalEvent;

/// The collector's metric names. Dashboards and alerts (`k8s/components/`), the docs and the tests
/// read them: they never change.
pub(crate) mod names {
    /// Health events published, by `kind`.
    pub(crate) const EVENTS_TOTAL: &str = "gpumedic_collector_events_total";
    /// Health events Kafka refused for good, by `kind`.
    pub(crate) const EVENTS_REFUSED_TOTAL: &str = "gpumedic_collector_events_refused_total";
    /// Faults dropped because the publisher took nothing for a long time, by `kind`.
    pub(crate) const EVENTS_LOST_TOTAL: &str = "gpumedic_collector_events_lost_total";
    /// Heartbeats dropped while the publisher was busy.
    pub(crate) const HEARTBEATS_DROPPED_TOTAL: &str = "gpumedic_collector_heartbeats_dropped_total";
    /// Health events written to the spool, by `kind`.
    pub(crate) const SPOOLED_TOTAL: &str = "gpumedic_collector_spooled_total";
    /// 1 while Kafka acknowledges events.
    pub(crate) const KAFKA_UP: &str = "gpumedic_collector_kafka_up";
    /// Events Kafka did not acknowledge.
    pub(crate) const DELIVERY_FAILURES_TOTAL: &str = "gpumedic_collector_delivery_failures_total";
    /// Bytes in the spool.
    pub(crate) const SPOOL_BYTES: &str = "gpumedic_collector_spool_bytes";
    /// Records in the spool.
    pub(crate) const SPOOL_RECORDS: &str = "gpumedic_collector_spool_records";
    /// Spool segments truncated at a torn record.
    pub(crate) const SPOOL_TRUNCATED_TOTAL: &str = "gpumedic_collector_spool_truncated_total";
    /// Records the spool dropped, by `kind`.
    pub(crate) const SPOOL_DROPPED_TOTAL: &str = "gpumedic_collector_spool_dropped_total";
    /// InfiniBand port reads that failed.
    pub(crate) const NETWORK_READ_FAILURES_TOTAL: &str = "gpumedic_collector_network_read_failures_total";
    /// Network health events, by `check`.
    pub(crate) const NETWORK_EVENTS_TOTAL: &str = "gpumedic_collector_network_events_total";
    /// Node token re-reads that failed.
    pub(crate) const NODE_TOKEN_READ_FAILURES_TOTAL: &str = "gpumedic_collector_node_token_read_failures_total";
    /// Node key announcements that could not be published.
    pub(crate) const NODE_KEY_PUBLISH_FAILURES_TOTAL: &str = "gpumedic_collector_node_key_publish_failures_total";
    /// GPU samples that hung, by `monitor`.
    pub(crate) const MONITOR_HUNG_TOTAL: &str = "gpumedic_collector_monitor_hung_total";
    /// GPU backends that could not be opened, by `monitor`.
    pub(crate) const BACKEND_OPEN_FAILURES_TOTAL: &str = "gpumedic_collector_backend_open_failures_total";
    /// Kernel log reads that failed.
    pub(crate) const KMSG_READ_FAILURES_TOTAL: &str = "gpumedic_collector_kmsg_read_failures_total";
    /// Kernel log records not published, by `reason`.
    pub(crate) const KMSG_RECORDS_SKIPPED_TOTAL: &str = "gpumedic_collector_kmsg_records_skipped_total";
    /// Kernel log records overwritten before they were read.
    pub(crate) const KMSG_RECORDS_LOST_TOTAL: &str = "gpumedic_collector_kmsg_records_lost_total";
    /// DCGM calls that failed, by `monitor`.
    pub(crate) const DCGM_FAILURES_TOTAL: &str = "gpumedic_collector_dcgm_failures_total";
    /// DCGM health checks, by `overall`.
    pub(crate) const DCGM_HEALTH_CHECKS_TOTAL: &str = "gpumedic_collector_dcgm_health_checks_total";
    /// DCGM diagnostics, by `result`.
    pub(crate) const DCGM_DIAG_RUNS_TOTAL: &str = "gpumedic_collector_dcgm_diag_runs_total";
    /// Synthetic events published on request.
    pub(crate) const SYNTHETIC_EVENTS_TOTAL: &str = "gpumedic_collector_synthetic_events_total";
    /// Events taken over the ingest API, by `outcome`.
    pub(crate) const INGEST_EVENTS_TOTAL: &str = "gpumedic_collector_ingest_events_total";
    /// Ingest calls refused, by `code`.
    pub(crate) const INGEST_CALLS_REFUSED_TOTAL: &str = "gpumedic_collector_ingest_calls_refused_total";
    /// Cloud maintenance notices, by `provider` and `state`.
    pub(crate) const CLOUD_NOTICES_TOTAL: &str = "gpumedic_collector_cloud_notices_total";
    /// Cloud maintenance polls that failed, by `provider`.
    pub(crate) const CLOUD_POLL_FAILURES_TOTAL: &str = "gpumedic_collector_cloud_poll_failures_total";
}

/// Kafka refuses a health event for good: it is not kept (data loss, so an error).
pub(crate) struct EventRefused<'a, I: Display, E: Display> {
    pub(crate) id: &'a I,
    pub(crate) kind: &'a str,
    pub(crate) error: &'a E,
    /// Its size, for a fresh event; `None` for one taken from the spool.
    pub(crate) bytes: Option<usize>,
}

impl<I: Display, E: Display> InternalEvent for EventRefused<'_, I, E> {
    fn emit(self) {
        metrics::counter!(names::EVENTS_REFUSED_TOTAL, "kind" => self.kind.to_owned()).increment(1);
        match self.bytes {
            Some(bytes) => tracing::error!(id = %self.id, kind = %self.kind, bytes, error = %self.error,
                "Kafka refuses a health event for good; it is not kept."),
            None => tracing::error!(id = %self.id, kind = %self.kind, error = %self.error,
                "Kafka refuses a spooled health event for good; it is removed from the spool."),
        }
    }
}

/// The publisher took nothing for a long time: the sampler's oldest waiting fault is dropped.
pub(crate) struct EventLost<'a, I: Display, K: Debug> {
    pub(crate) event_id: &'a I,
    pub(crate) kind: &'a K,
}

impl<I: Display, K: Debug> InternalEvent for EventLost<'_, I, K> {
    fn emit(self) {
        metrics::counter!(names::EVENTS_LOST_TOTAL, "kind" => format!("{:?}", self.kind)).increment(1);
        tracing::error!(event_id = %self.event_id,
            "The publisher has taken nothing for a long time; dropping the sampler's oldest waiting fault.");
    }
}

/// Kafka did not acknowledge an event; while it was up, that starts spooling.
pub(crate) struct DeliveryFailed<'a> {
    pub(crate) error: &'a str,
    /// Whether Kafka was taking events until now (the log line is said once per outage).
    pub(crate) was_up: bool,
}

impl InternalEvent for DeliveryFailed<'_> {
    fn emit(self) {
        metrics::counter!(names::DELIVERY_FAILURES_TOTAL).increment(1);
        if self.was_up {
            tracing::warn!(error = %self.error, "Kafka did not acknowledge an event; spooling events to disk until it does.");
        }
    }
}

/// A spool segment ended in a torn or corrupt record (a crash while writing); it is truncated.
pub(crate) struct SpoolTruncated<'a, P: Display> {
    pub(crate) path: &'a P,
    pub(crate) bytes: u64,
}

impl<P: Display> InternalEvent for SpoolTruncated<'_, P> {
    fn emit(self) {
        metrics::counter!(names::SPOOL_TRUNCATED_TOTAL).increment(1);
        tracing::warn!(path = %self.path, bytes = self.bytes,
            "The spool segment ends in a torn or corrupt record (a crash while writing); truncating it there.");
    }
}

/// The spool is full: its oldest healthy evidence (heartbeats) is dropped to keep the faults.
pub(crate) struct SpoolFull<'a> {
    /// How many records of each kind were dropped.
    pub(crate) dropped: &'a [(&'a str, u64)],
    /// The segment they were dropped from.
    pub(crate) segment: u64,
}

impl InternalEvent for SpoolFull<'_> {
    fn emit(self) {
        for (kind, n) in self.dropped {
            metrics::counter!(names::SPOOL_DROPPED_TOTAL, "kind" => (*kind).to_owned()).increment(*n);
        }
        let total: u64 = self.dropped.iter().map(|(_, n)| n).sum();
        tracing::warn!(
            dropped = total,
            segment = self.segment,
            "The spool is full; dropping its oldest healthy evidence (heartbeats) to keep the faults."
        );
    }
}

/// The InfiniBand ports could not be read.
pub(crate) struct NetworkReadFailed<'a, E: Display> {
    pub(crate) error: &'a E,
}

impl<E: Display> InternalEvent for NetworkReadFailed<'_, E> {
    fn emit(self) {
        metrics::counter!(names::NETWORK_READ_FAILURES_TOTAL).increment(1);
        tracing::warn!(error = %self.error, "The InfiniBand ports cannot be read; trying again at the next interval.");
    }
}

/// The node token could not be re-read; records keep the last one read.
pub(crate) struct NodeTokenReadFailed<'a, E: Display> {
    pub(crate) error: &'a E,
    /// Whether this starts a run of failures (the log line is said once per run).
    pub(crate) first: bool,
}

impl<E: Display> InternalEvent for NodeTokenReadFailed<'_, E> {
    fn emit(self) {
        metrics::counter!(names::NODE_TOKEN_READ_FAILURES_TOTAL).increment(1);
        if self.first {
            tracing::warn!(error = %self.error,
                "Cannot re-read the node token; records keep the last one read, which expires.");
        }
    }
}

/// A GPU sample hung; it is reported.
pub(crate) struct MonitorHung {
    pub(crate) monitor: &'static str,
    pub(crate) timeout: Duration,
}

impl InternalEvent for MonitorHung {
    fn emit(self) {
        metrics::counter!(names::MONITOR_HUNG_TOTAL, "monitor" => self.monitor).increment(1);
        tracing::warn!(
            monitor = self.monitor,
            timeout_ms = self.timeout.as_millis() as u64,
            "A GPU sample hung; reporting it."
        );
    }
}

/// Kernel log records were overwritten before they were read.
pub(crate) struct KmsgRecordsLost;

impl InternalEvent for KmsgRecordsLost {
    fn emit(self) {
        metrics::counter!(names::KMSG_RECORDS_LOST_TOTAL).increment(1);
        tracing::warn!("Kernel log records were overwritten before they were read.");
    }
}

/// The DCGM diagnostic finished.
pub(crate) struct DiagFinished {
    pub(crate) failed: usize,
    pub(crate) tests: usize,
}

impl InternalEvent for DiagFinished {
    fn emit(self) {
        let result = if self.failed > 0 { "fail" } else { "pass" };
        metrics::counter!(names::DCGM_DIAG_RUNS_TOTAL, "result" => result).increment(1);
        tracing::info!(failed = self.failed, tests = self.tests, "The DCGM diagnostic finished.");
    }
}

/// An ingest call was refused.
pub(crate) struct IngestCallRefused<'a, E: Display> {
    pub(crate) index: usize,
    pub(crate) error: &'a E,
    pub(crate) code: String,
}

impl<E: Display> InternalEvent for IngestCallRefused<'_, E> {
    fn emit(self) {
        metrics::counter!(names::INGEST_CALLS_REFUSED_TOTAL, "code" => self.code).increment(1);
        tracing::warn!(index = self.index, error = %self.error, "Refused an ingest call.");
    }
}
