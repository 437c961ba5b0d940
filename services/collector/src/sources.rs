//! The collector's long-running sources, and [`Emitter`], which publishes straight to Kafka
//! without the spool (for `gpumedic inject`; the service's sources publish through
//! [`crate::publisher::Sink`]).

use std::path::{Path, PathBuf};
use std::time::Duration;

use gpumedic_runtime::kafka::{self, KafkaError, Producer};
use gpumedic_schemas::health::{Component, Detail, Entity, MonitorHealthDetail, MonitorState, Source};
use gpumedic_schemas::{HealthEvent, Record as _, topics};
use tokio_util::sync::CancellationToken;

use crate::gpu::GpuBackend;
use crate::inventory::Inventory;
use crate::kernel_log::kmsg::{self, Admission, Cursor, KmsgReader, Resume, Skip, read_boot_time, wall_time};
use crate::kernel_log::{LineOrigin, LogParser, event::to_health_event};
use crate::publisher::{Outbox, Sink};
use crate::sampler::Sampler;

/// Publishes health events on the raw topic, keyed by node, with the standard headers.
#[derive(Clone)]
pub struct Emitter {
    /// The producer.
    pub producer: Producer,
    /// The codec (embedded schema ids, or a schema registry's).
    pub codec: std::sync::Arc<gpumedic_schemas::Codec>,
}

impl Emitter {
    /// Publishes `event` and waits for Kafka's acknowledgement.
    pub async fn emit(&self, event: &HealthEvent) -> Result<(), KafkaError> {
        self.emit_with_token(event, None).await
    }

    /// Publishes `event` with `node_token` in its `gpumedic.node-token` header (an operator's
    /// token for `gpumedic inject`, checked by an enricher that enforces node authentication),
    /// and waits for Kafka's acknowledgement.
    pub async fn emit_with_token(&self, event: &HealthEvent, node_token: Option<&[u8]>) -> Result<(), KafkaError> {
        let bytes = self.codec.encode(event).expect("events built by the collector always encode");
        let id = event.event_id.to_string();
        let envelope = kafka::Envelope {
            topic: topics::HEALTH_RAW,
            key: &event.node,
            id: &id,
            content_type: HealthEvent::CONTENT_TYPE,
            incoming_trace: None,
        };
        match node_token {
            None => kafka::publish_record(&self.producer, envelope, &bytes).await?,
            Some(t) => {
                let tp = kafka::traceparent(None);
                let headers = [
                    (kafka::record_headers::TRACEPARENT, tp.as_bytes()),
                    (kafka::record_headers::EVENT_ID, id.as_bytes()),
                    (kafka::record_headers::CONTENT_TYPE, HealthEvent::CONTENT_TYPE.as_bytes()),
                    (kafka::record_headers::NODE_TOKEN, t),
                ];
                kafka::publish(&self.producer, topics::HEALTH_RAW, &event.node, &bytes, &headers).await?;
            }
        }
        metrics::counter!("gpumedic_collector_events_total", "kind" => format!("{:?}", event.kind)).increment(1);
        Ok(())
    }

    /// Publishes, retrying with backoff until it succeeds or `token` is cancelled (false then).
    pub async fn emit_until_done(&self, event: &HealthEvent, token: &CancellationToken) -> bool {
        let mut backoff = Duration::from_millis(200);
        loop {
            match self.emit(event).await {
                Ok(()) => return true,
                Err(e) => tracing::warn!(error = %e, "Cannot publish a health event; retrying."),
            }
            tokio::select! {
                () = token.cancelled() => return false,
                () = tokio::time::sleep(backoff) => {}
            }
            backoff = (backoff * 2).min(Duration::from_secs(10));
        }
    }
}

fn monitor_event(node: &str, monitor: &str, state: MonitorState, message: String) -> HealthEvent {
    let mut e = HealthEvent::new(
        node,
        Source::Nvml,
        Component::Node,
        Entity::default(),
        Detail::MonitorHealth(MonitorHealthDetail { monitor: monitor.into(), state, message: Some(message) }),
    );
    e.healthy = state == MonitorState::Ok;
    e
}

