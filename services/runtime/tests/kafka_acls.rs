//! One Kafka principal per service, enforced by a broker: a private broker with SASL/SCRAM and
//! StandardAuthorizer (compose/kafka-secure, never the shared testbed broker), the ACLs that
//! scripts/kafka-acls.sh gives, and each principal trying every topic. Each may produce, read and
//! use a group exactly as docs/deploy.md's principals table says and is refused everything else
//! with an authorization error; a client without credentials, or with a wrong password, is
//! refused outright. The enricher binary, started with its own credentials, creates its topics,
//! joins its group, consumes and produces.

use std::path::PathBuf;
use std::time::Duration;

use gpumedic_runtime::kafka::{KafkaSettings, TopicSpec, dead_letter_topic, record_headers};
use gpumedic_runtime::testbed;
use gpumedic_schemas::health::{Component, Detail, Entity, Source, XidDetail};
use gpumedic_schemas::{EnrichedHealthEvent, HealthEvent, topics};
use rdkafka::consumer::{BaseConsumer, CommitMode, Consumer as _};
use rdkafka::error::{KafkaError as RdKafkaError, RDKafkaErrorCode};
use rdkafka::message::{Headers as _, Message as _};
use rdkafka::producer::FutureRecord;
use rdkafka::{Offset, TopicPartitionList};

const SECURE: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../../compose/kafka-secure");
const ACLS: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../../scripts/kafka-acls.sh");
const DEPLOY_MD: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../../docs/deploy.md");

const SERVICES: [&str; 4] = ["collector", "enricher", "classifier", "remediator"];

/// The topics a principal may produce to, as docs/deploy.md gives them; every other is refused.
fn may_produce(user: &str, topic: &str) -> bool {
    let dlq = dead_letter_topic;
    match user {
        "collector" => topic == topics::HEALTH_RAW || topic == topics::NODE_TOKENS,
        "enricher" => topic == topics::HEALTH_ENRICHED || topic == dlq(topics::HEALTH_RAW),
        "classifier" => {
            topic == topics::VERDICTS || topic == dlq(topics::HEALTH_ENRICHED) || topic == dlq(topics::ACTIONS)
        }
        "remediator" => topic == topics::ACTIONS || topic == dlq(topics::VERDICTS),
        "operator" => true,
        _ => false,
    }
}

/// The topics a principal may read; every other is refused.
fn may_read(user: &str, topic: &str) -> bool {
    match user {
        "enricher" => topic == topics::HEALTH_RAW || topic == topics::NODE_TOKENS,
        "classifier" => topic == topics::HEALTH_ENRICHED || topic == topics::ACTIONS,
        "remediator" | "console" => topic == topics::VERDICTS,
        "operator" => true,
        _ => false,
    }
}

/// Every topic of the pipeline with the consumers' dead-letter topics.
fn all_topics() -> Vec<String> {
    let mut all: Vec<String> = topics::ALL.iter().map(|t| (*t).to_owned()).collect();
    all.push(topics::NODE_TOKENS.to_owned());
    for t in [topics::HEALTH_RAW, topics::HEALTH_ENRICHED, topics::ACTIONS, topics::VERDICTS] {
        all.push(dead_letter_topic(t));
    }
    all
}

/// Where compose/ keeps Kafka (compose/lib/common.sh's CACHE_DIR).
fn kafka_libs() -> PathBuf {
    let cache = std::env::var_os("GPUMEDIC_CACHE").map(PathBuf::from).unwrap_or_else(|| {
        std::env::var_os("XDG_CACHE_HOME")
            .map(PathBuf::from)
            .unwrap_or_else(|| PathBuf::from(std::env::var_os("HOME").expect("HOME is set")).join(".cache"))
            .join("gpumedic")
    });
    cache.join(format!("kafka-{}/libs", std::env::var("KAFKA_VERSION").unwrap_or_else(|_| "4.1.1".into())))
}

