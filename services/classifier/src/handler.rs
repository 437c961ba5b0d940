//! The consumer's batch handler ([`Handler`]): a batch of records decoded, its events observed
//! through the engine, its verdicts published, and all of it written to Postgres at once.

use std::sync::Arc;

use gpumedic_runtime::BoxError;
use gpumedic_runtime::fault::Labeled;
use gpumedic_runtime::kafka::{BatchHandler, Disposition, Record, record_headers};
use gpumedic_schemas::{ActionOutcome, EnrichedHealthEvent};
use tokio::sync::Mutex;

use crate::classifier::{Classifier, ClassifierError};
use crate::events::{BatchRecorded, BatchStage, ClockSkewClamped, InputRefused, InternalEvent as _, SlowBatch};
use crate::rules::engine::{Absorbed, Decision, Engine};
use crate::{nvlink, observe, persist, store, workload};

/// Where a batch's time goes: `decode` (Avro and the JSON kept in Postgres), `classify` (the
/// engine), `publish` (until every verdict is acknowledged), `write` (the Postgres round trip).
fn stage_seconds(stage: &'static str, from: std::time::Instant, to: std::time::Instant) {
    BatchStage { stage, elapsed: to.duration_since(from) }.emit();
}

/// A batch's steps, timed in order, for [`SlowBatch`].
struct Steps {
    started: std::time::Instant,
    /// When the batch began, on the clock of the records' timestamps.
    began_ms: i64,
    last: std::time::Instant,
    steps: Vec<(&'static str, std::time::Duration)>,
}

impl Steps {
    fn new(started: std::time::Instant) -> Self {
        let began_ms = chrono::Utc::now().timestamp_millis();
        Steps { started, began_ms, last: started, steps: Vec::with_capacity(12) }
    }

    /// Ends the step `name` now, and returns now.
    fn mark(&mut self, name: &'static str) -> std::time::Instant {
        let now = std::time::Instant::now();
        self.steps.push((name, now.duration_since(self.last)));
        self.last = now;
        now
    }

