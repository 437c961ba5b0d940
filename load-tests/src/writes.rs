//! `event-writes`: how fast the classifier's event rows go into PostgreSQL by each way of writing
//! them, on the same rows, each into a fresh database, `--batch` events per statement on one
//! connection (the classifier writes each part of a batch so):
//!
//! 1. `unnest`: the classifier's batch statement with the events bound as arrays (`INSERT ...
//!    SELECT FROM UNNEST(arrays) ON CONFLICT DO NOTHING`), events only: how it wrote before;
//! 2. `copy-staging`: binary `COPY` into a temporary table, then `INSERT ... SELECT ... ON
//!    CONFLICT DO NOTHING` (idempotent, as the classifier's write must be);
//! 3. `batch`: the classifier's batch write as it is ([`store::write_batch`]: `COPY` into the
//!    staging table, then the batch statement reading it), events only;
//! 4. `copy-unchecked`: binary `COPY` straight into `health_events`, not idempotent (a redelivered
//!    event fails the batch): the ceiling of COPY, not a candidate.
//!
//! The events are the fleet mix of [`crate::classify`]. Each method writes the same batches twice
//! (the second pass is a redelivery: nothing new) except `copy-unchecked`, which cannot. The
//! methods take turns batch by batch, each on its own connection to its own database.

use std::time::Instant;

use chrono::{DateTime, TimeDelta, Utc};

use gpumedic_classifier::store::{self, Batch, EventRows};
use gpumedic_testkit as testkit;

/// Options of the scenario.
#[derive(Debug, clap::Args)]
pub struct Options {
    /// How many events.
    #[arg(long, default_value_t = 100_000)]
    events: usize,
    /// Events per statement.
    #[arg(long, default_value_t = 5000)]
    batch: usize,
    /// Nodes in the simulated fleet (8 GPUs each).
    #[arg(long, default_value_t = 1000)]
    nodes: usize,
}

/// One method's figures.
#[derive(Debug, serde::Serialize)]
pub struct Method {
    method: &'static str,
    /// Events per second on the first pass (all new).
    new_per_sec: f64,
    /// Events per second on the second pass (all already recorded); 0 when not run.
    redelivered_per_sec: f64,
}

/// The JSON result.
#[derive(Debug, serde::Serialize)]
pub struct Result {
    scenario: &'static str,
    events: usize,
    batch: usize,
    methods: Vec<Method>,
}

