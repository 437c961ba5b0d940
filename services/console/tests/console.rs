//! The console against the testbed's real servers: Nodes it watches in the apiserver, history
//! rows in PostgreSQL and verdicts on Kafka come back on its pages and its API, a verdict
//! published while a page listens arrives as a Server-Sent Event, and with `--api-auth
//! kubernetes` only a token RBAC allows gets in.

mod support;

use std::time::Duration;

use gpumedic_testkit::http_get;
use k8s_openapi::api::authentication::v1::{TokenRequest, TokenRequestSpec};
use k8s_openapi::api::core::v1::ServiceAccount;
use k8s_openapi::api::rbac::v1::{ClusterRole, ClusterRoleBinding};
use kube::api::{Api, DeleteParams, PostParams};
use serde_json::{Value, json};
use tokio::io::{AsyncBufReadExt as _, AsyncWriteExt as _, BufReader};

async fn get_json(addr: std::net::SocketAddr, path: &str) -> Value {
    let (code, body) = http_get(addr, path).await.expect("the console answers");
    assert_eq!(code, 200, "GET {path}: {body}");
    serde_json::from_str(&body).unwrap_or_else(|e| panic!("GET {path} is not JSON ({e}): {body}"))
}

async fn get_html(addr: std::net::SocketAddr, path: &str) -> String {
    let (code, body) = http_get(addr, path).await.expect("the console answers");
    assert_eq!(code, 200, "GET {path}: {body}");
    assert!(body.starts_with("<!doctype html>"), "GET {path} is not a page: {body}");
    body
}

fn names(list: &Value) -> Vec<String> {
    list["items"].as_array().expect("items").iter().map(|n| n["name"].as_str().unwrap_or("").to_owned()).collect()
}

