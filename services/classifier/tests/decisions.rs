//! The decision-quality corpus: every scenario in `tests/decisions/*.yaml` run through the default
//! rule set, its decisions judged against what docs/decisions.md says should happen.
//!
//! A scenario is a small fleet, a timeline of events and the expected outcome (the format is in
//! docs/decisions.md, "The decision-quality corpus"). Each event becomes the
//! [`Observation`] the classifier's mapping (`observe.rs`) builds from the enriched record: GPUs
//! named by their resolved UUID with PCI bus id and index, the node's current boot id, the
//! collector's publish time. The engine is ticked at every event's time, at every checkpoint and
//! at the end, as the live classifier's ticker would. The decisions go through
//! [`gpumedic_classifier::quality`], which says when each node and GPU was out of service.
//!
//! On failure the test prints every failing scenario with what was expected, what happened and
//! every decision, then the quality summary over the whole corpus. Pure logic; no server.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt::Write as _;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::path::{Path, PathBuf};

use gpumedic_classifier::lemons::{self, Ledger};
use gpumedic_classifier::nvlink::Roots;
use gpumedic_classifier::quality::{Checkpoint, Expect, Expectations, Miss, Options, Summary, Target, Timeline};
use gpumedic_classifier::rules::{Decision, Engine, FieldValue, Observation, RuleSet, defaults, parse_duration};
use serde::Deserialize;

/// The fewest scenarios the corpus may have.
const MIN_SCENARIOS: usize = 40;
/// Scenario time zero, in microseconds since the Unix epoch (2025-10-09T08:53:20Z).
const T0: i64 = 1_760_000_000_000_000;
/// The most observations one event line may expand to (a typo in `every` should not hang).
const MAX_EXPANSION: usize = 200_000;

