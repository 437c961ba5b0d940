//! The remediator: turns verdicts into changes on the cluster (node conditions, taints, labels,
//! cordon, drain, repair hooks) within strict safety limits, and publishes what it did on
//! `gpumedic.actions.v1`. One replica leads at a time.
//!
//! This crate holds the service frame (configuration, the consumer group on the verdict topic,
//! the Kubernetes client and readiness) and the remediation core:
//! - [`request`]: what is asked ([`request::Remediation`]), independent of the verdict's wire format;
//! - [`plan`]: the pure planner, node as it is + request + mode -> exact changes or "nothing, because";
//! - [`safety`]: the circuit breaker and the quarantine rate limit, pure with the clock passed in;
//! - [`drain`]: which pods leave (pure) and the Eviction API drain (edge);
//! - [`apply`]: the thin Kubernetes edge that carries plans out and records Events.
//!
//! - [`verdicts`]: verdict in, action outcome out.
//!
//! Each verdict is applied (or deliberately not, with the reason), the outcome is published on
//! `gpumedic.actions.v1` and acknowledged, and only then is the verdict's offset stored. Applying
//! the same verdict twice yields one action (`already_done` the second time).

pub mod apply;
pub mod drain;
pub mod plan;
pub mod request;
pub mod safety;
pub mod verdicts;

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use clap::Parser;
use gpumedic_runtime::config::{CommonArgs, CommonConfig, Problems, Validate, parse_duration};
use gpumedic_runtime::kafka::{
    self, HandleError, KafkaArgs, KafkaSettings, Producer, Record, RecordHandler, record_headers,
};
use gpumedic_runtime::service::Service;
use gpumedic_runtime::shutdown::ShutdownError;
use gpumedic_schemas::{ActionOutcome, Record as _, Verdict, topics};

use crate::apply::{ApplyError, Remediator, Settings};
use crate::drain::{DrainMode, DrainPolicy};
use crate::plan::{Mode, Policy};
use crate::safety::{BreakerLimits, Gate};

/// The service's name, as used in metric names and logs.
pub const NAME: &str = "remediator";

/// Command-line flags and environment variables.
#[derive(Debug, Parser)]
#[command(name = "gpumedic-remediator", version, about = "Applies verdicts to Kubernetes nodes, safely.")]
pub struct Args {
    #[command(flatten)]
    common: CommonArgs,
    #[command(flatten)]
    kafka: KafkaArgs,
    /// Kafka consumer group shared by all remediator replicas.
    #[arg(long, env = "GPUMEDIC_GROUP", default_value = "gpumedic-remediator")]
    group: String,
    /// How far the remediator may go: `monitor-only` (decide and report, change nothing),
    /// `cordon-drain`, or `full-remediation` (adds repair hooks).
    #[arg(long, env = "GPUMEDIC_MODE", default_value = "monitor-only")]
    mode: String,
    /// Label selector of the GPU nodes the breaker's share is measured against.
    #[arg(long, env = "GPUMEDIC_GPU_NODE_SELECTOR", default_value = "nvidia.com/gpu.present=true")]
    gpu_node_selector: String,
    /// Circuit breaker: the largest share of GPU nodes quarantined within the window (0..1).
    #[arg(long, env = "GPUMEDIC_BREAKER_MAX_SHARE", default_value_t = 0.1)]
    breaker_max_share: f64,
    /// Circuit breaker: the largest number of GPU nodes quarantined within the window.
    #[arg(long, env = "GPUMEDIC_BREAKER_MAX_COUNT", default_value_t = 50)]
    breaker_max_count: usize,
    /// Circuit breaker window.
    #[arg(long, env = "GPUMEDIC_BREAKER_WINDOW", default_value = "1h")]
    breaker_window: String,
    /// New quarantines allowed per minute.
    #[arg(long, env = "GPUMEDIC_QUARANTINES_PER_MINUTE", default_value_t = 20)]
    quarantines_per_minute: usize,
    /// How long a drain may take before it is reported incomplete.
    #[arg(long, env = "GPUMEDIC_DRAIN_DEADLINE", default_value = "5m")]
    drain_deadline: String,
    /// Grace period for evicted pods, overriding the pods' own (unset: theirs).
    #[arg(long, env = "GPUMEDIC_DRAIN_GRACE_SECONDS")]
    drain_grace_seconds: Option<i64>,
    /// Evict only the pods on the faulty GPU when the verdict names one.
    #[arg(long, env = "GPUMEDIC_PARTIAL_DRAIN")]
    partial_drain: bool,
    /// Verdicts issued longer ago than this are reported and not acted on (recoveries still
    /// are): a new consumer group, or one that was down for hours, must not quarantine nodes for
    /// faults that were judged long ago.
    #[arg(long, env = "GPUMEDIC_MAX_VERDICT_AGE", default_value = "15m")]
    max_verdict_age: String,
}

