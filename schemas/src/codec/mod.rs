//! [`Codec`]: the codec the services share (`Arc<Codec>`), framing records as [`framing`] does
//! and resolving schema ids through a [`SchemaResolver`]: the embedded table
//! ([`Codec::embedded`], [`EmbeddedResolver`]) or a schema registry ([`Codec::with_registry`],
//! [`RegistryResolver`], cargo feature `registry`). Tests plug in a [`FixedResolver`] or a
//! [`FailingResolver`] ([`Codec::with_resolver`]).
//!
//! Decoding stays as fast as the embedded codec for every record written with this build's
//! schemas: a resolver that knows an id answers without I/O or allocation, and an id that names
//! this build's schema of the record takes the straight binary path. Other writer schemas go
//! through Avro schema resolution.

use std::sync::Arc;

use apache_avro::Schema;
use apache_avro::reader::datum::GenericDatumReader;
use apache_avro::types::Value;

use crate::framing::{self, DecodeError, EncodeError, Record};

#[cfg(feature = "registry")]
mod registry;
mod resolver;

#[cfg(feature = "registry")]
pub use registry::{RegistryOptions, RegistryResolver, RegistryStartError};
pub use resolver::{
    EmbeddedResolver, FailingResolver, FixedResolver, Pending, Resolution, SchemaResolver, Unavailable, Writer,
    WriterSchema,
};

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
    #[error("cannot resolve schema id {id}: {source}")]
    RegistryUnavailable {
        /// The schema id on the wire.
        id: u32,
        /// What the resolver reported (with a registry, its client's `RegistryError`).
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },
}

impl DecodeFailure {
    /// A short, stable, low-cardinality reason, as [`DecodeError::reason`], plus
    /// `registry_unavailable`.
    pub fn reason(&self) -> &'static str {
        match self {
            DecodeFailure::Invalid(e) => e.reason(),
            DecodeFailure::RegistryUnavailable { .. } => "registry_unavailable",
        }
    }

    /// True when the record must be retried, not dead-lettered.
    pub fn is_transient(&self) -> bool {
        match self {
            DecodeFailure::Invalid(_) => false,
            DecodeFailure::RegistryUnavailable { .. } => true,
        }
    }
}

/// The codec the services share: encodes with this build's schemas and decodes whatever schema
/// version a record was written with. `Send + Sync`; share it as `Arc<Codec>`.
#[derive(Debug, Clone)]
pub struct Codec {
    resolver: Arc<dyn SchemaResolver>,
}

impl Codec {
    /// A codec without a registry: the embedded ids (it writes 7 to 10, the current versions, and
    /// reads 1 to 10), exactly as [`framing::encode`] and [`framing::decode`].
    pub fn embedded() -> Self {
        Self::with_resolver(EmbeddedResolver)
    }

    /// A codec resolving schema ids through `resolver`.
    pub fn with_resolver(resolver: impl SchemaResolver + 'static) -> Self {
        Self { resolver: Arc::new(resolver) }
    }

    /// A codec backed by the schema registry at `url`: see [`RegistryResolver::start`], which
    /// registers this build's schemas now.
    ///
    /// # Errors
    /// [`RegistryStartError`] when the registry is unreachable or refuses a schema: a service
    /// should not start without the ids it must write.
    #[cfg(feature = "registry")]
    pub async fn with_registry(url: &str, options: RegistryOptions) -> Result<Self, RegistryStartError> {
        Ok(Self::with_resolver(RegistryResolver::start(url, options).await?))
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
        framing::encode_into_with_id(record, self.writer_id::<T>(), buffer)
    }

    /// The schema id this codec writes for `T`.
    pub fn writer_id<T: Record>(&self) -> u32 {
        self.resolver.writer_id(T::SCHEMA_ID)
    }

    /// Decodes a framed record into `T`, whatever version of its schema wrote it. An id seen
    /// before decodes without I/O; a new one is fetched from the registry once.
    ///
    /// # Errors
    /// [`DecodeFailure::Invalid`] for a bad record (dead-letter it),
    /// [`DecodeFailure::RegistryUnavailable`] when the registry cannot be asked (retry).
    pub async fn decode<T: Record>(&self, payload: &[u8]) -> Result<T, DecodeFailure> {
        let (id, body) = framing::split_frame(payload)?;
        match self.resolver.resolve(id).get().await? {
            Writer::Embedded => Ok(framing::decode(payload)?),
            Writer::Schema(writer) => {
                if writer.name != T::NAME {
                    return Err(
                        DecodeError::WrongRecordType { expected: T::NAME, found: writer.name.clone(), id }.into()
                    );
                }
                if writer.ours {
                    return Ok(framing::decode_body_fast(body)?);
                }
                framing::decode_body_with_writer_schema(&writer.schema, body).map_err(|e| with_id(e, id).into())
            }
        }
    }

