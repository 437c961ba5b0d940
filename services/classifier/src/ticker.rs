//! The ticker: time-based conditions (burst ends, quiet periods) evaluated when no event arrives.

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::Mutex;

use crate::classifier::{Classifier, ClassifierError};
use crate::events::InternalEvent as _;
use crate::rules::engine::Decision;
use crate::store;

/// Evaluates time-based conditions every `every`, so a quiet period ends without a new event.
pub(crate) async fn ticker(
    classifier: Arc<Mutex<Classifier>>,
    every: Duration,
    token: tokio_util::sync::CancellationToken,
) -> Result<(), ClassifierError> {
    loop {
        tokio::select! {
            () = token.cancelled() => {
                flush_rollups(&classifier).await;
                return Ok(());
            }
            () = tokio::time::sleep(every) => {}
        }
        let mut c = classifier.lock().await;
        // Never a deadline for a node another replica owns now.
        if let Err(e) = c.reconcile().await {
            tracing::warn!(error = %e, "Cannot bring the engine in line with the partition assignment; not ticking.");
            continue;
        }
        let decisions: Vec<(Decision, Option<&[u8]>)> =
            c.engine.tick(chrono::Utc::now().timestamp_micros()).into_iter().map(|d| (d, None)).collect();
        metrics::gauge!(crate::events::names::NODES_AWAITING_TIME).set(c.engine.nodes_awaiting_time() as f64);
        if decisions.is_empty() {
            continue;
        }
        // The engine already moved on, so retry from the decisions we hold until both writes
        // succeed (ids are deterministic: a repeat publish is deduplicated downstream).
        loop {
            let judged = match c.judge_lemons(&decisions).await {
                Ok(judged) => judged,
                Err(e) => {
                    tracing::warn!(error = %e, "Cannot read the hardware history for tick decisions; retrying.");
                    tokio::select! {
                        () = token.cancelled() => return Ok(()),
                        () = tokio::time::sleep(Duration::from_secs(1)) => {}
                    }
                    continue;
                }
            };
            match c.publish(&judged).await {
                Ok(published) => match store::record_decisions(&c.pool, &published).await {
                    Ok(()) => break,
                    Err(e) => tracing::warn!(error = %e, "Cannot record tick decisions; retrying."),
                },
                Err(e) => tracing::warn!(error = %e, "Cannot publish tick verdicts; retrying."),
            }
            tokio::select! {
                () = token.cancelled() => return Ok(()),
                () = tokio::time::sleep(Duration::from_secs(1)) => {}
            }
        }
    }
}

/// Stops the rollup writer once what waits in it is written ([`crate::rollups`]), then writes
/// the rollups of the minutes still open, at shutdown: they are held in memory until their minute
/// is over, and the next run starts afresh. A failure loses them (the events are still in Kafka).
async fn flush_rollups(classifier: &Mutex<Classifier>) {
    let mut c = classifier.lock().await;
    c.rollups.close().await;
    let open = c.keeper.drain();
    if open.is_empty() {
        return;
    }
    match crate::rollups::write(&c.pool, &open).await {
        Ok(()) => tracing::info!(rollups = open.len(), "Wrote the rollups of the minutes still open at shutdown."),
        Err(e) => crate::events::RollupsLost { rollups: open.len(), error: &e, stopping: true }.emit(),
    }
}
