//! `gpumedic`: the operator CLI.
//!
//! Subcommands grow with the pipeline: the pipeline's Kafka topics, kernel logs checked with the
//! collector's own parser, synthetic faults, incident history, rule checks, replay and backtest, the
//! demo, the remediator's control surface (circuit breaker status and reset, global pause and
//! resume), and the repair webhook's signature as a receiver checks it.
//!
//! The binary only parses the command line and calls [`run`]; [`Cli`] lists the subcommands,
//! each carried out in a room of its own.

mod cli;
mod control;
mod demo;
mod hooks;
mod incidents;
mod inject;
mod parse_log;
mod replay;
mod rules;
mod topics;

pub use cli::{Cli, run};