#[tokio::test(flavor = "multi_thread")]
async fn pages_and_api_show_the_fleet_the_history_and_live_verdicts() {
    let fleet = support::fleet().await;
    let console = fleet.console("none").await;
    let addr = console.admin_addr();

    // The fleet: 24 GPUs, the quarantined node's 8 out of service, the breaker open.
    let f = get_json(addr, "/api/v1/fleet").await;
    assert_eq!(f["gpus"]["total"], 24, "{f}");
    assert_eq!(f["gpus"]["out_of_service"], 8, "{f}");
    let ratio = f["gpus"]["in_service_ratio"].as_f64().expect("ratio");
    assert!((ratio - 16.0 / 24.0).abs() < 1e-9, "{f}");
    assert_eq!(f["nodes_by_state"]["quarantined"], 1, "{f}");
    assert_eq!(f["nodes_by_state"]["healthy"], 2, "{f}");
    assert_eq!(f["out_of_service"][0]["name"], fleet.quarantined.as_str(), "{f}");
    assert_eq!(f["remediator"]["breaker_open"], true, "{f}");
    let commands = f["remediator"]["commands"].to_string();
    assert!(commands.contains(&format!("gpumedic breaker reset -n {}", fleet.namespace)), "{commands}");
    assert_eq!(f["last_hour"]["verdicts_by_severity"]["critical"], 1, "{f}");
    assert_eq!(f["last_hour"]["actions_by_outcome"]["cordon:succeeded"], 1, "{f}");

    // The gauge, once the first round of the fleet gauges ran.
    let mut metric = String::new();
    for _ in 0..50 {
        let (_, text) = http_get(addr, "/metrics").await.expect("metrics");
        if let Some(line) = text.lines().find(|l| l.starts_with("gpumedic_console_fleet_gpu_in_service_ratio ")) {
            metric = line.to_owned();
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let value: f64 = metric.rsplit(' ').next().and_then(|v| v.parse().ok()).unwrap_or_else(|| panic!("{metric:?}"));
    assert!((value - 16.0 / 24.0).abs() < 1e-6, "{metric}");

    // The node list: filters and cursor pagination.
    let all = get_json(addr, "/api/v1/nodes").await;
    assert_eq!(names(&all), [fleet.healthy.as_str(), fleet.quarantined.as_str(), fleet.other.as_str()]);
    assert_eq!(all["items"][1]["open_incidents"]["count"], 1, "{all}");
    assert_eq!(names(&get_json(addr, "/api/v1/nodes?state=quarantined").await), [fleet.quarantined.as_str()]);
    assert_eq!(names(&get_json(addr, "/api/v1/nodes?zone=zone-b").await), [fleet.other.as_str()]);
    assert_eq!(
        names(&get_json(addr, "/api/v1/nodes?rule=xid-79-fallen-off-the-bus").await),
        [fleet.quarantined.as_str()]
    );
    assert_eq!(names(&get_json(addr, &format!("/api/v1/nodes?q={}-GPU-2", fleet.run)).await), [fleet.other.as_str()]);
    let mut seen = Vec::new();
    let mut path = "/api/v1/nodes?limit=2".to_owned();
    loop {
        let page = get_json(addr, &path).await;
        assert_eq!(page["matched"], 3);
        seen.extend(names(&page));
        match page["next_cursor"].as_str() {
            Some(c) => path = format!("/api/v1/nodes?limit=2&cursor={c}"),
            None => break,
        }
    }
    assert_eq!(seen, [fleet.healthy.as_str(), fleet.quarantined.as_str(), fleet.other.as_str()]);
    let (code, body) = http_get(addr, "/api/v1/nodes?cursor=not-a-cursor").await.unwrap();
    assert_eq!(code, 400, "{body}");
    assert!(body.contains("cursor"), "{body}");

    // One node: its GPUs, incident, action and Kubernetes Event.
    let n = get_json(addr, &format!("/api/v1/nodes/{}", fleet.quarantined)).await;
    assert_eq!(n["node"]["state"], "quarantined", "{n}");
    assert_eq!(n["inventory"]["gpus"][1]["pci_bus_id"], "0000:2a:00.0", "{n}");
    assert_eq!(n["open_incidents"][0]["incident_id"], fleet.incident.to_string(), "{n}");
    assert_eq!(n["actions"][0]["status"], "succeeded", "{n}");
    assert_eq!(n["events"][0]["reason"], "GpumedicQuarantined", "{n}");
    let (code, _) = http_get(addr, "/api/v1/nodes/no-such-node").await.unwrap();
    assert_eq!(code, 404);

    // Incidents: the list and one story.
    let list = get_json(addr, &format!("/api/v1/incidents?node={}&status=open", fleet.quarantined)).await;
    assert_eq!(list["items"][0]["incident_id"], fleet.incident.to_string(), "{list}");
    // Every incident of this run's database, a page at a time, newest first.
    let first = get_json(addr, "/api/v1/incidents?limit=1").await;
    assert_eq!(first["items"][0]["incident_id"], fleet.incident.to_string(), "{first}");
    let cursor = first["next_cursor"].as_str().expect("a second page");
    let second = get_json(addr, &format!("/api/v1/incidents?limit=1&cursor={cursor}")).await;
    assert_eq!(second["items"][0]["node"], fleet.healthy.as_str(), "{second}");
    assert!(second["next_cursor"].is_null(), "{second}");
    let resolved = get_json(addr, "/api/v1/incidents?status=resolved").await;
    assert_eq!(resolved["items"].as_array().map(Vec::len), Some(1), "{resolved}");
    let d = get_json(addr, &format!("/api/v1/incidents/{}", fleet.incident)).await;
    assert_eq!(d["verdicts"][0]["verdict_id"], fleet.verdict.to_string(), "{d}");
    assert_eq!(d["events"][0]["xid"], 79, "{d}");
    assert_eq!(d["actions"][0]["action"], "cordon", "{d}");

    // The pages tell the same.
    let page = get_html(addr, "/").await;
    assert!(page.contains("id=\"in-service-ratio\">66.7%"), "{page}");
    assert!(page.contains(&format!("href=\"/nodes/{}\"", fleet.quarantined)), "{page}");
    assert!(page.contains("breaker open") && page.contains("gpumedic breaker reset"), "{page}");
    let page = get_html(addr, "/nodes?state=quarantined").await;
    assert!(page.contains(&fleet.quarantined) && !page.contains(&format!(">{}<", fleet.other)), "{page}");
    let page = get_html(addr, &format!("/nodes/{}", fleet.quarantined)).await;
    assert!(page.contains(&fleet.incident.to_string()) && page.contains("GPU-3b2c"), "{page}");
    assert!(page.contains("GpumedicQuarantined"), "{page}");
    let page = get_html(addr, &format!("/incidents/{}", fleet.incident)).await;
    for part in ["story-evidence", "story-verdict", "story-action", "Xid 79"] {
        assert!(page.contains(part), "{part} missing: {page}");
    }

    // A page listening on the live stream hears a verdict published now.
    let mut stream = tokio::net::TcpStream::connect(addr).await.expect("connect");
    stream
        .write_all(format!("GET /api/v1/live HTTP/1.1\r\nHost: {addr}\r\nAccept: text/event-stream\r\n\r\n").as_bytes())
        .await
        .unwrap();
    let mut lines = BufReader::new(stream).lines();
    let opened = tokio::time::timeout(Duration::from_secs(10), async {
        while let Ok(Some(l)) = lines.next_line().await {
            if l.contains(": connected") {
                return true;
            }
        }
        false
    })
    .await;
    assert_eq!(opened, Ok(true), "the event stream did not open");
    let id = fleet.publish_verdict(&fleet.healthy, "two double-bit ECC errors in a minute").await;
    let heard = tokio::time::timeout(Duration::from_secs(20), async {
        while let Ok(Some(l)) = lines.next_line().await {
            if l.contains(&id.to_string()) {
                return Some(l);
            }
        }
        None
    })
    .await;
    let line = heard.ok().flatten().expect("the verdict arrived on the event stream within 20 s");
    assert!(line.contains(&fleet.healthy) && line.contains("double-bit"), "{line}");
    let (_, text) = http_get(addr, "/metrics").await.unwrap();
    assert!(text.lines().any(|l| l.starts_with("gpumedic_console_live_verdicts_total 1")), "{text}");
    assert!(text.lines().any(|l| l == "gpumedic_console_live_clients 1"), "{text}");
    // A page that goes is counted out at once, with no verdict needed to notice.
    drop(lines);
    let mut text = String::new();
    for _ in 0..50 {
        text = http_get(addr, "/metrics").await.unwrap().1;
        if text.lines().any(|l| l == "gpumedic_console_live_clients 0") {
            return;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    panic!("the closed stream is still counted: {text}");
}

/// The ClusterRole `name` as `k8s/base/classifier.yaml` ships it.
fn shipped_reader() -> ClusterRole {
    use serde::Deserialize as _;
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../k8s/base/classifier.yaml");
    let text = std::fs::read_to_string(&path).expect("k8s/base/classifier.yaml");
    serde_yaml::Deserializer::from_str(&text)
        .map(|d| serde_yaml::from_value::<Value>(serde_yaml::Value::deserialize(d).expect("YAML")).expect("JSON"))
        .filter(|o| o["kind"] == "ClusterRole" && o["metadata"]["name"] == "gpumedic-incident-reader")
        .map(|o| serde_json::from_value(o).expect("a ClusterRole"))
        .next()
        .expect("k8s/base/classifier.yaml ships gpumedic-incident-reader")
}

#[tokio::test(flavor = "multi_thread")]
async fn only_a_token_rbac_allows_reads_the_console() {
    let fleet = support::fleet().await;
    let client = fleet.client.clone();
    let ns = fleet.namespace.clone();
    // The shipped reader role, under a name of this run, bound to one ServiceAccount.
    let role_name = format!("{}-reader", fleet.run);
    let mut role = shipped_reader();
    role.metadata = serde_json::from_value(json!({ "name": role_name })).unwrap();
    Api::<ClusterRole>::all(client.clone()).create(&PostParams::default(), &role).await.expect("role");
    struct Gone(kube::Client, String);
    impl Drop for Gone {
        fn drop(&mut self) {
            let (c, n) = (self.0.clone(), self.1.clone());
            let _ = std::thread::spawn(move || {
                let Ok(rt) = tokio::runtime::Builder::new_current_thread().enable_all().build() else { return };
                rt.block_on(async {
                    let _ = Api::<ClusterRoleBinding>::all(c.clone()).delete(&n, &DeleteParams::default()).await;
                    let _ = Api::<ClusterRole>::all(c).delete(&n, &DeleteParams::default()).await;
                });
            })
            .join();
        }
    }
    let _gone = Gone(client.clone(), role_name.clone());
    let binding: ClusterRoleBinding = serde_json::from_value(json!({
        "metadata": { "name": role_name },
        "roleRef": { "apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": role_name },
        "subjects": [{ "kind": "ServiceAccount", "name": "reader", "namespace": ns }],
    }))
    .unwrap();
    Api::<ClusterRoleBinding>::all(client.clone()).create(&PostParams::default(), &binding).await.expect("binding");
    let sas: Api<ServiceAccount> = Api::namespaced(client.clone(), &ns);
    let mut tokens = Vec::new();
    for name in ["reader", "stranger"] {
        sas.create(&PostParams::default(), &serde_json::from_value(json!({ "metadata": { "name": name } })).unwrap())
            .await
            .expect("service account");
        let request = TokenRequest {
            spec: Some(TokenRequestSpec { expiration_seconds: Some(600), ..TokenRequestSpec::default() }),
            ..TokenRequest::default()
        };
        let answer = sas.create_token_request(name, &PostParams::default(), &request).await.expect("token");
        tokens.push(answer.status.and_then(|s| s.token).expect("a token"));
    }
    let console = fleet.console("kubernetes").await;
    let base = format!("http://{}", console.admin_addr());
    let http = reqwest::Client::new();
    let get = |path: &str, token: Option<&str>| {
        let mut r = http.get(format!("{base}{path}"));
        if let Some(t) = token {
            r = r.bearer_auth(t);
        }
        r.send()
    };
    for path in ["/", "/api/v1/fleet", "/api/v1/nodes", "/api/v1/live"] {
        let r = get(path, None).await.expect("answer");
        assert_eq!(r.status(), 401, "{path} without a token");
        assert!(r.headers().contains_key("www-authenticate"), "{path}");
        assert_eq!(get(path, Some("garbage")).await.unwrap().status(), 401, "{path} with a garbage token");
        assert_eq!(get(path, Some(&tokens[1])).await.unwrap().status(), 403, "{path} for an unbound account");
    }
    let fleet_json: Value = get("/api/v1/fleet", Some(&tokens[0])).await.unwrap().json().await.unwrap();
    assert_eq!(fleet_json["gpus"]["total"], 24, "{fleet_json}");
    let r = get(&format!("/api/v1/incidents/{}", fleet.incident), Some(&tokens[0])).await.unwrap();
    assert_eq!(r.status(), 200);
    let r = get(&format!("/nodes/{}", fleet.quarantined), Some(&tokens[0])).await.unwrap();
    assert_eq!(r.status(), 200);
    // Probes and metrics stay open.
    assert_eq!(get("/healthz", None).await.unwrap().status(), 200);
    let metrics = get("/metrics", None).await.unwrap().text().await.unwrap();
    assert!(metrics.contains("gpumedic_console_api_auth_total"), "{metrics}");
    drop(console);
}
