//! The remediator's configuration: its flags and environment variables ([`Args`]), validated
//! into a [`Config`] with every problem listed at once.

use std::time::Duration;

use clap::Parser;
use gpumedic_runtime::config::{CommonArgs, CommonConfig, Problems, Validate, parse_duration};
use gpumedic_runtime::postgres;
use gpumedic_runtime::stage::{StageArgs, StageDefaults, StageSettings};
use gpumedic_schemas::topics;

use crate::apply::Settings;
use crate::drain::{self, DrainPolicy};
use crate::lease::LeaseSettings;
use crate::plan::{Mode, Policy};
use crate::safety::BreakerLimits;
use crate::window::Window;
use crate::{control, hooks, ladder, validate};

/// The defaults of the remediator's stage flags.
#[derive(Debug, Clone)]
pub struct Defaults;

impl StageDefaults for Defaults {
    const GROUP: &'static str = "gpumedic-remediator";
}

/// Command-line flags and environment variables.
#[derive(Debug, Parser)]
#[command(name = "gpumedic-remediator", version, about = "Applies verdicts to Kubernetes nodes, safely.")]
pub struct Args {
    #[command(flatten)]
    common: CommonArgs,
    #[command(flatten)]
    stage: StageArgs<Defaults>,
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
    /// Circuit breaker: the largest number of single GPUs quarantined (DRA device taints) within
    /// the window; one more trips the breaker.
    #[arg(long, env = "GPUMEDIC_BREAKER_MAX_GPUS", default_value_t = 100)]
    breaker_max_gpus: usize,
    /// Quarantine only the faulty GPU (a DeviceTaintRule) where the node publishes its GPUs through
    /// DRA (ResourceSlices of driver gpu.nvidia.com) and the fault is GPU-scoped; `false`: always
    /// the node.
    #[arg(long, env = "GPUMEDIC_GPU_QUARANTINE", default_value_t = true, action = clap::ArgAction::Set)]
    gpu_quarantine: bool,
    /// The share (0..1) of a node's GPUs that may be quarantined one by one; a node with more
    /// quarantined goes out whole.
    #[arg(long, env = "GPUMEDIC_GPU_QUARANTINE_MAX_SHARE", default_value_t = 0.5)]
    gpu_quarantine_max_share: f64,
    /// New quarantines allowed per minute.
    #[arg(long, env = "GPUMEDIC_QUARANTINES_PER_MINUTE", default_value_t = 20)]
    quarantines_per_minute: usize,
    /// How long a drain may take before it is reported incomplete.
    #[arg(long, env = "GPUMEDIC_DRAIN_DEADLINE", default_value = "5m")]
    drain_deadline: String,
    /// Grace period for evicted pods, overriding the pods' own (unset: theirs).
    #[arg(long, env = "GPUMEDIC_DRAIN_GRACE_SECONDS")]
    drain_grace_seconds: Option<i64>,
    /// How pods leave a drained node: `immediate` (evict now), `allow-completion` (evict nothing,
    /// wait for them to finish until the deadline) or `delete-after-timeout` (evict, and
    /// force-delete what is left at the deadline, PodDisruptionBudget or not).
    #[arg(long, env = "GPUMEDIC_DRAIN_MODE", default_value = "immediate")]
    drain_mode: String,
    /// Exceptions per namespace and priority class, repeatable or `;`-separated, first match wins:
    /// `namespace=inference-*:mode=allow-completion,deadline=30m`,
    /// `priorityClass=system-*:mode=skip`,
    /// `namespace=batch,priorityClass=low:mode=delete-after-timeout,grace=30,deadline=2m`.
    #[arg(long = "drain-policy", env = "GPUMEDIC_DRAIN_POLICIES", value_delimiter = ';')]
    drain_policies: Vec<String>,
    /// Namespace globs never drained, comma-separated.
    #[arg(long, env = "GPUMEDIC_DRAIN_EXCLUDE_NAMESPACES", value_delimiter = ',', default_value = "kube-system")]
    drain_exclude_namespaces: Vec<String>,
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
    /// How long a custom action (a rule's `action: custom`, run through the repair hooks in
    /// full-remediation) may take: a webhook's step succeeds on healthy evidence (the incident's
    /// recovery) before it, a custom resource's on its phase. Longer than the custom rules' quiet
    /// periods (Xid 45 alone: 1h), or every webhook call times out.
    #[arg(long, env = "GPUMEDIC_CUSTOM_ACTION_TIMEOUT", default_value = "2h")]
    custom_action_timeout: String,
    /// How often the leader drives the repair ladders (calls hooks, reads their status, escalates).
    #[arg(long, env = "GPUMEDIC_REPAIR_CHECK", default_value = "10s")]
    repair_check: String,
    /// The incident store (the classifier's PostgreSQL, a read-only role is enough): the leader
    /// resyncs every managed node against its open incidents from there, so verdicts it missed,
    /// was refused or skipped still converge. Unset: no resync (verdicts only), with a warning.
    #[arg(long, env = "GPUMEDIC_INCIDENT_DATABASE_URL", hide_env_values = true)]
    incident_database_url: Option<String>,
    /// How often the leader resyncs the managed nodes against the open incidents.
    #[arg(long, env = "GPUMEDIC_RESYNC_INTERVAL", default_value = "2m")]
    resync_interval: String,
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
    /// Validate a repaired node before it returns to service (full-remediation): `job` runs a
    /// Kubernetes Job on the node when its recovery verdict arrives (by default `dcgmi diag -r 2`,
    /// or --validation-job-template); `webhook` asks the repair webhook for the action `validate`
    /// at every look until it answers Succeeded or Failed; `resource` creates the repair custom
    /// resource with the action `validate` and reads its phase. The node returns only when the
    /// validation passes; a failure or a timeout escalates along the repair ladder. `none`: the
    /// recovery verdict returns it.
    #[arg(long, env = "GPUMEDIC_VALIDATION", default_value = "none",
          value_parser = ["none", "job", "webhook", "resource"])]
    validation: String,
    /// A YAML template of the validation Job (batch/v1; `{{node}}`, `{{gpu_uuid}}`,
    /// `{{incident_id}}`, `{{verdict_id}}`, `{{name}}` are filled in; its pod must tolerate
    /// gpumedic.io/unhealthy). Default: DCGM's level-2 diagnostic pinned to the node.
    #[arg(long, env = "GPUMEDIC_VALIDATION_JOB_TEMPLATE")]
    validation_job_template: Option<std::path::PathBuf>,
    /// How long a validation Job may take before it counts as failed.
    #[arg(long, env = "GPUMEDIC_VALIDATION_TIMEOUT", default_value = "30m")]
    validation_timeout: String,
    /// After a validation passes, how long the node stays out (state `burn-in`) without a new
    /// fault before it returns (`30m`, `24h`); a fault verdict meanwhile escalates the repair
    /// ladder, except one of another incident on another GPU, which holds the burn-in until that
    /// incident recovers (then it starts over). Unset or `0s`: no burn-in.
    #[arg(long, env = "GPUMEDIC_VALIDATION_BURN_IN")]
    validation_burn_in: Option<String>,
    /// The namespace validation Jobs are created in (a template's own namespace wins); default
    /// the lease namespace.
    #[arg(long, env = "GPUMEDIC_VALIDATION_NAMESPACE")]
    validation_namespace: Option<String>,
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
    /// Kafka settings and the consumer group.
    pub stage: StageSettings,
    /// The verdict topic.
    pub verdicts_topic: String,
    /// The actions topic.
    pub actions_topic: String,
    /// The edge's settings.
    pub settings: Settings,
    /// Breaker limits.
    pub breaker: BreakerLimits,
    /// The breaker's limit on single GPUs quarantined within its window.
    pub breaker_max_gpus: usize,
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
    /// The incident store the leader resyncs from, when configured.
    pub incident_database_url: Option<String>,
    /// How often the leader resyncs.
    pub resync_interval: Duration,
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
        let stage = self.stage.validate().map_err(|e| p.extend(e)).ok();
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
        if self.breaker_max_gpus == 0 {
            p.push("--breaker-max-gpus", "must be at least 1 (turn GPU quarantine off with --gpu-quarantine=false)");
        }
        if !(0.0..=1.0).contains(&self.gpu_quarantine_max_share) {
            p.push("--gpu-quarantine-max-share", "must be between 0 and 1");
        }
        let window = p.check("--breaker-window", parse_duration(&self.breaker_window));
        let deadline = p.check("--drain-deadline", parse_duration(&self.drain_deadline));
        let drain_mode = p.check("--drain-mode", drain::parse_mode(self.drain_mode.trim(), self.drain_grace_seconds));
        let mut drain_rules = Vec::new();
        for raw in self.drain_policies.iter().filter(|r| !r.trim().is_empty()) {
            if let Some(rule) = p.check("--drain-policy", raw.trim().parse::<drain::DrainRule>()) {
                drain_rules.push(rule);
            }
        }
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
        let custom_timeout = p.check("--custom-action-timeout", parse_duration(&self.custom_action_timeout));
        if custom_timeout.is_some_and(|t| t.is_zero()) {
            p.push("--custom-action-timeout", "must be more than 0");
        }
        let repair_ladder =
            repair_timeout.and_then(|t| p.check("--repair-ladder", ladder::parse_steps(&self.repair_ladder, t)));
        let repair_check = p.check("--repair-check", parse_duration(&self.repair_check));
        let resync_interval = p.check("--resync-interval", parse_duration(&self.resync_interval));
        if resync_interval.is_some_and(|d| d.is_zero()) {
            p.push("--resync-interval", "must be more than zero");
        }
        let incident_database_url = self.incident_database_url.filter(|u| !u.trim().is_empty());
        if let Some(url) = &incident_database_url {
            postgres::check_url(&mut p, "--incident-database-url", url);
        }
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
        let validation_timeout = p.check("--validation-timeout", parse_duration(&self.validation_timeout));
        if validation_timeout.is_some_and(|t| t.is_zero()) {
            p.push("--validation-timeout", "must be more than 0");
        }
        let validation_template = match &self.validation_job_template {
            Some(file) => p.check(
                "--validation-job-template",
                std::fs::read_to_string(file)
                    .map_err(|e| format!("cannot read {}: {e}", file.display()))
                    .and_then(|text| {
                        serde_yaml::from_str::<serde_json::Value>(&text).map_err(|e| format!("{}: {e}", file.display()))
                    })
                    .and_then(|t| validate::check_template(&t).map(|()| t)),
            ),
            None => serde_yaml::from_str::<serde_json::Value>(validate::DEFAULT_TEMPLATE).ok(),
        };
        let step = match self.validation.as_str() {
            "job" => Some(validate::Step::Job(validation_template.clone().unwrap_or_default())),
            "webhook" => {
                if self.repair_webhook_url.as_deref().is_none_or(|u| u.trim().is_empty()) {
                    p.push("--validation", "webhook validates through the repair webhook: set --repair-webhook-url");
                }
                Some(validate::Step::Webhook)
            }
            "resource" => {
                if self.repair_resource_template.is_none() {
                    p.push(
                        "--validation",
                        "resource validates through the repair custom resource: set --repair-resource-template",
                    );
                }
                Some(validate::Step::Resource)
            }
            _ => None,
        };
        let burn_in = match self.validation_burn_in.as_deref().map(str::trim).filter(|b| !b.is_empty()) {
            Some(raw) => p.check("--validation-burn-in", parse_duration(raw)).filter(|b| !b.is_zero()),
            None => None,
        };
        if burn_in.is_some() && step.is_none() {
            p.push("--validation-burn-in", "a burn-in follows a validation: set --validation too");
        }
        let validation = step.map(|step| validate::Settings {
            burn_in,
            step,
            namespace: self
                .validation_namespace
                .clone()
                .filter(|n| !n.trim().is_empty())
                .unwrap_or_else(|| namespace.clone()),
            timeout: validation_timeout.unwrap_or_default(),
        });
        let resource = template.map(|template| hooks::ResourceSettings {
            template,
            status_path: self.repair_resource_status_path.trim().to_owned(),
            default_namespace: namespace.clone(),
        });
        p.finish(|| Config {
            common: common.expect("checked"),
            stage: stage.expect("checked"),
            verdicts_topic: self.verdicts_topic,
            actions_topic: self.actions_topic,
            settings: Settings {
                policy: Policy { mode: mode.expect("checked"), partial_drain: self.partial_drain, ..Policy::default() },
                drain: DrainPolicy {
                    mode: drain_mode.expect("checked"),
                    deadline: deadline.expect("checked"),
                    rules: drain_rules,
                    exclude_namespaces: self
                        .drain_exclude_namespaces
                        .iter()
                        .map(|n| n.trim().to_owned())
                        .filter(|n| !n.is_empty())
                        .collect(),
                    ..DrainPolicy::default()
                },
                ladder: repair_ladder.expect("checked"),
                custom_timeout: custom_timeout.expect("checked"),
                validation,
                gpu_quarantine: crate::dra::GpuQuarantine {
                    enabled: self.gpu_quarantine,
                    max_share: self.gpu_quarantine_max_share,
                },
                ..Settings::default()
            },
            breaker: BreakerLimits {
                max_share: self.breaker_max_share,
                max_count: self.breaker_max_count,
                window: window.expect("checked"),
            },
            breaker_max_gpus: self.breaker_max_gpus,
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
            incident_database_url,
            resync_interval: resync_interval.expect("checked"),
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

    #[test]
    fn validation_through_the_hooks_needs_the_hook_it_names() {
        let config = validate(&["--repair-webhook-secret", "s", "--validation", "webhook"]).expect("valid");
        let validation = config.settings.validation.expect("validation on");
        assert_eq!(validation.step, validate::Step::Webhook);
        let problems = validate(&["--repair-webhook-secret", "s", "--validation", "resource"]).expect_err("invalid");
        assert_eq!(
            problems,
            ["--validation: resource validates through the repair custom resource: set --repair-resource-template"]
        );
        let config = validate(&["--repair-webhook-secret", "s", "--validation", "job"]).expect("valid");
        assert!(matches!(config.settings.validation.expect("validation on").step, validate::Step::Job(_)));
    }

    #[test]
    fn a_burn_in_is_off_unless_set_and_follows_a_validation() {
        let config = validate(&["--repair-webhook-secret", "s", "--validation", "job"]).expect("valid");
        assert_eq!(config.settings.validation.expect("validation on").burn_in, None);
        let on = ["--repair-webhook-secret", "s", "--validation", "job", "--validation-burn-in", "24h"];
        let config = validate(&on).expect("valid");
        assert_eq!(config.settings.validation.expect("validation on").burn_in, Some(Duration::from_secs(86_400)));
        let off = ["--repair-webhook-secret", "s", "--validation", "job", "--validation-burn-in", "0s"];
        assert_eq!(validate(&off).expect("valid").settings.validation.expect("validation on").burn_in, None);
        let problems = validate(&["--repair-webhook-secret", "s", "--validation-burn-in", "1h"]).expect_err("invalid");
        assert_eq!(problems, ["--validation-burn-in: a burn-in follows a validation: set --validation too"]);
    }

    #[test]
    fn gpu_quarantine_limits_are_checked_at_start() {
        let config = validate(&["--repair-webhook-secret", "s"]).expect("valid");
        assert!(config.settings.gpu_quarantine.enabled);
        assert_eq!((config.breaker_max_gpus, config.settings.gpu_quarantine.max_share), (100, 0.5));
        let config = validate(&["--repair-webhook-secret", "s", "--gpu-quarantine", "false"]).expect("valid");
        assert!(!config.settings.gpu_quarantine.enabled);
        let problems =
            validate(&["--repair-webhook-secret", "s", "--breaker-max-gpus", "0", "--gpu-quarantine-max-share", "1.5"])
                .expect_err("invalid");
        assert!(problems.iter().any(|p| p.starts_with("--breaker-max-gpus: must be at least 1")), "{problems:#?}");
        assert!(problems.iter().any(|p| p == "--gpu-quarantine-max-share: must be between 0 and 1"), "{problems:#?}");
    }
}
