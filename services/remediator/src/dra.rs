//! GPU-level quarantine in clusters that allocate GPUs through Dynamic Resource Allocation.
//!
//! Where the NVIDIA DRA driver publishes the node's GPUs as devices of driver `gpu.nvidia.com`
//! in `ResourceSlice`s (one pool per node, a device per GPU with its `uuid` attribute), a
//! GPU-scoped fault takes only that GPU out: a `DeviceTaintRule` (`resource.k8s.io/v1beta2`)
//! taints the device `NoSchedule`, the pods whose `ResourceClaim`s are allocated the device are
//! evicted, and the node stays schedulable for its healthy GPUs.
//!
//! The rule's name is deterministic from node and GPU ([`rule_name`]), so a redelivered verdict
//! or a restarted remediator never makes a second one. gpumedic's rules carry
//! [`MANAGED_BY_LABEL`]` = gpumedic` and the incidents that hold them ([`INCIDENTS_ANNOTATION`]);
//! recovery removes its incident and deletes the rule once none is left, and never touches a rule
//! without gpumedic's label.
//!
//! The decisions (which device a UUID names, which pods hold it, whether a node has so many GPUs
//! out that it goes out whole) are pure functions here; the reads and writes are thin helpers
//! the edge ([`crate::apply`]) calls.

use std::collections::{BTreeMap, BTreeSet};

use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::api::resource::v1::{ResourceClaim, ResourceSlice};
use k8s_openapi::api::resource::v1beta2::{DeviceTaint, DeviceTaintRule, DeviceTaintRuleSpec, DeviceTaintSelector};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::api::{Api, DeleteParams, ListParams, Patch, PatchParams, PostParams, Preconditions};
use serde_json::json;

use crate::drain::PodRef;
use crate::request::{Action, Remediation};

pub mod cache;

pub use cache::DraCache;

/// The driver whose devices are the node's GPUs.
pub const DRIVER: &str = "gpu.nvidia.com";
/// The label every rule gpumedic creates carries (`gpumedic`); rules without it are never
/// changed or deleted.
pub const MANAGED_BY_LABEL: &str = "app.kubernetes.io/managed-by";
/// The value of [`MANAGED_BY_LABEL`] on gpumedic's rules.
pub const MANAGED_BY: &str = "gpumedic";
/// The label naming the node a rule's device is on (see [`node_label_value`]).
pub const NODE_LABEL: &str = "gpumedic.io/node";
/// The annotation with the node's full name.
pub const NODE_ANNOTATION: &str = "gpumedic.io/node";
/// The annotation with the quarantined GPU's UUID.
pub const GPU_ANNOTATION: &str = "gpumedic.io/gpu-uuid";
/// The annotation listing the open incidents that hold the rule, comma-separated.
pub const INCIDENTS_ANNOTATION: &str = "gpumedic.io/incidents";
/// The annotation set to `true` once the pods holding the device have all left.
pub const DRAINED_ANNOTATION: &str = "gpumedic.io/drained";
/// The node label naming the GPU gpumedic found faulty (the latest), so schedulers and people
/// that read labels can avoid it where no DeviceTaintRule can.
pub const GPU_LABEL: &str = "gpumedic.io/unhealthy-gpu";

/// What went wrong reading or writing DRA objects.
#[derive(Debug, thiserror::Error)]
pub enum DraError {
    /// The node's ResourceSlices could not be listed.
    #[error("cannot list the ResourceSlices of node {node}: {source}")]
    Slices {
        /// The node.
        node: String,
        /// The API error.
        #[source]
        source: kube::Error,
    },
    /// ResourceClaims could not be listed.
    #[error("cannot list ResourceClaims: {0}")]
    Claims(#[source] kube::Error),
    /// A DeviceTaintRule could not be read, created, changed or deleted.
    #[error("cannot write DeviceTaintRule {rule}: {source}")]
    Rule {
        /// The rule.
        rule: String,
        /// The API error.
        #[source]
        source: kube::Error,
    },
    /// The rule changed under every attempt to write it.
    #[error("DeviceTaintRule {rule} changed under every attempt to write it")]
    Conflict {
        /// The rule.
        rule: String,
    },
    /// gpumedic's DeviceTaintRules could not be listed.
    #[error("cannot list gpumedic's DeviceTaintRules: {0}")]
    Rules(#[source] kube::Error),
}

/// The switches of GPU-level quarantine.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct GpuQuarantine {
    /// Quarantine single GPUs where the node publishes them through DRA; off: always the node.
    pub enabled: bool,
    /// The share (0..=1) of a node's GPUs that may be quarantined one by one; one more takes
    /// the whole node out.
    pub max_share: f64,
}

impl Default for GpuQuarantine {
    fn default() -> Self {
        Self { enabled: true, max_share: 0.5 }
    }
}

/// One device, as a DeviceTaintRule selects it.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub struct DeviceRef {
    /// The driver (`gpu.nvidia.com`).
    pub driver: String,
    /// The pool (the NVIDIA driver names it after the node).
    pub pool: String,
    /// The device's name in the pool (`gpu-0`).
    pub device: String,
}

