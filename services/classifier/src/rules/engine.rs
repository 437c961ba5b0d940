//! The engine: observations in, decisions (verdicts-to-be) out, with incidents per rule, node
//! and GPU.
//!
//! An incident opens on a rule's first firing and is not fired again while it is open: a later
//! firing only yields a decision when it raises the action or the severity (flap damping). It
//! closes only on explicit healthy evidence that stands for the rule's quiet period without new
//! fault evidence. Time is the observations' own (`observed_at_micros`, kept monotonic per node)
//! or an explicit [`Engine::tick`], never the wall clock, so replaying the same input gives the
//! same decisions with the same ids.

use std::borrow::Cow;
use std::collections::{BTreeMap, VecDeque};
use std::sync::Arc;

use serde::{Deserialize, Serialize};
use uuid::Uuid;

use super::facts::{MAX_GPUS, NodeFacts};
use super::id::{Id, IdSet};
use super::keys::SortedMap;
use super::model::{Action, Proof, Rule, RuleSet, Scope, Severity, SyntheticPolicy, codes_contain, normalise_key};
use super::observation::{DomainRoot, FieldValue, Observation};
use super::sanity::{self, Invalid};
use super::state::{CondState, Firing, MAX_EVIDENCE};

/// How many refused observations wait for [`Engine::take_refused`] before the oldest give way.
const MAX_REFUSED: usize = 10_000;

/// How many absorbed events wait for [`Engine::take_absorbed`] before the oldest give way.
const MAX_ABSORBED: usize = 10_000;

/// A sympathetic event recorded as evidence on another GPU's root incident instead of opening an
/// incident of its own: on the same node (from the engine's own state) or on another node of the
/// GPU's NVLink domain (from [`Observation::domain_roots`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Absorbed {
    /// The event.
    pub event_id: String,
    /// The node that logged it.
    pub node: String,
    /// The GPU that logged it.
    pub gpu: Option<String>,
    /// When it counted (the node's clock), in microseconds since the Unix epoch.
    pub at_micros: i64,
    /// The root incident it is evidence on.
    pub incident_id: Uuid,
    /// The rule of the root incident.
    pub root_rule: String,
    /// The root GPU's node.
    pub root_node: String,
    /// The root GPU.
    pub root_gpu: Option<String>,
    /// When the root incident opened.
    pub root_opened_at_micros: i64,
}

/// An observation the engine refused before any rule saw it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Refused {
    /// The node.
    pub node: String,
    /// The event.
    pub event_id: String,
    /// Why.
    pub reason: Invalid,
}

/// The namespace of every incident and verdict id (UUIDv5), fixed forever so ids stay stable
/// across releases.
pub const ID_NAMESPACE: Uuid = Uuid::from_u128(0x6770_756d_6564_6963_8a1e_5c0d_1f2b_3a47);

/// How many recent event ids per node are remembered to ignore redeliveries: about an hour of a
/// node's steady stream (0.03 events a second) and two minutes of its start round. The service
/// finds every duplicate of a recorded event in Postgres, and one within a batch by the batch's
/// own keys, before the engine sees it (docs/pipeline.md); the replay tools keep every key they
/// read. This window is the engine's own last line, and at 100,000 nodes each 1,024 ids took
/// 0.8 GB.
const RECENT_IDS: usize = 128;

/// A stable 64-bit digest of an event id (FNV-1a): remembering digests rather than ids keeps the
/// redelivery filter at 8 KiB per node ([`RecentIds`]), and unlike std's hasher it is the same in every release,
/// so a snapshot restored by a newer binary still recognises its ids.
fn digest(id: &str) -> u64 {
    id.bytes().fold(0xcbf2_9ce4_8422_2325, |h, b| (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3))
}

/// The version of [`Snapshot`]'s layout.
pub const SNAPSHOT_FORMAT: u32 = 1;

/// What a decision does to its incident.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum DecisionKind {
    /// The incident opened.
    Open,
    /// The incident's action or severity went up.
    Escalate,
    /// An override rule (Xid 154) changed the action it names.
    Override,
    /// The incident closed on healthy evidence.
    Recover,
}

/// A verdict-to-be: what the classifier publishes and records.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Decision {
    /// Deterministic: UUIDv5 over the incident id and the step.
    pub verdict_id: Uuid,
    /// Deterministic: UUIDv5 over the rule id and version, node, GPU and first evidence id.
    pub incident_id: Uuid,
    /// 0 for the opening decision, then one more for each decision on the incident.
    pub step: u32,
    /// What the decision does.
    pub kind: DecisionKind,
    /// The rule.
    pub rule_id: String,
    /// The rule's version.
    pub rule_version: u32,
    /// The node.
    pub node: String,
    /// The GPU, for GPU-scoped rules whose evidence names one (its canonical identity).
    pub gpu: Option<String>,
    /// The GPU's NVML index, when the evidence named it.
    #[serde(default)]
    pub gpu_index: Option<i32>,
    /// The GPU's PCI bus id, when the evidence named it.
    #[serde(default)]
    pub gpu_pci: Option<String>,
    /// The action must not be taken before this time (a cloud maintenance window, less the lead).
    #[serde(default)]
    pub not_before_micros: Option<i64>,
    /// The action may wait until the GPU has no workload or a maintenance window opens (a
    /// contained error: the GPU keeps serving other work safely).
    #[serde(default)]
    pub deferrable: bool,
    /// The incident's severity (for a recovery, the severity that was cleared).
    pub severity: Severity,
    /// The recommended action (`none` for a recovery).
    pub action: Action,
    /// Follow-up actions, in order.
    pub then: Vec<Action>,
    /// The operator-defined action, for `custom`.
    pub custom: Option<String>,
    /// Why, for humans.
    pub reason: String,
    /// The event ids that led here, oldest first, at most 32.
    pub evidence: Vec<String>,
    /// True for a recovery: the remediator may undo what it did for the incident.
    pub recovery: bool,
    /// Incidents whose action this decision replaces (Xid 154 overriding the guess from other
    /// Xids on the same GPU).
    pub supersedes: Vec<Uuid>,
    /// True when any evidence was injected.
    pub synthetic: bool,
    /// The NVLink domain of the GPU, on the opening decision of an incident that can be the root
    /// of sympathetic errors on other nodes of that domain (a rule named in a `sympathetic.to`,
    /// opened by evidence that is not itself sympathetic). Recorded on the incident, where other
    /// replicas find it.
    #[serde(default)]
    pub nvlink_domain: Option<String>,
    /// The observation time the decision belongs to (a deadline's own time when a burst end,
    /// a held threshold or a quiet period decided it).
    pub decided_at_micros: i64,
}

/// An open incident.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Incident {
    /// Deterministic id.
    pub id: Uuid,
    /// When it opened.
    pub opened_at: i64,
    /// The latest step.
    pub step: u32,
    /// Current severity.
    pub severity: Severity,
    /// Current action.
    pub action: Action,
    /// Current follow-ups.
    pub then: Vec<Action>,
    /// Evidence so far, capped: event ids, held as [`Id`]s (a UUID inline, not a 36-character
    /// string on the heap: with the fault mix, a node's open incidents hold some hundred).
    pub evidence: Vec<Id>,
    /// Any evidence was injected.
    pub synthetic: bool,
    /// Healthy evidence that started the quiet period, and when.
    pub clear_since: Option<(i64, Id)>,
    /// The override incident that replaced this incident's action.
    pub overridden_by: Option<Uuid>,
    /// The node's boot id when the incident opened.
    #[serde(default)]
    pub boot: Option<String>,
    /// The GPUs a node-wide incident's fault evidence named: its healthy evidence must come from
    /// each of them.
    #[serde(default)]
    pub gpus: IdSet,
    /// The failed GPUs that have shown healthy evidence since the proof of repair.
    #[serde(default)]
    pub cleared: IdSet,
}

/// An incident the store holds open, as [`Engine::reattach`] takes it.
#[derive(Debug, Clone, PartialEq)]
pub struct StoredIncident {
    /// The incident's id.
    pub incident_id: Uuid,
    /// The node.
    pub node: String,
    /// The rule.
    pub rule_id: String,
    /// The GPU, for a GPU-scoped incident.
    pub gpu: Option<String>,
    /// Its severity now.
    pub severity: Severity,
    /// The action of its latest verdict.
    pub action: Action,
    /// When it opened (microseconds since the epoch).
    pub opened_at_micros: i64,
    /// How many verdicts it has had (the next one takes this as its step).
    pub verdicts: u32,
}

/// What [`Engine::reattach`] did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Reattached {
    /// Replayed incidents that took the stored incident's identity.
    pub renamed: usize,
    /// Stored incidents followed again with no replayed evidence.
    pub restored: usize,
    /// Stored incidents of rules the rule set no longer has.
    pub unknown_rule: usize,
}

/// The state of one rule for one node or GPU.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct KeyState {
    /// The rule version the state was built under.
    pub version: u32,
    /// The condition's state.
    pub cond: CondState,
    /// The open incident.
    pub incident: Option<Box<Incident>>,
}

/// A rule's state is kept per rule and GPU (none for a node-wide rule): the rule named by the
/// rule set's own shared name and the GPU by [`Id`], so a node's fifty-odd keys copy no string.
type Key = (Arc<str>, Option<Id>);