// ---------------------------------------------------------------------------------------------
// The format.

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct Scenario {
    description: String,
    source: String,
    nodes: BTreeMap<String, NodeSpec>,
    /// When the run ends (the latest event or checkpoint when absent).
    #[serde(default)]
    end: Option<String>,
    events: Vec<EventSpec>,
    /// Per node: a quality `Expect`, plus `gpus: {index: Expect}`. Nodes not listed are expected
    /// never to be quarantined.
    #[serde(default)]
    expect: BTreeMap<String, serde_yaml::Value>,
    #[serde(default)]
    checkpoints: Vec<CheckpointSpec>,
    /// Oscillations over the whole run.
    #[serde(default)]
    oscillations: Option<usize>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct NodeSpec {
    gpus: u32,
    /// The NVLink domain of the node's GPUs (its `nvidia.com/gpu.clique` label), when in one.
    #[serde(default)]
    nvlink_domain: Option<String>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct CheckpointSpec {
    at: String,
    node: String,
    #[serde(default)]
    gpu: Option<u32>,
    in_service: bool,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
enum GpuSel {
    One(u32),
    Many(Vec<u32>),
    Word(String),
}

#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
enum NodeSel {
    Many(Vec<String>),
    Word(String),
}

#[derive(Debug, Clone, Copy, Deserialize)]
#[serde(untagged)]
enum Num {
    Int(i64),
    Float(f64),
}

impl From<Num> for FieldValue {
    fn from(n: Num) -> FieldValue {
        match n {
            Num::Int(i) => FieldValue::Int(i),
            Num::Float(f) => FieldValue::Float(f),
        }
    }
}

impl Num {
    fn as_f64(self) -> f64 {
        match self {
            Num::Int(i) => i as f64,
            Num::Float(f) => f,
        }
    }
}

/// One line of a timeline; `every`/`until` repeat it, `nodes`/`gpu` fan it out.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct EventSpec {
    at: String,
    #[serde(default)]
    every: Option<String>,
    #[serde(default)]
    until: Option<String>,
    #[serde(default)]
    node: Option<String>,
    #[serde(default)]
    nodes: Option<NodeSel>,
    #[serde(default)]
    gpu: Option<GpuSel>,
    kind: String,
    #[serde(default)]
    id: Option<String>,
    #[serde(default)]
    source: Option<String>,
    #[serde(default)]
    healthy: Option<bool>,
    /// Stamped this much after (or, with `-`, before) it was published.
    #[serde(default)]
    skew: Option<String>,
    #[serde(default)]
    boot_id: Option<String>,
    #[serde(default)]
    workload: Option<String>,
    #[serde(default)]
    workloads: Option<Vec<String>>,
    // xid, sxid
    #[serde(default)]
    code: Option<u32>,
    #[serde(default)]
    pid: Option<i64>,
    #[serde(default)]
    process: Option<String>,
    #[serde(default)]
    recovery_action: Option<String>,
    #[serde(default)]
    fatal: Option<bool>,
    // readings
    #[serde(default)]
    value: Option<Num>,
    #[serde(default)]
    slowdown: Option<Num>,
    #[serde(default)]
    shutdown: Option<Num>,
    #[serde(default)]
    limit: Option<Num>,
    #[serde(default)]
    reason: Option<String>,
    #[serde(default)]
    link_state: Option<String>,
    #[serde(default)]
    crc_errors: Option<i64>,
    #[serde(default)]
    recovery_errors: Option<i64>,
    #[serde(default)]
    pending: Option<bool>,
    #[serde(default)]
    failure: Option<bool>,
    #[serde(default)]
    correctable: Option<i64>,
    #[serde(default)]
    uncorrectable: Option<i64>,
    #[serde(default)]
    total: Option<i64>,
    #[serde(default)]
    single_bit_volatile: Option<i64>,
    #[serde(default)]
    double_bit_volatile: Option<i64>,
    #[serde(default)]
    single_bit_aggregate: Option<i64>,
    #[serde(default)]
    double_bit_aggregate: Option<i64>,
    /// pcie_aer: corrected, non_fatal, fatal.
    #[serde(default)]
    severity: Option<String>,
    /// dcgm_diag: pass, fail.
    #[serde(default)]
    result: Option<String>,
    #[serde(default)]
    check: Option<String>,
    /// cloud_maintenance: scheduled, cancelled, completed; monitor_health: ok, hung, failed.
    #[serde(default)]
    state: Option<String>,
    /// cloud_maintenance: the provider's event type.
    #[serde(default)]
    event: Option<String>,
    #[serde(default)]
    starts: Option<String>,
    #[serde(default)]
    ends: Option<String>,
    #[serde(default)]
    monitor: Option<String>,
    /// gpu_inventory: the GPUs present.
    #[serde(default)]
    present: Option<GpuSel>,
    /// custom: the values, each a field of the observation (text, as observe.rs maps them).
    #[serde(default)]
    values: Option<BTreeMap<String, String>>,
    /// custom: the component (`node` by default, `gpu`, `pcie`).
    #[serde(default)]
    component: Option<String>,
}

/// The kinds a scenario may use; `reboot` is not an observation but gives the node a new boot id.
const SCENARIO_KINDS: &[&str] = &[
    "xid",
    "sxid",
    "gpu_lost",
    "ecc",
    "row_remap",
    "retired_pages",
    "temperature",
    "power",
    "throttle",
    "nvlink",
    "pcie_replay",
    "pcie_aer",
    "mce",
    "dcgm_diag",
    "dcgm_health",
    "cloud_maintenance",
    "monitor_health",
    "gpu_inventory",
    "custom",
    "reboot",
];

/// Kinds that are about one GPU.
const GPU_KINDS: &[&str] = &[
    "xid",
    "gpu_lost",
    "ecc",
    "row_remap",
    "retired_pages",
    "temperature",
    "power",
    "throttle",
    "nvlink",
    "dcgm_diag",
];

// ---------------------------------------------------------------------------------------------
// From the format to observations.

fn micros(text: &str) -> Result<i64, String> {
    let (neg, body) = match text.trim().strip_prefix('-') {
        Some(rest) => (true, rest),
        None => (false, text.trim()),
    };
    let d = parse_duration(body).map_err(|e| e.to_string())?.micros();
    Ok(if neg { -d } else { d })
}

fn uuid(node: &str, i: u32) -> String {
    format!("GPU-{node}-{i}")
}

fn pci(i: u32) -> String {
    format!("0000:{:02x}:00.0", 0x18 + i * 0x10)
}

/// Renders a time relative to the scenario's start, e.g. `1h30m` or `-5s`.
fn rel(t: i64) -> String {
    let d = t.saturating_sub(T0);
    if d == i64::MIN || d.unsigned_abs() > 400 * 86_400_000_000 {
        return format!("@{t}us");
    }
    let (sign, mut us) = if d < 0 { ("-", -d) } else { ("", d) };
    let mut out = String::from(sign);
    for (unit, size) in [("d", 86_400_000_000), ("h", 3_600_000_000), ("m", 60_000_000), ("s", 1_000_000)] {
        if us >= size {
            out.push_str(&format!("{}{unit}", us / size));
            us %= size;
        }
    }
    if us > 0 {
        out.push_str(&format!("{}ms", us / 1000));
    }
    if out.is_empty() || out == "-" { "0s".into() } else { out }
}

/// What happens at one point of the run.
#[derive(Debug, Clone)]
enum Step {
    /// The node reboots: later events carry a new boot id (this one when given).
    Reboot { node: String, boot_id: Option<String> },
    /// An observation; its boot id is the node's current one unless the event names one.
    Observe { o: Box<Observation>, boot_id: Option<String> },
}

#[derive(Debug)]
struct Loaded {
    name: String,
    scenario: Scenario,
    steps: Vec<(i64, Step)>,
    expectations: Expectations,
    end: i64,
}

fn gpus_of(sel: &GpuSel, count: u32, what: &str) -> Result<Vec<u32>, String> {
    let list = match sel {
        GpuSel::One(i) => vec![*i],
        GpuSel::Many(v) => v.clone(),
        GpuSel::Word(w) if w == "all" => (0..count).collect(),
        GpuSel::Word(w) => return Err(format!("{what}: `{w}` is not a GPU index, a list of them or `all`")),
    };
    if let Some(bad) = list.iter().find(|i| **i >= count) {
        return Err(format!("{what}: GPU {bad} does not exist (the node has {count})"));
    }
    Ok(list)
}

fn load(path: &Path) -> Result<Loaded, String> {
    let text = std::fs::read_to_string(path).map_err(|e| format!("cannot read: {e}"))?;
    let scenario: Scenario = serde_yaml::from_str(&text).map_err(|e| e.to_string())?;
    if scenario.description.trim().is_empty() || scenario.source.trim().is_empty() {
        return Err("`description` and `source` must say something".into());
    }
    if scenario.nodes.is_empty() || scenario.events.is_empty() {
        return Err("a scenario needs nodes and events".into());
    }
    let mut steps: Vec<(i64, Step)> = Vec::new();
    for (i, ev) in scenario.events.iter().enumerate() {
        let line = format!("event {} ({} at {})", i + 1, ev.kind, ev.at);
        expand(&scenario, i, ev, &mut steps).map_err(|e| format!("{line}: {e}"))?;
    }
    // Stable: events at the same time keep their order in the file.
    steps.sort_by_key(|(t, _)| *t);
    let mut expectations = Expectations { oscillations: scenario.oscillations, ..Default::default() };
    for name in scenario.expect.keys() {
        if !scenario.nodes.contains_key(name) {
            return Err(format!("expect: node `{name}` is not in `nodes`"));
        }
    }
    for (name, spec) in &scenario.nodes {
        let Some(value) = scenario.expect.get(name) else {
            expectations.targets.push((Target::node(name), Expect { quarantined: Some(false), ..Default::default() }));
            continue;
        };
        let mut value = value.clone();
        let gpus = match value.as_mapping_mut() {
            Some(m) => m.remove("gpus"),
            None => return Err(format!("expect.{name}: expected a mapping")),
        };
        let node_expect: Expect = serde_yaml::from_value(value).map_err(|e| format!("expect.{name}: {e}"))?;
        expectations.targets.push((Target::node(name), node_expect));
        if let Some(gpus) = gpus {
            let gpus: BTreeMap<u32, Expect> =
                serde_yaml::from_value(gpus).map_err(|e| format!("expect.{name}.gpus: {e}"))?;
            for (i, e) in gpus {
                gpus_of(&GpuSel::One(i), spec.gpus, &format!("expect.{name}.gpus"))?;
                expectations.targets.push((Target::gpu(name, uuid(name, i)), e));
            }
        }
    }
    for c in &scenario.checkpoints {
        let Some(spec) = scenario.nodes.get(&c.node) else {
            return Err(format!("checkpoint at {}: node `{}` is not in `nodes`", c.at, c.node));
        };
        let target = match c.gpu {
            Some(i) => {
                gpus_of(&GpuSel::One(i), spec.gpus, "checkpoint")?;
                Target::gpu(&c.node, uuid(&c.node, i))
            }
            None => Target::node(&c.node),
        };
        let at = T0 + micros(&c.at).map_err(|e| format!("checkpoint at {}: {e}", c.at))?;
        expectations.checkpoints.push(Checkpoint {
            at_micros: at,
            target,
            in_service: c.in_service,
            label: c.at.clone(),
        });
    }
    let last_step = steps.last().map_or(T0, |(t, _)| *t);
    let last_checkpoint = expectations.checkpoints.iter().map(|c| c.at_micros).max().unwrap_or(T0);
    let end = match &scenario.end {
        Some(e) => T0 + micros(e).map_err(|err| format!("end: {err}"))?,
        None => last_step.max(last_checkpoint),
    };
    if end < last_step.max(last_checkpoint) {
        return Err("`end` is before the last event or checkpoint".into());
    }
    let name = path.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
    Ok(Loaded { name, scenario, steps, expectations, end })
}

fn expand(s: &Scenario, index: usize, ev: &EventSpec, out: &mut Vec<(i64, Step)>) -> Result<(), String> {
    if !SCENARIO_KINDS.contains(&ev.kind.as_str()) {
        return Err(format!("unknown kind; one of {}", SCENARIO_KINDS.join(", ")));
    }
    let start = micros(&ev.at)?;
    let times: Vec<i64> = match (&ev.every, &ev.until) {
        (None, None) => vec![start],
        (Some(every), Some(until)) => {
            let (every, until) = (micros(every)?, micros(until)?);
            if every <= 0 || until < start {
                return Err("`every` must be positive and `until` not before `at`".into());
            }
            let n = usize::try_from((until - start) / every + 1).map_err(|e| e.to_string())?;
            if n > MAX_EXPANSION {
                return Err(format!("repeats {n} times; at most {MAX_EXPANSION}"));
            }
            (0..n as i64).map(|k| start + k * every).collect()
        }
        _ => return Err("`every` and `until` go together".into()),
    };
    let nodes: Vec<String> = match (&ev.node, &ev.nodes) {
        (Some(n), None) => vec![n.clone()],
        (None, Some(NodeSel::Many(v))) => v.clone(),
        (None, Some(NodeSel::Word(w))) if w == "all" => s.nodes.keys().cloned().collect(),
        (None, Some(NodeSel::Word(w))) => vec![w.clone()],
        _ => return Err("name exactly one of `node` and `nodes`".into()),
    };
    let gpu_kind = GPU_KINDS.contains(&ev.kind.as_str());
    if gpu_kind && ev.gpu.is_none() {
        return Err("this kind is about one GPU: give `gpu`".into());
    }
    if ev.id.is_some()
        && (times.len() > 1 || nodes.len() > 1 || matches!(ev.gpu, Some(GpuSel::Many(_) | GpuSel::Word(_))))
    {
        return Err("an explicit `id` names one event; it cannot repeat or fan out".into());
    }
    if ev.kind == "reboot" && ev.gpu.is_some() {
        return Err("a reboot is of the whole node".into());
    }
    for node in &nodes {
        let Some(spec) = s.nodes.get(node) else { return Err(format!("node `{node}` is not in `nodes`")) };
        let gpus: Vec<Option<u32>> = match &ev.gpu {
            Some(sel) => gpus_of(sel, spec.gpus, "gpu")?.into_iter().map(Some).collect(),
            None => vec![None],
        };
        for (k, t) in times.iter().enumerate() {
            let at = T0 + t;
            if ev.kind == "reboot" {
                out.push((at, Step::Reboot { node: node.clone(), boot_id: ev.boot_id.clone() }));
                continue;
            }
            for gpu in &gpus {
                let id = match &ev.id {
                    Some(id) => id.clone(),
                    None => {
                        let g = gpu.map(|g| format!("-g{g}")).unwrap_or_default();
                        format!("e{}.{k}-{node}{g}", index + 1)
                    }
                };
                let mut o = observation(ev, node, spec.gpus, *gpu, id, at)?;
                if o.gpu.is_some() {
                    o.nvlink_domain = spec.nvlink_domain.clone();
                }
                out.push((at, Step::Observe { o: Box::new(o), boot_id: ev.boot_id.clone() }));
            }
        }
    }
    Ok(())
}

fn need<T: Clone>(v: &Option<T>, key: &str) -> Result<T, String> {
    v.clone().ok_or_else(|| format!("`{key}` is required for this kind"))
}

/// The observation `observe.rs` builds for this event (boot id set when the run reaches it).
fn observation(
    ev: &EventSpec,
    node: &str,
    gpu_count: u32,
    gpu: Option<u32>,
    id: String,
    published: i64,
) -> Result<Observation, String> {
    let observed = published + ev.skew.as_deref().map(micros).transpose()?.unwrap_or(0);
    let kind = ev.kind.as_str();
    let mut o = Observation::new(id, node, observed, kind);
    o.received_at_micros = Some(published);
    if let Some(i) = gpu {
        o.gpu = Some(uuid(node, i));
        o.gpu_index = Some(i as i32);
        o.gpu_pci = Some(pci(i));
    }
    o.workloads = ev.workloads.clone().unwrap_or_default();
    o.workloads.extend(ev.workload.clone());
    let (source, component, healthy) = match kind {
        "xid" => {
            o = o.xid(need(&ev.code, "code")?);
            if let Some(pid) = ev.pid {
                o = o.field("pid", pid);
            }
            if let Some(p) = &ev.process {
                o = o.field("process", p.as_str());
            }
            if let Some(a) = &ev.recovery_action {
                o = o.field("recovery_action", recovery_action(a)?);
            }
            ("kernel_log", "gpu", false)
        }
        "sxid" => {
            o = o.xid(need(&ev.code, "code")?);
            if let Some(fatal) = ev.fatal {
                o = o.field("severity", if fatal { "fatal" } else { "non_fatal" });
            }
            ("kernel_log", "nvswitch", false)
        }
        "gpu_lost" => ("nvml", "gpu", false),
        "ecc" => {
            let mut zero = true;
            for (name, v) in [
                ("single_bit_volatile", ev.single_bit_volatile),
                ("double_bit_volatile", ev.double_bit_volatile),
                ("single_bit_aggregate", ev.single_bit_aggregate),
                ("double_bit_aggregate", ev.double_bit_aggregate),
            ] {
                if let Some(v) = v {
                    o = o.field(name, v);
                    zero &= !name.ends_with("volatile") || v == 0;
                }
            }
            ("nvml", "gpu", zero)
        }
        "row_remap" => {
            let (pending, failure) = (ev.pending.unwrap_or(false), ev.failure.unwrap_or(false));
            o = o
                .field("failure", failure)
                .field("pending", pending)
                .field("correctable", ev.correctable.unwrap_or(0))
                .field("uncorrectable", ev.uncorrectable.unwrap_or(0));
            ("nvml", "gpu", !pending && !failure)
        }
        "retired_pages" => {
            let pending = ev.pending.unwrap_or(false);
            o = o.field("total", ev.total.unwrap_or(0)).field("pending", pending);
            ("nvml", "gpu", !pending)
        }
        "temperature" => {
            let value = need(&ev.value, "value")?;
            o = o.field("value", value);
            if let Some(s) = ev.slowdown {
                o = o.field("slowdown_threshold", s);
            }
            if let Some(s) = ev.shutdown {
                o = o.field("shutdown_threshold", s);
            }
            let normal = ev.slowdown.is_none_or(|s| value.as_f64() < s.as_f64());
            ("nvml", "gpu", normal)
        }
        "power" => {
            let value = need(&ev.value, "value")?;
            o = o.field("value", value.as_f64());
            if let Some(l) = ev.limit {
                o = o.field("limit", l.as_f64());
            }
            ("nvml", "gpu", ev.limit.is_none_or(|l| value.as_f64() <= l.as_f64()))
        }
        "throttle" => {
            if let Some(r) = &ev.reason {
                o = o.field("reason", r.as_str());
            }
            ("nvml", "gpu", ev.reason.is_none())
        }
        "nvlink" => {
            if let Some(state) = &ev.link_state {
                o = o.field("link_state", state.as_str());
            }
            o = o
                .field("crc_errors", ev.crc_errors.unwrap_or(0))
                .field("recovery_errors", ev.recovery_errors.unwrap_or(0));
            ("nvml", "nvlink", ev.link_state.as_deref() != Some("down"))
        }
        "pcie_replay" => {
            o = o.field("value", need(&ev.value, "value")?);
            ("nvml", "pcie", false)
        }
        "pcie_aer" => {
            o = o.field("severity", need(&ev.severity, "severity")?.as_str());
            ("kernel_log", "pcie", false)
        }
        "mce" => ("kernel_log", "cpu", false),
        "dcgm_diag" | "dcgm_health" => {
            let result = need(&ev.result, "result")?;
            if !["pass", "fail", "warn"].contains(&result.as_str()) {
                return Err(format!("result `{result}` is not pass, warn or fail"));
            }
            let default_check = if kind == "dcgm_diag" { "diag_level_2" } else { "health_watch" };
            o = o.field("check", ev.check.as_deref().unwrap_or(default_check)).field("result", result.as_str());
            ("dcgm", "gpu", result == "pass")
        }
        "cloud_maintenance" => {
            let state = ev.state.as_deref().unwrap_or("scheduled");
            if !["scheduled", "cancelled", "completed"].contains(&state) {
                return Err(format!("state `{state}` is not scheduled, cancelled or completed"));
            }
            o = o.field("event", ev.event.as_deref().unwrap_or("system-maintenance"));
            if let Some(s) = &ev.starts {
                o = o.field("starts_at_micros", T0 + micros(s)?);
            }
            if let Some(e) = &ev.ends {
                o = o.field("ends_at_micros", T0 + micros(e)?);
            }
            ("cloud", "node", state != "scheduled")
        }
        "monitor_health" => {
            let state = ev.state.as_deref().unwrap_or("ok");
            o = o.field("monitor", ev.monitor.as_deref().unwrap_or(if gpu.is_some() { "nvml" } else { "kernel_log" }));
            if state != "ok" {
                o = o.field("state", state);
            }
            ("nvml", if gpu.is_some() { "gpu" } else { "node" }, state == "ok")
        }
        "gpu_inventory" => {
            let present = gpus_of(&need(&ev.present, "present")?, gpu_count, "present")?;
            o.inventory = present.iter().map(|i| uuid(node, *i)).collect();
            // As observe.rs maps it: the node's expected count (its nvidia.com/gpu capacity)
            // against the GPUs present.
            let count = present.len() as i64;
            let expected = i64::from(gpu_count);
            o = o.field("count", count).field("expected", expected).field("missing", (expected - count).max(0));
            ("nvml", "node", present.len() as u32 == gpu_count)
        }
        "custom" => {
            // As observe.rs maps a custom event: every value a text field. The collector's own
            // custom events (InfiniBand ports, NIC driver errors, PCIe links, clock slowdowns)
            // say what they are in `check`.
            for (k, v) in need(&ev.values, "values")? {
                o = o.field(&k, v.as_str());
            }
            let component = ev.component.as_deref().unwrap_or(if gpu.is_some() { "gpu" } else { "node" });
            // Only `healthy` says whether a custom observation is evidence of health.
            return Ok(finish(o, ev, "kernel_log", component, false));
        }
        other => return Err(format!("kind `{other}` cannot be observed")),
    };
    Ok(finish(o, ev, source, component, healthy))
}

/// The source, component and health of `o`, as the event gives them or the kind implies.
fn finish(mut o: Observation, ev: &EventSpec, source: &str, component: &str, healthy: bool) -> Observation {
    o.source = ev.source.clone().unwrap_or_else(|| source.to_owned());
    o.component = component.to_owned();
    o.healthy = ev.healthy.unwrap_or(healthy);
    o.synthetic = o.source == "synthetic";
    o
}

/// The recovery action as `observe.rs` spells it (`XidRecoveryAction` in snake case).
fn recovery_action(text: &str) -> Result<&'static str, String> {
    let key: String =
        text.to_ascii_lowercase().split(|c: char| !c.is_ascii_alphanumeric()).collect::<Vec<_>>().join("_");
    Ok(match key.trim_matches('_') {
        "none" => "none",
        "gpu_reset_required" | "gpu_reset" => "gpu_reset_required",
        "node_reboot_required" | "node_reboot" => "node_reboot_required",
        "drain_p2p" => "drain_p2p",
        "drain_and_reset" => "drain_and_reset",
        "unknown" => "unknown",
        _ => {
            return Err(format!(
                "recovery_action `{text}` is not None, GPU Reset Required, Node Reboot Required, Drain P2P or Drain and Reset"
            ));
        }
    })
}

// ---------------------------------------------------------------------------------------------
// Running and judging.

struct Outcome {
    issued: Vec<(i64, Decision)>,
    summary: Summary,
    misses: Vec<Miss>,
    panic: Option<String>,
}

fn run(rules: &RuleSet, s: &Loaded) -> Outcome {
    let mut issued: Vec<(i64, Decision)> = Vec::new();
    let result = catch_unwind(AssertUnwindSafe(|| {
        let mut engine = Engine::new(rules.clone());
        // The root NVLink incidents of each domain, as the incident store holds them for every
        // replica: every opening decision so far.
        let mut roots = Roots::new(rules);
        // The hardware history of nodes and GPUs, as the incident store holds it: every incident
        // so far, judged with the classifier's default lemon settings.
        let mut lemons = Ledger::new(lemons::Settings::default());
        let mut boots: BTreeMap<String, (u32, String)> =
            s.scenario.nodes.keys().map(|n| (n.clone(), (0, format!("boot-{n}-0")))).collect();
        let mut ticks: BTreeSet<i64> = s.steps.iter().map(|(t, _)| *t).collect();
        ticks.extend(s.expectations.checkpoints.iter().map(|c| c.at_micros));
        ticks.insert(s.end);
        let mut steps = s.steps.iter().peekable();
        for t in ticks {
            issued.extend(lemons.judge(engine.tick(t)).into_iter().map(|d| (t, d)));
            while let Some((_, step)) = steps.next_if(|(at, _)| *at == t) {
                match step {
                    Step::Reboot { node, boot_id } => {
                        let b = boots.entry(node.clone()).or_insert((0, String::new()));
                        b.0 += 1;
                        b.1 = boot_id.clone().unwrap_or_else(|| format!("boot-{node}-{}", b.0));
                    }
                    Step::Observe { o, boot_id } => {
                        let mut o = o.as_ref().clone();
                        o.boot_id = Some(boot_id.clone().unwrap_or_else(|| boots[&o.node].1.clone()));
                        let mut made = lemons.judge(engine.observe(&roots.attach(&o)));
                        made.extend(lemons.replaced(&o));
                        roots.learn(&made);
                        issued.extend(made.into_iter().map(|d| (t, d)));
                    }
                }
            }
        }
    }));
    let panic = result.err().map(|p| {
        p.downcast_ref::<String>()
            .cloned()
            .or_else(|| p.downcast_ref::<&str>().map(|s| (*s).to_owned()))
            .unwrap_or_default()
    });
    let mut timeline = Timeline::new(Options::default());
    for (t, d) in &issued {
        timeline.push(d, Some(*t));
    }
    let (summary, misses) = timeline.evaluate(Some(&s.expectations), Some(s.end));
    Outcome { issued, summary, misses, panic }
}

fn decision_line(t: i64, d: &Decision) -> String {
    let mut action = d.action.to_string();
    for then in &d.then {
        action.push_str(&format!(">{then}"));
    }
    let mut notes = Vec::new();
    if d.decided_at_micros != t {
        notes.push(format!("issued {}", rel(t)));
    }
    if let Some(nb) = d.not_before_micros {
        notes.push(format!("not_before {}", rel(nb)));
    }
    if d.deferrable {
        notes.push("deferrable".into());
    }
    let notes = if notes.is_empty() { String::new() } else { format!(" ({})", notes.join(", ")) };
    format!(
        "    {:>10}  {:<4} {:<10} {:<34} {:<9} {:<8} {}{notes}",
        rel(d.decided_at_micros),
        d.node,
        d.gpu.as_deref().map_or("-".to_owned(), |g| g.rsplit('-').next().map_or(g.to_owned(), |i| format!("gpu {i}"))),
        format!("{} v{}", d.rule_id, d.rule_version),
        format!("{:?}", d.kind).to_lowercase(),
        d.severity,
        if d.recovery { "recovery".to_owned() } else { action },
    )
}

fn report(s: &Loaded, out: &Outcome) -> String {
    let mut r = String::new();
    let first_line = s.scenario.description.lines().next().unwrap_or("");
    let _ = writeln!(r, "FAIL {}: {first_line}", s.name);
    let _ = writeln!(r, "  source: {}", s.scenario.source.trim());
    if let Some(p) = &out.panic {
        let _ = writeln!(r, "  the engine panicked: {p}");
    }
    for m in &out.misses {
        let _ = writeln!(r, "  - {m}");
    }
    if out.issued.is_empty() {
        let _ = writeln!(r, "  decisions: none");
    } else {
        let _ = writeln!(r, "  decisions ({}; times from the scenario's start):", out.issued.len());
        const SHOWN: usize = 40;
        for (t, d) in out.issued.iter().take(SHOWN) {
            let _ = writeln!(r, "{}", decision_line(*t, d));
        }
        if out.issued.len() > SHOWN {
            let _ = writeln!(r, "    ... and {} more", out.issued.len() - SHOWN);
        }
    }
    r
}

fn corpus_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests").join("decisions")
}

