//! Cloud maintenance against a local metadata server that serves each provider's documented
//! payloads (AWS IMDSv2, the GCP metadata server with its hanging `wait_for_change` GET, Azure
//! Scheduled Events, the Oracle Cloud IMDS v2 instance document) and refuses requests without the headers each one demands. The module is
//! driven directly (poll, track, detect), and once through the collector binary to Kafka.

mod common;

use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::Router;
use axum::extract::{Query, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, put};
use common::CollectorEnv;
use gpumedic_collector::cloud::{self, CloudSettings, Notice, Poller, ProviderChoice, Tracker};
use gpumedic_schemas::health::CloudProvider;
use gpumedic_schemas::{Detail, HealthEvent};
use gpumedic_testkit as testkit;

const AWS_EVENT: &str = r#"[
  {
    "NotBefore" : "21 Jan 2030 09:00:43 GMT",
    "Code" : "system-reboot",
    "Description" : "scheduled reboot",
    "EventId" : "instance-event-0d59937288b749b32",
    "NotAfter" : "21 Jan 2030 09:17:23 GMT",
    "State" : "active"
  }
]"#;

const GCP_UPCOMING: &str = r#"{
  "can_reschedule": false,
  "latest_window_start_time": "2030-10-13T03:00:00Z",
  "maintenance_status": "PENDING",
  "type": "SCHEDULED",
  "window_end_time": "2030-10-13T05:00:00Z",
  "window_start_time": "2030-10-13T01:00:00Z"
}"#;

/// The OCI instance document (IMDS v2) with a maintenance reboot due; without it when `due` is
/// empty.
fn oci_instance(due: &str) -> String {
    serde_json::json!({
        "availabilityDomain": "EMIr:PHX-AD-1",
        "compartmentId": "ocid1.tenancy.oc1..exampleuniqueID",
        "displayName": "gpu-node-3",
        "id": "ocid1.instance.oc1.phx.exampleuniqueID",
        "region": "phx",
        "canonicalRegionName": "us-phoenix-1",
        "shape": "BM.GPU.H100.8",
        "state": "Running",
        "timeMaintenanceRebootDue": due,
    })
    .to_string()
}

const AZURE_EVENTS: &str = r#"{
    "DocumentIncarnation": 2,
    "Events": [
        {
            "EventId": "C7061BAC-AFDC-4513-B24B-AA5F13A16123",
            "EventStatus": "Scheduled",
            "EventType": "Freeze",
            "ResourceType": "VirtualMachine",
            "Resources": ["gpu-vm-7"],
            "NotBefore": "Mon, 11 Apr 2030 22:26:58 GMT",
            "Description": "Virtual machine is being paused because of a memory-preserving Live Migration operation.",
            "EventSource": "Platform",
            "DurationInSeconds": 5
        },
        {
            "EventId": "9DB3AD1A-2A9B-4E5E-8E16-ED4A3A0F1B2C",
            "EventStatus": "Scheduled",
            "EventType": "Reboot",
            "ResourceType": "VirtualMachine",
            "Resources": ["another-vm"],
            "NotBefore": "Mon, 11 Apr 2030 23:00:00 GMT",
            "Description": "Virtual machine is going to be restarted as requested by authorized user.",
            "EventSource": "User",
            "DurationInSeconds": -1
        }
    ]
}"#;

/// What the fake metadata server serves; tests change it while pollers run.
struct Served {
    /// Which provider the server pretends to be (the others' paths answer 404).
    provider: CloudProvider,
    aws_events: Option<String>,
    gcp_event: tokio::sync::watch::Sender<(String, u64)>,
    gcp_upcoming: Option<String>,
    gcp_waiters: usize,
    azure_events: String,
    oci_instance: String,
}

type Shared = Arc<Mutex<Served>>;

struct Fake {
    url: String,
    state: Shared,
}

