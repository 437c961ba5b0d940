//! `classify-throughput`: how many enriched events per second the classifier classifies and
//! persists, beside the two ceilings under it, all measured in one run on the same records:
//!
//! 1. N enriched events (the simulated fleet's stream as the enricher passes it on, see
//!    [`crate::fleet::Enriched`]: inventories, start snapshots, heartbeats, readings on change, a
//!    few faults; 10 µs apart) are produced to a fresh topic.
//! 2. Kafka ceiling: a fresh consumer group reads them all, doing nothing with them.
//! 3. Postgres ceiling: the same events, as the classifier's batch rows (built beforehand), are
//!    written to a fresh database with the classifier's own batch statement, `--batch-max` at a
//!    time on one connection, as the classifier does.
//! 4. The classifier binary (the release build next to this one, or `--classifier-bin`) is
//!    started on the topic with a fresh database and group; the clock runs from its readiness
//!    (partitions assigned) until `gpumedic_classifier_events_total` reaches N, then the rows are
//!    counted. Its per-stage timings (decode, classify, publish, write) are read from /metrics.

use std::time::{Duration, Instant};

use anyhow::Context as _;
use gpumedic_classifier::store;
use gpumedic_runtime::kafka::{KafkaSettings, stage_topics};
use gpumedic_schemas::enriched::NodeContext;
use gpumedic_schemas::{EnrichedHealthEvent, HealthEvent};
use gpumedic_testkit as testkit;
use rdkafka::producer::{BaseRecord, Producer as _};

/// Options of the scenario.
#[derive(Debug, clap::Args)]
pub struct Options {
    /// How many enriched events.
    #[arg(long, default_value_t = 200_000)]
    events: usize,
    /// Nodes in the simulated fleet (8 GPUs each).
    #[arg(long, default_value_t = 1000)]
    nodes: usize,
    /// Partitions of the scratch topic.
    #[arg(long, default_value_t = 12)]
    partitions: i32,
    /// The classifier's --batch-max, also the Postgres ceiling's batch size.
    #[arg(long, default_value_t = 5000)]
    batch_max: usize,
    /// The classifier's --batch-linger.
    #[arg(long, default_value = "5ms")]
    batch_linger: String,
    /// The classifier's --persist: `all` (every event, as the Postgres ceiling writes) or
    /// `evidence` (the default of the service).
    #[arg(long, default_value = "all")]
    persist: String,
    /// The classifier binary; by default the one built next to this program.
    #[arg(long)]
    classifier_bin: Option<std::path::PathBuf>,
}

/// The JSON result.
#[derive(Debug, serde::Serialize)]
pub struct Result {
    scenario: &'static str,
    events: usize,
    nodes: usize,
    partitions: i32,
    batch_max: usize,
    batch_linger: String,
    avro_bytes_per_event: usize,
    kafka_consume_per_sec: f64,
    postgres_insert_per_sec: f64,
    classifier_persisted_per_sec: f64,
    classifier_seconds: f64,
    /// The classifier's peak resident memory over the run (`VmHWM`): it starts with the whole
    /// backlog ahead of it, the memory of a classifier that is behind.
    classifier_peak_rss_mib: f64,
    persist: String,
    verdicts: i64,
    batches: f64,
    stage_seconds: Vec<(String, f64)>,
}

/// `e` as the enricher would have sent it, at `enriched_at`, on a bench cloud node.
pub(crate) fn enriched(e: HealthEvent, enriched_at: chrono::DateTime<chrono::Utc>) -> EnrichedHealthEvent {
    EnrichedHealthEvent {
        event: e,
        node_context: NodeContext {
            cluster: Some("bench".into()),
            instance_type: Some("p5.48xlarge".into()),
            zone: Some("us-east-1a".into()),
            gpu_product: Some("NVIDIA-H100-80GB-HBM3".into()),
            driver_version: Some("550.90.07".into()),
            ..Default::default()
        },
        node_unknown: false,
        xid_catalog: None,
        workloads: vec![],
        enriched_at,
        gpu: None,
        gpu_unresolved: false,
    }
}

