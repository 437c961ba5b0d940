//! The state machine behind each condition type, for one rule on one node or GPU.
//!
//! Each state takes matching observations in order and says whether the observation was fault
//! evidence (which cancels a pending recovery) and whether the condition now holds. Time only
//! moves with observations and ticks, so the same input always gives the same output. Every
//! state is bounded: windows are pruned and lists capped.

use std::collections::{BTreeSet, VecDeque};

use serde::{Deserialize, Serialize};

use super::id::Id;
use super::model::{BurstTest, Condition, Distinct, Judge, codes_contain};
use super::observation::{FieldValue, Observation};

/// The most event ids a burst or decision carries; enough to trace an incident, bounded so a
/// storm of events cannot grow state without limit.
pub const MAX_EVIDENCE: usize = 32;

/// The most counter samples a rate keeps. Samples closer together than a `1 / (MAX_SAMPLES / 2)`
/// share of the window are thinned (the newer replaces the older), so a whole window fits
/// whatever the sampling interval: NVML polled every 5 s for a 24 h rate is 17,280 samples a GPU,
/// and keeping only the last few hundred of them measured the growth of the last 20 minutes
/// instead (the soak found it: it was also 200 MB for 8,000 GPUs).
const MAX_SAMPLES: usize = 64;

/// One piece of evidence.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Ev {
    /// When (the node's clock when it arrived).
    pub t: i64,
    /// The event id.
    pub id: Id,
    /// Whether it was injected.
    #[serde(default)]
    pub synthetic: bool,
    /// What makes it a distinct occurrence, for counts that count distinct occurrences.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub key: Option<Box<str>>,
    /// The GPU it named, so a node-wide incident knows which GPUs failed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gpu: Option<Id>,
}

impl Ev {
    fn of(o: &Observation, t: i64) -> Ev {
        Ev { t, id: Id::new(&o.event_id), synthetic: o.synthetic, key: None, gpu: o.gpu.as_deref().map(Id::new) }
    }
}

/// The occurrence an observation belongs to, for [`Distinct::Process`]: the workload the enricher
/// named, else the process the Xid line named, else the second it was logged in (the driver logs
/// one exception as several lines within the same moment).
pub fn occurrence(o: &Observation) -> String {
    if let Some(w) = o.workloads.first() {
        return format!("workload {w}");
    }
    let pid = o.fields.get("pid").map(ToString::to_string);
    let process = o.fields.get("process").map(ToString::to_string);
    if pid.is_some() || process.is_some() {
        return format!("process {} {}", process.unwrap_or_default(), pid.unwrap_or_default());
    }
    format!("at {}", o.observed_at_micros.div_euclid(1_000_000))
}

/// A condition that now holds.
#[derive(Debug, Clone, PartialEq)]
pub struct Firing {
    /// When it came to hold.
    pub at: i64,
    /// The evidence, oldest first, at most [`MAX_EVIDENCE`].
    pub evidence: Vec<Ev>,
    /// What held, for the human-readable reason.
    pub detail: String,
}

/// What one observation did to a condition.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Update {
    /// The observation was fault evidence (cancels a pending recovery).
    pub adverse: bool,
    /// The condition holds now.
    pub firing: Option<Firing>,
}

/// A burst in progress.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Burst {
    /// The first event's time.
    pub start: i64,
    /// The latest event's time.
    pub last: i64,
    /// Every Xid code seen.
    pub codes: BTreeSet<u32>,
    /// How many events.
    pub events: u32,
    /// The first event ids.
    pub evidence: Vec<Ev>,
    /// Already fired (for `judge: each`, at most once per burst).
    pub fired: bool,
}

/// A counter sample: its event's time and id and whether it was injected (an [`Ev`] less the
/// occurrence key, which only counts use, and less the GPU: 48 bytes, not 88; a node's 32 counter
/// rates keep two samples each on a healthy fleet, some 90 with the fault mix), and the counter's
/// value. A rate's samples all name one GPU: a rule's key is per GPU, or for a node-wide rule the
/// node's one counter (a node-wide rate over several GPUs' counters would read each GPU's lower
/// value as a reset); so a sample's evidence names the GPU of the observation being judged
/// ([`Sample::ev`]). Snapshots write it as before, the event as an [`Ev`] beside the value.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(from = "SampleRecord", into = "SampleRecord")]
pub struct Sample {
    /// When (the node's clock when it arrived).
    pub t: i64,
    /// The counter's value.
    pub value: f64,
    /// The event id.
    pub id: Id,
    /// Whether it was injected.
    pub synthetic: bool,
}

