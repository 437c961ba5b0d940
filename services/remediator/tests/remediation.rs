//! The remediator against the testbed's real kube-apiserver: quarantine and recovery with
//! ownership, manual and foreign cordons, idempotence, drains (DaemonSet and mirror pods skipped,
//! PodDisruptionBudgets retried until the deadline, allow-completion, delete-after-timeout,
//! partial drain) and the circuit breaker. Every test makes its own nodes and namespaces.

mod common;

use std::time::Duration;

use common::*;
use gpumedic_remediator::NodeCache;
use gpumedic_remediator::apply::{Outcome, Settings, count_nodes};
use gpumedic_remediator::drain::{DrainMode, SkipReason};
use gpumedic_remediator::plan::{APPLIED_ANNOTATION, Applied, Policy, Skip, TAINT_KEY};
use gpumedic_remediator::request::Action;
use gpumedic_remediator::safety::{BreakerLimits, Gate};
use k8s_openapi::api::core::v1::{Node, Pod};
use k8s_openapi::api::policy::v1::PodDisruptionBudget;
use kube::api::{Api, DeleteParams, Patch, PatchParams, PostParams};
use serde_json::json;

fn applied(node: &Node) -> Option<Applied> {
    node.metadata
        .annotations
        .as_ref()
        .and_then(|a| a.get(APPLIED_ANNOTATION))
        .map(|raw| serde_json::from_str(raw).expect("the record parses"))
}

fn drain_report(outcome: Outcome) -> gpumedic_remediator::drain::DrainReport {
    match outcome {
        Outcome::Applied { drain: Some(report), .. } => report,
        other => panic!("expected a drain, got {other:?}"),
    }
}

#[tokio::test]
async fn quarantine_sets_condition_taint_label_cordon_and_events() {
    let client = admin().await;
    let name = gpu_node(&client).await;
    set_condition(&client, &name, "KernelDeadlock", "True", "Hung").await;
    let r = remediator(settings()).await;

    let outcome = r.remediate(&request(&name, Action::Cordon), 10).await.expect("remediation applied");
    assert!(matches!(outcome, Outcome::Applied { drain: None, .. }), "{outcome:?}");

    let node = get_node(&client, &name).await;
    let conds = conditions(&node);
    assert!(conds.contains(&("GpuUnhealthy".into(), "True".into(), Some("Xid79".into()))), "{conds:?}");
    assert!(
        conds.contains(&("KernelDeadlock".into(), "True".into(), Some("Hung".into()))),
        "someone else's condition survives: {conds:?}"
    );
    assert_eq!(gpumedic_taints(&node), vec![(TAINT_KEY.to_owned(), Some("gpu".to_owned()), "NoSchedule".to_owned())]);
    assert_eq!(labels(&node).get("gpumedic.io/state").map(String::as_str), Some("quarantined"));
    assert!(cordoned(&node));
    let record = applied(&node).expect("ownership recorded");
    assert!(record.cordoned);
    assert_eq!(record.incident_id, "i1");
    // Events are written in the background; `event_reasons` waits for them to settle.
    let events = event_reasons(&client, &name).await;
    for reason in ["ConditionSet", "Tainted", "Cordoned"] {
        assert!(events.iter().any(|e| e == reason), "{reason} missing from {events:?}");
    }
    cleanup(&client, &[&name], &[]).await;
}

/// The cordon and taint keep work off the node, so they are written first; the condition that
/// explains them follows. A watch sees every version of the node in order.
#[tokio::test]
async fn the_cordon_is_on_the_node_before_the_condition_that_explains_it() {
    use futures::{StreamExt as _, TryStreamExt as _};
    use kube::api::{WatchEvent, WatchParams};

    let client = admin().await;
    let name = gpu_node(&client).await;
    let nodes: Api<Node> = Api::all(client.clone());
    let from = get_node(&client, &name).await.metadata.resource_version.expect("a resourceVersion");
    let params = WatchParams::default().fields(&format!("metadata.name={name}")).timeout(30);
    let mut versions = nodes.watch(&params, &from).await.expect("watch the node").boxed();
    let r = remediator(settings()).await;

    let outcome = r.remediate(&request(&name, Action::Cordon), 10).await.expect("remediation applied");
    assert!(matches!(outcome, Outcome::Applied { drain: None, .. }), "{outcome:?}");

    let mut seen = Vec::new();
    while let Some(event) = tokio::time::timeout(Duration::from_secs(10), versions.try_next())
        .await
        .expect("the node's versions arrive")
        .expect("the watch goes on")
    {
        let WatchEvent::Modified(node) = event else { continue };
        let explained = conditions(&node).iter().any(|(t, s, _)| t == "GpuUnhealthy" && s == "True");
        seen.push((cordoned(&node), !gpumedic_taints(&node).is_empty(), explained));
        if explained {
            break;
        }
    }
    assert_eq!(seen, vec![(true, true, false), (true, true, true)], "(cordoned, tainted, condition) per version");
}

