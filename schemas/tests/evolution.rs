//! The evolution gate and reader-schema resolution across versions.
//!
//! - Every current schema is fully compatible, both ways, with every released version under
//!   `schemas/avro/released/` (`v1/`, `v2/` and the latest, at the top). When this fails, the change would
//!   break producers or consumers that upgrade at a different time, or data still on the topics:
//!   make the change compatible (optional fields with defaults, enum symbols appended), or release
//!   a new topic version.
//! - The schema behind an embedded id never changes: ids 1 to 4 are the files under `released/v1/`,
//!   5 to 8 those under `released/v2/`, 9 and 10 (and 7 and 8, unchanged) the latest release. Changing a current schema therefore fails here until it is
//!   released: new ids in the codec's table, the old files kept under `released/v<N>/`.
//! - Records framed with the version 1 ids decode into this build's types, the new fields at their
//!   defaults, both as apache-avro writes them with the v1 files and as the v1 build wrote them
//!   (`tests/fixtures/v1_frames.txt`).
//! - The fixtures `health_event_v3.avsc` (named before version 3 was released; it is the current
//!   schema plus a `sequence` field) and `health_event_incompatible.avsc` are the next
//!   evolution: this build reads what a v3 writer wrote and the reverse, and an incompatible change
//!   is rejected with a message that names the field.

mod common;

use apache_avro::Schema;
use apache_avro::reader::datum::GenericDatumReader;
use apache_avro::types::Value;
use apache_avro::writer::datum::GenericDatumWriter;
use gpumedic_schemas::enriched::NodeContext;
use gpumedic_schemas::health::{Detail, Kind, Source};
use gpumedic_schemas::verdict::RecommendedAction;
use gpumedic_schemas::{ActionOutcome, EnrichedHealthEvent, HealthEvent, Record, Verdict, avro, compat, framing};

const NAMES: [&str; 4] = ["HealthEvent", "EnrichedHealthEvent", "Verdict", "ActionOutcome"];

/// Every released version, oldest first, with the embedded ids of its four schemas.
const RELEASED: [(&str, [&str; 4], [u32; 4]); 3] = [
    (
        "v1",
        [
            include_str!("../avro/released/v1/health_event.avsc"),
            include_str!("../avro/released/v1/enriched_health_event.avsc"),
            include_str!("../avro/released/v1/verdict.avsc"),
            include_str!("../avro/released/v1/action_outcome.avsc"),
        ],
        [framing::HEALTH_EVENT_V1, framing::ENRICHED_HEALTH_EVENT_V1, framing::VERDICT_V1, framing::ACTION_OUTCOME_V1],
    ),
    (
        "v2",
        [
            include_str!("../avro/released/v2/health_event.avsc"),
            include_str!("../avro/released/v2/enriched_health_event.avsc"),
            include_str!("../avro/released/v2/verdict.avsc"),
            include_str!("../avro/released/v2/action_outcome.avsc"),
        ],
        [framing::HEALTH_EVENT_V2, framing::ENRICHED_HEALTH_EVENT_V2, framing::VERDICT_V2, framing::ACTION_OUTCOME_V2],
    ),
    (
        "latest (v3)",
        [
            include_str!("../avro/released/health_event.avsc"),
            include_str!("../avro/released/enriched_health_event.avsc"),
            include_str!("../avro/released/verdict.avsc"),
            include_str!("../avro/released/action_outcome.avsc"),
        ],
        [framing::HEALTH_EVENT_V3, framing::ENRICHED_HEALTH_EVENT_V3, framing::VERDICT_V2, framing::ACTION_OUTCOME_V2],
    ),
];
const HEALTH_EVENT_V3: &str = include_str!("fixtures/health_event_v3.avsc");
const HEALTH_EVENT_INCOMPATIBLE: &str = include_str!("fixtures/health_event_incompatible.avsc");
/// Frames the version 1 build (commit 7a6e41c) encoded from `tests/common` as it was then: one
/// line each, `<record> <hex>`.
const V1_FRAMES: &str = include_str!("fixtures/v1_frames.txt");

fn one(source: &str) -> Schema {
    avro::parse_set(&[source]).expect("fixture parses").remove(0)
}

