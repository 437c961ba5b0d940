//! One fault through all four services, as separate processes against the real testbed: a
//! simulated GPU node's Xid 79 cordons, taints and drains it and opens an incident in Postgres;
//! the GPU's healthy heartbeats then recover it (uncordoned, taint and condition cleared, incident
//! resolved). Xid 13 once on another node is info only and changes nothing on it.

use std::process::Command;
use std::time::Duration;

use gpumedic_runtime::testbed::{self, ServiceProcess};
use k8s_openapi::api::core::v1::{Namespace, Node, Pod};
use kube::api::{Api, DeleteParams, ListParams, PostParams};
use serde_json::json;

const GPUMEDIC: &str = env!("CARGO_BIN_EXE_gpumedic");

fn bin(name: &str) -> String {
    testbed::workspace_binary(name).unwrap_or_else(|e| panic!("{e}")).display().to_string()
}

/// The default rules, with the Xid 79 quiet period cut to 20 s so recovery fits in a test. The
/// engine runs on event time: a classifier catching up on a backlog sees 20 s of heartbeats at
/// once, so a shorter period could quarantine and recover between two looks at the node.
fn fast_rules() -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(testbed::unique_name("e2e-rules"));
    std::fs::create_dir_all(&dir).unwrap();
    let src = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../classifier/rules");
    for entry in std::fs::read_dir(src).unwrap() {
        let path = entry.unwrap().path();
        let text = std::fs::read_to_string(&path).unwrap().replace("quiet: 15m", "quiet: 20s");
        std::fs::write(dir.join(path.file_name().unwrap()), text).unwrap();
    }
    dir
}