/// The validated configuration.
#[derive(Debug, Clone)]
pub struct Config {
    /// Shared service settings.
    pub common: CommonConfig,
    /// Kafka settings.
    pub kafka: KafkaSettings,
    /// The consumer group.
    pub group: String,
    /// The edge's settings.
    pub settings: Settings,
    /// Breaker limits.
    pub breaker: BreakerLimits,
    /// New quarantines per minute.
    pub quarantines_per_minute: usize,
    /// GPU node selector.
    pub gpu_node_selector: String,
    /// The oldest verdict acted on.
    pub max_verdict_age: Duration,
}

impl Validate for Args {
    type Valid = Config;

    fn validate(self) -> Result<Config, Problems> {
        let mut p = Problems::default();
        let common = self.common.validate().map_err(|e| p.extend(e)).ok();
        let kafka = self.kafka.validate().map_err(|e| p.extend(e)).ok();
        if self.group.trim().is_empty() {
            p.push("--group", "the consumer group must not be empty");
        }
        let mode = p.check(
            "--mode",
            match self.mode.as_str() {
                "monitor-only" => Ok(Mode::MonitorOnly),
                "cordon-drain" => Ok(Mode::CordonDrain),
                "full-remediation" => Ok(Mode::FullRemediation),
                other => Err(format!("'{other}' is not a mode; use monitor-only, cordon-drain or full-remediation")),
            },
        );
        if !(0.0..=1.0).contains(&self.breaker_max_share) {
            p.push("--breaker-max-share", "must be between 0 and 1");
        }
        let window = p.check("--breaker-window", parse_duration(&self.breaker_window));
        let deadline = p.check("--drain-deadline", parse_duration(&self.drain_deadline));
        let max_verdict_age = p.check("--max-verdict-age", parse_duration(&self.max_verdict_age));
        if self.drain_grace_seconds.is_some_and(|g| g < 0) {
            p.push("--drain-grace-seconds", "must not be negative");
        }
        p.finish(|| Config {
            common: common.expect("checked"),
            kafka: kafka.expect("checked"),
            group: self.group,
            settings: Settings {
                policy: Policy { mode: mode.expect("checked"), partial_drain: self.partial_drain, ..Policy::default() },
                drain: DrainPolicy {
                    mode: DrainMode::Immediate { grace_seconds: self.drain_grace_seconds },
                    deadline: deadline.expect("checked"),
                    ..DrainPolicy::default()
                },
                ..Settings::default()
            },
            breaker: BreakerLimits {
                max_share: self.breaker_max_share,
                max_count: self.breaker_max_count,
                window: window.expect("checked"),
            },
            quarantines_per_minute: self.quarantines_per_minute,
            gpu_node_selector: self.gpu_node_selector,
            max_verdict_age: max_verdict_age.expect("checked"),
        })
    }
}

/// Runs the remediator until SIGTERM/SIGINT or a failure.
pub async fn run(config: Config) -> Result<(), ShutdownError> {
    let mut service = Service::start(NAME, &config.common);
    let kube_ready = service.readiness.register("gpu-nodes-counted");
    let token = service.shutdown.token();
    let setup = async {
        let kube_config = kube::Config::infer().await.map_err(|e| Box::new(e) as gpumedic_runtime::BoxError)?;
        let remediator = Remediator::new(
            kube_config,
            config.settings.clone(),
            Gate::new(config.breaker, config.quarantines_per_minute),
        )?;
        let producer = config.kafka.producer(NAME)?;
        Ok::<_, gpumedic_runtime::BoxError>((remediator, producer))
    };
    let (remediator, producer) = match setup.await {
        Ok(v) => v,
        Err(e) => return Err(ShutdownError::TaskFailed { task: "setup".into(), source: e }),
    };
    tracing::info!(mode = ?config.settings.policy.mode, "Remediator ready.");
    let fleet = Fleet {
        client: remediator.client(),
        selector: config.gpu_node_selector.clone(),
        names: Arc::new(std::sync::RwLock::new(std::collections::HashSet::new())),
        count: Arc::new(AtomicUsize::new(0)),
    };
    service.shutdown.spawn("gpu-node-count", count_gpu_nodes(fleet.clone(), kube_ready, token));
    service.spawn_consumer(
        config.kafka,
        config.group,
        vec![topics::VERDICTS],
        vec![topics::ACTIONS],
        topics::DEFAULT_PARTITIONS,
        Handler { remediator, producer, fleet, max_verdict_age: config.max_verdict_age },
    );
    service.run().await
}

