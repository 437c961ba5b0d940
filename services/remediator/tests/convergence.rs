//! Convergence, as processes against the testbed: the leader resyncs the managed nodes against
//! the open incidents of the incident store (a PostgreSQL database with the classifier's schema,
//! written here as the classifier writes it), so a verdict refused while paused is acted on after
//! the resume, a switch from monitor-only acts on incidents already open, and a node whose
//! incident resolved without its recovery verdict reaching the remediator is released, once, and
//! not taken out again by a replay of the old fault.

mod common;

use std::process::Command;
use std::time::Duration;

use common::*;
use gpumedic_schemas::{ActionStatus, RecommendedAction, Verdict};
use gpumedic_testkit::{self as testkit, ServiceProcess, eventually};
use serde_json::json;
use sqlx::PgPool;

const BIN: &str = env!("CARGO_BIN_EXE_gpumedic-remediator");

/// The incident store: a fresh database with the classifier's migrations.
struct Store {
    pool: PgPool,
    url: String,
}

impl Store {
    async fn new() -> Self {
        let admin = testkit::require_postgres().await.unwrap_or_else(|e| panic!("{e}"));
        let url = testkit::fresh_database(&admin, &testkit::unique_name("convergence")).await.expect("database");
        let pool = gpumedic_runtime::postgres::connect(&url, 2).await.expect("connect");
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../classifier/migrations");
        sqlx::migrate::Migrator::new(dir)
            .await
            .expect("the classifier's migrations")
            .run(&pool)
            .await
            .expect("migrated");
        Store { pool, url }
    }

    /// Records `v` as the classifier does: the incident (resolved by a recovery) and the verdict
    /// with its whole record.
    async fn record(&self, v: &Verdict) {
        sqlx::query(
            "INSERT INTO incidents (incident_id, node, rule_id, severity, opened_at, summary)
             VALUES ($1, $2, $3, 'critical', $4, $5) ON CONFLICT (incident_id) DO NOTHING",
        )
        .bind(v.incident_id)
        .bind(&v.node)
        .bind(&v.rule_id)
        .bind(v.issued_at)
        .bind(&v.reason)
        .execute(&self.pool)
        .await
        .expect("incident written");
        if v.recovery {
            sqlx::query("UPDATE incidents SET resolved_at = $2 WHERE incident_id = $1")
                .bind(v.incident_id)
                .bind(v.issued_at)
                .execute(&self.pool)
                .await
                .expect("incident resolved");
        }
        sqlx::query(
            "INSERT INTO verdicts (verdict_id, incident_id, node, severity, rule_id, rule_version, action, reason,
                                   recovery, issued_at, record)
             VALUES ($1, $2, $3, 'critical', $4, 1, $5, $6, $7, $8, $9::json)",
        )
        .bind(v.verdict_id)
        .bind(v.incident_id)
        .bind(&v.node)
        .bind(&v.rule_id)
        .bind(serde_json::to_value(v.action).unwrap().as_str().unwrap().to_owned())
        .bind(&v.reason)
        .bind(v.recovery)
        .bind(v.issued_at)
        .bind(serde_json::to_string(v).unwrap())
        .execute(&self.pool)
        .await
        .expect("verdict written");
    }
}

/// One test's world: namespace, fleet label, topics, group and incident store.
struct World {
    base: Fleet,
    store: Store,
}

impl std::ops::Deref for World {
    type Target = Fleet;

    fn deref(&self) -> &Fleet {
        &self.base
    }
}

impl World {
    async fn new() -> Self {
        Self { base: Fleet::new().await, store: Store::new().await }
    }

    /// Starts the remediator in `mode`, resyncing every second.
    async fn start(&self, mode: &str) -> ServiceProcess {
        self.start_with(mode, &[]).await
    }

    /// [`World::start`] with `extra` settings.
    async fn start_with(&self, mode: &str, extra: &[(&str, String)]) -> ServiceProcess {
        let mut env = vec![
            ("GPUMEDIC_CONTROL_POLL", "500ms".to_owned()),
            ("GPUMEDIC_INCIDENT_DATABASE_URL", self.store.url.clone()),
            ("GPUMEDIC_RESYNC_INTERVAL", "1s".into()),
        ];
        env.extend(extra.iter().cloned());
        let mut r = ServiceProcess::start(BIN, &[], &self.env("rem-a", mode, &env)).expect("the remediator starts");
        r.wait_ready(Duration::from_secs(90)).await.unwrap_or_else(|e| panic!("{e}"));
        r
    }

