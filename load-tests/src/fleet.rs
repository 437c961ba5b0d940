//! The simulated GPU fleet: raw health events as N nodes with 8 GPUs each would send them, at a
//! chosen rate and with a chosen fault rate, and the matching Nodes and GPU pods in the apiserver.
//!
//! The stream goes round the fleet's GPUs; each GPU's turn is one NVML reading (temperature,
//! power and ECC counters in rotation), and each node's first GPU also brings the node's NVML
//! heartbeat. Faults are drawn at `faults_per_minute` over the whole fleet, each on a random GPU,
//! with this mix (see `shared/reference/xid-catalog.md` for what each Xid means):
//!
//! | share | fault | what follows |
//! |---|---|---|
//! | 60% | an Xid from the kernel log: 13, 31 (22% each, application faults), 43 (12%), 45 (10%), 94 (6%), 79 (6%), 74 (5%), 63 (4%), 48 (3%), 119 (3%), 64 (2%), 95 (2%), 92 (1%), with Xid 79 the GPU is lost | a lost GPU sends a `gpu_lost` event, then nothing for 20 of its turns, then readings again (recovery) |
//! | 15% | an ECC trend | the GPU's corrected-error counters climb for 10 turns; one trend in four ends in an uncorrected error and a pending row remap |
//! | 15% | a thermal excursion | the GPU reads 91-97 °C (over its 90 °C slowdown) with a thermal throttle for 6 turns, then cools |
//! | 10% | a cloud maintenance notice for the node | an AWS `system-reboot` window two days ahead |
//!
//! Every draw comes from a seeded generator, so a seed gives the same stream.

use std::collections::{BTreeMap, VecDeque};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use anyhow::Context as _;
use futures::{StreamExt as _, TryStreamExt as _};
use gpumedic_schemas::HealthEvent;
use gpumedic_schemas::health::{
    CloudMaintenanceDetail, CloudProvider, Component, Detail, EccDetail, Entity, GpuLostDetail, MonitorHealthDetail,
    MonitorState, PowerDetail, RowRemapDetail, Source, TemperatureDetail, ThrottleDetail, XidDetail,
};
use k8s_openapi::api::core::v1::{Namespace, Node, Pod};
use kube::api::{Api, DeleteParams, PostParams};
use rdkafka::producer::{BaseRecord, DefaultProducerContext, Producer as _, ThreadedProducer};
use serde_json::json;

/// GPUs per simulated node.
pub const GPUS_PER_NODE: usize = 8;

/// The slowdown threshold every simulated GPU reports.
const SLOWDOWN_CELSIUS: i32 = 90;

/// Options of the `fleet` command (the simulator on its own).
#[derive(Debug, clap::Args)]
pub struct Options {
    /// Nodes in the fleet, 8 GPUs each.
    #[arg(long, default_value_t = 1000)]
    pub nodes: usize,
    /// Events per second.
    #[arg(long, default_value_t = 5000)]
    pub rate: u64,
    /// How long to produce.
    #[arg(long, default_value = "60s", value_parser = crate::duration)]
    pub duration: Duration,
    /// Faults per minute over the whole fleet.
    #[arg(long, default_value_t = 30.0)]
    pub faults_per_minute: f64,
    /// Seed of the generator: a seed gives the same stream.
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// The topic to produce to.
    #[arg(long, default_value = gpumedic_schemas::topics::HEALTH_RAW)]
    pub topic: String,
    /// Also create the fleet's Nodes (and `--pods-per-node` GPU pods each) in the apiserver.
    #[arg(long)]
    pub create_nodes: bool,
    /// GPU pods per node when creating the fleet in the apiserver.
    #[arg(long, default_value_t = 2)]
    pub pods_per_node: usize,
}

/// The JSON result of the `fleet` command.
#[derive(Debug, serde::Serialize)]
pub struct Summary {
    scenario: &'static str,
    nodes: usize,
    gpus: usize,
    rate_target: u64,
    rate_achieved: f64,
    seconds: f64,
    events: u64,
    counts: BTreeMap<&'static str, u64>,
    /// The label every created Node carries, when `--create-nodes`.
    fleet_label: Option<String>,
}

/// A small, fast, seeded generator (SplitMix64): the stream must not depend on a crate's version.
#[derive(Debug, Clone)]
struct Rng(u64);

impl Rng {
    fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// Uniform in [0, 1).
    fn unit(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }

