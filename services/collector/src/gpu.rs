//! GPU backends: what the collector samples per GPU, from NVML on a GPU node or from a simulated
//! fleet in tests, the demo and load tests. Both sit behind [`GpuBackend`], so everything
//! downstream works the same without a GPU.

use std::sync::{Arc, Mutex};

use crate::identity::NodeIdentity;

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
    /// The GPU could not be read this time (an NVML error other than GPU_IS_LOST): no readings,
    /// and the error as NVML said it. The other GPUs of the node are sampled as usual.
    pub error: Option<String>,
    /// The UUIDs of the MIG devices on the GPU (MIG mode on); empty otherwise. The kubelet names
    /// MIG devices by these, so an event on the GPU can name the pods on them.
    pub mig_devices: Vec<String>,
    /// Board serial number, when the GPU tells it.
    pub serial: Option<String>,
    /// Product name (`NVIDIA H100 80GB HBM3`), when the GPU tells it.
    pub product: Option<String>,
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
    /// Pages retired for multiple single-bit errors (GPUs before Ampere; Ampere and newer remap
    /// rows instead and answer `None`).
    pub retired_pages_sbe: Option<i64>,
    /// Pages retired for a double-bit error.
    pub retired_pages_dbe: Option<i64>,
    /// A page retirement waits for the next driver reload.
    pub retired_pages_pending: Option<bool>,
    /// Rows remapped for correctable errors (Ampere and newer).
    pub remapped_rows_correctable: Option<i64>,
    /// Rows remapped for uncorrectable errors.
    pub remapped_rows_uncorrectable: Option<i64>,
    /// A row remap waits for a GPU reset.
    pub remap_pending: Option<bool>,
    /// A row remap failed: no spare rows left.
    pub remap_failure: Option<bool>,
    /// The clock-event (throttle) reasons as NVML's bit mask (`nvmlClocksEventReason*`).
    pub throttle_mask: Option<u64>,
    /// The PCIe link generation now (`nvmlDeviceGetCurrPcieLinkGeneration`).
    pub pcie_link_gen: Option<u32>,
    /// The highest PCIe link generation the GPU and its slot allow
    /// (`nvmlDeviceGetMaxPcieLinkGeneration`).
    pub pcie_link_gen_max: Option<u32>,
    /// The PCIe link width now, in lanes (`nvmlDeviceGetCurrPcieLinkWidth`).
    pub pcie_link_width: Option<u32>,
    /// The widest PCIe link the GPU and its slot allow (`nvmlDeviceGetMaxPcieLinkWidth`).
    pub pcie_link_width_max: Option<u32>,
    /// NVLink links that answer, by link number; empty on a GPU without NVLink.
    pub nvlinks: Vec<NvlinkSample>,
}

/// One NVLink link's state and error counters. `None` means the link does not report the value.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct NvlinkSample {
    /// Link number.
    pub link: u32,
    /// The link is up.
    pub active: Option<bool>,
    /// Receive CRC errors in flow-control digits.
    pub crc_flit: Option<i64>,
    /// Receive CRC errors in data packets.
    pub crc_data: Option<i64>,
    /// Transmit replays.
    pub replay: Option<i64>,
    /// Link recoveries.
    pub recovery: Option<i64>,
}

/// An Xid that NVML's event set delivered: the code and the GPU, no message text.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NvmlXid {
    /// NVML index of the GPU, when NVML could say.
    pub index: Option<u32>,
    /// GPU UUID, when NVML could say.
    pub uuid: Option<String>,
    /// PCI bus id, `dddd:bb:dd.f` lowercase, when NVML could say.
    pub pci_bus_id: Option<String>,
    /// The Xid number (NVML only keeps the last one between waits).
    pub code: u64,
}

/// Where an Xid watcher delivers what it sees; the watcher stops once the receiver is gone.
pub type XidSink = tokio::sync::mpsc::Sender<NvmlXid>;

