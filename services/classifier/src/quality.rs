//! Decision quality: what the engine's decisions did to nodes and GPUs over time, and how that
//! compares with what should have happened.
//!
//! The input is the decisions in the order the engine issued them, each optionally with the time
//! it was issued. From them a [`Timeline`] works out when each node and GPU was out of service:
//!
//! - a decision *quarantines* ([`quarantines`]) when it is not a recovery, not `deferrable`, and
//!   its action is `cordon` or more disruptive (cordon, drain, reset_gpu, reboot_node,
//!   contact_support, replace_node);
//! - it takes effect at `max(decided_at, not_before)`; a decision stamped after the time it was
//!   issued (an observation from the future) counts from when it was issued;
//! - the incident is *released* by its recovery decision; a recovery that comes before the
//!   quarantine took effect (a maintenance notice withdrawn before its window) cancels it;
//! - a node-scoped incident (no GPU) takes out the node and every GPU on it; a GPU-scoped one takes
//!   out the GPU and, unless the remediator quarantines single GPUs
//!   ([`Options::gpu_level_quarantine`]), its node;
//! - a node or GPU is *in service* when no quarantining incident that covers it is open;
//! - an *oscillation* is a node or GPU taken out again after it was returned to service.
//!
//! With [`Expectations`] (what a scenario says should happen) the same timeline also counts false
//! quarantines, missed hardware faults, false clears and missed releases, and lists every
//! [`Miss`]. Pure: no I/O, no clock.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;

use serde::{Deserialize, Serialize};
use uuid::Uuid;

use crate::rules::{Action, Decision, Severity};

/// True when `d` takes its node or GPU out of service: not a recovery, not deferrable, and an
/// action of `cordon` or more disruptive.
pub fn quarantines(d: &Decision) -> bool {
    !d.recovery && !d.deferrable && d.action >= Action::Cordon
}

/// A node, or one GPU of it (by its canonical identity).
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Target {
    /// The node.
    pub node: String,
    /// The GPU; `None` for the node as a whole.
    pub gpu: Option<String>,
}

impl Target {
    /// The node as a whole.
    pub fn node(node: impl Into<String>) -> Target {
        Target { node: node.into(), gpu: None }
    }

    /// One GPU of a node.
    pub fn gpu(node: impl Into<String>, gpu: impl Into<String>) -> Target {
        Target { node: node.into(), gpu: Some(gpu.into()) }
    }
}

impl fmt::Display for Target {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.gpu {
            Some(g) => write!(f, "{}/{g}", self.node),
            None => f.write_str(&self.node),
        }
    }
}

/// How the remediator applies quarantines.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Options {
    /// The remediator takes single GPUs out (a GPU-scoped incident leaves its node in service).
    pub gpu_level_quarantine: bool,
}

/// When an incident held its target out of service: from, and until (open when `None`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Span {
    from: i64,
    to: Option<i64>,
}

impl Span {
    fn covers(self, t: i64) -> bool {
        self.from <= t && self.to.is_none_or(|to| t < to)
    }
}

#[derive(Debug, Clone)]
struct Track {
    node: String,
    gpu: Option<String>,
    spans: Vec<Span>,
}

/// Out-of-service spans per incident, built from the decisions in the order they were issued.
#[derive(Debug, Clone, Default)]
pub struct Timeline {
    options: Options,
    decisions: Vec<Decision>,
    incidents: BTreeMap<Uuid, Track>,
}

/// The highest severity issued for a target, or none at all.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Worst {
    /// No decision named the target.
    None,
    /// At most info.
    Info,
    /// At most warning.
    Warning,
    /// Critical.
    Critical,
}

impl From<Severity> for Worst {
    fn from(s: Severity) -> Worst {
        match s {
            Severity::Info => Worst::Info,
            Severity::Warning => Worst::Warning,
            Severity::Critical => Worst::Critical,
        }
    }
}

impl fmt::Display for Worst {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Worst::None => "none",
            Worst::Info => "info",
            Worst::Warning => "warning",
            Worst::Critical => "critical",
        })
    }
}

