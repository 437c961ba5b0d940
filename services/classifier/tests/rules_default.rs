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
    let by = |o: Observation, pid: i64| o.field("pid", pid).field("process", "python");
    e.observe(&by(xid("e1", T0, "GPU-0", 13), 100));
    assert!(e.observe(&by(xid("e2", T0 + H, "GPU-0", 13), 200)).is_empty(), "the open info incident is not re-fired");
    // The same process failing again is not another occurrence.
    assert!(e.observe(&by(xid("e2b", T0 + H + MIN, "GPU-0", 13), 200)).is_empty());
    let d = only(e.observe(&by(xid("e3", T0 + 2 * H, "GPU-0", 13), 300)));
    assert_eq!(
        (d.rule_id.as_str(), d.severity, d.action),
        ("xid-application-repeated", Severity::Warning, Action::RunDiagnostics)
    );
    assert!(!d.action.quarantines(), "an application Xid never takes the GPU out of service by count");
    assert_eq!(d.evidence, ["e1", "e2b", "e3"]);

    // One exception logged as three lines in the same millisecond counts once, whatever the window.
    let mut e = engine();
    only(e.observe(&by(xid("l1", T0, "GPU-0", 13), 7)));
    assert!(e.observe(&by(xid("l2", T0 + 200, "GPU-0", 13), 7)).is_empty());
    assert!(e.observe(&by(xid("l3", T0 + 400, "GPU-0", 13), 7)).is_empty());
    assert_eq!(e.open_incidents().len(), 1);

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
    let o = xid("e1", T0, "GPU-0", 154).field("recovery_action", "Drain P2P");
    let d = only(e.observe(&o));
    assert_eq!((d.severity, d.action), (Severity::Warning, Action::Drain));
    let d = only(e.observe(&xid("e2", T0 + S, "GPU-0", 62)));
    assert_eq!((d.rule_id.as_str(), d.action), ("xid-reset-gpu", Action::Drain));
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
    assert!(e.observe(&temperature("t4", T0 + 80 * S, 96, false)).is_empty(), "one reading at shutdown is not enough");
    let d = only(e.observe(&temperature("t4b", T0 + 85 * S, 97, false)));
    assert_eq!((d.rule_id.as_str(), d.severity, d.action), ("temperature-shutdown", Severity::Critical, Action::Drain));
    assert_eq!(d.evidence, ["t4", "t4b"], "two readings in a row");
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
    let opened = only(e.observe(&xid("e1", T0, "GPU-0", 79).boot("boot-1")));
    assert!(e.tick(T0 + 48 * H).is_empty(), "time alone never closes an incident");
    // The other GPUs answering proves nothing about the lost one...
    assert!(e.observe(&healthy("o1", T0 + 47 * H, "GPU-1").boot("boot-1")).is_empty());
    // ...nor does the lost GPU answering before the node rebooted.
    assert!(e.observe(&healthy("h0", T0 + 48 * H, "GPU-0").boot("boot-1")).is_empty());
    assert!(e.tick(T0 + 48 * H + 30 * MIN).is_empty());
    // After a reboot its healthy evidence starts the 15-minute quiet period...
    assert!(e.observe(&healthy("h1", T0 + 48 * H + 31 * MIN, "GPU-0").boot("boot-2")).is_empty());
    // ...new fault evidence cancels it...
    assert!(e.observe(&Observation::new("e2", "node-a", T0 + 48 * H + 35 * MIN, "gpu_lost").boot("boot-2")).is_empty());
    assert!(e.tick(T0 + 48 * H + 50 * MIN).is_empty());
    // ...and fresh healthy evidence must stand the whole period again (after a reboot: the
    // incident's boot was boot-1, and boot-2 is still newer than it).
    assert!(e.observe(&healthy("h2", T0 + 49 * H, "GPU-0").boot("boot-2")).is_empty());
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
    // Double-bit errors held for 30 s (the Xid of the same error gets there first).
    let mut e = engine();
    assert!(e.observe(&gpu("a", "ecc").field("double_bit_volatile", 2)).is_empty());
    let d = only(e.tick(T0 + 30 * S));
    assert_eq!((d.rule_id.as_str(), d.severity, d.action), ("ecc-double-bit", Severity::Critical, Action::ResetGpu));
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
#[allow(clippy::large_enum_variant)] // a test stream, built once
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