    /// Publishes `v` on the verdict topic and records it in the store, as the classifier does.
    async fn issue(&self, v: &Verdict) {
        self.store.record(v).await;
        publish_verdict(&self.bootstrap, &self.verdicts, v).await;
    }

    fn cli(&self, args: &[&str]) {
        let bin = testkit::workspace_binary("gpumedic").unwrap_or_else(|e| panic!("{e}"));
        let out = Command::new(bin)
            .args(args)
            .args(["--namespace", &self.ns])
            .env("KUBECONFIG", testkit::kubeconfig_path())
            .env("GPUMEDIC_OPERATOR", "tester")
            .output()
            .expect("gpumedic runs");
        assert!(out.status.success(), "gpumedic {args:?}: {}", String::from_utf8_lossy(&out.stderr));
    }
}

#[tokio::test]
async fn a_verdict_refused_while_paused_is_acted_on_after_the_resume_while_its_incident_is_open() {
    let w = World::new().await;
    let (open_node, closed_node) = (w.node().await, w.node().await);
    let mut r = w.start("cordon-drain").await;
    w.cli(&["pause", "--reason", "driver rollout"]);
    eventually("the leader to pause", Duration::from_secs(30), async || {
        metric(&r, "gpumedic_remediator_paused 1").await.then_some(())
    })
    .await;
    let open = testkit::verdict(&open_node).action(RecommendedAction::Cordon).build();
    let closed = testkit::verdict(&closed_node).action(RecommendedAction::Cordon).build();
    for v in [&open, &closed] {
        w.issue(v).await;
        let o = wait_for_outcome(&w.actions, v.verdict_id, |_| true).await;
        assert_eq!(o.status, ActionStatus::SkippedByMode, "{}", o.detail);
    }
    // The second incident resolves while paused; its recovery verdict finds nothing to undo.
    let recovered = testkit::verdict(&closed_node).incident(closed.incident_id).recovery(true).build();
    w.issue(&recovered).await;
    wait_for_outcome(&w.actions, recovered.verdict_id, |_| true).await;
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert!(!cordoned(&get_node(&w.client, &open_node).await), "paused: nothing changes, resync included");

    w.cli(&["resume"]);
    // No new verdict: the resync acts on the incident still open, under the verdict that asked.
    let o = wait_for_outcome(&w.actions, open.verdict_id, |o| o.status == ActionStatus::Applied).await;
    assert!(o.detail.starts_with("resync"), "{}", o.detail);
    assert!(cordoned(&get_node(&w.client, &open_node).await));
    tokio::time::sleep(Duration::from_secs(4)).await;
    assert!(!cordoned(&get_node(&w.client, &closed_node).await), "a resolved incident is not acted on");
    r.terminate(Duration::from_secs(20)).await.unwrap_or_else(|e| panic!("{e}"));
    cleanup(&w.client, &[&open_node, &closed_node], &[&w.ns]).await;
}

#[tokio::test]
async fn switching_monitor_only_to_cordon_drain_acts_on_the_incidents_already_open() {
    let w = World::new().await;
    let name = w.node().await;
    let mut r = w.start("monitor-only").await;
    let v = testkit::verdict(&name).action(RecommendedAction::Cordon).build();
    w.issue(&v).await;
    let o = wait_for_outcome(&w.actions, v.verdict_id, |_| true).await;
    assert_eq!(o.status, ActionStatus::DryRun, "{}", o.detail);
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert!(!cordoned(&get_node(&w.client, &name).await), "monitor-only changes nothing");
    r.terminate(Duration::from_secs(20)).await.unwrap_or_else(|e| panic!("{e}"));

    // The same group: the verdict was handled and is not delivered again.
    let mut r = w.start("cordon-drain").await;
    let o = wait_for_outcome(&w.actions, v.verdict_id, |o| o.status == ActionStatus::Applied).await;
    assert!(o.detail.starts_with("resync"), "{}", o.detail);
    let node = get_node(&w.client, &name).await;
    assert!(cordoned(&node) && !gpumedic_taints(&node).is_empty());
    r.terminate(Duration::from_secs(20)).await.unwrap_or_else(|e| panic!("{e}"));
    cleanup(&w.client, &[&name], &[&w.ns]).await;
}

