//! The remediator: turns verdicts into changes on the cluster (node conditions, taints, labels,
//! cordon, drain, repair hooks) within strict safety limits, and publishes what it did on
//! `gpumedic.actions.v1`. One replica leads at a time.
//!
//! This crate holds the service frame (configuration, leadership, the consumer group on the
//! verdict topic, the Kubernetes client and readiness) and the remediation core:
//! - [`request`]: what is asked ([`request::Remediation`]), independent of the verdict's wire format;
//! - [`plan`]: the pure planner, node as it is + request + mode -> exact changes or "nothing, because";
//! - [`safety`]: the circuit breaker and the quarantine rate limit, pure with the clock passed in;
//! - [`drain`]: which pods leave (pure) and the Eviction API drain (edge);
//! - [`apply`]: the thin Kubernetes edge that carries plans out and records Events;
//! - [`lease`]: leader election over a `coordination.k8s.io` Lease (pure decision, thin edge);
//! - [`control`]: the status object (breaker state, pause, reset requests) shared with the CLI;
//! - [`window`] and [`maintenance`]: maintenance windows (pure) and deferred actions (edge);
//! - [`ladder`] and [`hooks`]: the repair escalation ladder (pure, durable on the node) and the
//!   repair hooks it calls (a signed webhook, a custom resource), full-remediation mode only;
//! - [`verdicts`]: verdict in, action outcome out.
//!
//! Only the leader consumes: it joins the consumer group when it takes the lease and leaves it
//! when it loses or releases the lease, so the partitions move to the next leader. Each verdict
//! is applied (or deliberately not, with the reason), the outcome is published on
//! `gpumedic.actions.v1` and acknowledged, and only then is the verdict's offset stored. Applying
//! the same verdict twice yields one action (`already_done` the second time), which is what lets
//! a new leader pick up a verdict the old one was in the middle of.

pub mod apply;
pub mod control;
pub mod drain;
pub mod hooks;
pub mod ladder;
pub mod lease;
pub mod maintenance;
pub mod plan;
pub mod request;
pub mod safety;
pub mod verdicts;
pub mod window;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use clap::Parser;
use gpumedic_runtime::BoxError;
use gpumedic_runtime::admin::ReadyFlag;
use gpumedic_runtime::config::{CommonArgs, CommonConfig, Problems, Validate, parse_duration};
use gpumedic_runtime::kafka::{
    self, HandleError, KafkaArgs, KafkaSettings, Producer, Record, RecordHandler, record_headers,
};
use gpumedic_runtime::keyed;
use gpumedic_runtime::service::Service;
use gpumedic_runtime::shutdown::ShutdownError;
use gpumedic_schemas::{ActionOutcome, ActionStatus, Codec, Record as _, Severity, Verdict, topics};
use tokio_util::sync::CancellationToken;

use crate::apply::{ApplyError, Outcome, Remediator, Settings};
use crate::control::StatusClient;
use crate::drain::{DrainMode, DrainPolicy};
use crate::lease::{LeaseClient, LeaseSettings, Validity};
use crate::plan::{Mode, Policy, Skip};
use crate::request::Action;
use crate::safety::{BreakerLimits, Gate};
use crate::window::Window;

/// The service's name, as used in metric names and logs.
pub const NAME: &str = "remediator";

/// Command-line flags and environment variables.
#[derive(Debug, Parser)]
#[command(name = "gpumedic-remediator", version, about = "Applies verdicts to Kubernetes nodes, safely.")]
pub struct Args {
    #[command(flatten)]
    common: CommonArgs,
    #[command(flatten)]
    kafka: KafkaArgs,
    /// Kafka consumer group shared by all remediator replicas.
    #[arg(long, env = "GPUMEDIC_GROUP", default_value = "gpumedic-remediator")]
    group: String,
    /// The topic verdicts are read from (the public contract's; another one only for staging
    /// side by side or tests).
    #[arg(long, env = "GPUMEDIC_VERDICTS_TOPIC", default_value = topics::VERDICTS)]
    verdicts_topic: String,
    /// The topic action outcomes are published on (as --verdicts-topic).
    #[arg(long, env = "GPUMEDIC_ACTIONS_TOPIC", default_value = topics::ACTIONS)]
    actions_topic: String,
    /// How far the remediator may go: `monitor-only` (decide and report, change nothing),
    /// `cordon-drain`, or `full-remediation` (adds repair hooks).
    #[arg(long, env = "GPUMEDIC_MODE", default_value = "monitor-only")]
    mode: String,
    /// Label selector of the GPU nodes the breaker's share is measured against.
    #[arg(long, env = "GPUMEDIC_GPU_NODE_SELECTOR", default_value = "nvidia.com/gpu.present=true")]
    gpu_node_selector: String,
    /// Circuit breaker: the largest share of GPU nodes quarantined within the window (0..1).
    #[arg(long, env = "GPUMEDIC_BREAKER_MAX_SHARE", default_value_t = 0.1)]
    breaker_max_share: f64,
    /// Circuit breaker: the largest number of GPU nodes quarantined within the window.
    #[arg(long, env = "GPUMEDIC_BREAKER_MAX_COUNT", default_value_t = 50)]
    breaker_max_count: usize,
    /// Circuit breaker window.
    #[arg(long, env = "GPUMEDIC_BREAKER_WINDOW", default_value = "1h")]
    breaker_window: String,
    /// New quarantines allowed per minute.
    #[arg(long, env = "GPUMEDIC_QUARANTINES_PER_MINUTE", default_value_t = 20)]
    quarantines_per_minute: usize,
    /// How long a drain may take before it is reported incomplete.
    #[arg(long, env = "GPUMEDIC_DRAIN_DEADLINE", default_value = "5m")]
    drain_deadline: String,
    /// Grace period for evicted pods, overriding the pods' own (unset: theirs).
    #[arg(long, env = "GPUMEDIC_DRAIN_GRACE_SECONDS")]
    drain_grace_seconds: Option<i64>,
    /// Evict only the pods on the faulty GPU when the verdict names one.
    #[arg(long, env = "GPUMEDIC_PARTIAL_DRAIN")]
    partial_drain: bool,
    /// Verdicts issued longer ago than this are reported and not acted on (recoveries still
    /// are): a new consumer group, or one that was down for hours, must not quarantine nodes for
    /// faults that were judged long ago.
    #[arg(long, env = "GPUMEDIC_MAX_VERDICT_AGE", default_value = "15m")]
    max_verdict_age: String,
    /// Verdicts handled at once, for different nodes (one node's verdicts always run in order).
    /// Quarantine is mostly waiting on the apiserver, so this is what lets a mass failure be
    /// quarantined in seconds; the breaker and rate limit still count every admission.
    #[arg(long, env = "GPUMEDIC_MAX_IN_FLIGHT", default_value_t = 64)]
    max_in_flight: usize,
    /// The namespace of the leader-election Lease and the status object: the remediator's own
    /// (unset: $POD_NAMESPACE, else `gpumedic`).
    #[arg(long, env = "GPUMEDIC_LEASE_NAMESPACE")]
    lease_namespace: Option<String>,
    /// The leader-election Lease, shared by the replicas of one deployment.
    #[arg(long, env = "GPUMEDIC_LEASE_NAME", default_value = "gpumedic-remediator")]
    lease_name: String,
    /// How long a lease that is not renewed stays valid: the longest a failover takes.
    #[arg(long, env = "GPUMEDIC_LEASE_DURATION", default_value = "15s")]
    lease_duration: String,
    /// How often the leader renews the lease and a standby looks at it. The leader stops acting
    /// when it could not renew for the lease duration less this.
    #[arg(long, env = "GPUMEDIC_LEASE_RENEW", default_value = "5s")]
    lease_renew: String,
    /// This replica's name in the lease (unset: $POD_NAME, else hostname and process id).
    #[arg(long, env = "GPUMEDIC_IDENTITY")]
    identity: Option<String>,
    /// The status object (a ConfigMap in the lease namespace): breaker state, pause, resets.
    #[arg(long, env = "GPUMEDIC_STATUS_CONFIGMAP", default_value = control::STATUS_CONFIGMAP)]
    status_configmap: String,
    /// How often the leader reads the status object for a pause, a resume or a breaker reset.
    #[arg(long, env = "GPUMEDIC_CONTROL_POLL", default_value = "2s")]
    control_poll: String,
    /// A maintenance window, repeatable or `;`-separated, in UTC: `Sat 02:00-06:00`,
    /// `Mon-Fri 22:00-02:00`, `daily 03:00-04:00`. With windows, warning and info verdicts that
    /// drain or repair mark the node now and wait for the next window; without, nothing waits.
    #[arg(long = "maintenance-window", env = "GPUMEDIC_MAINTENANCE_WINDOWS", value_delimiter = ';')]
    maintenance_windows: Vec<String>,
    /// How often the leader looks for deferred actions while a window is open.
    #[arg(long, env = "GPUMEDIC_MAINTENANCE_CHECK", default_value = "30s")]
    maintenance_check: String,
    /// The repair escalation ladder (full-remediation): comma-separated repairs, each with an
    /// optional `=<timeout>`, mildest first. A verdict's ladder starts at its own action.
    #[arg(long, env = "GPUMEDIC_REPAIR_LADDER", default_value = ladder::DEFAULT_LADDER)]
    repair_ladder: String,
    /// The timeout of a ladder step that does not give its own.
    #[arg(long, env = "GPUMEDIC_REPAIR_STEP_TIMEOUT", default_value = "30m")]
    repair_step_timeout: String,
    /// How often the leader drives the repair ladders (calls hooks, reads their status, escalates).
    #[arg(long, env = "GPUMEDIC_REPAIR_CHECK", default_value = "10s")]
    repair_check: String,
    /// The repair webhook: an https:// URL each ladder step is POSTed to, signed.
    #[arg(long, env = "GPUMEDIC_REPAIR_WEBHOOK_URL")]
    repair_webhook_url: Option<String>,
    #[command(flatten)]
    repair_webhook_keys: WebhookKeyArgs,
    /// Extra CA certificates (PEM) the webhook's certificate may chain to, beside the public roots.
    #[arg(long, env = "GPUMEDIC_REPAIR_WEBHOOK_CA_FILE")]
    repair_webhook_ca_file: Option<std::path::PathBuf>,
    /// One webhook request's time limit.
    #[arg(long, env = "GPUMEDIC_REPAIR_WEBHOOK_TIMEOUT", default_value = "10s")]
    repair_webhook_timeout: String,
    /// Attempts per webhook call (connect errors, timeouts, 5xx and 429 are retried).
    #[arg(long, env = "GPUMEDIC_REPAIR_WEBHOOK_ATTEMPTS", default_value_t = 5)]
    repair_webhook_attempts: u32,
    /// The first wait between webhook attempts; it doubles, up to 30 s.
    #[arg(long, env = "GPUMEDIC_REPAIR_WEBHOOK_BACKOFF", default_value = "500ms")]
    repair_webhook_backoff: String,
    /// Allow a plain http:// webhook URL (the body is signed but readable on the wire).
    #[arg(long, env = "GPUMEDIC_REPAIR_WEBHOOK_ALLOW_HTTP")]
    repair_webhook_allow_http: bool,
    /// A YAML template of the custom resource created for each ladder step (any apiVersion and
    /// kind; `{{node}}`, `{{action}}`, ... are filled in; see docs/operations.md).
    #[arg(long, env = "GPUMEDIC_REPAIR_RESOURCE_TEMPLATE")]
    repair_resource_template: Option<std::path::PathBuf>,
    /// The dotted path of the field a repair controller reports `Succeeded` or `Failed` in.
    #[arg(long, env = "GPUMEDIC_REPAIR_RESOURCE_STATUS_PATH", default_value = "status.phase")]
    repair_resource_status_path: String,
}

