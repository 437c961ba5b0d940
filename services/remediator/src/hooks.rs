//! Repair hooks: how a step of the escalation ladder ([`crate::ladder`]) reaches whatever repairs
//! nodes. Two kinds, either or both:
//!
//! - a **webhook**: an HTTPS POST of a JSON body ([`WebhookBody`]) signed with HMAC-SHA256 under
//!   a shared secret (`X-Gpumedic-Signature: sha256=<hex>`), with `X-Gpumedic-Timestamp` and an
//!   `Idempotency-Key` of `<verdict id>:<step>`, the same across retries, restarts and failovers,
//!   so the receiver does each step once. Connection errors, timeouts, 5xx and 429 are retried
//!   with exponential backoff; any other answer but 2xx fails the step at once. A 2xx means the
//!   receiver took the work, not that the node is repaired: success then comes from healthy
//!   evidence (a recovery verdict) before the step's timeout.
//! - a **custom resource** for a repair controller, rendered from a template of any
//!   apiVersion/kind with the node, GPU, action and verdict filled in, and created under a name
//!   derived from the verdict and the step ([`resource_name`]), so a retry or a new leader finds it
//!   instead of creating a second. The controller reports through a status field (`status.phase`
//!   by default): `Succeeded` ends the ladder, `Failed` escalates.
//!
//! The signature, the body, the retry classification, the template rendering and the phase
//! reading are pure and tested here; [`Webhook`], [`CustomResource`] and [`Hooks`] are the edge.

use std::sync::Arc;
use std::time::Duration;

use chrono::{DateTime, Utc};
use kube::api::{Api, ApiResource, DynamicObject, PostParams};
use kube::core::GroupVersionKind;
use kube::discovery::Scope;
use serde::Serialize;
use serde_json::{Value, json};

use crate::ladder::{Ladder, Report};

/// The header carrying the body's signature.
pub const SIGNATURE_HEADER: &str = "X-Gpumedic-Signature";
/// The header carrying the time of the attempt (Unix seconds).
pub const TIMESTAMP_HEADER: &str = "X-Gpumedic-Timestamp";
/// The header carrying the idempotency key.
pub const IDEMPOTENCY_HEADER: &str = "Idempotency-Key";
/// The label on every custom resource gpumedic creates, naming the node.
pub const NODE_LABEL: &str = "gpumedic.io/node";
/// The label on every custom resource gpumedic creates, naming the verdict (sanitised).
pub const VERDICT_LABEL: &str = "gpumedic.io/verdict-id";

/// Why a step could not be handed to the hooks.
#[derive(Debug, thiserror::Error)]
pub enum HookError {
    /// The receiver refused the step for good (a 4xx other than 429, a template the API server
    /// rejects): the step has failed.
    #[error("the repair hook refused the step: {0}")]
    Refused(String),
    /// The receiver could not be reached or kept failing through every retry: the step stays
    /// pending and is tried again at the next look, until its timeout.
    #[error("the repair hook is unavailable: {0}")]
    Unavailable(String),
    /// The webhook client could not be built (a bad CA bundle).
    #[error("cannot build the webhook client: {0}")]
    Client(String),
}

/// A secret that does not print itself.
#[derive(Clone, PartialEq, Eq)]
pub struct Secret(pub Vec<u8>);

impl std::fmt::Debug for Secret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Secret(<redacted>)")
    }
}

/// `sha256=<hex>`: the HMAC-SHA256 of `body` under `secret`, as sent in [`SIGNATURE_HEADER`].
pub fn signature(secret: &[u8], body: &[u8]) -> String {
    let key = ring::hmac::Key::new(ring::hmac::HMAC_SHA256, secret);
    format!("sha256={}", hex::encode(ring::hmac::sign(&key, body).as_ref()))
}

/// Checks a [`SIGNATURE_HEADER`] value against `body` in constant time (what a receiver does).
pub fn verify(secret: &[u8], body: &[u8], header: &str) -> bool {
    let Some(tag) = header.strip_prefix("sha256=").and_then(|h| hex::decode(h).ok()) else { return false };
    let key = ring::hmac::Key::new(ring::hmac::HMAC_SHA256, secret);
    ring::hmac::verify(&key, body, &tag).is_ok()
}

/// The idempotency key of step `step` (from 1) of the ladder started by `verdict_id`.
pub fn idempotency_key(verdict_id: &str, step: usize) -> String {
    format!("{verdict_id}:{step}")
}

