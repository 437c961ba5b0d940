//! The collector following a kernel log. Driver lines in the kernel's record format (as the
//! kernel itself logs them, facility `kern`) come out as raw Xid events, with the kernel's time and
//! an id derived from the record; after a restart, a line logged while the collector was down
//! arrives and the earlier one does not arrive again; a record re-read with no cursor is the same
//! event; a first run does not publish history; and a userspace write to the machine's real
//! `/dev/kmsg` (as root, which is how the collector runs and how CI runs) is not an Xid.
//!
//! Userspace cannot log under the kernel's facility, so the kernel's own lines are fed through a
//! file of records in the `/dev/kmsg` format, which `--kmsg-path` follows as it grows.

use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::time::Duration;

use chrono::{DateTime, Utc};
use gpumedic_collector::kernel_log::kmsg::{read_boot_time, wall_time};
use gpumedic_schemas::{Detail, HealthEvent, topics};
use gpumedic_testkit as testkit;

const BIN: &str = env!("CARGO_BIN_EXE_gpumedic-collector");

fn boot_time_us() -> i64 {
    read_boot_time(Path::new("/proc/stat")).expect("this machine's boot time")
}

/// A record as the kernel logs it: priority 3 (error), facility 0 (`kern`), stamped `at`.
fn kernel_record(seq: u64, at: DateTime<Utc>, line: &str) -> String {
    let since_boot = at.timestamp_micros() - boot_time_us();
    format!("3,{seq},{since_boot},-;{line}\n SUBSYSTEM=pci\n DEVICE=+pci:0000:3b:00.0\n")
}

/// Appends records to the file the collector follows.
fn log_records(file: &Path, records: &str) {
    let mut f = std::fs::OpenOptions::new().create(true).append(true).open(file).expect("open the record file");
    f.write_all(records.as_bytes()).expect("append records");
}

fn xid_line(marker: &str) -> String {
    format!("NVRM: Xid (PCI:0000:3b:00): 79, pid=4242, name={marker}, GPU has fallen off the bus.")
}

/// The node's events whose Xid names `marker`, seen within `wait` (the topic is read from the
/// start each time).
async fn events_with(node: &str, marker: &str, wait: Duration) -> Vec<HealthEvent> {
    let mut found = Vec::new();
    let _ = testkit::wait_for_record(
        topics::HEALTH_RAW,
        |r| {
            if r.key.as_deref() == Some(node.as_bytes())
                && let Ok(e) = gpumedic_schemas::decode::<HealthEvent>(r.payload.as_deref().unwrap_or_default())
                && matches!(&e.detail, Detail::Xid(x) if x.process.as_deref() == Some(marker))
            {
                found.push(e);
            }
            false
        },
        wait,
    )
    .await;
    found
}

struct Collector {
    env: Vec<(&'static str, String)>,
    state: PathBuf,
}

impl Collector {
    async fn new(node: &str, kmsg: &str) -> Self {
        let bootstrap = testkit::require_kafka().await.unwrap_or_else(|e| panic!("{e}"));
        let state = std::env::temp_dir().join(testkit::unique_name("collector-state"));
        std::fs::create_dir_all(&state).unwrap();
        let env = vec![
            ("GPUMEDIC_KAFKA_BOOTSTRAP", bootstrap),
            ("GPUMEDIC_NODE_NAME", node.to_owned()),
            ("GPUMEDIC_GPU_BACKEND", "off".to_owned()),
            ("GPUMEDIC_STATE_DIR", state.display().to_string()),
            ("GPUMEDIC_KMSG_PATH", kmsg.to_owned()),
        ];
        Collector { env, state }
    }