    /// Uniform in [0, n).
    fn below(&mut self, n: usize) -> usize {
        (self.next_u64() % n.max(1) as u64) as usize
    }

    /// Picks from `(weight, value)` pairs.
    fn pick<T: Copy>(&mut self, table: &[(u32, T)]) -> T {
        let total: u32 = table.iter().map(|(w, _)| w).sum();
        let mut at = (self.next_u64() % u64::from(total)) as u32;
        for (w, v) in table {
            if at < *w {
                return *v;
            }
            at -= w;
        }
        table[table.len() - 1].1
    }
}

/// Xid codes by share of the Xids a fleet logs (application faults dominate).
const XIDS: &[(u32, i32)] = &[
    (22, 13),
    (22, 31),
    (12, 43),
    (10, 45),
    (6, 94),
    (6, 79),
    (5, 74),
    (4, 63),
    (3, 48),
    (3, 119),
    (2, 64),
    (2, 95),
    (1, 92),
];

#[derive(Debug, Clone, Copy)]
enum Fault {
    Xid,
    EccTrend,
    Thermal,
    Maintenance,
}

const FAULTS: &[(u32, Fault)] =
    &[(60, Fault::Xid), (15, Fault::EccTrend), (15, Fault::Thermal), (10, Fault::Maintenance)];

/// What a GPU is going through.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    Normal,
    /// Corrected errors climbing for `left` more turns; `uncorrected` at the end.
    EccTrend {
        left: u32,
        uncorrected: bool,
    },
    /// Over the slowdown threshold for `left` more turns.
    Hot {
        left: u32,
    },
    /// An uncorrected error counted since the driver loaded, until the GPU is reset in `left`
    /// more turns (as remediation would), which clears the volatile counters.
    Uncorrected {
        left: u32,
    },
    /// Fallen off the bus: silent for `left` more turns.
    Lost {
        left: u32,
    },
}

#[derive(Debug, Clone)]
struct Gpu {
    uuid: String,
    pci_bus_id: String,
    sbe_volatile: i64,
    sbe_aggregate: i64,
    dbe_volatile: i64,
    dbe_aggregate: i64,
    state: State,
}

/// The fleet: its nodes, its GPUs' states, and the generator.
#[derive(Debug)]
pub struct Fleet {
    nodes: Vec<String>,
    gpus: Vec<Gpu>,
    rng: Rng,
    /// The GPU whose turn is next.
    turn: usize,
    /// How many times the stream went round the fleet.
    round: usize,
    /// Events already due (faults, heartbeats), sent before the next turn.
    due: VecDeque<HealthEvent>,
    /// Chance that an event is followed by a fault.
    fault_chance: f64,
    counts: BTreeMap<&'static str, u64>,
}

impl Fleet {
    /// A fleet of `nodes` nodes named `<prefix>-00000`…, sending `rate` events per second with
    /// `faults_per_minute` faults over the whole fleet.
    pub fn new(prefix: &str, nodes: usize, rate: u64, faults_per_minute: f64, seed: u64) -> Self {
        let nodes: Vec<String> = (0..nodes.max(1)).map(|n| format!("{prefix}-{n:05}")).collect();
        let mut rng = Rng(seed);
        let gpus = (0..nodes.len() * GPUS_PER_NODE)
            .map(|g| Gpu {
                uuid: format!(
                    "GPU-{:08x}-{:04x}-{:04x}-0000-{:012x}",
                    g / GPUS_PER_NODE,
                    g % GPUS_PER_NODE,
                    seed & 0xffff,
                    g
                ),
                pci_bus_id: format!("00000000:{:02x}:00.0", 0x18 + (g % GPUS_PER_NODE) * 0x10),
                sbe_volatile: 0,
                sbe_aggregate: rng.below(20) as i64,
                dbe_volatile: 0,
                dbe_aggregate: 0,
                state: State::Normal,
            })
            .collect();
        Fleet {
            nodes,
            gpus,
            rng,
            turn: 0,
            round: 0,
            due: VecDeque::new(),
            fault_chance: faults_per_minute / 60.0 / rate.max(1) as f64,
            counts: BTreeMap::new(),
        }
    }

    /// The nodes' names.
    pub fn nodes(&self) -> &[String] {
        &self.nodes
    }

