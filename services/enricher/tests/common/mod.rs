//! What the enricher's tests against the testbed share: the shared raw and enriched topics or
//! topics of a test's own, an enricher process started on them, a namespace with Nodes, GPU Pods
//! and the collector's ServiceAccount, Pod-bound tokens minted as the kubelet mints the
//! collector's, the enriched record of an event, and dead-letter reasons.

#![allow(dead_code)] // Each test file uses its own part of this.

use std::time::Duration;

use gpumedic_runtime::kafka::{self, KafkaSettings, Record, dlq_headers};
use gpumedic_schemas::{EnrichedHealthEvent, HealthEvent, topics};
use gpumedic_testkit as testkit;
use k8s_openapi::api::authentication::v1::TokenRequest;
use k8s_openapi::api::core::v1::{Namespace, Node, Pod, ServiceAccount};
use kube::api::{Api, DeleteParams, PostParams};
use serde_json::json;

pub const BIN: &str = env!("CARGO_BIN_EXE_gpumedic-enricher");
pub const COLLECTOR_SA: &str = "gpumedic-collector";

/// Settings for the testbed's Kafka, with the shared raw and enriched topics (and the raw topic's
/// dead-letter topic) created when missing.
pub async fn shared_topics() -> KafkaSettings {
    let bootstrap = testkit::require_kafka().await.unwrap_or_else(|e| panic!("{e}"));
    let settings = KafkaSettings { bootstrap, options: vec![], schema_registry: None, topic_replication: None };
    settings
        .ensure_topics(&kafka::stage_topics(&[topics::HEALTH_RAW], &[topics::HEALTH_ENRICHED], 12))
        .await
        .expect("topics");
    settings
}

/// Starts the enricher with the Kafka of `settings` and the testbed's kubeconfig, then `env`
/// (which wins over both), and waits until it is ready.
pub async fn start_enricher(settings: &KafkaSettings, env: &[(&str, String)]) -> testkit::ServiceProcess {
    let mut all = vec![
        ("GPUMEDIC_KAFKA_BOOTSTRAP", settings.bootstrap.clone()),
        ("KUBECONFIG", testkit::kubeconfig_path().display().to_string()),
    ];
    all.extend(env.iter().cloned());
    let mut enricher = testkit::ServiceProcess::start(BIN, &[], &all).expect("enricher starts");
    enricher.wait_ready(Duration::from_secs(60)).await.unwrap_or_else(|e| panic!("{e}"));
    enricher
}

/// Starts an enricher on the shared topics ([`shared_topics`]) in a new group named after
/// `group`, committed at the end of the raw topic: not behind every record earlier runs left
/// there. `env` as for [`start_enricher`].
pub async fn shared_topic_enricher(
    settings: &KafkaSettings,
    group: &str,
    env: &[(&str, String)],
) -> testkit::ServiceProcess {
    let group = testkit::group_at_end(group, &[topics::HEALTH_RAW]).await.expect("group");
    let mut all = vec![("GPUMEDIC_GROUP", group)];
    all.extend(env.iter().cloned());
    start_enricher(settings, &all).await
}

/// The record of `event` on the shared enriched topic, found by its event id (a node's records
/// share its key), and the enriched event it carries.
pub async fn enriched_of(event: &HealthEvent) -> (Record, EnrichedHealthEvent) {
    let out = testkit::wait_for_event(topics::HEALTH_ENRICHED, event.event_id, Duration::from_secs(60))
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let enriched = gpumedic_schemas::decode(out.payload.as_deref().unwrap()).expect("decodes");
    (out, enriched)
}

/// A raw topic, its dead-letter topic and an enriched topic of this test's own, created.
pub struct Topics {
    pub settings: KafkaSettings,
    pub raw: String,
    pub dlq: String,
    pub enriched: String,
}

