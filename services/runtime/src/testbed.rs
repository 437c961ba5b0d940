//! Access to the testbed's real servers for integration tests, the demo and load tests.
//!
//! Each accessor checks that its server answers and otherwise returns an error that says how to
//! start it, so a test without its server fails loudly instead of passing by skipping.

use std::time::Duration;

/// The command that starts the testbed, quoted in every error.
pub const START_HINT: &str = "start the testbed with `compose/up` (or `just testbed-up`) from the repository root";

/// A testbed server is not reachable.
#[derive(Debug, thiserror::Error)]
#[error("{server} is not reachable at {address}: {detail}; {hint}", hint = START_HINT)]
pub struct Unreachable {
    /// Which server.
    pub server: &'static str,
    /// Where it was looked for.
    pub address: String,
    /// What failed.
    pub detail: String,
}

/// Kafka's bootstrap address: `KAFKA_BOOTSTRAP`, or the testbed's default.
pub fn kafka_bootstrap() -> String {
    std::env::var("KAFKA_BOOTSTRAP").unwrap_or_else(|_| "127.0.0.1:19092".to_owned())
}

/// PostgreSQL's URL: `DATABASE_URL`, or the testbed's default.
pub fn database_url() -> String {
    std::env::var("DATABASE_URL").unwrap_or_else(|_| "postgres://gpumedic:gpumedic@127.0.0.1:15432/gpumedic".to_owned())
}

/// The kubeconfig the testbed writes: `KUBECONFIG`, or `.testbed/kubeconfig` at the repository root.
pub fn kubeconfig_path() -> std::path::PathBuf {
    match std::env::var_os("KUBECONFIG") {
        Some(p) => p.into(),
        None => std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../.testbed/kubeconfig"),
    }
}

/// A name unique to this call, for topics, groups, databases and Kubernetes objects, so tests run
/// in parallel without seeing each other: lowercase, starting with `prefix`.
pub fn unique_name(prefix: &str) -> String {
    format!("{prefix}-{}", &uuid::Uuid::new_v4().simple().to_string()[..12])
}

/// A new consumer group named after `prefix`, committed at the current end of `topics`, so a
/// service started in it reads every record written from now on and none of the backlog that
/// earlier tests and load runs left on the shared topics.
pub async fn group_at_end(prefix: &str, topics: &[&str]) -> Result<String, crate::kafka::KafkaError> {
    let group = unique_name(prefix);
    crate::kafka::KafkaSettings {
        bootstrap: kafka_bootstrap(),
        options: vec![],
        schema_registry: None,
        topic_replication: None,
    }
    .start_group_at_end(&group, topics)
    .await?;
    Ok(group)
}

/// Waits until consumer group `group` is stable with `members` members, each holding at least one
/// partition, or fails after `timeout` naming the group's last state. A test that starts several
/// replicas waits here before it writes, so no record it writes is caught in a rebalance the test
/// itself started (a sleep only guesses how long the group takes to settle).
pub async fn wait_group_stable(group: &str, members: usize, timeout: std::time::Duration) -> Result<(), String> {
    use rdkafka::consumer::{BaseConsumer, Consumer as _};
    let admin: std::sync::Arc<BaseConsumer> = std::sync::Arc::new(
        rdkafka::ClientConfig::new()
            .set("bootstrap.servers", kafka_bootstrap())
            .create()
            .map_err(|e| format!("cannot create a Kafka client: {e}"))?,
    );
    let deadline = std::time::Instant::now() + timeout;
    loop {
        let (admin, name) = (admin.clone(), group.to_owned());
        let (stable, seen) = tokio::task::spawn_blocking(move || {
            match admin.fetch_group_list(Some(&name), std::time::Duration::from_secs(5)) {
                Ok(list) => match list.groups().first() {
                    Some(g) => {
                        let assigned =
                            g.members().iter().filter(|m| m.assignment().is_some_and(|a| !a.is_empty())).count();
                        (
                            g.state() == "Stable" && g.members().len() == members && assigned == members,
                            format!("state {}, {} members, {assigned} with partitions", g.state(), g.members().len()),
                        )
                    }
                    None => (false, "not listed".to_owned()),
                },
                Err(e) => (false, format!("cannot list: {e}")),
            }
        })
        .await
        .map_err(|e| format!("the group listing panicked: {e}"))?;
        if stable {
            return Ok(());
        }
        if std::time::Instant::now() >= deadline {
            return Err(format!("consumer group {group} did not settle with {members} members in {timeout:?}: {seen}"));
        }
        tokio::time::sleep(std::time::Duration::from_millis(250)).await;
    }
}

