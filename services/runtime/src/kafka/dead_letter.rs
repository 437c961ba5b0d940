//! Dead letters: a record that can never be processed goes to `<topic>.dlq` with the reason and
//! its origin in headers.

use std::time::Duration;

use rdkafka::message::{Header, OwnedHeaders};
use rdkafka::producer::FutureRecord;
use tokio_util::sync::CancellationToken;

use crate::events::{DeadLetterGivenUp, InternalEvent as _};
use crate::fault;

use super::{DEFAULT_POISON_ATTEMPTS, KafkaError, Producer, Record, dead_letter_topic};

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
                DeadLetterGivenUp { service, record, error: &e, reason }.emit();
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
