//! `pipeline-throughput`: raw events per second through the enricher and the classifier (with
//! Postgres persistence), beside the raw Kafka passthrough rate (produce and consume the same
//! record size, no processing) measured in the same run. The goals: at least 50,000
//! events per second end to end on 2 cores, and at least half of the Kafka passthrough rate.
//!
//! 1. Kafka ceiling: `kafka-ceiling` on records of the raw events' size.
//! 2. The release enricher and classifier start on the pipeline's topics with new consumer groups
//!    that begin at the end of the topics, the classifier on a fresh database.
//! 3. N raw events (the fleet mix of [`crate::classify`], as raw records) are produced as fast as
//!    Kafka takes them; the clock runs from the first produce until the classifier's
//!    `gpumedic_classifier_events_total` reaches N, then the rows are counted.

use std::time::{Duration, Instant};

use anyhow::Context as _;
use gpumedic_runtime::testbed;
use gpumedic_schemas::topics;
use rdkafka::producer::{BaseRecord, Producer as _};

/// Options of the scenario.
#[derive(Debug, clap::Args)]
pub struct Options {
    /// Raw events through the pipeline.
    #[arg(long, default_value_t = 200_000)]
    events: usize,
    /// Nodes in the simulated fleet (8 GPUs each).
    #[arg(long, default_value_t = 1000)]
    nodes: usize,
}

/// The JSON result.
#[derive(Debug, serde::Serialize)]
pub struct Result {
    scenario: &'static str,
    events: usize,
    raw_bytes_per_event: usize,
    kafka_produce_per_sec: f64,
    kafka_consume_per_sec: f64,
    pipeline_per_sec: f64,
    pipeline_seconds: f64,
    rows: i64,
}

/// Runs the scenario and prints one line per figure.
pub async fn run(o: Options) -> anyhow::Result<Result> {
    let bootstrap = testbed::require_kafka().await?;
    testbed::require_kubernetes().await?;
    let admin_db = testbed::require_postgres().await?;
    let base = chrono::Utc::now() - chrono::Duration::minutes(30);
    let raw: Vec<(String, Vec<u8>)> = (0..o.events)
        .map(|i| {
            let e = crate::classify::event(i, o.nodes, base).event;
            Ok((e.node.clone(), gpumedic_schemas::encode(&e)?))
        })
        .collect::<anyhow::Result<_>>()?;
    let bytes = raw.iter().map(|(_, b)| b.len()).sum::<usize>() / raw.len().max(1);
    println!("pipeline-throughput: {} raw events of {bytes} B", o.events);

    let ceiling = crate::kafka_ceiling(o.events, bytes, topics::DEFAULT_PARTITIONS).await?;
    println!(
        "  kafka passthrough (raw):     produce {:>9.0}/s, consume {:>9.0}/s",
        ceiling.produce_per_sec, ceiling.consume_per_sec
    );

    let db = testbed::unique_name("bench_pipeline").replace('-', "_");
    let url = testbed::fresh_database(&admin_db, &db).await?;
    let common = async |group: &str| crate::service_env(&bootstrap, group).await;
    let mut enricher = testbed::ServiceProcess::start(
        &crate::release_binary("gpumedic-enricher")?,
        &[],
        &common("bench-pipeline-enricher").await?,
    )?;
    let mut env = common("bench-pipeline-classifier").await?;
    env.extend([
        ("GPUMEDIC_DATABASE_URL", url.clone()),
        ("GPUMEDIC_VERDICTS_TOPIC", testbed::unique_name("bench-pipeline-verdicts")),
        ("GPUMEDIC_ACTIONS_TOPIC", testbed::unique_name("bench-pipeline-actions")),
    ]);
    let mut classifier = testbed::ServiceProcess::start(&crate::release_binary("gpumedic-classifier")?, &[], &env)?;
    for s in [&mut enricher, &mut classifier] {
        s.wait_ready(Duration::from_secs(120)).await.map_err(anyhow::Error::msg)?;
    }

    let producer = crate::scratch_producer(&bootstrap)?;
    let start = Instant::now();
    for (key, payload) in &raw {
        crate::send(&producer, BaseRecord::to(topics::HEALTH_RAW).key(key.as_str()).payload(payload.as_slice()))?;
    }
    producer.flush(Duration::from_secs(120)).context("flush")?;
    let deadline = start + Duration::from_secs(900);
    loop {
        let (_, text) = testbed::http_get(classifier.admin_addr(), "/metrics").await?;
        if crate::classify::metric(&text, "gpumedic_classifier_events_total") >= o.events as f64 {
            break;
        }
        anyhow::ensure!(Instant::now() < deadline, "the pipeline did not finish within 900 s");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let seconds = start.elapsed().as_secs_f64();
    let pool = gpumedic_runtime::postgres::connect(&url, 1).await?;
    let rows: i64 = sqlx::query_scalar("SELECT count(*) FROM health_events").fetch_one(&pool).await?;
    pool.close().await;
    for s in [&mut enricher, &mut classifier] {
        let _ = s.terminate(Duration::from_secs(20)).await;
    }
    anyhow::ensure!(rows == o.events as i64, "{rows} rows in health_events, {} events produced", o.events);
    let result = Result {
        scenario: "pipeline-throughput",
        events: o.events,
        raw_bytes_per_event: bytes,
        kafka_produce_per_sec: ceiling.produce_per_sec,
        kafka_consume_per_sec: ceiling.consume_per_sec,
        pipeline_per_sec: o.events as f64 / seconds,
        pipeline_seconds: seconds,
        rows,
    };
    println!(
        "  enricher + classifier:       {:>9.0} events/s persisted ({} in {:.1} s; goal 50,000/s and half the \
         passthrough)",
        result.pipeline_per_sec, o.events, seconds
    );
    Ok(result)
}
