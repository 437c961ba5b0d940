//! GPU backends: what the collector samples per GPU, from NVML on a GPU node or from a simulated
//! fleet in tests, the demo and load tests. Both sit behind [`GpuBackend`], so everything
//! downstream works the same without a GPU.

use std::sync::{Arc, Mutex};

/// One GPU's readings at one moment. `None` means the GPU does not support the reading.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct GpuSample {
    /// NVML index (not stable across reboots).
    pub index: u32,
    /// GPU UUID.
    pub uuid: String,
    /// PCI bus id, `dddd:bb:dd.f` lowercase.
    pub pci_bus_id: String,
    /// The GPU no longer answers (NVML_ERROR_GPU_IS_LOST: fallen off the bus).
    pub lost: bool,
    /// GPU temperature, Celsius.
    pub temperature_c: Option<i32>,
    /// Slowdown threshold, Celsius.
    pub slowdown_c: Option<i32>,
    /// Shutdown threshold, Celsius.
    pub shutdown_c: Option<i32>,
    /// Power draw, watts.
    pub power_w: Option<f64>,
    /// Enforced power limit, watts.
    pub power_limit_w: Option<f64>,
    /// Corrected ECC errors since the driver loaded.
    pub ecc_sbe_volatile: Option<i64>,
    /// Uncorrected ECC errors since the driver loaded.
    pub ecc_dbe_volatile: Option<i64>,
    /// Corrected ECC errors, lifetime.
    pub ecc_sbe_aggregate: Option<i64>,
    /// Uncorrected ECC errors, lifetime.
    pub ecc_dbe_aggregate: Option<i64>,
    /// PCIe replay counter.
    pub pcie_replay: Option<i64>,
}

/// Why a backend could not sample.
#[derive(Debug, thiserror::Error)]
pub enum BackendError {
    /// NVML could not be loaded or initialised (no driver on this node).
    #[error("NVML is not available: {0}")]
    Unavailable(String),
    /// A call failed.
    #[error("NVML call failed: {0}")]
    Call(String),
}

/// A source of GPU samples.
pub trait GpuBackend: Send + 'static {
    /// The backend's name for logs and monitor-health events (`nvml`, `simulated`).
    fn name(&self) -> &'static str;
    /// Samples every GPU. Runs on a blocking thread: NVML calls can hang.
    fn sample(&mut self) -> Result<Vec<GpuSample>, BackendError>;
}

/// A simulated node with `n` healthy GPUs, whose faults are scripted through a [`SimulatedControl`].
pub struct Simulated {
    state: Arc<Mutex<Vec<GpuSample>>>,
}

/// Changes the state of a [`Simulated`] backend from outside: tests, the demo, load tests.
#[derive(Clone)]
pub struct SimulatedControl {
    state: Arc<Mutex<Vec<GpuSample>>>,
}

impl Simulated {
    /// `n` healthy H100-like GPUs on `node`, with UUIDs derived from the node name so they are
    /// stable across restarts.
    pub fn new(node: &str, n: u32) -> (Self, SimulatedControl) {
        let gpus = (0..n)
            .map(|i| GpuSample {
                index: i,
                uuid: simulated_uuid(node, i),
                pci_bus_id: format!("0000:{:02x}:00.0", 0x18 + i * 0x10),
                lost: false,
                temperature_c: Some(45),
                slowdown_c: Some(87),
                shutdown_c: Some(92),
                power_w: Some(350.0),
                power_limit_w: Some(700.0),
                ecc_sbe_volatile: Some(0),
                ecc_dbe_volatile: Some(0),
                ecc_sbe_aggregate: Some(0),
                ecc_dbe_aggregate: Some(0),
                pcie_replay: Some(0),
            })
            .collect();
        let state = Arc::new(Mutex::new(gpus));
        (Self { state: state.clone() }, SimulatedControl { state })
    }
}

/// The UUID the simulated backend gives GPU `index` of `node`.
pub fn simulated_uuid(node: &str, index: u32) -> String {
    let h = fnv1a(node.as_bytes()) ^ u64::from(index).wrapping_mul(0x9e37_79b9_7f4a_7c15);
    format!(
        "GPU-{:08x}-{:04x}-{:04x}-{:04x}-{:012x}",
        h >> 32,
        (h >> 16) & 0xffff,
        h & 0xffff,
        index,
        h & 0xffff_ffff_ffff
    )
}

fn fnv1a(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325, |h, b| (h ^ u64::from(*b)).wrapping_mul(0x0100_0000_01b3))
}

