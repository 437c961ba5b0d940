//! The flags of `gpumedic replay` and how they become a [`Source`] of records.

use std::path::PathBuf;

use anyhow::{Context as _, bail};
use chrono::Utc;
use clap::{Args, Subcommand, ValueEnum};
use gpumedic_runtime::config::{Validate as _, render_problems};
use gpumedic_runtime::kafka::{KafkaArgs, KafkaSettings};
use gpumedic_schemas::topics;

use super::source::{Source, TimeRange, parse_time};

/// Flags of `gpumedic replay`.
#[derive(Debug, Subcommand)]
pub enum ReplayCommand {
    /// Write a topic's records over a range to a file (for `--file` inputs later).
    Export {
        #[command(flatten)]
        input: TopicInput,
        /// The file to write.
        #[arg(long)]
        out: PathBuf,
    },
    /// Produce a topic's records over a range (or a file's) again, keys and headers kept, to
    /// `--to-topic` (the source topic by default). Consumers deduplicate by id.
    Republish {
        #[command(flatten)]
        input: Input,
        /// Where to produce; the input topic when not given (required with `--file`).
        #[arg(long)]
        to_topic: Option<String>,
    },
    /// Run enriched events through a rule set with no side effects and print how the verdicts
    /// differ from those recorded on the verdict topic.
    Backtest(BacktestArgs),
}

/// A topic and a range of it.
#[derive(Debug, Clone, Args)]
pub struct TopicInput {
    #[command(flatten)]
    pub(super) kafka: KafkaArgs,
    /// The topic to read.
    #[arg(long)]
    pub(super) topic: String,
    #[command(flatten)]
    pub(super) range: RangeArgs,
}

/// A range by Kafka timestamp.
#[derive(Debug, Clone, Args)]
pub struct RangeArgs {
    /// First record time: RFC 3339 (`2026-11-30T02:00:00Z`) or an age (`90m`, `2h`, `7d` ago).
    /// The topic's start when not given.
    #[arg(long)]
    from: Option<String>,
    /// Last record time, same forms. The topic's end (when the replay starts) when not given.
    #[arg(long)]
    to: Option<String>,
}

/// A topic range, or a file written by `export`.
#[derive(Debug, Clone, Args)]
pub struct Input {
    /// Read this exported file instead of a topic.
    #[arg(long, conflicts_with = "topic")]
    file: Option<PathBuf>,
    /// Kafka bootstrap servers (host:port,...).
    #[arg(long, env = "GPUMEDIC_KAFKA_BOOTSTRAP")]
    kafka_bootstrap: Option<String>,
    /// Extra librdkafka properties as key=value.
    #[arg(long = "kafka-option", env = "GPUMEDIC_KAFKA_OPTIONS", value_delimiter = ',')]
    kafka_options: Vec<String>,
    /// The topic to read (with `--kafka-bootstrap`).
    #[arg(long)]
    pub(super) topic: Option<String>,
    #[command(flatten)]
    pub(super) range: RangeArgs,
}

/// Flags of `gpumedic replay backtest`.
#[derive(Debug, Args)]
pub struct BacktestArgs {
    #[command(flatten)]
    pub(super) input: Input,
    /// The recorded verdicts to compare with (read from the input range's start to the topic's
    /// end). Not read with `--no-compare`.
    #[arg(long, default_value = topics::VERDICTS)]
    pub(super) verdicts_topic: String,
    /// Only run the rules and print the verdicts they give, without comparing.
    #[arg(long)]
    pub(super) no_compare: bool,
    /// A rules directory (YAML files), as the classifier's `--rules-dir`; the built-in default rule
    /// set when not given.
    #[arg(long)]
    pub(super) rules_dir: Option<PathBuf>,
    /// Act on synthetic (injected) events, as a classifier started with `--allow-synthetic`.
    #[arg(long)]
    pub(super) allow_synthetic: bool,
    /// At most this many differences in the table (JSON output lists all).
    #[arg(long, default_value_t = 50)]
    pub(super) limit: usize,
    /// Table for humans, or JSON for scripts.
    #[arg(long, value_enum, default_value_t = Output::Table)]
    pub(super) output: Output,
    /// Judge the decisions against expected outcomes: a YAML file with `expect`, `checkpoints` and
    /// `oscillations` as a decision-quality scenario writes them (other keys are ignored, so a
    /// scenario file itself will do). Checkpoint times are RFC 3339 or an offset from the first
    /// event (`20m`).
    #[arg(long)]
    pub(super) expect: Option<PathBuf>,
}

/// Output format.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Output {
    /// Aligned text for humans.
    Table,
    /// One JSON document.
    Json,
}

impl RangeArgs {
    pub(super) fn resolve(&self) -> anyhow::Result<TimeRange> {
        let now = Utc::now();
        let parse = |flag: &str, v: &Option<String>| -> anyhow::Result<Option<i64>> {
            v.as_deref().map(|t| parse_time(t, now).with_context(|| format!("{flag} '{t}'"))).transpose()
        };
        let range = TimeRange { from_ms: parse("--from", &self.from)?, to_ms: parse("--to", &self.to)? };
        if let (Some(f), Some(t)) = (range.from_ms, range.to_ms)
            && f > t
        {
            bail!("--from is after --to");
        }
        Ok(range)
    }
}

impl Input {
    pub(super) fn settings(&self) -> anyhow::Result<Option<KafkaSettings>> {
        let Some(bootstrap) = &self.kafka_bootstrap else { return Ok(None) };
        let args = KafkaArgs {
            kafka_bootstrap: bootstrap.clone(),
            kafka_options: self.kafka_options.clone(),
            schema_registry_url: None,
            topic_replication: None,
        };
        Ok(Some(args.validate().map_err(|p| anyhow::anyhow!(render_problems("gpumedic replay", &p)))?))
    }

    pub(super) fn source(&self) -> anyhow::Result<Source> {
        match (&self.file, &self.topic) {
            (Some(path), _) => Ok(Source::File { path: path.clone(), range: self.range.resolve()? }),
            (None, Some(topic)) => {
                let settings = self.settings()?.context("--kafka-bootstrap is required to read a topic")?;
                Ok(Source::Topic { settings, topic: topic.clone(), range: self.range.resolve()? })
            }
            (None, None) => bail!("give --topic (with --kafka-bootstrap) or --file"),
        }
    }
}
