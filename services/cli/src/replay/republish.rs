//! `gpumedic replay republish`: the records produced again, keys and headers kept.

use std::time::Duration;

use anyhow::Context as _;
use gpumedic_runtime::kafka::KafkaSettings;
use rdkafka::message::{Header, OwnedHeaders};
use rdkafka::producer::{BaseRecord, DefaultProducerContext, Producer as _, ThreadedProducer};

use super::source::Source;

/// Produces every record of `source` to `topic`; returns how many.
pub(super) fn republish(settings: &KafkaSettings, topic: &str, source: Source) -> anyhow::Result<u64> {
    let producer: ThreadedProducer<DefaultProducerContext> = settings
        .client_config_with(
            "gpumedic-replay",
            &[("acks", "all"), ("enable.idempotence", "true"), ("linger.ms", "20"), ("compression.type", "lz4")],
        )
        .create()
        .context("cannot create the producer")?;
    let count = source.for_each(|item| {
        let mut headers = OwnedHeaders::new();
        for (k, v) in &item.headers {
            headers = headers.insert(Header { key: k, value: Some(v) });
        }
        let mut record: BaseRecord<'_, [u8], [u8]> = BaseRecord::to(topic).headers(headers);
        if let Some(k) = &item.key {
            record = record.key(k);
        }
        if let Some(p) = &item.payload {
            record = record.payload(p);
        }
        let mut record = record;
        loop {
            match producer.send(record) {
                Ok(()) => return Ok(()),
                Err((e, back)) if e.rdkafka_error_code() == Some(rdkafka::types::RDKafkaErrorCode::QueueFull) => {
                    producer.poll(Duration::from_millis(50));
                    record = back;
                }
                Err((e, _)) => return Err(anyhow::anyhow!("producing to {topic}: {e}")),
            }
        }
    })?;
    producer.flush(Duration::from_secs(60)).context("waiting for Kafka to acknowledge every record")?;
    Ok(count)
}
