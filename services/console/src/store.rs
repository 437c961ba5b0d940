//! What the console reads from the classifier's incident history in PostgreSQL: every query
//! parameterised, bounded by a limit, and on indexes the classifier's migrations create
//! (`incidents_node_time`, `incidents_open`, `verdicts_incident`, `health_events_node_time`).
//! The one story of an incident is the incident API's own query
//! ([`gpumedic_classifier::api::incident_detail`]), so the page, the API and `gpumedic incidents
//! --id` tell it alike.

use std::collections::{BTreeMap, BTreeSet};

use chrono::{DateTime, Utc};
use gpumedic_classifier::api::Incident;
use serde::{Deserialize, Serialize};
use sqlx::PgPool;
use uuid::Uuid;

use crate::fleet::{decode_cursor, encode_cursor};

/// A verdict as the fleet page lists it.
#[derive(Debug, Clone, Serialize, Deserialize, sqlx::FromRow, PartialEq)]
pub struct RecentVerdict {
    /// Its id.
    pub verdict_id: Uuid,
    /// Its incident.
    pub incident_id: Uuid,
    /// The node.
    pub node: String,
    /// The rule.
    pub rule_id: String,
    /// Severity.
    pub severity: String,
    /// Recommended action.
    pub action: String,
    /// A recovery verdict.
    pub recovery: bool,
    /// Why.
    pub reason: String,
    /// When.
    pub issued_at: DateTime<Utc>,
}

/// An action outcome, with the node and incident it was for.
#[derive(Debug, Clone, Serialize, Deserialize, sqlx::FromRow, PartialEq)]
pub struct RecentAction {
    /// The verdict it answers.
    pub verdict_id: Uuid,
    /// Its incident.
    pub incident_id: Uuid,
    /// The node.
    pub node: String,
    /// The action.
    pub action: String,
    /// Its status.
    pub status: String,
    /// What happened.
    pub detail: String,
    /// When.
    pub at: DateTime<Utc>,
}

/// The last hour of decisions and actions.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
pub struct LastHour {
    /// Verdicts issued, by severity.
    pub verdicts_by_severity: BTreeMap<String, i64>,
    /// Of those, recoveries.
    pub recoveries: i64,
    /// Action outcomes reported, by `action:status`.
    pub actions_by_outcome: BTreeMap<String, i64>,
    /// The latest verdicts, newest first (at most 20).
    pub recent_verdicts: Vec<RecentVerdict>,
    /// The latest action outcomes, newest first (at most 20).
    pub recent_actions: Vec<RecentAction>,
}

/// The last hour, as of the database's clock.
pub async fn last_hour(db: &PgPool) -> Result<LastHour, sqlx::Error> {
    let by_severity: Vec<(String, bool, i64)> = sqlx::query_as(
        "SELECT severity, recovery, count(*) FROM verdicts WHERE issued_at > now() - interval '1 hour'
          GROUP BY severity, recovery",
    )
    .fetch_all(db)
    .await?;
    let mut out = LastHour::default();
    for (severity, recovery, n) in by_severity {
        *out.verdicts_by_severity.entry(severity).or_default() += n;
        if recovery {
            out.recoveries += n;
        }
    }
    let by_outcome: Vec<(String, i64)> = sqlx::query_as(
        "SELECT action || ':' || status, count(*) FROM actions WHERE at > now() - interval '1 hour' GROUP BY 1",
    )
    .fetch_all(db)
    .await?;
    out.actions_by_outcome = by_outcome.into_iter().collect();
    out.recent_verdicts = sqlx::query_as(
        "SELECT verdict_id, incident_id, node, rule_id, severity, action, recovery, reason, issued_at
           FROM verdicts WHERE issued_at > now() - interval '1 hour' ORDER BY issued_at DESC LIMIT 20",
    )
    .fetch_all(db)
    .await?;
    out.recent_actions = sqlx::query_as(
        "SELECT a.verdict_id, v.incident_id, v.node, a.action, a.status, a.detail, a.at
           FROM actions a JOIN verdicts v USING (verdict_id)
          WHERE a.at > now() - interval '1 hour' ORDER BY a.at DESC LIMIT 20",
    )
    .fetch_all(db)
    .await?;
    Ok(out)
}

