//! Per-node GPU inventories and the resolution of an event's GPU reference to one canonical
//! [`GpuIdentity`].
//!
//! One physical GPU goes by several names: the kernel log knows only its PCI bus id, NVML its UUID
//! and index. The collector publishes each node's inventory (`gpu_inventory` events: at start, on
//! change and every 5 minutes) on the raw topic keyed by node, so the enricher instance that owns
//! the node's partition sees the inventory in order with the node's other events. This module keeps
//! the latest inventory of each node and answers, for every event, which GPU it names.
//!
//! A GPU that leaves the inventory (it fell off the bus) is still known by its names for
//! [`InventoryLimits::max_age`] after the inventory without it: the events about its departure
//! (NVML's `gpu_lost`, the kernel log's Xid 79) may reach the enricher after that inventory, since
//! the collector samples NVML and reads the kernel log independently, and they must still name the
//! GPU by its UUID and serial. A GPU the latest inventory lists always comes first: a departed
//! GPU answers only a UUID or a PCI bus id no present GPU has, never an index (NVML renumbers).
//!
//! The cache is owned by the consumer's handler (one task), so it needs no lock; it is bounded in
//! nodes (least recently updated evicted first) and in GPUs per node. Lookups scan the node's few
//! GPUs (64 at most) without allocating; only the one resolved identity is cloned into the output.

use std::collections::{BTreeMap, HashMap};
use std::fmt;

use chrono::{DateTime, TimeDelta, Utc};
use gpumedic_schemas::health::{Component, Entity, GpuIdentity, GpuInventoryDetail};

use crate::events::names;

/// A PCI address (`domain:bus:device.function`), parsed so that every way of writing it compares
/// equal: `0000:1B:00.0`, `00000000:1b:00.0` (NVML), `PCI:0000:1b:00` (the kernel log, function 0).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct PciAddr {
    domain: u32,
    bus: u8,
    device: u8,
    function: u8,
}

impl PciAddr {
    /// Parses `raw`, or `None` when it is not a PCI address. Accepts a `PCI:` prefix, a domain of
    /// 4 to 8 hex digits, either case, and a missing function (0), as the collector's kernel-log
    /// parser does (`services/collector/src/kernel_log/parse.rs`, `normalize_pci`).
    pub fn parse(raw: &str) -> Option<Self> {
        let raw = raw.trim();
        let raw = raw.strip_prefix("PCI:").or_else(|| raw.strip_prefix("pci:")).unwrap_or(raw);
        let raw = raw.trim_end_matches([':', ',', '.']);
        let (main, function) = match raw.rsplit_once('.') {
            Some((m, f)) if (1..=2).contains(&f.len()) => (m, u8::from_str_radix(f, 16).ok()?),
            Some(_) => return None,
            None => (raw, 0),
        };
        let mut parts = main.split(':');
        let (domain, bus, device) = (parts.next()?, parts.next()?, parts.next()?);
        if parts.next().is_some() || !(4..=8).contains(&domain.len()) || bus.len() != 2 || device.len() != 2 {
            return None;
        }
        // from_str_radix takes a leading sign; a PCI address has none.
        if [domain, bus, device].iter().any(|p| !p.bytes().all(|b| b.is_ascii_hexdigit())) {
            return None;
        }
        let domain = u32::from_str_radix(domain, 16).ok()?;
        let bus = u8::from_str_radix(bus, 16).ok()?;
        let device = u8::from_str_radix(device, 16).ok()?;
        // The collector's parser refuses domains above 0xffff; so do we, so both agree on what is
        // a PCI address.
        if domain > 0xffff || function > 7 || device > 0x1f {
            return None;
        }
        Some(Self { domain, bus, device, function })
    }
}

/// The collector's normal form, `dddd:bb:dd.f` in lower case.
impl fmt::Display for PciAddr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:04x}:{:02x}:{:02x}.{:x}", self.domain, self.bus, self.device, self.function)
    }
}

/// `raw` in the collector's normal form (`0000:1b:00.0`), or `None` when it is not a PCI address.
pub fn normalize_pci(raw: &str) -> Option<String> {
    PciAddr::parse(raw).map(|p| p.to_string())
}

/// The cache's bounds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct InventoryLimits {
    /// Most nodes kept; past it the least recently updated node is forgotten.
    pub max_nodes: usize,
    /// Most GPUs kept per node; an inventory listing more keeps the first ones.
    pub max_gpus: usize,
    /// An inventory observed longer than this before an event is not used to resolve it: the node
    /// has stopped refreshing (its collector is down) or its partition moved to another enricher
    /// and back, so the inventory may no longer be true. Three missed 5-minute refreshes.
    ///
    /// A GPU that leaves a node's inventory is still resolved (by UUID or PCI bus id) for as
    /// long after the inventory without it, as an inventory listing it would have been trusted.
    pub max_age: TimeDelta,
}

impl Default for InventoryLimits {
    fn default() -> Self {
        Self { max_nodes: 200_000, max_gpus: 64, max_age: TimeDelta::minutes(15) }
    }
}

