//! The simulated GPU fleet: what N nodes with 8 GPUs each send when each runs the collector, and
//! the matching Nodes and GPU pods in the apiserver.
//!
//! Every node is a simulated collector built from the collector's own parts
//! (`gpumedic_collector`): the simulated GPU backend ([`Simulated`]) holds its GPUs' readings,
//! the collector's [`Sampler`] decides which readings become events, its [`Inventory`] decides
//! when the GPU inventory is published, and its kernel-log parser turns the driver's Xid lines
//! into events. So the stream has the collector's shape, not a copy of it:
//!
//! - **An inventory first.** A node's first sample publishes its `gpu_inventory` (reason
//!   `start`: UUIDs, PCI bus ids, serials, product) and then the start snapshot (every reading
//!   of every GPU once, marked as such), as a collector that just started does. Inventories come
//!   again on a change (a GPU fell off the bus, a reboot brought it back) and every inventory
//!   refresh.
//! - **Readings on change only.** Each node samples its GPUs every sample interval; temperature,
//!   power and clock-event reasons move at every sample, but the sampler publishes a reading only
//!   when it crosses a threshold or a counter grows. When nothing happens, a node sends one
//!   heartbeat per GPU per heartbeat interval and its inventory per refresh.
//! - **Kernel-log Xids by PCI bus id.** An Xid is the driver's line
//!   (`NVRM: Xid (PCI:0000:18:00): 79, ...`) run through the collector's parser: the event names
//!   the GPU by PCI bus id only, and the enricher resolves it against the node's inventory. (The
//!   collector's publisher adds the UUID itself when its own inventory knows the GPU; with
//!   `--xid-names stamped` the simulated collectors do that too.)
//! - **The collector's intervals.** [`Intervals::COLLECTOR`] are the collector's defaults (sample
//!   every 10 s, a heartbeat per GPU every 60 s, the inventory every 5 minutes): 1,000 nodes then
//!   send about 137 events a second. A scenario that wants more events per second from the same
//!   nodes runs their collectors with shorter intervals ([`Intervals::paced`]), all scaled alike.
//!
//! Each event's `observed_at` is the fleet's own clock: node `k` of `N` samples at
//! `start + k/N` of a sample interval, then every sample interval. Faults are drawn as events are
//! taken, each event starting one with `fault_chance`, on a random GPU of a node that has already
//! published its inventory, with this mix (see `shared/reference/xid-catalog.md` for what each Xid
//! means):
//!
//! | share | fault | what follows |
//! |---|---|---|
//! | 60% | an Xid from the kernel log: 13, 31 (22% each, application faults), 43 (12%), 45 (10%), 94 (6%), 79 (6%), 74 (5%), 63 (4%), 48 (3%), 119 (3%), 64 (2%), 95 (2%), 92 (1%) | with Xid 79 the GPU falls off the bus: the next sample brings NVML's `gpu_lost`, then a changed inventory without it; 20 samples later the node reboots (a new boot id, a `start` inventory and a new snapshot) |
//! | 15% | an ECC trend | the GPU's corrected-error counters climb for 10 samples (an `ecc` event each); one trend in four ends in an uncorrected error and a pending row remap, which a GPU reset clears 10 samples later |
//! | 15% | a thermal excursion | the GPU reads 88-91 °C (over its 87 °C slowdown) with `hw_thermal_slowdown` for 6 samples, then cools |
//! | 10% | a cloud maintenance notice for the node | an AWS `system-reboot` window two days ahead |
//!
//! Every draw comes from a seeded generator, so a seed gives the same stream (event ids and boot
//! ids aside: those are random, as a node's boot id is).

use std::collections::{BTreeMap, VecDeque};
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use anyhow::Context as _;
use chrono::{DateTime, Utc};
use futures::{StreamExt as _, TryStreamExt as _};
use gpumedic_collector::gpu::{GpuBackend as _, Simulated, SimulatedControl, throttle};
use gpumedic_collector::identity::NodeIdentity;
use gpumedic_collector::inventory::{self, Inventory};
use gpumedic_collector::kernel_log::{event::to_health_event, kmsg, parse::parse_line};
use gpumedic_collector::sampler::{SNAPSHOT_RAW, Sampler};
use gpumedic_enricher::inventory::{InventoryCache, Resolution};
use gpumedic_schemas::health::{CloudMaintenanceDetail, CloudProvider, Component, Detail, Entity, GpuIdentity, Source};
use gpumedic_schemas::{EnrichedHealthEvent, HealthEvent};
use k8s_openapi::api::core::v1::{Namespace, Node, Pod};
use kube::api::{Api, DeleteParams, PostParams};
use rdkafka::producer::{BaseRecord, DefaultProducerContext, Producer as _, ThreadedProducer};
use serde_json::json;

/// GPUs per simulated node.
pub const GPUS_PER_NODE: usize = 8;

/// Samples a node waits, after a GPU fell off the bus, before it reboots (as remediation would
/// have it).
const LOST_SAMPLES: u32 = 20;

/// Options of the `fleet` command (the simulator on its own).
#[derive(Debug, clap::Args)]
pub struct Options {
    /// Nodes in the fleet, 8 GPUs each.
    #[arg(long, default_value_t = 1000)]
    pub nodes: usize,
    /// Events per second: the nodes' collectors run with intervals scaled so that their steady
    /// stream comes to this rate (see the module's doc).
    #[arg(long, default_value_t = 5000)]
    pub rate: u64,
    /// How long to produce.
    #[arg(long, default_value = "60s", value_parser = crate::duration)]
    pub duration: Duration,
    /// Faults per minute over the whole fleet.
    #[arg(long, default_value_t = 30.0)]
    pub faults_per_minute: f64,
    /// Seed of the generator: a seed gives the same stream.
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// How kernel-log Xids name their GPU: `pci` (the PCI bus id only, as the kernel log writes
    /// it) or `stamped` (with the UUID too, as the collector's publisher adds it when its own
    /// inventory knows the GPU).
    #[arg(long, value_enum, default_value_t = XidNames::Pci)]
    pub xid_names: XidNames,
    /// The topic to produce to.
    #[arg(long, default_value = gpumedic_schemas::topics::HEALTH_RAW)]
    pub topic: String,
    /// Also create the fleet's Nodes (and `--pods-per-node` GPU pods each) in the apiserver.
    #[arg(long)]
    pub create_nodes: bool,
    /// GPU pods per node when creating the fleet in the apiserver.
    #[arg(long, default_value_t = 2)]
    pub pods_per_node: usize,
}

/// The JSON result of the `fleet` command.
#[derive(Debug, serde::Serialize)]
pub struct Summary {
    scenario: &'static str,
    nodes: usize,
    gpus: usize,
    rate_target: u64,
    rate_achieved: f64,
    seconds: f64,
    events: u64,
    /// The collectors' sample interval, heartbeat interval and inventory refresh, in ms.
    intervals_ms: [f64; 3],
    /// How much fleet time (`observed_at`) the stream spans, in seconds.
    fleet_seconds: f64,
    counts: BTreeMap<&'static str, u64>,
    /// The label every created Node carries, when `--create-nodes`.
    fleet_label: Option<String>,
}

/// How the simulated collectors name the GPU of a kernel-log Xid.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum XidNames {
    /// The PCI bus id only, as the kernel log writes it: the enricher resolves every Xid against
    /// the node's inventory.
    Pci,
    /// The PCI bus id and the UUID, as the collector's publisher stamps an event whose PCI bus id
    /// its own inventory knows.
    Stamped,
}

/// The collector's intervals the simulated collectors run with.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Intervals {
    /// `--sample-interval`: how often a node samples its GPUs.
    pub sample: Duration,
    /// `--heartbeat-interval`: how often each GPU reports a heartbeat when nothing changes.
    pub heartbeat: Duration,
    /// `--inventory-refresh`: how often the inventory is published when nothing changes.
    pub inventory_refresh: Duration,
}

