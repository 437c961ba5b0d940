//! A restarted classifier under `--persist evidence` follows the incidents it followed before, as
//! under `--persist all`, against the real Kafka and PostgreSQL: the same stream (heartbeats, an
//! Xid 79 that waits for a reboot, more heartbeats of the same boot) goes to a classifier under
//! each policy, each is restarted (rebuilding from what it recorded), and the reboot's heartbeat
//! recovers the same incident under both; `evidence` recorded fewer events.

use std::time::Duration;

use gpumedic_schemas::{HealthEvent, Verdict};
use gpumedic_testkit as testkit;

mod support;
use support::{Bed, healthy, rules_dir, xid, xid79_rule};

/// One node's events, the same ones (ids included) for both policies.
struct Stream {
    before: Vec<HealthEvent>,
    fault: HealthEvent,
    after: Vec<HealthEvent>,
    reboot: HealthEvent,
}

/// Runs the stream through a classifier under `persist`, restarts it, sends the reboot's
/// heartbeat; returns the opening and recovery verdicts and the rows in `health_events`.
async fn through(persist: &str, node: &str, stream: &Stream) -> (Verdict, Verdict, i64) {
    let bed = Bed::new(&format!("persist-{persist}")).await;
    let rules = rules_dir(&xid79_rule(1));
    let mut c = bed.start(&rules, "48h", &[("GPUMEDIC_PERSIST", persist.into())]).await;
    for e in &stream.before {
        bed.send(node, e.clone()).await;
    }
    bed.send(node, stream.fault.clone()).await;
    let opened = bed.verdict(node, |v| !v.recovery, "the fault's verdict").await;
    // Healthy, but no proof of repair: the incident stays open, and these bear on nothing.
    for e in &stream.after {
        bed.send(node, e.clone()).await;
    }
    let pool = gpumedic_runtime::postgres::connect(&bed.url, 1).await.unwrap();
    let rows = testkit::eventually_with("the classifier to take in 41 events", Duration::from_secs(60), async || {
        // Every event taken in: the classifier counts them whether or not it records them.
        let (_, text) = testkit::http_get(c.admin_addr(), "/metrics").await.unwrap();
        let consumed = text
            .lines()
            .find(|l| l.starts_with("gpumedic_classifier_events_total"))
            .and_then(|l| l.split_whitespace().last())
            .and_then(|v| v.parse::<f64>().ok())
            .unwrap_or(0.0);
        if consumed < 41.0 {
            return Err(format!("{consumed} of 41 taken in"));
        }
        let rows: i64 = sqlx::query_scalar("SELECT count(*) FROM health_events WHERE node = $1")
            .bind(node)
            .fetch_one(&pool)
            .await
            .unwrap();
        Ok(rows)
    })
    .await;
    c.terminate(Duration::from_secs(20)).await.unwrap_or_else(|e| panic!("{e}"));
    // The healthy events' minute was still open: written at shutdown under `evidence`.
    let rolled: Option<i64> = sqlx::query_scalar("SELECT sum(events)::int8 FROM telemetry_rollups WHERE node = $1")
        .bind(node)
        .fetch_one(&pool)
        .await
        .unwrap();
    let healthy = (stream.before.len() + stream.after.len()) as i64;
    assert_eq!(rolled, (persist == "evidence").then_some(healthy), "{persist}: the rollups written at shutdown");
    pool.close().await;

    let mut c = bed.start(&rules, "48h", &[("GPUMEDIC_PERSIST", persist.into())]).await;
    bed.send(node, stream.reboot.clone()).await;
    let recovery = bed.verdict(node, |v| v.recovery, "the recovery after the reboot").await;
    // The verdict is published before its batch is written: the row follows within moments.
    let _ =
        testkit::eventually_or(Duration::from_secs(10), async || (bed.incidents(node).await == (1, 1)).then_some(()))
            .await;
    assert_eq!(bed.incidents(node).await, (1, 1), "{persist}: one incident, and it is closed");
    c.terminate(Duration::from_secs(20)).await.unwrap_or_else(|e| panic!("{e}"));
    std::fs::remove_dir_all(&rules).ok();
    (opened, recovery, rows)
}

