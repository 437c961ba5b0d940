//! [`Codec`]: the codec the services share (`Arc<Codec>`), resolving schema ids either from the
//! embedded table ([`Codec::embedded`]) or from a schema registry ([`Codec::with_registry`],
//! cargo feature `registry`).
//!
//! With a registry, the schema id space is the registry's: every id on the wire, 1 to 8 included,
//! is resolved through the registry, never through the embedded table, because a registry hands
//! out the same small numbers to whatever schema it saw first. How data written without a
//! registry stays readable is in docs/events.md ("Schema registry"); [`Codec::embedded_ids_readable`]
//! tells whether it is with the registry at hand.
//!
//! Decoding stays as fast as the embedded codec for every record written with this build's
//! schemas: a writer schema is compared with this build's schema (Parsing Canonical Form) once,
//! when its id is first seen, and an id that names this build's schema of the record takes the
//! straight binary path. Other writer schemas go through Avro schema resolution.

#[cfg(feature = "registry")]
use std::collections::HashMap;
#[cfg(feature = "registry")]
use std::sync::{Arc, Mutex, RwLock};
#[cfg(feature = "registry")]
use std::time::Duration;

use apache_avro::Schema;
use apache_avro::reader::datum::GenericDatumReader;
use apache_avro::types::Value;

use crate::codec::{self, DecodeError, EncodeError, Record};
#[cfg(feature = "registry")]
use crate::registry::{RegistryClient, RegistryError};
#[cfg(feature = "registry")]
use crate::{ActionOutcome, EnrichedHealthEvent, HealthEvent, Verdict, avro};

/// Why a framed record could not be decoded by a [`Codec`].
#[derive(Debug, thiserror::Error)]
pub enum DecodeFailure {
    /// The record itself is bad: send it to the dead-letter topic. With a registry, this includes
    /// a schema id the registry answers it does not know ([`DecodeError::UnknownSchemaId`]) and a
    /// registered schema that is not Avro or not a valid one ([`DecodeError::Malformed`]).
    #[error(transparent)]
    Invalid(#[from] DecodeError),
    /// The registry could not be asked for the record's writer schema. Transient: the record is
    /// probably fine, so the consumer must retry it later and never dead-letter it.
    #[cfg(feature = "registry")]
    #[error("cannot resolve schema id {id}: {source}")]
    RegistryUnavailable {
        /// The schema id on the wire.
        id: u32,
        /// What the registry client reported.
        #[source]
        source: RegistryError,
    },
}

impl DecodeFailure {
    /// A short, stable, low-cardinality reason, as [`DecodeError::reason`], plus
    /// `registry_unavailable`.
    pub fn reason(&self) -> &'static str {
        match self {
            DecodeFailure::Invalid(e) => e.reason(),
            #[cfg(feature = "registry")]
            DecodeFailure::RegistryUnavailable { .. } => "registry_unavailable",
        }
    }

    /// True when the record must be retried, not dead-lettered.
    pub fn is_transient(&self) -> bool {
        match self {
            DecodeFailure::Invalid(_) => false,
            #[cfg(feature = "registry")]
            DecodeFailure::RegistryUnavailable { .. } => true,
        }
    }
}

/// Settings of [`Codec::with_registry`].
#[cfg(feature = "registry")]
#[derive(Debug, Clone)]
pub struct RegistryOptions {
    /// Bound on each registry request, connecting included.
    pub request_timeout: Duration,
    /// Put before every subject name: `<prefix><topic>-value`. Empty in production
    /// (TopicNameStrategy); tests use it so that parallel tests register under their own
    /// subjects.
    pub subject_prefix: String,
}

#[cfg(feature = "registry")]
impl Default for RegistryOptions {
    fn default() -> Self {
        Self { request_timeout: Duration::from_secs(5), subject_prefix: String::new() }
    }
}

/// Why [`Codec::with_registry`] could not start.
#[cfg(feature = "registry")]
#[derive(Debug, thiserror::Error)]
pub enum RegistryStartError {
    /// A schema could not be registered (registry unreachable, or it refused the schema, for
    /// example under a compatibility setting that this version breaks).
    #[error("cannot register schema {record} under subject {subject}: {source}")]
    Register {
        /// Full Avro name of the record.
        record: &'static str,
        /// The subject.
        subject: String,
        /// What the registry client reported.
        #[source]
        source: RegistryError,
    },
    /// The registry was unreachable while the embedded ids were checked.
    #[error("cannot check schema id {id} in the registry: {source}")]
    Check {
        /// The schema id.
        id: u32,
        /// What the registry client reported.
        #[source]
        source: RegistryError,
    },
}

