//! The console's configuration: its flags and environment variables ([`Args`]), validated into a
//! [`Config`] with every problem listed at once.

use std::time::Duration;

use clap::Parser;
use gpumedic_runtime::api_auth;
use gpumedic_runtime::config::{CommonArgs, CommonConfig, Problems, Validate, parse_duration};
use gpumedic_runtime::kafka::{KafkaArgs, KafkaSettings};
use gpumedic_runtime::postgres;
use gpumedic_schemas::topics;

/// Command-line flags and environment variables.
#[derive(Debug, Parser)]
#[command(
    name = "gpumedic-console",
    version,
    about = "Serves the GPU fleet's health as web pages and a read-only JSON API."
)]
pub struct Args {
    #[command(flatten)]
    common: CommonArgs,
    #[command(flatten)]
    kafka: KafkaArgs,
    /// PostgreSQL URL of the classifier's incident history (postgres://user:password@host:port/database).
    /// The console only reads; give it a read-only role.
    #[arg(long, env = "GPUMEDIC_DATABASE_URL")]
    database_url: String,
    /// Connections in the console's read-only database pool.
    #[arg(long, env = "GPUMEDIC_DATABASE_POOL", default_value_t = 4)]
    database_pool: u32,
    /// Label selector of the GPU nodes the console shows (the remediator's --gpu-node-selector).
    #[arg(long, env = "GPUMEDIC_GPU_NODE_SELECTOR", default_value = "nvidia.com/gpu.present=true")]
    gpu_node_selector: String,
    /// The remediator's namespace, where its status object (breaker and pause) lives.
    #[arg(long, env = "GPUMEDIC_REMEDIATOR_NAMESPACE", default_value = "gpumedic")]
    remediator_namespace: String,
    /// The remediator's status object (its --status-configmap).
    #[arg(long, env = "GPUMEDIC_STATUS_CONFIGMAP", default_value = gpumedic_remediator::control::STATUS_CONFIGMAP)]
    status_configmap: String,
    /// The topic of verdicts pushed live to open pages.
    #[arg(long, env = "GPUMEDIC_VERDICTS_TOPIC", default_value = topics::VERDICTS)]
    verdicts_topic: String,
    /// Each replica reads the verdict topic in a consumer group of its own, named this prefix and
    /// a random suffix, starting at the end of the topic (a live view, not a replay).
    #[arg(long, env = "GPUMEDIC_GROUP_PREFIX", default_value = "gpumedic-console")]
    group_prefix: String,
    #[command(flatten)]
    api_auth: gpumedic_runtime::api_auth::ApiAuthArgs,
    /// How often the fleet gauges (`gpumedic_console_fleet_*`) are recomputed from the caches.
    #[arg(long, env = "GPUMEDIC_FLEET_GAUGE_INTERVAL", default_value = "5s")]
    fleet_gauge_interval: String,
    /// A link to a verdict's trace, with `{trace_id}` where its id goes (Jaeger:
    /// `http://jaeger:16686/trace/{trace_id}`), shown on the incident page when OTLP is on. No
    /// links when empty.
    #[arg(long, env = "GPUMEDIC_TRACE_URL", default_value = "")]
    trace_url: String,
}

/// The validated configuration.
#[derive(Debug, Clone)]
pub struct Config {
    /// Shared service settings.
    pub common: CommonConfig,
    /// Kafka settings.
    pub kafka: KafkaSettings,
    /// The database URL.
    pub database_url: String,
    /// Connections in the pool.
    pub database_pool: u32,
    /// The GPU nodes shown.
    pub gpu_node_selector: String,
    /// The remediator's namespace.
    pub remediator_namespace: String,
    /// The remediator's status object.
    pub status_configmap: String,
    /// The verdict topic.
    pub verdicts_topic: String,
    /// The consumer group's prefix.
    pub group_prefix: String,
    /// How requests are authenticated.
    pub api_auth: api_auth::Settings,
    /// How often the fleet gauges are recomputed.
    pub fleet_gauge_interval: Duration,
    /// The trace link template (`{trace_id}` in it), when links are shown.
    pub trace_url: Option<String>,
}