impl Intervals {
    /// The collector's defaults: `--sample-interval 10s`, `--heartbeat-interval 60s`,
    /// `--inventory-refresh 5m` (a unit test holds them to the collector's flags).
    pub const COLLECTOR: Intervals = Intervals {
        sample: Duration::from_secs(10),
        heartbeat: Duration::from_secs(60),
        inventory_refresh: Duration::from_secs(300),
    };

    /// The collector's defaults, all scaled by one factor so that the steady stream of `nodes`
    /// nodes ([`Intervals::steady_rate`]) comes to `rate` events per second. The heartbeat and
    /// the refresh stay whole multiples of the sample interval (6 and 30), as with the defaults.
    pub fn paced(nodes: usize, rate: u64) -> Self {
        let d = Self::COLLECTOR;
        let factor = d.steady_rate(nodes) / rate.max(1) as f64;
        let sample_us = ((d.sample.as_micros() as f64 * factor).round() as u64).max(1);
        let times = |i: Duration| (i.as_micros() / d.sample.as_micros()) as u64;
        Intervals {
            sample: Duration::from_micros(sample_us),
            heartbeat: Duration::from_micros(sample_us * times(d.heartbeat)),
            inventory_refresh: Duration::from_micros(sample_us * times(d.inventory_refresh)),
        }
    }

    /// Events per second (of fleet time) that `nodes` nodes send when nothing happens: a
    /// heartbeat per GPU per heartbeat interval and an inventory per node per refresh.
    pub fn steady_rate(&self, nodes: usize) -> f64 {
        nodes as f64
            * (GPUS_PER_NODE as f64 / self.heartbeat.as_secs_f64() + 1.0 / self.inventory_refresh.as_secs_f64())
    }

    /// The three intervals in milliseconds, for results.
    pub fn millis(&self) -> [f64; 3] {
        [self.sample, self.heartbeat, self.inventory_refresh].map(|d| d.as_secs_f64() * 1000.0)
    }
}

/// What a fleet is made of.
#[derive(Debug, Clone)]
pub struct Settings {
    /// Nodes are named `<prefix>-00000`, `<prefix>-00001`, ...
    pub prefix: String,
    /// How many nodes, 8 GPUs each.
    pub nodes: usize,
    /// The intervals their collectors run with.
    pub intervals: Intervals,
    /// The chance that an event taken from the stream starts a fault.
    pub fault_chance: f64,
    /// Seed of the generator.
    pub seed: u64,
    /// The fleet's clock at the first sample.
    pub start: DateTime<Utc>,
    /// How kernel-log Xids name their GPU.
    pub xid_names: XidNames,
}

/// `t` truncated to whole microseconds, as the wire carries it.
pub fn micros(t: DateTime<Utc>) -> DateTime<Utc> {
    DateTime::from_timestamp_micros(t.timestamp_micros()).unwrap_or(t)
}

/// A small, fast, seeded generator (SplitMix64): the stream must not depend on a crate's version.
#[derive(Debug, Clone)]
struct Rng(u64);

impl Rng {
    fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// Uniform in [0, 1).
    fn unit(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }

    /// Uniform in [0, n).
    fn below(&mut self, n: usize) -> usize {
        (self.next_u64() % n.max(1) as u64) as usize
    }

    /// Picks from `(weight, value)` pairs.
    fn pick<T: Copy>(&mut self, table: &[(u32, T)]) -> T {
        let total: u32 = table.iter().map(|(w, _)| w).sum();
        let mut at = (self.next_u64() % u64::from(total)) as u32;
        for (w, v) in table {
            if at < *w {
                return *v;
            }
            at -= w;
        }
        table[table.len() - 1].1
    }
}

/// Xid codes by share of the Xids a fleet logs (application faults dominate).
const XIDS: &[(u32, u32)] = &[
    (22, 13),
    (22, 31),
    (12, 43),
    (10, 45),
    (6, 94),
    (6, 79),
    (5, 74),
    (4, 63),
    (3, 48),
    (3, 119),
    (2, 64),
    (2, 95),
    (1, 92),
];

#[derive(Debug, Clone, Copy)]
enum Fault {
    Xid,
    EccTrend,
    Thermal,
    Maintenance,
}

const FAULTS: &[(u32, Fault)] =
    &[(60, Fault::Xid), (15, Fault::EccTrend), (15, Fault::Thermal), (10, Fault::Maintenance)];

/// What a GPU is going through, advanced once per sample of its node.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    Normal,
    /// Corrected errors climbing for `left` more samples; `uncorrected` at the end.
    EccTrend {
        left: u32,
        uncorrected: bool,
    },
    /// Over the slowdown threshold for `left` more samples.
    Hot {
        left: u32,
    },
    /// An uncorrected error with a row remap pending, until a GPU reset in `left` more samples.
    Uncorrected {
        left: u32,
    },
    /// Fallen off the bus: it answers again only after its node reboots.
    Lost,
}

/// One simulated node: the collector's parts for it, and its GPUs' faults.
struct SimNode {
    name: String,
    backend: Simulated,
    control: SimulatedControl,
    identity: NodeIdentity,
    inventory: Inventory,
    sampler: Sampler,
    /// The boot the sampler belongs to: a new boot starts a new sampler, as in the collector.
    boot_id: String,
    gpus: [State; GPUS_PER_NODE],
    /// The last kernel-log record's sequence number in this boot.
    kmsg_seq: u64,
    /// Samples until the node reboots, after a GPU fell off the bus.
    reboot_in: Option<u32>,
    /// The GPUs of the last inventory published, as the enricher will know them.
    published: Vec<GpuIdentity>,
}

/// The fleet: its nodes, its clock, and the generator.
pub struct Fleet {
    names: Vec<String>,
    nodes: Vec<SimNode>,
    intervals: Intervals,
    start: DateTime<Utc>,
    /// The fleet's `start` as an `Instant`, for the inventory's refresh clock.
    epoch: Instant,
    clock: DateTime<Utc>,
    rng: Rng,
    /// Node samples taken so far; the next is node `turn % nodes`.
    turn: u64,
    /// Events already made, handed out before the next sample.
    due: VecDeque<HealthEvent>,
    fault_chance: f64,
    xid_names: XidNames,
    counts: BTreeMap<&'static str, u64>,
    /// Where the nodes' inventories keep their state file (removed with the fleet).
    state_dir: PathBuf,
}

impl std::fmt::Debug for Fleet {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Fleet")
            .field("nodes", &self.nodes.len())
            .field("intervals", &self.intervals)
            .field("clock", &self.clock)
            .field("counts", &self.counts)
            .finish_non_exhaustive()
    }
}

impl Drop for Fleet {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.state_dir);
    }
}

impl Fleet {
    /// A fleet as `settings` say; its clock starts at `settings.start` (in whole microseconds).
    ///
    /// # Errors
    /// When the folder for the inventories' state files cannot be made.
    pub fn new(settings: Settings) -> anyhow::Result<Self> {
        // The collector's inventory keeps a small state file per node: in memory when the
        // machine has /dev/shm, so a fleet costs no disk writes.
        let shm = PathBuf::from("/dev/shm");
        let root = if shm.is_dir() { shm } else { std::env::temp_dir() };
        let state_dir = root.join(gpumedic_testkit::unique_name("gpumedic-fleet"));
        std::fs::create_dir_all(&state_dir).with_context(|| format!("create {}", state_dir.display()))?;
        let names: Vec<String> = (0..settings.nodes.max(1)).map(|n| format!("{}-{n:05}", settings.prefix)).collect();
        let nodes = names
            .iter()
            .enumerate()
            .map(|(k, name)| {
                let (backend, control) = Simulated::new(name, GPUS_PER_NODE as u32);
                // Random, as a real boot id is: kernel-log event ids are made from it.
                let boot_id = uuid::Uuid::new_v4().to_string();
                let identity = NodeIdentity::new(boot_id.clone());
                let inventory = Inventory::open(
                    name,
                    &state_dir.join(format!("{k:05}")),
                    settings.intervals.inventory_refresh,
                    identity.clone(),
                );
                SimNode {
                    name: name.clone(),
                    backend,
                    control,
                    identity,
                    inventory,
                    sampler: Sampler::new(name, Source::Nvml, settings.intervals.heartbeat),
                    boot_id,
                    gpus: [State::Normal; GPUS_PER_NODE],
                    kmsg_seq: 0,
                    reboot_in: None,
                    published: Vec::new(),
                }
            })
            .collect();
        let start = micros(settings.start);
        Ok(Fleet {
            names,
            nodes,
            intervals: settings.intervals,
            start,
            epoch: Instant::now(),
            clock: start,
            rng: Rng(settings.seed),
            turn: 0,
            due: VecDeque::new(),
            fault_chance: settings.fault_chance,
            xid_names: settings.xid_names,
            counts: BTreeMap::new(),
            state_dir,
        })
    }

