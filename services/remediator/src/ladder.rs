//! The escalation ladder: after a drain, in full-remediation mode, a node with a repair verdict
//! walks a configured list of repair steps (by default `reset_gpu -> reboot_node -> replace_node`),
//! starting at the verdict's action. Each step hands the node to the repair hooks
//! ([`crate::hooks`]) and has a timeout; the step succeeds when a hook reports success (the custom
//! resource's phase reads `Succeeded`) or when healthy evidence arrives (a recovery verdict for
//! the incident). A step that fails or times out escalates to the next; when the last one fails
//! the node is left `failed` for an operator. After a failed validation the ladder keeps the
//! recovery it held ([`Ladder::held_recovery`]): the next step is then over when a hook reports
//! success, or, when no hook reports back (the webhook alone), when it has had its timeout, and
//! the node is validated again ([`Move::Validate`]).
//!
//! The ladder is durable: it lives on the Node in the [`LADDER_ANNOTATION`] (JSON [`Ladder`]), like
//! deferred actions, and the leader drives it from a periodic task, so a failover or a restart
//! continues where the last leader stopped without repeating a step. The receivers guard against
//! a repeat too: the webhook's `Idempotency-Key` and the custom resource's name are derived from
//! the verdict and the step number, never from the attempt.
//!
//! Everything here is pure except the three small annotation functions at the end.

use std::time::Duration;

use chrono::{DateTime, Utc};
use gpumedic_schemas::verdict::RecommendedAction;
use k8s_openapi::api::core::v1::Node;
use kube::api::{Api, Patch, PatchParams};
use serde::{Deserialize, Serialize};
use serde_json::{Value, json};

use crate::request::{Action, Remediation};

/// The default ladder (`--repair-ladder`).
pub const DEFAULT_LADDER: &str = "reset_gpu,reboot_node,replace_node";

/// The Node annotation holding the node's [`Ladder`].
pub const LADDER_ANNOTATION: &str = "gpumedic.io/repair";

/// One rung: a repair action and how long it may take.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct StepSpec {
    /// The repair asked of the hooks.
    pub action: Action,
    /// How long the step may take before the ladder escalates, in seconds.
    pub timeout_seconds: u64,
}

impl StepSpec {
    /// The step's timeout.
    pub fn timeout(&self) -> Duration {
        Duration::from_secs(self.timeout_seconds)
    }
}

/// Parses a ladder flag: comma-separated repair names, each with an optional `=<duration>`
/// timeout (`reset_gpu=10m,reboot_node=30m,replace_node`); a step without one gets `default`.
pub fn parse_steps(raw: &str, default: Duration) -> Result<Vec<StepSpec>, String> {
    let mut steps: Vec<StepSpec> = Vec::new();
    for part in raw.split(',').map(str::trim).filter(|p| !p.is_empty()) {
        let (name, timeout) = match part.split_once('=') {
            Some((n, t)) => (n, gpumedic_runtime::config::parse_duration(t.trim())?),
            None => (part, default),
        };
        let action = Action::parse_repair(name)?;
        if timeout.is_zero() {
            return Err(format!("step '{part}' needs a timeout above zero"));
        }
        if steps.iter().any(|s| s.action == action) {
            return Err(format!("'{}' appears twice in the ladder", action.name()));
        }
        steps.push(StepSpec { action, timeout_seconds: timeout.as_secs().max(1) });
    }
    if steps.is_empty() {
        return Err("the ladder needs at least one step".to_owned());
    }
    Ok(steps)
}

/// The steps a verdict asking for `action` walks: the configured ladder from that action on (a
/// reboot verdict starts at reboot). An action the ladder does not name starts at the first rung
/// more drastic than it; past the top of the ladder it is a ladder of its own, with the last
/// rung's timeout.
pub fn steps_for(action: Action, ladder: &[StepSpec]) -> Vec<StepSpec> {
    if let Some(i) = ladder.iter().position(|s| s.action == action) {
        return ladder[i..].to_vec();
    }
    if let Some(i) = ladder.iter().position(|s| s.action > action) {
        return ladder[i..].to_vec();
    }
    let timeout_seconds = ladder.last().map_or(3600, |s| s.timeout_seconds);
    vec![StepSpec { action, timeout_seconds }]
}

