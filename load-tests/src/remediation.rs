//! Remediation benchmarks against the testbed's kube-apiserver and Kafka, with the remediator
//! binary (release build) as deployed: it consumes verdicts from a topic and changes Nodes.
//!
//! - **floor**: the apiserver's own latency and throughput for a plain node patch (a label), at
//!   the same concurrency the scenarios' fleet is built with, on the same nodes, in the same run:
//!   no remediation can beat it.
//! - **mass quarantine**: N GPU nodes, one critical `cordon` verdict each on a fresh topic; the
//!   time from the first verdict produced to the last node cordoned, as seen by a watch.
//! - **GPU quarantine**: G single-GPU quarantines in a DRA cluster: G/4 nodes publishing 8 GPUs
//!   each in a ResourceSlice shaped like the NVIDIA DRA driver's, four critical GPU-scoped `cordon`
//!   verdicts per node (half its GPUs, the escalation share not passed); the time from the first
//!   verdict produced to the last DeviceTaintRule seen by a watch. Needs an apiserver serving
//!   `resource.k8s.io/v1beta2` (compose/lib/servers.sh).
//! - **mass drain**: M GPU nodes with P pods each (bound with `spec.nodeName`; no kubelet runs
//!   them, so grace 0 makes an eviction final), one critical `drain` verdict each; the time from
//!   the first verdict produced to the last pod gone, as seen by a watch.
//!
//! The breaker and the rate limit are opened wide (share 1.0, count and rate above N), since
//! the point is the pipeline's speed, not its brakes. Each scenario has its own fleet label,
//! namespace, topics and group; what it made is deleted at the end.

use std::collections::HashSet;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::Context as _;
use futures::{StreamExt as _, TryStreamExt as _};
use gpumedic_runtime::kafka::{KafkaSettings, TopicSpec};
use gpumedic_schemas::{RecommendedAction, Severity, Verdict};
use gpumedic_testkit as testkit;
use k8s_openapi::api::core::v1::{Namespace, Node, Pod};
use kube::api::{Api, DeleteParams, ListParams, Patch, PatchParams, PostParams};
use kube::runtime::watcher;
use serde_json::json;

/// The flags of the `remediation` scenario.
#[derive(Debug, clap::Args)]
pub struct Args {
    /// Nodes (and verdicts) in the mass-quarantine scenario.
    #[arg(long, default_value_t = 1000)]
    nodes: usize,
    /// Nodes in the mass-drain scenario.
    #[arg(long, default_value_t = 500)]
    drain_nodes: usize,
    /// Pods per node in the mass-drain scenario.
    #[arg(long, default_value_t = 20)]
    pods_per_node: usize,
    /// Requests in flight while building fixtures and measuring the floor.
    #[arg(long, default_value_t = 32)]
    concurrency: usize,
    /// Single-GPU quarantines (DeviceTaintRules) in the GPU-quarantine scenario, four per node.
    #[arg(long, default_value_t = 1000)]
    gpu_quarantines: usize,
    /// Which scenarios to run beside the floor: `all`, `quarantine`, `gpu-quarantine` or `drain`.
    #[arg(long, default_value = "all")]
    only: String,
    /// The remediator binary (default: the one beside this program, i.e. the same profile).
    #[arg(long)]
    remediator: Option<PathBuf>,
    /// Extra `KEY=VALUE` environment for the remediator (repeatable), to compare settings.
    #[arg(long = "remediator-env")]
    remediator_env: Vec<String>,
}

/// The apiserver's floor for a plain node patch.
#[derive(Debug, serde::Serialize)]
struct Floor {
    patches: usize,
    concurrency: usize,
    p50_ms: f64,
    p99_ms: f64,
    patches_per_sec: f64,
}

/// One remediation scenario's result.
#[derive(Debug, serde::Serialize)]
struct Scenario {
    scenario: &'static str,
    nodes: usize,
    pods: usize,
    seconds: f64,
    per_sec: f64,
    unit: &'static str,
    goal_seconds: f64,
    /// Whether the goal was met; `None` below the goal's scale (1,000 nodes, 10,000 pods).
    met: Option<bool>,
}

fn verdict_on_goal(met: Option<bool>) -> &'static str {
    match met {
        Some(true) => "met",
        Some(false) => "MISSED",
        None => "not judged below the goal's scale",
    }
}

#[derive(Debug, serde::Serialize)]
struct Report {
    floor: Floor,
    scenarios: Vec<Scenario>,
}