impl Fake {
    async fn start(provider: CloudProvider) -> Self {
        let state = Arc::new(Mutex::new(Served {
            provider,
            aws_events: None,
            gcp_event: tokio::sync::watch::channel(("NONE".to_owned(), 1)).0,
            gcp_upcoming: None,
            gcp_waiters: 0,
            azure_events: r#"{"DocumentIncarnation": 1, "Events": []}"#.to_owned(),
            oci_instance: oci_instance(""),
        }));
        let app = Router::new()
            .route("/latest/api/token", put(aws_token))
            .route("/latest/meta-data/events/maintenance/scheduled", get(aws_events))
            .route("/computeMetadata/v1/instance/id", get(gcp_id))
            .route("/computeMetadata/v1/instance/maintenance-event", get(gcp_event))
            .route("/computeMetadata/v1/instance/upcoming-maintenance", get(gcp_upcoming))
            .route("/metadata/instance", get(azure_instance))
            .route("/metadata/instance/compute/name", get(azure_name))
            .route("/metadata/scheduledevents", get(azure_events))
            .route("/opc/v2/instance/", get(oci_instance_doc))
            .with_state(state.clone());
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let url = format!("http://{}", listener.local_addr().unwrap());
        tokio::spawn(async move { axum::serve(listener, app).await.expect("serve") });
        Self { url, state }
    }

    fn set(&self, change: impl FnOnce(&mut Served)) {
        change(&mut self.state.lock().unwrap());
    }

    fn settings(&self, provider: ProviderChoice, interval: Duration) -> CloudSettings {
        CloudSettings {
            provider,
            interval,
            aws_url: self.url.clone(),
            gcp_url: self.url.clone(),
            azure_url: self.url.clone(),
            oci_url: self.url.clone(),
        }
    }
}

fn is(state: &Shared, p: CloudProvider) -> bool {
    state.lock().unwrap().provider == p
}

const TOKEN: &str = "AQAEAFTestTokenOnlyForThisServer==";

async fn aws_token(State(s): State<Shared>, headers: HeaderMap) -> Response {
    if !is(&s, CloudProvider::Aws) {
        return StatusCode::NOT_FOUND.into_response();
    }
    // IMDSv2 refuses a token request without a lifetime.
    match headers.get("x-aws-ec2-metadata-token-ttl-seconds").and_then(|v| v.to_str().ok()?.parse::<u32>().ok()) {
        Some(1..=21600) => TOKEN.into_response(),
        _ => StatusCode::BAD_REQUEST.into_response(),
    }
}

async fn aws_events(State(s): State<Shared>, headers: HeaderMap) -> Response {
    if !is(&s, CloudProvider::Aws) {
        return StatusCode::NOT_FOUND.into_response();
    }
    if headers.get("x-aws-ec2-metadata-token").and_then(|v| v.to_str().ok()) != Some(TOKEN) {
        return StatusCode::UNAUTHORIZED.into_response();
    }
    match s.lock().unwrap().aws_events.clone() {
        Some(body) => body.into_response(),
        None => StatusCode::NOT_FOUND.into_response(),
    }
}

fn google(headers: &HeaderMap) -> bool {
    headers.get("metadata-flavor").and_then(|v| v.to_str().ok()) == Some("Google")
}

fn flavored(body: String, etag: Option<String>) -> Response {
    let mut r = ([("Metadata-Flavor", "Google")], body).into_response();
    if let Some(etag) = etag {
        r.headers_mut().insert("ETag", etag.parse().unwrap());
    }
    r
}

async fn gcp_id(State(s): State<Shared>, headers: HeaderMap) -> Response {
    if !is(&s, CloudProvider::Gcp) {
        return StatusCode::NOT_FOUND.into_response();
    }
    if !google(&headers) {
        return StatusCode::FORBIDDEN.into_response();
    }
    flavored("4520031799277581759".into(), None)
}

#[derive(serde::Deserialize)]
struct WaitQuery {
    wait_for_change: Option<String>,
    last_etag: Option<String>,
    timeout_sec: Option<u64>,
}

/// The documented hanging GET: with `wait_for_change=true` and the current ETag, the answer
/// waits for the value to change (or `timeout_sec`); otherwise it comes at once.
async fn gcp_event(State(s): State<Shared>, headers: HeaderMap, Query(q): Query<WaitQuery>) -> Response {
    if !is(&s, CloudProvider::Gcp) {
        return StatusCode::NOT_FOUND.into_response();
    }
    if !google(&headers) {
        return StatusCode::FORBIDDEN.into_response();
    }
    let mut rx = s.lock().unwrap().gcp_event.subscribe();
    let etag = |v: u64| format!("etag-{v}");
    let current = rx.borrow_and_update().1;
    if q.wait_for_change.as_deref() == Some("true") && q.last_etag.as_deref().is_none_or(|e| e == etag(current)) {
        s.lock().unwrap().gcp_waiters += 1;
        let wait = Duration::from_secs(q.timeout_sec.unwrap_or(3600));
        let _ = tokio::time::timeout(wait, rx.changed()).await;
        s.lock().unwrap().gcp_waiters -= 1;
    }
    let (value, version) = rx.borrow().clone();
    flavored(value, Some(etag(version)))
}

