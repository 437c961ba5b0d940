//! The remediator's status object: a ConfigMap (default `gpumedic-remediator-status`) in the
//! remediator's namespace that holds what must outlive one process and what operators ask for.
//!
//! The remediator writes the breaker's state (`breaker: open|closed`, why and when it tripped,
//! how many quarantines were counted), so a restarted replica or a new leader loads an open
//! breaker instead of silently closing it. Operators write through `gpumedic` (or
//! `kubectl patch`): `paused` (the global pause) and a reset request (`resetRequestedBy`,
//! `resetRequestedAt`), which the leader carries out and clears, recording `lastResetBy` and
//! `lastResetAt`. Every write is a JSON merge patch on its own keys, so the writers never
//! overwrite each other's fields.
//!
//! The keys and patches are pure ([`Status`], [`trip_patch`], ...); [`StatusClient`] is the
//! edge, shared with the CLI.

use std::collections::BTreeMap;

use chrono::{DateTime, SecondsFormat, Utc};
use k8s_openapi::api::core::v1::ConfigMap;
use kube::api::{Api, Patch, PatchParams, PostParams};
use serde::Serialize;
use serde_json::{Value, json};

/// The status object's default name.
pub const STATUS_CONFIGMAP: &str = "gpumedic-remediator-status";

/// The keys of the status object's `data`.
pub mod keys {
    /// `open` or `closed`.
    pub const BREAKER: &str = "breaker";
    /// Why the breaker tripped.
    pub const BREAKER_REASON: &str = "breakerReason";
    /// When it tripped (RFC 3339).
    pub const BREAKER_TRIPPED_AT: &str = "breakerTrippedAt";
    /// The quarantines counted in the window when it tripped.
    pub const QUARANTINES_COUNTED: &str = "quarantinesCounted";
    /// `true` while the global pause is set.
    pub const PAUSED: &str = "paused";
    /// Who set or lifted the pause.
    pub const PAUSED_BY: &str = "pausedBy";
    /// When the pause was set or lifted.
    pub const PAUSED_AT: &str = "pausedAt";
    /// Why the pause was set.
    pub const PAUSE_REASON: &str = "pauseReason";
    /// Who asked for a breaker reset that is not carried out yet.
    pub const RESET_REQUESTED_BY: &str = "resetRequestedBy";
    /// When that reset was asked for.
    pub const RESET_REQUESTED_AT: &str = "resetRequestedAt";
    /// Who asked for the last reset carried out.
    pub const LAST_RESET_BY: &str = "lastResetBy";
    /// When the last reset was carried out.
    pub const LAST_RESET_AT: &str = "lastResetAt";
    /// The quarantines the breaker counts within its window, as JSON `{"<node>": "<RFC 3339>"}`:
    /// the budget every leader shares, so a failover does not hand out a fresh one.
    pub const QUARANTINE_LEDGER: &str = "quarantineLedger";
}

/// The status object as read.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Status {
    /// Whether the breaker is open.
    pub breaker_open: bool,
    /// Why it tripped.
    pub breaker_reason: Option<String>,
    /// When it tripped.
    pub breaker_tripped_at: Option<String>,
    /// Quarantines counted when it tripped.
    pub quarantines_counted: Option<u64>,
    /// Whether the global pause is set.
    pub paused: bool,
    /// Who set or lifted the pause.
    pub paused_by: Option<String>,
    /// When.
    pub paused_at: Option<String>,
    /// Why it was set.
    pub pause_reason: Option<String>,
    /// A reset asked for and not carried out yet: who asked.
    pub reset_requested_by: Option<String>,
    /// When they asked.
    pub reset_requested_at: Option<String>,
    /// The last reset carried out: who asked.
    pub last_reset_by: Option<String>,
    /// When it was carried out.
    pub last_reset_at: Option<String>,
    /// The quarantines counted within the breaker's window: node and when (see
    /// [`keys::QUARANTINE_LEDGER`]); an unreadable ledger reads as empty.
    pub quarantine_ledger: BTreeMap<String, DateTime<Utc>>,
}

