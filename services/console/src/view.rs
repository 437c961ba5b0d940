//! The data behind each view, read once and rendered twice: as JSON under `/api/v1/` and as
//! HTML. Nodes and the remediator's status come from the watch caches (no API call per request);
//! incidents, verdicts and actions from PostgreSQL; a node's Kubernetes Events from one bounded
//! list call on the node's page.

use std::collections::BTreeMap;
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use gpumedic_classifier::api::{Incident, IncidentDetail};
use gpumedic_remediator::control::Status;
use k8s_openapi::api::core::v1::{ConfigMap, Event, Node};
use kube::api::{Api, ListParams};
use kube::runtime::reflector::{ObjectRef, Store};
use serde::{Deserialize, Serialize};
use sqlx::PgPool;
use uuid::Uuid;

use crate::fleet::{self, Fleet, NodePage, NodeQuery, NodeSummary};
use crate::live::Live;
use crate::store::{self, IncidentPage, IncidentQuery, Inventory, LastHour, OpenIncidents, RecentAction};

/// The most nodes the fleet view lists as out of service (the count is always complete).
pub const OUT_OF_SERVICE_LISTED: usize = 200;

/// Why a view cannot be shown now: answered 503, the detail goes to the log.
#[derive(Debug, thiserror::Error)]
pub enum ViewError {
    /// The database pool is not open yet.
    #[error("the incident database is not ready yet")]
    DatabaseNotReady,
    /// A query failed.
    #[error("the incident database is unavailable: {0}")]
    Database(#[from] sqlx::Error),
    /// The Node watch cache has not listed the nodes yet.
    #[error("the node cache is not filled yet")]
    NodesNotSynced,
}

/// Everything the console's handlers share.
pub struct Console {
    /// The Node watch cache (GPU nodes only).
    pub nodes: Store<Node>,
    /// Set once the Node cache has listed every node.
    pub nodes_synced: Arc<OnceLock<()>>,
    /// The watch cache of the remediator's status object.
    pub status: Store<ConfigMap>,
    /// The read-only pool, once open.
    pub pool: Arc<OnceLock<PgPool>>,
    /// For a node's Events.
    pub client: kube::Client,
    /// Live verdicts.
    pub live: Live,
    /// The remediator's namespace.
    pub remediator_namespace: String,
    /// Its status object's name.
    pub status_configmap: String,
    /// The trace link template (`--trace-url`), when links are shown.
    pub trace_url: Option<String>,
}

impl Console {
    fn db(&self) -> Result<&PgPool, ViewError> {
        self.pool.get().ok_or(ViewError::DatabaseNotReady)
    }

    /// Every node of the fleet, summarised.
    pub fn summaries(&self) -> Result<Vec<NodeSummary>, ViewError> {
        if self.nodes_synced.get().is_none() {
            return Err(ViewError::NodesNotSynced);
        }
        Ok(self.nodes.state().iter().map(|n| NodeSummary::of(n)).collect())
    }

    /// The remediator's status, when its object exists.
    pub fn remediator(&self) -> Remediator {
        let object = self.status.get(&ObjectRef::new(&self.status_configmap).within(&self.remediator_namespace));
        let status = object.map(|cm| Status::from_data(&cm.data.clone().unwrap_or_default()));
        Remediator::new(status, &self.remediator_namespace, &self.status_configmap)
    }
}

/// An operator command that changes what the page shows.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Command {
    /// What it does.
    pub what: String,
    /// The command line.
    pub command: String,
}

/// The remediator's breaker and pause, with the commands that change them.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Remediator {
    /// Whether the status object was found (false: no remediator has written it yet, or it lives
    /// elsewhere).
    pub found: bool,
    /// Whether the circuit breaker is open (no new quarantines).
    pub breaker_open: bool,
    /// Why it tripped.
    pub breaker_reason: Option<String>,
    /// When it tripped.
    pub breaker_tripped_at: Option<String>,
    /// Whether remediation is paused.
    pub paused: bool,
    /// Who paused or resumed.
    pub paused_by: Option<String>,
    /// Why it was paused.
    pub pause_reason: Option<String>,
    /// Commands that change the above.
    pub commands: Vec<Command>,
}

