//! The fleet as the console shows it, computed from Nodes: pure functions, no I/O.
//!
//! A node's state is gpumedic's state label (`gpumedic.io/state`: quarantined, draining, drained,
//! remediating, remediated, failed, or any value a later remediator writes), `opted-out` when the
//! opt-out label is set, and `healthy` otherwise. Its GPUs are the `nvidia.com/gpu` capacity the
//! kubelet reports, else the `nvidia.com/gpu.count` label of GPU feature discovery. A node's GPUs
//! are out of service while it is cordoned or carries gpumedic's taint: the scheduler places no
//! new work there. The fleet-health figure is the share of GPUs in service.

use std::collections::{BTreeMap, BTreeSet};

use base64::Engine as _;
use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use gpumedic_remediator::plan::{OPT_OUT_LABEL, STATE_LABEL, TAINT_KEY};
use gpumedic_remediator::request::Subsystem;
use k8s_openapi::api::core::v1::Node;
use serde::{Deserialize, Serialize};

/// The state of a node that gpumedic has not marked.
pub const HEALTHY: &str = "healthy";
/// The state of a node with the opt-out label.
pub const OPTED_OUT: &str = "opted-out";
/// The states in the order the fleet page lists them; others (written by a later remediator)
/// follow in name order.
pub const STATES: [&str; 8] =
    [HEALTHY, "quarantined", "draining", "drained", "remediating", "remediated", "failed", OPTED_OUT];
/// The node label naming the GPU product (GPU feature discovery).
pub const PRODUCT_LABEL: &str = "nvidia.com/gpu.product";
/// The node label naming the GPU count (GPU feature discovery).
pub const GPU_COUNT_LABEL: &str = "nvidia.com/gpu.count";
/// The node label naming the zone.
pub const ZONE_LABEL: &str = "topology.kubernetes.io/zone";
/// The extended resource of GPUs.
pub const GPU_RESOURCE: &str = "nvidia.com/gpu";

/// A taint on a node.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TaintView {
    /// Its key.
    pub key: String,
    /// Its value.
    pub value: Option<String>,
    /// Its effect.
    pub effect: String,
}

/// A node condition.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ConditionView {
    /// Its type.
    #[serde(rename = "type")]
    pub type_: String,
    /// `True`, `False` or `Unknown`.
    pub status: String,
    /// Its reason.
    pub reason: Option<String>,
    /// Its message.
    pub message: Option<String>,
    /// When it last changed.
    pub last_transition: Option<String>,
}

/// One node as the console shows it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct NodeSummary {
    /// The node's name.
    pub name: String,
    /// gpumedic's state of the node (see the module).
    pub state: String,
    /// Marked unschedulable.
    pub cordoned: bool,
    /// The GPU product, when labelled.
    pub product: Option<String>,
    /// The zone, when labelled.
    pub zone: Option<String>,
    /// Its GPUs.
    pub gpus: u32,
    /// Whether its GPUs are out of service (cordoned, or gpumedic's taint).
    pub out_of_service: bool,
    /// gpumedic's taints on it.
    pub taints: Vec<TaintView>,
    /// Conditions other than the kubelet's usual ones that are not healthy, and every gpumedic
    /// one.
    pub conditions: Vec<ConditionView>,
}

/// A taint gpumedic owns the key space of.
fn is_gpumedic_taint(key: &str) -> bool {
    key.starts_with("gpumedic.io/")
}

/// A condition type the remediator sets.
fn is_gpumedic_condition(type_: &str) -> bool {
    Subsystem::ALL.iter().any(|s| s.condition_type() == type_)
}