impl Topics {
    pub async fn create(prefix: &str) -> Topics {
        let bootstrap = testkit::require_kafka().await.unwrap_or_else(|e| panic!("{e}"));
        let (raw, enriched) =
            (testkit::unique_name(&format!("{prefix}-raw")), testkit::unique_name(&format!("{prefix}-enriched")));
        let settings = KafkaSettings { bootstrap, options: vec![], schema_registry: None, topic_replication: None };
        settings
            .ensure_topics(&kafka::stage_topics(&[&raw], &[&enriched], gpumedic_schemas::topics::DEFAULT_PARTITIONS))
            .await
            .expect("topics");
        Topics { dlq: kafka::dead_letter_topic(&raw), settings, raw, enriched }
    }

    /// Starts an enricher on these topics that enforces node authentication for `ns`'s collector
    /// ServiceAccount, with `env` besides, and waits until it is ready.
    pub async fn enforcing_enricher(&self, ns: &str, env: &[(&str, String)]) -> testkit::ServiceProcess {
        let mut all = vec![
            ("GPUMEDIC_GROUP", testkit::unique_name("nodeauth-enricher")),
            ("GPUMEDIC_RAW_TOPIC", self.raw.clone()),
            ("GPUMEDIC_ENRICHED_TOPIC", self.enriched.clone()),
            ("GPUMEDIC_NODE_AUTH", "enforce".into()),
            ("GPUMEDIC_COLLECTOR_SERVICE_ACCOUNT", format!("{ns}:{COLLECTOR_SA}")),
        ];
        all.extend(env.iter().cloned());
        start_enricher(&self.settings, &all).await
    }
}

/// Nodes and a namespace with ServiceAccounts, on the real apiserver; [`Cluster::delete`] removes
/// them.
pub struct Cluster {
    pub client: kube::Client,
    pub ns: String,
    pub nodes: Vec<String>,
}

impl Cluster {
    /// `nodes` new Nodes named after `prefix`, a namespace, and `service_accounts` in it.
    pub async fn create(prefix: &str, nodes: usize, service_accounts: &[&str]) -> Cluster {
        let builders = (0..nodes).map(|i| testkit::NodeBuilder::new(testkit::unique_name(&format!("{prefix}-{i}"))));
        Cluster::with_nodes(prefix, builders, service_accounts).await
    }

    /// The Nodes `nodes` build, a namespace named after `prefix`, and `service_accounts` in it.
    pub async fn with_nodes(
        prefix: &str,
        nodes: impl IntoIterator<Item = testkit::NodeBuilder>,
        service_accounts: &[&str],
    ) -> Cluster {
        let client = testkit::require_kubernetes().await.unwrap_or_else(|e| panic!("{e}"));
        let mut names = Vec::new();
        for node in nodes {
            names.push(node.create(&client).await.metadata.name.expect("a named node"));
        }
        let ns = testkit::unique_name(prefix);
        Api::<Namespace>::all(client.clone())
            .create(&PostParams::default(), &serde_json::from_value(json!({ "metadata": { "name": ns } })).unwrap())
            .await
            .expect("namespace");
        let sas: Api<ServiceAccount> = Api::namespaced(client.clone(), &ns);
        for sa in service_accounts {
            sas.create(&PostParams::default(), &serde_json::from_value(json!({ "metadata": { "name": sa } })).unwrap())
                .await
                .expect("service account");
        }
        Cluster { client, ns, nodes: names }
    }

    /// A Pod named `name` of ServiceAccount `sa`, bound to `node` (no kubelet runs it).
    pub async fn create_pod(&self, name: &str, node: &str, sa: &str) -> Pod {
        Api::<Pod>::namespaced(self.client.clone(), &self.ns)
            .create(
                &PostParams::default(),
                &serde_json::from_value(json!({ "metadata": { "name": name }, "spec": { "nodeName": node,
                    "serviceAccountName": sa, "automountServiceAccountToken": false,
                    "containers": [{ "name": "c", "image": "x" }] } }))
                .unwrap(),
            )
            .await
            .expect("pod")
    }

