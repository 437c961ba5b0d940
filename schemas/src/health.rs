//! The raw health event (`HealthEvent`, `schemas/avro/health_event.avsc`): one observation about
//! a GPU node, as a collector saw it.
//!
//! Field order, names and enum symbol order mirror the schema file exactly: apache-avro's serde
//! mapping writes enum symbols by position and checks record names against Rust type names.

use std::collections::BTreeMap;

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize, Serializer, ser::SerializeStruct};
use uuid::Uuid;

/// One observation about the health of a GPU node, published on
/// [`HEALTH_RAW`](crate::topics::HEALTH_RAW) keyed by node name.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct HealthEvent {
    /// Unique id, a UUIDv7 (time-ordered); consumers deduplicate on it.
    #[serde(with = "crate::serde_util::uuid_str")]
    pub event_id: Uuid,
    /// When the source observed the condition.
    #[serde(with = "crate::serde_util::micros")]
    pub observed_at: DateTime<Utc>,
    /// When the collector published the event.
    #[serde(with = "crate::serde_util::micros")]
    pub published_at: DateTime<Utc>,
    /// Kubernetes node name; also the Kafka key.
    pub node: String,
    /// Which source on the node produced the event.
    pub source: Source,
    /// The hardware part the event is about.
    pub component: Component,
    /// The affected part, as precisely as the source allows.
    pub entity: Entity,
    /// What kind of observation this is.
    pub kind: Kind,
    /// The typed detail; its variant matches `kind`.
    pub detail: Detail,
    /// Evidence of health or recovery rather than of a fault.
    pub healthy: bool,
    /// An injected fault (demos, tests).
    pub synthetic: bool,
    /// The raw source text, when there is one.
    pub raw: Option<String>,
    /// Version of the collector or ingest client.
    pub collector_version: String,
    /// The node's boot id (`/proc/sys/kernel/random/boot_id`) when the event was observed: a new
    /// one proves a reboot. `None` from writers that do not know it (schema version 1, the gRPC
    /// ingest).
    pub boot_id: Option<String>,
    /// The containers using the event's GPU, from the node's kubelet (schema version 3): an empty
    /// list means no pod uses it. `None` when the collector does not know (no GPU named, the
    /// kubelet not read, older writers); the enricher then falls back to its own view of the
    /// node's pods.
    pub workloads: Option<Vec<GpuWorkload>>,
}

/// A container holding a GPU, as the node's kubelet assigned it (`GpuWorkload` in the schema).
#[derive(Debug, Clone, Default, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct GpuWorkload {
    /// Pod namespace.
    pub namespace: String,
    /// Pod name.
    pub pod: String,
    /// The container the device is assigned to.
    pub container: String,
    /// The devices of the event's GPU the container holds, as the device plugin names them: the
    /// GPU UUID, or the UUIDs of MIG devices on it.
    pub gpu_uuids: Vec<String>,
}

/// The `raw` text of every event of a collector's start snapshot: readings published because the
/// collector (or the node, or a GPU answering for the first time) just started, not because they
/// changed. Published once per GPU and start, every reading whatever its value; readers may count
/// on nothing more following until a reading changes.
pub const SNAPSHOT_RAW: &str =
    "start snapshot: the reading as the collector first saw it, published whatever its value";

impl HealthEvent {
    /// Whether the event is part of a collector's start snapshot ([`SNAPSHOT_RAW`]).
    pub fn is_start_snapshot(&self) -> bool {
        self.raw.as_deref() == Some(SNAPSHOT_RAW)
    }