/// Runs the scenario and prints one line per method.
pub async fn run(o: Options) -> anyhow::Result<Result> {
    let admin = testkit::require_postgres().await?;
    let base = chrono::Utc::now() - chrono::Duration::minutes(30);
    let mut batches: Vec<EventRows> = Vec::new();
    let events: Vec<_> =
        crate::fleet::Enriched::new(o.nodes, base, chrono::Duration::microseconds(10))?.take(o.events).collect();
    for chunk in events.chunks(o.batch.max(1)) {
        let mut rows = EventRows::with_capacity(chunk.len());
        for e in chunk {
            rows.push(e)?;
        }
        batches.push(rows);
    }
    println!("event-writes: {} events, {} per statement", o.events, o.batch);
    const METHODS: [&str; 4] = ["unnest", "copy-staging", "batch", "copy-unchecked"];
    let mut pools = Vec::new();
    for method in METHODS {
        let db = testkit::unique_name(&format!("bench_writes_{method}")).replace('-', "_");
        let url = testkit::fresh_database(&admin, &db).await?;
        let pool = gpumedic_classifier::connect_and_migrate(&url, 1).await?;
        gpumedic_classifier::retention::maintain_logged(&pool, std::time::Duration::from_secs(30 * 86_400)).await;
        pools.push((db, pool));
    }
    // The methods take turns batch by batch, so a busy moment of the (shared) machine slows each
    // of them alike rather than whichever ran then.
    let mut seconds = [[0.0f64; METHODS.len()]; 2];
    for (pass, spent) in seconds.iter_mut().enumerate() {
        let mut new = [0u64; METHODS.len()];
        for rows in &batches {
            for (m, method) in METHODS.iter().enumerate() {
                if pass == 1 && *method == "copy-unchecked" {
                    continue;
                }
                let pool = &pools[m].1;
                let batch = Batch { events: rows.clone(), ..Default::default() };
                let start = Instant::now();
                new[m] += match *method {
                    "unnest" => u64::try_from(store::write_batch_arrays(pool, &batch).await?.new_events).unwrap_or(0),
                    "batch" => u64::try_from(store::write_batch(pool, &batch).await?.new_events).unwrap_or(0),
                    "copy-staging" => store::copy_events(pool, rows).await?,
                    _ => store::copy_events_unchecked(pool, rows).await?,
                };
                spent[m] += start.elapsed().as_secs_f64();
            }
        }
        for (m, method) in METHODS.iter().enumerate() {
            let expected = if pass == 0 { o.events as u64 } else { 0 };
            anyhow::ensure!(new[m] == expected, "{method}: {} new rows on pass {pass}, {expected} expected", new[m]);
        }
    }
    let mut methods = Vec::new();
    for (m, method) in METHODS.iter().enumerate() {
        let rate = |s: f64| if s > 0.0 { o.events as f64 / s } else { 0.0 };
        let (new, redelivered) = (rate(seconds[0][m]), rate(seconds[1][m]));
        println!("  {method:<15} {new:>9.0} events/s new, {redelivered:>9.0} events/s redelivered");
        methods.push(Method { method, new_per_sec: new, redelivered_per_sec: redelivered });
    }
    for (db, pool) in pools {
        pool.close().await;
        // Each method's database is a few hundred MB: gone once measured.
        sqlx::query(sqlx::AssertSqlSafe(format!("DROP DATABASE IF EXISTS \"{db}\""))).execute(&admin).await?;
    }
    Ok(Result { scenario: "event-writes", events: o.events, batch: o.batch, methods })
}

/// Options of `persist-policies`.
#[derive(Debug, clap::Args)]
pub struct PolicyOptions {
    /// How many events.
    #[arg(long, default_value_t = 200_000)]
    events: usize,
    /// Events per batch.
    #[arg(long, default_value_t = 5000)]
    batch: usize,
    /// Nodes in the simulated fleet (8 GPUs each).
    #[arg(long, default_value_t = 1000)]
    nodes: usize,
    /// Events per node per second of event time: the fleet's rate decides how many events share a
    /// GPU's rollup period, so how many rollups there are.
    #[arg(long, default_value_t = 0.03)]
    rate_per_node: f64,
    /// The span of each rollup, as the classifier's `--rollup-period`.
    #[arg(long, default_value = gpumedic_classifier::persist::DEFAULT_ROLLUP_PERIOD, value_parser = crate::duration)]
    rollup_period: std::time::Duration,
}

/// One policy's figures.
#[derive(Debug, serde::Serialize)]
pub struct Policy {
    persist: &'static str,
    /// Events classified and written per second (the engine, the keeper and the batch writes on
    /// one connection; no Kafka).
    events_per_sec: f64,
    event_rows: i64,
    rollup_rows: i64,
    /// `pg_total_relation_size` (table, indexes, TOAST) per row.
    event_row_bytes: f64,
    rollup_row_bytes: f64,
}

/// The JSON result of `persist-policies`.
#[derive(Debug, serde::Serialize)]
pub struct PolicyResult {
    scenario: &'static str,
    events: usize,
    nodes: usize,
    rate_per_node: f64,
    /// The rollup period, in seconds.
    rollup_period_s: u64,
    policies: Vec<Policy>,
}

/// Where `events` of a fleet of `nodes` at `rate_per_node` events per node per second start in
/// event time, how far apart they are, and the time they span: ending ten minutes ago.
fn spread(nodes: usize, events: usize, rate_per_node: f64) -> (DateTime<Utc>, TimeDelta, TimeDelta) {
    let fleet_rate = rate_per_node * nodes as f64;
    let spacing = TimeDelta::microseconds((1e6 / fleet_rate.max(1e-6)) as i64);
    let span = spacing * i32::try_from(events).unwrap_or(i32::MAX);
    (Utc::now() - TimeDelta::minutes(10) - span, spacing, span)
}

