//! Validation before return to service (full-remediation, `--validation job|webhook|resource`):
//! when the recovery verdict of a node on a repair ladder arrives, the node is not released yet.
//! A validation step runs first, one of three [`Step`]s: a Kubernetes Job from a template (by
//! default `dcgmi diag -r 2`), pinned to the node and tolerating gpumedic's taint; or the repair
//! hooks asked for the action `validate` (the signed webhook, polled under one idempotency key,
//! or a custom resource whose phase reports). The node's state label reads `validating`
//! meanwhile. A step that passes releases the node (the held recovery is carried out); one that
//! fails, or does not finish within `--validation-timeout`, escalates along the repair ladder, as
//! a failed repair step does. Each result is an outcome on `gpumedic.actions.v1` (action
//! `run_diagnostics`) with a short summary (a Job's conditions and its pod's termination message,
//! a hook's status message), which the classifier records in Postgres.
//!
//! The validation is a phase of the ladder ([`crate::ladder::Phase::Validating`]), recorded on the
//! Node with the held recovery ([`Validation`]), so a failover continues it and the resync leaves
//! it to the ladder's driver. The Job's name derives from the ladder's verdict and step (and, for a
//! second validation at the same step, its count: [`crate::ladder::Ladder::validation_suffix`]), so
//! a retry or a new leader finds the Job instead of creating a second. Rendering and reading a Job are pure
//! and tested here; [`create`] and [`read`] are the edge.

use std::time::Duration;

use chrono::{DateTime, Utc};
use k8s_openapi::api::batch::v1::Job;
use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, ListParams, PostParams};
use serde::{Deserialize, Serialize};
use serde_json::{Value, json};

use crate::ladder::{Ladder, Report, StepSpec};
use crate::plan::{NodeView, State, TAINT_KEY};
use crate::request::{Action, Remediation};

/// The default validation Job: DCGM's level-2 diagnostic on the node, pinned there by name (the
/// scheduler, and so the cordon, are bypassed), tolerating gpumedic's taint of any effect.
pub const DEFAULT_TEMPLATE: &str = r#"
apiVersion: batch/v1
kind: Job
spec:
  backoffLimit: 0
  template:
    spec:
      restartPolicy: Never
      nodeName: "{{node}}"
      tolerations:
        - key: gpumedic.io/unhealthy
          operator: Exists
      containers:
        - name: dcgm-diag
          image: nvcr.io/nvidia/cloud-native/dcgm:4.2.3-1-ubuntu22.04
          command: ["dcgmi", "diag", "-r", "2"]
"#;

/// The label on every validation Job, naming the node.
pub const NODE_LABEL: &str = "gpumedic.io/node";

/// What runs the validation.
#[derive(Debug, Clone, PartialEq)]
pub enum Step {
    /// A Job from this template (YAML parsed to JSON), with `{{...}}` placeholders in its strings.
    Job(Value),
    /// The repair webhook, asked for [`crate::hooks::VALIDATE_ACTION`] at every look.
    Webhook,
    /// The repair custom resource, created for [`crate::hooks::VALIDATE_ACTION`].
    Resource,
}

impl Step {
    /// The kind recorded with a validation of this step.
    pub fn kind(&self) -> Kind {
        match self {
            Step::Job(_) => Kind::Job,
            Step::Webhook => Kind::Webhook,
            Step::Resource => Kind::Resource,
        }
    }
}

/// How nodes are validated before they return to service.
#[derive(Debug, Clone, PartialEq)]
pub struct Settings {
    /// What runs the validation.
    pub step: Step,
    /// Where the Jobs are created (the template's namespace wins).
    pub namespace: String,
    /// How long a validation may take before it counts as failed.
    pub timeout: Duration,
    /// After a validation passes, how long the node stays out without a new fault before it
    /// returns (`--validation-burn-in`); `None`: it returns at once.
    pub burn_in: Option<Duration>,
}

/// The kind of a validation under way (records written before the hooks could validate are Jobs).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Kind {
    /// A Job.
    #[default]
    Job,
    /// The repair webhook.
    Webhook,
    /// The repair custom resource.
    Resource,
}

