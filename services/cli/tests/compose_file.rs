//! `compose/docker-compose.yml` is for people with Docker, which CI does not run: these tests read
//! it instead. Every flag and environment variable it passes to a gpumedic binary must be one that
//! binary knows (its `--help`: the flags, and the `[env: GPUMEDIC_...=]` names of clap), and the
//! collector must start as `gpumedic demo` starts it: simulated GPUs, the kernel log off, and a
//! state folder on a volume its non-root user may write.
//!
//! Needs the binaries (`cargo build --workspace --bins`); no server.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::process::Command;

use serde_yaml::Value;

/// Variables the binaries read that are not their own clap arguments, and who reads them.
const OTHER_ENV: &[(&str, &str)] = &[("KUBECONFIG", "the Kubernetes client (kube)")];

fn compose() -> Value {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../compose/docker-compose.yml");
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let mut doc: Value = serde_yaml::from_str(&text).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    // `<<: *service-env` merges as Docker Compose does.
    doc.apply_merge().expect("YAML merge keys");
    doc
}

fn services(doc: &Value) -> Vec<(String, &Value)> {
    doc["services"]
        .as_mapping()
        .expect("services")
        .iter()
        .map(|(k, v)| (k.as_str().expect("service name").to_owned(), v))
        .collect()
}

fn strings(v: &Value) -> Vec<String> {
    v.as_sequence().map(|s| s.iter().map(|x| x.as_str().expect("a string").to_owned()).collect()).unwrap_or_default()
}

/// A service's environment, from the map or the `K=V` list form.
fn environment(service: &Value) -> BTreeMap<String, String> {
    let env = &service["environment"];
    if let Some(map) = env.as_mapping() {
        map.iter()
            .map(|(k, v)| {
                let v = match v {
                    Value::String(s) => s.clone(),
                    other => serde_yaml::to_string(other).expect("a value").trim().to_owned(),
                };
                (k.as_str().expect("variable name").to_owned(), v)
            })
            .collect()
    } else {
        strings(env)
            .into_iter()
            .map(|kv| {
                let (k, v) = kv.split_once('=').unwrap_or((&kv, ""));
                (k.to_owned(), v.to_owned())
            })
            .collect()
    }
}

fn help(binary: &str) -> String {
    let path = gpumedic_testkit::workspace_binary(binary).unwrap_or_else(|e| panic!("{e}"));
    let out = Command::new(&path).arg("--help").output().expect("the binary runs");
    assert!(out.status.success(), "{binary} --help failed: {}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// Whether `--help` text lists option `flag` (`--name`, or `-n`).
fn lists_flag(help: &str, flag: &str) -> bool {
    help.lines().any(|l| {
        let l = l.trim_start();
        l.starts_with('-')
            && l.split([' ', ',', '=']).take_while(|t| t.starts_with('-') || t.is_empty()).any(|t| t == flag)
    })
}

#[test]
fn every_flag_and_variable_the_compose_file_passes_is_known_to_its_binary() {
    let doc = compose();
    let mut checked = 0;
    let mut unknown = Vec::new();
    for (name, service) in services(&doc) {
        let command = strings(&service["command"]);
        let Some(binary) = command.first().filter(|b| b.starts_with("gpumedic")) else { continue };
        let help = help(binary);
        for arg in command.iter().skip(1).filter(|a| a.starts_with('-')) {
            let flag = arg.split('=').next().unwrap_or(arg);
            if !lists_flag(&help, flag) {
                unknown.push(format!("{name}: {binary} has no flag {flag}"));
            }
        }
        for key in environment(service).keys() {
            let known = if key.starts_with("GPUMEDIC_") {
                help.contains(&format!("[env: {key}="))
            } else {
                OTHER_ENV.iter().any(|(k, _)| k == key)
            };
            if !known {
                unknown.push(format!("{name}: {binary} reads no variable {key}"));
            }
        }
        checked += 1;
    }
    assert!(checked >= 4, "the compose file runs {checked} gpumedic binaries; expected the four services");
    assert!(
        unknown.is_empty(),
        "compose/docker-compose.yml passes what its binaries do not know:\n{}",
        unknown.join("\n")
    );
}

#[test]
fn every_service_listens_where_its_ports_point() {
    let doc = compose();
    for (name, service) in services(&doc) {
        let Some(addr) = environment(service).get("GPUMEDIC_ADMIN_ADDR").cloned() else { continue };
        let port = addr.rsplit(':').next().expect("a port");
        let ports = strings(&service["ports"]);
        assert!(
            ports.iter().any(|p| p.rsplit(':').next() == Some(port)),
            "{name} listens on {addr}, but its ports {ports:?} map no host port to {port}"
        );
    }
}

#[test]
fn the_collector_starts_as_the_demo_starts_it() {
    let doc = compose();
    let all = services(&doc);
    let (_, collector) = all
        .iter()
        .find(|(_, s)| strings(&s["command"]).first().map(String::as_str) == Some("gpumedic-collector"))
        .expect("a collector service");
    let env = environment(collector);
    assert_eq!(env.get("GPUMEDIC_GPU_BACKEND").map(String::as_str), Some("simulated"), "no GPU in a compose run");
    assert_eq!(env.get("GPUMEDIC_KMSG_PATH").map(String::as_str), Some("off"), "/dev/kmsg needs privileges");
    let state = env.get("GPUMEDIC_STATE_DIR").expect("the collector needs a writable state folder");

    // The state folder is a named volume...
    let mount = strings(&collector["volumes"])
        .into_iter()
        .find(|v| v.split(':').nth(1) == Some(state.as_str()))
        .unwrap_or_else(|| panic!("no volume is mounted at the collector's state folder {state}"));
    let volume = mount.split(':').next().expect("a volume").to_owned();
    assert!(
        doc["volumes"].as_mapping().is_some_and(|m| m.contains_key(volume.as_str())),
        "{volume} is not a named volume of the compose file"
    );
    // ...that a root container hands to the image's user before the collector starts.
    let (init, init_service) = all
        .iter()
        .find(|(_, s)| {
            s["user"].as_str().is_some_and(|u| u.starts_with("0"))
                && strings(&s["volumes"]).contains(&mount)
                && strings(&s["command"]).first().map(String::as_str) == Some("chown")
        })
        .unwrap_or_else(|| panic!("no root container makes {volume} writable for the collector"));
    let dockerfile = std::fs::read_to_string(PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../Dockerfile"))
        .expect("the Dockerfile");
    let user = dockerfile.lines().rev().find_map(|l| l.strip_prefix("USER ")).map(str::trim).expect("the image's USER");
    let chown = strings(&init_service["command"]);
    assert_eq!(chown.get(1).map(String::as_str), Some(user), "{init} must hand {volume} to the image's user {user}");
    assert_eq!(
        collector["depends_on"][init.as_str()]["condition"].as_str(),
        Some("service_completed_successfully"),
        "the collector must start after {init} has finished"
    );
}
