//! Draining a node through the Eviction API, so PodDisruptionBudgets are honoured.
//!
//! [`classify`] decides, without I/O, which pods leave: DaemonSet pods (their controller would
//! put them straight back, and they tolerate the cordon), mirror and static pods (the kubelet
//! owns them; the API cannot remove them), finished pods, pods in excluded namespaces and, in a
//! partial drain, pods not on the faulty GPU are skipped. [`drain`] is the thin edge: it evicts
//! concurrently with a bound, retries PodDisruptionBudget refusals (HTTP 429) with backoff until
//! the deadline, and waits for the pods to be gone.
//!
//! Partial drain needs to know which pod holds which GPU. Without the kubelet's PodResources API
//! (a node-local socket the remediator cannot reach) that allocation is not visible through the
//! API server, so the convention is: a pod is on a GPU when its [`GPU_UUIDS_ANNOTATION`] lists
//! the GPU's UUID (set by the workload, an admission webhook or the enricher), or when a
//! container's `NVIDIA_VISIBLE_DEVICES` in the pod spec names its UUID or index. A pod that
//! requests `nvidia.com/gpu` and carries neither is evicted: not knowing is not a reason to leave
//! a job on a failing GPU.

use std::collections::BTreeSet;
use std::time::Duration;

use futures::StreamExt as _;
use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, DeleteParams, ListParams, PostParams};
use tokio::time::Instant;

use crate::plan::DrainScope;
use crate::request::GpuRef;

/// Pod annotation listing the GPU UUIDs a pod uses, comma-separated (see the module docs).
pub const GPU_UUIDS_ANNOTATION: &str = "gpumedic.io/gpu-uuids";
/// The annotation the kubelet puts on mirror pods.
pub const MIRROR_ANNOTATION: &str = "kubernetes.io/config.mirror";
/// The annotation naming where the kubelet got a pod from (`api`, `file`, `http`).
pub const SOURCE_ANNOTATION: &str = "kubernetes.io/config.source";
const GPU_RESOURCE: &str = "nvidia.com/gpu";

/// What went wrong listing the node's pods; per-pod failures are in the [`DrainReport`] instead.
#[derive(Debug, thiserror::Error)]
pub enum DrainError {
    /// The pods on the node could not be listed.
    #[error("cannot list the pods on node {node}: {source}")]
    List {
        /// The node.
        node: String,
        /// The API error.
        #[source]
        source: kube::Error,
    },
}

/// How pods leave the node.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum DrainMode {
    /// Evict now, with the pod's own grace period or the one given.
    Immediate {
        /// Overrides the pods' `terminationGracePeriodSeconds`.
        grace_seconds: Option<i64>,
    },
    /// Evict nothing: wait for the pods to finish on their own until the deadline.
    AllowCompletion,
    /// Evict, and at the deadline force-delete (grace 0) whatever is still there, PDB or not.
    DeleteAfterTimeout {
        /// Overrides the pods' `terminationGracePeriodSeconds` for the eviction.
        grace_seconds: Option<i64>,
    },
}

/// How the drain goes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DrainPolicy {
    /// How pods leave.
    pub mode: DrainMode,
    /// Namespace globs (`*`, `?`) to drain; empty means all.
    pub include_namespaces: Vec<String>,
    /// Namespace globs never drained; wins over `include_namespaces`.
    pub exclude_namespaces: Vec<String>,
    /// The whole drain's time limit, from its start.
    pub deadline: Duration,
    /// Evictions in flight at once.
    pub concurrency: usize,
    /// The first wait after a PodDisruptionBudget refusal; doubles up to `max_backoff`.
    pub initial_backoff: Duration,
    /// The longest wait between retries.
    pub max_backoff: Duration,
    /// How often to look whether the pods are gone.
    pub poll: Duration,
    /// Per-namespace and per-priority-class exceptions to `mode` and `deadline`, the first that
    /// matches a pod wins (see [`DrainRule`]).
    pub rules: Vec<DrainRule>,
}

/// An exception to the drain's mode, grace and deadline for the pods it matches: by namespace
/// glob, by priority class glob, or both (both must match). Unset settings keep the drain's own.
///
/// Written `<match>:<settings>`, for example
/// `namespace=inference-*:mode=allow-completion,deadline=30m` or
/// `priorityClass=system-*:mode=skip` or
/// `namespace=batch,priorityClass=low:mode=delete-after-timeout,grace=30,deadline=2m`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DrainRule {
    /// The namespace glob the pod's namespace must match, when set.
    pub namespace: Option<String>,
    /// The priority class glob the pod's `priorityClassName` must match, when set (a pod without
    /// one matches only `*`).
    pub priority_class: Option<String>,
    /// The mode for the pods matched, or `None` to keep the drain's; `Some(None)` leaves them
    /// on the node (`mode=skip`).
    pub mode: Option<Option<DrainMode>>,
    /// The grace period for evicted pods, overriding the pods' own and the drain's.
    pub grace_seconds: Option<i64>,
    /// How long these pods may take.
    pub deadline: Option<Duration>,
}