fn inventory(id: &str, t: i64, boot: &str, gpus: &[&str], missing: i64) -> Observation {
    let mut o = Observation::new(id, "node-a", t, "gpu_inventory").boot(boot).field("missing", missing);
    o.healthy = missing == 0;
    o.inventory = gpus.iter().map(|g| g.to_string()).collect();
    o
}

#[test]
fn a_gpu_missing_from_the_inventory_is_a_fault_that_only_a_reboot_with_every_gpu_clears() {
    let mut e = engine();
    let all: Vec<String> = (0..8).map(|i| format!("GPU-{i}")).collect();
    let all: Vec<&str> = all.iter().map(String::as_str).collect();
    assert!(e.observe(&inventory("i0", T0, "boot-1", &all, 0)).is_empty());
    let d = only(e.observe(&inventory("i1", T0 + MIN, "boot-1", &all[1..], 1)));
    assert_eq!(
        (d.rule_id.as_str(), d.action, d.severity),
        ("xid-79-fallen-off-the-bus", Action::RebootNode, Severity::Critical)
    );
    // The seven others keep answering for hours: the node stays out.
    for (i, t) in (1..=12).map(|k| (k, T0 + k * 10 * MIN)) {
        for g in &all[1..] {
            assert!(e.observe(&healthy(&format!("h{i}-{g}"), t, g).boot("boot-1")).is_empty());
        }
    }
    assert!(e.tick(T0 + 3 * H).is_empty());
    // A reboot that does not bring the GPU back changes nothing.
    assert!(e.observe(&inventory("i2", T0 + 4 * H, "boot-2", &all[1..], 1)).is_empty());
    assert!(e.tick(T0 + 5 * H).is_empty());
    // The next reboot brings every GPU back: the complete inventory starts the quiet period.
    assert!(e.observe(&inventory("i3", T0 + 6 * H, "boot-3", &all, 0)).is_empty());
    let back = only(e.tick(T0 + 6 * H + 15 * MIN));
    assert!(back.recovery && back.incident_id == d.incident_id);
}

#[test]
fn the_lost_gpus_own_heartbeat_after_a_reboot_releases_the_node_and_others_never_do() {
    let mut e = engine();
    let d = only(e.observe(&xid("x", T0, "GPU-3", 79).boot("boot-1")));
    assert!(d.gpu.is_none() && d.reason.contains("GPU-3"), "a node-wide verdict names the failed GPU in its reason");
    assert!(e.observe(&healthy("h1", T0 + H, "GPU-4").boot("boot-2")).is_empty());
    assert!(e.tick(T0 + 3 * H).is_empty(), "another GPU's heartbeat after the reboot is not the lost GPU's");
    assert!(e.observe(&healthy("h2", T0 + 3 * H, "GPU-3").boot("boot-2")).is_empty());
    let back = only(e.tick(T0 + 3 * H + 15 * MIN));
    assert!(back.recovery);
}

#[test]
fn the_kernel_logs_pci_id_and_nvmls_uuid_are_one_gpu_and_one_incident() {
    let mut e = engine();
    // NVML's heartbeat ties the PCI bus id to the UUID.
    let mut hb = healthy("hb", T0, "GPU-aaaa");
    hb.gpu_pci = Some("0000:1b:00.0".into());
    hb.gpu_index = Some(2);
    e.observe(&hb);
    // The kernel log names the GPU by PCI only; the ECC counter by UUID.
    assert!(e.observe(&xid("x48", T0 + S, "0000:1b:00.0", 48)).is_empty());
    assert!(
        e.observe(
            &Observation::new("ecc", "node-a", T0 + 5 * S, "ecc").gpu("GPU-aaaa").field("double_bit_volatile", 1)
        )
        .is_empty()
    );
    let d = only(e.tick(T0 + 40 * S));
    assert_eq!(
        (d.rule_id.as_str(), d.gpu.as_deref(), d.gpu_index, d.gpu_pci.as_deref()),
        ("ecc-double-bit", Some("GPU-aaaa"), Some(2), Some("0000:1b:00.0"))
    );
    assert!(e.tick(T0 + 10 * MIN).is_empty(), "the Xid 48 burst joins the counter's incident");
    assert_eq!(e.open_incidents().len(), 1);
    // A reset (the volatile counter back at 0) clears it after the quiet period.
    assert!(
        e.observe(
            &Observation::new("ecc0", "node-a", T0 + H, "ecc")
                .gpu("GPU-aaaa")
                .field("double_bit_volatile", 0)
                .healthy()
        )
        .is_empty()
    );
    let back = only(e.tick(T0 + H + 10 * MIN));
    assert!(back.recovery && back.incident_id == d.incident_id);
}

