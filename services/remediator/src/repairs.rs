//! The repair ladder's driver (full-remediation mode): calls the repair hooks one rung at a
//! time, escalates on failure or timeout, and ends a ladder on healthy evidence.

use std::sync::Arc;

use crate::error::TermError;
use crate::events::{
    BurnIn, BurnInInterrupted, InternalEvent as _, LadderFailed, LadderRefused, LadderRemediated, RepairStep,
    Validation, ValidationFailed, names,
};
use gpumedic_schemas::{ActionOutcome, ActionStatus};
use tokio_util::sync::CancellationToken;

use crate::apply::ApplyError;
use crate::term::{Shared, publish};
use crate::{hooks, ladder, plan, request};

/// Healthy evidence for a node on a repair ladder (a recovery verdict for its incident): the
/// ladder ends remediated, with an Event and an outcome under the verdict that started it, and
/// its record is removed before the recovery itself runs, so the driver cannot escalate a node
/// that is healthy. Redelivered, it finds no ladder and does nothing.
pub(crate) async fn end_ladder(shared: &Shared, request: &request::Remediation) -> Result<(), ApplyError> {
    let client = shared.remediator.client();
    let nodes: kube::Api<k8s_openapi::api::core::v1::Node> = kube::Api::all(client.clone());
    let node = match nodes.get_opt(&request.node).await {
        Ok(Some(n)) => n,
        Ok(None) => return Ok(()),
        Err(source) => return Err(ApplyError::Read { node: request.node.clone(), source }),
    };
    let Some(Ok(l)) = ladder::ladder_on(&node) else { return Ok(()) };
    if l.request.incident_id != request.incident_id {
        return Ok(());
    }
    // A validation before a release from quarantine repaired nothing: no "remediated" to report.
    let repaired = l.validation.as_ref().is_none_or(|v| v.release_from.is_none());
    if l.phase != ladder::Phase::Failed && repaired {
        let detail = format!(
            "remediated: healthy evidence (recovery verdict {}) after repair step {}/{} {}; ladder {}",
            request.verdict_id,
            l.step_number(),
            l.steps.len(),
            l.step_name(),
            l.describe()
        );
        shared.remediator.record_event(&node, "Remediated", detail.clone(), false).await;
        let outcome = ladder_outcome(&l, ActionStatus::Applied, detail);
        publish(shared, &outcome, None).await.map_err(|e| ApplyError::Publish(e.to_string()))?;
        LadderRemediated { node: &request.node, verdict_id: &l.verdict_id }.emit();
    }
    shared.remediator.leading(&request.node)?;
    ladder::write(&client, &request.node, None, None)
        .await
        .map_err(|source| ApplyError::Patch { node: request.node.clone(), source })
}

