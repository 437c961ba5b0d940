//! gpumedic's event contracts: the Kafka topics the four services share and, with them, the
//! records they carry.
//!
//! Every topic is keyed by node name, so one node's records stay in order through the pipeline.

pub mod topics;
