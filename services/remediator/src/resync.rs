//! Convergence: the leader resyncs the managed nodes against the open incidents in the incident
//! store (the classifier's PostgreSQL), so whatever verdicts the remediator missed, was refused or
//! saw twice, every node ends in the state its incidents call for (docs/pipeline.md,
//! "Convergence").
//!
//! Verdicts stay the fast path; the resync is the level-triggered safety net behind them. Every
//! `--resync-interval` the leader:
//! 1. lists the managed nodes and the incidents gpumedic holds on each (the ownership record);
//! 2. reads, in that order, the open incidents of those nodes with each one's latest fault verdict,
//!    and which of the held incidents are resolved;
//! 3. re-issues each open incident's latest verdict through the same path a verdict takes (the
//!    planner answers "already done" when the node matches, so this is one read per open
//!    incident), and carries out the recovery of each held incident the store shows resolved.
//!
//! That covers a verdict refused by the rate limit, the open breaker or the pause (acted on once
//! the limit lifts, if the incident is still open), a verdict skipped as stale, a switch from
//! monitor-only to an acting mode (open incidents are acted on), a drain that missed its deadline
//! (the node is still `draining`, so the re-issued verdict drains again), and a recovery verdict
//! that never arrived. A node is released only on an incident the store shows **resolved**, never
//! because an incident is missing from a read: the classifier publishes a verdict before it writes
//! it, so a read can lag the verdict topic, and absence proves nothing. A fault is re-issued only
//! after a second look shows its incident still open, and never for an incident this leader saw
//! recover (a recovery verdict can reach the remediator before the store shows it resolved).

use std::collections::{BTreeMap, BTreeSet, HashSet, VecDeque};
use std::sync::Arc;

use crate::error::TermError;
use crate::events::{InternalEvent as _, ResyncActionFailed, ResyncFailed, ResyncFinished, names};
use gpumedic_schemas::verdict::{RecommendedAction, Verdict};
use k8s_openapi::api::core::v1::Node;
use sqlx::PgPool;
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

use crate::apply::Outcome;
use crate::handler::Handler;
use crate::plan::{NodeView, Skip};
use crate::term::{Shared, persist_trip, publish};
use crate::{ladder, maintenance, verdicts};

/// How many recovered incident ids a leader remembers (see [`Recovered`]).
const RECOVERED_MEMORY: usize = 10_000;

/// The incidents this leader saw recover, newest last, bounded: a fault verdict for one of them
/// (a replay, or a resync whose read of the store predates the recovery) is not acted on.
#[derive(Debug, Default)]
pub(crate) struct Recovered {
    order: VecDeque<String>,
    ids: HashSet<String>,
}

impl Recovered {
    /// Remembers that `incident` recovered.
    pub(crate) fn insert(&mut self, incident: &str) {
        if self.ids.insert(incident.to_owned()) {
            self.order.push_back(incident.to_owned());
            if self.order.len() > RECOVERED_MEMORY
                && let Some(old) = self.order.pop_front()
            {
                self.ids.remove(&old);
            }
        }
    }

    /// Whether `incident` recovered, as far as this leader knows.
    pub(crate) fn contains(&self, incident: &str) -> bool {
        self.ids.contains(incident)
    }
}

/// What the resync needs to know of one managed node.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct NodeSnapshot {
    /// The node's name.
    pub(crate) name: String,
    /// The incidents gpumedic holds on the node (its ownership record).
    pub(crate) held: BTreeSet<String>,
    /// Incidents with work of their own on the node (a deferred action, a repair ladder): their
    /// drivers carry them on; the resync leaves them alone.
    pub(crate) busy: BTreeSet<String>,
}

impl NodeSnapshot {
    /// The snapshot of `node`. An unreadable ownership record holds nothing the resync can use
    /// (the planner refuses it with its reason when a verdict comes).
    pub(crate) fn of(node: &Node) -> Self {
        let view = NodeView::from_node(node);
        let held =
            view.applied().ok().flatten().map(|a| a.upgraded().incidents.into_keys().collect()).unwrap_or_default();
        let mut busy = BTreeSet::new();
        if let Some(Ok(d)) = maintenance::deferred_on(node) {
            busy.insert(d.request.incident_id);
        }
        if let Some(Ok(l)) = ladder::ladder_on(node)
            && l.active()
        {
            busy.insert(l.request.incident_id);
        }
        NodeSnapshot { name: view.name, held, busy }
    }
}

