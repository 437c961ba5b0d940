//! Against the testbed's real Kafka and PostgreSQL: permanent errors never stall a partition, and
//! a handler that retries for longer than `max.poll.interval.ms` keeps its partitions.
//!
//! - A record too large for the stage's output topic ends in the input's dead-letter topic.
//! - A record too large for the dead-letter topic itself is counted and given up.
//! - A record Postgres refuses (a NUL byte in text) is found in its batch and dead-lettered; the
//!   rest of the batch is written.
//! - A handler failing for longer than a short `max.poll.interval.ms` keeps its assignment.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use gpumedic_runtime::BoxError;
use gpumedic_runtime::admin::{self, Readiness};
use gpumedic_runtime::kafka::{
    Assignment, BatchHandler, BatchSettings, Disposition, KafkaSettings, Producer, Record, TopicSpec,
    dead_letter_topic, dlq_headers, publish, run_batch_consumer, stage_topics,
};
use gpumedic_testkit as testkit;
use rdkafka::ClientConfig;
use rdkafka::consumer::{BaseConsumer, Consumer as _};
use tokio_util::sync::CancellationToken;

/// Bytes no compression shrinks, so the broker sees their real size.
fn incompressible(len: usize) -> Vec<u8> {
    let mut rng = fastrand::Rng::with_seed(7);
    (0..len).map(|_| rng.u8(..)).collect()
}

async fn settings() -> KafkaSettings {
    let bootstrap = testkit::require_kafka().await.unwrap_or_else(|e| panic!("{e}"));
    KafkaSettings { bootstrap, options: vec![], schema_registry: None, topic_replication: None }
}

/// Waits until `group`'s committed offsets on `topic` (partitions `0..partitions`) are the ends
/// of the partitions, or panics after `timeout`.
async fn wait_committed_to_end(settings: &KafkaSettings, group: &str, topic: &str, partitions: i32, timeout: Duration) {
    let check: BaseConsumer =
        ClientConfig::new().set("bootstrap.servers", &settings.bootstrap).set("group.id", group).create().unwrap();
    let what = format!("offsets committed to the end of {topic}");
    testkit::eventually_with(&what, timeout, async || {
        let mut tpl = rdkafka::TopicPartitionList::new();
        for p in 0..partitions {
            tpl.add_partition(topic, p);
        }
        let committed = check.committed_offsets(tpl, Duration::from_secs(10)).unwrap();
        let mut behind = Vec::new();
        for p in 0..partitions {
            let (_, high) = check.fetch_watermarks(topic, p, Duration::from_secs(10)).unwrap();
            let at = committed.find_partition(topic, p).map(|e| e.offset());
            if high > 0 && at != Some(rdkafka::Offset::Offset(high)) {
                behind.push((p, at, high));
            }
        }
        if behind.is_empty() { Ok(()) } else { Err(format!("{behind:?}")) }
    })
    .await;
}

/// Forwards every record to `output`, one after another, failing the batch on the first error.
struct Forward {
    producer: Producer,
    output: String,
}

impl BatchHandler for Forward {
    async fn handle_batch(&mut self, records: &[Record]) -> Result<Vec<Disposition>, BoxError> {
        for r in records {
            let key = String::from_utf8_lossy(r.key.as_deref().unwrap_or_default()).into_owned();
            publish(&self.producer, &self.output, &key, r.payload.as_deref().unwrap_or_default(), &[]).await?;
        }
        Ok(vec![Disposition::Done; records.len()])
    }
}

