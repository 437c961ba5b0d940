//! Against the testbed's real PostgreSQL: a batch split by node into parts written at once lands
//! every event exactly once, and writing it again (a retried batch) adds nothing.

use gpumedic_classifier::store::{self, Batch};
use gpumedic_schemas::EnrichedHealthEvent;
use gpumedic_schemas::health::{Detail, Source, TemperatureDetail};
use gpumedic_testkit as testkit;

fn event(node: &str, celsius: i32) -> EnrichedHealthEvent {
    let detail =
        Detail::Temperature(TemperatureDetail { celsius, slowdown_celsius: Some(90), shutdown_celsius: Some(95) });
    testkit::event(node).detail(Source::Nvml, detail).healthy_flag(true).gpu(format!("GPU-{node}")).enriched().build()
}

#[tokio::test]
async fn parts_written_at_once_land_every_event_once_and_a_retry_adds_nothing() {
    let admin = testkit::require_postgres().await.unwrap_or_else(|e| panic!("{e}"));
    let name = testkit::unique_name("parts").replace('-', "_");
    let url = testkit::fresh_database(&admin, &name).await.expect("database created");
    let pool = gpumedic_classifier::connect_and_migrate(&url, 4).await.expect("migrations applied");

    // The classifier's connections carry the work_mem its batch statements need.
    let work_mem: String = sqlx::query_scalar("SHOW work_mem").fetch_one(&pool).await.unwrap();
    assert_eq!(work_mem, "64MB");

    let parts = 3;
    let mut batch = Batch::parts(parts, 600);
    let mut by_node: std::collections::HashMap<String, usize> = Default::default();
    for i in 0..600 {
        let node = format!("node-{}", i % 40);
        let part = store::part_of(&node, parts);
        assert_eq!(*by_node.entry(node.clone()).or_insert(part), part, "a node always goes to one part");
        batch[part].events.push(&event(&node, 50 + i % 30)).expect("row");
    }
    assert!(batch.iter().all(|b| !b.is_empty()), "40 nodes spread over every part");

    let written = store::write_parts(&pool, &batch).await.expect("written");
    assert_eq!(written.new_events, 600);
    let again = store::write_parts(&pool, &batch).await.expect("written again");
    assert_eq!(again.new_events, 0, "a retried batch adds nothing");
    let rows: i64 = sqlx::query_scalar("SELECT count(*) FROM health_events").fetch_one(&pool).await.unwrap();
    assert_eq!(rows, 600);
    let nodes: i64 =
        sqlx::query_scalar("SELECT count(DISTINCT node) FROM health_events").fetch_one(&pool).await.unwrap();
    assert_eq!(nodes, 40);

    pool.close().await;
    sqlx::query(sqlx::AssertSqlSafe(format!("DROP DATABASE \"{name}\""))).execute(&admin).await.expect("drop");
}

/// The look-up of already-recorded events finds exactly the recorded (event id, observed_at) pairs:
/// across two days' partitions, among ids never written, and not an id written at another time.
/// The table's statistics are gathered while it is empty first, as on a burst that the day's
/// statistics do not know yet (the plan that stalled for seconds was chosen in that state).
#[tokio::test]
async fn the_recorded_look_up_finds_exactly_the_written_pairs() {
    let admin = testkit::require_postgres().await.unwrap_or_else(|e| panic!("{e}"));
    let name = testkit::unique_name("recorded").replace('-', "_");
    let url = testkit::fresh_database(&admin, &name).await.expect("database created");
    let pool = gpumedic_classifier::connect_and_migrate(&url, 4).await.expect("migrations applied");
    sqlx::query("ANALYZE health_events").execute(&pool).await.expect("analysed while empty");

    let day = chrono::DateTime::parse_from_rfc3339("2026-12-02T23:59:00Z").unwrap().to_utc();
    let mut batch = Batch::default();
    let mut written = Vec::new();
    for i in 0..2_000i64 {
        let node = format!("node-{}", i % 50);
        // Half on each side of midnight: two days' partitions.
        let at = day + chrono::Duration::milliseconds(i * 60);
        let mut e = event(&node, 50);
        e.event.observed_at = at;
        batch.events.push(&e).expect("row");
        written.push((e.event.event_id, at));
    }
    assert_eq!(store::write_batch(&pool, &batch).await.expect("written").new_events, 2_000);

    let mut probe: Vec<_> = written.iter().step_by(2).copied().collect();
    let never: Vec<_> = (0..500).map(|i| (uuid::Uuid::new_v4(), day + chrono::Duration::seconds(i))).collect();
    probe.extend(&never);
    // A written id, asked for at another time, is another key: not recorded.
    let moved = (written[1].0, written[1].1 + chrono::Duration::milliseconds(1));
    probe.push(moved);
    let found = store::recorded(&pool, &probe).await.expect("looked up");
    let expected: std::collections::HashSet<_> = written.iter().step_by(2).copied().collect();
    assert_eq!(found.len(), 1_000);
    assert_eq!(found, expected, "exactly the written pairs asked for");
    assert!(store::recorded(&pool, &[]).await.expect("empty look-up").is_empty());

    pool.close().await;
    sqlx::query(sqlx::AssertSqlSafe(format!("DROP DATABASE \"{name}\""))).execute(&admin).await.expect("drop");
}

