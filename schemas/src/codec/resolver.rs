//! Where a [`Codec`](super::Codec) finds the writer schema behind a schema id, and which id it
//! writes: the [`SchemaResolver`] seam.
//!
//! [`EmbeddedResolver`] is the table built into gpumedic; [`RegistryResolver`](super::RegistryResolver)
//! (feature `registry`) asks a schema registry. [`FixedResolver`] and [`FailingResolver`] are for
//! tests: one writer schema for every id, or a registry that cannot be asked.

use std::fmt::Debug;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;

use apache_avro::Schema;

use super::DecodeFailure;
use crate::framing::DecodeError;

/// A writer schema a resolver found for an id.
#[derive(Debug)]
pub struct WriterSchema {
    /// The schema the record was written with.
    pub schema: Schema,
    /// Full name of the record the schema describes (empty for a schema that is not a record).
    pub name: String,
    /// True when the schema is exactly this build's schema of that record: the fast path applies.
    pub ours: bool,
}

/// The writer of a record, as a resolver names it.
#[derive(Debug, Clone)]
pub enum Writer {
    /// The embedded schema table's: the framing's own decoder reads it.
    Embedded,
    /// A schema the resolver holds.
    Schema(Arc<WriterSchema>),
}

/// A resolution in flight, for a resolver that has to ask someone.
pub type Pending<'a> = Pin<Box<dyn Future<Output = Result<Writer, DecodeFailure>> + Send + 'a>>;

/// What [`SchemaResolver::resolve`] returns: known now (the hot path, no allocation), or a
/// future to await (an id seen for the first time).
pub enum Resolution<'a> {
    /// Resolved without I/O.
    Ready(Result<Writer, DecodeFailure>),
    /// To be fetched.
    Pending(Pending<'a>),
}

impl Resolution<'_> {
    /// The writer, awaiting the fetch when there is one.
    pub async fn get(self) -> Result<Writer, DecodeFailure> {
        match self {
            Resolution::Ready(writer) => writer,
            Resolution::Pending(fetch) => fetch.await,
        }
    }
}

/// Resolves schema ids for a [`Codec`](super::Codec): which id to write for a record, and which
/// writer schema an id on the wire names. `Send + Sync`: one is shared by every decode.
pub trait SchemaResolver: Debug + Send + Sync {
    /// The id written for the record whose current embedded id is `embedded_id`.
    fn writer_id(&self, embedded_id: u32) -> u32 {
        embedded_id
    }

    /// The writer schema of `id`. A bad id is [`DecodeFailure::Invalid`]; a source that cannot be
    /// asked now is [`DecodeFailure::RegistryUnavailable`] (the record is retried).
    fn resolve(&self, id: u32) -> Resolution<'_>;

    /// True when records written with the embedded ids read correctly through this resolver.
    fn embedded_ids_readable(&self) -> bool {
        true
    }

    /// How many requests this resolver has sent to its source (0 for one without I/O).
    fn requests_sent(&self) -> u64 {
        0
    }
}

/// The schema table embedded in gpumedic: it writes ids 7 to 10 (the current versions) and reads
/// 1 to 10, exactly as [`framing::encode`](crate::framing::encode) and
/// [`framing::decode`](crate::framing::decode).
#[derive(Debug, Clone, Copy, Default)]
pub struct EmbeddedResolver;

impl SchemaResolver for EmbeddedResolver {
    fn resolve(&self, _id: u32) -> Resolution<'_> {
        // The framing's decoder looks the id up in the table itself (and refuses an unknown one).
        Resolution::Ready(Ok(Writer::Embedded))
    }
}

/// For tests: every id resolves to one writer schema (as a registry that only ever saw it would
/// answer), and records are written with the embedded ids.
#[derive(Debug, Clone)]
pub struct FixedResolver {
    writer: Arc<WriterSchema>,
}

impl FixedResolver {
    /// Every id resolves to `schema`; `ours` says whether it is this build's schema of its record.
    pub fn new(schema: Schema, ours: bool) -> Self {
        let name = match &schema {
            Schema::Record(record) => record.name.fullname(None),
            _ => String::new(),
        };
        Self { writer: Arc::new(WriterSchema { schema, name, ours }) }
    }
}

impl SchemaResolver for FixedResolver {
    fn resolve(&self, _id: u32) -> Resolution<'_> {
        Resolution::Ready(Ok(Writer::Schema(self.writer.clone())))
    }
}

/// For tests: a registry that cannot be asked. Every id fails as
/// [`DecodeFailure::RegistryUnavailable`] with `reason`, after the await a real fetch has; a
/// consumer must retry such a record, never dead-letter it.
#[derive(Debug, Clone)]
pub struct FailingResolver {
    reason: String,
}

impl FailingResolver {
    /// A resolver failing with `reason`.
    pub fn new(reason: impl Into<String>) -> Self {
        Self { reason: reason.into() }
    }
}

/// Why a [`FailingResolver`] failed.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct Unavailable(String);

impl SchemaResolver for FailingResolver {
    fn resolve(&self, id: u32) -> Resolution<'_> {
        let reason = self.reason.clone();
        Resolution::Pending(Box::pin(async move {
            Err(DecodeFailure::RegistryUnavailable { id, source: Box::new(Unavailable(reason)) })
        }))
    }

    fn embedded_ids_readable(&self) -> bool {
        false
    }
}

/// A [`DecodeError::Malformed`] with `message`.
pub(crate) fn malformed(message: String) -> DecodeError {
    DecodeError::Malformed(Box::new(<apache_avro::Error as serde::de::Error>::custom(message)))
}
