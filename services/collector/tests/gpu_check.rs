//! `gpumedic-gpu-check` on this machine: without an NVIDIA driver it fails clearly (exit 1, a
//! message naming NVML); on a GPU machine it prints every GPU.

const BIN: &str = env!("CARGO_BIN_EXE_gpumedic-gpu-check");

#[test]
fn reports_gpus_or_fails_clearly_without_a_driver() {
    let out = std::process::Command::new(BIN).output().expect("gpu-check runs");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    match out.status.code() {
        Some(0) => assert!(stdout.contains("GPU(s)"), "{stdout}"),
        Some(1) => {
            assert!(stderr.contains("NVML is not available"), "{stderr}");
            assert!(stderr.contains("NVIDIA driver"), "{stderr}");
            assert!(stdout.is_empty(), "nothing on stdout without a driver: {stdout}");
        }
        other => panic!("unexpected exit {other:?}: {stderr}"),
    }
}

#[test]
fn json_output_is_json_when_there_is_a_driver() {
    let out = std::process::Command::new(BIN).arg("--json").output().expect("gpu-check runs");
    if out.status.success() {
        let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("JSON");
        assert!(v.is_array());
    } else {
        assert_eq!(out.status.code(), Some(1));
    }
}
