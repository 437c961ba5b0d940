//! The console: the GPU fleet's health as web pages and a read-only JSON API, the page an
//! operator keeps open on a second screen.
//!
//! It reads, and never writes: GPU Nodes through a watch cache (their gpumedic state label,
//! cordon, taints and conditions), the remediator's status object through another (breaker and
//! pause), the classifier's incident history in PostgreSQL on a read-only pool, and the verdict
//! topic from its end, in a consumer group of each replica's own, for the live updates it pushes
//! to open pages as Server-Sent Events ([`live`]). Pages and API are served beside `/healthz`,
//! `/readyz` and `/metrics` on the admin port, guarded as the incident API is ([`api`]).
//!
//! The rooms: `config` (flags, validated into [`Config`]), [`fleet`] (pure: a Node as the console
//! shows it, the fleet's figures, filters and pages), [`store`] (the SQL), [`view`] (the data of
//! each view), [`api`] (routes and JSON), [`pages`] (HTML) and [`live`].

pub mod api;
pub mod fleet;
pub mod live;
pub mod pages;
pub mod store;
pub mod view;

mod config;
mod events;

pub use config::{Args, Config};

use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt as _;
use gpumedic_runtime::api_auth::Access;
use gpumedic_runtime::postgres;
use gpumedic_runtime::service::RunError;
use gpumedic_runtime::service::Service;
use k8s_openapi::api::core::v1::{ConfigMap, Node};
use kube::api::Api;
use kube::runtime::reflector;
use kube::runtime::{WatchStreamExt as _, watcher};
use tokio_util::sync::CancellationToken;

use crate::events::names;
use crate::live::Live;
use crate::view::Console;

/// The service's name, as used in metric names and logs.
pub const NAME: &str = "console";

