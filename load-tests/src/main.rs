//! gpumedic's load tests, run against the testbed's real servers.
//!
//! Each scenario prints a one-line summary and writes a JSON result:
//! - `kafka-ceiling`: the raw Kafka ceiling (produce and consume the same record size with no
//!   processing), the figure every pipeline throughput number is printed beside.
//! - `classify-throughput`: the classifier binary working through a pre-filled topic of enriched
//!   events into a fresh database, beside the raw Kafka consume rate and the raw Postgres insert
//!   rate of the same records, measured in the same run (see [`classify`]).
//! - `pipeline-throughput`: raw events from the simulated fleet through the enricher and
//!   classifier, beside the Kafka passthrough, with node authentication off and enforced (see
//!   [`pipeline`]); `--persist evidence|all` picks what the classifier records.
//! - `event-writes`: the classifier's event rows into PostgreSQL by its `UNNEST` insert and by
//!   binary `COPY`, on the same rows (see [`writes`]).
//! - `rollup-writes`: closed rollups of healthy telemetry into PostgreSQL by the batch statement's
//!   arrays and by binary `COPY`, new and merged, with the backend's CPU per rollup (see
//!   [`writes::run_rollups`]).
//! - `persist-policies`: the fleet's stream through the classifier's engine and batch write under
//!   `--persist all` and `evidence`: rows kept and bytes per row (see [`writes::run_policies`]).
//! - `latency`: fault to cordon through three services under background load (see [`latency`]).
//! - `fleet`: the simulated GPU fleet on its own: raw events as N nodes of 8 GPUs running the
//!   collector send them (an inventory first, readings on change, a heartbeat per GPU, kernel-log
//!   Xids by PCI bus id), at a rate, with a fault mix, into Kafka, and the fleet's Nodes and GPU
//!   pods in the apiserver (see [`fleet`]).
//! - `soak`: the pipeline for 30 minutes at 5,000 events per second from the simulated fleet,
//!   each service's RSS and consumer lag sampled; both must stay flat (see [`soak`]).
//! - `chaos`: the pipeline at 2,000 events per second on private servers while every service is
//!   SIGKILLed and Kafka, PostgreSQL and the apiserver are restarted or paused; proves by id that
//!   no event, incident or node action was lost or duplicated (see [`chaos`]).
//! - `scale-out`: the enricher and the classifier as R replicas each (`--replicas 1,2,4`) in one
//!   consumer group per service on 12-partition topics: events per second, speed-up over one
//!   replica, efficiency, CPU per event and each replica's share (see [`scale_out`]).
//! - `fleet-scale`: gpumedic at 10,000, 30,000 and 100,000 GPU nodes: each service's and each
//!   server's memory and CPU at each size under the fleet's steady stream and a burst, the
//!   enricher's start-up, the remediator's relists, fault to cordon beside the plain-patch floor
//!   (see [`scale`]).
//! - `backtest`: `gpumedic replay backtest` over a topic of enriched events, beside the raw Kafka
//!   consume rate of the same records (see [`backtest`]).
//! - `console`: the console's fleet, node list and node pages with 10,000 Nodes and 1,000,000
//!   incidents, beside a plain `SELECT` of the same rows (see [`console`]).

mod backtest;
mod chaos;
mod classify;
mod collectors;
mod console;
mod fleet;
mod latency;
mod pipeline;
mod procs;
mod remediation;
mod restart;
mod scale;
mod scale_out;
mod soak;
mod stages;
mod state_cost;
mod writes;

use std::time::{Duration, Instant};

use anyhow::Context as _;
use clap::{Parser, Subcommand};
use gpumedic_runtime::admin::Readiness;
use gpumedic_runtime::kafka::{KafkaSettings, TopicSpec};
use gpumedic_testkit as testkit;
use rdkafka::consumer::Consumer as _;
use rdkafka::producer::{BaseRecord, DefaultProducerContext, Producer as _, ThreadedProducer};

