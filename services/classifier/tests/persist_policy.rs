//! Against the testbed's real PostgreSQL: the same event stream recorded under `--persist all`
//! and `--persist evidence` rebuilds the same engine state (open incidents, every rule's
//! condition, the nodes' facts), though `evidence` records a fraction of the events; and the
//! rollups of what it left out are in `telemetry_rollups`.
//!
//! The stream is a few nodes' hours of heartbeats, temperatures, power and ECC counters with
//! faults in it: a GPU held at its slowdown temperature, an Xid 48, an Xid 79 followed by a
//! reboot, an ECC counter reset, GPU inventories. Each event goes through the engine and the
//! keeper as the batch handler sends it, and is written with the classifier's batch statement.

use chrono::{DateTime, Duration, Utc};
use gpumedic_classifier::persist::{Keeper, Policy};
use gpumedic_classifier::rules::{Engine, defaults};
use gpumedic_classifier::store::{self, Batch};
use gpumedic_classifier::{connect_and_migrate, observe};
use gpumedic_schemas::EnrichedHealthEvent;
use gpumedic_schemas::health::{
    Component, Detail, EccDetail, Entity, GpuIdentity, GpuInventoryDetail, HealthEvent, MonitorHealthDetail,
    MonitorState, PowerDetail, Source, TemperatureDetail, XidDetail,
};
use gpumedic_testkit as testkit;

const NODES: usize = 3;
const GPUS: usize = 4;

fn gpu(n: usize, g: usize) -> String {
    format!("GPU-{n:08x}-{g:04x}-0000-0000-000000000000")
}

fn event(n: usize, g: Option<usize>, source: Source, detail: Detail, healthy: bool, at: DateTime<Utc>) -> HealthEvent {
    let entity = Entity { gpu_uuid: g.map(|g| gpu(n, g)), gpu_index: g.map(|g| g as i32), ..Default::default() };
    let mut e = HealthEvent::new(format!("persist-node-{n}"), source, Component::Gpu, entity, detail);
    e.healthy = healthy;
    e.observed_at = at;
    e
}

fn enriched(e: HealthEvent) -> EnrichedHealthEvent {
    testkit::enriched(e).build()
}

fn xid(code: i32) -> Detail {
    Detail::Xid(XidDetail {
        code,
        text: format!("NVRM: Xid {code}"),
        pid: None,
        process: None,
        nvlink5: None,
        recovery_action: None,
    })
}

