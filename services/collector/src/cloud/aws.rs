//! AWS: scheduled events from the EC2 instance metadata service, version 2.
//!
//! `PUT /latest/api/token` with `X-aws-ec2-metadata-token-ttl-seconds` gives a session token;
//! `GET /latest/meta-data/events/maintenance/scheduled` with `X-aws-ec2-metadata-token` gives a
//! JSON list of events (`Code`, `Description`, `EventId`, `NotBefore`, `NotAfter`, `State`;
//! times like `21 Jan 2019 09:00:43 GMT`). Events in state `active` are in force; `completed`
//! and `canceled` ones stay in the list for a while and are not. On EKS the DaemonSet needs
//! `hostNetwork` or an IMDS hop limit of 2 for the token request to reach it.

use std::time::{Duration, Instant};

use chrono::{DateTime, NaiveDateTime, Utc};
use gpumedic_schemas::health::CloudProvider;
use serde::Deserialize;

use super::{CloudError, Notice, PROBE_TIMEOUT, body};

const NAME: &str = "aws";
/// The token's lifetime: six hours, the documented maximum.
const TOKEN_TTL: Duration = Duration::from_secs(21_600);
/// The token header and the TTL header.
pub const TOKEN_HEADER: &str = "X-aws-ec2-metadata-token";
/// The header that asks for a token of a given lifetime.
pub const TTL_HEADER: &str = "X-aws-ec2-metadata-token-ttl-seconds";
/// The scheduled events path.
pub const EVENTS_PATH: &str = "/latest/meta-data/events/maintenance/scheduled";
/// The token path.
pub const TOKEN_PATH: &str = "/latest/api/token";

/// One scheduled event as IMDS lists it.
#[derive(Debug, Deserialize)]
#[serde(rename_all = "PascalCase")]
struct Event {
    code: String,
    #[serde(default)]
    description: Option<String>,
    event_id: String,
    #[serde(default)]
    not_before: Option<String>,
    #[serde(default)]
    not_after: Option<String>,
    #[serde(default)]
    state: Option<String>,
}

/// Parses the scheduled-events document into the notices in force.
pub fn parse_events(text: &str) -> Result<Vec<Notice>, String> {
    let text = text.trim();
    if text.is_empty() {
        return Ok(Vec::new());
    }
    let raw: Vec<serde_json::Value> = serde_json::from_str(text).map_err(|e| e.to_string())?;
    let mut out = Vec::new();
    for value in raw {
        let e: Event = serde_json::from_value(value.clone()).map_err(|e| e.to_string())?;
        if e.state.as_deref().is_some_and(|s| !s.eq_ignore_ascii_case("active")) {
            continue;
        }
        out.push(Notice {
            provider: CloudProvider::Aws,
            id: e.event_id,
            event_type: e.code,
            window_start: e.not_before.as_deref().and_then(parse_time),
            window_end: e.not_after.as_deref().and_then(parse_time),
            description: e.description.filter(|d| !d.trim().is_empty()),
            raw: Some(value.to_string()),
        });
    }
    Ok(out)
}

/// IMDS times: `21 Jan 2019 09:00:43 GMT`.
fn parse_time(s: &str) -> Option<DateTime<Utc>> {
    let s = s.trim();
    let s = s.strip_suffix("GMT").or_else(|| s.strip_suffix("UTC")).unwrap_or(s).trim();
    NaiveDateTime::parse_from_str(s, "%d %b %Y %H:%M:%S").ok().map(|t| t.and_utc())
}

/// The AWS poller: keeps its session token until shortly before it expires.
#[derive(Debug)]
pub struct Aws {
    client: reqwest::Client,
    base: String,
    token: Option<(String, Instant)>,
}

impl Aws {
    /// A poller for the metadata service at `base`.
    pub fn new(client: reqwest::Client, base: &str) -> Self {
        Self { client, base: base.to_owned(), token: None }
    }