/// The GPU in a webhook body.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct WebhookGpu {
    /// The GPU's UUID.
    pub uuid: String,
    /// Its PCI bus id.
    pub pci_bus_id: String,
    /// Its NVML index; `null` when the verdict does not know it.
    pub index: Option<u32>,
}

/// The JSON body of a webhook call (see docs/operations.md for the contract).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct WebhookBody {
    /// The verdict that started the ladder.
    pub verdict_id: String,
    /// Its incident.
    pub incident_id: String,
    /// The node to repair.
    pub node: String,
    /// The faulty GPU, when the verdict names one.
    pub gpu: Option<WebhookGpu>,
    /// The repair asked for (`reset_gpu`, `reboot_node`, `replace_node`, `contact_support`).
    pub action: String,
    /// The step's number in the ladder, from 1.
    pub step: usize,
    /// How many steps the ladder has.
    pub steps: usize,
    /// The attempt of this step's call, from 1 (a receiver deduplicates on the key, not on this).
    pub attempt: u32,
    /// The step's timeout: the receiver has this long before gpumedic escalates.
    pub timeout_seconds: u64,
    /// The condition reason (`Xid79`).
    pub reason: String,
    /// The verdict's sentence for humans.
    pub message: String,
    /// When this attempt was sent (RFC 3339); receivers should refuse stale ones.
    pub timestamp: String,
}

impl WebhookBody {
    /// The body for attempt `attempt` of the current step of `ladder`, sent at `now`.
    pub fn new(ladder: &Ladder, attempt: u32, now: DateTime<Utc>) -> Self {
        let r = &ladder.request;
        Self {
            verdict_id: ladder.verdict_id.clone(),
            incident_id: r.incident_id.clone(),
            node: r.node.clone(),
            gpu: r.gpu.as_ref().map(|g| WebhookGpu {
                uuid: g.uuid.clone(),
                pci_bus_id: g.pci_bus_id.clone(),
                index: g.index,
            }),
            action: ladder.step().action.name().to_owned(),
            step: ladder.step_number(),
            steps: ladder.steps.len(),
            attempt,
            timeout_seconds: ladder.step().timeout_seconds,
            reason: r.reason.clone(),
            message: r.message.clone(),
            timestamp: now.to_rfc3339_opts(chrono::SecondsFormat::Secs, true),
        }
    }
}

/// What one webhook answer means.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Answer {
    /// Taken.
    Accepted,
    /// Try again after a backoff (5xx, 429, 408).
    Retry,
    /// Refused for good (any other status).
    Refused,
}

/// Classifies an HTTP status of a webhook answer.
pub fn classify(status: u16) -> Answer {
    match status {
        200..=299 => Answer::Accepted,
        408 | 429 | 500..=599 => Answer::Retry,
        _ => Answer::Refused,
    }
}

/// The wait before retry `attempt` (from 1): `initial` doubled each time, at most 30 s.
pub fn backoff(initial: Duration, attempt: u32) -> Duration {
    initial.saturating_mul(1 << attempt.saturating_sub(1).min(16)).min(Duration::from_secs(30))
}

/// The webhook's settings, from the flags.
#[derive(Debug, Clone)]
pub struct WebhookSettings {
    /// Where to POST.
    pub url: reqwest::Url,
    /// The shared HMAC secret.
    pub secret: Secret,
    /// One request's time limit.
    pub timeout: Duration,
    /// Attempts per call, the first included.
    pub attempts: u32,
    /// The first backoff; it doubles.
    pub backoff: Duration,
    /// Extra trusted CA certificates (PEM), for a receiver behind a private CA.
    pub ca_pem: Option<Vec<u8>>,
}

/// The webhook edge.
#[derive(Clone)]
pub struct Webhook {
    client: reqwest::Client,
    settings: WebhookSettings,
}

impl Webhook {
    /// A client for `settings`: rustls, no redirects (a signed POST is not re-sent elsewhere).
    pub fn new(settings: WebhookSettings) -> Result<Self, HookError> {
        let mut builder = reqwest::Client::builder()
            .use_rustls_tls()
            .timeout(settings.timeout)
            .redirect(reqwest::redirect::Policy::none())
            .user_agent(concat!("gpumedic-remediator/", env!("CARGO_PKG_VERSION")));
        if let Some(pem) = &settings.ca_pem {
            let certs = reqwest::Certificate::from_pem_bundle(pem).map_err(|e| HookError::Client(e.to_string()))?;
            if certs.is_empty() {
                return Err(HookError::Client("the CA bundle holds no certificate".to_owned()));
            }
            for cert in certs {
                builder = builder.add_root_certificate(cert);
            }
        }
        let client = builder.build().map_err(|e| HookError::Client(e.to_string()))?;
        Ok(Self { client, settings })
    }