/// When this test process first touched the testbed's Kafka: every record a test waits for was
/// written after it.
static FIRST_TOUCH: std::sync::LazyLock<std::time::SystemTime> = std::sync::LazyLock::new(std::time::SystemTime::now);

/// Checks that Kafka answers a metadata request; returns the bootstrap address.
pub async fn require_kafka() -> Result<String, Unreachable> {
    use rdkafka::consumer::{BaseConsumer, Consumer as _};
    std::sync::LazyLock::force(&FIRST_TOUCH);
    let bootstrap = kafka_bootstrap();
    let b = bootstrap.clone();
    let result = tokio::task::spawn_blocking(move || {
        let consumer: BaseConsumer = rdkafka::ClientConfig::new()
            .set("bootstrap.servers", &b)
            .set("socket.connection.setup.timeout.ms", "3000")
            .create()
            .map_err(|e| e.to_string())?;
        consumer.fetch_metadata(None, Duration::from_secs(5)).map(|_| ()).map_err(|e| e.to_string())
    })
    .await
    .map_err(|e| e.to_string())
    .and_then(|r| r);
    result.map(|()| bootstrap.clone()).map_err(|detail| Unreachable { server: "Kafka", address: bootstrap, detail })
}

/// Checks that PostgreSQL accepts a login; returns a pool on the testbed's main database.
pub async fn require_postgres() -> Result<sqlx::PgPool, Unreachable> {
    let url = database_url();
    let pool = tokio::time::timeout(Duration::from_secs(10), crate::postgres::connect(&url, 4))
        .await
        .map_err(|_| "timed out after 10 s".to_owned())
        .and_then(|r| r.map_err(|e| e.to_string()));
    pool.map_err(|detail| Unreachable { server: "PostgreSQL", address: redact(&url), detail })
}

/// Creates an empty database named `name` and returns its URL.
pub async fn fresh_database(admin: &sqlx::PgPool, name: &str) -> Result<String, sqlx::Error> {
    // The name comes from the test itself (unique_name), never from outside input.
    sqlx::query(sqlx::AssertSqlSafe(format!("CREATE DATABASE \"{name}\""))).execute(admin).await?;
    let base = database_url();
    let (prefix, _) = base.rsplit_once('/').unwrap_or((&base, ""));
    Ok(format!("{prefix}/{name}"))
}

/// Checks that the kube-apiserver answers with the testbed's admin credentials; returns a client.
pub async fn require_kubernetes() -> Result<kube::Client, Unreachable> {
    let path = kubeconfig_path();
    let address = path.display().to_string();
    let config = kube::config::Kubeconfig::read_from(&path).map_err(|e| Unreachable {
        server: "kube-apiserver",
        address: address.clone(),
        detail: e.to_string(),
    })?;
    let config = kube::Config::from_custom_kubeconfig(config, &kube::config::KubeConfigOptions::default())
        .await
        .map_err(|e| Unreachable { server: "kube-apiserver", address: address.clone(), detail: e.to_string() })?;
    let url = config.cluster_url.to_string();
    let client = kube::Client::try_from(config).map_err(|e| Unreachable {
        server: "kube-apiserver",
        address: url.clone(),
        detail: e.to_string(),
    })?;
    tokio::time::timeout(Duration::from_secs(10), client.apiserver_version())
        .await
        .map_err(|_| "timed out after 10 s".to_owned())
        .and_then(|r| r.map_err(|e| e.to_string()))
        .map_err(|detail| Unreachable { server: "kube-apiserver", address: url, detail })?;
    Ok(client)
}

