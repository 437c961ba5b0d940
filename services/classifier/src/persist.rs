//! What the classifier keeps of the event stream in Postgres ([`Policy`]), and the rollups of the
//! healthy telemetry it leaves out ([`Rollup`]), one per node, GPU, kind and `--rollup-period`.
//!
//! Under [`Policy::Evidence`] an event is recorded in `health_events` when incident history or a
//! rebuild needs it ([`Keeper::keep`]): it is unhealthy; the engine says it bore on its state
//! ([`Bearing`]: evidence for or against an incident, a changed fact, a refusal); it is the
//! first of its node, GPU and kind since the classifier started (and with nothing of that key
//! replayed by the rebuild, [`Keeper::recorded`]), or the first of that key in a
//! keyframe period of event time (an eighth of `--rebuild-window`, from a minute to 6 hours: so a
//! rebuild window always holds recent readings of each, whatever facts they carry; each key's
//! periods start at a phase of its own, so the fleet's keyframes spread over the period); or it is a
//! reading crossing back to healthy. Every other healthy event only
//! feeds its GPU's rollup of the period: the minimum, maximum and last value of each number it
//! carries, and the increase of each counter. The raw stream stays in Kafka.
//!
//! Leaving such an event out of a replay changes nothing the engine decides from, so a rebuild
//! from the recorded subset reaches the same incidents (`tests/persist_policy.rs`).
//!
//! Rollups are written once their period is over by the newest event time seen (plus
//! [`ROLLUP_GRACE_MICROS`]); an event later than that adds a row merged into the written one.
//! They are kept in memory until then, and written when the classifier stops: a crash loses the
//! open periods' rollups (the events are in Kafka), and a batch replayed after a crash adds its
//! events' counts a second time.
//!
//! The period ([`Keeper::with_rollup_period`], `--rollup-period`, 10 minutes by default) is what
//! makes rollups fold events at all: the collector sends one heartbeat per GPU a minute and its
//! readings only on a change, so a rollup per minute held one event (a row per heartbeat: at
//! 100,000 nodes over a billion rows a day), where one per 10 minutes holds ten.

use std::collections::{BTreeMap, VecDeque};

// Looked up for every event: foldhash, not std's SipHash (Cargo.toml says why).
use foldhash::HashMap;
use std::sync::Arc;

use chrono::{DateTime, Utc};

use crate::rules::id::Id;
use crate::rules::{Bearing, FieldValue, Observation};

/// Which events the classifier records in `health_events`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Policy {
    /// What incident history and a rebuild need; rollups of the rest.
    #[default]
    Evidence,
    /// Every event, as consumed (no rollups).
    All,
}

impl Policy {
    /// The flag's value: `evidence` or `all`.
    pub fn parse(text: &str) -> Result<Policy, String> {
        match text {
            "evidence" => Ok(Policy::Evidence),
            "all" => Ok(Policy::All),
            other => Err(format!("`{other}` is neither `evidence` nor `all`")),
        }
    }

    /// The flag's value for this policy.
    pub fn as_str(self) -> &'static str {
        match self {
            Policy::Evidence => "evidence",
            Policy::All => "all",
        }
    }
}

/// A minute, in microseconds.
const MINUTE_MICROS: i64 = 60_000_000;

/// `--rollup-period`'s default: ten heartbeats of a GPU in each rollup.
pub const DEFAULT_ROLLUP_PERIOD: &str = "10m";

/// The rollup period [`Keeper::new`] starts with: a minute, the shortest `--rollup-period`.
pub const MIN_ROLLUP_PERIOD: std::time::Duration = std::time::Duration::from_secs(60);

/// The longest rollup period: an hour.
pub const MAX_ROLLUP_PERIOD: std::time::Duration = std::time::Duration::from_secs(3600);

/// Whether `period` can be a rollup period: from [`MIN_ROLLUP_PERIOD`] to [`MAX_ROLLUP_PERIOD`],
/// in whole minutes that divide an hour, so that every period starts at the same minutes of each
/// hour (xx:00, xx:10, ... for 10 minutes) whatever the classifier's start, and rows of replicas
/// and restarts line up.
pub fn check_rollup_period(period: std::time::Duration) -> Result<(), String> {
    let secs = period.as_secs();
    if period < MIN_ROLLUP_PERIOD
        || period > MAX_ROLLUP_PERIOD
        || period.subsec_nanos() != 0
        || !secs.is_multiple_of(60)
    {
        return Err("must be whole minutes from 1m to 1h".into());
    }
    if !3600u64.is_multiple_of(secs) {
        return Err(format!(
            "{} minutes does not divide an hour (1, 2, 3, 4, 5, 6, 10, 12, 15, 20, 30 or 60)",
            secs / 60
        ));
    }
    Ok(())
}

/// The longest keyframe period ([`Keeper::for_rebuild_window`]), in microseconds: 6 hours.
pub const MAX_KEYFRAME_MICROS: i64 = 6 * 3_600_000_000;

/// The most rollups one batch hands the rollup writer, and the most one statement writes
/// ([`Keeper::closed`], `crate::rollups`): a minute that closes after a burst can hold one per GPU
/// and kind of the fleet (400,000 at 10,000 nodes), and written at once they made one statement of
/// hundreds of megabytes. The rest wait for the next batches.
pub const ROLLUPS_PER_BATCH: usize = 20_000;

/// The fewest closed rollups a batch may hand over ([`rollups_for_batch`]).
pub const ROLLUPS_MIN_PER_BATCH: usize = 1_000;

/// How many closed rollups a batch of `events` events hands the rollup writer: as many as it has
/// events, at least [`ROLLUPS_MIN_PER_BATCH`] and at most [`ROLLUPS_PER_BATCH`]. Each event adds
/// to one rollup at most, so the closed ones drain as fast as they are made, in statements about
/// the size of the batches that made them.
pub fn rollups_for_batch(events: usize) -> usize {
    events.clamp(ROLLUPS_MIN_PER_BATCH, ROLLUPS_PER_BATCH)
}

/// How long after its period ends (by the newest event time seen) a rollup is written: events of
/// a node arrive a little out of order across its sources.
pub const ROLLUP_GRACE_MICROS: i64 = 60_000_000;

/// Fields that are counters (they only grow, except when the GPU or driver resets them): their
/// rollup also says how much they grew in its period.
pub const COUNTER_FIELDS: &[(&str, &str)] = &[
    ("ecc", "single_bit_volatile"),
    ("ecc", "double_bit_volatile"),
    ("ecc", "single_bit_aggregate"),
    ("ecc", "double_bit_aggregate"),
    ("retired_pages", "total"),
    ("row_remap", "correctable"),
    ("row_remap", "uncorrectable"),
    ("nvlink", "crc_errors"),
    ("nvlink", "recovery_errors"),
    ("pcie_replay", "value"),
];

/// The most counters one kind has in [`COUNTER_FIELDS`] (ECC's four).
const COUNTERS_PER_KIND: usize = 4;

/// The place of `kind.field` among its kind's counters in [`COUNTER_FIELDS`], if it is one.
fn counter_slot(kind: &str, field: &str) -> Option<usize> {
    COUNTER_FIELDS
        .iter()
        .filter(|(k, _)| *k == kind)
        .position(|(_, f)| *f == field)
        .filter(|slot| *slot < COUNTERS_PER_KIND)
}

/// A stable digest (FNV-1a) of a node, GPU and kind.
fn key_digest(node: &str, gpu: &str, kind: &str) -> u64 {
    [node, gpu, kind]
        .iter()
        .flat_map(|p| p.bytes().chain([0x1f]))
        .fold(0xcbf2_9ce4_8422_2325, |h, b| (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3))
}