/// How one inventory contradicts itself.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Conflict {
    /// Two entries on one PCI bus id (two GPUs cannot share an address).
    SharedPci {
        /// The address.
        pci: String,
        /// The UUIDs the entries give it (`None` where an entry has none).
        uuids: [Option<String>; 2],
    },
    /// One UUID in two entries (with different PCI bus ids or indexes).
    SharedUuid {
        /// The UUID.
        uuid: String,
        /// The PCI bus ids the entries give it.
        pcis: [Option<String>; 2],
    },
    /// Two entries with one NVML index.
    DuplicateIndex {
        /// The index.
        index: i32,
        /// The UUIDs of the entries.
        uuids: [Option<String>; 2],
    },
}

impl Conflict {
    /// The metric label: `shared_pci`, `shared_uuid` or `duplicate_index`.
    pub fn kind(&self) -> &'static str {
        match self {
            Conflict::SharedPci { .. } => "shared_pci",
            Conflict::SharedUuid { .. } => "shared_uuid",
            Conflict::DuplicateIndex { .. } => "duplicate_index",
        }
    }
}

impl fmt::Display for Conflict {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let o = |s: &Option<String>| s.clone().unwrap_or_else(|| "-".to_owned());
        match self {
            Conflict::SharedPci { pci, uuids: [a, b] } => write!(f, "PCI {pci} is given to {} and {}", o(a), o(b)),
            Conflict::SharedUuid { uuid, pcis: [a, b] } => write!(f, "UUID {uuid} is on PCI {} and {}", o(a), o(b)),
            Conflict::DuplicateIndex { index, uuids: [a, b] } => {
                write!(f, "index {index} is given to {} and {}", o(a), o(b))
            }
        }
    }
}

/// Why an event's GPU reference was not resolved.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Unresolved {
    /// No inventory for the node yet (or only one too old to trust).
    NoInventory,
    /// The inventory has no GPU by that name.
    Unknown,
    /// The name leads to an entry of a contradictory inventory, or the event's own names (UUID
    /// and PCI bus id) lead to different GPUs.
    Conflict,
}

impl Unresolved {
    /// Every reason, in the order of [`Unresolved::as_str`]'s labels (for per-batch tallies).
    pub const ALL: [Unresolved; 3] = [Unresolved::NoInventory, Unresolved::Unknown, Unresolved::Conflict];

    /// The metric label: `no_inventory`, `unknown` or `conflict`.
    pub fn as_str(self) -> &'static str {
        match self {
            Unresolved::NoInventory => "no_inventory",
            Unresolved::Unknown => "unknown",
            Unresolved::Conflict => "conflict",
        }
    }
}

/// Which GPU an event names.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Resolution<'a> {
    /// The event names no GPU.
    NoGpu,
    /// The GPU's canonical identity, as the node's inventory gives it (PCI bus id normalised).
    Resolved(&'a GpuIdentity),
    /// The event names a GPU that could not be resolved; it is passed on marked.
    Unresolved(Unresolved),
}

/// What [`InventoryCache::apply`] found in an inventory.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Applied {
    /// Every contradiction; the entries involved are not used for resolution.
    pub conflicts: Vec<Conflict>,
    /// GPUs left out past [`InventoryLimits::max_gpus`].
    pub dropped: usize,
    /// A node forgotten to make room.
    pub evicted: Option<String>,
    /// The conflicts differ from those last logged for the node: the caller logs them (once per
    /// node and set of conflicts, not at every 5-minute refresh).
    pub log_conflicts: bool,
}

#[derive(Debug)]
struct Gpu {
    identity: GpuIdentity,
    pci: Option<PciAddr>,
    conflict: bool,
}

#[derive(Debug)]
struct NodeInventory {
    gpus: Vec<Gpu>,
    /// GPUs an earlier inventory listed and a later one did not, with the observation time of the
    /// first inventory without them; kept for [`InventoryLimits::max_age`], never in conflict.
    departed: Vec<(Gpu, DateTime<Utc>)>,
    observed_at: DateTime<Utc>,
    /// Position in the eviction order.
    seq: u64,
    /// The conflicts last reported for this node, so a refresh repeating them is not logged again.
    logged: Vec<Conflict>,
}

/// The latest GPU inventory of each node, and GPU reference resolution against it.
#[derive(Debug)]
pub struct InventoryCache {
    limits: InventoryLimits,
    nodes: HashMap<String, NodeInventory>,
    /// Update sequence to node: the first entry is the least recently updated node.
    order: BTreeMap<u64, String>,
    next_seq: u64,
}

impl Default for InventoryCache {
    fn default() -> Self {
        Self::new(InventoryLimits::default())
    }
}

impl InventoryCache {
    /// An empty cache with these bounds (`max_nodes` and `max_gpus` at least 1).
    pub fn new(limits: InventoryLimits) -> Self {
        let limits = InventoryLimits { max_nodes: limits.max_nodes.max(1), max_gpus: limits.max_gpus.max(1), ..limits };
        Self { limits, nodes: HashMap::new(), order: BTreeMap::new(), next_seq: 0 }
    }

    /// How many nodes have an inventory.
    pub fn len(&self) -> usize {
        self.nodes.len()
    }

    /// True when no node has an inventory.
    pub fn is_empty(&self) -> bool {
        self.nodes.is_empty()
    }

    /// True when the cache holds an inventory for `node`.
    pub fn contains(&self, node: &str) -> bool {
        self.nodes.contains_key(node)
    }

