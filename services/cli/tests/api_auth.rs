//! The incident API behind Kubernetes authentication, against the testbed's real apiserver
//! (`--authorization-mode RBAC`; ServiceAccount tokens signed with the testbed's own key pair and
//! minted here with the TokenRequest API).
//!
//! The classifier binary runs as a ServiceAccount bound to the ClusterRole `gpumedic-classifier`
//! of `k8s/base/classifier.yaml` (so the shipped grant is proven sufficient), reaching the
//! apiserver through a relay this test can hold. One ServiceAccount is bound to the shipped
//! `gpumedic-incident-reader`, another to nothing. No token and a garbage token are 401 with a
//! `WWW-Authenticate: Bearer` challenge; the unbound account is 403; the reader gets the list and
//! one incident; `/metrics` and the probes stay open; an apiserver that stops answering is a 503,
//! never an allow. `gpumedic incidents` sends a token from `--token-file`, `GPUMEDIC_TOKEN` or the
//! kubeconfig and says clearly what a 401 or 403 means.

use std::process::Command;
use std::time::Duration;

use gpumedic_runtime::kafka::{KafkaSettings, stage_topics};
use gpumedic_testkit::{self as testkit, ServiceProcess};
use k8s_openapi::api::authentication::v1::{TokenRequest, TokenRequestSpec};
use k8s_openapi::api::core::v1::{Namespace, ServiceAccount};
use k8s_openapi::api::rbac::v1::{ClusterRole, ClusterRoleBinding};
use kube::api::{Api, DeleteParams, PostParams};
use serde::Deserialize as _;
use serde_json::{Value, json};

const GPUMEDIC: &str = env!("CARGO_BIN_EXE_gpumedic");

fn bin(name: &str) -> String {
    testkit::workspace_binary(name).unwrap_or_else(|e| panic!("{e}")).display().to_string()
}

/// The ClusterRole `name` as `k8s/base/classifier.yaml` ships it.
fn shipped_cluster_role(name: &str) -> ClusterRole {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../k8s/base/classifier.yaml");
    let text = std::fs::read_to_string(&path).expect("k8s/base/classifier.yaml");
    serde_yaml::Deserializer::from_str(&text)
        .map(|d| serde_yaml::from_value::<Value>(serde_yaml::Value::deserialize(d).expect("YAML")).expect("JSON"))
        .filter(|o| o["kind"] == "ClusterRole" && o["metadata"]["name"] == name)
        .map(|o| serde_json::from_value(o).expect("a ClusterRole"))
        .next()
        .unwrap_or_else(|| panic!("k8s/base/classifier.yaml has no ClusterRole {name}"))
}

/// Deletes the test's cluster-scoped objects and namespace however the test ends (on a runtime of
/// its own: the test's may be the one panicking).
struct Cleanup {
    namespace: String,
    roles: Vec<String>,
}

impl Drop for Cleanup {
    fn drop(&mut self) {
        let (namespace, roles) = (self.namespace.clone(), self.roles.clone());
        let _ = std::thread::spawn(move || {
            let Ok(rt) = tokio::runtime::Builder::new_current_thread().enable_all().build() else { return };
            rt.block_on(async {
                let Ok(client) = testkit::require_kubernetes().await else { return };
                let dp = DeleteParams::default();
                for r in &roles {
                    let _ = Api::<ClusterRoleBinding>::all(client.clone()).delete(r, &dp).await;
                    let _ = Api::<ClusterRole>::all(client.clone()).delete(r, &dp).await;
                }
                let _ = Api::<Namespace>::all(client).delete(&namespace, &dp).await;
            });
        })
        .join();
    }
}

/// A GET with an optional bearer token: status, lower-cased head, body.
async fn get(addr: std::net::SocketAddr, path: &str, token: Option<&str>) -> (u16, String, String) {
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
    let mut stream = tokio::net::TcpStream::connect(addr).await.expect("connect to the admin port");
    let auth = token.map(|t| format!("Authorization: Bearer {t}\r\n")).unwrap_or_default();
    let request = format!("GET {path} HTTP/1.1\r\nHost: {addr}\r\n{auth}Connection: close\r\n\r\n");
    stream.write_all(request.as_bytes()).await.expect("send");
    let mut raw = Vec::new();
    stream.read_to_end(&mut raw).await.expect("read");
    let text = String::from_utf8_lossy(&raw).into_owned();
    let (head, body) = text.split_once("\r\n\r\n").unwrap_or((&text, ""));
    let code = head.split_whitespace().nth(1).and_then(|c| c.parse().ok()).expect("an HTTP status");
    (code, head.to_ascii_lowercase(), body.to_owned())
}

