//! The remediator's control plane, as processes against the testbed: two replicas sharing a
//! Lease (exactly one acts; the standby takes over a drain the killed leader left half done,
//! repeating no step), the circuit breaker persisted in the status object (a restart keeps it
//! open, `gpumedic breaker reset` closes it, recoveries proceed while it is open), the global
//! pause through `gpumedic pause|resume`, and a maintenance window that defers a non-urgent drain
//! and carries it out when it opens. Each test has its own namespace (Lease, status object, pods),
//! nodes, topics and consumer group.

mod common;

use std::process::Command;
use std::time::Duration;

use common::*;
use gpumedic_remediator::control::{self, StatusClient};
use gpumedic_remediator::maintenance::DEFERRED_ANNOTATION;
use gpumedic_schemas::{ActionOutcome, ActionStatus, RecommendedAction, Severity};
use gpumedic_testkit::{self as testkit, ServiceProcess, eventually};
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::policy::v1::PodDisruptionBudget;
use kube::api::{Api, DeleteParams, PostParams};
use rdkafka::consumer::{Consumer as _, StreamConsumer};
use serde_json::json;

const BIN: &str = env!("CARGO_BIN_EXE_gpumedic-remediator");

/// One test's world: its namespace, fleet label, topics and group.
struct World(Fleet);

impl std::ops::Deref for World {
    type Target = Fleet;

    fn deref(&self) -> &Fleet {
        &self.0
    }
}

impl World {
    async fn new() -> Self {
        Self(Fleet::new().await)
    }

    /// Starts a remediator replica named `identity`, with short lease timings and `extra` env.
    fn start(&self, identity: &str, extra: &[(&str, String)]) -> ServiceProcess {
        let mut env = vec![("GPUMEDIC_CONTROL_POLL", "500ms".to_owned())];
        env.extend(extra.iter().cloned());
        ServiceProcess::start(BIN, &[], &self.env(identity, "cordon-drain", &env)).expect("the remediator starts")
    }

    /// Every outcome on the actions topic, read until it has been quiet for a few seconds.
    async fn all_outcomes(&self) -> Vec<ActionOutcome> {
        let consumer: StreamConsumer = rdkafka::ClientConfig::new()
            .set("bootstrap.servers", &self.bootstrap)
            .set("group.id", testkit::unique_name("reader"))
            .set("auto.offset.reset", "earliest")
            .set("enable.auto.commit", "false")
            .create()
            .unwrap();
        consumer.subscribe(&[&self.actions]).unwrap();
        let mut all = Vec::new();
        while let Ok(Ok(m)) = tokio::time::timeout(Duration::from_secs(5), consumer.recv()).await {
            let r = gpumedic_runtime::kafka::Record::from_message(&m);
            all.push(gpumedic_schemas::decode(r.payload.as_deref().unwrap()).unwrap());
        }
        all
    }

    async fn holder(&self) -> Option<String> {
        Api::<Lease>::namespaced(self.client.clone(), &self.ns)
            .get_opt("gpumedic-remediator")
            .await
            .expect("lease read")
            .and_then(|l| l.spec)
            .and_then(|s| s.holder_identity)
    }

    async fn status(&self) -> control::Status {
        StatusClient::new(self.client.clone(), &self.ns, control::STATUS_CONFIGMAP).read().await.expect("status")
    }

    /// Runs the `gpumedic` CLI against this world's namespace; returns stdout.
    fn cli(&self, args: &[&str]) -> String {
        let bin = testkit::workspace_binary("gpumedic").unwrap_or_else(|e| panic!("{e}"));
        let out = Command::new(bin)
            .args(args)
            .args(["--namespace", &self.ns])
            .env("KUBECONFIG", testkit::kubeconfig_path())
            .env("GPUMEDIC_OPERATOR", "tester")
            .output()
            .expect("gpumedic runs");
        assert!(out.status.success(), "gpumedic {args:?}: {}", String::from_utf8_lossy(&out.stderr));
        String::from_utf8(out.stdout).unwrap()
    }
}

