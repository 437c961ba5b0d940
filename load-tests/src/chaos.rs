//! `chaos`: the pipeline under faults, on servers of its own, proven by id at the end.
//!
//! 1. Private PostgreSQL, Kafka, etcd and kube-apiserver start through `compose/up` with their own
//!    state folder (`--state-dir`) and ports (`--port-base`), so the schedule never touches the
//!    shared testbed ([`servers`]).
//! 2. The simulated fleet ([`crate::fleet`]) is created in the private apiserver, plus one node for
//!    a real collector (simulated GPUs). The collector, the enricher, two classifiers (one group)
//!    and the remediator (`cordon-drain`, breaker and rate limit out of the way, so every
//!    quarantine a verdict asks for is carried out) start with their logs in `<state>/services/`.
//! 3. The fleet's stream, with its fault mix, goes to the raw topic at `--rate`; every event id
//!    is kept, and records the broker refuses for good are counted (the run fails on any). Meanwhile the schedule ([`schedule`]) SIGKILLs and
//!    restarts each service, restarts Kafka, PostgreSQL and the apiserver (`compose/down` then
//!    `compose/up`), and SIGSTOPs every process of the private PostgreSQL for `--pg-pause`, past
//!    its statement and lock timeouts. A service that exits on its own is restarted and counted.
//! 4. The stream stops; the run waits until every consumer group's lag is 0, neither classifier
//!    holds a time-based decision still to come (`gpumedic_classifier_nodes_awaiting_time`: a held
//!    threshold or a quiet period being counted, which ends in a verdict on time with no new
//!    event), and the verdict and action topics have been still for `--settle-quiet`.
//! 5. The proofs ([`proofs`]), each naming the ids that break it: no event lost (every event on
//!    the raw topic is in `health_events` or on a dead-letter topic), none recorded twice, no two
//!    open incidents for one (node, rule, GPU), the verdicts on the topic and in PostgreSQL the
//!    same set, every verdict answered on the actions topic, no action applied twice, every outcome
//!    recorded, and every node cordoned and tainted exactly when an open incident calls for it.

mod proofs;
mod servers;

use std::collections::{BTreeMap, HashSet};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::Context as _;
use gpumedic_runtime::kafka::{KafkaSettings, dead_letter_topic, stage_topics};
use gpumedic_schemas::{ActionOutcome, EnrichedHealthEvent, HealthEvent, Verdict, topics};
use gpumedic_testkit as testkit;
use k8s_openapi::api::core::v1::Node;
use rdkafka::consumer::{BaseConsumer, Consumer as _};
use rdkafka::producer::{BaseRecord, Producer as _, ProducerContext, ThreadedProducer};
use rdkafka::{ClientContext, Message as _, Offset, TopicPartitionList};
use uuid::Uuid;

use crate::fleet::{self, Fleet};
use servers::PrivateTestbed;

/// Options of the scenario.
#[derive(Debug, clap::Args)]
pub struct Options {
    /// The short variant (about 5 minutes when the pipeline settles): a 100-second schedule with
    /// one of each fault.
    #[arg(long)]
    short: bool,
    /// Events per second from the simulated fleet.
    #[arg(long, default_value_t = 2000)]
    rate: u64,
    /// Nodes in the fleet (8 GPUs each).
    #[arg(long, default_value_t = 200)]
    nodes: usize,
    /// GPU pods per node.
    #[arg(long, default_value_t = 2)]
    pods_per_node: usize,
    /// Faults per minute over the whole fleet.
    #[arg(long, default_value_t = 60.0)]
    faults_per_minute: f64,
    /// Seed of the fleet's generator.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// How long PostgreSQL stays SIGSTOPped (past its 30 s statement timeout and 10 s lock timeout).
    #[arg(long, value_parser = crate::duration)]
    pg_pause: Option<Duration>,
    /// The classifier's cap on quiet periods, so incidents also recover during the run.
    #[arg(long, default_value = "20s", value_parser = crate::duration)]
    max_quiet: Duration,
    /// How long the verdict and action topics must be still, with every lag at 0 and no
    /// time-based decision pending, before the proofs (past the remediator's 10 s resync).
    #[arg(long, default_value = "20s", value_parser = crate::duration)]
    settle_quiet: Duration,
    /// The longest the pipeline may take to settle (the longest held threshold of the default
    /// rules is 5 minutes, and one that began as the stream ended is still due).
    #[arg(long, default_value = "420s", value_parser = crate::duration)]
    settle_timeout: Duration,
    /// The private servers' state folder (data, logs, pids, kubeconfig, service logs).
    #[arg(long, default_value = "target/chaos-testbed")]
    state_dir: PathBuf,
    /// The private servers' ports: this plus the testbed's offsets (Kafka +92, PostgreSQL +432,
    /// etcd +379/+380, the apiserver +443).
    #[arg(long, default_value_t = 29000)]
    port_base: u16,
    /// Leave the private servers and services' logs in place at the end (by default they are
    /// stopped and the state folder deleted; service logs are kept on failure).
    #[arg(long)]
    keep: bool,
}

