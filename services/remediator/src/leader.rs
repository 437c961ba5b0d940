//! Leadership: stand by until this replica holds the lease, then run the term's tasks (consume
//! verdicts, follow the status object, carry out deferred actions, drive repairs) until the
//! lease is lost or the service stops.

use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::error::TermError;
use gpumedic_runtime::admin::ReadyFlag;
use gpumedic_runtime::keyed;
use tokio_util::sync::CancellationToken;

use crate::NAME;
use crate::deferred::carry_out_deferred;
use crate::events::{InternalEvent as _, LeadershipGained, LeadershipLost, names};
use crate::handler::Handler;
use crate::lease::{LeaseClient, Validity};
use crate::plan::Mode;
use crate::repairs::drive_repairs;
use crate::term::{Shared, begin_term, watch_status};

/// Why a leadership term ended.
pub(crate) enum TermEnd {
    Shutdown,
    Lost,
    Failed(TermError),
}

/// Stands by until this replica holds the lease, then leads (consumes verdicts, watches the
/// status object, carries out deferred actions) until it loses the lease or the service stops.
/// On loss it stops acting at once (the term's tasks are cancelled: a drain in progress stops, the
/// verdict's offset is not stored, the consumer leaves the group) and stands by again; on shutdown
/// it releases the lease so a standby takes over at its next look.
///
/// Every lease call has a deadline: an attempt gets at most one renew period, and never more than
/// the time the lease is still provably held. The lease counts from the start of the last renewal
/// that succeeded, and `validity` stops every node write at the renew deadline on this replica's
/// own clock, before any standby can see the lease as expired, even while a renewal hangs.
pub(crate) async fn lead(
    shared: Arc<Shared>,
    mut lease: LeaseClient,
    validity: Arc<Validity>,
    lease_ready: ReadyFlag,
    token: CancellationToken,
) -> Result<(), TermError> {
    if !shared.stage.wait_for_topics(&token).await {
        return Ok(());
    }
    let renew = lease.settings().renew;
    loop {
        shared.consuming.set(true);
        loop {
            let started = Instant::now();
            match tokio::time::timeout(renew, lease.try_lead()).await {
                Ok(Ok(true)) => {
                    validity.renewed(started);
                    break;
                }
                Ok(Ok(false)) => lease_ready.set(true),
                Ok(Err(e)) => {
                    lease_ready.set(false);
                    tracing::warn!(error = %e, "Cannot reach the lease; standing by.");
                }
                Err(_) => {
                    lease_ready.set(false);
                    tracing::warn!(
                        seconds = renew.as_secs_f64(),
                        "The lease did not answer within the renew period; standing by."
                    );
                }
            }
            tokio::select! {
                () = token.cancelled() => return Ok(()),
                () = tokio::time::sleep(renew) => {}
            }
        }
        lease_ready.set(true);
        LeadershipGained { identity: &lease.settings().identity }.emit();
        shared.consuming.set(false);
        let term = token.child_token();
        let mut tasks = tokio::task::JoinSet::new();
        tasks.spawn(consume(shared.clone(), term.clone()));
        tasks.spawn(watch_status(shared.clone(), term.clone()));
        tasks.spawn(carry_out_deferred(shared.clone(), term.clone()));
        if let Some(url) = shared.incident_database_url.clone() {
            tasks.spawn(crate::resync::resync_loop(shared.clone(), url, term.clone()));
        }
        if shared.remediator.settings().policy.mode == Mode::FullRemediation {
            tasks.spawn(drive_repairs(shared.clone(), term.clone()));
        }
        let end = loop {
            tokio::select! {
                // Biased: on shutdown the term's tasks return as well, and that is not a failure.
                biased;
                () = token.cancelled() => break TermEnd::Shutdown,
                Some(joined) = tasks.join_next() => {
                    if token.is_cancelled() {
                        break TermEnd::Shutdown;
                    }
                    break TermEnd::Failed(match joined {
                        Ok(Ok(())) => TermError::TaskEnded,
                        Ok(Err(e)) => e,
                        Err(e) => e.into(),
                    });
                }
                () = tokio::time::sleep(renew) => {
                    let started = Instant::now();
                    let left = validity.left_at(started);
                    match tokio::time::timeout(renew.min(left), lease.try_lead()).await {
                        Ok(Ok(true)) => validity.renewed(started),
                        Ok(Ok(false)) => break TermEnd::Lost,
                        Ok(Err(e)) => tracing::warn!(error = %e, "Cannot renew the lease; still leading until the renew deadline."),
                        Err(_) => tracing::warn!(seconds = renew.min(left).as_secs_f64(),
                            "The lease renewal did not answer in time; still leading until the renew deadline."),
                    }
                    if !validity.current() {
                        break TermEnd::Lost;
                    }
                }
            }
        };
        // No write from here on, before the tasks have even stopped.
        validity.end();
        metrics::gauge!(names::LEADER).set(0.0);
        term.cancel();
        // A task stuck in a call that does not answer is not waited for forever.
        let stopped = async {
            while let Some(joined) = tasks.join_next().await {
                if let Ok(Err(e)) = joined {
                    tracing::warn!(error = %e, "A leader task failed while stopping.");
                }
            }
        };
        if tokio::time::timeout(Duration::from_secs(10), stopped).await.is_err() {
            tracing::warn!("Leader tasks did not stop within 10 s of the term's end; aborting them.");
            tasks.abort_all();
        }
        match end {
            TermEnd::Lost => {
                LeadershipLost.emit();
            }
            TermEnd::Shutdown => {
                if let Err(e) = lease.release().await {
                    tracing::warn!(error = %e, "Could not release the lease; a standby takes over when it expires.");
                }
                return Ok(());
            }
            TermEnd::Failed(e) => {
                if let Err(e) = lease.release().await {
                    tracing::warn!(error = %e, "Could not release the lease; a standby takes over when it expires.");
                }
                return Err(e);
            }
        }
    }
}

/// Loads what the previous leader left (breaker, pause) and consumes verdicts until `term` ends.
pub(crate) async fn consume(shared: Arc<Shared>, term: CancellationToken) -> Result<(), TermError> {
    loop {
        match begin_term(&shared).await {
            Ok(()) => break,
            Err(e) => tracing::warn!(error = %e, "Cannot load the breaker and pause state; retrying before consuming."),
        }
        tokio::select! {
            () = term.cancelled() => return Ok(()),
            () = tokio::time::sleep(Duration::from_secs(1)) => {}
        }
    }
    let (consumer, dlq) = shared.stage.join(NAME, shared.consuming.clone())?;
    let handler = Handler { shared: shared.clone(), term: term.clone() };
    // Verdicts for different nodes at once, each node's in order; offsets stored only up to the
    // last verdict below which all are done.
    keyed::run_keyed_consumer(NAME, consumer, dlq, &handler, shared.max_in_flight, term).await?;
    Ok(())
}