/// A node's rule keys and their state, in the order of their keys.
type Keys = SortedMap<Key, KeyState>;

/// The digests of a node's last [`RECENT_IDS`] event ids, to ignore a redelivered event: one
/// ring of them, searched in full for each event: 1 KB a node. A ring beside a hash set of the
/// same digests took 34 KB a node when it held 1,024 (3.4 GB at 100,000 nodes).
#[derive(Debug, Clone, Default)]
struct RecentIds {
    /// Digests; once full, `oldest` is where the oldest is (and the next one goes).
    ids: Vec<u64>,
    oldest: usize,
}

impl RecentIds {
    /// From digests oldest first (a snapshot's), keeping the last [`RECENT_IDS`].
    fn from_oldest_first(ids: Vec<u64>) -> RecentIds {
        let skip = ids.len().saturating_sub(RECENT_IDS);
        RecentIds { ids: ids.into_iter().skip(skip).collect(), oldest: 0 }
    }

    /// Remembers `id`; false when it was remembered already (a redelivery), and then nothing
    /// changes.
    fn insert(&mut self, id: u64) -> bool {
        if self.ids.contains(&id) {
            return false;
        }
        if self.ids.len() < RECENT_IDS {
            self.ids.push(id);
        } else {
            self.ids[self.oldest] = id;
            self.oldest = (self.oldest + 1) % RECENT_IDS;
        }
        true
    }

    /// The digests, oldest first.
    fn oldest_first(&self) -> impl Iterator<Item = u64> + '_ {
        self.ids[self.oldest..].iter().chain(&self.ids[..self.oldest]).copied()
    }

    #[cfg(test)]
    fn len(&self) -> usize {
        self.ids.len()
    }
}

#[derive(Debug, Clone, Default)]
struct NodeState {
    clock: i64,
    recent: RecentIds,
    keys: Keys,
    next_deadline: Option<i64>,
    facts: NodeFacts,
}

/// What one observation meant to the engine's state ([`Engine::observe_bearing`]). An
/// observation with no bearing changed nothing a replay depends on (beyond the node's clock and
/// its memory of recent event ids): a rebuild that leaves it out reaches the same incidents.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Bearing {
    /// Evidence for or against an incident: it moved a rule's condition or an open incident
    /// (fault evidence, a sample a rate keeps, the healthy evidence or proof an incident waits
    /// for), or a decision was made at its time.
    pub evidence: bool,
    /// It changed what the engine knows of the node ([`NodeFacts`]: boot, GPU names, inventory,
    /// counters, resets, recent Xid lines), or it was the node's first.
    pub facts: bool,
    /// Refused as impossible, or ignored as synthetic: kept so an operator can see it.
    pub refused: bool,
}

impl Bearing {
    /// True when a replay needs the observation, or an operator wants to see it.
    pub fn matters(&self) -> bool {
        self.evidence || self.facts || self.refused
    }
}

/// An open incident, as [`Engine::open_incidents`] lists them.
#[derive(Debug, Clone, PartialEq)]
pub struct OpenIncident {
    /// The incident id.
    pub incident_id: Uuid,
    /// The rule.
    pub rule_id: String,
    /// The node.
    pub node: String,
    /// The GPU.
    pub gpu: Option<String>,
    /// Current severity.
    pub severity: Severity,
    /// Current action.
    pub action: Action,
}

/// Everything the engine knows, to persist across a restart.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Snapshot {
    /// [`SNAPSHOT_FORMAT`].
    pub format: u32,
    /// Per node.
    pub nodes: Vec<NodeSnapshot>,
}

/// One node's state in a [`Snapshot`].
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct NodeSnapshot {
    /// The node.
    pub node: String,
    /// The node's clock.
    pub clock: i64,
    /// Digests of recent event ids, oldest first.
    pub recent: Vec<u64>,
    /// Per rule and GPU.
    pub keys: Vec<KeySnapshot>,
    /// The node's boot, GPUs, resets and counters.
    #[serde(default)]
    pub facts: NodeFacts,
}

/// One rule's state for one node or GPU in a [`Snapshot`].
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct KeySnapshot {
    /// The rule id.
    pub rule: String,
    /// The GPU.
    pub gpu: Option<String>,
    /// The state.
    pub state: KeyState,
}

/// Why a snapshot could not be restored.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RestoreError {
    /// Written by another engine version.
    #[error("snapshot format {found} is not supported (expected {SNAPSHOT_FORMAT})")]
    Format {
        /// The format found.
        found: u32,
    },
}

/// The rules engine.
#[derive(Debug, Clone)]
pub struct Engine {
    rules: RuleSet,
    nodes: BTreeMap<String, NodeState>,
    refused: VecDeque<Refused>,
    absorbed: VecDeque<Absorbed>,
}

fn incident_id(rule: &Rule, node: &str, gpu: Option<&str>, first: &str) -> Uuid {
    // Unit separators keep ("a", "b/c") and ("a/b", "c") apart.
    let name =
        format!("incident\u{1f}{}\u{1f}{}\u{1f}{node}\u{1f}{}\u{1f}{first}", rule.id, rule.version, gpu.unwrap_or(""));
    Uuid::new_v5(&ID_NAMESPACE, name.as_bytes())
}

fn verdict_id(incident: Uuid, step: u32) -> Uuid {
    Uuid::new_v5(&ID_NAMESPACE, format!("verdict\u{1f}{incident}\u{1f}{step}").as_bytes())
}

/// How disruptive an outcome is: escalation means this goes up.
fn weight(severity: Severity, action: Action, then: &[Action]) -> (Action, Severity) {
    (then.iter().copied().fold(action, Action::max), severity)
}

struct Outcome {
    severity: Severity,
    action: Action,
    then: Vec<Action>,
    note: Option<String>,
    deferrable: bool,
    not_before: Option<i64>,
}

impl Engine {
    /// An engine with no state.
    pub fn new(rules: RuleSet) -> Engine {
        Engine { rules, nodes: BTreeMap::new(), refused: VecDeque::new(), absorbed: VecDeque::new() }
    }

    /// The observations refused since the last call, oldest first (at most 10,000 are kept), for
    /// the service to count and log.
    pub fn take_refused(&mut self) -> Vec<Refused> {
        self.refused.drain(..).collect()
    }

    /// The sympathetic events absorbed into root incidents since the last call, oldest first (at
    /// most 10,000 are kept), for the service to record as evidence on those incidents.
    pub fn take_absorbed(&mut self) -> Vec<Absorbed> {
        self.absorbed.drain(..).collect()
    }

