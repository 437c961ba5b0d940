//! The collector: one per GPU node (a DaemonSet). It turns what the node knows about its GPUs into
//! raw health events on `gpumedic.health.raw.v1`, keyed by node name.
//!
//! This crate holds the service frame: configuration, the Kafka producer and its readiness. The
//! health sources (NVML, kernel log, DCGM, cloud maintenance, gRPC ingest) plug in behind it;
//! docs/collector.md lists them with their flags.

pub mod cloud;
pub mod dcgm;
pub mod gpu;
pub mod kernel_log;
pub mod nvml_xid;
pub mod sampler;
pub mod sources;

use std::path::PathBuf;
use std::time::Duration;

use clap::Parser;
use gpumedic_runtime::config::{CommonArgs, CommonConfig, Problems, Validate, parse_duration};
use gpumedic_runtime::kafka::{self, KafkaArgs, KafkaSettings, TopicSpec};
use gpumedic_runtime::service::Service;
use gpumedic_runtime::shutdown::ShutdownError;
use gpumedic_schemas::health::Source;
use gpumedic_schemas::{HealthEvent, topics};

use crate::gpu::{GpuBackend, NvmlBackend, Simulated};
use crate::sources::Emitter;
use rdkafka::producer::Producer as _;

/// The service's name, as used in metric names and logs.
pub const NAME: &str = "collector";

/// Command-line flags and environment variables.
#[derive(Debug, Parser)]
#[command(name = "gpumedic-collector", version, about = "Publishes the GPU health events of one node to Kafka.")]
pub struct Args {
    #[command(flatten)]
    common: CommonArgs,
    #[command(flatten)]
    kafka: KafkaArgs,
    /// The Kubernetes node this collector runs on (from the downward API: spec.nodeName).
    #[arg(long, env = "GPUMEDIC_NODE_NAME")]
    node_name: String,
    /// Where GPU readings come from: `nvml` (the driver), `simulated` (no GPU needed), or `off`.
    #[arg(long, env = "GPUMEDIC_GPU_BACKEND", default_value = "nvml")]
    gpu_backend: String,
    /// GPUs of the simulated backend.
    #[arg(long, env = "GPUMEDIC_SIMULATED_GPUS", default_value_t = 8)]
    simulated_gpus: u32,
    /// How often GPUs are sampled.
    #[arg(long, env = "GPUMEDIC_SAMPLE_INTERVAL", default_value = "10s")]
    sample_interval: String,
    /// How often each GPU reports a heartbeat (healthy evidence) when nothing changes.
    #[arg(long, env = "GPUMEDIC_HEARTBEAT_INTERVAL", default_value = "60s")]
    heartbeat_interval: String,
    /// A GPU sample taking longer than this is reported as a hung monitor.
    #[arg(long, env = "GPUMEDIC_SAMPLE_TIMEOUT", default_value = "5s")]
    sample_timeout: String,
    /// The kernel log to follow (`off` to disable).
    #[arg(long, env = "GPUMEDIC_KMSG_PATH", default_value = "/dev/kmsg")]
    kmsg_path: String,
    /// Where the collector keeps its state (the kernel-log cursor); a hostPath in Kubernetes.
    #[arg(long, env = "GPUMEDIC_STATE_DIR", default_value = "/var/lib/gpumedic")]
    state_dir: PathBuf,
    /// Xid events from NVML's event set: `auto` (only when the kernel log is off), `on` or `off`.
    #[arg(long, env = "GPUMEDIC_NVML_XIDS", default_value = "auto")]
    nvml_xids: String,
    #[command(flatten)]
    dcgm: dcgm::source::DcgmArgs,
    #[command(flatten)]
    cloud: cloud::CloudArgs,
}

/// Which GPU backend to run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BackendChoice {
    /// NVML through the driver.
    Nvml,
    /// A simulated node with this many GPUs.
    Simulated(u32),
    /// No GPU sampling.
    Off,
}

