//! The validated rule model: what a rule file means once the loader has accepted it.
//!
//! Everything here is plain data with no YAML left in it, so the engine never meets an
//! unchecked value: enums for the closed vocabularies, [`Interval`]s for durations, and
//! normalised code ranges.

use std::collections::BTreeMap;
use std::fmt;
use std::path::PathBuf;

use serde::{Deserialize, Serialize};

use super::duration::Interval;
use super::observation::{FieldValue, Observation};

/// The sources a rule may name (`match.source`).
pub const SOURCES: &[&str] = &["nvml", "kernel_log", "dcgm", "cloud", "ingest", "synthetic"];

/// The observation kinds a rule may name (`match.kind`).
pub const KINDS: &[&str] = &[
    "gpu_inventory",
    "xid",
    "sxid",
    "gpu_lost",
    "ecc",
    "retired_pages",
    "row_remap",
    "temperature",
    "power",
    "throttle",
    "nvlink",
    "pcie_replay",
    "mce",
    "pcie_aer",
    "dcgm_health",
    "dcgm_diag",
    "cloud_maintenance",
    "monitor_health",
    "custom",
];

/// How bad a verdict is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Severity {
    /// Worth recording; nothing to do.
    Info,
    /// Needs attention or a mild action.
    Warning,
    /// The GPU or node cannot be trusted with work.
    Critical,
}

impl Severity {
    /// Every value with its spelling in rule files.
    pub const ALL: &[(&str, Severity)] =
        &[("info", Severity::Info), ("warning", Severity::Warning), ("critical", Severity::Critical)];

    /// The spelling in rule files.
    pub fn as_str(self) -> &'static str {
        Self::ALL.iter().find(|(_, s)| *s == self).map(|(n, _)| *n).unwrap_or("?")
    }
}

impl fmt::Display for Severity {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A recommended action, ordered from least to most disruptive so that "escalate only when the
/// action increases" is a plain comparison.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Action {
    /// Record only.
    None,
    /// Watch more closely; no change to the node.
    Monitor,
    /// Run the GPU's diagnostics (DCGM) when it is free; no change to the node unless they fail.
    RunDiagnostics,
    /// An operator-defined action named by the rule's `custom` key.
    Custom,
    /// Stop new work landing on the node.
    Cordon,
    /// Cordon and evict the node's workloads.
    Drain,
    /// Stop the GPU's processes and reset it.
    ResetGpu,
    /// Reboot the host (or the VM that owns the GPU).
    RebootNode,
    /// Take the node out and hand it to a repair process.
    ContactSupport,
    /// Replace the hardware.
    ReplaceNode,
}

impl Action {
    /// Every value with its spelling in rule files.
    pub const ALL: &[(&str, Action)] = &[
        ("none", Action::None),
        ("monitor", Action::Monitor),
        ("run_diagnostics", Action::RunDiagnostics),
        ("custom", Action::Custom),
        ("cordon", Action::Cordon),
        ("drain", Action::Drain),
        ("reset_gpu", Action::ResetGpu),
        ("reboot_node", Action::RebootNode),
        ("contact_support", Action::ContactSupport),
        ("replace_node", Action::ReplaceNode),
    ];

    /// The spelling in rule files.
    pub fn as_str(self) -> &'static str {
        Self::ALL.iter().find(|(_, a)| *a == self).map(|(n, _)| *n).unwrap_or("?")
    }
}

impl Action {
    /// True when the action takes the node or GPU out of service (cordon or more disruptive);
    /// `none`, `monitor`, `run_diagnostics` and `custom` leave it serving.
    pub fn quarantines(self) -> bool {
        self >= Action::Cordon
    }
}

/// Xid codes NVIDIA's catalog marks as application errors or as recoverable by the driver (the
/// immediate action is "restart app" or "ignore", and the GPU is usually fine): 8, 13, 31, 32, 43,
/// 45, 68, 69 and 137. The device plugin likewise ignores 13, 31, 43, 45 and 68. No rule may
/// quarantine on these codes alone; the loader refuses one that tries.
pub const APPLICATION_XIDS: &[u32] = &[8, 13, 31, 32, 43, 45, 68, 69, 137];

impl fmt::Display for Action {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// What a rule's state and incidents are keyed by, besides the rule and the node.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Scope {
    /// One state per node: every GPU's evidence counts together.
    Node,
    /// One state per GPU (observations without a GPU share a node-level state).
    Gpu,
}

/// Whether synthetic (injected) observations take part.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum SyntheticPolicy {
    /// Injected faults are dropped before any rule sees them (production).
    #[default]
    Ignored,
    /// Injected faults are treated like real ones (demos, tests).
    Allowed,
}

