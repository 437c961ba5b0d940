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