impl Validate for Args {
    type Valid = Config;

    fn validate(self) -> Result<Config, Problems> {
        let mut p = Problems::default();
        let common = self.common.validate().map_err(|e| p.extend(e)).ok();
        let kafka = self.kafka.validate().map_err(|e| p.extend(e)).ok();
        postgres::check_database_flags(&mut p, &self.database_url, self.database_pool);
        if self.gpu_node_selector.trim().is_empty() {
            p.push("--gpu-node-selector", "must not be empty (the console would show every node as a GPU node)");
        }
        for (flag, v) in
            [("--remediator-namespace", &self.remediator_namespace), ("--status-configmap", &self.status_configmap)]
        {
            if v.is_empty()
                || v.len() > 253
                || !v.chars().all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || matches!(c, '-' | '.'))
            {
                p.push(flag, format!("'{v}' is not a Kubernetes object name"));
            }
        }
        if self.verdicts_topic.is_empty()
            || self.verdicts_topic.len() > 249
            || !self.verdicts_topic.chars().all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-'))
        {
            p.push(
                "--verdicts-topic",
                format!("'{}' is not a Kafka topic name ([a-zA-Z0-9._-], 1 to 249 characters)", self.verdicts_topic),
            );
        }
        if self.group_prefix.trim().is_empty() || self.group_prefix.len() > 200 {
            p.push("--group-prefix", "must be 1 to 200 characters");
        }
        let api_auth = self.api_auth.settings(&mut p);
        let gauge = p.check("--fleet-gauge-interval", parse_duration(&self.fleet_gauge_interval));
        if gauge.is_some_and(|d| d.is_zero()) {
            p.push("--fleet-gauge-interval", "must be more than 0");
        }
        let trace_url = match self.trace_url.trim() {
            "" => None,
            t if !(t.starts_with("http://") || t.starts_with("https://")) || !t.contains("{trace_id}") => {
                p.push("--trace-url", format!("{t:?} is not an http(s) URL with {{trace_id}} in it"));
                None
            }
            t => Some(t.to_owned()),
        };
        p.finish(|| Config {
            common: common.expect("checked"),
            kafka: kafka.expect("checked"),
            database_url: self.database_url,
            database_pool: self.database_pool,
            gpu_node_selector: self.gpu_node_selector,
            remediator_namespace: self.remediator_namespace,
            status_configmap: self.status_configmap,
            verdicts_topic: self.verdicts_topic,
            group_prefix: self.group_prefix,
            api_auth: api_auth.expect("checked"),
            fleet_gauge_interval: gauge.expect("checked"),
            trace_url,
        })
    }
}

#[cfg(test)]
mod tests {
    use gpumedic_runtime::config::{LoadError, load_from};

    use super::*;

    #[test]
    fn every_problem_is_listed_at_once() {
        let e = load_from::<Args, _, _>(
            "gpumedic-console",
            [
                "gpumedic-console",
                "--kafka-bootstrap",
                "127.0.0.1:19092",
                "--database-url",
                "mysql://x",
                "--api-auth",
                "open",
                "--verdicts-topic",
                "bad topic",
                "--remediator-namespace",
                "Gpumedic",
            ],
        )
        .expect_err("invalid");
        let LoadError::Invalid(text) = e else { panic!("not a validation error") };
        for flag in ["--database-url", "--api-auth", "--verdicts-topic", "--remediator-namespace"] {
            assert!(text.contains(flag), "{flag} missing from {text}");
        }
    }

    #[test]
    fn the_defaults_are_valid() {
        let c = load_from::<Args, _, _>(
            "gpumedic-console",
            ["gpumedic-console", "--kafka-bootstrap", "127.0.0.1:19092", "--database-url", "postgres://u@h/db"],
        )
        .expect("valid");
        assert_eq!(c.api_auth.mode, api_auth::Mode::Kubernetes);
        assert_eq!(c.gpu_node_selector, "nvidia.com/gpu.present=true");
        assert_eq!(c.verdicts_topic, topics::VERDICTS);
    }
}
