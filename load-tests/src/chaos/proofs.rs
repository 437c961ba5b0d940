//! The chaos scenario's proofs, as pure functions over what the run collected from Kafka,
//! PostgreSQL and the apiserver once the pipeline settled. Each returns the ids that break it, so
//! a failure names them.

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};

use chrono::{DateTime, Utc};
use gpumedic_remediator::maintenance::DEFERRED_ANNOTATION;
use gpumedic_remediator::plan::{NodeView, TAINT_KEY};
use gpumedic_remediator::verdicts::remediation;
use gpumedic_schemas::{ActionOutcome, ActionStatus, Verdict};
use uuid::Uuid;

/// An incident row of PostgreSQL that is still open.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OpenIncident {
    /// `incidents.incident_id`.
    pub incident_id: Uuid,
    /// `incidents.node`.
    pub node: String,
    /// `incidents.rule_id`.
    pub rule_id: String,
    /// `incidents.gpu_uuid`.
    pub gpu: Option<String>,
}

/// What the run read back once the pipeline settled.
#[derive(Debug, Default)]
pub struct Collected {
    /// Every event id the simulator produced (its producer acknowledged).
    pub produced: HashSet<Uuid>,
    /// Every event id on the raw topic (the simulator's and the collector's).
    pub raw_topic: HashSet<Uuid>,
    /// Every distinct event id in `health_events`.
    pub recorded: HashSet<Uuid>,
    /// Event ids `health_events` holds more than once.
    pub recorded_twice: Vec<Uuid>,
    /// Event ids found on the dead-letter topics.
    pub dead_lettered: HashSet<Uuid>,
    /// The open incidents.
    pub open_incidents: Vec<OpenIncident>,
    /// Every verdict on the verdicts topic (a redelivered one may appear twice).
    pub verdicts: Vec<Verdict>,
    /// Every verdict id in the `verdicts` table.
    pub verdicts_recorded: HashSet<Uuid>,
    /// Every outcome on the actions topic.
    pub outcomes: Vec<ActionOutcome>,
    /// Every `(verdict_id, action, status)` of the `actions` table.
    pub outcomes_recorded: HashSet<(Uuid, String, String)>,
    /// The fleet's Nodes as the apiserver has them.
    pub nodes: Vec<NodeView>,
}

/// The failures of each proof, by id (empty when it holds).
#[derive(Debug, Default, serde::Serialize)]
pub struct Findings {
    /// Simulator events the raw topic does not hold (the harness's producer or Kafka lost them).
    pub events_not_on_raw_topic: Vec<String>,
    /// Raw-topic events neither in PostgreSQL nor dead-lettered.
    pub events_lost: Vec<String>,
    /// Event ids recorded twice.
    pub events_recorded_twice: Vec<String>,
    /// Open incidents sharing a (node, rule, GPU) key: `node/rule/gpu: id, id`.
    pub duplicate_open_incidents: Vec<String>,
    /// Verdicts published but not recorded in PostgreSQL.
    pub verdicts_not_recorded: Vec<String>,
    /// Verdicts recorded in PostgreSQL but never published.
    pub verdicts_not_published: Vec<String>,
    /// Verdicts for the fleet with no outcome on the actions topic.
    pub verdicts_without_outcome: Vec<String>,
    /// `(verdict, action)` applied more than once: `verdict/action xN`.
    pub actions_applied_twice: Vec<String>,
    /// Outcomes on the actions topic missing from PostgreSQL.
    pub outcomes_not_recorded: Vec<String>,
    /// Nodes whose cordon, taint or ownership record differs from what their open incidents call
    /// for: `node: why`.
    pub nodes_in_wrong_state: Vec<String>,
}

impl Findings {
    /// Whether every proof holds.
    pub fn passed(&self) -> bool {
        self.figures().iter().all(|(_, n)| *n == 0)
    }

