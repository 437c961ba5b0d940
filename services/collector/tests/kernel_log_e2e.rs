//! The collector following the machine's real kernel log: a driver line written to /dev/kmsg (as
//! root, which is how the collector runs and how CI runs) comes out as a raw Xid event; after a
//! restart, a line logged while the collector was down arrives and the earlier one does not
//! arrive again.

use std::io::Write as _;
use std::time::Duration;

use gpumedic_runtime::testbed;
use gpumedic_schemas::{Detail, HealthEvent, topics};

const BIN: &str = env!("CARGO_BIN_EXE_gpumedic-collector");

fn log_to_kernel(line: &str) {
    let mut kmsg = std::fs::OpenOptions::new().write(true).open("/dev/kmsg").expect("write /dev/kmsg (run as root)");
    // The newline ends the record: without it the kernel may hold the text as a continuation.
    kmsg.write_all(format!("{line}\n").as_bytes()).expect("kernel accepted the line");
}

fn xid_line(marker: &str) -> String {
    format!("NVRM: Xid (PCI:0000:3b:00): 79, pid=4242, name={marker}, GPU has fallen off the bus.")
}

async fn events_with(node: &str, marker: &str, wait: Duration) -> usize {
    // Count matching events seen within `wait` (the topic is read from the start each time).
    let mut n = 0usize;
    let _ = testbed::wait_for_record(
        topics::HEALTH_RAW,
        |r| {
            if r.key.as_deref() == Some(node.as_bytes())
                && let Ok(e) = gpumedic_schemas::decode::<HealthEvent>(r.payload.as_deref().unwrap_or_default())
                && matches!(&e.detail, Detail::Xid(x) if x.process.as_deref() == Some(marker))
            {
                n += 1;
            }
            false
        },
        wait,
    )
    .await;
    n
}

#[tokio::test]
async fn kernel_lines_are_published_once_across_a_restart() {
    let bootstrap = testbed::require_kafka().await.unwrap_or_else(|e| panic!("{e}"));
    let node = testbed::unique_name("kmsg-node");
    let state = std::env::temp_dir().join(testbed::unique_name("collector-state"));
    let env = [
        ("GPUMEDIC_KAFKA_BOOTSTRAP", bootstrap),
        ("GPUMEDIC_NODE_NAME", node.clone()),
        ("GPUMEDIC_GPU_BACKEND", "off".to_owned()),
        ("GPUMEDIC_STATE_DIR", state.display().to_string()),
    ];
    let first = testbed::unique_name("first");
    let second = testbed::unique_name("second");

    let mut collector = testbed::ServiceProcess::start(BIN, &[], &env).expect("starts");
    collector.wait_ready(Duration::from_secs(60)).await.unwrap_or_else(|e| panic!("{e}"));
    log_to_kernel(&xid_line(&first));
    let got = testbed::wait_for_record(
        topics::HEALTH_RAW,
        |r| {
            r.key.as_deref() == Some(node.as_bytes())
                && gpumedic_schemas::decode::<HealthEvent>(r.payload.as_deref().unwrap_or_default())
                    .is_ok_and(|e| matches!(&e.detail, Detail::Xid(x) if x.process.as_deref() == Some(first.as_str())))
        },
        Duration::from_secs(30),
    )
    .await
    .unwrap_or_else(|e| panic!("{e}"));
    let event: HealthEvent = gpumedic_schemas::decode(got.payload.as_deref().unwrap()).unwrap();
    assert_eq!(event.entity.pci_bus_id.as_deref(), Some("0000:3b:00.0"));
    assert!(event.raw.as_deref().is_some_and(|r| r.contains(&first)));
    collector.terminate(Duration::from_secs(15)).await.expect("stops");
    assert!(state.join("kmsg.cursor").exists(), "the cursor was saved");

    // Logged while the collector is down: picked up after the restart, and the first line is
    // not published again.
    log_to_kernel(&xid_line(&second));
    let mut collector = testbed::ServiceProcess::start(BIN, &[], &env).expect("restarts");
    collector.wait_ready(Duration::from_secs(60)).await.unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(events_with(&node, &second, Duration::from_secs(8)).await, 1, "the line logged while down arrives once");
    assert_eq!(events_with(&node, &first, Duration::from_secs(3)).await, 1, "the first line is not re-reported");
    collector.terminate(Duration::from_secs(15)).await.expect("stops");
    std::fs::remove_dir_all(&state).ok();
}
