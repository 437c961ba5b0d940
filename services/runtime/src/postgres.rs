//! PostgreSQL connection pools. The classifier is the only writer; other tools read.
//!
//! Every pooled connection gets a `statement_timeout` and a `lock_timeout`
//! ([`DEFAULT_STATEMENT_TIMEOUT`], [`DEFAULT_LOCK_TIMEOUT`]), so a query stuck behind a lock or
//! on an overloaded server fails and is retried instead of holding its partition for ever. A
//! service changes them with its own settings, an operator in the database URL
//! (`?options[statement_timeout]=60s`). Migrations run on a connection of their own with
//! [`MIGRATION_STATEMENT_TIMEOUT`]. The readiness check gives up on a query after
//! [`READINESS_TIMEOUT`], so a server that stops answering (a SIGSTOPped or black-holed
//! Postgres, where no server-side timeout fires) turns readiness false.

use std::time::Duration;

use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::{ConnectOptions as _, Connection as _, PgPool};

use crate::config::Problems;

/// What went wrong connecting to PostgreSQL.
#[derive(Debug, thiserror::Error)]
pub enum PostgresError {
    /// The URL does not parse.
    #[error("the database URL is invalid: {0}")]
    Url(#[source] sqlx::Error),
    /// The server could not be reached or refused the login.
    #[error("cannot connect to PostgreSQL: {0}")]
    Connect(#[source] sqlx::Error),
    /// The schema could not be brought up to date.
    #[error("cannot migrate the database: {0}")]
    Migrate(#[source] sqlx::migrate::MigrateError),
}

/// The `statement_timeout` of every pooled connection unless the URL or the caller sets one.
pub const DEFAULT_STATEMENT_TIMEOUT: &str = "30s";
/// The `lock_timeout` of every pooled connection unless the URL or the caller sets one.
pub const DEFAULT_LOCK_TIMEOUT: &str = "10s";
/// The `statement_timeout` of the connection migrations run on: a migration may rewrite a
/// large table.
pub const MIGRATION_STATEMENT_TIMEOUT: &str = "30min";
/// How long the readiness check waits for `SELECT 1`.
pub const READINESS_TIMEOUT: Duration = Duration::from_secs(3);

/// Checks the flags of a service's database: `--database-url`, a PostgreSQL URL
/// ([`check_url`]), and `--database-pool`, the pool's size ([`check_pool`]). Each problem is
/// listed in `problems`.
pub fn check_database_flags(problems: &mut Problems, url: &str, pool: u32) {
    check_url(problems, "--database-url", url);
    check_pool(problems, "--database-pool", pool);
}

/// Checks that the `flag`'s value `url` is a PostgreSQL URL (`postgres://` or `postgresql://`);
/// what else is wrong with it shows when the pool connects.
pub fn check_url(problems: &mut Problems, flag: &str, url: &str) {
    if !(url.starts_with("postgres://") || url.starts_with("postgresql://")) {
        problems.push(flag, "must be a postgres:// URL");
    }
}

/// Checks that the `flag`'s value `size`, the connections of a pool, is at least one.
pub fn check_pool(problems: &mut Problems, flag: &str, size: u32) {
    if size == 0 {
        problems.push(flag, "must be at least 1");
    }
}

/// A pool of at most `max_connections` to `url`.
pub async fn connect(url: &str, max_connections: u32) -> Result<PgPool, PostgresError> {
    connect_with_settings(url, max_connections, &[]).await
}

/// [`connect`], with server `settings` (such as `work_mem`) set on every connection at start.
/// `statement_timeout` and `lock_timeout` get their defaults unless `settings` or the URL's
/// `options` name them.
pub async fn connect_with_settings(
    url: &str,
    max_connections: u32,
    settings: &[(&str, &str)],
) -> Result<PgPool, PostgresError> {
    let options: PgConnectOptions = url.parse::<PgConnectOptions>().map_err(PostgresError::Url)?;
    let named =
        |key: &str| options.get_options().is_some_and(|o| o.contains(key)) || settings.iter().any(|(k, _)| *k == key);
    let defaults: Vec<(&str, &str)> =
        [("statement_timeout", DEFAULT_STATEMENT_TIMEOUT), ("lock_timeout", DEFAULT_LOCK_TIMEOUT)]
            .into_iter()
            .filter(|(k, _)| !named(k))
            .collect();
    let options = options.options(defaults).options(settings.iter().copied());
    PgPoolOptions::new()
        .max_connections(max_connections)
        .acquire_timeout(Duration::from_secs(10))
        .connect_with(options)
        .await
        .map_err(PostgresError::Connect)
}

/// Runs `migrator` on a connection of its own, made like the pool's but with
/// [`MIGRATION_STATEMENT_TIMEOUT`], so a long migration is not cut by the pool's timeout and the
/// pool's connections keep theirs.
pub async fn migrate(pool: &PgPool, migrator: &sqlx::migrate::Migrator) -> Result<(), PostgresError> {
    let options = (*pool.connect_options())
        .clone()
        .options([("statement_timeout", MIGRATION_STATEMENT_TIMEOUT), ("lock_timeout", MIGRATION_STATEMENT_TIMEOUT)]);
    let mut conn = options.connect().await.map_err(PostgresError::Connect)?;
    let result = migrator.run(&mut conn).await.map_err(PostgresError::Migrate);
    if let Err(e) = conn.close().await {
        tracing::debug!(error = %e, "The migration connection did not close cleanly.");
    }
    result
}

/// Keeps `ready` true while the database answers `SELECT 1` within [`READINESS_TIMEOUT`],
/// checking every `every` until `token` is cancelled. Runs as one of a service's long tasks.
pub async fn watch_reachability(
    pool: PgPool,
    ready: crate::admin::ReadyFlag,
    every: Duration,
    token: tokio_util::sync::CancellationToken,
) -> Result<(), PostgresError> {
    loop {
        match tokio::time::timeout(READINESS_TIMEOUT, sqlx::query("SELECT 1").execute(&pool)).await {
            Ok(Ok(_)) => ready.set(true),
            Ok(Err(e)) => {
                ready.set(false);
                tracing::warn!(error = %e, "The database is not answering.");
            }
            Err(_) => {
                ready.set(false);
                tracing::warn!(
                    timeout_ms = READINESS_TIMEOUT.as_millis() as u64,
                    "The database did not answer in time; not ready."
                );
            }
        }
        tokio::select! {
            () = token.cancelled() => return Ok(()),
            () = tokio::time::sleep(every) => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Problem;

    fn problems(url: &str, pool: u32) -> Vec<Problem> {
        let mut p = Problems::default();
        check_database_flags(&mut p, url, pool);
        p.list().to_vec()
    }

    #[test]
    fn postgres_urls_and_a_pool_of_at_least_one_pass() {
        for (url, pool) in [("postgres://u:p@db:5432/gpumedic", 1), ("postgresql://u@db/gpumedic?sslmode=require", 16)]
        {
            let found = problems(url, pool);
            assert!(found.is_empty(), "{url} with {pool}: {found:?}");
        }
    }

    #[test]
    fn each_problem_is_listed_with_its_flag() {
        let url = Problem { field: "--database-url".into(), message: "must be a postgres:// URL".into() };
        let pool = Problem { field: "--database-pool".into(), message: "must be at least 1".into() };
        assert_eq!(problems("mysql://db/gpumedic", 4), std::slice::from_ref(&url));
        assert_eq!(problems("", 4), std::slice::from_ref(&url), "an empty URL");
        assert_eq!(problems("postgres://db/gpumedic", 0), std::slice::from_ref(&pool));
        assert_eq!(problems("db:5432", 0), [url, pool], "both, in the order of the flags");
    }

    #[test]
    fn another_flag_is_named_as_given() {
        let mut p = Problems::default();
        check_url(&mut p, "--incident-database-url", "http://db");
        check_pool(&mut p, "--api-database-pool", 0);
        let fields: Vec<&str> = p.list().iter().map(|p| p.field.as_str()).collect();
        assert_eq!(fields, ["--incident-database-url", "--api-database-pool"]);
    }
}