/// What should happen to one node or GPU. Every key is optional; only what is given is checked.
#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Expect {
    /// Taken out of service at some point during the run.
    #[serde(default)]
    pub quarantined: Option<bool>,
    /// Quarantined, and back in service at the end.
    #[serde(default)]
    pub released: Option<bool>,
    /// The most disruptive action issued for it, follow-ups (`then`) included; `none` when none.
    #[serde(default)]
    pub action: Option<Action>,
    /// The highest severity issued for it; `none` when no decision named it.
    #[serde(default)]
    pub severity: Option<Worst>,
    /// How many times it was taken out of service.
    #[serde(default)]
    pub quarantines: Option<usize>,
    /// How many distinct incidents named it.
    #[serde(default)]
    pub incidents: Option<usize>,
    /// Actions that must never be issued for it (as action or follow-up).
    #[serde(default)]
    pub never: Vec<Action>,
}

/// Whether a node or GPU is in service at a time.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Checkpoint {
    /// When, in microseconds since the Unix epoch.
    pub at_micros: i64,
    /// The node or GPU.
    pub target: Target,
    /// In service then.
    pub in_service: bool,
    /// How the time was written, for messages (`20m`, an RFC 3339 time).
    pub label: String,
}

/// Everything a run is expected to do.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Expectations {
    /// Per node or GPU.
    pub targets: Vec<(Target, Expect)>,
    /// Points in time.
    pub checkpoints: Vec<Checkpoint>,
    /// How many oscillations the whole run has.
    pub oscillations: Option<usize>,
}

/// What kind of expectation a [`Miss`] broke.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum MissKind {
    /// Taken out of service though it should not have been.
    FalseQuarantine,
    /// A fault that should have taken it out did not.
    MissedFault,
    /// Returned to service though it should still be out.
    FalseClear,
    /// Still out though it should be back.
    MissedRelease,
    /// In or out of service at the wrong time.
    Checkpoint,
    /// Another expectation: action, severity, counts.
    Other,
}

/// One broken expectation.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Miss {
    /// The kind.
    pub kind: MissKind,
    /// What it is about (`node`, `node/gpu`, or `run` for the whole run).
    pub target: String,
    /// The expectation, e.g. `quarantined`, `in_service at 20m`.
    pub what: String,
    /// The expected value.
    pub expected: String,
    /// What happened.
    pub got: String,
}

impl fmt::Display for Miss {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}: expected {}, got {}", self.target, self.what, self.expected, self.got)
    }
}

/// Counts over one run or many.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct Summary {
    /// Runs (scenarios, backtests) added up.
    pub runs: usize,
    /// Decisions issued.
    pub decisions: usize,
    /// Distinct incidents.
    pub incidents: usize,
    /// Quarantines that took effect (per incident).
    pub quarantines: usize,
    /// Quarantines released by a recovery.
    pub releases: usize,
    /// Quarantines still waiting for their `not_before` at the end.
    pub scheduled: usize,
    /// Nodes taken out of service at least once.
    pub nodes_out: usize,
    /// Nodes or GPUs taken out again after they were returned to service.
    pub oscillations: usize,
    /// Expectations checked (0 without expectations).
    pub checked: usize,
    /// Runs with at least one miss.
    pub failed_runs: usize,
    /// See [`MissKind::FalseQuarantine`].
    pub false_quarantines: usize,
    /// See [`MissKind::MissedFault`].
    pub missed_faults: usize,
    /// See [`MissKind::FalseClear`].
    pub false_clears: usize,
    /// See [`MissKind::MissedRelease`].
    pub missed_releases: usize,
    /// See [`MissKind::Checkpoint`].
    pub checkpoint_misses: usize,
    /// See [`MissKind::Other`].
    pub other_misses: usize,
}

impl Summary {
    /// Adds another run's counts.
    pub fn add(&mut self, o: &Summary) {
        self.runs += o.runs;
        self.decisions += o.decisions;
        self.incidents += o.incidents;
        self.quarantines += o.quarantines;
        self.releases += o.releases;
        self.scheduled += o.scheduled;
        self.nodes_out += o.nodes_out;
        self.oscillations += o.oscillations;
        self.checked += o.checked;
        self.failed_runs += o.failed_runs;
        self.false_quarantines += o.false_quarantines;
        self.missed_faults += o.missed_faults;
        self.false_clears += o.false_clears;
        self.missed_releases += o.missed_releases;
        self.checkpoint_misses += o.checkpoint_misses;
        self.other_misses += o.other_misses;
    }

