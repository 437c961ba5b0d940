//! What the engine knows about one node beyond its rules' state: its boot, its GPUs and their
//! names, the resets it has seen, and the last value of each counter. These are the facts that
//! proofs of repair ([`Proof`](super::model::Proof)) and input sanity ([`super::sanity`]) are
//! judged against.
//!
//! Every collection is bounded by [`MAX_GPUS`] entries (a node has at most a few dozen GPUs), so
//! a stream of made-up GPU names cannot grow the state.

use std::collections::{BTreeMap, BTreeSet, VecDeque};

use serde::{Deserialize, Serialize};

use super::id::Id;
use super::model::normalise_key;
use super::observation::{FieldValue, Observation};

/// The most GPUs remembered per node; beyond it the oldest-named entries give way.
pub const MAX_GPUS: usize = 64;

/// How many earlier boot ids are remembered, to recognise one that comes back.
const OLD_BOOTS: usize = 8;

/// How many recent Xid lines are remembered to recognise one exception logged as several lines.
const RECENT_LINES: usize = 64;

/// Counters that persist across GPU resets and reboots (kept in the GPU's InfoROM): they never
/// go down on the same GPU.
pub const PERSISTENT_COUNTERS: &[(&str, &str)] = &[
    ("ecc", "single_bit_aggregate"),
    ("ecc", "double_bit_aggregate"),
    ("retired_pages", "total"),
    ("row_remap", "correctable"),
    ("row_remap", "uncorrectable"),
];

/// Counters that start again from zero when the GPU is reset: one going down is a reset.
pub const VOLATILE_COUNTERS: &[(&str, &str)] = &[("ecc", "single_bit_volatile"), ("ecc", "double_bit_volatile")];

/// Every counter [`NodeFacts::counters`] keeps, in the order of their `kind.field` names (so a
/// GPU's counters list as their names sort); a counter is held by its place here.
const COUNTERS: [(&str, &str); 7] = [
    ("ecc", "double_bit_aggregate"),
    ("ecc", "double_bit_volatile"),
    ("ecc", "single_bit_aggregate"),
    ("ecc", "single_bit_volatile"),
    ("retired_pages", "total"),
    ("row_remap", "correctable"),
    ("row_remap", "uncorrectable"),
];

/// The place of `kind.field` in [`COUNTERS`].
fn counter_index(kind: &str, field: &str) -> Option<u8> {
    COUNTERS.iter().position(|(k, f)| *k == kind && *f == field).and_then(|i| u8::try_from(i).ok())
}

/// The last value of each counter, by GPU and counter: a GPU named by [`Id`] and a counter by its
/// place in [`COUNTERS`], so a node's few dozen counters copy no string (they were keyed by
/// `GPU\u{1f}kind.field` strings, some 5 KB a node). Each GPU's counters are one row of values
/// in a list sorted by GPU: 88 bytes a GPU, where a map entry per counter took some 3.8 KB a node
/// of 8 GPUs (48 counters in a B-tree's nodes, measured with `classifier-state`). At most
/// [`MAX_GPUS`] GPUs; beyond it the first in order gives way. It serialises as the strings did, in
/// the same order.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Counters(Vec<(Id, GpuCounters)>);

/// One GPU's counters: the last value of each of [`COUNTERS`], where `held` has its bit.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
struct GpuCounters {
    held: u8,
    values: [i64; COUNTERS.len()],
}

impl GpuCounters {
    fn get(&self, i: u8) -> Option<i64> {
        (self.held & (1 << i) != 0).then(|| self.values[usize::from(i)])
    }

    /// Each held counter's place and value, in the order of [`COUNTERS`].
    fn held(&self) -> impl Iterator<Item = (u8, i64)> + '_ {
        (0..COUNTERS.len() as u8).filter_map(|i| self.get(i).map(|v| (i, v)))
    }
}

impl Counters {
    /// The last value of `kind.field` on `gpu`.
    pub fn get(&self, gpu: &Id, kind: &str, field: &str) -> Option<i64> {
        counter_index(kind, field).and_then(|i| self.value(gpu, i))
    }

    /// The last value of the counter at `i` in [`COUNTERS`] on `gpu`.
    fn value(&self, gpu: &Id, i: u8) -> Option<i64> {
        let at = self.0.binary_search_by(|(g, _)| g.cmp(gpu)).ok()?;
        self.0[at].1.get(i)
    }