    /// An engine whose state is what feeding `observations` (in order) leaves, for a restart
    /// without a snapshot: re-read the topic from the retained offsets and discard the decisions,
    /// which were published before the restart.
    pub fn rebuild<'a>(rules: RuleSet, observations: impl IntoIterator<Item = &'a Observation>) -> Engine {
        let mut engine = Engine::new(rules);
        for o in observations {
            engine.observe(o);
        }
        engine
    }

    /// Keeps the state of the nodes `keep` accepts and forgets the others (their partitions went
    /// to another replica); returns how many were forgotten.
    pub fn retain_nodes(&mut self, mut keep: impl FnMut(&str) -> bool) -> usize {
        let before = self.nodes.len();
        self.nodes.retain(|name, _| keep(name));
        before - self.nodes.len()
    }

    /// Takes over the nodes of `rebuilt` (an engine rebuilt from their recorded events), replacing
    /// any state held for them. What `rebuilt` refused was counted when first seen.
    pub fn adopt(&mut self, rebuilt: Engine) {
        self.nodes.extend(rebuilt.nodes);
    }

    /// Puts the incidents the store holds open back under the engine after a rebuild from
    /// events, so none is orphaned: a rebuild under a new rule version gives a replayed fault a
    /// new incident id, and an incident opened before the rebuild window has no event left to
    /// replay. A replayed incident on the same (rule, GPU) takes the stored identity and step; a
    /// stored incident with none is followed again as it stood (severity, action, opened at),
    /// and clears on the current rule's evidence and proof like any other. Incidents of a rule
    /// the rule set no longer has are left alone and counted.
    pub fn reattach(&mut self, stored: Vec<StoredIncident>) -> Reattached {
        let mut done = Reattached::default();
        for s in stored {
            let Some(rule) = self.rules.get(&s.rule_id) else {
                done.unknown_rule += 1;
                continue;
            };
            let gpu = if rule.scope == Scope::Node { None } else { s.gpu.as_deref().map(Id::new) };
            let key: Key = (rule.id.clone(), gpu);
            let node = self.nodes.entry(s.node.clone()).or_default();
            let step = s.verdicts.saturating_sub(1);
            match node.keys.get_mut(&key).and_then(|st| st.incident.as_mut()) {
                Some(inc) if inc.id == s.incident_id => continue,
                Some(inc) => {
                    inc.id = s.incident_id;
                    inc.step = inc.step.max(step);
                    inc.opened_at = inc.opened_at.min(s.opened_at_micros);
                    done.renamed += 1;
                }
                None => {
                    let st = node.keys.get_or_insert_with(&key, || KeyState {
                        version: rule.version,
                        cond: CondState::new(&rule.condition),
                        incident: None,
                    });
                    st.version = rule.version;
                    st.incident = Some(Box::new(Incident {
                        id: s.incident_id,
                        opened_at: s.opened_at_micros,
                        step,
                        severity: s.severity,
                        action: s.action,
                        then: Vec::new(),
                        evidence: Vec::new(),
                        synthetic: false,
                        clear_since: None,
                        overridden_by: None,
                        boot: None,
                        gpus: IdSet::default(),
                        cleared: IdSet::default(),
                    }));
                    done.restored += 1;
                }
            }
            node.next_deadline = Some(i64::MIN);
        }
        done
    }

    /// How many nodes the engine holds state for.
    pub fn node_count(&self) -> usize {
        self.nodes.len()
    }

    /// How many nodes have a time-based decision still to come (a threshold being held, a quiet
    /// period being counted): the decisions a tick may yet make with no new event. Exact right
    /// after [`Engine::tick`].
    pub fn nodes_awaiting_time(&self) -> usize {
        self.nodes.values().filter(|n| n.next_deadline.is_some()).count()
    }

    /// The rules in force.
    pub fn rules(&self) -> &RuleSet {
        &self.rules
    }

    /// Replaces the rules (after a successful reload), keeping the state of every rule whose id
    /// and version are unchanged. A changed rule (same id, new version) starts counting afresh
    /// but keeps its open incidents, followed under the new version; a removed rule's state is
    /// dropped.
    pub fn replace_rules(&mut self, rules: RuleSet) {
        self.rules = rules;
        let rules = &self.rules;
        for node in self.nodes.values_mut() {
            node.keys.retain(|(rule_id, _), st| {
                let Some(r) = rules.get(rule_id) else { return false };
                if r.version == st.version && st.cond.fits(&r.condition) {
                    return true;
                }
                // A changed rule (a new version) starts counting afresh, but its open incidents
                // stay followed under the new version, so they clear on its evidence: a version
                // bump never orphans an open incident and the quarantine it holds.
                if st.incident.is_some() {
                    st.version = r.version;
                    st.cond = CondState::new(&r.condition);
                    return true;
                }
                false
            });
            node.next_deadline = Some(i64::MIN);
        }
    }

    /// Takes one observation and returns the decisions it (and any deadline its time passes)
    /// leads to. A redelivered event id is ignored.
    pub fn observe(&mut self, o: &Observation) -> Vec<Decision> {
        self.observe_bearing(o).0
    }

    /// [`Engine::observe`], also saying what the observation meant to the state ([`Bearing`]):
    /// the store keeps what a replay needs to reach the same state, and may leave out the rest.
    pub fn observe_bearing(&mut self, o: &Observation) -> (Vec<Decision>, Bearing) {
        if o.synthetic && self.rules.synthetic == SyntheticPolicy::Ignored {
            return (Vec::new(), Bearing { refused: true, ..Default::default() });
        }
        let first = !self.nodes.contains_key(&o.node);
        if first {
            self.nodes.insert(o.node.clone(), NodeState::default());
        }
        let Some(node) = self.nodes.get_mut(&o.node) else { return (Vec::new(), Bearing::default()) };
        let id = digest(&o.event_id);
        if !node.recent.insert(id) {
            return (Vec::new(), Bearing::default());
        }
        let mut bearing = Bearing { facts: first, ..Default::default() };
        if let Err(reason) = sanity::check(o, &node.facts) {
            if self.refused.len() >= MAX_REFUSED {
                self.refused.pop_front();
            }
            self.refused.push_back(Refused { node: o.node.clone(), event_id: o.event_id.clone(), reason });
            bearing.refused = true;
            return (Vec::new(), bearing);
        }
        // A PCI bus id this node's evidence has tied to a UUID names that GPU (the enricher
        // resolves references; this catches what it could not, e.g. before an inventory).
        let o: Cow<'_, Observation> = match o.gpu.as_deref().and_then(|g| node.facts.canonical(g)) {
            Some(uuid) => {
                let mut c = o.clone();
                c.gpu_pci = c.gpu.take();
                c.gpu = Some(uuid);
                Cow::Owned(c)
            }
            None => Cow::Borrowed(o),
        };
        let o = o.as_ref();
        if node.facts.repeats_line(o) {
            return (Vec::new(), bearing);
        }
        // Xid lines are remembered to recognise the next line of one exception: a fact too.
        bearing.facts |= o.kind == "xid" || o.kind == "sxid";
        // Late observations count at the node's current time, so state only moves forward.
        let now = node.clock.max(o.observed_at_micros);
        node.clock = now;
        let mut out = Vec::new();
        advance(&self.rules, &o.node, node, now, &mut out);
        let gpu_id = o.gpu.as_deref().map(Id::new);
        bearing.facts |= node.facts.learn_about(o, gpu_id.as_ref(), now);
        // Rules with an open incident on this node see every observation (it may be healthy
        // evidence); the others only what they match. Computed once, allocation-free when the
        // node is healthy, which is the common case. Asked once per rule for every event of a
        // node with an incident: foldhash, where std's SipHash was 9% of the classifier's CPU in
        // `pipeline-throughput` (docs/benchmarks.md).
        let open: foldhash::HashSet<Arc<str>> =
            node.keys.iter().filter(|(_, st)| st.incident.is_some()).map(|((rule, _), _)| rule.clone()).collect();
        for rule in &self.rules.rules {
            let matched = rule.matcher.matches(o);
            if !matched && !open.contains(&*rule.id) {
                continue;
            }
            let gpu = match rule.scope {
                Scope::Gpu => gpu_id.clone(),
                Scope::Node => None,
            };
            let key = (rule.id.clone(), gpu);
            if !matched && node.keys.get(&key).is_none_or(|k| k.incident.is_none()) {
                continue;
            }
            // What the key held before, to tell whether this observation moved it: one that
            // did not can be left out of a replay (see [`Bearing`]).
            let before = if bearing.evidence { None } else { Some(node.keys.get(&key).cloned()) };
            let st = node.keys.get_or_insert_with(&key, || KeyState {
                version: rule.version,
                cond: CondState::new(&rule.condition),
                incident: None,
            });
            let update = if matched { st.cond.observe(&rule.condition, o, now) } else { Default::default() };
            if let Some(inc) = st.incident.as_mut() {
                if update.adverse {
                    inc.clear_since = None;
                    inc.cleared.clear();
                    if rule.scope == Scope::Node
                        && let Some(g) = &o.gpu
                        && inc.gpus.len() < MAX_GPUS
                    {
                        inc.gpus.insert(Id::new(g));
                    }
                } else if inc.clear_since.is_none() && rule.clear.evidence.matches(o) {
                    clear_evidence(rule, &key, inc, o, &node.facts, now);
                }
            }
            if let Some(firing) = update.firing {
                if let Some(root) = sympathetic_root(rule, o, &node.keys, now) {
                    absorb(&mut node.keys, &root, &firing);
                    if let Some(inc) = node.keys.get(&root).and_then(|st| st.incident.as_ref()) {
                        let root_gpu = root.1.as_ref().map(Id::to_string);
                        let to = (inc.id, &*root.0, o.node.as_str(), root_gpu.as_deref(), inc.opened_at);
                        note_absorbed(&mut self.absorbed, to, o, &firing);
                    }
                } else if let Some(r) = domain_root(rule, o, now) {
                    // The root is on another node of the GPU's NVLink domain: its incident lives
                    // in that node's state (perhaps on another replica), so the evidence is
                    // recorded beside it rather than held here.
                    let to = (r.incident_id, r.rule_id.as_str(), r.node.as_str(), r.gpu.as_deref(), r.opened_at_micros);
                    note_absorbed(&mut self.absorbed, to, o, &firing);
                } else {
                    let outcome = outcome(&self.rules, rule, Some(o), &node.keys, &key);
                    let before = out.len();
                    fire(&self.rules, rule, &o.node, &node.facts, &mut node.keys, &key, firing, outcome, &mut out);
                    if o.nvlink_domain.is_some()
                        && key.1.is_some()
                        && key.1 == gpu_id
                        && can_be_root(&self.rules, rule, o)
                    {
                        for d in out[before..].iter_mut().filter(|d| d.kind == DecisionKind::Open) {
                            d.nvlink_domain = o.nvlink_domain.clone();
                        }
                    }
                }
            }
            fold_deadline(&self.rules, rule, node, &key);
            prune(node, &key);
            if let Some(before) = before {
                bearing.evidence |= node.keys.get(&key) != before.as_ref();
            }
        }
        // A quiet period of zero, or a threshold held for zero, is due at once.
        advance(&self.rules, &o.node, node, now, &mut out);
        // A decision at this observation's time (a deadline its time passed) needs it in a replay.
        bearing.evidence |= !out.is_empty();
        (out, bearing)
    }

    /// Moves every node's clock to `now_micros` (when it is behind) and returns the decisions
    /// whose time has come: bursts that ended, thresholds held long enough, quiet periods over.
    /// Call it with a time derived from the observations (a watermark) to keep replays exact.
    pub fn tick(&mut self, now_micros: i64) -> Vec<Decision> {
        let mut out = Vec::new();
        for (name, node) in self.nodes.iter_mut() {
            node.clock = node.clock.max(now_micros);
            let clock = node.clock;
            advance(&self.rules, name, node, clock, &mut out);
        }
        out
    }

    /// The open incidents, by node, rule and GPU.
    pub fn open_incidents(&self) -> Vec<OpenIncident> {
        let mut out = Vec::new();
        for (node, st) in &self.nodes {
            for ((rule, gpu), k) in &st.keys {
                if let Some(inc) = &k.incident {
                    out.push(OpenIncident {
                        incident_id: inc.id,
                        rule_id: rule.to_string(),
                        node: node.clone(),
                        gpu: gpu.as_ref().map(Id::to_string),
                        severity: inc.severity,
                        action: inc.action,
                    });
                }
            }
        }
        out
    }

    /// Everything the engine knows, to restore after a restart.
    pub fn snapshot(&self) -> Snapshot {
        Snapshot {
            format: SNAPSHOT_FORMAT,
            nodes: self
                .nodes
                .iter()
                .map(|(name, n)| NodeSnapshot {
                    node: name.clone(),
                    clock: n.clock,
                    recent: n.recent.oldest_first().collect(),
                    facts: n.facts.clone(),
                    keys: n
                        .keys
                        .iter()
                        .map(|((rule, gpu), st)| KeySnapshot {
                            rule: rule.to_string(),
                            gpu: gpu.as_ref().map(Id::to_string),
                            state: st.clone(),
                        })
                        .collect(),
                })
                .collect(),
        }
    }

    /// An engine with `rules` and the state in `snapshot`; state of rules that are gone or whose
    /// version changed is dropped, as in [`Engine::replace_rules`].
    pub fn restore(rules: RuleSet, snapshot: Snapshot) -> Result<Engine, RestoreError> {
        if snapshot.format != SNAPSHOT_FORMAT {
            return Err(RestoreError::Format { found: snapshot.format });
        }
        let mut nodes = BTreeMap::new();
        for n in snapshot.nodes {
            let recent = RecentIds::from_oldest_first(n.recent);
            let keys = n
                .keys
                .into_iter()
                .map(|k| {
                    // Shares the rule set's name when the rule is still there; one that is gone is
                    // dropped by `replace_rules` below.
                    let rule = rules.get(&k.rule).map_or_else(|| Arc::from(k.rule), |r| r.id.clone());
                    let mut state = k.state;
                    state.cond.shrink_to_fit();
                    ((rule, k.gpu.as_deref().map(Id::new)), state)
                })
                .collect();
            let state = NodeState { clock: n.clock, recent, keys, next_deadline: None, facts: n.facts };
            nodes.insert(n.node, state);
        }
        let mut engine =
            Engine { rules: RuleSet::default(), nodes, refused: VecDeque::new(), absorbed: VecDeque::new() };
        engine.replace_rules(rules);
        Ok(engine)
    }
}

