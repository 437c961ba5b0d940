//! Deferred actions: what waits, for what ([`hold`], [`due`]: pure), and the durable record.
//!
//! An action waits for one of three things ([`Until`]):
//! - a **maintenance window** (`--maintenance-window`): a warning or info verdict that drains or
//!   repairs, outside every window;
//! - a **time** the verdict names (`not_before`): a provider's scheduled maintenance, acted on
//!   shortly before its window (the classifier sets the time: the window's start less its lead);
//! - an **idle GPU**: a verdict the classifier marks `deferrable` (a contained error: the GPU is
//!   reset when convenient), carried out once no workload uses the GPU, or in a window.
//!
//! A waiting action is recorded on its Node, in the [`DEFERRED_ANNOTATION`] (JSON [`Deferred`]:
//! the request, the verdict it came from, when it was deferred, what it waits for). The record
//! lives on the node, not in the remediator's memory, so a restart or a failover keeps it; the
//! leader looks at the records every `--maintenance-check`, carries out those that are [`due`],
//! publishes their outcomes, and removes the records. A recovery verdict for the node (the notice
//! was cancelled or completed, the GPU recovered) removes its record: the plan is dropped.

use chrono::{DateTime, Utc};
use gpumedic_schemas::verdict::RecommendedAction;
use k8s_openapi::api::core::v1::Node;
use kube::api::{Api, ListParams, Patch, PatchParams};
use serde::{Deserialize, Serialize};
use serde_json::{Value, json};

use crate::request::{Action, Remediation};
use crate::window::{self, Window};

/// The Node annotation holding a [`Deferred`] action.
pub const DEFERRED_ANNOTATION: &str = "gpumedic.io/deferred";

/// What a deferred action waits for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Until {
    /// An open maintenance window (records written before this field existed mean this).
    #[default]
    Window,
    /// The verdict's `not_before`.
    Time,
    /// No workload on the GPU (or, for a node-wide action, on the node's GPUs), or an open window.
    Idle,
}

/// An action waiting for a maintenance window, a time, or an idle GPU.
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
    /// Not before this time: the window's opening, the verdict's `not_before`, or (idle) the
    /// time of deferral.
    pub not_before: DateTime<Utc>,
    /// What it waits for.
    #[serde(default)]
    pub until: Until,
}

/// What a verdict's request says about waiting, beside its action.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Timing {
    /// The request is a recovery (never waits).
    pub recovery: bool,
    /// The verdict is critical.
    pub critical: bool,
    /// The verdict's `not_before`.
    pub not_before: Option<DateTime<Utc>>,
    /// The verdict says the action may wait for an idle GPU.
    pub deferrable: bool,
}

/// Whether `action` waits, for what and until when (see the module docs). `None`: act now.
///
/// A `not_before` in the future holds any action that changes the node (a drain two days before
/// the provider's window would idle the node for two days); one in the past does not (the
/// window's start less the lead has come). A deferrable verdict waits for an idle GPU unless a
/// window is open now. Otherwise a non-critical action that drains waits for the next window.
pub fn hold(action: Action, timing: Timing, windows: &[Window], now: DateTime<Utc>) -> Option<(Until, DateTime<Utc>)> {
    if timing.recovery || action <= Action::Monitor {
        return None;
    }
    if let Some(at) = timing.not_before.filter(|at| *at > now) {
        return Some((Until::Time, at));
    }
    if window::open_at(windows, now) {
        return None;
    }
    if timing.deferrable && action.drains() {
        return Some((Until::Idle, now));
    }
    if window::deferrable(timing.critical, action) {
        return window::next_opening(windows, now).map(|at| (Until::Window, at));
    }
    None
}

/// Whether `deferred` may be carried out at `now`; `idle` says whether its GPU (or node) has no
/// workload, and is asked only for an action waiting for that.
pub fn due(deferred: &Deferred, windows: &[Window], now: DateTime<Utc>, idle: impl FnOnce() -> bool) -> bool {
    match deferred.until {
        // Windows removed from the configuration since: nothing would ever open, so go.
        Until::Window => windows.is_empty() || window::open_at(windows, now),
        Until::Time => now >= deferred.not_before,
        Until::Idle => window::open_at(windows, now) || idle(),
    }
}