    /// How many events of each kind (and faults of each kind) were made so far.
    pub fn counts(&self) -> &BTreeMap<&'static str, u64> {
        &self.counts
    }

    /// The next event of the stream, observed at `now`.
    pub fn next_event(&mut self, now: chrono::DateTime<chrono::Utc>) -> HealthEvent {
        loop {
            if let Some(mut e) = self.due.pop_front() {
                e.observed_at = now;
                self.count(&e);
                return e;
            }
            if self.rng.unit() < self.fault_chance {
                self.fault(now);
                continue;
            }
            let g = self.turn;
            self.turn = (self.turn + 1) % self.gpus.len();
            if self.turn == 0 {
                self.round += 1;
            }
            if g.is_multiple_of(GPUS_PER_NODE) {
                let node = &self.nodes[g / GPUS_PER_NODE];
                let heartbeat = Detail::MonitorHealth(MonitorHealthDetail {
                    monitor: "nvml".into(),
                    state: MonitorState::Ok,
                    message: None,
                });
                let mut e = HealthEvent::new(node.clone(), Source::Nvml, Component::Node, Entity::default(), heartbeat);
                e.healthy = true;
                self.due.push_back(e);
            }
            if let Some(e) = self.reading(g) {
                self.due.push_back(e);
            }
        }
    }

    fn count(&mut self, e: &HealthEvent) {
        let kind = match &e.detail {
            Detail::Xid(_) => "xid",
            Detail::GpuLost(_) => "gpu_lost",
            Detail::Ecc(_) => "ecc",
            Detail::RowRemap(_) => "row_remap",
            Detail::Temperature(_) => "temperature",
            Detail::Power(_) => "power",
            Detail::Throttle(_) => "throttle",
            Detail::CloudMaintenance(_) => "cloud_maintenance",
            Detail::MonitorHealth(_) => "monitor_health",
            _ => "other",
        };
        *self.counts.entry(kind).or_default() += 1;
        *self.counts.entry(if e.healthy { "healthy" } else { "unhealthy" }).or_default() += 1;
    }

    fn gpu_event(&self, g: usize, source: Source, detail: Detail, healthy: bool) -> HealthEvent {
        let gpu = &self.gpus[g];
        let entity =
            Entity { gpu_uuid: Some(gpu.uuid.clone()), pci_bus_id: Some(gpu.pci_bus_id.clone()), ..Default::default() };
        let mut e = HealthEvent::new(self.nodes[g / GPUS_PER_NODE].clone(), source, Component::Gpu, entity, detail);
        e.healthy = healthy;
        e
    }

    /// GPU `g`'s NVML reading for this turn (none while it is lost).
    fn reading(&mut self, g: usize) -> Option<HealthEvent> {
        // Temperature, power and ECC in rotation, staggered across GPUs so every kind flows.
        let turn_kind = (self.round + g) % 3;
        let jitter = self.rng.below(15) as i32;
        let state = self.gpus[g].state;
        let next = match state {
            State::Hot { left: 0 } => State::Normal,
            State::Lost { left: 0 } => {
                // Back after a reset: the volatile counters start again.
                let gpu = &mut self.gpus[g];
                gpu.sbe_volatile = 0;
                gpu.dbe_volatile = 0;
                State::Normal
            }
            State::Lost { left } => {
                self.gpus[g].state = State::Lost { left: left - 1 };
                return None;
            }
            State::Hot { left } => State::Hot { left: left - 1 },
            State::EccTrend { left: 0, uncorrected } => {
                if uncorrected {
                    let gpu = &mut self.gpus[g];
                    gpu.dbe_volatile += 1;
                    gpu.dbe_aggregate += 1;
                    let remap = Detail::RowRemap(RowRemapDetail {
                        correctable: 0,
                        uncorrectable: 1,
                        pending: true,
                        failure: false,
                    });
                    let e = self.gpu_event(g, Source::Nvml, remap, false);
                    self.due.push_back(e);
                    State::Uncorrected { left: 10 }
                } else {
                    State::Normal
                }
            }
            State::Uncorrected { left: 0 } => {
                let gpu = &mut self.gpus[g];
                gpu.sbe_volatile = 0;
                gpu.dbe_volatile = 0;
                State::Normal
            }
            State::Uncorrected { left } => State::Uncorrected { left: left - 1 },
            State::EccTrend { left, uncorrected } => {
                let climb = 5 + self.rng.below(45) as i64;
                let gpu = &mut self.gpus[g];
                gpu.sbe_volatile += climb;
                gpu.sbe_aggregate += climb;
                State::EccTrend { left: left - 1, uncorrected }
            }
            State::Normal => State::Normal,
        };
        self.gpus[g].state = next;
        let gpu = &self.gpus[g];
        let (detail, healthy) = match (next, turn_kind) {
            (State::Hot { .. }, _) => {
                let celsius = SLOWDOWN_CELSIUS + 1 + jitter % 7;
                let throttle =
                    Detail::Throttle(ThrottleDetail { reasons: vec!["hw_thermal_slowdown".into()], mask: Some(0x40) });
                let e = self.gpu_event(g, Source::Nvml, throttle, false);
                self.due.push_back(e);
                (
                    Detail::Temperature(TemperatureDetail {
                        celsius,
                        slowdown_celsius: Some(SLOWDOWN_CELSIUS),
                        shutdown_celsius: Some(95),
                    }),
                    false,
                )
            }
            (State::EccTrend { .. }, _) | (_, 2) => (
                Detail::Ecc(EccDetail {
                    single_bit_volatile: Some(gpu.sbe_volatile),
                    double_bit_volatile: Some(gpu.dbe_volatile),
                    single_bit_aggregate: Some(gpu.sbe_aggregate),
                    double_bit_aggregate: Some(gpu.dbe_aggregate),
                    location: Some("dram".into()),
                }),
                gpu.dbe_volatile == 0,
            ),
            (_, 0) => (
                Detail::Temperature(TemperatureDetail {
                    celsius: 55 + jitter,
                    slowdown_celsius: Some(SLOWDOWN_CELSIUS),
                    shutdown_celsius: Some(95),
                }),
                true,
            ),
            _ => {
                (Detail::Power(PowerDetail { watts: 380.0 + f64::from(jitter) * 20.0, limit_watts: Some(700.0) }), true)
            }
        };
        Some(self.gpu_event(g, Source::Nvml, detail, healthy))
    }

    /// Draws a fault on a random GPU; its first event is due now.
    fn fault(&mut self, now: chrono::DateTime<chrono::Utc>) {
        let g = self.rng.below(self.gpus.len());
        let kind = self.rng.pick(FAULTS);
        match kind {
            Fault::Xid => {
                let code = self.rng.pick(XIDS);
                let pid = 1000 + self.rng.below(60_000) as i32;
                let text = format!("NVRM: Xid (PCI:{}): {code}, pid={pid}, name=python", &self.gpus[g].pci_bus_id[4..]);
                let xid = Detail::Xid(XidDetail {
                    code,
                    text,
                    pid: Some(pid),
                    process: Some("python".into()),
                    nvlink5: None,
                    recovery_action: None,
                });
                let e = self.gpu_event(g, Source::KernelLog, xid, false);
                self.due.push_back(e);
                if code == 79 {
                    let lost = Detail::GpuLost(GpuLostDetail { reason: "NVML_ERROR_GPU_IS_LOST".into() });
                    let e = self.gpu_event(g, Source::Nvml, lost, false);
                    self.due.push_back(e);
                    self.gpus[g].state = State::Lost { left: 20 };
                }
                *self.counts.entry("fault_xid").or_default() += 1;
            }
            // A trend or an excursion starts on a GPU that is not going through something else.
            Fault::EccTrend => {
                let uncorrected = self.rng.below(4) == 0;
                if self.gpus[g].state == State::Normal {
                    self.gpus[g].state = State::EccTrend { left: 10, uncorrected };
                }
                *self.counts.entry("fault_ecc_trend").or_default() += 1;
            }
            Fault::Thermal => {
                if self.gpus[g].state == State::Normal {
                    self.gpus[g].state = State::Hot { left: 6 };
                }
                *self.counts.entry("fault_thermal").or_default() += 1;
            }
            Fault::Maintenance => {
                let node = self.nodes[g / GPUS_PER_NODE].clone();
                let id = format!("instance-event-{:016x}", self.rng.next_u64());
                let notice = Detail::CloudMaintenance(CloudMaintenanceDetail {
                    provider: CloudProvider::Aws,
                    event_type: "system-reboot".into(),
                    provider_event_id: Some(id),
                    window_start: Some(now + chrono::Duration::days(2)),
                    window_end: Some(now + chrono::Duration::days(2) + chrono::Duration::hours(2)),
                    description: Some("scheduled reboot".into()),
                });
                self.due.push_back(HealthEvent::new(node, Source::Cloud, Component::Node, Entity::default(), notice));
                *self.counts.entry("fault_maintenance").or_default() += 1;
            }
        }
    }
}