impl Remediator {
    /// The view of `status` (absent when the object was not found).
    pub fn new(status: Option<Status>, namespace: &str, configmap: &str) -> Remediator {
        let found = status.is_some();
        let s = status.unwrap_or_default();
        let mut target = format!("-n {namespace}");
        if configmap != gpumedic_remediator::control::STATUS_CONFIGMAP {
            target.push_str(&format!(" --status-configmap {configmap}"));
        }
        let mut commands = vec![Command {
            what: "show the breaker, the pause and the leader".into(),
            command: format!("gpumedic breaker status {target}"),
        }];
        if s.breaker_open {
            commands.push(Command {
                what: "close the breaker (find out why it tripped first)".into(),
                command: format!("gpumedic breaker reset {target}"),
            });
        }
        commands.push(if s.paused {
            Command { what: "resume remediation".into(), command: format!("gpumedic resume {target}") }
        } else {
            Command { what: "pause remediation".into(), command: format!("gpumedic pause {target} --reason \"<why>\"") }
        });
        Remediator {
            found,
            breaker_open: s.breaker_open,
            breaker_reason: s.breaker_reason,
            breaker_tripped_at: s.breaker_tripped_at,
            paused: s.paused,
            paused_by: s.paused_by,
            pause_reason: s.pause_reason,
            commands,
        }
    }
}

/// The fleet page.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct FleetView {
    /// Nodes and GPUs.
    #[serde(flatten)]
    pub fleet: Fleet,
    /// The breaker and the pause.
    pub remediator: Remediator,
    /// Decisions and actions in the last hour.
    pub last_hour: LastHour,
}

/// The fleet view.
pub async fn fleet_view(c: &Console) -> Result<FleetView, ViewError> {
    let nodes = c.summaries()?;
    let last_hour = store::last_hour(c.db()?).await?;
    Ok(FleetView { fleet: fleet::fleet(&nodes, OUT_OF_SERVICE_LISTED), remediator: c.remediator(), last_hour })
}

/// A row of the node list: the node and its open incidents.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct NodeRow {
    /// The node.
    #[serde(flatten)]
    pub node: NodeSummary,
    /// Its open incidents.
    pub open_incidents: OpenIncidents,
}

/// The node list page.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct NodesView {
    /// The nodes of this page.
    pub items: Vec<NodeRow>,
    /// Pass as `cursor` for the next page; absent on the last.
    pub next_cursor: Option<String>,
    /// How many nodes match the filters.
    pub matched: u64,
    /// The filter choices: GPU products, zones and rules of open incidents in the fleet.
    pub choices: Choices,
}

/// Values the filters can take.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Choices {
    /// States.
    pub states: Vec<String>,
    /// GPU products.
    pub products: Vec<String>,
    /// Zones.
    pub zones: Vec<String>,
    /// Rules with open incidents.
    pub rules: Vec<String>,
}

/// The node list view.
pub async fn nodes_view(c: &Console, q: &NodeQuery) -> Result<NodesView, ViewError> {
    let nodes = c.summaries()?;
    let db = c.db()?;
    let (products, zones) = fleet::choices(&nodes);
    let mut states: Vec<String> = fleet::STATES.iter().map(|s| (*s).to_owned()).collect();
    for n in &nodes {
        if !states.contains(&n.state) {
            states.push(n.state.clone());
        }
    }
    let with_rule = match &q.rule {
        Some(rule) => store::nodes_with_open_rule(db, rule).await?,
        None => Default::default(),
    };
    let NodePage { items, next_cursor, matched } = fleet::page(nodes, q, &with_rule);
    let names: Vec<String> = items.iter().map(|n| n.name.clone()).collect();
    let mut open = store::open_incidents(db, &names).await?;
    let items = items
        .into_iter()
        .map(|node| {
            let open_incidents = open.remove(&node.name).unwrap_or_default();
            NodeRow { node, open_incidents }
        })
        .collect();
    let rules = store::open_rules(db).await?;
    Ok(NodesView { items, next_cursor, matched, choices: Choices { states, products, zones, rules } })
}

/// A Kubernetes Event about a node.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct NodeEvent {
    /// When it last happened.
    pub at: Option<String>,
    /// `Normal` or `Warning`.
    #[serde(rename = "type")]
    pub type_: Option<String>,
    /// Its reason.
    pub reason: Option<String>,
    /// Its message.
    pub message: Option<String>,
    /// Who reported it.
    pub source: Option<String>,
    /// How many times.
    pub count: Option<i32>,
}

impl NodeEvent {
    fn of(e: &Event) -> NodeEvent {
        let at = e
            .last_timestamp
            .as_ref()
            .map(|t| t.0.to_string())
            .or_else(|| e.event_time.as_ref().map(|t| t.0.to_string()))
            .or_else(|| e.metadata.creation_timestamp.as_ref().map(|t| t.0.to_string()));
        NodeEvent {
            at,
            type_: e.type_.clone(),
            reason: e.reason.clone(),
            message: e.message.clone(),
            source: e
                .reporting_component
                .clone()
                .filter(|s| !s.is_empty())
                .or_else(|| e.source.as_ref().and_then(|s| s.component.clone())),
            count: e.count,
        }
    }
}

