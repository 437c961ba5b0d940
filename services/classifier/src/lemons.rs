//! Lemons: a node or GPU whose hardware keeps failing (docs/decisions.md, "Lemons").
//!
//! Field data says a few parts cause most exclusions: a GPU reset back into service after each
//! fault comes back with the next one. So each hardware-class incident is counted against its GPU
//! (by UUID, which NVML derives from the board and which follows the GPU to another node) and its
//! node. When a part reaches `min_incidents` hardware-class incidents within `window` (default 3
//! in 30 days), it is a *lemon*: the classifier opens a lemon incident beside the fault
//! (`lemon-gpu`, action `contact_support`, or `lemon-node`, action `replace_node`; critical), whose
//! reason lists the history. A lemon incident has no healthy evidence and never recovers on its
//! own, so the remediator keeps the node out after the fault that triggered it recovers: its
//! ownership record holds an open quarantining incident, and the resync re-issues it from the
//! incident store. A GPU lemon closes when a complete inventory of its node no longer lists the GPU
//! ([`Ledger::replaced`]: replaced, or moved out); a node lemon stays open for an operator.
//!
//! A decision is *hardware class* when it is not a recovery, it is critical, and its action or a
//! follow-up is a repair (`reset_gpu`, `reboot_node`, `contact_support`, `replace_node`): the
//! faults NVIDIA's catalog answers with a reset, a reboot or a replacement. An incident counts
//! once, from its first hardware-class decision. Workload faults, maintenance notices, thermal
//! drains and warnings never count.
//!
//! The judge ([`Ledger::judge`]) is pure: it sees the engine's decisions in order and adds the
//! lemon decisions they call for. What it knows of earlier incidents comes from the incident store
//! ([`Ledger::load`], rows marked `incidents.hardware`) live, or from its own memory in the decision
//! corpus; either way the batch's own decisions are learned as they are judged.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use chrono::{DateTime, Utc};
use sqlx::PgPool;
use uuid::Uuid;

use crate::events::{InternalEvent as _, LemonFound};
use crate::rules::engine::{Decision, DecisionKind};
use crate::rules::{Action, FieldValue, Observation, Severity};

/// The rule id of a GPU lemon incident.
pub const GPU_RULE: &str = "lemon-gpu";
/// The rule id of a node lemon incident.
pub const NODE_RULE: &str = "lemon-node";
/// The version of both lemon rules; part of their ids.
pub const RULE_VERSION: u32 = 1;

/// Namespace of lemon incident and verdict ids (UUIDv5), fixed forever so ids stay stable.
const NAMESPACE: Uuid = Uuid::from_u128(0x6770_756d_6564_6963_6c65_6d6f_6e73_0001);

/// When a part is a lemon.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Settings {
    /// Hardware-class incidents within the window that make a lemon; 0 turns lemons off.
    pub min_incidents: usize,
    /// How far back incidents count.
    pub window: Duration,
}

impl Default for Settings {
    fn default() -> Self {
        Settings { min_incidents: 3, window: Duration::from_secs(30 * 86_400) }
    }
}

/// Whether `d` is a hardware-class decision: not a recovery, critical, and its action or a
/// follow-up is a repair.
pub fn hardware_class(d: &Decision) -> bool {
    !d.recovery
        && d.severity == Severity::Critical
        && !is_lemon_rule(&d.rule_id)
        && d.then.iter().copied().fold(d.action, Action::max) >= Action::ResetGpu
}

/// Whether `rule_id` names a lemon incident.
pub fn is_lemon_rule(rule_id: &str) -> bool {
    rule_id == GPU_RULE || rule_id == NODE_RULE
}

/// A part a lemon incident holds out: its node, and its GPU (`None` for a node lemon).
type Held = (String, Option<String>);