#[test]
fn every_current_schema_is_compatible_with_every_released_version() {
    let mut failures = Vec::new();
    for (version, sources, _) in RELEASED {
        let released = avro::parse_set(&sources).unwrap_or_else(|e| panic!("released {version} schemas parse: {e}"));
        for ((name, current), released) in NAMES.iter().zip(avro::current()).zip(&released) {
            if let Err(e) = compat::check_full(name, current, released) {
                failures.push(format!("{version}: {e}"));
            }
        }
    }
    assert!(failures.is_empty(), "evolution gate:\n{}", failures.join("\n"));
}

#[test]
fn the_schema_behind_every_embedded_id_is_its_released_file() {
    let mut covered = Vec::new();
    for (version, sources, ids) in RELEASED {
        let released = avro::parse_set(&sources).expect("released schemas parse");
        for ((name, id), released) in NAMES.iter().zip(ids).zip(&released) {
            let embedded = framing::schema_for_id(id).unwrap_or_else(|| panic!("no schema for id {id}"));
            assert_eq!(
                embedded.canonical_form(),
                released.canonical_form(),
                "id {id} ({name} {version}) is not its released schema: records already written with it would be \
                 read with another. Release the change under new ids instead."
            );
            covered.push(id);
        }
    }
    covered.sort_unstable();
    // A record that did not change in a release keeps its id: the same id in two releases.
    covered.dedup();
    let table: Vec<u32> = framing::SCHEMA_TABLE.iter().map(|entry| entry.id).collect();
    assert_eq!(covered, table, "every id of the table is a released schema");
}

#[test]
fn this_build_writes_the_current_schemas_under_the_latest_ids() {
    assert_eq!(framing::schema_for_id(HealthEvent::SCHEMA_ID), Some(avro::health_event()));
    assert_eq!(framing::schema_for_id(EnrichedHealthEvent::SCHEMA_ID), Some(avro::enriched_health_event()));
    assert_eq!(framing::schema_for_id(Verdict::SCHEMA_ID), Some(avro::verdict()));
    assert_eq!(framing::schema_for_id(ActionOutcome::SCHEMA_ID), Some(avro::action_outcome()));
    let payload = framing::encode(&common::health_event(Detail::Absent)).unwrap();
    assert_eq!(&payload[..5], &[0, 0, 0, 0, 9]);
}

#[test]
fn the_gate_accepts_a_compatible_evolution() {
    compat::check_full("HealthEvent", &one(HEALTH_EVENT_V3), avro::health_event()).unwrap();
}

#[test]
fn the_gate_rejects_a_required_field_without_default_and_names_it() {
    let err = compat::check_full("HealthEvent", &one(HEALTH_EVENT_INCOMPATIBLE), avro::health_event()).unwrap_err();
    let message = err.to_string();
    assert_eq!(err.schema, "HealthEvent");
    assert_eq!(err.direction, "backward");
    assert!(message.contains("HealthEvent") && message.contains("'rack'") && message.contains("default"), "{message}");
}

#[test]
fn the_gate_rejects_a_removed_enum_default() {
    // Without a default symbol, a reader cannot read a symbol a newer writer added.
    let strip = |text: &str| text.replace(r#""name": "Source", "default": "unknown","#, r#""name": "Source","#);
    let stripped = strip(avro::HEALTH_EVENT_AVSC);
    assert_ne!(stripped, avro::HEALTH_EVENT_AVSC, "the default to strip is where the test expects it");
    let err = compat::check_full("HealthEvent", &one(HEALTH_EVENT_V3), &one(&stripped)).unwrap_err();
    assert_eq!(err.direction, "forward", "{err}");
}

fn field_mut<'a>(record: &'a mut Value, name: &str) -> &'a mut Value {
    let Value::Record(fields) = record else { panic!("not a record") };
    &mut fields.iter_mut().find(|(field, _)| field == name).unwrap_or_else(|| panic!("no field {name}")).1
}

/// Reads `body`, written with `writer`, as a generic value of `reader`.
fn resolve(writer: &Schema, reader: &Schema, body: &[u8]) -> Value {
    let mut rest = body;
    let value =
        GenericDatumReader::builder(writer).reader_schema(reader).build().unwrap().read_value(&mut rest).unwrap();
    assert!(rest.is_empty(), "trailing bytes");
    value
}