/// With `--validation`, the recovery of a node on a repair ladder waits for a validation step: the
/// Job or the custom resource is created (the webhook is asked at the driver's first look), the
/// ladder goes [`ladder::Phase::Validating`] holding the recovery, and the state label reads
/// `validating`. Returns the outcome for the recovery verdict when the
/// recovery waits (also when a validation is already under way: the resync's repeat), `None`
/// when it goes ahead now (no validation configured, no ladder for the incident, or a ladder
/// that failed: nothing left to escalate to).
///
/// In full-remediation a node that no ladder holds is validated too when this recovery would
/// release it from a whole-node quarantine ([`crate::validate::release_from`]): a ladder is
/// recorded for the validation alone, and a failure starts it at its first rung (a drained node)
/// or leaves the node `failed` for an operator (a node that was only cordoned).
pub(crate) async fn hold_for_validation(
    shared: &Shared,
    request: &request::Remediation,
) -> Result<Option<crate::apply::Outcome>, ApplyError> {
    let Some(settings) = shared.remediator.settings().validation.clone() else { return Ok(None) };
    let client = shared.remediator.client();
    let nodes: kube::Api<k8s_openapi::api::core::v1::Node> = kube::Api::all(client.clone());
    let node = match nodes.get_opt(&request.node).await {
        Ok(Some(n)) => n,
        Ok(None) => return Ok(None),
        Err(source) => return Err(ApplyError::Read { node: request.node.clone(), source }),
    };
    let raw = node.metadata.annotations.as_ref().and_then(|a| a.get(ladder::LADDER_ANNOTATION)).cloned();
    let mut release_from = None;
    let mut l = match ladder::ladder_on(&node) {
        Some(Ok(l)) => l,
        Some(Err(_)) => return Ok(None),
        None => {
            let policy = shared.remediator.settings().policy;
            let view = plan::NodeView::from_node(&node);
            release_from = crate::validate::release_from(&view, request);
            match release_from {
                Some(_) if policy.mode == plan::Mode::FullRemediation => {
                    crate::validate::release_ladder(request, &shared.remediator.settings().ladder, chrono::Utc::now())
                }
                _ => return Ok(None),
            }
        }
    };
    if l.request.incident_id != request.incident_id {
        return Ok(None);
    }
    let waiting =
        |what: &str| crate::apply::Outcome::Skipped { reason: plan::Skip::Validating(what.to_owned()), would: None };
    match (&l.phase, &l.validation) {
        // No repair has been proven since the node failed its validation: it stays out.
        (ladder::Phase::Failed, _) if l.failed_validation => {
            return Ok(Some(crate::apply::Outcome::Skipped { reason: plan::Skip::ValidationFailed, would: None }));
        }
        (ladder::Phase::Failed, _) => return Ok(None),
        (ladder::Phase::Validating | ladder::Phase::BurnIn, Some(v)) => return Ok(Some(waiting(&v.describe()))),
        // The recovery is held already, since a validation failed: the driver validates the node
        // again once the escalated step is over (a repeat of the recovery must not start it
        // while that step's repair may still be under way).
        (ladder::Phase::Pending | ladder::Phase::Running, _) if l.held_recovery.is_some() => {
            return Ok(Some(waiting(&format!(
                "after repair step {}/{} {}",
                l.step_number(),
                l.steps.len(),
                l.step_name()
            ))));
        }
        _ => {}
    }
    let after = match release_from {
        Some(state) => format!("healthy evidence for a node in quarantine ({})", state.as_str()),
        None => format!("healthy evidence after repair step {}/{} {}", l.step_number(), l.steps.len(), l.step_name()),
    };
    let what = start_validation(shared, &node, &mut l, &settings, request, release_from, &after).await?;
    let written = write_ladder_if_unchanged(shared, &request.node, raw.as_deref(), &l)
        .await
        .map_err(|e| ApplyError::Validation(format!("cannot record the validation on node {}: {e}", request.node)))?;
    if !written {
        return Err(ApplyError::Validation(format!("the repair ladder of node {} changed meanwhile", request.node)));
    }
    shared.remediator.advance_state(&request.node, plan::State::Validating).await?;
    tracing::info!(node = %request.node, validation = %what, "Healthy evidence: validating the node before it returns to service.");
    Ok(Some(waiting(&what)))
}

/// Starts the validation of the node on the ladder `l` before `recovery` is carried out: the Job
/// or the custom resource is created (the webhook is asked at the driver's first look), the
/// ladder moves to [`ladder::Phase::Validating`] holding the recovery, and the outcome and the
/// `ValidationStarted` Event say so, naming `after` (what the healthy evidence follows). The
/// caller writes the ladder and moves the state label. Returns what runs the validation.
async fn start_validation(
    shared: &Shared,
    node: &k8s_openapi::api::core::v1::Node,
    l: &mut ladder::Ladder,
    settings: &crate::validate::Settings,
    recovery: &request::Remediation,
    release_from: Option<plan::State>,
    after: &str,
) -> Result<String, ApplyError> {
    let client = shared.remediator.client();
    let suffix = l.validation_suffix();
    let mut name = format!("{}{suffix}", crate::validate::job_name(&l.verdict_id, l.step_number()));
    let mut namespace = String::new();
    shared.remediator.leading(&recovery.node)?;
    match &settings.step {
        crate::validate::Step::Job(template) => {
            let job = crate::validate::render(template, recovery, &name, &settings.namespace);
            namespace = job["metadata"]["namespace"].as_str().unwrap_or_default().to_owned();
            crate::validate::create(&client, &job).await.map_err(ApplyError::Validation)?;
        }
        crate::validate::Step::Resource => {
            let hook = shared.hooks.resource.as_ref().ok_or_else(|| {
                ApplyError::Validation("--validation resource needs --repair-resource-template".to_owned())
            })?;
            hook.create_validation(l, &name)
                .await
                .map_err(|e| ApplyError::Validation(format!("cannot create the validation resource: {e}")))?;
        }
        // Asked at every look of the driver, the first one included.
        crate::validate::Step::Webhook => {
            name = format!("{}{suffix}", hooks::validation_key(&l.verdict_id, l.step_number()));
        }
    }
    let now = chrono::Utc::now();
    let timeout_seconds = settings.timeout.as_secs().max(1);
    let validation = crate::validate::Validation {
        kind: settings.step.kind(),
        namespace,
        job: name,
        recovery: recovery.clone(),
        since: now,
        timeout_seconds,
        burn_in_seconds: settings.burn_in.map_or(0, |b| b.as_secs().max(1)),
        release_from,
    };
    let what = validation.describe();
    l.validating(validation);
    l.validations_at_step += 1;
    l.held_recovery = None;
    let runs = match settings.step {
        crate::validate::Step::Job(_) => format!("{what} runs on the node"),
        _ => format!("the repair hooks validate the node ({what})"),
    };
    let detail = format!("validating: {after}; {runs} before it returns to service (timeout {timeout_seconds}s)");
    let outcome = validation_outcome(l, ActionStatus::Applied, detail.clone());
    publish(shared, &outcome, None).await.map_err(|e| ApplyError::Publish(e.to_string()))?;
    shared.remediator.record_event(node, "ValidationStarted", detail, false).await;
    Validation { result: "started" }.emit();
    Ok(what)
}