/// Two and a half hours of the fleet's stream, every 10 s per node, starting at `base`.
fn stream(base: DateTime<Utc>) -> Vec<EnrichedHealthEvent> {
    let mut out = Vec::new();
    let steps = 900;
    for step in 0..steps {
        let at = base + Duration::seconds(step * 10);
        for n in 0..NODES {
            let at = at + Duration::milliseconds(n as i64 * 7);
            // Node 1 reboots at step 500 (after its Xid 79 at step 300).
            let boot = if n == 1 && step >= 500 { "boot-2" } else { "boot-1" };
            let mut push = |mut e: HealthEvent| {
                e.boot_id = Some(boot.into());
                out.push(enriched(e));
            };
            let heartbeat = MonitorHealthDetail { monitor: "nvml".into(), state: MonitorState::Ok, message: None };
            push(event(n, None, Source::Nvml, Detail::MonitorHealth(heartbeat), true, at));
            let g = (step as usize) % GPUS;
            // GPU 2 of node 0 runs hot from step 100 to 120 (over its slowdown threshold for
            // 200 s), and again from step 800 on (still hot at the end).
            let hot = n == 0 && g == 2 && ((100..120).contains(&step) || step >= 800);
            let celsius = if hot { 92 } else { 60 + ((step * 7 + n as i64) % 15) as i32 };
            let temp = TemperatureDetail { celsius, slowdown_celsius: Some(90), shutdown_celsius: Some(95) };
            push(event(n, Some(g), Source::Nvml, Detail::Temperature(temp), !hot, at));
            let power = PowerDetail { watts: 400.0 + ((step * 13) % 200) as f64, limit_watts: Some(700.0) };
            push(event(n, Some(g), Source::Nvml, Detail::Power(power), true, at));
            if step % 3 == 0 {
                // Node 2's GPU 1 gains a corrected error now and then; its volatile count starts
                // again from zero at step 600 (a reset).
                let grown = if n == 2 && g == 1 { step / 50 } else { 0 };
                let volatile = if n == 2 && g == 1 && step >= 600 { (step - 600) / 50 } else { grown };
                let ecc = EccDetail {
                    single_bit_volatile: Some(volatile),
                    double_bit_volatile: Some(0),
                    single_bit_aggregate: Some(3 + grown),
                    double_bit_aggregate: Some(0),
                    location: None,
                };
                push(event(n, Some(g), Source::Nvml, Detail::Ecc(ecc), true, at));
            }
            if step % 60 == 0 {
                let gpus = (0..GPUS)
                    .map(|g| GpuIdentity { index: Some(g as i32), uuid: Some(gpu(n, g)), ..Default::default() })
                    .collect();
                let reason = if step == 0 { GpuInventoryDetail::START } else { GpuInventoryDetail::REFRESH };
                let inventory = GpuInventoryDetail { gpus, reason: reason.into(), expected: Some(GPUS as i32) };
                push(event(n, None, Source::Nvml, Detail::GpuInventory(inventory), true, at));
            }
            // Node 0, GPU 3: an Xid 48 at step 200. Node 1: an Xid 79 at step 300, then the reboot.
            if n == 0 && step == 200 {
                push(event(n, Some(3), Source::KernelLog, xid(48), false, at));
            }
            if n == 1 && step == 300 {
                push(event(n, Some(0), Source::KernelLog, xid(79), false, at));
            }
        }
    }
    out
}

/// The stream through an engine and a keeper for `policy`, written to a fresh database in batches
/// of 500 as the handler writes them; returns the pool, the live engine and keeper, and the rows
/// recorded.
async fn record(name: &str, policy: Policy, events: &[EnrichedHealthEvent]) -> (sqlx::PgPool, Engine, Keeper, usize) {
    let admin = testkit::require_postgres().await.unwrap_or_else(|e| panic!("{e}"));
    let db = testkit::unique_name(name).replace('-', "_");
    let url = testkit::fresh_database(&admin, &db).await.expect("database");
    let pool = connect_and_migrate(&url, 4).await.expect("migrated");
    let mut engine = Engine::new(defaults::rule_set().expect("default rules"));
    let mut keeper = Keeper::new(policy);
    let mut recorded = 0;
    for chunk in events.chunks(500) {
        let mut batch = Batch::default();
        for e in chunk {
            let o = observe::observation(e);
            let (_, bearing) = engine.observe_bearing(&o);
            if keeper.keep(&o, bearing) {
                batch.events.push(e).expect("recordable");
                recorded += 1;
            }
        }
        for (k, r) in keeper.closed(gpumedic_classifier::persist::ROLLUPS_PER_BATCH) {
            batch.rollups.push(&k, &r);
        }
        store::write_batch(&pool, &batch).await.expect("written");
    }
    engine.take_absorbed();
    engine.take_refused();
    (pool, engine, keeper, recorded)
}

/// An engine's state without what a replay of fewer events may set differently: each node's clock
/// (the newest event time it saw) and its memory of recent event ids.
fn state(engine: &Engine) -> Vec<(String, String)> {
    engine.snapshot().nodes.into_iter().map(|n| (n.node, format!("{:?} {:?}", n.keys, n.facts))).collect()
}

async fn rebuilt(pool: &sqlx::PgPool, since: DateTime<Utc>, keeper: &mut Keeper) -> Engine {
    let nodes = store::nodes_since(pool, since).await.expect("nodes");
    let rules = defaults::rule_set().expect("default rules");
    store::rebuild(pool, rules, since, &nodes, keeper).await.expect("rebuilt").0
}

