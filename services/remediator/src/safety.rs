//! Safety limits on new quarantines: a circuit breaker on the share and count of GPU nodes
//! gpumedic quarantined within a window, and a rate limit per minute. Both are pure state
//! machines with the clock passed in, so they are tested without waiting; the caller owns the
//! state and asks through [`Gate::admit`], which the planner calls only for new quarantines
//! (recoveries never pass through here, so they proceed while the breaker is open).
//!
//! A mass failure is more likely a bad driver roll-out, a rule bug or a monitoring fault than
//! hundreds of GPUs dying at once, so once tripped the breaker stays open until an operator
//! resets it explicitly; it never closes by itself when the window slides.

use std::collections::{BTreeMap, VecDeque};
use std::time::{Duration, Instant};

use crate::plan::Admission;

/// What makes the breaker trip.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct BreakerLimits {
    /// The largest share (0..=1) of GPU nodes gpumedic may quarantine within the window.
    pub max_share: f64,
    /// The largest number of GPU nodes gpumedic may quarantine within the window.
    pub max_count: usize,
    /// The window quarantines are counted in.
    pub window: Duration,
}

/// Why the breaker is open.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Trip {
    /// When it tripped.
    pub at: Instant,
    /// A sentence for the Event, the log and the actions topic.
    pub reason: String,
}

/// The circuit breaker on new quarantines.
#[derive(Debug, Clone)]
pub struct CircuitBreaker {
    limits: BreakerLimits,
    /// Node name -> when gpumedic last quarantined it, within the window.
    quarantined: BTreeMap<String, Instant>,
    /// The largest number of single GPUs gpumedic may quarantine within the window.
    max_gpus: usize,
    /// GPU (its DeviceTaintRule's name) -> when gpumedic quarantined it, within the window.
    gpus: BTreeMap<String, Instant>,
    trip: Option<Trip>,
}

impl CircuitBreaker {
    /// A closed breaker.
    pub fn new(limits: BreakerLimits) -> Self {
        Self { limits, quarantined: BTreeMap::new(), max_gpus: usize::MAX, gpus: BTreeMap::new(), trip: None }
    }

    /// This breaker, also counting single GPUs quarantined (DRA device taints): at most `max_gpus`
    /// within the same window; one more trips it, for nodes and GPUs alike.
    pub fn with_max_gpus(mut self, max_gpus: usize) -> Self {
        self.max_gpus = max_gpus;
        self
    }

    /// Asks to quarantine the single GPU `gpu` (named by its DeviceTaintRule) now: refused while
    /// the breaker is open, and a GPU over the limit trips it. Counted at once, free when asked
    /// again, given back by [`CircuitBreaker::cancel_gpu`], as for nodes.
    pub fn admit_gpu(&mut self, gpu: &str, now: Instant) -> Admission {
        if let Some(trip) = &self.trip {
            return Admission::BreakerOpen(trip.reason.clone());
        }
        self.expire(now);
        if self.gpus.contains_key(gpu) {
            return Admission::Allowed;
        }
        let after = self.gpus.len() + 1;
        if after > self.max_gpus {
            let reason = format!(
                "quarantining GPU {gpu} would make {after} GPUs within {:?}, over the limit of {}",
                self.limits.window, self.max_gpus
            );
            self.trip = Some(Trip { at: now, reason: reason.clone() });
            return Admission::BreakerOpen(reason);
        }
        self.gpus.insert(gpu.to_owned(), now);
        Admission::Allowed
    }

    /// Gives back the reservation [`CircuitBreaker::admit_gpu`] made for `gpu`.
    pub fn cancel_gpu(&mut self, gpu: &str) {
        self.gpus.remove(gpu);
    }

    /// How many single GPUs count within the window at `now`.
    pub fn counted_gpus(&mut self, now: Instant) -> usize {
        self.expire(now);
        self.gpus.len()
    }

    /// Counts the GPUs a previous leader quarantined (their rules' creation, still within the
    /// window), so a failover hands out no fresh GPU budget.
    pub fn restore_gpus(&mut self, gpus: impl IntoIterator<Item = (String, Instant)>, now: Instant) {
        self.gpus = gpus.into_iter().collect();
        self.expire(now);
    }