/// A writer schema resolved from the registry.
#[cfg(feature = "registry")]
#[derive(Debug)]
struct WriterSchema {
    schema: Schema,
    /// Full name of the record the schema describes (empty for a schema that is not a record).
    name: String,
    /// True when the schema is exactly this build's schema of that record: the fast path applies.
    ours: bool,
}

/// The registry side of a [`Codec`].
#[cfg(feature = "registry")]
#[derive(Debug)]
struct Registry {
    client: RegistryClient,
    /// The registry ids of the embedded table's schemas (every version), indexed by embedded
    /// id - 1.
    writer_ids: [u32; codec::SCHEMA_TABLE.len()],
    /// Every id resolved so far. Ids are immutable in a schema registry, so entries never expire.
    known: RwLock<HashMap<u32, Arc<WriterSchema>>>,
    /// One cell per id being fetched, so that concurrent decodes of a new id fetch it once.
    fetching: Mutex<HashMap<u32, Arc<tokio::sync::OnceCell<Arc<WriterSchema>>>>>,
    embedded_ids_readable: bool,
}

/// The codec the services share: encodes with this build's schemas and decodes whatever schema
/// version a record was written with. `Send + Sync`; share it as `Arc<Codec>`.
#[derive(Debug)]
pub struct Codec {
    #[cfg(feature = "registry")]
    registry: Option<Registry>,
}

impl Codec {
    /// A codec without a registry: the embedded ids (it writes 5 to 8, the current version, and
    /// reads 1 to 8), exactly as [`codec::encode`] and [`codec::decode`].
    pub fn embedded() -> Self {
        Self {
            #[cfg(feature = "registry")]
            registry: None,
        }
    }

    /// Encodes `record` with the wire framing and the id of this build's schema: the registry's id
    /// with a registry, the embedded id without.
    ///
    /// # Errors
    /// [`EncodeError`] only on a defect of this crate.
    pub fn encode<T: Record>(&self, record: &T) -> Result<Vec<u8>, EncodeError> {
        let mut buffer = Vec::with_capacity(256);
        self.encode_into(record, &mut buffer)?;
        Ok(buffer)
    }

    /// As [`Codec::encode`], appending to `buffer`.
    ///
    /// # Errors
    /// As [`Codec::encode`].
    pub fn encode_into<T: Record>(&self, record: &T, buffer: &mut Vec<u8>) -> Result<(), EncodeError> {
        codec::encode_into_with_id(record, self.writer_id::<T>(), buffer)
    }

    /// The schema id this codec writes for `T`.
    pub fn writer_id<T: Record>(&self) -> u32 {
        #[cfg(feature = "registry")]
        if let Some(registry) = &self.registry {
            return registry.writer_ids[(T::SCHEMA_ID - 1) as usize];
        }
        T::SCHEMA_ID
    }

    /// Decodes a framed record into `T`, whatever version of its schema wrote it. An id seen
    /// before decodes without I/O; a new one is fetched from the registry once.
    ///
    /// # Errors
    /// [`DecodeFailure::Invalid`] for a bad record (dead-letter it),
    /// [`DecodeFailure::RegistryUnavailable`] when the registry cannot be asked (retry).
    pub async fn decode<T: Record>(&self, payload: &[u8]) -> Result<T, DecodeFailure> {
        #[cfg(feature = "registry")]
        if let Some(registry) = &self.registry {
            let (id, body) = codec::split_frame(payload)?;
            let writer = registry.resolve(id).await?;
            if writer.name != T::NAME {
                return Err(DecodeError::WrongRecordType { expected: T::NAME, found: writer.name.clone(), id }.into());
            }
            if writer.ours {
                return Ok(codec::decode_body_fast(body)?);
            }
            return codec::decode_body_with_writer_schema(&writer.schema, body).map_err(|e| with_id(e, id).into());
        }
        Ok(codec::decode(payload)?)
    }

    /// Decodes a framed record into a generic Avro value of `reader_schema`, through schema
    /// resolution from the record's writer schema: how a consumer built with another version of a
    /// schema (older or newer than this build's) reads the stream.
    ///
    /// # Errors
    /// As [`Codec::decode`]; [`DecodeError::Malformed`] also when the writer schema does not
    /// resolve to `reader_schema`.
    pub async fn decode_value(&self, payload: &[u8], reader_schema: &Schema) -> Result<Value, DecodeFailure> {
        let (id, body) = codec::split_frame(payload)?;
        #[cfg(feature = "registry")]
        if let Some(registry) = &self.registry {
            let writer = registry.resolve(id).await?;
            return Ok(read_value(&writer.schema, reader_schema, body)?);
        }
        let writer = codec::schema_for_id(id).ok_or(DecodeError::UnknownSchemaId(id))?;
        Ok(read_value(writer, reader_schema, body)?)
    }