/// The repair webhook's keys: the current one and, during a rotation, the previous one.
#[derive(Debug, clap::Args)]
struct WebhookKeyArgs {
    /// The webhook's current HMAC-SHA256 key (prefer --repair-webhook-secret-file, from a Secret).
    #[arg(long, env = "GPUMEDIC_REPAIR_WEBHOOK_SECRET", hide_env_values = true)]
    repair_webhook_secret: Option<String>,
    /// A file holding the webhook's current key (a mounted Secret); a trailing newline is ignored.
    #[arg(long, env = "GPUMEDIC_REPAIR_WEBHOOK_SECRET_FILE")]
    repair_webhook_secret_file: Option<std::path::PathBuf>,
    /// The id receivers know the current key by, sent in X-Gpumedic-Key-Id and signed
    /// (letters, digits, `.`, `_`, `-`; at most 64).
    #[arg(long, env = "GPUMEDIC_REPAIR_WEBHOOK_KEY_ID", default_value = hooks::DEFAULT_KEY_ID)]
    repair_webhook_key_id: String,
    /// During a key rotation: the id of the previous key, which signs every request too until
    /// every receiver knows the current one.
    #[arg(long, env = "GPUMEDIC_REPAIR_WEBHOOK_PREVIOUS_KEY_ID")]
    repair_webhook_previous_key_id: Option<String>,
    /// During a key rotation: the previous key (prefer --repair-webhook-previous-secret-file).
    #[arg(long, env = "GPUMEDIC_REPAIR_WEBHOOK_PREVIOUS_SECRET", hide_env_values = true)]
    repair_webhook_previous_secret: Option<String>,
    /// During a key rotation: a file holding the previous key; a trailing newline is ignored.
    #[arg(long, env = "GPUMEDIC_REPAIR_WEBHOOK_PREVIOUS_SECRET_FILE")]
    repair_webhook_previous_secret_file: Option<std::path::PathBuf>,
}

/// The validated configuration.
#[derive(Debug, Clone)]
pub struct Config {
    /// Shared service settings.
    pub common: CommonConfig,
    /// Kafka settings.
    pub kafka: KafkaSettings,
    /// The consumer group.
    pub group: String,
    /// The verdict topic.
    pub verdicts_topic: String,
    /// The actions topic.
    pub actions_topic: String,
    /// The edge's settings.
    pub settings: Settings,
    /// Breaker limits.
    pub breaker: BreakerLimits,
    /// New quarantines per minute.
    pub quarantines_per_minute: usize,
    /// GPU node selector.
    pub gpu_node_selector: String,
    /// The oldest verdict acted on.
    pub max_verdict_age: Duration,
    /// Verdicts handled at once (for different nodes).
    pub max_in_flight: usize,
    /// Leader election.
    pub lease: LeaseSettings,
    /// The status object's name (in the lease namespace).
    pub status_configmap: String,
    /// How often the status object is read.
    pub control_poll: Duration,
    /// Maintenance windows; empty: nothing waits.
    pub windows: Vec<Window>,
    /// How often deferred actions are looked for while a window is open.
    pub maintenance_check: Duration,
    /// How often the repair ladders are driven.
    pub repair_check: Duration,
    /// The repair webhook, when configured.
    pub webhook: Option<hooks::WebhookSettings>,
    /// The repair custom resource's template (its default namespace is the lease namespace),
    /// when configured.
    pub resource: Option<hooks::ResourceSettings>,
}

/// This replica's default identity: the pod name, else hostname and process id.
fn default_identity() -> String {
    if let Ok(pod) = std::env::var("POD_NAME")
        && !pod.trim().is_empty()
    {
        return pod;
    }
    let host = std::env::var("HOSTNAME")
        .ok()
        .or_else(|| std::fs::read_to_string("/etc/hostname").ok())
        .map(|h| h.trim().to_owned())
        .filter(|h| !h.is_empty())
        .unwrap_or_else(|| "remediator".to_owned());
    format!("{host}-{}", std::process::id())
}

impl Validate for Args {
    type Valid = Config;

