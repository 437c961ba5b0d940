//! `gpumedic demo`: the whole pipeline on this machine, with no GPU and no cluster.
//!
//! Brings the testbed up (Kafka, PostgreSQL, etcd and kube-apiserver on 127.0.0.1) unless
//! `compose/status` says it is up already. Creates a simulated GPU fleet as real Nodes and Pods in
//! the apiserver, and starts the four services: one collector per node with simulated GPUs, plus
//! the enricher, classifier and remediator; and the console, whose URL it prints (its fleet page
//! shows the story as it happens). One simulated GPU falls off the bus (it goes silent and the
//! driver's Xid 79 line names it), then the demo narrates what happens, live: detected,
//! classified, cordoned, drained, recorded; the other GPUs' heartbeats for longer than the quiet
//! period do not release the node; a simulated reboot (a new boot id, the GPU answering again, a
//! complete inventory) does, once, after the quiet period. Prints the incident history from
//! PostgreSQL and stops the services. `--keep` leaves them running until Ctrl-C.
//!
//! Every run has its own id (UTC date and time plus random digits), which names its Nodes,
//! namespace and consumer groups; at the end, on failure and on Ctrl-C or SIGTERM it stops the
//! services and removes them (the incident history stays in PostgreSQL, the logs under
//! `.testbed/logs/demo/<run id>/`). The services listen on their usual admin ports when free, and
//! on free ports the demo names otherwise.
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
use kube::api::{Api, DeleteParams, ListParams, PostParams};
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

/// The console's port on this machine, when free.
const CONSOLE_PORT: u16 = 9405;

/// The quiet period every rule is capped at (`GPUMEDIC_MAX_QUIET`), so recovery fits in a demo.
const QUIET: Duration = Duration::from_secs(20);

/// When the demo started, for the time shown with each step.
static STARTED: std::sync::OnceLock<std::time::Instant> = std::sync::OnceLock::new();

