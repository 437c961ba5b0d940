//! Client settings: the Kafka flags every service shares ([`KafkaArgs`]), validated into
//! [`KafkaSettings`], and the producer and consumer made from them.

use std::sync::Arc;

use gpumedic_schemas::Codec;
use rdkafka::config::ClientConfig;
use rdkafka::consumer::Consumer as _;

use crate::admin::ReadyFlag;
use crate::config::{Problems, Validate};

use super::context::{Assignment, ServiceContext};
use super::{Consumer, KafkaError, Producer, register_consumer_metrics};

/// Kafka flags shared by every service.
#[derive(Debug, Clone, clap::Args)]
pub struct KafkaArgs {
    /// Kafka bootstrap servers, comma separated (host:port,...).
    #[arg(long, env = "GPUMEDIC_KAFKA_BOOTSTRAP")]
    pub kafka_bootstrap: String,

    /// Extra librdkafka properties as key=value, repeatable or comma separated: TLS, SASL and
    /// tuning, for example `security.protocol=SASL_SSL`.
    #[arg(long = "kafka-option", env = "GPUMEDIC_KAFKA_OPTIONS", value_delimiter = ',')]
    pub kafka_options: Vec<String>,

    /// A Confluent-compatible schema registry (for example `http://registry:8081`, or Apicurio's
    /// `.../apis/ccompat/v7`): this build's schemas are registered under `<topic>-value` at start
    /// and writer schemas resolve by id from it. Without it, ids resolve from the table embedded
    /// in gpumedic (docs/events.md).
    #[arg(long, env = "GPUMEDIC_SCHEMA_REGISTRY_URL")]
    pub schema_registry_url: Option<String>,

    /// Replication factor of the topics gpumedic creates when they are missing (inputs, outputs,
    /// dead-letter topics). Unset: 3, or the number of brokers when the cluster has fewer.
    #[arg(long, env = "GPUMEDIC_TOPIC_REPLICATION")]
    pub topic_replication: Option<i32>,
}

/// [`KafkaArgs`] validated.
#[derive(Debug, Clone)]
pub struct KafkaSettings {
    /// Bootstrap servers.
    pub bootstrap: String,
    /// Extra librdkafka properties, applied last.
    pub options: Vec<(String, String)>,
    /// The schema registry's URL, when one is used.
    pub schema_registry: Option<String>,
    /// `--topic-replication`: the replication factor of topics gpumedic creates, when given.
    pub topic_replication: Option<i32>,
}

impl Validate for KafkaArgs {
    type Valid = KafkaSettings;

    fn validate(self) -> Result<KafkaSettings, Problems> {
        let mut p = Problems::default();
        if self
            .kafka_bootstrap
            .split(',')
            .any(|s| s.trim().rsplit_once(':').is_none_or(|(h, port)| h.is_empty() || port.parse::<u16>().is_err()))
        {
            p.push(
                "--kafka-bootstrap",
                format!("'{}' must be a comma-separated list of host:port", self.kafka_bootstrap),
            );
        }
        let mut options = Vec::new();
        for raw in &self.kafka_options {
            match raw.split_once('=') {
                Some((k, v)) if !k.trim().is_empty() => options.push((k.trim().to_owned(), v.trim().to_owned())),
                _ => p.push("--kafka-option", format!("'{raw}' must be key=value")),
            }
        }
        if let Some(r) = self.topic_replication
            && !(1..=32).contains(&r)
        {
            p.push("--topic-replication", format!("{r} is not from 1 to 32"));
        }
        let schema_registry = self.schema_registry_url.filter(|u| !u.trim().is_empty());
        if let Some(url) = &schema_registry
            && !(url.starts_with("http://") || url.starts_with("https://"))
        {
            p.push("--schema-registry-url", format!("'{url}' must be an http:// or https:// URL"));
        }
        p.finish(|| KafkaSettings {
            bootstrap: self.kafka_bootstrap,
            options,
            schema_registry,
            topic_replication: self.topic_replication,
        })
    }
}

impl KafkaSettings {
    pub(super) fn client_config(&self, client_id: &str) -> ClientConfig {
        let mut c = ClientConfig::new();
        c.set("bootstrap.servers", &self.bootstrap).set("client.id", client_id);
        c
    }

    pub(super) fn apply_options(&self, c: &mut ClientConfig) {
        for (k, v) in self.options.iter() {
            c.set(k, v);
        }
    }