/// What the validation `v` of the ladder `l` says now: the Job's status with its pods'
/// termination messages, or the hooks' report. A Job or resource that is gone has failed; a hook
/// that cannot be reached is still running (the timeout decides).
async fn read_validation(
    shared: &Shared,
    l: &ladder::Ladder,
    v: &crate::validate::Validation,
) -> Result<crate::validate::Verdict, TermError> {
    use crate::validate::{Kind, Verdict};
    let client = shared.remediator.client();
    let gone = || Verdict::Failed(format!("the {} is gone", v.describe()));
    let unavailable = |e: &hooks::HookError| {
        tracing::warn!(node = %l.request.node, validation = %v.describe(), error = %e,
            "The validation hook cannot be asked now; asking again at the next look.");
        Verdict::Running
    };
    let missing =
        |flag: &str| Verdict::Failed(format!("the {} cannot be read: {flag} is not configured", v.describe()));
    let timeout = std::time::Duration::from_secs(v.timeout_seconds);
    Ok(match v.kind {
        Kind::Job => match crate::validate::read(&client, v).await? {
            Some(job) => {
                let verdict = crate::validate::verdict_of(&job);
                if verdict == Verdict::Running {
                    verdict
                } else {
                    // The summary without the pods is still worth publishing.
                    let pods = crate::validate::read_pods(&client, v).await.unwrap_or_else(|e| {
                        tracing::warn!(node = %l.request.node, job = %v.job, error = %e,
                            "Cannot read the validation Job's pods; its result goes without their messages.");
                        Vec::new()
                    });
                    crate::validate::with_pods(verdict, crate::validate::pod_summary(&pods))
                }
            }
            None => gone(),
        },
        Kind::Webhook => match &shared.hooks.webhook {
            Some(w) => match w.validate(l, &v.job, timeout).await {
                Ok((report, message)) => {
                    crate::validate::hook_verdict(&report, message.as_deref(), "the validation webhook")
                }
                Err(e @ hooks::HookError::Unavailable(_)) => unavailable(&e),
                Err(e) => Verdict::Failed(e.to_string()),
            },
            None => missing("--repair-webhook-url"),
        },
        Kind::Resource => match &shared.hooks.resource {
            Some(r) => match r.validation_report(l, &v.job).await {
                Ok(Some((report, message))) => {
                    crate::validate::hook_verdict(&report, message.as_deref(), "the validation resource")
                }
                Ok(None) => gone(),
                Err(e @ hooks::HookError::Unavailable(_)) => unavailable(&e),
                Err(e) => Verdict::Failed(e.to_string()),
            },
            None => missing("--repair-resource-template"),
        },
    })
}

/// One look at the validation of the ladder `l` on `node`: a validation that passed releases the
/// node (the held recovery is carried out and its outcome published), or starts its burn-in when
/// one is set; one that failed or ran past its timeout escalates the ladder; one still running
/// waits.
async fn drive_validation(
    shared: &Shared,
    node: &k8s_openapi::api::core::v1::Node,
    mut l: ladder::Ladder,
    raw: Option<&str>,
) -> Result<(), TermError> {
    let name = l.request.node.clone();
    let Some(v) = l.validation.clone() else {
        let now = chrono::Utc::now();
        l.validation_failed("the validation record is missing", now);
        write_ladder_if_unchanged(shared, &name, raw, &l).await?;
        return Ok(());
    };
    let result = read_validation(shared, &l, &v).await?;
    let now = chrono::Utc::now();
    let elapsed = (now - v.since).to_std().unwrap_or_default();
    let result = match result {
        crate::validate::Verdict::Running if elapsed.as_secs() >= v.timeout_seconds => {
            crate::validate::Verdict::Failed(format!(
                "the {} did not finish within {}s",
                v.describe(),
                v.timeout_seconds
            ))
        }
        other => other,
    };
    match result {
        crate::validate::Verdict::Running => Ok(()),
        crate::validate::Verdict::Passed(summary) => {
            let then = match v.burn_in_seconds {
                0 => "the node returns to service".to_owned(),
                secs => format!(
                    "the node stays out for a burn-in of {} and returns if no new fault arrives meanwhile",
                    hooks::human_seconds(secs)
                ),
            };
            let detail = format!("validation passed: {summary}; {then}");
            publish(shared, &validation_outcome(&l, ActionStatus::Applied, detail.clone()), None).await?;
            shared.remediator.record_event(node, "ValidationPassed", detail, false).await;
            Validation { result: "passed" }.emit();
            if v.burn_in_seconds > 0 {
                l.burning_in(now);
                if !write_ladder_if_unchanged(shared, &name, raw, &l).await? {
                    return Ok(());
                }
                shared.remediator.advance_state(&name, plan::State::BurnIn).await?;
                BurnIn { result: "started" }.emit();
                tracing::info!(node = %name, burn_in_seconds = v.burn_in_seconds,
                    "The validation passed: the node burns in before it returns.");
                return Ok(());
            }
            release(shared, &name, &v).await
        }
        crate::validate::Verdict::Failed(summary) => {
            let detail = format!("validation failed: {summary}");
            publish(shared, &validation_outcome(&l, ActionStatus::Failed, detail.clone()), None).await?;
            shared.remediator.record_event(node, "ValidationFailed", detail, true).await;
            ValidationFailed { node: &name, job: &v.job, summary: &summary }.emit();
            escalate_from_validation(shared, node, l, raw, &format!("validation failed: {summary}"), now).await
        }
    }
}

