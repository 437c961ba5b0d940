//! Fault injection: an HTTP endpoint on loopback (`--synthetic-addr`, off unless set) that makes
//! the collector publish an event of any kind, marked `synthetic` and from source `synthetic`,
//! about its own node. For demos and tests: no GPU is needed to see the whole pipeline act.
//!
//! It can cordon nodes, so it is off by default, config validation refuses any address that is
//! not loopback, and the classifier ignores synthetic events unless its own `--allow-synthetic`
//! says otherwise.
//!
//! `POST /v1/inject` with a JSON body; either the short form `gpumedic inject` takes
//! (`{"xid": 79}`, `{"gpu_lost": true}`, `{"healthy": true}`) or any detail in the shape of the
//! Avro record (`{"detail": {"row_remap": {"correctable": 0, "uncorrectable": 3, "pending":
//! true, "failure": false}}}`), plus optional `component`, `entity` (or the shortcuts
//! `gpu_uuid`, `gpu_index`, `pci_bus_id`), `healthy`, `raw` and `count` (1 to 1000). The answer
//! comes once the events are acknowledged by Kafka or durable in the spool:
//! `{"event_ids": ["..."]}`; a bad body gets 400 `{"error": "..."}`.

use std::net::SocketAddr;

use axum::Json;
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use gpumedic_schemas::HealthEvent;
use gpumedic_schemas::health::{
    Component, Detail, Entity, GpuLostDetail, MonitorHealthDetail, MonitorState, Source, XidDetail,
};
use serde::Deserialize;
use tokio_util::sync::CancellationToken;

use crate::publisher::{Outcome, Sink};

/// Most events one request may ask for.
pub const MAX_COUNT: u32 = 1000;

/// The body of `POST /v1/inject`.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct InjectRequest {
    /// An Xid code (short form).
    pub xid: Option<i32>,
    /// "GPU has fallen off the bus" (short form).
    #[serde(default)]
    pub gpu_lost: bool,
    /// Healthy evidence; alone, a `monitor_health` OK event (short form).
    #[serde(default)]
    pub healthy: bool,
    /// Any detail, in the Avro record's shape: one field named after the kind.
    pub detail: Option<Detail>,
    /// The component; `gpu` unless given.
    pub component: Option<Component>,
    /// The affected part.
    pub entity: Option<Entity>,
    /// Shortcut for `entity.gpu_uuid`.
    pub gpu_uuid: Option<String>,
    /// Shortcut for `entity.gpu_index`.
    pub gpu_index: Option<i32>,
    /// Shortcut for `entity.pci_bus_id`.
    pub pci_bus_id: Option<String>,
    /// The raw text to attach.
    pub raw: Option<String>,
    /// How many events (each distinct); 1 unless given.
    pub count: Option<u32>,
}

/// Builds the events a request describes, about `node`.
///
/// # Errors
/// Why the request is malformed, in a sentence.
pub fn events(request: InjectRequest, node: &str) -> Result<Vec<HealthEvent>, String> {
    let count = request.count.unwrap_or(1);
    if !(1..=MAX_COUNT).contains(&count) {
        return Err(format!("count: {count} is not between 1 and {MAX_COUNT}"));
    }
    let detail = match (request.xid, request.gpu_lost, request.detail) {
        (Some(_), true, _) | (Some(_), _, Some(_)) | (_, true, Some(_)) => {
            return Err("give one of xid, gpu_lost and detail".into());
        }
        (Some(code), false, None) if code > 0 => Detail::Xid(XidDetail {
            code,
            text: format!("synthetic Xid {code} injected through the collector"),
            pid: None,
            process: None,
            nvlink5: None,
            recovery_action: None,
        }),
        (Some(code), false, None) => return Err(format!("xid: {code} is not an Xid code")),
        (None, true, None) => Detail::GpuLost(GpuLostDetail { reason: "synthetic: GPU has fallen off the bus".into() }),
        (None, false, Some(Detail::Absent)) => {
            return Err("detail: name one kind, e.g. {\"xid\": {\"code\": 79, \"text\": \"...\"}}".into());
        }
        (None, false, Some(detail)) => detail,
        (None, false, None) if request.healthy => Detail::MonitorHealth(MonitorHealthDetail {
            monitor: "synthetic".into(),
            state: MonitorState::Ok,
            message: Some("GPU answers normally".into()),
        }),
        (None, false, None) => return Err("say what to inject: xid, gpu_lost, healthy or detail".into()),
    };
    if (request.xid.is_some() || request.gpu_lost) && request.healthy {
        return Err("healthy: an Xid or a lost GPU is not healthy evidence".into());
    }
    let mut entity = request.entity.unwrap_or_default();
    entity.gpu_uuid = request.gpu_uuid.or(entity.gpu_uuid);
    entity.gpu_index = request.gpu_index.or(entity.gpu_index);
    entity.pci_bus_id = request.pci_bus_id.or(entity.pci_bus_id);
    if entity.gpu_index.is_some_and(|i| i < 0) {
        return Err("gpu_index: must not be negative".into());
    }
    let component = request.component.unwrap_or(Component::Gpu);
    if component == Component::Unknown {
        return Err("component: name a component".into());
    }
    Ok((0..count)
        .map(|_| {
            let mut e = HealthEvent::new(node, Source::Synthetic, component, entity.clone(), detail.clone());
            e.synthetic = true;
            e.healthy = request.healthy;
            e.raw.clone_from(&request.raw);
            e
        })
        .collect())
}