/// A node's open incidents in short.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq, Eq)]
pub struct OpenIncidents {
    /// How many.
    pub count: i64,
    /// The highest severity among them.
    pub worst: Option<String>,
    /// Their rules.
    pub rules: Vec<String>,
}

/// The open incidents of each of `nodes` that has any.
pub async fn open_incidents(db: &PgPool, nodes: &[String]) -> Result<BTreeMap<String, OpenIncidents>, sqlx::Error> {
    if nodes.is_empty() {
        return Ok(BTreeMap::new());
    }
    let rows: Vec<(String, i64, Option<String>, Vec<String>)> = sqlx::query_as(
        "SELECT node, count(*),
                (array_agg(severity ORDER BY CASE severity WHEN 'critical' THEN 0 WHEN 'warning' THEN 1 ELSE 2 END))[1],
                array_agg(DISTINCT rule_id)
           FROM incidents WHERE resolved_at IS NULL AND node = ANY($1) GROUP BY node",
    )
    .bind(nodes)
    .fetch_all(db)
    .await?;
    Ok(rows.into_iter().map(|(node, count, worst, rules)| (node, OpenIncidents { count, worst, rules })).collect())
}

/// The nodes with an open incident of `rule`.
pub async fn nodes_with_open_rule(db: &PgPool, rule: &str) -> Result<BTreeSet<String>, sqlx::Error> {
    let rows: Vec<(String,)> =
        sqlx::query_as("SELECT DISTINCT node FROM incidents WHERE resolved_at IS NULL AND rule_id = $1")
            .bind(rule)
            .fetch_all(db)
            .await?;
    Ok(rows.into_iter().map(|(n,)| n).collect())
}

/// The rules of every open incident, for the rule filter's choices.
pub async fn open_rules(db: &PgPool) -> Result<Vec<String>, sqlx::Error> {
    let rows: Vec<(String,)> =
        sqlx::query_as("SELECT DISTINCT rule_id FROM incidents WHERE resolved_at IS NULL ORDER BY 1 LIMIT 200")
            .fetch_all(db)
            .await?;
    Ok(rows.into_iter().map(|(r,)| r).collect())
}

/// A position in a list of incidents newest first: opened at, then id.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct IncidentCursor {
    /// Opened at (microseconds since the epoch).
    pub opened_at_micros: i64,
    /// The incident id.
    pub id: Uuid,
}

impl IncidentCursor {
    /// The cursor after `incident`.
    pub fn after(incident: &Incident) -> IncidentCursor {
        IncidentCursor { opened_at_micros: incident.opened_at.timestamp_micros(), id: incident.incident_id }
    }

    /// The opaque form handed out.
    pub fn encode(&self) -> String {
        encode_cursor(&format!("{}/{}", self.opened_at_micros, self.id))
    }

    /// Reads an opaque cursor; the error is for the caller.
    pub fn decode(cursor: &str) -> Result<IncidentCursor, String> {
        let text = decode_cursor(cursor)?;
        let bad = || format!("cursor: '{cursor}' is not a cursor this API gave out");
        let (micros, id) = text.split_once('/').ok_or_else(bad)?;
        Ok(IncidentCursor { opened_at_micros: micros.parse().map_err(|_| bad())?, id: id.parse().map_err(|_| bad())? })
    }

    fn opened_at(&self) -> Option<DateTime<Utc>> {
        DateTime::from_timestamp_micros(self.opened_at_micros)
    }
}

/// A validated incident list query.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct IncidentQuery {
    /// Exact node.
    pub node: Option<String>,
    /// `Some(true)`: open only; `Some(false)`: resolved only.
    pub open: Option<bool>,
    /// Exact rule.
    pub rule: Option<String>,
    /// Exact severity.
    pub severity: Option<String>,
    /// Incidents after this position.
    pub after: Option<IncidentCursor>,
    /// At most this many.
    pub limit: usize,
}