async fn token_for(accounts: &Api<ServiceAccount>, name: &str) -> String {
    let request = TokenRequest {
        // No audiences: the apiserver's own, as a pod's projected token has.
        spec: Some(TokenRequestSpec { expiration_seconds: Some(3600), ..TokenRequestSpec::default() }),
        ..TokenRequest::default()
    };
    accounts
        .create_token_request(name, &PostParams::default(), &request)
        .await
        .unwrap_or_else(|e| panic!("TokenRequest for {name}: {e}"))
        .status
        .and_then(|s| s.token)
        .expect("a token")
}

/// A kubeconfig for `server` with the testbed's CA and `token`.
fn kubeconfig(dir: &std::path::Path, name: &str, server: &str, token: &str) -> std::path::PathBuf {
    let testbed = kube::config::Kubeconfig::read_from(testkit::kubeconfig_path()).expect("testbed kubeconfig");
    let ca = testbed.clusters[0]
        .cluster
        .as_ref()
        .and_then(|c| c.certificate_authority_data.clone())
        .expect("the testbed's CA");
    let text = format!(
        "apiVersion: v1\nkind: Config\nclusters:\n- name: c\n  cluster:\n    server: {server}\n    certificate-authority-data: {ca}\nusers:\n- name: u\n  user:\n    token: {token}\ncontexts:\n- name: x\n  context:\n    cluster: c\n    user: u\ncurrent-context: x\n"
    );
    let path = dir.join(format!("{name}.kubeconfig"));
    std::fs::write(&path, text).expect("write kubeconfig");
    path
}

