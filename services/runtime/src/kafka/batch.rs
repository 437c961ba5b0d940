//! The batch-at-a-time loop ([`run_batch_consumer`]) for stages that write in bulk.

use std::future::Future;
use std::time::Duration;

use rdkafka::consumer::Consumer as _;
use tokio_util::sync::CancellationToken;

use crate::config::{Problems, Validate};
use crate::events::{BatchHandled, BatchRetried, InternalEvent as _, RecordsHandled, count_retry};
use crate::{BoxError, fault};

use super::{
    Consumer, DEFAULT_POISON_ATTEMPTS, Hold, KafkaError, Producer, Record, commit_stored, dead_letter_until_done,
    report_poison,
};

/// What became of one record of a batch, as its [`BatchHandler`] decided.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Disposition {
    /// Its effect is durable.
    Done,
    /// It can never be processed: it goes to the dead-letter topic with this reason.
    DeadLetter(String),
}

/// Processes records a batch at a time, for stages whose effects are cheaper in bulk (one
/// database round trip for many records). Must be idempotent: after a crash, or when the batch
/// failed, the same records come again.
pub trait BatchHandler: Send {
    /// Makes the effects of `records` durable and returns one [`Disposition`] per record, in
    /// order; or fails the whole batch, in which case the same batch is offered again after a
    /// backoff and no offset is stored. An error about the records themselves (wrapped in
    /// [`fault::RecordFault`], or one [`fault::is_permanent`] knows, such as a value Postgres
    /// refuses) is retried a bounded number of times, then the records are offered one at a time
    /// and the one at fault is dead-lettered with the error; any other error is taken for an
    /// outage and retried without limit.
    fn handle_batch(&mut self, records: &[Record]) -> impl Future<Output = Result<Vec<Disposition>, BoxError>> + Send;
}

/// How [`run_batch_consumer`] cuts batches.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BatchSettings {
    /// At most this many records in a batch.
    pub max: usize,
    /// How long to wait for more records once the first of a batch has arrived.
    pub linger: Duration,
    /// The byte bound and the poison-record rule, shared by every batching stage.
    pub limits: BatchLimits,
}

impl BatchSettings {
    /// Batches of at most `max` records gathered within `linger`, with the default [`BatchLimits`].
    pub fn new(max: usize, linger: Duration) -> Self {
        Self { max, linger, limits: BatchLimits::default() }
    }
}

/// The limits of [`BatchSettings`] every batching stage shares (`--batch-max-bytes`,
/// `--poison-attempts`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BatchLimits {
    /// At most this many bytes (keys, values and headers) in a batch; a single larger record is a
    /// batch of its own.
    pub max_bytes: usize,
    /// A batch failing this many times with a permanent error ([`fault::is_permanent`]) is
    /// handled one record at a time, and a record failing alone that way is dead-lettered.
    pub poison_attempts: u32,
}

/// The default of `--batch-max-bytes`: 16 MiB, far above a full batch of gpumedic records
/// (thousands of records of a few hundred bytes each), so it bounds memory against unusually
/// large records without cutting normal batches. No stage produces a batch as one Kafka record,
/// so the broker's 1 MiB message limit does not apply to it.
pub const DEFAULT_BATCH_MAX_BYTES: usize = 16 * 1024 * 1024;

impl Default for BatchLimits {
    fn default() -> Self {
        Self { max_bytes: DEFAULT_BATCH_MAX_BYTES, poison_attempts: DEFAULT_POISON_ATTEMPTS }
    }
}

/// Flags for [`BatchLimits`], flattened into the arguments of a batching service.
#[derive(Debug, Clone, clap::Args)]
pub struct BatchLimitArgs {
    /// Most bytes (keys, values and headers) in one batch; a larger record is a batch of its own.
    #[arg(long, env = "GPUMEDIC_BATCH_MAX_BYTES", default_value_t = DEFAULT_BATCH_MAX_BYTES)]
    pub batch_max_bytes: usize,
    /// How often a batch may fail with an error about its records (a value Postgres refuses, a
    /// record too large for Kafka) before its records are handled one at a time and the one at
    /// fault goes to the dead-letter topic. Outages are retried without limit.
    #[arg(long, env = "GPUMEDIC_POISON_ATTEMPTS", default_value_t = DEFAULT_POISON_ATTEMPTS)]
    pub poison_attempts: u32,
}