    /// True without a registry. With one: true when the registry's ids 1 to 8 are exactly the
    /// embedded table's schemas (checked at start), so records written without a registry, by
    /// this version or an earlier one, decode correctly through it.
    pub fn embedded_ids_readable(&self) -> bool {
        #[cfg(feature = "registry")]
        if let Some(registry) = &self.registry {
            return registry.embedded_ids_readable;
        }
        true
    }

    /// How many requests this codec has sent to its registry (0 without one).
    pub fn registry_requests(&self) -> u64 {
        #[cfg(feature = "registry")]
        if let Some(registry) = &self.registry {
            return registry.client.requests_sent();
        }
        0
    }
}

#[cfg(feature = "registry")]
impl Codec {
    /// A codec backed by the schema registry at `url` (Confluent REST API; for Apicurio, the
    /// `/apis/ccompat/v7` URL). Registers every schema of the embedded table under its record's
    /// subject `<topic>-value`, in table order (version 1 of the four records, then version 2):
    /// a new version of a record is a new version of the same subject, and a fresh registry gives
    /// the schemas the embedded ids. Remembers their ids, writes the current version's, then
    /// checks what the registry's ids 1 to 8 are ([`Codec::embedded_ids_readable`]).
    ///
    /// # Errors
    /// [`RegistryStartError`] when the registry is unreachable or refuses a schema: a service
    /// should not start without the ids it must write.
    pub async fn with_registry(url: &str, options: RegistryOptions) -> Result<Self, RegistryStartError> {
        let client = RegistryClient::new(url, options.request_timeout).map_err(|source| {
            RegistryStartError::Register { record: HealthEvent::NAME, subject: String::new(), source }
        })?;
        let texts = [
            avro::self_contained_json(&avro::V1_AVSC).expect("the embedded released .avsc files parse (tested)"),
            avro::self_contained_json(&avro::CURRENT_AVSC).expect("the embedded .avsc files parse (tested)"),
        ];
        let records = [
            (HealthEvent::NAME, HealthEvent::TOPIC),
            (EnrichedHealthEvent::NAME, EnrichedHealthEvent::TOPIC),
            (Verdict::NAME, Verdict::TOPIC),
            (ActionOutcome::NAME, ActionOutcome::TOPIC),
        ];
        let mut writer_ids = [0; codec::SCHEMA_TABLE.len()];
        let mut known = HashMap::new();
        // In table order, so that a fresh registry gives the schemas the embedded ids 1 to 8 and
        // records written without a registry stay readable through it (see docs/events.md). The
        // older versions are registered too, although this build never writes them: registering
        // a schema the subject already has only returns its id.
        for (slot, entry) in codec::SCHEMA_TABLE.iter().enumerate() {
            let position = records
                .iter()
                .position(|(name, _)| *name == entry.record)
                .expect("every table entry names one of the four records (tested)");
            let (record, topic) = records[position];
            let text = &texts[if entry.version == codec::CURRENT_VERSION { 1 } else { 0 }][position];
            let subject = format!("{}{topic}-value", options.subject_prefix);
            let id = client.register(&subject, text).await.map_err(|source| RegistryStartError::Register {
                record,
                subject,
                source,
            })?;
            writer_ids[slot] = id;
            let schema = codec::schema_for_id(entry.id).expect("every table entry has a schema (tested)").clone();
            let ours = entry.version == codec::CURRENT_VERSION;
            known.insert(id, Arc::new(WriterSchema { schema, name: record.to_owned(), ours }));
        }
        let registry = Registry {
            client,
            writer_ids,
            known: RwLock::new(known),
            fetching: Mutex::new(HashMap::new()),
            embedded_ids_readable: false,
        };
        let mut readable = true;
        for entry in &codec::SCHEMA_TABLE {
            match registry.resolve(entry.id).await {
                Ok(writer) => readable &= codec::schema_for_id(entry.id) == Some(&writer.schema),
                Err(DecodeFailure::RegistryUnavailable { id, source }) => {
                    return Err(RegistryStartError::Check { id, source });
                }
                Err(DecodeFailure::Invalid(_)) => readable = false,
            }
        }
        Ok(Self { registry: Some(Registry { embedded_ids_readable: readable, ..registry }) })
    }
}

