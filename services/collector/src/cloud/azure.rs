//! Azure: Scheduled Events from the instance metadata service.
//!
//! `GET /metadata/scheduledevents?api-version=2020-07-01` with `Metadata: true` answers
//! `{"DocumentIncarnation": n, "Events": [...]}`; each event has `EventId`, `EventType`
//! (`Reboot`, `Redeploy`, `Freeze`, `Preempt`, `Terminate`), `ResourceType`, `Resources` (the VM
//! names it applies to), `EventStatus` (`Scheduled`, `Started`), `NotBefore` (RFC 1123, empty once
//! started), `Description`, `EventSource` and `DurationInSeconds` (-1 when unknown). Events for
//! other VMs of the same availability set are skipped, using this VM's name from
//! `/metadata/instance/compute/name`. The collector only reads events: it never approves
//! (expedites) one, which stays the operator's or the drain's decision.

use std::time::Duration;

use chrono::{DateTime, Utc};
use gpumedic_schemas::health::CloudProvider;
use serde::Deserialize;

use super::{CloudError, Notice, PROBE_TIMEOUT, body};

const NAME: &str = "azure";
/// The header every request must carry.
pub const METADATA_HEADER: &str = "Metadata";
/// The scheduled events path, with the API version the collector reads.
pub const EVENTS_PATH: &str = "/metadata/scheduledevents?api-version=2020-07-01";
/// This VM's name.
pub const NAME_PATH: &str = "/metadata/instance/compute/name?api-version=2021-02-01&format=text";
/// The instance document the detection probe reads.
pub const PROBE_PATH: &str = "/metadata/instance?api-version=2021-02-01";

#[derive(Debug, Deserialize)]
#[serde(rename_all = "PascalCase")]
struct Document {
    events: Vec<serde_json::Value>,
}

#[derive(Debug, Deserialize)]
#[serde(rename_all = "PascalCase")]
struct Event {
    event_id: String,
    event_type: String,
    #[serde(default)]
    resources: Vec<String>,
    #[serde(default)]
    event_status: Option<String>,
    #[serde(default)]
    not_before: Option<String>,
    #[serde(default)]
    description: Option<String>,
    #[serde(default)]
    duration_in_seconds: Option<i64>,
}

/// Parses a Scheduled Events document into the notices in force for the VM named `vm` (all of
/// them when the name is unknown).
pub fn parse_events(text: &str, vm: Option<&str>) -> Result<Vec<Notice>, String> {
    let doc: Document = serde_json::from_str(text.trim()).map_err(|e| e.to_string())?;
    let mut out = Vec::new();
    for value in doc.events {
        let e: Event = serde_json::from_value(value.clone()).map_err(|e| e.to_string())?;
        if let Some(vm) = vm
            && !e.resources.is_empty()
            && !e.resources.iter().any(|r| r.eq_ignore_ascii_case(vm))
        {
            continue;
        }
        if e.event_status.as_deref().is_some_and(|s| !matches!(s, "Scheduled" | "Started")) {
            continue;
        }
        let start = e
            .not_before
            .as_deref()
            .filter(|s| !s.trim().is_empty())
            .and_then(|s| DateTime::parse_from_rfc2822(s.trim()).ok())
            .map(|t| t.with_timezone(&Utc));
        let end = match (start, e.duration_in_seconds) {
            (Some(s), Some(d)) if d > 0 => Some(s + chrono::Duration::seconds(d)),
            _ => None,
        };
        let description = match (e.description.filter(|d| !d.trim().is_empty()), e.event_status) {
            (Some(d), Some(status)) => Some(format!("{d} ({status})")),
            (d, status) => d.or(status),
        };
        out.push(Notice {
            provider: CloudProvider::Azure,
            id: e.event_id,
            event_type: e.event_type,
            window_start: start,
            window_end: end,
            description,
            raw: Some(value.to_string()),
        });
    }
    Ok(out)
}

/// The Azure poller.
#[derive(Debug)]
pub struct Azure {
    client: reqwest::Client,
    base: String,
    vm: Option<String>,
}

