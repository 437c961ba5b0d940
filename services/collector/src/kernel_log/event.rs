//! Turning parsed kernel-log events into raw `HealthEvent`s.

use gpumedic_schemas::HealthEvent;
use gpumedic_schemas::health::{
    AerSeverity, Component, CustomDetail, Detail, Entity, GpuLostDetail, MceDetail, Nvlink5XidFields, PcieAerDetail,
    Source, SxidDetail, XidDetail, XidRecoveryAction,
};

use super::nvlink5::Nvlink5Action;
use super::parse::{KernelEvent, KernelEventKind};

/// The `monitor` of the `custom` events NIC driver errors become.
pub const NIC_MONITOR: &str = "nic_driver";

/// The health event for `k`, seen on `node` in the line `raw`.
pub fn to_health_event(node: &str, k: &KernelEvent, raw: &str) -> HealthEvent {
    let mut entity = Entity { pci_bus_id: k.pci_bus_id.clone(), ..Default::default() };
    let (component, detail) = match k.kind {
        KernelEventKind::Xid => {
            let code = k.xid.map_or(0, |c| c as i32);
            entity.mig_instance = k.mig.as_ref().map(|m| match m.compute_instance {
                Some(ci) => format!("GPU-I:{} GPU-C:{ci}", m.gpu_instance),
                None => format!("GPU-I:{}", m.gpu_instance),
            });
            entity.nvlink_link = k.nvlink.as_ref().and_then(|n| n.link).map(|l| l as i32);
            let nvlink5 = ((144..=150).contains(&code)).then(|| Nvlink5XidFields {
                unit: k.nvlink.as_ref().and_then(|n| n.unit.clone()).unwrap_or_default(),
                severity: k.severity.clone().unwrap_or_default(),
                link: entity.nvlink_link,
                intr_info: k.nvlink.as_ref().and_then(|n| n.registers.first().cloned()),
                error_status: k
                    .nvlink
                    .as_ref()
                    .and_then(|n| n.registers.get(1))
                    .and_then(|r| i64::from_str_radix(r.trim_start_matches("0x"), 16).ok()),
            });
            let component = if code == 74 || (144..=150).contains(&code) { Component::Nvlink } else { Component::Gpu };
            (
                component,
                Detail::Xid(XidDetail {
                    code,
                    text: k.message.clone(),
                    pid: k.pid.map(|p| p as i32),
                    process: k.process.clone(),
                    nvlink5,
                    // Xid 154 names its action; an NVLink5 Xid's comes from its decode (one
                    // that defers to the Xid 154 that follows leaves it unset).
                    recovery_action: k.recovery_action.as_deref().map(recovery_action).or_else(|| {
                        k.nvlink5.as_ref().and_then(|d| match d.action {
                            Nvlink5Action::None => Some(XidRecoveryAction::None),
                            Nvlink5Action::GpuReset => Some(XidRecoveryAction::GpuReset),
                            Nvlink5Action::FollowXid154 => None,
                        })
                    }),
                }),
            )
        }
        KernelEventKind::Sxid => {
            entity.nvswitch_id = k.device.clone().or_else(|| k.pci_bus_id.clone());
            (
                Component::Nvswitch,
                Detail::Sxid(SxidDetail {
                    code: k.sxid.map_or(0, |c| c as i32),
                    text: k.message.clone(),
                    fatal: k.severity.as_deref().map(|s| s == "fatal"),
                    link: k.nvlink.as_ref().and_then(|n| n.link).map(|l| l as i32),
                }),
            )
        }
        KernelEventKind::GpuLost => (Component::Gpu, Detail::GpuLost(GpuLostDetail { reason: k.message.clone() })),
        KernelEventKind::Mce => (
            Component::Cpu,
            Detail::Mce(MceDetail {
                text: k.message.clone(),
                cpu: k.cpu.map(|c| c as i32),
                bank: k.mce_bank.map(|b| b as i32),
                status: None,
                corrected: k.severity.as_deref().map(|s| s == "corrected"),
            }),
        ),
        KernelEventKind::PcieAer => (
            Component::Pcie,
            Detail::PcieAer(PcieAerDetail {
                severity: match k.severity.as_deref() {
                    Some("corrected") => AerSeverity::Corrected,
                    Some("fatal") | Some("uncorrected_fatal") => AerSeverity::Fatal,
                    Some(s) if s.contains("non_fatal") => AerSeverity::NonFatal,
                    _ => AerSeverity::Unknown,
                },
                device: k.pci_bus_id.clone().unwrap_or_default(),
                error_type: k
                    .message
                    .split_once("type=")
                    .map(|(_, t)| t.split(',').next().unwrap_or(t).trim().to_owned()),
                text: k.message.clone(),
            }),
        ),
        KernelEventKind::NicDriver => {
            // The NIC's PCI address goes into the values, not the entity: the entity's PCI id
            // names a GPU, and a NIC fault is about the node's network.
            entity.pci_bus_id = None;
            let mut values = std::collections::BTreeMap::new();
            values.insert("check".to_owned(), "nic_driver".to_owned());
            if let Some(nic) = &k.nic {
                values.insert("error".to_owned(), nic.error.to_owned());
                values.insert("severity".to_owned(), nic.severity.to_owned());
                for (key, value) in [("driver", &nic.driver), ("device", &nic.device), ("interface", &nic.interface)] {
                    if let Some(v) = value {
                        values.insert(key.to_owned(), v.clone());
                    }
                }
                if let Some(q) = nic.queue {
                    values.insert("queue".to_owned(), q.to_string());
                }
            }
            (Component::Node, Detail::Custom(CustomDetail { monitor: NIC_MONITOR.to_owned(), values }))
        }
    };
    let mut event = HealthEvent::new(node, Source::KernelLog, component, entity, detail);
    event.raw = Some(raw.to_owned());
    event
}

