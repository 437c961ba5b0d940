//! From the public verdict to a remediation request, and from what happened to the action
//! outcome published on `gpumedic.actions.v1`. Pure mappings.

use gpumedic_schemas::verdict::{RecommendedAction, Verdict};
use gpumedic_schemas::{ActionOutcome, ActionStatus};

use crate::apply::Outcome;
use crate::plan::Skip;
use crate::request::{Action, GpuRef, Remediation, Subsystem};

/// The request a verdict makes of the remediator.
pub fn remediation(v: &Verdict) -> Remediation {
    // An operator-defined action (restart Fabric Manager, ...) runs through the repair hooks, named
    // by the rule; the node is marked, not changed. One without a name has nothing to run.
    let custom =
        v.custom_action.as_deref().map(str::trim).filter(|c| !c.is_empty() && v.action == RecommendedAction::Custom);
    let action = match v.action {
        RecommendedAction::None | RecommendedAction::Unknown => Action::None,
        RecommendedAction::Custom if custom.is_some() => Action::Custom,
        RecommendedAction::Monitor | RecommendedAction::Custom => Action::Monitor,
        // Diagnostics run on the node (DCGM) when the GPU is free; the node itself is not
        // changed unless they fail, which is a verdict of its own.
        RecommendedAction::RunDiagnostics => Action::Monitor,
        RecommendedAction::Cordon => Action::Cordon,
        RecommendedAction::Drain => Action::Drain,
        RecommendedAction::ResetGpu => Action::ResetGpu,
        RecommendedAction::RebootNode => Action::RebootNode,
        RecommendedAction::ReplaceNode => Action::ReplaceNode,
        RecommendedAction::ContactSupport => Action::ContactSupport,
    };
    let gpu = v.entity.gpu_uuid.as_ref().map(|uuid| GpuRef {
        uuid: uuid.clone(),
        pci_bus_id: v.entity.pci_bus_id.clone().unwrap_or_default(),
        index: v.entity.gpu_index.and_then(|i| u32::try_from(i).ok()),
    });
    Remediation {
        node: v.node.clone(),
        gpu,
        action,
        subsystem: subsystem(&v.rule_id),
        reason: condition_reason(&v.rule_id),
        message: v.reason.clone(),
        verdict_id: v.verdict_id.to_string(),
        incident_id: v.incident_id.to_string(),
        recovery: v.recovery,
        reissue: false,
        custom: custom.map(str::to_owned),
    }
}

/// Which node condition a rule speaks to, from its id (the default rule set names its family).
pub fn subsystem(rule_id: &str) -> Subsystem {
    let id = rule_id.to_ascii_lowercase();
    if ["nvlink", "nvswitch", "sxid", "pcie", "xid-74", "xid-144"].iter().any(|k| id.contains(k)) {
        Subsystem::Interconnect
    } else if ["ecc", "row-remap", "retired", "memory", "xid-48", "xid-63", "xid-64", "xid-92", "xid-94", "xid-95"]
        .iter()
        .any(|k| id.contains(k))
    {
        Subsystem::Memory
    } else if id.contains("maintenance") {
        Subsystem::Maintenance
    } else {
        Subsystem::Gpu
    }
}

/// A short CamelCase reason for the node condition: `xid-79-fallen-off-the-bus` gives `Xid79`,
/// other rule ids their words joined (`temperature-shutdown` gives `TemperatureShutdown`).
pub fn condition_reason(rule_id: &str) -> String {
    let mut parts = rule_id.split('-');
    if let (Some("xid"), Some(code)) = (parts.next(), parts.next())
        && !code.is_empty()
        && code.bytes().all(|b| b.is_ascii_digit())
    {
        return format!("Xid{code}");
    }
    rule_id
        .split(|c: char| !c.is_ascii_alphanumeric())
        .filter(|w| !w.is_empty())
        .map(|w| {
            let mut c = w.chars();
            c.next().map(|f| f.to_ascii_uppercase().to_string() + c.as_str()).unwrap_or_default()
        })
        .collect()
}

