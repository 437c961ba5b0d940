//! The incident history API, served read-only on the classifier's admin port.
//!
//! - `GET /api/v1/incidents?node=&status=open|resolved&severity=&rule=&since=&until=&limit=`
//! - `GET /api/v1/incidents/{id}`: the incident with its verdicts, their evidence events, the
//!   sympathetic errors of its NVLink peers it stands for, and the remediator's actions.
//! - `GET /api/v1/lemons?status=open|resolved`: the nodes and GPUs declared lemons (the `lemons`
//!   view, docs/incident-history.md), newest first, each with its hardware-class history.
//!
//! Every input is validated (a bad filter is a 400 with the reason) and every query is
//! parameterised; database failures are a 503 without internal detail (it goes to the log).
//! Each route is guarded by [`auth::require`]: a bearer token allowed to `list` (the list) or
//! `get` (one incident) `incidents.gpumedic.io`, unless `--api-auth none`.

use std::sync::{Arc, OnceLock};

use axum::Json;
use axum::Router;
use axum::extract::{Path, Query, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};
use sqlx::PgPool;
use uuid::Uuid;

use crate::auth::{self, Access, Verb};

/// The pool, set once the database is reachable; until then the API answers 503.
pub type SharedPool = Arc<OnceLock<PgPool>>;

/// The API's routes, each guarded by `access` for its verb.
pub fn routes(pool: SharedPool, access: Access) -> Router {
    let guard = |verb| axum::middleware::from_fn_with_state((access.clone(), verb), auth::require);
    Router::new()
        .route("/api/v1/incidents", get(list).route_layer(guard(Verb::List)))
        .route("/api/v1/incidents/{id}", get(one).route_layer(guard(Verb::Get)))
        .route("/api/v1/lemons", get(lemons).route_layer(guard(Verb::List)))
        .with_state(pool)
}

/// An error answer: status and a reason for the caller.
#[derive(Debug)]
pub struct ApiError(StatusCode, String);

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        (self.0, Json(serde_json::json!({ "error": self.1 }))).into_response()
    }
}

fn bad(reason: impl Into<String>) -> ApiError {
    ApiError(StatusCode::BAD_REQUEST, reason.into())
}

fn unavailable(e: &sqlx::Error) -> ApiError {
    tracing::warn!(error = %e, "Incident query failed.");
    ApiError(StatusCode::SERVICE_UNAVAILABLE, "the incident database is unavailable".into())
}

fn pool(p: &SharedPool) -> Result<&PgPool, ApiError> {
    p.get().ok_or_else(|| ApiError(StatusCode::SERVICE_UNAVAILABLE, "the incident database is not ready yet".into()))
}

/// Query parameters of the list, as received (validated by [`Filter::parse`]).
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ListParams {
    node: Option<String>,
    status: Option<String>,
    severity: Option<String>,
    rule: Option<String>,
    since: Option<String>,
    until: Option<String>,
    limit: Option<String>,
}

/// A validated list filter.
#[derive(Debug, Clone, PartialEq)]
pub struct Filter {
    /// Exact node name.
    pub node: Option<String>,
    /// `Some(true)`: open only; `Some(false)`: resolved only.
    pub open: Option<bool>,
    /// Exact severity.
    pub severity: Option<String>,
    /// Exact rule id.
    pub rule: Option<String>,
    /// Opened at or after.
    pub since: Option<DateTime<Utc>>,
    /// Opened before.
    pub until: Option<DateTime<Utc>>,
    /// At most this many, newest first.
    pub limit: i64,
}

