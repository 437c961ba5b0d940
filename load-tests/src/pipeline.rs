//! `pipeline-throughput`: raw events per second through the enricher and the classifier (with
//! Postgres persistence), beside the raw Kafka passthrough rate (produce and consume the same
//! record size, no processing) measured in the same run. The goals: at least 50,000
//! events per second end to end on 2 cores, and at least half of the Kafka passthrough rate.
//!
//! 1. Kafka ceiling: `kafka-ceiling` on records of the raw events' size, once.
//! 2. For each node authentication mode asked (`--node-auth`: `off`, `enforce`, or `both`, off
//!    then enforce on the same events): the release enricher and classifier start on fresh
//!    topics of their own, with new consumer groups and a fresh database. With `enforce`, a
//!    namespace holds the collector's ServiceAccount and one Pod per simulated node (see
//!    [`crate::collectors`]), and the enricher reviews every token as in production
//!    (`GPUMEDIC_NODE_AUTH=enforce`). How records prove their node follows the collector's
//!    `--node-auth-proof` (`--node-proof`): `signature` (the default, as the collector's) publishes
//!    each node's token once to a node-token directory topic of the pass and signs each record
//!    (key id and HMAC headers); `token` puts the token in every record (`gpumedic.node-token`).
//!    Either is built before the clock starts, as a collector holds its token, and signs each
//!    record, on its own node.
//! 3. N raw events from the simulated fleet ([`crate::fleet`]: `--nodes` simulated collectors at
//!    the collector's own intervals, so an inventory per node first, readings only on change or a
//!    threshold, a heartbeat per GPU every 60 s, kernel-log Xids by PCI bus id; the stream ends ten
//!    minutes ago) are produced as fast as Kafka takes them; the clock runs from the first produce
//!    until the classifier's
//!    `gpumedic_classifier_events_total` reaches N, then the rows are counted. A run fails unless
//!    exactly N events were classified, the rows fit the classifier's `--persist` (all N with
//!    `all`), and the raw topic's dead-letter topic is empty. The enricher's count of GPU
//!    references it could not resolve is printed beside the fleet's count of events that name a
//!    GPU outside their node's last inventory (NVML's `gpu_lost` after the GPU left it).
//!
//! The producing runs on a thread of its own so that the same 100 ms polls of the classifier's
//! metrics can also sample the events Kafka has acknowledged: the JSON result's `timeline`, for
//! the plots of `load-tests/plot/`.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use anyhow::Context as _;
use gpumedic_runtime::kafka::{self, KafkaSettings, node_proof, record_headers};
use gpumedic_schemas::{HealthEvent, topics};
use gpumedic_testkit as testkit;
use rdkafka::consumer::{BaseConsumer, Consumer as _};
use rdkafka::message::{Header, OwnedHeaders};
use rdkafka::producer::{BaseRecord, Producer as _};

use crate::collectors::Collectors;
use crate::fleet::{self, Fleet};

/// Collector Pods created and tokens minted at once with `--node-auth enforce`.
const POD_CONCURRENCY: usize = 32;

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
    /// Event time between consecutive events of the stream, in microseconds, in place of the
    /// fleet's own times (the simulated collectors' intervals: 1,000 nodes send about 137 events
    /// per second). 10 packs the stream into seconds, as the scenario did before it had the
    /// collector's shape. The spread decides how many rollups `--persist evidence`
    /// writes.
    #[arg(long)]
    event_spacing_us: Option<i64>,
    /// The chance that an event of the stream starts a fault (the fleet's mix: Xids, ECC trends,
    /// thermal excursions, maintenance notices).
    #[arg(long, default_value_t = 0.01)]
    fault_chance: f64,
    /// Seed of the fleet's generator.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// How kernel-log Xids name their GPU: `pci` (the PCI bus id only, resolved by the enricher)
    /// or `stamped` (with the UUID the collector's publisher adds).
    #[arg(long, value_enum, default_value_t = crate::fleet::XidNames::Pci)]
    xid_names: crate::fleet::XidNames,
    /// Node authentication in the enricher: `off`, `enforce` (every record carries its node's
    /// Pod-bound token, reviewed by the enricher), or `both` (off, then enforce, on the same
    /// events, and the ratio).
    #[arg(long, value_enum, default_value_t = NodeAuth::Both)]
    node_auth: NodeAuth,
    /// With node authentication enforced, how records prove their node, as the collector's
    /// `--node-auth-proof`: `signature` (key id and HMAC; the token once per node in the
    /// directory) or `token` (the token in every record).
    #[arg(long, value_enum, default_value_t = NodeProof::Signature)]
    node_proof: NodeProof,
}