    /// Asks to quarantine `node` now, with `gpu_nodes` GPU nodes in the fleet. Allowed quarantines
    /// are counted at once (a reservation), so concurrent requests cannot slip past the limit
    /// together; [`CircuitBreaker::cancel`] gives the reservation back when the change fails.
    /// Asking again for a node already counted is free. A request that would exceed a limit is
    /// refused and trips the breaker.
    pub fn admit(&mut self, node: &str, gpu_nodes: usize, now: Instant) -> Admission {
        if let Some(trip) = &self.trip {
            return Admission::BreakerOpen(trip.reason.clone());
        }
        self.expire(now);
        if self.quarantined.contains_key(node) {
            return Admission::Allowed;
        }
        let after = self.quarantined.len() + 1;
        let share = if gpu_nodes == 0 { 1.0 } else { after as f64 / gpu_nodes as f64 };
        let reason = if after > self.limits.max_count {
            Some(format!(
                "quarantining {node} would make {after} GPU nodes within {:?}, over the limit of {}",
                self.limits.window, self.limits.max_count
            ))
        } else if share > self.limits.max_share {
            Some(format!(
                "quarantining {node} would make {after} of {gpu_nodes} GPU nodes ({:.1}%) within {:?}, over the \
                 limit of {:.1}%",
                share * 100.0,
                self.limits.window,
                self.limits.max_share * 100.0
            ))
        } else {
            None
        };
        match reason {
            Some(reason) => {
                self.trip = Some(Trip { at: now, reason: reason.clone() });
                Admission::BreakerOpen(reason)
            }
            None => {
                self.quarantined.insert(node.to_owned(), now);
                Admission::Allowed
            }
        }
    }

    /// Gives back the reservation [`CircuitBreaker::admit`] made for `node`, when the quarantine
    /// was not applied after all.
    pub fn cancel(&mut self, node: &str) {
        self.quarantined.remove(node);
    }

    /// Why the breaker is open, if it is.
    pub fn trip(&self) -> Option<&Trip> {
        self.trip.as_ref()
    }

    /// Closes the breaker (the operator's `gpumedic breaker reset`) and forgets the quarantines
    /// counted so far, so the fleet gets a fresh budget.
    pub fn reset(&mut self) {
        self.trip = None;
        self.quarantined.clear();
        self.gpus.clear();
    }

    /// Replaces the breaker's state with what a previous leader left: the trip persisted in the
    /// status object (`Some(reason)` when open) and the quarantines still within the window (found
    /// on the nodes), so a failover or restart neither closes an open breaker nor hands out a
    /// fresh budget.
    pub fn restore(
        &mut self,
        trip: Option<String>,
        quarantined: impl IntoIterator<Item = (String, Instant)>,
        now: Instant,
    ) {
        self.trip = trip.map(|reason| Trip { at: now, reason });
        self.quarantined = quarantined.into_iter().collect();
        self.expire(now);
    }

    /// Opens the breaker by hand (an operator wrote `breaker: open` in the status object); a
    /// breaker already open keeps its reason.
    pub fn open(&mut self, reason: String, now: Instant) {
        self.trip.get_or_insert(Trip { at: now, reason });
    }

    /// The window the quarantines are counted in.
    pub fn window(&self) -> Duration {
        self.limits.window
    }

    /// The quarantines counted within the window at `now`: node and when.
    pub fn ledger(&mut self, now: Instant) -> Vec<(String, Instant)> {
        self.expire(now);
        self.quarantined.iter().map(|(n, at)| (n.clone(), *at)).collect()
    }

    /// How many quarantines count within the window at `now`.
    pub fn counted(&mut self, now: Instant) -> usize {
        self.expire(now);
        self.quarantined.len()
    }

    fn expire(&mut self, now: Instant) {
        let window = self.limits.window;
        self.quarantined.retain(|_, at| now.saturating_duration_since(*at) < window);
        self.gpus.retain(|_, at| now.saturating_duration_since(*at) < window);
    }
}

/// A sliding-window limit on new quarantines per minute.
#[derive(Debug, Clone)]
pub struct RateLimit {
    per_minute: usize,
    recent: VecDeque<(Instant, String)>,
}

impl RateLimit {
    const WINDOW: Duration = Duration::from_secs(60);

    /// At most `per_minute` new quarantines in any 60 seconds.
    pub fn new(per_minute: usize) -> Self {
        Self { per_minute, recent: VecDeque::new() }
    }

    /// Asks for one new quarantine of `node` at `now`; counts it when allowed. A node already
    /// counted within the minute is free, so a retried request does not spend twice.
    pub fn admit(&mut self, node: &str, now: Instant) -> Admission {
        while self.recent.front().is_some_and(|(at, _)| now.saturating_duration_since(*at) >= Self::WINDOW) {
            self.recent.pop_front();
        }
        if self.recent.iter().any(|(_, n)| n == node) {
            return Admission::Allowed;
        }
        if self.recent.len() >= self.per_minute {
            let free_in = self.recent.front().map(|(at, _)| Self::WINDOW - now.saturating_duration_since(*at));
            return Admission::RateLimited(format!(
                "{} new quarantines in the last minute (limit {}); the next is allowed in {:.1} s",
                self.recent.len(),
                self.per_minute,
                free_in.unwrap_or_default().as_secs_f64()
            ));
        }
        self.recent.push_back((now, node.to_owned()));
        Admission::Allowed
    }

