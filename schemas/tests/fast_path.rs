//! The codec's fast path (Avro binary read and written straight from the Rust types) is exactly
//! apache-avro with the schema files: the same bytes for every record, every detail kind with its
//! optional fields set and unset, and every enum symbol; and the same verdict (the same record, or
//! an error) on mutated bytes.

mod common;

use std::fmt::Debug;

use apache_avro::Schema;
use apache_avro::reader::datum::GenericDatumReader;
use apache_avro::writer::datum::GenericDatumWriter;
use common::XorShift;
use gpumedic_schemas::action::ActionStatus;
use gpumedic_schemas::health::*;
use gpumedic_schemas::verdict::{RecommendedAction, Severity};
use gpumedic_schemas::{ActionOutcome, EnrichedHealthEvent, Record, Verdict, avro, framing};

/// What apache-avro writes for `record` with `schema`, by field name and symbol name.
fn apache_body<T: Record>(schema: &Schema, record: &T) -> Vec<u8> {
    GenericDatumWriter::builder(schema)
        .human_readable(false)
        .build()
        .unwrap()
        .write_ser_to_vec(record)
        .unwrap_or_else(|e| panic!("{} does not serialize with its schema: {e}", T::NAME))
}

/// What apache-avro reads from `body` with `schema`, trailing bytes refused as the codec does.
fn apache_read<T: Record>(schema: &Schema, body: &[u8]) -> Option<T> {
    let reader = GenericDatumReader::builder(schema).human_readable(false).build().unwrap();
    let mut rest = body;
    let record = reader.read_deser::<T>(&mut rest).ok()?;
    rest.is_empty().then_some(record)
}

fn assert_same_as_apache<T: Record + PartialEq + Debug>(schema: &Schema, record: &T) {
    let framed = framing::encode(record).unwrap();
    let body = &framed[framing::HEADER_LEN..];
    assert_eq!(body, apache_body(schema, record).as_slice(), "{} bytes differ from apache-avro: {record:?}", T::NAME);
    assert_eq!(&framing::decode::<T>(&framed).unwrap(), record, "{} fast read", T::NAME);
    assert_eq!(apache_read::<T>(schema, body).as_ref(), Some(record), "{} apache-avro read", T::NAME);
}

/// Each detail of `common::all_details` with every optional field unset and every collection
/// empty: the union branch 0 and the empty block, where the full details cover branch 1.
fn minimal_details() -> Vec<Detail> {
    vec![
        Detail::Xid(XidDetail {
            code: -1,
            text: String::new(),
            pid: None,
            process: None,
            nvlink5: Some(Nvlink5XidFields {
                unit: "NETIR_LINK".into(),
                severity: "Fatal".into(),
                link: None,
                intr_info: None,
                error_status: None,
            }),
            recovery_action: None,
        }),
        Detail::Xid(XidDetail {
            code: 79,
            text: "GPU has fallen off the bus".into(),
            pid: None,
            process: None,
            nvlink5: None,
            recovery_action: None,
        }),
        Detail::Sxid(SxidDetail { code: 0, text: "x".into(), fatal: None, link: None }),
        Detail::Ecc(EccDetail::default()),
        Detail::Temperature(TemperatureDetail { celsius: i32::MIN, slowdown_celsius: None, shutdown_celsius: None }),
        Detail::Power(PowerDetail { watts: -0.0, limit_watts: None }),
        Detail::Throttle(ThrottleDetail { reasons: Vec::new(), mask: None }),
        Detail::Nvlink(NvlinkDetail {
            link: i32::MAX,
            active: None,
            crc_flit_errors: None,
            crc_data_errors: None,
            replay_errors: None,
            recovery_errors: None,
        }),
        Detail::PcieReplay(PcieReplayDetail { count: i64::MAX, delta: None }),
        Detail::Mce(MceDetail { text: "ü".into(), cpu: None, bank: None, status: None, corrected: None }),
        Detail::PcieAer(PcieAerDetail {
            severity: AerSeverity::Fatal,
            device: String::new(),
            error_type: None,
            text: String::new(),
        }),
        Detail::Dcgm(DcgmDetail { check: String::new(), result: DcgmResult::Pass, error_code: None, message: None }),
        Detail::CloudMaintenance(CloudMaintenanceDetail {
            provider: CloudProvider::Other,
            event_type: String::new(),
            provider_event_id: None,
            window_start: None,
            window_end: None,
            description: None,
        }),
        Detail::MonitorHealth(MonitorHealthDetail { monitor: "dcgm".into(), state: MonitorState::Ok, message: None }),
        Detail::Custom(CustomDetail { monitor: String::new(), values: Default::default() }),
        Detail::GpuInventory(GpuInventoryDetail { gpus: Vec::new(), reason: String::new(), expected: None }),
        Detail::GpuInventory(GpuInventoryDetail {
            gpus: vec![GpuIdentity::default(), common::full_gpu()],
            reason: GpuInventoryDetail::START.into(),
            expected: None,
        }),
        Detail::Absent,
    ]
}