/// What stops the console from starting or running.
#[derive(Debug, thiserror::Error)]
pub enum ConsoleError {
    /// No Kubernetes client.
    #[error(transparent)]
    Kubernetes(#[from] gpumedic_runtime::k8s::KubeError),
    /// The database pool could not be opened.
    #[error(transparent)]
    Database(#[from] postgres::PostgresError),
}

/// Runs the console until SIGTERM/SIGINT or a failure.
pub async fn run(config: Config) -> Result<(), RunError> {
    let client = match gpumedic_runtime::k8s::client().await {
        Ok(c) => c,
        Err(e) => {
            tracing::error!(error = %e, "Cannot start the console without a Kubernetes client.");
            return Err(RunError::setup("the Kubernetes client", ConsoleError::from(e)));
        }
    };
    let (nodes, nodes_writer) = reflector::store::<Node>();
    let (status, status_writer) = reflector::store::<ConfigMap>();
    let console = Arc::new(Console {
        nodes: nodes.clone(),
        nodes_synced: Arc::default(),
        status,
        pool: Arc::default(),
        client: client.clone(),
        live: Live::default(),
        remediator_namespace: config.remediator_namespace.clone(),
        status_configmap: config.status_configmap.clone(),
        trace_url: config.trace_url.clone(),
    });
    let access = Access::start(NAME, &config.api_auth).await;
    let mut service = Service::start_with_routes(NAME, &config.common, api::routes(console.clone(), access));
    metrics::gauge!(names::LIVE_CLIENTS).set(0.0);
    metrics::counter!(names::LIVE_VERDICTS_TOTAL).increment(0);
    let db_ready = service.readiness.register("database");
    let nodes_ready = service.readiness.register("kubernetes-nodes-synced");
    let assigned = service.readiness.register("kafka-partitions-assigned");
    let token = service.shutdown.token();

    // Read-only, and no query may run past 10 s: the console never holds the classifier back.
    match postgres::connect_with_settings(
        &config.database_url,
        config.database_pool,
        &[("statement_timeout", "10s"), ("default_transaction_read_only", "on")],
    )
    .await
    {
        Ok(pool) => {
            let _ = console.pool.set(pool.clone());
            service.shutdown.spawn(
                "database",
                postgres::watch_reachability(pool, db_ready, Duration::from_secs(10), token.clone()),
            );
        }
        Err(e) => {
            tracing::error!(error = %e, "Cannot open the console's database pool.");
            return Err(RunError::setup("the database pool", ConsoleError::from(e)));
        }
    }

    let node_api: Api<Node> = Api::all(client.clone());
    let node_watch = watcher::Config::default().labels(&config.gpu_node_selector);
    service.shutdown.spawn("node-watch", watch(node_api, node_watch, nodes_writer, "Nodes", token.clone()));
    let synced = console.nodes_synced.clone();
    let waiting = nodes.clone();
    let sync_token = token.clone();
    // A long task like the others: it ends only with the service.
    service.shutdown.spawn("node-sync", async move {
        tokio::select! {
            () = sync_token.cancelled() => {}
            filled = waiting.wait_until_ready() => {
                if filled.is_ok() {
                    let _ = synced.set(());
                    nodes_ready.set(true);
                    tracing::info!(nodes = waiting.state().len(), "The Node cache is filled.");
                }
                sync_token.cancelled().await;
            }
        }
        Ok::<(), ConsoleError>(())
    });
    let status_api: Api<ConfigMap> = Api::namespaced(client, &config.remediator_namespace);
    let status_watch = watcher::Config::default().fields(&format!("metadata.name={}", config.status_configmap));
    service.shutdown.spawn(
        "status-watch",
        watch(status_api, status_watch, status_writer, "the remediator's status", token.clone()),
    );
    service.shutdown.spawn("fleet-gauges", fleet_gauges(console.clone(), config.fleet_gauge_interval, token.clone()));

    let group = format!("{}-{}", config.group_prefix, uuid::Uuid::new_v4().simple());
    service.shutdown.spawn(
        "live-verdicts",
        live::run(config.kafka, group, config.verdicts_topic, console.live.clone(), assigned, token),
    );
    service.run().await
}

/// Keeps `writer`'s store current with `api`'s objects until `token` is cancelled; the watch
/// retries with backoff on its own, so errors are logged, not fatal.
async fn watch<K>(
    api: Api<K>,
    config: watcher::Config,
    writer: reflector::store::Writer<K>,
    what: &'static str,
    token: CancellationToken,
) -> Result<(), ConsoleError>
where
    K: kube::Resource<DynamicType = ()> + Clone + std::fmt::Debug + serde::de::DeserializeOwned + Send + Sync + 'static,
{
    // Managed fields are most of a Node's size and nothing the console shows.
    let stream = watcher(api, config)
        .default_backoff()
        .modify(|o: &mut K| {
            o.meta_mut().managed_fields = None;
        })
        .reflect(writer)
        .applied_objects();
    let mut stream = std::pin::pin!(stream);
    loop {
        tokio::select! {
            () = token.cancelled() => return Ok(()),
            item = stream.next() => match item {
                None => return Ok(()),
                Some(Ok(_)) => {}
                Some(Err(e)) => tracing::warn!(watch = what, error = %e, "The watch failed; it retries with backoff."),
            },
        }
    }
}

/// Sets the fleet gauges from the Node cache every `every`.
async fn fleet_gauges(console: Arc<Console>, every: Duration, token: CancellationToken) -> Result<(), ConsoleError> {
    loop {
        if let Ok(nodes) = console.summaries() {
            let f = fleet::fleet(&nodes, 0);
            metrics::gauge!(names::FLEET_GPU_IN_SERVICE_RATIO).set(f.gpus.in_service_ratio);
            metrics::gauge!(names::FLEET_GPUS, "service" => "in").set(f.gpus.in_service as f64);
            metrics::gauge!(names::FLEET_GPUS, "service" => "out").set(f.gpus.out_of_service as f64);
            for (state, n) in fleet::ordered_states(&f.nodes_by_state) {
                // Only the known states: a label value is not a bounded label set.
                if fleet::STATES.contains(&state.as_str()) {
                    metrics::gauge!(names::FLEET_NODES, "state" => state).set(n as f64);
                }
            }
        }
        tokio::select! {
            () = token.cancelled() => return Ok(()),
            () = tokio::time::sleep(every) => {}
        }
    }
}
