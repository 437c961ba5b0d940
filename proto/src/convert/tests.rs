//! The ingest conversion: valid events of several kinds become the raw event the collector
//! publishes, every validation rule rejects with the field named, and the caller never chooses
//! the node.

use std::collections::HashMap;

use chrono::{DateTime, Utc};
use gpumedic_schemas::health::{self as h};
use uuid::Uuid;

use super::*;
use crate::ingest::v1 as pb;

const NODE: &str = "gpu-node-17";

fn now() -> DateTime<Utc> {
    DateTime::from_timestamp_micros(1_767_225_600_000_000).expect("in range")
}

fn context() -> IngestContext<'static> {
    IngestContext { node: NODE, now: now(), collector_version: "0.1.0" }
}

/// A valid event of `kind` carrying `detail`, nothing optional set.
fn event(kind: pb::Kind, detail: PbDetail) -> pb::IngestEvent {
    pb::IngestEvent {
        component: pb::Component::Gpu as i32,
        kind: kind as i32,
        detail: Some(detail),
        ..Default::default()
    }
}

fn xid_event() -> pb::IngestEvent {
    let mut event = event(
        pb::Kind::Xid,
        PbDetail::Xid(pb::XidDetail {
            code: 145,
            text: "RLW_REMAP Nonfatal XC0 i0 Link 07".into(),
            pid: Some(4242),
            process: Some("python3".into()),
            nvlink5: Some(pb::Nvlink5XidFields {
                unit: "RLW_REMAP".into(),
                severity: "Nonfatal".into(),
                link: Some(7),
                intr_info: Some("0x00000004".into()),
                error_status: Some(0x1_0000_0000),
            }),
            recovery_action: pb::XidRecoveryAction::DrainAndReset as i32,
        }),
    );
    event.entity = Some(pb::Entity {
        gpu_uuid: Some("GPU-5c1f2a8e-9d3b-4f47-a1c2-0e6b7d8f9a01".into()),
        pci_bus_id: Some("0000:3b:00.0".into()),
        gpu_index: Some(3),
        nvlink_link: Some(7),
        ..Default::default()
    });
    event.raw = Some("NVRM: Xid (PCI:0000:3b:00): 145, pid=4242, name=python3, RLW_REMAP".into());
    event
}

fn custom_event() -> pb::IngestEvent {
    event(
        pb::Kind::Custom,
        PbDetail::Custom(pb::CustomDetail {
            monitor: "ib-link-checker".into(),
            values: HashMap::from([("port".into(), "mlx5_0/1".into()), ("state".into(), "down".into())]),
        }),
    )
}

fn field_of(result: Result<HealthEvent, IngestError>) -> String {
    match result {
        Err(IngestError::InvalidArgument { field, .. }) => field,
        other => panic!("expected InvalidArgument, got {other:?}"),
    }
}

#[test]
fn an_xid_event_becomes_the_raw_event_with_the_collectors_fields() {
    let event = to_health_event(xid_event(), &context()).expect("valid");
    assert_eq!(event.node, NODE);
    assert_eq!(event.source, h::Source::Ingest);
    assert_eq!(event.component, h::Component::Gpu);
    assert_eq!(event.kind, h::Kind::Xid);
    assert_eq!(event.observed_at, now(), "no observation time means now");
    assert_eq!(event.published_at, now());
    assert_eq!(event.event_id.get_version_num(), 7, "a generated id is a UUIDv7");
    assert_eq!(event.collector_version, "0.1.0");
    assert_eq!(event.entity.gpu_index, Some(3));
    assert_eq!(event.entity.nvswitch_id, None);
    assert_eq!(event.raw.as_deref(), Some("NVRM: Xid (PCI:0000:3b:00): 145, pid=4242, name=python3, RLW_REMAP"));
    let h::Detail::Xid(xid) = &event.detail else { panic!("xid detail expected: {:?}", event.detail) };
    assert_eq!(xid.code, 145);
    assert_eq!(xid.pid, Some(4242));
    assert_eq!(xid.recovery_action, Some(h::XidRecoveryAction::DrainAndReset));
    assert_eq!(xid.nvlink5.as_ref().map(|f| f.error_status), Some(Some(0x1_0000_0000)));
    // What the collector will publish goes through the Kafka codec.
    let framed = gpumedic_schemas::framing::encode(&event).expect("encodes");
    assert_eq!(gpumedic_schemas::framing::decode::<HealthEvent>(&framed).expect("decodes"), event);
}