/// What is remembered per node, GPU and kind: 24 bytes, nothing on the heap. A fleet has about
/// 80 a node ([`NodeKeys`]).
#[derive(Debug, Clone, Default)]
struct Track {
    /// The keyframe period (event time) of the last recorded event.
    period: i64,
    /// The kind, by its place in [`Names`].
    kind: u32,
    /// The GPU, by its place among the node's ([`NodeKeys::gpus`]).
    gpu: u32,
    /// The counters' last values, by their place in [`NodeKeys::counters`]; [`NO_COUNTERS`] for a
    /// kind that counts nothing.
    counters: u32,
    /// The last event was unhealthy.
    unhealthy: bool,
}

/// [`Track::counters`] of a kind with no counter.
const NO_COUNTERS: u32 = u32::MAX;

/// The last value of each counter of a node, GPU and kind that counts something, by its place
/// among the kind's counters ([`counter_slot`]): in place, nothing on the heap. They were a list
/// of (shared name, value) per key, a heap block of about 100 bytes each, and then four places
/// in every key, though half the kinds count nothing.
#[derive(Debug, Clone, Default)]
struct Counters {
    last: [i64; COUNTERS_PER_KIND],
    /// Which places of `last` hold a value (bit `i` for place `i`).
    seen: u8,
}

/// Whether events of `kind` carry a counter ([`COUNTER_FIELDS`]).
fn counts(kind: &str) -> bool {
    COUNTER_FIELDS.iter().any(|(k, _)| *k == kind)
}

/// Field and kind names, each held once: a key or an open rollup names one by its place here (4
/// bytes), and the rollups handed out share it: a fleet's rollups carry the same few dozen
/// names millions of times.
#[derive(Debug, Default)]
struct Names {
    places: HashMap<Arc<str>, u32>,
    names: Vec<Arc<str>>,
}

impl Names {
    /// The place of `name`, added when new.
    fn place(&mut self, name: &str) -> u32 {
        if let Some(place) = self.places.get(name) {
            return *place;
        }
        // Names come from the events' kinds and fields: a few dozen, never billions.
        let place = u32::try_from(self.names.len()).expect("fewer than 2^32 names");
        let shared: Arc<str> = Arc::from(name);
        self.names.push(Arc::clone(&shared));
        self.places.insert(shared, place);
        place
    }

    /// The name at `place`.
    fn name(&self, place: u32) -> &Arc<str> {
        &self.names[place as usize]
    }
}

/// A rollup's values by field name: a short list (a kind carries a handful of numbers), searched
/// in order, its names shared ([`Names`]). A map per rollup cost a whole tree node (about half a
/// kilobyte) for one or two fields, and at 800,000 GPUs that was most of the classifier's memory.
#[derive(Debug, Clone, PartialEq)]
pub struct Fields<V>(Vec<(Arc<str>, V)>);

impl<V> Default for Fields<V> {
    fn default() -> Self {
        Fields(Vec::new())
    }
}

impl<V> Fields<V> {
    /// The value of `field`.
    pub fn get(&self, field: &str) -> Option<&V> {
        self.0.iter().find(|(name, _)| &**name == field).map(|(_, v)| v)
    }

    /// No field.
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// Each field and its value, in the order they first came.
    pub fn iter(&self) -> impl Iterator<Item = (&str, &V)> {
        self.0.iter().map(|(name, v)| (&**name, v))
    }
}

impl<V> std::ops::Index<&str> for Fields<V> {
    type Output = V;

    fn index(&self, field: &str) -> &V {
        self.get(field).unwrap_or_else(|| panic!("no field {field}"))
    }
}

/// A JSON object, as the map it replaced was.
impl<V: serde::Serialize> serde::Serialize for Fields<V> {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.collect_map(self.iter())
    }
}

/// The minimum, maximum and last value of one reading over a rollup's period.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize)]
pub struct Reading {
    /// The smallest value.
    pub min: f64,
    /// The largest value.
    pub max: f64,
    /// The value of the latest event (by event time).
    pub last: f64,
}

impl Reading {
    /// Folds `other` in: the least minimum, the greatest maximum, and `other`'s last value when it
    /// is the `later` of the two.
    fn fold(&mut self, other: Reading, later: bool) {
        self.min = self.min.min(other.min);
        self.max = self.max.max(other.max);
        if later {
            self.last = other.last;
        }
    }
}

/// One GPU's (or node's) healthy telemetry of one kind over one period.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Rollup {
    /// The period's length, in microseconds (the keeper's when the rollup began).
    pub period: i64,
    /// Healthy events folded in.
    pub events: i32,
    /// The latest event's time.
    pub last_at: i64,
    /// Each numeric field's minimum, maximum and last value.
    pub readings: Fields<Reading>,
    /// How much each counter grew (a counter that went down was reset: it counts from zero).
    pub counters: Fields<i64>,
}

impl Rollup {
    /// Folds `other`, a rollup of the same key, in, as `telemetry_rollups`' merge of a row
    /// written twice does: counts and growths added, the least minimum, the greatest maximum,
    /// the last value of the later one (the longer period).
    pub fn merge(&mut self, other: Rollup) {
        let later = other.last_at >= self.last_at;
        self.events = self.events.saturating_add(other.events);
        self.last_at = self.last_at.max(other.last_at);
        self.period = self.period.max(other.period);
        for (field, r) in other.readings.0 {
            match self.readings.0.iter_mut().find(|(f, _)| *f == field) {
                Some((_, mine)) => mine.fold(r, later),
                None => self.readings.0.push((field, r)),
            }
        }
        for (field, growth) in other.counters.0 {
            match self.counters.0.iter_mut().find(|(f, _)| *f == field) {
                Some((_, mine)) => *mine = mine.saturating_add(growth),
                None => self.counters.0.push((field, growth)),
            }
        }
    }
}

/// How much a counter grew since its last value (none for its first), remembering this one. A
/// value below the last is a reset: the counter started again from zero, so it grew by the value.
pub fn counter_growth(last: Option<i64>, now: i64) -> i64 {
    match last {
        None => 0,
        Some(last) if now >= last => now.saturating_sub(last),
        Some(_) => now.max(0),
    }
}

fn counter_step(counters: &mut Counters, slot: usize, now: i64) -> i64 {
    let bit = 1u8 << slot;
    let last = (counters.seen & bit != 0).then_some(counters.last[slot]);
    counters.seen |= bit;
    counters.last[slot] = now;
    counter_growth(last, now)
}

/// The key of a rollup: node, GPU (empty for the node), kind and the start of its period
/// (microseconds).
pub type RollupKey = (String, String, String, i64);

/// One period's open rollups, by node: a node's are one list, each GPU (or the node) and kind
/// once, found by its key's place among the node's keys ([`NodeKeys`]), so an event whose rollup
/// exists finds it without copying a name (nearly every healthy event does). A list, not a map of
/// GPUs holding maps of kinds: on a running fleet every node reports within each minute, and
/// those nested maps cost about 5 KB a node and period however few kinds they held (a hash map's
/// table for each GPU); the list takes what its rollups take.
type PeriodRollups = HashMap<String, Vec<OpenRollup>>;

/// A rollup of one node's period ([`PeriodRollups`]): 48 bytes and its fields. Its GPU and kind
/// are its key's ([`NodeKeys`]), its field names places in [`Names`], and its period the
/// keeper's; named in full only when it is handed out ([`OpenRollup::rollup`]). Each rollup
/// naming its GPU, kind and fields itself (an [`Id`], shared names and a `Vec` each) took 120
/// bytes and 40 a reading, and a node has some 80 open at once.
#[derive(Debug, Default)]
struct OpenRollup {
    /// Its key's place in its node's [`NodeKeys`].
    slot: u32,
    /// Healthy events folded in.
    events: i32,
    /// The latest event's time.
    last_at: i64,
    /// Each numeric field's minimum, maximum and last value, by the field's place in [`Names`].
    readings: Box<[(u32, Reading)]>,
    /// How much each counter grew, by the field's place in [`Names`].
    counters: Box<[(u32, i64)]>,
}

