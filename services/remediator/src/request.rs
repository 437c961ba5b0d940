//! What the remediator is asked to do: one [`Remediation`] per verdict, independent of the verdict's
//! wire format so the decision logic does not move when the contract evolves. The mapping from a
//! decoded verdict onto this type lives next to the consumer.

use std::fmt;

use serde::{Deserialize, Serialize};

/// The GPU a verdict names, when it names one.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct GpuRef {
    /// The GPU's UUID as NVML reports it (`GPU-...`).
    pub uuid: String,
    /// The PCI bus id (`0000:3b:00.0`).
    pub pci_bus_id: String,
    /// The NVML index on the node, when the verdict knows it (a GPU the enricher could not
    /// resolve against the node's inventory has none, and is then matched by UUID only).
    #[serde(default)]
    pub index: Option<u32>,
}

/// The action a verdict asks for, mildest first.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub enum Action {
    /// Nothing to do (informational verdict).
    None,
    /// Mark the node (condition and event) but keep it in service.
    Monitor,
    /// Mark the node and, in full-remediation, run the operator-defined action the request names
    /// ([`Remediation::custom`]) through the repair hooks; the node stays in service.
    Custom,
    /// Stop new work landing on the node.
    Cordon,
    /// Cordon and move the running work off the node.
    Drain,
    /// Drain, then reset the faulty GPU (repair hook).
    ResetGpu,
    /// Drain, then reboot the node (repair hook).
    RebootNode,
    /// Drain, then replace the node (repair hook).
    ReplaceNode,
    /// Drain, then hand the node to the vendor (repair hook).
    ContactSupport,
}

impl Action {
    /// Whether the action takes the node out of scheduling.
    pub fn quarantines(self) -> bool {
        self >= Action::Cordon
    }

    /// Whether the action moves running pods off the node.
    pub fn drains(self) -> bool {
        self >= Action::Drain
    }

    /// Whether the action needs a repair hook after the drain.
    pub fn repairs(self) -> bool {
        self >= Action::ResetGpu
    }

    /// The action's name as the verdict contract, the flags and the repair hooks spell it
    /// (`reset_gpu`, `reboot_node`, ...).
    pub fn name(self) -> &'static str {
        match self {
            Action::None => "none",
            Action::Monitor => "monitor",
            Action::Custom => "custom",
            Action::Cordon => "cordon",
            Action::Drain => "drain",
            Action::ResetGpu => "reset_gpu",
            Action::RebootNode => "reboot_node",
            Action::ReplaceNode => "replace_node",
            Action::ContactSupport => "contact_support",
        }
    }

    /// Parses a repair action's name (see [`Action::name`]); other actions are not repairs.
    pub fn parse_repair(name: &str) -> Result<Action, String> {
        [Action::ResetGpu, Action::RebootNode, Action::ReplaceNode, Action::ContactSupport]
            .into_iter()
            .find(|a| a.name() == name.trim())
            .ok_or_else(|| {
                format!("'{name}' is not a repair; use reset_gpu, reboot_node, replace_node or contact_support")
            })
    }
}

/// The part of the node a verdict is about; each has its own node condition.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub enum Subsystem {
    /// The GPU itself (Xids, ECC, fallen off the bus).
    Gpu,
    /// NVLink, NVSwitch, PCIe.
    Interconnect,
    /// GPU memory (row remapping, retired pages).
    Memory,
    /// Planned maintenance announced by the cloud provider.
    Maintenance,
}

impl Subsystem {
    /// Every subsystem, for code that needs to know every condition gpumedic may own.
    pub const ALL: [Subsystem; 4] =
        [Subsystem::Gpu, Subsystem::Interconnect, Subsystem::Memory, Subsystem::Maintenance];