    fn validate(self) -> Result<Config, Problems> {
        let mut p = Problems::default();
        let common = self.common.validate().map_err(|e| p.extend(e)).ok();
        let kafka = self.kafka.validate().map_err(|e| p.extend(e)).ok();
        if self.group.trim().is_empty() {
            p.push("--group", "the consumer group must not be empty");
        }
        for (flag, topic) in [("--verdicts-topic", &self.verdicts_topic), ("--actions-topic", &self.actions_topic)] {
            if topic.trim().is_empty() {
                p.push(flag, "the topic must not be empty");
            }
        }
        let mode = p.check(
            "--mode",
            match self.mode.as_str() {
                "monitor-only" => Ok(Mode::MonitorOnly),
                "cordon-drain" => Ok(Mode::CordonDrain),
                "full-remediation" => Ok(Mode::FullRemediation),
                other => Err(format!("'{other}' is not a mode; use monitor-only, cordon-drain or full-remediation")),
            },
        );
        if !(0.0..=1.0).contains(&self.breaker_max_share) {
            p.push("--breaker-max-share", "must be between 0 and 1");
        }
        let window = p.check("--breaker-window", parse_duration(&self.breaker_window));
        let deadline = p.check("--drain-deadline", parse_duration(&self.drain_deadline));
        let max_verdict_age = p.check("--max-verdict-age", parse_duration(&self.max_verdict_age));
        if !(1..=1024).contains(&self.max_in_flight) {
            p.push("--max-in-flight", format!("{} must be between 1 and 1024", self.max_in_flight));
        }
        if self.drain_grace_seconds.is_some_and(|g| g < 0) {
            p.push("--drain-grace-seconds", "must not be negative");
        }
        let lease_duration = p.check("--lease-duration", parse_duration(&self.lease_duration));
        let lease_renew = p.check("--lease-renew", parse_duration(&self.lease_renew));
        if let (Some(d), Some(r)) = (lease_duration, lease_renew)
            && (r.is_zero() || r * 2 > d)
        {
            p.push("--lease-renew", "must be more than zero and at most half of --lease-duration");
        }
        if self.lease_name.trim().is_empty() {
            p.push("--lease-name", "must not be empty");
        }
        if self.status_configmap.trim().is_empty() {
            p.push("--status-configmap", "must not be empty");
        }
        let control_poll = p.check("--control-poll", parse_duration(&self.control_poll));
        let maintenance_check = p.check("--maintenance-check", parse_duration(&self.maintenance_check));
        let mut windows = Vec::new();
        for raw in self.maintenance_windows.iter().filter(|w| !w.trim().is_empty()) {
            if let Some(w) = p.check("--maintenance-window", raw.parse::<Window>()) {
                windows.push(w);
            }
        }
        let repair_timeout = p.check("--repair-step-timeout", parse_duration(&self.repair_step_timeout));
        let repair_ladder =
            repair_timeout.and_then(|t| p.check("--repair-ladder", ladder::parse_steps(&self.repair_ladder, t)));
        let repair_check = p.check("--repair-check", parse_duration(&self.repair_check));
        let webhook_timeout = p.check("--repair-webhook-timeout", parse_duration(&self.repair_webhook_timeout));
        let webhook_backoff = p.check("--repair-webhook-backoff", parse_duration(&self.repair_webhook_backoff));
        let mut webhook = None;
        if let Some(raw) = self.repair_webhook_url.as_deref().filter(|u| !u.trim().is_empty()) {
            let url = p.check(
                "--repair-webhook-url",
                reqwest::Url::parse(raw.trim()).map_err(|e| format!("'{raw}' is not a URL: {e}")).and_then(|u| match u
                    .scheme()
                {
                    "https" => Ok(u),
                    "http" if self.repair_webhook_allow_http => Ok(u),
                    "http" => Err("plain http is refused; use https, or --repair-webhook-allow-http".to_owned()),
                    other => Err(format!("'{other}' is not an http(s) scheme")),
                }),
            );
            let keys = self.repair_webhook_keys.keyring(&mut p);
            let ca_pem = self.repair_webhook_ca_file.as_ref().and_then(|file| {
                p.check(
                    "--repair-webhook-ca-file",
                    std::fs::read(file).map_err(|e| format!("cannot read {}: {e}", file.display())),
                )
            });
            if self.repair_webhook_attempts == 0 {
                p.push("--repair-webhook-attempts", "must be at least 1");
            }
            if let (Some(url), Some(keys), Some(timeout), Some(backoff)) = (url, keys, webhook_timeout, webhook_backoff)
            {
                webhook = Some(hooks::WebhookSettings {
                    url,
                    keys,
                    timeout,
                    attempts: self.repair_webhook_attempts,
                    backoff,
                    ca_pem,
                });
            }
        }
        let template = self.repair_resource_template.as_ref().and_then(|file| {
            p.check(
                "--repair-resource-template",
                std::fs::read_to_string(file)
                    .map_err(|e| format!("cannot read {}: {e}", file.display()))
                    .and_then(|text| {
                        serde_yaml::from_str::<serde_json::Value>(&text).map_err(|e| format!("{}: {e}", file.display()))
                    })
                    .and_then(|t| hooks::template_kind(&t).map(|_| t)),
            )
        });
        if self.repair_resource_status_path.trim().is_empty() {
            p.push("--repair-resource-status-path", "must not be empty");
        }
        let hooked = self.repair_webhook_url.as_deref().is_some_and(|u| !u.trim().is_empty())
            || self.repair_resource_template.is_some();
        if mode == Some(Mode::FullRemediation) && !hooked {
            p.push(
                "--mode",
                "full-remediation needs a repair hook: set --repair-webhook-url or --repair-resource-template \
                 (or run cordon-drain)",
            );
        }
        let namespace = self
            .lease_namespace
            .or_else(|| std::env::var("POD_NAMESPACE").ok())
            .filter(|n| !n.trim().is_empty())
            .unwrap_or_else(|| "gpumedic".to_owned());
        let identity = self.identity.filter(|i| !i.trim().is_empty()).unwrap_or_else(default_identity);
        let resource = template.map(|template| hooks::ResourceSettings {
            template,
            status_path: self.repair_resource_status_path.trim().to_owned(),
            default_namespace: namespace.clone(),
        });
        p.finish(|| Config {
            common: common.expect("checked"),
            kafka: kafka.expect("checked"),
            group: self.group,
            verdicts_topic: self.verdicts_topic,
            actions_topic: self.actions_topic,
            settings: Settings {
                policy: Policy { mode: mode.expect("checked"), partial_drain: self.partial_drain, ..Policy::default() },
                drain: DrainPolicy {
                    mode: DrainMode::Immediate { grace_seconds: self.drain_grace_seconds },
                    deadline: deadline.expect("checked"),
                    ..DrainPolicy::default()
                },
                ladder: repair_ladder.expect("checked"),
                ..Settings::default()
            },
            breaker: BreakerLimits {
                max_share: self.breaker_max_share,
                max_count: self.breaker_max_count,
                window: window.expect("checked"),
            },
            quarantines_per_minute: self.quarantines_per_minute,
            gpu_node_selector: self.gpu_node_selector,
            max_verdict_age: max_verdict_age.expect("checked"),
            max_in_flight: self.max_in_flight,
            lease: LeaseSettings {
                namespace,
                name: self.lease_name,
                identity,
                duration: lease_duration.expect("checked"),
                renew: lease_renew.expect("checked"),
            },
            status_configmap: self.status_configmap,
            control_poll: control_poll.expect("checked"),
            windows,
            maintenance_check: maintenance_check.expect("checked"),
            repair_check: repair_check.expect("checked"),
            resource,
            webhook,
        })
    }
}

/// One webhook key's secret from its value flag or its file flag (not both); `None` when neither
/// is given or it cannot be read (recorded). Returns the flag it came from with it.
fn webhook_secret<'f>(
    p: &mut Problems,
    value: Option<&str>,
    file: Option<&std::path::Path>,
    (value_flag, file_flag): (&'f str, &'f str),
) -> Option<(hooks::Secret, &'f str)> {
    match (value, file) {
        (Some(_), Some(_)) => {
            p.push(value_flag, format!("give the secret or {file_flag}, not both"));
            None
        }
        (Some(s), None) => Some((hooks::Secret(s.as_bytes().to_vec()), value_flag)),
        (None, Some(f)) => p.check(file_flag, hooks::read_secret(f)).map(|s| (s, file_flag)),
        (None, None) => None,
    }
}

impl WebhookKeyArgs {
    /// The webhook's signing keys: the current one (from --repair-webhook-secret or its file, named
    /// by --repair-webhook-key-id, `default` unless set) and, during a rotation, the previous one.
    /// Every problem is recorded, so one start lists them all.
    fn keyring(&self, p: &mut Problems) -> Option<hooks::Keyring> {
        /// The key `id` with `secret`, its problems recorded against the flags they came from.
        fn key(p: &mut Problems, id_flag: &str, id: &str, secret: Option<(hooks::Secret, &str)>) -> Option<hooks::Key> {
            let id_ok = p.check(id_flag, hooks::check_key_id(id).map_err(|e| e.to_string())).is_some();
            let (secret, flag) = secret?;
            if secret.0.is_empty() {
                p.push(flag, "the key must not be empty");
                return None;
            }
            if !id_ok {
                return None;
            }
            hooks::Key::new(id, secret).map_err(|e| p.push(flag, e.to_string())).ok()
        }
        let current_flags = ("--repair-webhook-secret", "--repair-webhook-secret-file");
        let current_secret = webhook_secret(
            p,
            self.repair_webhook_secret.as_deref(),
            self.repair_webhook_secret_file.as_deref(),
            current_flags,
        );
        if self.repair_webhook_secret.is_none() && self.repair_webhook_secret_file.is_none() {
            p.push("--repair-webhook-secret", "the webhook needs a secret (or --repair-webhook-secret-file)");
        }
        let current_id = self.repair_webhook_key_id.trim();
        let current = key(p, "--repair-webhook-key-id", current_id, current_secret.clone());

        // An empty value (a ConfigMap entry left blank after a rotation) means unset.
        let previous_id = self.repair_webhook_previous_key_id.as_deref().map(str::trim).filter(|i| !i.is_empty());
        let previous_value = self.repair_webhook_previous_secret.as_deref().filter(|s| !s.is_empty());
        let previous_file = self.repair_webhook_previous_secret_file.as_deref().filter(|f| !f.as_os_str().is_empty());
        // `None`: a problem; `Some(None)`: no rotation under way.
        let previous = match (previous_id, previous_value.is_some() || previous_file.is_some()) {
            (None, false) => Some(None),
            (Some(_), false) => {
                p.push(
                    "--repair-webhook-previous-key-id",
                    "names a previous key but none is given (--repair-webhook-previous-secret-file)",
                );
                None
            }
            (None, true) => {
                p.push("--repair-webhook-previous-key-id", "the previous key needs the id receivers know it by");
                None
            }
            (Some(id), true) => {
                let secret = webhook_secret(
                    p,
                    previous_value,
                    previous_file,
                    ("--repair-webhook-previous-secret", "--repair-webhook-previous-secret-file"),
                );
                let mut distinct = true;
                if id == current_id {
                    p.push("--repair-webhook-previous-key-id", "must differ from --repair-webhook-key-id");
                    distinct = false;
                }
                if let (Some((old, flag)), Some((new, _))) = (&secret, &current_secret)
                    && old == new
                {
                    p.push(*flag, "the previous key is the current key; a rotation needs a new one");
                    distinct = false;
                }
                key(p, "--repair-webhook-previous-key-id", id, secret).filter(|_| distinct).map(Some)
            }
        };
        let (current, previous) = (current?, previous?);
        hooks::Keyring::new(current, previous)
            .map_err(|e| p.push("--repair-webhook-previous-key-id", e.to_string()))
            .ok()
    }
}