#[derive(Clone)]
struct Endpoint {
    node: String,
    sink: Sink,
}

fn error(status: StatusCode, message: impl Into<String>) -> Response {
    (status, Json(serde_json::json!({ "error": message.into() }))).into_response()
}

async fn inject(State(endpoint): State<Endpoint>, body: axum::body::Bytes) -> Response {
    let request: InjectRequest = match serde_json::from_slice(&body) {
        Ok(r) => r,
        Err(e) => return error(StatusCode::BAD_REQUEST, format!("the body is not an inject request: {e}")),
    };
    let events = match events(request, &endpoint.node) {
        Ok(events) => events,
        Err(message) => return error(StatusCode::BAD_REQUEST, message),
    };
    let mut pending = Vec::with_capacity(events.len());
    for e in &events {
        match endpoint.sink.submit(e).await {
            Ok(outcome) => pending.push((e.event_id, outcome)),
            Err(e) => return error(StatusCode::SERVICE_UNAVAILABLE, e.to_string()),
        }
    }
    let mut ids = Vec::with_capacity(pending.len());
    for (id, outcome) in pending {
        match outcome.await {
            Ok(Outcome::Published | Outcome::Spooled) => ids.push(id.to_string()),
            Ok(Outcome::Dropped) => {
                return error(
                    StatusCode::SERVICE_UNAVAILABLE,
                    "the spool is full of faults; healthy evidence was dropped",
                );
            }
            Err(_) => return error(StatusCode::SERVICE_UNAVAILABLE, "the collector is shutting down"),
        }
    }
    metrics::counter!("gpumedic_collector_synthetic_events_total").increment(ids.len() as u64);
    tracing::info!(events = ids.len(), "Published synthetic events on request.");
    (StatusCode::OK, Json(serde_json::json!({ "event_ids": ids }))).into_response()
}

/// The endpoint's routes, for tests and [`serve`].
pub fn router(node: String, sink: Sink) -> axum::Router {
    axum::Router::new().route("/v1/inject", axum::routing::post(inject)).with_state(Endpoint { node, sink })
}

/// Serves the endpoint on `addr` (loopback, checked by the config) until `token` is cancelled.
///
/// # Errors
/// When the address cannot be bound or serving fails.
pub async fn serve(addr: SocketAddr, node: String, sink: Sink, token: CancellationToken) -> std::io::Result<()> {
    let listener = tokio::net::TcpListener::bind(addr).await?;
    tracing::warn!(%addr, "Fault injection is enabled: POST /v1/inject publishes synthetic events for this node.");
    axum::serve(listener, router(node, sink)).with_graceful_shutdown(token.cancelled_owned()).await
}

#[cfg(test)]
mod tests {
    use super::*;
    use gpumedic_schemas::Kind;

    fn parse(json: &str) -> Result<Vec<HealthEvent>, String> {
        events(serde_json::from_str(json).map_err(|e| e.to_string())?, "node-1")
    }

    #[test]
    fn short_forms_match_gpumedic_inject() {
        let xid = parse(r#"{"xid": 79, "gpu_index": 2, "count": 3}"#).unwrap();
        assert_eq!(xid.len(), 3);
        assert!(xid.iter().all(|e| e.synthetic && e.source == Source::Synthetic && e.node == "node-1"));
        assert_eq!(xid[0].entity.gpu_index, Some(2));
        assert_ne!(xid[0].event_id, xid[1].event_id);
        assert_eq!(parse(r#"{"gpu_lost": true}"#).unwrap()[0].kind, Kind::GpuLost);
        let healthy = parse(r#"{"healthy": true}"#).unwrap();
        assert!(healthy[0].healthy && healthy[0].kind == Kind::MonitorHealth);
    }

    #[test]
    fn any_kind_through_detail() {
        let e = parse(
            r#"{"detail": {"row_remap": {"correctable": 0, "uncorrectable": 3, "pending": true, "failure": false}},
                "component": "memory", "entity": {"gpu_uuid": "GPU-1"}}"#,
        )
        .unwrap();
        assert_eq!(e[0].kind, Kind::RowRemap);
        assert_eq!(e[0].component, Component::Memory);
        assert_eq!(e[0].entity.gpu_uuid.as_deref(), Some("GPU-1"));
    }

    #[test]
    fn malformed_requests_say_why() {
        for (body, want) in [
            ("{}", "say what to inject"),
            (r#"{"xid": 0}"#, "xid"),
            (r#"{"xid": 79, "gpu_lost": true}"#, "one of"),
            (r#"{"xid": 79, "healthy": true}"#, "healthy"),
            (r#"{"detail": {}}"#, "detail"),
            (r#"{"xid": 79, "count": 0}"#, "count"),
            (r#"{"xid": 79, "node": "other"}"#, "unknown field"),
        ] {
            let err = parse(body).expect_err(body);
            assert!(err.contains(want), "{body}: {err}");
        }
    }
}