impl Azure {
    /// A poller for the metadata service at `base`.
    pub fn new(client: reqwest::Client, base: &str) -> Self {
        Self { client, base: base.to_owned(), vm: None }
    }

    /// The notices in force for this VM.
    pub async fn poll(&mut self) -> Result<Vec<Notice>, CloudError> {
        if self.vm.is_none() {
            let r = self
                .client
                .get(format!("{}{NAME_PATH}", self.base))
                .header(METADATA_HEADER, "true")
                .timeout(Duration::from_secs(5))
                .send()
                .await;
            // Without the name every event is taken as this VM's, the safe side.
            self.vm = body(NAME, r).await.ok().map(|n| n.trim().to_owned()).filter(|n| !n.is_empty());
        }
        let r = self
            .client
            .get(format!("{}{EVENTS_PATH}", self.base))
            .header(METADATA_HEADER, "true")
            .timeout(Duration::from_secs(10))
            .send()
            .await;
        let text = body(NAME, r).await?;
        parse_events(&text, self.vm.as_deref()).map_err(|message| CloudError::Payload { provider: NAME, message })
    }
}

/// True when an Azure instance metadata service answers at `base`.
pub async fn probe(client: &reqwest::Client, base: &str) -> bool {
    let r =
        client.get(format!("{base}{PROBE_PATH}")).header(METADATA_HEADER, "true").timeout(PROBE_TIMEOUT).send().await;
    match r {
        Ok(resp) if resp.status().is_success() => resp
            .json::<serde_json::Value>()
            .await
            .is_ok_and(|doc| doc.get("compute").is_some_and(serde_json::Value::is_object)),
        _ => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The shape of the "Azure Metadata Service: Scheduled Events" page's example.
    const DOC: &str = r#"{
    "DocumentIncarnation": 2,
    "Events": [
        {
            "EventId": "C7061BAC-AFDC-4513-B24B-AA5F13A16123",
            "EventStatus": "Scheduled",
            "EventType": "Freeze",
            "ResourceType": "VirtualMachine",
            "Resources": ["WestNO_0", "WestNO_1"],
            "NotBefore": "Mon, 11 Apr 2022 22:26:58 GMT",
            "Description": "Virtual machine is being paused because of a memory-preserving Live Migration operation.",
            "EventSource": "Platform",
            "DurationInSeconds": 5
        },
        {
            "EventId": "A123BC45-1234-5678-AB90-ABCDEF123456",
            "EventStatus": "Started",
            "EventType": "Reboot",
            "ResourceType": "VirtualMachine",
            "Resources": ["WestNO_2"],
            "NotBefore": "",
            "Description": "Virtual machine is going to be restarted as requested by authorized user.",
            "EventSource": "User",
            "DurationInSeconds": -1
        }
    ]
}"#;

    #[test]
    fn documented_payload_filtered_to_this_vm() {
        let mine = parse_events(DOC, Some("westno_1")).unwrap();
        assert_eq!(mine.len(), 1);
        let n = &mine[0];
        assert_eq!((n.id.as_str(), n.event_type.as_str()), ("C7061BAC-AFDC-4513-B24B-AA5F13A16123", "Freeze"));
        assert_eq!(n.window_start, DateTime::parse_from_rfc3339("2022-04-11T22:26:58Z").ok().map(|t| t.to_utc()));
        assert_eq!(n.window_end, DateTime::parse_from_rfc3339("2022-04-11T22:27:03Z").ok().map(|t| t.to_utc()));
        assert!(n.description.as_deref().is_some_and(|d| d.ends_with("(Scheduled)")));
        let other = parse_events(DOC, Some("WestNO_2")).unwrap();
        assert_eq!(other.len(), 1);
        assert_eq!((other[0].event_type.as_str(), other[0].window_start), ("Reboot", None), "started: no NotBefore");
        assert_eq!(parse_events(DOC, None).unwrap().len(), 2, "without the VM name every event counts");
    }

    #[test]
    fn empty_and_broken_documents() {
        assert!(parse_events(r#"{"DocumentIncarnation": 0, "Events": []}"#, None).unwrap().is_empty());
        assert!(parse_events("[]", None).is_err());
    }
}
