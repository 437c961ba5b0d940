//! One fault through all four services, as separate processes against the real testbed: a
//! simulated GPU node's GPU 3 falls off the bus (it goes silent; the driver's Xid 79 line names it
//! by PCI bus id, which the collector resolves to its UUID), which cordons, taints and drains the
//! node and opens an incident in Postgres. The other seven GPUs' heartbeats for longer than the
//! quiet period do not release it; a simulated reboot (a new boot id, a complete inventory, the
//! lost GPU's own heartbeat) does, once, after the quiet period (uncordoned, taint and condition
//! cleared, incident resolved, one recovery verdict). Xid 13 once on another node is info only and
//! changes nothing on it; Xid 13 from three processes on one GPU asks for diagnostics, without a
//! cordon. Every metric the shipped alerts and dashboards name is then exported by one of the four
//! services.

#[path = "support/observability.rs"]
mod observability;

use std::process::Command;
use std::time::Duration;

use gpumedic_schemas::HealthEvent;
use gpumedic_schemas::health::{Component, Detail, Entity, Source, XidDetail};
use gpumedic_testkit::{self as testkit, ServiceProcess, eventually};
use k8s_openapi::api::core::v1::{Namespace, Node, Pod};
use kube::api::{Api, DeleteParams, ListParams, PostParams};
use serde_json::json;

const GPUMEDIC: &str = env!("CARGO_BIN_EXE_gpumedic");

fn bin(name: &str) -> String {
    testkit::workspace_binary(name).unwrap_or_else(|e| panic!("{e}")).display().to_string()
}

/// Every rule's quiet period is capped at this (`GPUMEDIC_MAX_QUIET`) so recovery fits in a test.
/// The engine runs on event time: a classifier catching up on a backlog sees 20 s of heartbeats at
/// once, so a shorter period could quarantine and recover between two looks at the node.
const QUIET: Duration = Duration::from_secs(20);

fn gpumedic_taint(node: &Node) -> bool {
    node.spec
        .as_ref()
        .and_then(|s| s.taints.as_ref())
        .is_some_and(|t| t.iter().any(|t| t.key.starts_with("gpumedic.io/")))
}

fn condition(node: &Node, type_: &str) -> Option<(String, Option<String>)> {
    node.status
        .as_ref()?
        .conditions
        .as_ref()?
        .iter()
        .find(|c| c.type_ == type_)
        .map(|c| (c.status.clone(), c.reason.clone()))
}