#[test]
fn a_custom_event_keeps_the_callers_id_time_version_and_values() {
    let id = "01900000-0000-7000-8000-000000000042";
    let mut event = custom_event();
    event.event_id = id.into();
    event.observed_at_micros = now().timestamp_micros() - 1_000_000;
    event.client_version = "ib-link-checker/1.4.2".into();
    event.healthy = true;
    event.synthetic = true;
    let event = to_health_event(event, &context()).expect("valid");
    assert_eq!(event.event_id, Uuid::parse_str(id).unwrap());
    assert_eq!(event.observed_at.timestamp_micros(), now().timestamp_micros() - 1_000_000);
    assert_eq!(event.collector_version, "ib-link-checker/1.4.2");
    assert!(event.healthy && event.synthetic);
    let h::Detail::Custom(custom) = &event.detail else { panic!("custom detail expected") };
    assert_eq!(custom.monitor, "ib-link-checker");
    assert_eq!(custom.values.get("state").map(String::as_str), Some("down"));
    assert_eq!(custom.values.len(), 2);
}

#[test]
fn enum_details_map_symbol_for_symbol() {
    let cloud = event(
        pb::Kind::CloudMaintenance,
        PbDetail::CloudMaintenance(pb::CloudMaintenanceDetail {
            provider: pb::CloudProvider::Gcp as i32,
            event_type: "MIGRATE_ON_HOST_MAINTENANCE".into(),
            window_start_micros: Some(1_767_312_000_000_000),
            window_end_micros: Some(1_767_319_200_000_000),
            ..Default::default()
        }),
    );
    let h::Detail::CloudMaintenance(cloud) = to_health_event(cloud, &context()).unwrap().detail else { panic!() };
    assert_eq!(cloud.provider, h::CloudProvider::Gcp);
    assert_eq!(cloud.window_end.map(|t| t.timestamp_micros()), Some(1_767_319_200_000_000));

    let monitor = event(
        pb::Kind::MonitorHealth,
        PbDetail::MonitorHealth(pb::MonitorHealthDetail {
            monitor: "ib-link-checker".into(),
            state: pb::MonitorState::Hung as i32,
            message: Some("no answer in 5s".into()),
        }),
    );
    let h::Detail::MonitorHealth(monitor) = to_health_event(monitor, &context()).unwrap().detail else { panic!() };
    assert_eq!(monitor.state, h::MonitorState::Hung);

    let aer = event(
        pb::Kind::PcieAer,
        PbDetail::PcieAer(pb::PcieAerDetail {
            severity: pb::AerSeverity::NonFatal as i32,
            device: "0000:3b:00.0".into(),
            error_type: None,
            text: String::new(),
        }),
    );
    let h::Detail::PcieAer(aer) = to_health_event(aer, &context()).unwrap().detail else { panic!() };
    assert_eq!(aer.severity, h::AerSeverity::NonFatal);

    let dcgm = event(
        pb::Kind::Dcgm,
        PbDetail::Dcgm(pb::DcgmDetail {
            check: "diag.memtest".into(),
            result: pb::DcgmResult::Fail as i32,
            ..Default::default()
        }),
    );
    let h::Detail::Dcgm(dcgm) = to_health_event(dcgm, &context()).unwrap().detail else { panic!() };
    assert_eq!(dcgm.result, h::DcgmResult::Fail);
}