/// Runs the floor and the chosen scenarios; prints one line each and writes `remediation.json`.
pub async fn run(args: Args, out_dir: &Path) -> anyhow::Result<()> {
    let client = testkit::require_kubernetes().await.map_err(anyhow::Error::msg)?;
    let bootstrap = testkit::require_kafka().await.map_err(anyhow::Error::msg)?;
    std::fs::create_dir_all(out_dir)?;
    let binary = match &args.remediator {
        Some(p) => p.clone(),
        None => std::env::current_exe()?.parent().context("no folder")?.join("gpumedic-remediator"),
    };
    anyhow::ensure!(binary.is_file(), "{} is missing: cargo build --release -p gpumedic-remediator", binary.display());
    let world =
        World { client, bootstrap, binary, out_dir: out_dir.to_owned(), extra_env: args.remediator_env.clone() };

    let mut scenarios = Vec::new();
    let fleet = testkit::unique_name("bench-fleet");
    let names = world.make_nodes(&fleet, args.nodes, args.concurrency).await?;
    let floor = world.floor(&names, args.concurrency).await?;
    println!(
        "remediation floor: {} plain node patches at concurrency {}: p50 {:.1} ms, p99 {:.1} ms, {:.0} patches/s",
        floor.patches, floor.concurrency, floor.p50_ms, floor.p99_ms, floor.patches_per_sec
    );
    if args.only == "all" || args.only == "quarantine" {
        let s = world.mass_quarantine(&fleet, &names).await;
        world.delete_nodes(&names, args.concurrency).await;
        let s = s?;
        println!(
            "mass-quarantine: {} nodes cordoned from {} verdicts in {:.2} s ({:.0} nodes/s; goal < {:.0} s: {}) beside \
             the floor of {:.0} patches/s",
            s.nodes,
            s.nodes,
            s.seconds,
            s.per_sec,
            s.goal_seconds,
            verdict_on_goal(s.met),
            floor.patches_per_sec
        );
        scenarios.push(s);
    } else {
        world.delete_nodes(&names, args.concurrency).await;
    }
    if args.only == "all" || args.only == "gpu-quarantine" {
        let s = world.gpu_quarantine(args.gpu_quarantines, args.concurrency).await?;
        println!(
            "gpu-quarantine: {} GPUs tainted by DeviceTaintRules on {} nodes in {:.2} s ({:.0} GPUs/s; goal < {:.0} s: \
             {}) beside the floor of {:.0} patches/s",
            s.pods,
            s.nodes,
            s.seconds,
            s.per_sec,
            s.goal_seconds,
            verdict_on_goal(s.met),
            floor.patches_per_sec
        );
        scenarios.push(s);
    }
    if args.only == "all" || args.only == "drain" {
        let s = world.mass_drain(args.drain_nodes, args.pods_per_node, args.concurrency).await?;
        println!(
            "mass-drain: {} pods evicted from {} nodes in {:.2} s ({:.0} evictions/s; goal < {:.0} s: {}) beside the \
             floor of {:.0} patches/s",
            s.pods,
            s.nodes,
            s.seconds,
            s.per_sec,
            s.goal_seconds,
            verdict_on_goal(s.met),
            floor.patches_per_sec
        );
        scenarios.push(s);
    }
    let path = out_dir.join("remediation.json");
    std::fs::write(&path, serde_json::to_vec_pretty(&Report { floor, scenarios })?)?;
    println!("result written to {}", path.display());
    Ok(())
}

struct World {
    client: kube::Client,
    bootstrap: String,
    binary: PathBuf,
    out_dir: PathBuf,
    extra_env: Vec<String>,
}

fn verdict(node: &str, action: RecommendedAction) -> Verdict {
    Verdict {
        verdict_id: uuid::Uuid::new_v4(),
        incident_id: uuid::Uuid::new_v4(),
        node: node.to_owned(),
        entity: Default::default(),
        severity: Severity::Critical,
        rule_id: "xid-79-fallen-off-the-bus".into(),
        rule_version: 1,
        action,
        custom_action: None,
        reason: "GPU has fallen off the bus (benchmark)".into(),
        evidence: vec![],
        issued_at: chrono::Utc::now(),
        recovery: false,
        not_before: None,
        deferrable: false,
        workload: None,
    }
}

impl World {
    async fn make_nodes(&self, fleet: &str, n: usize, concurrency: usize) -> anyhow::Result<Vec<String>> {
        let names: Vec<String> = (0..n).map(|i| format!("{fleet}-{i:05}")).collect();
        crate::fleet::create_nodes(&self.client, fleet, &names, concurrency).await?;
        Ok(names)
    }