/// One hardware-class incident, as the ledger counts it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Entry {
    /// The incident.
    pub incident_id: Uuid,
    /// Its node.
    pub node: String,
    /// Its GPU; `None` for a node-scoped incident.
    pub gpu: Option<String>,
    /// The rule that opened it.
    pub rule_id: String,
    /// When it counted (its first hardware-class decision), microseconds since the Unix epoch.
    pub at_micros: i64,
}

/// The hardware-class incidents and open lemon incidents the judge knows of.
#[derive(Debug, Clone, Default)]
pub struct Ledger {
    settings: Settings,
    /// By incident id: each counts once.
    entries: BTreeMap<Uuid, Entry>,
    /// Open lemon incidents, by part.
    open: BTreeMap<Held, BTreeSet<Uuid>>,
}

impl Ledger {
    /// An empty ledger.
    pub fn new(settings: Settings) -> Ledger {
        Ledger { settings, ..Default::default() }
    }

    /// Remembers a hardware-class incident (once).
    pub fn remember(&mut self, entry: Entry) {
        self.entries.entry(entry.incident_id).or_insert(entry);
    }

    /// Remembers an open lemon incident on `node` (and `gpu`, for a GPU lemon).
    pub fn remember_open(&mut self, incident_id: Uuid, node: &str, gpu: Option<&str>) {
        self.open.entry((node.to_owned(), gpu.map(str::to_owned))).or_default().insert(incident_id);
    }

    /// Whether a lemon incident other than `lemon`'s is open on its part: the part is out already.
    /// `lemon`'s own (a retried batch whose first write got part of the way) is made again.
    fn already_out(&self, lemon: &Decision) -> bool {
        self.open
            .get(&(lemon.node.clone(), lemon.gpu.clone()))
            .is_some_and(|ids| ids.iter().any(|id| *id != lemon.incident_id))
    }

    /// `decisions` with the lemon decisions they call for, each right after the decision that made
    /// its part a lemon. Learns every hardware-class incident among them.
    pub fn judge(&mut self, decisions: Vec<Decision>) -> Vec<Decision> {
        if self.settings.min_incidents == 0 {
            return decisions;
        }
        let mut out = Vec::with_capacity(decisions.len());
        for d in decisions {
            let lemon = self.judge_one(&d);
            out.push(d);
            out.extend(lemon);
        }
        out
    }

    fn judge_one(&mut self, d: &Decision) -> Option<Decision> {
        if is_lemon_rule(&d.rule_id) && d.kind == DecisionKind::Open {
            self.remember_open(d.incident_id, &d.node, d.gpu.as_deref());
            return None;
        }
        if !hardware_class(d) || self.entries.contains_key(&d.incident_id) {
            return None;
        }
        let now = d.decided_at_micros;
        self.remember(Entry {
            incident_id: d.incident_id,
            node: d.node.clone(),
            gpu: d.gpu.clone(),
            rule_id: d.rule_id.clone(),
            at_micros: now,
        });
        let window = i64::try_from(self.settings.window.as_micros()).unwrap_or(i64::MAX);
        let since = now.saturating_sub(window);
        // Older entries can count for nothing any more: the ledger stays bounded.
        self.entries.retain(|_, e| e.at_micros >= since);
        let in_window = |e: &&Entry| e.at_micros >= since && e.at_micros <= now;
        if let Some(gpu) = &d.gpu {
            let mut history: Vec<&Entry> =
                self.entries.values().filter(in_window).filter(|e| e.gpu.as_ref() == Some(gpu)).collect();
            history.sort_by_key(|e| (e.at_micros, e.incident_id));
            if history.len() >= self.settings.min_incidents {
                let lemon = lemon_decision(d, Part::Gpu(gpu), &history, self.settings.window);
                if self.already_out(&lemon) {
                    return None;
                }
                self.remember_open(lemon.incident_id, &d.node, Some(gpu));
                return Some(lemon);
            }
        }
        let mut history: Vec<&Entry> = self.entries.values().filter(in_window).filter(|e| e.node == d.node).collect();
        history.sort_by_key(|e| (e.at_micros, e.incident_id));
        // A node whose incidents are all one GPU's has a bad GPU, not a bad node: that GPU becomes
        // a lemon on its own count.
        let parts: BTreeSet<Option<&String>> = history.iter().map(|e| e.gpu.as_ref()).collect();
        if history.len() >= self.settings.min_incidents && (parts.len() >= 2 || parts.contains(&None)) {
            let lemon = lemon_decision(d, Part::Node, &history, self.settings.window);
            if self.already_out(&lemon) {
                return None;
            }
            self.remember_open(lemon.incident_id, &d.node, None);
            return Some(lemon);
        }
        None
    }