/// One minimal valid detail per kind: every proto kind maps onto the Avro kind of its detail.
#[test]
fn every_kind_maps_onto_the_avro_kind_of_its_detail() {
    let details = [
        (pb::Kind::Xid, PbDetail::Xid(Default::default())),
        (pb::Kind::Sxid, PbDetail::Sxid(Default::default())),
        (pb::Kind::GpuLost, PbDetail::GpuLost(pb::GpuLostDetail { reason: "fallen off the bus".into() })),
        (pb::Kind::Ecc, PbDetail::Ecc(Default::default())),
        (pb::Kind::RetiredPages, PbDetail::RetiredPages(Default::default())),
        (pb::Kind::RowRemap, PbDetail::RowRemap(Default::default())),
        (pb::Kind::Temperature, PbDetail::Temperature(Default::default())),
        (pb::Kind::Power, PbDetail::Power(pb::PowerDetail { watts: 698.5, limit_watts: Some(700.0) })),
        (
            pb::Kind::Throttle,
            PbDetail::Throttle(pb::ThrottleDetail { reasons: vec!["hw_slowdown".into()], mask: None }),
        ),
        (pb::Kind::Nvlink, PbDetail::Nvlink(Default::default())),
        (pb::Kind::PcieReplay, PbDetail::PcieReplay(pb::PcieReplayDetail { count: 10, delta: Some(-3) })),
        (pb::Kind::Mce, PbDetail::Mce(Default::default())),
        (
            pb::Kind::PcieAer,
            PbDetail::PcieAer(pb::PcieAerDetail {
                severity: pb::AerSeverity::Fatal as i32,
                device: "0000:3b:00.0".into(),
                ..Default::default()
            }),
        ),
        (
            pb::Kind::Dcgm,
            PbDetail::Dcgm(pb::DcgmDetail {
                check: "pcie".into(),
                result: pb::DcgmResult::Pass as i32,
                ..Default::default()
            }),
        ),
        (
            pb::Kind::CloudMaintenance,
            PbDetail::CloudMaintenance(pb::CloudMaintenanceDetail {
                provider: pb::CloudProvider::Aws as i32,
                event_type: "system-reboot".into(),
                ..Default::default()
            }),
        ),
        (
            pb::Kind::MonitorHealth,
            PbDetail::MonitorHealth(pb::MonitorHealthDetail {
                monitor: "nvml".into(),
                state: pb::MonitorState::Ok as i32,
                message: None,
            }),
        ),
        (pb::Kind::Custom, PbDetail::Custom(pb::CustomDetail { monitor: "m".into(), values: HashMap::new() })),
    ];
    assert_eq!(details.len(), 17, "every kind but unspecified");
    for (kind, detail) in details {
        let converted = to_health_event(event(kind, detail), &context())
            .unwrap_or_else(|e| panic!("{} should be valid: {e}", kind.as_str_name()));
        assert_eq!(converted.kind, converted.detail.kind());
        assert_eq!(
            format!("KIND_{:?}", converted.kind).to_uppercase().replace('_', ""),
            kind.as_str_name().replace('_', "")
        );
        gpumedic_schemas::framing::encode(&converted).expect("encodes");
    }
}