#[test]
fn every_detail_full_and_minimal_is_written_as_apache_avro_writes_it() {
    for detail in common::all_details().into_iter().chain(minimal_details()) {
        let mut event = common::health_event(detail.clone());
        assert_same_as_apache(avro::health_event(), &event);
        event.entity = Entity::default();
        event.raw = None;
        event.healthy = true;
        event.synthetic = false;
        event.boot_id = None;
        assert_same_as_apache(avro::health_event(), &event);
        let mut enriched = common::enriched(detail);
        assert_same_as_apache(avro::enriched_health_event(), &enriched);
        enriched.gpu = None;
        enriched.gpu_unresolved = true;
        enriched.node_context.expected_gpus = None;
        assert_same_as_apache(avro::enriched_health_event(), &enriched);
    }
}

/// Symbol order is the one thing the types carry that a name lookup would not check: write every
/// symbol of every enum and compare.
#[test]
fn every_enum_symbol_is_written_at_its_schema_index() {
    use Component as C;
    use Source as S;
    for (source, component) in [
        (S::Unknown, C::Unknown),
        (S::Nvml, C::Gpu),
        (S::KernelLog, C::Nvswitch),
        (S::Dcgm, C::Nvlink),
        (S::Cloud, C::Pcie),
        (S::Ingest, C::Memory),
        (S::Synthetic, C::Cpu),
        (S::Synthetic, C::Node),
    ] {
        let mut event = common::health_event(Detail::Absent);
        event.source = source;
        event.component = component;
        assert_same_as_apache(avro::health_event(), &event);
    }
    // Kind::Unknown with its detail absent, every other kind through its detail.
    let mut unknown = common::health_event(Detail::Absent);
    unknown.kind = Kind::Unknown;
    assert_same_as_apache(avro::health_event(), &unknown);

    use XidRecoveryAction as X;
    for action in [X::Unknown, X::None, X::GpuReset, X::NodeReboot, X::DrainP2p, X::DrainAndReset] {
        let detail = Detail::Xid(XidDetail {
            code: 154,
            text: "GPU recovery action changed".into(),
            pid: None,
            process: None,
            nvlink5: None,
            recovery_action: Some(action),
        });
        assert_same_as_apache(avro::health_event(), &common::health_event(detail));
    }
    for severity in [AerSeverity::Unknown, AerSeverity::Corrected, AerSeverity::NonFatal, AerSeverity::Fatal] {
        let detail = Detail::PcieAer(PcieAerDetail {
            severity,
            device: "0000:3b:00.0".into(),
            error_type: None,
            text: "aer".into(),
        });
        assert_same_as_apache(avro::health_event(), &common::health_event(detail));
    }
    for result in [DcgmResult::Unknown, DcgmResult::Pass, DcgmResult::Warn, DcgmResult::Fail, DcgmResult::Skip] {
        let detail = Detail::Dcgm(DcgmDetail { check: "diag".into(), result, error_code: None, message: None });
        assert_same_as_apache(avro::health_event(), &common::health_event(detail));
    }
    use CloudProvider as P;
    for provider in [P::Unknown, P::Aws, P::Gcp, P::Azure, P::Other] {
        let detail = Detail::CloudMaintenance(CloudMaintenanceDetail {
            provider,
            event_type: "reboot".into(),
            provider_event_id: None,
            window_start: None,
            window_end: None,
            description: None,
        });
        assert_same_as_apache(avro::health_event(), &common::health_event(detail));
    }
    use MonitorState as M;
    for state in [M::Unknown, M::Ok, M::Hung, M::Unavailable, M::Error] {
        let detail = Detail::MonitorHealth(MonitorHealthDetail { monitor: "nvml".into(), state, message: None });
        assert_same_as_apache(avro::health_event(), &common::health_event(detail));
    }

    use RecommendedAction as A;
    let actions = [A::Unknown, A::None, A::Monitor, A::Cordon, A::Drain, A::ResetGpu, A::RebootNode, A::ReplaceNode];
    let actions = actions.into_iter().chain([A::ContactSupport, A::Custom, A::RunDiagnostics]);
    let severities = [Severity::Unknown, Severity::Info, Severity::Warning, Severity::Critical].into_iter().cycle();
    for (action, severity) in actions.zip(severities) {
        let mut verdict = common::verdict();
        verdict.action = action;
        verdict.severity = severity;
        assert_same_as_apache(avro::verdict(), &verdict);
        verdict.not_before = None;
        verdict.deferrable = false;
        verdict.workload = None;
        assert_same_as_apache(avro::verdict(), &verdict);
        let mut outcome = common::action_outcome();
        outcome.action = action;
        assert_same_as_apache(avro::action_outcome(), &outcome);
    }
    use ActionStatus as T;
    for status in [T::Unknown, T::Applied, T::DryRun, T::SkippedByMode, T::BlockedByBreaker, T::AlreadyDone, T::Failed]
    {
        let mut outcome = common::action_outcome();
        outcome.status = status;
        assert_same_as_apache(avro::action_outcome(), &outcome);
    }
}

