//! `scale-out`: the enricher and the classifier as R replicas each (`--replicas 1,2,4`), every
//! replica count on 12-partition topics of its own, and the events per second at each count
//! beside the count of one: the speed-up, and the efficiency (speed-up over R).
//!
//! Kafka consumer groups are the distribution engine: the R enrichers join one group on the raw
//! topic, the R classifiers one group on the enriched topic, and the broker's group coordinator
//! hands each member its partitions. Nothing in the scenario or the services splits the work
//! otherwise. The classifiers share one database; each owns the state of the nodes of its
//! partitions and rebuilds it on assignment (docs/pipeline.md, "classifier").
//!
//! 1. Kafka ceiling: `kafka-ceiling` on records of the raw events' size, once, in the same run.
//! 2. For each replica count R: fresh raw and enriched topics of [`topics::DEFAULT_PARTITIONS`]
//!    (12) partitions, a fresh database, R release enrichers in one new consumer group and R
//!    release classifiers in another, each replica with its own admin port. Both groups must be
//!    stable with R members, each holding partitions, before the first produce, so no record is
//!    caught in a rebalance.
//! 3. N raw events from the simulated fleet ([`crate::fleet`], as `pipeline-throughput` builds
//!    them) are produced as fast as Kafka takes them; the clock runs from the first produce until
//!    the sum over the classifier replicas of `gpumedic_classifier_events_total` reaches N. A
//!    count fails unless exactly N events were classified and the raw topic's dead-letter topic
//!    is empty.
//!
//! Each replica's share of the events (its own `gpumedic_enricher_events_total` or
//! `gpumedic_classifier_events_total` over N) shows how the group spread the partitions, and the
//! CPU time of every replica, read from `/proc` at the first produce and when the clock stops, is
//! summed per event: on a machine whose cores the services share with Kafka and PostgreSQL, a
//! steadier measure than the rate.

use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context as _;
use gpumedic_runtime::kafka;
use gpumedic_schemas::{HealthEvent, topics};
use gpumedic_testkit as testkit;
use rdkafka::producer::{BaseRecord, Producer as _};

use crate::fleet::{self, Fleet};
use crate::pipeline::{cpu_seconds, dead_lettered, records_in, refusals};

/// How long the replicas may take to be ready, and each consumer group to be stable.
const START_TIMEOUT: Duration = Duration::from_secs(120);
/// How long one replica count may take to classify every event.
const RUN_TIMEOUT: Duration = Duration::from_secs(900);

/// Options of the scenario.
#[derive(Debug, clap::Args)]
pub struct Options {
    /// The replica counts to measure, in order, each for the enricher and the classifier alike.
    /// The speed-up is over the count 1 (over the first count when 1 is not asked).
    #[arg(long, value_delimiter = ',', default_value = "1,2,4")]
    replicas: Vec<usize>,
    /// Raw events through the pipeline at each replica count.
    #[arg(long, default_value_t = 200_000)]
    events: usize,
    /// Nodes in the simulated fleet (8 GPUs each).
    #[arg(long, default_value_t = 1000)]
    nodes: usize,
    /// The classifiers' --persist: `evidence` (its default) or `all`.
    #[arg(long, default_value = "evidence")]
    persist: String,
    /// The chance that an event of the stream starts a fault (the fleet's mix).
    #[arg(long, default_value_t = 0.01)]
    fault_chance: f64,
    /// Seed of the fleet's generator.
    #[arg(long, default_value_t = 1)]
    seed: u64,
}

/// The JSON result.
#[derive(Debug, serde::Serialize)]
pub struct Result {
    scenario: &'static str,
    events: usize,
    nodes: usize,
    /// Partitions of the raw and of the enriched topic.
    partitions: i32,
    raw_bytes_per_event: usize,
    /// The classifiers' --persist.
    persist: String,
    kafka_produce_per_sec: f64,
    kafka_consume_per_sec: f64,
    /// The machine's load averages (1, 5, 15 minutes) when the scenario ended.
    load_average: Option<[f64; 3]>,
    /// One row per replica count, in the order measured.
    runs: Vec<Row>,
}