    /// Replaces `node`'s inventory with `detail`, observed at `observed_at`.
    pub fn apply(&mut self, node: &str, detail: &GpuInventoryDetail, observed_at: DateTime<Utc>) -> Applied {
        let mut applied = Applied::default();
        let mut gpus: Vec<Gpu> = Vec::with_capacity(detail.gpus.len().min(self.limits.max_gpus));
        for identity in &detail.gpus {
            let pci = identity.pci_bus_id.as_deref().and_then(PciAddr::parse);
            let mut identity = identity.clone();
            identity.uuid = identity.uuid.filter(|u| !u.trim().is_empty());
            if let Some(p) = pci {
                identity.pci_bus_id = Some(p.to_string());
            }
            if identity.uuid.is_none() && pci.is_none() && identity.index.is_none() {
                // Nothing an event could name it by.
                continue;
            }
            // A repeated entry says nothing new; only entries that disagree are a conflict.
            if gpus.iter().any(|g| g.identity == identity) {
                continue;
            }
            if gpus.len() == self.limits.max_gpus {
                applied.dropped += 1;
                continue;
            }
            gpus.push(Gpu { identity, pci, conflict: false });
        }
        applied.conflicts = mark_conflicts(&mut gpus);

        let seq = self.next_seq;
        self.next_seq += 1;
        match self.nodes.get_mut(node) {
            Some(existing) => {
                // Reuse the name the order map holds rather than allocate it again.
                let name = self.order.remove(&existing.seq).unwrap_or_else(|| node.to_owned());
                self.order.insert(seq, name);
                applied.log_conflicts = !applied.conflicts.is_empty() && existing.logged != applied.conflicts;
                existing.logged.clone_from(&applied.conflicts);
                let previous = std::mem::replace(&mut existing.gpus, gpus);
                existing.departed = departed(
                    previous,
                    std::mem::take(&mut existing.departed),
                    &existing.gpus,
                    observed_at,
                    self.limits,
                );
                existing.observed_at = observed_at;
                existing.seq = seq;
            }
            None => {
                if self.nodes.len() >= self.limits.max_nodes
                    && let Some((_, oldest)) = self.order.pop_first()
                {
                    self.nodes.remove(&oldest);
                    applied.evicted = Some(oldest);
                }
                applied.log_conflicts = !applied.conflicts.is_empty();
                self.order.insert(seq, node.to_owned());
                self.nodes.insert(
                    node.to_owned(),
                    NodeInventory { gpus, departed: Vec::new(), observed_at, seq, logged: applied.conflicts.clone() },
                );
            }
        }
        applied
    }

    /// The GPU that `entity` names on `node`, for an event of `component` observed at
    /// `observed_at`: by UUID, else by PCI bus id, else by index (only when the event has neither).
    ///
    /// A PCI bus id alone names a GPU on GPU, NVLink, memory and unknown components. On an NVSwitch,
    /// PCIe-fabric, CPU or node event it may be another device's (the switch, a root port), so there
    /// it names a GPU only when the inventory lists it, and is otherwise no GPU reference at all.
    pub fn resolve(
        &self,
        node: &str,
        entity: &Entity,
        component: Component,
        observed_at: DateTime<Utc>,
    ) -> Resolution<'_> {
        let uuid = entity.gpu_uuid.as_deref().map(str::trim).filter(|u| !u.is_empty());
        let pci_text = entity.pci_bus_id.as_deref().map(str::trim).filter(|p| !p.is_empty());
        let pci = pci_text.and_then(PciAddr::parse);
        let pci_is_gpu = !matches!(component, Component::Nvswitch | Component::Pcie | Component::Cpu | Component::Node);
        let names_gpu = uuid.is_some() || entity.gpu_index.is_some() || (pci_text.is_some() && pci_is_gpu);

        let inventory = self
            .nodes
            .get(node)
            .filter(|inv| observed_at.signed_duration_since(inv.observed_at) <= self.limits.max_age);
        let Some(inventory) = inventory else {
            return if names_gpu { Resolution::Unresolved(Unresolved::NoInventory) } else { Resolution::NoGpu };
        };
        let departed = |pred: &dyn Fn(&Gpu) -> bool| {
            inventory
                .departed
                .iter()
                .find(|(g, left)| observed_at.signed_duration_since(*left) <= self.limits.max_age && pred(g))
                .map(|(g, _)| g)
        };
        let found = if let Some(uuid) = uuid {
            let named = |g: &Gpu| g.identity.uuid.as_deref().is_some_and(|u| u.eq_ignore_ascii_case(uuid));
            let found = find(&inventory.gpus, named).or_departed(|| departed(&named));
            // The event's own PCI bus id must agree with the GPU its UUID names.
            match (found, pci) {
                (Found::Gpu(g), Some(p)) if g.pci.is_some_and(|gp| gp != p) => Found::Conflict,
                (found, _) => found,
            }
        } else if pci_text.is_some() {
            match pci {
                Some(p) => {
                    let named = |g: &Gpu| g.pci == Some(p);
                    find(&inventory.gpus, named).or_departed(|| departed(&named))
                }
                // Not a PCI address: it names nothing in any inventory.
                None => Found::None,
            }
            .or_not_a_gpu(pci_is_gpu)
        } else if let Some(index) = entity.gpu_index {
            find(&inventory.gpus, |g| g.identity.index == Some(index))
        } else {
            Found::NotAGpu
        };
        match found {
            Found::Gpu(g) => Resolution::Resolved(&g.identity),
            Found::Conflict => Resolution::Unresolved(Unresolved::Conflict),
            Found::None => Resolution::Unresolved(Unresolved::Unknown),
            Found::NotAGpu => Resolution::NoGpu,
        }
    }
}

