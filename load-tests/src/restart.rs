//! `classifier-restart`: how long a classifier takes to come back, and how much memory it needs,
//! when PostgreSQL holds a day of a fleet's history, beside the raw read rate of the same rows.
//!
//! 1. A fresh database gets the classifier's migrations and a daily partition for every day of
//!    the history. The history is what the real collector sends: one NVML heartbeat per GPU every
//!    `--heartbeat` (60 s, the collector's default), and Xids at `--faults-per-hour` over the
//!    fleet, fatal ones (79, 48) among the harmless ones (13, 31), timestamped over the last
//!    `--history` and written with the classifier's own batch statement: every event with
//!    `--persist all`, or with `--persist evidence` (the classifier's default) the events its
//!    engine and keeper would have recorded from that stream (the first of each GPU, a keyframe
//!    per GPU every 6 hours, the Xids and what they bore on).
//! 2. Ceiling: the rebuild's own queries (every event of the window, node by node, oldest first)
//!    are read as text and counted by a plain client that does nothing with the rows.
//! 3. The classifier binary starts on empty topics with that database; one replica owns every
//!    partition, so it rebuilds every node. The clock runs from the process start until its first
//!    rebuild is done (`gpumedic_classifier_rebuild_seconds_count`); its peak resident memory
//!    (`VmHWM`) is read from `/proc` meanwhile, against the 1 GiB limit of the Kustomize base.

use std::time::{Duration, Instant};

use anyhow::Context as _;
use futures::TryStreamExt as _;
use gpumedic_classifier::store;
use gpumedic_runtime::kafka::{KafkaSettings, stage_topics};
use gpumedic_schemas::health::{Component, Detail, Entity, MonitorHealthDetail, MonitorState, Source, XidDetail};
use gpumedic_schemas::{EnrichedHealthEvent, HealthEvent};
use gpumedic_testkit as testkit;

use crate::classify::metric;

/// Options of the scenario.
#[derive(Debug, clap::Args)]
pub struct Options {
    /// Nodes in the fleet (8 GPUs each).
    #[arg(long, default_value_t = 1000)]
    nodes: usize,
    /// How much history PostgreSQL holds (the classifier rebuilds up to its --rebuild-window, 48 h).
    #[arg(long, default_value = "24h", value_parser = crate::duration)]
    history: Duration,
    /// The collector's heartbeat per GPU.
    #[arg(long, default_value = "60s", value_parser = crate::duration)]
    heartbeat: Duration,
    /// Xids per hour over the whole fleet.
    #[arg(long, default_value_t = 60)]
    faults_per_hour: u64,
    /// Rows per insert (the classifier's --batch-max).
    #[arg(long, default_value_t = 5000)]
    batch: usize,
    /// What the history holds, as the classifier's --persist: `all`, every event of the stream,
    /// or `evidence`, the events the classifier records by default (the stream through its
    /// engine and keeper).
    #[arg(long, default_value = "all", value_parser = gpumedic_classifier::persist::Policy::parse)]
    persist: gpumedic_classifier::persist::Policy,
    /// Keep the database at the end (by default it is dropped).
    #[arg(long)]
    keep: bool,
    /// Measure against a database a run with `--keep` left (its name, printed by that run)
    /// instead of writing the history again; it is kept.
    #[arg(long)]
    reuse_database: Option<String>,
    /// The classifier binary; by default the one built next to this program.
    #[arg(long)]
    classifier_bin: Option<std::path::PathBuf>,
}

/// The JSON result.
#[derive(Debug, serde::Serialize)]
pub struct Result {
    scenario: &'static str,
    nodes: usize,
    gpus: usize,
    history_hours: f64,
    persist: &'static str,
    /// Events of the fleet's stream over the history.
    streamed: u64,
    /// Of them, rows in `health_events`.
    events: u64,
    faults: u64,
    table_bytes: i64,
    write_seconds: f64,
    postgres_read_per_sec: f64,
    postgres_read_seconds: f64,
    classifier_ready_seconds: f64,
    classifier_rebuild_seconds: f64,
    classifier_replay_per_sec: f64,
    classifier_peak_rss_mib: f64,
    classifier_rss_after_mib: f64,
    owned_nodes: f64,
}

