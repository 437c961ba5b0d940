//! One NVLink root fault across the nodes of an NVLink domain (docs/decisions.md, principle 9).
//!
//! When one GPU's NVLink goes down, its peers in the same NVLink domain log sympathetic errors
//! (Xid 145) within seconds, and in a multi-node domain (a GB200 NVL72: 72 GPUs over 18 nodes)
//! most peers are on other nodes. The engine's state is per node, and nodes are spread over
//! classifier replicas, so the root incident is looked up here, before the engine decides, and
//! handed to it as a fact on the observation ([`Observation::domain_roots`]):
//!
//! - the incident store is the shared truth: a root's opening decision carries the GPU's domain,
//!   recorded on its incident row (`incidents.nvlink_domain`), so every replica finds it once its
//!   batch is committed;
//! - roots opened earlier in the same batch are not committed yet, so the replica remembers the
//!   roots it opens as it goes ([`Roots::learn`]): the common case of root and peers in one batch
//!   of one replica needs nothing else.
//!
//! The engine picks a root by its own clock and the rule's `sympathetic` block; the events it
//! absorbs ([`Absorbed`]) are recorded in `sympathetic_evidence`, naming the peer's node and GPU
//! and the root's. Only observations that could echo a root (a rule's sympathetic code, on a GPU
//! with a domain) cost a query, so a healthy fleet costs nothing.

use std::borrow::Cow;
use std::collections::BTreeMap;

use chrono::{DateTime, Utc};
use sqlx::PgPool;
use uuid::Uuid;

use crate::events::{InternalEvent as _, SympatheticEvent};
use crate::rules::engine::{Absorbed, Decision, DecisionKind};
use crate::rules::model::{CodeRange, codes_contain};
use crate::rules::{DomainRoot, Observation, RuleSet};

/// The most roots remembered per domain; a domain has at most a few dozen GPUs.
const MAX_ROOTS_PER_DOMAIN: usize = 512;

/// The root incidents of NVLink domains known to one batch: loaded from the incident store and
/// learned from the batch's own decisions.
#[derive(Debug, Clone, Default)]
pub struct Roots {
    /// Every code some rule treats as sympathetic.
    codes: Vec<CodeRange>,
    /// The longest `sympathetic.within` of the rules, in microseconds.
    horizon: i64,
    /// By domain, ordered by opening time, then incident id.
    by_domain: BTreeMap<String, Vec<DomainRoot>>,
}

impl Roots {
    /// An empty index for `rules`.
    pub fn new(rules: &RuleSet) -> Roots {
        let sympathetic = rules.rules.iter().filter_map(|r| r.sympathetic.as_ref());
        let mut roots = Roots::default();
        for s in sympathetic {
            roots.codes.extend(s.xid.iter().cloned());
            roots.horizon = roots.horizon.max(s.within.micros());
        }
        roots
    }

    /// Whether `o` could echo a root on another node: one of the rules' sympathetic codes, on a
    /// GPU whose NVLink domain is known.
    pub fn wants(&self, o: &Observation) -> bool {
        o.gpu.is_some() && o.nvlink_domain.is_some() && o.xid.is_some_and(|x| codes_contain(&self.codes, x))
    }

    /// Remembers `root` (once per incident).
    pub fn remember(&mut self, root: DomainRoot) {
        let list = self.by_domain.entry(root.domain.clone()).or_default();
        if list.iter().any(|r| r.incident_id == root.incident_id) {
            return;
        }
        let at =
            list.partition_point(|r| (r.opened_at_micros, r.incident_id) < (root.opened_at_micros, root.incident_id));
        list.insert(at, root);
        // The newest matter: a root older than the window is no root for a new event.
        if list.len() > MAX_ROOTS_PER_DOMAIN {
            list.remove(0);
        }
    }