/// What every part of a running remediator shares.
struct Shared {
    remediator: Remediator,
    producer: Producer,
    codec: Arc<Codec>,
    fleet: Fleet,
    status: StatusClient,
    kafka: KafkaSettings,
    group: String,
    verdicts_topic: String,
    actions_topic: String,
    max_verdict_age: Duration,
    max_in_flight: usize,
    windows: Vec<Window>,
    control_poll: Duration,
    maintenance_check: Duration,
    repair_check: Duration,
    hooks: hooks::Hooks,
    lease_namespace: String,
    /// Turns ready once the leader's consumer has its partitions; a standby holds it ready.
    consuming: ReadyFlag,
    /// Whether the status object says the breaker is open, as last read or written.
    open_persisted: AtomicBool,
    /// Serialises the leader's writes to the status object (a trip and a reset must not cross).
    status_writes: tokio::sync::Mutex<()>,
    /// The unreadable ladders already reported with an Event (node, annotation value).
    refused_ladders: std::sync::Mutex<std::collections::HashSet<(String, String)>>,
}

/// Runs the remediator until SIGTERM/SIGINT or a failure.
pub async fn run(config: Config) -> Result<(), ShutdownError> {
    let mut service = Service::start(NAME, &config.common);
    let kube_ready = service.readiness.register("gpu-nodes-counted");
    let lease_ready = service.readiness.register("lease-reachable");
    // Named for what it means on the leader; a standby holds it ready, because a standby is a
    // healthy replica that must not be restarted or kept out of a rollout for not leading.
    let consuming = service.readiness.register("kafka-partitions-assigned-or-standby");
    let token = service.shutdown.token();
    let validity = Arc::new(Validity::for_lease(config.lease.renew_deadline()));
    let setup = async {
        let kube_config = kube::Config::infer().await.map_err(|e| Box::new(e) as BoxError)?;
        let remediator = Remediator::new(
            kube_config,
            config.settings.clone(),
            Gate::new(config.breaker, config.quarantines_per_minute),
        )?
        .with_validity(validity.clone());
        let producer = config.kafka.producer(NAME)?;
        let codec = config.kafka.codec().await?;
        Ok::<_, BoxError>((remediator, producer, codec))
    };
    let setup = async {
        let (remediator, producer, codec) = setup.await?;
        let hooks = hooks::Hooks {
            webhook: config.webhook.clone().map(hooks::Webhook::new).transpose()?,
            resource: config
                .resource
                .clone()
                .map(|r| hooks::CustomResource::new(remediator.client(), r))
                .transpose()
                .map_err(BoxError::from)?,
        };
        Ok::<_, BoxError>((remediator, producer, codec, hooks))
    };
    let (remediator, producer, codec, hooks) = match setup.await {
        Ok(v) => v,
        Err(e) => return Err(ShutdownError::TaskFailed { task: "setup".into(), source: e }),
    };
    tracing::info!(mode = ?config.settings.policy.mode, identity = %config.lease.identity,
        lease = %format!("{}/{}", config.lease.namespace, config.lease.name), "Remediator ready.");
    let client = remediator.client();
    let fleet = Fleet {
        client: client.clone(),
        selector: config.gpu_node_selector.clone(),
        names: Arc::new(std::sync::RwLock::new(std::collections::HashSet::new())),
        count: Arc::new(AtomicUsize::new(0)),
    };
    service.shutdown.spawn("gpu-node-count", count_gpu_nodes(fleet.clone(), kube_ready, token.clone()));
    metrics::gauge!("gpumedic_remediator_leader").set(0.0);
    let shared = Arc::new(Shared {
        remediator,
        producer,
        codec,
        fleet,
        status: StatusClient::new(client.clone(), &config.lease.namespace, &config.status_configmap),
        kafka: config.kafka,
        group: config.group,
        verdicts_topic: config.verdicts_topic,
        actions_topic: config.actions_topic,
        max_verdict_age: config.max_verdict_age,
        max_in_flight: config.max_in_flight,
        windows: config.windows,
        control_poll: config.control_poll,
        maintenance_check: config.maintenance_check,
        repair_check: config.repair_check,
        hooks,
        lease_namespace: config.lease.namespace.clone(),
        consuming,
        open_persisted: AtomicBool::new(false),
        status_writes: tokio::sync::Mutex::new(()),
        refused_ladders: std::sync::Mutex::new(std::collections::HashSet::new()),
    });
    // The lease on the client without kube's own retries: every attempt has a deadline here.
    let lease = LeaseClient::new(shared.remediator.client_without_retry(), config.lease);
    service.shutdown.spawn("leadership", lead(shared, lease, validity, lease_ready, token));
    service.run().await
}

/// Why a leadership term ended.
enum TermEnd {
    Shutdown,
    Lost,
    Failed(BoxError),
}

/// Stands by until this replica holds the lease, then leads (consumes verdicts, watches the
/// status object, carries out deferred actions) until it loses the lease or the service stops.
/// On loss it stops acting at once (the term's tasks are cancelled: a drain in progress stops, the
/// verdict's offset is not stored, the consumer leaves the group) and stands by again; on shutdown
/// it releases the lease so a standby takes over at its next look.
///
/// Every lease call has a deadline: an attempt gets at most one renew period, and never more than
/// the time the lease is still provably held. The lease counts from the start of the last renewal
/// that succeeded, and `validity` stops every node write at the renew deadline on this replica's
/// own clock, before any standby can see the lease as expired, even while a renewal hangs.
async fn lead(
    shared: Arc<Shared>,
    mut lease: LeaseClient,
    validity: Arc<Validity>,
    lease_ready: ReadyFlag,
    token: CancellationToken,
) -> Result<(), BoxError> {
    let specs = kafka::stage_topics(
        &[shared.verdicts_topic.as_str()],
        &[shared.actions_topic.as_str()],
        topics::DEFAULT_PARTITIONS,
    );
    if !kafka::wait_for_topics(&shared.kafka, &specs, &token).await {
        return Ok(());
    }
    let renew = lease.settings().renew;
    loop {
        shared.consuming.set(true);
        loop {
            let started = Instant::now();
            match tokio::time::timeout(renew, lease.try_lead()).await {
                Ok(Ok(true)) => {
                    validity.renewed(started);
                    break;
                }
                Ok(Ok(false)) => lease_ready.set(true),
                Ok(Err(e)) => {
                    lease_ready.set(false);
                    tracing::warn!(error = %e, "Cannot reach the lease; standing by.");
                }
                Err(_) => {
                    lease_ready.set(false);
                    tracing::warn!(
                        seconds = renew.as_secs_f64(),
                        "The lease did not answer within the renew period; standing by."
                    );
                }
            }
            tokio::select! {
                () = token.cancelled() => return Ok(()),
                () = tokio::time::sleep(renew) => {}
            }
        }
        lease_ready.set(true);
        tracing::info!(identity = %lease.settings().identity, "Leading: this replica holds the lease and acts on verdicts.");
        metrics::gauge!("gpumedic_remediator_leader").set(1.0);
        metrics::counter!("gpumedic_remediator_leadership_terms_total").increment(1);
        shared.consuming.set(false);
        let term = token.child_token();
        let mut tasks = tokio::task::JoinSet::new();
        tasks.spawn(consume(shared.clone(), term.clone()));
        tasks.spawn(watch_status(shared.clone(), term.clone()));
        tasks.spawn(carry_out_deferred(shared.clone(), term.clone()));
        if shared.remediator.settings().policy.mode == Mode::FullRemediation {
            tasks.spawn(drive_repairs(shared.clone(), term.clone()));
        }
        let end = loop {
            tokio::select! {
                // Biased: on shutdown the term's tasks return as well, and that is not a failure.
                biased;
                () = token.cancelled() => break TermEnd::Shutdown,
                Some(joined) = tasks.join_next() => {
                    if token.is_cancelled() {
                        break TermEnd::Shutdown;
                    }
                    break TermEnd::Failed(match joined {
                        Ok(Ok(())) => "a leader task ended on its own".into(),
                        Ok(Err(e)) => e,
                        Err(e) => Box::new(e),
                    });
                }
                () = tokio::time::sleep(renew) => {
                    let started = Instant::now();
                    let left = validity.left_at(started);
                    match tokio::time::timeout(renew.min(left), lease.try_lead()).await {
                        Ok(Ok(true)) => validity.renewed(started),
                        Ok(Ok(false)) => break TermEnd::Lost,
                        Ok(Err(e)) => tracing::warn!(error = %e, "Cannot renew the lease; still leading until the renew deadline."),
                        Err(_) => tracing::warn!(seconds = renew.min(left).as_secs_f64(),
                            "The lease renewal did not answer in time; still leading until the renew deadline."),
                    }
                    if !validity.current() {
                        break TermEnd::Lost;
                    }
                }
            }
        };
        // No write from here on, before the tasks have even stopped.
        validity.end();
        metrics::gauge!("gpumedic_remediator_leader").set(0.0);
        term.cancel();
        // A task stuck in a call that does not answer is not waited for forever.
        let stopped = async {
            while let Some(joined) = tasks.join_next().await {
                if let Ok(Err(e)) = joined {
                    tracing::warn!(error = %e, "A leader task failed while stopping.");
                }
            }
        };
        if tokio::time::timeout(Duration::from_secs(10), stopped).await.is_err() {
            tracing::warn!("Leader tasks did not stop within 10 s of the term's end; aborting them.");
            tasks.abort_all();
        }
        match end {
            TermEnd::Lost => {
                tracing::warn!("Lost the lease: stopped acting and left the consumer group; standing by.");
                metrics::counter!("gpumedic_remediator_leadership_lost_total").increment(1);
            }
            TermEnd::Shutdown => {
                if let Err(e) = lease.release().await {
                    tracing::warn!(error = %e, "Could not release the lease; a standby takes over when it expires.");
                }
                return Ok(());
            }
            TermEnd::Failed(e) => {
                if let Err(e) = lease.release().await {
                    tracing::warn!(error = %e, "Could not release the lease; a standby takes over when it expires.");
                }
                return Err(e);
            }
        }
    }
}