fn run(program: &str, args: &[&str]) -> String {
    let out = std::process::Command::new(program).args(args).output().unwrap_or_else(|e| panic!("{program}: {e}"));
    assert!(
        out.status.success(),
        "{program} {args:?} failed ({}):\n{}{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// A broker of this test's own with SASL/SCRAM and ACLs, started and stopped by
/// compose/kafka-secure.
struct SecureKafka {
    dir: PathBuf,
    port: u16,
}

impl SecureKafka {
    fn start() -> Self {
        let libs = kafka_libs();
        assert!(
            libs.join(".complete").is_file(),
            "Kafka is not installed at {}: run `compose/up kafka` once from the repository root (it fetches \
             Kafka into the cache; Java 17 is needed too)",
            libs.display()
        );
        let port = testbed::free_local_addr().expect("a free port").port();
        let mut controller_port = testbed::free_local_addr().expect("a free port").port();
        while controller_port == port {
            controller_port = testbed::free_local_addr().expect("a free port").port();
        }
        let kafka = Self { dir: std::env::temp_dir().join(testbed::unique_name("kafka-secure")), port };
        run(SECURE, &["start", &kafka.dir.display().to_string(), &port.to_string(), &controller_port.to_string()]);
        kafka
    }

    fn bootstrap(&self) -> String {
        format!("127.0.0.1:{}", self.port)
    }

    /// `user`'s librdkafka options, as its Secret's `options` would hold them.
    fn options(&self, user: &str) -> String {
        let file = self.dir.join("clients").join(format!("{user}.options"));
        std::fs::read_to_string(&file).unwrap_or_else(|e| panic!("{}: {e}", file.display())).trim().to_owned()
    }

    /// Client settings with `options` (comma separated key=value, as GPUMEDIC_KAFKA_OPTIONS).
    fn settings_with(&self, options: &str) -> KafkaSettings {
        KafkaSettings {
            bootstrap: self.bootstrap(),
            options: options
                .split(',')
                .filter(|o| !o.is_empty())
                .map(|o| {
                    let (k, v) = o.split_once('=').expect("key=value");
                    (k.to_owned(), v.to_owned())
                })
                .chain([("socket.connection.setup.timeout.ms".to_owned(), "5000".to_owned())])
                .collect(),
            schema_registry: None,
            topic_replication: Some(1),
        }
    }

    /// The client settings of `gpumedic-<user>` (or `admin`).
    fn settings(&self, user: &str) -> KafkaSettings {
        let name = if user == "admin" { user.to_owned() } else { format!("gpumedic-{user}") };
        self.settings_with(&self.options(&name))
    }

    fn admin_properties(&self) -> String {
        self.dir.join("clients/admin.properties").display().to_string()
    }
}

impl Drop for SecureKafka {
    fn drop(&mut self) {
        let _ = std::process::Command::new(SECURE).args(["stop", &self.dir.display().to_string()]).status();
        std::fs::remove_dir_all(&self.dir).ok();
    }
}

/// Produces one record to `topic` with the producer the services use (idempotent, acks=all).
async fn produce(settings: &KafkaSettings, topic: &str, key: &str, payload: &[u8]) -> Result<(), RdKafkaError> {
    let producer = settings.producer("acl-test").expect("the producer is created");
    producer
        .send(FutureRecord::to(topic).key(key).payload(payload), Duration::from_secs(30))
        .await
        .map(|_| ())
        .map_err(|(e, _)| e)
}

/// Reads `topic` (one partition) from the start, assigned rather than subscribed, until a record
/// satisfies `want` (its payload), the broker refuses the topic (`TopicAuthorizationFailed`: to a
/// principal without even Describe the topic's metadata says so, to one with Describe only the
/// fetch does), or `timeout` passes (the last error seen, or none). librdkafka wants a group id even so: `user`'s
/// own (errors about a group it may not use are not the topic's and are passed over).
async fn read(
    settings: &KafkaSettings,
    user: &str,
    topic: &str,
    want: impl Fn(&rdkafka::message::BorrowedMessage<'_>) -> bool + Send + 'static,
    timeout: Duration,
) -> Result<Vec<u8>, String> {
    // The operator reads as `gpumedic replay` does, in a group of its own each time.
    let group = if user == "operator" { testbed::unique_name("gpumedic-replay") } else { format!("gpumedic-{user}") };
    let config =
        settings.client_config_with("acl-test-reader", &[("group.id", &group), ("enable.auto.commit", "false")]);
    let topic = topic.to_owned();
    tokio::task::spawn_blocking(move || {
        let consumer: BaseConsumer = config.create().map_err(|e| e.to_string())?;
        let metadata = consumer.fetch_metadata(Some(&topic), Duration::from_secs(10)).map_err(|e| e.to_string())?;
        if let Some(err) = metadata.topics().iter().find(|t| t.name() == topic).and_then(|t| t.error()) {
            return Err(format!("{:?}", RDKafkaErrorCode::from(err)));
        }
        let mut tpl = TopicPartitionList::new();
        tpl.add_partition_offset(&topic, 0, Offset::Beginning).map_err(|e| e.to_string())?;
        consumer.assign(&tpl).map_err(|e| e.to_string())?;
        let deadline = std::time::Instant::now() + timeout;
        let mut last = String::from("no error");
        while std::time::Instant::now() < deadline {
            match consumer.poll(Duration::from_millis(200)) {
                Some(Ok(m)) if want(&m) => return Ok(m.payload().unwrap_or_default().to_vec()),
                Some(Ok(_)) | None => {}
                Some(Err(e)) if e.rdkafka_error_code() == Some(RDKafkaErrorCode::TopicAuthorizationFailed) => {
                    return Err("TopicAuthorizationFailed".into());
                }
                Some(Err(e)) => last = e.to_string(),
            }
        }
        Err(format!("no matching record from {topic} within {timeout:?} (last error: {last})"))
    })
    .await
    .expect("the reader does not panic")
}

/// Consumes `topic` as a member of `group` until the first record, and commits it: `Ok`, or
/// `GroupAuthorizationFailed` when the broker refuses the group, or what else went wrong.
async fn consume_in_group(settings: &KafkaSettings, group: &str, topic: &str) -> Result<(), String> {
    let config = settings.client_config_with(
        "acl-test-group",
        &[("group.id", group), ("enable.auto.commit", "false"), ("auto.offset.reset", "earliest")],
    );
    let topic = topic.to_owned();
    tokio::task::spawn_blocking(move || {
        let consumer: BaseConsumer = config.create().map_err(|e| e.to_string())?;
        consumer.subscribe(&[&topic]).map_err(|e| e.to_string())?;
        let deadline = std::time::Instant::now() + Duration::from_secs(30);
        let mut last = String::from("no error");
        while std::time::Instant::now() < deadline {
            match consumer.poll(Duration::from_millis(200)) {
                Some(Ok(m)) => {
                    return consumer
                        .commit_message(&m, CommitMode::Sync)
                        .map_err(|e| format!("{:?}", e.rdkafka_error_code().unwrap_or(RDKafkaErrorCode::Unknown)));
                }
                Some(Err(e)) if e.rdkafka_error_code() == Some(RDKafkaErrorCode::GroupAuthorizationFailed) => {
                    return Err("GroupAuthorizationFailed".into());
                }
                Some(Err(e)) => last = e.to_string(),
                None => {}
            }
        }
        Err(format!("no record from {topic} in group within 30 s (last error: {last})"))
    })
    .await
    .expect("the group consumer does not panic")
}

/// What `user` may not do that it should, or may that it should not, producing to every topic.
async fn produce_problems(kafka: &SecureKafka, user: &str) -> Vec<String> {
    let settings = kafka.settings(user);
    let mut problems = Vec::new();
    for topic in all_topics() {
        let result = produce(&settings, &topic, user, b"acl probe").await;
        match (may_produce(user, &topic), &result) {
            (true, Ok(())) => {}
            (false, Err(e)) if e.rdkafka_error_code() == Some(RDKafkaErrorCode::TopicAuthorizationFailed) => {}
            // A principal that may write no topic at all (the console) gets no producer id from
            // the broker (the idempotent producer's InitProducerId needs Write somewhere), so its
            // record is purged unsent rather than refused by topic.
            (false, Err(e))
                if !SERVICES.contains(&user) && e.rdkafka_error_code() == Some(RDKafkaErrorCode::PurgeQueue) => {}
            (allowed, result) => {
                problems.push(format!("{user} producing to {topic}: expected allowed={allowed}, got {result:?}"))
            }
        }
    }
    problems
}

fn xid_event(node: &str) -> HealthEvent {
    let detail = Detail::Xid(XidDetail {
        code: 79,
        text: "GPU has fallen off the bus.".into(),
        pid: None,
        process: None,
        nvlink5: None,
        recovery_action: None,
    });
    HealthEvent::new(node, Source::KernelLog, Component::Gpu, Entity::default(), detail)
}

fn header(m: &rdkafka::message::BorrowedMessage<'_>, name: &str) -> Option<Vec<u8>> {
    m.headers()?.iter().find(|h| h.key == name).and_then(|h| h.value.map(<[u8]>::to_vec))
}

#[tokio::test]
async fn each_service_principal_may_do_only_what_its_acls_allow() {
    let started = std::time::Instant::now();
    let kafka = SecureKafka::start();
    let out = run(
        ACLS,
        &[
            "--bootstrap",
            &kafka.bootstrap(),
            "--command-config",
            &kafka.admin_properties(),
            "--kafka-libs",
            &kafka_libs().display().to_string(),
        ],
    );
    eprintln!("{out}ACLs applied after {:?}.", started.elapsed());

    // The topics, as an operator creates them before the first deployment.
    let specs: Vec<TopicSpec> = all_topics().into_iter().map(|t| TopicSpec::new(t, 1)).collect();
    kafka.settings("admin").ensure_topics(&specs).await.expect("the admin creates the topics");

    // No credentials, or a wrong password: refused before any request.
    for (who, options) in [
        ("a client without credentials", String::new()),
        (
            "a client with a wrong password",
            "security.protocol=SASL_PLAINTEXT,sasl.mechanism=SCRAM-SHA-512,sasl.username=gpumedic-collector,\
             sasl.password=wrong"
                .to_owned(),
        ),
    ] {
        let settings = kafka.settings_with(&format!("{options},message.timeout.ms=10000"));
        let result = produce(&settings, topics::HEALTH_RAW, "n", b"x").await;
        assert!(result.is_err(), "{who} must not produce: {result:?}");
    }

    // Produce: every principal against every topic. The operator goes first, so every topic holds a
    // record for the read checks below; then the four services at once.
    let mut problems = produce_problems(&kafka, "operator").await;
    for p in
        futures::future::join_all(SERVICES.iter().chain(["console"].iter()).map(|user| produce_problems(&kafka, user)))
            .await
    {
        problems.extend(p);
    }
    eprintln!("Produce checks done after {:?}.", started.elapsed());

    // Read: every principal against every pipeline topic, without a group; all at once.
    let mut reads = Vec::new();
    for user in ["operator", "collector", "enricher", "classifier", "remediator", "console"] {
        for topic in topics::ALL.into_iter().chain([topics::NODE_TOKENS]) {
            let settings = kafka.settings(user);
            reads.push(async move {
                let result = read(&settings, user, topic, |_| true, Duration::from_secs(20)).await;
                (user, topic, result)
            });
        }
    }
    for (user, topic, result) in futures::future::join_all(reads).await {
        match (may_read(user, topic), &result) {
            (true, Ok(_)) => {}
            (false, Err(e)) if e == "TopicAuthorizationFailed" => {}
            (allowed, result) => {
                problems.push(format!("{user} reading {topic}: expected allowed={allowed}, got {result:?}"))
            }
        }
    }
    eprintln!("Read checks done after {:?}.", started.elapsed());

    // Groups: a consuming service consumes and commits in its own group only; all at once.
    let mut groups = Vec::new();
    for (user, input) in
        [("enricher", topics::HEALTH_RAW), ("classifier", topics::HEALTH_ENRICHED), ("remediator", topics::VERDICTS)]
    {
        for group_of in SERVICES {
            let settings = kafka.settings(user);
            groups.push(async move {
                let result = consume_in_group(&settings, &format!("gpumedic-{group_of}"), input).await;
                (user, group_of, result)
            });
        }
    }
    for (user, group_of, result) in futures::future::join_all(groups).await {
        match (user == group_of, &result) {
            (true, Ok(())) => {}
            (false, Err(e)) if e == "GroupAuthorizationFailed" => {}
            (own, result) => problems
                .push(format!("{user} consuming in group gpumedic-{group_of}: expected allowed={own}, got {result:?}")),
        }
    }
    // The console reads verdicts in a group of its own per replica (prefix gpumedic-console-), and
    // in no service's group.
    let console = kafka.settings("console");
    let own = testbed::unique_name("gpumedic-console");
    let (in_own, in_remediators) = futures::future::join(
        consume_in_group(&console, &own, topics::VERDICTS),
        consume_in_group(&console, "gpumedic-remediator", topics::VERDICTS),
    )
    .await;
    if let Err(e) = in_own {
        problems.push(format!("console consuming verdicts in its group {own}: expected allowed, got {e}"));
    }
    if !matches!(&in_remediators, Err(e) if e == "GroupAuthorizationFailed") {
        problems
            .push(format!("console consuming in group gpumedic-remediator: expected refused, got {in_remediators:?}"));
    }
    assert!(problems.is_empty(), "the ACLs do not match docs/deploy.md:\n{}", problems.join("\n"));
    eprintln!("Group checks done after {:?}.", started.elapsed());

    // The enricher binary with its own credentials: it creates its topics (they exist: Create is
    // allowed and changes nothing), joins its group, consumes raw and produces enriched and its
    // dead letters.
    testbed::require_kubernetes().await.unwrap_or_else(|e| panic!("{e}"));
    let binary = testbed::workspace_binary("gpumedic-enricher").unwrap_or_else(|e| panic!("{e}"));
    let mut enricher = testbed::ServiceProcess::start(
        &binary.display().to_string(),
        &[],
        &[
            ("GPUMEDIC_KAFKA_BOOTSTRAP", kafka.bootstrap()),
            ("GPUMEDIC_KAFKA_OPTIONS", kafka.options("gpumedic-enricher")),
            ("GPUMEDIC_TOPIC_REPLICATION", "1".into()),
            ("GPUMEDIC_CLUSTER_NAME", "acl-test".into()),
            ("KUBECONFIG", testbed::kubeconfig_path().display().to_string()),
        ],
    )
    .expect("the enricher starts");
    enricher.wait_ready(Duration::from_secs(90)).await.unwrap_or_else(|e| panic!("{e}"));
    eprintln!("The enricher is ready after {:?}.", started.elapsed());

    let collector = kafka.settings("collector");
    let node = testbed::unique_name("acl-node");
    let event = xid_event(&node);
    produce(&collector, topics::HEALTH_RAW, &node, &gpumedic_schemas::encode(&event).expect("encodes"))
        .await
        .expect("the collector produces to raw");
    let garbage_key = format!("{node}-garbage");
    produce(&collector, topics::HEALTH_RAW, &garbage_key, b"\x07not avro").await.expect("produced");

    // The classifier reads what the enricher wrote.
    let id = event.event_id.to_string();
    let payload = read(
        &kafka.settings("classifier"),
        "classifier",
        topics::HEALTH_ENRICHED,
        move |m| header(m, record_headers::EVENT_ID).as_deref() == Some(id.as_bytes()),
        Duration::from_secs(60),
    )
    .await
    .unwrap_or_else(|e| panic!("the enriched event did not arrive: {e}"));
    let enriched: EnrichedHealthEvent = gpumedic_schemas::decode(&payload).expect("decodes");
    assert_eq!(enriched.event, event, "the enricher, as gpumedic-enricher, passed the event on");
    let key = garbage_key.clone();
    read(
        &kafka.settings("operator"),
        "operator",
        &dead_letter_topic(topics::HEALTH_RAW),
        move |m| m.key() == Some(key.as_bytes()),
        Duration::from_secs(60),
    )
    .await
    .unwrap_or_else(|e| panic!("the garbage record was not dead-lettered by the enricher: {e}"));
    let status = enricher.terminate(Duration::from_secs(30)).await.unwrap_or_else(|e| panic!("{e}"));
    assert!(status.success(), "the enricher exited with {status}");
}

/// docs/deploy.md shows the commands the script runs, so the two cannot drift apart.
#[test]
fn deploy_md_shows_the_commands_the_acl_script_runs() {
    let printed = run(ACLS, &["--print", "--bootstrap", "kafka:9093", "--command-config", "admin.properties"]);
    let doc = std::fs::read_to_string(DEPLOY_MD).expect("docs/deploy.md");
    for line in printed.lines() {
        assert!(
            doc.contains(line),
            "docs/deploy.md lacks this command of `scripts/kafka-acls.sh --print --bootstrap kafka:9093 \
             --command-config admin.properties`; paste its output again:\n{line}"
        );
    }
}
