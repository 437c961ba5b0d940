//! Producing: a record acknowledged by Kafka before the caller goes on, with the headers every
//! pipeline record carries, and the partition a key lands on.

use std::time::Duration;

use rdkafka::message::{Header, OwnedHeaders};
use rdkafka::producer::FutureRecord;

use super::{KafkaError, Producer, record_headers, traceparent};

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
    publish_record_traced(producer, envelope, payload).await.map(|_| ())
}

/// As [`publish_record`], returning the record's trace id (32 hex digits, from the `traceparent`
/// it carries), so the record's row can link to its trace.
///
/// # Errors
/// As [`publish_record`].
pub async fn publish_record_traced(
    producer: &Producer,
    envelope: Envelope<'_>,
    payload: &[u8],
) -> Result<String, KafkaError> {
    let tp = traceparent(envelope.incoming_trace);
    let trace_id = tp.split('-').nth(1).unwrap_or_default().to_owned();
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
    .await?;
    Ok(trace_id)
}
