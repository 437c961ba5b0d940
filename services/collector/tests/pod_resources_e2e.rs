//! The collector attaching the pods of each event's GPU, as the kubelet's PodResources API says,
//! to the events it publishes: a PodResources server speaking the kubelet's protocol on a unix
//! socket in a temp dir, the collector binary on a simulated node, real Kafka. The fault is a
//! kernel-log Xid that names its GPU by PCI bus id alone, so the UUID the collector resolves is
//! what the pods are looked up by.

mod common;

use std::io::Write as _;
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use chrono::Utc;
use common::{CollectorEnv, Kubelet, PodDevices, first_event, scratch, serve_kubelet};
use gpumedic_collector::gpu::{simulated_pci, simulated_uuid};
use gpumedic_collector::kernel_log::kmsg::read_boot_time;
use gpumedic_collector::pod_resources::GPU_RESOURCE;
use gpumedic_schemas::health::{GpuWorkload, Kind, MonitorState};
use gpumedic_schemas::{Detail, HealthEvent};
use gpumedic_testkit as testkit;

/// An Xid 79 record for the simulated GPU at `pci`, as the kernel logs it, stamped now.
fn xid_record(seq: u64, pci: &str, marker: &str) -> String {
    let boot = read_boot_time(Path::new("/proc/stat")).expect("this machine's boot time");
    let since_boot = Utc::now().timestamp_micros() - boot;
    let short = pci.trim_end_matches(".0");
    format!(
        "3,{seq},{since_boot},-;NVRM: Xid (PCI:{short}): 79, pid=4242, name={marker}, GPU has fallen off the bus.\n SUBSYSTEM=pci\n DEVICE=+pci:{pci}\n"
    )
}

fn log_record(file: &Path, record: &str) {
    let mut f = std::fs::OpenOptions::new().create(true).append(true).open(file).expect("open the record file");
    f.write_all(record.as_bytes()).expect("append the record");
}

fn xid_named(e: &HealthEvent, marker: &str) -> bool {
    matches!(&e.detail, Detail::Xid(x) if x.process.as_deref() == Some(marker))
}

/// Starts a collector for `node` on a simulated node of four GPUs, following `kmsg`, asking the
/// kubelet on `socket` every second.
async fn collector(node: &str, state: &Path, kmsg: &Path, socket: &Path) -> testkit::ServiceProcess {
    let bootstrap = testkit::require_kafka().await.unwrap_or_else(|e| panic!("{e}"));
    CollectorEnv::new(bootstrap, node, state)
        .simulated(4)
        .set("GPUMEDIC_INGEST_SOCKET", "off")
        .set("GPUMEDIC_KMSG_PATH", kmsg.display().to_string())
        .set("GPUMEDIC_POD_RESOURCES_SOCKET", socket.display().to_string())
        .set("GPUMEDIC_POD_RESOURCES_INTERVAL", "1s")
        .start()
        .await
}

#[tokio::test]
async fn a_kernel_log_fault_names_the_pods_on_its_gpu_from_the_kubelet() {
    let node = testkit::unique_name("podres-node");
    let dir = scratch("podres"); // Short: the kubelet's socket goes in it.
    let socket = dir.join("kubelet.sock");
    let kmsg = dir.join("kmsg");
    log_record(&kmsg, "");
    let (gpu2, gpu3) = (simulated_uuid(&node, 2), simulated_uuid(&node, 3));
    let calls = Arc::new(AtomicU64::new(0));
    let entry =
        |ns: &str, pod: &str, container: &str, ids: &[String]| PodDevices::new(ns, pod, container, GPU_RESOURCE, ids);
    let kubelet = Kubelet {
        pods: vec![
            entry("ml", "train-a", "main", &[gpu2.clone(), simulated_uuid(&node, 0)]),
            entry("ml", "train-b", "main", std::slice::from_ref(&gpu3)),
            // Time-slicing: a replica of GPU 2.
            entry("dev", "nb", "jupyter", &[format!("{gpu2}::1")]),
        ],
        calls: calls.clone(),
    };
    let server = serve_kubelet(kubelet, &socket);
    let mut collector = collector(&node, &dir.join("state"), &kmsg, &socket).await;

    // The GPUs of this boot are known (the inventory), and the kubelet has answered at least
    // once before it is asked again.
    first_event(&node, Duration::from_secs(30), |e| e.kind == Kind::GpuInventory).await;
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    while calls.load(Ordering::SeqCst) < 2 {
        assert!(std::time::Instant::now() < deadline, "the collector never asked the kubelet twice");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }

    let marker = testkit::unique_name("xid");
    log_record(&kmsg, &xid_record(1, &simulated_pci(2), &marker));
    let event = first_event(&node, Duration::from_secs(30), |e| xid_named(e, &marker)).await;
    assert_eq!(event.entity.gpu_uuid.as_deref(), Some(gpu2.as_str()), "the PCI bus id resolved to the UUID");
    let w = |ns: &str, pod: &str, container: &str| GpuWorkload {
        namespace: ns.into(),
        pod: pod.into(),
        container: container.into(),
        gpu_uuids: vec![gpu2.clone()],
    };
    assert_eq!(
        event.workloads,
        Some(vec![w("dev", "nb", "jupyter"), w("ml", "train-a", "main")]),
        "exactly the containers on GPU 2, not train-b on GPU 3"
    );

    // A GPU no pod uses: the collector knows there are none.
    let idle = testkit::unique_name("xid");
    log_record(&kmsg, &xid_record(2, &simulated_pci(1), &idle));
    let event = first_event(&node, Duration::from_secs(30), |e| xid_named(e, &idle)).await;
    assert_eq!(event.workloads, Some(Vec::new()));

    collector.terminate(Duration::from_secs(15)).await.expect("stops");
    server.abort();
    std::fs::remove_dir_all(&dir).ok();
}

#[tokio::test]
async fn a_failing_kubelet_is_a_monitor_health_event_and_events_carry_no_list() {
    let node = testkit::unique_name("podres-node");
    let dir = scratch("podres"); // Short: the kubelet's socket goes in it.
    // There, but nothing listens: every call fails to connect.
    let socket = dir.join("kubelet.sock");
    std::fs::write(&socket, "").unwrap();
    let kmsg = dir.join("kmsg");
    log_record(&kmsg, "");
    let mut collector = collector(&node, &dir.join("state"), &kmsg, &socket).await;

    let failed = first_event(
        &node,
        Duration::from_secs(30),
        |e| matches!(&e.detail, Detail::MonitorHealth(m) if m.monitor == "pod-resources"),
    )
    .await;
    let Detail::MonitorHealth(m) = &failed.detail else { unreachable!() };
    assert_eq!(m.state, MonitorState::Error);
    assert!(!failed.healthy);
    assert!(m.message.as_deref().is_some_and(|text| text.contains("kubelet.sock")), "{m:?}");

    first_event(&node, Duration::from_secs(30), |e| e.kind == Kind::GpuInventory).await;
    let marker = testkit::unique_name("xid");
    log_record(&kmsg, &xid_record(1, &simulated_pci(2), &marker));
    let event = first_event(&node, Duration::from_secs(30), |e| xid_named(e, &marker)).await;
    assert_eq!(event.entity.gpu_uuid, Some(simulated_uuid(&node, 2)));
    assert_eq!(event.workloads, None, "not known: the enricher falls back to the pod annotation");

    collector.terminate(Duration::from_secs(15)).await.expect("stops");
    std::fs::remove_dir_all(&dir).ok();
}