impl std::fmt::Display for DeviceRef {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}/{}/{}", self.driver, self.pool, self.device)
    }
}

/// Whether `action` for a request that names a GPU may stay on that GPU: quarantining actions
/// that are not about the node (a reboot or a replacement needs the whole node empty), and, in
/// full-remediation, none that starts the repair ladder (its steps may escalate to a reboot,
/// which needs the node drained).
pub fn gpu_scoped(action: Action, full_remediation: bool) -> bool {
    action.quarantines()
        && !matches!(action, Action::RebootNode | Action::ReplaceNode)
        && !(full_remediation && action.repairs())
}

/// The device attribute `name` as a string: unqualified (the driver's own domain) or qualified
/// with the driver's name.
fn attribute<'a>(device: &'a k8s_openapi::api::resource::v1::Device, name: &str) -> Option<&'a str> {
    let attrs = device.attributes.as_ref()?;
    attrs.get(name).or_else(|| attrs.get(&format!("{DRIVER}/{name}"))).and_then(|a| a.string.as_deref())
}

/// One whole GPU a node publishes: the device a rule selects and the GPU's UUID.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Gpu {
    /// The device.
    pub device: DeviceRef,
    /// Its `uuid` attribute.
    pub uuid: String,
}

/// The whole GPUs among `slices` (devices of driver [`DRIVER`] whose UUID is a GPU's: a MIG
/// device has a `MIG-` UUID of its own).
pub fn gpus(slices: &[ResourceSlice]) -> Vec<Gpu> {
    slices
        .iter()
        .filter(|s| s.spec.driver == DRIVER)
        .flat_map(|s| s.spec.devices.iter().flatten().map(move |d| (s, d)))
        .filter_map(|(s, d)| {
            let uuid = attribute(d, "uuid")?;
            uuid.get(..4).is_some_and(|p| p.eq_ignore_ascii_case("GPU-")).then(|| Gpu {
                device: DeviceRef {
                    driver: s.spec.driver.clone(),
                    pool: s.spec.pool.name.clone(),
                    device: d.name.clone(),
                },
                uuid: uuid.to_owned(),
            })
        })
        .collect()
}

/// The device among `gpus` whose UUID is `uuid` (case-insensitive).
pub fn find_device(gpus: &[Gpu], uuid: &str) -> Option<DeviceRef> {
    gpus.iter().find(|g| g.uuid.eq_ignore_ascii_case(uuid)).map(|g| g.device.clone())
}

/// How many whole GPUs `gpus` are (a device published twice counts once).
pub fn gpu_count(gpus: &[Gpu]) -> usize {
    gpus.iter().map(|g| (g.device.pool.as_str(), g.device.device.as_str())).collect::<BTreeSet<_>>().len()
}

/// Whether quarantining `quarantined` of the node's `total` GPUs one by one is too many, so the
/// node goes out whole: more than `max_share` of them.
pub fn escalates(quarantined: usize, total: usize, max_share: f64) -> bool {
    total == 0 || quarantined as f64 > max_share * total as f64
}

/// A label value for `node`: the name when it fits a label value (63 characters), else a digest.
pub fn node_label_value(node: &str) -> String {
    if node.len() <= 63 { node.to_owned() } else { format!("h-{}", &digest(node)[..32]) }
}