/// An open incident of the store, with its latest fault verdict as published (absent for a
/// verdict written before the store kept whole verdicts).
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct OpenIncident {
    /// The incident.
    pub(crate) incident_id: String,
    /// Its node.
    pub(crate) node: String,
    /// Its latest fault verdict.
    pub(crate) verdict: Option<Verdict>,
}

/// A held incident the store shows resolved, with its recovery verdict when the store has it.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct ResolvedIncident {
    /// The incident.
    pub(crate) incident_id: String,
    /// Its recovery verdict.
    pub(crate) recovery: Option<Verdict>,
}

/// One thing the resync does.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum Step {
    /// Act on an open incident's latest fault verdict again.
    Reissue(Verdict),
    /// Carry out a resolved incident's recovery.
    Release(Verdict),
}

/// What one resync decided, with what it could not use.
#[derive(Debug, Default, PartialEq)]
pub(crate) struct Resync {
    /// The steps, in node order.
    pub(crate) steps: Vec<Step>,
    /// Open incidents or resolved held ones whose verdict the store does not keep whole.
    pub(crate) no_record: usize,
    /// Held incidents the store knows nothing of (purged by retention, or another database).
    pub(crate) unknown: usize,
}

/// Decides the resync, purely: `nodes` as listed first, then `open` and `resolved` as read from
/// the store after; `recovered` says which incidents this leader saw recover.
pub(crate) fn decide(
    nodes: &[NodeSnapshot],
    open: &[OpenIncident],
    resolved: &[ResolvedIncident],
    recovered: &dyn Fn(&str) -> bool,
) -> Resync {
    let mut out = Resync::default();
    let by_name: BTreeMap<&str, &NodeSnapshot> = nodes.iter().map(|n| (n.name.as_str(), n)).collect();
    let mut open_by_node: BTreeMap<&str, Vec<&OpenIncident>> = BTreeMap::new();
    for o in open {
        open_by_node.entry(o.node.as_str()).or_default().push(o);
    }
    let resolved: BTreeMap<&str, &ResolvedIncident> = resolved.iter().map(|r| (r.incident_id.as_str(), r)).collect();
    let open_ids: HashSet<&str> = open.iter().map(|o| o.incident_id.as_str()).collect();
    for (name, node) in &by_name {
        // Recoveries first: a node whose last quarantining incident resolved is released before
        // an open marking incident is looked at.
        for id in &node.held {
            if node.busy.contains(id) {
                continue;
            }
            match resolved.get(id.as_str()) {
                Some(ResolvedIncident { recovery: Some(v), .. }) => out.steps.push(Step::Release(v.clone())),
                Some(ResolvedIncident { recovery: None, .. }) => out.no_record += 1,
                None if !open_ids.contains(id.as_str()) => out.unknown += 1,
                None => {}
            }
        }
        for o in open_by_node.get(name).into_iter().flatten() {
            if node.busy.contains(&o.incident_id) || recovered(&o.incident_id) {
                continue;
            }
            match &o.verdict {
                None => out.no_record += 1,
                Some(v) if v.recovery || matches!(v.action, RecommendedAction::None | RecommendedAction::Unknown) => {}
                Some(v) => out.steps.push(Step::Reissue(v.clone())),
            }
        }
    }
    out
}

/// The incident store, read-only.
#[derive(Clone)]
pub(crate) struct IncidentStore {
    pool: PgPool,
}

/// A verdict read back from the store's JSON record; an unreadable one counts as absent.
fn verdict_from(record: Option<String>) -> Option<Verdict> {
    let record = record?;
    match serde_json::from_str(&record) {
        Ok(v) => Some(v),
        Err(e) => {
            tracing::warn!(error = %e, "Ignoring a verdict record the store keeps but this remediator cannot read.");
            None
        }
    }
}

impl IncidentStore {
    /// A pool of two connections to `url`, with the runtime's statement and lock timeouts.
    pub(crate) async fn connect(url: &str) -> Result<Self, TermError> {
        Ok(IncidentStore { pool: gpumedic_runtime::postgres::connect(url, 2).await? })
    }

