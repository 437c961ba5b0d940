//! The classifier: applies runbook rules to enriched health events per node and GPU, records
//! incidents, verdicts, actions and the events they need in Postgres (its sole writer; every
//! event with `--persist all`, see [`persist`]), and publishes verdicts on `gpumedic.verdicts.v1`,
//! keyed by node.
//!
//! Records are handled a batch at a time ([`kafka::run_batch_consumer`]): decode each record
//! (undecodable ones go to the dead-letter topic), observe the events through the engine in
//! order, publish all resulting verdicts at once and wait for every acknowledgement, then write
//! the whole batch (events, incidents, verdicts, action outcomes) in one Postgres statement, and
//! only then let the offsets be stored. Verdict ids are deterministic and every write is
//! idempotent, so a crash anywhere in between republishes the same ids (subscribers deduplicate)
//! and rewrites nothing. A ticker closes bursts and quiet periods when no event arrives; a
//! retention job keeps the daily event partitions; rule files are reloaded when they change.
//!
//! State is owned per partition of the enriched topic: a replica holds the engine state of the
//! nodes its partitions carry, and nothing else. Before it handles a batch or ticks, it looks at
//! its assignment: nodes of partitions it lost are forgotten, nodes of partitions it gained are
//! rebuilt from the events Postgres recorded (streamed, within `--rebuild-window`). So a replica
//! never decides from a stale snapshot after a rebalance, and never fires deadlines for a node
//! another replica owns.
//!
//! The service frame is split into rooms, this file only wiring them: `config` (flags, validated
//! into [`Config`]), `database` (the migrations, [`connect_and_migrate`]), `classifier` (the
//! engine with its outputs, [`Classifier`], and the partitions it holds), `handler` (a batch of
//! records, [`Handler`]) and `ticker` (time-based conditions without events).

pub mod api;
pub mod auth;
pub mod lemons;
pub mod nvlink;
pub mod observe;
pub mod persist;
pub mod quality;
pub mod reload;
pub mod retention;
pub mod rules;
pub mod store;
pub mod workload;

mod classifier;
mod config;
mod database;
mod events;
mod handler;
pub mod rollups;
mod ticker;
mod tight;

pub use classifier::{Classifier, ClassifierError};
pub use config::{Args, Config, Defaults, Topics};
pub use database::{MIGRATOR, connect_and_migrate};
pub use handler::Handler;

use std::sync::Arc;
use std::time::Duration;

use gpumedic_runtime::kafka;
use gpumedic_runtime::postgres;
use gpumedic_runtime::service::RunError;
use gpumedic_runtime::service::Service;
use gpumedic_runtime::stage::Stage;
use tokio::sync::Mutex;

use crate::classifier::Owned;
use crate::events::names;
use crate::rules::engine::Engine;
use crate::ticker::ticker;

/// The service's name, as used in metric names and logs.
pub const NAME: &str = "classifier";

/// Registers, at zero, the counters that only move on a rare event, so `/metrics` names them from
/// the start: dashboards and alerts find them, and `increase()` sees their first step.
fn register_metrics() {
    for reason in rules::sanity::Invalid::ALL {
        metrics::counter!(names::INVALID_INPUTS_TOTAL, "reason" => reason.as_str()).increment(0);
    }
    metrics::counter!(names::WORKLOAD_FAULTS_TOTAL).increment(0);
    for part in ["gpu", "node"] {
        metrics::counter!(names::LEMONS_TOTAL, "part" => part).increment(0);
    }
    metrics::counter!(names::CLOCK_SKEW_CLAMPED_TOTAL).increment(0);
    metrics::counter!(names::ROLLUPS_LOST_TOTAL).increment(0);
    for result in ["ok", "refused"] {
        metrics::counter!(names::RULE_RELOADS_TOTAL, "result" => result).increment(0);
    }
}

/// Runs the classifier until SIGTERM/SIGINT or a failure.
pub async fn run(config: Config) -> Result<(), RunError> {
    let api_pool = api::SharedPool::default();
    let access = auth::Access::start(NAME, &config.api_auth).await;
    let mut service = Service::start_with_routes(NAME, &config.common, api::routes(api_pool.clone(), access));
    register_metrics();
    let db_ready = service.readiness.register("database");
    let token = service.shutdown.token();
    let assignment = kafka::Assignment::default();
    let setup = async {
        let pool = connect_and_migrate(&config.database_url, config.database_pool).await?;
        // Partitions for today and the days ahead exist before the first event is written.
        retention::maintain_logged(&pool, config.event_retention).await;
        // State is rebuilt per partition once the group assigns them (Classifier::reconcile).
        let engine = Engine::new(config.rules.clone());
        let producer = config.stage.kafka.producer(NAME)?;
        let codec = config.stage.kafka.codec().await?;
        Ok::<_, ClassifierError>(Classifier {
            engine,
            pool: pool.clone(),
            producer,
            verdicts_topic: config.topics.verdicts.clone(),
            codec,
            write_parallelism: config.write_parallelism,
            workload_faults: config.workload_faults,
            assignment: assignment.clone(),
            owned: Owned::default(),
            enriched_topic: config.topics.enriched.clone(),
            rebuild_window: config.rebuild_window,
            clock_skew_allowance: config.clock_skew_allowance,
            lemons: config.lemons,
            keeper: persist::Keeper::for_rebuild_window(config.persist, config.rebuild_window)
                .with_rollup_period(config.rollup_period),
            rollups: rollups::RollupWriter::start(pool.clone(), token.clone()),
        })
    };
    let classifier = match setup.await {
        Ok(c) => Arc::new(Mutex::new(c)),
        Err(e) => {
            tracing::error!(error = %e, "Cannot start the classifier.");
            return Err(RunError::setup("the classifier", e));
        }
    };
    let pool = classifier.lock().await.pool.clone();
    // The incident API reads on its own pool: read-only, and no query may run past 10 s.
    match postgres::connect_with_settings(
        &config.database_url,
        config.api_database_pool,
        &[("statement_timeout", "10s"), ("default_transaction_read_only", "on")],
    )
    .await
    {
        Ok(read_only) => {
            let _ = api_pool.set(read_only);
        }
        Err(e) => {
            tracing::error!(error = %e, "Cannot open the incident API's database pool.");
            return Err(RunError::setup("the incident API database pool", e));
        }
    }
    service.shutdown.spawn(
        "database",
        postgres::watch_reachability(pool.clone(), db_ready, Duration::from_secs(10), token.clone()),
    );
    service.shutdown.spawn("retention", retention::run(pool, config.event_retention, token.clone()));
    service.shutdown.spawn("ticker", ticker(classifier.clone(), config.tick, token.clone()));
    if let Some(dir) = config.rules_dir.clone() {
        let watch = reload::watch(classifier.clone(), dir, config.allow_synthetic, config.rules_poll, token.clone());
        service.shutdown.spawn("rules-watch", watch);
    }
    let Config { stage, topics: t, batch, .. } = config;
    let handler = Handler::new(classifier, t.actions.clone());
    let stage = Stage::new(stage, [t.enriched, t.actions], [t.verdicts]).tracking(assignment);
    service.spawn_stage(stage, batch, handler);
    service.run().await
}
