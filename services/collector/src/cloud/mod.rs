//! Cloud maintenance: the notices a cloud provider's instance metadata service gives before it
//! reboots, migrates, freezes, preempts or retires the instance, as `cloud_maintenance` events.
//!
//! - AWS: IMDSv2 (a session token from `PUT /latest/api/token`, then
//!   `GET /latest/meta-data/events/maintenance/scheduled`), see [`aws`].
//! - GCP: `instance/maintenance-event` as a hanging GET (`wait_for_change`, bounded by the poll
//!   interval) and `instance/upcoming-maintenance`, see [`gcp`].
//! - Azure: Scheduled Events (`/metadata/scheduledevents`), filtered to this VM, see [`azure`].
//! - Oracle Cloud (OCI): the instance document of IMDS v2 (`/opc/v2/instance/`) and its
//!   `timeMaintenanceRebootDue`, see [`oci`].
//!
//! Each poll gives the set of notices in force; a [`Tracker`] turns successive sets into events:
//! an unhealthy event when a notice appears (or its type or window changes), a healthy one with
//! the same provider id when it goes away, both deduplicated by the provider's event id. The
//! first poll after a start with nothing scheduled publishes one healthy event, so an incident
//! opened before a restart can recover even if its notice ended while the collector was down.
//!
//! The provider is configured (`--cloud-provider aws|gcp|azure|oci`) or detected (`auto`, the
//! default): each documented endpoint is probed once at start with a short timeout, and off any
//! cloud the source logs one line and stays idle. Each provider's address is a flag, which is
//! how the tests point the source at a local server.

pub mod aws;
pub mod azure;
pub mod gcp;
pub mod oci;

use std::collections::BTreeMap;
use std::time::Duration;

use chrono::{DateTime, Utc};
use gpumedic_runtime::config::{Problems, Validate, parse_duration};
use gpumedic_runtime::kafka::KafkaError;
use gpumedic_schemas::HealthEvent;
use gpumedic_schemas::health::{CloudMaintenanceDetail, CloudProvider, Component, Detail, Entity, Source};
use tokio_util::sync::CancellationToken;

use crate::events::names;
use crate::publisher::Sink;

/// The link-local address of the instance metadata service on AWS, GCP, Azure and OCI alike. GCP's
/// `metadata.google.internal` resolves to it; the address avoids depending on cluster DNS.
pub const LINK_LOCAL: &str = "http://169.254.169.254";

/// How long a detection probe waits for an answer: off-cloud, nothing answers on the link-local
/// address and the collector must not wait long to find out.
pub const PROBE_TIMEOUT: Duration = Duration::from_secs(2);

/// The cloud maintenance flags.
#[derive(Debug, Clone, clap::Args)]
pub struct CloudArgs {
    /// The cloud whose maintenance notices are read: `auto` (detect), `aws`, `gcp`, `azure`, `oci`
    /// (Oracle Cloud) or `none`.
    #[arg(long, env = "GPUMEDIC_CLOUD_PROVIDER", default_value = "auto")]
    pub cloud_provider: String,
    /// How often maintenance notices are read (on GCP, the longest a change wait lasts).
    #[arg(long, env = "GPUMEDIC_CLOUD_POLL_INTERVAL", default_value = "10s")]
    pub cloud_poll_interval: String,
    /// The AWS instance metadata service (IMDSv2).
    #[arg(long, env = "GPUMEDIC_AWS_METADATA_URL", default_value = LINK_LOCAL)]
    pub aws_metadata_url: String,
    /// The GCP metadata server.
    #[arg(long, env = "GPUMEDIC_GCP_METADATA_URL", default_value = LINK_LOCAL)]
    pub gcp_metadata_url: String,
    /// The Azure instance metadata service.
    #[arg(long, env = "GPUMEDIC_AZURE_METADATA_URL", default_value = LINK_LOCAL)]
    pub azure_metadata_url: String,
    /// The Oracle Cloud (OCI) instance metadata service (IMDS v2).
    #[arg(long, env = "GPUMEDIC_OCI_METADATA_URL", default_value = LINK_LOCAL)]
    pub oci_metadata_url: String,
}

