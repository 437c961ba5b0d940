//! The enricher's view of the cluster: Nodes and GPU Pods, kept current by watch streams, never
//! one API call per event.
//!
//! Two watchers (Nodes; Pods that request `nvidia.com/gpu`) feed one index: node name to its
//! context and its GPU workloads. Readiness waits until both have listed everything once; a watch
//! that fails starts over with a complete list after a backoff, and readiness waits for that list.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, RwLock};
use std::time::Duration;

use futures::StreamExt as _;
use gpumedic_runtime::admin::ReadyFlag;
use gpumedic_schemas::enriched::Workload;
use k8s_openapi::api::core::v1::{Node, Pod};
use kube::runtime::watcher;
use kube::{Api, Client, ResourceExt as _};
use tokio_util::sync::CancellationToken;

use crate::enrich::{NodeInfo, node_context};
use crate::events::{InternalEvent as _, WatchFailed};

/// The resource name of NVIDIA GPUs in pod requests.
pub const GPU_RESOURCE: &str = "nvidia.com/gpu";
/// Annotation a pod may carry to name the GPUs it was given (comma-separated UUIDs); without a
/// kubelet pod-resources query, this is how a pod is tied to one faulty GPU.
pub const GPU_UUIDS_ANNOTATION: &str = "gpumedic.io/gpu-uuids";

/// The index the enrich step reads.
#[derive(Debug, Clone, Default)]
pub struct ClusterCache {
    inner: Arc<RwLock<Index>>,
}

#[derive(Debug, Default)]
struct Index {
    /// Shared with the readers: a reader takes a reference, not a copy of the node's context and
    /// workloads (the enrich step reads a node per event); a writer copies on write.
    nodes: HashMap<String, Arc<NodeInfo>>,
    /// Pod (namespace/name) to the node it is bound to and its workload entry.
    pods: HashMap<String, (String, Workload)>,
    /// Node name to the keys of the pods bound to it, so a node's workloads are found without a
    /// scan of every pod: a node applied after its pods (every node of the initial list when the
    /// pods list first) costs its own pods, not the fleet's (a scan made the initial list of
    /// 10,000 nodes and pods 10^8 comparisons).
    pods_by_node: HashMap<String, Vec<String>>,
}

impl Index {
    /// Binds pod `key` to `node` in [`Index::pods_by_node`], unbinding it from `old` first.
    fn bind(&mut self, key: &str, old: Option<&str>, node: &str) {
        if old == Some(node) {
            return;
        }
        if let Some(old) = old {
            self.unbind(key, old);
        }
        let keys = self.pods_by_node.entry(node.to_owned()).or_default();
        if !keys.iter().any(|k| k == key) {
            keys.push(key.to_owned());
        }
    }

    /// Removes pod `key` from `node`'s keys.
    fn unbind(&mut self, key: &str, node: &str) {
        if let Some(keys) = self.pods_by_node.get_mut(node) {
            keys.retain(|k| k != key);
            if keys.is_empty() {
                self.pods_by_node.remove(node);
            }
        }
    }
}

/// How node labels become context.
#[derive(Debug, Clone, Default)]
pub struct ContextSettings {
    /// Labels copied verbatim into the context.
    pub selected_labels: Vec<String>,
    /// The cluster's name.
    pub cluster: Option<String>,
}

impl ClusterCache {
    /// What the cache knows about `node`, if anything.
    pub fn node(&self, node: &str) -> Option<Arc<NodeInfo>> {
        self.inner.read().expect("cache lock").nodes.get(node).cloned()
    }

    /// How many nodes the cache knows.
    pub fn node_count(&self) -> usize {
        self.inner.read().expect("cache lock").nodes.len()
    }

