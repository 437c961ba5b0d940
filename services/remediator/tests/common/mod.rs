//! Fixtures for the remediator's tests against the testbed's kube-apiserver: small builders for
//! Nodes, namespaces and Pods with unique names, so tests run in parallel, and readers for what a
//! test checks (Events, conditions, taints).

#![allow(dead_code)] // Each test binary uses a different part of the fixtures.

use std::collections::BTreeMap;
use std::time::Duration;

use gpumedic_remediator::apply::{Remediator, Settings};
use gpumedic_remediator::drain::{DrainMode, DrainPolicy};
use gpumedic_remediator::request::{Action, GpuRef, Remediation, Subsystem};
use gpumedic_remediator::safety::{BreakerLimits, Gate};
use gpumedic_testkit::{self as testkit, NodeBuilder};
use k8s_openapi::api::core::v1::{Event, Namespace, Node, Pod};
use kube::api::{Api, DeleteParams, ListParams, Patch, PatchParams, PostParams};
use serde_json::{Value, json};

/// The admin client, or a panic that says how to start the testbed.
pub async fn admin() -> kube::Client {
    testkit::require_kubernetes().await.unwrap_or_else(|e| panic!("{e}"))
}

/// A Node with a unique name, as `build` makes it from a builder of that name.
pub async fn node(client: &kube::Client, build: impl FnOnce(NodeBuilder) -> NodeBuilder) -> String {
    let name = testkit::unique_name("rem-node");
    build(NodeBuilder::new(&name)).create(client).await;
    name
}

/// A plain GPU node.
pub async fn gpu_node(client: &kube::Client) -> String {
    node(client, |n| n.label("nvidia.com/gpu.present", "true")).await
}

/// Sets a condition the way another controller would, through the status subresource.
pub async fn set_condition(client: &kube::Client, node: &str, type_: &str, status: &str, reason: &str) {
    let nodes: Api<Node> = Api::all(client.clone());
    let c = json!({ "type": type_, "status": status, "reason": reason, "message": "set by someone else",
                    "lastTransitionTime": "2026-01-01T00:00:00Z" });
    nodes
        .patch_status(node, &PatchParams::default(), &Patch::Strategic(json!({ "status": { "conditions": [c] } })))
        .await
        .expect("condition set");
}

/// A namespace with a unique name.
pub async fn namespace(client: &kube::Client) -> String {
    let name = testkit::unique_name("rem-ns");
    let namespaces: Api<Namespace> = Api::all(client.clone());
    namespaces
        .create(&PostParams::default(), &serde_json::from_value(json!({ "metadata": { "name": name } })).unwrap())
        .await
        .expect("namespace created");
    name
}

/// A Pod bound to `node` (there is no scheduler), with `metadata` merged in (labels, annotations,
/// ownerReferences).
pub async fn pod(client: &kube::Client, ns: &str, name: &str, node: &str, metadata: Value) -> Pod {
    let mut meta = json!({ "name": name });
    if let (Some(m), Some(extra)) = (meta.as_object_mut(), metadata.as_object()) {
        m.extend(extra.clone());
    }
    let pods: Api<Pod> = Api::namespaced(client.clone(), ns);
    let pod: Pod = serde_json::from_value(json!({
        "metadata": meta,
        "spec": { "nodeName": node, "containers": [{ "name": "main", "image": "busybox" }] }
    }))
    .expect("pod fixture");
    pods.create(&PostParams::default(), &pod).await.expect("pod created")
}

/// Marks a pod Running and Ready, as a kubelet would; PodDisruptionBudgets only protect such pods
/// (the Eviction API lets Pending pods go regardless).
pub async fn mark_running(client: &kube::Client, ns: &str, name: &str) {
    let pods: Api<Pod> = Api::namespaced(client.clone(), ns);
    let status = json!({ "status": { "phase": "Running", "conditions": [
        { "type": "Ready", "status": "True", "lastTransitionTime": "2026-01-01T00:00:00Z" }] } });
    pods.patch_status(name, &PatchParams::default(), &Patch::Merge(status)).await.expect("pod marked running");
}