impl Sample {
    fn of(o: &Observation, t: i64, value: f64) -> Sample {
        Sample { t, value, id: Id::new(&o.event_id), synthetic: o.synthetic }
    }

    /// The sample's event as evidence, naming `gpu`, its rate's GPU.
    pub fn ev(&self, gpu: Option<Id>) -> Ev {
        Ev { t: self.t, id: self.id.clone(), synthetic: self.synthetic, key: None, gpu }
    }
}

/// A [`Sample`] as snapshots write it.
#[derive(Serialize, Deserialize)]
struct SampleRecord {
    ev: Ev,
    value: f64,
}

impl From<SampleRecord> for Sample {
    fn from(r: SampleRecord) -> Sample {
        let Ev { t, id, synthetic, .. } = r.ev;
        Sample { t, value: r.value, id, synthetic }
    }
}

impl From<Sample> for SampleRecord {
    fn from(s: Sample) -> SampleRecord {
        SampleRecord { ev: s.ev(None), value: s.value }
    }
}

/// The state of one condition.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum CondState {
    /// The latest events, at most `at_least` of them.
    Count {
        /// Oldest first.
        events: VecDeque<Ev>,
    },
    /// The burst in progress.
    Burst {
        /// None between bursts.
        burst: Option<Box<Burst>>,
    },
    /// The latest occurrence of each match.
    Together {
        /// One per entry of `of`.
        last: Vec<Option<Ev>>,
    },
    /// Counter samples: those in the window plus one before it as the baseline.
    Rate {
        /// Oldest first.
        samples: VecDeque<Sample>,
    },
    /// Since when the value has held.
    Threshold {
        /// The first reading of the current run.
        since: Option<Box<Ev>>,
        /// The latest reading of the run.
        latest: Option<Box<Ev>>,
        /// The latest value, for the reason.
        value: f64,
        /// Already fired in this run.
        fired: bool,
        /// Readings in a row that held.
        #[serde(default)]
        readings: u32,
    },
}

fn capped(mut evidence: Vec<Ev>) -> Vec<Ev> {
    evidence.truncate(MAX_EVIDENCE);
    evidence
}

fn codes_text(codes: &BTreeSet<u32>) -> String {
    if codes.is_empty() {
        return "no Xid code".to_owned();
    }
    let list: Vec<String> = codes.iter().map(u32::to_string).collect();
    format!("Xid {}", list.join(", "))
}

/// True when a burst's codes pass the test.
pub fn burst_passes(test: &BurstTest, burst: &Burst) -> bool {
    let has = |r: &super::model::CodeRange| burst.codes.iter().any(|c| r.contains(*c));
    test.with_all.iter().all(has)
        && (test.with_any.is_empty() || test.with_any.iter().any(has))
        && !test.without.iter().any(has)
        && (test.only.is_empty() || burst.codes.iter().all(|c| codes_contain(&test.only, *c)))
        && burst.events >= test.min_events
}

impl CondState {
    /// Frees what its lists hold beyond their entries (a snapshot's lists are read with the
    /// default growth).
    pub fn shrink_to_fit(&mut self) {
        match self {
            CondState::Count { events } => events.shrink_to_fit(),
            CondState::Rate { samples } => samples.shrink_to_fit(),
            CondState::Burst { .. } | CondState::Together { .. } | CondState::Threshold { .. } => {}
        }
    }

    /// A fresh state for `condition`.
    pub fn new(condition: &Condition) -> CondState {
        match condition {
            Condition::Count { .. } => CondState::Count { events: VecDeque::new() },
            Condition::Burst { .. } => CondState::Burst { burst: None },
            Condition::Together { of, .. } => CondState::Together { last: vec![None; of.len()] },
            Condition::Rate { .. } => CondState::Rate { samples: VecDeque::new() },
            Condition::Threshold { .. } => {
                CondState::Threshold { since: None, latest: None, value: 0.0, fired: false, readings: 0 }
            }
        }
    }

