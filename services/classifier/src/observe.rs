//! From the enriched event on the wire to the engine's [`Observation`], and from the engine's
//! [`Decision`] to the public [`Verdict`]. Pure mappings, tested without servers.

use chrono::{DateTime, Utc};
use gpumedic_schemas::EnrichedHealthEvent;
use gpumedic_schemas::health::{DcgmResult, Detail, MonitorState, Source, XidRecoveryAction};
use gpumedic_schemas::verdict::{RecommendedAction, Severity as WireSeverity, Verdict};

use crate::rules::engine::Decision;
use crate::rules::{Action, Observation, Severity};

/// The engine's view of an enriched event. Field names are the ones the rule files document.
pub fn observation(e: &EnrichedHealthEvent) -> Observation {
    let ev = &e.event;
    let kind = match &ev.detail {
        Detail::Dcgm(d) if d.check.starts_with("diag") => "dcgm_diag".to_owned(),
        Detail::Dcgm(_) => "dcgm_health".to_owned(),
        _ => wire_name(&ev.kind),
    };
    let mut o = Observation::new(ev.event_id.to_string(), &ev.node, ev.observed_at.timestamp_micros(), &kind);
    o.source = wire_name(&ev.source);
    o.component = wire_name(&ev.component);
    o.gpu = ev.entity.gpu_uuid.clone().or_else(|| ev.entity.pci_bus_id.clone());
    o.healthy = ev.healthy;
    o.synthetic = ev.synthetic || ev.source == Source::Synthetic;
    match &ev.detail {
        Detail::Xid(x) => {
            if let Ok(code) = u32::try_from(x.code) {
                o = o.xid(code);
            }
            if let Some(action) = x.recovery_action {
                o = o.field("recovery_action", recovery_action(action));
            }
        }
        Detail::Sxid(s) => {
            if let Ok(code) = u32::try_from(s.code) {
                o = o.xid(code);
            }
            if let Some(fatal) = s.fatal {
                o = o.field("severity", if fatal { "fatal" } else { "non_fatal" });
            }
        }
        Detail::Ecc(d) => {
            for (name, v) in [
                ("single_bit_volatile", d.single_bit_volatile),
                ("double_bit_volatile", d.double_bit_volatile),
                ("single_bit_aggregate", d.single_bit_aggregate),
                ("double_bit_aggregate", d.double_bit_aggregate),
            ] {
                if let Some(v) = v {
                    o = o.field(name, v);
                }
            }
        }
        Detail::RetiredPages(d) => {
            o = o.field("total", d.single_bit + d.double_bit).field("pending", d.pending);
        }
        Detail::RowRemap(d) => {
            o = o
                .field("failure", d.failure)
                .field("pending", d.pending)
                .field("correctable", d.correctable)
                .field("uncorrectable", d.uncorrectable);
        }
        Detail::Temperature(t) => {
            o = o.field("value", i64::from(t.celsius));
            if let Some(s) = t.slowdown_celsius {
                o = o.field("slowdown_threshold", i64::from(s));
            }
            if let Some(s) = t.shutdown_celsius {
                o = o.field("shutdown_threshold", i64::from(s));
            }
        }
        Detail::Power(p) => {
            o = o.field("value", p.watts);
            if let Some(l) = p.limit_watts {
                o = o.field("limit", l);
            }
        }
        Detail::Throttle(t) => {
            if let Some(r) = t.reasons.first() {
                o = o.field("reason", r.as_str());
            }
        }
        Detail::Nvlink(n) => {
            if let Some(active) = n.active {
                o = o.field("link_state", if active { "up" } else { "down" });
            }
            let crc = n.crc_flit_errors.unwrap_or(0) + n.crc_data_errors.unwrap_or(0);
            o = o.field("crc_errors", crc).field("recovery_errors", n.recovery_errors.unwrap_or(0));
        }
        Detail::PcieReplay(p) => o = o.field("value", p.count),
        Detail::PcieAer(a) => o = o.field("severity", wire_name(&a.severity)),
        Detail::CloudMaintenance(c) => {
            o = o.field("event", c.event_type.as_str());
            if let Some(start) = c.window_start {
                o = o.field("starts_at_micros", start.timestamp_micros());
            }
        }
        Detail::MonitorHealth(m) => {
            o = o.field("monitor", m.monitor.as_str());
            if m.state != MonitorState::Ok && !ev.healthy {
                o = o.field("state", wire_name(&m.state));
            }
        }
        Detail::Dcgm(d) => {
            o = o.field("check", d.check.as_str()).field("result", wire_name(&d.result));
            if d.result == DcgmResult::Pass {
                o.healthy = true;
            }
        }
        Detail::Custom(c) => {
            for (k, v) in &c.values {
                o = o.field(k, v.as_str());
            }
        }
        Detail::GpuLost(_) | Detail::Mce(_) | Detail::Absent => {}
    }
    o
}