/// Loads what the previous leader left (breaker, pause) and consumes verdicts until `term` ends.
async fn consume(shared: Arc<Shared>, term: CancellationToken) -> Result<(), BoxError> {
    loop {
        match begin_term(&shared).await {
            Ok(()) => break,
            Err(e) => tracing::warn!(error = %e, "Cannot load the breaker and pause state; retrying before consuming."),
        }
        tokio::select! {
            () = term.cancelled() => return Ok(()),
            () = tokio::time::sleep(Duration::from_secs(1)) => {}
        }
    }
    let consumer =
        shared.kafka.consumer(NAME, &shared.group, &[shared.verdicts_topic.as_str()], shared.consuming.clone())?;
    let dlq = shared.kafka.producer(&format!("{NAME}-dlq"))?;
    let handler = Handler { shared: shared.clone(), term: term.clone() };
    // Verdicts for different nodes at once, each node's in order; offsets stored only up to the
    // last verdict below which all are done.
    keyed::run_keyed_consumer(NAME, consumer, dlq, &handler, shared.max_in_flight, term).await?;
    Ok(())
}

/// A new leader's state: the pause and an open breaker from the status object, and the
/// quarantines still within the breaker's window from the nodes (gpumedic's taint and its
/// `timeAdded`), so a failover neither closes the breaker nor hands out a fresh budget.
async fn begin_term(shared: &Shared) -> Result<(), BoxError> {
    let status = shared.status.read().await?;
    shared.remediator.set_paused(status.paused);
    metrics::gauge!("gpumedic_remediator_paused").set(if status.paused { 1.0 } else { 0.0 });
    let nodes = maintenance::list_nodes(&shared.remediator.client(), &shared.fleet.selector).await?;
    let now = Instant::now();
    let wall = chrono::Utc::now();
    let mut gate = lock_gate(&shared.remediator);
    let window = gate.breaker.window();
    let quarantined: Vec<(String, Instant)> = nodes
        .iter()
        .filter_map(|n| {
            let added = quarantined_at(n)?;
            let age = (wall - added).to_std().unwrap_or_default();
            (age < window).then(|| (n.metadata.name.clone().unwrap_or_default(), now.checked_sub(age).unwrap_or(now)))
        })
        .collect();
    let trip = status
        .breaker_open
        .then(|| status.breaker_reason.clone().unwrap_or_else(|| "tripped under an earlier leader".to_owned()));
    tracing::info!(
        breaker_open = trip.is_some(),
        paused = status.paused,
        counted = quarantined.len(),
        "Loaded the breaker and pause state for this term."
    );
    gate.breaker.restore(trip, quarantined, now);
    shared.open_persisted.store(status.breaker_open, Ordering::Release);
    metrics::gauge!("gpumedic_remediator_breaker_open").set(if status.breaker_open { 1.0 } else { 0.0 });
    Ok(())
}

/// When gpumedic's taint went on `node`, if it carries one.
fn quarantined_at(node: &k8s_openapi::api::core::v1::Node) -> Option<chrono::DateTime<chrono::Utc>> {
    let taints = node.spec.as_ref()?.taints.as_ref()?;
    let taint = taints.iter().find(|t| t.key == plan::TAINT_KEY)?;
    let added = serde_json::to_value(taint).ok()?;
    chrono::DateTime::parse_from_rfc3339(added["timeAdded"].as_str()?).ok().map(|t| t.with_timezone(&chrono::Utc))
}

fn lock_gate(remediator: &Remediator) -> std::sync::MutexGuard<'_, Gate> {
    // The gate's state is a few maps updated in place; a panic elsewhere cannot leave it half
    // written, so a poisoned lock is still safe to use.
    remediator.gate().lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// Writes a trip the gate has and the status object does not show yet. Called after every
/// remediation, before its outcome is acknowledged, so no trip is lost to a crash.
async fn persist_trip(shared: &Shared) -> Result<(), BoxError> {
    if shared.open_persisted.load(Ordering::Acquire) {
        return Ok(());
    }
    let trip = {
        let mut gate = lock_gate(&shared.remediator);
        gate.breaker.trip().cloned().map(|t| (t.reason, gate.breaker.counted(Instant::now())))
    };
    let Some((reason, counted)) = trip else { return Ok(()) };
    let _writing = shared.status_writes.lock().await;
    shared.status.patch(&control::trip_patch(&reason, &control::now(), counted)).await?;
    shared.open_persisted.store(true, Ordering::Release);
    metrics::gauge!("gpumedic_remediator_breaker_open").set(1.0);
    metrics::counter!("gpumedic_remediator_breaker_trips_total").increment(1);
    tracing::error!(%reason, "The circuit breaker tripped: no new quarantines until an operator runs `gpumedic breaker reset`.");
    record_status_event(
        shared,
        "CircuitBreakerTripped",
        &format!("No new quarantines until `gpumedic breaker reset`: {reason}"),
        true,
    )
    .await;
    Ok(())
}

/// Follows the status object while leading: the pause, a reset request, and a breaker the object
/// shows closed while this leader holds it open (re-written: only a reset closes it).
async fn watch_status(shared: Arc<Shared>, term: CancellationToken) -> Result<(), BoxError> {
    loop {
        if let Err(e) = follow_status(&shared).await {
            tracing::warn!(error = %e, "Cannot read the status object; keeping the last pause and breaker state.");
        }
        tokio::select! {
            () = term.cancelled() => return Ok(()),
            () = tokio::time::sleep(shared.control_poll) => {}
        }
    }
}

async fn follow_status(shared: &Shared) -> Result<(), BoxError> {
    let status = shared.status.read().await?;
    if status.paused != shared.remediator.paused() {
        tracing::warn!(paused = status.paused, by = ?status.paused_by, reason = ?status.pause_reason,
            "{}", if status.paused { "Remediation paused: verdicts are reported, nothing is changed." } else { "Remediation resumed." });
        shared.remediator.set_paused(status.paused);
        metrics::gauge!("gpumedic_remediator_paused").set(if status.paused { 1.0 } else { 0.0 });
    }
    if status.reset_requested() {
        let by = status.reset_requested_by.clone().unwrap_or_else(|| "unknown".to_owned());
        let _writing = shared.status_writes.lock().await;
        let was_open = lock_gate(&shared.remediator).breaker.trip().is_some();
        lock_gate(&shared.remediator).breaker.reset();
        shared.status.patch(&control::reset_done_patch(&by, &control::now())).await?;
        shared.open_persisted.store(false, Ordering::Release);
        metrics::gauge!("gpumedic_remediator_breaker_open").set(0.0);
        metrics::counter!("gpumedic_remediator_breaker_resets_total").increment(1);
        tracing::warn!(%by, was_open, "The circuit breaker was reset: closed, with a fresh quarantine budget.");
        drop(_writing);
        record_status_event(
            shared,
            "CircuitBreakerReset",
            &format!("Reset by {by}; the quarantine budget starts afresh"),
            false,
        )
        .await;
        return Ok(());
    }
    shared.open_persisted.store(status.breaker_open, Ordering::Release);
    if status.breaker_open && lock_gate(&shared.remediator).breaker.trip().is_none() {
        // Opened by hand (`breaker: open`): honour it like a trip.
        let reason = status.breaker_reason.unwrap_or_else(|| "opened in the status object".to_owned());
        lock_gate(&shared.remediator).breaker.open(reason, Instant::now());
        metrics::gauge!("gpumedic_remediator_breaker_open").set(1.0);
    }
    persist_trip(shared).await
}

/// An Event on the status object, so `kubectl describe configmap` tells the breaker's story.
async fn record_status_event(shared: &Shared, reason: &str, message: &str, warning: bool) {
    let settings = shared.remediator.settings();
    if let Err(e) = control::record_event(
        &shared.remediator.client(),
        &shared.lease_namespace,
        shared.status.name(),
        &settings.component,
        reason,
        message,
        warning,
    )
    .await
    {
        tracing::warn!(error = %e, %reason, "Could not record an Event on the status object.");
    }
}