impl DrainRule {
    fn matches(&self, pod: &Pod) -> bool {
        let namespace = pod.metadata.namespace.as_deref().unwrap_or_default();
        let class = pod.spec.as_ref().and_then(|s| s.priority_class_name.as_deref()).unwrap_or_default();
        self.namespace.as_deref().is_none_or(|g| glob(g, namespace))
            && self.priority_class.as_deref().is_none_or(|g| glob(g, class))
    }
}

impl std::str::FromStr for DrainRule {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        let (matcher, settings) = s
            .split_once(':')
            .ok_or_else(|| format!("'{s}' needs `<match>:<settings>`, such as `namespace=ml-*:mode=skip`"))?;
        let mut rule =
            DrainRule { namespace: None, priority_class: None, mode: None, grace_seconds: None, deadline: None };
        for part in matcher.split(',').map(str::trim).filter(|p| !p.is_empty()) {
            match part.split_once('=').map(|(k, v)| (k.trim(), v.trim())) {
                Some(("namespace", v)) if !v.is_empty() => rule.namespace = Some(v.to_owned()),
                Some(("priorityClass", v)) if !v.is_empty() => rule.priority_class = Some(v.to_owned()),
                _ => return Err(format!("'{part}' in '{s}' is not `namespace=<glob>` or `priorityClass=<glob>`")),
            }
        }
        if rule.namespace.is_none() && rule.priority_class.is_none() {
            return Err(format!("'{s}' matches nothing: give `namespace=<glob>`, `priorityClass=<glob>` or both"));
        }
        for part in settings.split(',').map(str::trim).filter(|p| !p.is_empty()) {
            match part.split_once('=').map(|(k, v)| (k.trim(), v.trim())) {
                Some(("mode", "skip")) => rule.mode = Some(None),
                Some(("mode", v)) => rule.mode = Some(Some(parse_mode(v, None)?)),
                Some(("grace", v)) => {
                    let g: i64 = v.parse().map_err(|_| format!("grace '{v}' in '{s}' is not a number of seconds"))?;
                    if g < 0 {
                        return Err(format!("grace '{v}' in '{s}' must not be negative"));
                    }
                    rule.grace_seconds = Some(g);
                }
                Some(("deadline", v)) => {
                    let d =
                        gpumedic_runtime::config::parse_duration(v).map_err(|e| format!("deadline in '{s}': {e}"))?;
                    if d.is_zero() {
                        return Err(format!("deadline in '{s}' must be more than zero"));
                    }
                    rule.deadline = Some(d);
                }
                _ => {
                    return Err(format!(
                        "'{part}' in '{s}' is not `mode=immediate|allow-completion|delete-after-timeout|skip`, \
                         `grace=<seconds>` or `deadline=<duration>`"
                    ));
                }
            }
        }
        if rule.mode.is_none() && rule.grace_seconds.is_none() && rule.deadline.is_none() {
            return Err(format!("'{s}' changes nothing: give a mode, a grace or a deadline"));
        }
        Ok(rule)
    }
}

/// A drain mode by name (`immediate`, `allow-completion`, `delete-after-timeout`), with `grace`.
pub fn parse_mode(name: &str, grace_seconds: Option<i64>) -> Result<DrainMode, String> {
    match name {
        "immediate" => Ok(DrainMode::Immediate { grace_seconds }),
        "allow-completion" => Ok(DrainMode::AllowCompletion),
        "delete-after-timeout" => Ok(DrainMode::DeleteAfterTimeout { grace_seconds }),
        other => Err(format!("'{other}' is not immediate, allow-completion or delete-after-timeout")),
    }
}

impl DrainPolicy {
    /// How `pod` leaves and how long it may take: the first matching rule over the drain's own
    /// mode and deadline; `None` when a rule leaves it on the node.
    pub fn for_pod(&self, pod: &Pod) -> Option<(DrainMode, Duration)> {
        let Some(rule) = self.rules.iter().find(|r| r.matches(pod)) else {
            return Some((self.mode, self.deadline));
        };
        let mode = match rule.mode {
            Some(None) => return None,
            Some(Some(m)) => m,
            None => self.mode,
        };
        let mode = match (mode, rule.grace_seconds) {
            (DrainMode::Immediate { .. }, Some(g)) => DrainMode::Immediate { grace_seconds: Some(g) },
            (DrainMode::DeleteAfterTimeout { .. }, Some(g)) => DrainMode::DeleteAfterTimeout { grace_seconds: Some(g) },
            (m, _) => m,
        };
        Some((mode, rule.deadline.unwrap_or(self.deadline)))
    }
}

impl Default for DrainPolicy {
    fn default() -> Self {
        Self {
            mode: DrainMode::Immediate { grace_seconds: None },
            include_namespaces: Vec::new(),
            exclude_namespaces: vec!["kube-system".to_owned()],
            deadline: Duration::from_secs(300),
            concurrency: 64,
            initial_backoff: Duration::from_millis(250),
            max_backoff: Duration::from_secs(5),
            poll: Duration::from_millis(250),
            rules: Vec::new(),
        }
    }
}