/// Closed rollups written by the rollup writer's `COPY` path and by the batch statement's arrays
/// land as the same rows, and written a second time (a retry after a lost commit, or another
/// replica's rollup of the same minute) both merge the same way: events add up, the minimum and
/// maximum hold, the later last value wins.
#[tokio::test]
async fn rollups_by_copy_and_by_the_batch_statement_land_and_merge_alike() {
    use gpumedic_classifier::persist::{Keeper, Policy, RollupRows};
    use gpumedic_classifier::rules::{Engine, defaults};
    let admin = testkit::require_postgres().await.unwrap_or_else(|e| panic!("{e}"));
    let minute = chrono::DateTime::parse_from_rfc3339("2026-12-03T10:00:00Z").unwrap().to_utc();
    // Two GPUs over two minutes, in rollups of two minutes; the first GPU reads 50, 61, 55, 52.
    let mut engine = Engine::new(defaults::rule_set().expect("default rules"));
    let mut keeper = Keeper::new(Policy::Evidence).with_rollup_period(std::time::Duration::from_secs(120));
    for (node, seconds, celsius) in
        [("a", 5, 50), ("a", 20, 61), ("a", 40, 55), ("b", 10, 70), ("a", 70, 52), ("b", 80, 71), ("b", 95, 69)]
    {
        let at = minute + chrono::TimeDelta::seconds(seconds);
        let e = testkit::event(node)
            .detail(
                Source::Nvml,
                Detail::Temperature(TemperatureDetail {
                    celsius,
                    slowdown_celsius: Some(90),
                    shutdown_celsius: Some(95),
                }),
            )
            .healthy_flag(true)
            .gpu(format!("GPU-{node}"))
            .at(at)
            .enriched()
            .build();
        let o = gpumedic_classifier::observe::observation(&e);
        let (_, bearing) = engine.observe_bearing(&o);
        // Every healthy event is folded into its rollup (the first of a GPU is also recorded).
        keeper.keep(&o, bearing);
    }
    let mut rows = RollupRows::default();
    for (k, r) in keeper.drain() {
        rows.push(&k, &r);
    }
    assert_eq!(rows.len(), 2, "two GPUs, one period each");

    /// A rollup row as text: node, GPU, kind, minute, period (seconds), events, readings, counters.
    type Row = (String, String, String, chrono::DateTime<chrono::Utc>, f64, i32, String, String);
    let mut tables = Vec::new();
    for method in ["copy", "arrays"] {
        let name = testkit::unique_name(&format!("rollups-{method}")).replace('-', "_");
        let url = testkit::fresh_database(&admin, &name).await.expect("database created");
        let pool = gpumedic_classifier::connect_and_migrate(&url, 2).await.expect("migrations applied");
        for _ in 0..2 {
            match method {
                "copy" => assert_eq!(store::copy_rollups(&pool, &rows).await.expect("copied"), 2),
                _ => {
                    store::write_batch(&pool, &Batch { rollups: rows.clone(), ..Default::default() })
                        .await
                        .expect("written");
                }
            }
        }
        let (events, min, max, last, end): (i32, f64, f64, f64, chrono::DateTime<chrono::Utc>) = sqlx::query_as(
            "SELECT events, (readings -> 'value' ->> 'min')::float8, (readings -> 'value' ->> 'max')::float8,
                    (readings -> 'value' ->> 'last')::float8, minute + period
               FROM telemetry_rollups WHERE node = 'a' AND minute = $1",
        )
        .bind(minute)
        .fetch_one(&pool)
        .await
        .expect("node a's period");
        assert_eq!((events, min, max, last), (8, 50.0, 61.0, 52.0), "{method}: four events written twice, merged");
        assert_eq!(end, minute + chrono::TimeDelta::minutes(2), "{method}: the row says its period");
        let table: Vec<Row> = sqlx::query_as(
            "SELECT node, gpu_uuid, kind, minute, extract(epoch FROM period)::float8, events, readings::text,
                    counters::text
               FROM telemetry_rollups ORDER BY node, gpu_uuid, kind, minute",
        )
        .fetch_all(&pool)
        .await
        .expect("rollups");
        tables.push(table);
        pool.close().await;
        sqlx::query(sqlx::AssertSqlSafe(format!("DROP DATABASE \"{name}\""))).execute(&admin).await.expect("drop");
    }
    assert_eq!(tables[0].len(), 2);
    assert_eq!(tables[0], tables[1], "COPY and the batch statement leave the same rows");
}