impl Filter {
    /// Validates raw parameters; the error names the parameter and what is wrong.
    pub fn parse(p: ListParams) -> Result<Filter, String> {
        let time = |name: &str, v: Option<String>| -> Result<Option<DateTime<Utc>>, String> {
            v.map(|s| {
                DateTime::parse_from_rfc3339(&s)
                    .map(|t| t.with_timezone(&Utc))
                    .map_err(|_| format!("{name}: '{s}' is not an RFC 3339 time such as 2026-11-30T00:00:00Z"))
            })
            .transpose()
        };
        let open = match p.status.as_deref() {
            None => None,
            Some("open") => Some(true),
            Some("resolved") => Some(false),
            Some(other) => return Err(format!("status: '{other}' is not open or resolved")),
        };
        if let Some(s) = &p.severity
            && !["info", "warning", "critical"].contains(&s.as_str())
        {
            return Err(format!("severity: '{s}' is not info, warning or critical"));
        }
        for (name, v) in [("node", &p.node), ("rule", &p.rule)] {
            if v.as_ref().is_some_and(|v| v.is_empty() || v.len() > 253) {
                return Err(format!("{name}: must be 1 to 253 characters"));
            }
        }
        let limit = match p.limit {
            None => 100,
            Some(l) => match l.parse::<i64>() {
                Ok(n) if (1..=1000).contains(&n) => n,
                _ => return Err(format!("limit: '{l}' is not a number from 1 to 1000")),
            },
        };
        let since = time("since", p.since)?;
        let until = time("until", p.until)?;
        if let (Some(s), Some(u)) = (since, until)
            && s > u
        {
            return Err("since: must not be after until".into());
        }
        Ok(Filter { node: p.node, open, severity: p.severity, rule: p.rule, since, until, limit })
    }
}

/// One incident as the API shows it.
#[derive(Debug, Serialize, Deserialize, sqlx::FromRow, PartialEq)]
pub struct Incident {
    /// Its id.
    pub incident_id: Uuid,
    /// The node.
    pub node: String,
    /// The GPU, when the incident is about one.
    pub gpu: Option<String>,
    /// The rule that opened it.
    pub rule_id: String,
    /// Its severity.
    pub severity: String,
    /// When it opened.
    pub opened_at: DateTime<Utc>,
    /// When it was resolved, if it was.
    pub resolved_at: Option<DateTime<Utc>>,
    /// Why, for humans.
    pub summary: String,
}

async fn list(
    State(p): State<SharedPool>,
    params: Result<Query<ListParams>, axum::extract::rejection::QueryRejection>,
) -> Result<Json<Vec<Incident>>, ApiError> {
    let Query(params) = params.map_err(|e| bad(e.body_text()))?;
    let f = Filter::parse(params).map_err(bad)?;
    let rows = sqlx::query_as::<_, Incident>(
        "SELECT incident_id, node, gpu_uuid AS gpu, rule_id, severity, opened_at, resolved_at, summary
           FROM incidents
          WHERE ($1::text IS NULL OR node = $1)
            AND ($2::bool IS NULL OR (resolved_at IS NULL) = $2)
            AND ($3::text IS NULL OR severity = $3)
            AND ($4::text IS NULL OR rule_id = $4)
            AND ($5::timestamptz IS NULL OR opened_at >= $5)
            AND ($6::timestamptz IS NULL OR opened_at < $6)
          ORDER BY opened_at DESC
          LIMIT $7",
    )
    .bind(&f.node)
    .bind(f.open)
    .bind(&f.severity)
    .bind(&f.rule)
    .bind(f.since)
    .bind(f.until)
    .bind(f.limit)
    .fetch_all(pool(&p)?)
    .await
    .map_err(|e| unavailable(&e))?;
    Ok(Json(rows))
}

/// A verdict of an incident, with what was done about it.
#[derive(Debug, Serialize, Deserialize, sqlx::FromRow, PartialEq)]
pub struct VerdictRow {
    /// Its id.
    pub verdict_id: Uuid,
    /// Recommended action.
    pub action: String,
    /// Severity.
    pub severity: String,
    /// Why.
    pub reason: String,
    /// A recovery verdict.
    pub recovery: bool,
    /// Evidence event ids.
    pub evidence: Vec<Uuid>,
    /// When it was issued.
    pub issued_at: DateTime<Utc>,
    /// The trace id of its record (null before migration 0010, or when written outside a batch).
    #[serde(default)]
    pub trace_id: Option<String>,
}

/// What the remediator did.
#[derive(Debug, Serialize, Deserialize, sqlx::FromRow, PartialEq)]
pub struct ActionRow {
    /// The verdict it answers.
    pub verdict_id: Uuid,
    /// The action.
    pub action: String,
    /// Its status.
    pub status: String,
    /// What happened.
    pub detail: String,
    /// When.
    pub at: DateTime<Utc>,
}