    /// Calls the webhook for the current step of `ladder`, retrying what may be retried;
    /// returns how many attempts it took.
    pub async fn call(&self, ladder: &Ladder) -> Result<u32, HookError> {
        let key = idempotency_key(&ladder.verdict_id, ladder.step_number());
        let mut last = String::new();
        for attempt in 1..=self.settings.attempts.max(1) {
            if attempt > 1 {
                tokio::time::sleep(backoff(self.settings.backoff, attempt - 1)).await;
            }
            let now = Utc::now();
            let body = serde_json::to_vec(&WebhookBody::new(ladder, attempt, now)).expect("the body serializes");
            let sent = self
                .client
                .post(self.settings.url.clone())
                .header(reqwest::header::CONTENT_TYPE, "application/json")
                .header(SIGNATURE_HEADER, signature(&self.settings.secret.0, &body))
                .header(TIMESTAMP_HEADER, now.timestamp().to_string())
                .header(IDEMPOTENCY_HEADER, &key)
                .body(body)
                .send()
                .await;
            let (answer, what) = match sent {
                Ok(response) => {
                    let status = response.status().as_u16();
                    (classify(status), format!("HTTP {status}"))
                }
                Err(e) => (Answer::Retry, format!("{e}")),
            };
            let result = match answer {
                Answer::Accepted => "accepted",
                Answer::Retry => "retried",
                Answer::Refused => "refused",
            };
            metrics::counter!("gpumedic_remediator_webhook_requests_total", "result" => result).increment(1);
            match answer {
                Answer::Accepted => return Ok(attempt),
                Answer::Refused => return Err(HookError::Refused(format!("{what} for {key}"))),
                Answer::Retry => {
                    tracing::warn!(%key, attempt, answer = %what, "The repair webhook did not take the step; retrying.");
                    last = what;
                }
            }
        }
        Err(HookError::Unavailable(format!("{last} after {} attempts for {key}", self.settings.attempts.max(1))))
    }
}

/// The custom resource hook's settings, from the flags.
#[derive(Debug, Clone)]
pub struct ResourceSettings {
    /// The template (YAML parsed to JSON), with `{{...}}` placeholders in its strings.
    pub template: Value,
    /// The dotted path of the field the repair controller reports in (`status.phase`).
    pub status_path: String,
    /// The namespace of a namespaced kind whose template names none (the remediator's own).
    pub default_namespace: String,
}

/// Checks a template: an object with apiVersion and kind. Returns its group/version/kind.
pub fn template_kind(template: &Value) -> Result<GroupVersionKind, String> {
    let api_version = template["apiVersion"].as_str().ok_or("the template has no apiVersion")?;
    let kind = template["kind"].as_str().ok_or("the template has no kind")?;
    let (group, version) = api_version.rsplit_once('/').unwrap_or(("", api_version));
    if version.is_empty() || kind.is_empty() {
        return Err(format!("'{api_version}' / '{kind}' does not name a kind"));
    }
    Ok(GroupVersionKind::gvk(group, version, kind))
}

/// The name of the resource for step `step` of the ladder started by `verdict_id`: the same for
/// every attempt, so creating it twice finds the first.
pub fn resource_name(verdict_id: &str, step: usize) -> String {
    let id: String =
        verdict_id.to_ascii_lowercase().chars().map(|c| if c.is_ascii_alphanumeric() { c } else { '-' }).collect();
    let mut name = format!("gpumedic-{}-{step}", id.trim_matches('-'));
    name.truncate(253);
    name
}