    /// The node condition type gpumedic owns for this subsystem. Conditions are problem-oriented
    /// like node-problem-detector's (`True` means the problem is present), so a node without the
    /// condition reads as healthy.
    pub fn condition_type(self) -> &'static str {
        match self {
            Subsystem::Gpu => "GpuUnhealthy",
            Subsystem::Interconnect => "GpuInterconnectUnhealthy",
            Subsystem::Memory => "GpuMemoryUnhealthy",
            Subsystem::Maintenance => "GpuMaintenanceScheduled",
        }
    }

    /// The lowercase name used in taint values and labels.
    pub fn as_str(self) -> &'static str {
        match self {
            Subsystem::Gpu => "gpu",
            Subsystem::Interconnect => "interconnect",
            Subsystem::Memory => "memory",
            Subsystem::Maintenance => "maintenance",
        }
    }
}

impl fmt::Display for Subsystem {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// One request to change (or restore) a node.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Remediation {
    /// The node's name.
    pub node: String,
    /// The faulty GPU, when the verdict names one (enables partial drain).
    pub gpu: Option<GpuRef>,
    /// What to do.
    pub action: Action,
    /// Which condition the verdict is about.
    pub subsystem: Subsystem,
    /// A short CamelCase reason for the condition and events, such as `Xid79`.
    pub reason: String,
    /// A sentence for humans.
    pub message: String,
    /// The verdict this request comes from.
    pub verdict_id: String,
    /// The incident the verdict belongs to; ownership and manual-uncordon tracking are per incident.
    pub incident_id: String,
    /// True when the verdict says the node is healthy again: undo what gpumedic applied.
    pub recovery: bool,
    /// True when the resync re-issues an open incident's verdict: a condition of its type that
    /// already reads `True` is left as it reads (another open incident may have written it), so
    /// incidents sharing a condition do not rewrite it in turn at every resync.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub reissue: bool,
    /// The operator-defined action to run, for [`Action::Custom`] (a rule's `custom:` name, such
    /// as `restart-fabric-manager`): what the repair hooks are asked to do.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub custom: Option<String>,
}

impl Remediation {
    /// This request with its message naming the GPU (`... (GPU GPU-...)`) when it names one and
    /// the message does not already, so the node condition says which GPU is faulty.
    pub fn naming_gpu(&self) -> Remediation {
        let mut named = self.clone();
        if let Some(gpu) = &self.gpu
            && !self.message.to_ascii_lowercase().contains(&gpu.uuid.to_ascii_lowercase())
        {
            named.message = format!("{} (GPU {})", self.message, gpu.uuid);
        }
        named
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn actions_escalate_in_order() {
        assert!(!Action::Monitor.quarantines());
        assert!(!Action::Custom.quarantines() && !Action::Custom.repairs());
        assert!(Action::Cordon.quarantines() && !Action::Cordon.drains());
        assert!(Action::Drain.drains() && !Action::Drain.repairs());
        assert!(Action::ContactSupport.repairs());
    }

    #[test]
    fn repair_names_round_trip() {
        for a in [Action::ResetGpu, Action::RebootNode, Action::ReplaceNode, Action::ContactSupport] {
            assert_eq!(Action::parse_repair(a.name()), Ok(a));
        }
        assert!(Action::parse_repair("drain").is_err());
    }

    #[test]
    fn the_message_names_the_gpu_once() {
        let mut r = Remediation {
            node: "n".into(),
            gpu: Some(GpuRef { uuid: "GPU-abc".into(), pci_bus_id: String::new(), index: None }),
            action: Action::Drain,
            subsystem: Subsystem::Gpu,
            reason: "Xid79".into(),
            message: "fallen off the bus".into(),
            verdict_id: "v".into(),
            incident_id: "i".into(),
            recovery: false,
            reissue: false,
            custom: None,
        };
        assert_eq!(r.naming_gpu().message, "fallen off the bus (GPU GPU-abc)");
        assert_eq!(r.naming_gpu().naming_gpu().message, "fallen off the bus (GPU GPU-abc)");
        r.gpu = None;
        assert_eq!(r.naming_gpu().message, "fallen off the bus");
    }
}