/// An evidence event.
#[derive(Debug, Serialize, Deserialize, sqlx::FromRow, PartialEq)]
pub struct EventRow {
    /// Its id.
    pub event_id: Uuid,
    /// When it was observed.
    pub observed_at: DateTime<Utc>,
    /// Its source.
    pub source: String,
    /// Its kind.
    pub kind: String,
    /// The Xid, for Xid events.
    pub xid: Option<i32>,
    /// Healthy evidence.
    pub healthy: bool,
    /// Injected.
    pub synthetic: bool,
}

/// A sympathetic error of an NVLink peer (on this node or another of the domain), recorded as
/// evidence on the root incident instead of an incident of its own.
#[derive(Debug, Serialize, Deserialize, sqlx::FromRow, PartialEq)]
pub struct PeerRow {
    /// The peer's event.
    pub event_id: Uuid,
    /// The peer's node.
    pub node: String,
    /// The peer's GPU.
    pub gpu: Option<String>,
    /// When it counted.
    pub at: DateTime<Utc>,
}

/// One incident with its story.
#[derive(Debug, Serialize, Deserialize, PartialEq)]
pub struct IncidentDetail {
    /// The incident.
    #[serde(flatten)]
    pub incident: Incident,
    /// Its verdicts, oldest first.
    pub verdicts: Vec<VerdictRow>,
    /// The events its verdicts cite.
    pub events: Vec<EventRow>,
    /// What the remediator did about its verdicts.
    pub actions: Vec<ActionRow>,
    /// The sympathetic errors of its NVLink peers, oldest first.
    #[serde(default)]
    pub peers: Vec<PeerRow>,
}

async fn one(State(p): State<SharedPool>, Path(id): Path<String>) -> Result<Json<IncidentDetail>, ApiError> {
    let id: Uuid = id.parse().map_err(|_| bad(format!("id: '{id}' is not a UUID")))?;
    let db = pool(&p)?;
    incident_detail(db, id)
        .await
        .map_err(|e| unavailable(&e))?
        .map(Json)
        .ok_or_else(|| ApiError(StatusCode::NOT_FOUND, format!("no incident {id}")))
}

/// One incident with its story (verdicts, evidence events, actions, NVLink peers); `None` when
/// there is no such incident. Shared with the console, which tells the same story.
pub async fn incident_detail(db: &PgPool, id: Uuid) -> Result<Option<IncidentDetail>, sqlx::Error> {
    let Some(incident) = sqlx::query_as::<_, Incident>(
        "SELECT incident_id, node, gpu_uuid AS gpu, rule_id, severity, opened_at, resolved_at, summary
           FROM incidents WHERE incident_id = $1",
    )
    .bind(id)
    .fetch_optional(db)
    .await?
    else {
        return Ok(None);
    };
    let verdicts = sqlx::query_as::<_, VerdictRow>(
        "SELECT verdict_id, action, severity, reason, recovery, evidence, issued_at, trace_id
           FROM verdicts WHERE incident_id = $1 ORDER BY issued_at, verdict_id",
    )
    .bind(id)
    .fetch_all(db)
    .await?;
    let events = sqlx::query_as::<_, EventRow>(
        "SELECT event_id, observed_at, source, kind, xid, healthy, synthetic FROM health_events
          WHERE event_id IN (SELECT unnest(evidence) FROM verdicts WHERE incident_id = $1)
          ORDER BY observed_at",
    )
    .bind(id)
    .fetch_all(db)
    .await?;
    let actions = sqlx::query_as::<_, ActionRow>(
        "SELECT a.verdict_id, a.action, a.status, a.detail, a.at FROM actions a
           JOIN verdicts v USING (verdict_id) WHERE v.incident_id = $1 ORDER BY a.at",
    )
    .bind(id)
    .fetch_all(db)
    .await?;
    let peers = sqlx::query_as::<_, PeerRow>(
        "SELECT event_id, node, gpu_uuid AS gpu, at FROM sympathetic_evidence WHERE incident_id = $1
          ORDER BY at, event_id LIMIT 1000",
    )
    .bind(id)
    .fetch_all(db)
    .await?;
    Ok(Some(IncidentDetail { incident, verdicts, events, actions, peers }))
}