/// The names of the pods left in `ns`.
pub async fn pods_left(client: &kube::Client, ns: &str) -> Vec<String> {
    let pods: Api<Pod> = Api::namespaced(client.clone(), ns);
    let mut names: Vec<String> = pods
        .list(&ListParams::default())
        .await
        .expect("pods listed")
        .items
        .into_iter()
        .filter_map(|p| p.metadata.name)
        .collect();
    names.sort();
    names
}

/// The node as it is now.
pub async fn get_node(client: &kube::Client, name: &str) -> Node {
    Api::<Node>::all(client.clone()).get(name).await.expect("node read")
}

/// (type, status, reason) of every condition on the node.
pub fn conditions(node: &Node) -> Vec<(String, String, Option<String>)> {
    node.status
        .as_ref()
        .and_then(|s| s.conditions.clone())
        .unwrap_or_default()
        .into_iter()
        .map(|c| (c.type_, c.status, c.reason))
        .collect()
}

/// (key, value, effect) of every taint on the node.
pub fn taints(node: &Node) -> Vec<(String, Option<String>, String)> {
    node.spec
        .as_ref()
        .and_then(|s| s.taints.clone())
        .unwrap_or_default()
        .into_iter()
        .map(|t| (t.key, t.value, t.effect))
        .collect()
}

/// The taints under gpumedic's key. Nodes get `node.kubernetes.io/not-ready` from the
/// TaintNodesByCondition admission plugin at creation, and no controller lifts it here.
pub fn gpumedic_taints(node: &Node) -> Vec<(String, Option<String>, String)> {
    taints(node).into_iter().filter(|(k, _, _)| k.starts_with("gpumedic.io/")).collect()
}

/// Whether the node is cordoned.
pub fn cordoned(node: &Node) -> bool {
    node.spec.as_ref().and_then(|s| s.unschedulable).unwrap_or(false)
}

/// The node's labels.
pub fn labels(node: &Node) -> BTreeMap<String, String> {
    node.metadata.labels.clone().unwrap_or_default()
}

/// The reasons of the Events recorded about the node, oldest first, found the way
/// `kubectl describe node` finds them (kind, name and uid of the involved object).
pub async fn event_reasons(client: &kube::Client, node: &str) -> Vec<String> {
    // The remediator writes Events in the background: read until two looks a quarter second
    // apart agree (at most 5 s), so a test sees every Event its remediation caused.
    let mut last = read_event_reasons(client, node).await;
    for _ in 0..20 {
        tokio::time::sleep(std::time::Duration::from_millis(250)).await;
        let now = read_event_reasons(client, node).await;
        if now == last && !now.is_empty() {
            break;
        }
        last = now;
    }
    last
}

async fn read_event_reasons(client: &kube::Client, node: &str) -> Vec<String> {
    let uid = get_node(client, node).await.metadata.uid.expect("node uid");
    let events: Api<Event> = Api::all(client.clone());
    let lp = ListParams::default()
        .fields(&format!("involvedObject.kind=Node,involvedObject.name={node},involvedObject.uid={uid}"));
    let mut list = events.list(&lp).await.expect("events listed").items;
    list.sort_by(|a, b| a.metadata.creation_timestamp.cmp(&b.metadata.creation_timestamp));
    list.into_iter().filter_map(|e| e.reason).collect()
}

/// A request for `node` with the given action, incident `i1`.
pub fn request(node: &str, action: Action) -> Remediation {
    Remediation {
        node: node.to_owned(),
        gpu: Some(GpuRef { uuid: "GPU-aaa".into(), pci_bus_id: "0000:3b:00.0".into(), index: Some(0) }),
        action,
        subsystem: Subsystem::Gpu,
        reason: "Xid79".into(),
        message: "GPU has fallen off the bus".into(),
        verdict_id: testkit::unique_name("verdict"),
        incident_id: "i1".into(),
        recovery: false,
        reissue: false,
        custom: None,
    }
}

