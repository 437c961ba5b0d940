//! The one place events leave the node: every source hands its events to one publisher task
//! through a bounded channel ([`Sink`]); the publisher produces them to Kafka, or, while Kafka
//! cannot take them, writes them to the on-disk [`Spool`] and drains it in order once Kafka is
//! back.
//!
//! # Modes
//! - **Direct**: the spool is empty and Kafka answered last time. Each event is produced at once
//!   with a delivery future; a source that waits ([`Sink::emit`]) is answered on Kafka's
//!   acknowledgement.
//! - **Spooling**: the topic is not created yet, a delivery failed or timed out
//!   (`--delivery-timeout`), or spooled records are still waiting. New events are appended to
//!   the spool behind the waiting ones (one node's events keep their order, which is all their
//!   key promises); a waiting source is answered once its event is fsynced. While Kafka is down
//!   one spooled record is sent at a time as a probe, with backoff; once one is acknowledged the
//!   spool drains with up to [`DRAIN_WINDOW`] records in flight, and the publisher returns to
//!   direct mode when it is empty.
//!
//! A record Kafka refuses for good (over the broker's size limit, not authorized:
//! [`fault::is_permanent`]) must not block the spool's head for ever. Kafka refuses a whole
//! produce request at once, so a refusal is pinned on a record only when it was sent alone: the
//! producer refusing it before sending (larger than `message.max.bytes`) answers its source
//! `Refused` at once; a delivery refused with others in flight sends the spool's records one at
//! a time (a direct one is spooled first) until one is acknowledged. A record refused alone is
//! counted (`gpumedic_collector_events_refused_total`), logged as an error with its id, and
//! removed from the spool, so the records behind it drain.
//!
//! When the spool is full of faults the publisher stops taking events from the channel until the
//! spool drains: sources that wait are held (backpressure), and the GPU sampler, which never
//! waits, drops its own heartbeats ([`Outbox`]). A source is never answered before its event is
//! either acknowledged by Kafka or durable in the spool.
//!
//! # The node token
//! Every record is produced with the collector's node token ([`NodeToken`]) in header
//! `gpumedic.node-token`, read at the moment the record is handed to Kafka: a spooled record is
//! kept without it and leaves with the token current when it is drained, so a record spooled
//! through an outage longer than a token's life is not refused as expired.
//!
//! # Duplicates
//! The producer is idempotent (`enable.idempotence`), so librdkafka's own retries add no copies.
//! A copy can still reach the topic when a record is sent again by the collector: after a failed
//! spooled send, the records behind it that were in flight are sent again; after a crash between
//! Kafka's acknowledgement and the deletion of a drained segment, that segment is sent again; an
//! event still in flight when the shutdown grace ends is spooled and may also have been
//! delivered. Consumers deduplicate on the event id (the classifier records events by id).

use std::collections::VecDeque;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt as _;
use futures::future::BoxFuture;
use futures::stream::FuturesOrdered;
use gpumedic_runtime::fault;
use gpumedic_runtime::kafka::{self, KafkaSettings, Producer, TopicSpec, record_headers};
use gpumedic_schemas::{Codec, HealthEvent, Record as _};
use rdkafka::message::{Header, OwnedHeaders};
use rdkafka::producer::FutureRecord;
use tokio::sync::{mpsc, oneshot};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use crate::events::{DeliveryFailed, EventLost, EventRefused, InternalEvent as _, names};
use crate::identity::NodeIdentity;
use crate::node_token::{NodeToken, Proof};
use crate::spool::{Appended, Spool, SpoolError, SpoolRecord};

/// Most spooled records in flight while the spool drains.
pub const DRAIN_WINDOW: usize = 512;
/// Events waiting in the channel between the sources and the publisher.
pub const CHANNEL_CAPACITY: usize = 4096;
/// How long in-flight deliveries may finish at shutdown before their events are spooled.
const SHUTDOWN_GRACE: Duration = Duration::from_secs(3);
const MAX_BACKOFF: Duration = Duration::from_secs(10);

