//! Watch caches of the two things a GPU quarantine reads on every verdict: the GPUs each node
//! publishes (ResourceSlices of driver [`DRIVER`], kept as pool, device name and UUID only) and
//! gpumedic's own DeviceTaintRules. With them a GPU quarantine costs the node read, the node's
//! two writes and the rule's creation; without them it also lists the node's slices and rules
//! on every verdict, and at a thousand GPU faults the lists are most of the apiserver's work.
//!
//! The caches answer only once their first list is complete; before that, and for a node the
//! slice cache knows nothing about (a node whose driver published a moment ago, or a cluster
//! without DRA), the caller lists live, as it did before the caches. A device the cached slices
//! do not have is listed live too, so a slice the watch has not delivered yet is never missed.
//!
//! A node's verdicts run one after another, and the next one counts the node's rules for the
//! escalation share: so the rules gpumedic writes go into the cache from the apiserver's answer
//! at once ([`DraCache::wrote`], [`DraCache::deleted`]), not when the watch delivers them. A
//! watch event older than what the cache holds (by resourceVersion) is then ignored, so a lagging
//! watch never takes a write back.

use std::collections::{BTreeSet, HashMap};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, RwLock};

use k8s_openapi::api::resource::v1::ResourceSlice;
use k8s_openapi::api::resource::v1beta2::DeviceTaintRule;
use kube::Api;
use kube::runtime::watcher::{self, Event};
use tokio_util::sync::CancellationToken;

use crate::watch::{follow, read, version, write};

use super::{DRIVER, Gpu, MANAGED_BY, MANAGED_BY_LABEL, NODE_ANNOTATION, gpus, owned};

/// What a failing watch means here.
const FAILING: &str =
    "The GPU quarantine's watch failed; it retries with backoff, and until it lists again verdicts read the apiserver.";

/// Tombstones kept for rules gpumedic deleted, until the watch delivers the deletion; past this
/// many (a watch that stopped delivering) they are dropped rather than grow.
const MAX_TOMBSTONES: usize = 10_000;

/// The caches; cheap to clone (one shared state). A cache that was never started answers
/// nothing, so every read goes to the apiserver.
#[derive(Debug, Clone, Default)]
pub struct DraCache {
    slices: Arc<RwLock<Index<Vec<Gpu>>>>,
    rules: Arc<RwLock<Index<DeviceTaintRule>>>,
    /// Reads the caches could not answer, so the apiserver did.
    misses: Arc<AtomicU64>,
}

impl DraCache {
    /// Whether both caches have listed once, so they answer.
    pub fn ready(&self) -> bool {
        read(&self.slices).synced && read(&self.rules).synced
    }

    /// Counts a read the caches could not answer.
    pub fn missed(&self) {
        self.misses.fetch_add(1, Ordering::Relaxed);
    }

    /// How many reads the caches could not answer since the start.
    pub fn misses(&self) -> u64 {
        self.misses.load(Ordering::Relaxed)
    }

    /// The whole GPUs `node` publishes, or `None` when the cache cannot say (not listed yet,
    /// or no slice of the node known): then the caller lists them.
    pub fn gpus_on(&self, node: &str) -> Option<Vec<Gpu>> {
        let index = read(&self.slices);
        if !index.synced {
            return None;
        }
        let names = index.by_node.get(node).filter(|n| !n.is_empty())?;
        Some(names.iter().filter_map(|n| index.entries.get(n)).flat_map(|e| e.value.iter().cloned()).collect())
    }

    /// gpumedic's rules on `node`, or `None` before the first list is complete.
    pub fn rules_on(&self, node: &str) -> Option<Vec<DeviceTaintRule>> {
        let index = read(&self.rules);
        if !index.synced {
            return None;
        }
        let names = index.by_node.get(node);
        Some(names.into_iter().flatten().filter_map(|n| index.entries.get(n)).map(|e| e.value.clone()).collect())
    }

    /// Records a rule as the apiserver answered a write of it.
    pub fn wrote(&self, rule: &DeviceTaintRule) {
        let Some(name) = rule.metadata.name.clone() else { return };
        let node = rule_node(rule);
        write(&self.rules).apply(name, node, version(rule.metadata.resource_version.as_deref()), rule.clone());
    }

    /// Records that gpumedic deleted rule `name`, last seen at `resource_version`.
    pub fn deleted(&self, name: &str, resource_version: Option<&str>) {
        write(&self.rules).forget(name, version(resource_version));
    }

