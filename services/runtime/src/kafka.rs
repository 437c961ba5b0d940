//! Kafka for every service: client settings, the producer, a consumer in a group, topic creation,
//! and the at-least-once consumer loop with a dead-letter topic.
//!
//! The loop stores a record's offset only after its handler returned, that is after the record's
//! effect is durable (the produced record acknowledged, the Postgres transaction committed); the
//! stored offsets are committed in the background, on every partition revoke and at shutdown. A
//! crash therefore redelivers at most the records whose effects were not yet confirmed, and every
//! handler must be safe to run twice. Records are handled one at a time per consumer, so the order
//! within a partition (one node's events) is kept.
//!
//! [`run_batch_consumer`] is the same contract a batch at a time, for stages that write in bulk:
//! a [`BatchHandler`] gets up to `max` records (or what arrives within `linger`), in consumption
//! order, and the offsets are stored only once the whole batch is durable.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
use rdkafka::client::{ClientContext, DefaultClientContext};
use rdkafka::config::ClientConfig;
use rdkafka::consumer::{BaseConsumer, CommitMode, Consumer as _, ConsumerContext, Rebalance, StreamConsumer};
use rdkafka::error::{KafkaError as RdKafkaError, RDKafkaErrorCode};
use rdkafka::message::{Header, Headers as _, OwnedHeaders};
use rdkafka::producer::{FutureProducer, FutureRecord};
use rdkafka::statistics::Statistics;
use tokio_util::sync::CancellationToken;
use tracing::Instrument as _;

use gpumedic_schemas::{Codec, RegistryOptions};

use crate::admin::ReadyFlag;
use crate::config::{Problems, Validate};
use crate::{BoxError, fault};

/// What went wrong talking to Kafka.
#[derive(Debug, thiserror::Error)]
pub enum KafkaError {
    /// A client could not be created from the configuration.
    #[error("cannot create the Kafka {what}: {source}")]
    Client {
        /// Which client.
        what: &'static str,
        /// librdkafka's error.
        source: RdKafkaError,
    },
    /// Subscribing to topics failed.
    #[error("cannot subscribe to {topics:?}: {source}")]
    Subscribe {
        /// The topics.
        topics: Vec<String>,
        /// librdkafka's error.
        source: RdKafkaError,
    },
    /// A topic could not be created.
    #[error("cannot create topic '{topic}': {reason}")]
    CreateTopic {
        /// The topic.
        topic: String,
        /// Why.
        reason: String,
    },
    /// Committing offsets at shutdown failed.
    #[error("cannot commit offsets: {0}")]
    Commit(#[source] RdKafkaError),
    /// The schema registry could not be used at start (unreachable, or it refused a schema).
    #[error("schema registry at {url}: {source}")]
    SchemaRegistry {
        /// The registry's URL.
        url: String,
        /// What went wrong.
        source: Box<gpumedic_schemas::RegistryStartError>,
    },
    /// Producing a record failed after librdkafka's own retries.
    #[error("cannot produce to '{topic}': {source}")]
    Produce {
        /// The topic.
        topic: String,
        /// librdkafka's error.
        source: RdKafkaError,
    },
}

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

/// A topic the service needs, created when missing (the cluster's auto-creation is off).
#[derive(Debug, Clone)]
pub struct TopicSpec {
    /// The topic name.
    pub name: String,
    /// Partitions; consumers in a group scale up to this many.
    pub partitions: i32,
    /// Replication factor; `None` for the settings' ([`KafkaSettings::topic_replication`]).
    pub replication: Option<i32>,
    /// Topic configuration set at creation, such as `max.message.bytes`.
    pub config: Vec<(String, String)>,
}

impl TopicSpec {
    /// A topic with `partitions` partitions, replicated as the settings say.
    pub fn new(name: impl Into<String>, partitions: i32) -> Self {
        Self { name: name.into(), partitions, replication: None, config: Vec::new() }
    }

    /// The same topic with replication factor `replication`, whatever the settings say.
    pub fn with_replication(mut self, replication: i32) -> Self {
        self.replication = Some(replication);
        self
    }

    /// The same topic with the topic configuration `key=value` set at creation.
    pub fn with_config(mut self, key: impl Into<String>, value: impl Into<String>) -> Self {
        self.config.push((key.into(), value.into()));
        self
    }

    /// The dead-letter topic that goes with `topic`.
    pub fn dead_letter_for(topic: &str, partitions: i32) -> Self {
        Self::new(dead_letter_topic(topic), partitions)
    }
}

/// The name of the dead-letter topic for `topic`.
pub fn dead_letter_topic(topic: &str) -> String {
    format!("{topic}.dlq")
}

/// The producer every service uses.
pub type Producer = FutureProducer;
/// The consumer every service uses.
pub type Consumer = StreamConsumer<ServiceContext>;

impl KafkaSettings {
    fn client_config(&self, client_id: &str) -> ClientConfig {
        let mut c = ClientConfig::new();
        c.set("bootstrap.servers", &self.bootstrap).set("client.id", client_id);
        c
    }

    fn apply_options(&self, c: &mut ClientConfig) {
        for (k, v) in self.options.iter() {
            c.set(k, v);
        }
    }

    /// The replication factor `--topic-replication` asks for, if it was given.
    pub fn topic_replication(&self) -> Option<i32> {
        self.topic_replication
    }

