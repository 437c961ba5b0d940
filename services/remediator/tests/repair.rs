//! Repair hooks and the escalation ladder, with the remediator binary in full-remediation mode
//! against the testbed's kube-apiserver and Kafka:
//! - the signed webhook, received by an HTTPS server in the test (a CA made here with rcgen) that
//!   checks every request with the library's receiver check ([`hooks::verify`]): a
//!   first step answered 500 twice then 200 is retried under one idempotency key, times out
//!   without healthy evidence and escalates; a recovery verdict then ends the ladder remediated
//!   and returns the node;
//! - a webhook that refuses (403) fails every step at once, without retries: the node is `failed`,
//!   with an Event and a failed outcome;
//! - during a key rotation (a new current key, the old one as previous), every call verifies at a
//!   receiver that knows only the old key and at one that knows only the new key;
//! - the custom resource hook: a CRD installed in the test, the resource created once under its
//!   deterministic name, `status.phase: Succeeded` set by the test -> `remediated`;
//! - custom actions (a rule's `action: custom`, Xid 45 alone -> `restart-fabric-manager`): the
//!   signed webhook is called once under the action's name while the node stays in service, and
//!   without healthy evidence within `--custom-action-timeout` the ladder fails for an operator;
//!   through the custom resource, a `Succeeded` phase remediates and the recovery ends the ladder;
//! - validation before return (`--validation job`): the recovery of a repaired node creates a Job
//!   pinned to it and holds the node `validating`; the test acts as the kubelet and the Job
//!   controller by writing the Job's status: a Job that completes releases the node, one that
//!   fails escalates to the next rung, one that never finishes times out and escalates; the
//!   result carries the Job's conditions and its pod's termination message (the test writes the
//!   pod and its status as the Job controller and the kubelet would);
//! - validation through the repair hooks (`--validation webhook`, `resource`): the webhook is
//!   asked for `validate`, signed, under one key at every look, and answers with the state; the
//!   custom resource is created for `validate` and its controller (the test) reports a phase:
//!   success releases, failure and the timeout escalate;
//! - burn-in (`--validation-burn-in`): after a passed validation the node stays out (`burn-in`)
//!   and returns once the period passes without a new fault; a new fault verdict escalates the
//!   ladder; a remediator restarted during the burn-in finishes it without validating again; a
//!   fault of another incident on another GPU holds the burn-in without escalating, and it starts
//!   over once that incident recovers;
//! - after a failed validation the ladder keeps the held recovery: on a webhook-only ladder the
//!   escalated step is validated again once it has had its timeout (across a restart), one whose
//!   custom resource reports `Succeeded` is validated again at once, and a
//!   drained node's validation before release, failed, is validated again after its first rung
//!   under a Job of its own;
//! - the validation and burn-in counters are on /metrics at zero from the start;
//! - validation of releases without a repair (a drain or cordon quarantine, full-remediation):
//!   the recovery is held for a Job; a pass releases, a failure or timeout starts the repair
//!   ladder of a drained node and leaves a node that was only cordoned `failed` for an operator.
//!
//! Each test has its own namespace, nodes, topics and consumer group.

mod common;

use std::collections::{BTreeMap, VecDeque};
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::*;
use gpumedic_remediator::hooks;
use gpumedic_remediator::ladder::LADDER_ANNOTATION;
use gpumedic_schemas::{ActionStatus, RecommendedAction, Severity, Verdict};
use gpumedic_testkit::{self as testkit, ServiceProcess, eventually};
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::api::{Api, ApiResource, DynamicObject, ListParams, Patch, PatchParams, PostParams};
use kube::core::GroupVersionKind;
use serde_json::{Value, json};
use tokio_rustls::rustls;

const BIN: &str = env!("CARGO_BIN_EXE_gpumedic-remediator");
const SECRET: &str = "s3cret-shared-with-the-receiver";

/// One call the receiver saw.
#[derive(Debug, Clone)]
struct Call {
    key: String,
    /// The id of the receiver's key that verified the call (`None`: refused).
    verified_by: Option<String>,
    /// The signature headers (timestamp, key ids, signatures) and the raw body, to verify again
    /// with other keys.
    signed: (String, String, String, Vec<u8>),
    body: Value,
    status: u16,
}

impl Call {
    /// Whether a receiver that knows only `keys` accepts the call.
    fn verifies_with(&self, keys: &[hooks::Key]) -> bool {
        let (timestamp, key_ids, signatures, body) = &self.signed;
        let delivery = hooks::Delivery {
            timestamp: Some(timestamp.as_str()),
            key_ids: Some(key_ids.as_str()),
            signatures: Some(signatures.as_str()),
            body,
        };
        hooks::verify(&delivery, keys, Duration::from_secs(300), chrono::Utc::now().timestamp()).is_ok()
    }
}

/// The receiver's key for the shared secret of the old single-secret flags.
fn default_key() -> hooks::Key {
    hooks::Key::new(hooks::DEFAULT_KEY_ID, hooks::Secret(SECRET.into())).unwrap()
}

/// The test's HTTPS webhook receiver: verifies each request with the library's receiver check
/// (the keys it knows, a 5-minute window), records every call, and answers from a script per
/// step (`step -> statuses`, then 200).
#[derive(Clone)]
struct Receiver {
    keys: Arc<Mutex<Vec<hooks::Key>>>,
    calls: Arc<Mutex<Vec<Call>>>,
    script: Arc<Mutex<BTreeMap<u64, VecDeque<u16>>>>,
    always: Arc<Mutex<Option<u16>>>,
    /// The answer to a validation request (`action: validate`), per node; unset: running.
    validations: Arc<Mutex<BTreeMap<String, Value>>>,
}

impl Default for Receiver {
    fn default() -> Self {
        Self {
            keys: Arc::new(Mutex::new(vec![default_key()])),
            calls: Arc::default(),
            script: Arc::default(),
            always: Arc::default(),
            validations: Arc::default(),
        }
    }
}

impl Receiver {
    fn calls(&self) -> Vec<Call> {
        self.calls.lock().unwrap().clone()
    }

    fn calls_for(&self, key: &str) -> Vec<Call> {
        self.calls().into_iter().filter(|c| c.key == key).collect()
    }

    /// From now on, answers the validation of `node` with `phase` and `message`.
    fn validation_answer(&self, node: &str, phase: &str, message: &str) {
        let answer = json!({ "status": { "phase": phase, "message": message } });
        self.validations.lock().unwrap().insert(node.to_owned(), answer);
    }
}

async fn receive(
    axum::extract::State(r): axum::extract::State<Receiver>,
    headers: axum::http::HeaderMap,
    body: axum::body::Bytes,
) -> (axum::http::StatusCode, String) {
    let header = |name: &str| headers.get(name).and_then(|v| v.to_str().ok()).unwrap_or_default().to_owned();
    let delivery = hooks::Delivery::from_headers(&body[..], |name| headers.get(name).and_then(|v| v.to_str().ok()));
    let keys = r.keys.lock().unwrap().clone();
    let verified_by = hooks::verify(&delivery, &keys, Duration::from_secs(300), chrono::Utc::now().timestamp())
        .map(|v| v.key_id)
        .map_err(|e| eprintln!("The receiver refused a call: {e}"))
        .ok();
    let signed =
        (header(hooks::TIMESTAMP_HEADER), header(hooks::KEY_ID_HEADER), header(hooks::SIGNATURE_HEADER), body.to_vec());
    let body: Value = serde_json::from_slice(&body).unwrap_or(Value::Null);
    let step = body["step"].as_u64().unwrap_or(0);
    let status = match *r.always.lock().unwrap() {
        Some(s) => s,
        None => r.script.lock().unwrap().get_mut(&step).and_then(VecDeque::pop_front).unwrap_or(200),
    };
    // A validation is answered with its state, as a repair resource's status reads.
    let answer = if body["action"] == "validate" && status == 200 {
        let node = body["node"].as_str().unwrap_or_default();
        let running = json!({ "status": { "phase": "Running", "message": "dcgmi diag -r 2 is running" } });
        r.validations.lock().unwrap().get(node).cloned().unwrap_or(running).to_string()
    } else {
        String::new()
    };
    r.calls.lock().unwrap().push(Call { key: header(hooks::IDEMPOTENCY_HEADER), verified_by, signed, body, status });
    (axum::http::StatusCode::from_u16(status).unwrap(), answer)
}

/// A TCP listener that completes a TLS handshake before handing the connection to axum.
struct TlsListener {
    tcp: tokio::net::TcpListener,
    acceptor: tokio_rustls::TlsAcceptor,
}

impl axum::serve::Listener for TlsListener {
    type Io = tokio_rustls::server::TlsStream<tokio::net::TcpStream>;
    type Addr = SocketAddr;

    async fn accept(&mut self) -> (Self::Io, Self::Addr) {
        loop {
            let Ok((tcp, addr)) = self.tcp.accept().await else { continue };
            match self.acceptor.accept(tcp).await {
                Ok(tls) => return (tls, addr),
                Err(e) => eprintln!("TLS handshake failed: {e}"),
            }
        }
    }

    fn local_addr(&self) -> std::io::Result<SocketAddr> {
        self.tcp.local_addr()
    }
}

/// Starts the receiver on 127.0.0.1 with a certificate from a CA made now; returns the URL and
/// the CA's PEM (what --repair-webhook-ca-file gets).
async fn start_receiver(r: &Receiver) -> (String, String) {
    let ca_key = rcgen::KeyPair::generate().unwrap();
    let mut ca_params = rcgen::CertificateParams::new(Vec::<String>::new()).unwrap();
    ca_params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
    ca_params.distinguished_name.push(rcgen::DnType::CommonName, "gpumedic test CA");
    let ca_cert = ca_params.self_signed(&ca_key).unwrap();
    let issuer = rcgen::Issuer::new(ca_params, ca_key);
    let leaf_key = rcgen::KeyPair::generate().unwrap();
    let leaf = rcgen::CertificateParams::new(vec!["127.0.0.1".to_owned(), "localhost".to_owned()])
        .unwrap()
        .signed_by(&leaf_key, &issuer)
        .unwrap();
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let config = rustls::ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_no_client_auth()
        .with_single_cert(
            vec![leaf.der().clone()],
            rustls::pki_types::PrivatePkcs8KeyDer::from(leaf_key.serialize_der()).into(),
        )
        .unwrap();
    let tcp = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = tcp.local_addr().unwrap();
    let listener = TlsListener { tcp, acceptor: tokio_rustls::TlsAcceptor::from(Arc::new(config)) };
    let app = axum::Router::new().route("/repair", axum::routing::post(receive)).with_state(r.clone());
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    (format!("https://{addr}/repair"), ca_cert.pem())
}