/// How long one blocking wait on NVML's event set lasts before the watcher checks whether it
/// should stop.
pub const XID_WAIT: std::time::Duration = std::time::Duration::from_millis(1000);

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
    /// Starts a dedicated thread that waits for Xid events and sends them to `sink` until the
    /// receiver is dropped. False when the backend has no Xid events to offer.
    fn watch_xids(&self, sink: XidSink) -> Result<bool, BackendError> {
        let _ = sink;
        Ok(false)
    }
}

/// A simulated node with `n` healthy GPUs, whose faults are scripted through a [`SimulatedControl`].
/// Clones share the node: a backend opened again after a hang sees the same GPUs.
#[derive(Clone)]
pub struct Simulated {
    state: Arc<Mutex<Vec<GpuSample>>>,
    /// Taken by the first (only) Xid watcher.
    xids: Arc<Mutex<Option<XidQueue>>>,
}

/// Scripted Xids: GPU index and code.
type XidQueue = std::sync::mpsc::Receiver<(u32, u64)>;

/// Changes the state of a [`Simulated`] backend from outside: tests, the demo, load tests.
#[derive(Clone)]
pub struct SimulatedControl {
    node: String,
    state: Arc<Mutex<Vec<GpuSample>>>,
    xids: std::sync::mpsc::Sender<(u32, u64)>,
}

impl Simulated {
    /// `n` healthy H100-like GPUs on `node`, with UUIDs derived from the node name so they are
    /// stable across restarts.
    pub fn new(node: &str, n: u32) -> (Self, SimulatedControl) {
        let gpus = (0..n).map(|i| fresh_gpu(node, i)).collect();
        let state = Arc::new(Mutex::new(gpus));
        let (tx, rx) = std::sync::mpsc::channel();
        (
            Self { state: state.clone(), xids: Arc::new(Mutex::new(Some(rx))) },
            SimulatedControl { node: node.to_owned(), state, xids: tx },
        )
    }
}

/// Simulated GPU `index` of `node` as it comes up: healthy, idle, every counter at zero.
fn fresh_gpu(node: &str, index: u32) -> GpuSample {
    GpuSample {
        index,
        uuid: simulated_uuid(node, index),
        pci_bus_id: simulated_pci(index),
        lost: false,
        error: None,
        mig_devices: Vec::new(),
        serial: Some(format!("{:013}", fnv1a(node.as_bytes()).wrapping_add(u64::from(index)) % 10_000_000_000_000)),
        product: Some(SIMULATED_PRODUCT.to_owned()),
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
        // An H100-like GPU remaps rows and does not retire pages.
        retired_pages_sbe: None,
        retired_pages_dbe: None,
        retired_pages_pending: None,
        remapped_rows_correctable: Some(0),
        remapped_rows_uncorrectable: Some(0),
        remap_pending: Some(false),
        remap_failure: Some(false),
        throttle_mask: Some(throttle::GPU_IDLE),
        // An H100 SXM in a Gen5 x16 slot, at its maximum (tests script a downtrained link).
        pcie_link_gen: Some(5),
        pcie_link_gen_max: Some(5),
        pcie_link_width: Some(16),
        pcie_link_width_max: Some(16),
        nvlinks: (0..SIMULATED_NVLINKS)
            .map(|link| NvlinkSample {
                link,
                active: Some(true),
                crc_flit: Some(0),
                crc_data: Some(0),
                replay: Some(0),
                recovery: Some(0),
            })
            .collect(),
    }
}

/// The product name of every simulated GPU.
pub const SIMULATED_PRODUCT: &str = "NVIDIA H100 80GB HBM3";

/// The PCI bus id the simulated backend gives GPU `index` (`dddd:bb:dd.f`, as NVML's is
/// normalised).
pub fn simulated_pci(index: u32) -> String {
    format!("0000:{:02x}:00.0", 0x18 + index * 0x10)
}

