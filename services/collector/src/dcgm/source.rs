//! The DCGM source of the collector, where DCGM is deployed: a scrape of dcgm-exporter's
//! `/metrics` on an interval, and `dcgmi diag` on a schedule.
//!
//! - The scrape is on only when `--dcgm-exporter-url` is set. Its readings go through the same
//!   change logic as NVML samples ([`Sampler`], source `dcgm`), so temperature bands, ECC growth
//!   and row-remap flags are reported on change and threshold crossing only. A change of the
//!   last Xid (`DCGM_FI_DEV_XID_ERRORS`) is an Xid event. Per-GPU heartbeats are *not*
//!   published from DCGM: NVML owns them, and a stale exporter page must never read as healthy
//!   evidence for a GPU that is gone.
//! - The diagnostic runs only when `--dcgm-diag-interval` is set, first one interval after the
//!   start (a crash-looping collector does not run diagnostics in a loop). A failed test is an
//!   unhealthy `dcgm` event (`check` = `diag:<test>`) per GPU; a run without failures is one
//!   healthy `diag` event per GPU (and one for the node-wide tests), the evidence a
//!   diagnostic incident recovers on.
//! - The exporter not answering, a diagnostic that cannot run or hangs past
//!   `--dcgm-diag-timeout` are `monitor_health` events (`dcgm-exporter`, `dcgm-diag`), and the
//!   first success after one says so.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use chrono::{DateTime, Utc};
use gpumedic_runtime::config::{Problems, Validate, parse_duration};
use gpumedic_runtime::kafka::KafkaError;
use gpumedic_schemas::HealthEvent;
use gpumedic_schemas::health::{Component, DcgmDetail, DcgmResult, Detail, Entity, MonitorState, Source, XidDetail};
use tokio_util::sync::CancellationToken;

use super::diag::{DiagError, DiagReport, DiagStatus, parse_diag};
use super::exporter::{DcgmGpuReading, ExporterScrape, parse_metrics};
use crate::events::{DiagFinished, InternalEvent as _, names};
use crate::gpu::GpuSample;
use crate::publisher::Sink;
use crate::sampler::Sampler;

/// The DCGM flags.
#[derive(Debug, Clone, clap::Args)]
pub struct DcgmArgs {
    /// dcgm-exporter's metrics URL (for example `http://localhost:9400/metrics`); empty: no scrape.
    #[arg(long, env = "GPUMEDIC_DCGM_EXPORTER_URL", default_value = "")]
    pub dcgm_exporter_url: String,
    /// How often dcgm-exporter is scraped.
    #[arg(long, env = "GPUMEDIC_DCGM_SCRAPE_INTERVAL", default_value = "30s")]
    pub dcgm_scrape_interval: String,
    /// How often the DCGM diagnostic runs (`off` to never run it).
    #[arg(long, env = "GPUMEDIC_DCGM_DIAG_INTERVAL", default_value = "off")]
    pub dcgm_diag_interval: String,
    /// The diagnostic command, split on spaces (no shell quoting); its output must be JSON.
    #[arg(long, env = "GPUMEDIC_DCGM_DIAG_COMMAND", default_value = "dcgmi diag -r 1 -j")]
    pub dcgm_diag_command: String,
    /// A diagnostic running longer than this is killed and reported as hung.
    #[arg(long, env = "GPUMEDIC_DCGM_DIAG_TIMEOUT", default_value = "10m")]
    pub dcgm_diag_timeout: String,
    /// How often DCGM's health watches are read (`off` to never read them).
    #[arg(long, env = "GPUMEDIC_DCGM_HEALTH_INTERVAL", default_value = "off")]
    pub dcgm_health_interval: String,
    /// The command that sets the health watches, run before the first check and again after a
    /// failed one, split on spaces.
    #[arg(long, env = "GPUMEDIC_DCGM_HEALTH_SET_COMMAND", default_value = "dcgmi health -s a")]
    pub dcgm_health_set_command: String,
    /// The command that reads the health watches, split on spaces; its output must be JSON.
    #[arg(long, env = "GPUMEDIC_DCGM_HEALTH_COMMAND", default_value = "dcgmi health -c -j")]
    pub dcgm_health_command: String,
    /// A health command running longer than this is killed and reported as hung.
    #[arg(long, env = "GPUMEDIC_DCGM_HEALTH_TIMEOUT", default_value = "30s")]
    pub dcgm_health_timeout: String,
}

/// The validated DCGM settings.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct DcgmSettings {
    /// The exporter scrape, when on.
    pub exporter: Option<ExporterSettings>,
    /// The diagnostic schedule, when on.
    pub diag: Option<DiagSettings>,
    /// The health-watch schedule, when on.
    pub health: Option<HealthSettings>,
}

