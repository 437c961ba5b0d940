//! Against the testbed's real PostgreSQL: a rebuild replays the NVLink domain decisions made live.
//! A peer's Xid 145 that joined a root incident on another node of its domain joins it again when
//! the peer's node is rebuilt (no incident of its own appears from the replay); one that arrived
//! before its root was recorded opened its own incident live, and keeps it on replay, though the
//! root is in the incident store by then.

use chrono::{DateTime, Utc};
use gpumedic_classifier::nvlink::Roots;
use gpumedic_classifier::observe;
use gpumedic_classifier::rules::{Decision, Engine, defaults};
use gpumedic_classifier::store::{self, Batch, DecisionRows};
use gpumedic_schemas::EnrichedHealthEvent;
use gpumedic_schemas::health::GpuIdentity;
use gpumedic_testkit as testkit;

const DOMAIN: &str = "5e1f0000-0000-4000-8000-000000000001.3";

fn xid(node: &str, code: i32, at: DateTime<Utc>) -> EnrichedHealthEvent {
    let gpu = format!("GPU-{node}-0");
    let identity =
        GpuIdentity { uuid: Some(gpu.clone()), nvlink_domain: Some(DOMAIN.into()), ..GpuIdentity::default() };
    testkit::event(node).xid(code).gpu(gpu).boot("boot-1").at(at).enriched().gpu(identity).build()
}

/// What one batch of the live classifier does with `events`, written as it writes them.
async fn live(pool: &sqlx::PgPool, engine: &mut Engine, events: &[EnrichedHealthEvent]) -> Vec<Decision> {
    let mut roots = Roots::new(engine.rules());
    let observations: Vec<_> = events.iter().map(observe::observation).collect();
    roots.load(pool, &observations).await.expect("roots loaded");
    let mut batch = Batch::default();
    let mut decisions = Vec::new();
    for (e, o) in events.iter().zip(&observations) {
        batch.events.push(e).expect("row");
        let made = engine.observe(&roots.attach(o));
        roots.learn(&made);
        decisions.extend(made);
    }
    for a in engine.take_absorbed() {
        batch.sympathetic.push(&a);
    }
    let published: Vec<_> = decisions.iter().map(|d| (d.clone(), observe::verdict(d), String::new())).collect();
    batch.decisions = DecisionRows::new(&published);
    store::write_batch(pool, &batch).await.expect("written");
    decisions
}

#[tokio::test]
async fn a_rebuild_makes_the_domain_decisions_that_were_made_live() {
    let admin = testkit::require_postgres().await.unwrap_or_else(|e| panic!("{e}"));
    let name = testkit::unique_name("nvrebuild").replace('-', "_");
    let url = testkit::fresh_database(&admin, &name).await.expect("database created");
    let pool = gpumedic_classifier::connect_and_migrate(&url, 2).await.expect("migrations applied");
    let rules = defaults::rule_set().expect("the default rules load");
    let t0 = DateTime::from_timestamp_micros(Utc::now().timestamp_micros()).unwrap();
    let s = |n: i64| t0 + chrono::Duration::seconds(n);

    let mut engine = Engine::new(rules.clone());
    // Node early's peer error arrives before the root is recorded: its own incident, live.
    let early = live(&pool, &mut engine, &[xid("early", 145, s(1))]).await;
    assert_eq!(early.len(), 1, "{early:#?}");
    // The root on node root, then node late's peer error: absorbed, live.
    let root = live(&pool, &mut engine, &[xid("root", 149, s(0))]).await;
    assert_eq!(root[0].nvlink_domain.as_deref(), Some(DOMAIN));
    assert!(live(&pool, &mut engine, &[xid("late", 145, s(2))]).await.is_empty());
    let recorded: Vec<(String, uuid::Uuid)> =
        sqlx::query_as("SELECT node, incident_id FROM sympathetic_evidence").fetch_all(&pool).await.unwrap();
    assert_eq!(recorded, [("late".to_owned(), root[0].incident_id)]);

    // Rebuilt from the store, as a replica that gains the peers' partitions does.
    let since = s(-3600);
    let mut keeper = gpumedic_classifier::persist::Keeper::new(gpumedic_classifier::persist::Policy::Evidence);
    let (rebuilt, replayed) =
        store::rebuild(&pool, rules, since, &["early".to_owned(), "late".to_owned()], &mut keeper)
            .await
            .expect("rebuilt");
    assert_eq!(replayed, 2);
    let open: Vec<String> = rebuilt.open_incidents().into_iter().map(|i| i.node).collect();
    assert_eq!(open, ["early"], "what was decided live, and nothing else");

    pool.close().await;
    sqlx::query(sqlx::AssertSqlSafe(format!("DROP DATABASE \"{name}\""))).execute(&admin).await.expect("drop");
}
