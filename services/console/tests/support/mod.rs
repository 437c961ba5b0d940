//! A small fleet on the testbed for the console's tests: GPU Nodes in the real apiserver (under a
//! label of this run, which the console is told to select), the remediator's status object in a
//! namespace of the run, a Kubernetes Event about a node, and incident history rows in a fresh
//! database migrated by the classifier's own migrations. Nodes and namespace are deleted when the
//! fixture is dropped.

#![allow(dead_code)]

pub mod browser;

use std::time::Duration;

use chrono::Utc;
use gpumedic_runtime::kafka::{self, KafkaSettings};
use gpumedic_schemas::verdict::RecommendedAction;
use gpumedic_testkit::{self as testkit, NodeBuilder, ServiceProcess};
use k8s_openapi::api::core::v1::{ConfigMap, Event, Namespace, Node};
use kube::api::{Api, DeleteParams, PostParams};
use serde_json::json;
use uuid::Uuid;

pub const CONSOLE: &str = env!("CARGO_BIN_EXE_gpumedic-console");

/// The run's fleet and rows.
pub struct Fleet {
    pub run: String,
    pub namespace: String,
    pub topic: String,
    pub database_url: String,
    /// healthy, 8 GPUs, zone a.
    pub healthy: String,
    /// quarantined, cordoned and tainted, 8 GPUs, zone a: the node with the incident.
    pub quarantined: String,
    /// healthy, 8 GPUs, zone b.
    pub other: String,
    pub incident: Uuid,
    pub verdict: Uuid,
    pub client: kube::Client,
    _created: Created,
}

/// Deletes what a fixture created in the apiserver, however the test ends; made before the first
/// object is, so a fixture that fails half-way leaves nothing behind either.
pub struct Created {
    client: kube::Client,
    nodes: Vec<String>,
    namespace: String,
}

impl Drop for Created {
    fn drop(&mut self) {
        let client = self.client.clone();
        let nodes = self.nodes.clone();
        let namespace = self.namespace.clone();
        let _ = std::thread::spawn(move || {
            let Ok(rt) = tokio::runtime::Builder::new_current_thread().enable_all().build() else { return };
            rt.block_on(async {
                let dp = DeleteParams::default();
                for n in &nodes {
                    let _ = Api::<Node>::all(client.clone()).delete(n, &dp).await;
                }
                let event = format!("{}.cordoned", nodes[1]);
                let _ = Api::<Event>::namespaced(client.clone(), "default").delete(&event, &dp).await;
                let _ = Api::<Namespace>::all(client).delete(&namespace, &dp).await;
            });
        })
        .join();
    }
}

fn node(name: &str, run: &str, zone: &str, quarantined: bool) -> Node {
    let node = NodeBuilder::new(name)
        .label("nvidia.com/gpu.present", "true")
        .label("nvidia.com/gpu.product", "NVIDIA-H100-80GB-HBM3")
        .label("nvidia.com/gpu.count", "8")
        .label("topology.kubernetes.io/zone", zone)
        .label("gpumedic.io/console-test", run);
    let node = if quarantined {
        node.label("gpumedic.io/state", "quarantined").unschedulable(true).taint(
            "gpumedic.io/unhealthy",
            Some("gpu"),
            "NoSchedule",
        )
    } else {
        node
    };
    node.build()
}

