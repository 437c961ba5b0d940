//! The classifier: applies runbook rules to enriched health events per node and GPU, records every
//! event, incident, verdict and action in Postgres (its sole writer), and publishes verdicts on
//! `gpumedic.verdicts.v1`, keyed by node.
//!
//! For each enriched record: decode, observe (rules), publish the resulting verdicts and wait for
//! Kafka's acknowledgement, then commit the event and verdicts to Postgres, and only then let the
//! offset be stored. Verdict ids are deterministic, so a crash anywhere in between republishes
//! the same ids (subscribers deduplicate) and rewrites nothing. A ticker closes bursts and quiet
//! periods when no event arrives. At start the engine's state is rebuilt from the recorded events.

pub mod api;
pub mod observe;
pub mod rules;
pub mod store;

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use clap::Parser;
use gpumedic_runtime::config::{CommonArgs, CommonConfig, Problems, Validate, parse_duration};
use gpumedic_runtime::kafka::{
    self, Envelope, HandleError, KafkaArgs, KafkaSettings, Producer, Record, RecordHandler, record_headers,
};
use gpumedic_runtime::postgres;
use gpumedic_runtime::service::Service;
use gpumedic_runtime::shutdown::ShutdownError;
use gpumedic_schemas::{ActionOutcome, EnrichedHealthEvent, Record as _, Verdict, topics};
use tokio::sync::Mutex;

use crate::rules::engine::{Decision, Engine};
use crate::rules::{RuleSet, SyntheticPolicy};

/// The service's name, as used in metric names and logs.
pub const NAME: &str = "classifier";

/// Command-line flags and environment variables.
#[derive(Debug, Parser)]
#[command(
    name = "gpumedic-classifier",
    version,
    about = "Classifies GPU health events with runbook rules and records incidents."
)]
pub struct Args {
    #[command(flatten)]
    common: CommonArgs,
    #[command(flatten)]
    kafka: KafkaArgs,
    /// Kafka consumer group shared by all classifier replicas.
    #[arg(long, env = "GPUMEDIC_GROUP", default_value = "gpumedic-classifier")]
    group: String,
    /// PostgreSQL URL (postgres://user:password@host:port/database).
    #[arg(long, env = "GPUMEDIC_DATABASE_URL")]
    database_url: String,
    /// Connections in the database pool.
    #[arg(long, env = "GPUMEDIC_DATABASE_POOL", default_value_t = 8)]
    database_pool: u32,
    /// A folder of rule files (*.yaml) to use instead of the built-in default rule set.
    #[arg(long, env = "GPUMEDIC_RULES_DIR")]
    rules_dir: Option<PathBuf>,
    /// Act on synthetic (injected) events. For demos and tests; production leaves it off.
    #[arg(long, env = "GPUMEDIC_ALLOW_SYNTHETIC")]
    allow_synthetic: bool,
    /// How far back recorded events are replayed at start to rebuild incident state.
    #[arg(long, env = "GPUMEDIC_REBUILD_WINDOW", default_value = "48h")]
    rebuild_window: String,
    /// How often time-based conditions (burst ends, quiet periods) are evaluated without events.
    #[arg(long, env = "GPUMEDIC_TICK", default_value = "2s")]
    tick: String,
}

/// The validated configuration.
#[derive(Debug, Clone)]
pub struct Config {
    /// Shared service settings.
    pub common: CommonConfig,
    /// Kafka settings.
    pub kafka: KafkaSettings,
    /// The consumer group.
    pub group: String,
    /// The database URL.
    pub database_url: String,
    /// Connections in the pool.
    pub database_pool: u32,
    /// The rules.
    pub rules: RuleSet,
    /// How far back to rebuild.
    pub rebuild_window: Duration,
    /// The tick interval.
    pub tick: Duration,
}

impl Validate for Args {
    type Valid = Config;