impl NodeSummary {
    /// The summary of `node`. Reads the node in place: the fleet view summarises every node
    /// of the cache on each request, so nothing is copied that is not shown.
    pub fn of(node: &Node) -> NodeSummary {
        let label = |k: &str| node.metadata.labels.as_ref().and_then(|l| l.get(k));
        let spec = node.spec.as_ref();
        let status = node.status.as_ref();
        let cordoned = spec.and_then(|s| s.unschedulable).unwrap_or(false);
        let taints: Vec<TaintView> = spec
            .and_then(|s| s.taints.as_ref())
            .into_iter()
            .flatten()
            .filter(|t| is_gpumedic_taint(&t.key))
            .map(|t| TaintView { key: t.key.clone(), value: t.value.clone(), effect: t.effect.clone() })
            .collect();
        let state = if label(OPT_OUT_LABEL).is_some_and(|v| v == "true") {
            OPTED_OUT.to_owned()
        } else {
            label(STATE_LABEL).filter(|v| !v.is_empty()).cloned().unwrap_or_else(|| HEALTHY.to_owned())
        };
        let capacity = status
            .and_then(|s| s.capacity.as_ref())
            .and_then(|c| c.get(GPU_RESOURCE))
            .and_then(|q| q.0.parse::<u32>().ok())
            .filter(|n| *n > 0);
        let gpus = capacity.or_else(|| label(GPU_COUNT_LABEL).and_then(|v| v.parse().ok())).unwrap_or(0);
        let conditions = status
            .and_then(|s| s.conditions.as_ref())
            .into_iter()
            .flatten()
            .filter(|c| {
                let usual = matches!(
                    c.type_.as_str(),
                    "Ready" | "MemoryPressure" | "DiskPressure" | "PIDPressure" | "NetworkUnavailable"
                );
                let unhealthy = if c.type_ == "Ready" { c.status != "True" } else { c.status == "True" };
                is_gpumedic_condition(&c.type_) || (usual && unhealthy) || (!usual && c.status == "True")
            })
            .map(|c| ConditionView {
                type_: c.type_.clone(),
                status: c.status.clone(),
                reason: c.reason.clone(),
                message: c.message.clone(),
                last_transition: c.last_transition_time.as_ref().map(|t| t.0.to_string()),
            })
            .collect();
        let out_of_service = cordoned || taints.iter().any(|t| t.key == TAINT_KEY && t.effect != "PreferNoSchedule");
        NodeSummary {
            name: node.metadata.name.clone().unwrap_or_default(),
            state,
            cordoned,
            product: label(PRODUCT_LABEL).cloned(),
            zone: label(ZONE_LABEL).cloned(),
            gpus,
            out_of_service,
            taints,
            conditions,
        }
    }
}

/// GPU capacity of the fleet.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Capacity {
    /// Every GPU of the fleet's nodes.
    pub total: u64,
    /// GPUs on nodes that take work.
    pub in_service: u64,
    /// GPUs on cordoned or tainted nodes.
    pub out_of_service: u64,
    /// `in_service / total`: the fleet-health figure; 1 for a fleet without GPUs.
    pub in_service_ratio: f64,
}

/// The fleet's nodes and GPUs in numbers.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Fleet {
    /// GPU capacity.
    pub gpus: Capacity,
    /// Nodes in the fleet.
    pub nodes: u64,
    /// Nodes per state, every state of [`STATES`] present (0 when none).
    pub nodes_by_state: BTreeMap<String, u64>,
    /// Nodes whose GPUs are out of service, by name.
    pub out_of_service: Vec<NodeSummary>,
}

/// The fleet of `nodes`; `out_of_service` lists at most `limit` nodes, by name.
pub fn fleet(nodes: &[NodeSummary], limit: usize) -> Fleet {
    let mut by_state: BTreeMap<String, u64> = STATES.iter().map(|s| ((*s).to_owned(), 0)).collect();
    let (mut total, mut out) = (0u64, 0u64);
    let mut out_nodes: Vec<&NodeSummary> = Vec::new();
    for n in nodes {
        *by_state.entry(n.state.clone()).or_default() += 1;
        total += u64::from(n.gpus);
        if n.out_of_service {
            out += u64::from(n.gpus);
            out_nodes.push(n);
        }
    }
    out_nodes.sort_by(|a, b| a.name.cmp(&b.name));
    let ratio = if total == 0 { 1.0 } else { (total - out) as f64 / total as f64 };
    Fleet {
        gpus: Capacity { total, in_service: total - out, out_of_service: out, in_service_ratio: ratio },
        nodes: nodes.len() as u64,
        nodes_by_state: by_state,
        out_of_service: out_nodes.into_iter().take(limit).cloned().collect(),
    }
}