/// Creates the fleet and the rows.
pub async fn fleet() -> Fleet {
    let client = testkit::require_kubernetes().await.unwrap_or_else(|e| panic!("{e}"));
    let admin = testkit::require_postgres().await.unwrap_or_else(|e| panic!("{e}"));
    testkit::require_kafka().await.unwrap_or_else(|e| panic!("{e}"));
    let run = testkit::unique_name("console");
    let db_name = run.replace('-', "_");
    let database_url = testkit::fresh_database(&admin, &db_name).await.expect("a fresh database");
    let db = gpumedic_runtime::postgres::connect(&database_url, 2).await.expect("connect");
    gpumedic_runtime::postgres::migrate(&db, &gpumedic_classifier::MIGRATOR)
        .await
        .expect("the classifier's migrations");

    let (healthy, quarantined, other) = (format!("{run}-gpu-0"), format!("{run}-gpu-1"), format!("{run}-gpu-2"));
    let namespace = run.clone();
    let created = Created {
        client: client.clone(),
        nodes: vec![healthy.clone(), quarantined.clone(), other.clone()],
        namespace: namespace.clone(),
    };
    let nodes: Api<Node> = Api::all(client.clone());
    for (name, zone, q) in [(&healthy, "zone-a", false), (&quarantined, "zone-a", true), (&other, "zone-b", false)] {
        nodes.create(&PostParams::default(), &node(name, &run, zone, q)).await.expect("create node");
    }
    Api::<Namespace>::all(client.clone())
        .create(&PostParams::default(), &serde_json::from_value(json!({ "metadata": { "name": namespace } })).unwrap())
        .await
        .expect("create namespace");
    let status: ConfigMap = serde_json::from_value(json!({
        "metadata": { "name": "gpumedic-remediator-status" },
        "data": { "breaker": "open", "breakerReason": "3 of 3 GPU nodes quarantined within 1h (limit 10%)",
                  "breakerTrippedAt": "2026-12-01T10:00:00Z", "paused": "false" }
    }))
    .unwrap();
    Api::<ConfigMap>::namespaced(client.clone(), &namespace)
        .create(&PostParams::default(), &status)
        .await
        .expect("create status object");
    let event: Event = serde_json::from_value(json!({
        "metadata": { "name": format!("{quarantined}.cordoned") },
        "involvedObject": { "kind": "Node", "name": quarantined, "apiVersion": "v1" },
        "reason": "GpumedicQuarantined",
        "message": "gpumedic cordoned the node: GPU 3 fell off the bus (Xid 79).",
        "type": "Warning",
        "source": { "component": "gpumedic-remediator" },
        "count": 1,
        "lastTimestamp": Utc::now().to_rfc3339_opts(chrono::SecondsFormat::Secs, true),
    }))
    .unwrap();
    // Events about cluster-scoped objects live in `default`, as the kubelet's do.
    Api::<Event>::namespaced(client.clone(), "default")
        .create(&PostParams::default(), &event)
        .await
        .expect("create event");

    let (incident, verdict, evidence, inventory) = (Uuid::new_v4(), Uuid::new_v4(), Uuid::new_v4(), Uuid::new_v4());
    sqlx::query(
        "INSERT INTO incidents (incident_id, node, gpu_uuid, rule_id, severity, opened_at, summary)
         VALUES ($1, $2, 'GPU-3b2c', 'xid-79-fallen-off-the-bus', 'critical', now() - interval '5 minutes',
                 'GPU 3 fell off the bus (Xid 79)')",
    )
    .bind(incident)
    .bind(&quarantined)
    .execute(&db)
    .await
    .expect("insert incident");
    // A past incident of the healthy node, resolved, for the incident list's pages.
    sqlx::query(
        "INSERT INTO incidents (incident_id, node, rule_id, severity, opened_at, resolved_at, summary)
         VALUES ($1, $2, 'thermal-slowdown', 'warning', now() - interval '2 days', now() - interval '47 hours',
                 'GPU 5 throttled for heat')",
    )
    .bind(Uuid::new_v4())
    .bind(&healthy)
    .execute(&db)
    .await
    .expect("insert a past incident");
    sqlx::query(
        "INSERT INTO health_events (event_id, node, observed_at, source, component, kind, gpu_uuid, xid, synthetic, record)
         VALUES ($1, $2, now() - interval '6 minutes', 'kernel_log', 'gpu', 'xid', 'GPU-3b2c', 79, true, '{}'),
                ($3, $2, now() - interval '10 minutes', 'nvml', 'gpu', 'gpu_inventory', NULL, NULL, false,
                 '{\"event\": {\"detail\": {\"gpu_inventory\": {\"expected\": 8, \"reason\": \"start\", \"gpus\": [
                    {\"index\": 0, \"uuid\": \"GPU-0a1b\", \"pci_bus_id\": \"0000:17:00.0\", \"serial\": \"1650923000001\"},
                    {\"index\": 3, \"uuid\": \"GPU-3b2c\", \"pci_bus_id\": \"0000:2a:00.0\", \"serial\": \"1650923000004\"}]}}}}')",
    )
    .bind(evidence)
    .bind(&quarantined)
    .bind(inventory)
    .execute(&db)
    .await
    .expect("insert events");
    sqlx::query(
        "INSERT INTO verdicts (verdict_id, incident_id, node, gpu_uuid, severity, rule_id, rule_version, action, reason, evidence, issued_at)
         VALUES ($1, $2, $3, 'GPU-3b2c', 'critical', 'xid-79-fallen-off-the-bus', 1, 'cordon_and_drain',
                 'Xid 79: GPU has fallen off the bus', ARRAY[$4]::uuid[], now() - interval '5 minutes')",
    )
    .bind(verdict)
    .bind(incident)
    .bind(&quarantined)
    .bind(evidence)
    .execute(&db)
    .await
    .expect("insert verdict");
    sqlx::query(
        "INSERT INTO actions (verdict_id, action, status, detail, at)
         VALUES ($1, 'cordon', 'succeeded', 'cordoned and tainted gpumedic.io/unhealthy=gpu:NoSchedule', now() - interval '4 minutes')",
    )
    .bind(verdict)
    .execute(&db)
    .await
    .expect("insert action");
    db.close().await;

    let topic = format!("{run}.verdicts");
    let settings = kafka_settings();
    settings
        .ensure_topics(&[kafka::TopicSpec::new(topic.clone(), 3).with_replication(1)])
        .await
        .expect("create the verdict topic");
    Fleet {
        run,
        namespace,
        topic,
        database_url,
        healthy,
        quarantined,
        other,
        incident,
        verdict,
        client,
        _created: created,
    }
}

pub fn kafka_settings() -> KafkaSettings {
    KafkaSettings {
        bootstrap: testkit::kafka_bootstrap(),
        options: vec![],
        schema_registry: None,
        topic_replication: None,
    }
}

impl Fleet {
    /// Starts the console on this fleet with `--api-auth auth` and waits until it is ready.
    pub async fn console(&self, auth: &str) -> ServiceProcess {
        let env = [
            ("GPUMEDIC_KAFKA_BOOTSTRAP", testkit::kafka_bootstrap()),
            ("GPUMEDIC_DATABASE_URL", self.database_url.clone()),
            ("GPUMEDIC_GPU_NODE_SELECTOR", format!("gpumedic.io/console-test={}", self.run)),
            ("GPUMEDIC_REMEDIATOR_NAMESPACE", self.namespace.clone()),
            ("GPUMEDIC_VERDICTS_TOPIC", self.topic.clone()),
            ("GPUMEDIC_API_AUTH", auth.to_owned()),
            ("GPUMEDIC_FLEET_GAUGE_INTERVAL", "500ms".to_owned()),
            ("GPUMEDIC_TOPIC_REPLICATION", "1".to_owned()),
            ("KUBECONFIG", testkit::kubeconfig_path().display().to_string()),
        ];
        let mut p = ServiceProcess::start(CONSOLE, &[], &env).expect("the console starts");
        p.wait_ready(Duration::from_secs(60)).await.unwrap_or_else(|e| panic!("{e}"));
        p
    }

    /// Publishes a verdict about `node` on the run's topic, as the classifier does.
    pub async fn publish_verdict(&self, node: &str, reason: &str) -> Uuid {
        let v = testkit::verdict(node)
            .rule("xid-48-double-bit-ecc", 1)
            .action(RecommendedAction::Cordon)
            .reason(reason)
            .build();
        let id = v.verdict_id;
        let payload = gpumedic_schemas::Codec::embedded().encode(&v).expect("encode");
        let producer = kafka_settings().producer("console-test").expect("producer");
        kafka::publish(&producer, &self.topic, node, &payload, &[]).await.expect("publish the verdict");
        id
    }
}