/// Which provider to read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ProviderChoice {
    /// Probe each provider's endpoint at start.
    Auto,
    /// This provider.
    Fixed(CloudProvider),
    /// No cloud maintenance source.
    None,
}

/// The validated cloud maintenance settings.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CloudSettings {
    /// The provider.
    pub provider: ProviderChoice,
    /// Time between polls.
    pub interval: Duration,
    /// Base URL of each provider's metadata service, without a trailing slash.
    pub aws_url: String,
    /// GCP's.
    pub gcp_url: String,
    /// Azure's.
    pub azure_url: String,
    /// Oracle Cloud's.
    pub oci_url: String,
}

impl Validate for CloudArgs {
    type Valid = CloudSettings;

    fn validate(self) -> Result<CloudSettings, Problems> {
        let mut p = Problems::default();
        let provider = p.check(
            "--cloud-provider",
            match self.cloud_provider.trim() {
                "auto" => Ok(ProviderChoice::Auto),
                "aws" => Ok(ProviderChoice::Fixed(CloudProvider::Aws)),
                "gcp" => Ok(ProviderChoice::Fixed(CloudProvider::Gcp)),
                "azure" => Ok(ProviderChoice::Fixed(CloudProvider::Azure)),
                "oci" => Ok(ProviderChoice::Fixed(oci::OCI)),
                "none" | "off" => Ok(ProviderChoice::None),
                other => Err(format!("'{other}' is not a provider; use auto, aws, gcp, azure, oci or none")),
            },
        );
        let interval = p.check(
            "--cloud-poll-interval",
            parse_duration(&self.cloud_poll_interval)
                .and_then(|d| if d.is_zero() { Err("must be longer than zero".into()) } else { Ok(d) }),
        );
        let mut url = |flag: &str, raw: &str| {
            let trimmed = raw.trim().trim_end_matches('/').to_owned();
            match reqwest::Url::parse(&trimmed) {
                Ok(u) if matches!(u.scheme(), "http" | "https") => Some(trimmed),
                _ => {
                    p.push(flag, format!("'{raw}' is not an http(s) URL"));
                    None
                }
            }
        };
        let aws_url = url("--aws-metadata-url", &self.aws_metadata_url);
        let gcp_url = url("--gcp-metadata-url", &self.gcp_metadata_url);
        let azure_url = url("--azure-metadata-url", &self.azure_metadata_url);
        let oci_url = url("--oci-metadata-url", &self.oci_metadata_url);
        p.finish(|| CloudSettings {
            provider: provider.expect("checked"),
            interval: interval.expect("checked"),
            aws_url: aws_url.expect("checked"),
            gcp_url: gcp_url.expect("checked"),
            azure_url: azure_url.expect("checked"),
            oci_url: oci_url.expect("checked"),
        })
    }
}

/// A maintenance notice in force, as a provider reports it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Notice {
    /// The provider.
    pub provider: CloudProvider,
    /// The provider's id for the event (the dedupe key).
    pub id: String,
    /// The provider's event type (`system-reboot`, `MIGRATE_ON_HOST_MAINTENANCE`, `Freeze`, ...).
    pub event_type: String,
    /// Start of the window, when announced.
    pub window_start: Option<DateTime<Utc>>,
    /// End of the window, when announced.
    pub window_end: Option<DateTime<Utc>>,
    /// The provider's description.
    pub description: Option<String>,
    /// The provider's payload for this notice.
    pub raw: Option<String>,
}

/// Why a poll failed.
#[derive(Debug, thiserror::Error)]
pub enum CloudError {
    /// The metadata service did not answer, or answered with an error status.
    #[error("the {provider} metadata service failed: {source}")]
    Http {
        /// The provider.
        provider: &'static str,
        /// What failed.
        #[source]
        source: reqwest::Error,
    },
    /// It answered with something that is not the documented payload.
    #[error("the {provider} metadata service answered an unreadable payload: {message}")]
    Payload {
        /// The provider.
        provider: &'static str,
        /// What is wrong with it.
        message: String,
    },
}

/// Reads one provider's notices.
#[derive(Debug)]
pub enum Poller {
    /// AWS.
    Aws(aws::Aws),
    /// GCP.
    Gcp(gcp::Gcp),
    /// Azure.
    Azure(azure::Azure),
    /// Oracle Cloud.
    Oci(oci::Oci),
}