/// Notes when `key`'s state next needs time to pass.
fn fold_deadline(rules: &RuleSet, rule: &Rule, node: &mut NodeState, key: &Key) {
    let Some(st) = node.keys.get(key) else { return };
    let cond = st.cond.deadline(&rule.condition);
    let clear = st
        .incident
        .as_ref()
        .and_then(|i| i.clear_since.as_ref())
        .map(|(t, _)| t.saturating_add(rules.quiet(rule).micros()));
    for d in [cond, clear].into_iter().flatten() {
        node.next_deadline = Some(node.next_deadline.map_or(d, |n| n.min(d)));
    }
}

fn prune(node: &mut NodeState, key: &Key) {
    if node.keys.get(key).is_some_and(|st| st.incident.is_none() && st.cond.is_empty()) {
        node.keys.remove(key);
    }
}

/// Acts on every deadline of `node` that `now` has reached, earliest first.
fn advance(rules: &RuleSet, name: &str, node: &mut NodeState, now: i64, out: &mut Vec<Decision>) {
    if node.next_deadline.is_none_or(|d| d > now) {
        return;
    }
    loop {
        // The earliest due deadline; ties go to rule order, then key order, for determinism.
        let mut due: Option<(i64, usize, Key, bool)> = None;
        for (key, st) in &node.keys {
            let Some((ri, rule)) = rules.rules.iter().enumerate().find(|(_, r)| r.id == key.0) else { continue };
            let cond = st.cond.deadline(&rule.condition).map(|d| (d, false));
            let clear = st
                .incident
                .as_ref()
                .and_then(|i| i.clear_since.as_ref())
                .map(|(t, _)| (t.saturating_add(rules.quiet(rule).micros()), true));
            for (d, is_clear) in [cond, clear].into_iter().flatten() {
                if d <= now && due.as_ref().is_none_or(|(bd, bi, bk, _)| (d, ri, key) < (*bd, *bi, bk)) {
                    due = Some((d, ri, key.clone(), is_clear));
                }
            }
        }
        let Some((_, ri, key, is_clear)) = due else { break };
        let rule = &rules.rules[ri];
        if is_clear {
            recover(rules, rule, name, node, &key, out);
        } else if let Some(firing) = node.keys.get_mut(&key).and_then(|st| st.cond.expire(&rule.condition, now)) {
            let outcome = outcome(rules, rule, None, &node.keys, &key);
            fire(rules, rule, name, &node.facts, &mut node.keys, &key, firing, outcome, out);
        }
        prune(node, &key);
    }
    // Recompute exactly: whatever is left is in the future.
    node.next_deadline = None;
    let keys: Vec<Key> = node.keys.keys().cloned().collect();
    for key in keys {
        if let Some(rule) = rules.get(&key.0) {
            fold_deadline(rules, rule, node, &key);
        }
    }
}

/// The severity and action a firing of `rule` stands for now.
fn outcome(rules: &RuleSet, rule: &Rule, o: Option<&Observation>, keys: &Keys, key: &Key) -> Outcome {
    let lead = rules.lead.or(rule.not_before.as_ref().map(|s| s.lead));
    let not_before = rule.not_before.as_ref().zip(o).zip(lead).and_then(|((s, o), lead)| {
        let start = o.fields.get(&s.field).and_then(FieldValue::as_f64)?;
        Some((start as i64).saturating_sub(lead.micros()))
    });
    let base = Outcome {
        severity: rule.severity,
        action: rule.action,
        then: rule.then.clone(),
        note: None,
        deferrable: rule.deferrable,
        not_before,
    };
    if let Some(ov) = &rule.override_ {
        let named = o.and_then(|o| o.fields.get(&ov.field)).map(|v| match v {
            FieldValue::Text(t) => normalise_key(t),
            other => normalise_key(&other.to_string()),
        });
        return match named.and_then(|n| ov.actions.get(&n).map(|a| (n, a))) {
            Some((n, a)) => Outcome {
                severity: a.severity.unwrap_or(rule.severity),
                action: a.action,
                then: a.then.clone(),
                note: Some(format!("{} is `{n}`", ov.field)),
                deferrable: false,
                not_before: None,
            },
            // An unknown or missing value falls back to the rule's own action.
            None => base,
        };
    }
    if !rule.overridable {
        return base;
    }
    match active_override(rules, keys, key) {
        Some((by, inc)) => Outcome {
            severity: inc.severity,
            action: inc.action,
            then: inc.then.clone(),
            note: Some(format!("action from `{by}`, which overrides this rule's guess ({})", rule.action)),
            deferrable: false,
            not_before: None,
        },
        None => base,
    }
}

/// True when an override on `by` (a GPU, or the whole node when `None`) governs `target`.
fn covers(by: &Option<Id>, target: &Option<Id>) -> bool {
    by.is_none() || target.is_none() || by == target
}

/// The open override incident (Xid 154) that governs `key`: the most disruptive one on the same
/// GPU, or anywhere on the node for a node-wide incident.
fn active_override<'a>(rules: &'a RuleSet, keys: &'a Keys, key: &Key) -> Option<(&'a str, &'a Incident)> {
    let mut best: Option<(&str, &Incident)> = None;
    for ((rule_id, gpu), st) in keys {
        let Some(inc) = &st.incident else { continue };
        let is_override = rules.get(rule_id).is_some_and(|r| r.override_.is_some());
        if !is_override || !covers(gpu, &key.1) {
            continue;
        }
        if best.is_none_or(|(_, b)| weight(inc.severity, inc.action, &inc.then) > weight(b.severity, b.action, &b.then))
        {
            best = Some((&**rule_id, inc));
        }
    }
    best
}

/// Replaces the action of every open overridable incident that the override on `key` covers,
/// and returns their ids.
fn apply_override(rules: &RuleSet, keys: &mut Keys, key: &Key) -> Vec<Uuid> {
    let Some(by) = keys.get(key).and_then(|st| st.incident.clone()) else { return Vec::new() };
    let mut superseded = Vec::new();
    for ((rule_id, gpu), st) in keys.iter_mut() {
        let overridable = rules.get(rule_id).is_some_and(|r| r.overridable);
        let Some(inc) = st.incident.as_mut() else { continue };
        if overridable && covers(&key.1, gpu) {
            inc.overridden_by = Some(by.id);
            inc.severity = by.severity;
            inc.action = by.action;
            inc.then = by.then.clone();
            superseded.push(inc.id);
        }
    }
    superseded
}