/// Raw incident list parameters, as received.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct IncidentParams {
    node: Option<String>,
    status: Option<String>,
    rule: Option<String>,
    severity: Option<String>,
    cursor: Option<String>,
    limit: Option<String>,
}

impl IncidentQuery {
    /// Validates raw parameters; the error names the parameter and what is wrong.
    pub fn parse(p: IncidentParams) -> Result<IncidentQuery, String> {
        let blank = |v: Option<String>| v.map(|s| s.trim().to_owned()).filter(|s| !s.is_empty());
        let open = match blank(p.status).as_deref() {
            None => None,
            Some("open") => Some(true),
            Some("resolved") => Some(false),
            Some(other) => return Err(format!("status: '{other}' is not open or resolved")),
        };
        let severity = blank(p.severity);
        if let Some(s) = &severity
            && !["info", "warning", "critical"].contains(&s.as_str())
        {
            return Err(format!("severity: '{s}' is not info, warning or critical"));
        }
        let (node, rule) = (blank(p.node), blank(p.rule));
        for (name, v) in [("node", &node), ("rule", &rule)] {
            if v.as_ref().is_some_and(|v| v.len() > 253) {
                return Err(format!("{name}: must be at most 253 characters"));
            }
        }
        Ok(IncidentQuery {
            node,
            open,
            rule,
            severity,
            after: blank(p.cursor).map(|c| IncidentCursor::decode(&c)).transpose()?,
            limit: crate::fleet::parse_limit(p.limit, 50, 500)?,
        })
    }
}

/// A page of incidents, newest first.
#[derive(Debug, Serialize, Deserialize, PartialEq)]
pub struct IncidentPage {
    /// The incidents.
    pub items: Vec<Incident>,
    /// Pass as `cursor` for the next page; absent on the last.
    pub next_cursor: Option<String>,
}

/// The page of incidents `q` asks for.
pub async fn incidents(db: &PgPool, q: &IncidentQuery) -> Result<IncidentPage, sqlx::Error> {
    let (after_at, after_id) = match &q.after {
        Some(c) => (c.opened_at(), Some(c.id)),
        None => (None, None),
    };
    let limit = i64::try_from(q.limit).unwrap_or(500);
    let mut items = sqlx::query_as::<_, Incident>(
        "SELECT incident_id, node, gpu_uuid AS gpu, rule_id, severity, opened_at, resolved_at, summary
           FROM incidents
          WHERE ($1::text IS NULL OR node = $1)
            AND ($2::bool IS NULL OR (resolved_at IS NULL) = $2)
            AND ($3::text IS NULL OR rule_id = $3)
            AND ($4::text IS NULL OR severity = $4)
            AND ($5::timestamptz IS NULL OR (opened_at, incident_id) < ($5, $6))
          ORDER BY opened_at DESC, incident_id DESC
          LIMIT $7",
    )
    .bind(&q.node)
    .bind(q.open)
    .bind(&q.rule)
    .bind(&q.severity)
    .bind(after_at)
    .bind(after_id)
    .bind(limit + 1)
    .fetch_all(db)
    .await?;
    let more = items.len() > q.limit;
    items.truncate(q.limit);
    let next_cursor = if more { items.last().map(|i| IncidentCursor::after(i).encode()) } else { None };
    Ok(IncidentPage { items, next_cursor })
}

/// The latest action outcomes on `node`, newest first.
pub async fn node_actions(db: &PgPool, node: &str, limit: i64) -> Result<Vec<RecentAction>, sqlx::Error> {
    sqlx::query_as(
        "SELECT a.verdict_id, v.incident_id, v.node, a.action, a.status, a.detail, a.at
           FROM actions a JOIN verdicts v USING (verdict_id)
          WHERE v.incident_id IN (SELECT incident_id FROM incidents WHERE node = $1)
          ORDER BY a.at DESC LIMIT $2",
    )
    .bind(node)
    .bind(limit)
    .fetch_all(db)
    .await
}

