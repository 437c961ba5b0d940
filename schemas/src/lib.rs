//! gpumedic's event contracts: the Kafka topics the four services share and the records they carry.
//!
//! The Avro schema files under `schemas/avro/` are the source of truth ([`avro`]); the Rust types
//! ([`health`], [`enriched`], [`verdict`], [`action`]) mirror them field for field, and tests prove
//! that they agree. [`codec`] frames records for Kafka; [`Codec`] is the codec the services share,
//! resolving schema ids from the embedded table or (feature `registry`) from a schema registry
//! through [`registry`]; [`compat`] is the evolution gate.
//!
//! Every topic is keyed by node name, so one node's records stay in order through the pipeline.

pub mod action;
pub mod avro;
mod binary;
pub mod codec;
pub mod compat;
pub mod enriched;
pub mod health;
#[cfg(feature = "registry")]
pub mod registry;
mod serde_util;
pub mod shared_codec;
pub mod topics;
pub mod verdict;

pub use action::{ActionOutcome, ActionStatus};
pub use codec::{DecodeError, EncodeError, Record, decode, encode};
pub use enriched::EnrichedHealthEvent;
pub use health::{Detail, HealthEvent, Kind};
pub use shared_codec::{Codec, DecodeFailure};
#[cfg(feature = "registry")]
pub use shared_codec::{RegistryOptions, RegistryStartError};
pub use verdict::{RecommendedAction, Severity, Verdict};