/// Checks that the tracing backend (the testbed's Jaeger) answers its query API; returns the
/// OTLP/gRPC endpoint services export to (`OTLP_ENDPOINT`, default `http://127.0.0.1:14317`) and
/// the query address (`JAEGER_QUERY_URL`, default `http://127.0.0.1:16686`).
pub async fn require_tracing() -> Result<(String, std::net::SocketAddr), Unreachable> {
    let otlp = std::env::var("OTLP_ENDPOINT").unwrap_or_else(|_| "http://127.0.0.1:14317".to_owned());
    let query = std::env::var("JAEGER_QUERY_URL").unwrap_or_else(|_| "http://127.0.0.1:16686".to_owned());
    let unreachable = |detail: String| Unreachable { server: "Jaeger", address: query.clone(), detail };
    let addr: std::net::SocketAddr = query
        .strip_prefix("http://")
        .and_then(|a| a.trim_end_matches('/').parse().ok())
        .ok_or_else(|| unreachable("JAEGER_QUERY_URL must be http://ip:port".into()))?;
    match tokio::time::timeout(Duration::from_secs(10), http_get(addr, "/api/services")).await {
        Ok(Ok((200, _))) => Ok((otlp, addr)),
        Ok(Ok((code, body))) => Err(unreachable(format!("GET /api/services answered {code}: {body}"))),
        Ok(Err(e)) => Err(unreachable(e.to_string())),
        Err(_) => Err(unreachable("timed out after 10 s".into())),
    }
}

/// Checks that the schema registry answers its Confluent-compatible API; returns its URL:
/// `SCHEMA_REGISTRY_URL`, or the testbed's default `http://127.0.0.1:18081/apis/ccompat/v7`.
pub async fn require_schema_registry() -> Result<String, Unreachable> {
    let url =
        std::env::var("SCHEMA_REGISTRY_URL").unwrap_or_else(|_| "http://127.0.0.1:18081/apis/ccompat/v7".to_owned());
    let unreachable = |detail: String| Unreachable { server: "Schema registry", address: url.clone(), detail };
    let rest = url.strip_prefix("http://").ok_or_else(|| unreachable("only http:// URLs are supported".into()))?;
    let (authority, path) = rest.split_once('/').unwrap_or((rest, ""));
    let addr: std::net::SocketAddr =
        authority.parse().map_err(|e| unreachable(format!("{authority} is not an ip:port address: {e}")))?;
    let path = match path.trim_end_matches('/') {
        "" => "/subjects".to_owned(),
        base => format!("/{base}/subjects"),
    };
    match tokio::time::timeout(Duration::from_secs(10), http_get(addr, &path)).await {
        Ok(Ok((200, _))) => Ok(url.clone()),
        Ok(Ok((code, body))) => Err(unreachable(format!("GET {path} answered HTTP {code}: {body}"))),
        Ok(Err(e)) => Err(unreachable(e.to_string())),
        Err(_) => Err(unreachable("timed out after 10 s".to_owned())),
    }
}

/// A service binary started by a test: spawned with the testbed's addresses, polled on its
/// `/readyz`, stopped with SIGTERM. Killed if dropped while running.
pub struct ServiceProcess {
    child: std::process::Child,
    admin: std::net::SocketAddr,
    name: String,
}

impl ServiceProcess {
    /// Starts `binary` with `args`, `GPUMEDIC_ADMIN_ADDR` on a free local port, and `env`.
    pub fn start(binary: &str, args: &[&str], env: &[(&str, String)]) -> std::io::Result<Self> {
        let admin = free_local_addr()?;
        let mut cmd = std::process::Command::new(binary);
        cmd.args(args)
            .env("GPUMEDIC_ADMIN_ADDR", admin.to_string())
            .env("GPUMEDIC_LOG", "info")
            .stdin(std::process::Stdio::null());
        for (k, v) in env {
            cmd.env(k, v);
        }
        let child = cmd.spawn()?;
        Ok(Self { child, admin, name: binary.rsplit('/').next().unwrap_or(binary).to_owned() })
    }

    /// The admin server's address.
    pub fn admin_addr(&self) -> std::net::SocketAddr {
        self.admin
    }

    /// The process id (for sampling its memory from `/proc`).
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// The exit status, if the process has exited.
    pub fn try_wait(&mut self) -> std::io::Result<Option<std::process::ExitStatus>> {
        self.child.try_wait()
    }

