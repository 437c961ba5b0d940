//! Fully populated records for the tests (every optional field set, every detail variant), and a
//! deterministic random source for the mutation tests. Also included by path by the codec bench
//! and the fuzz crate's seed-corpus example.

#![allow(dead_code, reason = "each test binary uses a different subset")]

use std::collections::BTreeMap;

use chrono::{DateTime, Utc};
use gpumedic_schemas::action::{ActionOutcome, ActionStatus};
use gpumedic_schemas::enriched::{EnrichedHealthEvent, NodeContext, Workload, XidCatalogEntry};
use gpumedic_schemas::health::*;
use gpumedic_schemas::verdict::{RecommendedAction, Severity, Verdict};
use uuid::Uuid;

/// A time with microsecond precision, as the wire carries.
pub fn at(micros: i64) -> DateTime<Utc> {
    DateTime::from_timestamp_micros(micros).expect("in range")
}

pub fn uuid(n: u128) -> Uuid {
    Uuid::from_u128(0x0190_0000_0000_7000_8000_0000_0000_0000 | n)
}

pub fn full_entity() -> Entity {
    Entity {
        gpu_uuid: Some("GPU-5c1f2a8e-9d3b-4f47-a1c2-0e6b7d8f9a01".into()),
        pci_bus_id: Some("0000:3b:00.0".into()),
        gpu_index: Some(3),
        nvlink_link: Some(7),
        nvswitch_id: Some("0000:c5:00.0".into()),
        mig_instance: Some("1/0".into()),
    }
}

/// One detail of every kind, every optional field set.
pub fn all_details() -> Vec<Detail> {
    vec![
        Detail::Xid(XidDetail {
            code: 145,
            text: "RLW_REMAP Nonfatal XC0 i0 Link 07 (0x00000004 0x00000000 0x00000000)".into(),
            pid: Some(4242),
            process: Some("python3".into()),
            nvlink5: Some(Nvlink5XidFields {
                unit: "RLW_REMAP".into(),
                severity: "Nonfatal".into(),
                link: Some(7),
                intr_info: Some("0x00000004".into()),
                error_status: Some(0x1_0000_0000),
            }),
            recovery_action: Some(XidRecoveryAction::DrainAndReset),
        }),
        Detail::Sxid(SxidDetail { code: 20034, text: "LTSSM Fault Up".into(), fatal: Some(true), link: Some(12) }),
        Detail::GpuLost(GpuLostDetail { reason: "fallen off the bus".into() }),
        Detail::Ecc(EccDetail {
            single_bit_volatile: Some(12),
            double_bit_volatile: Some(1),
            single_bit_aggregate: Some(340),
            double_bit_aggregate: Some(2),
            location: Some("dram".into()),
        }),
        Detail::RetiredPages(RetiredPagesDetail { single_bit: 3, double_bit: 1, pending: true }),
        Detail::RowRemap(RowRemapDetail { correctable: 2, uncorrectable: 1, pending: true, failure: false }),
        Detail::Temperature(TemperatureDetail { celsius: 91, slowdown_celsius: Some(87), shutdown_celsius: Some(95) }),
        Detail::Power(PowerDetail { watts: 698.5, limit_watts: Some(700.0) }),
        Detail::Throttle(ThrottleDetail {
            reasons: vec!["hw_slowdown".into(), "sw_thermal_slowdown".into()],
            mask: Some(0x28),
        }),
        Detail::Nvlink(NvlinkDetail {
            link: 7,
            active: Some(false),
            crc_flit_errors: Some(10),
            crc_data_errors: Some(3),
            replay_errors: Some(100),
            recovery_errors: Some(2),
        }),
        Detail::PcieReplay(PcieReplayDetail { count: 1000, delta: Some(250) }),
        Detail::Mce(MceDetail {
            text: "mce: [Hardware Error]: CPU 3: Machine Check: 0 Bank 5: be00000000800400".into(),
            cpu: Some(3),
            bank: Some(5),
            status: Some("0xbe00000000800400".into()),
            corrected: Some(false),
        }),
        Detail::PcieAer(PcieAerDetail {
            severity: AerSeverity::NonFatal,
            device: "0000:3b:00.0".into(),
            error_type: Some("Transaction Layer".into()),
            text: "pcieport 0000:3a:00.0: AER: Uncorrected (Non-Fatal) error received: 0000:3b:00.0".into(),
        }),
        Detail::Dcgm(DcgmDetail {
            check: "diag.memtest".into(),
            result: DcgmResult::Fail,
            error_code: Some(25),
            message: Some("memory test failed".into()),
        }),
        Detail::CloudMaintenance(CloudMaintenanceDetail {
            provider: CloudProvider::Aws,
            event_type: "system-reboot".into(),
            provider_event_id: Some("instance-event-0d59937288b749b32".into()),
            window_start: Some(at(1_767_312_000_000_000)),
            window_end: Some(at(1_767_319_200_000_000)),
            description: Some("scheduled reboot".into()),
        }),
        Detail::MonitorHealth(MonitorHealthDetail {
            monitor: "nvml".into(),
            state: MonitorState::Hung,
            message: Some("nvmlDeviceGetHandleByIndex did not return within 5s".into()),
        }),
        Detail::Custom(CustomDetail {
            monitor: "ib-link-checker".into(),
            values: BTreeMap::from([("port".into(), "mlx5_0/1".into()), ("state".into(), "down".into())]),
        }),
        Detail::GpuInventory(GpuInventoryDetail {
            gpus: vec![full_gpu(), GpuIdentity { index: Some(4), ..GpuIdentity::default() }],
            reason: GpuInventoryDetail::CHANGE.into(),
            expected: Some(8),
        }),
    ]
}

