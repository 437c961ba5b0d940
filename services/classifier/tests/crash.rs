//! Crash safety against the real Kafka and PostgreSQL: the classifier is SIGKILLed several times
//! while it works through a topic of enriched events, restarted each time, and once it has caught
//! up every event is in `health_events` exactly once, nothing else is, every verdict in Postgres
//! is unique and was published on the verdict topic, and every published verdict was recorded.

use std::collections::{HashMap, HashSet};
use std::time::Duration;

use gpumedic_runtime::kafka::{KafkaSettings, stage_topics};
use gpumedic_schemas::{EnrichedHealthEvent, Verdict};
use gpumedic_testkit as testkit;
use rdkafka::consumer::{Consumer as _, StreamConsumer};
use rdkafka::producer::{FutureProducer, FutureRecord};
use uuid::Uuid;

const BIN: &str = env!("CARGO_BIN_EXE_gpumedic-classifier");
const EVENTS: usize = 20_000;
const NODES: usize = 200;
const PARTITIONS: i32 = 12;

fn event(k: usize, prefix: &str, base: chrono::DateTime<chrono::Utc>) -> EnrichedHealthEvent {
    let node = format!("{prefix}-n{}", k % NODES);
    let gpu = format!("GPU-{:08x}-0000-0000-0000-000000000000", k % NODES);
    // Strictly increasing event time, so a rebuild from Postgres replays each node in order.
    let e = testkit::event(node).gpu(gpu).at(base + chrono::Duration::milliseconds(k as i64));
    let e = if k.is_multiple_of(97) {
        e.xid(79)
    } else if k.is_multiple_of(89) {
        e.xid(13)
    } else {
        e
    };
    e.enriched().enriched_at(base).build()
}

async fn count(pool: &sqlx::PgPool, sql: &'static str) -> i64 {
    sqlx::query_scalar(sql).fetch_one(pool).await.expect("count")
}

/// Every verdict id on `topic`, read to the end (the high watermarks), with how often each came.
async fn published_verdicts(bootstrap: &str, topic: &str) -> HashMap<Uuid, usize> {
    let consumer: StreamConsumer = rdkafka::ClientConfig::new()
        .set("bootstrap.servers", bootstrap)
        .set("group.id", testkit::unique_name("crash-reader"))
        .set("auto.offset.reset", "earliest")
        .set("enable.auto.commit", "false")
        .create()
        .expect("consumer");
    let mut total = 0i64;
    for p in 0..PARTITIONS {
        let (low, high) = consumer.fetch_watermarks(topic, p, Duration::from_secs(10)).expect("watermarks");
        total += high - low;
    }
    consumer.subscribe(&[topic]).expect("subscribe");
    let mut ids = HashMap::new();
    for _ in 0..total {
        let m = tokio::time::timeout(Duration::from_secs(60), consumer.recv())
            .await
            .expect("the verdict topic is read to its end within a minute")
            .expect("record");
        let record = gpumedic_runtime::kafka::Record::from_message(&m);
        let v: Verdict = gpumedic_schemas::decode(record.payload.as_deref().unwrap_or_default()).expect("a verdict");
        *ids.entry(v.verdict_id).or_insert(0) += 1;
    }
    ids
}