    /// A fleet of `nodes` nodes named `<prefix>-00000`…, starting now, whose collectors run
    /// with the intervals that make its steady stream `rate` events per second
    /// ([`Intervals::paced`]), with `faults_per_minute` faults over the fleet at that rate.
    ///
    /// # Errors
    /// As [`Fleet::new`].
    pub fn paced(
        prefix: &str,
        nodes: usize,
        rate: u64,
        faults_per_minute: f64,
        seed: u64,
        xid_names: XidNames,
    ) -> anyhow::Result<Self> {
        Self::new(Settings {
            prefix: prefix.to_owned(),
            nodes,
            intervals: Intervals::paced(nodes, rate),
            fault_chance: faults_per_minute / 60.0 / rate.max(1) as f64,
            seed,
            start: Utc::now(),
            xid_names,
        })
    }

    /// How many nodes have taken their first sample: published their `start` inventory and
    /// their start snapshot.
    pub fn started(&self) -> usize {
        self.turn.min(self.nodes.len() as u64) as usize
    }

    /// Every node's collector restarts, as in a rollout of its DaemonSet: the next sample of each
    /// node publishes a `start` inventory and a start snapshot again, within one sample interval
    /// for the whole fleet. The nodes do not reboot (boot ids stay) and their GPUs keep their
    /// state; each collector takes its inventory's state file back, as a restarted one does.
    pub fn restart_collectors(&mut self) {
        let Intervals { heartbeat, inventory_refresh, .. } = self.intervals;
        for (k, node) in self.nodes.iter_mut().enumerate() {
            node.sampler = Sampler::new(&node.name, Source::Nvml, heartbeat);
            let state = self.state_dir.join(format!("{k:05}"));
            node.inventory = Inventory::open(&node.name, &state, inventory_refresh, node.identity.clone());
        }
    }

    /// The nodes' names.
    pub fn nodes(&self) -> &[String] {
        &self.names
    }

    /// The intervals the nodes' collectors run with.
    pub fn intervals(&self) -> Intervals {
        self.intervals
    }

    /// The fleet time the stream has reached (the `observed_at` of the last sample taken).
    pub fn clock(&self) -> DateTime<Utc> {
        self.clock
    }

    /// The fleet time the stream spans so far, in seconds.
    pub fn fleet_seconds(&self) -> f64 {
        (self.clock - self.start).num_microseconds().unwrap_or(i64::MAX) as f64 / 1e6
    }

    /// How many events of each kind (and faults of each kind) were made so far. Besides the
    /// event kinds: `healthy`/`unhealthy`, `snapshot` (start-snapshot readings), `xid_by_pci_only`
    /// (Xids without a UUID), `outside_inventory` (events naming a GPU that is not in their node's
    /// last published inventory: the ones the enricher cannot resolve), `reboot` and `fault_*`.
    pub fn counts(&self) -> &BTreeMap<&'static str, u64> {
        &self.counts
    }

    /// The next event of the stream.
    pub fn next_event(&mut self) -> HealthEvent {
        loop {
            if let Some(e) = self.due.pop_front() {
                self.count(&e);
                if self.rng.unit() < self.fault_chance {
                    self.fault();
                }
                return e;
            }
            self.sample_next_node();
        }
    }

    fn bump(&mut self, key: &'static str) {
        *self.counts.entry(key).or_default() += 1;
    }

    fn count(&mut self, e: &HealthEvent) {
        let kind = match &e.detail {
            Detail::Xid(_) => "xid",
            Detail::GpuLost(_) => "gpu_lost",
            Detail::GpuInventory(_) => "gpu_inventory",
            Detail::Ecc(_) => "ecc",
            Detail::RowRemap(_) => "row_remap",
            Detail::Temperature(_) => "temperature",
            Detail::Power(_) => "power",
            Detail::Throttle(_) => "throttle",
            Detail::PcieReplay(_) => "pcie_replay",
            Detail::Nvlink(_) => "nvlink",
            Detail::CloudMaintenance(_) => "cloud_maintenance",
            Detail::MonitorHealth(_) => "monitor_health",
            _ => "other",
        };
        self.bump(kind);
        self.bump(if e.healthy { "healthy" } else { "unhealthy" });
        if e.raw.as_deref() == Some(SNAPSHOT_RAW) {
            self.bump("snapshot");
        }
        if kind == "xid" && e.entity.gpu_uuid.is_none() {
            self.bump("xid_by_pci_only");
        }
    }

    /// The `Instant` of fleet time `at`, for the inventory's refresh clock.
    fn instant(&self, at: DateTime<Utc>) -> Instant {
        self.epoch + (at - self.start).to_std().unwrap_or_default()
    }

    /// `e` as the node's collector publishes it: with the node's boot id and, unless Xids go by
    /// PCI bus id only, as the publisher stamps it (a GPU named by PCI bus id gets its UUID).
    /// Counted as `outside_inventory` when it names a GPU its node's last inventory lacks.
    fn publish(&mut self, k: usize, mut e: HealthEvent) {
        let node = &self.nodes[k];
        let e = match (self.xid_names, e.source) {
            (XidNames::Pci, Source::KernelLog) => {
                e.boot_id = Some(node.identity.boot_id());
                e
            }
            _ => node.identity.stamp(&e),
        };
        let named = e.entity.gpu_uuid.is_some() || e.entity.pci_bus_id.is_some();
        let known = node.published.iter().any(|g| {
            (e.entity.gpu_uuid.is_some() && g.uuid == e.entity.gpu_uuid)
                || (e.entity.gpu_uuid.is_none() && e.entity.pci_bus_id.is_some() && g.pci_bus_id == e.entity.pci_bus_id)
        });
        if named && !known && e.component != Component::Node {
            self.bump("outside_inventory");
        }
        self.due.push_back(e);
    }

    /// The next node's sample: its GPUs move on, and what the collector would publish is due.
    fn sample_next_node(&mut self) {
        let n = self.nodes.len() as u64;
        let k = (self.turn % n) as usize;
        let offset = self.intervals.sample.as_micros() * u128::from(self.turn) / u128::from(n);
        self.clock = self.start + chrono::Duration::microseconds(i64::try_from(offset).unwrap_or(i64::MAX));
        self.turn += 1;
        let at = self.clock;
        let now = self.instant(at);
        let heartbeat = self.intervals.heartbeat;
        let Self { nodes, rng, counts, .. } = self;
        let node = &mut nodes[k];
        match node.reboot_in {
            Some(0) => {
                // Back from the reboot: a new boot id, every GPU answering with fresh counters.
                node.control.reboot(&node.identity);
                node.gpus = [State::Normal; GPUS_PER_NODE];
                node.kmsg_seq = 0;
                node.reboot_in = None;
                *counts.entry("reboot").or_default() += 1;
            }
            Some(left) => node.reboot_in = Some(left - 1),
            None => {}
        }
        for (g, state) in node.gpus.iter_mut().enumerate() {
            *state = advance(&node.control, g as u32, *state, rng);
        }
        let Ok(samples) = node.backend.sample() else { return };
        let boot_id = node.identity.boot_id();
        if boot_id != node.boot_id {
            // A new boot: every GPU is seen afresh, as by a collector started now.
            node.boot_id = boot_id;
            node.sampler = Sampler::new(&node.name, Source::Nvml, heartbeat);
        }
        // In the collector's order: a GPU's `gpu_lost` before the inventory without it, the
        // inventory before everything else (a reboot's proof of repair is a complete inventory
        // of the new boot).
        let due = node.inventory.observe(inventory::present(&samples), now);
        let events = inventory::publication_order(due, node.sampler.observe_with_snapshot(&samples, at));
        for mut e in events {
            e.observed_at = at;
            if let Detail::GpuInventory(d) = &e.detail {
                self.nodes[k].published = d.gpus.clone();
            }
            self.publish(k, e);
        }
    }

    /// Draws a fault on a random GPU of a node that has published its inventory; its first
    /// event is due now.
    fn fault(&mut self) {
        let started = self.turn.min(self.nodes.len() as u64) as usize;
        if started == 0 {
            return;
        }
        let k = self.rng.below(started);
        let g = self.rng.below(GPUS_PER_NODE);
        match self.rng.pick(FAULTS) {
            Fault::Xid => {
                let code = self.rng.pick(XIDS);
                self.xid(k, g, code);
                self.bump("fault_xid");
            }
            // A trend or an excursion starts on a GPU that is not going through something else.
            Fault::EccTrend => {
                let uncorrected = self.rng.below(4) == 0;
                if self.nodes[k].gpus[g] == State::Normal {
                    self.nodes[k].gpus[g] = State::EccTrend { left: 10, uncorrected };
                }
                self.bump("fault_ecc_trend");
            }
            Fault::Thermal => {
                if self.nodes[k].gpus[g] == State::Normal {
                    self.nodes[k].gpus[g] = State::Hot { left: 6 };
                }
                self.bump("fault_thermal");
            }
            Fault::Maintenance => {
                let now = self.clock;
                let id = format!("instance-event-{:016x}", self.rng.next_u64());
                let notice = Detail::CloudMaintenance(CloudMaintenanceDetail {
                    provider: CloudProvider::Aws,
                    event_type: "system-reboot".into(),
                    provider_event_id: Some(id),
                    window_start: Some(now + chrono::Duration::days(2)),
                    window_end: Some(now + chrono::Duration::days(2) + chrono::Duration::hours(2)),
                    description: Some("scheduled reboot".into()),
                });
                let mut e =
                    HealthEvent::new(self.names[k].clone(), Source::Cloud, Component::Node, Entity::default(), notice);
                e.observed_at = now;
                self.publish(k, e);
                self.bump("fault_maintenance");
            }
        }
    }

    /// The driver logs Xid `code` on GPU `g` of node `k`: its kernel-log line, read by the
    /// collector's parser. With Xid 79 the GPU falls off the bus and the node reboots later.
    fn xid(&mut self, k: usize, g: usize, code: u32) {
        let Some(gpu) = self.nodes[k].control.gpu(g as u32) else { return };
        if gpu.lost {
            return;
        }
        // The driver writes the bus id without the function: `PCI:0000:18:00`.
        let pci = gpu.pci_bus_id.strip_suffix(".0").unwrap_or(&gpu.pci_bus_id);
        let line = if code == 79 {
            format!("NVRM: Xid (PCI:{pci}): 79, pid='<unknown>', name=<unknown>, GPU has fallen off the bus.")
        } else {
            let pid = 1000 + self.rng.below(60_000);
            let channel = self.rng.below(0x40);
            format!("NVRM: Xid (PCI:{pci}): {code}, pid={pid}, name=python, Ch {channel:08x}")
        };
        let Some(parsed) = parse_line(&line) else {
            self.bump("xid_unparsed");
            return;
        };
        let node = &mut self.nodes[k];
        let mut e = to_health_event(&node.name, &parsed, &line);
        node.kmsg_seq += 1;
        e.event_id = kmsg::event_id(&node.name, &node.identity.boot_id(), node.kmsg_seq);
        e.observed_at = self.clock;
        if code == 79 && node.control.fall_off_bus(g as u32).is_ok() {
            node.gpus[g] = State::Lost;
            node.reboot_in = Some(LOST_SAMPLES);
        }
        self.publish(k, e);
    }
}