/// Produces the fleet's stream to `topic` at `rate` events per second until `until` or `stop`,
/// on the calling thread (run it on its own thread); `sent` counts the records queued so far.
pub fn produce_paced(
    fleet: &mut Fleet,
    producer: &ThreadedProducer<DefaultProducerContext>,
    topic: &str,
    rate: u64,
    until: Instant,
    stop: &AtomicBool,
    sent: &AtomicU64,
) -> anyhow::Result<()> {
    let start = Instant::now();
    let mut n: u64 = 0;
    while Instant::now() < until && !stop.load(Ordering::Relaxed) {
        let due = (start.elapsed().as_secs_f64() * rate as f64) as u64;
        if n >= due {
            std::thread::sleep(Duration::from_millis(2));
            continue;
        }
        let now = chrono::Utc::now();
        let upto = due.min(n + 1000);
        while n < upto {
            let e = fleet.next_event(now);
            let payload = gpumedic_schemas::encode(&e)?;
            crate::send(producer, BaseRecord::to(topic).key(e.node.as_str()).payload(payload.as_slice()))?;
            n += 1;
        }
        sent.store(n, Ordering::Relaxed);
    }
    producer.flush(Duration::from_secs(60)).context("flush")?;
    Ok(())
}

/// The label every Node of a created fleet carries, with the fleet's id as its value.
pub const FLEET_LABEL: &str = "gpumedic-bench/fleet";

