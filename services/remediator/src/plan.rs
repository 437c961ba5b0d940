//! The planner: given a node as it is and a [`Remediation`], decide the exact changes, or say
//! why there are none. Pure: no clock, no I/O; the Kubernetes edge ([`crate::apply`]) carries the
//! plan out and the safety gate ([`crate::safety`]) is consulted through a closure only when the
//! plan would put a node into quarantine.
//!
//! Ownership is recorded on the node itself, in the [`APPLIED_ANNOTATION`] (JSON [`Applied`]):
//! exactly the conditions, taints, labels and cordon gpumedic put there, and every open incident
//! gpumedic acts on for the node with what it asked for ([`Claim`]). Recovery removes only what
//! that record names, so an operator's taint, label, condition or cordon is never touched, and
//! only what no remaining incident still needs: a node leaves quarantine when its last
//! quarantining incident recovers, whatever order the incidents close in.
//! Planning compares the wanted state with the node's actual state, so a request applied twice
//! (or half-applied before a crash) yields only the missing changes, and none the second time.

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::Node;
use serde::{Deserialize, Serialize};

use crate::request::{Action, GpuRef, Remediation};

/// The taint gpumedic puts on a quarantined node; its value is the subsystem.
pub const TAINT_KEY: &str = "gpumedic.io/unhealthy";
/// The label that shows where a node is in gpumedic's remediation walk.
pub const STATE_LABEL: &str = "gpumedic.io/state";
/// The annotation holding the [`Applied`] record.
pub const APPLIED_ANNOTATION: &str = "gpumedic.io/applied";
/// A node with this label set to `true` is left alone (except to remove what gpumedic applied).
pub const OPT_OUT_LABEL: &str = "gpumedic.io/opt-out";
/// The reason on a condition gpumedic clears on recovery.
pub const RECOVERED_REASON: &str = "GpumedicRecovered";

/// How far the remediator may go, from configuration.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Mode {
    /// Decide and report what would be done; change nothing.
    MonitorOnly,
    /// Conditions, taints, labels, cordon and drain; no repair hooks.
    CordonDrain,
    /// Everything, including repair hooks after the drain.
    FullRemediation,
}

/// The taint effect gpumedic uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum, Serialize, Deserialize)]
pub enum TaintEffect {
    /// New pods are not scheduled; running pods stay until drained.
    NoSchedule,
    /// Running pods without a toleration are evicted by the taint manager too.
    NoExecute,
}

impl TaintEffect {
    /// The effect as Kubernetes spells it.
    pub fn as_str(self) -> &'static str {
        match self {
            TaintEffect::NoSchedule => "NoSchedule",
            TaintEffect::NoExecute => "NoExecute",
        }
    }
}

/// The switches that shape every plan.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Policy {
    /// How far the remediator may go.
    pub mode: Mode,
    /// The global pause: nothing is changed while it is set, recoveries included, because an
    /// operator pauses to freeze the fleet while they look.
    pub paused: bool,
    /// Evict only the pods on the faulty GPU when the request names one.
    pub partial_drain: bool,
    /// The effect of gpumedic's taint.
    pub taint_effect: TaintEffect,
}

impl Default for Policy {
    fn default() -> Self {
        Self { mode: Mode::CordonDrain, paused: false, partial_drain: false, taint_effect: TaintEffect::NoSchedule }
    }
}

/// Where a node is in gpumedic's remediation walk, as shown by [`STATE_LABEL`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
pub enum State {
    /// Marked and out of scheduling.
    Quarantined,
    /// Pods are being evicted.
    Draining,
    /// Every pod that had to leave has left.
    Drained,
    /// A repair hook is working on the node.
    Remediating,
    /// The repair succeeded; waiting for healthy evidence to return the node.
    Remediated,
    /// Healthy evidence arrived; a validation (Job or repair hook) decides whether the node returns.
    Validating,
    /// The validation passed; the node stays out until it has had no new fault for the burn-in
    /// period (`--validation-burn-in`).
    BurnIn,
    /// The repair failed; an operator must act.
    Failed,
}

impl State {
    /// The label value.
    pub fn as_str(self) -> &'static str {
        match self {
            State::Quarantined => "quarantined",
            State::Draining => "draining",
            State::Drained => "drained",
            State::Remediating => "remediating",
            State::Remediated => "remediated",
            State::Validating => "validating",
            State::BurnIn => "burn-in",
            State::Failed => "failed",
        }
    }

    /// Parses a label value.
    pub fn parse(value: &str) -> Option<State> {
        [
            State::Quarantined,
            State::Draining,
            State::Drained,
            State::Remediating,
            State::Remediated,
            State::Validating,
            State::BurnIn,
            State::Failed,
        ]
        .into_iter()
        .find(|s| s.as_str() == value)
    }

    /// Whether the drain is behind the node at this state.
    fn drained(self) -> bool {
        self >= State::Drained
    }
}

/// A taint's identity: Kubernetes allows one taint per key and effect.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
pub struct TaintKey {
    /// The key.
    pub key: String,
    /// The effect.
    pub effect: String,
}

/// A taint as the planner sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Taint {
    /// The key.
    pub key: String,
    /// The value, if any.
    pub value: Option<String>,
    /// The effect.
    pub effect: String,
}

impl Taint {
    fn identity(&self) -> TaintKey {
        TaintKey { key: self.key.clone(), effect: self.effect.clone() }
    }
}

/// A node condition as the planner sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Condition {
    /// The condition type.
    pub type_: String,
    /// `True`, `False` or `Unknown`.
    pub status: String,
    /// The reason.
    pub reason: Option<String>,
    /// The message.
    pub message: Option<String>,
}

/// The parts of a Node the planner reads.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct NodeView {
    /// The node's name.
    pub name: String,
    /// Its labels.
    pub labels: BTreeMap<String, String>,
    /// Its annotations.
    pub annotations: BTreeMap<String, String>,
    /// Its taints.
    pub taints: Vec<Taint>,
    /// `spec.unschedulable` (cordoned).
    pub unschedulable: bool,
    /// Its status conditions.
    pub conditions: Vec<Condition>,
}

impl NodeView {
    /// Reads the planner's view out of a Node object.
    pub fn from_node(node: &Node) -> Self {
        let spec = node.spec.as_ref();
        Self {
            name: node.metadata.name.clone().unwrap_or_default(),
            labels: node.metadata.labels.clone().unwrap_or_default(),
            annotations: node.metadata.annotations.clone().unwrap_or_default(),
            taints: spec
                .and_then(|s| s.taints.as_ref())
                .map(|ts| {
                    ts.iter()
                        .map(|t| Taint { key: t.key.clone(), value: t.value.clone(), effect: t.effect.clone() })
                        .collect()
                })
                .unwrap_or_default(),
            unschedulable: spec.and_then(|s| s.unschedulable).unwrap_or(false),
            conditions: node
                .status
                .as_ref()
                .and_then(|s| s.conditions.as_ref())
                .map(|cs| {
                    cs.iter()
                        .map(|c| Condition {
                            type_: c.type_.clone(),
                            status: c.status.clone(),
                            reason: c.reason.clone(),
                            message: c.message.clone(),
                        })
                        .collect()
                })
                .unwrap_or_default(),
        }
    }

    /// The ownership record, if gpumedic has applied anything, in its current form (see
    /// [`Applied::upgraded`]).
    pub fn applied(&self) -> Result<Option<Applied>, serde_json::Error> {
        self.annotations.get(APPLIED_ANNOTATION).map(|raw| serde_json::from_str(raw).map(Applied::upgraded)).transpose()
    }

    /// The state label, when it holds a known state.
    pub fn state(&self) -> Option<State> {
        self.labels.get(STATE_LABEL).and_then(|v| State::parse(v))
    }

    fn condition(&self, type_: &str) -> Option<&Condition> {
        self.conditions.iter().find(|c| c.type_ == type_)
    }

    fn has_taint(&self, id: &TaintKey) -> bool {
        self.taints.iter().any(|t| t.key == id.key && t.effect == id.effect)
    }

    fn opted_out(&self) -> bool {
        self.labels.get(OPT_OUT_LABEL).is_some_and(|v| v == "true")
    }
}