impl Status {
    /// Reads the status out of a ConfigMap's `data`; missing or unknown values read as closed and
    /// not paused.
    pub fn from_data(data: &BTreeMap<String, String>) -> Self {
        let text = |k: &str| data.get(k).filter(|v| !v.is_empty()).cloned();
        Self {
            breaker_open: data.get(keys::BREAKER).is_some_and(|v| v == "open"),
            breaker_reason: text(keys::BREAKER_REASON),
            breaker_tripped_at: text(keys::BREAKER_TRIPPED_AT),
            quarantines_counted: data.get(keys::QUARANTINES_COUNTED).and_then(|v| v.parse().ok()),
            paused: data.get(keys::PAUSED).is_some_and(|v| v == "true"),
            paused_by: text(keys::PAUSED_BY),
            paused_at: text(keys::PAUSED_AT),
            pause_reason: text(keys::PAUSE_REASON),
            reset_requested_by: text(keys::RESET_REQUESTED_BY),
            reset_requested_at: text(keys::RESET_REQUESTED_AT),
            last_reset_by: text(keys::LAST_RESET_BY),
            last_reset_at: text(keys::LAST_RESET_AT),
            quarantine_ledger: data
                .get(keys::QUARANTINE_LEDGER)
                .and_then(|v| serde_json::from_str::<BTreeMap<String, String>>(v).ok())
                .map(|m| {
                    m.into_iter()
                        .filter_map(|(node, at)| {
                            DateTime::parse_from_rfc3339(&at).ok().map(|t| (node, t.with_timezone(&Utc)))
                        })
                        .collect()
                })
                .unwrap_or_default(),
        }
    }

    /// Whether a reset waits to be carried out.
    pub fn reset_requested(&self) -> bool {
        self.reset_requested_at.is_some()
    }
}

/// The current time as the status object writes it.
pub fn now() -> String {
    Utc::now().to_rfc3339_opts(SecondsFormat::Secs, true)
}

fn data_patch(data: Value) -> Value {
    json!({ "data": data })
}

/// The breaker tripped (written by the remediator).
pub fn trip_patch(reason: &str, at: &str, counted: usize) -> Value {
    data_patch(json!({
        keys::BREAKER: "open",
        keys::BREAKER_REASON: reason,
        keys::BREAKER_TRIPPED_AT: at,
        keys::QUARANTINES_COUNTED: counted.to_string(),
    }))
}

/// A reset was carried out (written by the remediator): the breaker is closed and the request
/// cleared. The trip's reason and time stay, as history, until the next trip.
pub fn reset_done_patch(by: &str, at: &str) -> Value {
    data_patch(json!({
        keys::BREAKER: "closed",
        keys::LAST_RESET_BY: by,
        keys::LAST_RESET_AT: at,
        keys::RESET_REQUESTED_BY: Value::Null,
        keys::RESET_REQUESTED_AT: Value::Null,
        keys::QUARANTINE_LEDGER: Value::Null,
    }))
}

/// The quarantines the breaker counts within its window (written by the leader after each
/// remediation that changed them).
pub fn ledger_patch(ledger: &BTreeMap<String, DateTime<Utc>>) -> Value {
    let text: BTreeMap<&str, String> =
        ledger.iter().map(|(n, at)| (n.as_str(), at.to_rfc3339_opts(SecondsFormat::Secs, true))).collect();
    data_patch(json!({ keys::QUARANTINE_LEDGER: serde_json::to_string(&text).unwrap_or_default() }))
}

/// An operator asks for a breaker reset (written by `gpumedic breaker reset`).
pub fn reset_request_patch(by: &str, at: &str) -> Value {
    data_patch(json!({ keys::RESET_REQUESTED_BY: by, keys::RESET_REQUESTED_AT: at }))
}

/// An operator sets (`paused`) or lifts the global pause (written by `gpumedic pause|resume`).
pub fn pause_patch(paused: bool, by: &str, reason: Option<&str>, at: &str) -> Value {
    data_patch(json!({
        keys::PAUSED: if paused { "true" } else { "false" },
        keys::PAUSED_BY: by,
        keys::PAUSED_AT: at,
        keys::PAUSE_REASON: if paused { reason.map(Value::from).unwrap_or(Value::Null) } else { Value::Null },
    }))
}

/// What went wrong reading or writing the status object.
#[derive(Debug, thiserror::Error)]
#[error("cannot {what} the status object {namespace}/{name}: {source}")]
pub struct StatusError {
    /// The operation.
    pub what: &'static str,
    /// The namespace.
    pub namespace: String,
    /// The ConfigMap's name.
    pub name: String,
    /// The API error.
    #[source]
    pub source: kube::Error,
}

/// Reads and patches the status object.
#[derive(Clone)]
pub struct StatusClient {
    api: Api<ConfigMap>,
    namespace: String,
    name: String,
}

impl StatusClient {
    /// The status object `name` in `namespace`.
    pub fn new(client: kube::Client, namespace: &str, name: &str) -> Self {
        Self { api: Api::namespaced(client, namespace), namespace: namespace.to_owned(), name: name.to_owned() }
    }

    fn error(&self, what: &'static str, source: kube::Error) -> StatusError {
        StatusError { what, namespace: self.namespace.clone(), name: self.name.clone(), source }
    }