/// The recovery of `request`'s incident.
pub fn recovery(of: &Remediation) -> Remediation {
    Remediation {
        action: Action::None,
        recovery: true,
        reason: "Healthy".into(),
        message: "quiet for 10 min".into(),
        ..of.clone()
    }
}

/// Fast drain settings for tests: immediate eviction with grace 0 (no kubelet runs here to
/// finish a graceful termination, so a pod deleted with a grace period would stay terminating),
/// and short deadlines.
pub fn fast_drain(deadline: Duration) -> DrainPolicy {
    DrainPolicy {
        mode: DrainMode::Immediate { grace_seconds: Some(0) },
        deadline,
        initial_backoff: Duration::from_millis(100),
        max_backoff: Duration::from_millis(500),
        poll: Duration::from_millis(100),
        ..DrainPolicy::default()
    }
}

/// The admin credentials of the testbed as a client configuration (call [`admin`] first, so an
/// unreachable testbed fails with the hint to start it).
pub async fn admin_config() -> kube::Config {
    let kubeconfig = kube::config::Kubeconfig::read_from(testkit::kubeconfig_path()).expect("kubeconfig");
    kube::Config::from_custom_kubeconfig(kubeconfig, &Default::default()).await.expect("kubeconfig usable")
}

/// A remediator with the admin credentials, generous safety limits and `settings`.
pub async fn remediator(settings: Settings) -> Remediator {
    remediator_with(settings, roomy_gate()).await
}

/// A remediator with the admin credentials, `settings` and `gate`.
pub async fn remediator_with(settings: Settings, gate: Gate) -> Remediator {
    Remediator::new(admin_config().await, settings, gate).expect("remediator")
}

/// A gate that does not get in the way.
pub fn roomy_gate() -> Gate {
    Gate::new(BreakerLimits { max_share: 1.0, max_count: 10_000, window: Duration::from_secs(600) }, 10_000)
}

/// Settings with fast drains.
pub fn settings() -> Settings {
    Settings { drain: fast_drain(Duration::from_secs(10)), ..Settings::default() }
}

/// Deletes what a test made; failures do not matter (names are unique).
pub async fn cleanup(client: &kube::Client, nodes: &[&str], namespaces: &[&str]) {
    let n: Api<Node> = Api::all(client.clone());
    for name in nodes {
        let _ = n.delete(name, &DeleteParams::default()).await;
    }
    let ns: Api<Namespace> = Api::all(client.clone());
    for name in namespaces {
        let _ = ns.delete(name, &DeleteParams::default()).await;
    }
}

/// Publishes `verdict` on `topic`, keyed by its node, as the classifier would.
pub async fn publish_verdict(bootstrap: &str, topic: &str, verdict: &gpumedic_schemas::Verdict) {
    let producer = gpumedic_runtime::kafka::KafkaSettings {
        bootstrap: bootstrap.to_owned(),
        options: vec![],
        schema_registry: None,
        topic_replication: None,
    }
    .producer("remediator-test")
    .expect("producer");
    let bytes = gpumedic_schemas::encode(verdict).expect("the verdict encodes");
    gpumedic_runtime::kafka::publish(&producer, topic, &verdict.node, &bytes, &[]).await.expect("verdict published");
}

/// Waits (up to 2 minutes) for an outcome of verdict `id` on `actions` that `want` accepts.
pub async fn wait_for_outcome(
    actions: &str,
    id: uuid::Uuid,
    want: impl Fn(&gpumedic_schemas::ActionOutcome) -> bool,
) -> gpumedic_schemas::ActionOutcome {
    let record = testkit::wait_for_record(
        actions,
        |r| {
            gpumedic_schemas::decode::<gpumedic_schemas::ActionOutcome>(r.payload.as_deref().unwrap_or_default())
                .is_ok_and(|o| o.verdict_id == id && want(&o))
        },
        Duration::from_secs(120),
    )
    .await
    .unwrap_or_else(|e| panic!("no matching outcome for verdict {id}: {e}"));
    gpumedic_schemas::decode(record.payload.as_deref().unwrap()).unwrap()
}

