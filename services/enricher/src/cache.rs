//! The enricher's view of the cluster: Nodes and GPU Pods, kept current by watch streams, never
//! one API call per event.
//!
//! Two watchers (Nodes; Pods that request `nvidia.com/gpu`) feed one index: node name to its
//! context and its GPU workloads. Readiness waits until both have listed everything once.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, RwLock};

use futures::TryStreamExt as _;
use gpumedic_runtime::admin::ReadyFlag;
use gpumedic_schemas::enriched::Workload;
use k8s_openapi::api::core::v1::{Node, Pod};
use kube::runtime::{WatchStreamExt as _, watcher};
use kube::{Api, Client, ResourceExt as _};
use tokio_util::sync::CancellationToken;

use crate::enrich::{NodeInfo, node_context};

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
    nodes: HashMap<String, NodeInfo>,
    /// Pod (namespace/name) to the node it is bound to and its workload entry.
    pods: HashMap<String, (String, Workload)>,
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
    pub fn node(&self, node: &str) -> Option<NodeInfo> {
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
        let workloads: Vec<Workload> =
            index.pods.values().filter(|(n, _)| *n == name).map(|(_, w)| w.clone()).collect();
        let nvlink_domain = labels.get(crate::enrich::labels::GPU_CLIQUE).filter(|v| !v.is_empty()).cloned();
        index.nodes.insert(name, NodeInfo { context, workloads, nvlink_domain });
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
        if let Some((old_node, _)) = index.pods.insert(key.clone(), (node.clone(), workload.clone()))
            && old_node != node
            && let Some(info) = index.nodes.get_mut(&old_node)
        {
            info.workloads.retain(|w| !(w.namespace == workload.namespace && w.pod == workload.pod));
        }
        if let Some(info) = index.nodes.get_mut(&node) {
            info.workloads.retain(|w| !(w.namespace == workload.namespace && w.pod == workload.pod));
            info.workloads.push(workload);
        }
    }

    fn remove_pod(&self, key: &str) {
        let mut index = self.inner.write().expect("cache lock");
        if let Some((node, w)) = index.pods.remove(key)
            && let Some(info) = index.nodes.get_mut(&node)
        {
            info.workloads.retain(|x| !(x.namespace == w.namespace && x.pod == w.pod));
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

/// Keeps `cache` current until `token` is cancelled; `synced` turns ready once Nodes and Pods have
/// each been listed completely.
pub async fn run_watchers(
    client: Client,
    cache: ClusterCache,
    settings: ContextSettings,
    synced: ReadyFlag,
    token: CancellationToken,
) -> Result<(), kube::runtime::watcher::Error> {
    let nodes_synced = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let pods_synced = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let mark = {
        let (n, p, synced) = (nodes_synced.clone(), pods_synced.clone(), synced.clone());
        move || {
            if n.load(std::sync::atomic::Ordering::Acquire) && p.load(std::sync::atomic::Ordering::Acquire) {
                synced.set(true);
            }
        }
    };

    let node_stream = {
        let cache = cache.clone();
        let mark = mark.clone();
        watcher(Api::<Node>::all(client.clone()), watcher::Config::default()).default_backoff().try_for_each(
            move |event| {
                match event {
                    watcher::Event::Apply(n) | watcher::Event::InitApply(n) => cache.apply_node(&n, &settings),
                    watcher::Event::Delete(n) => cache.delete_node(&n),
                    watcher::Event::Init => {}
                    watcher::Event::InitDone => {
                        nodes_synced.store(true, std::sync::atomic::Ordering::Release);
                        mark();
                    }
                }
                futures::future::ready(Ok(()))
            },
        )
    };
    let pod_stream = {
        let cache = cache.clone();
        watcher(Api::<Pod>::all(client), watcher::Config::default()).default_backoff().try_for_each(move |event| {
            match event {
                watcher::Event::Apply(p) | watcher::Event::InitApply(p) => cache.apply_pod(&p),
                watcher::Event::Delete(p) => cache.remove_pod(&pod_key(&p)),
                watcher::Event::Init => {}
                watcher::Event::InitDone => {
                    pods_synced.store(true, std::sync::atomic::Ordering::Release);
                    mark();
                }
            }
            futures::future::ready(Ok(()))
        })
    };
    tokio::select! {
        () = token.cancelled() => Ok(()),
        r = futures::future::try_join(node_stream, pod_stream) => r.map(|_| ()),
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
}
