//! The Kubernetes edge: reads a node, asks the planner, writes the plan, records an Event per
//! action, and drains. Everything it decides comes from [`crate::plan`] and [`crate::safety`].
//!
//! Writes are shaped so gpumedic never clobbers what others own:
//! - labels, annotations, taints and cordon go in one JSON merge patch that carries the node's
//!   `resourceVersion`, so the ownership annotation lands atomically with the changes it
//!   records, and a concurrent change (someone else's taint) makes the write fail with 409
//!   instead of being overwritten; the edge then reads the node again and plans afresh;
//! - conditions go through the status subresource as a strategic merge patch, which merges the
//!   condition list by `type`, so only gpumedic's condition changes.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use chrono::{SecondsFormat, Utc};
use k8s_openapi::api::core::v1::{Event, Node};
use kube::api::{Api, ListParams, Patch, PatchParams, PostParams};
use serde_json::{Map, Value, json};

use crate::dra::{self, DraCache, DraError, Ensured};
use crate::drain::{DrainError, DrainPolicy, DrainReport, drain, drain_holders};
use crate::events::{
    Drained, GpuQuarantineEscalated, GpuQuarantined, GpusReleased, InternalEvent as _, LadderStarted,
    WriteRefusedNotLeading,
};
use crate::fleet::NodeCache;
use crate::ladder::{Ladder, StepSpec};
use crate::lease::Validity;
use crate::plan::{
    APPLIED_ANNOTATION, Admission, Decision, DrainScope, Intent, Mode, NodeView, Note, OPT_OUT_LABEL, Plan, Policy,
    Skip, State, advance, plan,
};
use crate::request::{Action, Remediation};
use crate::safety::Gate;

/// How many times a write that lost a race (409) is re-planned before giving up.
const CONFLICT_ATTEMPTS: usize = 5;

