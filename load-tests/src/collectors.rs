//! The collectors' identities for a scenario run with node authentication: in a namespace of its
//! own, the collector's ServiceAccount, one Pod per simulated node (`spec.nodeName` that node; no
//! kubelet runs, so the Pods only exist in the apiserver) and one Pod-bound token per node, minted
//! with TokenRequest as the kubelet mints the collector's projected token (audience `gpumedic`,
//! one hour). `services/enricher/tests/node_auth_e2e.rs` mints its tokens the same way.

use std::collections::HashMap;
use std::time::Instant;

use anyhow::Context as _;
use futures::{StreamExt as _, TryStreamExt as _};
use gpumedic_testkit as testkit;
use k8s_openapi::api::authentication::v1::TokenRequest;
use k8s_openapi::api::core::v1::{Namespace, Pod, ServiceAccount};
use kube::api::{Api, DeleteParams, ListParams, PostParams};
use serde_json::json;

/// The collector's ServiceAccount, as in the Kustomize base.
pub(crate) const SERVICE_ACCOUNT: &str = "gpumedic-collector";
/// The audience collector tokens are minted for (the enricher reviews them with it).
const AUDIENCE: &str = "gpumedic";
/// A token's life, as the collector DaemonSet projects it.
const TOKEN_SECONDS: i64 = 3600;

/// A namespace holding the collector's ServiceAccount and one Pod per node, with each node's
/// Pod-bound token.
pub(crate) struct Collectors {
    namespace: String,
    tokens: HashMap<String, String>,
}

impl Collectors {
    /// Creates the namespace, the ServiceAccount and a Pod on each of `nodes` (`concurrency` at a
    /// time), and mints each Pod's token. On an error, what was created is deleted again.
    pub(crate) async fn create(client: &kube::Client, nodes: &[String], concurrency: usize) -> anyhow::Result<Self> {
        let started = Instant::now();
        let namespace = testkit::unique_name("bench-pipeline-auth");
        let namespaces: Api<Namespace> = Api::all(client.clone());
        namespaces
            .create(&PostParams::default(), &serde_json::from_value(json!({ "metadata": { "name": namespace } }))?)
            .await
            .context("create the collectors' namespace")?;
        let mut collectors = Self { namespace, tokens: HashMap::new() };
        match collectors.populate(client, nodes, concurrency).await {
            Ok(()) => {
                println!(
                    "  node authentication: {} collector Pods and their tokens in namespace {} ({:.1} s)",
                    nodes.len(),
                    collectors.namespace,
                    started.elapsed().as_secs_f64()
                );
                Ok(collectors)
            }
            Err(e) => {
                collectors.delete(client).await;
                Err(e)
            }
        }
    }

    async fn populate(&mut self, client: &kube::Client, nodes: &[String], concurrency: usize) -> anyhow::Result<()> {
        let sas: Api<ServiceAccount> = Api::namespaced(client.clone(), &self.namespace);
        sas.create(
            &PostParams::default(),
            &serde_json::from_value(json!({ "metadata": { "name": SERVICE_ACCOUNT } }))?,
        )
        .await
        .context("create the collector's ServiceAccount")?;
        let pods: Api<Pod> = Api::namespaced(client.clone(), &self.namespace);
        self.tokens = futures::stream::iter(nodes.iter().enumerate().map(|(i, node)| {
            let (pods, sas) = (pods.clone(), sas.clone());
            async move {
                let pod: Pod = serde_json::from_value(json!({
                    "metadata": { "name": format!("collector-{i:06}") },
                    "spec": { "nodeName": node, "serviceAccountName": SERVICE_ACCOUNT,
                        "automountServiceAccountToken": false,
                        "containers": [{ "name": "collector", "image": "gpumedic-collector" }] }
                }))?;
                let pod = pods
                    .create(&PostParams::default(), &pod)
                    .await
                    .with_context(|| format!("create the collector Pod on {node}"))?;
                let request: TokenRequest = serde_json::from_value(json!({ "spec": {
                    "audiences": [AUDIENCE], "expirationSeconds": TOKEN_SECONDS,
                    "boundObjectRef": { "kind": "Pod", "apiVersion": "v1",
                        "name": pod.metadata.name, "uid": pod.metadata.uid } } }))?;
                let answer = sas
                    .create_token_request(SERVICE_ACCOUNT, &PostParams::default(), &request)
                    .await
                    .with_context(|| format!("request the token of the collector on {node}"))?;
                let token = answer.status.and_then(|s| s.token).context("the TokenRequest answered without a token")?;
                Ok::<_, anyhow::Error>((node.clone(), token))
            }
        }))
        .buffer_unordered(concurrency)
        .try_collect()
        .await?;
        Ok(())
    }

    /// The collector ServiceAccount as the enricher's `--collector-service-account` takes it.
    pub(crate) fn service_account(&self) -> String {
        format!("{}:{SERVICE_ACCOUNT}", self.namespace)
    }

    /// The token of the collector on `node`.
    pub(crate) fn token(&self, node: &str) -> Option<&str> {
        self.tokens.get(node).map(String::as_str)
    }

    /// Deletes the Pods at once (no kubelet would confirm a graceful deletion) and then the
    /// namespace. Best effort: a benchmark's cleanup. The testbed runs no namespace controller,
    /// so the namespace itself stays `Terminating`, empty of Pods, as every test's does.
    pub(crate) async fn delete(&self, client: &kube::Client) {
        let pods: Api<Pod> = Api::namespaced(client.clone(), &self.namespace);
        let now = DeleteParams { grace_period_seconds: Some(0), ..DeleteParams::default() };
        if let Err(e) = pods.delete_collection(&now, &ListParams::default()).await {
            eprintln!("  could not delete the collector Pods of namespace {}: {e}", self.namespace);
        }
        if let Err(e) = Api::<Namespace>::all(client.clone()).delete(&self.namespace, &DeleteParams::default()).await {
            eprintln!("  could not delete namespace {}: {e}", self.namespace);
        }
    }
}
