//! A classifier of a test's own against the testbed, for the tests that restart it: a fresh
//! database, its own enriched, verdict and actions topics and consumer group, the events they
//! publish and readers of what it decided.

#![allow(dead_code)] // Each test binary uses a different part.

use std::path::{Path, PathBuf};
use std::time::Duration;

use gpumedic_runtime::kafka::{KafkaSettings, Producer, publish, stage_topics};
use gpumedic_schemas::{HealthEvent, Verdict};
use gpumedic_testkit::{self as testkit, ServiceProcess};

const BIN: &str = env!("CARGO_BIN_EXE_gpumedic-classifier");

/// The GPU every event names.
pub const GPU: &str = "GPU-0000000b-bbbb-cccc-dddd-eeeeeeeeeeee";

/// An Xid `code` on [`GPU`] as the kernel logs it, before the reboot.
pub fn xid(node: &str, code: i32) -> HealthEvent {
    let text = format!("NVRM: Xid (PCI:0000:18:00): {code}");
    testkit::event(node).xid(code).text(text).gpu(GPU).boot("boot-before").build()
}

/// NVML's healthy evidence for [`GPU`] in boot `boot`.
pub fn healthy(node: &str, boot: &str) -> HealthEvent {
    testkit::event(node).gpu(GPU).boot(boot).build()
}

/// Xid 79 quarantines the node until a reboot; its quiet period is short for the test.
pub fn xid79_rule(version: u32) -> String {
    format!(
        "rules:\n  - id: xid-79-test\n    version: {version}\n    description: GPU has fallen off the bus\n    scope: node\n    match:\n      - {{kind: xid, xid: [79]}}\n    severity: critical\n    action: reboot_node\n    clear: {{evidence: {{healthy: true}}, proof: reboot, quiet: 2s}}\n"
    )
}

/// A rules folder of its own holding `text` as `rules.yaml`.
pub fn rules_dir(text: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(testkit::unique_name("classifier-rules"));
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join("rules.yaml"), text).unwrap();
    dir
}

/// One test's database, topics and group; classifiers started on it share them, so a restarted
/// one carries on where the last stopped.
pub struct Bed {
    pub bootstrap: String,
    pub url: String,
    pub enriched: String,
    pub verdicts: String,
    pub actions: String,
    pub group: String,
    pub producer: Producer,
}

impl Bed {
    /// A fresh bed, its names starting with `name`.
    pub async fn new(name: &str) -> Self {
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
        let producer = settings.producer(&format!("{name}-test")).unwrap();
        Bed { bootstrap, url, enriched, verdicts, actions, group: testkit::unique_name("classifier"), producer }
    }

    /// Starts a classifier on the bed with `rules`, rebuild window `window` and `extra` settings,
    /// and waits until it is ready.
    pub async fn start(&self, rules: &Path, window: &str, extra: &[(&str, String)]) -> ServiceProcess {
        let mut env = vec![
            ("GPUMEDIC_KAFKA_BOOTSTRAP", self.bootstrap.clone()),
            ("GPUMEDIC_GROUP", self.group.clone()),
            ("GPUMEDIC_ENRICHED_TOPIC", self.enriched.clone()),
            ("GPUMEDIC_VERDICTS_TOPIC", self.verdicts.clone()),
            ("GPUMEDIC_ACTIONS_TOPIC", self.actions.clone()),
            ("GPUMEDIC_DATABASE_URL", self.url.clone()),
            ("GPUMEDIC_RULES_DIR", rules.display().to_string()),
            ("GPUMEDIC_REBUILD_WINDOW", window.into()),
        ];
        env.extend(extra.iter().cloned());
        env.push(("GPUMEDIC_TICK", "500ms".into()));
        let mut c = ServiceProcess::start(BIN, &[], &env).expect("starts");
        c.wait_ready(Duration::from_secs(90)).await.unwrap_or_else(|e| panic!("{e}"));
        c
    }

    /// Publishes `e`, enriched, keyed by `node`.
    pub async fn send(&self, node: &str, e: HealthEvent) {
        publish(&self.producer, &self.enriched, node, &testkit::enriched(e).encode(), &[]).await.unwrap();
    }

    /// The first verdict for `node` that `want` accepts.
    pub async fn verdict(&self, node: &str, want: impl Fn(&Verdict) -> bool, what: &str) -> Verdict {
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

    /// (incidents, resolved) for `node` in the store, once they are `want` or after `timeout`: a
    /// verdict is published before its batch's rows are committed, so the rows may lag it.
    pub async fn incidents_once(&self, node: &str, want: (i64, i64), timeout: Duration) -> (i64, i64) {
        let settled = testkit::eventually_or(timeout, async || {
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
    pub async fn incidents(&self, node: &str) -> (i64, i64) {
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