/// Counts and logs what applying `node`'s inventory found: every conflict in
/// `gpumedic_enricher_inventory_conflicts_total{kind}` (each time, so a rate shows it persists),
/// the conflicts themselves in the log once per node until they change, GPUs past the cap and
/// evictions.
pub fn report(node: &str, applied: &Applied) {
    for conflict in &applied.conflicts {
        metrics::counter!(names::INVENTORY_CONFLICTS_TOTAL, "kind" => conflict.kind()).increment(1);
    }
    if applied.log_conflicts {
        let conflicts: Vec<String> = applied.conflicts.iter().map(ToString::to_string).collect();
        tracing::warn!(
            node,
            conflicts = ?conflicts,
            "The node's GPU inventory contradicts itself; the GPUs involved are not resolved until it does not."
        );
    }
    if applied.dropped > 0 {
        metrics::counter!(names::INVENTORY_GPUS_DROPPED_TOTAL).increment(applied.dropped as u64);
        tracing::debug!(node, dropped = applied.dropped, "GPUs past the per-node cap left out of the inventory.");
    }
    if let Some(evicted) = &applied.evicted {
        metrics::counter!(names::INVENTORY_EVICTIONS_TOTAL).increment(1);
        tracing::debug!(node = %evicted, "Node's GPU inventory forgotten to make room (least recently updated).");
    }
}

enum Found<'a> {
    Gpu(&'a Gpu),
    Conflict,
    None,
    NotAGpu,
}

impl<'a> Found<'a> {
    /// A miss among the present GPUs looked up again among the departed ones (`departed`).
    fn or_departed(self, departed: impl FnOnce() -> Option<&'a Gpu>) -> Self {
        match self {
            Found::None => departed().map_or(Found::None, Found::Gpu),
            other => other,
        }
    }

    /// A miss on a PCI bus id that may be another device's is no GPU reference.
    fn or_not_a_gpu(self, names_gpu: bool) -> Self {
        match self {
            Found::None if !names_gpu => Found::NotAGpu,
            other => other,
        }
    }
}

/// The GPUs that have left a node's inventory as `now` (observed at `at`) replaces `previous`:
/// those of `previous` that `now` does not list (by UUID, else PCI bus id), departing at `at`, and
/// those of `departed` that have not come back and left no longer than `max_age` ago. Entries in
/// conflict are not kept; at most `max_gpus`, the latest departures first.
fn departed(
    previous: Vec<Gpu>,
    departed: Vec<(Gpu, DateTime<Utc>)>,
    now: &[Gpu],
    at: DateTime<Utc>,
    limits: InventoryLimits,
) -> Vec<(Gpu, DateTime<Utc>)> {
    let listed = |g: &Gpu| {
        now.iter().any(|n| match (&g.identity.uuid, &n.identity.uuid) {
            (Some(a), Some(b)) => a.eq_ignore_ascii_case(b),
            (None, _) => g.pci.is_some() && g.pci == n.pci,
            (Some(_), None) => false,
        })
    };
    let mut kept: Vec<(Gpu, DateTime<Utc>)> = previous
        .into_iter()
        .filter(|g| !g.conflict && (g.identity.uuid.is_some() || g.pci.is_some()) && !listed(g))
        .map(|g| (g, at))
        .collect();
    for (g, left) in departed {
        if kept.len() == limits.max_gpus {
            break;
        }
        let repeated = kept.iter().any(|(k, _)| k.identity == g.identity);
        if at.signed_duration_since(left) <= limits.max_age && !listed(&g) && !repeated {
            kept.push((g, left));
        }
    }
    kept.truncate(limits.max_gpus);
    kept
}

/// The entry matching `pred`; conflicting entries match but are not used.
fn find(gpus: &[Gpu], pred: impl Fn(&Gpu) -> bool) -> Found<'_> {
    match gpus.iter().find(|g| pred(g)) {
        Some(g) if g.conflict => Found::Conflict,
        Some(g) => Found::Gpu(g),
        None => Found::None,
    }
}

/// Finds every contradiction between two entries and marks both entries; at most 64 entries, and
/// only when an inventory arrives, so comparing every pair costs nothing that matters.
fn mark_conflicts(gpus: &mut [Gpu]) -> Vec<Conflict> {
    let mut conflicts = Vec::new();
    for i in 0..gpus.len() {
        for j in i + 1..gpus.len() {
            let (a, b) = (&gpus[i], &gpus[j]);
            let uuids = || [a.identity.uuid.clone(), b.identity.uuid.clone()];
            let mut found = Vec::new();
            if a.pci.is_some() && a.pci == b.pci {
                found.push(Conflict::SharedPci {
                    pci: a.pci.map(|p| p.to_string()).unwrap_or_default(),
                    uuids: uuids(),
                });
            }
            if let (Some(ua), Some(ub)) = (&a.identity.uuid, &b.identity.uuid)
                && ua.eq_ignore_ascii_case(ub)
            {
                found.push(Conflict::SharedUuid {
                    uuid: ua.clone(),
                    pcis: [a.identity.pci_bus_id.clone(), b.identity.pci_bus_id.clone()],
                });
            }
            if a.identity.index.is_some() && a.identity.index == b.identity.index {
                found.push(Conflict::DuplicateIndex { index: a.identity.index.unwrap_or_default(), uuids: uuids() });
            }
            if !found.is_empty() {
                gpus[i].conflict = true;
                gpus[j].conflict = true;
                conflicts.extend(found);
            }
        }
    }
    conflicts
}