    /// The replication factor for topics created without one: `--topic-replication`, else 3 or
    /// the number of brokers when there are fewer (asked of the cluster now).
    pub async fn default_replication(&self) -> Result<i32, KafkaError> {
        if let Some(r) = self.topic_replication() {
            return Ok(r);
        }
        let c = self.client_config_with("gpumedic-admin", &[]);
        let brokers = tokio::task::spawn_blocking(move || {
            let consumer: BaseConsumer =
                c.create().map_err(|source| KafkaError::Client { what: "consumer", source })?;
            consumer
                .fetch_metadata(None, Duration::from_secs(10))
                .map(|m| m.brokers().len())
                .map_err(|source| KafkaError::Client { what: "metadata request", source })
        })
        .await
        .expect("the metadata task does not panic")?;
        Ok(replication_for(brokers, None))
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
    /// durable and a retried one is not duplicated.
    pub fn producer(&self, client_id: &str) -> Result<Producer, KafkaError> {
        let mut c = self.client_config(client_id);
        c.set("acks", "all")
            .set("enable.idempotence", "true")
            .set("linger.ms", "5")
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

    /// The codec records are written and read with: registry-backed when a schema registry is
    /// configured (this build's schemas are registered now, so a registry that is unreachable or
    /// refuses a schema stops the start with the reason), else the embedded schema table.
    pub async fn codec(&self) -> Result<Arc<Codec>, KafkaError> {
        let Some(url) = &self.schema_registry else { return Ok(Arc::new(Codec::embedded())) };
        let codec = Codec::with_registry(url, RegistryOptions::default())
            .await
            .map_err(|source| KafkaError::SchemaRegistry { url: url.clone(), source: Box::new(source) })?;
        if !codec.embedded_ids_readable() {
            tracing::warn!(%url, "Schema ids 1-4 in this registry are not gpumedic's schemas: records written without a registry cannot be read through it (docs/events.md).");
        }
        tracing::info!(%url, "Schemas registered; writer schemas resolve from the registry.");
        Ok(Arc::new(codec))
    }

    /// Creates the topics that do not exist yet; existing ones are left as they are. A topic
    /// without its own replication factor gets [`default_replication`](Self::default_replication),
    /// which is logged.
    pub async fn ensure_topics(&self, topics: &[TopicSpec]) -> Result<(), KafkaError> {
        let mut c = self.client_config("gpumedic-admin");
        self.apply_options(&mut c);
        let admin: AdminClient<DefaultClientContext> =
            c.create().map_err(|source| KafkaError::Client { what: "admin client", source })?;
        let default = if topics.iter().any(|t| t.replication.is_none()) {
            let r = self.default_replication().await?;
            let source = if self.topic_replication().is_some() { "--topic-replication" } else { "min(3, brokers)" };
            tracing::info!(replication = r, source, "Topics gpumedic creates get this replication factor.");
            r
        } else {
            1
        };
        let new: Vec<NewTopic<'_>> = topics
            .iter()
            .map(|t| {
                let mut n =
                    NewTopic::new(&t.name, t.partitions, TopicReplication::Fixed(t.replication.unwrap_or(default)));
                for (k, v) in &t.config {
                    n = n.set(k, v);
                }
                n
            })
            .collect();
        let opts = AdminOptions::new().operation_timeout(Some(Duration::from_secs(30)));
        let results = admin.create_topics(&new, &opts).await.map_err(|e| KafkaError::CreateTopic {
            topic: topics.iter().map(|t| t.name.as_str()).collect::<Vec<_>>().join(","),
            reason: e.to_string(),
        })?;
        for r in results {
            match r {
                Ok(_) | Err((_, RDKafkaErrorCode::TopicAlreadyExists)) => {}
                Err((topic, code)) => return Err(KafkaError::CreateTopic { topic, reason: code.to_string() }),
            }
        }
        Ok(())
    }

    /// Commits, for the new consumer group `group`, the current end of every partition of
    /// `topics`, so the group's members start exactly there: at records written after this call.
    /// `auto.offset.reset=latest` is not the same: the end is looked up only once a member has
    /// its partitions, so a record written between readiness and that lookup is skipped. A topic
    /// that does not exist yet is left out (the group reads it from the beginning).
    pub async fn start_group_at_end(&self, group: &str, topics: &[&str]) -> Result<(), KafkaError> {
        let c =
            self.client_config_with("gpumedic-group-start", &[("group.id", group), ("enable.auto.commit", "false")]);
        let topics: Vec<String> = topics.iter().map(|t| (*t).to_owned()).collect();
        tokio::task::spawn_blocking(move || {
            let consumer: BaseConsumer =
                c.create().map_err(|source| KafkaError::Client { what: "consumer", source })?;
            let timeout = Duration::from_secs(10);
            let mut ends = rdkafka::TopicPartitionList::new();
            for topic in &topics {
                for p in existing_partitions(&consumer, topic, timeout).map_err(KafkaError::Commit)? {
                    let (_, high) = consumer.fetch_watermarks(topic, p, timeout).map_err(KafkaError::Commit)?;
                    ends.add_partition_offset(topic, p, rdkafka::Offset::Offset(high)).map_err(KafkaError::Commit)?;
                }
            }
            if ends.count() > 0 {
                consumer.commit(&ends, CommitMode::Sync).map_err(KafkaError::Commit)?;
            }
            Ok(())
        })
        .await
        .expect("the offset commit does not panic")
    }
}

/// The replication factor for a new topic on a cluster of `brokers` brokers: `configured` when
/// given, else 3, or every broker when there are fewer (at least 1).
pub fn replication_for(brokers: usize, configured: Option<i32>) -> i32 {
    configured.unwrap_or_else(|| i32::try_from(brokers.clamp(1, 3)).unwrap_or(1))
}

/// The partitions of `topic` as the broker lists them; none when it does not exist yet.
pub(crate) fn existing_partitions<C: ConsumerContext>(
    consumer: &impl rdkafka::consumer::Consumer<C>,
    topic: &str,
    timeout: Duration,
) -> Result<Vec<i32>, RdKafkaError> {
    let metadata = consumer.fetch_metadata(Some(topic), timeout)?;
    Ok(metadata
        .topics()
        .iter()
        .filter(|t| t.name() == topic && t.error().is_none())
        .flat_map(|t| t.partitions().iter().map(|p| p.id()))
        .collect())
}

/// The consumer's context: readiness on assignment, a commit on revoke, lag in the metrics.
pub struct ServiceContext {
    service: &'static str,
    assigned: ReadyFlag,
    assignment: Assignment,
}

/// The partitions a consumer owns, as the last rebalance left them, with a generation that moves
/// on every change. Partitions leave it when revoked (before another consumer can take them) and
/// join it when assigned (before any of their records is polled).
#[derive(Debug, Clone, Default)]
pub struct Assignment {
    inner: Arc<std::sync::Mutex<(u64, Partitions)>>,
}

/// Owned `(topic, partition)` pairs.
type Partitions = std::collections::BTreeSet<(String, i32)>;

impl Assignment {
    /// The generation and the owned `(topic, partition)` pairs.
    pub fn snapshot(&self) -> (u64, Partitions) {
        self.inner.lock().expect("assignment lock").clone()
    }

    /// The owned partitions of `topic`, with the generation.
    pub fn of(&self, topic: &str) -> (u64, std::collections::BTreeSet<i32>) {
        let g = self.inner.lock().expect("assignment lock");
        (g.0, g.1.iter().filter(|(t, _)| t == topic).map(|(_, p)| *p).collect())
    }

    /// Adds `partitions` (a rebalance assigned them).
    pub fn add(&self, partitions: impl IntoIterator<Item = (String, i32)>) {
        let mut g = self.inner.lock().expect("assignment lock");
        g.0 += 1;
        g.1.extend(partitions);
    }

    /// Removes `partitions` (a rebalance revoked them).
    pub fn remove(&self, partitions: impl IntoIterator<Item = (String, i32)>) {
        let mut g = self.inner.lock().expect("assignment lock");
        g.0 += 1;
        for p in partitions {
            g.1.remove(&p);
        }
    }
}

/// The partition librdkafka's default partitioner (`consistent_random`) gives a record keyed
/// `key` on a topic of `partitions` partitions: the CRC-32 (IEEE, as zlib's) of the key modulo the
/// count. Every gpumedic producer uses that partitioner, so a consumer knows which nodes its
/// partitions carry without reading them.
pub fn partition_for(key: &[u8], partitions: i32) -> i32 {
    if partitions <= 0 {
        return 0;
    }
    let mut crc = !0u32;
    for &b in key {
        crc ^= u32::from(b);
        for _ in 0..8 {
            crc = if crc & 1 == 1 { (crc >> 1) ^ 0xEDB8_8320 } else { crc >> 1 };
        }
    }
    // A positive count below 2^31 fits both ways.
    ((!crc) % partitions.unsigned_abs()) as i32
}

impl ClientContext for ServiceContext {
    fn stats(&self, statistics: Statistics) {
        for (topic, t) in &statistics.topics {
            // librdkafka reports -1 for partitions it does not consume (and -1 for its internal
            // "unassigned" partition).
            let consumed = t.partitions.values().filter(|p| p.consumer_lag >= 0 && p.partition >= 0);
            let mut lag = 0i64;
            for p in consumed {
                lag += p.consumer_lag;
                metrics::gauge!(format!("gpumedic_{}_partition_lag", self.service), "topic" => topic.clone(),
                    "partition" => p.partition.to_string())
                .set(p.consumer_lag as f64);
            }
            metrics::gauge!(format!("gpumedic_{}_consumer_lag", self.service), "topic" => topic.clone())
                .set(lag as f64);
        }
    }
}

impl ConsumerContext for ServiceContext {
    fn pre_rebalance(&self, consumer: &BaseConsumer<Self>, rebalance: &Rebalance<'_>) {
        if let Rebalance::Revoke(tpl) = rebalance {
            // Flush what we have stored before another consumer takes the partitions over.
            match consumer.commit_consumer_state(CommitMode::Sync) {
                Ok(()) | Err(RdKafkaError::ConsumerCommit(RDKafkaErrorCode::NoOffset)) => {}
                Err(e) => {
                    tracing::warn!(error = %e, "Could not commit offsets on revoke; the next owner may see records again.")
                }
            }
            self.assignment.remove(tpl.elements().iter().map(|e| (e.topic().to_owned(), e.partition())));
            tracing::info!(partitions = tpl.count(), "Partitions revoked.");
        }
    }

    fn post_rebalance(&self, _consumer: &BaseConsumer<Self>, rebalance: &Rebalance<'_>) {
        match rebalance {
            Rebalance::Assign(tpl) => {
                self.assignment.add(tpl.elements().iter().map(|e| (e.topic().to_owned(), e.partition())));
                tracing::info!(partitions = tpl.count(), "Partitions assigned.");
                self.assigned.set(true);
            }
            Rebalance::Revoke(_) => {}
            Rebalance::Error(e) => tracing::warn!(error = %e, "Rebalance failed."),
        }
    }
}

/// One consumed record, owned, as handlers see it.
#[derive(Debug, Clone)]
pub struct Record {
    /// Its topic.
    pub topic: String,
    /// Its partition.
    pub partition: i32,
    /// Its offset.
    pub offset: i64,
    /// Its key (the node name on every gpumedic topic).
    pub key: Option<Vec<u8>>,
    /// Its value.
    pub payload: Option<Vec<u8>>,
    /// Its headers in order.
    pub headers: Vec<(String, Vec<u8>)>,
    /// Its timestamp in milliseconds since the epoch, when it has one.
    pub timestamp_ms: Option<i64>,
}

impl Record {
    /// The value of the first header named `name`.
    pub fn header(&self, name: &str) -> Option<&[u8]> {
        self.headers.iter().find(|(n, _)| n == name).map(|(_, v)| v.as_slice())
    }

    /// Copies a consumed message.
    pub fn from_message<M: rdkafka::Message>(m: &M) -> Self {
        let headers = m
            .headers()
            .map(|h| h.iter().map(|h| (h.key.to_owned(), h.value.map(<[u8]>::to_vec).unwrap_or_default())).collect())
            .unwrap_or_default();
        Record {
            topic: m.topic().to_owned(),
            partition: m.partition(),
            offset: m.offset(),
            key: m.key().map(<[u8]>::to_vec),
            payload: m.payload().map(<[u8]>::to_vec),
            headers,
            timestamp_ms: m.timestamp().to_millis(),
        }
    }
}

/// How a handler failed.
#[derive(Debug, thiserror::Error)]
pub enum HandleError {
    /// The record can never be processed (undecodable, invalid): it goes to the dead-letter topic
    /// with this reason, and the consumer moves on.
    #[error("invalid record: {0}")]
    Invalid(String),
    /// A dependency failed (database down, topic unavailable): the record is retried with backoff
    /// and its offset is not stored until it succeeds.
    #[error("transient failure: {0}")]
    Retry(#[source] BoxError),
}

/// Processes one record. Must be idempotent: after a crash the same record may come again.
pub trait RecordHandler: Send {
    /// Makes the record's effect durable, or says why it could not.
    fn handle(&mut self, record: &Record) -> impl Future<Output = Result<(), HandleError>> + Send;
}

/// Header names written on dead-lettered records.
pub mod dlq_headers {
    /// Why the record was dead-lettered.
    pub const REASON: &str = "gpumedic.dlq.reason";
    /// The service that gave up on it.
    pub const SERVICE: &str = "gpumedic.dlq.service";
    /// Where it came from: topic, partition and offset.
    pub const SOURCE_TOPIC: &str = "gpumedic.dlq.source.topic";
    /// The source partition.
    pub const SOURCE_PARTITION: &str = "gpumedic.dlq.source.partition";
    /// The source offset.
    pub const SOURCE_OFFSET: &str = "gpumedic.dlq.source.offset";
}

/// Publishes `record` to `<topic>.dlq` with the reason and its origin in headers; keeps key, value
/// and the original headers.
pub async fn dead_letter(producer: &Producer, service: &str, record: &Record, reason: &str) -> Result<(), KafkaError> {
    let topic = dead_letter_topic(&record.topic);
    let partition = record.partition.to_string();
    let offset = record.offset.to_string();
    let mut headers = OwnedHeaders::new_with_capacity(record.headers.len() + 5);
    for (k, v) in &record.headers {
        headers = headers.insert(Header { key: k, value: Some(v) });
    }
    for (k, v) in [
        (dlq_headers::REASON, reason),
        (dlq_headers::SERVICE, service),
        (dlq_headers::SOURCE_TOPIC, record.topic.as_str()),
        (dlq_headers::SOURCE_PARTITION, partition.as_str()),
        (dlq_headers::SOURCE_OFFSET, offset.as_str()),
    ] {
        headers = headers.insert(Header { key: k, value: Some(v) });
    }
    let mut fr: FutureRecord<'_, [u8], [u8]> = FutureRecord::to(&topic).headers(headers);
    if let Some(k) = &record.key {
        fr = fr.key(k.as_slice());
    }
    if let Some(p) = &record.payload {
        fr = fr.payload(p.as_slice());
    }
    producer
        .send(fr, Duration::from_secs(30))
        .await
        .map(|_| ())
        .map_err(|(source, _)| KafkaError::Produce { topic, source })
}

/// How often a handler may fail in the same permanent way ([`fault::is_permanent`]) before
/// [`run_consumer`] and [`keyed::run_keyed_consumer`](crate::keyed::run_keyed_consumer) give its
/// record to the dead-letter topic with the error; [`BatchLimits::poison_attempts`] for batches.
pub const DEFAULT_POISON_ATTEMPTS: u32 = 5;

/// How long a handler may run before the loop pauses the consumer's partitions and keeps polling
/// while it waits: librdkafka makes a member leave its group when it does not poll within
/// `max.poll.interval.ms` (5 minutes by default), and a long outage would then end in a
/// rebalance storm. A healthy batch takes far less, so the pause costs nothing in normal running.
pub const POLL_GRACE: Duration = Duration::from_secs(5);

/// Keeps a consumer polling while its loop waits on a slow or retrying handler. The assigned
/// partitions are paused, so polling serves rebalances, offset commits and the liveness check
/// without taking records; a record that still arrives (from a partition assigned meanwhile) is
/// kept in `early`, in order, for the loop to take next, and the assignment is paused again.
/// librdkafka fetches a resumed partition from the last record it handed out, so nothing is
/// skipped or read twice.
///
/// librdkafka keeps a partition's pause across a rebalance: one paused, revoked (a session that
/// timed out while the broker restarted) and assigned again stays paused. So the hold resumes
/// every partition it ever paused, not only those assigned when it resumes; otherwise the
/// consumer would sit ready with its partitions assigned and never fetch again.
pub(crate) struct Hold<'c> {
    consumer: &'c Consumer,
    /// Whether the assignment is paused.
    pub(crate) paused: bool,
    /// Every partition paused since the last resume, assigned now or not.
    paused_partitions: std::collections::BTreeSet<(String, i32)>,
    /// Records polled while paused, in order, for the loop to take first.
    pub(crate) early: std::collections::VecDeque<Record>,
}

impl<'c> Hold<'c> {
    pub(crate) fn new(consumer: &'c Consumer) -> Self {
        Self {
            consumer,
            paused: false,
            paused_partitions: std::collections::BTreeSet::new(),
            early: std::collections::VecDeque::new(),
        }
    }

    /// Pauses every assigned partition.
    pub(crate) fn pause(&mut self) {
        match self.consumer.assignment() {
            Ok(tpl) => match self.consumer.pause(&tpl) {
                Ok(()) => {
                    self.paused_partitions.extend(tpl.elements().iter().map(|e| (e.topic().to_owned(), e.partition())));
                    if !self.paused {
                        tracing::info!(
                            partitions = tpl.count(),
                            "Partitions paused while the handler waits; polling on."
                        );
                    }
                    self.paused = true;
                }
                Err(e) => tracing::warn!(error = %e, "Could not pause the partitions."),
            },
            Err(e) => tracing::warn!(error = %e, "Could not read the assignment to pause it."),
        }
    }

    /// Resumes the partitions if they were paused.
    pub(crate) fn resume(&mut self) {
        if !self.paused {
            return;
        }
        let resumed = self.consumer.assignment().and_then(|mut tpl| {
            // Those revoked meanwhile too: they stay paused in librdkafka when assigned again.
            for (topic, partition) in &self.paused_partitions {
                if tpl.find_partition(topic, *partition).is_none() {
                    tpl.add_partition(topic, *partition);
                }
            }
            self.consumer.resume(&tpl).map(|()| tpl.count())
        });
        match resumed {
            Ok(partitions) => {
                tracing::info!(partitions, "Partitions resumed.");
                self.paused = false;
                self.paused_partitions.clear();
            }
            Err(e) => {
                tracing::warn!(error = %e, "Could not resume the partitions; trying again after the next record.")
            }
        }
    }

    /// Polls with the partitions paused, for as long as the caller awaits it.
    async fn poll_paused(&mut self) -> std::convert::Infallible {
        if !self.paused {
            self.pause();
        }
        loop {
            match self.consumer.recv().await {
                Ok(m) => {
                    self.early.push_back(Record::from_message(&m));
                    self.pause();
                }
                Err(e) => tracing::warn!(error = %e, "Kafka consumer error while paused; continuing."),
            }
        }
    }

    /// Runs `work`, polling with paused partitions once it takes longer than [`POLL_GRACE`].
    async fn run<T>(&mut self, work: impl Future<Output = T>) -> T {
        tokio::pin!(work);
        if !self.paused {
            tokio::select! {
                biased;
                out = &mut work => return out,
                () = tokio::time::sleep(POLL_GRACE) => {}
            }
        }
        tokio::select! {
            biased;
            out = &mut work => out,
            never = self.poll_paused() => match never {},
        }
    }

    /// Waits `backoff` polling with paused partitions; `false` when `token` was cancelled first.
    async fn wait(&mut self, backoff: Duration, token: &CancellationToken) -> bool {
        tokio::select! {
            () = token.cancelled() => false,
            () = tokio::time::sleep(backoff) => true,
            never = self.poll_paused() => match never {},
        }
    }

    /// The next record: one kept while paused, else the next one polled; `None` when `token` was
    /// cancelled first.
    async fn next(&mut self, token: &CancellationToken) -> Option<Record> {
        if let Some(r) = self.early.pop_front() {
            return Some(r);
        }
        loop {
            let message = tokio::select! {
                () = token.cancelled() => return None,
                m = self.consumer.recv() => m,
            };
            match message {
                Ok(m) => return Some(Record::from_message(&m)),
                Err(e) => tracing::warn!(error = %e, "Kafka consumer error; continuing."),
            }
        }
    }
}

/// A record a handler failed on in the same permanent way too often: counted
/// (`gpumedic_<service>_poison_records_total`) and logged before it goes to the dead-letter topic.
fn report_poison(service: &'static str, record: &Record, attempts: u32, reason: &str) {
    metrics::counter!(format!("gpumedic_{service}_poison_records_total"), "topic" => record.topic.clone()).increment(1);
    tracing::warn!(topic = %record.topic, partition = record.partition, offset = record.offset, attempts, %reason,
        "The handler fails on this record the same way every time; it goes to the dead-letter topic.");
}

/// Registers, at zero, the consumer counters of `service` for each of its `topics`, so `/metrics`
/// names them before the first record is dead-lettered or retried: dashboards and alerts find
/// them, and `increase()` sees their first step.
fn register_consumer_metrics(service: &str, topics: &[&str]) {
    // Recorded into the exporter `/metrics` renders, however early the consumer is made.
    crate::admin::metrics_handle();
    metrics::counter!(format!("gpumedic_{service}_handler_retries_total")).increment(0);
    for topic in topics {
        let topic = (*topic).to_owned();
        for outcome in ["ok", "dead_lettered"] {
            metrics::counter!(format!("gpumedic_{service}_records_total"), "topic" => topic.clone(), "outcome" => outcome)
                .increment(0);
        }
        for name in ["dead_letters_failed_total", "poison_records_total"] {
            metrics::counter!(format!("gpumedic_{service}_{name}"), "topic" => topic.clone()).increment(0);
        }
    }
}

/// The at-least-once loop: receive, handle, store the offset; dead-letter invalid records; retry
/// transient failures with backoff, polling with the partitions paused meanwhile; dead-letter a
/// record whose handler fails in the same permanent way [`DEFAULT_POISON_ATTEMPTS`] times; on
/// cancellation finish the record in hand (unless it is waiting to be retried) and commit.
pub async fn run_consumer<H: RecordHandler>(
    service: &'static str,
    consumer: Consumer,
    dlq: Producer,
    mut handler: H,
    token: CancellationToken,
) -> Result<(), KafkaError> {
    let records_total = format!("gpumedic_{service}_records_total");
    let mut hold = Hold::new(&consumer);
    'records: loop {
        let Some(record) = hold.next(&token).await else { break };
        let mut backoff = Duration::from_millis(100);
        let mut permanent = 0u32;
        let span = record_span(service, &record);
        let started = std::time::Instant::now();
        loop {
            let refused = match hold.run(handler.handle(&record).instrument(span.clone())).await {
                Ok(()) => {
                    metrics::counter!(records_total.clone(), "topic" => record.topic.clone(), "outcome" => "ok")
                        .increment(1);
                    break;
                }
                Err(HandleError::Invalid(reason)) => Some(reason),
                Err(HandleError::Retry(e)) => {
                    metrics::counter!(format!("gpumedic_{service}_handler_retries_total")).increment(1);
                    if fault::is_permanent(e.as_ref()) {
                        permanent += 1;
                    }
                    if permanent >= DEFAULT_POISON_ATTEMPTS {
                        let reason = fault::error_chain(e.as_ref());
                        report_poison(service, &record, permanent, &reason);
                        Some(reason)
                    } else {
                        tracing::warn!(error = %e, topic = %record.topic, offset = record.offset, backoff_ms = backoff.as_millis() as u64, "Handler failed; retrying.");
                        None
                    }
                }
            };
            if let Some(reason) = refused {
                if !hold.run(dead_letter_until_done(&dlq, service, &record, &reason, &token)).await {
                    break 'records;
                }
                metrics::counter!(records_total.clone(), "topic" => record.topic.clone(), "outcome" => "dead_lettered")
                    .increment(1);
                break;
            }
            // Leave without storing the offset when cancelled: the record comes again after restart.
            if !hold.wait(backoff, &token).await {
                break 'records;
            }
            backoff = (backoff * 2).min(Duration::from_secs(30));
        }
        hold.resume();
        observe_latency(service, &record, started);
        // The effect is durable: the next start resumes after this record.
        // librdkafka commits the stored offset plus one: the next record to read.
        if let Err(e) = consumer.store_offset(&record.topic, record.partition, record.offset) {
            // Happens when the partition was revoked meanwhile; the new owner handles it again.
            tracing::warn!(error = %e, "Could not store an offset.");
        }
    }
    commit_stored(&consumer)
}

/// Writes `record` to its dead-letter topic, retrying with backoff until Kafka acknowledges it so
/// the record is never lost. When Kafka refuses it for good (too large for the dead-letter topic,
/// not authorized: [`fault::is_permanent`]) [`DEFAULT_POISON_ATTEMPTS`] times, it is given up
/// instead of blocking its partition:
/// counted in `gpumedic_<service>_dead_letters_failed_total` and logged as an error with its
/// coordinates. Returns `true` once the record is settled either way, `false` when `token` was
/// cancelled first (nothing stored).
pub(crate) async fn dead_letter_until_done(
    dlq: &Producer,
    service: &str,
    record: &Record,
    reason: &str,
    token: &CancellationToken,
) -> bool {
    tracing::warn!(topic = %record.topic, partition = record.partition, offset = record.offset, %reason, "Record is invalid; sending it to the dead-letter topic.");
    let mut dlq_backoff = Duration::from_millis(100);
    let mut permanent = 0u32;
    loop {
        let e = match dead_letter(dlq, service, record, reason).await {
            Ok(()) => return true,
            Err(e) => e,
        };
        // Kafka refuses a whole produce request at once: a record sent beside a refused one
        // shares its error. Tried again after a jittered pause, it goes alone or with others.
        if fault::is_permanent(&e) {
            permanent += 1;
            if permanent >= DEFAULT_POISON_ATTEMPTS {
                metrics::counter!(format!("gpumedic_{service}_dead_letters_failed_total"), "topic" => record.topic.clone())
                    .increment(1);
                let key = record.key.as_deref().map(String::from_utf8_lossy).unwrap_or_default();
                tracing::error!(error = %e, topic = %record.topic, partition = record.partition, offset = record.offset,
                    key = %key, %reason, "The dead-letter topic refuses the record for good; it is given up and its offset committed.");
                return true;
            }
            tracing::warn!(error = %e, topic = %record.topic, offset = record.offset, attempt = permanent,
                "The dead-letter topic refuses the record; trying again before giving it up.");
            let pause = dlq_backoff + Duration::from_millis(fastrand::u64(0..100));
            tokio::select! {
                () = token.cancelled() => return false,
                () = tokio::time::sleep(pause) => {}
            }
            dlq_backoff = (dlq_backoff * 2).min(Duration::from_secs(30));
            continue;
        }
        tracing::error!(error = %e, "Cannot write to the dead-letter topic; retrying so the record is not lost.");
        tokio::select! {
            () = token.cancelled() => return false,
            () = tokio::time::sleep(dlq_backoff) => {}
        }
        dlq_backoff = (dlq_backoff * 2).min(Duration::from_secs(30));
    }
}

/// Commits the stored offsets synchronously (at shutdown); having nothing to commit is fine.
pub(crate) fn commit_stored(consumer: &Consumer) -> Result<(), KafkaError> {
    match consumer.commit_consumer_state(CommitMode::Sync) {
        Ok(()) | Err(RdKafkaError::ConsumerCommit(RDKafkaErrorCode::NoOffset)) => Ok(()),
        Err(e) => Err(KafkaError::Commit(e)),
    }
}

/// Decodes a record's payload with `codec` for a [`RecordHandler`]: a bad record is
/// [`HandleError::Invalid`] (dead-lettered with the reason), an unreachable schema registry is
/// [`HandleError::Retry`] (the record is probably fine).
pub async fn decode_payload<T: gpumedic_schemas::Record>(codec: &Codec, record: &Record) -> Result<T, HandleError> {
    let payload = record.payload.as_deref().ok_or_else(|| HandleError::Invalid("empty record".into()))?;
    codec.decode(payload).await.map_err(|e| {
        if e.is_transient() {
            HandleError::Retry(Box::new(e))
        } else {
            HandleError::Invalid(format!("{}: {e}", e.reason()))
        }
    })
}

/// What became of one record of a batch, as its [`BatchHandler`] decided.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Disposition {
    /// Its effect is durable.
    Done,
    /// It can never be processed: it goes to the dead-letter topic with this reason.
    DeadLetter(String),
}

/// Processes records a batch at a time, for stages whose effects are cheaper in bulk (one
/// database round trip for many records). Must be idempotent: after a crash, or when the batch
/// failed, the same records come again.
pub trait BatchHandler: Send {
    /// Makes the effects of `records` durable and returns one [`Disposition`] per record, in
    /// order; or fails the whole batch, in which case the same batch is offered again after a
    /// backoff and no offset is stored. An error about the records themselves (wrapped in
    /// [`fault::RecordFault`], or one [`fault::is_permanent`] knows, such as a value Postgres
    /// refuses) is retried a bounded number of times, then the records are offered one at a time
    /// and the one at fault is dead-lettered with the error; any other error is taken for an
    /// outage and retried without limit.
    fn handle_batch(&mut self, records: &[Record]) -> impl Future<Output = Result<Vec<Disposition>, BoxError>> + Send;
}

/// How [`run_batch_consumer`] cuts batches.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BatchSettings {
    /// At most this many records in a batch.
    pub max: usize,
    /// How long to wait for more records once the first of a batch has arrived.
    pub linger: Duration,
    /// The byte bound and the poison-record rule, shared by every batching stage.
    pub limits: BatchLimits,
}

