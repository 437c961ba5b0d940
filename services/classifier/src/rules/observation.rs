//! The engine's input: one health observation, decoupled from the wire records.
//!
//! The Avro event types live in `gpumedic-schemas` and evolve on their own schedule; the rules
//! engine only needs this flat view, so the service maps each enriched record onto it and the
//! engine stays testable without the codec.

use std::collections::BTreeMap;
use std::fmt;

use serde::{Deserialize, Serialize};

/// A value carried in [`Observation::fields`].
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum FieldValue {
    /// A boolean, e.g. `pending` or `failure`.
    Bool(bool),
    /// An integer, e.g. a counter.
    Int(i64),
    /// A real number, e.g. a temperature.
    Float(f64),
    /// Text, e.g. `recovery_action` or `link_state`.
    Text(String),
}

impl FieldValue {
    /// The value as a number, when it is one; booleans and text are not numbers.
    pub fn as_f64(&self) -> Option<f64> {
        match self {
            FieldValue::Int(i) => Some(*i as f64),
            FieldValue::Float(f) => Some(*f),
            FieldValue::Bool(_) | FieldValue::Text(_) => None,
        }
    }
}

impl fmt::Display for FieldValue {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            FieldValue::Bool(b) => write!(f, "{b}"),
            FieldValue::Int(i) => write!(f, "{i}"),
            FieldValue::Float(x) => write!(f, "{x}"),
            FieldValue::Text(s) => write!(f, "{s}"),
        }
    }
}

impl From<bool> for FieldValue {
    fn from(v: bool) -> Self {
        FieldValue::Bool(v)
    }
}

impl From<i64> for FieldValue {
    fn from(v: i64) -> Self {
        FieldValue::Int(v)
    }
}

impl From<f64> for FieldValue {
    fn from(v: f64) -> Self {
        FieldValue::Float(v)
    }
}

impl From<&str> for FieldValue {
    fn from(v: &str) -> Self {
        FieldValue::Text(v.to_owned())
    }
}

impl From<String> for FieldValue {
    fn from(v: String) -> Self {
        FieldValue::Text(v)
    }
}

/// One health observation about a node or one of its GPUs.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Observation {
    /// The event's unique id; a redelivered event carries the same id and is ignored.
    pub event_id: String,
    /// The Kubernetes node name.
    pub node: String,
    /// The GPU, when the observation names one: its canonical identity (the UUID) when the
    /// enricher resolved the reference against the node's inventory, else the reference as
    /// reported (a UUID or a PCI bus id).
    pub gpu: Option<String>,
    /// The GPU's NVML index, when known (for naming the GPU in verdicts; not stable across boots).
    #[serde(default)]
    pub gpu_index: Option<i32>,
    /// The GPU's PCI bus id, when known.
    #[serde(default)]
    pub gpu_pci: Option<String>,
    /// The node's boot id when the event was observed (`/proc/sys/kernel/random/boot_id`); a new
    /// one is the proof that the node rebooted.
    #[serde(default)]
    pub boot_id: Option<String>,
    /// When the pipeline received the event (the collector's publish time), in microseconds since
    /// the Unix epoch; an observation stamped far after it is impossible and is refused.
    #[serde(default)]
    pub received_at_micros: Option<i64>,
    /// The workloads (pod owners, `namespace/Kind/name`) using the GPU, or the node when the event
    /// names no GPU, as the enricher found them.
    #[serde(default)]
    pub workloads: Vec<String>,
    /// For `gpu_inventory` observations: the canonical identities of the GPUs present.
    #[serde(default)]
    pub inventory: Vec<String>,
    /// When the source observed it, in microseconds since the Unix epoch. The engine's only clock.
    pub observed_at_micros: i64,
    /// Where it came from: `nvml`, `kernel_log`, `dcgm`, `cloud`, `ingest`, `synthetic`.
    pub source: String,
    /// The component, e.g. `gpu`, `nvlink`, `nvswitch`, `pcie`, `node`.
    pub component: String,
    /// What was observed: `xid`, `gpu_lost`, `ecc`, `temperature`, ... (see [`crate::rules::KINDS`]).
    pub kind: String,
    /// The Xid (or SXid) code, for `xid` and `sxid` observations.
    pub xid: Option<u32>,
    /// True when the observation is evidence of health (a heartbeat, a passed diagnostic).
    pub healthy: bool,
    /// True for injected faults; ignored unless the rule set allows them.
    pub synthetic: bool,
    /// Part of a collector's start snapshot: a reading published because the collector started,
    /// once per GPU and start, not because it changed. The engine judges it as any other reading;
    /// the history keeper rolls it up at once ([`crate::persist::Keeper::keep`]).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub start_snapshot: bool,
    /// Source-specific values, e.g. `value`, `slowdown_threshold`, `recovery_action`.
    pub fields: BTreeMap<String, FieldValue>,
    /// The NVLink domain (clique) of the GPU, as the enricher resolved it (the node label
    /// `nvidia.com/gpu.clique`). GPUs of one domain share an NVLink fabric across nodes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub nvlink_domain: Option<String>,
    /// Root incidents on GPUs of other nodes of the same NVLink domain that this observation may
    /// echo, as the service found them before the engine decides (the incident store, or the
    /// replica's own recent decisions). A fact handed in, so the engine stays pure: it picks the
    /// one a rule's `sympathetic` block accepts, by its own clock.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub domain_roots: Vec<DomainRoot>,
}