fn digest(s: &str) -> String {
    hex::encode(ring::digest::digest(&ring::digest::SHA256, s.as_bytes()).as_ref())
}

/// The name of gpumedic's rule for GPU `uuid` on `node`: readable when it fits a name (253
/// characters), else a digest of both; the same for the same pair, always.
pub fn rule_name(node: &str, uuid: &str) -> String {
    let name = format!("gpumedic-{node}-{}", uuid.to_ascii_lowercase());
    if name.len() <= 253 && name.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-' || b == b'.')
    {
        name
    } else {
        format!("gpumedic-{}", &digest(&format!("{node}/{uuid}"))[..40])
    }
}

/// The rule gpumedic writes to quarantine `device`, GPU `uuid` of `node`, for `request`.
pub fn rule(node: &str, uuid: &str, device: &DeviceRef, request: &Remediation) -> DeviceTaintRule {
    DeviceTaintRule {
        metadata: ObjectMeta {
            name: Some(rule_name(node, uuid)),
            labels: Some(BTreeMap::from([
                (MANAGED_BY_LABEL.to_owned(), MANAGED_BY.to_owned()),
                (NODE_LABEL.to_owned(), node_label_value(node)),
            ])),
            annotations: Some(BTreeMap::from([
                (NODE_ANNOTATION.to_owned(), node.to_owned()),
                (GPU_ANNOTATION.to_owned(), uuid.to_owned()),
                (INCIDENTS_ANNOTATION.to_owned(), request.incident_id.clone()),
            ])),
            ..ObjectMeta::default()
        },
        spec: DeviceTaintRuleSpec {
            device_selector: Some(DeviceTaintSelector {
                driver: Some(device.driver.clone()),
                pool: Some(device.pool.clone()),
                device: Some(device.device.clone()),
            }),
            taint: DeviceTaint {
                key: crate::plan::TAINT_KEY.to_owned(),
                value: Some(request.subsystem.as_str().to_owned()),
                effect: "NoSchedule".to_owned(),
                time_added: None,
            },
        },
        status: None,
    }
}

/// Whether gpumedic made `rule`.
pub fn owned(rule: &DeviceTaintRule) -> bool {
    rule.metadata.labels.as_ref().and_then(|l| l.get(MANAGED_BY_LABEL)).is_some_and(|v| v == MANAGED_BY)
}

/// The incidents that hold `rule`.
pub fn incidents(rule: &DeviceTaintRule) -> BTreeSet<String> {
    rule.metadata
        .annotations
        .as_ref()
        .and_then(|a| a.get(INCIDENTS_ANNOTATION))
        .map(|v| v.split(',').map(str::trim).filter(|s| !s.is_empty()).map(str::to_owned).collect())
        .unwrap_or_default()
}

/// Whether the pods holding `rule`'s device have all left.
pub fn drained(rule: &DeviceTaintRule) -> bool {
    rule.metadata.annotations.as_ref().and_then(|a| a.get(DRAINED_ANNOTATION)).is_some_and(|v| v == "true")
}

/// Whether `rule` is about `node` (by its annotation; the label may be a digest).
pub fn on_node(rule: &DeviceTaintRule, node: &str) -> bool {
    rule.metadata.annotations.as_ref().and_then(|a| a.get(NODE_ANNOTATION)).is_some_and(|n| n == node)
}

/// Which pods hold a device: the claims allocated it (by namespace and name) and the pods they
/// are reserved for.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Holders {
    /// `(namespace, claim)` of every claim allocated the device.
    pub claims: BTreeSet<(String, String)>,
    /// The pods the claims are reserved for.
    pub pods: BTreeSet<PodRef>,
}