/// The value of `field` in a rollup's `list`, added as `value` when absent.
fn field_value<'a, V>(list: &'a mut Box<[(u32, V)]>, field: &str, names: &mut Names, value: V) -> &'a mut V {
    let i = match list.iter().position(|(place, _)| **names.name(*place) == *field) {
        Some(i) => i,
        None => {
            crate::tight::push_boxed(list, (names.place(field), value));
            list.len() - 1
        }
    };
    &mut list[i].1
}

impl OpenRollup {
    /// Folds one reading in, at `at`.
    fn add(&mut self, o: &Observation, at: i64, mut counters: Option<&mut Counters>, names: &mut Names) {
        self.events = self.events.saturating_add(1);
        let later = at >= self.last_at;
        self.last_at = self.last_at.max(at);
        for (field, value) in &o.fields {
            let Some(v) = value.as_f64().filter(|v| v.is_finite()) else { continue };
            let one = Reading { min: v, max: v, last: v };
            field_value(&mut self.readings, field, names, one).fold(one, later);
            if let (FieldValue::Int(now), Some(slot), Some(counters)) =
                (value, counter_slot(&o.kind, field), counters.as_deref_mut())
            {
                let growth = counter_step(counters, slot, *now);
                *field_value(&mut self.counters, field, names, 0) += growth;
            }
        }
    }

    /// The rollup as it is written, its fields named, over a period of `period` microseconds.
    fn rollup(self, period: i64, names: &Names) -> Rollup {
        let named = |place: &u32| Arc::clone(names.name(*place));
        Rollup {
            period,
            events: self.events,
            last_at: self.last_at,
            readings: Fields(self.readings.iter().map(|(place, r)| (named(place), *r)).collect()),
            counters: Fields(self.counters.iter().map(|(place, g)| (named(place), *g)).collect()),
        }
    }
}

/// A node's keys (each GPU, or the node itself, and kind it has reported), in the order first
/// seen, and what is remembered of each ([`Track`]). Kept per node, not in one map of the
/// fleet's keys by digest: a hash table of 8 million entries (100,000 nodes) stood half empty
/// after each doubling, some 9 KB a node, and the open rollups had to name their GPU and kind
/// themselves. A key keeps its place: an open rollup names it by that place.
#[derive(Debug, Default)]
struct NodeKeys {
    /// [`key_digest`] of each key, apart from the rest: searched for every event.
    digests: Vec<u64>,
    keys: Vec<Track>,
    /// The node's GPUs (the empty name for the node itself), in the order first seen, their
    /// UUIDs held inline: named once, not by each of their kinds.
    gpus: Vec<Id>,
    /// The counters of the keys that count something.
    counters: Vec<Counters>,
}

/// A place in one of a node's lists: far fewer than 2^32 (its GPUs times the kinds).
fn place_of(len: usize) -> u32 {
    u32::try_from(len).expect("fewer than 2^32 keys a node")
}

impl NodeKeys {
    /// The place of the key with `digest`, added with `gpu` and `kind` when new, and whether it
    /// was.
    fn place(&mut self, digest: u64, gpu: &str, kind: &str, names: &mut Names) -> (usize, bool) {
        if let Some(i) = self.digests.iter().position(|d| *d == digest) {
            return (i, false);
        }
        let gpu = Id::new(gpu);
        let gpu = match self.gpus.iter().position(|g| *g == gpu) {
            Some(i) => place_of(i),
            None => {
                crate::tight::push(&mut self.gpus, gpu);
                place_of(self.gpus.len() - 1)
            }
        };
        let counters = if counts(kind) {
            crate::tight::push(&mut self.counters, Counters::default());
            place_of(self.counters.len() - 1)
        } else {
            NO_COUNTERS
        };
        crate::tight::push(&mut self.digests, digest);
        crate::tight::push(&mut self.keys, Track { kind: names.place(kind), gpu, counters, ..Track::default() });
        (self.keys.len() - 1, true)
    }

    /// The key at `slot` and its counters, if its kind counts something.
    fn track(&mut self, slot: usize) -> (&mut Track, Option<&mut Counters>) {
        let track = &mut self.keys[slot];
        let counters = self.counters.get_mut(track.counters as usize);
        (track, counters)
    }
}

/// Decides, per event, whether it is recorded, and rolls up the rest.
#[derive(Debug, Default)]
pub struct Keeper {
    policy: Policy,
    /// Each node's keys. A node's stay when its open rollups go ([`Keeper::retain_nodes`]): its
    /// closed ones name them until written, and a partition that comes back is replayed onto them.
    nodes: HashMap<String, NodeKeys>,
    /// The rollups not yet written, by the start of their period, then node, GPU and kind.
    open: BTreeMap<i64, PeriodRollups>,
    /// Rollups opened by a start snapshot's reading, handed out with the next hand-out rather than
    /// when their period closes ([`Keeper::keep`]), by the start of their period.
    early: BTreeMap<i64, PeriodRollups>,
    /// The rollup period, in microseconds.
    rollup_period: i64,
    /// The newest event time seen.
    watermark: i64,
    /// Each node, GPU and kind has an event recorded in every period this long (microseconds).
    keyframe: i64,
    /// The names of kinds and fields, held once.
    names: Names,
    /// Rollups whose period is over, not yet handed out to be written, oldest first.
    ready: VecDeque<ClosedPeriod>,
}

/// A period whose rollups are being handed out ([`Keeper::closed`]): a node's rollups are made
/// rows only when they are handed out, so a batch does work in proportion to what it hands out.
/// Made into rows all at once when the period closed, a minute of 10,000 nodes' telemetry took
/// one batch about 340 ms (docs/benchmarks.md), and the faults behind that batch waited.
#[derive(Debug)]
struct ClosedPeriod {
    start: i64,
    /// The rollup period, in microseconds.
    period: i64,
    /// The nodes still to hand out, in reverse name order (the next one is last).
    nodes: Vec<String>,
    rollups: PeriodRollups,
    /// The rest of a node of which only some rollups were handed out, in key order.
    rest: VecDeque<(RollupKey, Rollup)>,
}

impl ClosedPeriod {
    fn new(start: i64, period: i64, rollups: PeriodRollups) -> Self {
        let mut nodes: Vec<String> = rollups.keys().cloned().collect();
        nodes.sort_unstable_by(|a, b| b.cmp(a));
        ClosedPeriod { start, period, nodes, rollups, rest: VecDeque::new() }
    }

    /// The next rollup in key order, if any is left, named by the nodes' keys and `names`.
    fn next(&mut self, keys: &HashMap<String, NodeKeys>, names: &Names) -> Option<(RollupKey, Rollup)> {
        loop {
            if let Some(row) = self.rest.pop_front() {
                return Some(row);
            }
            let node = self.nodes.pop()?;
            if let Some(list) = self.rollups.remove(&node) {
                let node_keys = keys.get(&node).expect("a node's keys outlive its rollups");
                let mut rows: Vec<(RollupKey, Rollup)> = list
                    .into_iter()
                    .map(|r| {
                        let key = &node_keys.keys[r.slot as usize];
                        let (gpu, kind) = (node_keys.gpus[key.gpu as usize].to_string(), names.name(key.kind));
                        ((node.clone(), gpu, kind.to_string(), self.start), r.rollup(self.period, names))
                    })
                    .collect();
                rows.sort_unstable_by(|a, b| a.0.cmp(&b.0));
                self.rest.extend(rows);
            }
        }
    }
}

impl Keeper {
    /// A keeper for `policy`, with keyframes every [`MAX_KEYFRAME_MICROS`] and rollups per
    /// minute ([`MIN_ROLLUP_PERIOD`]).
    pub fn new(policy: Policy) -> Keeper {
        Keeper { policy, keyframe: MAX_KEYFRAME_MICROS, rollup_period: MINUTE_MICROS, ..Default::default() }
    }

