//! Decisions end to end, through the enricher, two classifier replicas and the remediator as
//! separate processes against the real testbed, each test on topics of its own. Events are
//! written to the raw topic shaped as the collector writes them (kernel-log Xid lines with the
//! GPU's PCI bus id, UUID, pid and process; cloud maintenance notices).
//!
//! - One training job of 16 pods on 16 nodes crashes: every GPU logs its three-line Xid 13 within
//!   the same millisecond. No node is cordoned, tainted or marked; one workload fault naming the
//!   job is recorded in Postgres and published on the verdict topic, although the nodes are split
//!   over two classifier replicas. A fatal SXid on one of those nodes then cordons and drains it.
//! - Xid 48 in the kernel log (the GPU named by PCI bus id) and NVML's double-bit counter of the
//!   same GPU (named by UUID) are one incident on that GPU; its own heartbeats do not release it,
//!   its reset (the volatile counter back at 0) and then its heartbeats do, once.
//! - A cloud notice for a window two days ahead leaves its node serving; the same notice for a
//!   window two minutes ahead, with the lead shortened by configuration, drains its node before
//!   the window opens.

use std::time::Duration;

use gpumedic_runtime::kafka::{self, Envelope, KafkaSettings, Record};
use gpumedic_schemas::health::{
    CloudMaintenanceDetail, CloudProvider, Component, Detail, EccDetail, Entity, GpuIdentity, GpuInventoryDetail,
    MonitorHealthDetail, MonitorState, Source, SxidDetail, XidDetail,
};
use gpumedic_schemas::{HealthEvent, Record as _, Verdict};
use gpumedic_testkit::{self as testkit, ServiceProcess, eventually};
use k8s_openapi::api::core::v1::{Namespace, Node, Pod};
use kube::api::{Api, DeleteParams, ListParams, PostParams};
use rdkafka::consumer::{Consumer as _, StreamConsumer};
use serde_json::json;

fn bin(name: &str) -> String {
    testkit::workspace_binary(name).unwrap_or_else(|e| panic!("{e}")).display().to_string()
}

fn cordoned(node: &Node) -> bool {
    node.spec.as_ref().and_then(|s| s.unschedulable) == Some(true)
}

fn marked(node: &Node) -> bool {
    let tainted = node
        .spec
        .as_ref()
        .and_then(|s| s.taints.as_ref())
        .is_some_and(|t| t.iter().any(|t| t.key.starts_with("gpumedic.io/")));
    let condition = node.status.as_ref().and_then(|s| s.conditions.as_ref()).is_some_and(|c| {
        c.iter().any(|c| {
            c.status == "True" && c.reason.as_deref().is_some_and(|r| !r.is_empty()) && c.type_.starts_with("Gpu")
        })
    });
    tainted || condition
}

/// One test's pipeline: its namespace (also the fleet label), topics, database and services.
struct Pipeline {
    client: kube::Client,
    ns: String,
    raw: String,
    verdicts: String,
    pool: sqlx::PgPool,
    producer: kafka::Producer,
    codec: std::sync::Arc<gpumedic_schemas::Codec>,
    services: Vec<ServiceProcess>,
}