/// The GPU nodes gpumedic manages (those matching `--gpu-node-selector`): it acts on no other
/// node, and the breaker's share is measured against their number.
#[derive(Clone)]
pub struct Fleet {
    client: kube::Client,
    selector: String,
    names: Arc<std::sync::RwLock<std::collections::HashSet<String>>>,
    count: Arc<AtomicUsize>,
}

impl Fleet {
    async fn refresh(&self) -> Result<usize, kube::Error> {
        let names = apply::managed_nodes(&self.client, &self.selector).await?;
        let n = names.len();
        *self.names.write().expect("fleet lock") = names;
        self.count.store(n, Ordering::Release);
        metrics::gauge!("gpumedic_remediator_gpu_nodes").set(n as f64);
        Ok(n)
    }

    /// Whether `node` is managed; a node not seen yet triggers one fresh listing, so a node that
    /// joined since the last refresh is not refused.
    async fn manages(&self, node: &str) -> Result<bool, kube::Error> {
        if self.names.read().expect("fleet lock").contains(node) {
            return Ok(true);
        }
        self.refresh().await?;
        Ok(self.names.read().expect("fleet lock").contains(node))
    }
}

/// Keeps the fleet (the breaker's denominator) current; ready once listed.
async fn count_gpu_nodes(
    fleet: Fleet,
    ready: gpumedic_runtime::admin::ReadyFlag,
    token: tokio_util::sync::CancellationToken,
) -> Result<(), kube::Error> {
    loop {
        match fleet.refresh().await {
            Ok(_) => ready.set(true),
            Err(e) => {
                ready.set(false);
                tracing::warn!(error = %e, "Cannot count GPU nodes; the breaker keeps the last count.");
            }
        }
        tokio::select! {
            () = token.cancelled() => return Ok(()),
            () = tokio::time::sleep(Duration::from_secs(30)) => {}
        }
    }
}

/// The consumer's handler: apply the verdict, publish the outcome, then let the offset be stored.
pub struct Handler {
    remediator: Remediator,
    producer: Producer,
    fleet: Fleet,
    max_verdict_age: Duration,
}

impl RecordHandler for Handler {
    async fn handle(&mut self, record: &Record) -> Result<(), HandleError> {
        let payload = record.payload.as_deref().ok_or_else(|| HandleError::Invalid("empty record".into()))?;
        let verdict: Verdict =
            gpumedic_schemas::decode(payload).map_err(|e| HandleError::Invalid(format!("{}: {e}", e.reason())))?;
        let request = verdicts::remediation(&verdict);
        let managed = self.fleet.manages(&verdict.node).await.map_err(|e| HandleError::Retry(Box::new(e)))?;
        let result = if let Some(age) = verdicts::stale(&verdict, chrono::Utc::now(), self.max_verdict_age) {
            Ok(apply::Outcome::Skipped { reason: plan::Skip::Stale(age), would: None })
        } else if !managed {
            Ok(apply::Outcome::Skipped { reason: plan::Skip::Unmanaged, would: None })
        } else {
            match self.remediator.remediate(&request, self.fleet.count.load(Ordering::Acquire)).await {
                Ok(outcome) => Ok(outcome),
                // A node that no longer exists will not come back for this verdict: record and move on.
                Err(e @ ApplyError::NodeNotFound { .. }) => Err(e.to_string()),
                Err(e) => return Err(HandleError::Retry(Box::new(e))),
            }
        };
        let outcome: ActionOutcome = verdicts::outcome(&verdict, &result);
        tracing::info!(node = %verdict.node, verdict_id = %verdict.verdict_id, status = ?outcome.status,
            detail = %outcome.detail, "Verdict handled.");
        // The label is the status as the action record spells it (blocked_by_breaker, dry_run, ...).
        let status =
            serde_json::to_value(outcome.status).ok().and_then(|v| v.as_str().map(str::to_owned)).unwrap_or_default();
        metrics::counter!("gpumedic_remediator_outcomes_total", "status" => status).increment(1);
        let bytes = gpumedic_schemas::encode(&outcome).map_err(|e| HandleError::Invalid(e.to_string()))?;
        let id = verdict.verdict_id.to_string();
        let envelope = kafka::Envelope {
            topic: topics::ACTIONS,
            key: &verdict.node,
            id: &id,
            content_type: ActionOutcome::CONTENT_TYPE,
            incoming_trace: record.header(record_headers::TRACEPARENT),
        };
        kafka::publish_record(&self.producer, envelope, &bytes).await.map_err(|e| HandleError::Retry(Box::new(e)))
    }
}