    /// Adds or replaces `node` (what the Node watcher does on every change; public so benches
    /// and tests fill the cache without a cluster).
    pub fn apply_node(&self, node: &Node, settings: &ContextSettings) {
        let labels: BTreeMap<String, String> = node.labels().clone();
        let mut context = node_context(&labels, &settings.selected_labels, settings.cluster.as_deref());
        context.expected_gpus = expected_gpus(node);
        let mut index = self.inner.write().expect("cache lock");
        let name = node.name_any();
        let workloads: Vec<Workload> = index
            .pods_by_node
            .get(&name)
            .into_iter()
            .flatten()
            .filter_map(|key| index.pods.get(key))
            .map(|(_, w)| w.clone())
            .collect();
        let nvlink_domain = labels.get(crate::enrich::labels::GPU_CLIQUE).filter(|v| !v.is_empty()).cloned();
        index.nodes.insert(name, Arc::new(NodeInfo { context, workloads, nvlink_domain }));
    }

    fn delete_node(&self, node: &Node) {
        self.inner.write().expect("cache lock").nodes.remove(&node.name_any());
    }

    /// Adds, moves or removes `pod`'s workload entry (what the Pod watcher does on every change).
    pub fn apply_pod(&self, pod: &Pod) {
        let key = pod_key(pod);
        let Some((node, workload)) = gpu_workload(pod) else {
            // No longer a bound, running GPU pod (finished, or never was one).
            self.remove_pod(&key);
            return;
        };
        let mut index = self.inner.write().expect("cache lock");
        let old = index.pods.insert(key.clone(), (node.clone(), workload.clone())).map(|(n, _)| n);
        index.bind(&key, old.as_deref(), &node);
        if let Some(old_node) = old
            && old_node != node
            && let Some(info) = index.nodes.get_mut(&old_node)
        {
            Arc::make_mut(info).workloads.retain(|w| !(w.namespace == workload.namespace && w.pod == workload.pod));
        }
        if let Some(info) = index.nodes.get_mut(&node) {
            let info = Arc::make_mut(info);
            info.workloads.retain(|w| !(w.namespace == workload.namespace && w.pod == workload.pod));
            info.workloads.push(workload);
        }
    }

    fn remove_pod(&self, key: &str) {
        let mut index = self.inner.write().expect("cache lock");
        let removed = index.pods.remove(key);
        if let Some((node, _)) = &removed {
            index.unbind(key, node);
        }
        if let Some((node, w)) = removed
            && let Some(info) = index.nodes.get_mut(&node)
        {
            Arc::make_mut(info).workloads.retain(|x| !(x.namespace == w.namespace && x.pod == w.pod));
        }
    }
}

/// How many GPUs `node` should have: its `nvidia.com/gpu` capacity, else its allocatable count;
/// `None` when it reports neither (or a value that is not a whole count).
///
/// Capacity comes first because the device plugin keeps a GPU that went unhealthy in capacity and
/// takes it out of allocatable: capacity is what the node was built with, which is what a missing
/// GPU is measured against.
pub fn expected_gpus(node: &Node) -> Option<i32> {
    let status = node.status.as_ref()?;
    let count = |resources: Option<&BTreeMap<String, k8s_openapi::apimachinery::pkg::api::resource::Quantity>>| {
        resources.and_then(|r| r.get(GPU_RESOURCE)).and_then(|q| q.0.trim().parse::<i32>().ok()).filter(|n| *n >= 0)
    };
    count(status.capacity.as_ref()).or_else(|| count(status.allocatable.as_ref()))
}

fn pod_key(pod: &Pod) -> String {
    format!("{}/{}", pod.namespace().unwrap_or_default(), pod.name_any())
}