impl Pipeline {
    /// Starts the enricher, `classifiers` classifier replicas (one group) and the remediator in
    /// cordon-drain mode, with `classifier_env` added to the classifiers' environment.
    async fn start(classifiers: usize, classifier_env: &[(&str, String)]) -> Self {
        let bootstrap = testkit::require_kafka().await.unwrap_or_else(|e| panic!("{e}"));
        let admin = testkit::require_postgres().await.unwrap_or_else(|e| panic!("{e}"));
        let client = testkit::require_kubernetes().await.unwrap_or_else(|e| panic!("{e}"));
        let db = testkit::unique_name("decisions").replace('-', "_");
        let url = testkit::fresh_database(&admin, &db).await.expect("database");
        let ns = testkit::unique_name("decisions");
        Api::<Namespace>::all(client.clone())
            .create(&PostParams::default(), &serde_json::from_value(json!({ "metadata": { "name": ns } })).unwrap())
            .await
            .expect("namespace");
        let [raw, enriched, verdicts, actions] =
            ["raw", "enriched", "verdicts", "actions"].map(|t| testkit::unique_name(&format!("decisions-{t}")));
        // The topics exist before the services start, as in a deployment.
        let settings = KafkaSettings {
            bootstrap: bootstrap.clone(),
            options: vec![],
            schema_registry: None,
            topic_replication: None,
        };
        let specs = kafka::stage_topics(
            &[&raw, &enriched, &verdicts, &actions],
            &[],
            gpumedic_schemas::topics::DEFAULT_PARTITIONS,
        );
        settings.ensure_topics(&specs).await.expect("topics");
        let kafka = ("GPUMEDIC_KAFKA_BOOTSTRAP", bootstrap.clone());
        let rules = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../classifier/rules");
        let mut services = vec![
            ServiceProcess::start(
                &bin("gpumedic-enricher"),
                &[],
                &[
                    kafka.clone(),
                    ("GPUMEDIC_GROUP", testkit::unique_name("enricher")),
                    ("GPUMEDIC_RAW_TOPIC", raw.clone()),
                    ("GPUMEDIC_ENRICHED_TOPIC", enriched.clone()),
                    ("KUBECONFIG", testkit::kubeconfig_path().display().to_string()),
                ],
            )
            .unwrap(),
        ];
        let group = testkit::unique_name("classifier");
        for _ in 0..classifiers {
            let mut env = vec![
                kafka.clone(),
                ("GPUMEDIC_GROUP", group.clone()),
                ("GPUMEDIC_DATABASE_URL", url.clone()),
                ("GPUMEDIC_RULES_DIR", rules.display().to_string()),
                ("GPUMEDIC_ENRICHED_TOPIC", enriched.clone()),
                ("GPUMEDIC_VERDICTS_TOPIC", verdicts.clone()),
                ("GPUMEDIC_ACTIONS_TOPIC", actions.clone()),
                ("GPUMEDIC_TICK", "500ms".into()),
            ];
            env.extend(classifier_env.iter().cloned());
            services.push(ServiceProcess::start(&bin("gpumedic-classifier"), &[], &env).unwrap());
        }
        services.push(
            ServiceProcess::start(
                &bin("gpumedic-remediator"),
                &[],
                &[
                    kafka,
                    ("GPUMEDIC_GROUP", testkit::unique_name("remediator")),
                    ("GPUMEDIC_VERDICTS_TOPIC", verdicts.clone()),
                    ("GPUMEDIC_ACTIONS_TOPIC", actions),
                    ("KUBECONFIG", testkit::kubeconfig_path().display().to_string()),
                    ("GPUMEDIC_LEASE_NAMESPACE", ns.clone()),
                    ("GPUMEDIC_MODE", "cordon-drain".into()),
                    ("GPUMEDIC_GPU_NODE_SELECTOR", format!("gpumedic.io/e2e={ns}")),
                    ("GPUMEDIC_BREAKER_MAX_SHARE", "1.0".into()),
                    ("GPUMEDIC_DRAIN_GRACE_SECONDS", "0".into()),
                    ("GPUMEDIC_DRAIN_DEADLINE", "30s".into()),
                    ("GPUMEDIC_MAINTENANCE_CHECK", "1s".into()),
                ],
            )
            .unwrap(),
        );
        for s in &mut services {
            s.wait_ready(Duration::from_secs(120)).await.unwrap_or_else(|e| panic!("{e}"));
        }
        Pipeline {
            client,
            ns,
            raw,
            verdicts,
            pool: gpumedic_runtime::postgres::connect(&url, 2).await.unwrap(),
            producer: settings.producer("decisions-e2e").unwrap(),
            codec: settings.codec().await.unwrap(),
            services,
        }
    }