/// A verdict's first read of its node is the fleet watch's copy, with no apiserver round trip.
/// That copy may be behind the node: the write planned from it is refused (409) and re-planned
/// from a fresh read, so a taint someone added meanwhile survives. The patch's answer then
/// replaces the copy, so the next verdict for the node plans from what is there.
#[tokio::test]
async fn a_verdict_plans_from_the_fleet_watchs_copy_and_a_stale_copy_never_overwrites_the_node() {
    let client = admin().await;
    let nodes: Api<Node> = Api::all(client.clone());
    let (current, behind) = (gpu_node(&client).await, gpu_node(&client).await);
    let stale = get_node(&client, &behind).await;
    let maintenance = json!({ "spec": { "taints": [{ "key": "example.com/maintenance", "effect": "NoSchedule" }] } });
    nodes.patch(&behind, &PatchParams::default(), &Patch::Merge(&maintenance)).await.expect("someone taints the node");
    let cache = NodeCache::listed([get_node(&client, &current).await, stale]);
    let r = remediator(settings()).await.with_node_cache(cache.clone());

    for name in [&current, &behind] {
        let outcome = r.remediate(&request(name, Action::Cordon), 10).await.expect("remediation applied");
        assert!(matches!(outcome, Outcome::Applied { drain: None, .. }), "{name}: {outcome:?}");
        let node = get_node(&client, name).await;
        assert!(cordoned(&node), "{name} is cordoned");
        assert_eq!(gpumedic_taints(&node).len(), 1, "{name}: {:?}", taints(&node));
        let cached = cache.get(name).expect("the cache holds the node");
        assert_eq!(cached.metadata.resource_version, node.metadata.resource_version, "the patch's answer is taken");
    }
    assert_eq!(cache.misses(), 0, "both first reads came from the cache");
    let keys: Vec<String> = taints(&get_node(&client, &behind).await).into_iter().map(|(k, _, _)| k).collect();
    assert!(keys.iter().any(|k| k == "example.com/maintenance"), "the other taint survives: {keys:?}");
    cleanup(&client, &[&current, &behind], &[]).await;
}

#[tokio::test]
async fn recovery_removes_only_what_gpumedic_applied() {
    let client = admin().await;
    let name = node(&client, |n| {
        n.label("nvidia.com/gpu.present", "true").label("team", "ml").taint(
            "example.com/maintenance",
            Some("soon"),
            "PreferNoSchedule",
        )
    })
    .await;
    set_condition(&client, &name, "KernelDeadlock", "True", "Hung").await;
    let before = get_node(&client, &name).await;
    let r = remediator(settings()).await;
    let req = request(&name, Action::Drain);
    let report = drain_report(r.remediate(&req, 10).await.expect("quarantine"));
    assert!(report.complete(), "{report:?}");
    assert_eq!(labels(&get_node(&client, &name).await)["gpumedic.io/state"], "drained");

    let outcome = r.remediate(&recovery(&req), 10).await.expect("recovery");
    assert!(matches!(outcome, Outcome::Applied { .. }), "{outcome:?}");
    let after = get_node(&client, &name).await;
    assert_eq!(labels(&after), labels(&before), "only gpumedic's labels are gone");
    assert_eq!(taints(&after), taints(&before), "only gpumedic's taint is gone");
    assert!(!cordoned(&after), "gpumedic lifts its own cordon");
    assert!(applied(&after).is_none(), "the ownership record is gone");
    let conds = conditions(&after);
    assert!(conds.contains(&("KernelDeadlock".into(), "True".into(), Some("Hung".into()))), "{conds:?}");
    assert!(conds.contains(&("GpuUnhealthy".into(), "False".into(), Some("GpumedicRecovered".into()))), "{conds:?}");
    assert!(event_reasons(&client, &name).await.iter().any(|e| e == "Recovered"));
    // Nothing is left to undo.
    let again = r.remediate(&recovery(&req), 10).await.expect("second recovery");
    assert_eq!(again, Outcome::Skipped { reason: Skip::NothingApplied, would: None });
    cleanup(&client, &[&name], &[]).await;
}