    fn count(&mut self, misses: &[Miss]) {
        for m in misses {
            *match m.kind {
                MissKind::FalseQuarantine => &mut self.false_quarantines,
                MissKind::MissedFault => &mut self.missed_faults,
                MissKind::FalseClear => &mut self.false_clears,
                MissKind::MissedRelease => &mut self.missed_releases,
                MissKind::Checkpoint => &mut self.checkpoint_misses,
                MissKind::Other => &mut self.other_misses,
            } += 1;
        }
        if !misses.is_empty() {
            self.failed_runs += 1;
        }
    }
}

impl fmt::Display for Summary {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let runs = if self.runs == 1 { String::new() } else { format!(" ({} runs)", self.runs) };
        writeln!(f, "Decision quality{runs}")?;
        let row =
            |f: &mut fmt::Formatter<'_>, name: &str, n: usize, note: String| writeln!(f, "  {name:<20} {n:>6}{note}");
        row(f, "decisions", self.decisions, String::new())?;
        row(f, "incidents", self.incidents, String::new())?;
        row(f, "quarantines", self.quarantines, format!("  ({} nodes taken out)", self.nodes_out))?;
        row(f, "releases", self.releases, String::new())?;
        row(f, "oscillations", self.oscillations, String::new())?;
        if self.scheduled > 0 {
            row(f, "scheduled", self.scheduled, "  (not_before after the end)".into())?;
        }
        if self.checked > 0 {
            let failed = if self.runs > 1 { format!(", {} runs failed", self.failed_runs) } else { String::new() };
            writeln!(f, "Against expectations ({} checked{failed})", self.checked)?;
            row(f, "false quarantines", self.false_quarantines, String::new())?;
            row(f, "missed faults", self.missed_faults, String::new())?;
            row(f, "false clears", self.false_clears, String::new())?;
            row(f, "missed releases", self.missed_releases, String::new())?;
            row(f, "checkpoint misses", self.checkpoint_misses, String::new())?;
            row(f, "other misses", self.other_misses, String::new())?;
        }
        Ok(())
    }
}

/// Merges spans into disjoint episodes, in time order.
fn episodes(mut spans: Vec<Span>) -> Vec<Span> {
    spans.sort_by_key(|s| s.from);
    let mut out: Vec<Span> = Vec::new();
    for s in spans {
        match out.last_mut() {
            Some(last) if last.to.is_none_or(|to| s.from <= to) => {
                last.to = match (last.to, s.to) {
                    (Some(a), Some(b)) => Some(a.max(b)),
                    _ => None,
                };
            }
            _ => out.push(s),
        }
    }
    out
}

/// The most disruptive of an action and its follow-ups.
fn worst_action(d: &Decision) -> Action {
    d.then.iter().copied().fold(d.action, Action::max)
}

impl Timeline {
    /// An empty timeline.
    pub fn new(options: Options) -> Timeline {
        Timeline { options, ..Timeline::default() }
    }

    /// A timeline of `decisions`, each issued at its own `decided_at_micros`.
    pub fn of(options: Options, decisions: &[Decision]) -> Timeline {
        let mut t = Timeline::new(options);
        for d in decisions {
            t.push(d, None);
        }
        t
    }

    /// Adds the next decision, issued at `issued_at` when known (a decision stamped after it was
    /// issued counts from when it was issued).
    pub fn push(&mut self, d: &Decision, issued_at: Option<i64>) {
        let at = issued_at.map_or(d.decided_at_micros, |i| i.min(d.decided_at_micros));
        self.decisions.push(d.clone());
        let track = self.incidents.entry(d.incident_id).or_insert_with(|| Track {
            node: d.node.clone(),
            gpu: d.gpu.clone(),
            spans: Vec::new(),
        });
        if d.recovery {
            if let Some(open) = track.spans.last_mut()
                && open.to.is_none()
            {
                if at <= open.from {
                    // Withdrawn before it took effect: it never did.
                    track.spans.pop();
                } else {
                    open.to = Some(at);
                }
            }
        } else if quarantines(d) {
            let from = at.max(d.not_before_micros.unwrap_or(i64::MIN));
            match track.spans.last_mut() {
                Some(open) if open.to.is_none() => open.from = open.from.min(from),
                _ => track.spans.push(Span { from, to: None }),
            }
        }
    }

    /// The decisions, in the order they were pushed.
    pub fn decisions(&self) -> &[Decision] {
        &self.decisions
    }