/// The same rollup twice in one write is refused by PostgreSQL ("ON CONFLICT DO UPDATE command
/// cannot affect row a second time"), an error no retry mends, so the rollup writer must not
/// retry it (it did, until the classifier stopped, while every later rollup waited); the keeper
/// hands each key out once (persist's unit tests), and a row written apart merges.
#[tokio::test]
async fn a_key_twice_in_one_rollup_write_is_refused_and_not_worth_a_retry() {
    use gpumedic_classifier::persist::{Rollup, RollupRows};
    let admin = testkit::require_postgres().await.unwrap_or_else(|e| panic!("{e}"));
    let name = testkit::unique_name("rollups-twice").replace('-', "_");
    let url = testkit::fresh_database(&admin, &name).await.expect("database created");
    let pool = gpumedic_classifier::connect_and_migrate(&url, 1).await.expect("migrations applied");
    let key = ("n1".to_owned(), "GPU-a".to_owned(), "heartbeat".to_owned(), 1_764_756_000_000_000);
    let rollup = Rollup { period: 600_000_000, events: 3, last_at: key.3 + 5_000_000, ..Rollup::default() };
    let mut twice = RollupRows::default();
    twice.push(&key, &rollup);
    twice.push(&key, &rollup);
    let refused = store::copy_rollups(&pool, &twice).await.expect_err("a row updated twice in one statement");
    assert!(!gpumedic_classifier::rollups::retryable(&refused), "not worth a retry: {refused}");
    let mut once = RollupRows::default();
    once.push(&key, &rollup);
    assert_eq!(store::copy_rollups(&pool, &once).await.expect("written"), 1);
    assert_eq!(store::copy_rollups(&pool, &once).await.expect("merged"), 1);
    let events: i32 = sqlx::query_scalar("SELECT events FROM telemetry_rollups").fetch_one(&pool).await.unwrap();
    assert_eq!(events, 6, "written apart, the two merge");
    pool.close().await;
    sqlx::query(sqlx::AssertSqlSafe(format!("DROP DATABASE \"{name}\""))).execute(&admin).await.expect("drop");
}

/// A recorded event's `record` leaves out its null fields, `->>` still reads what is set, and a
/// rebuild reads every such record back: an event of each of two kinds, replayed, none skipped.
#[tokio::test]
async fn a_recorded_event_is_stored_without_nulls_and_rebuilt_from() {
    let admin = testkit::require_postgres().await.unwrap_or_else(|e| panic!("{e}"));
    let name = testkit::unique_name("nonulls").replace('-', "_");
    let url = testkit::fresh_database(&admin, &name).await.expect("database created");
    let pool = gpumedic_classifier::connect_and_migrate(&url, 4).await.expect("migrations applied");

    let now = chrono::Utc::now();
    let mut hot = event("node-a", 97);
    hot.event.healthy = false;
    hot.event.observed_at = now - chrono::Duration::seconds(2);
    let mut xid = testkit::event("node-a").xid(79).enriched().build();
    xid.event.observed_at = now - chrono::Duration::seconds(1);
    let mut batch = Batch::default();
    batch.events.push(&hot).expect("row");
    batch.events.push(&xid).expect("row");
    assert_eq!(store::write_batch(&pool, &batch).await.expect("written").new_events, 2);

    let rows: Vec<(String, Option<String>, Option<String>)> = sqlx::query_as(
        "SELECT record::text, record->'event'->'detail'->'temperature'->>'celsius',
                record->'event'->'detail'->'xid'->>'code'
           FROM health_events ORDER BY observed_at",
    )
    .fetch_all(&pool)
    .await
    .unwrap();
    assert_eq!(rows.len(), 2);
    for (text, ..) in &rows {
        assert!(!text.contains(":null"), "a null field was stored: {text}");
    }
    assert_eq!((rows[0].1.as_deref(), rows[0].2.as_deref()), (Some("97"), None));
    assert_eq!((rows[1].1.as_deref(), rows[1].2.as_deref()), (None, Some("79")));
    let read: EnrichedHealthEvent = serde_json::from_str(&rows[0].0).expect("reads back");
    // As the event reads back from JSON with its nulls (which keeps microseconds, as Avro does).
    let as_before: EnrichedHealthEvent = serde_json::from_str(&serde_json::to_string(&hot).unwrap()).unwrap();
    assert_eq!(read, as_before);

    let rules = gpumedic_classifier::rules::defaults::rule_set().expect("the default rules load");
    let mut keeper = gpumedic_classifier::persist::Keeper::new(gpumedic_classifier::persist::Policy::Evidence);
    let since = now - chrono::Duration::hours(1);
    let (rebuilt, replayed) =
        store::rebuild(&pool, rules, since, &["node-a".to_owned()], &mut keeper).await.expect("rebuilt");
    assert_eq!(replayed, 2, "every stored record read back");
    assert!(!rebuilt.open_incidents().is_empty(), "the Xid 79's incident is open again after the rebuild");

    pool.close().await;
    sqlx::query(sqlx::AssertSqlSafe(format!("DROP DATABASE \"{name}\""))).execute(&admin).await.expect("drop");
}