#[tokio::test]
async fn a_node_leaves_quarantine_only_when_its_quarantining_incident_recovers() {
    let client = admin().await;
    let name = gpu_node(&client).await;
    let r = remediator(settings()).await;
    let critical = request(&name, Action::Cordon);
    let minor = gpumedic_remediator::request::Remediation {
        incident_id: "i2".into(),
        action: Action::Monitor,
        subsystem: gpumedic_remediator::request::Subsystem::Memory,
        reason: "EccContained".into(),
        message: "a contained ECC error".into(),
        ..request(&name, Action::Monitor)
    };
    r.remediate(&critical, 10).await.expect("critical incident");
    r.remediate(&minor, 10).await.expect("minor incident");

    // The minor incident recovers first: the node stays out of scheduling.
    let outcome = r.remediate(&recovery(&minor), 10).await.expect("minor recovery");
    assert!(matches!(outcome, Outcome::Applied { .. }), "{outcome:?}");
    let node = get_node(&client, &name).await;
    assert!(cordoned(&node), "the critical incident still holds the cordon");
    assert_eq!(gpumedic_taints(&node).len(), 1, "the critical incident still holds the taint");
    assert_eq!(labels(&node).get("gpumedic.io/state").map(String::as_str), Some("quarantined"));
    let conds = conditions(&node);
    assert!(conds.contains(&("GpuUnhealthy".into(), "True".into(), Some("Xid79".into()))), "{conds:?}");
    assert!(
        conds.contains(&("GpuMemoryUnhealthy".into(), "False".into(), Some("GpumedicRecovered".into()))),
        "{conds:?}"
    );
    let record = applied(&node).expect("the critical incident's record stays");
    assert_eq!(record.incident_id, "i1", "the quarantining incident holds the node");
    assert_eq!(record.incidents.keys().map(String::as_str).collect::<Vec<_>>(), ["i1"]);

    // The critical incident recovers: the node returns to service.
    let outcome = r.remediate(&recovery(&critical), 10).await.expect("critical recovery");
    assert!(matches!(outcome, Outcome::Applied { .. }), "{outcome:?}");
    let node = get_node(&client, &name).await;
    assert!(!cordoned(&node), "gpumedic lifts its cordon once no incident quarantines");
    assert!(gpumedic_taints(&node).is_empty());
    assert!(!labels(&node).contains_key("gpumedic.io/state"));
    assert!(applied(&node).is_none(), "no open incident is left");
    let conds = conditions(&node);
    assert!(conds.contains(&("GpuUnhealthy".into(), "False".into(), Some("GpumedicRecovered".into()))), "{conds:?}");
    let events = event_reasons(&client, &name).await;
    assert_eq!(events.iter().filter(|e| *e == "Recovered").count(), 2, "{events:?}");
    cleanup(&client, &[&name], &[]).await;
}

#[tokio::test]
async fn a_cordon_set_by_someone_else_is_left_alone_on_recovery() {
    let client = admin().await;
    let name = node(&client, |n| n.unschedulable(true)).await;
    let r = remediator(settings()).await;
    let req = request(&name, Action::Cordon);
    r.remediate(&req, 10).await.expect("quarantine");
    let node = get_node(&client, &name).await;
    assert!(!applied(&node).unwrap().cordoned, "gpumedic does not claim a cordon it did not set");
    assert!(!event_reasons(&client, &name).await.iter().any(|e| e == "Cordoned"));
    r.remediate(&recovery(&req), 10).await.expect("recovery");
    let node = get_node(&client, &name).await;
    assert!(cordoned(&node), "someone else's cordon stays");
    assert!(gpumedic_taints(&node).is_empty(), "gpumedic's taint is gone");
    cleanup(&client, &[&name], &[]).await;
}