/// One test's world: namespace, fleet label, topics, group, and a folder for files it hands the
/// remediator.
struct World {
    base: Fleet,
    dir: std::path::PathBuf,
}

impl std::ops::Deref for World {
    type Target = Fleet;

    fn deref(&self) -> &Fleet {
        &self.base
    }
}

impl World {
    async fn new() -> Self {
        let dir = std::env::temp_dir().join(testkit::unique_name("repair-test"));
        std::fs::create_dir_all(&dir).unwrap();
        Self { base: Fleet::new().await, dir }
    }

    fn file(&self, name: &str, contents: &str) -> String {
        let path = self.dir.join(name);
        std::fs::write(&path, contents).unwrap();
        path.display().to_string()
    }

    /// Starts a full-remediation remediator with fast checks and `extra` env.
    async fn start(&self, extra: &[(&str, String)]) -> ServiceProcess {
        let mut env =
            vec![("GPUMEDIC_REPAIR_CHECK", "500ms".to_owned()), ("GPUMEDIC_REPAIR_WEBHOOK_BACKOFF", "100ms".into())];
        env.extend(extra.iter().cloned());
        let mut p = ServiceProcess::start(BIN, &[], &self.env("rem-a", "full-remediation", &env))
            .expect("the remediator starts");
        p.wait_ready(Duration::from_secs(90)).await.unwrap_or_else(|e| panic!("{e}"));
        p
    }
}

/// A verdict about GPU-aaa on `node`; a recovery is for the record, after the GPU's healthy time.
fn verdict(node: &str, incident: uuid::Uuid, action: RecommendedAction, recovery: bool) -> Verdict {
    let gpu = gpumedic_schemas::health::Entity {
        gpu_uuid: Some("GPU-aaa".into()),
        gpu_index: Some(0),
        pci_bus_id: Some("0000:3b:00.0".into()),
        ..Default::default()
    };
    let v = testkit::verdict(node).incident(incident).action(action).entity(gpu).recovery(recovery);
    let v = if recovery { v.severity(Severity::Info).reason("healthy for 10 min") } else { v };
    v.build()
}

fn state(node: &k8s_openapi::api::core::v1::Node) -> Option<String> {
    labels(node).get("gpumedic.io/state").cloned()
}

/// The node once its state label reads `validating`. The remediator starts a validation (the Job,
/// the resource or the webhook's call, and the outcome saying so), then records its ladder and
/// writes the label: a test that has seen the start waits for the label, which follows within
/// those two writes (read at once, it failed CI once with the label still `remediating`).
async fn validating_node(client: &kube::Client, name: &str) -> k8s_openapi::api::core::v1::Node {
    eventually("the node's state label to read validating", Duration::from_secs(30), async || {
        let n = get_node(client, name).await;
        (state(&n).as_deref() == Some("validating")).then_some(n)
    })
    .await
}

fn has_ladder(node: &k8s_openapi::api::core::v1::Node) -> bool {
    node.metadata.annotations.as_ref().is_some_and(|a| a.contains_key(LADDER_ANNOTATION))
}

#[tokio::test]
async fn the_webhook_is_retried_under_one_key_escalates_on_timeout_and_a_recovery_ends_the_ladder() {
    let w = World::new().await;
    let name = w.node().await;
    pod(&w.client, &w.ns, "job-0", &name, json!({})).await;
    let receiver = Receiver::default();
    receiver.script.lock().unwrap().insert(1, VecDeque::from([500, 500]));
    let (url, ca) = start_receiver(&receiver).await;
    let mut r = w
        .start(&[
            ("GPUMEDIC_REPAIR_WEBHOOK_URL", url),
            ("GPUMEDIC_REPAIR_WEBHOOK_SECRET_FILE", w.file("secret", &format!("{SECRET}\n"))),
            ("GPUMEDIC_REPAIR_WEBHOOK_CA_FILE", w.file("ca.pem", &ca)),
            ("GPUMEDIC_REPAIR_LADDER", "reset_gpu=4s,reboot_node=10m,replace_node".into()),
        ])
        .await;

    let incident = uuid::Uuid::new_v4();
    let v = verdict(&name, incident, RecommendedAction::ResetGpu, false);
    w.publish(&v).await;
    let first =
        w.outcome(v.verdict_id, |o| o.action == RecommendedAction::ResetGpu && o.detail.contains("drain")).await;
    assert_eq!(first.status, ActionStatus::Applied, "{}", first.detail);
    assert!(first.detail.contains("repair ladder started at reset_gpu"), "{}", first.detail);
    assert!(pods_left(&w.client, &w.ns).await.is_empty(), "drained before the repair");

    // Step 1: 500, 500, 200 under one key; no healthy evidence within 4 s: step 2.
    let key1 = format!("{}:1", v.verdict_id);
    let key2 = format!("{}:2", v.verdict_id);
    eventually("the second step's webhook call", Duration::from_secs(60), async || {
        (!receiver.calls_for(&key2).is_empty()).then_some(())
    })
    .await;
    let step1 = receiver.calls_for(&key1);
    assert_eq!(step1.iter().map(|c| c.status).collect::<Vec<_>>(), [500, 500, 200], "{step1:?}");
    assert_eq!(step1.iter().map(|c| c.body["attempt"].as_u64().unwrap()).collect::<Vec<_>>(), [1, 2, 3]);
    assert_eq!(step1[0].body["action"], "reset_gpu");
    assert_eq!(step1[0].body["node"], name.as_str());
    assert_eq!(step1[0].body["gpu"]["uuid"], "GPU-aaa");
    assert_eq!(step1[0].body["incidentId"], incident.to_string());
    let step2 = receiver.calls_for(&key2);
    assert_eq!(step2.len(), 1, "{step2:?}");
    assert_eq!((step2[0].body["action"].as_str(), step2[0].body["step"].as_u64()), (Some("reboot_node"), Some(2)));
    let all = receiver.calls();
    assert!(
        all.iter().all(|c| c.verified_by.as_deref() == Some(hooks::DEFAULT_KEY_ID)),
        "every call is signed with the shared secret: {all:?}"
    );
    assert!(all.iter().all(|c| c.key == key1 || c.key == key2), "one key per step: {all:?}");
    w.outcome(v.verdict_id, |o| o.status == ActionStatus::Failed && o.detail.contains("escalating to reboot_node"))
        .await;
    w.outcome(v.verdict_id, |o| o.action == RecommendedAction::RebootNode && o.status == ActionStatus::Applied).await;
    let node = get_node(&w.client, &name).await;
    assert_eq!(state(&node).as_deref(), Some("remediating"));
    assert!(has_ladder(&node));

    // Healthy evidence during step 2: the ladder ends remediated and the node returns.
    let rec = verdict(&name, incident, RecommendedAction::None, true);
    w.publish(&rec).await;
    w.outcome(rec.verdict_id, |o| o.status == ActionStatus::Applied).await;
    let done = w.outcome(v.verdict_id, |o| o.detail.starts_with("remediated")).await;
    assert!(done.detail.contains("reboot_node"), "{}", done.detail);
    let node = get_node(&w.client, &name).await;
    assert!(!cordoned(&node) && gpumedic_taints(&node).is_empty(), "returned to service");
    assert!(!has_ladder(&node), "the ladder record is gone");
    assert_eq!(state(&node), None);
    let events = event_reasons(&w.client, &name).await;
    for reason in ["RepairLadderStarted", "RepairStepStarted", "RepairEscalated", "Remediated", "Recovered"] {
        assert!(events.iter().any(|e| e == reason), "{reason} missing from {events:?}");
    }
    // Nothing more happens: no third step.
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert!(receiver.calls().iter().all(|c| c.key != format!("{}:3", v.verdict_id)));
    r.terminate(Duration::from_secs(20)).await.unwrap_or_else(|e| panic!("{e}"));
    cleanup(&w.client, &[&name], &[&w.ns]).await;
}

#[tokio::test]
async fn a_webhook_that_refuses_fails_every_step_at_once_and_leaves_the_node_failed() {
    let w = World::new().await;
    let name = w.node().await;
    let receiver = Receiver::default();
    *receiver.always.lock().unwrap() = Some(403);
    let (url, ca) = start_receiver(&receiver).await;
    let mut r = w
        .start(&[
            ("GPUMEDIC_REPAIR_WEBHOOK_URL", url),
            ("GPUMEDIC_REPAIR_WEBHOOK_SECRET", SECRET.to_owned()),
            ("GPUMEDIC_REPAIR_WEBHOOK_CA_FILE", w.file("ca.pem", &ca)),
            ("GPUMEDIC_REPAIR_LADDER", "reset_gpu=10m,reboot_node=10m".into()),
        ])
        .await;
    let v = verdict(&name, uuid::Uuid::new_v4(), RecommendedAction::ResetGpu, false);
    w.publish(&v).await;
    let failed = w.outcome(v.verdict_id, |o| o.detail.starts_with("repair failed")).await;
    assert_eq!(failed.status, ActionStatus::Failed);
    assert!(failed.detail.contains("403"), "{}", failed.detail);
    let node = eventually("the node to be failed", Duration::from_secs(30), async || {
        let n = get_node(&w.client, &name).await;
        (state(&n).as_deref() == Some("failed")).then_some(n)
    })
    .await;
    assert!(cordoned(&node), "a failed node stays out of service");
    assert!(
        conditions(&node).contains(&("GpuUnhealthy".into(), "True".into(), Some("RepairFailed".into()))),
        "{:?}",
        conditions(&node)
    );
    let calls = receiver.calls();
    let keys: Vec<&str> = calls.iter().map(|c| c.key.as_str()).collect();
    assert_eq!(keys, [format!("{}:1", v.verdict_id), format!("{}:2", v.verdict_id)], "a 4xx is not retried");
    let events = event_reasons(&w.client, &name).await;
    assert!(events.iter().any(|e| e == "RepairEscalated") && events.iter().any(|e| e == "RepairFailed"), "{events:?}");
    r.terminate(Duration::from_secs(20)).await.unwrap_or_else(|e| panic!("{e}"));
    cleanup(&w.client, &[&name], &[&w.ns]).await;
}

