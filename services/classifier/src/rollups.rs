//! The rollup writer ([`RollupWriter`]): closed rollups go to PostgreSQL beside the batches, not
//! in them.
//!
//! A batch's write is on every fault's path: the consumer fetches the next batch, with the next
//! fault in it, only once the batch in hand is written. Closed rollups can be most of that write
//! at fleet scale (a minute closes one rollup per GPU and kind at once: at 10,000 nodes about
//! 150 ms per 1,000 rollups, docs/benchmarks.md), yet nothing waits for them: they are
//! derived from healthy telemetry the engine has already taken in, the raw events stay in Kafka,
//! and [`crate::persist`] already keeps them in memory until their minute is over, so a crash
//! loses the open ones. So the handler hands a written batch's closed rollups to a task of their
//! own, which writes them on its own connection while the next batch is classified.
//!
//! At most [`QUEUED`] batches' rollups wait for the writer. A batch that finds the queue full
//! hands over nothing: its closed rollups stay in the keeper, and a later batch hands them over
//! (so a fault never waits for rollups, and memory stays bounded by what the keeper holds: one
//! rollup per GPU, kind and minute). A write that fails is retried, with backoff, until it
//! succeeds or the classifier stops; at stop the queue is written out once, and what still fails
//! then is lost and counted (`rollups_lost_total`), as the open minutes' rollups of a crash are.

use std::time::Duration;

use sqlx::PgPool;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use crate::events::{BatchStage, InternalEvent as _, RollupsLost, RollupsWritten};
use crate::persist::{Keeper, Rollup, RollupKey, RollupRows};
use crate::store;

/// How many batches' closed rollups may wait for the writer.
pub const QUEUED: usize = 4;

/// One batch's closed rollups.
pub type Rows = Vec<(RollupKey, Rollup)>;

/// The handle the classifier keeps on its rollup writer task.
pub struct RollupWriter {
    tx: Option<mpsc::Sender<Rows>>,
    task: Option<tokio::task::JoinHandle<()>>,
}

impl RollupWriter {
    /// Starts the writer on `pool`; `token` is the classifier's shutdown.
    pub fn start(pool: PgPool, token: CancellationToken) -> Self {
        let (tx, rx) = mpsc::channel(QUEUED);
        let task = tokio::spawn(write_loop(pool, rx, token));
        RollupWriter { tx: Some(tx), task: Some(task) }
    }

    /// Hands the writer up to `at_most` of `keeper`'s closed rollups if its queue has room; if not,
    /// they stay in the keeper for a later batch, so no batch ever waits for the writer. Once the
    /// writer is closed they are written here, and an error is the caller's.
    pub async fn offer(&mut self, pool: &PgPool, keeper: &mut Keeper, at_most: usize) -> Result<(), store::StoreError> {
        let closed = match self.tx.as_ref().map(mpsc::Sender::try_reserve) {
            Some(Ok(permit)) => {
                let rows = keeper.closed(at_most);
                if !rows.is_empty() {
                    permit.send(rows);
                }
                return Ok(());
            }
            Some(Err(mpsc::error::TrySendError::Full(()))) => {
                // Taken as closed all the same (none handed over): a rebalance forgets only the
                // open minutes of the nodes it takes away, never closed ones.
                keeper.closed(0);
                return Ok(());
            }
            Some(Err(mpsc::error::TrySendError::Closed(()))) => true,
            None => false,
        };
        if closed {
            self.tx = None;
        }
        write(pool, &keeper.closed(at_most)).await
    }

    /// Writes out what waits and stops the writer; later rollups are written by
    /// [`RollupWriter::offer`]'s caller.
    pub async fn close(&mut self) {
        self.tx = None;
        if let Some(task) = self.task.take()
            && let Err(e) = task.await
        {
            tracing::warn!(error = %e, "The rollup writer ended abnormally.");
        }
    }
}

/// Writes `rows` in transactions of at most [`crate::persist::ROLLUPS_PER_BATCH`], each sent with
/// binary `COPY` ([`store::copy_rollups`]: docs/benchmarks.md, "Rollup writes", measured it
/// against the batch statement's arrays).
pub(crate) async fn write(pool: &PgPool, rows: &[(RollupKey, Rollup)]) -> Result<(), store::StoreError> {
    for chunk in rows.chunks(crate::persist::ROLLUPS_PER_BATCH) {
        let mut batch = RollupRows::default();
        for (key, rollup) in chunk {
            batch.push(key, rollup);
        }
        store::copy_rollups(pool, &batch).await?;
        RollupsWritten { rollups: chunk.len() }.emit();
    }
    Ok(())
}

/// Whether a failed write of rollups may succeed if sent again: not when PostgreSQL refused the
/// statement for what it holds or says (SQLSTATE class 21, a row updated twice; 22, bad data; 23,
/// a constraint; 42, the statement against the schema; 54, a limit), which would fail the same way
/// every time while the rollups behind it waited. A lost connection, a timeout, a serialization
/// failure or a server shutting down may.
pub fn retryable(e: &store::StoreError) -> bool {
    match e {
        sqlx::Error::Database(db) => {
            !db.code().is_some_and(|c| matches!(c.get(..2), Some("21" | "22" | "23" | "42" | "54")))
        }
        sqlx::Error::Encode(_) | sqlx::Error::TypeNotFound { .. } | sqlx::Error::ColumnNotFound(_) => false,
        _ => true,
    }
}

/// The writer task: each queued batch of rollups written, retried until it is or the classifier
/// stops; ends when the queue is closed and empty.
async fn write_loop(pool: PgPool, mut rx: mpsc::Receiver<Rows>, token: CancellationToken) {
    while let Some(rows) = rx.recv().await {
        let started = std::time::Instant::now();
        let mut backoff = Duration::from_millis(100);
        loop {
            match write(&pool, &rows).await {
                Ok(()) => break,
                Err(e) if token.is_cancelled() || !retryable(&e) => {
                    RollupsLost { rollups: rows.len(), error: &e, stopping: token.is_cancelled() }.emit();
                    break;
                }
                Err(e) => {
                    tracing::warn!(error = %e, rollups = rows.len(), backoff_ms = backoff.as_millis() as u64,
                        "Cannot write closed rollups; retrying.");
                    tokio::select! {
                        () = token.cancelled() => {}
                        () = tokio::time::sleep(backoff) => {}
                    }
                    backoff = (backoff * 2).min(Duration::from_secs(30));
                }
            }
        }
        BatchStage { stage: "rollups", elapsed: started.elapsed() }.emit();
    }
}
