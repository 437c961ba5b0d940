//! The Kafka codec: Confluent wire framing around a single Avro datum.
//!
//! ```text
//! byte 0      magic byte, always 0
//! bytes 1..5  schema id, unsigned 32-bit big-endian
//! bytes 5..   the record, Avro binary encoding of one datum (no container header)
//! ```
//!
//! Schema ids resolve from an embedded table built from `schemas/avro/` ([`SCHEMA_TABLE`]); the ids
//! are fixed forever, so data written without a registry stays readable. Every version of a record
//! has its own id: version 1 of the four records is 1 to 4 (the files under
//! `schemas/avro/released/v1/`), version 2 is 5 to 8 (`released/v2/`), version 3 is 9 and 10
//! (`HealthEvent` and `EnrichedHealthEvent`, the current files; `Verdict` and `ActionOutcome` did
//! not change in it and keep 7 and 8). Encoding writes the current version's id. A record written with an older or newer version of its schema is read
//! through Avro schema resolution into this build's types; a record written with this build's
//! schema takes a fast path that reads and writes the Avro binary straight from the Rust types
//! (the private `binary` module).

use apache_avro::Schema;
use apache_avro::reader::datum::GenericDatumReader;
use serde::Serialize;
use serde::de::DeserializeOwned;

use crate::action::ActionOutcome;
use crate::avro;
use crate::binary;
use crate::enriched::EnrichedHealthEvent;
use crate::health::HealthEvent;
use crate::topics;
use crate::verdict::Verdict;

/// The first byte of every framed record.
pub const MAGIC_BYTE: u8 = 0;
/// Length of the framing before the Avro body.
pub const HEADER_LEN: usize = 5;

/// Embedded schema id of `HealthEvent` v1.
pub const HEALTH_EVENT_V1: u32 = 1;
/// Embedded schema id of `EnrichedHealthEvent` v1.
pub const ENRICHED_HEALTH_EVENT_V1: u32 = 2;
/// Embedded schema id of `Verdict` v1.
pub const VERDICT_V1: u32 = 3;
/// Embedded schema id of `ActionOutcome` v1.
pub const ACTION_OUTCOME_V1: u32 = 4;
/// Embedded schema id of `HealthEvent` v2 (`boot_id`, the `gpu_inventory` kind).
pub const HEALTH_EVENT_V2: u32 = 5;
/// Embedded schema id of `EnrichedHealthEvent` v2 (the resolved `gpu`, `gpu_unresolved`, the
/// node's `expected_gpus`, and the `HealthEvent` v2 inside).
pub const ENRICHED_HEALTH_EVENT_V2: u32 = 6;
/// Embedded schema id of `Verdict` v2 (`run_diagnostics`, `not_before`, `deferrable`,
/// `workload`).
pub const VERDICT_V2: u32 = 7;
/// Embedded schema id of `ActionOutcome` v2: its own file is unchanged, but the
/// `RecommendedAction` it shares with the verdict gained `run_diagnostics`.
pub const ACTION_OUTCOME_V2: u32 = 8;

/// Embedded schema id of `HealthEvent` v3 (`workloads`: the containers using the event's GPU,
/// from the kubelet).
pub const HEALTH_EVENT_V3: u32 = 9;
/// Embedded schema id of `EnrichedHealthEvent` v3: its own file is unchanged, but the
/// `HealthEvent` inside it gained `workloads`.
pub const ENRICHED_HEALTH_EVENT_V3: u32 = 10;

/// The release this build writes (its schema files under `schemas/avro/`). A record whose
/// self-contained schema did not change in a release keeps its earlier version and id: this build
/// writes `HealthEvent` and `EnrichedHealthEvent` v3, `Verdict` and `ActionOutcome` v2.
pub const CURRENT_VERSION: u32 = 3;

/// One entry of the embedded schema table.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SchemaTableEntry {
    /// The schema id on the wire.
    pub id: u32,
    /// Full Avro name of the record.
    pub record: &'static str,
    /// Version of the record's schema (1 for the first release).
    pub version: u32,
}

