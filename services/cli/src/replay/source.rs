//! Where replayed records come from ([`Source`]): a topic over a time range, read up to the end
//! offsets seen at the start, or an export file; either read ahead on a thread of its own.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::mpsc::{Receiver, SyncSender, sync_channel};
use std::time::{Duration, Instant};

use anyhow::{Context as _, bail};
use chrono::{DateTime, Utc};
use gpumedic_classifier::rules;
use gpumedic_runtime::kafka::KafkaSettings;
use rdkafka::consumer::{BaseConsumer, Consumer as _};
use rdkafka::message::{Headers as _, Message as _};
use rdkafka::{Offset, TopicPartitionList};

use super::file::read_file;

/// One record as replay moves it.
#[derive(Debug, Clone, PartialEq)]
pub struct Item {
    /// Kafka timestamp, milliseconds since the epoch.
    pub timestamp_ms: i64,
    /// The key (node name in every gpumedic topic).
    pub key: Option<Vec<u8>>,
    /// The framed Avro record.
    pub payload: Option<Vec<u8>>,
    /// Headers in order.
    pub headers: Vec<(String, Vec<u8>)>,
}

/// A time range by Kafka timestamp, both ends inclusive, in milliseconds.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct TimeRange {
    /// From, or the start of the topic.
    pub from_ms: Option<i64>,
    /// To, or the end offsets when the read starts.
    pub to_ms: Option<i64>,
}

/// Parses RFC 3339 or an age (`30s`, `90m`, `2h`, `7d`) before `now`.
pub fn parse_time(text: &str, now: DateTime<Utc>) -> anyhow::Result<i64> {
    if let Ok(t) = DateTime::parse_from_rfc3339(text) {
        return Ok(t.timestamp_millis());
    }
    let age = rules::parse_duration(text).map_err(|e| anyhow::anyhow!("not RFC 3339 nor an age: {e}"))?;
    Ok(now.timestamp_millis() - age.micros() / 1000)
}

/// Where replayed records come from.
#[derive(Debug, Clone)]
pub enum Source {
    /// A topic over a range.
    Topic {
        /// Kafka settings.
        settings: KafkaSettings,
        /// The topic.
        topic: String,
        /// The range.
        range: TimeRange,
    },
    /// A file written by `export`, filtered by the range.
    File {
        /// The file.
        path: PathBuf,
        /// The range.
        range: TimeRange,
    },
}

impl Source {
    /// Calls `f` on every record in order (per partition for a topic), on this thread, while a
    /// reader thread fetches ahead. Returns how many records were seen.
    pub fn for_each(self, mut f: impl FnMut(Item) -> anyhow::Result<()>) -> anyhow::Result<u64> {
        let (tx, rx) = sync_channel::<Vec<Item>>(64);
        let reader = std::thread::spawn(move || match self {
            Source::Topic { settings, topic, range } => read_topic(&settings, &topic, range, &tx),
            Source::File { path, range } => read_file(&path, range, &tx),
        });
        let count = drain(&rx, &mut f);
        // A failed handler drops the receiver, which stops the reader at its next send.
        drop(rx);
        let read = reader.join().map_err(|_| anyhow::anyhow!("the reader thread panicked"))?;
        let count = count?;
        read?;
        Ok(count)
    }
}

fn drain(rx: &Receiver<Vec<Item>>, f: &mut impl FnMut(Item) -> anyhow::Result<()>) -> anyhow::Result<u64> {
    let mut count = 0;
    for batch in rx {
        for item in batch {
            f(item)?;
            count += 1;
        }
    }
    Ok(count)
}

/// Records sent to the consumer of a [`Source`] at a time.
pub(super) const BATCH: usize = 2_000;

