//! `fleet-scale`: gpumedic at the size of a large fleet (the issue's: 100,000 GPU nodes of 8 GPUs),
//! step by step (`--nodes 10000,30000,100000`), with what each service and each server underneath
//! takes at each size.
//!
//! At each size:
//! 1. **The fleet grows** in the apiserver to that size: GPU Nodes with the labels gpumedic
//!    selects on and a kubelet's status (capacity `nvidia.com/gpu: 8`, the usual conditions; see
//!    [`fleet::gpu_node`]) and `--pods-per-node` GPU pods bound to each, `--concurrency` requests
//!    in flight. No kubelet runs: nothing else writes to them.
//! 2. **The servers at rest**: etcd's and the apiserver's memory with the fleet stored, and the
//!    cost of the remediator's relists of the fleet, measured here with its own calls: the
//!    names-only list of the fleet (what the breaker's count made every 30 s before it became a
//!    metadata watch; now the cost of that watch's initial list and of a relist:
//!    [`gpumedic_remediator::apply::managed_nodes`]) and the whole-node list of each resync and
//!    new leader term ([`gpumedic_remediator::maintenance::list_nodes`]), in milliseconds and in
//!    apiserver CPU per call. Then the floor: a plain label patch on the nodes the faults will hit.
//! 3. **The services start** (release builds next to this program) on topics of this run: the
//!    enricher, the classifier (fresh database) and the remediator (`cordon-drain` on this fleet,
//!    resyncing every 30 s against the classifier's incidents, the breaker's limits raised so the
//!    timed faults are all acted on). Each one's start-up is the time until it is ready: for the
//!    enricher, its initial list and watch of every Node and Pod.
//! 4. **Steady**: the simulated fleet ([`fleet::Fleet`]: the collector's stream, an inventory
//!    first, readings on change, a heartbeat per GPU, Xids by PCI bus id, with its fault mix) at
//!    `--events-per-node` events per node per second (the 0.03: 3,000/s at 100,000 nodes)
//!    for `--steady`. With `--warm-up`, the fleet first runs at the burst's rate for that long,
//!    not measured, and the steady phase waits until the classifier has taken it all in and the
//!    wall clock has caught up with the fleet's.
//!    With `--rollout`, the warm-up is instead the fleet's start round (every node's collector
//!    starts), and the burst below begins with every collector restarting at once: a rollout of
//!    the collector over a fleet the classifier already knows. Without either, the steady phase
//!    and the burst at 10,000 nodes or more fall within the fleet's first start round (65 events
//!    a node), met by a fresh classifier that records every one of them.
//! 5. **Burst**: the fleet at `--burst-rate` (10,000/s) for `--burst`; during it, `--faults` Xid
//!    79s on distinct nodes, `--fault-interval` apart, each timed from its produce call to the
//!    first time a watch sees its node cordoned, beside the floor of step 2.
//!
//! Every `--sample-every` throughout, each process's memory and CPU time are read from `/proc`:
//! the three services, this program (the simulated collectors), and the servers found by the
//! ports they listen on (Kafka from `KAFKA_BOOTSTRAP`, PostgreSQL from `DATABASE_URL` with its
//! backends, the apiserver from the kubeconfig, etcd from the apiserver's `--etcd-servers`). A
//! phase's figures are the median memory, the peak, and the mean CPU in cores over the phase.
//!
//! At the end, the enricher's cache is filled in this process with the largest fleet's Nodes and
//! Pods ([`gpumedic_enricher::cache::ClusterCache`]) to tell its memory per node and per pod apart.
//!
//! Point `KUBECONFIG` at an apiserver of its own (see docs/benchmarks.md): 100,000 Nodes slow
//! every other user of a shared one. `--quick` is a one-minute run at 1,000 nodes.

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::Context as _;
use gpumedic_enricher::cache::{ClusterCache, ContextSettings};
use gpumedic_testkit::{self as testkit, ServiceProcess};
use k8s_openapi::api::core::v1::{Node, Pod};
use kube::api::{Api, Patch, PatchParams};
use rdkafka::producer::Producer as _;
use serde_json::json;

use crate::fleet::{self, Fleet};
use crate::procs::{self, Reading, Watched};
use crate::soak::{RunTopics, start_services};