#[tokio::test]
async fn a_gpu_off_the_bus_quarantines_and_drains_and_only_a_reboot_restores_the_node() {
    let bootstrap = testkit::require_kafka().await.unwrap_or_else(|e| panic!("{e}"));
    let admin = testkit::require_postgres().await.unwrap_or_else(|e| panic!("{e}"));
    let client = testkit::require_kubernetes().await.unwrap_or_else(|e| panic!("{e}"));
    let db = testkit::unique_name("e2e").replace('-', "_");
    let url = testkit::fresh_database(&admin, &db).await.expect("database");
    let kubeconfig = testkit::kubeconfig_path().display().to_string();

    // The fleet: three GPU nodes, four GPU pods on the first.
    let faulty = testkit::unique_name("e2e-gpu");
    let other = testkit::unique_name("e2e-gpu");
    let repeat = testkit::unique_name("e2e-gpu");
    let ns = testkit::unique_name("e2e-ns");
    for n in [&faulty, &other, &repeat] {
        testkit::NodeBuilder::new(n)
            .label("nvidia.com/gpu.present", "true")
            .label("gpumedic.io/e2e", &ns)
            .create(&client)
            .await;
    }
    let nodes: Api<Node> = Api::all(client.clone());
    let namespaces: Api<Namespace> = Api::all(client.clone());
    namespaces
        .create(&PostParams::default(), &serde_json::from_value(json!({ "metadata": { "name": ns } })).unwrap())
        .await
        .unwrap();
    let pods: Api<Pod> = Api::namespaced(client.clone(), &ns);
    for i in 0..4 {
        let pod = json!({ "metadata": { "name": format!("trainer-{i}") }, "spec": { "nodeName": faulty,
            "containers": [{ "name": "c", "image": "x", "resources": { "limits": { "nvidia.com/gpu": "2" } } }] } });
        pods.create(&PostParams::default(), &serde_json::from_value(pod).unwrap()).await.unwrap();
    }

    // The four services, each in its own consumer group so this test sees every record; the
    // default rules as shipped.
    let rules = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../classifier/rules");
    let kafka = ("GPUMEDIC_KAFKA_BOOTSTRAP", bootstrap.clone());
    // Every service exports its spans to the testbed's Jaeger: the fault must be one trace.
    let (otlp_endpoint, jaeger) = testkit::require_tracing().await.unwrap_or_else(|e| panic!("{e}"));
    let otlp = ("GPUMEDIC_OTLP_ENDPOINT", otlp_endpoint);
    let synthetic = testkit::free_local_addr().unwrap();
    // New groups, committed at the end of the topics before the services start: this test's
    // records are not queued behind every record earlier tests left on the shared topics, and none
    // of them is skipped.
    let kafka_settings = gpumedic_runtime::kafka::KafkaSettings {
        bootstrap: bootstrap.clone(),
        options: vec![],
        schema_registry: None,
        topic_replication: None,
    };
    let mut groups = Vec::new();
    for s in ["e2e-enricher", "e2e-classifier", "e2e-remediator"] {
        let group = testkit::group_at_end(s, &gpumedic_schemas::topics::ALL).await.expect("group offsets");
        groups.push(("GPUMEDIC_GROUP", group));
    }
    let mut collector = ServiceProcess::start(
        &bin("gpumedic-collector"),
        &[],
        &[
            kafka.clone(),
            otlp.clone(),
            // Fault injection through the collector itself, so the fault's trace starts there.
            ("GPUMEDIC_SYNTHETIC_ADDR", synthetic.to_string()),
            ("GPUMEDIC_NODE_NAME", faulty.clone()),
            ("GPUMEDIC_GPU_BACKEND", "simulated".into()),
            ("GPUMEDIC_SAMPLE_INTERVAL", "1s".into()),
            ("GPUMEDIC_HEARTBEAT_INTERVAL", "1s".into()),
            ("GPUMEDIC_KMSG_PATH", "off".into()),
            // Its own state folder: the spool allows one collector per folder.
            (
                "GPUMEDIC_STATE_DIR",
                std::env::temp_dir().join(testkit::unique_name("e2e-collector")).display().to_string(),
            ),
        ],
    )
    .unwrap();
    let mut enricher = ServiceProcess::start(
        &bin("gpumedic-enricher"),
        &[],
        &[kafka.clone(), otlp.clone(), groups[0].clone(), ("KUBECONFIG", kubeconfig.clone())],
    )
    .unwrap();
    let mut classifier = ServiceProcess::start(
        &bin("gpumedic-classifier"),
        &[],
        &[
            kafka.clone(),
            otlp.clone(),
            groups[1].clone(),
            ("GPUMEDIC_DATABASE_URL", url.clone()),
            ("GPUMEDIC_RULES_DIR", rules.display().to_string()),
            ("GPUMEDIC_ALLOW_SYNTHETIC", "true".into()),
            ("GPUMEDIC_TICK", "500ms".into()),
            ("GPUMEDIC_MAX_QUIET", format!("{}s", QUIET.as_secs())),
            // The API's authentication has its own test (api_auth.rs).
            ("GPUMEDIC_API_AUTH", "none".into()),
        ],
    )
    .unwrap();
    let mut remediator = ServiceProcess::start(
        &bin("gpumedic-remediator"),
        &[],
        &[
            kafka.clone(),
            otlp.clone(),
            groups[2].clone(),
            ("KUBECONFIG", kubeconfig.clone()),
            // Its Lease and status object live in the test's namespace.
            ("GPUMEDIC_LEASE_NAMESPACE", ns.clone()),
            ("GPUMEDIC_MODE", "cordon-drain".into()),
            ("GPUMEDIC_GPU_NODE_SELECTOR", format!("gpumedic.io/e2e={ns}")),
            ("GPUMEDIC_BREAKER_MAX_SHARE", "1.0".into()),
            ("GPUMEDIC_DRAIN_GRACE_SECONDS", "0".into()),
            ("GPUMEDIC_DRAIN_DEADLINE", "30s".into()),
            // The resync against the open incidents runs as in production, often enough that its
            // metrics are there when the test reads them.
            ("GPUMEDIC_INCIDENT_DATABASE_URL", url.clone()),
            ("GPUMEDIC_RESYNC_INTERVAL", "5s".into()),
        ],
    )
    .unwrap();
    for s in [&mut collector, &mut enricher, &mut classifier, &mut remediator] {
        s.wait_ready(Duration::from_secs(90)).await.unwrap_or_else(|e| panic!("{e}"));
    }

    // The fault, through the collector's fault-injection endpoint: simulated GPU 3 falls off the
    // bus.
    let inject = async |body: serde_json::Value| -> serde_json::Value {
        reqwest::Client::new()
            .post(format!("http://{synthetic}/v1/inject"))
            .json(&body)
            .send()
            .await
            .unwrap()
            .error_for_status()
            .unwrap()
            .json()
            .await
            .unwrap()
    };
    let answer = inject(json!({ "fall_off_bus": true, "gpu_index": 3 })).await;
    let fault_at = tokio::time::Instant::now();
    let fault_id = answer["event_ids"][0].as_str().expect("the injected event's id").to_owned();

    // Garbage on the raw topic goes to its dead-letter topic, and nothing else stops.
    let garbage_key = format!("{faulty}-garbage");
    let producer = kafka_settings.producer("e2e-garbage").unwrap();
    gpumedic_runtime::kafka::publish(&producer, gpumedic_schemas::topics::HEALTH_RAW, &garbage_key, b"\xde\xad", &[])
        .await
        .unwrap();

    // Quarantined: condition, taint, cordon; then drained.
    let node = eventually("the faulty node to be cordoned, tainted and marked", Duration::from_secs(60), async || {
        let n = nodes.get(&faulty).await.ok()?;
        let cordoned = n.spec.as_ref().and_then(|s| s.unschedulable) == Some(true);
        (cordoned && gpumedic_taint(&n)).then_some(n)
    })
    .await;
    assert_eq!(condition(&node, "GpuUnhealthy"), Some(("True".into(), Some("Xid79".into()))));
    eventually("the GPU pods to be evicted", Duration::from_secs(60), async || {
        pods.list(&ListParams::default()).await.ok().filter(|l| l.items.is_empty()).map(|_| ())
    })
    .await;

    // Recorded: the incident, its verdict and the remediator's action.
    let pool = gpumedic_runtime::postgres::connect(&url, 2).await.unwrap();
    // The Xid line named the GPU by PCI bus id only; the collector named it fully.
    let named: Option<String> = eventually("the fault recorded", Duration::from_secs(30), async || {
        sqlx::query_scalar("SELECT gpu_uuid FROM health_events WHERE event_id = $1::uuid")
            .bind(&fault_id)
            .fetch_optional(&pool)
            .await
            .ok()
            .flatten()
    })
    .await;
    assert_eq!(named, Some(gpumedic_collector::gpu::simulated_uuid(&faulty, 3)));
    let incident: uuid::Uuid = eventually("the incident in Postgres", Duration::from_secs(30), async || {
        sqlx::query_scalar(
            "SELECT incident_id FROM incidents WHERE node = $1 AND rule_id = 'xid-79-fallen-off-the-bus'",
        )
        .bind(&faulty)
        .fetch_optional(&pool)
        .await
        .ok()
        .flatten()
    })
    .await;
    eventually("the applied action recorded", Duration::from_secs(30), async || {
        let n: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM actions a JOIN verdicts v USING (verdict_id) WHERE v.incident_id = $1 AND a.status = 'applied'",
        )
        .bind(incident)
        .fetch_one(&pool)
        .await
        .ok()?;
        (n >= 1).then_some(())
    })
    .await;

    // One fault, one trace: the raw record's trace holds spans from all four services.
    let raw = testkit::wait_for_event(gpumedic_schemas::topics::HEALTH_RAW, &fault_id, Duration::from_secs(30))
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let traceparent = String::from_utf8_lossy(raw.header("traceparent").expect("a traceparent")).into_owned();
    let trace_id = traceparent.split('-').nth(1).expect("a W3C traceparent").to_owned();
    let services = eventually(
        "the fault's trace in Jaeger with spans from all four services",
        Duration::from_secs(60),
        async || {
            let (code, body) = testkit::http_get(jaeger, &format!("/api/traces/{trace_id}")).await.ok()?;
            if code != 200 {
                return None;
            }
            let trace: serde_json::Value = serde_json::from_str(&body).ok()?;
            let names: std::collections::BTreeSet<String> = trace["data"][0]["processes"]
                .as_object()?
                .values()
                .filter_map(|p| p["serviceName"].as_str().map(str::to_owned))
                .collect();
            ["collector", "enricher", "classifier", "remediator"].iter().all(|s| names.contains(*s)).then_some(names)
        },
    )
    .await;
    assert!(services.contains("remediator"));

    // Xid 13 once elsewhere: an info verdict, and the node is left alone.
    let out = Command::new(GPUMEDIC)
        .args(["inject", "--kafka-bootstrap", &bootstrap, "--node", &other, "--xid", "13", "--gpu-index", "0"])
        .output()
        .unwrap();
    assert!(out.status.success());
    eventually("an info verdict for Xid 13", Duration::from_secs(30), async || {
        let n: i64 = sqlx::query_scalar("SELECT count(*) FROM verdicts WHERE node = $1 AND severity = 'info'")
            .bind(&other)
            .fetch_one(&pool)
            .await
            .ok()?;
        (n >= 1).then_some(())
    })
    .await;

    // Xid 13 on one GPU from three distinct processes may point at hardware: the default rules
    // ask for diagnostics (a warning), and an application Xid never takes the node out of service.
    let gpu = "GPU-13131313-1313-1313-1313-131313131313";
    let emitter = gpumedic_collector::sources::Emitter {
        producer: kafka_settings.producer("e2e-xid13").unwrap(),
        codec: kafka_settings.codec().await.unwrap(),
    };
    for i in 0..3 {
        let mut e = HealthEvent::new(
            &repeat,
            Source::Synthetic,
            Component::Gpu,
            Entity { gpu_uuid: Some(gpu.into()), ..Entity::default() },
            Detail::Xid(XidDetail {
                code: 13,
                text: "Graphics Exception: ESR 0x404490=0x80000001".into(),
                pid: Some(4000 + i),
                process: Some(format!("train-{i}")),
                nvlink5: None,
                recovery_action: None,
            }),
        );
        e.synthetic = true;
        emitter.emit(&e).await.unwrap();
    }
    let escalated: String =
        eventually("a diagnostics verdict for the repeated Xid 13", Duration::from_secs(60), async || {
            sqlx::query_scalar("SELECT severity FROM verdicts WHERE node = $1 AND action = 'run_diagnostics'")
                .bind(&repeat)
                .fetch_optional(&pool)
                .await
                .ok()
                .flatten()
        })
        .await;
    assert_eq!(escalated, "warning");
    let dead = testkit::wait_for_record(
        &gpumedic_runtime::kafka::dead_letter_topic(gpumedic_schemas::topics::HEALTH_RAW),
        |r| r.key.as_deref() == Some(garbage_key.as_bytes()),
        Duration::from_secs(30),
    )
    .await
    .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(dead.payload.as_deref(), Some(&b"\xde\xad"[..]));

    // The other seven GPUs beat every second for longer than the quiet period: not the part that
    // failed, so no proof of repair, and the node stays out.
    tokio::time::sleep_until(fault_at + QUIET + Duration::from_secs(10)).await;
    let n = nodes.get(&faulty).await.unwrap();
    assert_eq!(n.spec.as_ref().and_then(|s| s.unschedulable), Some(true), "still cordoned without a reboot");
    let recoveries = async || -> i64 {
        sqlx::query_scalar("SELECT count(*) FROM verdicts WHERE incident_id = $1 AND recovery")
            .bind(incident)
            .fetch_one(&pool)
            .await
            .unwrap()
    };
    assert_eq!(recoveries().await, 0, "no recovery verdict from other GPUs' heartbeats");

    // The reboot: a new boot id, every GPU back, a complete inventory, GPU 3's own heartbeat; held
    // for the quiet period, the node is restored and the incident resolved.
    let answer = inject(json!({ "reboot": true })).await;
    assert!(answer["boot_id"].as_str().is_some_and(|b| !b.is_empty()), "{answer}");
    let rebooted_at = tokio::time::Instant::now();
    eventually("the node to be uncordoned and cleared", Duration::from_secs(90), async || {
        let n = nodes.get(&faulty).await.ok()?;
        let cordoned = n.spec.as_ref().and_then(|s| s.unschedulable) == Some(true);
        (!cordoned && !gpumedic_taint(&n) && condition(&n, "GpuUnhealthy").is_some_and(|(s, _)| s == "False"))
            .then_some(())
    })
    .await;
    // The classifier publishes a verdict before its batch's rows are committed (the write is
    // idempotent and follows): the row may lag the node by a moment.
    eventually("the incident to be resolved in PostgreSQL", Duration::from_secs(15), async || {
        let resolved: Option<chrono::DateTime<chrono::Utc>> =
            sqlx::query_scalar("SELECT resolved_at FROM incidents WHERE incident_id = $1")
                .bind(incident)
                .fetch_one(&pool)
                .await
                .ok()?;
        resolved.map(|_| ())
    })
    .await;
    assert!(rebooted_at.elapsed() >= QUIET, "released only after the quiet period");
    let repeat_node = nodes.get(&repeat).await.unwrap();
    assert_ne!(repeat_node.spec.as_ref().and_then(|s| s.unschedulable), Some(true), "an application Xid never cordons");
    let other_node = nodes.get(&other).await.unwrap();
    assert_ne!(other_node.spec.as_ref().and_then(|s| s.unschedulable), Some(true), "Xid 13 once does not cordon");
    assert!(!gpumedic_taint(&other_node));

    // The operator's view: `gpumedic incidents` reads the classifier's API.
    let api = format!("http://{}", classifier.admin_addr());
    let out = Command::new(GPUMEDIC).args(["incidents", "--api", &api, "--node", &faulty]).output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let table = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(table.contains(&incident.to_string()) && table.contains("xid-79-fallen-off-the-bus"), "{table}");
    let out = Command::new(GPUMEDIC)
        .args(["incidents", "--api", &api, "--id", &incident.to_string(), "--output", "json"])
        .output()
        .unwrap();
    let story: serde_json::Value = serde_json::from_slice(&out.stdout).expect("JSON");
    assert!(story["actions"].as_array().is_some_and(|a| a.iter().any(|a| a["status"] == "applied")), "{story}");
    let out = Command::new(GPUMEDIC).args(["incidents", "--api", &api, "--status", "closed"]).output().unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("status"), "a bad filter is refused with the reason");

    assert_eq!(recoveries().await, 1, "released exactly once");

    // Every metric an alert or a dashboard panel names is exported by one of the services.
    let mut scrapes = Vec::new();
    for s in [&collector, &enricher, &classifier, &remediator] {
        let (code, body) = testkit::http_get(s.admin_addr(), "/metrics").await.expect("scrape /metrics");
        assert_eq!(code, 200, "{body}");
        scrapes.push(body);
    }
    observability::assert_every_used_metric_is_exported(&scrapes);

    for s in [&mut collector, &mut enricher, &mut classifier, &mut remediator] {
        let status = s.terminate(Duration::from_secs(20)).await.unwrap_or_else(|e| panic!("{e}"));
        assert!(status.success());
    }
    pool.close().await;
    for n in [&faulty, &other, &repeat] {
        nodes.delete(n, &DeleteParams::default()).await.ok();
    }
    namespaces.delete(&ns, &DeleteParams::default()).await.ok();
}
