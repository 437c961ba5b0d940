//! The shipped alerts and dashboards, checked without a cluster: promtool (built by
//! compose/lib/install-promtool.sh) checks the alerting rules and runs their unit tests in
//! k8s/components/prometheus-rules/tests, where every alert has a case that fires and one that
//! stays quiet; the Grafana dashboards are valid, shipped by their kustomization, and read their
//! data source from a variable. That every metric they name is exported is checked against a live
//! pipeline in pipeline_e2e.rs.

#[path = "support/observability.rs"]
mod observability;

use std::collections::BTreeSet;
use std::path::PathBuf;
use std::process::Command;

use observability::{alerts, dashboards, dashboards_dir, metric_names, panel_exprs, regex_matches, rules_dir};

/// promtool as compose/lib/install-promtool.sh places it (`PROMTOOL` overrides).
fn promtool() -> PathBuf {
    if let Some(p) = std::env::var_os("PROMTOOL") {
        return PathBuf::from(p);
    }
    // The pinned version and the cache folder come from the testbed's settings, so they are
    // written down once.
    let common = observability::repo_root().join("compose/lib/common.sh");
    let out = Command::new("bash")
        .arg("-c")
        .arg(r#"source "$1" && printf %s "$BIN_DIR/promtool-$PROMETHEUS_VERSION/promtool""#)
        .arg("bash")
        .arg(&common)
        .output()
        .expect("run bash");
    assert!(out.status.success(), "cannot read {}: {}", common.display(), String::from_utf8_lossy(&out.stderr));
    let path = PathBuf::from(String::from_utf8(out.stdout).expect("a UTF-8 path"));
    assert!(
        path.is_file(),
        "promtool is not at {}: run compose/lib/install-promtool.sh (compose/up and scripts/test.sh run it), which \
         builds it from the Go module proxy",
        path.display()
    );
    path
}

/// A folder holding the rules file made from the PrometheusRule and a copy of the unit tests.
fn rules_workspace() -> PathBuf {
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(gpumedic_testkit::unique_name("alerts"));
    std::fs::create_dir_all(&dir).expect("a scratch folder");
    let rules = serde_yaml::to_string(&observability::rule_groups()).expect("YAML");
    std::fs::write(dir.join("gpumedic.rules.yaml"), rules).expect("write the rules file");
    for entry in std::fs::read_dir(rules_dir().join("tests")).expect("the alert tests' folder") {
        let path = entry.expect("a directory entry").path();
        if path.extension().is_some_and(|e| e == "yaml") {
            std::fs::copy(&path, dir.join(path.file_name().expect("a file name"))).expect("copy a test file");
        }
    }
    dir
}

/// The unit-test files, by name.
fn test_files() -> Vec<(String, serde_yaml::Value)> {
    let mut out = Vec::new();
    for entry in std::fs::read_dir(rules_dir().join("tests")).expect("the alert tests' folder") {
        let path = entry.expect("a directory entry").path();
        if path.extension().is_some_and(|e| e == "yaml") {
            let text = std::fs::read_to_string(&path).expect("a test file");
            let yaml = serde_yaml::from_str(&text).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
            out.push((path.file_name().expect("a file name").to_string_lossy().into_owned(), yaml));
        }
    }
    out.sort_by(|a, b| a.0.cmp(&b.0));
    out
}

fn run(cmd: &mut Command) -> String {
    let out = cmd.output().unwrap_or_else(|e| panic!("cannot run {cmd:?}: {e}"));
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "{cmd:?} failed:\n{text}");
    text
}

#[test]
fn the_alerting_rules_pass_promtool_check_and_their_unit_tests() {
    let promtool = promtool();
    let dir = rules_workspace();
    let checked = run(Command::new(&promtool).current_dir(&dir).args(["check", "rules", "gpumedic.rules.yaml"]));
    assert!(checked.contains("SUCCESS"), "{checked}");
    let files: Vec<String> = test_files().into_iter().map(|(name, _)| name).collect();
    assert!(!files.is_empty(), "the alerts have unit tests");
    let tested = run(Command::new(&promtool).current_dir(&dir).args(["test", "rules"]).args(&files));
    assert!(tested.contains("SUCCESS"), "{tested}");
}