const GPUS_PER_NODE: usize = 8;
/// The Xids of the history, fatal and harmless, in the order they come round.
const XIDS: [i32; 6] = [13, 31, 79, 13, 48, 31];

fn gpu_entity(node: usize, gpu: usize) -> Entity {
    Entity {
        gpu_uuid: Some(format!("GPU-{node:08x}-{gpu:04x}-0000-0000-000000000000")),
        pci_bus_id: Some(format!("00000000:{:02x}:00.0", 0x18 + gpu)),
        ..Default::default()
    }
}

fn enriched(e: HealthEvent) -> EnrichedHealthEvent {
    let at = e.observed_at;
    crate::classify::enriched(e, at)
}

/// The events of one heartbeat round at `at`: a heartbeat per GPU of every node, and the Xids
/// that fall in this round (`faults` of them, on GPUs spread over the fleet by `round`).
fn round(nodes: usize, at: chrono::DateTime<chrono::Utc>, round: u64, faults: u64) -> Vec<EnrichedHealthEvent> {
    let mut out = Vec::with_capacity(nodes * GPUS_PER_NODE + faults as usize);
    for n in 0..nodes {
        for g in 0..GPUS_PER_NODE {
            let mut e = HealthEvent::new(
                format!("bench-node-{n:05}"),
                Source::Nvml,
                Component::Gpu,
                gpu_entity(n, g),
                Detail::MonitorHealth(MonitorHealthDetail {
                    monitor: "nvml".into(),
                    state: MonitorState::Ok,
                    message: None,
                }),
            );
            e.healthy = true;
            e.observed_at = at + chrono::Duration::milliseconds((n * GPUS_PER_NODE + g) as i64 % 1000);
            out.push(enriched(e));
        }
    }
    for f in 0..faults {
        let k = round.wrapping_mul(7919).wrapping_add(f.wrapping_mul(104_729));
        let n = (k % nodes as u64) as usize;
        let g = (k / nodes as u64 % GPUS_PER_NODE as u64) as usize;
        let code = XIDS[(k % XIDS.len() as u64) as usize];
        let mut e = HealthEvent::new(
            format!("bench-node-{n:05}"),
            Source::KernelLog,
            Component::Gpu,
            gpu_entity(n, g),
            Detail::Xid(XidDetail {
                code,
                text: format!("NVRM: Xid (PCI:0000:{:02x}:00): {code}, pid=1234, name=python", 0x18 + g),
                pid: Some(1234),
                process: Some("python".into()),
                nvlink5: None,
                recovery_action: None,
            }),
        );
        e.observed_at = at + chrono::Duration::milliseconds(1500 + f as i64);
        out.push(enriched(e));
    }
    out
}