/// GPU `g`'s readings for its node's next sample, as its state `state` has them; its next state.
/// Temperature, power and the clock-event reasons move at every sample (a busy or idle GPU), well
/// within the GPU's limits unless a fault says otherwise.
fn advance(control: &SimulatedControl, g: u32, state: State, rng: &mut Rng) -> State {
    let (temp, watts, busy) = (40 + rng.below(30) as i32, rng.below(400) as f64, rng.below(5) != 0);
    let climb = 5 + rng.below(45) as i64;
    let hot = 1 + rng.below(4) as i32;
    let mut next = state;
    control.update(g, |s| {
        s.temperature_c = Some(temp);
        s.power_w = Some(if busy { 250.0 + watts } else { 60.0 + watts / 10.0 });
        s.throttle_mask = Some(if busy { throttle::SW_POWER_CAP } else { throttle::GPU_IDLE });
        next = match state {
            State::Normal | State::Lost => state,
            State::EccTrend { left: 0, uncorrected: false } => State::Normal,
            State::EccTrend { left: 0, uncorrected: true } => {
                s.ecc_dbe_volatile = s.ecc_dbe_volatile.map(|c| c + 1);
                s.ecc_dbe_aggregate = s.ecc_dbe_aggregate.map(|c| c + 1);
                s.remapped_rows_uncorrectable = s.remapped_rows_uncorrectable.map(|c| c + 1);
                s.remap_pending = Some(true);
                State::Uncorrected { left: 10 }
            }
            State::EccTrend { left, uncorrected } => {
                s.ecc_sbe_volatile = s.ecc_sbe_volatile.map(|c| c + climb);
                s.ecc_sbe_aggregate = s.ecc_sbe_aggregate.map(|c| c + climb);
                State::EccTrend { left: left - 1, uncorrected }
            }
            State::Uncorrected { left: 0 } => {
                // A GPU reset: the volatile counters start again and the remap is applied.
                s.ecc_sbe_volatile = Some(0);
                s.ecc_dbe_volatile = Some(0);
                s.remap_pending = Some(false);
                State::Normal
            }
            State::Uncorrected { left } => State::Uncorrected { left: left - 1 },
            State::Hot { left: 0 } => State::Normal,
            State::Hot { left } => {
                let (slow, shut) = (s.slowdown_c.unwrap_or(87), s.shutdown_c.unwrap_or(92));
                s.temperature_c = Some((slow + hot).min(shut - 1));
                s.throttle_mask = Some(throttle::HW_THERMAL_SLOWDOWN | throttle::SW_POWER_CAP);
                State::Hot { left: left - 1 }
            }
        };
    });
    next
}

/// The fleet's stream as the enricher passes it on, for the scenarios that feed the classifier
/// directly (`classify-throughput`, `backtest`, `event-writes`, `persist-policies`): nodes named
/// `bench-node-00000`… at the collector's own intervals, fault chance 0.01, seed 1. Each event is
/// resolved against its node's inventory by the enricher's own [`InventoryCache`] (the GPU's
/// identity, or marked unresolved), on the bench node's context ([`crate::classify::enriched`]),
/// and its `observed_at` is `base` plus `spacing` times its place in the stream.
pub struct Enriched {
    fleet: Fleet,
    cache: InventoryCache,
    base: DateTime<Utc>,
    spacing: chrono::Duration,
    index: i32,
}

impl Enriched {
    /// The stream of `nodes` nodes, enriched at `base`, `spacing` apart from `base` on.
    ///
    /// # Errors
    /// As [`Fleet::new`].
    pub fn new(nodes: usize, base: DateTime<Utc>, spacing: chrono::Duration) -> anyhow::Result<Self> {
        Self::with_fault_chance(nodes, base, spacing, 0.01)
    }

