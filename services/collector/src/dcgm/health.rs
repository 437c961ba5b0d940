//! DCGM health watches: the JSON of `dcgmi health -c -j`, and the events its incidents call for.
//!
//! DCGM watches the systems of each GPU in the background (PCIe, NVLink, memory, SM, InfoROM,
//! thermal, power, driver; NVSwitches and ConnectX NICs too on recent versions) once watches are
//! set (`dcgmi health -s a`), and `dcgmi health -c -j` reports what it found. dcgmi writes its
//! JSON through its generic output tree: every node has an optional `value`, optional `overflow`
//! lines (a long message is wrapped into lines of at most 54 characters) and `children`:
//!
//! ```json
//! {"header": ["Health Monitor Report"],
//!  "body": {"Overall Health": {"value": "Warning"},
//!           "GPU": {"children": {"0": {"value": "Warning", "children": {"Errors": {"children":
//!               {"PCIe system": {"value": "Warning", "overflow": ["Detected more than 8 PCIe",
//!                                                                "replays per minute for GPU 0: 13"]}}}}}}}}}
//! ```
//!
//! The entity groups are DCGM's names (`GPU`, `Switch`, `ConnectX`, ...), the systems its
//! `HelperSystemToString` names (`PCIe system`, `Memory system`, ...), the results `Healthy`,
//! `Warning` and `Failure`. Several incidents of one system on one entity are one line, their
//! messages joined with `, `. The JSON carries no DCGM error code.

use std::collections::BTreeMap;

use chrono::{DateTime, Utc};
use gpumedic_schemas::HealthEvent;
use gpumedic_schemas::health::{Component, DcgmDetail, DcgmResult, Detail, Entity, Source};
use serde_json::Value;

use super::source::GpuDirectory;

/// One system of one entity that DCGM reports as not healthy.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HealthIncident {
    /// DCGM's entity group (`GPU`, `Switch`, `ConnectX`, ...).
    pub entity_group: String,
    /// The entity's DCGM id (a GPU's DCGM index).
    pub entity_id: u32,
    /// The system, in snake case without ` system` (`pcie`, `nvlink`, `memory`, `sm`, `inforom`,
    /// `thermal`, `power`, `driver`, ...).
    pub system: String,
    /// `Warn` or `Fail`.
    pub result: DcgmResult,
    /// DCGM's message, its wrapped lines joined again.
    pub message: String,
}

/// A parsed `dcgmi health -c -j` report.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HealthReport {
    /// `Healthy`, `Warning` or `Failure`.
    pub overall: String,
    /// Every incident, by entity then system.
    pub incidents: Vec<HealthIncident>,
}

/// Why a health check's output is not a report.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum HealthError {
    /// Not JSON (dcgmi prints errors as text, e.g. `Error: Health watches not enabled.`).
    #[error("not a JSON health report: {0}")]
    NotJson(String),
    /// JSON, but not the health report's shape.
    #[error("not a DCGM health report: {0}")]
    Shape(String),
}

fn result_of(value: &str) -> Option<DcgmResult> {
    match value.trim() {
        "Healthy" => Some(DcgmResult::Pass),
        "Warning" => Some(DcgmResult::Warn),
        "Failure" => Some(DcgmResult::Fail),
        _ => None,
    }
}

/// `PCIe system` → `pcie`, `NVLINK system` → `nvlink`, `Driver` → `driver`.
fn system_slug(name: &str) -> String {
    let name = name.trim();
    let name = name.strip_suffix(" system").unwrap_or(name);
    let mut out = String::new();
    for c in name.chars() {
        if c.is_ascii_alphanumeric() {
            out.push(c.to_ascii_lowercase());
        } else if !out.ends_with('_') && !out.is_empty() {
            out.push('_');
        }
    }
    out.trim_end_matches('_').to_owned()
}

fn children(node: &Value) -> impl Iterator<Item = (&String, &Value)> {
    node.get("children").and_then(Value::as_object).into_iter().flat_map(|m| m.iter())
}