    /// True when the state belongs to `condition`'s type (a restored snapshot may predate a rule
    /// change).
    pub fn fits(&self, condition: &Condition) -> bool {
        match (self, condition) {
            (CondState::Together { last }, Condition::Together { of, .. }) => last.len() == of.len(),
            (CondState::Count { .. }, Condition::Count { .. })
            | (CondState::Burst { .. }, Condition::Burst { .. })
            | (CondState::Rate { .. }, Condition::Rate { .. })
            | (CondState::Threshold { .. }, Condition::Threshold { .. }) => true,
            _ => false,
        }
    }

    /// True when the state holds nothing worth keeping.
    pub fn is_empty(&self) -> bool {
        match self {
            CondState::Count { events } => events.is_empty(),
            CondState::Burst { burst } => burst.is_none(),
            CondState::Together { last } => last.iter().all(Option::is_none),
            CondState::Rate { samples } => samples.is_empty(),
            CondState::Threshold { since, .. } => since.is_none(),
        }
    }

    /// Takes an observation that matched the rule, at node time `t`.
    pub fn observe(&mut self, condition: &Condition, o: &Observation, t: i64) -> Update {
        match (self, condition) {
            (CondState::Count { events }, Condition::Count { at_least, within, distinct }) => {
                let mut ev = Ev::of(o, t);
                if let Some(Distinct::Process) = distinct {
                    // The same occurrence again (another line of one exception, the same job
                    // failing again) replaces its earlier entry rather than adding to the count.
                    let key = occurrence(o);
                    events.retain(|e| e.key.as_deref() != Some(key.as_str()));
                    ev.key = Some(key.into());
                }
                crate::tight::push_back(events, ev);
                if let Some(w) = within {
                    while events.front().is_some_and(|e| e.t < t.saturating_sub(w.micros())) {
                        events.pop_front();
                    }
                }
                // Only the latest `at_least` events can complete the count.
                while events.len() > *at_least as usize {
                    events.pop_front();
                }
                let firing = (events.len() == *at_least as usize).then(|| Firing {
                    at: t,
                    evidence: capped(events.iter().cloned().collect()),
                    detail: match (within, distinct) {
                        (Some(w), Some(Distinct::Process)) if *at_least > 1 => {
                            format!("{} from {at_least} distinct processes or workloads within {w}", describe(o))
                        }
                        (Some(w), None) if *at_least > 1 => format!("{at_least} matching events within {w}"),
                        _ => describe(o),
                    },
                });
                if *at_least == 1 {
                    // Nothing to remember: the next event fires on its own.
                    events.clear();
                }
                Update { adverse: true, firing }
            }
            (CondState::Burst { burst }, Condition::Burst { judge, test, .. }) => {
                let b = burst.get_or_insert_with(|| {
                    Box::new(Burst {
                        start: t,
                        last: t,
                        codes: BTreeSet::new(),
                        events: 0,
                        evidence: Vec::new(),
                        fired: false,
                    })
                });
                b.last = t;
                b.events = b.events.saturating_add(1);
                b.codes.extend(o.xid);
                if b.evidence.len() < MAX_EVIDENCE {
                    b.evidence.push(Ev::of(o, t));
                }
                let firing = (*judge == Judge::Each && !b.fired && burst_passes(test, b)).then(|| {
                    b.fired = true;
                    Firing {
                        at: t,
                        evidence: b.evidence.clone(),
                        detail: format!("a burst of {} events with {}", b.events, codes_text(&b.codes)),
                    }
                });
                Update { adverse: true, firing }
            }
            (CondState::Together { last }, Condition::Together { of, within }) => {
                let mut adverse = false;
                for (slot, m) in last.iter_mut().zip(of) {
                    if m.matches(o) {
                        *slot = Some(Ev::of(o, t));
                        adverse = true;
                    }
                }
                for slot in last.iter_mut() {
                    if slot.as_ref().is_some_and(|e| e.t < t.saturating_sub(within.micros())) {
                        *slot = None;
                    }
                }
                let firing = (adverse && last.iter().all(Option::is_some)).then(|| {
                    let mut evidence: Vec<Ev> = last.iter().flatten().cloned().collect();
                    evidence.sort_by(|a, b| (a.t, &a.id).cmp(&(b.t, &b.id)));
                    evidence.dedup_by(|a, b| a.id == b.id);
                    Firing { at: t, evidence, detail: format!("{} related events within {within}", last.len()) }
                });
                Update { adverse, firing }
            }
            (CondState::Rate { samples }, Condition::Rate { field, more_than, per }) => {
                let Some(value) = o.fields.get(field).and_then(FieldValue::as_f64) else {
                    return Update::default();
                };
                if samples.back().is_some_and(|s| value < s.value) {
                    // A counter that went down was reset (driver reload, reboot): start again.
                    samples.clear();
                }
                let adverse = samples.back().is_some_and(|s| value > s.value);
                // Thin: the newest sample replaces the previous one while that one is within the
                // spacing of the sample before it. The baseline is then at most one spacing
                // younger than the window's start. Of a run of samples with one value only the
                // first and the latest are kept: the first says since when the counter has held
                // it, the latest until when, and the samples between them say nothing more (the
                // counter's value at any time between the two is that value). A counter that
                // does not move, most of them on a healthy fleet, keeps two samples instead of a
                // window's worth of them.
                let spacing = per.micros() / (MAX_SAMPLES as i64 / 2);
                let n = samples.len();
                let flat = n >= 2 && samples[n - 1].value == value && samples[n - 2].value == value;
                if flat || (n >= 2 && samples[n - 1].t.saturating_sub(samples[n - 2].t) < spacing) {
                    samples.pop_back();
                }
                crate::tight::push_back(samples, Sample::of(o, t, value));
                while samples.len() > 1 && samples[1].t <= t.saturating_sub(per.micros()) {
                    samples.pop_front();
                }
                while samples.len() > MAX_SAMPLES {
                    samples.pop_front();
                }
                let base = &samples[0];
                let elapsed = t.saturating_sub(base.t);
                if samples.len() < 2 || elapsed <= 0 {
                    return Update { adverse, firing: None };
                }
                // A baseline older than the window spreads the growth over the longer time, so
                // sparse samples are judged as a rate rather than as one large jump; unless the
                // counter still held the baseline's value at a later sample, inside the window:
                // then its value at the window's start is known, and all the growth is within it.
                let growth = value - base.value;
                let held = samples[1].value == base.value;
                let normalised = if elapsed > per.micros() && !held {
                    growth * per.micros() as f64 / elapsed as f64
                } else {
                    growth
                };
                let firing = (normalised > *more_than).then(|| {
                    let now = Ev::of(o, t);
                    Firing {
                        at: t,
                        evidence: vec![base.ev(now.gpu.clone()), now],
                        detail: format!("{field} grew by {normalised} per {per} (more than {more_than})"),
                    }
                });
                Update { adverse, firing }
            }
            (
                CondState::Threshold { since, latest, value: last_value, fired, readings: run },
                Condition::Threshold { field, cmp, limit, for_, readings },
            ) => {
                let (Some(value), Some(bound)) = (o.fields.get(field).and_then(FieldValue::as_f64), limit.resolve(o))
                else {
                    return Update::default();
                };
                if !cmp.holds(value, bound) {
                    *since = None;
                    *latest = None;
                    *fired = false;
                    *run = 0;
                    return Update::default();
                }
                let first = Ev::clone(since.get_or_insert_with(|| Box::new(Ev::of(o, t))));
                *latest = Some(Box::new(Ev::of(o, t)));
                *last_value = value;
                *run = run.saturating_add(1);
                let held = for_.micros() > 0 && t.saturating_sub(first.t) >= for_.micros();
                let repeated = *readings > 0 && *run >= *readings;
                let firing = (!*fired && (held || repeated)).then(|| {
                    *fired = true;
                    threshold_firing(field, *cmp, value, limit, *for_, first.clone(), latest.as_deref().cloned(), t)
                });
                Update { adverse: true, firing }
            }
            _ => Update::default(),
        }
    }

