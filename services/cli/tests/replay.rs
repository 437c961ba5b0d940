//! `gpumedic replay` against the real Kafka: backtest enriched events with the default rules and
//! with a changed rule against recorded verdicts, export to a file and backtest the file, and
//! republish to another topic.
//!
//! The "recorded" verdicts are what the classifier's own engine gives for the same events (the
//! classifier's library, run here), plus one verdict no rule would give, so every kind of
//! difference has a known expected count.

use std::process::Command;
use std::time::Duration;

use chrono::{DateTime, Utc};
use gpumedic_classifier::observe;
use gpumedic_classifier::rules::{Engine, defaults};
use gpumedic_runtime::config::Validate as _;
use gpumedic_runtime::kafka::{self, Envelope, KafkaArgs, TopicSpec};
use gpumedic_schemas::health::{Component, Detail, Entity, Source, TemperatureDetail, XidDetail};
use gpumedic_schemas::{EnrichedHealthEvent, HealthEvent, Verdict};
use gpumedic_testkit as testkit;
use serde_json::Value;

const GPUMEDIC: &str = env!("CARGO_BIN_EXE_gpumedic");
const GPU: &str = "GPU-5a1e0000-0000-0000-0000-000000000001";

fn event(node: &str, at: DateTime<Utc>, detail: Detail, healthy: bool) -> EnrichedHealthEvent {
    let entity = Entity { gpu_uuid: Some(GPU.into()), gpu_index: Some(0), ..Entity::default() };
    let mut e = HealthEvent::new(node, Source::Nvml, Component::Gpu, entity, detail);
    e.observed_at = at;
    e.published_at = at;
    e.healthy = healthy;
    EnrichedHealthEvent {
        event: e,
        node_context: Default::default(),
        node_unknown: false,
        xid_catalog: None,
        workloads: vec![],
        enriched_at: at,
        gpu: None,
        gpu_unresolved: false,
    }
}

fn xid(code: i32) -> Detail {
    Detail::Xid(XidDetail {
        code,
        text: format!("Xid {code}"),
        pid: None,
        process: None,
        nvlink5: None,
        recovery_action: None,
    })
}

fn heartbeat() -> Detail {
    Detail::Temperature(TemperatureDetail { celsius: 55, slowdown_celsius: Some(87), shutdown_celsius: Some(92) })
}

/// Node A: Xid 79, then a reboot and 20 minutes of healthy heartbeats (the rule's quiet period is
/// 15 minutes, so it recovers). Node B: one Xid 13.
fn events(run: &str) -> Vec<EnrichedHealthEvent> {
    let t0 = DateTime::from_timestamp_micros((Utc::now() - chrono::Duration::minutes(40)).timestamp_micros()).unwrap();
    let (a, b) = (format!("{run}-a"), format!("{run}-b"));
    let mut out = vec![event(&a, t0, xid(79), false), event(&b, t0 + chrono::Duration::seconds(60), xid(13), false)];
    out[0].event.boot_id = Some("boot-1".into());
    for i in 1..=40 {
        // The node rebooted after the fault: a new boot id is the proof Xid 79's rule waits for.
        let mut beat = event(&a, t0 + chrono::Duration::seconds(30 * i), heartbeat(), true);
        beat.event.boot_id = Some("boot-2".into());
        out.push(beat);
    }
    out.sort_by_key(|e| e.event.observed_at);
    out
}

/// What the classifier's engine gives for `events`, in event-time order, with a tick at the end
/// (deadline decisions carry the deadline's own time, so when ticks happen does not matter).
fn engine_verdicts(events: &[EnrichedHealthEvent]) -> Vec<Verdict> {
    let mut engine = Engine::new(defaults::rule_set().expect("default rules"));
    let mut out = Vec::new();
    for e in events {
        let o = observe::observation(e);
        out.extend(engine.observe(&o).iter().map(observe::verdict));
    }
    let last = events.iter().map(|e| e.event.observed_at.timestamp_micros()).max().unwrap();
    out.extend(engine.tick(last).iter().map(observe::verdict));
    out
}

