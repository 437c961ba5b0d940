//! Validation before return to service (full-remediation, `--validation job`): when the recovery
//! verdict of a node on a repair ladder arrives, the node is not released yet. A Kubernetes Job
//! from a template (by default `dcgmi diag -r 2`), pinned to the node and tolerating gpumedic's
//! taint, runs first; the node's state label reads `validating` meanwhile. A Job that succeeds
//! releases the node (the held recovery is carried out); one that fails, or does not finish within
//! `--validation-timeout`, escalates along the repair ladder, as a failed repair step does. Each
//! result is an outcome on `gpumedic.actions.v1` (action `run_diagnostics`), which the classifier
//! records in Postgres.
//!
//! The validation is a phase of the ladder ([`crate::ladder::Phase::Validating`]), recorded on the
//! Node with the held recovery ([`Validation`]), so a failover continues it and the resync leaves
//! it to the ladder's driver. The Job's name derives from the ladder's verdict and step, so a retry
//! or a new leader finds the Job instead of creating a second. Rendering and reading a Job are pure
//! and tested here; [`create`] and [`read`] are the edge.

use std::time::Duration;

use chrono::{DateTime, Utc};
use k8s_openapi::api::batch::v1::Job;
use kube::api::{Api, PostParams};
use serde::{Deserialize, Serialize};
use serde_json::{Value, json};

use crate::plan::TAINT_KEY;
use crate::request::Remediation;

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

/// How nodes are validated before they return to service.
#[derive(Debug, Clone, PartialEq)]
pub struct Settings {
    /// The Job template (YAML parsed to JSON), with `{{...}}` placeholders in its strings.
    pub template: Value,
    /// Where the Jobs are created (the template's namespace wins).
    pub namespace: String,
    /// How long a Job may take before the validation counts as failed.
    pub timeout: Duration,
}

/// A validation under way, recorded on the node's ladder.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Validation {
    /// The Job's namespace.
    pub namespace: String,
    /// The Job's name.
    pub job: String,
    /// The recovery held until the Job passes.
    pub recovery: Remediation,
    /// When the Job was created.
    pub since: DateTime<Utc>,
    /// How long it may take, in seconds.
    pub timeout_seconds: u64,
}

/// What a validation Job says.
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
}
