//! Lemons against the real Kafka and PostgreSQL, with the default rules (docs/decisions.md,
//! "Lemons"): a GPU with three repaired uncorrectable ECC faults within the window is a lemon. After
//! two faults, each repaired (the volatile counter back at zero, then quiet), nothing more happens.
//! The third fault recovers too, but a lemon incident (contact_support, critical) opens beside it,
//! naming the three incidents, and stays open: the remediator keeps the node out for it. The
//! `lemons` view and the API's `/api/v1/lemons` list it; a complete inventory of the node in which
//! a new GPU has taken the lemon's place closes the lemon incident. A GPU moved to another node
//! keeps its history: its third fault there makes it a lemon on the new node.

use std::time::Duration;

use chrono::{DateTime, Utc};
use gpumedic_runtime::kafka::{KafkaSettings, Producer, Record, publish, stage_topics};
use gpumedic_schemas::Verdict;
use gpumedic_schemas::enriched::NodeContext;
use gpumedic_schemas::health::{Detail, EccDetail, GpuIdentity, GpuInventoryDetail, Source};
use gpumedic_schemas::verdict::RecommendedAction;
use gpumedic_testkit::{self as testkit, ServiceProcess};
use rdkafka::consumer::{Consumer as _, StreamConsumer};
use sqlx::PgPool;
use uuid::Uuid;

const BIN: &str = env!("CARGO_BIN_EXE_gpumedic-classifier");

fn ecc(node: &str, gpu: &str, volatile: i64, aggregate: i64, at: DateTime<Utc>) -> Vec<u8> {
    let detail = Detail::Ecc(EccDetail {
        single_bit_volatile: Some(0),
        double_bit_volatile: Some(volatile),
        single_bit_aggregate: Some(0),
        double_bit_aggregate: Some(aggregate),
        location: None,
    });
    let identity = GpuIdentity {
        index: Some(2),
        uuid: Some(gpu.into()),
        serial: Some(format!("serial-{gpu}")),
        ..GpuIdentity::default()
    };
    let e = testkit::event(node).detail(Source::Nvml, detail).healthy_flag(volatile == 0).gpu(gpu).gpu_index(2);
    e.at(at).boot(format!("boot-{node}")).enriched().gpu(identity).encode()
}

fn inventory(node: &str, gpus: &[&str], at: DateTime<Utc>) -> Vec<u8> {
    let identities: Vec<GpuIdentity> = gpus
        .iter()
        .enumerate()
        .map(|(i, g)| GpuIdentity {
            index: i32::try_from(i).ok(),
            uuid: Some((*g).to_owned()),
            ..GpuIdentity::default()
        })
        .collect();
    let expected = i32::try_from(gpus.len()).ok();
    let detail = Detail::GpuInventory(GpuInventoryDetail { gpus: identities, reason: "change".into(), expected });
    let e = testkit::event(node).detail(Source::Nvml, detail).healthy_flag(true).at(at).boot(format!("boot-{node}"));
    e.enriched().context(NodeContext { expected_gpus: expected, ..NodeContext::default() }).encode()
}

/// One fault of `gpu` on `node` from `t` and its repair: the counter up (held past the rule's
/// 30 s), back at zero after a reset at +30m, and zero readings until +50m, past the 10 m quiet
/// period, so the fault's incident recovers.
async fn fault_and_repair(p: &Producer, topic: &str, node: &str, gpu: &str, t: DateTime<Utc>, aggregate: i64) {
    let m = |min: i64| t + chrono::Duration::minutes(min);
    let readings = [(0, 2), (1, 2), (30, 0), (35, 0), (45, 0), (50, 0)];
    for (min, volatile) in readings {
        publish(p, topic, node, &ecc(node, gpu, volatile, aggregate, m(min)), &[]).await.expect("published");
    }
}

/// Every verdict on `topic`, read until it has been quiet for a few seconds.
async fn all_verdicts(topic: &str) -> Vec<Verdict> {
    let consumer: StreamConsumer = rdkafka::ClientConfig::new()
        .set("bootstrap.servers", testkit::kafka_bootstrap())
        .set("group.id", testkit::unique_name("reader"))
        .set("auto.offset.reset", "earliest")
        .set("enable.auto.commit", "false")
        .create()
        .expect("consumer");
    consumer.subscribe(&[topic]).expect("subscribed");
    let mut all = Vec::new();
    while let Ok(Ok(m)) = tokio::time::timeout(Duration::from_secs(6), consumer.recv()).await {
        let r = Record::from_message(&m);
        all.push(gpumedic_schemas::decode(r.payload.as_deref().expect("payload")).expect("a verdict"));
    }
    all
}

/// Waits until `node` has `want` resolved ECC incidents, or panics after a minute.
async fn wait_resolved(pool: &PgPool, node: &str, want: i64) {
    let what = format!("{node}: {want} ECC incidents resolved");
    testkit::eventually_with(&what, Duration::from_secs(60), async || {
        let n: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM incidents WHERE node = $1 AND rule_id = 'ecc-double-bit' AND resolved_at IS NOT NULL",
        )
        .bind(node)
        .fetch_one(pool)
        .await
        .expect("query");
        if n >= want { Ok(()) } else { Err(format!("{n} of {want}")) }
    })
    .await;
}

