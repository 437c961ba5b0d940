//! Two classifier replicas in one consumer group, as processes against the real Kafka and
//! PostgreSQL: state is owned per partition. An incident opens on the replica that owns the node;
//! that replica stops, the node's partition moves to the other, which rebuilds the node's state
//! from Postgres before handling its next record: the proof of repair then closes the incident
//! with exactly one recovery verdict, as one classifier would have issued. (Before, the survivor
//! decided from the snapshot it took at its own start, which did not hold the incident: the node
//! would never have been released.)

use std::time::Duration;

use gpumedic_runtime::kafka::{KafkaSettings, Record, publish, stage_topics};
use gpumedic_schemas::Verdict;
use gpumedic_testkit::{self as testkit, ServiceProcess};
use rdkafka::consumer::{Consumer as _, StreamConsumer};

const BIN: &str = env!("CARGO_BIN_EXE_gpumedic-classifier");
const GPU: &str = "GPU-0000000a-bbbb-cccc-dddd-eeeeeeeeeeee";

/// The verdicts for `node` on `topic`, read until it has been quiet for a few seconds.
async fn verdicts_for(topic: &str, node: &str) -> Vec<Verdict> {
    let consumer: StreamConsumer = rdkafka::ClientConfig::new()
        .set("bootstrap.servers", testkit::kafka_bootstrap())
        .set("group.id", testkit::unique_name("reader"))
        .set("auto.offset.reset", "earliest")
        .set("enable.auto.commit", "false")
        .create()
        .unwrap();
    consumer.subscribe(&[topic]).unwrap();
    let mut all = Vec::new();
    while let Ok(Ok(m)) = tokio::time::timeout(Duration::from_secs(6), consumer.recv()).await {
        let r = Record::from_message(&m);
        if r.key.as_deref() == Some(node.as_bytes()) {
            all.push(gpumedic_schemas::decode(r.payload.as_deref().unwrap()).unwrap());
        }
    }
    all
}

/// How many verdicts a replica says it published.
async fn published(replica: &ServiceProcess) -> u64 {
    let Ok((_, body)) = testkit::http_get(replica.admin_addr(), "/metrics").await else { return 0 };
    body.lines()
        .filter(|l| l.starts_with("gpumedic_classifier_verdicts_total"))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum::<f64>() as u64
}