/// NVLink links per simulated GPU (as on an H100 SXM).
pub const SIMULATED_NVLINKS: u32 = 18;

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

    /// GPU `index` as it is now, `None` when there is no such GPU.
    pub fn gpu(&self, index: u32) -> Option<GpuSample> {
        self.state.lock().expect("simulated state").iter().find(|g| g.index == index).cloned()
    }

    /// GPU `index` falls off the bus: from now on NVML answers GPU_IS_LOST for it (no readings, no
    /// heartbeats, absent from the inventory) until the node reboots. Returns the GPU as it was,
    /// for its names.
    ///
    /// # Errors
    /// A sentence when there is no such GPU or it is already lost.
    pub fn fall_off_bus(&self, index: u32) -> Result<GpuSample, String> {
        let mut gpus = self.state.lock().expect("simulated state");
        let count = gpus.len();
        let Some(gpu) = gpus.iter_mut().find(|g| g.index == index) else {
            return Err(format!("the simulated node has no GPU {index} (it has {count}, from 0)"));
        };
        if gpu.lost {
            return Err(format!("GPU {index} has already fallen off the bus; inject a reboot to bring it back"));
        }
        let before = gpu.clone();
        gpu.lost = true;
        Ok(before)
    }

    /// The node reboots: it gets a new boot id (on `identity`, so every event from now on carries
    /// it) and every GPU answers again with fresh counters. What a GPU keeps across a reboot in its
    /// InfoROM (aggregate ECC counts, remapped rows, a remap failure) stays. Returns the new boot
    /// id.
    ///
    /// The boot id changes under the same lock that samples take, so a sample is either all
    /// before the reboot or all after it: never revived GPUs under the old boot id, nor the lost
    /// GPU under the new one.
    pub fn reboot(&self, identity: &NodeIdentity) -> String {
        let mut gpus = self.state.lock().expect("simulated state");
        let boot_id = uuid::Uuid::new_v4().to_string();
        identity.reboot(boot_id.clone());
        for gpu in gpus.iter_mut() {
            let old = gpu.clone();
            *gpu = GpuSample {
                ecc_sbe_aggregate: old.ecc_sbe_aggregate,
                ecc_dbe_aggregate: old.ecc_dbe_aggregate,
                remapped_rows_correctable: old.remapped_rows_correctable,
                remapped_rows_uncorrectable: old.remapped_rows_uncorrectable,
                remap_failure: old.remap_failure,
                retired_pages_sbe: old.retired_pages_sbe,
                retired_pages_dbe: old.retired_pages_dbe,
                ..fresh_gpu(&self.node, old.index)
            };
        }
        boot_id
    }

    /// Raises Xid `code` on GPU `index`, as NVML's event set would deliver it.
    pub fn xid(&self, index: u32, code: u64) {
        // The watcher may not run (or may have stopped); an Xid nobody watches is dropped, as
        // NVML drops one.
        let _ = self.xids.send((index, code));
    }
}

impl GpuBackend for Simulated {
    fn name(&self) -> &'static str {
        "simulated"
    }

    fn sample(&mut self) -> Result<Vec<GpuSample>, BackendError> {
        Ok(self.state.lock().expect("simulated state").clone())
    }

    fn watch_xids(&self, sink: XidSink) -> Result<bool, BackendError> {
        let Some(rx) = self.xids.lock().expect("simulated xids").take() else { return Ok(false) };
        let state = self.state.clone();
        std::thread::Builder::new()
            .name("simulated-xid".into())
            .spawn(move || {
                while !sink.is_closed() {
                    match rx.recv_timeout(XID_WAIT) {
                        Ok((index, code)) => {
                            let gpu = state.lock().expect("simulated state").iter().find(|g| g.index == index).cloned();
                            let xid = NvmlXid {
                                index: Some(index),
                                uuid: gpu.as_ref().map(|g| g.uuid.clone()),
                                pci_bus_id: gpu.map(|g| g.pci_bus_id),
                                code,
                            };
                            if sink.blocking_send(xid).is_err() {
                                return;
                            }
                        }
                        Err(std::sync::mpsc::RecvTimeoutError::Timeout) => {}
                        Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => return,
                    }
                }
            })
            .map_err(|e| BackendError::Call(format!("cannot start the Xid watcher thread: {e}")))?;
        Ok(true)
    }
}