/// Which observations a matcher accepts by their `healthy` flag.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Health {
    /// Only fault evidence (`healthy: false`): the default for a rule's `match`.
    Unhealthy,
    /// Only healthy evidence: the default for a clear condition's `evidence`.
    Healthy,
    /// Both, for readings judged by their values (temperature, counters).
    Any,
}

/// An inclusive range of Xid codes; a single code is a range of one.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CodeRange {
    /// The first code.
    pub lo: u32,
    /// The last code.
    pub hi: u32,
}

impl CodeRange {
    /// True when `code` is in the range.
    pub fn contains(self, code: u32) -> bool {
        self.lo <= code && code <= self.hi
    }
}

/// True when any range in `set` holds `code`.
pub fn codes_contain(set: &[CodeRange], code: u32) -> bool {
    set.iter().any(|r| r.contains(code))
}

/// How a numeric field is compared.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Cmp {
    /// Strictly greater.
    Gt,
    /// Greater or equal.
    Ge,
    /// Strictly less.
    Lt,
    /// Less or equal.
    Le,
}

impl Cmp {
    /// Applies the comparison.
    pub fn holds(self, left: f64, right: f64) -> bool {
        match self {
            Cmp::Gt => left > right,
            Cmp::Ge => left >= right,
            Cmp::Lt => left < right,
            Cmp::Le => left <= right,
        }
    }

    /// The spelling in rule files.
    pub fn as_str(self) -> &'static str {
        match self {
            Cmp::Gt => "gt",
            Cmp::Ge => "ge",
            Cmp::Lt => "lt",
            Cmp::Le => "le",
        }
    }
}

/// The right-hand side of a numeric comparison.
#[derive(Debug, Clone, PartialEq)]
pub enum Operand {
    /// A number written in the rule.
    Number(f64),
    /// Another field of the same observation, e.g. `slowdown_threshold`.
    Field(String),
}

impl Operand {
    /// The operand's value for `o`, or `None` when the named field is missing or not a number.
    pub fn resolve(&self, o: &Observation) -> Option<f64> {
        match self {
            Operand::Number(n) => Some(*n),
            Operand::Field(name) => o.fields.get(name).and_then(FieldValue::as_f64),
        }
    }
}

impl fmt::Display for Operand {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Operand::Number(n) => write!(f, "{n}"),
            Operand::Field(name) => write!(f, "{name}"),
        }
    }
}

/// One test on one field of an observation.
#[derive(Debug, Clone, PartialEq)]
pub enum FieldTest {
    /// Equal (numbers compare by value, so `1` equals `1.0`).
    Eq(FieldValue),
    /// Not equal; a missing field is not equal.
    Ne(FieldValue),
    /// A numeric comparison; a missing or non-numeric field fails it.
    Cmp(Cmp, Operand),
    /// Equal to one of the values.
    In(Vec<FieldValue>),
    /// Present (`true`) or absent (`false`).
    Exists(bool),
}

/// True when two field values are the same value.
pub fn values_equal(a: &FieldValue, b: &FieldValue) -> bool {
    match (a.as_f64(), b.as_f64()) {
        (Some(x), Some(y)) => x == y,
        _ => a == b,
    }
}

impl FieldTest {
    /// Applies the test to `value` (absent when the observation lacks the field).
    pub fn holds(&self, value: Option<&FieldValue>, o: &Observation) -> bool {
        match self {
            FieldTest::Exists(want) => value.is_some() == *want,
            FieldTest::Eq(v) => value.is_some_and(|x| values_equal(x, v)),
            FieldTest::Ne(v) => value.is_some_and(|x| !values_equal(x, v)),
            FieldTest::In(vs) => value.is_some_and(|x| vs.iter().any(|v| values_equal(x, v))),
            FieldTest::Cmp(cmp, operand) => match (value.and_then(FieldValue::as_f64), operand.resolve(o)) {
                (Some(l), Some(r)) => cmp.holds(l, r),
                _ => false,
            },
        }
    }
}

/// A test on a named field.
#[derive(Debug, Clone, PartialEq)]
pub struct FieldPredicate {
    /// The field's name.
    pub field: String,
    /// The test.
    pub test: FieldTest,
}

/// One alternative of a `match`: every criterion it names must hold.
#[derive(Debug, Clone, PartialEq)]
pub struct Matcher {
    /// Accepted sources; empty accepts any.
    pub source: Vec<String>,
    /// Accepted components; empty accepts any.
    pub component: Vec<String>,
    /// Accepted kinds; empty accepts any.
    pub kind: Vec<String>,
    /// Accepted Xid codes; empty accepts any observation, with or without a code.
    pub xid: Vec<CodeRange>,
    /// The `healthy` flag filter.
    pub health: Health,
    /// Field tests, all of which must hold.
    pub fields: Vec<FieldPredicate>,
}