/// Parses the JSON of `dcgmi health -c -j`.
///
/// # Errors
/// [`HealthError`] when the text is not JSON or not a health report.
pub fn parse_health(text: &str) -> Result<HealthReport, HealthError> {
    let start = text.find('{').ok_or_else(|| HealthError::NotJson(text.trim().chars().take(200).collect()))?;
    let doc: Value = serde_json::from_str(&text[start..]).map_err(|e| HealthError::NotJson(format!("{e}")))?;
    let body = doc.get("body").and_then(Value::as_object).ok_or_else(|| HealthError::Shape("no `body`".into()))?;
    let overall = body
        .get("Overall Health")
        .and_then(|o| o.get("value"))
        .and_then(Value::as_str)
        .ok_or_else(|| HealthError::Shape("no `Overall Health`".into()))?
        .to_owned();
    let mut incidents = Vec::new();
    for (group, node) in body.iter().filter(|(k, _)| k.as_str() != "Overall Health") {
        for (id, entity) in children(node) {
            let Ok(entity_id) = id.trim().parse::<u32>() else { continue };
            let Some((_, errors)) = children(entity).find(|(k, _)| k.as_str() == "Errors") else { continue };
            for (system, detail) in children(errors) {
                let Some(result) = detail.get("value").and_then(Value::as_str).and_then(result_of) else { continue };
                if result == DcgmResult::Pass {
                    continue;
                }
                let message = detail
                    .get("overflow")
                    .and_then(Value::as_array)
                    .map(|lines| lines.iter().filter_map(Value::as_str).map(str::trim).collect::<Vec<_>>().join(" "))
                    .unwrap_or_default();
                incidents.push(HealthIncident {
                    entity_group: group.clone(),
                    entity_id,
                    system: system_slug(system),
                    result,
                    message,
                });
            }
        }
    }
    Ok(HealthReport { overall, incidents })
}

/// The key of an incident: entity group, entity id, system.
type Key = (String, u32, String);

/// Turns successive health reports into events: one per incident that appears or changes, one
/// healthy event per incident that goes away, and at the first report a healthy `health` event
/// for every GPU the [`GpuDirectory`] knows without an incident (the clear evidence for an
/// incident opened before a restart).
#[derive(Debug)]
pub struct HealthWatch {
    node: String,
    last: Option<BTreeMap<Key, (DcgmResult, String)>>,
}

impl HealthWatch {
    /// A watch for `node` with no report seen yet.
    pub fn new(node: impl Into<String>) -> Self {
        Self { node: node.into(), last: None }
    }

    fn event(&self, key: &Key, directory: &GpuDirectory, detail: DcgmDetail, now: DateTime<Utc>) -> HealthEvent {
        let (group, id, _) = key;
        let (component, entity) = match group.as_str() {
            "GPU" => (Component::Gpu, directory.entity(*id)),
            "Switch" | "NvSwitch" => {
                (Component::Nvswitch, Entity { nvswitch_id: Some(id.to_string()), ..Default::default() })
            }
            _ => (Component::Node, Entity::default()),
        };
        let healthy = detail.result == DcgmResult::Pass;
        let mut e = HealthEvent::new(&self.node, Source::Dcgm, component, entity, Detail::Dcgm(detail));
        e.observed_at = now;
        e.healthy = healthy;
        e
    }