/// What became of an event handed to the publisher.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    /// Kafka acknowledged it.
    Published,
    /// It is durable in the spool and will be published when Kafka is back.
    Spooled,
    /// The spool was full of faults and the event was healthy evidence: dropped and counted.
    Dropped,
    /// Kafka refuses the event for good (larger than the topic allows, not authorized): it is
    /// not kept, and is counted in `gpumedic_collector_events_refused_total` and logged.
    Refused,
}

/// Why an event could not be handed over.
#[derive(Debug, thiserror::Error)]
pub enum PublishError {
    /// The publisher has stopped (shutdown).
    #[error("the collector is shutting down")]
    Closed,
    /// The event could not be encoded.
    #[error("cannot encode the event: {0}")]
    Encode(String),
}

/// One event on its way to the publisher.
struct Outgoing {
    record: SpoolRecord,
    ack: Option<oneshot::Sender<Outcome>>,
}

/// Turns an event into the record the publisher produces (and the spool keeps).
///
/// # Errors
/// [`PublishError::Encode`] when the event does not encode.
pub fn to_record(event: &HealthEvent, codec: &Codec) -> Result<SpoolRecord, PublishError> {
    // Encoded now, with the schema id of this build's writer schema: a spooled record keeps it, and
    // ids never change in the embedded table or in a schema registry.
    let value = codec.encode(event).map_err(|e| PublishError::Encode(e.to_string()))?;
    Ok(SpoolRecord {
        key: event.node.clone(),
        id: event.event_id.to_string(),
        kind: format!("{:?}", event.kind),
        droppable: event.healthy,
        value,
    })
}

/// Hands events to the publisher. Cheap to clone; every source holds one.
///
/// Every event is stamped here on its way in ([`NodeIdentity::stamp`]): the node's boot id, and
/// a GPU named by PCI bus id alone gets its UUID and index. The stamp happens at submission, so
/// an event spooled before a reboot keeps the boot it was seen in.
#[derive(Clone)]
pub struct Sink {
    tx: mpsc::Sender<Outgoing>,
    codec: Arc<Codec>,
    identity: NodeIdentity,
}

impl Sink {
    /// The node identity events are stamped with.
    pub fn identity(&self) -> &NodeIdentity {
        &self.identity
    }

    fn record(&self, event: &HealthEvent) -> Result<SpoolRecord, PublishError> {
        to_record(&self.identity.stamp(event), &self.codec)
    }

    /// Queues `event` (waiting while the channel is full) and returns what will say when it is
    /// published or spooled.
    ///
    /// # Errors
    /// [`PublishError::Closed`] at shutdown, [`PublishError::Encode`].
    pub async fn submit(&self, event: &HealthEvent) -> Result<oneshot::Receiver<Outcome>, PublishError> {
        let record = self.record(event)?;
        let (ack, rx) = oneshot::channel();
        self.tx.send(Outgoing { record, ack: Some(ack) }).await.map_err(|_| PublishError::Closed)?;
        Ok(rx)
    }

    /// Publishes `event`: returns once Kafka acknowledged it or it is durable in the spool.
    ///
    /// # Errors
    /// [`PublishError::Closed`] at shutdown, [`PublishError::Encode`].
    pub async fn emit(&self, event: &HealthEvent) -> Result<Outcome, PublishError> {
        self.submit(event).await?.await.map_err(|_| PublishError::Closed)
    }

    /// Like [`Sink::emit`], for a source that must not lose its event: false when `token` is
    /// cancelled (or the publisher stopped) first.
    pub async fn emit_until_done(&self, event: &HealthEvent, token: &CancellationToken) -> bool {
        tokio::select! {
            () = token.cancelled() => false,
            r = self.emit(event) => match r {
                Ok(_) => true,
                Err(PublishError::Closed) => false,
                Err(e) => {
                    tracing::error!(error = %e, event_id = %event.event_id, "A health event cannot be published; it is lost.");
                    true
                }
            },
        }
    }

