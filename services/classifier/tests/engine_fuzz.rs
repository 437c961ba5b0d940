//! Fuzzing the engine with the default rules: arbitrary observations (every kind the rules know,
//! junk kinds, any Xid, fields at i64::MIN/MAX, NaN and infinite floats, empty and long strings,
//! times at i64::MIN/MAX, boot ids, inventories) and ticks at arbitrary times. The engine must never
//! panic, and its state must stay bounded by the number of nodes, GPUs and rules, whatever the
//! number of events.
//!
//! By default a few dozen cases run (a few seconds, for CI). `GPUMEDIC_FUZZ_SECS=600` runs fresh
//! random cases for that long instead and reports how many ran (services/classifier/fuzz/README.md).

use std::collections::BTreeSet;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use gpumedic_classifier::rules::engine::Snapshot;
use gpumedic_classifier::rules::state::{CondState, MAX_EVIDENCE};
use gpumedic_classifier::rules::{Engine, FieldValue, KINDS, Observation, RuleSet, SOURCES, defaults};
use proptest::prelude::*;
use proptest::sample::select;
use proptest::test_runner::{Config, RngAlgorithm, TestCaseError, TestError, TestRng, TestRunner};

/// 2025-10-09T08:53:20Z: most generated times are near it, so deadlines and windows come due.
const T0: i64 = 1_760_000_000_000_000;
const NODES: &[&str] = &["n1", "n2", "n3"];
/// The longest id the generator makes; it bounds the size of the evidence the state may keep.
const LONG: usize = 300;
/// Operations per case.
const OPS: usize = 1500;

fn gpu_pool() -> Vec<String> {
    vec![
        "GPU-n-0".into(),
        "GPU-n-1".into(),
        "GPU-n-2".into(),
        "0000:18:00.0".into(),
        String::new(),
        "G".repeat(LONG),
        "GPU-\u{1f}\u{0}é".into(),
    ]
}

/// One step of a case.
#[derive(Debug, Clone)]
enum Op {
    Observe(Box<Observation>),
    Tick(i64),
}

fn extreme_i64() -> impl Strategy<Value = i64> {
    prop_oneof![
        4 => -1_000i64..100_000,
        1 => select(vec![i64::MIN, i64::MIN + 1, -1, 0, 1, i64::MAX - 1, i64::MAX, u32::MAX as i64]),
        1 => any::<i64>(),
    ]
}

fn extreme_f64() -> impl Strategy<Value = f64> {
    prop_oneof![
        4 => -100.0f64..2_000.0,
        1 => select(vec![f64::NAN, f64::INFINITY, f64::NEG_INFINITY, f64::MAX, f64::MIN, -0.0, f64::EPSILON, 2147483647.0]),
        1 => any::<f64>(),
    ]
}

fn text() -> impl Strategy<Value = String> {
    prop_oneof![
        4 => select(vec![
            "none", "None", "GPU Reset Required", "gpu_reset_required", "node_reboot_required", "drain_p2p",
            "Drain and Reset", "fatal", "non_fatal", "corrected", "up", "down", "pass", "fail", "hw_slowdown",
            "scheduled", "cancelled", "nvml", "kernel_log", "python3", "",
        ]).prop_map(str::to_owned),
        1 => proptest::collection::vec(any::<char>(), 0..24).prop_map(|c| c.into_iter().collect()),
        1 => (0usize..=LONG).prop_map(|n| "x".repeat(n)),
    ]
}

fn field_value() -> impl Strategy<Value = FieldValue> {
    prop_oneof![
        any::<bool>().prop_map(FieldValue::Bool),
        extreme_i64().prop_map(FieldValue::Int),
        extreme_f64().prop_map(FieldValue::Float),
        text().prop_map(FieldValue::Text),
    ]
}

fn field_name() -> impl Strategy<Value = String> {
    prop_oneof![
        8 => select(vec![
            "value", "slowdown_threshold", "shutdown_threshold", "limit", "double_bit_volatile",
            "single_bit_volatile", "single_bit_aggregate", "double_bit_aggregate", "pending", "failure",
            "correctable", "uncorrectable", "total", "link_state", "crc_errors", "recovery_errors", "severity",
            "recovery_action", "reason", "result", "check", "event", "starts_at_micros", "ends_at_micros",
            "monitor", "state", "pid", "process",
        ]).prop_map(str::to_owned),
        1 => text(),
    ]
}

