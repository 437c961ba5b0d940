//! `fleet-scale --quick` end to end against the testbed: 1,000 GPU Nodes with their pods in the
//! apiserver, the three services started from the binaries built next to this one (run
//! `cargo build --workspace --bins --all-features` first), the fleet's stream, a burst with timed
//! faults, and a JSON result with a figure for every process and phase.

use std::process::Command;

const BIN: &str = env!("CARGO_BIN_EXE_gpumedic-load-tests");

#[test]
fn a_quick_fleet_scale_run_measures_every_service_and_cordons_every_timed_fault() {
    let out = tempdir();
    let status = Command::new(BIN)
        .args(["fleet-scale", "--quick", "--out-dir"])
        .arg(&out)
        .status()
        .expect("start gpumedic-load-tests");
    assert!(status.success(), "fleet-scale --quick failed: {status}");
    let result: serde_json::Value =
        serde_json::from_slice(&std::fs::read(out.join("fleet-scale.json")).expect("the result")).expect("JSON");
    let step = &result["steps"][0];
    assert_eq!(step["nodes"], 1000);
    assert_eq!(step["relist_whole"]["items"], 1000, "{step}");
    assert!(result["node_json_bytes"].as_u64().unwrap() > 2000, "a Node carries a kubelet's status: {result}");
    for phase in ["steady", "burst"] {
        for process in ["enricher", "classifier", "remediator", "load-tests"] {
            let mib = step[phase]["mib"][process].as_f64().unwrap_or(0.0);
            assert!(mib > 1.0, "{phase} {process}: {mib} MiB");
        }
        assert!(step[phase]["rate_achieved"].as_f64().unwrap() > 0.0);
    }
    assert!(step["startup_s"]["enricher"].as_f64().unwrap() > 0.0);
    let faults = &step["fault_to_cordon"];
    assert_eq!(faults["faults"], 20);
    let cordoned = faults["cordoned"].as_u64().unwrap() + faults["already_cordoned"].as_u64().unwrap();
    assert_eq!(cordoned, 20, "every timed fault ends in a cordon: {faults}");
    let cache = &result["enricher_cache"];
    assert!(cache["bytes_per_node"].as_f64().unwrap() > 0.0, "{cache}");
    let _ = std::fs::remove_dir_all(&out);
}

fn tempdir() -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!("fleet-scale-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    dir
}