    fn validate(self) -> Result<Config, Problems> {
        let mut p = Problems::default();
        let common = self.common.validate().map_err(|e| p.extend(e)).ok();
        let kafka = self.kafka.validate().map_err(|e| p.extend(e)).ok();
        if self.group.trim().is_empty() {
            p.push("--group", "the consumer group must not be empty");
        }
        if !(self.database_url.starts_with("postgres://") || self.database_url.starts_with("postgresql://")) {
            p.push("--database-url", "must be a postgres:// URL");
        }
        if self.database_pool == 0 {
            p.push("--database-pool", "must be at least 1");
        }
        let rules = match &self.rules_dir {
            None => rules::defaults::rule_set(),
            Some(dir) => rules::load::check_dir(dir),
        };
        let rules = match rules {
            Ok(r) => Some(r),
            Err(errors) => {
                for e in errors {
                    p.push("--rules-dir", e.to_string());
                }
                None
            }
        };
        let rebuild_window = p.check("--rebuild-window", parse_duration(&self.rebuild_window));
        let tick = p.check("--tick", parse_duration(&self.tick));
        p.finish(|| {
            let rules = rules.expect("checked");
            Config {
                common: common.expect("checked"),
                kafka: kafka.expect("checked"),
                group: self.group,
                database_url: self.database_url,
                database_pool: self.database_pool,
                rules: if self.allow_synthetic { rules.with_synthetic(SyntheticPolicy::Allowed) } else { rules },
                rebuild_window: rebuild_window.expect("checked"),
                tick: tick.expect("checked"),
            }
        })
    }
}

/// The classifier's database migrations (`services/classifier/migrations`).
pub static MIGRATOR: sqlx::migrate::Migrator = sqlx::migrate!("./migrations");

