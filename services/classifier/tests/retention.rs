//! The event retention job against the real PostgreSQL: the migration leaves daily partitions
//! from today on; the job creates the days ahead (moving early rows out of the default
//! partition), drops whole days past the retention, deletes expired rows from the default
//! partition, and a second run has nothing to do.

use chrono::{Days, Utc};
use gpumedic_classifier::retention::{self, DAYS_AHEAD, partition_name};
use gpumedic_testkit as testkit;
use std::time::Duration;
use uuid::Uuid;

async fn insert(pool: &sqlx::PgPool, at: chrono::DateTime<Utc>) -> Uuid {
    let id = Uuid::now_v7();
    sqlx::query(
        "INSERT INTO health_events (event_id, node, observed_at, source, component, kind, record)
         VALUES ($1, 'node-1', $2, 'nvml', 'gpu', 'monitor_health', '{}')",
    )
    .bind(id)
    .bind(at)
    .execute(pool)
    .await
    .expect("insert");
    id
}

async fn partition_of(pool: &sqlx::PgPool, id: Uuid) -> Option<String> {
    sqlx::query_scalar("SELECT tableoid::regclass::text FROM health_events WHERE event_id = $1")
        .bind(id)
        .fetch_optional(pool)
        .await
        .expect("query")
}

#[tokio::test]
async fn partitions_are_created_ahead_and_expired_days_dropped() {
    let admin = testkit::require_postgres().await.unwrap_or_else(|e| panic!("{e}"));
    let db = testkit::unique_name("retention").replace('-', "_");
    let url = testkit::fresh_database(&admin, &db).await.expect("database");
    let pool = gpumedic_classifier::connect_and_migrate(&url, 2).await.expect("migrated");
    let now = Utc::now();
    let today = now.date_naive();

    let recent = insert(&pool, now).await;
    assert_eq!(partition_of(&pool, recent).await, Some(partition_name(today)));
    // An old day with its own partition, an older event with none, an event from the future.
    let old_day = today - Days::new(35);
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "CREATE TABLE {} PARTITION OF health_events FOR VALUES FROM ('{old_day} 00:00:00+00') TO ('{} 00:00:00+00')",
        partition_name(old_day),
        old_day + Days::new(1)
    )))
    .execute(&pool)
    .await
    .expect("old partition");
    let in_old_partition = insert(&pool, now - chrono::Duration::days(35)).await;
    let in_default = insert(&pool, now - chrono::Duration::days(40)).await;
    let early = insert(&pool, now + chrono::Duration::days(i64::from(DAYS_AHEAD) + 2)).await;
    assert_eq!(partition_of(&pool, in_default).await.as_deref(), Some("health_events_default"));
    assert_eq!(partition_of(&pool, early).await.as_deref(), Some("health_events_default"));

    // Two days later: two more days ahead, the early event moved into its day, the old day
    // dropped, the old event deleted from the default partition; the recent one kept.
    let later = now + chrono::Duration::days(2);
    let report = retention::maintain(&pool, Duration::from_secs(30 * 86_400), later).await.expect("maintained");
    let ahead = |n: u64| today + Days::new(n);
    assert_eq!(report.created, vec![ahead(u64::from(DAYS_AHEAD) + 1), ahead(u64::from(DAYS_AHEAD) + 2)]);
    assert_eq!(report.dropped, vec![old_day]);
    assert_eq!(report.default_rows_deleted, 1);
    assert_eq!(partition_of(&pool, early).await, Some(partition_name(ahead(u64::from(DAYS_AHEAD) + 2))));
    assert_eq!(partition_of(&pool, in_old_partition).await, None);
    assert_eq!(partition_of(&pool, in_default).await, None);
    assert_eq!(partition_of(&pool, recent).await, Some(partition_name(today)));

    let again = retention::maintain(&pool, Duration::from_secs(30 * 86_400), later).await.expect("maintained");
    assert_eq!(again, retention::Report::default(), "a second run has nothing to do");

    pool.close().await;
    sqlx::query(sqlx::AssertSqlSafe(format!("DROP DATABASE \"{db}\" WITH (FORCE)"))).execute(&admin).await.ok();
}

#[tokio::test]
async fn telemetry_rollups_expire_with_the_events() {
    let admin = testkit::require_postgres().await.unwrap_or_else(|e| panic!("{e}"));
    let db = testkit::unique_name("retention-rollups").replace('-', "_");
    let url = testkit::fresh_database(&admin, &db).await.expect("database");
    let pool = gpumedic_classifier::connect_and_migrate(&url, 2).await.expect("migrated");
    let now = Utc::now();
    for days in [0, 31] {
        sqlx::query(
            "INSERT INTO telemetry_rollups (node, gpu_uuid, kind, minute, events, last_at)
             VALUES ('node-1', 'GPU-a', 'temperature', date_trunc('minute', $1::timestamptz), 1, $1)",
        )
        .bind(now - chrono::Duration::days(days))
        .execute(&pool)
        .await
        .expect("rollup");
    }
    let report = retention::maintain(&pool, Duration::from_secs(30 * 86_400), now).await.expect("maintained");
    assert_eq!(report.rollups_deleted, 1);
    let left: i64 = sqlx::query_scalar("SELECT count(*) FROM telemetry_rollups").fetch_one(&pool).await.expect("count");
    assert_eq!(left, 1, "the recent minute stays");

    pool.close().await;
    sqlx::query(sqlx::AssertSqlSafe(format!("DROP DATABASE \"{db}\" WITH (FORCE)"))).execute(&admin).await.ok();
}