impl Validate for BatchLimitArgs {
    type Valid = BatchLimits;

    fn validate(self) -> Result<BatchLimits, Problems> {
        let mut p = Problems::default();
        if self.batch_max_bytes < 1024 {
            p.push("--batch-max-bytes", format!("{} is below 1024", self.batch_max_bytes));
        }
        if !(1..=100).contains(&self.poison_attempts) {
            p.push("--poison-attempts", format!("{} is not from 1 to 100", self.poison_attempts));
        }
        p.finish(|| BatchLimits { max_bytes: self.batch_max_bytes, poison_attempts: self.poison_attempts })
    }
}

/// The bytes a record takes in a batch.
pub(super) fn record_bytes(r: &Record) -> usize {
    r.key.as_ref().map_or(0, Vec::len)
        + r.payload.as_ref().map_or(0, Vec::len)
        + r.headers.iter().map(|(k, v)| k.len() + v.len()).sum::<usize>()
}

/// Offers `records` to `handler` until it succeeds: `Some(Ok)` with its dispositions, or
/// `Some(Err(reason))` once it failed `attempts` times with a permanent error; transient errors
/// are retried with backoff without limit (polling with paused partitions). `None` when `token`
/// was cancelled during a backoff.
async fn settle_batch<H: BatchHandler>(
    service: &'static str,
    handler: &mut H,
    records: &[Record],
    attempts: u32,
    hold: &mut Hold<'_>,
    token: &CancellationToken,
) -> Option<Result<Vec<Disposition>, String>> {
    let mut backoff = Duration::from_millis(100);
    let mut permanent = 0u32;
    loop {
        let e = match hold.run(handler.handle_batch(records)).await {
            Ok(d) => return Some(Ok(d)),
            Err(e) => e,
        };
        let kind = fault::metric_label(e.as_ref());
        let attempt = if fault::is_permanent(e.as_ref()) {
            permanent += 1;
            if permanent >= attempts {
                count_retry(service, kind);
                return Some(Err(fault::error_chain(e.as_ref())));
            }
            Some(permanent)
        } else {
            None
        };
        BatchRetried { service, kind, records: records.len(), attempt, error: &e, backoff }.emit();
        // Leave without storing offsets: the batch comes again after restart.
        if !hold.wait(backoff, token).await {
            return None;
        }
        backoff = (backoff * 2).min(Duration::from_secs(30));
    }
}