/// Each rule, broken once on an otherwise valid event, names its field.
#[test]
fn each_validation_error_names_its_field() {
    type Break = fn(&mut pb::IngestEvent);
    fn xid(event: &mut pb::IngestEvent) -> &mut pb::XidDetail {
        match event.detail.as_mut() {
            Some(PbDetail::Xid(xid)) => xid,
            _ => unreachable!("xid_event has an xid detail"),
        }
    }
    let xid_cases: Vec<(&str, Break)> = vec![
        ("event_id", |e| e.event_id = "not-a-uuid".into()),
        ("event_id", |e| e.event_id = Uuid::nil().to_string()),
        ("observed_at_micros", |e| e.observed_at_micros = -1),
        ("observed_at_micros", |e| e.observed_at_micros = now().timestamp_micros() + 6 * 60 * 1_000_000),
        ("component", |e| e.component = pb::Component::Unspecified as i32),
        ("component", |e| e.component = 99),
        ("entity.gpu_uuid", |e| e.entity.as_mut().unwrap().gpu_uuid = Some(String::new())),
        ("entity.pci_bus_id", |e| e.entity.as_mut().unwrap().pci_bus_id = Some("x".repeat(MAX_NAME_BYTES + 1))),
        ("entity.gpu_index", |e| e.entity.as_mut().unwrap().gpu_index = Some(-1)),
        ("entity.nvlink_link", |e| e.entity.as_mut().unwrap().nvlink_link = Some(-7)),
        ("kind", |e| e.kind = pb::Kind::Unspecified as i32),
        ("kind", |e| e.kind = pb::Kind::Sxid as i32),
        ("kind", |e| e.kind = 1000),
        ("detail", |e| e.detail = None),
        ("raw", |e| e.raw = Some(String::new())),
        ("raw", |e| e.raw = Some("x".repeat(MAX_TEXT_BYTES + 1))),
        ("client_version", |e| e.client_version = "v".repeat(MAX_NAME_BYTES + 1)),
        ("detail.xid.code", |e| xid(e).code = -1),
        ("detail.xid.pid", |e| xid(e).pid = Some(-1)),
        ("detail.xid.process", |e| xid(e).process = Some(String::new())),
        ("detail.xid.recovery_action", |e| xid(e).recovery_action = 42),
        ("detail.xid.nvlink5.unit", |e| xid(e).nvlink5.as_mut().unwrap().unit = String::new()),
        ("detail.xid.nvlink5.link", |e| xid(e).nvlink5.as_mut().unwrap().link = Some(-1)),
    ];
    for (field, break_it) in xid_cases {
        let mut event = xid_event();
        break_it(&mut event);
        assert_eq!(field_of(to_health_event(event, &context())), field);
    }

    let detail_cases: Vec<(&str, pb::Kind, PbDetail)> = vec![
        ("detail.gpu_lost.reason", pb::Kind::GpuLost, PbDetail::GpuLost(pb::GpuLostDetail { reason: String::new() })),
        (
            "detail.ecc.double_bit_aggregate",
            pb::Kind::Ecc,
            PbDetail::Ecc(pb::EccDetail { double_bit_aggregate: Some(-2), ..Default::default() }),
        ),
        (
            "detail.retired_pages.single_bit",
            pb::Kind::RetiredPages,
            PbDetail::RetiredPages(pb::RetiredPagesDetail { single_bit: -1, ..Default::default() }),
        ),
        (
            "detail.row_remap.uncorrectable",
            pb::Kind::RowRemap,
            PbDetail::RowRemap(pb::RowRemapDetail { uncorrectable: -1, ..Default::default() }),
        ),
        (
            "detail.power.watts",
            pb::Kind::Power,
            PbDetail::Power(pb::PowerDetail { watts: f64::NAN, limit_watts: None }),
        ),
        (
            "detail.power.limit_watts",
            pb::Kind::Power,
            PbDetail::Power(pb::PowerDetail { watts: 1.0, limit_watts: Some(f64::INFINITY) }),
        ),
        (
            "detail.throttle.reasons[1]",
            pb::Kind::Throttle,
            PbDetail::Throttle(pb::ThrottleDetail { reasons: vec!["hw_slowdown".into(), String::new()], mask: None }),
        ),
        (
            "detail.throttle.reasons",
            pb::Kind::Throttle,
            PbDetail::Throttle(pb::ThrottleDetail { reasons: vec!["r".into(); MAX_ENTRIES + 1], mask: None }),
        ),
        ("detail.nvlink.link", pb::Kind::Nvlink, PbDetail::Nvlink(pb::NvlinkDetail { link: -1, ..Default::default() })),
        (
            "detail.pcie_replay.count",
            pb::Kind::PcieReplay,
            PbDetail::PcieReplay(pb::PcieReplayDetail { count: -1, delta: None }),
        ),
        ("detail.mce.bank", pb::Kind::Mce, PbDetail::Mce(pb::MceDetail { bank: Some(-5), ..Default::default() })),
        (
            "detail.pcie_aer.severity",
            pb::Kind::PcieAer,
            PbDetail::PcieAer(pb::PcieAerDetail { device: "0000:3b:00.0".into(), ..Default::default() }),
        ),
        (
            "detail.pcie_aer.device",
            pb::Kind::PcieAer,
            PbDetail::PcieAer(pb::PcieAerDetail { severity: pb::AerSeverity::Fatal as i32, ..Default::default() }),
        ),
        (
            "detail.dcgm.check",
            pb::Kind::Dcgm,
            PbDetail::Dcgm(pb::DcgmDetail { result: pb::DcgmResult::Fail as i32, ..Default::default() }),
        ),
        (
            "detail.dcgm.result",
            pb::Kind::Dcgm,
            PbDetail::Dcgm(pb::DcgmDetail { check: "diag".into(), result: 9, ..Default::default() }),
        ),
        (
            "detail.cloud_maintenance.provider",
            pb::Kind::CloudMaintenance,
            PbDetail::CloudMaintenance(pb::CloudMaintenanceDetail {
                event_type: "reboot".into(),
                ..Default::default()
            }),
        ),
        (
            "detail.cloud_maintenance.window_end_micros",
            pb::Kind::CloudMaintenance,
            PbDetail::CloudMaintenance(pb::CloudMaintenanceDetail {
                provider: pb::CloudProvider::Aws as i32,
                event_type: "reboot".into(),
                window_start_micros: Some(2_000),
                window_end_micros: Some(1_000),
                ..Default::default()
            }),
        ),
        (
            "detail.monitor_health.state",
            pb::Kind::MonitorHealth,
            PbDetail::MonitorHealth(pb::MonitorHealthDetail { monitor: "nvml".into(), ..Default::default() }),
        ),
        (
            "detail.custom.monitor",
            pb::Kind::Custom,
            PbDetail::Custom(pb::CustomDetail { monitor: String::new(), values: HashMap::new() }),
        ),
        (
            "detail.custom.values",
            pb::Kind::Custom,
            PbDetail::Custom(pb::CustomDetail {
                monitor: "m".into(),
                values: HashMap::from([(String::new(), "v".into())]),
            }),
        ),
        (
            "detail.custom.values",
            pb::Kind::Custom,
            PbDetail::Custom(pb::CustomDetail {
                monitor: "m".into(),
                values: (0..=MAX_ENTRIES).map(|i| (format!("k{i}"), "v".into())).collect(),
            }),
        ),
        (
            "detail.custom.values[\"k\"]",
            pb::Kind::Custom,
            PbDetail::Custom(pb::CustomDetail {
                monitor: "m".into(),
                values: HashMap::from([("k".into(), "v".repeat(MAX_TEXT_BYTES + 1))]),
            }),
        ),
    ];
    for (field, kind, detail) in detail_cases {
        assert_eq!(field_of(to_health_event(event(kind, detail), &context())), field);
    }
}

