//! The managed fleet: the GPU nodes gpumedic acts on, their count (the breaker's denominator),
//! which of them carry a repair ladder or a deferred action, and each one's state as the planner
//! reads it.
//!
//! One watch of the managed Nodes keeps all of it, holding of each node only what the planner
//! and the node writes read ([`trim`]: names, gpumedic's own labels and annotations, taints, the
//! cordon and the conditions; not the other labels, images, addresses or managed fields). Before it, the fleet count (every
//! 30 s), the deferred actions (every 30 s) and the repair ladders (every 10 s) each listed the
//! fleet: at 100,000 nodes a names-only list costs the apiserver about 3 CPU seconds, so the
//! three polls kept about half an apiserver core busy. The polls now read the watch's index and
//! read whole only the nodes it says carry their annotation. A verdict's first read of its node
//! is the index's copy too ([`NodeCache::get`]), which takes an apiserver round trip off every
//! fault's path: the write planned from it is guarded by its resourceVersion, as with any read
//! that may be a moment old.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, RwLock};

use k8s_openapi::api::core::v1::{Node, NodeSpec, NodeStatus};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::api::{Api, ListParams};
use kube::runtime::watcher::{self, Event};

use crate::ladder::LADDER_ANNOTATION;
use crate::maintenance::DEFERRED_ANNOTATION;
use crate::plan::{APPLIED_ANNOTATION, Applied};
use crate::request::Subsystem;
use crate::watch::{follow, read, write};

/// The annotations the index remembers per node, one bit each.
const TRACKED: [&str; 2] = [LADDER_ANNOTATION, DEFERRED_ANNOTATION];

/// The GPU nodes gpumedic manages (those matching `--gpu-node-selector`): it acts on no other
/// node, and the breaker's share is measured against their number.
#[derive(Clone)]
pub struct Fleet {
    pub(crate) client: kube::Client,
    pub(crate) selector: String,
    index: NodeCache,
    pub(crate) count: Arc<AtomicUsize>,
}

/// The watch's copies of the managed nodes, trimmed ([`trim`]); cheap to clone (one shared
/// state). A cache whose watch never listed answers nothing, so every read goes to the apiserver.
#[derive(Debug, Clone, Default)]
pub struct NodeCache {
    index: Arc<RwLock<Index>>,
    /// Reads it could not answer (not listed yet, or a node it has not delivered).
    misses: Arc<AtomicU64>,
}

impl NodeCache {
    /// `name`'s copy, once the watch has listed; `None` (and a miss counted) otherwise. It may be
    /// a moment behind the apiserver: write from it only guarded by its resourceVersion.
    pub fn get(&self, name: &str) -> Option<Node> {
        let found = {
            let index = read(&self.index);
            index.synced.then(|| index.nodes.get(name).map(|n| Node::clone(n))).flatten()
        };
        if found.is_none() {
            self.misses.fetch_add(1, Ordering::Relaxed);
            metrics::counter!(crate::events::names::NODE_CACHE_MISSES_TOTAL).increment(1);
        }
        found
    }

    /// Takes `node` as written by this process (a patch's answer), when it is newer than the
    /// copy held: the watch delivers the same version a moment later, and a verdict for the node
    /// in between plans from what is really there instead of failing its write on a stale copy.
    pub fn offer(&self, node: &Node) {
        let Some(name) = node.metadata.name.as_deref() else { return };
        let mut index = write(&self.index);
        let newer = match index.nodes.get(name) {
            Some(held) => version(node) > version(held),
            // Not a managed node, or not listed yet: the watch decides what the index holds.
            None => false,
        };
        if newer {
            index.nodes.insert(name.to_owned(), Arc::new(trim(node.clone())));
        }
    }

    /// A cache that has listed `nodes`, as the fleet watch's first list leaves it (for tests and
    /// tools that drive a [`crate::apply::Remediator`] without a watch).
    pub fn listed(nodes: impl IntoIterator<Item = Node>) -> Self {
        let cache = Self::default();
        {
            let mut index = write(&cache.index);
            index.event(Event::Init);
            for node in nodes {
                index.event(Event::InitApply(trim(node)));
            }
            index.event(Event::InitDone);
        }
        cache
    }

    /// How many reads it could not answer since the start.
    pub fn misses(&self) -> u64 {
        self.misses.load(Ordering::Relaxed)
    }
}

/// A node's resourceVersion as a number ([`crate::watch::version`]; an unreadable one orders
/// first).
fn version(node: &Node) -> Option<u64> {
    crate::watch::version(node.metadata.resource_version.as_deref())
}