/// NVML's clock-event (throttle) reason bits (`nvmlClocksEventReason*`, formerly
/// `nvmlClocksThrottleReason*`) and their names, as the classifier's rules spell them.
pub mod throttle {
    /// Nothing is running on the GPU.
    pub const GPU_IDLE: u64 = 0x1;
    /// Application clocks are set lower.
    pub const APPLICATIONS_CLOCKS_SETTING: u64 = 0x2;
    /// The software power cap holds the clocks down.
    pub const SW_POWER_CAP: u64 = 0x4;
    /// Hardware slowdown (thermal or power brake) is engaged.
    pub const HW_SLOWDOWN: u64 = 0x8;
    /// Sync boost with other GPUs.
    pub const SYNC_BOOST: u64 = 0x10;
    /// Software thermal slowdown.
    pub const SW_THERMAL_SLOWDOWN: u64 = 0x20;
    /// Hardware thermal slowdown.
    pub const HW_THERMAL_SLOWDOWN: u64 = 0x40;
    /// Hardware power brake slowdown (an external power brake signal).
    pub const HW_POWER_BRAKE_SLOWDOWN: u64 = 0x80;
    /// The display clock setting.
    pub const DISPLAY_CLOCK_SETTING: u64 = 0x100;

    /// Every known reason, most serious first: the classifier reads the first as `reason`.
    pub const NAMES: [(u64, &str); 9] = [
        (HW_SLOWDOWN, "hw_slowdown"),
        (HW_THERMAL_SLOWDOWN, "hw_thermal_slowdown"),
        (HW_POWER_BRAKE_SLOWDOWN, "hw_power_brake_slowdown"),
        (SW_THERMAL_SLOWDOWN, "sw_thermal_slowdown"),
        (SW_POWER_CAP, "sw_power_cap"),
        (SYNC_BOOST, "sync_boost"),
        (APPLICATIONS_CLOCKS_SETTING, "applications_clocks_setting"),
        (DISPLAY_CLOCK_SETTING, "display_clock_setting"),
        (GPU_IDLE, "gpu_idle"),
    ];

    /// Reasons that point at the hardware or its cooling rather than at load or settings: the
    /// ones the collector reports. An idle GPU, a power cap under load and clock settings are
    /// normal operation and change too often to publish.
    pub const CONCERNING: u64 = HW_SLOWDOWN | HW_THERMAL_SLOWDOWN | HW_POWER_BRAKE_SLOWDOWN | SW_THERMAL_SLOWDOWN;

    /// Reasons that explain a hardware slowdown: the GPU's own temperature or an external power
    /// brake. [`HW_SLOWDOWN`] without any of them (and without a temperature or power reading
    /// that explains it) is a gray failure: a board, sensor or power-supply fault.
    pub const EXPLAINS_SLOWDOWN: u64 = HW_THERMAL_SLOWDOWN | HW_POWER_BRAKE_SLOWDOWN | SW_THERMAL_SLOWDOWN;

    /// The names of the reasons set in `mask`, most serious first.
    pub fn names(mask: u64) -> Vec<String> {
        NAMES.iter().filter(|(bit, _)| mask & bit != 0).map(|(_, n)| (*n).to_owned()).collect()
    }
}

/// The real backend: NVML through nvml-wrapper, loaded at run time (no driver needed to build).
pub struct NvmlBackend {
    nvml: nvml_wrapper::Nvml,
    /// Serial and product name by UUID: they never change for a GPU, so they are read once (a
    /// failed read is tried again at the next sample).
    names: std::collections::HashMap<String, (Option<String>, Option<String>)>,
}