    /// A Pod named `name` with `annotations`, bound to `node` and asking for `gpus` GPUs (no
    /// kubelet runs it).
    pub async fn create_gpu_pod(&self, name: &str, node: &str, gpus: &str, annotations: serde_json::Value) -> Pod {
        Api::<Pod>::namespaced(self.client.clone(), &self.ns)
            .create(
                &PostParams::default(),
                &serde_json::from_value(json!({ "metadata": { "name": name, "annotations": annotations },
                    "spec": { "nodeName": node, "containers": [{ "name": "c", "image": "x",
                        "resources": { "limits": { "nvidia.com/gpu": gpus } } }] } }))
                .unwrap(),
            )
            .await
            .expect("pod")
    }

    /// A token of `sa` bound to `pod` (audience gpumedic, an hour), as the kubelet projects it.
    pub async fn pod_token(&self, sa: &str, pod: &Pod) -> String {
        let request: TokenRequest = serde_json::from_value(json!({ "spec": {
            "audiences": ["gpumedic"], "expirationSeconds": 3600,
            "boundObjectRef": { "kind": "Pod", "apiVersion": "v1", "name": pod.metadata.name, "uid": pod.metadata.uid } } }))
        .unwrap();
        let answer = Api::<ServiceAccount>::namespaced(self.client.clone(), &self.ns)
            .create_token_request(sa, &PostParams::default(), &request)
            .await
            .expect("token request");
        answer.status.and_then(|s| s.token).expect("a token")
    }

    /// The token of a collector Pod on `node`.
    pub async fn collector_token(&self, node: &str) -> String {
        let pod = self.create_pod(&format!("collector-{node}"), node, COLLECTOR_SA).await;
        self.pod_token(COLLECTOR_SA, &pod).await
    }

    /// A token of the right shape signed by nothing, claiming the collector's ServiceAccount for
    /// an hour.
    pub fn forged_token(&self) -> String {
        use base64::Engine as _;
        let b64 = |s: String| base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(s);
        let exp = chrono::Utc::now().timestamp() + 3600;
        format!(
            "{}.{}.c2lnbmF0dXJl",
            b64(r#"{"alg":"RS256","kid":"forged"}"#.into()),
            b64(format!(
                r#"{{"aud":["gpumedic"],"exp":{exp},"sub":"system:serviceaccount:{}:{COLLECTOR_SA}"}}"#,
                self.ns
            ))
        )
    }

    /// Deletes the nodes and the namespace.
    pub async fn delete(self) {
        for n in &self.nodes {
            Api::<Node>::all(self.client.clone()).delete(n, &DeleteParams::default()).await.unwrap();
        }
        Api::<Namespace>::all(self.client.clone()).delete(&self.ns, &DeleteParams::default()).await.unwrap();
    }
}

/// The record keyed `key` on the shared raw topic's dead-letter topic, which the enricher
/// dead-lettered.
pub async fn shared_dead_letter(key: &str) -> Record {
    testkit::wait_for_record(
        &kafka::dead_letter_topic(topics::HEALTH_RAW),
        |r| r.key.as_deref() == Some(key.as_bytes()),
        Duration::from_secs(60),
    )
    .await
    .unwrap_or_else(|e| panic!("{e}"))
}

/// The dead-letter reason of `event`'s record, which the enricher dead-lettered.
pub async fn dead_letter_reason(dlq: &str, event: &HealthEvent) -> String {
    let id = event.event_id.to_string();
    let dead = testkit::wait_for_event(dlq, &id, Duration::from_secs(60))
        .await
        .unwrap_or_else(|e| panic!("{} was not dead-lettered: {e}", event.node));
    assert_eq!(dead.header(dlq_headers::SERVICE), Some(&b"enricher"[..]));
    String::from_utf8_lossy(dead.header(dlq_headers::REASON).expect("reason")).into_owned()
}

/// The count of `gpumedic_enricher_records_unauthenticated_total` for `node` and `reason` in the
/// exposition `metrics` (0 when absent).
pub fn refused(metrics: &str, node: Option<&str>, reason: &str) -> f64 {
    metrics
        .lines()
        .find(|l| {
            l.starts_with("gpumedic_enricher_records_unauthenticated_total{")
                && node.is_none_or(|n| l.contains(&format!("claimed_node=\"{n}\"")))
                && l.contains(&format!("reason=\"{reason}\""))
        })
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
        .unwrap_or(0.0)
}
