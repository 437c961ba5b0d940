//! Leader election over a `coordination.k8s.io/v1` Lease, so exactly one remediator replica
//! consumes verdicts and changes nodes while the others stand by.
//!
//! [`Elector`] is the pure decision: given the Lease as read and the local monotonic clock, take
//! it, renew it, create it, or wait. Expiry is judged the way client-go judges it: a standby
//! remembers when it last saw the holder's record *change* (by its own clock), and takes over
//! once the record has stood still for the lease duration; the holder's `renewTime` is never
//! compared with the local wall clock, so clock skew between replicas cannot cause two leaders.
//! [`LeaseClient`] is the thin edge: every write carries the `resourceVersion` it was planned
//! from, so two standbys racing for an expired lease cannot both win (the later write gets 409).

use std::time::{Duration, Instant};

use chrono::{SecondsFormat, Utc};
use k8s_openapi::api::coordination::v1::Lease;
use kube::api::{Api, PostParams};
use serde_json::json;

/// Where the lease lives and who this replica is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LeaseSettings {
    /// The namespace of the Lease (the remediator's own).
    pub namespace: String,
    /// The Lease's name, shared by every replica of one deployment.
    pub name: String,
    /// This replica's identity (the pod name), written as `holderIdentity`.
    pub identity: String,
    /// How long a lease that is not renewed stays valid.
    pub duration: Duration,
    /// How often the holder renews and a standby looks.
    pub renew: Duration,
}

impl LeaseSettings {
    /// How long the holder keeps acting without a successful renewal: the lease duration less one
    /// renew period, so it stops before any standby can see the lease as expired.
    pub fn renew_deadline(&self) -> Duration {
        self.duration.saturating_sub(self.renew)
    }
}

/// The parts of a Lease the election reads.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Record {
    /// `spec.holderIdentity`; `None` or empty when released.
    pub holder: Option<String>,
    /// `spec.renewTime`, as written (compared for change only, never as a time).
    pub renew_time: Option<String>,
    /// `spec.leaseDurationSeconds`.
    pub duration_seconds: Option<i32>,
    /// `spec.leaseTransitions`.
    pub transitions: i32,
}

impl Record {
    /// Reads the record out of a Lease.
    pub fn from_lease(lease: &Lease) -> Self {
        let spec = lease.spec.as_ref().map(|s| serde_json::to_value(s).unwrap_or_default()).unwrap_or_default();
        Self {
            holder: spec["holderIdentity"].as_str().filter(|h| !h.is_empty()).map(str::to_owned),
            renew_time: spec["renewTime"].as_str().map(str::to_owned),
            duration_seconds: spec["leaseDurationSeconds"].as_i64().and_then(|d| i32::try_from(d).ok()),
            transitions: spec["leaseTransitions"].as_i64().and_then(|t| i32::try_from(t).ok()).unwrap_or(0),
        }
    }
}

/// What to do with the lease now.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Step {
    /// No Lease exists: create it, held by us.
    Create,
    /// It is free (released) or expired: take it over.
    Take,
    /// We hold it: renew it.
    Renew,
    /// Someone else holds it and it has not expired.
    Wait {
        /// The holder.
        holder: String,
        /// How long until it expires if the holder stops renewing.
        expires_in: Duration,
    },
}

/// The election's memory: the last record seen and when (local monotonic clock).
#[derive(Debug, Clone, Default)]
pub struct Elector {
    observed: Option<(Record, Instant)>,
}

impl Elector {
    /// Decides what `me` does with the lease read as `current` at `now`; `fallback` is the
    /// duration used when the record names none.
    pub fn step(&mut self, current: Option<&Record>, me: &str, fallback: Duration, now: Instant) -> Step {
        let Some(current) = current else {
            self.observed = None;
            return Step::Create;
        };
        let seen_at = match &self.observed {
            Some((record, at)) if record == current => *at,
            _ => {
                self.observed = Some((current.clone(), now));
                now
            }
        };
        let Some(holder) = current.holder.as_deref() else { return Step::Take };
        if holder == me {
            return Step::Renew;
        }
        let duration = current
            .duration_seconds
            .and_then(|s| u64::try_from(s).ok())
            .map(Duration::from_secs)
            .filter(|d| !d.is_zero())
            .unwrap_or(fallback);
        let stood = now.saturating_duration_since(seen_at);
        if stood >= duration {
            Step::Take
        } else {
            Step::Wait { holder: holder.to_owned(), expires_in: duration - stood }
        }
    }
}