    async fn token(&mut self) -> Result<String, CloudError> {
        if let Some((t, at)) = &self.token
            && at.elapsed() + Duration::from_secs(60) < TOKEN_TTL
        {
            return Ok(t.clone());
        }
        let r = self
            .client
            .put(format!("{}{TOKEN_PATH}", self.base))
            .header(TTL_HEADER, TOKEN_TTL.as_secs().to_string())
            .timeout(Duration::from_secs(5))
            .send()
            .await;
        let token = body(NAME, r).await?.trim().to_owned();
        if token.is_empty() {
            return Err(CloudError::Payload { provider: NAME, message: "an empty session token".into() });
        }
        self.token = Some((token.clone(), Instant::now()));
        Ok(token)
    }

    /// The notices in force.
    pub async fn poll(&mut self) -> Result<Vec<Notice>, CloudError> {
        let token = self.token().await?;
        let r = self
            .client
            .get(format!("{}{EVENTS_PATH}", self.base))
            .header(TOKEN_HEADER, token)
            .timeout(Duration::from_secs(5))
            .send()
            .await;
        match r {
            // No events: IMDS answers 404 for the path.
            Ok(resp) if resp.status() == reqwest::StatusCode::NOT_FOUND => Ok(Vec::new()),
            // The token expired early (the instance was stopped and started): get a new one.
            Ok(resp) if resp.status() == reqwest::StatusCode::UNAUTHORIZED => {
                self.token = None;
                Err(CloudError::Payload { provider: NAME, message: "the session token was refused".into() })
            }
            other => {
                let text = body(NAME, other).await?;
                parse_events(&text).map_err(|message| CloudError::Payload { provider: NAME, message })
            }
        }
    }
}

/// True when an IMDSv2 token endpoint answers at `base`.
pub async fn probe(client: &reqwest::Client, base: &str) -> bool {
    let r = client.put(format!("{base}{TOKEN_PATH}")).header(TTL_HEADER, "60").timeout(PROBE_TIMEOUT).send().await;
    match r {
        Ok(resp) if resp.status().is_success() => resp.text().await.is_ok_and(|t| !t.trim().is_empty()),
        _ => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The example of the EC2 user guide ("View scheduled events").
    const DOC: &str = r#"[
  {
    "NotBefore" : "21 Jan 2019 09:00:43 GMT",
    "Code" : "system-reboot",
    "Description" : "scheduled reboot",
    "EventId" : "instance-event-0d59937288b749b32",
    "NotAfter" : "21 Jan 2019 09:17:23 GMT",
    "State" : "active"
  },
  {
    "NotBefore" : "29 Jan 2019 09:00:43 GMT",
    "Code" : "instance-stop",
    "Description" : "[Canceled] scheduled stop",
    "EventId" : "instance-event-0a1b2c3d4e5f60718",
    "State" : "canceled"
  }
]"#;

    #[test]
    fn documented_payload() {
        let notices = parse_events(DOC).unwrap();
        assert_eq!(notices.len(), 1, "the canceled event is not in force");
        let n = &notices[0];
        assert_eq!((n.id.as_str(), n.event_type.as_str()), ("instance-event-0d59937288b749b32", "system-reboot"));
        assert_eq!(n.window_start, DateTime::parse_from_rfc3339("2019-01-21T09:00:43Z").ok().map(|t| t.to_utc()));
        assert_eq!(n.window_end, DateTime::parse_from_rfc3339("2019-01-21T09:17:23Z").ok().map(|t| t.to_utc()));
        assert_eq!(n.description.as_deref(), Some("scheduled reboot"));
        assert!(n.raw.as_deref().is_some_and(|r| r.contains("instance-event-0d59937288b749b32")));
    }

    #[test]
    fn empty_and_broken_payloads() {
        assert!(parse_events("").unwrap().is_empty());
        assert!(parse_events("[]").unwrap().is_empty());
        assert!(parse_events("<html>").is_err());
        assert!(parse_events(r#"[{"Code": "system-reboot"}]"#).is_err(), "an event without an id");
    }
}