/// Exactly what gpumedic applied to a node, stored as JSON in [`APPLIED_ANNOTATION`].
///
/// The record is additive over its first, single-incident form (`incidentId` and the applied
/// parts only): that form still reads, as one open incident (see [`NodeView::applied`]), and the
/// fields it had keep their meaning, so a reader that knows only them still finds the incident
/// that holds the node in `incidentId`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Applied {
    /// The incident that holds the node: the latest quarantining incident to act on it, else the
    /// latest incident. Every open incident is in [`Applied::incidents`].
    pub incident_id: String,
    /// True when gpumedic set `spec.unschedulable`; false when the node was already cordoned by
    /// someone else (then recovery leaves the cordon alone) or the operator has uncordoned it.
    pub cordoned: bool,
    /// The taints gpumedic added.
    #[serde(default)]
    pub taints: Vec<TaintKey>,
    /// The label keys gpumedic set.
    #[serde(default)]
    pub labels: Vec<String>,
    /// The condition types gpumedic set to `True`.
    #[serde(default)]
    pub conditions: Vec<String>,
    /// An operator uncordoned the node while it was held: gpumedic does not take it out of
    /// scheduling again until a new quarantining incident (new evidence) arrives.
    #[serde(default)]
    pub operator_uncordoned: bool,
    /// Every open incident gpumedic acts on for the node, by incident id, with what it asked for.
    /// Empty only in a record of the single-incident form, before [`Applied::upgraded`].
    #[serde(default)]
    pub incidents: BTreeMap<String, Claim>,
}

/// What one open incident asked of a node, as [`Applied::incidents`] records it.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Claim {
    /// The incident asked for the node to be taken out of scheduling (cordon or more). It stays
    /// set until the incident recovers: a milder verdict later does not release the node.
    pub quarantines: bool,
    /// The node condition type of the incident's subsystem (`GpuUnhealthy`, ...); empty when
    /// read from a single-incident record that named no condition.
    #[serde(default)]
    pub condition: String,
    /// The incident's latest reason (`Xid79`); empty when read from a single-incident record,
    /// which did not keep it.
    #[serde(default)]
    pub reason: String,
    /// The incident's latest verdict carried out on the node (its id), whether from the verdict
    /// topic or re-issued by the resync; empty in records written before it was kept. The same
    /// verdict delivered again is then handled as a re-issue: it was carried out already.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub verdict: String,
}

impl Applied {
    /// Whether this record holds the node out of scheduling.
    pub fn quarantines(&self) -> bool {
        self.cordoned || !self.taints.is_empty()
    }

    /// The record in its current form: a single-incident record (no `incidents`) becomes one
    /// open incident, `incident_id`, which quarantines when the record shows a quarantine
    /// (cordon, taint, state label) and claims the condition recorded last.
    pub fn upgraded(mut self) -> Self {
        if self.incidents.is_empty() && !self.incident_id.is_empty() {
            let claim = Claim {
                quarantines: self.quarantines() || self.labels.iter().any(|l| l == STATE_LABEL),
                condition: self.conditions.last().cloned().unwrap_or_default(),
                reason: String::new(),
                verdict: String::new(),
            };
            self.incidents.insert(self.incident_id.clone(), claim);
        }
        self
    }

    /// Whether an open incident asked for the node to be out of scheduling.
    pub fn wants_quarantine(&self) -> bool {
        self.incidents.values().any(|c| c.quarantines)
    }

    /// The open incidents for humans: `i1 (Xid79), i2 (EccContained)`, quarantining ones first.
    pub fn describe_incidents(&self) -> String {
        let mut ids: Vec<(&String, &Claim)> = self.incidents.iter().collect();
        ids.sort_by_key(|(_, c)| !c.quarantines);
        ids.iter()
            .map(|(id, c)| if c.reason.is_empty() { (*id).clone() } else { format!("{id} ({})", c.reason) })
            .collect::<Vec<_>>()
            .join(", ")
    }

    /// The record without the verdict ids of its claims: what a write is worth making for.
    fn without_verdicts(&self) -> Self {
        let mut r = self.clone();
        r.incidents.values_mut().for_each(|c| c.verdict.clear());
        r
    }

    /// The incident that holds the node now: the first quarantining one, else the first one.
    fn holder(&self) -> Option<&String> {
        self.incidents.iter().find(|(_, c)| c.quarantines).or_else(|| self.incidents.iter().next()).map(|(id, _)| id)
    }
}

/// A condition gpumedic sets.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConditionChange {
    /// The condition type (one per [`Subsystem`]).
    pub type_: String,
    /// True when the problem is present.
    pub problem: bool,
    /// The reason, such as `Xid79`.
    pub reason: String,
    /// The message for humans.
    pub message: String,
    /// Whether the status flips, so `lastTransitionTime` must move.
    pub transition: bool,
}

/// What the drain should cover.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DrainScope {
    /// Only the pods on this GPU (partial drain); all pods when `None`.
    pub gpu: Option<GpuRef>,
}

/// A Kubernetes Event to record on the node.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Note {
    /// A CamelCase reason (`Cordoned`, `Tainted`, ...).
    pub reason: String,
    /// A sentence for `kubectl describe node`.
    pub message: String,
    /// Warning rather than Normal.
    pub warning: bool,
    /// True when the note is about a condition, written through the status subresource before
    /// the rest of the plan; the edge records it even when the rest loses a race.
    pub on_status: bool,
}

impl Note {
    /// A Normal Event about an object change.
    pub fn normal(reason: &str, message: String) -> Self {
        Self { reason: reason.to_owned(), message, warning: false, on_status: false }
    }

    /// A Warning Event about an object change.
    pub fn warning(reason: &str, message: String) -> Self {
        Self { reason: reason.to_owned(), message, warning: true, on_status: false }
    }

    fn condition(message: String) -> Self {
        Self { reason: "ConditionSet".to_owned(), message, warning: true, on_status: true }
    }
}

/// Why a plan quarantines, marks or restores the node.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Intent {
    /// Take the node out of scheduling (and maybe drain it).
    Quarantine,
    /// Only mark the node (condition), or respect an operator's uncordon.
    Mark,
    /// Undo what gpumedic applied.
    Recover,
}

/// The exact changes to make to one node.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Plan {
    /// The node.
    pub node: String,
    /// What the plan is for.
    pub intent: Intent,
    /// Conditions to set, each merged by type so other conditions are untouched.
    pub conditions: Vec<ConditionChange>,
    /// Taints to add.
    pub add_taints: Vec<Taint>,
    /// Taints to remove (only ones gpumedic added).
    pub remove_taints: Vec<TaintKey>,
    /// Labels to set.
    pub set_labels: BTreeMap<String, String>,
    /// Labels to remove (only ones gpumedic set).
    pub remove_labels: Vec<String>,
    /// `Some(true)` to cordon, `Some(false)` to uncordon, `None` to leave `spec.unschedulable`.
    pub cordon: Option<bool>,
    /// Evict pods after the node is marked.
    pub drain: Option<DrainScope>,
    /// The repair hook to run after the drain (full-remediation mode only).
    pub repair: Option<Action>,
    /// The new ownership record, written when `applied_changed`; `None` then removes the annotation.
    pub applied: Option<Applied>,
    /// Whether the ownership annotation changes.
    pub applied_changed: bool,
    /// Events to record, one per action.
    pub notes: Vec<Note>,
    /// True when this plan takes a node into quarantine that gpumedic did not hold: counts
    /// against the circuit breaker and the rate limit.
    pub new_quarantine: bool,
    /// The DeviceTaintRule that quarantines the faulty GPU alone (DRA clusters), when the edge
    /// took the GPU out instead of the node (see [`crate::dra`]); the planner never sets it.
    pub gpu_rule: Option<String>,
}

impl Plan {
    pub(crate) fn new(node: &str, intent: Intent) -> Self {
        Self {
            node: node.to_owned(),
            intent,
            conditions: Vec::new(),
            add_taints: Vec::new(),
            remove_taints: Vec::new(),
            set_labels: BTreeMap::new(),
            remove_labels: Vec::new(),
            cordon: None,
            drain: None,
            repair: None,
            applied: None,
            applied_changed: false,
            notes: Vec::new(),
            new_quarantine: false,
            gpu_rule: None,
        }
    }

    /// Whether the plan changes anything.
    pub fn is_empty(&self) -> bool {
        self.conditions.is_empty()
            && self.add_taints.is_empty()
            && self.remove_taints.is_empty()
            && self.set_labels.is_empty()
            && self.remove_labels.is_empty()
            && self.cordon.is_none()
            && self.drain.is_none()
            && self.repair.is_none()
            && !self.applied_changed
    }

