//! Access to the testbed's real servers (Kafka, PostgreSQL, kube-apiserver, schema registry,
//! Jaeger) for integration tests and load tests, and readers of what a test waits for on Kafka.
//!
//! Each accessor checks that its server answers and otherwise returns an error that says how to
//! start it, so a test without its server fails loudly instead of passing by skipping.

use std::time::Duration;

use gpumedic_runtime::kafka::{KafkaError, KafkaSettings, Record};

use crate::http::http_get;

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
        None => std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../.testbed/kubeconfig"),
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
pub async fn group_at_end(prefix: &str, topics: &[&str]) -> Result<String, KafkaError> {
    let group = unique_name(prefix);
    KafkaSettings { bootstrap: kafka_bootstrap(), options: vec![], schema_registry: None, topic_replication: None }
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
    let pool = tokio::time::timeout(Duration::from_secs(10), gpumedic_runtime::postgres::connect(&url, 4))
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

/// Reads `topic` in a fresh consumer group, from the records written since a minute before this
/// test process first touched Kafka, until one satisfies `want` or `timeout` passes (the error
/// says how many records were seen).
pub async fn wait_for_record(
    topic: &str,
    mut want: impl FnMut(&Record) -> bool,
    timeout: Duration,
) -> Result<Record, String> {
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
    let partitions = consumer
        .fetch_metadata(Some(topic), Duration::from_secs(10))
        .map(|m| {
            m.topics()
                .iter()
                .filter(|t| t.name() == topic && t.error().is_none())
                .flat_map(|t| t.partitions().iter().map(|p| p.id()))
                .collect::<Vec<i32>>()
        })
        .unwrap_or_default();
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
                let record = Record::from_message(&m);
                if want(&record) {
                    return Ok(record);
                }
            }
        }
    }
}

/// [`wait_for_record`] for the record of one health event: the one whose event id header
/// ([`record_headers::EVENT_ID`](gpumedic_runtime::kafka::record_headers::EVENT_ID)) is `event_id`.
pub async fn wait_for_event(
    topic: &str,
    event_id: impl std::fmt::Display,
    timeout: Duration,
) -> Result<Record, String> {
    let id = event_id.to_string();
    wait_for_record(
        topic,
        |r| r.header(gpumedic_runtime::kafka::record_headers::EVENT_ID) == Some(id.as_bytes()),
        timeout,
    )
    .await
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