impl BatchSettings {
    /// Batches of at most `max` records gathered within `linger`, with the default [`BatchLimits`].
    pub fn new(max: usize, linger: Duration) -> Self {
        Self { max, linger, limits: BatchLimits::default() }
    }
}

/// The limits of [`BatchSettings`] every batching stage shares (`--batch-max-bytes`,
/// `--poison-attempts`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BatchLimits {
    /// At most this many bytes (keys, values and headers) in a batch; a single larger record is a
    /// batch of its own.
    pub max_bytes: usize,
    /// A batch failing this many times with a permanent error ([`fault::is_permanent`]) is
    /// handled one record at a time, and a record failing alone that way is dead-lettered.
    pub poison_attempts: u32,
}

/// The default of `--batch-max-bytes`: 16 MiB, far above a full batch of gpumedic records
/// (thousands of records of a few hundred bytes each), so it bounds memory against unusually
/// large records without cutting normal batches. No stage produces a batch as one Kafka record,
/// so the broker's 1 MiB message limit does not apply to it.
pub const DEFAULT_BATCH_MAX_BYTES: usize = 16 * 1024 * 1024;

impl Default for BatchLimits {
    fn default() -> Self {
        Self { max_bytes: DEFAULT_BATCH_MAX_BYTES, poison_attempts: DEFAULT_POISON_ATTEMPTS }
    }
}