    fn covers(&self, track: &Track, target: &Target) -> bool {
        track.node == target.node
            && match (&target.gpu, &track.gpu) {
                (None, None) => true,
                (None, Some(_)) => !self.options.gpu_level_quarantine,
                (Some(_), None) => true,
                (Some(g), Some(tg)) => g == tg,
            }
    }

    /// The spans that hold `target` out, as seen at `end` (later effects left out, later
    /// releases not yet happened).
    fn spans(&self, target: &Target, end: Option<i64>) -> Vec<Span> {
        let end = end.unwrap_or(i64::MAX);
        self.incidents
            .values()
            .filter(|t| self.covers(t, target))
            .flat_map(|t| t.spans.iter().copied())
            .filter(|s| s.from <= end)
            .map(|s| Span { from: s.from, to: s.to.filter(|to| *to <= end) })
            .collect()
    }

    /// True when `target` is in service at `at`.
    pub fn in_service(&self, target: &Target, at: i64) -> bool {
        !self.spans(target, None).iter().any(|s| s.covers(at))
    }

    fn names(&self, d: &Decision, target: &Target) -> bool {
        d.node == target.node && (target.gpu.is_none() || d.gpu == target.gpu)
    }

    /// The nodes and GPUs any decision named.
    pub fn targets(&self) -> BTreeSet<Target> {
        let mut out = BTreeSet::new();
        for d in &self.decisions {
            out.insert(Target::node(&d.node));
            if let Some(g) = &d.gpu {
                out.insert(Target::gpu(&d.node, g));
            }
        }
        out
    }

    /// The counts at `end` (after every decision when `None`), and with `expectations` every
    /// miss.
    pub fn evaluate(&self, expectations: Option<&Expectations>, end: Option<i64>) -> (Summary, Vec<Miss>) {
        let last = end.unwrap_or(i64::MAX);
        let mut s =
            Summary { runs: 1, decisions: self.decisions.len(), incidents: self.incidents.len(), ..Default::default() };
        for track in self.incidents.values() {
            for span in &track.spans {
                if span.from > last {
                    s.scheduled += 1;
                    continue;
                }
                s.quarantines += 1;
                if span.to.is_some_and(|to| to <= last) {
                    s.releases += 1;
                }
            }
        }
        let mut targets = self.targets();
        if let Some(e) = expectations {
            targets.extend(e.targets.iter().map(|(t, _)| t.clone()));
        }
        let mut nodes_out = BTreeSet::new();
        let mut again = BTreeSet::new();
        for t in &targets {
            let eps = episodes(self.spans(t, end));
            if t.gpu.is_none() && !eps.is_empty() {
                nodes_out.insert(t.node.clone());
            }
            for ep in eps.iter().skip(1) {
                again.insert((t.node.clone(), ep.from));
            }
        }
        s.nodes_out = nodes_out.len();
        s.oscillations = again.len();
        let mut misses = Vec::new();
        if let Some(e) = expectations {
            for (target, expect) in &e.targets {
                s.checked += self.check(target, expect, end, &mut misses);
            }
            for c in &e.checkpoints {
                s.checked += 1;
                let got = self.in_service(&c.target, c.at_micros);
                if got != c.in_service {
                    misses.push(Miss {
                        kind: MissKind::Checkpoint,
                        target: c.target.to_string(),
                        what: format!("in_service at {}", c.label),
                        expected: c.in_service.to_string(),
                        got: got.to_string(),
                    });
                }
            }
            if let Some(want) = e.oscillations {
                s.checked += 1;
                if want != s.oscillations {
                    misses.push(Miss {
                        kind: MissKind::Other,
                        target: "run".into(),
                        what: "oscillations".into(),
                        expected: want.to_string(),
                        got: s.oscillations.to_string(),
                    });
                }
            }
        }
        s.count(&misses);
        (s, misses)
    }