fn time() -> impl Strategy<Value = i64> {
    prop_oneof![
        8 => (0i64..7 * 86_400_000_000).prop_map(|d| T0 + d),
        1 => select(vec![i64::MIN, i64::MIN + 1, i64::MAX, i64::MAX - 1, 0, -1]),
        1 => any::<i64>(),
    ]
}

fn kind() -> impl Strategy<Value = String> {
    let mut known: Vec<String> = KINDS.iter().map(|k| (*k).to_owned()).collect();
    known.push("gpu_inventory".into());
    prop_oneof![8 => select(known), 1 => text()]
}

fn xid() -> impl Strategy<Value = Option<u32>> {
    prop_oneof![
        1 => Just(None),
        4 => select(vec![8u32, 13, 31, 43, 45, 48, 62, 63, 64, 74, 79, 92, 94, 95, 145, 149, 154, 20034]).prop_map(Some),
        1 => any::<u32>().prop_map(Some),
    ]
}

fn event_id() -> impl Strategy<Value = String> {
    // A small pool makes redeliveries common; the rest are fresh.
    prop_oneof![
        2 => (0u32..40).prop_map(|i| format!("dup-{i}")),
        6 => any::<u64>().prop_map(|i| format!("e{i:x}")),
        1 => (0usize..=LONG).prop_map(|n| "i".repeat(n)),
    ]
}

fn observation() -> impl Strategy<Value = Observation> {
    let gpus = gpu_pool();
    let identity = (
        event_id(),
        select(NODES.to_vec()),
        proptest::option::of(select(gpus.clone())),
        proptest::option::of(extreme_i64().prop_map(|i| i as i32)),
        proptest::option::of(select(vec!["b0", "b1", "b2", ""])),
        proptest::option::of(time()),
        proptest::collection::vec(select(vec!["ns/Job/a", "ns/Job/b", "", "x/y/z"]), 0..3),
        proptest::collection::vec(select(gpus), 0..9),
    );
    let what = (
        time(),
        prop_oneof![4 => select(SOURCES.to_vec()).prop_map(str::to_owned), 1 => text()],
        kind(),
        xid(),
        any::<bool>(),
        prop_oneof![9 => Just(false), 1 => Just(true)],
        proptest::collection::btree_map(field_name(), field_value(), 0..6),
    );
    (identity, what).prop_map(
        |(
            (event_id, node, gpu, gpu_index, boot_id, received_at, workloads, inventory),
            (observed, source, kind, xid, healthy, synthetic, fields),
        )| {
            let mut o = Observation::new(event_id, node, observed, &kind);
            o.gpu_pci = gpu.as_ref().map(|g| format!("pci-{}", g.len()));
            o.gpu = gpu;
            o.gpu_index = gpu_index;
            o.boot_id = boot_id.map(str::to_owned);
            o.received_at_micros = received_at;
            o.workloads = workloads.into_iter().map(str::to_owned).collect();
            o.inventory = inventory;
            o.source = source;
            o.xid = xid;
            o.healthy = healthy;
            o.synthetic = synthetic;
            o.fields = fields;
            o
        },
    )
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        12 => observation().prop_map(|o| Op::Observe(Box::new(o))),
        1 => time().prop_map(Op::Tick),
    ]
}

fn ops(max: usize) -> impl Strategy<Value = Vec<Op>> {
    proptest::collection::vec(op(), 0..max)
}

/// The most JSON bytes a snapshot may take: every node remembers at most 1024 event digests, and
/// has at most one state per rule and GPU (or none), each holding a bounded amount of evidence.
fn snapshot_bound(rules: &RuleSet) -> usize {
    let keys = rules.rules.len() * (gpu_pool().len() + 1);
    let evidence = LONG + 120;
    let per_key = (2 * MAX_EVIDENCE + 64 + 16) * evidence + 2 * LONG + 1024;
    NODES.len() * (1024 * 22 + keys * per_key + 1024)
}