    /// The same with `fault_chance` ([`Settings::fault_chance`]) instead of 1%.
    ///
    /// # Errors
    /// As [`Fleet::new`].
    pub fn with_fault_chance(
        nodes: usize,
        base: DateTime<Utc>,
        spacing: chrono::Duration,
        fault_chance: f64,
    ) -> anyhow::Result<Self> {
        let fleet = Fleet::new(Settings {
            prefix: "bench-node".to_owned(),
            nodes,
            intervals: Intervals::COLLECTOR,
            fault_chance,
            seed: 1,
            start: base,
            xid_names: XidNames::Pci,
        })?;
        Ok(Self { fleet, cache: InventoryCache::default(), base: micros(base), spacing, index: 0 })
    }
}

impl Enriched {
    /// Every node's collector restarts ([`Fleet::restart_collectors`]).
    pub fn restart_collectors(&mut self) {
        self.fleet.restart_collectors();
    }
}

impl Iterator for Enriched {
    type Item = EnrichedHealthEvent;

    fn next(&mut self) -> Option<EnrichedHealthEvent> {
        let mut e = self.fleet.next_event();
        // Resolved at the fleet's own times, as the enricher would have.
        if let Detail::GpuInventory(d) = &e.detail {
            self.cache.apply(&e.node, d, e.observed_at);
        }
        let (gpu, gpu_unresolved) = match self.cache.resolve(&e.node, &e.entity, e.component, e.observed_at) {
            Resolution::Resolved(g) => (Some(g.clone()), false),
            Resolution::Unresolved(_) => (None, true),
            Resolution::NoGpu => (None, false),
        };
        e.observed_at = self.base + self.spacing * self.index;
        self.index = self.index.saturating_add(1);
        let mut enriched = crate::classify::enriched(e, self.base);
        enriched.gpu = gpu;
        enriched.gpu_unresolved = gpu_unresolved;
        Some(enriched)
    }
}

/// Produces the fleet's stream to `topic` at `rate` events per second until `until` or `stop`,
/// on the calling thread (run it on its own thread); `sent` counts the records queued so far.
pub fn produce_paced(
    fleet: &mut Fleet,
    producer: &ThreadedProducer<DefaultProducerContext>,
    topic: &str,
    rate: u64,
    until: Instant,
    stop: &AtomicBool,
    sent: &AtomicU64,
) -> anyhow::Result<()> {
    let start = Instant::now();
    let mut n: u64 = 0;
    while Instant::now() < until && !stop.load(Ordering::Relaxed) {
        let due = (start.elapsed().as_secs_f64() * rate as f64) as u64;
        if n >= due {
            std::thread::sleep(Duration::from_millis(2));
            continue;
        }
        let upto = due.min(n + 1000);
        while n < upto {
            let e = fleet.next_event();
            let payload = gpumedic_schemas::encode(&e)?;
            crate::send(producer, BaseRecord::to(topic).key(e.node.as_str()).payload(payload.as_slice()))?;
            n += 1;
        }
        sent.store(n, Ordering::Relaxed);
    }
    producer.flush(Duration::from_secs(60)).context("flush")?;
    Ok(())
}

/// The label every Node of a created fleet carries, with the fleet's id as its value.
pub const FLEET_LABEL: &str = "gpumedic-bench/fleet";

/// A GPU Node of the fleet `fleet`: labelled `FLEET_LABEL=fleet` with the labels a GPU node of a
/// cloud fleet has; with `status`, also the status a kubelet would report for a p5.48xlarge
/// (capacity and allocatable with 8 `nvidia.com/gpu`, the four usual conditions, addresses and
/// node info), so the object has the size of a real Node.
pub fn gpu_node(name: &str, fleet: &str, status: bool) -> anyhow::Result<Node> {
    let mut node = json!({ "metadata": { "name": name, "labels": {
        FLEET_LABEL: fleet,
        "nvidia.com/gpu.present": "true",
        "nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3",
        "node.kubernetes.io/instance-type": "p5.48xlarge",
        "topology.kubernetes.io/zone": "us-east-1a",
    } } });
    if status {
        let now = Utc::now().to_rfc3339_opts(chrono::SecondsFormat::Secs, true);
        let condition = |kind: &str, state: &str, reason: &str, message: &str| {
            json!({ "type": kind, "status": state, "reason": reason, "message": message,
                "lastHeartbeatTime": now, "lastTransitionTime": now })
        };
        let resources = json!({ "cpu": "192", "memory": "2097152Mi", "ephemeral-storage": "7650Gi",
            "pods": "110", "nvidia.com/gpu": GPUS_PER_NODE.to_string(), "vpc.amazonaws.com/efa": "32" });
        node["metadata"]["labels"]["kubernetes.io/hostname"] = json!(name);
        node["metadata"]["labels"]["kubernetes.io/os"] = json!("linux");
        node["metadata"]["labels"]["kubernetes.io/arch"] = json!("amd64");
        node["metadata"]["labels"]["nvidia.com/gpu.count"] = json!(GPUS_PER_NODE.to_string());
        node["metadata"]["labels"]["nvidia.com/gpu.memory"] = json!("81559");
        node["spec"] = json!({ "providerID": format!("aws:///us-east-1a/i-{name}") });
        node["status"] = json!({
            "capacity": resources, "allocatable": resources,
            "conditions": [
                condition("MemoryPressure", "False", "KubeletHasSufficientMemory", "kubelet has sufficient memory available"),
                condition("DiskPressure", "False", "KubeletHasNoDiskPressure", "kubelet has no disk pressure"),
                condition("PIDPressure", "False", "KubeletHasSufficientPID", "kubelet has sufficient PID available"),
                condition("Ready", "True", "KubeletReady", "kubelet is posting ready status"),
            ],
            "addresses": [{ "type": "InternalIP", "address": "10.0.0.1" }, { "type": "Hostname", "address": name }],
            "nodeInfo": { "machineID": "ec2", "systemUUID": "ec2", "bootID": "b", "kernelVersion": "6.8.0-1015-aws",
                "osImage": "Ubuntu 24.04.1 LTS", "containerRuntimeVersion": "containerd://1.7.24",
                "kubeletVersion": "v1.36.3", "kubeProxyVersion": "", "operatingSystem": "linux", "architecture": "amd64" },
        });
    }
    Ok(serde_json::from_value(node)?)
}

/// Creates `names` as GPU Nodes of `fleet` ([`gpu_node`] without status), `concurrency` requests
/// in flight.
pub async fn create_nodes(
    client: &kube::Client,
    fleet: &str,
    names: &[String],
    concurrency: usize,
) -> anyhow::Result<()> {
    create_gpu_nodes(client, fleet, names, false, concurrency).await
}

/// Creates `names` as GPU Nodes of `fleet` ([`gpu_node`], with its status when `status`),
/// `concurrency` requests in flight.
pub async fn create_gpu_nodes(
    client: &kube::Client,
    fleet: &str,
    names: &[String],
    status: bool,
    concurrency: usize,
) -> anyhow::Result<()> {
    let nodes: Api<Node> = Api::all(client.clone());
    futures::stream::iter(names.iter().map(|name| {
        let nodes = nodes.clone();
        async move {
            let node = gpu_node(name, fleet, status)?;
            nodes.create(&PostParams::default(), &node).await.with_context(|| format!("create node {name}"))?;
            Ok::<_, anyhow::Error>(())
        }
    }))
    .buffer_unordered(concurrency)
    .try_collect::<Vec<()>>()
    .await?;
    Ok(())
}

/// [`create_nodes`], then `pods_per_node` GPU pods on each in a new namespace, which it returns.
pub async fn create_in_apiserver(
    client: &kube::Client,
    fleet: &str,
    names: &[String],
    pods_per_node: usize,
    concurrency: usize,
) -> anyhow::Result<String> {
    create_nodes(client, fleet, names, concurrency).await?;
    create_gpu_pods(client, names, pods_per_node, concurrency).await
}