impl Matcher {
    /// True when `o` satisfies every criterion.
    pub fn matches(&self, o: &Observation) -> bool {
        let health_ok = match self.health {
            Health::Unhealthy => !o.healthy,
            Health::Healthy => o.healthy,
            Health::Any => true,
        };
        health_ok
            && (self.source.is_empty() || self.source.contains(&o.source))
            && (self.component.is_empty() || self.component.contains(&o.component))
            && (self.kind.is_empty() || self.kind.contains(&o.kind))
            && (self.xid.is_empty() || o.xid.is_some_and(|x| codes_contain(&self.xid, x)))
            && self.fields.iter().all(|p| p.test.holds(o.fields.get(&p.field), o))
    }
}

/// A `match`: a list of alternatives, any of which may accept.
#[derive(Debug, Clone, PartialEq)]
pub struct Match(pub Vec<Matcher>);

impl Match {
    /// True when any alternative accepts `o`.
    pub fn matches(&self, o: &Observation) -> bool {
        self.0.iter().any(|m| m.matches(o))
    }
}

/// When a burst is judged.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Judge {
    /// As soon as the growing burst satisfies the test (for "X with Y": act without waiting).
    Each,
    /// Once the burst has ended, i.e. `gap` passed without a matching event (for "X alone").
    Close,
}

/// The test applied to a burst's set of Xid codes.
#[derive(Debug, Clone, PartialEq)]
pub struct BurstTest {
    /// Each of these codes must be present.
    pub with_all: Vec<CodeRange>,
    /// At least one of these codes must be present (when non-empty).
    pub with_any: Vec<CodeRange>,
    /// None of these codes may be present.
    pub without: Vec<CodeRange>,
    /// Every code present must be in this set (when non-empty): "X alone".
    pub only: Vec<CodeRange>,
    /// The burst must hold at least this many events.
    pub min_events: u32,
}

/// The stateful part of a rule: when matching evidence amounts to a finding.
#[derive(Debug, Clone, PartialEq)]
pub enum Condition {
    /// At least `at_least` matching events within `within` (any time when absent).
    Count {
        /// How many events.
        at_least: u32,
        /// The sliding window.
        within: Option<Interval>,
        /// When set, events count once per distinct value of this key (see [`Distinct`]).
        distinct: Option<Distinct>,
    },
    /// Matching events grouped until `gap` passes without one, then judged by `test`.
    Burst {
        /// The quiet gap that ends a burst (NVIDIA uses 3 minutes).
        gap: Interval,
        /// When the burst is judged.
        judge: Judge,
        /// The test on the burst.
        test: BurstTest,
    },
    /// Each of the matches seen within `within` of one another.
    Together {
        /// The matches that must all occur (applied on top of the rule's `match`).
        of: Vec<Match>,
        /// The window.
        within: Interval,
    },
    /// A counter field growing by more than `more_than` within `per`.
    Rate {
        /// The counter field.
        field: String,
        /// The growth that fires the rule.
        more_than: f64,
        /// The window.
        per: Interval,
    },
    /// A value field compared with a limit, holding for `for_` or for `readings` readings in a
    /// row, whichever comes first.
    Threshold {
        /// The value field.
        field: String,
        /// The comparison.
        cmp: Cmp,
        /// The limit.
        limit: Operand,
        /// How long it must hold.
        for_: Interval,
        /// Or this many readings in a row, whichever comes first (0: only the duration counts).
        readings: u32,
    },
}

impl Condition {
    /// The condition's name in rule files.
    pub fn name(&self) -> &'static str {
        match self {
            Condition::Count { .. } => "count",
            Condition::Burst { .. } => "burst",
            Condition::Together { .. } => "together",
            Condition::Rate { .. } => "rate",
            Condition::Threshold { .. } => "threshold",
        }
    }
}

/// What makes two events of a `count` different occurrences.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Distinct {
    /// The process or workload that met the error: the first workload the enricher named, else the
    /// Xid line's process name and pid, else the second the event was logged in. One exception's
    /// multi-line log is one occurrence; the same job failing again is one occurrence too.
    Process,
}

/// What an override (Xid 154's recovery action) maps one field value to.
#[derive(Debug, Clone, PartialEq)]
pub struct Outcome {
    /// The action.
    pub action: Action,
    /// Follow-up actions, in order.
    pub then: Vec<Action>,
    /// The severity; the rule's own when absent.
    pub severity: Option<Severity>,
}