/// The snake-case wire symbol of a schema enum (its serde name).
fn wire_name<T: serde::Serialize>(v: &T) -> String {
    serde_json::to_value(v).ok().and_then(|j| j.as_str().map(str::to_owned)).unwrap_or_default()
}

fn recovery_action(a: XidRecoveryAction) -> &'static str {
    match a {
        XidRecoveryAction::None => "none",
        XidRecoveryAction::GpuReset => "gpu_reset_required",
        XidRecoveryAction::NodeReboot => "node_reboot_required",
        XidRecoveryAction::DrainP2p => "drain_p2p",
        XidRecoveryAction::DrainAndReset => "drain_and_reset",
        XidRecoveryAction::Unknown => "unknown",
    }
}

/// The public verdict for a decision. It is issued at the decision's own time (the event time
/// that decided it), so a replay produces the same record, and a consumer can tell a verdict
/// about an old fault from a fresh one.
pub fn verdict(d: &Decision) -> Verdict {
    let issued_at = DateTime::<Utc>::from_timestamp_micros(d.decided_at_micros).unwrap_or_default();
    let mut entity = gpumedic_schemas::health::Entity::default();
    if let Some(gpu) = &d.gpu {
        if gpu.starts_with("GPU-") || gpu.starts_with("MIG-") {
            entity.gpu_uuid = Some(gpu.clone());
        } else {
            entity.pci_bus_id = Some(gpu.clone());
        }
    }
    let mut reason = d.reason.clone();
    if !d.then.is_empty() {
        let then: Vec<&str> = d.then.iter().map(|a| a.as_str()).collect();
        reason.push_str(&format!(" (then: {})", then.join(", ")));
    }
    Verdict {
        verdict_id: d.verdict_id,
        incident_id: d.incident_id,
        node: d.node.clone(),
        entity,
        severity: match d.severity {
            Severity::Info => WireSeverity::Info,
            Severity::Warning => WireSeverity::Warning,
            Severity::Critical => WireSeverity::Critical,
        },
        rule_id: d.rule_id.clone(),
        rule_version: i32::try_from(d.rule_version).unwrap_or(i32::MAX),
        action: match d.action {
            Action::None => RecommendedAction::None,
            Action::Monitor => RecommendedAction::Monitor,
            Action::Custom => RecommendedAction::Custom,
            Action::Cordon => RecommendedAction::Cordon,
            Action::Drain => RecommendedAction::Drain,
            Action::ResetGpu => RecommendedAction::ResetGpu,
            Action::RebootNode => RecommendedAction::RebootNode,
            Action::ContactSupport => RecommendedAction::ContactSupport,
            Action::ReplaceNode => RecommendedAction::ReplaceNode,
        },
        custom_action: d.custom.clone(),
        reason,
        evidence: d.evidence.iter().filter_map(|e| e.parse().ok()).collect(),
        issued_at,
        recovery: d.recovery,
    }
}