/// The topics, database and classifier of one test.
struct Bed {
    enriched: String,
    verdicts: String,
    pool: PgPool,
    producer: Producer,
    classifier: ServiceProcess,
}

async fn bed(name: &str) -> Bed {
    let bootstrap = testkit::require_kafka().await.unwrap_or_else(|e| panic!("{e}"));
    let admin = testkit::require_postgres().await.unwrap_or_else(|e| panic!("{e}"));
    let url = testkit::fresh_database(&admin, &testkit::unique_name(name).replace('-', "_")).await.expect("database");
    let [enriched, verdicts, actions] =
        ["enriched", "verdicts", "actions"].map(|t| testkit::unique_name(&format!("{name}-{t}")));
    let settings =
        KafkaSettings { bootstrap: bootstrap.clone(), options: vec![], schema_registry: None, topic_replication: None };
    settings.ensure_topics(&stage_topics(&[&enriched, &actions], &[&verdicts], 3)).await.expect("topics");
    let mut classifier = ServiceProcess::start(
        BIN,
        &[],
        &[
            ("GPUMEDIC_KAFKA_BOOTSTRAP", bootstrap),
            ("GPUMEDIC_GROUP", testkit::unique_name("classifier")),
            ("GPUMEDIC_ENRICHED_TOPIC", enriched.clone()),
            ("GPUMEDIC_VERDICTS_TOPIC", verdicts.clone()),
            ("GPUMEDIC_ACTIONS_TOPIC", actions),
            ("GPUMEDIC_DATABASE_URL", url.clone()),
            // The events are stamped hours ago and the engine runs on their time: a tick at the
            // wall clock would move the node's clock past them. Deadlines pass on later events.
            ("GPUMEDIC_TICK", "1h".into()),
            ("GPUMEDIC_API_AUTH", "none".into()),
        ],
    )
    .expect("starts");
    classifier.wait_ready(Duration::from_secs(90)).await.unwrap_or_else(|e| panic!("{e}"));
    let pool = gpumedic_runtime::postgres::connect(&url, 2).await.expect("pool");
    let producer = settings.producer(name).expect("producer");
    Bed { enriched, verdicts, pool, producer, classifier }
}

fn lemons_of<'a>(verdicts: &'a [Verdict], node: &str) -> Vec<&'a Verdict> {
    verdicts.iter().filter(|v| v.node == node && v.rule_id.starts_with("lemon-")).collect()
}