/// While leading, carries out the deferred actions recorded on the managed nodes once they are
/// due (a window open, their time come, their GPU idle), publishes their outcomes and removes the
/// records. Paused, or held by the breaker or the rate limit, a record stays for the next look.
async fn carry_out_deferred(shared: Arc<Shared>, term: CancellationToken) -> Result<(), BoxError> {
    loop {
        tokio::select! {
            () = term.cancelled() => return Ok(()),
            () = tokio::time::sleep(shared.maintenance_check) => {}
        }
        if shared.remediator.paused() {
            continue;
        }
        let nodes = match maintenance::pending(&shared.remediator.client(), &shared.fleet.selector).await {
            Ok(n) => n,
            Err(e) => {
                tracing::warn!(error = %e, "Cannot list the nodes with deferred actions; trying again later.");
                continue;
            }
        };
        for node in nodes {
            if term.is_cancelled() {
                return Ok(());
            }
            let name = node.metadata.name.clone().unwrap_or_default();
            if let Err(e) = carry_out(&shared, &node, &term).await {
                tracing::warn!(node = %name, error = %e, "A deferred action did not go through; it stays for the next look.");
            }
        }
    }
}

/// Carries out the deferred action on `node`, if it may go now.
async fn carry_out(
    shared: &Shared,
    node: &k8s_openapi::api::core::v1::Node,
    term: &CancellationToken,
) -> Result<(), BoxError> {
    let name = node.metadata.name.clone().unwrap_or_default();
    let deferred = match maintenance::deferred_on(node) {
        Some(Ok(d)) => d,
        Some(Err(e)) => {
            tracing::warn!(node = %name, error = %e, "Dropping an unreadable deferred action.");
            metrics::counter!("gpumedic_remediator_deferred_refused_total", "reason" => "unreadable").increment(1);
            let why = format!("Dropped the unreadable deferred action in {}: {e}", maintenance::DEFERRED_ANNOTATION);
            shared.remediator.record_event(node, "DeferredActionRefused", why, true).await;
            maintenance::clear(&shared.remediator.client(), &name).await?;
            return Ok(());
        }
        None => return Ok(()),
    };
    // The record is data on this node, never a command for another: whoever can annotate one node
    // (its own kubelet can) must not reach a second one through it.
    if deferred.request.node != name {
        tracing::warn!(node = %name, names = %deferred.request.node, "Dropping a deferred action that names another node.");
        metrics::counter!("gpumedic_remediator_deferred_refused_total", "reason" => "other_node").increment(1);
        let why = format!(
            "Dropped the deferred action in {}: it names node {}, and a node's annotations act on that node only",
            maintenance::DEFERRED_ANNOTATION,
            deferred.request.node
        );
        shared.remediator.record_event(node, "DeferredActionRefused", why, true).await;
        maintenance::clear(&shared.remediator.client(), &name).await?;
        return Ok(());
    }
    let idle = match deferred.until {
        maintenance::Until::Idle => {
            drain::workload_on(&shared.remediator.client(), &name, deferred.request.gpu.as_ref()).await?.is_empty()
        }
        _ => false,
    };
    if !maintenance::due(&deferred, &shared.windows, chrono::Utc::now(), || idle) {
        return Ok(());
    }
    shared.remediator.leading(&name)?;
    let gpu_nodes = shared.fleet.count.load(Ordering::Acquire);
    let result = tokio::select! {
        () = term.cancelled() => return Ok(()),
        r = shared.remediator.remediate(&deferred.request, gpu_nodes) => r,
    };
    persist_trip(shared).await?;
    let result = match result {
        Ok(Outcome::Skipped { reason: Skip::BreakerOpen(_) | Skip::RateLimited(_) | Skip::Paused, .. }) => {
            return Ok(());
        }
        Ok(o) => Ok(o),
        Err(e @ ApplyError::NodeNotFound { .. }) => Err(e.to_string()),
        Err(e) => return Err(Box::new(e)),
    };
    let outcome = verdicts::outcome_for(deferred.verdict_id, &name, deferred.action, &result);
    tracing::info!(node = %name, verdict_id = %deferred.verdict_id, status = ?outcome.status,
        detail = %outcome.detail, "Carried out a deferred action.");
    publish(shared, &outcome, None).await?;
    maintenance::clear(&shared.remediator.client(), &name).await?;
    Ok(())
}

/// Publishes `outcome` on the actions topic and waits for the acknowledgement.
async fn publish(shared: &Shared, outcome: &ActionOutcome, trace: Option<&[u8]>) -> Result<(), HandleError> {
    let status =
        serde_json::to_value(outcome.status).ok().and_then(|v| v.as_str().map(str::to_owned)).unwrap_or_default();
    // The label is the status as the action record spells it (blocked_by_breaker, dry_run, ...).
    let action =
        serde_json::to_value(outcome.action).ok().and_then(|v| v.as_str().map(str::to_owned)).unwrap_or_default();
    metrics::counter!("gpumedic_remediator_outcomes_total", "action" => action, "status" => status).increment(1);
    let bytes = shared.codec.encode(outcome).map_err(|e| HandleError::Invalid(e.to_string()))?;
    let id = outcome.verdict_id.to_string();
    let envelope = kafka::Envelope {
        topic: &shared.actions_topic,
        key: &outcome.node,
        id: &id,
        content_type: ActionOutcome::CONTENT_TYPE,
        incoming_trace: trace,
    };
    kafka::publish_record(&shared.producer, envelope, &bytes).await.map_err(|e| HandleError::Retry(Box::new(e)))
}

/// The GPU nodes gpumedic manages (those matching `--gpu-node-selector`): it acts on no other
/// node, and the breaker's share is measured against their number.
#[derive(Clone)]
pub struct Fleet {
    client: kube::Client,
    selector: String,
    names: Arc<std::sync::RwLock<std::collections::HashSet<String>>>,
    count: Arc<AtomicUsize>,
}

impl Fleet {
    async fn refresh(&self) -> Result<usize, kube::Error> {
        let names = apply::managed_nodes(&self.client, &self.selector).await?;
        let n = names.len();
        *self.names.write().expect("fleet lock") = names;
        self.count.store(n, Ordering::Release);
        metrics::gauge!("gpumedic_remediator_gpu_nodes").set(n as f64);
        Ok(n)
    }

    /// Whether `node` is managed; a node not seen yet triggers one fresh listing, so a node that
    /// joined since the last refresh is not refused.
    async fn manages(&self, node: &str) -> Result<bool, kube::Error> {
        if self.names.read().expect("fleet lock").contains(node) {
            return Ok(true);
        }
        self.refresh().await?;
        Ok(self.names.read().expect("fleet lock").contains(node))
    }
}

/// Keeps the fleet (the breaker's denominator) current; ready once listed.
async fn count_gpu_nodes(
    fleet: Fleet,
    ready: gpumedic_runtime::admin::ReadyFlag,
    token: tokio_util::sync::CancellationToken,
) -> Result<(), kube::Error> {
    loop {
        match fleet.refresh().await {
            Ok(_) => ready.set(true),
            Err(e) => {
                ready.set(false);
                tracing::warn!(error = %e, "Cannot count GPU nodes; the breaker keeps the last count.");
            }
        }
        tokio::select! {
            () = token.cancelled() => return Ok(()),
            () = tokio::time::sleep(Duration::from_secs(30)) => {}
        }
    }
}

/// The consumer's handler for one leadership term: apply the verdict, publish the outcome, then
/// let the offset be stored. When the term ends mid-verdict (the lease is lost, or shutdown) the
/// work in hand stops at once and the offset is not stored: the next leader takes the verdict up
/// again, and because every step is idempotent it does only what is left.
pub struct Handler {
    shared: Arc<Shared>,
    term: CancellationToken,
}

impl Handler {
    /// What the remediator does with `request` from `verdict` on a managed node, fresh enough.
    async fn act(&self, verdict: &Verdict, request: &request::Remediation) -> Result<Outcome, ApplyError> {
        let shared = &self.shared;
        let gpu_nodes = shared.fleet.count.load(Ordering::Acquire);
        let now = chrono::Utc::now();
        let timing = maintenance::Timing {
            recovery: request.recovery,
            critical: verdict.severity == Severity::Critical,
            not_before: verdict.not_before,
            deferrable: verdict.deferrable,
        };
        let waits = !shared.remediator.paused() && shared.remediator.settings().policy.mode != Mode::MonitorOnly;
        let Some((until, not_before)) =
            waits.then(|| maintenance::hold(request.action, timing, &shared.windows, now)).flatten()
        else {
            if request.recovery && !shared.remediator.paused() {
                end_ladder(shared, request).await?;
            }
            let outcome = shared.remediator.remediate(request, gpu_nodes).await?;
            if request.recovery && !shared.remediator.paused() {
                shared.remediator.leading(&request.node)?;
                maintenance::clear_for(&shared.remediator.client(), &request.node, &request.incident_id)
                    .await
                    .map_err(|source| ApplyError::Patch { node: request.node.clone(), source })?;
            }
            return Ok(outcome);
        };
        // Mark now (the condition tells people and schedulers), the rest when it is due.
        let mark = request::Remediation { action: Action::Monitor, ..request.clone() };
        match shared.remediator.remediate(&mark, gpu_nodes).await? {
            Outcome::Applied { .. } | Outcome::AlreadyDone => {}
            other => return Ok(other),
        }
        let deferred = maintenance::Deferred {
            verdict_id: verdict.verdict_id,
            action: verdict.action,
            request: request.clone(),
            deferred_at: now,
            not_before,
            until,
        };
        shared.remediator.leading(&request.node)?;
        maintenance::defer(&shared.remediator.client(), &deferred)
            .await
            .map_err(|source| ApplyError::Patch { node: request.node.clone(), source })?;
        let waits_for = maintenance::waits_for(until, not_before);
        tracing::info!(node = %request.node, verdict_id = %verdict.verdict_id, until = ?until, waits_for = %waits_for, "Deferred an action: the node is marked now, the rest waits.");
        let label = format!("{until:?}").to_ascii_lowercase();
        metrics::counter!("gpumedic_remediator_deferred_total", "until" => label).increment(1);
        Ok(Outcome::Skipped { reason: Skip::Deferred(waits_for), would: None })
    }
}