impl NvmlBackend {
    /// Loads and initialises NVML.
    pub fn init() -> Result<Self, BackendError> {
        nvml_wrapper::Nvml::init()
            .map(|nvml| Self { nvml, names: Default::default() })
            .map_err(|e| BackendError::Unavailable(e.to_string()))
    }
}

impl GpuBackend for NvmlBackend {
    fn name(&self) -> &'static str {
        "nvml"
    }

    fn sample(&mut self) -> Result<Vec<GpuSample>, BackendError> {
        let count = self.nvml.device_count().map_err(|e| BackendError::Call(e.to_string()))?;
        Ok(collect_gpus(count, |index| self.sample_one(index)))
    }

    fn watch_xids(&self, sink: XidSink) -> Result<bool, BackendError> {
        std::thread::Builder::new()
            .name("nvml-xid".into())
            .spawn(move || watch_nvml_xids(&sink))
            .map_err(|e| BackendError::Call(format!("cannot start the Xid watcher thread: {e}")))?;
        Ok(true)
    }
}

impl NvmlBackend {
    /// Reads GPU `index`. Every reading NVML refuses is left unknown; only a GPU that cannot be
    /// opened at all (or answers GPU_IS_LOST) fails the read.
    fn sample_one(&mut self, index: u32) -> Result<GpuSample, GpuReadError> {
        use nvml_wrapper::enum_wrappers::device::{
            EccCounter, MemoryError, RetirementCause, TemperatureSensor, TemperatureThreshold,
        };
        use nvml_wrapper::error::NvmlError;

        let device = self.nvml.device_by_index(index).map_err(GpuReadError::from)?;
        // A lost GPU answers every call with GpuLost; the UUID read tells first. Another error
        // leaves the UUID unknown, not the GPU: it is still there and still sampled.
        let uuid = match device.uuid() {
            Ok(u) => u,
            Err(NvmlError::GpuLost) => return Err(GpuReadError::Lost),
            Err(e) => {
                tracing::debug!(gpu = index, error = %e, "Cannot read the GPU's UUID.");
                String::new()
            }
        };
        let (serial, product) = match self.names.get(&uuid) {
            Some((Some(serial), Some(product))) => (Some(serial.clone()), Some(product.clone())),
            _ => {
                let names = (device.serial().ok(), device.name().ok());
                if !uuid.is_empty() {
                    self.names.insert(uuid.clone(), names.clone());
                }
                names
            }
        };
        let ecc = |kind, counter| device.total_ecc_errors(kind, counter).ok().map(|v| v as i64);
        let retired = |cause| device.retired_pages(cause).ok().map(|p| p.len() as i64);
        let remap = remapped_rows(&device);
        Ok(GpuSample {
            index,
            uuid,
            pci_bus_id: device
                .pci_info()
                .ok()
                .and_then(|p| crate::kernel_log::parse::normalize_pci(&p.bus_id))
                .unwrap_or_default(),
            lost: false,
            error: None,
            mig_devices: mig_devices(&device),
            serial,
            product,
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
            retired_pages_sbe: retired(RetirementCause::MultipleSingleBitEccErrors),
            retired_pages_dbe: retired(RetirementCause::DoubleBitEccError),
            retired_pages_pending: device.are_pages_pending_retired().ok(),
            remapped_rows_correctable: remap[0].map(|v| v as i64),
            remapped_rows_uncorrectable: remap[1].map(|v| v as i64),
            remap_pending: remap[2].map(|v| v != 0),
            remap_failure: remap[3].map(|v| v != 0),
            throttle_mask: device.current_throttle_reasons().ok().map(|r| r.bits()),
            pcie_link_gen: device.current_pcie_link_gen().ok(),
            pcie_link_gen_max: device.max_pcie_link_gen().ok(),
            pcie_link_width: device.current_pcie_link_width().ok(),
            pcie_link_width_max: device.max_pcie_link_width().ok(),
            nvlinks: nvlinks(&device),
        })
    }
}