    /// A new event observed and published now, with a fresh UUIDv7 and `kind` taken from
    /// `detail`. Callers set `healthy`, `synthetic` and `raw` afterwards when they apply.
    pub fn new(node: impl Into<String>, source: Source, component: Component, entity: Entity, detail: Detail) -> Self {
        // The wire carries microseconds; truncate now so an event equals itself after a round trip.
        let now = Utc::now();
        let now = DateTime::from_timestamp_micros(now.timestamp_micros()).unwrap_or(now);
        Self {
            event_id: Uuid::now_v7(),
            observed_at: now,
            published_at: now,
            node: node.into(),
            source,
            component,
            entity,
            kind: detail.kind(),
            detail,
            healthy: false,
            synthetic: false,
            raw: None,
            collector_version: env!("CARGO_PKG_VERSION").to_owned(),
            boot_id: None,
            workloads: None,
        }
    }
}

/// Where the collector read an event.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Source {
    /// A source this reader does not know (written by a newer version).
    Unknown,
    /// NVIDIA Management Library.
    Nvml,
    /// The kernel log (`/dev/kmsg` or the journal).
    KernelLog,
    /// NVIDIA Data Center GPU Manager.
    Dcgm,
    /// The cloud provider's maintenance API.
    Cloud,
    /// The gRPC ingest API (custom monitors).
    Ingest,
    /// Fault injection.
    Synthetic,
}

/// The hardware part an event is about.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Component {
    /// A component this reader does not know.
    Unknown,
    /// A GPU.
    Gpu,
    /// An NVSwitch.
    Nvswitch,
    /// An NVLink link.
    Nvlink,
    /// The PCIe fabric.
    Pcie,
    /// Host memory.
    Memory,
    /// A CPU.
    Cpu,
    /// The node as a whole.
    Node,
}

/// Identifies the affected part on the node; every field is optional.
#[derive(Debug, Clone, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Entity {
    /// GPU UUID as NVML reports it.
    pub gpu_uuid: Option<String>,
    /// PCI bus id (domain:bus:device.function).
    pub pci_bus_id: Option<String>,
    /// NVML index; not stable across reboots.
    pub gpu_index: Option<i32>,
    /// NVLink link number.
    pub nvlink_link: Option<i32>,
    /// NVSwitch identifier.
    pub nvswitch_id: Option<String>,
    /// MIG instance or MIG device UUID.
    pub mig_instance: Option<String>,
}