/// A rule whose action is read from a field of the evidence and which overrides the guess of
/// `overridable` rules on the same GPU while its incident is open (Xid 154).
#[derive(Debug, Clone, PartialEq)]
pub struct Override {
    /// The field naming the action, e.g. `recovery_action`.
    pub field: String,
    /// Normalised field value (lower case, words joined by `_`) to outcome.
    pub actions: BTreeMap<String, Outcome>,
}

/// Normalises a field value for [`Override::actions`]: `GPU Reset Required` and
/// `gpu_reset_required` are the same value.
pub fn normalise_key(value: &str) -> String {
    let mut out = String::with_capacity(value.len());
    for word in value.split(|c: char| !c.is_ascii_alphanumeric()).filter(|w| !w.is_empty()) {
        if !out.is_empty() {
            out.push('_');
        }
        out.push_str(&word.to_ascii_lowercase());
    }
    out
}

/// What must be seen, after an incident opened, before its healthy evidence counts: the proof
/// that the remedy happened.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Proof {
    /// Nothing beyond the evidence itself (readings judged by their values).
    None,
    /// A reset of the failed GPU: it re-appeared in the inventory, its volatile ECC counters
    /// started again, the driver's Xid 154 returned to `None`, or the node rebooted.
    Reset,
    /// A reboot of the node: a new boot id, and the node's GPU count back to the expected one.
    Reboot,
}

impl Proof {
    /// Every value with its spelling in rule files.
    pub const ALL: &[(&str, Proof)] = &[("none", Proof::None), ("reset", Proof::Reset), ("reboot", Proof::Reboot)];

    /// The spelling in rule files.
    pub fn as_str(self) -> &'static str {
        Self::ALL.iter().find(|(_, p)| *p == self).map(|(n, _)| *n).unwrap_or("?")
    }
}

/// What closes an open incident.
#[derive(Debug, Clone, PartialEq)]
pub struct Clear {
    /// The healthy evidence that starts the quiet period. It counts only from the part that
    /// failed: the incident's GPU, every GPU a node-wide incident named, or the node itself for a
    /// node-wide incident that named no GPU.
    pub evidence: Match,
    /// What must have happened first.
    pub proof: Proof,
    /// How long the evidence must stand without new fault evidence.
    pub quiet: Interval,
}

/// Errors on one GPU that are the echo of another GPU's fault: NVLink peers log Xid 145 when
/// their link partner goes down. Within `within` of the root's incident opening on another GPU of
/// the node, they are evidence on that incident, not incidents of their own.
#[derive(Debug, Clone, PartialEq)]
pub struct Sympathetic {
    /// The codes that can be sympathetic.
    pub xid: Vec<CodeRange>,
    /// The rules whose incident on another GPU is the root.
    pub to: Vec<String>,
    /// How soon after the root's incident opened.
    pub within: Interval,
}

/// When a scheduled action may start: a field of the evidence (a maintenance window's start)
/// less a lead.
#[derive(Debug, Clone, PartialEq)]
pub struct Schedule {
    /// The field holding the window's start, in microseconds since the Unix epoch.
    pub field: String,
    /// How long before the start the action may begin.
    pub lead: Interval,
}

/// Where a rule was written, for messages.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Origin {
    /// The file.
    pub file: PathBuf,
    /// The line of the rule's `id`.
    pub line: usize,
}

impl fmt::Display for Origin {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}:{}", self.file.display(), self.line)
    }
}

/// One validated rule.
#[derive(Debug, Clone, PartialEq)]
pub struct Rule {
    /// Unique across the rule set; shared with every key of the engine's state that names it.
    pub id: std::sync::Arc<str>,
    /// Bumped whenever the rule's meaning changes; part of every incident and verdict id.
    pub version: u32,
    /// What the rule detects, for humans.
    pub description: String,
    /// Which observations are evidence.
    pub matcher: Match,
    /// Per node or per GPU.
    pub scope: Scope,
    /// When evidence amounts to a finding.
    pub condition: Condition,
    /// The finding's severity.
    pub severity: Severity,
    /// The recommended action.
    pub action: Action,
    /// Follow-up actions, in order (e.g. drain, then reset the GPU).
    pub then: Vec<Action>,
    /// The operator-defined action's name, for `action: custom`.
    pub custom: Option<String>,
    /// True when an [`Override`] rule may replace this rule's action (the Xid-based guesses).
    pub overridable: bool,
    /// Set for rules whose action comes from the evidence (Xid 154).
    pub override_: Option<Override>,
    /// The action may wait until the GPU is idle or a maintenance window opens.
    pub deferrable: bool,
    /// Rules whose open incident on the same GPU (or node) absorbs this rule's evidence: while
    /// one is open, this rule does not open an incident of its own.
    pub suppressed_by: Vec<String>,
    /// When the action may start, for scheduled events.
    pub not_before: Option<Schedule>,
    /// When this rule's evidence is the echo of another GPU's fault.
    pub sympathetic: Option<Sympathetic>,
    /// What closes the incident.
    pub clear: Clear,
    /// Where the rule was written.
    pub origin: Origin,
}