/// How records prove their node with node authentication enforced (`--node-proof`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum NodeProof {
    /// The token in the node-token directory, a key id and a signature on every record.
    Signature,
    /// The token on every record.
    Token,
}

/// Which node authentication modes a run measures (`--node-auth`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum NodeAuth {
    /// The enricher checks no token; the records carry none.
    Off,
    /// Every record carries its node's token; the enricher reviews it and enriches only a record
    /// whose token is bound to the node it claims.
    Enforce,
    /// Off, then enforce, on the same events, each with fresh topics, groups and database.
    Both,
}

/// The JSON result. The top-level run is the first one measured (`off` with `--node-auth both`),
/// so the plots read it as before.
#[derive(Debug, serde::Serialize)]
pub struct Result {
    scenario: &'static str,
    events: usize,
    nodes: usize,
    raw_bytes_per_event: usize,
    /// How much event time the stream spans, in seconds.
    event_seconds: f64,
    /// The fleet's events and faults by kind (see [`crate::fleet::Fleet::counts`]).
    fleet_counts: BTreeMap<&'static str, u64>,
    kafka_produce_per_sec: f64,
    kafka_consume_per_sec: f64,
    /// The classifier's --persist.
    persist: String,
    #[serde(flatten)]
    first: Run,
    /// With `--node-auth both`: the run with node authentication enforced.
    enforce: Option<Run>,
    /// With `--node-auth both`: the enforced run's events per second over the first run's.
    enforce_over_off: Option<f64>,
}

/// The figures of one pass of the events through the pipeline.
#[derive(Debug, serde::Serialize)]
pub struct Run {
    /// `off` or `enforce`.
    node_auth: &'static str,
    /// With `enforce`: `signature` or `token`.
    node_proof: Option<&'static str>,
    pipeline_per_sec: f64,
    pipeline_seconds: f64,
    /// Events over the time until the classifier had stopped with every rollup written (its
    /// rollup writer writes beside the batches, so some are written after the last event is).
    with_rollups_per_sec: f64,
    /// Rows in `health_events`.
    rows: i64,
    /// Rows in `telemetry_rollups`.
    rollups: i64,
    /// `pg_total_relation_size` of `health_events` (all its partitions) and of `telemetry_rollups`.
    events_bytes: i64,
    rollup_bytes: i64,
    /// Records in the raw topic's dead-letter topic after the run (the run fails unless 0).
    dead_lettered: u64,
    /// The enricher's `gpumedic_enricher_token_reviews_total` after the run.
    token_reviews: u64,
    /// The enricher's `gpumedic_enricher_gpu_unresolved_total` after the run.
    gpu_unresolved: u64,
    /// CPU time (user and system) the enricher spent while the clock ran, per event, in µs: on a
    /// shared machine a steadier measure of its cost than the rate.
    enricher_cpu_us_per_event: f64,
    /// The same for the classifier.
    classifier_cpu_us_per_event: f64,
    /// `[seconds since the first produce, events acknowledged by Kafka, events classified]` at
    /// each 100 ms poll of the classifier's `gpumedic_classifier_events_total`.
    timeline: Vec<[f64; 3]>,
}

