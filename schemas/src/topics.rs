//! The Kafka topics of the pipeline. Names carry a major version: a breaking change to a record
//! gets a new topic, never an incompatible record on an existing one.

/// Raw health events from the collectors.
pub const HEALTH_RAW: &str = "gpumedic.health.raw.v1";
/// Health events with cluster and Xid-catalog context, from the enricher.
pub const HEALTH_ENRICHED: &str = "gpumedic.health.enriched.v1";
/// Verdicts from the classifier. Public: other systems subscribe here.
pub const VERDICTS: &str = "gpumedic.verdicts.v1";
/// What the remediator did about each verdict.
pub const ACTIONS: &str = "gpumedic.actions.v1";

/// The node-token directory: each collector's token, published once per rotation (keyed by node
/// and key id), so raw records carry a signature instead of the token
/// (`gpumedic_runtime::kafka::node_proof`). Not a pipeline topic: no Avro, read by the enrichers.
pub const NODE_TOKENS: &str = "gpumedic.node-tokens.v1";

/// Every pipeline topic, in flow order.
pub const ALL: [&str; 4] = [HEALTH_RAW, HEALTH_ENRICHED, VERDICTS, ACTIONS];

/// Default partition count when a service creates a topic: the ceiling on how many replicas of a
/// consuming service share the work.
pub const DEFAULT_PARTITIONS: i32 = 12;