#[derive(Debug, Parser)]
#[command(name = "gpumedic-load-tests", about = "Load scenarios against the real servers of the testbed.")]
struct Cli {
    #[command(subcommand)]
    scenario: Scenario,
    /// Where to write the JSON result.
    #[arg(long, global = true, default_value = "target/load-tests")]
    out_dir: std::path::PathBuf,
}

#[derive(Debug, Subcommand)]
enum Scenario {
    /// Raw Kafka produce and consume rate for records of one size, no processing.
    KafkaCeiling {
        /// How many records.
        #[arg(long, default_value_t = 500_000)]
        records: usize,
        /// Bytes per record (a raw health event is about 300 bytes in Avro).
        #[arg(long, default_value_t = 300)]
        size: usize,
        /// Partitions of the scratch topic.
        #[arg(long, default_value_t = 12)]
        partitions: i32,
    },
    /// Events per second classified and persisted by the classifier binary, beside the raw Kafka
    /// consume rate and the raw Postgres insert rate of the same events.
    ClassifyThroughput(classify::Options),
    /// Events per second backtested by `gpumedic replay backtest`, beside the raw Kafka consume
    /// rate of the same events.
    Backtest(backtest::Options),
    /// Fault to cordon through the enricher, classifier and remediator, under background load.
    Latency(latency::Options),
    /// Raw events per second through the enricher and classifier, beside the Kafka passthrough,
    /// with node authentication off and enforced (`--node-auth`).
    PipelineThroughput(pipeline::Options),
    /// Event rows per second into PostgreSQL: the classifier's UNNEST insert against binary COPY.
    EventWrites(writes::Options),
    /// Closed rollups per second into PostgreSQL, and its CPU per rollup: arrays against COPY.
    RollupWrites(writes::RollupOptions),
    /// What `--persist all` and `--persist evidence` record of the fleet's stream, and its size.
    PersistPolicies(writes::PolicyOptions),
    /// The simulated GPU fleet on its own: raw events in the collector's shape at a rate with a
    /// fault mix into Kafka, and optionally its Nodes and GPU pods in the apiserver.
    Fleet(fleet::Options),
    /// gpumedic at fleet sizes up to 100,000 GPU nodes: memory and CPU of each service and server,
    /// the enricher's start-up, the remediator's relists and fault to cordon at each size.
    FleetScale(scale::Options),
    /// Internal to `fleet-scale`: the enricher's cache filled in a fresh process, its memory
    /// growth per node and per pod printed as JSON (a fresh process, so memory freed earlier in
    /// the run is not reused and hidden).
    #[command(hide = true)]
    CacheCost(scale::CacheCostArgs),
    /// The pipeline for a long run at a steady rate from the simulated fleet, memory and lag of each
    /// service sampled (runs on request: 30 minutes by default).
    Soak(soak::Options),
    /// The remediator against the apiserver: the floor (a plain node patch), mass quarantine and
    /// mass drain (see load-tests/src/remediation.rs).
    Remediation(remediation::Args),
    /// Render times of the console's pages with a large fleet and history, beside a plain SELECT
    /// of the same rows.
    Console(console::Options),
    /// The pipeline under faults on private servers (services killed, Kafka, PostgreSQL and the
    /// apiserver restarted, PostgreSQL paused), proven by id at the end; exits 1 when a proof fails.
    Chaos(chaos::Options),
    /// How long a classifier takes to rebuild its state from a day of fleet history in
    /// PostgreSQL, and its peak memory, beside the raw read rate of the same rows.
    ClassifierRestart(restart::Options),
    /// The memory of the classifier's decision state (its engine and keeper) per node as a fleet
    /// runs for hours, fed the fleet's stream in this process (no servers).
    ClassifierState(state_cost::Options),
    /// The enricher and the classifier as 1, 2 and 4 replicas each on 12-partition topics (Kafka
    /// consumer groups spread the partitions): events per second, speed-up and efficiency.
    ScaleOut(scale_out::Options),
}