/// The UUIDs of the MIG devices on `device` when MIG mode is on; empty when it is off or NVML
/// cannot tell.
fn mig_devices(device: &nvml_wrapper::Device<'_>) -> Vec<String> {
    // NVML_DEVICE_MIG_ENABLE: asked first, so a GPU without MIG costs one call.
    if device.mig_mode().ok().map(|m| m.current) != Some(1) {
        return Vec::new();
    }
    let slots = device.mig_device_count().unwrap_or(0);
    // Empty slots answer NotFound and are skipped.
    (0..slots).filter_map(|slot| device.mig_device_by_index(slot).ok()?.uuid().ok()).collect()
}

/// Why one GPU could not be read.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum GpuReadError {
    /// The GPU fell off the bus (NVML_ERROR_GPU_IS_LOST).
    Lost,
    /// Any other failure, as the library said it.
    Failed(String),
}

impl From<nvml_wrapper::error::NvmlError> for GpuReadError {
    fn from(e: nvml_wrapper::error::NvmlError) -> Self {
        match e {
            nvml_wrapper::error::NvmlError::GpuLost => Self::Lost,
            other => Self::Failed(other.to_string()),
        }
    }
}

/// Samples GPUs `0..count` with `read`, one at a time. A GPU that cannot be read is listed lost
/// or with its error, never dropped and never failing the others: one GPU's bad answer must not
/// blank the node's readings and heartbeats.
pub fn collect_gpus(count: u32, mut read: impl FnMut(u32) -> Result<GpuSample, GpuReadError>) -> Vec<GpuSample> {
    (0..count)
        .map(|index| match read(index) {
            Ok(sample) => sample,
            Err(GpuReadError::Lost) => GpuSample { index, lost: true, ..Default::default() },
            Err(GpuReadError::Failed(error)) => {
                tracing::debug!(gpu = index, %error, "A GPU cannot be read; the others are sampled.");
                GpuSample { index, error: Some(error), ..Default::default() }
            }
        })
        .collect()
}

/// The row-remapping fields through NVML's field-value API (nvml-wrapper has no wrapper for
/// `nvmlDeviceGetRemappedRows`): correctable, uncorrectable, pending, failure. `None` on GPUs
/// before Ampere and on drivers that do not know the fields.
fn remapped_rows(device: &nvml_wrapper::Device<'_>) -> [Option<u64>; 4] {
    use nvml_wrapper::enums::device::SampleValue;
    use nvml_wrapper::structs::device::FieldId;
    use nvml_wrapper::sys_exports::field_id::{
        NVML_FI_DEV_REMAPPED_COR, NVML_FI_DEV_REMAPPED_FAILURE, NVML_FI_DEV_REMAPPED_PENDING, NVML_FI_DEV_REMAPPED_UNC,
    };
    let ids = [
        NVML_FI_DEV_REMAPPED_COR,
        NVML_FI_DEV_REMAPPED_UNC,
        NVML_FI_DEV_REMAPPED_PENDING,
        NVML_FI_DEV_REMAPPED_FAILURE,
    ]
    .map(FieldId);
    let mut out = [None; 4];
    let Ok(values) = device.field_values_for(&ids) else { return out };
    for (slot, value) in out.iter_mut().zip(values) {
        *slot = match value.and_then(|v| v.value) {
            Ok(SampleValue::U32(v)) => Some(u64::from(v)),
            Ok(SampleValue::U64(v)) => Some(v),
            Ok(SampleValue::I64(v)) => u64::try_from(v).ok(),
            Ok(SampleValue::F64(v)) if v.is_finite() && v >= 0.0 => Some(v as u64),
            _ => None,
        };
    }
    out
}

