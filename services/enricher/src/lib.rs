//! The enricher: joins each raw health event with what the cluster knows (node labels, the GPU
//! workloads on the node, the Xid catalog) and republishes it on `gpumedic.health.enriched.v1`.
//!
//! This crate holds the service frame: configuration, the consumer group on the raw topic, the
//! Kubernetes client and readiness. Until enrichment is deployed, raw records are dead-lettered
//! with that reason (nothing is lost; they can be replayed).

pub mod catalog;

use std::time::Duration;

use clap::Parser;
use gpumedic_runtime::config::{CommonArgs, CommonConfig, Problems, Validate};
use gpumedic_runtime::k8s;
use gpumedic_runtime::kafka::{DeadLetterAll, KafkaArgs, KafkaSettings};
use gpumedic_runtime::service::Service;
use gpumedic_runtime::shutdown::ShutdownError;
use gpumedic_schemas::topics;

/// The service's name, as used in metric names and logs.
pub const NAME: &str = "enricher";

/// Command-line flags and environment variables.
#[derive(Debug, Parser)]
#[command(
    name = "gpumedic-enricher",
    version,
    about = "Adds cluster and Xid-catalog context to raw GPU health events."
)]
pub struct Args {
    #[command(flatten)]
    common: CommonArgs,
    #[command(flatten)]
    kafka: KafkaArgs,
    /// Kafka consumer group shared by all enricher replicas.
    #[arg(long, env = "GPUMEDIC_GROUP", default_value = "gpumedic-enricher")]
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

/// Runs the enricher until SIGTERM/SIGINT or a failure.
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
        vec![topics::HEALTH_RAW],
        vec![topics::HEALTH_ENRICHED],
        topics::DEFAULT_PARTITIONS,
        DeadLetterAll { reason: format!("gpumedic-enricher {} does not enrich events yet", env!("CARGO_PKG_VERSION")) },
    );
    service.run().await
}