    async fn delete_nodes(&self, names: &[String], concurrency: usize) {
        crate::fleet::delete_from_apiserver(&self.client, names, None, concurrency).await;
    }

    /// One plain label patch per node, `concurrency` in flight.
    async fn floor(&self, names: &[String], concurrency: usize) -> anyhow::Result<Floor> {
        let nodes: Api<Node> = Api::all(self.client.clone());
        let start = Instant::now();
        let mut latencies: Vec<f64> = futures::stream::iter(names.iter().map(|name| {
            let nodes = nodes.clone();
            async move {
                let t = Instant::now();
                let patch = json!({ "metadata": { "labels": { "gpumedic-bench/touched": "yes" } } });
                nodes.patch(name, &PatchParams::default(), &Patch::Merge(&patch)).await?;
                Ok::<_, kube::Error>(t.elapsed().as_secs_f64() * 1000.0)
            }
        }))
        .buffer_unordered(concurrency)
        .try_collect()
        .await?;
        let secs = start.elapsed().as_secs_f64();
        latencies.sort_by(f64::total_cmp);
        let pct = |p: f64| latencies[((latencies.len() as f64 * p).ceil() as usize).clamp(1, latencies.len()) - 1];
        Ok(Floor {
            patches: names.len(),
            concurrency,
            p50_ms: pct(0.50),
            p99_ms: pct(0.99),
            patches_per_sec: names.len() as f64 / secs,
        })
    }

    /// Starts the remediator on `verdicts` for the nodes of `fleet`, in `mode`, and waits until it
    /// leads with its partitions assigned. Its log goes to `<out>/<log>`.
    async fn start_remediator(
        &self,
        ns: &str,
        fleet: &str,
        verdicts: &str,
        mode: &str,
        log: &str,
    ) -> anyhow::Result<Remediator> {
        self.start_remediator_with(ns, fleet, verdicts, mode, log, &[]).await
    }