    /// The same, with a rollup per `period` ([`check_rollup_period`]; one outside it is clamped
    /// to a minute to an hour).
    pub fn with_rollup_period(self, period: std::time::Duration) -> Keeper {
        let micros = i64::try_from(period.as_micros()).unwrap_or(i64::MAX);
        Keeper { rollup_period: micros.clamp(MINUTE_MICROS, 60 * MINUTE_MICROS), ..self }
    }

    /// The same, with a keyframe of each node, GPU and kind in every `period` of event time: an
    /// eighth of the rebuild window, from a minute to [`MAX_KEYFRAME_MICROS`].
    pub fn for_rebuild_window(policy: Policy, window: std::time::Duration) -> Keeper {
        let eighth = i64::try_from(window.as_micros() / 8).unwrap_or(i64::MAX);
        Keeper { keyframe: eighth.clamp(MINUTE_MICROS, MAX_KEYFRAME_MICROS), ..Keeper::new(policy) }
    }

    /// The policy.
    pub fn policy(&self) -> Policy {
        self.policy
    }

    /// Whether the event `o` (which the engine judged as `bearing`) is recorded; when it is not
    /// (and when it is healthy), it is folded into its rollup. Under [`Policy::All`], always.
    pub fn keep(&mut self, o: &Observation, bearing: Bearing) -> bool {
        if self.policy == Policy::All {
            return true;
        }
        let at = o.observed_at_micros;
        self.watermark = self.watermark.max(at);
        let gpu = o.gpu.as_deref().unwrap_or("");
        let digest = key_digest(&o.node, gpu, &o.kind);
        let period = self.period(digest, at);
        // Found by the event's own name, copied only for the node's first event.
        let keys = match self.nodes.get_mut(o.node.as_str()) {
            Some(keys) => keys,
            None => self.nodes.entry(o.node.clone()).or_default(),
        };
        let (slot, first) = keys.place(digest, gpu, &o.kind, &mut self.names);
        let (track, counters) = keys.track(slot);
        let crossing = o.healthy && track.unhealthy;
        let keyframe = first || track.period != period;
        let keep = !o.healthy || bearing.matters() || crossing || keyframe;
        track.unhealthy = !o.healthy;
        if keep {
            track.period = period;
        }
        if o.healthy {
            let start = at.div_euclid(self.rollup_period) * self.rollup_period;
            let slot = place_of(slot);
            // A start snapshot's reading that opens its key's rollup of the period hands that
            // rollup out with the next batch's rather than at the period's close; the table merges
            // a later row of the same period into it. A collector's start snapshot reports each
            // reading of each GPU once, and most kinds report again only on a change: held open
            // until their period closed, those rollups (some 60 a node) were most of what the
            // classifier's state grew by while a fleet's collectors started (a rollout of the
            // collector, or the first deployment; docs/benchmarks.md). The cost is one row more
            // for a reading that changes again within the period of its snapshot.
            let opened = |periods: &BTreeMap<i64, PeriodRollups>| {
                periods
                    .get(&start)
                    .and_then(|nodes| nodes.get(o.node.as_str()))
                    .is_some_and(|list| list.iter().any(|r| r.slot == slot))
            };
            let periods = if o.start_snapshot && !opened(&self.open) { &mut self.early } else { &mut self.open };
            // Found by the event's own names, copied only for a period's first event of the key.
            let nodes = periods.entry(start).or_default();
            let list = match nodes.get_mut(o.node.as_str()) {
                Some(list) => list,
                None => nodes.entry(o.node.clone()).or_default(),
            };
            let i = match list.iter().position(|r| r.slot == slot) {
                Some(i) => i,
                None => {
                    crate::tight::push(list, OpenRollup { slot, ..OpenRollup::default() });
                    list.len() - 1
                }
            };
            list[i].add(o, at, counters, &mut self.names);
        }
        keep
    }

    /// Takes in an event recorded before, replayed by a rebuild (a start, or partitions gained in
    /// a rebalance), oldest first: its node, GPU and kind are then known, with the period of their
    /// last recorded event and whether it was unhealthy. Without this every key was "the first
    /// since start" again, and the first reading of each after a rollout of the classifier was
    /// recorded at once (at 100,000 nodes, millions of rows within one reporting interval); with
    /// it a key's next keyframe is due when it would have been had the classifier not restarted,
    /// and a reading after a recorded unhealthy one is still recorded as the crossing back.
    pub fn recorded(&mut self, o: &Observation) {
        if self.policy == Policy::All {
            return;
        }
        let gpu = o.gpu.as_deref().unwrap_or("");
        let digest = key_digest(&o.node, gpu, &o.kind);
        let period = self.period(digest, o.observed_at_micros);
        let keys = match self.nodes.get_mut(o.node.as_str()) {
            Some(keys) => keys,
            None => self.nodes.entry(o.node.clone()).or_default(),
        };
        let (slot, _) = keys.place(digest, gpu, &o.kind, &mut self.names);
        let (track, counters) = keys.track(slot);
        track.period = period;
        track.unhealthy = !o.healthy;
        // A counter's last value, as a healthy reading leaves it (Rollup::add): the growth from it
        // to the first reading after the restart is counted in that reading's rollup. A changed
        // counter is a changed fact, recorded, so the last recorded value is the last one seen.
        if let (true, Some(counters)) = (o.healthy, counters) {
            for (field, value) in &o.fields {
                if let (FieldValue::Int(now), Some(slot)) = (value, counter_slot(&o.kind, field)) {
                    counter_step(counters, slot, *now);
                }
            }
        }
    }

    /// The keyframe period of event time `at` for the key with `digest`. Each key's periods are
    /// shifted by a phase of their own (its digest modulo the period), so the fleet's keys start
    /// their periods spread over the whole period, not all at one instant: with periods aligned,
    /// the first reading of every node, GPU and kind after each boundary was recorded at once
    /// (at 100,000 nodes, millions of rows within one reporting interval, far beyond what a
    /// batch writes, and every fault queued behind them). Each key still has one period, and so
    /// one keyframe, in every `keyframe` of event time.
    fn period(&self, digest: u64, at: i64) -> i64 {
        at.saturating_add(self.period_phase(digest)).div_euclid(self.keyframe)
    }

    /// The shift of a key's keyframe periods ([`Keeper::period`]).
    fn period_phase(&self, digest: u64) -> i64 {
        (digest % self.keyframe.unsigned_abs()) as i64
    }

    /// Up to `at_most` of the rollups whose period ended [`ROLLUP_GRACE_MICROS`] before the
    /// newest event time seen, oldest period first, taken out to be written, in key order (so a
    /// statement's rows lock in the same order every time); the rest of them on later calls.
    ///
    /// The rollups opened by start snapshots since the last hand-out come after the closed periods,
    /// unless `at_most` is 0 (the writer's queue is full): then they wait, as the closed ones do.
    pub fn closed(&mut self, at_most: usize) -> Vec<(RollupKey, Rollup)> {
        let cutoff = self.watermark.saturating_sub(ROLLUP_GRACE_MICROS + self.rollup_period);
        let open = self.open.split_off(&cutoff.saturating_add(1));
        let closed = std::mem::replace(&mut self.open, open);
        self.close(closed);
        if at_most > 0 {
            let early = std::mem::take(&mut self.early);
            self.close(early);
        }
        self.take(at_most)
    }

    /// Every rollup held, closed or not, in key order: at shutdown, and for tests.
    pub fn drain(&mut self) -> Vec<(RollupKey, Rollup)> {
        let open = std::mem::take(&mut self.open);
        self.close(open);
        let early = std::mem::take(&mut self.early);
        self.close(early);
        self.take(usize::MAX)
    }