/// One look at the burn-in of the ladder `l` on `node`: over without a new fault (a new fault
/// escalates the ladder when its verdict arrives, [`interrupt_burn_in`]), the node returns. While
/// another incident keeps the node out (recorded in gpumedic's ownership record) the burn-in
/// waits, and it starts over once the last such incident has recovered.
async fn drive_burn_in(
    shared: &Shared,
    node: &k8s_openapi::api::core::v1::Node,
    mut l: ladder::Ladder,
    raw: Option<&str>,
) -> Result<(), TermError> {
    let name = l.request.node.clone();
    let now = chrono::Utc::now();
    let Some(v) = l.validation.clone() else {
        return escalate_from_validation(shared, node, l, raw, "the validation record is missing", now).await;
    };
    // Another incident that keeps the node out (a fault on another GPU) holds the burn-in: the
    // node does not pass while it has an open fault, and burns in for the whole period again
    // once the last such incident has recovered.
    let others = other_quarantining_incidents(node, &l.request.incident_id);
    if !others.is_empty() {
        if l.burn_in_held_for != others {
            tracing::info!(node = %name, incidents = %others.join(", "),
                "Other incidents keep the node out: its burn-in waits for them to recover.");
            l.burn_in_held_for = others;
            l.since = now;
            write_ladder_if_unchanged(shared, &name, raw, &l).await?;
        }
        return Ok(());
    }
    if !l.burn_in_held_for.is_empty() {
        let recovered = std::mem::take(&mut l.burn_in_held_for).join(", ");
        l.since = now;
        let detail = format!(
            "burn-in restarted: incident(s) {recovered} that kept the node out recovered; the node burns in for {} \
             from now before it returns",
            hooks::human_seconds(v.burn_in_seconds)
        );
        // The ladder first: when another look changed it meanwhile, that look reports, and
        // this one neither publishes nor records a restart of its own.
        if !write_ladder_if_unchanged(shared, &name, raw, &l).await? {
            return Ok(());
        }
        publish(shared, &validation_outcome(&l, ActionStatus::Applied, detail.clone()), None).await?;
        shared.remediator.record_event(node, "BurnInRestarted", detail, false).await;
        BurnIn { result: "restarted" }.emit();
        tracing::info!(node = %name, incidents = %recovered,
            "The incidents that held the burn-in recovered: the burn-in starts over.");
        return Ok(());
    }
    if !l.burn_in_over(now) {
        return Ok(());
    }
    let detail = format!(
        "burn-in completed: no new fault on the node for {} after the validation passed; the node returns to service",
        hooks::human_seconds(v.burn_in_seconds)
    );
    publish(shared, &validation_outcome(&l, ActionStatus::Applied, detail.clone()), None).await?;
    shared.remediator.record_event(node, "BurnInCompleted", detail, false).await;
    BurnIn { result: "completed" }.emit();
    release(shared, &name, &v).await
}