    /// [`World::start_remediator`] with `env` set on the remediator besides.
    async fn start_remediator_with(
        &self,
        ns: &str,
        fleet: &str,
        verdicts: &str,
        mode: &str,
        log: &str,
        env: &[(&str, &str)],
    ) -> anyhow::Result<Remediator> {
        let admin = testkit::free_local_addr()?;
        let logfile = std::fs::File::create(self.out_dir.join(log))?;
        let mut cmd = std::process::Command::new(&self.binary);
        cmd.env("GPUMEDIC_ADMIN_ADDR", admin.to_string())
            .env("GPUMEDIC_LOG", "info")
            .env("GPUMEDIC_KAFKA_BOOTSTRAP", &self.bootstrap)
            .env("GPUMEDIC_GROUP", testkit::unique_name("bench-remediator"))
            .env("GPUMEDIC_VERDICTS_TOPIC", verdicts)
            .env("GPUMEDIC_ACTIONS_TOPIC", format!("{verdicts}.actions"))
            .env("KUBECONFIG", testkit::kubeconfig_path())
            .env("GPUMEDIC_LEASE_NAMESPACE", ns)
            .env("GPUMEDIC_MODE", mode)
            .env("GPUMEDIC_GPU_NODE_SELECTOR", format!("gpumedic-bench/fleet={fleet}"))
            .env("GPUMEDIC_BREAKER_MAX_SHARE", "1.0")
            .env("GPUMEDIC_BREAKER_MAX_COUNT", "100000")
            .env("GPUMEDIC_QUARANTINES_PER_MINUTE", "100000")
            .env("GPUMEDIC_DRAIN_GRACE_SECONDS", "0")
            .env("GPUMEDIC_DRAIN_DEADLINE", "10m")
            .stdin(std::process::Stdio::null())
            .stdout(logfile.try_clone()?)
            .stderr(logfile);
        for (k, v) in env {
            cmd.env(k, v);
        }
        for kv in &self.extra_env {
            let (k, v) = kv.split_once('=').context("--remediator-env takes KEY=VALUE")?;
            cmd.env(k, v);
        }
        let child = cmd.spawn().with_context(|| format!("start {}", self.binary.display()))?;
        let mut r = Remediator { child };
        let deadline = Instant::now() + Duration::from_secs(120);
        loop {
            if testkit::http_get(admin, "/readyz").await.is_ok_and(|(status, _)| status == 200) {
                return Ok(r);
            }
            if let Some(status) = r.child.try_wait()? {
                anyhow::bail!(
                    "the remediator exited with {status}; see its log in {}",
                    self.out_dir.join(log).display()
                );
            }
            anyhow::ensure!(Instant::now() < deadline, "the remediator was not ready within 120 s");
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }

    /// The testbed's Kafka, as the scenarios' producers and topic set-up reach it.
    fn kafka(&self) -> KafkaSettings {
        KafkaSettings {
            bootstrap: self.bootstrap.clone(),
            options: vec![],
            schema_registry: None,
            topic_replication: None,
        }
    }

    /// A new verdict topic of the default partition count, for one scenario's remediator alone.
    async fn fresh_verdict_topic(&self) -> anyhow::Result<String> {
        let topic = testkit::unique_name("bench-verdicts");
        self.kafka().ensure_topics(&[TopicSpec::new(&topic, gpumedic_schemas::topics::DEFAULT_PARTITIONS)]).await?;
        Ok(topic)
    }

    async fn namespace(&self) -> anyhow::Result<String> {
        let name = testkit::unique_name("bench-ns");
        let namespaces: Api<Namespace> = Api::all(self.client.clone());
        namespaces
            .create(&PostParams::default(), &serde_json::from_value(json!({ "metadata": { "name": name } }))?)
            .await?;
        Ok(name)
    }

    /// Produces one verdict per node as fast as Kafka takes them; returns when the first was sent.
    async fn produce(&self, topic: &str, names: &[String], action: RecommendedAction) -> anyhow::Result<Instant> {
        let verdicts: Vec<Verdict> = names.iter().map(|n| verdict(n, action)).collect();
        self.produce_verdicts(topic, &verdicts).await
    }

    /// Produces `verdicts`, keyed by node, as fast as Kafka takes them; returns when the first was
    /// sent.
    async fn produce_verdicts(&self, topic: &str, verdicts: &[Verdict]) -> anyhow::Result<Instant> {
        let producer = self.kafka().producer("bench")?;
        let records: Vec<(String, Vec<u8>)> = verdicts
            .iter()
            .map(|v| Ok((v.node.clone(), gpumedic_schemas::encode(v)?)))
            .collect::<anyhow::Result<_>>()?;
        let first = Instant::now();
        futures::stream::iter(records.iter().map(|(key, bytes)| {
            let producer = &producer;
            async move { gpumedic_runtime::kafka::publish(producer, topic, key, bytes, &[]).await }
        }))
        .buffer_unordered(256)
        .try_collect::<Vec<_>>()
        .await?;
        Ok(first)
    }

    async fn mass_quarantine(&self, fleet: &str, names: &[String]) -> anyhow::Result<Scenario> {
        let ns = self.namespace().await?;
        let topic = self.fresh_verdict_topic().await?;
        let mut remediator = self.start_remediator(&ns, fleet, &topic, "cordon-drain", "mass-quarantine.log").await?;
        // Watch before producing, so no cordon is missed.
        let nodes: Api<Node> = Api::all(self.client.clone());
        let selector = format!("gpumedic-bench/fleet={fleet}");
        let mut stream = watcher(nodes, watcher::Config::default().labels(&selector)).boxed();
        let mut listed = false;
        while !listed {
            if let Some(watcher::Event::InitDone) = stream.try_next().await? {
                listed = true;
            }
        }
        let first = self.produce(&topic, names, RecommendedAction::Cordon).await?;
        let mut cordoned = HashSet::new();
        let timeout = Duration::from_secs(600);
        while cordoned.len() < names.len() {
            let event = tokio::time::timeout(timeout.saturating_sub(first.elapsed()), stream.try_next())
                .await
                .context("not every node was cordoned within 10 minutes")??;
            if let Some(watcher::Event::Apply(n) | watcher::Event::InitApply(n)) = event
                && n.spec.as_ref().and_then(|s| s.unschedulable).unwrap_or(false)
            {
                cordoned.insert(n.metadata.name.unwrap_or_default());
            }
        }
        let seconds = first.elapsed().as_secs_f64();
        remediator.stop();
        let _ = Api::<Namespace>::all(self.client.clone()).delete(&ns, &DeleteParams::default()).await;
        Ok(Scenario {
            scenario: "mass-quarantine",
            nodes: names.len(),
            pods: 0,
            seconds,
            per_sec: names.len() as f64 / seconds,
            unit: "nodes cordoned per second",
            goal_seconds: 10.0,
            met: (names.len() >= 1000).then_some(seconds < 10.0),
        })
    }

    /// `quarantines` single-GPU quarantines, four per node, on nodes that publish 8 GPUs through DRA.
    async fn gpu_quarantine(&self, quarantines: usize, concurrency: usize) -> anyhow::Result<Scenario> {
        use gpumedic_remediator::dra;
        use k8s_openapi::api::resource::v1::ResourceSlice;
        use k8s_openapi::api::resource::v1beta2::DeviceTaintRule;
        const GPUS: usize = 8;
        const PER_NODE: usize = 4;
        let fleet = testkit::unique_name("bench-dra");
        let names = self.make_nodes(&fleet, quarantines.div_ceil(PER_NODE), concurrency).await?;
        let uuid = |node: usize, gpu: usize| format!("GPU-{node:08x}-0000-4000-8000-{gpu:012x}");
        let slices: Api<ResourceSlice> = Api::all(self.client.clone());
        let slice_names: Vec<String> = names.iter().map(|n| format!("{n}-gpu.nvidia.com")).collect();
        futures::stream::iter(names.iter().enumerate().map(|(i, node)| {
            let slices = slices.clone();
            let devices: Vec<_> = (0..GPUS)
                .map(|g| {
                    json!({ "name": format!("gpu-{g}"), "attributes": {
                    "type": { "string": "gpu" }, "uuid": { "string": uuid(i, g) }, "index": { "int": g } } })
                })
                .collect();
            let slice = json!({
                "apiVersion": "resource.k8s.io/v1", "kind": "ResourceSlice",
                "metadata": { "name": format!("{node}-gpu.nvidia.com") },
                "spec": { "driver": dra::DRIVER, "nodeName": node,
                          "pool": { "name": node, "generation": 1, "resourceSliceCount": 1 }, "devices": devices },
            });
            async move {
                let slice: ResourceSlice = serde_json::from_value(slice)?;
                slices.create(&PostParams::default(), &slice).await?;
                Ok::<_, anyhow::Error>(())
            }
        }))
        .buffer_unordered(concurrency)
        .try_collect::<Vec<_>>()
        .await?;
        let wanted: HashSet<String> = names
            .iter()
            .enumerate()
            .flat_map(|(i, n)| (0..PER_NODE).map(move |g| (i, n, g)))
            .take(quarantines)
            .map(|(i, n, g)| dra::rule_name(n, &uuid(i, g)))
            .collect();
        let ns = self.namespace().await?;
        let topic = self.fresh_verdict_topic().await?;
        let mut remediator = self
            .start_remediator_with(
                &ns,
                &fleet,
                &topic,
                "cordon-drain",
                "gpu-quarantine.log",
                &[("GPUMEDIC_BREAKER_MAX_GPUS", "100000")],
            )
            .await?;
        let rules: Api<DeviceTaintRule> = Api::all(self.client.clone());
        let selector = format!("{}={}", dra::MANAGED_BY_LABEL, dra::MANAGED_BY);
        let mut stream = watcher(rules.clone(), watcher::Config::default().labels(&selector)).boxed();
        while !matches!(stream.try_next().await?, Some(watcher::Event::InitDone)) {}
        let verdicts: Vec<Verdict> = names
            .iter()
            .enumerate()
            .flat_map(|(i, n)| (0..PER_NODE).map(move |g| (i, n, g)))
            .take(quarantines)
            .map(|(i, n, g)| Verdict {
                entity: gpumedic_schemas::health::Entity { gpu_uuid: Some(uuid(i, g)), ..Default::default() },
                rule_id: "xid-48-with-row-remap".into(),
                reason: "double-bit ECC error (benchmark)".into(),
                ..verdict(n, RecommendedAction::Cordon)
            })
            .collect();
        let first = self.produce_verdicts(&topic, &verdicts).await?;
        let mut seen = HashSet::new();
        let timeout = Duration::from_secs(600);
        while seen.len() < wanted.len() {
            let event = tokio::time::timeout(timeout.saturating_sub(first.elapsed()), stream.try_next())
                .await
                .context("not every GPU was tainted within 10 minutes")??;
            if let Some(watcher::Event::Apply(r) | watcher::Event::InitApply(r)) = event
                && let Some(name) = r.metadata.name
                && wanted.contains(&name)
            {
                seen.insert(name);
            }
        }
        let seconds = first.elapsed().as_secs_f64();
        remediator.stop();
        for name in &wanted {
            let _ = rules.delete(name, &DeleteParams::default()).await;
        }
        for name in &slice_names {
            let _ = slices.delete(name, &DeleteParams::default()).await;
        }
        self.delete_nodes(&names, concurrency).await;
        let _ = Api::<Namespace>::all(self.client.clone()).delete(&ns, &DeleteParams::default()).await;
        Ok(Scenario {
            scenario: "gpu-quarantine",
            nodes: names.len(),
            pods: wanted.len(),
            seconds,
            per_sec: wanted.len() as f64 / seconds,
            unit: "GPUs tainted per second",
            goal_seconds: 10.0,
            met: (wanted.len() >= 1000).then_some(seconds < 10.0),
        })
    }

    async fn mass_drain(&self, n: usize, per_node: usize, concurrency: usize) -> anyhow::Result<Scenario> {
        let fleet = testkit::unique_name("bench-drain");
        let names = self.make_nodes(&fleet, n, concurrency).await?;
        let ns = self.namespace().await?;
        let pods: Api<Pod> = Api::namespaced(self.client.clone(), &ns);
        let made = Instant::now();
        futures::stream::iter((0..n * per_node).map(|i| {
            let pods = pods.clone();
            let node = &names[i / per_node];
            async move {
                let pod: Pod = serde_json::from_value(json!({
                    "metadata": { "name": format!("job-{i:06}") },
                    "spec": { "nodeName": node, "containers": [{ "name": "main", "image": "busybox" }] }
                }))?;
                pods.create(&PostParams::default(), &pod).await?;
                Ok::<_, anyhow::Error>(())
            }
        }))
        .buffer_unordered(concurrency)
        .try_collect::<Vec<()>>()
        .await?;
        println!("mass-drain: {} pods created in {:.1} s", n * per_node, made.elapsed().as_secs_f64());
        let topic = self.fresh_verdict_topic().await?;
        let mut remediator = self.start_remediator(&ns, &fleet, &topic, "cordon-drain", "mass-drain.log").await?;
        let mut stream = watcher(pods.clone(), watcher::Config::default()).boxed();
        let mut live: HashSet<String> = HashSet::new();
        loop {
            match stream.try_next().await? {
                Some(watcher::Event::InitApply(p)) => {
                    live.insert(p.metadata.name.unwrap_or_default());
                }
                Some(watcher::Event::InitDone) => break,
                _ => {}
            }
        }
        anyhow::ensure!(live.len() == n * per_node, "{} pods listed, {} made", live.len(), n * per_node);
        let first = self.produce(&topic, &names, RecommendedAction::Drain).await?;
        let timeout = Duration::from_secs(600);
        while !live.is_empty() {
            let event = tokio::time::timeout(timeout.saturating_sub(first.elapsed()), stream.try_next())
                .await
                .with_context(|| format!("{} pods still there after 10 minutes", live.len()))??;
            match event {
                Some(watcher::Event::Delete(p)) => {
                    live.remove(&p.metadata.name.unwrap_or_default());
                }
                // A restarted watch lists again: what it does not list is gone.
                Some(watcher::Event::Init) => live.clear(),
                Some(watcher::Event::InitApply(p) | watcher::Event::Apply(p)) => {
                    live.insert(p.metadata.name.unwrap_or_default());
                }
                _ => {}
            }
        }
        let seconds = first.elapsed().as_secs_f64();
        remediator.stop();
        let left = pods.list_metadata(&ListParams::default().limit(1)).await?.items.len();
        anyhow::ensure!(left == 0, "the watch saw every pod go but a list finds {left}");
        self.delete_nodes(&names, concurrency).await;
        let _ = Api::<Namespace>::all(self.client.clone()).delete(&ns, &DeleteParams::default()).await;
        let total = n * per_node;
        Ok(Scenario {
            scenario: "mass-drain",
            nodes: n,
            pods: total,
            seconds,
            per_sec: total as f64 / seconds,
            unit: "pods evicted per second",
            goal_seconds: 120.0,
            met: (total >= 10_000).then_some(seconds < 120.0),
        })
    }
}

/// The remediator process; killed when dropped.
struct Remediator {
    child: std::process::Child,
}

impl Remediator {
    fn stop(&mut self) {
        let _ = std::process::Command::new("kill").arg("-TERM").arg(self.child.id().to_string()).status();
        let deadline = Instant::now() + Duration::from_secs(20);
        while Instant::now() < deadline {
            if let Ok(Some(_)) = self.child.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for Remediator {
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}
