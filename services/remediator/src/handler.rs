//! The verdict handler: one verdict in, its remediation (or why not) applied, its outcome
//! published on the actions topic.

use std::sync::Arc;
use std::sync::atomic::Ordering;

use gpumedic_runtime::kafka::{self, HandleError, Record, RecordHandler, record_headers};
use gpumedic_runtime::keyed;
use gpumedic_schemas::{ActionOutcome, Severity, Verdict};
use tokio_util::sync::CancellationToken;

use crate::apply::{ApplyError, Outcome};
use crate::events::{ActionDeferred, InternalEvent as _, VerdictHandled, VerdictStale, VerdictTimed};
use crate::plan::{Mode, Skip};
use crate::repairs::{end_ladder, hold_for_validation, interrupt_burn_in};
use crate::request::Action;
use crate::term::{Shared, persist_trip, publish};
use crate::{maintenance, request, verdicts};

/// The consumer's handler for one leadership term: apply the verdict, publish the outcome, then
/// let the offset be stored. When the term ends mid-verdict (the lease is lost, or shutdown) the
/// work in hand stops at once and the offset is not stored: the next leader takes the verdict up
/// again, and because every step is idempotent it does only what is left.
pub struct Handler {
    pub(crate) shared: Arc<Shared>,
    pub(crate) term: CancellationToken,
}

impl Handler {
    /// What the remediator does with `request` from `verdict` on a managed node, fresh enough.
    pub(crate) async fn act(&self, verdict: &Verdict, request: &request::Remediation) -> Result<Outcome, ApplyError> {
        let shared = &self.shared;
        let gpu_nodes = shared.fleet.count.load(Ordering::Acquire);
        let now = chrono::Utc::now();
        let timing = maintenance::Timing {
            recovery: request.recovery,
            critical: verdict.severity == Severity::Critical,
            not_before: verdict.not_before,
            deferrable: verdict.deferrable,
        };
        // A fresh fault that would take a node out ends the burn-in of a node that was about to
        // return (a re-issue by the resync is no new evidence; a warning that only marks is not
        // enough to undo a passed validation). Without a burn-in configured no node is read for
        // it, so a mass failure costs no extra read per verdict.
        let burn_in = shared.remediator.settings().validation.as_ref().is_some_and(|v| v.burn_in.is_some());
        if burn_in
            && !request.recovery
            && !request.reissue
            && request.action.quarantines()
            && !shared.remediator.paused()
            && shared.remediator.settings().policy.mode == Mode::FullRemediation
        {
            interrupt_burn_in(shared, request, verdict.issued_at).await?;
        }
        let waits = !shared.remediator.paused() && shared.remediator.settings().policy.mode != Mode::MonitorOnly;
        let Some((until, not_before)) =
            waits.then(|| maintenance::hold(request.action, timing, &shared.windows, now)).flatten()
        else {
            if request.recovery && !shared.remediator.paused() {
                if let Some(waits) = hold_for_validation(shared, request).await? {
                    return Ok(waits);
                }
                end_ladder(shared, request).await?;
            }
            let outcome = shared.remediator.remediate(request, gpu_nodes).await?;
            if request.recovery && !shared.remediator.paused() {
                shared.remediator.leading(&request.node)?;
                maintenance::clear_for(&shared.remediator.client(), &request.node, &request.incident_id)
                    .await
                    .map_err(|source| ApplyError::Patch { node: request.node.clone(), source })?;
            }
            return Ok(outcome);
        };
        // A re-issued verdict (the resync) whose action was carried out after an earlier
        // deferral: nothing is left to wait for.
        if request.reissue && shared.remediator.reflects(request).await? {
            return Ok(Outcome::AlreadyDone);
        }
        // Mark now (the condition tells people and schedulers), the rest when it is due.
        let mark = request::Remediation { action: Action::Monitor, ..request.clone() };
        match shared.remediator.remediate(&mark, gpu_nodes).await? {
            Outcome::Applied { .. } | Outcome::AlreadyDone => {}
            other => return Ok(other),
        }
        let deferred = maintenance::Deferred {
            verdict_id: verdict.verdict_id,
            action: verdict.action,
            request: request.clone(),
            deferred_at: now,
            not_before,
            until,
        };
        // A node records one deferral. The resync re-issuing one incident's verdict must not
        // replace another incident's pending deferral: the two would take the record from each
        // other at every interval (and report it each time), and neither would stay recorded.
        // This one is re-issued once the pending one is carried out and cleared.
        if request.reissue && pending_for_another(shared, request).await? {
            tracing::debug!(node = %request.node, incident = %request.incident_id,
                "Another incident's deferred action is pending on the node; this one is re-issued after it.");
            return Ok(Outcome::AlreadyDone);
        }
        shared.remediator.leading(&request.node)?;
        maintenance::defer(&shared.remediator.client(), &deferred)
            .await
            .map_err(|source| ApplyError::Patch { node: request.node.clone(), source })?;
        let waits_for = maintenance::waits_for(until, not_before);
        ActionDeferred { node: &request.node, verdict_id: &verdict.verdict_id, until: &until, waits_for: &waits_for }
            .emit();
        Ok(Outcome::Skipped { reason: Skip::Deferred(waits_for), would: None })
    }
}

