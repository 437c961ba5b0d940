//! The node's GPU inventory: which GPUs answer, by every name they go by, and how many there
//! should be. Published as a `gpu_inventory` event (source `nvml`, component `gpu`, no GPU in the
//! entity: it is about the node) at start (reason `start`), when the GPUs present change (reason
//! `change`), and every `--inventory-refresh` (reason `refresh`).
//!
//! A GPU is present when the backend samples it and it is not lost (NVML's GPU_IS_LOST counts as
//! absent). `expected` is the largest number of GPUs present at once in this boot; the inventory
//! is healthy when at least that many are present. The classifier counts a GPU missing from the
//! inventory as a fault in its own right, and a complete inventory after a reboot as part of the
//! proof of repair, so `expected` must not forget a GPU lost before a collector restart: it is
//! kept in `<state-dir>/gpu-inventory.json` keyed by boot id, with the identities of every GPU
//! seen in the boot (so a kernel-log Xid about a GPU that vanished before the restart still
//! resolves to its UUID). A file of another boot is ignored: after a reboot the count starts over.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use gpumedic_schemas::HealthEvent;
use gpumedic_schemas::health::{Component, Detail, Entity, GpuIdentity, GpuInventoryDetail, Source};
use serde::{Deserialize, Serialize};

use crate::gpu::GpuSample;
use crate::identity::NodeIdentity;

/// The file in the state folder that keeps the count and the identities of this boot.
pub const STATE_FILE: &str = "gpu-inventory.json";

/// What survives a collector restart within one boot.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
struct Saved {
    boot_id: String,
    expected: u32,
    /// Every GPU seen in the boot, present or not any more.
    gpus: Vec<GpuIdentity>,
}

/// The GPUs present in `samples`, by their names; lost GPUs are not present.
pub fn present(samples: &[GpuSample]) -> Vec<GpuIdentity> {
    let mut gpus: Vec<GpuIdentity> = samples
        .iter()
        .filter(|s| !s.lost)
        .map(|s| GpuIdentity {
            index: i32::try_from(s.index).ok(),
            uuid: (!s.uuid.is_empty()).then(|| s.uuid.clone()),
            pci_bus_id: (!s.pci_bus_id.is_empty()).then(|| s.pci_bus_id.clone()),
            serial: s.serial.clone(),
            product: s.product.clone(),
            // NVML's fabric (clique) information has no safe wrapper in nvml-wrapper 0.12; the
            // node label `nvidia.com/gpu.clique` is the other source, which the enricher reads.
            nvlink_domain: None,
        })
        .collect();
    gpus.sort_by_key(|g| g.index);
    gpus
}

/// One sample's events in the order the collector publishes them: the sampler's events about GPUs
/// that `inventory` (the sample's inventory event, if one is due) no longer lists first, then the
/// inventory, then the rest. So NVML's `gpu_lost` goes out before the inventory without the lost
/// GPU, and the enricher still finds the GPU in the node's inventory when it names it; a reboot's
/// `start` inventory, which lists every GPU, still comes before the new boot's heartbeats and
/// start snapshot (the proof of repair is a complete inventory, then the GPUs' own evidence).
pub fn publication_order(inventory: Option<HealthEvent>, sampled: Vec<HealthEvent>) -> Vec<HealthEvent> {
    let Some(inventory) = inventory else { return sampled };
    let Detail::GpuInventory(detail) = &inventory.detail else {
        let mut events = vec![inventory];
        events.extend(sampled);
        return events;
    };
    let listed = |e: &HealthEvent| {
        let (uuid, pci) = (e.entity.gpu_uuid.as_deref(), e.entity.pci_bus_id.as_deref());
        if uuid.is_none() && pci.is_none() {
            // About no GPU in particular (a monitor's health): nothing the inventory can lack.
            return true;
        }
        detail.gpus.iter().any(|g| match uuid {
            Some(u) => g.uuid.as_deref() == Some(u),
            None => g.pci_bus_id.as_deref() == pci,
        })
    };
    let (mut events, after): (Vec<HealthEvent>, Vec<HealthEvent>) = sampled.into_iter().partition(|e| !listed(e));
    events.push(inventory);
    events.extend(after);
    events
}

/// The key a GPU is remembered by: its UUID, else its PCI bus id, else its index.
fn key(gpu: &GpuIdentity) -> String {
    gpu.uuid.clone().or_else(|| gpu.pci_bus_id.clone()).unwrap_or_else(|| format!("index:{}", gpu.index.unwrap_or(-1)))
}

