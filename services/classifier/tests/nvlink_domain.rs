//! One NVLink root fault across the nodes of an NVLink domain, as two classifier replicas in one
//! consumer group against the real Kafka and PostgreSQL, with the default rules: an Xid 149 on a
//! GPU of node A in domain D opens one incident; the Xid 145 its peers on nodes B and C of D log
//! seconds later are recorded as evidence on it (naming each peer's node and GPU) and open nothing
//! of their own, whichever replica owns B and C; an Xid 145 on node E of another domain D2 is its
//! own incident.

use std::time::Duration;

use chrono::{DateTime, Utc};
use gpumedic_runtime::kafka::{KafkaSettings, Record, publish, record_headers, stage_topics};
use gpumedic_schemas::health::GpuIdentity;
use gpumedic_schemas::{HealthEvent, Verdict};
use gpumedic_testkit::{self as testkit, ServiceProcess};
use rdkafka::consumer::{Consumer as _, StreamConsumer};
use sqlx::PgPool;
use uuid::Uuid;

const BIN: &str = env!("CARGO_BIN_EXE_gpumedic-classifier");

fn xid(node: &str, gpu: &str, domain: &str, code: i32, at: DateTime<Utc>) -> (HealthEvent, Vec<u8>) {
    let e = testkit::event(node).xid(code).gpu(gpu).boot("boot-1").at(at).build();
    let identity = GpuIdentity {
        index: Some(0),
        uuid: Some(gpu.into()),
        nvlink_domain: Some(domain.into()),
        ..GpuIdentity::default()
    };
    let bytes = testkit::enriched(e.clone()).gpu(identity).encode();
    (e, bytes)
}

/// A recorded peer: event, node, GPU, root node, root GPU.
type PeerRow = (Uuid, String, Option<String>, String, Option<String>);

/// Every verdict on `topic`, read until it has been quiet for a few seconds.
async fn all_verdicts(topic: &str) -> Vec<Verdict> {
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
        all.push(gpumedic_schemas::decode(r.payload.as_deref().unwrap()).unwrap());
    }
    all
}

/// Waits until `query` (a count) reaches `want`, or panics with `what` after a minute.
async fn wait_count(pool: &PgPool, query: &'static str, bind: &str, want: i64, what: &str) {
    testkit::eventually_with(what, Duration::from_secs(60), async || {
        let n: i64 = sqlx::query_scalar(query).bind(bind).fetch_one(pool).await.unwrap();
        if n >= want { Ok(()) } else { Err(format!("{n} of {want}")) }
    })
    .await;
}