/// The at-least-once loop, a batch at a time: gather up to `batch.max` records and
/// `batch.limits.max_bytes` bytes (or what arrives within `batch.linger` of the first), in
/// consumption order, so each partition's order is kept; hand them to `handler`; dead-letter the
/// records it refused and wait for Kafka to acknowledge them; and only then store each
/// partition's highest offset. A batch that fails with a transient error is retried whole with
/// backoff and nothing is stored; one that fails with a permanent error
/// ([`fault::is_permanent`]) `batch.limits.poison_attempts` times is handled one record at a
/// time, and a record failing alone that way is dead-lettered with the error. While a handler is
/// slow or retrying, the partitions are paused and the consumer keeps polling, so the group
/// keeps it. On cancellation the batch in hand is finished (unless it is waiting to be retried)
/// and the stored offsets are committed, as [`run_consumer`] does.
pub async fn run_batch_consumer<H: BatchHandler>(
    service: &'static str,
    consumer: Consumer,
    dlq: Producer,
    mut handler: H,
    batch: BatchSettings,
    token: CancellationToken,
) -> Result<(), KafkaError> {
    let max = batch.max.max(1);
    let max_bytes = batch.limits.max_bytes;
    let attempts = batch.limits.poison_attempts.max(1);
    let mut hold = Hold::new(&consumer);
    let mut records: Vec<Record> = Vec::with_capacity(max);
    'batches: loop {
        records.clear();
        let Some(first) = hold.next(&token).await else { break };
        let mut bytes = record_bytes(&first);
        records.push(first);
        let deadline = tokio::time::Instant::now() + batch.linger;
        while records.len() < max && bytes < max_bytes {
            let next = match hold.early.pop_front() {
                Some(r) => r,
                None => match tokio::time::timeout_at(deadline, consumer.recv()).await {
                    Err(_) => break,
                    Ok(Ok(m)) => Record::from_message(&m),
                    Ok(Err(e)) => {
                        tracing::warn!(error = %e, "Kafka consumer error; continuing.");
                        continue;
                    }
                },
            };
            let size = record_bytes(&next);
            if bytes + size > max_bytes {
                // It starts the next batch, ahead of anything polled later.
                hold.early.push_front(next);
                break;
            }
            bytes += size;
            records.push(next);
        }
        let started = std::time::Instant::now();
        let dispositions = match settle_batch(service, &mut handler, &records, attempts, &mut hold, &token).await {
            None => break 'batches,
            Some(Ok(d)) => d,
            Some(Err(reason)) if records.len() == 1 => {
                report_poison(service, &records[0], attempts, &reason);
                vec![Disposition::DeadLetter(reason)]
            }
            Some(Err(reason)) => {
                tracing::warn!(records = records.len(), attempts, %reason, "The batch fails the same way every time; handling its records one at a time to find the ones at fault.");
                let mut d = Vec::with_capacity(records.len());
                for r in &records {
                    match settle_batch(service, &mut handler, std::slice::from_ref(r), 1, &mut hold, &token).await {
                        None => break 'batches,
                        Some(Ok(one)) => d.extend(one),
                        Some(Err(reason)) => {
                            report_poison(service, r, attempts, &reason);
                            d.push(Disposition::DeadLetter(reason));
                        }
                    }
                }
                d
            }
        };
        assert_eq!(dispositions.len(), records.len(), "a batch handler must return one disposition per record");
        // Counted per topic and outcome, then added once each: a counter looked up per record was
        // a visible cost at tens of thousands of records a second (docs/profiles.md).
        let mut counts: Vec<(&str, &'static str, u64)> = Vec::new();
        for (record, disposition) in records.iter().zip(&dispositions) {
            let outcome = match disposition {
                Disposition::Done => "ok",
                Disposition::DeadLetter(reason) => {
                    if !hold.run(dead_letter_until_done(&dlq, service, record, reason, &token)).await {
                        break 'batches;
                    }
                    "dead_lettered"
                }
            };
            match counts.iter_mut().find(|(t, o, _)| *t == record.topic && *o == outcome) {
                Some(c) => c.2 += 1,
                None => counts.push((&record.topic, outcome, 1)),
            }
        }
        for (topic, outcome, count) in counts {
            RecordsHandled { service, topic, outcome, count }.emit();
        }
        BatchHandled { service, elapsed: started.elapsed() }.emit();
        // Every effect of the batch is durable: store each partition's highest offset (records
        // of one partition arrive in order, so the last one seen is the highest).
        let mut highest: Vec<(&str, i32, i64)> = Vec::new();
        for r in &records {
            match highest.iter_mut().find(|(t, p, _)| *t == r.topic && *p == r.partition) {
                Some(h) => h.2 = h.2.max(r.offset),
                None => highest.push((&r.topic, r.partition, r.offset)),
            }
        }
        for (topic, partition, offset) in highest {
            // librdkafka commits the stored offset plus one: the next record to read.
            if let Err(e) = consumer.store_offset(topic, partition, offset) {
                // Happens when the partition was revoked meanwhile; the new owner handles it again.
                tracing::warn!(error = %e, topic, partition, "Could not store an offset.");
            }
        }
        hold.resume();
    }
    commit_stored(&consumer)
}