#[test]
fn a_contained_memory_error_defers_its_reset_and_absorbs_the_counter() {
    let mut e = engine();
    let d = only(e.observe(&xid("x94", T0, "GPU-0", 94)));
    assert_eq!(
        (d.rule_id.as_str(), d.action, d.severity, d.deferrable),
        ("xid-94-contained-memory-error", Action::ResetGpu, Severity::Warning, true)
    );
    e.observe(&Observation::new("ecc", "node-a", T0 + 5 * S, "ecc").gpu("GPU-0").field("double_bit_volatile", 1));
    assert!(e.tick(T0 + 10 * MIN).is_empty(), "no urgent reset for a contained error's counter");
    // 95 is uncontained: urgent, not deferrable.
    let d = only(e.observe(&xid("x95", T0 + H, "GPU-1", 95)));
    assert_eq!((d.action, d.severity, d.deferrable), (Action::ResetGpu, Severity::Critical, false));
}

#[test]
fn sxid_fatal_takes_the_node_out_and_non_fatal_does_not() {
    let sxid = |id: &str, fatal: Option<bool>| {
        let o = Observation::new(id, "node-a", T0, "sxid").source("kernel_log").component("nvswitch").xid(12028);
        match fatal {
            Some(true) => o.field("severity", "fatal"),
            Some(false) => o.field("severity", "non_fatal"),
            None => o,
        }
    };
    let d = only(engine().observe(&sxid("f", Some(true))));
    assert_eq!(
        (d.rule_id.as_str(), d.action, d.then.as_slice(), d.severity),
        ("sxid-nvswitch-fatal", Action::Drain, &[Action::RebootNode][..], Severity::Critical)
    );
    for fatal in [Some(false), None] {
        let d = only(engine().observe(&sxid("n", fatal)));
        assert_eq!((d.rule_id.as_str(), d.action), ("sxid-nvswitch", Action::Monitor));
    }
}

#[test]
fn maintenance_acts_before_its_window_and_never_on_one_that_is_over() {
    let notice = |id: &str, t: i64, start: i64, end: i64| {
        Observation::new(id, "node-a", t, "cloud_maintenance")
            .source("cloud")
            .field("starts_at_micros", start)
            .field("ends_at_micros", end)
    };
    let d = only(engine().observe(&notice("m", T0, T0 + 48 * H, T0 + 50 * H)));
    assert_eq!((d.action, d.not_before_micros), (Action::Drain, Some(T0 + 47 * H)));
    let mut short = Engine::new(rules().with_lead(gpumedic_classifier::rules::Interval::from_secs(60)));
    assert_eq!(only(short.observe(&notice("m", T0, T0 + 2 * MIN, T0 + H))).not_before_micros, Some(T0 + MIN));
    let mut e = engine();
    assert!(e.observe(&notice("old", T0, 0, 1)).is_empty(), "a window that ended in 1970");
    let refused = e.take_refused();
    assert_eq!(refused.len(), 1);
    assert_eq!(refused[0].reason.as_str(), "maintenance_window_over");
}

#[test]
fn impossible_readings_are_refused_before_any_rule() {
    let mut e = engine();
    assert!(e.observe(&temperature("hot", T0, 2_147_483_647, false)).is_empty());
    let bad_threshold = Observation::new("th", "node-a", T0 + S, "temperature")
        .gpu("GPU-0")
        .field("value", 60)
        .field("slowdown_threshold", 0)
        .field("shutdown_threshold", -1);
    assert!(e.observe(&bad_threshold).is_empty());
    assert!(e.tick(T0 + H).is_empty());
    let reasons: Vec<&str> = e.take_refused().iter().map(|r| r.reason.as_str()).collect();
    assert_eq!(reasons, ["temperature_out_of_range", "threshold_out_of_range"]);
    assert!(e.open_incidents().is_empty());
}