    /// Queues `event` without waiting and without an answer; false when the channel is full.
    pub fn try_offer(&self, event: &HealthEvent) -> bool {
        let record = match self.record(event) {
            Ok(r) => r,
            Err(e) => {
                tracing::error!(error = %e, event_id = %event.event_id, "A health event cannot be published; it is lost.");
                return true;
            }
        };
        // Closed means shutdown: the event is not taken, and nothing waits for it.
        !matches!(self.tx.try_send(Outgoing { record, ack: None }), Err(mpsc::error::TrySendError::Full(_)))
    }
}

/// The sampler's side of the channel: never waits. When the channel is full, heartbeats (healthy
/// evidence) are dropped and counted, and faults wait here, in order, for the next sample.
pub struct Outbox {
    sink: Sink,
    backlog: VecDeque<HealthEvent>,
}

/// Most faults the sampler keeps while the publisher takes nothing.
const OUTBOX_CAPACITY: usize = 1024;

impl Outbox {
    /// An outbox over `sink`.
    pub fn new(sink: Sink) -> Self {
        Self { sink, backlog: VecDeque::new() }
    }

    /// Queues `events` behind any earlier backlog, without waiting.
    pub fn offer(&mut self, events: impl IntoIterator<Item = HealthEvent>) {
        while let Some(e) = self.backlog.front() {
            if !self.sink.try_offer(e) {
                break;
            }
            self.backlog.pop_front();
        }
        for e in events {
            if self.backlog.is_empty() && self.sink.try_offer(&e) {
                continue;
            }
            if e.healthy {
                metrics::counter!(names::HEARTBEATS_DROPPED_TOTAL).increment(1);
                continue;
            }
            if self.backlog.len() >= OUTBOX_CAPACITY {
                let lost = self.backlog.pop_front().expect("full");
                EventLost { event_id: &lost.event_id, kind: &lost.kind }.emit();
            }
            self.backlog.push_back(e);
        }
    }
}

/// How the publisher runs.
#[derive(Debug, Clone)]
pub struct PublisherSettings {
    /// Kafka, for creating the topic.
    pub kafka: KafkaSettings,
    /// The topic events go to.
    pub topic: String,
    /// The spool folder.
    pub spool_dir: PathBuf,
    /// The spool's bound.
    pub spool_max_bytes: u64,
}

/// The publisher task; see the module documentation.
pub struct Publisher {
    settings: PublisherSettings,
    producer: Producer,
    spool: Spool,
    rx: mpsc::Receiver<Outgoing>,
    node_token: NodeToken,
}

type Delivery = BoxFuture<'static, Done>;

enum Done {
    Direct { id: u64, result: Result<(), Failure> },
    Spooled { seq: u64, generation: u64, kind: String, event: String, alone: bool, result: Result<(), Failure> },
}

/// Why Kafka did not take a record, and whether it ever will.
#[derive(Debug, Clone)]
struct Failure {
    error: String,
    /// Kafka refuses this record for good ([`fault::is_permanent`]).
    permanent: bool,
}

impl Failure {
    fn of(error: &rdkafka::error::KafkaError) -> Self {
        Self { error: error.to_string(), permanent: fault::is_permanent(error) }
    }
}

/// Counts and logs a record Kafka refuses for good.
fn refused(record: &SpoolRecord, failure: &Failure) {
    EventRefused { id: &record.id, kind: &record.kind, error: &failure.error, bytes: Some(record.value.len()) }.emit();
}

struct Direct {
    id: u64,
    record: SpoolRecord,
    ack: Option<oneshot::Sender<Outcome>>,
}

impl Publisher {
    /// Opens the spool and returns the publisher (to spawn) and the sink sources publish through,
    /// which stamps every event with `identity`.
    ///
    /// # Errors
    /// [`SpoolError`] when the spool cannot be opened.
    pub fn open(
        settings: PublisherSettings,
        producer: Producer,
        codec: Arc<Codec>,
        identity: NodeIdentity,
    ) -> Result<(Self, Sink), SpoolError> {
        let spool = Spool::open(&settings.spool_dir, settings.spool_max_bytes)?;
        let (tx, rx) = mpsc::channel(CHANNEL_CAPACITY);
        Ok((Self { settings, producer, spool, rx, node_token: NodeToken::default() }, Sink { tx, codec, identity }))
    }

