//! `gpumedic replay`: read a topic over a time range (or a file exported from one) and either
//! export it, re-publish it, or backtest a rule set against it.
//!
//! - `export` writes the records (key, payload, headers, timestamp) to a file, so an incident's
//!   stream can be kept, shared and replayed after the topic's retention has passed.
//! - `republish` produces the records again, with their keys and headers, to a topic (the same one
//!   by default): downstream state is rebuilt, and every consumer deduplicates by event or verdict
//!   id, so a record seen before changes nothing.
//! - `backtest` runs enriched events through a rule set with no side effects (no Kafka writes, no
//!   Postgres, no Kubernetes) and prints how its verdicts differ from the recorded ones on the
//!   verdict topic.
//!
//! A backtest also prints the decision-quality summary of its decisions (quarantines, releases,
//! oscillations; `gpumedic_classifier::quality`), and with `--expect` judges them against the
//! expected outcomes of a decision-quality scenario file (docs/decisions.md).
//!
//! Ranges select records by their Kafka timestamp (the producer's create time), which is what
//! Kafka can seek by. The reader stops at the end offsets seen when it starts, so a busy topic does
//! not make a replay run forever.
//!
//! One room per concern: `args` (the flags), `source` (the range reader), `file` (the export
//! format), `republish`, `backtest` (the run, the comparison and the report) and `expect` (the
//! expected outcomes of `--expect`).

mod args;
mod backtest;
mod expect;
mod file;
mod republish;
mod source;

use anyhow::{Context as _, bail};
use gpumedic_runtime::config::{Validate as _, render_problems};

use args::Output;
pub use args::ReplayCommand;
use backtest::backtest;
use file::FileWriter;
use republish::republish;
use source::Source;

/// Runs a replay subcommand.
pub fn run(command: ReplayCommand) -> anyhow::Result<()> {
    match command {
        ReplayCommand::Export { input, out } => {
            let settings =
                input.kafka.clone().validate().map_err(|p| anyhow::anyhow!(render_problems("gpumedic replay", &p)))?;
            let source = Source::Topic { settings, topic: input.topic.clone(), range: input.range.resolve()? };
            let mut writer = FileWriter::create(&out)?;
            let count = source.for_each(|item| writer.write(&item))?;
            writer.finish()?;
            eprintln!("Exported {count} records to {}.", out.display());
            Ok(())
        }
        ReplayCommand::Republish { input, to_topic } => {
            let source = input.source()?;
            let target = match (&to_topic, &input.topic) {
                (Some(t), _) | (None, Some(t)) => t.clone(),
                (None, None) => bail!("--to-topic is required when the input is a file"),
            };
            let settings = input.settings()?.context("--kafka-bootstrap is required to republish")?;
            let count = republish(&settings, &target, source)?;
            eprintln!("Republished {count} records to {target}.");
            Ok(())
        }
        ReplayCommand::Backtest(args) => {
            let report = backtest(&args)?;
            match args.output {
                Output::Json => println!("{}", serde_json::to_string_pretty(&report)?),
                Output::Table => print!("{}", report.table(args.limit)),
            }
            Ok(())
        }
    }
}
