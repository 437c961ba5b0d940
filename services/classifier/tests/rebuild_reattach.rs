//! A restarted classifier keeps following the incidents the store holds open, against the real
//! Kafka and PostgreSQL. Two ways a rebuild from events alone lost one (and with it, the node's
//! release, since the remediator holds a node while its incident is open):
//! - a restart under a new version of the rule: the replayed fault opened the incident again
//!   under a new id, so the recovery named an incident nobody had opened and the stored one
//!   stayed open for good;
//! - an incident older than `--rebuild-window`: no event was left to replay, so nothing followed
//!   it and its healthy evidence closed nothing.

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

/// Xid 48 on one GPU cordons until that GPU's healthy evidence has stood 2 s.
const XID48_RULE: &str = "rules:\n  - id: xid-48-test\n    version: 1\n    description: double-bit ECC error\n    match:\n      - {kind: xid, xid: [48]}\n    severity: warning\n    action: cordon\n    clear: {evidence: {healthy: true}, quiet: 2s}\n";

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
        let producer = settings.producer("reattach-test").unwrap();
        Bed { bootstrap, url, enriched, verdicts, actions, group: testkit::unique_name("classifier"), producer }
    }

    async fn start(&self, rules: &Path, window: &str) -> ServiceProcess {
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

    /// (incidents, resolved) for `node` in the store, once they are `want` or after 15 s: a
    /// verdict is published before its batch's rows are committed, so the rows may lag it.
    async fn incidents_once(&self, node: &str, want: (i64, i64)) -> (i64, i64) {
        let settled = testkit::eventually_or(Duration::from_secs(15), async || {
            let counts = self.incidents(node).await;
            (counts == want).then_some(counts)
        })
        .await;
        match settled {
            Ok(counts) => counts,
            Err(()) => self.incidents(node).await,
        }
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
    let dir = std::env::temp_dir().join(testkit::unique_name("reattach-rules"));
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join("rules.yaml"), text).unwrap();
    dir
}

#[tokio::test]
async fn a_restart_under_a_new_rule_version_recovers_the_incident_it_opened_not_a_new_one() {
    let bed = Bed::new("reattach-version").await;
    let rules = rules_dir(&xid79_rule(1));
    let node = testkit::unique_name("reattach-node");
    let mut c = bed.start(&rules, "48h").await;
    bed.send(&node, xid(&node, 79)).await;
    let opened = bed.verdict(&node, |v| !v.recovery, "the fault's verdict").await;
    c.terminate(Duration::from_secs(20)).await.unwrap_or_else(|e| panic!("{e}"));

    // An upgrade bumps the rule's version; the classifier restarts under it.
    std::fs::write(rules.join("rules.yaml"), xid79_rule(2)).unwrap();
    let mut c = bed.start(&rules, "48h").await;
    bed.send(&node, healthy(&node, "boot-after")).await;
    let recovery = bed.verdict(&node, |v| v.recovery, "the recovery after the reboot").await;
    assert_eq!(recovery.incident_id, opened.incident_id, "the recovery closes the incident the remediator holds");
    assert_ne!(recovery.verdict_id, opened.verdict_id);
    assert_eq!(bed.incidents_once(&node, (1, 1)).await, (1, 1), "one incident, and it is closed");
    c.terminate(Duration::from_secs(20)).await.unwrap_or_else(|e| panic!("{e}"));
    std::fs::remove_dir_all(&rules).ok();
}

#[tokio::test]
async fn an_incident_older_than_the_rebuild_window_is_still_followed_after_a_restart() {
    let bed = Bed::new("reattach-window").await;
    let rules = rules_dir(XID48_RULE);
    let node = testkit::unique_name("reattach-node");
    let mut c = bed.start(&rules, "48h").await;
    bed.send(&node, xid(&node, 48)).await;
    let opened = bed.verdict(&node, |v| !v.recovery, "the fault's verdict").await;
    c.terminate(Duration::from_secs(20)).await.unwrap_or_else(|e| panic!("{e}"));

    // The fault is now older than the window the restarted classifier replays.
    tokio::time::sleep(Duration::from_secs(4)).await;
    let mut c = bed.start(&rules, "3s").await;
    bed.send(&node, healthy(&node, "boot-before")).await;
    let recovery = bed.verdict(&node, |v| v.recovery, "the recovery on the GPU's healthy evidence").await;
    assert_eq!(recovery.incident_id, opened.incident_id);
    assert_eq!(bed.incidents_once(&node, (1, 1)).await, (1, 1), "one incident, and it is closed");
    c.terminate(Duration::from_secs(20)).await.unwrap_or_else(|e| panic!("{e}"));
    std::fs::remove_dir_all(&rules).ok();
}
