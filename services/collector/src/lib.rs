//! The collector: one per GPU node (a DaemonSet). It turns what the node knows about its GPUs into
//! raw health events on `gpumedic.health.raw.v1`, keyed by node name.
//!
//! This crate holds the service frame: configuration, the publisher (Kafka with an on-disk spool
//! for outages) and its readiness. The health sources (NVML, kernel log, DCGM, cloud
//! maintenance, gRPC ingest, fault injection) plug in behind it; docs/collector.md lists them
//! with their flags.

pub mod cloud;
pub mod dcgm;
pub mod gpu;
pub mod identity;
pub mod ingest;
pub mod inventory;
pub mod kernel_log;
pub mod network;
pub mod node_token;
pub mod nvml_xid;
pub mod pod_resources;
pub mod publisher;
pub mod sampler;
pub mod socket_claim;
pub mod sources;
pub mod spool;
pub mod synthetic;

mod events;

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use clap::Parser;
use gpumedic_runtime::config::{CommonArgs, CommonConfig, Problems, Validate, parse_duration, parse_socket_addr};
use gpumedic_runtime::kafka::{self, KafkaArgs, KafkaSettings};
use gpumedic_runtime::service::RunError;
use gpumedic_runtime::service::Service;
use gpumedic_schemas::health::Source;
use gpumedic_schemas::topics;