    /// Each proof's name and number of failures, in the order they are printed.
    pub fn figures(&self) -> Vec<(&'static str, usize)> {
        vec![
            ("events not on the raw topic", self.events_not_on_raw_topic.len()),
            ("events lost", self.events_lost.len()),
            ("event ids recorded twice", self.events_recorded_twice.len()),
            ("duplicate open incidents", self.duplicate_open_incidents.len()),
            ("verdicts published, not recorded", self.verdicts_not_recorded.len()),
            ("verdicts recorded, not published", self.verdicts_not_published.len()),
            ("verdicts without an outcome", self.verdicts_without_outcome.len()),
            ("actions applied twice", self.actions_applied_twice.len()),
            ("outcomes not recorded", self.outcomes_not_recorded.len()),
            ("nodes in the wrong state", self.nodes_in_wrong_state.len()),
        ]
    }

    /// Each proof's failing ids (at most `limit` of each), for the report.
    pub fn failing_ids(&self, limit: usize) -> Vec<(&'static str, Vec<String>)> {
        let lists = [
            &self.events_not_on_raw_topic,
            &self.events_lost,
            &self.events_recorded_twice,
            &self.duplicate_open_incidents,
            &self.verdicts_not_recorded,
            &self.verdicts_not_published,
            &self.verdicts_without_outcome,
            &self.actions_applied_twice,
            &self.outcomes_not_recorded,
            &self.nodes_in_wrong_state,
        ];
        self.figures()
            .into_iter()
            .zip(lists)
            .filter(|((_, n), _)| *n > 0)
            .map(|((name, _), ids)| (name, ids.iter().take(limit).cloned().collect()))
            .collect()
    }
}

/// An enum's name as the schemas spell it (`reboot_node`, `applied`), as the classifier stores it.
pub fn wire_name<T: serde::Serialize>(value: &T) -> String {
    serde_json::to_value(value).ok().and_then(|j| j.as_str().map(str::to_owned)).unwrap_or_default()
}

fn sorted(ids: impl IntoIterator<Item = Uuid>) -> Vec<String> {
    let mut v: Vec<String> = ids.into_iter().map(|u| u.to_string()).collect();
    v.sort();
    v
}

/// What an open incident asks of its node, from its verdicts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Wants {
    /// Out of scheduling now.
    Quarantine,
    /// Out of scheduling once its wait ends (a future `not_before`, or a deferrable drain waiting
    /// for an idle GPU): marked and deferred meanwhile, or already quarantined.
    Held,
}

/// Runs every proof over `c`; `fleet` names the nodes the remediator manages, `now` is when the
/// nodes were read.
pub fn check(c: &Collected, fleet: &HashSet<String>, now: DateTime<Utc>) -> Findings {
    let mut f = Findings {
        events_not_on_raw_topic: sorted(c.produced.difference(&c.raw_topic).copied()),
        events_lost: sorted(
            c.raw_topic.iter().filter(|id| !c.recorded.contains(id) && !c.dead_lettered.contains(id)).copied(),
        ),
        events_recorded_twice: sorted(c.recorded_twice.iter().copied()),
        ..Findings::default()
    };

    let mut keys: BTreeMap<(String, String, String), Vec<String>> = BTreeMap::new();
    for i in &c.open_incidents {
        keys.entry((i.node.clone(), i.rule_id.clone(), i.gpu.clone().unwrap_or_default()))
            .or_default()
            .push(i.incident_id.to_string());
    }
    f.duplicate_open_incidents = keys
        .into_iter()
        .filter(|(_, ids)| ids.len() > 1)
        .map(|((node, rule, gpu), ids)| format!("{node}/{rule}/{gpu}: {}", ids.join(", ")))
        .collect();

    let published: HashSet<Uuid> = c.verdicts.iter().map(|v| v.verdict_id).collect();
    f.verdicts_not_recorded = sorted(published.difference(&c.verdicts_recorded).copied());
    f.verdicts_not_published = sorted(c.verdicts_recorded.difference(&published).copied());

    let answered: HashSet<Uuid> = c.outcomes.iter().map(|o| o.verdict_id).collect();
    f.verdicts_without_outcome = sorted(
        published
            .iter()
            .filter(|id| !answered.contains(id))
            .copied()
            .filter(|id| c.verdicts.iter().find(|v| v.verdict_id == *id).is_some_and(|v| fleet.contains(&v.node))),
    );
    let mut applied: BTreeMap<(Uuid, String), usize> = BTreeMap::new();
    for o in c.outcomes.iter().filter(|o| o.status == ActionStatus::Applied) {
        *applied.entry((o.verdict_id, wire_name(&o.action))).or_default() += 1;
    }
    f.actions_applied_twice =
        applied.into_iter().filter(|(_, n)| *n > 1).map(|((v, a), n)| format!("{v}/{a} x{n}")).collect();
    let mut not_recorded: BTreeSet<String> = BTreeSet::new();
    for o in &c.outcomes {
        let key = (o.verdict_id, wire_name(&o.action), wire_name(&o.status));
        if !c.outcomes_recorded.contains(&key) {
            not_recorded.insert(format!("{}/{}/{}", key.0, key.1, key.2));
        }
    }
    f.outcomes_not_recorded = not_recorded.into_iter().collect();

    f.nodes_in_wrong_state = node_states(c, now);
    f
}