/// `persist-policies`: the fleet mix, spread in event time at `--rate-per-node`, through the
/// classifier's engine and keeper and its batch write, once with `--persist all` and once with
/// `evidence`, each into a fresh database (PostgreSQL only: no Kafka). Prints the rows each keeps
/// and their size on disk, the figures docs/incident-history.md sizes a fleet from.
pub async fn run_policies(o: PolicyOptions) -> anyhow::Result<PolicyResult> {
    use gpumedic_classifier::persist::{Keeper, Policy as Persist};
    use gpumedic_classifier::rules::{Engine, defaults};
    let admin = testkit::require_postgres().await?;
    let (base, spacing, span) = spread(o.nodes, o.events, o.rate_per_node);
    let events: Vec<_> = crate::fleet::Enriched::new(o.nodes, base, spacing)?.take(o.events).collect();
    println!(
        "persist-policies: {} events of {} nodes at {} per node per second ({:.1} h of event time)",
        o.events,
        o.nodes,
        o.rate_per_node,
        span.num_seconds() as f64 / 3600.0
    );
    let mut policies = Vec::new();
    for (name, persist) in [("all", Persist::All), ("evidence", Persist::Evidence)] {
        let db = testkit::unique_name(&format!("bench_persist_{name}")).replace('-', "_");
        let url = testkit::fresh_database(&admin, &db).await?;
        let pool = gpumedic_classifier::connect_and_migrate(&url, 1).await?;
        gpumedic_classifier::retention::maintain_logged(&pool, std::time::Duration::from_secs(30 * 86_400)).await;
        let mut engine = Engine::new(defaults::rule_set().map_err(|e| anyhow::anyhow!("{e:?}"))?);
        let mut keeper = Keeper::for_rebuild_window(persist, std::time::Duration::from_secs(48 * 3600))
            .with_rollup_period(o.rollup_period);
        let start = Instant::now();
        for chunk in events.chunks(o.batch.max(1)) {
            let mut batch = Batch::default();
            for e in chunk {
                let obs = gpumedic_classifier::observe::observation(e);
                let (_, bearing) = engine.observe_bearing(&obs);
                if keeper.keep(&obs, bearing) {
                    batch.events.push(e)?;
                }
            }
            for (k, r) in keeper.closed(gpumedic_classifier::persist::ROLLUPS_PER_BATCH) {
                batch.rollups.push(&k, &r);
            }
            store::write_batch(&pool, &batch).await?;
        }
        let events_per_sec = o.events as f64 / start.elapsed().as_secs_f64();
        sqlx::query("VACUUM ANALYZE health_events").execute(&pool).await?;
        sqlx::query("VACUUM ANALYZE telemetry_rollups").execute(&pool).await?;
        let (event_rows, rollup_rows, event_bytes, rollup_bytes): (i64, i64, i64, i64) = sqlx::query_as(
            "SELECT (SELECT count(*) FROM health_events), (SELECT count(*) FROM telemetry_rollups),
                    (SELECT coalesce(sum(pg_total_relation_size(inhrelid)), 0)::int8 FROM pg_inherits
                      WHERE inhparent = 'health_events'::regclass),
                    pg_total_relation_size('telemetry_rollups')",
        )
        .fetch_one(&pool)
        .await?;
        let per = |bytes: i64, rows: i64| if rows > 0 { bytes as f64 / rows as f64 } else { 0.0 };
        let p = Policy {
            persist: name,
            events_per_sec,
            event_rows,
            rollup_rows,
            event_row_bytes: per(event_bytes, event_rows),
            rollup_row_bytes: per(rollup_bytes, rollup_rows),
        };
        println!(
            "  --persist {name:<9} {events_per_sec:>9.0} events/s; {event_rows} event rows of {:.0} B, {rollup_rows} rollups of {:.0} B",
            p.event_row_bytes, p.rollup_row_bytes
        );
        policies.push(p);
        pool.close().await;
        sqlx::query(sqlx::AssertSqlSafe(format!("DROP DATABASE IF EXISTS \"{db}\""))).execute(&admin).await?;
    }
    Ok(PolicyResult {
        scenario: "persist-policies",
        events: o.events,
        nodes: o.nodes,
        rate_per_node: o.rate_per_node,
        rollup_period_s: o.rollup_period.as_secs(),
        policies,
    })
}