/// A validation under way, recorded on the node's ladder.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Validation {
    /// What runs it.
    #[serde(default)]
    pub kind: Kind,
    /// The Job's namespace (a Job only).
    pub namespace: String,
    /// The Job's or the resource's name, or the webhook's idempotency key.
    pub job: String,
    /// The recovery held until the Job passes.
    pub recovery: Remediation,
    /// When the Job was created.
    pub since: DateTime<Utc>,
    /// How long it may take, in seconds.
    pub timeout_seconds: u64,
    /// The burn-in after it passes, in seconds (0: none), fixed when it starts.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub burn_in_seconds: u64,
    /// For a validation before a release from quarantine (no repair ladder behind it): the state
    /// the node was released from; `None` after a repair.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub release_from: Option<State>,
}

fn is_zero(n: &u64) -> bool {
    *n == 0
}

impl Validation {
    /// What runs it, for Events and outcomes: `Job ns/name`, `webhook call <key>`, `resource name`.
    pub fn describe(&self) -> String {
        match self.kind {
            Kind::Job => format!("Job {}/{}", self.namespace, self.job),
            Kind::Webhook => format!("webhook call {}", self.job),
            Kind::Resource => format!("resource {}", self.job),
        }
    }
}

/// What a validation says.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Verdict {
    /// Not finished.
    Running,
    /// It succeeded, with a summary for the outcome.
    Passed(String),
    /// It failed, with a summary for the outcome.
    Failed(String),
}

/// The Job's name for the validation after step `step` of the ladder of verdict `verdict_id`.
pub fn job_name(verdict_id: &str, step: usize) -> String {
    let id: String = verdict_id.chars().filter(char::is_ascii_alphanumeric).take(36).collect();
    format!("gpumedic-validate-{}-{step}", id.to_ascii_lowercase())
}

/// Renders `template` for the validation of `recovery`'s node: every `{{key}}` in its strings is
/// replaced (`node`, `gpu_uuid`, `incident_id`, `verdict_id`, `name`), working on parsed values so
/// a value cannot change the document's shape; then the name, namespace (unless the template sets
/// one) and gpumedic's node label are set.
pub fn render(template: &Value, recovery: &Remediation, name: &str, namespace: &str) -> Value {
    let vars = [
        ("node", recovery.node.clone()),
        ("gpu_uuid", recovery.gpu.as_ref().map(|g| g.uuid.clone()).unwrap_or_default()),
        ("incident_id", recovery.incident_id.clone()),
        ("verdict_id", recovery.verdict_id.clone()),
        ("name", name.to_owned()),
    ];
    let mut job = template.clone();
    crate::hooks::fill_template(&mut job, &vars);
    if !job["metadata"].is_object() {
        job["metadata"] = json!({});
    }
    job["metadata"]["name"] = json!(name);
    if job["metadata"]["namespace"].as_str().is_none_or(str::is_empty) {
        job["metadata"]["namespace"] = json!(namespace);
    }
    if !job["metadata"]["labels"].is_object() {
        job["metadata"]["labels"] = json!({});
    }
    job["metadata"]["labels"][NODE_LABEL] = json!(recovery.node);
    job
}

/// Checks a template: a `batch/v1` Job whose pod tolerates gpumedic's taint (else the kubelet
/// refuses it on a node with the `NoExecute` taint, and a `NoSchedule` one keeps it from ever
/// being placed when the template names no node).
pub fn check_template(template: &Value) -> Result<(), String> {
    if template["apiVersion"] != "batch/v1" || template["kind"] != "Job" {
        return Err("the validation template must be a batch/v1 Job".to_owned());
    }
    let tolerations = template["spec"]["template"]["spec"]["tolerations"].as_array();
    let tolerates = tolerations.is_some_and(|ts| {
        ts.iter().any(|t| t["operator"] == "Exists" && (t["key"].is_null() || t["key"] == TAINT_KEY))
    });
    if !tolerates {
        return Err(format!("the validation Job's pod must tolerate {TAINT_KEY} (operator: Exists)"));
    }
    Ok(())
}

