//! What the shipped alerts and dashboards ask Prometheus for: the alerting rules (from the
//! PrometheusRule in k8s/components/prometheus-rules), the Grafana dashboards (in
//! k8s/components/grafana-dashboards), the metric names their PromQL names, and the check that a
//! running pipeline exports every one of them. Shared by `alerts.rs` (promtool, the files
//! themselves) and `pipeline_e2e.rs` (which scrapes all four services after a fault).

// Each test binary that includes this module uses part of it.
#![allow(dead_code)]

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// The repository's root.
pub fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..").canonicalize().expect("repository root")
}

/// The PrometheusRule's folder.
pub fn rules_dir() -> PathBuf {
    repo_root().join("k8s/components/prometheus-rules")
}

/// The dashboards' folder.
pub fn dashboards_dir() -> PathBuf {
    repo_root().join("k8s/components/grafana-dashboards")
}

/// The PrometheusRule's `spec` (its `groups`), which is exactly a Prometheus rules file.
pub fn rule_groups() -> serde_yaml::Value {
    let path = rules_dir().join("prometheusrule.yaml");
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let rule: serde_yaml::Value = serde_yaml::from_str(&text).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let spec = rule.get("spec").cloned().expect("the PrometheusRule has a spec");
    assert!(spec.get("groups").is_some_and(serde_yaml::Value::is_sequence), "the PrometheusRule's spec has groups");
    spec
}

/// Every alerting rule: (alert name, expression).
pub fn alerts() -> Vec<(String, String)> {
    let spec = rule_groups();
    let mut out = Vec::new();
    for group in spec["groups"].as_sequence().expect("groups") {
        for rule in group["rules"].as_sequence().expect("a group's rules") {
            let name = rule["alert"].as_str().expect("every rule is an alert").to_owned();
            out.push((name, rule["expr"].as_str().expect("an alert's expr").to_owned()));
        }
    }
    out
}

/// Every dashboard: (file name, parsed JSON).
pub fn dashboards() -> Vec<(String, serde_json::Value)> {
    let mut out = Vec::new();
    for entry in std::fs::read_dir(dashboards_dir()).expect("the dashboards' folder") {
        let path = entry.expect("a directory entry").path();
        if path.extension().is_some_and(|e| e == "json") {
            let text = std::fs::read_to_string(&path).expect("a dashboard");
            let json = serde_json::from_str(&text).unwrap_or_else(|e| panic!("{} is not JSON: {e}", path.display()));
            out.push((path.file_name().expect("a file name").to_string_lossy().into_owned(), json));
        }
    }
    out.sort_by(|a, b| a.0.cmp(&b.0));
    out
}

/// Every PromQL expression of a dashboard's panels: (panel title, expression).
pub fn panel_exprs(dashboard: &serde_json::Value) -> Vec<(String, String)> {
    let mut out = Vec::new();
    for panel in dashboard["panels"].as_array().expect("a dashboard's panels") {
        for target in panel["targets"].as_array().into_iter().flatten() {
            if let Some(expr) = target["expr"].as_str() {
                out.push((panel["title"].as_str().unwrap_or_default().to_owned(), expr.to_owned()));
            }
        }
    }
    out
}

/// What an expression asks for by name: plain metric names, and `__name__` matchers (as
/// `(regex, is_regex)`).
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Names {
    /// Metric names written out (`rate(x[5m])`, `x{a="b"}`, `x`).
    pub plain: BTreeSet<String>,
    /// `{__name__="..."}` (false) and `{__name__=~"..."}` (true) matchers.
    pub matchers: BTreeSet<(String, bool)>,
}

/// PromQL words that are not metric names where they stand alone.
const KEYWORDS: [&str; 14] = [
    "by",
    "without",
    "on",
    "ignoring",
    "group_left",
    "group_right",
    "and",
    "or",
    "unless",
    "bool",
    "offset",
    "inf",
    "nan",
    "atan2",
];

/// PromQL's aggregation operators, which may stand before `by (...)` instead of `(`.
const AGGREGATIONS: [&str; 14] = [
    "sum",
    "avg",
    "min",
    "max",
    "count",
    "group",
    "stddev",
    "stdvar",
    "topk",
    "bottomk",
    "quantile",
    "count_values",
    "limitk",
    "limit_ratio",
];