#[tokio::test]
async fn evidence_only_history_rebuilds_the_same_state_as_every_event() {
    let base = Utc::now() - Duration::hours(3);
    let events = stream(base);
    let (all_pool, live, _, all_rows) = record("persist-all", Policy::All, &events).await;
    let (evidence_pool, live_evidence, mut live_keeper, evidence_rows) =
        record("persist-evidence", Policy::Evidence, &events).await;
    assert_eq!(all_rows, events.len());
    assert!(
        evidence_rows * 3 < all_rows,
        "evidence recorded {evidence_rows} of {all_rows} events; most of this stream is plain telemetry"
    );
    assert_eq!(state(&live), state(&live_evidence), "the policy changes nothing the engine decides");

    let since = base - Duration::minutes(1);
    let from_all = rebuilt(&all_pool, since, &mut Keeper::new(Policy::Evidence)).await;
    let mut restarted = Keeper::new(Policy::Evidence);
    let from_evidence = rebuilt(&evidence_pool, since, &mut restarted).await;
    let open = |e: &Engine| {
        let mut v: Vec<_> = e.open_incidents().into_iter().map(|i| (i.node, i.rule_id, i.gpu, i.incident_id)).collect();
        v.sort();
        v
    };
    assert!(!open(&live).is_empty(), "the stream leaves incidents open: {:?}", open(&live));
    assert_eq!(open(&from_all), open(&live));
    assert_eq!(open(&from_evidence), open(&from_all), "the same open incidents after a restart");
    assert_eq!(state(&from_evidence), state(&from_all), "the same conditions and facts after a restart");

    // The keeper of a restarted classifier, taking in what the rebuild replayed, records the
    // stream's next readings as the live one does: not the first of every key again.
    let last = events.last().expect("events").event.observed_at;
    let next: Vec<_> = events
        .iter()
        .filter(|e| e.event.observed_at > last - Duration::seconds(30))
        .map(|e| {
            let mut o = observe::observation(e);
            o.observed_at_micros += 30_000_000;
            o
        })
        .collect();
    let none = Default::default();
    let live_kept: Vec<bool> = next.iter().map(|o| live_keeper.keep(o, none)).collect();
    let restarted_kept: Vec<bool> = next.iter().map(|o| restarted.keep(o, none)).collect();
    let fresh_kept = next.iter().filter(|o| Keeper::new(Policy::Evidence).keep(o, none)).count();
    assert_eq!(restarted_kept, live_kept, "a restart changes nothing the keeper records");
    let kept = live_kept.iter().filter(|k| **k).count();
    assert!(
        kept < fresh_kept / 2,
        "{kept} of {} next readings recorded; a keeper knowing nothing: {fresh_kept}",
        next.len()
    );

    // What was left out is in the rollups: every healthy event, counted once.
    let (rollup_events,): (i64,) = sqlx::query_as("SELECT coalesce(sum(events), 0)::int8 FROM telemetry_rollups")
        .fetch_one(&evidence_pool)
        .await
        .expect("rollups");
    let healthy = events.iter().filter(|e| e.event.healthy).count() as i64;
    let last_minutes = (NODES * (GPUS + 1) * 4) as i64 * 7;
    assert!(
        rollup_events <= healthy && rollup_events > healthy - last_minutes,
        "rollups hold {rollup_events} of {healthy} healthy events (the open minutes are not written yet)"
    );
    let (grown,): (Option<i64>,) = sqlx::query_as(
        "SELECT sum((counters ->> 'single_bit_aggregate')::int8)::int8 FROM telemetry_rollups
          WHERE node = 'persist-node-2' AND gpu_uuid = $1 AND kind = 'ecc'",
    )
    .bind(gpu(2, 1))
    .fetch_one(&evidence_pool)
    .await
    .expect("counter growth");
    assert_eq!(grown, Some(17), "node 2's GPU 1 gained 17 corrected errors over the stream");
    let (none,): (i64,) =
        sqlx::query_as("SELECT count(*) FROM telemetry_rollups").fetch_one(&all_pool).await.expect("rollups");
    assert_eq!(none, 0, "--persist all writes no rollups");
}