/// How the health watches are set and read.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HealthSettings {
    /// Time between checks.
    pub interval: Duration,
    /// Sets the watches (program and arguments).
    pub set_command: Vec<String>,
    /// Reads them.
    pub check_command: Vec<String>,
    /// Longest run of either.
    pub timeout: Duration,
}

/// How dcgm-exporter is scraped.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExporterSettings {
    /// The metrics URL.
    pub url: String,
    /// Time between scrapes.
    pub interval: Duration,
}

/// How the diagnostic runs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DiagSettings {
    /// Time between runs.
    pub interval: Duration,
    /// Program and arguments.
    pub command: Vec<String>,
    /// Longest run.
    pub timeout: Duration,
}

impl Validate for DcgmArgs {
    type Valid = DcgmSettings;

    fn validate(self) -> Result<DcgmSettings, Problems> {
        let mut p = Problems::default();
        let url = self.dcgm_exporter_url.trim().to_owned();
        if !url.is_empty() && reqwest::Url::parse(&url).map_or(true, |u| !matches!(u.scheme(), "http" | "https")) {
            p.push("--dcgm-exporter-url", format!("'{url}' is not an http(s) URL"));
        }
        let scrape = p.check("--dcgm-scrape-interval", parse_duration(&self.dcgm_scrape_interval).and_then(nonzero));
        let diag_interval = match self.dcgm_diag_interval.trim() {
            "off" | "" => None,
            raw => p.check("--dcgm-diag-interval", parse_duration(raw).and_then(nonzero)),
        };
        let command: Vec<String> = self.dcgm_diag_command.split_whitespace().map(str::to_owned).collect();
        if command.is_empty() {
            p.push("--dcgm-diag-command", "the command is empty");
        }
        let timeout = p.check("--dcgm-diag-timeout", parse_duration(&self.dcgm_diag_timeout).and_then(nonzero));
        let health_interval = match self.dcgm_health_interval.trim() {
            "off" | "" => None,
            raw => p.check("--dcgm-health-interval", parse_duration(raw).and_then(nonzero)),
        };
        let words = |s: &str| -> Vec<String> { s.split_whitespace().map(str::to_owned).collect() };
        let (set_command, check_command) = (words(&self.dcgm_health_set_command), words(&self.dcgm_health_command));
        if check_command.is_empty() {
            p.push("--dcgm-health-command", "the command is empty");
        }
        let health_timeout =
            p.check("--dcgm-health-timeout", parse_duration(&self.dcgm_health_timeout).and_then(nonzero));
        p.finish(|| DcgmSettings {
            exporter: (!url.is_empty()).then(|| ExporterSettings { url, interval: scrape.expect("checked") }),
            diag: diag_interval.map(|interval| DiagSettings { interval, command, timeout: timeout.expect("checked") }),
            health: health_interval.map(|interval| HealthSettings {
                interval,
                set_command,
                check_command,
                timeout: health_timeout.expect("checked"),
            }),
        })
    }
}

fn nonzero(d: Duration) -> Result<Duration, String> {
    if d.is_zero() { Err("must be longer than zero".into()) } else { Ok(d) }
}

/// What DCGM knows of each GPU by its DCGM index, from the latest scrape: the diagnostic names
/// GPUs only by index, and the classifier tells GPUs apart by UUID.
#[derive(Debug, Clone, Default)]
pub struct GpuDirectory(Arc<Mutex<HashMap<u32, Identity>>>);

/// A GPU's UUID and PCI address, as far as known.
type Identity = (Option<String>, Option<String>);

impl GpuDirectory {
    /// Remembers the identity of each GPU in `scrape`.
    pub fn learn(&self, scrape: &ExporterScrape) {
        let mut map = self.0.lock().expect("directory lock");
        for r in &scrape.readings {
            if let Some(index) = r.index {
                map.insert(index, (r.uuid.clone(), r.pci_bus_id.clone()));
            }
        }
    }

    /// The DCGM index of every GPU seen, sorted.
    pub fn indexes(&self) -> Vec<u32> {
        let mut all: Vec<u32> = self.0.lock().expect("directory lock").keys().copied().collect();
        all.sort_unstable();
        all
    }

    /// The entity of GPU `index`, with its UUID and PCI address when known.
    pub fn entity(&self, index: u32) -> Entity {
        let map = self.0.lock().expect("directory lock");
        let (uuid, pci) = map.get(&index).cloned().unwrap_or_default();
        Entity { gpu_uuid: uuid, pci_bus_id: pci, gpu_index: i32::try_from(index).ok(), ..Default::default() }
    }
}

/// Turns successive exporter scrapes into events: the [`Sampler`]'s change logic, plus Xids.
#[derive(Debug)]
pub struct ExporterWatch {
    node: String,
    sampler: Sampler,
    last_xid: HashMap<(u32, Option<String>), i64>,
}