/// Options of the scenario.
#[derive(Debug, clap::Args)]
pub struct Options {
    /// The fleet sizes, in nodes of 8 GPUs, smallest first: the fleet grows to each in turn.
    #[arg(long, value_delimiter = ',', default_value = "10000,30000,100000")]
    nodes: Vec<usize>,
    /// GPU pods bound to each node (one 8-GPU pod: a training fleet's shape).
    #[arg(long, default_value_t = 1)]
    pods_per_node: usize,
    /// Steady events per node per second (the production-like 0.03).
    #[arg(long, default_value_t = 0.03)]
    events_per_node: f64,
    /// Before the steady phase, the fleet at `--burst-rate` for this long, not measured, then a
    /// wait until the classifier has taken every event in. Under `--persist evidence` a classifier
    /// records the first event of each node, GPU and kind it has not seen (nor had replayed by its
    /// rebuild): fresh, it records about half of a 10,000-node burst as rows; warmed up, it
    /// records what a classifier that has run a while does. 0 (the default) measures the fresh one.
    #[arg(long, default_value = "0s", value_parser = crate::duration)]
    warm_up: Duration,
    /// The burst as a rollout of the collectors over a fleet the classifier already knows: first
    /// the fleet's start round (every node's collector starts: its inventory and its start
    /// snapshot, 65 events a node of 8 GPUs), at the burst's rate and not measured; then the steady
    /// phase; then, as the burst begins, every collector restarts at once, so the burst is the
    /// fleet's second start round. Without it, the burst is the first start round of a fleet
    /// and a classifier that have never met (the classifier records every node, GPU and kind's
    /// first event). Not with `--warm-up`.
    #[arg(long, conflicts_with = "warm_up")]
    rollout: bool,
    /// How long the steady phase runs at each size.
    #[arg(long, default_value = "90s", value_parser = crate::duration)]
    steady: Duration,
    /// Events per second of the burst.
    #[arg(long, default_value_t = 10_000)]
    burst_rate: u64,
    /// How long the burst runs at each size.
    #[arg(long, default_value = "60s", value_parser = crate::duration)]
    burst: Duration,
    /// Timed faults (Xid 79, each on its own node) during each burst.
    #[arg(long, default_value_t = 100)]
    faults: usize,
    /// Time between two timed faults.
    #[arg(long, default_value = "400ms", value_parser = crate::duration)]
    fault_interval: Duration,
    /// The fleet's own fault mix, faults per minute over the whole fleet.
    #[arg(long, default_value_t = 30.0)]
    faults_per_minute: f64,
    /// Requests in flight while creating the fleet.
    #[arg(long, default_value_t = 48)]
    concurrency: usize,
    /// Time between two samples of the processes.
    #[arg(long, default_value = "5s", value_parser = crate::duration)]
    sample_every: Duration,
    /// A one-minute run: 1,000 nodes, 15 s steady, a 15 s burst at 2,000/s with 20 faults.
    #[arg(long)]
    quick: bool,
    /// Leave the fleet in the apiserver at the end (by default its Nodes and namespaces are
    /// deleted).
    #[arg(long)]
    keep_fleet: bool,
    /// Grow the fleet a run with `--keep-fleet` left (its id, the value of its Nodes'
    /// `gpumedic-bench/fleet` label) instead of a new one: its Nodes are counted and only the
    /// rest made. The apiserver's creation figures then cover the new Nodes only.
    #[arg(long)]
    fleet: Option<String>,
}

impl Options {
    fn quick(mut self) -> Self {
        if self.quick {
            self.nodes = vec![1000];
            self.steady = Duration::from_secs(15);
            self.burst = Duration::from_secs(15);
            self.burst_rate = 2000;
            self.faults = 20;
            self.fault_interval = Duration::from_millis(300);
            self.sample_every = Duration::from_secs(3);
        }
        self
    }
}

/// One phase's figures per process.
#[derive(Debug, Default, serde::Serialize)]
pub struct Phase {
    rate_target: f64,
    rate_achieved: f64,
    seconds: f64,
    /// Median memory over the phase, MiB (RSS; PSS summed over PostgreSQL's processes).
    mib: BTreeMap<&'static str, f64>,
    /// Peak memory over the phase, MiB.
    peak_mib: BTreeMap<&'static str, f64>,
    /// Mean CPU over the phase, in cores.
    cpu_cores: BTreeMap<&'static str, f64>,
    /// The classifier's events at the end of the phase, against those produced since the start.
    classified: f64,
    produced: u64,
    /// Of the events produced in the phase, the start-snapshot readings (a collector's first
    /// sample publishes every reading of every GPU once).
    start_snapshot: u64,
    /// The events the classifier recorded in `health_events` and the rollups it wrote, from the
    /// start to the end of the phase.
    recorded: f64,
    rollups: f64,
}

/// One relist, timed.
#[derive(Debug, Default, serde::Serialize)]
pub struct Relist {
    /// Median milliseconds of a call.
    ms: f64,
    /// The apiserver's and etcd's CPU seconds per call.
    apiserver_cpu_s: f64,
    etcd_cpu_s: f64,
    /// Objects returned.
    items: usize,
    /// The response re-serialised as JSON, MiB.
    json_mib: f64,
}

/// Fault to cordon during the burst.
#[derive(Debug, Default, serde::Serialize)]
pub struct FaultToCordon {
    faults: usize,
    cordoned: usize,
    /// Targets the fleet's own fault mix had cordoned before their timed fault was sent.
    already_cordoned: usize,
    p50_ms: f64,
    p99_ms: f64,
    max_ms: f64,
    /// Each fault's latency in the order sent; `null` for a node never seen cordoned.
    latencies_ms: Vec<Option<f64>>,
    /// The latency split at the records each fault caused ([`crate::stages`]).
    stages: Vec<crate::stages::Stage>,
}