    /// Produces every record with `token` (read at each produce, so a rotation applies to the
    /// next record); without it records carry no node token.
    #[must_use]
    pub fn with_node_token(mut self, token: NodeToken) -> Self {
        self.node_token = token;
        self
    }

    fn send(&self, record: &SpoolRecord) -> Result<BoxFuture<'static, Result<(), Failure>>, Failure> {
        let tp = kafka::traceparent(None);
        let mut headers = OwnedHeaders::new_with_capacity(4)
            .insert(Header { key: record_headers::TRACEPARENT, value: Some(tp.as_bytes()) })
            .insert(Header { key: record_headers::EVENT_ID, value: Some(record.id.as_bytes()) })
            .insert(Header { key: record_headers::CONTENT_TYPE, value: Some(HealthEvent::CONTENT_TYPE.as_bytes()) });
        // The proof of now, not of when the record was spooled (see the module documentation).
        let (token, signed) = match self.node_token.proof() {
            Proof::Signed(key) => (None, Some((key.sign(record.key.as_bytes(), &record.value), key))),
            Proof::Token(token) => (Some(token), None),
            Proof::None => (None, None),
        };
        if let Some(token) = &token {
            headers = headers.insert(Header { key: record_headers::NODE_TOKEN, value: Some(&token[..]) });
        }
        if let Some((signature, key)) = &signed {
            headers = headers
                .insert(Header { key: record_headers::NODE_KEY_ID, value: Some(key.id().as_bytes()) })
                .insert(Header { key: record_headers::NODE_SIGNATURE, value: Some(&signature[..]) });
        }
        let fr = FutureRecord::to(&self.settings.topic).key(&record.key).payload(&record.value).headers(headers);
        let delivery = self.producer.send_result(fr).map_err(|(e, _)| Failure::of(&e))?;
        Ok(Box::pin(async move {
            match delivery.await {
                Ok(Ok(_)) => Ok(()),
                Ok(Err((e, _))) => Err(Failure::of(&e)),
                Err(_) => Err(Failure { error: "the producer was dropped".to_owned(), permanent: false }),
            }
        }))
    }

    /// Runs until `token` is cancelled; then spools whatever Kafka has not acknowledged.
    ///
    /// # Errors
    /// [`SpoolError::Io`] when the spool cannot be written: events would be lost, so the
    /// collector stops (and is restarted) rather than go on silently.
    pub async fn run(mut self, token: CancellationToken) -> Result<(), SpoolError> {
        let specs = [TopicSpec::new(self.settings.topic.clone(), gpumedic_schemas::topics::DEFAULT_PARTITIONS)];
        let mut state = State::default();
        let mut ensure: Option<BoxFuture<'static, Result<(), kafka::KafkaError>>> = None;
        let mut ensure_at = Instant::now();
        let mut inflight: FuturesOrdered<Delivery> = FuturesOrdered::new();
        loop {
            if !state.topic_ready && ensure.is_none() && Instant::now() >= ensure_at {
                let kafka = self.settings.kafka.clone();
                let specs = specs.clone();
                ensure = Some(Box::pin(async move { kafka.ensure_topics(&specs).await }));
            }
            self.place_waiting(&mut state)?;
            self.start_drain(&mut state, &mut inflight);
            self.spool.sync()?;
            for ack in state.spooled_acks.drain(..) {
                let _ = ack.send(Outcome::Spooled);
            }
            let accepting = state.waiting.is_empty() && (state.up || state.direct.is_empty());
            let timer = if !state.topic_ready && ensure.is_none() {
                Some(ensure_at)
            } else if state.topic_ready && !state.up && !state.probing && !state.retry_due && self.spool.has_unsent() {
                Some(state.retry_at)
            } else {
                None
            };
            tokio::select! {
                biased;
                () = token.cancelled() => break,
                Some(done) = inflight.next(), if !inflight.is_empty() => self.finish(&mut state, done)?,
                r = async { ensure.as_mut().expect("checked").await }, if ensure.is_some() => {
                    ensure = None;
                    match r {
                        Ok(()) => {
                            tracing::info!(topic = %self.settings.topic, "The topic is ready; publishing.");
                            state.topic_ready = true;
                            state.set_up(true);
                        }
                        Err(e) => {
                            tracing::warn!(error = %e, retry_in_ms = state.backoff.as_millis() as u64, "Kafka is not reachable; spooling events to disk until it is.");
                            ensure_at = Instant::now() + state.backoff;
                            state.backoff = (state.backoff * 2).min(MAX_BACKOFF);
                        }
                    }
                }
                () = tokio::time::sleep_until(timer.unwrap_or_else(Instant::now)), if timer.is_some() => {
                    state.retry_due = true;
                }
                Some(first) = self.rx.recv(), if accepting => {
                    // A batch per turn: one fsync covers every event spooled in it.
                    self.accept(&mut state, &mut inflight, first);
                    for _ in 1..256 {
                        let Ok(next) = self.rx.try_recv() else { break };
                        self.accept(&mut state, &mut inflight, next);
                    }
                }
            }
        }
        self.shut_down(state, inflight).await
    }

    /// Takes one event from a source: produced at once in direct mode, spooled otherwise.
    fn accept(&mut self, state: &mut State, inflight: &mut FuturesOrdered<Delivery>, o: Outgoing) {
        let direct_mode = state.topic_ready
            && state.up
            && self.spool.is_empty()
            && state.waiting.is_empty()
            && state.spooled_inflight == 0;
        if direct_mode {
            match self.send(&o.record) {
                Ok(fut) => {
                    let id = state.next_direct;
                    state.next_direct += 1;
                    inflight.push_back(Box::pin(async move { Done::Direct { id, result: fut.await } }));
                    state.direct.push_back(Direct { id, record: o.record, ack: o.ack });
                    return;
                }
                Err(f) if f.permanent => {
                    refused(&o.record, &f);
                    if let Some(ack) = o.ack {
                        let _ = ack.send(Outcome::Refused);
                    }
                    return;
                }
                Err(f) => tracing::warn!(error = %f.error, "The Kafka producer refused an event; spooling it."),
            }
        }
        state.waiting.push_back(o);
    }

    /// Moves waiting events into the spool while it has room.
    fn place_waiting(&mut self, state: &mut State) -> Result<(), SpoolError> {
        while let Some(o) = state.waiting.pop_front() {
            match self.spool.append(&o.record) {
                Ok(Appended::Stored) => {
                    metrics::counter!(names::SPOOLED_TOTAL, "kind" => o.record.kind.clone()).increment(1);
                    state.spooled_acks.extend(o.ack);
                }
                Ok(Appended::Dropped) => {
                    if let Some(ack) = o.ack {
                        let _ = ack.send(Outcome::Dropped);
                    }
                }
                Err(SpoolError::Full { bytes, max }) => {
                    if !state.full_logged {
                        tracing::warn!(
                            bytes,
                            max,
                            "The spool is full of faults; holding new events until Kafka takes some."
                        );
                        state.full_logged = true;
                    }
                    state.waiting.push_front(o);
                    return Ok(());
                }
                Err(SpoolError::TooLarge(len)) => {
                    tracing::error!(id = %o.record.id, bytes = len, "A health event is larger than the whole spool; it is lost.");
                }
                Err(e) => return Err(e),
            }
        }
        state.full_logged = false;
        Ok(())
    }

    /// Sends spooled records: a window of them while Kafka is up, one probe when a retry is due.
    fn start_drain(&mut self, state: &mut State, inflight: &mut FuturesOrdered<Delivery>) {
        if !state.topic_ready || !state.direct.is_empty() {
            return;
        }
        let window = if state.up && !state.alone {
            DRAIN_WINDOW
        } else if state.up || (state.retry_due && !state.probing) {
            1
        } else {
            return;
        };
        while state.spooled_inflight < window {
            let (seq, record) = match self.spool.next_unsent() {
                Ok(Some(next)) => next,
                Ok(None) => break,
                Err(e) => {
                    tracing::error!(error = %e, "Cannot read the spool; retrying later.");
                    break;
                }
            };
            let generation = state.generation;
            match self.send(&record) {
                Err(f) if f.permanent => {
                    // Refused before sending, for itself alone; settled in turn, after the
                    // records ahead of it, since the spool acknowledges in order.
                    let (kind, event) = (record.kind, record.id);
                    inflight.push_back(Box::pin(async move {
                        Done::Spooled { seq, generation, kind, event, alone: true, result: Err(f) }
                    }));
                    state.spooled_inflight += 1;
                }
                Ok(fut) => {
                    let (kind, event, alone) = (record.kind, record.id, window == 1);
                    inflight.push_back(Box::pin(async move {
                        Done::Spooled { seq, generation, kind, event, alone, result: fut.await }
                    }));
                    state.spooled_inflight += 1;
                    if !state.up {
                        state.probing = true;
                        state.retry_due = false;
                    }
                }
                Err(f) => {
                    // The local queue is full: try again once deliveries made room.
                    tracing::debug!(error = %f.error, "The producer queue is full; draining later.");
                    self.spool.rewind();
                    state.generation += 1;
                    break;
                }
            }
        }
    }

    fn finish(&mut self, state: &mut State, done: Done) -> Result<(), SpoolError> {
        match done {
            Done::Direct { id, result } => {
                let Some(pos) = state.direct.iter().position(|d| d.id == id) else { return Ok(()) };
                let d = state.direct.remove(pos).expect("found");
                match result {
                    Ok(()) => {
                        published(&d.record);
                        if let Some(ack) = d.ack {
                            let _ = ack.send(Outcome::Published);
                        }
                    }
                    Err(f) => {
                        if f.permanent {
                            // Refused with whatever shared its request: spooled, and sent alone
                            // to find out whether it is the one at fault. Kafka is up.
                            state.alone = true;
                        } else {
                            state.failed(&f.error);
                        }
                        state.waiting.push_back(Outgoing { record: d.record, ack: d.ack });
                    }
                }
            }
            Done::Spooled { seq, generation, kind, event, alone, result } => {
                if generation != state.generation {
                    return Ok(());
                }
                state.spooled_inflight -= 1;
                state.probing = false;
                match result {
                    Ok(()) => {
                        state.set_up(true);
                        state.alone = false;
                        self.spool.ack(seq)?;
                        metrics::counter!(names::EVENTS_TOTAL, "kind" => kind).increment(1);
                    }
                    Err(f) if f.permanent && !alone => {
                        // Refused with the others in its request: send one at a time.
                        state.alone = true;
                        state.generation += 1;
                        state.spooled_inflight = 0;
                        self.spool.rewind();
                    }
                    Err(f) if f.permanent => {
                        // Refused alone: out of the spool's head, so the records behind it drain.
                        self.spool.ack(seq)?;
                        EventRefused { id: &event, kind: &kind, error: &f.error, bytes: None }.emit();
                    }
                    Err(f) => {
                        state.failed(&f.error);
                        state.generation += 1;
                        state.spooled_inflight = 0;
                        self.spool.rewind();
                    }
                }
            }
        }
        Ok(())
    }

    async fn shut_down(mut self, mut state: State, mut inflight: FuturesOrdered<Delivery>) -> Result<(), SpoolError> {
        self.rx.close();
        while let Ok(o) = self.rx.try_recv() {
            state.waiting.push_back(o);
        }
        // Let deliveries in flight finish for a moment; what Kafka has not acknowledged by then
        // is spooled for the next start.
        let grace = tokio::time::sleep(SHUTDOWN_GRACE);
        tokio::pin!(grace);
        while !inflight.is_empty() {
            tokio::select! {
                () = &mut grace => break,
                Some(done) = inflight.next() => self.finish(&mut state, done)?,
            }
        }
        for d in std::mem::take(&mut state.direct) {
            state.waiting.push_back(Outgoing { record: d.record, ack: d.ack });
        }
        self.place_waiting(&mut state)?;
        self.spool.sync()?;
        for ack in state.spooled_acks.drain(..) {
            let _ = ack.send(Outcome::Spooled);
        }
        if !state.waiting.is_empty() {
            tracing::error!(
                events = state.waiting.len(),
                "The spool is full of faults at shutdown; these events are lost."
            );
        }
        if !self.spool.is_empty() {
            tracing::info!(
                records = self.spool.len(),
                bytes = self.spool.bytes(),
                "Events wait in the spool for the next start."
            );
        }
        Ok(())
    }
}

