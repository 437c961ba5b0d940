//! Polling on while a handler is slow or retrying ([`Hold`]), so the group keeps the consumer.

use std::future::Future;
use std::time::Duration;

use rdkafka::consumer::Consumer as _;
use tokio_util::sync::CancellationToken;

use super::{Consumer, Record};

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
///
/// The consumer loops hold one each; it is public so the pause and resume can be tested against a
/// real broker.
pub struct Hold<'c> {
    consumer: &'c Consumer,
    /// Whether the assignment is paused.
    pub(crate) paused: bool,
    /// Every partition paused since the last resume, assigned now or not.
    paused_partitions: std::collections::BTreeSet<(String, i32)>,
    /// Records polled while paused, in order, for the loop to take first.
    pub(crate) early: std::collections::VecDeque<Record>,
}

impl<'c> Hold<'c> {
    /// A hold on `consumer`, with nothing paused.
    pub fn new(consumer: &'c Consumer) -> Self {
        Self {
            consumer,
            paused: false,
            paused_partitions: std::collections::BTreeSet::new(),
            early: std::collections::VecDeque::new(),
        }
    }

    /// Whether the assignment is paused.
    pub fn is_paused(&self) -> bool {
        self.paused
    }

    /// Pauses every assigned partition.
    pub fn pause(&mut self) {
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

    /// Resumes the partitions if they were paused: every partition paused since the last resume,
    /// assigned now or not.
    pub fn resume(&mut self) {
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
    pub(crate) async fn run<T>(&mut self, work: impl Future<Output = T>) -> T {
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
    pub(crate) async fn wait(&mut self, backoff: Duration, token: &CancellationToken) -> bool {
        tokio::select! {
            () = token.cancelled() => false,
            () = tokio::time::sleep(backoff) => true,
            never = self.poll_paused() => match never {},
        }
    }

    /// The next record: one kept while paused, else the next one polled; `None` when `token` was
    /// cancelled first.
    pub(crate) async fn next(&mut self, token: &CancellationToken) -> Option<Record> {
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