/// Where the ladder is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Phase {
    /// The current step's hooks have not been called yet (or the call did not finish).
    Pending,
    /// The current step's hooks accepted the work at `since`; waiting for success or the timeout.
    Running,
    /// A hook reported success: the node waits for healthy evidence to return to service.
    Succeeded,
    /// Healthy evidence arrived and the validation ([`Ladder::validation`]) decides whether the
    /// node returns to service or the ladder escalates.
    Validating,
    /// The validation passed at `since`; the node returns once it has had no new fault for the
    /// validation's burn-in period. A new fault escalates the ladder, unless it is another
    /// incident's on another GPU ([`Ladder::fault_elsewhere`]): that one holds the burn-in
    /// ([`Ladder::burn_in_held_for`]) until it recovers.
    BurnIn,
    /// Every step failed: an operator must act.
    Failed,
}

/// A node's repair ladder, stored as JSON in [`LADDER_ANNOTATION`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Ladder {
    /// The verdict that started it (its id names the hook calls and the outcomes).
    pub verdict_id: String,
    /// The action that verdict recommended, as published.
    pub action: RecommendedAction,
    /// The request the verdict made (node, GPU, incident, reason).
    pub request: Remediation,
    /// The rungs, the first being the verdict's own action.
    pub steps: Vec<StepSpec>,
    /// The index of the current step in `steps`.
    pub current: usize,
    /// Where the current step is.
    pub phase: Phase,
    /// When the current phase began.
    pub since: DateTime<Utc>,
    /// What happened to the earlier steps, one line each.
    #[serde(default)]
    pub history: Vec<String>,
    /// The validation under way, in [`Phase::Validating`] and [`Phase::BurnIn`].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub validation: Option<crate::validate::Validation>,
    /// A validation (or its burn-in) failed on this ladder: once the ladder has failed, a recovery
    /// no longer returns the node (only an operator does).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub failed_validation: bool,
    /// The recovery verdict a failed validation (or an interrupted burn-in) held: the incident
    /// has recovered already and the classifier sends no other recovery for it, so once the
    /// escalated step is over ([`Move::Validate`]) the node is validated again with this one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub held_recovery: Option<Remediation>,
    /// How many validations have started at the current step (back to 0 when the ladder
    /// escalates); a second one at the same step (a drained node's validation before release
    /// failed, and its first rung is over) gets a name of its own ([`Ladder::validation_suffix`]).
    #[serde(default, skip_serializing_if = "is_zero")]
    pub validations_at_step: u32,
    /// The other incidents that quarantine the node during its burn-in (faults on other GPUs):
    /// the burn-in does not complete while any is open, and starts over once the last recovers.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub burn_in_held_for: Vec<String>,
}

fn is_zero(n: &u32) -> bool {
    *n == 0
}

/// What the hooks say about the current step.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Report {
    /// Nothing decisive (still working, or no hook that reports back).
    Working,
    /// A hook reported the repair done.
    Succeeded,
    /// A hook reported the repair failed, and why.
    Failed(String),
    /// No hook reports back on this step (the webhook alone): healthy evidence or the timeout
    /// ends it.
    Silent,
}

/// What the driver does with a ladder now.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Move {
    /// Call the hooks for the current step.
    Start,
    /// Nothing yet.
    Wait,
    /// The current step succeeded.
    Succeed,
    /// The current step failed (the reason); the next step follows, or the ladder fails.
    Escalate(String),
    /// The current step is over (the reason: its hook reported success, or no hook reports on it
    /// and it has had its timeout) and the node's healthy evidence is already held
    /// ([`Ladder::held_recovery`]): the node is validated now.
    Validate(String),
    /// The ladder is over (succeeded or failed): nothing to drive.
    Done,
}