    /// Sets the counter at `i` in [`COUNTERS`] on `gpu`; a GPU new beyond [`MAX_GPUS`] takes the
    /// place of the first in order.
    fn set(&mut self, gpu: &Id, i: u8, value: i64) {
        let at = match self.0.binary_search_by(|(g, _)| g.cmp(gpu)) {
            Ok(at) => at,
            Err(mut at) => {
                if self.0.len() >= MAX_GPUS {
                    self.0.remove(0);
                    at = at.saturating_sub(1);
                }
                crate::tight::insert(&mut self.0, at, (gpu.clone(), GpuCounters::default()));
                at
            }
        };
        let row = &mut self.0[at].1;
        row.held |= 1 << i;
        row.values[usize::from(i)] = value;
    }

    /// How many are kept.
    pub fn len(&self) -> usize {
        self.0.iter().map(|(_, row)| row.held.count_ones() as usize).sum()
    }

    /// True when none is kept.
    pub fn is_empty(&self) -> bool {
        self.0.iter().all(|(_, row)| row.held == 0)
    }

    fn clear(&mut self) {
        self.0 = Vec::new();
    }

    /// Every counter's GPU, place and value, in order of GPU and place.
    fn iter(&self) -> impl Iterator<Item = (&Id, u8, i64)> + '_ {
        self.0.iter().flat_map(|(gpu, row)| row.held().map(move |(i, v)| (gpu, i, v)))
    }
}

impl Serialize for Counters {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.collect_map(self.iter().map(|(gpu, i, v)| {
            let (kind, field) = COUNTERS[usize::from(i)];
            (NodeFacts::counter_key(&gpu.to_string(), kind, field), v)
        }))
    }
}

impl<'de> Deserialize<'de> for Counters {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Counters, D::Error> {
        let named = BTreeMap::<String, i64>::deserialize(deserializer)?;
        // A counter this release does not keep is left out, as `learn` would not have kept it.
        let mut counters = Counters::default();
        for (key, v) in named {
            let Some((gpu, name)) = key.split_once('\u{1f}') else { continue };
            let Some(i) = name.split_once('.').and_then(|(kind, field)| counter_index(kind, field)) else { continue };
            counters.set(&Id::new(gpu), i, v);
        }
        Ok(counters)
    }
}

/// A GPU's other names, for verdicts.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct GpuNames {
    /// The NVML index.
    pub index: Option<i32>,
    /// The PCI bus id.
    pub pci: Option<String>,
}

/// The facts of one node.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct NodeFacts {
    /// The current boot id.
    pub boot: Option<String>,
    /// When (node time) the node was last seen to reboot: a boot id that replaced another.
    pub rebooted_at: Option<i64>,
    /// Earlier boot ids, oldest first.
    pub old_boots: VecDeque<String>,
    /// The latest reset evidence per GPU (node time).
    pub resets: BTreeMap<Id, i64>,
    /// The GPUs in the latest inventory.
    pub present: BTreeSet<Id>,
    /// How many GPUs the latest inventory found missing, when it could tell.
    pub missing: Option<i64>,
    /// Each GPU's index and PCI bus id, by canonical identity.
    pub names: BTreeMap<Id, GpuNames>,
    /// The last value of each counter, by GPU and `kind.field`.
    pub counters: Counters,
    /// Digests and times of recent Xid lines, oldest first.
    #[serde(default)]
    pub lines: VecDeque<(u64, i64)>,
}

/// A stable digest (FNV-1a) of the parts that make one Xid exception.
fn line_digest(parts: &[&str]) -> u64 {
    parts
        .iter()
        .flat_map(|p| p.bytes().chain([0x1f]))
        .fold(0xcbf2_9ce4_8422_2325, |h, b| (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3))
}

fn bounded_insert<K: Ord, V>(map: &mut BTreeMap<K, V>, key: K, value: V) {
    if !map.contains_key(&key) && map.len() >= MAX_GPUS * 4 {
        map.pop_first();
    }
    map.insert(key, value);
}

fn int(o: &Observation, field: &str) -> Option<i64> {
    match o.fields.get(field) {
        Some(FieldValue::Int(i)) => Some(*i),
        Some(FieldValue::Float(f)) if f.is_finite() => Some(*f as i64),
        _ => None,
    }
}