#[cfg(feature = "registry")]
impl Registry {
    async fn resolve(&self, id: u32) -> Result<Arc<WriterSchema>, DecodeFailure> {
        if let Some(writer) = self.known.read().unwrap_or_else(|e| e.into_inner()).get(&id) {
            return Ok(writer.clone());
        }
        let cell = self.fetching.lock().unwrap_or_else(|e| e.into_inner()).entry(id).or_default().clone();
        let writer = cell.get_or_try_init(|| self.fetch(id)).await?.clone();
        self.known.write().unwrap_or_else(|e| e.into_inner()).insert(id, writer.clone());
        self.fetching.lock().unwrap_or_else(|e| e.into_inner()).remove(&id);
        Ok(writer)
    }

    async fn fetch(&self, id: u32) -> Result<Arc<WriterSchema>, DecodeFailure> {
        let registered = match self.client.schema_by_id(id).await {
            Ok(registered) => registered,
            // The registry does not know the id: the record is bad, not the registry.
            Err(RegistryError::NotFound { .. }) => return Err(DecodeError::UnknownSchemaId(id).into()),
            Err(source) => return Err(DecodeFailure::RegistryUnavailable { id, source }),
        };
        if !registered.schema_type.eq_ignore_ascii_case("AVRO") {
            return Err(malformed(format!("schema id {id} is a {} schema, not Avro", registered.schema_type)).into());
        }
        let schema = Schema::parse_str(&registered.schema).map_err(|e| DecodeError::Malformed(Box::new(e)))?;
        let name = match &schema {
            Schema::Record(record) => record.name.fullname(None),
            _ => String::new(),
        };
        let ours = match name.as_str() {
            HealthEvent::NAME => same(&schema, 0),
            EnrichedHealthEvent::NAME => same(&schema, 1),
            Verdict::NAME => same(&schema, 2),
            ActionOutcome::NAME => same(&schema, 3),
            _ => false,
        };
        Ok(Arc::new(WriterSchema { schema, name, ours }))
    }
}

/// This build's schema at table index `index`.
#[cfg(feature = "registry")]
fn ours(index: usize) -> &'static Schema {
    [avro::health_event(), avro::enriched_health_event(), avro::verdict(), avro::action_outcome()][index]
}

/// Same Parsing Canonical Form: the same bytes on the wire for every value, so the fast path reads
/// them. Computed once per id, when it is first resolved.
#[cfg(feature = "registry")]
fn same(schema: &Schema, index: usize) -> bool {
    schema.canonical_form() == ours(index).canonical_form()
}

#[cfg(feature = "registry")]
fn malformed(message: String) -> DecodeError {
    DecodeError::Malformed(Box::new(<apache_avro::Error as serde::de::Error>::custom(message)))
}

/// `decode_body_with_writer_schema` knows no id; put the wire id into its wrong-type error.
#[cfg(feature = "registry")]
fn with_id(error: DecodeError, id: u32) -> DecodeError {
    match error {
        DecodeError::WrongRecordType { expected, found, .. } => DecodeError::WrongRecordType { expected, found, id },
        other => other,
    }
}

fn read_value(writer: &Schema, reader: &Schema, body: &[u8]) -> Result<Value, DecodeError> {
    let malformed = |e| DecodeError::Malformed(Box::new(e));
    let datum_reader =
        GenericDatumReader::builder(writer).reader_schema(reader).human_readable(false).build().map_err(malformed)?;
    let mut rest = body;
    let value = datum_reader.read_value(&mut rest).map_err(malformed)?;
    if rest.is_empty() { Ok(value) } else { Err(DecodeError::TrailingBytes(rest.len())) }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::avro;
    use crate::health::{Component, Detail, Entity, Source};

    fn event() -> crate::HealthEvent {
        crate::HealthEvent::new("node-a", Source::Synthetic, Component::Gpu, Entity::default(), Detail::Absent)
    }

    #[tokio::test]
    async fn the_embedded_codec_matches_the_free_functions() {
        let codec = Codec::embedded();
        let event = event();
        let bytes = codec.encode(&event).unwrap();
        assert_eq!(bytes, codec::encode(&event).unwrap());
        assert_eq!(codec.decode::<crate::HealthEvent>(&bytes).await.unwrap(), event);
        assert_eq!(codec.writer_id::<crate::Verdict>(), codec::VERDICT_V2);
        assert!(codec.embedded_ids_readable());
        assert_eq!(codec.registry_requests(), 0);
        let err = codec.decode::<crate::HealthEvent>(&[0, 0, 0, 0, 99]).await.unwrap_err();
        assert_eq!(err.reason(), "unknown_schema_id");
        assert!(!err.is_transient());
    }

    #[tokio::test]
    async fn the_embedded_codec_reads_into_a_generic_reader_schema() {
        let codec = Codec::embedded();
        let bytes = codec.encode(&event()).unwrap();
        let value = codec.decode_value(&bytes, avro::health_event()).await.unwrap();
        assert!(value.validate(avro::health_event()));
    }
}