/// The validated configuration.
#[derive(Debug, Clone)]
pub struct Config {
    /// Shared service settings.
    pub common: CommonConfig,
    /// Kafka settings.
    pub kafka: KafkaSettings,
    /// This node's name; the key of every record the collector publishes.
    pub node_name: String,
    /// The GPU backend.
    pub backend: BackendChoice,
    /// Sampling interval.
    pub sample_interval: Duration,
    /// Heartbeat interval.
    pub heartbeat_interval: Duration,
    /// Sample timeout.
    pub sample_timeout: Duration,
    /// The kernel log, when followed.
    pub kmsg_path: Option<PathBuf>,
    /// The state folder.
    pub state_dir: PathBuf,
    /// Whether Xid events come from NVML's event set.
    pub nvml_xids: nvml_xid::XidChoice,
    /// The DCGM source.
    pub dcgm: dcgm::source::DcgmSettings,
    /// The cloud maintenance source.
    pub cloud: cloud::CloudSettings,
}

impl Validate for Args {
    type Valid = Config;

    fn validate(self) -> Result<Config, Problems> {
        let mut p = Problems::default();
        let common = self.common.validate().map_err(|e| p.extend(e)).ok();
        let kafka = self.kafka.validate().map_err(|e| p.extend(e)).ok();
        if !is_dns_subdomain(&self.node_name) {
            p.push("--node-name", format!("'{}' is not a valid Kubernetes node name", self.node_name));
        }
        let backend = p.check(
            "--gpu-backend",
            match self.gpu_backend.as_str() {
                "nvml" => Ok(BackendChoice::Nvml),
                "simulated" if self.simulated_gpus > 0 => Ok(BackendChoice::Simulated(self.simulated_gpus)),
                "simulated" => Err("the simulated backend needs --simulated-gpus of at least 1".into()),
                "off" => Ok(BackendChoice::Off),
                other => Err(format!("'{other}' is not a backend; use nvml, simulated or off")),
            },
        );
        let sample_interval = p.check("--sample-interval", parse_duration(&self.sample_interval));
        let heartbeat_interval = p.check("--heartbeat-interval", parse_duration(&self.heartbeat_interval));
        let sample_timeout = p.check("--sample-timeout", parse_duration(&self.sample_timeout));
        let nvml_xids = p.check("--nvml-xids", nvml_xid::XidChoice::parse(&self.nvml_xids));
        let dcgm = self.dcgm.validate().map_err(|e| p.extend(e)).ok();
        let cloud = self.cloud.validate().map_err(|e| p.extend(e)).ok();
        p.finish(|| Config {
            common: common.expect("checked"),
            kafka: kafka.expect("checked"),
            node_name: self.node_name,
            backend: backend.expect("checked"),
            sample_interval: sample_interval.expect("checked"),
            heartbeat_interval: heartbeat_interval.expect("checked"),
            sample_timeout: sample_timeout.expect("checked"),
            kmsg_path: (self.kmsg_path != "off" && !self.kmsg_path.is_empty()).then(|| PathBuf::from(self.kmsg_path)),
            state_dir: self.state_dir,
            nvml_xids: nvml_xids.expect("checked"),
            dcgm: dcgm.expect("checked"),
            cloud: cloud.expect("checked"),
        })
    }
}

/// True for a valid DNS-1123 subdomain, the rule Kubernetes applies to node names.
pub fn is_dns_subdomain(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 253
        && name.split('.').all(|label| {
            !label.is_empty()
                && label.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
                && !label.starts_with('-')
                && !label.ends_with('-')
        })
}

