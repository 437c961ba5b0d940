//! The collector: one per GPU node (a DaemonSet). It turns what the node knows about its GPUs into
//! raw health events on `gpumedic.health.raw.v1`, keyed by node name.
//!
//! This crate holds the service frame: configuration, the Kafka producer and its readiness. The
//! health sources (NVML, kernel log, DCGM, cloud maintenance, gRPC ingest) plug in behind it.

pub mod kernel_log;

use std::time::Duration;

use clap::Parser;
use gpumedic_runtime::config::{CommonArgs, CommonConfig, Problems, Validate};
use gpumedic_runtime::kafka::{self, KafkaArgs, KafkaSettings, TopicSpec};
use gpumedic_runtime::service::Service;
use gpumedic_runtime::shutdown::ShutdownError;
use gpumedic_schemas::topics;
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
        p.finish(|| Config {
            common: common.expect("checked"),
            kafka: kafka.expect("checked"),
            node_name: self.node_name,
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
    service.shutdown.spawn("publisher", async move {
        let specs = [TopicSpec::new(topics::HEALTH_RAW, topics::DEFAULT_PARTITIONS)];
        if !kafka::wait_for_topics(&config.kafka, &specs, &token).await {
            return Ok::<_, CollectorError>(());
        }
        let producer = config.kafka.producer(&format!("{NAME}-{}", config.node_name))?;
        ready.set(true);
        tracing::info!(node = %config.node_name, topic = topics::HEALTH_RAW, "Collector ready to publish.");
        token.cancelled().await;
        ready.set(false);
        // Deliver what is queued before leaving; the deadline bounds this too.
        if let Err(e) = producer.flush(Duration::from_secs(10)) {
            tracing::error!(error = %e, "Some health events were not delivered before shutdown.");
        }
        Ok(())
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