impl ExporterWatch {
    /// A watch for `node`.
    pub fn new(node: impl Into<String>) -> Self {
        let node = node.into();
        // Heartbeats are filtered out (see the module docs), so their interval does not matter.
        Self {
            sampler: Sampler::new(node.clone(), Source::Dcgm, Duration::from_secs(3600)),
            node,
            last_xid: HashMap::new(),
        }
    }

    /// The events that `scrape`, taken at `now`, calls for.
    pub fn observe(&mut self, scrape: &ExporterScrape, now: DateTime<Utc>) -> Vec<HealthEvent> {
        let samples = gpu_samples(&scrape.readings);
        let mut events: Vec<HealthEvent> = self
            .sampler
            .observe(&samples, now)
            .into_iter()
            .filter(|e| !matches!(e.detail, Detail::MonitorHealth(_)))
            .collect();
        for r in &scrape.readings {
            let (Some(index), Some(xid)) = (r.index, r.xid) else { continue };
            let key = (index, r.mig_instance.clone());
            let before = self.last_xid.insert(key, xid);
            // The gauge holds the *last* Xid since the exporter started: at first sight it may be
            // old news (the kernel log reported it), so only a change is an event.
            if xid == 0 || before.is_none_or(|b| b == xid) {
                continue;
            }
            let entity = Entity {
                gpu_uuid: r.uuid.clone(),
                pci_bus_id: r.pci_bus_id.clone(),
                gpu_index: i32::try_from(index).ok(),
                mig_instance: r.mig_instance.clone(),
                ..Default::default()
            };
            let mut e = HealthEvent::new(
                &self.node,
                Source::Dcgm,
                Component::Gpu,
                entity,
                Detail::Xid(XidDetail {
                    code: i32::try_from(xid).unwrap_or(i32::MAX),
                    text: "reported by dcgm-exporter (DCGM_FI_DEV_XID_ERRORS); DCGM gives no message text".into(),
                    pid: None,
                    process: None,
                    nvlink5: None,
                    recovery_action: None,
                }),
            );
            e.observed_at = now;
            events.push(e);
        }
        events
    }
}

/// One sample per GPU from the readings: the GPU-wide reading, or the first MIG instance's when
/// the exporter reports only instances (the health fields are the GPU's either way).
fn gpu_samples(readings: &[DcgmGpuReading]) -> Vec<GpuSample> {
    let mut by_index: BTreeMap<u32, &DcgmGpuReading> = BTreeMap::new();
    for r in readings {
        let Some(index) = r.index else { continue };
        match by_index.get(&index) {
            Some(existing) if existing.mig_instance.is_none() || r.mig_instance.is_some() => {}
            _ => {
                by_index.insert(index, r);
            }
        }
    }
    let to_i32 = |v: Option<i64>| v.and_then(|v| i32::try_from(v).ok());
    by_index
        .into_iter()
        .map(|(index, r)| GpuSample {
            index,
            uuid: r.uuid.clone().unwrap_or_default(),
            pci_bus_id: r.pci_bus_id.clone().unwrap_or_default(),
            lost: false,
            temperature_c: to_i32(r.temperature_c),
            slowdown_c: to_i32(r.slowdown_c),
            shutdown_c: to_i32(r.shutdown_c),
            // Power without the enforced limit cannot cross it; the exporter has no limit field.
            power_w: None,
            power_limit_w: None,
            ecc_sbe_volatile: r.ecc_sbe_volatile,
            ecc_dbe_volatile: r.ecc_dbe_volatile,
            ecc_sbe_aggregate: r.ecc_sbe_aggregate,
            ecc_dbe_aggregate: r.ecc_dbe_aggregate,
            remapped_rows_correctable: r.remapped_rows_correctable,
            remapped_rows_uncorrectable: r.remapped_rows_uncorrectable,
            remap_pending: r.row_remap_pending,
            remap_failure: r.row_remap_failure,
            ..Default::default()
        })
        .collect()
}

/// A `monitor_health` event about a DCGM component.
fn monitor_event(node: &str, monitor: &str, state: MonitorState, message: String) -> HealthEvent {
    crate::sources::monitor_event(node, Source::Dcgm, monitor, state, message)
}

/// Whether a DCGM component answered last time; reports only the changes.
#[derive(Debug, Default)]
struct MonitorStatus {
    failing: bool,
}

impl MonitorStatus {
    fn failed(&mut self, node: &str, monitor: &str, state: MonitorState, message: String) -> Option<HealthEvent> {
        metrics::counter!(names::DCGM_FAILURES_TOTAL, "monitor" => monitor.to_owned()).increment(1);
        if std::mem::replace(&mut self.failing, true) {
            // Said once already; the counter keeps the tally.
            tracing::debug!(monitor, state = ?state, error = %message, "A DCGM source is still not answering.");
            return None;
        }
        tracing::warn!(monitor, state = ?state, error = %message, "A DCGM source is not answering.");
        Some(monitor_event(node, monitor, state, message))
    }

