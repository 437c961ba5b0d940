//! The classifier: applies runbook rules to enriched health events per node and GPU, records every
//! event, incident, verdict and action in Postgres (its sole writer), and publishes verdicts on
//! `gpumedic.verdicts.v1`.
//!
//! This crate holds the service frame: configuration, the database and its migrations, the
//! consumer group on the enriched and action topics, and readiness. Until the rules are deployed,
//! records are dead-lettered with that reason (nothing is lost; they can be replayed).

pub mod rules;

use std::time::Duration;

use clap::Parser;
use gpumedic_runtime::config::{CommonArgs, CommonConfig, Problems, Validate};
use gpumedic_runtime::kafka::{DeadLetterAll, KafkaArgs, KafkaSettings};
use gpumedic_runtime::postgres;
use gpumedic_runtime::service::Service;
use gpumedic_runtime::shutdown::ShutdownError;
use gpumedic_schemas::topics;

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
        p.finish(|| Config {
            common: common.expect("checked"),
            kafka: kafka.expect("checked"),
            group: self.group,
            database_url: self.database_url,
            database_pool: self.database_pool,
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
}

/// Connects to the database and brings its schema up to date.
pub async fn connect_and_migrate(url: &str, pool_size: u32) -> Result<sqlx::PgPool, ClassifierError> {
    let pool = postgres::connect(url, pool_size).await?;
    MIGRATOR.run(&pool).await?;
    tracing::info!("Database schema is up to date.");
    Ok(pool)
}

/// Runs the classifier until SIGTERM/SIGINT or a failure.
pub async fn run(config: Config) -> Result<(), ShutdownError> {
    let mut service = Service::start(NAME, &config.common);
    let db_ready = service.readiness.register("database");
    let token = service.shutdown.token();
    let (url, pool_size) = (config.database_url.clone(), config.database_pool);
    service.shutdown.spawn("database", async move {
        let pool = connect_and_migrate(&url, pool_size).await?;
        postgres::watch_reachability(pool, db_ready, Duration::from_secs(10), token).await?;
        Ok::<_, ClassifierError>(())
    });
    service.spawn_consumer(
        config.kafka,
        config.group,
        vec![topics::HEALTH_ENRICHED, topics::ACTIONS],
        vec![topics::VERDICTS],
        topics::DEFAULT_PARTITIONS,
        DeadLetterAll {
            reason: format!("gpumedic-classifier {} does not classify events yet", env!("CARGO_PKG_VERSION")),
        },
    );
    service.run().await
}