/// The metric names in a PromQL expression: identifiers not followed by `(` (functions and
/// aggregations are), not keywords, outside label matchers, ranges and strings; label lists after
/// `by`/`without`/`on`/`ignoring`/`group_*` are skipped, and `__name__` matchers are collected.
/// Grafana's `$variables` only ever stand in strings and ranges, which are skipped.
pub fn metric_names(expr: &str) -> Names {
    let chars: Vec<char> = expr.chars().collect();
    let mut names = Names::default();
    let mut i = 0;
    let ident_start = |c: char| c.is_ascii_alphabetic() || c == '_' || c == ':';
    let ident_char = |c: char| c.is_ascii_alphanumeric() || c == '_' || c == ':';
    while i < chars.len() {
        let c = chars[i];
        if c == '"' || c == '\'' || c == '`' {
            i = skip_string(&chars, i);
        } else if c == '[' {
            while i < chars.len() && chars[i] != ']' {
                i += 1;
            }
            i += 1;
        } else if c == '{' {
            let start = i + 1;
            while i < chars.len() && chars[i] != '}' {
                if chars[i] == '"' || chars[i] == '\'' || chars[i] == '`' {
                    i = skip_string(&chars, i);
                } else {
                    i += 1;
                }
            }
            let body: String = chars[start..i.min(chars.len())].iter().collect();
            names.matchers.extend(name_matchers(&body));
            i += 1;
        } else if c.is_ascii_digit() || c == '.' {
            // A number or a duration (1e3, 0.99, 5m).
            while i < chars.len() && (chars[i].is_ascii_alphanumeric() || chars[i] == '.') {
                i += 1;
            }
        } else if ident_start(c) {
            let start = i;
            while i < chars.len() && ident_char(chars[i]) {
                i += 1;
            }
            let word: String = chars[start..i].iter().collect();
            let mut j = i;
            while j < chars.len() && chars[j].is_whitespace() {
                j += 1;
            }
            let called = j < chars.len() && chars[j] == '(';
            if called && ["by", "without", "on", "ignoring", "group_left", "group_right"].contains(&word.as_str()) {
                // A label list, not an expression.
                while j < chars.len() && chars[j] != ')' {
                    j += 1;
                }
                i = j + 1;
            } else if !called
                && !KEYWORDS.contains(&word.to_ascii_lowercase().as_str())
                && !AGGREGATIONS.contains(&word.as_str())
            {
                names.plain.insert(word);
            }
        } else {
            i += 1;
        }
    }
    names
}

/// The index just past the string literal that opens at `i`.
fn skip_string(chars: &[char], i: usize) -> usize {
    let quote = chars[i];
    let mut j = i + 1;
    while j < chars.len() && chars[j] != quote {
        if chars[j] == '\\' && quote != '`' {
            j += 1;
        }
        j += 1;
    }
    j + 1
}

/// The `__name__` matchers in a label-matcher list such as `a="b", __name__=~"x_.+"`.
fn name_matchers(body: &str) -> Vec<(String, bool)> {
    let mut out = Vec::new();
    let mut rest = body;
    while let Some(at) = rest.find("__name__") {
        let after = rest[at + "__name__".len()..].trim_start();
        let (is_regex, after) = if let Some(a) = after.strip_prefix("=~") {
            (true, a)
        } else if let Some(a) = after.strip_prefix('=') {
            (false, a)
        } else {
            panic!("a __name__ matcher this check does not know (only = and =~): {body}");
        };
        let after = after.trim_start();
        let quote = after.chars().next().expect("a quoted value");
        let value_end = after[1..].find(quote).expect("a closed string") + 1;
        out.push((after[1..value_end].to_owned(), is_regex));
        rest = &after[value_end + 1..];
    }
    out
}

/// Whether the anchored regex `pattern` matches `name`. Knows the part of RE2 the rules use:
/// literals, `.`, `.+`, `.*` and `(a|b|c)` groups of literals; anything else panics, so a new
/// pattern is extended here rather than silently passed.
pub fn regex_matches(pattern: &str, name: &str) -> bool {
    #[derive(Debug)]
    enum Tok {
        Lit(char),
        Any,
        AnyPlus,
        AnyStar,
        Alt(Vec<String>),
    }
    let mut toks = Vec::new();
    let p: Vec<char> = pattern.chars().collect();
    let mut i = 0;
    while i < p.len() {
        match p[i] {
            '.' if p.get(i + 1) == Some(&'+') => {
                toks.push(Tok::AnyPlus);
                i += 2;
            }
            '.' if p.get(i + 1) == Some(&'*') => {
                toks.push(Tok::AnyStar);
                i += 2;
            }
            '.' => {
                toks.push(Tok::Any);
                i += 1;
            }
            '(' => {
                let close = p[i..].iter().position(|c| *c == ')').expect("a closed group") + i;
                let inner: String = p[i + 1..close].iter().collect();
                assert!(
                    inner.chars().all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '|'),
                    "regex group {inner:?} in {pattern:?} is more than this check knows"
                );
                toks.push(Tok::Alt(inner.split('|').map(str::to_owned).collect()));
                i = close + 1;
            }
            c if c.is_ascii_alphanumeric() || c == '_' || c == ':' => {
                toks.push(Tok::Lit(c));
                i += 1;
            }
            c => panic!("regex {pattern:?} uses {c:?}, which this check does not know"),
        }
    }
    fn go(toks: &[Tok], s: &str) -> bool {
        let Some((first, rest)) = toks.split_first() else { return s.is_empty() };
        match first {
            Tok::Lit(c) => s.strip_prefix(*c).is_some_and(|s| go(rest, s)),
            Tok::Any => s.chars().next().is_some_and(|c| go(rest, &s[c.len_utf8()..])),
            Tok::AnyPlus | Tok::AnyStar => {
                let min = usize::from(matches!(first, Tok::AnyPlus));
                (min..=s.len()).any(|k| s.is_char_boundary(k) && go(rest, &s[k..]))
            }
            Tok::Alt(options) => options.iter().any(|o| s.strip_prefix(o.as_str()).is_some_and(|s| go(rest, s))),
        }
    }
    go(&toks, name)
}