    /// Decodes a framed record into a generic Avro value of `reader_schema`, through schema
    /// resolution from the record's writer schema: how a consumer built with another version of a
    /// schema (older or newer than this build's) reads the stream.
    ///
    /// # Errors
    /// As [`Codec::decode`]; [`DecodeError::Malformed`] also when the writer schema does not
    /// resolve to `reader_schema`.
    pub async fn decode_value(&self, payload: &[u8], reader_schema: &Schema) -> Result<Value, DecodeFailure> {
        let (id, body) = framing::split_frame(payload)?;
        match self.resolver.resolve(id).get().await? {
            Writer::Embedded => {
                let writer = framing::schema_for_id(id).ok_or(DecodeError::UnknownSchemaId(id))?;
                Ok(read_value(writer, reader_schema, body)?)
            }
            Writer::Schema(writer) => Ok(read_value(&writer.schema, reader_schema, body)?),
        }
    }

    /// True without a registry. With one: true when the registry's ids 1 to 10 are exactly the
    /// embedded table's schemas (checked at start), so records written without a registry, by
    /// this version or an earlier one, decode correctly through it.
    pub fn embedded_ids_readable(&self) -> bool {
        self.resolver.embedded_ids_readable()
    }

    /// How many requests this codec has sent to its registry (0 without one).
    pub fn registry_requests(&self) -> u64 {
        self.resolver.requests_sent()
    }
}

/// `decode_body_with_writer_schema` knows no id; put the wire id into its wrong-type error.
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
        assert_eq!(bytes, framing::encode(&event).unwrap());
        assert_eq!(codec.decode::<crate::HealthEvent>(&bytes).await.unwrap(), event);
        assert_eq!(codec.writer_id::<crate::Verdict>(), framing::VERDICT_V2);
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

    #[tokio::test]
    async fn a_failing_resolver_makes_every_decode_transient_never_invalid() {
        let bytes = Codec::embedded().encode(&event()).unwrap();
        let codec = Codec::with_resolver(FailingResolver::new("the registry is down"));
        let err = codec.decode::<crate::HealthEvent>(&bytes).await.unwrap_err();
        assert!(err.is_transient(), "{err:?}");
        assert_eq!(err.reason(), "registry_unavailable");
        assert!(
            matches!(err, DecodeFailure::RegistryUnavailable { id, .. } if id == framing::HEALTH_EVENT_V3),
            "{err:?}"
        );
        assert!(err.to_string().contains("the registry is down"), "{err}");
        let err = codec.decode_value(&bytes, avro::health_event()).await.unwrap_err();
        assert!(err.is_transient(), "{err:?}");
        assert!(!codec.embedded_ids_readable());
    }

    #[tokio::test]
    async fn a_failing_resolver_still_refuses_a_bad_frame_as_invalid() {
        // The frame is checked before any resolver is asked: a record that is not even framed is
        // dead-lettered, whatever the registry's state.
        let codec = Codec::with_resolver(FailingResolver::new("the registry is down"));
        let err = codec.decode::<crate::HealthEvent>(&[1, 2]).await.unwrap_err();
        assert!(!err.is_transient(), "{err:?}");
        assert!(matches!(err, DecodeFailure::Invalid(_)), "{err:?}");
    }

    #[tokio::test]
    async fn a_fixed_resolver_reads_every_id_with_its_one_schema() {
        let event = event();
        let bytes = Codec::embedded().encode(&event).unwrap();
        let codec = Codec::with_resolver(FixedResolver::new(avro::health_event().clone(), true));
        assert_eq!(codec.decode::<crate::HealthEvent>(&bytes).await.unwrap(), event);
        let verdict = codec.decode::<crate::Verdict>(&bytes).await.unwrap_err();
        assert_eq!(verdict.reason(), "wrong_record_type", "{verdict:?}");
        // Not this build's schema: read through schema resolution, same value.
        let slow = Codec::with_resolver(FixedResolver::new(avro::health_event().clone(), false));
        assert_eq!(slow.decode::<crate::HealthEvent>(&bytes).await.unwrap(), event);
    }
}