/// Runs the scenario and prints one line per figure.
pub async fn run(o: Options) -> anyhow::Result<Result> {
    let bootstrap = testkit::require_kafka().await?;
    let admin = testkit::require_postgres().await?;
    let settings =
        KafkaSettings { bootstrap: bootstrap.clone(), options: vec![], schema_registry: None, topic_replication: None };
    let enriched = testkit::unique_name("bench-enriched");
    let verdicts = testkit::unique_name("bench-verdicts");
    let actions = testkit::unique_name("bench-actions");
    settings.ensure_topics(&stage_topics(&[&enriched, &actions], &[&verdicts], o.partitions)).await?;

    let base = chrono::Utc::now() - chrono::Duration::minutes(10);
    let spacing = chrono::Duration::microseconds(10);
    let events: Vec<EnrichedHealthEvent> =
        crate::fleet::Enriched::new(o.nodes, base, spacing)?.take(o.events).collect();
    let payloads: Vec<Vec<u8>> = events.iter().map(gpumedic_schemas::encode).collect::<std::result::Result<_, _>>()?;
    let avro_bytes = payloads.iter().map(Vec::len).sum::<usize>() / payloads.len().max(1);
    let producer = crate::scratch_producer(&bootstrap)?;
    for (e, payload) in events.iter().zip(&payloads) {
        crate::send(&producer, BaseRecord::to(&enriched).key(e.event.node.as_str()).payload(payload.as_slice()))?;
    }
    producer.flush(Duration::from_secs(120)).context("flush")?;
    println!("classify-throughput: {} enriched events of {avro_bytes} B on {} partitions", o.events, o.partitions);

    // (a) The raw Kafka consume rate of the same records.
    let kafka_per_sec = crate::raw_consume_rate(&settings, &enriched, o.events).await?;
    println!("  kafka consume (raw):            {kafka_per_sec:>9.0} events/s");

    // (b) The raw Postgres insert rate: the classifier's batch statement, rows built beforehand.
    let raw_db = testkit::unique_name("bench_raw").replace('-', "_");
    let raw_url = testkit::fresh_database(&admin, &raw_db).await?;
    let pool = gpumedic_classifier::connect_and_migrate(&raw_url, 1).await?;
    let batches: Vec<store::Batch> = events
        .chunks(o.batch_max.max(1))
        .map(|chunk| {
            let mut rows = store::EventRows::with_capacity(chunk.len());
            for e in chunk {
                rows.push(e)?;
            }
            Ok(store::Batch { events: rows, ..Default::default() })
        })
        .collect::<anyhow::Result<_>>()?;
    let start = Instant::now();
    for b in &batches {
        store::write_batch(&pool, b).await?;
    }
    let postgres_per_sec = o.events as f64 / start.elapsed().as_secs_f64();
    pool.close().await;
    println!("  postgres insert (raw, {:>5}/batch): {postgres_per_sec:>9.0} events/s", o.batch_max);

    // (c) The classifier binary.
    let bin = match o.classifier_bin {
        Some(b) => b,
        None => std::env::current_exe()?.with_file_name("gpumedic-classifier"),
    };
    anyhow::ensure!(bin.is_file(), "{} is missing: `cargo build --release -p gpumedic-classifier`", bin.display());
    let db = testkit::unique_name("bench_classify").replace('-', "_");
    let url = testkit::fresh_database(&admin, &db).await?;
    let mut classifier = testkit::ServiceProcess::start(
        bin.to_str().context("binary path")?,
        &[],
        &[
            ("GPUMEDIC_KAFKA_BOOTSTRAP", bootstrap.clone()),
            ("GPUMEDIC_GROUP", testkit::unique_name("bench-classifier")),
            ("GPUMEDIC_DATABASE_URL", url.clone()),
            // `all` by default: every event recorded, as the Postgres ceiling beside it writes.
            ("GPUMEDIC_PERSIST", o.persist.clone()),
            ("GPUMEDIC_ENRICHED_TOPIC", enriched.clone()),
            ("GPUMEDIC_VERDICTS_TOPIC", verdicts.clone()),
            ("GPUMEDIC_ACTIONS_TOPIC", actions.clone()),
            ("GPUMEDIC_BATCH_MAX", o.batch_max.to_string()),
            ("GPUMEDIC_BATCH_LINGER", o.batch_linger.clone()),
            ("GPUMEDIC_LOG", "warn".into()),
        ],
    )?;
    classifier.wait_ready(Duration::from_secs(120)).await.map_err(anyhow::Error::msg)?;
    let start = Instant::now();
    let deadline = start + Duration::from_secs(900);
    let metrics = loop {
        let (_, text) = testkit::http_get(classifier.admin_addr(), "/metrics").await?;
        if metric(&text, "gpumedic_classifier_events_total") >= o.events as f64 {
            break text;
        }
        anyhow::ensure!(Instant::now() < deadline, "the classifier did not catch up within 15 minutes");
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    let classifier_seconds = start.elapsed().as_secs_f64();
    let classifier_per_sec = o.events as f64 / classifier_seconds;
    let peak_rss = crate::procs::status_mib(classifier.pid(), "VmHWM:");
    let status = classifier.terminate(Duration::from_secs(30)).await.map_err(anyhow::Error::msg)?;
    anyhow::ensure!(status.success(), "the classifier exited with {status}");
    let pool = gpumedic_runtime::postgres::connect(&url, 1).await?;
    let rows: i64 = sqlx::query_scalar("SELECT count(*) FROM health_events").fetch_one(&pool).await?;
    let verdict_rows: i64 = sqlx::query_scalar("SELECT count(*) FROM verdicts").fetch_one(&pool).await?;
    pool.close().await;
    if o.persist == "all" {
        anyhow::ensure!(rows == o.events as i64, "{rows} events persisted, expected {}", o.events);
    }
    println!(
        "  classifier (classified + persisted, --persist {}): {classifier_per_sec:>9.0} events/s ({classifier_seconds:.1} s, \
         {rows} event rows, {verdict_rows} verdicts, peak RSS {peak_rss:.0} MiB)",
        o.persist
    );
    let batches_done = metric(&metrics, "gpumedic_classifier_batches_total");
    let stage_seconds: Vec<(String, f64)> = ["decode", "classify", "publish", "write"]
        .iter()
        .map(|s| {
            let needle = format!("gpumedic_classifier_batch_stage_seconds_sum{{stage=\"{s}\"}}");
            ((*s).to_owned(), metric(&metrics, &needle))
        })
        .collect();
    let breakdown: Vec<String> = stage_seconds.iter().map(|(s, v)| format!("{s} {v:.2}s")).collect();
    println!("  classifier time in {batches_done:.0} batches: {}", breakdown.join(", "));
    for name in [&raw_db, &db] {
        sqlx::query(sqlx::AssertSqlSafe(format!("DROP DATABASE \"{name}\" WITH (FORCE)"))).execute(&admin).await.ok();
    }
    Ok(Result {
        scenario: "classify-throughput",
        events: o.events,
        nodes: o.nodes,
        partitions: o.partitions,
        batch_max: o.batch_max,
        batch_linger: o.batch_linger,
        avro_bytes_per_event: avro_bytes,
        kafka_consume_per_sec: kafka_per_sec,
        postgres_insert_per_sec: postgres_per_sec,
        classifier_persisted_per_sec: classifier_per_sec,
        classifier_seconds,
        classifier_peak_rss_mib: peak_rss,
        persist: o.persist,
        verdicts: verdict_rows,
        batches: batches_done,
        stage_seconds,
    })
}

/// The sum of the samples of `name` (a metric name, or a name with its labels) in Prometheus text;
/// 0 when there is none.
pub(crate) fn metric(text: &str, name: &str) -> f64 {
    text.lines()
        .filter(|l| {
            l.strip_prefix(name)
                .is_some_and(|rest| rest.starts_with(' ') || (rest.starts_with('{') && !name.contains('{')))
        })
        .filter_map(|l| l.rsplit(' ').next().and_then(|v| v.parse::<f64>().ok()))
        .sum::<f64>()
        // An empty float sum is -0.0, which prints as "-0": a metric nobody reported is 0.
        + 0.0
}

#[cfg(test)]
mod tests {
    use super::metric;

    #[test]
    fn samples_are_summed_by_name_and_an_absent_metric_is_zero() {
        let text = "# TYPE a counter\na_total{topic=\"x\"} 2\na_total{topic=\"y\"} 3\na_total_more 7\n";
        assert_eq!(metric(text, "a_total"), 5.0);
        assert_eq!(metric(text, "a_total{topic=\"y\"}"), 3.0);
        assert_eq!(format!("{:.0}", metric(text, "absent_total")), "0");
    }
}