/// Metrics the alerts read from outside gpumedic: kube-state-metrics and Prometheus itself.
pub const EXTERNAL: [&str; 5] = [
    "up",
    "kube_deployment_status_replicas_available",
    "kube_deployment_spec_replicas",
    "kube_daemonset_status_desired_number_scheduled",
    "kube_daemonset_status_number_ready",
];

/// gpumedic metrics a fault through the pipeline does not make appear, each with the reason. Keep
/// this short: a counter that moves only on a rare event is better registered at zero when its
/// service starts.
pub const NOT_IN_A_PIPELINE_RUN: [(&str, &str); 1] = [(
    "gpumedic_collector_events_refused_total",
    "counted when Kafka refuses an event for good; its `kind` label is known only then",
)];

/// Where each metric name is used: name → the alerts and panels that use it. `__name__` regexes
/// are keyed as `~regex`.
pub fn used_names() -> BTreeMap<String, BTreeSet<String>> {
    let mut used: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    let mut add = |names: Names, place: String| {
        for n in names.plain {
            used.entry(n).or_default().insert(place.clone());
        }
        for (m, is_regex) in names.matchers {
            let key = if is_regex { format!("~{m}") } else { m };
            used.entry(key).or_default().insert(place.clone());
        }
    };
    for (alert, expr) in alerts() {
        add(metric_names(&expr), format!("alert {alert}"));
    }
    for (file, dashboard) in dashboards() {
        for (title, expr) in panel_exprs(&dashboard) {
            add(metric_names(&expr), format!("dashboard {file}, panel {title:?}"));
        }
    }
    used
}

/// The metric names in Prometheus text exposition: every sample's name, and every `# TYPE`'d
/// family (so a histogram is known by its base name and by `_bucket`, `_sum` and `_count`).
pub fn exposed_names(text: &str) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    for line in text.lines() {
        if let Some(rest) = line.strip_prefix("# TYPE ") {
            if let Some(name) = rest.split_whitespace().next() {
                out.insert(name.to_owned());
            }
        } else if !line.starts_with('#') && !line.trim().is_empty() {
            let end = line.find(['{', ' ']).unwrap_or(line.len());
            out.insert(line[..end].to_owned());
        }
    }
    out
}

/// Panics, listing each, when an alert or a dashboard panel names a metric none of the scraped
/// `/metrics` texts export (other than [`EXTERNAL`] and [`NOT_IN_A_PIPELINE_RUN`]), or a
/// `__name__` regex that matches none.
pub fn assert_every_used_metric_is_exported(scrapes: &[String]) {
    let exported: BTreeSet<String> = scrapes.iter().flat_map(|s| exposed_names(s)).collect();
    let allowed: BTreeSet<&str> = NOT_IN_A_PIPELINE_RUN.iter().map(|(n, _)| *n).chain(EXTERNAL).collect();
    let mut missing = Vec::new();
    for (name, places) in used_names() {
        let found = match name.strip_prefix('~') {
            Some(regex) => exported.iter().any(|e| regex_matches(regex, e)),
            None => exported.contains(&name) || allowed.contains(name.as_str()),
        };
        if !found {
            missing.push(format!("  {name}, used by {}", places.into_iter().collect::<Vec<_>>().join("; ")));
        }
    }
    assert!(
        missing.is_empty(),
        "metrics named by the alerts or dashboards that no service exported after a fault went through the \
         pipeline:\n{}\n(exported: {} names)",
        missing.join("\n"),
        exported.len()
    );
}