/// Runs the scenario and prints one line per figure.
pub async fn run(o: Options) -> anyhow::Result<Result> {
    let bootstrap = testkit::require_kafka().await?;
    let client = testkit::require_kubernetes().await?;
    let admin_db = testkit::require_postgres().await?;
    let mut fleet = Fleet::new(fleet::Settings {
        prefix: "bench-node".to_owned(),
        nodes: o.nodes,
        intervals: fleet::Intervals::COLLECTOR,
        fault_chance: o.fault_chance,
        seed: o.seed,
        start: chrono::Utc::now(),
        xid_names: o.xid_names,
    })?;
    let mut events: Vec<HealthEvent> = (0..o.events).map(|_| fleet.next_event()).collect();
    // The stream ends ten minutes ago, whatever time it spans.
    let end = fleet::micros(chrono::Utc::now() - chrono::Duration::minutes(10));
    match o.event_spacing_us {
        None => {
            let shift = end - fleet.clock();
            events.iter_mut().for_each(|e| e.observed_at += shift);
        }
        Some(us) => {
            let spacing = chrono::Duration::microseconds(us);
            let base = end - spacing * i32::try_from(o.events).unwrap_or(i32::MAX);
            for (i, e) in events.iter_mut().enumerate() {
                e.observed_at = base + spacing * i32::try_from(i).unwrap_or(i32::MAX);
            }
        }
    }
    let event_seconds = match (events.first(), events.last()) {
        (Some(a), Some(b)) => (b.observed_at - a.observed_at).num_milliseconds() as f64 / 1000.0,
        _ => 0.0,
    };
    let raw: Vec<(String, Vec<u8>)> =
        events.iter().map(|e| Ok((e.node.clone(), gpumedic_schemas::encode(e)?))).collect::<anyhow::Result<_>>()?;
    drop(events);
    let raw = Arc::new(raw);
    let bytes = raw.iter().map(|(_, b)| b.len()).sum::<usize>() / raw.len().max(1);
    let counts = fleet.counts().clone();
    let count = |k: &str| counts.get(k).copied().unwrap_or(0);
    println!(
        "pipeline-throughput: {} raw events of {bytes} B from {} simulated collectors over {:.0} s of event time: \
         {} heartbeats, {} inventories, {} start-snapshot readings, {} Xids ({} by PCI bus id only), {} GPUs lost",
        o.events,
        o.nodes,
        event_seconds,
        count("monitor_health"),
        count("gpu_inventory"),
        count("snapshot"),
        count("xid"),
        count("xid_by_pci_only"),
        count("gpu_lost"),
    );
    println!("  the fleet's mix: {counts:?}");
    drop(fleet);

    let ceiling = crate::kafka_ceiling(o.events, bytes, topics::DEFAULT_PARTITIONS).await?;
    println!(
        "  kafka passthrough (raw):     produce {:>9.0}/s, consume {:>9.0}/s",
        ceiling.produce_per_sec, ceiling.consume_per_sec
    );

    let modes: &[NodeAuth] = match o.node_auth {
        NodeAuth::Off => &[NodeAuth::Off],
        NodeAuth::Enforce => &[NodeAuth::Enforce],
        NodeAuth::Both => &[NodeAuth::Off, NodeAuth::Enforce],
    };
    let mut runs = Vec::new();
    for &mode in modes {
        let run = match mode {
            NodeAuth::Enforce => {
                let nodes: Vec<String> =
                    raw.iter().map(|(node, _)| node.clone()).collect::<BTreeSet<_>>().into_iter().collect();
                let collectors = Collectors::create(&client, &nodes, POD_CONCURRENCY).await?;
                let run = pass(&bootstrap, &admin_db, &raw, &o.persist, Some((&collectors, o.node_proof))).await;
                collectors.delete(&client).await;
                run?
            }
            NodeAuth::Off | NodeAuth::Both => pass(&bootstrap, &admin_db, &raw, &o.persist, None).await?,
        };
        println!(
            "  enricher + classifier, node auth {:<7} {:>9.0} events/s persisted ({} in {:.1} s; goal 50,000/s and \
             half the passthrough); CPU per event: enricher {:.1} µs, classifier {:.1} µs",
            format!("{}:", run.node_auth),
            run.pipeline_per_sec,
            o.events,
            run.pipeline_seconds,
            run.enricher_cpu_us_per_event,
            run.classifier_cpu_us_per_event
        );
        println!(
            "  --persist {}: {} event rows ({:.0} B each with indexes), {} rollup rows ({:.0} B each); \
             {:.0} events/s up to the classifier's stop with every rollup written",
            o.persist,
            run.rows,
            run.events_bytes as f64 / run.rows.max(1) as f64,
            run.rollups,
            run.rollup_bytes as f64 / run.rollups.max(1) as f64,
            run.with_rollups_per_sec
        );
        println!(
            "  enricher: {} GPU references unresolved; the fleet sent {} events naming a GPU outside its node's \
             last inventory",
            run.gpu_unresolved,
            count("outside_inventory")
        );
        runs.push(run);
    }
    let mut runs = runs.into_iter();
    let first = runs.next().context("no run was measured")?;
    let enforce = runs.next();
    let enforce_over_off = enforce.as_ref().map(|e| e.pipeline_per_sec / first.pipeline_per_sec);
    if let Some(ratio) = enforce_over_off {
        println!(
            "  node auth enforce / off:     {:>9.3} ({:+.1}%; the issue allows -10%)",
            ratio,
            (ratio - 1.0) * 100.0
        );
    }
    Ok(Result {
        scenario: "pipeline-throughput",
        events: o.events,
        nodes: o.nodes,
        raw_bytes_per_event: bytes,
        event_seconds,
        fleet_counts: counts,
        kafka_produce_per_sec: ceiling.produce_per_sec,
        kafka_consume_per_sec: ceiling.consume_per_sec,
        persist: o.persist,
        first,
        enforce,
        enforce_over_off,
    })
}

