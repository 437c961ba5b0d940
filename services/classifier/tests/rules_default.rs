//! The default rule set (`services/classifier/rules/*.yaml`), loaded from the real files and
//! driven through the engine: the runbook's key scenarios, recovery, id determinism and restart
//! equivalence. Pure logic; no server is needed.

use std::path::Path;

use gpumedic_classifier::rules::{
    Action, Decision, DecisionKind, Engine, Observation, RuleSet, Severity, Snapshot, SyntheticPolicy, check_dir,
    defaults,
};

const S: i64 = 1_000_000;
const MIN: i64 = 60 * S;
const H: i64 = 60 * MIN;
/// A fixed start, so ids and times in failures are readable and stable.
const T0: i64 = 1_760_000_000 * S;

fn rules() -> RuleSet {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("rules");
    match check_dir(&dir) {
        Ok(set) => set,
        Err(errors) => {
            panic!("default rules are invalid:\n{}", errors.iter().map(|e| format!("{e}\n")).collect::<String>())
        }
    }
}

fn engine() -> Engine {
    Engine::new(rules())
}

fn xid(id: &str, t: i64, gpu: &str, code: u32) -> Observation {
    Observation::new(id, "node-a", t, "xid").source("kernel_log").gpu(gpu).xid(code)
}

fn healthy(id: &str, t: i64, gpu: &str) -> Observation {
    Observation::new(id, "node-a", t, "monitor_health").gpu(gpu).healthy()
}

fn at(mut o: Observation, t: i64) -> Observation {
    o.observed_at_micros = t;
    o
}

fn only(decisions: Vec<Decision>) -> Decision {
    assert_eq!(decisions.len(), 1, "expected one decision, got {decisions:#?}");
    decisions.into_iter().next().unwrap()
}

#[test]
fn default_rules_load_from_the_files_and_the_compiled_copy() {
    let from_files = rules();
    let compiled = defaults::rule_set().unwrap_or_else(|e| panic!("{e:?}"));
    assert_eq!(from_files.rules.len(), compiled.rules.len());
    assert!(from_files.rules.len() >= 30, "{}", from_files.rules.len());
    assert_eq!(from_files.synthetic, SyntheticPolicy::Ignored, "production ignores injected faults");
    for (a, b) in from_files.rules.iter().zip(&compiled.rules) {
        assert_eq!((&a.id, a.version, &a.condition), (&b.id, b.version, &b.condition));
    }
}

#[test]
fn xid_13_once_is_info_and_takes_no_cordon_level_action() {
    let mut e = engine();
    let d = only(e.observe(&xid("e1", T0, "GPU-0", 13)));
    assert_eq!(
        (d.rule_id.as_str(), d.kind, d.severity, d.action),
        ("xid-application", DecisionKind::Open, Severity::Info, Action::None)
    );
    assert_eq!(d.evidence, ["e1"]);
    assert_eq!(d.gpu.as_deref(), Some("GPU-0"));
    assert!(d.action < Action::Cordon && d.then.is_empty());
}

#[test]
fn xid_13_repeated_on_the_same_gpu_escalates_and_on_different_gpus_does_not() {
    let mut e = engine();
    e.observe(&xid("e1", T0, "GPU-0", 13));
    assert!(e.observe(&xid("e2", T0 + H, "GPU-0", 13)).is_empty(), "the open info incident is not re-fired");
    let d = only(e.observe(&xid("e3", T0 + 2 * H, "GPU-0", 13)));
    assert_eq!(
        (d.rule_id.as_str(), d.severity, d.action),
        ("xid-application-repeated", Severity::Warning, Action::Cordon)
    );
    assert_eq!(d.evidence, ["e1", "e2", "e3"]);

    let mut e = engine();
    for (i, gpu) in ["GPU-0", "GPU-1", "GPU-2"].iter().enumerate() {
        let d = only(e.observe(&xid(&format!("e{i}"), T0 + i as i64 * MIN, gpu, 13)));
        assert_eq!(d.severity, Severity::Info, "three GPUs once each: no repeat on one GPU");
    }
    // Outside the 24h window the count starts again.
    let mut e = engine();
    e.observe(&xid("e1", T0, "GPU-0", 31));
    e.observe(&xid("e2", T0 + H, "GPU-0", 31));
    assert!(e.observe(&xid("e3", T0 + 25 * H, "GPU-0", 31)).is_empty());
}