/// What one replica count measured, before it is compared with the others.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Measured {
    /// Replicas of the enricher, and of the classifier.
    pub(crate) replicas: usize,
    /// Events produced (and classified).
    pub(crate) events: usize,
    /// From the first produce until the classifiers' events summed to `events`.
    pub(crate) seconds: f64,
    /// CPU seconds each enricher replica spent while the clock ran.
    pub(crate) enricher_cpu: Vec<f64>,
    /// CPU seconds each classifier replica spent while the clock ran.
    pub(crate) classifier_cpu: Vec<f64>,
    /// Each enricher replica's `gpumedic_enricher_events_total` at the end.
    pub(crate) enricher_events: Vec<f64>,
    /// Each classifier replica's `gpumedic_classifier_events_total` at the end.
    pub(crate) classifier_events: Vec<f64>,
    /// Rows in `health_events` (in the one database the classifiers share).
    pub(crate) rows: i64,
    /// Records in the raw topic's dead-letter topic.
    pub(crate) dead_lettered: u64,
    /// The enrichers' `gpumedic_enricher_gpu_unresolved_total`, summed.
    pub(crate) gpu_unresolved: u64,
}

/// One replica count's figures, compared with the baseline count (1, or the first measured).
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct Row {
    /// Replicas of the enricher, and of the classifier.
    pub replicas: usize,
    /// Events per second through the pipeline.
    pub events_per_sec: f64,
    /// Seconds from the first produce until the last event was classified.
    pub seconds: f64,
    /// Events per second over the baseline count's.
    pub speedup: f64,
    /// The speed-up per replica, scaled to the baseline count: 1.0 is linear scaling.
    pub efficiency: f64,
    /// CPU µs per event of all enricher replicas together.
    pub enricher_cpu_us_per_event: f64,
    /// CPU µs per event of all classifier replicas together.
    pub classifier_cpu_us_per_event: f64,
    /// Both services together.
    pub cpu_us_per_event: f64,
    /// Each enricher replica's fraction of the events.
    pub enricher_shares: Vec<f64>,
    /// Each classifier replica's fraction of the events.
    pub classifier_shares: Vec<f64>,
    /// The busiest classifier replica's share over an even share (1/R): 1.0 is a perfect spread.
    pub classifier_imbalance: f64,
    /// Rows in `health_events`.
    pub rows: i64,
    /// Records dead-lettered (the run fails unless 0).
    pub dead_lettered: u64,
    /// GPU references the enrichers could not resolve.
    pub gpu_unresolved: u64,
}

/// Each value's fraction of `total` (zeros when `total` is 0).
pub(crate) fn shares(values: &[f64], total: f64) -> Vec<f64> {
    values.iter().map(|v| if total > 0.0 { v / total } else { 0.0 }).collect()
}

/// The largest share over an even share of `shares.len()` replicas: 1.0 when the work is spread
/// evenly, R when one replica did everything.
pub(crate) fn imbalance(shares: &[f64]) -> f64 {
    shares.iter().copied().fold(0.0, f64::max) * shares.len() as f64
}

/// Compares the replica counts measured: the speed-up and efficiency of each over the count 1,
/// or over the first count measured when 1 is not among them.
pub(crate) fn summarize(measured: &[Measured]) -> Vec<Row> {
    let rate = |m: &Measured| if m.seconds > 0.0 { m.events as f64 / m.seconds } else { 0.0 };
    let baseline = measured.iter().find(|m| m.replicas == 1).or(measured.first());
    let (base_rate, base_replicas) = baseline.map_or((0.0, 1), |b| (rate(b), b.replicas.max(1)));
    measured
        .iter()
        .map(|m| {
            let events_per_sec = rate(m);
            let speedup = if base_rate > 0.0 { events_per_sec / base_rate } else { 0.0 };
            let per_event = |cpu: &[f64]| cpu.iter().sum::<f64>() * 1e6 / m.events.max(1) as f64;
            let total = m.events as f64;
            let classifier_shares = shares(&m.classifier_events, total);
            Row {
                replicas: m.replicas,
                events_per_sec,
                seconds: m.seconds,
                speedup,
                efficiency: speedup * base_replicas as f64 / m.replicas.max(1) as f64,
                enricher_cpu_us_per_event: per_event(&m.enricher_cpu),
                classifier_cpu_us_per_event: per_event(&m.classifier_cpu),
                cpu_us_per_event: per_event(&m.enricher_cpu) + per_event(&m.classifier_cpu),
                enricher_shares: shares(&m.enricher_events, total),
                classifier_imbalance: imbalance(&classifier_shares),
                classifier_shares,
                rows: m.rows,
                dead_lettered: m.dead_lettered,
                gpu_unresolved: m.gpu_unresolved,
            }
        })
        .collect()
}