use crate::gpu::{GpuBackend, NvmlBackend, Simulated};
use crate::publisher::{Publisher, PublisherSettings};

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
    /// The file holding the node's boot id, stamped on every event (a new one proves a reboot).
    /// Read once at start; a missing or empty file stops the start.
    #[arg(long, env = "GPUMEDIC_BOOT_ID_FILE", default_value = identity::BOOT_ID_FILE)]
    boot_id_file: PathBuf,
    /// How often the GPU inventory is published when nothing changes (it is also published at
    /// start and whenever the GPUs present change).
    #[arg(long, env = "GPUMEDIC_INVENTORY_REFRESH", default_value = "5m")]
    inventory_refresh: String,
    /// How often GPUs are sampled.
    #[arg(long, env = "GPUMEDIC_SAMPLE_INTERVAL", default_value = "10s")]
    sample_interval: String,
    /// How often each GPU reports a heartbeat (healthy evidence) when nothing changes.
    #[arg(long, env = "GPUMEDIC_HEARTBEAT_INTERVAL", default_value = "60s")]
    heartbeat_interval: String,
    /// A GPU sample taking longer than this is reported as a hung monitor.
    #[arg(long, env = "GPUMEDIC_SAMPLE_TIMEOUT", default_value = "5s")]
    sample_timeout: String,
    /// The kernel log to follow (`off` to disable): the `/dev/kmsg` device, or a file of records
    /// in its format (one a line, as `cat /dev/kmsg` prints them), followed as it grows.
    #[arg(long, env = "GPUMEDIC_KMSG_PATH", default_value = "/dev/kmsg")]
    kmsg_path: String,
    /// On a first run (no saved kernel-log cursor), records older than this are history, not new
    /// faults: they are counted, not published.
    #[arg(long, env = "GPUMEDIC_KMSG_LOOK_BACK", default_value = "10m")]
    kmsg_look_back: String,
    /// Where the collector keeps its state (the kernel-log cursor, the spool); a hostPath in
    /// Kubernetes.
    #[arg(long, env = "GPUMEDIC_STATE_DIR", default_value = "/var/lib/gpumedic")]
    state_dir: PathBuf,
    /// Most bytes the on-disk spool (`<state-dir>/spool`) holds while Kafka is unreachable
    /// (suffix KiB, MiB or GiB); when full, healthy heartbeats are dropped first.
    #[arg(long, env = "GPUMEDIC_SPOOL_MAX_BYTES", default_value = "256MiB")]
    spool_max_bytes: String,
    /// How long Kafka may take to acknowledge an event before it is spooled instead.
    #[arg(long, env = "GPUMEDIC_DELIVERY_TIMEOUT", default_value = "10s")]
    delivery_timeout: String,
    /// The unix socket of the gRPC ingest API for custom monitors: a path, empty for
    /// `<state-dir>/ingest.sock`, or `off`.
    #[arg(long, env = "GPUMEDIC_INGEST_SOCKET", default_value = "")]
    ingest_socket: String,
    /// Largest gRPC ingest message accepted (suffix KiB, MiB or GiB).
    #[arg(long, env = "GPUMEDIC_INGEST_MAX_MESSAGE_BYTES", default_value = "4MiB")]
    ingest_max_message_bytes: String,
    /// Enables fault injection: an HTTP endpoint on this loopback address (e.g. 127.0.0.1:9401)
    /// that publishes synthetic events for this node. Off when empty.
    #[arg(long, env = "GPUMEDIC_SYNTHETIC_ADDR", default_value = "")]
    synthetic_addr: String,
    /// Xid events from NVML's event set: `auto` (only when the kernel log is off), `on` or `off`.
    #[arg(long, env = "GPUMEDIC_NVML_XIDS", default_value = "auto")]
    nvml_xids: String,
    /// The collector's projected ServiceAccount token (audience `gpumedic`, bound to this pod),
    /// attached to every raw record so the enricher can check that this node speaks only for
    /// itself; re-read when the kubelet rotates it. `off` sends records without a token.
    #[arg(long, env = "GPUMEDIC_NODE_TOKEN_FILE", default_value = node_token::DEFAULT_TOKEN_FILE)]
    node_token_file: String,
    /// Refuse to start when the node token file cannot be read (an enricher that enforces node
    /// authentication dead-letters records without a token). Off: a missing token is a warning.
    #[arg(long, env = "GPUMEDIC_REQUIRE_NODE_TOKEN")]
    require_node_token: bool,
    /// How records prove the node: `signature` (the token is published once per rotation to the
    /// node-token directory, and each record carries its key id and an HMAC; the token itself
    /// until the directory acknowledges it) or `token` (the token in every record).
    #[arg(long, env = "GPUMEDIC_NODE_AUTH_PROOF", default_value = "signature")]
    node_auth_proof: String,
    /// The node-token directory topic (`--node-auth-proof signature`).
    #[arg(long, env = "GPUMEDIC_NODE_TOKENS_TOPIC", default_value = topics::NODE_TOKENS)]
    node_tokens_topic: String,
    /// How often the InfiniBand/RoCE ports are read from sysfs (`off` to disable).
    #[arg(long, env = "GPUMEDIC_IB_INTERVAL", default_value = "30s")]
    ib_interval: String,
    /// The sysfs root the ports are read under (`<root>/class/infiniband/<hca>/ports/<n>/`).
    #[arg(long, env = "GPUMEDIC_SYSFS_ROOT", default_value = "/sys")]
    sysfs_root: PathBuf,
    /// How many HCAs the node should have; fewer is a missing-HCA event. Unset: not checked.
    #[arg(long, env = "GPUMEDIC_IB_EXPECTED_HCAS")]
    ib_expected_hcas: Option<u32>,
    /// HCAs (`mlx5_3`) or ports (`mlx5_3/2`) not to watch, comma-separated: ports that are
    /// unused and down for good.
    #[arg(long, env = "GPUMEDIC_IB_IGNORE", default_value = "")]
    ib_ignore: String,
    /// The kubelet's PodResources socket, asked which pods use which GPU so that every event on
    /// a GPU names the pods on it (`off` to disable). A missing socket is logged once and the
    /// collector runs on without it.
    #[arg(long, env = "GPUMEDIC_POD_RESOURCES_SOCKET", default_value = pod_resources::DEFAULT_SOCKET)]
    pod_resources_socket: String,
    /// How often the kubelet's PodResources API is asked.
    #[arg(long, env = "GPUMEDIC_POD_RESOURCES_INTERVAL", default_value = "30s")]
    pod_resources_interval: String,
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
    /// The host's boot id, read from `--boot-id-file` at start.
    pub boot_id: String,
    /// Time between unchanged GPU inventories.
    pub inventory_refresh: Duration,
    /// Sampling interval.
    pub sample_interval: Duration,
    /// Heartbeat interval.
    pub heartbeat_interval: Duration,
    /// Sample timeout.
    pub sample_timeout: Duration,
    /// The kernel log, when followed.
    pub kmsg_path: Option<PathBuf>,
    /// How far back a first run publishes kernel-log records.
    pub kmsg_look_back: Duration,
    /// The state folder.
    pub state_dir: PathBuf,
    /// The spool's bound in bytes.
    pub spool_max_bytes: u64,
    /// How long a delivery may take before the event is spooled.
    pub delivery_timeout: Duration,
    /// The ingest socket, when the ingest API is served.
    pub ingest_socket: Option<PathBuf>,
    /// Largest ingest message, in bytes.
    pub ingest_max_message_bytes: usize,
    /// The fault-injection endpoint's address (loopback), when enabled.
    pub synthetic_addr: Option<SocketAddr>,
    /// Whether Xid events come from NVML's event set.
    pub nvml_xids: nvml_xid::XidChoice,
    /// The node token file, when records carry a token (`--node-token-file`).
    pub node_token_file: Option<PathBuf>,
    /// The token read from it at start, empty when the file could not be read (allowed unless
    /// `--require-node-token`). Its `Debug` never shows the credential.
    pub node_token: node_token::NodeToken,
    /// The node-token directory topic, when records are signed (`--node-auth-proof signature`);
    /// `None`: every record carries the token.
    pub node_tokens_topic: Option<String>,
    /// The DCGM source.
    pub dcgm: dcgm::source::DcgmSettings,
    /// The cloud maintenance source.
    pub cloud: cloud::CloudSettings,
    /// The InfiniBand/RoCE port source, when on (`node` is filled in by `run`).
    pub network: Option<network::NetworkSettings>,
    /// The kubelet's PodResources poller, when on.
    pub pod_resources: Option<pod_resources::PodResourcesSettings>,
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
        let boot_id = p.check("--boot-id-file", identity::read_boot_id(&self.boot_id_file));
        let inventory_refresh = p.check(
            "--inventory-refresh",
            parse_duration(&self.inventory_refresh).and_then(|d| {
                if d.is_zero() { Err("the inventory needs a refresh interval above zero".to_owned()) } else { Ok(d) }
            }),
        );
        let sample_interval = p.check("--sample-interval", parse_duration(&self.sample_interval));
        let heartbeat_interval = p.check("--heartbeat-interval", parse_duration(&self.heartbeat_interval));
        let sample_timeout = p.check("--sample-timeout", parse_duration(&self.sample_timeout));
        let kmsg_look_back = p.check("--kmsg-look-back", parse_duration(&self.kmsg_look_back));
        let spool_max_bytes = p.check(
            "--spool-max-bytes",
            parse_bytes(&self.spool_max_bytes).and_then(|b| {
                if b < 1024 * 1024 {
                    Err(format!("{b} bytes is too small for a spool; give at least 1MiB"))
                } else {
                    Ok(b)
                }
            }),
        );
        let delivery_timeout = p.check("--delivery-timeout", parse_duration(&self.delivery_timeout));
        let ingest_max_message_bytes = p.check(
            "--ingest-max-message-bytes",
            parse_bytes(&self.ingest_max_message_bytes)
                .and_then(|b| usize::try_from(b).map_err(|_| format!("{b} bytes is too large"))),
        );
        let ingest_socket = match self.ingest_socket.as_str() {
            "off" => None,
            "" => Some(self.state_dir.join("ingest.sock")),
            path => Some(PathBuf::from(path)),
        };
        if let Some(path) = &ingest_socket
            && path.as_os_str().len() > 107
        {
            p.push(
                "--ingest-socket",
                format!("{} is longer than a unix socket path may be (107 bytes)", path.display()),
            );
        }
        let synthetic_addr = match self.synthetic_addr.as_str() {
            "" | "off" => None,
            raw => p.check(
                "--synthetic-addr",
                parse_socket_addr(raw).and_then(|addr| {
                    if addr.ip().is_loopback() {
                        Ok(addr)
                    } else {
                        Err(format!(
                            "{addr} is not a loopback address: fault injection can cordon nodes, so it listens on 127.0.0.1 or [::1] only"
                        ))
                    }
                }),
            ),
        };
        let nvml_xids = p.check("--nvml-xids", nvml_xid::XidChoice::parse(&self.nvml_xids));
        let node_token_file = match self.node_token_file.as_str() {
            "" | "off" => None,
            path => Some(PathBuf::from(path)),
        };
        let node_token = match &node_token_file {
            None if self.require_node_token => {
                p.push("--node-token-file", "--require-node-token needs a token file, not off");
                None
            }
            None => None,
            Some(path) => match node_token::read_token(path) {
                Ok(token) => Some(token),
                Err(e) if self.require_node_token => {
                    p.push("--node-token-file", e.to_string());
                    None
                }
                // Said at start, by `run`, where logging is set up.
                Err(_) => None,
            },
        };
        let node_tokens_topic = match self.node_auth_proof.as_str() {
            "signature" if self.node_tokens_topic.trim().is_empty() => {
                p.push("--node-tokens-topic", "must name a topic when --node-auth-proof is signature");
                None
            }
            "signature" => Some(self.node_tokens_topic.clone()),
            "token" => None,
            other => {
                p.push("--node-auth-proof", format!("{other:?} is neither signature nor token"));
                None
            }
        };
        let network = match self.ib_interval.trim() {
            "off" | "" => None,
            raw => p
                .check(
                    "--ib-interval",
                    parse_duration(raw).and_then(|d| {
                        if d.is_zero() {
                            Err("the ports need an interval above zero (or off)".to_owned())
                        } else {
                            Ok(d)
                        }
                    }),
                )
                .map(|interval| network::NetworkSettings {
                    node: self.node_name.clone(),
                    sysfs_root: self.sysfs_root.clone(),
                    interval,
                    expected_hcas: self.ib_expected_hcas,
                    ignore: self
                        .ib_ignore
                        .split(',')
                        .map(str::trim)
                        .filter(|s| !s.is_empty())
                        .map(str::to_owned)
                        .collect(),
                }),
        };
        let pod_resources = match self.pod_resources_socket.trim() {
            "off" | "" => None,
            socket => p
                .check(
                    "--pod-resources-interval",
                    parse_duration(&self.pod_resources_interval).and_then(|d| {
                        if d.is_zero() {
                            Err("the kubelet needs an interval above zero (or --pod-resources-socket off)".to_owned())
                        } else {
                            Ok(d)
                        }
                    }),
                )
                .map(|interval| pod_resources::PodResourcesSettings {
                    node: self.node_name.clone(),
                    socket: PathBuf::from(socket),
                    interval,
                    timeout: interval.min(Duration::from_secs(5)),
                }),
        };
        let dcgm = self.dcgm.validate().map_err(|e| p.extend(e)).ok();
        let cloud = self.cloud.validate().map_err(|e| p.extend(e)).ok();
        p.finish(|| Config {
            common: common.expect("checked"),
            kafka: kafka.expect("checked"),
            node_name: self.node_name,
            backend: backend.expect("checked"),
            boot_id: boot_id.expect("checked"),
            inventory_refresh: inventory_refresh.expect("checked"),
            sample_interval: sample_interval.expect("checked"),
            heartbeat_interval: heartbeat_interval.expect("checked"),
            sample_timeout: sample_timeout.expect("checked"),
            kmsg_path: (self.kmsg_path != "off" && !self.kmsg_path.is_empty()).then(|| PathBuf::from(self.kmsg_path)),
            kmsg_look_back: kmsg_look_back.expect("checked"),
            state_dir: self.state_dir,
            spool_max_bytes: spool_max_bytes.expect("checked"),
            delivery_timeout: delivery_timeout.expect("checked"),
            ingest_socket,
            ingest_max_message_bytes: ingest_max_message_bytes.expect("checked"),
            synthetic_addr,
            nvml_xids: nvml_xids.expect("checked"),
            node_token_file,
            node_token: node_token::NodeToken::new(node_token),
            node_tokens_topic,
            dcgm: dcgm.expect("checked"),
            cloud: cloud.expect("checked"),
            network,
            pod_resources,
        })
    }
}

