//! The record-at-a-time loop ([`run_consumer`]) and what every consumer loop shares: the poison
//! rule, the counters registered at zero, latency metrics and the commit at shutdown.

use std::time::Duration;

use rdkafka::consumer::{CommitMode, Consumer as _};
use rdkafka::error::{KafkaError as RdKafkaError, RDKafkaErrorCode};
use tokio_util::sync::CancellationToken;
use tracing::Instrument as _;

use crate::events::{
    InternalEvent as _, RecordPoisoned, RecordRetried, RecordSettled, RecordsHandled, count_retry, metric_name, names,
};
use crate::fault;

use super::{
    Consumer, HandleError, Hold, KafkaError, Producer, Record, RecordHandler, dead_letter_until_done, record_span,
};

/// How often a handler may fail in the same permanent way ([`fault::is_permanent`]) before
/// [`run_consumer`] and [`keyed::run_keyed_consumer`](crate::keyed::run_keyed_consumer) give its
/// record to the dead-letter topic with the error; [`BatchLimits::poison_attempts`] for batches.
pub const DEFAULT_POISON_ATTEMPTS: u32 = 5;
/// A record a handler failed on in the same permanent way too often: counted
/// (`gpumedic_<service>_poison_records_total`) and logged before it goes to the dead-letter topic.
pub(crate) fn report_poison(service: &'static str, record: &Record, attempts: u32, reason: &str) {
    RecordPoisoned { service, record, attempts, reason }.emit();
}

/// Registers, at zero, the consumer counters of `service` for each of its `topics`, so `/metrics`
/// names them before the first record is dead-lettered or retried: dashboards and alerts find
/// them, and `increase()` sees their first step.
pub(crate) fn register_consumer_metrics(service: &str, topics: &[&str]) {
    // Recorded into the exporter `/metrics` renders, however early the consumer is made.
    crate::admin::metrics_handle();
    for kind in fault::KINDS {
        metrics::counter!(metric_name(service, names::HANDLER_RETRIES_TOTAL), "kind" => kind).increment(0);
    }
    for topic in topics {
        let topic = (*topic).to_owned();
        for outcome in ["ok", "dead_lettered"] {
            metrics::counter!(metric_name(service, names::RECORDS_TOTAL), "topic" => topic.clone(), "outcome" => outcome)
                .increment(0);
        }
        for name in [names::DEAD_LETTERS_FAILED_TOTAL, names::POISON_RECORDS_TOTAL] {
            metrics::counter!(metric_name(service, name), "topic" => topic.clone()).increment(0);
        }
    }
}

/// The at-least-once loop: receive, handle, store the offset; dead-letter invalid records; retry
/// transient failures with backoff, polling with the partitions paused meanwhile; dead-letter a
/// record whose handler fails in the same permanent way [`DEFAULT_POISON_ATTEMPTS`] times; on
/// cancellation finish the record in hand (unless it is waiting to be retried) and commit.
pub async fn run_consumer<H: RecordHandler>(
    service: &'static str,
    consumer: Consumer,
    dlq: Producer,
    mut handler: H,
    token: CancellationToken,
) -> Result<(), KafkaError> {
    let mut hold = Hold::new(&consumer);
    'records: loop {
        let Some(record) = hold.next(&token).await else { break };
        let mut backoff = Duration::from_millis(100);
        let mut permanent = 0u32;
        let span = record_span(service, &record);
        let started = std::time::Instant::now();
        loop {
            let refused = match hold.run(handler.handle(&record).instrument(span.clone())).await {
                Ok(()) => {
                    RecordsHandled { service, topic: &record.topic, outcome: "ok", count: 1 }.emit();
                    break;
                }
                Err(HandleError::Invalid(reason)) => Some(reason),
                Err(HandleError::Retry(e)) => {
                    let kind = fault::metric_label(e.as_ref());
                    if fault::is_permanent(e.as_ref()) {
                        permanent += 1;
                    }
                    if permanent >= DEFAULT_POISON_ATTEMPTS {
                        count_retry(service, kind);
                        let reason = fault::error_chain(e.as_ref());
                        report_poison(service, &record, permanent, &reason);
                        Some(reason)
                    } else {
                        RecordRetried { service, kind, record: &record, error: &e, backoff }.emit();
                        None
                    }
                }
            };
            if let Some(reason) = refused {
                if !hold.run(dead_letter_until_done(&dlq, service, &record, &reason, &token)).await {
                    break 'records;
                }
                RecordsHandled { service, topic: &record.topic, outcome: "dead_lettered", count: 1 }.emit();
                break;
            }
            // Leave without storing the offset when cancelled: the record comes again after restart.
            if !hold.wait(backoff, &token).await {
                break 'records;
            }
            backoff = (backoff * 2).min(Duration::from_secs(30));
        }
        hold.resume();
        observe_latency(service, &record, started);
        // The effect is durable: the next start resumes after this record.
        // librdkafka commits the stored offset plus one: the next record to read.
        if let Err(e) = consumer.store_offset(&record.topic, record.partition, record.offset) {
            // Happens when the partition was revoked meanwhile; the new owner handles it again.
            tracing::warn!(error = %e, "Could not store an offset.");
        }
    }
    commit_stored(&consumer)
}

/// Commits the stored offsets synchronously (at shutdown); having nothing to commit is fine.
pub(crate) fn commit_stored(consumer: &Consumer) -> Result<(), KafkaError> {
    match consumer.commit_consumer_state(CommitMode::Sync) {
        Ok(()) | Err(RdKafkaError::ConsumerCommit(RDKafkaErrorCode::NoOffset)) => Ok(()),
        Err(e) => Err(KafkaError::Commit(e)),
    }
}

/// Records how long `record` took to handle (`gpumedic_<service>_record_seconds`, retries
/// included) and how old it was when its effect became durable
/// (`gpumedic_<service>_record_age_seconds`, from its Kafka timestamp: the pipeline's latency up to
/// this stage).
pub(crate) fn observe_latency(service: &'static str, record: &Record, started: std::time::Instant) {
    let age = record.timestamp_ms.map(|ts| {
        let age_ms = chrono_now_ms().saturating_sub(ts).max(0);
        Duration::from_millis(u64::try_from(age_ms).unwrap_or(0))
    });
    RecordSettled { service, topic: &record.topic, elapsed: started.elapsed(), age }.emit();
}

fn chrono_now_ms() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX))
}