    /// A GPU node of this test's fleet with `gpus` GPUs.
    async fn node(&self, gpus: u32) -> String {
        let name = testkit::unique_name("decisions-gpu");
        testkit::NodeBuilder::new(&name)
            .label("gpumedic.io/e2e", &self.ns)
            .capacity("nvidia.com/gpu", gpus.to_string())
            .allocatable("nvidia.com/gpu", gpus.to_string())
            .create(&self.client)
            .await;
        name
    }

    async fn get(&self, node: &str) -> Node {
        Api::<Node>::all(self.client.clone()).get(node).await.expect("node")
    }

    /// Writes `event` to this test's raw topic, as the collector does.
    async fn emit(&self, event: &HealthEvent) {
        let bytes = self.codec.encode(event).unwrap();
        let id = event.event_id.to_string();
        let envelope = Envelope {
            topic: &self.raw,
            key: &event.node,
            id: &id,
            content_type: HealthEvent::CONTENT_TYPE,
            incoming_trace: None,
        };
        kafka::publish_record(&self.producer, envelope, &bytes).await.expect("published");
    }

    /// Every verdict on this test's verdict topic, read until it has been quiet for a few seconds.
    async fn all_verdicts(&self) -> Vec<Verdict> {
        let consumer: StreamConsumer = rdkafka::ClientConfig::new()
            .set("bootstrap.servers", testkit::kafka_bootstrap())
            .set("group.id", testkit::unique_name("reader"))
            .set("auto.offset.reset", "earliest")
            .set("enable.auto.commit", "false")
            .create()
            .unwrap();
        consumer.subscribe(&[&self.verdicts]).unwrap();
        let mut all = Vec::new();
        while let Ok(Ok(m)) = tokio::time::timeout(Duration::from_secs(5), consumer.recv()).await {
            let r = Record::from_message(&m);
            all.push(gpumedic_schemas::decode(r.payload.as_deref().unwrap()).unwrap());
        }
        all
    }

    async fn stop(mut self, nodes: &[String]) {
        for s in &mut self.services {
            let status = s.terminate(Duration::from_secs(20)).await.unwrap_or_else(|e| panic!("{e}"));
            assert!(status.success(), "a service exited with {status}");
        }
        self.pool.close().await;
        let api: Api<Node> = Api::all(self.client.clone());
        for n in nodes {
            api.delete(n, &DeleteParams::default()).await.ok();
        }
        Api::<Namespace>::all(self.client.clone()).delete(&self.ns, &DeleteParams::default()).await.ok();
    }
}

fn uuid_of(node: &str, gpu: u32) -> String {
    let u = uuid::Uuid::new_v5(&uuid::Uuid::NAMESPACE_DNS, format!("{node}/{gpu}").as_bytes());
    format!("GPU-{u}")
}

fn pci_of(gpu: u32) -> String {
    format!("0000:{:02x}:00.0", 0x18 + gpu * 0x10)
}

/// An event from the node's kernel log as the collector emits it: the GPU named by PCI bus id and
/// resolved to its UUID and index.
fn kernel_log(node: &str, gpu: u32, detail: Detail, raw: String) -> HealthEvent {
    let entity = Entity {
        gpu_uuid: Some(uuid_of(node, gpu)),
        pci_bus_id: Some(pci_of(gpu)),
        gpu_index: Some(gpu as i32),
        ..Entity::default()
    };
    let mut e = HealthEvent::new(node, Source::KernelLog, Component::Gpu, entity, detail);
    e.raw = Some(raw);
    e.boot_id = Some(uuid::Uuid::new_v5(&uuid::Uuid::NAMESPACE_DNS, node.as_bytes()).to_string());
    e
}