/// Flags for [`BatchLimits`], flattened into the arguments of a batching service.
#[derive(Debug, Clone, clap::Args)]
pub struct BatchLimitArgs {
    /// Most bytes (keys, values and headers) in one batch; a larger record is a batch of its own.
    #[arg(long, env = "GPUMEDIC_BATCH_MAX_BYTES", default_value_t = DEFAULT_BATCH_MAX_BYTES)]
    pub batch_max_bytes: usize,
    /// How often a batch may fail with an error about its records (a value Postgres refuses, a
    /// record too large for Kafka) before its records are handled one at a time and the one at
    /// fault goes to the dead-letter topic. Outages are retried without limit.
    #[arg(long, env = "GPUMEDIC_POISON_ATTEMPTS", default_value_t = DEFAULT_POISON_ATTEMPTS)]
    pub poison_attempts: u32,
}

impl Validate for BatchLimitArgs {
    type Valid = BatchLimits;

    fn validate(self) -> Result<BatchLimits, Problems> {
        let mut p = Problems::default();
        if self.batch_max_bytes < 1024 {
            p.push("--batch-max-bytes", format!("{} is below 1024", self.batch_max_bytes));
        }
        if !(1..=100).contains(&self.poison_attempts) {
            p.push("--poison-attempts", format!("{} is not from 1 to 100", self.poison_attempts));
        }
        p.finish(|| BatchLimits { max_bytes: self.batch_max_bytes, poison_attempts: self.poison_attempts })
    }
}

