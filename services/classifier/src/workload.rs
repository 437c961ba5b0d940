//! Workload faults: the same application-class Xid (13, 31, 43, ...) on GPUs of several nodes that
//! share a workload, within a short window, is the workload's fault, not the GPUs'. One training
//! job crashing across 16 nodes logs an Xid 13 on every GPU it used; each GPU's own rules keep it
//! in service (application Xids never quarantine by count alone), and this module records the
//! crash once, as a workload fault naming the job, in Postgres and on the verdict topic.
//!
//! Nodes of one workload are spread over partitions, so over classifier replicas: the correlation
//! is in Postgres, not in any replica's memory. Each replica records the sightings of its batch
//! ([`sighting`]: an application Xid on a GPU with a known workload), then, per workload and under
//! an advisory lock on it, either extends the workload's open fault (one seen within the window)
//! or, when the sightings within the window span at least the node threshold, records a new fault
//! and publishes its verdict before committing. Ids are derived from the first sighting, so a
//! retried batch or a replica crash between publish and commit publishes the same verdict id again
//! (subscribers deduplicate) and records nothing twice.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use chrono::{DateTime, Utc};
use gpumedic_schemas::enriched::Workload;
use gpumedic_schemas::health::{Detail, Entity};
use gpumedic_schemas::verdict::{RecommendedAction, Severity};
use gpumedic_schemas::{EnrichedHealthEvent, Verdict};
use sqlx::PgConnection;
use uuid::Uuid;

use crate::rules::model::APPLICATION_XIDS;

/// The rule id workload-fault verdicts carry.
pub const RULE_ID: &str = "workload-fault";

/// Namespace of the derived fault and verdict ids.
const NAMESPACE: Uuid = Uuid::from_u128(0x6770_756d_6564_6963_776f_726b_6c6f_6164);

/// When sightings make a workload fault.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Settings {
    /// Sightings at most this far apart belong to one fault.
    pub window: Duration,
    /// Distinct nodes needed.
    pub min_nodes: usize,
    /// Whether synthetic (injected) events count.
    pub allow_synthetic: bool,
}

/// One application-class Xid on a GPU running a workload.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Sighting {
    /// The event's id.
    pub event_id: Uuid,
    /// `namespace/Kind/name` of the workload's top controlling owner (`namespace/Pod/name` for a
    /// bare pod).
    pub workload: String,
    /// The node.
    pub node: String,
    /// The GPU, by UUID, when known.
    pub gpu_uuid: Option<String>,
    /// The Xid.
    pub xid: i32,
    /// When it was observed.
    pub observed_at: DateTime<Utc>,
}

/// A workload's name as faults record it.
pub fn workload_name(w: &Workload) -> String {
    match (&w.owner_kind, &w.owner_name) {
        (Some(kind), Some(name)) => format!("{}/{kind}/{name}", w.namespace),
        _ => format!("{}/Pod/{}", w.namespace, w.pod),
    }
}

/// The sighting `event` makes, if any: an application-class Xid with a workload the enricher
/// found on its GPU (or the only GPU workload on the node, when the GPU is unknown).
pub fn sighting(event: &EnrichedHealthEvent, settings: &Settings) -> Option<Sighting> {
    let e = &event.event;
    let Detail::Xid(x) = &e.detail else { return None };
    if !u32::try_from(x.code).is_ok_and(|c| APPLICATION_XIDS.contains(&c)) || (e.synthetic && !settings.allow_synthetic)
    {
        return None;
    }
    let uuid = event.gpu.as_ref().and_then(|g| g.uuid.clone()).or_else(|| e.entity.gpu_uuid.clone());
    let on_gpu = |w: &&Workload| uuid.as_ref().is_some_and(|u| w.gpu_uuids.iter().any(|g| g.eq_ignore_ascii_case(u)));
    let workload = match event.workloads.iter().find(on_gpu) {
        Some(w) => w,
        // Which pod used the GPU is unknown: only a node with a single workload says for sure.
        None => match event.workloads.as_slice() {
            [only] if uuid.is_none() || only.gpu_uuids.is_empty() => only,
            _ => return None,
        },
    };
    Some(Sighting {
        event_id: e.event_id,
        workload: workload_name(workload),
        node: e.node.clone(),
        gpu_uuid: uuid,
        xid: x.code,
        observed_at: e.observed_at,
    })
}

/// A sighting as read back: event id, node, GPU UUID, Xid, time.
type SightingRow = (Uuid, String, Option<String>, i32, DateTime<Utc>);