    /// The node time at which [`CondState::expire`] has work to do.
    pub fn deadline(&self, condition: &Condition) -> Option<i64> {
        match (self, condition) {
            // A burst ends when *more than* `gap` passes without an event.
            (CondState::Burst { burst: Some(b) }, Condition::Burst { gap, .. }) => {
                Some(b.last.saturating_add(gap.micros()).saturating_add(1))
            }
            (CondState::Threshold { since: Some(s), fired: false, .. }, Condition::Threshold { for_, .. })
                if for_.micros() > 0 =>
            {
                Some(s.t.saturating_add(for_.micros()))
            }
            _ => None,
        }
    }

    /// Acts on a deadline that `now` has reached: ends a burst (judging it when it is judged on
    /// close), or fires a threshold that has held long enough.
    pub fn expire(&mut self, condition: &Condition, now: i64) -> Option<Firing> {
        let due = self.deadline(condition).is_some_and(|d| d <= now);
        if !due {
            return None;
        }
        match (self, condition) {
            (CondState::Burst { burst }, Condition::Burst { gap, judge, test }) => {
                let b = *burst.take()?;
                (*judge == Judge::Close && burst_passes(test, &b)).then(|| Firing {
                    at: b.last.saturating_add(gap.micros()),
                    detail: format!(
                        "a burst of {} events with {}, ended by {gap} without another",
                        b.events,
                        codes_text(&b.codes)
                    ),
                    evidence: b.evidence,
                })
            }
            (
                CondState::Threshold { since, latest, value, fired, .. },
                Condition::Threshold { field, cmp, limit, for_, .. },
            ) => {
                let first = since.as_deref()?.clone();
                *fired = true;
                let at = first.t.saturating_add(for_.micros());
                Some(threshold_firing(field, *cmp, *value, limit, *for_, first, latest.as_deref().cloned(), at))
            }
            _ => None,
        }
    }
}

