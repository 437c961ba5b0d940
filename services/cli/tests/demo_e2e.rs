//! `gpumedic demo`, the README's main command, run end to end against the testbed as a newcomer
//! runs it: the story it tells (the injected fault quarantines and drains the node, the other
//! GPUs' heartbeats do not release it, a reboot does, once), and that nothing of the run is left
//! afterwards: no Node, no namespace, no consumer group, no collector state. A second run is
//! interrupted (SIGINT, as Ctrl-C sends) in the middle of the story and must clean up as well.
//!
//! The demo runs `compose/up` only when `compose/status` reports the testbed down; on the shared
//! testbed it starts no server. Needs the binaries (`cargo build --workspace --bins`). The full
//! story takes about 90 seconds, the interrupted one about 20.

use std::path::PathBuf;
use std::time::Duration;

use gpumedic_testkit::{self as testkit, demo::Demo};
use k8s_openapi::api::core::v1::{Namespace, Node};
use kube::api::{Api, ListParams};
use rdkafka::consumer::{BaseConsumer, Consumer as _};

/// The two runs one after the other: each starts ten processes, and the machine running the
/// tests may have two cores.
static ONE_AT_A_TIME: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// Asserts that nothing of run `run_id` is left: Nodes, namespace, consumer groups, state folders.
async fn assert_cleaned_up(run_id: &str) {
    let client = testkit::require_kubernetes().await.unwrap_or_else(|e| panic!("{e}"));
    let nodes = Api::<Node>::all(client.clone())
        .list(&ListParams::default().labels(&format!("gpumedic.io/demo={run_id}")))
        .await
        .expect("list nodes");
    let names: Vec<_> = nodes.items.iter().filter_map(|n| n.metadata.name.clone()).collect();
    assert!(names.is_empty(), "run {run_id} left its Nodes: {names:?}");
    let ns = format!("demo-{run_id}");
    let left = Api::<Namespace>::all(client).get_opt(&ns).await.expect("get namespace");
    assert!(left.is_none(), "run {run_id} left namespace {ns}: {left:?}");

    let bootstrap = testkit::kafka_bootstrap();
    let run = run_id.to_owned();
    let groups = tokio::task::spawn_blocking(move || {
        let consumer: BaseConsumer = rdkafka::ClientConfig::new()
            .set("bootstrap.servers", &bootstrap)
            .set("group.id", testkit::unique_name("demo-e2e-lister"))
            .create()
            .expect("Kafka client");
        let list = consumer.fetch_group_list(None, Duration::from_secs(20)).expect("list consumer groups");
        list.groups().iter().map(|g| g.name().to_owned()).filter(|g| g.contains(&run)).collect::<Vec<_>>()
    })
    .await
    .expect("group listing");
    assert!(groups.is_empty(), "run {run_id} left consumer groups: {groups:?}");

    let logs = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../.testbed/logs/demo").join(run_id);
    let state: Vec<_> = std::fs::read_dir(&logs)
        .map(|d| d.filter_map(Result::ok).map(|e| e.file_name()).filter(|n| n.to_string_lossy().starts_with("state-")))
        .into_iter()
        .flatten()
        .collect();
    assert!(state.is_empty(), "run {run_id} left collector state in {}: {state:?}", logs.display());
}

/// Asserts that `needles` occur in `out` in this order.
fn assert_in_order(out: &str, needles: &[String]) {
    let mut from = 0;
    for n in needles {
        match out[from..].find(n.as_str()) {
            Some(i) => from += i + n.len(),
            None => panic!("the demo's story lacks {n:?} (in this place):\n{out}"),
        }
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn the_demo_tells_the_story_and_leaves_nothing_behind() {
    let _one = ONE_AT_A_TIME.lock().await;
    let mut demo = Demo::start(&[]);
    let status = tokio::task::block_in_place(|| demo.wait(Duration::from_secs(300)));
    let out = demo.output();
    assert!(status.success(), "gpumedic demo failed ({status}):\n{out}");
    let run_id = demo.run_id();
    let faulty = format!("demo-{run_id}-gpu-2");
    let story: Vec<String> = [
        format!("Injecting a fault: GPU 3 of {faulty} falls off the bus"),
        "classified: critical, recommended action reboot_node (rule xid-79-fallen-off-the-bus)".to_owned(),
        format!("cordoned: {faulty} is unschedulable; taint gpumedic.io/"),
        format!("the console shows it: 75.0% of the fleet's 32 GPUs in service, {faulty} quarantined"),
        format!("drained: the training pods on {faulty} were evicted"),
        "still cordoned, 1 incident open".to_owned(),
        format!("Rebooting {faulty} (simulated)"),
        format!("{faulty} is schedulable again, gpumedic's taint is gone, GpuUnhealthy=False"),
        "released once (one recovery verdict)".to_owned(),
        format!("{faulty}  xid-79-fallen-off-the-bus  critical"),
        format!("Removing what run {run_id} created"),
        "removed; the incident history stays in PostgreSQL".to_owned(),
        "Done: a GPU fell off the bus".to_owned(),
    ]
    .into();
    assert_in_order(&out, &story);
    assert_cleaned_up(&run_id).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn an_interrupted_demo_cleans_up_too() {
    let _one = ONE_AT_A_TIME.lock().await;
    // The console's usual port held (by this test, or by whoever holds it already): the demo
    // takes another and says so.
    let _held = std::net::TcpListener::bind("127.0.0.1:9405");
    let mut demo = Demo::start(&[]);
    // Interrupted once the fleet, the groups and the services exist, in the middle of the story.
    tokio::task::block_in_place(|| demo.wait_for_line("all services report ready", Duration::from_secs(180)));
    demo.signal("INT");
    let status = tokio::task::block_in_place(|| demo.wait(Duration::from_secs(90)));
    let out = demo.output();
    assert!(!status.success(), "an interrupted demo must not report success:\n{out}");
    let run_id = demo.run_id();
    assert!(
        out.contains("port 9405 on 127.0.0.1 is taken (another process listens there): the console uses"),
        "the demo did not say that the console's port is taken:\n{out}"
    );
    assert_in_order(&out, &[format!("Removing what run {run_id} created"), "removed;".to_owned()]);
    // On standard error, so not ordered with the lines above in `out`.
    assert!(out.contains("demo failed: interrupted by Ctrl-C"), "the demo did not say it was interrupted:\n{out}");
    assert_cleaned_up(&run_id).await;
}