/// The workload entry for a pod that is bound to a node, not finished, and requests GPUs.
pub fn gpu_workload(pod: &Pod) -> Option<(String, Workload)> {
    let spec = pod.spec.as_ref()?;
    let node = spec.node_name.clone()?;
    let phase = pod.status.as_ref().and_then(|s| s.phase.as_deref());
    if matches!(phase, Some("Succeeded" | "Failed")) {
        return None;
    }
    let wants_gpu = spec.containers.iter().chain(spec.init_containers.iter().flatten()).any(|c| {
        c.resources.as_ref().is_some_and(|r| {
            r.limits.as_ref().is_some_and(|l| l.contains_key(GPU_RESOURCE))
                || r.requests.as_ref().is_some_and(|l| l.contains_key(GPU_RESOURCE))
        })
    });
    if !wants_gpu {
        return None;
    }
    let owner = pod.owner_references().iter().find(|o| o.controller == Some(true));
    let gpu_uuids = pod
        .annotations()
        .get(GPU_UUIDS_ANNOTATION)
        .map(|v| v.split(',').map(|s| s.trim().to_owned()).filter(|s| !s.is_empty()).collect())
        .unwrap_or_default();
    Some((
        node,
        Workload {
            namespace: pod.namespace().unwrap_or_default(),
            pod: pod.name_any(),
            owner_kind: owner.map(|o| o.kind.clone()),
            owner_name: owner.map(|o| o.name.clone()),
            gpu_uuids,
        },
    ))
}

/// One watched kind as the cache indexes it: what an event does to the index, and how a complete
/// list replaces what the index held.
trait Indexed<K> {
    /// The kind in logs and metrics (`nodes`, `pods`).
    const RESOURCE: &'static str;
    /// The object's key in the index.
    fn key(object: &K) -> String;
    /// Adds or replaces `object`.
    fn apply(&self, object: &K);
    /// Removes `object`.
    fn delete(&self, object: &K);
    /// Removes every entry whose key is not in `listed` (what a complete list did not name was
    /// deleted while the watch was down).
    fn retain(&self, listed: &HashSet<String>);
}

struct NodeIndex {
    cache: ClusterCache,
    settings: ContextSettings,
}

impl Indexed<Node> for NodeIndex {
    const RESOURCE: &'static str = "nodes";
    fn key(node: &Node) -> String {
        node.name_any()
    }
    fn apply(&self, node: &Node) {
        self.cache.apply_node(node, &self.settings);
    }
    fn delete(&self, node: &Node) {
        self.cache.delete_node(node);
    }
    fn retain(&self, listed: &HashSet<String>) {
        self.cache.inner.write().expect("cache lock").nodes.retain(|name, _| listed.contains(name));
    }
}

struct PodIndex {
    cache: ClusterCache,
}

impl Indexed<Pod> for PodIndex {
    const RESOURCE: &'static str = "pods";
    fn key(pod: &Pod) -> String {
        pod_key(pod)
    }
    fn apply(&self, pod: &Pod) {
        self.cache.apply_pod(pod);
    }
    fn delete(&self, pod: &Pod) {
        self.cache.remove_pod(&pod_key(pod));
    }
    fn retain(&self, listed: &HashSet<String>) {
        let gone: Vec<String> = {
            let index = self.cache.inner.read().expect("cache lock");
            index.pods.keys().filter(|k| !listed.contains(*k)).cloned().collect()
        };
        for key in gone {
            self.cache.remove_pod(&key);
        }
    }
}

/// One list-then-watch of a kind, applied to the index: the keys a list in progress has named so
/// far, so that its end can drop what it did not name.
struct Listing<I> {
    index: I,
    listed: Option<HashSet<String>>,
}

impl<I> Listing<I> {
    fn new(index: I) -> Self {
        Self { index, listed: None }
    }

    /// Applies one event; true when it ends a complete list (the index is then whole).
    fn handle<K>(&mut self, event: watcher::Event<K>) -> bool
    where
        I: Indexed<K>,
    {
        match event {
            watcher::Event::Init => self.listed = Some(HashSet::new()),
            watcher::Event::InitApply(o) => {
                if let Some(listed) = self.listed.as_mut() {
                    listed.insert(I::key(&o));
                }
                self.index.apply(&o);
            }
            watcher::Event::InitDone => {
                if let Some(listed) = self.listed.take() {
                    self.index.retain(&listed);
                }
                return true;
            }
            watcher::Event::Apply(o) => self.index.apply(&o),
            watcher::Event::Delete(o) => self.index.delete(&o),
        }
        false
    }
}