impl Poller {
    /// A poller for `provider`, with the settings' address and interval.
    pub fn new(provider: CloudProvider, settings: &CloudSettings) -> Option<Self> {
        let client = metadata_client();
        Some(match provider {
            CloudProvider::Aws => Self::Aws(aws::Aws::new(client, &settings.aws_url)),
            CloudProvider::Gcp => Self::Gcp(gcp::Gcp::new(client, &settings.gcp_url, settings.interval)),
            CloudProvider::Azure => Self::Azure(azure::Azure::new(client, &settings.azure_url)),
            // OCI travels as `Other` until the schema has a symbol for it.
            CloudProvider::Other => Self::Oci(oci::Oci::new(client, &settings.oci_url)),
            CloudProvider::Unknown => return None,
        })
    }

    /// The provider.
    pub fn provider(&self) -> CloudProvider {
        match self {
            Self::Aws(_) => CloudProvider::Aws,
            Self::Gcp(_) => CloudProvider::Gcp,
            Self::Azure(_) => CloudProvider::Azure,
            Self::Oci(_) => oci::OCI,
        }
    }

    /// The notices in force now. On GCP this may wait up to the poll interval for a change, so
    /// the caller does not sleep between GCP polls.
    pub async fn poll(&mut self) -> Result<Vec<Notice>, CloudError> {
        match self {
            Self::Aws(p) => p.poll().await,
            Self::Gcp(p) => p.poll().await,
            Self::Azure(p) => p.poll().await,
            Self::Oci(p) => p.poll().await,
        }
    }

    /// Whether the poll waits for changes itself (no sleep between polls).
    pub fn waits_for_change(&self) -> bool {
        matches!(self, Self::Gcp(_))
    }
}

/// The HTTP client for metadata services: a short connect timeout and no proxy (the metadata
/// address is link-local; a proxy would answer for the wrong machine, or not at all).
pub fn metadata_client() -> reqwest::Client {
    reqwest::Client::builder().no_proxy().connect_timeout(PROBE_TIMEOUT).build().expect("a plain HTTP client builds")
}

/// Probes each provider's documented endpoint at once, with [`PROBE_TIMEOUT`]; the first in the
/// order GCP, Azure, OCI, AWS that answers like itself wins. GCP marks its answers with a
/// `Metadata-Flavor: Google` header, Azure's instance document has a `compute` section and OCI's
/// an instance OCID as its id, so none is mistaken for another on the shared address; AWS is
/// judged last because it only needs its token endpoint to answer.
pub async fn detect(settings: &CloudSettings) -> Option<CloudProvider> {
    let client = metadata_client();
    let (gcp, azure, oci, aws) = tokio::join!(
        gcp::probe(&client, &settings.gcp_url),
        azure::probe(&client, &settings.azure_url),
        oci::probe(&client, &settings.oci_url),
        aws::probe(&client, &settings.aws_url),
    );
    [(gcp, CloudProvider::Gcp), (azure, CloudProvider::Azure), (oci, oci::OCI), (aws, CloudProvider::Aws)]
        .into_iter()
        .find_map(|(found, p)| found.then_some(p))
}

/// Turns successive sets of notices into events.
#[derive(Debug)]
pub struct Tracker {
    node: String,
    provider: CloudProvider,
    known: BTreeMap<String, Notice>,
    polled: bool,
}

impl Tracker {
    /// A tracker for `node` on `provider`.
    pub fn new(node: impl Into<String>, provider: CloudProvider) -> Self {
        Self { node: node.into(), provider, known: BTreeMap::new(), polled: false }
    }