/// Creates `names` as GPU Nodes labelled `FLEET_LABEL=fleet` (with the labels a GPU node of a
/// cloud fleet has), `concurrency` requests in flight.
pub async fn create_nodes(
    client: &kube::Client,
    fleet: &str,
    names: &[String],
    concurrency: usize,
) -> anyhow::Result<()> {
    let nodes: Api<Node> = Api::all(client.clone());
    futures::stream::iter(names.iter().map(|name| {
        let nodes = nodes.clone();
        async move {
            let node: Node = serde_json::from_value(json!({ "metadata": { "name": name, "labels": {
                FLEET_LABEL: fleet,
                "nvidia.com/gpu.present": "true",
                "nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3",
                "node.kubernetes.io/instance-type": "p5.48xlarge",
                "topology.kubernetes.io/zone": "us-east-1a",
            } } }))?;
            nodes.create(&PostParams::default(), &node).await.with_context(|| format!("create node {name}"))?;
            Ok::<_, anyhow::Error>(())
        }
    }))
    .buffer_unordered(concurrency)
    .try_collect::<Vec<()>>()
    .await?;
    Ok(())
}

/// [`create_nodes`], then `pods_per_node` GPU pods on each in a new namespace, which it returns.
pub async fn create_in_apiserver(
    client: &kube::Client,
    fleet: &str,
    names: &[String],
    pods_per_node: usize,
    concurrency: usize,
) -> anyhow::Result<String> {
    create_nodes(client, fleet, names, concurrency).await?;
    let ns = gpumedic_testkit::unique_name("bench-fleet");
    let namespaces: Api<Namespace> = Api::all(client.clone());
    namespaces.create(&PostParams::default(), &serde_json::from_value(json!({ "metadata": { "name": ns } }))?).await?;
    let pods: Api<Pod> = Api::namespaced(client.clone(), &ns);
    let gpus = (GPUS_PER_NODE / pods_per_node.max(1)).max(1).to_string();
    futures::stream::iter((0..names.len() * pods_per_node).map(|i| {
        let pods = pods.clone();
        let node = &names[i / pods_per_node];
        let gpus = gpus.clone();
        async move {
            let pod: Pod = serde_json::from_value(json!({
                "metadata": { "name": format!("trainer-{i:06}"), "labels": { "app": "trainer" } },
                "spec": { "nodeName": node, "containers": [{ "name": "main", "image": "trainer",
                    "resources": { "limits": { "nvidia.com/gpu": gpus } } }] }
            }))?;
            pods.create(&PostParams::default(), &pod).await.with_context(|| format!("create pod on {node}"))?;
            Ok::<_, anyhow::Error>(())
        }
    }))
    .buffer_unordered(concurrency)
    .try_collect::<Vec<()>>()
    .await?;
    Ok(ns)
}