    /// The recovery decisions a GPU inventory `o` proves: every open GPU lemon on its node whose
    /// GPU is no longer present, in an inventory that is complete (no GPU missing against the
    /// node's expected count), was replaced or moved out; its lemon incident closes, and the node
    /// returns once nothing else holds it. Other observations prove nothing.
    pub fn replaced(&mut self, o: &Observation) -> Vec<Decision> {
        if o.kind != "gpu_inventory" || o.inventory.is_empty() || o.synthetic {
            return Vec::new();
        }
        let complete = match o.fields.get("missing") {
            Some(FieldValue::Int(n)) => *n == 0,
            Some(_) => false,
            None => true,
        };
        if !complete {
            return Vec::new();
        }
        let gone: Vec<(Held, BTreeSet<Uuid>)> = self
            .open
            .iter()
            .filter(|((node, gpu), _)| node == &o.node && gpu.as_ref().is_some_and(|g| !o.inventory.contains(g)))
            .map(|(k, ids)| (k.clone(), ids.clone()))
            .collect();
        let mut out = Vec::new();
        for ((node, gpu), ids) in gone {
            self.open.remove(&(node.clone(), gpu.clone()));
            for incident_id in ids {
                let gpu = gpu.clone().unwrap_or_default();
                out.push(Decision {
                    verdict_id: Uuid::new_v5(&NAMESPACE, format!("verdict\u{1f}{incident_id}\u{1f}1").as_bytes()),
                    incident_id,
                    step: 1,
                    kind: DecisionKind::Recover,
                    rule_id: GPU_RULE.to_owned(),
                    rule_version: RULE_VERSION,
                    node: node.clone(),
                    gpu: Some(gpu.clone()),
                    gpu_index: None,
                    gpu_pci: None,
                    not_before_micros: None,
                    deferrable: false,
                    severity: Severity::Critical,
                    action: Action::None,
                    then: Vec::new(),
                    custom: None,
                    reason: format!(
                        "GPU {gpu} is no longer in node {node}'s inventory, which is complete: the lemon was replaced \
                         (or moved out), and its lemon incident closes."
                    ),
                    evidence: vec![o.event_id.clone()],
                    recovery: true,
                    supersedes: Vec::new(),
                    synthetic: false,
                    nvlink_domain: None,
                    decided_at_micros: o.observed_at_micros,
                });
            }
        }
        out
    }