/// What `job` says: passed when it completed (a `Complete` condition, or a succeeded pod), failed
/// when it failed (a `Failed` condition, or a failed pod), else still running. The summary names
/// the condition's reason and message.
pub fn verdict_of(job: &Job) -> Verdict {
    let Some(status) = &job.status else { return Verdict::Running };
    let condition = |type_: &str| {
        status.conditions.iter().flatten().find(|c| c.type_ == type_ && c.status == "True").map(|c| {
            let reason = c.reason.clone().unwrap_or_default();
            let message = c.message.clone().unwrap_or_default();
            [reason, message].into_iter().filter(|s| !s.is_empty()).collect::<Vec<_>>().join(": ")
        })
    };
    let counts = format!("{} succeeded, {} failed", status.succeeded.unwrap_or(0), status.failed.unwrap_or(0));
    if let Some(why) = condition("Failed") {
        return Verdict::Failed(format!("the Job failed ({why}; {counts})"));
    }
    if let Some(why) = condition("Complete") {
        return Verdict::Passed(format!("the Job completed ({why}; {counts})"));
    }
    if status.failed.unwrap_or(0) > 0 {
        return Verdict::Failed(format!("a pod of the Job failed ({counts})"));
    }
    if status.succeeded.unwrap_or(0) > 0 {
        return Verdict::Passed(format!("a pod of the Job succeeded ({counts})"));
    }
    Verdict::Running
}

/// Whether `recovery` would return `node` to service from a whole-node quarantine that no repair
/// ran on (full-remediation validates such releases too): the state it would release the node
/// from (`quarantined`, `draining`, `drained`). `None` when another open incident keeps the node
/// out, the recovery's incident did not take it out, an operator has uncordoned it already, or the
/// node is past those states (a repair ladder's own).
pub fn release_from(node: &NodeView, recovery: &Remediation) -> Option<State> {
    let state = node.state().filter(|s| matches!(s, State::Quarantined | State::Draining | State::Drained))?;
    let record = node.applied().ok().flatten()?;
    let holds = record.incidents.get(&recovery.incident_id).is_some_and(|c| c.quarantines);
    let others = record.incidents.iter().any(|(id, c)| *id != recovery.incident_id && c.quarantines);
    (holds && !others && !record.operator_uncordoned).then_some(state)
}

/// The ladder that records a validation before `recovery` releases its node from quarantine, at
/// `now`: named by the recovery verdict, over the configured `steps` from the first rung, so a
/// failed validation starts the repairs there. Its request reads as the failed validation would
/// be reported to the repair hooks.
pub fn release_ladder(recovery: &Remediation, steps: &[StepSpec], now: DateTime<Utc>) -> Ladder {
    let first = steps.first().map_or(Action::RebootNode, |s| s.action);
    let fault = Remediation {
        action: first,
        recovery: false,
        reissue: false,
        reason: "ValidationFailed".to_owned(),
        message: format!(
            "the node failed its validation before release from quarantine (recovery verdict {})",
            recovery.verdict_id
        ),
        ..recovery.clone()
    };
    Ladder::new(&recovery.verdict_id, crate::ladder::recommended(first), &fault, steps, now)
}

/// The label the Job controller puts on a Job's pods, naming the Job.
pub const JOB_NAME_LABEL: &str = "batch.kubernetes.io/job-name";

/// The longest termination message carried into an outcome, in characters.
pub const MAX_MESSAGE_CHARS: usize = 512;

/// What the Job's pods say when they ended (`pods` as listed by [`JOB_NAME_LABEL`]): for each
/// terminated container, its exit code and reason, and the termination message the kubelet wrote
/// (the container's `/dev/termination-log`, or its log's tail with
/// `terminationMessagePolicy: FallbackToLogsOnError`), cut to [`MAX_MESSAGE_CHARS`]. `None` when
/// no container has ended.
pub fn pod_summary(pods: &[Pod]) -> Option<String> {
    let mut pods: Vec<&Pod> = pods.iter().collect();
    pods.sort_by(|a, b| a.metadata.name.cmp(&b.metadata.name));
    let parts: Vec<String> = pods
        .iter()
        .flat_map(|pod| {
            let name = pod.metadata.name.clone().unwrap_or_default();
            pod.status.iter().flat_map(|s| s.container_statuses.iter().flatten()).filter_map(move |c| {
                let ended = c.state.as_ref().and_then(|s| s.terminated.as_ref())?;
                let reason = ended.reason.as_deref().map(|r| format!(" ({r})")).unwrap_or_default();
                let message = ended
                    .message
                    .as_deref()
                    .map(str::trim)
                    .filter(|m| !m.is_empty())
                    .map(|m| format!(": {}", cut(m, MAX_MESSAGE_CHARS)))
                    .unwrap_or_default();
                Some(format!("pod {name} container {} exited {}{reason}{message}", c.name, ended.exit_code))
            })
        })
        .collect();
    (!parts.is_empty()).then(|| parts.join("; "))
}

