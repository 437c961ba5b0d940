//! PostgreSQL connection pools. The classifier is the only writer; other tools read.

use std::time::Duration;

use sqlx::PgPool;
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};

/// What went wrong connecting to PostgreSQL.
#[derive(Debug, thiserror::Error)]
pub enum PostgresError {
    /// The URL does not parse.
    #[error("the database URL is invalid: {0}")]
    Url(#[source] sqlx::Error),
    /// The server could not be reached or refused the login.
    #[error("cannot connect to PostgreSQL: {0}")]
    Connect(#[source] sqlx::Error),
}

/// A pool of at most `max_connections` to `url`.
pub async fn connect(url: &str, max_connections: u32) -> Result<PgPool, PostgresError> {
    connect_with_settings(url, max_connections, &[]).await
}

/// [`connect`], with server `settings` (such as `work_mem`) set on every connection at start.
pub async fn connect_with_settings(
    url: &str,
    max_connections: u32,
    settings: &[(&str, &str)],
) -> Result<PgPool, PostgresError> {
    let options: PgConnectOptions =
        url.parse::<PgConnectOptions>().map_err(PostgresError::Url)?.options(settings.iter().copied());
    PgPoolOptions::new()
        .max_connections(max_connections)
        .acquire_timeout(Duration::from_secs(10))
        .connect_with(options)
        .await
        .map_err(PostgresError::Connect)
}

/// Keeps `ready` true while the database answers, checking every `every` until `token` is
/// cancelled. Runs as one of a service's long tasks.
pub async fn watch_reachability(
    pool: PgPool,
    ready: crate::admin::ReadyFlag,
    every: Duration,
    token: tokio_util::sync::CancellationToken,
) -> Result<(), PostgresError> {
    loop {
        match sqlx::query("SELECT 1").execute(&pool).await {
            Ok(_) => ready.set(true),
            Err(e) => {
                ready.set(false);
                tracing::warn!(error = %e, "The database is not answering.");
            }
        }
        tokio::select! {
            () = token.cancelled() => return Ok(()),
            () = tokio::time::sleep(every) => {}
        }
    }
}