#[tokio::test]
async fn a_ladder_annotation_naming_another_node_or_with_no_steps_calls_no_hook_and_says_why() {
    let w = World::new().await;
    let (a, b, c) = (w.node().await, w.node().await, w.node().await);
    let receiver = Receiver::default();
    let (url, ca) = start_receiver(&receiver).await;
    let mut r = w
        .start(&[
            ("GPUMEDIC_REPAIR_WEBHOOK_URL", url),
            ("GPUMEDIC_REPAIR_WEBHOOK_SECRET", SECRET.to_owned()),
            ("GPUMEDIC_REPAIR_WEBHOOK_CA_FILE", w.file("ca.pem", &ca)),
            ("GPUMEDIC_REPAIR_LADDER", "reboot_node=10m,replace_node".into()),
        ])
        .await;
    // Whoever can annotate node A (its own kubelet can) writes a pending ladder for node B on it,
    // and an empty ladder on node C.
    let steps = gpumedic_remediator::ladder::parse_steps("reboot_node=10m,replace_node", Duration::from_secs(600))
        .expect("steps");
    let for_b = request(&b, gpumedic_remediator::request::Action::RebootNode);
    let forged = gpumedic_remediator::ladder::Ladder::new(
        &uuid::Uuid::new_v4().to_string(),
        RecommendedAction::RebootNode,
        &for_b,
        &steps,
        chrono::Utc::now(),
    );
    let mut empty = serde_json::to_value(&forged).unwrap();
    empty["steps"] = json!([]);
    empty["request"]["node"] = json!(c);
    let nodes: Api<k8s_openapi::api::core::v1::Node> = Api::all(w.client.clone());
    for (name, ladder) in [(&a, serde_json::to_string(&forged).unwrap()), (&c, empty.to_string())] {
        let patch = json!({ "metadata": { "annotations": { LADDER_ANNOTATION: ladder } } });
        nodes.patch(name, &PatchParams::default(), &Patch::Merge(&patch)).await.expect("annotated");
    }
    for (name, why) in [(&a, format!("names node \"{b}\"")), (&c, "no steps".to_owned())] {
        eventually("an Event saying why the ladder is ignored", Duration::from_secs(30), async || {
            let events = events_of(&w.client, name).await;
            events
                .iter()
                .any(|(reason, message)| reason == "RepairLadderRefused" && message.contains(&why))
                .then_some(())
        })
        .await;
    }
    // Several more looks (every 500 ms): still no hook call, one Event each, the leader still up.
    tokio::time::sleep(Duration::from_secs(4)).await;
    assert!(receiver.calls().is_empty(), "no hook was called: {:?}", receiver.calls());
    for name in [&a, &c] {
        let refused = event_reasons(&w.client, name).await.into_iter().filter(|e| e == "RepairLadderRefused").count();
        assert_eq!(refused, 1, "one Event per annotation value on {name}");
    }
    assert!(r.try_wait().unwrap().is_none(), "the remediator is still running");
    let body = testkit::http_get(r.admin_addr(), "/metrics").await.unwrap().1;
    assert!(body.lines().any(|l| l == "gpumedic_remediator_leader 1"), "still leading");
    let node_b = get_node(&w.client, &b).await;
    assert!(!cordoned(&node_b) && state(&node_b).is_none(), "node B is untouched");
    r.terminate(Duration::from_secs(20)).await.unwrap_or_else(|e| panic!("{e}"));
    cleanup(&w.client, &[&a, &b, &c], &[&w.ns]).await;
}

/// The Events on `node`: reason and message.
async fn events_of(client: &kube::Client, node: &str) -> Vec<(String, String)> {
    let events: Api<k8s_openapi::api::core::v1::Event> = Api::all(client.clone());
    let lp = ListParams::default().fields(&format!("involvedObject.name={node}"));
    events
        .list(&lp)
        .await
        .map(|l| l.items.into_iter().map(|e| (e.reason.unwrap_or_default(), e.message.unwrap_or_default())).collect())
        .unwrap_or_default()
}

#[tokio::test]
async fn during_a_key_rotation_receivers_with_the_old_or_the_new_key_both_verify_every_call() {
    let w = World::new().await;
    let name = w.node().await;
    // This receiver has not been rolled yet: it knows only the old key.
    let receiver = Receiver::default();
    let (url, ca) = start_receiver(&receiver).await;
    const NEW_SECRET: &str = "the-new-key-after-rotation";
    let mut r = w
        .start(&[
            ("GPUMEDIC_REPAIR_WEBHOOK_URL", url),
            ("GPUMEDIC_REPAIR_WEBHOOK_KEY_ID", "2026-12".into()),
            ("GPUMEDIC_REPAIR_WEBHOOK_SECRET_FILE", w.file("new", &format!("{NEW_SECRET}\n"))),
            ("GPUMEDIC_REPAIR_WEBHOOK_PREVIOUS_KEY_ID", hooks::DEFAULT_KEY_ID.into()),
            ("GPUMEDIC_REPAIR_WEBHOOK_PREVIOUS_SECRET_FILE", w.file("previous", &format!("{SECRET}\n"))),
            ("GPUMEDIC_REPAIR_WEBHOOK_CA_FILE", w.file("ca.pem", &ca)),
            ("GPUMEDIC_REPAIR_LADDER", "reset_gpu=10m,reboot_node=10m".into()),
        ])
        .await;
    let v = verdict(&name, uuid::Uuid::new_v4(), RecommendedAction::ResetGpu, false);
    w.publish(&v).await;
    let call = eventually("the first step's webhook call", Duration::from_secs(60), async || {
        receiver.calls_for(&format!("{}:1", v.verdict_id)).into_iter().next()
    })
    .await;
    assert_eq!(call.verified_by.as_deref(), Some(hooks::DEFAULT_KEY_ID), "the old key verifies: {call:?}");
    assert_eq!(call.signed.1, "2026-12,default", "the current key signs first");
    let new = hooks::Key::new("2026-12", hooks::Secret(NEW_SECRET.into())).unwrap();
    assert!(call.verifies_with(std::slice::from_ref(&new)), "a rolled receiver with only the new key verifies");
    assert!(call.verifies_with(&[new, default_key()]), "so does one with both");
    let impostor = hooks::Key::new("2026-12", hooks::Secret(b"guessed".to_vec())).unwrap();
    assert!(!call.verifies_with(&[impostor]), "another secret under the new id does not");
    r.terminate(Duration::from_secs(20)).await.unwrap_or_else(|e| panic!("{e}"));
    cleanup(&w.client, &[&name], &[&w.ns]).await;
}

const GROUP: &str = "repair.gpumedic-test.io";

/// The test's repair CRD (namespaced `GpuRepair`, any fields, a status subresource), installed
/// once for all runs and waited for until established.
async fn install_crd(client: &kube::Client) {
    let crds: Api<CustomResourceDefinition> = Api::all(client.clone());
    let crd: CustomResourceDefinition = serde_json::from_value(json!({
        "metadata": { "name": format!("gpurepairs.{GROUP}") },
        "spec": {
            "group": GROUP,
            "scope": "Namespaced",
            "names": { "plural": "gpurepairs", "singular": "gpurepair", "kind": "GpuRepair" },
            "versions": [{
                "name": "v1", "served": true, "storage": true,
                "subresources": { "status": {} },
                "schema": { "openAPIV3Schema": { "type": "object", "x-kubernetes-preserve-unknown-fields": true } }
            }]
        }
    }))
    .unwrap();
    match crds.create(&PostParams::default(), &crd).await {
        Ok(_) => {}
        Err(kube::Error::Api(s)) if s.is_already_exists() => {}
        Err(e) => panic!("CRD: {e}"),
    }
    eventually("the CRD to be established", Duration::from_secs(30), async || {
        let crd = crds.get(&format!("gpurepairs.{GROUP}")).await.ok()?;
        let established = crd.status?.conditions?.iter().any(|c| c.type_ == "Established" && c.status == "True");
        established.then_some(())
    })
    .await;
}

#[tokio::test]
async fn the_custom_resource_is_created_once_and_its_succeeded_phase_remediates_the_node() {
    let w = World::new().await;
    install_crd(&w.client).await;
    let name = w.node().await;
    let template = format!(
        "apiVersion: {GROUP}/v1\nkind: GpuRepair\nmetadata:\n  namespace: {}\n  labels:\n    team: infra\n\
         spec:\n  nodeName: \"{{{{node}}}}\"\n  gpu: \"{{{{gpu_uuid}}}}\"\n  operation: \"{{{{action}}}}\"\n  \
         verdict: \"{{{{verdict_id}}}}\"\n",
        w.ns
    );
    let mut r = w
        .start(&[
            ("GPUMEDIC_REPAIR_RESOURCE_TEMPLATE", w.file("template.yaml", &template)),
            ("GPUMEDIC_REPAIR_LADDER", "reset_gpu=10m,reboot_node=10m".into()),
        ])
        .await;
    let v = verdict(&name, uuid::Uuid::new_v4(), RecommendedAction::ResetGpu, false);
    w.publish(&v).await;

    let ar = ApiResource::from_gvk_with_plural(&GroupVersionKind::gvk(GROUP, "v1", "GpuRepair"), "gpurepairs");
    let repairs: Api<DynamicObject> = Api::namespaced_with(w.client.clone(), &w.ns, &ar);
    let cr_name = format!("gpumedic-{}-1", v.verdict_id);
    let cr = eventually("the repair resource", Duration::from_secs(60), async || {
        repairs.get_opt(&cr_name).await.expect("read the repair resource")
    })
    .await;
    assert_eq!(cr.data["spec"]["nodeName"], name.as_str());
    assert_eq!(cr.data["spec"]["operation"], "reset_gpu");
    assert_eq!(cr.data["spec"]["gpu"], "GPU-aaa");
    assert_eq!(cr.data["spec"]["verdict"], v.verdict_id.to_string());
    assert_eq!(cr.metadata.labels.as_ref().unwrap()["team"], "infra");
    w.outcome(v.verdict_id, |o| o.detail.contains("GpuRepair") && o.status == ActionStatus::Applied).await;
    // A few more looks of the driver while the controller works: still one resource.
    tokio::time::sleep(Duration::from_secs(2)).await;
    let listed = repairs.list(&ListParams::default()).await.unwrap().items;
    assert_eq!(
        listed.len(),
        1,
        "one resource for the step: {:?}",
        listed.iter().map(|o| &o.metadata.name).collect::<Vec<_>>()
    );
    assert_eq!(state(&get_node(&w.client, &name).await).as_deref(), Some("remediating"));

    // The repair controller reports success.
    repairs
        .patch_status(&cr_name, &PatchParams::default(), &Patch::Merge(json!({ "status": { "phase": "Succeeded" } })))
        .await
        .expect("status set");
    let node = eventually("the node to be remediated", Duration::from_secs(30), async || {
        let n = get_node(&w.client, &name).await;
        (state(&n).as_deref() == Some("remediated")).then_some(n)
    })
    .await;
    assert!(cordoned(&node), "remediated nodes wait for healthy evidence before returning");
    let done = w.outcome(v.verdict_id, |o| o.detail.starts_with("remediated")).await;
    assert_eq!(done.status, ActionStatus::Applied);
    assert!(event_reasons(&w.client, &name).await.iter().any(|e| e == "RepairSucceeded"));
    assert_eq!(repairs.list(&ListParams::default()).await.unwrap().items.len(), 1, "no second step");
    r.terminate(Duration::from_secs(20)).await.unwrap_or_else(|e| panic!("{e}"));
    cleanup(&w.client, &[&name], &[&w.ns]).await;
}