/// Options of `rollup-writes`.
#[derive(Debug, clap::Args)]
pub struct RollupOptions {
    /// How many events of the fleet's stream make the rollups.
    #[arg(long, default_value_t = 100_000)]
    events: usize,
    /// Rollups per statement (the rollup writer sends 1,000 to 20,000, as many as its batch had
    /// events).
    #[arg(long, default_value_t = 5000)]
    batch: usize,
    /// Nodes in the simulated fleet (8 GPUs each).
    #[arg(long, default_value_t = 1000)]
    nodes: usize,
    /// Events per node per second of event time (how many events share a GPU's rollup period).
    #[arg(long, default_value_t = 0.03)]
    rate_per_node: f64,
    /// The span of each rollup, as the classifier's `--rollup-period`.
    #[arg(long, default_value = gpumedic_classifier::persist::DEFAULT_ROLLUP_PERIOD, value_parser = crate::duration)]
    rollup_period: std::time::Duration,
}

/// One way of writing rollups, measured.
#[derive(Debug, serde::Serialize)]
pub struct RollupMethod {
    method: &'static str,
    /// Rollups per second on the first pass (all new) and the second (all merged into the rows of
    /// the first).
    new_per_sec: f64,
    merged_per_sec: f64,
    /// CPU of the method's PostgreSQL backend per rollup, µs, on each pass.
    new_backend_us: f64,
    merged_backend_us: f64,
}

/// The JSON result of `rollup-writes`.
#[derive(Debug, serde::Serialize)]
pub struct RollupResult {
    scenario: &'static str,
    rollups: usize,
    batch: usize,
    methods: Vec<RollupMethod>,
}