/// Writes `--history` of the fleet's events into the fresh database at `url`, oldest first (those
/// `--persist` records); returns the events of the stream, the rows written, the Xids among them
/// and the seconds it took.
async fn write_history(
    o: &Options,
    url: &str,
    now: chrono::DateTime<chrono::Utc>,
) -> anyhow::Result<(u64, u64, u64, f64)> {
    use gpumedic_classifier::persist::{Keeper, Policy};
    use gpumedic_classifier::rules::{Engine, defaults};
    let pool = gpumedic_classifier::connect_and_migrate(url, 1).await?;

    // A daily partition for every day of the history, as the retention job keeps them.
    let start = now - chrono::Duration::from_std(o.history)?;
    let mut day = start.date_naive();
    while day < now.date_naive() {
        let name = format!("health_events_p{}", day.format("%Y%m%d"));
        let next = day.succ_opt().context("date")?;
        sqlx::query(sqlx::AssertSqlSafe(format!(
            "CREATE TABLE IF NOT EXISTS {name} PARTITION OF health_events FOR VALUES FROM ('{day}') TO ('{next}')"
        )))
        .execute(&pool)
        .await
        .with_context(|| format!("creating partition {name}"))?;
        day = next;
    }

    // The history, one heartbeat round at a time, in batches of --batch.
    let rounds = (o.history.as_secs() / o.heartbeat.as_secs().max(1)).max(1);
    let faults_per_round = o.faults_per_hour as f64 * o.heartbeat.as_secs_f64() / 3600.0;
    let gpus = o.nodes * GPUS_PER_NODE;
    println!(
        "classifier-restart: writing {} h of history for {} nodes ({gpus} GPUs): {rounds} heartbeat rounds, about {} events",
        o.history.as_secs_f64() / 3600.0,
        o.nodes,
        rounds * gpus as u64
    );
    // Under `evidence`, what the classifier's engine and keeper record of the stream, with its
    // default rebuild window (so a keyframe per key every 6 hours). Rollups are dropped: the
    // rebuild does not read them.
    let mut filter = match o.persist {
        Policy::All => None,
        Policy::Evidence => Some((
            Engine::new(defaults::rule_set().map_err(|e| anyhow::anyhow!("{e:?}"))?),
            Keeper::for_rebuild_window(Policy::Evidence, Duration::from_secs(48 * 3600)),
        )),
    };
    let writing = Instant::now();
    let (mut streamed, mut events, mut faults, mut owed) = (0u64, 0u64, 0u64, 0.0f64);
    let mut rows = store::EventRows::with_capacity(o.batch);
    let mut last_report = Instant::now();
    for r in 0..rounds {
        owed += faults_per_round;
        let due = owed.floor() as u64;
        owed -= due as f64;
        let at = start + chrono::Duration::from_std(o.heartbeat * r as u32)?;
        for e in round(o.nodes, at, r, due) {
            streamed += 1;
            if let Some((engine, keeper)) = &mut filter {
                let obs = gpumedic_classifier::observe::observation(&e);
                let (_, bearing) = engine.observe_bearing(&obs);
                if !keeper.keep(&obs, bearing) {
                    continue;
                }
            }
            rows.push(&e)?;
            events += 1;
            if rows.len() >= o.batch {
                let full = std::mem::replace(&mut rows, store::EventRows::with_capacity(o.batch));
                store::write_batch(&pool, &store::Batch { events: full, ..Default::default() }).await?;
            }
        }
        faults += due;
        if let Some((_, keeper)) = &mut filter {
            keeper.closed(usize::MAX);
        }
        if last_report.elapsed() >= Duration::from_secs(30) {
            println!(
                "  {streamed} events of the stream, {events} written ({:.0}/s)",
                streamed as f64 / writing.elapsed().as_secs_f64()
            );
            last_report = Instant::now();
        }
    }
    if !rows.is_empty() {
        store::write_batch(&pool, &store::Batch { events: rows, ..Default::default() }).await?;
    }
    let write_seconds = writing.elapsed().as_secs_f64();
    sqlx::query("VACUUM ANALYZE health_events").execute(&pool).await?;
    println!(
        "  written: {events} of the stream's {streamed} events (--persist {}, {faults} Xids) in {write_seconds:.0} s",
        o.persist.as_str()
    );
    pool.close().await;
    Ok((streamed, events, faults, write_seconds))
}

