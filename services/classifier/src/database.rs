//! The classifier's database: its migrations and the connection that brings the schema up to date.

use gpumedic_runtime::postgres;

use crate::classifier::ClassifierError;

/// The classifier's database migrations (`services/classifier/migrations`).
pub static MIGRATOR: sqlx::migrate::Migrator = sqlx::migrate!("./migrations");

/// Connects to the database and brings its schema up to date.
pub async fn connect_and_migrate(url: &str, pool_size: u32) -> Result<sqlx::PgPool, ClassifierError> {
    // A batch statement carries thousands of rows with their JSON: at the default 4 MB of
    // work_mem Postgres spills it to temporary files (docs/profiles.md).
    let pool = postgres::connect_with_settings(url, pool_size, &[("work_mem", "64MB")]).await?;
    postgres::migrate(&pool, &MIGRATOR).await?;
    tracing::info!("Database schema is up to date.");
    Ok(pool)
}
