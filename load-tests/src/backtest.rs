//! `backtest`: how fast `gpumedic replay backtest` runs a topic of enriched events through the
//! default rule set, beside the raw Kafka consume rate of the same records measured in the same
//! run. The goal: 1,000,000 events backtested in under 20 s.
//!
//! 1. N enriched events (the fleet mix of [`crate::classify`]) are produced to a fresh topic.
//! 2. Kafka ceiling: a fresh consumer group reads them all, doing nothing with them.
//! 3. The release `gpumedic` binary next to this one runs `replay backtest --no-compare` over the
//!    topic; the figure is its whole wall time, process start and exit included, and its own
//!    report of the events it ran through the rules.

use std::time::{Duration, Instant};

use anyhow::{Context as _, bail};
use gpumedic_runtime::kafka::{KafkaSettings, TopicSpec};
use gpumedic_testkit as testkit;
use rdkafka::producer::{BaseRecord, Producer as _};

/// Options of the scenario.
#[derive(Debug, clap::Args)]
pub struct Options {
    /// How many enriched events.
    #[arg(long, default_value_t = 1_000_000)]
    events: usize,
    /// Nodes in the simulated fleet (8 GPUs each).
    #[arg(long, default_value_t = 1000)]
    nodes: usize,
    /// Partitions of the scratch topic.
    #[arg(long, default_value_t = 12)]
    partitions: i32,
    /// The gpumedic CLI; by default the one built next to this program.
    #[arg(long)]
    gpumedic_bin: Option<std::path::PathBuf>,
}

/// The JSON result.
#[derive(Debug, serde::Serialize)]
pub struct Result {
    scenario: &'static str,
    events: usize,
    nodes: usize,
    partitions: i32,
    kafka_consume_per_sec: f64,
    backtest_wall_seconds: f64,
    backtest_per_sec: f64,
    backtest_report_seconds: f64,
    backtest_verdicts: u64,
}

/// Runs the scenario and prints one line per figure.
pub async fn run(o: Options) -> anyhow::Result<Result> {
    let bootstrap = testkit::require_kafka().await?;
    let settings =
        KafkaSettings { bootstrap: bootstrap.clone(), options: vec![], schema_registry: None, topic_replication: None };
    let topic = testkit::unique_name("bench-backtest");
    settings.ensure_topics(&[TopicSpec::new(&topic, o.partitions)]).await?;
    let bin = match &o.gpumedic_bin {
        Some(b) => b.clone(),
        None => std::env::current_exe()?.with_file_name("gpumedic"),
    };
    anyhow::ensure!(bin.is_file(), "{} is missing: `cargo build --release -p gpumedic`", bin.display());

    // Event times spread over the last hours, 10 µs apart, as a fleet's stream would be.
    let base = chrono::Utc::now() - chrono::Duration::hours(2);
    let producer = crate::scratch_producer(&bootstrap)?;
    let mut buffer = Vec::with_capacity(1024);
    for e in crate::fleet::Enriched::new(o.nodes, base, chrono::Duration::microseconds(10))?.take(o.events) {
        buffer.clear();
        gpumedic_schemas::framing::encode_into(&e, &mut buffer)?;
        crate::send(&producer, BaseRecord::to(&topic).key(e.event.node.as_str()).payload(buffer.as_slice()))?;
    }
    producer.flush(Duration::from_secs(300)).context("flush")?;
    println!("backtest: {} enriched events on {} partitions ({} nodes)", o.events, o.partitions, o.nodes);

    // The raw Kafka consume rate of the same records.
    let kafka_per_sec = crate::raw_consume_rate(&settings, &topic, o.events).await?;
    println!("  kafka consume (raw):           {kafka_per_sec:>9.0} events/s");

    let start = Instant::now();
    let out = tokio::process::Command::new(&bin)
        .args(["replay", "backtest", "--kafka-bootstrap", &bootstrap, "--topic", &topic, "--no-compare"])
        .args(["--output", "json"])
        .output()
        .await
        .with_context(|| format!("running {}", bin.display()))?;
    let wall = start.elapsed().as_secs_f64();
    if !out.status.success() {
        bail!("gpumedic replay backtest failed: {}", String::from_utf8_lossy(&out.stderr));
    }
    let report: serde_json::Value = serde_json::from_slice(&out.stdout).context("the backtest's JSON report")?;
    let seen = report["events"].as_u64().unwrap_or(0);
    anyhow::ensure!(seen == o.events as u64, "the backtest saw {seen} events, {} were produced", o.events);
    let result = Result {
        scenario: "backtest",
        events: o.events,
        nodes: o.nodes,
        partitions: o.partitions,
        kafka_consume_per_sec: kafka_per_sec,
        backtest_wall_seconds: wall,
        backtest_per_sec: o.events as f64 / wall,
        backtest_report_seconds: report["seconds"].as_f64().unwrap_or(0.0),
        backtest_verdicts: report["backtest_verdicts"].as_u64().unwrap_or(0),
    };
    println!(
        "  gpumedic replay backtest:      {:>9.0} events/s ({} events in {:.2} s wall, goal under 20 s for 1,000,000; {} verdicts)",
        result.backtest_per_sec, o.events, wall, result.backtest_verdicts
    );
    Ok(result)
}