/// Waits until `node` carries no deferred action.
async fn plan_removed(client: &kube::Client, node: &str) {
    eventually("the deferred action to be removed", Duration::from_secs(15), async || {
        let n = get_node(client, node).await;
        n.metadata.annotations.as_ref().is_none_or(|a| !a.contains_key(DEFERRED_ANNOTATION)).then_some(())
    })
    .await;
}

fn state(node: &k8s_openapi::api::core::v1::Node) -> Option<String> {
    labels(node).get("gpumedic.io/state").cloned()
}

#[tokio::test]
async fn leader_failover_mid_drain_finishes_the_drain_once() {
    let w = World::new().await;
    let name = w.node().await;
    pod(&w.client, &w.ns, "held-0", &name, json!({ "labels": { "app": "held" } })).await;
    mark_running(&w.client, &w.ns, "held-0").await;
    let pdbs: Api<PodDisruptionBudget> = Api::namespaced(w.client.clone(), &w.ns);
    let pdb = json!({ "metadata": { "name": "held" },
        "spec": { "minAvailable": 1, "selector": { "matchLabels": { "app": "held" } } } });
    pdbs.create(&PostParams::default(), &serde_json::from_value(pdb).unwrap()).await.expect("pdb");

    let slow_drain = [("GPUMEDIC_DRAIN_DEADLINE", "180s".to_owned())];
    let mut first = Some(w.start("rem-a", &slow_drain));
    first.as_mut().unwrap().wait_ready(Duration::from_secs(90)).await.unwrap_or_else(|e| panic!("{e}"));
    let mut second = w.start("rem-b", &slow_drain);
    second.wait_ready(Duration::from_secs(90)).await.unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(w.holder().await.as_deref(), Some("rem-a"), "the first replica leads");
    assert!(metric(first.as_ref().unwrap(), "gpumedic_remediator_leader 1").await);
    assert!(metric(&second, "gpumedic_remediator_leader 0").await, "the standby is ready but does not lead");

    let v = testkit::verdict(&name).action(RecommendedAction::Drain).build();
    w.publish(&v).await;
    // Mid-drain: cordoned, tainted, draining, the PodDisruptionBudget holding the pod.
    eventually("the leader to start draining", Duration::from_secs(60), async || {
        let n = get_node(&w.client, &name).await;
        (state(&n).as_deref() == Some("draining")).then_some(())
    })
    .await;
    eventually("the DrainStarted Event", Duration::from_secs(30), async || {
        event_reasons(&w.client, &name).await.iter().any(|e| e == "DrainStarted").then_some(())
    })
    .await;

    let killed = std::time::Instant::now();
    drop(first.take()); // SIGKILL: no release, no commit.
    eventually("the standby to take the lease over", Duration::from_secs(60), async || {
        (w.holder().await.as_deref() == Some("rem-b")).then_some(())
    })
    .await;
    println!("takeover after SIGKILL: {:?} (lease duration 4s, renew 1s)", killed.elapsed());
    // The budget lifts; the new leader's drain (picked up from the redelivered verdict) finishes.
    pdbs.delete("held", &DeleteParams::default()).await.expect("pdb lifted");
    eventually("the node to be drained", Duration::from_secs(120), async || {
        let n = get_node(&w.client, &name).await;
        (state(&n).as_deref() == Some("drained")).then_some(())
    })
    .await;
    assert!(pods_left(&w.client, &w.ns).await.is_empty());

    let applied = w.outcome(v.verdict_id, |o| o.status == ActionStatus::Applied).await;
    assert!(applied.detail.contains("1 evicted"), "the new leader evicted the pod: {}", applied.detail);
    assert!(!applied.detail.contains("cordoned"), "the new leader did not cordon again: {}", applied.detail);
    let all: Vec<_> = w.all_outcomes().await.into_iter().filter(|o| o.verdict_id == v.verdict_id).collect();
    assert_eq!(all.len(), 1, "one outcome for the verdict (the killed leader never finished it): {all:?}");
    let events = event_reasons(&w.client, &name).await;
    for once in ["Cordoned", "Tainted", "Drained"] {
        assert_eq!(events.iter().filter(|e| *e == once).count(), 1, "{once} once: {events:?}");
    }
    let node = get_node(&w.client, &name).await;
    assert!(cordoned(&node));
    assert_eq!(gpumedic_taints(&node).len(), 1);
    let status = second.terminate(Duration::from_secs(20)).await.unwrap_or_else(|e| panic!("{e}"));
    assert!(status.success(), "the leader exits 0 on SIGTERM: {status}");
    assert_eq!(w.holder().await, None, "a leader shutting down releases the lease");
    cleanup(&w.client, &[&name], &[&w.ns]).await;
}