/// The bytes a record takes in a batch.
fn record_bytes(r: &Record) -> usize {
    r.key.as_ref().map_or(0, Vec::len)
        + r.payload.as_ref().map_or(0, Vec::len)
        + r.headers.iter().map(|(k, v)| k.len() + v.len()).sum::<usize>()
}

/// Offers `records` to `handler` until it succeeds: `Some(Ok)` with its dispositions, or
/// `Some(Err(reason))` once it failed `attempts` times with a permanent error; transient errors
/// are retried with backoff without limit (polling with paused partitions). `None` when `token`
/// was cancelled during a backoff.
async fn settle_batch<H: BatchHandler>(
    service: &'static str,
    handler: &mut H,
    records: &[Record],
    attempts: u32,
    hold: &mut Hold<'_>,
    token: &CancellationToken,
) -> Option<Result<Vec<Disposition>, String>> {
    let mut backoff = Duration::from_millis(100);
    let mut permanent = 0u32;
    loop {
        let e = match hold.run(handler.handle_batch(records)).await {
            Ok(d) => return Some(Ok(d)),
            Err(e) => e,
        };
        metrics::counter!(format!("gpumedic_{service}_handler_retries_total")).increment(1);
        if fault::is_permanent(e.as_ref()) {
            permanent += 1;
            if permanent >= attempts {
                return Some(Err(fault::error_chain(e.as_ref())));
            }
            tracing::warn!(error = %e, records = records.len(), attempt = permanent, backoff_ms = backoff.as_millis() as u64, "Batch handler failed on the records themselves; retrying the batch.");
        } else {
            tracing::warn!(error = %e, records = records.len(), backoff_ms = backoff.as_millis() as u64, "Batch handler failed; retrying the batch.");
        }
        // Leave without storing offsets: the batch comes again after restart.
        if !hold.wait(backoff, token).await {
            return None;
        }
        backoff = (backoff * 2).min(Duration::from_secs(30));
    }
}

/// The at-least-once loop, a batch at a time: gather up to `batch.max` records and
/// `batch.limits.max_bytes` bytes (or what arrives within `batch.linger` of the first), in
/// consumption order, so each partition's order is kept; hand them to `handler`; dead-letter the
/// records it refused and wait for Kafka to acknowledge them; and only then store each
/// partition's highest offset. A batch that fails with a transient error is retried whole with
/// backoff and nothing is stored; one that fails with a permanent error
/// ([`fault::is_permanent`]) `batch.limits.poison_attempts` times is handled one record at a
/// time, and a record failing alone that way is dead-lettered with the error. While a handler is
/// slow or retrying, the partitions are paused and the consumer keeps polling, so the group
/// keeps it. On cancellation the batch in hand is finished (unless it is waiting to be retried)
/// and the stored offsets are committed, as [`run_consumer`] does.
pub async fn run_batch_consumer<H: BatchHandler>(
    service: &'static str,
    consumer: Consumer,
    dlq: Producer,
    mut handler: H,
    batch: BatchSettings,
    token: CancellationToken,
) -> Result<(), KafkaError> {
    let records_total = format!("gpumedic_{service}_records_total");
    let batches_total = format!("gpumedic_{service}_batches_total");
    let batch_seconds = format!("gpumedic_{service}_batch_seconds");
    let max = batch.max.max(1);
    let max_bytes = batch.limits.max_bytes;
    let attempts = batch.limits.poison_attempts.max(1);
    let mut hold = Hold::new(&consumer);
    let mut records: Vec<Record> = Vec::with_capacity(max);
    'batches: loop {
        records.clear();
        let Some(first) = hold.next(&token).await else { break };
        let mut bytes = record_bytes(&first);
        records.push(first);
        let deadline = tokio::time::Instant::now() + batch.linger;
        while records.len() < max && bytes < max_bytes {
            let next = match hold.early.pop_front() {
                Some(r) => r,
                None => match tokio::time::timeout_at(deadline, consumer.recv()).await {
                    Err(_) => break,
                    Ok(Ok(m)) => Record::from_message(&m),
                    Ok(Err(e)) => {
                        tracing::warn!(error = %e, "Kafka consumer error; continuing.");
                        continue;
                    }
                },
            };
            let size = record_bytes(&next);
            if bytes + size > max_bytes {
                // It starts the next batch, ahead of anything polled later.
                hold.early.push_front(next);
                break;
            }
            bytes += size;
            records.push(next);
        }
        let started = std::time::Instant::now();
        let dispositions = match settle_batch(service, &mut handler, &records, attempts, &mut hold, &token).await {
            None => break 'batches,
            Some(Ok(d)) => d,
            Some(Err(reason)) if records.len() == 1 => {
                report_poison(service, &records[0], attempts, &reason);
                vec![Disposition::DeadLetter(reason)]
            }
            Some(Err(reason)) => {
                tracing::warn!(records = records.len(), attempts, %reason, "The batch fails the same way every time; handling its records one at a time to find the ones at fault.");
                let mut d = Vec::with_capacity(records.len());
                for r in &records {
                    match settle_batch(service, &mut handler, std::slice::from_ref(r), 1, &mut hold, &token).await {
                        None => break 'batches,
                        Some(Ok(one)) => d.extend(one),
                        Some(Err(reason)) => {
                            report_poison(service, r, attempts, &reason);
                            d.push(Disposition::DeadLetter(reason));
                        }
                    }
                }
                d
            }
        };
        assert_eq!(dispositions.len(), records.len(), "a batch handler must return one disposition per record");
        // Counted per topic and outcome, then added once each: a counter looked up per record was
        // a visible cost at tens of thousands of records a second (docs/profiles.md).
        let mut counts: Vec<(&str, &'static str, u64)> = Vec::new();
        for (record, disposition) in records.iter().zip(&dispositions) {
            let outcome = match disposition {
                Disposition::Done => "ok",
                Disposition::DeadLetter(reason) => {
                    if !hold.run(dead_letter_until_done(&dlq, service, record, reason, &token)).await {
                        break 'batches;
                    }
                    "dead_lettered"
                }
            };
            match counts.iter_mut().find(|(t, o, _)| *t == record.topic && *o == outcome) {
                Some(c) => c.2 += 1,
                None => counts.push((&record.topic, outcome, 1)),
            }
        }
        for (topic, outcome, n) in counts {
            metrics::counter!(records_total.clone(), "topic" => topic.to_owned(), "outcome" => outcome).increment(n);
        }
        metrics::counter!(batches_total.clone()).increment(1);
        metrics::histogram!(batch_seconds.clone()).record(started.elapsed().as_secs_f64());
        // Every effect of the batch is durable: store each partition's highest offset (records
        // of one partition arrive in order, so the last one seen is the highest).
        let mut highest: Vec<(&str, i32, i64)> = Vec::new();
        for r in &records {
            match highest.iter_mut().find(|(t, p, _)| *t == r.topic && *p == r.partition) {
                Some(h) => h.2 = h.2.max(r.offset),
                None => highest.push((&r.topic, r.partition, r.offset)),
            }
        }
        for (topic, partition, offset) in highest {
            // librdkafka commits the stored offset plus one: the next record to read.
            if let Err(e) = consumer.store_offset(topic, partition, offset) {
                // Happens when the partition was revoked meanwhile; the new owner handles it again.
                tracing::warn!(error = %e, topic, partition, "Could not store an offset.");
            }
        }
        hold.resume();
    }
    commit_stored(&consumer)
}

