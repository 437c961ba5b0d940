//! What every event the collector publishes says about its node beyond the observation itself:
//! the node's boot id, the full name of a GPU that a source knew only by PCI bus id, and the pods
//! using the event's GPU as the kubelet last said ([`crate::pod_resources`]).
//!
//! [`NodeIdentity`] is shared by the publisher's [`Sink`](crate::publisher::Sink), which stamps
//! every event on its way out (whatever the source: NVML, kernel log, DCGM, cloud, gRPC ingest,
//! fault injection), by the GPU inventory, which tells it the GPUs of this boot, and by the
//! simulated backend, whose injected reboot replaces the boot id. Stamping in one place means no
//! source can forget it: the classifier proves a reboot by a new boot id, so an event without one
//! would hide the proof, and one with a stale id would be refused.

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::{Arc, RwLock};

use gpumedic_schemas::HealthEvent;
use gpumedic_schemas::health::GpuIdentity;

use crate::kernel_log::parse::normalize_pci;
use crate::pod_resources::GpuPods;

/// Where Linux publishes the id of the current boot; it changes at every reboot.
pub const BOOT_ID_FILE: &str = "/proc/sys/kernel/random/boot_id";

/// Reads a boot id file: its content, trimmed.
///
/// # Errors
/// A sentence naming the file, when it cannot be read or is empty.
pub fn read_boot_id(path: &Path) -> Result<String, String> {
    let text = std::fs::read_to_string(path).map_err(|e| format!("cannot read {}: {e}", path.display()))?;
    let id = text.trim();
    if id.is_empty() {
        return Err(format!("{} is empty; it should hold the boot id", path.display()));
    }
    Ok(id.to_owned())
}

/// The file in the state folder that keeps a simulated node's boot id across collector restarts.
pub const SIMULATED_BOOT_FILE: &str = "simulated-boot";

/// The boot id of the simulated node kept in `state_dir`, when it was saved in the host's boot
/// `host_boot_id`: a collector restart must not take the simulated node back to a boot id it
/// already left (the classifier refuses events from a replaced boot), while a real reboot of the
/// host starts every simulated node afresh.
pub fn load_simulated_boot(state_dir: &Path, host_boot_id: &str) -> Option<String> {
    let text = std::fs::read_to_string(state_dir.join(SIMULATED_BOOT_FILE)).ok()?;
    let (host, simulated) = text.trim().split_once(' ')?;
    (host == host_boot_id && !simulated.is_empty()).then(|| simulated.to_owned())
}

/// Saves the simulated node's boot id `simulated` for [`load_simulated_boot`].
///
/// # Errors
/// When the file cannot be written.
pub fn save_simulated_boot(state_dir: &Path, host_boot_id: &str, simulated: &str) -> std::io::Result<()> {
    std::fs::create_dir_all(state_dir)?;
    let tmp = state_dir.join(format!("{SIMULATED_BOOT_FILE}.tmp"));
    std::fs::write(&tmp, format!("{host_boot_id} {simulated}\n"))?;
    std::fs::rename(tmp, state_dir.join(SIMULATED_BOOT_FILE))
}

/// The node's boot id and the GPUs known in this boot, shared by every task of the collector.
/// Cheap to clone.
#[derive(Debug, Clone)]
pub struct NodeIdentity(Arc<RwLock<Inner>>);

#[derive(Debug)]
struct Inner {
    boot_id: String,
    /// Every GPU seen in this boot, by normalised PCI bus id, including GPUs that have since
    /// gone missing: an Xid 79 about a GPU that just vanished must still name it.
    gpus: BTreeMap<String, GpuIdentity>,
    /// Which pods use which GPU, from the kubelet; `None` while not known (no socket, or its
    /// last answer is stale).
    gpu_pods: Option<GpuPods>,
    /// The parent GPU's UUID of each MIG device, by MIG UUID.
    mig_parents: BTreeMap<String, String>,
}

impl NodeIdentity {
    /// A node in boot `boot_id`, no GPU known yet.
    pub fn new(boot_id: impl Into<String>) -> Self {
        Self(Arc::new(RwLock::new(Inner {
            boot_id: boot_id.into(),
            gpus: BTreeMap::new(),
            gpu_pods: None,
            mig_parents: BTreeMap::new(),
        })))
    }