/// Decides when to publish the inventory, and keeps `expected` and the boot's identities.
#[derive(Debug)]
pub struct Inventory {
    node: String,
    path: PathBuf,
    refresh: Duration,
    identity: NodeIdentity,
    boot_id: String,
    expected: u32,
    known: BTreeMap<String, GpuIdentity>,
    /// The GPUs present in the last published inventory; `None` before the first of this boot.
    last: Option<Vec<GpuIdentity>>,
    published_at: Option<Instant>,
}

impl Inventory {
    /// The inventory of `node`, kept in `state_dir`, refreshed every `refresh`, for the boot
    /// `identity` is in. What an earlier run saved for the same boot is taken back (and the
    /// identities handed to `identity`); a missing, unreadable or foreign file starts afresh.
    pub fn open(node: impl Into<String>, state_dir: &Path, refresh: Duration, identity: NodeIdentity) -> Self {
        let boot_id = identity.boot_id();
        let mut inv = Self {
            node: node.into(),
            path: state_dir.join(STATE_FILE),
            refresh,
            identity,
            boot_id: boot_id.clone(),
            expected: 0,
            known: BTreeMap::new(),
            last: None,
            published_at: None,
        };
        match std::fs::read(&inv.path) {
            Ok(bytes) => match serde_json::from_slice::<Saved>(&bytes) {
                Ok(saved) if saved.boot_id == boot_id => {
                    tracing::info!(expected = saved.expected, "GPU count of this boot taken from the state folder.");
                    inv.expected = saved.expected;
                    inv.identity.remember(&saved.gpus);
                    inv.known = saved.gpus.into_iter().map(|g| (key(&g), g)).collect();
                }
                Ok(_) => tracing::info!("The saved GPU inventory is from an earlier boot; counting afresh."),
                Err(e) => {
                    tracing::warn!(path = %inv.path.display(), error = %e, "The saved GPU inventory is unreadable; counting afresh.");
                }
            },
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => {
                tracing::warn!(path = %inv.path.display(), error = %e, "Cannot read the saved GPU inventory; counting afresh.");
            }
        }
        inv
    }

    /// The most GPUs present at once in this boot (including earlier runs of the collector).
    pub fn expected(&self) -> u32 {
        self.expected
    }

    /// The inventory event that `present` (the GPUs answering now, see [`present`]) calls for at
    /// `now`: the first of a boot, a change, or a refresh when one is due; `None` otherwise.
    ///
    /// A new boot id on the shared [`NodeIdentity`] (a simulated reboot) starts a new boot here
    /// too: the count starts over and the next inventory is a `start`.
    pub fn observe(&mut self, present: Vec<GpuIdentity>, now: Instant) -> Option<HealthEvent> {
        let boot_id = self.identity.boot_id();
        if boot_id != self.boot_id {
            self.boot_id = boot_id;
            self.expected = 0;
            self.known.clear();
            self.last = None;
            self.published_at = None;
        }
        let reason = match (&self.last, self.published_at) {
            (None, _) | (_, None) => GpuInventoryDetail::START,
            (Some(last), _) if *last != present => GpuInventoryDetail::CHANGE,
            (_, Some(at)) if now.saturating_duration_since(at) >= self.refresh => GpuInventoryDetail::REFRESH,
            _ => return None,
        };
        self.learn(&present);
        let count = u32::try_from(present.len()).unwrap_or(u32::MAX);
        let mut e = HealthEvent::new(
            &self.node,
            Source::Nvml,
            Component::Gpu,
            Entity::default(),
            Detail::GpuInventory(GpuInventoryDetail {
                gpus: present.clone(),
                reason: reason.to_owned(),
                expected: i32::try_from(self.expected).ok(),
            }),
        );
        e.healthy = count >= self.expected;
        self.last = Some(present);
        self.published_at = Some(now);
        Some(e)
    }

    /// Takes `present` into the count and the identities, saving them when they changed.
    fn learn(&mut self, present: &[GpuIdentity]) {
        let mut changed = false;
        let count = u32::try_from(present.len()).unwrap_or(u32::MAX);
        if count > self.expected {
            self.expected = count;
            changed = true;
        }
        for gpu in present {
            let k = key(gpu);
            if self.known.get(&k) != Some(gpu) {
                self.known.insert(k, gpu.clone());
                changed = true;
            }
        }
        self.identity.remember(present);
        if changed {
            self.save();
        }
    }