/// Records how long `record` took to handle (`gpumedic_<service>_record_seconds`, retries
/// included) and how old it was when its effect became durable
/// (`gpumedic_<service>_record_age_seconds`, from its Kafka timestamp: the pipeline's latency up to
/// this stage).
pub(crate) fn observe_latency(service: &'static str, record: &Record, started: std::time::Instant) {
    metrics::histogram!(format!("gpumedic_{service}_record_seconds"), "topic" => record.topic.clone())
        .record(started.elapsed().as_secs_f64());
    if let Some(ts) = record.timestamp_ms {
        let age_ms = chrono_now_ms().saturating_sub(ts).max(0);
        metrics::histogram!(format!("gpumedic_{service}_record_age_seconds"), "topic" => record.topic.clone())
            .record(age_ms as f64 / 1000.0);
    }
}

fn chrono_now_ms() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX))
}

/// Header names every gpumedic record carries (see docs/events.md).
pub mod record_headers {
    /// W3C trace context.
    pub const TRACEPARENT: &str = "traceparent";
    /// The record's id as text (event id, or verdict id).
    pub const EVENT_ID: &str = "gpumedic.event-id";
    /// The record's media type.
    pub const CONTENT_TYPE: &str = "content-type";
    /// On a raw health record: the producing collector's projected ServiceAccount token (audience
    /// `gpumedic`), bound to its Pod and so to its node. The enricher verifies it against the
    /// record's node (docs/security.md).
    pub const NODE_TOKEN: &str = "gpumedic.node-token";
}

/// The OpenTelemetry context a `traceparent` header carries, if it is a valid one.
fn parent_context(traceparent: Option<&[u8]>) -> Option<opentelemetry::Context> {
    use opentelemetry::propagation::TextMapPropagator as _;
    use opentelemetry::trace::TraceContextExt as _;

    let tp = std::str::from_utf8(traceparent?).ok()?;
    let carrier = std::collections::HashMap::from([("traceparent".to_owned(), tp.to_owned())]);
    let cx = opentelemetry_sdk::propagation::TraceContextPropagator::new().extract(&carrier);
    cx.span().span_context().is_valid().then_some(cx)
}

/// A span for handling `record`, a child of the trace its `traceparent` header carries, so one
/// fault is one trace across the services (when tracing export is on; otherwise a plain span).
pub fn record_span(service: &'static str, record: &Record) -> tracing::Span {
    use tracing_opentelemetry::OpenTelemetrySpanExt as _;

    let span = tracing::info_span!("handle_record", service, topic = %record.topic, partition = record.partition,
        offset = record.offset);
    if let Some(cx) = parent_context(record.header(record_headers::TRACEPARENT)) {
        let _ = span.set_parent(cx);
    }
    span
}

/// The `traceparent` for a record produced now. With tracing export on, it names a new `publish`
/// span: a child of the record being handled (`incoming`) when there is one, else of the current
/// span, so each service adds its span to the fault's trace. With export off, the incoming trace
/// is continued with a new span id, or a new trace is started. Every record thus carries one, and
/// one fault keeps one trace id.
pub fn traceparent(incoming: Option<&[u8]>) -> String {
    use opentelemetry::propagation::TextMapPropagator as _;
    use opentelemetry::trace::TraceContextExt as _;
    use tracing_opentelemetry::OpenTelemetrySpanExt as _;

    let span = tracing::info_span!("publish");
    if let Some(cx) = parent_context(incoming) {
        let _ = span.set_parent(cx);
    }
    let cx = span.context();
    if cx.span().span_context().is_valid() {
        let mut carrier = std::collections::HashMap::new();
        opentelemetry_sdk::propagation::TraceContextPropagator::new().inject_context(&cx, &mut carrier);
        if let Some(tp) = carrier.remove("traceparent") {
            return tp;
        }
    }
    // Ids from a thread-local generator: a UUID per record cost a getrandom system call each
    // (docs/profiles.md). Zero is not a valid id.
    let span_id = fastrand::u64(1..);
    let trace_id = incoming
        .and_then(|v| std::str::from_utf8(v).ok())
        .and_then(|tp| {
            let mut parts = tp.split('-');
            let trace_id = parts.nth(1)?;
            (parts.count() == 2 && trace_id.len() == 32 && trace_id.bytes().all(|b| b.is_ascii_hexdigit()))
                .then(|| trace_id.to_owned())
        })
        .unwrap_or_else(|| format!("{:032x}", fastrand::u128(1..)));
    format!("00-{trace_id}-{span_id:016x}-01")
}

/// Produces one record and waits until Kafka acknowledged it (`acks=all`): when this returns
/// `Ok`, the record is durable and the caller may store its input offset.
pub async fn publish(
    producer: &Producer,
    topic: &str,
    key: &str,
    payload: &[u8],
    headers: &[(&str, &[u8])],
) -> Result<(), KafkaError> {
    let mut owned = OwnedHeaders::new_with_capacity(headers.len());
    for (k, v) in headers {
        owned = owned.insert(Header { key: k, value: Some(*v) });
    }
    producer
        .send(FutureRecord::to(topic).key(key).payload(payload).headers(owned), Duration::from_secs(30))
        .await
        .map(|_| ())
        .map_err(|(source, _)| KafkaError::Produce { topic: topic.to_owned(), source })
}

/// Whether `topic` exists on the cluster (asked of the producer's connection). Publishing to a
/// missing topic would only time out after `message.timeout.ms`, since auto-creation is off.
pub async fn topic_exists(producer: &Producer, topic: &str) -> Result<bool, KafkaError> {
    use rdkafka::producer::Producer as _;
    let client = producer.clone();
    let topic = topic.to_owned();
    tokio::task::spawn_blocking(move || {
        client
            .client()
            .fetch_metadata(Some(&topic), Duration::from_secs(10))
            .map(|m| m.topics().iter().any(|t| t.name() == topic && t.error().is_none() && !t.partitions().is_empty()))
    })
    .await
    .expect("metadata task")
    .map_err(|source| KafkaError::Client { what: "metadata request", source })
}

/// Where a pipeline record goes and what its standard headers say.
#[derive(Debug, Clone, Copy)]
pub struct Envelope<'a> {
    /// The topic.
    pub topic: &'a str,
    /// The key: the node name on every gpumedic topic.
    pub key: &'a str,
    /// The record's id (`gpumedic.event-id`).
    pub id: &'a str,
    /// The record's media type (`content-type`).
    pub content_type: &'a str,
    /// The `traceparent` of the record being handled, continued by this one.
    pub incoming_trace: Option<&'a [u8]>,
}

