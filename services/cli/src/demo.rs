//! `gpumedic demo`: the whole pipeline on this machine, with no GPU and no cluster.
//!
//! Brings the testbed up (Kafka, PostgreSQL, etcd and kube-apiserver on 127.0.0.1) unless it is
//! up already. Creates a simulated GPU fleet as real Nodes and Pods in the apiserver, and starts the
//! four services: one collector per node with simulated GPUs, plus the enricher, classifier and
//! remediator; and the console, whose URL it prints (its fleet page shows the story as it
//! happens). One simulated GPU falls off the bus (it goes silent and the driver's Xid 79 line
//! names it), then the demo narrates what happens, live: detected, classified, cordoned, drained,
//! recorded; the other GPUs' heartbeats for longer than the quiet period do not release the node;
//! a simulated reboot (a new boot id, the GPU answering again, a complete inventory) does, once,
//! after the quiet period. Prints the incident history from PostgreSQL and stops the services.
//! `--keep` leaves them running until Ctrl-C.
//!
//! The rules are the default ones, unchanged; the classifier runs with `GPUMEDIC_MAX_QUIET=20s`,
//! which caps every rule's quiet period so that the recovery happens while you watch.
//!
//! The services are the binaries next to this one (`cargo build --workspace --bins` builds them
//! all); the testbed scripts are found from the current directory or from this binary's path.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use anyhow::{Context as _, bail};
use clap::Args;
use k8s_openapi::api::core::v1::{Namespace, Node, Pod};
use kube::api::{Api, ListParams, PostParams};
use serde_json::json;

/// Flags of `gpumedic demo`.
#[derive(Debug, Args)]
pub struct DemoArgs {
    /// Leave the services running after the story (stop them with Ctrl-C).
    #[arg(long)]
    keep: bool,
    /// Simulated GPU nodes in the fleet.
    #[arg(long, default_value_t = 4, value_parser = clap::value_parser!(u16).range(2..=32))]
    nodes: u16,
    /// The repository checkout (holding compose/ and services/classifier/rules/); found from the
    /// current directory or this binary's path when not given.
    #[arg(long)]
    repo: Option<PathBuf>,
}

/// The console's port on this machine.
const CONSOLE_PORT: u16 = 9405;
/// Where the console is reached.
const CONSOLE_URL: &str = "http://127.0.0.1:9405";

/// The quiet period every rule is capped at (`GPUMEDIC_MAX_QUIET`), so recovery fits in a demo.
const QUIET: Duration = Duration::from_secs(20);

fn say(text: &str) {
    println!("\n==> {text}");
}

fn tell(text: &str) {
    println!("    {text}");
}

/// A service process started by the demo, its output in a log file.
struct Service {
    name: String,
    child: Child,
    log: PathBuf,
}

/// The running services; stopped (SIGTERM, then waited for) when dropped.
#[derive(Default)]
struct Services(Vec<Service>);

impl Services {
    fn start(&mut self, name: &str, binary: &Path, env: &[(&str, String)], logs: &Path) -> anyhow::Result<()> {
        let log = logs.join(format!("{name}.log"));
        let out = std::fs::File::create(&log).with_context(|| format!("creating {}", log.display()))?;
        let child = Command::new(binary)
            .envs(env.iter().map(|(k, v)| (*k, v.as_str())))
            .stdout(out.try_clone()?)
            .stderr(out)
            .stdin(Stdio::null())
            .spawn()
            .with_context(|| format!("starting {}", binary.display()))?;
        self.0.push(Service { name: name.to_owned(), child, log });
        Ok(())
    }

    /// The last lines of every service's log, for a failure report.
    fn tails(&self) -> String {
        let mut s = String::new();
        for svc in &self.0 {
            let text = std::fs::read_to_string(&svc.log).unwrap_or_default();
            let lines: Vec<&str> = text.lines().collect();
            s.push_str(&format!("--- last lines of {} ---\n", svc.name));
            for l in &lines[lines.len().saturating_sub(8)..] {
                s.push_str(l);
                s.push('\n');
            }
        }
        s
    }

