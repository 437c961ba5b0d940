//! The service runtime shared by gpumedic's four services and its CLI.
//!
//! Every service is the same shape: load and validate its configuration (all problems listed, exit
//! 64 when invalid), start telemetry, serve `/healthz`, `/readyz` and `/metrics`, run its long tasks
//! under one shutdown tree, and move records between Kafka topics at least once. This crate owns that
//! shape so each service only writes what is its own.

pub mod admin;
#[cfg(feature = "k8s")]
pub mod api_auth;
pub mod config;
pub mod events;
pub mod fault;
#[cfg(feature = "k8s")]
pub mod k8s;
pub mod kafka;
pub mod keyed;
#[cfg(feature = "postgres")]
pub mod postgres;
pub mod schema;
pub mod service;
pub mod shutdown;
pub mod stage;
pub mod telemetry;

/// A boxed error from a task or a handler, for places that carry errors of many kinds.
pub type BoxError = Box<dyn std::error::Error + Send + Sync + 'static>;