    /// The open incidents on `nodes`, each with its latest fault verdict.
    pub(crate) async fn open_on(&self, nodes: &[String]) -> Result<Vec<OpenIncident>, sqlx::Error> {
        let rows: Vec<(Uuid, String, Option<String>)> = sqlx::query_as(
            "SELECT i.incident_id, i.node, v.record::text
               FROM incidents i
               LEFT JOIN LATERAL (
                   SELECT record FROM verdicts
                    WHERE verdicts.incident_id = i.incident_id AND NOT recovery
                    ORDER BY issued_at DESC LIMIT 1) v ON true
              WHERE i.resolved_at IS NULL AND i.node = ANY($1)
              ORDER BY i.node, i.opened_at",
        )
        .bind(nodes)
        .fetch_all(&self.pool)
        .await?;
        Ok(rows
            .into_iter()
            .map(|(id, node, record)| OpenIncident { incident_id: id.to_string(), node, verdict: verdict_from(record) })
            .collect())
    }

    /// Which of `incidents` are resolved, each with its latest recovery verdict.
    pub(crate) async fn resolved_among(&self, incidents: &[Uuid]) -> Result<Vec<ResolvedIncident>, sqlx::Error> {
        let rows: Vec<(Uuid, Option<String>)> = sqlx::query_as(
            "SELECT i.incident_id, v.record::text
               FROM incidents i
               LEFT JOIN LATERAL (
                   SELECT record FROM verdicts
                    WHERE verdicts.incident_id = i.incident_id AND recovery
                    ORDER BY issued_at DESC LIMIT 1) v ON true
              WHERE i.incident_id = ANY($1) AND i.resolved_at IS NOT NULL",
        )
        .bind(incidents)
        .fetch_all(&self.pool)
        .await?;
        Ok(rows
            .into_iter()
            .map(|(id, record)| ResolvedIncident { incident_id: id.to_string(), recovery: verdict_from(record) })
            .collect())
    }

    /// Whether `incident` is still open (the second look before a fault is re-issued).
    pub(crate) async fn still_open(&self, incident: Uuid) -> Result<bool, sqlx::Error> {
        let open: Option<bool> = sqlx::query_scalar("SELECT resolved_at IS NULL FROM incidents WHERE incident_id = $1")
            .bind(incident)
            .fetch_optional(&self.pool)
            .await?;
        Ok(open.unwrap_or(false))
    }
}

/// While leading: every `interval`, one resync (see the module's documentation). The first runs
/// one interval after the term starts, so a new leader first takes up the verdicts in flight.
pub(crate) async fn resync_loop(shared: Arc<Shared>, url: String, term: CancellationToken) -> Result<(), TermError> {
    let handler = Handler { shared: shared.clone(), term: term.clone() };
    let mut store: Option<IncidentStore> = None;
    loop {
        tokio::select! {
            () = term.cancelled() => return Ok(()),
            () = tokio::time::sleep(shared.resync_interval) => {}
        }
        if shared.remediator.paused() {
            continue;
        }
        if store.is_none() {
            match IncidentStore::connect(&url).await {
                Ok(s) => store = Some(s),
                Err(e) => {
                    ResyncFailed { error: &e, unreachable: true }.emit();
                    continue;
                }
            }
        }
        let Some(s) = store.as_ref() else { continue };
        let started = std::time::Instant::now();
        match resync_once(&shared, &handler, s, &term).await {
            Ok(()) => {
                ResyncFinished { elapsed: started.elapsed() }.emit();
            }
            Err(e) => {
                ResyncFailed { error: &e, unreachable: false }.emit();
            }
        }
    }
}