/// One size's figures.
#[derive(Debug, Default, serde::Serialize)]
pub struct Step {
    nodes: usize,
    pods: usize,
    /// Seconds to create this step's new Nodes and Pods, and objects per second.
    create_seconds: f64,
    create_per_sec: f64,
    /// The servers with the fleet stored, before the services start: MiB and CPU cores while idle.
    servers_at_rest_mib: BTreeMap<&'static str, f64>,
    /// A names-only list of the fleet (the remediator's node watch lists so at its start) and
    /// its resync's whole-node list.
    relist_names: Relist,
    relist_whole: Relist,
    floor_patch_p50_ms: f64,
    floor_patch_p99_ms: f64,
    /// Seconds from start to ready, per service.
    startup_s: BTreeMap<&'static str, f64>,
    /// The enricher's memory once ready (its cache filled), MiB.
    enricher_ready_mib: f64,
    /// The remediator's resyncs during the step: count and mean seconds.
    resyncs: f64,
    resync_mean_s: f64,
    /// The remediator's mean per verdict over the step, ms: from the verdict's record timestamp
    /// to its handling, and the handling (see [`crate::stages::remediator_means`]).
    remediator_delivered_ms: f64,
    remediator_acted_ms: f64,
    /// `--warm-up`: events produced, and seconds from its end until the classifier had taken
    /// them all in.
    warm_up_events: u64,
    warm_up_drained_s: f64,
    steady: Phase,
    burst: Phase,
    fault_to_cordon: FaultToCordon,
    /// The classifier's batches over the whole run (the warm-up's too), per stage of a batch.
    classifier_batches: Vec<crate::stages::BatchStage>,
}

/// The enricher's cache, filled in this process.
#[derive(Debug, Default, serde::Serialize, serde::Deserialize)]
pub struct CacheCost {
    nodes: usize,
    pods: usize,
    bytes_per_node: f64,
    bytes_per_pod: f64,
}