impl Holders {
    /// The holders of `device` among `claims`: a claim holds it when its `status.allocation`
    /// names the device (as the scheduler writes it).
    pub fn of(device: &DeviceRef, claims: &[ResourceClaim]) -> Self {
        let mut holders = Holders::default();
        for claim in claims {
            let Some(status) = &claim.status else { continue };
            let allocated = status
                .allocation
                .as_ref()
                .and_then(|a| a.devices.as_ref())
                .and_then(|d| d.results.as_ref())
                .is_some_and(|rs| {
                    rs.iter().any(|r| r.driver == device.driver && r.pool == device.pool && r.device == device.device)
                });
            if !allocated {
                continue;
            }
            let namespace = claim.metadata.namespace.clone().unwrap_or_default();
            holders.claims.insert((namespace.clone(), claim.metadata.name.clone().unwrap_or_default()));
            for consumer in status.reserved_for.iter().flatten() {
                if consumer.resource == "pods" && consumer.api_group.as_deref().is_none_or(str::is_empty) {
                    holders.pods.insert(PodRef { namespace: namespace.clone(), name: consumer.name.clone() });
                }
            }
        }
        holders
    }

    /// Whether `pod` holds the device: it is a consumer a claim is reserved for, or it refers to
    /// one of the claims (by name, or through the claim generated from its template).
    pub fn hold(&self, pod: &Pod) -> bool {
        let namespace = pod.metadata.namespace.clone().unwrap_or_default();
        let name = pod.metadata.name.clone().unwrap_or_default();
        if self.pods.contains(&PodRef { namespace: namespace.clone(), name }) {
            return true;
        }
        let named = pod
            .spec
            .iter()
            .flat_map(|s| s.resource_claims.iter().flatten())
            .filter_map(|c| c.resource_claim_name.clone());
        let generated = pod
            .status
            .iter()
            .flat_map(|s| s.resource_claim_statuses.iter().flatten())
            .filter_map(|c| c.resource_claim_name.clone());
        named.chain(generated).any(|claim| self.claims.contains(&(namespace.clone(), claim)))
    }
}

/// Whether `e` says the cluster does not serve the resource (no DRA, or no DeviceTaintRules):
/// then gpumedic has none of them to release.
pub fn unserved(e: &DraError) -> bool {
    match e {
        DraError::Slices { source, .. } | DraError::Rule { source, .. } => not_found(source),
        DraError::Claims(source) => not_found(source),
        // A role that may not list DeviceTaintRules could not have made any either.
        DraError::Rules(source) => not_found(source) || matches!(source, kube::Error::Api(s) if s.is_forbidden()),
        DraError::Conflict { .. } => false,
    }
}

fn not_found(e: &kube::Error) -> bool {
    matches!(e, kube::Error::Api(s) if s.is_not_found())
}

/// The ResourceSlices of driver [`DRIVER`] published for `node`.
pub async fn slices_on(client: &kube::Client, node: &str) -> Result<Vec<ResourceSlice>, DraError> {
    let api: Api<ResourceSlice> = Api::all(client.clone());
    let lp = ListParams::default().fields(&format!("spec.nodeName={node},spec.driver={DRIVER}"));
    api.list(&lp).await.map(|l| l.items).map_err(|source| DraError::Slices { node: node.to_owned(), source })
}

/// The pods and claims holding `device`.
pub async fn holders(client: &kube::Client, device: &DeviceRef) -> Result<Holders, DraError> {
    let api: Api<ResourceClaim> = Api::all(client.clone());
    let claims = api.list(&ListParams::default()).await.map_err(DraError::Claims)?;
    Ok(Holders::of(device, &claims.items))
}

/// gpumedic's rules for devices on `node`.
pub async fn rules_on(client: &kube::Client, node: &str) -> Result<Vec<DeviceTaintRule>, DraError> {
    let api: Api<DeviceTaintRule> = Api::all(client.clone());
    let lp = ListParams::default()
        .labels(&format!("{MANAGED_BY_LABEL}={MANAGED_BY},{NODE_LABEL}={}", node_label_value(node)));
    let rules = api.list(&lp).await.map_err(DraError::Rules)?;
    Ok(rules.items.into_iter().filter(|r| owned(r) && on_node(r, node)).collect())
}

/// Every rule gpumedic made, by name, with when it was made: the GPU quarantines a new leader
/// counts against the breaker.
pub async fn quarantined_gpus(client: &kube::Client) -> Result<Vec<(String, chrono::DateTime<chrono::Utc>)>, DraError> {
    let api: Api<DeviceTaintRule> = Api::all(client.clone());
    let lp = ListParams::default().labels(&format!("{MANAGED_BY_LABEL}={MANAGED_BY}"));
    let rules = api.list(&lp).await.map_err(DraError::Rules)?;
    Ok(rules
        .items
        .into_iter()
        .filter(owned)
        .filter_map(|r| {
            let created = chrono::DateTime::from_timestamp_millis(r.metadata.creation_timestamp?.0.as_millisecond())?;
            Some((r.metadata.name?, created))
        })
        .collect())
}