/// Renders the template for the current step of `ladder`: every `{{key}}` in its strings is
/// replaced (`node`, `gpu_uuid`, `gpu_index`, `pci_bus_id`, `action`, `step`, `verdict_id`,
/// `incident_id`, `reason`, `message`, `name`), working on parsed values so a value cannot change the
/// document's shape; then the name and gpumedic's labels are set.
pub fn render(template: &Value, ladder: &Ladder) -> Value {
    let r = &ladder.request;
    let name = resource_name(&ladder.verdict_id, ladder.step_number());
    let gpu = r.gpu.as_ref();
    let vars: [(&str, String); 11] = [
        ("node", r.node.clone()),
        ("gpu_uuid", gpu.map(|g| g.uuid.clone()).unwrap_or_default()),
        ("gpu_index", gpu.and_then(|g| g.index).map(|i| i.to_string()).unwrap_or_default()),
        ("pci_bus_id", gpu.map(|g| g.pci_bus_id.clone()).unwrap_or_default()),
        ("action", ladder.step().action.name().to_owned()),
        ("step", ladder.step_number().to_string()),
        ("verdict_id", ladder.verdict_id.clone()),
        ("incident_id", r.incident_id.clone()),
        ("reason", r.reason.clone()),
        ("message", r.message.clone()),
        ("name", name.clone()),
    ];
    fn fill(v: &mut Value, vars: &[(&str, String)]) {
        match v {
            Value::String(s) => {
                for (k, value) in vars {
                    let placeholder = format!("{{{{{k}}}}}");
                    if s.contains(&placeholder) {
                        *s = s.replace(&placeholder, value);
                    }
                }
            }
            Value::Array(items) => items.iter_mut().for_each(|i| fill(i, vars)),
            Value::Object(map) => map.values_mut().for_each(|i| fill(i, vars)),
            _ => {}
        }
    }
    let mut object = template.clone();
    fill(&mut object, &vars);
    if !object["metadata"].is_object() {
        object["metadata"] = json!({});
    }
    object["metadata"]["name"] = json!(name);
    if !object["metadata"]["labels"].is_object() {
        object["metadata"]["labels"] = json!({});
    }
    let label = |s: &str| -> String {
        let mut v: String =
            s.chars().map(|c| if c.is_ascii_alphanumeric() || "-_.".contains(c) { c } else { '-' }).collect();
        v.truncate(63);
        v.trim_matches(|c: char| !c.is_ascii_alphanumeric()).to_owned()
    };
    object["metadata"]["labels"][NODE_LABEL] = json!(label(&r.node));
    object["metadata"]["labels"][VERDICT_LABEL] = json!(label(&ladder.verdict_id));
    object
}

/// What the repair controller reports in `object` at the dotted `path`: `Succeeded` or `Failed`
/// (any case), with `status.message` as the reason of a failure; anything else is still working.
pub fn report_of(object: &Value, path: &str) -> Report {
    let phase = path.split('.').filter(|p| !p.is_empty()).try_fold(object, |v, key| v.get(key)).and_then(Value::as_str);
    match phase.map(str::to_ascii_lowercase).as_deref() {
        Some("succeeded") => Report::Succeeded,
        Some("failed") => Report::Failed(object["status"]["message"].as_str().map_or_else(
            || "the repair controller reported Failed".to_owned(),
            |m| format!("the repair controller reported Failed: {m}"),
        )),
        _ => Report::Working,
    }
}

/// The custom resource edge; the kind is looked up (discovery) on first use, so the remediator
/// starts before the repair controller's CRD is installed.
#[derive(Clone)]
pub struct CustomResource {
    client: kube::Client,
    settings: ResourceSettings,
    gvk: GroupVersionKind,
    resolved: Arc<tokio::sync::OnceCell<(ApiResource, bool)>>,
}

impl CustomResource {
    /// The hook for `settings`, creating resources with `client`.
    pub fn new(client: kube::Client, settings: ResourceSettings) -> Result<Self, String> {
        let gvk = template_kind(&settings.template)?;
        Ok(Self { client, settings, gvk, resolved: Arc::new(tokio::sync::OnceCell::new()) })
    }

    async fn api(&self, object: &Value) -> Result<Api<DynamicObject>, HookError> {
        let (resource, namespaced) = self
            .resolved
            .get_or_try_init(|| async {
                let (ar, caps) = kube::discovery::pinned_kind(&self.client, &self.gvk).await.map_err(|e| {
                    HookError::Unavailable(format!(
                        "cannot find {}/{} {}: {e}",
                        self.gvk.group, self.gvk.version, self.gvk.kind
                    ))
                })?;
                Ok::<_, HookError>((ar, caps.scope == Scope::Namespaced))
            })
            .await?;
        Ok(if *namespaced {
            let ns = object["metadata"]["namespace"].as_str().unwrap_or(&self.settings.default_namespace);
            Api::namespaced_with(self.client.clone(), ns, resource)
        } else {
            Api::all_with(self.client.clone(), resource)
        })
    }

