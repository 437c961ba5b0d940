//! gpumedic's gRPC ingest API: custom health monitors on a node publish events to the collector.
//! The contract is `proto/gpumedic/ingest/v1/ingest.proto`; this crate is its generated code.

/// Version 1 of the ingest API.
pub mod ingest {
    /// `gpumedic.ingest.v1`.
    pub mod v1 {
        #![allow(missing_docs, clippy::all, clippy::pedantic)]
        tonic::include_proto!("gpumedic.ingest.v1");
    }
}