#[cfg(test)]
mod tests {
    use super::*;

    const A: &str = "GPU-aaaaaaaa-0000-0000-0000-000000000000";
    const B: &str = "GPU-bbbbbbbb-0000-0000-0000-000000000000";
    const C: &str = "GPU-cccccccc-0000-0000-0000-000000000000";

    fn gpu(index: i32, uuid: &str, pci: &str) -> GpuIdentity {
        GpuIdentity {
            index: Some(index),
            uuid: Some(uuid.to_owned()),
            pci_bus_id: Some(pci.to_owned()),
            serial: Some(format!("serial-{index}")),
            product: Some("NVIDIA H100 80GB HBM3".to_owned()),
            nvlink_domain: None,
        }
    }

    fn inventory(gpus: Vec<GpuIdentity>) -> GpuInventoryDetail {
        GpuInventoryDetail { gpus, reason: GpuInventoryDetail::START.to_owned(), expected: None }
    }

    fn t0() -> DateTime<Utc> {
        DateTime::from_timestamp(1_800_000_000, 0).unwrap()
    }

    /// Two GPUs on node `n`, as NVML writes PCI ids (8-digit domain, upper case).
    fn cache() -> InventoryCache {
        let mut c = InventoryCache::default();
        let applied =
            c.apply("n", &inventory(vec![gpu(0, A, "00000000:1B:00.0"), gpu(1, B, "00000000:2A:00.0")]), t0());
        assert!(applied.conflicts.is_empty());
        c
    }

    fn by_uuid(u: &str) -> Entity {
        Entity { gpu_uuid: Some(u.to_owned()), ..Entity::default() }
    }

    fn by_pci(p: &str) -> Entity {
        Entity { pci_bus_id: Some(p.to_owned()), ..Entity::default() }
    }

    fn by_index(i: i32) -> Entity {
        Entity { gpu_index: Some(i), ..Entity::default() }
    }

    fn resolved(r: Resolution<'_>) -> (Option<i32>, Option<&str>, Option<&str>) {
        match r {
            Resolution::Resolved(g) => (g.index, g.uuid.as_deref(), g.pci_bus_id.as_deref()),
            other => panic!("not resolved: {other:?}"),
        }
    }

    #[test]
    fn pci_addresses_compare_equal_in_every_form() {
        for raw in
            ["0000:1b:00.0", "0000:1B:00.0", "00000000:1b:00.0", "PCI:0000:1b:00", " 0000:1b:00.0, ", "0000:1b:00"]
        {
            assert_eq!(normalize_pci(raw).as_deref(), Some("0000:1b:00.0"), "{raw}");
        }
        assert_eq!(normalize_pci("0002:c8:1f.7").as_deref(), Some("0002:c8:1f.7"));
        for bad in ["", "1b:00.0", "0000:1b:20.0", "0000:1b:00.8", "zzzz:1b:00.0", "0000:1b:00:00.0", "+000:1b:00.0"] {
            assert_eq!(normalize_pci(bad), None, "{bad}");
        }
        // The collector's parser refuses domains above 0xffff; agreeing keeps both sides' ids equal.
        assert_eq!(normalize_pci("00010000:00:00.0"), None);
    }

    #[test]
    fn resolves_by_uuid_then_pci_then_index() {
        let c = cache();
        let r = c.resolve("n", &by_uuid(B), Component::Gpu, t0());
        assert_eq!(resolved(r), (Some(1), Some(B), Some("0000:2a:00.0")), "PCI id normalised in the identity");
        assert_eq!(resolved(c.resolve("n", &by_uuid(&B.to_lowercase()), Component::Gpu, t0())).1, Some(B));
        for pci in ["0000:1b:00.0", "0000:1B:00.0", "00000000:1b:00.0", "PCI:0000:1b:00"] {
            let r = c.resolve("n", &by_pci(pci), Component::Gpu, t0());
            assert_eq!(resolved(r), (Some(0), Some(A), Some("0000:1b:00.0")), "{pci}");
        }
        assert_eq!(resolved(c.resolve("n", &by_index(1), Component::Gpu, t0())).1, Some(B));
        // The whole identity comes out, not only the names the event had.
        let Resolution::Resolved(g) = c.resolve("n", &by_pci("0000:1b:00.0"), Component::Gpu, t0()) else { panic!() };
        assert_eq!(g.serial.as_deref(), Some("serial-0"));
    }