#[tokio::test]
async fn the_third_repaired_fault_on_one_gpu_keeps_it_out_and_says_why() {
    let mut b = bed("lemons").await;
    let node = testkit::unique_name("lemon-node");
    let gpu = format!("GPU-{}", Uuid::new_v4());
    // Six hours ago, so the faults' own times are an hour apart, all within the 30-day window.
    let t0 = DateTime::from_timestamp_micros((Utc::now() - chrono::Duration::hours(6)).timestamp_micros()).unwrap();
    let hour = |h: i64| t0 + chrono::Duration::hours(h);

    // Two faults, each repaired: no lemon.
    fault_and_repair(&b.producer, &b.enriched, &node, &gpu, hour(0), 2).await;
    fault_and_repair(&b.producer, &b.enriched, &node, &gpu, hour(1), 4).await;
    wait_resolved(&b.pool, &node, 2).await;
    let after_two = all_verdicts(&b.verdicts).await;
    assert!(lemons_of(&after_two, &node).is_empty(), "two faults are no lemon: {after_two:#?}");
    let lemon_rows: i64 = sqlx::query_scalar("SELECT count(*) FROM lemons WHERE node = $1")
        .bind(&node)
        .fetch_one(&b.pool)
        .await
        .expect("the lemons view");
    assert_eq!(lemon_rows, 0);

    // The third: it recovers too, but the GPU is a lemon now.
    fault_and_repair(&b.producer, &b.enriched, &node, &gpu, hour(2), 6).await;
    wait_resolved(&b.pool, &node, 3).await;
    let verdicts = all_verdicts(&b.verdicts).await;
    let lemons = lemons_of(&verdicts, &node);
    assert_eq!(lemons.len(), 1, "{verdicts:#?}");
    let lemon = lemons[0];
    assert_eq!(
        (lemon.rule_id.as_str(), lemon.action, lemon.severity, lemon.recovery),
        ("lemon-gpu", RecommendedAction::ContactSupport, gpumedic_schemas::Severity::Critical, false)
    );
    assert_eq!(lemon.entity.gpu_uuid.as_deref(), Some(gpu.as_str()));
    let faults: Vec<Uuid> = sqlx::query_scalar(
        "SELECT incident_id FROM incidents WHERE node = $1 AND rule_id = 'ecc-double-bit' ORDER BY opened_at",
    )
    .bind(&node)
    .fetch_all(&b.pool)
    .await
    .expect("incidents");
    assert_eq!(faults.len(), 3);
    assert!(lemon.reason.contains("3 hardware-class incidents within 30d"), "{}", lemon.reason);
    // The reason names the three, oldest first.
    let at: Vec<usize> = faults
        .iter()
        .map(|id| lemon.reason.find(&id.to_string()).unwrap_or_else(|| panic!("{id} unnamed: {}", lemon.reason)))
        .collect();
    assert!(at.windows(2).all(|w| w[0] < w[1]), "oldest first: {}", lemon.reason);
    // The lemon has no recovery, while all three faults have theirs.
    assert!(!verdicts.iter().any(|v| v.incident_id == lemon.incident_id && v.recovery), "{verdicts:#?}");
    let (open, hardware, history): (bool, i64, serde_json::Value) =
        sqlx::query_as("SELECT open, hardware_incidents, history FROM lemons WHERE incident_id = $1")
            .bind(lemon.incident_id)
            .fetch_one(&b.pool)
            .await
            .expect("the lemon in the view");
    assert!(open);
    assert_eq!(hardware, 3);
    let listed: Vec<String> =
        history.as_array().unwrap().iter().map(|h| h["incident_id"].as_str().unwrap().to_owned()).collect();
    assert_eq!(listed, faults.iter().map(Uuid::to_string).collect::<Vec<_>>());

    // What `gpumedic incidents --lemons` prints from.
    let (code, body) = testkit::http_get(b.classifier.admin_addr(), "/api/v1/lemons?status=open").await.unwrap();
    assert_eq!(code, 200, "{body}");
    let listed: serde_json::Value = serde_json::from_str(&body).unwrap();
    let mine: Vec<&serde_json::Value> =
        listed.as_array().unwrap().iter().filter(|l| l["node"].as_str() == Some(node.as_str())).collect();
    assert_eq!(mine.len(), 1, "{listed:#}");
    assert_eq!((mine[0]["part"].as_str(), mine[0]["gpu"].as_str()), (Some("gpu"), Some(gpu.as_str())));

    // The GPU is replaced: the node's complete inventory names a new GPU in its place, and the
    // lemon incident closes with a recovery verdict (the remediator then returns the node).
    let new_gpu = format!("GPU-{}", Uuid::new_v4());
    publish(&b.producer, &b.enriched, &node, &inventory(&node, &[&new_gpu], hour(4)), &[]).await.expect("published");
    testkit::eventually("the lemon to close after its GPU was replaced", Duration::from_secs(60), async || {
        let open = sqlx::query_scalar::<_, bool>("SELECT open FROM lemons WHERE incident_id = $1")
            .bind(lemon.incident_id)
            .fetch_one(&b.pool)
            .await
            .expect("the lemon in the view");
        (!open).then_some(())
    })
    .await;
    let verdicts = all_verdicts(&b.verdicts).await;
    let closed: Vec<&Verdict> = verdicts.iter().filter(|v| v.incident_id == lemon.incident_id && v.recovery).collect();
    assert_eq!(closed.len(), 1, "{verdicts:#?}");
    assert!(closed[0].reason.contains("no longer in node"), "{}", closed[0].reason);

    b.classifier.terminate(Duration::from_secs(20)).await.unwrap_or_else(|e| panic!("{e}"));
    b.pool.close().await;
}

#[tokio::test]
async fn a_gpu_moved_to_another_node_keeps_its_history() {
    let mut b = bed("lemon-moved").await;
    let first = testkit::unique_name("lemon-from");
    let second = testkit::unique_name("lemon-to");
    let gpu = format!("GPU-{}", Uuid::new_v4());
    let t0 = DateTime::from_timestamp_micros((Utc::now() - chrono::Duration::hours(6)).timestamp_micros()).unwrap();
    let hour = |h: i64| t0 + chrono::Duration::hours(h);

    fault_and_repair(&b.producer, &b.enriched, &first, &gpu, hour(0), 2).await;
    fault_and_repair(&b.producer, &b.enriched, &first, &gpu, hour(1), 4).await;
    wait_resolved(&b.pool, &first, 2).await;
    // The GPU goes into another node, and fails there.
    fault_and_repair(&b.producer, &b.enriched, &second, &gpu, hour(3), 6).await;
    wait_resolved(&b.pool, &second, 1).await;
    let verdicts = all_verdicts(&b.verdicts).await;
    assert!(lemons_of(&verdicts, &first).is_empty(), "{verdicts:#?}");
    let lemons = lemons_of(&verdicts, &second);
    assert_eq!(lemons.len(), 1, "{verdicts:#?}");
    assert_eq!((lemons[0].rule_id.as_str(), lemons[0].entity.gpu_uuid.as_deref()), ("lemon-gpu", Some(gpu.as_str())));
    assert!(lemons[0].reason.contains(&first) && lemons[0].reason.contains(&second), "{}", lemons[0].reason);

    b.classifier.terminate(Duration::from_secs(20)).await.unwrap_or_else(|e| panic!("{e}"));
    b.pool.close().await;
}