#[tokio::test]
async fn a_record_too_large_for_the_output_topic_goes_to_the_dead_letter_topic() {
    let settings = settings().await;
    let input = testkit::unique_name("too-large-in");
    let output = testkit::unique_name("too-large-out");
    let group = testkit::unique_name("too-large");
    let mut specs = stage_topics(&[&input], &[], 1);
    specs.push(TopicSpec::new(&output, 1).with_config("max.message.bytes", "4096"));
    settings.ensure_topics(&specs).await.expect("topics");
    let producer = settings.producer("too-large-test").expect("producer");
    let big = incompressible(10_000);
    for i in 0..10 {
        let payload = if i == 4 { big.clone() } else { format!("small-{i}").into_bytes() };
        publish(&producer, &input, "node-a", &payload, &[]).await.expect("published to the input");
    }
    let consumer = settings.consumer("faults", &group, &[&input], Readiness::default().register("a")).unwrap();
    let token = CancellationToken::new();
    let handler = Forward { producer: producer.clone(), output: output.clone() };
    let task = tokio::spawn(run_batch_consumer(
        "faults",
        consumer,
        producer.clone(),
        handler,
        BatchSettings::new(100, Duration::from_millis(200)),
        token.clone(),
    ));

    let dead = testkit::wait_for_record(&dead_letter_topic(&input), |_| true, Duration::from_secs(60))
        .await
        .unwrap_or_else(|e| panic!("the oversized record never reached the dead-letter topic: {e}"));
    assert_eq!(dead.payload.as_deref(), Some(big.as_slice()));
    assert_eq!(dead.header(dlq_headers::SOURCE_OFFSET), Some(&b"4"[..]));
    let reason = String::from_utf8_lossy(dead.header(dlq_headers::REASON).unwrap_or_default()).into_owned();
    assert!(reason.to_lowercase().contains("too large"), "{reason}");
    // The partition moved on: the records after it were forwarded and everything is committed.
    testkit::wait_for_record(&output, |r| r.payload.as_deref() == Some(&b"small-9"[..]), Duration::from_secs(30))
        .await
        .expect("the record after the oversized one was forwarded");
    wait_committed_to_end(&settings, &group, &input, 1, Duration::from_secs(30)).await;
    token.cancel();
    task.await.unwrap().expect("commits");
}

/// Dead-letters the records whose payload is larger than 1000 bytes.
struct RefuseLarge;

impl BatchHandler for RefuseLarge {
    async fn handle_batch(&mut self, records: &[Record]) -> Result<Vec<Disposition>, BoxError> {
        Ok(records
            .iter()
            .map(|r| match r.payload.as_ref() {
                Some(p) if p.len() > 1000 => Disposition::DeadLetter("too large to handle".into()),
                _ => Disposition::Done,
            })
            .collect())
    }
}

#[tokio::test]
async fn a_record_the_dead_letter_topic_refuses_is_counted_and_given_up() {
    let metrics = admin::metrics_handle();
    let settings = settings().await;
    let input = testkit::unique_name("dlq-refuses");
    let group = testkit::unique_name("dlq-refuses");
    settings
        .ensure_topics(&[
            TopicSpec::new(&input, 1),
            TopicSpec::dead_letter_for(&input, 1).with_config("max.message.bytes", "4096"),
        ])
        .await
        .expect("topics");
    let producer = settings.producer("dlq-refuses-test").expect("producer");
    for i in 0..5 {
        let payload = if i == 2 { incompressible(10_000) } else { b"fine".to_vec() };
        publish(&producer, &input, "node-a", &payload, &[]).await.expect("published");
    }
    let consumer = settings.consumer("faultsdlq", &group, &[&input], Readiness::default().register("a")).unwrap();
    let token = CancellationToken::new();
    let task = tokio::spawn(run_batch_consumer(
        "faultsdlq",
        consumer,
        producer.clone(),
        RefuseLarge,
        BatchSettings::new(100, Duration::from_millis(50)),
        token.clone(),
    ));
    wait_committed_to_end(&settings, &group, &input, 1, Duration::from_secs(60)).await;
    let line = format!("gpumedic_faultsdlq_dead_letters_failed_total{{topic=\"{input}\"}} 1");
    let text = metrics.render();
    assert!(text.contains(&line), "no '{line}' in the metrics:\n{text}");
    token.cancel();
    task.await.unwrap().expect("commits");
}

/// Writes each batch's payloads as text in one statement, as a stage writing in bulk does.
struct WriteText {
    pool: sqlx::PgPool,
    table: String,
}

impl BatchHandler for WriteText {
    async fn handle_batch(&mut self, records: &[Record]) -> Result<Vec<Disposition>, BoxError> {
        let values: Vec<String> = records
            .iter()
            .map(|r| String::from_utf8_lossy(r.payload.as_deref().unwrap_or_default()).into_owned())
            .collect();
        let sql = format!("INSERT INTO {} (v) SELECT * FROM UNNEST($1::text[]) ON CONFLICT DO NOTHING", self.table);
        sqlx::query(sqlx::AssertSqlSafe(sql)).bind(&values).execute(&self.pool).await?;
        Ok(vec![Disposition::Done; records.len()])
    }
}