    /// Whether the plan touches metadata or spec (one patch on the Node object).
    pub fn changes_object(&self) -> bool {
        !(self.add_taints.is_empty()
            && self.remove_taints.is_empty()
            && self.set_labels.is_empty()
            && self.remove_labels.is_empty()
            && self.cordon.is_none()
            && !self.applied_changed)
    }
}

/// Whether the safety gate lets a new quarantine through.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Admission {
    /// Go ahead.
    Allowed,
    /// The circuit breaker is open; the text says why.
    BreakerOpen(String),
    /// The rate limit on new quarantines is spent; the text says when it frees up.
    RateLimited(String),
}

/// Why a request leads to no change.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Skip {
    /// The request asks for nothing.
    NoAction,
    /// Monitor-only mode: the plan is reported, not applied.
    MonitorOnly,
    /// The global pause is set.
    Paused,
    /// The node carries the opt-out label.
    OptedOut,
    /// The circuit breaker refused a new quarantine.
    BreakerOpen(String),
    /// The rate limit refused a new quarantine.
    RateLimited(String),
    /// Recovery asked for a node gpumedic has not changed.
    NothingApplied,
    /// Recovery for an incident gpumedic does not act on for the node: it recovered already, or
    /// its fault was never applied (stale, refused, or before the record was removed by hand).
    OtherIncident {
        /// The open incidents gpumedic acts on for the node, for humans.
        active: String,
    },
    /// The ownership annotation cannot be read; gpumedic will not guess what it owns.
    UnreadableRecord(String),
    /// The verdict is older than the remediator acts on (its age).
    Stale(std::time::Duration),
    /// The node does not match the GPU node selector (or no longer exists).
    Unmanaged,
    /// A fault verdict of an incident that has recovered already (a replay): acting on it would
    /// take a healthy node out again.
    Recovered,
    /// The node is marked now and the rest waits for what this says (a maintenance window's
    /// opening, the verdict's `not_before`, an idle GPU).
    Deferred(String),
    /// The recovery waits for the validation this names (`Job ns/name`, `webhook call <key>`,
    /// `resource <name>`) to pass.
    Validating(String),
    /// The node failed its validation and its repair ladder has ended without a repair proven
    /// since: the recovery does not return it; an operator does.
    ValidationFailed,
}

impl std::fmt::Display for Skip {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Skip::NoAction => f.write_str("the verdict asks for no action"),
            Skip::MonitorOnly => f.write_str("the remediator runs in monitor-only mode"),
            Skip::Paused => f.write_str("remediation is paused"),
            Skip::OptedOut => write!(f, "the node is labelled {OPT_OUT_LABEL}=true"),
            Skip::BreakerOpen(why) => write!(f, "the circuit breaker is open: {why}"),
            Skip::RateLimited(why) => write!(f, "the quarantine rate limit is reached: {why}"),
            Skip::NothingApplied => f.write_str("gpumedic has applied nothing to the node"),
            Skip::OtherIncident { active } => {
                write!(f, "the incident is not one gpumedic acts on for the node (open: {active})")
            }
            Skip::UnreadableRecord(e) => write!(f, "the {APPLIED_ANNOTATION} annotation cannot be read: {e}"),
            Skip::Stale(age) => write!(f, "the verdict is stale (issued {}s ago)", age.as_secs()),
            Skip::Unmanaged => {
                f.write_str("the node is not a managed GPU node (it does not match the GPU node selector)")
            }
            Skip::Recovered => f.write_str("the incident has recovered already; this fault verdict is a replay"),
            Skip::Deferred(waits_for) => write!(f, "the node is marked now; the action waits for {waits_for}"),
            Skip::Validating(what) => {
                write!(f, "the node returns to service only once the validation {what} passes")
            }
            Skip::ValidationFailed => f.write_str(
                "the node failed its validation and its repair ladder has ended: it stays out until an operator acts",
            ),
        }
    }
}

/// The planner's answer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Decision {
    /// Make these changes.
    Apply(Box<Plan>),
    /// The node already reflects the request: nothing to do.
    AlreadyDone,
    /// Nothing will be done, and why; `would` holds the plan a mode or switch held back.
    Nothing {
        /// Why.
        reason: Skip,
        /// The plan that would have been applied, when one was computed.
        would: Option<Box<Plan>>,
    },
}

impl Decision {
    fn nothing(reason: Skip) -> Self {
        Decision::Nothing { reason, would: None }
    }
}

/// Decides what to do with `request` on `node`. `admit` is called only when the plan would take
/// a node into quarantine that gpumedic does not already hold, so the breaker and rate limit
/// count exactly the new quarantines; it is never called for recoveries or in monitor-only mode.
pub fn plan(node: &NodeView, request: &Remediation, policy: &Policy, admit: &mut dyn FnMut() -> Admission) -> Decision {
    if request.action == Action::None && !request.recovery {
        return Decision::nothing(Skip::NoAction);
    }
    if policy.paused {
        return Decision::nothing(Skip::Paused);
    }
    let applied = match node.applied() {
        Ok(a) => a,
        Err(e) => return Decision::nothing(Skip::UnreadableRecord(e.to_string())),
    };
    let decision = if request.recovery {
        plan_recovery(node, request, applied)
    } else if node.opted_out() {
        // Checked after recovery on purpose: removing gpumedic's own marks from a node that opted
        // out later is what the operator wants.
        return Decision::nothing(Skip::OptedOut);
    } else {
        plan_fault(node, request, policy, applied)
    };
    let plan = match decision {
        Ok(plan) if plan.is_empty() => return Decision::AlreadyDone,
        Ok(plan) => plan,
        Err(skip) => return Decision::nothing(skip),
    };
    if policy.mode == Mode::MonitorOnly {
        return Decision::Nothing { reason: Skip::MonitorOnly, would: Some(Box::new(plan)) };
    }
    if plan.new_quarantine {
        match admit() {
            Admission::Allowed => {}
            Admission::BreakerOpen(why) => {
                return Decision::Nothing { reason: Skip::BreakerOpen(why), would: Some(Box::new(plan)) };
            }
            Admission::RateLimited(why) => {
                return Decision::Nothing { reason: Skip::RateLimited(why), would: Some(Box::new(plan)) };
            }
        }
    }
    Decision::Apply(Box::new(plan))
}

fn plan_fault(node: &NodeView, request: &Remediation, policy: &Policy, applied: Option<Applied>) -> Result<Plan, Skip> {
    let held = applied.as_ref().is_some_and(Applied::quarantines);
    let before = applied.clone();
    let mut record = applied.unwrap_or_default();
    let wants_quarantine = request.action.quarantines();
    let type_ = request.subsystem.condition_type();
    // A new quarantining incident on a node gpumedic already marked is new evidence: it clears an
    // earlier manual uncordon. A known incident, or one that only marks, leaves it.
    if wants_quarantine && !record.incidents.contains_key(&request.incident_id) {
        record.operator_uncordoned = false;
    }
    let claim = record.incidents.entry(request.incident_id.clone()).or_default();
    // This very verdict was carried out on the node already (the resync re-issued it from the
    // incident store before the verdict topic delivered it, or it is delivered again after a
    // restart): it is handled as the re-issue it is, so it neither rewrites the condition another
    // incident wrote since nor takes the node over, and reports nothing applied twice.
    let reissue = request.reissue || (!claim.verdict.is_empty() && claim.verdict == request.verdict_id);
    request.verdict_id.clone_into(&mut claim.verdict);
    claim.quarantines |= wants_quarantine;
    type_.clone_into(&mut claim.condition);
    claim.reason.clone_from(&request.reason);
    let claims_quarantine = claim.quarantines;
    // `incident_id` names the incident that holds the node, so a marking incident does not take
    // it over from a quarantining one.
    // A resync's re-issue moves nothing: two open incidents re-issued in turn would otherwise
    // take the holder from each other at every pass.
    let holder_quarantines = record.incidents.get(&record.incident_id).is_some_and(|c| c.quarantines);
    if !(reissue && record.incidents.contains_key(&record.incident_id)) && (claims_quarantine || !holder_quarantines) {
        record.incident_id.clone_from(&request.incident_id);
    }
    let mut plan = Plan::new(
        &node.name,
        if wants_quarantine && !record.operator_uncordoned { Intent::Quarantine } else { Intent::Mark },
    );

    // The condition is set whatever else happens: it is information, not an action on workloads.
    let current = node.condition(type_);
    let up_to_date = current.is_some_and(|c| {
        c.status == "True"
            && (reissue
                || (c.reason.as_deref() == Some(request.reason.as_str())
                    && c.message.as_deref() == Some(request.message.as_str())))
    });
    if !up_to_date {
        let transition = current.is_none_or(|c| c.status != "True");
        plan.conditions.push(ConditionChange {
            type_: type_.to_owned(),
            problem: true,
            reason: request.reason.clone(),
            message: request.message.clone(),
            transition,
        });
        plan.notes.push(Note::condition(format!(
            "{type_}=True ({}): {} [incident {}]",
            request.reason, request.message, request.incident_id
        )));
    }
    if !record.conditions.iter().any(|c| c == type_) {
        record.conditions.push(type_.to_owned());
    }

    // gpumedic cordoned this node and finds it schedulable: an operator uncordoned it. Respect
    // that for the rest of the incident, and drop gpumedic's taint too, because the operator's
    // intent is that the node takes work again.
    if record.cordoned && !node.unschedulable {
        record.cordoned = false;
        record.operator_uncordoned = true;
        for id in std::mem::take(&mut record.taints) {
            if node.has_taint(&id) {
                plan.remove_taints.push(id);
            }
        }
        plan.notes.push(Note::normal(
            "ManualUncordonRespected",
            format!(
                "An operator uncordoned the node during incident {}; gpumedic will not cordon it again until \
                 new evidence arrives",
                record.incident_id
            ),
        ));
    }

    if wants_quarantine && !record.operator_uncordoned {
        plan_quarantine(node, request, policy, &mut record, &mut plan);
        plan.new_quarantine = !held && (plan.cordon.is_some() || !plan.add_taints.is_empty());
    }
    if policy.mode == Mode::FullRemediation && request.action == Action::Custom && request.custom.is_some() {
        plan_custom(node, request, &mut plan);
    }

    // A new verdict id alone is not worth a write; it is recorded with whatever else is written.
    plan.applied_changed = before.as_ref().map(Applied::without_verdicts) != Some(record.without_verdicts());
    if !plan.is_empty() && before.as_ref() != Some(&record) {
        plan.applied_changed = true;
    }
    plan.applied = Some(record);
    Ok(plan)
}

