//! The classifier as a process against the real Kafka and PostgreSQL, on topics of its own: an enriched Xid 79 becomes a
//! critical reboot verdict and an open incident; healthy evidence held for the quiet period
//! becomes a recovery verdict and a resolved incident; garbage goes to the dead-letter topic.

use std::time::Duration;

use gpumedic_runtime::kafka::{KafkaSettings, dead_letter_topic, dlq_headers, publish, stage_topics};
use gpumedic_schemas::Verdict;
use gpumedic_schemas::verdict::{RecommendedAction, Severity};
use gpumedic_testkit as testkit;

const BIN: &str = env!("CARGO_BIN_EXE_gpumedic-classifier");
const GPU: &str = "GPU-aaaaaaaa-bbbb-cccc-dddd-eeeeeeeeeeee";

fn verdict_for(node: &str, recovery: bool) -> impl FnMut(&gpumedic_runtime::kafka::Record) -> bool + '_ {
    move |r| {
        r.key.as_deref() == Some(node.as_bytes())
            && gpumedic_schemas::decode::<Verdict>(r.payload.as_deref().unwrap_or_default())
                .is_ok_and(|v| v.recovery == recovery)
    }
}

#[tokio::test]
async fn xid79_opens_an_incident_and_healthy_evidence_resolves_it() {
    let bootstrap = testkit::require_kafka().await.unwrap_or_else(|e| panic!("{e}"));
    let admin = testkit::require_postgres().await.unwrap_or_else(|e| panic!("{e}"));
    let db = testkit::unique_name("classify").replace('-', "_");
    let url = testkit::fresh_database(&admin, &db).await.expect("database");
    let enriched_topic = testkit::unique_name("classify-enriched");
    let verdicts_topic = testkit::unique_name("classify-verdicts");
    let actions_topic = testkit::unique_name("classify-actions");
    let settings =
        KafkaSettings { bootstrap: bootstrap.clone(), options: vec![], schema_registry: None, topic_replication: None };
    settings
        .ensure_topics(&stage_topics(&[&enriched_topic, &actions_topic], &[&verdicts_topic], 12))
        .await
        .expect("topics");

    // The default Xid 79 rule, with a quiet period short enough for a test.
    let rules = std::env::temp_dir().join(testkit::unique_name("rules"));
    std::fs::create_dir_all(&rules).unwrap();
    std::fs::write(
        rules.join("79.yaml"),
        "rules:\n  - id: xid-79-fallen-off-the-bus\n    version: 1\n    description: GPU has fallen off the bus\n    scope: node\n    match:\n      - {kind: xid, xid: [79]}\n      - {kind: gpu_lost}\n    severity: critical\n    action: reboot_node\n    clear: {evidence: {healthy: true}, proof: reboot, quiet: 3s}\n",
    )
    .unwrap();

    let mut classifier = testkit::ServiceProcess::start(
        BIN,
        &[],
        &[
            ("GPUMEDIC_KAFKA_BOOTSTRAP", bootstrap),
            // Topics of its own: not behind the traffic other tests put on the shared ones.
            ("GPUMEDIC_GROUP", testkit::unique_name("classifier")),
            ("GPUMEDIC_ENRICHED_TOPIC", enriched_topic.clone()),
            ("GPUMEDIC_VERDICTS_TOPIC", verdicts_topic.clone()),
            ("GPUMEDIC_ACTIONS_TOPIC", actions_topic.clone()),
            ("GPUMEDIC_DATABASE_URL", url.clone()),
            ("GPUMEDIC_RULES_DIR", rules.display().to_string()),
            ("GPUMEDIC_TICK", "500ms".into()),
            // The API's authentication has its own test (services/cli/tests/api_auth.rs).
            ("GPUMEDIC_API_AUTH", "none".into()),
        ],
    )
    .expect("starts");
    classifier.wait_ready(Duration::from_secs(60)).await.unwrap_or_else(|e| panic!("{e}"));

    let node = testkit::unique_name("cls-node");
    let producer = settings.producer("classifier-test").unwrap();
    let fault = testkit::event(&node).xid(79).text("GPU has fallen off the bus.").gpu(GPU).boot("boot-before").build();
    publish(&producer, &enriched_topic, &node, &testkit::enriched(fault.clone()).encode(), &[]).await.unwrap();
    // The same event again (a redelivery) must not produce a second verdict.
    publish(&producer, &enriched_topic, &node, &testkit::enriched(fault.clone()).encode(), &[]).await.unwrap();

    let opened = testkit::wait_for_record(&verdicts_topic, verdict_for(&node, false), Duration::from_secs(60))
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let v: Verdict = gpumedic_schemas::decode(opened.payload.as_deref().unwrap()).unwrap();
    assert_eq!((v.severity, v.action), (Severity::Critical, RecommendedAction::RebootNode));
    assert_eq!(v.rule_id, "xid-79-fallen-off-the-bus");
    assert_eq!(v.evidence, vec![fault.event_id]);

    // Healthy evidence, then the quiet period passes with no fault: a recovery verdict.
    // After the reboot: a new boot id is the proof the rule waits for.
    let healthy = testkit::event(&node).gpu(GPU).boot("boot-after").build();
    publish(&producer, &enriched_topic, &node, &testkit::enriched(healthy).encode(), &[]).await.unwrap();
    let recovered = testkit::wait_for_record(&verdicts_topic, verdict_for(&node, true), Duration::from_secs(60))
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let r: Verdict = gpumedic_schemas::decode(recovered.payload.as_deref().unwrap()).unwrap();
    assert_eq!(r.incident_id, v.incident_id);
    assert_ne!(r.verdict_id, v.verdict_id);

    // Postgres holds the events, the incident (resolved) and both verdicts, once each.
    let pool = gpumedic_runtime::postgres::connect(&url, 2).await.unwrap();
    let events: i64 = sqlx::query_scalar("SELECT count(*) FROM health_events WHERE node = $1")
        .bind(&node)
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(events, 2, "the redelivered event is recorded once");
    let (severity, resolved): (String, Option<chrono::DateTime<chrono::Utc>>) =
        sqlx::query_as("SELECT severity, resolved_at FROM incidents WHERE incident_id = $1")
            .bind(v.incident_id)
            .fetch_one(&pool)
            .await
            .expect("incident recorded");
    assert_eq!(severity, "critical");
    assert!(resolved.is_some(), "the incident is resolved");
    let verdicts: i64 = sqlx::query_scalar("SELECT count(*) FROM verdicts WHERE incident_id = $1")
        .bind(v.incident_id)
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(verdicts, 2);

    // The incident history API on the admin port tells the same story, and refuses bad filters.
    let admin = classifier.admin_addr();
    let (code, body) =
        testkit::http_get(admin, &format!("/api/v1/incidents?node={node}&status=resolved")).await.unwrap();
    assert_eq!(code, 200, "{body}");
    let list: Vec<serde_json::Value> = serde_json::from_str(&body).unwrap();
    assert_eq!(list.len(), 1, "{body}");
    assert_eq!(list[0]["incident_id"], v.incident_id.to_string());
    let (code, body) = testkit::http_get(admin, &format!("/api/v1/incidents/{}", v.incident_id)).await.unwrap();
    assert_eq!(code, 200, "{body}");
    let detail: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert_eq!(detail["verdicts"].as_array().map(Vec::len), Some(2), "{body}");
    assert_eq!(detail["events"][0]["event_id"], fault.event_id.to_string(), "{body}");
    for bad in [
        "/api/v1/incidents?status=closed",
        "/api/v1/incidents?limit=0",
        "/api/v1/incidents?color=red",
        "/api/v1/incidents/not-a-uuid",
    ] {
        let (code, body) = testkit::http_get(admin, bad).await.unwrap();
        assert_eq!(code, 400, "{bad}: {body}");
        assert!(body.contains("error"), "{body}");
    }
    let (code, _) = testkit::http_get(admin, &format!("/api/v1/incidents/{}", uuid::Uuid::new_v4())).await.unwrap();
    assert_eq!(code, 404);

    // Garbage on the enriched topic goes to its dead-letter topic; the classifier carries on.
    let garbage_key = format!("{node}-garbage");
    publish(&producer, &enriched_topic, &garbage_key, b"garbage", &[]).await.unwrap();
    let dead = testkit::wait_for_record(
        &dead_letter_topic(&enriched_topic),
        |r| r.key.as_deref() == Some(garbage_key.as_bytes()),
        Duration::from_secs(60),
    )
    .await
    .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(dead.header(dlq_headers::SERVICE), Some(&b"classifier"[..]));

    classifier.terminate(Duration::from_secs(15)).await.expect("stops");
    pool.close().await;
    std::fs::remove_dir_all(&rules).ok();
}
