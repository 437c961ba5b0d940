//! `classifier-state`: what the classifier's decision state costs in memory per node as a fleet
//! runs, beyond the first minutes a `fleet-scale` run sees.
//!
//! The fleet's stream ([`crate::fleet::Enriched`]: the collector's shape and intervals, its fault
//! mix) is fed, in this process and without servers, through the classifier's own engine (the
//! default rules' state per node and key, each node's facts, and the ids of its recent events,
//! kept to ignore a redelivered event) and keeper (each node, GPU and kind's last recorded
//! reading, and the open rollups, whose closed ones are taken out and dropped as the classifier
//! hands them to its writer). At each `--checkpoints` (events per node) it reads this process's
//! resident memory; the growth from before the first event, divided by the nodes, is the state's
//! cost per node at that age of the fleet. Then every collector restarts (a rollout of the
//! collector DaemonSet) and it counts, by event kind, what the keeper records of the start
//! inventories and snapshots sent again, and why. One node of the collector's stream sends about 8
//! events a minute, so 1,000 events a node is about two hours of a real fleet.
//!
//! This process allocates with glibc's malloc and the classifier with mimalloc, so the figures
//! are the state's size to within the allocators' overheads, not the classifier's RSS. The
//! classifier's other per-node state (its lemon, NVLink and workload bookkeeping) is not fed.

use std::collections::BTreeMap;
use std::time::Instant;

use gpumedic_classifier::persist::{Keeper, Policy, rollups_for_batch};
use gpumedic_classifier::rules::state::CondState;
use gpumedic_classifier::rules::{Engine, defaults};

use crate::fleet::{Enriched, Intervals};
use crate::procs::Watched;

/// Options of the scenario.
#[derive(Debug, clap::Args)]
pub struct Options {
    /// Nodes of 8 GPUs in the fleet.
    #[arg(long, default_value_t = 2000)]
    nodes: usize,
    /// Events per node at which memory is read, ascending.
    #[arg(long, value_delimiter = ',', default_value = "65,300,1000,2000")]
    checkpoints: Vec<usize>,
    /// Feed only one part of the state, to tell their costs apart: `engine` (the keeper gets
    /// nothing) or `keeper` (the engine sees nothing; every event has no bearing).
    #[arg(long, value_parser = ["both", "engine", "keeper", "none"], default_value = "both")]
    part: String,
    /// The chance that an event starts a fault. The default, 1%, is some 120 faults a node a
    /// day, which nothing repairs here, so their incidents pile up; 0 is a healthy fleet.
    #[arg(long, default_value_t = 0.01)]
    fault_chance: f64,
    /// The keeper's rollup period, as the classifier's `--rollup-period` (default the same).
    #[arg(long, default_value = gpumedic_classifier::persist::DEFAULT_ROLLUP_PERIOD, value_parser = crate::duration)]
    rollup_period: std::time::Duration,
}

/// The memory at one checkpoint.
#[derive(Debug, serde::Serialize)]
pub struct Checkpoint {
    events_per_node: usize,
    /// Hours of the fleet's own time the stream spans so far.
    fleet_hours: f64,
    /// Growth of this process's resident memory since before the first event, MiB.
    growth_mib: f64,
    bytes_per_node: f64,
}

/// The JSON result.
#[derive(Debug, serde::Serialize)]
pub struct Result {
    scenario: &'static str,
    nodes: usize,
    events: usize,
    events_per_sec: f64,
    checkpoints: Vec<Checkpoint>,
    /// After the checkpoints, a rollout of the collector: per event kind, what was recorded.
    rollout: BTreeMap<String, Kept>,
}

/// Events of one kind, and how many of them the keeper recorded and why.
#[derive(Debug, Default, serde::Serialize)]
pub struct Kept {
    events: u64,
    recorded: u64,
    unhealthy: u64,
    /// The engine's bearing: evidence for or against an incident, or a changed fact.
    evidence: u64,
    facts: u64,
}

/// The classifier's largest batch (`--batch-max`'s default): each closes and hands out as many
/// rollups ([`rollups_for_batch`]). Handed out 20,000 at a time, as until 2026-12-04, the
/// hand-out itself (some 11 MB of keys and rows at once) was most of the keeper's high-water
/// mark at 500 nodes.
const BATCH: usize = 5000;