/// How GPU sampling runs.
#[derive(Debug, Clone)]
pub struct SamplingSettings {
    /// The node.
    pub node: String,
    /// The source events are attributed to.
    pub source: Source,
    /// Time between samples.
    pub interval: Duration,
    /// Time between heartbeats of an unchanged GPU.
    pub heartbeat: Duration,
    /// A sample taking longer is a hung monitor.
    pub timeout: Duration,
    /// Where the GPU inventory keeps its count across restarts.
    pub state_dir: PathBuf,
    /// Time between inventories when nothing changes.
    pub inventory_refresh: Duration,
}

/// Samples GPUs every `interval` on a blocking thread; a sample that takes longer than `timeout`
/// is reported as a hung monitor and does not stall anything else. Each sample also feeds the
/// GPU inventory ([`Inventory`]), published at start, on a change and every `inventory_refresh`.
pub async fn sample_gpus(
    settings: SamplingSettings,
    backend: Box<dyn GpuBackend>,
    sink: Sink,
    token: CancellationToken,
) -> Result<(), KafkaError> {
    let SamplingSettings { node, source, interval, heartbeat, timeout, state_dir, inventory_refresh } = settings;
    let name = backend.name();
    let identity = sink.identity().clone();
    let mut inventory = Inventory::open(&node, &state_dir, inventory_refresh, identity.clone());
    let mut boot_id = identity.boot_id();
    let mut sampler = Sampler::new(&node, source, heartbeat);
    let backend = std::sync::Arc::new(std::sync::Mutex::new(backend));
    let mut hung = false;
    // Sampling never waits for the broker: the outbox drops heartbeats when the publisher is
    // saturated and keeps faults for the next turn.
    let mut outbox = Outbox::new(sink);
    loop {
        let b = backend.clone();
        let boot_before = identity.boot_id();
        let call = tokio::task::spawn_blocking(move || b.lock().expect("backend lock").sample());
        let events = match tokio::time::timeout(timeout, call).await {
            Ok(Ok(Ok(samples))) => {
                let mut events = Vec::new();
                if hung {
                    hung = false;
                    events.push(monitor_event(&node, name, MonitorState::Ok, format!("{name} answers again")));
                }
                if identity.boot_id() != boot_before {
                    // The node rebooted (a simulated reboot) while it was sampled: the readings
                    // may be from either boot, so they are dropped; the next sample is all new.
                } else {
                    if boot_before != boot_id {
                        // A new boot: every GPU is seen afresh, as by a collector started now.
                        boot_id = boot_before;
                        sampler = Sampler::new(&node, source, heartbeat);
                    }
                    // The inventory goes first: a reboot's proof of repair is a complete
                    // inventory of the new boot, then the lost GPU's own heartbeat.
                    events.extend(inventory.observe(crate::inventory::present(&samples), std::time::Instant::now()));
                    events.extend(sampler.observe(&samples, chrono::Utc::now()));
                }
                events
            }
            Ok(Ok(Err(e))) => vec![monitor_event(&node, name, MonitorState::Error, e.to_string())],
            Ok(Err(join)) => {
                vec![monitor_event(&node, name, MonitorState::Error, format!("sampling panicked: {join}"))]
            }
            Err(_) if hung => Vec::new(),
            Err(_) => {
                hung = true;
                metrics::counter!("gpumedic_collector_monitor_hung_total", "monitor" => name).increment(1);
                tracing::warn!(
                    monitor = name,
                    timeout_ms = timeout.as_millis() as u64,
                    "A GPU sample hung; reporting it."
                );
                vec![monitor_event(
                    &node,
                    name,
                    MonitorState::Hung,
                    format!("{name} did not answer within {timeout:?}"),
                )]
            }
        };
        outbox.offer(events);
        tokio::select! {
            () = token.cancelled() => return Ok(()),
            () = tokio::time::sleep(interval) => {}
        }
    }
}

/// Where the kernel's boot time is read (`btime`), when this boot's cursor has none yet.
const PROC_STAT: &str = "/proc/stat";

/// Where and how the kernel log is followed.
#[derive(Debug, Clone)]
pub struct KernelLog {
    /// This node's name.
    pub node: String,
    /// `/dev/kmsg`, or a file of records in its format.
    pub path: PathBuf,
    /// Where the cursor is kept.
    pub state_dir: PathBuf,
    /// The host's boot id: the cursor's, and part of every event id.
    pub boot_id: String,
    /// On a first run, how far back records are published.
    pub look_back: Duration,
}