/// Readiness of the cache: both kinds listed completely since their watch last failed.
struct Synced {
    nodes: AtomicBool,
    pods: AtomicBool,
    flag: ReadyFlag,
}

impl Synced {
    fn set(&self, resource: &str, synced: bool) {
        let part = if resource == NodeIndex::RESOURCE { &self.nodes } else { &self.pods };
        part.store(synced, Ordering::Release);
        self.flag.set(self.nodes.load(Ordering::Acquire) && self.pods.load(Ordering::Acquire));
    }
}

/// Keeps `cache` current until `token` is cancelled; `synced` turns ready once Nodes and Pods have
/// each been listed completely.
///
/// A watch that fails (the apiserver restarting or unreachable) is logged, counted in
/// `gpumedic_enricher_watch_failures_total`, and started again after a backoff (0.8 s doubling to
/// 30 s, with jitter) with a complete list, which also drops what was deleted meanwhile. Until
/// that list is complete `synced` is false; the cache keeps serving what it holds.
pub async fn run_watchers(
    client: Client,
    cache: ClusterCache,
    settings: ContextSettings,
    synced: ReadyFlag,
    token: CancellationToken,
) {
    let synced = Synced { nodes: AtomicBool::new(false), pods: AtomicBool::new(false), flag: synced };
    let nodes = keep_watching(
        Api::<Node>::all(client.clone()),
        Listing::new(NodeIndex { cache: cache.clone(), settings }),
        &synced,
        &token,
    );
    let pods = keep_watching(Api::<Pod>::all(client), Listing::new(PodIndex { cache }), &synced, &token);
    futures::future::join(nodes, pods).await;
}

