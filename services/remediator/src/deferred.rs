//! Deferred actions: while leading, carry out the actions recorded on managed nodes once a
//! maintenance window opens, their time comes or their GPU is idle.

use std::sync::Arc;
use std::sync::atomic::Ordering;

use crate::error::TermError;
use tokio_util::sync::CancellationToken;

use crate::apply::{ApplyError, Outcome};
use crate::events::{DeferredActionRefused, InternalEvent as _};
use crate::plan::Skip;
use crate::term::{Shared, persist_trip, publish};
use crate::{drain, maintenance, verdicts};

/// While leading, carries out the deferred actions recorded on the managed nodes once they are
/// due (a window open, their time come, their GPU idle), publishes their outcomes and removes the
/// records. Paused, or held by the breaker or the rate limit, a record stays for the next look.
pub(crate) async fn carry_out_deferred(shared: Arc<Shared>, term: CancellationToken) -> Result<(), TermError> {
    loop {
        tokio::select! {
            () = term.cancelled() => return Ok(()),
            () = tokio::time::sleep(shared.maintenance_check) => {}
        }
        if shared.remediator.paused() {
            continue;
        }
        let nodes = match shared.fleet.carrying(maintenance::DEFERRED_ANNOTATION).await {
            Ok(n) => n,
            Err(e) => {
                tracing::warn!(error = %e, "Cannot list the nodes with deferred actions; trying again later.");
                continue;
            }
        };
        for node in nodes {
            if term.is_cancelled() {
                return Ok(());
            }
            let name = node.metadata.name.clone().unwrap_or_default();
            if let Err(e) = carry_out(&shared, &node, &term).await {
                tracing::warn!(node = %name, error = %e, "A deferred action did not go through; it stays for the next look.");
            }
        }
    }
}

/// Carries out the deferred action on `node`, if it may go now.
pub(crate) async fn carry_out(
    shared: &Shared,
    node: &k8s_openapi::api::core::v1::Node,
    term: &CancellationToken,
) -> Result<(), TermError> {
    let name = node.metadata.name.clone().unwrap_or_default();
    let deferred = match maintenance::deferred_on(node) {
        Some(Ok(d)) => d,
        Some(Err(e)) => {
            DeferredActionRefused::Unreadable { node: &name, error: &e }.emit();
            let why = format!("Dropped the unreadable deferred action in {}: {e}", maintenance::DEFERRED_ANNOTATION);
            shared.remediator.record_event(node, "DeferredActionRefused", why, true).await;
            maintenance::clear(&shared.remediator.client(), &name).await?;
            return Ok(());
        }
        None => return Ok(()),
    };
    // The record is data on this node, never a command for another: whoever can annotate one node
    // (its own kubelet can) must not reach a second one through it.
    if deferred.request.node != name {
        DeferredActionRefused::OtherNode { node: &name, names: &deferred.request.node }.emit();
        let why = format!(
            "Dropped the deferred action in {}: it names node {}, and a node's annotations act on that node only",
            maintenance::DEFERRED_ANNOTATION,
            deferred.request.node
        );
        shared.remediator.record_event(node, "DeferredActionRefused", why, true).await;
        maintenance::clear(&shared.remediator.client(), &name).await?;
        return Ok(());
    }
    let idle = match deferred.until {
        maintenance::Until::Idle => {
            drain::workload_on(&shared.remediator.client(), &name, deferred.request.gpu.as_ref()).await?.is_empty()
        }
        _ => false,
    };
    if !maintenance::due(&deferred, &shared.windows, chrono::Utc::now(), || idle) {
        return Ok(());
    }
    shared.remediator.leading(&name)?;
    let gpu_nodes = shared.fleet.count.load(Ordering::Acquire);
    let result = tokio::select! {
        () = term.cancelled() => return Ok(()),
        r = shared.remediator.remediate(&deferred.request, gpu_nodes) => r,
    };
    persist_trip(shared).await?;
    let result = match result {
        Ok(Outcome::Skipped { reason: Skip::BreakerOpen(_) | Skip::RateLimited(_) | Skip::Paused, .. }) => {
            return Ok(());
        }
        Ok(o) => Ok(o),
        Err(e @ ApplyError::NodeNotFound { .. }) => Err(e.to_string()),
        Err(e) => return Err(e.into()),
    };
    let outcome = verdicts::outcome_for(deferred.verdict_id, &name, deferred.action, &result);
    tracing::info!(node = %name, verdict_id = %deferred.verdict_id, status = ?outcome.status,
        detail = %outcome.detail, "Carried out a deferred action.");
    publish(shared, &outcome, None).await?;
    maintenance::clear(&shared.remediator.client(), &name).await?;
    Ok(())
}
