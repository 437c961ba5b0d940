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
//! The consumer is not wired to the core yet: verdicts are dead-lettered with that reason
//! (nothing is lost; they can be replayed).

pub mod apply;
pub mod drain;
pub mod plan;
pub mod request;
pub mod safety;

use std::time::Duration;

use clap::Parser;
use gpumedic_runtime::config::{CommonArgs, CommonConfig, Problems, Validate};
use gpumedic_runtime::k8s;
use gpumedic_runtime::kafka::{DeadLetterAll, KafkaArgs, KafkaSettings};
use gpumedic_runtime::service::Service;
use gpumedic_runtime::shutdown::ShutdownError;
use gpumedic_schemas::topics;

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
        p.finish(|| Config { common: common.expect("checked"), kafka: kafka.expect("checked"), group: self.group })
    }
}

/// Runs the remediator until SIGTERM/SIGINT or a failure.
pub async fn run(config: Config) -> Result<(), ShutdownError> {
    let mut service = Service::start(NAME, &config.common);
    let kube_ready = service.readiness.register("kubernetes-api");
    let token = service.shutdown.token();
    service.shutdown.spawn("kubernetes", async move {
        let client = k8s::client().await?;
        k8s::watch_reachability(client, kube_ready, Duration::from_secs(15), token).await
    });
    service.spawn_consumer(
        config.kafka,
        config.group,
        vec![topics::VERDICTS],
        vec![topics::ACTIONS],
        topics::DEFAULT_PARTITIONS,
        DeadLetterAll { reason: format!("gpumedic-remediator {} does not remediate yet", env!("CARGO_PKG_VERSION")) },
    );
    service.run().await
}
