//! Retention of recorded health events: `health_events` is partitioned by UTC day of
//! `observed_at` (`health_events_pYYYYMMDD`, plus `health_events_default` for anything outside
//! them). A job runs at start and hourly: it creates the partitions of today and the next
//! [`DAYS_AHEAD`] days, drops the daily partitions wholly older than the retention, and deletes
//! expired rows that landed in the default partition. Dropping a partition is instant and leaves
//! no bloat, unlike deleting rows. Telemetry rollups and workload-fault sightings (one per
//! application Xid line) expire with the events; incidents, verdicts, actions and workload faults
//! are small and kept.
//!
//! Replicas serialise on a transaction-scoped advisory lock, so they never race on DDL.

use std::time::Duration;

use chrono::{DateTime, NaiveDate, Utc};
use sqlx::PgPool;
use tokio_util::sync::CancellationToken;

use crate::events::{InternalEvent as _, RetentionFailed, RetentionRan};

/// Partitions are created this many days ahead of today, so a job that fails for a while (or a
/// clock a little ahead) never sends the day's events to the default partition.
pub const DAYS_AHEAD: u32 = 3;

/// How often the job runs after the first time.
pub const EVERY: Duration = Duration::from_secs(3600);

/// Key of the advisory lock held while changing partitions ("gpumedic" in ASCII).
const LOCK_KEY: i64 = 0x6770_756d_6564_6963;

/// What one run did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Report {
    /// Days whose partition was created.
    pub created: Vec<NaiveDate>,
    /// Days whose partition was dropped.
    pub dropped: Vec<NaiveDate>,
    /// Expired rows deleted from the default partition.
    pub default_rows_deleted: u64,
    /// Expired workload-fault sightings deleted.
    pub sightings_deleted: u64,
    /// Expired telemetry rollups deleted (see [`crate::persist`]).
    pub rollups_deleted: u64,
}

/// The partition name for `day`.
pub fn partition_name(day: NaiveDate) -> String {
    format!("health_events_p{}", day.format("%Y%m%d"))
}

/// The day of a partition named by [`partition_name`]; `None` for any other table.
pub fn partition_day(name: &str) -> Option<NaiveDate> {
    let digits = name.strip_prefix("health_events_p")?;
    (digits.len() == 8).then(|| NaiveDate::parse_from_str(digits, "%Y%m%d").ok()).flatten()
}

/// Which daily partitions to create and which to drop, given the existing ones, today, and the
/// retention cutoff (events observed before it may go). A day is dropped only when all of it is
/// before the cutoff.
pub fn plan(existing: &[NaiveDate], today: NaiveDate, cutoff: DateTime<Utc>) -> (Vec<NaiveDate>, Vec<NaiveDate>) {
    let create = (0..=DAYS_AHEAD)
        .filter_map(|n| today.checked_add_days(chrono::Days::new(u64::from(n))))
        .filter(|d| !existing.contains(d))
        .collect();
    let mut drop: Vec<NaiveDate> = existing
        .iter()
        .copied()
        .filter(|d| {
            d.checked_add_days(chrono::Days::new(1))
                .and_then(|end| end.and_hms_opt(0, 0, 0))
                .is_some_and(|end| end.and_utc() <= cutoff)
        })
        .collect();
    drop.sort();
    (create, drop)
}