impl SimulatedControl {
    /// Applies `change` to GPU `index`; false when there is no such GPU.
    pub fn update(&self, index: u32, change: impl FnOnce(&mut GpuSample)) -> bool {
        let mut gpus = self.state.lock().expect("simulated state");
        match gpus.iter_mut().find(|g| g.index == index) {
            Some(g) => {
                change(g);
                true
            }
            None => false,
        }
    }
}

impl GpuBackend for Simulated {
    fn name(&self) -> &'static str {
        "simulated"
    }

    fn sample(&mut self) -> Result<Vec<GpuSample>, BackendError> {
        Ok(self.state.lock().expect("simulated state").clone())
    }
}

/// The real backend: NVML through nvml-wrapper, loaded at run time (no driver needed to build).
pub struct NvmlBackend {
    nvml: nvml_wrapper::Nvml,
}

impl NvmlBackend {
    /// Loads and initialises NVML.
    pub fn init() -> Result<Self, BackendError> {
        nvml_wrapper::Nvml::init().map(|nvml| Self { nvml }).map_err(|e| BackendError::Unavailable(e.to_string()))
    }
}

impl GpuBackend for NvmlBackend {
    fn name(&self) -> &'static str {
        "nvml"
    }

    fn sample(&mut self) -> Result<Vec<GpuSample>, BackendError> {
        use nvml_wrapper::enum_wrappers::device::{EccCounter, MemoryError, TemperatureSensor, TemperatureThreshold};
        use nvml_wrapper::error::NvmlError;

        let count = self.nvml.device_count().map_err(|e| BackendError::Call(e.to_string()))?;
        let mut out = Vec::with_capacity(count as usize);
        for index in 0..count {
            let device = match self.nvml.device_by_index(index) {
                Ok(d) => d,
                Err(NvmlError::GpuLost) => {
                    out.push(GpuSample { index, lost: true, ..Default::default() });
                    continue;
                }
                Err(e) => return Err(BackendError::Call(e.to_string())),
            };
            // A lost GPU answers every call with GpuLost; the UUID read tells first.
            let uuid = match device.uuid() {
                Ok(u) => u,
                Err(NvmlError::GpuLost) => {
                    out.push(GpuSample { index, lost: true, ..Default::default() });
                    continue;
                }
                Err(e) => return Err(BackendError::Call(e.to_string())),
            };
            let ecc = |kind, counter| device.total_ecc_errors(kind, counter).ok().map(|v| v as i64);
            out.push(GpuSample {
                index,
                uuid,
                pci_bus_id: device
                    .pci_info()
                    .ok()
                    .and_then(|p| crate::kernel_log::parse::normalize_pci(&p.bus_id))
                    .unwrap_or_default(),
                lost: false,
                temperature_c: device.temperature(TemperatureSensor::Gpu).ok().map(|t| t as i32),
                slowdown_c: device.temperature_threshold(TemperatureThreshold::Slowdown).ok().map(|t| t as i32),
                shutdown_c: device.temperature_threshold(TemperatureThreshold::Shutdown).ok().map(|t| t as i32),
                power_w: device.power_usage().ok().map(|mw| f64::from(mw) / 1000.0),
                power_limit_w: device.enforced_power_limit().ok().map(|mw| f64::from(mw) / 1000.0),
                ecc_sbe_volatile: ecc(MemoryError::Corrected, EccCounter::Volatile),
                ecc_dbe_volatile: ecc(MemoryError::Uncorrected, EccCounter::Volatile),
                ecc_sbe_aggregate: ecc(MemoryError::Corrected, EccCounter::Aggregate),
                ecc_dbe_aggregate: ecc(MemoryError::Uncorrected, EccCounter::Aggregate),
                pcie_replay: device.pcie_replay_counter().ok().map(i64::from),
            });
        }
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn simulated_gpus_are_stable_and_scriptable() {
        let (mut sim, control) = Simulated::new("gpu-node-1", 8);
        let first = sim.sample().unwrap();
        assert_eq!(first.len(), 8);
        assert_eq!(first[3].uuid, simulated_uuid("gpu-node-1", 3));
        assert_ne!(first[3].uuid, simulated_uuid("gpu-node-2", 3));
        assert!(control.update(3, |g| g.lost = true));
        assert!(!control.update(9, |g| g.lost = true));
        assert!(sim.sample().unwrap()[3].lost);
    }

    #[test]
    fn nvml_without_a_driver_is_unavailable_not_a_crash() {
        // This machine has no NVIDIA driver; on a GPU machine the same call succeeds.
        match NvmlBackend::init() {
            Err(BackendError::Unavailable(_)) => {}
            Ok(mut b) => assert!(b.sample().is_ok(), "NVML loaded, so sampling works"),
            Err(e) => panic!("unexpected: {e}"),
        }
    }
}