#[tokio::test]
async fn a_record_postgres_refuses_is_found_in_its_batch_and_dead_lettered() {
    let settings = settings().await;
    let admin_pool = testkit::require_postgres().await.unwrap_or_else(|e| panic!("{e}"));
    let database = testkit::unique_name("poison");
    let url = testkit::fresh_database(&admin_pool, &database).await.expect("database");
    let pool = gpumedic_runtime::postgres::connect(&url, 2).await.expect("pool");
    sqlx::query("CREATE TABLE written (v text PRIMARY KEY)").execute(&pool).await.expect("table");

    let input = testkit::unique_name("poison");
    let group = testkit::unique_name("poison");
    settings.ensure_topics(&stage_topics(&[&input], &[], 3)).await.expect("topics");
    let producer = settings.producer("poison-test").expect("producer");
    for i in 0..20 {
        // A NUL byte: valid UTF-8, but PostgreSQL stores no NUL in text (SQLSTATE 22021).
        let payload = if i == 11 { "bad\0record".to_owned() } else { format!("good-{i}") };
        publish(&producer, &input, &format!("node-{}", i % 4), payload.as_bytes(), &[]).await.expect("published");
    }
    let consumer = settings.consumer("faultspoison", &group, &[&input], Readiness::default().register("a")).unwrap();
    let token = CancellationToken::new();
    let handler = WriteText { pool: pool.clone(), table: "written".into() };
    let task = tokio::spawn(run_batch_consumer(
        "faultspoison",
        consumer,
        producer.clone(),
        handler,
        BatchSettings::new(100, Duration::from_millis(300)),
        token.clone(),
    ));

    let dead = testkit::wait_for_record(&dead_letter_topic(&input), |_| true, Duration::from_secs(60))
        .await
        .unwrap_or_else(|e| panic!("the poison record never reached the dead-letter topic: {e}"));
    assert_eq!(dead.payload.as_deref(), Some(&b"bad\0record"[..]));
    let reason = String::from_utf8_lossy(dead.header(dlq_headers::REASON).unwrap_or_default()).into_owned();
    assert!(reason.contains("0x00"), "the reason names Postgres's refusal: {reason}");
    wait_committed_to_end(&settings, &group, &input, 3, Duration::from_secs(30)).await;
    token.cancel();
    task.await.unwrap().expect("commits");
    let written: Vec<String> = sqlx::query_scalar("SELECT v FROM written ORDER BY v").fetch_all(&pool).await.unwrap();
    assert_eq!(written.len(), 19, "every good record is written: {written:?}");
    assert!(written.iter().all(|v| v.starts_with("good-")), "{written:?}");
}

/// Fails every batch until `until`, then records the offsets it handled.
struct FailFor {
    until: Instant,
    handled: Arc<Mutex<Vec<i64>>>,
}

impl BatchHandler for FailFor {
    async fn handle_batch(&mut self, records: &[Record]) -> Result<Vec<Disposition>, BoxError> {
        if Instant::now() < self.until {
            return Err("the database is down".into());
        }
        self.handled.lock().unwrap().extend(records.iter().map(|r| r.offset));
        Ok(vec![Disposition::Done; records.len()])
    }
}

#[tokio::test]
async fn a_handler_retrying_past_the_poll_interval_keeps_its_partitions() {
    let mut settings = settings().await;
    let input = testkit::unique_name("poll-interval");
    let group = testkit::unique_name("poll-interval");
    settings.ensure_topics(&stage_topics(&[&input], &[], 1)).await.expect("topics");
    let producer = settings.producer("poll-interval-test").expect("producer");
    for i in 0..5 {
        publish(&producer, &input, "node-a", format!("r{i}").as_bytes(), &[]).await.expect("published");
    }
    // For the consumer only: a member that does not poll for 10 s leaves its group.
    settings.options.push(("session.timeout.ms".into(), "6000".into()));
    settings.options.push(("max.poll.interval.ms".into(), "10000".into()));
    let assignment = Assignment::default();
    let ready = Readiness::default().register("assigned");
    let consumer =
        settings.consumer_tracking("faultspoll", &group, &[&input], ready.clone(), assignment.clone()).unwrap();
    let handled = Arc::new(Mutex::new(Vec::new()));
    // Longer than max.poll.interval.ms, counted from now: the consumer joins within it.
    let handler = FailFor { until: Instant::now() + Duration::from_secs(18), handled: handled.clone() };
    let token = CancellationToken::new();
    let task = tokio::spawn(run_batch_consumer(
        "faultspoll",
        consumer,
        producer.clone(),
        handler,
        BatchSettings::new(100, Duration::from_millis(200)),
        token.clone(),
    ));
    testkit::eventually_with("the batch to be handled", Duration::from_secs(60), async || {
        let handled = handled.lock().unwrap();
        if handled.len() >= 5 { Ok(()) } else { Err(format!("{handled:?}")) }
    })
    .await;
    wait_committed_to_end(&settings, &group, &input, 1, Duration::from_secs(30)).await;
    // Time for a rebalance that a missed poll would have caused to show.
    tokio::time::sleep(Duration::from_secs(3)).await;
    // Read before stopping: closing the consumer revokes its partitions.
    let (generation, owned) = assignment.snapshot();
    token.cancel();
    task.await.unwrap().expect("commits");
    assert_eq!(generation, 1, "one assignment and no revocation; owned now: {owned:?}");
    assert_eq!(*handled.lock().unwrap(), vec![0, 1, 2, 3, 4], "each record handled once, in order");
}

