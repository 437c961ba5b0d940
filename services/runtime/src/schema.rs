//! The codec every service writes and reads records with, chosen by `--schema-registry-url`: a
//! schema registry when one is given, else the schema table embedded in gpumedic.
//!
//! The registry client is built here, not in the Kafka settings: the settings only carry its URL.

use std::sync::Arc;

use gpumedic_schemas::{Codec, RegistryOptions, RegistryStartError};

/// The codec records are written and read with: registry-backed when `registry_url` is given
/// (this build's schemas are registered now, so a registry that is unreachable or refuses a schema
/// stops the start with the reason), else the embedded schema table.
pub async fn codec(registry_url: Option<&str>) -> Result<Arc<Codec>, RegistryStartError> {
    let Some(url) = registry_url else { return Ok(Arc::new(Codec::embedded())) };
    let codec = Codec::with_registry(url, RegistryOptions::default()).await?;
    if !codec.embedded_ids_readable() {
        tracing::warn!(%url, "Schema ids 1-4 in this registry are not gpumedic's schemas: records written without a registry cannot be read through it (docs/events.md).");
    }
    tracing::info!(%url, "Schemas registered; writer schemas resolve from the registry.");
    Ok(Arc::new(codec))
}