/// Publishes a pipeline record with the headers every gpumedic record carries (`traceparent`,
/// `gpumedic.event-id`, `content-type`) and waits for Kafka's acknowledgement.
pub async fn publish_record(producer: &Producer, envelope: Envelope<'_>, payload: &[u8]) -> Result<(), KafkaError> {
    let tp = traceparent(envelope.incoming_trace);
    publish(
        producer,
        envelope.topic,
        envelope.key,
        payload,
        &[
            (record_headers::TRACEPARENT, tp.as_bytes()),
            (record_headers::EVENT_ID, envelope.id.as_bytes()),
            (record_headers::CONTENT_TYPE, envelope.content_type.as_bytes()),
        ],
    )
    .await
}

/// Creates `topics` (and waits for Kafka) with backoff until it succeeds or `token` is cancelled.
/// Returns `false` when cancelled first. A service that starts before Kafka stays unready rather
/// than crash-looping.
pub async fn wait_for_topics(settings: &KafkaSettings, topics: &[TopicSpec], token: &CancellationToken) -> bool {
    let mut backoff = Duration::from_millis(200);
    loop {
        match settings.ensure_topics(topics).await {
            Ok(()) => return true,
            Err(e) => {
                tracing::warn!(error = %e, retry_in_ms = backoff.as_millis() as u64, "Kafka is not ready; retrying.")
            }
        }
        tokio::select! {
            () = token.cancelled() => return false,
            () = tokio::time::sleep(backoff) => {}
        }
        backoff = (backoff * 2).min(Duration::from_secs(10));
    }
}

/// The topics a consuming stage needs: its inputs, their dead-letter topics, and its outputs.
pub fn stage_topics(inputs: &[&str], outputs: &[&str], partitions: i32) -> Vec<TopicSpec> {
    let mut specs: Vec<TopicSpec> = Vec::new();
    for t in inputs {
        specs.push(TopicSpec::new(*t, partitions));
        specs.push(TopicSpec::dead_letter_for(t, partitions));
    }
    for t in outputs {
        specs.push(TopicSpec::new(*t, partitions));
    }
    specs
}

/// A handler for a stage whose processing is not deployed yet: every record goes to the
/// dead-letter topic with `reason`, so nothing is lost and the records can be replayed once it is.
#[derive(Debug, Clone)]
pub struct DeadLetterAll {
    /// Written as the dead-letter reason.
    pub reason: String,
}

