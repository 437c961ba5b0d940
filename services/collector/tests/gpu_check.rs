//! `gpumedic-gpu-check` on this machine: without an NVIDIA driver it fails clearly (exit 1, a
//! message naming NVML); on a GPU machine it prints every GPU.
//!
//! Without a driver the GPU half of these tests checks nothing: they say so on stderr
//! ("NOTHING CHECKED"), and with `GPUMEDIC_REQUIRE_GPU=1` (set by `load-tests/gpu-check`) they
//! fail instead, so a run on a GPU machine cannot pass by taking the no-driver branch.

const BIN: &str = env!("CARGO_BIN_EXE_gpumedic-gpu-check");

/// Says that the NVML path of `test` was not exercised; fails when a GPU is required.
fn checked_nothing(test: &str) {
    eprintln!(
        "NOTHING CHECKED: {test}: no NVIDIA driver on this machine, so the NVML path was not exercised; run load-tests/gpu-check on a GPU machine"
    );
    assert!(
        std::env::var_os("GPUMEDIC_REQUIRE_GPU").is_none(),
        "{test}: GPUMEDIC_REQUIRE_GPU is set but NVML is not available: nothing was checked"
    );
}

#[test]
fn reports_gpus_on_a_gpu_machine_or_fails_clearly_without_a_driver() {
    let out = std::process::Command::new(BIN).output().expect("gpu-check runs");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    match out.status.code() {
        Some(0) => assert!(stdout.contains("GPU(s)"), "{stdout}"),
        Some(1) => {
            assert!(stderr.contains("NVML is not available"), "{stderr}");
            assert!(stderr.contains("NVIDIA driver"), "{stderr}");
            assert!(stdout.is_empty(), "nothing on stdout without a driver: {stdout}");
            checked_nothing("reports_gpus_on_a_gpu_machine_or_fails_clearly_without_a_driver (GPU listing)");
        }
        other => panic!("unexpected exit {other:?}: {stderr}"),
    }
}

#[test]
fn json_output_is_json_on_a_gpu_machine_and_checks_nothing_without_a_driver() {
    let out = std::process::Command::new(BIN).arg("--json").output().expect("gpu-check runs");
    if out.status.success() {
        let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("JSON");
        assert!(v.is_array());
    } else {
        assert_eq!(out.status.code(), Some(1));
        checked_nothing("json_output_is_json_on_a_gpu_machine_and_checks_nothing_without_a_driver");
    }
}

#[test]
fn the_kernel_log_mode_runs_a_log_through_the_collectors_parser() {
    use std::io::Write as _;

    let mut child = std::process::Command::new(BIN)
        .args(["--kernel-log", "-"])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .expect("gpu-check runs");
    child
        .stdin
        .take()
        .expect("stdin")
        .write_all(
            b"[ 5523.234118] NVRM: Xid (PCI:0018:01:00): 149, NETIR_LINK_EVT  Fatal   XC0 i0 Link 04 (0x004505c6 0x00000000)\n\
              [ 5523.300000] eth0: link up\n",
        )
        .expect("write");
    let out = child.wait_with_output().expect("gpu-check ends");
    assert!(out.status.success());
    let stdout = String::from_utf8_lossy(&out.stdout);
    let lines: Vec<&str> = stdout.lines().collect();
    assert_eq!(lines.len(), 2, "{stdout}");
    let event: serde_json::Value = serde_json::from_str(lines[0]).expect("one JSON event");
    assert_eq!(event["xid"], 149);
    assert_eq!(event["nvlink5"]["action"], "gpu_reset");
    assert_eq!(lines[1], "kernel log: 2 line(s) read, 1 GPU health event(s) recognised");
}

#[test]
fn the_dcgm_health_and_infiniband_modes_use_the_collectors_readers() {
    let fixture = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/dcgm/health-check-warn.json");
    let out = std::process::Command::new(BIN).args(["--dcgm-health", fixture]).output().expect("gpu-check runs");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{stdout}");
    assert!(stdout.contains("overall Failure, 3 incident(s)"), "{stdout}");
    assert!(stdout.contains("GPU 1 health:memory Fail"), "{stdout}");

    let root = std::env::temp_dir().join(format!("gpu-check-ib-{}", std::process::id()));
    let port = root.join("class/infiniband/mlx5_0/ports/1");
    std::fs::create_dir_all(port.join("counters")).unwrap();
    std::fs::write(port.join("state"), "1: DOWN\n").unwrap();
    std::fs::write(port.join("phys_state"), "2: Polling\n").unwrap();
    std::fs::write(port.join("counters/link_downed"), "4\n").unwrap();
    let out = std::process::Command::new(BIN)
        .args(["--infiniband", root.to_str().unwrap()])
        .output()
        .expect("gpu-check runs");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{stdout}");
    assert!(stdout.contains("1 HCA(s) [mlx5_0], 1 port(s)"), "{stdout}");
    assert!(stdout.contains("mlx5_0/1 DOWN DOWN/Polling"), "{stdout}");
    assert!(stdout.contains("link_downed 4"), "{stdout}");
    std::fs::remove_dir_all(&root).ok();
}