/// Why a pod stays on the node.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum SkipReason {
    /// Owned by a DaemonSet.
    DaemonSet,
    /// A mirror pod (the kubelet's copy of a static pod).
    Mirror,
    /// A static pod (from a file or URL on the node).
    Static,
    /// Already Succeeded or Failed.
    Finished,
    /// Its namespace is not drained.
    Namespace,
    /// Partial drain: it does not use the faulty GPU.
    OtherGpu,
    /// A drain rule (`mode=skip`) leaves it.
    Policy,
}

/// Whether one pod leaves.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Disposition {
    /// Evict it.
    Evict,
    /// Leave it.
    Skip(SkipReason),
}

/// A pod's namespace and name.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct PodRef {
    /// The namespace.
    pub namespace: String,
    /// The name.
    pub name: String,
}

impl std::fmt::Display for PodRef {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}/{}", self.namespace, self.name)
    }
}

/// Decides whether `pod` leaves the node in a drain of `scope` under `policy`.
pub fn classify(pod: &Pod, scope: &DrainScope, policy: &DrainPolicy) -> Disposition {
    let meta = &pod.metadata;
    let annotations = meta.annotations.as_ref();
    if annotations.is_some_and(|a| a.contains_key(MIRROR_ANNOTATION)) {
        return Disposition::Skip(SkipReason::Mirror);
    }
    if annotations.and_then(|a| a.get(SOURCE_ANNOTATION)).is_some_and(|s| s != "api") {
        return Disposition::Skip(SkipReason::Static);
    }
    if meta.owner_references.iter().flatten().any(|o| o.kind == "DaemonSet") {
        return Disposition::Skip(SkipReason::DaemonSet);
    }
    if pod.status.as_ref().and_then(|s| s.phase.as_deref()).is_some_and(|p| p == "Succeeded" || p == "Failed") {
        return Disposition::Skip(SkipReason::Finished);
    }
    let namespace = meta.namespace.as_deref().unwrap_or_default();
    let included = policy.include_namespaces.is_empty() || policy.include_namespaces.iter().any(|g| glob(g, namespace));
    if !included || policy.exclude_namespaces.iter().any(|g| glob(g, namespace)) {
        return Disposition::Skip(SkipReason::Namespace);
    }
    if let Some(gpu) = &scope.gpu
        && !on_gpu(pod, &gpu.uuid, gpu.index)
    {
        return Disposition::Skip(SkipReason::OtherGpu);
    }
    if policy.for_pod(pod).is_none() {
        return Disposition::Skip(SkipReason::Policy);
    }
    Disposition::Evict
}

/// Whether `pod` is workload on `gpu` (or, without one, on any of the node's GPUs): running or
/// pending, not a DaemonSet's, mirror or static pod (the device plugin and the exporters run on
/// every GPU node and are not workload).
pub fn is_workload_on(pod: &Pod, gpu: Option<&GpuRef>) -> bool {
    let policy = DrainPolicy { exclude_namespaces: Vec::new(), ..DrainPolicy::default() };
    if classify(pod, &DrainScope { gpu: gpu.cloned() }, &policy) != Disposition::Evict {
        return false;
    }
    match gpu {
        Some(g) => on_gpu(pod, &g.uuid, g.index),
        None => uses_any_gpu(pod),
    }
}

/// Whether `pod` uses any GPU: it lists GPUs (annotation or `NVIDIA_VISIBLE_DEVICES`, other than
/// `none`/`void`), or requests the GPU resource.
fn uses_any_gpu(pod: &Pod) -> bool {
    let lists = |v: &str| !v.trim().is_empty() && !matches!(v.trim(), "none" | "void");
    if let Some(list) = pod.metadata.annotations.as_ref().and_then(|a| a.get(GPU_UUIDS_ANNOTATION)) {
        return lists(list);
    }
    let Some(spec) = &pod.spec else { return false };
    spec.containers.iter().chain(spec.init_containers.iter().flatten()).any(|c| {
        let env = c.env.iter().flatten().find(|e| e.name == "NVIDIA_VISIBLE_DEVICES").and_then(|e| e.value.as_deref());
        let res = c.resources.as_ref();
        env.is_some_and(lists)
            || res.and_then(|r| r.limits.as_ref()).is_some_and(|l| l.contains_key(GPU_RESOURCE))
            || res.and_then(|r| r.requests.as_ref()).is_some_and(|l| l.contains_key(GPU_RESOURCE))
    })
}

/// The workload pods on `node` that use `gpu` (or any of its GPUs): what a deferred GPU reset
/// waits to see gone.
pub async fn workload_on(client: &kube::Client, node: &str, gpu: Option<&GpuRef>) -> Result<Vec<PodRef>, kube::Error> {
    let all: Api<Pod> = Api::all(client.clone());
    Ok(list_on_node(&all, node).await?.iter().filter(|p| is_workload_on(p, gpu)).map(pod_ref).collect())
}