impl NodeFacts {
    /// The key of a counter in [`NodeFacts::counters`].
    pub fn counter_key(gpu: &str, kind: &str, field: &str) -> String {
        format!("{gpu}\u{1f}{kind}.{field}")
    }

    /// True when `boot_id` is one this node has already left behind (a boot id going backwards).
    pub fn is_old_boot(&self, boot_id: &str) -> bool {
        self.boot.as_deref() != Some(boot_id) && self.old_boots.iter().any(|b| b == boot_id)
    }

    /// True when `o` repeats an Xid line already seen: the same GPU, code, process and recovery
    /// action within the same second is one exception that the driver logged as several lines.
    /// Remembers `o` otherwise.
    pub fn repeats_line(&mut self, o: &Observation) -> bool {
        if o.kind != "xid" && o.kind != "sxid" {
            return false;
        }
        let text = |f: &str| o.fields.get(f).map(ToString::to_string).unwrap_or_default();
        let code = o.xid.map(|x| x.to_string()).unwrap_or_default();
        let (pid, process, action) = (text("pid"), text("process"), text("recovery_action"));
        let digest =
            line_digest(&[o.kind.as_str(), o.gpu.as_deref().unwrap_or(""), code.as_str(), &pid, &process, &action]);
        let second = o.observed_at_micros.div_euclid(1_000_000);
        if self.lines.iter().any(|(d, s)| *d == digest && *s == second) {
            return true;
        }
        self.lines.push_back((digest, second));
        while self.lines.len() > RECENT_LINES {
            self.lines.pop_front();
        }
        false
    }

    /// The canonical identity for a GPU reference: a PCI bus id this node's evidence has already
    /// tied to a UUID resolves to the UUID (a second line of defence behind the enricher).
    pub fn canonical(&self, gpu: &str) -> Option<String> {
        self.names.iter().find(|(_, n)| n.pci.as_deref() == Some(gpu)).map(|(uuid, _)| uuid.to_string())
    }

    /// Takes what `o` says about the node, at node time `now`; true when that changed a fact.
    pub fn learn(&mut self, o: &Observation, now: i64) -> bool {
        self.learn_about(o, o.gpu.as_deref().map(Id::new).as_ref(), now)
    }

    /// [`NodeFacts::learn`], with `o`'s GPU already read as an [`Id`] (`gpu`).
    pub fn learn_about(&mut self, o: &Observation, gpu_id: Option<&Id>, now: i64) -> bool {
        let mut changed = false;
        if let Some(boot) = &o.boot_id {
            match &self.boot {
                Some(current) if current == boot => {}
                Some(current) => {
                    changed = true;
                    self.old_boots.push_back(current.clone());
                    while self.old_boots.len() > OLD_BOOTS {
                        self.old_boots.pop_front();
                    }
                    self.boot = Some(boot.clone());
                    self.rebooted_at = Some(now);
                    // A new boot starts every counter and every GPU afresh.
                    self.counters.clear();
                }
                None => {
                    changed = true;
                    self.boot = Some(boot.clone());
                }
            }
        }
        if let Some((gpu, id)) = o.gpu.as_ref().zip(gpu_id)
            && (o.gpu_index.is_some() || o.gpu_pci.is_some())
            && gpu.starts_with("GPU-")
        {
            // Merge: a kernel-log line knows the PCI bus id, NVML the index too. Compared before
            // anything is copied: nearly every observation repeats names already known.
            let known = self.names.get(id);
            let index = o.gpu_index.or(known.and_then(|k| k.index));
            let pci = o.gpu_pci.as_ref().or(known.and_then(|k| k.pci.as_ref()));
            if known.is_none_or(|k| k.index != index || k.pci.as_ref() != pci) {
                changed = true;
                let names = GpuNames { index, pci: pci.cloned() };
                bounded_insert(&mut self.names, id.clone(), names);
            }
        }
        if o.kind == "gpu_inventory" {
            let now_present: BTreeSet<Id> = o.inventory.iter().take(MAX_GPUS).map(|g| Id::new(g)).collect();
            // A GPU back in the inventory after being absent was reset (or the node rebooted).
            if !self.present.is_empty() {
                for gpu in now_present.difference(&self.present) {
                    bounded_insert(&mut self.resets, gpu.clone(), now);
                }
            }
            let missing = int(o, "missing").map(|m| m.max(0));
            changed |= now_present != self.present || missing != self.missing;
            self.present = now_present;
            self.missing = missing;
        }
        if o.kind == "xid"
            && o.xid == Some(154)
            && let Some(gpu) = gpu_id
            && o.fields.get("recovery_action").is_some_and(|a| normalise_key(&a.to_string()) == "none")
        {
            // The driver says the GPU needs nothing more: whatever reset it asked for happened.
            changed = true;
            bounded_insert(&mut self.resets, gpu.clone(), now);
        }
        if let Some(gpu) = gpu_id
            && COUNTERS.iter().any(|(kind, _)| o.kind == *kind)
        {
            for (i, (kind, field)) in COUNTERS.iter().enumerate() {
                if o.kind != *kind {
                    continue;
                }
                let Some(value) = int(o, field) else { continue };
                let last = self.counters.value(gpu, i as u8);
                if VOLATILE_COUNTERS.contains(&(kind, field)) && last.is_some_and(|last| value < last) {
                    // Volatile counters start again from zero on a reset.
                    bounded_insert(&mut self.resets, gpu.clone(), now);
                }
                if last != Some(value) {
                    changed = true;
                    self.counters.set(gpu, i as u8, value);
                }
            }
        }
        changed
    }

