//! Oracle Cloud Infrastructure (OCI): the maintenance reboot from the instance metadata service,
//! version 2.
//!
//! `GET /opc/v2/instance/` with `Authorization: Bearer Oracle` (the header IMDS v2 requires; v1
//! without it is being retired) answers the instance document, the same `Instance` resource the
//! Compute API describes. Its `timeMaintenanceRebootDue` (RFC 3339) is set while an
//! infrastructure maintenance reboot is scheduled: the time the instance is expected to be
//! stopped and started; if it has not been rebooted by then, Oracle reboots it within 24 hours of
//! that time. It is empty (or absent) when no maintenance is due, and cleared once the instance
//! stops. One notice (id [`NOTICE_ID`], type [`EVENT_TYPE`]) stands for it; a new due time is a
//! changed window.
//!
//! The schema's `CloudProvider` has no OCI symbol yet, so OCI notices carry [`OCI`]
//! (`CloudProvider::Other`) and say "Oracle Cloud" in their description.

use std::time::Duration;

use chrono::{DateTime, Utc};
use gpumedic_schemas::health::CloudProvider;
use serde::Deserialize;

use super::{CloudError, Notice, PROBE_TIMEOUT, body};

const NAME: &str = "oci";
/// How OCI is named in events: the schema's enum has no OCI symbol yet.
pub const OCI: CloudProvider = CloudProvider::Other;
/// The instance document.
pub const INSTANCE_PATH: &str = "/opc/v2/instance/";
/// The header IMDS v2 requires, and its value.
pub const AUTH_HEADER: (&str, &str) = ("Authorization", "Bearer Oracle");
/// The dedupe key of the maintenance reboot notice (there is at most one at a time).
pub const NOTICE_ID: &str = "maintenance-reboot";
/// The event type of the maintenance reboot notice.
pub const EVENT_TYPE: &str = "maintenance-reboot";
/// How long after the due time Oracle may reboot the instance itself.
pub const REBOOT_WITHIN: chrono::TimeDelta = chrono::TimeDelta::hours(24);

#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
struct Instance {
    #[serde(default)]
    id: Option<String>,
    #[serde(default)]
    time_maintenance_reboot_due: Option<String>,
}

/// Parses the instance document into the notices in force: one when a maintenance reboot is
/// due, none otherwise.
pub fn parse_instance(text: &str) -> Result<Vec<Notice>, String> {
    let instance: Instance = serde_json::from_str(text.trim()).map_err(|e| e.to_string())?;
    let Some(due) = instance.time_maintenance_reboot_due.filter(|d| !d.trim().is_empty()) else {
        return Ok(Vec::new());
    };
    let start = DateTime::parse_from_rfc3339(due.trim())
        .map_err(|e| format!("timeMaintenanceRebootDue '{due}' is not an RFC 3339 time: {e}"))?
        .with_timezone(&Utc);
    let raw = serde_json::json!({ "id": instance.id, "timeMaintenanceRebootDue": due }).to_string();
    Ok(vec![Notice {
        provider: OCI,
        id: NOTICE_ID.to_owned(),
        event_type: EVENT_TYPE.to_owned(),
        window_start: Some(start),
        window_end: Some(start + REBOOT_WITHIN),
        description: Some(
            "Oracle Cloud (OCI) infrastructure maintenance reboot due; Oracle reboots the instance within 24 hours of the due time"
                .to_owned(),
        ),
        raw: Some(raw),
    }])
}

/// The OCI poller.
#[derive(Debug)]
pub struct Oci {
    client: reqwest::Client,
    base: String,
}

impl Oci {
    /// A poller for the metadata service at `base`.
    pub fn new(client: reqwest::Client, base: &str) -> Self {
        Self { client, base: base.to_owned() }
    }

    /// The notices in force.
    pub async fn poll(&mut self) -> Result<Vec<Notice>, CloudError> {
        let r = self
            .client
            .get(format!("{}{INSTANCE_PATH}", self.base))
            .header(AUTH_HEADER.0, AUTH_HEADER.1)
            .timeout(Duration::from_secs(5))
            .send()
            .await;
        let text = body(NAME, r).await?;
        parse_instance(&text).map_err(|message| CloudError::Payload { provider: NAME, message })
    }
}

/// True when an OCI instance document answers at `base` (its id is an instance OCID).
pub async fn probe(client: &reqwest::Client, base: &str) -> bool {
    let r = client
        .get(format!("{base}{INSTANCE_PATH}"))
        .header(AUTH_HEADER.0, AUTH_HEADER.1)
        .timeout(PROBE_TIMEOUT)
        .send()
        .await;
    match r {
        Ok(resp) if resp.status().is_success() => {
            resp.json::<Instance>().await.is_ok_and(|i| i.id.is_some_and(|id| id.starts_with("ocid1.instance.")))
        }
        _ => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An instance document as IMDS v2 serves it (the fields of the Compute API's `Instance`;
    /// values from its examples), with a maintenance reboot due.
    pub(crate) const DOC: &str = r#"{
  "availabilityDomain": "EMIr:PHX-AD-1",
  "faultDomain": "FAULT-DOMAIN-2",
  "compartmentId": "ocid1.tenancy.oc1..exampleuniqueID",
  "displayName": "gpu-node-3",
  "hostname": "gpu-node-3",
  "id": "ocid1.instance.oc1.phx.exampleuniqueID",
  "image": "ocid1.image.oc1.phx.exampleuniqueID",
  "metadata": {"ssh_authorized_keys": "ssh-rsa AAAA... example"},
  "region": "phx",
  "canonicalRegionName": "us-phoenix-1",
  "ociAdName": "phx-ad-1",
  "shape": "BM.GPU.H100.8",
  "state": "Running",
  "timeCreated": 1600381928581,
  "timeMaintenanceRebootDue": "2030-05-25T21:10:29.600Z"
}"#;

    #[test]
    fn documented_payload() {
        let notices = parse_instance(DOC).unwrap();
        assert_eq!(notices.len(), 1);
        let n = &notices[0];
        assert_eq!((n.provider, n.id.as_str(), n.event_type.as_str()), (OCI, NOTICE_ID, EVENT_TYPE));
        let due = DateTime::parse_from_rfc3339("2030-05-25T21:10:29.600Z").unwrap().to_utc();
        assert_eq!(n.window_start, Some(due));
        assert_eq!(n.window_end, Some(due + REBOOT_WITHIN), "Oracle reboots within 24 hours of the due time");
        assert!(n.description.as_deref().is_some_and(|d| d.contains("Oracle Cloud")));
        assert!(n.raw.as_deref().is_some_and(|r| r.contains("ocid1.instance.oc1.phx.exampleuniqueID")));
    }

    #[test]
    fn nothing_due_and_broken_payloads() {
        let none = DOC
            .replace(r#""timeMaintenanceRebootDue": "2030-05-25T21:10:29.600Z""#, r#""timeMaintenanceRebootDue": """#);
        assert!(parse_instance(&none).unwrap().is_empty(), "an empty due time: nothing scheduled");
        assert!(parse_instance(r#"{"id": "ocid1.instance.oc1.phx.x"}"#).unwrap().is_empty(), "absent");
        assert!(parse_instance("<html>").is_err());
        assert!(parse_instance(r#"{"timeMaintenanceRebootDue": "next tuesday"}"#).is_err());
    }
}
