//! Time and identity from the payload are not trusted, against the real Kafka and PostgreSQL:
//! an event stamped a day ahead (a node's clock far off) is bounded by its record's Kafka
//! timestamp, so it does not move the node's engine clock and a later quiet period still ends;
//! and an old event published again, after the engine's in-memory window of recent ids has moved
//! past it, is recognised by Postgres and produces no second verdict; nor does a second copy that
//! arrives in the same batch as the first, further from it than that window reaches.

use std::time::Duration;

use gpumedic_runtime::kafka::{KafkaSettings, Producer, Record, publish, stage_topics};
use gpumedic_schemas::{HealthEvent, Verdict};
use gpumedic_testkit as testkit;

const BIN: &str = env!("CARGO_BIN_EXE_gpumedic-classifier");
const GPU: &str = "GPU-aaaaaaaa-bbbb-cccc-dddd-eeeeeeeeeeee";

/// Xid 79 opens a node incident; healthy evidence held for 3 s resolves it (no reboot proof, so
/// the test needs no boot ids).
const RULE: &str = "rules:\n  - id: xid-79-test\n    version: 1\n    description: GPU has fallen off the bus\n    scope: node\n    match:\n      - {kind: xid, xid: [79]}\n    severity: critical\n    action: cordon\n    clear: {evidence: {healthy: true}, quiet: 3s}\n";

/// Xid 48 twice within an hour on a node opens an incident: a copy of one Xid 48 counted again
/// would open it.
const TWICE: &str = "rules:\n  - id: xid-48-twice-test\n    version: 1\n    description: double-bit ECC twice\n    scope: node\n    match:\n      - {kind: xid, xid: [48]}\n    condition: {count: {at_least: 2, within: 1h}}\n    severity: critical\n    action: cordon\n    clear: {evidence: {healthy: true}, quiet: 3s}\n";

fn xid(node: &str, code: i32, pid: i32) -> HealthEvent {
    testkit::event(node).xid(code).text("GPU has fallen off the bus.").pid(pid).gpu(GPU).build()
}

fn healthy(node: &str) -> HealthEvent {
    testkit::event(node).gpu(GPU).build()
}

struct Bed {
    classifier: testkit::ServiceProcess,
    producer: Producer,
    enriched: String,
    verdicts: String,
    url: String,
    rules: std::path::PathBuf,
}

impl Bed {
    async fn start(name: &str) -> Bed {
        Bed::start_with(name, RULE, &[]).await
    }