/// What went wrong applying a remediation.
#[derive(Debug, thiserror::Error)]
pub enum ApplyError {
    /// The node does not exist.
    #[error("node {node} does not exist")]
    NodeNotFound {
        /// The node.
        node: String,
    },
    /// The node could not be read.
    #[error("cannot read node {node}: {source}")]
    Read {
        /// The node.
        node: String,
        /// The API error.
        #[source]
        source: kube::Error,
    },
    /// The node's metadata or spec could not be patched.
    #[error("cannot patch node {node}: {source}")]
    Patch {
        /// The node.
        node: String,
        /// The API error.
        #[source]
        source: kube::Error,
    },
    /// The node's conditions could not be patched.
    #[error("cannot patch the status of node {node}: {source}")]
    Status {
        /// The node.
        node: String,
        /// The API error.
        #[source]
        source: kube::Error,
    },
    /// Every attempt lost a race with another writer.
    #[error("node {node} changed under every one of {attempts} attempts to write it")]
    Conflict {
        /// The node.
        node: String,
        /// How many attempts were made.
        attempts: usize,
    },
    /// The Kubernetes client could not be built from its configuration.
    #[error("cannot build the Kubernetes client: {0}")]
    Client(#[source] kube::Error),
    /// The drain could not start.
    #[error(transparent)]
    Drain(#[from] DrainError),
    /// A DRA object (ResourceSlice, ResourceClaim, DeviceTaintRule) could not be read or written.
    #[error(transparent)]
    Dra(#[from] DraError),
    /// An outcome owed before going on (a repair ladder's end) could not be published.
    #[error("cannot publish an action outcome: {0}")]
    Publish(String),
    /// The validation step (its Job, its custom resource) could not be started.
    #[error("{0}")]
    Validation(String),
    /// This replica can no longer prove it holds the leader lease, so it writes nothing.
    #[error("not writing to node {node}: this replica can no longer prove it holds the leader lease")]
    NotLeading {
        /// The node.
        node: String,
    },
}

/// The edge's settings.
#[derive(Debug, Clone)]
pub struct Settings {
    /// Mode, pause, partial drain, taint effect.
    pub policy: Policy,
    /// How drains go.
    pub drain: DrainPolicy,
    /// The namespace Events about nodes are written to (nodes are cluster-scoped; the kubelet
    /// uses `default`, and `kubectl describe node` finds them there).
    pub event_namespace: String,
    /// `source.component` and `reportingComponent` of the Events.
    pub component: String,
    /// The escalation ladder repairs walk after the drain (full-remediation mode).
    pub ladder: Vec<StepSpec>,
    /// How long a custom action run through the repair hooks may take.
    pub custom_timeout: std::time::Duration,
    /// How a repaired node is validated before it returns (`--validation`); `None`: it
    /// returns on its recovery verdict.
    pub validation: Option<crate::validate::Settings>,
    /// GPU-level quarantine in DRA clusters.
    pub gpu_quarantine: dra::GpuQuarantine,
}

impl Default for Settings {
    fn default() -> Self {
        Self {
            policy: Policy::default(),
            drain: DrainPolicy::default(),
            event_namespace: "default".to_owned(),
            component: "gpumedic-remediator".to_owned(),
            ladder: crate::ladder::parse_steps(crate::ladder::DEFAULT_LADDER, std::time::Duration::from_secs(1800))
                .expect("the default ladder parses"),
            custom_timeout: std::time::Duration::from_secs(7200),
            validation: None,
            gpu_quarantine: dra::GpuQuarantine::default(),
        }
    }
}

/// What a remediation came to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    /// The plan was written; the drain report when it drained.
    Applied {
        /// What was changed.
        plan: Box<Plan>,
        /// The drain, when the plan drained.
        drain: Option<DrainReport>,
    },
    /// The node already reflected the request.
    AlreadyDone,
    /// Nothing was changed, and why.
    Skipped {
        /// Why.
        reason: Skip,
        /// What would have been done.
        would: Option<Box<Plan>>,
    },
}

/// Applies remediations to nodes through the Kubernetes API, under one safety gate.
#[derive(Clone)]
pub struct Remediator {
    client: kube::Client,
    /// The same credentials without kube's built-in retry of 429: it would retry a refused
    /// eviction up to 15 times with backoff growing to minutes, blind to the drain's deadline,
    /// so the drain retries PodDisruptionBudget refusals itself.
    evictions: kube::Client,
    settings: Arc<Settings>,
    gate: Arc<Mutex<Gate>>,
    /// The global pause, set from the status object while the process runs.
    paused: Arc<AtomicBool>,
    /// Whether this replica still holds the leader lease; checked before every node write.
    validity: Arc<Validity>,
    /// The watch caches of the nodes' GPUs and gpumedic's DeviceTaintRules, shared by every
    /// clone; until [`Remediator::watch_dra`] runs and they have listed, every read goes to the
    /// apiserver.
    dra: DraCache,
    /// The fleet watch's copies of the managed nodes: a verdict's first read of its node. Until
    /// [`Remediator::with_node_cache`] gives it one that has listed, that read goes to the
    /// apiserver's watch cache.
    nodes: NodeCache,
    /// The Events waiting to be written, and the writes' slots.
    events: Arc<EventWriter>,
}

impl Remediator {
    /// A remediator writing with the credentials in `config`, counting new quarantines in `gate`.
    pub fn new(config: kube::Config, settings: Settings, gate: Gate) -> Result<Self, ApplyError> {
        let client = kube::Client::try_from(config.clone()).map_err(ApplyError::Client)?;
        let mut no_retry = config;
        no_retry.default_retry = false;
        let evictions = kube::Client::try_from(no_retry).map_err(ApplyError::Client)?;
        Ok(Self {
            client,
            evictions,
            settings: Arc::new(settings),
            gate: Arc::new(Mutex::new(gate)),
            paused: Arc::new(AtomicBool::new(false)),
            validity: Arc::new(Validity::unconditional()),
            dra: DraCache::default(),
            nodes: NodeCache::default(),
            events: Arc::default(),
        })
    }

    /// This remediator, reading a verdict's node first from `nodes` (the fleet watch's copies).
    #[must_use]
    pub fn with_node_cache(mut self, nodes: NodeCache) -> Self {
        self.nodes = nodes;
        self
    }

    /// Keeps the GPU quarantine's watch caches current until `token` is cancelled, so a GPU
    /// verdict reads the node's GPUs and gpumedic's rules on it from memory (see
    /// [`crate::dra::cache`]). Until it runs, and until each cache has listed once, they are read
    /// from the apiserver.
    pub async fn watch_dra(self, token: tokio_util::sync::CancellationToken) {
        self.dra.clone().run(self.client.clone(), token).await;
    }

    /// This remediator, writing only while `validity` says the leader lease is held.
    pub fn with_validity(mut self, validity: Arc<Validity>) -> Self {
        self.validity = validity;
        self
    }

    /// Refuses a write to `node` once the lease can no longer be proven held: every node write,
    /// the start of a drain and every repair call goes through this first.
    pub fn leading(&self, node: &str) -> Result<(), ApplyError> {
        if self.validity.current() {
            Ok(())
        } else {
            WriteRefusedNotLeading.emit();
            Err(ApplyError::NotLeading { node: node.to_owned() })
        }
    }

    /// The client without kube's built-in retries, for calls that carry their own deadline (the
    /// lease renewal, evictions).
    pub fn client_without_retry(&self) -> kube::Client {
        self.evictions.clone()
    }

    /// Sets or lifts the global pause (see [`Policy::paused`]); `Settings::policy.paused` pauses
    /// for good.
    pub fn set_paused(&self, paused: bool) {
        self.paused.store(paused, Ordering::Release);
    }

    /// Whether the global pause is set.
    pub fn paused(&self) -> bool {
        self.settings.policy.paused || self.paused.load(Ordering::Acquire)
    }

    /// The GPU quarantine's watch caches (to see whether they are listed, and how often a
    /// verdict had to read the apiserver instead).
    pub fn dra_cache(&self) -> &DraCache {
        &self.dra
    }

    /// The edge's settings.
    pub fn settings(&self) -> &Settings {
        &self.settings
    }

    /// The client nodes are read and written with.
    pub fn client(&self) -> kube::Client {
        self.client.clone()
    }

    /// The safety gate, to inspect or reset the breaker.
    pub fn gate(&self) -> &Mutex<Gate> {
        &self.gate
    }

    /// Plans `request` against the node as it is now and carries the plan out: node changes,
    /// Events, and the drain when the plan has one. `gpu_nodes` is the fleet size the breaker's
    /// share is measured against.
    ///
    /// A GPU-scoped fault on a node that publishes its GPUs through DRA quarantines only that GPU
    /// (see [`crate::dra`]); everything else is planned on the node. A request that names a GPU
    /// names it in the node condition's message too.
    pub async fn remediate(&self, request: &Remediation, gpu_nodes: usize) -> Result<Outcome, ApplyError> {
        let request = request.naming_gpu();
        match self.route(&request, gpu_nodes).await? {
            Route::Done(outcome) => Ok(outcome),
            Route::Node(request) => self.remediate_node(&request, gpu_nodes, None).await,
        }
    }

    /// Whether the node already shows everything `request` asks for, by the planner, changing
    /// nothing (the safety gate is not asked: a plan that needs it is not done). The resync asks
    /// it before deferring a re-issued verdict again, so an action carried out after its
    /// deferral is not deferred (and reported) once more at every interval.
    ///
    /// # Errors
    /// [`ApplyError`] when the node cannot be read.
    pub async fn reflects(&self, request: &Remediation) -> Result<bool, ApplyError> {
        let request = request.naming_gpu();
        let nodes: Api<Node> = Api::all(self.client.clone());
        let node = read(&nodes, &request.node).await?;
        let view = crate::plan::NodeView::from_node(&node);
        let policy = Policy { paused: self.paused(), ..self.settings.policy };
        let decision = plan(&view, &request, &policy, &mut || Admission::Allowed);
        Ok(matches!(decision, Decision::AlreadyDone))
    }

    /// Whether `request` is carried out on one GPU (done here) or on the node (the request to
    /// plan there: the same, or escalated to the whole node).
    async fn route(&self, request: &Remediation, gpu_nodes: usize) -> Result<Route, ApplyError> {
        let on_node = || Ok(Route::Node(request.clone()));
        let settings = &self.settings;
        if !settings.gpu_quarantine.enabled || self.paused() || settings.policy.mode == Mode::MonitorOnly {
            return on_node();
        }
        let name = request.node.as_str();
        if request.recovery {
            self.release_gpus(request).await?;
            return on_node();
        }
        let Some(gpu) = request.gpu.as_ref() else { return on_node() };
        if !dra::gpu_scoped(request.action, settings.policy.mode == Mode::FullRemediation) {
            return on_node();
        }
        let nodes: Api<Node> = Api::all(self.client.clone());
        let node = read(&nodes, name).await?;
        let view = NodeView::from_node(&node);
        // An opted-out node is the planner's to refuse; on a node gpumedic holds already the new
        // incident joins the node's quarantine.
        if view.labels.get(OPT_OUT_LABEL).is_some_and(|v| v == "true")
            || view.applied().ok().flatten().is_some_and(|a| a.quarantines())
        {
            return on_node();
        }
        let (gpus, device) = match self.node_gpus(name, &gpu.uuid).await {
            Ok(found) => found,
            Err(e) => {
                tracing::warn!(node = name, error = %e, "Could not read the node's ResourceSlices; quarantining the node instead of the GPU.");
                return on_node();
            }
        };
        if gpus.is_empty() {
            return on_node();
        }
        let Some(device) = device else {
            tracing::warn!(node = name, gpu = %gpu.uuid, "The node publishes its GPUs through DRA but none with the verdict's UUID; quarantining the node instead.");
            return on_node();
        };
        let rules = match self.dra.rules_on(name) {
            Some(cached) => Ok(cached),
            None => {
                self.dra.missed();
                dra::rules_on(&self.client, name).await
            }
        };
        let rules = match rules {
            Ok(rules) => rules,
            Err(e) if dra::unserved(&e) => {
                tracing::warn!(
                    node = name,
                    "The cluster serves no DeviceTaintRules (resource.k8s.io/v1beta2, feature gate DRADeviceTaintRules); quarantining the node instead of the GPU."
                );
                return on_node();
            }
            Err(e) => return Err(e.into()),
        };
        let rule_name = dra::rule_name(name, &gpu.uuid);
        let fresh = !rules.iter().any(|r| r.metadata.name.as_deref() == Some(rule_name.as_str()));
        let (quarantined, total) = (rules.len() + usize::from(fresh), dra::gpu_count(&gpus));
        let max_share = settings.gpu_quarantine.max_share;
        if fresh && dra::escalates(quarantined, total, max_share) {
            let why = format!(
                "Quarantining GPU {} would take {quarantined} of the node's {total} GPUs out one by one, more than \
                 {:.0}%; the node is quarantined instead",
                gpu.uuid,
                max_share * 100.0
            );
            GpuQuarantineEscalated { node: name, gpu: &gpu.uuid, quarantined, total }.emit();
            self.record(&node, &[note("GpuQuarantineEscalated", why, true)]).await;
            return Ok(Route::Node(Remediation { gpu: None, ..request.clone() }));
        }
        if fresh {
            let admission = lock(&self.gate).admit_gpu(&rule_name, Instant::now());
            match admission {
                Admission::Allowed => {}
                Admission::BreakerOpen(why) => {
                    self.note_skip(&node, &Skip::BreakerOpen(why.clone())).await;
                    return Ok(Route::Done(Outcome::Skipped { reason: Skip::BreakerOpen(why), would: None }));
                }
                Admission::RateLimited(why) => {
                    return Ok(Route::Done(Outcome::Skipped { reason: Skip::RateLimited(why), would: None }));
                }
            }
        }
        let result = self.quarantine_gpu(request, &node, &device, &rule_name, !fresh, gpu_nodes).await;
        if fresh && !matches!(result, Ok(Route::Done(Outcome::Applied { .. }))) {
            lock(&self.gate).breaker.cancel_gpu(&rule_name);
        }
        result
    }

    /// The whole GPUs `node` publishes and the device of GPU `uuid` among them: from the watch
    /// cache when it knows the node and has the device, else listed from the apiserver (a slice
    /// published a moment ago may not have reached the cache).
    async fn node_gpus(&self, node: &str, uuid: &str) -> Result<(Vec<dra::Gpu>, Option<dra::DeviceRef>), DraError> {
        if let Some(gpus) = self.dra.gpus_on(node)
            && let Some(device) = dra::find_device(&gpus, uuid)
        {
            return Ok((gpus, Some(device)));
        }
        self.dra.missed();
        let gpus = dra::gpus(&dra::slices_on(&self.client, node).await?);
        let device = dra::find_device(&gpus, uuid);
        Ok((gpus, device))
    }

    /// Quarantines GPU `device` of `node` for `request`: marks the node (its condition, the
    /// incident recorded as one that leaves the node in service), creates or joins gpumedic's
    /// DeviceTaintRule `rule_name`, and evicts the pods whose claims are allocated the device.
    async fn quarantine_gpu(
        &self,
        request: &Remediation,
        node: &Node,
        device: &dra::DeviceRef,
        rule_name: &str,
        exists: bool,
        gpu_nodes: usize,
    ) -> Result<Route, ApplyError> {
        let name = request.node.as_str();
        let uuid = request.gpu.as_ref().map(|g| g.uuid.as_str()).unwrap_or_default();
        let mark = Remediation { action: Action::Monitor, ..request.clone() };
        let mut plan = match self.remediate_node(&mark, gpu_nodes, Some(node.clone())).await? {
            Outcome::Applied { plan, .. } => plan,
            Outcome::AlreadyDone => Box::new(Plan::new(name, Intent::Quarantine)),
            skipped @ Outcome::Skipped { .. } => return Ok(Route::Done(skipped)),
        };
        plan.intent = Intent::Quarantine;
        self.leading(name)?;
        let wanted = dra::rule(name, uuid, device, request);
        let ensured = dra::ensure_rule(&self.client, &self.dra, &wanted, &request.incident_id, exists).await?;
        let drained = match ensured {
            Ensured::Foreign => {
                tracing::warn!(
                    node = name,
                    rule = rule_name,
                    "A DeviceTaintRule with gpumedic's name exists that gpumedic did not create; quarantining the node instead."
                );
                return Ok(Route::Node(Remediation { gpu: None, ..request.clone() }));
            }
            Ensured::Created => {
                GpuQuarantined {
                    node: name,
                    gpu: uuid,
                    device: &device,
                    rule: rule_name,
                    incident: &request.incident_id,
                }
                .emit();
                let message = format!(
                    "GPU {uuid} (device {device}) tainted NoSchedule by DeviceTaintRule {rule_name} for incident {}; \
                     the node stays schedulable for its other GPUs",
                    request.incident_id
                );
                self.record(node, &[note("GpuQuarantined", message, true)]).await;
                false
            }
            Ensured::Joined => false,
            Ensured::Present { drained } => drained,
        };
        let report = if request.action.drains() && !drained {
            self.leading(name)?;
            Some(self.drain_gpu(node, device, rule_name).await?)
        } else {
            None
        };
        if matches!(ensured, Ensured::Present { .. }) && report.is_none() && plan.is_empty() {
            return Ok(Route::Done(Outcome::AlreadyDone));
        }
        plan.gpu_rule = Some(rule_name.to_owned());
        if report.is_some() {
            plan.drain = Some(DrainScope { gpu: request.gpu.clone() });
        }
        Ok(Route::Done(Outcome::Applied { plan, drain: report }))
    }

    /// Evicts the pods holding `device` (by their ResourceClaims' allocations) and marks gpumedic's
    /// rule drained once they are all gone.
    async fn drain_gpu(
        &self,
        node: &Node,
        device: &dra::DeviceRef,
        rule_name: &str,
    ) -> Result<DrainReport, ApplyError> {
        let name = node.metadata.name.as_deref().unwrap_or_default();
        let holders = dra::holders(&self.client, device).await?;
        let message = format!("Draining the pods whose ResourceClaims hold device {device} through the Eviction API");
        self.record(node, &[note("DrainStarted", message, false)]).await;
        let started = Instant::now();
        let report = drain_holders(&self.evictions, name, &holders, &self.settings.drain).await?;
        let incomplete = incomplete_detail(&report);
        let device_name = device.to_string();
        Drained {
            node: name,
            device: Some(&device_name),
            elapsed: started.elapsed(),
            incomplete: incomplete.as_deref(),
        }
        .emit();
        match incomplete {
            None => {
                dra::mark_drained(&self.client, &self.dra, rule_name).await?;
                self.record(node, &[note("Drained", report.summary(), false)]).await;
            }
            Some(detail) => self.record(node, &[note("DrainIncomplete", detail, true)]).await,
        }
        Ok(report)
    }

    /// On a recovery, takes the incident off gpumedic's DeviceTaintRules on the node and deletes
    /// those no open incident holds any more. A cluster that serves no DeviceTaintRules has none.
    async fn release_gpus(&self, request: &Remediation) -> Result<(), ApplyError> {
        let name = request.node.as_str();
        self.leading(name)?;
        let deleted = match dra::release(&self.client, &self.dra, name, &request.incident_id).await {
            Ok(deleted) => deleted,
            Err(e) if dra::unserved(&e) => return Ok(()),
            Err(e) => return Err(e.into()),
        };
        if deleted.is_empty() {
            return Ok(());
        }
        GpusReleased { node: name, rules: &deleted, incident: &request.incident_id }.emit();
        let nodes: Api<Node> = Api::all(self.client.clone());
        if let Ok(Some(node)) = nodes.get_opt(name).await {
            let message = format!(
                "Incident {} recovered; deleted DeviceTaintRule(s) {}",
                request.incident_id,
                deleted.join(", ")
            );
            self.record(&node, &[note("GpuReleased", message, false)]).await;
        }
        Ok(())
    }

    /// Plans `request` on the node and carries the plan out (see [`Remediator::remediate`]).
    /// `read_already` is the node as just read, when the caller has it: the first attempt plans on it
    /// (its resourceVersion guards the write as a fresh read would).
    async fn remediate_node(
        &self,
        request: &Remediation,
        gpu_nodes: usize,
        mut read_already: Option<Node>,
    ) -> Result<Outcome, ApplyError> {
        let nodes: Api<Node> = Api::all(self.client.clone());
        let name = request.node.as_str();
        // A plan whose object patch was written before its conditions' patch lost a race: its
        // object's Events are still owed, and its outcome stands if the re-plan finds nothing
        // left to do.
        let mut partly_written: Option<Box<Plan>> = None;
        // The first read is the fleet watch's copy (else the apiserver's watch cache), which
        // takes an apiserver round trip (or a read of etcd) off the fault's path; it may be a
        // moment old. A write planned from it is guarded by its resourceVersion (a stale one
        // fails with 409 and is re-planned from a fresh read), and a decision to write nothing is
        // taken only from a fresh read.
        let mut cached = read_already.is_none();
        // The fresh read after a cached one that asked for no write is not a conflict's retry.
        for _ in 0..CONFLICT_ATTEMPTS + 1 {
            let node = match read_already.take() {
                Some(node) => node,
                None if cached => match self.nodes.get(name) {
                    Some(node) => node,
                    None => read_cached(&nodes, name).await?,
                },
                None => read(&nodes, name).await?,
            };
            let view = crate::plan::NodeView::from_node(&node);
            let mut admitted = false;
            let policy = Policy { paused: self.paused(), ..self.settings.policy };
            let decision = plan(&view, request, &policy, &mut || {
                let a = lock(&self.gate).admit(name, gpu_nodes, Instant::now());
                admitted = a == Admission::Allowed;
                a
            });
            if cached && !matches!(decision, Decision::Apply(_)) {
                if admitted {
                    lock(&self.gate).cancel(name);
                }
                cached = false;
                continue;
            }
            cached = false;
            let plan = match decision {
                Decision::AlreadyDone => {
                    return Ok(match partly_written {
                        Some(plan) => Outcome::Applied { plan, drain: None },
                        None => Outcome::AlreadyDone,
                    });
                }
                Decision::Nothing { reason, would } => {
                    self.note_skip(&node, &reason).await;
                    return Ok(Outcome::Skipped { reason, would });
                }
                Decision::Apply(plan) => plan,
            };
            let mut plan = plan;
            label_gpu(&view, request, &mut plan);
            self.leading(name)?;
            match write(&nodes, &node, &plan, &self.nodes).await {
                Ok(()) => {}
                Err(WriteError::Conflict { object_written }) => {
                    // A quarantine written stands and keeps its place in the budget.
                    if admitted && !object_written {
                        lock(&self.gate).cancel(name);
                    }
                    if object_written {
                        let owed: Vec<Note> = plan.notes.iter().filter(|n| !n.on_status).cloned().collect();
                        self.record(&node, &owed).await;
                        partly_written = Some(plan);
                    }
                    continue;
                }
                Err(WriteError::Failed { error, object_written }) => {
                    if admitted && !object_written {
                        lock(&self.gate).cancel(name);
                    }
                    if object_written {
                        // The retry's plan no longer holds the object's notes.
                        let owed: Vec<Note> = plan.notes.iter().filter(|n| !n.on_status).cloned().collect();
                        self.record(&node, &owed).await;
                    }
                    return Err(error);
                }
            }
            tracing::info!(node = name, incident = %request.incident_id, intent = ?plan.intent, "Applied a remediation plan.");
            // The re-plan after a partial write no longer holds the written object's notes.
            self.record(&node, &plan.notes).await;
            let drained = match &plan.drain {
                Some(scope) => {
                    self.leading(name)?;
                    Some(self.drain(&nodes, &node, scope).await?)
                }
                None => None,
            };
            // The repair follows a finished drain only (the planner asks for one only once the
            // node is drained or being drained); an incomplete drain leaves the ladder unstarted.
            if plan.repair.is_some() {
                if drained.as_ref().is_none_or(DrainReport::complete) {
                    self.leading(name)?;
                    self.start_ladder(&nodes, request).await?;
                } else {
                    plan.repair = None;
                }
            }
            return Ok(Outcome::Applied { plan, drain: drained });
        }
        Err(ApplyError::Conflict { node: name.to_owned(), attempts: CONFLICT_ATTEMPTS })
    }

    async fn drain(
        &self,
        nodes: &Api<Node>,
        node: &Node,
        scope: &crate::plan::DrainScope,
    ) -> Result<DrainReport, ApplyError> {
        let name = node.metadata.name.as_deref().unwrap_or_default();
        let what = match &scope.gpu {
            Some(gpu) => match gpu.index {
                Some(index) => format!("the pods on GPU {} (index {index})", gpu.uuid),
                None => format!("the pods on GPU {}", gpu.uuid),
            },
            None => "all pods".to_owned(),
        };
        self.record(node, &[note("DrainStarted", format!("Draining {what} through the Eviction API"), false)]).await;
        let started = Instant::now();
        let report = drain(&self.evictions, name, scope, &self.settings.drain).await?;
        // How long drains take, finished or cut off by their deadline (a dashboard's panel).
        let incomplete = incomplete_detail(&report);
        Drained { node: name, device: None, elapsed: started.elapsed(), incomplete: incomplete.as_deref() }.emit();
        match incomplete {
            None => {
                self.record(node, &[note("Drained", report.summary(), false)]).await;
                self.advance(nodes, name, State::Drained).await?;
            }
            Some(detail) => self.record(node, &[note("DrainIncomplete", detail, true)]).await,
        }
        Ok(report)
    }

    /// Records the escalation ladder for `request` on its drained node and moves the state to
    /// `remediating`, in one write guarded by the node's resourceVersion; the leader's repair task
    /// walks the ladder from there. A ladder already recorded for the incident is left as it is,
    /// so a redelivered verdict starts nothing twice.
    async fn start_ladder(&self, nodes: &Api<Node>, request: &Remediation) -> Result<(), ApplyError> {
        let name = request.node.as_str();
        for _ in 0..CONFLICT_ATTEMPTS {
            let node = read(nodes, name).await?;
            if let Some(Ok(existing)) = crate::ladder::ladder_on(&node)
                && existing.request.incident_id == request.incident_id
            {
                return Ok(());
            }
            let ladder = if request.action == crate::request::Action::Custom {
                Ladder::custom(&request.verdict_id, request, self.settings.custom_timeout, Utc::now())
            } else {
                Ladder::new(
                    &request.verdict_id,
                    crate::ladder::recommended(request.action),
                    request,
                    &self.settings.ladder,
                    Utc::now(),
                )
            };
            let mut patch = crate::ladder::ladder_patch(Some(&ladder), node.metadata.resource_version.as_deref());
            if advance(&crate::plan::NodeView::from_node(&node), State::Remediating).is_some() {
                patch["metadata"]["labels"] = json!({ crate::plan::STATE_LABEL: State::Remediating.as_str() });
            }
            match nodes.patch(name, &PatchParams::default(), &Patch::Merge(&patch)).await {
                Ok(_) => {}
                Err(kube::Error::Api(s)) if s.is_conflict() => continue,
                Err(source) => return Err(ApplyError::Patch { node: name.to_owned(), source }),
            }
            LadderStarted { node: name, incident: &request.incident_id, ladder: &ladder.describe() }.emit();
            self.record(&node, &[note("RepairLadderStarted", format!("Repair ladder {}", ladder.describe()), false)])
                .await;
            return Ok(());
        }
        Err(ApplyError::Conflict { node: name.to_owned(), attempts: CONFLICT_ATTEMPTS })
    }

    /// Moves the state label of `name` to `to` (see [`advance`]), re-reading the node on conflicts.
    pub async fn advance_state(&self, name: &str, to: State) -> Result<(), ApplyError> {
        let nodes: Api<Node> = Api::all(self.client.clone());
        self.advance(&nodes, name, to).await
    }

    /// Sets gpumedic's condition `type_` on `name` to True with a new reason and message (a
    /// failed repair says so where `kubectl describe node` shows it), leaving its transition time.
    pub async fn restate_condition(
        &self,
        name: &str,
        type_: &str,
        reason: &str,
        message: &str,
    ) -> Result<(), ApplyError> {
        self.leading(name)?;
        let nodes: Api<Node> = Api::all(self.client.clone());
        let patch = json!({ "status": { "conditions": [{
            "type": type_, "status": "True", "reason": reason, "message": message, "lastHeartbeatTime": now(),
        }] } });
        nodes
            .patch_status(name, &PatchParams::default(), &Patch::Strategic(&patch))
            .await
            .map_err(|source| ApplyError::Status { node: name.to_owned(), source })?;
        Ok(())
    }

    /// Records one Event on `node` (the repair ladder's steps).
    pub async fn record_event(&self, node: &Node, reason: &str, message: String, warning: bool) {
        self.record(node, &[note(reason, message, warning)]).await;
    }

    /// Moves the state label to `to`, re-reading the node on conflicts.
    async fn advance(&self, nodes: &Api<Node>, name: &str, to: State) -> Result<(), ApplyError> {
        self.leading(name)?;
        for _ in 0..CONFLICT_ATTEMPTS {
            let node = read(nodes, name).await?;
            let Some(plan) = advance(&crate::plan::NodeView::from_node(&node), to) else { return Ok(()) };
            match write(nodes, &node, &plan, &self.nodes).await {
                Ok(()) => return Ok(()),
                Err(WriteError::Conflict { .. }) => continue,
                Err(WriteError::Failed { error, .. }) => return Err(error),
            }
        }
        Err(ApplyError::Conflict { node: name.to_owned(), attempts: CONFLICT_ATTEMPTS })
    }

    /// Events for refusals an operator should see; quiet skips (no action, monitor-only,
    /// nothing applied) would only add noise to every verdict.
    async fn note_skip(&self, node: &Node, reason: &Skip) {
        let note = match reason {
            Skip::BreakerOpen(_) => note("CircuitBreakerOpen", format!("Not quarantined: {reason}"), true),
            Skip::RateLimited(_) => note("QuarantineRateLimited", format!("Not quarantined: {reason}"), true),
            Skip::UnreadableRecord(_) => note("OwnershipRecordUnreadable", format!("Not changed: {reason}"), true),
            _ => return,
        };
        self.record(node, &[note]).await;
    }

    /// Records one Event per note on the node. Events are the story for humans, not state, so
    /// they are written in the background (a verdict does not wait for them), at most
    /// [`EVENT_WRITES`] at a time: in a mass failure the quarantines go first and the Events follow
    /// (when each verdict's Events were written at once, they were a third of the apiserver's work
    /// while 1,000 GPUs were quarantined). Past [`EVENT_BACKLOG`] Events waiting, a new one is
    /// dropped and logged; a failed write is logged, and the remediation goes on.
    async fn record(&self, node: &Node, notes: &[Note]) {
        if notes.is_empty() {
            return;
        }
        let name = node.metadata.name.clone();
        if self.events.waiting.fetch_add(notes.len(), Ordering::AcqRel) >= EVENT_BACKLOG {
            self.events.waiting.fetch_sub(notes.len(), Ordering::AcqRel);
            let reasons: Vec<_> = notes.iter().map(|n| n.reason.as_str()).collect();
            tracing::warn!(node = ?name, reasons = ?reasons, backlog = EVENT_BACKLOG,
                "Too many Events are waiting to be written; these are dropped (the remediation itself is done).");
            return;
        }
        let events: Api<Event> = Api::namespaced(self.client.clone(), &self.settings.event_namespace);
        let writes: Vec<(String, Event)> =
            notes.iter().map(|n| (n.reason.clone(), event_for(node, n, &self.settings))).collect();
        let writer = self.events.clone();
        tokio::spawn(async move {
            for (reason, event) in writes {
                let result = match writer.slots.acquire().await {
                    Ok(_slot) => events.create(&PostParams::default(), &event).await.map(|_| ()),
                    Err(_) => Ok(()),
                };
                writer.waiting.fetch_sub(1, Ordering::AcqRel);
                if let Err(e) = result {
                    tracing::warn!(node = ?name, %reason, error = %e, "Could not record an Event on the node.");
                }
            }
        });
    }
}

/// Event writes at once (see [`Remediator::record`]).
pub const EVENT_WRITES: usize = 4;
/// Events that may wait to be written before new ones are dropped.
pub const EVENT_BACKLOG: usize = 10_000;

/// The background writer of the remediator's Events: its slots and how many Events wait.
#[derive(Debug)]
struct EventWriter {
    slots: tokio::sync::Semaphore,
    waiting: std::sync::atomic::AtomicUsize,
}

impl Default for EventWriter {
    fn default() -> Self {
        Self { slots: tokio::sync::Semaphore::new(EVENT_WRITES), waiting: std::sync::atomic::AtomicUsize::new(0) }
    }
}

/// Counts the nodes matching `selector` (the GPU nodes the breaker's share is measured against).
pub async fn count_nodes(client: &kube::Client, selector: &str) -> Result<usize, kube::Error> {
    Ok(managed_nodes(client, selector).await?.len())
}

/// The names of the nodes that match `selector`: the GPU nodes gpumedic manages.
pub async fn managed_nodes(
    client: &kube::Client,
    selector: &str,
) -> Result<std::collections::HashSet<String>, kube::Error> {
    let nodes: Api<Node> = Api::all(client.clone());
    Ok(nodes
        .list_metadata(&ListParams::default().labels(selector))
        .await?
        .items
        .into_iter()
        .filter_map(|n| n.metadata.name)
        .collect())
}

/// Where [`Remediator::route`] sends a request.
enum Route {
    /// Plan this request on the node.
    Node(Remediation),
    /// Carried out on one GPU.
    Done(Outcome),
}

/// Names the faulty GPU in the node's [`dra::GPU_LABEL`] while gpumedic has an incident open on
/// the node, for schedulers that read labels where no DeviceTaintRule can keep work off the GPU;
/// the label goes with gpumedic's record. The label is gpumedic's own by its key.
fn label_gpu(view: &NodeView, request: &Remediation, plan: &mut Plan) {
    let current = view.labels.get(dra::GPU_LABEL);
    if request.recovery {
        if plan.applied.is_none() && current.is_some() {
            plan.remove_labels.push(dra::GPU_LABEL.to_owned());
        }
    } else if let Some(gpu) = &request.gpu
        && plan.applied.is_some()
        && current != Some(&gpu.uuid)
        && gpu.uuid.len() <= 63
    {
        plan.set_labels.insert(dra::GPU_LABEL.to_owned(), gpu.uuid.clone());
    }
}

fn lock(gate: &Mutex<Gate>) -> std::sync::MutexGuard<'_, Gate> {
    // The gate's state is a few maps updated in place; a panic elsewhere cannot leave it half
    // written, so a poisoned lock is still safe to use.
    gate.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// `name` as the apiserver's watch cache holds it (`resourceVersion=0`): no read of etcd, and
/// possibly a moment old.
async fn read_cached(nodes: &Api<Node>, name: &str) -> Result<Node, ApplyError> {
    match nodes.get_with(name, &kube::api::GetParams::any()).await {
        Ok(node) => Ok(node),
        // A node created a moment ago may not be in the cache yet.
        Err(kube::Error::Api(s)) if s.is_not_found() => read(nodes, name).await,
        Err(source) => Err(ApplyError::Read { node: name.to_owned(), source }),
    }
}

async fn read(nodes: &Api<Node>, name: &str) -> Result<Node, ApplyError> {
    nodes
        .get_opt(name)
        .await
        .map_err(|source| ApplyError::Read { node: name.to_owned(), source })?
        .ok_or_else(|| ApplyError::NodeNotFound { node: name.to_owned() })
}

/// What a drain cut off by its deadline left: its summary and the first pod it could not evict;
/// `None` for a complete drain.
fn incomplete_detail(report: &DrainReport) -> Option<String> {
    if report.complete() {
        return None;
    }
    let mut detail = report.summary();
    if let Some((pod, why)) = report.blocked.first() {
        detail.push_str(&format!("; {pod}: {why}"));
    }
    Some(detail)
}

enum WriteError {
    /// The node changed since it was read; `object_written` says whether the object patch (the
    /// cordon, taints, labels) went through before the status patch lost.
    Conflict { object_written: bool },
    /// The apiserver refused or could not be reached; `object_written` as for a conflict.
    Failed { error: ApplyError, object_written: bool },
}

/// Writes `plan` onto `node` (as read): the object patch first (the cordon and taints, which
/// keep work off the node, so they are on it one apiserver round trip sooner), then the
/// conditions, each guarded by the resourceVersion the previous step left, so two writers racing
/// on one node (a redelivered verdict, a second replica) cannot both act: the later write fails
/// with 409. Under load a node write costs several milliseconds, and the cordon is what the
/// fault-to-cordon time measures; the condition that explains it follows at once.
async fn write(nodes: &Api<Node>, node: &Node, plan: &Plan, cache: &NodeCache) -> Result<(), WriteError> {
    let name = plan.node.as_str();
    let mut version = node.metadata.resource_version.clone();
    if plan.changes_object() {
        let patch = object_patch(node, version.as_deref(), plan);
        match nodes.patch(name, &PatchParams::default(), &Patch::Merge(&patch)).await {
            Ok(updated) => {
                cache.offer(&updated);
                version = updated.metadata.resource_version;
            }
            Err(kube::Error::Api(s)) if s.is_conflict() => {
                return Err(WriteError::Conflict { object_written: false });
            }
            Err(source) => {
                let error = ApplyError::Patch { node: name.to_owned(), source };
                return Err(WriteError::Failed { error, object_written: false });
            }
        }
    }
    if !plan.conditions.is_empty() {
        let patch = conditions_patch(plan, version.as_deref(), &now());
        match nodes.patch_status(name, &PatchParams::default(), &Patch::Strategic(&patch)).await {
            Ok(updated) => cache.offer(&updated),
            Err(kube::Error::Api(s)) if s.is_conflict() => {
                return Err(WriteError::Conflict { object_written: plan.changes_object() });
            }
            Err(source) => {
                let error = ApplyError::Status { node: name.to_owned(), source };
                return Err(WriteError::Failed { error, object_written: plan.changes_object() });
            }
        }
    }
    Ok(())
}

/// The JSON merge patch for labels, the ownership annotation, taints and cordon. Taints are a
/// plain list in the Node schema (no merge key), so the patch carries the whole new list, and the
/// resourceVersion makes sure it is built from the list that is really there.
pub fn object_patch(node: &Node, resource_version: Option<&str>, plan: &Plan) -> Value {
    let mut metadata = Map::new();
    metadata.insert("resourceVersion".into(), json!(resource_version));
    let mut labels = Map::new();
    for (k, v) in &plan.set_labels {
        labels.insert(k.clone(), json!(v));
    }
    for k in &plan.remove_labels {
        labels.insert(k.clone(), Value::Null);
    }
    if !labels.is_empty() {
        metadata.insert("labels".into(), Value::Object(labels));
    }
    if plan.applied_changed {
        let record = plan.applied.as_ref().map(|a| json!(serde_json::to_string(a).expect("the record serializes")));
        metadata.insert("annotations".into(), json!({ APPLIED_ANNOTATION: record.unwrap_or(Value::Null) }));
    }
    let mut spec = Map::new();
    if !plan.add_taints.is_empty() || !plan.remove_taints.is_empty() {
        let existing = node.spec.as_ref().and_then(|s| s.taints.clone()).unwrap_or_default();
        let mut taints: Vec<Value> = existing
            .iter()
            .filter(|t| !plan.remove_taints.iter().any(|r| r.key == t.key && r.effect == t.effect))
            .map(|t| serde_json::to_value(t).expect("a taint serializes"))
            .collect();
        let added = now();
        for t in &plan.add_taints {
            taints.push(json!({ "key": t.key, "value": t.value, "effect": t.effect, "timeAdded": added }));
        }
        spec.insert("taints".into(), Value::Array(taints));
    }
    if let Some(cordon) = plan.cordon {
        spec.insert("unschedulable".into(), json!(cordon));
    }
    let mut patch = Map::new();
    patch.insert("metadata".into(), Value::Object(metadata));
    if !spec.is_empty() {
        patch.insert("spec".into(), Value::Object(spec));
    }
    Value::Object(patch)
}

/// The strategic merge patch for the status subresource: the condition list merges by `type`,
/// so conditions other than the plan's are left as they are. `lastTransitionTime` moves only
/// when the status flips, as the API conventions ask. The resourceVersion makes the write fail
/// with 409 when the node changed since it was read.
pub fn conditions_patch(plan: &Plan, resource_version: Option<&str>, now: &str) -> Value {
    let conditions: Vec<Value> = plan
        .conditions
        .iter()
        .map(|c| {
            let mut v = json!({
                "type": c.type_,
                "status": if c.problem { "True" } else { "False" },
                "reason": c.reason,
                "message": c.message,
                "lastHeartbeatTime": now,
            });
            if c.transition {
                v["lastTransitionTime"] = json!(now);
            }
            v
        })
        .collect();
    json!({ "metadata": { "resourceVersion": resource_version }, "status": { "conditions": conditions } })
}

fn note(reason: &str, message: String, warning: bool) -> Note {
    if warning { Note::warning(reason, message) } else { Note::normal(reason, message) }
}

fn now() -> String {
    Utc::now().to_rfc3339_opts(SecondsFormat::Secs, true)
}

/// A core/v1 Event about `node`, so `kubectl describe node` lists it.
fn event_for(node: &Node, n: &Note, settings: &Settings) -> Event {
    let name = node.metadata.name.clone().unwrap_or_default();
    let at = now();
    serde_json::from_value(json!({
        "metadata": { "generateName": format!("{name}.gpumedic."), "namespace": settings.event_namespace },
        "involvedObject": { "apiVersion": "v1", "kind": "Node", "name": name, "uid": node.metadata.uid },
        "reason": n.reason,
        "message": n.message,
        "type": if n.warning { "Warning" } else { "Normal" },
        "source": { "component": settings.component },
        "reportingComponent": settings.component,
        "reportingInstance": std::env::var("HOSTNAME").unwrap_or_else(|_| settings.component.clone()),
        "action": n.reason,
        "firstTimestamp": at,
        "lastTimestamp": at,
        "count": 1,
    }))
    .expect("the Event is well formed")
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::plan::{ConditionChange, Intent, Taint, TaintKey};

    fn empty_plan() -> Plan {
        match crate::plan::plan(
            &crate::plan::NodeView { name: "n".into(), ..Default::default() },
            &Remediation {
                node: "n".into(),
                gpu: None,
                action: crate::request::Action::Cordon,
                subsystem: crate::request::Subsystem::Gpu,
                reason: "Xid79".into(),
                message: "m".into(),
                verdict_id: "v".into(),
                incident_id: "i".into(),
                recovery: false,
                reissue: false,
                custom: None,
            },
            &Policy::default(),
            &mut || Admission::Allowed,
        ) {
            Decision::Apply(p) => *p,
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn object_patch_keeps_foreign_taints_and_carries_the_resource_version() {
        let node: Node = serde_json::from_value(json!({
            "metadata": { "name": "n", "resourceVersion": "42" },
            "spec": { "taints": [
                { "key": "example.com/maint", "effect": "NoSchedule" },
                { "key": "gpumedic.io/unhealthy", "value": "gpu", "effect": "NoSchedule" }
            ] }
        }))
        .unwrap();
        let mut p = empty_plan();
        p.add_taints = vec![Taint { key: "x".into(), value: None, effect: "NoExecute".into() }];
        p.remove_taints = vec![TaintKey { key: "gpumedic.io/unhealthy".into(), effect: "NoSchedule".into() }];
        p.remove_labels = vec!["gone".into()];
        let v = object_patch(&node, Some("42"), &p);
        assert_eq!(v["metadata"]["resourceVersion"], "42");
        assert_eq!(v["metadata"]["labels"]["gone"], Value::Null);
        assert_eq!(v["metadata"]["labels"]["gpumedic.io/state"], "quarantined");
        let taints = v["spec"]["taints"].as_array().unwrap();
        assert_eq!(taints.len(), 2);
        assert_eq!(taints[0]["key"], "example.com/maint");
        assert_eq!(taints[1]["key"], "x");
        assert_eq!(v["spec"]["unschedulable"], true);
        let record: crate::plan::Applied =
            serde_json::from_str(v["metadata"]["annotations"][APPLIED_ANNOTATION].as_str().unwrap()).unwrap();
        assert!(record.cordoned);
    }

    #[test]
    fn conditions_patch_moves_the_transition_time_only_on_a_flip() {
        let mut p = empty_plan();
        p.intent = Intent::Mark;
        p.conditions = vec![
            ConditionChange {
                type_: "A".into(),
                problem: true,
                reason: "r".into(),
                message: "m".into(),
                transition: true,
            },
            ConditionChange {
                type_: "B".into(),
                problem: false,
                reason: "r".into(),
                message: "m".into(),
                transition: false,
            },
        ];
        let v = conditions_patch(&p, Some("7"), "2026-01-01T00:00:00Z");
        assert_eq!(v["metadata"]["resourceVersion"], "7");
        let cs = v["status"]["conditions"].as_array().unwrap();
        assert_eq!(cs[0]["status"], "True");
        assert_eq!(cs[0]["lastTransitionTime"], "2026-01-01T00:00:00Z");
        assert_eq!(cs[1]["status"], "False");
        assert!(cs[1].get("lastTransitionTime").is_none());
    }
}
