//! What the collector's tests share: the environment of a collector process and its start, a
//! scratch folder, the first raw event of a node that a test waits for, the fault-injection
//! endpoint, a kubelet's PodResources API on a unix socket, and a configuration the collector
//! must refuse.

#![allow(dead_code)] // Each test file uses its own part of this.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use gpumedic_proto::podresources::v1::pod_resources_lister_server::{PodResourcesLister, PodResourcesListerServer};
use gpumedic_proto::podresources::v1::{
    ContainerDevices, ContainerResources, ListPodResourcesRequest, ListPodResourcesResponse, PodResources,
};
use gpumedic_schemas::{HealthEvent, topics};
use gpumedic_testkit as testkit;

pub const BIN: &str = env!("CARGO_BIN_EXE_gpumedic-collector");

/// The environment of a collector process: the Kafka it publishes to, its node, its state folder
/// (the spool allows one collector per folder), and neither a GPU backend nor the kernel log until
/// the test sets them.
#[derive(Debug, Clone)]
pub struct CollectorEnv {
    vars: Vec<(&'static str, String)>,
}

impl CollectorEnv {
    /// A collector of `node` publishing to `bootstrap`, its state in `state`.
    pub fn new(bootstrap: impl Into<String>, node: &str, state: &Path) -> Self {
        Self {
            vars: vec![
                ("GPUMEDIC_KAFKA_BOOTSTRAP", bootstrap.into()),
                ("GPUMEDIC_NODE_NAME", node.to_owned()),
                ("GPUMEDIC_STATE_DIR", state.display().to_string()),
                ("GPUMEDIC_GPU_BACKEND", "off".to_owned()),
                ("GPUMEDIC_KMSG_PATH", "off".to_owned()),
            ],
        }
    }

    /// The simulated GPU backend with `gpus` GPUs.
    pub fn simulated(self, gpus: u32) -> Self {
        self.set("GPUMEDIC_GPU_BACKEND", "simulated").set("GPUMEDIC_SIMULATED_GPUS", gpus.to_string())
    }

    /// Sets `key` to `value`, in place of what was set before.
    pub fn set(mut self, key: &'static str, value: impl Into<String>) -> Self {
        let value = value.into();
        match self.vars.iter_mut().find(|(k, _)| *k == key) {
            Some(var) => var.1 = value,
            None => self.vars.push((key, value)),
        }
        self
    }