#[tokio::test]
async fn killed_mid_batch_and_restarted_it_loses_and_duplicates_nothing() {
    let bootstrap = testkit::require_kafka().await.unwrap_or_else(|e| panic!("{e}"));
    let admin = testkit::require_postgres().await.unwrap_or_else(|e| panic!("{e}"));
    let db = testkit::unique_name("crash").replace('-', "_");
    let url = testkit::fresh_database(&admin, &db).await.expect("database");
    let enriched = testkit::unique_name("crash-enriched");
    let verdicts = testkit::unique_name("crash-verdicts");
    let actions = testkit::unique_name("crash-actions");
    let settings =
        KafkaSettings { bootstrap: bootstrap.clone(), options: vec![], schema_registry: None, topic_replication: None };
    settings.ensure_topics(&stage_topics(&[&enriched, &actions], &[&verdicts], PARTITIONS)).await.expect("topics");

    // The whole stream is on the topic before the classifier starts, so it is always mid-stream.
    let prefix = testkit::unique_name("crash");
    let base = chrono::Utc::now() - chrono::Duration::minutes(30);
    let producer: FutureProducer = rdkafka::ClientConfig::new()
        .set("bootstrap.servers", &bootstrap)
        .set("linger.ms", "20")
        .set("queue.buffering.max.messages", "100000")
        .create()
        .expect("producer");
    let events: Vec<EnrichedHealthEvent> = (0..EVENTS).map(|k| event(k, &prefix, base)).collect();
    let ids: HashSet<Uuid> = events.iter().map(|e| e.event.event_id).collect();
    let sends = events.iter().map(|e| {
        let payload = gpumedic_schemas::encode(e).expect("encodes");
        let producer = &producer;
        let topic = &enriched;
        async move {
            producer
                .send(FutureRecord::to(topic).key(&e.event.node).payload(&payload), Duration::from_secs(60))
                .await
                .map_err(|(e, _)| e)
        }
    });
    futures::future::try_join_all(sends).await.expect("events produced");

    let env = [
        ("GPUMEDIC_KAFKA_BOOTSTRAP", bootstrap.clone()),
        ("GPUMEDIC_GROUP", testkit::unique_name("crash-classifier")),
        ("GPUMEDIC_DATABASE_URL", url.clone()),
        // Every event recorded, so each one's exactly-once recording can be checked.
        ("GPUMEDIC_PERSIST", "all".into()),
        ("GPUMEDIC_ENRICHED_TOPIC", enriched.clone()),
        ("GPUMEDIC_VERDICTS_TOPIC", verdicts.clone()),
        ("GPUMEDIC_ACTIONS_TOPIC", actions.clone()),
        // Small batches: many commits to land between.
        ("GPUMEDIC_BATCH_MAX", "200".into()),
        ("GPUMEDIC_LOG", "warn".into()),
    ];
    let pool = gpumedic_runtime::postgres::connect(&url, 2).await.expect("pool");
    let mut kills = Vec::new();
    for share in [5, 35, 65] {
        let threshold = (EVENTS * share / 100) as i64;
        let classifier = testkit::ServiceProcess::start(BIN, &[], &env).expect("starts");
        let deadline = tokio::time::Instant::now() + Duration::from_secs(180);
        loop {
            // The schema appears once the classifier has migrated the fresh database.
            let n: Option<i64> = sqlx::query_scalar("SELECT count(*) FROM health_events").fetch_one(&pool).await.ok();
            if n.is_some_and(|n| n >= threshold) {
                break;
            }
            assert!(tokio::time::Instant::now() < deadline, "the classifier made no progress to {threshold} events");
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        // Dropping the process kills it with SIGKILL: no shutdown, no commit, mid-batch.
        drop(classifier);
        kills.push(count(&pool, "SELECT count(*) FROM health_events").await);
    }
    assert!(
        kills.iter().all(|&n| n < EVENTS as i64),
        "every kill must land before the end of the stream to test anything: rows at each kill {kills:?}"
    );

    let mut classifier = testkit::ServiceProcess::start(BIN, &[], &env).expect("restarts");
    testkit::eventually("the classifier to catch up", Duration::from_secs(300), async || {
        (count(&pool, "SELECT count(*) FROM health_events").await >= EVENTS as i64).then_some(())
    })
    .await;
    let status = classifier.terminate(Duration::from_secs(30)).await.expect("stops");
    assert!(status.success(), "{status}");

    // Every event exactly once, and nothing else.
    let recorded: Vec<(Uuid, i64)> = sqlx::query_as("SELECT event_id, count(*) FROM health_events GROUP BY event_id")
        .fetch_all(&pool)
        .await
        .unwrap();
    let twice: Vec<&(Uuid, i64)> = recorded.iter().filter(|(_, n)| *n != 1).collect();
    assert!(twice.is_empty(), "events recorded more than once: {twice:?}");
    let recorded: HashSet<Uuid> = recorded.into_iter().map(|(id, _)| id).collect();
    assert_eq!(recorded.len(), EVENTS);
    assert_eq!(recorded, ids, "the recorded events are exactly the produced ones");

    // Verdicts: unique in Postgres, each one published, and each published one recorded.
    let in_db: Vec<Uuid> = sqlx::query_scalar("SELECT verdict_id FROM verdicts").fetch_all(&pool).await.unwrap();
    let unique: HashSet<Uuid> = in_db.iter().copied().collect();
    assert_eq!(unique.len(), in_db.len(), "verdict ids are unique");
    assert!(unique.len() >= NODES / 2, "the Xids produced verdicts: {}", unique.len());
    let published = published_verdicts(&bootstrap, &verdicts).await;
    let published_ids: HashSet<Uuid> = published.keys().copied().collect();
    let missing: Vec<&Uuid> = unique.difference(&published_ids).collect();
    assert!(missing.is_empty(), "verdicts recorded but never published: {missing:?}");
    let unrecorded: Vec<&Uuid> = published_ids.difference(&unique).collect();
    assert!(unrecorded.is_empty(), "verdicts published but never recorded: {unrecorded:?}");
    // Each verdict's incident is recorded once.
    let incidents = count(&pool, "SELECT count(DISTINCT incident_id) FROM verdicts").await;
    assert_eq!(incidents, count(&pool, "SELECT count(*) FROM incidents").await);
    let republished = published.values().filter(|&&n| n > 1).count();
    println!("rows at each kill: {kills:?}; verdicts: {}; republished after a crash: {republished}", unique.len());

    pool.close().await;
    sqlx::query(sqlx::AssertSqlSafe(format!("DROP DATABASE \"{db}\" WITH (FORCE)"))).execute(&admin).await.ok();
}