/// `pods_per_node` GPU pods bound to each of `names` (the node's 8 GPUs shared out between them),
/// in a new namespace, which it returns.
pub async fn create_gpu_pods(
    client: &kube::Client,
    names: &[String],
    pods_per_node: usize,
    concurrency: usize,
) -> anyhow::Result<String> {
    let ns = gpumedic_testkit::unique_name("bench-fleet");
    let namespaces: Api<Namespace> = Api::all(client.clone());
    namespaces.create(&PostParams::default(), &serde_json::from_value(json!({ "metadata": { "name": ns } }))?).await?;
    let pods: Api<Pod> = Api::namespaced(client.clone(), &ns);
    let gpus = (GPUS_PER_NODE / pods_per_node.max(1)).max(1).to_string();
    futures::stream::iter((0..names.len() * pods_per_node).map(|i| {
        let pods = pods.clone();
        let node = &names[i / pods_per_node];
        let gpus = gpus.clone();
        async move {
            let pod: Pod = serde_json::from_value(json!({
                "metadata": { "name": format!("trainer-{i:06}"), "labels": { "app": "trainer" } },
                "spec": { "nodeName": node, "containers": [{ "name": "main", "image": "trainer",
                    "resources": { "limits": { "nvidia.com/gpu": gpus } } }] }
            }))?;
            pods.create(&PostParams::default(), &pod).await.with_context(|| format!("create pod on {node}"))?;
            Ok::<_, anyhow::Error>(())
        }
    }))
    .buffer_unordered(concurrency)
    .try_collect::<Vec<()>>()
    .await?;
    Ok(ns)
}

/// Deletes the Nodes `names` and the namespace `ns` (best effort: a benchmark's cleanup).
pub async fn delete_from_apiserver(client: &kube::Client, names: &[String], ns: Option<&str>, concurrency: usize) {
    let nodes: Api<Node> = Api::all(client.clone());
    futures::stream::iter(names.iter().map(|name| {
        let nodes = nodes.clone();
        async move {
            let _ = nodes.delete(name, &DeleteParams::default()).await;
        }
    }))
    .buffer_unordered(concurrency)
    .collect::<Vec<()>>()
    .await;
    if let Some(ns) = ns {
        let _ = Api::<Namespace>::all(client.clone()).delete(ns, &DeleteParams::default()).await;
    }
}

/// The `fleet` command: the simulator on its own, into Kafka (and the apiserver).
pub async fn run(o: Options) -> anyhow::Result<Summary> {
    let bootstrap = gpumedic_testkit::require_kafka().await?;
    let id = gpumedic_testkit::unique_name("fleet");
    let mut fleet = Fleet::paced(&id, o.nodes, o.rate, o.faults_per_minute, o.seed, o.xid_names)?;
    let fleet_label = if o.create_nodes {
        let client = gpumedic_testkit::require_kubernetes().await?;
        let made = Instant::now();
        let ns = create_in_apiserver(&client, &id, fleet.nodes(), o.pods_per_node, 32).await?;
        println!(
            "fleet: {} Nodes ({FLEET_LABEL}={id}) and {} GPU pods in namespace {ns} created in {:.1} s",
            o.nodes,
            o.nodes * o.pods_per_node,
            made.elapsed().as_secs_f64()
        );
        Some(format!("{FLEET_LABEL}={id}"))
    } else {
        None
    };
    gpumedic_runtime::kafka::KafkaSettings {
        bootstrap: bootstrap.clone(),
        options: vec![],
        schema_registry: None,
        topic_replication: None,
    }
    .ensure_topics(&[gpumedic_runtime::kafka::TopicSpec::new(&o.topic, gpumedic_schemas::topics::DEFAULT_PARTITIONS)])
    .await?;
    let producer = crate::scratch_producer(&bootstrap)?;
    let (stop, sent) = (Arc::new(AtomicBool::new(false)), Arc::new(AtomicU64::new(0)));
    let topic = o.topic.clone();
    let start = Instant::now();
    let until = start + o.duration;
    let (rate, s2, n2) = (o.rate, stop.clone(), sent.clone());
    let fleet = tokio::task::spawn_blocking(move || {
        produce_paced(&mut fleet, &producer, &topic, rate, until, &s2, &n2).map(|()| fleet)
    })
    .await??;
    let seconds = start.elapsed().as_secs_f64();
    let events = sent.load(Ordering::Relaxed);
    let summary = Summary {
        scenario: "fleet",
        nodes: o.nodes,
        gpus: o.nodes * GPUS_PER_NODE,
        rate_target: o.rate,
        rate_achieved: events as f64 / seconds,
        seconds,
        events,
        intervals_ms: fleet.intervals().millis(),
        fleet_seconds: fleet.fleet_seconds(),
        counts: fleet.counts().clone(),
        fleet_label,
    };
    let [sample, heartbeat, refresh] = summary.intervals_ms;
    println!(
        "fleet: {events} events from {} nodes ({} GPUs) to {} in {seconds:.1} s ({:.0}/s, target {}/s); collectors \
         sampling every {sample:.0} ms, heartbeats every {heartbeat:.0} ms, inventories every {refresh:.0} ms; {:?}",
        o.nodes, summary.gpus, o.topic, summary.rate_achieved, o.rate, summary.counts
    );
    Ok(summary)
}

#[cfg(test)]
mod tests {
    use std::collections::{HashMap, HashSet};

    use gpumedic_schemas::Kind;
    use gpumedic_schemas::health::{GpuInventoryDetail, MonitorHealthDetail};

    use super::*;

    fn t0() -> DateTime<Utc> {
        DateTime::from_timestamp(1_800_000_000, 0).unwrap()
    }

    fn fleet(nodes: usize, fault_chance: f64, seed: u64, xid_names: XidNames) -> Fleet {
        Fleet::new(Settings {
            prefix: "t".into(),
            nodes,
            intervals: Intervals::COLLECTOR,
            fault_chance,
            seed,
            start: t0(),
            xid_names,
        })
        .unwrap()
    }

    /// `nodes` nodes paced for 10 events a node per second, without faults.
    fn quiet(nodes: usize, seed: u64) -> (Fleet, Intervals) {
        let intervals = Intervals::paced(nodes, 10 * nodes as u64);
        let settings = Settings {
            prefix: "q".into(),
            nodes,
            intervals,
            fault_chance: 0.0,
            seed,
            start: t0(),
            xid_names: XidNames::Pci,
        };
        (Fleet::new(settings).unwrap(), intervals)
    }

    fn take(f: &mut Fleet, n: usize) -> Vec<HealthEvent> {
        (0..n).map(|_| f.next_event()).collect()
    }

    fn inventory(e: &HealthEvent) -> Option<&GpuInventoryDetail> {
        match &e.detail {
            Detail::GpuInventory(d) => Some(d),
            _ => None,
        }
    }

    #[test]
    fn the_intervals_are_the_collectors_defaults_and_pacing_scales_them_alike() {
        use clap::CommandFactory as _;
        let command = gpumedic_collector::Args::command();
        let default = |long: &str| {
            let arg = command.get_arguments().find(|a| a.get_long() == Some(long)).expect(long);
            crate::duration(arg.get_default_values()[0].to_str().unwrap()).unwrap()
        };
        assert_eq!(default("sample-interval"), Intervals::COLLECTOR.sample);
        assert_eq!(default("heartbeat-interval"), Intervals::COLLECTOR.heartbeat);
        assert_eq!(default("inventory-refresh"), Intervals::COLLECTOR.inventory_refresh);
        // 1,000 nodes of 8 GPUs: 8,000 heartbeats a minute and 1,000 inventories in 5 minutes.
        assert!((Intervals::COLLECTOR.steady_rate(1000) - 136.67).abs() < 0.01);
        let paced = Intervals::paced(1000, 5000);
        assert!((paced.steady_rate(1000) - 5000.0).abs() < 1.0, "{paced:?}");
        assert_eq!((paced.heartbeat, paced.inventory_refresh), (paced.sample * 6, paced.sample * 30));
    }