fn plan_quarantine(node: &NodeView, request: &Remediation, policy: &Policy, record: &mut Applied, plan: &mut Plan) {
    let taint = Taint {
        key: TAINT_KEY.to_owned(),
        value: Some(request.subsystem.as_str().to_owned()),
        effect: policy.taint_effect.as_str().to_owned(),
    };
    let id = taint.identity();
    if !node.has_taint(&id) {
        plan.notes
            .push(Note::normal("Tainted", format!("Added taint {}={}:{}", taint.key, request.subsystem, taint.effect)));
        plan.add_taints.push(taint);
        if !record.taints.contains(&id) {
            record.taints.push(id);
        }
    }
    if !node.unschedulable {
        plan.cordon = Some(true);
        record.cordoned = true;
        plan.notes.push(Note::normal("Cordoned", format!("Cordoned for incident {}", request.incident_id)));
    }
    // A cordon someone else set is left unrecorded, so recovery never lifts it.

    let current = node.state();
    let drain_done = current.is_some_and(State::drained);
    let wanted = if request.action.drains() && !drain_done {
        State::Draining
    } else {
        // Never walk the state backwards on a repeated or milder request.
        current.unwrap_or(State::Quarantined)
    };
    if current != Some(wanted) {
        plan.set_labels.insert(STATE_LABEL.to_owned(), wanted.as_str().to_owned());
    }
    if !record.labels.iter().any(|l| l == STATE_LABEL) {
        record.labels.push(STATE_LABEL.to_owned());
    }
    if request.action.drains() && !drain_done {
        let gpu = if policy.partial_drain { request.gpu.clone() } else { None };
        plan.drain = Some(DrainScope { gpu });
    }
    if policy.mode == Mode::FullRemediation && request.action.repairs() && current < Some(State::Remediating) {
        plan.repair = Some(request.action);
    }
}

/// A custom action runs once per incident, through the repair hooks, as a ladder of its own
/// (see [`crate::ladder::Ladder::custom`]); a node already on a ladder (this incident's, finished
/// or not, or another's repair) starts none, and says why when it is another's.
fn plan_custom(node: &NodeView, request: &Remediation, plan: &mut Plan) {
    let Some(raw) = node.annotations.get(crate::ladder::LADDER_ANNOTATION) else {
        plan.repair = Some(Action::Custom);
        return;
    };
    let holder = serde_json::from_str::<crate::ladder::Ladder>(raw).ok().map(|l| l.request.incident_id);
    if holder.as_deref() != Some(request.incident_id.as_str()) {
        plan.notes.push(Note::normal(
            "CustomActionHeld",
            format!(
                "The custom action {} of incident {} waits: the node is on the repair ladder of incident {}",
                request.custom.as_deref().unwrap_or_default(),
                request.incident_id,
                holder.as_deref().unwrap_or("(unreadable)")
            ),
        ));
    }
}

fn plan_recovery(node: &NodeView, request: &Remediation, applied: Option<Applied>) -> Result<Plan, Skip> {
    let Some(mut record) = applied else {
        return Err(Skip::NothingApplied);
    };
    let Some(recovered) = record.incidents.remove(&request.incident_id) else {
        return Err(Skip::OtherIncident { active: record.incidents.keys().cloned().collect::<Vec<_>>().join(", ") });
    };
    let mut plan = Plan::new(&node.name, Intent::Recover);
    let last = record.incidents.is_empty();

    // A condition goes back to False only when no remaining incident uses it; once the last
    // incident recovers, every condition gpumedic set goes (a single-incident record may have
    // named more than its incident's own).
    let in_use = |type_: &str| record.incidents.values().any(|c| c.condition == type_);
    let clear: Vec<String> =
        record.conditions.iter().filter(|t| last || (**t == recovered.condition && !in_use(t))).cloned().collect();
    for type_ in &clear {
        if node.condition(type_).is_some_and(|c| c.status == "True") {
            plan.conditions.push(ConditionChange {
                type_: type_.clone(),
                problem: false,
                reason: RECOVERED_REASON.to_owned(),
                message: format!("Healthy again: {}", request.message),
                transition: true,
            });
        }
    }
    record.conditions.retain(|t| !clear.contains(t));
    // A condition the recovered incident shares with an open one keeps saying True, with the
    // open incident's reason rather than the recovered one's.
    if !clear.contains(&recovered.condition)
        && let Some(current) = node.condition(&recovered.condition).filter(|c| c.status == "True")
        && let Some((id, open)) =
            record.incidents.iter().find(|(_, c)| c.condition == recovered.condition && !c.reason.is_empty())
        && current.reason.as_deref() != Some(open.reason.as_str())
    {
        plan.conditions.push(ConditionChange {
            type_: recovered.condition.clone(),
            problem: true,
            reason: open.reason.clone(),
            message: format!(
                "Incident {id} ({}) is still open; incident {} recovered",
                open.reason, request.incident_id
            ),
            transition: false,
        });
    }

    // The cordon, taint and state label go only when no remaining incident quarantines.
    let stays_quarantined = record.wants_quarantine();
    if !stays_quarantined {
        plan.remove_taints = record.taints.iter().filter(|id| node.has_taint(id)).cloned().collect();
        plan.remove_labels = record.labels.iter().filter(|l| node.labels.contains_key(*l)).cloned().collect();
        if record.cordoned && node.unschedulable {
            plan.cordon = Some(false);
        }
        record.taints.clear();
        record.labels.clear();
        record.cordoned = false;
    }

    let uncordoned = if plan.cordon == Some(false) { " and uncordoned" } else { "" };
    let message = if last {
        format!(
            "Incident {} recovered ({}); removed what gpumedic applied{uncordoned}",
            request.incident_id, request.reason
        )
    } else if stays_quarantined {
        format!(
            "Incident {} recovered ({}); the node stays quarantined for open incident(s) {}",
            request.incident_id,
            request.reason,
            record.describe_incidents()
        )
    } else {
        let released = !plan.remove_taints.is_empty() || !plan.remove_labels.is_empty() || plan.cordon.is_some();
        format!(
            "Incident {} recovered ({}); {}open incident(s) {} still mark the node",
            request.incident_id,
            request.reason,
            if released { format!("lifted gpumedic's quarantine{uncordoned}; ") } else { String::new() },
            record.describe_incidents()
        )
    };
    plan.notes.push(Note::normal("Recovered", message));

    if last {
        plan.applied = None;
    } else {
        // The holder stays unless it recovered, or it only marks while another quarantines.
        if !record.incidents.get(&record.incident_id).is_some_and(|c| c.quarantines || !stays_quarantined) {
            record.incident_id = record.holder().cloned().unwrap_or_default();
        }
        plan.applied = Some(record);
    }
    plan.applied_changed = true;
    Ok(plan)
}