    fn close(&mut self, periods: BTreeMap<i64, PeriodRollups>) {
        let period = self.rollup_period;
        self.ready.extend(periods.into_iter().map(|(start, rollups)| ClosedPeriod::new(start, period, rollups)));
    }

    /// Up to `at_most` closed rollups, oldest period first, in key order, each key once.
    ///
    /// A key can be closed twice before it is handed out: an event later than its period's close
    /// opens the period again, and the next close queues it behind the rest of the first. Both in
    /// one statement, `INSERT ... ON CONFLICT DO UPDATE` refuses the statement ("cannot affect row
    /// a second time"), so they are merged here, as the table merges rows written apart.
    fn take(&mut self, at_most: usize) -> Vec<(RollupKey, Rollup)> {
        let mut out = Vec::new();
        while out.len() < at_most {
            let Some(period) = self.ready.front_mut() else { break };
            match period.next(&self.nodes, &self.names) {
                Some(row) => out.push(row),
                None => {
                    self.ready.pop_front();
                }
            }
        }
        out.sort_by(|a, b| a.0.cmp(&b.0));
        // In place: a hand-out is up to 20,000 rollups, and a second list of them was as much again.
        out.dedup_by(|later, kept| {
            let same = later.0 == kept.0;
            if same {
                kept.1.merge(std::mem::take(&mut later.1));
            }
            same
        });
        out
    }

    /// Forgets the open rollups of the nodes `keep` rejects (their partitions went to another
    /// replica, which starts them afresh). Closed ones, and those of start snapshots (already
    /// due), are still written: the other replica's rows for the same period merge with them.
    pub fn retain_nodes(&mut self, mut keep: impl FnMut(&str) -> bool) {
        for period in self.open.values_mut() {
            period.retain(|node, _| keep(node));
        }
    }
}

/// What a keeper holds, counted ([`Keeper::footprint`]).
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub struct Footprint {
    /// Nodes known.
    pub nodes: usize,
    /// Their keys: each GPU (or the node) and kind.
    pub keys: usize,
    /// Keys whose kind counts something, and so hold its counters' last values.
    pub counting_keys: usize,
    /// Rollups open or closed and not yet handed out.
    pub rollups: usize,
    /// Their readings and counters.
    pub fields: usize,
}

impl Keeper {
    /// What the keeper holds, counted (`classifier-state` prints it per node).
    pub fn footprint(&self) -> Footprint {
        let mut f = Footprint { nodes: self.nodes.len(), ..Footprint::default() };
        for keys in self.nodes.values() {
            f.keys += keys.keys.len();
            f.counting_keys += keys.counters.len();
        }
        let open = self.open.values().chain(self.early.values()).flat_map(HashMap::values);
        for list in open.chain(self.ready.iter().flat_map(|c| c.rollups.values())) {
            f.rollups += list.len();
            f.fields += list.iter().map(|r| r.readings.len() + r.counters.len()).sum::<usize>();
        }
        for (_, r) in self.ready.iter().flat_map(|c| &c.rest) {
            f.rollups += 1;
            f.fields += r.readings.iter().count() + r.counters.iter().count();
        }
        f
    }
}

/// Rollups as column arrays, ready to insert.
#[derive(Debug, Default, Clone)]
pub struct RollupRows {
    pub(crate) nodes: Vec<String>,
    pub(crate) gpus: Vec<String>,
    pub(crate) kinds: Vec<String>,
    /// The start of each rollup's period (column `minute`).
    pub(crate) minutes: Vec<DateTime<Utc>>,
    /// Each rollup's period, in microseconds.
    pub(crate) periods: Vec<i64>,
    pub(crate) events: Vec<i32>,
    pub(crate) last_at: Vec<DateTime<Utc>>,
    /// `{"field": {"min": .., "max": .., "last": ..}}` as JSON text.
    pub(crate) readings: Vec<String>,
    /// `{"field": growth}` as JSON text.
    pub(crate) counters: Vec<String>,
}

impl RollupRows {
    /// Adds one rollup.
    pub fn push(&mut self, key: &RollupKey, r: &Rollup) {
        let at = |m: i64| DateTime::from_timestamp_micros(m).unwrap_or_default();
        self.nodes.push(key.0.clone());
        self.gpus.push(key.1.clone());
        self.kinds.push(key.2.clone());
        self.minutes.push(at(key.3));
        self.periods.push(r.period);
        self.events.push(r.events);
        self.last_at.push(at(r.last_at));
        // Plain maps of numbers: serialising them cannot fail.
        self.readings.push(serde_json::to_string(&r.readings).unwrap_or_else(|_| "{}".into()));
        self.counters.push(serde_json::to_string(&r.counters).unwrap_or_else(|_| "{}".into()));
    }

    /// How many rollups.
    pub fn len(&self) -> usize {
        self.nodes.len()
    }

