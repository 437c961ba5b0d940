//! Against the testbed's real PostgreSQL: every pooled connection has a statement and a lock
//! timeout (defaults, overridable by the caller and the URL), and readiness turns false when the
//! server stops answering.

use std::time::Duration;

use gpumedic_runtime::admin::Readiness;
use gpumedic_runtime::postgres;
use gpumedic_testkit as testkit;
use tokio_util::sync::CancellationToken;

async fn show(pool: &sqlx::PgPool, setting: &str) -> String {
    sqlx::query_scalar(sqlx::AssertSqlSafe(format!("SHOW {setting}"))).fetch_one(pool).await.expect("SHOW answers")
}

/// Whether `SELECT pg_sleep(3)` is cancelled by the statement timeout (SQLSTATE 57014).
async fn sleep_is_cancelled(pool: &sqlx::PgPool) -> bool {
    match sqlx::query("SELECT pg_sleep(3)").execute(pool).await {
        Ok(_) => false,
        Err(sqlx::Error::Database(e)) => e.code().as_deref() == Some("57014"),
        Err(e) => panic!("unexpected error: {e}"),
    }
}

#[tokio::test]
async fn every_connection_has_a_statement_and_a_lock_timeout() {
    testkit::require_postgres().await.unwrap_or_else(|e| panic!("{e}"));
    let url = testkit::database_url();

    let pool = postgres::connect(&url, 1).await.expect("pool");
    assert_eq!(show(&pool, "statement_timeout").await, postgres::DEFAULT_STATEMENT_TIMEOUT);
    assert_eq!(show(&pool, "lock_timeout").await, postgres::DEFAULT_LOCK_TIMEOUT);

    // A service's own setting wins over the default.
    let pool = postgres::connect_with_settings(&url, 1, &[("statement_timeout", "1s")]).await.expect("pool");
    assert_eq!(show(&pool, "statement_timeout").await, "1s");
    assert!(sleep_is_cancelled(&pool).await, "a query longer than the timeout is cancelled");

    // So does the operator's, in the URL.
    let sep = if url.contains('?') { '&' } else { '?' };
    let pool = postgres::connect(&format!("{url}{sep}options[statement_timeout]=1500ms"), 1).await.expect("pool");
    assert_eq!(show(&pool, "statement_timeout").await, "1500ms");
    assert_eq!(show(&pool, "lock_timeout").await, postgres::DEFAULT_LOCK_TIMEOUT);
    assert!(sleep_is_cancelled(&pool).await, "a query longer than the URL's timeout is cancelled");
}

async fn wait_ready(flag: &gpumedic_runtime::admin::ReadyFlag, want: bool, timeout: Duration) {
    let what = format!("readiness to turn {want}");
    gpumedic_testkit::eventually(&what, timeout, async || (flag.get() == want).then_some(())).await;
}

#[tokio::test]
async fn readiness_turns_false_when_the_database_stops_answering() {
    testkit::require_postgres().await.unwrap_or_else(|e| panic!("{e}"));
    let url = testkit::database_url();
    // postgres://user:password@host:port/database: route host:port through the proxy.
    let at = url.rfind('@').expect("the testbed URL has credentials");
    let slash = at + url[at..].find('/').expect("the testbed URL names a database");
    let relay = testkit::Relay::start(&url[at + 1..slash]).await.expect("the relay starts");
    let proxied = format!("{}@{}{}", &url[..at], relay.addr(), &url[slash..]);

    let pool = postgres::connect(&proxied, 2).await.expect("pool through the proxy");
    let ready = Readiness::default().register("database");
    let token = CancellationToken::new();
    let watch =
        tokio::spawn(postgres::watch_reachability(pool, ready.clone(), Duration::from_millis(200), token.clone()));
    wait_ready(&ready, true, Duration::from_secs(10)).await;

    relay.hold(true);
    wait_ready(&ready, false, postgres::READINESS_TIMEOUT + Duration::from_secs(5)).await;

    relay.hold(false);
    wait_ready(&ready, true, Duration::from_secs(30)).await;
    token.cancel();
    watch.await.expect("joins").expect("stops cleanly");
}