#[tokio::test]
async fn a_manual_uncordon_is_respected_until_new_evidence() {
    let client = admin().await;
    let name = gpu_node(&client).await;
    let r = remediator(settings()).await;
    let req = request(&name, Action::Cordon);
    r.remediate(&req, 10).await.expect("quarantine");
    // The operator's `kubectl uncordon`.
    Api::<Node>::all(client.clone()).uncordon(&name).await.expect("uncordon");

    let outcome = r.remediate(&request(&name, Action::Cordon), 10).await.expect("same incident again");
    assert!(matches!(outcome, Outcome::Applied { .. }), "{outcome:?}");
    let node = get_node(&client, &name).await;
    assert!(!cordoned(&node), "not cordoned again for the same incident");
    assert!(gpumedic_taints(&node).is_empty(), "gpumedic's taint went with its cordon");
    let record = applied(&node).unwrap();
    assert!(record.operator_uncordoned && !record.cordoned);
    assert!(event_reasons(&client, &name).await.iter().any(|e| e == "ManualUncordonRespected"));
    assert_eq!(r.remediate(&request(&name, Action::Cordon), 10).await.unwrap(), Outcome::AlreadyDone);

    // A new incident is new evidence.
    let newer =
        gpumedic_remediator::request::Remediation { incident_id: "i2".into(), ..request(&name, Action::Cordon) };
    r.remediate(&newer, 10).await.expect("new incident");
    assert!(cordoned(&get_node(&client, &name).await));
    cleanup(&client, &[&name], &[]).await;
}

#[tokio::test]
async fn the_same_request_twice_yields_one_action_even_concurrently() {
    let client = admin().await;
    let name = gpu_node(&client).await;
    let r = remediator(settings()).await;
    let req = request(&name, Action::Cordon);
    let (a, b) = tokio::join!(r.remediate(&req, 10), r.remediate(&req, 10));
    let outcomes = [a.expect("first"), b.expect("second")];
    let applied_count = outcomes.iter().filter(|o| matches!(o, Outcome::Applied { .. })).count();
    assert!(applied_count >= 1, "{outcomes:?}");
    assert_eq!(r.remediate(&req, 10).await.unwrap(), Outcome::AlreadyDone);
    let events = event_reasons(&client, &name).await;
    for reason in ["ConditionSet", "Tainted", "Cordoned"] {
        assert_eq!(events.iter().filter(|e| *e == reason).count(), 1, "{reason} once in {events:?}");
    }
    assert_eq!(gpumedic_taints(&get_node(&client, &name).await).len(), 1);
    cleanup(&client, &[&name], &[]).await;
}

#[tokio::test]
async fn drain_evicts_bound_pods_but_skips_daemonset_and_mirror_pods() {
    let client = admin().await;
    let name = gpu_node(&client).await;
    let ns = namespace(&client).await;
    for i in 0..3 {
        pod(&client, &ns, &format!("job-{i}"), &name, json!({})).await;
    }
    pod(
        &client,
        &ns,
        "dcgm-exporter",
        &name,
        json!({ "ownerReferences": [{ "apiVersion": "apps/v1", "kind": "DaemonSet", "name": "dcgm",
                                      "uid": "00000000-0000-0000-0000-000000000001", "controller": true }] }),
    )
    .await;
    pod(
        &client,
        &ns,
        "static-etcd",
        &name,
        json!({ "annotations": { "kubernetes.io/config.mirror": "abc", "kubernetes.io/config.source": "file" } }),
    )
    .await;

    let r = remediator(settings()).await;
    let report = drain_report(r.remediate(&request(&name, Action::Drain), 10).await.expect("drain"));
    assert_eq!(report.evicted.iter().map(|p| p.name.as_str()).collect::<Vec<_>>(), ["job-0", "job-1", "job-2"]);
    let skipped: Vec<_> = report.skipped.iter().map(|(p, why)| (p.name.as_str(), *why)).collect();
    assert_eq!(skipped, [("dcgm-exporter", SkipReason::DaemonSet), ("static-etcd", SkipReason::Mirror)]);
    assert!(report.complete());
    assert_eq!(pods_left(&client, &ns).await, ["dcgm-exporter", "static-etcd"]);
    let node = get_node(&client, &name).await;
    assert_eq!(labels(&node)["gpumedic.io/state"], "drained");
    let events = event_reasons(&client, &name).await;
    assert!(events.iter().any(|e| e == "DrainStarted") && events.iter().any(|e| e == "Drained"), "{events:?}");
    // Drained once: the same request again does nothing.
    assert_eq!(r.remediate(&request(&name, Action::Drain), 10).await.unwrap(), Outcome::AlreadyDone);
    cleanup(&client, &[&name], &[&ns]).await;
}