    /// Loads from the incident store the open GPU lemon incidents of the nodes of the GPU
    /// inventories among `observations`, for [`Ledger::replaced`]; no inventory, no query.
    pub async fn load_open_for<'a>(
        &mut self,
        pool: &PgPool,
        observations: impl IntoIterator<Item = &'a Observation>,
    ) -> Result<(), sqlx::Error> {
        let nodes: BTreeSet<String> =
            observations.into_iter().filter(|o| o.kind == "gpu_inventory").map(|o| o.node.clone()).collect();
        if nodes.is_empty() || self.settings.min_incidents == 0 {
            return Ok(());
        }
        let nodes: Vec<String> = nodes.into_iter().collect();
        let open: Vec<(Uuid, String, Option<String>)> = sqlx::query_as(
            "SELECT incident_id, node, gpu_uuid FROM incidents
              WHERE rule_id = $2 AND resolved_at IS NULL AND node = ANY($1)",
        )
        .bind(&nodes)
        .bind(GPU_RULE)
        .fetch_all(pool)
        .await?;
        for (incident_id, node, gpu) in open {
            self.remember_open(incident_id, &node, gpu.as_deref());
        }
        Ok(())
    }

    /// Loads from the incident store what judging `decisions` needs: the hardware-class incidents
    /// of their nodes and GPUs within the window before the earliest of them, and the open lemon
    /// incidents of those nodes. Decisions that are not hardware class cost nothing: a batch
    /// without one makes no query.
    pub async fn load(&mut self, pool: &PgPool, decisions: &[Decision]) -> Result<(), sqlx::Error> {
        if self.settings.min_incidents == 0 {
            return Ok(());
        }
        let mut nodes = BTreeSet::new();
        let mut gpus = BTreeSet::new();
        let mut earliest = i64::MAX;
        for d in decisions.iter().filter(|d| hardware_class(d)) {
            nodes.insert(d.node.clone());
            gpus.extend(d.gpu.clone());
            earliest = earliest.min(d.decided_at_micros);
        }
        if nodes.is_empty() {
            return Ok(());
        }
        let window = i64::try_from(self.settings.window.as_micros()).unwrap_or(i64::MAX);
        let since = DateTime::<Utc>::from_timestamp_micros(earliest.saturating_sub(window)).unwrap_or_default();
        let nodes: Vec<String> = nodes.into_iter().collect();
        let gpus: Vec<String> = gpus.into_iter().collect();
        let rows: Vec<HistoryRow> = sqlx::query_as(
            "SELECT incident_id, node, gpu_uuid, rule_id, opened_at
               FROM incidents
              WHERE hardware AND opened_at >= $3 AND (node = ANY($1) OR gpu_uuid = ANY($2))
              ORDER BY opened_at, incident_id
              LIMIT 10000",
        )
        .bind(&nodes)
        .bind(&gpus)
        .bind(since)
        .fetch_all(pool)
        .await?;
        for (incident_id, node, gpu, rule_id, opened_at) in rows {
            self.remember(Entry { incident_id, node, gpu, rule_id, at_micros: opened_at.timestamp_micros() });
        }
        let open: Vec<(Uuid, String, Option<String>)> = sqlx::query_as(
            "SELECT incident_id, node, gpu_uuid FROM incidents
              WHERE rule_id = ANY($2) AND resolved_at IS NULL AND node = ANY($1)",
        )
        .bind(&nodes)
        .bind([GPU_RULE, NODE_RULE])
        .fetch_all(pool)
        .await?;
        for (incident_id, node, gpu) in open {
            self.remember_open(incident_id, &node, gpu.as_deref());
        }
        Ok(())
    }
}

/// A hardware-class incident as the store has it: incident id, node, GPU, rule, opening time.
type HistoryRow = (Uuid, String, Option<String>, String, DateTime<Utc>);

/// The part a lemon incident is about.
enum Part<'a> {
    Gpu(&'a str),
    Node,
}