    fn answered(&mut self, node: &str, monitor: &str) -> Option<HealthEvent> {
        std::mem::replace(&mut self.failing, false)
            .then(|| monitor_event(node, monitor, MonitorState::Ok, format!("{monitor} answers again")))
    }
}

/// Scrapes dcgm-exporter every interval until `token` is cancelled.
pub async fn scrape_exporter(
    node: String,
    settings: ExporterSettings,
    directory: GpuDirectory,
    emitter: Sink,
    token: CancellationToken,
) -> Result<(), KafkaError> {
    const MONITOR: &str = "dcgm-exporter";
    let client = http_client();
    let timeout = settings.interval.min(Duration::from_secs(10));
    let mut watch = ExporterWatch::new(node.clone());
    let mut status = MonitorStatus::default();
    tracing::info!(url = %settings.url, interval_ms = settings.interval.as_millis() as u64, "Scraping dcgm-exporter.");
    loop {
        let got = client.get(&settings.url).timeout(timeout).send().await.and_then(reqwest::Response::error_for_status);
        let got = match got {
            Ok(resp) => resp.text().await,
            Err(e) => Err(e),
        };
        let events: Vec<HealthEvent> = match got {
            Ok(text) => {
                let scrape = parse_metrics(&text);
                if !scrape.problems.is_empty() {
                    tracing::debug!(problems = scrape.problems.len(), first = %scrape.problems[0], "dcgm-exporter page has unreadable lines.");
                }
                directory.learn(&scrape);
                status.answered(&node, MONITOR).into_iter().chain(watch.observe(&scrape, Utc::now())).collect()
            }
            Err(e) => {
                let state = if e.is_timeout() {
                    MonitorState::Hung
                } else if e.is_status() {
                    MonitorState::Error
                } else {
                    MonitorState::Unavailable
                };
                status
                    .failed(&node, MONITOR, state, format!("scraping {} failed: {e}", settings.url))
                    .into_iter()
                    .collect()
            }
        };
        if !emit_then_wait(&emitter, &events, &token, settings.interval).await {
            return Ok(());
        }
    }
}

/// An HTTP client for local endpoints: short connect timeout, and no proxy (a cluster-wide
/// `HTTP_PROXY` must never see node-local traffic).
pub(crate) fn http_client() -> reqwest::Client {
    reqwest::Client::builder()
        .no_proxy()
        .connect_timeout(Duration::from_secs(2))
        .build()
        .expect("a plain HTTP client builds")
}

/// What one diagnostic run ended with.
#[derive(Debug)]
pub enum DiagOutcome {
    /// A report was read.
    Report(DiagReport),
    /// The command could not start, failed without a report, or printed something else.
    Failed(String),
    /// It ran past the timeout and was killed.
    TimedOut,
}

/// Runs the diagnostic command once.
pub async fn run_diag_once(settings: &DiagSettings) -> DiagOutcome {
    let program = settings.command.first().map_or("", String::as_str);
    let output = match run_command(&settings.command, settings.timeout).await {
        CommandRun::Output(o) => o,
        CommandRun::Failed(m) => return DiagOutcome::Failed(m),
        CommandRun::TimedOut => return DiagOutcome::TimedOut,
    };
    // dcgmi exits non-zero when a test fails, with the report on stdout: read it regardless.
    match parse_diag(&String::from_utf8_lossy(&output.stdout)) {
        Ok(report) => DiagOutcome::Report(report),
        Err(DiagError::Runtime(msg)) => DiagOutcome::Failed(format!("DCGM could not run the diagnostic: {msg}")),
        Err(e) => {
            let stderr = String::from_utf8_lossy(&output.stderr);
            let stderr: String = stderr.trim().chars().take(300).collect();
            DiagOutcome::Failed(format!("{program} exited with {}: {e}; stderr: {stderr}", output.status))
        }
    }
}