#[tokio::test]
async fn a_node_that_moves_to_the_other_replica_keeps_its_incident_and_is_released_once() {
    let bootstrap = testkit::require_kafka().await.unwrap_or_else(|e| panic!("{e}"));
    let admin = testkit::require_postgres().await.unwrap_or_else(|e| panic!("{e}"));
    let db = testkit::unique_name("replicas").replace('-', "_");
    let url = testkit::fresh_database(&admin, &db).await.expect("database");
    let [enriched_topic, verdicts_topic, actions_topic] =
        ["enriched", "verdicts", "actions"].map(|t| testkit::unique_name(&format!("replicas-{t}")));
    let settings =
        KafkaSettings { bootstrap: bootstrap.clone(), options: vec![], schema_registry: None, topic_replication: None };
    settings
        .ensure_topics(&stage_topics(&[&enriched_topic, &actions_topic], &[&verdicts_topic], 12))
        .await
        .expect("topics");
    let rules = std::env::temp_dir().join(testkit::unique_name("rules"));
    std::fs::create_dir_all(&rules).unwrap();
    std::fs::write(
        rules.join("79.yaml"),
        "rules:\n  - id: xid-79-fallen-off-the-bus\n    version: 1\n    description: GPU has fallen off the bus\n    scope: node\n    match:\n      - {kind: xid, xid: [79]}\n      - {kind: gpu_lost}\n    severity: critical\n    action: reboot_node\n    clear: {evidence: {healthy: true}, proof: reboot, quiet: 3s}\n",
    )
    .unwrap();
    let group = testkit::unique_name("classifier");
    let start = || {
        ServiceProcess::start(
            BIN,
            &[],
            &[
                ("GPUMEDIC_KAFKA_BOOTSTRAP", bootstrap.clone()),
                ("GPUMEDIC_GROUP", group.clone()),
                ("GPUMEDIC_ENRICHED_TOPIC", enriched_topic.clone()),
                ("GPUMEDIC_VERDICTS_TOPIC", verdicts_topic.clone()),
                ("GPUMEDIC_ACTIONS_TOPIC", actions_topic.clone()),
                ("GPUMEDIC_DATABASE_URL", url.clone()),
                ("GPUMEDIC_RULES_DIR", rules.display().to_string()),
                ("GPUMEDIC_TICK", "500ms".into()),
            ],
        )
        .expect("starts")
    };
    // Both replicas up before the fault: each took its snapshot (if any) before it.
    let mut replicas = vec![start(), start()];
    for r in &mut replicas {
        r.wait_ready(Duration::from_secs(90)).await.unwrap_or_else(|e| panic!("{e}"));
    }
    // Both hold partitions before anything is written: no record is caught in the rebalance the
    // second replica started.
    testkit::wait_group_stable(&group, 2, Duration::from_secs(90)).await.unwrap_or_else(|e| panic!("{e}"));

    let node = testkit::unique_name("replicas-node");
    let producer = settings.producer("replicas-test").unwrap();
    let fault = testkit::event(&node).xid(79).text("GPU has fallen off the bus.").gpu(GPU).boot("boot-before").build();
    publish(&producer, &enriched_topic, &node, &testkit::enriched(fault.clone()).encode(), &[]).await.unwrap();
    let opened = testkit::wait_for_record(
        &verdicts_topic,
        |r| r.key.as_deref() == Some(node.as_bytes()),
        Duration::from_secs(60),
    )
    .await
    .unwrap_or_else(|e| panic!("{e}"));
    let opened: Verdict = gpumedic_schemas::decode(opened.payload.as_deref().unwrap()).unwrap();
    assert!(!opened.recovery);

    // The replica that owns the node (the one that published) stops; the node moves.
    let mut owner = None;
    for (i, r) in replicas.iter().enumerate() {
        if published(r).await > 0 {
            owner = Some(i);
        }
    }
    let owner = owner.expect("one replica published the fault's verdict");
    let mut stopped = replicas.remove(owner);
    stopped.terminate(Duration::from_secs(20)).await.unwrap_or_else(|e| panic!("{e}"));
    let survivor = &mut replicas[0];
    assert_eq!(published(survivor).await, 0, "the other replica issued nothing for a node it did not own");

    // The proof of repair reaches the survivor: after the quiet period, one recovery.
    let repaired_at = chrono::Utc::now();
    publish(
        &producer,
        &enriched_topic,
        &node,
        &testkit::event(&node).gpu(GPU).boot("boot-after").enriched().encode(),
        &[],
    )
    .await
    .unwrap();
    testkit::wait_for_record(
        &verdicts_topic,
        |r| {
            r.key.as_deref() == Some(node.as_bytes())
                && gpumedic_schemas::decode::<Verdict>(r.payload.as_deref().unwrap_or_default())
                    .is_ok_and(|v| v.recovery)
        },
        Duration::from_secs(90),
    )
    .await
    .unwrap_or_else(|e| panic!("the survivor never released the node: {e}"));

    // Exactly what one classifier would have issued: the fault and one recovery, by id.
    let all = verdicts_for(&verdicts_topic, &node).await;
    let mut ids: Vec<(uuid::Uuid, bool)> = all.iter().map(|v| (v.verdict_id, v.recovery)).collect();
    ids.sort();
    ids.dedup();
    assert_eq!(ids.len(), 2, "{all:#?}");
    assert!(all.iter().all(|v| v.incident_id == opened.incident_id), "one incident: {all:#?}");
    let recovery = all.iter().find(|v| v.recovery).unwrap();
    assert!(recovery.issued_at >= repaired_at, "no recovery before the proof of repair");

    let pool = gpumedic_runtime::postgres::connect(&url, 2).await.unwrap();
    let (incidents, resolved): (i64, i64) =
        sqlx::query_as("SELECT count(*), count(resolved_at) FROM incidents WHERE node = $1")
            .bind(&node)
            .fetch_one(&pool)
            .await
            .unwrap();
    assert_eq!((incidents, resolved), (1, 1));
    survivor.terminate(Duration::from_secs(20)).await.unwrap_or_else(|e| panic!("{e}"));
    pool.close().await;
    std::fs::remove_dir_all(&rules).ok();
}
