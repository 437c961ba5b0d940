//! The classifier's configuration: its flags and environment variables ([`Args`]), validated
//! into a [`Config`] with every problem listed at once.

use std::path::PathBuf;
use std::time::Duration;

use clap::Parser;
use gpumedic_runtime::config::{CommonArgs, CommonConfig, Problems, Validate, parse_duration};
use gpumedic_runtime::kafka::BatchSettings;
use gpumedic_runtime::postgres;
use gpumedic_runtime::stage::{BatchArgs, StageArgs, StageDefaults, StageSettings};
use gpumedic_schemas::topics;

use crate::rules::{self, RuleSet, SyntheticPolicy};
use crate::{auth, lemons, workload};

/// The defaults of the classifier's stage flags.
#[derive(Debug, Clone)]
pub struct Defaults;

impl StageDefaults for Defaults {
    const GROUP: &'static str = "gpumedic-classifier";
    const BATCH_MAX: &'static str = "5000";
    // No wait for more: a batch is what has been fetched when the last one is done, so it grows
    // with the load by itself, and a fault at a quiet moment is not held (docs/pipeline.md).
    const BATCH_LINGER: &'static str = "0ms";
    const MAX_BATCH_LINGER: Duration = Duration::from_secs(10);
    const LINGER_DELAYS: &'static str = "every verdict";
}

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
    stage: StageArgs<Defaults>,
    #[command(flatten)]
    batch: BatchArgs<Defaults>,
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
    #[command(flatten)]
    api_auth: gpumedic_runtime::api_auth::ApiAuthArgs,
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
    /// A batch is written as this many statements at once, split by node, each on its own
    /// connection: Postgres runs one backend per statement, so one statement uses one core of
    /// the database (docs/profiles.md). At most --database-pool. A batch of at most 1,000 records
    /// is one statement (one commit).
    #[arg(long, env = "GPUMEDIC_WRITE_PARALLELISM", default_value_t = 2)]
    write_parallelism: usize,
    /// Which health events are recorded in Postgres: `evidence` (what incident history and a
    /// rebuild need, plus rollups of the healthy telemetry; docs/incident-history.md) or `all`
    /// (every event).
    #[arg(long, env = "GPUMEDIC_PERSIST", default_value = "evidence")]
    persist: String,
    /// The span of each rollup of healthy telemetry under `--persist evidence`: whole minutes
    /// from 1m to 1h that divide an hour. The collector sends a heartbeat per GPU a minute, so
    /// `1m` makes about a row per heartbeat.
    #[arg(long, env = "GPUMEDIC_ROLLUP_PERIOD", default_value = crate::persist::DEFAULT_ROLLUP_PERIOD)]
    rollup_period: String,
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
    /// Hardware-class incidents of one node or GPU within --lemon-window that make it a lemon:
    /// taken out for good, with `replace_node` or `contact_support` (docs/decisions.md); 0 turns
    /// lemons off.
    #[arg(long, env = "GPUMEDIC_LEMON_INCIDENTS", default_value_t = 3)]
    lemon_incidents: usize,
    /// How far back hardware-class incidents count towards a lemon.
    #[arg(long, env = "GPUMEDIC_LEMON_WINDOW", default_value = "30d")]
    lemon_window: String,
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
    /// Kafka settings and the consumer group.
    pub stage: StageSettings,
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
    /// Which health events are recorded.
    pub persist: crate::persist::Policy,
    /// The span of each rollup.
    pub rollup_period: Duration,
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
    /// When a node or GPU is a lemon.
    pub lemons: lemons::Settings,
}

impl Validate for Args {
    type Valid = Config;

    fn validate(self) -> Result<Config, Problems> {
        let mut p = Problems::default();
        let common = self.common.validate().map_err(|e| p.extend(e)).ok();
        let stage = self.stage.validate().map_err(|e| p.extend(e)).ok();
        let batch = self.batch.validate().map_err(|e| p.extend(e)).ok();
        postgres::check_database_flags(&mut p, &self.database_url, self.database_pool);
        postgres::check_pool(&mut p, "--api-database-pool", self.api_database_pool);
        // With no valid pool, that problem is the one to fix first.
        if self.write_parallelism == 0
            || (self.database_pool > 0 && self.write_parallelism > self.database_pool as usize)
        {
            p.push(
                "--write-parallelism",
                format!("{} is not from 1 to --database-pool ({})", self.write_parallelism, self.database_pool),
            );
        }
        let api_auth = self.api_auth.settings(&mut p);
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
        let lemon_window = p.check("--lemon-window", parse_duration(&self.lemon_window));
        if lemon_window.is_some_and(|w| w.is_zero() || w > Duration::from_secs(366 * 86_400)) {
            p.push("--lemon-window", "must be more than 0 and at most 366d");
        }
        if self.lemon_incidents == 1 {
            p.push("--lemon-incidents", "must be 0 (off) or at least 2 (one fault is a fault, not a pattern)");
        }
        let clock_skew_allowance = p.check("--clock-skew-allowance", parse_duration(&self.clock_skew_allowance));
        if clock_skew_allowance.is_some_and(|d| d > Duration::from_secs(86_400)) {
            p.push(
                "--clock-skew-allowance",
                "must be at most 1d (it bounds how far one event can move a node's clock)",
            );
        }
        let persist = p.check("--persist", crate::persist::Policy::parse(&self.persist));
        let rollup_period = p.check("--rollup-period", parse_duration(&self.rollup_period));
        if let Some(Err(e)) = rollup_period.map(crate::persist::check_rollup_period) {
            p.push("--rollup-period", e);
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
                stage: stage.expect("checked"),
                database_url: self.database_url,
                database_pool: self.database_pool,
                api_database_pool: self.api_database_pool,
                api_auth: api_auth.expect("checked"),
                write_parallelism: self.write_parallelism,
                persist: persist.expect("checked"),
                rollup_period: rollup_period.expect("checked"),
                rules: if self.allow_synthetic { rules.with_synthetic(SyntheticPolicy::Allowed) } else { rules },
                rebuild_window: rebuild_window.expect("checked"),
                tick: tick.expect("checked"),
                batch: batch.expect("checked"),
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
                lemons: lemons::Settings {
                    min_incidents: self.lemon_incidents,
                    window: lemon_window.expect("checked"),
                },
            }
        })
    }
}