/// What stops the collector.
#[derive(Debug, thiserror::Error)]
pub enum CollectorError {
    /// Kafka failed.
    #[error(transparent)]
    Kafka(#[from] kafka::KafkaError),
}

/// Runs the collector until SIGTERM/SIGINT or a failure.
pub async fn run(config: Config) -> Result<(), ShutdownError> {
    let mut service = Service::start(NAME, &config.common);
    let ready = service.readiness.register("kafka-producer");
    let token = service.shutdown.token();
    let specs = [TopicSpec::new(topics::HEALTH_RAW, topics::DEFAULT_PARTITIONS)];
    if !kafka::wait_for_topics(&config.kafka, &specs, &token).await {
        return service.run().await;
    }
    let producer = match config.kafka.producer(&format!("{NAME}-{}", config.node_name)) {
        Ok(p) => p,
        Err(e) => return Err(ShutdownError::TaskFailed { task: "producer".into(), source: Box::new(e) }),
    };
    let emitter = Emitter { producer: producer.clone() };
    ready.set(true);
    tracing::info!(node = %config.node_name, topic = topics::HEALTH_RAW, "Collector ready to publish.");

    let backend: Option<(Box<dyn GpuBackend>, Source)> = match config.backend {
        BackendChoice::Off => None,
        BackendChoice::Simulated(n) => {
            let (sim, _control) = Simulated::new(&config.node_name, n);
            Some((Box::new(sim), Source::Nvml))
        }
        BackendChoice::Nvml => match NvmlBackend::init() {
            Ok(b) => Some((Box::new(b), Source::Nvml)),
            Err(e) => {
                // One clear line and one event; the rest of the collector goes on.
                tracing::warn!(error = %e, "NVML is not available on this node; GPU sampling is disabled.");
                let mut event = HealthEvent::new(
                    &config.node_name,
                    Source::Nvml,
                    gpumedic_schemas::health::Component::Node,
                    gpumedic_schemas::health::Entity::default(),
                    gpumedic_schemas::Detail::MonitorHealth(gpumedic_schemas::health::MonitorHealthDetail {
                        monitor: "nvml".into(),
                        state: gpumedic_schemas::health::MonitorState::Unavailable,
                        message: Some(e.to_string()),
                    }),
                );
                event.healthy = false;
                let _ = emitter.emit(&event).await;
                None
            }
        },
    };
    if let Some((backend, source)) = backend {
        if config.nvml_xids.runs(config.kmsg_path.is_some()) {
            let forward = nvml_xid::forward_xids(
                config.node_name.clone(),
                source,
                backend.as_ref(),
                emitter.clone(),
                token.clone(),
            );
            service.shutdown.spawn("nvml-xid", forward);
        }
        service.shutdown.spawn(
            "gpu-sampler",
            sources::sample_gpus(
                sources::SamplingSettings {
                    node: config.node_name.clone(),
                    source,
                    interval: config.sample_interval,
                    heartbeat: config.heartbeat_interval,
                    timeout: config.sample_timeout,
                },
                backend,
                emitter.clone(),
                token.clone(),
            ),
        );
    }
    let directory = dcgm::source::GpuDirectory::default();
    if let Some(exporter) = config.dcgm.exporter.clone() {
        let task = dcgm::source::scrape_exporter(
            config.node_name.clone(),
            exporter,
            directory.clone(),
            emitter.clone(),
            token.clone(),
        );
        service.shutdown.spawn("dcgm-exporter", task);
    }
    if let Some(diag) = config.dcgm.diag.clone() {
        let task =
            dcgm::source::schedule_diag(config.node_name.clone(), diag, directory, emitter.clone(), token.clone());
        service.shutdown.spawn("dcgm-diag", task);
    }
    let cloud =
        cloud::watch_maintenance(config.node_name.clone(), config.cloud.clone(), emitter.clone(), token.clone());
    service.shutdown.spawn("cloud-maintenance", cloud);
    if let Some(path) = config.kmsg_path.clone() {
        if let Err(e) = std::fs::create_dir_all(&config.state_dir) {
            return Err(ShutdownError::TaskFailed { task: "state-dir".into(), source: Box::new(e) });
        }
        service.shutdown.spawn(
            "kernel-log",
            sources::follow_kernel_log(
                config.node_name.clone(),
                path,
                config.state_dir.clone(),
                emitter,
                token.clone(),
            ),
        );
    }
    service.shutdown.spawn("producer-flush", async move {
        token.cancelled().await;
        ready.set(false);
        // Deliver what is queued before leaving; the deadline bounds this too.
        if let Err(e) =
            tokio::task::spawn_blocking(move || producer.flush(Duration::from_secs(10))).await.unwrap_or(Ok(()))
        {
            tracing::error!(error = %e, "Some health events were not delivered before shutdown.");
        }
        Ok::<_, CollectorError>(())
    });
    service.run().await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn node_names_follow_kubernetes_rules() {
        assert!(is_dns_subdomain("gpu-node-17"));
        assert!(is_dns_subdomain("ip-10-0-3-17.ec2.internal"));
        assert!(!is_dns_subdomain(""));
        assert!(!is_dns_subdomain("GPU_Node"));
        assert!(!is_dns_subdomain("-node"));
        assert!(!is_dns_subdomain("a..b"));
    }
}