/// Every NVLink link that answers, with its state and error counters.
fn nvlinks(device: &nvml_wrapper::Device<'_>) -> Vec<NvlinkSample> {
    use nvml_wrapper::enum_wrappers::nv_link::ErrorCounter;
    // NVML_NVLINK_MAX_LINKS in the NVML headers nvml-wrapper 0.12 is built against.
    const MAX_LINKS: u32 = 18;
    (0..MAX_LINKS)
        .filter_map(|link| {
            let l = device.link_wrapper_for(link);
            // A link that cannot say whether it is up does not exist on this GPU.
            let active = l.is_active().ok()?;
            let counter = |c| l.error_counter(c).ok().and_then(|v| i64::try_from(v).ok());
            Some(NvlinkSample {
                link,
                active: Some(active),
                crc_flit: counter(ErrorCounter::DlCrcFlit),
                crc_data: counter(ErrorCounter::DlCrcData),
                replay: counter(ErrorCounter::DlReplay),
                recovery: counter(ErrorCounter::DlRecovery),
            })
        })
        .collect()
}

/// The body of the `nvml-xid` thread: registers every GPU that supports it for critical Xid
/// events and waits on the set in slices of [`XID_WAIT`], so that it notices a closed sink.
fn watch_nvml_xids(sink: &XidSink) {
    use nvml_wrapper::bitmasks::event::EventTypes;
    use nvml_wrapper::enums::event::XidError;
    use nvml_wrapper::error::NvmlError;

    // Its own handle: the event set borrows it for the life of the thread. NVML counts
    // initialisations, so this does not disturb the sampler's handle.
    let nvml = match nvml_wrapper::Nvml::init() {
        Ok(n) => n,
        Err(e) => {
            tracing::warn!(error = %e, "NVML is not available; Xid events from NVML are off.");
            return;
        }
    };
    let mut set = match nvml.create_event_set() {
        Ok(s) => s,
        Err(e) => {
            tracing::warn!(error = %e, "Cannot create an NVML event set; Xid events from NVML are off.");
            return;
        }
    };
    let count = nvml.device_count().unwrap_or(0);
    let mut watched = 0;
    for index in 0..count {
        let Ok(device) = nvml.device_by_index(index) else { continue };
        if !device.supported_event_types().is_ok_and(|t| t.contains(EventTypes::CRITICAL_XID_ERROR)) {
            continue;
        }
        set = match device.register_events(EventTypes::CRITICAL_XID_ERROR, set) {
            Ok(s) => s,
            Err(e) => {
                // NVML releases the set on a failed registration, so there is nothing left to
                // wait on; the kernel log remains the primary Xid source.
                tracing::warn!(gpu = index, error = %e.error, "Cannot register for NVML Xid events; they are off.");
                return;
            }
        };
        watched += 1;
    }
    if watched == 0 {
        tracing::info!("No GPU supports NVML Xid events; the kernel log is the only Xid source.");
        return;
    }
    tracing::info!(gpus = watched, "Waiting for Xid events from NVML.");
    let wait_ms = u32::try_from(XID_WAIT.as_millis()).unwrap_or(1000);
    while !sink.is_closed() {
        match set.wait(wait_ms) {
            Ok(event) if event.event_type.contains(EventTypes::CRITICAL_XID_ERROR) => {
                let code = match event.event_data {
                    Some(XidError::Value(code)) => code,
                    // NVML could not say which Xid: nothing to report.
                    _ => continue,
                };
                let xid = NvmlXid {
                    index: event.device.index().ok(),
                    uuid: event.device.uuid().ok(),
                    pci_bus_id: event
                        .device
                        .pci_info()
                        .ok()
                        .and_then(|p| crate::kernel_log::parse::normalize_pci(&p.bus_id)),
                    code,
                };
                if sink.blocking_send(xid).is_err() {
                    return;
                }
            }
            Ok(_) | Err(NvmlError::Timeout) => {}
            Err(e) => {
                // A lost GPU is the sampler's to report; do not spin on the error.
                tracing::debug!(error = %e, "NVML event wait failed; waiting again.");
                std::thread::sleep(XID_WAIT);
            }
        }
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
    fn a_simulated_gpu_falls_off_the_bus_until_the_node_reboots() {
        let (mut sim, control) = Simulated::new("gpu-node-1", 8);
        let identity = NodeIdentity::new("boot-1");
        control.update(3, |g| {
            g.ecc_sbe_volatile = Some(5);
            g.ecc_dbe_aggregate = Some(2);
            g.pcie_replay = Some(40);
        });
        let gone = control.fall_off_bus(3).expect("GPU 3 exists");
        assert_eq!((gone.index, gone.pci_bus_id.as_str()), (3, simulated_pci(3).as_str()));
        assert!(sim.sample().unwrap()[3].lost, "NVML answers GPU_IS_LOST");
        assert!(control.fall_off_bus(3).unwrap_err().contains("already"));
        assert!(control.fall_off_bus(8).unwrap_err().contains("no GPU 8"));

        let boot = control.reboot(&identity);
        assert_ne!(boot, "boot-1");
        assert_eq!(identity.boot_id(), boot, "every later event carries the new boot id");
        let after = sim.sample().unwrap();
        assert!(after.iter().all(|g| !g.lost), "every GPU answers again");
        assert_eq!(after[3].ecc_sbe_volatile, Some(0), "volatile counters start from zero");
        assert_eq!(after[3].pcie_replay, Some(0));
        assert_eq!(after[3].ecc_dbe_aggregate, Some(2), "the InfoROM's lifetime count stays");
        assert_eq!(after[3].uuid, simulated_uuid("gpu-node-1", 3), "the same GPU");
        assert_ne!(control.reboot(&identity), boot, "each reboot a new boot id");
    }

    #[test]
    fn one_gpu_that_cannot_be_read_does_not_fail_the_others() {
        let gpus = collect_gpus(4, |index| match index {
            1 => Err(GpuReadError::Failed("Unknown Error".into())),
            2 => Err(GpuReadError::Lost),
            _ => Ok(GpuSample { index, uuid: format!("GPU-{index}"), ..Default::default() }),
        });
        assert_eq!(gpus.len(), 4, "every GPU is listed");
        assert_eq!(gpus[1].error.as_deref(), Some("Unknown Error"));
        assert!(gpus[2].lost && gpus[2].error.is_none());
        assert_eq!((gpus[0].uuid.as_str(), gpus[3].uuid.as_str()), ("GPU-0", "GPU-3"));
    }

    #[test]
    fn nvml_samples_on_a_gpu_machine_and_checks_nothing_without_a_driver() {
        // Without an NVIDIA driver the call fails cleanly and the NVML path is not exercised: the
        // test says so, and fails when GPUMEDIC_REQUIRE_GPU is set (load-tests/gpu-check sets it).
        match NvmlBackend::init() {
            Err(BackendError::Unavailable(e)) => {
                eprintln!("NOTHING CHECKED: no NVIDIA driver on this machine ({e}); NVML sampling was not exercised");
                assert!(
                    std::env::var_os("GPUMEDIC_REQUIRE_GPU").is_none(),
                    "GPUMEDIC_REQUIRE_GPU is set but NVML is not available: nothing was checked"
                );
            }
            Ok(mut b) => {
                let gpus = b.sample().expect("NVML loaded, so sampling works");
                assert!(!gpus.is_empty(), "a machine with a driver has a GPU");
                assert!(gpus.iter().all(|g| g.lost || g.error.is_some() || !g.uuid.is_empty()), "{gpus:?}");
            }
            Err(e) => panic!("unexpected: {e}"),
        }
    }
}