/// A new fault verdict (`request`, issued at `issued_at`) for a node in its burn-in: the burn-in
/// is interrupted and the ladder escalates, as a failed validation does (the outcome and a Warning
/// Event say which fault). A fault of another incident on another GPU
/// ([`ladder::Ladder::fault_elsewhere`]) is a new problem rather than a repair that did not hold:
/// the ladder stays at its step and the burn-in starts over and waits for that incident
/// ([`drive_burn_in`]). A verdict issued before the burn-in began (a replay) changes nothing; nor
/// does one for a node that is not burning in.
pub(crate) async fn interrupt_burn_in(
    shared: &Shared,
    request: &request::Remediation,
    issued_at: chrono::DateTime<chrono::Utc>,
) -> Result<(), ApplyError> {
    let nodes: kube::Api<k8s_openapi::api::core::v1::Node> = kube::Api::all(shared.remediator.client());
    let node = match nodes.get_opt(&request.node).await {
        Ok(Some(n)) => n,
        Ok(None) => return Ok(()),
        Err(source) => return Err(ApplyError::Read { node: request.node.clone(), source }),
    };
    let Some(Ok(l)) = ladder::ladder_on(&node) else { return Ok(()) };
    if l.phase != ladder::Phase::BurnIn || issued_at < l.since {
        return Ok(());
    }
    let raw = node.metadata.annotations.as_ref().and_then(|a| a.get(ladder::LADDER_ANNOTATION)).cloned();
    let now = chrono::Utc::now();
    let lasted = (now - l.since).to_std().unwrap_or_default().as_secs();
    let period = l.validation.as_ref().map_or(0, |v| v.burn_in_seconds);
    let why = format!(
        "a new fault during the burn-in, {} into {}: {} (verdict {}, incident {})",
        hooks::human_seconds(lasted),
        hooks::human_seconds(period),
        request.reason,
        request.verdict_id,
        request.incident_id
    );
    shared.remediator.leading(&request.node)?;
    if l.fault_elsewhere(request) {
        return hold_burn_in(shared, &node, l, raw.as_deref(), request, now).await;
    }
    let moved = async {
        let detail = format!("burn-in interrupted: {why}");
        publish(shared, &validation_outcome(&l, ActionStatus::Failed, detail.clone()), None).await?;
        shared.remediator.record_event(&node, "BurnInInterrupted", detail, true).await;
        BurnInInterrupted { node: &request.node, why: &why }.emit();
        escalate_from_validation(shared, &node, l, raw.as_deref(), &why, now).await
    };
    moved
        .await
        .map_err(|e| ApplyError::Validation(format!("cannot escalate the burn-in of node {}: {e}", request.node)))
}

/// A fault of another incident on another GPU (`fault`) arrived during the burn-in of the ladder
/// `l` on `node` at `now`: the ladder does not escalate (its repair is not in question), but the
/// burn-in's clock starts over and the burn-in waits for that incident to recover
/// ([`drive_burn_in`] reads it from the ownership record once the verdict has been carried out).
async fn hold_burn_in(
    shared: &Shared,
    node: &k8s_openapi::api::core::v1::Node,
    mut l: ladder::Ladder,
    raw: Option<&str>,
    fault: &request::Remediation,
    now: chrono::DateTime<chrono::Utc>,
) -> Result<(), ApplyError> {
    let gpu = fault.gpu.as_ref().map_or_else(String::new, |g| g.uuid.clone());
    let period = l.validation.as_ref().map_or(0, |v| v.burn_in_seconds);
    let detail = format!(
        "burn-in held: a fault on another GPU ({gpu}: {}, verdict {}, incident {}) is a new problem, not a sign that \
         repair step {}/{} {} did not hold; the ladder stays at that step, and the node stays out and burns in for {} \
         again once that incident has recovered",
        fault.reason,
        fault.verdict_id,
        fault.incident_id,
        l.step_number(),
        l.steps.len(),
        l.step_name(),
        hooks::human_seconds(period)
    );
    // The incident itself is recorded as holding the burn-in by the driver, from the ownership
    // record the verdict is about to be written to: recorded here first, a look in between would
    // take it for recovered.
    l.since = now;
    let held = async {
        publish(shared, &validation_outcome(&l, ActionStatus::Applied, detail.clone()), None).await?;
        shared.remediator.record_event(node, "BurnInHeld", detail, false).await;
        BurnIn { result: "held" }.emit();
        tracing::info!(node = %fault.node, incident = %fault.incident_id, gpu = %gpu,
            "A fault on another GPU during the burn-in: the burn-in waits for its incident to recover.");
        write_ladder_if_unchanged(shared, &fault.node, raw, &l).await
    };
    held.await
        .map(|_| ())
        .map_err(|e| ApplyError::Validation(format!("cannot hold the burn-in of node {}: {e}", fault.node)))
}

/// The open incidents other than `ours` that keep `node` out of scheduling, as gpumedic's
/// ownership record lists them (sorted); none when the record cannot be read.
fn other_quarantining_incidents(node: &k8s_openapi::api::core::v1::Node, ours: &str) -> Vec<String> {
    let view = plan::NodeView::from_node(node);
    let Ok(Some(applied)) = view.applied() else { return Vec::new() };
    applied.upgraded().incidents.into_iter().filter(|(id, c)| c.quarantines && id != ours).map(|(id, _)| id).collect()
}