/// The opening decision of the lemon incident that `trigger` (the incident that made its part a
/// lemon) calls for, with `history` (oldest first) in its reason. Its ids derive from the
/// trigger's incident, so a retried batch or a replay makes the same decision.
fn lemon_decision(trigger: &Decision, part: Part<'_>, history: &[&Entry], window: Duration) -> Decision {
    let (rule_id, action, what, gpu) = match part {
        Part::Gpu(g) => (GPU_RULE, Action::ContactSupport, format!("GPU {g} on node {}", trigger.node), Some(g)),
        Part::Node => (NODE_RULE, Action::ReplaceNode, format!("Node {}", trigger.node), None),
    };
    let name = format!("lemon\u{1f}{rule_id}\u{1f}{}", trigger.incident_id);
    let incident_id = Uuid::new_v5(&NAMESPACE, name.as_bytes());
    let verdict_id = Uuid::new_v5(&NAMESPACE, format!("verdict\u{1f}{incident_id}\u{1f}0").as_bytes());
    let listed: Vec<String> = history
        .iter()
        .map(|e| {
            let at = DateTime::<Utc>::from_timestamp_micros(e.at_micros).unwrap_or_default();
            let gpu = e.gpu.as_deref().map(|g| format!(" {g}")).unwrap_or_default();
            format!("{} {} on {}{gpu} (incident {})", at.format("%Y-%m-%dT%H:%M:%SZ"), e.rule_id, e.node, e.incident_id)
        })
        .collect();
    let reason = format!(
        "{what} is a lemon: {} hardware-class incidents within {}: {}. It stays out of service until the part is \
         replaced; its faults' recoveries do not return it.",
        history.len(),
        humantime_days(window),
        listed.join("; ")
    );
    Decision {
        verdict_id,
        incident_id,
        step: 0,
        kind: DecisionKind::Open,
        rule_id: rule_id.to_owned(),
        rule_version: RULE_VERSION,
        node: trigger.node.clone(),
        gpu: gpu.map(str::to_owned),
        gpu_index: if gpu.is_some() { trigger.gpu_index } else { None },
        gpu_pci: if gpu.is_some() { trigger.gpu_pci.clone() } else { None },
        not_before_micros: None,
        deferrable: false,
        severity: Severity::Critical,
        action,
        then: Vec::new(),
        custom: None,
        reason,
        evidence: trigger.evidence.clone(),
        recovery: false,
        supersedes: Vec::new(),
        synthetic: trigger.synthetic,
        nvlink_domain: None,
        decided_at_micros: trigger.decided_at_micros,
    }
}

/// A window for humans: whole days as `30d`, else hours, minutes or seconds.
fn humantime_days(d: Duration) -> String {
    let s = d.as_secs();
    match s {
        _ if s >= 86_400 && s.is_multiple_of(86_400) => format!("{}d", s / 86_400),
        _ if s >= 3_600 && s.is_multiple_of(3_600) => format!("{}h", s / 3_600),
        _ if s >= 60 && s.is_multiple_of(60) => format!("{}m", s / 60),
        _ => format!("{s}s"),
    }
}