    /// Gives back the slot taken for `node`.
    pub fn cancel(&mut self, node: &str) {
        if let Some(i) = self.recent.iter().rposition(|(_, n)| n == node) {
            self.recent.remove(i);
        }
    }
}

/// The breaker and the rate limit together: what the planner's `admit` closure asks.
#[derive(Debug, Clone)]
pub struct Gate {
    /// The circuit breaker.
    pub breaker: CircuitBreaker,
    /// The rate limit.
    pub rate: RateLimit,
}

impl Gate {
    /// A closed breaker and an unspent rate limit.
    pub fn new(limits: BreakerLimits, per_minute: usize) -> Self {
        Self { breaker: CircuitBreaker::new(limits), rate: RateLimit::new(per_minute) }
    }

    /// This gate, its breaker also counting single GPUs (see [`CircuitBreaker::with_max_gpus`]).
    pub fn with_max_gpus(mut self, max_gpus: usize) -> Self {
        self.breaker = self.breaker.with_max_gpus(max_gpus);
        self
    }

    /// The breaker first (a trip must be seen even when the rate limit would also refuse), then
    /// the rate limit; a rate-limit refusal gives the breaker's reservation back.
    pub fn admit(&mut self, node: &str, gpu_nodes: usize, now: Instant) -> Admission {
        match self.breaker.admit(node, gpu_nodes, now) {
            Admission::Allowed => {}
            refused => return refused,
        }
        match self.rate.admit(node, now) {
            Admission::Allowed => Admission::Allowed,
            refused => {
                self.breaker.cancel(node);
                refused
            }
        }
    }

    /// Asks to quarantine the single GPU `gpu` (see [`CircuitBreaker::admit_gpu`]). The
    /// per-minute rate limit counts nodes only: GPU quarantines leave the node in service.
    pub fn admit_gpu(&mut self, gpu: &str, now: Instant) -> Admission {
        self.breaker.admit_gpu(gpu, now)
    }