#[tokio::test]
async fn a_leader_whose_apiserver_stops_answering_stops_leading_before_a_standby_can_take_over() {
    let w = World::new().await;
    // The leader reaches the apiserver through a relay; the standby directly.
    let kubeconfig = std::fs::read_to_string(testkit::kubeconfig_path()).expect("the testbed's kubeconfig");
    let server = kubeconfig
        .lines()
        .find_map(|l| l.trim().strip_prefix("server: https://"))
        .expect("the kubeconfig names its server")
        .trim()
        .to_owned();
    let relay = testkit::Relay::start(&server).await.expect("the relay starts");
    let relayed = std::env::temp_dir().join(testkit::unique_name("kubeconfig"));
    std::fs::write(&relayed, kubeconfig.replace(&server, &relay.addr().to_string())).unwrap();
    // Renew deadline 6 s: the leader must stop by then; a standby takes over no sooner than 8 s
    // after it last saw the lease change.
    let timings = [("GPUMEDIC_LEASE_DURATION", "8s".to_owned()), ("GPUMEDIC_LEASE_RENEW", "2s".to_owned())];
    let mut env_a = timings.to_vec();
    env_a.push(("KUBECONFIG", relayed.display().to_string()));
    let mut first = w.start("rem-a", &env_a);
    first.wait_ready(Duration::from_secs(90)).await.unwrap_or_else(|e| panic!("{e}"));
    eventually("the first replica to lead", Duration::from_secs(30), async || {
        (w.holder().await.as_deref() == Some("rem-a")).then_some(())
    })
    .await;
    let mut second = w.start("rem-b", &timings);
    second.wait_ready(Duration::from_secs(90)).await.unwrap_or_else(|e| panic!("{e}"));
    assert!(metric(&first, "gpumedic_remediator_leader 1").await, "the first replica leads");

    // The apiserver stops answering the leader. It must stop acting on its own clock, before the
    // standby may see the lease as expired and take over.
    relay.hold(true);
    let held = std::time::Instant::now();
    let mut stopped = None;
    loop {
        // The leader's gauge is read before the lease, so a stop seen here came first.
        if stopped.is_none() && metric(&first, "gpumedic_remediator_leader 0").await {
            stopped = Some(held.elapsed());
        }
        if w.holder().await.as_deref() == Some("rem-b") {
            break;
        }
        assert!(held.elapsed() < Duration::from_secs(60), "the standby never took over");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let took_over = held.elapsed();
    println!(
        "apiserver held from the leader: it stopped leading after {stopped:?}; the standby took over after {took_over:?} (lease 8s, renew 2s)"
    );
    let stopped = stopped.unwrap_or_else(|| {
        panic!("the old leader still said it led when the standby took over ({took_over:?} after the hold)")
    });
    assert!(stopped < took_over);

    // The new leader acts; the old one, its apiserver back, stands by and writes nothing.
    let name = w.node().await;
    let v = testkit::verdict(&name).action(RecommendedAction::Cordon).build();
    w.publish(&v).await;
    w.outcome(v.verdict_id, |o| o.status == ActionStatus::Applied).await;
    relay.hold(false);
    tokio::time::sleep(Duration::from_secs(5)).await;
    assert!(
        metric(&first, "gpumedic_remediator_leader 0").await,
        "the old leader stands by once it hears the apiserver again"
    );
    assert_eq!(w.holder().await.as_deref(), Some("rem-b"));
    let events = event_reasons(&w.client, &name).await;
    assert_eq!(events.iter().filter(|e| *e == "Cordoned").count(), 1, "cordoned once: {events:?}");
    drop(first);
    second.terminate(Duration::from_secs(20)).await.unwrap_or_else(|e| panic!("{e}"));
    std::fs::remove_file(&relayed).ok();
    cleanup(&w.client, &[&name], &[&w.ns]).await;
}

#[tokio::test]
async fn the_breaker_survives_a_restart_lets_recoveries_through_and_closes_on_gpumedic_breaker_reset() {
    let w = World::new().await;
    let mut nodes = Vec::new();
    for _ in 0..4 {
        nodes.push(w.node().await);
    }
    // Two of four may be quarantined; the third trips the breaker.
    let limits = [("GPUMEDIC_BREAKER_MAX_SHARE", "0.5".to_owned())];
    let mut r = w.start("rem-a", &limits);
    r.wait_ready(Duration::from_secs(90)).await.unwrap_or_else(|e| panic!("{e}"));
    let incidents: Vec<uuid::Uuid> = nodes.iter().map(|_| uuid::Uuid::new_v4()).collect();
    let cordon =
        |i: usize| testkit::verdict(&nodes[i]).incident(incidents[i]).action(RecommendedAction::Cordon).build();
    for i in 0..2 {
        let v = cordon(i);
        w.publish(&v).await;
        w.outcome(v.verdict_id, |o| o.status == ActionStatus::Applied).await;
    }
    let v = cordon(2);
    w.publish(&v).await;
    w.outcome(v.verdict_id, |o| o.status == ActionStatus::BlockedByBreaker).await;
    let status = w.status().await;
    assert!(status.breaker_open, "the trip is in the status object: {status:?}");
    assert!(status.breaker_reason.as_deref().is_some_and(|r| r.contains("3 of 4")), "{status:?}");
    assert!(metric(&r, "gpumedic_remediator_breaker_open 1").await);

    // A restart keeps it open.
    r.terminate(Duration::from_secs(20)).await.unwrap_or_else(|e| panic!("{e}"));
    let mut r = w.start("rem-a2", &limits);
    r.wait_ready(Duration::from_secs(90)).await.unwrap_or_else(|e| panic!("{e}"));
    let v = cordon(3);
    w.publish(&v).await;
    w.outcome(v.verdict_id, |o| o.status == ActionStatus::BlockedByBreaker).await;
    assert!(!cordoned(&get_node(&w.client, &nodes[3]).await));

    // Recoveries proceed while it is open.
    let v = testkit::verdict(&nodes[0]).incident(incidents[0]).severity(Severity::Info).recovery(true).build();
    w.publish(&v).await;
    w.outcome(v.verdict_id, |o| o.status == ActionStatus::Applied).await;
    assert!(!cordoned(&get_node(&w.client, &nodes[0]).await), "recovered while the breaker is open");

    let shown: serde_json::Value = serde_json::from_str(&w.cli(&["breaker", "status", "-o", "json"])).unwrap();
    assert_eq!((shown["breakerOpen"].as_bool(), shown["leader"].as_str()), (Some(true), Some("rem-a2")), "{shown}");
    w.cli(&["breaker", "reset"]);
    eventually("the leader to carry the reset out", Duration::from_secs(30), async || {
        let s = w.status().await;
        (!s.breaker_open && !s.reset_requested()).then_some(s)
    })
    .await;
    let shown: serde_json::Value = serde_json::from_str(&w.cli(&["breaker", "status", "-o", "json"])).unwrap();
    assert_eq!(shown["lastResetBy"], "tester", "{shown}");
    let v = cordon(3);
    w.publish(&v).await;
    w.outcome(v.verdict_id, |o| o.status == ActionStatus::Applied).await;
    assert!(cordoned(&get_node(&w.client, &nodes[3]).await), "quarantines go through after the reset");
    r.terminate(Duration::from_secs(20)).await.unwrap_or_else(|e| panic!("{e}"));
    let refs: Vec<&str> = nodes.iter().map(String::as_str).collect();
    cleanup(&w.client, &refs, &[&w.ns]).await;
}

#[tokio::test]
async fn a_failover_does_not_refresh_the_breaker_budget_even_after_the_quarantined_node_recovered() {
    let w = World::new().await;
    let (first, second) = (w.node().await, w.node().await);
    // One quarantine per hour, whatever the share.
    let limits = [("GPUMEDIC_BREAKER_MAX_COUNT", "1".to_owned())];
    let mut r = w.start("rem-a", &limits);
    r.wait_ready(Duration::from_secs(90)).await.unwrap_or_else(|e| panic!("{e}"));
    let incident = uuid::Uuid::new_v4();
    let v = testkit::verdict(&first).incident(incident).action(RecommendedAction::Cordon).build();
    w.publish(&v).await;
    w.outcome(v.verdict_id, |o| o.status == ActionStatus::Applied).await;
    // It recovers: gpumedic's taint, which a new leader used to count the budget from, is gone.
    let v = testkit::verdict(&first).incident(incident).severity(Severity::Info).recovery(true).build();
    w.publish(&v).await;
    w.outcome(v.verdict_id, |o| o.status == ActionStatus::Applied).await;
    assert!(gpumedic_taints(&get_node(&w.client, &first).await).is_empty());
    let status = w.status().await;
    assert!(status.quarantine_ledger.contains_key(&first), "the budget spent is shared: {status:?}");

    r.terminate(Duration::from_secs(20)).await.unwrap_or_else(|e| panic!("{e}"));
    let mut r = w.start("rem-b", &limits);
    r.wait_ready(Duration::from_secs(90)).await.unwrap_or_else(|e| panic!("{e}"));
    let v = testkit::verdict(&second).action(RecommendedAction::Cordon).build();
    w.publish(&v).await;
    let o = w.outcome(v.verdict_id, |_| true).await;
    assert_eq!(o.status, ActionStatus::BlockedByBreaker, "the new leader counts the first quarantine: {}", o.detail);
    assert!(!cordoned(&get_node(&w.client, &second).await));
    r.terminate(Duration::from_secs(20)).await.unwrap_or_else(|e| panic!("{e}"));
    cleanup(&w.client, &[&first, &second], &[&w.ns]).await;
}

#[tokio::test]
async fn a_verdict_while_paused_changes_nothing_and_resume_lets_the_next_through() {
    let w = World::new().await;
    let name = w.node().await;
    let mut r = w.start("rem-a", &[]);
    r.wait_ready(Duration::from_secs(90)).await.unwrap_or_else(|e| panic!("{e}"));
    let table = w.cli(&["pause", "--reason", "driver rollout"]);
    assert!(table.contains("PAUSED") && table.contains("yes"), "{table}");
    eventually("the leader to pause", Duration::from_secs(30), async || {
        metric(&r, "gpumedic_remediator_paused 1").await.then_some(())
    })
    .await;
    let before = get_node(&w.client, &name).await;
    let incident = uuid::Uuid::new_v4();
    let v = testkit::verdict(&name).incident(incident).action(RecommendedAction::Drain).build();
    w.publish(&v).await;
    let o = w.outcome(v.verdict_id, |_| true).await;
    assert_eq!(o.status, ActionStatus::SkippedByMode);
    assert!(o.detail.contains("paused"), "{}", o.detail);
    let after = get_node(&w.client, &name).await;
    assert_eq!(after.metadata.labels, before.metadata.labels);
    assert_eq!(after.metadata.annotations, before.metadata.annotations);
    assert_eq!(after.spec, before.spec, "no cordon, no taint");
    assert_eq!(conditions(&after), conditions(&before), "no condition");

    w.cli(&["resume"]);
    eventually("the leader to resume", Duration::from_secs(30), async || {
        metric(&r, "gpumedic_remediator_paused 0").await.then_some(())
    })
    .await;
    let v = testkit::verdict(&name).incident(incident).action(RecommendedAction::Cordon).build();
    w.publish(&v).await;
    w.outcome(v.verdict_id, |o| o.status == ActionStatus::Applied).await;
    assert!(cordoned(&get_node(&w.client, &name).await));
    r.terminate(Duration::from_secs(20)).await.unwrap_or_else(|e| panic!("{e}"));
    cleanup(&w.client, &[&name], &[&w.ns]).await;
}

#[tokio::test]
async fn a_non_urgent_drain_waits_for_the_maintenance_window_and_runs_when_it_opens() {
    let w = World::new().await;
    let waits = w.node().await;
    let urgent = w.node().await;
    pod(&w.client, &w.ns, "job-0", &waits, json!({})).await;
    // A window opening 30 s from now (long enough to defer first on a busy machine).
    let opens = chrono::DateTime::from_timestamp(chrono::Utc::now().timestamp() + 30, 0).expect("a time");
    let closes = opens + chrono::Duration::minutes(30);
    let window = format!("daily {}-{} UTC", opens.format("%H:%M:%S"), closes.format("%H:%M:%S"));
    let mut r = w.start(
        "rem-a",
        &[("GPUMEDIC_MAINTENANCE_WINDOWS", window.clone()), ("GPUMEDIC_MAINTENANCE_CHECK", "1s".into())],
    );
    r.wait_ready(Duration::from_secs(90)).await.unwrap_or_else(|e| panic!("{e}"));

    let v = testkit::verdict(&waits).action(RecommendedAction::Drain).severity(Severity::Warning).build();
    w.publish(&v).await;
    let critical = testkit::verdict(&urgent).action(RecommendedAction::Drain).build();
    w.publish(&critical).await;
    let deferred = w.outcome(v.verdict_id, |_| true).await;
    assert!(
        chrono::Utc::now() < opens,
        "the machine was too slow: the window ({window}) opened before the verdict was handled"
    );
    assert_eq!(deferred.status, ActionStatus::SkippedByMode, "{}", deferred.detail);
    assert!(deferred.detail.contains("maintenance window"), "{}", deferred.detail);
    let node = get_node(&w.client, &waits).await;
    assert!(!cordoned(&node) && gpumedic_taints(&node).is_empty(), "nothing disruptive before the window");
    assert!(conditions(&node).iter().any(|(t, s, _)| t == "GpuUnhealthy" && s == "True"), "marked now");
    assert!(node.metadata.annotations.as_ref().is_some_and(|a| a.contains_key(DEFERRED_ANNOTATION)));
    // A critical verdict does not wait.
    w.outcome(critical.verdict_id, |o| o.status == ActionStatus::Applied).await;
    assert!(cordoned(&get_node(&w.client, &urgent).await));

    // The window opens: the deferred drain runs and its outcome is published.
    let done = w.outcome(v.verdict_id, |o| o.status == ActionStatus::Applied).await;
    assert!(chrono::Utc::now() >= opens, "not before the window opened");
    assert!(done.detail.contains("cordoned") && done.detail.contains("drain"), "{}", done.detail);
    let node = get_node(&w.client, &waits).await;
    assert_eq!(state(&node).as_deref(), Some("drained"));
    // The plan is removed just after the outcome is published.
    plan_removed(&w.client, &waits).await;
    assert!(pods_left(&w.client, &w.ns).await.is_empty());
    r.terminate(Duration::from_secs(20)).await.unwrap_or_else(|e| panic!("{e}"));
    cleanup(&w.client, &[&waits, &urgent], &[&w.ns]).await;
}

#[tokio::test]
async fn scheduled_maintenance_waits_for_its_not_before_across_a_restart_and_a_past_one_acts_now() {
    let w = World::new().await;
    let scheduled = w.node().await;
    let due = w.node().await;
    pod(&w.client, &w.ns, "job-0", &scheduled, json!({})).await;
    let mut r = w.start("rem-a", &[("GPUMEDIC_MAINTENANCE_CHECK", "1s".into())]);
    r.wait_ready(Duration::from_secs(90)).await.unwrap_or_else(|e| panic!("{e}"));

    // The provider's window starts soon; the classifier's not_before is its start less the lead.
    let not_before = chrono::Utc::now() + chrono::Duration::seconds(25);
    let mut v = testkit::verdict(&scheduled).action(RecommendedAction::Drain).severity(Severity::Warning).build();
    v.rule_id = "cloud-maintenance".into();
    v.not_before = Some(not_before);
    w.publish(&v).await;
    // A notice whose not_before has already come acts at once.
    let mut now = testkit::verdict(&due).action(RecommendedAction::Drain).severity(Severity::Warning).build();
    now.rule_id = "cloud-maintenance".into();
    now.not_before = Some(chrono::Utc::now() - chrono::Duration::seconds(5));
    w.publish(&now).await;

    let held = w.outcome(v.verdict_id, |_| true).await;
    assert!(
        chrono::Utc::now() < not_before,
        "the machine was too slow: not_before passed before the verdict was handled"
    );
    assert_eq!(held.status, ActionStatus::SkippedByMode, "{}", held.detail);
    assert!(held.detail.contains("the time the verdict names"), "{}", held.detail);
    let node = get_node(&w.client, &scheduled).await;
    assert!(!cordoned(&node) && gpumedic_taints(&node).is_empty(), "nothing disruptive before not_before");
    assert!(node.metadata.annotations.as_ref().is_some_and(|a| a.contains_key(DEFERRED_ANNOTATION)));
    w.outcome(now.verdict_id, |o| o.status == ActionStatus::Applied).await;
    assert!(cordoned(&get_node(&w.client, &due).await), "a not_before in the past does not hold");

    // A deferred record is data about its own node: one on `forged` naming `victim` is dropped.
    let forged = w.node().await;
    let victim = w.node().await;
    let record = gpumedic_remediator::maintenance::Deferred {
        verdict_id: uuid::Uuid::new_v4(),
        action: RecommendedAction::Drain,
        request: gpumedic_remediator::verdicts::remediation(
            &testkit::verdict(&victim).action(RecommendedAction::Drain).build(),
        ),
        deferred_at: chrono::Utc::now(),
        not_before: chrono::Utc::now(),
        until: gpumedic_remediator::maintenance::Until::Time,
    };
    let raw = serde_json::to_string(&record).unwrap();
    Api::<k8s_openapi::api::core::v1::Node>::all(w.client.clone())
        .patch(
            &forged,
            &kube::api::PatchParams::default(),
            &kube::api::Patch::Merge(json!({ "metadata": { "annotations": { DEFERRED_ANNOTATION: raw } } })),
        )
        .await
        .expect("annotated");
    eventually("the forged record dropped", Duration::from_secs(30), async || {
        let n = get_node(&w.client, &forged).await;
        n.metadata.annotations.as_ref().is_none_or(|a| !a.contains_key(DEFERRED_ANNOTATION)).then_some(())
    })
    .await;
    assert!(!cordoned(&get_node(&w.client, &victim).await), "a record on one node never acts on another");

    // The plan is on the node, not in the process: a restart keeps it.
    r.terminate(Duration::from_secs(20)).await.unwrap_or_else(|e| panic!("{e}"));
    let mut r = w.start("rem-b", &[("GPUMEDIC_MAINTENANCE_CHECK", "1s".into())]);
    r.wait_ready(Duration::from_secs(90)).await.unwrap_or_else(|e| panic!("{e}"));
    let done = w.outcome(v.verdict_id, |o| o.status == ActionStatus::Applied).await;
    assert!(chrono::Utc::now() >= not_before, "not before not_before");
    assert!(done.detail.contains("drain"), "{}", done.detail);
    let node = get_node(&w.client, &scheduled).await;
    assert!(cordoned(&node));
    plan_removed(&w.client, &scheduled).await;
    r.terminate(Duration::from_secs(20)).await.unwrap_or_else(|e| panic!("{e}"));
    cleanup(&w.client, &[&scheduled, &due, &forged, &victim], &[&w.ns]).await;
}

#[tokio::test]
async fn a_deferrable_reset_waits_until_no_workload_uses_the_gpu_and_a_cancelled_notice_drops_its_plan() {
    let w = World::new().await;
    let busy = w.node().await;
    let cancelled = w.node().await;
    let uses = |uuid: &str| json!({ "annotations": { "gpumedic.io/gpu-uuids": uuid } });
    pod(&w.client, &w.ns, "on-the-gpu", &busy, uses("GPU-aaa")).await;
    pod(&w.client, &w.ns, "on-another-gpu", &busy, uses("GPU-bbb")).await;
    let mut r =
        w.start("rem-a", &[("GPUMEDIC_MAINTENANCE_CHECK", "1s".into()), ("GPUMEDIC_PARTIAL_DRAIN", "true".into())]);
    r.wait_ready(Duration::from_secs(90)).await.unwrap_or_else(|e| panic!("{e}"));

    // A contained ECC error: reset the GPU when convenient.
    let mut v = testkit::verdict(&busy).action(RecommendedAction::ResetGpu).severity(Severity::Warning).build();
    v.rule_id = "xid-94-contained-memory-error".into();
    v.deferrable = true;
    v.entity.gpu_uuid = Some("GPU-aaa".into());
    v.entity.gpu_index = Some(0);
    w.publish(&v).await;
    let held = w.outcome(v.verdict_id, |_| true).await;
    assert_eq!(held.status, ActionStatus::SkippedByMode, "{}", held.detail);
    assert!(held.detail.contains("no workload"), "{}", held.detail);
    // Still held a few looks later: the job on that GPU is running.
    tokio::time::sleep(Duration::from_secs(4)).await;
    let node = get_node(&w.client, &busy).await;
    assert!(!cordoned(&node), "nothing disruptive while the job runs");
    assert!(node.metadata.annotations.as_ref().is_some_and(|a| a.contains_key(DEFERRED_ANNOTATION)));

    // The job on the faulty GPU ends (the one on another GPU does not matter): the reset goes.
    Api::<k8s_openapi::api::core::v1::Pod>::namespaced(w.client.clone(), &w.ns)
        .delete("on-the-gpu", &DeleteParams { grace_period_seconds: Some(0), ..DeleteParams::default() })
        .await
        .expect("pod deleted");
    let done = w.outcome(v.verdict_id, |o| o.status == ActionStatus::Applied).await;
    assert!(done.detail.contains("drain"), "{}", done.detail);
    assert!(cordoned(&get_node(&w.client, &busy).await));
    // Partial drain by the verdict's GPU: the job on the other GPU keeps running.
    assert_eq!(pods_left(&w.client, &w.ns).await, vec!["on-another-gpu".to_owned()]);

    // A notice that the provider then cancels: the recovery removes the plan before its time.
    let mut notice = testkit::verdict(&cancelled).action(RecommendedAction::Drain).severity(Severity::Warning).build();
    notice.rule_id = "cloud-maintenance".into();
    notice.not_before = Some(chrono::Utc::now() + chrono::Duration::hours(47));
    w.publish(&notice).await;
    w.outcome(notice.verdict_id, |o| o.status == ActionStatus::SkippedByMode).await;
    let mut over =
        testkit::verdict(&cancelled).incident(notice.incident_id).severity(Severity::Info).recovery(true).build();
    over.rule_id = "cloud-maintenance".into();
    w.publish(&over).await;
    w.outcome(over.verdict_id, |_| true).await;
    let node = get_node(&w.client, &cancelled).await;
    assert!(node.metadata.annotations.as_ref().is_none_or(|a| !a.contains_key(DEFERRED_ANNOTATION)), "plan dropped");
    assert!(!cordoned(&node));
    r.terminate(Duration::from_secs(20)).await.unwrap_or_else(|e| panic!("{e}"));
    cleanup(&w.client, &[&busy, &cancelled], &[&w.ns]).await;
}