    /// SIGTERM to each, then waits; returns the services that did not exit 0.
    fn stop(&mut self) -> Vec<String> {
        for svc in &self.0 {
            let _ = Command::new("kill").args(["-TERM", &svc.child.id().to_string()]).status();
        }
        let mut failed = Vec::new();
        for mut svc in self.0.drain(..) {
            match svc.child.wait() {
                Ok(st) if st.success() => {}
                Ok(st) => failed.push(format!("{} exited with {st}", svc.name)),
                Err(e) => failed.push(format!("{}: {e}", svc.name)),
            }
        }
        failed
    }
}

impl Drop for Services {
    fn drop(&mut self) {
        let _ = self.stop();
    }
}

/// Finds the checkout: `--repo`, else the current directory or one above it, else the binary's
/// `target/<profile>/..` ancestors.
fn find_repo(given: Option<&Path>) -> anyhow::Result<PathBuf> {
    let is_repo = |p: &Path| p.join("compose/up").is_file() && p.join("services/classifier/rules").is_dir();
    if let Some(p) = given {
        return if is_repo(p) { Ok(p.to_owned()) } else { bail!("{} is not a gpumedic checkout", p.display()) };
    }
    let cwd = std::env::current_dir()?;
    let exe = std::env::current_exe()?;
    cwd.ancestors()
        .chain(exe.ancestors())
        .find(|p| is_repo(p))
        .map(Path::to_owned)
        .context("cannot find the gpumedic checkout (compose/up): run this from the repository or pass --repo")
}

/// Runs `compose/up` (idempotent) and reads `compose/env`'s `export K=V` lines.
fn testbed(repo: &Path) -> anyhow::Result<BTreeMap<String, String>> {
    let up = Command::new(repo.join("compose/up"))
        .current_dir(repo)
        .stdout(Stdio::null())
        .output()
        .context("running compose/up")?;
    for line in String::from_utf8_lossy(&up.stderr).lines() {
        tell(line);
    }
    if !up.status.success() {
        bail!("compose/up failed ({}); see the lines above", up.status);
    }
    let env = Command::new(repo.join("compose/env")).current_dir(repo).output().context("running compose/env")?;
    if !env.status.success() {
        bail!("compose/env failed: {}", String::from_utf8_lossy(&env.stderr));
    }
    let mut vars = BTreeMap::new();
    for line in String::from_utf8_lossy(&env.stdout).lines() {
        if let Some((k, v)) = line.strip_prefix("export ").and_then(|l| l.split_once('=')) {
            let v = v.trim_matches('"');
            let v =
                if k == "PATH" { v.replace("$PATH", &std::env::var("PATH").unwrap_or_default()) } else { v.to_owned() };
            vars.insert(k.to_owned(), v);
        }
    }
    for k in ["KAFKA_BOOTSTRAP", "DATABASE_URL", "KUBECONFIG"] {
        if !vars.contains_key(k) {
            bail!("compose/env did not give {k}");
        }
    }
    Ok(vars)
}