    /// Remembers the roots among `decisions`: the opening decisions that carry a domain.
    pub fn learn<'a>(&mut self, decisions: impl IntoIterator<Item = &'a Decision>) {
        for d in decisions {
            if let (DecisionKind::Open, Some(domain)) = (d.kind, &d.nvlink_domain) {
                self.remember(DomainRoot {
                    domain: domain.clone(),
                    incident_id: d.incident_id,
                    rule_id: d.rule_id.clone(),
                    node: d.node.clone(),
                    gpu: d.gpu.clone(),
                    opened_at_micros: d.decided_at_micros,
                });
            }
        }
    }

    /// `o` with the roots it could echo handed in: those of its domain, on other nodes, opened no
    /// earlier than the longest window before its time (the engine's clock for the node is at or
    /// after it, and the engine applies each rule's own window).
    pub fn attach<'o>(&self, o: &'o Observation) -> Cow<'o, Observation> {
        if !self.wants(o) {
            return Cow::Borrowed(o);
        }
        let Some(list) = o.nvlink_domain.as_ref().and_then(|d| self.by_domain.get(d)) else {
            return Cow::Borrowed(o);
        };
        let since = o.observed_at_micros.saturating_sub(self.horizon);
        let mut o = o.clone();
        o.domain_roots.extend(list.iter().filter(|r| r.node != o.node && r.opened_at_micros >= since).cloned());
        Cow::Owned(o)
    }

    /// Loads from the incident store the roots of the domains of `observations` that could echo
    /// one, opened no earlier than the longest window before the earliest of them.
    pub async fn load<'a>(
        &mut self,
        pool: &PgPool,
        observations: impl IntoIterator<Item = &'a Observation>,
    ) -> Result<(), sqlx::Error> {
        let mut domains = std::collections::BTreeSet::new();
        let mut earliest = i64::MAX;
        for o in observations.into_iter().filter(|o| self.wants(o)) {
            domains.extend(o.nvlink_domain.clone());
            earliest = earliest.min(o.observed_at_micros);
        }
        if domains.is_empty() {
            return Ok(());
        }
        let since = DateTime::<Utc>::from_timestamp_micros(earliest.saturating_sub(self.horizon)).unwrap_or_default();
        let domains: Vec<String> = domains.into_iter().collect();
        let rows: Vec<RootRow> = sqlx::query_as(
            "SELECT incident_id, rule_id, node, gpu_uuid, nvlink_domain, opened_at
               FROM incidents
              WHERE nvlink_domain = ANY($1) AND opened_at >= $2
              ORDER BY opened_at, incident_id
              LIMIT 10000",
        )
        .bind(&domains)
        .bind(since)
        .fetch_all(pool)
        .await?;
        for (incident_id, rule_id, node, gpu, domain, opened_at) in rows {
            let opened_at_micros = opened_at.timestamp_micros();
            self.remember(DomainRoot { domain, incident_id, rule_id, node, gpu, opened_at_micros });
        }
        Ok(())
    }
}

/// A root as the incident store has it: incident id, rule, node, GPU, domain, opening time.
type RootRow = (Uuid, String, String, Option<String>, String, DateTime<Utc>);

/// Counts and logs the events the engine absorbed into root incidents, by where the root was:
/// on the same node, or on another node of the GPU's NVLink domain.
pub fn absorbed(events: &[Absorbed]) {
    for a in events {
        let scope = if a.root_node == a.node { "node" } else { "nvlink_domain" };
        SympatheticEvent {
            root: scope,
            node: &a.node,
            gpu: &a.gpu,
            event_id: &a.event_id,
            incident_id: &a.incident_id,
            root_node: &a.root_node,
            root_gpu: &a.root_gpu,
        }
        .emit();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rules::defaults;

    const S: i64 = 1_000_000;

    fn root(id: u128, node: &str, domain: &str, at: i64) -> DomainRoot {
        DomainRoot {
            domain: domain.into(),
            incident_id: Uuid::from_u128(id),
            rule_id: "xid-nvlink5".into(),
            node: node.into(),
            gpu: Some(format!("GPU-{id}")),
            opened_at_micros: at,
        }
    }

    #[test]
    fn only_a_sympathetic_code_on_a_gpu_with_a_domain_is_handed_roots() {
        let rules = defaults::rule_set().expect("the default rules load");
        let mut roots = Roots::new(&rules);
        roots.remember(root(1, "a", "D", 100 * S));
        let peer = Observation::new("p", "b", 110 * S, "xid").gpu("GPU-b").xid(145).nvlink_domain("D");
        assert_eq!(roots.attach(&peer).domain_roots, [root(1, "a", "D", 100 * S)]);
        for o in [
            Observation { xid: Some(79), ..peer.clone() },
            Observation { nvlink_domain: None, ..peer.clone() },
            Observation { gpu: None, ..peer.clone() },
            Observation { nvlink_domain: Some("D2".into()), ..peer.clone() },
            // The root's own node is the engine's business.
            Observation { node: "a".into(), ..peer.clone() },
            // Opened longer than any window before the event.
            Observation { observed_at_micros: 200 * S, ..peer.clone() },
        ] {
            assert!(roots.attach(&o).domain_roots.is_empty(), "{o:?}");
        }
    }

    #[test]
    fn roots_are_kept_once_in_opening_order_and_learned_from_opening_decisions() {
        let rules = defaults::rule_set().expect("the default rules load");
        let mut roots = Roots::new(&rules);
        roots.remember(root(2, "c", "D", 105 * S));
        roots.remember(root(1, "a", "D", 100 * S));
        roots.remember(root(1, "a", "D", 100 * S));
        let mut engine = crate::rules::Engine::new(rules);
        let opened =
            engine.observe(&Observation::new("r", "e", 101 * S, "xid").gpu("GPU-e").xid(149).nvlink_domain("D"));
        roots.learn(&opened);
        let ids: Vec<u128> = roots.by_domain["D"].iter().map(|r| r.incident_id.as_u128()).collect();
        assert_eq!(&ids[..1], [1]);
        assert_eq!(ids.len(), 3);
        assert_eq!(roots.by_domain["D"][1].node, "e");
    }
}
