//! The collector's long-running sources, and [`Emitter`], which publishes straight to Kafka
//! without the spool (for `gpumedic inject`; the service's sources publish through
//! [`crate::publisher::Sink`]).

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use gpumedic_runtime::kafka::{self, KafkaError, Producer};
use gpumedic_schemas::health::{Component, Detail, Entity, MonitorHealthDetail, MonitorState, Source};
use gpumedic_schemas::{HealthEvent, Record as _, topics};
use tokio::sync::oneshot;
use tokio_util::sync::CancellationToken;

use crate::events::{InternalEvent as _, MonitorHung, names};
use crate::gpu::{BackendError, GpuBackend, GpuSample};
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
        metrics::counter!(names::EVENTS_TOTAL, "kind" => format!("{:?}", event.kind)).increment(1);
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

/// A `monitor_health` event about one of the collector's own sources (`monitor`), as `source`
/// reports it: healthy when `state` is `Ok`.
pub(crate) fn monitor_event(
    node: &str,
    source: Source,
    monitor: &str,
    state: MonitorState,
    message: String,
) -> HealthEvent {
    let mut e = HealthEvent::new(
        node,
        source,
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

/// Opens a GPU backend: NVML's initialisation, or the simulated node again. It runs on the
/// sampling worker's thread, so an initialisation that hangs is a hung sample, not a stuck task.
pub type BackendOpener = Arc<dyn Fn() -> Result<Box<dyn GpuBackend>, BackendError> + Send + Sync>;

/// The longest wait between two attempts to open a backend that failed to open.
pub const MAX_OPEN_BACKOFF: Duration = Duration::from_secs(300);

/// What the worker answers for one sample.
enum Answer {
    /// The backend could not be opened.
    OpenFailed(BackendError),
    /// The backend was open (`opened`: just now) and sampled.
    Sampled { opened: bool, result: Result<Vec<GpuSample>, BackendError> },
}

/// The one thread that calls the backend. NVML calls can hang; a hung call holds only this
/// thread, and no second call is queued behind it: the thread is replaced once the call comes back
/// (with a freshly opened backend), or at once if it died. So at most one thread is ever stuck.
struct Worker {
    jobs: std::sync::mpsc::Sender<oneshot::Sender<Answer>>,
    /// The answer of a call that missed its deadline, while it is still outstanding.
    stuck: Option<oneshot::Receiver<Answer>>,
}

impl Worker {
    fn start(name: &'static str, open: BackendOpener) -> std::io::Result<Self> {
        let (jobs, rx) = std::sync::mpsc::channel::<oneshot::Sender<Answer>>();
        std::thread::Builder::new().name(format!("{name}-sampler")).spawn(move || {
            let mut backend: Option<Box<dyn GpuBackend>> = None;
            // Ends when the sampling task drops the worker (or replaces it).
            while let Ok(reply) = rx.recv() {
                let opened = backend.is_none();
                if backend.is_none() {
                    match open() {
                        Ok(b) => backend = Some(b),
                        Err(e) => {
                            let _ = reply.send(Answer::OpenFailed(e));
                            continue;
                        }
                    }
                }
                let result = backend.as_mut().map(|b| b.sample()).unwrap_or_else(|| Ok(Vec::new()));
                // The sampling task may have given up on this answer (a missed deadline).
                let _ = reply.send(Answer::Sampled { opened, result });
            }
        })?;
        Ok(Self { jobs, stuck: None })
    }
}

/// The state of GPU sampling between two samples: the backend's worker, the init backoff, the
/// change detection ([`Sampler`]) and the GPU inventory ([`Inventory`]). [`sample_gpus`] calls
/// [`GpuSampling::tick`] every interval; tests call it directly.
pub struct GpuSampling {
    node: String,
    source: Source,
    heartbeat: Duration,
    timeout: Duration,
    name: &'static str,
    open: BackendOpener,
    worker: Option<Worker>,
    /// The backend answered at least once since the worker started.
    open_now: bool,
    /// Failed attempts to open the backend in a row, and when the next one may run.
    open_failures: u32,
    next_open: Option<std::time::Instant>,
    hung: bool,
    identity: crate::identity::NodeIdentity,
    inventory: Inventory,
    boot_id: String,
    sampler: Sampler,
    /// The last good sample of each GPU, whose names stand in for a GPU that cannot be read.
    known: HashMap<u32, GpuSample>,
}

impl GpuSampling {
    /// Sampling for `settings.node` through backends from `open`, stamped with `identity`.
    pub fn new(
        settings: &SamplingSettings,
        name: &'static str,
        open: BackendOpener,
        identity: crate::identity::NodeIdentity,
    ) -> Self {
        let inventory =
            Inventory::open(&settings.node, &settings.state_dir, settings.inventory_refresh, identity.clone());
        Self {
            node: settings.node.clone(),
            source: settings.source,
            heartbeat: settings.heartbeat,
            timeout: settings.timeout,
            name,
            open,
            worker: None,
            open_now: false,
            open_failures: 0,
            next_open: None,
            hung: false,
            boot_id: identity.boot_id(),
            identity,
            inventory,
            sampler: Sampler::new(&settings.node, settings.source, settings.heartbeat),
            known: HashMap::new(),
        }
    }

    fn monitor(&self, state: MonitorState, message: String) -> HealthEvent {
        monitor_event(&self.node, Source::Nvml, self.name, state, message)
    }

    /// One sample at `now`: the events it calls for. Never waits longer than the sample timeout.
    pub async fn tick(&mut self, now: std::time::Instant) -> Vec<HealthEvent> {
        let mut events = Vec::new();
        // A worker stuck in a call: replaced once the call comes back (or the thread died), and
        // nothing else is asked of it meanwhile.
        if let Some(stuck) = self.worker.as_mut().and_then(|w| w.stuck.as_mut()) {
            match stuck.try_recv() {
                Err(oneshot::error::TryRecvError::Empty) => return events,
                Ok(_) | Err(oneshot::error::TryRecvError::Closed) => {
                    tracing::info!(
                        monitor = self.name,
                        "The hung GPU sample came back; starting a fresh sampling worker."
                    );
                    self.worker = None;
                    self.open_now = false;
                }
            }
        }
        if !self.open_now && self.next_open.is_some_and(|at| now < at) {
            return events;
        }
        if self.worker.is_none() {
            match Worker::start(self.name, self.open.clone()) {
                Ok(w) => self.worker = Some(w),
                Err(e) => {
                    tracing::warn!(monitor = self.name, error = %e, "Cannot start the GPU sampling thread; trying again at the next sample.");
                    return vec![self.monitor(MonitorState::Error, format!("cannot start the sampling thread: {e}"))];
                }
            }
        }
        let Some(worker) = self.worker.as_mut() else { return events };
        let (reply, answer) = oneshot::channel();
        if worker.jobs.send(reply).is_err() {
            // The thread is gone (a backend panicked): the next sample starts a new one.
            self.worker = None;
            self.open_now = false;
            return vec![self.monitor(MonitorState::Error, "the sampling thread died".into())];
        }
        let boot_before = self.identity.boot_id();
        let mut answer = answer;
        let result = tokio::time::timeout(self.timeout, &mut answer).await;
        match result {
            Err(_) => {
                worker.stuck = Some(answer);
                if !self.hung {
                    self.hung = true;
                    MonitorHung { monitor: self.name, timeout: self.timeout }.emit();
                    events.push(self.monitor(
                        MonitorState::Hung,
                        format!("{} did not answer within {:?}", self.name, self.timeout),
                    ));
                }
            }
            Ok(Err(_)) => {
                self.worker = None;
                self.open_now = false;
                events.push(self.monitor(MonitorState::Error, "sampling panicked".into()));
            }
            Ok(Ok(Answer::OpenFailed(e))) => {
                self.worker = None;
                self.open_failures += 1;
                let backoff = self
                    .timeout
                    .max(Duration::from_secs(1))
                    .saturating_mul(1 << self.open_failures.min(12))
                    .min(MAX_OPEN_BACKOFF);
                self.next_open = Some(now + backoff);
                metrics::counter!(names::BACKEND_OPEN_FAILURES_TOTAL, "monitor" => self.name).increment(1);
                tracing::warn!(
                    monitor = self.name,
                    error = %e,
                    attempts = self.open_failures,
                    retry_in_s = backoff.as_secs(),
                    "The GPU backend cannot be opened; trying again later."
                );
                if self.open_failures == 1 {
                    events.push(self.monitor(MonitorState::Unavailable, e.to_string()));
                }
            }
            Ok(Ok(Answer::Sampled { opened, result })) => {
                if opened {
                    self.open_now = true;
                    if self.open_failures > 0 {
                        tracing::info!(
                            monitor = self.name,
                            attempts = self.open_failures + 1,
                            "The GPU backend opened after failing; sampling resumes."
                        );
                        events.push(self.monitor(
                            MonitorState::Ok,
                            format!("{} opened after {} failed attempts", self.name, self.open_failures),
                        ));
                    }
                    self.open_failures = 0;
                    self.next_open = None;
                }
                match result {
                    Ok(samples) => {
                        if self.hung {
                            self.hung = false;
                            events.push(self.monitor(MonitorState::Ok, format!("{} answers again", self.name)));
                        }
                        events.extend(self.observe(samples, boot_before));
                    }
                    Err(e) => events.push(self.monitor(MonitorState::Error, e.to_string())),
                }
            }
        }
        events
    }

    fn observe(&mut self, mut samples: Vec<GpuSample>, boot_before: String) -> Vec<HealthEvent> {
        if self.identity.boot_id() != boot_before {
            // The node rebooted (a simulated reboot) while it was sampled: the readings may be
            // from either boot, so they are dropped; the next sample is all new.
            return Vec::new();
        }
        if boot_before != self.boot_id {
            // A new boot: every GPU is seen afresh, as by a collector started now.
            self.boot_id = boot_before;
            self.sampler = Sampler::new(&self.node, self.source, self.heartbeat);
            self.known.clear();
        }
        // A GPU that cannot be read is still present: its last known names stand in for it.
        for s in samples.iter_mut() {
            match (&s.error, self.known.get(&s.index)) {
                (Some(_), Some(k)) => {
                    s.uuid.clone_from(&k.uuid);
                    s.pci_bus_id.clone_from(&k.pci_bus_id);
                    s.serial.clone_from(&k.serial);
                    s.product.clone_from(&k.product);
                }
                (None, _) if !s.lost => {
                    self.known.insert(s.index, s.clone());
                }
                _ => {}
            }
        }
        // The MIG devices of each GPU read this time, so that an event on the GPU names the pods
        // on them (a GPU not read keeps the devices it last had).
        for s in samples.iter().filter(|s| s.error.is_none() && !s.lost && !s.uuid.is_empty()) {
            self.identity.set_mig_devices(&s.uuid, s.mig_devices.iter().cloned());
        }
        // A reboot's proof of repair is a complete inventory of the new boot, then the lost GPU's
        // own heartbeat; a GPU that leaves the inventory is reported lost before the inventory
        // without it (`publication_order`).
        let inventory = self.inventory.observe(crate::inventory::present(&samples), std::time::Instant::now());
        let sampled = self.sampler.observe_with_snapshot(&samples, chrono::Utc::now());
        crate::inventory::publication_order(inventory, sampled)
    }
}

/// Samples GPUs every `interval` on one worker thread ([`GpuSampling`]); a sample that takes
/// longer than `timeout` is reported as a hung monitor and does not stall anything else, a
/// backend that cannot be opened is tried again with backoff. Each sample also feeds the GPU
/// inventory ([`Inventory`]), published at start, on a change and every `inventory_refresh`.
pub async fn sample_gpus(
    settings: SamplingSettings,
    name: &'static str,
    open: BackendOpener,
    sink: Sink,
    token: CancellationToken,
) -> Result<(), KafkaError> {
    let interval = settings.interval;
    let mut sampling = GpuSampling::new(&settings, name, open, sink.identity().clone());
    // Sampling never waits for the broker: the outbox drops heartbeats when the publisher is
    // saturated and keeps faults for the next turn.
    let mut outbox = Outbox::new(sink);
    loop {
        let events = tokio::select! {
            () = token.cancelled() => return Ok(()),
            e = sampling.tick(std::time::Instant::now()) => e,
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
///
/// A failure to read the log (or its cursor) does not end the collector: it is a
/// `monitor_health` event (monitor `kernel_log`, state `error`; once per run of failures and
/// again when the error changes), counted in `gpumedic_collector_kmsg_read_failures_total`, and
/// the log is opened again after a backoff (1 s, doubling to [`MAX_KMSG_BACKOFF`]), resuming
/// from the saved cursor as after a restart. The first record read after a failure is a healthy
/// `monitor_health` event.
pub async fn follow_kernel_log(
    log: KernelLog,
    emitter: Sink,
    token: CancellationToken,
) -> Result<(), crate::kernel_log::kmsg::KmsgError> {
    let mut backoff = Duration::from_secs(1);
    let mut last_error: Option<String> = None;
    let mut recovered: Option<HealthEvent> = None;
    loop {
        match follow_kernel_log_once(&log, &emitter, &token, &mut recovered).await {
            Ok(()) => return Ok(()),
            Err(e) => {
                let message = e.to_string();
                metrics::counter!(names::KMSG_READ_FAILURES_TOTAL).increment(1);
                tracing::warn!(
                    path = %log.path.display(),
                    error = %message,
                    retry_in_ms = backoff.as_millis() as u64,
                    "The kernel log cannot be read; reporting it and trying again."
                );
                if recovered.is_none() {
                    // A record was read since the last report: this failure is news again.
                    last_error = None;
                }
                if last_error.as_deref() != Some(message.as_str()) {
                    let event = kernel_log_monitor(&log.node, MonitorState::Error, message.clone());
                    if !emitter.emit_until_done(&event, &token).await {
                        return Ok(());
                    }
                    last_error = Some(message);
                }
                recovered =
                    Some(kernel_log_monitor(&log.node, MonitorState::Ok, "the kernel log is read again".into()));
            }
        }
        tokio::select! {
            () = token.cancelled() => return Ok(()),
            () = tokio::time::sleep(backoff) => {}
        }
        backoff = (backoff * 2).min(MAX_KMSG_BACKOFF);
    }
}

/// The longest wait between two attempts to read a kernel log that failed.
pub const MAX_KMSG_BACKOFF: Duration = Duration::from_secs(60);

/// A `monitor_health` event about the kernel-log source.
fn kernel_log_monitor(node: &str, state: MonitorState, message: String) -> HealthEvent {
    monitor_event(node, Source::KernelLog, "kernel_log", state, message)
}

/// [`follow_kernel_log`] until the log fails: reads, publishes and saves the cursor. Publishes
/// `recovered` (and clears it) after the first record read.
async fn follow_kernel_log_once(
    log: &KernelLog,
    emitter: &Sink,
    token: &CancellationToken,
    recovered: &mut Option<HealthEvent>,
) -> Result<(), crate::kernel_log::kmsg::KmsgError> {
    let KernelLog { node, path, state_dir, boot_id, look_back } = log.clone();
    let (emitter, token) = (emitter.clone(), token.clone());
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
                if let Some(ok) = recovered.take()
                    && !emitter.emit_until_done(&ok, &token).await
                {
                    return Ok(());
                }
                let at = wall_time(boot_time_us, record.timestamp_us);
                match admission.check(&record, at) {
                    Ok(()) => {
                        let origin = LineOrigin { seq: record.seq, timestamp_us: record.timestamp_us };
                        parser.feed_from(&record.text, origin, &mut found);
                        current = Some((record.seq, record.text));
                    }
                    Err(Skip::Seen) => continue,
                    Err(skip) => {
                        metrics::counter!(names::KMSG_RECORDS_SKIPPED_TOTAL, "reason" => skip.as_str()).increment(1);
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

#[cfg(test)]
mod tests {
    //! Robust sampling: each test drives [`GpuSampling::tick`] or [`follow_kernel_log`] against a
    //! fake or simulated backend, without a GPU.

    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::{Condvar, Mutex};
    use std::time::Instant;

    use gpumedic_schemas::Kind;

    use super::*;
    use crate::gpu::Simulated;
    use crate::identity::NodeIdentity;
    use crate::publisher::test_support;

    fn settings(timeout: Duration) -> SamplingSettings {
        SamplingSettings {
            node: "n".into(),
            source: Source::Nvml,
            interval: Duration::from_secs(10),
            heartbeat: Duration::from_secs(3600),
            timeout,
            state_dir: std::env::temp_dir().join(format!("gpumedic-sampling-{}", uuid::Uuid::new_v4())),
            inventory_refresh: Duration::from_secs(3600),
        }
    }

    fn monitor(e: &HealthEvent) -> Option<(&str, MonitorState)> {
        match &e.detail {
            Detail::MonitorHealth(m) => Some((m.monitor.as_str(), m.state)),
            _ => None,
        }
    }

    fn heartbeat_of(events: &[HealthEvent], gpu: i32) -> bool {
        // The per-GPU heartbeat names the source (`nvml`, also for the simulated backend).
        events.iter().any(|e| e.entity.gpu_index == Some(gpu) && monitor(e) == Some(("nvml", MonitorState::Ok)))
    }

    fn simulated_opener(sim: Simulated) -> BackendOpener {
        Arc::new(move || Ok(Box::new(sim.clone()) as Box<dyn GpuBackend>))
    }

    #[tokio::test]
    async fn one_unreadable_gpu_is_reported_and_the_others_go_on() {
        let (sim, control) = Simulated::new("n", 3);
        control.update(1, |g| g.error = Some("Unknown Error".into()));
        let mut sampling = GpuSampling::new(
            &settings(Duration::from_secs(5)),
            "simulated",
            simulated_opener(sim),
            NodeIdentity::new("b1"),
        );
        let first = sampling.tick(Instant::now()).await;
        assert!(heartbeat_of(&first, 0) && heartbeat_of(&first, 2), "the other GPUs beat: {first:#?}");
        assert!(!heartbeat_of(&first, 1), "an unreadable GPU is no evidence of health");
        let failed: Vec<_> = first.iter().filter(|e| monitor(e) == Some(("nvml", MonitorState::Error))).collect();
        assert_eq!(failed.len(), 1, "one monitor_health error, for that GPU: {first:#?}");
        assert_eq!(failed[0].entity.gpu_index, Some(1));
        assert!(!failed[0].healthy);
        assert!(first.iter().any(|e| e.kind == Kind::GpuInventory), "the inventory is published");
        let again = sampling.tick(Instant::now()).await;
        assert!(again.iter().all(|e| monitor(e) != Some(("nvml", MonitorState::Error))), "reported once");
        control.update(1, |g| g.error = None);
        let back = sampling.tick(Instant::now()).await;
        assert!(heartbeat_of(&back, 1), "the GPU answering again is healthy evidence at once: {back:#?}");
    }

    #[tokio::test]
    async fn a_backend_that_fails_to_open_twice_is_tried_again_and_reported() {
        let (sim, _control) = Simulated::new("n", 2);
        let attempts = Arc::new(AtomicUsize::new(0));
        let open: BackendOpener = {
            let attempts = attempts.clone();
            Arc::new(move || {
                if attempts.fetch_add(1, Ordering::SeqCst) < 2 {
                    Err(BackendError::Unavailable("driver not loaded yet".into()))
                } else {
                    Ok(Box::new(sim.clone()) as Box<dyn GpuBackend>)
                }
            })
        };
        let mut sampling =
            GpuSampling::new(&settings(Duration::from_secs(5)), "simulated", open, NodeIdentity::new("b1"));
        let t0 = Instant::now();
        let first = sampling.tick(t0).await;
        assert_eq!(first.len(), 1, "{first:#?}");
        assert_eq!(monitor(&first[0]), Some(("simulated", MonitorState::Unavailable)));
        assert!(sampling.tick(t0).await.is_empty(), "not tried again before the backoff");
        assert_eq!(attempts.load(Ordering::SeqCst), 1);
        let second = sampling.tick(t0 + Duration::from_secs(3600)).await;
        assert!(second.is_empty(), "the same failure is reported once: {second:#?}");
        assert_eq!(attempts.load(Ordering::SeqCst), 2, "tried again after the backoff");
        let third = sampling.tick(t0 + Duration::from_secs(7200)).await;
        assert_eq!(attempts.load(Ordering::SeqCst), 3);
        assert!(
            third.iter().any(|e| monitor(e) == Some(("simulated", MonitorState::Ok)) && e.entity.gpu_index.is_none()),
            "the backend opening is reported healthy: {third:#?}"
        );
        assert!(heartbeat_of(&third, 0) && heartbeat_of(&third, 1), "sampling runs once open");
    }

    /// A backend whose samples block while the gate is shut, counting calls.
    #[derive(Clone)]
    struct Gated {
        gate: Arc<(Mutex<bool>, Condvar)>,
        calls: Arc<AtomicUsize>,
        inside: Arc<AtomicUsize>,
        most_inside: Arc<AtomicUsize>,
        sim: Simulated,
    }

    impl GpuBackend for Gated {
        fn name(&self) -> &'static str {
            "simulated"
        }

        fn sample(&mut self) -> Result<Vec<GpuSample>, BackendError> {
            self.calls.fetch_add(1, Ordering::SeqCst);
            let now = self.inside.fetch_add(1, Ordering::SeqCst) + 1;
            self.most_inside.fetch_max(now, Ordering::SeqCst);
            let (lock, cv) = &*self.gate;
            let mut open = lock.lock().unwrap();
            while !*open {
                open = cv.wait(open).unwrap();
            }
            drop(open);
            self.inside.fetch_sub(1, Ordering::SeqCst);
            self.sim.sample()
        }
    }

    #[tokio::test]
    async fn a_hung_call_is_abandoned_without_piling_up_threads_and_the_worker_is_replaced() {
        let (sim, _control) = Simulated::new("n", 2);
        let gated = Gated {
            gate: Arc::new((Mutex::new(false), Condvar::new())),
            calls: Arc::default(),
            inside: Arc::default(),
            most_inside: Arc::default(),
            sim,
        };
        let opened = Arc::new(AtomicUsize::new(0));
        let open: BackendOpener = {
            let (gated, opened) = (gated.clone(), opened.clone());
            Arc::new(move || {
                opened.fetch_add(1, Ordering::SeqCst);
                Ok(Box::new(gated.clone()) as Box<dyn GpuBackend>)
            })
        };
        let mut sampling =
            GpuSampling::new(&settings(Duration::from_secs(1)), "simulated", open, NodeIdentity::new("b1"));
        let hung = sampling.tick(Instant::now()).await;
        assert_eq!(hung.len(), 1, "{hung:#?}");
        assert_eq!(monitor(&hung[0]), Some(("simulated", MonitorState::Hung)));
        for _ in 0..3 {
            assert!(sampling.tick(Instant::now()).await.is_empty(), "still hung: reported once");
        }
        assert_eq!(gated.calls.load(Ordering::SeqCst), 1, "nothing is queued behind the hung call");
        {
            let (lock, cv) = &*gated.gate;
            *lock.lock().unwrap() = true;
            cv.notify_all();
        }
        while gated.inside.load(Ordering::SeqCst) > 0 {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        // The call came back; give the worker a moment to hand over its late answer.
        let mut back = Vec::new();
        for _ in 0..100 {
            back = sampling.tick(Instant::now()).await;
            if !back.is_empty() {
                break;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        assert!(
            back.iter().any(|e| monitor(e) == Some(("simulated", MonitorState::Ok)) && e.entity.gpu_index.is_none()),
            "the monitor answers again: {back:#?}"
        );
        assert!(heartbeat_of(&back, 0));
        assert_eq!(opened.load(Ordering::SeqCst), 2, "the hung worker was replaced by a fresh one");
        assert_eq!(gated.calls.load(Ordering::SeqCst), 2, "the missed samples were not run late");
        assert_eq!(gated.most_inside.load(Ordering::SeqCst), 1, "never more than one call stuck at once");
    }

    #[tokio::test]
    async fn a_kernel_log_read_error_is_reported_and_retried_not_an_exit() {
        let dir = std::env::temp_dir().join(format!("gpumedic-kmsg-{}", uuid::Uuid::new_v4()));
        let log_path = dir.join("kmsg");
        // A directory where the log should be: it opens, and every read fails (EISDIR).
        std::fs::create_dir_all(&log_path).unwrap();
        let (sink, mut tap) = test_support::sink(NodeIdentity::new("b1"));
        let token = CancellationToken::new();
        let log = KernelLog {
            node: "n".into(),
            path: log_path.clone(),
            state_dir: dir.join("state"),
            boot_id: "b1".into(),
            look_back: Duration::from_secs(600),
        };
        let task = tokio::spawn(follow_kernel_log(log, sink, token.clone()));
        let failed = tokio::time::timeout(Duration::from_secs(30), tap.next())
            .await
            .expect("a monitor_health event, not silence")
            .expect("the source goes on instead of exiting");
        assert_eq!(failed.kind, Kind::MonitorHealth);
        assert_eq!(monitor(&failed), Some(("kernel_log", MonitorState::Error)));
        assert_eq!(failed.source, Source::KernelLog);
        assert!(!failed.healthy);
        assert!(!task.is_finished(), "the collector's kernel-log task keeps running");
        // The log becomes readable: the next attempt reads it and says so.
        std::fs::remove_dir(&log_path).unwrap();
        std::fs::write(&log_path, "6,1,1000,-;an old record\n").unwrap();
        let back = tokio::time::timeout(Duration::from_secs(30), tap.next())
            .await
            .expect("the retry reads the log")
            .expect("an event");
        assert_eq!(monitor(&back), Some(("kernel_log", MonitorState::Ok)));
        assert!(back.healthy);
        token.cancel();
        task.await.unwrap().unwrap();
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