    fn read(&self) -> std::sync::RwLockReadGuard<'_, Inner> {
        // A panic while holding the lock leaves plain data behind, still consistent enough to
        // stamp events with: keep going rather than stop publishing.
        self.0.read().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    fn write(&self) -> std::sync::RwLockWriteGuard<'_, Inner> {
        self.0.write().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// The current boot id.
    pub fn boot_id(&self) -> String {
        self.read().boot_id.clone()
    }

    /// The node rebooted into `boot_id`: the GPUs of the old boot are forgotten (indexes and even
    /// the GPUs present may differ after a reboot).
    pub fn reboot(&self, boot_id: impl Into<String>) {
        let mut inner = self.write();
        inner.boot_id = boot_id.into();
        inner.gpus.clear();
        inner.mig_parents.clear();
    }

    /// Remembers `gpus` as GPUs of this boot (by PCI bus id; a GPU without one cannot be looked
    /// up by it and is skipped). Known GPUs not in `gpus` are kept.
    pub fn remember<'a>(&self, gpus: impl IntoIterator<Item = &'a GpuIdentity>) {
        let mut inner = self.write();
        for gpu in gpus {
            if let Some(pci) = gpu.pci_bus_id.as_deref().and_then(normalize_pci) {
                inner.gpus.insert(pci, gpu.clone());
            }
        }
    }

    /// Which pods use which GPU, as the kubelet last said; `None`: not known, events then carry
    /// no list of their own.
    pub fn set_gpu_pods(&self, pods: Option<GpuPods>) {
        self.write().gpu_pods = pods;
    }

    /// The MIG devices on the GPU `parent_uuid` (by MIG UUID) are now `mig_uuids`, replacing
    /// those it had (MIG devices come and go without a reboot), so that an event on the GPU names
    /// the pods on its MIG devices too.
    pub fn set_mig_devices(&self, parent_uuid: &str, mig_uuids: impl IntoIterator<Item = String>) {
        let mut inner = self.write();
        inner.mig_parents.retain(|_, parent| parent != parent_uuid);
        for mig in mig_uuids {
            inner.mig_parents.insert(mig, parent_uuid.to_owned());
        }
    }

    /// The GPU of this boot at PCI bus id `pci` (any spelling the kernel log uses).
    pub fn by_pci(&self, pci: &str) -> Option<GpuIdentity> {
        let key = normalize_pci(pci)?;
        self.read().gpus.get(&key).cloned()
    }

    /// `event` as it leaves the node: with the current boot id, and, when it names a GPU by PCI
    /// bus id alone, with that GPU's UUID and index from this boot's inventory. An unknown PCI
    /// bus id is left as it is. An event that names a GPU by UUID (its own or the one found
    /// here) gets the containers using that GPU, when the kubelet's answer is known and the
    /// source did not set a list of its own.
    pub fn stamp(&self, event: &HealthEvent) -> HealthEvent {
        let inner = self.read();
        let mut e = event.clone();
        e.boot_id = Some(inner.boot_id.clone());
        if e.entity.gpu_uuid.is_none()
            && let Some(gpu) = e.entity.pci_bus_id.as_deref().and_then(normalize_pci).and_then(|p| inner.gpus.get(&p))
        {
            e.entity.gpu_uuid.clone_from(&gpu.uuid);
            e.entity.gpu_index = e.entity.gpu_index.or(gpu.index);
        }
        if e.workloads.is_none()
            && let (Some(pods), Some(uuid)) = (&inner.gpu_pods, e.entity.gpu_uuid.as_deref())
        {
            e.workloads = Some(pods.workloads_of(uuid, e.entity.mig_instance.as_deref(), &inner.mig_parents));
        }
        e
    }
}

#[cfg(test)]
mod tests {
    use gpumedic_schemas::health::{Component, Detail, Entity, GpuLostDetail, Source};

    use super::*;

    fn gpu(index: i32, uuid: &str, pci: &str) -> GpuIdentity {
        GpuIdentity {
            index: Some(index),
            uuid: Some(uuid.into()),
            pci_bus_id: Some(pci.into()),
            ..GpuIdentity::default()
        }
    }