/// Counts and logs the lemon decisions among `decisions`: an operator must replace the part.
pub fn announce<'a>(decisions: impl IntoIterator<Item = &'a Decision>) {
    for d in decisions.into_iter().filter(|d| is_lemon_rule(&d.rule_id) && d.kind == DecisionKind::Open) {
        let part = if d.rule_id == GPU_RULE { "gpu" } else { "node" };
        LemonFound {
            part,
            node: &d.node,
            gpu: &d.gpu,
            incident_id: &d.incident_id,
            action: &d.action,
            reason: &d.reason,
        }
        .emit();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const DAY: i64 = 86_400 * 1_000_000;

    fn fault(id: u128, node: &str, gpu: Option<&str>, day: i64) -> Decision {
        Decision {
            verdict_id: Uuid::from_u128(id + 1000),
            incident_id: Uuid::from_u128(id),
            step: 0,
            kind: DecisionKind::Open,
            rule_id: "xid-48-alone".into(),
            rule_version: 1,
            node: node.into(),
            gpu: gpu.map(str::to_owned),
            gpu_index: Some(0),
            gpu_pci: None,
            not_before_micros: None,
            deferrable: false,
            severity: Severity::Critical,
            action: Action::ResetGpu,
            then: Vec::new(),
            custom: None,
            reason: "Xid 48".into(),
            evidence: vec![format!("{}", Uuid::from_u128(id + 2000))],
            recovery: false,
            supersedes: Vec::new(),
            synthetic: false,
            nvlink_domain: None,
            decided_at_micros: day * DAY,
        }
    }

    fn lemons(out: &[Decision]) -> Vec<&Decision> {
        out.iter().filter(|d| is_lemon_rule(&d.rule_id)).collect()
    }

    #[test]
    fn the_third_hardware_fault_on_a_gpu_within_the_window_makes_it_a_lemon() {
        let mut ledger = Ledger::new(Settings::default());
        assert!(lemons(&ledger.judge(vec![fault(1, "n1", Some("GPU-a"), 0)])).is_empty());
        assert!(lemons(&ledger.judge(vec![fault(2, "n1", Some("GPU-a"), 10)])).is_empty());
        let out = ledger.judge(vec![fault(3, "n1", Some("GPU-a"), 20)]);
        let l = lemons(&out);
        assert_eq!(l.len(), 1, "{out:?}");
        assert_eq!(
            (l[0].rule_id.as_str(), l[0].action, l[0].gpu.as_deref()),
            (GPU_RULE, Action::ContactSupport, Some("GPU-a"))
        );
        assert!(l[0].reason.contains("3 hardware-class incidents within 30d"), "{}", l[0].reason);
        // The fourth finds the lemon open and opens no other.
        assert!(lemons(&ledger.judge(vec![fault(4, "n1", Some("GPU-a"), 21)])).is_empty());
    }

    #[test]
    fn a_lemon_is_dated_by_the_incidents_that_made_it_never_by_the_wall_clock() {
        // A replay of a stream from long ago declares the same lemon at the same time: its
        // decision (so its verdict and incident) and the history in its reason carry the verdict
        // times of the incidents that made it one. (The log line announcing it is stamped when
        // it is written, like every log line.)
        let faults = || {
            vec![fault(1, "n1", Some("GPU-a"), 0), fault(2, "n1", Some("GPU-a"), 10), fault(3, "n1", Some("GPU-a"), 20)]
        };
        let out = Ledger::new(Settings::default()).judge(faults());
        let l = lemons(&out);
        assert_eq!(l.len(), 1, "{out:?}");
        assert_eq!(l[0].decided_at_micros, 20 * DAY);
        let at = DateTime::<Utc>::from_timestamp_micros(20 * DAY).unwrap();
        assert_eq!(crate::observe::verdict(l[0]).issued_at, at);
        for day in ["1970-01-01T00:00:00Z", "1970-01-11T00:00:00Z", "1970-01-21T00:00:00Z"] {
            assert!(l[0].reason.contains(&format!("{day} xid-48-alone on n1 GPU-a")), "{day}: {}", l[0].reason);
        }
        assert_eq!(Ledger::new(Settings::default()).judge(faults()), out, "the same input, the same lemon");
    }

    #[test]
    fn faults_outside_the_window_recoveries_warnings_and_repeats_do_not_count() {
        let mut ledger = Ledger::new(Settings::default());
        let mut warning = fault(5, "n1", Some("GPU-a"), 25);
        warning.severity = Severity::Warning;
        let mut recovery = fault(1, "n1", Some("GPU-a"), 26);
        recovery.recovery = true;
        recovery.kind = DecisionKind::Recover;
        let mut thermal = fault(6, "n1", Some("GPU-a"), 27);
        thermal.action = Action::Drain;
        let out = ledger.judge(vec![
            fault(1, "n1", Some("GPU-a"), 0),
            fault(2, "n1", Some("GPU-a"), 31),
            fault(2, "n1", Some("GPU-a"), 32),
            warning,
            recovery,
            thermal,
        ]);
        assert!(lemons(&out).is_empty(), "{out:?}");
    }

    #[test]
    fn a_gpu_moved_to_another_node_keeps_its_history() {
        let mut ledger = Ledger::new(Settings::default());
        ledger.judge(vec![fault(1, "n1", Some("GPU-a"), 0), fault(2, "n1", Some("GPU-a"), 1)]);
        let out = ledger.judge(vec![fault(3, "n2", Some("GPU-a"), 2)]);
        let l = lemons(&out);
        assert_eq!(l.len(), 1);
        assert_eq!(l[0].node, "n2");
    }

    #[test]
    fn a_node_with_faults_on_several_parts_is_a_node_lemon_and_ids_are_stable() {
        let mut a = Ledger::new(Settings::default());
        let faults = vec![fault(1, "n1", Some("GPU-a"), 0), fault(2, "n1", Some("GPU-b"), 1), fault(3, "n1", None, 2)];
        let out = a.judge(faults.clone());
        let l = lemons(&out);
        assert_eq!(l.len(), 1);
        assert_eq!((l[0].rule_id.as_str(), l[0].action, l[0].gpu.as_deref()), (NODE_RULE, Action::ReplaceNode, None));
        let mut b = Ledger::new(Settings::default());
        assert_eq!(lemons(&b.judge(faults))[0].incident_id, l[0].incident_id);
    }

    #[test]
    fn the_default_rules_that_count_are_the_ones_the_docs_name() {
        // docs/decisions.md, "Lemons", names these; the override rule (Xid 154) counts only when
        // the driver's action is a reset or a reboot, which its own action here is not.
        let rules = crate::rules::defaults::rule_set().expect("the default rules load");
        let counted: Vec<&str> = rules
            .rules
            .iter()
            .filter(|r| {
                let mut d = fault(1, "n1", Some("GPU-a"), 0);
                (d.severity, d.action, d.then) = (r.severity, r.action, r.then.clone());
                hardware_class(&d)
            })
            .map(|r| &*r.id)
            .collect();
        assert_eq!(
            counted,
            [
                "xid-48-alone",
                "xid-48-with-row-remap",
                "xid-64-row-remap-failure",
                "xid-reset-gpu",
                "xid-79-fallen-off-the-bus",
                "sxid-nvswitch-fatal",
                "ecc-double-bit",
                "row-remap-failure",
                "pcie-aer-fatal",
                "dcgm-diagnostic-failed",
            ]
        );
    }

    #[test]
    fn a_complete_inventory_without_the_lemon_gpu_closes_its_lemon() {
        let mut ledger = Ledger::new(Settings::default());
        let out = ledger.judge((1..=3).map(|i| fault(i, "n1", Some("GPU-a"), i as i64)).collect());
        let lemon = lemons(&out)[0].incident_id;
        let inventory = |present: &[&str], missing: i64| {
            let mut o = Observation::new("inv", "n1", 40 * DAY, "gpu_inventory").field("missing", missing);
            o.inventory = present.iter().map(|g| (*g).to_owned()).collect();
            o
        };
        // Still there, or an incomplete inventory (the GPU may have fallen off the bus): nothing.
        assert!(ledger.replaced(&inventory(&["GPU-a", "GPU-b"], 0)).is_empty());
        assert!(ledger.replaced(&inventory(&["GPU-b"], 1)).is_empty());
        // Replaced: a new GPU in its place.
        let closed = ledger.replaced(&inventory(&["GPU-new", "GPU-b"], 0));
        assert_eq!(closed.len(), 1);
        assert_eq!((closed[0].incident_id, closed[0].kind, closed[0].recovery), (lemon, DecisionKind::Recover, true));
        assert!(closed[0].reason.contains("no longer in node n1's inventory"), "{}", closed[0].reason);
        assert!(ledger.replaced(&inventory(&["GPU-new", "GPU-b"], 0)).is_empty(), "once");
    }

    #[test]
    fn zero_turns_lemons_off() {
        let mut ledger = Ledger::new(Settings { min_incidents: 0, ..Settings::default() });
        let out = ledger.judge((1..=5).map(|i| fault(i, "n1", Some("GPU-a"), i as i64)).collect());
        assert!(lemons(&out).is_empty());
    }
}