/// What stops the classifier.
#[derive(Debug, thiserror::Error)]
pub enum ClassifierError {
    /// The database is unreachable.
    #[error(transparent)]
    Database(#[from] postgres::PostgresError),
    /// A migration failed.
    #[error("database migration failed: {0}")]
    Migrate(#[from] sqlx::migrate::MigrateError),
    /// A query failed.
    #[error("database query failed: {0}")]
    Query(#[from] sqlx::Error),
    /// Kafka failed.
    #[error(transparent)]
    Kafka(#[from] kafka::KafkaError),
}

/// Connects to the database and brings its schema up to date.
pub async fn connect_and_migrate(url: &str, pool_size: u32) -> Result<sqlx::PgPool, ClassifierError> {
    let pool = postgres::connect(url, pool_size).await?;
    MIGRATOR.run(&pool).await?;
    tracing::info!("Database schema is up to date.");
    Ok(pool)
}

/// The engine with its outputs, shared by the record handler and the ticker.
pub struct Classifier {
    engine: Engine,
    pool: sqlx::PgPool,
    producer: Producer,
}

impl Classifier {
    /// Publishes verdicts for `decisions` (waiting for Kafka's acknowledgement); returns them.
    async fn publish(
        &self,
        decisions: Vec<Decision>,
        incoming_trace: Option<&[u8]>,
    ) -> Result<Vec<(Decision, Verdict)>, kafka::KafkaError> {
        let mut out = Vec::with_capacity(decisions.len());
        for d in decisions {
            let v = observe::verdict(&d);
            let bytes = gpumedic_schemas::encode(&v).expect("verdicts built from decisions always encode");
            let id = v.verdict_id.to_string();
            let envelope = Envelope {
                topic: topics::VERDICTS,
                key: &v.node,
                id: &id,
                content_type: Verdict::CONTENT_TYPE,
                incoming_trace,
            };
            kafka::publish_record(&self.producer, envelope, &bytes).await?;
            tracing::info!(node = %v.node, rule = %v.rule_id, severity = ?v.severity, action = ?v.action,
                recovery = v.recovery, verdict_id = %v.verdict_id, "Verdict published.");
            metrics::counter!("gpumedic_classifier_verdicts_total", "severity" => format!("{:?}", v.severity).to_lowercase(),
                "recovery" => v.recovery.to_string()).increment(1);
            out.push((d, v));
        }
        Ok(out)
    }
}

/// The consumer's handler: enriched events into the engine; action outcomes into the record.
pub struct Handler {
    classifier: Arc<Mutex<Classifier>>,
    /// Decisions of the event being retried: the engine has already taken the event in (and
    /// would ignore it a second time), so they must not be lost with a failed publish.
    retrying: Option<(String, Vec<Decision>)>,
}

impl RecordHandler for Handler {
    async fn handle(&mut self, record: &Record) -> Result<(), HandleError> {
        let payload = record.payload.as_deref().ok_or_else(|| HandleError::Invalid("empty record".into()))?;
        let retry = |e: Box<dyn std::error::Error + Send + Sync>| HandleError::Retry(e);
        if record.topic == topics::ACTIONS {
            let outcome: ActionOutcome =
                gpumedic_schemas::decode(payload).map_err(|e| HandleError::Invalid(format!("{}: {e}", e.reason())))?;
            let c = self.classifier.lock().await;
            return store::record_action(&c.pool, &outcome).await.map_err(|e| retry(Box::new(e)));
        }
        let event: EnrichedHealthEvent =
            gpumedic_schemas::decode(payload).map_err(|e| HandleError::Invalid(format!("{}: {e}", e.reason())))?;
        let observation = observe::observation(&event);
        let mut c = self.classifier.lock().await;
        let decisions = match self.retrying.take() {
            Some((id, decisions)) if id == observation.event_id => decisions,
            _ => c.engine.observe(&observation),
        };
        let outcome = async {
            let published = c.publish(decisions.clone(), record.header(record_headers::TRACEPARENT)).await?;
            store::record_event(&c.pool, &event, &published).await?;
            Ok::<_, ClassifierError>(())
        }
        .await;
        if let Err(e) = outcome {
            self.retrying = Some((observation.event_id.clone(), decisions));
            return Err(retry(Box::new(e)));
        }
        metrics::counter!("gpumedic_classifier_events_total").increment(1);
        Ok(())
    }
}

/// Runs the classifier until SIGTERM/SIGINT or a failure.
pub async fn run(config: Config) -> Result<(), ShutdownError> {
    let api_pool = api::SharedPool::default();
    let mut service = Service::start_with_routes(NAME, &config.common, api::routes(api_pool.clone()));
    let db_ready = service.readiness.register("database");
    let token = service.shutdown.token();
    let setup = async {
        let pool = connect_and_migrate(&config.database_url, config.database_pool).await?;
        let since = chrono::Utc::now() - chrono::Duration::from_std(config.rebuild_window).unwrap_or_default();
        let history = store::events_since(&pool, since).await?;
        let observations: Vec<_> = history.iter().map(observe::observation).collect();
        let engine = Engine::rebuild(config.rules.clone(), observations.iter());
        tracing::info!(
            events = observations.len(),
            open_incidents = engine.open_incidents().len(),
            "Incident state rebuilt."
        );
        let producer = config.kafka.producer(NAME)?;
        Ok::<_, ClassifierError>(Classifier { engine, pool, producer })
    };
    let classifier = match setup.await {
        Ok(c) => Arc::new(Mutex::new(c)),
        Err(e) => {
            tracing::error!(error = %e, "Cannot start the classifier.");
            return Err(ShutdownError::TaskFailed { task: "setup".into(), source: Box::new(e) });
        }
    };
    let pool = classifier.lock().await.pool.clone();
    let _ = api_pool.set(pool.clone());
    service
        .shutdown
        .spawn("database", postgres::watch_reachability(pool, db_ready, Duration::from_secs(10), token.clone()));
    service.shutdown.spawn("ticker", ticker(classifier.clone(), config.tick, token));
    service.spawn_consumer(
        config.kafka,
        config.group,
        vec![topics::HEALTH_ENRICHED, topics::ACTIONS],
        vec![topics::VERDICTS],
        topics::DEFAULT_PARTITIONS,
        Handler { classifier, retrying: None },
    );
    service.run().await
}

/// Evaluates time-based conditions every `every`, so a quiet period ends without a new event.
async fn ticker(
    classifier: Arc<Mutex<Classifier>>,
    every: Duration,
    token: tokio_util::sync::CancellationToken,
) -> Result<(), ClassifierError> {
    loop {
        tokio::select! {
            () = token.cancelled() => return Ok(()),
            () = tokio::time::sleep(every) => {}
        }
        let mut c = classifier.lock().await;
        let decisions = c.engine.tick(chrono::Utc::now().timestamp_micros());
        if decisions.is_empty() {
            continue;
        }
        // The engine already moved on, so retry from the decisions we hold until both writes
        // succeed (ids are deterministic: a repeat publish is deduplicated downstream).
        loop {
            match c.publish(decisions.clone(), None).await {
                Ok(published) => match store::record_decisions(&c.pool, &published).await {
                    Ok(()) => break,
                    Err(e) => tracing::warn!(error = %e, "Cannot record tick decisions; retrying."),
                },
                Err(e) => tracing::warn!(error = %e, "Cannot publish tick verdicts; retrying."),
            }
            tokio::select! {
                () = token.cancelled() => return Ok(()),
                () = tokio::time::sleep(Duration::from_secs(1)) => {}
            }
        }
    }
}