/// Declares the `Kind` enum, the `Detail` enum with one variant per kind, and the serde mapping of
/// `Detail` onto the Avro `Detail` record (one nullable field per kind), from one list so that
/// the three cannot drift apart.
macro_rules! kinds {
    ($( $(#[$doc:meta])* $variant:ident => $field:ident : $detail:ident ),+ $(,)?) => {
        /// What kind of observation an event is.
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
        #[serde(rename_all = "snake_case")]
        pub enum Kind {
            /// A kind this reader does not know (written by a newer version).
            Unknown,
            $( $(#[$doc])* $variant, )+
        }

        /// The typed detail of an event, one variant per [`Kind`].
        ///
        /// On the wire this is the Avro record `Detail` with one nullable field per kind, exactly
        /// one of them set: unlike a union, a record gains a kind without breaking older readers.
        #[derive(Debug, Clone, PartialEq, Deserialize)]
        #[serde(from = "DetailFields")]
        pub enum Detail {
            /// No detail: a kind without one, or a kind this reader does not know.
            Absent,
            $( $(#[$doc])* $variant($detail), )+
        }

        impl Detail {
            /// The kind this detail belongs to ([`Kind::Unknown`] for [`Detail::Absent`]).
            pub fn kind(&self) -> Kind {
                match self {
                    Detail::Absent => Kind::Unknown,
                    $( Detail::$variant(_) => Kind::$variant, )+
                }
            }
        }

        /// The wire shape of [`Detail`].
        #[derive(Deserialize)]
        #[serde(rename = "Detail")]
        struct DetailFields {
            $( $field: Option<$detail>, )+
        }

        impl From<DetailFields> for Detail {
            /// A well-formed record has one field set; should a foreign writer set several, the
            /// first in schema order wins, as documented in docs/events.md.
            fn from(fields: DetailFields) -> Self {
                $( if let Some(detail) = fields.$field { return Detail::$variant(detail); } )+
                Detail::Absent
            }
        }

        impl Serialize for Detail {
            fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
                let mut record = serializer.serialize_struct("Detail", [$( stringify!($field) ),+].len())?;
                $(
                    let value = match self {
                        Detail::$variant(detail) => Some(detail),
                        _ => None,
                    };
                    record.serialize_field(stringify!($field), &value)?;
                )+
                record.end()
            }
        }
    };
}

kinds! {
    /// An Xid error from the GPU driver.
    Xid => xid: XidDetail,
    /// An NVSwitch SXid error.
    Sxid => sxid: SxidDetail,
    /// The GPU fell off the bus or is lost.
    GpuLost => gpu_lost: GpuLostDetail,
    /// ECC error counters.
    Ecc => ecc: EccDetail,
    /// Retired memory pages.
    RetiredPages => retired_pages: RetiredPagesDetail,
    /// Row remapping state.
    RowRemap => row_remap: RowRemapDetail,
    /// Temperature against thresholds.
    Temperature => temperature: TemperatureDetail,
    /// Power draw.
    Power => power: PowerDetail,
    /// Clock throttle reasons.
    Throttle => throttle: ThrottleDetail,
    /// NVLink state and counters.
    Nvlink => nvlink: NvlinkDetail,
    /// PCIe replay counter.
    PcieReplay => pcie_replay: PcieReplayDetail,
    /// Machine check exception.
    Mce => mce: MceDetail,
    /// PCIe Advanced Error Reporting.
    PcieAer => pcie_aer: PcieAerDetail,
    /// DCGM health watch or diagnostic result.
    Dcgm => dcgm: DcgmDetail,
    /// Cloud provider maintenance.
    CloudMaintenance => cloud_maintenance: CloudMaintenanceDetail,
    /// The state of a health source itself.
    MonitorHealth => monitor_health: MonitorHealthDetail,
    /// Free key/values from a custom monitor.
    Custom => custom: CustomDetail,
    /// The GPUs the collector sees on the node (schema version 2).
    GpuInventory => gpu_inventory: GpuInventoryDetail,
}

/// An NVIDIA Xid error reported by the GPU driver.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct XidDetail {
    /// The Xid number.
    pub code: i32,
    /// The message text after the Xid number.
    pub text: String,
    /// Process id, when logged.
    pub pid: Option<i32>,
    /// Process name, when logged.
    pub process: Option<String>,
    /// Decoded fields of an NVLink5 Xid (144 to 150).
    pub nvlink5: Option<Nvlink5XidFields>,
    /// For Xid 154: the recovery action the driver asks for.
    pub recovery_action: Option<XidRecoveryAction>,
}

/// The decoded fields of an NVLink5 Xid (144 to 150).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Nvlink5XidFields {
    /// The NVLink unit that raised the error.
    pub unit: String,
    /// Severity as logged.
    pub severity: String,
    /// Link number, when logged.
    pub link: Option<i32>,
    /// Interrupt info register as logged.
    pub intr_info: Option<String>,
    /// Error status register value, when logged.
    pub error_status: Option<i64>,
}

/// The recovery action the driver requests with Xid 154.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum XidRecoveryAction {
    /// An action this reader does not know.
    Unknown,
    /// No action needed.
    None,
    /// Reset the GPU.
    GpuReset,
    /// Reboot the node.
    NodeReboot,
    /// Drain peer-to-peer traffic.
    DrainP2p,
    /// Drain, then reset.
    DrainAndReset,
}

/// An NVSwitch SXid error.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SxidDetail {
    /// The SXid number.
    pub code: i32,
    /// The message text.
    pub text: String,
    /// Whether the driver flagged it fatal, when logged.
    pub fatal: Option<bool>,
    /// NVSwitch port or link, when logged.
    pub link: Option<i32>,
}

/// The GPU is gone.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct GpuLostDetail {
    /// How the loss showed.
    pub reason: String,
}