    /// No rollups.
    pub fn is_empty(&self) -> bool {
        self.nodes.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const M: i64 = MINUTE_MICROS;

    fn temp(id: &str, at: i64, value: i64, healthy: bool) -> Observation {
        let mut o = Observation::new(id, "n1", at, "temperature").gpu("GPU-a").field("value", value);
        o.healthy = healthy;
        o
    }

    fn ecc(id: &str, at: i64, aggregate: i64) -> Observation {
        let mut o = Observation::new(id, "n1", at, "ecc").gpu("GPU-a").field("single_bit_aggregate", aggregate);
        o.healthy = true;
        o
    }

    #[test]
    fn a_minute_keeps_min_max_and_the_last_reading_by_event_time() {
        let mut k = Keeper::new(Policy::Evidence);
        for (i, (at, v)) in [(1, 61), (5, 70), (3, 58), (9, 64)].into_iter().enumerate() {
            k.keep(&temp(&i.to_string(), at * 1_000_000, v, true), Bearing::default());
        }
        let all = k.drain();
        assert_eq!(all.len(), 1);
        let (key, r) = &all[0];
        assert_eq!(key, &("n1".to_owned(), "GPU-a".to_owned(), "temperature".to_owned(), 0));
        assert_eq!(r.events, 4);
        assert_eq!(r.readings["value"], Reading { min: 58.0, max: 70.0, last: 64.0 });
        assert_eq!(r.last_at, 9_000_000);
        assert!(r.counters.is_empty(), "a temperature is no counter");
    }

    #[test]
    fn counters_count_their_growth_across_minutes_and_resets() {
        let mut k = Keeper::new(Policy::Evidence);
        // First reading: a baseline, no growth. Then +2, +0, a reset to 1 (grew by 1), +4.
        for (i, (at, v)) in
            [(0, 10), (20 * M / 60, 12), (M + 1, 12), (M + 2, 1), (2 * M + 1, 5)].into_iter().enumerate()
        {
            k.keep(&ecc(&i.to_string(), at, v), Bearing::default());
        }
        let by_minute: BTreeMap<i64, Rollup> = k.drain().into_iter().map(|(k, r)| (k.3, r)).collect();
        assert_eq!(by_minute[&0].counters["single_bit_aggregate"], 2);
        assert_eq!(by_minute[&M].counters["single_bit_aggregate"], 1, "12 -> 12 is none, 12 -> 1 is a reset");
        assert_eq!(by_minute[&(2 * M)].counters["single_bit_aggregate"], 4);
        assert_eq!(by_minute[&M].readings["single_bit_aggregate"], Reading { min: 1.0, max: 12.0, last: 1.0 });
    }

    #[test]
    fn fields_are_a_json_object_and_share_their_names_across_rollups() {
        let mut k = Keeper::new(Policy::Evidence);
        k.keep(&temp("a", 1, 60, true), Bearing::default());
        let mut other = temp("b", 2, 61, true);
        other.gpu = Some("GPU-b".into());
        k.keep(&other, Bearing::default());
        let all = k.drain();
        assert_eq!(all.len(), 2);
        assert!(Arc::ptr_eq(&all[0].1.readings.0[0].0, &all[1].1.readings.0[0].0), "one `value` for both");
        assert_eq!(
            serde_json::to_string(&all[0].1.readings).unwrap(),
            r#"{"value":{"min":60.0,"max":60.0,"last":60.0}}"#
        );
        assert_eq!(serde_json::to_string(&all[0].1.counters).unwrap(), "{}");
        assert_eq!(all[1].1.readings.get("value"), Some(&Reading { min: 61.0, max: 61.0, last: 61.0 }));
        assert_eq!(all[1].1.readings.get("other"), None);
    }

    #[test]
    fn counter_growth_from_nothing_a_step_and_a_reset() {
        assert_eq!(counter_growth(None, 7), 0);
        assert_eq!(counter_growth(Some(7), 7), 0);
        assert_eq!(counter_growth(Some(7), 9), 2);
        assert_eq!(counter_growth(Some(7), 3), 3);
        assert_eq!(counter_growth(Some(i64::MIN), i64::MAX), i64::MAX, "saturates");
    }

    #[test]
    fn what_is_kept_under_evidence() {
        let mut k = Keeper::new(Policy::Evidence);
        let none = Bearing::default();
        assert!(k.keep(&temp("a", 0, 60, true), none), "the first of its GPU and kind");
        assert!(!k.keep(&temp("b", 1, 61, true), none), "a plain healthy reading");
        assert!(k.keep(&temp("c", 2, 99, false), none), "unhealthy");
        assert!(k.keep(&temp("d", 3, 60, true), none), "back to normal");
        assert!(!k.keep(&temp("e", 4, 60, true), none));
        let evidence = Bearing { evidence: true, ..Default::default() };
        assert!(k.keep(&temp("f", 5, 60, true), evidence), "evidence for an incident");
        // The key's next period begins at its own phase (Keeper::period), within a period of 0.
        let digest = key_digest("n1", "GPU-a", "temperature");
        let boundary = (k.period(digest, 0) + 1) * MAX_KEYFRAME_MICROS - k.period_phase(digest);
        assert!(boundary > 5 && boundary <= MAX_KEYFRAME_MICROS);
        assert!(!k.keep(&temp("g", boundary - 1, 60, true), none), "just before: not yet a keyframe");
        let later = boundary;
        assert!(k.keep(&temp("g", later, 60, true), none), "the first of the next keyframe period");
        assert!(!k.keep(&temp("h", later + 1, 60, true), none));
        let mut other = temp("i", later + 2, 60, true);
        other.gpu = Some("GPU-b".into());
        assert!(k.keep(&other, none), "another GPU's first");
        assert!(Keeper::new(Policy::All).keep(&temp("j", 8, 60, true), none));
    }

    #[test]
    fn keyframes_spread_over_the_period_not_all_after_one_boundary() {
        // 2,000 GPUs reporting every minute for three hours, keyframes every hour: after the
        // first of each (kept at start), each GPU's keyframe falls in a minute of its own phase.
        let mut k = Keeper::for_rebuild_window(Policy::Evidence, std::time::Duration::from_secs(8 * 3600));
        assert_eq!(k.keyframe, 60 * MINUTE_MICROS);
        let none = Bearing::default();
        let gpus = 2_000;
        let mut per_minute = vec![0u32; 180];
        for minute in 0..180i64 {
            for g in 0..gpus {
                let mut o = Observation::new("r", format!("node-{g}"), minute * MINUTE_MICROS + g, "temperature")
                    .gpu("GPU-0")
                    .field("value", 60);
                o.healthy = true;
                if k.keep(&o, none) && minute > 0 {
                    per_minute[minute as usize] += 1;
                }
            }
            k.closed(usize::MAX);
        }
        // One keyframe per GPU in each of the two full hours after the first minute, and in
        // the third hour's minutes up to each GPU's phase.
        let after_start: u32 = per_minute.iter().sum();
        assert!(after_start >= 2 * gpus as u32 && after_start <= 3 * gpus as u32, "{after_start}");
        // Evenly spread: 2,000 over 60 minutes is about 33 a minute. Aligned periods put all
        // 2,000 into the minute after each hour.
        let most = *per_minute.iter().max().unwrap();
        assert!(most <= 100, "at most {most} keyframes in one minute: {per_minute:?}");
    }

    #[test]
    fn after_a_rebuild_a_key_recorded_in_this_period_is_not_a_first_again() {
        let none = Bearing::default();
        let mut k = Keeper::new(Policy::Evidence);
        let digest = key_digest("n1", "GPU-a", "temperature");
        let boundary = MAX_KEYFRAME_MICROS - k.period_phase(digest);
        assert!(boundary > 10);
        // Replayed: a healthy reading at 1, then an unhealthy one of another GPU.
        k.recorded(&temp("a", 1, 60, true));
        let mut hot = temp("b", 2, 99, false);
        hot.gpu = Some("GPU-b".into());
        k.recorded(&hot);
        assert!(!k.keep(&temp("c", 3, 60, true), none), "its keyframe of this period is recorded");
        assert!(k.keep(&temp("d", boundary, 60, true), none), "the next period's is due as before");
        let mut cooled = temp("e", 4, 60, true);
        cooled.gpu = Some("GPU-b".into());
        assert!(k.keep(&cooled, none), "the crossing back after a recorded unhealthy reading");
        let mut other = temp("f", 5, 60, true);
        other.gpu = Some("GPU-c".into());
        assert!(k.keep(&other, none), "a key with nothing recorded is still a first");

        // A counter's growth from its last recorded value is counted across the restart.
        let mut k = Keeper::new(Policy::Evidence);
        k.recorded(&ecc("g", 1, 10));
        k.keep(&ecc("h", 2, 13), none);
        let rollups = k.drain();
        assert_eq!(rollups.len(), 1, "replayed events are not rolled up again");
        assert_eq!(rollups[0].1.events, 1);
        assert_eq!(rollups[0].1.counters["single_bit_aggregate"], 3);
    }

    #[test]
    fn rollups_close_a_minute_and_a_grace_after_their_end() {
        let mut k = Keeper::new(Policy::Evidence);
        k.keep(&temp("a", 10, 60, true), Bearing::default());
        k.keep(&temp("b", M + 10, 60, true), Bearing::default());
        assert!(k.closed(ROLLUPS_PER_BATCH).is_empty(), "the grace has not passed");
        k.keep(&temp("c", 2 * M + 10, 60, true), Bearing::default());
        let closed = k.closed(ROLLUPS_PER_BATCH);
        assert_eq!(closed.iter().map(|(k, _)| k.3).collect::<Vec<_>>(), vec![0]);
        assert_eq!(k.drain().len(), 2);
    }

    #[test]
    fn a_ten_minute_period_folds_ten_heartbeats_into_one_rollup_and_closes_a_grace_after_it() {
        let mut k = Keeper::new(Policy::Evidence).with_rollup_period(std::time::Duration::from_secs(600));
        // One reading a minute, from 12 minutes past the first period's start (xx:00) to 25 past.
        for minute in 12..=25 {
            k.keep(&temp(&minute.to_string(), minute * M + 5, 50 + minute, true), Bearing::default());
        }
        // The newest event time is 25 past: the period from 10 to 20 ended 5 minutes ago, more
        // than its grace.
        let closed = k.closed(ROLLUPS_PER_BATCH);
        assert_eq!(closed.len(), 1, "one rollup for the period from 10 to 20: {closed:?}");
        let (key, r) = &closed[0];
        assert_eq!(key.3, 10 * M, "keyed by the period's start");
        assert_eq!((r.period, r.events), (10 * M, 8), "12 to 19 past");
        assert_eq!(r.readings["value"], Reading { min: 62.0, max: 69.0, last: 69.0 });
        // 20 to 25 past stays open until a minute after 30 past.
        k.keep(&temp("30", 30 * M + 59_000_000, 70, true), Bearing::default());
        assert!(k.closed(ROLLUPS_PER_BATCH).is_empty(), "the grace has not passed");
        k.keep(&temp("31", 31 * M, 70, true), Bearing::default());
        let closed = k.closed(ROLLUPS_PER_BATCH);
        assert_eq!(closed.iter().map(|(k, r)| (k.3, r.events)).collect::<Vec<_>>(), [(20 * M, 6)]);
    }

    #[test]
    fn a_start_snapshots_rollup_is_handed_out_at_once_and_the_rest_of_its_period_when_it_closes() {
        let mut k = Keeper::new(Policy::Evidence).with_rollup_period(std::time::Duration::from_secs(600));
        let none = Bearing::default();
        let snapshot = |mut o: Observation| {
            o.start_snapshot = true;
            o
        };
        assert!(k.keep(&snapshot(ecc("s", 10, 4).field("single_bit_volatile", 1)), none), "the key's first");
        let first = k.closed(ROLLUPS_PER_BATCH);
        assert_eq!(first.len(), 1, "handed out before its period closes: {first:?}");
        let (key, r) = &first[0];
        assert_eq!(key, &("n1".to_owned(), "GPU-a".to_owned(), "ecc".to_owned(), 0));
        assert_eq!((r.period, r.events, r.last_at), (10 * M, 1, 10));
        assert_eq!(r.readings["single_bit_aggregate"], Reading { min: 4.0, max: 4.0, last: 4.0 });
        assert_eq!(r.counters["single_bit_aggregate"], 0, "a baseline");
        assert_eq!(k.footprint().rollups, 0);

        // The key's later readings of the period are held until it closes, their growth counted
        // from the snapshot's values.
        assert!(!k.keep(&ecc("a", 2 * M, 6), none));
        assert!(!k.keep(&ecc("b", 3 * M, 5), none));
        assert!(k.closed(ROLLUPS_PER_BATCH).is_empty(), "the period is open");
        // A plain first reading of a key (not a snapshot's) waits for its period as before.
        assert!(k.keep(&temp("t", 4 * M, 60, true), none));
        assert!(k.closed(ROLLUPS_PER_BATCH).is_empty(), "the period is open");
        k.keep(&snapshot(temp("u", 11 * M + 1, 61, true)), none);
        assert!(k.closed(0).is_empty(), "the writer is full: nothing handed out");
        assert_eq!(k.footprint().rollups, 3, "the closed period's two and the snapshot's wait");
        let rest = k.closed(ROLLUPS_PER_BATCH);
        let keys: Vec<_> = rest.iter().map(|(key, r)| (key.2.as_str(), key.3, r.events)).collect();
        assert_eq!(keys, [("ecc", 0, 2), ("temperature", 0, 1), ("temperature", 10 * M, 1)]);
        let r = &rest[0].1;
        assert_eq!(r.readings["single_bit_aggregate"], Reading { min: 5.0, max: 6.0, last: 5.0 });
        assert_eq!(r.counters["single_bit_aggregate"], 2 + 5, "4 -> 6, then a reset to 5");
        assert!(r.counters.get("single_bit_volatile").is_none(), "reported only by the snapshot");

        // The two rows merged as the table merges them: the period counts every event once.
        let mut whole = first[0].1.clone();
        whole.merge(r.clone());
        assert_eq!(whole.events, 3);
        assert_eq!(whole.readings["single_bit_aggregate"], Reading { min: 4.0, max: 6.0, last: 5.0 });
        assert_eq!(whole.readings["single_bit_volatile"], Reading { min: 1.0, max: 1.0, last: 1.0 });
        assert_eq!(whole.counters["single_bit_aggregate"], 7);

        // A snapshot's reading in a period its key already has open adds to that rollup.
        let mut k = Keeper::new(Policy::Evidence);
        k.keep(&temp("before", 10, 60, true), none);
        k.keep(&snapshot(temp("restart", 20, 61, true)), none);
        assert!(k.closed(ROLLUPS_PER_BATCH).is_empty(), "added to the open rollup");
        assert_eq!(k.drain().iter().map(|(_, r)| r.events).collect::<Vec<_>>(), [2]);
    }

    #[test]
    fn a_rollup_period_is_whole_minutes_that_divide_an_hour() {
        let secs = std::time::Duration::from_secs;
        for ok in [60, 120, 300, 600, 900, 1800, 3600] {
            assert_eq!(check_rollup_period(secs(ok)), Ok(()), "{ok} s");
        }
        for bad in [0, 30, 90, 420, 7200] {
            assert!(check_rollup_period(secs(bad)).is_err(), "{bad} s");
        }
        assert!(check_rollup_period(std::time::Duration::from_millis(60_500)).is_err());
        assert!(check_rollup_period(gpumedic_runtime::config::parse_duration(DEFAULT_ROLLUP_PERIOD).unwrap()).is_ok());
    }

    #[test]
    fn a_batch_writes_about_as_many_rollups_as_it_has_events() {
        assert_eq!(rollups_for_batch(1), ROLLUPS_MIN_PER_BATCH);
        assert_eq!(rollups_for_batch(3_000), 3_000);
        assert_eq!(rollups_for_batch(100_000), ROLLUPS_PER_BATCH);
    }

    #[test]
    fn a_large_closed_minute_is_handed_out_a_few_rollups_at_a_time() {
        let mut k = Keeper::new(Policy::Evidence);
        for gpu in 0..5 {
            let mut o = temp(&gpu.to_string(), 10, 60, true);
            o.gpu = Some(format!("GPU-{gpu}"));
            k.keep(&o, Bearing::default());
        }
        assert!(k.closed(2).is_empty(), "still open");
        k.keep(&temp("late", 2 * M + 10, 60, true), Bearing::default());
        let gpus = |batch: Vec<(RollupKey, Rollup)>| batch.into_iter().map(|(k, _)| k.1).collect::<Vec<_>>();
        assert_eq!(gpus(k.closed(2)), ["GPU-0", "GPU-1"]);
        assert_eq!(gpus(k.closed(2)), ["GPU-2", "GPU-3"]);
        assert_eq!(gpus(k.drain()), ["GPU-4", "GPU-a"], "the closed rest, then the open minute");
        assert!(k.closed(2).is_empty());
    }

    #[test]
    fn a_closed_minute_is_handed_out_node_by_node_in_key_order_whatever_the_step() {
        let fill = |k: &mut Keeper| {
            for node in ["n3", "n1", "n2"] {
                for gpu in ["GPU-b", "GPU-a"] {
                    let mut o = temp("e", 10, 60, true);
                    (o.node, o.gpu) = (node.into(), Some(gpu.into()));
                    k.keep(&o, Bearing::default());
                }
            }
            k.keep(&temp("late", 2 * M + 10, 60, true), Bearing::default());
        };
        let keys = |rows: Vec<(RollupKey, Rollup)>| rows.into_iter().map(|(k, _)| (k.0, k.1)).collect::<Vec<_>>();
        let mut whole = Keeper::new(Policy::Evidence);
        fill(&mut whole);
        let all = keys(whole.closed(ROLLUPS_PER_BATCH));
        assert_eq!(all.len(), 6);
        assert!(all.windows(2).all(|w| w[0] < w[1]), "in key order: {all:?}");
        for step in [1, 2, 4] {
            let mut k = Keeper::new(Policy::Evidence);
            fill(&mut k);
            let mut got = Vec::new();
            loop {
                let batch = keys(k.closed(step));
                assert!(batch.len() <= step);
                if batch.is_empty() {
                    break;
                }
                got.extend(batch);
            }
            assert_eq!(got, all, "{step} at a time");
        }
    }

    #[test]
    fn a_minute_taken_as_closed_but_not_handed_out_survives_a_rebalance() {
        // The rollup writer's queue is full: the batch takes the closed minute as closed (none
        // handed out), then the node's partition goes to another replica.
        let mut k = Keeper::new(Policy::Evidence);
        let mut other = temp("x", 10, 60, true);
        other.node = "n2".into();
        k.keep(&other, Bearing::default());
        k.keep(&temp("a", 10, 60, true), Bearing::default());
        k.keep(&temp("late", 2 * M + 10, 60, true), Bearing::default());
        assert!(k.closed(0).is_empty());
        k.retain_nodes(|node| node == "n1");
        let nodes: Vec<String> = k.closed(ROLLUPS_PER_BATCH).into_iter().map(|(key, _)| key.0).collect();
        assert_eq!(nodes, ["n1", "n2"], "the closed minute of the node given away is still written");
    }

    #[test]
    fn a_period_closed_again_by_a_late_event_is_handed_out_once_merged() {
        // Two GPUs closed; the writer takes one, then a late event for the other GPU's closed
        // minute opens it again, and it closes again before the first close is all handed out.
        let mut k = Keeper::new(Policy::Evidence);
        let mut b = temp("b1", 10, 50, true);
        b.gpu = Some("GPU-b".into());
        k.keep(&temp("a1", 10, 60, true), Bearing::default());
        k.keep(&b, Bearing::default());
        k.keep(&temp("late", 2 * M + 10, 60, true), Bearing::default());
        assert_eq!(k.closed(1).len(), 1, "GPU-a handed out, GPU-b still waits");
        let mut b_late = temp("b2", 20, 70, true);
        b_late.gpu = Some("GPU-b".into());
        k.keep(&b_late, Bearing::default());
        let closed = k.closed(ROLLUPS_PER_BATCH);
        let keys: Vec<_> = closed.iter().map(|(key, _)| (key.1.as_str(), key.3)).collect();
        assert_eq!(keys, [("GPU-b", 0)], "one row per key in a hand-out (a statement cannot update a row twice)");
        let r = &closed[0].1;
        assert_eq!(r.events, 2);
        assert_eq!(r.readings["value"], Reading { min: 50.0, max: 70.0, last: 70.0 });
    }

    #[test]
    fn each_counter_has_its_own_place_in_a_track() {
        for (kind, field) in COUNTER_FIELDS {
            let slot = counter_slot(kind, field).expect("every counter has a place");
            let mut others = COUNTER_FIELDS.iter().filter(|(k, f)| k == kind && f != field);
            assert!(others.all(|(k, f)| counter_slot(k, f) != Some(slot)), "{kind}.{field} shares its place");
        }
        assert_eq!(counter_slot("ecc", "made_up"), None);
        assert_eq!(counter_slot("temperature", "value"), None, "pcie_replay's value is a counter, not every value");
        let mut counters = Counters::default();
        assert_eq!(counter_step(&mut counters, 3, 7), 0, "the first value is no growth");
        assert_eq!(counter_step(&mut counters, 0, 5), 0, "nor another counter's first");
        assert_eq!(counter_step(&mut counters, 3, 9), 2);
        assert_eq!(counter_step(&mut counters, 0, 1), 1, "a reset: it grew by its value");
        assert!(COUNTER_FIELDS.iter().all(|(kind, _)| counts(kind)));
        assert!(!counts("temperature"), "a kind with no counter has no place for counters");
    }

    #[test]
    fn merged_rollups_add_counts_and_growth_and_keep_the_later_last_value() {
        let mut names = Names::default();
        let mut counters = Counters::default();
        let (mut early, mut late) = (OpenRollup::default(), OpenRollup::default());
        early.add(&ecc("e1", 5, 10), 5, Some(&mut counters), &mut names);
        early.add(&ecc("e2", 9, 13), 9, Some(&mut counters), &mut names);
        late.add(&ecc("e3", 30, 14), 30, Some(&mut counters), &mut names);
        let mut early = early.rollup(M, &names);
        early.merge(late.rollup(10 * M, &names));
        assert_eq!((early.events, early.last_at, early.period), (3, 30, 10 * M));
        assert_eq!(early.readings["single_bit_aggregate"], Reading { min: 10.0, max: 14.0, last: 14.0 });
        assert_eq!(early.counters["single_bit_aggregate"], 4, "3 then 1");
    }

    #[test]
    fn an_open_rollup_and_a_key_name_their_gpu_kind_and_fields_by_place() {
        // What a node holds per key and per open rollup, some 80 of each (docs/benchmarks.md).
        assert_eq!(std::mem::size_of::<OpenRollup>(), 48);
        assert_eq!(std::mem::size_of::<Track>(), 24);
        assert_eq!(std::mem::size_of::<(u32, Reading)>(), 32);
        // Two GPUs of two nodes and two kinds: each node's keys in the order first seen, each
        // rollup naming its own key.
        let mut k = Keeper::new(Policy::Evidence);
        for (node, gpu, kind) in [("n1", "GPU-a", "temperature"), ("n2", "GPU-b", "ecc"), ("n1", "GPU-b", "ecc")] {
            let mut o = temp("e", 10, 60, true);
            (o.node, o.gpu, o.kind) = (node.into(), Some(gpu.into()), kind.into());
            if kind == "ecc" {
                o = o.field("single_bit_aggregate", 3);
            }
            k.keep(&o, Bearing::default());
        }
        let n1 = &k.nodes["n1"];
        assert_eq!((n1.keys.len(), n1.gpus.len(), n1.counters.len()), (2, 2, 1), "ecc counts, temperature not");
        // The temperature's `value`; each ECC rollup's `value` and counter, and the counter's growth.
        let held = Footprint { nodes: 2, keys: 3, counting_keys: 2, rollups: 3, fields: 7 };
        assert_eq!(k.footprint(), held);
        let keys: Vec<(String, String, String)> = k.drain().into_iter().map(|(key, _)| (key.0, key.1, key.2)).collect();
        let want = [("n1", "GPU-a", "temperature"), ("n1", "GPU-b", "ecc"), ("n2", "GPU-b", "ecc")];
        assert_eq!(keys, want.map(|(n, g, k)| (n.to_owned(), g.to_owned(), k.to_owned())));
    }

    #[test]
    fn the_keyframe_period_follows_the_rebuild_window() {
        let hour = std::time::Duration::from_secs(3600);
        let none = Bearing::default();
        let mut k = Keeper::for_rebuild_window(Policy::Evidence, hour * 2);
        let quarter = 15 * MINUTE_MICROS;
        assert_eq!(k.keyframe, quarter, "a quarter of an hour: 2h / 8");
        assert!(k.keep(&temp("a", 0, 60, true), none));
        // The key's periods begin at its own phase: one a quarter of an hour after the next.
        let boundary = quarter - k.period_phase(key_digest("n1", "GPU-a", "temperature"));
        assert!(boundary > 1);
        assert!(!k.keep(&temp("b", boundary - 1, 60, true), none));
        assert!(k.keep(&temp("c", boundary, 60, true), none));
        assert!(!k.keep(&temp("d", boundary + quarter - 1, 60, true), none));
        assert!(k.keep(&temp("e", boundary + quarter, 60, true), none));
        assert_eq!(Keeper::for_rebuild_window(Policy::Evidence, hour * 480).keyframe, MAX_KEYFRAME_MICROS);
        assert_eq!(Keeper::for_rebuild_window(Policy::Evidence, hour / 600).keyframe, MINUTE_MICROS);
    }

    #[test]
    fn the_flag_values() {
        assert_eq!(Policy::parse("evidence"), Ok(Policy::Evidence));
        assert_eq!(Policy::parse("all"), Ok(Policy::All));
        assert!(Policy::parse("some").is_err());
        assert_eq!(Policy::default().as_str(), "evidence");
    }
}
