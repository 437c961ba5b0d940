//! Smoke test against the testbed's real Kafka: the runtime's producer, its at-least-once consumer
//! loop in a group, commit on shutdown, resume after the committed offset, and the dead-letter path.

use std::time::Duration;

use gpumedic_runtime::admin::Readiness;
use gpumedic_runtime::kafka::{
    HandleError, KafkaSettings, Record, RecordHandler, TopicSpec, dead_letter_topic, dlq_headers, run_consumer,
};
use gpumedic_testkit as testkit;
use rdkafka::producer::FutureRecord;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

/// Sends each record to the test; when `reject_bad`, payloads equal to "bad" are invalid.
struct Collect {
    tx: mpsc::UnboundedSender<Record>,
    reject_bad: bool,
}

impl RecordHandler for Collect {
    async fn handle(&mut self, record: &Record) -> Result<(), HandleError> {
        if self.reject_bad && record.payload.as_deref() == Some(b"bad") {
            return Err(HandleError::Invalid("payload is the word bad".into()));
        }
        self.tx.send(record.clone()).expect("test receiver alive");
        Ok(())
    }
}

async fn produce(settings: &KafkaSettings, topic: &str, payloads: &[&str]) {
    let producer = settings.producer("smoke-producer").expect("producer");
    for p in payloads {
        producer
            .send(FutureRecord::to(topic).key("node-a").payload(*p), Duration::from_secs(10))
            .await
            .expect("delivered");
    }
}

/// Runs one consumer in `group` until `n` good records arrived, then shuts it down (committing).
async fn consume(
    settings: &KafkaSettings,
    group: &str,
    topic: &'static str,
    n: usize,
    reject_bad: bool,
) -> Vec<Record> {
    let readiness = Readiness::default();
    let assigned = readiness.register("assigned");
    let consumer = settings.consumer("smoke", group, &[topic], assigned.clone()).expect("consumer");
    let dlq = settings.producer("smoke-dlq").expect("dlq producer");
    let (tx, mut rx) = mpsc::unbounded_channel();
    let token = CancellationToken::new();
    let task = tokio::spawn(run_consumer("smoke", consumer, dlq, Collect { tx, reject_bad }, token.clone()));
    let mut got = Vec::new();
    while got.len() < n {
        let r = tokio::time::timeout(Duration::from_secs(60), rx.recv())
            .await
            .unwrap_or_else(|_| panic!("only {} of {n} records arrived within 60 s", got.len()))
            .expect("handler alive");
        got.push(r);
    }
    assert!(assigned.get(), "the consumer received records, so it must have had partitions assigned");
    token.cancel();
    task.await.expect("consumer task").expect("clean shutdown with commit");
    got
}

#[tokio::test]
async fn consumer_resumes_after_committed_offset_and_dead_letters_bad_records() {
    let bootstrap = testkit::require_kafka().await.unwrap_or_else(|e| panic!("{e}"));
    let settings = KafkaSettings { bootstrap, options: vec![], schema_registry: None, topic_replication: None };
    let topic: &'static str = Box::leak(testkit::unique_name("smoke").into_boxed_str());
    let group = testkit::unique_name("smoke-group");
    // One partition, so offsets are a single sequence we can reason about.
    settings
        .ensure_topics(&[TopicSpec::new(topic, 1), TopicSpec::dead_letter_for(topic, 1)])
        .await
        .expect("topics created");
    // Creating again is not an error.
    settings.ensure_topics(&[TopicSpec::new(topic, 1)]).await.expect("idempotent create");

    produce(&settings, topic, &["one", "two", "bad", "three"]).await;
    let first = consume(&settings, &group, topic, 3, true).await;
    let payloads: Vec<_> =
        first.iter().map(|r| String::from_utf8_lossy(r.payload.as_deref().unwrap()).into_owned()).collect();
    assert_eq!(payloads, ["one", "two", "three"]);
    assert_eq!(first.iter().map(|r| r.offset).collect::<Vec<_>>(), [0, 1, 3]);
    assert_eq!(first[0].key.as_deref(), Some(&b"node-a"[..]));

    // A restarted consumer in the same group starts after the committed offset.
    produce(&settings, topic, &["four", "five"]).await;
    let second = consume(&settings, &group, topic, 2, true).await;
    let payloads: Vec<_> =
        second.iter().map(|r| String::from_utf8_lossy(r.payload.as_deref().unwrap()).into_owned()).collect();
    assert_eq!(payloads, ["four", "five"], "records before the commit must not come again");
    assert_eq!(second[0].offset, 4);

    // The bad record is in the dead-letter topic, with its reason and origin.
    let dlq_topic: &'static str = Box::leak(dead_letter_topic(topic).into_boxed_str());
    let dead = consume(&settings, &testkit::unique_name("smoke-dlq-reader"), dlq_topic, 1, false).await;
    assert_eq!(dead[0].payload.as_deref(), Some(&b"bad"[..]));
    assert_eq!(dead[0].key.as_deref(), Some(&b"node-a"[..]));
    assert_eq!(dead[0].header(dlq_headers::REASON), Some(&b"payload is the word bad"[..]));
    assert_eq!(dead[0].header(dlq_headers::SOURCE_TOPIC), Some(topic.as_bytes()));
    assert_eq!(dead[0].header(dlq_headers::SOURCE_OFFSET), Some(&b"2"[..]));
}