#[test]
fn the_callers_node_is_never_the_published_one() {
    // Naming the collector's own node is allowed, and changes nothing.
    let mut same = custom_event();
    same.node = NODE.into();
    assert_eq!(to_health_event(same, &context()).expect("own node").node, NODE);

    // Naming another node is refused, even when the event is otherwise malformed.
    let mut other = custom_event();
    other.node = "gpu-node-18".into();
    other.component = pb::Component::Unspecified as i32;
    let error = to_health_event(other, &context()).unwrap_err();
    assert_eq!(error, IngestError::NodeNotServed { claimed: "gpu-node-18".into(), serving: NODE.into() });
    assert_eq!(error.code(), tonic::Code::PermissionDenied);
    assert_eq!(error.field(), None);
    let status = error.to_status(4);
    assert_eq!(status.code(), tonic::Code::PermissionDenied);
    assert!(status.message().starts_with("events[4]: "), "{}", status.message());
}

#[test]
fn results_carry_the_documented_codes() {
    let published = pb::EventResult::published(2, Uuid::nil());
    assert_eq!((published.index, published.code), (2, 0));
    assert!(published.field.is_empty() && published.message.is_empty());

    let mut broken = xid_event();
    broken.entity.as_mut().unwrap().gpu_index = Some(-1);
    let error = to_health_event(broken, &context()).unwrap_err();
    assert_eq!(error.code(), tonic::Code::InvalidArgument);
    let rejected = pb::EventResult::rejected(5, "caller-id", &error);
    assert_eq!(rejected.index, 5);
    assert_eq!(rejected.code, 3, "INVALID_ARGUMENT");
    assert_eq!(rejected.field, "entity.gpu_index");
    assert_eq!(rejected.event_id, "caller-id");
    assert!(rejected.message.contains("negative"), "{}", rejected.message);
}