/// One GPU of a node's inventory.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq, Eq)]
pub struct Gpu {
    /// NVML index.
    pub index: Option<i64>,
    /// UUID.
    pub uuid: Option<String>,
    /// PCI bus id.
    pub pci_bus_id: Option<String>,
    /// Board serial.
    pub serial: Option<String>,
    /// Product name.
    pub product: Option<String>,
}

/// A node's latest GPU inventory, as its collector published it.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct Inventory {
    /// When it was observed.
    pub observed_at: DateTime<Utc>,
    /// GPUs the collector expects on the node.
    pub expected: Option<i64>,
    /// The GPUs present.
    pub gpus: Vec<Gpu>,
}

/// The GPUs of one inventory record's JSON (`record.event.detail.gpu_inventory`).
pub fn inventory_gpus(detail: &serde_json::Value) -> Vec<Gpu> {
    let text = |v: &serde_json::Value| v.as_str().map(str::to_owned);
    detail["gpus"]
        .as_array()
        .map(|gpus| {
            gpus.iter()
                .map(|g| Gpu {
                    index: g["index"].as_i64(),
                    uuid: text(&g["uuid"]),
                    pci_bus_id: text(&g["pci_bus_id"]),
                    serial: text(&g["serial"]),
                    product: text(&g["product"]),
                })
                .collect()
        })
        .unwrap_or_default()
}

/// The latest GPU inventory of `node` within the event retention, if any.
pub async fn inventory(db: &PgPool, node: &str) -> Result<Option<Inventory>, sqlx::Error> {
    let row: Option<(DateTime<Utc>, Option<serde_json::Value>)> = sqlx::query_as(
        "SELECT observed_at, (record->'event'->'detail'->'gpu_inventory')::jsonb FROM health_events
          WHERE node = $1 AND kind = 'gpu_inventory' ORDER BY observed_at DESC LIMIT 1",
    )
    .bind(node)
    .fetch_optional(db)
    .await?;
    Ok(row.map(|(observed_at, detail)| {
        let detail = detail.unwrap_or_default();
        Inventory { observed_at, expected: detail["expected"].as_i64(), gpus: inventory_gpus(&detail) }
    }))
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    #[test]
    fn incident_cursors_round_trip_and_refuse_others() {
        let c = IncidentCursor { opened_at_micros: 1_764_000_000_123_456, id: Uuid::new_v4() };
        assert_eq!(IncidentCursor::decode(&c.encode()), Ok(c));
        assert!(IncidentCursor::decode(&encode_cursor("nonsense")).unwrap_err().starts_with("cursor"));
    }

    #[test]
    fn incident_queries_are_validated() {
        let p = |v: serde_json::Value| IncidentQuery::parse(serde_json::from_value(v).unwrap());
        assert_eq!(p(json!({ "status": "open" })).unwrap().open, Some(true));
        assert_eq!(p(json!({})).unwrap().limit, 50);
        assert!(p(json!({ "status": "closed" })).unwrap_err().starts_with("status"));
        assert!(p(json!({ "severity": "fatal" })).unwrap_err().starts_with("severity"));
        assert!(p(json!({ "limit": "501" })).unwrap_err().starts_with("limit"));
    }

    #[test]
    fn an_inventory_lists_each_gpu_by_every_name() {
        let d = json!({ "gpus": [
            { "index": 0, "uuid": "GPU-a", "pci_bus_id": "0000:17:00.0", "serial": "S1", "product": "H100" },
            { "index": 1, "uuid": null }
        ], "expected": 8 });
        let gpus = inventory_gpus(&d);
        assert_eq!(gpus.len(), 2);
        assert_eq!(gpus[0].pci_bus_id.as_deref(), Some("0000:17:00.0"));
        assert_eq!(gpus[1], Gpu { index: Some(1), ..Gpu::default() });
    }
}