fn custom_verdict(node: &str, incident: uuid::Uuid) -> Verdict {
    Verdict {
        severity: Severity::Info,
        rule_id: "xid-45-alone".into(),
        custom_action: Some("restart-fabric-manager".into()),
        reason: "Xid 45 alone on GPU-aaa: restart Fabric Manager".into(),
        ..verdict(node, incident, RecommendedAction::Custom, false)
    }
}

#[tokio::test]
async fn a_custom_action_is_signed_to_the_webhook_under_its_name_and_times_out_to_an_operator() {
    let w = World::new().await;
    let name = w.node().await;
    pod(&w.client, &w.ns, "job-0", &name, json!({})).await;
    let receiver = Receiver::default();
    let (url, ca) = start_receiver(&receiver).await;
    let mut r = w
        .start(&[
            ("GPUMEDIC_REPAIR_WEBHOOK_URL", url),
            ("GPUMEDIC_REPAIR_WEBHOOK_SECRET_FILE", w.file("secret", &format!("{SECRET}\n"))),
            ("GPUMEDIC_REPAIR_WEBHOOK_CA_FILE", w.file("ca.pem", &ca)),
            ("GPUMEDIC_CUSTOM_ACTION_TIMEOUT", "4s".into()),
        ])
        .await;
    let incident = uuid::Uuid::new_v4();
    let v = custom_verdict(&name, incident);
    w.publish(&v).await;
    let first = w.outcome(v.verdict_id, |o| o.action == RecommendedAction::Custom && o.detail.contains("ladder")).await;
    assert_eq!(first.status, ActionStatus::Applied, "{}", first.detail);
    assert!(first.detail.contains("repair ladder started at custom"), "{}", first.detail);

    // One signed call, under the action's name, for step 1 of 1.
    let key = format!("{}:1", v.verdict_id);
    eventually("the custom action's webhook call", Duration::from_secs(60), async || {
        (!receiver.calls_for(&key).is_empty()).then_some(())
    })
    .await;
    let calls = receiver.calls_for(&key);
    assert_eq!(calls.len(), 1, "{calls:?}");
    assert_eq!(calls[0].verified_by.as_deref(), Some(hooks::DEFAULT_KEY_ID), "signed with the shared secret");
    assert_eq!(
        (calls[0].body["action"].as_str(), calls[0].body["step"].as_u64(), calls[0].body["steps"].as_u64()),
        (Some("restart-fabric-manager"), Some(1), Some(1))
    );
    assert_eq!(calls[0].body["timeoutSeconds"].as_u64(), Some(4));
    assert_eq!(calls[0].body["gpu"]["uuid"], "GPU-aaa");
    w.outcome(v.verdict_id, |o| o.detail.contains("restart-fabric-manager handed to the repair hooks")).await;

    // The node is marked, never taken out: the pod stays.
    let node = get_node(&w.client, &name).await;
    assert!(!cordoned(&node) && gpumedic_taints(&node).is_empty(), "a custom action keeps the node in service");
    assert_eq!(state(&node), None);
    assert_eq!(pods_left(&w.client, &w.ns).await, ["job-0"]);

    // No healthy evidence within the timeout: the ladder fails and an operator must act.
    let failed = w.outcome(v.verdict_id, |o| o.detail.starts_with("repair failed")).await;
    assert_eq!((failed.status, failed.action), (ActionStatus::Failed, RecommendedAction::Custom));
    assert!(failed.detail.contains("restart-fabric-manager was the last"), "{}", failed.detail);
    let events = event_reasons(&w.client, &name).await;
    for reason in ["RepairLadderStarted", "RepairStepStarted", "RepairFailed"] {
        assert!(events.iter().any(|e| e == reason), "{reason} missing from {events:?}");
    }
    let node = get_node(&w.client, &name).await;
    assert!(
        conditions(&node).contains(&("GpuUnhealthy".into(), "True".into(), Some("RepairFailed".into()))),
        "{:?}",
        conditions(&node)
    );
    assert!(!cordoned(&node), "still in service");
    // Nothing more is called.
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert_eq!(receiver.calls().len(), 1);
    r.terminate(Duration::from_secs(20)).await.unwrap_or_else(|e| panic!("{e}"));
    cleanup(&w.client, &[&name], &[&w.ns]).await;
}

#[tokio::test]
async fn a_custom_action_through_the_custom_resource_succeeds_and_the_recovery_ends_it() {
    let w = World::new().await;
    install_crd(&w.client).await;
    let name = w.node().await;
    let template = format!(
        "apiVersion: {GROUP}/v1\nkind: GpuRepair\nmetadata:\n  namespace: {}\n\
         spec:\n  nodeName: \"{{{{node}}}}\"\n  operation: \"{{{{action}}}}\"\n",
        w.ns
    );
    let mut r = w.start(&[("GPUMEDIC_REPAIR_RESOURCE_TEMPLATE", w.file("template.yaml", &template))]).await;
    let incident = uuid::Uuid::new_v4();
    let v = custom_verdict(&name, incident);
    w.publish(&v).await;
    let ar = ApiResource::from_gvk_with_plural(&GroupVersionKind::gvk(GROUP, "v1", "GpuRepair"), "gpurepairs");
    let repairs: Api<DynamicObject> = Api::namespaced_with(w.client.clone(), &w.ns, &ar);
    let cr_name = format!("gpumedic-{}-1", v.verdict_id);
    let cr = eventually("the custom action's resource", Duration::from_secs(60), async || {
        repairs.get_opt(&cr_name).await.expect("read the repair resource")
    })
    .await;
    assert_eq!(cr.data["spec"]["operation"], "restart-fabric-manager");
    assert_eq!(cr.data["spec"]["nodeName"], name.as_str());
    repairs
        .patch_status(&cr_name, &PatchParams::default(), &Patch::Merge(json!({ "status": { "phase": "Succeeded" } })))
        .await
        .expect("status set");
    let done = w.outcome(v.verdict_id, |o| o.detail.starts_with("remediated")).await;
    assert_eq!((done.status, done.action), (ActionStatus::Applied, RecommendedAction::Custom));
    let node = get_node(&w.client, &name).await;
    assert!(!cordoned(&node) && state(&node).is_none(), "never out of service");

    // The incident's recovery clears the mark and the ladder record.
    let rec = verdict(&name, incident, RecommendedAction::None, true);
    w.publish(&rec).await;
    w.outcome(rec.verdict_id, |o| o.status == ActionStatus::Applied).await;
    let node = eventually("the ladder record to go", Duration::from_secs(30), async || {
        let n = get_node(&w.client, &name).await;
        (!has_ladder(&n)).then_some(n)
    })
    .await;
    assert!(conditions(&node).iter().all(|(_, status, _)| status != "True"), "{:?}", conditions(&node));
    assert_eq!(repairs.list(&ListParams::default()).await.unwrap().items.len(), 1, "one resource, one run");
    r.terminate(Duration::from_secs(20)).await.unwrap_or_else(|e| panic!("{e}"));
    cleanup(&w.client, &[&name], &[&w.ns]).await;
}

/// The Job's status as the Job controller writes it when its pod succeeded or failed.
fn job_status(passed: bool) -> Value {
    let now = chrono::Utc::now().to_rfc3339_opts(chrono::SecondsFormat::Secs, true);
    let condition = |type_: &str, reason: &str, message: &str| {
        json!({ "type": type_, "status": "True", "reason": reason, "message": message,
                "lastProbeTime": now, "lastTransitionTime": now })
    };
    if passed {
        json!({ "status": { "startTime": now, "completionTime": now, "succeeded": 1, "ready": 0, "terminating": 0,
            "uncountedTerminatedPods": {},
            "conditions": [condition("SuccessCriteriaMet", "CompletionsReached", "Reached expected number of succeeded pods"),
                           condition("Complete", "CompletionsReached", "Reached expected number of succeeded pods")] } })
    } else {
        json!({ "status": { "startTime": now, "failed": 1, "ready": 0, "terminating": 0, "uncountedTerminatedPods": {},
            "conditions": [condition("FailureTarget", "BackoffLimitExceeded", "Job has reached the specified backoff limit"),
                           condition("Failed", "BackoffLimitExceeded", "Job has reached the specified backoff limit")] } })
    }
}

/// A node on a repair ladder (a reset verdict, drained, step 1 handed to the webhook), then its
/// recovery verdict: returns the recovery verdict and the validation Job's name.
async fn repaired_then_recovered(w: &World, name: &str) -> (Verdict, String) {
    let (_, rec, job) = held_for_validation(w, name, "validation Job").await;
    (rec, job)
}

/// As [`repaired_then_recovered`], for a validation the recovery's outcome names with `what`
/// (`validation Job`, `validation webhook call`, `validation resource`): returns the fault
/// verdict, the recovery verdict and the validation's name (its Job or resource).
async fn held_for_validation(w: &World, name: &str, what: &str) -> (Verdict, Verdict, String) {
    let incident = uuid::Uuid::new_v4();
    let v = verdict(name, incident, RecommendedAction::ResetGpu, false);
    w.publish(&v).await;
    w.outcome(v.verdict_id, |o| o.detail.contains("handed to the repair hooks")).await;
    let rec = verdict(name, incident, RecommendedAction::None, true);
    w.publish(&rec).await;
    let held = w.outcome(rec.verdict_id, |o| o.detail.contains(what)).await;
    assert_eq!(held.status, ActionStatus::SkippedByMode, "{}", held.detail);
    let started = w.outcome(v.verdict_id, |o| o.action == RecommendedAction::RunDiagnostics).await;
    assert!(started.detail.starts_with("validating"), "{}", started.detail);
    let job = format!("gpumedic-validate-{}-1", v.verdict_id.simple());
    (v, rec, job)
}

/// Whether the webhook was called for step `step` of a ladder on `node`.
fn called_for_step(receiver: &Receiver, node: &str, step: u64) -> Option<Call> {
    receiver
        .calls()
        .into_iter()
        .find(|c| c.body["node"] == node && c.body["step"] == step && c.body["action"] != "validate")
}

