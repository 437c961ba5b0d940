//! The collector reading a fake sysfs tree's InfiniBand ports and a kernel log with a NIC driver
//! error, publishing what it finds to the testbed's Kafka: the flags reach the source, and the
//! events leave the node as the classifier's rules expect them (`custom`, named by `check`).

use std::collections::BTreeMap;
use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::time::Duration;

use gpumedic_collector::kernel_log::kmsg::read_boot_time;
use gpumedic_schemas::{Detail, HealthEvent, topics};
use gpumedic_testkit as testkit;

const BIN: &str = env!("CARGO_BIN_EXE_gpumedic-collector");

fn port(root: &Path, hca: &str, state: &str, phys: &str) {
    let p = root.join(format!("class/infiniband/{hca}/ports/1"));
    std::fs::create_dir_all(p.join("counters")).unwrap();
    std::fs::write(p.join("state"), format!("{state}\n")).unwrap();
    std::fs::write(p.join("phys_state"), format!("{phys}\n")).unwrap();
    std::fs::write(p.join("link_layer"), "InfiniBand\n").unwrap();
    for c in ["link_downed", "symbol_error", "link_error_recovery", "port_rcv_errors"] {
        std::fs::write(p.join("counters").join(c), "0\n").unwrap();
    }
}

/// The node's custom event whose values hold every pair of `want`.
async fn custom_event(node: &str, want: &[(&str, &str)], healthy: bool) -> HealthEvent {
    let got = testkit::wait_for_record(
        topics::HEALTH_RAW,
        |r| {
            r.key.as_deref() == Some(node.as_bytes())
                && gpumedic_schemas::decode::<HealthEvent>(r.payload.as_deref().unwrap_or_default()).is_ok_and(|e| {
                    e.healthy == healthy
                        && matches!(&e.detail, Detail::Custom(c)
                            if want.iter().all(|(k, v)| c.values.get(*k).map(String::as_str) == Some(*v)))
                })
        },
        Duration::from_secs(30),
    )
    .await
    .unwrap_or_else(|e| panic!("no event with {want:?} (healthy {healthy}) for {node}: {e}"));
    gpumedic_schemas::decode(got.payload.as_deref().unwrap()).unwrap()
}

fn values(e: &HealthEvent) -> BTreeMap<String, String> {
    match &e.detail {
        Detail::Custom(c) => c.values.clone(),
        other => panic!("custom expected, got {other:?}"),
    }
}

#[tokio::test]
async fn infiniband_ports_and_nic_driver_errors_reach_kafka() {
    let bootstrap = testkit::require_kafka().await.unwrap_or_else(|e| panic!("{e}"));
    let node = testkit::unique_name("ib-node");
    let dir: PathBuf = std::env::temp_dir().join(testkit::unique_name("ib-sysfs"));
    let (sysfs, state) = (dir.join("sys"), dir.join("state"));
    std::fs::create_dir_all(&state).unwrap();
    port(&sysfs, "mlx5_0", "4: ACTIVE", "5: LinkUp");
    port(&sysfs, "mlx5_1", "1: DOWN", "2: Polling");
    // A kernel record (facility kern) of the mlx5 driver's firmware health report.
    let boot = read_boot_time(Path::new("/proc/stat")).unwrap();
    let since_boot = chrono::Utc::now().timestamp_micros() - boot;
    let kmsg = dir.join("kmsg");
    std::fs::File::create(&kmsg)
        .unwrap()
        .write_all(
            format!(
                "3,7,{since_boot},-;mlx5_core 0000:41:00.0: poll_health:852:(pid 0): device's health compromised - reached miss count\n"
            )
            .as_bytes(),
        )
        .unwrap();
    let env = vec![
        ("GPUMEDIC_KAFKA_BOOTSTRAP", bootstrap),
        ("GPUMEDIC_NODE_NAME", node.clone()),
        ("GPUMEDIC_GPU_BACKEND", "off".to_owned()),
        ("GPUMEDIC_STATE_DIR", state.display().to_string()),
        ("GPUMEDIC_KMSG_PATH", kmsg.display().to_string()),
        ("GPUMEDIC_SYSFS_ROOT", sysfs.display().to_string()),
        ("GPUMEDIC_IB_INTERVAL", "1s".to_owned()),
        ("GPUMEDIC_IB_EXPECTED_HCAS", "3".to_owned()),
        ("GPUMEDIC_CLOUD_PROVIDER", "none".to_owned()),
    ];
    let mut collector = testkit::ServiceProcess::start(BIN, &[], &env).expect("starts");
    collector.wait_ready(Duration::from_secs(60)).await.unwrap_or_else(|e| panic!("{e}"));

    let down = custom_event(&node, &[("check", "ib_port"), ("hca", "mlx5_1"), ("link", "down")], false).await;
    assert_eq!(values(&down).get("phys_state").map(String::as_str), Some("Polling"));
    assert!(down.boot_id.is_some(), "stamped like every event");
    let short = custom_event(&node, &[("check", "ib_hcas"), ("present", "2"), ("expected", "3")], false).await;
    assert_eq!(short.component, gpumedic_schemas::health::Component::Node);
    let nic = custom_event(&node, &[("check", "nic_driver"), ("error", "health_compromised")], false).await;
    assert_eq!(values(&nic).get("severity").map(String::as_str), Some("fatal"));
    assert_eq!(nic.entity.pci_bus_id, None, "the NIC is not named as a GPU");

    // The cable is reseated: the port comes back, and with every port up the event is healthy.
    port(&sysfs, "mlx5_1", "4: ACTIVE", "5: LinkUp");
    custom_event(&node, &[("check", "ib_port"), ("hca", "mlx5_1"), ("link", "up")], true).await;

    collector.terminate(Duration::from_secs(15)).await.expect("stops");
    std::fs::remove_dir_all(&dir).ok();
}