    /// Checks one target; returns how many expectations were checked.
    fn check(&self, target: &Target, e: &Expect, end: Option<i64>, misses: &mut Vec<Miss>) -> usize {
        let eps = episodes(self.spans(target, end));
        let quarantined = !eps.is_empty();
        let released = eps.last().is_some_and(|s| s.to.is_some());
        let named: Vec<&Decision> = self.decisions.iter().filter(|d| !d.recovery && self.names(d, target)).collect();
        let action = named.iter().map(|d| worst_action(d)).max().unwrap_or(Action::None);
        let severity = named.iter().map(|d| Worst::from(d.severity)).max().unwrap_or(Worst::None);
        let incidents: BTreeSet<Uuid> = named.iter().map(|d| d.incident_id).collect();
        let mut checked = 0;
        let mut miss = |kind: MissKind, what: &str, expected: String, got: String| {
            misses.push(Miss { kind, target: target.to_string(), what: what.into(), expected, got });
        };
        if let Some(want) = e.quarantined {
            checked += 1;
            if want != quarantined {
                let kind = if want { MissKind::MissedFault } else { MissKind::FalseQuarantine };
                miss(kind, "quarantined", want.to_string(), quarantined.to_string());
            }
        }
        if let Some(want) = e.released {
            checked += 1;
            if want != released {
                let kind = if want { MissKind::MissedRelease } else { MissKind::FalseClear };
                let got = match (quarantined, released) {
                    (false, _) => "never quarantined".to_owned(),
                    (true, r) => r.to_string(),
                };
                miss(kind, "released", want.to_string(), got);
            }
        }
        if let Some(want) = e.action {
            checked += 1;
            if want != action {
                miss(MissKind::Other, "action", want.to_string(), action.to_string());
            }
        }
        if let Some(want) = e.severity {
            checked += 1;
            if want != severity {
                miss(MissKind::Other, "severity", want.to_string(), severity.to_string());
            }
        }
        if let Some(want) = e.quarantines {
            checked += 1;
            if want != eps.len() {
                miss(MissKind::Other, "quarantines", want.to_string(), eps.len().to_string());
            }
        }
        if let Some(want) = e.incidents {
            checked += 1;
            if want != incidents.len() {
                miss(MissKind::Other, "incidents", want.to_string(), incidents.len().to_string());
            }
        }
        for never in &e.never {
            checked += 1;
            if let Some(d) = named.iter().find(|d| d.action == *never || d.then.contains(never)) {
                miss(MissKind::Other, "never", format!("no {never}"), format!("{never} from {}", d.rule_id));
            }
        }
        checked
    }
}