/// Parses a size in bytes: a number with an optional `KiB`, `MiB` or `GiB` suffix.
pub fn parse_bytes(raw: &str) -> Result<u64, String> {
    let raw = raw.trim();
    let (digits, unit) = match raw.find(|c: char| !c.is_ascii_digit()) {
        Some(i) => raw.split_at(i),
        None => (raw, ""),
    };
    let factor: u64 = match unit.trim() {
        "" | "B" => 1,
        "KiB" => 1 << 10,
        "MiB" => 1 << 20,
        "GiB" => 1 << 30,
        other => return Err(format!("'{raw}': unknown unit '{other}'; use KiB, MiB or GiB")),
    };
    digits
        .parse::<u64>()
        .ok()
        .and_then(|n| n.checked_mul(factor))
        .ok_or_else(|| format!("'{raw}' is not a size such as 256MiB"))
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
    /// The spool could not be opened.
    #[error(transparent)]
    Spool(#[from] spool::SpoolError),
}

/// The GPU backend to sample: its name, how to open it (again), and the instance opened at start
/// when there is one (for NVML's Xid watcher).
type SamplingBackend = (&'static str, sources::BackendOpener, Option<Box<dyn GpuBackend>>);

/// Runs the collector until SIGTERM/SIGINT or a failure.
pub async fn run(config: Config) -> Result<(), RunError> {
    let mut service = Service::start(NAME, &config.common);
    let ready = service.readiness.register("publisher");
    let token = service.shutdown.token();
    let failed = |step: &'static str, e: CollectorError| RunError::setup(step, e);
    // Kafka's own deadline for an acknowledgement, unless the operator set one: past it the event
    // goes to the spool. Operator options come later and win.
    let mut kafka = config.kafka.clone();
    kafka.options.insert(0, ("message.timeout.ms".into(), config.delivery_timeout.as_millis().to_string()));
    let producer =
        kafka.producer(&format!("{NAME}-{}", config.node_name)).map_err(|e| failed("the producer", e.into()))?;
    // With a schema registry, this build's schema must be registered before the first event is
    // encoded: an unreachable registry stops the start (the kernel-log cursor keeps its place).
    let codec = config.kafka.codec().await.map_err(|e| failed("the schema registry", e.into()))?;
    // A simulated node keeps the boot id of its last simulated reboot across a restart of the
    // collector (the classifier refuses events from a boot it saw replaced).
    let boot_id = match config.backend {
        BackendChoice::Simulated(_) => {
            identity::load_simulated_boot(&config.state_dir, &config.boot_id).unwrap_or_else(|| config.boot_id.clone())
        }
        _ => config.boot_id.clone(),
    };
    tracing::info!(%boot_id, "Every event carries this boot id.");
    let node_token = config.node_token.clone();
    match (&config.node_token_file, node_token.get()) {
        (None, _) => tracing::warn!(
            "No node token file is configured (--node-token-file off): records carry no node token, and an enricher that enforces node authentication dead-letters them."
        ),
        (Some(path), None) => tracing::warn!(
            path = %path.display(),
            "The node token file cannot be read: records carry no node token until it can, and an enricher that enforces node authentication dead-letters them."
        ),
        (Some(path), Some(_)) => tracing::info!(path = %path.display(), "Every record carries this node's token."),
    }
    if let Some(path) = config.node_token_file.clone() {
        service.shutdown.spawn("node-token", node_token.clone().follow(path, token.clone()));
        if let Some(topic) = config.node_tokens_topic.clone() {
            let keys = node_token.clone().publish_keys(
                config.kafka.clone(),
                producer.clone(),
                topic,
                config.node_name.clone(),
                token.clone(),
            );
            service.shutdown.spawn("node-key", keys);
        }
    }
    let node_identity = identity::NodeIdentity::new(boot_id);
    // The publisher starts without Kafka: events spool until the broker answers.
    let (publisher, sink) = Publisher::open(
        PublisherSettings {
            kafka: config.kafka.clone(),
            topic: topics::HEALTH_RAW.to_owned(),
            spool_dir: config.state_dir.join("spool"),
            spool_max_bytes: config.spool_max_bytes,
        },
        producer,
        codec,
        node_identity,
    )
    .map_err(|e| failed("the spool", e.into()))?;
    let publisher = publisher.with_node_token(node_token);
    service.shutdown.spawn("publisher", publisher.run(token.clone()));
    ready.set(true);
    tracing::info!(node = %config.node_name, topic = topics::HEALTH_RAW, "Collector ready to publish.");

    let mut simulated = None;
    // The backend is opened on the sampling worker's thread and opened again after a failure
    // (with backoff) or a hang; NVML is tried once here too, for the Xid watcher.
    let backend: Option<SamplingBackend> = match config.backend {
        BackendChoice::Off => None,
        BackendChoice::Simulated(n) => {
            let (sim, control) = Simulated::new(&config.node_name, n);
            simulated = Some(synthetic::SimulatedNode {
                control,
                state_dir: config.state_dir.clone(),
                host_boot_id: config.boot_id.clone(),
            });
            let first: Box<dyn GpuBackend> = Box::new(sim.clone());
            let open: sources::BackendOpener =
                std::sync::Arc::new(move || Ok(Box::new(sim.clone()) as Box<dyn GpuBackend>));
            Some(("simulated", open, Some(first)))
        }
        BackendChoice::Nvml => {
            let open: sources::BackendOpener =
                std::sync::Arc::new(|| NvmlBackend::init().map(|b| Box::new(b) as Box<dyn GpuBackend>));
            let first = match NvmlBackend::init() {
                Ok(b) => Some(Box::new(b) as Box<dyn GpuBackend>),
                Err(e) => {
                    // Sampling reports it (a monitor_health event) and keeps trying with backoff.
                    tracing::warn!(error = %e, "NVML is not available on this node yet; GPU sampling will keep trying.");
                    None
                }
            };
            Some(("nvml", open, first))
        }
    };
    if let Some((name, open, first)) = backend {
        if let Some(first) = &first
            && config.nvml_xids.runs(config.kmsg_path.is_some())
        {
            let forward = nvml_xid::forward_xids(
                config.node_name.clone(),
                Source::Nvml,
                first.as_ref(),
                sink.clone(),
                token.clone(),
            );
            service.shutdown.spawn("nvml-xid", forward);
        }
        service.shutdown.spawn(
            "gpu-sampler",
            sources::sample_gpus(
                sources::SamplingSettings {
                    node: config.node_name.clone(),
                    source: Source::Nvml,
                    interval: config.sample_interval,
                    heartbeat: config.heartbeat_interval,
                    timeout: config.sample_timeout,
                    state_dir: config.state_dir.clone(),
                    inventory_refresh: config.inventory_refresh,
                },
                name,
                open,
                sink.clone(),
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
            sink.clone(),
            token.clone(),
        );
        service.shutdown.spawn("dcgm-exporter", task);
    }
    if let Some(health) = config.dcgm.health.clone() {
        let task = dcgm::source::watch_health(
            config.node_name.clone(),
            health,
            directory.clone(),
            sink.clone(),
            token.clone(),
        );
        service.shutdown.spawn("dcgm-health", task);
    }
    if let Some(diag) = config.dcgm.diag.clone() {
        let task = dcgm::source::schedule_diag(config.node_name.clone(), diag, directory, sink.clone(), token.clone());
        service.shutdown.spawn("dcgm-diag", task);
    }
    if let Some(settings) = config.pod_resources.clone() {
        service.shutdown.spawn("pod-resources", pod_resources::poll(settings, sink.clone(), token.clone()));
    }
    if let Some(settings) = config.network.clone() {
        service.shutdown.spawn("infiniband", network::watch_fabric(settings, sink.clone(), token.clone()));
    }
    let cloud = cloud::watch_maintenance(config.node_name.clone(), config.cloud.clone(), sink.clone(), token.clone());
    service.shutdown.spawn("cloud-maintenance", cloud);
    if let Some(path) = config.kmsg_path.clone() {
        if let Err(e) = std::fs::create_dir_all(&config.state_dir) {
            return Err(RunError::setup("the state directory", e));
        }
        service.shutdown.spawn(
            "kernel-log",
            sources::follow_kernel_log(
                sources::KernelLog {
                    node: config.node_name.clone(),
                    path,
                    state_dir: config.state_dir.clone(),
                    // The kernel log's cursor and event ids are the host's boot's, whatever a
                    // simulated node says.
                    boot_id: config.boot_id.clone(),
                    look_back: config.kmsg_look_back,
                },
                sink.clone(),
                token.clone(),
            ),
        );
    }
    if let Some(socket) = config.ingest_socket.clone() {
        let settings = ingest::IngestSettings {
            socket,
            node: config.node_name.clone(),
            max_message_bytes: config.ingest_max_message_bytes,
        };
        service.shutdown.spawn("ingest", ingest::serve(settings, sink.clone(), token.clone()));
    }
    if let Some(addr) = config.synthetic_addr {
        let task = synthetic::serve(addr, config.node_name.clone(), sink, simulated, token.clone());
        service.shutdown.spawn("synthetic", task);
    }
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

    #[test]
    fn sizes_parse_with_binary_units() {
        assert_eq!(parse_bytes("256MiB"), Ok(256 << 20));
        assert_eq!(parse_bytes("4096"), Ok(4096));
        assert_eq!(parse_bytes("1GiB"), Ok(1 << 30));
        assert!(parse_bytes("12MB").is_err());
        assert!(parse_bytes("lots").is_err());
    }

    fn args(extra: &[&str]) -> Result<Config, Problems> {
        let mut argv = vec!["gpumedic-collector", "--kafka-bootstrap", "127.0.0.1:1", "--node-name", "n1"];
        argv.extend_from_slice(extra);
        Args::try_parse_from(argv).expect("parses").validate()
    }

    #[test]
    fn fault_injection_is_off_by_default_and_loopback_only() {
        let c = args(&[]).expect("valid");
        assert_eq!(c.synthetic_addr, None);
        assert_eq!(c.ingest_socket, Some(PathBuf::from("/var/lib/gpumedic/ingest.sock")));
        assert!(args(&["--synthetic-addr", "127.0.0.1:9401"]).is_ok());
        assert!(args(&["--synthetic-addr", "[::1]:9401"]).is_ok());
        let err = args(&["--synthetic-addr", "0.0.0.0:9401"]).expect_err("not loopback");
        assert!(err.list().iter().any(|p| p.field == "--synthetic-addr" && p.message.contains("loopback")));
        assert_eq!(args(&["--ingest-socket", "off"]).expect("valid").ingest_socket, None);
    }

    #[test]
    fn a_missing_node_token_is_a_problem_only_when_required() {
        let c = args(&["--node-token-file", "/nonexistent/token"]).expect("valid: said at start");
        assert_eq!((c.node_token_file, c.node_token.get()), (Some(PathBuf::from("/nonexistent/token")), None));
        let err = args(&["--node-token-file", "/nonexistent/token", "--require-node-token"]).expect_err("required");
        assert!(err.list().iter().any(|p| p.field == "--node-token-file" && p.message.contains("/nonexistent/token")));
        assert!(args(&["--node-token-file", "off", "--require-node-token"]).is_err());
        assert_eq!(args(&["--node-token-file", "off"]).expect("valid").node_token_file, None);
        let file = std::env::temp_dir().join(format!("gpumedic-token-{}", uuid::Uuid::new_v4()));
        std::fs::write(&file, "header.payload.signature\n").unwrap();
        let c = args(&["--node-token-file", file.to_str().unwrap(), "--require-node-token"]).expect("valid");
        assert_eq!(c.node_token.get().as_deref(), Some(&b"header.payload.signature"[..]));
        std::fs::remove_file(&file).unwrap();
    }

    #[test]
    fn the_kubelet_is_asked_on_its_default_socket_unless_off() {
        let c = args(&[]).expect("valid");
        let settings = c.pod_resources.expect("on by default");
        assert_eq!(settings.socket, PathBuf::from(pod_resources::DEFAULT_SOCKET));
        assert_eq!((settings.interval, settings.timeout), (Duration::from_secs(30), Duration::from_secs(5)));
        assert_eq!(args(&["--pod-resources-socket", "off"]).expect("valid").pod_resources, None);
        let err = args(&["--pod-resources-interval", "0s"]).expect_err("zero interval");
        assert!(err.list().iter().any(|p| p.field == "--pod-resources-interval"));
    }

    #[test]
    fn the_boot_id_is_read_at_start_and_a_missing_file_is_a_listed_problem() {
        let c = args(&[]).expect("valid");
        assert_eq!(c.boot_id, identity::read_boot_id(std::path::Path::new(identity::BOOT_ID_FILE)).unwrap());
        assert_eq!(c.inventory_refresh, Duration::from_secs(300));
        let err = args(&["--boot-id-file", "/nonexistent/boot_id", "--inventory-refresh", "0s"]).expect_err("invalid");
        let fields: Vec<&str> = err.list().iter().map(|p| p.field.as_str()).collect();
        assert!(fields.contains(&"--boot-id-file") && fields.contains(&"--inventory-refresh"), "{fields:?}");
        assert!(err.list().iter().any(|p| p.message.contains("/nonexistent/boot_id")));
    }
}