#[allow(clippy::too_many_arguments)]
fn threshold_firing(
    field: &str,
    cmp: super::model::Cmp,
    value: f64,
    limit: &super::model::Operand,
    for_: super::duration::Interval,
    first: Ev,
    latest: Option<Ev>,
    at: i64,
) -> Firing {
    let mut evidence = vec![first];
    if let Some(l) = latest
        && l.id != evidence[0].id
    {
        evidence.push(l);
    }
    let held = if for_.micros() > 0 { format!(" for {for_}") } else { String::new() };
    Firing { at, evidence, detail: format!("{field} {value} {} {limit}{held}", cmp.as_str()) }
}

fn describe(o: &Observation) -> String {
    match o.xid {
        Some(x) => format!("{} {x}", if o.kind == "sxid" { "SXid" } else { "Xid" }),
        None => format!("{} from {}", o.kind, o.source),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rules::duration::Interval;
    use crate::rules::model::{Cmp, CodeRange, Health, Match, Matcher, Operand};

    const S: i64 = 1_000_000;

    fn obs(id: &str, kind: &str) -> Observation {
        Observation::new(id, "n", 0, kind)
    }

    fn ids(f: &Firing) -> Vec<String> {
        f.evidence.iter().map(|e| e.id.to_string()).collect()
    }

    #[test]
    fn count_fires_on_the_nth_event_in_the_window_only() {
        let c = Condition::Count { at_least: 3, within: Some(Interval::from_secs(60)), distinct: None };
        let mut s = CondState::new(&c);
        assert!(s.observe(&c, &obs("a", "xid"), 0).firing.is_none());
        assert!(s.observe(&c, &obs("b", "xid"), 10 * S).firing.is_none());
        // 65s after the first: "a" has left the window, so only two remain.
        assert!(s.observe(&c, &obs("c", "xid"), 65 * S).firing.is_none());
        let f = s.observe(&c, &obs("d", "xid"), 68 * S).firing.unwrap();
        assert_eq!(ids(&f), ["b", "c", "d"]);
        assert_eq!(f.at, 68 * S);
        let CondState::Count { events } = &s else { unreachable!() };
        assert_eq!(events.len(), 3, "bounded by at_least");
    }

    fn burst(judge: Judge, test: BurstTest) -> Condition {
        Condition::Burst { gap: Interval::from_secs(180), judge, test }
    }

    fn test(with_all: &[u32], with_any: &[u32], without: &[u32], only: &[u32]) -> BurstTest {
        let r = |v: &[u32]| v.iter().map(|c| CodeRange { lo: *c, hi: *c }).collect();
        BurstTest { with_all: r(with_all), with_any: r(with_any), without: r(without), only: r(only), min_events: 1 }
    }

    #[test]
    fn burst_judged_on_close_sees_the_whole_burst() {
        let c = burst(Judge::Close, test(&[48], &[], &[63, 64], &[]));
        let mut s = CondState::new(&c);
        assert!(s.observe(&c, &obs("a", "xid").xid(48), 0).firing.is_none());
        assert_eq!(s.deadline(&c), Some(180 * S + 1));
        assert!(s.expire(&c, 180 * S).is_none(), "exactly the gap does not end a burst");
        // 63 joins the burst at exactly the gap: the burst is no longer "48 alone".
        s.observe(&c, &obs("b", "xid").xid(63), 180 * S);
        assert!(s.expire(&c, 400 * S).is_none());
        assert!(s.is_empty(), "the burst ended");
        // A new burst of 48 alone fires when it ends, stamped at its end, not at the tick.
        s.observe(&c, &obs("c", "xid").xid(48), 1000 * S);
        let f = s.expire(&c, 5000 * S).unwrap();
        assert_eq!((f.at, ids(&f)), (1180 * S, vec!["c".to_owned()]));
    }

    #[test]
    fn burst_judged_on_each_fires_once_when_the_codes_meet() {
        let c = burst(Judge::Each, test(&[48], &[63, 64], &[], &[]));
        let mut s = CondState::new(&c);
        assert!(s.observe(&c, &obs("a", "xid").xid(48), 0).firing.is_none());
        let f = s.observe(&c, &obs("b", "xid").xid(64), 60 * S).firing.unwrap();
        assert_eq!(ids(&f), ["a", "b"]);
        assert!(s.observe(&c, &obs("c", "xid").xid(63), 61 * S).firing.is_none(), "once per burst");
        assert!(s.expire(&c, 1000 * S).is_none(), "judge each never fires on close");
    }

    #[test]
    fn burst_only_means_alone() {
        let c = burst(Judge::Close, test(&[45], &[], &[], &[45]));
        let mut s = CondState::new(&c);
        s.observe(&c, &obs("a", "xid").xid(45), 0);
        s.observe(&c, &obs("b", "xid").xid(45), S);
        assert!(s.expire(&c, 1000 * S).is_some());
        s.observe(&c, &obs("c", "xid").xid(45), 2000 * S);
        s.observe(&c, &obs("d", "xid").xid(13), 2001 * S);
        assert!(s.expire(&c, 9000 * S).is_none(), "45 with others follows the others");
    }

    fn xid_match(code: u32) -> Match {
        Match(vec![Matcher {
            source: vec![],
            component: vec![],
            kind: vec![],
            xid: vec![CodeRange { lo: code, hi: code }],
            health: Health::Any,
            fields: vec![],
        }])
    }

    #[test]
    fn together_needs_every_match_within_the_window() {
        let c = Condition::Together { of: vec![xid_match(48), xid_match(63)], within: Interval::from_secs(60) };
        let mut s = CondState::new(&c);
        assert!(s.observe(&c, &obs("a", "xid").xid(63), 0).firing.is_none());
        assert!(s.observe(&c, &obs("b", "xid").xid(48), 61 * S).firing.is_none(), "too far apart");
        let u = s.observe(&c, &obs("x", "xid").xid(13), 62 * S);
        assert!(!u.adverse && u.firing.is_none(), "matches neither");
        let f = s.observe(&c, &obs("c", "xid").xid(63), 100 * S).firing.unwrap();
        assert_eq!(ids(&f), ["b", "c"]);
    }

    #[test]
    fn rate_fires_on_fast_growth_and_survives_counter_resets() {
        let c = Condition::Rate { field: "crc".into(), more_than: 100.0, per: Interval::from_secs(3600) };
        let mut s = CondState::new(&c);
        let sample = |id: &str, v: i64| obs(id, "nvlink").field("crc", v);
        assert!(!s.observe(&c, &sample("a", 1000), 0).adverse, "the first sample is only a baseline");
        let u = s.observe(&c, &sample("b", 1050), 600 * S);
        assert!(u.adverse && u.firing.is_none());
        let f = s.observe(&c, &sample("c", 1101), 1200 * S).firing.unwrap();
        assert_eq!(ids(&f), ["a", "c"]);
        // Reset to zero: not growth, and the old baseline is gone.
        let u = s.observe(&c, &sample("d", 0), 1300 * S);
        assert!(!u.adverse && u.firing.is_none());
        // 150 over two hours is 75 per hour: slow growth over sparse samples does not fire.
        assert!(s.observe(&c, &sample("e", 150), 1300 * S + 7200 * S).firing.is_none());
        assert!(s.observe(&c, &obs("f", "nvlink"), 9000 * S) == Update::default(), "no field, no effect");
    }

    #[test]
    fn rate_over_a_long_window_sees_the_whole_window_with_bounded_samples() {
        // 1,200 corrected errors over 24 h, read every 5 s: 17,280 samples a day.
        let c = Condition::Rate { field: "sbe".into(), more_than: 1000.0, per: Interval::from_secs(24 * 3600) };
        let mut s = CondState::new(&c);
        let mut fired = None;
        for i in 0..=17_280i64 {
            let t = i * 5 * S;
            let value = i * 1200 / 17_280;
            let u = s.observe(&c, &obs(&format!("e{i}"), "ecc").field("sbe", value), t);
            let CondState::Rate { samples } = &s else { unreachable!() };
            assert!(samples.len() <= MAX_SAMPLES, "{} samples kept at {i}", samples.len());
            if fired.is_none() && u.firing.is_some() {
                fired = Some(i);
            }
        }
        // 1,000 of growth takes 20 h; thinning costs at most one spacing (45 min) of the window.
        let at = fired.expect("the slow trend fires within the day");
        assert!((20 * 720..=21 * 720).contains(&at), "fired after {} h", at as f64 / 720.0);
        // The same counter growing at half the rate never fires.
        let mut s = CondState::new(&c);
        for i in 0..=2 * 17_280i64 {
            let u = s.observe(&c, &obs(&format!("h{i}"), "ecc").field("sbe", i * 600 / 17_280), i * 5 * S);
            assert!(u.firing.is_none(), "600 a day fired at {i}");
        }
    }

    #[test]
    fn a_counter_that_does_not_move_keeps_two_samples_and_its_growth_is_still_seen() {
        // Single-bit errors read every 60 s, flat for 100 hours, then 1,500 of them in an hour.
        let c = Condition::Rate { field: "sbe".into(), more_than: 1000.0, per: Interval::from_secs(24 * 3600) };
        let mut s = CondState::new(&c);
        let len = |s: &CondState| match s {
            CondState::Rate { samples } => samples.len(),
            _ => unreachable!(),
        };
        let flat_until = 100 * 60;
        for i in 0..flat_until {
            let u = s.observe(&c, &obs(&format!("f{i}"), "ecc").field("sbe", 7), i * 60 * S);
            assert!(!u.adverse && u.firing.is_none());
            assert!(len(&s) <= 2, "{} samples of a flat counter at minute {i}", len(&s));
        }
        let mut fired = None;
        for i in 0..60 {
            let minute = flat_until + i;
            let u = s.observe(&c, &obs(&format!("g{i}"), "ecc").field("sbe", 7 + 25 * (i + 1)), minute * 60 * S);
            if fired.is_none()
                && let Some(f) = u.firing
            {
                fired = Some((i, f));
            }
        }
        // The counter was 7 at a sample inside the window, so the whole 1,000 grew within the
        // day: it fires at the 41st minute's 1,025, not spread over the 100 flat hours.
        let (at, f) = fired.expect("1,500 in an hour after a flat counter fires");
        assert_eq!(at, 40, "fired at minute {at} of the growth");
        assert_eq!(ids(&f), ["f0", "g40"], "the first flat sample is the baseline");
    }

    #[test]
    fn a_counter_sample_is_written_as_an_event_and_a_value_and_names_its_gpu_as_evidence() {
        let gpu = "GPU-6f2d1c3a-1b2c-4d5e-8f90-0123456789ab";
        let c = Condition::Rate { field: "sbe".into(), more_than: 10.0, per: Interval::from_secs(3600) };
        let mut s = CondState::new(&c);
        s.observe(&c, &obs("a", "ecc").gpu(gpu).field("sbe", 1), S);
        let f = s.observe(&c, &obs("b", "ecc").gpu(gpu).field("sbe", 50), 2 * S).firing.expect("49 in a second fires");
        assert!(f.evidence.iter().all(|e| e.gpu.as_ref().is_some_and(|g| g.is(gpu))), "{:?}", f.evidence);
        let CondState::Rate { samples } = &s else { unreachable!() };
        // As the `Sample { ev: Ev, value }` before it was written, less the GPU its rate names;
        // one an older snapshot holds, with its GPU, reads as the same sample.
        let json = serde_json::to_value(&samples[0]).unwrap();
        assert_eq!(json, serde_json::json!({"ev": {"t": S, "id": "a", "synthetic": false}, "value": 1.0}));
        assert_eq!(serde_json::from_value::<Sample>(json).unwrap(), samples[0]);
        let older = serde_json::json!({"ev": {"t": S, "id": "a", "synthetic": false, "gpu": gpu}, "value": 1.0});
        assert_eq!(serde_json::from_value::<Sample>(older).unwrap(), samples[0]);
        assert_eq!(std::mem::size_of::<Sample>(), 48);
    }

    #[test]
    fn a_keys_lists_hold_little_more_than_their_entries() {
        // A flat counter keeps two samples, and its list holds room for two, not the four a
        // `VecDeque` grows to at first.
        let rate = Condition::Rate { field: "sbe".into(), more_than: 1000.0, per: Interval::from_secs(24 * 3600) };
        let mut s = CondState::new(&rate);
        for i in 0..100 {
            s.observe(&rate, &obs(&format!("f{i}"), "ecc").field("sbe", 7), i * 60 * S);
        }
        let CondState::Rate { samples } = &s else { unreachable!() };
        assert_eq!((samples.len(), samples.capacity()), (2, 2), "a flat counter's samples and their room");
        // A moving counter's list grows with its samples, by a quarter at a time.
        for i in 0..100 {
            s.observe(&rate, &obs(&format!("g{i}"), "ecc").field("sbe", 8 + i), (100 + i) * 60 * S);
        }
        let CondState::Rate { samples } = &s else { unreachable!() };
        assert!(
            samples.capacity() <= samples.len() + samples.len() / 4 + 1,
            "{} for {}",
            samples.capacity(),
            samples.len()
        );
        // A count of one event holds one, and a snapshot's list read back is shrunk to its entries.
        let count = Condition::Count { at_least: 3, within: Some(Interval::from_secs(3600)), distinct: None };
        let mut s = CondState::new(&count);
        s.observe(&count, &obs("x1", "xid"), S);
        let CondState::Count { events } = &s else { unreachable!() };
        assert_eq!((events.len(), events.capacity()), (1, 1));
        let mut read: CondState = serde_json::from_str(&serde_json::to_string(&s).expect("json")).expect("read");
        read.shrink_to_fit();
        let CondState::Count { events } = &read else { unreachable!() };
        assert_eq!((events.len(), events.capacity()), (1, 1));
    }

    #[test]
    fn threshold_holds_for_the_duration_and_resets_when_it_drops() {
        let c = Condition::Threshold {
            field: "value".into(),
            cmp: Cmp::Ge,
            limit: Operand::Field("slowdown_threshold".into()),
            for_: Interval::from_secs(30),
            readings: 0,
        };
        let mut s = CondState::new(&c);
        let temp = |id: &str, v: i64| obs(id, "temperature").field("value", v).field("slowdown_threshold", 90);
        assert!(s.observe(&c, &temp("a", 91), 0).adverse);
        assert_eq!(s.deadline(&c), Some(30 * S));
        assert!(!s.observe(&c, &temp("b", 80), 10 * S).adverse);
        assert_eq!(s.deadline(&c), None, "dropping below restarts the clock");
        s.observe(&c, &temp("c", 95), 20 * S);
        assert!(s.observe(&c, &temp("d", 96), 49 * S).firing.is_none());
        let f = s.observe(&c, &temp("e", 97), 50 * S).firing.unwrap();
        assert_eq!((f.at, ids(&f)), (50 * S, vec!["c".to_owned(), "e".to_owned()]));
        // Held without further readings: a tick fires it at exactly `for` after the first.
        let mut s = CondState::new(&c);
        s.observe(&c, &temp("x", 91), 0);
        let f = s.expire(&c, 1000 * S).unwrap();
        assert_eq!(f.at, 30 * S);
        assert!(f.detail.contains("value 91 ge slowdown_threshold for 30s"), "{}", f.detail);
        assert!(s.expire(&c, 2000 * S).is_none(), "fires once per run");
    }
}