/// Whether `pod` uses the GPU with `uuid` (or NVML `index`), by the convention in the module docs.
fn on_gpu(pod: &Pod, uuid: &str, index: Option<u32>) -> bool {
    let index = index.map(|i| i.to_string());
    let listed = |list: &str| {
        list.split(',')
            .map(str::trim)
            .any(|d| d == "all" || d.eq_ignore_ascii_case(uuid) || index.as_deref().is_some_and(|i| d == i))
    };
    if let Some(list) = pod.metadata.annotations.as_ref().and_then(|a| a.get(GPU_UUIDS_ANNOTATION)) {
        return listed(list);
    }
    let Some(spec) = &pod.spec else { return false };
    let containers = spec.containers.iter().chain(spec.init_containers.iter().flatten());
    let mut requests_gpu = false;
    for c in containers {
        if let Some(v) =
            c.env.iter().flatten().find(|e| e.name == "NVIDIA_VISIBLE_DEVICES").and_then(|e| e.value.as_deref())
        {
            return listed(v);
        }
        let res = c.resources.as_ref();
        requests_gpu |= res.and_then(|r| r.limits.as_ref()).is_some_and(|l| l.contains_key(GPU_RESOURCE))
            || res.and_then(|r| r.requests.as_ref()).is_some_and(|l| l.contains_key(GPU_RESOURCE));
    }
    requests_gpu
}

/// Shell-style glob on a name: `*` matches any run of characters, `?` exactly one.
pub fn glob(pattern: &str, name: &str) -> bool {
    let (p, n): (Vec<char>, Vec<char>) = (pattern.chars().collect(), name.chars().collect());
    let (mut pi, mut ni) = (0, 0);
    // Where the last `*` was and how much of the name it has eaten, to backtrack to.
    let mut star: Option<(usize, usize)> = None;
    while ni < n.len() {
        if pi < p.len() && (p[pi] == '?' || p[pi] == n[ni]) {
            pi += 1;
            ni += 1;
        } else if pi < p.len() && p[pi] == '*' {
            star = Some((pi, ni));
            pi += 1;
        } else if let Some((sp, sn)) = star {
            pi = sp + 1;
            ni = sn + 1;
            star = Some((sp, sn + 1));
        } else {
            return false;
        }
    }
    p[pi..].iter().all(|&c| c == '*')
}

/// What happened to each pod on the node.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct DrainReport {
    /// Evicted and gone.
    pub evicted: Vec<PodRef>,
    /// Gone on their own (allow-completion), or already gone when evicted.
    pub completed: Vec<PodRef>,
    /// Force-deleted at the deadline (delete-after-timeout).
    pub force_deleted: Vec<PodRef>,
    /// Left on the node on purpose.
    pub skipped: Vec<(PodRef, SkipReason)>,
    /// Still refused by a PodDisruptionBudget at the deadline, with the last refusal.
    pub blocked: Vec<(PodRef, String)>,
    /// Evicted (or awaited) but still present at the deadline.
    pub remaining: Vec<PodRef>,
    /// Eviction or deletion failed for another reason.
    pub failed: Vec<(PodRef, String)>,
}

impl DrainReport {
    /// Whether every pod that had to leave has left.
    pub fn complete(&self) -> bool {
        self.blocked.is_empty() && self.remaining.is_empty() && self.failed.is_empty()
    }

    /// A one-line summary for Events and logs.
    pub fn summary(&self) -> String {
        format!(
            "{} evicted, {} completed, {} force-deleted, {} skipped, {} blocked by a PodDisruptionBudget, {} still \
             terminating, {} failed",
            self.evicted.len(),
            self.completed.len(),
            self.force_deleted.len(),
            self.skipped.len(),
            self.blocked.len(),
            self.remaining.len(),
            self.failed.len()
        )
    }
}

enum Eviction {
    Accepted,
    Gone,
    Blocked(String),
    Failed(String),
}

/// Drains `node`: lists its pods, evicts (or awaits) those [`classify`] lets go, and reports
/// per pod. Returns an error only when the pods cannot be listed at all. `client` must be built
/// with `default_retry` off (see [`crate::apply::Remediator`]), or kube's own retry of HTTP 429
/// holds each refused eviction far past the deadline.
pub async fn drain(
    client: &kube::Client,
    node: &str,
    scope: &DrainScope,
    policy: &DrainPolicy,
) -> Result<DrainReport, DrainError> {
    drain_where(client, node, scope, policy, None).await
}

/// Drains from `node` only the pods `holders` says hold a quarantined DRA device (the partial
/// drain, driven by ResourceClaim allocations instead of GPU UUIDs); every other rule of
/// [`classify`] still applies, and the pods left are reported as on another GPU.
pub async fn drain_holders(
    client: &kube::Client,
    node: &str,
    holders: &crate::dra::Holders,
    policy: &DrainPolicy,
) -> Result<DrainReport, DrainError> {
    drain_where(client, node, &DrainScope { gpu: None }, policy, Some(holders)).await
}