/// Events a node fed after the rollout: its start inventory and snapshot (65 events of a node of
/// 8 GPUs), and a little more.
const ROLLOUT_EVENTS_PER_NODE: usize = 80;

/// Runs the scenario and prints a line per checkpoint.
pub fn run(o: Options) -> anyhow::Result<Result> {
    anyhow::ensure!(
        !o.checkpoints.is_empty() && o.checkpoints.windows(2).all(|w| w[0] < w[1]),
        "--checkpoints: events per node must grow"
    );
    let nodes = o.nodes.max(1);
    let o_part = o.part.as_str();
    // The collector's own pace: the stream's events spaced as the fleet sends them.
    let spacing = chrono::TimeDelta::microseconds((1e6 / Intervals::COLLECTOR.steady_rate(nodes)) as i64);
    let total = nodes * o.checkpoints.last().copied().unwrap_or(0);
    let base = chrono::Utc::now() - spacing * i32::try_from(total).unwrap_or(i32::MAX);
    let rss = || Watched { pid: std::process::id(), with_children: false }.read().map_or(f64::NAN, |r| r.mib);
    let mut stream = Enriched::with_fault_chance(nodes, base, spacing, o.fault_chance)?;
    let mut engine = Engine::new(defaults::rule_set().map_err(|e| anyhow::anyhow!("{e:?}"))?);
    // As the classifier builds it with its defaults (`--rebuild-window 48h`).
    let mut keeper = Keeper::for_rebuild_window(Policy::Evidence, std::time::Duration::from_secs(48 * 3600))
        .with_rollup_period(o.rollup_period);
    println!(
        "classifier-state: {nodes} nodes of 8 GPUs, the collector's stream with a fault chance of {}, the default rules, rollups per {:?}; {o_part} fed",
        o.fault_chance, o.rollup_period
    );
    let before = rss();
    let (start, mut fed) = (Instant::now(), 0usize);
    let mut checkpoints = Vec::new();
    for &per_node in &o.checkpoints {
        while fed < per_node * nodes {
            let Some(e) = stream.next() else { break };
            let o = gpumedic_classifier::observe::observation(&e);
            let bearing =
                if o_part == "both" || o_part == "engine" { engine.observe_bearing(&o).1 } else { Default::default() };
            if o_part == "both" || o_part == "keeper" {
                keeper.keep(&o, bearing);
            }
            fed += 1;
            // As the classifier's full batches (5,000 events) hand its writer the closed rollups.
            if fed % BATCH == 0 {
                drop(keeper.closed(rollups_for_batch(BATCH)));
            }
        }
        let growth_mib = rss() - before;
        let c = Checkpoint {
            events_per_node: per_node,
            fleet_hours: (spacing * i32::try_from(fed).unwrap_or(i32::MAX)).num_seconds() as f64 / 3600.0,
            growth_mib,
            bytes_per_node: growth_mib * 1024.0 * 1024.0 / nodes as f64,
        };
        println!(
            "  {:>6} events a node ({:.1} h of the fleet's time): {:>7.1} MiB, {:>7.0} bytes a node; at 100,000 nodes {:.2} GiB",
            c.events_per_node,
            c.fleet_hours,
            c.growth_mib,
            c.bytes_per_node,
            c.bytes_per_node * 100_000.0 / (1u64 << 30) as f64
        );
        // What the keeper holds now: resident memory is a high-water mark, and the keeper's
        // rollups come and go with their periods.
        let held = keeper.footprint();
        if held.nodes > 0 {
            let per = |count: usize| count as f64 / held.nodes as f64;
            println!(
                "         the keeper per node: {:.1} keys ({:.1} of kinds that count), {:.1} rollups open or \
                 waiting to be handed out, holding {:.1} readings and counters",
                per(held.keys),
                per(held.counting_keys),
                per(held.rollups),
                per(held.fields),
            );
        }
        checkpoints.push(c);
    }
    // What the engine holds per node, from its own snapshot.
    let snapshot = engine.snapshot();
    if !snapshot.nodes.is_empty() {
        let per = |f: &dyn Fn(&gpumedic_classifier::rules::engine::NodeSnapshot) -> usize| {
            snapshot.nodes.iter().map(f).sum::<usize>() as f64 / snapshot.nodes.len() as f64
        };
        println!(
            "  the engine per node: {:.0} rule keys ({:.0} bytes of JSON), {:.0} counters and {:.0} GPU names \
             ({:.0} bytes of JSON for all its facts), {:.0} recent event ids",
            per(&|n| n.keys.len()),
            per(&|n| json_len(&n.keys)),
            per(&|n| n.facts.counters.len()),
            per(&|n| n.facts.names.len()),
            per(&|n| json_len(&n.facts)),
            per(&|n| n.recent.len()),
        );
        // The rule keys by their condition's type, and what each type holds: a rate keeps counter
        // samples, a count its latest events.
        let mut kinds: BTreeMap<&str, (usize, usize)> = BTreeMap::new();
        for k in snapshot.nodes.iter().flat_map(|n| &n.keys) {
            let (kind, held) = match &k.state.cond {
                CondState::Count { events } => ("count", events.len()),
                CondState::Burst { burst } => ("burst", burst.as_ref().map_or(0, |b| b.evidence.len())),
                CondState::Together { last } => ("together", last.iter().flatten().count()),
                CondState::Rate { samples } => ("rate", samples.len()),
                CondState::Threshold { since, .. } => ("threshold", usize::from(since.is_some())),
            };
            let e = kinds.entry(kind).or_default();
            e.0 += 1;
            e.1 += held;
        }
        let n = snapshot.nodes.len() as f64;
        let list: Vec<String> = kinds
            .iter()
            .map(|(kind, (keys, held))| format!("{kind} {:.1} keys holding {:.1}", *keys as f64 / n, *held as f64 / n))
            .collect();
        println!(
            "  the rule keys per node by condition (and the samples, events or readings they hold): {}",
            list.join(", ")
        );
        let open = engine.open_incidents();
        let mut by_rule: BTreeMap<&str, usize> = BTreeMap::new();
        for i in &open {
            *by_rule.entry(i.rule_id.as_str()).or_default() += 1;
        }
        let mut by_rule: Vec<_> = by_rule.into_iter().collect();
        by_rule.sort_by_key(|(_, count)| std::cmp::Reverse(*count));
        let by_rule: Vec<String> =
            by_rule.iter().map(|(rule, count)| format!("{rule} {:.2}", *count as f64 / n)).collect();
        println!("  open incidents per node: {:.2} ({})", open.len() as f64 / n, by_rule.join(", "));
        println!(
            "  in memory: a rule key's state {} bytes (its condition's {}), a piece of evidence {}, a counter sample {}",
            std::mem::size_of::<gpumedic_classifier::rules::engine::KeyState>(),
            std::mem::size_of::<CondState>(),
            std::mem::size_of::<gpumedic_classifier::rules::state::Ev>(),
            std::mem::size_of::<gpumedic_classifier::rules::state::Sample>(),
        );
    }
    // A rollout of the collector: every node's start inventory and snapshot again, to a
    // classifier that knows the fleet. What of it is recorded, by kind and why.
    stream.restart_collectors();
    let mut rollout: BTreeMap<String, Kept> = BTreeMap::new();
    for _ in 0..nodes * ROLLOUT_EVENTS_PER_NODE {
        let Some(e) = stream.next() else { break };
        let o = gpumedic_classifier::observe::observation(&e);
        let (_, bearing) = engine.observe_bearing(&o);
        let kept = keeper.keep(&o, bearing);
        let k = rollout.entry(o.kind.clone()).or_default();
        k.events += 1;
        k.recorded += u64::from(kept);
        k.unhealthy += u64::from(!o.healthy);
        k.evidence += u64::from(bearing.evidence);
        k.facts += u64::from(bearing.facts);
    }
    println!("  then every collector restarts; of the next {ROLLOUT_EVENTS_PER_NODE} events a node, recorded:");
    for (kind, k) in &rollout {
        println!(
            "    {kind:<18} {:>6} of {:>7} (unhealthy {}, evidence {}, facts {})",
            k.recorded, k.events, k.unhealthy, k.evidence, k.facts
        );
    }
    Ok(Result {
        scenario: "classifier-state",
        rollout,
        nodes,
        events: fed,
        events_per_sec: fed as f64 / start.elapsed().as_secs_f64(),
        checkpoints,
    })
}

/// The length of `value`'s JSON.
fn json_len(value: &impl serde::Serialize) -> usize {
    serde_json::to_vec(value).map_or(0, |v| v.len())
}