/// A PodDisruptionBudget as the disruption controller would leave it: no disruption allowed.
async fn blocking_pdb(client: &kube::Client, ns: &str, name: &str, app: &str, pods: i32) {
    let pdbs: Api<PodDisruptionBudget> = Api::namespaced(client.clone(), ns);
    let pdb: PodDisruptionBudget = serde_json::from_value(json!({
        "metadata": { "name": name },
        "spec": { "minAvailable": pods, "selector": { "matchLabels": { "app": app } } }
    }))
    .unwrap();
    let created = pdbs.create(&PostParams::default(), &pdb).await.expect("pdb created");
    // No controller-manager runs in the testbed, so write the status its disruption controller
    // would compute.
    let status = json!({ "status": {
        "observedGeneration": created.metadata.generation, "disruptionsAllowed": 0,
        "currentHealthy": pods, "desiredHealthy": pods, "expectedPods": pods } });
    pdbs.patch_status(name, &PatchParams::default(), &Patch::Merge(status)).await.expect("pdb status");
}

#[tokio::test]
async fn evictions_blocked_by_a_pdb_are_retried_and_reported_blocked_at_the_deadline() {
    let client = admin().await;
    let name = gpu_node(&client).await;
    let ns = namespace(&client).await;
    for (pod_name, app) in [("held-0", "held"), ("held-1", "held"), ("freed-0", "freed")] {
        pod(&client, &ns, pod_name, &name, json!({ "labels": { "app": app } })).await;
        mark_running(&client, &ns, pod_name).await;
    }
    blocking_pdb(&client, &ns, "held", "held", 2).await;
    blocking_pdb(&client, &ns, "freed", "freed", 1).await;
    // The "freed" budget is lifted while the drain retries: its pod must then leave.
    let lifter = {
        let client = client.clone();
        let ns = ns.clone();
        tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(1500)).await;
            Api::<PodDisruptionBudget>::namespaced(client, &ns)
                .delete("freed", &DeleteParams::default())
                .await
                .expect("pdb lifted");
        })
    };

    let r = remediator(Settings { drain: fast_drain(Duration::from_secs(4)), ..Settings::default() }).await;
    let started = std::time::Instant::now();
    let report = drain_report(r.remediate(&request(&name, Action::Drain), 10).await.expect("drain"));
    lifter.await.unwrap();
    let took = started.elapsed();
    assert!(
        took >= Duration::from_secs(4) && took < Duration::from_secs(8),
        "retried until the deadline, not past it: {took:?}"
    );
    assert_eq!(report.evicted.iter().map(|p| p.name.as_str()).collect::<Vec<_>>(), ["freed-0"]);
    let blocked: Vec<_> = report.blocked.iter().map(|(p, _)| p.name.as_str()).collect();
    assert_eq!(blocked, ["held-0", "held-1"]);
    assert!(report.blocked[0].1.contains("disruption budget"), "{:?}", report.blocked);
    assert!(!report.complete());
    assert_eq!(pods_left(&client, &ns).await, ["held-0", "held-1"]);
    let node = get_node(&client, &name).await;
    assert_eq!(labels(&node)["gpumedic.io/state"], "draining", "an incomplete drain is not called drained");
    assert!(event_reasons(&client, &name).await.iter().any(|e| e == "DrainIncomplete"));
    cleanup(&client, &[&name], &[&ns]).await;
}

#[tokio::test]
async fn delete_after_timeout_force_deletes_what_a_pdb_holds_past_the_deadline() {
    let client = admin().await;
    let name = gpu_node(&client).await;
    let ns = namespace(&client).await;
    pod(&client, &ns, "held-0", &name, json!({ "labels": { "app": "held" } })).await;
    mark_running(&client, &ns, "held-0").await;
    blocking_pdb(&client, &ns, "held", "held", 1).await;
    let mut drain = fast_drain(Duration::from_secs(2));
    drain.mode = DrainMode::DeleteAfterTimeout { grace_seconds: Some(0) };
    let r = remediator(Settings { drain, ..Settings::default() }).await;
    let report = drain_report(r.remediate(&request(&name, Action::Drain), 10).await.expect("drain"));
    assert_eq!(report.force_deleted.iter().map(|p| p.name.as_str()).collect::<Vec<_>>(), ["held-0"]);
    assert!(report.complete(), "{report:?}");
    assert!(pods_left(&client, &ns).await.is_empty());
    cleanup(&client, &[&name], &[&ns]).await;
}