async fn drain_where(
    client: &kube::Client,
    node: &str,
    scope: &DrainScope,
    policy: &DrainPolicy,
    holders: Option<&crate::dra::Holders>,
) -> Result<DrainReport, DrainError> {
    let started = Instant::now();
    let all: Api<Pod> = Api::all(client.clone());
    let pods = list_on_node(&all, node).await.map_err(|source| DrainError::List { node: node.to_owned(), source })?;
    let mut report = DrainReport::default();
    // The pods that leave, grouped by how (the drain's mode and deadline, or a rule's).
    let mut groups: std::collections::BTreeMap<(DrainMode, Duration), Vec<(PodRef, String)>> =
        std::collections::BTreeMap::new();
    for pod in &pods {
        let r = pod_ref(pod);
        let disposition = match classify(pod, scope, policy) {
            Disposition::Evict if holders.is_some_and(|h| !h.hold(pod)) => Disposition::Skip(SkipReason::OtherGpu),
            d => d,
        };
        match (disposition, policy.for_pod(pod)) {
            (Disposition::Evict, Some(how)) => {
                groups.entry(how).or_default().push((r, pod.metadata.uid.clone().unwrap_or_default()));
            }
            (Disposition::Evict, None) => report.skipped.push((r, SkipReason::Policy)),
            (Disposition::Skip(why), _) => report.skipped.push((r, why)),
        }
    }
    let parts = futures::future::join_all(groups.into_iter().map(|((mode, deadline), leaving)| {
        let all = all.clone();
        async move { drain_group(client, &all, node, leaving, mode, started + deadline, policy).await }
    }))
    .await;
    for part in parts {
        report.evicted.extend(part.evicted);
        report.completed.extend(part.completed);
        report.force_deleted.extend(part.force_deleted);
        report.blocked.extend(part.blocked);
        report.remaining.extend(part.remaining);
        report.failed.extend(part.failed);
    }
    for list in [&mut report.evicted, &mut report.completed, &mut report.force_deleted, &mut report.remaining] {
        list.sort();
    }
    report.skipped.sort();
    report.blocked.sort();
    report.failed.sort();
    Ok(report)
}

/// Drains `leaving` (pods of `node`, by reference and UID) in `mode` until `deadline`.
async fn drain_group(
    client: &kube::Client,
    all: &Api<Pod>,
    node: &str,
    leaving: Vec<(PodRef, String)>,
    mode: DrainMode,
    deadline: Instant,
    policy: &DrainPolicy,
) -> DrainReport {
    let mut report = DrainReport::default();
    let grace = match mode {
        DrainMode::Immediate { grace_seconds } | DrainMode::DeleteAfterTimeout { grace_seconds } => Some(grace_seconds),
        DrainMode::AllowCompletion => None,
    };
    // Pods that were asked to leave (or are awaited) and must be seen gone.
    let mut awaited: Vec<(PodRef, String)> = Vec::new();
    if let Some(grace_seconds) = grace {
        let outcomes: Vec<_> = futures::stream::iter(leaving.into_iter().map(|(r, uid)| {
            let client = client.clone();
            async move {
                let outcome = evict(&client, &r, grace_seconds, deadline, policy).await;
                (r, uid, outcome)
            }
        }))
        .buffer_unordered(policy.concurrency.max(1))
        .collect()
        .await;
        for (r, uid, outcome) in outcomes {
            match outcome {
                Eviction::Accepted => awaited.push((r, uid)),
                Eviction::Gone => report.completed.push(r),
                Eviction::Blocked(why) => report.blocked.push((r, why)),
                Eviction::Failed(why) => report.failed.push((r, why)),
            }
        }
    } else {
        awaited = leaving;
    }

    let still = wait_gone(all, node, &awaited, deadline, policy.poll).await;
    for (r, uid) in awaited {
        match (still.contains(&uid), grace) {
            (true, _) => report.remaining.push(r),
            (false, Some(_)) => report.evicted.push(r),
            (false, None) => report.completed.push(r),
        }
    }

    if matches!(mode, DrainMode::DeleteAfterTimeout { .. }) {
        let overdue: Vec<PodRef> = std::mem::take(&mut report.remaining)
            .into_iter()
            .chain(std::mem::take(&mut report.blocked).into_iter().map(|(r, _)| r))
            .collect();
        let deletes = futures::stream::iter(overdue.into_iter().map(|r| {
            let client = client.clone();
            async move {
                let api: Api<Pod> = Api::namespaced(client, &r.namespace);
                let dp = DeleteParams { grace_period_seconds: Some(0), ..DeleteParams::default() };
                let result = match api.delete(&r.name, &dp).await {
                    Ok(_) => Ok(()),
                    Err(kube::Error::Api(s)) if s.is_not_found() => Ok(()),
                    Err(e) => Err(e.to_string()),
                };
                (r, result)
            }
        }))
        .buffer_unordered(policy.concurrency.max(1))
        .collect::<Vec<_>>()
        .await;
        for (r, result) in deletes {
            match result {
                Ok(()) => report.force_deleted.push(r),
                Err(e) => report.failed.push((r, e)),
            }
        }
    }
    report
}