/// A recorded workload fault.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Fault {
    /// Its id (also the verdict's incident id).
    pub fault_id: Uuid,
    /// The verdict it is published as.
    pub verdict_id: Uuid,
    /// The workload.
    pub workload: String,
    /// The application Xids seen.
    pub xids: Vec<i32>,
    /// The nodes, sorted.
    pub nodes: Vec<String>,
    /// GPUs with a sighting (by UUID, or one per node where unknown).
    pub gpus: usize,
    /// The first and last sighting.
    pub first_seen: DateTime<Utc>,
    /// The last sighting.
    pub last_seen: DateTime<Utc>,
    /// The sightings' event ids (evidence), oldest first.
    pub events: Vec<Uuid>,
}

/// Whether `sightings` of one workload (any order) make a fault: the nodes seen within `window`
/// before the newest, at least `min_nodes` of them. Pure.
pub fn fault_of(sightings: &[Sighting], settings: &Settings) -> Option<Fault> {
    let newest = sightings.iter().map(|s| s.observed_at).max()?;
    let window = chrono::Duration::from_std(settings.window).unwrap_or(chrono::Duration::MAX);
    let mut recent: Vec<&Sighting> =
        sightings.iter().filter(|s| s.observed_at >= newest.checked_sub_signed(window).unwrap_or_default()).collect();
    recent.sort_by_key(|s| (s.observed_at, s.event_id));
    let nodes: BTreeSet<&str> = recent.iter().map(|s| s.node.as_str()).collect();
    if nodes.len() < settings.min_nodes.max(1) {
        return None;
    }
    let first = recent.first()?;
    let fault_id = Uuid::new_v5(&NAMESPACE, format!("{}\n{}", first.workload, first.event_id).as_bytes());
    let gpus: BTreeSet<(&str, &str)> =
        recent.iter().map(|s| (s.node.as_str(), s.gpu_uuid.as_deref().unwrap_or_default())).collect();
    Some(Fault {
        fault_id,
        verdict_id: Uuid::new_v5(&fault_id, b"verdict"),
        workload: first.workload.clone(),
        xids: recent.iter().map(|s| s.xid).collect::<BTreeSet<_>>().into_iter().collect(),
        nodes: nodes.into_iter().map(str::to_owned).collect(),
        gpus: gpus.len(),
        first_seen: first.observed_at,
        last_seen: newest,
        events: recent.iter().map(|s| s.event_id).collect(),
    })
}

/// The verdict a fault is published as: no node action, the workload named. Keyed (as every
/// verdict) by a node: the first one the fault was seen on.
pub fn verdict(fault: &Fault, issued_at: DateTime<Utc>) -> Verdict {
    let xids: Vec<String> = fault.xids.iter().map(i32::to_string).collect();
    Verdict {
        verdict_id: fault.verdict_id,
        incident_id: fault.fault_id,
        node: fault.nodes.first().cloned().unwrap_or_default(),
        entity: Entity::default(),
        severity: Severity::Warning,
        rule_id: RULE_ID.to_owned(),
        rule_version: 1,
        action: RecommendedAction::None,
        custom_action: None,
        reason: format!(
            "Workload fault: application Xid {} on {} GPUs of {} nodes of {} within {}s; the job failed, \
             the GPUs stay in service",
            xids.join(", "),
            fault.gpus,
            fault.nodes.len(),
            fault.workload,
            (fault.last_seen - fault.first_seen).num_seconds(),
        ),
        // A verdict carries a bounded list: the first sightings are the story.
        evidence: fault.events.iter().take(32).copied().collect(),
        issued_at,
        recovery: false,
        not_before: None,
        deferrable: false,
        workload: Some(fault.workload.clone()),
    }
}

/// Groups `sightings` by workload.
pub fn by_workload(sightings: Vec<Sighting>) -> BTreeMap<String, Vec<Sighting>> {
    let mut out: BTreeMap<String, Vec<Sighting>> = BTreeMap::new();
    for s in sightings {
        out.entry(s.workload.clone()).or_default().push(s);
    }
    out
}