/// The final-state proof: each node against what its open incidents call for.
fn node_states(c: &Collected, now: DateTime<Utc>) -> Vec<String> {
    let open: HashSet<Uuid> = c.open_incidents.iter().map(|i| i.incident_id).collect();
    // Per open incident, the strongest thing any of its (non-recovery) verdicts asked for: a
    // milder verdict later does not release the node (plan::Claim::quarantines).
    let mut wants: HashMap<Uuid, Wants> = HashMap::new();
    for v in c.verdicts.iter().filter(|v| !v.recovery && open.contains(&v.incident_id)) {
        let request = remediation(v);
        if !request.action.quarantines() {
            continue;
        }
        let held = v.not_before.is_some_and(|at| at > now) || (v.deferrable && request.action.drains());
        let w = if held { Wants::Held } else { Wants::Quarantine };
        let e = wants.entry(v.incident_id).or_insert(w);
        if w == Wants::Quarantine {
            *e = Wants::Quarantine;
        }
    }
    let mut by_node: HashMap<&str, Vec<(Uuid, Wants)>> = HashMap::new();
    for i in &c.open_incidents {
        if let Some(w) = wants.get(&i.incident_id) {
            by_node.entry(i.node.as_str()).or_default().push((i.incident_id, *w));
        }
    }
    let mut wrong = Vec::new();
    for node in &c.nodes {
        let asks = by_node.get(node.name.as_str()).cloned().unwrap_or_default();
        let applied = match node.applied() {
            Ok(a) => a.unwrap_or_default(),
            Err(e) => {
                wrong.push(format!("{}: unreadable ownership record: {e}", node.name));
                continue;
            }
        };
        let tainted = node.taints.iter().any(|t| t.key == TAINT_KEY);
        let quarantined = node.unschedulable && tainted;
        let claims_quarantine: BTreeSet<&String> =
            applied.incidents.iter().filter(|(_, c)| c.quarantines).map(|(id, _)| id).collect();
        let must: Vec<Uuid> = asks.iter().filter(|(_, w)| *w == Wants::Quarantine).map(|(id, _)| *id).collect();
        let held: Vec<Uuid> = asks.iter().filter(|(_, w)| *w == Wants::Held).map(|(id, _)| *id).collect();
        if !must.is_empty() {
            if !quarantined {
                wrong.push(format!(
                    "{}: open quarantining incident(s) {} but cordoned={} tainted={}",
                    node.name,
                    join(&must),
                    node.unschedulable,
                    tainted
                ));
            }
            let unclaimed: Vec<Uuid> =
                must.iter().filter(|id| !claims_quarantine.contains(&id.to_string())).copied().collect();
            if !unclaimed.is_empty() {
                wrong.push(format!(
                    "{}: open quarantining incident(s) {} missing from the ownership record",
                    node.name,
                    join(&unclaimed)
                ));
            }
        } else if !held.is_empty() {
            if !quarantined && !node.annotations.contains_key(DEFERRED_ANNOTATION) {
                wrong.push(format!("{}: held incident(s) {} neither quarantined nor deferred", node.name, join(&held)));
            }
        } else if node.unschedulable || tainted || !claims_quarantine.is_empty() {
            wrong.push(format!(
                "{}: no open quarantining incident but cordoned={} tainted={} claims={:?}",
                node.name, node.unschedulable, tainted, claims_quarantine
            ));
        }
        // A quarantine claim for an incident PostgreSQL says is closed: its recovery was not applied.
        let stale: Vec<&String> = claims_quarantine
            .iter()
            .filter(|id| id.parse::<Uuid>().map_or(true, |u| !open.contains(&u)))
            .copied()
            .collect();
        if !stale.is_empty() && !must.is_empty() {
            wrong.push(format!("{}: quarantine claims of closed incidents {stale:?}", node.name));
        }
    }
    wrong
}