/// Runs the scenario and prints a table of the replica counts.
pub async fn run(o: Options) -> anyhow::Result<Result> {
    anyhow::ensure!(!o.replicas.is_empty(), "--replicas names no replica count");
    anyhow::ensure!(o.replicas.iter().all(|&r| r >= 1), "--replicas: each count must be at least 1");
    let partitions = topics::DEFAULT_PARTITIONS;
    if let Some(&r) = o.replicas.iter().find(|&&r| r > partitions as usize) {
        anyhow::bail!("--replicas {r}: more replicas than the {partitions} partitions would leave some idle");
    }
    let bootstrap = testkit::require_kafka().await?;
    let admin_db = testkit::require_postgres().await?;
    let mut fleet = Fleet::new(fleet::Settings {
        prefix: "scale-node".to_owned(),
        nodes: o.nodes,
        intervals: fleet::Intervals::COLLECTOR,
        fault_chance: o.fault_chance,
        seed: o.seed,
        start: chrono::Utc::now(),
        xid_names: fleet::XidNames::Pci,
    })?;
    let mut events: Vec<HealthEvent> = (0..o.events).map(|_| fleet.next_event()).collect();
    // The fleet's own event times, shifted so the stream ends ten minutes ago.
    let shift = fleet::micros(chrono::Utc::now() - chrono::Duration::minutes(10)) - fleet.clock();
    events.iter_mut().for_each(|e| e.observed_at += shift);
    let raw: Vec<(String, Vec<u8>)> =
        events.iter().map(|e| Ok((e.node.clone(), gpumedic_schemas::encode(e)?))).collect::<anyhow::Result<_>>()?;
    drop(events);
    drop(fleet);
    let raw = Arc::new(raw);
    let bytes = raw.iter().map(|(_, b)| b.len()).sum::<usize>() / raw.len().max(1);
    println!(
        "scale-out: {} raw events of {bytes} B from {} simulated collectors, {partitions} partitions per topic, \
         replica counts {:?}",
        o.events, o.nodes, o.replicas
    );
    let ceiling = crate::kafka_ceiling(o.events, bytes, partitions).await?;
    println!(
        "  kafka passthrough (raw): produce {:.0}/s, consume {:.0}/s",
        ceiling.produce_per_sec, ceiling.consume_per_sec
    );

    let mut measured = Vec::new();
    for &replicas in &o.replicas {
        let m = pass(&bootstrap, &admin_db, &raw, &o.persist, replicas).await?;
        println!(
            "  {replicas} replica(s): {:.0} events/s ({} in {:.1} s), classifier shares {:?}",
            m.events as f64 / m.seconds,
            m.events,
            m.seconds,
            shares(&m.classifier_events, m.events as f64).iter().map(|s| format!("{:.2}", s)).collect::<Vec<_>>()
        );
        measured.push(m);
    }
    let runs = summarize(&measured);
    print!("{}", table(&runs));
    let load_average = load_average();
    if let Some([one, five, fifteen]) = load_average {
        println!("  load average at the end: {one:.2} {five:.2} {fifteen:.2}");
    }
    Ok(Result {
        scenario: "scale-out",
        events: o.events,
        nodes: o.nodes,
        partitions,
        raw_bytes_per_event: bytes,
        persist: o.persist,
        kafka_produce_per_sec: ceiling.produce_per_sec,
        kafka_consume_per_sec: ceiling.consume_per_sec,
        load_average,
        runs,
    })
}