    /// Creates the resource for the current step of `ladder`; one that exists already (a retry,
    /// a new leader) is fine. Returns its name.
    pub async fn create(&self, ladder: &Ladder) -> Result<String, HookError> {
        let object = render(&self.settings.template, ladder);
        let api = self.api(&object).await?;
        let name = object["metadata"]["name"].as_str().unwrap_or_default().to_owned();
        let dynamic: DynamicObject =
            serde_json::from_value(object).map_err(|e| HookError::Refused(format!("the rendered template: {e}")))?;
        match api.create(&PostParams::default(), &dynamic).await {
            Ok(_) => Ok(name),
            Err(kube::Error::Api(s)) if s.is_already_exists() => Ok(name),
            // The API server refuses the object itself (schema, admission, RBAC): no retry mends that.
            Err(kube::Error::Api(s)) if (400..500).contains(&s.code) && s.code != 429 && s.code != 409 => {
                Err(HookError::Refused(format!("{} {name}: {}", self.gvk.kind, s.message)))
            }
            Err(e) => Err(HookError::Unavailable(format!("{} {name}: {e}", self.gvk.kind))),
        }
    }

    /// What the repair controller reports about the current step of `ladder`.
    pub async fn report(&self, ladder: &Ladder) -> Result<Report, HookError> {
        let object = render(&self.settings.template, ladder);
        let api = self.api(&object).await?;
        let name = resource_name(&ladder.verdict_id, ladder.step_number());
        match api.get_opt(&name).await {
            Ok(Some(found)) => {
                let value = serde_json::to_value(&found).unwrap_or_default();
                Ok(report_of(&value, &self.settings.status_path))
            }
            // Deleted by someone: nothing to read; the step's timeout decides.
            Ok(None) => Ok(Report::Working),
            Err(e) => Err(HookError::Unavailable(format!("{} {name}: {e}", self.gvk.kind))),
        }
    }
}

/// The configured hooks together.
#[derive(Clone, Default)]
pub struct Hooks {
    /// The webhook, when configured.
    pub webhook: Option<Webhook>,
    /// The custom resource, when configured.
    pub resource: Option<CustomResource>,
}

impl Hooks {
    /// Whether any hook is configured.
    pub fn any(&self) -> bool {
        self.webhook.is_some() || self.resource.is_some()
    }

    /// Hands the current step of `ladder` to every hook: the webhook first, then the resource.
    /// Returns a sentence for the step's Event and outcome.
    pub async fn start(&self, ladder: &Ladder) -> Result<String, HookError> {
        let mut parts = Vec::new();
        if let Some(w) = &self.webhook {
            let attempts = w.call(ladder).await?;
            parts.push(format!("webhook accepted it after {attempts} attempt(s)"));
        }
        if let Some(r) = &self.resource {
            let name = r.create(ladder).await?;
            parts.push(format!("{} {name} created", r.gvk.kind));
        }
        Ok(parts.join("; "))
    }