/// The validation (or the burn-in after it) of the ladder `l` on `node` failed for `why` at `now`:
/// the ladder escalates from the step the node was on, as a failed repair step does, keeping the
/// recovery it held ([`ladder::Ladder::held_recovery`]) for the validation after the next step;
/// the state label follows (`remediating`, or `failed` on the last rung).
async fn escalate_from_validation(
    shared: &Shared,
    node: &k8s_openapi::api::core::v1::Node,
    mut l: ladder::Ladder,
    raw: Option<&str>,
    why: &str,
    now: chrono::DateTime<chrono::Utc>,
) -> Result<(), TermError> {
    let name = l.request.node.clone();
    l.failed_validation = true;
    // The recovery stays with the ladder: the classifier has closed the incident and sends no
    // other, so the next validation (once the escalated step is over) carries this one out.
    let held = l.validation.take();
    let release_from = held.as_ref().and_then(|v| v.release_from);
    l.held_recovery = held.map(|v| v.recovery);
    match release_from {
        // Validated before a release, with no repair behind it: a drained node starts its repair
        // ladder at the first rung; one that was only cordoned (work still on it) is not
        // repaired behind its workloads' backs: it stays out for an operator.
        Some(from) => {
            l.history.push(format!("validation before release: {why}"));
            l.since = now;
            let detail = if from == plan::State::Drained {
                l.phase = ladder::Phase::Pending;
                format!(
                    "validation before release failed ({why}); the node stays out and its repair ladder starts at {}",
                    l.step_name()
                )
            } else {
                l.phase = ladder::Phase::Failed;
                format!(
                    "validation before release failed ({why}); the node was not drained, so no repair starts: it \
                     stays out and an operator must act"
                )
            };
            publish(shared, &ladder_outcome(&l, ActionStatus::Failed, detail.clone()), None).await?;
            shared.remediator.record_event(node, "ReleaseRefused", detail.clone(), true).await;
            if l.phase == ladder::Phase::Failed {
                shared
                    .remediator
                    .restate_condition(&name, l.request.subsystem.condition_type(), "ValidationFailed", &detail)
                    .await?;
            }
        }
        None => {
            l.phase = ladder::Phase::Running;
            escalate(shared, node, &mut l, why, now).await?;
        }
    }
    if !write_ladder_if_unchanged(shared, &name, raw, &l).await? {
        return Ok(());
    }
    let state = if l.phase == ladder::Phase::Failed { plan::State::Failed } else { plan::State::Remediating };
    shared.remediator.advance_state(&name, state).await?;
    Ok(())
}

/// The validation `v` (and its burn-in, if any) passed: the ladder ends, then the held recovery is
/// carried out (the node returns) and its outcome published under the recovery verdict.
async fn release(shared: &Shared, name: &str, v: &crate::validate::Validation) -> Result<(), TermError> {
    carry_out(shared, name, &v.recovery).await?;
    tracing::info!(node = %name, validation = %v.describe(), "The validation passed: the node returned to service.");
    Ok(())
}

/// Ends the ladder on `name` and carries out its held `recovery` (what gpumedic applied goes),
/// publishing the recovery's outcome under its verdict.
async fn carry_out(shared: &Shared, name: &str, recovery: &request::Remediation) -> Result<(), TermError> {
    // The ladder ends before the recovery runs, so the driver cannot escalate a node that
    // is returning; the recovery then removes what gpumedic applied.
    end_ladder(shared, recovery).await?;
    let gpu_nodes = shared.fleet.count.load(std::sync::atomic::Ordering::Acquire);
    let released = shared.remediator.remediate(recovery, gpu_nodes).await.map_err(|e| e.to_string());
    shared.remediator.leading(name)?;
    crate::maintenance::clear_for(&shared.remediator.client(), name, &recovery.incident_id).await?;
    let verdict_id = uuid::Uuid::parse_str(&recovery.verdict_id).unwrap_or_default();
    let outcome =
        crate::verdicts::outcome_for(verdict_id, name, gpumedic_schemas::verdict::RecommendedAction::None, &released);
    publish(shared, &outcome, None).await?;
    Ok(())
}

/// A validation's outcome, under the verdict that started the ladder, as `run_diagnostics`.
fn validation_outcome(l: &ladder::Ladder, status: ActionStatus, detail: String) -> ActionOutcome {
    ActionOutcome {
        action: gpumedic_schemas::verdict::RecommendedAction::RunDiagnostics,
        ..ladder_outcome(l, status, detail)
    }
}

