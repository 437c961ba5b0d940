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
//!
//! Two requests act on the simulated GPU backend (`--gpu-backend simulated`) rather than publish
//! an event of their own, so that the pipeline sees the real mechanism, not a made-up event:
//! - `{"fall_off_bus": true, "gpu_index": N}`: simulated GPU N stops answering (NVML's lost GPU:
//!   no readings, no heartbeats, missing from the inventory published on the change), and the
//!   kernel-log line of an Xid 79 naming it by PCI bus id is published, synthetic and from source
//!   `synthetic` like every injected fault; the collector names the GPU fully from its inventory,
//!   as it does a real kernel-log Xid. Answers `{"event_ids": [...], "pci_bus_id": "..."}`.
//! - `{"reboot": true}`: the simulated node reboots: a new boot id on every later event, every GPU
//!   answering again with fresh counters, an inventory with reason `start`, heartbeats from every
//!   GPU. Answers `{"event_ids": [], "boot_id": "..."}`.
//!
//! With another backend both are refused (409): a real GPU falls off the bus on its own, and a
//! real node's reboot is a real reboot.

use std::net::SocketAddr;
use std::path::PathBuf;

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

use crate::events::names;
use crate::gpu::SimulatedControl;
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
    /// The simulated GPU `gpu_index` falls off the bus (simulated backend only).
    #[serde(default)]
    pub fall_off_bus: bool,
    /// The simulated node reboots (simulated backend only).
    #[serde(default)]
    pub reboot: bool,
}

/// What a request asks of the simulated node.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Simulation {
    /// This GPU (by index) falls off the bus.
    FallOffBus(u32),
    /// The node reboots.
    Reboot,
}

/// The simulated-node action `request` asks for, `None` when it asks for events instead.
///
/// # Errors
/// Why the request is malformed, in a sentence.
pub fn simulation(request: &InjectRequest) -> Result<Option<Simulation>, String> {
    if !request.fall_off_bus && !request.reboot {
        return Ok(None);
    }
    let other = request.xid.is_some()
        || request.gpu_lost
        || request.healthy
        || request.detail.is_some()
        || request.component.is_some()
        || request.entity.is_some()
        || request.gpu_uuid.is_some()
        || request.pci_bus_id.is_some()
        || request.raw.is_some()
        || request.count.is_some();
    match (request.fall_off_bus, request.reboot) {
        (true, true) => Err("give one of fall_off_bus and reboot".into()),
        _ if other => Err("fall_off_bus takes gpu_index alone, and reboot takes nothing else".into()),
        (true, false) => match request.gpu_index {
            Some(i) => u32::try_from(i)
                .map(|i| Some(Simulation::FallOffBus(i)))
                .map_err(|_| "gpu_index: must not be negative".to_owned()),
            None => Err("fall_off_bus: name the GPU with gpu_index".into()),
        },
        (false, _) if request.gpu_index.is_some() => Err("reboot: a reboot is of the whole node; no gpu_index".into()),
        (false, _) => Ok(Some(Simulation::Reboot)),
    }
}

/// The kernel-log line the driver writes when the GPU at `pci_bus_id` (`dddd:bb:dd.f`) falls off
/// the bus.
pub fn xid79_line(pci_bus_id: &str) -> String {
    // The driver names the GPU without the PCI function.
    let short = pci_bus_id.rsplit_once('.').map_or(pci_bus_id, |(main, _)| main);
    format!("NVRM: Xid (PCI:{short}): 79, pid='<unknown>', name=<unknown>, GPU has fallen off the bus.")
}