    #[test]
    fn the_strongest_name_decides_and_names_must_agree() {
        let c = cache();
        // UUID first: a wrong index beside it does not matter (indexes change across reboots).
        let e = Entity { gpu_uuid: Some(A.into()), gpu_index: Some(1), ..Entity::default() };
        assert_eq!(resolved(c.resolve("n", &e, Component::Gpu, t0())).1, Some(A));
        // PCI before index.
        let e = Entity { pci_bus_id: Some("0000:2a:00.0".into()), gpu_index: Some(0), ..Entity::default() };
        assert_eq!(resolved(c.resolve("n", &e, Component::Gpu, t0())).1, Some(B));
        // A UUID and a PCI id naming two different GPUs: which one is meant is unknown.
        let e = Entity { gpu_uuid: Some(A.into()), pci_bus_id: Some("0000:2a:00.0".into()), ..Entity::default() };
        assert_eq!(c.resolve("n", &e, Component::Gpu, t0()), Resolution::Unresolved(Unresolved::Conflict));
        let e = Entity { gpu_uuid: Some(A.into()), pci_bus_id: Some("0000:1B:00".into()), ..Entity::default() };
        assert_eq!(resolved(c.resolve("n", &e, Component::Gpu, t0())).1, Some(A));
        // An unknown UUID is not rescued by its PCI id: the GPU at that address may have been
        // replaced since the inventory.
        let e = Entity { gpu_uuid: Some(C.into()), pci_bus_id: Some("0000:1b:00.0".into()), ..Entity::default() };
        assert_eq!(c.resolve("n", &e, Component::Gpu, t0()), Resolution::Unresolved(Unresolved::Unknown));
    }

    #[test]
    fn unknown_names_and_missing_inventories_are_unresolved() {
        let c = cache();
        let unknown = Resolution::Unresolved(Unresolved::Unknown);
        assert_eq!(c.resolve("n", &by_uuid(C), Component::Gpu, t0()), unknown);
        assert_eq!(c.resolve("n", &by_pci("0000:99:00.0"), Component::Gpu, t0()), unknown);
        assert_eq!(c.resolve("n", &by_pci("not a pci id"), Component::Gpu, t0()), unknown);
        assert_eq!(c.resolve("n", &by_index(7), Component::Gpu, t0()), unknown);
        let none = Resolution::Unresolved(Unresolved::NoInventory);
        assert_eq!(c.resolve("other", &by_pci("0000:1b:00.0"), Component::Gpu, t0()), none);
        assert_eq!(c.resolve("other", &by_uuid(A), Component::Memory, t0()), none);
        // Too old to trust: the node stopped refreshing, or its partition was elsewhere meanwhile.
        let late = t0() + TimeDelta::minutes(16);
        assert_eq!(c.resolve("n", &by_uuid(A), Component::Gpu, late), none);
        assert!(matches!(
            c.resolve("n", &by_uuid(A), Component::Gpu, t0() + TimeDelta::minutes(15)),
            Resolution::Resolved(_)
        ));
    }

    #[test]
    fn events_naming_no_gpu_are_not_unresolved() {
        let c = cache();
        assert_eq!(c.resolve("n", &Entity::default(), Component::Node, t0()), Resolution::NoGpu);
        assert_eq!(c.resolve("other", &Entity::default(), Component::Gpu, t0()), Resolution::NoGpu);
        // An NVSwitch's or a root port's PCI id is not a GPU's: no reference, not an unknown one.
        let switch =
            Entity { pci_bus_id: Some("0000:c8:00.0".into()), nvswitch_id: Some("x".into()), ..Entity::default() };
        assert_eq!(c.resolve("n", &switch, Component::Nvswitch, t0()), Resolution::NoGpu);
        assert_eq!(c.resolve("other", &switch, Component::Nvswitch, t0()), Resolution::NoGpu);
        assert_eq!(c.resolve("n", &by_pci("0000:00:01.0"), Component::Pcie, t0()), Resolution::NoGpu);
        // ...but an AER on a GPU's own address is tied to that GPU.
        assert_eq!(resolved(c.resolve("n", &by_pci("0000:2a:00.0"), Component::Pcie, t0())).1, Some(B));
    }