/// The rows as a Markdown table, one line per replica count.
pub(crate) fn table(rows: &[Row]) -> String {
    let mut out = String::from(
        "| replicas | events/s | speed-up | efficiency | CPU µs/event (enricher + classifier) | classifier shares | \
         enricher shares |\n|---|---|---|---|---|---|---|\n",
    );
    let list = |s: &[f64]| s.iter().map(|v| format!("{:.0}%", v * 100.0)).collect::<Vec<_>>().join(" / ");
    for r in rows {
        out.push_str(&format!(
            "| {} | {:.0} | {:.2} | {:.2} | {:.1} ({:.1} + {:.1}) | {} | {} |\n",
            r.replicas,
            r.events_per_sec,
            r.speedup,
            r.efficiency,
            r.cpu_us_per_event,
            r.enricher_cpu_us_per_event,
            r.classifier_cpu_us_per_event,
            list(&r.classifier_shares),
            list(&r.enricher_shares),
        ));
    }
    out
}

/// The load averages of `/proc/loadavg`, if it reads.
fn load_average() -> Option<[f64; 3]> {
    let text = std::fs::read_to_string("/proc/loadavg").ok()?;
    let mut fields = text.split_whitespace().map(|f| f.parse::<f64>().ok());
    Some([fields.next()??, fields.next()??, fields.next()??])
}