#[tokio::test]
async fn a_job_crash_across_sixteen_nodes_is_one_workload_fault_and_a_fatal_sxid_still_cordons() {
    let p = Pipeline::start(2, &[]).await;
    const NODES: usize = 16;
    const GPUS: u32 = 8;
    let mut nodes = Vec::new();
    for _ in 0..NODES {
        nodes.push(p.node(GPUS).await);
    }
    // The job: one pod of eight GPUs per node, all controlled by one Job.
    let pods: Api<Pod> = Api::namespaced(p.client.clone(), &p.ns);
    for (i, node) in nodes.iter().enumerate() {
        let uuids: Vec<String> = (0..GPUS).map(|g| uuid_of(node, g)).collect();
        let pod = json!({ "metadata": { "name": format!("train-worker-{i}"),
                "annotations": { "gpumedic.io/gpu-uuids": uuids.join(",") },
                "ownerReferences": [{ "apiVersion": "batch/v1", "kind": "Job", "name": "train",
                    "uid": "6a1f1e6e-0000-4000-8000-000000000001", "controller": true }] },
            "spec": { "nodeName": node, "containers": [{ "name": "c", "image": "x",
                "resources": { "limits": { "nvidia.com/gpu": GPUS.to_string() } } }] } });
        pods.create(&PostParams::default(), &serde_json::from_value(pod).unwrap()).await.expect("pod");
    }
    // The enricher learns of the pods from its watch; give it a moment before the crash.
    tokio::time::sleep(Duration::from_secs(3)).await;

    // The crash: on every GPU the driver logs one Xid 13 exception as three lines, same instant.
    let lines = [
        "Graphics SM Warp Exception on (GPC 0, TPC 1, SM 0): Out Of Range Address",
        "Graphics SM Global Exception on (GPC 0, TPC 1, SM 0): Multiple Warp Errors",
        "Graphics Exception: ESR 0x505648=0x102000e 0x505650=0x0 0x505644=0xd3eff2 0x50564c=0x17f",
    ];
    let mut xid_events = Vec::new();
    for node in &nodes {
        for gpu in 0..GPUS {
            let pid = 4000 + gpu as i32;
            let mut first: Option<HealthEvent> = None;
            for text in lines {
                let raw = format!("NVRM: Xid (PCI:{}): 13, pid={pid}, name=python3, {text}", pci_of(gpu));
                let detail = Detail::Xid(XidDetail {
                    code: 13,
                    text: text.into(),
                    pid: Some(pid),
                    process: Some("python3".into()),
                    nvlink5: None,
                    recovery_action: None,
                });
                let mut e = kernel_log(node, gpu, detail, raw);
                if let Some(f) = &first {
                    e.observed_at = f.observed_at;
                }
                first.get_or_insert_with(|| e.clone());
                xid_events.push(e);
            }
        }
    }
    for e in &xid_events {
        p.emit(e).await;
    }

    // Every event recorded, then the fault: one record, all sixteen nodes, every GPU.
    let recorded = async || -> i64 {
        sqlx::query_scalar("SELECT count(*) FROM health_events WHERE kind = 'xid'")
            .fetch_one(&p.pool)
            .await
            .unwrap_or(0)
    };
    eventually("every Xid line recorded", Duration::from_secs(90), async || {
        (recorded().await == xid_events.len() as i64).then_some(())
    })
    .await;
    let workload = format!("{}/Job/train", p.ns);
    let (faults, fault_nodes, gpus): (i64, i32, i32) =
        eventually("one workload fault with all sixteen nodes", Duration::from_secs(60), async || {
            let row: (i64, Option<i32>, Option<i32>) = sqlx::query_as(
                "SELECT count(*), max(cardinality(nodes)), max(gpus) FROM workload_faults WHERE workload = $1",
            )
            .bind(&workload)
            .fetch_one(&p.pool)
            .await
            .ok()?;
            (row.1 == Some(NODES as i32)).then_some((row.0, row.1.unwrap_or(0), row.2.unwrap_or(0)))
        })
        .await;
    assert_eq!((faults, fault_nodes, gpus), (1, NODES as i32, (NODES as i32) * GPUS as i32));
    let xids: Vec<i32> = sqlx::query_scalar("SELECT unnest(xids) FROM workload_faults WHERE workload = $1")
        .bind(&workload)
        .fetch_all(&p.pool)
        .await
        .unwrap();
    assert_eq!(xids, vec![13]);

    // Each GPU's own rules: info, no action; a single exception is not "repeated".
    let (all, not_info, acting): (i64, i64, i64) = sqlx::query_as(
        "SELECT count(*), count(*) FILTER (WHERE severity <> 'info'), count(*) FILTER (WHERE action <> 'none')
           FROM verdicts WHERE node = ANY($1)",
    )
    .bind(&nodes)
    .fetch_one(&p.pool)
    .await
    .unwrap();
    assert!(all >= (NODES as i64) * i64::from(GPUS), "each GPU's own verdict ({all})");
    assert_eq!((not_info, acting), (0, 0), "no GPU verdict is more than info or asks for anything");

    // On the verdict topic: exactly one workload fault verdict, naming the job, asking for nothing.
    let verdicts = p.all_verdicts().await;
    let workload_verdicts: Vec<&Verdict> = verdicts.iter().filter(|v| v.workload.is_some()).collect();
    assert_eq!(workload_verdicts.len(), 1, "{workload_verdicts:#?}");
    let v = workload_verdicts[0];
    assert_eq!(v.workload.as_deref(), Some(workload.as_str()));
    assert_eq!(v.rule_id, "workload-fault");
    assert_eq!(v.action, gpumedic_schemas::RecommendedAction::None);
    assert!(verdicts.iter().all(|v| v.action == gpumedic_schemas::RecommendedAction::None), "no node action anywhere");
    for node in &nodes {
        let n = p.get(node).await;
        assert!(!cordoned(&n) && !marked(&n), "{node} left alone");
    }

    // A fatal SXid on one of those nodes: the baseboard needs a reset; the node leaves service.
    let fatal = &nodes[0];
    let detail =
        Detail::Sxid(SxidDetail { code: 20034, text: "LTSSM Fault Up".into(), fatal: Some(true), link: Some(30) });
    let mut sxid = HealthEvent::new(
        fatal,
        Source::KernelLog,
        Component::Nvswitch,
        Entity { nvswitch_id: Some("0000:c5:00.0".into()), ..Entity::default() },
        detail,
    );
    sxid.raw = Some("nvidia-nvswitch0: SXid (PCI:0000:c5:00.0): 20034, Fatal, Link 30 LTSSM Fault Up".into());
    sxid.boot_id = xid_events[0].boot_id.clone();
    p.emit(&sxid).await;
    eventually("the node with the fatal SXid cordoned and drained", Duration::from_secs(60), async || {
        let n = p.get(fatal).await;
        let left = pods.list(&ListParams::default().fields(&format!("spec.nodeName={fatal}"))).await.ok()?;
        (cordoned(&n) && left.items.is_empty()).then_some(())
    })
    .await;
    for node in &nodes[1..] {
        assert!(!cordoned(&p.get(node).await), "only the SXid's node");
    }
    p.stop(&nodes).await;
}