/// Whether `request`'s node carries a deferred action of another incident.
async fn pending_for_another(shared: &Shared, request: &request::Remediation) -> Result<bool, ApplyError> {
    let nodes: kube::Api<k8s_openapi::api::core::v1::Node> = kube::Api::all(shared.remediator.client());
    let node =
        nodes.get(&request.node).await.map_err(|source| ApplyError::Read { node: request.node.clone(), source })?;
    Ok(matches!(maintenance::deferred_on(&node), Some(Ok(d)) if d.request.incident_id != request.incident_id))
}

impl RecordHandler for Handler {
    async fn handle(&mut self, record: &Record) -> Result<(), HandleError> {
        self.handle_verdict(record).await
    }
}

impl keyed::SharedHandler for Handler {
    async fn handle(&self, record: &Record) -> Result<(), HandleError> {
        self.handle_verdict(record).await
    }
}

impl Handler {
    /// Whether this leader saw `incident` recover.
    fn recovered(&self, incident: &str) -> bool {
        self.shared.recovered.lock().unwrap_or_else(std::sync::PoisonError::into_inner).contains(incident)
    }

    /// [`Handler::act`] under the node's lock ([`crate::term::NodeLocks`]), for the verdict
    /// consumer and the resync alike. A fault of an incident this leader saw recover is not acted
    /// on (a replay, or a resync whose read of the store predates the recovery): it must not take
    /// the node out again. A recovery acted on is remembered before the lock is released.
    pub(crate) async fn act_on_node(
        &self,
        verdict: &Verdict,
        request: &request::Remediation,
    ) -> Result<Outcome, ApplyError> {
        let _node = self.shared.node_locks.lock(&request.node).await;
        if !verdict.recovery && self.recovered(&request.incident_id) {
            return Ok(Outcome::Skipped { reason: Skip::Recovered, would: None });
        }
        let outcome = self.act(verdict, request).await;
        if verdict.recovery && outcome.is_ok() {
            self.shared
                .recovered
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .insert(&request.incident_id);
        }
        outcome
    }

    /// One verdict: its remediation (or why not), then its outcome on the actions topic.
    async fn handle_verdict(&self, record: &Record) -> Result<(), HandleError> {
        let started = std::time::Instant::now();
        let delivered = record.timestamp_ms.and_then(|at| {
            let ms = chrono::Utc::now().timestamp_millis().checked_sub(at)?;
            u64::try_from(ms).ok().map(std::time::Duration::from_millis)
        });
        let verdict: Verdict = kafka::decode_payload(&self.shared.codec, record).await?;
        let request = verdicts::remediation(&verdict);
        let shared = self.shared.clone();
        let managed = shared.fleet.manages(&verdict.node).await.map_err(|e| HandleError::Retry(Box::new(e)))?;
        let result = if let Some(age) = verdicts::stale(&verdict, chrono::Utc::now(), shared.max_verdict_age) {
            VerdictStale { node: &verdict.node, verdict_id: &verdict.verdict_id, age, recovery: verdict.recovery }
                .emit();
            Ok(Outcome::Skipped { reason: Skip::Stale(age), would: None })
        } else if !managed {
            Ok(Outcome::Skipped { reason: Skip::Unmanaged, would: None })
        } else {
            let acted = tokio::select! {
                // Stop at once: the next leader (or this one, after a restart) takes it up again.
                () = self.term.cancelled() => return Err(HandleError::Retry("the leadership term ended".into())),
                r = self.act_on_node(&verdict, &request) => r,
            };
            match acted {
                Ok(outcome) => Ok(outcome),
                // A node that no longer exists will not come back for this verdict: record and move on.
                Err(e @ ApplyError::NodeNotFound { .. }) => Err(e.to_string()),
                Err(e) => return Err(HandleError::retry(e)),
            }
        };
        if verdict.recovery && result.is_ok() {
            shared.recovered.lock().unwrap_or_else(std::sync::PoisonError::into_inner).insert(&request.incident_id);
        }
        VerdictTimed { delivered, acted: started.elapsed() }.emit();
        // A trip is durable before the verdict that caused it is acknowledged.
        persist_trip(&shared).await.map_err(HandleError::retry)?;
        let outcome: ActionOutcome = verdicts::outcome(&verdict, &result);
        VerdictHandled {
            node: &verdict.node,
            verdict_id: &verdict.verdict_id,
            status: &outcome.status,
            detail: &outcome.detail,
        }
        .emit();
        publish(&shared, &outcome, record.header(record_headers::TRACEPARENT)).await
    }
}
