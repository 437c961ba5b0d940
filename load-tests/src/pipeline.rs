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
    /// `[seconds since the first produce, events acknowledged by Kafka, events classified]` at
    /// each 100 ms poll of the classifier's `gpumedic_classifier_events_total`.
    timeline: Vec<[f64; 3]>,
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
        timeline,
    };
    println!(
        "  enricher + classifier:       {:>9.0} events/s persisted ({} in {:.1} s; goal 50,000/s and half the \
         passthrough)",
        result.pipeline_per_sec, o.events, seconds
    );
    Ok(result)
}