/// `text` cut to `max` characters, with an ellipsis when cut.
fn cut(text: &str, max: usize) -> String {
    if text.chars().count() <= max {
        return text.to_owned();
    }
    let mut cut: String = text.chars().take(max).collect();
    cut.push('…');
    cut
}

/// `verdict` with the pods' summary ([`pod_summary`]) added to its own.
pub fn with_pods(verdict: Verdict, pods: Option<String>) -> Verdict {
    let Some(pods) = pods else { return verdict };
    match verdict {
        Verdict::Passed(s) => Verdict::Passed(format!("{s}; {pods}")),
        Verdict::Failed(s) => Verdict::Failed(format!("{s}; {pods}")),
        Verdict::Running => Verdict::Running,
    }
}

/// What a hook's report about a validation (`--validation webhook` or `resource`) says, with the
/// message it reported beside a success; `what` names the hook for the summary.
pub fn hook_verdict(report: &Report, message: Option<&str>, what: &str) -> Verdict {
    match report {
        Report::Working | Report::Silent => Verdict::Running,
        Report::Succeeded => Verdict::Passed(match message {
            Some(m) => format!("{what} reported Succeeded: {m}"),
            None => format!("{what} reported Succeeded"),
        }),
        Report::Failed(why) => Verdict::Failed(why.clone()),
    }
}

/// The pods of the validation Job `v` (the Job controller labels them with [`JOB_NAME_LABEL`]).
pub async fn read_pods(client: &kube::Client, v: &Validation) -> Result<Vec<Pod>, kube::Error> {
    let pods: Api<Pod> = Api::namespaced(client.clone(), &v.namespace);
    Ok(pods.list(&ListParams::default().labels(&format!("{JOB_NAME_LABEL}={}", v.job))).await?.items)
}

/// Creates the validation Job; one that exists already (a retry, a new leader) is fine.
pub async fn create(client: &kube::Client, job: &Value) -> Result<(), String> {
    let namespace = job["metadata"]["namespace"].as_str().unwrap_or_default();
    let name = job["metadata"]["name"].as_str().unwrap_or_default();
    let jobs: Api<Job> = Api::namespaced(client.clone(), namespace);
    let object: Job = serde_json::from_value(job.clone()).map_err(|e| format!("the rendered validation Job: {e}"))?;
    match jobs.create(&PostParams::default(), &object).await {
        Ok(_) => Ok(()),
        Err(kube::Error::Api(s)) if s.is_already_exists() => Ok(()),
        Err(e) => Err(format!("cannot create the validation Job {namespace}/{name}: {e}")),
    }
}