/// Whether a holder whose last successful renewal was at `renewed` must stop acting at `now`.
pub fn lost(renewed: Instant, deadline: Duration, now: Instant) -> bool {
    now.saturating_duration_since(renewed) >= deadline
}

/// Whether this replica may still act as the leader, as far as it can prove: the lease counts
/// from the *start* of the last renewal that succeeded (the apiserver applied it no earlier), and
/// stops counting [`LeaseSettings::renew_deadline`] later, before any standby can see the lease as
/// expired. Every write the leader makes checks it first, so a leader whose renewals hang or are
/// refused stops writing on its own clock, whatever the apiserver or the network does.
#[derive(Debug)]
pub struct Validity {
    /// `None` for a process that acts without an election (tests, the library on its own).
    deadline: Option<Duration>,
    renewed: std::sync::Mutex<Option<Instant>>,
}

impl Validity {
    /// Validity that follows a lease whose holder must stop `deadline` after a renewal started.
    pub fn for_lease(deadline: Duration) -> Self {
        Self { deadline: Some(deadline), renewed: std::sync::Mutex::new(None) }
    }

    /// Validity for a process without leader election: always current.
    pub fn unconditional() -> Self {
        Self { deadline: None, renewed: std::sync::Mutex::new(None) }
    }

    /// A renewal (or the acquisition) that started at `at` succeeded.
    pub fn renewed(&self, at: Instant) {
        let mut renewed = self.renewed.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        // A slow answer to an earlier attempt never moves the start back.
        if renewed.is_none_or(|r| r < at) {
            *renewed = Some(at);
        }
    }

    /// The term ended: nothing may be written until the lease is held again.
    pub fn end(&self) {
        *self.renewed.lock().unwrap_or_else(std::sync::PoisonError::into_inner) = None;
    }

    /// How long the lease is still provably held at `now` (zero when it is not).
    pub fn left_at(&self, now: Instant) -> Duration {
        let Some(deadline) = self.deadline else { return Duration::MAX };
        match *self.renewed.lock().unwrap_or_else(std::sync::PoisonError::into_inner) {
            Some(renewed) => deadline.saturating_sub(now.saturating_duration_since(renewed)),
            None => Duration::ZERO,
        }
    }

    /// Whether the lease is provably held at `now`.
    pub fn current_at(&self, now: Instant) -> bool {
        !self.left_at(now).is_zero()
    }

    /// Whether the lease is provably held now.
    pub fn current(&self) -> bool {
        self.current_at(Instant::now())
    }
}

/// What went wrong talking to the apiserver about the lease.
#[derive(Debug, thiserror::Error)]
pub enum LeaseError {
    /// The Lease could not be read or written.
    #[error("cannot {what} lease {namespace}/{name}: {source}")]
    Api {
        /// The operation.
        what: &'static str,
        /// The namespace.
        namespace: String,
        /// The lease.
        name: String,
        /// The API error.
        #[source]
        source: kube::Error,
    },
}

/// The Kubernetes edge of the election.
pub struct LeaseClient {
    api: Api<Lease>,
    settings: LeaseSettings,
    elector: Elector,
}

impl LeaseClient {
    /// A client for the lease in `settings`.
    pub fn new(client: kube::Client, settings: LeaseSettings) -> Self {
        Self { api: Api::namespaced(client, &settings.namespace), settings, elector: Elector::default() }
    }

    /// The settings.
    pub fn settings(&self) -> &LeaseSettings {
        &self.settings
    }

    fn error(&self, what: &'static str, source: kube::Error) -> LeaseError {
        LeaseError::Api { what, namespace: self.settings.namespace.clone(), name: self.settings.name.clone(), source }
    }