/// `record` as a writer with `schema` (an older or newer version of its schema) would write it:
/// the fields that version lacks dropped, the ones only it has at their defaults.
fn written_with<T: Record>(record: &T, schema: &Schema) -> Vec<u8> {
    let current = framing::schema_for_id(T::SCHEMA_ID).unwrap();
    let value = resolve(current, schema, &framing::encode(record).unwrap()[5..]);
    assert!(value.validate(schema), "{}: not a valid datum of the other version", T::NAME);
    GenericDatumWriter::builder(schema).build().unwrap().write_value_to_vec(value).expect("valid datum")
}

fn frame(id: u32, body: &[u8]) -> Vec<u8> {
    let mut payload = vec![framing::MAGIC_BYTE];
    payload.extend_from_slice(&id.to_be_bytes());
    payload.extend_from_slice(body);
    payload
}

/// `event` without what version 2 added: what a v1 record of it reads as.
fn v1_view(event: &HealthEvent) -> HealthEvent {
    HealthEvent { boot_id: None, workloads: None, ..event.clone() }
}

#[test]
fn a_v1_health_event_decodes_into_the_v2_type_with_the_defaults() {
    let v1 = &avro::v1()[0];
    let details = common::all_details();
    let mut seen = 0;
    for detail in details.into_iter().filter(|d| d.kind() != Kind::GpuInventory) {
        let event = common::health_event(detail);
        assert!(event.boot_id.is_some(), "the fixture sets the v2 field, so its default shows");
        let payload = frame(framing::HEALTH_EVENT_V1, &written_with(&event, v1));
        let read: HealthEvent = framing::decode(&payload).unwrap();
        assert_eq!(read, v1_view(&event));
        seen += 1;
    }
    assert_eq!(seen, 17, "every kind v1 knows");
}

#[test]
fn a_v1_enriched_event_decodes_into_the_v2_type_with_the_defaults() {
    let v1 = &avro::v1()[1];
    let mut enriched = common::enriched(common::all_details().remove(0));
    enriched.gpu_unresolved = true;
    let payload = frame(framing::ENRICHED_HEALTH_EVENT_V1, &written_with(&enriched, v1));
    let read: EnrichedHealthEvent = framing::decode(&payload).unwrap();
    let expected = EnrichedHealthEvent {
        event: v1_view(&enriched.event),
        node_context: NodeContext { expected_gpus: None, ..enriched.node_context.clone() },
        gpu: None,
        gpu_unresolved: false,
        ..enriched
    };
    assert_eq!(read, expected);
}

#[test]
fn a_v1_verdict_and_action_outcome_decode_into_the_v2_types_with_the_defaults() {
    let verdict = common::verdict();
    let payload = frame(framing::VERDICT_V1, &written_with(&verdict, &avro::v1()[2]));
    let read: Verdict = framing::decode(&payload).unwrap();
    assert_eq!(read, Verdict { not_before: None, deferrable: false, workload: None, ..verdict });

    let outcome = common::action_outcome();
    let payload = frame(framing::ACTION_OUTCOME_V1, &written_with(&outcome, &avro::v1()[3]));
    assert_eq!(framing::decode::<ActionOutcome>(&payload).unwrap(), outcome);
}

/// Decodes a frame the v1 build wrote, and checks that the record, seen through the v1 schema
/// again, is what the frame holds: nothing a v1 record carried was lost or changed on the way into
/// the v2 type. (Compared as values, not bytes: a map's entries may be written in any order.)
fn check_v1_frame<T: Record + std::fmt::Debug>(frame: &[u8], v1: &Schema, id: u32) -> T {
    let (frame_id, body) = framing::split_frame(frame).unwrap();
    assert_eq!(frame_id, id, "{}", T::NAME);
    let record: T = framing::decode(frame).unwrap_or_else(|e| panic!("{}: v1 frame does not decode: {e}", T::NAME));
    let current = framing::schema_for_id(T::SCHEMA_ID).unwrap();
    assert_eq!(
        resolve(current, v1, &framing::encode(&record).unwrap()[5..]),
        resolve(v1, v1, body),
        "{}: v1 content changed on the way into v2: {record:?}",
        T::NAME
    );
    record
}