impl Ladder {
    /// A new ladder for `request` (a repair verdict) over the configured `ladder`, at `now`.
    pub fn new(
        verdict_id: &str,
        action: RecommendedAction,
        request: &Remediation,
        ladder: &[StepSpec],
        now: DateTime<Utc>,
    ) -> Self {
        Self {
            verdict_id: verdict_id.to_owned(),
            action,
            request: request.clone(),
            steps: steps_for(request.action, ladder),
            current: 0,
            phase: Phase::Pending,
            since: now,
            history: Vec::new(),
            validation: None,
            failed_validation: false,
            held_recovery: None,
            validations_at_step: 0,
            burn_in_held_for: Vec::new(),
        }
    }

    /// The ladder of a custom action (`request.action` is [`Action::Custom`]): the one step that
    /// runs it through the hooks, with `timeout`. Its failure or timeout fails the ladder: there is
    /// no milder or harsher version of an operator's action to escalate to, and the node, which a
    /// custom action does not drain, must not get a reset or a reboot that way.
    pub fn custom(verdict_id: &str, request: &Remediation, timeout: Duration, now: DateTime<Utc>) -> Self {
        Self {
            verdict_id: verdict_id.to_owned(),
            action: RecommendedAction::Custom,
            request: request.clone(),
            steps: vec![StepSpec { action: Action::Custom, timeout_seconds: timeout.as_secs().max(1) }],
            current: 0,
            phase: Phase::Pending,
            since: now,
            history: Vec::new(),
            validation: None,
            failed_validation: false,
            held_recovery: None,
            validations_at_step: 0,
            burn_in_held_for: Vec::new(),
        }
    }

    /// What the hooks are asked to do at the current step: the repair's name (`reset_gpu`, ...),
    /// or for a custom action the name its rule gave it (`restart-fabric-manager`).
    pub fn step_name(&self) -> String {
        self.name_of(self.step())
    }

    fn name_of(&self, step: StepSpec) -> String {
        match (step.action, &self.request.custom) {
            (Action::Custom, Some(name)) => name.clone(),
            (action, _) => action.name().to_owned(),
        }
    }

    /// The current step.
    pub fn step(&self) -> StepSpec {
        self.steps[self.current.min(self.steps.len() - 1)]
    }

    /// The current step's number, from 1 (what the hooks see).
    pub fn step_number(&self) -> usize {
        self.current + 1
    }

    /// Whether the ladder still has work (pending, running, validating or burning in).
    pub fn active(&self) -> bool {
        matches!(self.phase, Phase::Pending | Phase::Running | Phase::Validating | Phase::BurnIn)
    }

    /// The validation passed at `now`: the burn-in begins.
    pub fn burning_in(&mut self, now: DateTime<Utc>) {
        self.phase = Phase::BurnIn;
        self.since = now;
    }

    /// Whether the burn-in is over at `now` (it has lasted the validation's burn-in period);
    /// false outside a burn-in.
    pub fn burn_in_over(&self, now: DateTime<Utc>) -> bool {
        let Some(v) = self.validation.as_ref().filter(|_| self.phase == Phase::BurnIn) else { return false };
        (now - self.since).to_std().unwrap_or_default().as_secs() >= v.burn_in_seconds
    }

    /// Healthy evidence arrived: the node is validated by `validation` before it returns.
    pub fn validating(&mut self, validation: crate::validate::Validation) {
        self.since = validation.since;
        self.validation = Some(validation);
        self.phase = Phase::Validating;
    }

    /// The validation failed (or timed out) at `now` for `why`: the ladder escalates from the step
    /// the node was on, as a failed repair step does, and the held recovery is dropped.
    pub fn validation_failed(&mut self, why: &str, now: DateTime<Utc>) {
        self.validation = None;
        self.escalate(&format!("validation: {why}"), now);
    }

    /// Whether the current step is the last rung.
    pub fn at_top(&self) -> bool {
        self.current + 1 >= self.steps.len()
    }

    /// What tells the next validation's name (Job, resource, webhook key) apart from an earlier
    /// one of this ladder at the same step: nothing for the first validation at a step (its name
    /// is the verdict's and the step's), the count for the later ones (`-2`, `-3`, ...), so a
    /// re-validation never finds the Job that failed before.
    pub fn validation_suffix(&self) -> String {
        match self.validations_at_step {
            0 => String::new(),
            n => format!("-{}", n + 1),
        }
    }

