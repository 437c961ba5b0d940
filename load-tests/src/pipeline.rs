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
//!
//! The producing runs on a thread of its own so that the same 100 ms polls of the classifier's
//! metrics can also sample the events Kafka has acknowledged: the JSON result's `timeline`, for
//! the plots of `load-tests/plot/`.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
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
    /// The classifier's --persist: `evidence` (its default) or `all`. Run the scenario once with
    /// each, back to back, to compare them (each run measures its own Kafka ceiling).
    #[arg(long, default_value = "evidence")]
    persist: String,
    /// Event time between consecutive events of the stream, in microseconds. The default packs
    /// the stream into seconds; 33333 spreads 1,000 nodes' events at the fleet's rate (0.03 events
    /// per node per second), which decides how many per-minute rollups `--persist evidence` writes.
    #[arg(long, default_value_t = 10)]
    event_spacing_us: i64,
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
    /// The classifier's --persist.
    persist: String,
    /// Rows in `health_events`.
    rows: i64,
    /// Rows in `telemetry_rollups`.
    rollups: i64,
    /// `pg_total_relation_size` of `health_events` (all its partitions) and of `telemetry_rollups`.
    events_bytes: i64,
    rollup_bytes: i64,
    /// `[seconds since the first produce, events acknowledged by Kafka, events classified]` at
    /// each 100 ms poll of the classifier's `gpumedic_classifier_events_total`.
    timeline: Vec<[f64; 3]>,
}

/// Runs the scenario and prints one line per figure.
pub async fn run(o: Options) -> anyhow::Result<Result> {
    let bootstrap = testbed::require_kafka().await?;
    testbed::require_kubernetes().await?;
    let admin_db = testbed::require_postgres().await?;
    let spacing = chrono::Duration::microseconds(o.event_spacing_us);
    // The stream ends ten minutes ago, whatever time it spans.
    let span = spacing * i32::try_from(o.events).unwrap_or(i32::MAX);
    let base = chrono::Utc::now() - chrono::Duration::minutes(10) - span;
    let raw: Vec<(String, Vec<u8>)> = (0..o.events)
        .map(|i| {
            let mut e = crate::classify::event(i, o.nodes, base).event;
            e.observed_at = base + spacing * i32::try_from(i).unwrap_or(i32::MAX);
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
        ("GPUMEDIC_PERSIST", o.persist.clone()),
        ("GPUMEDIC_VERDICTS_TOPIC", testbed::unique_name("bench-pipeline-verdicts")),
        ("GPUMEDIC_ACTIONS_TOPIC", testbed::unique_name("bench-pipeline-actions")),
    ]);
    let mut classifier = testbed::ServiceProcess::start(&crate::release_binary("gpumedic-classifier")?, &[], &env)?;
    for s in [&mut enricher, &mut classifier] {
        s.wait_ready(Duration::from_secs(120)).await.map_err(anyhow::Error::msg)?;
    }

    let producer = Arc::new(crate::scratch_producer(&bootstrap)?);
    let queued = Arc::new(AtomicU64::new(0));
    let start = Instant::now();
    let producing = {
        let (producer, queued) = (producer.clone(), queued.clone());
        std::thread::spawn(move || -> anyhow::Result<()> {
            for (key, payload) in &raw {
                crate::send(
                    &producer,
                    BaseRecord::to(topics::HEALTH_RAW).key(key.as_str()).payload(payload.as_slice()),
                )?;
                queued.fetch_add(1, Ordering::Relaxed);
            }
            producer.flush(Duration::from_secs(120)).context("flush")
        })
    };
    let deadline = start + Duration::from_secs(900);
    let mut timeline: Vec<[f64; 3]> = Vec::new();
    let mut producing = Some(producing);
    loop {
        let (_, text) = testbed::http_get(classifier.admin_addr(), "/metrics").await?;
        let classified = crate::classify::metric(&text, "gpumedic_classifier_events_total");
        // Queued minus still in librdkafka's queue or awaiting acknowledgement: what Kafka has
        // taken. Read in this order, a record queued between the two reads can only lower it.
        let acknowledged = queued.load(Ordering::Relaxed).saturating_sub(producer.in_flight_count().max(0) as u64);
        timeline.push([start.elapsed().as_secs_f64(), acknowledged as f64, classified]);
        if classified >= o.events as f64 {
            break;
        }
        if producing.as_ref().is_some_and(|p| p.is_finished())
            && let Some(p) = producing.take()
        {
            p.join().map_err(|_| anyhow::anyhow!("the producer thread panicked"))??;
        }
        anyhow::ensure!(Instant::now() < deadline, "the pipeline did not finish within 900 s");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let seconds = start.elapsed().as_secs_f64();
    if let Some(p) = producing {
        p.join().map_err(|_| anyhow::anyhow!("the producer thread panicked"))??;
    }
    let pool = gpumedic_runtime::postgres::connect(&url, 1).await?;
    let rows: i64 = sqlx::query_scalar("SELECT count(*) FROM health_events").fetch_one(&pool).await?;
    for s in [&mut enricher, &mut classifier] {
        let _ = s.terminate(Duration::from_secs(20)).await;
    }
    // After the classifier stopped: the rollups it wrote, and what both tables take on disk.
    let rollups: i64 = sqlx::query_scalar("SELECT count(*) FROM telemetry_rollups").fetch_one(&pool).await?;
    let (events_bytes, rollup_bytes): (i64, i64) = sqlx::query_as(
        "SELECT (SELECT coalesce(sum(pg_total_relation_size(inhrelid)), 0)::int8 FROM pg_inherits
                  WHERE inhparent = 'health_events'::regclass),
                pg_total_relation_size('telemetry_rollups')",
    )
    .fetch_one(&pool)
    .await?;
    pool.close().await;
    if o.persist == "all" {
        anyhow::ensure!(rows == o.events as i64, "{rows} rows in health_events, {} events produced", o.events);
    } else {
        anyhow::ensure!(rows <= o.events as i64, "{rows} rows in health_events, {} events produced", o.events);
    }
    let result = Result {
        scenario: "pipeline-throughput",
        events: o.events,
        raw_bytes_per_event: bytes,
        kafka_produce_per_sec: ceiling.produce_per_sec,
        kafka_consume_per_sec: ceiling.consume_per_sec,
        pipeline_per_sec: o.events as f64 / seconds,
        pipeline_seconds: seconds,
        persist: o.persist.clone(),
        rows,
        rollups,
        events_bytes,
        rollup_bytes,
        timeline,
    };
    println!(
        "  enricher + classifier:       {:>9.0} events/s persisted ({} in {:.1} s; goal 50,000/s and half the \
         passthrough)",
        result.pipeline_per_sec, o.events, seconds
    );
    println!(
        "  --persist {}: {rows} event rows ({:.0} B each with indexes), {rollups} rollup rows ({:.0} B each)",
        o.persist,
        events_bytes as f64 / rows.max(1) as f64,
        rollup_bytes as f64 / rollups.max(1) as f64
    );
    Ok(result)
}