/// In a transaction: locks `workload`, records its new sightings, and returns the fault to publish
/// if this is the one that makes it (an open fault is extended instead). The caller publishes the
/// fault's verdict and then commits.
pub async fn decide(
    tx: &mut PgConnection,
    workload: &str,
    sightings: &[Sighting],
    settings: &Settings,
) -> Result<Option<Fault>, sqlx::Error> {
    sqlx::query("SELECT pg_advisory_xact_lock(hashtextextended('gpumedic.workload-fault:' || $1, 0))")
        .bind(workload)
        .execute(&mut *tx)
        .await?;
    for s in sightings {
        sqlx::query(
            "INSERT INTO workload_fault_sightings (event_id, workload, node, gpu_uuid, xid, observed_at)
             VALUES ($1, $2, $3, $4, $5, $6) ON CONFLICT (event_id) DO NOTHING",
        )
        .bind(s.event_id)
        .bind(&s.workload)
        .bind(&s.node)
        .bind(&s.gpu_uuid)
        .bind(s.xid)
        .bind(s.observed_at)
        .execute(&mut *tx)
        .await?;
    }
    let Some(newest) = sightings.iter().map(|s| s.observed_at).max() else { return Ok(None) };
    let window = chrono::Duration::from_std(settings.window).unwrap_or(chrono::Duration::MAX);
    let since = newest.checked_sub_signed(window).unwrap_or_default();
    // A fault seen within the window is this one still going: extend it.
    let open: Option<Uuid> = sqlx::query_scalar(
        "SELECT fault_id FROM workload_faults WHERE workload = $1 AND last_seen >= $2 ORDER BY last_seen DESC LIMIT 1",
    )
    .bind(workload)
    .bind(since)
    .fetch_optional(&mut *tx)
    .await?;
    if let Some(fault_id) = open {
        // Recounted from the sightings, so every replica's share ends up in the one record.
        sqlx::query(
            "UPDATE workload_faults f
                SET last_seen = s.last_seen, nodes = s.nodes, xids = s.xids, gpus = s.gpus
               FROM (SELECT max(observed_at) AS last_seen,
                            array_agg(DISTINCT node ORDER BY node) AS nodes,
                            array_agg(DISTINCT xid ORDER BY xid) AS xids,
                            count(DISTINCT (node, coalesce(gpu_uuid, '')))::integer AS gpus
                       FROM workload_fault_sightings
                      WHERE workload = $2
                        AND observed_at >= (SELECT first_seen FROM workload_faults WHERE fault_id = $1)
                        AND observed_at <= greatest((SELECT last_seen FROM workload_faults WHERE fault_id = $1), $3)) s
              WHERE f.fault_id = $1",
        )
        .bind(fault_id)
        .bind(workload)
        .bind(newest)
        .execute(&mut *tx)
        .await?;
        return Ok(None);
    }
    let rows: Vec<SightingRow> = sqlx::query_as(
        "SELECT event_id, node, gpu_uuid, xid, observed_at FROM workload_fault_sightings
          WHERE workload = $1 AND observed_at >= $2 AND observed_at <= $3",
    )
    .bind(workload)
    .bind(since)
    .bind(newest)
    .fetch_all(&mut *tx)
    .await?;
    let known: Vec<Sighting> = rows
        .into_iter()
        .map(|(event_id, node, gpu_uuid, xid, observed_at)| Sighting {
            event_id,
            workload: workload.to_owned(),
            node,
            gpu_uuid,
            xid,
            observed_at,
        })
        .collect();
    let Some(fault) = fault_of(&known, settings) else { return Ok(None) };
    sqlx::query(
        "INSERT INTO workload_faults (fault_id, workload, xids, nodes, gpus, first_seen, last_seen, verdict_id)
         VALUES ($1, $2, $3, $4, $5, $6, $7, $8) ON CONFLICT (fault_id) DO NOTHING",
    )
    .bind(fault.fault_id)
    .bind(&fault.workload)
    .bind(&fault.xids)
    .bind(&fault.nodes)
    .bind(i32::try_from(fault.gpus).unwrap_or(i32::MAX))
    .bind(fault.first_seen)
    .bind(fault.last_seen)
    .bind(fault.verdict_id)
    .execute(&mut *tx)
    .await?;
    Ok(Some(fault))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(second: i64) -> DateTime<Utc> {
        DateTime::from_timestamp(1_800_000_000 + second, 0).unwrap()
    }

    fn seen(node: &str, gpu: &str, second: i64) -> Sighting {
        Sighting {
            event_id: Uuid::new_v5(&NAMESPACE, format!("{node}{gpu}{second}").as_bytes()),
            workload: "ml/JobSet/train".into(),
            node: node.into(),
            gpu_uuid: Some(gpu.into()),
            xid: 13,
            observed_at: at(second),
        }
    }

    fn settings() -> Settings {
        Settings { window: Duration::from_secs(120), min_nodes: 2, allow_synthetic: false }
    }

    #[test]
    fn one_node_is_not_a_workload_fault_however_many_gpus() {
        let s: Vec<_> = (0..8).map(|g| seen("n1", &format!("GPU-{g}"), 0)).collect();
        assert_eq!(fault_of(&s, &settings()), None);
    }

    #[test]
    fn several_nodes_within_the_window_are_one_fault_with_a_stable_id() {
        let mut s: Vec<_> = (0..16).map(|n| seen(&format!("n{n:02}"), "GPU-0", n % 3)).collect();
        let fault = fault_of(&s, &settings()).expect("a fault");
        assert_eq!(fault.nodes.len(), 16);
        assert_eq!(fault.gpus, 16);
        assert_eq!(fault.xids, vec![13]);
        assert_eq!((fault.first_seen, fault.last_seen), (at(0), at(2)));
        s.reverse();
        assert_eq!(fault_of(&s, &settings()).unwrap().fault_id, fault.fault_id, "order does not matter");
        let v = verdict(&fault, at(3));
        assert_eq!(
            (v.action, v.severity, v.workload.as_deref()),
            (RecommendedAction::None, Severity::Warning, Some("ml/JobSet/train"))
        );
        assert!(v.reason.contains("16 GPUs of 16 nodes"), "{}", v.reason);
    }

    #[test]
    fn sightings_further_apart_than_the_window_do_not_add_up() {
        let s = vec![seen("n1", "GPU-0", 0), seen("n2", "GPU-0", 600)];
        assert_eq!(fault_of(&s, &settings()), None);
        let s = vec![seen("n1", "GPU-0", 0), seen("n2", "GPU-0", 600), seen("n3", "GPU-0", 601)];
        assert_eq!(fault_of(&s, &settings()).unwrap().nodes, vec!["n2".to_owned(), "n3".to_owned()]);
    }

    fn xid_event(code: i32, workloads: Vec<Workload>, gpu: Option<&str>) -> EnrichedHealthEvent {
        let mut e = gpumedic_schemas::HealthEvent::new(
            "n1",
            gpumedic_schemas::health::Source::KernelLog,
            gpumedic_schemas::health::Component::Gpu,
            Entity::default(),
            Detail::Xid(gpumedic_schemas::health::XidDetail {
                code,
                text: String::new(),
                pid: Some(7),
                process: Some("python".into()),
                nvlink5: None,
                recovery_action: None,
            }),
        );
        e.entity.gpu_uuid = gpu.map(str::to_owned);
        EnrichedHealthEvent {
            event: e,
            node_context: Default::default(),
            node_unknown: false,
            xid_catalog: None,
            workloads,
            enriched_at: at(0),
            gpu: None,
            gpu_unresolved: false,
        }
    }

    fn pod(name: &str, gpus: &[&str]) -> Workload {
        Workload {
            namespace: "ml".into(),
            pod: name.into(),
            owner_kind: Some("JobSet".into()),
            owner_name: Some("train".into()),
            gpu_uuids: gpus.iter().map(|g| (*g).to_owned()).collect(),
        }
    }

    #[test]
    fn a_sighting_is_an_application_xid_on_a_gpu_with_a_known_workload() {
        let s = settings();
        let on = sighting(&xid_event(13, vec![pod("a", &["GPU-1"]), pod("b", &["GPU-0"])], Some("GPU-0")), &s);
        assert_eq!(on.map(|s| s.workload), Some("ml/JobSet/train".to_owned()));
        assert_eq!(sighting(&xid_event(79, vec![pod("a", &["GPU-0"])], Some("GPU-0")), &s), None, "hardware Xid");
        assert_eq!(sighting(&xid_event(13, vec![], Some("GPU-0")), &s), None, "no workload");
        let two_others = vec![pod("a", &["GPU-1"]), pod("b", &["GPU-2"])];
        assert_eq!(sighting(&xid_event(13, two_others, Some("GPU-0")), &s), None, "not this GPU's workload");
        let only = sighting(&xid_event(43, vec![pod("a", &[])], Some("GPU-0")), &s);
        assert!(only.is_some(), "the node's only workload, allocation unknown");
        let bare = Workload { owner_kind: None, owner_name: None, ..pod("solo", &["GPU-0"]) };
        assert_eq!(workload_name(&bare), "ml/Pod/solo");
        let mut synthetic = xid_event(13, vec![pod("a", &["GPU-0"])], Some("GPU-0"));
        synthetic.event.synthetic = true;
        assert_eq!(sighting(&synthetic, &s), None);
        assert!(sighting(&synthetic, &Settings { allow_synthetic: true, ..s }).is_some());
    }
}
