//! The classifier: applies runbook rules to enriched health events per node and GPU, records every
//! event, incident, verdict and action in Postgres (its sole writer), and publishes verdicts on
//! `gpumedic.verdicts.v1`, keyed by node.
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

pub mod api;
pub mod auth;
pub mod nvlink;
pub mod observe;
pub mod quality;
pub mod reload;
pub mod retention;
pub mod rules;
pub mod store;
pub mod workload;

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use clap::Parser;
use gpumedic_runtime::BoxError;
use gpumedic_runtime::config::{CommonArgs, CommonConfig, Problems, Validate, parse_duration};
use gpumedic_runtime::kafka::{
    self, BatchHandler, BatchSettings, Disposition, Envelope, KafkaArgs, KafkaSettings, Producer, Record,
    record_headers,
};
use gpumedic_runtime::postgres;
use gpumedic_runtime::service::Service;
use gpumedic_runtime::shutdown::ShutdownError;
use gpumedic_schemas::{ActionOutcome, Codec, EnrichedHealthEvent, Record as _, Verdict, topics};
use tokio::sync::Mutex;

use crate::rules::engine::{Absorbed, Decision, Engine};
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
    #[command(flatten)]
    batch_limits: kafka::BatchLimitArgs,
    /// Kafka consumer group shared by all classifier replicas.
    #[arg(long, env = "GPUMEDIC_GROUP", default_value = "gpumedic-classifier")]
    group: String,
    /// PostgreSQL URL (postgres://user:password@host:port/database).
    #[arg(long, env = "GPUMEDIC_DATABASE_URL")]
    database_url: String,
    /// Connections in the database pool.
    #[arg(long, env = "GPUMEDIC_DATABASE_POOL", default_value_t = 8)]
    database_pool: u32,
    /// Connections of the incident API's own pool: read-only, with a statement timeout, so a
    /// heavy query never takes a connection the classifier writes with.
    #[arg(long, env = "GPUMEDIC_API_DATABASE_POOL", default_value_t = 2)]
    api_database_pool: u32,
    /// How the incident API (`/api/`) authenticates requests: `kubernetes` (a bearer token,
    /// checked with a TokenReview, whose user needs `get`/`list` on `incidents.gpumedic.io` by a
    /// SubjectAccessReview) or `none` (anyone who reaches the admin port; local use only).
    #[arg(long, env = "GPUMEDIC_API_AUTH", default_value = "kubernetes")]
    api_auth: String,
    /// How long the incident API reuses a decision about a token (allowed or refused), so a
    /// dashboard that polls does not review its token on every request. A revoked grant keeps
    /// working this long; `0s` reviews every request.
    #[arg(long, env = "GPUMEDIC_API_AUTH_CACHE_TTL", default_value = "10s")]
    api_auth_cache_ttl: String,
    /// At most this many decisions about tokens are kept.
    #[arg(long, env = "GPUMEDIC_API_AUTH_CACHE_SIZE", default_value_t = 1024)]
    api_auth_cache_size: usize,
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
    /// At most this many records are classified and written to Postgres together. Batches fill
    /// only under backlog (see --batch-linger); larger ones cost fewer round trips per event
    /// (docs/benchmarks.md).
    #[arg(long, env = "GPUMEDIC_BATCH_MAX", default_value_t = 5000)]
    batch_max: usize,
    /// How long a batch waits for more records after its first one (a latency cap when quiet).
    #[arg(long, env = "GPUMEDIC_BATCH_LINGER", default_value = "5ms")]
    batch_linger: String,
    /// A batch is written as this many statements at once, split by node, each on its own
    /// connection: Postgres runs one backend per statement, so one statement uses one core of
    /// the database (docs/profiles.md). At most --database-pool.
    #[arg(long, env = "GPUMEDIC_WRITE_PARALLELISM", default_value_t = 2)]
    write_parallelism: usize,
    /// How long recorded health events are kept; older daily partitions are dropped hourly.
    /// Incidents, verdicts and actions are kept.
    #[arg(long, env = "GPUMEDIC_EVENT_RETENTION", default_value = "30d")]
    event_retention: String,
    /// How often the rule files of --rules-dir are checked for changes (and reloaded when valid).
    #[arg(long, env = "GPUMEDIC_RULES_POLL", default_value = "2s")]
    rules_poll: String,
    /// The topic of enriched health events to classify.
    #[arg(long, env = "GPUMEDIC_ENRICHED_TOPIC", default_value = topics::HEALTH_ENRICHED)]
    enriched_topic: String,
    /// The topic verdicts are published on.
    #[arg(long, env = "GPUMEDIC_VERDICTS_TOPIC", default_value = topics::VERDICTS)]
    verdicts_topic: String,
    /// The topic of the remediator's action outcomes, recorded in Postgres.
    #[arg(long, env = "GPUMEDIC_ACTIONS_TOPIC", default_value = topics::ACTIONS)]
    actions_topic: String,
    /// How long before a cloud maintenance window opens its action may start; replaces the lead
    /// of every rule's `not_before` (the default rules use 1h).
    #[arg(long, env = "GPUMEDIC_MAINTENANCE_LEAD")]
    maintenance_lead: Option<String>,
    /// Caps every rule's quiet period (e.g. `20s` for a demo or a test); the proofs of repair
    /// still apply. Unset in production: the rules' own periods hold.
    #[arg(long, env = "GPUMEDIC_MAX_QUIET")]
    max_quiet: Option<String>,
    /// Application-class Xids (13, 31, 43, ...) of one workload on several nodes at most this far
    /// apart are one workload fault: recorded once, published as a verdict naming the workload,
    /// and no node action (docs/decisions.md).
    #[arg(long, env = "GPUMEDIC_WORKLOAD_FAULT_WINDOW", default_value = "2m")]
    workload_fault_window: String,
    /// How many distinct nodes make a workload fault.
    #[arg(long, env = "GPUMEDIC_WORKLOAD_FAULT_MIN_NODES", default_value_t = 2)]
    workload_fault_min_nodes: usize,
    /// How far an event's observed_at may be after the Kafka timestamp of the record carrying it
    /// (clocks a little apart); later is clamped to the record's time, counted and logged, so one
    /// bad node clock cannot move that node's engine clock forward for good.
    #[arg(long, env = "GPUMEDIC_CLOCK_SKEW_ALLOWANCE", default_value = "5m")]
    clock_skew_allowance: String,
}