#[test]
fn frames_written_by_the_v1_build_still_decode() {
    let mut counts = [0; 4];
    for line in V1_FRAMES.lines().filter(|line| !line.is_empty() && !line.starts_with('#')) {
        let (record, hex) = line.split_once(' ').expect("<record> <hex>");
        let bytes: Vec<u8> =
            (0..hex.len()).step_by(2).map(|i| u8::from_str_radix(&hex[i..i + 2], 16).expect("hex")).collect();
        match record {
            "HealthEvent" => {
                let event: HealthEvent = check_v1_frame(&bytes, &avro::v1()[0], framing::HEALTH_EVENT_V1);
                assert_eq!(event.boot_id, None);
                assert_ne!(event.kind, Kind::Unknown);
                assert_eq!(event.detail.kind(), event.kind);
                counts[0] += 1;
            }
            "EnrichedHealthEvent" => {
                let enriched: EnrichedHealthEvent =
                    check_v1_frame(&bytes, &avro::v1()[1], framing::ENRICHED_HEALTH_EVENT_V1);
                assert_eq!((enriched.gpu, enriched.gpu_unresolved), (None, false));
                assert_eq!(enriched.node_context.expected_gpus, None);
                counts[1] += 1;
            }
            "Verdict" => {
                let verdict: Verdict = check_v1_frame(&bytes, &avro::v1()[2], framing::VERDICT_V1);
                assert_eq!((verdict.not_before, verdict.deferrable, verdict.workload), (None, false, None));
                counts[2] += 1;
            }
            "ActionOutcome" => {
                check_v1_frame::<ActionOutcome>(&bytes, &avro::v1()[3], framing::ACTION_OUTCOME_V1);
                counts[3] += 1;
            }
            other => panic!("unknown record {other}"),
        }
    }
    assert_eq!(counts, [17, 17, 1, 1], "one frame per v1 detail kind, each also enriched; a verdict; an outcome");
}

#[test]
fn a_v1_reader_reads_a_v2_verdict_with_the_new_symbol_as_unknown() {
    let mut verdict = common::verdict();
    verdict.action = RecommendedAction::RunDiagnostics;
    let v1 = &avro::v1()[2];
    let mut value = resolve(avro::verdict(), v1, &framing::encode(&verdict).unwrap()[5..]);
    assert!(value.validate(v1));
    assert_eq!(field_mut(&mut value, "action"), &Value::Enum(0, "unknown".into()));
    assert_eq!(field_mut(&mut value, "rule_id"), &Value::String(verdict.rule_id.clone()));

    let mut event = common::health_event(common::all_details().pop().unwrap());
    assert_eq!(event.kind, Kind::GpuInventory);
    event.entity = Default::default();
    let v1 = &avro::v1()[0];
    let mut value = resolve(avro::health_event(), v1, &framing::encode(&event).unwrap()[5..]);
    assert_eq!(field_mut(&mut value, "kind"), &Value::Enum(0, "unknown".into()));
    let Value::Record(detail) = field_mut(&mut value, "detail") else { panic!("detail is a record") };
    assert!(detail.iter().all(|(_, field)| field == &Value::Union(0, Box::new(Value::Null))), "no detail set for v1");
}

/// `event` as a v3 writer would write it, with the v3-only parts set.
fn written_by_v3(event: &HealthEvent, v3: &Schema) -> Vec<u8> {
    let mut value = resolve(avro::health_event(), v3, &framing::encode(event).unwrap()[5..]);
    *field_mut(&mut value, "sequence") = Value::Union(1, Box::new(Value::Long(7)));
    *field_mut(&mut value, "source") = Value::Enum(7, "bmc".into());
    *field_mut(&mut value, "kind") = Value::Enum(19, "fabric_manager".into());
    let detail = field_mut(&mut value, "detail");
    let Value::Record(detail_fields) = detail else { panic!() };
    for (_, field) in detail_fields.iter_mut() {
        *field = Value::Union(0, Box::new(Value::Null));
    }
    *field_mut(detail, "fabric_manager") =
        Value::Union(1, Box::new(Value::Record(vec![("state".into(), Value::String("degraded".into()))])));
    GenericDatumWriter::builder(v3).build().unwrap().write_value_to_vec(value).expect("valid v3 datum")
}