    /// The variables, as [`testkit::ServiceProcess::start`] takes them.
    pub fn vars(&self) -> &[(&'static str, String)] {
        &self.vars
    }

    /// Starts the collector with this environment and waits until it is ready.
    pub async fn start(&self) -> testkit::ServiceProcess {
        let mut collector = testkit::ServiceProcess::start(BIN, &[], &self.vars).expect("the collector starts");
        collector.wait_ready(Duration::from_secs(60)).await.unwrap_or_else(|e| panic!("{e}"));
        collector
    }
}

/// A new folder of this test's own under the temporary directory, named after `prefix` (keep it
/// short where a unix socket goes in it: a socket's path is at most 107 bytes).
pub fn scratch(prefix: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(testkit::unique_name(prefix));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// The first event of `node` on the raw topic that `pick` accepts, within `wait`.
pub async fn first_event(node: &str, wait: Duration, pick: impl Fn(&HealthEvent) -> bool) -> HealthEvent {
    let record = testkit::wait_for_record(
        topics::HEALTH_RAW,
        |r| {
            r.key.as_deref() == Some(node.as_bytes())
                && gpumedic_schemas::decode::<HealthEvent>(r.payload.as_deref().unwrap_or_default())
                    .is_ok_and(|e| pick(&e))
        },
        wait,
    )
    .await
    .unwrap_or_else(|e| panic!("{e}"));
    gpumedic_schemas::decode(record.payload.as_deref().expect("a value")).expect("decodes")
}

/// A minimal HTTP/1.1 POST of the JSON `body` to `path` on loopback: the status code and the body.
pub async fn post(addr: SocketAddr, path: &str, body: &str) -> std::io::Result<(u16, String)> {
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
    let mut stream = tokio::net::TcpStream::connect(addr).await?;
    let request = format!(
        "POST {path} HTTP/1.1\r\nHost: {addr}\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    );
    stream.write_all(request.as_bytes()).await?;
    let mut raw = Vec::new();
    stream.read_to_end(&mut raw).await?;
    let text = String::from_utf8_lossy(&raw);
    let code = text.split_whitespace().nth(1).and_then(|c| c.parse().ok()).unwrap_or(0);
    Ok((code, text.split_once("\r\n\r\n").map(|(_, b)| b.to_owned()).unwrap_or_default()))
}

/// Posts `body` to the fault-injection endpoint on `addr` once it listens (it starts shortly after
/// /readyz answers; tried for 10 s): the status code and the answer as JSON (null when it is not).
pub async fn inject(addr: SocketAddr, body: &str) -> (u16, serde_json::Value) {
    let mut last = String::new();
    for _ in 0..100 {
        match post(addr, "/v1/inject", body).await {
            Ok((code, answer)) => return (code, serde_json::from_str(&answer).unwrap_or(serde_json::Value::Null)),
            Err(e) => last = e.to_string(),
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    panic!("the fault-injection endpoint on {addr} does not answer: {last}")
}

/// [`inject`], which must succeed: the ids of the injected events, once they are spooled or
/// published.
pub async fn inject_ids(addr: SocketAddr, body: &str) -> Vec<String> {
    let (code, answer) = inject(addr, body).await;
    assert_eq!(code, 200, "inject answered {code}: {answer}");
    answer["event_ids"].as_array().expect("ids").iter().map(|i| i.as_str().expect("an id").to_owned()).collect()
}

/// Runs the collector with a Kafka address, a node name and `args`, which it must refuse as an
/// invalid configuration (exit 64); what it wrote on stderr.
pub fn refused(args: &[&str]) -> String {
    let mut all = vec!["--kafka-bootstrap", "127.0.0.1:19092", "--node-name", "n1"];
    all.extend_from_slice(args);
    let (code, stderr) = testkit::run_with_invalid_config(BIN, &all);
    assert_eq!(code, Some(64), "{stderr}");
    stderr
}

/// One container's devices of one resource, in a kubelet's PodResources answer.
#[derive(Debug, Clone)]
pub struct PodDevices {
    pub namespace: String,
    pub pod: String,
    pub container: String,
    pub resource: String,
    pub device_ids: Vec<String>,
}

impl PodDevices {
    /// Container `container` of pod `namespace/pod` holding `device_ids` of `resource`.
    pub fn new(namespace: &str, pod: &str, container: &str, resource: &str, device_ids: &[impl AsRef<str>]) -> Self {
        Self {
            namespace: namespace.into(),
            pod: pod.into(),
            container: container.into(),
            resource: resource.into(),
            device_ids: device_ids.iter().map(|id| id.as_ref().to_owned()).collect(),
        }
    }
}

/// A kubelet's PodResources API (`v1.PodResourcesLister/List`): answers with `pods` and counts
/// the calls.
#[derive(Debug, Default)]
pub struct Kubelet {
    pub pods: Vec<PodDevices>,
    pub calls: Arc<AtomicU64>,
}

#[tonic::async_trait]
impl PodResourcesLister for Kubelet {
    async fn list(
        &self,
        _: tonic::Request<ListPodResourcesRequest>,
    ) -> Result<tonic::Response<ListPodResourcesResponse>, tonic::Status> {
        self.calls.fetch_add(1, Ordering::SeqCst);
        let pod_resources = self
            .pods
            .iter()
            .map(|p| PodResources {
                name: p.pod.clone(),
                namespace: p.namespace.clone(),
                containers: vec![ContainerResources {
                    name: p.container.clone(),
                    devices: vec![ContainerDevices {
                        resource_name: p.resource.clone(),
                        device_ids: p.device_ids.clone(),
                    }],
                }],
            })
            .collect();
        Ok(tonic::Response::new(ListPodResourcesResponse { pod_resources }))
    }
}

/// Serves `kubelet` on the unix socket `socket`; the server stops when the returned handle is
/// aborted.
pub fn serve_kubelet(kubelet: Kubelet, socket: &Path) -> tokio::task::JoinHandle<Result<(), tonic::transport::Error>> {
    let listener = tokio::net::UnixListener::bind(socket).expect("bind the kubelet socket");
    tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(PodResourcesListerServer::new(kubelet))
            .serve_with_incoming(tokio_stream::wrappers::UnixListenerStream::new(listener)),
    )
}