#[tokio::test]
async fn a_node_whose_incident_resolved_without_its_verdict_is_released_once_and_a_replay_does_not_take_it_again() {
    let w = World::new().await;
    let name = w.node().await;
    let mut r = w.start("cordon-drain").await;
    let fault = testkit::verdict(&name).action(RecommendedAction::Cordon).build();
    w.issue(&fault).await;
    wait_for_outcome(&w.actions, fault.verdict_id, |o| o.status == ActionStatus::Applied).await;
    assert!(cordoned(&get_node(&w.client, &name).await));

    // The incident resolves in the store; its recovery verdict never reaches the remediator.
    let recovery = testkit::verdict(&name).incident(fault.incident_id).recovery(true).build();
    w.store.record(&recovery).await;
    let o = wait_for_outcome(&w.actions, recovery.verdict_id, |o| o.status == ActionStatus::Applied).await;
    assert!(o.detail.starts_with("resync"), "{}", o.detail);
    let node = get_node(&w.client, &name).await;
    assert!(!cordoned(&node) && gpumedic_taints(&node).is_empty(), "released");

    // The old fault verdict, replayed: the node stays in service.
    let mut replay = fault.clone();
    replay.verdict_id = uuid::Uuid::new_v4();
    publish_verdict(&w.bootstrap, &w.verdicts, &replay).await;
    let o = wait_for_outcome(&w.actions, replay.verdict_id, |_| true).await;
    assert_eq!(o.status, ActionStatus::SkippedByMode, "{}", o.detail);
    assert!(o.detail.contains("recovered already"), "{}", o.detail);
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert!(!cordoned(&get_node(&w.client, &name).await), "a replayed fault does not take a recovered node out");
    let released = eventually("the recovery outcome count", Duration::from_secs(10), async || {
        let body = testkit::http_get(r.admin_addr(), "/metrics").await.ok()?.1;
        body.lines()
            .find(|l| {
                l.starts_with("gpumedic_remediator_resync_actions_total{")
                    && l.contains("kind=\"recovery\"")
                    && l.contains("result=\"applied\"")
            })
            .map(str::to_owned)
    })
    .await;
    assert!(released.ends_with(" 1"), "released exactly once: {released}");
    r.terminate(Duration::from_secs(20)).await.unwrap_or_else(|e| panic!("{e}"));
    cleanup(&w.client, &[&name], &[&w.ns]).await;
}

#[tokio::test]
async fn a_drain_a_pdb_held_past_its_deadline_is_reported_incomplete_and_retried_until_it_finishes() {
    use k8s_openapi::api::policy::v1::PodDisruptionBudget;
    use kube::api::{Api, DeleteParams, Patch, PatchParams, PostParams};
    let w = World::new().await;
    let name = w.node().await;
    pod(&w.client, &w.ns, "held", &name, json!({ "labels": { "app": "held" } })).await;
    mark_running(&w.client, &w.ns, "held").await;
    let pdbs: Api<PodDisruptionBudget> = Api::namespaced(w.client.clone(), &w.ns);
    let pdb: PodDisruptionBudget = serde_json::from_value(json!({
        "metadata": { "name": "held" },
        "spec": { "minAvailable": 1, "selector": { "matchLabels": { "app": "held" } } }
    }))
    .unwrap();
    let created = pdbs.create(&PostParams::default(), &pdb).await.expect("pdb created");
    // No controller-manager in the testbed: write the status its disruption controller would.
    let status = json!({ "status": { "observedGeneration": created.metadata.generation, "disruptionsAllowed": 0,
        "currentHealthy": 1, "desiredHealthy": 1, "expectedPods": 1 } });
    pdbs.patch_status("held", &PatchParams::default(), &Patch::Merge(status)).await.expect("pdb status");

    let mut r = w.start_with("cordon-drain", &[("GPUMEDIC_DRAIN_DEADLINE", "1s".into())]).await;
    let v = testkit::verdict(&name).action(RecommendedAction::Drain).build();
    w.issue(&v).await;
    let o = wait_for_outcome(&w.actions, v.verdict_id, |o| o.status == ActionStatus::Applied).await;
    // The verdict's own outcome, or the resync's when it reached the stored incident first.
    assert!(
        o.detail.starts_with("drain incomplete")
            || o.detail.starts_with("resync (the node did not match its fault verdict): drain incomplete"),
        "{}",
        o.detail
    );
    assert_eq!(pods_left(&w.client, &w.ns).await, ["held"]);
    eventually("the incomplete drain to be counted", Duration::from_secs(10), async || {
        let body = testkit::http_get(r.admin_addr(), "/metrics").await.ok()?.1;
        body.lines()
            .any(|l| l.starts_with("gpumedic_remediator_drains_incomplete_total") && !l.ends_with(" 0"))
            .then_some(())
    })
    .await;
    assert_eq!(
        get_node(&w.client, &name)
            .await
            .metadata
            .labels
            .unwrap_or_default()
            .get("gpumedic.io/state")
            .map(String::as_str),
        Some("draining")
    );

    // The budget goes; no new verdict: the resync drains again and the node reads drained.
    pdbs.delete("held", &DeleteParams::default()).await.expect("pdb deleted");
    eventually("the resync to finish the drain", Duration::from_secs(60), async || {
        let node = get_node(&w.client, &name).await;
        let drained =
            node.metadata.labels.unwrap_or_default().get("gpumedic.io/state").map(String::as_str) == Some("drained");
        (drained && pods_left(&w.client, &w.ns).await.is_empty()).then_some(())
    })
    .await;
    let o = wait_for_outcome(&w.actions, v.verdict_id, |o| o.detail.starts_with("resync")).await;
    assert_eq!(o.status, ActionStatus::Applied, "{}", o.detail);
    r.terminate(Duration::from_secs(20)).await.unwrap_or_else(|e| panic!("{e}"));
    cleanup(&w.client, &[&name], &[&w.ns]).await;
}

