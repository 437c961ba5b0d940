//! GCP: the metadata server's `instance/maintenance-event` and `instance/upcoming-maintenance`
//! keys, both read with `Metadata-Flavor: Google`.
//!
//! `maintenance-event` is `NONE`, `MIGRATE_ON_HOST_MAINTENANCE` or
//! `TERMINATE_ON_HOST_MAINTENANCE`; it changes about 60 seconds before the event. It is read as a
//! hanging GET: `?wait_for_change=true&last_etag=<etag of the last answer>&timeout_sec=<poll
//! interval>` returns as soon as the value changes, or with the same value after the timeout.
//! `upcoming-maintenance` is a JSON document (`type`, `maintenance_status`, `window_start_time`,
//! `window_end_time`, `latest_window_start_time`, `can_reschedule`; RFC 3339 times) present
//! while maintenance is planned, and 404 otherwise; it is read once per change wait.

use std::time::Duration;

use chrono::{DateTime, Utc};
use gpumedic_schemas::health::CloudProvider;
use serde::Deserialize;

use super::{CloudError, Notice, PROBE_TIMEOUT, body};

const NAME: &str = "gcp";
/// The header every request carries and every answer echoes.
pub const FLAVOR_HEADER: &str = "Metadata-Flavor";
/// The maintenance-event key.
pub const EVENT_PATH: &str = "/computeMetadata/v1/instance/maintenance-event";
/// The upcoming-maintenance key.
pub const UPCOMING_PATH: &str = "/computeMetadata/v1/instance/upcoming-maintenance";
/// The key the detection probe reads.
pub const PROBE_PATH: &str = "/computeMetadata/v1/instance/id";

/// The notice for a `maintenance-event` value; `None` for `NONE`.
pub fn maintenance_event(value: &str) -> Option<Notice> {
    let value = value.trim();
    if value.is_empty() || value.eq_ignore_ascii_case("NONE") {
        return None;
    }
    Some(Notice {
        provider: CloudProvider::Gcp,
        id: "maintenance-event".into(),
        event_type: value.to_owned(),
        window_start: None,
        window_end: None,
        description: Some(match value {
            "MIGRATE_ON_HOST_MAINTENANCE" => "the instance is live-migrated in about 60 seconds".into(),
            "TERMINATE_ON_HOST_MAINTENANCE" => {
                "the instance is stopped for host maintenance in about 60 seconds".into()
            }
            other => format!("maintenance-event is {other}"),
        }),
        raw: Some(value.to_owned()),
    })
}

/// The `upcoming-maintenance` document (snake case from the metadata server; the REST API's
/// camel case is accepted too).
#[derive(Debug, Deserialize)]
struct Upcoming {
    #[serde(default, rename = "type", alias = "maintenance_type")]
    kind: Option<String>,
    #[serde(default, alias = "maintenanceStatus")]
    maintenance_status: Option<String>,
    #[serde(default, alias = "windowStartTime")]
    window_start_time: Option<String>,
    #[serde(default, alias = "windowEndTime")]
    window_end_time: Option<String>,
    #[serde(default, alias = "latestWindowStartTime")]
    latest_window_start_time: Option<String>,
    #[serde(default, alias = "canReschedule")]
    can_reschedule: Option<bool>,
}

/// Parses the `upcoming-maintenance` document.
pub fn upcoming_maintenance(text: &str) -> Result<Option<Notice>, String> {
    let text = text.trim();
    if text.is_empty() {
        return Ok(None);
    }
    let u: Upcoming = serde_json::from_str(text).map_err(|e| e.to_string())?;
    let time = |s: &Option<String>| {
        s.as_deref().and_then(|s| DateTime::parse_from_rfc3339(s.trim()).ok()).map(|t| t.with_timezone(&Utc))
    };
    let mut description = Vec::new();
    if let Some(s) = &u.maintenance_status {
        description.push(format!("status {s}"));
    }
    if let Some(l) = &u.latest_window_start_time {
        description.push(format!("starts at the latest {l}"));
    }
    if let Some(c) = u.can_reschedule {
        description.push(if c { "can be started early".to_owned() } else { "cannot be rescheduled".to_owned() });
    }
    Ok(Some(Notice {
        provider: CloudProvider::Gcp,
        id: "upcoming-maintenance".into(),
        event_type: u.kind.unwrap_or_else(|| "SCHEDULED".into()),
        window_start: time(&u.window_start_time),
        window_end: time(&u.window_end_time),
        description: (!description.is_empty()).then(|| description.join(", ")),
        raw: Some(text.to_owned()),
    }))
}

/// The GCP poller.
#[derive(Debug)]
pub struct Gcp {
    client: reqwest::Client,
    base: String,
    wait: Duration,
    etag: Option<String>,
}

