//! Against the testbed's real PostgreSQL: every pooled connection has a statement and a lock
//! timeout (defaults, overridable by the caller and the URL), and readiness turns false when the
//! server stops answering.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use gpumedic_runtime::admin::Readiness;
use gpumedic_runtime::postgres;
use gpumedic_runtime::testbed;
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
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
    testbed::require_postgres().await.unwrap_or_else(|e| panic!("{e}"));
    let url = testbed::database_url();

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

/// A TCP proxy to `upstream` that stops passing bytes on while `frozen` is set, as a stopped or
/// black-holed server would: connections stay open and nothing answers.
async fn freezable_proxy(upstream: String, frozen: Arc<AtomicBool>) -> std::net::SocketAddr {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("address");
    tokio::spawn(async move {
        while let Ok((client, _)) = listener.accept().await {
            let Ok(server) = tokio::net::TcpStream::connect(&upstream).await else { continue };
            let (cr, cw) = client.into_split();
            let (sr, sw) = server.into_split();
            tokio::spawn(pipe(cr, sw, frozen.clone()));
            tokio::spawn(pipe(sr, cw, frozen.clone()));
        }
    });
    addr
}

async fn pipe(
    mut from: tokio::net::tcp::OwnedReadHalf,
    mut to: tokio::net::tcp::OwnedWriteHalf,
    frozen: Arc<AtomicBool>,
) {
    let mut buf = vec![0u8; 16 * 1024];
    loop {
        let n = match from.read(&mut buf).await {
            Ok(0) | Err(_) => return,
            Ok(n) => n,
        };
        while frozen.load(Ordering::Acquire) {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        if to.write_all(&buf[..n]).await.is_err() {
            return;
        }
    }
}

async fn wait_ready(flag: &gpumedic_runtime::admin::ReadyFlag, want: bool, timeout: Duration) {
    let deadline = Instant::now() + timeout;
    while flag.get() != want {
        assert!(Instant::now() < deadline, "readiness did not turn {want} within {timeout:?}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[tokio::test]
async fn readiness_turns_false_when_the_database_stops_answering() {
    testbed::require_postgres().await.unwrap_or_else(|e| panic!("{e}"));
    let url = testbed::database_url();
    // postgres://user:password@host:port/database: route host:port through the proxy.
    let at = url.rfind('@').expect("the testbed URL has credentials");
    let slash = at + url[at..].find('/').expect("the testbed URL names a database");
    let frozen = Arc::new(AtomicBool::new(false));
    let proxy = freezable_proxy(url[at + 1..slash].to_owned(), frozen.clone()).await;
    let proxied = format!("{}@{proxy}{}", &url[..at], &url[slash..]);

    let pool = postgres::connect(&proxied, 2).await.expect("pool through the proxy");
    let ready = Readiness::default().register("database");
    let token = CancellationToken::new();
    let watch =
        tokio::spawn(postgres::watch_reachability(pool, ready.clone(), Duration::from_millis(200), token.clone()));
    wait_ready(&ready, true, Duration::from_secs(10)).await;

    frozen.store(true, Ordering::Release);
    wait_ready(&ready, false, postgres::READINESS_TIMEOUT + Duration::from_secs(5)).await;

    frozen.store(false, Ordering::Release);
    wait_ready(&ready, true, Duration::from_secs(30)).await;
    token.cancel();
    watch.await.expect("joins").expect("stops cleanly");
}