/// The plan that moves the state label to `to` after a step (drain, repair) finished; `None`
/// when gpumedic does not own the label or it already reads `to`.
pub fn advance(node: &NodeView, to: State) -> Option<Plan> {
    let record = node.applied().ok().flatten()?;
    if !record.labels.iter().any(|l| l == STATE_LABEL) || node.state() == Some(to) {
        return None;
    }
    let mut plan = Plan::new(&node.name, Intent::Quarantine);
    plan.set_labels.insert(STATE_LABEL.to_owned(), to.as_str().to_owned());
    Some(plan)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::request::Subsystem;

    fn request(action: Action) -> Remediation {
        Remediation {
            node: "gpu-1".into(),
            gpu: Some(GpuRef { uuid: "GPU-abc".into(), pci_bus_id: "0000:3b:00.0".into(), index: Some(0) }),
            action,
            subsystem: Subsystem::Gpu,
            reason: "Xid79".into(),
            message: "GPU has fallen off the bus".into(),
            verdict_id: "v1".into(),
            incident_id: "i1".into(),
            recovery: false,
            reissue: false,
            custom: None,
        }
    }

    fn node() -> NodeView {
        NodeView { name: "gpu-1".into(), ..NodeView::default() }
    }

    fn allow() -> impl FnMut() -> Admission {
        || Admission::Allowed
    }

    fn apply_plan(view: &mut NodeView, plan: &Plan) {
        for c in &plan.conditions {
            view.conditions.retain(|x| x.type_ != c.type_);
            view.conditions.push(Condition {
                type_: c.type_.clone(),
                status: if c.problem { "True" } else { "False" }.into(),
                reason: Some(c.reason.clone()),
                message: Some(c.message.clone()),
            });
        }
        view.taints.retain(|t| !plan.remove_taints.contains(&t.identity()));
        view.taints.extend(plan.add_taints.iter().cloned());
        for (k, v) in &plan.set_labels {
            view.labels.insert(k.clone(), v.clone());
        }
        for k in &plan.remove_labels {
            view.labels.remove(k);
        }
        if let Some(c) = plan.cordon {
            view.unschedulable = c;
        }
        match (&plan.applied, plan.applied_changed) {
            (_, false) => None,
            (Some(a), true) => view.annotations.insert(APPLIED_ANNOTATION.into(), serde_json::to_string(a).unwrap()),
            (None, true) => view.annotations.remove(APPLIED_ANNOTATION),
        };
    }

    fn must_apply(d: Decision) -> Plan {
        match d {
            Decision::Apply(p) => *p,
            other => panic!("expected a plan, got {other:?}"),
        }
    }

    #[test]
    fn drain_request_marks_taints_cordons_and_drains() {
        let p = must_apply(plan(&node(), &request(Action::Drain), &Policy::default(), &mut allow()));
        assert_eq!(p.conditions[0].type_, "GpuUnhealthy");
        assert!(p.conditions[0].problem && p.conditions[0].transition);
        assert_eq!(p.add_taints[0].key, TAINT_KEY);
        assert_eq!(p.add_taints[0].value.as_deref(), Some("gpu"));
        assert_eq!(p.add_taints[0].effect, "NoSchedule");
        assert_eq!(p.cordon, Some(true));
        assert_eq!(p.set_labels.get(STATE_LABEL).map(String::as_str), Some("draining"));
        assert_eq!(p.drain, Some(DrainScope { gpu: None }));
        assert!(p.new_quarantine);
        let rec = p.applied.unwrap();
        assert!(rec.cordoned);
        assert_eq!(rec.taints, vec![TaintKey { key: TAINT_KEY.into(), effect: "NoSchedule".into() }]);
        assert_eq!(rec.labels, vec![STATE_LABEL.to_owned()]);
        assert_eq!(rec.conditions, vec!["GpuUnhealthy".to_owned()]);
        let reasons: Vec<_> = p.notes.iter().map(|n| n.reason.as_str()).collect();
        assert_eq!(reasons, ["ConditionSet", "Tainted", "Cordoned"]);
    }

    #[test]
    fn the_same_request_twice_is_already_done() {
        let mut view = node();
        let req = request(Action::Cordon);
        let p = must_apply(plan(&view, &req, &Policy::default(), &mut allow()));
        apply_plan(&mut view, &p);
        let mut calls = 0;
        let d = plan(&view, &req, &Policy::default(), &mut || {
            calls += 1;
            Admission::Allowed
        });
        assert_eq!(d, Decision::AlreadyDone);
        assert_eq!(calls, 0, "an already-held node does not count against the breaker");
    }

    #[test]
    fn drain_is_not_repeated_once_drained() {
        let mut view = node();
        let req = request(Action::Drain);
        let p = must_apply(plan(&view, &req, &Policy::default(), &mut allow()));
        apply_plan(&mut view, &p);
        // Still draining (the drain did not finish): asked again, the drain is retried.
        let again = must_apply(plan(&view, &req, &Policy::default(), &mut allow()));
        assert!(again.drain.is_some() && again.cordon.is_none() && again.add_taints.is_empty());
        let step = advance(&view, State::Drained).unwrap();
        apply_plan(&mut view, &step);
        assert_eq!(view.labels[STATE_LABEL], "drained");
        assert_eq!(plan(&view, &req, &Policy::default(), &mut allow()), Decision::AlreadyDone);
        // A milder request later does not walk the state back.
        assert_eq!(plan(&view, &request(Action::Cordon), &Policy::default(), &mut allow()), Decision::AlreadyDone);
    }

    #[test]
    fn foreign_cordon_is_not_recorded_and_not_lifted_on_recovery() {
        let mut view = NodeView { unschedulable: true, ..node() };
        let p = must_apply(plan(&view, &request(Action::Cordon), &Policy::default(), &mut allow()));
        assert_eq!(p.cordon, None);
        assert!(!p.applied.as_ref().unwrap().cordoned);
        apply_plan(&mut view, &p);
        let rec = Remediation { recovery: true, ..request(Action::None) };
        let r = must_apply(plan(&view, &rec, &Policy::default(), &mut allow()));
        assert_eq!(r.cordon, None, "someone else's cordon stays");
        assert_eq!(r.remove_taints.len(), 1);
        apply_plan(&mut view, &r);
        assert!(view.unschedulable);
        assert!(view.taints.is_empty() && view.annotations.is_empty());
    }

    #[test]
    fn recovery_removes_only_what_gpumedic_applied() {
        let mut view = node();
        view.labels.insert("team".into(), "ml".into());
        view.taints.push(Taint { key: "example.com/maint".into(), value: None, effect: "NoSchedule".into() });
        view.conditions.push(Condition {
            type_: "KernelDeadlock".into(),
            status: "True".into(),
            reason: Some("Hung".into()),
            message: None,
        });
        let before = view.clone();
        let p = must_apply(plan(&view, &request(Action::Drain), &Policy::default(), &mut allow()));
        apply_plan(&mut view, &p);
        let rec = Remediation { recovery: true, reason: "Healthy".into(), ..request(Action::None) };
        let r = must_apply(plan(&view, &rec, &Policy::default(), &mut allow()));
        assert_eq!(r.cordon, Some(false));
        assert_eq!(r.intent, Intent::Recover);
        apply_plan(&mut view, &r);
        assert_eq!(view.labels, before.labels);
        assert_eq!(view.taints, before.taints);
        assert!(!view.unschedulable);
        let gpu = view.conditions.iter().find(|c| c.type_ == "GpuUnhealthy").unwrap();
        assert_eq!((gpu.status.as_str(), gpu.reason.as_deref()), ("False", Some(RECOVERED_REASON)));
        assert_eq!(view.conditions.iter().find(|c| c.type_ == "KernelDeadlock"), before.conditions.first());
        // A second recovery finds nothing to undo.
        assert_eq!(
            plan(&view, &rec, &Policy::default(), &mut allow()),
            Decision::Nothing { reason: Skip::NothingApplied, would: None }
        );
    }

    #[test]
    fn manual_uncordon_is_respected_until_a_new_incident() {
        let mut view = node();
        let req = request(Action::Cordon);
        let p = must_apply(plan(&view, &req, &Policy::default(), &mut allow()));
        apply_plan(&mut view, &p);
        view.unschedulable = false; // the operator's `kubectl uncordon`
        let p = must_apply(plan(&view, &req, &Policy::default(), &mut allow()));
        assert_eq!(p.cordon, None);
        assert!(p.add_taints.is_empty());
        assert_eq!(p.remove_taints.len(), 1, "gpumedic's taint goes with its cordon");
        assert!(p.notes.iter().any(|n| n.reason == "ManualUncordonRespected"));
        let rec = p.applied.clone().unwrap();
        assert!(rec.operator_uncordoned && !rec.cordoned);
        apply_plan(&mut view, &p);
        assert_eq!(plan(&view, &req, &Policy::default(), &mut allow()), Decision::AlreadyDone);
        // A new incident is new evidence.
        let newer = Remediation { incident_id: "i2".into(), ..request(Action::Cordon) };
        let p = must_apply(plan(&view, &newer, &Policy::default(), &mut allow()));
        assert_eq!(p.cordon, Some(true));
        assert!(p.new_quarantine);
    }

    #[test]
    fn opt_out_pause_monitor_only_and_no_action_change_nothing() {
        let req = request(Action::Drain);
        let opted = NodeView { labels: [(OPT_OUT_LABEL.to_owned(), "true".to_owned())].into(), ..node() };
        assert_eq!(
            plan(&opted, &req, &Policy::default(), &mut allow()),
            Decision::Nothing { reason: Skip::OptedOut, would: None }
        );
        let paused = Policy { paused: true, ..Policy::default() };
        assert_eq!(plan(&node(), &req, &paused, &mut allow()), Decision::Nothing { reason: Skip::Paused, would: None });
        let monitor = Policy { mode: Mode::MonitorOnly, ..Policy::default() };
        match plan(&node(), &req, &monitor, &mut || panic!("monitor-only never consults the breaker")) {
            Decision::Nothing { reason: Skip::MonitorOnly, would: Some(p) } => assert_eq!(p.cordon, Some(true)),
            other => panic!("{other:?}"),
        }
        assert_eq!(
            plan(&node(), &request(Action::None), &Policy::default(), &mut allow()),
            Decision::Nothing { reason: Skip::NoAction, would: None }
        );
    }

    #[test]
    fn breaker_and_rate_limit_refuse_new_quarantines_only() {
        let refuse = &mut || Admission::BreakerOpen("3 of 10 GPU nodes".into());
        match plan(&node(), &request(Action::Cordon), &Policy::default(), refuse) {
            Decision::Nothing { reason: Skip::BreakerOpen(_), would: Some(_) } => {}
            other => panic!("{other:?}"),
        }
        // A monitor request marks without quarantining: no admission needed.
        let p = must_apply(plan(&node(), &request(Action::Monitor), &Policy::default(), refuse));
        assert_eq!(p.intent, Intent::Mark);
        assert!(p.cordon.is_none() && p.add_taints.is_empty() && !p.new_quarantine);
        // Recovery is never refused.
        let mut view = node();
        let p = must_apply(plan(&view, &request(Action::Cordon), &Policy::default(), &mut allow()));
        apply_plan(&mut view, &p);
        let rec = Remediation { recovery: true, ..request(Action::None) };
        assert!(matches!(plan(&view, &rec, &Policy::default(), refuse), Decision::Apply(_)));
        let limited = &mut || Admission::RateLimited("60 per minute".into());
        assert!(matches!(
            plan(&node(), &request(Action::Cordon), &Policy::default(), limited),
            Decision::Nothing { reason: Skip::RateLimited(_), .. }
        ));
    }

    #[test]
    fn partial_drain_names_the_gpu_and_full_remediation_adds_the_repair() {
        let policy = Policy { partial_drain: true, mode: Mode::FullRemediation, ..Policy::default() };
        let p = must_apply(plan(&node(), &request(Action::ResetGpu), &policy, &mut allow()));
        assert_eq!(p.drain.unwrap().gpu.unwrap().uuid, "GPU-abc");
        assert_eq!(p.repair, Some(Action::ResetGpu));
        let p = must_apply(plan(&node(), &request(Action::ResetGpu), &Policy::default(), &mut allow()));
        assert_eq!(p.drain, Some(DrainScope { gpu: None }));
        assert_eq!(p.repair, None, "cordon-drain mode narrows repairs to a drain");
    }

    #[test]
    fn a_custom_action_marks_the_node_and_runs_once_in_full_remediation_only() {
        let custom = Remediation { custom: Some("restart-fabric-manager".into()), ..request(Action::Custom) };
        let full = Policy { mode: Mode::FullRemediation, ..Policy::default() };
        let p = must_apply(plan(&node(), &custom, &full, &mut allow()));
        assert_eq!(p.repair, Some(Action::Custom));
        assert_eq!((p.cordon, p.drain.as_ref(), p.add_taints.len()), (None, None, 0), "the node stays in service");
        assert_eq!(p.conditions.len(), 1);
        let p = must_apply(plan(&node(), &custom, &Policy::default(), &mut allow()));
        assert_eq!(p.repair, None, "cordon-drain mode runs no hooks");
        // Once its ladder is on the node, the incident's verdicts start nothing more.
        let mut view = node();
        let mut ladder = crate::ladder::Ladder::custom(
            "v1",
            &Remediation { node: view.name.clone(), ..custom.clone() },
            std::time::Duration::from_secs(60),
            chrono::Utc::now(),
        );
        view.annotations.insert(crate::ladder::LADDER_ANNOTATION.into(), serde_json::to_string(&ladder).unwrap());
        let p = plan(&view, &custom, &full, &mut allow());
        assert!(matches!(&p, Decision::Apply(p) if p.repair.is_none()), "{p:?}");
        // Another incident's ladder holds it back, and the note says so.
        ladder.request.incident_id = "other".into();
        view.annotations.insert(crate::ladder::LADDER_ANNOTATION.into(), serde_json::to_string(&ladder).unwrap());
        let p = must_apply(plan(&view, &custom, &full, &mut allow()));
        assert_eq!(p.repair, None);
        assert!(p.notes.iter().any(|n| n.reason == "CustomActionHeld" && n.message.contains("other")), "{:?}", p.notes);
    }

    #[test]
    fn recovery_for_another_incident_and_unreadable_records_are_refused() {
        let mut view = node();
        let p = must_apply(plan(&view, &request(Action::Cordon), &Policy::default(), &mut allow()));
        apply_plan(&mut view, &p);
        let other = Remediation { recovery: true, incident_id: "old".into(), ..request(Action::None) };
        assert_eq!(
            plan(&view, &other, &Policy::default(), &mut allow()),
            Decision::Nothing { reason: Skip::OtherIncident { active: "i1".into() }, would: None }
        );
        view.annotations.insert(APPLIED_ANNOTATION.into(), "{not json".into());
        assert!(matches!(
            plan(&view, &request(Action::Cordon), &Policy::default(), &mut allow()),
            Decision::Nothing { reason: Skip::UnreadableRecord(_), .. }
        ));
    }

    /// A fault request for incident `id`.
    fn incident(id: &str, action: Action, subsystem: Subsystem, reason: &str) -> Remediation {
        Remediation { incident_id: id.into(), subsystem, reason: reason.into(), ..request(action) }
    }

    /// The recovery of incident `id`.
    fn recovered(id: &str) -> Remediation {
        Remediation { incident_id: id.into(), recovery: true, reason: "Healthy".into(), ..request(Action::None) }
    }

    fn applied_to(view: &mut NodeView, req: &Remediation) -> Plan {
        let p = must_apply(plan(view, req, &Policy::default(), &mut allow()));
        apply_plan(view, &p);
        p
    }

    fn condition_of<'a>(view: &'a NodeView, type_: &str) -> (&'a str, Option<&'a str>) {
        let c = view.condition(type_).unwrap_or_else(|| panic!("no {type_} in {:?}", view.conditions));
        (c.status.as_str(), c.reason.as_deref())
    }

    /// A critical incident quarantines, then a minor one marks the same node.
    fn critical_then_minor(minor_subsystem: Subsystem) -> NodeView {
        let mut view = node();
        applied_to(&mut view, &incident("critical", Action::Drain, Subsystem::Gpu, "Xid79"));
        applied_to(&mut view, &incident("minor", Action::Monitor, minor_subsystem, "EccContained"));
        view
    }

    #[test]
    fn a_reissued_verdict_leaves_a_condition_another_open_incident_wrote() {
        // Both incidents use GpuUnhealthy; the minor one wrote it last.
        let mut view = node();
        let critical = incident("critical", Action::Cordon, Subsystem::Gpu, "Xid79");
        applied_to(&mut view, &critical);
        applied_to(&mut view, &incident("minor", Action::Monitor, Subsystem::Gpu, "EccContained"));
        assert_eq!(condition_of(&view, "GpuUnhealthy"), ("True", Some("EccContained")));
        let again = Remediation { reissue: true, ..critical.clone() };
        assert_eq!(plan(&view, &again, &Policy::default(), &mut allow()), Decision::AlreadyDone);
        // Nor does it take the node over from the incident that holds it.
        let both = incident("both", Action::Drain, Subsystem::Gpu, "Xid48");
        applied_to(&mut view, &both);
        assert_eq!(view.applied().unwrap().unwrap().incident_id, "both");
        let again = Remediation { reissue: true, ..critical.clone() };
        assert_eq!(plan(&view, &again, &Policy::default(), &mut allow()), Decision::AlreadyDone);
        // A new verdict from the classifier still writes its reason: the condition tells the latest.
        let fresh = Remediation { verdict_id: "v2".into(), ..critical.clone() };
        let fresh = must_apply(plan(&view, &fresh, &Policy::default(), &mut allow()));
        assert_eq!(fresh.conditions.len(), 1);
    }

    #[test]
    fn a_verdict_the_resync_carried_out_first_is_not_applied_again_when_the_topic_delivers_it() {
        // The resync re-issues the critical incident's verdict from the store before the verdict
        // topic delivers it (a new leader, its consumer behind); a minor incident then writes the
        // shared condition.
        let mut view = node();
        let critical = incident("critical", Action::Cordon, Subsystem::Gpu, "Xid79");
        applied_to(&mut view, &Remediation { reissue: true, ..critical.clone() });
        applied_to(
            &mut view,
            &Remediation {
                verdict_id: "v-minor".into(),
                ..incident("minor", Action::Monitor, Subsystem::Gpu, "EccContained")
            },
        );
        assert_eq!(view.applied().unwrap().unwrap().incidents["critical"].verdict, "v1");
        // The topic's delivery of the same verdict: already done, nothing rewritten or moved.
        assert_eq!(plan(&view, &critical, &Policy::default(), &mut allow()), Decision::AlreadyDone);
        // A new verdict of the incident with new words writes them, and records its id with them.
        let fresh = Remediation { verdict_id: "v3".into(), message: "GPU fell off the bus again".into(), ..critical };
        let p = must_apply(plan(&view, &fresh, &Policy::default(), &mut allow()));
        assert_eq!(p.conditions.len(), 1);
        assert_eq!(p.applied.as_ref().unwrap().incidents["critical"].verdict, "v3");
    }

    #[test]
    fn a_new_verdict_id_alone_is_not_worth_a_write() {
        let mut view = node();
        let first = request(Action::Cordon);
        applied_to(&mut view, &first);
        let again = Remediation { verdict_id: "v2".into(), ..first };
        assert_eq!(plan(&view, &again, &Policy::default(), &mut allow()), Decision::AlreadyDone);
    }

    #[test]
    fn every_open_incident_is_recorded_and_a_marking_one_does_not_take_the_node_over() {
        let view = critical_then_minor(Subsystem::Memory);
        let rec = view.applied().unwrap().unwrap();
        assert_eq!(rec.incident_id, "critical");
        assert_eq!(
            rec.incidents.get("critical"),
            Some(&Claim {
                quarantines: true,
                condition: "GpuUnhealthy".into(),
                reason: "Xid79".into(),
                verdict: "v1".into()
            })
        );
        assert_eq!(
            rec.incidents.get("minor"),
            Some(&Claim {
                quarantines: false,
                condition: "GpuMemoryUnhealthy".into(),
                reason: "EccContained".into(),
                verdict: "v1".into()
            })
        );
        // The written form: camelCase, the single-incident fields kept.
        let json: serde_json::Value = serde_json::from_str(&view.annotations[APPLIED_ANNOTATION]).unwrap();
        assert_eq!(json["incidentId"], "critical");
        assert_eq!(json["operatorUncordoned"], false);
        assert_eq!(json["incidents"]["minor"]["condition"], "GpuMemoryUnhealthy");
        assert_eq!(json["incidents"]["critical"]["quarantines"], true);
    }

    #[test]
    fn a_minor_incident_recovering_leaves_the_critical_quarantine() {
        let mut view = critical_then_minor(Subsystem::Memory);
        let r = must_apply(plan(&view, &recovered("minor"), &Policy::default(), &mut allow()));
        assert_eq!(r.intent, Intent::Recover);
        assert_eq!(r.cordon, None, "the critical incident still holds the cordon");
        assert!(r.remove_taints.is_empty() && r.remove_labels.is_empty(), "{r:?}");
        assert_eq!(r.conditions.len(), 1);
        assert_eq!((r.conditions[0].type_.as_str(), r.conditions[0].problem), ("GpuMemoryUnhealthy", false));
        let note = &r.notes[0];
        assert_eq!(note.reason, "Recovered");
        assert!(note.message.contains("Incident minor recovered"), "{}", note.message);
        assert!(note.message.contains("stays quarantined for open incident(s) critical (Xid79)"), "{}", note.message);
        apply_plan(&mut view, &r);
        assert!(view.unschedulable);
        assert_eq!(view.taints.len(), 1);
        assert_eq!(view.labels[STATE_LABEL], "draining");
        assert_eq!(condition_of(&view, "GpuUnhealthy"), ("True", Some("Xid79")));
        assert_eq!(condition_of(&view, "GpuMemoryUnhealthy"), ("False", Some(RECOVERED_REASON)));
        let rec = view.applied().unwrap().unwrap();
        assert_eq!(rec.incidents.keys().collect::<Vec<_>>(), ["critical"]);
        assert_eq!(rec.conditions, ["GpuUnhealthy"]);
        assert!(rec.cordoned);

        // The critical incident's recovery returns the node.
        let r = must_apply(plan(&view, &recovered("critical"), &Policy::default(), &mut allow()));
        assert_eq!(r.cordon, Some(false));
        apply_plan(&mut view, &r);
        assert!(!view.unschedulable && view.taints.is_empty() && view.annotations.is_empty());
        assert!(!view.labels.contains_key(STATE_LABEL));
        assert_eq!(condition_of(&view, "GpuUnhealthy"), ("False", Some(RECOVERED_REASON)));
    }

    #[test]
    fn a_lemon_keeps_the_node_out_when_the_fault_that_made_it_recovers() {
        // The classifier's lemon incident (docs/decisions.md, "Lemons") arrives as a verdict of
        // its own beside the third fault, and has no recovery of its own.
        let fault = crate::verdicts::remediation(&lemon_verdicts::fault());
        let lemon = crate::verdicts::remediation(&lemon_verdicts::lemon());
        assert_eq!(
            (lemon.action, lemon.subsystem, lemon.reason.as_str()),
            (Action::ContactSupport, Subsystem::Gpu, "LemonGpu")
        );
        let mut view = node();
        applied_to(&mut view, &fault);
        applied_to(&mut view, &lemon);
        let r = must_apply(plan(&view, &recovered(&fault.incident_id), &Policy::default(), &mut allow()));
        assert_eq!(r.cordon, None, "{r:?}");
        assert!(r.remove_taints.is_empty() && r.remove_labels.is_empty(), "{r:?}");
        assert!(
            r.notes[0]
                .message
                .contains(&format!("stays quarantined for open incident(s) {} (LemonGpu)", lemon.incident_id)),
            "{}",
            r.notes[0].message
        );
        apply_plan(&mut view, &r);
        assert!(view.unschedulable && view.taints.len() == 1);
        assert_eq!(condition_of(&view, "GpuUnhealthy"), ("True", Some("LemonGpu")));
        // Once drained, a resync re-issues the open lemon's verdict: nothing changes, the node
        // stays out.
        let drained = advance(&view, State::Drained).expect("gpumedic owns the state label");
        apply_plan(&mut view, &drained);
        let again = Remediation { reissue: true, ..lemon };
        assert_eq!(plan(&view, &again, &Policy::default(), &mut allow()), Decision::AlreadyDone);
    }

    /// The verdicts of a third fault on a GPU and of the lemon incident it opened.
    mod lemon_verdicts {
        use gpumedic_schemas::Severity;
        use gpumedic_schemas::verdict::{RecommendedAction, Verdict};

        fn verdict(incident: u128, rule: &str, action: RecommendedAction) -> Verdict {
            Verdict {
                verdict_id: uuid::Uuid::from_u128(incident + 100),
                incident_id: uuid::Uuid::from_u128(incident),
                node: "n".into(),
                entity: gpumedic_schemas::health::Entity { gpu_uuid: Some("GPU-a".into()), ..Default::default() },
                severity: Severity::Critical,
                rule_id: rule.into(),
                rule_version: 1,
                action,
                custom_action: None,
                reason: format!("{rule} on GPU-a"),
                evidence: vec![],
                issued_at: chrono::Utc::now(),
                recovery: false,
                not_before: None,
                deferrable: false,
                workload: None,
            }
        }

        pub(super) fn fault() -> Verdict {
            verdict(1, "ecc-double-bit", RecommendedAction::ResetGpu)
        }

        pub(super) fn lemon() -> Verdict {
            verdict(2, "lemon-gpu", RecommendedAction::ContactSupport)
        }
    }

    #[test]
    fn a_condition_shared_with_an_open_incident_stays_true_with_its_reason() {
        // The minor incident is about the GPU too: it shares the critical one's condition, and
        // its reason is the last written.
        let mut view = critical_then_minor(Subsystem::Gpu);
        assert_eq!(condition_of(&view, "GpuUnhealthy"), ("True", Some("EccContained")));
        let r = must_apply(plan(&view, &recovered("minor"), &Policy::default(), &mut allow()));
        assert_eq!(r.cordon, None);
        assert_eq!(r.conditions.len(), 1, "{:?}", r.conditions);
        let c = &r.conditions[0];
        assert!(c.problem && !c.transition, "restated, not flipped: {c:?}");
        assert_eq!(c.reason, "Xid79");
        apply_plan(&mut view, &r);
        assert_eq!(condition_of(&view, "GpuUnhealthy"), ("True", Some("Xid79")));
        assert!(view.unschedulable);
        assert_eq!(view.applied().unwrap().unwrap().conditions, ["GpuUnhealthy"]);
    }

    #[test]
    fn the_critical_incident_recovering_first_releases_the_node_and_keeps_the_minor_mark() {
        let mut view = critical_then_minor(Subsystem::Memory);
        let r = must_apply(plan(&view, &recovered("critical"), &Policy::default(), &mut allow()));
        assert_eq!(r.cordon, Some(false));
        assert_eq!(r.remove_taints.len(), 1);
        assert_eq!(r.remove_labels, [STATE_LABEL]);
        assert_eq!(r.conditions.iter().map(|c| c.type_.as_str()).collect::<Vec<_>>(), ["GpuUnhealthy"]);
        assert!(r.notes[0].message.contains("still mark the node"), "{}", r.notes[0].message);
        apply_plan(&mut view, &r);
        assert!(!view.unschedulable && view.taints.is_empty());
        assert_eq!(condition_of(&view, "GpuMemoryUnhealthy"), ("True", Some("EccContained")));
        let rec = view.applied().unwrap().unwrap();
        assert_eq!(rec.incident_id, "minor");
        assert!(!rec.quarantines() && rec.labels.is_empty());
        assert_eq!(rec.conditions, ["GpuMemoryUnhealthy"]);

        let r = must_apply(plan(&view, &recovered("minor"), &Policy::default(), &mut allow()));
        assert_eq!(r.cordon, None);
        apply_plan(&mut view, &r);
        assert!(view.annotations.is_empty());
        assert_eq!(condition_of(&view, "GpuMemoryUnhealthy"), ("False", Some(RECOVERED_REASON)));
    }

    #[test]
    fn recovery_of_an_incident_not_in_the_record_does_nothing() {
        let mut view = critical_then_minor(Subsystem::Memory);
        assert_eq!(
            plan(&view, &recovered("unknown"), &Policy::default(), &mut allow()),
            Decision::Nothing { reason: Skip::OtherIncident { active: "critical, minor".into() }, would: None }
        );
        applied_to(&mut view, &recovered("minor"));
        // Redelivered, the minor recovery finds its incident gone; the node stays held.
        assert_eq!(
            plan(&view, &recovered("minor"), &Policy::default(), &mut allow()),
            Decision::Nothing { reason: Skip::OtherIncident { active: "critical".into() }, would: None }
        );
        assert!(view.unschedulable);
    }

    #[test]
    fn the_single_incident_record_still_reads_as_one_incident() {
        let mut view = node();
        view.unschedulable = true;
        view.taints.push(Taint { key: TAINT_KEY.into(), value: Some("gpu".into()), effect: "NoSchedule".into() });
        view.labels.insert(STATE_LABEL.into(), "quarantined".into());
        view.conditions.push(Condition {
            type_: "GpuUnhealthy".into(),
            status: "True".into(),
            reason: Some("Xid79".into()),
            message: None,
        });
        view.annotations.insert(
            APPLIED_ANNOTATION.into(),
            r#"{"incidentId":"old","cordoned":true,"taints":[{"key":"gpumedic.io/unhealthy","effect":"NoSchedule"}],"labels":["gpumedic.io/state"],"conditions":["GpuUnhealthy"],"operatorUncordoned":false}"#.into(),
        );
        let rec = view.applied().unwrap().unwrap();
        assert_eq!(
            rec.incidents.get("old"),
            Some(&Claim {
                quarantines: true,
                condition: "GpuUnhealthy".into(),
                reason: String::new(),
                verdict: String::new()
            })
        );
        // The same incident again changes nothing on the node.
        let again = Remediation { incident_id: "old".into(), ..request(Action::Cordon) };
        let p = must_apply(plan(&view, &again, &Policy::default(), &mut allow()));
        assert!(p.cordon.is_none() && p.add_taints.is_empty() && !p.new_quarantine, "{p:?}");
        assert_eq!(p.applied.as_ref().map(|a| a.incidents["old"].reason.as_str()), Some("Xid79"));
        // A minor incident's recovery leaves the old incident's quarantine.
        applied_to(&mut view, &incident("minor", Action::Monitor, Subsystem::Memory, "EccContained"));
        applied_to(&mut view, &recovered("minor"));
        assert!(view.unschedulable && view.taints.len() == 1);
        // The old incident's recovery returns the node.
        applied_to(&mut view, &recovered("old"));
        assert!(!view.unschedulable && view.taints.is_empty() && view.annotations.is_empty());
        assert_eq!(condition_of(&view, "GpuUnhealthy"), ("False", Some(RECOVERED_REASON)));
    }

    #[test]
    fn a_marking_incident_is_not_new_evidence_against_a_manual_uncordon() {
        let mut view = node();
        let critical = incident("critical", Action::Cordon, Subsystem::Gpu, "Xid79");
        applied_to(&mut view, &critical);
        view.unschedulable = false; // the operator's `kubectl uncordon`
        applied_to(&mut view, &critical);
        applied_to(&mut view, &incident("minor", Action::Monitor, Subsystem::Memory, "EccContained"));
        // The critical incident's verdicts keep coming: still not cordoned again.
        assert_eq!(plan(&view, &critical, &Policy::default(), &mut allow()), Decision::AlreadyDone);
        assert!(view.applied().unwrap().unwrap().operator_uncordoned);
        // A new quarantining incident is new evidence.
        let p = must_apply(plan(
            &view,
            &incident("third", Action::Cordon, Subsystem::Interconnect, "NvlinkDown"),
            &Policy::default(),
            &mut allow(),
        ));
        assert_eq!(p.cordon, Some(true));
    }

    #[test]
    fn a_changed_message_updates_the_condition_without_a_transition() {
        let mut view = node();
        let p = must_apply(plan(&view, &request(Action::Monitor), &Policy::default(), &mut allow()));
        apply_plan(&mut view, &p);
        // The classifier's next verdict of the incident (a verdict id names one step of it).
        let req = Remediation { message: "again".into(), verdict_id: "v2".into(), ..request(Action::Monitor) };
        let p = must_apply(plan(&view, &req, &Policy::default(), &mut allow()));
        assert_eq!(p.conditions.len(), 1);
        assert!(!p.conditions[0].transition);
        // The record only learns which verdict it carried out.
        assert_eq!(p.applied.as_ref().unwrap().incidents["i1"].verdict, "v2");
    }
}