/// Announces a step, with the time since the demo started.
fn say(text: &str) {
    let secs = STARTED.get_or_init(std::time::Instant::now).elapsed().as_secs();
    println!("\n==> [{}:{:02}] {text}", secs / 60, secs % 60);
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

    /// The first service that has exited, with its status, if any did.
    fn exited(&mut self) -> Option<String> {
        self.0.iter_mut().find_map(|svc| match svc.child.try_wait() {
            Ok(Some(st)) => Some(format!("{} exited ({st}); its log: {}", svc.name, svc.log.display())),
            _ => None,
        })
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

/// The testbed servers the demo needs, as `compose/status` names them.
const NEEDED: [&str; 4] = ["postgres", "kafka", "etcd", "kube-apiserver"];

/// Runs `compose/up` unless `compose/status` says the servers the demo needs are up already, then
/// reads `compose/env`'s `export K=V` lines. `compose/up` shows its progress on the terminal.
fn testbed(repo: &Path) -> anyhow::Result<BTreeMap<String, String>> {
    let status =
        Command::new(repo.join("compose/status")).current_dir(repo).output().context("running compose/status")?;
    let text = String::from_utf8_lossy(&status.stdout);
    let up = |name: &str| {
        text.lines().any(|l| {
            let mut w = l.split_whitespace();
            w.next() == Some(name) && w.next() == Some("up")
        })
    };
    if NEEDED.iter().all(|n| up(n)) {
        tell("the testbed is up already (compose/status): Kafka, PostgreSQL, etcd and kube-apiserver answer");
    } else {
        tell("compose/up starts what is missing (the first run downloads and builds it: many minutes)");
        let up = Command::new(repo.join("compose/up"))
            .current_dir(repo)
            .stdout(Stdio::null())
            .stderr(Stdio::inherit())
            .status()
            .context("running compose/up")?;
        if !up.success() {
            bail!("compose/up failed ({up}); see its lines above");
        }
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

/// A service of the demo has exited while the demo waited on it.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
struct Stopped(String);

/// Polls `check` every 250 ms until it gives a value, or fails after `secs` naming `what`.
async fn wait_for<T>(
    secs: u64,
    what: &str,
    mut check: impl AsyncFnMut() -> anyhow::Result<Option<T>>,
) -> anyhow::Result<T> {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(secs);
    loop {
        // A transient error (a service still starting) counts as "not yet"; a stopped service
        // does not.
        match check().await {
            Ok(Some(v)) => return Ok(v),
            Err(e) if e.is::<Stopped>() => return Err(e),
            _ => {}
        }
        if tokio::time::Instant::now() >= deadline {
            bail!("timed out after {secs} s waiting for: {what}");
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}

/// A name for this run, unique across days and machines sharing a testbed: the UTC date and time
/// and six random hex digits (`261201-205512-3fa9c1`). DNS-safe, so it names Nodes and namespaces.
fn run_id() -> String {
    let random = uuid::Uuid::new_v4().simple().to_string();
    format!("{}-{}", chrono::Utc::now().format("%y%m%d-%H%M%S"), &random[..6])
}

/// A port for a service on 127.0.0.1: `preferred` when nothing listens there, else one the
/// system has free (and the demo says which port was taken). `used` holds the ports handed out.
fn pick_port(preferred: u16, what: &str, used: &mut Vec<u16>) -> anyhow::Result<u16> {
    let free = |p: u16| !used.contains(&p) && std::net::TcpListener::bind(("127.0.0.1", p)).is_ok();
    let port = if free(preferred) {
        preferred
    } else {
        let mut port = 0;
        for _ in 0..20 {
            let p = std::net::TcpListener::bind(("127.0.0.1", 0)).context("finding a free port")?.local_addr()?.port();
            if !used.contains(&p) {
                port = p;
                break;
            }
        }
        if port == 0 {
            bail!("no free port on 127.0.0.1 for the {what}");
        }
        tell(&format!(
            "port {preferred} on 127.0.0.1 is taken (another process listens there): the {what} uses {port}"
        ));
        port
    };
    used.push(port);
    Ok(port)
}

/// What the demo created, removed at its end, on failure and on Ctrl-C: its Nodes, its namespace
/// (with the pods, Leases, ConfigMaps and Events in it), its consumer groups and the collectors'
/// state folders. The pipeline's topics are the shared, fixed ones: they stay.
#[derive(Default)]
struct Created {
    nodes: Vec<String>,
    namespace: Option<String>,
    groups: Vec<String>,
    state_dirs: Vec<PathBuf>,
}

impl Created {
    /// Removes everything; returns what could not be removed (the rest is still tried).
    async fn clean_up(&mut self, client: &kube::Client, kafka: &gpumedic_runtime::kafka::KafkaSettings) -> Vec<String> {
        use k8s_openapi::api::coordination::v1::Lease;
        use k8s_openapi::api::core::v1::{ConfigMap, Event};
        let mut problems = Vec::new();
        let now = DeleteParams { grace_period_seconds: Some(0), ..DeleteParams::default() };
        let nodes: Api<Node> = Api::all(client.clone());
        // The remediator's Events about a Node go to the `default` namespace, as Kubernetes' own do.
        let node_events: Api<Event> = Api::namespaced(client.clone(), "default");
        for n in self.nodes.drain(..) {
            match nodes.delete(&n, &now).await {
                Ok(_) => {}
                Err(kube::Error::Api(e)) if e.code == 404 => {}
                Err(e) => problems.push(format!("deleting node {n}: {e}")),
            }
            let about = ListParams::default().fields(&format!("involvedObject.name={n}"));
            if let Err(e) = node_events.delete_collection(&now, &about).await {
                problems.push(format!("deleting the events about node {n}: {e}"));
            }
        }
        if let Some(ns) = self.namespace.take() {
            let all = ListParams::default();
            // The testbed runs no controller-manager to empty a deleted namespace: the demo
            // deletes what it and the services put there itself, then the namespace.
            let emptied = async {
                Api::<Pod>::namespaced(client.clone(), &ns).delete_collection(&now, &all).await?;
                Api::<Lease>::namespaced(client.clone(), &ns).delete_collection(&now, &all).await?;
                Api::<ConfigMap>::namespaced(client.clone(), &ns).delete_collection(&now, &all).await?;
                Api::<Event>::namespaced(client.clone(), &ns).delete_collection(&now, &all).await?;
                Ok::<_, kube::Error>(())
            };
            if let Err(e) = emptied.await {
                problems.push(format!("emptying namespace {ns}: {e}"));
            }
            if let Err(e) = delete_namespace(client, &ns).await {
                problems.push(format!("deleting namespace {ns}: {e}"));
            }
        }
        if !self.groups.is_empty() {
            let groups: Vec<String> = std::mem::take(&mut self.groups);
            if let Err(e) = delete_groups(kafka, &groups).await {
                problems.push(format!("deleting consumer groups {}: {e}", groups.join(", ")));
            }
        }
        for dir in self.state_dirs.drain(..) {
            if let Err(e) = std::fs::remove_dir_all(&dir)
                && e.kind() != std::io::ErrorKind::NotFound
            {
                problems.push(format!("removing {}: {e}", dir.display()));
            }
        }
        problems
    }
}

/// Deletes namespace `ns` and waits until it is gone. Where no namespace controller finishes the
/// deletion within 5 s (the testbed runs none), the demo, having emptied it, finalizes it itself.
async fn delete_namespace(client: &kube::Client, ns: &str) -> Result<(), kube::Error> {
    let api: Api<Namespace> = Api::all(client.clone());
    match api.delete(ns, &DeleteParams::default()).await {
        Ok(_) => {}
        Err(kube::Error::Api(e)) if e.code == 404 => return Ok(()),
        Err(e) => return Err(e),
    }
    for _ in 0..20 {
        if api.get_opt(ns).await?.is_none() {
            return Ok(());
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    let Some(mut namespace) = api.get_opt(ns).await? else { return Ok(()) };
    if let Some(spec) = namespace.spec.as_mut() {
        spec.finalizers = Some(Vec::new());
    }
    api.replace_subresource("finalize", ns, &PostParams::default(), &namespace).await?;
    Ok(())
}

/// Deletes the (stopped, so empty) consumer groups `groups`; one already gone is no error.
async fn delete_groups(kafka: &gpumedic_runtime::kafka::KafkaSettings, groups: &[String]) -> anyhow::Result<()> {
    use rdkafka::admin::{AdminClient, AdminOptions};
    use rdkafka::client::DefaultClientContext;
    use rdkafka::types::RDKafkaErrorCode;
    let admin: AdminClient<DefaultClientContext> =
        kafka.client_config_with("gpumedic-demo-cleanup", &[]).create().context("creating a Kafka admin client")?;
    let names: Vec<&str> = groups.iter().map(String::as_str).collect();
    let opts = AdminOptions::new().operation_timeout(Some(Duration::from_secs(10)));
    for r in admin.delete_groups(&names, &opts).await? {
        match r {
            Ok(_) | Err((_, RDKafkaErrorCode::GroupIdNotFound)) => {}
            Err((group, code)) => bail!("{group}: {code}"),
        }
    }
    Ok(())
}

/// Waits for Ctrl-C or SIGTERM; gives the signal's name.
async fn interrupted() -> &'static str {
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()).ok();
    let term = async {
        match term.as_mut() {
            Some(t) => {
                t.recv().await;
            }
            None => std::future::pending::<()>().await,
        }
    };
    tokio::select! {
        _ = tokio::signal::ctrl_c() => "Ctrl-C",
        () = term => "SIGTERM",
    }
}

/// Runs the demo; `Err` carries what failed, with the services' last log lines.
pub async fn run(args: DemoArgs) -> anyhow::Result<()> {
    STARTED.get_or_init(std::time::Instant::now);
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
    let kafka = gpumedic_runtime::kafka::KafkaSettings {
        bootstrap: bootstrap.clone(),
        options: vec![],
        schema_registry: None,
        topic_replication: None,
    };

    let run_id = run_id();
    let ns = format!("demo-{run_id}");
    let nodes: Vec<String> = (0..args.nodes).map(|i| format!("demo-{run_id}-gpu-{i}")).collect();
    let faulty = nodes[2.min(nodes.len() - 1)].clone();
    let logs = repo.join(".testbed/logs/demo").join(&run_id);
    std::fs::create_dir_all(&logs).with_context(|| format!("creating {}", logs.display()))?;
    tell(&format!("run {run_id}: its Nodes, namespace and consumer groups are named after it"));
    tell(&format!("the services' logs: {}", logs.display()));

    let me = std::env::current_exe()?;
    let mut created = Created::default();
    let mut services = Services::default();
    let story = async {
        create_fleet(&client, &run_id, &nodes, &ns, &mut created).await?;
        let out = Command::new(&me).args(["topics", "create", "--kafka-bootstrap", &bootstrap]).output()?;
        if !out.status.success() {
            bail!("creating the topics: {}", String::from_utf8_lossy(&out.stderr));
        }
        story(
            &env,
            &logs,
            &mut services,
            &mut created,
            &kafka,
            StoryContext {
                me: &me,
                bins: [&collector, &enricher, &classifier, &remediator, &console],
                nodes: &nodes,
                faulty: &faulty,
                ns: &ns,
                run_id: &run_id,
                rules: &repo.join("services/classifier/rules"),
                client: &client,
                db: &db,
            },
        )
        .await
    };
    let mut outcome = tokio::select! {
        r = story => r.map_err(|e| anyhow::anyhow!("{e:#}\n{}", services.tails())),
        signal = interrupted() => Err(anyhow::anyhow!("interrupted by {signal}")),
    };
    if outcome.is_ok() && args.keep {
        say(&format!("The services keep running (logs in {}); press Ctrl-C to stop them", logs.display()));
        interrupted().await;
    }
    say("Stopping the services");
    let failed = services.stop();
    if !failed.is_empty() && outcome.is_ok() {
        outcome = Err(anyhow::anyhow!("services did not stop cleanly: {}", failed.join("; ")));
    }
    say(&format!("Removing what run {run_id} created: its Nodes, namespace, consumer groups and state folders"));
    let problems = created.clean_up(&client, &kafka).await;
    if problems.is_empty() {
        tell(&format!("removed; the incident history stays in PostgreSQL and the logs in {}", logs.display()));
    } else {
        for p in &problems {
            tell(&format!("not removed: {p}"));
        }
        if outcome.is_ok() {
            outcome = Err(anyhow::anyhow!("the clean-up failed: {}", problems.join("; ")));
        }
    }
    outcome?;
    say("Done: a GPU fell off the bus and was detected, classified, quarantined, drained and recorded; \
         the node came back only after a reboot proved the repair.");
    Ok(())
}

/// Creates the simulated fleet: `nodes` as Nodes labelled with the run id, and two training pods
/// on each in namespace `ns`; records each in `created` as it goes.
async fn create_fleet(
    client: &kube::Client,
    run_id: &str,
    nodes: &[String],
    ns: &str,
    created: &mut Created,
) -> anyhow::Result<()> {
    say(&format!(
        "Creating a simulated fleet: {} GPU nodes (8 simulated H100s each) and their training pods",
        nodes.len()
    ));
    let node_api: Api<Node> = Api::all(client.clone());
    for n in nodes {
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
        created.nodes.push(n.clone());
    }
    let ns_api: Api<Namespace> = Api::all(client.clone());
    ns_api.create(&PostParams::default(), &serde_json::from_value(json!({ "metadata": { "name": ns } }))?).await?;
    created.namespace = Some(ns.to_owned());
    let pods: Api<Pod> = Api::namespaced(client.clone(), ns);
    for n in nodes {
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
    created: &mut Created,
    kafka: &gpumedic_runtime::kafka::KafkaSettings,
    cx: StoryContext<'_>,
) -> anyhow::Result<()> {
    let [collector, enricher, classifier, remediator, console] = cx.bins;
    let bootstrap = env["KAFKA_BOOTSTRAP"].clone();
    // The testbed's Jaeger, when compose/env names it: the services send their traces there and
    // the console's incident page links each verdict to its trace.
    let tracing = env.get("OTLP_ENDPOINT").zip(env.get("JAEGER_QUERY_URL"));
    let common = |port: u16| {
        let mut e = vec![
            ("GPUMEDIC_KAFKA_BOOTSTRAP", bootstrap.clone()),
            ("GPUMEDIC_SHUTDOWN_DEADLINE", "10s".to_owned()),
            ("GPUMEDIC_ADMIN_ADDR", format!("127.0.0.1:{port}")),
            ("KUBECONFIG", env["KUBECONFIG"].clone()),
        ];
        if let Some((otlp, _)) = tracing {
            e.push(("GPUMEDIC_OTLP_ENDPOINT", otlp.clone()));
        }
        e
    };
    say("Starting the four services and the console");
    // The usual ports when free; another demo, a test or any other process may hold them.
    let mut used = Vec::new();
    let mut ports = Vec::new();
    let mut injection = BTreeMap::new();
    for (i, n) in cx.nodes.iter().enumerate() {
        let i16 = u16::try_from(i)?;
        let port = pick_port(9410 + i16, &format!("collector of {n}"), &mut used)?;
        // Each collector's fault-injection endpoint: the fault and the reboot act on its
        // simulated GPUs.
        let synthetic = format!("127.0.0.1:{}", pick_port(9450 + i16, &format!("fault injection of {n}"), &mut used)?);
        injection.insert(n.clone(), synthetic.clone());
        // A state folder of this run: the GPU count of an earlier run's boot must not carry over.
        let state = logs.join(format!("state-{i}"));
        created.state_dirs.push(state.clone());
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
    // no record of this run is skipped (production groups start at the beginning). They are
    // deleted at the end.
    let group = |s: &str| format!("demo-{}-{s}", cx.run_id);
    for s in ["enricher", "classifier", "remediator"] {
        created.groups.push(group(s));
        kafka.start_group_at_end(&group(s), &gpumedic_schemas::topics::ALL).await?;
    }
    let enricher_port = pick_port(9402, "enricher", &mut used)?;
    let classifier_port = pick_port(9403, "classifier", &mut used)?;
    let remediator_port = pick_port(9404, "remediator", &mut used)?;
    let console_port = pick_port(CONSOLE_PORT, "console", &mut used)?;
    let console_url = format!("http://127.0.0.1:{console_port}");
    let mut e = common(enricher_port);
    e.extend([("GPUMEDIC_GROUP", group("enricher")), ("GPUMEDIC_CLUSTER_NAME", "demo".into())]);
    services.start("enricher", enricher, &e, logs)?;
    let mut e = common(classifier_port);
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
    let mut e = common(remediator_port);
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
    let mut e = common(console_port);
    e.extend([
        ("GPUMEDIC_DATABASE_URL", env["DATABASE_URL"].clone()),
        // This run's fleet only, and the remediator's status object in the run's namespace.
        ("GPUMEDIC_GPU_NODE_SELECTOR", format!("gpumedic.io/demo={}", cx.run_id)),
        ("GPUMEDIC_REMEDIATOR_NAMESPACE", cx.ns.to_owned()),
        // A demo on this machine: the pages open in a browser without a token.
        ("GPUMEDIC_API_AUTH", "none".into()),
    ]);
    if let Some((_, jaeger)) = tracing {
        e.push(("GPUMEDIC_TRACE_URL", format!("{}/trace/{{trace_id}}", jaeger.trim_end_matches('/'))));
    }
    services.start("console", console, &e, logs)?;
    let collector_ports: Vec<String> = ports.iter().map(u16::to_string).collect();
    tell(&format!(
        "admin ports (/healthz /readyz /metrics): collectors {}, enricher {enricher_port}, classifier {classifier_port}, \
         remediator {remediator_port}, console {console_port}",
        collector_ports.join(" ")
    ));
    ports.extend([enricher_port, classifier_port, remediator_port, console_port]);
    let http = reqwest::Client::builder().timeout(Duration::from_secs(2)).build()?;
    for port in &ports {
        let url = format!("http://127.0.0.1:{port}/readyz");
        wait_for(120, &format!("the service on port {port} to be ready"), async || {
            if let Some(exited) = services.exited() {
                return Err(Stopped(exited).into());
            }
            Ok(http.get(&url).send().await?.status().is_success().then_some(()))
        })
        .await?;
    }
    tell("all services report ready; each simulated GPU sends a heartbeat every 2 s");
    say(&format!("Open the console to watch the story on the fleet page: {console_url}/"));

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
        let f: serde_json::Value = http.get(format!("{console_url}/api/v1/fleet")).send().await?.json().await?;
        Ok((f["gpus"]["out_of_service"] == 8).then_some(f))
    })
    .await?;
    tell(&format!(
        "the console shows it: {:.1}% of the fleet's {total} GPUs in service, {faulty} quarantined ({console_url}/nodes/{faulty})",
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