    #[test]
    fn conflicting_entries_are_not_used_and_the_rest_are() {
        let mut c = InventoryCache::default();
        let applied = c.apply(
            "n",
            &inventory(vec![
                gpu(0, A, "0000:1b:00.0"),
                gpu(1, B, "0000:1B:00.0"), // Two UUIDs on one PCI id.
                gpu(2, C, "0000:3c:00.0"),
                gpu(3, "GPU-dddd", "0000:4d:00.0"),
                gpu(4, "GPU-dddd", "0000:5e:00.0"), // One UUID on two PCI ids.
                gpu(6, "GPU-eeee", "0000:6f:00.0"),
                gpu(6, "GPU-ffff", "0000:70:00.0"), // Duplicate index.
                gpu(2, C, "0000:3c:00.0"),          // A repeat: not a conflict.
            ]),
            t0(),
        );
        let kinds: Vec<&str> = applied.conflicts.iter().map(Conflict::kind).collect();
        assert_eq!(kinds, ["shared_pci", "shared_uuid", "duplicate_index"]);
        assert!(applied.log_conflicts);
        assert_eq!(applied.conflicts[0].to_string(), format!("PCI 0000:1b:00.0 is given to {A} and {B}"));

        let conflict = Resolution::Unresolved(Unresolved::Conflict);
        assert_eq!(c.resolve("n", &by_pci("0000:1b:00.0"), Component::Gpu, t0()), conflict);
        assert_eq!(c.resolve("n", &by_uuid(A), Component::Gpu, t0()), conflict);
        assert_eq!(c.resolve("n", &by_uuid("GPU-dddd"), Component::Gpu, t0()), conflict);
        assert_eq!(c.resolve("n", &by_pci("0000:5e:00.0"), Component::Gpu, t0()), conflict);
        assert_eq!(c.resolve("n", &by_index(6), Component::Gpu, t0()), conflict);
        assert_eq!(c.resolve("n", &by_uuid("GPU-ffff"), Component::Gpu, t0()), conflict);
        assert_eq!(resolved(c.resolve("n", &by_pci("0000:3c:00.0"), Component::Gpu, t0())).1, Some(C));
        assert_eq!(resolved(c.resolve("n", &by_index(2), Component::Gpu, t0())).1, Some(C));

        // The same conflicts at the next refresh are not logged again; a clean inventory resets that.
        let same = c.apply("n", &inventory(vec![gpu(0, A, "0000:1b:00.0"), gpu(1, B, "0000:1b:00.0")]), t0());
        assert!(same.log_conflicts, "a different set of conflicts is logged");
        let again = c.apply("n", &inventory(vec![gpu(0, A, "0000:1b:00.0"), gpu(1, B, "0000:1b:00.0")]), t0());
        assert!(!again.log_conflicts && again.conflicts.len() == 1, "{again:?}");
        let clean = c.apply("n", &inventory(vec![gpu(0, A, "0000:1b:00.0")]), t0());
        assert!(clean.conflicts.is_empty() && !clean.log_conflicts);
        assert_eq!(resolved(c.resolve("n", &by_uuid(A), Component::Gpu, t0())).1, Some(A), "the latest inventory wins");
    }

    #[test]
    fn the_latest_inventory_replaces_the_previous_one() {
        let mut c = cache();
        c.apply("n", &inventory(vec![gpu(0, C, "0000:1b:00.0")]), t0());
        assert_eq!(resolved(c.resolve("n", &by_pci("0000:1b:00.0"), Component::Gpu, t0())).1, Some(C));
        assert_eq!(resolved(c.resolve("n", &by_index(0), Component::Gpu, t0())).1, Some(C));
        // B left with that inventory: known for as long as an inventory listing it was trusted.
        let gone = t0() + TimeDelta::minutes(16);
        c.apply("n", &inventory(vec![gpu(0, C, "0000:1b:00.0")]), gone);
        assert_eq!(c.resolve("n", &by_uuid(B), Component::Gpu, gone), Resolution::Unresolved(Unresolved::Unknown));
        // An empty inventory (every GPU gone): references are unknown, not "no inventory".
        c.apply("n", &inventory(vec![]), gone);
        let later = gone + TimeDelta::minutes(16);
        c.apply("n", &inventory(vec![]), later);
        assert_eq!(c.resolve("n", &by_uuid(C), Component::Gpu, later), Resolution::Unresolved(Unresolved::Unknown));
    }

    /// The inventory of `n` without A (it fell off the bus) `at`.
    fn a_departs(c: &mut InventoryCache, at: DateTime<Utc>) {
        c.apply("n", &inventory(vec![gpu(1, B, "00000000:2A:00.0")]), at);
    }

    #[test]
    fn a_gpu_that_leaves_the_inventory_is_still_resolved_by_uuid_and_pci_for_a_while() {
        // The collector may publish the inventory without a lost GPU before NVML's gpu_lost and
        // the kernel log's Xid 79 reach the enricher: both must still name the GPU.
        let mut c = cache();
        let left = t0() + TimeDelta::seconds(10);
        a_departs(&mut c, left);
        let lost = c.resolve("n", &by_uuid(A), Component::Gpu, left);
        assert_eq!(resolved(lost), (Some(0), Some(A), Some("0000:1b:00.0")), "gpu_lost, by UUID");
        let Resolution::Resolved(g) = lost else { unreachable!() };
        assert_eq!(g.serial.as_deref(), Some("serial-0"), "the whole identity, serial included");
        let xid79 = c.resolve("n", &by_pci("PCI:0000:1b:00"), Component::Gpu, left + TimeDelta::seconds(1));
        assert_eq!(resolved(xid79).1, Some(A), "Xid 79, by PCI bus id");
        // Names that must agree still must.
        let e = Entity { gpu_uuid: Some(A.into()), pci_bus_id: Some("0000:2a:00.0".into()), ..Entity::default() };
        assert_eq!(c.resolve("n", &e, Component::Gpu, left), Resolution::Unresolved(Unresolved::Conflict));
        // Not by index: NVML renumbers the GPUs that are left.
        assert_eq!(c.resolve("n", &by_index(0), Component::Gpu, left), Resolution::Unresolved(Unresolved::Unknown));
        // Refreshes without A keep its departure time; past the inventory's trust it is unknown.
        let refreshed = left + TimeDelta::minutes(10);
        a_departs(&mut c, refreshed);
        assert_eq!(resolved(c.resolve("n", &by_uuid(A), Component::Gpu, refreshed)).1, Some(A));
        let past = left + TimeDelta::minutes(15) + TimeDelta::seconds(1);
        assert_eq!(c.resolve("n", &by_uuid(A), Component::Gpu, past), Resolution::Unresolved(Unresolved::Unknown));
        a_departs(&mut c, past);
        assert_eq!(c.resolve("n", &by_uuid(A), Component::Gpu, refreshed), Resolution::Unresolved(Unresolved::Unknown));
    }