/// The classifier's topics. Fixed in production (the defaults); tests and benchmarks give each
/// run its own.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Topics {
    /// Enriched health events in.
    pub enriched: String,
    /// Verdicts out.
    pub verdicts: String,
    /// Action outcomes in.
    pub actions: String,
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
    /// Connections in the incident API's read-only pool.
    pub api_database_pool: u32,
    /// How the incident API authenticates requests.
    pub api_auth: auth::Settings,
    /// Statements a batch is written as, at once.
    pub write_parallelism: usize,
    /// The rules.
    pub rules: RuleSet,
    /// How far back to rebuild.
    pub rebuild_window: Duration,
    /// The tick interval.
    pub tick: Duration,
    /// How records are batched.
    pub batch: BatchSettings,
    /// How long events are kept.
    pub event_retention: Duration,
    /// Where the rules came from, when from files: watched and reloaded.
    pub rules_dir: Option<PathBuf>,
    /// Whether synthetic events are acted on (kept across reloads).
    pub allow_synthetic: bool,
    /// How often the rule files are checked.
    pub rules_poll: Duration,
    /// The topics.
    pub topics: Topics,
    /// When application Xids across nodes are a workload fault.
    pub workload_faults: workload::Settings,
    /// How far an event's observed_at may be after its record's Kafka timestamp.
    pub clock_skew_allowance: Duration,
}

impl Validate for Args {
    type Valid = Config;