/// Structural bounds, whatever happened to the values.
fn check_bounded(rules: &RuleSet, snap: &Snapshot) -> Result<(), TestCaseError> {
    prop_assert!(snap.nodes.len() <= NODES.len(), "{} nodes", snap.nodes.len());
    let max_keys = rules.rules.len() * (gpu_pool().len() + 1);
    for n in &snap.nodes {
        prop_assert!(n.recent.len() <= 1024, "{}: {} recent ids", n.node, n.recent.len());
        prop_assert!(n.keys.len() <= max_keys, "{}: {} keys (at most {max_keys})", n.node, n.keys.len());
        for k in &n.keys {
            if let Some(inc) = &k.state.incident {
                prop_assert!(inc.evidence.len() <= MAX_EVIDENCE, "{}: {} evidence", k.rule, inc.evidence.len());
            }
            let held = match &k.state.cond {
                CondState::Count { events } => events.len(),
                CondState::Burst { burst } => burst.as_ref().map_or(0, |b| b.evidence.len()),
                CondState::Together { last } => last.len(),
                CondState::Rate { samples } => samples.len(),
                CondState::Threshold { .. } => 2,
            };
            prop_assert!(held <= 64, "{}: the condition holds {held} items", k.rule);
        }
    }
    let bytes = serde_json::to_vec(snap).map_err(|e| TestCaseError::fail(e.to_string()))?.len();
    let bound = snapshot_bound(rules);
    prop_assert!(bytes <= bound, "snapshot of {bytes} bytes (bound {bound})");
    Ok(())
}

/// A panic: its message and where (`file:line:column`).
#[derive(Debug, Clone, PartialEq, Eq)]
struct Panic {
    message: String,
    at: String,
}

/// The latest panic on the fuzz thread, as the hook saw it.
static LAST_PANIC: Mutex<Option<Panic>> = Mutex::new(None);

/// The fuzz test's thread (libtest names threads after tests): its panics are recorded quietly
/// and reported by the test; any other thread's go to the previous hook as usual.
const FUZZ_TEST: &str = "the_engine_never_panics_and_its_state_stays_bounded";

fn quiet_panics() {
    let previous = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        if std::thread::current().name() != Some(FUZZ_TEST) {
            return previous(info);
        }
        let message = info
            .payload()
            .downcast_ref::<String>()
            .cloned()
            .or_else(|| info.payload().downcast_ref::<&str>().map(|s| (*s).to_owned()))
            .unwrap_or_default();
        let at = info.location().map(|l| format!("{}:{}:{}", l.file(), l.line(), l.column())).unwrap_or_default();
        if let Ok(mut last) = LAST_PANIC.lock() {
            *last = Some(Panic { message, at });
        }
    }));
}

/// Runs one case. A panic fails it, unless its place is in `known` (a timed run that already
/// reported it): then the engine starts afresh and the case goes on, so the search reaches past a
/// known bug to the next one.
fn run_case(rules: &RuleSet, ops: &[Op], known: &BTreeSet<String>) -> Result<(), TestCaseError> {
    let mut engine = Engine::new(rules.clone());
    for op in ops {
        let step = catch_unwind(AssertUnwindSafe(|| match op {
            Op::Observe(o) => engine.observe(o),
            Op::Tick(t) => engine.tick(*t),
        }));
        match step {
            Ok(decisions) => {
                for d in &decisions {
                    prop_assert!(d.evidence.len() <= MAX_EVIDENCE);
                }
            }
            Err(_) => {
                let p = LAST_PANIC
                    .lock()
                    .ok()
                    .and_then(|mut p| p.take())
                    .unwrap_or(Panic { message: "a panic the hook did not see".into(), at: "?".into() });
                if !known.contains(&p.at) {
                    return Err(TestCaseError::fail(format!("panic: {} at {}", p.message, p.at)));
                }
                engine = Engine::new(rules.clone());
            }
        }
    }
    check_bounded(rules, &engine.snapshot())
}

/// One failure: why, and the minimal input proptest shrank it to.
fn describe(why: &str, input: &[Op]) -> String {
    let shown: Vec<String> = input
        .iter()
        .take(20)
        .map(|op| {
            let text = format!("{op:?}");
            let cut: String = text.chars().take(600).collect();
            format!("  {cut}{}", if cut.len() < text.len() { " ..." } else { "" })
        })
        .collect();
    format!("{why}\nminimal input ({} operations):\n{}", input.len(), shown.join("\n"))
}