    #[test]
    fn a_present_gpu_always_wins_over_a_departed_one() {
        let mut c = cache();
        a_departs(&mut c, t0());
        // A new GPU at A's address: the address is its, A keeps its UUID.
        c.apply("n", &inventory(vec![gpu(0, C, "0000:1b:00.0"), gpu(1, B, "0000:2a:00.0")]), t0());
        assert_eq!(resolved(c.resolve("n", &by_pci("0000:1b:00.0"), Component::Gpu, t0())).1, Some(C));
        assert_eq!(resolved(c.resolve("n", &by_uuid(A), Component::Gpu, t0())).1, Some(A));
        // A comes back after a reboot: it is present again, not departed twice.
        let back = t0() + TimeDelta::minutes(1);
        c.apply("n", &inventory(vec![gpu(0, A, "0000:1b:00.0"), gpu(1, B, "0000:2a:00.0")]), back);
        assert_eq!(resolved(c.resolve("n", &by_index(0), Component::Gpu, back)).1, Some(A));
        let departed: Vec<Option<&str>> =
            c.nodes["n"].departed.iter().map(|(g, _)| g.identity.uuid.as_deref()).collect();
        assert_eq!(departed, [Some(C)]);
    }

    #[test]
    fn departed_gpus_are_bounded_per_node() {
        let mut c = InventoryCache::new(InventoryLimits { max_gpus: 2, ..InventoryLimits::default() });
        let mut at = t0();
        for i in 0..5 {
            c.apply("n", &inventory(vec![gpu(i, &format!("GPU-{i:08x}"), &format!("0000:{:02x}:00.0", i + 1))]), at);
            at += TimeDelta::seconds(1);
        }
        c.apply("n", &inventory(vec![]), at);
        let departed: Vec<Option<i32>> = c.nodes["n"].departed.iter().map(|(g, _)| g.identity.index).collect();
        assert_eq!(departed, [Some(4), Some(3)], "the latest departures first");
    }

    #[test]
    fn nodes_are_bounded_least_recently_updated_first() {
        let mut c = InventoryCache::new(InventoryLimits { max_nodes: 3, ..InventoryLimits::default() });
        let inv = inventory(vec![gpu(0, A, "0000:1b:00.0")]);
        for n in ["n1", "n2", "n3"] {
            assert_eq!(c.apply(n, &inv, t0()).evicted, None);
        }
        // n1 refreshed: n2 is now the least recently updated.
        assert_eq!(c.apply("n1", &inv, t0()).evicted, None);
        assert_eq!(c.apply("n4", &inv, t0()).evicted.as_deref(), Some("n2"));
        assert_eq!(c.apply("n5", &inv, t0()).evicted.as_deref(), Some("n3"));
        assert_eq!(c.len(), 3);
        assert!(c.contains("n1") && c.contains("n4") && c.contains("n5"));
        assert!(!c.contains("n2") && !c.contains("n3"));
        assert_eq!(c.resolve("n2", &by_uuid(A), Component::Gpu, t0()), Resolution::Unresolved(Unresolved::NoInventory));
        assert_eq!(c.order.len(), c.nodes.len(), "the eviction order holds each node once");
    }

    #[test]
    fn gpus_per_node_are_bounded() {
        let mut c = InventoryCache::new(InventoryLimits { max_gpus: 2, ..InventoryLimits::default() });
        let applied = c.apply(
            "n",
            &inventory(vec![gpu(0, A, "0000:1b:00.0"), gpu(1, B, "0000:2a:00.0"), gpu(2, C, "0000:3c:00.0")]),
            t0(),
        );
        assert_eq!(applied.dropped, 1);
        assert_eq!(resolved(c.resolve("n", &by_index(1), Component::Gpu, t0())).1, Some(B));
        assert_eq!(c.resolve("n", &by_uuid(C), Component::Gpu, t0()), Resolution::Unresolved(Unresolved::Unknown));

        let mut c = InventoryCache::default();
        let many: Vec<GpuIdentity> =
            (0..100).map(|i| gpu(i, &format!("GPU-{i:08x}"), &format!("0000:{:02x}:00.0", i + 1))).collect();
        assert_eq!(c.apply("n", &inventory(many), t0()).dropped, 36, "64 kept by default");
    }

    #[test]
    fn entries_without_any_name_are_skipped() {
        let mut c = InventoryCache::default();
        let nameless = GpuIdentity { product: Some("x".into()), ..GpuIdentity::default() };
        let applied = c.apply("n", &inventory(vec![nameless.clone(), nameless, gpu(0, A, "0000:1b:00.0")]), t0());
        assert!(applied.conflicts.is_empty(), "{applied:?}");
        assert_eq!(resolved(c.resolve("n", &by_index(0), Component::Gpu, t0())).1, Some(A));
    }
}