/// Reads the kernel log, publishes what it recognises in the kernel's own records, and saves the
/// cursor (`boot_id`, the host's, the sequence and the boot time) in the state folder after each
/// publish, so a restart neither re-reports nor misses. Each event's id comes from (node, boot
/// id, sequence) and its time from the boot time plus the record's timestamp, so a record read
/// twice (a crash before the save) is the same event both times.
pub async fn follow_kernel_log(
    log: KernelLog,
    emitter: Sink,
    token: CancellationToken,
) -> Result<(), crate::kernel_log::kmsg::KmsgError> {
    let KernelLog { node, path, state_dir, boot_id, look_back } = log;
    let cursor_path = state_dir.join("kmsg.cursor");
    let saved = Cursor::load(&cursor_path)?;
    let resume = Resume::decide(saved.as_ref(), &boot_id);
    // The boot time saved with this boot's cursor, so times stay the same across restarts.
    let boot_time_us = match saved.as_ref().filter(|c| c.boot_id == boot_id).and_then(|c| c.boot_time_us) {
        Some(t) => t,
        None => read_boot_time(Path::new(PROC_STAT))?,
    };
    let admission = Admission::new(resume, chrono::Utc::now(), look_back);
    tracing::info!(path = %path.display(), ?resume, look_back_s = look_back.as_secs(), "Following the kernel log.");
    let mut reader = KmsgReader::open(&path)?;
    let (tx, mut rx) = tokio::sync::mpsc::channel(1024);
    // Reads block until the kernel logs something, so they live on a thread of their own; it
    // ends when the channel closes at shutdown and the next record arrives.
    std::thread::Builder::new()
        .name("kmsg".into())
        .spawn(move || {
            loop {
                let r = reader.next_record();
                let failed = r.is_err();
                if tx.blocking_send(r).is_err() || failed {
                    return;
                }
            }
        })
        .map_err(|source| crate::kernel_log::kmsg::KmsgError::Read { path: path.clone(), source })?;

    let mut parser = LogParser::new();
    let mut found = Vec::new();
    let mut last_seq: Option<u64> = None;
    loop {
        // A multi-line record is complete once the log is quiet for a moment.
        let next = tokio::select! {
            () = token.cancelled() => return Ok(()),
            r = tokio::time::timeout(Duration::from_millis(250), rx.recv()) => r,
        };
        let mut current: Option<(u64, String)> = None;
        match next {
            Err(_) => parser.flush_from(&mut found),
            Ok(None) => return Ok(()),
            Ok(Some(Err(e))) => return Err(e),
            Ok(Some(Ok(record))) => {
                let at = wall_time(boot_time_us, record.timestamp_us);
                match admission.check(&record, at) {
                    Ok(()) => {
                        let origin = LineOrigin { seq: record.seq, timestamp_us: record.timestamp_us };
                        parser.feed_from(&record.text, origin, &mut found);
                        current = Some((record.seq, record.text));
                    }
                    Err(Skip::Seen) => continue,
                    Err(skip) => {
                        metrics::counter!("gpumedic_collector_kmsg_records_skipped_total", "reason" => skip.as_str())
                            .increment(1);
                        tracing::debug!(
                            seq = record.seq,
                            reason = skip.as_str(),
                            "A kernel-log record is not published."
                        );
                    }
                }
                // Skipped records are handled too: the cursor moves past them.
                last_seq = Some(record.seq);
            }
        }
        for (k, origin) in found.drain(..) {
            // The line the event started on is its raw text; an event completed by a later line
            // (or by a pause) has only its joined message.
            let raw = match &current {
                Some((seq, text)) if *seq == origin.seq => text.as_str(),
                _ => k.message.as_str(),
            };
            let mut event = to_health_event(&node, &k, raw);
            event.event_id = kmsg::event_id(&node, &boot_id, origin.seq);
            event.observed_at = wall_time(boot_time_us, origin.timestamp_us);
            if !emitter.emit_until_done(&event, &token).await {
                return Ok(());
            }
        }
        // Everything up to `last_seq` is published, unless a multi-line record is still open.
        // A crash before the save re-reads at most the records since the last one (at least once,
        // with the same ids).
        if parser.is_idle()
            && let Some(seq) = last_seq.take()
        {
            Cursor { boot_id: boot_id.clone(), seq, boot_time_us: Some(boot_time_us) }.save(&cursor_path)?;
        }
    }
}