/// The events a diagnostic report calls for: one unhealthy event per failed test and GPU; for a
/// GPU (or the node-wide tests) without failures, one healthy `diag` event.
pub fn diag_events(node: &str, report: &DiagReport, directory: &GpuDirectory, now: DateTime<Utc>) -> Vec<HealthEvent> {
    // GPU index, or None for node-wide tests and entities that are not GPUs.
    let mut units: BTreeSet<Option<u32>> = BTreeSet::new();
    let mut passed: BTreeMap<Option<u32>, usize> = BTreeMap::new();
    let mut warned: BTreeMap<Option<u32>, Vec<String>> = BTreeMap::new();
    let mut failed: BTreeSet<Option<u32>> = BTreeSet::new();
    let mut out = Vec::new();
    let entity = |gpu: Option<u32>| gpu.map_or_else(Entity::default, |i| directory.entity(i));
    let component = |gpu: Option<u32>| if gpu.is_some() { Component::Gpu } else { Component::Node };
    for test in &report.tests {
        for r in &test.results {
            units.insert(r.gpu);
            match r.status {
                DiagStatus::Pass => *passed.entry(r.gpu).or_default() += 1,
                DiagStatus::Warn => warned
                    .entry(r.gpu)
                    .or_default()
                    .extend(r.warnings.iter().map(|w| format!("{}: {}", test.name, w.message))),
                DiagStatus::Fail => {
                    failed.insert(r.gpu);
                    let message = r.warnings.iter().map(|w| w.message.as_str()).collect::<Vec<_>>().join("; ");
                    let mut e = HealthEvent::new(
                        node,
                        Source::Dcgm,
                        component(r.gpu),
                        entity(r.gpu),
                        Detail::Dcgm(DcgmDetail {
                            check: format!("diag:{}", test.name),
                            result: DcgmResult::Fail,
                            error_code: r.warnings.iter().find_map(|w| w.error_id).and_then(|c| i32::try_from(c).ok()),
                            message: (!message.is_empty()).then_some(message),
                        }),
                    );
                    e.observed_at = now;
                    out.push(e);
                }
                DiagStatus::Skip | DiagStatus::NotRun | DiagStatus::Unknown => {}
            }
        }
    }
    for unit in units.into_iter().filter(|u| !failed.contains(u)) {
        let mut message = format!(
            "{} test(s) passed{}",
            passed.get(&unit).copied().unwrap_or(0),
            report.version.as_deref().map(|v| format!(" (DCGM {v})")).unwrap_or_default()
        );
        if let Some(w) = warned.get(&unit).filter(|w| !w.is_empty()) {
            message.push_str(&format!("; warnings: {}", w.join("; ")));
        }
        let mut e = HealthEvent::new(
            node,
            Source::Dcgm,
            component(unit),
            entity(unit),
            Detail::Dcgm(DcgmDetail {
                check: "diag".into(),
                result: DcgmResult::Pass,
                error_code: None,
                message: Some(message),
            }),
        );
        e.observed_at = now;
        e.healthy = true;
        out.push(e);
    }
    out
}

/// How one run of a DCGM command ended: its stdout, or why there is none.
enum CommandRun {
    /// It ran (whatever its exit status); its stdout and stderr.
    Output(std::process::Output),
    /// It could not start.
    Failed(String),
    /// It ran past the timeout and was killed.
    TimedOut,
}

async fn run_command(command: &[String], timeout: Duration) -> CommandRun {
    let Some((program, args)) = command.split_first() else {
        return CommandRun::Failed("the command is empty".into());
    };
    let child = tokio::process::Command::new(program)
        .args(args)
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .kill_on_drop(true)
        .spawn();
    let child = match child {
        Ok(c) => c,
        Err(e) => return CommandRun::Failed(format!("cannot run {program}: {e}")),
    };
    match tokio::time::timeout(timeout, child.wait_with_output()).await {
        Err(_) => CommandRun::TimedOut,
        Ok(Err(e)) => CommandRun::Failed(format!("{program} failed: {e}")),
        Ok(Ok(o)) => CommandRun::Output(o),
    }
}

/// What one health check ended with.
#[derive(Debug)]
pub enum HealthOutcome {
    /// A report was read.
    Report(super::health::HealthReport),
    /// A command could not run, failed, or printed no report.
    Failed(String),
    /// A command ran past the timeout and was killed.
    TimedOut,
}

/// Sets the health watches when `set` (first check, or after a failed one), then reads them.
pub async fn check_health_once(settings: &HealthSettings, set: bool) -> HealthOutcome {
    if set && !settings.set_command.is_empty() {
        match run_command(&settings.set_command, settings.timeout).await {
            CommandRun::Output(o) if o.status.success() => {}
            CommandRun::Output(o) => {
                let out = String::from_utf8_lossy(&o.stdout);
                let out: String = out.trim().chars().take(300).collect();
                return HealthOutcome::Failed(format!("setting the health watches exited with {}: {out}", o.status));
            }
            CommandRun::Failed(m) => return HealthOutcome::Failed(m),
            CommandRun::TimedOut => return HealthOutcome::TimedOut,
        }
    }
    match run_command(&settings.check_command, settings.timeout).await {
        CommandRun::Output(o) => match super::health::parse_health(&String::from_utf8_lossy(&o.stdout)) {
            Ok(report) => HealthOutcome::Report(report),
            Err(e) => HealthOutcome::Failed(format!("the health check exited with {}: {e}", o.status)),
        },
        CommandRun::Failed(m) => HealthOutcome::Failed(m),
        CommandRun::TimedOut => HealthOutcome::TimedOut,
    }
}