#[tokio::test]
async fn a_validation_job_that_passes_releases_the_node_and_one_that_fails_escalates() {
    let w = World::new().await;
    let (a, b) = (w.node().await, w.node().await);
    let receiver = Receiver::default();
    let (url, ca) = start_receiver(&receiver).await;
    let mut r = w.start(&job_validation_env(&w, &url, &ca, "10m")).await;
    let jobs: Api<k8s_openapi::api::batch::v1::Job> = Api::namespaced(w.client.clone(), &w.ns);

    // A: healthy evidence; the Job runs pinned to the node; the node waits, validating.
    let (rec, job_a) = repaired_then_recovered(&w, &a).await;
    let job =
        eventually("the validation Job", Duration::from_secs(30), async || jobs.get_opt(&job_a).await.unwrap()).await;
    let pod = job.spec.as_ref().unwrap().template.spec.as_ref().unwrap();
    assert_eq!(pod.node_name.as_deref(), Some(a.as_str()), "pinned to the node");
    assert!(
        pod.tolerations.iter().flatten().any(|t| t.key.as_deref() == Some("gpumedic.io/unhealthy")),
        "tolerates gpumedic's taint"
    );
    let command: Vec<String> = pod.containers[0].command.clone().unwrap_or_default();
    assert_eq!(command, ["dcgmi", "diag", "-r", "2"]);
    let node = validating_node(&w.client, &a).await;
    assert!(cordoned(&node), "not released before the Job passes");

    // The test, as the kubelet and the Job controller: the diagnostic passed.
    jobs.patch_status(&job_a, &PatchParams::default(), &Patch::Merge(job_status(true))).await.expect("Job status");
    let node = eventually("node A to return", Duration::from_secs(30), async || {
        let n = get_node(&w.client, &a).await;
        (!cordoned(&n)).then_some(n)
    })
    .await;
    assert!(gpumedic_taints(&node).is_empty() && state(&node).is_none() && !has_ladder(&node));
    w.outcome(rec.verdict_id, |o| o.status == ActionStatus::Applied && o.detail.contains("uncordoned")).await;
    let events = event_reasons(&w.client, &a).await;
    assert!(
        events.iter().any(|e| e == "ValidationStarted") && events.iter().any(|e| e == "ValidationPassed"),
        "{events:?}"
    );

    // B: the diagnostic fails: the ladder escalates to the next rung and the node stays out.
    let (_, job_b) = repaired_then_recovered(&w, &b).await;
    eventually("B's validation Job", Duration::from_secs(30), async || jobs.get_opt(&job_b).await.unwrap()).await;
    jobs.patch_status(&job_b, &PatchParams::default(), &Patch::Merge(job_status(false))).await.expect("Job status");
    let calls = eventually("the second rung's webhook call", Duration::from_secs(30), async || {
        let calls: Vec<Call> =
            receiver.calls().into_iter().filter(|c| c.body["node"] == b.as_str() && c.body["step"] == 2).collect();
        (!calls.is_empty()).then_some(calls)
    })
    .await;
    assert_eq!(calls[0].body["action"], "reboot_node");
    let node = get_node(&w.client, &b).await;
    assert!(cordoned(&node), "a failed validation keeps the node out");
    assert_eq!(state(&node).as_deref(), Some("remediating"));
    let events = event_reasons(&w.client, &b).await;
    assert!(
        events.iter().any(|e| e == "ValidationFailed") && events.iter().any(|e| e == "RepairEscalated"),
        "{events:?}"
    );
    r.terminate(Duration::from_secs(20)).await.unwrap_or_else(|e| panic!("{e}"));
    cleanup(&w.client, &[&a, &b], &[&w.ns]).await;
}

#[tokio::test]
async fn a_validation_job_that_never_finishes_times_out_and_escalates() {
    let w = World::new().await;
    let name = w.node().await;
    let receiver = Receiver::default();
    let (url, ca) = start_receiver(&receiver).await;
    let mut r = w.start(&job_validation_env(&w, &url, &ca, "3s")).await;
    let (_, job) = repaired_then_recovered(&w, &name).await;
    let jobs: Api<k8s_openapi::api::batch::v1::Job> = Api::namespaced(w.client.clone(), &w.ns);
    assert!(jobs.get_opt(&job).await.unwrap().is_some());
    eventually("the second rung's webhook call", Duration::from_secs(30), async || {
        receiver.calls().iter().any(|c| c.body["node"] == name.as_str() && c.body["step"] == 2).then_some(())
    })
    .await;
    let events = event_reasons(&w.client, &name).await;
    assert!(events.iter().any(|e| e == "ValidationFailed"), "{events:?}");
    assert!(cordoned(&get_node(&w.client, &name).await));
    r.terminate(Duration::from_secs(20)).await.unwrap_or_else(|e| panic!("{e}"));
    cleanup(&w.client, &[&name], &[&w.ns]).await;
}

#[tokio::test]
async fn a_webhook_validation_is_polled_under_one_key_and_passes_fails_or_times_out() {
    let w = World::new().await;
    let (a, b, c) = (w.node().await, w.node().await, w.node().await);
    let receiver = Receiver::default();
    let (url, ca) = start_receiver(&receiver).await;
    let mut r = w
        .start(&[
            ("GPUMEDIC_REPAIR_WEBHOOK_URL", url),
            ("GPUMEDIC_REPAIR_WEBHOOK_SECRET", SECRET.to_owned()),
            ("GPUMEDIC_REPAIR_WEBHOOK_CA_FILE", w.file("ca.pem", &ca)),
            ("GPUMEDIC_REPAIR_LADDER", "reset_gpu=10m,reboot_node=10m".into()),
            ("GPUMEDIC_VALIDATION", "webhook".into()),
            ("GPUMEDIC_VALIDATION_TIMEOUT", "20s".into()),
        ])
        .await;
    // B's receiver finds the node still faulty; C's never finishes; A's runs, then passes.
    receiver.validation_answer(&b, "Failed", "PCIe replay counter above threshold on GPU 0");
    let what = "validation webhook call";
    let ((va, rec_a, _), (vb, _, _), (vc, _, _)) = tokio::join!(
        held_for_validation(&w, &a, what),
        held_for_validation(&w, &b, what),
        held_for_validation(&w, &c, what)
    );

    // A: asked for `validate`, signed, polled under one key while it runs; the node waits.
    let key_a = format!("{}:1:validate", va.verdict_id);
    let calls = eventually("A's validation to be asked twice", Duration::from_secs(30), async || {
        let calls = receiver.calls_for(&key_a);
        (calls.len() >= 2).then_some(calls)
    })
    .await;
    assert!(calls.iter().all(|c| c.verified_by.as_deref() == Some(hooks::DEFAULT_KEY_ID)), "{calls:?}");
    assert_eq!((calls[0].body["action"].as_str(), calls[0].body["step"].as_u64()), (Some("validate"), Some(1)));
    assert_eq!(calls[0].body["timeoutSeconds"].as_u64(), Some(20));
    let node = validating_node(&w.client, &a).await;
    assert!(cordoned(&node), "not released while the validation runs");
    receiver.validation_answer(&a, "Succeeded", "dcgmi diag -r 2: all 6 tests passed");
    let node = eventually("node A to return", Duration::from_secs(30), async || {
        let n = get_node(&w.client, &a).await;
        (!cordoned(&n)).then_some(n)
    })
    .await;
    assert!(gpumedic_taints(&node).is_empty() && state(&node).is_none() && !has_ladder(&node));
    let passed = w.outcome(va.verdict_id, |o| o.detail.starts_with("validation passed")).await;
    assert_eq!((passed.action, passed.status), (RecommendedAction::RunDiagnostics, ActionStatus::Applied));
    assert!(passed.detail.contains("all 6 tests passed"), "{}", passed.detail);
    w.outcome(rec_a.verdict_id, |o| o.status == ActionStatus::Applied && o.detail.contains("uncordoned")).await;

    // B: failed, with the receiver's reason; the ladder escalates to the next rung.
    let step2 =
        eventually("B's second rung", Duration::from_secs(30), async || called_for_step(&receiver, &b, 2)).await;
    assert_eq!(step2.body["action"], "reboot_node");
    let failed = w.outcome(vb.verdict_id, |o| o.detail.starts_with("validation failed")).await;
    assert_eq!((failed.action, failed.status), (RecommendedAction::RunDiagnostics, ActionStatus::Failed));
    assert!(failed.detail.contains("PCIe replay counter above threshold"), "{}", failed.detail);
    let node = get_node(&w.client, &b).await;
    assert!(cordoned(&node) && state(&node).as_deref() == Some("remediating"), "B stays out");

    // C: no answer but "running" within 20 s: the validation times out and the ladder escalates.
    eventually("C's second rung", Duration::from_secs(60), async || called_for_step(&receiver, &c, 2)).await;
    let timed_out = w.outcome(vc.verdict_id, |o| o.detail.starts_with("validation failed")).await;
    assert!(timed_out.detail.contains("did not finish within 20s"), "{}", timed_out.detail);
    assert!(cordoned(&get_node(&w.client, &c).await));
    r.terminate(Duration::from_secs(20)).await.unwrap_or_else(|e| panic!("{e}"));
    cleanup(&w.client, &[&a, &b, &c], &[&w.ns]).await;
}

/// A remediator whose repairs and validations are GpuRepair custom resources in the world's
/// namespace (the CRD installed), validations timing out after `timeout`; and the resources' API.
async fn resource_validation(w: &World, timeout: &str) -> (ServiceProcess, Api<DynamicObject>) {
    install_crd(&w.client).await;
    let template = format!(
        "apiVersion: {GROUP}/v1\nkind: GpuRepair\nmetadata:\n  namespace: {}\n\
         spec:\n  nodeName: \"{{{{node}}}}\"\n  operation: \"{{{{action}}}}\"\n",
        w.ns
    );
    let r = w
        .start(&[
            ("GPUMEDIC_REPAIR_RESOURCE_TEMPLATE", w.file("template.yaml", &template)),
            ("GPUMEDIC_REPAIR_LADDER", "reset_gpu=10m,reboot_node=10m".into()),
            ("GPUMEDIC_VALIDATION", "resource".into()),
            ("GPUMEDIC_VALIDATION_TIMEOUT", timeout.into()),
        ])
        .await;
    let ar = ApiResource::from_gvk_with_plural(&GroupVersionKind::gvk(GROUP, "v1", "GpuRepair"), "gpurepairs");
    (r, Api::namespaced_with(w.client.clone(), &w.ns, &ar))
}