    /// What the hooks report about the current (running) step; a webhook does not report back.
    pub async fn report(&self, ladder: &Ladder) -> Result<Report, HookError> {
        match &self.resource {
            Some(r) => r.report(ladder).await,
            None => Ok(Report::Working),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ladder::{Ladder, parse_steps};
    use crate::request::{Action, GpuRef, Remediation, Subsystem};
    use gpumedic_schemas::verdict::RecommendedAction;

    fn ladder() -> Ladder {
        let request = Remediation {
            node: "gpu-1".into(),
            gpu: Some(GpuRef { uuid: "GPU-abc".into(), pci_bus_id: "0000:3b:00.0".into(), index: Some(2) }),
            action: Action::ResetGpu,
            subsystem: Subsystem::Gpu,
            reason: "Xid79".into(),
            message: "GPU has \"fallen\" off the bus".into(),
            verdict_id: "7b2c7a4e-0000-4000-8000-000000000001".into(),
            incident_id: "i1".into(),
            recovery: false,
        };
        let steps = parse_steps("reset_gpu=10m,reboot_node=30m", Duration::from_secs(60)).unwrap();
        Ladder::new(&request.verdict_id, RecommendedAction::ResetGpu, &request, &steps, Utc::now())
    }

    #[test]
    fn signature_matches_a_known_vector_and_verifies() {
        // RFC 4231 test case 2.
        let sig = signature(b"Jefe", b"what do ya want for nothing?");
        assert_eq!(sig, "sha256=5bdcc146bf60754e6a042426089575c75a003f089d2739839dec58b964ec3843");
        assert!(verify(b"Jefe", b"what do ya want for nothing?", &sig));
        assert!(!verify(b"Jefe", b"what do ya want for something?", &sig));
        assert!(!verify(b"other", b"what do ya want for nothing?", &sig));
        assert!(!verify(b"Jefe", b"what do ya want for nothing?", "5bdcc146"));
    }

    #[test]
    fn retries_are_for_5xx_429_and_408_only() {
        assert_eq!(classify(200), Answer::Accepted);
        assert_eq!(classify(202), Answer::Accepted);
        for s in [500, 502, 503, 429, 408] {
            assert_eq!(classify(s), Answer::Retry, "{s}");
        }
        for s in [400, 401, 403, 404, 409, 422, 301] {
            assert_eq!(classify(s), Answer::Refused, "{s}");
        }
        assert_eq!(backoff(Duration::from_millis(200), 1), Duration::from_millis(200));
        assert_eq!(backoff(Duration::from_millis(200), 3), Duration::from_millis(800));
        assert_eq!(backoff(Duration::from_secs(1), 40), Duration::from_secs(30));
    }

    #[test]
    fn the_key_and_the_name_depend_on_the_verdict_and_step_only() {
        let mut l = ladder();
        let a = WebhookBody::new(&l, 1, Utc::now());
        let b = WebhookBody::new(&l, 2, Utc::now());
        assert_ne!(a, b, "the attempt is in the body");
        assert_eq!(idempotency_key(&l.verdict_id, l.step_number()), "7b2c7a4e-0000-4000-8000-000000000001:1");
        assert_eq!(resource_name(&l.verdict_id, 1), "gpumedic-7b2c7a4e-0000-4000-8000-000000000001-1");
        l.escalate("timed out", Utc::now());
        let c = WebhookBody::new(&l, 1, Utc::now());
        assert_eq!((c.step, c.steps, c.action.as_str()), (2, 2, "reboot_node"));
        assert_eq!(resource_name("Verdict_X", 2), "gpumedic-verdict-x-2");
    }

    #[test]
    fn the_template_is_filled_without_changing_its_shape() {
        let template: Value = serde_yaml::from_str(
            "apiVersion: repair.example.com/v1\nkind: GpuRepair\nmetadata:\n  labels:\n    team: infra\n\
             spec:\n  nodeName: '{{node}}'\n  gpu: '{{gpu_uuid}} #{{gpu_index}}'\n  operation: '{{action}}'\n  \
             note: '{{message}}'\n  ref: '{{verdict_id}}/{{step}}'\n",
        )
        .unwrap();
        assert_eq!(template_kind(&template).unwrap(), GroupVersionKind::gvk("repair.example.com", "v1", "GpuRepair"));
        let object = render(&template, &ladder());
        assert_eq!(object["metadata"]["name"], "gpumedic-7b2c7a4e-0000-4000-8000-000000000001-1");
        assert_eq!(object["metadata"]["labels"]["team"], "infra");
        assert_eq!(object["metadata"]["labels"][NODE_LABEL], "gpu-1");
        assert_eq!(object["spec"]["nodeName"], "gpu-1");
        assert_eq!(object["spec"]["gpu"], "GPU-abc #2");
        assert_eq!(object["spec"]["operation"], "reset_gpu");
        assert_eq!(object["spec"]["note"], "GPU has \"fallen\" off the bus");
        assert_eq!(object["spec"]["ref"], "7b2c7a4e-0000-4000-8000-000000000001/1");
        assert!(template_kind(&json!({ "kind": "X" })).is_err());
    }

    #[test]
    fn the_phase_is_read_at_the_configured_path() {
        assert_eq!(report_of(&json!({}), "status.phase"), Report::Working);
        assert_eq!(report_of(&json!({ "status": { "phase": "Running" } }), "status.phase"), Report::Working);
        assert_eq!(report_of(&json!({ "status": { "phase": "Succeeded" } }), "status.phase"), Report::Succeeded);
        assert!(matches!(
            report_of(&json!({ "status": { "phase": "Failed", "message": "BMC down" } }), "status.phase"),
            Report::Failed(m) if m.contains("BMC down")
        ));
        assert_eq!(
            report_of(&json!({ "status": { "result": { "state": "succeeded" } } }), "status.result.state"),
            Report::Succeeded
        );
    }
}