/// Whether `node` may replace `held`: not when `held` is known to be newer (a patch's answer
/// offered before the watch delivered the event of an earlier change).
fn not_older(node: &Node, held: Option<&Arc<Node>>) -> bool {
    match (held.and_then(|h| version(h)), version(node)) {
        (Some(held), Some(new)) => new >= held,
        _ => true,
    }
}

/// The prefix of every label and annotation gpumedic writes or reads on a node (its state, the
/// opt-out, the ownership record, a deferral, a repair ladder, the unhealthy GPU).
const OWN_PREFIX: &str = "gpumedic.io/";

/// What the index keeps of a node: its name, uid and resourceVersion, gpumedic's own labels and
/// annotations ([`OWN_PREFIX`]), its taints and cordon, and gpumedic's own conditions
/// ([`own_conditions`]). The rest (other labels, annotations and conditions, managed fields,
/// images, addresses, capacity, system info) is dropped, which is most of a real node's size: a
/// GPU node carries dozens of feature-discovery labels, and a kubelet's four conditions with their
/// messages and times. Whatever the planner, the node writes or the resync read of a node must be
/// kept here (the taints whole: a taint patch carries the whole list; the conditions' patch merges
/// by type, so it never needs the others).
pub(crate) fn trim(node: Node) -> Node {
    let own = |m: Option<std::collections::BTreeMap<String, String>>| {
        m.map(|m| m.into_iter().filter(|(k, _)| k.starts_with(OWN_PREFIX)).collect())
    };
    let mut metadata = node.metadata;
    metadata.managed_fields = None;
    metadata.labels = own(metadata.labels.take());
    metadata.annotations = own(metadata.annotations.take());
    let owned = own_conditions(&metadata);
    Node {
        spec: node.spec.map(|s| NodeSpec { taints: s.taints, unschedulable: s.unschedulable, ..NodeSpec::default() }),
        status: node.status.map(|s| NodeStatus {
            conditions: match owned {
                Some(owned) => s.conditions.map(|cs| cs.into_iter().filter(|c| owned(&c.type_)).collect()),
                None => s.conditions,
            },
            ..NodeStatus::default()
        }),
        metadata,
    }
}

/// Which condition types of a node are gpumedic's: those of its subsystems, and any its ownership
/// record names (set by an older release under another name, so a recovery can still clear it).
/// `None`, keep them all, when the record does not parse: then nothing the planner might read is
/// missing.
fn own_conditions(metadata: &ObjectMeta) -> Option<impl Fn(&str) -> bool> {
    let recorded: Vec<String> = match metadata.annotations.as_ref().and_then(|a| a.get(APPLIED_ANNOTATION)) {
        None => Vec::new(),
        Some(raw) => {
            let applied = serde_json::from_str::<Applied>(raw).ok()?.upgraded();
            applied.conditions.into_iter().chain(applied.incidents.into_values().map(|c| c.condition)).collect()
        }
    };
    Some(move |type_: &str| {
        Subsystem::ALL.iter().any(|s| s.condition_type() == type_) || recorded.iter().any(|r| r == type_)
    })
}

impl Fleet {
    /// The fleet of the nodes matching `selector`; empty until [`Fleet::watch`] has listed.
    pub(crate) fn new(client: kube::Client, selector: String) -> Self {
        Self { client, selector, index: NodeCache::default(), count: Arc::new(AtomicUsize::new(0)) }
    }

    /// The watch's copies of the managed nodes, for the node writes.
    pub(crate) fn cache(&self) -> NodeCache {
        self.index.clone()
    }

    /// Whether `node` is managed. A node the watch has not delivered (one that joined a moment
    /// ago, or any before the first list) is looked up by name, so it is not refused.
    pub(crate) async fn manages(&self, node: &str) -> Result<bool, kube::Error> {
        if read(&self.index.index).nodes.contains_key(node) {
            return Ok(true);
        }
        let params = ListParams::default().labels(&self.selector).fields(&format!("metadata.name={node}"));
        let found = Api::<Node>::all(self.client.clone()).list_metadata(&params).await?.items;
        Ok(found.iter().any(|n| n.metadata.name.as_deref() == Some(node)))
    }

