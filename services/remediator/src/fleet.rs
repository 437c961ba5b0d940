//! The managed fleet: the GPU nodes gpumedic acts on, their count (the breaker's denominator),
//! and which of them carry a repair ladder or a deferred action.
//!
//! One metadata watch of the managed Nodes keeps all of it, holding only each node's name and
//! which of gpumedic's annotations it carries. Before it, the fleet count (every 30 s), the
//! deferred actions (every 30 s) and the repair ladders (every 10 s) each listed the fleet: at
//! 100,000 nodes a names-only list costs the apiserver about 3 CPU seconds, so the three polls
//! kept about half an apiserver core busy. The polls now read the watch's index and read whole
//! only the nodes it says carry their annotation.

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, RwLock};

use k8s_openapi::api::core::v1::Node;
use kube::api::{Api, ListParams};
use kube::core::PartialObjectMeta;
use kube::runtime::watcher::{self, Event};

use crate::ladder::LADDER_ANNOTATION;
use crate::maintenance::DEFERRED_ANNOTATION;
use crate::watch::{follow, read, write};

/// The annotations the index remembers per node, one bit each.
const TRACKED: [&str; 2] = [LADDER_ANNOTATION, DEFERRED_ANNOTATION];

/// The GPU nodes gpumedic manages (those matching `--gpu-node-selector`): it acts on no other
/// node, and the breaker's share is measured against their number.
#[derive(Clone)]
pub struct Fleet {
    pub(crate) client: kube::Client,
    pub(crate) selector: String,
    index: Arc<RwLock<Index>>,
    pub(crate) count: Arc<AtomicUsize>,
}

impl Fleet {
    /// The fleet of the nodes matching `selector`; empty until [`Fleet::watch`] has listed.
    pub(crate) fn new(client: kube::Client, selector: String) -> Self {
        Self { client, selector, index: Arc::default(), count: Arc::new(AtomicUsize::new(0)) }
    }

    /// Whether `node` is managed. A node the watch has not delivered (one that joined a moment
    /// ago, or any before the first list) is looked up by name, so it is not refused.
    pub(crate) async fn manages(&self, node: &str) -> Result<bool, kube::Error> {
        if read(&self.index).nodes.contains_key(node) {
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
            let index = read(&self.index);
            match bit {
                Some(bit) if index.synced => {
                    Some(index.nodes.iter().filter(|(_, flags)| *flags & bit != 0).map(|(n, _)| n.clone()).collect())
                }
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

    /// Keeps the index and the count current until `token` is cancelled; `ready` once the first
    /// list is complete. The watch retries with backoff on its own; while it cannot reach the
    /// apiserver the breaker keeps the last count.
    pub(crate) async fn watch(
        self,
        ready: gpumedic_runtime::admin::ReadyFlag,
        token: tokio_util::sync::CancellationToken,
    ) -> Result<(), kube::Error> {
        // Metadata only: an Api of PartialObjectMeta lists and watches without specs or statuses.
        let api = Api::<PartialObjectMeta<Node>>::all(self.client.clone());
        let config = watcher::Config::default().labels(&self.selector);
        let failing =
            "The watch of the GPU nodes failed; it retries with backoff, and the breaker keeps the last count.";
        follow(api, config, "nodes", failing, token, |event| {
            let synced = {
                let mut index = write(&self.index);
                index.event(event);
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
fn flags(node: &PartialObjectMeta<Node>) -> u8 {
    let Some(annotations) = node.metadata.annotations.as_ref() else { return 0 };
    TRACKED.iter().enumerate().filter(|(_, a)| annotations.contains_key(**a)).fold(0, |f, (i, _)| f | 1 << i)
}

/// The managed nodes by name, with the annotations they carry.
#[derive(Debug, Default)]
struct Index {
    /// Whether a list has completed.
    synced: bool,
    nodes: HashMap<String, u8>,
    /// The nodes of a relist in progress, swapped in when it completes.
    relist: Option<HashMap<String, u8>>,
}

impl Index {
    fn event(&mut self, event: Event<PartialObjectMeta<Node>>) {
        match event {
            Event::Apply(n) => {
                if let Some(name) = n.metadata.name.clone() {
                    self.nodes.insert(name, flags(&n));
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
                    self.relist.get_or_insert_with(HashMap::new).insert(name, flags(&n));
                }
            }
            Event::InitDone => {
                self.nodes = self.relist.take().unwrap_or_default();
                self.synced = true;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn node(name: &str, annotations: &[&str]) -> PartialObjectMeta<Node> {
        let mut meta = PartialObjectMeta::<Node>::default();
        meta.metadata.name = Some(name.to_owned());
        meta.metadata.annotations = Some(annotations.iter().map(|a| ((*a).to_owned(), "{}".to_owned())).collect());
        meta
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
        assert_eq!(index.nodes, HashMap::from([("a".into(), 1), ("b".into(), 0)]));
        index.event(Event::Apply(node("b", &[DEFERRED_ANNOTATION, LADDER_ANNOTATION, "other"])));
        index.event(Event::Apply(node("a", &[])));
        assert_eq!(index.nodes, HashMap::from([("a".into(), 0), ("b".into(), 3)]));
        index.event(Event::Delete(node("a", &[])));
        // A relist answers with the old contents until it completes, then replaces them.
        index.event(Event::Init);
        index.event(Event::InitApply(node("c", &[DEFERRED_ANNOTATION])));
        assert_eq!(index.nodes, HashMap::from([("b".into(), 3)]));
        index.event(Event::InitDone);
        assert_eq!(index.nodes, HashMap::from([("c".into(), 2)]));
    }
}
