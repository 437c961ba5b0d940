//! The short chaos run as a test: the pipeline on private servers (Kafka, PostgreSQL, etcd and a
//! kube-apiserver started by the scenario itself from the testbed's installed binaries) while
//! every service is killed once, Kafka, PostgreSQL and the apiserver are restarted and PostgreSQL
//! is paused; then every event, verdict and action is proven by id (nothing lost, duplicated or
//! applied twice, every node in the state its incidents call for). The scenario exits 1 when a
//! proof fails or the pipeline does not settle, and this test fails with it.
//!
//! It needs the testbed's servers installed (`./compose/up` does it once; `scripts/test.sh` runs it
//! first) and every service binary built beside this test (`cargo build --workspace --bins
//! --all-features`). It takes about seven minutes in a debug build.

use std::collections::VecDeque;
use std::io::{BufRead as _, BufReader, Write as _};
use std::process::{Command, Stdio};

/// How many of the run's last lines a failure repeats.
const LAST_LINES: usize = 60;

#[test]
fn the_short_chaos_run_loses_nothing_duplicates_nothing_and_leaves_every_node_right() {
    let exe = env!("CARGO_BIN_EXE_gpumedic-load-tests");
    let dir = std::env::temp_dir().join(format!("gpumedic-chaos-test-{}", std::process::id()));
    for service in ["gpumedic-collector", "gpumedic-enricher", "gpumedic-classifier", "gpumedic-remediator"] {
        let binary = std::path::Path::new(exe).with_file_name(service);
        assert!(
            binary.is_file(),
            "{} is missing: build every service first (`cargo build --workspace --bins --all-features`)",
            binary.display()
        );
    }
    // The debug services carry 150 events/s through the restarts on two cores; the ports are away
    // from the shared testbed's and from the scenario's default, so a developer's own chaos run
    // (port base 29000) can go on beside the suite.
    let mut child = Command::new(exe)
        .args(["chaos", "--short", "--rate", "150", "--port-base", "29600", "--state-dir"])
        .arg(dir.join("state"))
        .arg("--out-dir")
        .arg(dir.join("out"))
        .stdout(Stdio::piped())
        .spawn()
        .expect("the load-tests binary starts");
    // The run's output goes out as it comes (past the test harness's capture), and its last
    // lines, which say what failed, go into the failure message too: a CI log shows the end of
    // the run and the failures, and the run's own lines are far above them.
    let mut last = VecDeque::new();
    for line in BufReader::new(child.stdout.take().expect("piped")).lines() {
        let line = line.expect("the run's output is text");
        let _ = writeln!(std::io::stdout().lock(), "{line}");
        if last.len() == LAST_LINES {
            last.pop_front();
        }
        last.push_back(line);
    }
    let status = child.wait().expect("the load-tests binary ends");
    assert!(
        status.success(),
        "the short chaos run failed ({status}); the services' and servers' logs are kept under {}. The run's last \
         lines:\n{}",
        dir.join("state").display(),
        Vec::from(last).join("\n")
    );
    let _ = std::fs::remove_dir_all(&dir);
}