/// The embedded schema table, in id order. Ids are never reused or renumbered: a new version of a
/// record gets the next free id and the old entry stays, so its data stays readable. A schema
/// registry started fresh for gpumedic numbers the schemas in this order too
/// ([`Codec::with_registry`](crate::Codec)), so its ids are these.
pub const SCHEMA_TABLE: [SchemaTableEntry; 10] = [
    SchemaTableEntry { id: HEALTH_EVENT_V1, record: HealthEvent::NAME, version: 1 },
    SchemaTableEntry { id: ENRICHED_HEALTH_EVENT_V1, record: EnrichedHealthEvent::NAME, version: 1 },
    SchemaTableEntry { id: VERDICT_V1, record: Verdict::NAME, version: 1 },
    SchemaTableEntry { id: ACTION_OUTCOME_V1, record: ActionOutcome::NAME, version: 1 },
    SchemaTableEntry { id: HEALTH_EVENT_V2, record: HealthEvent::NAME, version: 2 },
    SchemaTableEntry { id: ENRICHED_HEALTH_EVENT_V2, record: EnrichedHealthEvent::NAME, version: 2 },
    SchemaTableEntry { id: VERDICT_V2, record: Verdict::NAME, version: 2 },
    SchemaTableEntry { id: ACTION_OUTCOME_V2, record: ActionOutcome::NAME, version: 2 },
    SchemaTableEntry { id: HEALTH_EVENT_V3, record: HealthEvent::NAME, version: 3 },
    SchemaTableEntry { id: ENRICHED_HEALTH_EVENT_V3, record: EnrichedHealthEvent::NAME, version: 3 },
];

/// A record type the codec can frame: one of the four event records.
pub trait Record: Serialize + DeserializeOwned {
    /// Full Avro name of the record.
    const NAME: &'static str;
    /// The embedded id of the schema this build writes and reads into.
    const SCHEMA_ID: u32;
    /// The `content-type` header value for the record (see docs/events.md).
    const CONTENT_TYPE: &'static str;
    /// The topic that carries the record; with a schema registry, the record's schema is
    /// registered under the subject `<topic>-value` (TopicNameStrategy).
    const TOPIC: &'static str;
}

impl Record for HealthEvent {
    const NAME: &'static str = "io.gpumedic.events.HealthEvent";
    const SCHEMA_ID: u32 = HEALTH_EVENT_V3;
    const CONTENT_TYPE: &'static str = "application/vnd.gpumedic.health-event.v1+avro";
    const TOPIC: &'static str = topics::HEALTH_RAW;
}

impl Record for EnrichedHealthEvent {
    const NAME: &'static str = "io.gpumedic.events.EnrichedHealthEvent";
    const SCHEMA_ID: u32 = ENRICHED_HEALTH_EVENT_V3;
    const CONTENT_TYPE: &'static str = "application/vnd.gpumedic.enriched-health-event.v1+avro";
    const TOPIC: &'static str = topics::HEALTH_ENRICHED;
}

impl Record for Verdict {
    const NAME: &'static str = "io.gpumedic.events.Verdict";
    const SCHEMA_ID: u32 = VERDICT_V2;
    const CONTENT_TYPE: &'static str = "application/vnd.gpumedic.verdict.v1+avro";
    const TOPIC: &'static str = topics::VERDICTS;
}

impl Record for ActionOutcome {
    const NAME: &'static str = "io.gpumedic.events.ActionOutcome";
    const SCHEMA_ID: u32 = ACTION_OUTCOME_V2;
    const CONTENT_TYPE: &'static str = "application/vnd.gpumedic.action-outcome.v1+avro";
    const TOPIC: &'static str = topics::ACTIONS;
}

/// The schema registered under an embedded id, if any: for ids 1 to 4 the version 1 schema the
/// record was written with (`schemas/avro/released/v1/`), for 5 and 6 the version 2 one
/// (`released/v2/`), for 7 to 10 the current one.
pub fn schema_for_id(id: u32) -> Option<&'static Schema> {
    match id {
        HEALTH_EVENT_V1 => avro::v1().first(),
        ENRICHED_HEALTH_EVENT_V1 => avro::v1().get(1),
        VERDICT_V1 => avro::v1().get(2),
        ACTION_OUTCOME_V1 => avro::v1().get(3),
        HEALTH_EVENT_V2 => avro::v2().first(),
        ENRICHED_HEALTH_EVENT_V2 => avro::v2().get(1),
        VERDICT_V2 => Some(avro::verdict()),
        ACTION_OUTCOME_V2 => Some(avro::action_outcome()),
        HEALTH_EVENT_V3 => Some(avro::health_event()),
        ENRICHED_HEALTH_EVENT_V3 => Some(avro::enriched_health_event()),
        _ => None,
    }
}

fn table_entry(id: u32) -> Option<&'static SchemaTableEntry> {
    SCHEMA_TABLE.iter().find(|entry| entry.id == id)
}