/// An incident that may be the root of sympathetic errors on other nodes of its NVLink domain
/// (an NVLink fault with the link down, on one GPU).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DomainRoot {
    /// The NVLink domain of the root GPU.
    pub domain: String,
    /// The root incident.
    pub incident_id: uuid::Uuid,
    /// The rule that opened it.
    pub rule_id: String,
    /// The root GPU's node.
    pub node: String,
    /// The root GPU.
    pub gpu: Option<String>,
    /// When the root incident opened (event time), in microseconds since the Unix epoch.
    pub opened_at_micros: i64,
}

impl Observation {
    /// An observation with the given identity and kind, unhealthy, not synthetic, without fields;
    /// a starting point for the lead's mapping and for tests.
    pub fn new(event_id: impl Into<String>, node: impl Into<String>, observed_at_micros: i64, kind: &str) -> Self {
        Observation {
            event_id: event_id.into(),
            node: node.into(),
            gpu: None,
            gpu_index: None,
            gpu_pci: None,
            boot_id: None,
            received_at_micros: None,
            workloads: Vec::new(),
            inventory: Vec::new(),
            observed_at_micros,
            source: "nvml".to_owned(),
            component: "gpu".to_owned(),
            kind: kind.to_owned(),
            xid: None,
            healthy: false,
            synthetic: false,
            start_snapshot: false,
            fields: BTreeMap::new(),
            nvlink_domain: None,
            domain_roots: Vec::new(),
        }
    }

    /// Sets the GPU's NVLink domain.
    pub fn nvlink_domain(mut self, domain: impl Into<String>) -> Self {
        self.nvlink_domain = Some(domain.into());
        self
    }

    /// Adds a root incident of the GPU's NVLink domain on another node.
    pub fn domain_root(mut self, root: DomainRoot) -> Self {
        self.domain_roots.push(root);
        self
    }

    /// Sets the GPU.
    pub fn gpu(mut self, gpu: impl Into<String>) -> Self {
        self.gpu = Some(gpu.into());
        self
    }

    /// Sets the boot id.
    pub fn boot(mut self, boot_id: impl Into<String>) -> Self {
        self.boot_id = Some(boot_id.into());
        self
    }

    /// Adds a workload using the GPU (`namespace/Kind/name`).
    pub fn workload(mut self, workload: impl Into<String>) -> Self {
        self.workloads.push(workload.into());
        self
    }

    /// Sets the observation time.
    pub fn at(mut self, observed_at_micros: i64) -> Self {
        self.observed_at_micros = observed_at_micros;
        self
    }

    /// Sets the source.
    pub fn source(mut self, source: &str) -> Self {
        self.source = source.to_owned();
        self
    }

    /// Sets the component.
    pub fn component(mut self, component: &str) -> Self {
        self.component = component.to_owned();
        self
    }

    /// Sets the Xid code.
    pub fn xid(mut self, code: u32) -> Self {
        self.xid = Some(code);
        self
    }

    /// Marks the observation as healthy evidence.
    pub fn healthy(mut self) -> Self {
        self.healthy = true;
        self
    }

    /// Marks the observation as synthetic (injected).
    pub fn synthetic(mut self) -> Self {
        self.synthetic = true;
        self
    }

    /// Adds a field.
    pub fn field(mut self, name: &str, value: impl Into<FieldValue>) -> Self {
        self.fields.insert(name.to_owned(), value.into());
        self
    }
}
