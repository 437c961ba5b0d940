//! The incident history views (migration 0003, documented in docs/incident-history.md) against
//! the real PostgreSQL: a fresh database seeded with a small, realistic history, and each view
//! asked what an operator would ask.

use gpumedic_testkit as testkit;
use uuid::Uuid;

/// rule, resolved, open, and mean, median and max minutes to resolve.
type MttrRow = (String, i64, i64, Option<f64>, Option<f64>, Option<f64>);

struct Seed<'a> {
    pool: &'a sqlx::PgPool,
}

impl Seed<'_> {
    /// An incident opened `days_ago` days ago, resolved `hours` later (or still open).
    async fn incident(&self, node: &str, rule: &str, severity: &str, days_ago: i32, hours: Option<i32>) -> Uuid {
        let id = Uuid::new_v4();
        sqlx::query(
            "INSERT INTO incidents (incident_id, node, rule_id, severity, opened_at, resolved_at, summary)
             VALUES ($1, $2, $3, $4, now() - make_interval(days => $5),
                     now() - make_interval(days => $5) + make_interval(hours => $6), $3)",
        )
        .bind(id)
        .bind(node)
        .bind(rule)
        .bind(severity)
        .bind(days_ago)
        .bind(hours)
        .execute(self.pool)
        .await
        .expect("incident");
        id
    }

    /// A verdict of `incident`, issued `minutes` after it opened.
    async fn verdict(&self, incident: Uuid, action: &str, recovery: bool, minutes: i32) -> Uuid {
        let id = Uuid::new_v4();
        sqlx::query(
            "INSERT INTO verdicts (verdict_id, incident_id, node, severity, rule_id, rule_version, action, reason,
                                   recovery, issued_at)
             SELECT $1, incident_id, node, severity, rule_id, 1, $2, summary, $3,
                    opened_at + make_interval(mins => $4)
               FROM incidents WHERE incident_id = $5",
        )
        .bind(id)
        .bind(action)
        .bind(recovery)
        .bind(minutes)
        .bind(incident)
        .execute(self.pool)
        .await
        .expect("verdict");
        id
    }

    /// What the remediator did about `verdict`, `minutes` after it was issued.
    async fn action(&self, verdict: Uuid, action: &str, status: &str, minutes: i32) {
        sqlx::query(
            "INSERT INTO actions (verdict_id, action, status, detail, at)
             SELECT verdict_id, $2, $3, 'seeded', issued_at + make_interval(mins => $4) FROM verdicts
              WHERE verdict_id = $1",
        )
        .bind(verdict)
        .bind(action)
        .bind(status)
        .bind(minutes)
        .execute(self.pool)
        .await
        .expect("action");
    }
}

#[tokio::test]
async fn each_view_answers_its_question() {
    let admin = testkit::require_postgres().await.unwrap_or_else(|e| panic!("{e}"));
    let db = testkit::unique_name("views").replace('-', "_");
    let url = testkit::fresh_database(&admin, &db).await.expect("database");
    let pool = gpumedic_classifier::connect_and_migrate(&url, 2).await.expect("migrated");
    let seed = Seed { pool: &pool };

    // node-a: Xid 79 twice in the month (rebooted the first time); node-b: an open ECC warning;
    // node-c: an Xid 79 forty days ago, outside the 30-day views but inside time to resolve.
    let a1 = seed.incident("node-a", "xid-79", "critical", 10, Some(2)).await;
    let a1_open = seed.verdict(a1, "reboot_node", false, 0).await;
    let a1_clear = seed.verdict(a1, "none", true, 120).await;
    seed.action(a1_open, "cordon", "succeeded", 1).await;
    seed.action(a1_open, "drain", "succeeded", 5).await;
    let a2 = seed.incident("node-a", "xid-79", "critical", 3, Some(4)).await;
    seed.verdict(a2, "reboot_node", false, 0).await;
    let b1 = seed.incident("node-b", "ecc-dbe", "warning", 1, None).await;
    seed.verdict(b1, "monitor", false, 0).await;
    seed.incident("node-c", "xid-79", "critical", 40, Some(1)).await;

    // incident_history: one row per incident with time to resolve and the last action.
    let (verdicts, hours, open, last, status): (i64, Option<f64>, bool, Option<String>, Option<String>) =
        sqlx::query_as(
            "SELECT verdicts, extract(epoch FROM time_to_resolve)::float8 / 3600, open, last_action, last_action_status
               FROM incident_history WHERE incident_id = $1",
        )
        .bind(a1)
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!((verdicts, hours, open), (2, Some(2.0), false));
    assert_eq!((last.as_deref(), status.as_deref()), (Some("drain"), Some("succeeded")));
    let (open, last, ttr): (bool, Option<String>, Option<f64>) = sqlx::query_as(
        "SELECT open, last_action, extract(epoch FROM time_to_resolve)::float8 FROM incident_history
          WHERE incident_id = $1",
    )
    .bind(b1)
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!((open, last, ttr), (true, None, None));
    assert_eq!(
        sqlx::query_scalar::<_, i64>("SELECT count(*) FROM incident_history").fetch_one(&pool).await.unwrap(),
        4
    );

    // incidents_per_node_30d: node-c's old incident is outside the window.
    let per_node: Vec<(String, i64, i64, i64, i64)> =
        sqlx::query_as("SELECT node, incidents, critical, warning, open FROM incidents_per_node_30d ORDER BY node")
            .fetch_all(&pool)
            .await
            .unwrap();
    assert_eq!(per_node, vec![("node-a".into(), 2, 2, 0, 0), ("node-b".into(), 1, 0, 1, 1)]);

    // mttr_by_fault_kind: Xid 79 resolved in 2h, 4h and 1h; the ECC warning is still open.
    let mttr: Vec<MttrRow> = sqlx::query_as(
        "SELECT rule_id, resolved, open, extract(epoch FROM mean_time_to_resolve)::float8 / 60,
                extract(epoch FROM median_time_to_resolve)::float8 / 60,
                extract(epoch FROM max_time_to_resolve)::float8 / 60
           FROM mttr_by_fault_kind ORDER BY rule_id",
    )
    .fetch_all(&pool)
    .await
    .unwrap();
    assert_eq!(
        mttr,
        vec![
            ("ecc-dbe".into(), 0, 1, None, None, None),
            ("xid-79".into(), 3, 0, Some(140.0), Some(120.0), Some(240.0)),
        ]
    );

    // repeat_fault_nodes: only node-a had the same fault twice within 30 days.
    let repeats: Vec<(String, String, i64)> =
        sqlx::query_as("SELECT node, rule_id, incidents FROM repeat_fault_nodes").fetch_all(&pool).await.unwrap();
    assert_eq!(repeats, vec![("node-a".into(), "xid-79".into(), 2)]);

    // incident_actions: what was done for a1, verdict by verdict.
    let done: Vec<(Uuid, String, Option<String>, Option<String>)> = sqlx::query_as(
        "SELECT verdict_id, recommended_action, action, status FROM incident_actions
          WHERE incident_id = $1 ORDER BY issued_at, at",
    )
    .bind(a1)
    .fetch_all(&pool)
    .await
    .unwrap();
    assert_eq!(
        done,
        vec![
            (a1_open, "reboot_node".into(), Some("cordon".into()), Some("succeeded".into())),
            (a1_open, "reboot_node".into(), Some("drain".into()), Some("succeeded".into())),
            (a1_clear, "none".into(), None, None),
        ]
    );

    pool.close().await;
    sqlx::query(sqlx::AssertSqlSafe(format!("DROP DATABASE \"{db}\" WITH (FORCE)"))).execute(&admin).await.ok();
}