impl RecordHandler for Handler {
    async fn handle(&mut self, record: &Record) -> Result<(), HandleError> {
        self.handle_verdict(record).await
    }
}

impl keyed::SharedHandler for Handler {
    async fn handle(&self, record: &Record) -> Result<(), HandleError> {
        self.handle_verdict(record).await
    }
}

impl Handler {
    /// One verdict: its remediation (or why not), then its outcome on the actions topic.
    async fn handle_verdict(&self, record: &Record) -> Result<(), HandleError> {
        let verdict: Verdict = kafka::decode_payload(&self.shared.codec, record).await?;
        let request = verdicts::remediation(&verdict);
        let shared = self.shared.clone();
        let managed = shared.fleet.manages(&verdict.node).await.map_err(|e| HandleError::Retry(Box::new(e)))?;
        let result = if let Some(age) = verdicts::stale(&verdict, chrono::Utc::now(), shared.max_verdict_age) {
            tracing::warn!(node = %verdict.node, verdict_id = %verdict.verdict_id, age_seconds = age.as_secs(),
                "Did not act on a verdict older than --max-verdict-age; its outcome says stale.");
            metrics::counter!("gpumedic_remediator_stale_verdicts_total", "recovery" => verdict.recovery.to_string())
                .increment(1);
            Ok(Outcome::Skipped { reason: Skip::Stale(age), would: None })
        } else if !managed {
            Ok(Outcome::Skipped { reason: Skip::Unmanaged, would: None })
        } else {
            let acted = tokio::select! {
                // Stop at once: the next leader (or this one, after a restart) takes it up again.
                () = self.term.cancelled() => return Err(HandleError::Retry("the leadership term ended".into())),
                r = self.act(&verdict, &request) => r,
            };
            match acted {
                Ok(outcome) => Ok(outcome),
                // A node that no longer exists will not come back for this verdict: record and move on.
                Err(e @ ApplyError::NodeNotFound { .. }) => Err(e.to_string()),
                Err(e) => return Err(HandleError::Retry(Box::new(e))),
            }
        };
        // A trip is durable before the verdict that caused it is acknowledged.
        persist_trip(&shared).await.map_err(HandleError::Retry)?;
        let outcome: ActionOutcome = verdicts::outcome(&verdict, &result);
        tracing::info!(node = %verdict.node, verdict_id = %verdict.verdict_id, status = ?outcome.status,
            detail = %outcome.detail, "Verdict handled.");
        publish(&shared, &outcome, record.header(record_headers::TRACEPARENT)).await
    }
}

/// Healthy evidence for a node on a repair ladder (a recovery verdict for its incident): the
/// ladder ends remediated, with an Event and an outcome under the verdict that started it, and
/// its record is removed before the recovery itself runs, so the driver cannot escalate a node
/// that is healthy. Redelivered, it finds no ladder and does nothing.
async fn end_ladder(shared: &Shared, request: &request::Remediation) -> Result<(), ApplyError> {
    let client = shared.remediator.client();
    let nodes: kube::Api<k8s_openapi::api::core::v1::Node> = kube::Api::all(client.clone());
    let node = match nodes.get_opt(&request.node).await {
        Ok(Some(n)) => n,
        Ok(None) => return Ok(()),
        Err(source) => return Err(ApplyError::Read { node: request.node.clone(), source }),
    };
    let Some(Ok(l)) = ladder::ladder_on(&node) else { return Ok(()) };
    if l.request.incident_id != request.incident_id {
        return Ok(());
    }
    if l.phase != ladder::Phase::Failed {
        let detail = format!(
            "remediated: healthy evidence (recovery verdict {}) after repair step {}/{} {}; ladder {}",
            request.verdict_id,
            l.step_number(),
            l.steps.len(),
            l.step().action.name(),
            l.describe()
        );
        shared.remediator.record_event(&node, "Remediated", detail.clone(), false).await;
        let outcome = ladder_outcome(&l, ActionStatus::Applied, detail);
        publish(shared, &outcome, None).await.map_err(|e| ApplyError::Publish(e.to_string()))?;
        metrics::counter!("gpumedic_remediator_repair_ladders_total", "result" => "remediated").increment(1);
        tracing::info!(node = %request.node, verdict_id = %l.verdict_id, "A repair ladder ended: the node is healthy again.");
    }
    shared.remediator.leading(&request.node)?;
    ladder::write(&client, &request.node, None, None)
        .await
        .map_err(|source| ApplyError::Patch { node: request.node.clone(), source })
}

/// The outcome of a ladder step, under the verdict that started the ladder and naming the step's
/// action. The contract has no `in_progress` status: a started step is `applied`, a failed or
/// timed-out one `failed` (the detail says which, and what follows).
fn ladder_outcome(l: &ladder::Ladder, status: ActionStatus, detail: String) -> ActionOutcome {
    ActionOutcome {
        verdict_id: uuid::Uuid::parse_str(&l.verdict_id).unwrap_or_default(),
        node: l.request.node.clone(),
        action: ladder::recommended(l.step().action),
        status,
        detail,
        at: chrono::Utc::now(),
    }
}

/// While leading in full-remediation mode: every `--repair-check`, walks the ladders recorded on
/// the managed nodes one move each (call the hooks of a pending step, read a running step's
/// status, escalate on failure or timeout). Paused, nothing moves.
async fn drive_repairs(shared: Arc<Shared>, term: CancellationToken) -> Result<(), BoxError> {
    use futures::StreamExt as _;
    loop {
        tokio::select! {
            () = term.cancelled() => return Ok(()),
            () = tokio::time::sleep(shared.repair_check) => {}
        }
        if shared.remediator.paused() {
            continue;
        }
        let nodes = match ladder::pending(&shared.remediator.client(), &shared.fleet.selector).await {
            Ok(n) => n,
            Err(e) => {
                tracing::warn!(error = %e, "Cannot list the nodes on a repair ladder; trying again later.");
                continue;
            }
        };
        let moves = futures::stream::iter(nodes).for_each_concurrent(16, |node| {
            let shared = shared.clone();
            async move {
                if let Err(e) = drive_ladder(&shared, &node).await {
                    tracing::warn!(node = ?node.metadata.name, error = %e, "A repair ladder did not move; trying again at the next look.");
                }
            }
        });
        tokio::select! {
            () = term.cancelled() => return Ok(()),
            () = moves => {}
        }
    }
}