fn published(record: &SpoolRecord) {
    metrics::counter!(names::EVENTS_TOTAL, "kind" => record.kind.clone()).increment(1);
}

/// The publisher's bookkeeping between loop turns.
struct State {
    topic_ready: bool,
    /// Kafka acknowledged the last delivery.
    up: bool,
    /// A probe is in flight while Kafka is down.
    probing: bool,
    retry_due: bool,
    retry_at: Instant,
    backoff: Duration,
    /// Bumped on a failed spooled send: deliveries of an older generation are ignored.
    generation: u64,
    spooled_inflight: usize,
    /// Kafka refused a request for good: spooled records go one at a time until one is
    /// acknowledged, so the refusal is pinned on the record that earns it.
    alone: bool,
    direct: VecDeque<Direct>,
    next_direct: u64,
    /// Events to spool, in order, when the spool has room.
    waiting: VecDeque<Outgoing>,
    /// Sources to answer once the spool is fsynced.
    spooled_acks: Vec<oneshot::Sender<Outcome>>,
    full_logged: bool,
}

impl Default for State {
    fn default() -> Self {
        Self {
            topic_ready: false,
            up: false,
            probing: false,
            retry_due: false,
            retry_at: Instant::now(),
            backoff: Duration::from_millis(200),
            generation: 0,
            spooled_inflight: 0,
            alone: false,
            direct: VecDeque::new(),
            next_direct: 0,
            waiting: VecDeque::new(),
            spooled_acks: Vec::new(),
            full_logged: false,
        }
    }
}

