//! The JSON API under `/api/v1/` (documented in `docs/api.md`) and the routes of every view.
//!
//! Every route, pages included, is guarded by [`api_auth::require`] as the incident API is: a
//! bearer token whose user may `list` (the fleet, lists, the live stream) or `get` (one node, one
//! incident) `incidents.gpumedic.io`, unless `--api-auth none`. Bad parameters are a 400 with the
//! reason; an unready cache or database a 503 without internal detail (it goes to the log).

use std::sync::Arc;

use axum::Json;
use axum::Router;
use axum::extract::rejection::QueryRejection;
use axum::extract::{Path, Query, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use gpumedic_classifier::api::IncidentDetail;
use gpumedic_runtime::api_auth::{self, Access, Verb};
use serde::Deserialize;
use uuid::Uuid;

use crate::fleet::{NodeParams, NodeQuery};
use crate::pages;
use crate::store::{IncidentPage, IncidentParams, IncidentQuery};
use crate::view::{self, Console, FleetView, NodeView, NodesView, ViewError};

/// Every route of the console, each guarded by `access` for its verb.
pub fn routes(console: Arc<Console>, access: Access) -> Router {
    let guard = |verb| axum::middleware::from_fn_with_state((access.clone(), verb), api_auth::require);
    Router::new()
        .route("/", get(pages::fleet).route_layer(guard(Verb::List)))
        .route("/nodes", get(pages::nodes).route_layer(guard(Verb::List)))
        .route("/nodes/{name}", get(pages::node).route_layer(guard(Verb::Get)))
        .route("/incidents/{id}", get(pages::incident).route_layer(guard(Verb::Get)))
        .route("/api/v1/fleet", get(fleet).route_layer(guard(Verb::List)))
        .route("/api/v1/nodes", get(nodes).route_layer(guard(Verb::List)))
        .route("/api/v1/nodes/{name}", get(node).route_layer(guard(Verb::Get)))
        .route("/api/v1/incidents", get(incidents).route_layer(guard(Verb::List)))
        .route("/api/v1/incidents/{id}", get(incident).route_layer(guard(Verb::Get)))
        .route("/api/v1/live", get(live).route_layer(guard(Verb::List)))
        .with_state(console)
}

/// An error answer: status and a reason for the caller.
#[derive(Debug)]
pub struct ApiError(pub StatusCode, pub String);

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        (self.0, Json(serde_json::json!({ "error": self.1 }))).into_response()
    }
}

impl From<ViewError> for ApiError {
    fn from(e: ViewError) -> Self {
        let (status, reason) = unavailable(&e);
        ApiError(status, reason)
    }
}

/// The status and public reason of a view that cannot be shown; logs the detail.
pub fn unavailable(e: &ViewError) -> (StatusCode, String) {
    match e {
        ViewError::Database(_) => {
            tracing::warn!(error = %e, "A console query failed.");
            (StatusCode::SERVICE_UNAVAILABLE, "the incident database is unavailable".into())
        }
        other => (StatusCode::SERVICE_UNAVAILABLE, other.to_string()),
    }
}

fn bad(reason: impl Into<String>) -> ApiError {
    ApiError(StatusCode::BAD_REQUEST, reason.into())
}

/// `GET /api/v1/fleet`.
async fn fleet(State(c): State<Arc<Console>>) -> Result<Json<FleetView>, ApiError> {
    Ok(Json(view::fleet_view(&c).await?))
}

/// `GET /api/v1/nodes`.
async fn nodes(
    State(c): State<Arc<Console>>,
    params: Result<Query<NodeParams>, QueryRejection>,
) -> Result<Json<NodesView>, ApiError> {
    let Query(params) = params.map_err(|e| bad(e.body_text()))?;
    let q = NodeQuery::parse(params).map_err(bad)?;
    Ok(Json(view::nodes_view(&c, &q).await?))
}

/// Parameters of one node.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NodeDetailParams {
    /// A cursor into the node's past incidents.
    pub cursor: Option<String>,
}

/// `GET /api/v1/nodes/{name}`.
async fn node(
    State(c): State<Arc<Console>>,
    Path(name): Path<String>,
    params: Result<Query<NodeDetailParams>, QueryRejection>,
) -> Result<Json<NodeView>, ApiError> {
    let Query(params) = params.map_err(|e| bad(e.body_text()))?;
    if let Some(cursor) = &params.cursor {
        crate::store::IncidentCursor::decode(cursor).map_err(bad)?;
    }
    view::node_view(&c, &name, params.cursor)
        .await?
        .map(Json)
        .ok_or_else(|| ApiError(StatusCode::NOT_FOUND, format!("no GPU node {name}")))
}

/// `GET /api/v1/incidents`.
async fn incidents(
    State(c): State<Arc<Console>>,
    params: Result<Query<IncidentParams>, QueryRejection>,
) -> Result<Json<IncidentPage>, ApiError> {
    let Query(params) = params.map_err(|e| bad(e.body_text()))?;
    let q = IncidentQuery::parse(params).map_err(bad)?;
    Ok(Json(view::incidents_view(&c, &q).await?))
}

/// `GET /api/v1/incidents/{id}`.
async fn incident(State(c): State<Arc<Console>>, Path(id): Path<String>) -> Result<Json<IncidentDetail>, ApiError> {
    let id: Uuid = id.parse().map_err(|_| bad(format!("id: '{id}' is not a UUID")))?;
    view::incident_view(&c, id)
        .await?
        .map(Json)
        .ok_or_else(|| ApiError(StatusCode::NOT_FOUND, format!("no incident {id}")))
}

/// Parameters of the live stream.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LiveParams {
    /// Only this node's verdicts.
    pub node: Option<String>,
}

/// `GET /api/v1/live`: Server-Sent Events, one `verdict` event per verdict published.
async fn live(State(c): State<Arc<Console>>, params: Result<Query<LiveParams>, QueryRejection>) -> Response {
    match params {
        Ok(Query(p)) => c.live.events(p.node.filter(|n| !n.is_empty())).into_response(),
        Err(e) => bad(e.body_text()).into_response(),
    }
}