/// The consumer group a service environment from [`crate::service_env`] names.
fn group_of(env: &[(&'static str, String)]) -> anyhow::Result<String> {
    env.iter()
        .find(|(k, _)| *k == "GPUMEDIC_GROUP")
        .map(|(_, v)| v.clone())
        .context("the service environment names no consumer group")
}

/// One replica count: `replicas` enrichers and classifiers on topics, groups and a database of
/// their own, `raw` produced through them.
async fn pass(
    bootstrap: &str,
    admin_db: &sqlx::PgPool,
    raw: &Arc<Vec<(String, Vec<u8>)>>,
    persist: &str,
    replicas: usize,
) -> anyhow::Result<Measured> {
    let events = raw.len();
    let crate::pipeline::Stages { raw_topic, url, mut enricher_env, classifier_env, .. } =
        crate::pipeline::Stages::new(bootstrap, admin_db, "bench-scale", persist).await?;
    enricher_env.push(("GPUMEDIC_NODE_AUTH", "off".to_owned()));
    let enricher_binary = crate::release_binary("gpumedic-enricher")?;
    let classifier_binary = crate::release_binary("gpumedic-classifier")?;
    // Every replica of a service with the same environment, so the same consumer group; each
    // gets an admin port of its own from `ServiceProcess::start`.
    let mut enrichers = Vec::with_capacity(replicas);
    let mut classifiers = Vec::with_capacity(replicas);
    for _ in 0..replicas {
        enrichers.push(testkit::ServiceProcess::start(&enricher_binary, &[], &enricher_env)?);
        classifiers.push(testkit::ServiceProcess::start(&classifier_binary, &[], &classifier_env)?);
    }
    let measured =
        measure(bootstrap, raw, &raw_topic, &enricher_env, &classifier_env, &mut enrichers, &mut classifiers)
            .await
            .with_context(|| format!("{replicas} replica(s)"));
    for s in enrichers.iter_mut().chain(classifiers.iter_mut()) {
        let _ = s.terminate(Duration::from_secs(20)).await;
    }
    let mut m = measured?;
    let pool = gpumedic_runtime::postgres::connect(&url, 1).await?;
    m.rows = sqlx::query_scalar("SELECT count(*) FROM health_events").fetch_one(&pool).await?;
    pool.close().await;
    if persist == "all" {
        anyhow::ensure!(m.rows == events as i64, "{} rows in health_events, {events} events produced", m.rows);
    } else {
        anyhow::ensure!(m.rows <= events as i64, "{} rows in health_events, {events} events produced", m.rows);
    }
    Ok(m)
}

/// Waits for the replicas and their groups, produces `raw` and clocks it through them.
async fn measure(
    bootstrap: &str,
    raw: &Arc<Vec<(String, Vec<u8>)>>,
    raw_topic: &str,
    enricher_env: &[(&'static str, String)],
    classifier_env: &[(&'static str, String)],
    enrichers: &mut [testkit::ServiceProcess],
    classifiers: &mut [testkit::ServiceProcess],
) -> anyhow::Result<Measured> {
    let (events, replicas) = (raw.len(), enrichers.len());
    for s in enrichers.iter_mut().chain(classifiers.iter_mut()) {
        s.wait_ready(START_TIMEOUT).await.map_err(anyhow::Error::msg)?;
    }
    // Every member holds its partitions before the first record, so none is caught in a
    // rebalance and each replica's share is that of a settled group.
    for group in [group_of(enricher_env)?, group_of(classifier_env)?] {
        testkit::wait_group_stable(&group, replicas, START_TIMEOUT)
            .await
            .map_err(|e| anyhow::anyhow!("consumer group {group} did not settle: {e}"))?;
    }

    let producer = Arc::new(crate::scratch_producer(bootstrap)?);
    let cpu =
        |ps: &[testkit::ServiceProcess]| ps.iter().map(|p| cpu_seconds(p.pid())).collect::<anyhow::Result<Vec<_>>>();
    let (enricher_before, classifier_before) = (cpu(enrichers)?, cpu(classifiers)?);
    let start = Instant::now();
    let producing = {
        let (producer, raw, topic) = (producer.clone(), raw.clone(), raw_topic.to_owned());
        std::thread::spawn(move || -> anyhow::Result<()> {
            for (key, payload) in raw.iter() {
                crate::send(&producer, BaseRecord::to(&topic).key(key.as_str()).payload(payload.as_slice()))?;
            }
            producer.flush(Duration::from_secs(120)).context("flush")
        })
    };
    let deadline = start + RUN_TIMEOUT;
    let mut producing = Some(producing);
    let mut classifier_events;
    for poll in 0u64.. {
        classifier_events = metric_per_replica(classifiers, "gpumedic_classifier_events_total").await?;
        if classifier_events.iter().sum::<f64>() >= events as f64 {
            break;
        }
        if producing.as_ref().is_some_and(|p| p.is_finished())
            && let Some(p) = producing.take()
        {
            p.join().map_err(|_| anyhow::anyhow!("the producer thread panicked"))??;
        }
        // Once a second: a record an enricher dead-lettered is never classified, so stop early.
        if poll % 10 == 9 {
            for e in enrichers.iter() {
                let (_, text) = testkit::http_get(e.admin_addr(), "/metrics").await?;
                let refused = dead_lettered(&text);
                anyhow::ensure!(refused == 0.0, "an enricher dead-lettered {refused} records: {}", refusals(&text));
            }
        }
        anyhow::ensure!(Instant::now() < deadline, "the pipeline did not finish within {RUN_TIMEOUT:?}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let seconds = start.elapsed().as_secs_f64();
    let since = |after: Vec<f64>, before: &[f64]| after.iter().zip(before).map(|(a, b)| a - b).collect::<Vec<_>>();
    let enricher_cpu = since(cpu(enrichers)?, &enricher_before);
    let classifier_cpu = since(cpu(classifiers)?, &classifier_before);
    if let Some(p) = producing {
        p.join().map_err(|_| anyhow::anyhow!("the producer thread panicked"))??;
    }
    // Settled: a classifier counting one event more after the clock stopped would be a duplicate.
    let classifier_events = metric_per_replica(classifiers, "gpumedic_classifier_events_total").await?;
    let enricher_events = metric_per_replica(enrichers, "gpumedic_enricher_events_total").await?;
    let gpu_unresolved =
        metric_per_replica(enrichers, "gpumedic_enricher_gpu_unresolved_total").await?.iter().sum::<f64>();
    let dlq = kafka::dead_letter_topic(raw_topic);
    let dead = records_in(bootstrap, &dlq).await?;
    anyhow::ensure!(dead == 0, "{dead} records in {dlq}: the enrichers refused them");
    let classified = classifier_events.iter().sum::<f64>();
    anyhow::ensure!(classified == events as f64, "{classified} events classified, {events} produced");
    Ok(Measured {
        replicas,
        events,
        seconds,
        enricher_cpu,
        classifier_cpu,
        enricher_events,
        classifier_events,
        rows: 0,
        dead_lettered: dead,
        gpu_unresolved: gpu_unresolved as u64,
    })
}

/// Metric `name` (summed over its labels) on each of `services`' `/metrics`, in their order.
async fn metric_per_replica(services: &[testkit::ServiceProcess], name: &str) -> anyhow::Result<Vec<f64>> {
    let mut values = Vec::with_capacity(services.len());
    for s in services {
        let (_, text) = testkit::http_get(s.admin_addr(), "/metrics").await?;
        values.push(crate::classify::metric(&text, name));
    }
    Ok(values)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn measured(replicas: usize, seconds: f64, classifier_events: Vec<f64>) -> Measured {
        Measured {
            replicas,
            events: 1000,
            seconds,
            enricher_cpu: vec![0.5 / replicas as f64; replicas],
            classifier_cpu: vec![1.0 / replicas as f64; replicas],
            enricher_events: vec![1000.0 / replicas as f64; replicas],
            classifier_events,
            rows: 10,
            dead_lettered: 0,
            gpu_unresolved: 0,
        }
    }

    #[test]
    fn speedup_and_efficiency_are_over_one_replica() {
        let rows = summarize(&[
            measured(1, 1.0, vec![1000.0]),
            measured(2, 0.8, vec![500.0, 500.0]),
            measured(4, 0.5, vec![400.0, 200.0, 200.0, 200.0]),
        ]);
        assert_eq!(rows.iter().map(|r| r.events_per_sec).collect::<Vec<_>>(), [1000.0, 1250.0, 2000.0]);
        assert_eq!(rows.iter().map(|r| r.speedup).collect::<Vec<_>>(), [1.0, 1.25, 2.0]);
        assert_eq!(rows.iter().map(|r| r.efficiency).collect::<Vec<_>>(), [1.0, 0.625, 0.5]);
        // CPU summed over the replicas: 0.5 s and 1.0 s over 1000 events, whatever the count.
        for r in &rows {
            assert!((r.enricher_cpu_us_per_event - 500.0).abs() < 1e-6, "{r:?}");
            assert!((r.classifier_cpu_us_per_event - 1000.0).abs() < 1e-6, "{r:?}");
            assert!((r.cpu_us_per_event - 1500.0).abs() < 1e-6, "{r:?}");
        }
    }

    #[test]
    fn without_one_replica_the_first_count_is_the_baseline() {
        let rows = summarize(&[measured(2, 1.0, vec![500.0, 500.0]), measured(4, 0.5, vec![250.0; 4])]);
        assert_eq!(rows.iter().map(|r| r.speedup).collect::<Vec<_>>(), [1.0, 2.0]);
        // Doubling the replicas doubled the rate: linear from the baseline of 2.
        assert_eq!(rows.iter().map(|r| r.efficiency).collect::<Vec<_>>(), [1.0, 1.0]);
        // The baseline is 1 even when measured after the others.
        let rows = summarize(&[measured(2, 0.5, vec![500.0, 500.0]), measured(1, 1.0, vec![1000.0])]);
        assert_eq!(rows.iter().map(|r| (r.speedup, r.efficiency)).collect::<Vec<_>>(), [(2.0, 1.0), (1.0, 1.0)]);
        assert!(summarize(&[]).is_empty());
    }

    #[test]
    fn shares_show_how_the_group_spread_the_partitions() {
        let rows = summarize(&[measured(4, 0.5, vec![400.0, 200.0, 200.0, 200.0])]);
        assert_eq!(rows[0].classifier_shares, [0.4, 0.2, 0.2, 0.2]);
        assert_eq!(rows[0].enricher_shares, [0.25; 4]);
        // The busiest replica did 40%, an even share is 25%.
        assert!((rows[0].classifier_imbalance - 1.6).abs() < 1e-9);
        assert_eq!(imbalance(&[0.5, 0.5]), 1.0);
        assert_eq!(imbalance(&[1.0, 0.0]), 2.0);
        assert_eq!(shares(&[3.0, 1.0], 0.0), [0.0, 0.0]);
    }

    #[test]
    fn the_table_has_a_line_per_replica_count() {
        let rows = summarize(&[measured(1, 1.0, vec![1000.0]), measured(2, 0.8, vec![600.0, 400.0])]);
        let table = table(&rows);
        assert_eq!(table.lines().count(), 4, "{table}");
        assert!(
            table.contains("| 2 | 1250 | 1.25 | 0.62 | 1500.0 (500.0 + 1000.0) | 60% / 40% | 50% / 50% |"),
            "{table}"
        );
    }

    #[test]
    fn the_group_comes_from_the_service_environment() {
        let env = vec![("GPUMEDIC_LOG", "warn".to_owned()), ("GPUMEDIC_GROUP", "g-1".to_owned())];
        assert_eq!(group_of(&env).expect("named"), "g-1");
        assert!(group_of(&env[..1]).is_err());
    }
}