/// Watches one kind into `listing` until `token` is cancelled, starting over after each failure.
async fn keep_watching<K, I>(api: Api<K>, mut listing: Listing<I>, synced: &Synced, token: &CancellationToken)
where
    K: kube::Resource + Clone + std::fmt::Debug + serde::de::DeserializeOwned + Send + 'static,
    I: Indexed<K>,
{
    let mut backoff = watcher::DefaultBackoff::default();
    loop {
        let mut stream = std::pin::pin!(watcher(api.clone(), watcher::Config::default()));
        let failure = loop {
            let next = tokio::select! {
                () = token.cancelled() => return,
                next = stream.next() => next,
            };
            match next {
                Some(Ok(event)) => {
                    if listing.handle(event) {
                        synced.set(I::RESOURCE, true);
                        tracing::info!(resource = I::RESOURCE, "The cluster cache listed {} completely.", I::RESOURCE);
                    }
                }
                Some(Err(e)) => break e.to_string(),
                None => break "the watch stream ended".to_owned(),
            }
        };
        synced.set(I::RESOURCE, false);
        let delay = backoff.next().unwrap_or(Duration::from_secs(30));
        WatchFailed { resource: I::RESOURCE, error: &failure, retry_in: delay }.emit();
        tokio::select! {
            () = token.cancelled() => return,
            () = tokio::time::sleep(delay) => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pod(json: serde_json::Value) -> Pod {
        serde_json::from_value(json).unwrap()
    }

    #[test]
    fn only_bound_unfinished_gpu_pods_are_workloads() {
        let gpu = pod(serde_json::json!({
            "metadata": { "name": "trainer-0", "namespace": "ml",
                "annotations": { "gpumedic.io/gpu-uuids": "GPU-aaa, GPU-bbb" },
                "ownerReferences": [{ "apiVersion": "batch/v1", "kind": "Job", "name": "trainer", "uid": "u", "controller": true }] },
            "spec": { "nodeName": "gpu-1", "containers": [{ "name": "c", "resources": { "limits": { "nvidia.com/gpu": "2" } } }] }
        }));
        let (node, w) = gpu_workload(&gpu).expect("a GPU workload");
        assert_eq!(node, "gpu-1");
        assert_eq!((w.owner_kind.as_deref(), w.owner_name.as_deref()), (Some("Job"), Some("trainer")));
        assert_eq!(w.gpu_uuids, ["GPU-aaa", "GPU-bbb"]);

        let cpu = pod(serde_json::json!({ "metadata": { "name": "web", "namespace": "a" },
            "spec": { "nodeName": "gpu-1", "containers": [{ "name": "c" }] } }));
        assert!(gpu_workload(&cpu).is_none());
        let unbound = pod(serde_json::json!({ "metadata": { "name": "p", "namespace": "a" },
            "spec": { "containers": [{ "name": "c", "resources": { "limits": { "nvidia.com/gpu": "1" } } }] } }));
        assert!(gpu_workload(&unbound).is_none());
        let done = pod(serde_json::json!({ "metadata": { "name": "p", "namespace": "a" },
            "spec": { "nodeName": "n", "containers": [{ "name": "c", "resources": { "requests": { "nvidia.com/gpu": "1" } } }] },
            "status": { "phase": "Succeeded" } }));
        assert!(gpu_workload(&done).is_none());
    }

    fn node(json: serde_json::Value) -> Node {
        serde_json::from_value(json).unwrap()
    }

    #[test]
    fn expected_gpus_is_capacity_else_allocatable() {
        let both = node(serde_json::json!({ "metadata": { "name": "a" }, "status": {
            "capacity": { "nvidia.com/gpu": "8", "cpu": "96" }, "allocatable": { "nvidia.com/gpu": "7" } } }));
        assert_eq!(expected_gpus(&both), Some(8), "capacity keeps an unhealthy GPU; allocatable does not");
        let allocatable = node(serde_json::json!({ "metadata": { "name": "a" }, "status": {
            "capacity": { "cpu": "96" }, "allocatable": { "nvidia.com/gpu": "4" } } }));
        assert_eq!(expected_gpus(&allocatable), Some(4));
        let cpu_only =
            node(serde_json::json!({ "metadata": { "name": "a" }, "status": { "capacity": { "cpu": "96" } } }));
        assert_eq!(expected_gpus(&cpu_only), None);
        assert_eq!(expected_gpus(&node(serde_json::json!({ "metadata": { "name": "a" } }))), None);
        let odd = node(
            serde_json::json!({ "metadata": { "name": "a" }, "status": { "capacity": { "nvidia.com/gpu": "1k" } } }),
        );
        assert_eq!(expected_gpus(&odd), None, "not a whole count");

        let cache = ClusterCache::default();
        cache.apply_node(&both, &ContextSettings::default());
        assert_eq!(cache.node("a").unwrap().context.expected_gpus, Some(8));
    }

    #[test]
    fn index_follows_pods_between_nodes() {
        let cache = ClusterCache::default();
        let settings = ContextSettings::default();
        for n in ["gpu-1", "gpu-2"] {
            cache.apply_node(
                &serde_json::from_value(serde_json::json!({ "metadata": { "name": n } })).unwrap(),
                &settings,
            );
        }
        let on = |node: &str| {
            pod(serde_json::json!({ "metadata": { "name": "p", "namespace": "ml" },
                "spec": { "nodeName": node, "containers": [{ "name": "c", "resources": { "limits": { "nvidia.com/gpu": "1" } } }] } }))
        };
        cache.apply_pod(&on("gpu-1"));
        assert_eq!(cache.node("gpu-1").unwrap().workloads.len(), 1);
        cache.apply_pod(&on("gpu-2"));
        assert_eq!(cache.node("gpu-1").unwrap().workloads.len(), 0);
        assert_eq!(cache.node("gpu-2").unwrap().workloads.len(), 1);
        cache.remove_pod("ml/p");
        assert_eq!(cache.node("gpu-2").unwrap().workloads.len(), 0);
        assert!(cache.node("gpu-3").is_none());
    }

    #[test]
    fn a_node_applied_after_its_pods_takes_its_own_and_no_other() {
        // The Pods list may finish before the Nodes list: each node then finds its pods by the
        // pods' node index, including a pod that moved and one that went away before it came.
        let cache = ClusterCache::default();
        let settings = ContextSettings::default();
        let on = |name: &str, node: &str| {
            pod(serde_json::json!({ "metadata": { "name": name, "namespace": "ml" },
                "spec": { "nodeName": node, "containers": [{ "name": "c", "resources": { "limits": { "nvidia.com/gpu": "1" } } }] } }))
        };
        cache.apply_pod(&on("p", "gpu-1"));
        cache.apply_pod(&on("q", "gpu-1"));
        cache.apply_pod(&on("r", "gpu-2"));
        cache.apply_pod(&on("q", "gpu-2"));
        cache.apply_pod(&on("s", "gpu-1"));
        cache.remove_pod("ml/s");
        for n in ["gpu-1", "gpu-2", "gpu-3"] {
            cache.apply_node(&node(serde_json::json!({ "metadata": { "name": n } })), &settings);
        }
        let pods_on = |n: &str| {
            let mut p: Vec<String> = cache.node(n).unwrap().workloads.iter().map(|w| w.pod.clone()).collect();
            p.sort();
            p
        };
        assert_eq!(pods_on("gpu-1"), ["p"]);
        assert_eq!(pods_on("gpu-2"), ["q", "r"]);
        assert!(pods_on("gpu-3").is_empty());
        // A node applied again (a status change) keeps its workloads.
        cache.apply_node(&node(serde_json::json!({ "metadata": { "name": "gpu-2" } })), &settings);
        assert_eq!(pods_on("gpu-2"), ["q", "r"]);
    }

    #[test]
    fn a_list_after_a_failed_watch_drops_what_was_deleted_meanwhile() {
        let cache = ClusterCache::default();
        let named = |n: &str| node(serde_json::json!({ "metadata": { "name": n } }));
        let on = |name: &str, node: &str| {
            pod(serde_json::json!({ "metadata": { "name": name, "namespace": "ml" },
                "spec": { "nodeName": node, "containers": [{ "name": "c", "resources": { "limits": { "nvidia.com/gpu": "1" } } }] } }))
        };
        let mut nodes = Listing::new(NodeIndex { cache: cache.clone(), settings: ContextSettings::default() });
        let mut pods = Listing::new(PodIndex { cache: cache.clone() });
        for event in
            [watcher::Event::Init, watcher::Event::InitApply(named("a")), watcher::Event::InitApply(named("b"))]
        {
            assert!(!nodes.handle(event), "not whole before InitDone");
        }
        assert!(nodes.handle(watcher::Event::InitDone));
        pods.handle(watcher::Event::Init);
        pods.handle(watcher::Event::InitApply(on("p", "a")));
        pods.handle(watcher::Event::InitApply(on("q", "a")));
        assert!(pods.handle(watcher::Event::InitDone));
        assert_eq!(cache.node("a").unwrap().workloads.len(), 2);

        // The watches failed; meanwhile b and the pod q were deleted and c was added. The new
        // lists name what is there now.
        for event in
            [watcher::Event::Init, watcher::Event::InitApply(named("a")), watcher::Event::InitApply(named("c"))]
        {
            nodes.handle(event);
        }
        assert!(cache.node("b").is_some(), "kept (and served) until the list is complete");
        assert!(nodes.handle(watcher::Event::InitDone));
        assert!(cache.node("b").is_none(), "not listed: deleted while the watch was down");
        assert!(cache.node("c").is_some());
        pods.handle(watcher::Event::Init);
        pods.handle(watcher::Event::InitApply(on("p", "a")));
        assert!(pods.handle(watcher::Event::InitDone));
        let workloads = cache.node("a").unwrap().workloads.clone();
        assert_eq!(workloads.iter().map(|w| w.pod.as_str()).collect::<Vec<_>>(), ["p"]);

        // Watch events between lists apply as they come.
        nodes.handle(watcher::Event::Delete(named("c")));
        assert!(!nodes.handle(watcher::Event::Apply(named("d"))));
        assert!(cache.node("c").is_none() && cache.node("d").is_some());
    }
}