fn join(ids: &[Uuid]) -> String {
    ids.iter().map(Uuid::to_string).collect::<Vec<_>>().join(", ")
}

#[cfg(test)]
mod tests {
    use super::*;
    use gpumedic_schemas::RecommendedAction;
    use gpumedic_schemas::health::Entity;

    fn verdict(node: &str, incident: Uuid, action: RecommendedAction, recovery: bool) -> Verdict {
        Verdict {
            verdict_id: Uuid::new_v4(),
            incident_id: incident,
            node: node.into(),
            entity: Entity::default(),
            severity: gpumedic_schemas::Severity::Critical,
            rule_id: "xid-79-fallen-off-the-bus".into(),
            rule_version: 1,
            action,
            custom_action: None,
            reason: "Xid79".into(),
            evidence: vec![],
            issued_at: Utc::now(),
            recovery,
            not_before: None,
            deferrable: false,
            workload: None,
        }
    }

    fn outcome(v: &Verdict, status: ActionStatus) -> ActionOutcome {
        ActionOutcome {
            verdict_id: v.verdict_id,
            node: v.node.clone(),
            action: v.action,
            status,
            detail: String::new(),
            at: Utc::now(),
        }
    }

    fn node(name: &str, cordoned: bool, claims: &[Uuid]) -> NodeView {
        let mut n = NodeView { name: name.into(), unschedulable: cordoned, ..NodeView::default() };
        if cordoned {
            n.taints.push(gpumedic_remediator::plan::Taint {
                key: TAINT_KEY.into(),
                value: Some("gpu".into()),
                effect: "NoSchedule".into(),
            });
        }
        if !claims.is_empty() {
            let incidents: serde_json::Map<String, serde_json::Value> = claims
                .iter()
                .map(|id| (id.to_string(), serde_json::json!({ "quarantines": true, "condition": "GpuUnhealthy" })))
                .collect();
            let record = serde_json::json!({ "incidentId": claims[0].to_string(), "cordoned": cordoned,
                "taints": [], "incidents": incidents });
            n.annotations.insert(gpumedic_remediator::plan::APPLIED_ANNOTATION.into(), record.to_string());
        }
        n
    }

    /// A consistent run: one quarantined node, one recovered node, one healthy node.
    fn consistent() -> (Collected, HashSet<String>) {
        let (open, closed) = (Uuid::new_v4(), Uuid::new_v4());
        let v1 = verdict("n1", open, RecommendedAction::RebootNode, false);
        let v2 = verdict("n2", closed, RecommendedAction::RebootNode, false);
        let v3 = verdict("n2", closed, RecommendedAction::RebootNode, true);
        let e: Vec<Uuid> = (0..5).map(|_| Uuid::new_v4()).collect();
        let outcomes = vec![
            outcome(&v1, ActionStatus::Applied),
            outcome(&v1, ActionStatus::AlreadyDone),
            outcome(&v2, ActionStatus::Applied),
            outcome(&v3, ActionStatus::Applied),
        ];
        let c = Collected {
            produced: e[..4].iter().copied().collect(),
            raw_topic: e.iter().copied().collect(),
            recorded: e[..4].iter().copied().collect(),
            dead_lettered: [e[4]].into_iter().collect(),
            open_incidents: vec![OpenIncident {
                incident_id: open,
                node: "n1".into(),
                rule_id: "xid-79-fallen-off-the-bus".into(),
                gpu: None,
            }],
            verdicts_recorded: [&v1, &v2, &v3].iter().map(|v| v.verdict_id).collect(),
            outcomes_recorded: outcomes
                .iter()
                .map(|o| (o.verdict_id, wire_name(&o.action), wire_name(&o.status)))
                .collect(),
            verdicts: vec![v1.clone(), v1, v2, v3],
            outcomes,
            nodes: vec![node("n1", true, &[open]), node("n2", false, &[]), node("n3", false, &[])],
            ..Collected::default()
        };
        (c, ["n1", "n2", "n3"].map(String::from).into_iter().collect())
    }