    /// True when `gpu` was reset (or the node rebooted) after `since`.
    pub fn reset_since(&self, gpu: &str, since: i64) -> bool {
        self.rebooted_since(since) || self.resets.get(&Id::new(gpu)).is_some_and(|t| *t > since)
    }

    /// True when the node rebooted after `since`.
    pub fn rebooted_since(&self, since: i64) -> bool {
        self.rebooted_at.is_some_and(|t| t > since)
    }

    /// True when the latest inventory found every expected GPU (or none has said otherwise).
    pub fn complete(&self) -> bool {
        self.missing.is_none_or(|m| m == 0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn obs(id: &str, kind: &str) -> Observation {
        Observation::new(id, "n", 0, kind)
    }

    #[test]
    fn a_new_boot_id_is_a_reboot_and_an_old_one_is_recognised() {
        let mut f = NodeFacts::default();
        f.learn(&obs("a", "monitor_health").boot("b1"), 10);
        assert_eq!(f.rebooted_at, None, "the first boot id seen proves nothing");
        f.learn(&obs("b", "monitor_health").boot("b2"), 20);
        assert_eq!(f.rebooted_at, Some(20));
        assert!(f.rebooted_since(15) && !f.rebooted_since(20));
        assert!(f.is_old_boot("b1") && !f.is_old_boot("b2") && !f.is_old_boot("b3"));
        assert!(f.reset_since("GPU-x", 15), "a reboot resets every GPU");
    }

    #[test]
    fn resets_from_inventory_volatile_counters_and_the_drivers_none() {
        let mut f = NodeFacts::default();
        let inv = |id: &str, gpus: &[&str]| {
            let mut o = obs(id, "gpu_inventory");
            o.inventory = gpus.iter().map(|g| g.to_string()).collect();
            o
        };
        f.learn(&inv("i1", &["GPU-a", "GPU-b"]), 1);
        f.learn(&inv("i2", &["GPU-a"]), 2);
        assert!(!f.reset_since("GPU-b", 0));
        f.learn(&inv("i3", &["GPU-a", "GPU-b"]), 3);
        assert!(f.reset_since("GPU-b", 2) && !f.reset_since("GPU-a", 0), "b came back");
        f.learn(&obs("e1", "ecc").gpu("GPU-a").field("double_bit_volatile", 4i64), 4);
        f.learn(&obs("e2", "ecc").gpu("GPU-a").field("double_bit_volatile", 5i64), 5);
        assert!(!f.reset_since("GPU-a", 0));
        f.learn(&obs("e3", "ecc").gpu("GPU-a").field("double_bit_volatile", 0i64), 6);
        assert!(f.reset_since("GPU-a", 5), "fresh counters");
        f.learn(&obs("x", "xid").gpu("GPU-c").xid(154).field("recovery_action", "None"), 7);
        assert!(f.reset_since("GPU-c", 6));
    }

    #[test]
    fn one_exception_logged_as_three_lines_is_one() {
        let mut f = NodeFacts::default();
        let line = |id: &str, t: i64| obs(id, "xid").gpu("GPU-a").xid(13).field("pid", 42i64).at(t);
        assert!(!f.repeats_line(&line("a", 1_000_000)));
        assert!(f.repeats_line(&line("b", 1_000_100)));
        assert!(f.repeats_line(&line("c", 1_000_900)));
        assert!(!f.repeats_line(&line("d", 2_000_000)), "the next second is another exception");
        let other = obs("e", "xid").gpu("GPU-a").xid(13).field("pid", 43i64).at(2_000_000);
        assert!(!f.repeats_line(&other), "another process");
    }

    #[test]
    fn counters_are_held_by_gpu_and_place_and_written_as_their_names_were() {
        let mut names: Vec<String> =
            PERSISTENT_COUNTERS.iter().chain(VOLATILE_COUNTERS).map(|(k, f)| format!("{k}.{f}")).collect();
        names.sort();
        let held: Vec<String> = COUNTERS.iter().map(|(k, f)| format!("{k}.{f}")).collect();
        assert_eq!(held, names, "every counter, in the order of its name");

        let uuid = "GPU-6f2d1c3a-1b2c-4d5e-8f90-0123456789ab";
        let mut f = NodeFacts::default();
        f.learn(&obs("e", "ecc").gpu(uuid).field("double_bit_volatile", 2i64).field("single_bit_aggregate", 5i64), 1);
        f.learn(&obs("r", "row_remap").gpu("GPU-b").field("correctable", 1i64), 2);
        f.learn(&obs("r2", "row_remap").gpu("GPU-a").field("uncorrectable", 3i64), 3);
        assert_eq!(f.counters.get(&Id::new(uuid), "ecc", "single_bit_aggregate"), Some(5));
        assert_eq!(f.counters.get(&Id::new("GPU-b"), "row_remap", "correctable"), Some(1));
        assert_eq!(f.counters.get(&Id::new("GPU-b"), "row_remap", "uncorrectable"), None);

        // Written exactly as the map of `GPU\u{1f}kind.field` strings it replaced.
        let by_name: BTreeMap<String, i64> = [
            (NodeFacts::counter_key(uuid, "ecc", "double_bit_volatile"), 2),
            (NodeFacts::counter_key(uuid, "ecc", "single_bit_aggregate"), 5),
            (NodeFacts::counter_key("GPU-b", "row_remap", "correctable"), 1),
            (NodeFacts::counter_key("GPU-a", "row_remap", "uncorrectable"), 3),
        ]
        .into();
        let json = serde_json::to_string(&f.counters).unwrap();
        assert_eq!(json, serde_json::to_string(&by_name).unwrap());
        assert_eq!(serde_json::from_str::<Counters>(&json).unwrap(), f.counters);

        let mut unknown = by_name.clone();
        unknown.insert(NodeFacts::counter_key("GPU-a", "ecc", "made_up"), 9);
        unknown.insert("no separator".into(), 9);
        let read: Counters = serde_json::from_str(&serde_json::to_string(&unknown).unwrap()).unwrap();
        assert_eq!(read, f.counters, "a counter this release does not keep is left out");

        // One row of values a GPU, in GPU order, whatever the order counters came in.
        assert_eq!(f.counters.0.iter().map(|(g, _)| g.to_string()).collect::<Vec<_>>(), [uuid, "GPU-a", "GPU-b"]);
        assert_eq!(f.counters.len(), 4);
        assert_eq!(std::mem::size_of::<(Id, GpuCounters)>(), 88);
        f.learn(&obs("boot", "gpu_inventory").boot("b1"), 4);
        f.learn(&obs("boot2", "gpu_inventory").boot("b2"), 5);
        assert!(f.counters.is_empty() && f.counters.get(&Id::new(uuid), "ecc", "single_bit_aggregate").is_none());
    }

    #[test]
    fn names_stay_bounded() {
        let mut f = NodeFacts::default();
        for i in 0..10_000 {
            let o = obs("x", "ecc").gpu(format!("GPU-{i}")).field("double_bit_volatile", 1i64);
            let mut o = o;
            o.gpu_index = Some(i);
            f.learn(&o, i64::from(i));
        }
        assert!(f.names.len() <= MAX_GPUS * 4 && f.counters.len() <= MAX_GPUS * 4);
        assert_eq!(f.counters.0.len(), MAX_GPUS, "the GPUs counted");
        assert_eq!(f.counters.get(&Id::new("GPU-9999"), "ecc", "double_bit_volatile"), Some(1), "the latest kept");
    }
}