fn gpumedic(args: &[&str]) -> (bool, String, String) {
    let out = Command::new(GPUMEDIC).args(args).output().expect("gpumedic runs");
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

fn json(args: &[&str]) -> Value {
    let (ok, stdout, stderr) = gpumedic(args);
    assert!(ok, "gpumedic {args:?} failed: {stderr}");
    serde_json::from_str(&stdout).unwrap_or_else(|e| panic!("not JSON ({e}): {stdout}"))
}

fn count(report: &Value, change: &str) -> usize {
    report["differences"].as_array().unwrap().iter().filter(|d| d["change"] == change).count()
}

#[tokio::test]
async fn backtest_export_and_republish_against_real_kafka() {
    let bootstrap = testkit::require_kafka().await.unwrap_or_else(|e| panic!("{e}"));
    let settings = KafkaArgs {
        kafka_bootstrap: bootstrap.clone(),
        kafka_options: vec![],
        schema_registry_url: None,
        topic_replication: None,
    }
    .validate()
    .unwrap();
    let run = testkit::unique_name("replay");
    let (enriched, verdicts, copy) = (format!("{run}.enriched"), format!("{run}.verdicts"), format!("{run}.copy"));
    settings
        .ensure_topics(&[TopicSpec::new(&enriched, 3), TopicSpec::new(&verdicts, 3), TopicSpec::new(&copy, 3)])
        .await
        .unwrap();
    let producer = settings.producer("replay-test").unwrap();

    let events = events(&run);
    for e in &events {
        let id = e.event.event_id.to_string();
        let envelope =
            Envelope { topic: &enriched, key: &e.event.node, id: &id, content_type: "x", incoming_trace: None };
        kafka::publish_record(&producer, envelope, &gpumedic_schemas::encode(e).unwrap()).await.unwrap();
    }
    // The recorded verdicts, plus one for a node no event names (inside the window).
    let mut recorded = engine_verdicts(&events);
    assert!(recorded.len() >= 3, "Xid 79 opens and recovers, Xid 13 gives an info verdict: {recorded:?}");
    let mut stray = recorded[0].clone();
    stray.node = format!("{run}-c");
    stray.verdict_id = uuid::Uuid::new_v4();
    recorded.push(stray);
    for v in &recorded {
        let id = v.verdict_id.to_string();
        let envelope = Envelope { topic: &verdicts, key: &v.node, id: &id, content_type: "x", incoming_trace: None };
        kafka::publish_record(&producer, envelope, &gpumedic_schemas::encode(v).unwrap()).await.unwrap();
    }
    let common = ["--kafka-bootstrap", &bootstrap, "--verdicts-topic", &verdicts, "--output", "json"];

    // The default rules give what was recorded, except the stray verdict.
    let args: Vec<&str> = ["replay", "backtest", "--topic", &enriched].into_iter().chain(common).collect();
    let report = json(&args);
    assert_eq!(report["events"], events.len());
    assert_eq!(report["recorded_verdicts"], recorded.len());
    assert_eq!(report["same"], recorded.len() - 1, "{report:#}");
    assert_eq!(
        (count(&report, "changed"), count(&report, "only_recorded"), count(&report, "only_backtest")),
        (0, 1, 0)
    );

    // A changed rule: Xid 79 becomes a warning to drain. Its opening verdict changes, and so does
    // its recovery (which names the severity it clears).
    let rules = std::env::temp_dir().join(&run);
    std::fs::create_dir_all(&rules).unwrap();
    let src = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../classifier/rules");
    for entry in std::fs::read_dir(src).unwrap() {
        let path = entry.unwrap().path();
        let text = std::fs::read_to_string(&path).unwrap();
        let changed = text.replacen(
            "    severity: critical\n    action: reboot_node\n    overridable: true\n    clear:\n      evidence:",
            "    severity: warning\n    action: drain\n    overridable: true\n    clear:\n      evidence:",
            1,
        );
        std::fs::write(rules.join(path.file_name().unwrap()), changed).unwrap();
    }
    let rules_dir = rules.display().to_string();
    let args: Vec<&str> =
        ["replay", "backtest", "--topic", &enriched, "--rules-dir", &rules_dir].into_iter().chain(common).collect();
    let report = json(&args);
    let changed: Vec<&Value> =
        report["differences"].as_array().unwrap().iter().filter(|d| d["change"] == "changed").collect();
    assert_eq!(changed.len(), 2, "{report:#}");
    assert!(
        changed.iter().all(
            |d| d["rule"] == "xid-79-fallen-off-the-bus" && d["backtest"].as_str().unwrap().starts_with("warning/")
        )
    );
    assert!(changed.iter().any(|d| d["recorded"] == "critical/reboot_node" && d["backtest"] == "warning/drain"));

    // A bad rules directory is refused with its problems, and nothing runs.
    std::fs::write(rules.join("99-bad.yaml"), "rules:\n  - id: broken\n    severity: catastrophic\n").unwrap();
    let args: Vec<&str> =
        ["replay", "backtest", "--topic", &enriched, "--rules-dir", &rules_dir].into_iter().chain(common).collect();
    let (ok, _, stderr) = gpumedic(&args);
    assert!(!ok);
    assert!(stderr.contains("99-bad.yaml"), "{stderr}");

    // Export, then backtest the file: the same result as the topic.
    let file = std::env::temp_dir().join(format!("{run}.export"));
    let file_arg = file.display().to_string();
    let (ok, _, stderr) =
        gpumedic(&["replay", "export", "--kafka-bootstrap", &bootstrap, "--topic", &enriched, "--out", &file_arg]);
    assert!(ok, "{stderr}");
    assert!(stderr.contains(&format!("Exported {} records", events.len())), "{stderr}");
    let args: Vec<&str> = ["replay", "backtest", "--file", &file_arg].into_iter().chain(common).collect();
    let from_file = json(&args);
    assert_eq!(from_file["events"], events.len());
    assert_eq!(from_file["same"], recorded.len() - 1);

    // A time range: nothing was produced in the future.
    let args: Vec<&str> = ["replay", "backtest", "--topic", &enriched, "--from", "2999-01-01T00:00:00Z"]
        .into_iter()
        .chain(common)
        .collect();
    assert_eq!(json(&args)["events"], 0);

    // Republish the file to another topic: every record arrives with its key.
    let (ok, _, stderr) =
        gpumedic(&["replay", "republish", "--file", &file_arg, "--kafka-bootstrap", &bootstrap, "--to-topic", &copy]);
    assert!(ok, "{stderr}");
    let args: Vec<&str> = ["replay", "backtest", "--topic", &copy].into_iter().chain(common).collect();
    let copied = json(&args);
    assert_eq!(copied["events"], events.len());
    assert_eq!(copied["same"], recorded.len() - 1);

    // Republished again, every event is on the topic twice, a whole stream apart: the backtest,
    // as the classifier, takes each in once, and gives the same verdicts.
    let (ok, _, stderr) =
        gpumedic(&["replay", "republish", "--file", &file_arg, "--kafka-bootstrap", &bootstrap, "--to-topic", &copy]);
    assert!(ok, "{stderr}");
    let args: Vec<&str> = ["replay", "backtest", "--topic", &copy].into_iter().chain(common).collect();
    let twice = json(&args);
    assert_eq!(
        (twice["events"].as_u64(), twice["duplicates"].as_u64()),
        (Some(events.len() as u64), Some(events.len() as u64))
    );
    assert_eq!(twice["same"], recorded.len() - 1, "{twice:#}");
    let _ = std::fs::remove_file(file);
    let _ = std::fs::remove_dir_all(rules);
    tokio::time::sleep(Duration::from_millis(10)).await;
}
