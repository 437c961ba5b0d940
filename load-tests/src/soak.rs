//! `soak`: the pipeline for a long run at a steady rate (the issue's: 30 minutes at 5,000 events
//! per second), with the resident memory of each service and its consumer lag sampled; both must
//! stay flat.
//!
//! 1. The simulated fleet ([`crate::fleet`]) is created in the apiserver: `--nodes` GPU nodes,
//!    labelled for this run only, with GPU pods. Its stream has the collector's shape (an
//!    inventory first, readings on change, a heartbeat per GPU, kernel-log Xids by PCI bus id), its
//!    collectors' intervals scaled so that the fleet sends `--rate` events per second.
//! 2. The release enricher, classifier (fresh database) and remediator (`cordon-drain`, on this
//!    run's nodes, with the default safety limits) start on topics of this run only, so other
//!    users of the testbed's Kafka neither feed nor read it.
//! 3. The fleet's stream, with its fault mix, is produced to the raw topic at `--rate` for
//!    `--duration`. Every `--sample-every`: each service's RSS (`/proc/<pid>/status`), its
//!    consumer lag (`gpumedic_<service>_consumer_lag`, from librdkafka's statistics), the
//!    classifier's events so far and the enricher's GPU references it could not resolve.
//! 4. Verdicts, after the first fifth of the run (warm-up) is set aside and the rest cut in
//!    thirds: memory is flat when the median RSS of the last third is at most 10% (and at least
//!    8 MiB) above that of the first; lag is flat when the highest lag of the last third is at most
//!    twice that of the first third, or under two seconds of events.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use gpumedic_runtime::kafka::{KafkaSettings, stage_topics};
use gpumedic_schemas::topics;
use gpumedic_testkit::{self as testkit, ServiceProcess};

use crate::fleet::{self, Fleet};

/// Options of the scenario.
#[derive(Debug, clap::Args)]
pub struct Options {
    /// Events per second.
    #[arg(long, default_value_t = 5000)]
    rate: u64,
    /// How long to run.
    #[arg(long, default_value = "30m", value_parser = crate::duration)]
    duration: Duration,
    /// Nodes in the fleet (8 GPUs each).
    #[arg(long, default_value_t = 1000)]
    nodes: usize,
    /// GPU pods per node.
    #[arg(long, default_value_t = 2)]
    pods_per_node: usize,
    /// Faults per minute over the whole fleet.
    #[arg(long, default_value_t = 30.0)]
    faults_per_minute: f64,
    /// How kernel-log Xids name their GPU: `pci` (the PCI bus id only) or `stamped` (with the
    /// UUID the collector's publisher adds).
    #[arg(long, value_enum, default_value_t = fleet::XidNames::Pci)]
    xid_names: fleet::XidNames,
    /// Time between two samples.
    #[arg(long, default_value = "10s", value_parser = crate::duration)]
    sample_every: Duration,
    /// Keep the run's database and topics (by default they are deleted at the end: a 30-minute
    /// soak writes about 9 million rows, some 12 GB in PostgreSQL and 4 GB in Kafka).
    #[arg(long)]
    keep_database: bool,
}

/// One sample.
#[derive(Debug, Clone, serde::Serialize)]
pub struct Sample {
    t_s: f64,
    produced: u64,
    classified: f64,
    rss_mib: BTreeMap<&'static str, f64>,
    lag: BTreeMap<&'static str, f64>,
    /// The enricher's `gpumedic_enricher_gpu_unresolved_total` so far.
    gpu_unresolved: f64,
}

/// A service's verdict.
#[derive(Debug, serde::Serialize)]
pub struct Flatness {
    service: &'static str,
    rss_first_third_mib: f64,
    rss_last_third_mib: f64,
    rss_flat: bool,
    lag_first_third_max: f64,
    lag_last_third_max: f64,
    lag_flat: bool,
}

/// The JSON result.
#[derive(Debug, serde::Serialize)]
pub struct Result {
    scenario: &'static str,
    rate: u64,
    duration_s: f64,
    nodes: usize,
    faults_per_minute: f64,
    produced: u64,
    classified: f64,
    rate_achieved: f64,
    /// The simulated collectors' sample interval, heartbeat interval and inventory refresh, in ms.
    intervals_ms: [f64; 3],
    /// How much fleet time (`observed_at`) the stream spanned, in seconds.
    fleet_seconds: f64,
    /// GPU references the enricher could not resolve (its counter at the last sample), beside the
    /// fleet's count of events naming a GPU outside their node's last inventory (`outside_inventory`).
    gpu_unresolved: f64,
    fleet_counts: BTreeMap<&'static str, u64>,
    verdicts: Vec<Flatness>,
    flat: bool,
    samples: Vec<Sample>,
}

const SERVICES: [&str; 3] = ["enricher", "classifier", "remediator"];