/// Every identity field set, for the GPU `full_entity` names.
pub fn full_gpu() -> GpuIdentity {
    GpuIdentity {
        index: Some(3),
        uuid: Some("GPU-5c1f2a8e-9d3b-4f47-a1c2-0e6b7d8f9a01".into()),
        pci_bus_id: Some("0000:3b:00.0".into()),
        serial: Some("1654922008123".into()),
        product: Some("NVIDIA H100 80GB HBM3".into()),
        nvlink_domain: Some("a1b2c3d4-0000-4000-8000-000000000001.7".into()),
    }
}

/// A fully populated raw event carrying `detail`.
pub fn health_event(detail: Detail) -> HealthEvent {
    HealthEvent {
        event_id: uuid(1),
        observed_at: at(1_767_225_600_123_456),
        published_at: at(1_767_225_600_223_456),
        node: "gpu-node-17".into(),
        source: Source::KernelLog,
        component: Component::Gpu,
        entity: full_entity(),
        kind: detail.kind(),
        detail,
        healthy: false,
        synthetic: true,
        raw: Some("NVRM: Xid (PCI:0000:3b:00): 145, pid=4242, name=python3, RLW_REMAP ...".into()),
        collector_version: "0.1.0".into(),
        boot_id: Some("8c2f7c1e-4d51-4b0e-9a58-2f0a6c1b9d33".into()),
        workloads: Some(vec![GpuWorkload {
            namespace: "training".into(),
            pod: "llm-pretrain-0".into(),
            container: "trainer".into(),
            gpu_uuids: vec!["GPU-5c1f2a8e-9d3b-4f47-a1c2-0e6b7d8f9a01".into()],
        }]),
    }
}

pub fn enriched(detail: Detail) -> EnrichedHealthEvent {
    EnrichedHealthEvent {
        event: health_event(detail),
        node_context: NodeContext {
            cluster: Some("train-eu-1".into()),
            instance_type: Some("p5.48xlarge".into()),
            zone: Some("eu-north-1a".into()),
            gpu_product: Some("NVIDIA-H100-80GB-HBM3".into()),
            driver_version: Some("570.133.20".into()),
            labels: BTreeMap::from([("team".into(), "llm".into())]),
            expected_gpus: Some(8),
        },
        node_unknown: false,
        xid_catalog: Some(XidCatalogEntry {
            name: "NVLink error".into(),
            immediate_action: "NVLink workflow: decode the register fields".into(),
            investigatory_action: "contact support".into(),
            catalog_version: Some("2025-06".into()),
        }),
        workloads: vec![Workload {
            namespace: "training".into(),
            pod: "llm-pretrain-worker-3".into(),
            owner_kind: Some("Job".into()),
            owner_name: Some("llm-pretrain".into()),
            gpu_uuids: vec!["GPU-5c1f2a8e-9d3b-4f47-a1c2-0e6b7d8f9a01".into()],
        }],
        enriched_at: at(1_767_225_600_323_456),
        gpu: Some(full_gpu()),
        gpu_unresolved: false,
    }
}

pub fn verdict() -> Verdict {
    Verdict {
        verdict_id: uuid(2),
        incident_id: uuid(3),
        node: "gpu-node-17".into(),
        entity: full_entity(),
        severity: Severity::Critical,
        rule_id: "xid-79-fallen-off-bus".into(),
        rule_version: 3,
        action: RecommendedAction::Custom,
        custom_action: Some("open-rma-ticket".into()),
        reason: "Xid 79 on GPU-5c1f2a8e: GPU has fallen off the bus".into(),
        evidence: vec![uuid(1), uuid(4)],
        issued_at: at(1_767_225_600_423_456),
        recovery: true,
        not_before: Some(at(1_767_312_000_000_000)),
        deferrable: true,
        workload: Some("training/Job/llm-pretrain".into()),
    }
}

pub fn action_outcome() -> ActionOutcome {
    ActionOutcome {
        verdict_id: uuid(2),
        node: "gpu-node-17".into(),
        action: RecommendedAction::Drain,
        status: ActionStatus::BlockedByBreaker,
        detail: "breaker open: 11 of 100 nodes quarantined (limit 10%)".into(),
        at: at(1_767_225_600_523_456),
    }
}

/// Deterministic xorshift64*, so a failure reproduces from the printed iteration.
pub struct XorShift(pub u64);

impl XorShift {
    pub fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }

    pub fn below(&mut self, n: usize) -> usize {
        (self.next() % n.max(1) as u64) as usize
    }
}