/// Sets DCGM's health watches and reads them every interval (the first time at once) until
/// `token` is cancelled: one event per incident that appears or changes, a healthy one when it
/// goes ([`super::health::HealthWatch`]). A command that fails or prints no report is a
/// `monitor_health` `error` (`dcgm-health`), one that hangs past the timeout is killed and
/// reported `hung`; the watches are set again before the next check.
pub async fn watch_health(
    node: String,
    settings: HealthSettings,
    directory: GpuDirectory,
    emitter: Sink,
    token: CancellationToken,
) -> Result<(), KafkaError> {
    const MONITOR: &str = "dcgm-health";
    let mut status = MonitorStatus::default();
    let mut watch = super::health::HealthWatch::new(node.clone());
    let mut set = true;
    tracing::info!(
        command = %settings.check_command.join(" "),
        interval_ms = settings.interval.as_millis() as u64,
        "Reading DCGM's health watches."
    );
    loop {
        let outcome = tokio::select! {
            () = token.cancelled() => return Ok(()),
            o = check_health_once(&settings, set) => o,
        };
        let events: Vec<HealthEvent> = match outcome {
            HealthOutcome::Report(report) => {
                set = false;
                metrics::counter!(names::DCGM_HEALTH_CHECKS_TOTAL, "overall" => report.overall.clone()).increment(1);
                status
                    .answered(&node, MONITOR)
                    .into_iter()
                    .chain(watch.observe(&report, &directory, Utc::now()))
                    .collect()
            }
            HealthOutcome::Failed(message) => {
                set = true;
                status.failed(&node, MONITOR, MonitorState::Error, message).into_iter().collect()
            }
            HealthOutcome::TimedOut => {
                set = true;
                status
                    .failed(
                        &node,
                        MONITOR,
                        MonitorState::Hung,
                        format!("the health command ran past {:?} and was killed", settings.timeout),
                    )
                    .into_iter()
                    .collect()
            }
        };
        if !emit_then_wait(&emitter, &events, &token, settings.interval).await {
            return Ok(());
        }
    }
}

/// Runs the diagnostic every interval (the first one interval after the start) until `token` is
/// cancelled.
pub async fn schedule_diag(
    node: String,
    settings: DiagSettings,
    directory: GpuDirectory,
    emitter: Sink,
    token: CancellationToken,
) -> Result<(), KafkaError> {
    const MONITOR: &str = "dcgm-diag";
    let mut status = MonitorStatus::default();
    tracing::info!(
        command = %settings.command.join(" "),
        interval_ms = settings.interval.as_millis() as u64,
        "Scheduling the DCGM diagnostic."
    );
    loop {
        tokio::select! {
            () = token.cancelled() => return Ok(()),
            () = tokio::time::sleep(settings.interval) => {}
        }
        let outcome = tokio::select! {
            () = token.cancelled() => return Ok(()),
            o = run_diag_once(&settings) => o,
        };
        let events: Vec<HealthEvent> = match outcome {
            DiagOutcome::Report(report) => {
                let failed = report.failed().len();
                DiagFinished { failed, tests: report.tests.len() }.emit();
                status
                    .answered(&node, MONITOR)
                    .into_iter()
                    .chain(diag_events(&node, &report, &directory, Utc::now()))
                    .collect()
            }
            DiagOutcome::Failed(message) => {
                status.failed(&node, MONITOR, MonitorState::Error, message).into_iter().collect()
            }
            DiagOutcome::TimedOut => status
                .failed(
                    &node,
                    MONITOR,
                    MonitorState::Hung,
                    format!("the diagnostic ran past {:?} and was killed", settings.timeout),
                )
                .into_iter()
                .collect(),
        };
        for e in &events {
            if !emitter.emit_until_done(e, &token).await {
                return Ok(());
            }
        }
    }
}

