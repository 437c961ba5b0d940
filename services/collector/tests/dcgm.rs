//! The DCGM source: dcgm-exporter served by a local HTTP server from the fixtures, and a fake
//! `dcgmi` (a shell script printing fixture JSON, exiting as dcgmi does) for the diagnostic.

mod common;

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::Router;
use axum::extract::State;
use axum::routing::get;
use common::CollectorEnv;
use gpumedic_collector::dcgm::source::{DiagOutcome, DiagSettings, run_diag_once};
use gpumedic_schemas::health::{DcgmResult, MonitorState, Source};
use gpumedic_schemas::{Detail, HealthEvent};
use gpumedic_testkit as testkit;

/// A collector of `node` without GPUs, the kernel log or cloud notices, scraping the
/// dcgm-exporter at `url` every second, in a state folder of its own.
fn dcgm_collector(bootstrap: String, node: &str, url: String) -> CollectorEnv {
    CollectorEnv::new(bootstrap, node, &std::env::temp_dir().join(testkit::unique_name("collector-state")))
        .set("GPUMEDIC_CLOUD_PROVIDER", "none")
        .set("GPUMEDIC_DCGM_EXPORTER_URL", url)
        .set("GPUMEDIC_DCGM_SCRAPE_INTERVAL", "1s")
}

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/dcgm").join(name)
}

/// A fake `dcgmi` in a fresh folder: prints `json` (a fixture's path) and exits with `code`,
/// after sleeping `sleep` seconds.
fn fake_dcgmi(json: Option<&Path>, code: i32, sleep: u32) -> PathBuf {
    use std::os::unix::fs::PermissionsExt as _;
    let dir = std::env::temp_dir().join(testkit::unique_name("fake-dcgmi"));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("dcgmi");
    let body = match json {
        Some(p) => format!("cat '{}'", p.display()),
        None => "echo 'Error: unable to establish a connection to the specified host: localhost' >&2".to_owned(),
    };
    std::fs::write(
        &path,
        format!("#!/bin/sh\n[ \"$1 $2 $3 $4\" = \"diag -r 1 -j\" ] || exit 2\nsleep {sleep}\n{body}\nexit {code}\n"),
    )
    .unwrap();
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755)).unwrap();
    path
}

fn diag(script: &Path, timeout: Duration) -> DiagSettings {
    DiagSettings {
        interval: Duration::from_secs(1),
        command: vec![script.display().to_string(), "diag".into(), "-r".into(), "1".into(), "-j".into()],
        timeout,
    }
}

#[tokio::test]
async fn the_diagnostic_command_is_run_and_read() {
    // dcgmi exits non-zero when a test fails; the report is read all the same.
    let fail = fake_dcgmi(Some(&fixture("diag-4x-r2-fail.json")), 226, 0);
    match run_diag_once(&diag(&fail, Duration::from_secs(30))).await {
        DiagOutcome::Report(r) => assert_eq!(r.failed().len(), 1),
        other => panic!("{other:?}"),
    }
    let pass = fake_dcgmi(Some(&fixture("diag-3x-r1-pass.json")), 0, 0);
    match run_diag_once(&diag(&pass, Duration::from_secs(30))).await {
        DiagOutcome::Report(r) => assert!(r.failed().is_empty()),
        other => panic!("{other:?}"),
    }
    let no_host_engine = fake_dcgmi(None, 1, 0);
    match run_diag_once(&diag(&no_host_engine, Duration::from_secs(30))).await {
        DiagOutcome::Failed(msg) => assert!(msg.contains("unable to establish a connection"), "{msg}"),
        other => panic!("{other:?}"),
    }
    let hung = fake_dcgmi(Some(&fixture("diag-3x-r1-pass.json")), 0, 30);
    assert!(matches!(run_diag_once(&diag(&hung, Duration::from_millis(300))).await, DiagOutcome::TimedOut));
    let missing = diag(Path::new("/nonexistent/dcgmi"), Duration::from_secs(1));
    assert!(matches!(run_diag_once(&missing).await, DiagOutcome::Failed(_)));
    for p in [fail, pass, no_host_engine, hung] {
        std::fs::remove_dir_all(p.parent().unwrap()).ok();
    }
}

