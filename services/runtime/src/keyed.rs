//! An at-least-once consumer that handles records with different keys at the same time.
//!
//! [`crate::kafka::run_consumer`] handles one record at a time. That is right for a stage whose
//! work is CPU-bound, but the remediator's work is mostly waiting on the Kubernetes API (about
//! six round trips to quarantine a node), so one record at a time leaves the apiserver idle.
//! [`run_keyed_consumer`] runs up to `max_in_flight` records at once:
//!
//! - **Per-key order.** Records with the same key (the node name on every gpumedic topic) run one
//!   after another in offset order; records with different keys run concurrently. A record
//!   waiting behind another of its key takes no slot (up to [`HELD_PER_SLOT`] times
//!   `max_in_flight` records in hand in all): a node's burst of verdicts must not hold the slots
//!   other nodes' verdicts could run in. (When the waiting counted, four faults per node filled 64
//!   slots with 16 nodes, and 1,000 GPU quarantines ran 16 at a time.)
//! - **At least once.** A partition's offset is stored only up to the last record below which
//!   every record's effect is durable ([`OffsetTracker`]), so a crash re-delivers whatever was in
//!   hand and nothing after a gap is skipped.
//! - **Dead letters and retries** as in `run_consumer`: an invalid record goes to the dead-letter
//!   topic, and so does one whose handler fails in the same permanent way
//!   [`kafka::DEFAULT_POISON_ATTEMPTS`] times; a transient failure is retried with backoff
//!   (holding only that key).
//! - **Polling on**: while every slot stays taken longer than [`kafka::POLL_GRACE`] (records held
//!   in retries through an apiserver outage), the partitions are paused and the consumer keeps
//!   polling, so it never exceeds `max.poll.interval.ms` and leaves its group.
//! - **Cancellation** drops the records in hand without storing their offsets, then commits what
//!   is stored.

use std::collections::{BTreeSet, HashMap, VecDeque};
use std::future::Future;
use std::time::Duration;

use futures::StreamExt as _;
use futures::stream::FuturesUnordered;
use rdkafka::consumer::Consumer as _;
use tokio_util::sync::CancellationToken;
use tracing::Instrument as _;

use crate::events::{InternalEvent as _, RecordRetried, RecordsHandled, count_retry};
use crate::fault;
use crate::kafka::{self, Consumer, HandleError, KafkaError, Producer, Record};

/// Records in hand, running or waiting behind their key, per slot of `max_in_flight`.
pub const HELD_PER_SLOT: usize = 4;

/// A handler that may run for several records at once (it takes `&self`).
pub trait SharedHandler: Send + Sync {
    /// Makes the record's effect durable, or says why it could not.
    fn handle(&self, record: &Record) -> impl Future<Output = Result<(), HandleError>> + Send;
}

/// Which offsets of each partition are in hand, and which may be stored.
#[derive(Debug, Default)]
pub struct OffsetTracker {
    partitions: HashMap<(String, i32), Partition>,
}

#[derive(Debug, Default)]
struct Partition {
    in_hand: BTreeSet<i64>,
    /// The lowest offset received: nothing below it is this consumer's to store.
    first: Option<i64>,
    highest_done: Option<i64>,
    stored: Option<i64>,
}

impl OffsetTracker {
    /// `record` was received.
    pub fn start(&mut self, record: &Record) {
        let p = self.partitions.entry((record.topic.clone(), record.partition)).or_default();
        p.in_hand.insert(record.offset);
        p.first = Some(p.first.map_or(record.offset, |f| f.min(record.offset)));
    }

    /// `record`'s effect is durable. Returns the offset to store now, if it moved: the highest
    /// finished offset below the lowest one still in hand.
    pub fn finish(&mut self, record: &Record) -> Option<i64> {
        let p = self.partitions.get_mut(&(record.topic.clone(), record.partition))?;
        p.in_hand.remove(&record.offset);
        p.highest_done = p.highest_done.max(Some(record.offset));
        // Everything received below the lowest record in hand is done.
        let storable = match p.in_hand.first() {
            Some(&lowest) => Some(lowest - 1).filter(|&below| p.first.is_some_and(|f| below >= f)),
            None => p.highest_done,
        }?;
        if p.stored.is_some_and(|s| s >= storable) {
            return None;
        }
        p.stored = Some(storable);
        Some(storable)
    }
}

/// Handles one record to the end: `Ok(true)` when its effect is durable (handled or
/// dead-lettered), `Ok(false)` when `token` was cancelled first.
async fn process<H: SharedHandler>(
    service: &'static str,
    dlq: &Producer,
    handler: &H,
    record: Record,
    token: &CancellationToken,
) -> (Record, bool) {
    let span = kafka::record_span(service, &record);
    let started = std::time::Instant::now();
    let mut backoff = Duration::from_millis(100);
    let mut permanent = 0u32;
    loop {
        let refused = match handler.handle(&record).instrument(span.clone()).await {
            Ok(()) => {
                RecordsHandled { service, topic: &record.topic, outcome: "ok", count: 1 }.emit();
                break;
            }
            Err(HandleError::Invalid(reason)) => reason,
            Err(HandleError::Retry(e)) => {
                let kind = fault::metric_label(e.as_ref());
                if fault::is_permanent(e.as_ref()) {
                    permanent += 1;
                }
                if permanent >= kafka::DEFAULT_POISON_ATTEMPTS {
                    count_retry(service, kind);
                    let reason = fault::error_chain(e.as_ref());
                    kafka::report_poison(service, &record, permanent, &reason);
                    reason
                } else {
                    RecordRetried { service, kind, record: &record, error: &e, backoff }.emit();
                    tokio::select! {
                        () = token.cancelled() => return (record, false),
                        () = tokio::time::sleep(backoff) => {}
                    }
                    backoff = (backoff * 2).min(Duration::from_secs(30));
                    continue;
                }
            }
        };
        if !kafka::dead_letter_until_done(dlq, service, &record, &refused, token).await {
            return (record, false);
        }
        RecordsHandled { service, topic: &record.topic, outcome: "dead_lettered", count: 1 }.emit();
        break;
    }
    kafka::observe_latency(service, &record, started);
    (record, true)
}