/// Why a record could not be encoded.
#[derive(Debug, thiserror::Error)]
pub enum EncodeError {
    /// The record's schema id has no entry in the table (a defect of this crate).
    #[error("no embedded schema with id {0}")]
    UnknownSchemaId(u32),
    /// The value does not fit the schema (a defect of this crate: the round-trip tests cover every
    /// record).
    #[error("record does not fit its schema: {0}")]
    Schema(#[source] Box<apache_avro::Error>),
}

/// Why bytes could not be decoded into a record. Every variant is a reason to send the Kafka
/// record to the dead-letter topic; [`DecodeError::reason`] is the short header value.
#[derive(Debug, thiserror::Error)]
pub enum DecodeError {
    /// Fewer bytes than the 5-byte header (0 for an empty payload).
    #[error("payload too short for the wire header: {len} bytes, need at least {HEADER_LEN}")]
    TooShort {
        /// Length of the payload.
        len: usize,
    },
    /// The first byte is not the magic byte 0.
    #[error("wrong magic byte {0:#04x}, expected 0x00")]
    WrongMagicByte(u8),
    /// The schema id is in neither the embedded table nor the given schema.
    #[error("unknown schema id {0}")]
    UnknownSchemaId(u32),
    /// The schema id belongs to another record type.
    #[error("wrong record type: expected {expected}, found {found} (schema id {id})")]
    WrongRecordType {
        /// The record the caller asked for.
        expected: &'static str,
        /// The record the schema id names.
        found: String,
        /// The schema id on the wire.
        id: u32,
    },
    /// The Avro body does not decode with the writer schema, or does not resolve to the reader's.
    #[error("malformed Avro body: {0}")]
    Malformed(#[source] Box<apache_avro::Error>),
    /// Bytes were left over after the record.
    #[error("{0} trailing bytes after the record")]
    TrailingBytes(usize),
}

impl DecodeError {
    /// A short, stable, low-cardinality reason (for the `gpumedic.dlq.reason` header and metric
    /// labels).
    pub fn reason(&self) -> &'static str {
        match self {
            DecodeError::TooShort { .. } => "too_short",
            DecodeError::WrongMagicByte(_) => "wrong_magic_byte",
            DecodeError::UnknownSchemaId(_) => "unknown_schema_id",
            DecodeError::WrongRecordType { .. } => "wrong_record_type",
            DecodeError::Malformed(_) => "malformed",
            DecodeError::TrailingBytes(_) => "trailing_bytes",
        }
    }
}

/// Encodes `record` with its current schema and the wire framing.
///
/// # Errors
/// [`EncodeError`] only on a defect of this crate (the types and schemas are tested to agree).
pub fn encode<T: Record>(record: &T) -> Result<Vec<u8>, EncodeError> {
    let mut buffer = Vec::with_capacity(256);
    encode_into(record, &mut buffer)?;
    Ok(buffer)
}

/// Appends the framed encoding of `record` to `buffer`, so a producer can reuse one buffer.
///
/// # Errors
/// As [`encode`]; on error `buffer` may hold a partial record after its previous length.
pub fn encode_into<T: Record>(record: &T, buffer: &mut Vec<u8>) -> Result<(), EncodeError> {
    table_entry(T::SCHEMA_ID).ok_or(EncodeError::UnknownSchemaId(T::SCHEMA_ID))?;
    encode_into_with_id(record, T::SCHEMA_ID, buffer)
}

/// Appends `record` framed with schema id `id`, which must name this build's schema of `T` (the
/// embedded id, or the id a schema registry gave that schema).
pub(crate) fn encode_into_with_id<T: Record>(record: &T, id: u32, buffer: &mut Vec<u8>) -> Result<(), EncodeError> {
    buffer.push(MAGIC_BYTE);
    buffer.extend_from_slice(&id.to_be_bytes());
    // Written from the type, not through apache-avro's schema walk: the type mirrors its schema
    // (see `binary`), and the schema walk cost half the throughput goal.
    binary::write(record, buffer).map_err(|e| EncodeError::Schema(Box::new(e)))
}

/// Splits a framed payload into its schema id and Avro body.
///
/// # Errors
/// [`DecodeError::TooShort`] and [`DecodeError::WrongMagicByte`].
pub fn split_frame(payload: &[u8]) -> Result<(u32, &[u8]), DecodeError> {
    let Some((header, body)) = payload.split_first_chunk::<HEADER_LEN>() else {
        return Err(DecodeError::TooShort { len: payload.len() });
    };
    if header[0] != MAGIC_BYTE {
        return Err(DecodeError::WrongMagicByte(header[0]));
    }
    Ok((u32::from_be_bytes([header[1], header[2], header[3], header[4]]), body))
}

/// Decodes a framed payload into `T`, resolving the writer schema from the embedded table.
///
/// # Errors
/// [`DecodeError`]; never panics, whatever the bytes.
pub fn decode<T: Record>(payload: &[u8]) -> Result<T, DecodeError> {
    let (id, body) = split_frame(payload)?;
    let entry = table_entry(id).ok_or(DecodeError::UnknownSchemaId(id))?;
    if entry.record != T::NAME {
        return Err(DecodeError::WrongRecordType { expected: T::NAME, found: entry.record.to_owned(), id });
    }
    if id == T::SCHEMA_ID {
        return decode_body_fast(body);
    }
    let writer = schema_for_id(id).ok_or(DecodeError::UnknownSchemaId(id))?;
    decode_body_with_writer_schema(writer, body)
}

/// Decodes an unframed Avro body written with this build's schema of `T`.
pub(crate) fn decode_body_fast<T: Record>(body: &[u8]) -> Result<T, DecodeError> {
    // Same schema on both sides: read straight into T from the type (see `binary`), no schema
    // walk and no intermediate Value.
    let mut rest = body;
    let record = binary::read::<T>(&mut rest).map_err(|e| DecodeError::Malformed(Box::new(e)))?;
    finish(record, rest)
}

/// Decodes an unframed Avro body written with `writer_schema` into `T`, through Avro schema
/// resolution to this build's schema of `T`. For writer schemas that come from elsewhere than the
/// embedded table: a schema registry, or evolved fixtures in tests.
///
/// # Errors
/// [`DecodeError::WrongRecordType`] when `writer_schema` names another record,
/// [`DecodeError::Malformed`] and [`DecodeError::TrailingBytes`].
pub fn decode_body_with_writer_schema<T: Record>(writer_schema: &Schema, body: &[u8]) -> Result<T, DecodeError> {
    if let Schema::Record(record) = writer_schema {
        let found = record.name.fullname(None);
        if found != T::NAME {
            return Err(DecodeError::WrongRecordType { expected: T::NAME, found, id: 0 });
        }
    }
    let reader_schema = schema_for_id(T::SCHEMA_ID).ok_or(DecodeError::UnknownSchemaId(T::SCHEMA_ID))?;
    let malformed = |e| DecodeError::Malformed(Box::new(e));
    // Built per call: this path runs only for records written with another schema version, and
    // the resolved reader borrows the caller's writer schema.
    let reader = GenericDatumReader::builder(writer_schema)
        .reader_schema(reader_schema)
        .human_readable(false)
        .build()
        .map_err(malformed)?;
    let mut rest = body;
    let value = reader.read_value(&mut rest).map_err(malformed)?;
    let record = apache_avro::from_value::<T>(&value).map_err(malformed)?;
    finish(record, rest)
}

fn finish<T>(record: T, rest: &[u8]) -> Result<T, DecodeError> {
    if rest.is_empty() { Ok(record) } else { Err(DecodeError::TrailingBytes(rest.len())) }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_table_numbers_every_version_of_every_record_once_from_one() {
        let ids: Vec<u32> = SCHEMA_TABLE.iter().map(|entry| entry.id).collect();
        assert_eq!(ids, (1..=10).collect::<Vec<u32>>());
        for entry in &SCHEMA_TABLE {
            let Some(Schema::Record(record)) = schema_for_id(entry.id) else {
                panic!("id {} has no record schema", entry.id);
            };
            assert_eq!(record.name.fullname(None), entry.record, "id {}", entry.id);
        }
        assert_eq!(schema_for_id(0), None);
        assert_eq!(schema_for_id(11), None);
    }

    #[test]
    fn every_record_writes_its_current_version() {
        for (id, name) in [
            (HealthEvent::SCHEMA_ID, HealthEvent::NAME),
            (EnrichedHealthEvent::SCHEMA_ID, EnrichedHealthEvent::NAME),
            (Verdict::SCHEMA_ID, Verdict::NAME),
            (ActionOutcome::SCHEMA_ID, ActionOutcome::NAME),
        ] {
            let entry = table_entry(id).expect("in the table");
            assert_eq!(entry.record, name);
            let latest = SCHEMA_TABLE.iter().filter(|e| e.record == name).map(|e| e.version).max();
            assert_eq!(Some(entry.version), latest, "{name} writes its latest version");
            assert!(entry.version <= CURRENT_VERSION);
        }
        assert_eq!(table_entry(HealthEvent::SCHEMA_ID).map(|e| e.version), Some(CURRENT_VERSION));
        // Each record's v1 id still names it, with the v1 schema.
        for (position, id) in
            [HEALTH_EVENT_V1, ENRICHED_HEALTH_EVENT_V1, VERDICT_V1, ACTION_OUTCOME_V1].into_iter().enumerate()
        {
            assert_eq!(table_entry(id).map(|entry| entry.version), Some(1));
            assert_eq!(schema_for_id(id), avro::v1().get(position));
        }
        // And the v2 ids the v2 schemas.
        for (position, id) in
            [HEALTH_EVENT_V2, ENRICHED_HEALTH_EVENT_V2, VERDICT_V2, ACTION_OUTCOME_V2].into_iter().enumerate()
        {
            assert_eq!(table_entry(id).map(|entry| entry.version), Some(2));
            assert_eq!(
                schema_for_id(id).map(Schema::canonical_form),
                avro::v2().get(position).map(Schema::canonical_form)
            );
        }
    }
}