    /// Whether `fault` (a new quarantining fault verdict during the burn-in) is another
    /// incident's on another GPU than this ladder's: a new problem, no sign that this ladder's
    /// repair did not hold. A fault of the ladder's own incident, on its GPU, or one that names no
    /// GPU (a node-level fault), or any fault after a repair of the whole node (the ladder names no
    /// GPU), says the repair did not hold.
    pub fn fault_elsewhere(&self, fault: &Remediation) -> bool {
        if fault.incident_id == self.request.incident_id {
            return false;
        }
        match (&fault.gpu, &self.request.gpu) {
            (Some(new), Some(ours)) => {
                let same_uuid = !new.uuid.is_empty() && new.uuid.eq_ignore_ascii_case(&ours.uuid);
                let same_bus = !new.pci_bus_id.is_empty() && new.pci_bus_id.eq_ignore_ascii_case(&ours.pci_bus_id);
                !same_uuid && !same_bus
            }
            _ => false,
        }
    }

    /// Decides the next move at `now`, given what the hooks report about a running step. A
    /// report of success or failure wins over the timeout: a hook that answered in time is
    /// believed even when it is read after the deadline. A pending step (hooks unreachable so
    /// far) is tried again until the same timeout, counted from when it became pending.
    pub fn decide(&self, now: DateTime<Utc>, report: &Report) -> Move {
        let elapsed = (now - self.since).to_std().unwrap_or_default();
        match self.phase {
            // A step whose hooks stay unreachable fails at its timeout like one that never succeeds.
            Phase::Pending if elapsed >= self.step().timeout() => Move::Escalate(format!(
                "the repair hooks did not take the step within its timeout of {}s",
                self.step().timeout_seconds
            )),
            Phase::Pending => Move::Start,
            // Driven by the validation's own reading and the burn-in's clock (see crate::repairs).
            Phase::Succeeded | Phase::Failed | Phase::Validating | Phase::BurnIn => Move::Done,
            Phase::Running => match report {
                Report::Succeeded if self.held_recovery.is_some() => {
                    Move::Validate("its repair controller reported success".to_owned())
                }
                Report::Succeeded => Move::Succeed,
                Report::Failed(why) => Move::Escalate(why.clone()),
                // Nothing will report this step done, and the recovery that would is held
                // already: the step's timeout is the time the repair was given.
                Report::Silent if self.held_recovery.is_some() && elapsed >= self.step().timeout() => Move::Validate(
                    format!("it has had its {}s and no hook reports back on it", self.step().timeout_seconds),
                ),
                Report::Working | Report::Silent => {
                    if elapsed >= self.step().timeout() {
                        Move::Escalate(format!(
                            "no success within the step's timeout of {}s",
                            self.step().timeout_seconds
                        ))
                    } else {
                        Move::Wait
                    }
                }
            },
        }
    }

    /// The hooks accepted the current step at `now`.
    pub fn started(&mut self, now: DateTime<Utc>) {
        self.phase = Phase::Running;
        self.since = now;
    }

    /// The current step succeeded at `now`.
    pub fn succeeded(&mut self, now: DateTime<Utc>) {
        self.phase = Phase::Succeeded;
        self.since = now;
    }

    /// The current step failed at `now` for `why`: the next step is pending, or the ladder has
    /// failed when this was the top.
    pub fn escalate(&mut self, why: &str, now: DateTime<Utc>) {
        self.history.push(format!("step {} {}: {why}", self.step_number(), self.step_name()));
        if self.at_top() {
            self.phase = Phase::Failed;
        } else {
            self.current += 1;
            self.validations_at_step = 0;
            self.phase = Phase::Pending;
        }
        self.since = now;
    }

    /// One line for Events and outcomes: where the ladder is.
    pub fn describe(&self) -> String {
        let rungs: Vec<String> = self
            .steps
            .iter()
            .enumerate()
            .map(|(i, s)| {
                let mark = if i == self.current { "*" } else { "" };
                format!("{mark}{}({}s)", self.name_of(*s), s.timeout_seconds)
            })
            .collect();
        format!("{} [{}]", self.phase_name(), rungs.join(" -> "))
    }