/// The node page.
#[derive(Debug, Serialize, Deserialize, PartialEq)]
pub struct NodeView {
    /// The node.
    pub node: NodeSummary,
    /// Its labels.
    pub labels: BTreeMap<String, String>,
    /// Its latest GPU inventory, if its collector published one within the event retention.
    pub inventory: Option<Inventory>,
    /// Its open incidents, newest first.
    pub open_incidents: Vec<Incident>,
    /// Its incidents, newest first, a page at a time.
    pub incidents: IncidentPage,
    /// The latest actions taken on it, newest first.
    pub actions: Vec<RecentAction>,
    /// Its Kubernetes Events, newest first.
    pub events: Vec<NodeEvent>,
    /// Why the Events could not be read, when they could not.
    pub events_error: Option<String>,
}

/// The node view of `name`, its past incidents from `cursor`; `None` when it is not a fleet node.
pub async fn node_view(
    c: &Console,
    name: &str,
    incidents_after: Option<String>,
) -> Result<Option<NodeView>, ViewError> {
    if c.nodes_synced.get().is_none() {
        return Err(ViewError::NodesNotSynced);
    }
    let Some(node) = c.nodes.get(&ObjectRef::new(name)) else { return Ok(None) };
    let db = c.db()?;
    let summary = NodeSummary::of(&node);
    let labels = node.metadata.labels.clone().unwrap_or_default();
    let open = store::incidents(
        db,
        &IncidentQuery { node: Some(name.to_owned()), open: Some(true), limit: 100, ..IncidentQuery::default() },
    )
    .await?;
    let after = incidents_after.map(|c| store::IncidentCursor::decode(&c)).transpose().ok().flatten();
    let incidents = store::incidents(
        db,
        &IncidentQuery { node: Some(name.to_owned()), after, limit: 50, ..IncidentQuery::default() },
    )
    .await?;
    let actions = store::node_actions(db, name, 50).await?;
    let inventory = store::inventory(db, name).await?;
    let (events, events_error) = node_events(&c.client, name).await;
    Ok(Some(NodeView {
        node: summary,
        labels,
        inventory,
        open_incidents: open.items,
        incidents,
        actions,
        events,
        events_error,
    }))
}

/// The Events about node `name`, newest first (at most 50), or why there are none.
async fn node_events(client: &kube::Client, name: &str) -> (Vec<NodeEvent>, Option<String>) {
    let api: Api<Event> = Api::all(client.clone());
    let params =
        ListParams::default().fields(&format!("involvedObject.kind=Node,involvedObject.name={name}")).limit(200);
    match tokio::time::timeout(Duration::from_secs(3), api.list(&params)).await {
        Ok(Ok(list)) => {
            let mut events: Vec<NodeEvent> = list.items.iter().map(NodeEvent::of).collect();
            events.sort_by(|a, b| b.at.cmp(&a.at));
            events.truncate(50);
            (events, None)
        }
        Ok(Err(e)) => {
            tracing::warn!(node = name, error = %e, "Cannot list the node's Events.");
            (Vec::new(), Some("the apiserver refused to list the node's Events".into()))
        }
        Err(_) => {
            tracing::warn!(node = name, "The apiserver did not list the node's Events within 3 s.");
            (Vec::new(), Some("the apiserver did not answer within 3 s".into()))
        }
    }
}

/// The incident view; `None` when there is no such incident.
pub async fn incident_view(c: &Console, id: Uuid) -> Result<Option<IncidentDetail>, ViewError> {
    Ok(gpumedic_classifier::api::incident_detail(c.db()?, id).await?)
}

/// The incident list view.
pub async fn incidents_view(c: &Console, q: &IncidentQuery) -> Result<IncidentPage, ViewError> {
    Ok(store::incidents(c.db()?, q).await?)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_commands_follow_the_breaker_and_the_pause() {
        let r = Remediator::new(None, "gpumedic", gpumedic_remediator::control::STATUS_CONFIGMAP);
        assert!(!r.found && !r.breaker_open);
        assert!(r.commands.iter().any(|c| c.command.starts_with("gpumedic pause -n gpumedic")));
        let open = Status { breaker_open: true, paused: true, ..Status::default() };
        let r = Remediator::new(Some(open), "ops", "my-status");
        let lines: Vec<&str> = r.commands.iter().map(|c| c.command.as_str()).collect();
        assert!(lines.contains(&"gpumedic breaker reset -n ops --status-configmap my-status"), "{lines:?}");
        assert!(lines.contains(&"gpumedic resume -n ops --status-configmap my-status"), "{lines:?}");
    }
}