    /// The replication factor `--topic-replication` asks for, if it was given.
    pub fn topic_replication(&self) -> Option<i32> {
        self.topic_replication
    }
    /// A librdkafka configuration for a client of a tool (not a service loop): the bootstrap
    /// servers, `client_id`, then `properties`, then the operator's `--kafka-option`s, which win.
    pub fn client_config_with(&self, client_id: &str, properties: &[(&str, &str)]) -> ClientConfig {
        let mut c = self.client_config(client_id);
        for (k, v) in properties {
            c.set(*k, *v);
        }
        self.apply_options(&mut c);
        c
    }

    /// An idempotent producer that waits for all in-sync replicas, so an acknowledged record is
    /// durable and a retried one is not duplicated. It sends each record at once (`linger.ms`
    /// 0): the collectors, the classifier's verdicts and the remediator's outcomes are a few
    /// records at a time on a fault's path, where librdkafka's default of 5 ms would be added at
    /// every hop. Records queued while a request is in flight still go out together.
    pub fn producer(&self, client_id: &str) -> Result<Producer, KafkaError> {
        self.producer_lingering(client_id, "0")
    }

    /// As [`producer`](Self::producer), for a stage that produces whole batches of thousands of
    /// records at a time (the enricher): it waits up to a millisecond to fill its requests,
    /// which costs measurably less CPU per record than sending at once and a fifth of
    /// librdkafka's default wait (docs/benchmarks.md, fault to cordon).
    pub fn bulk_producer(&self, client_id: &str) -> Result<Producer, KafkaError> {
        self.producer_lingering(client_id, "1")
    }

    fn producer_lingering(&self, client_id: &str, linger_ms: &str) -> Result<Producer, KafkaError> {
        let mut c = self.client_config(client_id);
        c.set("acks", "all")
            .set("enable.idempotence", "true")
            .set("linger.ms", linger_ms)
            .set("compression.type", "lz4")
            .set("message.timeout.ms", "30000")
            // Named, not left to the default: the classifier finds a partition's nodes with
            // [`partition_for`], which must agree with how records were placed.
            .set("partitioner", "consistent_random");
        self.apply_options(&mut c);
        c.create().map_err(|source| KafkaError::Client { what: "producer", source })
    }

    /// A consumer in `group` subscribed to `topics`. Offsets are stored by [`run_consumer`] after
    /// each record's effect is durable and committed in the background; `assigned` turns ready
    /// once the group has given this consumer its partitions.
    pub fn consumer(
        &self,
        service: &'static str,
        group: &str,
        topics: &[&str],
        assigned: ReadyFlag,
    ) -> Result<Consumer, KafkaError> {
        self.consumer_tracking(service, group, topics, assigned, Assignment::default())
    }

    /// As [`consumer`](Self::consumer), keeping `assignment` current with every rebalance, for a
    /// service whose state is owned per partition.
    pub fn consumer_tracking(
        &self,
        service: &'static str,
        group: &str,
        topics: &[&str],
        assigned: ReadyFlag,
        assignment: Assignment,
    ) -> Result<Consumer, KafkaError> {
        let mut c = self.client_config(service);
        c.set("group.id", group)
            .set("enable.auto.commit", "true")
            .set("auto.commit.interval.ms", "1000")
            .set("enable.auto.offset.store", "false")
            .set("auto.offset.reset", "earliest")
            .set("statistics.interval.ms", "5000")
            .set("session.timeout.ms", "10000")
            // A topic created just before the subscription (by this service, or another during a
            // rollout) can be missing from the first metadata; librdkafka's default would leave
            // the consumer without it for five minutes.
            .set("topic.metadata.refresh.interval.ms", "10000");
        self.apply_options(&mut c);
        let consumer: Consumer = c
            .create_with_context(ServiceContext { service, assigned, assignment })
            .map_err(|source| KafkaError::Client { what: "consumer", source })?;
        consumer.subscribe(topics).map_err(|source| KafkaError::Subscribe {
            topics: topics.iter().map(|t| (*t).to_owned()).collect(),
            source,
        })?;
        register_consumer_metrics(service, topics);
        Ok(consumer)
    }

    /// The codec records are written and read with, for `--schema-registry-url`
    /// ([`crate::schema::codec`]): registry-backed when one is given, else the embedded table.
    pub async fn codec(&self) -> Result<Arc<Codec>, KafkaError> {
        crate::schema::codec(self.schema_registry.as_deref()).await.map_err(|source| KafkaError::SchemaRegistry {
            url: self.schema_registry.clone().unwrap_or_default(),
            source: Box::new(source),
        })
    }
}
