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