/// Runs the job once: creates, drops and deletes as [`plan`] says, in one transaction.
pub async fn maintain(pool: &PgPool, retention: Duration, now: DateTime<Utc>) -> Result<Report, sqlx::Error> {
    let cutoff = now - chrono::Duration::from_std(retention).unwrap_or(chrono::Duration::MAX);
    let mut tx = pool.begin().await?;
    sqlx::query("SELECT pg_advisory_xact_lock($1)").bind(LOCK_KEY).execute(&mut *tx).await?;
    let names: Vec<String> = sqlx::query_scalar(
        "SELECT c.relname::text FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid
          WHERE i.inhparent = 'health_events'::regclass",
    )
    .fetch_all(&mut *tx)
    .await?;
    let existing: Vec<NaiveDate> = names.iter().filter_map(|n| partition_day(n)).collect();
    let (create, drop) = plan(&existing, now.date_naive(), cutoff);
    let mut report = Report::default();
    for day in create {
        let (from, to) = (bound(day), bound(day + chrono::Days::new(1)));
        // Rows of that day that arrived early sit in the default partition, and Postgres refuses
        // a new partition whose range they fall in: move them across.
        sqlx::query(
            "CREATE TEMP TABLE IF NOT EXISTS gpumedic_moved (LIKE health_events INCLUDING DEFAULTS) ON COMMIT DROP",
        )
        .execute(&mut *tx)
        .await?;
        sqlx::query(
            "WITH moved AS (DELETE FROM health_events_default WHERE observed_at >= $1::timestamptz
                                                                AND observed_at < $2::timestamptz RETURNING *)
             INSERT INTO gpumedic_moved SELECT * FROM moved",
        )
        .bind(&from)
        .bind(&to)
        .execute(&mut *tx)
        .await?;
        // The name and bounds are built from a date here, never from input.
        sqlx::query(sqlx::AssertSqlSafe(format!(
            "CREATE TABLE {} PARTITION OF health_events FOR VALUES FROM ('{from}') TO ('{to}')",
            partition_name(day)
        )))
        .execute(&mut *tx)
        .await?;
        sqlx::query("INSERT INTO health_events SELECT * FROM gpumedic_moved").execute(&mut *tx).await?;
        sqlx::query("TRUNCATE gpumedic_moved").execute(&mut *tx).await?;
        report.created.push(day);
    }
    for day in drop {
        sqlx::query(sqlx::AssertSqlSafe(format!("DROP TABLE {}", partition_name(day)))).execute(&mut *tx).await?;
        report.dropped.push(day);
    }
    report.default_rows_deleted = sqlx::query("DELETE FROM health_events_default WHERE observed_at < $1")
        .bind(cutoff)
        .execute(&mut *tx)
        .await?
        .rows_affected();
    report.sightings_deleted = sqlx::query("DELETE FROM workload_fault_sightings WHERE observed_at < $1")
        .bind(cutoff)
        .execute(&mut *tx)
        .await?
        .rows_affected();
    report.rollups_deleted = sqlx::query("DELETE FROM telemetry_rollups WHERE minute < $1")
        .bind(cutoff)
        .execute(&mut *tx)
        .await?
        .rows_affected();
    tx.commit().await?;
    Ok(report)
}

fn bound(day: NaiveDate) -> String {
    format!("{} 00:00:00+00", day.format("%Y-%m-%d"))
}

/// Runs the job once now, logging and counting what it did; a failure is logged and the service
/// carries on (the days ahead give it time to succeed on a later run).
pub async fn maintain_logged(pool: &PgPool, retention: Duration) {
    match maintain(pool, retention, Utc::now()).await {
        Ok(report) => RetentionRan { report: &report, retention }.emit(),
        Err(error) => RetentionFailed { error: &error }.emit(),
    }
}

/// The job as a task under the shutdown tree: every [`EVERY`] until cancelled (the first run is
/// done at start, before consuming).
pub async fn run(pool: PgPool, retention: Duration, token: CancellationToken) -> Result<(), std::convert::Infallible> {
    loop {
        tokio::select! {
            () = token.cancelled() => return Ok(()),
            () = tokio::time::sleep(EVERY) => {}
        }
        maintain_logged(&pool, retention).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn day(s: &str) -> NaiveDate {
        s.parse().unwrap()
    }

    #[test]
    fn partition_names_round_trip() {
        assert_eq!(partition_name(day("2026-03-09")), "health_events_p20260309");
        assert_eq!(partition_day("health_events_p20260309"), Some(day("2026-03-09")));
        assert_eq!(partition_day("health_events_default"), None);
        assert_eq!(partition_day("health_events_p2026"), None);
    }

    #[test]
    fn plan_creates_days_ahead_and_drops_only_whole_expired_days() {
        let existing = [day("2026-03-01"), day("2026-03-02"), day("2026-03-09"), day("2026-03-10")];
        let cutoff: DateTime<Utc> = "2026-03-03T00:00:00Z".parse().unwrap();
        let (create, drop) = plan(&existing, day("2026-03-10"), cutoff);
        assert_eq!(create, vec![day("2026-03-11"), day("2026-03-12"), day("2026-03-13")]);
        assert_eq!(drop, vec![day("2026-03-01"), day("2026-03-02")]);
        // Part of 2026-03-02 is after the cutoff: it stays.
        let cutoff: DateTime<Utc> = "2026-03-02T12:00:00Z".parse().unwrap();
        assert_eq!(plan(&existing, day("2026-03-10"), cutoff).1, vec![day("2026-03-01")]);
    }
}