    fn phase_name(&self) -> &'static str {
        match self.phase {
            Phase::Pending => "pending",
            Phase::Running => "running",
            Phase::Succeeded => "succeeded",
            Phase::Validating => "validating",
            Phase::BurnIn => "burn-in",
            Phase::Failed => "failed",
        }
    }
}

/// The recommended action as published for a repair action (outcomes of later steps name the
/// step's action, not the verdict's).
pub fn recommended(action: Action) -> RecommendedAction {
    match action {
        Action::None => RecommendedAction::None,
        Action::Monitor => RecommendedAction::Monitor,
        Action::Custom => RecommendedAction::Custom,
        Action::Cordon => RecommendedAction::Cordon,
        Action::Drain => RecommendedAction::Drain,
        Action::ResetGpu => RecommendedAction::ResetGpu,
        Action::RebootNode => RecommendedAction::RebootNode,
        Action::ReplaceNode => RecommendedAction::ReplaceNode,
        Action::ContactSupport => RecommendedAction::ContactSupport,
    }
}

/// Reads the ladder on a node, if any; an unreadable record, or one that could not have been
/// written for this node (no steps, a step past the end, another node named), reads as an error
/// string. The record is data about its own node: whoever can annotate one node must not reach
/// another through it, nor crash the leader with it.
pub fn ladder_on(node: &Node) -> Option<Result<Ladder, String>> {
    let raw = node.metadata.annotations.as_ref().and_then(|a| a.get(LADDER_ANNOTATION))?;
    let name = node.metadata.name.as_deref().unwrap_or_default();
    Some(serde_json::from_str::<Ladder>(raw).map_err(|e| e.to_string()).and_then(|l| {
        if l.steps.is_empty() {
            Err("the ladder has no steps".to_owned())
        } else if l.current >= l.steps.len() {
            Err(format!("the current step {} is past the ladder's {} steps", l.current + 1, l.steps.len()))
        } else if l.request.node != name {
            Err(format!("the ladder names node {:?}, not this node", l.request.node))
        } else {
            Ok(l)
        }
    }))
}

/// The merge patch that writes `ladder` (or removes the record, for `None`), guarded by the
/// node's `resourceVersion` when given, so a recovery that cleared the ladder meanwhile is not
/// undone by a driver that read the node before it.
pub fn ladder_patch(ladder: Option<&Ladder>, resource_version: Option<&str>) -> Value {
    let value = ladder.map_or(Value::Null, |l| json!(serde_json::to_string(l).expect("the ladder serializes")));
    let mut patch = json!({ "metadata": { "annotations": { LADDER_ANNOTATION: value } } });
    if let Some(rv) = resource_version {
        patch["metadata"]["resourceVersion"] = json!(rv);
    }
    patch
}