/// A validated set of rules, in load order.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct RuleSet {
    /// The rules.
    pub rules: Vec<Rule>,
    /// Whether synthetic observations take part.
    pub synthetic: SyntheticPolicy,
    /// Replaces every rule's `not_before.lead` when set (the classifier's `--maintenance-lead`).
    pub lead: Option<Interval>,
    /// Caps every rule's quiet period when set (the classifier's `--max-quiet`, for demos and
    /// tests that cannot wait 15 minutes; proofs of repair still apply).
    pub max_quiet: Option<Interval>,
}

impl RuleSet {
    /// The rule with `id`.
    pub fn get(&self, id: &str) -> Option<&Rule> {
        self.rules.iter().find(|r| &*r.id == id)
    }

    /// The same rules with every scheduled action's lead replaced, e.g. a shorter one for a test.
    pub fn with_lead(mut self, lead: Interval) -> Self {
        self.lead = Some(lead);
        self
    }

    /// The same rules with every quiet period capped at `quiet`.
    pub fn with_max_quiet(mut self, quiet: Interval) -> Self {
        self.max_quiet = Some(quiet);
        self
    }

    /// The quiet period of `rule` under this set's cap.
    pub fn quiet(&self, rule: &Rule) -> Interval {
        self.max_quiet.map_or(rule.clear.quiet, |cap| rule.clear.quiet.min(cap))
    }

    /// The same rules with another synthetic policy, e.g. for a demo that injects faults.
    pub fn with_synthetic(mut self, policy: SyntheticPolicy) -> Self {
        self.synthetic = policy;
        self
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn matcher() -> Matcher {
        Matcher {
            source: vec![],
            component: vec![],
            kind: vec!["temperature".into()],
            xid: vec![],
            health: Health::Any,
            fields: vec![],
        }
    }

    #[test]
    fn field_comparisons_against_numbers_and_other_fields() {
        let o = Observation::new("e", "n", 0, "temperature").field("value", 91i64).field("slowdown_threshold", 90.0);
        let mut m = matcher();
        m.fields = vec![FieldPredicate {
            field: "value".into(),
            test: FieldTest::Cmp(Cmp::Ge, Operand::Field("slowdown_threshold".into())),
        }];
        assert!(m.matches(&o));
        m.fields[0].test = FieldTest::Cmp(Cmp::Ge, Operand::Field("shutdown_threshold".into()));
        assert!(!m.matches(&o), "a missing operand field fails the comparison");
        m.fields[0].test = FieldTest::Eq(FieldValue::Float(91.0));
        assert!(m.matches(&o), "integers equal floats of the same value");
        m.fields[0].test = FieldTest::Exists(false);
        assert!(!m.matches(&o));
    }

    #[test]
    fn health_and_code_filters() {
        let mut m = matcher();
        m.kind = vec!["xid".into()];
        m.xid = vec![CodeRange { lo: 144, hi: 150 }];
        m.health = Health::Unhealthy;
        assert!(m.matches(&Observation::new("e", "n", 0, "xid").xid(145)));
        assert!(!m.matches(&Observation::new("e", "n", 0, "xid").xid(151)));
        assert!(!m.matches(&Observation::new("e", "n", 0, "xid")), "no code, no match when codes are named");
        assert!(!m.matches(&Observation::new("e", "n", 0, "xid").xid(145).healthy()));
    }

    #[test]
    fn actions_order_by_disruption_and_keys_normalise() {
        assert!(Action::None < Action::Monitor && Action::Cordon < Action::Drain && Action::Drain < Action::ResetGpu);
        assert!(Action::ResetGpu < Action::RebootNode && Action::RebootNode < Action::ReplaceNode);
        assert!(Severity::Info < Severity::Warning && Severity::Warning < Severity::Critical);
        assert_eq!(normalise_key("GPU Reset Required"), "gpu_reset_required");
        assert_eq!(normalise_key("  drain-and-reset "), "drain_and_reset");
    }
}