/// How old `v` is when it is too old to act on: never for a recovery, which only removes what
/// gpumedic applied and is safe whenever it comes.
pub fn stale(
    v: &Verdict,
    now: chrono::DateTime<chrono::Utc>,
    max_age: std::time::Duration,
) -> Option<std::time::Duration> {
    let age = (now - v.issued_at).to_std().ok()?;
    (!v.recovery && age > max_age).then_some(age)
}

/// The outcome record for what the remediator did about `v`.
pub fn outcome(v: &Verdict, result: &Result<Outcome, String>) -> ActionOutcome {
    outcome_for(v.verdict_id, &v.node, v.action, result)
}

/// The outcome record for what the remediator did about verdict `verdict_id` on `node`, which
/// asked for `action` (also used for deferred actions carried out in a maintenance window).
pub fn outcome_for(
    verdict_id: uuid::Uuid,
    node: &str,
    action: RecommendedAction,
    result: &Result<Outcome, String>,
) -> ActionOutcome {
    let (status, detail) = match result {
        Ok(Outcome::Applied { plan, drain }) => {
            // The contract has no incomplete status (a new symbol waits for a schema release):
            // the detail starts with "drain incomplete" instead, so it reads apart from a drain
            // that finished.
            let mut d = match drain {
                Some(r) if !r.complete() => {
                    format!("drain incomplete (retried at the next resync): {}", describe(plan))
                }
                _ => describe(plan),
            };
            if let Some(r) = drain {
                d.push_str(&format!(
                    "; drain: {} evicted, {} completed, {} force-deleted, {} skipped, {} blocked, {} remaining, {} failed",
                    r.evicted.len(),
                    r.completed.len(),
                    r.force_deleted.len(),
                    r.skipped.len(),
                    r.blocked.len(),
                    r.remaining.len(),
                    r.failed.len()
                ));
            }
            (ActionStatus::Applied, d)
        }
        Ok(Outcome::AlreadyDone) => (ActionStatus::AlreadyDone, "the node already reflects this verdict".to_owned()),
        Ok(Outcome::Skipped { reason, would }) => {
            let status = match reason {
                Skip::MonitorOnly => ActionStatus::DryRun,
                Skip::BreakerOpen(_) | Skip::RateLimited(_) => ActionStatus::BlockedByBreaker,
                _ => ActionStatus::SkippedByMode,
            };
            let mut d = match reason {
                // The contract has no stale status: the detail starts with "stale" instead, so
                // a stale verdict reads apart from what the mode held back.
                Skip::Stale(age) => format!(
                    "stale: the verdict was issued {}s ago, longer ago than --max-verdict-age; did nothing",
                    age.as_secs()
                ),
                _ => format!("did nothing because {reason}"),
            };
            if let Some(plan) = would {
                d.push_str(&format!("; would have: {}", describe(plan)));
            }
            (status, d)
        }
        Err(e) => (ActionStatus::Failed, e.clone()),
    };
    ActionOutcome { verdict_id, node: node.to_owned(), action, status, detail, at: chrono::Utc::now() }
}

