//! A Kubernetes `Node` builder: the testbed runs no kubelet, so a test makes the Nodes its
//! services act on, with the labels, taints and capacity it needs.

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::Node;
use kube::api::{Api, PostParams};
use serde_json::{Value, json};

/// A [`Node`] under construction: a name and nothing else until methods add to it.
///
/// ```
/// let node = gpumedic_testkit::NodeBuilder::new("gpu-1").label("nvidia.com/gpu.present", "true").build();
/// assert_eq!(node.metadata.name.as_deref(), Some("gpu-1"));
/// ```
#[derive(Debug, Clone)]
#[must_use]
pub struct NodeBuilder {
    name: String,
    labels: BTreeMap<String, String>,
    taints: Vec<Value>,
    unschedulable: bool,
    capacity: BTreeMap<String, String>,
    allocatable: BTreeMap<String, String>,
}

impl NodeBuilder {
    /// A Node named `name`.
    pub fn new(name: impl Into<String>) -> Self {
        Self {
            name: name.into(),
            labels: BTreeMap::new(),
            taints: vec![],
            unschedulable: false,
            capacity: BTreeMap::new(),
            allocatable: BTreeMap::new(),
        }
    }

    /// Adds label `key=value`.
    pub fn label(mut self, key: impl Into<String>, value: impl Into<String>) -> Self {
        self.labels.insert(key.into(), value.into());
        self
    }

    /// Adds every label of `labels`.
    pub fn labels<K: Into<String>, V: Into<String>>(mut self, labels: impl IntoIterator<Item = (K, V)>) -> Self {
        self.labels.extend(labels.into_iter().map(|(k, v)| (k.into(), v.into())));
        self
    }

    /// Adds a taint: `key`, an optional `value`, and `effect` (`NoSchedule`, `NoExecute`, ...).
    pub fn taint(mut self, key: &str, value: Option<&str>, effect: &str) -> Self {
        self.taints.push(match value {
            Some(v) => json!({ "key": key, "value": v, "effect": effect }),
            None => json!({ "key": key, "effect": effect }),
        });
        self
    }

    /// Marks the Node unschedulable (cordoned).
    pub fn unschedulable(mut self, unschedulable: bool) -> Self {
        self.unschedulable = unschedulable;
        self
    }

    /// Sets the Node's status capacity of `resource` (say `nvidia.com/gpu`) to `quantity`.
    pub fn capacity(mut self, resource: impl Into<String>, quantity: impl Into<String>) -> Self {
        self.capacity.insert(resource.into(), quantity.into());
        self
    }

    /// Sets the Node's status allocatable of `resource` to `quantity`.
    pub fn allocatable(mut self, resource: impl Into<String>, quantity: impl Into<String>) -> Self {
        self.allocatable.insert(resource.into(), quantity.into());
        self
    }

    /// The Node. A Node takes its status when created (kubelets register so).
    pub fn build(self) -> Node {
        let mut node = json!({
            "metadata": { "name": self.name, "labels": self.labels },
            "spec": { "taints": self.taints, "unschedulable": self.unschedulable },
        });
        if !self.capacity.is_empty() || !self.allocatable.is_empty() {
            node["status"] = json!({ "capacity": self.capacity, "allocatable": self.allocatable });
        }
        serde_json::from_value(node).expect("a valid Node")
    }

    /// Creates the Node on the apiserver and returns it as created; panics with the apiserver's
    /// answer when it refuses.
    pub async fn create(self, client: &kube::Client) -> Node {
        let name = self.name.clone();
        Api::<Node>::all(client.clone())
            .create(&PostParams::default(), &self.build())
            .await
            .unwrap_or_else(|e| panic!("node {name} could not be created: {e}"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_node_carries_what_was_set() {
        let node = NodeBuilder::new("n")
            .label("a", "1")
            .labels([("b", "2")])
            .taint("gpumedic.io/quarantine", Some("xid"), "NoSchedule")
            .taint("k", None, "NoExecute")
            .unschedulable(true)
            .capacity("nvidia.com/gpu", "8")
            .allocatable("nvidia.com/gpu", "7")
            .build();
        let labels = node.metadata.labels.unwrap_or_default();
        assert_eq!((labels["a"].as_str(), labels["b"].as_str()), ("1", "2"));
        let spec = node.spec.unwrap_or_default();
        assert_eq!(spec.unschedulable, Some(true));
        let taints = spec.taints.unwrap_or_default();
        assert_eq!(taints[0].value.as_deref(), Some("xid"));
        assert_eq!((taints[1].key.as_str(), taints[1].value.as_deref()), ("k", None));
        let status = node.status.unwrap_or_default();
        assert_eq!(status.capacity.unwrap_or_default()["nvidia.com/gpu"].0, "8");
        assert_eq!(status.allocatable.unwrap_or_default()["nvidia.com/gpu"].0, "7");
    }
}