/// Deletes the Nodes `names` and the namespace `ns` (best effort: a benchmark's cleanup).
pub async fn delete_from_apiserver(client: &kube::Client, names: &[String], ns: Option<&str>, concurrency: usize) {
    let nodes: Api<Node> = Api::all(client.clone());
    futures::stream::iter(names.iter().map(|name| {
        let nodes = nodes.clone();
        async move {
            let _ = nodes.delete(name, &DeleteParams::default()).await;
        }
    }))
    .buffer_unordered(concurrency)
    .collect::<Vec<()>>()
    .await;
    if let Some(ns) = ns {
        let _ = Api::<Namespace>::all(client.clone()).delete(ns, &DeleteParams::default()).await;
    }
}

/// The `fleet` command: the simulator on its own, into Kafka (and the apiserver).
pub async fn run(o: Options) -> anyhow::Result<Summary> {
    let bootstrap = gpumedic_testkit::require_kafka().await?;
    let id = gpumedic_testkit::unique_name("fleet");
    let mut fleet = Fleet::new(&id, o.nodes, o.rate, o.faults_per_minute, o.seed);
    let fleet_label = if o.create_nodes {
        let client = gpumedic_testkit::require_kubernetes().await?;
        let made = Instant::now();
        let ns = create_in_apiserver(&client, &id, fleet.nodes(), o.pods_per_node, 32).await?;
        println!(
            "fleet: {} Nodes ({FLEET_LABEL}={id}) and {} GPU pods in namespace {ns} created in {:.1} s",
            o.nodes,
            o.nodes * o.pods_per_node,
            made.elapsed().as_secs_f64()
        );
        Some(format!("{FLEET_LABEL}={id}"))
    } else {
        None
    };
    gpumedic_runtime::kafka::KafkaSettings {
        bootstrap: bootstrap.clone(),
        options: vec![],
        schema_registry: None,
        topic_replication: None,
    }
    .ensure_topics(&[gpumedic_runtime::kafka::TopicSpec::new(&o.topic, gpumedic_schemas::topics::DEFAULT_PARTITIONS)])
    .await?;
    let producer = crate::scratch_producer(&bootstrap)?;
    let (stop, sent) = (Arc::new(AtomicBool::new(false)), Arc::new(AtomicU64::new(0)));
    let topic = o.topic.clone();
    let start = Instant::now();
    let until = start + o.duration;
    let (rate, s2, n2) = (o.rate, stop.clone(), sent.clone());
    let fleet = tokio::task::spawn_blocking(move || {
        produce_paced(&mut fleet, &producer, &topic, rate, until, &s2, &n2).map(|()| fleet)
    })
    .await??;
    let seconds = start.elapsed().as_secs_f64();
    let events = sent.load(Ordering::Relaxed);
    let summary = Summary {
        scenario: "fleet",
        nodes: o.nodes,
        gpus: o.nodes * GPUS_PER_NODE,
        rate_target: o.rate,
        rate_achieved: events as f64 / seconds,
        seconds,
        events,
        counts: fleet.counts().clone(),
        fleet_label,
    };
    println!(
        "fleet: {events} events from {} nodes ({} GPUs) to {} in {seconds:.1} s ({:.0}/s, target {}/s); {:?}",
        o.nodes, summary.gpus, o.topic, summary.rate_achieved, o.rate, summary.counts
    );
    Ok(summary)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn stream(seed: u64, n: usize) -> (Fleet, Vec<HealthEvent>) {
        let mut fleet = Fleet::new("t", 50, 1000, 600.0, seed);
        let now = chrono::DateTime::from_timestamp(1_800_000_000, 0).unwrap();
        let events = (0..n).map(|_| fleet.next_event(now)).collect();
        (fleet, events)
    }

    #[test]
    fn a_seed_gives_the_same_stream_and_another_seed_another() {
        let key = |e: &HealthEvent| (e.node.clone(), e.entity.gpu_uuid.clone(), format!("{:?}", e.detail), e.healthy);
        let (_, a) = stream(7, 5000);
        let (_, b) = stream(7, 5000);
        let (_, c) = stream(8, 5000);
        assert_eq!(a.iter().map(key).collect::<Vec<_>>(), b.iter().map(key).collect::<Vec<_>>());
        assert_ne!(a.iter().map(key).collect::<Vec<_>>(), c.iter().map(key).collect::<Vec<_>>());
    }

    #[test]
    fn the_stream_is_mostly_healthy_readings_with_every_fault_kind() {
        // 600 faults a minute at 1,000 events a second: one event in 100 starts a fault.
        let (fleet, events) = stream(1, 200_000);
        let c = fleet.counts();
        for kind in [
            "temperature",
            "power",
            "ecc",
            "monitor_health",
            "xid",
            "gpu_lost",
            "throttle",
            "cloud_maintenance",
            "row_remap",
        ] {
            assert!(c.get(kind).copied().unwrap_or(0) > 0, "no {kind} in {c:?}");
        }
        let faults: u64 =
            ["fault_xid", "fault_ecc_trend", "fault_thermal", "fault_maintenance"].iter().map(|k| c[k]).sum();
        assert!((1500..2500).contains(&faults), "about 2,000 faults expected: {c:?}");
        assert!(c["fault_xid"] > c["fault_ecc_trend"] && c["fault_xid"] > c["fault_maintenance"], "{c:?}");
        let unhealthy: Vec<String> =
            events.iter().filter(|e| !e.healthy).map(|e| format!("{:?}", e.detail.kind())).collect();
        assert!(
            unhealthy.len() * 20 < events.len(),
            "{} unhealthy of {}: {:?}",
            unhealthy.len(),
            events.len(),
            &unhealthy[..50]
        );
        // The stream goes round the fleet: every GPU reports.
        let gpus: std::collections::HashSet<_> = events.iter().filter_map(|e| e.entity.gpu_uuid.clone()).collect();
        assert_eq!(gpus.len(), 50 * GPUS_PER_NODE);
    }

    #[test]
    fn a_lost_gpu_goes_silent_then_reports_again_and_a_hot_gpu_cools() {
        let mut fleet = Fleet::new("t", 2, 1000, 0.0, 3);
        let now = chrono::Utc::now();
        fleet.gpus[5].state = State::Lost { left: 3 };
        fleet.gpus[6].state = State::Hot { left: 2 };
        let uuid5 = fleet.gpus[5].uuid.clone();
        let uuid6 = fleet.gpus[6].uuid.clone();
        let mut readings5 = Vec::new();
        let mut hot6 = Vec::new();
        // Ten rounds of 16 GPUs (and 2 heartbeats a round).
        for _ in 0..10 * 18 {
            let e = fleet.next_event(now);
            if e.entity.gpu_uuid.as_deref() == Some(uuid5.as_str()) {
                readings5.push(e.healthy);
            }
            if e.entity.gpu_uuid.as_deref() == Some(uuid6.as_str()) && matches!(e.detail, Detail::Temperature(_)) {
                hot6.push(e.healthy);
            }
        }
        assert_eq!(readings5.len(), 10 - 3, "silent for three turns, then readings: {readings5:?}");
        assert!(readings5.iter().all(|h| *h));
        assert_eq!(&hot6[..2], &[false, false], "{hot6:?}");
        assert!(hot6[2..].iter().all(|h| *h), "{hot6:?}");
    }

    #[test]
    fn an_ecc_trend_climbs_and_may_end_uncorrected() {
        let mut fleet = Fleet::new("t", 1, 1000, 0.0, 4);
        let now = chrono::Utc::now();
        fleet.gpus[0].state = State::EccTrend { left: 3, uncorrected: true };
        let uuid = fleet.gpus[0].uuid.clone();
        let mut sbe = Vec::new();
        let mut remap = 0;
        for _ in 0..9 * 30 {
            let e = fleet.next_event(now);
            if e.entity.gpu_uuid.as_deref() != Some(uuid.as_str()) {
                continue;
            }
            match &e.detail {
                Detail::Ecc(d) => {
                    sbe.push((d.single_bit_aggregate.unwrap(), d.double_bit_volatile.unwrap(), e.healthy))
                }
                Detail::RowRemap(_) => remap += 1,
                _ => {}
            }
        }
        assert!(sbe.windows(2).all(|w| w[1].0 >= w[0].0), "{sbe:?}");
        assert!(sbe[0].0 < sbe[2].0, "corrected errors climb: {sbe:?}");
        assert_eq!(remap, 1);
        assert!(sbe.iter().any(|(_, dbe, healthy)| *dbe == 1 && !healthy), "{sbe:?}");
        assert!(sbe.last().is_some_and(|(_, dbe, healthy)| *dbe == 0 && *healthy), "reset after ten turns: {sbe:?}");
    }
}