    /// The events that the notices in force now call for.
    pub fn update(&mut self, current: Vec<Notice>) -> Vec<HealthEvent> {
        let mut out = Vec::new();
        let first = !std::mem::replace(&mut self.polled, true);
        let mut seen = BTreeMap::new();
        for n in current {
            // A notice listed twice in one answer counts once.
            seen.entry(n.id.clone()).or_insert(n);
        }
        for (id, gone) in std::mem::take(&mut self.known) {
            if seen.contains_key(&id) {
                self.known.insert(id, gone);
            } else {
                tracing::info!(provider = ?self.provider, event_id = %id, "A cloud maintenance notice ended.");
                out.push(self.event(&gone, true));
            }
        }
        for (id, notice) in seen {
            if self.known.get(&id) != Some(&notice) {
                tracing::info!(
                    provider = ?self.provider,
                    event_id = %id,
                    event_type = %notice.event_type,
                    window_start = ?notice.window_start,
                    "Cloud maintenance is scheduled for this node."
                );
                out.push(self.event(&notice, false));
                self.known.insert(id, notice);
            }
        }
        if first && self.known.is_empty() {
            out.push(self.event(
                &Notice {
                    provider: self.provider,
                    id: String::new(),
                    event_type: "none".into(),
                    window_start: None,
                    window_end: None,
                    description: Some("no maintenance is scheduled".into()),
                    raw: None,
                },
                true,
            ));
        }
        out
    }

    fn event(&self, n: &Notice, healthy: bool) -> HealthEvent {
        let mut e = HealthEvent::new(
            &self.node,
            Source::Cloud,
            Component::Node,
            Entity::default(),
            Detail::CloudMaintenance(CloudMaintenanceDetail {
                provider: n.provider,
                event_type: n.event_type.clone(),
                provider_event_id: (!n.id.is_empty()).then(|| n.id.clone()),
                window_start: n.window_start,
                window_end: n.window_end,
                description: n.description.clone(),
            }),
        );
        e.healthy = healthy;
        e.raw = n.raw.clone();
        metrics::counter!(
            names::CLOUD_NOTICES_TOTAL,
            "provider" => provider_name(n.provider),
            "state" => if healthy { "ended" } else { "scheduled" }
        )
        .increment(1);
        e
    }
}

/// The provider's name in flags, logs and metric labels.
pub fn provider_name(p: CloudProvider) -> &'static str {
    match p {
        CloudProvider::Aws => "aws",
        CloudProvider::Gcp => "gcp",
        CloudProvider::Azure => "azure",
        // The only `Other` provider the collector reads.
        CloudProvider::Other => "oci",
        CloudProvider::Unknown => "unknown",
    }
}

/// The provider to read: the configured one, or the detected one; `None` when there is none.
pub async fn resolve(settings: &CloudSettings) -> Option<CloudProvider> {
    match settings.provider {
        ProviderChoice::None => None,
        ProviderChoice::Fixed(p) => Some(p),
        ProviderChoice::Auto => {
            let found = detect(settings).await;
            match found {
                Some(p) => tracing::info!(provider = provider_name(p), "Detected the cloud provider."),
                None => tracing::info!(
                    "No cloud metadata service answered; cloud maintenance notices are off (set --cloud-provider to force one)."
                ),
            }
            found
        }
    }
}

/// Reads maintenance notices until `token` is cancelled. Off-cloud it waits for the token, so the
/// service does not take an idle source for a dead one.
pub async fn watch_maintenance(
    node: String,
    settings: CloudSettings,
    emitter: Sink,
    token: CancellationToken,
) -> Result<(), KafkaError> {
    let provider = tokio::select! {
        () = token.cancelled() => return Ok(()),
        p = resolve(&settings) => p,
    };
    let Some(mut poller) = provider.and_then(|p| Poller::new(p, &settings)) else {
        token.cancelled().await;
        return Ok(());
    };
    let mut tracker = Tracker::new(node, poller.provider());
    let mut failing = false;
    loop {
        let polled = tokio::select! {
            () = token.cancelled() => return Ok(()),
            r = poller.poll() => r,
        };
        match polled {
            Ok(notices) => {
                if std::mem::replace(&mut failing, false) {
                    tracing::info!(provider = provider_name(poller.provider()), "The metadata service answers again.");
                }
                for e in tracker.update(notices) {
                    if !emitter.emit_until_done(&e, &token).await {
                        return Ok(());
                    }
                }
            }
            Err(e) => {
                metrics::counter!(names::CLOUD_POLL_FAILURES_TOTAL, "provider" => provider_name(poller.provider()))
                    .increment(1);
                // Known notices stay known: a failed poll is no evidence that they ended.
                if !std::mem::replace(&mut failing, true) {
                    tracing::warn!(error = %e, "Cannot read cloud maintenance notices; retrying.");
                }
            }
        }
        if !poller.waits_for_change() || failing {
            tokio::select! {
                () = token.cancelled() => return Ok(()),
                () = tokio::time::sleep(settings.interval) => {}
            }
        }
    }
}