async fn list_on_node(all: &Api<Pod>, node: &str) -> Result<Vec<Pod>, kube::Error> {
    let lp = ListParams::default().fields(&format!("spec.nodeName={node}"));
    Ok(all.list(&lp).await?.items)
}

fn pod_ref(pod: &Pod) -> PodRef {
    PodRef {
        namespace: pod.metadata.namespace.clone().unwrap_or_default(),
        name: pod.metadata.name.clone().unwrap_or_default(),
    }
}

/// One eviction, retried with exponential backoff while a PodDisruptionBudget refuses it (429)
/// and the deadline allows.
async fn evict(
    client: &kube::Client,
    pod: &PodRef,
    grace_seconds: Option<i64>,
    deadline: Instant,
    policy: &DrainPolicy,
) -> Eviction {
    let api: Api<Pod> = Api::namespaced(client.clone(), &pod.namespace);
    // Built by hand rather than with `Api::evict`: kube 5 sends its delete options under the
    // key `delete_options`, which the API server ignores, so the grace period would be lost.
    let eviction = serde_json::json!({
        "apiVersion": "policy/v1",
        "kind": "Eviction",
        "metadata": { "name": pod.name, "namespace": pod.namespace },
        "deleteOptions": { "gracePeriodSeconds": grace_seconds },
    });
    let mut backoff = policy.initial_backoff;
    loop {
        let result: Result<kube::core::Status, _> =
            api.create_subresource("eviction", &pod.name, &PostParams::default(), &eviction).await;
        match result {
            Ok(_) => return Eviction::Accepted,
            Err(kube::Error::Api(s)) if s.is_not_found() => return Eviction::Gone,
            Err(kube::Error::Api(s)) if s.code == 429 => {
                let now = Instant::now();
                if now >= deadline {
                    return Eviction::Blocked(s.message);
                }
                tracing::debug!(pod = %pod, wait = ?backoff, reason = %s.message, "A PodDisruptionBudget refused an eviction; retrying.");
                tokio::time::sleep(backoff.min(deadline - now)).await;
                backoff = (backoff * 2).min(policy.max_backoff);
            }
            Err(e) => return Eviction::Failed(e.to_string()),
        }
    }
}