#[derive(Debug, serde::Serialize)]
pub(crate) struct CeilingResult {
    scenario: &'static str,
    records: usize,
    record_bytes: usize,
    produce_per_sec: f64,
    consume_per_sec: f64,
    produce_mib_per_sec: f64,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    match cli.scenario {
        Scenario::KafkaCeiling { records, size, partitions } => {
            let result = kafka_ceiling(records, size, partitions).await?;
            println!(
                "kafka-ceiling: {} records of {} B: produce {:.0}/s ({:.1} MiB/s), consume {:.0}/s",
                result.records,
                result.record_bytes,
                result.produce_per_sec,
                result.produce_mib_per_sec,
                result.consume_per_sec
            );
            write_result(&cli.out_dir, "kafka-ceiling.json", &result)?;
        }
        Scenario::ClassifyThroughput(options) => {
            let result = classify::run(options).await?;
            write_result(&cli.out_dir, "classify-throughput.json", &result)?;
        }
        Scenario::PipelineThroughput(options) => {
            let result = pipeline::run(options).await?;
            write_result(&cli.out_dir, "pipeline-throughput.json", &result)?;
        }
        Scenario::PersistPolicies(options) => {
            let result = writes::run_policies(options).await?;
            write_result(&cli.out_dir, "persist-policies.json", &result)?;
        }
        Scenario::RollupWrites(options) => {
            let result = writes::run_rollups(options).await?;
            write_result(&cli.out_dir, "rollup-writes.json", &result)?;
        }
        Scenario::EventWrites(options) => {
            let result = writes::run(options).await?;
            write_result(&cli.out_dir, "event-writes.json", &result)?;
        }
        Scenario::Latency(options) => {
            let result = latency::run(options).await?;
            write_result(&cli.out_dir, "latency.json", &result)?;
        }
        Scenario::Backtest(options) => {
            let result = backtest::run(options).await?;
            write_result(&cli.out_dir, "backtest.json", &result)?;
        }
        Scenario::Fleet(options) => {
            let result = fleet::run(options).await?;
            write_result(&cli.out_dir, "fleet.json", &result)?;
        }
        Scenario::FleetScale(options) => {
            let result = scale::run(options).await?;
            write_result(&cli.out_dir, "fleet-scale.json", &result)?;
        }
        Scenario::CacheCost(args) => println!("{}", serde_json::to_string(&scale::cache_cost(&args))?),
        Scenario::Soak(options) => {
            let result = soak::run(options).await?;
            write_result(&cli.out_dir, "soak.json", &result)?;
        }
        Scenario::ClassifierState(options) => {
            let result = state_cost::run(options)?;
            write_result(&cli.out_dir, "classifier-state.json", &result)?;
        }
        Scenario::ClassifierRestart(options) => {
            let result = restart::run(options).await?;
            write_result(&cli.out_dir, "classifier-restart.json", &result)?;
        }
        Scenario::ScaleOut(options) => {
            let result = scale_out::run(options).await?;
            write_result(&cli.out_dir, "scale-out.json", &result)?;
        }
        Scenario::Remediation(args) => remediation::run(args, &cli.out_dir).await?,
        Scenario::Console(options) => {
            let result = console::run(options).await?;
            write_result(&cli.out_dir, "console.json", &result)?;
        }
        Scenario::Chaos(options) => {
            let result = chaos::run(options).await?;
            write_result(&cli.out_dir, "chaos.json", &result)?;
            anyhow::ensure!(result.passed(), "chaos: a proof failed (see the figures above and chaos.json)");
        }
    }
    Ok(())
}

/// Writes a scenario's JSON result into `out_dir` and says where.
fn write_result(out_dir: &std::path::Path, name: &str, result: &impl serde::Serialize) -> anyhow::Result<()> {
    std::fs::create_dir_all(out_dir)?;
    let path = out_dir.join(name);
    std::fs::write(&path, serde_json::to_vec_pretty(result)?)?;
    println!("result written to {}", path.display());
    Ok(())
}

/// A duration flag (`500ms`, `30s`, `30m`).
pub(crate) fn duration(raw: &str) -> Result<Duration, String> {
    gpumedic_runtime::config::parse_duration(raw)
}