/// Mutates `body` (bit flips, boundary bytes, truncation, insertion, random tails) `rounds` times
/// and checks the fast reader and apache-avro agree on each result: the same record, or both an
/// error.
fn readers_agree_on_mutations<T: Record>(schema: &Schema, body: &[u8], rng: &mut XorShift) {
    let mut outcomes = [0usize; 2];
    let interesting = [0x00, 0x01, 0x02, 0x7f, 0x80, 0xff, 0xfe, 0x3f, 0x40];
    for round in 0..3_000 {
        let mut mutated = body.to_vec();
        for _ in 0..1 + rng.below(3) {
            match rng.below(5) {
                0 if !mutated.is_empty() => {
                    let i = rng.below(mutated.len());
                    mutated[i] ^= 1 << rng.below(8);
                }
                1 if !mutated.is_empty() => {
                    let i = rng.below(mutated.len());
                    mutated[i] = interesting[rng.below(interesting.len())];
                }
                2 => mutated.truncate(rng.below(mutated.len() + 1)),
                3 => {
                    let i = rng.below(mutated.len() + 1);
                    mutated.insert(i, interesting[rng.below(interesting.len())]);
                }
                _ => mutated.extend((0..rng.below(8)).map(|_| rng.next() as u8)),
            }
        }
        let mut framed = vec![0];
        framed.extend_from_slice(&T::SCHEMA_ID.to_be_bytes());
        framed.extend_from_slice(&mutated);
        // Compared through their encodings: a mutated double may be NaN, which is not equal to
        // itself as a value but is as bytes.
        let fast = framing::decode::<T>(&framed).ok().map(|record| framing::encode(&record).unwrap());
        let apache = apache_read::<T>(schema, &mutated).map(|record| framing::encode(&record).unwrap());
        outcomes[usize::from(fast.is_some())] += 1;
        assert_eq!(fast, apache, "{} readers disagree at round {round} on {mutated:02x?}", T::NAME);
    }
    // Both outcomes must be common, or the comparison proves little.
    assert!(outcomes.iter().all(|&n| n > 100), "{}: rejected and accepted {outcomes:?}", T::NAME);
}

#[test]
fn the_fast_reader_and_apache_avro_agree_on_mutated_bytes() {
    let mut rng = XorShift(0x2545_F491_4F6C_DD1D);
    for detail in common::all_details() {
        let event = common::health_event(detail);
        readers_agree_on_mutations::<HealthEvent>(
            avro::health_event(),
            &apache_body(avro::health_event(), &event),
            &mut rng,
        );
    }
    let enriched = common::enriched(common::all_details().remove(16));
    readers_agree_on_mutations::<EnrichedHealthEvent>(
        avro::enriched_health_event(),
        &apache_body(avro::enriched_health_event(), &enriched),
        &mut rng,
    );
    let verdict = common::verdict();
    readers_agree_on_mutations::<Verdict>(avro::verdict(), &apache_body(avro::verdict(), &verdict), &mut rng);
    let outcome = common::action_outcome();
    readers_agree_on_mutations::<ActionOutcome>(
        avro::action_outcome(),
        &apache_body(avro::action_outcome(), &outcome),
        &mut rng,
    );
}