/// ECC error counters.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct EccDetail {
    /// Corrected errors since the driver loaded.
    pub single_bit_volatile: Option<i64>,
    /// Uncorrected errors since the driver loaded.
    pub double_bit_volatile: Option<i64>,
    /// Corrected errors over the GPU's lifetime.
    pub single_bit_aggregate: Option<i64>,
    /// Uncorrected errors over the GPU's lifetime.
    pub double_bit_aggregate: Option<i64>,
    /// Memory where the errors were counted (dram, sram).
    pub location: Option<String>,
}

/// Retired memory pages.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RetiredPagesDetail {
    /// Pages retired for multiple single-bit errors.
    pub single_bit: i64,
    /// Pages retired for a double-bit error.
    pub double_bit: i64,
    /// A retirement waits for the next driver reload.
    pub pending: bool,
}

/// Row remapping state.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RowRemapDetail {
    /// Rows remapped for correctable errors.
    pub correctable: i64,
    /// Rows remapped for uncorrectable errors.
    pub uncorrectable: i64,
    /// A remap waits for a GPU reset.
    pub pending: bool,
    /// A remap failed.
    pub failure: bool,
}

/// A temperature reading against its thresholds.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TemperatureDetail {
    /// Current temperature, degrees Celsius.
    pub celsius: i32,
    /// Slowdown threshold, when known.
    pub slowdown_celsius: Option<i32>,
    /// Shutdown threshold, when known.
    pub shutdown_celsius: Option<i32>,
}

/// A power reading.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PowerDetail {
    /// Current draw, watts.
    pub watts: f64,
    /// Enforced limit, watts, when known.
    pub limit_watts: Option<f64>,
}

/// Why the GPU's clocks are held down.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ThrottleDetail {
    /// Active reasons by NVML name without prefix.
    pub reasons: Vec<String>,
    /// Raw NVML reason bit mask, when read from NVML.
    pub mask: Option<i64>,
}

/// State and error counters of one NVLink link.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct NvlinkDetail {
    /// Link number.
    pub link: i32,
    /// Whether the link is up, when known.
    pub active: Option<bool>,
    /// CRC errors in flow-control digits.
    pub crc_flit_errors: Option<i64>,
    /// CRC errors in data packets.
    pub crc_data_errors: Option<i64>,
    /// Replays.
    pub replay_errors: Option<i64>,
    /// Link recoveries.
    pub recovery_errors: Option<i64>,
}

/// The PCIe replay counter.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PcieReplayDetail {
    /// Counter value.
    pub count: i64,
    /// Increase since the previous report.
    pub delta: Option<i64>,
}

/// A machine check exception.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct MceDetail {
    /// The kernel log line.
    pub text: String,
    /// Reporting CPU.
    pub cpu: Option<i32>,
    /// MCA bank.
    pub bank: Option<i32>,
    /// MCA status register (hex text).
    pub status: Option<String>,
    /// Whether it was corrected.
    pub corrected: Option<bool>,
}

/// A PCIe Advanced Error Reporting message.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PcieAerDetail {
    /// Severity class.
    pub severity: AerSeverity,
    /// PCI address of the reporting device.
    pub device: String,
    /// Error type as logged.
    pub error_type: Option<String>,
    /// The kernel log line.
    pub text: String,
}

/// AER severity class.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum AerSeverity {
    /// A class this reader does not know.
    Unknown,
    /// Corrected error.
    Corrected,
    /// Uncorrected, non-fatal.
    NonFatal,
    /// Uncorrected, fatal.
    Fatal,
}

/// A DCGM health watch or diagnostic result.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DcgmDetail {
    /// The watch system or diagnostic test.
    pub check: String,
    /// Outcome.
    pub result: DcgmResult,
    /// DCGM error code.
    pub error_code: Option<i32>,
    /// DCGM's message.
    pub message: Option<String>,
}