    /// Keeps both caches current until `token` is cancelled. The watches retry with backoff on
    /// their own (a cluster that does not serve the resources keeps its cache empty, and every
    /// read goes to the apiserver, which says so).
    pub async fn run(self, client: kube::Client, token: CancellationToken) {
        let slices = Api::<ResourceSlice>::all(client.clone());
        let slice_config = watcher::Config::default().fields(&format!("spec.driver={DRIVER}"));
        let rules = Api::<DeviceTaintRule>::all(client);
        let rule_config = watcher::Config::default().labels(&format!("{MANAGED_BY_LABEL}={MANAGED_BY}"));
        let slice_index = self.slices.clone();
        let rule_index = self.rules.clone();
        tokio::join!(
            follow(slices, slice_config, "resourceslices", FAILING, token.clone(), move |event| {
                let mut index = write(&slice_index);
                index.event(event.indexed(|s: ResourceSlice| {
                    let node = s.spec.node_name.clone();
                    let gpus = gpus(std::slice::from_ref(&s));
                    Indexed {
                        name: s.metadata.name.clone(),
                        node,
                        version: version(s.metadata.resource_version.as_deref()),
                        value: gpus,
                    }
                }));
            }),
            follow(rules, rule_config, "devicetaintrules", FAILING, token, move |event| {
                let mut index = write(&rule_index);
                index.event(event.indexed(|mut r: DeviceTaintRule| {
                    r.metadata.managed_fields = None;
                    let node = if owned(&r) { rule_node(&r) } else { None };
                    Indexed {
                        name: r.metadata.name.clone(),
                        node,
                        version: version(r.metadata.resource_version.as_deref()),
                        value: r,
                    }
                }));
            }),
        );
    }
}

fn rule_node(rule: &DeviceTaintRule) -> Option<String> {
    rule.metadata.annotations.as_ref().and_then(|a| a.get(NODE_ANNOTATION)).cloned()
}

/// An object as the index keeps it.
#[derive(Debug)]
struct Indexed<V> {
    name: Option<String>,
    node: Option<String>,
    version: Option<u64>,
    value: V,
}

/// An event of `K` as an event of what the index keeps of it.
trait IndexEvent<K> {
    fn indexed<V>(self, f: impl FnMut(K) -> Indexed<V>) -> Event<Indexed<V>>;
}

impl<K> IndexEvent<K> for Event<K> {
    fn indexed<V>(self, mut f: impl FnMut(K) -> Indexed<V>) -> Event<Indexed<V>> {
        match self {
            Event::Apply(k) => Event::Apply(f(k)),
            Event::Delete(k) => Event::Delete(f(k)),
            Event::Init => Event::Init,
            Event::InitApply(k) => Event::InitApply(f(k)),
            Event::InitDone => Event::InitDone,
        }
    }
}

#[derive(Debug)]
struct Entry<V> {
    node: String,
    version: Option<u64>,
    value: V,
}

/// Objects by name, and their names by node.
#[derive(Debug)]
struct Index<V> {
    /// Whether a list has completed: only then does the index answer.
    synced: bool,
    entries: HashMap<String, Entry<V>>,
    by_node: HashMap<String, BTreeSet<String>>,
    /// Objects gpumedic deleted, with the last version it saw: an older event of theirs is
    /// ignored until the watch delivers the deletion.
    tombstones: HashMap<String, u64>,
    /// The objects of a relist in progress, swapped in when it completes.
    relist: Option<Vec<Indexed<V>>>,
}

impl<V> Default for Index<V> {
    fn default() -> Self {
        Self {
            synced: false,
            entries: HashMap::new(),
            by_node: HashMap::new(),
            tombstones: HashMap::new(),
            relist: None,
        }
    }
}

impl<V> Index<V> {
    fn event(&mut self, event: Event<Indexed<V>>) {
        match event {
            Event::Apply(o) => {
                if let Some(name) = o.name {
                    self.apply(name, o.node, o.version, o.value);
                }
            }
            Event::Delete(o) => {
                if let Some(name) = o.name {
                    self.tombstones.remove(&name);
                    self.remove(&name);
                }
            }
            Event::Init => self.relist = Some(Vec::new()),
            Event::InitApply(o) => self.relist.get_or_insert_with(Vec::new).push(o),
            Event::InitDone => {
                let listed = self.relist.take().unwrap_or_default();
                self.entries.clear();
                self.by_node.clear();
                self.tombstones.clear();
                for o in listed {
                    if let Some(name) = o.name {
                        self.apply(name, o.node, o.version, o.value);
                    }
                }
                self.synced = true;
            }
        }
    }

    /// Keeps `value` under `name` unless what the index holds is newer.
    fn apply(&mut self, name: String, node: Option<String>, version: Option<u64>, value: V) {
        if let Some(v) = version {
            if self.entries.get(&name).and_then(|e| e.version).is_some_and(|held| v < held) {
                return;
            }
            match self.tombstones.get(&name) {
                Some(&dead) if v <= dead => return,
                Some(_) => {
                    self.tombstones.remove(&name);
                }
                None => {}
            }
        }
        self.remove(&name);
        // An object about no node (a rule without gpumedic's annotation) is nothing to look up.
        let Some(node) = node else { return };
        self.by_node.entry(node.clone()).or_default().insert(name.clone());
        self.entries.insert(name, Entry { node, version, value });
    }

