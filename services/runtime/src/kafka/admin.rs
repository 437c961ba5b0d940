//! Topic administration: the topics a stage needs ([`TopicSpec`], [`stage_topics`]), creating
//! the missing ones, the replication factor they get, and starting a consumer group at the end.

use std::time::Duration;

use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
use rdkafka::client::DefaultClientContext;
use rdkafka::consumer::{BaseConsumer, CommitMode, Consumer as _, ConsumerContext};
use rdkafka::error::{KafkaError as RdKafkaError, RDKafkaErrorCode};
use tokio_util::sync::CancellationToken;

use super::{KafkaError, KafkaSettings, Producer};

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

impl KafkaSettings {
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