/// Query parameters of the lemon list.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LemonParams {
    status: Option<String>,
}

/// A node or GPU declared a lemon, with its hardware-class history (the `lemons` view).
#[derive(Debug, Serialize, Deserialize, sqlx::FromRow, PartialEq)]
pub struct Lemon {
    /// The lemon incident.
    pub incident_id: Uuid,
    /// `gpu` or `node`.
    pub part: String,
    /// The node it was declared on.
    pub node: String,
    /// The GPU, for a GPU lemon.
    pub gpu: Option<String>,
    /// When it was declared.
    pub declared_at: DateTime<Utc>,
    /// When the incident was closed (the part replaced); `None` while the part is held out.
    pub resolved_at: Option<DateTime<Utc>>,
    /// Why, with the incidents that made it one.
    pub reason: String,
    /// The part's hardware-class incidents in the 30 days before it was declared.
    pub hardware_incidents: i64,
    /// Those incidents (id, node, GPU, rule, opened and resolved), oldest first.
    pub history: serde_json::Value,
}

async fn lemons(
    State(p): State<SharedPool>,
    params: Result<Query<LemonParams>, axum::extract::rejection::QueryRejection>,
) -> Result<Json<Vec<Lemon>>, ApiError> {
    let Query(params) = params.map_err(|e| bad(e.body_text()))?;
    let open = match params.status.as_deref() {
        None => None,
        Some("open") => Some(true),
        Some("resolved") => Some(false),
        Some(other) => return Err(bad(format!("status: '{other}' is not open or resolved"))),
    };
    let rows = sqlx::query_as::<_, Lemon>(
        "SELECT incident_id, part, node, gpu_uuid AS gpu, declared_at, resolved_at, reason, hardware_incidents,
                history::jsonb AS history
           FROM lemons
          WHERE ($1::bool IS NULL OR open = $1)
          ORDER BY declared_at DESC
          LIMIT 1000",
    )
    .bind(open)
    .fetch_all(pool(&p)?)
    .await
    .map_err(|e| unavailable(&e))?;
    Ok(Json(rows))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn params(pairs: &[(&str, &str)]) -> ListParams {
        let q: String = pairs.iter().map(|(k, v)| format!("{k}={v}")).collect::<Vec<_>>().join("&");
        serde_urlencoded_like(&q)
    }

    // Axum's Query uses serde_urlencoded; building the struct through serde_json keeps the test
    // free of another dependency.
    fn serde_urlencoded_like(q: &str) -> ListParams {
        let map: serde_json::Map<String, serde_json::Value> = q
            .split('&')
            .filter(|kv| !kv.is_empty())
            .filter_map(|kv| kv.split_once('='))
            .map(|(k, v)| (k.to_owned(), serde_json::Value::String(v.to_owned())))
            .collect();
        serde_json::from_value(serde_json::Value::Object(map)).expect("known keys")
    }

    #[test]
    fn filters_validate_every_parameter() {
        let f = Filter::parse(params(&[("node", "gpu-1"), ("status", "open"), ("limit", "5")])).unwrap();
        assert_eq!((f.node.as_deref(), f.open, f.limit), (Some("gpu-1"), Some(true), 5));
        assert_eq!(Filter::parse(params(&[])).unwrap().limit, 100);
        for (k, v, needle) in [
            ("status", "closed", "status"),
            ("severity", "fatal", "severity"),
            ("limit", "0", "limit"),
            ("limit", "lots", "limit"),
            ("since", "yesterday", "since"),
        ] {
            let e = Filter::parse(params(&[(k, v)])).unwrap_err();
            assert!(e.starts_with(needle), "{e}");
        }
        let e =
            Filter::parse(params(&[("since", "2026-12-01T00:00:00Z"), ("until", "2026-11-01T00:00:00Z")])).unwrap_err();
        assert!(e.contains("after"), "{e}");
    }
}