/// Reads `topic` over `range` into `tx` in batches, stopping at the end offsets of the start.
fn read_topic(
    settings: &KafkaSettings,
    topic: &str,
    range: TimeRange,
    tx: &SyncSender<Vec<Item>>,
) -> anyhow::Result<()> {
    // Assigned, never subscribed: the group id is required by librdkafka but nothing is committed.
    let group = format!("gpumedic-replay-{}", uuid::Uuid::new_v4());
    let consumer: BaseConsumer = settings
        .client_config_with(
            "gpumedic-replay",
            &[
                ("group.id", &group),
                ("enable.auto.commit", "false"),
                ("enable.auto.offset.store", "false"),
                ("fetch.max.bytes", "52428800"),
                ("max.partition.fetch.bytes", "10485760"),
            ],
        )
        .create()
        .context("cannot create the Kafka consumer")?;
    let timeout = Duration::from_secs(15);
    let metadata = consumer.fetch_metadata(Some(topic), timeout).with_context(|| format!("metadata of {topic}"))?;
    let partitions: Vec<i32> = metadata
        .topics()
        .iter()
        .find(|t| t.name() == topic && t.error().is_none())
        .map(|t| t.partitions().iter().map(|p| p.id()).collect())
        .unwrap_or_default();
    if partitions.is_empty() {
        bail!("topic {topic} does not exist or has no partitions");
    }
    // Start offsets: by time when --from is given.
    let mut start = TopicPartitionList::new();
    for &p in &partitions {
        let offset = range.from_ms.map_or(Offset::Beginning, Offset::Offset);
        start.add_partition_offset(topic, p, offset).context("partition list")?;
    }
    let start = if range.from_ms.is_some() { consumer.offsets_for_times(start, timeout)? } else { start };
    let mut assignment = TopicPartitionList::new();
    let mut remaining: BTreeMap<i32, i64> = BTreeMap::new();
    for &p in &partitions {
        let (low, high) = consumer.fetch_watermarks(topic, p, timeout)?;
        let first = match start.find_partition(topic, p).map(|e| e.offset()) {
            Some(Offset::Offset(o)) => o.max(low),
            // No record at or after --from in this partition.
            Some(Offset::End) => high,
            _ => low,
        };
        if first < high {
            assignment.add_partition_offset(topic, p, Offset::Offset(first))?;
            remaining.insert(p, high);
        }
    }
    if remaining.is_empty() {
        return Ok(());
    }
    consumer.assign(&assignment).context("assigning partitions")?;
    let mut batch = Vec::with_capacity(BATCH);
    let mut idle = Instant::now();
    while !remaining.is_empty() {
        let Some(message) = consumer.poll(Duration::from_millis(200)) else {
            if idle.elapsed() > Duration::from_secs(60) {
                bail!("no record from {topic} for 60 s with {} partitions left to read", remaining.len());
            }
            continue;
        };
        idle = Instant::now();
        let m = message.with_context(|| format!("reading {topic}"))?;
        let partition = m.partition();
        let Some(&end) = remaining.get(&partition) else { continue };
        if m.offset() >= end {
            remaining.remove(&partition);
            continue;
        }
        let timestamp_ms = m.timestamp().to_millis().unwrap_or(0);
        if range.to_ms.is_some_and(|to| timestamp_ms > to) {
            remaining.remove(&partition);
            continue;
        }
        let headers = m
            .headers()
            .map(|h| h.iter().map(|h| (h.key.to_owned(), h.value.map(<[u8]>::to_vec).unwrap_or_default())).collect())
            .unwrap_or_default();
        batch.push(Item {
            timestamp_ms,
            key: m.key().map(<[u8]>::to_vec),
            payload: m.payload().map(<[u8]>::to_vec),
            headers,
        });
        if m.offset() + 1 >= end {
            remaining.remove(&partition);
        }
        if batch.len() == BATCH && tx.send(std::mem::replace(&mut batch, Vec::with_capacity(BATCH))).is_err() {
            return Ok(());
        }
    }
    if !batch.is_empty() {
        let _ = tx.send(batch);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn times_parse_as_rfc3339_or_age() {
        let now = DateTime::parse_from_rfc3339("2026-11-30T12:00:00Z").unwrap().with_timezone(&Utc);
        assert_eq!(parse_time("2026-11-30T11:00:00Z", now).unwrap(), now.timestamp_millis() - 3_600_000);
        assert_eq!(parse_time("2h", now).unwrap(), now.timestamp_millis() - 7_200_000);
        assert!(parse_time("yesterday", now).is_err());
    }
}
