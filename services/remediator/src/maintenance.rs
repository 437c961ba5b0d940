//! Deferred actions: the durable half of maintenance windows ([`crate::window`] is the pure half).
//!
//! A verdict that may wait is recorded on its Node, in the [`DEFERRED_ANNOTATION`] (JSON
//! [`Deferred`]: the request, the verdict it came from, when it was deferred and the window it
//! waits for). The record lives on the node, not in the remediator's memory, so a restart or a
//! failover keeps it; while a window is open the leader carries the recorded actions out, publishes
//! their outcomes, and removes the records. A recovery verdict for the node removes its record.

use chrono::{DateTime, Utc};
use gpumedic_schemas::verdict::RecommendedAction;
use k8s_openapi::api::core::v1::Node;
use kube::api::{Api, ListParams, Patch, PatchParams};
use serde::{Deserialize, Serialize};
use serde_json::{Value, json};

use crate::request::Remediation;

/// The Node annotation holding a [`Deferred`] action.
pub const DEFERRED_ANNOTATION: &str = "gpumedic.io/deferred";

/// An action waiting for a maintenance window.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Deferred {
    /// The verdict that asked for it (the outcome is published under its id).
    pub verdict_id: uuid::Uuid,
    /// The action the verdict recommended, as published.
    pub action: RecommendedAction,
    /// What to do.
    pub request: Remediation,
    /// When it was deferred.
    pub deferred_at: DateTime<Utc>,
    /// When the window it waits for opens.
    pub not_before: DateTime<Utc>,
}

/// Reads the deferred action on a node, if any; an unreadable record reads as an error string.
pub fn deferred_on(node: &Node) -> Option<Result<Deferred, String>> {
    node.metadata
        .annotations
        .as_ref()
        .and_then(|a| a.get(DEFERRED_ANNOTATION))
        .map(|raw| serde_json::from_str(raw).map_err(|e| e.to_string()))
}

fn annotation_patch(value: Value) -> Value {
    json!({ "metadata": { "annotations": { DEFERRED_ANNOTATION: value } } })
}

/// Records `deferred` on its node. A later deferral for the node replaces an earlier one: the
/// newest verdict is the classifier's current judgement.
pub async fn defer(client: &kube::Client, deferred: &Deferred) -> Result<(), kube::Error> {
    let nodes: Api<Node> = Api::all(client.clone());
    let raw = serde_json::to_string(deferred).expect("the record serializes");
    nodes.patch(&deferred.request.node, &PatchParams::default(), &Patch::Merge(annotation_patch(json!(raw)))).await?;
    Ok(())
}

/// Removes the deferred action from `node`; a node without one, or gone, is fine.
pub async fn clear(client: &kube::Client, node: &str) -> Result<(), kube::Error> {
    let nodes: Api<Node> = Api::all(client.clone());
    match nodes.patch(node, &PatchParams::default(), &Patch::Merge(annotation_patch(Value::Null))).await {
        Ok(_) => Ok(()),
        Err(kube::Error::Api(s)) if s.code == 404 => Ok(()),
        Err(e) => Err(e),
    }
}

/// The managed nodes (matching `selector`) that carry a deferred action.
pub async fn pending(client: &kube::Client, selector: &str) -> Result<Vec<Node>, kube::Error> {
    let nodes: Api<Node> = Api::all(client.clone());
    Ok(nodes
        .list(&ListParams::default().labels(selector))
        .await?
        .items
        .into_iter()
        .filter(|n| n.metadata.annotations.as_ref().is_some_and(|a| a.contains_key(DEFERRED_ANNOTATION)))
        .collect())
}

/// The managed nodes (matching `selector`), whole.
pub async fn list_nodes(client: &kube::Client, selector: &str) -> Result<Vec<Node>, kube::Error> {
    Ok(Api::<Node>::all(client.clone()).list(&ListParams::default().labels(selector)).await?.items)
}