#[tokio::test]
async fn a_custom_resource_validation_passes_fails_or_times_out() {
    let w = World::new().await;
    let (a, b, c) = (w.node().await, w.node().await, w.node().await);
    let (mut r, repairs) = resource_validation(&w, "20s").await;
    let what = "validation resource";
    let ((va, rec_a, name_a), (vb, _, name_b), (vc, _, name_c)) = tokio::join!(
        held_for_validation(&w, &a, what),
        held_for_validation(&w, &b, what),
        held_for_validation(&w, &c, what)
    );
    let report = async |name: &str, phase: &str, message: &str| {
        let status = json!({ "status": { "phase": phase, "message": message } });
        repairs.patch_status(name, &PatchParams::default(), &Patch::Merge(status)).await.expect("status set");
    };

    // A: the resource asks for `validate` on the node; its controller reports success.
    let cr = repairs.get_opt(&name_a).await.unwrap().expect("A's validation resource");
    assert_eq!(
        (cr.data["spec"]["operation"].as_str(), cr.data["spec"]["nodeName"].as_str()),
        (Some("validate"), Some(a.as_str()))
    );
    validating_node(&w.client, &a).await;
    report(&name_a, "Succeeded", "burn-in suite passed on 8 GPUs").await;
    eventually("node A to return", Duration::from_secs(30), async || {
        let n = get_node(&w.client, &a).await;
        (!cordoned(&n) && state(&n).is_none()).then_some(())
    })
    .await;
    let passed = w.outcome(va.verdict_id, |o| o.detail.starts_with("validation passed")).await;
    assert!(passed.detail.contains("burn-in suite passed on 8 GPUs"), "{}", passed.detail);
    w.outcome(rec_a.verdict_id, |o| o.status == ActionStatus::Applied && o.detail.contains("uncordoned")).await;

    // B: its controller reports failure: the next rung's resource is created.
    report(&name_b, "Failed", "NVLink errors on GPU 3").await;
    let step2 = format!("gpumedic-{}-2", vb.verdict_id);
    let cr =
        eventually("B's second rung", Duration::from_secs(30), async || repairs.get_opt(&step2).await.unwrap()).await;
    assert_eq!(cr.data["spec"]["operation"], "reboot_node");
    let failed = w.outcome(vb.verdict_id, |o| o.detail.starts_with("validation failed")).await;
    assert_eq!(failed.status, ActionStatus::Failed);
    assert!(failed.detail.contains("NVLink errors on GPU 3"), "{}", failed.detail);
    assert!(cordoned(&get_node(&w.client, &b).await), "B stays out");

    // C: its controller never reports: the validation times out and the ladder escalates.
    assert!(repairs.get_opt(&name_c).await.unwrap().is_some());
    let step2 = format!("gpumedic-{}-2", vc.verdict_id);
    eventually("C's second rung", Duration::from_secs(60), async || repairs.get_opt(&step2).await.unwrap()).await;
    let timed_out = w.outcome(vc.verdict_id, |o| o.detail.starts_with("validation failed")).await;
    assert!(timed_out.detail.contains("did not finish within 20s"), "{}", timed_out.detail);
    r.terminate(Duration::from_secs(20)).await.unwrap_or_else(|e| panic!("{e}"));
    cleanup(&w.client, &[&a, &b, &c], &[&w.ns]).await;
}

/// The validation Job's pod, as the Job controller creates it and the kubelet ends it: its
/// container terminated with `exit_code` and the termination message `message`.
async fn ended_pod(w: &World, job: &str, node: &str, exit_code: i32, message: &str) {
    let name = format!("{job}-x7k2p");
    let labels = json!({ "labels": { "batch.kubernetes.io/job-name": job, "job-name": job } });
    pod(&w.client, &w.ns, &name, node, labels).await;
    let now = chrono::Utc::now().to_rfc3339_opts(chrono::SecondsFormat::Secs, true);
    let reason = if exit_code == 0 { "Completed" } else { "Error" };
    let phase = if exit_code == 0 { "Succeeded" } else { "Failed" };
    let status = json!({ "status": { "phase": phase, "containerStatuses": [{
        "name": "main", "image": "busybox", "imageID": "", "ready": false, "restartCount": 0,
        "state": { "terminated": { "exitCode": exit_code, "reason": reason, "message": message,
                                    "startedAt": now, "finishedAt": now } } }] } });
    let pods: Api<k8s_openapi::api::core::v1::Pod> = Api::namespaced(w.client.clone(), &w.ns);
    pods.patch_status(&name, &PatchParams::default(), &Patch::Merge(status)).await.expect("pod status");
}

#[tokio::test]
async fn a_validation_jobs_result_carries_its_conditions_and_its_pods_termination_message() {
    let w = World::new().await;
    let (a, b) = (w.node().await, w.node().await);
    let receiver = Receiver::default();
    let (url, ca) = start_receiver(&receiver).await;
    let mut r = w.start(&job_validation_env(&w, &url, &ca, "10m")).await;
    let jobs: Api<k8s_openapi::api::batch::v1::Job> = Api::namespaced(w.client.clone(), &w.ns);
    let what = "validation Job";
    let ((va, _, job_a), (vb, _, job_b)) =
        tokio::join!(held_for_validation(&w, &a, what), held_for_validation(&w, &b, what));
    for job in [&job_a, &job_b] {
        eventually("the validation Job", Duration::from_secs(30), async || jobs.get_opt(job).await.unwrap()).await;
    }

    // The test, as the Job controller and the kubelet: A's diagnostic passed, B's failed, each
    // pod with the termination message DCGM's wrapper writes.
    ended_pod(&w, &job_a, &a, 0, "Diagnostic level 2: Deployment Pass, Integration Pass, Hardware Pass").await;
    jobs.patch_status(&job_a, &PatchParams::default(), &Patch::Merge(job_status(true))).await.expect("Job status");
    ended_pod(&w, &job_b, &b, 226, "Diagnostic level 2: Hardware FAIL: PCIe bandwidth 3.1 GB/s on GPU 0").await;
    jobs.patch_status(&job_b, &PatchParams::default(), &Patch::Merge(job_status(false))).await.expect("Job status");

    let passed = w.outcome(va.verdict_id, |o| o.detail.starts_with("validation passed")).await;
    for part in ["CompletionsReached", "exited 0 (Completed)", "Hardware Pass"] {
        assert!(passed.detail.contains(part), "{part} missing from: {}", passed.detail);
    }
    let failed = w.outcome(vb.verdict_id, |o| o.detail.starts_with("validation failed")).await;
    assert_eq!((failed.action, failed.status), (RecommendedAction::RunDiagnostics, ActionStatus::Failed));
    for part in ["BackoffLimitExceeded", "exited 226 (Error)", "PCIe bandwidth 3.1 GB/s on GPU 0"] {
        assert!(failed.detail.contains(part), "{part} missing from: {}", failed.detail);
    }
    let events = events_of(&w.client, &b).await;
    assert!(
        events.iter().any(|(reason, message)| reason == "ValidationFailed" && message.contains("PCIe bandwidth")),
        "{events:?}"
    );
    r.terminate(Duration::from_secs(20)).await.unwrap_or_else(|e| panic!("{e}"));
    cleanup(&w.client, &[&a, &b], &[&w.ns]).await;
}

/// The remediator's settings for a Job validation that may take `timeout`, on a two-rung repair
/// ladder whose webhook is at `url` (CA `ca`).
fn job_validation_env(w: &World, url: &str, ca: &str, timeout: &str) -> Vec<(&'static str, String)> {
    vec![
        ("GPUMEDIC_REPAIR_WEBHOOK_URL", url.to_owned()),
        ("GPUMEDIC_REPAIR_WEBHOOK_SECRET", SECRET.to_owned()),
        ("GPUMEDIC_REPAIR_WEBHOOK_CA_FILE", w.file("ca.pem", ca)),
        ("GPUMEDIC_REPAIR_LADDER", "reset_gpu=10m,reboot_node=10m".into()),
        ("GPUMEDIC_VALIDATION", "job".into()),
        ("GPUMEDIC_VALIDATION_NAMESPACE", w.ns.clone()),
        ("GPUMEDIC_VALIDATION_TIMEOUT", timeout.to_owned()),
    ]
}

/// The remediator's settings for a Job validation with `burn_in`, its webhook at `url` (CA `ca`).
fn burn_in_env(w: &World, url: &str, ca: &str, burn_in: &str) -> Vec<(&'static str, String)> {
    let mut env = job_validation_env(w, url, ca, "10m");
    env.push(("GPUMEDIC_VALIDATION_BURN_IN", burn_in.to_owned()));
    env
}

/// Passes the validation Job `job` of `node` and waits for the node's burn-in to begin.
async fn pass_into_burn_in(w: &World, node: &str, job: &str, fault: &Verdict) {
    let jobs: Api<k8s_openapi::api::batch::v1::Job> = Api::namespaced(w.client.clone(), &w.ns);
    eventually("the validation Job", Duration::from_secs(30), async || jobs.get_opt(job).await.unwrap()).await;
    jobs.patch_status(job, &PatchParams::default(), &Patch::Merge(job_status(true))).await.expect("Job status");
    let passed = w.outcome(fault.verdict_id, |o| o.detail.starts_with("validation passed")).await;
    assert!(passed.detail.contains("burn-in"), "{}", passed.detail);
    let node = eventually("the burn-in to begin", Duration::from_secs(30), async || {
        let n = get_node(&w.client, node).await;
        (state(&n).as_deref() == Some("burn-in")).then_some(n)
    })
    .await;
    assert!(cordoned(&node) && !gpumedic_taints(&node).is_empty(), "still out during the burn-in");
}