    fn lost(entity: Entity) -> HealthEvent {
        HealthEvent::new(
            "n",
            Source::KernelLog,
            Component::Gpu,
            entity,
            Detail::GpuLost(GpuLostDetail { reason: "fallen off the bus".into() }),
        )
    }

    #[test]
    fn boot_ids_are_read_trimmed_and_problems_name_the_file() {
        let dir = std::env::temp_dir().join(format!("boot-id-{}", uuid::Uuid::new_v4()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("boot_id");
        std::fs::write(&file, "5b1d6a52-8f3e-4d2a-9c1b-0a7e6f3d2c10\n").unwrap();
        assert_eq!(read_boot_id(&file).unwrap(), "5b1d6a52-8f3e-4d2a-9c1b-0a7e6f3d2c10");
        std::fs::write(&file, " \n").unwrap();
        assert!(read_boot_id(&file).unwrap_err().contains("empty"));
        let missing = dir.join("nope");
        let err = read_boot_id(&missing).unwrap_err();
        assert!(err.contains(&missing.display().to_string()), "{err}");
        std::fs::remove_dir_all(&dir).ok();
        // The real file on this (Linux) machine.
        assert!(read_boot_id(Path::new(BOOT_ID_FILE)).unwrap().len() >= 32);
    }

    #[test]
    fn every_event_gets_the_boot_id_and_a_pci_only_gpu_its_full_name() {
        let id = NodeIdentity::new("boot-1");
        id.remember(&[gpu(3, "GPU-3", "0000:48:00.0")]);
        // The kernel log's short spelling of the bus id.
        let e = id.stamp(&lost(Entity { pci_bus_id: Some("0000:48:00".into()), ..Entity::default() }));
        assert_eq!(e.boot_id.as_deref(), Some("boot-1"));
        assert_eq!((e.entity.gpu_uuid.as_deref(), e.entity.gpu_index), (Some("GPU-3"), Some(3)));
        assert_eq!(e.entity.pci_bus_id.as_deref(), Some("0000:48:00"), "the reference as reported stays");
        let unknown = id.stamp(&lost(Entity { pci_bus_id: Some("0000:99:00.0".into()), ..Entity::default() }));
        assert_eq!((unknown.entity.gpu_uuid, unknown.entity.gpu_index), (None, None), "unknown PCI: as is");
        let named = id.stamp(&lost(Entity {
            gpu_uuid: Some("GPU-other".into()),
            pci_bus_id: Some("0000:48:00.0".into()),
            ..Entity::default()
        }));
        assert_eq!(named.entity.gpu_uuid.as_deref(), Some("GPU-other"), "a UUID the source gave wins");
        let mut old = lost(Entity::default());
        old.boot_id = Some("stale".into());
        assert_eq!(id.stamp(&old).boot_id.as_deref(), Some("boot-1"), "the collector knows its node's boot");
    }

    #[test]
    fn a_gpu_event_gets_the_pods_on_its_gpu_once_the_kubelet_answered() {
        use gpumedic_proto::podresources::v1::{
            ContainerDevices, ContainerResources, ListPodResourcesResponse, PodResources,
        };
        let id = NodeIdentity::new("boot-1");
        id.remember(&[gpu(3, "GPU-3", "0000:48:00.0")]);
        let by_pci = || lost(Entity { pci_bus_id: Some("0000:48:00.0".into()), ..Entity::default() });
        assert_eq!(id.stamp(&by_pci()).workloads, None, "the kubelet not asked yet: not known");
        let answer = ListPodResourcesResponse {
            pod_resources: vec![PodResources {
                name: "train-0".into(),
                namespace: "ml".into(),
                containers: vec![ContainerResources {
                    name: "main".into(),
                    devices: vec![ContainerDevices {
                        resource_name: crate::pod_resources::GPU_RESOURCE.into(),
                        device_ids: vec!["GPU-3".into()],
                    }],
                }],
            }],
        };
        id.set_gpu_pods(Some(crate::pod_resources::gpu_pods(&answer)));
        let e = id.stamp(&by_pci());
        let pods: Vec<(&str, &str)> =
            e.workloads.iter().flatten().map(|w| (w.pod.as_str(), w.container.as_str())).collect();
        assert_eq!(pods, [("train-0", "main")], "the UUID found by PCI bus id names the pods");
        let other = id.stamp(&lost(Entity { gpu_uuid: Some("GPU-7".into()), ..Entity::default() }));
        assert_eq!(other.workloads, Some(Vec::new()), "a GPU no pod uses: known to be none");
        assert_eq!(id.stamp(&lost(Entity::default())).workloads, None, "no GPU named: nothing to say");
        id.set_gpu_pods(None);
        assert_eq!(id.stamp(&by_pci()).workloads, None, "the answer went stale");
    }

    #[test]
    fn an_event_on_a_gpu_names_the_pods_on_its_mig_devices_as_the_sampler_last_saw_them() {
        use gpumedic_proto::podresources::v1::{
            ContainerDevices, ContainerResources, ListPodResourcesResponse, PodResources,
        };
        let id = NodeIdentity::new("boot-1");
        let on = |pod: &str, mig: &str| PodResources {
            name: pod.into(),
            namespace: "inf".into(),
            containers: vec![ContainerResources {
                name: "c".into(),
                devices: vec![ContainerDevices {
                    resource_name: "nvidia.com/mig-3g.40gb".into(),
                    device_ids: vec![mig.into()],
                }],
            }],
        };
        let answer = ListPodResourcesResponse { pod_resources: vec![on("a", "MIG-1"), on("b", "MIG-2")] };
        id.set_gpu_pods(Some(crate::pod_resources::gpu_pods(&answer)));
        let on_gpu = || lost(Entity { gpu_uuid: Some("GPU-3".into()), ..Entity::default() });
        let pods = |e: HealthEvent| -> Vec<String> { e.workloads.into_iter().flatten().map(|w| w.pod).collect() };
        assert!(pods(id.stamp(&on_gpu())).is_empty(), "MIG devices of an unknown parent");
        id.set_mig_devices("GPU-3", ["MIG-1".to_owned(), "MIG-2".to_owned()]);
        assert_eq!(pods(id.stamp(&on_gpu())), ["a", "b"]);
        // MIG-2 destroyed: the next sample no longer lists it.
        id.set_mig_devices("GPU-3", ["MIG-1".to_owned()]);
        assert_eq!(pods(id.stamp(&on_gpu())), ["a"]);
        let on_mig =
            lost(Entity { gpu_uuid: Some("GPU-3".into()), mig_instance: Some("MIG-1".into()), ..Entity::default() });
        assert_eq!(pods(id.stamp(&on_mig)), ["a"], "an event on one MIG device");
    }

    #[test]
    fn a_simulated_boot_survives_a_restart_but_not_a_host_reboot() {
        let dir = std::env::temp_dir().join(format!("sim-boot-{}", uuid::Uuid::new_v4()));
        assert_eq!(load_simulated_boot(&dir, "host-1"), None, "nothing saved yet");
        save_simulated_boot(&dir, "host-1", "sim-2").unwrap();
        assert_eq!(load_simulated_boot(&dir, "host-1").as_deref(), Some("sim-2"));
        assert_eq!(load_simulated_boot(&dir, "host-2"), None, "the host rebooted since");
        std::fs::remove_dir_all(&dir).ok();
    }

    #[test]
    fn a_reboot_replaces_the_boot_id_and_forgets_the_old_boots_gpus() {
        let id = NodeIdentity::new("boot-1");
        id.remember(&[gpu(3, "GPU-3", "0000:48:00.0")]);
        let clone = id.clone();
        clone.reboot("boot-2");
        assert_eq!(id.boot_id(), "boot-2", "every holder sees the new boot");
        assert_eq!(id.by_pci("0000:48:00.0"), None);
        let e = id.stamp(&lost(Entity { pci_bus_id: Some("0000:48:00.0".into()), ..Entity::default() }));
        assert_eq!((e.boot_id.as_deref(), e.entity.gpu_uuid), (Some("boot-2"), None));
    }
}