#[tokio::test]
async fn a_maintenance_notice_drains_its_node_shortly_before_the_window_not_on_arrival() {
    // The default lead is an hour; shortened so a window two minutes out is acted on in a test.
    let lead = Duration::from_secs(90);
    let p = Pipeline::start(1, &[("GPUMEDIC_MAINTENANCE_LEAD", format!("{}s", lead.as_secs()))]).await;
    let later = p.node(8).await;
    let soon = p.node(8).await;
    let notice = |node: &str, starts: chrono::DateTime<chrono::Utc>| {
        let detail = Detail::CloudMaintenance(CloudMaintenanceDetail {
            provider: CloudProvider::Aws,
            event_type: "instance-reboot".into(),
            provider_event_id: Some(format!("instance-event-{node}")),
            window_start: Some(starts),
            window_end: Some(starts + chrono::Duration::hours(2)),
            description: Some("scheduled reboot".into()),
        });
        HealthEvent::new(node, Source::Cloud, Component::Node, Entity::default(), detail)
    };
    let now = chrono::Utc::now();
    let in_two_days = now + chrono::Duration::days(2);
    let in_two_minutes = now + chrono::Duration::minutes(2);
    p.emit(&notice(&later, in_two_days)).await;
    p.emit(&notice(&soon, in_two_minutes)).await;

    // Both verdicts carry their not_before: the window's start less the lead.
    let verdicts: Vec<Verdict> = eventually("both maintenance verdicts", Duration::from_secs(60), async || {
        let v: Vec<Verdict> =
            p.all_verdicts().await.into_iter().filter(|v| v.rule_id == "cloud-maintenance" && !v.recovery).collect();
        (v.len() == 2).then_some(v)
    })
    .await;
    let lead = chrono::Duration::from_std(lead).unwrap();
    for v in verdicts {
        let starts = if v.node == later { in_two_days } else { in_two_minutes };
        let expected = starts - lead;
        let got = v.not_before.expect("a not_before");
        assert!((got - expected).num_milliseconds().abs() < 1000, "{}: not_before {got}, expected {expected}", v.node);
    }

    // Not on arrival: both serve until their time.
    tokio::time::sleep(Duration::from_secs(5)).await;
    assert!(!cordoned(&p.get(&later).await) && !cordoned(&p.get(&soon).await), "nothing on arrival");
    let drained_at = eventually("the node whose window is near to be drained", Duration::from_secs(120), async || {
        cordoned(&p.get(&soon).await).then(chrono::Utc::now)
    })
    .await;
    assert!(drained_at >= in_two_minutes - lead, "not before its not_before");
    assert!(drained_at < in_two_minutes, "before the window opens");
    assert!(!cordoned(&p.get(&later).await), "the window two days out leaves its node serving");
    p.stop(&[later, soon]).await;
}