/// The producer scenarios fill their scratch topics with: the services' settings (idempotent,
/// `acks=all`, lz4), threaded, so the measurement is Kafka's, not an async runtime's.
pub(crate) fn scratch_producer(bootstrap: &str) -> anyhow::Result<ThreadedProducer<DefaultProducerContext>> {
    rdkafka::ClientConfig::new()
        .set("bootstrap.servers", bootstrap)
        .set("acks", "all")
        .set("enable.idempotence", "true")
        .set("linger.ms", "5")
        .set("compression.type", "lz4")
        .set("queue.buffering.max.messages", "1000000")
        .create()
        .context("producer")
}

/// A consumer for reading partitions it is assigned. librdkafka assigns partitions only with a
/// group; the consumer never joins it (no subscription) and is never dropped, so no close can
/// hold the run.
pub(crate) fn topic_reader(bootstrap: &str) -> anyhow::Result<&'static rdkafka::consumer::BaseConsumer> {
    let consumer: rdkafka::consumer::BaseConsumer = rdkafka::ClientConfig::new()
        .set("bootstrap.servers", bootstrap)
        .set("group.id", testkit::unique_name("load-tests-reader"))
        .set("enable.auto.commit", "false")
        .set("enable.partition.eof", "false")
        .create()?;
    Ok(Box::leak(Box::new(consumer)))
}

/// Each partition of `topic` with its low and high watermarks; none for a topic with no metadata.
pub(crate) fn watermarks(
    consumer: &rdkafka::consumer::BaseConsumer,
    topic: &str,
) -> anyhow::Result<Vec<(i32, i64, i64)>> {
    let timeout = Duration::from_secs(30);
    let metadata = consumer.fetch_metadata(Some(topic), timeout)?;
    let Some(t) = metadata.topics().iter().find(|t| t.name() == topic) else { return Ok(vec![]) };
    t.partitions()
        .iter()
        .map(|p| {
            let (low, high) = consumer.fetch_watermarks(topic, p.id(), timeout)?;
            Ok((p.id(), low, high))
        })
        .collect()
}