#[test]
fn every_alert_has_a_case_that_fires_and_one_that_stays_quiet() {
    let mut fires = BTreeSet::new();
    let mut quiet = BTreeSet::new();
    for (file, yaml) in test_files() {
        let rule_files: Vec<&str> =
            yaml["rule_files"].as_sequence().into_iter().flatten().filter_map(|f| f.as_str()).collect();
        assert_eq!(rule_files, ["gpumedic.rules.yaml"], "{file} tests the rules made from the PrometheusRule");
        for test in yaml["tests"].as_sequence().unwrap_or_else(|| panic!("{file} has tests")) {
            for case in test["alert_rule_test"].as_sequence().into_iter().flatten() {
                let name = case["alertname"].as_str().unwrap_or_else(|| panic!("{file}: a case names its alert"));
                match case["exp_alerts"].as_sequence() {
                    Some(expected) if !expected.is_empty() => fires.insert(name.to_owned()),
                    _ => quiet.insert(name.to_owned()),
                };
            }
        }
    }
    let all: BTreeSet<String> = alerts().into_iter().map(|(name, _)| name).collect();
    assert!(all.len() >= 19, "the PrometheusRule's alerts are all read: {all:?}");
    let not_firing: Vec<&String> = all.difference(&fires).collect();
    let not_quiet: Vec<&String> = all.difference(&quiet).collect();
    assert!(not_firing.is_empty(), "alerts without a unit test that makes them fire: {not_firing:?}");
    assert!(not_quiet.is_empty(), "alerts without a unit test that keeps them quiet: {not_quiet:?}");
    let unknown: Vec<&String> = fires.union(&quiet).filter(|n| !all.contains(*n)).collect();
    assert!(unknown.is_empty(), "unit tests for alerts that do not exist: {unknown:?}");
}