    /// One round: creates, takes over or renews the lease when the election says so. `Ok(true)`
    /// when this replica holds the lease afterwards; a lost race (409) is `Ok(false)`.
    pub async fn try_lead(&mut self) -> Result<bool, LeaseError> {
        let lease = self.api.get_opt(&self.settings.name).await.map_err(|e| self.error("read", e))?;
        let record = lease.as_ref().map(Record::from_lease);
        let me = self.settings.identity.clone();
        let now = stamp();
        let step = self.elector.step(record.as_ref(), &me, self.settings.duration, Instant::now());
        let spec = match (&step, &record) {
            (Step::Wait { .. }, _) => return Ok(false),
            (Step::Create, _) => json!({
                "holderIdentity": me, "leaseDurationSeconds": self.duration_seconds(),
                "acquireTime": now, "renewTime": now, "leaseTransitions": 0,
            }),
            (Step::Take, Some(r)) => {
                tracing::info!(identity = %me, previous = ?r.holder, "Taking over the remediator lease.");
                json!({
                    "holderIdentity": me, "leaseDurationSeconds": self.duration_seconds(),
                    "acquireTime": now, "renewTime": now, "leaseTransitions": r.transitions + 1,
                })
            }
            (Step::Renew, _) | (Step::Take, None) => json!({ "renewTime": now }),
        };
        let result = match (step, lease) {
            (Step::Create, _) | (_, None) => {
                let lease: Lease = serde_json::from_value(json!({
                    "metadata": { "name": self.settings.name, "namespace": self.settings.namespace },
                    "spec": spec,
                }))
                .expect("the lease is well formed");
                self.api.create(&PostParams::default(), &lease).await
            }
            (_, Some(mut lease)) => {
                let mut merged = serde_json::to_value(lease.spec.take().unwrap_or_default()).unwrap_or_default();
                if let (Some(m), Some(s)) = (merged.as_object_mut(), spec.as_object()) {
                    m.extend(s.clone());
                }
                lease.spec = Some(serde_json::from_value(merged).expect("the lease spec is well formed"));
                // The resourceVersion read above travels in the object: a concurrent writer makes this 409.
                self.api.replace(&self.settings.name, &PostParams::default(), &lease).await
            }
        };
        match result {
            Ok(_) => Ok(true),
            Err(kube::Error::Api(s)) if s.is_conflict() || s.is_already_exists() => Ok(false),
            Err(e) => Err(self.error("write", e)),
        }
    }

    /// Gives the lease up (graceful shutdown) so a standby takes over at its next look instead of
    /// after the lease duration. Does nothing when another replica holds it.
    pub async fn release(&mut self) -> Result<(), LeaseError> {
        let Some(mut lease) = self.api.get_opt(&self.settings.name).await.map_err(|e| self.error("read", e))? else {
            return Ok(());
        };
        if Record::from_lease(&lease).holder.as_deref() != Some(self.settings.identity.as_str()) {
            return Ok(());
        }
        let mut spec = serde_json::to_value(lease.spec.take().unwrap_or_default()).unwrap_or_default();
        if let Some(m) = spec.as_object_mut() {
            m.remove("holderIdentity");
            m.remove("acquireTime");
            m.remove("renewTime");
        }
        lease.spec = Some(serde_json::from_value(spec).expect("the lease spec is well formed"));
        match self.api.replace(&self.settings.name, &PostParams::default(), &lease).await {
            Ok(_) => Ok(()),
            Err(kube::Error::Api(s)) if s.is_conflict() => Ok(()),
            Err(e) => Err(self.error("release", e)),
        }
    }

    fn duration_seconds(&self) -> u64 {
        self.settings.duration.as_secs().max(1)
    }
}