#[tokio::test]
async fn a_burn_in_without_a_new_fault_returns_the_node_and_a_new_fault_escalates_the_ladder() {
    let w = World::new().await;
    let (a, b) = (w.node().await, w.node().await);
    let receiver = Receiver::default();
    let (url, ca) = start_receiver(&receiver).await;
    let mut r = w.start(&burn_in_env(&w, &url, &ca, "12s")).await;
    let what = "validation Job";
    let ((va, rec_a, job_a), (vb, _, job_b)) =
        tokio::join!(held_for_validation(&w, &a, what), held_for_validation(&w, &b, what));
    tokio::join!(pass_into_burn_in(&w, &a, &job_a, &va), pass_into_burn_in(&w, &b, &job_b, &vb));

    // B: a new fault on the node during its burn-in (another incident): the repair did not hold,
    // and the ladder escalates to the next rung.
    let fault = verdict(&b, uuid::Uuid::new_v4(), RecommendedAction::ResetGpu, false);
    w.publish(&fault).await;
    let interrupted = w.outcome(vb.verdict_id, |o| o.detail.starts_with("burn-in interrupted")).await;
    assert_eq!((interrupted.action, interrupted.status), (RecommendedAction::RunDiagnostics, ActionStatus::Failed));
    assert!(interrupted.detail.contains(&fault.verdict_id.to_string()), "{}", interrupted.detail);
    let step2 =
        eventually("B's second rung", Duration::from_secs(30), async || called_for_step(&receiver, &b, 2)).await;
    assert_eq!(step2.body["action"], "reboot_node");
    let node = get_node(&w.client, &b).await;
    assert!(cordoned(&node) && state(&node).as_deref() == Some("remediating"), "B stays out");
    assert!(event_reasons(&w.client, &b).await.iter().any(|e| e == "BurnInInterrupted"));

    // A: no new fault for the burn-in's 12 s: it returns, and the held recovery is carried out.
    let node = eventually("node A to return", Duration::from_secs(60), async || {
        let n = get_node(&w.client, &a).await;
        (!cordoned(&n)).then_some(n)
    })
    .await;
    assert!(gpumedic_taints(&node).is_empty() && state(&node).is_none() && !has_ladder(&node));
    let done = w.outcome(va.verdict_id, |o| o.detail.starts_with("burn-in completed")).await;
    assert_eq!((done.action, done.status), (RecommendedAction::RunDiagnostics, ActionStatus::Applied));
    w.outcome(rec_a.verdict_id, |o| o.status == ActionStatus::Applied && o.detail.contains("uncordoned")).await;
    assert!(event_reasons(&w.client, &a).await.iter().any(|e| e == "BurnInCompleted"));
    r.terminate(Duration::from_secs(20)).await.unwrap_or_else(|e| panic!("{e}"));
    cleanup(&w.client, &[&a, &b], &[&w.ns]).await;
}

#[tokio::test]
async fn a_burn_in_survives_a_remediator_restart() {
    let w = World::new().await;
    let name = w.node().await;
    let receiver = Receiver::default();
    let (url, ca) = start_receiver(&receiver).await;
    let env = burn_in_env(&w, &url, &ca, "15s");
    let mut r = w.start(&env).await;
    let (v, rec, job) = held_for_validation(&w, &name, "validation Job").await;
    pass_into_burn_in(&w, &name, &job, &v).await;

    // The remediator goes away during the burn-in: the node stays out, its burn-in on the Node.
    r.terminate(Duration::from_secs(20)).await.unwrap_or_else(|e| panic!("{e}"));
    let node = get_node(&w.client, &name).await;
    assert!(cordoned(&node) && state(&node).as_deref() == Some("burn-in"));
    let raw = node.metadata.annotations.as_ref().unwrap()[LADDER_ANNOTATION].clone();
    let recorded: Value = serde_json::from_str(&raw).unwrap();
    assert_eq!(
        (recorded["phase"].as_str(), recorded["validation"]["burnInSeconds"].as_u64()),
        (Some("burn_in"), Some(15))
    );

    // A new replica takes over and finishes the burn-in, without validating again.
    let mut r = w.start(&env).await;
    eventually("the node to return", Duration::from_secs(60), async || {
        let n = get_node(&w.client, &name).await;
        (!cordoned(&n) && state(&n).is_none()).then_some(())
    })
    .await;
    w.outcome(v.verdict_id, |o| o.detail.starts_with("burn-in completed")).await;
    w.outcome(rec.verdict_id, |o| o.status == ActionStatus::Applied && o.detail.contains("uncordoned")).await;
    let jobs: Api<k8s_openapi::api::batch::v1::Job> = Api::namespaced(w.client.clone(), &w.ns);
    assert_eq!(jobs.list(&ListParams::default()).await.unwrap().items.len(), 1, "one validation, not two");
    r.terminate(Duration::from_secs(20)).await.unwrap_or_else(|e| panic!("{e}"));
    cleanup(&w.client, &[&name], &[&w.ns]).await;
}

/// A node taken out by a verdict asking for `action` (no repair: a cordon or a drain), then its
/// recovery verdict, held for a validation Job: returns the recovery verdict and the Job's name.
async fn quarantined_then_recovered(w: &World, name: &str, action: RecommendedAction, out: &str) -> (Verdict, String) {
    let incident = uuid::Uuid::new_v4();
    let v = verdict(name, incident, action, false);
    w.publish(&v).await;
    eventually("the quarantine", Duration::from_secs(60), async || {
        (state(&get_node(&w.client, name).await).as_deref() == Some(out)).then_some(())
    })
    .await;
    assert!(!has_ladder(&get_node(&w.client, name).await), "no repair ladder");
    let rec = verdict(name, incident, RecommendedAction::None, true);
    w.publish(&rec).await;
    let held = w.outcome(rec.verdict_id, |o| o.detail.contains("validation Job")).await;
    assert_eq!(held.status, ActionStatus::SkippedByMode, "{}", held.detail);
    let started = w.outcome(rec.verdict_id, |o| o.action == RecommendedAction::RunDiagnostics).await;
    assert!(started.detail.starts_with("validating: healthy evidence for a node in quarantine"), "{}", started.detail);
    let job = format!("gpumedic-validate-{}-1", rec.verdict_id.simple());
    (rec, job)
}

#[tokio::test]
async fn a_release_from_a_quarantine_without_a_repair_is_validated_first() {
    let w = World::new().await;
    let (a, b, c, d) = (w.node().await, w.node().await, w.node().await, w.node().await);
    let receiver = Receiver::default();
    let (url, ca) = start_receiver(&receiver).await;
    let mut r = w.start(&job_validation_env(&w, &url, &ca, "20s")).await;
    let jobs: Api<k8s_openapi::api::batch::v1::Job> = Api::namespaced(w.client.clone(), &w.ns);
    let drain = RecommendedAction::Drain;
    let ((rec_a, job_a), (rec_b, job_b), (rec_c, _), (rec_d, job_d)) = tokio::join!(
        quarantined_then_recovered(&w, &a, drain, "drained"),
        quarantined_then_recovered(&w, &b, drain, "drained"),
        quarantined_then_recovered(&w, &c, drain, "drained"),
        quarantined_then_recovered(&w, &d, RecommendedAction::Cordon, "quarantined"),
    );
    for node in [&a, &b, &c, &d] {
        let n = validating_node(&w.client, node).await;
        assert!(cordoned(&n), "{node} waits for its validation");
    }
    for job in [&job_a, &job_b, &job_d] {
        eventually("the validation Job", Duration::from_secs(30), async || jobs.get_opt(job).await.unwrap()).await;
    }

    // A passes: released, and the recovery's outcome follows.
    jobs.patch_status(&job_a, &PatchParams::default(), &Patch::Merge(job_status(true))).await.expect("Job status");
    eventually("node A to return", Duration::from_secs(30), async || {
        let n = get_node(&w.client, &a).await;
        (!cordoned(&n) && state(&n).is_none() && !has_ladder(&n)).then_some(())
    })
    .await;
    w.outcome(rec_a.verdict_id, |o| o.status == ActionStatus::Applied && o.detail.contains("uncordoned")).await;
    let events = event_reasons(&w.client, &a).await;
    assert!(events.iter().any(|e| e == "ValidationPassed"), "{events:?}");
    assert!(!events.iter().any(|e| e == "Remediated"), "nothing was repaired: {events:?}");

    // B fails: drained, so its repair ladder starts at the first rung.
    jobs.patch_status(&job_b, &PatchParams::default(), &Patch::Merge(job_status(false))).await.expect("Job status");
    let step1 = eventually("B's first rung", Duration::from_secs(30), async || called_for_step(&receiver, &b, 1)).await;
    assert_eq!(step1.body["action"], "reset_gpu");
    let refused = w.outcome(rec_b.verdict_id, |o| o.detail.starts_with("validation before release failed")).await;
    assert_eq!(refused.status, ActionStatus::Failed);
    let node = get_node(&w.client, &b).await;
    assert!(cordoned(&node) && state(&node).as_deref() == Some("remediating"), "B stays out");

    // D was only cordoned (its work still runs there): no repair behind its back; it stays out.
    jobs.patch_status(&job_d, &PatchParams::default(), &Patch::Merge(job_status(false))).await.expect("Job status");
    let node = eventually("D to fail", Duration::from_secs(30), async || {
        let n = get_node(&w.client, &d).await;
        (state(&n).as_deref() == Some("failed")).then_some(n)
    })
    .await;
    assert!(cordoned(&node));
    assert!(
        conditions(&node).contains(&("GpuUnhealthy".into(), "True".into(), Some("ValidationFailed".into()))),
        "{:?}",
        conditions(&node)
    );
    w.outcome(rec_d.verdict_id, |o| o.detail.contains("an operator must act")).await;
    assert!(called_for_step(&receiver, &d, 1).is_none(), "no repair for a node that was not drained");
    // The recovery again (as the resync re-issues a resolved incident's): it stays out.
    let again = Verdict { verdict_id: uuid::Uuid::new_v4(), ..rec_d.clone() };
    w.publish(&again).await;
    let held = w.outcome(again.verdict_id, |o| o.detail.contains("until an operator acts")).await;
    assert_eq!(held.status, ActionStatus::SkippedByMode, "{}", held.detail);
    assert!(cordoned(&get_node(&w.client, &d).await), "still out");

    // C never finishes within 20 s: the same as a failure.
    eventually("C's first rung", Duration::from_secs(60), async || called_for_step(&receiver, &c, 1)).await;
    w.outcome(rec_c.verdict_id, |o| o.detail.contains("did not finish within 20s")).await;
    r.terminate(Duration::from_secs(20)).await.unwrap_or_else(|e| panic!("{e}"));
    cleanup(&w.client, &[&a, &b, &c, &d], &[&w.ns]).await;
}

/// The test's validation Job `job`, once the remediator has created it.
async fn validation_job(w: &World, job: &str) -> k8s_openapi::api::batch::v1::Job {
    let jobs: Api<k8s_openapi::api::batch::v1::Job> = Api::namespaced(w.client.clone(), &w.ns);
    eventually("the validation Job", Duration::from_secs(60), async || jobs.get_opt(job).await.unwrap()).await
}

/// Writes the status of the validation Job `job` as the Job controller would: passed or failed.
async fn end_job(w: &World, job: &str, passed: bool) {
    let jobs: Api<k8s_openapi::api::batch::v1::Job> = Api::namespaced(w.client.clone(), &w.ns);
    jobs.patch_status(job, &PatchParams::default(), &Patch::Merge(job_status(passed))).await.expect("Job status");
}

/// Waits until `node` is back in service: uncordoned, without gpumedic's taint, state or ladder.
async fn returned(w: &World, node: &str) {
    eventually("the node to return", Duration::from_secs(60), async || {
        let n = get_node(&w.client, node).await;
        (!cordoned(&n) && gpumedic_taints(&n).is_empty() && state(&n).is_none() && !has_ladder(&n)).then_some(())
    })
    .await;
}