#[allow(clippy::too_many_arguments)]
fn decision(
    rule: &Rule,
    node: &str,
    facts: &NodeFacts,
    key: &Key,
    inc: &Incident,
    kind: DecisionKind,
    reason: String,
    at: i64,
) -> Decision {
    let recovery = kind == DecisionKind::Recover;
    let (action, then) = if recovery { (Action::None, Vec::new()) } else { (inc.action, inc.then.clone()) };
    let custom = (action == Action::Custom || then.contains(&Action::Custom)).then(|| rule.custom.clone()).flatten();
    // A node-wide verdict names no GPU (its entity is empty by contract, and the remediator acts
    // on the whole node); its reason names the GPUs that failed.
    let names = key.1.as_ref().and_then(|g| facts.names.get(g)).cloned().unwrap_or_default();
    let gpu = key.1.as_ref().map(Id::to_string);
    let mut reason = reason;
    if gpu.is_none() && !inc.gpus.is_empty() && kind != DecisionKind::Recover {
        let list: Vec<String> = inc.gpus.iter().map(Id::to_string).collect();
        reason.push_str(&format!(" (GPUs: {})", list.join(", ")));
    }
    Decision {
        verdict_id: verdict_id(inc.id, inc.step),
        incident_id: inc.id,
        step: inc.step,
        kind,
        rule_id: rule.id.to_string(),
        rule_version: rule.version,
        node: node.to_owned(),
        gpu,
        gpu_index: names.index,
        gpu_pci: names.pci,
        not_before_micros: None,
        deferrable: false,
        severity: inc.severity,
        action,
        then,
        custom,
        reason,
        evidence: inc.evidence.iter().map(Id::to_string).collect(),
        recovery,
        supersedes: Vec::new(),
        synthetic: inc.synthetic,
        nvlink_domain: None,
        decided_at_micros: at,
    }
}

/// The root incident `o` echoes, when `o` is one of `rule`'s sympathetic codes on a GPU and
/// another GPU of the node has an incident of a root rule that opened within the window.
fn sympathetic_root(rule: &Rule, o: &Observation, keys: &Keys, now: i64) -> Option<Key> {
    let s = rule.sympathetic.as_ref()?;
    let (code, gpu) = (o.xid?, o.gpu.as_ref()?);
    if !codes_contain(&s.xid, code) {
        return None;
    }
    keys.iter()
        .find(|((r, g), st)| {
            g.as_ref().is_some_and(|g| !g.is(gpu))
                && s.to.iter().any(|t| **t == **r)
                && st.incident.as_ref().is_some_and(|i| now.saturating_sub(i.opened_at) <= s.within.micros())
        })
        .map(|(k, _)| k.clone())
}

/// The root incident on another node of `o`'s NVLink domain that `o` echoes, when `o` is one of
/// `rule`'s sympathetic codes on a GPU with a domain, and one of the roots handed in with it is of
/// a rule in `sympathetic.to`, in the same domain, on another node, and opened within `within` of
/// the node's clock. Nodes' clocks differ, so the window counts both ways. The earliest such root
/// wins (the service hands them in by opening time).
fn domain_root<'o>(rule: &Rule, o: &'o Observation, now: i64) -> Option<&'o DomainRoot> {
    let s = rule.sympathetic.as_ref()?;
    let (code, domain) = (o.xid?, o.nvlink_domain.as_ref()?);
    if o.gpu.is_none() || !codes_contain(&s.xid, code) {
        return None;
    }
    let within = u64::try_from(s.within.micros()).unwrap_or(0);
    o.domain_roots.iter().find(|r| {
        &r.domain == domain
            && r.node != o.node
            && s.to.contains(&r.rule_id)
            && now.abs_diff(r.opened_at_micros) <= within
    })
}

/// Whether an incident `rule` opens on `o` can be the root of sympathetic errors on other nodes:
/// the rule is named in some rule's `sympathetic.to`, and `o` is not itself one of `rule`'s
/// sympathetic codes (a peer's Xid 145 that opened an incident has no known root; it is not one).
fn can_be_root(rules: &RuleSet, rule: &Rule, o: &Observation) -> bool {
    let echo = rule.sympathetic.as_ref().zip(o.xid).is_some_and(|(s, code)| codes_contain(&s.xid, code));
    !echo && rules.rules.iter().any(|r| r.sympathetic.as_ref().is_some_and(|s| s.to.iter().any(|t| **t == *rule.id)))
}

/// Queues a firing's evidence as absorbed into the root incident `to` (id, rule, node, GPU,
/// opening time).
fn note_absorbed(
    queue: &mut VecDeque<Absorbed>,
    to: (Uuid, &str, &str, Option<&str>, i64),
    o: &Observation,
    firing: &Firing,
) {
    let (incident_id, root_rule, root_node, root_gpu, opened) = to;
    for e in &firing.evidence {
        if queue.len() >= MAX_ABSORBED {
            queue.pop_front();
        }
        queue.push_back(Absorbed {
            event_id: e.id.to_string(),
            node: o.node.clone(),
            gpu: e.gpu.as_ref().map(ToString::to_string).or_else(|| o.gpu.clone()),
            at_micros: e.t,
            incident_id,
            root_rule: root_rule.to_owned(),
            root_node: root_node.to_owned(),
            root_gpu: root_gpu.map(str::to_owned),
            root_opened_at_micros: opened,
        });
    }
}

/// Adds a firing's evidence to the open incident on `into`, with no decision.
fn absorb(keys: &mut Keys, into: &Key, firing: &Firing) {
    if let Some(inc) = keys.get_mut(into).and_then(|st| st.incident.as_mut()) {
        for e in &firing.evidence {
            if inc.evidence.len() < MAX_EVIDENCE && !inc.evidence.contains(&e.id) {
                crate::tight::push(&mut inc.evidence, e.id.clone());
            }
        }
        inc.synthetic |= firing.evidence.iter().any(|e| e.synthetic);
    }
}

/// The open incident of a rule in `rule.suppressed_by` that covers `key`, if any.
fn suppressor(rule: &Rule, keys: &Keys, key: &Key) -> Option<Key> {
    if rule.suppressed_by.is_empty() {
        return None;
    }
    keys.iter()
        .find(|((r, gpu), st)| {
            st.incident.is_some() && rule.suppressed_by.iter().any(|s| **s == **r) && covers(gpu, &key.1)
        })
        .map(|(k, _)| k.clone())
}

/// Opens the incident, or escalates it, or (flap damping) only records the evidence.
#[allow(clippy::too_many_arguments)]
fn fire(
    rules: &RuleSet,
    rule: &Rule,
    node: &str,
    facts: &NodeFacts,
    keys: &mut Keys,
    key: &Key,
    firing: Firing,
    outcome: Outcome,
    out: &mut Vec<Decision>,
) {
    let ids: Vec<Id> = firing.evidence.iter().map(|e| e.id.clone()).collect();
    let gpus: IdSet = firing.evidence.iter().filter_map(|e| e.gpu.clone()).take(MAX_GPUS).collect();
    let synthetic = firing.evidence.iter().any(|e| e.synthetic);
    let opening = keys.get(key).is_some_and(|st| st.incident.is_none());
    if opening && let Some(by) = suppressor(rule, keys, key) {
        // Another rule's open incident already stands for this fault (a double-bit counter rising
        // with a contained Xid 94): the evidence joins it instead of opening a second incident.
        absorb(keys, &by, &firing);
        return;
    }
    let Some(st) = keys.get_mut(key) else { return };
    if rule.override_.is_some() && outcome.action == Action::None {
        // The driver's recovery action is back to None: the request that opened this incident is
        // fulfilled. NVIDIA's own pipeline clears on this event, so it closes now; without an
        // open request there is nothing to decide.
        if let Some(mut inc) = st.incident.take() {
            inc.step += 1;
            inc.evidence = ids;
            let reason = format!(
                "{}: recovered; the driver's recovery action returned to None after it asked for `{}`",
                rule.description, inc.action
            );
            out.push(decision(rule, node, facts, key, &inc, DecisionKind::Recover, reason, firing.at));
            st.cond = CondState::new(&rule.condition);
        }
        return;
    }
    let note = outcome.note.as_ref().map(|n| format!("; {n}")).unwrap_or_default();
    let made = match st.incident.as_mut() {
        None => {
            let first = ids.first().map(Id::to_string).unwrap_or_default();
            let inc = Incident {
                id: incident_id(rule, node, key.1.as_ref().map(Id::to_string).as_deref(), &first),
                opened_at: firing.at,
                step: 0,
                severity: outcome.severity,
                action: outcome.action,
                then: outcome.then,
                evidence: ids,
                synthetic,
                clear_since: None,
                overridden_by: None,
                boot: facts.boot.clone(),
                gpus: if rule.scope == Scope::Node { gpus } else { IdSet::default() },
                cleared: IdSet::default(),
            };
            let reason = format!("{}: {}{note}", rule.description, firing.detail);
            let d = decision(rule, node, facts, key, &inc, DecisionKind::Open, reason, firing.at);
            st.incident = Some(Box::new(inc));
            d
        }
        Some(inc) => {
            for id in ids {
                if inc.evidence.len() < MAX_EVIDENCE && !inc.evidence.contains(&id) {
                    crate::tight::push(&mut inc.evidence, id);
                }
            }
            if rule.scope == Scope::Node {
                for g in gpus.iter() {
                    if inc.gpus.len() < MAX_GPUS {
                        inc.gpus.insert(g.clone());
                    }
                }
            }
            inc.synthetic |= synthetic;
            let new = (outcome.severity, outcome.action, &outcome.then);
            let kind = if rule.override_.is_some() && new != (inc.severity, inc.action, &inc.then) {
                // The override names the action outright, so any change counts, down included.
                DecisionKind::Override
            } else if weight(outcome.severity, outcome.action, &outcome.then)
                > weight(inc.severity, inc.action, &inc.then)
            {
                DecisionKind::Escalate
            } else {
                return;
            };
            inc.step += 1;
            inc.severity = inc.severity.max(outcome.severity);
            if kind == DecisionKind::Override {
                inc.severity = outcome.severity;
            }
            inc.action = outcome.action;
            inc.then = outcome.then;
            let prefix = if kind == DecisionKind::Escalate { "escalated: " } else { "" };
            let reason = format!("{prefix}{}: {}{note}", rule.description, firing.detail);
            decision(rule, node, facts, key, inc, kind, reason, firing.at)
        }
    };
    let mut made = made;
    made.deferrable = outcome.deferrable;
    made.not_before_micros = outcome.not_before;
    if rule.override_.is_some() {
        made.supersedes = apply_override(rules, keys, key);
    }
    out.push(made);
}