#[test]
fn every_dashboard_is_grafana_json_that_its_kustomization_ships() {
    let kustomization: serde_yaml::Value = serde_yaml::from_str(
        &std::fs::read_to_string(dashboards_dir().join("kustomization.yaml")).expect("the kustomization"),
    )
    .expect("YAML");
    assert_eq!(kustomization["kind"].as_str(), Some("Component"));
    assert_eq!(kustomization["generatorOptions"]["labels"]["grafana_dashboard"].as_str(), Some("1"));
    let shipped: BTreeSet<String> = kustomization["configMapGenerator"]
        .as_sequence()
        .expect("a configMapGenerator")
        .iter()
        .flat_map(|g| g["files"].as_sequence().expect("files"))
        .map(|f| f.as_str().expect("a file").rsplit('=').next().expect("a source").to_owned())
        .collect();
    let boards = dashboards();
    let files: BTreeSet<String> = boards.iter().map(|(f, _)| f.clone()).collect();
    assert_eq!(files, shipped, "every dashboard file is in a ConfigMap, and every ConfigMap's file exists");
    let expected: BTreeSet<&str> = ["decisions.json", "pipeline.json", "remediation.json"].into();
    assert_eq!(files.iter().map(String::as_str).collect::<BTreeSet<_>>(), expected);

    let mut uids = BTreeSet::new();
    for (file, d) in &boards {
        let uid = d["uid"].as_str().unwrap_or_else(|| panic!("{file} has a uid"));
        assert!(uids.insert(uid.to_owned()), "{file}: uid {uid} is not unique");
        assert!(d["title"].as_str().is_some_and(|t| t.starts_with("gpumedic")), "{file}: title");
        assert!(d["schemaVersion"].as_u64().is_some_and(|v| v >= 39), "{file}: schemaVersion 39 or later");
        let variables = d["templating"]["list"].as_array().unwrap_or_else(|| panic!("{file}: variables"));
        assert!(
            variables
                .iter()
                .any(|v| v["name"] == "datasource" && v["type"] == "datasource" && v["query"] == "prometheus"),
            "{file}: a Prometheus data-source variable"
        );
        let mut ids = BTreeSet::new();
        for panel in d["panels"].as_array().unwrap_or_else(|| panic!("{file}: panels")) {
            let title = panel["title"].as_str().unwrap_or_default();
            assert!(ids.insert(panel["id"].as_u64().expect("a panel id")), "{file}: panel ids are unique");
            let grid = &panel["gridPos"];
            let (x, w) = (grid["x"].as_u64().expect("gridPos.x"), grid["w"].as_u64().expect("gridPos.w"));
            assert!(x + w <= 24 && grid["h"].as_u64().is_some() && grid["y"].as_u64().is_some(), "{file}: {title}");
            if panel["type"] == "row" {
                continue;
            }
            assert_eq!(panel["datasource"]["uid"], "${datasource}", "{file}: {title} reads the chosen data source");
            let targets = panel["targets"].as_array().unwrap_or_else(|| panic!("{file}: {title} has targets"));
            assert!(!targets.is_empty(), "{file}: {title} has targets");
            for t in targets {
                let expr = t["expr"].as_str().unwrap_or_else(|| panic!("{file}: {title}: every target has an expr"));
                assert!(
                    metric_names(expr).plain.iter().any(|n| n.starts_with("gpumedic_")),
                    "{file}: {title}: {expr} reads a gpumedic metric"
                );
                assert!(expr.contains(r#"namespace=~"$namespace""#), "{file}: {title}: {expr} honours $namespace");
            }
        }
        assert!(panel_exprs(d).len() >= 8, "{file} shows something");
    }
}

#[test]
fn the_promql_name_reader_finds_metrics_and_nothing_else() {
    let n = metric_names(
        r#"sum by (namespace, job, topic) (increase({__name__=~"gpumedic_.+_records_total", outcome="dead_lettered"}[15m])) > 0
           and on (namespace) histogram_quantile(0.99, sum by (le) (rate(gpumedic_x_seconds_bucket{a="b{c}"}[$__rate_interval])))
           unless sum without (pod) (gpumedic_y offset 5m) * 1e3 or absent(up) or gpumedic_z"#,
    );
    let plain: Vec<&str> = n.plain.iter().map(String::as_str).collect();
    assert_eq!(plain, ["gpumedic_x_seconds_bucket", "gpumedic_y", "gpumedic_z", "up"]);
    assert_eq!(n.matchers.into_iter().collect::<Vec<_>>(), [("gpumedic_.+_records_total".to_owned(), true)]);

    assert!(regex_matches("gpumedic_.+_records_total", "gpumedic_enricher_records_total"));
    assert!(!regex_matches("gpumedic_.+_records_total", "gpumedic__records_total"));
    assert!(regex_matches("gpumedic_(enricher|classifier)_consumer_lag", "gpumedic_classifier_consumer_lag"));
    assert!(!regex_matches("gpumedic_(enricher|classifier)_consumer_lag", "gpumedic_remediator_consumer_lag"));
    assert!(!regex_matches("gpumedic_.+_lag", "gpumedic_enricher_consumer_lag_total"));

    let text = "# TYPE gpumedic_a_seconds histogram\ngpumedic_a_seconds_bucket{le=\"1\"} 0\ngpumedic_b_total 3\n";
    let names: Vec<String> = observability::exposed_names(text).into_iter().collect();
    assert_eq!(names, ["gpumedic_a_seconds", "gpumedic_a_seconds_bucket", "gpumedic_b_total"]);
}

#[test]
fn the_alerts_and_dashboards_name_gpumedic_metrics_the_services_write() {
    // Cheap and without servers: every literal gpumedic metric name they use appears in the
    // services' code (or is one of the runtime's per-service names). The live check, after a
    // fault through all four services, is in pipeline_e2e.rs.
    let mut source = String::new();
    let mut stack = vec![observability::repo_root().join("services")];
    while let Some(dir) = stack.pop() {
        for entry in std::fs::read_dir(&dir).expect("a source folder") {
            let path = entry.expect("a directory entry").path();
            if path.is_dir() && !path.ends_with("tests") {
                stack.push(path);
            } else if path.extension().is_some_and(|e| e == "rs") {
                source.push_str(&std::fs::read_to_string(&path).expect("a source file"));
            }
        }
    }
    let runtime_suffixes = [
        "_records_total",
        "_handler_retries_total",
        "_dead_letters_failed_total",
        "_poison_records_total",
        "_consumer_lag",
        "_partition_lag",
        "_record_seconds",
        "_record_age_seconds",
        "_batches_total",
        "_batch_seconds",
        "_up",
    ];
    let mut unknown = Vec::new();
    for (name, places) in observability::used_names() {
        if !name.starts_with("gpumedic_") {
            continue;
        }
        let base = ["_bucket", "_sum", "_count"].iter().find_map(|s| name.strip_suffix(s)).unwrap_or(&name);
        let by_runtime = runtime_suffixes.iter().any(|s| {
            base.strip_suffix(s).is_some_and(|svc| {
                ["gpumedic_collector", "gpumedic_enricher", "gpumedic_classifier", "gpumedic_remediator"].contains(&svc)
            })
        });
        if !by_runtime && !source.contains(&format!("\"{base}\"")) {
            unknown.push(format!("{name} ({})", places.into_iter().collect::<Vec<_>>().join("; ")));
        }
    }
    assert!(unknown.is_empty(), "metric names no service writes: {unknown:?}");
}
