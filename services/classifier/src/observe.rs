//! From the enriched event on the wire to the engine's [`Observation`], and from the engine's
//! [`Decision`] to the public [`Verdict`]. Pure mappings, tested without servers.

use std::collections::BTreeSet;

use chrono::{DateTime, Utc};
use gpumedic_schemas::EnrichedHealthEvent;
use gpumedic_schemas::enriched::Workload;
use gpumedic_schemas::health::{DcgmResult, Detail, MonitorState, Source, XidRecoveryAction};
use gpumedic_schemas::verdict::{RecommendedAction, Severity as WireSeverity, Verdict};

use crate::rules::engine::Decision;
use crate::rules::{Action, Observation, Severity};

/// The time an event may say it happened, given the Kafka timestamp of the record that carried it
/// (`record_ms`, milliseconds since the epoch): `Some(record time)` when `observed_at` is more than
/// `allowance` after it, else `None` (keep `observed_at`).
///
/// The payload's times come from the node's clock, which may be wrong; the record's timestamp comes
/// from the pipeline's producer (or the broker). An event cannot have happened after the record
/// that reports it was written, so one far-future stamp is bounded here, before it can move the
/// node's engine clock (which only moves forward) for good. Events stamped in the past are kept as
/// they are: a spool that held events through a broker outage delivers them late, and their own
/// time is the true one (the engine counts a late observation at the node's current time anyway).
pub fn bounded_observed_at(
    observed_at: DateTime<Utc>,
    record_ms: Option<i64>,
    allowance: std::time::Duration,
) -> Option<DateTime<Utc>> {
    let record = DateTime::from_timestamp_millis(record_ms?)?;
    let allowance = chrono::Duration::from_std(allowance).ok()?;
    (observed_at > record.checked_add_signed(allowance)?).then_some(record)
}

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
    // The enricher's resolved identity first: the same GPU reported by index, PCI id or UUID must
    // land in one incident. Without it, the reference as reported, as before version 2.
    let identity = e.gpu.as_ref();
    o.gpu = identity
        .and_then(|g| g.uuid.clone())
        .or_else(|| ev.entity.gpu_uuid.clone())
        .or_else(|| ev.entity.pci_bus_id.clone());
    o.gpu_index = identity.and_then(|g| g.index).or(ev.entity.gpu_index);
    o.gpu_pci = identity.and_then(|g| g.pci_bus_id.clone()).or_else(|| ev.entity.pci_bus_id.clone());
    o.nvlink_domain = identity.and_then(|g| g.nvlink_domain.clone()).filter(|d| !d.is_empty());
    o.boot_id = ev.boot_id.clone();
    o.received_at_micros = Some(ev.published_at.timestamp_micros());
    o.workloads = workloads(&e.workloads);
    o.healthy = ev.healthy;
    o.synthetic = ev.synthetic || ev.source == Source::Synthetic;
    o.start_snapshot = ev.is_start_snapshot();
    match &ev.detail {
        Detail::Xid(x) => {
            if let Ok(code) = u32::try_from(x.code) {
                o = o.xid(code);
            }
            if let Some(action) = x.recovery_action {
                o = o.field("recovery_action", recovery_action(action));
            }
            if let Some(pid) = x.pid {
                o = o.field("pid", i64::from(pid));
            }
            if let Some(process) = &x.process {
                o = o.field("process", process.as_str());
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
            // Saturating: a corrupt or hostile counter near i64::MAX must not panic the consumer
            // (overflow checks are on in debug builds) or wrap to a small total (release builds).
            o = o.field("total", d.single_bit.saturating_add(d.double_bit)).field("pending", d.pending);
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
            let crc = n.crc_flit_errors.unwrap_or(0).saturating_add(n.crc_data_errors.unwrap_or(0));
            o = o.field("crc_errors", crc).field("recovery_errors", n.recovery_errors.unwrap_or(0));
        }
        Detail::PcieReplay(p) => o = o.field("value", p.count),
        Detail::PcieAer(a) => o = o.field("severity", wire_name(&a.severity)),
        Detail::CloudMaintenance(c) => {
            o = o.field("event", c.event_type.as_str());
            if let Some(start) = c.window_start {
                o = o.field("starts_at_micros", start.timestamp_micros());
            }
            if let Some(end) = c.window_end {
                o = o.field("ends_at_micros", end.timestamp_micros());
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
        Detail::GpuInventory(inv) => {
            o.inventory = inv.gpus.iter().filter_map(|g| g.uuid.clone()).collect();
            let count = saturating_i64(inv.gpus.len());
            o = o.field("count", count);
            // The node's capacity is what the cluster schedules against; the collector's own
            // count (the most seen this boot) cannot know of a GPU lost before it started.
            let expected = e.node_context.expected_gpus.or(inv.expected).map(i64::from);
            if let Some(expected) = expected {
                o = o.field("expected", expected).field("missing", expected.saturating_sub(count).max(0));
            }
        }
        Detail::GpuLost(_) | Detail::Mce(_) | Detail::Absent => {}
    }
    o
}

/// A count as an engine integer: saturates rather than wraps.
fn saturating_i64(v: impl TryInto<i64>) -> i64 {
    v.try_into().unwrap_or(i64::MAX)
}

/// The workloads as the engine names them: `namespace/OwnerKind/owner_name`, or
/// `namespace/Pod/pod` for a pod without an owner; deduplicated (the pods of one job are one
/// workload) and sorted, so the same pods give the same list whatever order the enricher saw them in.
fn workloads(pods: &[Workload]) -> Vec<String> {
    pods.iter()
        .map(|w| match (&w.owner_kind, &w.owner_name) {
            (Some(kind), Some(name)) => format!("{}/{kind}/{name}", w.namespace),
            _ => format!("{}/Pod/{}", w.namespace, w.pod),
        })
        .collect::<BTreeSet<_>>()
        .into_iter()
        .collect()
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
    let mut entity = gpumedic_schemas::health::Entity {
        pci_bus_id: d.gpu_pci.clone(),
        gpu_index: d.gpu_index,
        ..Default::default()
    };
    if let Some(gpu) = &d.gpu {
        if gpu.starts_with("GPU-") || gpu.starts_with("MIG-") {
            entity.gpu_uuid = Some(gpu.clone());
        } else if entity.pci_bus_id.is_none() {
            // A GPU the enricher could not resolve is named by the reference as reported, which
            // is a PCI bus id when it is not a UUID.
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
            Action::RunDiagnostics => RecommendedAction::RunDiagnostics,
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
        not_before: d.not_before_micros.and_then(DateTime::<Utc>::from_timestamp_micros),
        deferrable: d.deferrable,
        // The engine does not tell workload faults from hardware ones yet.
        workload: None,
    }
}

#[cfg(test)]
mod tests {
    use gpumedic_schemas::HealthEvent;
    use gpumedic_schemas::enriched::NodeContext;
    use gpumedic_schemas::health::{
        CloudMaintenanceDetail, CloudProvider, Component, Entity, GpuIdentity, GpuInventoryDetail, NvlinkDetail,
        RetiredPagesDetail, XidDetail,
    };
    use uuid::Uuid;

    use super::*;
    use crate::rules::FieldValue;
    use crate::rules::engine::DecisionKind;

    const UUID: &str = "GPU-5c1f2a8e-9d3b-4f47-a1c2-0e6b7d8f9a01";

    fn at(micros: i64) -> DateTime<Utc> {
        DateTime::from_timestamp_micros(micros).unwrap()
    }

    fn enriched(entity: Entity, detail: Detail) -> EnrichedHealthEvent {
        EnrichedHealthEvent {
            event: HealthEvent {
                event_id: Uuid::from_u128(1),
                observed_at: at(1_000_000),
                published_at: at(1_500_000),
                node: "node-a".into(),
                source: Source::Nvml,
                component: Component::Gpu,
                entity,
                kind: detail.kind(),
                detail,
                healthy: false,
                synthetic: false,
                raw: None,
                collector_version: "test".into(),
                boot_id: Some("boot-1".into()),
                workloads: None,
            },
            node_context: NodeContext::default(),
            node_unknown: false,
            xid_catalog: None,
            workloads: Vec::new(),
            enriched_at: at(2_000_000),
            gpu: None,
            gpu_unresolved: false,
        }
    }

    fn xid(pid: Option<i32>, process: Option<&str>) -> Detail {
        Detail::Xid(XidDetail {
            code: 79,
            text: "GPU has fallen off the bus".into(),
            pid,
            process: process.map(str::to_owned),
            nvlink5: None,
            recovery_action: None,
        })
    }

    fn inventory(gpus: usize, expected: Option<i32>) -> Detail {
        Detail::GpuInventory(GpuInventoryDetail {
            gpus: (0..gpus)
                .map(|i| GpuIdentity {
                    index: i32::try_from(i).ok(),
                    uuid: Some(format!("GPU-{i}")),
                    ..GpuIdentity::default()
                })
                .collect(),
            reason: GpuInventoryDetail::CHANGE.into(),
            expected,
        })
    }

    fn int(o: &Observation, name: &str) -> Option<i64> {
        match o.fields.get(name) {
            Some(FieldValue::Int(v)) => Some(*v),
            None => None,
            other => panic!("{name} is not an integer: {other:?}"),
        }
    }

    #[test]
    fn the_resolved_identity_names_the_gpu() {
        let entity = Entity { gpu_index: Some(1), pci_bus_id: Some("0000:01:00.0".into()), ..Entity::default() };
        let mut e = enriched(entity, xid(None, None));
        e.gpu = Some(GpuIdentity {
            index: Some(3),
            uuid: Some(UUID.into()),
            pci_bus_id: Some("0000:3b:00.0".into()),
            ..GpuIdentity::default()
        });
        let o = observation(&e);
        assert_eq!(o.gpu.as_deref(), Some(UUID));
        assert_eq!(o.gpu_index, Some(3));
        assert_eq!(o.gpu_pci.as_deref(), Some("0000:3b:00.0"));
    }

    #[test]
    fn without_an_identity_the_entity_names_the_gpu() {
        let entity = Entity { gpu_index: Some(2), pci_bus_id: Some("0000:3b:00.0".into()), ..Entity::default() };
        let o = observation(&enriched(entity.clone(), xid(None, None)));
        assert_eq!(o.gpu.as_deref(), Some("0000:3b:00.0"));
        assert_eq!((o.gpu_index, o.gpu_pci.as_deref()), (Some(2), Some("0000:3b:00.0")));

        // The entity's UUID wins over its PCI id, and an identity without a UUID does not hide it.
        let mut e = enriched(Entity { gpu_uuid: Some(UUID.into()), ..entity }, xid(None, None));
        e.gpu = Some(GpuIdentity { index: Some(5), ..GpuIdentity::default() });
        let o = observation(&e);
        assert_eq!(o.gpu.as_deref(), Some(UUID));
        assert_eq!(o.gpu_index, Some(5));
    }

    #[test]
    fn boot_id_and_receipt_time_come_from_the_raw_event() {
        let o = observation(&enriched(Entity::default(), Detail::Absent));
        assert_eq!(o.boot_id.as_deref(), Some("boot-1"));
        assert_eq!(o.received_at_micros, Some(1_500_000));
        assert_eq!(o.observed_at_micros, 1_000_000);
        assert_eq!(o.gpu, None);
    }

    #[test]
    fn a_start_snapshot_reading_is_marked_by_its_raw_text_alone() {
        let mut e = enriched(Entity::default(), Detail::Absent);
        assert!(!observation(&e).start_snapshot);
        e.event.raw = Some("NVRM: Xid (PCI:0000:3b:00): 79, GPU has fallen off the bus.".into());
        assert!(!observation(&e).start_snapshot);
        e.event.raw = Some(gpumedic_schemas::health::SNAPSHOT_RAW.into());
        assert!(observation(&e).start_snapshot);
    }

    #[test]
    fn workloads_are_owners_or_pods_once_each() {
        let pod = |pod: &str, owner: Option<(&str, &str)>| Workload {
            namespace: "training".into(),
            pod: pod.into(),
            owner_kind: owner.map(|(kind, _)| kind.to_owned()),
            owner_name: owner.map(|(_, name)| name.to_owned()),
            gpu_uuids: Vec::new(),
        };
        let mut e = enriched(Entity::default(), xid(None, None));
        e.workloads = vec![
            pod("llm-worker-1", Some(("Job", "llm"))),
            pod("debug", None),
            pod("llm-worker-0", Some(("Job", "llm"))),
        ];
        let o = observation(&e);
        assert_eq!(o.workloads, ["training/Job/llm", "training/Pod/debug"]);
    }

    #[test]
    fn an_inventory_counts_the_gpus_against_the_nodes_capacity() {
        let mut e = enriched(Entity::default(), inventory(7, Some(7)));
        e.node_context.expected_gpus = Some(8);
        let o = observation(&e);
        assert_eq!(o.kind, "gpu_inventory");
        assert_eq!(o.inventory, (0..7).map(|i| format!("GPU-{i}")).collect::<Vec<_>>());
        assert_eq!((int(&o, "count"), int(&o, "expected"), int(&o, "missing")), (Some(7), Some(8), Some(1)));

        // Without the node's capacity, the collector's own expectation.
        let o = observation(&enriched(Entity::default(), inventory(6, Some(8))));
        assert_eq!((int(&o, "count"), int(&o, "expected"), int(&o, "missing")), (Some(6), Some(8), Some(2)));

        // More present than expected is nothing missing, not a negative count.
        let o = observation(&enriched(Entity::default(), inventory(8, Some(4))));
        assert_eq!(int(&o, "missing"), Some(0));

        // Expectation unknown: no guess.
        let o = observation(&enriched(Entity::default(), inventory(8, None)));
        assert_eq!((int(&o, "count"), int(&o, "expected"), int(&o, "missing")), (Some(8), None, None));
    }

    #[test]
    fn an_xid_carries_its_process_when_logged() {
        let o = observation(&enriched(Entity::default(), xid(Some(4242), Some("python3"))));
        assert_eq!(o.xid, Some(79));
        assert_eq!(int(&o, "pid"), Some(4242));
        assert_eq!(o.fields.get("process"), Some(&FieldValue::Text("python3".into())));
        let o = observation(&enriched(Entity::default(), xid(None, None)));
        assert!(!o.fields.contains_key("pid") && !o.fields.contains_key("process"), "{:?}", o.fields);
    }

    #[test]
    fn cloud_maintenance_carries_both_ends_of_its_window() {
        let detail = Detail::CloudMaintenance(CloudMaintenanceDetail {
            provider: CloudProvider::Aws,
            event_type: "system-reboot".into(),
            provider_event_id: None,
            window_start: Some(at(10_000_000)),
            window_end: Some(at(20_000_000)),
            description: None,
        });
        let o = observation(&enriched(Entity::default(), detail));
        assert_eq!((int(&o, "starts_at_micros"), int(&o, "ends_at_micros")), (Some(10_000_000), Some(20_000_000)));
    }

    #[test]
    fn counters_at_the_top_of_their_range_saturate_instead_of_overflowing() {
        // What a u64::MAX counter from NVML is on the wire (a long) at most.
        let max = i64::try_from(u64::MAX).unwrap_or(i64::MAX);
        let pages = Detail::RetiredPages(RetiredPagesDetail { single_bit: max, double_bit: max, pending: false });
        assert_eq!(int(&observation(&enriched(Entity::default(), pages)), "total"), Some(i64::MAX));
        let nvlink = Detail::Nvlink(NvlinkDetail {
            link: 0,
            active: Some(true),
            crc_flit_errors: Some(max),
            crc_data_errors: Some(max),
            replay_errors: None,
            recovery_errors: Some(max),
        });
        let o = observation(&enriched(Entity::default(), nvlink));
        assert_eq!((int(&o, "crc_errors"), int(&o, "recovery_errors")), (Some(i64::MAX), Some(i64::MAX)));
        assert_eq!(saturating_i64(u64::MAX), i64::MAX);
        assert_eq!(saturating_i64(usize::MAX), i64::MAX);
    }

    fn decision() -> Decision {
        Decision {
            verdict_id: Uuid::from_u128(2),
            incident_id: Uuid::from_u128(3),
            step: 0,
            kind: DecisionKind::Open,
            rule_id: "ecc-dbe-contained".into(),
            rule_version: 1,
            node: "node-a".into(),
            gpu: Some(UUID.into()),
            gpu_index: Some(3),
            gpu_pci: Some("0000:3b:00.0".into()),
            not_before_micros: Some(30_000_000),
            deferrable: true,
            severity: Severity::Warning,
            action: Action::RunDiagnostics,
            then: Vec::new(),
            custom: None,
            reason: "contained uncorrectable error".into(),
            evidence: vec![Uuid::from_u128(1).to_string()],
            recovery: false,
            supersedes: Vec::new(),
            synthetic: false,
            nvlink_domain: None,
            decided_at_micros: 1_000_000,
        }
    }

    #[test]
    fn a_verdict_names_the_gpu_every_way_and_carries_the_schedule() {
        let v = verdict(&decision());
        assert_eq!(v.entity.gpu_uuid.as_deref(), Some(UUID));
        assert_eq!(v.entity.pci_bus_id.as_deref(), Some("0000:3b:00.0"));
        assert_eq!(v.entity.gpu_index, Some(3));
        assert_eq!(v.action, RecommendedAction::RunDiagnostics);
        assert_eq!(v.not_before, Some(at(30_000_000)));
        assert!(v.deferrable);
        assert_eq!(v.workload, None);
        assert_eq!(v.issued_at, at(1_000_000));
        assert_eq!(v.evidence, [Uuid::from_u128(1)]);

        let v =
            verdict(&Decision { not_before_micros: None, deferrable: false, action: Action::Monitor, ..decision() });
        assert_eq!((v.not_before, v.deferrable, v.action), (None, false, RecommendedAction::Monitor));
    }

    #[test]
    fn a_gpu_that_is_not_a_uuid_is_a_pci_bus_id() {
        let d = Decision { gpu: Some("0000:3b:00.0".into()), gpu_pci: None, gpu_index: None, ..decision() };
        let v = verdict(&d);
        assert_eq!(v.entity.gpu_uuid, None);
        assert_eq!(v.entity.pci_bus_id.as_deref(), Some("0000:3b:00.0"));

        let d = Decision { gpu: Some("MIG-1234".into()), ..decision() };
        assert_eq!(verdict(&d).entity.gpu_uuid.as_deref(), Some("MIG-1234"));
        let d = Decision { gpu: None, gpu_pci: None, gpu_index: None, ..decision() };
        assert_eq!(verdict(&d).entity, Entity::default());
    }

    #[test]
    fn an_observed_at_far_after_its_record_is_bounded_by_the_record_time() {
        let allowance = std::time::Duration::from_secs(300);
        let record_ms = 1_700_000_000_000i64;
        let record = DateTime::from_timestamp_millis(record_ms).unwrap();
        let day_ahead = record + chrono::Duration::days(1);
        assert_eq!(bounded_observed_at(day_ahead, Some(record_ms), allowance), Some(record));
        // Within the allowance (clocks a little apart) and in the past (late delivery): kept.
        let skewed = record + chrono::Duration::seconds(299);
        assert_eq!(bounded_observed_at(skewed, Some(record_ms), allowance), None);
        assert_eq!(bounded_observed_at(record - chrono::Duration::days(3), Some(record_ms), allowance), None);
        // A record without a timestamp gives nothing to bound by.
        assert_eq!(bounded_observed_at(day_ahead, None, allowance), None);
    }
}