/// One line for humans: what a plan changes.
pub fn describe(plan: &crate::plan::Plan) -> String {
    let mut parts = Vec::new();
    if !plan.conditions.is_empty() {
        parts.push(format!("{} condition(s) set", plan.conditions.len()));
    }
    if !plan.add_taints.is_empty() {
        parts.push(format!("{} taint(s) added", plan.add_taints.len()));
    }
    if !plan.remove_taints.is_empty() {
        parts.push(format!("{} taint(s) removed", plan.remove_taints.len()));
    }
    match plan.cordon {
        Some(true) => parts.push("cordoned".to_owned()),
        Some(false) => parts.push("uncordoned".to_owned()),
        None => {}
    }
    if let Some(rule) = &plan.gpu_rule {
        parts.push(format!("GPU quarantined by DeviceTaintRule {rule}"));
    }
    if plan.drain.is_some() {
        parts.push("drained".to_owned());
    }
    if let Some(state) = plan.set_labels.get(crate::plan::STATE_LABEL) {
        parts.push(format!("state {state}"));
    }
    if let Some(repair) = plan.repair {
        parts.push(format!("repair ladder started at {}", repair.name()));
    }
    if parts.is_empty() { "no change".to_owned() } else { parts.join(", ") }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn verdict(action: RecommendedAction) -> Verdict {
        Verdict {
            verdict_id: uuid::Uuid::nil(),
            incident_id: uuid::Uuid::nil(),
            node: "n".into(),
            entity: Default::default(),
            severity: gpumedic_schemas::Severity::Warning,
            rule_id: "ecc-contained".into(),
            rule_version: 1,
            action,
            custom_action: None,
            reason: String::new(),
            evidence: vec![],
            issued_at: chrono::Utc::now(),
            recovery: false,
            not_before: None,
            deferrable: true,
            workload: None,
        }
    }

    #[test]
    fn a_named_custom_action_is_run_and_an_unnamed_one_only_marks() {
        let mut v = verdict(RecommendedAction::Custom);
        v.custom_action = Some(" restart-fabric-manager ".into());
        let r = remediation(&v);
        assert_eq!((r.action, r.custom.as_deref()), (Action::Custom, Some("restart-fabric-manager")));
        v.custom_action = Some(" ".into());
        assert_eq!((remediation(&v).action, remediation(&v).custom), (Action::Monitor, None));
        // A name on a verdict that is not custom runs nothing.
        let mut v = verdict(RecommendedAction::Monitor);
        v.custom_action = Some("restart-fabric-manager".into());
        assert_eq!((remediation(&v).action, remediation(&v).custom), (Action::Monitor, None));
    }

    #[test]
    fn run_diagnostics_changes_the_node_no_more_than_monitor() {
        let diagnostics = remediation(&verdict(RecommendedAction::RunDiagnostics));
        assert_eq!(diagnostics.action, Action::Monitor);
        assert_eq!(diagnostics.action, remediation(&verdict(RecommendedAction::Monitor)).action);
    }

    #[test]
    fn old_verdicts_are_stale_but_recoveries_never_are() {
        let now = chrono::Utc::now();
        let mut v = Verdict {
            verdict_id: uuid::Uuid::nil(),
            incident_id: uuid::Uuid::nil(),
            node: "n".into(),
            entity: Default::default(),
            severity: gpumedic_schemas::Severity::Critical,
            rule_id: "xid-79-fallen-off-the-bus".into(),
            rule_version: 1,
            action: RecommendedAction::RebootNode,
            custom_action: None,
            reason: String::new(),
            evidence: vec![],
            issued_at: now - chrono::Duration::minutes(20),
            recovery: false,
            not_before: None,
            deferrable: false,
            workload: None,
        };
        let limit = std::time::Duration::from_secs(15 * 60);
        assert!(stale(&v, now, limit).is_some_and(|age| age.as_secs() >= 1200));
        v.recovery = true;
        assert_eq!(stale(&v, now, limit), None);
        v.recovery = false;
        v.issued_at = now - chrono::Duration::minutes(1);
        assert_eq!(stale(&v, now, limit), None);
    }

    #[test]
    fn a_stale_verdict_is_reported_skipped_with_a_detail_that_says_stale() {
        let v = verdict(RecommendedAction::Drain);
        let skipped = Ok(Outcome::Skipped { reason: Skip::Stale(std::time::Duration::from_secs(1200)), would: None });
        let o = outcome(&v, &skipped);
        assert_eq!(o.status, ActionStatus::SkippedByMode);
        assert!(o.detail.starts_with("stale: the verdict was issued 1200s ago"), "{}", o.detail);
        let by_mode = outcome(&v, &Ok(Outcome::Skipped { reason: Skip::Paused, would: None }));
        assert!(!by_mode.detail.starts_with("stale"), "{}", by_mode.detail);
    }

    #[test]
    fn reasons_and_subsystems_follow_rule_ids() {
        assert_eq!(condition_reason("xid-79-fallen-off-the-bus"), "Xid79");
        assert_eq!(condition_reason("xid-application-repeated"), "XidApplicationRepeated");
        assert_eq!(condition_reason("temperature-shutdown"), "TemperatureShutdown");
        assert_eq!(subsystem("xid-79-fallen-off-the-bus"), Subsystem::Gpu);
        assert_eq!(subsystem("xid-48-alone"), Subsystem::Memory);
        assert_eq!(subsystem("nvlink-down"), Subsystem::Interconnect);
        assert_eq!(subsystem("cloud-maintenance"), Subsystem::Maintenance);
    }
}