/// Found by the full chaos run: a deferrable action (it waits for the node to have no workload)
/// carried out after its deferral was, at every resync interval, deferred again and reported
/// again ("the action waits for ..."), so the actions topic never went quiet and the node's
/// deferral was rewritten forever. A carried-out action is in line with its incident.
#[tokio::test]
async fn a_deferred_action_once_carried_out_is_not_deferred_again_by_the_resync() {
    let w = World::new().await;
    let name = w.node().await;
    // Deferrals checked every second, as the resync runs: a loop between them shows in seconds.
    let mut r = w.start_with("cordon-drain", &[("GPUMEDIC_MAINTENANCE_CHECK", "1s".into())]).await;
    let v = testkit::verdict(&name).action(RecommendedAction::Drain).deferrable(true).build();
    w.issue(&v).await;
    // The node runs no workload: the deferral is due at once, and the drain is carried out.
    eventually("the deferred drain to be carried out", Duration::from_secs(60), async || {
        cordoned(&get_node(&w.client, &name).await).then_some(())
    })
    .await;
    // Several resync intervals (1 s each) with the incident still open. (A resync may reach the
    // incident before its verdict does, and defer it first: counted before, not after.)
    tokio::time::sleep(Duration::from_secs(3)).await;
    let before = resync_deferrals(&r).await;
    tokio::time::sleep(Duration::from_secs(8)).await;
    assert_eq!(resync_deferrals(&r).await, before, "the resync deferred a carried-out action again");
    assert!(cordoned(&get_node(&w.client, &name).await), "still in line with the open incident");
    r.terminate(Duration::from_secs(20)).await.unwrap_or_else(|e| panic!("{e}"));
    cleanup(&w.client, &[&name], &[&w.ns]).await;
}

/// Found by the full chaos run too: a node records one deferral, so two incidents on one node
/// both waiting (here for a time their verdicts name) took the record from each other at every
/// resync interval, each time deferred and reported again. The pending one stays; the other is
/// re-issued after it.
#[tokio::test]
async fn two_deferred_incidents_on_one_node_do_not_take_the_deferral_from_each_other() {
    let w = World::new().await;
    let name = w.node().await;
    let mut r = w.start("cordon-drain").await;
    let later = chrono::Utc::now() + chrono::Duration::hours(2);
    for _ in 0..2 {
        let v = testkit::verdict(&name).action(RecommendedAction::Drain).not_before(later).build();
        w.issue(&v).await;
        wait_for_outcome(&w.actions, v.verdict_id, |_| true).await;
    }
    // Several resync intervals (1 s each) with both incidents open and waiting.
    tokio::time::sleep(Duration::from_secs(3)).await;
    let before = resync_deferrals(&r).await;
    tokio::time::sleep(Duration::from_secs(8)).await;
    assert_eq!(resync_deferrals(&r).await, before, "the resync moved the node's deferral between its incidents");
    r.terminate(Duration::from_secs(20)).await.unwrap_or_else(|e| panic!("{e}"));
    cleanup(&w.client, &[&name], &[&w.ns]).await;
}

/// How many times the resync deferred an action (`gpumedic_remediator_resync_actions_total`
/// with result `deferred`).
async fn resync_deferrals(r: &ServiceProcess) -> f64 {
    let (_, text) = testkit::http_get(r.admin_addr(), "/metrics").await.expect("metrics");
    text.lines()
        .filter(|l| l.starts_with("gpumedic_remediator_resync_actions_total") && l.contains("result=\"deferred\""))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}