impl State {
    fn set_up(&mut self, up: bool) {
        if up && !self.up {
            tracing::info!("Kafka takes events; draining the spool first if anything waits there.");
            self.backoff = Duration::from_millis(200);
        }
        self.up = up;
        metrics::gauge!(names::KAFKA_UP).set(if up { 1.0 } else { 0.0 });
    }

    fn failed(&mut self, error: &str) {
        DeliveryFailed { error, was_up: self.up }.emit();
        self.set_up(false);
        self.retry_due = false;
        self.retry_at = Instant::now() + self.backoff;
        self.backoff = (self.backoff * 2).min(MAX_BACKOFF);
    }
}

/// A [`Sink`] for unit tests: what goes in comes out of the [`test_support::Tap`], decoded, and
/// is acknowledged as published.
#[cfg(test)]
pub(crate) mod test_support {
    use super::*;

    /// The other end of a test sink.
    pub(crate) struct Tap {
        rx: mpsc::Receiver<Outgoing>,
        codec: Arc<Codec>,
    }

    /// A sink stamping `identity`, and its tap.
    pub(crate) fn sink(identity: NodeIdentity) -> (Sink, Tap) {
        let (tx, rx) = mpsc::channel(1024);
        let codec = Arc::new(Codec::embedded());
        (Sink { tx, codec: codec.clone(), identity }, Tap { rx, codec })
    }

    impl Tap {
        /// The next event, acknowledged as published; `None` once every sink is gone.
        pub(crate) async fn next(&mut self) -> Option<HealthEvent> {
            let out = self.rx.recv().await?;
            if let Some(ack) = out.ack {
                let _ = ack.send(Outcome::Published);
            }
            Some(self.codec.decode(&out.record.value).await.expect("the sink's own encoding decodes"))
        }
    }
}