impl Gcp {
    /// A poller for the metadata server at `base`, each change wait lasting at most `wait`.
    pub fn new(client: reqwest::Client, base: &str, wait: Duration) -> Self {
        Self { client, base: base.to_owned(), wait, etag: None }
    }

    /// The notices in force: waits for `maintenance-event` to change (the first call returns at
    /// once), then reads `upcoming-maintenance`.
    pub async fn poll(&mut self) -> Result<Vec<Notice>, CloudError> {
        let url = format!("{}{EVENT_PATH}", self.base);
        let mut request = self.client.get(&url).header(FLAVOR_HEADER, "Google");
        if let Some(etag) = &self.etag {
            let secs = self.wait.as_secs().max(1);
            request = request
                .query(&[("wait_for_change", "true"), ("last_etag", etag.as_str()), ("timeout_sec", &secs.to_string())])
                // The server holds the request up to `timeout_sec`; allow it that long and a bit.
                .timeout(Duration::from_secs(secs) + Duration::from_secs(5));
        } else {
            request = request.timeout(Duration::from_secs(5));
        }
        let resp = request.send().await.and_then(reqwest::Response::error_for_status);
        let resp = resp.map_err(|source| CloudError::Http { provider: NAME, source })?;
        self.etag = resp.headers().get("etag").and_then(|v| v.to_str().ok()).map(str::to_owned);
        let value = resp.text().await.map_err(|source| CloudError::Http { provider: NAME, source })?;
        let mut notices: Vec<Notice> = maintenance_event(&value).into_iter().collect();

        let r = self
            .client
            .get(format!("{}{UPCOMING_PATH}", self.base))
            .header(FLAVOR_HEADER, "Google")
            .timeout(Duration::from_secs(5))
            .send()
            .await;
        match r {
            // Nothing planned.
            Ok(resp) if resp.status() == reqwest::StatusCode::NOT_FOUND => {}
            other => {
                let text = body(NAME, other).await?;
                let upcoming =
                    upcoming_maintenance(&text).map_err(|message| CloudError::Payload { provider: NAME, message })?;
                notices.extend(upcoming);
            }
        }
        Ok(notices)
    }
}

/// True when a GCP metadata server answers at `base` (it marks answers `Metadata-Flavor: Google`).
pub async fn probe(client: &reqwest::Client, base: &str) -> bool {
    let r =
        client.get(format!("{base}{PROBE_PATH}")).header(FLAVOR_HEADER, "Google").timeout(PROBE_TIMEOUT).send().await;
    r.is_ok_and(|resp| {
        resp.status().is_success()
            && resp.headers().get(FLAVOR_HEADER).and_then(|v| v.to_str().ok()).is_some_and(|v| v == "Google")
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The shape the "Monitor and plan for a host maintenance event" page documents.
    const UPCOMING: &str = r#"{
  "can_reschedule": false,
  "latest_window_start_time": "2024-10-13T03:00:00Z",
  "maintenance_status": "PENDING",
  "type": "SCHEDULED",
  "window_end_time": "2024-10-13T05:00:00Z",
  "window_start_time": "2024-10-13T01:00:00Z"
}"#;

    #[test]
    fn maintenance_event_values() {
        assert_eq!(maintenance_event("NONE"), None);
        assert_eq!(maintenance_event(""), None);
        let m = maintenance_event("MIGRATE_ON_HOST_MAINTENANCE").unwrap();
        assert_eq!((m.id.as_str(), m.event_type.as_str()), ("maintenance-event", "MIGRATE_ON_HOST_MAINTENANCE"));
        assert!(maintenance_event("TERMINATE_ON_HOST_MAINTENANCE\n").is_some());
    }

    #[test]
    fn upcoming_maintenance_document() {
        let n = upcoming_maintenance(UPCOMING).unwrap().unwrap();
        assert_eq!(n.event_type, "SCHEDULED");
        assert_eq!(n.window_start, DateTime::parse_from_rfc3339("2024-10-13T01:00:00Z").ok().map(|t| t.to_utc()));
        assert_eq!(n.window_end, DateTime::parse_from_rfc3339("2024-10-13T05:00:00Z").ok().map(|t| t.to_utc()));
        assert!(n.description.as_deref().is_some_and(|d| d.contains("PENDING")));
        let camel =
            r#"{"type": "UNSCHEDULED", "windowStartTime": "2024-10-13T01:00:00Z", "maintenanceStatus": "ONGOING"}"#;
        let n = upcoming_maintenance(camel).unwrap().unwrap();
        assert_eq!(n.event_type, "UNSCHEDULED");
        assert!(n.window_start.is_some());
        assert!(upcoming_maintenance("not json").is_err());
    }
}