/// Reads the validation Job; `None` when it is gone.
pub async fn read(client: &kube::Client, v: &Validation) -> Result<Option<Job>, kube::Error> {
    Api::<Job>::namespaced(client.clone(), &v.namespace).get_opt(&v.job).await
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::request::{Action, GpuRef, Subsystem};

    fn recovery() -> Remediation {
        Remediation {
            node: "gpu-1".into(),
            gpu: Some(GpuRef { uuid: "GPU-abc".into(), pci_bus_id: String::new(), index: Some(0) }),
            action: Action::None,
            subsystem: Subsystem::Gpu,
            reason: "Xid79".into(),
            message: "healthy".into(),
            verdict_id: "v2".into(),
            incident_id: "i1".into(),
            recovery: true,
            reissue: false,
            custom: None,
        }
    }

    fn template() -> Value {
        serde_yaml::from_str(DEFAULT_TEMPLATE).expect("the default template parses")
    }

    #[test]
    fn the_default_job_is_pinned_tolerates_the_taint_and_runs_the_level_2_diagnostic() {
        check_template(&template()).expect("the default template is valid");
        let job = render(&template(), &recovery(), &job_name("7B2C-7a4e", 1), "gpumedic");
        assert_eq!(job["metadata"]["name"], "gpumedic-validate-7b2c7a4e-1");
        assert_eq!(job["metadata"]["namespace"], "gpumedic");
        assert_eq!(job["metadata"]["labels"][NODE_LABEL], "gpu-1");
        let pod = &job["spec"]["template"]["spec"];
        assert_eq!(pod["nodeName"], "gpu-1");
        assert_eq!(pod["tolerations"][0]["key"], TAINT_KEY);
        assert_eq!(pod["containers"][0]["command"], json!(["dcgmi", "diag", "-r", "2"]));
        let _: Job = serde_json::from_value(job).expect("a Job");
    }

    #[test]
    fn templates_that_are_not_jobs_or_do_not_tolerate_the_taint_are_refused() {
        let mut t = template();
        t["kind"] = json!("Pod");
        assert!(check_template(&t).is_err());
        let mut t = template();
        t["spec"]["template"]["spec"]["tolerations"] = json!([{ "key": "other", "operator": "Exists" }]);
        assert!(check_template(&t).unwrap_err().contains(TAINT_KEY));
    }

    #[test]
    fn a_job_reads_as_passed_failed_or_running() {
        let job = |status: Value| -> Job { serde_json::from_value(json!({ "status": status })).unwrap() };
        assert_eq!(verdict_of(&job(json!({}))), Verdict::Running);
        assert_eq!(verdict_of(&job(json!({ "active": 1 }))), Verdict::Running);
        let passed = verdict_of(&job(json!({ "succeeded": 1,
            "conditions": [{ "type": "Complete", "status": "True", "reason": "CompletionsReached" }] })));
        assert!(matches!(&passed, Verdict::Passed(s) if s.contains("CompletionsReached")), "{passed:?}");
        let failed = verdict_of(&job(json!({ "failed": 1,
            "conditions": [{ "type": "Failed", "status": "True", "reason": "BackoffLimitExceeded", "message": "diag level 2 failed" }] })));
        assert!(matches!(&failed, Verdict::Failed(s) if s.contains("diag level 2 failed")), "{failed:?}");
        assert!(matches!(verdict_of(&job(json!({ "failed": 1 }))), Verdict::Failed(_)));
    }

    fn pod(name: &str, terminated: Value) -> Pod {
        serde_json::from_value(json!({ "metadata": { "name": name }, "status": { "containerStatuses": [
            { "name": "dcgm-diag", "image": "dcgm", "imageID": "", "ready": false, "restartCount": 0,
              "state": terminated }] } }))
        .unwrap()
    }

    #[test]
    fn the_pods_termination_message_joins_the_jobs_summary() {
        let failed = pod(
            "v-1-abc",
            json!({ "terminated": { "exitCode": 226, "reason": "Error",
                "message": "  Diagnostic: PCIe bandwidth FAIL on GPU 0\n" } }),
        );
        let running = pod("v-1-def", json!({ "running": {} }));
        let summary = pod_summary(&[running.clone(), failed]).expect("a summary");
        assert_eq!(
            summary,
            "pod v-1-abc container dcgm-diag exited 226 (Error): Diagnostic: PCIe bandwidth FAIL on GPU 0"
        );
        assert_eq!(pod_summary(&[running]), None, "no container ended");
        let quiet = pod("v-1-ghi", json!({ "terminated": { "exitCode": 0 } }));
        assert_eq!(pod_summary(&[quiet]).as_deref(), Some("pod v-1-ghi container dcgm-diag exited 0"));
        let long = pod("v-1-jkl", json!({ "terminated": { "exitCode": 1, "message": "x".repeat(4096) } }));
        let cut = pod_summary(&[long]).unwrap();
        assert!(cut.chars().count() < MAX_MESSAGE_CHARS + 60 && cut.ends_with('…'), "{cut}");

        let verdict = with_pods(Verdict::Failed("the Job failed (BackoffLimitExceeded)".into()), Some(summary));
        assert!(
            matches!(&verdict, Verdict::Failed(s) if s.contains("(BackoffLimitExceeded); pod v-1-abc")),
            "{verdict:?}"
        );
        assert_eq!(with_pods(Verdict::Running, Some("x".into())), Verdict::Running);
    }

    /// A node gpumedic took out for `incidents` (id, quarantines), in `state`.
    fn quarantined(state: &str, incidents: &[(&str, bool)], uncordoned: bool) -> NodeView {
        use crate::plan::{APPLIED_ANNOTATION, STATE_LABEL};
        let claims: serde_json::Map<String, Value> = incidents
            .iter()
            .map(|(id, q)| ((*id).to_owned(), json!({ "quarantines": q, "condition": "GpuUnhealthy" })))
            .collect();
        let first = incidents[0].0;
        let record = json!({ "incidentId": first, "cordoned": true, "labels": [STATE_LABEL],
            "operatorUncordoned": uncordoned, "incidents": claims });
        let node: k8s_openapi::api::core::v1::Node = serde_json::from_value(json!({ "metadata": { "name": "gpu-1",
            "labels": { STATE_LABEL: state },
            "annotations": { APPLIED_ANNOTATION: record.to_string() } } }))
        .unwrap();
        NodeView::from_node(&node)
    }

    #[test]
    fn only_a_release_from_a_whole_node_quarantine_of_this_incident_alone_is_validated() {
        let r = recovery();
        assert_eq!(release_from(&quarantined("drained", &[("i1", true)], false), &r), Some(State::Drained));
        assert_eq!(release_from(&quarantined("quarantined", &[("i1", true)], false), &r), Some(State::Quarantined));
        assert_eq!(
            release_from(&quarantined("drained", &[("i1", true), ("i2", true)], false), &r),
            None,
            "i2 holds it"
        );
        assert_eq!(
            release_from(&quarantined("drained", &[("i1", true), ("i2", false)], false), &r),
            Some(State::Drained),
            "a marking incident does not keep it out"
        );
        assert_eq!(release_from(&quarantined("drained", &[("i2", true)], false), &r), None, "another's quarantine");
        assert_eq!(release_from(&quarantined("drained", &[("i1", false)], false), &r), None, "marked only");
        assert_eq!(release_from(&quarantined("drained", &[("i1", true)], true), &r), None, "uncordoned by hand");
        assert_eq!(release_from(&quarantined("remediating", &[("i1", true)], false), &r), None, "a ladder's");

        let steps = crate::ladder::parse_steps("reset_gpu,reboot_node", Duration::from_secs(60)).unwrap();
        let l = release_ladder(&r, &steps, Utc::now());
        assert_eq!((l.verdict_id.as_str(), l.step_name(), l.steps.len()), ("v2", "reset_gpu".to_owned(), 2));
        assert!(!l.request.recovery && l.request.incident_id == "i1");
    }

    #[test]
    fn a_hooks_report_reads_as_a_validation_verdict() {
        assert_eq!(hook_verdict(&Report::Working, Some("diag 40%"), "the webhook"), Verdict::Running);
        assert_eq!(
            hook_verdict(&Report::Succeeded, Some("diag level 2 passed"), "the webhook"),
            Verdict::Passed("the webhook reported Succeeded: diag level 2 passed".into())
        );
        assert_eq!(
            hook_verdict(&Report::Failed("it reported Failed: NVLink".into()), None, "x"),
            Verdict::Failed("it reported Failed: NVLink".into())
        );
        let v = Validation {
            kind: Kind::Webhook,
            namespace: String::new(),
            job: "v2:1:validate".into(),
            recovery: recovery(),
            since: Utc::now(),
            timeout_seconds: 60,
            burn_in_seconds: 0,
            release_from: None,
        };
        assert_eq!(v.describe(), "webhook call v2:1:validate");
        let old: Value = json!({ "namespace": "gpumedic", "job": "gpumedic-validate-v2-1", "recovery": recovery(),
            "since": "2026-12-01T00:00:00Z", "timeoutSeconds": 60 });
        let old: Validation = serde_json::from_value(old).expect("a record written before the hooks validated");
        assert_eq!((old.kind, old.describe()), (Kind::Job, "Job gpumedic/gpumedic-validate-v2-1".to_owned()));
    }
}