/// One resync: list, read, decide, act.
async fn resync_once(
    shared: &Shared,
    handler: &Handler,
    store: &IncidentStore,
    term: &CancellationToken,
) -> Result<(), TermError> {
    // The nodes first, then the store: a record on a node at listing time was written after its
    // verdict, which the classifier published before it wrote the incident, so the store read
    // after the listing knows every incident a record holds. The fleet watch's copies serve as
    // the listing: each is a version its node had, no later than now. What the resync then does
    // is planned from the node as it is (a write from a stale copy is refused and re-planned).
    let snapshots = shared.fleet.map_nodes(NodeSnapshot::of).await?;
    let names: Vec<String> = snapshots.iter().map(|n| n.name.clone()).collect();
    let held: Vec<Uuid> =
        snapshots.iter().flat_map(|n| n.held.iter()).filter_map(|id| Uuid::parse_str(id).ok()).collect();
    let open = store.open_on(&names).await?;
    let resolved = store.resolved_among(&held).await?;
    metrics::gauge!(names::RESYNC_OPEN_INCIDENTS).set(open.len() as f64);
    let plan = {
        let recovered = shared.recovered.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        decide(&snapshots, &open, &resolved, &|id| recovered.contains(id))
    };
    if plan.no_record > 0 {
        tracing::warn!(
            count = plan.no_record,
            "Some incidents have no whole verdict in the store (written before it kept them); the resync leaves them to their verdicts."
        );
        metrics::counter!(names::RESYNC_SKIPPED_TOTAL, "reason" => "no_record").increment(plan.no_record as u64);
    }
    if plan.unknown > 0 {
        metrics::counter!(names::RESYNC_SKIPPED_TOTAL, "reason" => "unknown_incident").increment(plan.unknown as u64);
    }
    tracing::debug!(nodes = snapshots.len(), open = open.len(), steps = plan.steps.len(), "Resync decided.");
    for step in plan.steps {
        if term.is_cancelled() {
            return Ok(());
        }
        let (verdict, kind) = match step {
            Step::Reissue(v) => {
                // A second look: the incident may have closed since the read.
                if !store.still_open(v.incident_id).await? {
                    continue;
                }
                (v, "fault")
            }
            Step::Release(v) => (v, "recovery"),
        };
        if let Err(e) = resync_verdict(shared, handler, &verdict, kind).await {
            ResyncActionFailed { node: &verdict.node, incident: &verdict.incident_id, kind, error: &e }.emit();
        }
    }
    Ok(())
}