/// The summary of `decisions` (each issued at its own time), without expectations.
pub fn summarize(decisions: &[Decision]) -> Summary {
    Timeline::of(Options::default(), decisions).evaluate(None, None).0
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rules::DecisionKind;

    const M: i64 = 60_000_000;

    fn d(incident: u128, node: &str, gpu: Option<&str>, at: i64, action: Action) -> Decision {
        Decision {
            verdict_id: Uuid::from_u128(at as u128),
            incident_id: Uuid::from_u128(incident),
            step: 0,
            kind: DecisionKind::Open,
            rule_id: "r".into(),
            rule_version: 1,
            node: node.into(),
            gpu: gpu.map(str::to_owned),
            gpu_index: None,
            gpu_pci: None,
            not_before_micros: None,
            deferrable: false,
            severity: Severity::Critical,
            action,
            then: Vec::new(),
            custom: None,
            reason: String::new(),
            evidence: Vec::new(),
            recovery: false,
            supersedes: Vec::new(),
            synthetic: false,
            nvlink_domain: None,
            decided_at_micros: at,
        }
    }

    fn recover(incident: u128, node: &str, gpu: Option<&str>, at: i64) -> Decision {
        Decision { recovery: true, kind: DecisionKind::Recover, ..d(incident, node, gpu, at, Action::None) }
    }

    #[test]
    fn what_quarantines() {
        assert!(quarantines(&d(1, "n", None, 0, Action::Cordon)));
        assert!(!quarantines(&d(1, "n", None, 0, Action::RunDiagnostics)));
        assert!(!quarantines(&Decision { deferrable: true, ..d(1, "n", None, 0, Action::ResetGpu) }));
        assert!(!quarantines(&recover(1, "n", None, 0)));
    }

    #[test]
    fn a_gpu_incident_takes_out_its_gpu_and_node_but_not_its_peers() {
        let t = Timeline::of(
            Options::default(),
            &[d(1, "n", Some("g0"), 10 * M, Action::ResetGpu), recover(1, "n", Some("g0"), 50 * M)],
        );
        assert!(t.in_service(&Target::node("n"), 5 * M));
        assert!(!t.in_service(&Target::node("n"), 10 * M));
        assert!(!t.in_service(&Target::gpu("n", "g0"), 49 * M));
        assert!(t.in_service(&Target::gpu("n", "g1"), 20 * M));
        assert!(t.in_service(&Target::node("n"), 50 * M));
        let gpu_level = Timeline::of(Options { gpu_level_quarantine: true }, t.decisions());
        assert!(gpu_level.in_service(&Target::node("n"), 20 * M));
        assert!(!gpu_level.in_service(&Target::gpu("n", "g0"), 20 * M));
        let (s, _) = t.evaluate(None, None);
        assert_eq!((s.quarantines, s.releases, s.nodes_out, s.oscillations), (1, 1, 1, 0));
    }

    #[test]
    fn a_node_incident_covers_every_gpu() {
        let t = Timeline::of(Options { gpu_level_quarantine: true }, &[d(1, "n", None, 0, Action::RebootNode)]);
        assert!(!t.in_service(&Target::gpu("n", "g7"), M));
        assert!(t.in_service(&Target::node("m"), M));
    }

    #[test]
    fn not_before_delays_and_an_early_withdrawal_cancels() {
        let planned = Decision { not_before_micros: Some(100 * M), ..d(1, "n", None, 0, Action::Drain) };
        let t = Timeline::of(Options::default(), std::slice::from_ref(&planned));
        assert!(t.in_service(&Target::node("n"), 99 * M));
        assert!(!t.in_service(&Target::node("n"), 100 * M));
        assert_eq!(t.evaluate(None, Some(50 * M)).0.scheduled, 1);
        let t = Timeline::of(Options::default(), &[planned, recover(1, "n", None, 10 * M)]);
        let (s, _) = t.evaluate(None, None);
        assert_eq!((s.quarantines, s.releases, s.nodes_out), (0, 0, 0));
    }

    #[test]
    fn flapping_is_an_oscillation_counted_once_per_node_and_time() {
        let t = Timeline::of(
            Options::default(),
            &[
                d(1, "n", Some("g0"), 0, Action::ResetGpu),
                recover(1, "n", Some("g0"), 10 * M),
                d(2, "n", Some("g0"), 20 * M, Action::ResetGpu),
            ],
        );
        let (s, _) = t.evaluate(None, None);
        assert_eq!((s.quarantines, s.releases, s.oscillations), (2, 1, 1));
    }

    #[test]
    fn decisions_stamped_in_the_future_count_from_when_they_were_issued() {
        let mut t = Timeline::new(Options::default());
        t.push(&d(1, "n", None, 0, Action::Drain), Some(0));
        t.push(&recover(1, "n", None, 1000 * M), Some(5 * M));
        assert!(t.in_service(&Target::node("n"), 6 * M));
    }

    #[test]
    fn expectations_are_checked_and_misses_classified() {
        let t = Timeline::of(
            Options::default(),
            &[d(1, "a", Some("g0"), 0, Action::Cordon), recover(1, "a", Some("g0"), 10 * M)],
        );
        let e = Expectations {
            targets: vec![
                (Target::node("a"), Expect { quarantined: Some(false), ..Default::default() }),
                (
                    Target::gpu("a", "g0"),
                    Expect { released: Some(false), action: Some(Action::Drain), ..Default::default() },
                ),
                (
                    Target::node("b"),
                    Expect { quarantined: Some(true), severity: Some(Worst::None), ..Default::default() },
                ),
            ],
            checkpoints: vec![Checkpoint {
                at_micros: 5 * M,
                target: Target::node("a"),
                in_service: true,
                label: "5m".into(),
            }],
            oscillations: Some(0),
        };
        let (s, misses) = t.evaluate(Some(&e), None);
        let kinds: Vec<MissKind> = misses.iter().map(|m| m.kind).collect();
        assert_eq!(
            kinds,
            [
                MissKind::FalseQuarantine,
                MissKind::FalseClear,
                MissKind::Other,
                MissKind::MissedFault,
                MissKind::Checkpoint
            ]
        );
        assert_eq!((s.checked, s.false_quarantines, s.false_clears, s.missed_faults, s.failed_runs), (7, 1, 1, 1, 1));
        let text = s.to_string();
        assert!(text.contains("false clears") && text.contains("Against expectations (7 checked)"), "{text}");
    }
}