/// Reads the body of a successful answer; any error status is an error.
pub(crate) async fn body(
    provider: &'static str,
    r: Result<reqwest::Response, reqwest::Error>,
) -> Result<String, CloudError> {
    let r = r.and_then(reqwest::Response::error_for_status).map_err(|source| CloudError::Http { provider, source })?;
    r.text().await.map_err(|source| CloudError::Http { provider, source })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn notice(id: &str, kind: &str) -> Notice {
        Notice {
            provider: CloudProvider::Aws,
            id: id.into(),
            event_type: kind.into(),
            window_start: DateTime::from_timestamp(1_800_000_000, 0),
            window_end: None,
            description: None,
            raw: None,
        }
    }

    fn summary(events: &[HealthEvent]) -> Vec<(String, String, bool)> {
        events
            .iter()
            .map(|e| match &e.detail {
                Detail::CloudMaintenance(d) => {
                    (d.provider_event_id.clone().unwrap_or_default(), d.event_type.clone(), e.healthy)
                }
                other => panic!("{other:?}"),
            })
            .collect()
    }

    #[test]
    fn notices_appear_once_and_end_with_healthy_evidence() {
        let mut t = Tracker::new("n", CloudProvider::Aws);
        assert_eq!(summary(&t.update(vec![])), [(String::new(), "none".into(), true)], "a clean start says so once");
        assert!(t.update(vec![]).is_empty());
        let a = notice("instance-event-1", "system-reboot");
        assert_eq!(
            summary(&t.update(vec![a.clone(), a.clone()])),
            [("instance-event-1".into(), "system-reboot".into(), false)]
        );
        assert!(t.update(vec![a.clone()]).is_empty(), "deduplicated by event id");
        let moved = Notice { window_start: DateTime::from_timestamp(1_800_003_600, 0), ..a.clone() };
        assert_eq!(t.update(vec![moved.clone()]).len(), 1, "a rescheduled window is news");
        let b = notice("instance-event-2", "instance-stop");
        let both = t.update(vec![moved, b.clone()]);
        assert_eq!(summary(&both), [("instance-event-2".into(), "instance-stop".into(), false)]);
        assert_eq!(
            summary(&t.update(vec![b])),
            [("instance-event-1".into(), "system-reboot".into(), true)],
            "the ended notice comes back healthy with its id"
        );
        assert!(both.iter().all(|e| e.source == Source::Cloud && e.component == Component::Node));
    }

    #[test]
    fn a_start_with_a_notice_does_not_claim_health() {
        let mut t = Tracker::new("n", CloudProvider::Aws);
        let events = t.update(vec![notice("e", "system-maintenance")]);
        assert_eq!(events.len(), 1);
        assert!(!events[0].healthy);
    }

    #[test]
    fn flags_are_validated() {
        let args = |provider: &str, interval: &str, url: &str| CloudArgs {
            cloud_provider: provider.into(),
            cloud_poll_interval: interval.into(),
            aws_metadata_url: url.into(),
            gcp_metadata_url: LINK_LOCAL.into(),
            azure_metadata_url: LINK_LOCAL.into(),
            oci_metadata_url: LINK_LOCAL.into(),
        };
        let ok = args("auto", "10s", "http://127.0.0.1:8080/").validate().unwrap();
        assert_eq!(ok.provider, ProviderChoice::Auto);
        assert_eq!(ok.aws_url, "http://127.0.0.1:8080", "a trailing slash is dropped");
        assert_eq!(args("none", "1s", LINK_LOCAL).validate().unwrap().provider, ProviderChoice::None);
        assert_eq!(args("oci", "1s", LINK_LOCAL).validate().unwrap().provider, ProviderChoice::Fixed(oci::OCI));
        let bad = args("oracle", "0s", "169.254.169.254").validate().unwrap_err();
        let fields: Vec<&str> = bad.list().iter().map(|p| p.field.as_str()).collect();
        assert_eq!(fields, ["--cloud-provider", "--cloud-poll-interval", "--aws-metadata-url"]);
    }
}