/// The event for [`xid79_line`]: shaped as the kernel-log source shapes it (the GPU named by PCI
/// bus id alone, the line in `raw`), marked synthetic and from source `synthetic`.
pub fn xid79_event(node: &str, pci_bus_id: &str) -> HealthEvent {
    let line = xid79_line(pci_bus_id);
    let parsed = crate::kernel_log::parse::parse_all(&line);
    let k = parsed.first().expect("the kernel-log parser reads the driver's own Xid 79 line");
    let mut e = crate::kernel_log::event::to_health_event(node, k, &line);
    e.source = Source::Synthetic;
    e.synthetic = true;
    e
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

/// The simulated node behind the endpoint, when the collector runs the simulated backend.
#[derive(Clone)]
pub struct SimulatedNode {
    /// Scripts the simulated GPUs.
    pub control: SimulatedControl,
    /// Where the simulated boot id is kept across restarts.
    pub state_dir: PathBuf,
    /// The host's own boot id, which the saved simulated one is tied to.
    pub host_boot_id: String,
}

#[derive(Clone)]
struct Endpoint {
    node: String,
    sink: Sink,
    simulated: Option<SimulatedNode>,
    simulating: std::sync::Arc<tokio::sync::Mutex<()>>,
}

fn error(status: StatusCode, message: impl Into<String>) -> Response {
    (status, Json(serde_json::json!({ "error": message.into() }))).into_response()
}

async fn inject(State(endpoint): State<Endpoint>, body: axum::body::Bytes) -> Response {
    let request: InjectRequest = match serde_json::from_slice(&body) {
        Ok(r) => r,
        Err(e) => return error(StatusCode::BAD_REQUEST, format!("the body is not an inject request: {e}")),
    };
    match simulation(&request) {
        Ok(Some(action)) => return simulate(&endpoint, action).await,
        Ok(None) => {}
        Err(message) => return error(StatusCode::BAD_REQUEST, message),
    }
    let events = match events(request, &endpoint.node) {
        Ok(events) => events,
        Err(message) => return error(StatusCode::BAD_REQUEST, message),
    };
    match publish(&endpoint.sink, &events).await {
        Ok(ids) => {
            metrics::counter!(names::SYNTHETIC_EVENTS_TOTAL).increment(ids.len() as u64);
            tracing::info!(events = ids.len(), "Published synthetic events on request.");
            (StatusCode::OK, Json(serde_json::json!({ "event_ids": ids }))).into_response()
        }
        Err(response) => response,
    }
}

/// Publishes `events` and waits until each is acknowledged or spooled; their ids, or the answer
/// to give when that failed.
async fn publish(sink: &Sink, events: &[HealthEvent]) -> Result<Vec<String>, Response> {
    let mut pending = Vec::with_capacity(events.len());
    for e in events {
        match sink.submit(e).await {
            Ok(outcome) => pending.push((e.event_id, outcome)),
            Err(e) => return Err(error(StatusCode::SERVICE_UNAVAILABLE, e.to_string())),
        }
    }
    let mut ids = Vec::with_capacity(pending.len());
    for (id, outcome) in pending {
        match outcome.await {
            Ok(Outcome::Published | Outcome::Spooled) => ids.push(id.to_string()),
            Ok(Outcome::Dropped) => {
                return Err(error(
                    StatusCode::SERVICE_UNAVAILABLE,
                    "the spool is full of faults; healthy evidence was dropped",
                ));
            }
            Ok(Outcome::Refused) => {
                return Err(error(StatusCode::UNPROCESSABLE_ENTITY, "Kafka refuses the event for good"));
            }
            Err(_) => return Err(error(StatusCode::SERVICE_UNAVAILABLE, "the collector is shutting down")),
        }
    }
    Ok(ids)
}

/// Carries out a fall-off-bus or a reboot on the simulated node.
async fn simulate(endpoint: &Endpoint, action: Simulation) -> Response {
    let Some(sim) = &endpoint.simulated else {
        return error(
            StatusCode::CONFLICT,
            "fall_off_bus and reboot act on the simulated GPU backend only (--gpu-backend simulated): \
             on a real node a GPU falls off the bus on its own, and a reboot is a real reboot",
        );
    };
    match action {
        Simulation::FallOffBus(index) => {
            // One simulated action at a time: two requests must not both see the GPU present.
            let one_at_a_time = endpoint.simulating.lock().await;
            let gpu = match sim.control.gpu(index) {
                Some(gpu) if !gpu.lost => gpu,
                Some(_) => {
                    let message =
                        format!("GPU {index} has already fallen off the bus; inject a reboot to bring it back");
                    return error(StatusCode::CONFLICT, message);
                }
                None => return error(StatusCode::CONFLICT, format!("the simulated node has no GPU {index}")),
            };
            let event = xid79_event(&endpoint.node, &gpu.pci_bus_id);
            // The driver logs the Xid as the GPU drops and NVML notices at its next poll: the Xid
            // is queued before the GPU goes silent, so it reaches the pipeline first.
            let outcome = match endpoint.sink.submit(&event).await {
                Ok(outcome) => outcome,
                Err(e) => return error(StatusCode::SERVICE_UNAVAILABLE, e.to_string()),
            };
            if let Err(message) = sim.control.fall_off_bus(index) {
                return error(StatusCode::CONFLICT, message);
            }
            drop(one_at_a_time);
            match outcome.await {
                Ok(Outcome::Published | Outcome::Spooled) => {}
                Ok(Outcome::Dropped | Outcome::Refused) | Err(_) => {
                    return error(StatusCode::SERVICE_UNAVAILABLE, "the Xid 79 event could not be published");
                }
            }
            metrics::counter!(names::SYNTHETIC_EVENTS_TOTAL).increment(1);
            tracing::warn!(gpu = index, pci_bus_id = %gpu.pci_bus_id, "Simulated GPU fell off the bus on request.");
            let body = serde_json::json!({ "event_ids": [event.event_id.to_string()], "pci_bus_id": gpu.pci_bus_id });
            (StatusCode::OK, Json(body)).into_response()
        }
        Simulation::Reboot => {
            let _one_at_a_time = endpoint.simulating.lock().await;
            let boot_id = sim.control.reboot(endpoint.sink.identity());
            if let Err(e) = crate::identity::save_simulated_boot(&sim.state_dir, &sim.host_boot_id, &boot_id) {
                tracing::warn!(error = %e, "Cannot save the simulated boot id; a collector restart would go back to the host's.");
            }
            tracing::warn!(%boot_id, "Simulated node rebooted on request.");
            (StatusCode::OK, Json(serde_json::json!({ "event_ids": [], "boot_id": boot_id }))).into_response()
        }
    }
}

/// The endpoint's routes, for tests and [`serve`]; `simulated` when the backend is simulated.
pub fn router(node: String, sink: Sink, simulated: Option<SimulatedNode>) -> axum::Router {
    axum::Router::new().route("/v1/inject", axum::routing::post(inject)).with_state(Endpoint {
        node,
        sink,
        simulated,
        simulating: Default::default(),
    })
}

/// Serves the endpoint on `addr` (loopback, checked by the config) until `token` is cancelled.
///
/// # Errors
/// When the address cannot be bound or serving fails.
pub async fn serve(
    addr: SocketAddr,
    node: String,
    sink: Sink,
    simulated: Option<SimulatedNode>,
    token: CancellationToken,
) -> std::io::Result<()> {
    let listener = tokio::net::TcpListener::bind(addr).await?;
    tracing::warn!(%addr, "Fault injection is enabled: POST /v1/inject publishes synthetic events for this node.");
    axum::serve(listener, router(node, sink, simulated)).with_graceful_shutdown(token.cancelled_owned()).await
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

    fn request(json: &str) -> InjectRequest {
        serde_json::from_str(json).unwrap()
    }

    #[test]
    fn fall_off_bus_and_reboot_are_simulated_node_actions() {
        assert_eq!(simulation(&request(r#"{"xid": 79}"#)), Ok(None), "events, not an action");
        assert_eq!(
            simulation(&request(r#"{"fall_off_bus": true, "gpu_index": 3}"#)),
            Ok(Some(Simulation::FallOffBus(3)))
        );
        assert_eq!(simulation(&request(r#"{"reboot": true}"#)), Ok(Some(Simulation::Reboot)));
        for (body, want) in [
            (r#"{"fall_off_bus": true}"#, "gpu_index"),
            (r#"{"fall_off_bus": true, "gpu_index": -1}"#, "negative"),
            (r#"{"fall_off_bus": true, "reboot": true}"#, "one of"),
            (r#"{"fall_off_bus": true, "gpu_index": 1, "xid": 79}"#, "alone"),
            (r#"{"reboot": true, "gpu_index": 1}"#, "whole node"),
            (r#"{"reboot": true, "count": 2}"#, "nothing else"),
        ] {
            let err = simulation(&request(body)).expect_err(body);
            assert!(err.contains(want), "{body}: {err}");
        }
    }

    #[test]
    fn the_fall_off_bus_xid_is_shaped_like_the_kernel_logs() {
        let e = xid79_event("node-1", "0000:48:00.0");
        assert_eq!(xid79_line("0000:48:00.0"), e.raw.clone().unwrap());
        assert!(e.raw.as_deref().unwrap().starts_with("NVRM: Xid (PCI:0000:48:00): 79,"));
        assert!(e.synthetic && e.source == Source::Synthetic && e.kind == Kind::Xid);
        assert!(matches!(&e.detail, Detail::Xid(x) if x.code == 79));
        assert_eq!(e.entity.pci_bus_id.as_deref(), Some("0000:48:00.0"), "named by PCI alone");
        assert_eq!((e.entity.gpu_uuid.as_deref(), e.entity.gpu_index), (None, None));
        // Through the sink's stamp, the collector's inventory names the GPU fully.
        let identity = crate::identity::NodeIdentity::new("boot-1");
        let gpu = gpumedic_schemas::health::GpuIdentity {
            index: Some(3),
            uuid: Some("GPU-3".into()),
            pci_bus_id: Some("0000:48:00.0".into()),
            ..Default::default()
        };
        identity.remember([&gpu]);
        let stamped = identity.stamp(&e);
        assert_eq!((stamped.entity.gpu_uuid.as_deref(), stamped.entity.gpu_index), (Some("GPU-3"), Some(3)));
        gpumedic_schemas::encode(&stamped).expect("encodes");
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