/// Writes `ladder` (or removes it) on `node`; a 409 means the node changed since it was read at
/// `resource_version`.
pub async fn write(
    client: &kube::Client,
    node: &str,
    ladder: Option<&Ladder>,
    resource_version: Option<&str>,
) -> Result<(), kube::Error> {
    let nodes: Api<Node> = Api::all(client.clone());
    match nodes.patch(node, &PatchParams::default(), &Patch::Merge(ladder_patch(ladder, resource_version))).await {
        Ok(_) => Ok(()),
        // Clearing a ladder from a node that is gone is done.
        Err(kube::Error::Api(s)) if s.code == 404 && ladder.is_none() => Ok(()),
        Err(e) => Err(e),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::request::{GpuRef, Subsystem};

    fn at(secs: i64) -> DateTime<Utc> {
        DateTime::from_timestamp(1_767_225_600 + secs, 0).unwrap()
    }

    fn default_ladder() -> Vec<StepSpec> {
        parse_steps("reset_gpu=10m,reboot_node=30m,replace_node=4h", Duration::from_secs(60)).unwrap()
    }

    fn request(action: Action) -> Remediation {
        Remediation {
            node: "gpu-1".into(),
            gpu: None,
            action,
            subsystem: Subsystem::Gpu,
            reason: "Xid79".into(),
            message: "fell off the bus".into(),
            verdict_id: "v1".into(),
            incident_id: "i1".into(),
            recovery: false,
            reissue: false,
            custom: None,
        }
    }

    #[test]
    fn a_custom_action_is_one_step_under_its_own_name_that_fails_the_ladder_on_timeout() {
        let r = Remediation {
            action: Action::Custom,
            custom: Some("restart-fabric-manager".into()),
            ..request(Action::Custom)
        };
        let mut l = Ladder::custom("v1", &r, Duration::from_secs(120), at(0));
        assert_eq!(
            (l.steps.len(), l.step_name(), l.action),
            (1, "restart-fabric-manager".to_owned(), RecommendedAction::Custom)
        );
        assert_eq!(l.describe(), "pending [*restart-fabric-manager(120s)]");
        assert!(Action::parse_repair("custom").is_err(), "custom is no rung of the configured ladder");
        l.started(at(0));
        assert_eq!(l.decide(at(119), &Report::Working), Move::Wait);
        let Move::Escalate(why) = l.decide(at(120), &Report::Working) else { panic!("the timeout escalates") };
        assert!(l.at_top());
        l.escalate(&why, at(120));
        assert_eq!(l.phase, Phase::Failed);
        assert!(l.history[0].starts_with("step 1 restart-fabric-manager: no success"), "{:?}", l.history);
    }

    #[test]
    fn parses_steps_with_and_without_timeouts() {
        let steps = parse_steps("reset_gpu=90s, reboot_node", Duration::from_secs(600)).unwrap();
        assert_eq!(
            steps,
            [
                StepSpec { action: Action::ResetGpu, timeout_seconds: 90 },
                StepSpec { action: Action::RebootNode, timeout_seconds: 600 }
            ]
        );
        for bad in ["", "drain", "reset_gpu=0s", "reset_gpu,reset_gpu", "reboot_node=soon"] {
            assert!(parse_steps(bad, Duration::from_secs(60)).is_err(), "{bad:?} should not parse");
        }
    }

    #[test]
    fn a_ladder_starts_at_the_verdicts_action() {
        let ladder = default_ladder();
        let names = |a| steps_for(a, &ladder).iter().map(|s| s.action).collect::<Vec<_>>();
        assert_eq!(names(Action::ResetGpu), [Action::ResetGpu, Action::RebootNode, Action::ReplaceNode]);
        assert_eq!(names(Action::RebootNode), [Action::RebootNode, Action::ReplaceNode]);
        assert_eq!(names(Action::ContactSupport), [Action::ContactSupport], "past the top: its own ladder");
        let short = parse_steps("reboot_node", Duration::from_secs(60)).unwrap();
        assert_eq!(
            steps_for(Action::ResetGpu, &short).iter().map(|s| s.action).collect::<Vec<_>>(),
            [Action::RebootNode],
            "an action the ladder skips starts at the next rung"
        );
    }

    #[test]
    fn a_step_that_times_out_escalates_and_the_top_failing_fails_the_ladder() {
        let mut l =
            Ladder::new("v1", RecommendedAction::RebootNode, &request(Action::RebootNode), &default_ladder(), at(0));
        assert_eq!(l.decide(at(0), &Report::Working), Move::Start);
        assert!(matches!(l.decide(at(1800), &Report::Working), Move::Escalate(w) if w.contains("did not take")));
        l.started(at(1));
        assert_eq!(l.step_number(), 1);
        assert_eq!(l.decide(at(1 + 1799), &Report::Working), Move::Wait);
        let Move::Escalate(why) = l.decide(at(1 + 1800), &Report::Working) else { panic!("expected a timeout") };
        assert!(why.contains("1800s"), "{why}");
        l.escalate(&why, at(1801));
        assert_eq!((l.step().action, l.phase, l.step_number()), (Action::ReplaceNode, Phase::Pending, 2));
        assert!(l.active());
        assert_eq!(l.decide(at(1802), &Report::Working), Move::Start);
        l.started(at(1802));
        assert_eq!(l.decide(at(1803), &Report::Failed("no spare".into())), Move::Escalate("no spare".into()));
        l.escalate("no spare", at(1803));
        assert_eq!(l.phase, Phase::Failed);
        assert!(!l.active());
        assert_eq!(l.decide(at(9999), &Report::Working), Move::Done);
        assert_eq!(l.history.len(), 2);
        assert!(l.history[1].contains("replace_node: no spare"), "{:?}", l.history);
    }

    #[test]
    fn a_burn_in_lasts_its_period_from_the_passed_validation_and_keeps_the_ladder_active() {
        let r = request(Action::ResetGpu);
        let mut l = Ladder::new("v1", RecommendedAction::ResetGpu, &r, &default_ladder(), at(0));
        l.started(at(0));
        let v = crate::validate::Validation {
            kind: crate::validate::Kind::Job,
            namespace: "gpumedic".into(),
            job: "gpumedic-validate-v1-1".into(),
            recovery: Remediation { recovery: true, action: Action::None, ..r },
            since: at(10),
            timeout_seconds: 600,
            burn_in_seconds: 3600,
            release_from: None,
        };
        l.validating(v);
        assert!(!l.burn_in_over(at(100_000)), "no burn-in while validating");
        l.burning_in(at(100));
        assert!(l.active() && l.phase == Phase::BurnIn);
        assert_eq!(l.decide(at(5000), &Report::Working), Move::Done, "the burn-in's own driver moves it");
        assert!(!l.burn_in_over(at(100 + 3599)));
        assert!(l.burn_in_over(at(100 + 3600)));
        assert!(l.describe().starts_with("burn-in ["), "{}", l.describe());
        // Written and read back (a restart, a failover), it goes on from the same start.
        let back: Ladder = serde_json::from_str(&serde_json::to_string(&l).unwrap()).unwrap();
        assert_eq!(back, l);
        assert!(back.burn_in_over(at(100 + 3600)));
    }

    #[test]
    fn with_the_recovery_held_from_a_failed_validation_the_end_of_the_next_step_validates() {
        let r = request(Action::ResetGpu);
        let mut l = Ladder::new("v1", RecommendedAction::ResetGpu, &r, &default_ladder(), at(0));
        l.escalate("validation failed: diag FAIL", at(10));
        l.started(at(20));
        // Without the held recovery, a step no hook reports on times out and escalates.
        assert!(matches!(l.decide(at(20 + 1800), &Report::Silent), Move::Escalate(_)));
        l.held_recovery = Some(Remediation { recovery: true, action: Action::None, ..r });
        assert_eq!(l.decide(at(20 + 1799), &Report::Silent), Move::Wait, "the step has its whole timeout");
        assert!(matches!(l.decide(at(20 + 1800), &Report::Silent), Move::Validate(w) if w.contains("1800s")));
        assert!(matches!(l.decide(at(21), &Report::Succeeded), Move::Validate(w) if w.contains("reported success")));
        // A repair controller that reports back and stays silent past the timeout did not finish.
        assert!(matches!(l.decide(at(20 + 1800), &Report::Working), Move::Escalate(_)));
        assert!(matches!(l.decide(at(21), &Report::Failed("no spare".into())), Move::Escalate(_)));
        // Written and read back (a restart), the held recovery is still there.
        let back: Ladder = serde_json::from_str(&serde_json::to_string(&l).unwrap()).unwrap();
        assert_eq!(back, l);
    }

    #[test]
    fn a_second_validation_on_a_ladder_gets_a_name_of_its_own() {
        let mut l =
            Ladder::new("v1", RecommendedAction::ResetGpu, &request(Action::ResetGpu), &default_ladder(), at(0));
        assert_eq!(l.validation_suffix(), "");
        l.validations_at_step = 1;
        assert_eq!(l.validation_suffix(), "-2", "a second validation at step 1");
        l.escalate("validation failed", at(1));
        assert_eq!(l.validation_suffix(), "", "the first at step 2");
        let first = serde_json::to_string(&l).unwrap();
        assert!(!first.contains("validationsAtStep"), "records without a validation keep their shape: {first}");
        assert_eq!(serde_json::from_str::<Ladder>(&first).unwrap().validations_at_step, 0);
    }

    #[test]
    fn only_another_incidents_fault_on_another_gpu_is_elsewhere() {
        let l = Ladder::new("v1", RecommendedAction::ResetGpu, &request(Action::ResetGpu), &default_ladder(), at(0));
        let gpu = |uuid: &str, bus: &str| Some(GpuRef { uuid: uuid.into(), pci_bus_id: bus.into(), index: None });
        let ours = Remediation { gpu: gpu("GPU-aaa", "0000:3b:00.0"), ..request(Action::ResetGpu) };
        let l = Ladder { request: ours.clone(), ..l };
        let other = |gpu: Option<GpuRef>| Remediation { incident_id: "i2".into(), gpu, ..ours.clone() };
        assert!(l.fault_elsewhere(&other(gpu("GPU-bbb", "0000:5e:00.0"))));
        assert!(!l.fault_elsewhere(&other(gpu("gpu-AAA", ""))), "the same GPU by UUID");
        assert!(!l.fault_elsewhere(&other(gpu("", "0000:3B:00.0"))), "the same GPU by bus id");
        assert!(!l.fault_elsewhere(&other(None)), "a node-level fault");
        assert!(!l.fault_elsewhere(&Remediation { gpu: gpu("GPU-bbb", ""), ..ours.clone() }), "our own incident");
        let whole = Ladder { request: Remediation { gpu: None, ..ours.clone() }, ..l.clone() };
        assert!(!whole.fault_elsewhere(&other(gpu("GPU-bbb", ""))), "after a repair of the whole node");
    }

    #[test]
    fn a_reported_success_wins_even_after_the_deadline() {
        let mut l =
            Ladder::new("v1", RecommendedAction::ResetGpu, &request(Action::ResetGpu), &default_ladder(), at(0));
        l.started(at(0));
        assert_eq!(l.decide(at(100_000), &Report::Succeeded), Move::Succeed);
        l.succeeded(at(100_000));
        assert_eq!(l.decide(at(100_001), &Report::Working), Move::Done);
        assert!(l.describe().starts_with("succeeded [*reset_gpu(600s)"), "{}", l.describe());
    }

    #[test]
    fn the_record_round_trips_and_the_patch_is_guarded() {
        let l = Ladder::new("v1", RecommendedAction::ResetGpu, &request(Action::ResetGpu), &default_ladder(), at(0));
        let p = ladder_patch(Some(&l), Some("42"));
        assert_eq!(p["metadata"]["resourceVersion"], "42");
        let raw = p["metadata"]["annotations"][LADDER_ANNOTATION].as_str().unwrap();
        assert_eq!(serde_json::from_str::<Ladder>(raw).unwrap(), l);
        let clear = ladder_patch(None, None);
        assert_eq!(clear["metadata"]["annotations"][LADDER_ANNOTATION], Value::Null);
        assert!(clear["metadata"].get("resourceVersion").is_none());
    }

    #[test]
    fn a_ladder_record_that_could_not_have_been_written_for_its_node_is_refused() {
        let on = |name: &str, l: &Ladder| -> Node {
            serde_json::from_value(json!({ "metadata": { "name": name,
                "annotations": { LADDER_ANNOTATION: serde_json::to_string(l).unwrap() } } }))
            .unwrap()
        };
        let good = Ladder::new("v1", RecommendedAction::ResetGpu, &request(Action::ResetGpu), &default_ladder(), at(0));
        assert_eq!(ladder_on(&on("gpu-1", &good)), Some(Ok(good.clone())));
        let other = ladder_on(&on("gpu-2", &good)).unwrap().unwrap_err();
        assert!(other.contains("gpu-1"), "{other}");
        let empty = Ladder { steps: vec![], current: 0, ..good.clone() };
        assert!(ladder_on(&on("gpu-1", &empty)).unwrap().unwrap_err().contains("no steps"));
        let past = Ladder { current: 3, ..good.clone() };
        assert!(ladder_on(&on("gpu-1", &past)).unwrap().unwrap_err().contains("past"));
        let bare: Node = serde_json::from_value(json!({ "metadata": { "name": "gpu-1" } })).unwrap();
        assert_eq!(ladder_on(&bare), None);
    }
}