#[tokio::test]
async fn created_topics_get_the_configured_replication_or_min_3_brokers() {
    let settings = settings().await;
    let meta: BaseConsumer = ClientConfig::new().set("bootstrap.servers", &settings.bootstrap).create().unwrap();
    let brokers = meta.fetch_metadata(None, Duration::from_secs(10)).unwrap().brokers().len();
    let replicas = |topic: &str| {
        let m = meta.fetch_metadata(Some(topic), Duration::from_secs(10)).unwrap();
        m.topics()[0].partitions()[0].replicas().len()
    };

    let default = testkit::unique_name("replication-default");
    settings.ensure_topics(&[TopicSpec::new(&default, 1)]).await.expect("created");
    assert_eq!(replicas(&default), brokers.min(3), "min(3, brokers) with {brokers} brokers");
    assert_eq!(settings.default_replication().await.unwrap(), brokers.min(3) as i32);

    // One more replica than the cluster has brokers: the configured factor is used, and refused.
    let mut configured = settings.clone();
    let factor = brokers as i32 + 1;
    configured.topic_replication = Some(factor);
    assert_eq!(configured.default_replication().await.unwrap(), factor);
    let topic = testkit::unique_name("replication-configured");
    let err = configured.ensure_topics(&[TopicSpec::new(&topic, 1)]).await.expect_err("more replicas than brokers");
    assert!(err.to_string().to_lowercase().contains("replication"), "{err}");
}

/// Records the payload bytes of every batch it is offered.
struct BatchBytes(Arc<Mutex<Vec<usize>>>);

impl BatchHandler for BatchBytes {
    async fn handle_batch(&mut self, records: &[Record]) -> Result<Vec<Disposition>, BoxError> {
        self.0.lock().unwrap().push(records.iter().map(|r| r.payload.as_ref().map_or(0, Vec::len)).sum());
        Ok(vec![Disposition::Done; records.len()])
    }
}

#[tokio::test]
async fn batches_are_bounded_by_bytes_as_well_as_count() {
    let settings = settings().await;
    let input = testkit::unique_name("batch-bytes");
    let group = testkit::unique_name("batch-bytes");
    settings.ensure_topics(&stage_topics(&[&input], &[], 1)).await.expect("topics");
    let producer = settings.producer("batch-bytes-test").expect("producer");
    for _ in 0..20 {
        publish(&producer, &input, "node-a", &[b'x'; 1000], &[]).await.expect("published");
    }
    let seen = Arc::new(Mutex::new(Vec::new()));
    let consumer = settings.consumer("faultsbytes", &group, &[&input], Readiness::default().register("a")).unwrap();
    let token = CancellationToken::new();
    let mut batch = BatchSettings::new(100, Duration::from_millis(500));
    batch.limits.max_bytes = 3500;
    let task = tokio::spawn(run_batch_consumer(
        "faultsbytes",
        consumer,
        producer.clone(),
        BatchBytes(seen.clone()),
        batch,
        token.clone(),
    ));
    wait_committed_to_end(&settings, &group, &input, 1, Duration::from_secs(60)).await;
    token.cancel();
    task.await.unwrap().expect("commits");
    let sizes = seen.lock().unwrap().clone();
    assert_eq!(sizes.iter().sum::<usize>(), 20_000, "every record handled once: {sizes:?}");
    // Keys and headers count too: three 1000-byte records and their keys fit in 3500 bytes.
    assert!(sizes.iter().all(|s| *s <= 3000), "{sizes:?}");
}