/// Resident memory of `pid`, MiB.
fn rss_mib(pid: u32) -> f64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("VmRSS:"))
                .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<f64>().ok())
        })
        .map_or(f64::NAN, |kb| kb / 1024.0)
}

fn median(mut v: Vec<f64>) -> f64 {
    v.retain(|x| x.is_finite());
    if v.is_empty() {
        return f64::NAN;
    }
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// The verdicts of the module's doc, from the samples after warm-up.
fn flatness(samples: &[Sample], rate: u64) -> Vec<Flatness> {
    let steady = &samples[samples.len() / 5..];
    let third = (steady.len() / 3).max(1);
    let (first, last) = (&steady[..third.min(steady.len())], &steady[steady.len().saturating_sub(third)..]);
    SERVICES
        .iter()
        .map(|&service| {
            let rss = |s: &[Sample]| median(s.iter().map(|x| x.rss_mib[service]).collect());
            let lag = |s: &[Sample]| s.iter().map(|x| x.lag[service]).fold(0.0, f64::max);
            let (a, b) = (rss(first), rss(last));
            let (la, lb) = (lag(first), lag(last));
            Flatness {
                service,
                rss_first_third_mib: a,
                rss_last_third_mib: b,
                rss_flat: b - a <= (a * 0.10).max(8.0),
                lag_first_third_max: la,
                lag_last_third_max: lb,
                lag_flat: lb <= (2.0 * la).max(2.0 * rate as f64),
            }
        })
        .collect()
}

/// The four topics of one run (`<id>-raw`, `-enriched`, `-verdicts`, `-actions`): other users of
/// the testbed's Kafka neither feed nor read a run on them.
#[derive(Debug, Clone)]
pub(crate) struct RunTopics {
    pub(crate) raw: String,
    pub(crate) enriched: String,
    pub(crate) verdicts: String,
    pub(crate) actions: String,
}

impl RunTopics {
    /// Creates the run's topics (and their dead-letter topics) in the testbed's Kafka.
    pub(crate) async fn create(bootstrap: &str, id: &str) -> anyhow::Result<Self> {
        let [raw, enriched, verdicts, actions] =
            ["raw", "enriched", "verdicts", "actions"].map(|t| format!("{id}-{t}"));
        KafkaSettings {
            bootstrap: bootstrap.to_owned(),
            options: vec![],
            schema_registry: None,
            topic_replication: None,
        }
        .ensure_topics(&stage_topics(&[&raw, &enriched, &actions], &[&verdicts], topics::DEFAULT_PARTITIONS))
        .await?;
        Ok(Self { raw, enriched, verdicts, actions })
    }

    /// Deletes the run's topics and their dead-letter topics.
    pub(crate) async fn delete(&self, bootstrap: &str) -> anyhow::Result<()> {
        let admin: rdkafka::admin::AdminClient<rdkafka::client::DefaultClientContext> =
            rdkafka::ClientConfig::new().set("bootstrap.servers", bootstrap).create()?;
        let dead: Vec<String> = [&self.raw, &self.enriched, &self.actions]
            .iter()
            .map(|t| gpumedic_runtime::kafka::dead_letter_topic(t))
            .collect();
        let all: Vec<&str> = [&self.raw, &self.enriched, &self.verdicts, &self.actions]
            .into_iter()
            .map(String::as_str)
            .chain(dead.iter().map(String::as_str))
            .collect();
        admin.delete_topics(&all, &rdkafka::admin::AdminOptions::new()).await?;
        Ok(())
    }
}

/// Starts the release enricher, classifier (into `database_url`) and remediator (`cordon-drain`
/// on the nodes matching `selector`, its lease in `lease_namespace`, pods evicted at once, with
/// `remediator_env` added) on `topics`, each in a new consumer group named after `prefix`; does not
/// wait for them to be ready.
pub(crate) async fn start_services(
    bootstrap: &str,
    prefix: &str,
    topics: &RunTopics,
    database_url: &str,
    selector: &str,
    lease_namespace: &str,
    remediator_env: Vec<(&'static str, String)>,
) -> anyhow::Result<[(&'static str, ServiceProcess); 3]> {
    let topics_env = [
        ("GPUMEDIC_ENRICHED_TOPIC", topics.enriched.clone()),
        ("GPUMEDIC_VERDICTS_TOPIC", topics.verdicts.clone()),
        ("GPUMEDIC_ACTIONS_TOPIC", topics.actions.clone()),
    ];
    let mut env = crate::service_env(bootstrap, &format!("{prefix}-enricher")).await?;
    env.extend([("GPUMEDIC_RAW_TOPIC", topics.raw.clone()), topics_env[0].clone()]);
    let enricher = ServiceProcess::start(&crate::release_binary("gpumedic-enricher")?, &[], &env)?;
    let mut env = crate::service_env(bootstrap, &format!("{prefix}-classifier")).await?;
    env.push(("GPUMEDIC_DATABASE_URL", database_url.to_owned()));
    env.extend(topics_env.clone());
    let classifier = ServiceProcess::start(&crate::release_binary("gpumedic-classifier")?, &[], &env)?;
    let mut env = crate::service_env(bootstrap, &format!("{prefix}-remediator")).await?;
    env.extend(topics_env);
    env.extend([
        ("GPUMEDIC_MODE", "cordon-drain".to_owned()),
        ("GPUMEDIC_GPU_NODE_SELECTOR", selector.to_owned()),
        ("GPUMEDIC_LEASE_NAMESPACE", lease_namespace.to_owned()),
        ("GPUMEDIC_DRAIN_GRACE_SECONDS", "0".to_owned()),
    ]);
    env.extend(remediator_env);
    let remediator = ServiceProcess::start(&crate::release_binary("gpumedic-remediator")?, &[], &env)?;
    Ok([("enricher", enricher), ("classifier", classifier), ("remediator", remediator)])
}

/// Runs the scenario and prints one line per sample and per verdict.
pub async fn run(o: Options) -> anyhow::Result<Result> {
    let bootstrap = testkit::require_kafka().await?;
    let client = testkit::require_kubernetes().await?;
    let admin_db = testkit::require_postgres().await?;
    let id = testkit::unique_name("soak");
    let mut fleet = Fleet::paced(&id, o.nodes, o.rate, o.faults_per_minute, 1, o.xid_names)?;
    let names = fleet.nodes().to_vec();
    let [sample, heartbeat, refresh] = fleet.intervals().millis();
    let ns = fleet::create_in_apiserver(&client, &id, &names, o.pods_per_node, 32).await?;
    println!(
        "soak: {} nodes ({} GPUs, {} pods) in the apiserver; {} events/s for {:?}, {} faults/min",
        o.nodes,
        o.nodes * fleet::GPUS_PER_NODE,
        o.nodes * o.pods_per_node,
        o.rate,
        o.duration,
        o.faults_per_minute
    );
    println!(
        "  the simulated collectors sample every {sample:.0} ms, beat every {heartbeat:.0} ms per GPU and publish \
         their inventory every {refresh:.0} ms"
    );

    let db = id.replace('-', "_");
    let url = testkit::fresh_database(&admin_db, &db).await?;
    let run_topics = RunTopics::create(&bootstrap, &id).await?;
    let raw = run_topics.raw.clone();
    let mut services =
        start_services(&bootstrap, "soak", &run_topics, &url, &format!("{}={id}", fleet::FLEET_LABEL), &ns, vec![])
            .await?;
    for (_, s) in &mut services {
        s.wait_ready(Duration::from_secs(120)).await.map_err(anyhow::Error::msg)?;
    }

    let producer = crate::scratch_producer(&bootstrap)?;
    let (stop, sent) = (Arc::new(AtomicBool::new(false)), Arc::new(AtomicU64::new(0)));
    let start = Instant::now();
    let until = start + o.duration;
    let (rate, s2, n2, topic) = (o.rate, stop.clone(), sent.clone(), raw.clone());
    let producing = std::thread::spawn(move || {
        fleet::produce_paced(&mut fleet, &producer, &topic, rate, until, &s2, &n2).map(|()| fleet)
    });

    let mut samples: Vec<Sample> = Vec::new();
    let mut next = start + o.sample_every;
    let outcome: anyhow::Result<()> = async {
        while Instant::now() < until {
            tokio::time::sleep_until(next.into()).await;
            next += o.sample_every;
            let mut rss_mib = BTreeMap::new();
            let mut lag = BTreeMap::new();
            let mut classified = 0.0;
            let mut gpu_unresolved = 0.0;
            for (name, s) in &mut services {
                if let Ok(Some(status)) = s.try_wait() {
                    anyhow::bail!("the {name} exited with {status} during the soak");
                }
                rss_mib.insert(*name, self::rss_mib(s.pid()));
                let (_, text) = testkit::http_get(s.admin_addr(), "/metrics").await?;
                lag.insert(*name, crate::classify::metric(&text, &format!("gpumedic_{name}_consumer_lag")));
                if *name == "classifier" {
                    classified = crate::classify::metric(&text, "gpumedic_classifier_events_total");
                }
                if *name == "enricher" {
                    gpu_unresolved = crate::classify::metric(&text, "gpumedic_enricher_gpu_unresolved_total");
                }
            }
            let sample = Sample {
                t_s: start.elapsed().as_secs_f64(),
                produced: sent.load(Ordering::Relaxed),
                classified,
                rss_mib,
                lag,
                gpu_unresolved,
            };
            println!(
                "  t={:>6.0}s produced {:>9} classified {:>9.0}  rss MiB {:?}  lag {:?}  unresolved {:.0}",
                sample.t_s, sample.produced, sample.classified, sample.rss_mib, sample.lag, sample.gpu_unresolved
            );
            samples.push(sample);
        }
        Ok(())
    }
    .await;
    stop.store(true, Ordering::Relaxed);
    let fleet = producing.join().map_err(|_| anyhow::anyhow!("the producer thread panicked"))??;
    let seconds = start.elapsed().as_secs_f64();
    for (_, s) in &mut services {
        let _ = s.terminate(Duration::from_secs(30)).await;
    }
    fleet::delete_from_apiserver(&client, &names, Some(&ns), 32).await;
    if !o.keep_database {
        sqlx::query(sqlx::AssertSqlSafe(format!("DROP DATABASE IF EXISTS {db} WITH (FORCE)")))
            .execute(&admin_db)
            .await?;
        // The run's topics hold gigabytes too.
        run_topics.delete(&bootstrap).await?;
    }
    outcome?;
    anyhow::ensure!(samples.len() >= 5, "too few samples ({}) for a verdict: run longer", samples.len());

    let verdicts = flatness(&samples, o.rate);
    for v in &verdicts {
        println!(
            "  {:<10} RSS {:>6.1} -> {:>6.1} MiB ({}), lag max {:>8.0} -> {:>8.0} ({})",
            v.service,
            v.rss_first_third_mib,
            v.rss_last_third_mib,
            if v.rss_flat { "flat" } else { "GROWING" },
            v.lag_first_third_max,
            v.lag_last_third_max,
            if v.lag_flat { "flat" } else { "GROWING" },
        );
    }
    let last = samples.last().expect("samples");
    let result = Result {
        scenario: "soak",
        rate: o.rate,
        duration_s: seconds,
        nodes: o.nodes,
        faults_per_minute: o.faults_per_minute,
        produced: last.produced,
        classified: last.classified,
        rate_achieved: last.produced as f64 / last.t_s,
        intervals_ms: fleet.intervals().millis(),
        fleet_seconds: fleet.fleet_seconds(),
        gpu_unresolved: last.gpu_unresolved,
        fleet_counts: fleet.counts().clone(),
        flat: verdicts.iter().all(|v| v.rss_flat && v.lag_flat),
        verdicts,
        samples,
    };
    println!(
        "soak: {:.0} events/s produced for {:.0} s, {:.0} classified; memory and lag {} (goal: flat)",
        result.rate_achieved,
        result.duration_s,
        result.classified,
        if result.flat { "flat" } else { "NOT flat" }
    );
    println!(
        "  fleet: {:.0} s of fleet time; {} Xids, {} of them by PCI bus id only; the enricher left {:.0} GPU \
         references unresolved, the fleet sent {} naming a GPU outside its node's last inventory (NVML's gpu_lost \
         after a GPU left it); {:?}",
        result.fleet_seconds,
        result.fleet_counts.get("xid").copied().unwrap_or(0),
        result.fleet_counts.get("xid_by_pci_only").copied().unwrap_or(0),
        result.gpu_unresolved,
        result.fleet_counts.get("outside_inventory").copied().unwrap_or(0),
        result.fleet_counts
    );
    Ok(result)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample(t: f64, rss: f64, lag: f64) -> Sample {
        Sample {
            t_s: t,
            produced: 0,
            classified: 0.0,
            rss_mib: SERVICES.iter().map(|s| (*s, rss)).collect(),
            lag: SERVICES.iter().map(|s| (*s, lag)).collect(),
            gpu_unresolved: 0.0,
        }
    }

    #[test]
    fn steady_memory_and_lag_are_flat_and_growth_is_not() {
        // Warm-up growth (the first fifth) does not count.
        let flat: Vec<Sample> = (0..30)
            .map(|i| sample(f64::from(i), if i < 6 { 10.0 * f64::from(i) } else { 100.0 + f64::from(i % 3) }, 50.0))
            .collect();
        assert!(flatness(&flat, 5000).iter().all(|v| v.rss_flat && v.lag_flat));
        let leaking: Vec<Sample> = (0..30).map(|i| sample(f64::from(i), 100.0 + 5.0 * f64::from(i), 50.0)).collect();
        assert!(flatness(&leaking, 5000).iter().all(|v| !v.rss_flat && v.lag_flat));
        let falling_behind: Vec<Sample> = (0..30).map(|i| sample(f64::from(i), 100.0, 2000.0 * f64::from(i))).collect();
        assert!(flatness(&falling_behind, 5000).iter().all(|v| v.rss_flat && !v.lag_flat));
    }

    #[test]
    fn rss_is_read_from_proc() {
        let mib = rss_mib(std::process::id());
        assert!(mib > 1.0 && mib < 10_000.0, "{mib}");
    }
}
