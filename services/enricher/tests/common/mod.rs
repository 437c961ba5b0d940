//! What the node authentication tests share: topics of their own, a namespace with the
//! collector's ServiceAccount and Pods bound to nodes, Pod-bound tokens minted as the kubelet
//! mints the collector's, an enricher that enforces node authentication, and dead-letter reasons.

#![allow(dead_code)] // Each test file uses its own part of this.

use std::time::Duration;

use gpumedic_runtime::kafka::{self, KafkaSettings, dlq_headers};
use gpumedic_schemas::HealthEvent;
use gpumedic_testkit as testkit;
use k8s_openapi::api::authentication::v1::TokenRequest;
use k8s_openapi::api::core::v1::{Namespace, Node, Pod, ServiceAccount};
use kube::api::{Api, DeleteParams, PostParams};
use serde_json::json;

pub const BIN: &str = env!("CARGO_BIN_EXE_gpumedic-enricher");
pub const COLLECTOR_SA: &str = "gpumedic-collector";

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
            ("GPUMEDIC_KAFKA_BOOTSTRAP", self.settings.bootstrap.clone()),
            ("GPUMEDIC_GROUP", testkit::unique_name("nodeauth-enricher")),
            ("GPUMEDIC_RAW_TOPIC", self.raw.clone()),
            ("GPUMEDIC_ENRICHED_TOPIC", self.enriched.clone()),
            ("GPUMEDIC_NODE_AUTH", "enforce".into()),
            ("GPUMEDIC_COLLECTOR_SERVICE_ACCOUNT", format!("{ns}:{COLLECTOR_SA}")),
            ("KUBECONFIG", testkit::kubeconfig_path().display().to_string()),
        ];
        all.extend(env.iter().cloned());
        let mut enricher = testkit::ServiceProcess::start(BIN, &[], &all).expect("enricher starts");
        enricher.wait_ready(Duration::from_secs(60)).await.unwrap_or_else(|e| panic!("{e}"));
        enricher
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
        let client = testkit::require_kubernetes().await.unwrap_or_else(|e| panic!("{e}"));
        let names: Vec<String> = (0..nodes).map(|i| testkit::unique_name(&format!("{prefix}-{i}"))).collect();
        for n in &names {
            testkit::NodeBuilder::new(n).create(&client).await;
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