    /// A classifier with the rules in `rule` and the extra settings `env`.
    async fn start_with(name: &str, rule: &str, env: &[(&'static str, &str)]) -> Bed {
        let bootstrap = testkit::require_kafka().await.unwrap_or_else(|e| panic!("{e}"));
        let admin = testkit::require_postgres().await.unwrap_or_else(|e| panic!("{e}"));
        let db = testkit::unique_name(name).replace('-', "_");
        let url = testkit::fresh_database(&admin, &db).await.expect("database");
        let enriched = testkit::unique_name(&format!("{name}-enriched"));
        let verdicts = testkit::unique_name(&format!("{name}-verdicts"));
        let actions = testkit::unique_name(&format!("{name}-actions"));
        let settings = KafkaSettings {
            bootstrap: bootstrap.clone(),
            options: vec![],
            schema_registry: None,
            topic_replication: None,
        };
        settings.ensure_topics(&stage_topics(&[&enriched, &actions], &[&verdicts], 12)).await.expect("topics");
        let rules = std::env::temp_dir().join(testkit::unique_name("rules"));
        std::fs::create_dir_all(&rules).unwrap();
        std::fs::write(rules.join("test.yaml"), rule).unwrap();
        let mut settings_env = vec![
            ("GPUMEDIC_KAFKA_BOOTSTRAP", bootstrap),
            ("GPUMEDIC_GROUP", testkit::unique_name("classifier")),
            ("GPUMEDIC_ENRICHED_TOPIC", enriched.clone()),
            ("GPUMEDIC_VERDICTS_TOPIC", verdicts.clone()),
            ("GPUMEDIC_ACTIONS_TOPIC", actions),
            ("GPUMEDIC_DATABASE_URL", url.clone()),
            ("GPUMEDIC_RULES_DIR", rules.display().to_string()),
            ("GPUMEDIC_TICK", "500ms".into()),
        ];
        settings_env.extend(env.iter().map(|(k, v)| (*k, v.to_string())));
        let classifier = testkit::ServiceProcess::start(BIN, &[], &settings_env).expect("starts");
        let mut bed =
            Bed { classifier, producer: settings.producer("event-time-test").unwrap(), enriched, verdicts, url, rules };
        bed.classifier.wait_ready(Duration::from_secs(60)).await.unwrap_or_else(|e| panic!("{e}"));
        bed
    }

    async fn send(&self, e: &HealthEvent) {
        let bytes = testkit::enriched(e.clone()).encode();
        publish(&self.producer, &self.enriched, &e.node, &bytes, &[]).await.unwrap();
    }

    /// Waits up to `wait` for a verdict about `node` that `pick` accepts.
    async fn verdict(&self, node: &str, wait: Duration, pick: impl Fn(&Verdict) -> bool) -> Option<Verdict> {
        let found =
            testkit::wait_for_record(&self.verdicts, |r: &Record| of_node(r, node).is_some_and(|v| pick(&v)), wait)
                .await
                .ok()?;
        of_node(&found, node)
    }

    /// Every verdict record about `node` on the topic (after `wait` for more to arrive).
    async fn verdicts(&self, node: &str, wait: Duration) -> Vec<Verdict> {
        let mut all = Vec::new();
        let _ = testkit::wait_for_record(
            &self.verdicts,
            |r| {
                all.extend(of_node(r, node));
                false
            },
            wait,
        )
        .await;
        all
    }

    async fn metric(&self, name: &str) -> f64 {
        let Ok((_, body)) = testkit::http_get(self.classifier.admin_addr(), "/metrics").await else { return 0.0 };
        body.lines()
            .filter(|l| l.starts_with(name))
            .filter_map(|l| l.rsplit_once(' ').and_then(|(_, v)| v.parse::<f64>().ok()))
            .sum()
    }

    async fn stop(mut self) {
        self.classifier.terminate(Duration::from_secs(15)).await.expect("stops");
        std::fs::remove_dir_all(&self.rules).ok();
    }
}

fn of_node(r: &Record, node: &str) -> Option<Verdict> {
    (r.key.as_deref() == Some(node.as_bytes()))
        .then(|| gpumedic_schemas::decode::<Verdict>(r.payload.as_deref().unwrap_or_default()).ok())
        .flatten()
}

#[tokio::test]
async fn an_event_from_a_day_ahead_does_not_move_the_node_clock() {
    let bed = Bed::start("skew").await;
    let node = testkit::unique_name("skew-node");

    // A node whose clock is a day fast stamps both times of its event a day ahead.
    let mut ahead = healthy(&node);
    let day = chrono::Duration::days(1);
    ahead.observed_at += day;
    ahead.published_at += day;
    bed.send(&ahead).await;

    // Normal events after it: the fault opens its incident, and healthy evidence held for the
    // quiet period (3 s of the node's time) resolves it. Had the first event moved the node's
    // clock a day ahead, the quiet period would end only a day from now.
    let fault = xid(&node, 79, 1);
    bed.send(&fault).await;
    let opened =
        bed.verdict(&node, Duration::from_secs(60), |v| !v.recovery).await.expect("the fault opens its incident");
    bed.send(&healthy(&node)).await;
    let recovered = bed
        .verdict(&node, Duration::from_secs(30), |v| v.recovery)
        .await
        .expect("the quiet period ends on time: the day-ahead event did not move the node's clock");
    assert_eq!(recovered.incident_id, opened.incident_id);

    // It was recorded at its record's time, not a day ahead, and counted.
    let pool = gpumedic_runtime::postgres::connect(&bed.url, 2).await.unwrap();
    let at: chrono::DateTime<chrono::Utc> =
        sqlx::query_scalar("SELECT observed_at FROM health_events WHERE event_id = $1")
            .bind(ahead.event_id)
            .fetch_one(&pool)
            .await
            .expect("the event is recorded");
    assert!(at < chrono::Utc::now() + chrono::Duration::minutes(5), "recorded at {at}");
    assert!(bed.metric("gpumedic_classifier_clock_skew_clamped_total").await >= 1.0);
    pool.close().await;
    bed.stop().await;
}

#[tokio::test]
async fn an_old_event_published_again_produces_no_second_verdict() {
    let bed = Bed::start("replay").await;
    let node = testkit::unique_name("replay-node");

    let fault = xid(&node, 79, 1);
    bed.send(&fault).await;
    bed.verdict(&node, Duration::from_secs(60), |v| !v.recovery).await.expect("the fault opens its incident");
    bed.send(&healthy(&node)).await;
    bed.verdict(&node, Duration::from_secs(30), |v| v.recovery).await.expect("and is resolved");

    // More events of the node than the engine remembers ids of (128), each its own Xid line (a
    // code no rule matches), so neither the id window nor the repeated-line window holds the fault.
    let others: Vec<HealthEvent> = (0..1100).map(|pid| xid(&node, 63, 1000 + pid)).collect();
    let sends = others.iter().map(|e| {
        let bytes = testkit::enriched(e.clone()).encode();
        let (producer, topic, key) = (&bed.producer, &bed.enriched, e.node.clone());
        async move { publish(producer, topic, &key, &bytes, &[]).await }
    });
    futures::future::try_join_all(sends).await.unwrap();

    // The same fault again (same id and time): a replay, a re-publish, a re-read log line.
    let before = bed.metric("gpumedic_classifier_duplicate_events_total").await;
    bed.send(&fault).await;
    testkit::eventually("the replayed event to be handled", Duration::from_secs(60), async || {
        (bed.metric("gpumedic_classifier_duplicate_events_total").await > before).then_some(())
    })
    .await;
    let opened: Vec<Verdict> =
        bed.verdicts(&node, Duration::from_secs(3)).await.into_iter().filter(|v| !v.recovery).collect();
    assert_eq!(opened.len(), 1, "the replayed fault produced another verdict: {opened:#?}");
    bed.stop().await;
}

#[tokio::test]
async fn a_second_copy_in_the_same_batch_is_not_counted_again() {
    // A batch lingers for what follows its first record, so the whole stream below is one batch.
    let bed = Bed::start_with("in-batch", TWICE, &[("GPUMEDIC_BATCH_LINGER", "3s")]).await;
    let node = testkit::unique_name("in-batch-node");

    // One Xid 48, then more of the node's events than the engine remembers ids of (each its own
    // Xid 63 line, which no rule matches), then the same Xid 48 again: a re-send that caught up
    // with its original. Counted twice, it would open the incident.
    let fault = xid(&node, 48, 1);
    let mut stream = vec![fault.clone()];
    stream.extend((0..300).map(|pid| xid(&node, 63, 1000 + pid)));
    stream.push(fault);
    let before = bed.metric("gpumedic_classifier_duplicate_events_total").await;
    let sends = stream.iter().map(|e| {
        let bytes = testkit::enriched(e.clone()).encode();
        let (producer, topic, key) = (&bed.producer, &bed.enriched, e.node.clone());
        async move { publish(producer, topic, &key, &bytes, &[]).await }
    });
    futures::future::try_join_all(sends).await.unwrap();
    testkit::eventually("the copy to be handled", Duration::from_secs(60), async || {
        (bed.metric("gpumedic_classifier_duplicate_events_total").await > before).then_some(())
    })
    .await;
    let verdicts = bed.verdicts(&node, Duration::from_secs(3)).await;
    assert!(verdicts.is_empty(), "one Xid 48 was counted twice: {verdicts:#?}");

    // The Xid 48 was recorded once.
    let pool = gpumedic_runtime::postgres::connect(&bed.url, 2).await.unwrap();
    let rows: i64 = sqlx::query_scalar("SELECT count(*) FROM health_events WHERE node = $1 AND xid = 48")
        .bind(&node)
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(rows, 1);
    pool.close().await;
    bed.stop().await;
}