/// Where a failure's panic happened, from its message.
fn place(why: &str) -> Option<String> {
    why.strip_prefix("panic: ").and_then(|rest| rest.rsplit_once(" at ")).map(|(_, at)| at.to_owned())
}

#[test]
fn the_engine_never_panics_and_its_state_stays_bounded() {
    let rules = defaults::rule_set().unwrap_or_else(|e| panic!("{e:?}"));
    let secs: u64 = std::env::var("GPUMEDIC_FUZZ_SECS").ok().and_then(|s| s.parse().ok()).unwrap_or(0);
    quiet_panics();
    let started = Instant::now();
    let mut cases: u64 = 0;
    let mut round: u64 = 0;
    // Panic places already reported (a timed run goes on past them), and every failure.
    let mut known: BTreeSet<String> = BTreeSet::new();
    let mut failures: Vec<String> = Vec::new();
    loop {
        // A fixed seed by default, so CI is repeatable; fresh seeds in a timed run.
        let seed = if secs == 0 {
            [7u8; 32]
        } else {
            let mut s = [0u8; 32];
            let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default();
            s[..16].copy_from_slice(&now.as_nanos().to_le_bytes());
            s[16..24].copy_from_slice(&round.to_le_bytes());
            s
        };
        let per_round = if secs == 0 { 24 } else { 64 };
        let config = Config {
            cases: per_round,
            failure_persistence: None,
            max_shrink_iters: 20_000,
            max_shrink_time: 120_000,
            ..Config::default()
        };
        let mut runner = TestRunner::new_with_rng(config, TestRng::from_seed(RngAlgorithm::ChaCha, &seed));
        let result = runner.run(&ops(OPS), |ops| run_case(&rules, &ops, &known));
        cases += u64::from(per_round);
        round += 1;
        match result {
            Ok(()) => {}
            Err(TestError::Abort(why)) => failures.push(format!("aborted: {why}")),
            Err(TestError::Fail(why, input)) => {
                let why = why.to_string();
                failures.push(format!(
                    "after {cases} cases ({:.0} s): {}",
                    started.elapsed().as_secs_f64(),
                    describe(&why, &input)
                ));
                match place(&why) {
                    // A timed run notes the place and searches on; a bound broken stops it.
                    Some(at) if secs > 0 => {
                        known.insert(at);
                    }
                    _ => break,
                }
            }
        }
        if started.elapsed() >= Duration::from_secs(secs) {
            break;
        }
    }
    let _ = std::panic::take_hook();
    let summary = format!(
        "engine fuzz: {cases} cases of up to {OPS} operations in {:.1} s; {} failures",
        started.elapsed().as_secs_f64(),
        failures.len()
    );
    assert!(failures.is_empty(), "{summary}:\n\n{}", failures.join("\n\n"));
    eprintln!("{summary}");
}

/// The extremes on their own, so a regression names itself without a search.
#[test]
fn extreme_times_and_values_do_not_panic() {
    let rules = defaults::rule_set().unwrap_or_else(|e| panic!("{e:?}"));
    let mut engine = Engine::new(rules);
    let mut n = 0;
    for t in [i64::MIN, -1, 0, T0, i64::MAX - 1, i64::MAX] {
        for (kind, code) in
            [("xid", Some(48)), ("xid", Some(13)), ("temperature", None), ("ecc", None), ("power", None)]
        {
            n += 1;
            let mut o = Observation::new(format!("x{n}"), "n1", t, kind).gpu("GPU-n-0");
            o.xid = code;
            o.received_at_micros = Some(t);
            for v in [FieldValue::Int(i64::MAX), FieldValue::Float(f64::NAN)] {
                o = o.field("value", v.clone()).field("slowdown_threshold", v.clone()).field("limit", v.clone());
                o = o.field("single_bit_aggregate", v.clone()).field("double_bit_volatile", v);
                engine.observe(&o);
                o.event_id.push('+');
            }
            engine.tick(t);
        }
    }
    engine.tick(i64::MAX);
}