    fn validate(self) -> Result<Config, Problems> {
        let mut p = Problems::default();
        let common = self.common.validate().map_err(|e| p.extend(e)).ok();
        let kafka = self.kafka.validate().map_err(|e| p.extend(e)).ok();
        let batch_limits = self.batch_limits.validate().map_err(|e| p.extend(e)).ok();
        if self.group.trim().is_empty() {
            p.push("--group", "the consumer group must not be empty");
        }
        if !(self.database_url.starts_with("postgres://") || self.database_url.starts_with("postgresql://")) {
            p.push("--database-url", "must be a postgres:// URL");
        }
        if self.database_pool == 0 {
            p.push("--database-pool", "must be at least 1");
        }
        if self.api_database_pool == 0 {
            p.push("--api-database-pool", "must be at least 1");
        }
        // With no valid pool, that problem is the one to fix first.
        if self.write_parallelism == 0
            || (self.database_pool > 0 && self.write_parallelism > self.database_pool as usize)
        {
            p.push(
                "--write-parallelism",
                format!("{} is not from 1 to --database-pool ({})", self.write_parallelism, self.database_pool),
            );
        }
        let api_auth = p.check("--api-auth", auth::Mode::parse(&self.api_auth));
        let api_auth_cache_ttl = p.check("--api-auth-cache-ttl", parse_duration(&self.api_auth_cache_ttl));
        if api_auth_cache_ttl.is_some_and(|t| t > Duration::from_secs(300)) {
            p.push("--api-auth-cache-ttl", "must be at most 5m (a revoked grant keeps working that long)");
        }
        if !(1..=100_000).contains(&self.api_auth_cache_size) {
            p.push("--api-auth-cache-size", format!("{} is not from 1 to 100000", self.api_auth_cache_size));
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
        if !(1..=100_000).contains(&self.batch_max) {
            p.push("--batch-max", format!("{} is not from 1 to 100000", self.batch_max));
        }
        let linger = p.check("--batch-linger", parse_duration(&self.batch_linger));
        if linger.is_some_and(|l| l > Duration::from_secs(10)) {
            p.push("--batch-linger", "must be at most 10s (it delays every verdict)");
        }
        let retention = p.check("--event-retention", parse_duration(&self.event_retention));
        if let Some(r) = retention {
            if r < Duration::from_secs(86_400) {
                p.push("--event-retention", "must be at least 1d (events are dropped a day at a time)");
            } else if rebuild_window.is_some_and(|w| r < w) {
                p.push("--event-retention", "must be at least --rebuild-window (the rebuild reads those events)");
            }
        }
        let lead = self.maintenance_lead.as_deref().and_then(|l| p.check("--maintenance-lead", parse_duration(l)));
        if lead.is_some_and(|l| l > Duration::from_secs(7 * 86_400)) {
            p.push("--maintenance-lead", "must be at most 7d (providers announce windows days ahead, not weeks)");
        }
        let max_quiet = self.max_quiet.as_deref().and_then(|q| p.check("--max-quiet", parse_duration(q)));
        let workload_window = p.check("--workload-fault-window", parse_duration(&self.workload_fault_window));
        if workload_window.is_some_and(|w| w.is_zero() || w > Duration::from_secs(86_400)) {
            p.push("--workload-fault-window", "must be more than 0 and at most 1d (a job fails within seconds)");
        }
        if self.workload_fault_min_nodes < 2 {
            p.push("--workload-fault-min-nodes", "must be at least 2 (one node's errors are that node's)");
        }
        let clock_skew_allowance = p.check("--clock-skew-allowance", parse_duration(&self.clock_skew_allowance));
        if clock_skew_allowance.is_some_and(|d| d > Duration::from_secs(86_400)) {
            p.push(
                "--clock-skew-allowance",
                "must be at most 1d (it bounds how far one event can move a node's clock)",
            );
        }
        let rules_poll = p.check("--rules-poll", parse_duration(&self.rules_poll));
        if rules_poll.is_some_and(|d| d.is_zero()) {
            p.push("--rules-poll", "must be more than 0");
        }
        for (flag, topic) in [
            ("--enriched-topic", &self.enriched_topic),
            ("--verdicts-topic", &self.verdicts_topic),
            ("--actions-topic", &self.actions_topic),
        ] {
            if topic.is_empty()
                || topic.len() > 249
                || !topic.chars().all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-'))
            {
                p.push(flag, format!("'{topic}' is not a Kafka topic name ([a-zA-Z0-9._-], 1 to 249 characters)"));
            }
        }
        if self.enriched_topic == self.verdicts_topic
            || self.enriched_topic == self.actions_topic
            || self.verdicts_topic == self.actions_topic
        {
            p.push("--enriched-topic", "the enriched, verdicts and actions topics must differ");
        }
        p.finish(|| {
            let mut rules = rules.expect("checked");
            let interval = |d: Duration| rules::Interval(d.as_micros().try_into().unwrap_or(i64::MAX));
            if let Some(lead) = lead {
                rules = rules.with_lead(interval(lead));
            }
            if let Some(quiet) = max_quiet {
                rules = rules.with_max_quiet(interval(quiet));
            }
            Config {
                common: common.expect("checked"),
                kafka: kafka.expect("checked"),
                group: self.group,
                database_url: self.database_url,
                database_pool: self.database_pool,
                api_database_pool: self.api_database_pool,
                api_auth: auth::Settings {
                    mode: api_auth.expect("checked"),
                    cache_ttl: api_auth_cache_ttl.expect("checked"),
                    cache_size: self.api_auth_cache_size,
                },
                write_parallelism: self.write_parallelism,
                rules: if self.allow_synthetic { rules.with_synthetic(SyntheticPolicy::Allowed) } else { rules },
                rebuild_window: rebuild_window.expect("checked"),
                tick: tick.expect("checked"),
                batch: BatchSettings {
                    max: self.batch_max,
                    linger: linger.expect("checked"),
                    limits: batch_limits.expect("checked"),
                },
                event_retention: retention.expect("checked"),
                rules_dir: self.rules_dir,
                allow_synthetic: self.allow_synthetic,
                rules_poll: rules_poll.expect("checked"),
                topics: Topics {
                    enriched: self.enriched_topic,
                    verdicts: self.verdicts_topic,
                    actions: self.actions_topic,
                },
                workload_faults: workload::Settings {
                    window: workload_window.expect("checked"),
                    min_nodes: self.workload_fault_min_nodes,
                    allow_synthetic: self.allow_synthetic,
                },
                clock_skew_allowance: clock_skew_allowance.expect("checked"),
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
    /// Which nodes this replica owns cannot be told (topic metadata unavailable).
    #[error("cannot tell which nodes this replica owns: {0}")]
    Ownership(String),
}

/// Connects to the database and brings its schema up to date.
pub async fn connect_and_migrate(url: &str, pool_size: u32) -> Result<sqlx::PgPool, ClassifierError> {
    // A batch statement carries thousands of rows with their JSON: at the default 4 MB of
    // work_mem Postgres spills it to temporary files (docs/profiles.md).
    let pool = postgres::connect_with_settings(url, pool_size, &[("work_mem", "64MB")]).await?;
    postgres::migrate(&pool, &MIGRATOR).await?;
    tracing::info!("Database schema is up to date.");
    Ok(pool)
}

/// Which partitions' nodes the engine holds.
#[derive(Debug, Default)]
struct Owned {
    /// The assignment generation the engine was last reconciled with.
    generation: Option<u64>,
    /// The partitions of the enriched topic it holds the nodes of.
    partitions: std::collections::BTreeSet<i32>,
}

/// The engine with its outputs, shared by the batch handler, the ticker and the rules watcher.
pub struct Classifier {
    engine: Engine,
    /// The consumer's partitions, kept current by the rebalance callbacks.
    assignment: kafka::Assignment,
    owned: Owned,
    enriched_topic: String,
    rebuild_window: Duration,
    pool: sqlx::PgPool,
    producer: Producer,
    verdicts_topic: String,
    codec: Arc<Codec>,
    /// Statements each batch is written as, at once.
    write_parallelism: usize,
    /// When application Xids across nodes are a workload fault.
    workload_faults: workload::Settings,
    /// How far an event's observed_at may be after its record's Kafka timestamp.
    clock_skew_allowance: Duration,
}

impl Classifier {
    /// Brings the engine's nodes in line with the assignment: forgets the nodes of partitions
    /// this replica no longer owns and rebuilds those of partitions it gained.
    async fn reconcile(&mut self) -> Result<(), ClassifierError> {
        let (generation, owned) = self.assignment.of(&self.enriched_topic);
        if self.owned.generation == Some(generation) {
            return Ok(());
        }
        let count = partition_count(&self.producer, &self.enriched_topic).await?;
        let owns = |node: &str| owned.contains(&kafka::partition_for(node.as_bytes(), count));
        let forgotten = self.engine.retain_nodes(owns);
        let gained: std::collections::BTreeSet<i32> = owned.difference(&self.owned.partitions).copied().collect();
        if !gained.is_empty() {
            let started = std::time::Instant::now();
            let since = chrono::Utc::now() - chrono::Duration::from_std(self.rebuild_window).unwrap_or_default();
            let nodes: Vec<String> = store::nodes_since(&self.pool, since)
                .await?
                .into_iter()
                .filter(|n| gained.contains(&kafka::partition_for(n.as_bytes(), count)))
                .collect();
            let (rebuilt, events) = store::rebuild(&self.pool, self.engine.rules().clone(), since, &nodes).await?;
            let open = rebuilt.open_incidents().len();
            self.engine.adopt(rebuilt);
            tracing::info!(partitions = ?gained, nodes = nodes.len(), events, open_incidents = open,
                seconds = started.elapsed().as_secs_f64(), "Rebuilt the state of the nodes of newly assigned partitions.");
            metrics::histogram!("gpumedic_classifier_rebuild_seconds").record(started.elapsed().as_secs_f64());
        }
        if forgotten > 0 {
            tracing::info!(nodes = forgotten, "Forgot the nodes of partitions another replica now owns.");
        }
        metrics::gauge!("gpumedic_classifier_owned_nodes").set(self.engine.node_count() as f64);
        self.owned = Owned { generation: Some(generation), partitions: owned };
        Ok(())
    }

    /// Publishes the verdicts for `decisions` all at once (each continuing the trace of the record
    /// that caused it) and waits for every acknowledgement; returns them with their decisions.
    async fn publish(
        &self,
        decisions: &[(Decision, Option<&[u8]>)],
    ) -> Result<Vec<(Decision, Verdict)>, kafka::KafkaError> {
        let out: Vec<(Decision, Verdict)> = decisions.iter().map(|(d, _)| (d.clone(), observe::verdict(d))).collect();
        let encoded: Vec<(Vec<u8>, String)> = out
            .iter()
            .map(|(_, v)| {
                let bytes = self.codec.encode(v).expect("verdicts built from decisions always encode");
                (bytes, v.verdict_id.to_string())
            })
            .collect();
        // Futures are first polled in order, so the records are queued in decision order, and
        // librdkafka (idempotent producer) keeps that order within each partition.
        let sends = out.iter().zip(&encoded).zip(decisions).map(|(((_, v), (bytes, id)), (_, trace))| {
            let envelope = Envelope {
                topic: &self.verdicts_topic,
                key: &v.node,
                id,
                content_type: Verdict::CONTENT_TYPE,
                incoming_trace: *trace,
            };
            kafka::publish_record(&self.producer, envelope, bytes)
        });
        futures::future::try_join_all(sends).await?;
        for (_, v) in &out {
            tracing::info!(node = %v.node, rule = %v.rule_id, severity = ?v.severity, action = ?v.action,
                recovery = v.recovery, verdict_id = %v.verdict_id, "Verdict published.");
            // The rule is a label: rules are few (the rules directory's), and a dashboard shows
            // which of them decide.
            metrics::counter!("gpumedic_classifier_verdicts_total", "rule" => v.rule_id.clone(),
                "severity" => format!("{:?}", v.severity).to_lowercase(), "recovery" => v.recovery.to_string())
            .increment(1);
        }
        Ok(out)
    }

    /// Records the batch's workload-fault sightings, one workload at a time, and publishes each
    /// fault they complete before committing it (see [`workload`]).
    async fn record_workload_faults(&self, sightings: Vec<workload::Sighting>) -> Result<(), ClassifierError> {
        for (name, sightings) in workload::by_workload(sightings) {
            let mut tx = self.pool.begin().await?;
            if let Some(fault) = workload::decide(&mut tx, &name, &sightings, &self.workload_faults).await? {
                let v = workload::verdict(&fault, chrono::Utc::now());
                let bytes = self.codec.encode(&v).expect("workload verdicts always encode");
                let id = v.verdict_id.to_string();
                let envelope = Envelope {
                    topic: &self.verdicts_topic,
                    key: &v.node,
                    id: &id,
                    content_type: Verdict::CONTENT_TYPE,
                    incoming_trace: None,
                };
                kafka::publish_record(&self.producer, envelope, &bytes).await?;
                tracing::warn!(workload = %fault.workload, nodes = fault.nodes.len(), gpus = fault.gpus, xids = ?fault.xids,
                    verdict_id = %v.verdict_id, "Workload fault: one job's application errors on several nodes; no node action.");
                metrics::counter!("gpumedic_classifier_workload_faults_total").increment(1);
            }
            tx.commit().await?;
        }
        Ok(())
    }
}

/// Where a batch's time goes: `decode` (Avro and the JSON kept in Postgres), `classify` (the
/// engine), `publish` (until every verdict is acknowledged), `write` (the Postgres round trip).
fn stage_seconds(stage: &'static str, from: std::time::Instant, to: std::time::Instant) {
    metrics::histogram!("gpumedic_classifier_batch_stage_seconds", "stage" => stage)
        .record(to.duration_since(from).as_secs_f64());
}

/// Identifies a batch by its first and last record and its length: the consumer loop offers a
/// failed batch again unchanged, so the same key means the same records.
type BatchKey = (String, i32, i64, String, i32, i64, usize);

fn batch_key(records: &[Record]) -> Option<BatchKey> {
    let (first, last) = (records.first()?, records.last()?);
    Some((
        first.topic.clone(),
        first.partition,
        first.offset,
        last.topic.clone(),
        last.partition,
        last.offset,
        records.len(),
    ))
}

/// A failed batch's key, its decisions with the index of the record behind each, and the
/// sympathetic events it absorbed.
type Retry = (BatchKey, Vec<(Decision, usize)>, Vec<Absorbed>);

/// The consumer's batch handler: enriched events into the engine and all of the batch into
/// Postgres at once; action outcomes into the record.
pub struct Handler {
    classifier: Arc<Mutex<Classifier>>,
    actions_topic: String,
    /// Decisions of the batch being retried, with the index of the record behind each, and the
    /// sympathetic events it absorbed: the engine has already taken its events in (and would
    /// ignore them a second time), so they must not be lost with a failed publish or write.
    retrying: Option<Retry>,
}

impl Handler {
    /// A handler over `classifier`, recording outcomes read from `actions_topic`.
    pub fn new(classifier: Arc<Mutex<Classifier>>, actions_topic: String) -> Self {
        Handler { classifier, actions_topic, retrying: None }
    }
}

impl BatchHandler for Handler {
    #[tracing::instrument(name = "classify_batch", skip_all, fields(records = records.len()))]
    async fn handle_batch(&mut self, records: &[Record]) -> Result<Vec<Disposition>, BoxError> {
        let started = std::time::Instant::now();
        let mut dispositions = vec![Disposition::Done; records.len()];
        let (codec, parts, workload_faults, skew) = {
            let c = self.classifier.lock().await;
            (c.codec.clone(), c.write_parallelism, c.workload_faults, c.clock_skew_allowance)
        };
        // One batch per concurrent write; a node's rows all go to the same one.
        let mut batch = store::Batch::parts(parts, records.len());
        let mut observations = Vec::with_capacity(records.len());
        let mut sightings = Vec::new();
        for (i, record) in records.iter().enumerate() {
            let Some(payload) = record.payload.as_deref() else {
                dispositions[i] = Disposition::DeadLetter("empty record".into());
                continue;
            };
            if record.topic == self.actions_topic {
                match codec.decode::<ActionOutcome>(payload).await {
                    // Outcomes refer to verdicts of earlier batches, already written.
                    Ok(outcome) => batch[0].actions.push(&outcome),
                    // An unreachable schema registry: the whole batch waits and is retried.
                    Err(e) if e.is_transient() => return Err(Box::new(e)),
                    Err(e) => dispositions[i] = Disposition::DeadLetter(format!("{}: {e}", e.reason())),
                }
                continue;
            }
            match codec.decode::<EnrichedHealthEvent>(payload).await {
                Ok(mut event) => {
                    // Bounded before it is recorded, so the engine, Postgres and a rebuild from
                    // Postgres all see the same time.
                    if let Some(at) = observe::bounded_observed_at(event.event.observed_at, record.timestamp_ms, skew) {
                        clock_skew_clamped(&event, at);
                        event.event.observed_at = at;
                    }
                    match batch[store::part_of(&event.event.node, parts)].events.push(&event) {
                        Ok(()) => {
                            sightings.extend(workload::sighting(&event, &workload_faults));
                            let key = (event.event.event_id, event.event.observed_at);
                            observations.push((i, key, observe::observation(&event)));
                        }
                        Err(e) => dispositions[i] = Disposition::DeadLetter(format!("cannot record the event: {e}")),
                    }
                }
                Err(e) if e.is_transient() => return Err(Box::new(e)),
                Err(e) => dispositions[i] = Disposition::DeadLetter(format!("{}: {e}", e.reason())),
            }
        }
        let key = batch_key(records);
        let c = &mut *self.classifier.lock().await;
        // Before any record of a newly assigned partition: that node's state comes first.
        c.reconcile().await?;
        let decoded = std::time::Instant::now();
        stage_seconds("decode", started, decoded);
        let (decisions, absorbed) = match self.retrying.take() {
            Some((k, decisions, absorbed)) if Some(&k) == key.as_ref() => (decisions, absorbed),
            _ => {
                // Only events new to Postgres are observed: one recorded there had its verdicts
                // published before it was written, however long ago (the engine's own memory of
                // ids is short). The insert skips them too; they count as duplicates below.
                let keys: Vec<_> = observations.iter().map(|(_, key, _)| *key).collect();
                let recorded = store::recorded(&c.pool, &keys).await.map_err(ClassifierError::from)?;
                let fresh: Vec<_> = observations.iter().filter(|(_, key, _)| !recorded.contains(key)).collect();
                // Root NVLink incidents of other nodes of a peer's domain, handed to the engine.
                let mut roots = nvlink::Roots::new(c.engine.rules());
                roots.load(&c.pool, fresh.iter().map(|(_, _, o)| o)).await.map_err(ClassifierError::from)?;
                let mut decisions = Vec::new();
                for (i, _, o) in fresh {
                    let made = c.engine.observe(&roots.attach(o));
                    roots.learn(&made);
                    decisions.extend(made.into_iter().map(|d| (d, *i)));
                }
                count_refused(&mut c.engine);
                let absorbed = c.engine.take_absorbed();
                nvlink::absorbed(&absorbed);
                (decisions, absorbed)
            }
        };
        for a in &absorbed {
            batch[store::part_of(&a.node, parts)].sympathetic.push(a);
        }
        let classified = std::time::Instant::now();
        stage_seconds("classify", decoded, classified);
        let outcome = async {
            let traced: Vec<(Decision, Option<&[u8]>)> =
                decisions.iter().map(|(d, i)| (d.clone(), records[*i].header(record_headers::TRACEPARENT))).collect();
            let published = c.publish(&traced).await?;
            let acknowledged = std::time::Instant::now();
            stage_seconds("publish", classified, acknowledged);
            let mut by_part: Vec<Vec<(Decision, Verdict)>> = vec![Vec::new(); parts];
            for (d, v) in published {
                by_part[store::part_of(&v.node, parts)].push((d, v));
            }
            for (b, published) in batch.iter_mut().zip(&by_part) {
                b.decisions = store::DecisionRows::new(published);
            }
            let written = store::write_parts(&c.pool, &batch).await?;
            // After the events are recorded: a failure here retries the batch, which writes
            // nothing twice.
            c.record_workload_faults(sightings).await?;
            stage_seconds("write", acknowledged, std::time::Instant::now());
            Ok::<_, ClassifierError>(written)
        }
        .await;
        match outcome {
            Ok(written) => {
                let events = batch.iter().map(|b| b.events.len() as u64).sum::<u64>();
                metrics::counter!("gpumedic_classifier_events_total").increment(events);
                metrics::counter!("gpumedic_classifier_duplicate_events_total")
                    .increment(events.saturating_sub(u64::try_from(written.new_events).unwrap_or(0)));
                Ok(dispositions)
            }
            Err(e) => {
                if let Some(key) = key {
                    self.retrying = Some((key, decisions, absorbed));
                }
                Err(Box::new(e))
            }
        }
    }
}

/// How many partitions `topic` has, from the broker's metadata.
async fn partition_count(producer: &Producer, topic: &str) -> Result<i32, ClassifierError> {
    use rdkafka::producer::Producer as _;
    let producer = producer.clone();
    let topic = topic.to_owned();
    let count = tokio::task::spawn_blocking(move || {
        producer
            .client()
            .fetch_metadata(Some(&topic), Duration::from_secs(10))
            .map(|m| m.topics().iter().find(|t| t.name() == topic).map_or(0, |t| t.partitions().len()))
    })
    .await
    .map_err(|e| ClassifierError::Ownership(e.to_string()))?
    .map_err(|e| ClassifierError::Ownership(e.to_string()))?;
    match i32::try_from(count) {
        Ok(n) if n > 0 => Ok(n),
        _ => Err(ClassifierError::Ownership("the enriched topic has no partitions yet".into())),
    }
}

/// Counts and logs an event whose observed_at was bounded by its record's timestamp.
fn clock_skew_clamped(event: &EnrichedHealthEvent, to: chrono::DateTime<chrono::Utc>) {
    metrics::counter!("gpumedic_classifier_clock_skew_clamped_total").increment(1);
    tracing::warn!(node = %event.event.node, event_id = %event.event.event_id, observed_at = %event.event.observed_at,
        record_time = %to, "An event said it happened after the record carrying it was written; it counts at the record's time.");
}

/// Counts and logs the observations the engine refused as impossible: never a fault, never
/// healthy evidence, but an operator wants to know a node sends them (a broken sensor, a collector
/// bug, a clock far off).
fn count_refused(engine: &mut Engine) {
    for r in engine.take_refused() {
        metrics::counter!("gpumedic_classifier_invalid_inputs_total", "reason" => r.reason.as_str()).increment(1);
        tracing::warn!(node = %r.node, event_id = %r.event_id, reason = %r.reason, "Refused an impossible observation before any rule.");
    }
}

/// Registers, at zero, the counters that only move on a rare event, so `/metrics` names them from
/// the start: dashboards and alerts find them, and `increase()` sees their first step.
fn register_metrics() {
    for reason in rules::sanity::Invalid::ALL {
        metrics::counter!("gpumedic_classifier_invalid_inputs_total", "reason" => reason.as_str()).increment(0);
    }
    metrics::counter!("gpumedic_classifier_workload_faults_total").increment(0);
    metrics::counter!("gpumedic_classifier_clock_skew_clamped_total").increment(0);
    for result in ["ok", "refused"] {
        metrics::counter!("gpumedic_classifier_rule_reloads_total", "result" => result).increment(0);
    }
}

/// Runs the classifier until SIGTERM/SIGINT or a failure.
pub async fn run(config: Config) -> Result<(), ShutdownError> {
    let api_pool = api::SharedPool::default();
    let access = auth::Access::start(&config.api_auth).await;
    let mut service = Service::start_with_routes(NAME, &config.common, api::routes(api_pool.clone(), access));
    register_metrics();
    let db_ready = service.readiness.register("database");
    let assigned = service.readiness.register("kafka-partitions-assigned");
    let token = service.shutdown.token();
    let assignment = kafka::Assignment::default();
    let setup = async {
        let pool = connect_and_migrate(&config.database_url, config.database_pool).await?;
        // Partitions for today and the days ahead exist before the first event is written.
        retention::maintain_logged(&pool, config.event_retention).await;
        // State is rebuilt per partition once the group assigns them (Classifier::reconcile).
        let engine = Engine::new(config.rules.clone());
        let producer = config.kafka.producer(NAME)?;
        let codec = config.kafka.codec().await?;
        Ok::<_, ClassifierError>(Classifier {
            engine,
            pool,
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
        })
    };
    let classifier = match setup.await {
        Ok(c) => Arc::new(Mutex::new(c)),
        Err(e) => {
            tracing::error!(error = %e, "Cannot start the classifier.");
            return Err(ShutdownError::TaskFailed { task: "setup".into(), source: Box::new(e) });
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
            return Err(ShutdownError::TaskFailed { task: "setup".into(), source: Box::new(e) });
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
    let Config { kafka: settings, group, topics: t, batch, .. } = config;
    let handler = Handler::new(classifier, t.actions.clone());
    service.shutdown.spawn("consumer", async move {
        let inputs = [t.enriched.as_str(), t.actions.as_str()];
        let specs = kafka::stage_topics(&inputs, &[t.verdicts.as_str()], topics::DEFAULT_PARTITIONS);
        if !kafka::wait_for_topics(&settings, &specs, &token).await {
            return Ok(());
        }
        let consumer = settings.consumer_tracking(NAME, &group, &inputs, assigned, assignment)?;
        let dlq = settings.producer(&format!("{NAME}-dlq"))?;
        kafka::run_batch_consumer(NAME, consumer, dlq, handler, batch, token).await
    });
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
        // Never a deadline for a node another replica owns now.
        if let Err(e) = c.reconcile().await {
            tracing::warn!(error = %e, "Cannot bring the engine in line with the partition assignment; not ticking.");
            continue;
        }
        let decisions: Vec<(Decision, Option<&[u8]>)> =
            c.engine.tick(chrono::Utc::now().timestamp_micros()).into_iter().map(|d| (d, None)).collect();
        if decisions.is_empty() {
            continue;
        }
        // The engine already moved on, so retry from the decisions we hold until both writes
        // succeed (ids are deterministic: a repeat publish is deduplicated downstream).
        loop {
            match c.publish(&decisions).await {
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

/// The engine's rules, for the rules watcher.
impl Classifier {
    fn replace_rules(&mut self, mut rules: RuleSet) {
        // The lead and the quiet cap are the service's settings, not the files': keep them.
        let current = self.engine.rules();
        rules.lead = current.lead;
        rules.max_quiet = current.max_quiet;
        self.engine.replace_rules(rules);
    }
}