    fn forget(&mut self, name: &str, version: Option<u64>) {
        self.remove(name);
        if let Some(v) = version {
            if self.tombstones.len() >= MAX_TOMBSTONES {
                self.tombstones.clear();
            }
            self.tombstones.insert(name.to_owned(), v);
        }
    }

    fn remove(&mut self, name: &str) {
        if let Some(old) = self.entries.remove(name)
            && let Some(names) = self.by_node.get_mut(&old.node)
        {
            names.remove(name);
            if names.is_empty() {
                self.by_node.remove(&old.node);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn o(name: &str, node: &str, version: u64, value: &'static str) -> Indexed<&'static str> {
        Indexed { name: Some(name.into()), node: Some(node.into()), version: Some(version), value }
    }

    fn on(index: &Index<&'static str>, node: &str) -> Vec<&'static str> {
        index.by_node.get(node).into_iter().flatten().map(|n| index.entries[n].value).collect()
    }

    fn listed(objects: Vec<Indexed<&'static str>>) -> Index<&'static str> {
        let mut index = Index::default();
        index.event(Event::Init);
        for object in objects {
            index.event(Event::InitApply(object));
        }
        index.event(Event::InitDone);
        index
    }

    #[test]
    fn nothing_is_answered_before_the_first_list_completes() {
        let cache = DraCache::default();
        write(&cache.slices).event(Event::Init);
        write(&cache.slices).event(Event::InitApply(Indexed {
            name: Some("s".into()),
            node: Some("n".into()),
            version: Some(1),
            value: vec![],
        }));
        assert!(cache.gpus_on("n").is_none());
        assert!(cache.rules_on("n").is_none());
        write(&cache.rules).event(Event::Init);
        write(&cache.rules).event(Event::InitDone);
        assert_eq!(cache.rules_on("n").map(|r| r.len()), Some(0), "a listed cache answers, even with none");
    }

    #[test]
    fn objects_are_found_by_node_and_leave_on_delete() {
        let mut index = listed(vec![o("a", "n1", 1, "A"), o("b", "n1", 2, "B"), o("c", "n2", 3, "C")]);
        assert_eq!(on(&index, "n1"), ["A", "B"]);
        index.event(Event::Delete(o("a", "n1", 4, "A")));
        assert_eq!(on(&index, "n1"), ["B"]);
        index.event(Event::Delete(o("b", "n1", 5, "B")));
        assert!(!index.by_node.contains_key("n1"), "an emptied node leaves the index");
        assert_eq!(on(&index, "n2"), ["C"]);
    }

    #[test]
    fn a_write_is_seen_at_once_and_a_lagging_watch_does_not_take_it_back() {
        let mut index = listed(vec![o("r", "n", 5, "v5")]);
        // gpumedic patched the rule (version 9); the watch then delivers an earlier change.
        index.apply("r".into(), Some("n".into()), Some(9), "v9");
        index.event(Event::Apply(o("r", "n", 7, "v7")));
        assert_eq!(on(&index, "n"), ["v9"]);
        index.event(Event::Apply(o("r", "n", 9, "v9")));
        index.event(Event::Apply(o("r", "n", 11, "v11")));
        assert_eq!(on(&index, "n"), ["v11"]);
    }

    #[test]
    fn a_deleted_rule_stays_deleted_until_made_again() {
        let mut index = listed(vec![o("r", "n", 5, "v5")]);
        index.forget("r", Some(5));
        assert!(on(&index, "n").is_empty());
        // The watch lags: the creation arrives after gpumedic's delete.
        index.event(Event::Apply(o("r", "n", 5, "v5")));
        assert!(on(&index, "n").is_empty(), "a stale event does not bring a deleted rule back");
        // Created again later: a newer version.
        index.event(Event::Apply(o("r", "n", 12, "v12")));
        assert_eq!(on(&index, "n"), ["v12"]);
        assert!(index.tombstones.is_empty());
    }

    #[test]
    fn a_relist_replaces_everything_at_its_end() {
        let mut index = listed(vec![o("a", "n", 1, "A"), o("b", "n", 2, "B")]);
        index.event(Event::Init);
        index.event(Event::InitApply(o("b", "n", 8, "B8")));
        assert_eq!(on(&index, "n"), ["A", "B"], "the old contents answer while the relist runs");
        index.event(Event::InitDone);
        assert_eq!(on(&index, "n"), ["B8"]);
    }

    #[test]
    fn an_object_about_no_node_is_not_kept() {
        let mut index = listed(vec![]);
        index.apply("x".into(), None, Some(1), "X");
        assert!(index.entries.is_empty() && index.by_node.is_empty());
    }
}