    /// Gives back both reservations for `node`.
    pub fn cancel(&mut self, node: &str) {
        self.breaker.cancel(node);
        self.rate.cancel(node);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn limits(max_share: f64, max_count: usize) -> BreakerLimits {
        BreakerLimits { max_share, max_count, window: Duration::from_secs(600) }
    }

    #[test]
    fn trips_at_the_configured_share_and_stays_open_until_reset() {
        let t0 = Instant::now();
        let mut b = CircuitBreaker::new(limits(0.3, 100));
        for i in 0..3 {
            assert_eq!(b.admit(&format!("n{i}"), 10, t0), Admission::Allowed);
        }
        let refused = b.admit("n3", 10, t0);
        assert!(matches!(&refused, Admission::BreakerOpen(why) if why.contains("4 of 10")), "{refused:?}");
        assert!(b.trip().is_some());
        // Still open long after the window has emptied: only a reset closes it.
        let later = t0 + Duration::from_secs(3600);
        assert_eq!(b.counted(later), 0);
        assert!(matches!(b.admit("n4", 10, later), Admission::BreakerOpen(_)));
        b.reset();
        assert_eq!(b.admit("n4", 10, later), Admission::Allowed);
    }

    #[test]
    fn trips_at_the_configured_count() {
        let t0 = Instant::now();
        let mut b = CircuitBreaker::new(limits(1.0, 2));
        assert_eq!(b.admit("a", 1000, t0), Admission::Allowed);
        assert_eq!(b.admit("b", 1000, t0), Admission::Allowed);
        assert!(matches!(b.admit("c", 1000, t0), Admission::BreakerOpen(why) if why.contains("limit of 2")));
    }

    #[test]
    fn the_window_slides_and_repeats_are_free() {
        let t0 = Instant::now();
        let mut b = CircuitBreaker::new(limits(1.0, 2));
        assert_eq!(b.admit("a", 10, t0), Admission::Allowed);
        assert_eq!(b.admit("a", 10, t0), Admission::Allowed);
        assert_eq!(b.admit("b", 10, t0 + Duration::from_secs(1)), Admission::Allowed);
        // "a" left the window, so "c" fits without a trip.
        assert_eq!(b.admit("c", 10, t0 + Duration::from_secs(600)), Admission::Allowed);
        assert_eq!(b.counted(t0 + Duration::from_secs(600)), 2);
        assert!(b.trip().is_none());
    }

    #[test]
    fn a_cancelled_reservation_frees_its_place() {
        let t0 = Instant::now();
        let mut b = CircuitBreaker::new(limits(1.0, 1));
        assert_eq!(b.admit("a", 10, t0), Admission::Allowed);
        b.cancel("a");
        assert_eq!(b.admit("b", 10, t0), Admission::Allowed);
    }

    #[test]
    fn a_restored_breaker_stays_open_and_counts_what_it_was_given() {
        let t0 = Instant::now();
        let mut b = CircuitBreaker::new(limits(1.0, 2));
        b.restore(Some("tripped before the failover".into()), [], t0);
        assert!(matches!(b.admit("a", 10, t0), Admission::BreakerOpen(why) if why.contains("failover")));
        let now = t0 + Duration::from_secs(601);
        b.restore(None, [("a".to_owned(), now), ("old".to_owned(), t0)], now);
        assert_eq!(b.counted(now), 1, "quarantines older than the window are dropped");
        assert_eq!(b.admit("b", 10, now), Admission::Allowed);
        assert!(matches!(b.admit("c", 10, now), Admission::BreakerOpen(_)));
    }

    #[test]
    fn gpus_count_against_their_own_limit_and_a_trip_stops_nodes_too() {
        let t0 = Instant::now();
        let mut b = CircuitBreaker::new(limits(1.0, 100)).with_max_gpus(2);
        assert_eq!(b.admit_gpu("g1", t0), Admission::Allowed);
        assert_eq!(b.admit_gpu("g1", t0), Admission::Allowed, "asking again is free");
        assert_eq!(b.admit_gpu("g2", t0), Admission::Allowed);
        assert_eq!(b.counted(t0), 0, "GPUs are not nodes");
        let refused = b.admit_gpu("g3", t0);
        assert!(matches!(&refused, Admission::BreakerOpen(why) if why.contains("3 GPUs")), "{refused:?}");
        assert!(matches!(b.admit("n1", 10, t0), Admission::BreakerOpen(_)), "one breaker for both");
        b.reset();
        assert_eq!(b.counted_gpus(t0), 0);
        assert_eq!(b.admit_gpu("g3", t0), Admission::Allowed);
        b.cancel_gpu("g3");
        assert_eq!(b.counted_gpus(t0), 0);
        b.restore_gpus(
            [("old".to_owned(), t0), ("new".to_owned(), t0 + Duration::from_secs(600))],
            t0 + Duration::from_secs(600),
        );
        assert_eq!(b.counted_gpus(t0 + Duration::from_secs(600)), 1, "rules older than the window are not counted");
    }

    #[test]
    fn an_empty_fleet_admits_nothing() {
        let mut b = CircuitBreaker::new(limits(0.5, 10));
        assert!(matches!(b.admit("a", 0, Instant::now()), Admission::BreakerOpen(_)));
    }

    #[test]
    fn rate_limit_allows_n_per_sliding_minute() {
        let t0 = Instant::now();
        let mut r = RateLimit::new(2);
        assert_eq!(r.admit("a", t0), Admission::Allowed);
        assert_eq!(r.admit("b", t0 + Duration::from_secs(30)), Admission::Allowed);
        assert_eq!(r.admit("a", t0 + Duration::from_secs(31)), Admission::Allowed, "a retry is free");
        let refused = r.admit("c", t0 + Duration::from_secs(40));
        assert!(matches!(&refused, Admission::RateLimited(why) if why.contains("20.0 s")), "{refused:?}");
        assert_eq!(r.admit("c", t0 + Duration::from_secs(60)), Admission::Allowed);
        r.cancel("c");
        assert_eq!(r.admit("d", t0 + Duration::from_secs(61)), Admission::Allowed);
    }

    #[test]
    fn gate_checks_the_breaker_first_and_returns_the_reservation_when_rate_limited() {
        let t0 = Instant::now();
        let mut g = Gate::new(limits(1.0, 2), 1);
        assert_eq!(g.admit("a", 10, t0), Admission::Allowed);
        assert!(matches!(g.admit("b", 10, t0), Admission::RateLimited(_)));
        assert_eq!(g.breaker.counted(t0), 1, "the refused node holds no breaker place");
        assert!(g.breaker.trip().is_none(), "a rate-limited request does not trip the breaker");
    }
}