#[test]
fn xid_79_and_fallen_off_the_bus_reboot_the_node_once() {
    let mut e = engine();
    let d = only(e.observe(&xid("e1", T0, "GPU-3", 79)));
    assert_eq!(
        (d.rule_id.as_str(), d.severity, d.action),
        ("xid-79-fallen-off-the-bus", Severity::Critical, Action::RebootNode)
    );
    assert_eq!(d.gpu, None, "a node-wide incident");
    let lost = Observation::new("e2", "node-a", T0 + S, "gpu_lost").gpu("GPU-5");
    assert!(e.observe(&lost).is_empty(), "a second GPU falling off joins the open node incident");

    let mut e = engine();
    let d = only(e.observe(&Observation::new("e9", "node-b", T0, "gpu_lost").source("kernel_log")));
    assert_eq!((d.severity, d.action, d.node.as_str()), (Severity::Critical, Action::RebootNode, "node-b"));
}

#[test]
fn xid_48_alone_resets_the_gpu_when_the_burst_ends() {
    let mut e = engine();
    assert!(e.observe(&xid("e1", T0, "GPU-0", 48)).is_empty(), "alone can only be known once the burst ends");
    assert!(e.tick(T0 + 3 * MIN).is_empty(), "exactly 3 minutes does not end the burst");
    let d = only(e.tick(T0 + 3 * MIN + 1));
    assert_eq!((d.rule_id.as_str(), d.severity, d.action), ("xid-48-alone", Severity::Critical, Action::ResetGpu));
    assert_eq!(d.decided_at_micros, T0 + 3 * MIN, "stamped at the burst's end, not at the tick");

    // The next event's own time ends the burst just as a tick does.
    let mut e2 = engine();
    e2.observe(&xid("e1", T0, "GPU-0", 48));
    let later = e2.observe(&healthy("h1", T0 + H, "GPU-0"));
    assert_eq!(later[0].verdict_id, d.verdict_id);
}

#[test]
fn xid_48_with_63_drains_then_resets_at_once() {
    let mut e = engine();
    assert!(e.observe(&xid("e1", T0, "GPU-0", 48)).is_empty());
    let d = only(e.observe(&xid("e2", T0 + MIN, "GPU-0", 63)));
    assert_eq!(
        (d.rule_id.as_str(), d.severity, d.action),
        ("xid-48-with-row-remap", Severity::Critical, Action::Drain)
    );
    assert_eq!(d.then, [Action::ResetGpu]);
    assert_eq!(d.evidence, ["e1", "e2"]);
    assert!(e.tick(T0 + H).is_empty(), "the burst was not 48 alone");
}

#[test]
fn xid_154_recovery_action_overrides_the_guess_from_other_xids() {
    // 48 with 63 guessed drain-and-reset; 154 says the node must reboot.
    let mut e = engine();
    e.observe(&xid("e1", T0, "GPU-0", 48));
    let guess = only(e.observe(&xid("e2", T0 + S, "GPU-0", 63)));
    let o = xid("e3", T0 + 2 * S, "GPU-0", 154).field("recovery_action", "Node Reboot Required");
    let d = only(e.observe(&o));
    assert_eq!(
        (d.rule_id.as_str(), d.severity, d.action),
        ("xid-154-recovery-action", Severity::Critical, Action::RebootNode)
    );
    assert_eq!(d.supersedes, [guess.incident_id]);
    assert!(e.tick(T0 + H).is_empty(), "no 48-alone decision: the burst had 63");

    // 154 first: a later guess on the same GPU takes 154's action, even a milder one.
    let mut e = engine();
    let o = xid("e1", T0, "GPU-0", 154).field("recovery_action", "none");
    let d = only(e.observe(&o));
    assert_eq!((d.severity, d.action), (Severity::Info, Action::None));
    let d = only(e.observe(&xid("e2", T0 + S, "GPU-0", 62)));
    assert_eq!((d.rule_id.as_str(), d.action), ("xid-reset-gpu", Action::None));
    assert!(d.reason.contains("overrides"), "{}", d.reason);
    // Another GPU is not governed by GPU-0's override.
    let d = only(e.observe(&xid("e3", T0 + S, "GPU-1", 62)));
    assert_eq!(d.action, Action::ResetGpu);

    // A changed recovery action on the same GPU is decided again, milder included.
    let step = e.observe(&xid("e4", T0 + 2 * S, "GPU-0", 154).field("recovery_action", "GPU Reset Required"));
    let d = only(step);
    assert_eq!((d.kind, d.action, d.step), (DecisionKind::Override, Action::ResetGpu, 1));
    assert!(e.observe(&xid("e5", T0 + 3 * S, "GPU-0", 154).field("recovery_action", "gpu_reset_required")).is_empty());
}