    #[test]
    fn with_nothing_happening_a_node_sends_a_heartbeat_per_gpu_per_interval_and_its_inventory_per_refresh() {
        let nodes = 20;
        let (mut f, intervals) = quiet(nodes, 9);
        let events = take(&mut f, 20_000);
        let first_round_ends = t0() + chrono::Duration::from_std(intervals.sample).unwrap();
        let later: Vec<&HealthEvent> = events.iter().filter(|e| e.observed_at >= first_round_ends).collect();
        // Temperature, power and clock reasons move at every sample; none of it is news.
        for e in &later {
            assert!(e.kind == Kind::MonitorHealth || e.kind == Kind::GpuInventory, "{e:?}");
            assert!(e.raw.as_deref() != Some(SNAPSHOT_RAW));
        }
        let mut beats: HashMap<&str, Vec<DateTime<Utc>>> = HashMap::new();
        let mut refreshes: HashMap<&str, Vec<DateTime<Utc>>> = HashMap::new();
        for e in &events {
            if let Some(d) = inventory(e) {
                assert!(d.reason == "start" || d.reason == "refresh", "{d:?}");
                refreshes.entry(e.node.as_str()).or_default().push(e.observed_at);
            } else if e.kind == Kind::MonitorHealth {
                beats.entry(e.entity.gpu_uuid.as_deref().unwrap()).or_default().push(e.observed_at);
            }
        }
        let spaced = |times: &[DateTime<Utc>], every: Duration| {
            times.windows(2).all(|w| (w[1] - w[0]).to_std().unwrap() == every)
        };
        assert_eq!(beats.len(), nodes * GPUS_PER_NODE, "every GPU beats");
        assert!(beats.values().all(|t| t.len() > 3 && spaced(t, intervals.heartbeat)));
        assert_eq!(refreshes.len(), nodes);
        assert!(refreshes.values().all(|t| t.len() > 3 && spaced(t, intervals.inventory_refresh)));
        // Over two refresh intervals: 10 heartbeats per GPU and 2 inventories per node, exactly.
        let (from, to) = (t0() + intervals.inventory_refresh, t0() + intervals.inventory_refresh * 3);
        let window = events.iter().filter(|e| e.observed_at >= from && e.observed_at < to).count();
        assert_eq!(window, nodes * (GPUS_PER_NODE * 10 + 2));
        let seconds = (intervals.inventory_refresh * 2).as_secs_f64();
        assert!((window as f64 / seconds - 200.0).abs() < 1.0, "the paced rate: {}", window as f64 / seconds);
    }

    #[test]
    fn a_rollout_of_the_collectors_sends_every_nodes_start_again_in_one_sample_interval() {
        let nodes = 20;
        let (mut f, intervals) = quiet(nodes, 4);
        let starts = |events: &[HealthEvent]| {
            let nodes: HashSet<&str> = events
                .iter()
                .filter(|e| inventory(e).is_some_and(|d| d.reason == "start"))
                .map(|e| e.node.as_str())
                .collect();
            let snapshot = events.iter().filter(|e| e.raw.as_deref() == Some(SNAPSHOT_RAW)).count();
            (nodes.len(), snapshot)
        };
        let first = take(&mut f, 5_000);
        assert_eq!(f.started(), nodes);
        let (started, snapshot) = starts(&first);
        assert_eq!(started, nodes, "every node starts once");
        assert!(snapshot >= nodes * GPUS_PER_NODE, "{snapshot} start-snapshot readings");
        let boots: HashSet<String> = first.iter().filter_map(|e| e.boot_id.clone()).collect();
        // Running on: no node starts again.
        assert_eq!(starts(&take(&mut f, 5_000)), (0, 0));
        f.restart_collectors();
        let restarted_at = f.clock();
        let after = take(&mut f, 5_000);
        let within_a_round: Vec<HealthEvent> = after
            .iter()
            .filter(|e| e.observed_at <= restarted_at + chrono::Duration::from_std(intervals.sample).unwrap())
            .cloned()
            .collect();
        assert_eq!(starts(&within_a_round), (nodes, snapshot), "the same start again, within one sample interval");
        assert!(after.iter().filter_map(|e| e.boot_id.as_ref()).all(|b| boots.contains(b)), "no node rebooted");
    }

    #[test]
    fn each_nodes_inventory_comes_first_in_each_of_its_boots() {
        let mut f = fleet(30, 0.02, 5, XidNames::Pci);
        let events = take(&mut f, 60_000);
        assert!(f.counts().get("reboot").copied().unwrap_or(0) > 0, "{:?}", f.counts());
        let mut boots: HashMap<(&str, &str), usize> = HashMap::new();
        for e in &events {
            let boot = e.boot_id.as_deref().expect("every event carries its node's boot id");
            let seen = boots.entry((e.node.as_str(), boot)).or_default();
            if *seen == 0 {
                let d = inventory(e).unwrap_or_else(|| panic!("{} boot {boot} starts with {e:?}", e.node));
                assert_eq!((d.reason.as_str(), d.gpus.len(), d.expected), ("start", GPUS_PER_NODE, Some(8)));
                assert!(d.gpus.iter().all(|g| g.uuid.is_some() && g.pci_bus_id.is_some() && g.serial.is_some()));
            }
            *seen += 1;
        }
        let nodes: HashSet<&str> = boots.keys().map(|(n, _)| *n).collect();
        assert_eq!(nodes.len(), 30);
    }

    #[test]
    fn kernel_log_xids_name_their_gpu_by_pci_bus_id_only_and_the_enricher_resolves_each() {
        let mut f = fleet(30, 0.02, 6, XidNames::Pci);
        let events = take(&mut f, 60_000);
        let mut cache = InventoryCache::default();
        let (mut xids, mut unresolved, mut lost) = (0, 0, 0);
        for e in &events {
            if let Some(d) = inventory(e) {
                cache.apply(&e.node, d, e.observed_at);
                continue;
            }
            let resolution = cache.resolve(&e.node, &e.entity, e.component, e.observed_at);
            if matches!(resolution, Resolution::Unresolved(_)) {
                unresolved += 1;
            }
            if e.kind == Kind::GpuLost {
                // NVML's gpu_lost goes out before the inventory without the GPU: it names the GPU.
                lost += 1;
                let Resolution::Resolved(gpu) = resolution else { panic!("{e:?}: {resolution:?}") };
                assert_eq!(gpu.uuid, e.entity.gpu_uuid);
                assert!(gpu.serial.is_some(), "{gpu:?}");
            }
            if let Detail::Xid(x) = &e.detail {
                xids += 1;
                assert_eq!(e.source, Source::KernelLog);
                assert_eq!(e.entity.gpu_uuid, None, "{e:?}");
                let pci = e.entity.pci_bus_id.as_deref().expect("the kernel log's PCI bus id");
                let line = e.raw.as_deref().expect("the driver's line");
                assert!(line.contains(&format!("NVRM: Xid (PCI:{}): {}", &pci[..pci.len() - 2], x.code)), "{line}");
                let Resolution::Resolved(gpu) = resolution else { panic!("{e:?}: {resolution:?}") };
                let index = gpu.index.expect("index") as u32;
                assert_eq!(gpu.uuid.as_deref(), Some(gpumedic_collector::gpu::simulated_uuid(&e.node, index).as_str()));
                assert_eq!(gpu.pci_bus_id.as_deref(), Some(pci));
            }
        }
        assert!(xids > 100, "{xids} Xids: {:?}", f.counts());
        assert_eq!(Some(&xids), f.counts().get("xid_by_pci_only"));
        // Every GPU reference resolves, the lost GPUs' included: no event names a GPU outside its
        // node's last inventory.
        assert!(lost > 0 && Some(&lost) == f.counts().get("gpu_lost"), "{:?}", f.counts());
        assert_eq!(unresolved, 0);
        assert_eq!(f.counts().get("outside_inventory"), None);

        let mut stamped = fleet(30, 0.02, 6, XidNames::Stamped);
        let xids: Vec<HealthEvent> = take(&mut stamped, 60_000).into_iter().filter(|e| e.kind == Kind::Xid).collect();
        assert!(!xids.is_empty() && xids.iter().all(|e| e.entity.gpu_uuid.is_some() && e.entity.pci_bus_id.is_some()));
    }