#[tokio::test]
async fn after_a_failed_validation_a_webhook_only_step_is_validated_again_once_it_has_had_its_time() {
    let w = World::new().await;
    let (a, b) = (w.node().await, w.node().await);
    let receiver = Receiver::default();
    let (url, ca) = start_receiver(&receiver).await;
    // The webhook is the only hook: nothing reports a step done, and the incident's recovery
    // verdict, held by the failed validation, is the only healthy evidence there will be.
    let mut env = job_validation_env(&w, &url, &ca, "10m");
    env.push(("GPUMEDIC_REPAIR_LADDER", "reset_gpu=30s,reboot_node=12s".into()));
    let mut r = w.start(&env).await;

    // A: repaired at step 1, recovered, and the validation fails: the ladder escalates to reboot.
    let (va, rec_a, job_a1) = held_for_validation(&w, &a, "validation Job").await;
    validation_job(&w, &job_a1).await;
    end_job(&w, &job_a1, false).await;
    eventually("A's second rung", Duration::from_secs(30), async || called_for_step(&receiver, &a, 2)).await;
    // The remediator goes away during the reboot: the held recovery is on the Node.
    r.terminate(Duration::from_secs(20)).await.unwrap_or_else(|e| panic!("{e}"));
    let node = get_node(&w.client, &a).await;
    assert!(cordoned(&node) && state(&node).as_deref() == Some("remediating"), "A stays out");
    let recorded: Value =
        serde_json::from_str(&node.metadata.annotations.as_ref().unwrap()[LADDER_ANNOTATION]).unwrap();
    assert_eq!(recorded["heldRecovery"]["verdict_id"], rec_a.verdict_id.to_string(), "{recorded}");

    // A new replica: once the reboot has had its 12 s, the node is validated again, and released.
    let mut r = w.start(&env).await;
    let job_a2 = format!("gpumedic-validate-{}-2", va.verdict_id.simple());
    let job = validation_job(&w, &job_a2).await;
    let pod = job.spec.as_ref().unwrap().template.spec.as_ref().unwrap();
    assert_eq!(pod.node_name.as_deref(), Some(a.as_str()), "pinned to the node");
    let again = w.outcome(va.verdict_id, |o| o.detail.contains(&format!("Job {}/{job_a2}", w.ns))).await;
    assert!(again.detail.starts_with("validating: repair step 2/2 reboot_node is over"), "{}", again.detail);
    validating_node(&w.client, &a).await;
    end_job(&w, &job_a2, true).await;
    returned(&w, &a).await;
    w.outcome(rec_a.verdict_id, |o| o.status == ActionStatus::Applied && o.detail.contains("uncordoned")).await;
    let done = w.outcome(va.verdict_id, |o| o.detail.starts_with("remediated")).await;
    assert!(done.detail.contains("reboot_node"), "{}", done.detail);

    // B: drained without a repair; its validation before release fails, so its ladder starts
    // at the first rung; after that rung's time a second validation (a Job of its own) runs.
    let (rec_b, job_b1) = quarantined_then_recovered(&w, &b, RecommendedAction::Drain, "drained").await;
    validation_job(&w, &job_b1).await;
    end_job(&w, &job_b1, false).await;
    eventually("B's first rung", Duration::from_secs(30), async || called_for_step(&receiver, &b, 1)).await;
    let job_b2 = format!("{job_b1}-2");
    validation_job(&w, &job_b2).await;
    end_job(&w, &job_b2, true).await;
    returned(&w, &b).await;
    w.outcome(rec_b.verdict_id, |o| o.status == ActionStatus::Applied && o.detail.contains("uncordoned")).await;
    r.terminate(Duration::from_secs(20)).await.unwrap_or_else(|e| panic!("{e}"));
    cleanup(&w.client, &[&a, &b], &[&w.ns]).await;
}

#[tokio::test]
async fn the_validation_and_burn_in_counters_are_exported_at_zero_from_the_start() {
    let w = World::new().await;
    let receiver = Receiver::default();
    let (url, ca) = start_receiver(&receiver).await;
    let mut r = w.start(&burn_in_env(&w, &url, &ca, "1h")).await;
    let body = testkit::http_get(r.admin_addr(), "/metrics").await.unwrap().1;
    let at_zero = |name: &str, result: &str| {
        body.lines().any(|l| {
            l.starts_with(&format!("{name}{{")) && l.contains(&format!("result=\"{result}\"")) && l.ends_with(" 0")
        })
    };
    for result in ["started", "completed", "interrupted", "held", "restarted"] {
        assert!(at_zero("gpumedic_remediator_burn_ins_total", result), "burn_ins_total {result} missing:\n{body}");
    }
    for result in ["started", "passed", "failed"] {
        assert!(
            at_zero("gpumedic_remediator_validations_total", result),
            "validations_total {result} missing:\n{body}"
        );
    }
    r.terminate(Duration::from_secs(20)).await.unwrap_or_else(|e| panic!("{e}"));
    cleanup(&w.client, &[], &[&w.ns]).await;
}

/// A fault verdict of a new incident on `node`'s GPU `uuid` (index `index`), asking for `action`.
fn fault_on_gpu(node: &str, uuid: &str, index: i32, action: RecommendedAction) -> Verdict {
    let gpu = gpumedic_schemas::health::Entity {
        gpu_uuid: Some(uuid.into()),
        gpu_index: Some(index),
        pci_bus_id: Some(format!("0000:{:02x}:00.0", 0x3b + index)),
        ..Default::default()
    };
    testkit::verdict(node).incident(uuid::Uuid::new_v4()).action(action).entity(gpu).build()
}

#[tokio::test]
async fn a_fault_on_another_gpu_during_the_burn_in_holds_it_until_that_incident_recovers() {
    let w = World::new().await;
    let name = w.node().await;
    let receiver = Receiver::default();
    let (url, ca) = start_receiver(&receiver).await;
    let mut r = w.start(&burn_in_env(&w, &url, &ca, "10s")).await;
    let (v, rec, job) = held_for_validation(&w, &name, "validation Job").await;
    pass_into_burn_in(&w, &name, &job, &v).await;

    // Another incident on another GPU: a new problem, not a repair that did not hold.
    let other = fault_on_gpu(&name, "GPU-bbb", 1, RecommendedAction::ResetGpu);
    w.publish(&other).await;
    let held = w.outcome(v.verdict_id, |o| o.detail.starts_with("burn-in held")).await;
    assert_eq!((held.action, held.status), (RecommendedAction::RunDiagnostics, ActionStatus::Applied));
    assert!(held.detail.contains(&other.incident_id.to_string()), "{}", held.detail);
    w.outcome(other.verdict_id, |_| true).await;
    // Well past the burn-in's 10 s: the node is still out, burning in, on its first rung.
    tokio::time::sleep(Duration::from_secs(16)).await;
    let node = get_node(&w.client, &name).await;
    assert!(cordoned(&node) && state(&node).as_deref() == Some("burn-in"), "the node stays out");
    let recorded: Value =
        serde_json::from_str(&node.metadata.annotations.as_ref().unwrap()[LADDER_ANNOTATION]).unwrap();
    assert_eq!(recorded["current"], 0, "no escalation: {recorded}");
    assert_eq!(recorded["burnInHeldFor"], json!([other.incident_id.to_string()]), "{recorded}");
    assert!(called_for_step(&receiver, &name, 2).is_none(), "no second rung");
    let events = event_reasons(&w.client, &name).await;
    assert!(events.iter().any(|e| e == "BurnInHeld"), "{events:?}");
    assert!(!events.iter().any(|e| e == "BurnInInterrupted" || e == "RepairEscalated"), "{events:?}");

    // The other incident recovers: the burn-in starts over, and the node returns after it.
    let other_rec = Verdict {
        verdict_id: uuid::Uuid::new_v4(),
        recovery: true,
        action: RecommendedAction::None,
        severity: Severity::Info,
        issued_at: chrono::Utc::now(),
        ..other.clone()
    };
    w.publish(&other_rec).await;
    let restarted = w.outcome(v.verdict_id, |o| o.detail.starts_with("burn-in restarted")).await;
    assert!(restarted.detail.contains(&other.incident_id.to_string()), "{}", restarted.detail);
    assert_eq!(state(&get_node(&w.client, &name).await).as_deref(), Some("burn-in"), "not released at once");
    returned(&w, &name).await;
    w.outcome(v.verdict_id, |o| o.detail.starts_with("burn-in completed")).await;
    w.outcome(rec.verdict_id, |o| o.status == ActionStatus::Applied && o.detail.contains("uncordoned")).await;
    assert!(called_for_step(&receiver, &name, 2).is_none(), "no second rung");
    r.terminate(Duration::from_secs(20)).await.unwrap_or_else(|e| panic!("{e}"));
    cleanup(&w.client, &[&name], &[&w.ns]).await;
}

#[tokio::test]
async fn after_a_failed_validation_the_next_rungs_reported_success_is_validated_at_once() {
    let w = World::new().await;
    let name = w.node().await;
    let (mut r, repairs) = resource_validation(&w, "10m").await;
    let report = async |name: &str, phase: &str, message: &str| {
        let status = json!({ "status": { "phase": phase, "message": message } });
        repairs.patch_status(name, &PatchParams::default(), &Patch::Merge(status)).await.expect("status set");
    };
    let (v, rec, first) = held_for_validation(&w, &name, "validation resource").await;
    report(&first, "Failed", "NVLink errors on GPU 0").await;

    // The reboot's controller reports success: the recovery the failed validation held is the
    // healthy evidence, so the node is validated again at once, under the second step's name.
    let step2 = format!("gpumedic-{}-2", v.verdict_id);
    eventually("the second rung", Duration::from_secs(30), async || repairs.get_opt(&step2).await.unwrap()).await;
    report(&step2, "Succeeded", "rebooted").await;
    let second = format!("gpumedic-validate-{}-2", v.verdict_id.simple());
    let cr =
        eventually("the second validation", Duration::from_secs(30), async || repairs.get_opt(&second).await.unwrap())
            .await;
    assert_eq!(cr.data["spec"]["operation"], "validate");
    validating_node(&w.client, &name).await;
    report(&second, "Succeeded", "diag passed after the reboot").await;
    returned(&w, &name).await;
    w.outcome(rec.verdict_id, |o| o.status == ActionStatus::Applied && o.detail.contains("uncordoned")).await;
    let passed = w.outcome(v.verdict_id, |o| o.detail.contains("diag passed after the reboot")).await;
    assert_eq!(passed.status, ActionStatus::Applied);
    r.terminate(Duration::from_secs(20)).await.unwrap_or_else(|e| panic!("{e}"));
    cleanup(&w.client, &[&name], &[&w.ns]).await;
}