#[test]
fn xid_45_alone_differs_from_45_with_others() {
    let mut e = engine();
    e.observe(&xid("e1", T0, "GPU-0", 45));
    e.observe(&xid("e2", T0 + MIN, "GPU-0", 45));
    let d = only(e.tick(T0 + H));
    assert_eq!(
        (d.rule_id.as_str(), d.action, d.custom.as_deref()),
        ("xid-45-alone", Action::Custom, Some("restart-fabric-manager"))
    );

    let mut e = engine();
    let d = only(e.observe(&xid("e1", T0, "GPU-0", 62)));
    assert_eq!(d.rule_id, "xid-reset-gpu");
    assert!(e.observe(&xid("e2", T0 + S, "GPU-0", 45)).is_empty());
    assert!(e.tick(T0 + H).is_empty(), "45 with others follows the other Xid");
}

#[test]
fn xid_63_and_92_are_trend_signals() {
    let mut e = engine();
    assert!(e.observe(&xid("e1", T0, "GPU-0", 63)).is_empty(), "one 63 is ignored");
    assert!(e.observe(&xid("e2", T0 + H, "GPU-0", 63)).is_empty());
    let d = only(e.observe(&xid("e3", T0 + 2 * H, "GPU-0", 63)));
    assert_eq!((d.rule_id.as_str(), d.severity), ("xid-63-row-remap-trend", Severity::Warning));
    for (i, t) in [0, 1, 2].iter().enumerate() {
        let out = e.observe(&xid(&format!("s{i}"), T0 + t * H, "GPU-1", 92));
        assert_eq!(out.len(), usize::from(i == 2));
    }
}

fn temperature(id: &str, t: i64, value: i64, healthy_flag: bool) -> Observation {
    let mut o = Observation::new(id, "node-a", t, "temperature")
        .gpu("GPU-0")
        .field("value", value)
        .field("slowdown_threshold", 90)
        .field("shutdown_threshold", 95);
    o.healthy = healthy_flag;
    o
}

#[test]
fn temperature_tiers_info_warning_critical() {
    let mut e = engine();
    let d = only(e.observe(&temperature("t1", T0, 85, false)));
    assert_eq!((d.rule_id.as_str(), d.severity, d.action), ("temperature-elevated", Severity::Info, Action::None));
    assert!(e.observe(&temperature("t2", T0 + 10 * S, 91, false)).is_empty(), "slowdown must hold for a minute");
    let d = only(e.observe(&temperature("t3", T0 + 70 * S, 92, false)));
    assert_eq!(
        (d.rule_id.as_str(), d.severity, d.action),
        ("temperature-slowdown", Severity::Warning, Action::Monitor)
    );
    assert_eq!(d.evidence, ["t2"], "held from t2 for a minute: due before t3 is taken");
    assert_eq!(d.decided_at_micros, T0 + 70 * S);
    let d = only(e.observe(&temperature("t4", T0 + 80 * S, 96, false)));
    assert_eq!((d.rule_id.as_str(), d.severity, d.action), ("temperature-shutdown", Severity::Critical, Action::Drain));
    // Cooling down: both hot incidents recover only after their quiet periods of cool readings.
    assert!(e.observe(&temperature("t5", T0 + 2 * MIN, 70, true)).is_empty());
    let recovered = e.tick(T0 + 2 * MIN + 30 * MIN);
    let ids: Vec<&str> = recovered.iter().map(|d| d.rule_id.as_str()).collect();
    assert_eq!(ids, ["temperature-elevated", "temperature-slowdown", "temperature-shutdown"]);
    assert!(recovered.iter().all(|d| d.recovery && d.action == Action::None && d.evidence == ["t5"]));
}