/// The states of `by_state` in page order: [`STATES`] first, then the others by name.
pub fn ordered_states(by_state: &BTreeMap<String, u64>) -> Vec<(String, u64)> {
    let mut out: Vec<(String, u64)> =
        STATES.iter().map(|s| ((*s).to_owned(), by_state.get(*s).copied().unwrap_or(0))).collect();
    out.extend(by_state.iter().filter(|(k, _)| !STATES.contains(&k.as_str())).map(|(k, v)| (k.clone(), *v)));
    out
}

/// A validated node list query.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct NodeQuery {
    /// A substring of the name.
    pub search: Option<String>,
    /// Exact state.
    pub state: Option<String>,
    /// Exact GPU product.
    pub product: Option<String>,
    /// Exact zone.
    pub zone: Option<String>,
    /// Only nodes with an open incident of this rule (resolved to names by the caller).
    pub rule: Option<String>,
    /// Nodes after this name (decoded cursor).
    pub after: Option<String>,
    /// At most this many.
    pub limit: usize,
}

/// Raw node list parameters, as received.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NodeParams {
    q: Option<String>,
    state: Option<String>,
    product: Option<String>,
    zone: Option<String>,
    rule: Option<String>,
    cursor: Option<String>,
    limit: Option<String>,
}

/// A blank parameter (an empty field of the page's form) is no filter.
fn given(v: Option<String>) -> Option<String> {
    v.map(|s| s.trim().to_owned()).filter(|s| !s.is_empty())
}

/// Parses a page size: `default` when absent, else 1 to `max`.
pub fn parse_limit(raw: Option<String>, default: usize, max: usize) -> Result<usize, String> {
    match given(raw) {
        None => Ok(default),
        Some(l) => match l.parse::<usize>() {
            Ok(n) if (1..=max).contains(&n) => Ok(n),
            _ => Err(format!("limit: '{l}' is not a number from 1 to {max}")),
        },
    }
}

/// An opaque cursor over `text`.
pub fn encode_cursor(text: &str) -> String {
    URL_SAFE_NO_PAD.encode(text.as_bytes())
}

/// The text of a cursor made by [`encode_cursor`].
pub fn decode_cursor(cursor: &str) -> Result<String, String> {
    URL_SAFE_NO_PAD
        .decode(cursor.as_bytes())
        .ok()
        .and_then(|b| String::from_utf8(b).ok())
        .ok_or_else(|| format!("cursor: '{cursor}' is not a cursor this API gave out"))
}

impl NodeQuery {
    /// Validates raw parameters; the error names the parameter and what is wrong.
    pub fn parse(p: NodeParams) -> Result<NodeQuery, String> {
        let q = NodeQuery {
            search: given(p.q),
            state: given(p.state),
            product: given(p.product),
            zone: given(p.zone),
            rule: given(p.rule),
            after: given(p.cursor).map(|c| decode_cursor(&c)).transpose()?,
            limit: parse_limit(p.limit, 100, 1000)?,
        };
        for (name, v) in
            [("q", &q.search), ("state", &q.state), ("product", &q.product), ("zone", &q.zone), ("rule", &q.rule)]
        {
            if v.as_ref().is_some_and(|v| v.len() > 253) {
                return Err(format!("{name}: must be at most 253 characters"));
            }
        }
        Ok(q)
    }

    /// The same query without its cursor, as page links carry it.
    pub fn filters(&self) -> Vec<(&'static str, String)> {
        let mut out = Vec::new();
        for (k, v) in [
            ("q", &self.search),
            ("state", &self.state),
            ("product", &self.product),
            ("zone", &self.zone),
            ("rule", &self.rule),
        ] {
            if let Some(v) = v {
                out.push((k, v.clone()));
            }
        }
        out
    }
}

