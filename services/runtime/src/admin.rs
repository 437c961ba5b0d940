//! The admin HTTP server every service runs: `/healthz` (the process is alive), `/readyz` (every
//! readiness check passes: partitions assigned, database reachable, ...) and `/metrics`
//! (Prometheus text format). No internal error text is served; details go to the logs.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, OnceLock};

use axum::Router;
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::IntoResponse;
use axum::routing::get;
use metrics_exporter_prometheus::{PrometheusBuilder, PrometheusHandle};
use tokio_util::sync::CancellationToken;

/// What went wrong with the admin server.
#[derive(Debug, thiserror::Error)]
pub enum AdminError {
    /// The listen address could not be bound.
    #[error("cannot listen on {addr}: {source}")]
    Bind {
        /// The address.
        addr: SocketAddr,
        /// The OS error.
        source: std::io::Error,
    },
    /// The server stopped with an error.
    #[error("admin server failed: {0}")]
    Serve(#[source] std::io::Error),
}

/// One named readiness check; set it when the component it stands for is ready.
#[derive(Debug, Clone)]
pub struct ReadyFlag(Arc<AtomicBool>);

impl ReadyFlag {
    /// Marks the component ready (`true`) or not.
    pub fn set(&self, ready: bool) {
        self.0.store(ready, Ordering::Release);
    }

    /// Whether the component is ready.
    pub fn get(&self) -> bool {
        self.0.load(Ordering::Acquire)
    }
}

/// The set of readiness checks of a service. `/readyz` answers 200 only when all pass.
#[derive(Debug, Clone, Default)]
pub struct Readiness {
    checks: Arc<Mutex<Vec<(String, ReadyFlag)>>>,
}

impl Readiness {
    /// Adds a check named `name`, initially not ready.
    pub fn register(&self, name: impl Into<String>) -> ReadyFlag {
        let flag = ReadyFlag(Arc::new(AtomicBool::new(false)));
        self.checks.lock().expect("readiness lock").push((name.into(), flag.clone()));
        flag
    }

    /// The names of the checks that do not pass yet.
    pub fn pending(&self) -> Vec<String> {
        self.checks.lock().expect("readiness lock").iter().filter(|(_, f)| !f.get()).map(|(n, _)| n.clone()).collect()
    }
}

/// The process-wide Prometheus recorder; installed on first use.
pub fn metrics_handle() -> PrometheusHandle {
    static HANDLE: OnceLock<PrometheusHandle> = OnceLock::new();
    HANDLE
        .get_or_init(|| {
            // Histograms as Prometheus histograms (aggregatable across replicas), with buckets
            // from a millisecond to a minute: record handling and pipeline latency.
            const BUCKETS: [f64; 14] =
                [0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 15.0, 60.0];
            let builder = PrometheusBuilder::new();
            let builder = builder
                .set_buckets_for_metric(metrics_exporter_prometheus::Matcher::Suffix("_seconds".into()), &BUCKETS)
                .unwrap_or_else(|_| PrometheusBuilder::new());
            let recorder = builder.build_recorder();
            let handle = recorder.handle();
            // Another recorder may exist in tests that build several services in one process;
            // the handle still renders this one.
            let _ = metrics::set_global_recorder(recorder);
            handle
        })
        .clone()
}

#[derive(Clone)]
struct AdminState {
    readiness: Readiness,
    metrics: PrometheusHandle,
    stopping: CancellationToken,
}

/// The admin router, exposed so tests can drive it without a socket.
pub fn router(readiness: Readiness, stopping: CancellationToken) -> Router {
    let state = AdminState { readiness, metrics: metrics_handle(), stopping };
    Router::new()
        .route("/healthz", get(|| async { "ok\n" }))
        .route("/readyz", get(readyz))
        .route("/metrics", get(metrics_text))
        .with_state(state)
}

async fn readyz(State(state): State<AdminState>) -> impl IntoResponse {
    if state.stopping.is_cancelled() {
        return (StatusCode::SERVICE_UNAVAILABLE, "not ready: shutting down\n".to_owned());
    }
    let pending = state.readiness.pending();
    if pending.is_empty() {
        (StatusCode::OK, "ready\n".to_owned())
    } else {
        (StatusCode::SERVICE_UNAVAILABLE, format!("not ready: {}\n", pending.join(", ")))
    }
}

async fn metrics_text(State(state): State<AdminState>) -> impl IntoResponse {
    ([(axum::http::header::CONTENT_TYPE, "text/plain; version=0.0.4")], state.metrics.render())
}

/// Serves the admin router, plus a service's own read-only routes (`extra`), on `addr` until
/// `token` is cancelled.
pub async fn serve(
    addr: SocketAddr,
    readiness: Readiness,
    token: CancellationToken,
    extra: Router,
) -> Result<(), AdminError> {
    let listener = tokio::net::TcpListener::bind(addr).await.map_err(|source| AdminError::Bind { addr, source })?;
    tracing::info!(%addr, "Admin server listening.");
    let app = router(readiness, token.clone()).merge(extra);
    axum::serve(listener, app)
        .with_graceful_shutdown(async move { token.cancelled().await })
        .await
        .map_err(AdminError::Serve)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn readiness_lists_pending_checks() {
        let r = Readiness::default();
        let kafka = r.register("kafka");
        let db = r.register("database");
        assert_eq!(r.pending(), vec!["kafka".to_string(), "database".to_string()]);
        kafka.set(true);
        assert_eq!(r.pending(), vec!["database".to_string()]);
        db.set(true);
        assert!(r.pending().is_empty());
    }
}