async fn gcp_upcoming(State(s): State<Shared>, headers: HeaderMap) -> Response {
    if !is(&s, CloudProvider::Gcp) {
        return StatusCode::NOT_FOUND.into_response();
    }
    if !google(&headers) {
        return StatusCode::FORBIDDEN.into_response();
    }
    match s.lock().unwrap().gcp_upcoming.clone() {
        Some(body) => flavored(body, None),
        None => StatusCode::NOT_FOUND.into_response(),
    }
}

/// Why Azure would refuse the request, if it would.
fn azure_refusal(s: &Shared, headers: &HeaderMap) -> Option<Response> {
    if !is(s, CloudProvider::Azure) {
        return Some(StatusCode::NOT_FOUND.into_response());
    }
    if headers.get("metadata").and_then(|v| v.to_str().ok()) != Some("true") {
        return Some(
            (StatusCode::BAD_REQUEST, r#"{"error": "Bad request. Required metadata header not specified"}"#)
                .into_response(),
        );
    }
    None
}

async fn azure_instance(State(s): State<Shared>, headers: HeaderMap) -> Response {
    if let Some(r) = azure_refusal(&s, &headers) {
        return r;
    }
    axum::Json(
        serde_json::json!({"compute": {"name": "gpu-vm-7", "vmSize": "Standard_ND96isr_H100_v5"}, "network": {}}),
    )
    .into_response()
}

async fn azure_name(State(s): State<Shared>, headers: HeaderMap) -> Response {
    azure_refusal(&s, &headers).unwrap_or_else(|| "gpu-vm-7".into_response())
}

async fn azure_events(State(s): State<Shared>, headers: HeaderMap, Query(q): Query<Vec<(String, String)>>) -> Response {
    if let Some(r) = azure_refusal(&s, &headers) {
        return r;
    }
    if !q.iter().any(|(k, v)| k == "api-version" && v == "2020-07-01") {
        return StatusCode::BAD_REQUEST.into_response();
    }
    s.lock().unwrap().azure_events.clone().into_response()
}

/// OCI's IMDS v2 refuses a request without `Authorization: Bearer Oracle`.
async fn oci_instance_doc(State(s): State<Shared>, headers: HeaderMap) -> Response {
    if !is(&s, cloud::oci::OCI) {
        return StatusCode::NOT_FOUND.into_response();
    }
    if headers.get("authorization").and_then(|v| v.to_str().ok()) != Some("Bearer Oracle") {
        return StatusCode::UNAUTHORIZED.into_response();
    }
    s.lock().unwrap().oci_instance.clone().into_response()
}

fn summary(events: &[HealthEvent]) -> Vec<(CloudProvider, String, String, bool)> {
    events
        .iter()
        .map(|e| match &e.detail {
            Detail::CloudMaintenance(d) => {
                (d.provider, d.provider_event_id.clone().unwrap_or_default(), d.event_type.clone(), e.healthy)
            }
            other => panic!("not a cloud maintenance event: {other:?}"),
        })
        .collect()
}

async fn poll(poller: &mut Poller, tracker: &mut Tracker) -> Vec<HealthEvent> {
    let notices: Vec<Notice> = poller.poll().await.unwrap_or_else(|e| panic!("{e}"));
    tracker.update(notices)
}

#[tokio::test]
async fn aws_scheduled_events_through_imdsv2() {
    let fake = Fake::start(CloudProvider::Aws).await;
    let settings = fake.settings(ProviderChoice::Fixed(CloudProvider::Aws), Duration::from_secs(1));
    let mut poller = Poller::new(CloudProvider::Aws, &settings).unwrap();
    let mut tracker = Tracker::new("node-a", CloudProvider::Aws);
    assert_eq!(
        summary(&poll(&mut poller, &mut tracker).await),
        [(CloudProvider::Aws, String::new(), "none".into(), true)]
    );
    fake.set(|s| s.aws_events = Some(AWS_EVENT.into()));
    let events = poll(&mut poller, &mut tracker).await;
    assert_eq!(
        summary(&events),
        [(CloudProvider::Aws, "instance-event-0d59937288b749b32".into(), "system-reboot".into(), false)]
    );
    let Detail::CloudMaintenance(d) = &events[0].detail else { unreachable!() };
    assert_eq!(d.window_start.map(|t| t.to_rfc3339()), Some("2030-01-21T09:00:43+00:00".into()));
    assert!(poll(&mut poller, &mut tracker).await.is_empty(), "the same notice is not published again");
    // Completed events stay listed with another state; they are no longer in force.
    fake.set(|s| s.aws_events = Some(AWS_EVENT.replace("\"active\"", "\"completed\"")));
    assert_eq!(
        summary(&poll(&mut poller, &mut tracker).await),
        [(CloudProvider::Aws, "instance-event-0d59937288b749b32".into(), "system-reboot".into(), true)]
    );
}

#[tokio::test]
async fn gcp_maintenance_event_is_a_hanging_get() {
    let fake = Fake::start(CloudProvider::Gcp).await;
    let settings = fake.settings(ProviderChoice::Fixed(CloudProvider::Gcp), Duration::from_secs(60));
    let mut poller = Poller::new(CloudProvider::Gcp, &settings).unwrap();
    let mut tracker = Tracker::new("node-g", CloudProvider::Gcp);
    assert_eq!(summary(&poll(&mut poller, &mut tracker).await)[0].2, "none", "the first read answers at once");

    // The next read waits on the server for a change: it is still waiting when the value changes.
    let waiting = tokio::spawn(async move {
        let events = poll(&mut poller, &mut tracker).await;
        (events, poller, tracker)
    });
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while fake.state.lock().unwrap().gcp_waiters == 0 {
        assert!(tokio::time::Instant::now() < deadline, "the poller never made a wait_for_change request");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(!waiting.is_finished(), "a wait_for_change request returned before anything changed");
    fake.set(|s| {
        s.gcp_upcoming = Some(GCP_UPCOMING.into());
        s.gcp_event.send_modify(|(v, version)| {
            *v = "TERMINATE_ON_HOST_MAINTENANCE".into();
            *version += 1;
        });
    });
    let (events, mut poller, mut tracker) = waiting.await.unwrap();
    assert_eq!(
        summary(&events),
        [
            (CloudProvider::Gcp, "maintenance-event".into(), "TERMINATE_ON_HOST_MAINTENANCE".into(), false),
            (CloudProvider::Gcp, "upcoming-maintenance".into(), "SCHEDULED".into(), false),
        ]
    );
    let Detail::CloudMaintenance(up) = &events[1].detail else { unreachable!() };
    assert_eq!(up.window_end.map(|t| t.to_rfc3339()), Some("2030-10-13T05:00:00+00:00".into()));

    fake.set(|s| {
        s.gcp_upcoming = None;
        s.gcp_event.send_modify(|(v, version)| {
            *v = "NONE".into();
            *version += 1;
        });
    });
    let ended = poll(&mut poller, &mut tracker).await;
    assert_eq!(ended.len(), 2);
    assert!(ended.iter().all(|e| e.healthy), "both notices ended: {:?}", summary(&ended));
}

#[tokio::test]
async fn azure_scheduled_events_for_this_vm_only() {
    let fake = Fake::start(CloudProvider::Azure).await;
    let settings = fake.settings(ProviderChoice::Fixed(CloudProvider::Azure), Duration::from_secs(1));
    let mut poller = Poller::new(CloudProvider::Azure, &settings).unwrap();
    let mut tracker = Tracker::new("node-z", CloudProvider::Azure);
    assert!(poll(&mut poller, &mut tracker).await[0].healthy);
    fake.set(|s| s.azure_events = AZURE_EVENTS.into());
    let events = poll(&mut poller, &mut tracker).await;
    assert_eq!(
        summary(&events),
        [(CloudProvider::Azure, "C7061BAC-AFDC-4513-B24B-AA5F13A16123".into(), "Freeze".into(), false)],
        "the other VM's reboot is not this node's"
    );
    fake.set(|s| s.azure_events = r#"{"DocumentIncarnation": 3, "Events": []}"#.into());
    assert!(poll(&mut poller, &mut tracker).await[0].healthy);
}

#[tokio::test]
async fn oci_maintenance_reboot_through_imds_v2() {
    let fake = Fake::start(cloud::oci::OCI).await;
    let settings = fake.settings(ProviderChoice::Auto, Duration::from_secs(1));
    assert_eq!(cloud::detect(&settings).await, Some(cloud::oci::OCI), "OCI is detected by its instance OCID");
    let mut poller = Poller::new(cloud::oci::OCI, &settings).unwrap();
    let mut tracker = Tracker::new("node-o", cloud::oci::OCI);
    assert_eq!(
        summary(&poll(&mut poller, &mut tracker).await),
        [(CloudProvider::Other, String::new(), "none".into(), true)],
        "nothing due: a clean start says so once"
    );
    fake.set(|s| s.oci_instance = oci_instance("2030-05-25T21:10:29.600Z"));
    let events = poll(&mut poller, &mut tracker).await;
    assert_eq!(
        summary(&events),
        [(CloudProvider::Other, "maintenance-reboot".into(), "maintenance-reboot".into(), false)]
    );
    let Detail::CloudMaintenance(d) = &events[0].detail else { unreachable!() };
    assert_eq!(d.window_start.map(|t| t.to_rfc3339()), Some("2030-05-25T21:10:29.600+00:00".into()));
    assert_eq!(d.window_end.map(|t| t.to_rfc3339()), Some("2030-05-26T21:10:29.600+00:00".into()));
    assert!(d.description.as_deref().is_some_and(|t| t.contains("Oracle Cloud")));
    assert!(poll(&mut poller, &mut tracker).await.is_empty(), "the same notice is not published again");
    fake.set(|s| s.oci_instance = oci_instance("2030-05-27T08:00:00Z"));
    assert_eq!(poll(&mut poller, &mut tracker).await.len(), 1, "a rescheduled reboot is news");
    fake.set(|s| s.oci_instance = oci_instance(""));
    assert_eq!(
        summary(&poll(&mut poller, &mut tracker).await),
        [(CloudProvider::Other, "maintenance-reboot".into(), "maintenance-reboot".into(), true)],
        "the due time cleared: the notice ended"
    );
}

#[tokio::test]
async fn the_provider_is_detected_and_off_cloud_is_quiet() {
    for provider in [CloudProvider::Aws, CloudProvider::Gcp, CloudProvider::Azure] {
        let fake = Fake::start(provider).await;
        let settings = fake.settings(ProviderChoice::Auto, Duration::from_secs(1));
        assert_eq!(cloud::detect(&settings).await, Some(provider));
    }
    // Nothing listens: detection finds nothing and does not fail.
    let nowhere = format!("http://{}", testkit::free_local_addr().unwrap());
    let settings = CloudSettings {
        provider: ProviderChoice::Auto,
        interval: Duration::from_secs(1),
        aws_url: nowhere.clone(),
        gcp_url: nowhere.clone(),
        azure_url: nowhere.clone(),
        oci_url: nowhere,
    };
    assert_eq!(cloud::detect(&settings).await, None);
    assert_eq!(cloud::resolve(&CloudSettings { provider: ProviderChoice::None, ..settings }).await, None);
}

#[tokio::test]
async fn the_collector_publishes_a_detected_notice_to_kafka() {
    let bootstrap = testkit::require_kafka().await.unwrap_or_else(|e| panic!("{e}"));
    let fake = Fake::start(CloudProvider::Aws).await;
    fake.set(|s| s.aws_events = Some(AWS_EVENT.into()));
    let node = testkit::unique_name("cloud-node");
    let mut collector =
        CollectorEnv::new(bootstrap, &node, &std::env::temp_dir().join(testkit::unique_name("collector-state")))
            .set("GPUMEDIC_CLOUD_PROVIDER", "auto")
            .set("GPUMEDIC_CLOUD_POLL_INTERVAL", "1s")
            .set("GPUMEDIC_AWS_METADATA_URL", fake.url.clone())
            .set("GPUMEDIC_GCP_METADATA_URL", fake.url.clone())
            .set("GPUMEDIC_AZURE_METADATA_URL", fake.url.clone())
            .start()
            .await;
    let want = |healthy: bool| {
        move |e: &HealthEvent| {
            e.healthy == healthy
                && matches!(&e.detail, Detail::CloudMaintenance(d)
                    if d.provider == CloudProvider::Aws
                        && d.provider_event_id.as_deref() == Some("instance-event-0d59937288b749b32"))
        }
    };
    common::first_event(&node, Duration::from_secs(30), want(false)).await;
    fake.set(|s| s.aws_events = Some("[]".into()));
    let event = common::first_event(&node, Duration::from_secs(30), want(true)).await;
    assert_eq!(event.source, gpumedic_schemas::health::Source::Cloud);
    collector.terminate(Duration::from_secs(15)).await.expect("stops");
}