/// The current time as a Kubernetes MicroTime.
fn stamp() -> String {
    Utc::now().to_rfc3339_opts(SecondsFormat::Micros, true)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn held_by(holder: &str, renewed: &str) -> Record {
        Record {
            holder: Some(holder.into()),
            renew_time: Some(renewed.into()),
            duration_seconds: Some(15),
            transitions: 0,
        }
    }

    const D: Duration = Duration::from_secs(15);

    #[test]
    fn a_missing_lease_is_created_and_a_released_one_taken() {
        let t0 = Instant::now();
        let mut e = Elector::default();
        assert_eq!(e.step(None, "a", D, t0), Step::Create);
        assert_eq!(e.step(Some(&Record::default()), "a", D, t0), Step::Take);
    }

    #[test]
    fn the_holder_renews() {
        let mut e = Elector::default();
        assert_eq!(e.step(Some(&held_by("a", "t1")), "a", D, Instant::now()), Step::Renew);
    }

    #[test]
    fn a_standby_waits_while_the_record_moves_and_takes_over_once_it_stands_still() {
        let t0 = Instant::now();
        let mut e = Elector::default();
        // First sight: the full duration from now, whatever renewTime says (no clock comparison).
        assert_eq!(e.step(Some(&held_by("a", "t1")), "b", D, t0), Step::Wait { holder: "a".into(), expires_in: D });
        let at = |s| t0 + Duration::from_secs(s);
        assert!(
            matches!(e.step(Some(&held_by("a", "t1")), "b", D, at(10)), Step::Wait { expires_in, .. } if expires_in == Duration::from_secs(5))
        );
        // The holder renewed: the clock starts again.
        assert!(
            matches!(e.step(Some(&held_by("a", "t2")), "b", D, at(14)), Step::Wait { expires_in, .. } if expires_in == D)
        );
        assert!(matches!(e.step(Some(&held_by("a", "t2")), "b", D, at(28)), Step::Wait { .. }));
        assert_eq!(e.step(Some(&held_by("a", "t2")), "b", D, at(29)), Step::Take);
    }

    #[test]
    fn the_records_own_duration_wins_over_the_local_one() {
        let t0 = Instant::now();
        let mut e = Elector::default();
        let r = Record { duration_seconds: Some(2), ..held_by("a", "t1") };
        assert!(matches!(e.step(Some(&r), "b", D, t0), Step::Wait { .. }));
        assert_eq!(e.step(Some(&r), "b", D, t0 + Duration::from_secs(2)), Step::Take);
    }

    #[test]
    fn the_holder_stops_before_a_standby_can_take_over() {
        let s = LeaseSettings {
            namespace: "ns".into(),
            name: "l".into(),
            identity: "a".into(),
            duration: D,
            renew: Duration::from_secs(5),
        };
        let t0 = Instant::now();
        assert_eq!(s.renew_deadline(), Duration::from_secs(10));
        assert!(!lost(t0, s.renew_deadline(), t0 + Duration::from_secs(9)));
        assert!(lost(t0, s.renew_deadline(), t0 + Duration::from_secs(10)));
    }

    #[test]
    fn validity_counts_from_the_start_of_the_last_renewal_and_ends_at_the_deadline() {
        let t0 = Instant::now();
        let v = Validity::for_lease(Duration::from_secs(10));
        assert!(!v.current_at(t0), "nothing is valid before the lease is held");
        v.renewed(t0);
        assert!(v.current_at(t0 + Duration::from_secs(9)));
        assert_eq!(v.left_at(t0 + Duration::from_secs(4)), Duration::from_secs(6));
        assert!(!v.current_at(t0 + Duration::from_secs(10)), "stops at the deadline");
        // A late answer to an older attempt does not move the start back.
        v.renewed(t0 + Duration::from_secs(5));
        v.renewed(t0 + Duration::from_secs(2));
        assert!(v.current_at(t0 + Duration::from_secs(14)));
        assert!(!v.current_at(t0 + Duration::from_secs(15)));
        v.end();
        assert!(!v.current_at(t0 + Duration::from_secs(6)), "an ended term writes nothing");
    }

    #[test]
    fn without_an_election_validity_is_unconditional() {
        let v = Validity::unconditional();
        assert!(v.current());
        v.end();
        assert!(v.current());
    }
}
