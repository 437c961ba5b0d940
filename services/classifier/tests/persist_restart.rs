//! A restarted classifier under `--persist evidence` follows the incidents it followed before, as
//! under `--persist all`, against the real Kafka and PostgreSQL: the same stream (heartbeats, an
//! Xid 79 that waits for a reboot, more heartbeats of the same boot) goes to a classifier under
//! each policy, each is restarted (rebuilding from what it recorded), and the reboot's heartbeat
//! recovers the same incident under both; `evidence` recorded fewer events.

use std::path::Path;
use std::time::Duration;

use gpumedic_runtime::kafka::{KafkaSettings, Producer, publish, stage_topics};
use gpumedic_schemas::{HealthEvent, Verdict};
use gpumedic_testkit::{self as testkit, ServiceProcess};

const BIN: &str = env!("CARGO_BIN_EXE_gpumedic-classifier");
const GPU: &str = "GPU-0000000b-bbbb-cccc-dddd-eeeeeeeeeeee";

fn xid(node: &str, code: i32) -> HealthEvent {
    let text = format!("NVRM: Xid (PCI:0000:18:00): {code}");
    testkit::event(node).xid(code).text(text).gpu(GPU).boot("boot-before").build()
}

fn healthy(node: &str, boot: &str) -> HealthEvent {
    testkit::event(node).gpu(GPU).boot(boot).build()
}

/// Xid 79 quarantines the node until a reboot; its quiet period is short for the test.
fn xid79_rule(version: u32) -> String {
    format!(
        "rules:\n  - id: xid-79-test\n    version: {version}\n    description: GPU has fallen off the bus\n    scope: node\n    match:\n      - {{kind: xid, xid: [79]}}\n    severity: critical\n    action: reboot_node\n    clear: {{evidence: {{healthy: true}}, proof: reboot, quiet: 2s}}\n"
    )
}

struct Bed {
    bootstrap: String,
    url: String,
    enriched: String,
    verdicts: String,
    actions: String,
    group: String,
    producer: Producer,
}

impl Bed {
    async fn new(name: &str) -> Self {
        let bootstrap = testkit::require_kafka().await.unwrap_or_else(|e| panic!("{e}"));
        let admin = testkit::require_postgres().await.unwrap_or_else(|e| panic!("{e}"));
        let db = testkit::unique_name(name).replace('-', "_");
        let url = testkit::fresh_database(&admin, &db).await.expect("database");
        let [enriched, verdicts, actions] =
            ["enriched", "verdicts", "actions"].map(|t| testkit::unique_name(&format!("{name}-{t}")));
        let settings = KafkaSettings {
            bootstrap: bootstrap.clone(),
            options: vec![],
            schema_registry: None,
            topic_replication: None,
        };
        settings.ensure_topics(&stage_topics(&[&enriched, &actions], &[&verdicts], 3)).await.expect("topics");
        let producer = settings.producer("persist-restart-test").unwrap();
        Bed { bootstrap, url, enriched, verdicts, actions, group: testkit::unique_name("classifier"), producer }
    }

    async fn start(&self, rules: &Path, window: &str, persist: &str) -> ServiceProcess {
        let mut c = ServiceProcess::start(
            BIN,
            &[],
            &[
                ("GPUMEDIC_KAFKA_BOOTSTRAP", self.bootstrap.clone()),
                ("GPUMEDIC_GROUP", self.group.clone()),
                ("GPUMEDIC_ENRICHED_TOPIC", self.enriched.clone()),
                ("GPUMEDIC_VERDICTS_TOPIC", self.verdicts.clone()),
                ("GPUMEDIC_ACTIONS_TOPIC", self.actions.clone()),
                ("GPUMEDIC_DATABASE_URL", self.url.clone()),
                ("GPUMEDIC_RULES_DIR", rules.display().to_string()),
                ("GPUMEDIC_REBUILD_WINDOW", window.into()),
                ("GPUMEDIC_PERSIST", persist.into()),
                ("GPUMEDIC_TICK", "500ms".into()),
            ],
        )
        .expect("starts");
        c.wait_ready(Duration::from_secs(90)).await.unwrap_or_else(|e| panic!("{e}"));
        c
    }

    async fn send(&self, node: &str, e: HealthEvent) {
        publish(&self.producer, &self.enriched, node, &testkit::enriched(e).encode(), &[]).await.unwrap();
    }

    /// The first verdict for `node` that `want` accepts.
    async fn verdict(&self, node: &str, want: impl Fn(&Verdict) -> bool, what: &str) -> Verdict {
        let r = testkit::wait_for_record(
            &self.verdicts,
            |r| {
                r.key.as_deref() == Some(node.as_bytes())
                    && gpumedic_schemas::decode::<Verdict>(r.payload.as_deref().unwrap_or_default())
                        .is_ok_and(|v| want(&v))
            },
            Duration::from_secs(60),
        )
        .await
        .unwrap_or_else(|e| panic!("{what}: {e}"));
        gpumedic_schemas::decode(r.payload.as_deref().unwrap()).unwrap()
    }