async fn serve_metrics(page: Arc<Mutex<String>>) -> String {
    async fn metrics(State(page): State<Arc<Mutex<String>>>) -> String {
        page.lock().unwrap().clone()
    }
    let app = Router::new().route("/metrics", get(metrics)).with_state(page);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let url = format!("http://{}/metrics", listener.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(listener, app).await.expect("serve") });
    url
}

/// `page` with the value of every line starting with `prefix` replaced.
fn set_value(page: &str, prefix: &str, value: &str) -> String {
    page.lines()
        .map(|l| match l.rsplit_once(' ') {
            Some((head, _)) if l.starts_with(prefix) => format!("{head} {value}\n"),
            _ => format!("{l}\n"),
        })
        .collect()
}

#[tokio::test]
async fn the_collector_publishes_exporter_changes_and_diagnostic_results() {
    let bootstrap = testkit::require_kafka().await.unwrap_or_else(|e| panic!("{e}"));
    let original = std::fs::read_to_string(fixture("exporter-3x.prom")).unwrap();
    let quiet = set_value(&original, "DCGM_FI_DEV_XID_ERRORS{gpu=\"1\"", "0");
    let page = Arc::new(Mutex::new(quiet));
    let url = serve_metrics(page.clone()).await;
    let dcgmi = fake_dcgmi(Some(&fixture("diag-3x-r2-fail.json")), 226, 0);
    let node = testkit::unique_name("dcgm-node");
    let mut collector = dcgm_collector(bootstrap, &node, url)
        .set("GPUMEDIC_DCGM_DIAG_INTERVAL", "2s")
        .set("GPUMEDIC_DCGM_DIAG_COMMAND", format!("{} diag -r 1 -j", dcgmi.display()))
        .start()
        .await;
    let find = |want: Box<dyn Fn(&HealthEvent) -> bool + Send>| {
        common::first_event(&node, Duration::from_secs(30), move |e| e.source == Source::Dcgm && want(e))
    };

    // GPU 1 comes up with a failed row remap: reported on the first scrape.
    let remap = find(Box::new(|e| matches!(&e.detail, Detail::RowRemap(d) if d.failure))).await;
    assert_eq!(remap.entity.gpu_uuid.as_deref(), Some("GPU-3f2b8c1d-77e0-4a5b-b9c2-6d1e0f8a4c27"));
    // A new Xid on the exporter page is an Xid event.
    *page.lock().unwrap() = original;
    let xid = find(Box::new(|e| matches!(&e.detail, Detail::Xid(x) if x.code == 79))).await;
    assert_eq!(xid.entity.gpu_index, Some(1));
    // The diagnostic's failure names the GPU by the UUID the exporter gave it.
    let failed = find(Box::new(|e| matches!(&e.detail, Detail::Dcgm(d) if d.result == DcgmResult::Fail))).await;
    let Detail::Dcgm(d) = &failed.detail else { unreachable!() };
    assert_eq!(d.check, "diag:GPU Memory");
    assert!(!failed.healthy);
    assert_eq!(failed.entity.gpu_uuid.as_deref(), Some("GPU-3f2b8c1d-77e0-4a5b-b9c2-6d1e0f8a4c27"));
    collector.terminate(Duration::from_secs(15)).await.expect("stops");
    std::fs::remove_dir_all(dcgmi.parent().unwrap()).ok();
}

#[tokio::test]
async fn an_unreachable_exporter_is_a_monitor_event() {
    let bootstrap = testkit::require_kafka().await.unwrap_or_else(|e| panic!("{e}"));
    let node = testkit::unique_name("dcgm-down-node");
    let nowhere = format!("http://{}/metrics", testkit::free_local_addr().unwrap());
    let mut collector = dcgm_collector(bootstrap, &node, nowhere).start().await;
    common::first_event(&node, Duration::from_secs(30), |e| {
        !e.healthy
            && matches!(&e.detail, Detail::MonitorHealth(m)
                if m.monitor == "dcgm-exporter" && m.state == MonitorState::Unavailable)
    })
    .await;
    collector.terminate(Duration::from_secs(15)).await.expect("stops");
}