/// `rollup-writes`: the closed rollups of the fleet's stream (spread in event time at
/// `--rate-per-node` through the classifier's engine and keeper under `--persist evidence`)
/// written into PostgreSQL by each way the classifier can: `unnest`, its batch statement with the
/// rollups bound as arrays ([`store::write_batch`]), and `copy-staging`, binary `COPY` into a
/// temporary table, then `INSERT ... SELECT ... ON CONFLICT DO UPDATE` ([`store::copy_rollups`]).
/// Each method writes into a fresh database of its own on one connection, the methods taking turns
/// statement by statement, twice: new rows, then the same rollups again (every one merged into its
/// row). Prints the rate and the CPU the method's PostgreSQL backend spent per rollup (from
/// `/proc`, so the scenario must run on the database's machine), and checks that both methods
/// left the same table.
pub async fn run_rollups(o: RollupOptions) -> anyhow::Result<RollupResult> {
    use gpumedic_classifier::persist::{Keeper, Policy as Persist, RollupRows};
    use gpumedic_classifier::rules::{Engine, defaults};
    let admin = testkit::require_postgres().await?;
    let (base, spacing, _) = spread(o.nodes, o.events, o.rate_per_node);
    let mut engine = Engine::new(defaults::rule_set().map_err(|e| anyhow::anyhow!("{e:?}"))?);
    let mut keeper = Keeper::for_rebuild_window(Persist::Evidence, std::time::Duration::from_secs(48 * 3600))
        .with_rollup_period(o.rollup_period);
    let mut closed = Vec::new();
    for e in crate::fleet::Enriched::new(o.nodes, base, spacing)?.take(o.events) {
        let obs = gpumedic_classifier::observe::observation(&e);
        let (_, bearing) = engine.observe_bearing(&obs);
        keeper.keep(&obs, bearing);
        closed.extend(keeper.closed(usize::MAX));
    }
    closed.extend(keeper.drain());
    let batches: Vec<RollupRows> = closed
        .chunks(o.batch.max(1))
        .map(|chunk| {
            let mut rows = RollupRows::default();
            for (k, r) in chunk {
                rows.push(k, r);
            }
            rows
        })
        .collect();
    let rollups = closed.len();
    println!("rollup-writes: {rollups} rollups of {} events, {} per statement", o.events, o.batch);
    const METHODS: [&str; 2] = ["unnest", "copy-staging"];
    let mut pools = Vec::new();
    for method in METHODS {
        let db = testkit::unique_name(&format!("bench_rollups_{method}")).replace('-', "_");
        let url = testkit::fresh_database(&admin, &db).await?;
        let pool = gpumedic_classifier::connect_and_migrate(&url, 1).await?;
        let pid: i32 = sqlx::query_scalar("SELECT pg_backend_pid()").fetch_one(&pool).await?;
        let backend = crate::procs::Watched { pid: u32::try_from(pid)?, with_children: false };
        pools.push((db, pool, backend));
    }
    let mut seconds = [[0.0f64; METHODS.len()]; 2];
    let mut cpu = [[0.0f64; METHODS.len()]; 2];
    for pass in 0..2 {
        for rows in &batches {
            for (m, method) in METHODS.iter().enumerate() {
                let (_, pool, backend) = &pools[m];
                let before = backend.read().map(|r| r.cpu_seconds);
                let start = Instant::now();
                match *method {
                    "unnest" => {
                        store::write_batch(pool, &Batch { rollups: rows.clone(), ..Default::default() }).await?;
                    }
                    _ => {
                        store::copy_rollups(pool, rows).await?;
                    }
                }
                seconds[pass][m] += start.elapsed().as_secs_f64();
                let after = backend.read().map(|r| r.cpu_seconds);
                let (Some(before), Some(after)) = (before, after) else {
                    anyhow::bail!(
                        "{method}: cannot read its PostgreSQL backend's CPU from /proc (run on the database's machine)"
                    );
                };
                cpu[pass][m] += after - before;
            }
        }
    }
    // Both methods must leave the same table: every rollup twice, merged.
    let mut tables = Vec::new();
    for (_, pool, _) in &pools {
        let digest: (i64, i64, String) = sqlx::query_as(
            "SELECT count(*), coalesce(sum(events), 0)::int8,
                    coalesce(md5(string_agg(node || gpu_uuid || kind || minute || events || last_at || readings::text
                                            || counters::text, ',' ORDER BY node, gpu_uuid, kind, minute)), '')
               FROM telemetry_rollups",
        )
        .fetch_one(pool)
        .await?;
        tables.push(digest);
    }
    let folded: i64 = closed.iter().map(|(_, r)| i64::from(r.events)).sum();
    anyhow::ensure!(
        tables[0].1 == 2 * folded,
        "{} events in the rollups written twice, {} expected",
        tables[0].1,
        2 * folded
    );
    anyhow::ensure!(tables.windows(2).all(|w| w[0] == w[1]), "the methods left different tables: {tables:?}");
    let mut methods = Vec::new();
    for (m, method) in METHODS.iter().enumerate() {
        let rate = |s: f64| if s > 0.0 { rollups as f64 / s } else { 0.0 };
        let us = |s: f64| s * 1e6 / rollups.max(1) as f64;
        let r = RollupMethod {
            method,
            new_per_sec: rate(seconds[0][m]),
            merged_per_sec: rate(seconds[1][m]),
            new_backend_us: us(cpu[0][m]),
            merged_backend_us: us(cpu[1][m]),
        };
        println!(
            "  {method:<13} new {:>8.0}/s, backend {:>5.1} µs each; merged {:>8.0}/s, backend {:>5.1} µs each",
            r.new_per_sec, r.new_backend_us, r.merged_per_sec, r.merged_backend_us
        );
        methods.push(r);
    }
    for (db, pool, _) in pools {
        pool.close().await;
        sqlx::query(sqlx::AssertSqlSafe(format!("DROP DATABASE IF EXISTS \"{db}\""))).execute(&admin).await?;
    }
    Ok(RollupResult { scenario: "rollup-writes", rollups, batch: o.batch, methods })
}