#[tokio::test]
async fn a_restart_under_evidence_only_history_recovers_the_incident_as_under_every_event() {
    let node = testkit::unique_name("persist-node");
    let stream = Stream {
        before: (0..20).map(|_| healthy(&node, "boot-before")).collect(),
        fault: xid(&node, 79),
        after: (0..20).map(|_| healthy(&node, "boot-before")).collect(),
        reboot: healthy(&node, "boot-after"),
    };
    let (all_opened, all_recovery, all_rows) = through("all", &node, &stream).await;
    let (opened, recovery, rows) = through("evidence", &node, &stream).await;
    assert_eq!(all_rows, 41, "--persist all records every event");
    assert!(rows < all_rows, "--persist evidence recorded {rows} of {all_rows} events");
    assert_eq!(opened.incident_id, all_opened.incident_id, "the same incident");
    assert_eq!(recovery.incident_id, opened.incident_id, "the recovery closes the incident it opened");
    assert_eq!(recovery.verdict_id, all_recovery.verdict_id, "the same recovery verdict");
}

/// A period's rollup (the default `--rollup-period`, 10 minutes) is written by the rollup writer
/// while the classifier runs, once event time has passed the period and its grace: the writer
/// beside the batches (not the write at shutdown) puts it in `telemetry_rollups`, each event
/// counted once, in one row per GPU and kind for the whole period.
#[tokio::test]
async fn a_closed_period_is_rolled_up_while_the_classifier_runs() {
    use chrono::{DurationRound as _, TimeDelta, Utc};
    let node = testkit::unique_name("rollup-node");
    let bed = Bed::new("rollup-writer").await;
    let rules = rules_dir(&xid79_rule(1));
    let mut c = bed.start(&rules, "48h", &[("GPUMEDIC_PERSIST", "evidence".into())]).await;
    let start = Utc::now().duration_trunc(TimeDelta::minutes(10)).unwrap() - TimeDelta::minutes(30);
    // A reading every 50 s for 9 minutes: 11 events, over nine minutes of the period.
    for s in 0..11 {
        let e = testkit::event(&node).gpu(support::GPU).boot("boot-a").at(start + TimeDelta::seconds(s * 50)).build();
        bed.send(&node, e).await;
    }
    // Twelve minutes after the period's start by event time: the period and its minute of grace
    // are over.
    let later = testkit::event(&node).gpu(support::GPU).boot("boot-a").at(start + TimeDelta::minutes(12)).build();
    bed.send(&node, later).await;
    let pool = gpumedic_runtime::postgres::connect(&bed.url, 1).await.unwrap();
    let rolled = testkit::eventually_with("the closed period's rollup", Duration::from_secs(60), async || {
        rolled_up(&pool, &node, start).await.ok_or_else(|| "no rollup for the closed period yet".to_owned())
    })
    .await;
    assert_eq!(rolled, 11, "every event of the closed period counted once, before any stop");
    let rows: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM telemetry_rollups WHERE node = $1 AND minute < $2 AND period = interval '10 minutes'",
    )
    .bind(&node)
    .bind(start + TimeDelta::minutes(10))
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!(rows, 1, "one row of ten minutes for the GPU's nine minutes of readings");
    c.terminate(Duration::from_secs(20)).await.unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(rolled_up(&pool, &node, start).await, Some(11), "the stop wrote the closed period no second time");
    pool.close().await;
    std::fs::remove_dir_all(&rules).ok();
}

/// The events `node`'s rollups of the period starting at `minute` count, if any is written.
async fn rolled_up(pool: &sqlx::PgPool, node: &str, minute: chrono::DateTime<chrono::Utc>) -> Option<i64> {
    sqlx::query_scalar("SELECT sum(events)::int8 FROM telemetry_rollups WHERE node = $1 AND minute = $2")
        .bind(node)
        .bind(minute)
        .fetch_one(pool)
        .await
        .unwrap()
}