    /// Polls `/readyz` until it answers 200 or `timeout` passes; the error carries the last answer.
    pub async fn wait_ready(&mut self, timeout: Duration) -> Result<(), String> {
        let deadline = tokio::time::Instant::now() + timeout;
        let mut last = String::from("no answer yet");
        while tokio::time::Instant::now() < deadline {
            if let Ok(Some(status)) = self.child.try_wait() {
                return Err(format!("{} exited with {status} before it was ready", self.name));
            }
            match http_get(self.admin, "/readyz").await {
                Ok((200, _)) => return Ok(()),
                Ok((code, body)) => last = format!("{code} {}", body.trim()),
                Err(e) => last = e.to_string(),
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        Err(format!("{} was not ready after {timeout:?}; last /readyz: {last}", self.name))
    }

    /// Sends SIGTERM and waits up to `timeout` for the process to exit; returns its status.
    pub async fn terminate(&mut self, timeout: Duration) -> Result<std::process::ExitStatus, String> {
        let pid = self.child.id().to_string();
        let sent = std::process::Command::new("kill").args(["-TERM", &pid]).status().map_err(|e| e.to_string())?;
        if !sent.success() {
            return Err(format!("kill -TERM {pid} failed"));
        }
        let deadline = tokio::time::Instant::now() + timeout;
        while tokio::time::Instant::now() < deadline {
            if let Some(status) = self.child.try_wait().map_err(|e| e.to_string())? {
                return Ok(status);
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        Err(format!("{} did not exit within {timeout:?} of SIGTERM", self.name))
    }
}

impl Drop for ServiceProcess {
    fn drop(&mut self) {
        if matches!(self.child.try_wait(), Ok(None)) {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

/// The lifecycle every service must have: started with the testbed's addresses it reports ready
/// on `/readyz` within `ready_within`, serves `/healthz` and `/metrics`, and on SIGTERM exits 0
/// within `deadline`. Panics with a readable message otherwise.
pub async fn assert_service_lifecycle(
    binary: &str,
    args: &[&str],
    env: &[(&str, String)],
    ready_within: Duration,
    deadline: Duration,
) {
    let mut env = env.to_vec();
    env.push(("GPUMEDIC_SHUTDOWN_DEADLINE", format!("{}ms", deadline.as_millis())));
    let mut process = ServiceProcess::start(binary, args, &env).expect("service binary starts");
    process.wait_ready(ready_within).await.unwrap_or_else(|e| panic!("{e}; {START_HINT} if it is not running"));
    let (code, body) = http_get(process.admin_addr(), "/healthz").await.expect("healthz answers");
    assert_eq!((code, body.trim()), (200, "ok"));
    let (code, body) = http_get(process.admin_addr(), "/metrics").await.expect("metrics answers");
    assert_eq!(code, 200);
    assert!(body.contains("_up"), "metrics should include the service's up gauge: {body}");
    // The process exits on its own within the deadline it was given, plus start-up slack.
    let status = process.terminate(deadline + Duration::from_secs(5)).await.unwrap_or_else(|e| panic!("{e}"));
    assert!(status.success(), "{binary} exited with {status} after SIGTERM");
}

/// Reads `topic` in a fresh consumer group, from the records written since a minute before this
/// test process first touched Kafka, until one satisfies `want` or `timeout` passes (the error
/// says how many records were seen).
pub async fn wait_for_record(
    topic: &str,
    mut want: impl FnMut(&crate::kafka::Record) -> bool,
    timeout: Duration,
) -> Result<crate::kafka::Record, String> {
    use rdkafka::consumer::{Consumer as _, StreamConsumer};
    std::sync::LazyLock::force(&FIRST_TOUCH);
    let consumer: StreamConsumer = rdkafka::ClientConfig::new()
        .set("bootstrap.servers", kafka_bootstrap())
        .set("group.id", unique_name("test-reader"))
        .set("auto.offset.reset", "earliest")
        .set("enable.auto.commit", "false")
        .create()
        .map_err(|e| e.to_string())?;
    // From a minute before this process first touched Kafka, not from the beginning: the shared
    // topics hold every record earlier tests and load runs left, millions on a busy testbed.
    let since =
        FIRST_TOUCH.duration_since(std::time::UNIX_EPOCH).unwrap_or_default().saturating_sub(Duration::from_secs(60));
    // A topic not created yet (or metadata not answered) holds only what comes next.
    let partitions =
        crate::kafka::admin::existing_partitions(&consumer, topic, Duration::from_secs(10)).unwrap_or_default();
    if partitions.is_empty() {
        consumer.subscribe(&[topic]).map_err(|e| e.to_string())?;
    } else {
        // The end of each partition as it is before the lookup: a partition with nothing since
        // `since` answers "the end", which the broker resolves only when fetching starts, so a
        // record written in between would be skipped. Every record past this end was written
        // after `since`, so such a partition starts here. (Looked up after the timestamps, the
        // end could already include a record written in between, and skip it.)
        // A topic created moments ago answers with transient errors (no leader yet) for a while.
        let mut ends = std::collections::HashMap::new();
        for &p in &partitions {
            let (_, high) = settled(|| consumer.fetch_watermarks(topic, p, Duration::from_secs(10)))?;
            ends.insert(p, high);
        }
        let mut timestamps = rdkafka::TopicPartitionList::new();
        for &p in &partitions {
            timestamps
                .add_partition_offset(topic, p, rdkafka::Offset::Offset(since.as_millis() as i64))
                .map_err(|e| e.to_string())?;
        }
        let mut start = settled(|| consumer.offsets_for_times(timestamps.clone(), Duration::from_secs(10)))?;
        let unresolved: Vec<i32> = start
            .elements()
            .iter()
            .filter(|e| matches!(e.offset(), rdkafka::Offset::End | rdkafka::Offset::Invalid))
            .map(|e| e.partition())
            .collect();
        for p in unresolved {
            start.set_partition_offset(topic, p, rdkafka::Offset::Offset(ends[&p])).map_err(|e| e.to_string())?;
        }
        consumer.assign(&start).map_err(|e| e.to_string())?;
    }
    let deadline = tokio::time::Instant::now() + timeout;
    let mut seen = 0usize;
    let mut last_error = String::new();
    loop {
        let left = deadline.saturating_duration_since(tokio::time::Instant::now());
        match tokio::time::timeout(left, consumer.recv()).await {
            Err(_) => {
                return Err(format!(
                    "no matching record on {topic} within {timeout:?} ({seen} others seen){last_error}"
                ));
            }
            // A topic created moments ago answers with transient errors (no leader yet) while the
            // broker settles, as on the first test run against a new testbed: read on.
            Ok(Err(e)) => last_error = format!("; last consumer error: {e}"),
            Ok(Ok(m)) => {
                seen += 1;
                let record = crate::kafka::Record::from_message(&m);
                if want(&record) {
                    return Ok(record);
                }
            }
        }
    }
}

/// A TCP relay in front of a server whose forwarding can be held: while held, bytes are read and
/// kept, not passed on, so connections stay open and nothing answers, as a black-holed server or
/// a network that stopped answering one client looks. Released, the kept bytes flow on. For tests
/// of what a service does when a dependency stops answering; it runs until the test ends.
pub struct Relay {
    addr: std::net::SocketAddr,
    held: std::sync::Arc<std::sync::atomic::AtomicBool>,
}

impl Relay {
    /// Starts a relay on a free local port to `upstream` (`host:port`).
    pub async fn start(upstream: &str) -> std::io::Result<Self> {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?;
        let held = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let (flag, upstream) = (held.clone(), upstream.to_owned());
        tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                let Ok(server) = tokio::net::TcpStream::connect(&upstream).await else { continue };
                let (cr, cw) = client.into_split();
                let (sr, sw) = server.into_split();
                tokio::spawn(relay_pipe(cr, sw, flag.clone()));
                tokio::spawn(relay_pipe(sr, cw, flag.clone()));
            }
        });
        Ok(Self { addr, held })
    }

    /// The relay's own address.
    pub fn addr(&self) -> std::net::SocketAddr {
        self.addr
    }

    /// Holds (`true`) or releases (`false`) every byte in both directions.
    pub fn hold(&self, held: bool) {
        self.held.store(held, std::sync::atomic::Ordering::Release);
    }
}

async fn relay_pipe(
    mut from: tokio::net::tcp::OwnedReadHalf,
    mut to: tokio::net::tcp::OwnedWriteHalf,
    held: std::sync::Arc<std::sync::atomic::AtomicBool>,
) {
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
    let mut buf = vec![0u8; 64 * 1024];
    loop {
        let n = match from.read(&mut buf).await {
            Ok(0) | Err(_) => return,
            Ok(n) => n,
        };
        while held.load(std::sync::atomic::Ordering::Acquire) {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        if to.write_all(&buf[..n]).await.is_err() {
            return;
        }
    }
}

/// `lookup` retried for up to 30 s while the broker answers with an error (a topic created
/// moments ago has no partition leader yet); the last error if it never succeeds.
fn settled<T>(mut lookup: impl FnMut() -> rdkafka::error::KafkaResult<T>) -> Result<T, String> {
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    loop {
        match lookup() {
            Ok(v) => return Ok(v),
            Err(e) if std::time::Instant::now() >= deadline => return Err(e.to_string()),
            Err(_) => std::thread::sleep(Duration::from_millis(250)),
        }
    }
}

/// Runs `binary` with invalid `args` and returns its exit code and stderr.
pub fn run_with_invalid_config(binary: &str, args: &[&str]) -> (Option<i32>, String) {
    let out = std::process::Command::new(binary)
        .args(args)
        .env_remove("GPUMEDIC_KAFKA_BOOTSTRAP")
        .env_remove("GPUMEDIC_DATABASE_URL")
        .env_remove("GPUMEDIC_NODE_NAME")
        .output()
        .expect("binary runs");
    (out.status.code(), String::from_utf8_lossy(&out.stderr).into_owned())
}

/// The path of workspace binary `name` (built next to the running test's own folder), for tests
/// that run several services. Fails with the command that builds them when it is missing.
pub fn workspace_binary(name: &str) -> Result<std::path::PathBuf, String> {
    let exe = std::env::current_exe().map_err(|e| e.to_string())?;
    // target/<profile>/deps/<test> -> target/<profile>/<name>
    let dir = exe.parent().and_then(|d| d.parent()).ok_or("the test binary has no parent folder")?;
    let path = dir.join(name);
    if path.is_file() {
        Ok(path)
    } else {
        Err(format!(
            "{} is missing: build the binaries first with `cargo build --workspace --bins` (scripts/test.sh does)",
            path.display()
        ))
    }
}

/// A local address with a port nobody listens on right now.
pub fn free_local_addr() -> std::io::Result<std::net::SocketAddr> {
    std::net::TcpListener::bind("127.0.0.1:0")?.local_addr()
}

/// A minimal HTTP/1.1 GET on loopback: status code and body.
pub async fn http_get(addr: std::net::SocketAddr, path: &str) -> std::io::Result<(u16, String)> {
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
    let mut stream = tokio::net::TcpStream::connect(addr).await?;
    stream.write_all(format!("GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n").as_bytes()).await?;
    let mut raw = Vec::new();
    stream.read_to_end(&mut raw).await?;
    let text = String::from_utf8_lossy(&raw);
    let code = text
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .ok_or_else(|| std::io::Error::new(std::io::ErrorKind::InvalidData, "not an HTTP response"))?;
    let (head, body) = text.split_once("\r\n\r\n").unwrap_or((&text, ""));
    let chunked = head.lines().any(|l| {
        l.split_once(':').is_some_and(|(k, v)| {
            k.trim().eq_ignore_ascii_case("transfer-encoding") && v.trim().eq_ignore_ascii_case("chunked")
        })
    });
    Ok((code, if chunked { dechunk(body) } else { body.to_owned() }))
}

/// The body of a `Transfer-Encoding: chunked` response (Jaeger's query API answers so).
fn dechunk(mut rest: &str) -> String {
    let mut out = String::new();
    while let Some((size, after)) = rest.split_once("\r\n") {
        let Ok(n) = usize::from_str_radix(size.split(';').next().unwrap_or("").trim(), 16) else { break };
        if n == 0 || after.len() < n {
            break;
        }
        out.push_str(&after[..n]);
        rest = after[n..].strip_prefix("\r\n").unwrap_or(&after[n..]);
    }
    out
}

fn redact(url: &str) -> String {
    match (url.find("://"), url.rfind('@')) {
        (Some(s), Some(at)) if at > s => format!("{}://***{}", &url[..s], &url[at..]),
        _ => url.to_owned(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chunked_bodies_are_joined() {
        assert_eq!(dechunk("4\r\n{\"a\"\r\n3\r\n:1}\r\n0\r\n\r\n"), "{\"a\":1}");
        assert_eq!(dechunk("garbage"), "");
    }

    #[test]
    fn unique_names_differ_and_are_dns_safe() {
        let a = unique_name("t");
        let b = unique_name("t");
        assert_ne!(a, b);
        assert!(a.chars().all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-'), "{a}");
    }

    #[test]
    fn passwords_are_redacted() {
        assert_eq!(redact("postgres://u:secret@h:1/db"), "postgres://***@h:1/db");
    }
}