#[test]
fn recovery_only_on_healthy_evidence_held_for_the_quiet_period() {
    let mut e = engine();
    let opened = only(e.observe(&xid("e1", T0, "GPU-0", 79)));
    assert!(e.tick(T0 + 48 * H).is_empty(), "time alone never closes an incident");
    // Healthy evidence starts the 15-minute quiet period...
    assert!(e.observe(&healthy("h1", T0 + 48 * H + MIN, "GPU-0")).is_empty());
    // ...new fault evidence cancels it...
    assert!(e.observe(&Observation::new("e2", "node-a", T0 + 48 * H + 5 * MIN, "gpu_lost")).is_empty());
    assert!(e.tick(T0 + 48 * H + 20 * MIN).is_empty());
    // ...and fresh healthy evidence must stand the whole period again.
    assert!(e.observe(&healthy("h2", T0 + 49 * H, "GPU-0")).is_empty());
    assert!(e.tick(T0 + 49 * H + 15 * MIN - 1).is_empty());
    let d = only(e.tick(T0 + 49 * H + 15 * MIN));
    assert_eq!((d.kind, d.recovery, d.incident_id, d.step), (DecisionKind::Recover, true, opened.incident_id, 1));
    assert_eq!(
        (d.severity, d.action, d.evidence.as_slice()),
        (Severity::Critical, Action::None, &["h2".to_string()][..])
    );
    assert!(e.open_incidents().is_empty());
    // A new fault opens a new incident with a new id.
    let again = only(e.observe(&xid("e3", T0 + 50 * H, "GPU-0", 79)));
    assert_eq!(again.kind, DecisionKind::Open);
    assert_ne!(again.incident_id, opened.incident_id);
}

#[test]
fn other_default_rules_fire_on_their_evidence() {
    let gpu = |id: &str, kind: &str| Observation::new(id, "node-a", T0, kind).gpu("GPU-0");
    let cases: Vec<(Observation, &str, Severity, Action)> = vec![
        (gpu("a", "ecc").field("double_bit_volatile", 2), "ecc-double-bit", Severity::Critical, Action::ResetGpu),
        (gpu("b", "row_remap").field("failure", true), "row-remap-failure", Severity::Critical, Action::Drain),
        (
            gpu("c", "row_remap").field("pending", true).healthy(),
            "row-remap-pending",
            Severity::Warning,
            Action::ResetGpu,
        ),
        (
            gpu("d", "retired_pages").field("total", 61),
            "retired-pages-limit",
            Severity::Warning,
            Action::ContactSupport,
        ),
        (gpu("e", "nvlink").field("link_state", "down"), "nvlink-down", Severity::Warning, Action::ResetGpu),
        (gpu("f", "cloud_maintenance").source("cloud"), "cloud-maintenance", Severity::Warning, Action::Drain),
        (gpu("g", "monitor_health").field("monitor", "nvml"), "monitor-hung", Severity::Warning, Action::Monitor),
        (gpu("h", "dcgm_diag").source("dcgm"), "dcgm-diagnostic-failed", Severity::Critical, Action::Drain),
        (gpu("i", "pcie_aer").field("severity", "fatal"), "pcie-aer-fatal", Severity::Critical, Action::RebootNode),
    ];
    for (o, rule, severity, action) in cases {
        let out = engine().observe(&o);
        assert_eq!(out.len(), 1, "{o:?} gave {out:#?}");
        let d = only(out);
        assert_eq!((d.rule_id.as_str(), d.severity, d.action), (rule, severity, action), "{o:?}");
    }
    // Counters: NVLink CRC errors growing faster than 100 an hour.
    let mut e = engine();
    let crc = |id: &str, t: i64, v: i64| at(gpu(id, "nvlink"), t).field("crc_errors", v).field("link_state", "up");
    assert!(e.observe(&crc("n1", T0, 10)).is_empty());
    let d = only(e.observe(&crc("n2", T0 + 30 * MIN, 200)));
    assert_eq!((d.rule_id.as_str(), d.severity), ("nvlink-crc-growth", Severity::Warning));
    // Power above the limit for five minutes.
    let mut e = engine();
    let power = |id: &str, t: i64| at(gpu(id, "power").field("value", 450).field("limit", 400), t);
    assert!(e.observe(&power("p1", T0)).is_empty());
    let d = only(e.tick(T0 + 5 * MIN));
    assert_eq!((d.rule_id.as_str(), d.evidence.as_slice()), ("power-over-limit", &["p1".to_string()][..]));
}

#[test]
fn synthetic_events_are_ignored_unless_the_rule_set_allows_them() {
    let fault = xid("e1", T0, "GPU-0", 79).synthetic();
    assert!(engine().observe(&fault).is_empty());
    let mut e = Engine::new(rules().with_synthetic(SyntheticPolicy::Allowed));
    let d = only(e.observe(&fault));
    assert!(d.synthetic, "decisions on injected evidence say so");
}

#[test]
fn redelivered_events_change_nothing() {
    let mut e = engine();
    e.observe(&xid("e1", T0, "GPU-0", 13));
    e.observe(&xid("e2", T0 + S, "GPU-0", 13));
    assert!(e.observe(&xid("e2", T0 + S, "GPU-0", 13)).is_empty(), "a redelivery is not a third event");
    assert_eq!(e.open_incidents().len(), 1);
}