#[tokio::test]
async fn drain_rules_per_namespace_and_priority_class_choose_how_each_pod_leaves() {
    let client = admin().await;
    let name = gpu_node(&client).await;
    let (kept, work) = (namespace(&client).await, namespace(&client).await);
    // A priority class of the test's own, as a cluster would have for its critical serving pods.
    let class = gpumedic_testkit::unique_name("critical");
    let classes: Api<k8s_openapi::api::scheduling::v1::PriorityClass> = Api::all(client.clone());
    classes
        .create(
            &PostParams::default(),
            &serde_json::from_value(json!({ "metadata": { "name": class }, "value": 1000 })).unwrap(),
        )
        .await
        .expect("priority class created");
    pod(&client, &kept, "left-alone", &name, json!({})).await;
    pod(&client, &work, "plain", &name, json!({})).await;
    let pods: Api<Pod> = Api::namespaced(client.clone(), &work);
    let held: Pod = serde_json::from_value(json!({
        "metadata": { "name": "serving", "labels": { "app": "serving" } },
        "spec": { "nodeName": name, "priorityClassName": class, "containers": [{ "name": "main", "image": "busybox" }] }
    }))
    .unwrap();
    pods.create(&PostParams::default(), &held).await.expect("pod created");
    mark_running(&client, &work, "serving").await;
    blocking_pdb(&client, &work, "serving", "serving", 1).await;

    let mut drain = fast_drain(Duration::from_secs(20));
    drain.rules = vec![
        format!("namespace={kept}:mode=skip").parse().expect("a rule"),
        format!("priorityClass={class}:mode=delete-after-timeout,grace=0,deadline=2s").parse().expect("a rule"),
    ];
    let r = remediator(Settings { drain, ..Settings::default() }).await;
    let started = std::time::Instant::now();
    let report = drain_report(r.remediate(&request(&name, Action::Drain), 10).await.expect("drain"));
    assert_eq!(report.evicted.iter().map(|p| p.name.as_str()).collect::<Vec<_>>(), ["plain"]);
    assert_eq!(report.force_deleted.iter().map(|p| p.name.as_str()).collect::<Vec<_>>(), ["serving"]);
    assert_eq!(
        report.skipped.iter().map(|(p, w)| (p.name.as_str(), *w)).collect::<Vec<_>>(),
        [("left-alone", SkipReason::Policy)]
    );
    assert!(report.complete(), "{report:?}");
    assert!(started.elapsed() < Duration::from_secs(20), "the PDB-held pod went at its own 2 s deadline");
    assert_eq!(pods_left(&client, &kept).await, ["left-alone"]);
    assert!(pods_left(&client, &work).await.is_empty());
    classes.delete(&class, &DeleteParams::default()).await.expect("priority class deleted");
    cleanup(&client, &[&name], &[&kept, &work]).await;
}

#[tokio::test]
async fn allow_completion_waits_for_pods_to_finish_without_evicting() {
    let client = admin().await;
    let name = gpu_node(&client).await;
    let ns = namespace(&client).await;
    pod(&client, &ns, "training", &name, json!({})).await;
    mark_running(&client, &ns, "training").await;
    let finisher = {
        let client = client.clone();
        let ns = ns.clone();
        tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(1000)).await;
            Api::<Pod>::namespaced(client, &ns)
                .patch_status(
                    "training",
                    &PatchParams::default(),
                    &Patch::Merge(json!({ "status": { "phase": "Succeeded" } })),
                )
                .await
                .expect("pod finished");
        })
    };
    let mut drain = fast_drain(Duration::from_secs(10));
    drain.mode = DrainMode::AllowCompletion;
    let r = remediator(Settings { drain, ..Settings::default() }).await;
    let report = drain_report(r.remediate(&request(&name, Action::Drain), 10).await.expect("drain"));
    finisher.await.unwrap();
    assert_eq!(report.completed.iter().map(|p| p.name.as_str()).collect::<Vec<_>>(), ["training"]);
    assert!(report.evicted.is_empty() && report.complete(), "{report:?}");
    assert_eq!(pods_left(&client, &ns).await, ["training"], "the finished pod was not evicted");
    cleanup(&client, &[&name], &[&ns]).await;
}