/// What [`ensure_rule`] found or did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Ensured {
    /// The rule was created.
    Created,
    /// gpumedic's rule was there; the incident was added to it.
    Joined,
    /// gpumedic's rule was there with the incident already; `drained` says whether its pods
    /// have all left.
    Present {
        /// Whether the holders have left.
        drained: bool,
    },
    /// A rule of that name exists that gpumedic did not create; it is left alone.
    Foreign,
}

/// Makes sure gpumedic's rule `wanted` exists and names `incident`; `exists` says whether the
/// caller saw it already (then it is read first rather than created).
///
/// Every rule written goes into `cache` as the apiserver answered it, so the node's next verdict
/// counts it.
pub async fn ensure_rule(
    client: &kube::Client,
    cache: &DraCache,
    wanted: &DeviceTaintRule,
    incident: &str,
    exists: bool,
) -> Result<Ensured, DraError> {
    let api: Api<DeviceTaintRule> = Api::all(client.clone());
    let name = wanted.metadata.name.clone().unwrap_or_default();
    let err = |source| DraError::Rule { rule: name.clone(), source };
    // Create first: a new quarantine (the common case, and the one a mass failure is made of)
    // costs one call; a rule already there answers 409 and is read.
    let mut create = !exists;
    for _ in 0..5 {
        if create {
            match api.create(&PostParams::default(), wanted).await {
                Ok(created) => {
                    cache.wrote(&created);
                    return Ok(Ensured::Created);
                }
                Err(kube::Error::Api(s)) if s.is_already_exists() => {}
                Err(source) => return Err(err(source)),
            }
        }
        let Some(existing) = api.get_opt(&name).await.map_err(err)? else {
            // Deleted in between (a recovery): create it again.
            create = true;
            continue;
        };
        create = false;
        if !owned(&existing) {
            return Ok(Ensured::Foreign);
        }
        let mut held = incidents(&existing);
        if held.contains(incident) {
            return Ok(Ensured::Present { drained: drained(&existing) });
        }
        held.insert(incident.to_owned());
        let patch = json!({ "metadata": {
            "resourceVersion": existing.metadata.resource_version,
            "annotations": { INCIDENTS_ANNOTATION: held.into_iter().collect::<Vec<_>>().join(","), DRAINED_ANNOTATION: null },
        } });
        match api.patch(&name, &PatchParams::default(), &Patch::Merge(&patch)).await {
            Ok(joined) => {
                cache.wrote(&joined);
                return Ok(Ensured::Joined);
            }
            Err(kube::Error::Api(s)) if s.is_conflict() || s.is_already_exists() => continue,
            Err(source) => return Err(err(source)),
        }
    }
    Err(DraError::Conflict { rule: name })
}

/// Marks gpumedic's rule `name` as drained (its holders have all left), so a redelivered verdict
/// does not drain again.
pub async fn mark_drained(client: &kube::Client, cache: &DraCache, name: &str) -> Result<(), DraError> {
    let api: Api<DeviceTaintRule> = Api::all(client.clone());
    let patch = json!({ "metadata": { "annotations": { DRAINED_ANNOTATION: "true" } } });
    api.patch(name, &PatchParams::default(), &Patch::Merge(&patch))
        .await
        .map(|marked| cache.wrote(&marked))
        .map_err(|source| DraError::Rule { rule: name.to_owned(), source })
}

