//! gpumedic's test support, for integration tests and the load tests (never a service binary):
//!
//! - [`testbed`]: the testbed's real servers, each checked before use so that a test without its
//!   server fails with how to start it (it never passes by skipping), unique names so tests run
//!   in parallel, and readers of what a test waits for on Kafka;
//! - [`process`]: service binaries started by a test and stopped with SIGTERM;
//! - [`demo`]: `gpumedic demo` run as a newcomer runs it, its output waited on by text;
//! - [`eventually()`]: the one poller for a condition a service makes true in the background;
//! - [`fixtures`] and [`NodeBuilder`]: builders for health events, enriched events, verdicts and
//!   Kubernetes Nodes;
//! - [`http_get`] and [`Relay`]: loopback HTTP, and a TCP relay a test can hold.
//!
//! Everything is re-exported at the root: `gpumedic_testkit::require_kafka()`,
//! `gpumedic_testkit::event("node").xid(79)`.

pub mod demo;
pub mod eventually;
pub mod fixtures;
pub mod http;
pub mod node;
pub mod process;
pub mod relay;
pub mod testbed;

pub use eventually::{eventually, eventually_or, eventually_with};
pub use fixtures::{EnrichedBuilder, EventBuilder, VerdictBuilder, enriched, event, verdict};
pub use http::http_get;
pub use node::NodeBuilder;
pub use process::{
    ServiceProcess, assert_service_lifecycle, free_local_addr, run_with_invalid_config, workspace_binary,
};
pub use relay::Relay;
pub use testbed::{
    START_HINT, Unreachable, database_url, fresh_database, group_at_end, kafka_bootstrap, kubeconfig_path,
    require_kafka, require_kubernetes, require_postgres, require_schema_registry, require_tracing, unique_name,
    wait_for_event, wait_for_record, wait_group_stable,
};