/// Emits `events` in order, then waits `interval`: false once `token` is cancelled (the source
/// stops), true when the next round is due.
async fn emit_then_wait(emitter: &Sink, events: &[HealthEvent], token: &CancellationToken, interval: Duration) -> bool {
    for e in events {
        if !emitter.emit_until_done(e, token).await {
            return false;
        }
    }
    tokio::select! {
        () = token.cancelled() => false,
        () = tokio::time::sleep(interval) => true,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use gpumedic_schemas::Kind;

    const NEW_STYLE: &str = include_str!("../../tests/fixtures/dcgm/exporter-3x.prom");
    const DCGM3_FAIL: &str = include_str!("../../tests/fixtures/dcgm/diag-3x-r2-fail.json");
    const DCGM4_FAIL: &str = include_str!("../../tests/fixtures/dcgm/diag-4x-r2-fail.json");
    const DCGM4_PASS: &str = include_str!("../../tests/fixtures/dcgm/diag-4x-r1-pass.json");

    fn at(s: i64) -> DateTime<Utc> {
        DateTime::from_timestamp(1_800_000_000 + s, 0).unwrap()
    }

    fn args(extra: &[(&str, &str)]) -> DcgmArgs {
        let mut a = DcgmArgs {
            dcgm_exporter_url: String::new(),
            dcgm_scrape_interval: "30s".into(),
            dcgm_diag_interval: "off".into(),
            dcgm_diag_command: "dcgmi diag -r 1 -j".into(),
            dcgm_diag_timeout: "10m".into(),
            dcgm_health_interval: "off".into(),
            dcgm_health_set_command: "dcgmi health -s a".into(),
            dcgm_health_command: "dcgmi health -c -j".into(),
            dcgm_health_timeout: "30s".into(),
        };
        for (k, v) in extra {
            match *k {
                "url" => a.dcgm_exporter_url = (*v).into(),
                "diag" => a.dcgm_diag_interval = (*v).into(),
                "command" => a.dcgm_diag_command = (*v).into(),
                "scrape" => a.dcgm_scrape_interval = (*v).into(),
                "health" => a.dcgm_health_interval = (*v).into(),
                "health-command" => a.dcgm_health_command = (*v).into(),
                _ => unreachable!(),
            }
        }
        a
    }

    #[test]
    fn health_watches_are_off_by_default_and_read_with_dcgmi() {
        let s = args(&[("health", "1m")]).validate().unwrap().health.expect("on");
        assert_eq!(s.interval, Duration::from_secs(60));
        assert_eq!(s.set_command, ["dcgmi", "health", "-s", "a"]);
        assert_eq!(s.check_command, ["dcgmi", "health", "-c", "-j"]);
        let err = args(&[("health", "0s"), ("health-command", " ")]).validate().unwrap_err();
        let fields: Vec<&str> = err.list().iter().map(|p| p.field.as_str()).collect();
        assert!(fields.contains(&"--dcgm-health-interval") && fields.contains(&"--dcgm-health-command"), "{fields:?}");
    }

    fn health_settings(check: &[&str], timeout: Duration) -> HealthSettings {
        HealthSettings {
            interval: Duration::from_secs(60),
            set_command: vec!["true".into()],
            check_command: check.iter().map(|s| (*s).to_owned()).collect(),
            timeout,
        }
    }

    #[tokio::test]
    async fn a_health_check_reads_the_report_and_a_failing_or_hung_dcgmi_is_an_outcome_of_its_own() {
        let fixture = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/dcgm/health-check-warn.json");
        let ok = check_health_once(&health_settings(&["cat", fixture], Duration::from_secs(10)), true).await;
        assert!(matches!(&ok, HealthOutcome::Report(r) if r.incidents.len() == 3), "{ok:?}");
        // dcgmi prints its errors as text, on stdout.
        let not_set = health_settings(&["echo", "Error: Health watches not enabled."], Duration::from_secs(10));
        assert!(
            matches!(check_health_once(&not_set, false).await, HealthOutcome::Failed(m) if m.contains("not a JSON"))
        );
        let missing = health_settings(&["/nonexistent/dcgmi"], Duration::from_secs(10));
        assert!(
            matches!(check_health_once(&missing, false).await, HealthOutcome::Failed(m) if m.contains("cannot run"))
        );
        let hung = health_settings(&["sleep", "30"], Duration::from_millis(200));
        assert!(matches!(check_health_once(&hung, false).await, HealthOutcome::TimedOut));
        let mut unset = health_settings(&["cat", fixture], Duration::from_secs(10));
        unset.set_command = vec!["false".into()];
        assert!(
            matches!(check_health_once(&unset, true).await, HealthOutcome::Failed(m) if m.contains("setting the health watches")),
            "a failure to set the watches is reported"
        );
    }

    #[test]
    fn off_by_default_and_every_problem_listed() {
        assert_eq!(args(&[]).validate().unwrap(), DcgmSettings::default());
        let on = args(&[("url", "http://localhost:9400/metrics"), ("diag", "6h")]).validate().unwrap();
        assert_eq!(on.exporter.unwrap().interval, Duration::from_secs(30));
        assert_eq!(on.diag.unwrap().command, ["dcgmi", "diag", "-r", "1", "-j"]);
        let bad = args(&[("url", "localhost:9400"), ("diag", "sometimes"), ("command", "  "), ("scrape", "0s")])
            .validate()
            .unwrap_err();
        let fields: Vec<&str> = bad.list().iter().map(|p| p.field.as_str()).collect();
        assert_eq!(
            fields,
            ["--dcgm-exporter-url", "--dcgm-scrape-interval", "--dcgm-diag-interval", "--dcgm-diag-command"]
        );
    }

    #[test]
    fn exporter_changes_become_events_and_first_sight_is_quiet() {
        let mut watch = ExporterWatch::new("n");
        let healthy = set_value(NEW_STYLE, "DCGM_FI_DEV_XID_ERRORS{gpu=\"1\"", "0");
        let first = watch.observe(&parse_metrics(&healthy), at(0));
        // GPU 1 comes up with a failed row remap: reported at once; no heartbeats, no old Xid.
        let kinds: Vec<Kind> = first.iter().map(|e| e.kind).collect();
        assert_eq!(kinds, [Kind::RowRemap], "{first:?}");
        assert!(first.iter().all(|e| e.source == Source::Dcgm));
        assert!(watch.observe(&parse_metrics(&healthy), at(30)).is_empty(), "nothing changed");
        let later = watch.observe(&parse_metrics(NEW_STYLE), at(60));
        assert_eq!(later.len(), 1, "{later:?}");
        let Detail::Xid(x) = &later[0].detail else { panic!("{later:?}") };
        assert_eq!(x.code, 79);
        assert_eq!(later[0].entity.gpu_index, Some(1));
        assert!(later[0].entity.gpu_uuid.is_some());
        let grown = set_value(NEW_STYLE, "DCGM_FI_DEV_ECC_DBE_VOL_TOTAL{gpu=\"1\"", "2");
        let ecc = watch.observe(&parse_metrics(&grown), at(90));
        assert_eq!(ecc.iter().map(|e| e.kind).collect::<Vec<_>>(), [Kind::Ecc]);
        assert!(matches!(&ecc[0].detail, Detail::Ecc(d) if d.double_bit_volatile == Some(2)));
    }

    /// `page` with the value of the line starting with `prefix` replaced.
    fn set_value(page: &str, prefix: &str, value: &str) -> String {
        page.lines()
            .map(|l| match l.rsplit_once(' ') {
                Some((head, _)) if l.starts_with(prefix) => format!("{head} {value}\n"),
                _ => format!("{l}\n"),
            })
            .collect()
    }

    #[test]
    fn temperature_thresholds_from_the_exporter_are_judged() {
        let page = |t: i64| {
            format!(
                "DCGM_FI_DEV_GPU_TEMP{{gpu=\"0\",UUID=\"GPU-a\"}} {t}\nDCGM_FI_DEV_SLOWDOWN_TEMP{{gpu=\"0\",UUID=\"GPU-a\"}} 87\n\
                 DCGM_FI_DEV_SHUTDOWN_TEMP{{gpu=\"0\",UUID=\"GPU-a\"}} 92\n"
            )
        };
        let mut watch = ExporterWatch::new("n");
        assert!(watch.observe(&parse_metrics(&page(40)), at(0)).is_empty());
        let hot = watch.observe(&parse_metrics(&page(93)), at(1));
        assert!(matches!(&hot[0].detail, Detail::Temperature(t) if t.celsius == 93 && t.shutdown_celsius == Some(92)));
        assert!(!hot[0].healthy);
        assert!(watch.observe(&parse_metrics(&page(50)), at(2))[0].healthy);
    }

    #[test]
    fn failed_diagnostics_are_unhealthy_per_gpu_and_passes_are_evidence() {
        let directory = GpuDirectory::default();
        directory.learn(&parse_metrics(NEW_STYLE));
        let events = diag_events("n", &parse_diag(DCGM3_FAIL).unwrap(), &directory, at(0));
        let failed: Vec<_> = events.iter().filter(|e| !e.healthy).collect();
        assert_eq!(failed.len(), 1);
        let Detail::Dcgm(d) = &failed[0].detail else { panic!() };
        assert_eq!((d.check.as_str(), d.result, d.error_code), ("diag:GPU Memory", DcgmResult::Fail, Some(4)));
        assert_eq!(failed[0].entity.gpu_index, Some(1));
        assert!(failed[0].entity.gpu_uuid.is_some(), "the UUID comes from the exporter's scrape");
        // GPU 0 and the node-wide tests passed (the persistence-mode warning is kept as text).
        let passed: Vec<_> = events.iter().filter(|e| e.healthy).collect();
        assert_eq!(passed.len(), 2, "{passed:?}");
        assert!(
            passed
                .iter()
                .all(|e| matches!(&e.detail, Detail::Dcgm(d) if d.check == "diag" && d.result == DcgmResult::Pass))
        );
        let node_wide = passed.iter().find(|e| e.entity.gpu_index.is_none()).expect("node-wide pass");
        assert!(
            matches!(&node_wide.detail, Detail::Dcgm(d) if d.message.as_deref().is_some_and(|m| m.contains("warnings")))
        );

        let v4 = diag_events("n", &parse_diag(DCGM4_FAIL).unwrap(), &GpuDirectory::default(), at(0));
        let failed: Vec<_> = v4.iter().filter(|e| !e.healthy).collect();
        assert_eq!(failed.len(), 1);
        assert_eq!(failed[0].entity.gpu_index, Some(3));
        assert_eq!(failed[0].entity.gpu_uuid, None, "no scrape, no UUID");
        assert!(
            diag_events("n", &parse_diag(DCGM4_PASS).unwrap(), &GpuDirectory::default(), at(0))
                .iter()
                .all(|e| e.healthy)
        );
    }
}
