//! Smoke test against the testbed's real PostgreSQL: the classifier's migrations run into a fresh
//! database made for the test, a row round-trips, and running the migrations again changes nothing.

use gpumedic_testkit as testkit;
use sqlx::Row as _;

#[tokio::test]
async fn migrations_apply_to_a_fresh_database_and_a_row_round_trips() {
    let admin = testkit::require_postgres().await.unwrap_or_else(|e| panic!("{e}"));
    let name = testkit::unique_name("test").replace('-', "_");
    let url = testkit::fresh_database(&admin, &name).await.expect("database created");

    let pool = gpumedic_classifier::connect_and_migrate(&url, 2).await.expect("migrations applied");
    let id = uuid::Uuid::now_v7();
    sqlx::query(
        "INSERT INTO health_events (event_id, node, observed_at, source, component, kind, xid, record)
         VALUES ($1, 'gpu-node-1', now(), 'kernel_log', 'gpu', 'xid', 79, $2)
         ON CONFLICT (event_id, observed_at) DO NOTHING",
    )
    .bind(id)
    .bind(serde_json::json!({ "message": "GPU has fallen off the bus" }))
    .execute(&pool)
    .await
    .expect("insert");
    let row = sqlx::query("SELECT node, xid, record->>'message' AS message FROM health_events WHERE event_id = $1")
        .bind(id)
        .fetch_one(&pool)
        .await
        .expect("read back");
    assert_eq!(row.get::<String, _>("node"), "gpu-node-1");
    assert_eq!(row.get::<i32, _>("xid"), 79);
    assert_eq!(row.get::<String, _>("message"), "GPU has fallen off the bus");

    // Migrations are recorded, so a restart does not re-run them.
    gpumedic_classifier::connect_and_migrate(&url, 1).await.expect("second run is a no-op");
    let applied: i64 = sqlx::query_scalar("SELECT count(*) FROM _sqlx_migrations").fetch_one(&pool).await.unwrap();
    assert_eq!(applied as usize, gpumedic_classifier::MIGRATOR.iter().count());

    pool.close().await;
    sqlx::query(sqlx::AssertSqlSafe(format!("DROP DATABASE \"{name}\""))).execute(&admin).await.expect("drop");
}