/// How an outcome says what the action waits for.
pub fn waits_for(until: Until, at: DateTime<Utc>) -> String {
    let at = at.to_rfc3339_opts(chrono::SecondsFormat::Secs, true);
    match until {
        Until::Window => format!("the maintenance window opening at {at}"),
        Until::Time => format!("{at}, the time the verdict names (scheduled maintenance less its lead)"),
        Until::Idle => "the GPU to have no workload, or a maintenance window".to_owned(),
    }
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

/// Removes the deferred action on `node` only when it belongs to `incident_id`, guarded by the
/// node's resourceVersion: the recovery of one incident never drops another open incident's plan.
/// Returns whether a plan was removed.
pub async fn clear_for(client: &kube::Client, node: &str, incident_id: &str) -> Result<bool, kube::Error> {
    let nodes: Api<Node> = Api::all(client.clone());
    let Some(current) = nodes.get_opt(node).await? else { return Ok(false) };
    match deferred_on(&current) {
        Some(Ok(d)) if d.request.incident_id == incident_id => {}
        _ => return Ok(false),
    }
    let mut patch = annotation_patch(Value::Null);
    patch["metadata"]["resourceVersion"] = json!(current.metadata.resource_version);
    match nodes.patch(node, &PatchParams::default(), &Patch::Merge(patch)).await {
        Ok(_) => Ok(true),
        Err(kube::Error::Api(s)) if s.code == 404 => Ok(false),
        Err(e) => Err(e),
    }
}

/// The managed nodes (matching `selector`) that carry `annotation`, whole. The fleet is listed by
/// metadata only, a page at a time (a quarter of a whole list's cost to the apiserver at 10,000
/// nodes, and a fraction of its memory here), and only the nodes carrying the annotation are read
/// whole; a node deleted in between is left out. [`crate::fleet::Fleet::carrying`] reads the
/// names from its watch instead, and lists here only until the watch has listed once.
pub async fn carrying(client: &kube::Client, selector: &str, annotation: &str) -> Result<Vec<Node>, kube::Error> {
    let api = Api::<Node>::all(client.clone());
    let mut params = ListParams::default().labels(selector).limit(LIST_PAGE);
    let mut names = Vec::new();
    loop {
        let page = api.list_metadata(&params).await?;
        names.extend(page.items.into_iter().filter_map(|n| {
            n.metadata.annotations.as_ref().is_some_and(|a| a.contains_key(annotation)).then_some(n.metadata.name?)
        }));
        match page.metadata.continue_.filter(|c| !c.is_empty()) {
            Some(token) => params = params.continue_token(&token),
            None => break,
        }
    }
    let mut nodes = Vec::with_capacity(names.len());
    for name in names {
        if let Some(node) = api.get_opt(&name).await? {
            nodes.push(node);
        }
    }
    Ok(nodes)
}

/// The managed nodes (matching `selector`), whole.
pub async fn list_nodes(client: &kube::Client, selector: &str) -> Result<Vec<Node>, kube::Error> {
    Ok(Api::<Node>::all(client.clone()).list(&ListParams::default().labels(selector)).await?.items)
}

/// Nodes per page of [`map_nodes`]: the page size kube-runtime's watcher lists with.
pub const LIST_PAGE: u32 = 500;

/// `f` of each managed node (matching `selector`), the nodes read [`LIST_PAGE`] at a time and
/// dropped page by page, so a listing of a large fleet holds one page of whole Nodes and what `f`
/// keeps of the rest (a listing of 10,000 whole Nodes in one response held 27 MiB of JSON and the
/// Nodes decoded from it).
pub async fn map_nodes<T>(
    client: &kube::Client,
    selector: &str,
    mut f: impl FnMut(&Node) -> T,
) -> Result<Vec<T>, kube::Error> {
    let api = Api::<Node>::all(client.clone());
    let mut out = Vec::new();
    let mut params = ListParams::default().labels(selector).limit(LIST_PAGE);
    loop {
        let page = api.list(&params).await?;
        out.extend(page.items.iter().map(&mut f));
        match page.metadata.continue_.filter(|c| !c.is_empty()) {
            Some(token) => params = params.continue_token(&token),
            None => return Ok(out),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(s: &str) -> DateTime<Utc> {
        DateTime::parse_from_rfc3339(s).unwrap().with_timezone(&Utc)
    }

    fn timing() -> Timing {
        Timing { recovery: false, critical: false, not_before: None, deferrable: false }
    }

    fn deferred(until: Until, not_before: DateTime<Utc>) -> Deferred {
        Deferred {
            verdict_id: uuid::Uuid::nil(),
            action: RecommendedAction::Drain,
            request: Remediation {
                node: "n".into(),
                gpu: None,
                action: Action::Drain,
                subsystem: crate::request::Subsystem::Maintenance,
                reason: "CloudMaintenance".into(),
                message: String::new(),
                verdict_id: String::new(),
                incident_id: String::new(),
                recovery: false,
                reissue: false,
                custom: None,
            },
            deferred_at: not_before,
            not_before,
            until,
        }
    }

    // 2026-12-05 is a Saturday.
    const NOW: &str = "2026-12-05T10:00:00Z";

    #[test]
    fn a_future_not_before_holds_any_change_to_the_node_even_a_critical_one() {
        let now = at(NOW);
        let later = at("2026-12-07T09:00:00Z");
        for action in [Action::Cordon, Action::Drain, Action::RebootNode] {
            let t = Timing { critical: true, not_before: Some(later), ..timing() };
            assert_eq!(hold(action, t, &[], now), Some((Until::Time, later)), "{action:?}");
        }
        let t = Timing { not_before: Some(later), ..timing() };
        assert_eq!(hold(Action::Monitor, t, &[], now), None, "a mark never waits");
        assert_eq!(hold(Action::Drain, Timing { recovery: true, ..t }, &[], now), None, "nor a recovery");
    }

    #[test]
    fn a_not_before_that_has_come_acts_now() {
        let now = at(NOW);
        let t = Timing { critical: true, not_before: Some(at("2026-12-05T09:59:00Z")), ..timing() };
        assert_eq!(hold(Action::Drain, t, &[], now), None);
        let t = Timing { not_before: Some(now), ..t };
        assert_eq!(hold(Action::Drain, t, &[], now), None);
    }

    #[test]
    fn a_deferrable_reset_waits_for_an_idle_gpu_unless_a_window_is_open() {
        let now = at(NOW);
        let t = Timing { critical: true, deferrable: true, ..timing() };
        assert_eq!(hold(Action::ResetGpu, t, &[], now), Some((Until::Idle, now)));
        let open: Window = "Sat 09:00-11:00".parse().unwrap();
        assert_eq!(hold(Action::ResetGpu, t, &[open], now), None);
        let closed: Window = "Sun 02:00-04:00".parse().unwrap();
        assert_eq!(hold(Action::ResetGpu, t, std::slice::from_ref(&closed), now), Some((Until::Idle, now)));
        assert_eq!(hold(Action::Cordon, t, &[closed], now), None, "a cordon is cheap and never waits");
    }

    #[test]
    fn windows_hold_only_non_critical_drains() {
        let now = at(NOW);
        let w: Window = "Sun 02:00-04:00".parse().unwrap();
        let windows = std::slice::from_ref(&w);
        assert_eq!(hold(Action::Drain, timing(), windows, now), Some((Until::Window, at("2026-12-06T02:00:00Z"))));
        assert_eq!(hold(Action::Drain, Timing { critical: true, ..timing() }, windows, now), None);
        assert_eq!(hold(Action::Drain, timing(), &[], now), None, "no windows: nothing waits");
    }

    #[test]
    fn due_follows_what_the_action_waits_for() {
        let now = at(NOW);
        let open: Window = "Sat 09:00-11:00".parse().unwrap();
        let closed: Window = "Sun 02:00-04:00".parse().unwrap();
        let never = || panic!("idle is asked only for an idle wait");
        assert!(due(&deferred(Until::Window, now), std::slice::from_ref(&open), now, never));
        assert!(!due(&deferred(Until::Window, now), std::slice::from_ref(&closed), now, never));
        assert!(due(&deferred(Until::Window, now), &[], now, never), "windows removed: go");
        assert!(!due(&deferred(Until::Time, at("2026-12-05T10:00:01Z")), &[], now, never));
        assert!(due(&deferred(Until::Time, now), &[], now, never));
        assert!(!due(&deferred(Until::Idle, now), std::slice::from_ref(&closed), now, || false));
        assert!(due(&deferred(Until::Idle, now), std::slice::from_ref(&closed), now, || true));
        assert!(due(&deferred(Until::Idle, now), &[open], now, || false));
    }

    #[test]
    fn records_written_before_until_existed_wait_for_a_window() {
        let mut raw = serde_json::to_value(deferred(Until::Time, at(NOW))).unwrap();
        raw.as_object_mut().unwrap().remove("until");
        let read: Deferred = serde_json::from_value(raw).unwrap();
        assert_eq!(read.until, Until::Window);
    }
}
