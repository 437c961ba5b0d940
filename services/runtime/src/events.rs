//! The runtime's notable events, each with its log line and its metric in one place, and the
//! names of the metrics every service shares.
//!
//! A notable event (a record dead-lettered, a handler retried, a batch handled) is a small type
//! whose [`InternalEvent::emit`] writes the log line and updates the counter together, so the two
//! cannot drift apart and a metric's name is spelled once. Each service crate keeps its own
//! events the same way, in its `events` module, implementing [`InternalEvent`]. Plain debug logs
//! stay inline.
//!
//! The runtime's metrics are per service (`gpumedic_<service>_records_total`): their suffixes are
//! the constants in [`names`], joined by [`metric_name`].

use std::fmt::Display;
use std::time::Duration;

use crate::kafka::Record;

/// A notable event: [`emit`](InternalEvent::emit) writes its log line and updates its metrics.
pub trait InternalEvent: Sized {
    /// Logs the event and counts it.
    fn emit(self);
}

/// An error that names its kind for the failure counters: a short, fixed, low-cardinality label
/// (`kubernetes`, `conflict`, ...), never the error's text.
pub trait MetricLabel {
    /// The value of the `kind` label this error is counted under.
    fn metric_label(&self) -> &'static str;
}

/// The suffixes of the metrics every service has, after `gpumedic_<service>_`. Dashboards, alerts
/// (`k8s/components/`) and tests read these names: they never change.
pub mod names {
    /// Records consumed, by `topic` and `outcome` (`ok`, `dead_lettered`).
    pub const RECORDS_TOTAL: &str = "records_total";
    /// Failed handler attempts that are retried, by `kind`.
    pub const HANDLER_RETRIES_TOTAL: &str = "handler_retries_total";
    /// Records the handler failed on the same permanent way too often, by `topic`.
    pub const POISON_RECORDS_TOTAL: &str = "poison_records_total";
    /// Records the dead-letter topic refused for good, by `topic`.
    pub const DEAD_LETTERS_FAILED_TOTAL: &str = "dead_letters_failed_total";
    /// Batches handled.
    pub const BATCHES_TOTAL: &str = "batches_total";
    /// How long a batch took to handle.
    pub const BATCH_SECONDS: &str = "batch_seconds";
    /// How long a record took to handle, retries included, by `topic`.
    pub const RECORD_SECONDS: &str = "record_seconds";
    /// How old a record was when its effect became durable, by `topic`.
    pub const RECORD_AGE_SECONDS: &str = "record_age_seconds";
    /// The consumer lag of one partition, by `topic` and `partition`.
    pub const PARTITION_LAG: &str = "partition_lag";
    /// The consumer lag summed over a topic's partitions, by `topic`.
    pub const CONSUMER_LAG: &str = "consumer_lag";
    /// 1 while the service runs.
    pub const UP: &str = "up";
    /// Requests to the read-only API, by `result`.
    pub const API_AUTH_TOTAL: &str = "api_auth_total";
    /// TokenReviews and SubjectAccessReviews sent, by `review`.
    pub const API_AUTH_REVIEWS_TOTAL: &str = "api_auth_reviews_total";
}

/// The full name of one of `service`'s shared metrics: `gpumedic_<service>_<suffix>`.
pub fn metric_name(service: &str, suffix: &str) -> String {
    format!("gpumedic_{service}_{suffix}")
}

/// Records of one topic reached an outcome (`ok`, `dead_lettered`): counted, not logged (the hot
/// path; a dead letter is logged when it is sent).
#[derive(Debug)]
pub struct RecordsHandled<'a> {
    /// The service.
    pub service: &'a str,
    /// The topic they came from.
    pub topic: &'a str,
    /// `ok` or `dead_lettered`.
    pub outcome: &'static str,
    /// How many.
    pub count: u64,
}

impl InternalEvent for RecordsHandled<'_> {
    fn emit(self) {
        metrics::counter!(metric_name(self.service, names::RECORDS_TOTAL), "topic" => self.topic.to_owned(),
            "outcome" => self.outcome)
        .increment(self.count);
    }
}

/// A record handler failed and the record is tried again after `backoff`.
#[derive(Debug)]
pub struct RecordRetried<'a, E: Display> {
    /// The service.
    pub service: &'a str,
    /// The failure's kind ([`MetricLabel`]).
    pub kind: &'static str,
    /// The record.
    pub record: &'a Record,
    /// The failure.
    pub error: &'a E,
    /// How long until the next attempt.
    pub backoff: Duration,
}

impl<E: Display> InternalEvent for RecordRetried<'_, E> {
    fn emit(self) {
        count_retry(self.service, self.kind);
        tracing::warn!(error = %self.error, kind = self.kind, topic = %self.record.topic, offset = self.record.offset,
            backoff_ms = self.backoff.as_millis() as u64, "Handler failed; retrying.");
    }
}