/// Polls `check` every 250 ms until it gives a value, or fails after `secs` naming `what`.
async fn wait_for<T>(
    secs: u64,
    what: &str,
    mut check: impl AsyncFnMut() -> anyhow::Result<Option<T>>,
) -> anyhow::Result<T> {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(secs);
    loop {
        // A transient error (a service still starting) counts as "not yet".
        if let Ok(Some(v)) = check().await {
            return Ok(v);
        }
        if tokio::time::Instant::now() >= deadline {
            bail!("timed out after {secs} s waiting for: {what}");
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}

/// Runs the demo; `Err` carries what failed (the caller adds the services' last log lines).
pub async fn run(args: DemoArgs) -> anyhow::Result<()> {
    let repo = find_repo(args.repo.as_deref())?;
    say("Starting the testbed (Kafka, PostgreSQL, etcd and kube-apiserver on 127.0.0.1)");
    let env = testbed(&repo)?;
    let bin_dir = std::env::current_exe()?.parent().context("binary folder")?.to_owned();
    let binary = |name: &str| -> anyhow::Result<PathBuf> {
        let p = bin_dir.join(name);
        if p.is_file() {
            Ok(p)
        } else {
            bail!("{} is missing: build the services with `cargo build --workspace --bins`", p.display())
        }
    };
    let (collector, enricher, classifier, remediator, console) = (
        binary("gpumedic-collector")?,
        binary("gpumedic-enricher")?,
        binary("gpumedic-classifier")?,
        binary("gpumedic-remediator")?,
        binary("gpumedic-console")?,
    );
    let bootstrap = env["KAFKA_BOOTSTRAP"].clone();
    let database_url = env["DATABASE_URL"].clone();
    let kubeconfig = env["KUBECONFIG"].clone();
    let kube_config = kube::Config::from_custom_kubeconfig(
        kube::config::Kubeconfig::read_from(&kubeconfig).context("reading the testbed kubeconfig")?,
        &Default::default(),
    )
    .await?;
    let client = kube::Client::try_from(kube_config)?;
    let db = sqlx::postgres::PgPoolOptions::new()
        .max_connections(2)
        .connect(&database_url)
        .await
        .context("connecting to PostgreSQL")?;

    let run_id = chrono::Utc::now().format("%H%M%S").to_string();
    let ns = format!("demo-{run_id}");
    let nodes: Vec<String> = (0..args.nodes).map(|i| format!("demo-{run_id}-gpu-{i}")).collect();
    let faulty = nodes[2.min(nodes.len() - 1)].clone();

    say(&format!(
        "Creating a simulated fleet: {} GPU nodes (8 simulated H100s each) and their training pods",
        nodes.len()
    ));
    let node_api: Api<Node> = Api::all(client.clone());
    for n in &nodes {
        let node: Node = serde_json::from_value(json!({
            "metadata": { "name": n, "labels": {
                "nvidia.com/gpu.present": "true",
                "nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3",
                // GPU feature discovery's count: the console's GPU capacity (the demo's Nodes
                // have no kubelet to report nvidia.com/gpu).
                "nvidia.com/gpu.count": "8",
                "node.kubernetes.io/instance-type": "p5.48xlarge",
                "topology.kubernetes.io/zone": "demo-zone-a",
                "gpumedic.io/demo": run_id,
            }},
        }))?;
        node_api.create(&PostParams::default(), &node).await.with_context(|| format!("creating node {n}"))?;
    }
    let ns_api: Api<Namespace> = Api::all(client.clone());
    ns_api.create(&PostParams::default(), &serde_json::from_value(json!({ "metadata": { "name": ns } }))?).await?;
    let pods: Api<Pod> = Api::namespaced(client.clone(), &ns);
    for n in &nodes {
        for j in 0..2 {
            let pod: Pod = serde_json::from_value(json!({
                "metadata": { "name": format!("trainer-{}-{j}", n.rsplit('-').next().unwrap_or("x")) },
                "spec": { "nodeName": n, "containers": [{ "name": "train", "image": "nvcr.io/nvidia/pytorch:25.01-py3",
                    "resources": { "limits": { "nvidia.com/gpu": "4" } } }] },
            }))?;
            pods.create(&PostParams::default(), &pod).await?;
        }
    }
    tell(&format!("nodes: {}", nodes.join(" ")));
    tell(&format!("pods: {} training pods in namespace {ns}", pods.list(&ListParams::default()).await?.items.len()));

    // The default rules as shipped; the classifier's --max-quiet shortens their quiet periods.
    let rules = repo.join("services/classifier/rules");

    let me = std::env::current_exe()?;
    let created = Command::new(&me).args(["topics", "create", "--kafka-bootstrap", &bootstrap]).output()?;
    if !created.status.success() {
        bail!("creating the topics: {}", String::from_utf8_lossy(&created.stderr));
    }

    let logs = repo.join(".testbed/logs/demo");
    std::fs::create_dir_all(&logs)?;
    let mut services = Services::default();
    let result = story(
        &env,
        &logs,
        &mut services,
        StoryContext {
            me: &me,
            bins: [&collector, &enricher, &classifier, &remediator, &console],
            nodes: &nodes,
            faulty: &faulty,
            ns: &ns,
            run_id: &run_id,
            rules: &rules,
            client: &client,
            db: &db,
        },
    )
    .await;
    if let Err(e) = result {
        let tails = services.tails();
        drop(services);
        bail!("{e:#}\n{tails}");
    }
    if args.keep {
        say(&format!("The services keep running (logs in {}); press Ctrl-C to stop them", logs.display()));
        tokio::signal::ctrl_c().await?;
    }
    say("Stopping the services");
    let failed = services.stop();
    if !failed.is_empty() {
        bail!("services did not stop cleanly: {}", failed.join("; "));
    }
    say("Done: a GPU fell off the bus and was detected, classified, quarantined, drained and recorded; \
         the node came back only after a reboot proved the repair.");
    Ok(())
}

struct StoryContext<'a> {
    me: &'a Path,
    bins: [&'a Path; 5],
    nodes: &'a [String],
    faulty: &'a str,
    ns: &'a str,
    run_id: &'a str,
    rules: &'a Path,
    client: &'a kube::Client,
    db: &'a sqlx::PgPool,
}

async fn story(
    env: &BTreeMap<String, String>,
    logs: &Path,
    services: &mut Services,
    cx: StoryContext<'_>,
) -> anyhow::Result<()> {
    let [collector, enricher, classifier, remediator, console] = cx.bins;
    let bootstrap = env["KAFKA_BOOTSTRAP"].clone();
    let common = |port: u16| {
        vec![
            ("GPUMEDIC_KAFKA_BOOTSTRAP", bootstrap.clone()),
            ("GPUMEDIC_SHUTDOWN_DEADLINE", "10s".to_owned()),
            ("GPUMEDIC_ADMIN_ADDR", format!("127.0.0.1:{port}")),
            ("KUBECONFIG", env["KUBECONFIG"].clone()),
        ]
    };
    say("Starting the four services and the console");
    let mut ports = Vec::new();
    let mut injection = BTreeMap::new();
    for (i, n) in cx.nodes.iter().enumerate() {
        let port = 9410 + u16::try_from(i)?;
        // Each collector's fault-injection endpoint: the fault and the reboot act on its
        // simulated GPUs.
        let synthetic = format!("127.0.0.1:{}", 9450 + u16::try_from(i)?);
        injection.insert(n.clone(), synthetic.clone());
        let state = logs.join(format!("state-{i}"));
        // A fresh state folder: the GPU count of an earlier run's boot must not carry over.
        let _ = std::fs::remove_dir_all(&state);
        let mut e = common(port);
        e.extend([
            ("GPUMEDIC_NODE_NAME", n.clone()),
            ("GPUMEDIC_GPU_BACKEND", "simulated".into()),
            ("GPUMEDIC_SAMPLE_INTERVAL", "1s".into()),
            ("GPUMEDIC_HEARTBEAT_INTERVAL", "2s".into()),
            ("GPUMEDIC_KMSG_PATH", "off".into()),
            ("GPUMEDIC_SYNTHETIC_ADDR", synthetic),
            ("GPUMEDIC_STATE_DIR", state.display().to_string()),
        ]);
        services.start(&format!("collector-{i}"), collector, &e, logs)?;
        ports.push(port);
    }
    // Each run uses new consumer groups, committed at the end of the topics before the services
    // start: this run's story does not queue behind every record earlier runs and tests left, and
    // no record of this run is skipped (production groups start at the beginning).
    let group = |s: &str| format!("demo-{}-{s}", cx.run_id);
    let kafka = gpumedic_runtime::kafka::KafkaSettings {
        bootstrap: bootstrap.clone(),
        options: vec![],
        schema_registry: None,
        topic_replication: None,
    };
    for s in ["enricher", "classifier", "remediator"] {
        kafka.start_group_at_end(&group(s), &gpumedic_schemas::topics::ALL).await?;
    }
    let mut e = common(9402);
    e.extend([("GPUMEDIC_GROUP", group("enricher")), ("GPUMEDIC_CLUSTER_NAME", "demo".into())]);
    services.start("enricher", enricher, &e, logs)?;
    let mut e = common(9403);
    e.extend([
        ("GPUMEDIC_GROUP", group("classifier")),
        ("GPUMEDIC_DATABASE_URL", env["DATABASE_URL"].clone()),
        ("GPUMEDIC_RULES_DIR", cx.rules.display().to_string()),
        // The injected Xid 79 is marked synthetic; production classifiers ignore such events.
        ("GPUMEDIC_ALLOW_SYNTHETIC", "true".into()),
        ("GPUMEDIC_TICK", "500ms".into()),
        // Every rule's quiet period capped at 20 s (15 min for a lost GPU in production).
        ("GPUMEDIC_MAX_QUIET", format!("{}s", QUIET.as_secs())),
        // A demo on this machine: `gpumedic incidents` reads the history without a token.
        ("GPUMEDIC_API_AUTH", "none".into()),
    ]);
    services.start("classifier", classifier, &e, logs)?;
    let mut e = common(9404);
    e.extend([
        ("GPUMEDIC_GROUP", group("remediator")),
        ("GPUMEDIC_MODE", "cordon-drain".into()),
        ("GPUMEDIC_GPU_NODE_SELECTOR", format!("gpumedic.io/demo={}", cx.run_id)),
        ("GPUMEDIC_BREAKER_MAX_SHARE", "0.5".into()),
        ("GPUMEDIC_DRAIN_GRACE_SECONDS", "0".into()),
        ("GPUMEDIC_DRAIN_DEADLINE", "60s".into()),
        // Leader election needs a namespace for its Lease and status object.
        ("GPUMEDIC_LEASE_NAMESPACE", cx.ns.to_owned()),
        // The resync against the open incidents, as deployed (every 2 minutes there).
        ("GPUMEDIC_INCIDENT_DATABASE_URL", env["DATABASE_URL"].clone()),
        ("GPUMEDIC_RESYNC_INTERVAL", "10s".into()),
    ]);
    services.start("remediator", remediator, &e, logs)?;
    let mut e = common(CONSOLE_PORT);
    e.extend([
        ("GPUMEDIC_DATABASE_URL", env["DATABASE_URL"].clone()),
        // This run's fleet only, and the remediator's status object in the run's namespace.
        ("GPUMEDIC_GPU_NODE_SELECTOR", format!("gpumedic.io/demo={}", cx.run_id)),
        ("GPUMEDIC_REMEDIATOR_NAMESPACE", cx.ns.to_owned()),
        // A demo on this machine: the pages open in a browser without a token.
        ("GPUMEDIC_API_AUTH", "none".into()),
    ]);
    services.start("console", console, &e, logs)?;
    ports.extend([9402, 9403, 9404, CONSOLE_PORT]);
    tell(&format!(
        "collectors on {}-{}, enricher 9402, classifier 9403, remediator 9404, console {CONSOLE_PORT} (/healthz /readyz /metrics)",
        ports[0],
        ports[cx.nodes.len() - 1]
    ));
    let http = reqwest::Client::builder().timeout(Duration::from_secs(2)).build()?;
    for port in &ports {
        let url = format!("http://127.0.0.1:{port}/readyz");
        wait_for(120, &format!("the service on port {port} to be ready"), async || {
            Ok(http.get(&url).send().await?.status().is_success().then_some(()))
        })
        .await?;
    }
    tell("all services report ready; each simulated GPU sends a heartbeat every 2 s");
    say(&format!("Open the console to watch the story on the fleet page: {CONSOLE_URL}/"));

    let faulty = cx.faulty;
    let collector_addr = injection.get(faulty).context("the faulty node's collector")?.clone();
    let inject = |args: &[&str]| -> anyhow::Result<String> {
        let out = Command::new(cx.me).args(["inject", "--collector", &collector_addr]).args(args).output()?;
        if !out.status.success() {
            bail!("gpumedic inject {} failed: {}", args.join(" "), String::from_utf8_lossy(&out.stderr));
        }
        Ok(String::from_utf8_lossy(&out.stdout).trim().to_owned())
    };
    let db = cx.db;
    // The collector's inventory names every GPU; the fault below is logged by PCI bus id only.
    wait_for(60, &format!("the GPU inventory of {faulty}"), async || {
        Ok(last_inventory(db, faulty).await?.filter(|(present, _)| *present == 8))
    })
    .await?;
    tell(&format!(
        "{faulty}'s collector published its GPU inventory: 8 of 8 GPUs, each by index, UUID, PCI bus id and serial"
    ));

    say(&format!("Injecting a fault: GPU 3 of {faulty} falls off the bus"));
    let event_id: uuid::Uuid =
        inject(&["--fall-off-bus", "--gpu", "3"])?.parse().context("inject printed no event id")?;
    tell("the simulated GPU stops answering: no readings, no heartbeats");
    tell(&format!(
        "the driver's Xid 79 line names it by PCI bus id only; published as raw event {event_id} (marked synthetic, like every injected fault)"
    ));

    let (uuid, pci): (Option<String>, Option<String>) =
        wait_for(60, "the event to be enriched, classified and recorded", async || {
            Ok(sqlx::query_as("SELECT gpu_uuid, pci_bus_id FROM health_events WHERE event_id = $1")
                .bind(event_id)
                .fetch_optional(db)
                .await?)
        })
        .await?;
    let uuid = uuid.unwrap_or_else(|| "no UUID".into());
    tell(&format!(
        "detected: the collector named the GPU from its inventory ({} is {uuid}); the classifier recorded the event",
        pci.unwrap_or_default()
    ));
    let (present, expected) = wait_for(60, "the inventory without GPU 3", async || {
        Ok(last_inventory(db, faulty).await?.filter(|(present, _)| *present < 8))
    })
    .await?;
    tell(&format!(
        "the inventory changed: {present} of {} GPUs answer, and NVML reports the GPU lost",
        expected.map_or_else(|| "?".to_owned(), |e| e.to_string())
    ));

    let verdict: String = wait_for(60, "a verdict", async || {
        Ok(sqlx::query_scalar(
            "SELECT severity || ', recommended action ' || action || ' (rule ' || rule_id || ')'
               FROM verdicts WHERE node = $1 AND NOT recovery ORDER BY issued_at LIMIT 1",
        )
        .bind(faulty)
        .fetch_optional(db)
        .await?)
    })
    .await?;
    tell(&format!("classified: {verdict}"));

    let nodes: Api<Node> = Api::all(cx.client.clone());
    let node = wait_for(60, &format!("{faulty} to be cordoned"), async || {
        let n = nodes.get(faulty).await?;
        Ok(n.spec.as_ref().and_then(|s| s.unschedulable).unwrap_or(false).then_some(n))
    })
    .await?;
    let taint = node
        .spec
        .as_ref()
        .and_then(|s| s.taints.as_ref())
        .and_then(|t| t.iter().find(|t| t.key.starts_with("gpumedic.io/")))
        .map(|t| format!("{}={}:{}", t.key, t.value.clone().unwrap_or_default(), t.effect))
        .unwrap_or_else(|| "none".into());
    tell(&format!("cordoned: {faulty} is unschedulable; taint {taint}"));
    let total = cx.nodes.len() * 8;
    let fleet: serde_json::Value = wait_for(30, "the console to show the node out of service", async || {
        let f: serde_json::Value = http.get(format!("{CONSOLE_URL}/api/v1/fleet")).send().await?.json().await?;
        Ok((f["gpus"]["out_of_service"] == 8).then_some(f))
    })
    .await?;
    tell(&format!(
        "the console shows it: {:.1}% of the fleet's {total} GPUs in service, {faulty} quarantined ({CONSOLE_URL}/nodes/{faulty})",
        fleet["gpus"]["in_service_ratio"].as_f64().unwrap_or_default() * 100.0
    ));
    if let Some((status, reason)) = condition(&node, "GpuUnhealthy") {
        tell(&format!("condition: GpuUnhealthy={status} reason {reason}"));
    }

    let pods: Api<Pod> = Api::namespaced(cx.client.clone(), cx.ns);
    let on_node = ListParams::default().fields(&format!("spec.nodeName={faulty}"));
    wait_for(60, &format!("the pods on {faulty} to be evicted"), async || {
        Ok(pods.list(&on_node).await?.items.is_empty().then_some(()))
    })
    .await?;
    let remaining = pods.list(&ListParams::default()).await?.items.len();
    tell(&format!(
        "drained: the training pods on {faulty} were evicted through the Eviction API; {remaining} pods remain on the healthy nodes"
    ));

    wait_for(60, "the remediator's action to be recorded", async || {
        Ok(sqlx::query_scalar::<_, i32>(
            "SELECT 1 FROM actions a JOIN verdicts v USING (verdict_id) WHERE v.node = $1 AND a.status = 'applied' LIMIT 1",
        )
        .bind(faulty)
        .fetch_optional(db)
        .await?)
    })
    .await?;
    tell("recorded: the incident, its verdict and the remediator's action are in PostgreSQL");

    let wait = QUIET + Duration::from_secs(10);
    say(&format!(
        "Waiting {} s: the other 7 GPUs keep sending heartbeats, for longer than the {} s quiet period",
        wait.as_secs(),
        QUIET.as_secs()
    ));
    tokio::time::sleep(wait).await;
    let n = nodes.get(faulty).await?;
    if !n.spec.as_ref().and_then(|s| s.unschedulable).unwrap_or(false) {
        bail!("{faulty} was released without proof of repair: only the GPUs that did not fail sent heartbeats");
    }
    let open: i64 = sqlx::query_scalar("SELECT count(*) FROM incidents WHERE node = $1 AND resolved_at IS NULL")
        .bind(faulty)
        .fetch_one(db)
        .await?;
    tell(&format!(
        "still cordoned, {open} incident open: heartbeats from GPUs that did not fail prove nothing about GPU 3, and a lost GPU needs a reboot"
    ));

    say(&format!("Rebooting {faulty} (simulated): the node comes back with a new boot id"));
    let rebooted_at = tokio::time::Instant::now();
    let boot_id = inject(&["--reboot"])?;
    tell(&format!("new boot id {boot_id}; every GPU answers again with fresh counters"));
    wait_for(60, "GPU 3's heartbeat in the new boot", async || {
        Ok(sqlx::query_scalar::<_, i32>(
            "SELECT 1 FROM health_events WHERE node = $1 AND kind = 'monitor_health' AND healthy
                AND gpu_uuid = $2 AND record->'event'->>'boot_id' = $3 LIMIT 1",
        )
        .bind(faulty)
        .bind(&uuid)
        .bind(&boot_id)
        .fetch_optional(db)
        .await?)
    })
    .await?;
    let (present, _) = last_inventory(db, faulty).await?.unwrap_or_default();
    tell(&format!(
        "proof of repair: a new boot id, the inventory complete again ({present} of 8), and GPU 3's own heartbeat"
    ));

    say(&format!(
        "Recovery: that proof must stand for the quiet period ({} s here) before the node returns",
        QUIET.as_secs()
    ));
    wait_for(90, &format!("{faulty} to be returned to service"), async || {
        let n = nodes.get(faulty).await?;
        let schedulable = !n.spec.as_ref().and_then(|s| s.unschedulable).unwrap_or(false);
        let cleared = condition(&n, "GpuUnhealthy").is_some_and(|(s, _)| s == "False");
        Ok((schedulable && cleared).then_some(()))
    })
    .await?;
    tell(&format!(
        "recovered {} s after the reboot: {faulty} is schedulable again, gpumedic's taint is gone, GpuUnhealthy=False",
        rebooted_at.elapsed().as_secs()
    ));
    let (reason, recoveries): (String, i64) = wait_for(30, "the incident to be resolved", async || {
        Ok(sqlx::query_as(
            "SELECT v.reason, (SELECT count(*) FROM verdicts w WHERE w.incident_id = i.incident_id AND w.recovery)
               FROM verdicts v JOIN incidents i USING (incident_id)
              WHERE i.node = $1 AND i.resolved_at IS NOT NULL AND v.recovery LIMIT 1",
        )
        .bind(faulty)
        .fetch_optional(db)
        .await?)
    })
    .await?;
    if recoveries != 1 {
        bail!("{faulty} was released {recoveries} times for one incident");
    }
    tell(&format!("released once (one recovery verdict): {reason}"));

    say("Incident history for this run (PostgreSQL)");
    print_history(db, &format!("demo-{}-%", cx.run_id)).await
}

/// The GPUs present and expected in the latest inventory of `node` the classifier recorded.
async fn last_inventory(db: &sqlx::PgPool, node: &str) -> anyhow::Result<Option<(i32, Option<i32>)>> {
    Ok(sqlx::query_as(
        "SELECT json_array_length(record->'event'->'detail'->'gpu_inventory'->'gpus'),
                (record->'event'->'detail'->'gpu_inventory'->>'expected')::int
           FROM health_events WHERE node = $1 AND kind = 'gpu_inventory' ORDER BY observed_at DESC LIMIT 1",
    )
    .bind(node)
    .fetch_optional(db)
    .await?)
}

fn condition(node: &Node, type_: &str) -> Option<(String, String)> {
    node.status
        .as_ref()?
        .conditions
        .as_ref()?
        .iter()
        .find(|c| c.type_ == type_)
        .map(|c| (c.status.clone(), c.reason.clone().unwrap_or_default()))
}

/// Node, rule, severity, opened, resolved, seconds out of service, actions.
type HistoryRow = (String, String, String, String, Option<String>, Option<f64>, Option<String>);

async fn print_history(db: &sqlx::PgPool, nodes_like: &str) -> anyhow::Result<()> {
    let rows: Vec<HistoryRow> = sqlx::query_as(
        "SELECT i.node, i.rule_id, i.severity,
                to_char(i.opened_at, 'HH24:MI:SS'),
                to_char(i.resolved_at, 'HH24:MI:SS'),
                round(extract(epoch FROM i.resolved_at - i.opened_at)::numeric, 1)::float8,
                (SELECT string_agg(DISTINCT a.action || ':' || a.status, ', ')
                   FROM actions a JOIN verdicts v USING (verdict_id) WHERE v.incident_id = i.incident_id)
           FROM incidents i WHERE i.node LIKE $1 ORDER BY i.opened_at",
    )
    .bind(nodes_like)
    .fetch_all(db)
    .await?;
    let header = ["NODE", "RULE", "SEVERITY", "OPENED", "RESOLVED", "SECONDS OUT", "ACTIONS"];
    let table: Vec<Vec<String>> = rows
        .into_iter()
        .map(|(node, rule, severity, opened, resolved, secs, actions)| {
            vec![
                node,
                rule,
                severity,
                opened,
                resolved.unwrap_or_else(|| "-".into()),
                secs.map_or_else(|| "-".into(), |s| format!("{s:.1}")),
                actions.unwrap_or_else(|| "-".into()),
            ]
        })
        .collect();
    for line in crate::incidents::table(&header, &table).lines() {
        tell(line);
    }
    Ok(())
}