/// What one pass of raw events through an enricher and a classifier runs on, all its own: the
/// raw and enriched topics, a fresh database, and the two services' environments (every
/// replica started with one joins the same consumer group). The enricher's node authentication
/// is the caller's to set.
pub(crate) struct Stages {
    /// The Kafka settings the topics were made with.
    pub settings: KafkaSettings,
    /// Where the raw events go.
    pub raw_topic: String,
    /// The classifier's database.
    pub url: String,
    /// The enricher's environment.
    pub enricher_env: Vec<(&'static str, String)>,
    /// The classifier's environment (`persist` as given).
    pub classifier_env: Vec<(&'static str, String)>,
}

impl Stages {
    /// Topics, database and environments named after `prefix`.
    pub(crate) async fn new(
        bootstrap: &str,
        admin_db: &sqlx::PgPool,
        prefix: &str,
        persist: &str,
    ) -> anyhow::Result<Self> {
        let raw_topic = testkit::unique_name(&format!("{prefix}-raw"));
        let enriched_topic = testkit::unique_name(&format!("{prefix}-enriched"));
        let settings = KafkaSettings {
            bootstrap: bootstrap.to_owned(),
            options: vec![],
            schema_registry: None,
            topic_replication: None,
        };
        settings
            .ensure_topics(&kafka::stage_topics(&[&raw_topic, &enriched_topic], &[], topics::DEFAULT_PARTITIONS))
            .await?;
        let db = testkit::unique_name(prefix).replace('-', "_");
        let url = testkit::fresh_database(admin_db, &db).await?;
        let mut enricher_env = crate::service_env(bootstrap, &format!("{prefix}-enricher")).await?;
        enricher_env
            .extend([("GPUMEDIC_RAW_TOPIC", raw_topic.clone()), ("GPUMEDIC_ENRICHED_TOPIC", enriched_topic.clone())]);
        let mut classifier_env = crate::service_env(bootstrap, &format!("{prefix}-classifier")).await?;
        classifier_env.extend([
            ("GPUMEDIC_DATABASE_URL", url.clone()),
            ("GPUMEDIC_PERSIST", persist.to_owned()),
            ("GPUMEDIC_ENRICHED_TOPIC", enriched_topic),
            ("GPUMEDIC_VERDICTS_TOPIC", testkit::unique_name(&format!("{prefix}-verdicts"))),
            ("GPUMEDIC_ACTIONS_TOPIC", testkit::unique_name(&format!("{prefix}-actions"))),
        ]);
        Ok(Self { settings, raw_topic, url, enricher_env, classifier_env })
    }
}

/// One pass of `raw` through a release enricher and classifier started for it, on topics, groups
/// and a database of its own. With `collectors`, each record proves its node as `proof` says and
/// the enricher enforces node authentication.
async fn pass(
    bootstrap: &str,
    admin_db: &sqlx::PgPool,
    raw: &Arc<Vec<(String, Vec<u8>)>>,
    persist: &str,
    collectors: Option<(&Collectors, NodeProof)>,
) -> anyhow::Result<Run> {
    let events = raw.len();
    let Stages { settings, raw_topic, url, enricher_env: mut env, classifier_env } =
        Stages::new(bootstrap, admin_db, "bench-pipeline", persist).await?;
    // Built before the clock starts, as the collector holds its token before it sends (and signs
    // each record on its own node).
    let directory = testkit::unique_name("bench-pipeline-node-tokens");
    let headers: Vec<Option<OwnedHeaders>> = match collectors {
        None => vec![None; events],
        Some((c, NodeProof::Token)) => raw
            .iter()
            .map(|(node, _)| {
                let token = c.token(node).with_context(|| format!("no collector token for {node}"))?;
                Ok(Some(OwnedHeaders::new().insert(Header { key: record_headers::NODE_TOKEN, value: Some(token) })))
            })
            .collect::<anyhow::Result<_>>()?,
        Some((c, NodeProof::Signature)) => {
            settings.ensure_topics(&[node_proof::directory_topic(&directory)]).await?;
            let producer = settings.producer("bench-pipeline-collectors")?;
            let mut keys = std::collections::HashMap::new();
            for node in raw.iter().map(|(n, _)| n).collect::<BTreeSet<_>>() {
                let token = c.token(node).with_context(|| format!("no collector token for {node}"))?;
                let key = node_proof::NodeKey::of(token.as_bytes());
                kafka::publish(
                    &producer,
                    &directory,
                    &node_proof::directory_key(node, key.id()),
                    token.as_bytes(),
                    &[],
                )
                .await?;
                keys.insert(node.clone(), key);
            }
            raw.iter()
                .map(|(node, payload)| {
                    let key = &keys[node];
                    let signature = key.sign(node.as_bytes(), payload);
                    Some(
                        OwnedHeaders::new()
                            .insert(Header { key: record_headers::NODE_KEY_ID, value: Some(key.id()) })
                            .insert(Header { key: record_headers::NODE_SIGNATURE, value: Some(&signature[..]) }),
                    )
                })
                .collect()
        }
    };

    match collectors {
        None => env.push(("GPUMEDIC_NODE_AUTH", "off".to_owned())),
        Some((c, _)) => env.extend([
            ("GPUMEDIC_NODE_AUTH", "enforce".to_owned()),
            ("GPUMEDIC_COLLECTOR_SERVICE_ACCOUNT", c.service_account()),
            ("GPUMEDIC_NODE_TOKENS_TOPIC", directory.clone()),
        ]),
    }
    let mut enricher = testkit::ServiceProcess::start(&crate::release_binary("gpumedic-enricher")?, &[], &env)?;
    let mut classifier =
        testkit::ServiceProcess::start(&crate::release_binary("gpumedic-classifier")?, &[], &classifier_env)?;
    for s in [&mut enricher, &mut classifier] {
        s.wait_ready(Duration::from_secs(120)).await.map_err(anyhow::Error::msg)?;
    }

    let producer = Arc::new(crate::scratch_producer(bootstrap)?);
    let queued = Arc::new(AtomicU64::new(0));
    let cpu_before = [cpu_seconds(enricher.pid())?, cpu_seconds(classifier.pid())?];
    let start = Instant::now();
    let producing = {
        let (producer, queued, raw, topic) = (producer.clone(), queued.clone(), raw.clone(), raw_topic.clone());
        std::thread::spawn(move || -> anyhow::Result<()> {
            for ((key, payload), headers) in raw.iter().zip(headers) {
                let record = BaseRecord::to(&topic).key(key.as_str()).payload(payload.as_slice());
                crate::send(
                    &producer,
                    match headers {
                        Some(h) => record.headers(h),
                        None => record,
                    },
                )?;
                queued.fetch_add(1, Ordering::Relaxed);
            }
            producer.flush(Duration::from_secs(120)).context("flush")
        })
    };
    let deadline = start + Duration::from_secs(900);
    let mut timeline: Vec<[f64; 3]> = Vec::new();
    let mut producing = Some(producing);
    let mut classified = 0.0;
    for poll in 0u64.. {
        let (_, text) = testkit::http_get(classifier.admin_addr(), "/metrics").await?;
        classified = crate::classify::metric(&text, "gpumedic_classifier_events_total");
        // Queued minus still in librdkafka's queue or awaiting acknowledgement: what Kafka has
        // taken. Read in this order, a record queued between the two reads can only lower it.
        let acknowledged = queued.load(Ordering::Relaxed).saturating_sub(producer.in_flight_count().max(0) as u64);
        timeline.push([start.elapsed().as_secs_f64(), acknowledged as f64, classified]);
        if classified >= events as f64 {
            break;
        }
        if producing.as_ref().is_some_and(|p| p.is_finished())
            && let Some(p) = producing.take()
        {
            p.join().map_err(|_| anyhow::anyhow!("the producer thread panicked"))??;
        }
        // Once a second: a record the enricher dead-lettered is never classified, so stop early.
        if poll % 10 == 9 {
            let (_, text) = testkit::http_get(enricher.admin_addr(), "/metrics").await?;
            let refused = dead_lettered(&text);
            anyhow::ensure!(refused == 0.0, "the enricher dead-lettered {refused} records: {}", refusals(&text));
        }
        anyhow::ensure!(Instant::now() < deadline, "the pipeline did not finish within 900 s");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let seconds = start.elapsed().as_secs_f64();
    let cpu = [cpu_seconds(enricher.pid())? - cpu_before[0], cpu_seconds(classifier.pid())? - cpu_before[1]];
    if let Some(p) = producing {
        p.join().map_err(|_| anyhow::anyhow!("the producer thread panicked"))??;
    }
    let pool = gpumedic_runtime::postgres::connect(&url, 1).await?;
    let rows: i64 = sqlx::query_scalar("SELECT count(*) FROM health_events").fetch_one(&pool).await?;
    let (_, text) = testkit::http_get(enricher.admin_addr(), "/metrics").await?;
    let token_reviews = crate::classify::metric(&text, "gpumedic_enricher_token_reviews_total") as u64;
    let gpu_unresolved = crate::classify::metric(&text, "gpumedic_enricher_gpu_unresolved_total") as u64;
    // A rollup write PostgreSQL refused is lost at once (a retry cannot mend it): the run's
    // rollups would be short, so it fails.
    let (_, classifier_metrics) = testkit::http_get(classifier.admin_addr(), "/metrics").await?;
    let lost = crate::classify::metric(&classifier_metrics, "gpumedic_classifier_rollups_lost_total");
    anyhow::ensure!(lost == 0.0, "the classifier lost {lost} rollups (its log says why)");
    // The classifier's stop writes the closed rollups still waiting for its rollup writer and
    // the open periods': the pipeline's work is done, rollups included, once it has stopped.
    let _ = classifier.terminate(Duration::from_secs(120)).await;
    let with_rollups_seconds = start.elapsed().as_secs_f64();
    let _ = enricher.terminate(Duration::from_secs(20)).await;
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
    let dlq = kafka::dead_letter_topic(&raw_topic);
    let dead = records_in(bootstrap, &dlq).await?;
    anyhow::ensure!(dead == 0, "{dead} records in {dlq}: the enricher refused them ({})", refusals(&text));
    anyhow::ensure!(classified == events as f64, "{classified} events classified, {events} produced");
    if persist == "all" {
        anyhow::ensure!(rows == events as i64, "{rows} rows in health_events, {events} events produced");
    } else {
        anyhow::ensure!(rows <= events as i64, "{rows} rows in health_events, {events} events produced");
    }
    Ok(Run {
        node_auth: if collectors.is_some() { "enforce" } else { "off" },
        node_proof: match collectors {
            None => None,
            Some((_, NodeProof::Signature)) => Some("signature"),
            Some((_, NodeProof::Token)) => Some("token"),
        },
        pipeline_per_sec: events as f64 / seconds,
        pipeline_seconds: seconds,
        with_rollups_per_sec: events as f64 / with_rollups_seconds,
        rows,
        rollups,
        events_bytes,
        rollup_bytes,
        dead_lettered: dead,
        token_reviews,
        gpu_unresolved,
        enricher_cpu_us_per_event: cpu[0] * 1e6 / events as f64,
        classifier_cpu_us_per_event: cpu[1] * 1e6 / events as f64,
        timeline,
    })
}

/// The CPU time (user and system, all threads) process `pid` has used so far, from
/// `/proc/<pid>/stat`, whose clock ticks are 1/100 s on Linux.
pub(crate) fn cpu_seconds(pid: u32) -> anyhow::Result<f64> {
    let stat =
        std::fs::read_to_string(format!("/proc/{pid}/stat")).with_context(|| format!("read /proc/{pid}/stat"))?;
    stat_cpu_seconds(&stat)
}

/// The CPU seconds in the text of a `/proc/<pid>/stat`.
fn stat_cpu_seconds(stat: &str) -> anyhow::Result<f64> {
    // After the command name in parentheses (which may hold spaces and parentheses itself):
    // state is field 3, utime and stime are fields 14 and 15.
    let rest = stat.rsplit_once(')').map(|(_, r)| r).context("no command name in /proc/<pid>/stat")?;
    let fields: Vec<&str> = rest.split_whitespace().collect();
    let ticks = |i: usize| -> anyhow::Result<f64> {
        Ok(fields.get(i - 3).context("a short /proc/<pid>/stat")?.parse::<u64>()? as f64)
    };
    Ok((ticks(14)? + ticks(15)?) / 100.0)
}

/// The records the enricher's `/metrics` counts as dead-lettered, on any topic.
pub(crate) fn dead_lettered(metrics: &str) -> f64 {
    metrics
        .lines()
        .filter(|l| l.starts_with("gpumedic_enricher_records_total{") && l.contains("outcome=\"dead_lettered\""))
        .filter_map(|l| l.rsplit(' ').next().and_then(|v| v.parse::<f64>().ok()))
        .sum()
}

/// The enricher's refusals of node authentication, per claimed node and reason, for an error.
pub(crate) fn refusals(metrics: &str) -> String {
    let lines: Vec<&str> =
        metrics.lines().filter(|l| l.starts_with("gpumedic_enricher_records_unauthenticated_total")).take(5).collect();
    if lines.is_empty() { "no node authentication refusals counted".to_owned() } else { lines.join("; ") }
}

/// The records in `topic` (the sum of its partitions' high watermarks: a topic of this run, never
/// truncated).
pub(crate) async fn records_in(bootstrap: &str, topic: &str) -> anyhow::Result<u64> {
    let (bootstrap, topic) = (bootstrap.to_owned(), topic.to_owned());
    tokio::task::spawn_blocking(move || -> anyhow::Result<u64> {
        let consumer: BaseConsumer = rdkafka::ClientConfig::new().set("bootstrap.servers", &bootstrap).create()?;
        let timeout = Duration::from_secs(10);
        let metadata = consumer.fetch_metadata(Some(&topic), timeout)?;
        let partitions: Vec<i32> =
            metadata.topics().iter().flat_map(|t| t.partitions().iter().map(|p| p.id())).collect();
        anyhow::ensure!(!partitions.is_empty(), "{topic} has no partitions");
        let mut total = 0u64;
        for p in partitions {
            let (low, high) = consumer.fetch_watermarks(&topic, p, timeout)?;
            total += u64::try_from(high - low).unwrap_or(0);
        }
        Ok(total)
    })
    .await?
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dead_lettered_sums_the_enrichers_dead_letter_outcomes_only() {
        let text = "gpumedic_enricher_records_total{topic=\"raw\",outcome=\"ok\"} 90\n\
                    gpumedic_enricher_records_total{topic=\"raw\",outcome=\"dead_lettered\"} 3\n\
                    gpumedic_enricher_records_total{outcome=\"dead_lettered\",topic=\"other\"} 2\n\
                    gpumedic_classifier_records_total{topic=\"raw\",outcome=\"dead_lettered\"} 7\n";
        assert_eq!(dead_lettered(text), 5.0);
        assert_eq!(dead_lettered("gpumedic_enricher_records_total{topic=\"raw\",outcome=\"ok\"} 90\n"), 0.0);
    }

    #[test]
    fn cpu_seconds_are_user_and_system_ticks_after_the_command_name() {
        let stat = "4242 (gpumedic (x) y) S 1 4242 4242 0 -1 4194560 900 0 0 0 250 75 0 0 20 0 9 0 100 0 0";
        assert_eq!(stat_cpu_seconds(stat).expect("parsed"), 3.25);
        assert!(stat_cpu_seconds("4242 gpumedic S 1").is_err());
        assert!(cpu_seconds(std::process::id()).is_ok(), "this process's own /proc/<pid>/stat reads");
    }
}