#[tokio::test]
async fn one_gpu_named_by_pci_in_the_kernel_log_and_by_uuid_in_nvml_is_one_incident_cleared_after_its_reset() {
    // Quiet periods capped so the release fits in a test; the proofs and the Xid burst still hold.
    let p = Pipeline::start(1, &[("GPUMEDIC_MAX_QUIET", "5s".into())]).await;
    let node = p.node(8).await;
    let boot = uuid::Uuid::new_v5(&uuid::Uuid::NAMESPACE_DNS, node.as_bytes()).to_string();
    let nvml = |gpu: Option<u32>, detail: Detail, healthy: bool| {
        let entity = match gpu {
            Some(g) => Entity {
                gpu_uuid: Some(uuid_of(&node, g)),
                pci_bus_id: Some(format!("0000{}", pci_of(g).to_uppercase())),
                gpu_index: Some(g as i32),
                ..Entity::default()
            },
            None => Entity::default(),
        };
        let component = if gpu.is_some() { Component::Gpu } else { Component::Node };
        let mut e = HealthEvent::new(&node, Source::Nvml, component, entity, detail);
        e.healthy = healthy;
        e.boot_id = Some(boot.clone());
        e
    };
    // The inventory as NVML writes PCI ids (eight-digit domain, upper case).
    let gpus = (0..8u32)
        .map(|g| GpuIdentity {
            index: Some(g as i32),
            uuid: Some(uuid_of(&node, g)),
            pci_bus_id: Some(format!("0000{}", pci_of(g).to_uppercase())),
            serial: Some(format!("1650000{g:03}")),
            product: Some("NVIDIA H100 80GB HBM3".into()),
            nvlink_domain: None,
        })
        .collect();
    let inventory = GpuInventoryDetail { gpus, reason: GpuInventoryDetail::START.into(), expected: Some(8) };
    p.emit(&nvml(None, Detail::GpuInventory(inventory), true)).await;
    let beat = |g: u32| {
        let ok = MonitorHealthDetail { monitor: "nvml".into(), state: MonitorState::Ok, message: None };
        nvml(Some(g), Detail::MonitorHealth(ok), true)
    };
    for g in 0..8 {
        p.emit(&beat(g)).await;
    }
    tokio::time::sleep(Duration::from_secs(2)).await;

    // GPU 2: Xid 48 in the kernel log, which names it by PCI bus id only...
    let mut xid48 = kernel_log(
        &node,
        2,
        Detail::Xid(XidDetail {
            code: 48,
            text: "An uncorrectable double bit error (DBE) has been detected on GPU in the framebuffer".into(),
            pid: None,
            process: None,
            nvlink5: None,
            recovery_action: None,
        }),
        format!("NVRM: Xid (PCI:{}): 48, pid=<unknown>, name=<unknown>, An uncorrectable double bit error", pci_of(2)),
    );
    xid48.entity = Entity { pci_bus_id: Some(pci_of(2)), ..Entity::default() };
    p.emit(&xid48).await;
    // ...and, two seconds later, NVML's volatile double-bit counter of the same GPU, by UUID.
    tokio::time::sleep(Duration::from_secs(2)).await;
    let ecc = |volatile: i64| {
        Detail::Ecc(EccDetail {
            single_bit_volatile: Some(0),
            double_bit_volatile: Some(volatile),
            single_bit_aggregate: Some(0),
            double_bit_aggregate: Some(1),
            location: Some("dram".into()),
        })
    };
    p.emit(&nvml(Some(2), ecc(1), false)).await;
    let xid_recorded_uuid: Option<String> =
        eventually("the Xid 48 recorded with the GPU's UUID", Duration::from_secs(60), async || {
            sqlx::query_scalar("SELECT gpu_uuid FROM health_events WHERE event_id = $1")
                .bind(xid48.event_id)
                .fetch_optional(&p.pool)
                .await
                .ok()
                .flatten()
        })
        .await;
    assert_eq!(xid_recorded_uuid, Some(uuid_of(&node, 2)), "the enricher resolved the PCI bus id");

    // The Xid's burst closes three minutes after it (NVIDIA's gap); by then both sources have had
    // their say. One incident, on GPU 2 by UUID; the GPU leaves service.
    let incidents = async || -> Vec<(uuid::Uuid, String, Option<String>, bool)> {
        sqlx::query_as(
            "SELECT incident_id, rule_id, gpu_uuid, resolved_at IS NOT NULL FROM incidents
              WHERE node = $1 AND severity <> 'info'",
        )
        .bind(&node)
        .fetch_all(&p.pool)
        .await
        .unwrap()
    };
    eventually("an incident for GPU 2", Duration::from_secs(90), async || {
        (!incidents().await.is_empty()).then_some(())
    })
    .await;
    tokio::time::sleep_until(tokio::time::Instant::now() + Duration::from_secs(3 * 60 + 15)).await;
    let open = incidents().await;
    assert_eq!(open.len(), 1, "one fault seen by two sources is one incident: {open:?}");
    let (incident, rule, gpu, resolved) = open[0].clone();
    assert_eq!(gpu, Some(uuid_of(&node, 2)), "{rule}");
    assert!(!resolved, "GPU 2's own heartbeats without a reset prove nothing");
    assert!(cordoned(&p.get(&node).await), "the node is cordoned for the GPU's reset");

    // The reset: the volatile counter starts again from 0, and GPU 2 answers. Released once.
    p.emit(&nvml(Some(2), ecc(0), true)).await;
    for _ in 0..10 {
        p.emit(&beat(2)).await;
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
    eventually("the incident resolved after the reset", Duration::from_secs(90), async || {
        incidents().await.iter().all(|i| i.3).then_some(())
    })
    .await;
    let recoveries: i64 = sqlx::query_scalar("SELECT count(*) FROM verdicts WHERE incident_id = $1 AND recovery")
        .bind(incident)
        .fetch_one(&p.pool)
        .await
        .unwrap();
    assert_eq!(recoveries, 1);
    eventually("the node back in service", Duration::from_secs(60), async || {
        (!cordoned(&p.get(&node).await)).then_some(())
    })
    .await;
    p.stop(&[node]).await;
}
