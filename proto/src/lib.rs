//! gpumedic's gRPC ingest API: custom health monitors on a node publish events to the collector.
//! The contract is `proto/gpumedic/ingest/v1/ingest.proto` (documented in docs/ingest.md); this
//! crate is its generated client and server code, plus [`convert`], the validation and conversion
//! of an ingest event into the raw `HealthEvent` the collector publishes. It also holds the
//! kubelet's PodResources API ([`podresources`]), which the collector reads to learn which pods
//! use which GPU.

pub mod convert;

pub use convert::{IngestContext, IngestError, to_health_event};

/// Version 1 of the ingest API.
pub mod ingest {
    /// `gpumedic.ingest.v1`.
    pub mod v1 {
        #![allow(missing_docs, clippy::all, clippy::pedantic)]
        tonic::include_proto!("gpumedic.ingest.v1");
    }
}

/// The kubelet's PodResources API (`k8s.io/kubelet/pkg/apis/podresources/v1`), trimmed to `List`:
/// the pods of the node and the devices (GPU UUIDs, MIG ids) assigned to each container.
pub mod podresources {
    /// Package `v1`: the service is `v1.PodResourcesLister`.
    pub mod v1 {
        #![allow(missing_docs, clippy::all, clippy::pedantic)]
        tonic::include_proto!("v1");
    }
}