fn recovery_action(parsed: &str) -> XidRecoveryAction {
    match parsed {
        "none" => XidRecoveryAction::None,
        "gpu_reset_required" | "gpu_reset" => XidRecoveryAction::GpuReset,
        "node_reboot_required" | "node_reboot" => XidRecoveryAction::NodeReboot,
        "drain_p2p" => XidRecoveryAction::DrainP2p,
        "drain_and_reset" => XidRecoveryAction::DrainAndReset,
        _ => XidRecoveryAction::Unknown,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernel_log::parse::parse_all;

    #[test]
    fn nic_driver_errors_are_node_events_that_name_the_nic_apart_from_gpus() {
        let line = "mlx5_core 0000:41:00.0: poll_health:852:(pid 0): device's health compromised - reached miss count";
        let k = &parse_all(line)[0];
        let e = to_health_event("n1", k, line);
        assert_eq!((e.source, e.component), (Source::KernelLog, Component::Node));
        assert_eq!(e.entity, Entity::default(), "a NIC's PCI id is not a GPU's");
        let Detail::Custom(c) = &e.detail else { panic!("custom expected: {:?}", e.detail) };
        assert_eq!(c.monitor, NIC_MONITOR);
        let get = |k: &str| c.values.get(k).map(String::as_str);
        assert_eq!(
            (get("check"), get("error"), get("severity"), get("device"), get("driver")),
            (Some("nic_driver"), Some("health_compromised"), Some("fatal"), Some("0000:41:00.0"), Some("mlx5_core"))
        );
        let line = "NETDEV WATCHDOG: eth2 (mlx5_core): transmit queue 3 timed out 5376 ms";
        let e = to_health_event("n1", &parse_all(line)[0], line);
        let Detail::Custom(c) = &e.detail else { panic!("custom expected") };
        assert_eq!(c.values.get("queue").map(String::as_str), Some("3"));
        assert_eq!(c.values.get("interface").map(String::as_str), Some("eth2"));
        assert!(!e.healthy);
    }

    #[test]
    fn xid_lines_become_typed_events() {
        let line = "NVRM: Xid (PCI:0000:01:00): 154, GPU recovery action changed from 0x0 (None) to 0x2 (Node Reboot Required)";
        let k = &parse_all(line)[0];
        let e = to_health_event("gpu-1", k, line);
        assert_eq!(e.kind, gpumedic_schemas::Kind::Xid);
        assert_eq!(e.entity.pci_bus_id.as_deref(), Some("0000:01:00.0"));
        let Detail::Xid(x) = &e.detail else { panic!("xid detail") };
        assert_eq!((x.code, x.recovery_action), (154, Some(XidRecoveryAction::NodeReboot)));
        assert_eq!(e.raw.as_deref(), Some(line));
        // The event encodes against the schema.
        gpumedic_schemas::encode(&e).expect("encodes");
    }

    #[test]
    fn an_nvlink5_xid_carries_its_decoded_action_and_link() {
        let fatal = "NVRM: Xid (PCI:0018:01:00): 149, NETIR_LINK_EVT  Fatal   XC0 i0 Link 04 (0x004505c6 0x00000000)";
        let e = to_health_event("gpu-1", &parse_all(fatal)[0], fatal);
        let Detail::Xid(x) = &e.detail else { panic!("xid detail") };
        assert_eq!(x.recovery_action, Some(XidRecoveryAction::GpuReset), "a fatal NETIR error needs a GPU reset");
        assert_eq!((e.entity.nvlink_link, e.component), (Some(4), Component::Nvlink));
        let ber = "NVRM: Xid (PCI:0018:01:00): 149, NETIR_BER_EVENT Nonfatal XC0 i0 Link 02 (0x00000000 0x00000001)";
        let Detail::Xid(x) = &to_health_event("gpu-1", &parse_all(ber)[0], ber).detail else { panic!() };
        assert_eq!(x.recovery_action, Some(XidRecoveryAction::None));
        let remap = "NVRM: Xid (PCI:0008:01:00): 145, RLW_REMAP Nonfatal XC1 i1 Link 06 (0x00000000 0x00000001)";
        let Detail::Xid(x) = &to_health_event("gpu-1", &parse_all(remap)[0], remap).detail else { panic!() };
        assert_eq!(x.recovery_action, None, "the Xid 154 that follows names the action");
        let other = "NVRM: Xid (PCI:0000:3b:00): 79, pid='<unknown>', name=<unknown>, GPU has fallen off the bus.";
        let Detail::Xid(x) = &to_health_event("gpu-1", &parse_all(other)[0], other).detail else { panic!() };
        assert_eq!(x.recovery_action, None, "other Xids are not decoded");
    }

    #[test]
    fn every_kind_encodes() {
        let text = "\
NVRM: Xid (PCI:0018:01:00): 149, NETIR_LINK_EVT  Fatal   XC0 i0 Link 04 (0x004505c6 0x00000010)
nvidia-nvswitch3: SXid (PCI:0000:c8:00.0): 24007, Fatal, Link 44 sourcetrack TCEN0 crumbstore ECC DBE Error (First)
NVRM: GPU 0000:41:00.0: GPU has fallen off the bus.
mce: [Hardware Error]: CPU 3: Machine Check Exception: 5 Bank 7: be00000000800400
nvidia 0000:3b:00.0: AER: PCIe Bus Error: severity=Corrected, type=Physical Layer, (Receiver ID)
";
        let events = parse_all(text);
        assert_eq!(events.len(), 5);
        for k in &events {
            let e = to_health_event("gpu-1", k, "line");
            gpumedic_schemas::encode(&e).unwrap_or_else(|err| panic!("{k:?}: {err}"));
        }
        let Detail::Xid(x) = to_health_event("n", &events[0], "").detail else { panic!() };
        assert_eq!(x.nvlink5.as_ref().map(|n| (n.link, n.error_status)), Some((Some(4), Some(16))));
        let Detail::PcieAer(a) = to_health_event("n", &events[4], "").detail else { panic!() };
        assert_eq!((a.severity, a.error_type.as_deref()), (AerSeverity::Corrected, Some("Physical Layer")));
    }
}
