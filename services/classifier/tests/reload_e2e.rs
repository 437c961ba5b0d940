//! Rules reload in the running classifier, against the real Kafka and PostgreSQL: a bad new rule
//! file is refused (counted, old rules kept: the open incident's state survives), a good one is
//! taken up without a restart and its rule fires on the next event.

use std::time::Duration;

use gpumedic_runtime::kafka::{KafkaSettings, publish, stage_topics};
use gpumedic_schemas::Verdict;
use gpumedic_testkit as testkit;

const BIN: &str = env!("CARGO_BIN_EXE_gpumedic-classifier");

const XID_79: &str = "rules:\n  - id: xid-79\n    version: 1\n    description: GPU has fallen off the bus\n    scope: node\n    match: {kind: xid, xid: [79]}\n    severity: critical\n    action: reboot_node\n    clear: {evidence: {healthy: true}, proof: reboot, quiet: 30m}\n";

fn xid(node: &str, code: i32) -> Vec<u8> {
    testkit::event(node).xid(code).gpu("GPU-11111111-2222-3333-4444-555555555555").enriched().encode()
}

async fn metric(admin: std::net::SocketAddr, needle: &str) -> bool {
    testkit::http_get(admin, "/metrics").await.is_ok_and(|(_, body)| body.lines().any(|l| l.starts_with(needle)))
}

async fn wait_for_metric(admin: std::net::SocketAddr, needle: &str) {
    let what = format!("`{needle}` in /metrics");
    testkit::eventually(&what, Duration::from_secs(30), async || metric(admin, needle).await.then_some(())).await;
}

#[tokio::test]
async fn rules_reload_on_change_and_a_bad_file_is_refused() {
    let bootstrap = testkit::require_kafka().await.unwrap_or_else(|e| panic!("{e}"));
    let admin = testkit::require_postgres().await.unwrap_or_else(|e| panic!("{e}"));
    let db = testkit::unique_name("reload").replace('-', "_");
    let url = testkit::fresh_database(&admin, &db).await.expect("database");
    let enriched = testkit::unique_name("reload-enriched");
    let verdicts = testkit::unique_name("reload-verdicts");
    let actions = testkit::unique_name("reload-actions");
    let settings =
        KafkaSettings { bootstrap: bootstrap.clone(), options: vec![], schema_registry: None, topic_replication: None };
    settings.ensure_topics(&stage_topics(&[&enriched, &actions], &[&verdicts], 3)).await.expect("topics");
    let rules = std::env::temp_dir().join(testkit::unique_name("reload-rules"));
    std::fs::create_dir_all(&rules).unwrap();
    std::fs::write(rules.join("10-xid-79.yaml"), XID_79).unwrap();

    let mut classifier = testkit::ServiceProcess::start(
        BIN,
        &[],
        &[
            ("GPUMEDIC_KAFKA_BOOTSTRAP", bootstrap),
            ("GPUMEDIC_GROUP", testkit::unique_name("reload")),
            ("GPUMEDIC_DATABASE_URL", url),
            ("GPUMEDIC_ENRICHED_TOPIC", enriched.clone()),
            ("GPUMEDIC_VERDICTS_TOPIC", verdicts.clone()),
            ("GPUMEDIC_ACTIONS_TOPIC", actions),
            ("GPUMEDIC_RULES_DIR", rules.display().to_string()),
            ("GPUMEDIC_RULES_POLL", "200ms".into()),
        ],
    )
    .expect("starts");
    classifier.wait_ready(Duration::from_secs(60)).await.unwrap_or_else(|e| panic!("{e}"));
    let addr = classifier.admin_addr();
    let producer = settings.producer("reload-test").unwrap();
    let node = testkit::unique_name("reload-node");
    let verdict_with_rule = |rule: &'static str| {
        let node = node.clone();
        move |r: &gpumedic_runtime::kafka::Record| {
            r.key.as_deref() == Some(node.as_bytes())
                && gpumedic_schemas::decode::<Verdict>(r.payload.as_deref().unwrap_or_default())
                    .is_ok_and(|v| v.rule_id == rule)
        }
    };
    publish(&producer, &enriched, &node, &xid(&node, 79), &[]).await.unwrap();
    let opened = testkit::wait_for_record(&verdicts, verdict_with_rule("xid-79"), Duration::from_secs(60))
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let opened: Verdict = gpumedic_schemas::decode(opened.payload.as_deref().unwrap()).unwrap();

    // A bad file: refused, the old rules stay.
    std::fs::write(rules.join("20-bad.yaml"), "rules:\n  - id: Not An Id\n    severity: fatal\n").unwrap();
    wait_for_metric(addr, "gpumedic_classifier_rule_reloads_total{result=\"refused\"} 1").await;

    // Fixed: a new rule for Xid 62 is taken up; the Xid 79 rule is unchanged, so its open
    // incident's state is kept (a second Xid 79 opens nothing new).
    std::fs::remove_file(rules.join("20-bad.yaml")).unwrap();
    std::fs::write(rules.join("20-xid-62.yaml"), XID_79.replace("xid-79", "xid-62").replace("[79]", "[62]")).unwrap();
    wait_for_metric(addr, "gpumedic_classifier_rule_reloads_total{result=\"ok\"} 1").await;
    publish(&producer, &enriched, &node, &xid(&node, 79), &[]).await.unwrap();
    publish(&producer, &enriched, &node, &xid(&node, 62), &[]).await.unwrap();
    testkit::wait_for_record(&verdicts, verdict_with_rule("xid-62"), Duration::from_secs(60))
        .await
        .unwrap_or_else(|e| panic!("the reloaded rule did not fire: {e}"));
    let mut xid79 = 0;
    testkit::wait_for_record(
        &verdicts,
        |r| {
            if let Ok(v) = gpumedic_schemas::decode::<Verdict>(r.payload.as_deref().unwrap_or_default())
                && v.rule_id == "xid-79"
                && v.node == node
            {
                assert_eq!(v.incident_id, opened.incident_id, "the open incident was kept");
                xid79 += 1;
            }
            v_is_xid62(r, &node)
        },
        Duration::from_secs(30),
    )
    .await
    .unwrap();
    assert_eq!(xid79, 1, "the second Xid 79 joined the open incident; no new verdict");

    classifier.terminate(Duration::from_secs(15)).await.expect("stops");
    std::fs::remove_dir_all(&rules).ok();
    sqlx::query(sqlx::AssertSqlSafe(format!("DROP DATABASE \"{db}\" WITH (FORCE)"))).execute(&admin).await.ok();
}

/// Whether `r` is the Xid 62 verdict for `node` (the last record the test expects).
fn v_is_xid62(r: &gpumedic_runtime::kafka::Record, node: &str) -> bool {
    gpumedic_schemas::decode::<Verdict>(r.payload.as_deref().unwrap_or_default())
        .is_ok_and(|v| v.rule_id == "xid-62" && v.node == node)
}