async fn eventually<T>(what: &str, timeout: Duration, mut check: impl AsyncFnMut() -> Option<T>) -> T {
    let deadline = tokio::time::Instant::now() + timeout;
    loop {
        if let Some(v) = check().await {
            return v;
        }
        assert!(tokio::time::Instant::now() < deadline, "timed out after {timeout:?} waiting for: {what}");
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}

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
async fn xid79_quarantines_and_drains_then_recovery_restores_the_node() {
    let bootstrap = testbed::require_kafka().await.unwrap_or_else(|e| panic!("{e}"));
    let admin = testbed::require_postgres().await.unwrap_or_else(|e| panic!("{e}"));
    let client = testbed::require_kubernetes().await.unwrap_or_else(|e| panic!("{e}"));
    let db = testbed::unique_name("e2e").replace('-', "_");
    let url = testbed::fresh_database(&admin, &db).await.expect("database");
    let kubeconfig = testbed::kubeconfig_path().display().to_string();

    // The fleet: three GPU nodes, four GPU pods on the first.
    let faulty = testbed::unique_name("e2e-gpu");
    let other = testbed::unique_name("e2e-gpu");
    let repeat = testbed::unique_name("e2e-gpu");
    let ns = testbed::unique_name("e2e-ns");
    let nodes: Api<Node> = Api::all(client.clone());
    for n in [&faulty, &other, &repeat] {
        let node =
            json!({ "metadata": { "name": n, "labels": { "nvidia.com/gpu.present": "true", "gpumedic.io/e2e": ns } } });
        nodes.create(&PostParams::default(), &serde_json::from_value(node).unwrap()).await.expect("node");
    }
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

    // The four services, each in its own consumer group so this test sees every record.
    let rules = fast_rules();
    let kafka = ("GPUMEDIC_KAFKA_BOOTSTRAP", bootstrap.clone());
    // Every service exports its spans to the testbed's Jaeger: the fault must be one trace.
    let (otlp_endpoint, jaeger) = testbed::require_tracing().await.unwrap_or_else(|e| panic!("{e}"));
    let otlp = ("GPUMEDIC_OTLP_ENDPOINT", otlp_endpoint);
    let synthetic = testbed::free_local_addr().unwrap();
    // New groups, committed at the end of the topics before the services start: this test's
    // records are not queued behind every record earlier tests left on the shared topics, and none
    // of them is skipped.
    let kafka_settings =
        gpumedic_runtime::kafka::KafkaSettings { bootstrap: bootstrap.clone(), options: vec![], schema_registry: None };
    let mut groups = Vec::new();
    for s in ["e2e-enricher", "e2e-classifier", "e2e-remediator"] {
        let group = testbed::group_at_end(s, &gpumedic_schemas::topics::ALL).await.expect("group offsets");
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
                std::env::temp_dir().join(testbed::unique_name("e2e-collector")).display().to_string(),
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
        ],
    )
    .unwrap();
    for s in [&mut collector, &mut enricher, &mut classifier, &mut remediator] {
        s.wait_ready(Duration::from_secs(90)).await.unwrap_or_else(|e| panic!("{e}"));
    }

    // The fault, through the collector's fault-injection endpoint.
    let answer: serde_json::Value = reqwest::Client::new()
        .post(format!("http://{synthetic}/v1/inject"))
        .json(&json!({ "xid": 79, "gpu_index": 3 }))
        .send()
        .await
        .unwrap()
        .error_for_status()
        .unwrap()
        .json()
        .await
        .unwrap();
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
    let raw = testbed::wait_for_record(
        gpumedic_schemas::topics::HEALTH_RAW,
        |r| r.header(gpumedic_runtime::kafka::record_headers::EVENT_ID) == Some(fault_id.as_bytes()),
        Duration::from_secs(30),
    )
    .await
    .unwrap_or_else(|e| panic!("{e}"));
    let traceparent = String::from_utf8_lossy(raw.header("traceparent").expect("a traceparent")).into_owned();
    let trace_id = traceparent.split('-').nth(1).expect("a W3C traceparent").to_owned();
    let services = eventually(
        "the fault's trace in Jaeger with spans from all four services",
        Duration::from_secs(60),
        async || {
            let (code, body) = testbed::http_get(jaeger, &format!("/api/traces/{trace_id}")).await.ok()?;
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

    // Xid 13 repeated on one GPU points at hardware: the default rules escalate to a cordon.
    let gpu = "GPU-13131313-1313-1313-1313-131313131313";
    let out = Command::new(GPUMEDIC)
        .args([
            "inject",
            "--kafka-bootstrap",
            &bootstrap,
            "--node",
            &repeat,
            "--xid",
            "13",
            "--gpu-uuid",
            gpu,
            "--count",
            "3",
        ])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    eventually("the node with a repeating Xid 13 to be cordoned", Duration::from_secs(60), async || {
        let n = nodes.get(&repeat).await.ok()?;
        (n.spec.as_ref().and_then(|s| s.unschedulable) == Some(true)).then_some(())
    })
    .await;
    let escalated: String = sqlx::query_scalar("SELECT severity FROM verdicts WHERE node = $1 AND action = 'cordon'")
        .bind(&repeat)
        .fetch_one(&pool)
        .await
        .expect("a cordon verdict for the repeated Xid 13");
    assert_eq!(escalated, "warning");
    let dead = testbed::wait_for_record(
        &gpumedic_runtime::kafka::dead_letter_topic(gpumedic_schemas::topics::HEALTH_RAW),
        |r| r.key.as_deref() == Some(garbage_key.as_bytes()),
        Duration::from_secs(30),
    )
    .await
    .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(dead.payload.as_deref(), Some(&b"\xde\xad"[..]));

    // Recovery: the simulated GPUs' heartbeats are healthy evidence; after the quiet period the
    // node is restored and the incident resolved.
    eventually("the node to be uncordoned and cleared", Duration::from_secs(60), async || {
        let n = nodes.get(&faulty).await.ok()?;
        let cordoned = n.spec.as_ref().and_then(|s| s.unschedulable) == Some(true);
        (!cordoned && !gpumedic_taint(&n) && condition(&n, "GpuUnhealthy").is_some_and(|(s, _)| s == "False"))
            .then_some(())
    })
    .await;
    let resolved: Option<chrono::DateTime<chrono::Utc>> =
        sqlx::query_scalar("SELECT resolved_at FROM incidents WHERE incident_id = $1")
            .bind(incident)
            .fetch_one(&pool)
            .await
            .unwrap();
    assert!(resolved.is_some(), "the incident is resolved");
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

    for s in [&mut collector, &mut enricher, &mut classifier, &mut remediator] {
        let status = s.terminate(Duration::from_secs(20)).await.unwrap_or_else(|e| panic!("{e}"));
        assert!(status.success());
    }
    pool.close().await;
    for n in [&faulty, &other, &repeat] {
        nodes.delete(n, &DeleteParams::default()).await.ok();
    }
    namespaces.delete(&ns, &DeleteParams::default()).await.ok();
    std::fs::remove_dir_all(&rules).ok();
}