#[test]
fn the_default_rules_decide_every_scenario_as_the_spec_says() {
    let rules = defaults::rule_set().unwrap_or_else(|e| panic!("the default rules do not load: {e:?}"));
    let mut files: Vec<PathBuf> = std::fs::read_dir(corpus_dir())
        .expect("tests/decisions exists")
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "yaml"))
        .collect();
    files.sort();
    let mut problems = Vec::new();
    let mut loaded = Vec::new();
    for f in &files {
        match load(f) {
            Ok(s) => loaded.push(s),
            Err(e) => problems.push(format!("{}: {e}", f.display())),
        }
    }
    if loaded.len() + problems.len() < MIN_SCENARIOS {
        problems.push(format!("the corpus has {} scenarios; it needs at least {MIN_SCENARIOS}", files.len()));
    }
    // GPUMEDIC_CORPUS_VERBOSE=1 prints every scenario's decisions, passing or not (run with
    // --nocapture), to see why a scenario passes.
    let verbose = std::env::var_os("GPUMEDIC_CORPUS_VERBOSE").is_some();
    let mut total = Summary::default();
    let mut failed = Vec::new();
    for s in &loaded {
        let out = run(&rules, s);
        total.add(&out.summary);
        let fails = out.panic.is_some() || !out.misses.is_empty();
        if verbose {
            eprintln!("{}", report(s, &out).replacen("FAIL", if fails { "FAIL" } else { "PASS" }, 1));
        }
        if fails {
            failed.push(report(s, &out));
        }
    }
    let mut text = String::new();
    if !problems.is_empty() {
        let _ = writeln!(text, "{} scenario files cannot be used:", problems.len());
        for p in &problems {
            let _ = writeln!(text, "  {p}");
        }
    }
    for f in &failed {
        text.push_str(f);
    }
    let _ = writeln!(text, "\n{} of {} scenarios failed.\n{total}", failed.len(), loaded.len());
    assert!(problems.is_empty() && failed.is_empty(), "{text}");
    eprintln!("{} scenarios pass.\n{total}", loaded.len());
}