/// Removes `incident` from gpumedic's rules on `node`, deleting each that no open incident holds
/// any more. Returns the names of the rules deleted. Rules gpumedic did not create are never
/// listed here, so never touched. The rules are listed from the apiserver, not the cache: each
/// write is guarded by the version read, and a stale one would only fail. Each write goes into
/// `cache`.
pub async fn release(
    client: &kube::Client,
    cache: &DraCache,
    node: &str,
    incident: &str,
) -> Result<Vec<String>, DraError> {
    let api: Api<DeviceTaintRule> = Api::all(client.clone());
    let mut deleted = Vec::new();
    for rule in rules_on(client, node).await? {
        let name = rule.metadata.name.clone().unwrap_or_default();
        let mut held = incidents(&rule);
        if !held.remove(incident) {
            continue;
        }
        let err = |source| DraError::Rule { rule: name.clone(), source };
        // The resourceVersion guards both writes: an incident added meanwhile keeps the rule.
        let version = rule.metadata.resource_version.clone();
        let result = if held.is_empty() {
            let dp = DeleteParams {
                preconditions: Some(Preconditions { resource_version: version, uid: rule.metadata.uid.clone() }),
                ..DeleteParams::default()
            };
            api.delete(&name, &dp).await.map(|_| {
                cache.deleted(&name, rule.metadata.resource_version.as_deref());
                true
            })
        } else {
            let patch = json!({ "metadata": { "resourceVersion": version,
                "annotations": { INCIDENTS_ANNOTATION: held.into_iter().collect::<Vec<_>>().join(",") } } });
            api.patch(&name, &PatchParams::default(), &Patch::Merge(&patch)).await.map(|kept| {
                cache.wrote(&kept);
                false
            })
        };
        match result {
            Ok(true) => deleted.push(name),
            Ok(false) => {}
            Err(kube::Error::Api(s)) if s.is_not_found() => {
                cache.deleted(&name, rule.metadata.resource_version.as_deref())
            }
            Err(source) => return Err(err(source)),
        }
    }
    Ok(deleted)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn slice(node: &str, devices: &[(&str, &str)]) -> ResourceSlice {
        serde_json::from_value(json!({
            "apiVersion": "resource.k8s.io/v1", "kind": "ResourceSlice",
            "metadata": { "name": format!("{node}-gpu.nvidia.com-abc") },
            "spec": {
                "driver": DRIVER, "nodeName": node,
                "pool": { "name": node, "generation": 1, "resourceSliceCount": 1 },
                "devices": devices.iter().map(|(name, uuid)| json!({
                    "name": name,
                    "attributes": { "uuid": { "string": uuid }, "type": { "string": "gpu" } },
                })).collect::<Vec<_>>(),
            }
        }))
        .unwrap()
    }

    fn claim(ns: &str, name: &str, device: &str, reserved: &[&str]) -> ResourceClaim {
        serde_json::from_value(json!({
            "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
            "metadata": { "name": name, "namespace": ns },
            "spec": {},
            "status": {
                "allocation": { "devices": { "results": [
                    { "request": "gpu", "driver": DRIVER, "pool": "n1", "device": device } ] } },
                "reservedFor": reserved.iter().map(|p| json!({ "resource": "pods", "name": p, "uid": "u" })).collect::<Vec<_>>(),
            }
        }))
        .unwrap()
    }

    #[test]
    fn the_device_is_found_by_its_uuid_and_mig_devices_are_not_gpus() {
        let mut s = slice("n1", &[("gpu-0", "GPU-aaa"), ("gpu-1", "GPU-bbb"), ("gpu-1-mig-1g", "MIG-ccc")]);
        assert_eq!(
            find_device(&gpus(std::slice::from_ref(&s)), "gpu-BBB"),
            Some(DeviceRef { driver: DRIVER.into(), pool: "n1".into(), device: "gpu-1".into() })
        );
        assert_eq!(find_device(&gpus(std::slice::from_ref(&s)), "GPU-zzz"), None);
        assert_eq!(gpu_count(&gpus(std::slice::from_ref(&s))), 2);
        assert_eq!(gpu_count(&gpus(&[s.clone(), s.clone()])), 2, "a device listed twice is one GPU");
        s.spec.driver = "other.example.com".into();
        assert_eq!(find_device(&gpus(&[s]), "GPU-aaa"), None, "only the NVIDIA driver's devices are GPUs");
    }

    #[test]
    fn only_gpu_faults_that_need_no_whole_node_stay_on_the_gpu() {
        assert!(gpu_scoped(Action::Cordon, false) && gpu_scoped(Action::Drain, true));
        assert!(gpu_scoped(Action::ResetGpu, false) && gpu_scoped(Action::ContactSupport, false));
        assert!(!gpu_scoped(Action::ResetGpu, true), "the repair ladder needs the node");
        assert!(!gpu_scoped(Action::RebootNode, false) && !gpu_scoped(Action::ReplaceNode, false));
        assert!(!gpu_scoped(Action::Monitor, false));
    }

    #[test]
    fn more_than_the_share_escalates() {
        assert!(!escalates(4, 8, 0.5));
        assert!(escalates(5, 8, 0.5));
        assert!(escalates(1, 1, 0.5), "a node's only GPU is the node");
        assert!(escalates(1, 0, 0.5));
    }

    #[test]
    fn rule_names_are_deterministic_and_valid() {
        assert_eq!(rule_name("n1.example", "GPU-ABC"), "gpumedic-n1.example-gpu-abc");
        assert_eq!(rule_name("n1", "GPU-a"), rule_name("n1", "GPU-a"));
        let long = "n".repeat(250);
        let name = rule_name(&long, "GPU-a");
        assert!(name.len() <= 253 && name.starts_with("gpumedic-"), "{name}");
        assert_ne!(name, rule_name(&long, "GPU-b"));
        assert_eq!(node_label_value("n1"), "n1");
        assert!(node_label_value(&long).len() <= 63);
    }

    #[test]
    fn the_rule_selects_the_device_and_is_gpumedics() {
        let device = DeviceRef { driver: DRIVER.into(), pool: "n1".into(), device: "gpu-1".into() };
        let request = Remediation {
            node: "n1".into(),
            gpu: None,
            action: Action::Drain,
            subsystem: crate::request::Subsystem::Memory,
            reason: "EccDbe".into(),
            message: "m".into(),
            verdict_id: "v".into(),
            incident_id: "i1".into(),
            recovery: false,
            reissue: false,
            custom: None,
        };
        let r = rule("n1", "GPU-bbb", &device, &request);
        assert!(owned(&r) && on_node(&r, "n1") && !on_node(&r, "n2"));
        assert_eq!(incidents(&r), BTreeSet::from(["i1".to_owned()]));
        let sel = r.spec.device_selector.as_ref().unwrap();
        assert_eq!(
            (sel.driver.as_deref(), sel.pool.as_deref(), sel.device.as_deref()),
            (Some(DRIVER), Some("n1"), Some("gpu-1"))
        );
        assert_eq!((r.spec.taint.effect.as_str(), r.spec.taint.value.as_deref()), ("NoSchedule", Some("memory")));
        let json = serde_json::to_value(&r).unwrap();
        assert_eq!(json["apiVersion"], "resource.k8s.io/v1beta2");
    }

    #[test]
    fn the_holders_are_the_claims_allocated_the_device_and_their_pods() {
        let device = DeviceRef { driver: DRIVER.into(), pool: "n1".into(), device: "gpu-1".into() };
        let claims =
            [claim("a", "c1", "gpu-1", &["p1"]), claim("a", "c2", "gpu-0", &["p2"]), claim("b", "c3", "gpu-1", &[])];
        let h = Holders::of(&device, &claims);
        assert_eq!(h.claims, BTreeSet::from([("a".into(), "c1".into()), ("b".into(), "c3".into())]));
        let pod = |ns: &str, name: &str, claim: Option<&str>, generated: Option<&str>| -> Pod {
            serde_json::from_value(json!({
                "metadata": { "name": name, "namespace": ns },
                "spec": { "containers": [], "resourceClaims": claim.map(|c| vec![json!({ "name": "gpu", "resourceClaimName": c })]) },
                "status": { "resourceClaimStatuses": generated.map(|c| vec![json!({ "name": "gpu", "resourceClaimName": c })]) },
            }))
            .unwrap()
        };
        assert!(h.hold(&pod("a", "p1", None, None)), "reserved for");
        assert!(h.hold(&pod("b", "x", Some("c3"), None)), "refers to the claim by name");
        assert!(h.hold(&pod("b", "y", None, Some("c3"))), "refers to the claim made from its template");
        assert!(!h.hold(&pod("a", "p2", Some("c2"), None)), "another GPU's claim");
        assert!(!h.hold(&pod("a", "z", Some("c3"), None)), "same claim name, other namespace");
    }
}