/// One page of nodes and the cursor of the next, if there is one.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct NodePage {
    /// The nodes, by name.
    pub items: Vec<NodeSummary>,
    /// Pass as `cursor` for the next page; absent on the last.
    pub next_cursor: Option<String>,
    /// How many nodes match the filters, on every page.
    pub matched: u64,
}

/// The page of `nodes` that `query` asks for; `with_rule` holds the nodes with an open incident
/// of the query's rule (ignored without one).
pub fn page(mut nodes: Vec<NodeSummary>, query: &NodeQuery, with_rule: &BTreeSet<String>) -> NodePage {
    let search = query.search.as_ref().map(|s| s.to_lowercase());
    nodes.retain(|n| {
        search.as_ref().is_none_or(|s| n.name.to_lowercase().contains(s))
            && query.state.as_ref().is_none_or(|s| &n.state == s)
            && query.product.as_ref().is_none_or(|p| n.product.as_ref() == Some(p))
            && query.zone.as_ref().is_none_or(|z| n.zone.as_ref() == Some(z))
            && (query.rule.is_none() || with_rule.contains(&n.name))
    });
    nodes.sort_by(|a, b| a.name.cmp(&b.name));
    let matched = nodes.len() as u64;
    let start = match &query.after {
        Some(after) => nodes.partition_point(|n| n.name.as_str() <= after.as_str()),
        None => 0,
    };
    let rest = nodes.len() - start;
    let items: Vec<NodeSummary> = nodes.into_iter().skip(start).take(query.limit).collect();
    let next_cursor = (rest > query.limit).then(|| items.last().map(|n| encode_cursor(&n.name))).flatten();
    NodePage { items, next_cursor, matched }
}