/// Takes healthy evidence `o` for the open incident on `key`. It counts only from the part that
/// failed (the incident's GPU; each GPU a node-wide incident named; the node itself when it named
/// none) and only once the rule's proof of repair has been seen since the incident opened. When
/// every failed part has shown it, the quiet period starts.
fn clear_evidence(rule: &Rule, key: &Key, inc: &mut Incident, o: &Observation, facts: &NodeFacts, now: i64) {
    let required: IdSet = match &key.1 {
        Some(g) => IdSet::from_iter([g.clone()]),
        None => inc.gpus.clone(),
    };
    let gpu = o.gpu.as_deref().map(Id::new);
    let from_failed = match &gpu {
        Some(g) => required.contains(g),
        None => required.is_empty(),
    };
    if !from_failed {
        return;
    }
    let proven = match rule.clear.proof {
        Proof::None => true,
        Proof::Reset => match &o.gpu {
            Some(g) => facts.reset_since(g, inc.opened_at),
            None => facts.rebooted_since(inc.opened_at),
        },
        Proof::Reboot => facts.rebooted_since(inc.opened_at) && facts.complete(),
    };
    if !proven {
        return;
    }
    if let Some(g) = gpu {
        inc.cleared.insert(g);
    }
    if required.iter().all(|g| inc.cleared.contains(g)) {
        inc.clear_since = Some((now, Id::new(&o.event_id)));
    }
}