#[tokio::test]
async fn peers_on_other_nodes_of_the_domain_are_evidence_on_the_one_root_incident() {
    let bootstrap = testkit::require_kafka().await.unwrap_or_else(|e| panic!("{e}"));
    let admin = testkit::require_postgres().await.unwrap_or_else(|e| panic!("{e}"));
    let db = testkit::unique_name("nvlink").replace('-', "_");
    let url = testkit::fresh_database(&admin, &db).await.expect("database");
    let [enriched_topic, verdicts_topic, actions_topic] =
        ["enriched", "verdicts", "actions"].map(|t| testkit::unique_name(&format!("nvlink-{t}")));
    let settings =
        KafkaSettings { bootstrap: bootstrap.clone(), options: vec![], schema_registry: None, topic_replication: None };
    settings
        .ensure_topics(&stage_topics(&[&enriched_topic, &actions_topic], &[&verdicts_topic], 12))
        .await
        .expect("topics");
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
                ("GPUMEDIC_TICK", "500ms".into()),
                // The API's authentication has its own test (services/cli/tests/api_auth.rs).
                ("GPUMEDIC_API_AUTH", "none".into()),
            ],
        )
        .expect("starts")
    };
    // Two replicas: the nodes' partitions are shared between them, so the peers' root is found
    // in the incident store when another replica owns it.
    let mut replicas = vec![start(), start()];
    for r in &mut replicas {
        r.wait_ready(Duration::from_secs(90)).await.unwrap_or_else(|e| panic!("{e}"));
    }
    // Both hold partitions before anything is written: no record is caught in the rebalance the
    // second replica started.
    testkit::wait_group_stable(&group, 2, Duration::from_secs(90)).await.unwrap_or_else(|e| panic!("{e}"));

    let [a, b, c, e] = ["a", "b", "c", "e"].map(|n| testkit::unique_name(&format!("nvl72-{n}")));
    let domain = format!("{}.1", Uuid::new_v4());
    let other_domain = format!("{}.2", Uuid::new_v4());
    let gpu = |node: &str| format!("GPU-{}", Uuid::new_v5(&Uuid::NAMESPACE_OID, node.as_bytes()));
    let producer = settings.producer("nvlink-test").unwrap();
    let t0 = DateTime::from_timestamp_micros(Utc::now().timestamp_micros()).unwrap();

    // The root: an NVLink5 error on A's GPU.
    let (root, bytes) = xid(&a, &gpu(&a), &domain, 149, t0);
    publish(&producer, &enriched_topic, &a, &bytes, &[]).await.unwrap();
    let opened =
        testkit::wait_for_record(&verdicts_topic, |r| r.key.as_deref() == Some(a.as_bytes()), Duration::from_secs(60))
            .await
            .unwrap_or_else(|e| panic!("{e}"));
    // The verdict's record carries a traceparent; its trace id is recorded with the verdict.
    let traceparent =
        String::from_utf8_lossy(opened.header(record_headers::TRACEPARENT).expect("a traceparent")).into_owned();
    let trace_id = traceparent.split('-').nth(1).expect("a trace id").to_owned();
    let opened: Verdict = gpumedic_schemas::decode(opened.payload.as_deref().unwrap()).unwrap();
    assert_eq!(opened.evidence, [root.event_id]);
    let pool = gpumedic_runtime::postgres::connect(&url, 2).await.unwrap();
    let root_id = opened.incident_id.to_string();
    wait_count(&pool, "SELECT count(*) FROM incidents WHERE incident_id::text = $1", &root_id, 1, "root recorded")
        .await;

    // Seconds later, the peers: B and C in the root's domain, E in another one.
    let later = t0 + chrono::Duration::seconds(5);
    let mut peers = Vec::new();
    for (node, d) in [(&b, &domain), (&c, &domain), (&e, &other_domain)] {
        let (event, bytes) = xid(node, &gpu(node), d, 145, later);
        publish(&producer, &enriched_topic, node, &bytes, &[]).await.unwrap();
        peers.push(event);
    }
    // E's own incident opens; B's and C's events are recorded as the root's evidence.
    testkit::wait_for_record(&verdicts_topic, |r| r.key.as_deref() == Some(e.as_bytes()), Duration::from_secs(60))
        .await
        .unwrap_or_else(|err| panic!("E's own incident: {err}"));
    // The verdict is published before its batch is committed: E's row follows within moments.
    wait_count(&pool, "SELECT count(*) FROM incidents WHERE node = $1", &e, 1, "E's incident recorded").await;
    for node in [&b, &c] {
        wait_count(&pool, "SELECT count(*) FROM health_events WHERE node = $1", node, 1, "peer event recorded").await;
    }

    // Every incident of the four nodes, named in each failure below.
    let nodes = vec![a.clone(), b.clone(), c.clone(), e.clone()];
    let incidents: Vec<(Uuid, String, Option<String>)> =
        sqlx::query_as("SELECT incident_id, node, nvlink_domain FROM incidents WHERE node = ANY($1) ORDER BY node")
            .bind(&nodes)
            .fetch_all(&pool)
            .await
            .unwrap();
    let rows: Vec<PeerRow> = sqlx::query_as(
        "SELECT event_id, node, gpu_uuid, root_node, root_gpu_uuid FROM sympathetic_evidence
          WHERE incident_id = $1 ORDER BY node",
    )
    .bind(opened.incident_id)
    .fetch_all(&pool)
    .await
    .unwrap();
    let mut want = vec![
        (peers[0].event_id, b.clone(), Some(gpu(&b)), a.clone(), Some(gpu(&a))),
        (peers[1].event_id, c.clone(), Some(gpu(&c)), a.clone(), Some(gpu(&a))),
    ];
    want.sort_by(|x, y| x.1.cmp(&y.1));
    assert_eq!(
        rows, want,
        "B's and C's errors are evidence on A's incident, naming each peer; incidents {incidents:#?}"
    );

    // Exactly one incident for A, B and C (A's); E has its own.
    let by_node: Vec<&str> = incidents.iter().map(|(_, n, _)| n.as_str()).collect();
    let mut expected = vec![a.as_str(), e.as_str()];
    expected.sort();
    assert_eq!(by_node, expected, "{incidents:#?}");
    let root_row = incidents.iter().find(|(_, n, _)| n == &a).unwrap();
    assert_eq!((root_row.0, root_row.2.as_deref()), (opened.incident_id, Some(domain.as_str())));
    assert_eq!(incidents.iter().find(|(_, n, _)| n == &e).unwrap().2, None, "an echo is no root for others");

    // No verdict for B or C on the bus.
    let verdicts = all_verdicts(&verdicts_topic).await;
    let keyed: Vec<&str> = verdicts.iter().map(|v| v.node.as_str()).filter(|n| nodes.iter().any(|x| x == n)).collect();
    assert!(keyed.iter().all(|n| *n == a || *n == e), "{verdicts:#?}");

    // The incident API (what `gpumedic incidents show` reads) lists the peers.
    let mut listed = None;
    for r in &replicas {
        let (code, body) = testkit::http_get(r.admin_addr(), &format!("/api/v1/incidents/{root_id}")).await.unwrap();
        assert_eq!(code, 200, "{body}");
        listed = Some(serde_json::from_str::<serde_json::Value>(&body).unwrap());
    }
    let detail = listed.unwrap();
    assert_eq!(
        detail["verdicts"][0]["trace_id"].as_str(),
        Some(trace_id.as_str()),
        "the incident API gives the verdict's trace id (traceparent {traceparent}): {detail:#}"
    );
    let mut peer_nodes: Vec<String> =
        detail["peers"].as_array().unwrap().iter().map(|p| p["node"].as_str().unwrap().to_owned()).collect();
    peer_nodes.sort();
    let mut bc = vec![b.clone(), c.clone()];
    bc.sort();
    assert_eq!(peer_nodes, bc, "{detail:#}");

    for r in &mut replicas {
        r.terminate(Duration::from_secs(20)).await.unwrap_or_else(|e| panic!("{e}"));
    }
    pool.close().await;
}