/// Acts on `verdict` as its handler would, and publishes an outcome only when something changed
/// (or was deferred): an incident in step with its node costs one read and says nothing.
async fn resync_verdict(
    shared: &Shared,
    handler: &Handler,
    verdict: &Verdict,
    kind: &'static str,
) -> Result<(), TermError> {
    if !shared.fleet.manages(&verdict.node).await? {
        return Ok(());
    }
    let request = crate::request::Remediation { reissue: !verdict.recovery, ..verdicts::remediation(verdict) };
    let outcome = handler.act_on_node(verdict, &request).await;
    persist_trip(shared).await?;
    let result = match outcome {
        Ok(o) => o,
        Err(e) => return Err(e.into()),
    };
    // A recovery acted on is already remembered (`Handler::act_on_node`).
    let label = match &result {
        Outcome::Applied { .. } => "applied",
        Outcome::AlreadyDone => "already_done",
        Outcome::Skipped { reason: Skip::Deferred(_), .. } => "deferred",
        Outcome::Skipped { reason: Skip::Recovered, .. } => "recovered",
        Outcome::Skipped { .. } => "held",
    };
    metrics::counter!(names::RESYNC_ACTIONS_TOTAL, "kind" => kind, "result" => label).increment(1);
    if !matches!(result, Outcome::Applied { .. } | Outcome::Skipped { reason: Skip::Deferred(_), .. }) {
        return Ok(());
    }
    let mut outcome = verdicts::outcome(verdict, &Ok(result));
    outcome.detail = format!("resync (the node did not match its {kind} verdict): {}", outcome.detail);
    tracing::info!(node = %verdict.node, incident = %verdict.incident_id, verdict_id = %verdict.verdict_id,
        kind, detail = %outcome.detail, "The resync brought a node in line with its incidents.");
    publish(shared, &outcome, None).await?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use gpumedic_schemas::health::Entity;
    use gpumedic_schemas::verdict::Severity;

    fn verdict(node: &str, incident: &str, action: RecommendedAction, recovery: bool) -> Verdict {
        Verdict {
            verdict_id: Uuid::new_v4(),
            incident_id: Uuid::parse_str(incident).expect("a uuid"),
            node: node.to_owned(),
            entity: Entity::default(),
            severity: Severity::Critical,
            rule_id: "xid-79-fallen-off-bus".to_owned(),
            rule_version: 1,
            action,
            custom_action: None,
            reason: "Xid79".to_owned(),
            evidence: Vec::new(),
            issued_at: chrono::Utc::now(),
            recovery,
            not_before: None,
            deferrable: false,
            workload: None,
        }
    }

    const I1: &str = "00000000-0000-0000-0000-000000000001";
    const I2: &str = "00000000-0000-0000-0000-000000000002";

    fn node(name: &str, held: &[&str]) -> NodeSnapshot {
        NodeSnapshot {
            name: name.to_owned(),
            held: held.iter().map(|s| (*s).to_owned()).collect(),
            busy: BTreeSet::new(),
        }
    }

    fn open(node: &str, incident: &str, action: RecommendedAction) -> OpenIncident {
        OpenIncident {
            incident_id: incident.to_owned(),
            node: node.to_owned(),
            verdict: Some(verdict(node, incident, action, false)),
        }
    }

    fn never(_: &str) -> bool {
        false
    }

    #[test]
    fn an_open_incident_is_reissued_whether_or_not_the_node_holds_it() {
        let nodes = [node("a", &[]), node("b", &[I2])];
        let open = [open("a", I1, RecommendedAction::Drain), open("b", I2, RecommendedAction::Cordon)];
        let r = decide(&nodes, &open, &[], &never);
        let reissued: Vec<(String, String)> = r
            .steps
            .iter()
            .map(|s| match s {
                Step::Reissue(v) => (v.node.clone(), v.incident_id.to_string()),
                Step::Release(_) => panic!("nothing resolved"),
            })
            .collect();
        assert_eq!(reissued, [("a".to_owned(), I1.to_owned()), ("b".to_owned(), I2.to_owned())]);
    }

    #[test]
    fn a_node_is_released_only_for_an_incident_the_store_shows_resolved() {
        let nodes = [node("a", &[I1]), node("b", &[I2])];
        // I1 is missing from the open read (a read lagging the verdict topic): not released.
        // I2 is resolved: released with its recovery verdict.
        let rec = verdict("b", I2, RecommendedAction::None, true);
        let resolved = [ResolvedIncident { incident_id: I2.to_owned(), recovery: Some(rec.clone()) }];
        let r = decide(&nodes, &[], &resolved, &never);
        assert_eq!(r.steps, [Step::Release(rec)]);
        assert_eq!(r.unknown, 1, "I1 is neither open nor resolved in the store");
    }

    #[test]
    fn an_incident_seen_to_recover_is_not_reissued_from_an_older_read() {
        let nodes = [node("a", &[])];
        let r = decide(&nodes, &[open("a", I1, RecommendedAction::Drain)], &[], &|id| id == I1);
        assert!(r.steps.is_empty(), "{r:?}");
    }

    #[test]
    fn deferred_and_laddered_incidents_are_left_to_their_drivers() {
        let mut n = node("a", &[I1]);
        n.busy.insert(I1.to_owned());
        let resolved = [ResolvedIncident {
            incident_id: I1.to_owned(),
            recovery: Some(verdict("a", I1, RecommendedAction::None, true)),
        }];
        let r = decide(&[n.clone()], &[open("a", I1, RecommendedAction::RebootNode)], &[], &never);
        assert!(r.steps.is_empty(), "{r:?}");
        let r = decide(&[n], &[], &resolved, &never);
        assert!(r.steps.is_empty(), "{r:?}");
    }

    #[test]
    fn unmanaged_nodes_no_action_and_missing_records_do_nothing() {
        let nodes = [node("a", &[])];
        let elsewhere = open("z", I1, RecommendedAction::Drain);
        let quiet = open("a", I2, RecommendedAction::None);
        let mut bare = open("a", I1, RecommendedAction::Drain);
        bare.verdict = None;
        let r = decide(&nodes, &[elsewhere, quiet, bare], &[], &never);
        assert!(r.steps.is_empty(), "{r:?}");
        assert_eq!(r.no_record, 1);
    }

    #[test]
    fn the_recovered_memory_is_bounded_and_forgets_the_oldest() {
        let mut m = Recovered::default();
        for i in 0..=RECOVERED_MEMORY {
            m.insert(&i.to_string());
        }
        assert!(!m.contains("0"));
        assert!(m.contains("1") && m.contains(&RECOVERED_MEMORY.to_string()));
    }
}