/// The outcome of a ladder step, under the verdict that started the ladder and naming the step's
/// action. The contract has no `in_progress` status: a started step is `applied`, a failed or
/// timed-out one `failed` (the detail says which, and what follows).
pub(crate) fn ladder_outcome(l: &ladder::Ladder, status: ActionStatus, detail: String) -> ActionOutcome {
    ActionOutcome {
        verdict_id: uuid::Uuid::parse_str(&l.verdict_id).unwrap_or_default(),
        node: l.request.node.clone(),
        action: ladder::recommended(l.step().action),
        status,
        detail,
        at: chrono::Utc::now(),
    }
}

/// While leading in full-remediation mode: every `--repair-check`, walks the ladders recorded on
/// the managed nodes one move each (call the hooks of a pending step, read a running step's
/// status, escalate on failure or timeout). Paused, nothing moves.
pub(crate) async fn drive_repairs(shared: Arc<Shared>, term: CancellationToken) -> Result<(), TermError> {
    use futures::StreamExt as _;
    loop {
        tokio::select! {
            () = term.cancelled() => return Ok(()),
            () = tokio::time::sleep(shared.repair_check) => {}
        }
        if shared.remediator.paused() {
            continue;
        }
        let nodes = match shared.fleet.carrying(ladder::LADDER_ANNOTATION).await {
            Ok(n) => n,
            Err(e) => {
                tracing::warn!(error = %e, "Cannot list the nodes on a repair ladder; trying again later.");
                continue;
            }
        };
        let moves = futures::stream::iter(nodes).for_each_concurrent(16, |node| {
            let shared = shared.clone();
            async move {
                if let Err(e) = drive_ladder(&shared, &node).await {
                    tracing::warn!(node = ?node.metadata.name, error = %e, "A repair ladder did not move; trying again at the next look.");
                }
            }
        });
        tokio::select! {
            () = term.cancelled() => return Ok(()),
            () = moves => {}
        }
    }
}

/// One move of the ladder on `node` (see [`ladder::Ladder::decide`]). The hooks are called, the
/// outcome published and the Event recorded before the new ladder is written: a crash in between
/// repeats the call under the same idempotency key, which the receiver deduplicates.
pub(crate) async fn drive_ladder(shared: &Shared, node: &k8s_openapi::api::core::v1::Node) -> Result<(), TermError> {
    let name = node.metadata.name.clone().unwrap_or_default();
    let raw = node.metadata.annotations.as_ref().and_then(|a| a.get(ladder::LADDER_ANNOTATION)).cloned();
    let mut l = match ladder::ladder_on(node) {
        Some(Ok(l)) => l,
        Some(Err(e)) => {
            LadderRefused { node: &name, error: &e }.emit();
            // Once per distinct annotation value, not at every look.
            let first = raw.as_ref().is_some_and(|r| {
                let mut seen = shared.refused_ladders.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
                if seen.len() > 10_000 {
                    seen.clear();
                }
                seen.insert((name.clone(), r.clone()))
            });
            if first {
                let why = format!("Ignoring the repair ladder in {}: {e}", ladder::LADDER_ANNOTATION);
                shared.remediator.record_event(node, "RepairLadderRefused", why, true).await;
            }
            return Ok(());
        }
        None => return Ok(()),
    };
    if !l.active() {
        return Ok(());
    }
    // Hooks reboot and replace machines: never called by a replica that cannot prove it leads.
    shared.remediator.leading(&name)?;
    match l.phase {
        ladder::Phase::Validating => return drive_validation(shared, node, l, raw.as_deref()).await,
        ladder::Phase::BurnIn => return drive_burn_in(shared, node, l, raw.as_deref()).await,
        _ => {}
    }
    let report =
        if l.phase == ladder::Phase::Running { shared.hooks.report(&l).await? } else { ladder::Report::Working };
    let now = chrono::Utc::now();
    let (number, total, step) = (l.step_number(), l.steps.len(), l.step());
    let what = format!("repair step {number}/{total} {}", l.step_name());
    match l.decide(now, &report) {
        ladder::Move::Wait | ladder::Move::Done => return Ok(()),
        ladder::Move::Start => match shared.hooks.start(&l).await {
            Ok(detail) => {
                let detail = format!("{what} handed to the repair hooks ({detail}); timeout {}s", step.timeout_seconds);
                publish(shared, &ladder_outcome(&l, ActionStatus::Applied, detail.clone()), None).await?;
                shared.remediator.record_event(node, "RepairStepStarted", detail, false).await;
                RepairStep { action: step.action.name(), result: "started" }.emit();
                l.started(now);
            }
            Err(hooks::HookError::Unavailable(why)) => {
                tracing::warn!(node = %name, step = %what, %why, "The repair hooks are unavailable; the step stays pending.");
                return Ok(());
            }
            Err(e) => escalate(shared, node, &mut l, &e.to_string(), now).await?,
        },
        ladder::Move::Succeed => {
            let detail = format!(
                "remediated: {what} succeeded (reported by the repair controller); the node returns to service on healthy evidence"
            );
            publish(shared, &ladder_outcome(&l, ActionStatus::Applied, detail.clone()), None).await?;
            shared.remediator.record_event(node, "RepairSucceeded", detail, false).await;
            RepairStep { action: step.action.name(), result: "succeeded" }.emit();
            metrics::counter!(names::REPAIR_LADDERS_TOTAL, "result" => "remediated").increment(1);
            l.succeeded(now);
        }
        ladder::Move::Escalate(why) => escalate(shared, node, &mut l, &why, now).await?,
        ladder::Move::Validate(why) => {
            let Some(recovery) = l.held_recovery.clone() else { return Ok(()) };
            if report == ladder::Report::Succeeded {
                RepairStep { action: step.action.name(), result: "succeeded" }.emit();
            }
            let Some(settings) = shared.remediator.settings().validation.clone() else {
                // A replica started without --validation carries the held recovery out as the
                // recovery verdict would have been without one.
                tracing::info!(node = %name, step = %what, "The repair step is over and no validation is configured: the held recovery is carried out.");
                return carry_out(shared, &name, &recovery).await;
            };
            let after = format!(
                "{what} is over ({why}) and the incident's healthy evidence is held from before it (recovery verdict {})",
                recovery.verdict_id
            );
            start_validation(shared, node, &mut l, &settings, &recovery, None, &after).await?;
        }
    }
    if !write_ladder_if_unchanged(shared, &name, raw.as_deref(), &l).await? {
        tracing::info!(node = %name, "The repair ladder changed meanwhile (a recovery?); leaving it.");
        return Ok(());
    }
    match l.phase {
        ladder::Phase::Succeeded => shared.remediator.advance_state(&name, plan::State::Remediated).await?,
        ladder::Phase::Failed => shared.remediator.advance_state(&name, plan::State::Failed).await?,
        ladder::Phase::Validating => shared.remediator.advance_state(&name, plan::State::Validating).await?,
        _ => {}
    }
    Ok(())
}