/// Reads every record of `ranges` (topic, partition, first offset, end offset: the next after the
/// last) with `consumer`, handing each to `each`; fails when it stalls for five minutes.
pub(crate) fn read_ranges(
    consumer: &rdkafka::consumer::BaseConsumer,
    ranges: &[(String, i32, i64, i64)],
    mut each: impl FnMut(&rdkafka::message::BorrowedMessage<'_>),
) -> anyhow::Result<()> {
    use rdkafka::Message as _;
    let mut tpl = rdkafka::TopicPartitionList::new();
    let mut ends = std::collections::BTreeMap::new();
    for (topic, partition, from, end) in ranges {
        if end > from {
            tpl.add_partition_offset(topic, *partition, rdkafka::Offset::Offset(*from))?;
            ends.insert((topic.clone(), *partition), *end);
        }
    }
    if ends.is_empty() {
        return Ok(());
    }
    consumer.assign(&tpl)?;
    let deadline = Instant::now() + Duration::from_secs(300);
    while !ends.is_empty() {
        anyhow::ensure!(Instant::now() < deadline, "reading stalled with partitions {ends:?} unfinished");
        let Some(m) = consumer.poll(Duration::from_secs(1)) else { continue };
        let m = m?;
        each(&m);
        let key = (m.topic().to_owned(), m.partition());
        if ends.get(&key).is_some_and(|end| m.offset() + 1 >= *end) {
            ends.remove(&key);
        }
    }
    Ok(())
}

/// Reads `records` records of `topic` in a new consumer group with the services' consumer, doing
/// nothing with them: the raw consume rate the scenarios print their figures beside.
pub(crate) async fn raw_consume_rate(settings: &KafkaSettings, topic: &str, records: usize) -> anyhow::Result<f64> {
    let readiness = Readiness::default();
    let consumer =
        settings.consumer("load-tests", &testkit::unique_name("bench-raw"), &[topic], readiness.register("a"))?;
    let start = Instant::now();
    for _ in 0..records {
        tokio::time::timeout(Duration::from_secs(60), consumer.recv()).await.context("consume stalled")??;
    }
    let per_sec = records as f64 / start.elapsed().as_secs_f64();
    consumer.unsubscribe();
    Ok(per_sec)
}

/// A release binary built next to this program (the services the scenarios start).
pub(crate) fn release_binary(name: &str) -> anyhow::Result<String> {
    let p = std::env::current_exe()?.with_file_name(name);
    anyhow::ensure!(p.is_file(), "{} is missing: `cargo build --release -p {name}`", p.display());
    Ok(p.display().to_string())
}

/// The environment of a pipeline service a scenario starts: the testbed's Kafka, a new consumer
/// group named after `group` and committed at the end of the pipeline topics (so it reads only
/// this scenario's records, and every one of them), warnings only, the testbed's kubeconfig.
pub(crate) async fn service_env(bootstrap: &str, group: &str) -> anyhow::Result<Vec<(&'static str, String)>> {
    let group = testkit::group_at_end(group, &gpumedic_schemas::topics::ALL).await?;
    Ok(vec![
        ("GPUMEDIC_KAFKA_BOOTSTRAP", bootstrap.to_owned()),
        ("GPUMEDIC_GROUP", group),
        ("GPUMEDIC_LOG", "warn".to_owned()),
        ("KUBECONFIG", testkit::kubeconfig_path().display().to_string()),
    ])
}

/// Queues `record`, waiting while librdkafka's queue is full.
pub(crate) fn send(
    producer: &ThreadedProducer<DefaultProducerContext>,
    mut record: BaseRecord<'_, str, [u8]>,
) -> anyhow::Result<()> {
    loop {
        match producer.send(record) {
            Ok(()) => return Ok(()),
            Err((e, r)) if e.rdkafka_error_code() == Some(rdkafka::types::RDKafkaErrorCode::QueueFull) => {
                record = r;
                producer.poll(Duration::from_millis(1));
            }
            Err((e, _)) => anyhow::bail!("produce failed: {e}"),
        }
    }
}

pub(crate) async fn kafka_ceiling(records: usize, size: usize, partitions: i32) -> anyhow::Result<CeilingResult> {
    let bootstrap = testkit::require_kafka().await?;
    let settings =
        KafkaSettings { bootstrap: bootstrap.clone(), options: vec![], schema_registry: None, topic_replication: None };
    let topic = testkit::unique_name("ceiling");
    settings.ensure_topics(&[TopicSpec::new(&topic, partitions)]).await?;

    // The same producer settings the services use (idempotent, acks=all, lz4), with a threaded
    // producer so the measurement is Kafka's, not an async runtime's.
    let producer = scratch_producer(&bootstrap)?;
    let payload: Vec<u8> = (0..size).map(|i| b"0123456789abcdef"[i % 16]).collect();
    let keys: Vec<String> = (0..1000).map(|i| format!("gpu-node-{i}")).collect();
    let start = Instant::now();
    for i in 0..records {
        send(&producer, BaseRecord::to(&topic).key(keys[i % keys.len()].as_str()).payload(payload.as_slice()))?;
    }
    producer.flush(Duration::from_secs(120)).context("flush")?;
    let produce_secs = start.elapsed().as_secs_f64();

    let readiness = Readiness::default();
    let consumer = settings.consumer(
        "load-tests",
        &testkit::unique_name("ceiling"),
        &[topic.as_str()],
        readiness.register("a"),
    )?;
    let start = Instant::now();
    let mut seen = 0usize;
    while seen < records {
        tokio::time::timeout(Duration::from_secs(60), consumer.recv()).await.context("consume stalled")??;
        seen += 1;
    }
    let consume_secs = start.elapsed().as_secs_f64();
    consumer.unsubscribe();
    Ok(CeilingResult {
        scenario: "kafka-ceiling",
        records,
        record_bytes: size,
        produce_per_sec: records as f64 / produce_secs,
        consume_per_sec: records as f64 / consume_secs,
        produce_mib_per_sec: (records * size) as f64 / produce_secs / (1024.0 * 1024.0),
    })
}
