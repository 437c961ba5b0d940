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
//!
//! One room per concern: [`settings`] (flags and clients), [`admin`] (topics), [`context`] (the
//! consumer's rebalance context), [`record`] (records, handler errors, trace headers), [`consume`]
//! (the record-at-a-time loop and what the loops share), [`batch`] (the batch loop), [`hold`]
//! (polling on while a handler waits), [`dead_letter`] and [`produce`]. Everything is re-exported
//! here, so callers name `gpumedic_runtime::kafka::X`.

use rdkafka::consumer::StreamConsumer;
use rdkafka::error::KafkaError as RdKafkaError;
use rdkafka::producer::FutureProducer;

pub mod admin;
pub mod batch;
pub mod consume;
pub mod context;
pub mod dead_letter;
pub mod hold;
pub mod node_proof;
pub mod produce;
pub mod record;
pub mod settings;

pub use admin::{TopicSpec, dead_letter_topic, replication_for, stage_topics, topic_exists, wait_for_topics};
pub use batch::{
    BatchHandler, BatchLimitArgs, BatchLimits, BatchSettings, DEFAULT_BATCH_MAX_BYTES, Disposition, run_batch_consumer,
};
pub use consume::{DEFAULT_POISON_ATTEMPTS, run_consumer};
pub(crate) use consume::{commit_stored, observe_latency, register_consumer_metrics, report_poison};
pub use context::{Assignment, ServiceContext};
pub(crate) use dead_letter::dead_letter_until_done;
pub use dead_letter::{dead_letter, dlq_headers};
pub use hold::{Hold, POLL_GRACE};
pub use produce::{Envelope, partition_for, publish, publish_record, publish_record_traced};
pub use record::{HandleError, Record, RecordHandler, decode_payload, record_headers, record_span, traceparent};
pub use settings::{KafkaArgs, KafkaSettings};

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

/// The producer every service uses.
pub type Producer = FutureProducer;
/// The consumer every service uses.
pub type Consumer = StreamConsumer<ServiceContext>;

#[cfg(test)]
mod tests;