/// Closes the incident on `key`: its healthy evidence has stood for the quiet period.
fn recover(rules: &RuleSet, rule: &Rule, node: &str, state: &mut NodeState, key: &Key, out: &mut Vec<Decision>) {
    let Some(st) = state.keys.get_mut(key) else { return };
    let Some(mut inc) = st.incident.take() else { return };
    let Some((since, evidence_id)) = inc.clear_since.take() else { return };
    inc.step += 1;
    inc.evidence = vec![evidence_id];
    let proof = match rule.clear.proof {
        Proof::None => String::new(),
        Proof::Reset => " after a reset of the failed GPU".to_owned(),
        Proof::Reboot => " after a reboot with every GPU present".to_owned(),
    };
    let reason = format!(
        "{}: recovered; healthy evidence from the part that failed has stood for {}{proof} without new fault evidence",
        rule.description,
        rules.quiet(rule)
    );
    let at = since.saturating_add(rules.quiet(rule).micros());
    out.push(decision(rule, node, &state.facts, key, &inc, DecisionKind::Recover, reason, at));
    // The next incident needs fresh evidence: old counts must not reopen it at once.
    st.cond = CondState::new(&rule.condition);
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeSet;
    use std::path::Path;

    use super::*;
    use crate::rules::load::load_sources;

    const S: i64 = 1_000_000;

    const RULES: &str = r#"
rules:
  - id: guess
    version: 1
    description: Xid 62
    match: {kind: xid, xid: [62, 63]}
    severity: warning
    action: reset_gpu
    overridable: true
    clear: {evidence: {healthy: true}, proof: reset, quiet: 10m}
  - id: three
    version: 1
    description: three in a minute
    scope: node
    match: {kind: xid, xid: [13]}
    condition: {count: {at_least: 3, within: 1m}}
    severity: info
    action: monitor
    clear: {evidence: {healthy: true}, quiet: 0s}
  - id: ov
    version: 1
    description: Xid 154
    match: {kind: xid, xid: [154]}
    severity: warning
    action: monitor
    override:
      field: recovery_action
      actions: {none: {action: none, severity: info}, node_reboot_required: {action: reboot_node, severity: critical}}
    clear: {evidence: {healthy: true}, proof: reboot, quiet: 10m}
"#;

    fn rules(text: &str) -> RuleSet {
        load_sources([(Path::new("t.yaml"), text)]).unwrap_or_else(|e| panic!("{e:#?}"))
    }

    fn xid(id: &str, t: i64, gpu: &str, code: u32) -> Observation {
        Observation::new(id, "n1", t, "xid").gpu(gpu).xid(code)
    }

    #[test]
    fn the_bearing_of_an_observation_says_what_a_replay_needs() {
        const HOT: &str = r#"
rules:
  - id: hot
    version: 1
    description: hot for 30 s
    match: {kind: temperature, healthy: any}
    condition: {threshold: {field: value, ge: 90, for: 30s}}
    severity: warning
    action: monitor
    clear: {evidence: {kind: temperature, healthy: any, fields: {value: {lt: 90}}}, quiet: 1m}
"#;
        let mut e = Engine::new(rules(HOT));
        let temp = |id: &str, t: i64, v: i64| {
            let mut o = Observation::new(id, "n1", t, "temperature").gpu("g0").field("value", v).boot("b1");
            o.healthy = v < 90;
            o
        };
        let (_, first) = e.observe_bearing(&temp("a", 0, 60));
        assert!(first.facts && !first.evidence, "the node's first event (its boot id)");
        assert_eq!(e.observe_bearing(&temp("b", S, 61)).1, Bearing::default(), "a plain reading bears on nothing");
        assert!(e.observe_bearing(&temp("c", 2 * S, 95)).1.evidence, "a threshold starts being held");
        assert!(e.observe_bearing(&temp("d", 3 * S, 96)).1.evidence, "the run goes on");
        let (opened, held) = e.observe_bearing(&temp("e", 40 * S, 96));
        assert!(held.evidence && opened.len() == 1, "the incident opens");
        assert!(e.observe_bearing(&temp("f", 41 * S, 70)).1.evidence, "the healthy evidence it waits for");
        assert_eq!(e.observe_bearing(&temp("g", 42 * S, 70)).1, Bearing::default(), "the quiet period runs already");
        let (recovered, at) = e.observe_bearing(&temp("h", 120 * S, 70));
        assert!(at.evidence && recovered.len() == 1, "a decision at its time");
        assert!(e.observe_bearing(&temp("i", 121 * S, 70).boot("b2")).1.facts, "a reboot");
        assert_eq!(e.observe_bearing(&temp("i", 122 * S, 70)).1, Bearing::default(), "a redelivery");
    }

    #[test]
    fn flap_damping_escalates_only_when_the_action_rises() {
        let mut e = Engine::new(rules(RULES));
        let open = e.observe(&xid("a", 0, "g0", 62));
        assert_eq!(open.len(), 1);
        assert!(e.observe(&xid("b", S, "g0", 62)).is_empty(), "same outcome: damped");
        // 154 overrides to a reboot; the open guess is superseded and takes that action...
        let ov = e.observe(&xid("c", 2 * S, "g0", 154).field("recovery_action", "node_reboot_required"));
        assert_eq!(ov[0].supersedes, [open[0].incident_id]);
        // ...so a further guess is damped (its action is already the override's)...
        assert!(e.observe(&xid("d", 3 * S, "g0", 63)).is_empty());
        // ...and evidence accumulates on the incident without new decisions.
        let inc = e.open_incidents().into_iter().find(|i| i.rule_id == "guess").unwrap();
        assert_eq!((inc.action, inc.severity), (Action::RebootNode, Severity::Critical));
    }

    #[test]
    fn the_drivers_none_closes_its_request_and_proves_the_reset() {
        let mut e = Engine::new(rules(RULES));
        assert!(e.observe(&xid("a", 0, "g0", 154).field("recovery_action", "None")).is_empty(), "nothing to close");
        let guess = e.observe(&xid("b", S, "g0", 62)).remove(0);
        assert_eq!(guess.action, Action::ResetGpu);
        let req = e.observe(&xid("c", 2 * S, "g0", 154).field("recovery_action", "node_reboot_required")).remove(0);
        assert_eq!((req.action, req.supersedes.clone()), (Action::RebootNode, vec![guess.incident_id]));
        // A heartbeat before the reset proves nothing.
        e.observe(&Observation::new("h0", "n1", 3 * S, "monitor_health").gpu("g0").healthy());
        let none = e.observe(&xid("d", 4 * S, "g0", 154).field("recovery_action", "None"));
        assert_eq!(none.len(), 1, "{none:#?}");
        assert!(none[0].recovery && none[0].incident_id == req.incident_id, "the request's incident closes at once");
        // The guess waits for the GPU's own healthy evidence after the reset, then its quiet period.
        assert!(e.observe(&Observation::new("h1", "n1", 5 * S, "monitor_health").gpu("g1").healthy()).is_empty());
        e.observe(&Observation::new("h2", "n1", 6 * S, "monitor_health").gpu("g0").healthy());
        let back = e.tick(6 * S + 600 * S);
        assert_eq!(back.len(), 1);
        assert!(back[0].recovery && back[0].incident_id == guess.incident_id);
        // An unknown recovery action falls back to the override rule's own action.
        let d = e.observe(&xid("e", 700 * S, "g1", 154).field("recovery_action", "something new"));
        assert_eq!(d[0].action, Action::Monitor);
    }

    #[test]
    fn a_quiet_period_being_counted_is_a_node_awaiting_time_until_the_tick_that_ends_it() {
        let mut e = Engine::new(rules(RULES));
        let guess = e.observe(&xid("a", 0, "g0", 62)).remove(0);
        e.tick(S);
        assert_eq!(e.nodes_awaiting_time(), 0, "no clear evidence yet: the incident waits for an event, not for time");
        // The reset is proven (the driver's None) and the GPU's own heartbeat starts the quiet period.
        e.observe(&xid("b", 2 * S, "g0", 154).field("recovery_action", "None"));
        e.observe(&Observation::new("h", "n1", 3 * S, "monitor_health").gpu("g0").healthy());
        assert!(e.tick(4 * S).is_empty());
        assert_eq!(e.nodes_awaiting_time(), 1, "a quiet period is being counted");
        let back = e.tick(3 * S + 600 * S);
        assert!(back.len() == 1 && back[0].recovery && back[0].incident_id == guess.incident_id, "{back:#?}");
        assert_eq!(e.nodes_awaiting_time(), 0, "the quiet period ended: nothing left to wait for");
    }

    #[test]
    fn reattach_takes_the_stored_identity_and_follows_an_incident_with_no_replayed_evidence() {
        let mut e = Engine::new(rules(RULES));
        e.observe(&xid("a", 0, "g0", 62));
        let (stored, restored) = (Uuid::from_u128(7), Uuid::from_u128(8));
        let incident = |id, node: &str, rule: &str, gpu: Option<&str>, verdicts| StoredIncident {
            incident_id: id,
            node: node.into(),
            rule_id: rule.into(),
            gpu: gpu.map(str::to_owned),
            severity: Severity::Warning,
            action: Action::Monitor,
            opened_at_micros: 0,
            verdicts,
        };
        let done = e.reattach(vec![
            incident(stored, "n1", "guess", Some("g0"), 2),
            incident(restored, "n2", "three", None, 1),
            incident(Uuid::from_u128(9), "n3", "gone", None, 1),
            // Already followed under its own id: nothing to do.
            incident(stored, "n1", "guess", Some("g0"), 2),
        ]);
        assert_eq!(done, Reattached { renamed: 1, restored: 1, unknown_rule: 1 });
        let open: BTreeSet<Uuid> = e.open_incidents().iter().map(|i| i.incident_id).collect();
        assert_eq!(open, BTreeSet::from([stored, restored]), "the replayed id gave way to the stored one");
        // The restored node-wide incident clears on the node's own healthy evidence (quiet 0 s),
        // with the step after the stored verdicts, so its verdict id is new.
        let back = e.observe(&Observation::new("h", "n2", 5 * S, "monitor_health").healthy());
        assert!(back.len() == 1 && back[0].recovery && back[0].incident_id == restored, "{back:#?}");
        assert_eq!(back[0].step, 1);
        assert!(e.open_incidents().iter().all(|i| i.incident_id != restored));
    }

    #[test]
    fn ids_depend_on_rule_node_gpu_and_first_evidence_only() {
        let run = |node: &str, first: &str| {
            let mut e = Engine::new(rules(RULES));
            let mut o = xid(first, 5 * S, "g0", 62);
            o.node = node.to_owned();
            e.observe(&o).remove(0)
        };
        let a = run("n1", "a");
        assert_eq!(a, run("n1", "a"));
        assert_ne!(a.incident_id, run("n2", "a").incident_id);
        assert_ne!(a.incident_id, run("n1", "b").incident_id);
        assert_eq!(a.verdict_id, verdict_id(a.incident_id, 0));
        assert_eq!(a.incident_id.get_version_num(), 5);
    }

    #[test]
    fn quiet_period_of_zero_recovers_on_the_healthy_evidence_itself() {
        let mut e = Engine::new(rules(RULES));
        for (i, t) in [0, 10, 20].iter().enumerate() {
            e.observe(&xid(&format!("x{i}"), t * S, &format!("g{i}"), 13));
        }
        assert_eq!(e.open_incidents().len(), 1, "node scope counts every GPU");
        // A node-wide incident that named GPUs clears on evidence from each of them, not from the
        // node or from one of them.
        assert!(e.observe(&Observation::new("h", "n1", 30 * S, "monitor_health").healthy()).is_empty());
        assert!(e.observe(&Observation::new("h0", "n1", 30 * S, "monitor_health").gpu("g0").healthy()).is_empty());
        assert!(e.observe(&Observation::new("h9", "n1", 30 * S, "monitor_health").gpu("g9").healthy()).is_empty());
        assert!(e.observe(&Observation::new("h1", "n1", 30 * S, "monitor_health").gpu("g1").healthy()).is_empty());
        let d = e.observe(&Observation::new("h2", "n1", 30 * S, "monitor_health").gpu("g2").healthy());
        assert_eq!(d.len(), 1);
        assert!(d[0].recovery && d[0].decided_at_micros == 30 * S);
        assert!(e.nodes["n1"].keys.is_empty(), "state is pruned after recovery");
    }

    #[test]
    fn late_observations_count_at_the_node_clock() {
        let mut e = Engine::new(rules(RULES));
        e.observe(&xid("a", 100 * S, "g0", 13));
        e.observe(&xid("b", 101 * S, "g0", 13));
        // Stamped long before, but arriving now: it counts at 101s, inside the window.
        let d = e.observe(&xid("c", 0, "g0", 13));
        assert_eq!(d.len(), 1);
        assert_eq!(d[0].decided_at_micros, 101 * S);
    }

    #[test]
    fn replacing_rules_keeps_unchanged_state_and_follows_a_changed_rules_open_incidents() {
        let mut e = Engine::new(rules(RULES));
        e.observe(&xid("a", 0, "g0", 13));
        e.observe(&xid("b", S, "g0", 13));
        e.observe(&xid("c", 0, "g0", 62));
        let before: Vec<String> = e.open_incidents().iter().map(|i| i.rule_id.clone()).collect();
        assert_eq!(before, ["guess"], "the Xid 62 incident is open");
        e.replace_rules(rules(&RULES.replacen(
            "version: 1\n    description: Xid 62",
            "version: 2\n    description: Xid 62",
            1,
        )));
        let after: Vec<String> = e.open_incidents().iter().map(|i| i.rule_id.clone()).collect();
        assert_eq!(after, before, "a version bump does not orphan the open incident");
        assert_eq!(e.snapshot().nodes[0].keys.iter().find(|k| k.rule == "guess").map(|k| k.state.version), Some(2));
        assert_eq!(e.observe(&xid("d", 2 * S, "g0", 13)).len(), 1, "the unchanged count kept its two events");
    }

    #[test]
    fn rebuild_leaves_the_state_a_live_run_leaves() {
        let obs: Vec<Observation> =
            (0..50).map(|i| xid(&format!("r{i}"), i * 20 * S, "g0", [13, 62, 154][i as usize % 3])).collect();
        let mut live = Engine::new(rules(RULES));
        for o in &obs {
            live.observe(o);
        }
        assert_eq!(Engine::rebuild(rules(RULES), &obs).snapshot(), live.snapshot());
    }

    #[test]
    fn restore_refuses_other_formats() {
        let mut snap = Engine::new(rules(RULES)).snapshot();
        snap.format = 99;
        assert_eq!(Engine::restore(rules(RULES), snap).unwrap_err(), RestoreError::Format { found: 99 });
    }

    const NVLINK: &str = r#"
rules:
  - id: nvlink5
    version: 1
    description: NVLink5 error
    match: {kind: xid, xid: ["144-150"]}
    severity: warning
    action: monitor
    sympathetic: {xid: [145], to: [nvlink5, down], within: 30s}
    clear: {evidence: {healthy: true}, quiet: 1h}
  - id: down
    version: 1
    description: NVLink link down
    match: {kind: nvlink, healthy: any, fields: {link_state: down}}
    severity: warning
    action: reset_gpu
    clear: {evidence: {kind: nvlink, healthy: any, fields: {link_state: up}}, quiet: 10m}
"#;

    /// An Xid on `gpu` of `node`, in NVLink domain `domain` when given.
    fn nv(id: &str, node: &str, t: i64, gpu: &str, code: u32, domain: Option<&str>) -> Observation {
        let o = Observation::new(id, node, t, "xid").gpu(gpu).xid(code);
        match domain {
            Some(d) => o.nvlink_domain(d),
            None => o,
        }
    }

    /// The root a decision stands for, as the service hands it to peers on other nodes.
    fn root_of(d: &Decision) -> DomainRoot {
        DomainRoot {
            domain: d.nvlink_domain.clone().expect("a root decision carries its domain"),
            incident_id: d.incident_id,
            rule_id: d.rule_id.clone(),
            node: d.node.clone(),
            gpu: d.gpu.clone(),
            opened_at_micros: d.decided_at_micros,
        }
    }

    #[test]
    fn a_peer_on_another_node_of_the_domain_is_evidence_on_the_root() {
        let mut e = Engine::new(rules(NVLINK));
        let root = e.observe(&nv("r", "a", 100 * S, "gA", 149, Some("D"))).remove(0);
        assert_eq!(root.nvlink_domain.as_deref(), Some("D"), "the root's domain is recorded for other replicas");
        assert!(e.take_absorbed().is_empty());
        for (id, node, gpu) in [("p1", "b", "gB"), ("p2", "c", "gC")] {
            let peer = nv(id, node, 110 * S, gpu, 145, Some("D")).domain_root(root_of(&root));
            assert!(e.observe(&peer).is_empty(), "{node}: no incident of its own");
        }
        let absorbed = e.take_absorbed();
        let seen: Vec<(&str, &str, Option<&str>, Uuid)> =
            absorbed.iter().map(|a| (a.event_id.as_str(), a.node.as_str(), a.gpu.as_deref(), a.incident_id)).collect();
        assert_eq!(seen, [("p1", "b", Some("gB"), root.incident_id), ("p2", "c", Some("gC"), root.incident_id)]);
        assert_eq!((absorbed[0].root_node.as_str(), absorbed[0].root_gpu.as_deref()), ("a", Some("gA")));
        assert_eq!(e.open_incidents().len(), 1, "one incident for the domain: the root's");
    }

    #[test]
    fn a_link_down_is_a_root_too_and_the_window_counts_both_ways() {
        let mut e = Engine::new(rules(NVLINK));
        let down = Observation::new("r", "a", 100 * S, "nvlink").gpu("gA").field("link_state", "down");
        let root = e.observe(&down.nvlink_domain("D")).remove(0);
        assert_eq!(root.rule_id, "down");
        // A peer whose clock is a few seconds behind the root's node.
        let peer = nv("p", "b", 95 * S, "gB", 145, Some("D")).domain_root(root_of(&root));
        assert!(e.observe(&peer).is_empty());
        assert_eq!(e.take_absorbed().len(), 1);
    }

    #[test]
    fn a_peer_in_another_domain_opens_its_own_incident() {
        let mut e = Engine::new(rules(NVLINK));
        let root = e.observe(&nv("r", "a", 100 * S, "gA", 149, Some("D"))).remove(0);
        let peer = nv("p", "e", 105 * S, "gE", 145, Some("D2")).domain_root(root_of(&root));
        let own = e.observe(&peer);
        assert_eq!(own.len(), 1);
        assert_eq!((own[0].node.as_str(), own[0].kind), ("e", DecisionKind::Open));
        assert_eq!(own[0].nvlink_domain, None, "an echo whose root is unknown is no root for others");
        assert!(e.take_absorbed().is_empty());
    }

    #[test]
    fn a_peer_outside_the_window_opens_its_own_incident() {
        let mut e = Engine::new(rules(NVLINK));
        let root = e.observe(&nv("r", "a", 100 * S, "gA", 149, Some("D"))).remove(0);
        let late = nv("p", "b", 131 * S, "gB", 145, Some("D")).domain_root(root_of(&root));
        assert_eq!(e.observe(&late).len(), 1);
        let early = nv("q", "c", 69 * S, "gC", 145, Some("D")).domain_root(root_of(&root));
        assert_eq!(e.observe(&early).len(), 1);
        assert!(e.take_absorbed().is_empty());
    }

    #[test]
    fn without_a_domain_only_the_node_correlates_as_before() {
        let mut e = Engine::new(rules(NVLINK));
        let root = e.observe(&nv("r", "a", 100 * S, "gA", 149, None)).remove(0);
        assert_eq!(root.nvlink_domain, None);
        // Another node, no domain known: its own incident, whatever roots are handed in.
        let stray = DomainRoot { domain: "D".into(), ..root_of(&Decision { nvlink_domain: Some("D".into()), ..root }) };
        assert_eq!(e.observe(&nv("p", "b", 101 * S, "gB", 145, None).domain_root(stray)).len(), 1);
        // The same node: absorbed from the engine's own state, as before, and reported.
        assert!(e.observe(&nv("q", "a", 102 * S, "gA2", 145, None)).is_empty());
        let absorbed = e.take_absorbed();
        assert_eq!(absorbed.len(), 1);
        assert_eq!((absorbed[0].node.as_str(), absorbed[0].root_node.as_str()), ("a", "a"));
        // An incident of a rule that `sympathetic.to` does not name is no root.
        let other = DomainRoot { rule_id: "xid-other".into(), ..absorbed_root(&absorbed[0]) };
        assert_eq!(e.observe(&nv("s", "c", 103 * S, "gC", 145, Some("D")).domain_root(other)).len(), 1);
    }

    fn absorbed_root(a: &Absorbed) -> DomainRoot {
        DomainRoot {
            domain: "D".into(),
            incident_id: a.incident_id,
            rule_id: a.root_rule.clone(),
            node: a.root_node.clone(),
            gpu: a.root_gpu.clone(),
            opened_at_micros: a.root_opened_at_micros,
        }
    }

    #[test]
    fn recent_ids_forget_the_oldest_first_and_survive_a_snapshot() {
        let mut r = RecentIds::default();
        let n = RECENT_IDS as u64;
        assert!((0..n).all(|i| r.insert(i)), "every new id is new");
        assert!(!r.insert(0) && !r.insert(n - 1), "a remembered id is a redelivery");
        assert!(r.insert(n), "one more");
        assert_eq!(r.len(), RECENT_IDS);
        // 0 was the oldest and is forgotten; 1 is still remembered.
        assert!(!r.insert(1));
        assert!(r.insert(0), "the oldest was forgotten first");
        let order: Vec<u64> = r.oldest_first().collect();
        assert_eq!(order.first(), Some(&2));
        assert_eq!(&order[order.len() - 2..], &[n, 0]);
        // A snapshot's list, oldest first, restores the same filter; a longer list keeps its last.
        let mut back = RecentIds::from_oldest_first(order.clone());
        assert_eq!(back.oldest_first().collect::<Vec<_>>(), order);
        assert!(!back.insert(n) && !back.insert(2));
        let long = RecentIds::from_oldest_first((0..n + 10).collect());
        assert_eq!(long.oldest_first().next(), Some(10));
        assert_eq!(long.len(), RECENT_IDS);
    }

    #[test]
    fn an_incidents_evidence_is_held_as_ids_and_written_as_the_event_ids() {
        let ids: Vec<String> = (1..=3u128).map(|i| Uuid::from_u128(i).to_string()).collect();
        let mut e = Engine::new(rules(RULES));
        let mut opened = Vec::new();
        for (i, id) in ids.iter().enumerate() {
            opened.extend(e.observe(&xid(id, (i as i64 + 1) * S, "g0", 13)));
        }
        let [d] = opened.as_slice() else { panic!("one incident opens: {opened:?}") };
        assert_eq!(d.evidence, ids, "the verdict names each event by its id");
        let st = &e.nodes["n1"].keys[&(Arc::from("three"), None)];
        let inc = st.incident.as_ref().unwrap();
        assert!(inc.evidence.iter().all(|id| matches!(id, Id::Uuid(_))), "{:?}", inc.evidence);
        // A snapshot writes them as the strings an incident held before, and reads those back.
        let json = serde_json::to_value(e.snapshot()).unwrap();
        let written = &json["nodes"][0]["keys"];
        assert!(
            written.to_string().contains(&format!("\"evidence\":[\"{}\",\"{}\",\"{}\"]", ids[0], ids[1], ids[2])),
            "{written}"
        );
        let back = Engine::restore(rules(RULES), serde_json::from_value(json).unwrap()).unwrap();
        assert_eq!(back.nodes["n1"].keys[&(Arc::from("three"), None)].incident, st.incident);
    }

    #[test]
    fn state_stays_bounded_under_a_storm() {
        let mut e = Engine::new(rules(RULES));
        for i in 0..10_000 {
            e.observe(&xid(&format!("s{i}"), i * S, "g0", 13));
        }
        let n = &e.nodes["n1"];
        assert_eq!(n.recent.len(), RECENT_IDS);
        let st = &n.keys[&(Arc::from("three"), None)];
        let CondState::Count { events } = &st.cond else { panic!("count state expected") };
        assert_eq!(events.len(), 3);
        assert!(st.incident.as_ref().unwrap().evidence.len() <= MAX_EVIDENCE);
    }
}