    /// Logs the batch if it was slow, or if its oldest record had waited long in Kafka before
    /// the batch began (a stall before the handler: the consumer, or the batch before).
    fn finish(self, records: &[Record]) {
        let total = self.last.duration_since(self.started);
        let waited = records.iter().filter_map(|r| r.timestamp_ms).min().map_or(std::time::Duration::ZERO, |t| {
            std::time::Duration::from_millis(self.began_ms.saturating_sub(t).max(0).unsigned_abs())
        });
        if total >= SlowBatch::THRESHOLD || waited >= SlowBatch::THRESHOLD {
            SlowBatch { records: records.len(), total, waited, steps: &self.steps }.emit();
        }
    }
}

/// Identifies a batch by its first and last record and its length: the consumer loop offers a
/// failed batch again unchanged, so the same key means the same records.
type BatchKey = (String, i32, i64, String, i32, i64, usize);

fn batch_key(records: &[Record]) -> Option<BatchKey> {
    let (first, last) = (records.first()?, records.last()?);
    Some((
        first.topic.clone(),
        first.partition,
        first.offset,
        last.topic.clone(),
        last.partition,
        last.offset,
        records.len(),
    ))
}

/// A failed batch's key, its decisions with the index of the record behind each, the
/// sympathetic events it absorbed, and what of it is recorded.
type Retry = (BatchKey, Vec<(Decision, usize)>, Vec<Absorbed>, Kept);

/// An event's identity, as `health_events` keys it: its id and time.
type EventKey = (uuid::Uuid, chrono::DateTime<chrono::Utc>);

/// What of a batch is recorded ([`persist`]): per decoded event, whether it is. Kept for a retry,
/// as the engine and the keeper took the events in already.
#[derive(Debug)]
struct Kept {
    events: Vec<bool>,
    /// Per decoded event (as `events`), its record's index in the batch and its key.
    keys: Vec<(usize, EventKey)>,
}

impl Kept {
    /// Each event taken in, by key, with whether it is recorded.
    fn by_key(&self) -> std::collections::HashMap<EventKey, bool> {
        self.keys.iter().zip(&self.events).map(|((_, key), kept)| (*key, *kept)).collect()
    }
}

/// The decisions of a failed attempt (`made`, each with the index of its record in that attempt)
/// whose events are in the batch offered now (`here`: each event's record index in it), with
/// their indexes here. A batch is offered again with other records after a rebalance: the engine
/// took the failed attempt's events in already and will not decide on them again, so their
/// decisions must not be lost; those of events no longer here are dropped, as their partition's
/// new owner takes the events in from Kafka (none of them was written).
fn carried_over<D>(
    made: Vec<(D, usize)>,
    before: &Kept,
    here: &std::collections::HashMap<EventKey, usize>,
) -> Vec<(D, usize)> {
    let key_of: std::collections::HashMap<usize, EventKey> = before.keys.iter().copied().collect();
    made.into_iter().filter_map(|(d, i)| key_of.get(&i).and_then(|key| here.get(key)).map(|&at| (d, at))).collect()
}

/// The consumer's batch handler: enriched events into the engine and all of the batch into
/// Postgres at once; action outcomes into the record.
pub struct Handler {
    classifier: Arc<Mutex<Classifier>>,
    actions_topic: String,
    /// Decisions of the batch being retried, with the index of the record behind each, and the
    /// sympathetic events it absorbed: the engine has already taken its events in (and would
    /// ignore them a second time), so they must not be lost with a failed publish or write.
    retrying: Option<Retry>,
}

impl Handler {
    /// A handler over `classifier`, recording outcomes read from `actions_topic`.
    pub fn new(classifier: Arc<Mutex<Classifier>>, actions_topic: String) -> Self {
        Handler { classifier, actions_topic, retrying: None }
    }
}

impl BatchHandler for Handler {
    #[tracing::instrument(name = "classify_batch", skip_all, fields(records = records.len()))]
    async fn handle_batch(&mut self, records: &[Record]) -> Result<Vec<Disposition>, BoxError> {
        let started = std::time::Instant::now();
        let mut steps = Steps::new(started);
        let mut dispositions = vec![Disposition::Done; records.len()];
        let (codec, parts, workload_faults, skew, policy) = {
            let c = self.classifier.lock().await;
            (c.codec.clone(), c.write_parallelism, c.workload_faults, c.clock_skew_allowance, c.keeper.policy())
        };
        // One batch per concurrent write; a node's rows all go to the same one. A small batch is
        // one statement: each part is a commit, and a commit's WAL flush, not the rows, is most
        // of a small write (store::ONE_STATEMENT_UP_TO).
        let parts = if records.len() <= store::ONE_STATEMENT_UP_TO { 1 } else { parts };
        let mut batch = store::Batch::parts(parts, records.len());
        let mut observations = Vec::with_capacity(records.len());
        // Under `--persist evidence`, the decoded events wait for the engine's word on which to
        // record; under `all` each is recorded as it is decoded.
        let mut pending: Vec<Option<EnrichedHealthEvent>> = match policy {
            persist::Policy::Evidence => Vec::with_capacity(records.len()),
            persist::Policy::All => Vec::new(),
        };
        let mut sightings = Vec::new();
        for (i, record) in records.iter().enumerate() {
            let Some(payload) = record.payload.as_deref() else {
                dispositions[i] = Disposition::DeadLetter("empty record".into());
                continue;
            };
            if record.topic == self.actions_topic {
                match codec.decode::<ActionOutcome>(payload).await {
                    // Outcomes refer to verdicts of earlier batches, already written.
                    Ok(outcome) => batch[0].actions.push(&outcome),
                    // An unreachable schema registry: the whole batch waits and is retried.
                    Err(e) if e.is_transient() => return Err(Box::new(e)),
                    Err(e) => dispositions[i] = Disposition::DeadLetter(format!("{}: {e}", e.reason())),
                }
                continue;
            }
            match codec.decode::<EnrichedHealthEvent>(payload).await {
                Ok(mut event) => {
                    // Bounded before it is recorded, so the engine, Postgres and a rebuild from
                    // Postgres all see the same time.
                    if let Some(at) = observe::bounded_observed_at(event.event.observed_at, record.timestamp_ms, skew) {
                        clock_skew_clamped(&event, at);
                        event.event.observed_at = at;
                    }
                    let recorded = match policy {
                        persist::Policy::All => batch[store::part_of(&event.event.node, parts)].events.push(&event),
                        persist::Policy::Evidence => Ok(()),
                    };
                    match recorded {
                        Ok(()) => {
                            sightings.extend(workload::sighting(&event, &workload_faults));
                            let key = (event.event.event_id, event.event.observed_at);
                            observations.push((i, key, observe::observation(&event)));
                            if policy == persist::Policy::Evidence {
                                pending.push(Some(event));
                            }
                        }
                        Err(e) => dispositions[i] = Disposition::DeadLetter(format!("cannot record the event: {e}")),
                    }
                }
                Err(e) if e.is_transient() => return Err(Box::new(e)),
                Err(e) => dispositions[i] = Disposition::DeadLetter(format!("{}: {e}", e.reason())),
            }
        }
        let key = batch_key(records);
        steps.mark("decode");
        let c = &mut *self.classifier.lock().await;
        steps.mark("lock");
        // Before any record of a newly assigned partition: that node's state comes first.
        c.reconcile().await?;
        let decoded = steps.mark("reconcile");
        stage_seconds("decode", started, decoded);
        let (decisions, absorbed, kept) = match self.retrying.take() {
            Some((k, decisions, absorbed, kept)) if Some(&k) == key.as_ref() => (decisions, absorbed, kept),
            before => {
                // A failed attempt at other records: its events still here were taken in already.
                let taken = before.as_ref().map(|(_, _, _, kept)| kept.by_key()).unwrap_or_default();
                // Only events new to Postgres are observed: one recorded there had its verdicts
                // published before it was written, however long ago (the engine's own memory of
                // ids is short). The insert skips them too; they count as duplicates below.
                let keys: Vec<_> = observations.iter().map(|(_, key, _)| *key).collect();
                let recorded = match store::recorded(&c.pool, &keys).await {
                    Ok(recorded) => recorded,
                    Err(e) => {
                        // What a failed attempt took in waits for the next attempt.
                        self.retrying = before;
                        return Err(Box::new(ClassifierError::from(e)));
                    }
                };
                // Nor is a second copy within the batch (a re-send, a redelivery that caught up
                // with its original), however many of its node's events lie between: it is
                // recorded as its first copy is (`copy_of`).
                let mut first_copy = std::collections::HashMap::with_capacity(keys.len());
                let copy_of: Vec<Option<usize>> = keys
                    .iter()
                    .enumerate()
                    .map(|(j, key)| {
                        let first = *first_copy.entry(*key).or_insert(j);
                        (first != j).then_some(first)
                    })
                    .collect();
                let fresh: Vec<_> = observations
                    .iter()
                    .enumerate()
                    .filter(|(j, (_, key, _))| {
                        !recorded.contains(key) && copy_of[*j].is_none() && !taken.contains_key(key)
                    })
                    .collect();
                // Root NVLink incidents of other nodes of a peer's domain, handed to the engine.
                let mut roots = nvlink::Roots::new(c.engine.rules());
                if let Err(e) = roots.load(&c.pool, fresh.iter().map(|(_, (_, _, o))| o)).await {
                    self.retrying = before;
                    return Err(Box::new(ClassifierError::from(e)));
                }
                steps.mark("look_up");
                let mut absorbed = Vec::new();
                let mut decisions = match before {
                    Some((_, made, earlier, kept)) => {
                        // Each event's record here, looked up only after a failed attempt.
                        let mut here = std::collections::HashMap::with_capacity(observations.len());
                        for (i, key, _) in &observations {
                            here.entry(*key).or_insert(*i);
                        }
                        absorbed = earlier;
                        carried_over(made, &kept, &here)
                    }
                    None => Vec::new(),
                };
                // Which observations are recorded: every one already recorded (the insert skips
                // it), of those a failed attempt took in what it kept, and of the fresh ones what
                // the persistence policy keeps.
                let mut keep: Vec<bool> = keys.iter().map(|key| taken.get(key).copied().unwrap_or(true)).collect();
                for (j, (i, _, o)) in fresh {
                    let (made, bearing) = c.engine.observe_bearing(&roots.attach(o));
                    keep[j] = c.keeper.keep(o, bearing);
                    roots.learn(&made);
                    decisions.extend(made.into_iter().map(|d| (d, *i)));
                }
                for (j, first) in copy_of.iter().enumerate() {
                    if let Some(first) = *first {
                        keep[j] = keep[first];
                    }
                }
                count_refused(&mut c.engine);
                let new = c.engine.take_absorbed();
                nvlink::absorbed(&new);
                absorbed.extend(new);
                let keys = observations.iter().map(|(i, key, _)| (*i, *key)).collect();
                (decisions, absorbed, Kept { events: keep, keys })
            }
        };
        if policy == persist::Policy::Evidence {
            for ((j, event), (i, _, _)) in pending.iter_mut().enumerate().zip(&observations) {
                let Some(event) = event.take().filter(|_| kept.events[j]) else { continue };
                if let Err(e) = batch[store::part_of(&event.event.node, parts)].events.push(&event) {
                    dispositions[*i] = Disposition::DeadLetter(format!("cannot record the event: {e}"));
                }
            }
        }
        for a in &absorbed {
            batch[store::part_of(&a.node, parts)].sympathetic.push(a);
        }
        let classified = steps.mark("classify");
        stage_seconds("classify", decoded, classified);
        let outcome = async {
            // Judged here, not with the engine: a failed look-up retries the batch from the
            // engine's decisions, which are kept.
            let mut judged = c.judge_lemons(&decisions).await?;
            // A complete GPU inventory without a lemon GPU closes that GPU's lemon incident.
            let inventories: Vec<_> =
                observations.iter().filter(|(_, _, o)| o.kind == "gpu_inventory").map(|(i, _, o)| (o, *i)).collect();
            judged.extend(c.close_replaced_lemons(&inventories).await?);
            steps.mark("judge");
            let traced: Vec<(Decision, Option<&[u8]>)> =
                judged.iter().map(|(d, i)| (d.clone(), records[*i].header(record_headers::TRACEPARENT))).collect();
            let published = c.publish(&traced).await?;
            let acknowledged = steps.mark("publish");
            stage_seconds("publish", classified, acknowledged);
            let mut by_part: Vec<Vec<store::Published>> = vec![Vec::new(); parts];
            for (d, v, t) in published {
                by_part[store::part_of(&v.node, parts)].push((d, v, t));
            }
            for (b, published) in batch.iter_mut().zip(&by_part) {
                b.decisions = store::DecisionRows::new(published);
            }
            let written = store::write_parts(&c.pool, &batch).await?;
            steps.mark("write");
            // After the events are recorded: a failure here retries the batch, which writes
            // nothing twice.
            c.record_workload_faults(sightings).await?;
            stage_seconds("write", acknowledged, steps.mark("workload"));
            // Closed rollups go to their own writer once the batch is recorded, if it has room:
            // no batch, and so no fault, waits for them (crate::rollups).
            if policy == persist::Policy::Evidence {
                c.rollups.offer(&c.pool, &mut c.keeper, persist::rollups_for_batch(records.len())).await?;
                steps.mark("rollups");
            }
            Ok::<_, ClassifierError>(written)
        }
        .await;
        match outcome {
            Ok(written) => {
                let rows = batch.iter().map(|b| b.events.len() as u64).sum::<u64>();
                BatchRecorded {
                    observations: observations.len() as u64,
                    rows,
                    duplicates: rows.saturating_sub(u64::try_from(written.new_events).unwrap_or(0)),
                }
                .emit();
                steps.finish(records);
                Ok(dispositions)
            }
            Err(e) => {
                if let Some(key) = key {
                    self.retrying = Some((key, decisions, absorbed, kept));
                }
                // Counted by what failed (handler_retries_total{kind}).
                Err(Box::new(Labeled::new(e)))
            }
        }
    }
}

/// Counts and logs an event whose observed_at was bounded by its record's timestamp.
fn clock_skew_clamped(event: &EnrichedHealthEvent, to: chrono::DateTime<chrono::Utc>) {
    ClockSkewClamped {
        node: &event.event.node,
        event_id: &event.event.event_id,
        observed_at: &event.event.observed_at,
        record_time: &to,
    }
    .emit();
}

/// Counts and logs the observations the engine refused as impossible: never a fault, never
/// healthy evidence, but an operator wants to know a node sends them (a broken sensor, a collector
/// bug, a clock far off).
fn count_refused(engine: &mut Engine) {
    for r in engine.take_refused() {
        InputRefused { node: &r.node, event_id: &r.event_id, reason: r.reason.as_str() }.emit();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(n: u128) -> EventKey {
        (uuid::Uuid::from_u128(n), chrono::DateTime::from_timestamp(1_700_000_000, 0).unwrap())
    }

    #[test]
    fn a_failed_attempts_decisions_follow_their_events_into_the_batch_offered_next() {
        // The failed attempt: records 0..4 carried events 10, 11, 12, 13; decisions on 11 and 13.
        let before =
            Kept { events: vec![true, false, true, true], keys: (0..4).map(|i| (i, key(10 + i as u128))).collect() };
        assert!(!before.by_key()[&key(11)], "11 was not recorded");
        let made = vec![("on 11", 1), ("on 13", 3), ("also on 13", 3)];
        // After a rebalance the batch holds 13 at record 0 and new events; 11's partition moved.
        let here = [(key(13), 0), (key(20), 1)].into_iter().collect();
        assert_eq!(carried_over(made, &before, &here), vec![("on 13", 0), ("also on 13", 0)]);
    }
}