/// One move of the ladder on `node` (see [`ladder::Ladder::decide`]). The hooks are called, the
/// outcome published and the Event recorded before the new ladder is written: a crash in between
/// repeats the call under the same idempotency key, which the receiver deduplicates.
async fn drive_ladder(shared: &Shared, node: &k8s_openapi::api::core::v1::Node) -> Result<(), BoxError> {
    let name = node.metadata.name.clone().unwrap_or_default();
    let raw = node.metadata.annotations.as_ref().and_then(|a| a.get(ladder::LADDER_ANNOTATION)).cloned();
    let mut l = match ladder::ladder_on(node) {
        Some(Ok(l)) => l,
        Some(Err(e)) => {
            tracing::warn!(node = %name, error = %e, "Ignoring an unreadable repair ladder.");
            metrics::counter!("gpumedic_remediator_ladders_refused_total").increment(1);
            // Once per distinct annotation value, not at every look.
            let first = raw.as_ref().is_some_and(|r| {
                let mut seen = shared.refused_ladders.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
                if seen.len() > 10_000 {
                    seen.clear();
                }
                seen.insert((name.clone(), r.clone()))
            });
            if first {
                let why = format!("Ignoring the repair ladder in {}: {e}", ladder::LADDER_ANNOTATION);
                shared.remediator.record_event(node, "RepairLadderRefused", why, true).await;
            }
            return Ok(());
        }
        None => return Ok(()),
    };
    if !l.active() {
        return Ok(());
    }
    // Hooks reboot and replace machines: never called by a replica that cannot prove it leads.
    shared.remediator.leading(&name)?;
    let report =
        if l.phase == ladder::Phase::Running { shared.hooks.report(&l).await? } else { ladder::Report::Working };
    let now = chrono::Utc::now();
    let (number, total, step) = (l.step_number(), l.steps.len(), l.step());
    let what = format!("repair step {number}/{total} {}", step.action.name());
    match l.decide(now, &report) {
        ladder::Move::Wait | ladder::Move::Done => return Ok(()),
        ladder::Move::Start => match shared.hooks.start(&l).await {
            Ok(detail) => {
                let detail = format!("{what} handed to the repair hooks ({detail}); timeout {}s", step.timeout_seconds);
                publish(shared, &ladder_outcome(&l, ActionStatus::Applied, detail.clone()), None).await?;
                shared.remediator.record_event(node, "RepairStepStarted", detail, false).await;
                metrics::counter!("gpumedic_remediator_repair_steps_total", "action" => step.action.name(), "result" => "started").increment(1);
                l.started(now);
            }
            Err(hooks::HookError::Unavailable(why)) => {
                tracing::warn!(node = %name, step = %what, %why, "The repair hooks are unavailable; the step stays pending.");
                return Ok(());
            }
            Err(e) => escalate(shared, node, &mut l, &e.to_string(), now).await?,
        },
        ladder::Move::Succeed => {
            let detail = format!(
                "remediated: {what} succeeded (reported by the repair controller); the node returns to service on healthy evidence"
            );
            publish(shared, &ladder_outcome(&l, ActionStatus::Applied, detail.clone()), None).await?;
            shared.remediator.record_event(node, "RepairSucceeded", detail, false).await;
            metrics::counter!("gpumedic_remediator_repair_steps_total", "action" => step.action.name(), "result" => "succeeded").increment(1);
            metrics::counter!("gpumedic_remediator_repair_ladders_total", "result" => "remediated").increment(1);
            l.succeeded(now);
        }
        ladder::Move::Escalate(why) => escalate(shared, node, &mut l, &why, now).await?,
    }
    if !write_ladder_if_unchanged(shared, &name, raw.as_deref(), &l).await? {
        tracing::info!(node = %name, "The repair ladder changed meanwhile (a recovery?); leaving it.");
        return Ok(());
    }
    match l.phase {
        ladder::Phase::Succeeded => shared.remediator.advance_state(&name, plan::State::Remediated).await?,
        ladder::Phase::Failed => shared.remediator.advance_state(&name, plan::State::Failed).await?,
        _ => {}
    }
    Ok(())
}

/// The current step of `l` failed for `why`: the outcome and the Event, and on the last rung the
/// ladder's failure (condition message too, for `kubectl describe node`).
async fn escalate(
    shared: &Shared,
    node: &k8s_openapi::api::core::v1::Node,
    l: &mut ladder::Ladder,
    why: &str,
    now: chrono::DateTime<chrono::Utc>,
) -> Result<(), BoxError> {
    let (number, total, step) = (l.step_number(), l.steps.len(), l.step());
    let name = l.request.node.clone();
    metrics::counter!("gpumedic_remediator_repair_steps_total", "action" => step.action.name(), "result" => "failed")
        .increment(1);
    if l.at_top() {
        l.escalate(why, now);
        let detail = format!(
            "repair failed: step {number}/{total} {} was the last ({why}); an operator must act. History: {}",
            step.action.name(),
            l.history.join("; ")
        );
        publish(shared, &ladder_outcome(l, ActionStatus::Failed, detail.clone()), None).await?;
        shared.remediator.record_event(node, "RepairFailed", detail.clone(), true).await;
        shared
            .remediator
            .restate_condition(&name, l.request.subsystem.condition_type(), "RepairFailed", &detail)
            .await?;
        metrics::counter!("gpumedic_remediator_repair_ladders_total", "result" => "failed").increment(1);
        tracing::error!(node = %name, verdict_id = %l.verdict_id, %detail, "A repair ladder failed on its last step: an operator must act.");
    } else {
        let next = l.steps[l.current + 1].action.name();
        let detail =
            format!("repair step {number}/{total} {} failed ({why}); escalating to {next}", step.action.name());
        publish(shared, &ladder_outcome(l, ActionStatus::Failed, detail.clone()), None).await?;
        shared.remediator.record_event(node, "RepairEscalated", detail, true).await;
        l.escalate(why, now);
    }
    Ok(())
}

/// Writes `l` on `name` if its ladder record still reads `before`, re-reading on conflicts (the
/// kubelet's status updates move the node's resourceVersion); false when the record changed.
async fn write_ladder_if_unchanged(
    shared: &Shared,
    name: &str,
    before: Option<&str>,
    l: &ladder::Ladder,
) -> Result<bool, BoxError> {
    let client = shared.remediator.client();
    let nodes: kube::Api<k8s_openapi::api::core::v1::Node> = kube::Api::all(client.clone());
    for _ in 0..5 {
        let Some(node) = nodes.get_opt(name).await? else { return Ok(false) };
        let now = node.metadata.annotations.as_ref().and_then(|a| a.get(ladder::LADDER_ANNOTATION)).map(String::as_str);
        if now != before {
            return Ok(false);
        }
        match ladder::write(&client, name, Some(l), node.metadata.resource_version.as_deref()).await {
            Ok(()) => return Ok(true),
            Err(kube::Error::Api(s)) if s.is_conflict() => continue,
            Err(e) => return Err(Box::new(e)),
        }
    }
    Err(format!("node {name} changed under every attempt to write its repair ladder").into())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The configuration from a webhook URL plus `args`, or its problems as `flag: message`.
    fn validate(args: &[&str]) -> Result<Config, Vec<String>> {
        let mut argv = vec!["gpumedic-remediator", "--kafka-bootstrap", "localhost:9092"];
        argv.extend(["--repair-webhook-url", "https://repair.example.com/v1/repair"]);
        argv.extend(args);
        Args::try_parse_from(argv)
            .expect("the flags parse")
            .validate()
            .map_err(|p| p.list().iter().map(|p| format!("{}: {}", p.field, p.message)).collect())
    }

    fn key_ids(config: &Config) -> Vec<&str> {
        config.webhook.as_ref().expect("a webhook").keys.keys().iter().map(hooks::Key::id).collect()
    }

    fn file(name: &str, contents: &str) -> String {
        let path = std::env::temp_dir().join(format!("gpumedic-remediator-{}-{name}", std::process::id()));
        std::fs::write(&path, contents).expect("the test file is written");
        path.display().to_string()
    }

    #[test]
    fn a_single_secret_is_the_key_named_default() {
        let config = validate(&["--repair-webhook-secret", "s3cret"]).expect("valid");
        assert_eq!(key_ids(&config), ["default"]);
        let config = validate(&["--repair-webhook-secret-file", &file("only", "s3cret\n")]).expect("valid");
        assert_eq!(key_ids(&config), ["default"]);
    }

    #[test]
    fn during_a_rotation_both_keys_sign_the_current_one_first() {
        let config = validate(&[
            "--repair-webhook-key-id",
            "2026-12",
            "--repair-webhook-secret-file",
            &file("new", "new-secret\n"),
            "--repair-webhook-previous-key-id",
            "default",
            "--repair-webhook-previous-secret-file",
            &file("old", "old-secret\n"),
        ])
        .expect("valid");
        assert_eq!(key_ids(&config), ["2026-12", "default"]);
        // A blank previous id (a ConfigMap entry emptied after the rotation) is no rotation.
        let config =
            validate(&["--repair-webhook-secret", "s3cret", "--repair-webhook-previous-key-id", " "]).expect("valid");
        assert_eq!(key_ids(&config), ["default"]);
    }

    #[test]
    fn every_key_problem_is_listed_against_its_flag() {
        let problems = validate(&[
            "--repair-webhook-secret",
            "",
            "--repair-webhook-key-id",
            "new,key",
            "--repair-webhook-previous-secret-file",
            "/nonexistent/previous",
        ])
        .expect_err("invalid");
        assert_eq!(problems.len(), 3, "{problems:#?}");
        assert!(problems[0].starts_with("--repair-webhook-key-id: the key id 'new,key' holds ','"), "{problems:#?}");
        assert_eq!(problems[1], "--repair-webhook-secret: the key must not be empty");
        assert!(problems[2].starts_with("--repair-webhook-previous-key-id: the previous key needs"), "{problems:#?}");

        let problems = validate(&[
            "--repair-webhook-secret",
            "same",
            "--repair-webhook-previous-key-id",
            "default",
            "--repair-webhook-previous-secret",
            "same",
        ])
        .expect_err("invalid");
        assert_eq!(
            problems,
            [
                "--repair-webhook-previous-key-id: must differ from --repair-webhook-key-id",
                "--repair-webhook-previous-secret: the previous key is the current key; a rotation needs a new one",
            ]
        );

        let problems =
            validate(&["--repair-webhook-previous-key-id", "old", "--repair-webhook-key-id", ""]).expect_err("invalid");
        assert_eq!(
            problems,
            [
                "--repair-webhook-secret: the webhook needs a secret (or --repair-webhook-secret-file)",
                "--repair-webhook-key-id: the key id is empty",
                "--repair-webhook-previous-key-id: names a previous key but none is given \
                 (--repair-webhook-previous-secret-file)",
            ]
        );
    }
}