/// Polls the node's pods until none of `awaited` (by UID, so a replacement with the same name
/// does not count) is left or the deadline passes; returns the UIDs still there.
async fn wait_gone(
    all: &Api<Pod>,
    node: &str,
    awaited: &[(PodRef, String)],
    deadline: Instant,
    poll: Duration,
) -> BTreeSet<String> {
    let wanted: BTreeSet<String> = awaited.iter().map(|(_, uid)| uid.clone()).collect();
    let mut still = wanted.clone();
    while !still.is_empty() {
        match list_on_node(all, node).await {
            Ok(pods) => {
                still = pods
                    .iter()
                    .filter(|p| {
                        // A pod that finished counts as gone: it no longer holds the GPU.
                        let finished = p
                            .status
                            .as_ref()
                            .and_then(|s| s.phase.as_deref())
                            .is_some_and(|ph| ph == "Succeeded" || ph == "Failed");
                        !finished
                    })
                    .filter_map(|p| p.metadata.uid.clone())
                    .filter(|uid| wanted.contains(uid))
                    .collect();
            }
            Err(e) => {
                tracing::warn!(node, error = %e, "Listing the node's pods failed while waiting for them to leave.")
            }
        }
        if still.is_empty() || Instant::now() >= deadline {
            break;
        }
        tokio::time::sleep(poll.min(deadline.saturating_duration_since(Instant::now()))).await;
    }
    still
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::request::GpuRef;
    use serde_json::json;

    fn pod(v: serde_json::Value) -> Pod {
        serde_json::from_value(v).unwrap()
    }

    fn all() -> DrainScope {
        DrainScope { gpu: None }
    }

    fn gpu0() -> DrainScope {
        DrainScope { gpu: Some(GpuRef { uuid: "GPU-aaa".into(), pci_bus_id: "0000:3b:00.0".into(), index: Some(0) }) }
    }

    #[test]
    fn globs_match_like_a_shell() {
        assert!(glob("*", "anything"));
        assert!(glob("kube-*", "kube-system"));
        assert!(!glob("kube-*", "default"));
        assert!(glob("team-?-prod", "team-a-prod"));
        assert!(!glob("team-?-prod", "team-ab-prod"));
        assert!(glob("*-prod*", "ml-prod-east"));
        assert!(glob("a*b*c", "aXXbYYc"));
        assert!(!glob("a*b*c", "aXXbYY"));
        assert!(glob("", ""));
        assert!(!glob("", "x"));
    }

    #[test]
    fn daemonset_mirror_static_and_finished_pods_stay() {
        let p = DrainPolicy::default();
        let ds = pod(json!({"metadata": {"name": "a", "namespace": "ml", "ownerReferences": [
            {"apiVersion": "apps/v1", "kind": "DaemonSet", "name": "dcgm", "uid": "u"}]}}));
        assert_eq!(classify(&ds, &all(), &p), Disposition::Skip(SkipReason::DaemonSet));
        let mirror = pod(json!({"metadata": {"name": "a", "namespace": "ml",
            "annotations": {MIRROR_ANNOTATION: "abc", SOURCE_ANNOTATION: "file"}}}));
        assert_eq!(classify(&mirror, &all(), &p), Disposition::Skip(SkipReason::Mirror));
        let stat =
            pod(json!({"metadata": {"name": "a", "namespace": "ml", "annotations": {SOURCE_ANNOTATION: "file"}}}));
        assert_eq!(classify(&stat, &all(), &p), Disposition::Skip(SkipReason::Static));
        let done = pod(json!({"metadata": {"name": "a", "namespace": "ml"}, "status": {"phase": "Succeeded"}}));
        assert_eq!(classify(&done, &all(), &p), Disposition::Skip(SkipReason::Finished));
        let rs = pod(json!({"metadata": {"name": "a", "namespace": "ml", "ownerReferences": [
            {"apiVersion": "apps/v1", "kind": "ReplicaSet", "name": "r", "uid": "u"}]}}));
        assert_eq!(classify(&rs, &all(), &p), Disposition::Evict);
    }

    #[test]
    fn drain_rules_parse_and_every_mistake_says_what_is_wrong() {
        let r: DrainRule =
            "namespace=ml-*,priorityClass=low:mode=delete-after-timeout,grace=30,deadline=2m".parse().unwrap();
        assert_eq!(
            r,
            DrainRule {
                namespace: Some("ml-*".into()),
                priority_class: Some("low".into()),
                mode: Some(Some(DrainMode::DeleteAfterTimeout { grace_seconds: None })),
                grace_seconds: Some(30),
                deadline: Some(Duration::from_secs(120)),
            }
        );
        assert_eq!("priorityClass=system-*:mode=skip".parse::<DrainRule>().unwrap().mode, Some(None));
        for (bad, says) in [
            ("namespace=a", "needs `<match>:<settings>`"),
            (":mode=skip", "matches nothing"),
            ("node=a:mode=skip", "is not `namespace=<glob>`"),
            ("namespace=a:mode=gently", "is not immediate, allow-completion or delete-after-timeout"),
            ("namespace=a:grace=-1", "must not be negative"),
            ("namespace=a:deadline=0s", "must be more than zero"),
            ("namespace=a:", "changes nothing"),
        ] {
            let e = bad.parse::<DrainRule>().expect_err(bad);
            assert!(e.contains(says), "{bad}: {e}");
        }
    }

    #[test]
    fn the_first_matching_rule_decides_how_a_pod_leaves() {
        let policy = DrainPolicy {
            mode: DrainMode::Immediate { grace_seconds: Some(5) },
            rules: vec![
                "priorityClass=system-*:mode=skip".parse().unwrap(),
                "namespace=serving:mode=allow-completion,deadline=30m".parse().unwrap(),
                "namespace=serving-*:grace=60".parse().unwrap(),
            ],
            ..DrainPolicy::default()
        };
        let with = |ns: &str, class: Option<&str>| {
            let mut p = pod(json!({"metadata": {"name": "a", "namespace": ns}}));
            p.spec.get_or_insert_with(Default::default).priority_class_name = class.map(str::to_owned);
            p
        };
        assert_eq!(policy.for_pod(&with("serving", Some("system-node-critical"))), None);
        assert_eq!(
            policy.for_pod(&with("serving", None)),
            Some((DrainMode::AllowCompletion, Duration::from_secs(1800)))
        );
        assert_eq!(
            policy.for_pod(&with("serving-eu", None)),
            Some((DrainMode::Immediate { grace_seconds: Some(60) }, policy.deadline))
        );
        assert_eq!(policy.for_pod(&with("batch", None)), Some((policy.mode, policy.deadline)));
        assert_eq!(
            classify(&with("batch", Some("system-cluster-critical")), &all(), &policy),
            Disposition::Skip(SkipReason::Policy)
        );
    }

    #[test]
    fn namespace_globs_include_and_exclude() {
        let p = DrainPolicy {
            include_namespaces: vec!["ml-*".into()],
            exclude_namespaces: vec!["ml-infra".into()],
            ..DrainPolicy::default()
        };
        let in_ns = |ns: &str| pod(json!({"metadata": {"name": "a", "namespace": ns}}));
        assert_eq!(classify(&in_ns("ml-train"), &all(), &p), Disposition::Evict);
        assert_eq!(classify(&in_ns("ml-infra"), &all(), &p), Disposition::Skip(SkipReason::Namespace));
        assert_eq!(classify(&in_ns("web"), &all(), &p), Disposition::Skip(SkipReason::Namespace));
        assert_eq!(
            classify(&in_ns("kube-system"), &all(), &DrainPolicy::default()),
            Disposition::Skip(SkipReason::Namespace)
        );
    }

    #[test]
    fn partial_drain_takes_only_pods_on_the_faulty_gpu() {
        let p = DrainPolicy::default();
        let annotated = |uuids: &str| {
            pod(json!({"metadata": {"name": "a", "namespace": "ml", "annotations": {GPU_UUIDS_ANNOTATION: uuids}}}))
        };
        assert_eq!(classify(&annotated("GPU-bbb, GPU-aaa"), &gpu0(), &p), Disposition::Evict);
        assert_eq!(classify(&annotated("GPU-bbb"), &gpu0(), &p), Disposition::Skip(SkipReason::OtherGpu));
        assert_eq!(classify(&annotated("GPU-bbb"), &all(), &p), Disposition::Evict, "a full drain takes everyone");
        let env = |v: &str| {
            pod(json!({"metadata": {"name": "a", "namespace": "ml"}, "spec": {"containers": [
                {"name": "c", "env": [{"name": "NVIDIA_VISIBLE_DEVICES", "value": v}]}]}}))
        };
        assert_eq!(classify(&env("0,1"), &gpu0(), &p), Disposition::Evict);
        assert_eq!(classify(&env("2"), &gpu0(), &p), Disposition::Skip(SkipReason::OtherGpu));
        assert_eq!(classify(&env("all"), &gpu0(), &p), Disposition::Evict);
        let unknown = pod(json!({"metadata": {"name": "a", "namespace": "ml"}, "spec": {"containers": [
            {"name": "c", "resources": {"limits": {"nvidia.com/gpu": "1"}}}]}}));
        assert_eq!(classify(&unknown, &gpu0(), &p), Disposition::Evict, "unknown allocation is evicted");
        let cpu_only =
            pod(json!({"metadata": {"name": "a", "namespace": "ml"}, "spec": {"containers": [{"name": "c"}]}}));
        assert_eq!(classify(&cpu_only, &gpu0(), &p), Disposition::Skip(SkipReason::OtherGpu));
    }

    #[test]
    fn an_unknown_index_matches_by_uuid_only() {
        let p = DrainPolicy::default();
        let no_index =
            DrainScope { gpu: Some(GpuRef { uuid: "GPU-aaa".into(), pci_bus_id: String::new(), index: None }) };
        let env = |v: &str| {
            pod(json!({"metadata": {"name": "a", "namespace": "ml"}, "spec": {"containers": [
                {"name": "c", "env": [{"name": "NVIDIA_VISIBLE_DEVICES", "value": v}]}]}}))
        };
        assert_eq!(
            classify(&env("0"), &no_index, &p),
            Disposition::Skip(SkipReason::OtherGpu),
            "not index 0 by default"
        );
        assert_eq!(classify(&env("GPU-aaa"), &no_index, &p), Disposition::Evict);
    }

    #[test]
    fn workload_is_what_uses_the_gpu_and_is_not_infrastructure() {
        let gpu = GpuRef { uuid: "GPU-aaa".into(), pci_bus_id: String::new(), index: Some(0) };
        let job = |uuids: &str| {
            pod(json!({"metadata": {"name": "a", "namespace": "ml", "annotations": {GPU_UUIDS_ANNOTATION: uuids}}}))
        };
        assert!(is_workload_on(&job("GPU-aaa"), Some(&gpu)));
        assert!(!is_workload_on(&job("GPU-bbb"), Some(&gpu)));
        assert!(is_workload_on(&job("GPU-bbb"), None), "any GPU counts for a node-wide action");
        assert!(!is_workload_on(&job("none"), None));
        let plugin = pod(json!({"metadata": {"name": "a", "namespace": "kube-system",
            "annotations": {GPU_UUIDS_ANNOTATION: "all"},
            "ownerReferences": [{"apiVersion": "apps/v1", "kind": "DaemonSet", "name": "dp", "uid": "u"}]}}));
        assert!(!is_workload_on(&plugin, Some(&gpu)), "the device plugin is not workload");
        let done =
            pod(json!({"metadata": {"name": "a", "namespace": "ml", "annotations": {GPU_UUIDS_ANNOTATION: "GPU-aaa"}},
            "status": {"phase": "Succeeded"}}));
        assert!(!is_workload_on(&done, Some(&gpu)));
        let requests = pod(json!({"metadata": {"name": "a", "namespace": "ml"}, "spec": {"containers": [
            {"name": "c", "resources": {"limits": {"nvidia.com/gpu": "1"}}}]}}));
        assert!(is_workload_on(&requests, None));
        let cpu_only =
            pod(json!({"metadata": {"name": "a", "namespace": "ml"}, "spec": {"containers": [{"name": "c"}]}}));
        assert!(!is_workload_on(&cpu_only, None));
    }
}