    /// The managed nodes that carry `annotation` (a repair ladder or a deferred action), read
    /// whole. From the watch's index once it has listed; before that, by a listing of the fleet's
    /// metadata. A node deleted in between is left out.
    pub(crate) async fn carrying(&self, annotation: &str) -> Result<Vec<Node>, kube::Error> {
        let bit = TRACKED.iter().position(|a| *a == annotation).map(|i| 1u8 << i);
        let names = {
            let index = read(&self.index.index);
            match bit {
                Some(bit) if index.synced => Some(
                    index.nodes.iter().filter(|(_, node)| flags(node) & bit != 0).map(|(n, _)| n.clone()).collect(),
                ),
                _ => None,
            }
        };
        let Some(mut names): Option<Vec<String>> = names else {
            return crate::maintenance::carrying(&self.client, &self.selector, annotation).await;
        };
        names.sort();
        let api = Api::<Node>::all(self.client.clone());
        let mut nodes = Vec::with_capacity(names.len());
        for name in names {
            // The index may be a moment behind: the node read whole is what counts.
            if let Some(node) = api.get_opt(&name).await?
                && node.metadata.annotations.as_ref().is_some_and(|a| a.contains_key(annotation))
            {
                nodes.push(node);
            }
        }
        Ok(nodes)
    }

    /// `f` of every managed node, in name order: the watch's copies once it has listed (a moment
    /// behind the apiserver at most, each a version the node really had), else listed from the
    /// apiserver. The resync reads the fleet this way: at 100,000 nodes a whole list costs the
    /// apiserver about 6 CPU seconds, every resync interval.
    pub(crate) async fn map_nodes<T>(&self, mut f: impl FnMut(&Node) -> T) -> Result<Vec<T>, kube::Error> {
        {
            let index = read(&self.index.index);
            if index.synced {
                let mut nodes: Vec<(&String, &Arc<Node>)> = index.nodes.iter().collect();
                nodes.sort_unstable_by(|a, b| a.0.cmp(b.0));
                return Ok(nodes.into_iter().map(|(_, n)| f(n)).collect());
            }
        }
        crate::maintenance::map_nodes(&self.client, &self.selector, f).await
    }

    /// Keeps the index and the count current until `token` is cancelled; `ready` once the first
    /// list is complete. The watch retries with backoff on its own; while it cannot reach the
    /// apiserver the breaker keeps the last count.
    pub(crate) async fn watch(
        self,
        ready: gpumedic_runtime::admin::ReadyFlag,
        token: tokio_util::sync::CancellationToken,
    ) -> Result<(), kube::Error> {
        let api = Api::<Node>::all(self.client.clone());
        let config = watcher::Config::default().labels(&self.selector);
        let failing =
            "The watch of the GPU nodes failed; it retries with backoff, and the breaker keeps the last count.";
        follow(api, config, "nodes", failing, token, |event| {
            let synced = {
                let mut index = write(&self.index.index);
                index.event(event.modify(|n| *n = trim(std::mem::take(n))));
                index.synced.then_some(index.nodes.len())
            };
            if let Some(n) = synced {
                self.count.store(n, Ordering::Release);
                metrics::gauge!(crate::events::names::GPU_NODES).set(n as f64);
                ready.set(true);
            }
        })
        .await;
        Ok(())
    }
}

/// Which of [`TRACKED`] `node` carries, one bit each.
fn flags(node: &Node) -> u8 {
    let Some(annotations) = node.metadata.annotations.as_ref() else { return 0 };
    TRACKED.iter().enumerate().filter(|(_, a)| annotations.contains_key(**a)).fold(0, |f, (i, _)| f | 1 << i)
}

/// The managed nodes by name, trimmed.
#[derive(Debug, Default)]
struct Index {
    /// Whether a list has completed.
    synced: bool,
    nodes: HashMap<String, Arc<Node>>,
    /// The nodes of a relist in progress, swapped in when it completes.
    relist: Option<HashMap<String, Arc<Node>>>,
}

