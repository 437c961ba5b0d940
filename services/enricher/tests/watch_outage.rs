//! The enricher while the Kubernetes API is unreachable: its cluster-cache watches fail, it keeps
//! running (not ready), and once the API answers again it lists Nodes and Pods anew, so a node
//! added meanwhile is known and one deleted meanwhile is not.
//!
//! The outage is a gate in front of the shared apiserver (the apiserver itself is never stopped):
//! the enricher's kubeconfig names the gate; closing it drops every open connection and refuses new
//! ones, as a restarting apiserver does.

mod common;

use std::sync::{Arc, Mutex};
use std::time::Duration;

use gpumedic_runtime::kafka::{Producer, publish};
use gpumedic_schemas::{EnrichedHealthEvent, HealthEvent, topics};
use gpumedic_testkit as testkit;
use k8s_openapi::api::core::v1::Node;
use kube::api::{Api, DeleteParams, PostParams};

/// A TCP forwarder on a fixed local port that can be closed (every connection dropped, new ones
/// refused) and opened again on the same port.
struct Gate {
    addr: std::net::SocketAddr,
    upstream: String,
    tasks: Arc<Mutex<Vec<tokio::task::JoinHandle<()>>>>,
}

impl Gate {
    async fn open_new(upstream: &str) -> Self {
        let gate =
            Self { addr: testkit::free_local_addr().unwrap(), upstream: upstream.to_owned(), tasks: Arc::default() };
        gate.open().await;
        gate
    }

    async fn open(&self) {
        let socket = tokio::net::TcpSocket::new_v4().unwrap();
        socket.set_reuseaddr(true).unwrap();
        socket.bind(self.addr).unwrap();
        let listener = socket.listen(64).unwrap();
        let (upstream, tasks) = (self.upstream.clone(), self.tasks.clone());
        let accept = tokio::spawn(async move {
            while let Ok((mut client, _)) = listener.accept().await {
                let upstream = upstream.clone();
                let pipe = tokio::spawn(async move {
                    if let Ok(mut server) = tokio::net::TcpStream::connect(&upstream).await {
                        let _ = tokio::io::copy_bidirectional(&mut client, &mut server).await;
                    }
                });
                tasks.lock().unwrap().push(pipe);
            }
        });
        self.tasks.lock().unwrap().push(accept);
    }

    /// Drops the listener and every connection through it.
    fn close(&self) {
        for task in self.tasks.lock().unwrap().drain(..) {
            task.abort();
        }
    }
}

fn xid_event(node: &str) -> HealthEvent {
    testkit::event(node).xid(79).text("GPU has fallen off the bus.").build()
}

async fn enriched_of(producer: &Producer, event: &HealthEvent) -> EnrichedHealthEvent {
    publish(producer, topics::HEALTH_RAW, &event.node, &gpumedic_schemas::encode(event).unwrap(), &[])
        .await
        .expect("produced");
    common::enriched_of(event).await.1
}

fn labelled_node(name: &str) -> Node {
    testkit::NodeBuilder::new(name).label("node.kubernetes.io/instance-type", "p5.48xlarge").build()
}

#[tokio::test]
async fn an_unreachable_apiserver_leaves_the_enricher_running_and_its_cache_lists_again() {
    let settings = common::shared_topics().await;
    let client = testkit::require_kubernetes().await.unwrap_or_else(|e| panic!("{e}"));

    // The enricher reaches the apiserver through the gate.
    let kubeconfig = std::fs::read_to_string(testkit::kubeconfig_path()).expect("the testbed's kubeconfig");
    let server =
        kubeconfig.lines().find_map(|l| l.trim().strip_prefix("server: https://")).expect("a server line").to_owned();
    let gate = Gate::open_new(&server).await;
    let dir = std::env::temp_dir().join(testkit::unique_name("enricher-gate"));
    std::fs::create_dir_all(&dir).unwrap();
    let gated = dir.join("kubeconfig");
    std::fs::write(&gated, kubeconfig.replace(&format!("https://{server}"), &format!("https://{}", gate.addr)))
        .unwrap();

    let nodes: Api<Node> = Api::all(client.clone());
    let (stays, goes, comes) =
        (testkit::unique_name("gate-stays"), testkit::unique_name("gate-goes"), testkit::unique_name("gate-comes"));
    for name in [&stays, &goes] {
        nodes.create(&PostParams::default(), &labelled_node(name)).await.expect("node");
    }

    let mut enricher =
        common::shared_topic_enricher(&settings, "enricher", &[("KUBECONFIG", gated.display().to_string())]).await;

    // The outage: the watches fail, the enricher stays up and says it is not ready.
    gate.close();
    testkit::eventually("the enricher to turn unready with its watches failing", Duration::from_secs(30), async || {
        if let Some(status) = enricher.try_wait().unwrap() {
            panic!("the enricher exited with {status} when the apiserver became unreachable");
        }
        matches!(testkit::http_get(enricher.admin_addr(), "/readyz").await, Ok((503, _))).then_some(())
    })
    .await;
    nodes.delete(&goes, &DeleteParams::default()).await.expect("deleted");
    nodes.create(&PostParams::default(), &labelled_node(&comes)).await.expect("node");
    tokio::time::sleep(Duration::from_secs(5)).await;
    if let Some(status) = enricher.try_wait().unwrap() {
        panic!("the enricher exited with {status} during the apiserver's outage");
    }
    let (_, metrics) = testkit::http_get(enricher.admin_addr(), "/metrics").await.expect("metrics");
    assert!(
        metrics.lines().any(|l| l.starts_with("gpumedic_enricher_watch_failures_total{resource=\"nodes\"}")),
        "the failures are counted: {metrics}"
    );

    // The apiserver answers again: the cache lists anew and the enricher is ready.
    gate.open().await;
    enricher.wait_ready(Duration::from_secs(90)).await.unwrap_or_else(|e| panic!("{e}"));
    let producer = settings.producer("enricher-gate-test").unwrap();
    for (node, known) in [(&stays, true), (&comes, true), (&goes, false)] {
        let enriched = enriched_of(&producer, &xid_event(node)).await;
        assert_eq!(!enriched.node_unknown, known, "{node}: known after the outage is {known}");
        if known {
            assert_eq!(enriched.node_context.instance_type.as_deref(), Some("p5.48xlarge"), "{node}");
        }
    }

    enricher.terminate(Duration::from_secs(15)).await.expect("stops on SIGTERM");
    for name in [&stays, &comes] {
        nodes.delete(name, &DeleteParams::default()).await.expect("deleted");
    }
    let _ = std::fs::remove_dir_all(&dir);
}