    #[test]
    fn a_consistent_run_passes_every_proof() {
        let (c, fleet) = consistent();
        let f = check(&c, &fleet, Utc::now());
        assert!(f.passed(), "{f:?}");
    }

    #[test]
    fn each_kind_of_loss_or_duplicate_is_named_by_id() {
        let (mut c, fleet) = consistent();
        let lost = *c.recorded.iter().next().unwrap();
        c.recorded.remove(&lost);
        c.recorded_twice.push(lost);
        let mut twin = c.open_incidents[0].clone();
        twin.incident_id = Uuid::new_v4();
        c.open_incidents.push(twin.clone());
        let v = c.verdicts[0].clone();
        c.outcomes.push(outcome(&v, ActionStatus::Applied));
        let unanswered = verdict("n3", Uuid::new_v4(), RecommendedAction::Monitor, false);
        c.verdicts.push(unanswered.clone());
        let f = check(&c, &fleet, Utc::now());
        assert_eq!(f.events_lost, vec![lost.to_string()]);
        assert_eq!(f.events_recorded_twice, vec![lost.to_string()]);
        assert_eq!(f.duplicate_open_incidents.len(), 1, "{f:?}");
        assert!(f.duplicate_open_incidents[0].contains(&twin.incident_id.to_string()));
        assert_eq!(f.actions_applied_twice, vec![format!("{}/reboot_node x2", v.verdict_id)]);
        assert_eq!(f.verdicts_without_outcome, vec![unanswered.verdict_id.to_string()]);
        assert_eq!(f.verdicts_not_recorded, vec![unanswered.verdict_id.to_string()]);
        assert!(!f.passed());
    }

    #[test]
    fn a_node_out_of_step_with_its_incidents_is_named() {
        let (mut c, fleet) = consistent();
        // n1's quarantining incident is open but the node is not cordoned; n3 is cordoned for nothing.
        c.nodes = vec![node("n1", false, &[]), node("n2", false, &[]), node("n3", true, &[Uuid::new_v4()])];
        let f = check(&c, &fleet, Utc::now());
        let names: Vec<&str> = f.nodes_in_wrong_state.iter().map(|s| s.split(':').next().unwrap()).collect();
        assert_eq!(names, vec!["n1", "n1", "n3"], "{f:?}");
    }

    #[test]
    fn a_held_incident_may_wait_deferred_but_not_vanish() {
        let (mut c, fleet) = consistent();
        let held = Uuid::new_v4();
        let mut v = verdict("n3", held, RecommendedAction::ResetGpu, false);
        v.deferrable = true;
        c.verdicts_recorded.insert(v.verdict_id);
        c.outcomes.push(outcome(&v, ActionStatus::SkippedByMode));
        c.outcomes_recorded.insert((v.verdict_id, "reset_gpu".into(), "skipped_by_mode".into()));
        c.verdicts.push(v);
        c.open_incidents.push(OpenIncident { incident_id: held, node: "n3".into(), rule_id: "r".into(), gpu: None });
        let f = check(&c, &fleet, Utc::now());
        assert_eq!(f.nodes_in_wrong_state.len(), 1, "{f:?}");
        c.nodes[2].annotations.insert(DEFERRED_ANNOTATION.into(), "{}".into());
        assert!(check(&c, &fleet, Utc::now()).passed());
    }
}