/// The runner itself: a scenario's events become the observations the classifier would see.
#[test]
fn events_expand_into_the_observations_the_classifier_builds() {
    let text = r#"
description: expansion
source: this test
nodes: {n1: {gpus: 2}}
events:
  - {at: 0s, every: 30s, until: 1m, node: n1, gpu: all, kind: monitor_health}
  - {at: 1m, node: n1, gpu: 1, kind: xid, code: 13, pid: 42, process: python, workload: ml/Job/train}
  - {at: 2m, node: n1, kind: reboot}
  - {at: 3m, node: n1, gpu: 0, kind: xid, code: 154, recovery_action: GPU Reset Required, skew: 1h}
  - {at: 4m, node: n1, kind: gpu_inventory, present: [0]}
checkpoints: [{at: 5m, node: n1, gpu: 1, in_service: true}]
"#;
    let dir = std::env::temp_dir().join(format!("gpumedic-corpus-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("t.yaml");
    std::fs::write(&path, text).unwrap();
    let s = load(&path).unwrap_or_else(|e| panic!("{e}"));
    std::fs::remove_dir_all(&dir).unwrap();
    assert_eq!(s.steps.len(), 6 + 4);
    assert_eq!(s.end, T0 + 5 * 60_000_000);
    let obs: Vec<&Observation> = s
        .steps
        .iter()
        .filter_map(|(_, st)| match st {
            Step::Observe { o, .. } => Some(o.as_ref()),
            Step::Reboot { .. } => None,
        })
        .collect();
    assert!(obs[..6].iter().all(|o| o.kind == "monitor_health" && o.healthy && o.gpu.is_some()));
    let x = obs.iter().find(|o| o.xid == Some(13)).unwrap();
    assert_eq!(x.gpu.as_deref(), Some("GPU-n1-1"));
    assert_eq!(x.gpu_pci.as_deref(), Some("0000:28:00.0"));
    assert_eq!((x.source.as_str(), x.healthy), ("kernel_log", false));
    assert_eq!(x.fields["pid"], FieldValue::Int(42));
    assert_eq!(x.workloads, ["ml/Job/train"]);
    let r = obs.iter().find(|o| o.xid == Some(154)).unwrap();
    assert_eq!(r.fields["recovery_action"], FieldValue::Text("gpu_reset_required".into()));
    assert_eq!(r.observed_at_micros - r.received_at_micros.unwrap(), 3_600_000_000);
    let inv = obs.last().unwrap();
    assert_eq!((inv.inventory.clone(), inv.healthy), (vec!["GPU-n1-0".to_owned()], false));
    assert_eq!(
        s.expectations.targets,
        [(Target::node("n1"), Expect { quarantined: Some(false), ..Default::default() })]
    );
    // The run gives later events the new boot id.
    let mut rules = defaults::rule_set().unwrap();
    rules.rules.clear();
    let out = run(&rules, &s);
    assert!(out.panic.is_none() && out.misses.is_empty() && out.issued.is_empty());
}

#[test]
fn bad_scenarios_are_refused_with_the_reason() {
    let dir = std::env::temp_dir().join(format!("gpumedic-corpus-bad-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let base = "description: d\nsource: s\nnodes: {n1: {gpus: 2}}\n";
    for (body, reason) in [
        ("events: [{at: 0s, node: n1, kind: xid, code: 79}]", "give `gpu`"),
        ("events: [{at: 0s, node: n1, gpu: 2, kind: xid, code: 79}]", "GPU 2 does not exist"),
        ("events: [{at: 0s, node: n1, kind: nonsense}]", "unknown kind"),
        ("events: [{at: 0s, node: n1, kind: reboot, colour: red}]", "unknown field `colour`"),
        ("events: [{at: 0s, node: n9, kind: reboot}]", "node `n9` is not in `nodes`"),
        ("events: [{at: 0s, node: n1, kind: reboot}]\nexpect: {n1: {quarantined: maybe}}", "expect.n1"),
        ("events: [{at: 5x, node: n1, kind: reboot}]", "invalid duration"),
    ] {
        let path = dir.join("bad.yaml");
        std::fs::write(&path, format!("{base}{body}\n")).unwrap();
        let err = load(&path).expect_err(body);
        assert!(err.contains(reason), "{body}: {err}");
    }
    std::fs::remove_dir_all(&dir).unwrap();
}