    /// The events `report`, read at `now`, calls for.
    pub fn observe(&mut self, report: &HealthReport, directory: &GpuDirectory, now: DateTime<Utc>) -> Vec<HealthEvent> {
        let current: BTreeMap<Key, (DcgmResult, String)> = report
            .incidents
            .iter()
            .map(|i| ((i.entity_group.clone(), i.entity_id, i.system.clone()), (i.result, i.message.clone())))
            .collect();
        let mut out = Vec::new();
        let first = self.last.is_none();
        let last = self.last.take().unwrap_or_default();
        for (key, (result, message)) in &current {
            if last.get(key) == Some(&(*result, message.clone())) {
                continue;
            }
            let detail = DcgmDetail {
                check: format!("health:{}", key.2),
                result: *result,
                error_code: None,
                message: Some(if key.0 == "GPU" { message.clone() } else { format!("{} {}: {message}", key.0, key.1) }),
            };
            out.push(self.event(key, directory, detail, now));
        }
        for key in last.keys().filter(|k| !current.contains_key(*k)) {
            let detail = DcgmDetail {
                check: format!("health:{}", key.2),
                result: DcgmResult::Pass,
                error_code: None,
                message: Some("DCGM no longer reports this system".into()),
            };
            out.push(self.event(key, directory, detail, now));
        }
        if first {
            for index in directory.indexes() {
                if current.keys().any(|(g, id, _)| g == "GPU" && *id == index) {
                    continue;
                }
                let key = ("GPU".to_owned(), index, String::new());
                let detail = DcgmDetail {
                    check: "health".into(),
                    result: DcgmResult::Pass,
                    error_code: None,
                    message: Some("DCGM's health watches report no incident".into()),
                };
                out.push(self.event(&key, directory, detail, now));
            }
        }
        self.last = Some(current);
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const WARN: &str = include_str!("../../tests/fixtures/dcgm/health-check-warn.json");
    const HEALTHY: &str = include_str!("../../tests/fixtures/dcgm/health-check-healthy.json");

    fn at(s: i64) -> DateTime<Utc> {
        DateTime::from_timestamp(1_800_000_000 + s, 0).unwrap()
    }

    fn dcgm(e: &HealthEvent) -> &DcgmDetail {
        match &e.detail {
            Detail::Dcgm(d) => d,
            other => panic!("dcgm expected, got {other:?}"),
        }
    }

    #[test]
    fn the_report_is_read_per_entity_and_system_with_wrapped_messages_joined() {
        let r = parse_health(WARN).unwrap();
        assert_eq!(r.overall, "Failure");
        assert_eq!(r.incidents.len(), 3, "{r:#?}");
        let pcie = r.incidents.iter().find(|i| i.system == "pcie").unwrap();
        assert_eq!((pcie.entity_group.as_str(), pcie.entity_id, pcie.result), ("GPU", 0, DcgmResult::Warn));
        assert_eq!(pcie.message, "Detected more than 8 PCIe replays per minute for GPU 0 : 13");
        let mem = r.incidents.iter().find(|i| i.system == "memory").unwrap();
        assert_eq!((mem.entity_id, mem.result), (1, DcgmResult::Fail));
        assert_eq!(mem.message, "Detected 2 volatile double-bit ECC error(s) in GPU 1.");
        let cx = r.incidents.iter().find(|i| i.entity_group == "ConnectX").unwrap();
        assert_eq!(cx.system, "connectx");
        assert_eq!(parse_health(HEALTHY).unwrap(), HealthReport { overall: "Healthy".into(), incidents: vec![] });
    }

    #[test]
    fn text_errors_and_foreign_json_are_typed_errors() {
        assert!(matches!(
            parse_health("Error: Health watches not enabled. Please enable watches. \n"),
            Err(HealthError::NotJson(_))
        ));
        assert!(matches!(parse_health(r#"{"body": {"GPU": {}}}"#), Err(HealthError::Shape(_))));
        assert!(matches!(parse_health("{ not json"), Err(HealthError::NotJson(_))));
    }

    #[test]
    fn one_event_per_incident_on_change_and_a_healthy_one_when_it_goes() {
        let directory = GpuDirectory::default();
        let mut w = HealthWatch::new("n1");
        let first = w.observe(&parse_health(WARN).unwrap(), &directory, at(0));
        assert_eq!(first.len(), 3);
        let pcie = first.iter().find(|e| dcgm(e).check == "health:pcie").unwrap();
        assert_eq!((pcie.source, pcie.component, pcie.healthy), (Source::Dcgm, Component::Gpu, false));
        assert_eq!(pcie.entity.gpu_index, Some(0));
        assert_eq!(dcgm(pcie).result, DcgmResult::Warn);
        let cx = first.iter().find(|e| dcgm(e).check == "health:connectx").unwrap();
        assert_eq!((cx.component, cx.entity.gpu_index), (Component::Node, None), "a NIC is not a GPU");
        assert!(dcgm(cx).message.as_deref().unwrap().starts_with("ConnectX 0: "));
        assert!(w.observe(&parse_health(WARN).unwrap(), &directory, at(60)).is_empty(), "unchanged: nothing");
        let cleared = w.observe(&parse_health(HEALTHY).unwrap(), &directory, at(120));
        assert_eq!(cleared.len(), 3);
        assert!(cleared.iter().all(|e| e.healthy && dcgm(e).result == DcgmResult::Pass));
        assert!(cleared.iter().any(|e| dcgm(e).check == "health:memory" && e.entity.gpu_index == Some(1)));
    }
}