    /// Writes the state file atomically (temporary file, fsync, rename). A failure is logged, not
    /// fatal: publishing goes on, only a restart would count afresh.
    fn save(&self) {
        let saved = Saved {
            boot_id: self.boot_id.clone(),
            expected: self.expected,
            gpus: self.known.values().cloned().collect(),
        };
        let write = || -> std::io::Result<()> {
            use std::io::Write as _;
            if let Some(dir) = self.path.parent() {
                std::fs::create_dir_all(dir)?;
            }
            let tmp = self.path.with_extension("tmp");
            let mut f = std::fs::File::create(&tmp)?;
            f.write_all(&serde_json::to_vec_pretty(&saved).map_err(std::io::Error::other)?)?;
            f.sync_all()?;
            std::fs::rename(&tmp, &self.path)
        };
        if let Err(e) = write() {
            tracing::warn!(path = %self.path.display(), error = %e, "Cannot save the GPU inventory; a restart would count GPUs afresh.");
        }
    }
}

#[cfg(test)]
mod tests {
    use gpumedic_schemas::Kind;

    use super::*;
    use crate::gpu::{GpuBackend as _, Simulated};

    fn state_dir(name: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("inventory-{name}-{}", uuid::Uuid::new_v4()));
        std::fs::create_dir_all(&dir).unwrap();
        dir
    }

    fn detail(e: &HealthEvent) -> &GpuInventoryDetail {
        match &e.detail {
            Detail::GpuInventory(d) => d,
            other => panic!("not an inventory: {other:?}"),
        }
    }

    const REFRESH: Duration = Duration::from_secs(300);

    #[test]
    fn start_change_and_refresh() {
        let dir = state_dir("reasons");
        let (mut sim, control) = Simulated::new("n", 4);
        let mut inv = Inventory::open("n", &dir, REFRESH, NodeIdentity::new("boot-1"));
        let t0 = Instant::now();
        let start = inv.observe(present(&sim.sample().unwrap()), t0).expect("the first inventory");
        assert_eq!((start.kind, start.component, start.source), (Kind::GpuInventory, Component::Gpu, Source::Nvml));
        assert_eq!(start.entity, Entity::default(), "about the node, not one GPU");
        let d = detail(&start);
        assert_eq!((d.reason.as_str(), d.gpus.len(), d.expected), ("start", 4, Some(4)));
        assert!(start.healthy);
        let g3 = &d.gpus[3];
        assert_eq!(g3.uuid.as_deref(), Some(crate::gpu::simulated_uuid("n", 3).as_str()));
        assert!(g3.pci_bus_id.is_some() && g3.serial.is_some() && g3.product.is_some(), "{g3:?}");

        assert!(inv.observe(present(&sim.sample().unwrap()), t0 + Duration::from_secs(10)).is_none(), "unchanged");
        control.update(3, |g| g.lost = true);
        let lost = inv.observe(present(&sim.sample().unwrap()), t0 + Duration::from_secs(20)).expect("a change");
        let d = detail(&lost);
        assert_eq!((d.reason.as_str(), d.gpus.len(), d.expected), ("change", 3, Some(4)));
        assert!(!lost.healthy, "a GPU short of the count");
        assert!(d.gpus.iter().all(|g| g.index != Some(3)), "a lost GPU is not present");
        assert!(inv.observe(present(&sim.sample().unwrap()), t0 + Duration::from_secs(30)).is_none());
        let refresh = inv.observe(present(&sim.sample().unwrap()), t0 + Duration::from_secs(320)).expect("refresh");
        assert_eq!((detail(&refresh).reason.as_str(), refresh.healthy), ("refresh", false));
        control.update(3, |g| g.lost = false);
        let back = inv.observe(present(&sim.sample().unwrap()), t0 + Duration::from_secs(330)).expect("a change");
        assert_eq!((detail(&back).reason.as_str(), detail(&back).gpus.len(), back.healthy), ("change", 4, true));
        std::fs::remove_dir_all(&dir).ok();
    }

    #[test]
    fn expected_survives_a_restart_in_the_same_boot_only() {
        let dir = state_dir("restart");
        let (mut sim, control) = Simulated::new("n", 8);
        let identity = NodeIdentity::new("boot-1");
        let mut inv = Inventory::open("n", &dir, REFRESH, identity.clone());
        inv.observe(present(&sim.sample().unwrap()), Instant::now()).expect("start");
        control.update(3, |g| g.lost = true);
        inv.observe(present(&sim.sample().unwrap()), Instant::now()).expect("change");
        let pci3 = crate::gpu::simulated_pci(3);
        drop(inv);

        // The collector restarts in the same boot with GPU 3 still gone.
        let identity = NodeIdentity::new("boot-1");
        let mut inv = Inventory::open("n", &dir, REFRESH, identity.clone());
        assert_eq!(inv.expected(), 8);
        assert_eq!(
            identity.by_pci(&pci3).and_then(|g| g.uuid),
            Some(crate::gpu::simulated_uuid("n", 3)),
            "the lost GPU's name is still known after the restart"
        );
        let start = inv.observe(present(&sim.sample().unwrap()), Instant::now()).expect("start");
        let d = detail(&start);
        assert_eq!((d.reason.as_str(), d.gpus.len(), d.expected), ("start", 7, Some(8)));
        assert!(!start.healthy, "the GPU lost before the restart is still missing");

        // After a reboot the count starts over.
        let mut inv = Inventory::open("n", &dir, REFRESH, NodeIdentity::new("boot-2"));
        assert_eq!(inv.expected(), 0);
        let start = inv.observe(present(&sim.sample().unwrap()), Instant::now()).expect("start");
        assert_eq!((detail(&start).expected, start.healthy), (Some(7), true));
        std::fs::remove_dir_all(&dir).ok();
    }

    #[test]
    fn a_new_boot_id_starts_the_count_over_with_a_start_inventory() {
        let dir = state_dir("reboot");
        let (mut sim, control) = Simulated::new("n", 2);
        let identity = NodeIdentity::new("boot-1");
        let mut inv = Inventory::open("n", &dir, REFRESH, identity.clone());
        inv.observe(present(&sim.sample().unwrap()), Instant::now()).expect("start");
        control.update(1, |g| g.lost = true);
        inv.observe(present(&sim.sample().unwrap()), Instant::now()).expect("change");
        control.reboot(&identity);
        let start = inv.observe(present(&sim.sample().unwrap()), Instant::now()).expect("start");
        assert_eq!((detail(&start).reason.as_str(), detail(&start).expected, start.healthy), ("start", Some(2), true));
        std::fs::remove_dir_all(&dir).ok();
    }

    #[test]
    fn a_lost_gpus_events_go_before_the_inventory_without_it_and_the_rest_after() {
        use crate::sampler::Sampler;
        let dir = state_dir("order");
        let (mut sim, control) = Simulated::new("n", 4);
        let mut inv = Inventory::open("n", &dir, REFRESH, NodeIdentity::new("boot-1"));
        let mut sampler = Sampler::new("n", Source::Nvml, Duration::from_secs(60));
        let (t0, at) = (Instant::now(), chrono::Utc::now());
        let sample = |sim: &mut Simulated| sim.sample().unwrap();
        let mut observe = |samples: Vec<GpuSample>, secs: u64| {
            let inventory = inv.observe(present(&samples), t0 + Duration::from_secs(secs));
            let sampled = sampler.observe_with_snapshot(&samples, at + chrono::Duration::seconds(secs as i64));
            publication_order(inventory, sampled)
        };
        // The first sample: the complete inventory before every GPU's heartbeat and snapshot.
        let start = observe(sample(&mut sim), 0);
        assert_eq!(start[0].kind, Kind::GpuInventory);
        assert!(start.len() > 4 && start[1..].iter().all(|e| e.kind != Kind::GpuInventory));

        control.update(2, |g| g.lost = true);
        let lost = observe(sample(&mut sim), 60);
        let kinds: Vec<Kind> = lost.iter().map(|e| e.kind).collect();
        let uuid2 = crate::gpu::simulated_uuid("n", 2);
        assert_eq!(kinds[..2], [Kind::GpuLost, Kind::GpuInventory], "{kinds:?}");
        assert_eq!(lost[0].entity.gpu_uuid.as_deref(), Some(uuid2.as_str()));
        assert_eq!(detail(&lost[1]).gpus.len(), 3);
        assert!(kinds[2..].iter().all(|k| *k == Kind::MonitorHealth), "the others' heartbeats after: {kinds:?}");
        assert_eq!(kinds.len(), 5);

        // No inventory due: the sampler's events as they are.
        let quiet = observe(sample(&mut sim), 70);
        assert!(quiet.is_empty(), "{quiet:?}");
        std::fs::remove_dir_all(&dir).ok();
    }

    #[test]
    fn an_unreadable_state_file_counts_afresh() {
        let dir = state_dir("corrupt");
        std::fs::write(dir.join(STATE_FILE), b"{ not json").unwrap();
        let inv = Inventory::open("n", &dir, REFRESH, NodeIdentity::new("boot-1"));
        assert_eq!(inv.expected(), 0);
        std::fs::remove_dir_all(&dir).ok();
    }
}