    #[test]
    fn a_reading_repeats_only_on_a_change_a_threshold_or_a_heartbeat() {
        let mut f = fleet(20, 0.03, 7, XidNames::Pci);
        let events = take(&mut f, 60_000);
        for kind in ["temperature", "throttle", "ecc", "row_remap", "gpu_lost", "snapshot"] {
            assert!(f.counts().get(kind).copied().unwrap_or(0) > 0, "no {kind}: {:?}", f.counts());
        }
        // Per GPU and boot: the last reading of each kind, and the last heartbeat.
        let mut last: HashMap<(String, String, Kind), &HealthEvent> = HashMap::new();
        for e in &events {
            let (Some(uuid), Some(boot)) = (e.entity.gpu_uuid.clone(), e.boot_id.clone()) else { continue };
            if e.kind == Kind::Power {
                assert_eq!(e.raw.as_deref(), Some(SNAPSHOT_RAW), "no GPU draws over its limit in this fleet: {e:?}");
            }
            let key = (uuid, boot, e.kind);
            let before = last.insert(key, e);
            if e.raw.as_deref() == Some(SNAPSHOT_RAW) {
                assert!(before.is_none(), "a snapshot only at a boot's first sight: {e:?}");
                continue;
            }
            let Some(before) = before else { continue };
            match (&before.detail, &e.detail) {
                // A band crossed, a set of reasons changed, a flag flipped: never the same twice.
                (Detail::Temperature(_), Detail::Temperature(_))
                | (Detail::Throttle(_), Detail::Throttle(_))
                | (Detail::RowRemap(_), Detail::RowRemap(_)) => {
                    assert_ne!(before.healthy, e.healthy, "{before:?} then {e:?}");
                }
                (Detail::Ecc(a), Detail::Ecc(b)) => {
                    let grew = |x: Option<i64>, y: Option<i64>| y > x;
                    assert!(
                        grew(a.single_bit_aggregate, b.single_bit_aggregate)
                            || grew(a.double_bit_aggregate, b.double_bit_aggregate),
                        "{a:?} then {b:?}"
                    );
                }
                (Detail::MonitorHealth(_), Detail::MonitorHealth(MonitorHealthDetail { message, .. })) => {
                    let gap = (e.observed_at - before.observed_at).to_std().unwrap();
                    assert!(gap >= f.intervals().heartbeat || message.is_some(), "{before:?} then {e:?}");
                }
                _ => {}
            }
        }
    }

    #[test]
    fn a_gpu_that_falls_off_the_bus_leaves_the_inventory_and_its_node_reboots() {
        let mut f = fleet(2, 0.0, 3, XidNames::Pci);
        // Both nodes started, and nothing of theirs still due.
        while f.turn < 2 || !f.due.is_empty() {
            f.next_event();
        }
        f.xid(0, 3, 79);
        let boot = f.nodes[0].identity.boot_id();
        let events: Vec<HealthEvent> = take(&mut f, 400).into_iter().filter(|e| e.node == "t-00000").collect();
        let xid = &events[0];
        assert!(matches!(xid.detail, Detail::Xid(ref x) if x.code == 79), "{xid:?}");
        assert_eq!((xid.entity.gpu_uuid.as_deref(), xid.entity.pci_bus_id.as_deref()), (None, Some("0000:48:00.0")));
        assert_eq!(xid.event_id, kmsg::event_id("t-00000", &boot, 1), "the kernel log's own event id");
        // The next sample: NVML's gpu_lost, then the inventory without the GPU.
        assert_eq!(events[1].kind, Kind::GpuLost);
        let uuid3 = gpumedic_collector::gpu::simulated_uuid("t-00000", 3);
        assert_eq!(events[1].entity.gpu_uuid.as_deref(), Some(uuid3.as_str()));
        let change = inventory(&events[2]).expect("the next sample's inventory");
        assert_eq!((change.reason.as_str(), change.gpus.len(), events[2].healthy), ("change", 7, false));
        assert_eq!(events[1].observed_at, events[2].observed_at, "one sample");
        let restart = events.iter().position(|e| e.boot_id.as_deref() != Some(boot.as_str())).expect("a reboot");
        let start = inventory(&events[restart]).expect("the new boot's inventory first");
        assert_eq!((start.reason.as_str(), start.gpus.len()), ("start", 8));
        let gap = (events[restart].observed_at - events[2].observed_at).to_std().unwrap();
        assert_eq!(gap, Intervals::COLLECTOR.sample * LOST_SAMPLES);
        assert!(events[restart..].iter().any(|e| e.raw.as_deref() == Some(SNAPSHOT_RAW)), "a new start snapshot");
    }

    #[test]
    fn the_enriched_stream_carries_each_gpu_the_enricher_resolved() {
        let base = t0();
        let spacing = chrono::Duration::microseconds(10);
        let events: Vec<EnrichedHealthEvent> = Enriched::new(20, base, spacing).unwrap().take(30_000).collect();
        assert!(events.iter().enumerate().all(|(i, e)| e.event.observed_at == base + spacing * i as i32));
        let xids: Vec<&EnrichedHealthEvent> = events.iter().filter(|e| e.event.kind == Kind::Xid).collect();
        assert!(!xids.is_empty());
        assert!(
            xids.iter().all(|e| e.event.entity.gpu_uuid.is_none() && e.gpu.as_ref().is_some_and(|g| g.uuid.is_some()))
        );
        let beats = events.iter().filter(|e| e.event.kind == Kind::MonitorHealth);
        assert!(beats.clone().count() > 1000 && beats.clone().all(|e| e.gpu.is_some() && !e.gpu_unresolved));
        let lost = events.iter().filter(|e| e.event.kind == Kind::GpuLost);
        assert!(lost.clone().count() > 0);
        assert!(
            lost.clone().all(|e| !e.gpu_unresolved
                && e.gpu.as_ref().is_some_and(|g| g.uuid == e.event.entity.gpu_uuid && g.serial.is_some())),
            "NVML's gpu_lost names its GPU with its UUID and serial"
        );
        assert!(events.iter().all(|e| !e.gpu_unresolved), "every GPU reference resolves");
    }

    #[test]
    fn a_seed_gives_the_same_stream_and_another_seed_another() {
        let key = |e: &HealthEvent| {
            (e.node.clone(), e.entity.gpu_uuid.clone(), format!("{:?}", e.detail), e.healthy, e.observed_at)
        };
        let keys = |seed| take(&mut fleet(20, 0.02, seed, XidNames::Pci), 20_000).iter().map(key).collect::<Vec<_>>();
        assert_eq!(keys(7), keys(7));
        assert_ne!(keys(7), keys(8));
    }

    #[test]
    fn the_fault_mix_comes_at_the_asked_chance_with_xids_the_most_common() {
        let mut f = fleet(50, 0.01, 1, XidNames::Pci);
        let events = take(&mut f, 150_000);
        let c = f.counts();
        for kind in ["xid", "gpu_lost", "ecc", "row_remap", "temperature", "throttle", "cloud_maintenance", "reboot"] {
            assert!(c.get(kind).copied().unwrap_or(0) > 0, "no {kind} in {c:?}");
        }
        let faults: u64 =
            ["fault_xid", "fault_ecc_trend", "fault_thermal", "fault_maintenance"].iter().map(|k| c[k]).sum();
        assert!((1200..1800).contains(&faults), "about 1,500 faults expected: {c:?}");
        assert!(c["fault_xid"] > c["fault_ecc_trend"] && c["fault_xid"] > c["fault_maintenance"], "{c:?}");
        assert!(!c.contains_key("xid_unparsed"), "{c:?}");
        let unhealthy = events.iter().filter(|e| !e.healthy).count();
        assert!(unhealthy * 5 < events.len(), "{unhealthy} unhealthy of {}: {c:?}", events.len());
    }
}