/// The JSON result.
#[derive(Debug, serde::Serialize)]
pub struct Result {
    scenario: &'static str,
    pods_per_node: usize,
    events_per_node: f64,
    burst_rate: u64,
    /// One Node and one Pod as the apiserver returns them, JSON bytes.
    node_json_bytes: usize,
    pod_json_bytes: usize,
    /// `uptime`'s load averages when the run started.
    load_at_start: String,
    steps: Vec<Step>,
    enricher_cache: CacheCost,
    /// Samples: `[seconds, process, MiB, CPU seconds so far]`.
    samples: Vec<(f64, &'static str, f64, f64)>,
}

/// The processes sampled, by name.
pub(crate) type Watchlist = Vec<(&'static str, Watched)>;

/// One reading of one process, when it was taken.
type Sample = (Instant, &'static str, Reading);

/// Samples every process in `watch` until told to stop; shared with the phases.
#[derive(Clone, Default)]
struct Sampler {
    samples: Arc<Mutex<Vec<Sample>>>,
}

impl Sampler {
    fn take(&self, watch: &Watchlist) {
        let now = Instant::now();
        let mut s = self.samples.lock().expect("samples lock");
        for (name, w) in watch {
            if let Some(r) = w.read() {
                s.push((now, name, r));
            }
        }
    }

    /// Median and peak memory, mean CPU cores, per process, between `from` and `to`.
    fn phase(&self, from: Instant, to: Instant) -> Phase {
        let s = self.samples.lock().expect("samples lock");
        let mut by: BTreeMap<&'static str, Vec<(Instant, Reading)>> = BTreeMap::new();
        for (t, name, r) in s.iter().filter(|(t, _, _)| *t >= from && *t <= to) {
            by.entry(name).or_default().push((*t, *r));
        }
        let mut phase = Phase::default();
        for (name, rs) in by {
            let mut mib: Vec<f64> = rs.iter().map(|(_, r)| r.mib).collect();
            mib.sort_by(f64::total_cmp);
            phase.mib.insert(name, mib[mib.len() / 2]);
            phase.peak_mib.insert(name, mib[mib.len() - 1]);
            if let (Some(a), Some(b)) = (rs.first(), rs.last())
                && b.0 > a.0
            {
                phase.cpu_cores.insert(name, (b.1.cpu_seconds - a.1.cpu_seconds) / (b.0 - a.0).as_secs_f64());
            }
        }
        phase
    }
}

/// The servers underneath, found by the ports they listen on.
pub(crate) fn servers() -> anyhow::Result<Watchlist> {
    let kafka = procs::port_of(&testkit::kafka_bootstrap()).and_then(procs::listening_on);
    let postgres = procs::port_of(&testkit::database_url()).and_then(procs::listening_on);
    let kubeconfig = kube::config::Kubeconfig::read_from(testkit::kubeconfig_path())?;
    let server = kubeconfig.clusters.first().and_then(|c| c.cluster.as_ref()?.server.clone()).unwrap_or_default();
    let apiserver = procs::port_of(&server).and_then(procs::listening_on);
    let etcd = apiserver
        .and_then(|p| procs::flag_of(p, "--etcd-servers"))
        .and_then(|urls| procs::port_of(urls.split(',').next()?))
        .and_then(procs::listening_on);
    let mut list = vec![("load-tests", Watched { pid: std::process::id(), with_children: false })];
    for (name, pid, with_children) in [
        ("kafka", kafka, false),
        ("postgres", postgres, true),
        ("kube-apiserver", apiserver, false),
        ("etcd", etcd, false),
    ] {
        match pid {
            Some(pid) => list.push((name, Watched { pid, with_children })),
            None => println!("  fleet-scale: cannot see the {name} process (not listening here?); it is not measured"),
        }
    }
    Ok(list)
}

/// Times `calls` relists made by `list` (returning items and JSON bytes), with the apiserver's and
/// etcd's CPU over them.
async fn relist<F, Fut>(watch: &Watchlist, calls: usize, list: F) -> anyhow::Result<Relist>
where
    F: Fn() -> Fut,
    Fut: std::future::Future<Output = anyhow::Result<(usize, usize)>>,
{
    let cpu = |name: &str| {
        watch.iter().find(|(n, _)| *n == name).and_then(|(_, w)| w.read()).map_or(f64::NAN, |r| r.cpu_seconds)
    };
    let (api0, etcd0) = (cpu("kube-apiserver"), cpu("etcd"));
    let mut ms = Vec::with_capacity(calls);
    let mut last = (0, 0);
    for _ in 0..calls {
        let t = Instant::now();
        last = list().await?;
        ms.push(t.elapsed().as_secs_f64() * 1000.0);
    }
    ms.sort_by(f64::total_cmp);
    Ok(Relist {
        ms: ms[ms.len() / 2],
        apiserver_cpu_s: (cpu("kube-apiserver") - api0) / calls as f64,
        etcd_cpu_s: (cpu("etcd") - etcd0) / calls as f64,
        items: last.0,
        json_mib: last.1 as f64 / (1024.0 * 1024.0),
    })
}

/// Produces the fleet's stream at `rate` for `length` on a thread of its own; gives the fleet back
/// with the events sent.
fn produce(
    mut fleet: Fleet,
    bootstrap: &str,
    topic: &str,
    rate: u64,
    length: Duration,
) -> anyhow::Result<std::thread::JoinHandle<anyhow::Result<(Fleet, u64)>>> {
    let producer = crate::scratch_producer(bootstrap)?;
    let topic = topic.to_owned();
    Ok(std::thread::spawn(move || {
        let (stop, sent) = (AtomicBool::new(false), AtomicU64::new(0));
        fleet::produce_paced(&mut fleet, &producer, &topic, rate, Instant::now() + length, &stop, &sent)?;
        producer.flush(Duration::from_secs(60)).context("flush")?;
        Ok((fleet, sent.load(Ordering::Relaxed)))
    }))
}

/// Runs the scenario and prints one line per figure.
pub async fn run(o: Options) -> anyhow::Result<Result> {
    let o = o.quick();
    anyhow::ensure!(!o.nodes.is_empty() && o.nodes.windows(2).all(|w| w[0] < w[1]), "--nodes: sizes must grow");
    let bootstrap = testkit::require_kafka().await?;
    let client = testkit::require_kubernetes().await?;
    let admin_db = testkit::require_postgres().await?;
    let load_at_start = std::fs::read_to_string("/proc/loadavg").unwrap_or_default().trim().to_owned();
    let id = o.fleet.clone().unwrap_or_else(|| testkit::unique_name("scale"));
    let largest = *o.nodes.last().expect("sizes");
    let names: Vec<String> = (0..largest).map(|n| format!("{id}-{n:05}")).collect();
    let selector = format!("{}={id}", fleet::FLEET_LABEL);
    let nodes_api: Api<Node> = Api::all(client.clone());
    // A kept fleet's Nodes are the first of its names.
    let mut made = gpumedic_remediator::apply::managed_nodes(&client, &selector).await?.len();
    anyhow::ensure!(o.fleet.is_some() || made == 0, "a new fleet has no Nodes yet");
    if made > 0 {
        println!("fleet-scale: the kept fleet {id} has {made} Nodes");
    }
    let mut watch = servers()?;
    let sampler = Sampler::default();
    let t0 = Instant::now();
    let sampling = {
        let (sampler, every) = (sampler.clone(), o.sample_every);
        let watch = Arc::new(Mutex::new(watch.clone()));
        let handle = watch.clone();
        let task = tokio::spawn(async move {
            loop {
                let list = handle.lock().expect("watch lock").clone();
                sampler.take(&list);
                tokio::time::sleep(every).await;
            }
        });
        (task, watch)
    };
    println!(
        "fleet-scale: sizes {:?} nodes of 8 GPUs, {} pods each; {} events/node/s steady, bursts of {}/s; load {}",
        o.nodes, o.pods_per_node, o.events_per_node, o.burst_rate, load_at_start
    );

    let mut namespaces: Vec<String> = Vec::new();
    let mut steps = Vec::new();
    let mut sizes = (0usize, 0usize);
    let outcome: anyhow::Result<()> = async {
        for (k, &size) in o.nodes.iter().enumerate() {
            // 1. Grow the fleet.
            let new = &names[made.min(size)..size];
            let started = Instant::now();
            fleet::create_gpu_nodes(&client, &id, new, true, o.concurrency).await?;
            namespaces.push(fleet::create_gpu_pods(&client, new, o.pods_per_node, o.concurrency).await?);
            made = made.max(size);
            let mut step = Step { nodes: size, pods: size * o.pods_per_node, ..Step::default() };
            step.create_seconds = started.elapsed().as_secs_f64();
            step.create_per_sec = (new.len() * (1 + o.pods_per_node)) as f64 / step.create_seconds.max(1e-3);
            if sizes == (0, 0) {
                let node = serde_json::to_vec(&nodes_api.get(&names[0]).await?)?.len();
                let pods: Api<Pod> = Api::all(client.clone());
                let pod = pods.list(&kube::api::ListParams::default().labels("app=trainer").limit(1)).await?;
                sizes = (node, pod.items.first().map_or(0, |p| serde_json::to_vec(p).map_or(0, |v| v.len())));
            }
            println!(
                "  {size} nodes: {} Nodes and {} Pods created in {:.0} s ({:.0} objects/s); a Node is {} B, a Pod {} B",
                new.len(),
                new.len() * o.pods_per_node,
                step.create_seconds,
                step.create_per_sec,
                sizes.0,
                sizes.1
            );

            // 2. The servers at rest, the relists, the floor.
            tokio::time::sleep(Duration::from_secs(5)).await;
            let rest = Instant::now();
            sampler.take(&watch);
            step.servers_at_rest_mib = sampler.phase(rest, Instant::now()).mib;
            let names_only = async || {
                let n = gpumedic_remediator::apply::managed_nodes(&client, &selector).await?;
                let bytes: usize = n.iter().map(String::len).sum();
                Ok((n.len(), bytes))
            };
            step.relist_names = relist(&watch, 3, names_only).await?;
            let whole = async || {
                let n = gpumedic_remediator::maintenance::list_nodes(&client, &selector).await?;
                Ok((n.len(), serde_json::to_vec(&n)?.len()))
            };
            step.relist_whole = relist(&watch, 3, whole).await?;
            println!(
                "    at rest: {:?} MiB; the fleet count's relist {:.0} ms ({:.2} apiserver CPU s, {} names), a \
                 resync's whole list {:.0} ms ({:.2} apiserver + {:.2} etcd CPU s, {:.0} MiB of JSON)",
                step.servers_at_rest_mib,
                step.relist_names.ms,
                step.relist_names.apiserver_cpu_s,
                step.relist_names.items,
                step.relist_whole.ms,
                step.relist_whole.apiserver_cpu_s,
                step.relist_whole.etcd_cpu_s,
                step.relist_whole.json_mib
            );
            // The newest nodes (a kept fleet's newest when this step adds none), under a label
            // of this run's own.
            let pool = if new.is_empty() { &names[..size] } else { new };
            let targets: Vec<String> = pool[pool.len().saturating_sub(o.faults)..].to_vec();
            let target_label = testkit::unique_name("target");
            let mut floor = Vec::with_capacity(targets.len());
            for name in &targets {
                let t = Instant::now();
                let patch = json!({ "metadata": { "labels": { "gpumedic-bench/fault-target": target_label } } });
                nodes_api.patch(name, &PatchParams::default(), &Patch::Merge(&patch)).await?;
                floor.push(t.elapsed().as_secs_f64() * 1000.0);
            }
            floor.sort_by(f64::total_cmp);
            step.floor_patch_p50_ms = crate::latency::percentile(&floor, 0.50);
            step.floor_patch_p99_ms = crate::latency::percentile(&floor, 0.99);

            // 3. The services.
            let topics = RunTopics::create(&bootstrap, &format!("{id}-{k}")).await?;
            let db = format!("{id}_{k}").replace('-', "_");
            let url = testkit::fresh_database(&admin_db, &db).await?;
            let started = Instant::now();
            let mut services = start_services(
                &bootstrap,
                "scale",
                &topics,
                &url,
                &selector,
                &namespaces[0],
                vec![
                    ("GPUMEDIC_INCIDENT_DATABASE_URL", url.clone()),
                    ("GPUMEDIC_RESYNC_INTERVAL", "30s".to_owned()),
                    ("GPUMEDIC_BREAKER_MAX_SHARE", "1.0".to_owned()),
                    ("GPUMEDIC_BREAKER_MAX_COUNT", "1000000".to_owned()),
                    ("GPUMEDIC_QUARANTINES_PER_MINUTE", "100000".to_owned()),
                ],
            )
            .await?;
            {
                let mut list = sampling.1.lock().expect("watch lock");
                list.retain(|(n, _)| !matches!(*n, "enricher" | "classifier" | "remediator"));
                for (name, s) in &services {
                    list.push((name, Watched { pid: s.pid(), with_children: false }));
                }
                watch = list.clone();
            }
            let ready = futures::future::join_all(services.iter_mut().map(async |(name, s)| {
                let r = s.wait_ready(Duration::from_secs(600)).await;
                (*name, r.map(|()| started.elapsed().as_secs_f64()))
            }))
            .await;
            for (name, r) in ready {
                step.startup_s.insert(name, r.map_err(anyhow::Error::msg).with_context(|| format!("the {name}"))?);
            }
            step.enricher_ready_mib =
                Watched { pid: services[0].1.pid(), with_children: false }.read().map_or(f64::NAN, |r| r.mib);
            println!(
                "    start-up to ready: {:?} s; the enricher holds {:.0} MiB with its cache filled",
                step.startup_s, step.enricher_ready_mib
            );
            let result =
                phases(&o, &id, &target_label, k, size, &topics, &bootstrap, &nodes_api, &targets, &sampler, &services)
                    .await;
            for (name, s) in &services {
                if let Ok((_, text)) = testkit::http_get(s.admin_addr(), "/metrics").await
                    && *name == "classifier"
                {
                    step.classifier_batches = crate::stages::classifier_batches(&text);
                }
                if let Ok((_, text)) = testkit::http_get(s.admin_addr(), "/metrics").await
                    && *name == "remediator"
                {
                    step.resyncs = crate::classify::metric(&text, "gpumedic_remediator_resync_seconds_count");
                    step.resync_mean_s =
                        crate::classify::metric(&text, "gpumedic_remediator_resync_seconds_sum") / step.resyncs;
                    [step.remediator_delivered_ms, step.remediator_acted_ms] = crate::stages::remediator_means(&text);
                }
            }
            for (_, s) in &mut services {
                let _ = s.terminate(Duration::from_secs(30)).await;
            }
            let _ = topics.delete(&bootstrap).await;
            let _ = sqlx::query(sqlx::AssertSqlSafe(format!("DROP DATABASE IF EXISTS {db} WITH (FORCE)")))
                .execute(&admin_db)
                .await;
            let (warm_up, steady, burst, faults) = result?;
            (step.warm_up_events, step.warm_up_drained_s) = warm_up;
            step.steady = steady;
            step.burst = burst;
            step.fault_to_cordon = faults;
            print_step(&step);
            steps.push(step);
        }
        Ok(())
    }
    .await;
    sampling.0.abort();
    if !o.keep_fleet {
        fleet::delete_from_apiserver(&client, &names[..made], None, o.concurrency).await;
        for ns in &namespaces {
            fleet::delete_from_apiserver(&client, &[], Some(ns), 1).await;
        }
    }
    outcome?;
    let enricher_cache = cache_cost_in_child(&id, largest, o.pods_per_node)?;
    println!(
        "  the enricher's cache: {:.0} B per node and {:.0} B per pod ({} nodes, {} pods filled in this process)",
        enricher_cache.bytes_per_node, enricher_cache.bytes_per_pod, enricher_cache.nodes, enricher_cache.pods
    );
    let samples = sampler
        .samples
        .lock()
        .expect("samples lock")
        .iter()
        .map(|(t, name, r)| (t.saturating_duration_since(t0).as_secs_f64(), *name, r.mib, r.cpu_seconds))
        .collect();
    Ok(Result {
        scenario: "fleet-scale",
        pods_per_node: o.pods_per_node,
        events_per_node: o.events_per_node,
        burst_rate: o.burst_rate,
        node_json_bytes: sizes.0,
        pod_json_bytes: sizes.1,
        load_at_start,
        steps,
        enricher_cache,
        samples,
    })
}

/// Steps 4 and 5 of the module's doc at one size: steady, then the burst with the timed faults.
#[allow(clippy::too_many_arguments)]
async fn phases(
    o: &Options,
    id: &str,
    target_label: &str,
    k: usize,
    size: usize,
    topics: &RunTopics,
    bootstrap: &str,
    nodes_api: &Api<Node>,
    targets: &[String],
    sampler: &Sampler,
    services: &[(&'static str, ServiceProcess); 3],
) -> anyhow::Result<((u64, f64), Phase, Phase, FaultToCordon)> {
    let steady_rate = ((size as f64 * o.events_per_node).round() as u64).max(1);
    let metric = async |name: &str| match testkit::http_get(services[1].1.admin_addr(), "/metrics").await {
        Ok((_, text)) => crate::classify::metric(&text, name),
        Err(_) => f64::NAN,
    };
    let classified = async || metric("gpumedic_classifier_events_total").await;
    let snapshots = |fleet: &Fleet| fleet.counts().get("snapshot").copied().unwrap_or(0);

    // Warm-up, not measured: the classifier sees the fleet's nodes, GPUs and kinds. The fleet is
    // paced for the steady rate, so at the burst's its clock runs ahead of the wall's; the steady
    // phase waits until the wall has caught up (else the steady phase and the burst would carry
    // event times past the classifier's clock skew allowance).
    let fleet = Fleet::paced(id, size, steady_rate, o.faults_per_minute, k as u64 + 1, fleet::XidNames::Pci)?;
    let (mut fleet, mut warm_sent, mut drained_s) = (fleet, 0, 0.0);
    if o.rollout {
        // The start round: until every node has sampled once, in pieces no longer than what the
        // nodes left should take (at the events per node so far), so that little of the fleet's
        // later rounds follows it: those run the fleet's clock ahead at this rate.
        while fleet.started() < size {
            let per_node = if fleet.started() == 0 { 100.0 } else { warm_sent as f64 / fleet.started() as f64 };
            let left = (size - fleet.started()) as f64 * per_node / o.burst_rate as f64;
            let sent;
            (fleet, sent) =
                produce(fleet, bootstrap, &topics.raw, o.burst_rate, Duration::from_secs_f64(left.clamp(0.2, 5.0)))?
                    .join()
                    .map_err(|_| anyhow::anyhow!("panic"))??;
            warm_sent += sent;
        }
    } else if !o.warm_up.is_zero() {
        (fleet, warm_sent) = produce(fleet, bootstrap, &topics.raw, o.burst_rate, o.warm_up)?
            .join()
            .map_err(|_| anyhow::anyhow!("panic"))??;
    }
    if warm_sent > 0 {
        let (produced, deadline) = (Instant::now(), Instant::now() + Duration::from_secs(600));
        while classified().await < warm_sent as f64 {
            anyhow::ensure!(Instant::now() < deadline, "the classifier did not take the warm-up in within 10 minutes");
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
        drained_s = produced.elapsed().as_secs_f64();
        let ahead = (fleet.clock() - chrono::Utc::now()).to_std().unwrap_or_default();
        println!(
            "    warm-up{}: {warm_sent} events ({} start-snapshot readings), all classified {drained_s:.1} s after; \
             the fleet's clock {:.0} s ahead of the wall's, waited for",
            if o.rollout { " (the fleet's start round)" } else { "" },
            snapshots(&fleet),
            ahead.as_secs_f64()
        );
        tokio::time::sleep(ahead).await;
    }

    // Steady.
    let start = Instant::now();
    let snapshot_before = snapshots(&fleet);
    let (mut fleet, steady_sent) = produce(fleet, bootstrap, &topics.raw, steady_rate, o.steady)?
        .join()
        .map_err(|_| anyhow::anyhow!("panic"))??;
    let end = Instant::now();
    let mut steady = sampler.phase(start, end);
    steady.rate_target = steady_rate as f64;
    steady.seconds = (end - start).as_secs_f64();
    steady.rate_achieved = steady_sent as f64 / steady.seconds;
    steady.produced = warm_sent + steady_sent;
    steady.classified = classified().await;
    steady.start_snapshot = snapshots(&fleet) - snapshot_before;
    steady.recorded = metric("gpumedic_classifier_recorded_events_total").await;
    steady.rollups = metric("gpumedic_classifier_rollups_total").await;

    // Burst, with the timed faults.
    let (watch, cordoned_at) =
        crate::latency::watch_cordons(nodes_api.clone(), format!("gpumedic-bench/fault-target={target_label}"));
    let settings = gpumedic_runtime::kafka::KafkaSettings {
        bootstrap: bootstrap.to_owned(),
        options: vec![],
        schema_registry: None,
        topic_replication: None,
    };
    let faults_producer = settings.producer("bench-scale-faults")?;
    let mut stages = crate::stages::Stages::start(bootstrap, &[&topics.enriched, &topics.verdicts, &topics.actions])?;
    let snapshot_before = snapshots(&fleet);
    if o.rollout {
        fleet.restart_collectors();
    }
    let start = Instant::now();
    let producing = produce(fleet, bootstrap, &topics.raw, o.burst_rate, o.burst)?;
    tokio::time::sleep(Duration::from_secs(3).min(o.burst / 4)).await;
    let mut faulted_at: HashMap<String, Instant> = HashMap::new();
    for (index, name) in targets.iter().enumerate() {
        let bytes = gpumedic_schemas::encode(&crate::latency::fallen_off_the_bus(name))?;
        let traceparent = stages.traceparent(index as u64);
        faulted_at.insert(name.clone(), Instant::now());
        let headers = [(gpumedic_runtime::kafka::record_headers::TRACEPARENT, traceparent.as_bytes())];
        gpumedic_runtime::kafka::publish(&faults_producer, &topics.raw, name, &bytes, &headers).await?;
        tokio::time::sleep(o.fault_interval).await;
    }
    let (fleet, burst_sent) = tokio::task::spawn_blocking(move || producing.join())
        .await?
        .map_err(|_| anyhow::anyhow!("the producer thread panicked"))??;
    let end = Instant::now();
    let deadline = Instant::now() + Duration::from_secs(60);
    while cordoned_at.lock().expect("lock").len() < faulted_at.len() && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    watch.abort();
    let _ = faults_producer.flush(Duration::from_secs(5));
    let mut burst = sampler.phase(start, end);
    burst.rate_target = o.burst_rate as f64;
    burst.seconds = (end - start).as_secs_f64();
    burst.rate_achieved = burst_sent as f64 / burst.seconds;
    burst.produced = warm_sent + steady_sent + burst_sent;
    burst.classified = classified().await;
    burst.start_snapshot = snapshots(&fleet) - snapshot_before;
    burst.recorded = metric("gpumedic_classifier_recorded_events_total").await;
    burst.rollups = metric("gpumedic_classifier_rollups_total").await;

    let seen = cordoned_at.lock().expect("lock").clone();
    let cordoned_ms: HashMap<u64, i64> = targets
        .iter()
        .enumerate()
        .filter_map(|(i, n)| {
            let (c, f) = (seen.get(n)?, faulted_at.get(n)?);
            (c >= f).then(|| (i as u64, crate::stages::instant_ms(*c)))
        })
        .collect();
    let stages = stages.finish(&cordoned_ms)?;
    let latencies_ms: Vec<Option<f64>> = targets
        .iter()
        .map(|n| {
            let (c, f) = (seen.get(n)?, faulted_at.get(n)?);
            // Cordoned before its fault was sent (by the fleet's own fault mix): not timed.
            (c >= f).then(|| (*c - *f).as_secs_f64() * 1000.0)
        })
        .collect();
    let already_cordoned =
        targets.iter().filter(|n| matches!((seen.get(*n), faulted_at.get(*n)), (Some(c), Some(f)) if c < f)).count();
    let mut sorted: Vec<f64> = latencies_ms.iter().flatten().copied().collect();
    sorted.sort_by(f64::total_cmp);
    let faults = FaultToCordon {
        faults: faulted_at.len(),
        cordoned: sorted.len(),
        already_cordoned,
        p50_ms: crate::latency::percentile(&sorted, 0.50),
        p99_ms: crate::latency::percentile(&sorted, 0.99),
        max_ms: sorted.last().copied().unwrap_or(f64::NAN),
        latencies_ms,
        stages,
    };
    Ok(((warm_sent, drained_s), steady, burst, faults))
}

fn print_step(step: &Step) {
    for (label, p) in [("steady", &step.steady), ("burst", &step.burst)] {
        println!(
            "    {label}: {:.0} events/s (target {:.0}) for {:.0} s, {:.0} of {} classified; {} start-snapshot \
             readings in the phase; since the start {:.0} events recorded, {:.0} rollups written",
            p.rate_achieved,
            p.rate_target,
            p.seconds,
            p.classified,
            p.produced,
            p.start_snapshot,
            p.recorded,
            p.rollups
        );
        for (name, mib) in &p.mib {
            println!(
                "      {name:<15} {mib:>8.0} MiB (peak {:>8.0})  {:>5.2} cores",
                p.peak_mib.get(name).copied().unwrap_or(f64::NAN),
                p.cpu_cores.get(name).copied().unwrap_or(f64::NAN)
            );
        }
        let ours: f64 = ["enricher", "classifier", "remediator"].iter().filter_map(|s| p.peak_mib.get(s)).sum();
        println!("      gpumedic's three services together: {ours:.0} MiB at peak (goal: under 2 GB at 100,000 nodes)");
    }
    let f = &step.fault_to_cordon;
    println!(
        "    fault to cordon during the burst: {} of {} cordoned, p50 {:.0} ms, p99 {:.0} ms, max {:.0} ms (goal p50 < 20, \
         p99 < 100) beside a plain node patch p50 {:.1} ms, p99 {:.1} ms; {:.0} resyncs of {:.2} s mean",
        f.cordoned,
        f.faults,
        f.p50_ms,
        f.p99_ms,
        f.max_ms,
        step.floor_patch_p50_ms,
        step.floor_patch_p99_ms,
        step.resyncs,
        step.resync_mean_s
    );
    crate::stages::print(&f.stages);
    println!(
        "    the remediator, mean per verdict over the step: {:.1} ms from the verdict's timestamp to its handling, \
         {:.1} ms handling it",
        step.remediator_delivered_ms, step.remediator_acted_ms
    );
    for b in &step.classifier_batches {
        println!(
            "    classifier batches, {:<8} {:>7.0} batches, {:>7.1} s in all, {:>4.0} over 0.5 s",
            b.stage, b.batches, b.seconds, b.over_half_second
        );
    }
}

/// The arguments of the hidden `cache-cost` scenario ([`cache_cost`]).
#[derive(Debug, clap::Args)]
pub struct CacheCostArgs {
    /// The run's id (the Nodes' name prefix).
    #[arg(long)]
    id: String,
    /// Nodes in the cache.
    #[arg(long)]
    nodes: usize,
    /// GPU pods on each node.
    #[arg(long)]
    pods_per_node: usize,
}

/// [`cache_cost`] in a fresh process of this binary: this one has allocated and freed the whole
/// run's buffers, and a cache filled in their freed memory would grow its resident size by
/// nothing.
fn cache_cost_in_child(id: &str, nodes: usize, pods_per_node: usize) -> anyhow::Result<CacheCost> {
    let out = std::process::Command::new(std::env::current_exe()?)
        .args(["cache-cost", "--id", id, "--nodes", &nodes.to_string(), "--pods-per-node", &pods_per_node.to_string()])
        .output()?;
    anyhow::ensure!(out.status.success(), "cache-cost failed: {}", String::from_utf8_lossy(&out.stderr));
    let last = String::from_utf8_lossy(&out.stdout).lines().last().unwrap_or_default().to_owned();
    Ok(serde_json::from_str(&last)?)
}

/// The enricher's cache filled with `nodes` Nodes as [`fleet::gpu_node`] makes them and
/// `pods_per_node` GPU pods on each, in this process: the growth of this process's resident
/// memory per node and per pod (each object is built, applied and dropped, so the growth is the
/// cache's).
pub fn cache_cost(args: &CacheCostArgs) -> CacheCost {
    let (id, nodes, pods_per_node) = (args.id.as_str(), args.nodes, args.pods_per_node);
    let rss = || Watched { pid: std::process::id(), with_children: false }.read().map_or(f64::NAN, |r| r.mib);
    let cache = ClusterCache::default();
    let settings = ContextSettings::default();
    let before = rss();
    for n in 0..nodes {
        if let Ok(node) = fleet::gpu_node(&format!("{id}-cache-{n:05}"), id, true) {
            cache.apply_node(&node, &settings);
        }
    }
    let with_nodes = rss();
    let gpus = (fleet::GPUS_PER_NODE / pods_per_node.max(1)).max(1).to_string();
    for i in 0..nodes * pods_per_node {
        let pod = serde_json::from_value::<Pod>(json!({
            "metadata": { "name": format!("trainer-{i:06}"), "namespace": "bench", "labels": { "app": "trainer" } },
            "spec": { "nodeName": format!("{id}-cache-{:05}", i / pods_per_node.max(1)),
                "containers": [{ "name": "main", "image": "trainer", "resources": { "limits": { "nvidia.com/gpu": gpus } } }] },
            "status": { "phase": "Running" }
        }));
        if let Ok(pod) = pod {
            cache.apply_pod(&pod);
        }
    }
    let with_pods = rss();
    let pods = nodes * pods_per_node;
    CacheCost {
        nodes,
        pods,
        bytes_per_node: (with_nodes - before) * 1024.0 * 1024.0 / nodes.max(1) as f64,
        bytes_per_pod: (with_pods - with_nodes) * 1024.0 * 1024.0 / pods.max(1) as f64,
    }
}