/// A varied, deterministic stream over three nodes: Xids (including bursts and 154), readings,
/// healthy heartbeats and quiet gaps, with ticks interleaved.
fn stream() -> Vec<Step> {
    let mut seed: u64 = 0x9e37_79b9_7f4a_7c15;
    let mut next = move || {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        seed
    };
    let codes = [13, 31, 43, 45, 48, 62, 63, 64, 79, 92, 94, 119, 145, 154];
    let actions = ["none", "GPU Reset Required", "Node Reboot Required", "Drain and Reset"];
    let mut t = T0;
    let mut out = Vec::new();
    for i in 0..1500 {
        t += (next() % (4 * MIN as u64)) as i64;
        let node = format!("node-{}", next() % 3);
        let gpu = format!("GPU-{}", next() % 2);
        let id = format!("ev-{i}");
        let o = match next() % 10 {
            0..=3 => {
                let code = codes[(next() % codes.len() as u64) as usize];
                let mut o = Observation::new(&id, &node, t, "xid").gpu(&gpu).xid(code);
                if code == 154 {
                    o = o.field("recovery_action", actions[(next() % 4) as usize]);
                }
                o
            }
            4 => Observation::new(&id, &node, t, "temperature")
                .gpu(&gpu)
                .field("value", 80 + (next() % 20) as i64)
                .field("slowdown_threshold", 90)
                .field("shutdown_threshold", 97),
            5 => Observation::new(&id, &node, t, "nvlink")
                .gpu(&gpu)
                .field("crc_errors", (i as i64) * (next() % 5) as i64),
            6 => Observation::new(&id, &node, t, "gpu_lost").gpu(&gpu),
            _ => Observation::new(&id, &node, t, "monitor_health").gpu(&gpu).healthy(),
        };
        out.push(Step::Observe(o));
        if next() % 7 == 0 {
            out.push(Step::Tick(t + (next() % (10 * MIN as u64)) as i64));
        }
    }
    out.push(Step::Tick(t + 48 * H));
    out
}

#[derive(Clone)]
enum Step {
    Observe(Observation),
    Tick(i64),
}

fn run(e: &mut Engine, steps: &[Step]) -> Vec<Decision> {
    let mut out = Vec::new();
    for s in steps {
        out.extend(match s {
            Step::Observe(o) => e.observe(o),
            Step::Tick(t) => e.tick(*t),
        });
    }
    out
}

#[test]
fn replaying_the_same_input_gives_the_same_verdicts_and_ids() {
    let steps = stream();
    let first = run(&mut engine(), &steps);
    let second = run(&mut engine(), &steps);
    assert!(first.len() > 50, "the stream should exercise many rules: {}", first.len());
    assert_eq!(first, second);
    let kinds: Vec<DecisionKind> = first.iter().map(|d| d.kind).collect();
    for k in [DecisionKind::Open, DecisionKind::Override, DecisionKind::Recover] {
        assert!(kinds.contains(&k), "{k:?} not exercised");
    }
    let mut ids: Vec<_> = first.iter().map(|d| d.verdict_id).collect();
    ids.sort();
    ids.dedup();
    assert_eq!(ids.len(), first.len(), "verdict ids are unique");
}

#[test]
fn a_restart_from_a_snapshot_or_a_rebuild_changes_no_verdict() {
    let steps = stream();
    let whole = run(&mut engine(), &steps);
    for cut in [1, steps.len() / 3, steps.len() / 2, steps.len() - 1] {
        let (before, after) = steps.split_at(cut);
        let mut first = engine();
        let mut got = run(&mut first, before);

        // Snapshot through JSON, as it would be stored.
        let json = serde_json::to_string(&first.snapshot()).unwrap();
        let snapshot: Snapshot = serde_json::from_str(&json).unwrap();
        let mut restored = Engine::restore(rules(), snapshot).unwrap();
        let mut via_snapshot = got.clone();
        via_snapshot.extend(run(&mut restored, after));
        assert_eq!(via_snapshot, whole, "snapshot at step {cut}");

        // Rebuild by replaying what came before (ticks included, as the service would replay them).
        let mut rebuilt = engine();
        run(&mut rebuilt, before);
        got.extend(run(&mut rebuilt, after));
        assert_eq!(got, whole, "rebuild at step {cut}");
    }
}
