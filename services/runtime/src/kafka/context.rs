//! The consumer's context: readiness on assignment, a commit on revoke, the partitions owned
//! ([`Assignment`]) and the lag in the metrics.

use std::sync::Arc;

use rdkafka::client::ClientContext;
use rdkafka::consumer::{BaseConsumer, CommitMode, Consumer as _, ConsumerContext, Rebalance};
use rdkafka::error::{KafkaError as RdKafkaError, RDKafkaErrorCode};
use rdkafka::statistics::Statistics;

use crate::admin::ReadyFlag;
use crate::events::{metric_name, names};

/// The consumer's context: readiness on assignment, a commit on revoke, lag in the metrics.
pub struct ServiceContext {
    pub(crate) service: &'static str,
    pub(crate) assigned: ReadyFlag,
    pub(crate) assignment: Assignment,
}

impl ServiceContext {
    /// The context of `service`'s consumer: `assigned` turns ready on the first assignment, and
    /// `assignment` follows every rebalance. [`KafkaSettings::consumer`](super::KafkaSettings::consumer)
    /// builds one; this is for a consumer configured by hand (a test assigning partitions itself).
    pub fn new(service: &'static str, assigned: ReadyFlag, assignment: Assignment) -> Self {
        Self { service, assigned, assignment }
    }
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

impl ClientContext for ServiceContext {
    fn stats(&self, statistics: Statistics) {
        for (topic, t) in &statistics.topics {
            // librdkafka reports -1 for partitions it does not consume (and -1 for its internal
            // "unassigned" partition).
            let consumed = t.partitions.values().filter(|p| p.consumer_lag >= 0 && p.partition >= 0);
            let mut lag = 0i64;
            for p in consumed {
                lag += p.consumer_lag;
                metrics::gauge!(metric_name(self.service, names::PARTITION_LAG), "topic" => topic.clone(),
                    "partition" => p.partition.to_string())
                .set(p.consumer_lag as f64);
            }
            metrics::gauge!(metric_name(self.service, names::CONSUMER_LAG), "topic" => topic.clone()).set(lag as f64);
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