/// A batch handler failed and the batch is offered again after `backoff`; `attempt` counts the
/// failures about the records themselves (`None` for an outage, retried without limit).
#[derive(Debug)]
pub struct BatchRetried<'a, E: Display> {
    /// The service.
    pub service: &'a str,
    /// The failure's kind ([`MetricLabel`]).
    pub kind: &'static str,
    /// How many records the batch holds.
    pub records: usize,
    /// The how-manieth permanent failure this is, if it is one.
    pub attempt: Option<u32>,
    /// The failure.
    pub error: &'a E,
    /// How long until the next attempt.
    pub backoff: Duration,
}

impl<E: Display> InternalEvent for BatchRetried<'_, E> {
    fn emit(self) {
        count_retry(self.service, self.kind);
        let backoff_ms = self.backoff.as_millis() as u64;
        match self.attempt {
            Some(attempt) => tracing::warn!(error = %self.error, kind = self.kind, records = self.records, attempt,
                backoff_ms, "Batch handler failed on the records themselves; retrying the batch."),
            None => tracing::warn!(error = %self.error, kind = self.kind, records = self.records, backoff_ms,
                "Batch handler failed; retrying the batch."),
        }
    }
}

/// Counts one failed handler attempt that is retried, under its kind.
pub(crate) fn count_retry(service: &str, kind: &'static str) {
    metrics::counter!(metric_name(service, names::HANDLER_RETRIES_TOTAL), "kind" => kind).increment(1);
}

/// The handler failed on a record in the same permanent way too often: it goes to the
/// dead-letter topic.
#[derive(Debug)]
pub struct RecordPoisoned<'a> {
    /// The service.
    pub service: &'a str,
    /// The record.
    pub record: &'a Record,
    /// How many times it failed.
    pub attempts: u32,
    /// The failure, as the dead letter carries it.
    pub reason: &'a str,
}

impl InternalEvent for RecordPoisoned<'_> {
    fn emit(self) {
        let r = self.record;
        metrics::counter!(metric_name(self.service, names::POISON_RECORDS_TOTAL), "topic" => r.topic.clone())
            .increment(1);
        tracing::warn!(topic = %r.topic, partition = r.partition, offset = r.offset, attempts = self.attempts,
            reason = %self.reason,
            "The handler fails on this record the same way every time; it goes to the dead-letter topic.");
    }
}

/// The dead-letter topic refused a record for good: it is given up and its offset committed.
/// Data is lost, so this is an error.
#[derive(Debug)]
pub struct DeadLetterGivenUp<'a, E: Display> {
    /// The service.
    pub service: &'a str,
    /// The record.
    pub record: &'a Record,
    /// Why the dead-letter topic refused it.
    pub error: &'a E,
    /// Why it was being dead-lettered.
    pub reason: &'a str,
}

impl<E: Display> InternalEvent for DeadLetterGivenUp<'_, E> {
    fn emit(self) {
        let r = self.record;
        metrics::counter!(metric_name(self.service, names::DEAD_LETTERS_FAILED_TOTAL), "topic" => r.topic.clone())
            .increment(1);
        let key = r.key.as_deref().map(String::from_utf8_lossy).unwrap_or_default();
        tracing::error!(error = %self.error, topic = %r.topic, partition = r.partition, offset = r.offset,
            key = %key, reason = %self.reason,
            "The dead-letter topic refuses the record for good; it is given up and its offset committed.");
    }
}

/// A batch's effects are durable (counted; its records are counted by [`RecordsHandled`]).
#[derive(Debug)]
pub struct BatchHandled<'a> {
    /// The service.
    pub service: &'a str,
    /// How long it took, retries included.
    pub elapsed: Duration,
}

impl InternalEvent for BatchHandled<'_> {
    fn emit(self) {
        metrics::counter!(metric_name(self.service, names::BATCHES_TOTAL)).increment(1);
        metrics::histogram!(metric_name(self.service, names::BATCH_SECONDS)).record(self.elapsed.as_secs_f64());
    }
}

/// A record's effect is durable: how long it took to handle, retries included, and how old it
/// was then (`age`, from its Kafka timestamp: the pipeline's latency up to this stage).
#[derive(Debug)]
pub struct RecordSettled<'a> {
    /// The service.
    pub service: &'a str,
    /// The topic it came from.
    pub topic: &'a str,
    /// How long it took to handle.
    pub elapsed: Duration,
    /// How old it was, when it has a timestamp.
    pub age: Option<Duration>,
}

impl InternalEvent for RecordSettled<'_> {
    fn emit(self) {
        metrics::histogram!(metric_name(self.service, names::RECORD_SECONDS), "topic" => self.topic.to_owned())
            .record(self.elapsed.as_secs_f64());
        if let Some(age) = self.age {
            metrics::histogram!(metric_name(self.service, names::RECORD_AGE_SECONDS), "topic" => self.topic.to_owned())
                .record(age.as_secs_f64());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shared_metrics_are_named_after_the_service() {
        assert_eq!(metric_name("enricher", names::RECORDS_TOTAL), "gpumedic_enricher_records_total");
        assert_eq!(
            metric_name("remediator", names::HANDLER_RETRIES_TOTAL),
            "gpumedic_remediator_handler_retries_total"
        );
    }
}