    /// The ConfigMap's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The status; a missing object reads as the default (closed, not paused).
    pub async fn read(&self) -> Result<Status, StatusError> {
        let cm = self.api.get_opt(&self.name).await.map_err(|e| self.error("read", e))?;
        Ok(cm.and_then(|c| c.data).map(|d| Status::from_data(&d)).unwrap_or_default())
    }

    /// Applies a merge patch from [`trip_patch`] and friends, creating the object when missing.
    pub async fn patch(&self, patch: &Value) -> Result<(), StatusError> {
        match self.api.patch(&self.name, &PatchParams::default(), &Patch::Merge(patch)).await {
            Ok(_) => return Ok(()),
            Err(kube::Error::Api(s)) if s.code == 404 => {}
            Err(e) => return Err(self.error("patch", e)),
        }
        let cm: ConfigMap = serde_json::from_value(json!({
            "metadata": {
                "name": self.name,
                "namespace": self.namespace,
                "labels": { "app.kubernetes.io/name": "gpumedic", "app.kubernetes.io/component": "remediator" },
            },
            "data": { keys::BREAKER: "closed", keys::PAUSED: "false" },
        }))
        .expect("the ConfigMap is well formed");
        match self.api.create(&PostParams::default(), &cm).await {
            // Another writer created it first: patch theirs.
            Ok(_) => {}
            Err(kube::Error::Api(s)) if s.is_already_exists() => {}
            Err(e) => return Err(self.error("create", e)),
        }
        self.api
            .patch(&self.name, &PatchParams::default(), &Patch::Merge(patch))
            .await
            .map_err(|e| self.error("patch", e))?;
        Ok(())
    }
}

/// Records an Event about the status object (breaker trips and resets), so
/// `kubectl describe configmap` and `kubectl get events` tell the breaker's story.
pub async fn record_event(
    client: &kube::Client,
    namespace: &str,
    name: &str,
    component: &str,
    reason: &str,
    message: &str,
    warning: bool,
) -> Result<(), kube::Error> {
    let at = now();
    let event: k8s_openapi::api::core::v1::Event = serde_json::from_value(json!({
        "metadata": { "generateName": format!("{name}.gpumedic."), "namespace": namespace },
        "involvedObject": { "apiVersion": "v1", "kind": "ConfigMap", "name": name, "namespace": namespace },
        "reason": reason,
        "message": message,
        "type": if warning { "Warning" } else { "Normal" },
        "source": { "component": component },
        "reportingComponent": component,
        "reportingInstance": std::env::var("HOSTNAME").unwrap_or_else(|_| component.to_owned()),
        "action": reason,
        "firstTimestamp": at,
        "lastTimestamp": at,
        "count": 1,
    }))
    .expect("the Event is well formed");
    Api::<k8s_openapi::api::core::v1::Event>::namespaced(client.clone(), namespace)
        .create(&PostParams::default(), &event)
        .await?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn apply(data: &mut BTreeMap<String, String>, patch: &Value) {
        for (k, v) in patch["data"].as_object().unwrap() {
            match v.as_str() {
                Some(s) => data.insert(k.clone(), s.to_owned()),
                None => data.remove(k),
            };
        }
    }

    #[test]
    fn a_trip_a_reset_request_and_its_completion_round_trip() {
        let mut data = BTreeMap::new();
        assert_eq!(Status::from_data(&data), Status::default());
        apply(&mut data, &trip_patch("4 of 10", "2026-01-01T00:00:00Z", 3));
        let s = Status::from_data(&data);
        assert!(s.breaker_open && !s.reset_requested());
        assert_eq!((s.breaker_reason.as_deref(), s.quarantines_counted), (Some("4 of 10"), Some(3)));
        apply(&mut data, &reset_request_patch("alice", "2026-01-01T01:00:00Z"));
        assert!(Status::from_data(&data).reset_requested());
        apply(&mut data, &reset_done_patch("alice", "2026-01-01T01:00:02Z"));
        let s = Status::from_data(&data);
        assert!(!s.breaker_open && !s.reset_requested());
        assert_eq!(s.last_reset_by.as_deref(), Some("alice"));
        assert_eq!(s.breaker_reason.as_deref(), Some("4 of 10"), "the last trip stays as history");
    }

    #[test]
    fn pause_and_resume() {
        let mut data = BTreeMap::new();
        apply(&mut data, &pause_patch(true, "bob", Some("driver rollout"), "t"));
        let s = Status::from_data(&data);
        assert!(s.paused);
        assert_eq!(s.pause_reason.as_deref(), Some("driver rollout"));
        apply(&mut data, &pause_patch(false, "bob", None, "t2"));
        let s = Status::from_data(&data);
        assert!(!s.paused && s.pause_reason.is_none());
    }
}
