//! The Rust types and the `.avsc` files agree: every record, with every optional field set and
//! every detail variant, round-trips through apache-avro using the schema file itself, both
//! through the streaming serde path and through apache-avro's `Value` model.

mod common;

use std::collections::HashSet;
use std::fmt::Debug;

use apache_avro::Schema;
use apache_avro::reader::datum::GenericDatumReader;
use apache_avro::writer::datum::GenericDatumWriter;
use gpumedic_schemas::health::{Detail, Entity, Kind};
use gpumedic_schemas::{Record, avro, framing};
use serde::Serialize;
use serde::de::DeserializeOwned;

/// Writes `record` with `schema` (validated by the schema-aware serializer), reads it back both
/// ways, and checks the codec agrees.
fn round_trip<T>(schema: &Schema, record: &T)
where
    T: Record + Serialize + DeserializeOwned + PartialEq + Debug,
{
    let body = GenericDatumWriter::builder(schema).build().unwrap().write_ser_to_vec(record).unwrap_or_else(|e| {
        panic!("{} does not serialize with its schema file: {e}", T::NAME);
    });

    let reader = GenericDatumReader::builder(schema).build().unwrap();
    let streamed: T = reader.read_deser(&mut body.as_slice()).unwrap();
    assert_eq!(&streamed, record, "{} streaming round trip", T::NAME);

    // The generic path: the body is valid Avro for the schema as any Avro library reads it.
    let value = reader.read_value(&mut body.as_slice()).unwrap();
    assert!(value.validate(schema), "{} decoded value does not validate", T::NAME);
    let from_value: T = apache_avro::from_value(&value).unwrap();
    assert_eq!(&from_value, record, "{} Value round trip", T::NAME);

    let framed = framing::encode(record).unwrap();
    assert_eq!(framed[0], 0);
    assert_eq!(u32::from_be_bytes(framed[1..5].try_into().unwrap()), T::SCHEMA_ID);
    assert_eq!(&framed[5..], body.as_slice(), "the codec writes the same body");
    assert_eq!(&framing::decode::<T>(&framed).unwrap(), record);

    // Through resolution (writer schema given explicitly, as a registry would): same result.
    assert_eq!(&framing::decode_body_with_writer_schema::<T>(schema, &body).unwrap(), record);
}

#[test]
fn every_detail_variant_round_trips_as_a_health_event() {
    let details = common::all_details();
    let kinds: HashSet<Kind> = details.iter().map(Detail::kind).collect();
    assert_eq!(kinds.len(), 18, "one detail per kind, every kind covered");
    assert!(!kinds.contains(&Kind::Unknown));
    for detail in details {
        round_trip(avro::health_event(), &common::health_event(detail));
    }
}

#[test]
fn an_event_without_detail_and_optionals_round_trips() {
    let mut event = common::health_event(Detail::Absent);
    event.entity = Entity::default();
    event.raw = None;
    event.healthy = true;
    round_trip(avro::health_event(), &event);
}

#[test]
fn enriched_health_event_round_trips() {
    for detail in common::all_details() {
        round_trip(avro::enriched_health_event(), &common::enriched(detail));
    }
    let mut unknown_node = common::enriched(Detail::Absent);
    unknown_node.node_unknown = true;
    unknown_node.node_context = Default::default();
    unknown_node.xid_catalog = None;
    unknown_node.workloads.clear();
    unknown_node.gpu = None;
    unknown_node.gpu_unresolved = true;
    round_trip(avro::enriched_health_event(), &unknown_node);
}

#[test]
fn verdict_round_trips() {
    round_trip(avro::verdict(), &common::verdict());
    let mut minimal = common::verdict();
    minimal.entity = Entity::default();
    minimal.custom_action = None;
    minimal.evidence.clear();
    minimal.not_before = None;
    minimal.deferrable = false;
    minimal.workload = None;
    round_trip(avro::verdict(), &minimal);
}

#[test]
fn action_outcome_round_trips() {
    round_trip(avro::action_outcome(), &common::action_outcome());
}