/// Runs the scenario and prints one line per figure.
pub async fn run(o: Options) -> anyhow::Result<Result> {
    let bootstrap = testkit::require_kafka().await?;
    let admin = testkit::require_postgres().await?;
    let now = chrono::Utc::now();
    let (db, url, streamed, events, faults, write_seconds) = match &o.reuse_database {
        Some(db) => {
            let base = testkit::database_url();
            let url = format!("{}/{db}", base.rsplit_once('/').map_or(base.as_str(), |(p, _)| p));
            let pool = gpumedic_runtime::postgres::connect(&url, 1).await?;
            let events: i64 = sqlx::query_scalar("SELECT count(*) FROM health_events").fetch_one(&pool).await?;
            let faults: i64 =
                sqlx::query_scalar("SELECT count(*) FROM health_events WHERE xid IS NOT NULL").fetch_one(&pool).await?;
            pool.close().await;
            println!("classifier-restart: reusing database {db}: {events} events ({faults} Xids)");
            (db.clone(), url, events as u64, events as u64, faults as u64, 0.0)
        }
        None => {
            let db = testkit::unique_name("bench_restart").replace('-', "_");
            let url = testkit::fresh_database(&admin, &db).await?;
            let (streamed, events, faults, write_seconds) = write_history(&o, &url, now).await?;
            println!("  database {db}");
            (db, url, streamed, events, faults, write_seconds)
        }
    };
    let pool = gpumedic_runtime::postgres::connect(&url, 1).await?;
    let table_bytes: i64 = sqlx::query_scalar(
        "SELECT COALESCE(sum(pg_total_relation_size(inhrelid)), 0)::bigint FROM pg_inherits
          WHERE inhparent = 'health_events'::regclass",
    )
    .fetch_one(&pool)
    .await?;
    println!("  health_events: {:.1} GiB with indexes", table_bytes as f64 / (1u64 << 30) as f64);

    // Ceiling: the rebuild's query, read and counted, nothing else.
    let reading = Instant::now();
    let since = now - chrono::Duration::hours(48);
    let nodes = store::nodes_since(&pool, since).await?;
    let mut read = 0u64;
    for node in &nodes {
        let mut stream = sqlx::query_scalar::<_, String>(
            "SELECT h.record::text FROM health_events h WHERE h.node = $2 AND h.observed_at >= $1
              ORDER BY h.observed_at, h.event_id",
        )
        .bind(since)
        .bind(node)
        .fetch(&pool);
        while stream.try_next().await?.is_some() {
            read += 1;
        }
    }
    let postgres_read_seconds = reading.elapsed().as_secs_f64();
    let postgres_read_per_sec = read as f64 / postgres_read_seconds;
    anyhow::ensure!(read == events, "the ceiling read {read} rows, {events} were written");
    println!(
        "  postgres read (the rebuild's query, rows counted): {postgres_read_per_sec:>9.0} rows/s ({postgres_read_seconds:.1} s)"
    );
    pool.close().await;

    // The classifier binary, one replica, empty topics.
    let bin = match o.classifier_bin {
        Some(b) => b,
        None => std::env::current_exe()?.with_file_name("gpumedic-classifier"),
    };
    anyhow::ensure!(bin.is_file(), "{} is missing: `cargo build --release -p gpumedic-classifier`", bin.display());
    let settings =
        KafkaSettings { bootstrap: bootstrap.clone(), options: vec![], schema_registry: None, topic_replication: None };
    let enriched_topic = testkit::unique_name("bench-restart-enriched");
    let verdicts = testkit::unique_name("bench-restart-verdicts");
    let actions = testkit::unique_name("bench-restart-actions");
    settings.ensure_topics(&stage_topics(&[&enriched_topic, &actions], &[&verdicts], 12)).await?;
    let started = Instant::now();
    let mut classifier = testkit::ServiceProcess::start(
        bin.to_str().context("binary path")?,
        &[],
        &[
            ("GPUMEDIC_KAFKA_BOOTSTRAP", bootstrap.clone()),
            ("GPUMEDIC_GROUP", testkit::unique_name("bench-restart")),
            ("GPUMEDIC_DATABASE_URL", url.clone()),
            ("GPUMEDIC_ENRICHED_TOPIC", enriched_topic.clone()),
            ("GPUMEDIC_VERDICTS_TOPIC", verdicts.clone()),
            ("GPUMEDIC_ACTIONS_TOPIC", actions.clone()),
            ("GPUMEDIC_LOG", "warn".into()),
        ],
    )?;
    let pid = classifier.pid();
    let deadline = started + Duration::from_secs(1800);
    let mut ready_seconds = None;
    let metrics = loop {
        if let Some(status) = classifier.try_wait()? {
            anyhow::bail!("the classifier exited during the rebuild with {status}");
        }
        if ready_seconds.is_none()
            && matches!(testkit::http_get(classifier.admin_addr(), "/readyz").await, Ok((200, _)))
        {
            ready_seconds = Some(started.elapsed().as_secs_f64());
        }
        if let Ok((_, text)) = testkit::http_get(classifier.admin_addr(), "/metrics").await
            && metric(&text, "gpumedic_classifier_rebuild_seconds_count") >= 1.0
        {
            break text;
        }
        anyhow::ensure!(Instant::now() < deadline, "the classifier did not rebuild within 30 minutes");
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    let total = started.elapsed().as_secs_f64();
    let peak_rss = crate::procs::status_mib(pid, "VmHWM:");
    let rss_after = crate::procs::status_mib(pid, "VmRSS:");
    let rebuild_seconds = metric(&metrics, "gpumedic_classifier_rebuild_seconds_sum");
    let owned_nodes = metric(&metrics, "gpumedic_classifier_owned_nodes");
    let status = classifier.terminate(Duration::from_secs(30)).await.map_err(anyhow::Error::msg)?;
    anyhow::ensure!(status.success(), "the classifier exited with {status}");
    let replay_per_sec = events as f64 / rebuild_seconds.max(f64::EPSILON);
    println!(
        "  classifier: rebuilt {owned_nodes:.0} nodes from {events} events in {rebuild_seconds:.1} s ({replay_per_sec:.0} events/s), \
         {total:.1} s from process start; peak RSS {peak_rss:.0} MiB (limit 1024 MiB), {rss_after:.0} MiB after"
    );
    // A kept database holds the fleet it was written for, whatever --nodes says now.
    let nodes = if o.reuse_database.is_some() { owned_nodes as usize } else { o.nodes };
    if !o.keep && o.reuse_database.is_none() {
        sqlx::query(sqlx::AssertSqlSafe(format!("DROP DATABASE \"{db}\" WITH (FORCE)"))).execute(&admin).await.ok();
    }
    Ok(Result {
        scenario: "classifier-restart",
        nodes,
        gpus: nodes * GPUS_PER_NODE,
        history_hours: o.history.as_secs_f64() / 3600.0,
        persist: o.persist.as_str(),
        streamed,
        events,
        faults,
        table_bytes,
        write_seconds,
        postgres_read_per_sec,
        postgres_read_seconds,
        classifier_ready_seconds: ready_seconds.unwrap_or(total),
        classifier_rebuild_seconds: rebuild_seconds,
        classifier_replay_per_sec: replay_per_sec,
        classifier_peak_rss_mib: peak_rss,
        classifier_rss_after_mib: rss_after,
        owned_nodes,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_round_is_a_heartbeat_per_gpu_and_its_faults() {
        let at = chrono::Utc::now();
        let events = round(3, at, 5, 2);
        assert_eq!(events.len(), 3 * GPUS_PER_NODE + 2);
        let beats = events.iter().filter(|e| matches!(e.event.detail, Detail::MonitorHealth(_))).count();
        assert_eq!(beats, 3 * GPUS_PER_NODE);
        let ids: std::collections::HashSet<_> = events.iter().map(|e| e.event.event_id).collect();
        assert_eq!(ids.len(), events.len(), "every event has its own id");
        assert!(events.iter().filter(|e| !e.event.healthy).all(|e| matches!(e.event.detail, Detail::Xid(_))));
    }
}