impl Index {
    fn event(&mut self, event: Event<Node>) {
        match event {
            Event::Apply(n) => {
                if let Some(name) = n.metadata.name.clone()
                    && not_older(&n, self.nodes.get(&name))
                {
                    self.nodes.insert(name, Arc::new(n));
                }
            }
            Event::Delete(n) => {
                if let Some(name) = &n.metadata.name {
                    self.nodes.remove(name);
                }
            }
            Event::Init => self.relist = Some(HashMap::new()),
            Event::InitApply(n) => {
                if let Some(name) = n.metadata.name.clone() {
                    self.relist.get_or_insert_with(HashMap::new).insert(name, Arc::new(n));
                }
            }
            Event::InitDone => {
                let mut relisted = self.relist.take().unwrap_or_default();
                // A copy offered while the relist ran may be newer than the one listed.
                for (name, listed) in &mut relisted {
                    if let Some(held) = self.nodes.get(name)
                        && !not_older(listed, Some(held))
                    {
                        *listed = held.clone();
                    }
                }
                self.nodes = relisted;
                self.synced = true;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn node(name: &str, annotations: &[&str]) -> Node {
        let mut node = Node::default();
        node.metadata.name = Some(name.to_owned());
        node.metadata.annotations = Some(annotations.iter().map(|a| ((*a).to_owned(), "{}".to_owned())).collect());
        node
    }

    fn flagged(index: &Index) -> HashMap<String, u8> {
        index.nodes.iter().map(|(name, node)| (name.clone(), flags(node))).collect()
    }

    #[test]
    fn the_index_keeps_names_and_the_annotations_they_carry_and_swaps_in_a_relist_whole() {
        let mut index = Index::default();
        index.event(Event::Init);
        index.event(Event::InitApply(node("a", &[LADDER_ANNOTATION])));
        index.event(Event::InitApply(node("b", &[])));
        assert!(!index.synced && index.nodes.is_empty(), "nothing counts before the list completes");
        index.event(Event::InitDone);
        assert!(index.synced);
        assert_eq!(flagged(&index), HashMap::from([("a".into(), 1), ("b".into(), 0)]));
        index.event(Event::Apply(node("b", &[DEFERRED_ANNOTATION, LADDER_ANNOTATION, "other"])));
        index.event(Event::Apply(node("a", &[])));
        assert_eq!(flagged(&index), HashMap::from([("a".into(), 0), ("b".into(), 3)]));
        index.event(Event::Delete(node("a", &[])));
        // A relist answers with the old contents until it completes, then replaces them.
        index.event(Event::Init);
        index.event(Event::InitApply(node("c", &[DEFERRED_ANNOTATION])));
        assert_eq!(flagged(&index), HashMap::from([("b".into(), 3)]));
        index.event(Event::InitDone);
        assert_eq!(flagged(&index), HashMap::from([("c".into(), 2)]));
    }

    fn versioned(name: &str, version: &str, cordoned: bool) -> Node {
        let mut n = node(name, &[]);
        n.metadata.resource_version = Some(version.to_owned());
        n.spec = Some(NodeSpec { unschedulable: Some(cordoned), ..NodeSpec::default() });
        n
    }

    #[test]
    fn the_cache_answers_once_listed_and_takes_only_newer_copies_of_nodes_it_holds() {
        let cache = NodeCache::default();
        {
            let mut index = write(&cache.index);
            index.event(Event::Init);
            index.event(Event::InitApply(versioned("a", "10", false)));
        }
        assert!(cache.get("a").is_none(), "nothing is answered before the list completes");
        write(&cache.index).event(Event::InitDone);
        assert_eq!(cache.get("a").and_then(|n| n.metadata.resource_version), Some("10".into()));
        assert!(cache.get("b").is_none());
        assert_eq!(cache.misses(), 2);
        // A patch's answer, newer than the watch's copy, is taken; an older one is not.
        cache.offer(&versioned("a", "12", true));
        assert_eq!(cache.get("a").and_then(|n| n.spec).and_then(|s| s.unschedulable), Some(true));
        cache.offer(&versioned("a", "11", false));
        assert_eq!(cache.get("a").and_then(|n| n.metadata.resource_version), Some("12".into()));
        // A node the watch has not delivered is the watch's to add.
        cache.offer(&versioned("b", "13", false));
        assert!(cache.get("b").is_none());
        // The watch's event of an earlier change, arriving after the patch's answer, does not
        // take the copy back; its event of the patch itself, or of a later change, does.
        write(&cache.index).event(Event::Apply(versioned("a", "11", false)));
        assert_eq!(cache.get("a").and_then(|n| n.metadata.resource_version), Some("12".into()));
        write(&cache.index).event(Event::Apply(versioned("a", "14", false)));
        assert_eq!(cache.get("a").and_then(|n| n.metadata.resource_version), Some("14".into()));
        // Nor does a relist that listed the node before its last change.
        cache.offer(&versioned("a", "16", true));
        {
            let mut index = write(&cache.index);
            index.event(Event::Init);
            index.event(Event::InitApply(versioned("a", "15", false)));
            index.event(Event::InitApply(versioned("c", "15", false)));
            index.event(Event::InitDone);
        }
        assert_eq!(cache.get("a").and_then(|n| n.metadata.resource_version), Some("16".into()));
        assert_eq!(cache.get("c").and_then(|n| n.metadata.resource_version), Some("15".into()));
    }

    #[test]
    fn a_trimmed_node_keeps_what_the_planner_and_the_writes_read() {
        use k8s_openapi::api::core::v1::{ContainerImage, NodeCondition, Taint};
        use k8s_openapi::apimachinery::pkg::apis::meta::v1::ManagedFieldsEntry;
        let mut n = versioned("a", "7", true);
        n.metadata.uid = Some("uid-a".into());
        let pair = |k: &str, v: &str| (k.to_owned(), v.to_owned());
        n.metadata.labels = Some(
            [
                pair("nvidia.com/gpu.product", "H100"),
                pair(crate::plan::STATE_LABEL, "quarantined"),
                pair(crate::plan::OPT_OUT_LABEL, "true"),
            ]
            .into(),
        );
        n.metadata.annotations = Some(
            [
                pair("node.alpha.kubernetes.io/ttl", "0"),
                pair(crate::plan::APPLIED_ANNOTATION, "{}"),
                pair(LADDER_ANNOTATION, "{}"),
            ]
            .into(),
        );
        n.metadata.managed_fields = Some(vec![ManagedFieldsEntry::default()]);
        n.spec.as_mut().unwrap().taints =
            Some(vec![Taint { key: "k".into(), effect: "NoSchedule".into(), ..Taint::default() }]);
        n.spec.as_mut().unwrap().pod_cidr = Some("10.0.0.0/24".into());
        n.status = Some(NodeStatus {
            conditions: Some(vec![NodeCondition {
                type_: "Ready".into(),
                status: "True".into(),
                ..NodeCondition::default()
            }]),
            images: Some(vec![ContainerImage { names: Some(vec!["big".into()]), size_bytes: Some(1) }]),
            ..NodeStatus::default()
        });
        let mut view = crate::plan::NodeView::from_node(&n);
        let t = trim(n);
        // The planner's view, less the labels and annotations that are not gpumedic's.
        view.labels.remove("nvidia.com/gpu.product");
        view.annotations.remove("node.alpha.kubernetes.io/ttl");
        assert_eq!(crate::plan::NodeView::from_node(&t), view);
        assert_eq!(view.labels.len() + view.annotations.len(), 4, "gpumedic's own are kept: {view:?}");
        assert_eq!(t.metadata.uid.as_deref(), Some("uid-a"));
        assert_eq!(t.metadata.resource_version.as_deref(), Some("7"));
        assert!(t.metadata.managed_fields.is_none());
        assert!(t.spec.as_ref().unwrap().pod_cidr.is_none());
        assert!(t.status.as_ref().unwrap().images.is_none());
    }

    #[test]
    fn a_trimmed_node_keeps_gpumedics_conditions_and_those_its_record_names_and_no_others() {
        use k8s_openapi::api::core::v1::NodeCondition;
        let condition = |t: &str| NodeCondition { type_: t.into(), status: "True".into(), ..NodeCondition::default() };
        let with = |applied: Option<&str>| {
            let mut n = versioned("a", "7", true);
            n.metadata.annotations = applied.map(|a| [(APPLIED_ANNOTATION.to_owned(), a.to_owned())].into());
            n.status = Some(NodeStatus {
                conditions: Some(
                    [
                        "Ready",
                        "MemoryPressure",
                        "GpuUnhealthy",
                        "GpuMaintenanceScheduled",
                        "GpuXidFault",
                        "KernelDeadlock",
                    ]
                    .map(condition)
                    .into(),
                ),
                ..NodeStatus::default()
            });
            n
        };
        let kept = |n: Node| -> Vec<String> {
            trim(n).status.and_then(|s| s.conditions).unwrap_or_default().into_iter().map(|c| c.type_).collect()
        };
        // No record: only the types of gpumedic's subsystems.
        assert_eq!(kept(with(None)), ["GpuUnhealthy", "GpuMaintenanceScheduled"]);
        // A record naming a type an older release set keeps it, so its recovery can clear it;
        // the claims' conditions count too.
        let record = r#"{"incidentId":"i1","cordoned":true,"conditions":["GpuXidFault"],
            "incidents":{"i2":{"quarantines":false,"condition":"KernelDeadlock"}}}"#;
        assert_eq!(
            kept(with(Some(record))),
            ["GpuUnhealthy", "GpuMaintenanceScheduled", "GpuXidFault", "KernelDeadlock"]
        );
        // A record that does not parse: every condition is kept.
        assert_eq!(kept(with(Some("{not json"))).len(), 6);
        // What the planner reads of gpumedic's conditions is the same either way.
        let full = crate::plan::NodeView::from_node(&with(Some(record)));
        let trimmed = crate::plan::NodeView::from_node(&trim(with(Some(record))));
        for type_ in Subsystem::ALL.map(Subsystem::condition_type).into_iter().chain(["GpuXidFault", "KernelDeadlock"])
        {
            let find = |v: &crate::plan::NodeView| v.conditions.iter().find(|c| c.type_ == type_).cloned();
            assert_eq!(find(&trimmed), find(&full), "{type_}");
        }
    }
}