impl RecordHandler for DeadLetterAll {
    async fn handle(&mut self, _record: &Record) -> Result<(), HandleError> {
        Err(HandleError::Invalid(self.reason.clone()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(bootstrap: &str, options: &[&str]) -> KafkaArgs {
        KafkaArgs {
            kafka_bootstrap: bootstrap.to_owned(),
            kafka_options: options.iter().map(|s| (*s).to_owned()).collect(),
            schema_registry_url: None,
            topic_replication: None,
        }
    }

    #[test]
    fn a_schema_registry_url_must_be_http() {
        let mut a = args("k:9092", &[]);
        a.schema_registry_url = Some("registry:8081".into());
        assert!(a.validate().unwrap_err().list().iter().any(|p| p.field == "--schema-registry-url"));
        let mut a = args("k:9092", &[]);
        a.schema_registry_url = Some("http://registry:8081".into());
        assert_eq!(a.validate().unwrap().schema_registry.as_deref(), Some("http://registry:8081"));
        let mut a = args("k:9092", &[]);
        a.schema_registry_url = Some(String::new());
        assert_eq!(a.validate().unwrap().schema_registry, None);
    }

    #[test]
    fn settings_validate_bootstrap_and_options() {
        let ok = args("127.0.0.1:19092,kafka-1:9092", &["security.protocol=SSL"]).validate().expect("valid");
        assert_eq!(ok.options, vec![("security.protocol".to_owned(), "SSL".to_owned())]);
        let err = args("localhost", &["novalue", "=x"]).validate().expect_err("invalid");
        assert_eq!(err.list().len(), 3, "{:?}", err.list());
    }

    #[test]
    fn traceparent_continues_the_incoming_trace() {
        let incoming = b"00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
        let tp = traceparent(Some(incoming));
        assert!(tp.starts_with("00-4bf92f3577b34da6a3ce929d0e0e4736-"), "{tp}");
        assert_ne!(tp.as_bytes(), incoming, "a new span id");
        let fresh = traceparent(None);
        assert_eq!(fresh.len(), 55, "{fresh}");
        assert_ne!(traceparent(Some(b"garbage")).split('-').nth(1), Some("garbage"));
    }

    #[test]
    fn partition_for_is_the_crc32_of_the_key_modulo_the_count() {
        // CRC-32 reference values (zlib): "" -> 0, "123456789" -> 0xCBF43926.
        assert_eq!(partition_for(b"", 12), 0);
        assert_eq!(partition_for(b"123456789", i32::MAX), (0xCBF4_3926u32 % i32::MAX as u32) as i32);
        assert_eq!(partition_for(b"123456789", 12), (0xCBF4_3926u32 % 12) as i32);
        assert_eq!(partition_for(b"node", 0), 0, "no partitions: no panic");
    }

    /// Against the testbed's Kafka: the partitions records land on are the ones [`partition_for`]
    /// names, so a consumer knows its partitions' nodes.
    #[tokio::test]
    async fn records_land_where_partition_for_says() {
        let bootstrap = crate::testbed::require_kafka().await.unwrap_or_else(|e| panic!("{e}"));
        let settings = KafkaSettings { bootstrap, options: vec![], schema_registry: None, topic_replication: None };
        let topic = crate::testbed::unique_name("partition-for");
        settings.ensure_topics(&[TopicSpec::new(topic.clone(), 12)]).await.expect("topic");
        let producer = settings.producer("partition-for-test").expect("producer");
        for i in 0..64 {
            let key = format!("gpu-node-{i:04}.cluster.example");
            let delivery = producer
                .send(FutureRecord::to(&topic).key(&key).payload("x"), Duration::from_secs(30))
                .await
                .map_err(|(e, _)| e)
                .expect("delivered");
            assert_eq!(delivery.partition, partition_for(key.as_bytes(), 12), "{key}");
        }
    }

    /// The (partition, offset) of each record of each batch offered, in order.
    type Seen = std::sync::Arc<std::sync::Mutex<Vec<Vec<(i32, i64)>>>>;

    /// Records every batch it is offered; fails the first one once; dead-letters `bad` payloads.
    struct Recorder {
        seen: Seen,
        failed_once: bool,
    }

    impl BatchHandler for Recorder {
        async fn handle_batch(&mut self, records: &[Record]) -> Result<Vec<Disposition>, BoxError> {
            self.seen.lock().unwrap().push(records.iter().map(|r| (r.partition, r.offset)).collect());
            if !self.failed_once {
                self.failed_once = true;
                return Err("the database is down".into());
            }
            Ok(records
                .iter()
                .map(|r| match r.payload.as_deref() {
                    Some(b"bad") => Disposition::DeadLetter("bad payload".into()),
                    _ => Disposition::Done,
                })
                .collect())
        }
    }

    /// Against the testbed's Kafka: batches are bounded, keep each partition's order, a failed
    /// batch comes again whole, refused records reach the dead-letter topic, and the offsets
    /// committed at shutdown are the ends of the partitions.
    #[tokio::test]
    async fn batch_consumer_retries_whole_batches_and_commits_after_them() {
        use rdkafka::TopicPartitionList;
        let bootstrap = crate::testbed::require_kafka().await.unwrap_or_else(|e| panic!("{e}"));
        let settings = KafkaSettings { bootstrap, options: vec![], schema_registry: None, topic_replication: None };
        let topic = crate::testbed::unique_name("batch");
        let group = crate::testbed::unique_name("batch");
        settings.ensure_topics(&stage_topics(&[&topic], &[], 3)).await.expect("topics");
        let producer = settings.producer("batch-test").expect("producer");
        for i in 0..50 {
            let payload: &[u8] = if i == 17 { b"bad" } else { b"good" };
            publish(&producer, &topic, &format!("k{}", i % 10), payload, &[]).await.expect("published");
        }
        let seen: Seen = Default::default();
        let ready = crate::admin::Readiness::default().register("assigned");
        let consumer = settings.consumer("test", &group, &[&topic], ready).expect("consumer");
        let token = CancellationToken::new();
        let batch = BatchSettings::new(16, Duration::from_millis(50));
        let handler = Recorder { seen: seen.clone(), failed_once: false };
        let task = tokio::spawn(run_batch_consumer("test", consumer, producer.clone(), handler, batch, token.clone()));
        let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
        while seen.lock().unwrap().iter().skip(1).map(Vec::len).sum::<usize>() < 50 {
            assert!(tokio::time::Instant::now() < deadline, "not every record was handled: {:?}", seen.lock().unwrap());
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        // Let the last batch's dead letter and offsets through, then stop (which commits).
        tokio::time::sleep(Duration::from_millis(500)).await;
        token.cancel();
        task.await.expect("joins").expect("commits");

        let batches = seen.lock().unwrap().clone();
        assert_eq!(batches[0], batches[1], "the failed batch is offered again unchanged");
        assert!(batches.iter().all(|b| !b.is_empty() && b.len() <= 16), "{batches:?}");
        let mut last = std::collections::HashMap::new();
        for (p, o) in batches.iter().skip(1).flatten() {
            assert!(last.insert(*p, *o).is_none_or(|prev| prev < *o), "partition {p} out of order: {batches:?}");
        }
        let dead = crate::testbed::wait_for_record(&dead_letter_topic(&topic), |_| true, Duration::from_secs(30))
            .await
            .expect("dead letter");
        assert_eq!(dead.payload.as_deref(), Some(&b"bad"[..]));
        assert_eq!(dead.header(dlq_headers::REASON), Some(&b"bad payload"[..]));

        let check: BaseConsumer = ClientConfig::new()
            .set("bootstrap.servers", &settings.bootstrap)
            .set("group.id", &group)
            .create()
            .expect("consumer");
        let mut tpl = TopicPartitionList::new();
        for p in 0..3 {
            tpl.add_partition(&topic, p);
        }
        let committed = check.committed_offsets(tpl, Duration::from_secs(10)).expect("committed offsets");
        let mut total = 0;
        for p in 0..3 {
            let (_, high) = check.fetch_watermarks(&topic, p, Duration::from_secs(10)).expect("watermarks");
            let at = committed.find_partition(&topic, p).map(|e| e.offset());
            if high > 0 {
                assert_eq!(at, Some(rdkafka::Offset::Offset(high)), "partition {p}");
            }
            total += high;
        }
        assert_eq!(total, 50);
    }

    /// Against the testbed's Kafka: a group started at the end reads only what was written after,
    /// including a record written before any member has its partitions; a missing topic is left out.
    #[tokio::test]
    async fn a_group_started_at_the_end_reads_every_later_record_and_no_earlier_one() {
        use rdkafka::Message as _;
        use rdkafka::consumer::StreamConsumer;
        let bootstrap = crate::testbed::require_kafka().await.unwrap_or_else(|e| panic!("{e}"));
        let settings = KafkaSettings { bootstrap, options: vec![], schema_registry: None, topic_replication: None };
        let topic = crate::testbed::unique_name("group-end");
        let group = crate::testbed::unique_name("group-end");
        settings.ensure_topics(&[TopicSpec::new(&topic, 3)]).await.expect("topic");
        let producer = settings.producer("group-end-test").expect("producer");
        for i in 0..20 {
            publish(&producer, &topic, &format!("k{i}"), b"before", &[]).await.expect("published");
        }
        let missing = crate::testbed::unique_name("group-end-missing");
        settings.start_group_at_end(&group, &[&topic, &missing]).await.expect("offsets committed");
        for i in 0..7 {
            publish(&producer, &topic, &format!("k{i}"), b"after", &[]).await.expect("published");
        }
        // The member comes after the records, and would start past them with `latest`.
        let consumer: StreamConsumer = settings
            .client_config_with("group-end-test", &[("group.id", &group), ("auto.offset.reset", "latest")])
            .create()
            .expect("consumer");
        consumer.subscribe(&[&topic]).expect("subscribed");
        let mut payloads = Vec::new();
        while payloads.len() < 7 {
            let m = tokio::time::timeout(Duration::from_secs(30), consumer.recv())
                .await
                .unwrap_or_else(|_| panic!("only {} records after the start: {payloads:?}", payloads.len()))
                .expect("record");
            payloads.push(String::from_utf8_lossy(m.payload().unwrap_or_default()).into_owned());
        }
        assert!(payloads.iter().all(|p| p == "after"), "{payloads:?}");
    }

    /// Against the testbed's Kafka: a partition the hold paused, then lost and got back (a
    /// session that timed out while the broker restarted), is fetched again after the hold resumes,
    /// although the assignment was empty when it resumed. librdkafka keeps a partition's pause
    /// across assignments; a consumer that resumed only its assignment then never fetched again.
    #[tokio::test]
    async fn a_partition_paused_then_revoked_and_assigned_again_is_fetched_after_the_resume() {
        use rdkafka::Message as _;
        let bootstrap = crate::testbed::require_kafka().await.unwrap_or_else(|e| panic!("{e}"));
        let settings = KafkaSettings { bootstrap, options: vec![], schema_registry: None, topic_replication: None };
        let topic = crate::testbed::unique_name("hold-revoke");
        settings.ensure_topics(&[TopicSpec::new(&topic, 1)]).await.expect("topic");
        let producer = settings.producer("hold-test").expect("producer");
        let context = ServiceContext {
            service: "hold-test",
            assigned: crate::admin::Readiness::default().register("assigned"),
            assignment: Assignment::default(),
        };
        let consumer: Consumer = settings
            .client_config_with("hold-test", &[("group.id", &crate::testbed::unique_name("hold-revoke"))])
            .create_with_context(context)
            .expect("consumer");
        let at = |offset| {
            let mut tpl = rdkafka::TopicPartitionList::new();
            tpl.add_partition_offset(&topic, 0, offset).expect("offset");
            tpl
        };
        let next = async || {
            let m = tokio::time::timeout(Duration::from_secs(20), consumer.recv()).await;
            m.map(|m| String::from_utf8_lossy(m.expect("record").payload().unwrap_or_default()).into_owned())
        };

        consumer.assign(&at(rdkafka::Offset::Beginning)).expect("assigned");
        publish(&producer, &topic, "k", b"first", &[]).await.expect("published");
        assert_eq!(next().await.ok().as_deref(), Some("first"));
        let mut hold = Hold::new(&consumer);
        hold.pause();
        assert!(hold.paused);
        // Revoked while paused; the handler finishes and the hold resumes with nothing assigned.
        consumer.unassign().expect("unassigned");
        hold.resume();
        assert!(!hold.paused);
        // Assigned again: its records must flow.
        consumer.assign(&at(rdkafka::Offset::Offset(1))).expect("assigned again");
        publish(&producer, &topic, "k", b"second", &[]).await.expect("published");
        assert_eq!(next().await.ok().as_deref(), Some("second"), "the partition stayed paused");
    }

    #[test]
    fn topic_replication_is_validated_and_kept_from_librdkafka() {
        let mut a = args("k:9092", &["acks=all"]);
        a.topic_replication = Some(3);
        let s = a.validate().expect("valid");
        assert_eq!(s.topic_replication(), Some(3));
        let c = s.client_config_with("t", &[]);
        assert!(c.config_map().keys().all(|k| !k.contains("replication")), "not a librdkafka property");
        assert_eq!(c.get("acks"), Some("all"));
        let mut a = args("k:9092", &[]);
        a.topic_replication = Some(0);
        assert!(a.validate().unwrap_err().list().iter().any(|p| p.field == "--topic-replication"));
        assert_eq!(args("k:9092", &[]).validate().unwrap().topic_replication(), None);
    }

    #[test]
    fn replication_is_three_or_every_broker() {
        assert_eq!(replication_for(1, None), 1);
        assert_eq!(replication_for(2, None), 2);
        assert_eq!(replication_for(3, None), 3);
        assert_eq!(replication_for(9, None), 3);
        assert_eq!(replication_for(0, None), 1, "no metadata: at least one");
        assert_eq!(replication_for(9, Some(5)), 5);
    }

    #[test]
    fn batch_limits_are_validated() {
        let ok = BatchLimitArgs { batch_max_bytes: DEFAULT_BATCH_MAX_BYTES, poison_attempts: 5 }.validate().unwrap();
        assert_eq!(ok, BatchLimits::default());
        let err = BatchLimitArgs { batch_max_bytes: 10, poison_attempts: 0 }.validate().unwrap_err();
        assert_eq!(err.list().len(), 2, "{:?}", err.list());
    }

    #[test]
    fn a_record_counts_its_key_value_and_headers() {
        let r = Record {
            topic: "t".into(),
            partition: 0,
            offset: 0,
            key: Some(b"node".to_vec()),
            payload: Some(vec![0; 100]),
            headers: vec![("h".into(), b"vv".to_vec())],
            timestamp_ms: None,
        };
        assert_eq!(record_bytes(&r), 4 + 100 + 3);
    }

    #[test]
    fn dead_letter_topic_is_suffixed() {
        assert_eq!(dead_letter_topic("gpumedic.health.raw.v1"), "gpumedic.health.raw.v1.dlq");
    }
}