/// A reading of a collector's start snapshot (the `raw` text marks it) is rolled up and written
/// at once, before its period is over: most such readings are of kinds that report again only
/// on a change, and a fleet's start snapshots held until their periods closed were most of the
/// classifier's memory while its collectors started. A later reading of the same GPU and kind in
/// that period is written when the period closes, merged into the same row, each event counted
/// once; a plain reading (no snapshot) of another GPU waits for its period's close.
#[tokio::test]
async fn a_start_snapshots_rollup_is_written_at_once_and_its_period_merged_into_it() {
    use chrono::{DateTime, DurationRound as _, TimeDelta, Utc};
    use gpumedic_schemas::health::{Detail, SNAPSHOT_RAW, Source, TemperatureDetail};
    let node = testkit::unique_name("snapshot-node");
    let bed = Bed::new("snapshot-rollup").await;
    let rules = rules_dir(&xid79_rule(1));
    let mut c = bed.start(&rules, "48h", &[("GPUMEDIC_PERSIST", "evidence".into())]).await;
    let start = Utc::now().duration_trunc(TimeDelta::minutes(10)).unwrap() - TimeDelta::minutes(30);
    let temperature = |gpu: &str, celsius: i32, at: DateTime<Utc>, snapshot: bool| {
        let detail = TemperatureDetail { celsius, slowdown_celsius: Some(87), shutdown_celsius: Some(92) };
        let mut e = testkit::event(&node)
            .gpu(gpu)
            .boot("boot-a")
            .detail(Source::Nvml, Detail::Temperature(detail))
            .healthy_flag(true)
            .at(at)
            .build();
        e.raw = snapshot.then(|| SNAPSHOT_RAW.to_owned());
        e
    };
    const OTHER_GPU: &str = "GPU-0000000c-bbbb-cccc-dddd-eeeeeeeeeeee";
    bed.send(&node, temperature(OTHER_GPU, 50, start, false)).await;
    bed.send(&node, temperature(support::GPU, 61, start + TimeDelta::seconds(10), true)).await;
    let pool = gpumedic_runtime::postgres::connect(&bed.url, 1).await.unwrap();
    let row = async |gpu: &str| -> Option<(i32, f64, f64, f64)> {
        sqlx::query_as(
            "SELECT events, (readings -> 'value' ->> 'min')::float8, (readings -> 'value' ->> 'max')::float8,
                    (readings -> 'value' ->> 'last')::float8
               FROM telemetry_rollups WHERE node = $1 AND gpu_uuid = $2 AND kind = 'temperature' AND minute = $3",
        )
        .bind(&node)
        .bind(gpu)
        .bind(start)
        .fetch_optional(&pool)
        .await
        .unwrap()
    };
    let snapshot = testkit::eventually_with("the snapshot's rollup", Duration::from_secs(60), async || {
        row(support::GPU).await.ok_or_else(|| "the snapshot's rollup is not written yet".to_owned())
    })
    .await;
    assert_eq!(snapshot, (1, 61.0, 61.0, 61.0), "written while its period is still open");
    assert_eq!(row(OTHER_GPU).await, None, "a plain reading waits for its period to close");

    // Two more readings of the period, then one of the next period past the grace.
    bed.send(&node, temperature(support::GPU, 70, start + TimeDelta::minutes(3), false)).await;
    bed.send(&node, temperature(support::GPU, 58, start + TimeDelta::minutes(5), false)).await;
    bed.send(&node, temperature(support::GPU, 60, start + TimeDelta::minutes(12), false)).await;
    let merged = testkit::eventually_with("the closed period merged", Duration::from_secs(60), async || {
        match row(support::GPU).await {
            Some(r) if r.0 >= 3 => Ok(r),
            other => Err(format!("{other:?}: the closed period is not merged in yet")),
        }
    })
    .await;
    assert_eq!(merged, (3, 58.0, 70.0, 58.0), "one row: each event once, the range and the last by event time");
    assert_eq!(row(OTHER_GPU).await, Some((1, 50.0, 50.0, 50.0)), "written once its period closed");
    c.terminate(Duration::from_secs(20)).await.unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(row(support::GPU).await, Some((3, 58.0, 70.0, 58.0)), "the stop wrote nothing of it twice");
    pool.close().await;
    std::fs::remove_dir_all(&rules).ok();
}