/// The keyed at-least-once loop (see the module docs); returns after `token` is cancelled, with
/// the stored offsets committed.
///
/// # Errors
/// [`KafkaError::Commit`] when the final commit fails.
pub async fn run_keyed_consumer<H: SharedHandler>(
    service: &'static str,
    consumer: Consumer,
    dlq: Producer,
    handler: &H,
    max_in_flight: usize,
    token: CancellationToken,
) -> Result<(), KafkaError> {
    let max_in_flight = max_in_flight.max(1);
    let max_held = max_in_flight.saturating_mul(HELD_PER_SLOT);
    let mut tracker = OffsetTracker::default();
    // A key is present while a record of it runs; its queue holds the ones waiting behind it.
    let mut busy: HashMap<Vec<u8>, VecDeque<Record>> = HashMap::new();
    let mut running: FuturesUnordered<_> = FuturesUnordered::new();
    let mut in_hand = 0usize;
    // While every slot is taken for longer than the grace (an apiserver outage holds records in
    // retries), the partitions are paused and the consumer polls on, so the group keeps it.
    let mut hold = kafka::Hold::new(&consumer);
    let mut full_since: Option<tokio::time::Instant> = None;
    macro_rules! admit {
        ($record:expr) => {{
            let record: Record = $record;
            in_hand += 1;
            tracker.start(&record);
            let key = record.key.clone().unwrap_or_default();
            match busy.get_mut(&key) {
                Some(waiting) => waiting.push_back(record),
                None => {
                    busy.insert(key, VecDeque::new());
                    running.push(process(service, &dlq, handler, record, &token));
                }
            }
        }};
    }
    // Full: every run slot taken, or as many records in hand as may be held.
    macro_rules! full {
        () => {
            running.len() >= max_in_flight || in_hand >= max_held
        };
    }
    loop {
        while !full!()
            && let Some(record) = hold.early.pop_front()
        {
            admit!(record);
        }
        let full = full!();
        if !full {
            full_since = None;
            hold.resume();
        } else if full_since.is_none() {
            full_since = Some(tokio::time::Instant::now());
        }
        let pause_at = full_since.map_or_else(tokio::time::Instant::now, |t| t + kafka::POLL_GRACE);
        tokio::select! {
            biased;
            () = token.cancelled() => break,
            Some((record, durable)) = running.next(), if !running.is_empty() => {
                let (record, durable): (Record, bool) = (record, durable);
                in_hand -= 1;
                if !durable {
                    break;
                }
                if let Some(offset) = tracker.finish(&record) {
                    // librdkafka commits the stored offset plus one: the next record to read.
                    if let Err(e) = consumer.store_offset(&record.topic, record.partition, offset) {
                        tracing::warn!(error = %e, "Could not store an offset.");
                    }
                }
                let key = record.key.clone().unwrap_or_default();
                match busy.get_mut(&key).and_then(VecDeque::pop_front) {
                    Some(next) => running.push(process(service, &dlq, handler, next, &token)),
                    None => {
                        busy.remove(&key);
                    }
                }
            }
            () = tokio::time::sleep_until(pause_at), if full && !hold.paused => hold.pause(),
            message = consumer.recv(), if !full || hold.paused => {
                let record = match message {
                    Ok(m) => Record::from_message(&m),
                    Err(e) => {
                        tracing::warn!(error = %e, "Kafka consumer error; continuing.");
                        continue;
                    }
                };
                if full {
                    // From a partition assigned while paused: kept, in order, for when a slot frees.
                    hold.early.push_back(record);
                    hold.pause();
                } else {
                    admit!(record);
                }
            }
        }
    }
    // Records still in hand are dropped unfinished: their offsets were never stored.
    drop(running);
    kafka::commit_stored(&consumer)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record(partition: i32, offset: i64) -> Record {
        Record { topic: "t".into(), partition, offset, key: None, payload: None, headers: vec![], timestamp_ms: None }
    }

    #[test]
    fn an_offset_is_stored_only_below_the_lowest_record_in_hand() {
        let mut t = OffsetTracker::default();
        for o in 10..14 {
            t.start(&record(0, o));
        }
        // 11 and 12 finish first: 10 is still in hand, so nothing may be stored.
        assert_eq!(t.finish(&record(0, 11)), None);
        assert_eq!(t.finish(&record(0, 12)), None);
        // 10 finishes: everything up to 12 is durable, 13 is in hand.
        assert_eq!(t.finish(&record(0, 10)), Some(12));
        assert_eq!(t.finish(&record(0, 13)), Some(13));
        // Another partition is independent.
        t.start(&record(1, 5));
        assert_eq!(t.finish(&record(1, 5)), Some(5));
    }

    #[test]
    fn a_gap_holds_the_offset_back_until_it_closes() {
        let mut t = OffsetTracker::default();
        for o in [1, 2, 3] {
            t.start(&record(0, o));
        }
        assert_eq!(t.finish(&record(0, 3)), None);
        assert_eq!(t.finish(&record(0, 1)), Some(1));
        assert_eq!(t.finish(&record(0, 2)), Some(3));
        // Finishing a record that was never started stores nothing new.
        assert_eq!(t.finish(&record(0, 2)), None);
    }
}