#[tokio::test]
async fn partial_drain_evicts_only_the_pods_on_the_faulty_gpu() {
    let client = admin().await;
    let name = gpu_node(&client).await;
    let ns = namespace(&client).await;
    pod(&client, &ns, "on-faulty", &name, json!({ "annotations": { "gpumedic.io/gpu-uuids": "GPU-aaa" } })).await;
    pod(&client, &ns, "on-healthy", &name, json!({ "annotations": { "gpumedic.io/gpu-uuids": "GPU-bbb" } })).await;
    let settings = Settings { policy: Policy { partial_drain: true, ..Policy::default() }, ..settings() };
    let r = remediator(settings).await;
    let report = drain_report(r.remediate(&request(&name, Action::Drain), 10).await.expect("drain"));
    assert_eq!(report.evicted.iter().map(|p| p.name.as_str()).collect::<Vec<_>>(), ["on-faulty"]);
    assert_eq!(
        report.skipped.iter().map(|(p, w)| (p.name.as_str(), *w)).collect::<Vec<_>>(),
        [("on-healthy", SkipReason::OtherGpu)]
    );
    assert_eq!(pods_left(&client, &ns).await, ["on-healthy"]);
    cleanup(&client, &[&name], &[&ns]).await;
}

#[tokio::test]
async fn the_breaker_trips_at_the_configured_share_lets_recoveries_through_and_holds_until_reset() {
    let client = admin().await;
    let fleet = gpumedic_testkit::unique_name("fleet");
    let mut names = Vec::new();
    for _ in 0..10 {
        names.push(node(&client, |n| n.label("gpumedic-test/fleet", &fleet)).await);
    }
    let gpu_nodes = count_nodes(&client, &format!("gpumedic-test/fleet={fleet}")).await.expect("nodes counted");
    assert_eq!(gpu_nodes, 10);
    let limits = BreakerLimits { max_share: 0.3, max_count: 100, window: Duration::from_secs(600) };
    let r = remediator_with(settings(), Gate::new(limits, 1000)).await;

    for name in &names[..3] {
        let outcome = r.remediate(&request(name, Action::Cordon), gpu_nodes).await.expect("quarantine");
        assert!(matches!(outcome, Outcome::Applied { .. }), "{outcome:?}");
    }
    let outcome = r.remediate(&request(&names[3], Action::Cordon), gpu_nodes).await.expect("refusal");
    assert!(
        matches!(&outcome, Outcome::Skipped { reason: Skip::BreakerOpen(why), .. } if why.contains("4 of 10")),
        "{outcome:?}"
    );
    let refused = get_node(&client, &names[3]).await;
    assert!(!cordoned(&refused) && gpumedic_taints(&refused).is_empty() && applied(&refused).is_none());
    assert!(event_reasons(&client, &names[3]).await.iter().any(|e| e == "CircuitBreakerOpen"));

    // Recoveries proceed while open; repeated requests for held nodes are not new quarantines.
    let outcome = r.remediate(&recovery(&request(&names[0], Action::Cordon)), gpu_nodes).await.expect("recovery");
    assert!(matches!(outcome, Outcome::Applied { .. }), "{outcome:?}");
    assert!(!cordoned(&get_node(&client, &names[0]).await));
    assert_eq!(r.remediate(&request(&names[1], Action::Cordon), gpu_nodes).await.unwrap(), Outcome::AlreadyDone);
    // Still open: other nodes are still refused.
    let outcome = r.remediate(&request(&names[4], Action::Cordon), gpu_nodes).await.unwrap();
    assert!(matches!(outcome, Outcome::Skipped { reason: Skip::BreakerOpen(_), .. }), "{outcome:?}");

    r.gate().lock().unwrap().breaker.reset();
    let outcome = r.remediate(&request(&names[3], Action::Cordon), gpu_nodes).await.expect("after reset");
    assert!(matches!(outcome, Outcome::Applied { .. }), "{outcome:?}");
    assert!(cordoned(&get_node(&client, &names[3]).await));
    let refs: Vec<&str> = names.iter().map(String::as_str).collect();
    cleanup(&client, &refs, &[]).await;
}