/// The distinct values of a field over `nodes`, for the filters' choices.
pub fn choices(nodes: &[NodeSummary]) -> (Vec<String>, Vec<String>) {
    let products: BTreeSet<String> = nodes.iter().filter_map(|n| n.product.clone()).collect();
    let zones: BTreeSet<String> = nodes.iter().filter_map(|n| n.zone.clone()).collect();
    (products.into_iter().collect(), zones.into_iter().collect())
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    fn node(v: serde_json::Value) -> Node {
        serde_json::from_value(v).expect("a node")
    }

    fn summary(name: &str, state: &str, gpus: u32, out: bool) -> NodeSummary {
        NodeSummary {
            name: name.into(),
            state: state.into(),
            cordoned: out,
            product: Some("H100".into()),
            zone: Some(if name.ends_with('1') { "a" } else { "b" }.into()),
            gpus,
            out_of_service: out,
            taints: vec![],
            conditions: vec![],
        }
    }

    #[test]
    fn a_quarantined_node_is_read_from_its_label_taint_and_cordon() {
        let n = node(json!({
            "metadata": { "name": "gpu-1", "labels": {
                "gpumedic.io/state": "quarantined", "nvidia.com/gpu.product": "H100",
                "topology.kubernetes.io/zone": "z1", "nvidia.com/gpu.count": "8" } },
            "spec": { "unschedulable": true, "taints": [
                { "key": "gpumedic.io/unhealthy", "value": "gpu", "effect": "NoSchedule" },
                { "key": "team.example/reserved", "effect": "NoSchedule" } ] },
            "status": { "conditions": [
                { "type": "Ready", "status": "True" },
                { "type": "GpuUnhealthy", "status": "True", "reason": "Xid79" } ] }
        }));
        let s = NodeSummary::of(&n);
        assert_eq!((s.state.as_str(), s.cordoned, s.out_of_service, s.gpus), ("quarantined", true, true, 8));
        assert_eq!(s.taints.len(), 1, "only gpumedic's taint");
        assert_eq!(s.conditions.iter().map(|c| c.type_.as_str()).collect::<Vec<_>>(), ["GpuUnhealthy"]);
        assert_eq!((s.product.as_deref(), s.zone.as_deref()), (Some("H100"), Some("z1")));
    }

    #[test]
    fn capacity_wins_over_the_label_and_an_unmarked_node_is_healthy() {
        let n = node(json!({
            "metadata": { "name": "gpu-2", "labels": { "nvidia.com/gpu.count": "8" } },
            "status": { "capacity": { "nvidia.com/gpu": "4" } }
        }));
        let s = NodeSummary::of(&n);
        assert_eq!((s.state.as_str(), s.gpus, s.out_of_service), (HEALTHY, 4, false));
        let opted = node(json!({ "metadata": { "name": "x", "labels": {
            "gpumedic.io/opt-out": "true", "gpumedic.io/state": "quarantined" } } }));
        assert_eq!(NodeSummary::of(&opted).state, OPTED_OUT);
    }

    #[test]
    fn the_fleet_counts_gpus_in_service_and_every_state() {
        let nodes = vec![summary("n1", HEALTHY, 8, false), summary("n2", "quarantined", 8, true), {
            let mut s = summary("n3", "lemon", 4, false);
            s.gpus = 4;
            s
        }];
        let f = fleet(&nodes, 10);
        assert_eq!((f.gpus.total, f.gpus.in_service, f.gpus.out_of_service), (20, 12, 8));
        assert!((f.gpus.in_service_ratio - 0.6).abs() < 1e-9);
        assert_eq!(f.nodes_by_state["quarantined"], 1);
        assert_eq!(f.nodes_by_state["draining"], 0);
        assert_eq!(f.out_of_service.iter().map(|n| n.name.as_str()).collect::<Vec<_>>(), ["n2"]);
        let order: Vec<String> = ordered_states(&f.nodes_by_state).into_iter().map(|(s, _)| s).collect();
        assert_eq!(order.first().map(String::as_str), Some(HEALTHY));
        assert_eq!(order.last().map(String::as_str), Some("lemon"));
        assert_eq!(fleet(&[], 10).gpus.in_service_ratio, 1.0);
    }

    #[test]
    fn pages_follow_their_cursor_through_the_filtered_nodes() {
        let nodes: Vec<NodeSummary> = (0..25).map(|i| summary(&format!("node-{i:02}"), HEALTHY, 8, false)).collect();
        let mut q = NodeQuery { limit: 10, ..NodeQuery::default() };
        let mut seen = Vec::new();
        loop {
            let p = page(nodes.clone(), &q, &BTreeSet::new());
            assert_eq!(p.matched, 25);
            seen.extend(p.items.iter().map(|n| n.name.clone()));
            match p.next_cursor {
                Some(c) => q.after = Some(decode_cursor(&c).unwrap()),
                None => break,
            }
        }
        assert_eq!(seen.len(), 25);
        assert!(seen.windows(2).all(|w| w[0] < w[1]));
        let q = NodeQuery { zone: Some("a".into()), limit: 100, ..NodeQuery::default() };
        let p = page(nodes.clone(), &q, &BTreeSet::new());
        assert_eq!(p.items.iter().map(|n| n.name.as_str()).collect::<Vec<_>>(), ["node-01", "node-11", "node-21"]);
        let q = NodeQuery {
            rule: Some("xid-79".into()),
            search: Some("NODE-1".into()),
            limit: 100,
            ..NodeQuery::default()
        };
        let with: BTreeSet<String> = ["node-12".to_owned(), "node-20".to_owned()].into();
        assert_eq!(page(nodes, &q, &with).items.len(), 1);
    }

    #[test]
    fn queries_are_validated() {
        let p = |v: serde_json::Value| NodeQuery::parse(serde_json::from_value(v).unwrap());
        assert_eq!(p(json!({})).unwrap().limit, 100);
        assert!(p(json!({ "limit": "0" })).unwrap_err().starts_with("limit"));
        assert!(p(json!({ "cursor": "%%%" })).unwrap_err().starts_with("cursor"));
        assert_eq!(p(json!({ "state": " " })).unwrap().state, None);
        assert_eq!(p(json!({ "cursor": encode_cursor("n1") })).unwrap().after.as_deref(), Some("n1"));
    }
}