/// The current step of `l` failed for `why`: the outcome and the Event, and on the last rung the
/// ladder's failure (condition message too, for `kubectl describe node`).
pub(crate) async fn escalate(
    shared: &Shared,
    node: &k8s_openapi::api::core::v1::Node,
    l: &mut ladder::Ladder,
    why: &str,
    now: chrono::DateTime<chrono::Utc>,
) -> Result<(), TermError> {
    let (number, total, step) = (l.step_number(), l.steps.len(), l.step());
    let name = l.request.node.clone();
    RepairStep { action: step.action.name(), result: "failed" }.emit();
    if l.at_top() {
        l.escalate(why, now);
        let detail = format!(
            "repair failed: step {number}/{total} {} was the last ({why}); an operator must act. History: {}",
            l.step_name(),
            l.history.join("; ")
        );
        publish(shared, &ladder_outcome(l, ActionStatus::Failed, detail.clone()), None).await?;
        shared.remediator.record_event(node, "RepairFailed", detail.clone(), true).await;
        shared
            .remediator
            .restate_condition(&name, l.request.subsystem.condition_type(), "RepairFailed", &detail)
            .await?;
        LadderFailed { node: &name, verdict_id: &l.verdict_id, detail: &detail }.emit();
    } else {
        let next = l.steps[l.current + 1].action.name();
        let detail = format!("repair step {number}/{total} {} failed ({why}); escalating to {next}", l.step_name());
        publish(shared, &ladder_outcome(l, ActionStatus::Failed, detail.clone()), None).await?;
        shared.remediator.record_event(node, "RepairEscalated", detail, true).await;
        l.escalate(why, now);
    }
    Ok(())
}

/// Writes `l` on `name` if its ladder record still reads `before`, re-reading on conflicts (the
/// kubelet's status updates move the node's resourceVersion); false when the record changed.
pub(crate) async fn write_ladder_if_unchanged(
    shared: &Shared,
    name: &str,
    before: Option<&str>,
    l: &ladder::Ladder,
) -> Result<bool, TermError> {
    let client = shared.remediator.client();
    let nodes: kube::Api<k8s_openapi::api::core::v1::Node> = kube::Api::all(client.clone());
    for _ in 0..5 {
        let Some(node) = nodes.get_opt(name).await? else { return Ok(false) };
        let now = node.metadata.annotations.as_ref().and_then(|a| a.get(ladder::LADDER_ANNOTATION)).map(String::as_str);
        if now != before {
            return Ok(false);
        }
        match ladder::write(&client, name, Some(l), node.metadata.resource_version.as_deref()).await {
            Ok(()) => return Ok(true),
            Err(kube::Error::Api(s)) if s.is_conflict() => continue,
            Err(e) => return Err(e.into()),
        }
    }
    Err(TermError::LadderConflict { node: name.to_owned() })
}
