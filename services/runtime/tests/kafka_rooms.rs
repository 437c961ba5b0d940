//! Tests of the Kafka rooms against the testbed's real Kafka: where records land, the batch loop's
//! retries, dead letters and commits, a group started at the end of its topics, and the hold's
//! resume of a partition revoked while paused. (The rooms' unit tests, which need no server, are
//! in `src/kafka/tests.rs`.)

use std::time::Duration;

use gpumedic_runtime::BoxError;
use gpumedic_runtime::admin::Readiness;
use gpumedic_runtime::kafka::{
    Assignment, BatchHandler, BatchSettings, Consumer, Disposition, Hold, KafkaSettings, Record, ServiceContext,
    TopicSpec, dead_letter_topic, dlq_headers, partition_for, publish, run_batch_consumer, stage_topics,
};
use gpumedic_testkit as testkit;
use rdkafka::config::ClientConfig;
use rdkafka::consumer::{BaseConsumer, Consumer as _};
use rdkafka::producer::FutureRecord;
use tokio_util::sync::CancellationToken;

/// Against the testbed's Kafka: the partitions records land on are the ones [`partition_for`]
/// names, so a consumer knows its partitions' nodes.
#[tokio::test]
async fn records_land_where_partition_for_says() {
    let bootstrap = testkit::require_kafka().await.unwrap_or_else(|e| panic!("{e}"));
    let settings = KafkaSettings { bootstrap, options: vec![], schema_registry: None, topic_replication: None };
    let topic = testkit::unique_name("partition-for");
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
    let bootstrap = testkit::require_kafka().await.unwrap_or_else(|e| panic!("{e}"));
    let settings = KafkaSettings { bootstrap, options: vec![], schema_registry: None, topic_replication: None };
    let topic = testkit::unique_name("batch");
    let group = testkit::unique_name("batch");
    settings.ensure_topics(&stage_topics(&[&topic], &[], 3)).await.expect("topics");
    let producer = settings.producer("batch-test").expect("producer");
    for i in 0..50 {
        let payload: &[u8] = if i == 17 { b"bad" } else { b"good" };
        publish(&producer, &topic, &format!("k{}", i % 10), payload, &[]).await.expect("published");
    }
    let seen: Seen = Default::default();
    let ready = Readiness::default().register("assigned");
    let consumer = settings.consumer("test", &group, &[&topic], ready).expect("consumer");
    let token = CancellationToken::new();
    let batch = BatchSettings::new(16, Duration::from_millis(50));
    let handler = Recorder { seen: seen.clone(), failed_once: false };
    let task = tokio::spawn(run_batch_consumer("test", consumer, producer.clone(), handler, batch, token.clone()));
    testkit::eventually_with("every record to be handled", Duration::from_secs(60), async || {
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
    let dead = testkit::wait_for_record(&dead_letter_topic(&topic), |_| true, Duration::from_secs(30))
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
    let bootstrap = testkit::require_kafka().await.unwrap_or_else(|e| panic!("{e}"));
    let settings = KafkaSettings { bootstrap, options: vec![], schema_registry: None, topic_replication: None };
    let topic = testkit::unique_name("group-end");
    let group = testkit::unique_name("group-end");
    settings.ensure_topics(&[TopicSpec::new(&topic, 3)]).await.expect("topic");
    let producer = settings.producer("group-end-test").expect("producer");
    for i in 0..20 {
        publish(&producer, &topic, &format!("k{i}"), b"before", &[]).await.expect("published");
    }
    let missing = testkit::unique_name("group-end-missing");
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
    let bootstrap = testkit::require_kafka().await.unwrap_or_else(|e| panic!("{e}"));
    let settings = KafkaSettings { bootstrap, options: vec![], schema_registry: None, topic_replication: None };
    let topic = testkit::unique_name("hold-revoke");
    settings.ensure_topics(&[TopicSpec::new(&topic, 1)]).await.expect("topic");
    let producer = settings.producer("hold-test").expect("producer");
    let context = ServiceContext::new("hold-test", Readiness::default().register("assigned"), Assignment::default());
    let consumer: Consumer = settings
        .client_config_with("hold-test", &[("group.id", &testkit::unique_name("hold-revoke"))])
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
    assert!(hold.is_paused());
    // Revoked while paused; the handler finishes and the hold resumes with nothing assigned.
    consumer.unassign().expect("unassigned");
    hold.resume();
    assert!(!hold.is_paused());
    // Assigned again: its records must flow.
    consumer.assign(&at(rdkafka::Offset::Offset(1))).expect("assigned again");
    publish(&producer, &topic, "k", b"second", &[]).await.expect("published");
    assert_eq!(next().await.ok().as_deref(), Some("second"), "the partition stayed paused");
}

/// What [`Gauge`] saw: records running now per key, the most running at once, and each key's
/// offsets in the order they ran.
#[derive(Default)]
struct Gauged {
    now: std::collections::HashMap<String, usize>,
    most_keys_at_once: usize,
    one_key_twice_at_once: bool,
    order: std::collections::HashMap<String, Vec<i64>>,
}

/// A handler that holds each record for a moment and gauges how many run at once.
struct Gauge(std::sync::Mutex<Gauged>);

impl gpumedic_runtime::keyed::SharedHandler for Gauge {
    async fn handle(&self, record: &Record) -> Result<(), gpumedic_runtime::kafka::HandleError> {
        let key = String::from_utf8_lossy(record.key.as_deref().unwrap_or_default()).into_owned();
        {
            let mut g = self.0.lock().unwrap();
            let running = g.now.entry(key.clone()).or_default();
            *running += 1;
            let twice = *running > 1;
            g.one_key_twice_at_once |= twice;
            let keys = g.now.values().filter(|n| **n > 0).count();
            g.most_keys_at_once = g.most_keys_at_once.max(keys);
            g.order.entry(key.clone()).or_default().push(record.offset);
        }
        tokio::time::sleep(Duration::from_millis(150)).await;
        *self.0.lock().unwrap().now.get_mut(&key).expect("counted") -= 1;
        Ok(())
    }
}

/// Against the testbed's Kafka: with `max_in_flight` slots, records of different keys fill every
/// slot even when each key's records come in a burst (the remediator's verdicts for the GPUs of
/// one node), each key's records run one at a time and in offset order.
#[tokio::test]
async fn a_burst_of_one_key_waits_without_holding_the_slots_other_keys_run_in() {
    let bootstrap = testkit::require_kafka().await.unwrap_or_else(|e| panic!("{e}"));
    let settings = KafkaSettings { bootstrap, options: vec![], schema_registry: None, topic_replication: None };
    let topic = testkit::unique_name("keyed");
    let group = testkit::unique_name("keyed");
    // One partition: every record in one order, each key's four in a row.
    settings.ensure_topics(&stage_topics(&[&topic], &[], 1)).await.expect("topics");
    let producer = settings.producer("keyed-test").expect("producer");
    let (keys, per_key, slots) = (8, 4, 4);
    for k in 0..keys {
        for _ in 0..per_key {
            publish(&producer, &topic, &format!("node-{k}"), b"verdict", &[]).await.expect("published");
        }
    }
    let ready = Readiness::default().register("assigned");
    let consumer = settings.consumer("test", &group, &[&topic], ready).expect("consumer");
    let token = CancellationToken::new();
    let gauge = std::sync::Arc::new(Gauge(Default::default()));
    let task = {
        let (gauge, producer, token) = (gauge.clone(), producer.clone(), token.clone());
        tokio::spawn(async move {
            gpumedic_runtime::keyed::run_keyed_consumer("test", consumer, producer, &*gauge, slots, token).await
        })
    };
    testkit::eventually_with("every record to be handled", Duration::from_secs(60), async || {
        let g = gauge.0.lock().unwrap();
        let done = g.order.values().map(Vec::len).sum::<usize>();
        if done == keys * per_key && g.now.values().all(|n| *n == 0) { Ok(()) } else { Err(format!("{done} handled")) }
    })
    .await;
    token.cancel();
    task.await.expect("joins").expect("commits");
    let g = gauge.0.lock().unwrap();
    assert!(!g.one_key_twice_at_once, "a key's records ran at the same time");
    for (key, offsets) in &g.order {
        assert!(offsets.windows(2).all(|w| w[0] < w[1]), "{key} ran out of order: {offsets:?}");
    }
    assert_eq!(g.most_keys_at_once, slots, "every slot ran a key of its own");
}
