//! The remediator: turns verdicts into changes on the cluster (node conditions, taints, labels,
//! cordon, drain, repair hooks) within strict safety limits, and publishes what it did on
//! `gpumedic.actions.v1`. One replica leads at a time.
//!
//! This crate holds the service frame (configuration, leadership, the consumer group on the
//! verdict topic, the Kubernetes client and readiness) and the remediation core:
//! - [`request`]: what is asked ([`request::Remediation`]), independent of the verdict's wire format;
//! - [`plan`]: the pure planner, node as it is + request + mode -> exact changes or "nothing, because";
//! - [`safety`]: the circuit breaker and the quarantine rate limit, pure with the clock passed in;
//! - [`drain`]: which pods leave (pure) and the Eviction API drain (edge);
//! - [`dra`]: GPU-level quarantine with DRA DeviceTaintRules (which device, which pods, when the
//!   node goes out whole: pure; the rule's writes: edge);
//! - [`apply`]: the thin Kubernetes edge that carries plans out and records Events;
//! - [`lease`]: leader election over a `coordination.k8s.io` Lease (pure decision, thin edge);
//! - [`control`]: the status object (breaker state, pause, reset requests) shared with the CLI;
//! - [`window`] and [`maintenance`]: maintenance windows (pure) and deferred actions (edge);
//! - [`ladder`] and [`hooks`]: the repair escalation ladder (pure, durable on the node) and the
//!   repair hooks it calls (a signed webhook, a custom resource), full-remediation mode only;
//! - [`verdicts`]: verdict in, action outcome out.
//!
//! The service frame is split into rooms, this file only wiring them: `config` (flags, validated
//! into [`Config`]), `term` (what a leadership term shares, and the publish and breaker-persist
//! helpers), `leader` (the lease loop and the term's tasks), `handler` (one verdict), `deferred`
//! (deferred actions carried out when due), `repairs` (the ladder driver) and `fleet` (the managed
//! nodes).
//!
//! Only the leader consumes: it joins the consumer group when it takes the lease and leaves it
//! when it loses or releases the lease, so the partitions move to the next leader. Each verdict
//! is applied (or deliberately not, with the reason), the outcome is published on
//! `gpumedic.actions.v1` and acknowledged, and only then is the verdict's offset stored. Applying
//! the same verdict twice yields one action (`already_done` the second time), which is what lets
//! a new leader pick up a verdict the old one was in the middle of.

pub mod apply;
pub mod control;
pub mod dra;
pub mod drain;
pub mod hooks;
pub mod ladder;
pub mod lease;
pub mod maintenance;
pub mod plan;
pub mod request;
pub mod safety;
pub mod validate;
pub mod verdicts;
pub mod window;

mod config;
mod deferred;
mod error;
mod events;
mod fleet;
mod handler;
mod leader;
mod repairs;
mod resync;
mod term;
mod watch;

pub use config::{Args, Config, Defaults};
pub use fleet::{Fleet, NodeCache};
pub use handler::Handler;

use std::sync::Arc;
use std::sync::atomic::AtomicBool;

use gpumedic_runtime::service::RunError;
use gpumedic_runtime::service::Service;
use gpumedic_runtime::stage::Stage;

use crate::apply::Remediator;
use crate::control::StatusClient;
use crate::events::names;
use crate::leader::lead;
use crate::lease::{LeaseClient, Validity};
use crate::safety::Gate;
use crate::term::Shared;

/// The service's name, as used in metric names and logs.
pub const NAME: &str = "remediator";

/// Registers, at zero, the counters that only move on a rare event, so `/metrics` names them from
/// the start: dashboards and alerts find them, and `increase()` sees their first step.
fn register_metrics() {
    for recovery in ["false", "true"] {
        metrics::counter!(names::STALE_VERDICTS_TOTAL, "recovery" => recovery).increment(0);
    }
    for result in ["ok", "failed"] {
        metrics::counter!(names::RESYNC_RUNS_TOTAL, "result" => result).increment(0);
    }
    // Not resync_actions_total: it appears with the resync's first action, which the convergence
    // test waits for by the series' appearance.
    for reason in ["no_record", "unknown_incident"] {
        metrics::counter!(names::RESYNC_SKIPPED_TOTAL, "reason" => reason).increment(0);
    }
    for until in ["window", "time", "idle"] {
        metrics::counter!(names::DEFERRED_TOTAL, "until" => until).increment(0);
    }
    for result in ["started", "passed", "failed"] {
        metrics::counter!(names::VALIDATIONS_TOTAL, "result" => result).increment(0);
    }
    for result in names::BURN_IN_RESULTS {
        metrics::counter!(names::BURN_INS_TOTAL, "result" => result).increment(0);
    }
    for name in [
        names::WRITES_REFUSED_NOT_LEADING_TOTAL,
        names::DRAINS_INCOMPLETE_TOTAL,
        names::BREAKER_TRIPS_TOTAL,
        names::BREAKER_RESETS_TOTAL,
        names::LEADERSHIP_LOST_TOTAL,
    ] {
        metrics::counter!(name).increment(0);
    }
}

