//! gpumedic's event contracts: the Kafka topics the four services share and the records they carry.
//!
//! The Avro schema files under `schemas/avro/` are the source of truth ([`avro`]); the Rust types
//! ([`health`], [`enriched`], [`verdict`], [`action`]) mirror them field for field, and tests prove
//! that they agree. [`framing`] frames records for Kafka (the Confluent wire format and the
//! embedded schema table); [`codec`] holds [`Codec`], the codec the services share, which resolves
//! schema ids through a [`SchemaResolver`]: the embedded table, or (feature `registry`) a schema
//! registry through the [`registry`] client; [`compat`] is the evolution gate.
//!
//! Every topic is keyed by node name, so one node's records stay in order through the pipeline.

pub mod action;
pub mod avro;
mod binary;
pub mod codec;
pub mod compat;
pub mod enriched;
pub mod framing;
pub mod health;
pub mod json;
#[cfg(feature = "registry")]
pub mod registry;
mod serde_util;
pub mod topics;
pub mod verdict;

pub use action::{ActionOutcome, ActionStatus};
pub use codec::{Codec, DecodeFailure, SchemaResolver};
#[cfg(feature = "registry")]
pub use codec::{RegistryOptions, RegistryResolver, RegistryStartError};
pub use enriched::EnrichedHealthEvent;
pub use framing::{DecodeError, EncodeError, Record, decode, encode};
pub use health::{Detail, HealthEvent, Kind};
pub use verdict::{RecommendedAction, Severity, Verdict};