    async fn start(&self) -> testkit::ServiceProcess {
        let mut collector = testkit::ServiceProcess::start(BIN, &[], &self.env).expect("starts");
        collector.wait_ready(Duration::from_secs(60)).await.unwrap_or_else(|e| panic!("{e}"));
        collector
    }
}

#[tokio::test]
async fn kernel_lines_are_published_once_across_a_restart() {
    let node = testkit::unique_name("kmsg-node");
    let state = std::env::temp_dir().join(testkit::unique_name("kmsg-records"));
    std::fs::create_dir_all(&state).unwrap();
    let records = state.join("kmsg");
    log_records(&records, "");
    let c = Collector::new(&node, &records.display().to_string()).await;
    let first = testkit::unique_name("first");
    let second = testkit::unique_name("second");

    let mut collector = c.start().await;
    let logged_at = Utc::now();
    log_records(&records, &kernel_record(100, logged_at, &xid_line(&first)));
    let got = testkit::wait_for_record(
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
    assert!(c.state.join("kmsg.cursor").exists(), "the cursor was saved");

    // Logged while the collector is down: picked up after the restart, and the first line is
    // not published again.
    log_records(&records, &kernel_record(101, Utc::now(), &xid_line(&second)));
    let mut collector = c.start().await;
    assert_eq!(
        events_with(&node, &second, Duration::from_secs(8)).await.len(),
        1,
        "the line logged while down arrives once"
    );
    assert_eq!(events_with(&node, &first, Duration::from_secs(3)).await.len(), 1, "the first line is not re-reported");
    collector.terminate(Duration::from_secs(15)).await.expect("stops");
    std::fs::remove_dir_all(&c.state).ok();
    std::fs::remove_dir_all(&state).ok();
}

#[tokio::test]
async fn a_reread_record_is_the_same_event_and_a_first_run_skips_history() {
    let node = testkit::unique_name("kmsg-node");
    let state = std::env::temp_dir().join(testkit::unique_name("kmsg-records"));
    std::fs::create_dir_all(&state).unwrap();
    let records = state.join("kmsg");
    let (old, recent, user) =
        (testkit::unique_name("old"), testkit::unique_name("recent"), testkit::unique_name("user"));
    let recent_at = Utc::now() - chrono::Duration::seconds(30);
    // History: five minutes ago (or just after boot, on a machine up for less), beyond a
    // two-minute look-back.
    let booted = DateTime::from_timestamp_micros(boot_time_us() + 1_000_000).unwrap();
    let old_at = booted.max(Utc::now() - chrono::Duration::minutes(5));
    assert!(old_at < Utc::now() - chrono::Duration::minutes(3), "this machine has been up for less than 3 minutes");
    let mut text = kernel_record(1, old_at, &xid_line(&old));
    text.push_str(&kernel_record(2, recent_at, &xid_line(&recent)));
    // The same line written by a userspace program: facility `user` (prefix 11 = 1 << 3 | 3).
    text.push_str(&format!("11,3,{},-;{}\n", recent_at.timestamp_micros() - boot_time_us(), xid_line(&user)));
    log_records(&records, &text);
    let mut c = Collector::new(&node, &records.display().to_string()).await;
    c.env.push(("GPUMEDIC_KMSG_LOOK_BACK", "2m".to_owned()));

    let mut collector = c.start().await;
    let seen = events_with(&node, &recent, Duration::from_secs(8)).await;
    assert_eq!(seen.len(), 1, "the recent line is published");
    let first = &seen[0];
    // The kernel's time, not the moment the collector read the line.
    assert_eq!(first.observed_at, wall_time(boot_time_us(), (recent_at.timestamp_micros() - boot_time_us()) as u64));
    collector.terminate(Duration::from_secs(15)).await.expect("stops");

    // No cursor (a lost state folder): the record is read again and is the same event.
    std::fs::remove_file(c.state.join("kmsg.cursor")).expect("the cursor was saved");
    let mut collector = c.start().await;
    let seen = events_with(&node, &recent, Duration::from_secs(8)).await;
    assert_eq!(seen.len(), 2, "re-read once more");
    assert_eq!((seen[1].event_id, seen[1].observed_at), (first.event_id, first.observed_at), "the same id and time");
    assert!(
        events_with(&node, &old, Duration::from_secs(2)).await.is_empty(),
        "history before the look-back is not a new fault"
    );
    assert!(events_with(&node, &user, Duration::from_secs(2)).await.is_empty(), "a userspace line is not an Xid");
    collector.terminate(Duration::from_secs(15)).await.expect("stops");
    std::fs::remove_dir_all(&c.state).ok();
    std::fs::remove_dir_all(&state).ok();
}

#[tokio::test]
async fn a_userspace_write_to_the_real_kmsg_is_not_an_xid() {
    let node = testkit::unique_name("kmsg-node");
    let c = Collector::new(&node, "/dev/kmsg").await;
    let mut collector = c.start().await;
    let marker = testkit::unique_name("forged");
    let mut kmsg = std::fs::OpenOptions::new().write(true).open("/dev/kmsg").expect("write /dev/kmsg (run as root)");
    // Even asking for priority 3 and facility 0: the kernel files a userspace write under `user`.
    // The newline ends the record: without it the kernel may hold the text as a continuation.
    kmsg.write_all(format!("<3>{}\n", xid_line(&marker)).as_bytes()).expect("kernel accepted the line");
    assert!(events_with(&node, &marker, Duration::from_secs(8)).await.is_empty(), "a forged driver line is not an Xid");
    // The collector read it all the same: records that are not the kernel's were counted.
    let admin = collector.admin_addr();
    testkit::eventually_with("a userspace record to be counted", Duration::from_secs(30), async || {
        let (_, body) = testkit::http_get(admin, "/metrics").await.expect("metrics");
        if body.contains("gpumedic_collector_kmsg_records_skipped_total{reason=\"not_kernel\"}") {
            Ok(())
        } else {
            Err(format!("\n{body}"))
        }
    })
    .await;
    collector.terminate(Duration::from_secs(15)).await.expect("stops");
    std::fs::remove_dir_all(&c.state).ok();
}
