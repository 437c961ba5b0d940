//! The frame of a service process: runtime, telemetry, admin server and the shutdown tree.
//!
//! A service's `main` loads its config and calls [`main`]; its library's `run` receives a
//! [`Service`], registers readiness checks, spawns its tasks, and returns [`Service::run`].

use std::future::Future;
use std::process::ExitCode;

use crate::BoxError;
use crate::admin::{self, Readiness};
use crate::config::CommonConfig;
use crate::events::{metric_name, names};
use crate::kafka::{self, BatchHandler, BatchSettings};
use crate::shutdown::{Shutdown, ShutdownError};
use crate::stage::Stage;

/// Why a service process did not end with a clean, requested shutdown.
#[derive(Debug, thiserror::Error)]
pub enum RunError {
    /// Something the service needs failed at start (its clients, its schema, its state), before
    /// any task ran.
    #[error("cannot start: {step}: {source}")]
    Setup {
        /// What was being set up.
        step: &'static str,
        /// Why it failed.
        #[source]
        source: BoxError,
    },
    /// The service ran and stopped: a task failed, ended or panicked, or the shutdown deadline
    /// passed.
    #[error(transparent)]
    Stopped(#[from] ShutdownError),
}

impl RunError {
    /// A failure at start, while setting up `step`.
    pub fn setup(step: &'static str, source: impl Into<BoxError>) -> Self {
        Self::Setup { step, source: source.into() }
    }
}

/// A running service: its name, readiness checks and task tree.
pub struct Service {
    /// The service's name, used in metric names (`gpumedic_<name>_...`).
    pub name: &'static str,
    /// Readiness checks served on `/readyz`.
    pub readiness: Readiness,
    /// The task tree; spawn long tasks here.
    pub shutdown: Shutdown,
}

impl Service {
    /// Creates the service and starts its admin server.
    pub fn start(name: &'static str, common: &CommonConfig) -> Self {
        Self::start_with_routes(name, common, axum::Router::new())
    }

    /// Like [`Service::start`], with the service's own HTTP routes served beside the admin ones.
    pub fn start_with_routes(name: &'static str, common: &CommonConfig, routes: axum::Router) -> Self {
        // Install the metrics recorder before anything records.
        admin::metrics_handle();
        let readiness = Readiness::default();
        let mut shutdown = Shutdown::new(common.shutdown_deadline);
        shutdown.spawn("admin-server", admin::serve(common.admin_addr, readiness.clone(), shutdown.token(), routes));
        metrics::gauge!(metric_name(name, names::UP)).set(1.0);
        Self { name, readiness, shutdown }
    }

    /// Spawns the consuming stage of a service: creates its topics (inputs, their dead-letter
    /// topics and outputs) with backoff while Kafka is not ready, joins its consumer group on the
    /// inputs, and hands every record to `handler` at least once, `batch` at a time
    /// ([`kafka::run_batch_consumer`]). Readiness (`kafka-partitions-assigned`) waits for the
    /// group's partition assignment.
    pub fn spawn_stage<H: BatchHandler + 'static>(&mut self, stage: Stage, batch: BatchSettings, handler: H) {
        let assigned = self.readiness.register("kafka-partitions-assigned");
        let token = self.shutdown.token();
        let name = self.name;
        self.shutdown.spawn("consumer", async move {
            if !stage.wait_for_topics(&token).await {
                return Ok(());
            }
            let (consumer, dlq) = stage.join(name, assigned)?;
            kafka::run_batch_consumer(name, consumer, dlq, handler, batch, token).await
        });
    }

    /// Runs until a signal or a failed task, then shuts down within the deadline.
    pub async fn run(self) -> Result<(), RunError> {
        Ok(self.shutdown.run().await?)
    }
}

/// Runs a service process: builds the tokio runtime, starts telemetry, runs `run` and turns its
/// result into the exit status (0 after a clean shutdown, 1 otherwise).
pub fn main<F, Fut, E>(name: &'static str, common: &CommonConfig, run: F) -> ExitCode
where
    F: FnOnce() -> Fut,
    Fut: Future<Output = Result<(), E>>,
    E: std::fmt::Display,
{
    let runtime = match tokio::runtime::Builder::new_multi_thread().enable_all().build() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("{name}: cannot start the async runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    runtime.block_on(async {
        let _telemetry = match crate::telemetry::init(name, common) {
            Ok(guard) => guard,
            Err(e) => {
                eprintln!("{name}: cannot start telemetry: {e}");
                return ExitCode::FAILURE;
            }
        };
        tracing::info!(service = name, version = env!("CARGO_PKG_VERSION"), "Starting.");
        match run().await {
            Ok(()) => {
                tracing::info!(service = name, "Stopped.");
                ExitCode::SUCCESS
            }
            Err(e) => {
                tracing::error!(service = name, error = %e, "Stopped with an error.");
                ExitCode::FAILURE
            }
        }
    })
}