/// Outcome of a DCGM check.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum DcgmResult {
    /// An outcome this reader does not know.
    Unknown,
    /// Passed.
    Pass,
    /// Warning.
    Warn,
    /// Failed.
    Fail,
    /// Skipped.
    Skip,
}

/// Maintenance the cloud provider scheduled for the instance.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CloudMaintenanceDetail {
    /// The provider.
    pub provider: CloudProvider,
    /// The provider's event type.
    pub event_type: String,
    /// The provider's id for the event.
    pub provider_event_id: Option<String>,
    /// Start of the window, when announced.
    #[serde(default, with = "crate::serde_util::micros::option")]
    pub window_start: Option<DateTime<Utc>>,
    /// End of the window, when announced.
    #[serde(default, with = "crate::serde_util::micros::option")]
    pub window_end: Option<DateTime<Utc>>,
    /// The provider's description.
    pub description: Option<String>,
}

/// Cloud provider.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum CloudProvider {
    /// A provider this reader does not know.
    Unknown,
    /// Amazon Web Services.
    Aws,
    /// Google Cloud.
    Gcp,
    /// Microsoft Azure.
    Azure,
    /// Another provider.
    Other,
}

/// The state of a health source itself.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct MonitorHealthDetail {
    /// The source.
    pub monitor: String,
    /// Its state.
    pub state: MonitorState,
    /// What went wrong.
    pub message: Option<String>,
}

/// State of a health source.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum MonitorState {
    /// A state this reader does not know.
    Unknown,
    /// Working.
    Ok,
    /// Not answering.
    Hung,
    /// Not present or not reachable.
    Unavailable,
    /// Answering with errors.
    Error,
}

/// Free key/values from a custom monitor.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CustomDetail {
    /// Name of the custom monitor.
    pub monitor: String,
    /// Free key/values.
    pub values: BTreeMap<String, String>,
}

/// The GPUs the collector sees on the node: the inventory that the enricher resolves GPU
/// references against, and that tells a missing GPU.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct GpuInventoryDetail {
    /// The GPUs present, in NVML index order.
    pub gpus: Vec<GpuIdentity>,
    /// Why the inventory was published: one of [`GpuInventoryDetail::REASONS`].
    pub reason: String,
    /// How many GPUs the collector expects on the node: the largest count it has seen in this
    /// boot.
    pub expected: Option<i32>,
}

impl GpuInventoryDetail {
    /// The collector started.
    pub const START: &'static str = "start";
    /// A GPU appeared, disappeared or changed identity since the previous inventory.
    pub const CHANGE: &'static str = "change";
    /// Periodic, unchanged since the previous inventory.
    pub const REFRESH: &'static str = "refresh";
    /// Every reason this version writes. On the wire the reason is a string, not an enum, so a
    /// reader keeps a reason added later as it came.
    pub const REASONS: [&'static str; 3] = [Self::START, Self::CHANGE, Self::REFRESH];
}

/// Every name one GPU of a node goes by, so that a reference by any of them (NVML index, PCI bus
/// id, UUID) resolves to the others. Every field is optional: a source knows what it knows.
#[derive(Debug, Clone, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct GpuIdentity {
    /// NVML index; not stable across reboots.
    pub index: Option<i32>,
    /// GPU UUID as NVML reports it: the canonical identity.
    pub uuid: Option<String>,
    /// PCI bus id (domain:bus:device.function).
    pub pci_bus_id: Option<String>,
    /// Board serial number.
    pub serial: Option<String>,
    /// Product name.
    pub product: Option<String>,
    /// The NVLink domain (clique): the node label `nvidia.com/gpu.clique`, or NVML's fabric
    /// cluster UUID and clique id.
    pub nvlink_domain: Option<String>,
}