/// Whether `process` exports the metric line `line` exactly.
pub async fn metric(process: &testkit::ServiceProcess, line: &str) -> bool {
    testkit::http_get(process.admin_addr(), "/metrics").await.is_ok_and(|(_, body)| body.lines().any(|l| l == line))
}

/// One test's remediators on the testbed: a namespace (their Lease and status object), a fleet
/// label their node selector picks, verdict and actions topics and a consumer group, all unique.
/// A test file's own world derefs to it.
pub struct Fleet {
    pub client: kube::Client,
    pub ns: String,
    pub fleet: String,
    pub verdicts: String,
    pub actions: String,
    pub group: String,
    pub bootstrap: String,
}

impl Fleet {
    /// A fresh fleet, or a panic that says how to start the testbed.
    pub async fn new() -> Self {
        let bootstrap = testkit::require_kafka().await.unwrap_or_else(|e| panic!("{e}"));
        let client = admin().await;
        let ns = namespace(&client).await;
        Self {
            client,
            ns,
            fleet: testkit::unique_name("fleet"),
            verdicts: testkit::unique_name("verdicts"),
            actions: testkit::unique_name("actions"),
            group: testkit::unique_name("remediator"),
            bootstrap,
        }
    }

    /// A Node of the fleet.
    pub async fn node(&self) -> String {
        node(&self.client, |n| n.label("gpumedic-test/fleet", &self.fleet)).await
    }

    /// The settings of a remediator of the fleet named `identity` in `mode`: short lease timings,
    /// no breaker in the way, immediate evictions; then `extra`, each replacing a setting of the
    /// same name.
    pub fn env<'a>(&self, identity: &str, mode: &str, extra: &[(&'a str, String)]) -> Vec<(&'a str, String)> {
        let mut env = vec![
            ("GPUMEDIC_KAFKA_BOOTSTRAP", self.bootstrap.clone()),
            ("GPUMEDIC_GROUP", self.group.clone()),
            ("GPUMEDIC_VERDICTS_TOPIC", self.verdicts.clone()),
            ("GPUMEDIC_ACTIONS_TOPIC", self.actions.clone()),
            ("KUBECONFIG", testkit::kubeconfig_path().display().to_string()),
            ("GPUMEDIC_LEASE_NAMESPACE", self.ns.clone()),
            ("GPUMEDIC_IDENTITY", identity.to_owned()),
            ("GPUMEDIC_LEASE_DURATION", "4s".into()),
            ("GPUMEDIC_LEASE_RENEW", "1s".into()),
            ("GPUMEDIC_MODE", mode.to_owned()),
            ("GPUMEDIC_GPU_NODE_SELECTOR", format!("gpumedic-test/fleet={}", self.fleet)),
            ("GPUMEDIC_BREAKER_MAX_SHARE", "1.0".into()),
            ("GPUMEDIC_DRAIN_GRACE_SECONDS", "0".into()),
            ("GPUMEDIC_SHUTDOWN_DEADLINE", "10s".into()),
        ];
        for (k, v) in extra {
            env.retain(|(key, _)| key != k);
            env.push((k, v.clone()));
        }
        env
    }

    /// Publishes `verdict` on the fleet's verdict topic.
    pub async fn publish(&self, verdict: &gpumedic_schemas::Verdict) {
        publish_verdict(&self.bootstrap, &self.verdicts, verdict).await;
    }

    /// Waits for the outcome of verdict `id` that `want` accepts.
    pub async fn outcome(
        &self,
        id: uuid::Uuid,
        want: impl Fn(&gpumedic_schemas::ActionOutcome) -> bool,
    ) -> gpumedic_schemas::ActionOutcome {
        wait_for_outcome(&self.actions, id, want).await
    }
}
