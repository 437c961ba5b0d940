//! The evolution gate and reader-schema resolution across versions.
//!
//! - Every current schema is fully compatible, both ways, with its released version under
//!   `schemas/avro/released/`. When this fails, the change would break producers or consumers that
//!   upgrade at a different time: make the change compatible (optional fields with defaults, enum
//!   symbols appended), or release a new topic version. When a compatible change ships, copy the
//!   file into `released/` and add its id to the codec's schema table.
//! - The fixtures under `tests/fixtures/` are real evolved versions: a v1 reader reads data a v2
//!   writer wrote and the reverse, and an incompatible change is rejected with a message that names
//!   the field.

mod common;

use apache_avro::Schema;
use apache_avro::reader::datum::GenericDatumReader;
use apache_avro::types::Value;
use apache_avro::writer::datum::GenericDatumWriter;
use gpumedic_schemas::health::{Detail, Kind, Source};
use gpumedic_schemas::{HealthEvent, avro, codec, compat};

const RELEASED: [&str; 4] = [
    include_str!("../avro/released/health_event.avsc"),
    include_str!("../avro/released/enriched_health_event.avsc"),
    include_str!("../avro/released/verdict.avsc"),
    include_str!("../avro/released/action_outcome.avsc"),
];
const HEALTH_EVENT_V2: &str = include_str!("fixtures/health_event_v2.avsc");
const HEALTH_EVENT_INCOMPATIBLE: &str = include_str!("fixtures/health_event_incompatible.avsc");

fn one(source: &str) -> Schema {
    avro::parse_set(&[source]).expect("fixture parses").remove(0)
}

#[test]
fn every_current_schema_is_compatible_with_its_released_version() {
    let released = avro::parse_set(&RELEASED).expect("released schemas parse");
    let current = [avro::health_event(), avro::enriched_health_event(), avro::verdict(), avro::action_outcome()];
    let names = ["HealthEvent", "EnrichedHealthEvent", "Verdict", "ActionOutcome"];
    let failures: Vec<String> = names
        .iter()
        .zip(current)
        .zip(&released)
        .filter_map(|((name, current), released)| compat::check_full(name, current, released).err())
        .map(|e| e.to_string())
        .collect();
    assert!(failures.is_empty(), "evolution gate:\n{}", failures.join("\n"));
}

#[test]
fn the_gate_accepts_a_compatible_evolution() {
    compat::check_full("HealthEvent", &one(HEALTH_EVENT_V2), avro::health_event()).unwrap();
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
    // Without a default symbol, a v1 reader cannot read a symbol a v2 writer added.
    let strip = |text: &str| text.replace(r#""name": "Source", "default": "unknown","#, r#""name": "Source","#);
    let reader = one(&strip(avro::HEALTH_EVENT_AVSC));
    let writer = one(HEALTH_EVENT_V2);
    let err = compat::check_full("HealthEvent", &writer, &reader).unwrap_err();
    assert_eq!(err.direction, "forward", "{err}");
}

fn field_mut<'a>(record: &'a mut Value, name: &str) -> &'a mut Value {
    let Value::Record(fields) = record else { panic!("not a record") };
    &mut fields.iter_mut().find(|(field, _)| field == name).unwrap_or_else(|| panic!("no field {name}")).1
}

/// `event` as a v2 writer would write it, with the v2-only parts set.
fn written_by_v2(event: &HealthEvent, v2: &Schema) -> Vec<u8> {
    let v1_body = &codec::encode(event).unwrap()[5..];
    let mut value = GenericDatumReader::builder(avro::health_event())
        .reader_schema(v2)
        .build()
        .unwrap()
        .read_value(&mut &v1_body[..])
        .unwrap();
    *field_mut(&mut value, "sequence") = Value::Union(1, Box::new(Value::Long(7)));
    *field_mut(&mut value, "source") = Value::Enum(7, "bmc".into());
    *field_mut(&mut value, "kind") = Value::Enum(18, "fabric_manager".into());
    let detail = field_mut(&mut value, "detail");
    let Value::Record(detail_fields) = detail else { panic!() };
    for (_, field) in detail_fields.iter_mut() {
        *field = Value::Union(0, Box::new(Value::Null));
    }
    *field_mut(detail, "fabric_manager") =
        Value::Union(1, Box::new(Value::Record(vec![("state".into(), Value::String("degraded".into()))])));
    GenericDatumWriter::builder(v2).build().unwrap().write_value_to_vec(value).expect("valid v2 datum")
}

#[test]
fn a_v1_reader_reads_what_a_v2_writer_wrote() {
    let v2 = one(HEALTH_EVENT_V2);
    let event = common::health_event(common::all_details().remove(0));
    let body = written_by_v2(&event, &v2);

    let read: HealthEvent = codec::decode_body_with_writer_schema(&v2, &body).unwrap();
    // New symbols fall back to the enum defaults; the new kind's detail is invisible to v1.
    assert_eq!(read.source, Source::Unknown);
    assert_eq!(read.kind, Kind::Unknown);
    assert_eq!(read.detail, Detail::Absent);
    let expected = HealthEvent { source: Source::Unknown, kind: Kind::Unknown, detail: Detail::Absent, ..event };
    assert_eq!(read, expected);
}

#[test]
fn a_v2_reader_reads_what_a_v1_writer_wrote() {
    let v2 = one(HEALTH_EVENT_V2);
    let event = common::health_event(common::all_details().remove(3));
    let payload = codec::encode(&event).unwrap();
    let value = GenericDatumReader::builder(avro::health_event())
        .reader_schema(&v2)
        .build()
        .unwrap()
        .read_value(&mut &payload[5..])
        .unwrap();
    assert!(value.validate(&v2));
    let mut value = value;
    assert_eq!(
        field_mut(&mut value, "sequence"),
        &Value::Union(0, Box::new(Value::Null)),
        "new field takes its default"
    );
    assert_eq!(field_mut(&mut value, "kind"), &Value::Enum(4, "ecc".into()));
    assert_eq!(field_mut(&mut value, "node"), &Value::String(event.node.clone()));
    let detail = field_mut(&mut value, "detail");
    assert_eq!(field_mut(detail, "fabric_manager"), &Value::Union(0, Box::new(Value::Null)));
    assert!(matches!(field_mut(detail, "ecc"), Value::Union(1, _)));
}