    /// (incidents, resolved) for `node` in the store.
    async fn incidents(&self, node: &str) -> (i64, i64) {
        let pool = gpumedic_runtime::postgres::connect(&self.url, 1).await.unwrap();
        let counts = sqlx::query_as("SELECT count(*), count(resolved_at) FROM incidents WHERE node = $1")
            .bind(node)
            .fetch_one(&pool)
            .await
            .unwrap();
        pool.close().await;
        counts
    }
}

fn rules_dir(text: &str) -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(testkit::unique_name("persist-restart-rules"));
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join("rules.yaml"), text).unwrap();
    dir
}

/// One node's events, the same ones (ids included) for both policies.
struct Stream {
    before: Vec<HealthEvent>,
    fault: HealthEvent,
    after: Vec<HealthEvent>,
    reboot: HealthEvent,
}

/// Runs the stream through a classifier under `persist`, restarts it, sends the reboot's
/// heartbeat; returns the opening and recovery verdicts and the rows in `health_events`.
async fn through(persist: &str, node: &str, stream: &Stream) -> (Verdict, Verdict, i64) {
    let bed = Bed::new(&format!("persist-{persist}")).await;
    let rules = rules_dir(&xid79_rule(1));
    let mut c = bed.start(&rules, "48h", persist).await;
    for e in &stream.before {
        bed.send(node, e.clone()).await;
    }
    bed.send(node, stream.fault.clone()).await;
    let opened = bed.verdict(node, |v| !v.recovery, "the fault's verdict").await;
    // Healthy, but no proof of repair: the incident stays open, and these bear on nothing.
    for e in &stream.after {
        bed.send(node, e.clone()).await;
    }
    let pool = gpumedic_runtime::postgres::connect(&bed.url, 1).await.unwrap();
    let rows = testkit::eventually_with("the classifier to take in 41 events", Duration::from_secs(60), async || {
        // Every event taken in: the classifier counts them whether or not it records them.
        let (_, text) = testkit::http_get(c.admin_addr(), "/metrics").await.unwrap();
        let consumed = text
            .lines()
            .find(|l| l.starts_with("gpumedic_classifier_events_total"))
            .and_then(|l| l.split_whitespace().last())
            .and_then(|v| v.parse::<f64>().ok())
            .unwrap_or(0.0);
        if consumed < 41.0 {
            return Err(format!("{consumed} of 41 taken in"));
        }
        let rows: i64 = sqlx::query_scalar("SELECT count(*) FROM health_events WHERE node = $1")
            .bind(node)
            .fetch_one(&pool)
            .await
            .unwrap();
        Ok(rows)
    })
    .await;
    c.terminate(Duration::from_secs(20)).await.unwrap_or_else(|e| panic!("{e}"));
    // The healthy events' minute was still open: written at shutdown under `evidence`.
    let rolled: Option<i64> = sqlx::query_scalar("SELECT sum(events)::int8 FROM telemetry_rollups WHERE node = $1")
        .bind(node)
        .fetch_one(&pool)
        .await
        .unwrap();
    let healthy = (stream.before.len() + stream.after.len()) as i64;
    assert_eq!(rolled, (persist == "evidence").then_some(healthy), "{persist}: the rollups written at shutdown");
    pool.close().await;

    let mut c = bed.start(&rules, "48h", persist).await;
    bed.send(node, stream.reboot.clone()).await;
    let recovery = bed.verdict(node, |v| v.recovery, "the recovery after the reboot").await;
    // The verdict is published before its batch is written: the row follows within moments.
    let _ =
        testkit::eventually_or(Duration::from_secs(10), async || (bed.incidents(node).await == (1, 1)).then_some(()))
            .await;
    assert_eq!(bed.incidents(node).await, (1, 1), "{persist}: one incident, and it is closed");
    c.terminate(Duration::from_secs(20)).await.unwrap_or_else(|e| panic!("{e}"));
    std::fs::remove_dir_all(&rules).ok();
    (opened, recovery, rows)
}

#[tokio::test]
async fn a_restart_under_evidence_only_history_recovers_the_incident_as_under_every_event() {
    let node = testkit::unique_name("persist-node");
    let stream = Stream {
        before: (0..20).map(|_| healthy(&node, "boot-before")).collect(),
        fault: xid(&node, 79),
        after: (0..20).map(|_| healthy(&node, "boot-before")).collect(),
        reboot: healthy(&node, "boot-after"),
    };
    let (all_opened, all_recovery, all_rows) = through("all", &node, &stream).await;
    let (opened, recovery, rows) = through("evidence", &node, &stream).await;
    assert_eq!(all_rows, 41, "--persist all records every event");
    assert!(rows < all_rows, "--persist evidence recorded {rows} of {all_rows} events");
    assert_eq!(opened.incident_id, all_opened.incident_id, "the same incident");
    assert_eq!(recovery.incident_id, opened.incident_id, "the recovery closes the incident it opened");
    assert_eq!(recovery.verdict_id, all_recovery.verdict_id, "the same recovery verdict");
}