/// `gpumedic incidents --api <api> <args>` with only `env` for credentials: success, stdout,
/// stderr.
fn incidents(api: &str, args: &[&str], env: &[(&str, &str)]) -> (bool, String, String) {
    let mut cmd = Command::new(GPUMEDIC);
    cmd.args(["incidents", "--api", api]).args(args).env_remove("GPUMEDIC_TOKEN");
    for (k, v) in env {
        cmd.env(k, v);
    }
    let out = cmd.output().expect("gpumedic runs");
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[tokio::test(flavor = "multi_thread")]
async fn the_incident_api_wants_a_token_whose_user_rbac_lets_read_incidents() {
    let bootstrap = testkit::require_kafka().await.unwrap_or_else(|e| panic!("{e}"));
    let admin = testkit::require_postgres().await.unwrap_or_else(|e| panic!("{e}"));
    let client = testkit::require_kubernetes().await.unwrap_or_else(|e| panic!("{e}"));
    let url = testkit::fresh_database(&admin, &testkit::unique_name("apiauth").replace('-', "_")).await.expect("db");

    // Three ServiceAccounts in a namespace of the test's own.
    let ns = testkit::unique_name("apiauth");
    let mut cleanup = Cleanup { namespace: ns.clone(), roles: vec![] };
    Api::<Namespace>::all(client.clone())
        .create(&PostParams::default(), &serde_json::from_value(json!({ "metadata": { "name": ns } })).unwrap())
        .await
        .expect("namespace");
    let accounts: Api<ServiceAccount> = Api::namespaced(client.clone(), &ns);
    for sa in ["classifier", "reader", "stranger"] {
        accounts
            .create(&PostParams::default(), &serde_json::from_value(json!({ "metadata": { "name": sa } })).unwrap())
            .await
            .expect("ServiceAccount");
    }
    // The shipped ClusterRoles, under names of this test's own, bound as the base and an operator
    // would bind them. The stranger is bound to nothing.
    for (role, sa) in [("gpumedic-classifier", "classifier"), ("gpumedic-incident-reader", "reader")] {
        let mut cluster_role = shipped_cluster_role(role);
        let name = format!("{role}-{ns}");
        cluster_role.metadata.name = Some(name.clone());
        cleanup.roles.push(name.clone());
        Api::<ClusterRole>::all(client.clone()).create(&PostParams::default(), &cluster_role).await.expect("role");
        let binding = json!({ "metadata": { "name": name },
            "roleRef": { "apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": name },
            "subjects": [{ "kind": "ServiceAccount", "name": sa, "namespace": ns }] });
        Api::<ClusterRoleBinding>::all(client.clone())
            .create(&PostParams::default(), &serde_json::from_value(binding).unwrap())
            .await
            .expect("binding");
    }
    let classifier_token = token_for(&accounts, "classifier").await;
    let reader = token_for(&accounts, "reader").await;
    let stranger = token_for(&accounts, "stranger").await;

    // The classifier reaches the apiserver through a relay, as its own ServiceAccount.
    let dir = std::env::temp_dir().join(testkit::unique_name("apiauth"));
    std::fs::create_dir_all(&dir).unwrap();
    let testbed_config =
        kube::config::Kubeconfig::read_from(testkit::kubeconfig_path()).expect("the testbed's kubeconfig");
    let server = testbed_config.clusters[0].cluster.as_ref().and_then(|c| c.server.clone()).expect("server");
    let upstream = server.trim_start_matches("https://").trim_end_matches('/').to_owned();
    let relay = testkit::Relay::start(&upstream).await.expect("relay");
    let classifier_kubeconfig =
        kubeconfig(&dir, "classifier", &format!("https://127.0.0.1:{}", relay.addr().port()), &classifier_token);

    let settings =
        KafkaSettings { bootstrap: bootstrap.clone(), options: vec![], schema_registry: None, topic_replication: None };
    let topics: Vec<String> =
        ["enriched", "verdicts", "actions"].iter().map(|t| testkit::unique_name(&format!("apiauth-{t}"))).collect();
    settings.ensure_topics(&stage_topics(&[&topics[0], &topics[2]], &[&topics[1]], 1)).await.expect("topics");
    let mut classifier = ServiceProcess::start(
        &bin("gpumedic-classifier"),
        &[],
        &[
            ("GPUMEDIC_KAFKA_BOOTSTRAP", bootstrap),
            ("GPUMEDIC_GROUP", testkit::unique_name("apiauth")),
            ("GPUMEDIC_ENRICHED_TOPIC", topics[0].clone()),
            ("GPUMEDIC_VERDICTS_TOPIC", topics[1].clone()),
            ("GPUMEDIC_ACTIONS_TOPIC", topics[2].clone()),
            ("GPUMEDIC_DATABASE_URL", url.clone()),
            ("KUBECONFIG", classifier_kubeconfig.display().to_string()),
            // Longer than the test, so the cached decisions below do not depend on its pace.
            ("GPUMEDIC_API_AUTH_CACHE_TTL", "5m".into()),
        ],
    )
    .expect("starts");
    classifier.wait_ready(Duration::from_secs(60)).await.unwrap_or_else(|e| panic!("{e}"));

    // One incident to read.
    let pool = gpumedic_runtime::postgres::connect(&url, 1).await.expect("database");
    let incident = uuid::Uuid::new_v4();
    sqlx::query(
        "INSERT INTO incidents (incident_id, node, rule_id, severity, opened_at, summary)
         VALUES ($1, 'apiauth-node', 'xid-79-fallen-off-the-bus', 'critical', now(), 'GPU fell off the bus')",
    )
    .bind(incident)
    .execute(&pool)
    .await
    .expect("incident");

    let admin = classifier.admin_addr();
    let list = "/api/v1/incidents?node=apiauth-node";
    let one = format!("/api/v1/incidents/{incident}");

    // No token, and a token the apiserver does not know: 401 with a Bearer challenge.
    for (token, path) in [(None, list), (None, one.as_str()), (Some("garbage.not.a.jwt"), list)] {
        let (code, head, body) = get(admin, path, token).await;
        assert_eq!(code, 401, "{path} with {token:?}: {body}");
        assert!(head.contains("www-authenticate: bearer"), "{path}: a Bearer challenge: {head}");
    }
    // Authenticated, but RBAC grants it nothing: 403 naming the verb and the resource.
    let (code, _, body) = get(admin, list, Some(&stranger)).await;
    assert_eq!(code, 403, "{body}");
    assert!(body.contains("list") && body.contains("incidents") && body.contains(":stranger"), "{body}");
    let (code, _, body) = get(admin, &one, Some(&stranger)).await;
    assert_eq!(code, 403, "{body}");
    assert!(body.contains("cannot get"), "{body}");
    // The reader: the list and the one incident, as before authentication existed.
    let (code, _, body) = get(admin, list, Some(&reader)).await;
    assert_eq!(code, 200, "{body}");
    let incidents_listed: Vec<Value> = serde_json::from_str(&body).expect("JSON list");
    assert_eq!(incidents_listed.len(), 1, "{body}");
    assert_eq!(incidents_listed[0]["incident_id"], incident.to_string());
    let (code, _, body) = get(admin, &one, Some(&reader)).await;
    assert_eq!(code, 200, "{body}");
    assert_eq!(serde_json::from_str::<Value>(&body).expect("JSON")["incident_id"], incident.to_string());
    // Probes and metrics stay open to Prometheus and the kubelet.
    for path in ["/metrics", "/healthz", "/readyz"] {
        let (code, _, body) = get(admin, path, None).await;
        assert_eq!(code, 200, "{path} needs no token: {body}");
    }

    // The CLI: a token from a file, from GPUMEDIC_TOKEN, or from the kubeconfig.
    let api = format!("http://{admin}");
    let reader_file = dir.join("reader.token");
    std::fs::write(&reader_file, format!("{reader}\n")).unwrap();
    let testbed_kubeconfig = testkit::kubeconfig_path().display().to_string();
    let reader_file_arg = reader_file.display().to_string();
    let (ok, out, err) = incidents(
        &api,
        &["--node", "apiauth-node", "--token-file", &reader_file_arg],
        &[("KUBECONFIG", &testbed_kubeconfig)],
    );
    assert!(ok && out.contains(&incident.to_string()), "{out}{err}");
    let (ok, out, err) = incidents(
        &api,
        &["--id", &incident.to_string(), "--output", "json"],
        &[("GPUMEDIC_TOKEN", &reader), ("KUBECONFIG", &testbed_kubeconfig)],
    );
    assert!(ok && out.contains("GPU fell off the bus"), "{out}{err}");
    let reader_kubeconfig = kubeconfig(&dir, "reader", &server, &reader).display().to_string();
    let (ok, out, err) = incidents(&api, &["--node", "apiauth-node"], &[("KUBECONFIG", &reader_kubeconfig)]);
    assert!(ok && out.contains(&incident.to_string()), "the kubeconfig's token: {out}{err}");
    // The testbed's own kubeconfig authenticates with a client certificate: no token to send.
    let (ok, _, err) = incidents(&api, &["--node", "apiauth-node"], &[("KUBECONFIG", &testbed_kubeconfig)]);
    assert!(!ok);
    assert!(err.contains("401 Unauthorized") && err.contains("needs a Kubernetes bearer token"), "{err}");
    let (ok, _, err) = incidents(
        &api,
        &["--node", "apiauth-node"],
        &[("GPUMEDIC_TOKEN", "garbage"), ("KUBECONFIG", &testbed_kubeconfig)],
    );
    assert!(!ok && err.contains("401 Unauthorized") && err.contains("GPUMEDIC_TOKEN"), "{err}");
    let (ok, _, err) = incidents(
        &api,
        &["--node", "apiauth-node"],
        &[("GPUMEDIC_TOKEN", &stranger), ("KUBECONFIG", &testbed_kubeconfig)],
    );
    assert!(!ok && err.contains("403 Forbidden") && err.contains("gpumedic-incident-reader"), "{err}");

    // The apiserver stops answering: a token not decided yet is a 503, never an allow; one
    // decided moments ago is still answered from the cache.
    relay.hold(true);
    let (code, _, body) = get(admin, list, Some("another-garbage-token")).await;
    assert_eq!(code, 503, "{body}");
    let (code, _, body) = get(admin, list, Some(&reader)).await;
    assert_eq!(code, 200, "a cached decision: {body}");
    relay.hold(false);

    let status = classifier.terminate(Duration::from_secs(20)).await.unwrap_or_else(|e| panic!("{e}"));
    assert!(status.success(), "{status}");
    std::fs::remove_dir_all(&dir).ok();
    drop(cleanup);
}