/// One fault of the schedule.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fault {
    /// SIGKILL the service (index into the run's services), start it again.
    Kill(&'static str),
    /// `compose/down` then `compose/up` of a private server.
    Restart(&'static str),
    /// SIGSTOP every process of the private PostgreSQL, SIGCONT after the pause.
    PausePostgres,
}

/// The schedule: when each fault starts, from the start of the stream, and how long the stream
/// runs at least. A step starts once the one before it has recovered, so on a busy machine the
/// schedule runs late and the stream runs on until 5 s after its last step.
pub fn schedule(short: bool) -> (Vec<(Duration, Fault)>, Duration) {
    let s = Duration::from_secs;
    if short {
        let steps = vec![
            (s(8), Fault::Kill("enricher")),
            (s(14), Fault::Kill("classifier-a")),
            (s(20), Fault::Kill("remediator")),
            (s(26), Fault::Restart("kafka")),
            (s(40), Fault::Kill("classifier-b")),
            (s(46), Fault::Restart("postgres")),
            (s(56), Fault::PausePostgres),
            (s(80), Fault::Restart("kubernetes")),
            (s(92), Fault::Kill("collector")),
        ];
        (steps, s(100))
    } else {
        let steps = vec![
            (s(20), Fault::Kill("enricher")),
            (s(40), Fault::Kill("classifier-a")),
            (s(60), Fault::Kill("remediator")),
            (s(80), Fault::Restart("kafka")),
            (s(120), Fault::Kill("classifier-b")),
            (s(140), Fault::Restart("postgres")),
            (s(170), Fault::PausePostgres),
            (s(230), Fault::Restart("kubernetes")),
            (s(265), Fault::Kill("collector")),
            (s(280), Fault::Kill("classifier-a")),
            (s(285), Fault::Kill("remediator")),
            (s(300), Fault::Restart("kafka")),
            (s(330), Fault::Kill("enricher")),
        ];
        (steps, s(360))
    }
}

/// What one fault did.
#[derive(Debug, Clone, serde::Serialize)]
pub struct StepReport {
    at_s: f64,
    fault: String,
    /// Seconds from the fault until the server answered or the service was ready again.
    recovered_in_s: f64,
    note: String,
}

/// The JSON result.
#[derive(Debug, serde::Serialize)]
pub struct Result {
    scenario: &'static str,
    short: bool,
    rate: u64,
    nodes: usize,
    stream_s: f64,
    produced: u64,
    produce_failures: u64,
    rate_achieved: f64,
    fleet_counts: BTreeMap<&'static str, u64>,
    schedule: Vec<StepReport>,
    /// Services that exited without being killed, restarted by the run: `service: status`.
    unexpected_exits: Vec<String>,
    settle_s: f64,
    /// Why the pipeline did not settle (every lag 0, verdicts and actions still), if it did not.
    unsettled: Option<String>,
    raw_topic_events: usize,
    recorded_events: usize,
    dead_lettered_events: usize,
    open_incidents: usize,
    verdicts: usize,
    outcomes: usize,
    quarantined_nodes: usize,
    figures: BTreeMap<&'static str, usize>,
    findings: proofs::Findings,
    passed: bool,
}

impl Result {
    /// Whether the pipeline settled, every proof held and the simulator delivered every event.
    pub fn passed(&self) -> bool {
        self.passed
    }
}

/// A service binary the run starts, kills and restarts, its output appended to a log file.
struct Service {
    name: &'static str,
    binary: String,
    env: Vec<(&'static str, String)>,
    log: PathBuf,
    child: Option<std::process::Child>,
    admin: std::net::SocketAddr,
}

impl Service {
    fn new(name: &'static str, binary: &str, env: Vec<(&'static str, String)>, logs: &std::path::Path) -> Self {
        Self {
            name,
            binary: crate::release_binary(binary).unwrap_or_else(|_| binary.to_owned()),
            env,
            log: logs.join(format!("{name}.log")),
            child: None,
            admin: ([127, 0, 0, 1], 0).into(),
        }
    }

    fn start(&mut self) -> anyhow::Result<()> {
        self.admin = testkit::free_local_addr()?;
        let log = std::fs::OpenOptions::new().create(true).append(true).open(&self.log)?;
        let child = std::process::Command::new(&self.binary)
            .env("GPUMEDIC_ADMIN_ADDR", self.admin.to_string())
            .env("GPUMEDIC_LOG", "info")
            .envs(self.env.iter().map(|(k, v)| (*k, v.as_str())))
            .stdin(std::process::Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log)
            .spawn()
            .with_context(|| format!("start {}", self.binary))?;
        self.child = Some(child);
        Ok(())
    }

    /// SIGKILL, and reap.
    fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// The exit status if it exited.
    fn exited(&mut self) -> Option<std::process::ExitStatus> {
        self.child.as_mut().and_then(|c| c.try_wait().ok().flatten())
    }

    async fn wait_ready(&mut self, timeout: Duration) -> anyhow::Result<Duration> {
        let started = Instant::now();
        let mut last = String::from("no answer yet");
        while started.elapsed() < timeout {
            if let Some(status) = self.exited() {
                anyhow::bail!("the {} exited with {status} before it was ready; see {}", self.name, self.log.display());
            }
            match testkit::http_get(self.admin, "/readyz").await {
                Ok((200, _)) => return Ok(started.elapsed()),
                Ok((code, body)) => last = format!("{code} {}", body.trim()),
                Err(e) => last = e.to_string(),
            }
            tokio::time::sleep(Duration::from_millis(250)).await;
        }
        anyhow::bail!(
            "the {} was not ready after {timeout:?} (last /readyz: {last}); see {}",
            self.name,
            self.log.display()
        )
    }

    /// SIGTERM and wait (the end of the run).
    async fn terminate(&mut self) {
        if let Some(c) = self.child.as_mut() {
            let _ = std::process::Command::new("kill").args(["-TERM", &c.id().to_string()]).status();
            for _ in 0..150 {
                if matches!(c.try_wait(), Ok(Some(_))) {
                    break;
                }
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
        }
        self.kill();
    }
}

impl Drop for Service {
    /// A run that ends early (an error, a failed settle) leaves no service behind.
    fn drop(&mut self) {
        self.kill();
    }
}

/// Counts the records the broker refused for good: events the harness, not the pipeline, lost.
struct Deliveries {
    failed: Arc<AtomicU64>,
}

impl ClientContext for Deliveries {}

impl ProducerContext for Deliveries {
    type DeliveryOpaque = ();
    fn delivery(&self, result: &rdkafka::message::DeliveryResult<'_>, _: Self::DeliveryOpaque) {
        if result.is_err() {
            self.failed.fetch_add(1, Ordering::Relaxed);
        }
    }
}

/// The kube client of the private apiserver.
async fn kube_client(path: &std::path::Path) -> anyhow::Result<kube::Client> {
    let config = kube::config::Kubeconfig::read_from(path)?;
    let config = kube::Config::from_custom_kubeconfig(config, &kube::config::KubeConfigOptions::default()).await?;
    Ok(kube::Client::try_from(config)?)
}

/// Every record of `topic` (all partitions, from the start to the current end).
fn read_topic(bootstrap: &str, topic: &str) -> anyhow::Result<Vec<Vec<u8>>> {
    let consumer = crate::topic_reader(bootstrap)?;
    let ranges: Vec<_> = crate::watermarks(consumer, topic)?
        .into_iter()
        .map(|(p, low, high)| (topic.to_owned(), p, low, high))
        .collect();
    let mut out = Vec::new();
    crate::read_ranges(consumer, &ranges, |m| {
        if let Some(p) = m.payload() {
            out.push(p.to_vec());
        }
    })?;
    Ok(out)
}

/// Reads the committed offsets of the services' consumer groups: one consumer per group, created
/// once and never subscribed (so it never joins the group), and never dropped: librdkafka's close
/// of a consumer configured with a `group.id` can wait indefinitely, which once held a run in its
/// settle step for minutes past every timeout.
struct GroupLag {
    consumers: Vec<(&'static str, &'static [&'static str], BaseConsumer)>,
}

impl GroupLag {
    /// The consumers, leaked: they live until the process ends.
    fn leaked(bootstrap: &str) -> anyhow::Result<&'static Self> {
        let mut consumers = Vec::new();
        for (group, topics) in GROUPS {
            let consumer: BaseConsumer = rdkafka::ClientConfig::new()
                .set("bootstrap.servers", bootstrap)
                .set("group.id", group)
                .set("enable.auto.commit", "false")
                .create()?;
            consumers.push((group, topics, consumer));
        }
        Ok(Box::leak(Box::new(Self { consumers })))
    }

    /// The summed lag of each group over its topics, in [`GROUPS`] order (a partition a group never
    /// committed counts from its start).
    fn lags(&self) -> anyhow::Result<Vec<i64>> {
        let timeout = Duration::from_secs(10);
        let mut lags = Vec::new();
        for (group, topics, consumer) in &self.consumers {
            let mut tpl = TopicPartitionList::new();
            for topic in *topics {
                let metadata = consumer.fetch_metadata(Some(topic), timeout)?;
                for t in metadata.topics() {
                    for p in t.partitions() {
                        tpl.add_partition(topic, p.id());
                    }
                }
            }
            let committed =
                consumer.committed_offsets(tpl, timeout).with_context(|| format!("the offsets of {group}"))?;
            let mut lag = 0;
            for e in committed.elements() {
                let (low, high) = consumer.fetch_watermarks(e.topic(), e.partition(), timeout)?;
                let at = match e.offset() {
                    Offset::Offset(o) => o,
                    _ => low,
                };
                lag += (high - at).max(0);
            }
            lags.push(lag);
        }
        Ok(lags)
    }
}

/// Runs blocking `work` (librdkafka calls) on a thread of its own and waits for it at most `limit`:
/// past it the run goes on with an error and the thread is left to finish or die with the process,
/// so no blocking call can hold the run.
async fn bounded<T: Send + 'static>(
    what: &str,
    limit: Duration,
    work: impl FnOnce() -> anyhow::Result<T> + Send + 'static,
) -> anyhow::Result<T> {
    let (tx, rx) = tokio::sync::oneshot::channel();
    std::thread::Builder::new().name("chaos-blocking".to_owned()).spawn(move || {
        let _ = tx.send(work());
    })?;
    match tokio::time::timeout(limit, rx).await {
        Ok(Ok(result)) => result,
        Ok(Err(_)) => anyhow::bail!("{what}: the thread panicked"),
        Err(_) => anyhow::bail!("{what} did not finish within {limit:?}"),
    }
}

/// How many nodes the two classifiers hold a time-based decision for (a held threshold, a quiet
/// period being counted), from their `/metrics`; an error while either cannot answer.
async fn awaiting_time(services: &[Service]) -> anyhow::Result<f64> {
    let mut total = 0.0;
    for s in services.iter().filter(|s| s.name.starts_with("classifier")) {
        let (status, text) =
            testkit::http_get(s.admin, "/metrics").await.with_context(|| format!("{} /metrics", s.name))?;
        anyhow::ensure!(status == 200, "{} /metrics answered {status}", s.name);
        anyhow::ensure!(
            text.contains("gpumedic_classifier_nodes_awaiting_time "),
            "{} has not ticked since it started",
            s.name
        );
        total += crate::classify::metric(&text, "gpumedic_classifier_nodes_awaiting_time");
    }
    Ok(total)
}

/// The end offsets of `topic`, summed: a figure that changes when anything is appended.
fn topic_end(bootstrap: &str, topic: &str) -> anyhow::Result<i64> {
    let consumer: BaseConsumer = rdkafka::ClientConfig::new().set("bootstrap.servers", bootstrap).create()?;
    let timeout = Duration::from_secs(10);
    let metadata = consumer.fetch_metadata(Some(topic), timeout)?;
    let mut sum = 0;
    for t in metadata.topics() {
        for p in t.partitions() {
            sum += consumer.fetch_watermarks(topic, p.id(), timeout)?.1;
        }
    }
    Ok(sum)
}

/// How long the simulator's producer may take to have every event acknowledged after the stream
/// stops: a Kafka restart at the end of the schedule took 36 s on a loaded 2-core machine, and the
/// idempotent producer then re-establishes its id before it sends again.
const FLUSH_FOR: Duration = Duration::from_secs(600);

const GROUPS: [(&str, &[&str]); 3] = [
    ("gpumedic-enricher", &[topics::HEALTH_RAW]),
    ("gpumedic-classifier", &[topics::HEALTH_ENRICHED, topics::ACTIONS]),
    ("gpumedic-remediator", &[topics::VERDICTS]),
];

/// Runs the scenario, prints each step and figure; the result says whether every proof held.
pub async fn run(o: Options) -> anyhow::Result<Result> {
    let compose = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../compose");
    let state = std::path::absolute(&o.state_dir)?;
    let bed = PrivateTestbed::new(compose, state.clone(), o.port_base);
    bed.ensure_ports_free()?;
    if state.exists() {
        // A folder left by an earlier run: its servers are down (the ports are free), so start clean.
        bed.wipe().await?;
    }
    println!("chaos: starting private servers ({}) in {}", servers::SERVERS.join(", "), state.display());
    let took = bed.up(&servers::SERVERS).await?;
    println!(
        "chaos: private servers up in {:.0} s: Kafka {}, {}",
        took.as_secs_f64(),
        bed.bootstrap(),
        bed.database_url()
    );
    let outcome = run_on(&o, &bed).await;
    match &outcome {
        Ok(r) if r.passed && !o.keep => bed.wipe().await?,
        _ if o.keep => println!(
            "chaos: --keep: the private servers stay up; stop them with `GPUMEDIC_TESTBED={} compose/down`",
            state.display()
        ),
        _ => {
            // Keep the evidence (service and server logs), stop the servers.
            bed.down(&servers::SERVERS).await?;
            println!("chaos: servers stopped; logs kept in {}/logs and {}/services", state.display(), state.display());
        }
    }
    outcome
}

async fn run_on(o: &Options, bed: &PrivateTestbed) -> anyhow::Result<Result> {
    let bootstrap = bed.bootstrap();
    let client = kube_client(&bed.kubeconfig()).await?;
    let settings =
        KafkaSettings { bootstrap: bootstrap.clone(), options: vec![], schema_registry: None, topic_replication: None };
    settings
        .ensure_topics(&stage_topics(
            &[topics::HEALTH_RAW, topics::HEALTH_ENRICHED, topics::ACTIONS],
            &[topics::VERDICTS],
            topics::DEFAULT_PARTITIONS,
        ))
        .await?;

    let id = "chaos";
    let mut fleet = Fleet::paced(id, o.nodes, o.rate, o.faults_per_minute, o.seed, fleet::XidNames::Pci)?;
    let mut names = fleet.nodes().to_vec();
    let ns = fleet::create_in_apiserver(&client, id, &names, o.pods_per_node, 32).await?;
    let collector_node = format!("{id}-collector");
    fleet::create_nodes(&client, id, std::slice::from_ref(&collector_node), 1).await?;
    names.push(collector_node.clone());
    let fleet_names: HashSet<String> = names.iter().cloned().collect();
    println!(
        "chaos: {} nodes ({} GPUs, {} pods) and the collector's node in the private apiserver",
        o.nodes,
        o.nodes * fleet::GPUS_PER_NODE,
        o.nodes * o.pods_per_node
    );

    let logs = bed.state_dir().join("services");
    std::fs::create_dir_all(&logs)?;
    let kubeconfig = bed.kubeconfig().display().to_string();
    let common = vec![("GPUMEDIC_KAFKA_BOOTSTRAP", bootstrap.clone()), ("GPUMEDIC_LOG", "info".to_owned())];
    let classifier_env = {
        let mut env = common.clone();
        env.extend([
            ("GPUMEDIC_DATABASE_URL", bed.database_url()),
            // Every event recorded: the suite proves none is lost or recorded twice.
            ("GPUMEDIC_PERSIST", "all".to_owned()),
            ("GPUMEDIC_MAX_QUIET", format!("{}s", o.max_quiet.as_secs())),
        ]);
        env
    };
    let mut services = vec![
        Service::new(
            "collector",
            "gpumedic-collector",
            {
                let mut env = common.clone();
                env.extend([
                    ("GPUMEDIC_NODE_NAME", collector_node.clone()),
                    ("GPUMEDIC_GPU_BACKEND", "simulated".to_owned()),
                    ("GPUMEDIC_SIMULATED_GPUS", "8".to_owned()),
                    ("GPUMEDIC_SAMPLE_INTERVAL", "1s".to_owned()),
                    ("GPUMEDIC_HEARTBEAT_INTERVAL", "5s".to_owned()),
                    ("GPUMEDIC_KMSG_PATH", "off".to_owned()),
                    ("GPUMEDIC_STATE_DIR", bed.state_dir().join("collector").display().to_string()),
                    ("GPUMEDIC_SYNTHETIC_ADDR", testkit::free_local_addr()?.to_string()),
                    ("GPUMEDIC_INGEST_SOCKET", bed.state_dir().join("collector/ingest.sock").display().to_string()),
                ]);
                env
            },
            &logs,
        ),
        Service::new(
            "enricher",
            "gpumedic-enricher",
            {
                let mut env = common.clone();
                env.push(("KUBECONFIG", kubeconfig.clone()));
                env
            },
            &logs,
        ),
        Service::new("classifier-a", "gpumedic-classifier", classifier_env.clone(), &logs),
        Service::new("classifier-b", "gpumedic-classifier", classifier_env, &logs),
        Service::new(
            "remediator",
            "gpumedic-remediator",
            {
                let mut env = common.clone();
                env.extend([
                    ("KUBECONFIG", kubeconfig.clone()),
                    ("GPUMEDIC_MODE", "cordon-drain".to_owned()),
                    ("GPUMEDIC_GPU_NODE_SELECTOR", format!("{}={id}", fleet::FLEET_LABEL)),
                    ("GPUMEDIC_LEASE_NAMESPACE", ns.clone()),
                    ("GPUMEDIC_DRAIN_GRACE_SECONDS", "0".to_owned()),
                    ("GPUMEDIC_BREAKER_MAX_SHARE", "1.0".to_owned()),
                    ("GPUMEDIC_BREAKER_MAX_COUNT", "100000".to_owned()),
                    ("GPUMEDIC_QUARANTINES_PER_MINUTE", "100000".to_owned()),
                    ("GPUMEDIC_MAINTENANCE_CHECK", "5s".to_owned()),
                    // As deployed: the leader resyncs nodes against the open incidents in the store.
                    ("GPUMEDIC_INCIDENT_DATABASE_URL", bed.database_url()),
                    ("GPUMEDIC_RESYNC_INTERVAL", "10s".to_owned()),
                ]);
                env
            },
            &logs,
        ),
    ];
    std::fs::create_dir_all(bed.state_dir().join("collector"))?;
    // One at a time: the classifiers' migrations and the lease are not raced at start.
    for s in &mut services {
        s.start()?;
        s.wait_ready(Duration::from_secs(120)).await?;
    }
    println!("chaos: collector, enricher, two classifiers and the remediator ready; logs in {}", logs.display());

    // The stream, with every acknowledged event id kept.
    let failed = Arc::new(AtomicU64::new(0));
    let producer: ThreadedProducer<Deliveries> = rdkafka::ClientConfig::new()
        .set("bootstrap.servers", &bootstrap)
        .set("acks", "all")
        .set("enable.idempotence", "true")
        .set("linger.ms", "5")
        .set("compression.type", "lz4")
        .set("message.timeout.ms", "900000")
        .set("queue.buffering.max.messages", "2000000")
        .create_with_context(Deliveries { failed: failed.clone() })?;
    let (schedule, stream_for) = schedule(o.short);
    let (stop, sent) = (Arc::new(AtomicBool::new(false)), Arc::new(AtomicU64::new(0)));
    let ids: Arc<Mutex<Vec<Uuid>>> = Arc::default();
    let start = Instant::now();
    let producing = {
        let (stop, sent, ids, rate) = (stop.clone(), sent.clone(), ids.clone(), o.rate);
        std::thread::spawn(move || -> anyhow::Result<Fleet> {
            let mut n: u64 = 0;
            // Until the schedule is done and the stream has run its length, whichever is later.
            while !stop.load(Ordering::Relaxed) {
                let due = (start.elapsed().as_secs_f64() * rate as f64) as u64;
                if n >= due {
                    std::thread::sleep(Duration::from_millis(2));
                    continue;
                }
                let mut batch = Vec::new();
                let upto = due.min(n + 1000);
                while n < upto {
                    let e = fleet.next_event();
                    let payload = gpumedic_schemas::encode(&e)?;
                    send(&producer, BaseRecord::to(topics::HEALTH_RAW).key(e.node.as_str()).payload(&payload))?;
                    batch.push(e.event_id);
                    n += 1;
                }
                ids.lock().map_err(|_| anyhow::anyhow!("poisoned"))?.extend(batch);
                sent.store(n, Ordering::Relaxed);
            }
            // Through Kafka's restarts the queue waits; give it the time a restart takes on a
            // loaded machine, and say what is still waiting while it does.
            let deadline = Instant::now() + FLUSH_FOR;
            loop {
                match producer.flush(Duration::from_secs(30)) {
                    Ok(()) => break,
                    Err(e) if Instant::now() < deadline => {
                        println!(
                            "chaos: {} events not yet acknowledged ({e}); still waiting",
                            producer.in_flight_count()
                        );
                    }
                    Err(e) => {
                        let left = producer.in_flight_count();
                        return Err(e).with_context(|| {
                            format!("flush the simulator's events: {left} unacknowledged after {FLUSH_FOR:?}")
                        });
                    }
                }
            }
            Ok(fleet)
        })
    };
    println!("chaos: streaming {} events/s for {} s with this schedule:", o.rate, stream_for.as_secs());
    for (at, fault) in &schedule {
        println!("  t={:>4}s  {}", at.as_secs(), describe(*fault, o));
    }

    let mut reports = Vec::new();
    let mut unexpected = Vec::new();
    let pg_pause = o.pg_pause.unwrap_or(if o.short { Duration::from_secs(20) } else { Duration::from_secs(45) });
    let steps: anyhow::Result<()> = async {
        for (at, fault) in &schedule {
            // Until the step is due, watch for services that exit on their own.
            while start.elapsed() < *at {
                watch(&mut services, &mut unexpected, start).await;
                tokio::time::sleep(Duration::from_millis(500)).await;
            }
            let began = Instant::now();
            let note = match fault {
                Fault::Kill(name) => {
                    let s = services.iter_mut().find(|s| s.name == *name).context("no such service")?;
                    s.kill();
                    tokio::time::sleep(Duration::from_secs(2)).await;
                    s.start()?;
                    match s.wait_ready(Duration::from_secs(180)).await {
                        Ok(_) => "killed, restarted, ready".to_owned(),
                        Err(e) => format!("killed, restarted, NOT ready: {e}"),
                    }
                }
                Fault::Restart(server) => {
                    let down = bed.down(&[server]).await?;
                    let up = bed.up(&[server]).await?;
                    format!("stopped in {:.1} s, started in {:.1} s", down.as_secs_f64(), up.as_secs_f64())
                }
                Fault::PausePostgres => {
                    let pids = bed.postgres_pids()?;
                    servers::signal(&pids, "STOP")?;
                    tokio::time::sleep(pg_pause).await;
                    // Every process of the cluster, including any the postmaster forked before it stopped.
                    let again = bed.postgres_pids().unwrap_or_default();
                    let all: Vec<u32> =
                        pids.iter().chain(again.iter()).copied().collect::<HashSet<_>>().into_iter().collect();
                    servers::signal(&all, "CONT")?;
                    format!("{} processes stopped for {} s", pids.len(), pg_pause.as_secs())
                }
            };
            let r = StepReport {
                at_s: (*at).as_secs_f64(),
                fault: describe(*fault, o),
                recovered_in_s: began.elapsed().as_secs_f64(),
                note,
            };
            println!(
                "  t={:>5.1}s  {}: {} ({:.1} s); {} events produced",
                start.elapsed().as_secs_f64(),
                r.fault,
                r.note,
                r.recovered_in_s,
                sent.load(Ordering::Relaxed)
            );
            reports.push(r);
        }
        // The last fault gets some stream after it too.
        let until = stream_for.max(start.elapsed() + Duration::from_secs(5));
        while start.elapsed() < until {
            watch(&mut services, &mut unexpected, start).await;
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
        Ok(())
    }
    .await;
    stop.store(true, Ordering::Relaxed);
    // The producer flushes for at most FLUSH_FOR; a minute more for the rest.
    let fleet = bounded("stopping the stream", FLUSH_FOR + Duration::from_secs(60), move || {
        producing.join().map_err(|_| anyhow::anyhow!("the producer thread panicked"))?
    })
    .await?;
    let stream_s = start.elapsed().as_secs_f64();
    steps?;
    let produced = sent.load(Ordering::Relaxed);
    let produce_failures = failed.load(Ordering::Relaxed);
    println!("chaos: stream ended: {produced} events in {stream_s:.0} s, {produce_failures} refused by the broker");

    // Settle: every lag 0, no time-based decision pending, the verdict and action topics still
    // for --settle-quiet.
    let settling = Instant::now();
    let mut last_ends = (-1, -1);
    let mut still_since = Instant::now();
    let group_lag = GroupLag::leaked(&bootstrap)?;
    let mut last_report = Instant::now();
    // Why the pipeline did not settle, if it did not: the proofs still run on what is there.
    let mut unsettled: Option<String> = None;
    loop {
        watch(&mut services, &mut unexpected, start).await;
        let b = bootstrap.clone();
        let measured = bounded("reading the consumer groups' lag", Duration::from_secs(60), move || {
            Ok((group_lag.lags()?, (topic_end(&b, topics::VERDICTS)?, topic_end(&b, topics::ACTIONS)?)))
        })
        .await;
        let measured = match measured {
            Ok(m) => awaiting_time(&services).await.map(|awaiting| (m, awaiting)),
            Err(e) => Err(e),
        };
        let ((lags, ends), awaiting) = match measured {
            Ok(m) => m,
            Err(e) => {
                // Counts as not settled; the settle timeout still bounds the wait.
                println!("  settle: {e:#}");
                if settling.elapsed() >= o.settle_timeout {
                    unsettled = Some(format!("not settled within {:?}: {e:#}", o.settle_timeout));
                    break;
                }
                still_since = Instant::now();
                tokio::time::sleep(Duration::from_secs(2)).await;
                continue;
            }
        };
        // A classifier with a held threshold or a quiet period still being counted will yet
        // publish (on time, with no new event): not settled until every such deadline has passed.
        if ends != last_ends || awaiting > 0.0 {
            still_since = Instant::now();
            last_ends = ends;
        }
        // A lag is judged when it is read, not over the quiet period: the real collector keeps
        // publishing its own monitor events and heartbeats, so a lag above 0 comes and goes for
        // a moment every few seconds and would never leave 20 s of quiet. Every group at its end
        // now means every event was handled (each commits after publishing), so a verdict one
        // of them caused is on the topic already and would have moved its end.
        let caught_up = lags.iter().all(|l| *l == 0);
        if last_report.elapsed() >= Duration::from_secs(30) {
            println!(
                "  settling for {:.0} s: lags {lags:?} (enricher, classifier, remediator), verdict and action ends {ends:?}, \
                 {awaiting:.0} nodes awaiting a time-based decision",
                settling.elapsed().as_secs_f64()
            );
            last_report = Instant::now();
        }
        if caught_up && still_since.elapsed() >= o.settle_quiet {
            break;
        }
        if settling.elapsed() >= o.settle_timeout {
            unsettled = Some(format!(
                "not settled within {:?}: lags {lags:?} (enricher, classifier, remediator), {awaiting:.0} nodes \
                 awaiting a time-based decision; the verdict and action topics last grew {:.0} s ago",
                o.settle_timeout,
                still_since.elapsed().as_secs_f64()
            ));
            break;
        }
        tokio::time::sleep(Duration::from_secs(2)).await;
    }
    let settle_s = settling.elapsed().as_secs_f64();
    match &unsettled {
        None => println!(
            "chaos: settled in {settle_s:.0} s (every lag 0, verdicts and actions still for {} s)",
            o.settle_quiet.as_secs()
        ),
        Some(why) => println!(
            "chaos: FAILED to settle: {why}; the proofs run on what is there (a lag above 0 counts events \
             still in flight as lost)"
        ),
    }

    // Read everything back.
    let mut c = proofs::Collected {
        produced: ids.lock().map_err(|_| anyhow::anyhow!("poisoned"))?.iter().copied().collect(),
        ..proofs::Collected::default()
    };
    let b = bootstrap.clone();
    let (raw, dead, verdicts, outcomes, undecodable) =
        bounded("reading the topics back", Duration::from_secs(900), move || {
            let mut undecodable = 0usize;
            let raw: HashSet<Uuid> = read_topic(&b, topics::HEALTH_RAW)?
                .iter()
                .filter_map(|p| gpumedic_schemas::decode::<HealthEvent>(p).ok().map(|e| e.event_id))
                .collect();
            let mut dead = HashSet::new();
            for p in read_topic(&b, &dead_letter_topic(topics::HEALTH_RAW))? {
                match gpumedic_schemas::decode::<HealthEvent>(&p) {
                    Ok(e) => drop(dead.insert(e.event_id)),
                    Err(_) => undecodable += 1,
                }
            }
            for p in read_topic(&b, &dead_letter_topic(topics::HEALTH_ENRICHED))? {
                match gpumedic_schemas::decode::<EnrichedHealthEvent>(&p) {
                    Ok(e) => drop(dead.insert(e.event.event_id)),
                    Err(_) => undecodable += 1,
                }
            }
            let verdicts: Vec<Verdict> = read_topic(&b, topics::VERDICTS)?
                .iter()
                .map(|p| gpumedic_schemas::decode(p))
                .collect::<std::result::Result<_, _>>()?;
            let outcomes: Vec<ActionOutcome> = read_topic(&b, topics::ACTIONS)?
                .iter()
                .map(|p| gpumedic_schemas::decode(p))
                .collect::<std::result::Result<_, _>>()?;
            Ok((raw, dead, verdicts, outcomes, undecodable))
        })
        .await?;
    (c.raw_topic, c.dead_lettered, c.verdicts, c.outcomes) = (raw, dead, verdicts, outcomes);
    if undecodable > 0 {
        println!("chaos: {undecodable} dead-lettered records could not be decoded (their ids are unknown)");
    }
    let db = gpumedic_runtime::postgres::connect(&bed.database_url(), 2).await?;
    let rows: Vec<(Uuid, i64)> =
        sqlx::query_as("SELECT event_id, count(*) FROM health_events GROUP BY event_id").fetch_all(&db).await?;
    c.recorded_twice = rows.iter().filter(|(_, n)| *n > 1).map(|(id, _)| *id).collect();
    c.recorded = rows.into_iter().map(|(id, _)| id).collect();
    let open: Vec<(Uuid, String, String, Option<String>)> =
        sqlx::query_as("SELECT incident_id, node, rule_id, gpu_uuid FROM incidents WHERE resolved_at IS NULL")
            .fetch_all(&db)
            .await?;
    c.open_incidents = open
        .into_iter()
        .map(|(incident_id, node, rule_id, gpu)| proofs::OpenIncident { incident_id, node, rule_id, gpu })
        .collect();
    c.verdicts_recorded =
        sqlx::query_scalar::<_, Uuid>("SELECT verdict_id FROM verdicts").fetch_all(&db).await?.into_iter().collect();
    c.outcomes_recorded = sqlx::query_as::<_, (Uuid, String, String)>("SELECT verdict_id, action, status FROM actions")
        .fetch_all(&db)
        .await?
        .into_iter()
        .collect();
    let nodes: kube::Api<Node> = kube::Api::all(client.clone());
    let listed = nodes.list(&kube::api::ListParams::default().labels(&format!("{}={id}", fleet::FLEET_LABEL))).await?;
    let read_at = chrono::Utc::now();
    c.nodes = listed.items.iter().map(gpumedic_remediator::plan::NodeView::from_node).collect();

    let findings = proofs::check(&c, &fleet_names, read_at);
    for s in &mut services {
        s.terminate().await;
    }

    let figures: BTreeMap<&'static str, usize> = findings.figures().into_iter().collect();
    let quarantined = c.nodes.iter().filter(|n| n.unschedulable).count();
    println!(
        "chaos: {} events on the raw topic, {} recorded, {} dead-lettered; {} verdicts, {} outcomes; {} open incidents; {} nodes quarantined",
        c.raw_topic.len(),
        c.recorded.len(),
        c.dead_lettered.len(),
        c.verdicts.iter().map(|v| v.verdict_id).collect::<HashSet<_>>().len(),
        c.outcomes.len(),
        c.open_incidents.len(),
        quarantined
    );
    for (name, n) in findings.figures() {
        println!("  {name:<36} {n}");
    }
    for (name, ids) in findings.failing_ids(20) {
        println!("  FAILED: {name}:");
        for id in ids {
            println!("    {id}");
        }
    }
    if !unexpected.is_empty() {
        println!("  services that exited on their own (restarted): {unexpected:?}");
    }
    let passed = findings.passed() && produce_failures == 0 && unsettled.is_none();
    Ok(Result {
        scenario: "chaos",
        short: o.short,
        rate: o.rate,
        nodes: o.nodes,
        stream_s,
        produced,
        produce_failures,
        rate_achieved: produced as f64 / stream_s,
        fleet_counts: fleet.counts().clone(),
        schedule: reports,
        unexpected_exits: unexpected,
        settle_s,
        unsettled,
        raw_topic_events: c.raw_topic.len(),
        recorded_events: c.recorded.len(),
        dead_lettered_events: c.dead_lettered.len(),
        open_incidents: c.open_incidents.len(),
        verdicts: c.verdicts.len(),
        outcomes: c.outcomes.len(),
        quarantined_nodes: quarantined,
        figures,
        findings,
        passed,
    })
}

/// A fault in words.
fn describe(fault: Fault, o: &Options) -> String {
    match fault {
        Fault::Kill(s) => format!("SIGKILL {s}"),
        Fault::Restart("kubernetes") => "restart etcd and the kube-apiserver".to_owned(),
        Fault::Restart(s) => format!("restart {s}"),
        Fault::PausePostgres => {
            format!("SIGSTOP PostgreSQL for {} s", o.pg_pause.map_or(if o.short { 20 } else { 45 }, |d| d.as_secs()))
        }
    }
}

/// Restarts any service that exited on its own, and records it.
async fn watch(services: &mut [Service], unexpected: &mut Vec<String>, start: Instant) {
    for s in services.iter_mut() {
        if let Some(status) = s.exited() {
            let line = format!("{} at t={:.0}s: {status}", s.name, start.elapsed().as_secs_f64());
            println!("  {line}; restarting it (see {})", s.log.display());
            unexpected.push(line);
            s.child = None;
            if let Err(e) = s.start() {
                println!("  could not restart the {}: {e}", s.name);
            }
        }
    }
}

/// Queues `record`, waiting while librdkafka's queue is full.
fn send(producer: &ThreadedProducer<Deliveries>, mut record: BaseRecord<'_, str, [u8]>) -> anyhow::Result<()> {
    loop {
        match producer.send(record) {
            Ok(()) => return Ok(()),
            Err((e, r)) if e.rdkafka_error_code() == Some(rdkafka::types::RDKafkaErrorCode::QueueFull) => {
                record = r;
                producer.poll(Duration::from_millis(5));
            }
            Err((e, _)) => anyhow::bail!("produce failed: {e}"),
        }
    }
}
