//! Tests of the Kafka rooms, against the testbed's Kafka where they say so.
//!
//! The testkit links its own copy of this crate (these tests are this crate built again): only
//! plain values (names, addresses) and the fields of records it reads cross from it, never one
//! of this crate's types.

use std::time::Duration;

use rdkafka::config::ClientConfig;
use rdkafka::consumer::{BaseConsumer, Consumer as _};
use rdkafka::producer::FutureRecord;
use tokio_util::sync::CancellationToken;

use super::batch::record_bytes;
use super::*;
use crate::BoxError;
use crate::config::Validate as _;

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
    let bootstrap = gpumedic_testkit::require_kafka().await.unwrap_or_else(|e| panic!("{e}"));
    let settings = KafkaSettings { bootstrap, options: vec![], schema_registry: None, topic_replication: None };
    let topic = gpumedic_testkit::unique_name("partition-for");
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
    let bootstrap = gpumedic_testkit::require_kafka().await.unwrap_or_else(|e| panic!("{e}"));
    let settings = KafkaSettings { bootstrap, options: vec![], schema_registry: None, topic_replication: None };
    let topic = gpumedic_testkit::unique_name("batch");
    let group = gpumedic_testkit::unique_name("batch");
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
    gpumedic_testkit::eventually_with("every record to be handled", Duration::from_secs(60), async || {
        let seen = seen.lock().unwrap();
        if seen.iter().skip(1).map(Vec::len).sum::<usize>() >= 50 { Ok(()) } else { Err(format!("{seen:?}")) }
    })
    .await;
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
    let dead = gpumedic_testkit::wait_for_record(&dead_letter_topic(&topic), |_| true, Duration::from_secs(30))
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
    let bootstrap = gpumedic_testkit::require_kafka().await.unwrap_or_else(|e| panic!("{e}"));
    let settings = KafkaSettings { bootstrap, options: vec![], schema_registry: None, topic_replication: None };
    let topic = gpumedic_testkit::unique_name("group-end");
    let group = gpumedic_testkit::unique_name("group-end");
    settings.ensure_topics(&[TopicSpec::new(&topic, 3)]).await.expect("topic");
    let producer = settings.producer("group-end-test").expect("producer");
    for i in 0..20 {
        publish(&producer, &topic, &format!("k{i}"), b"before", &[]).await.expect("published");
    }
    let missing = gpumedic_testkit::unique_name("group-end-missing");
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
    let bootstrap = gpumedic_testkit::require_kafka().await.unwrap_or_else(|e| panic!("{e}"));
    let settings = KafkaSettings { bootstrap, options: vec![], schema_registry: None, topic_replication: None };
    let topic = gpumedic_testkit::unique_name("hold-revoke");
    settings.ensure_topics(&[TopicSpec::new(&topic, 1)]).await.expect("topic");
    let producer = settings.producer("hold-test").expect("producer");
    let context = ServiceContext {
        service: "hold-test",
        assigned: crate::admin::Readiness::default().register("assigned"),
        assignment: Assignment::default(),
    };
    let consumer: Consumer = settings
        .client_config_with("hold-test", &[("group.id", &gpumedic_testkit::unique_name("hold-revoke"))])
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