/// Runs the remediator until SIGTERM/SIGINT or a failure.
pub async fn run(config: Config) -> Result<(), RunError> {
    let mut service = Service::start(NAME, &config.common);
    register_metrics();
    let kube_ready = service.readiness.register("gpu-nodes-counted");
    let lease_ready = service.readiness.register("lease-reachable");
    // Named for what it means on the leader; a standby holds it ready, because a standby is a
    // healthy replica that must not be restarted or kept out of a rollout for not leading.
    let consuming = service.readiness.register("kafka-partitions-assigned-or-standby");
    let token = service.shutdown.token();
    let validity = Arc::new(Validity::for_lease(config.lease.renew_deadline()));
    let kube_config =
        kube::Config::infer().await.map_err(|e| RunError::setup("the Kubernetes client configuration", e))?;
    let remediator = Remediator::new(
        kube_config,
        config.settings.clone(),
        Gate::new(config.breaker, config.quarantines_per_minute).with_max_gpus(config.breaker_max_gpus),
    )
    .map_err(|e| RunError::setup("the Kubernetes client", e))?
    .with_validity(validity.clone());
    let producer = config.stage.kafka.producer(NAME).map_err(|e| RunError::setup("the producer", e))?;
    let codec = config.stage.kafka.codec().await.map_err(|e| RunError::setup("the schema registry", e))?;
    let hooks = hooks::Hooks {
        webhook: config
            .webhook
            .clone()
            .map(hooks::Webhook::new)
            .transpose()
            .map_err(|e| RunError::setup("the webhook", e))?,
        resource: config
            .resource
            .clone()
            .map(|r| hooks::CustomResource::new(remediator.client(), r))
            .transpose()
            .map_err(|e| RunError::setup("the custom resource hook", e))?,
    };
    if config.incident_database_url.is_none() {
        tracing::warn!(
            "No --incident-database-url: the leader acts on verdicts only and does not resync nodes against the open \
             incidents, so a verdict refused, skipped or missed is not acted on later."
        );
    }
    tracing::info!(mode = ?config.settings.policy.mode, identity = %config.lease.identity,
        lease = %format!("{}/{}", config.lease.namespace, config.lease.name), "Remediator ready.");
    let client = remediator.client();
    let fleet = Fleet::new(client.clone(), config.gpu_node_selector.clone());
    let remediator = remediator.with_node_cache(fleet.cache());
    service.shutdown.spawn("gpu-node-watch", fleet.clone().watch(kube_ready, token.clone()));
    if config.settings.gpu_quarantine.enabled {
        // Standbys keep the caches too, so a new leader's first GPU verdicts read memory.
        let dra = remediator.clone().watch_dra(token.clone());
        service.shutdown.spawn("gpu-quarantine-caches", async move {
            dra.await;
            Ok::<(), std::convert::Infallible>(())
        });
    }
    metrics::gauge!(names::LEADER).set(0.0);
    let shared = Arc::new(Shared {
        remediator,
        producer,
        codec,
        fleet,
        status: StatusClient::new(client.clone(), &config.lease.namespace, &config.status_configmap),
        stage: Stage::new(config.stage, [config.verdicts_topic], [config.actions_topic.clone()]),
        actions_topic: config.actions_topic,
        max_verdict_age: config.max_verdict_age,
        max_in_flight: config.max_in_flight,
        windows: config.windows,
        control_poll: config.control_poll,
        maintenance_check: config.maintenance_check,
        repair_check: config.repair_check,
        incident_database_url: config.incident_database_url.clone(),
        resync_interval: config.resync_interval,
        recovered: std::sync::Mutex::new(resync::Recovered::default()),
        node_locks: term::NodeLocks::default(),
        hooks,
        lease_namespace: config.lease.namespace.clone(),
        consuming,
        open_persisted: AtomicBool::new(false),
        persisted_ledger: std::sync::Mutex::new(std::collections::BTreeSet::new()),
        status_writes: tokio::sync::Mutex::new(()),
        refused_ladders: std::sync::Mutex::new(std::collections::HashSet::new()),
    });
    // The lease on the client without kube's own retries: every attempt has a deadline here.
    let lease = LeaseClient::new(shared.remediator.client_without_retry(), config.lease);
    service.shutdown.spawn("leadership", lead(shared, lease, validity, lease_ready, token));
    service.run().await
}