#[test]
fn this_build_reads_what_a_v3_writer_wrote() {
    let v3 = one(HEALTH_EVENT_V3);
    let event = common::health_event(common::all_details().remove(0));
    let body = written_by_v3(&event, &v3);

    let read: HealthEvent = framing::decode_body_with_writer_schema(&v3, &body).unwrap();
    // New symbols fall back to the enum defaults; the new kind's detail is invisible to v2.
    assert_eq!(read.source, Source::Unknown);
    assert_eq!(read.kind, Kind::Unknown);
    assert_eq!(read.detail, Detail::Absent);
    let expected = HealthEvent { source: Source::Unknown, kind: Kind::Unknown, detail: Detail::Absent, ..event };
    assert_eq!(read, expected);
}

#[test]
fn a_v3_reader_reads_what_this_build_wrote() {
    let v3 = one(HEALTH_EVENT_V3);
    let event = common::health_event(common::all_details().remove(3));
    let payload = framing::encode(&event).unwrap();
    let mut value = resolve(avro::health_event(), &v3, &payload[5..]);
    assert!(value.validate(&v3));
    assert_eq!(
        field_mut(&mut value, "sequence"),
        &Value::Union(0, Box::new(Value::Null)),
        "new field takes its default"
    );
    assert_eq!(field_mut(&mut value, "kind"), &Value::Enum(4, "ecc".into()));
    assert_eq!(field_mut(&mut value, "node"), &Value::String(event.node.clone()));
    assert_eq!(field_mut(&mut value, "boot_id"), &Value::Union(1, Box::new(Value::String(event.boot_id.unwrap()))));
    let detail = field_mut(&mut value, "detail");
    assert_eq!(field_mut(detail, "fabric_manager"), &Value::Union(0, Box::new(Value::Null)));
    assert!(matches!(field_mut(detail, "ecc"), Value::Union(1, _)));
}

/// `event` without what version 3 added: what a v2 record of it reads as.
fn v2_view(event: &HealthEvent) -> HealthEvent {
    HealthEvent { workloads: None, ..event.clone() }
}

#[test]
fn a_v2_health_event_decodes_into_the_v3_type_without_workloads() {
    let v2 = &avro::v2()[0];
    let mut seen = 0;
    for detail in common::all_details() {
        let event = common::health_event(detail);
        assert!(event.workloads.as_ref().is_some_and(|w| !w.is_empty()), "the fixture sets the v3 field");
        let payload = frame(framing::HEALTH_EVENT_V2, &written_with(&event, v2));
        let read: HealthEvent = framing::decode(&payload).unwrap();
        assert_eq!(read, v2_view(&event), "an old writer's event: the collector did not say, not 'no pods'");
        seen += 1;
    }
    assert_eq!(seen, 18, "every kind v2 knows");

    let enriched = common::enriched(common::all_details().remove(0));
    let payload = frame(framing::ENRICHED_HEALTH_EVENT_V2, &written_with(&enriched, &avro::v2()[1]));
    let read: EnrichedHealthEvent = framing::decode(&payload).unwrap();
    assert_eq!(read, EnrichedHealthEvent { event: v2_view(&enriched.event), ..enriched });
}

#[test]
fn a_v2_reader_reads_a_v3_event_with_workloads_and_sees_the_rest_unchanged() {
    let v2 = &avro::v2()[0];
    let event = common::health_event(common::all_details().remove(0));
    let payload = framing::encode(&event).unwrap();
    assert_eq!(framing::split_frame(&payload).unwrap().0, framing::HEALTH_EVENT_V3);
    let value = resolve(avro::health_event(), v2, &payload[5..]);
    assert!(value.validate(v2), "a valid v2 datum");
    let Value::Record(fields) = &value else { panic!("a record") };
    assert!(fields.iter().all(|(name, _)| name != "workloads"), "v2 does not see the new field");
    // Written back with v2 and read by this build: the same event, less what v2 cannot carry.
    let body = GenericDatumWriter::builder(v2).build().unwrap().write_value_to_vec(value).unwrap();
    let read: HealthEvent = framing::decode(&frame(framing::HEALTH_EVENT_V2, &body)).unwrap();
    assert_eq!(read, v2_view(&event));

    // The enriched event as well: the raw event inside it carries the new field.
    let enriched = common::enriched(common::all_details().remove(0));
    let payload = framing::encode(&enriched).unwrap();
    let value = resolve(avro::enriched_health_event(), &avro::v2()[1], &payload[5..]);
    assert!(value.validate(&avro::v2()[1]));
}
