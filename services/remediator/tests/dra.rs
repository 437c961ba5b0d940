//! GPU-level quarantine with DRA device taints, against the testbed's kube-apiserver (which
//! serves `resource.k8s.io/v1beta2` DeviceTaintRules with the `DRADeviceTaintRules` gate on, see
//! compose/lib/servers.sh). The tests publish ResourceSlices shaped like the NVIDIA DRA driver's,
//! write ResourceClaim allocations as the scheduler would, and bind pods to the claims.

mod common;

use std::collections::BTreeMap;

use common::*;
use gpumedic_remediator::apply::{Outcome, Settings};
use gpumedic_remediator::dra::{self, GpuQuarantine};
use gpumedic_remediator::request::{Action, GpuRef, Remediation};
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::api::resource::v1::{ResourceClaim, ResourceSlice};
use k8s_openapi::api::resource::v1beta2::DeviceTaintRule;
use kube::api::{Api, DeleteParams, ListParams, Patch, PatchParams, PostParams};
use serde_json::json;

/// The UUID of GPU `index` on `node`, unique per test node.
fn uuid(node: &str, index: usize) -> String {
    let n = node.bytes().fold(0u64, |h, b| h.wrapping_mul(31).wrapping_add(u64::from(b)));
    format!("GPU-{:08x}-0000-4000-8000-{:012x}", n as u32, index)
}

/// Fails with the way out when the apiserver does not serve DeviceTaintRules.
async fn require_device_taint_rules(client: &kube::Client) {
    let api: Api<DeviceTaintRule> = Api::all(client.clone());
    if let Err(e) = api.list(&ListParams::default().limit(1)).await {
        panic!(
            "the testbed's kube-apiserver does not serve DeviceTaintRules ({e}); restart it with the flags in \
             compose/lib/servers.sh (--feature-gates DRADeviceTaintRules=true --runtime-config \
             resource.k8s.io/v1beta2=true): compose/down kubernetes && compose/up kubernetes"
        );
    }
}

/// Publishes `gpus` GPUs for `node` as the NVIDIA DRA driver does: one pool named after the
/// node, one device `gpu-<i>` per GPU with its `uuid`, `index` and `type` attributes.
async fn publish_gpus(client: &kube::Client, node: &str, gpus: usize) -> String {
    let name = format!("{node}-gpu.nvidia.com-x7k2p");
    let devices: Vec<_> = (0..gpus)
        .map(|i| {
            json!({
                "name": format!("gpu-{i}"),
                "attributes": {
                    "type": { "string": "gpu" },
                    "uuid": { "string": uuid(node, i) },
                    "index": { "int": i },
                    "minor": { "int": i },
                    "productName": { "string": "NVIDIA H100 80GB HBM3" },
                    "architecture": { "string": "Hopper" },
                    "brand": { "string": "Nvidia" },
                    "cudaComputeCapability": { "version": "9.0.0" },
                    "driverVersion": { "version": "570.124.6" },
                },
                "capacity": { "memory": { "value": "81559Mi" } },
            })
        })
        .collect();
    let slice: ResourceSlice = serde_json::from_value(json!({
        "apiVersion": "resource.k8s.io/v1", "kind": "ResourceSlice",
        "metadata": { "name": name },
        "spec": {
            "driver": dra::DRIVER, "nodeName": node,
            "pool": { "name": node, "generation": 1, "resourceSliceCount": 1 },
            "devices": devices,
        }
    }))
    .expect("slice fixture");
    Api::<ResourceSlice>::all(client.clone()).create(&PostParams::default(), &slice).await.expect("slice created");
    name
}

/// A pod on `node` holding GPU `gpu` through its own ResourceClaim, allocated and reserved as
/// the scheduler writes it.
async fn pod_on_gpu(client: &kube::Client, ns: &str, name: &str, node: &str, gpu: usize) {
    let claims: Api<ResourceClaim> = Api::namespaced(client.clone(), ns);
    let claim: ResourceClaim = serde_json::from_value(json!({
        "metadata": { "name": format!("{name}-gpu") },
        "spec": { "devices": { "requests": [{ "name": "gpu", "exactly": { "deviceClassName": "gpu.nvidia.com" } }] } }
    }))
    .expect("claim fixture");
    claims.create(&PostParams::default(), &claim).await.expect("claim created");
    let pods: Api<Pod> = Api::namespaced(client.clone(), ns);
    let pod: Pod = serde_json::from_value(json!({
        "metadata": { "name": name },
        "spec": {
            "nodeName": node,
            "resourceClaims": [{ "name": "gpu", "resourceClaimName": format!("{name}-gpu") }],
            "containers": [{ "name": "main", "image": "busybox", "resources": { "claims": [{ "name": "gpu" }] } }],
        }
    }))
    .expect("pod fixture");
    let pod = pods.create(&PostParams::default(), &pod).await.expect("pod created");
    let status = json!({ "status": {
        "allocation": {
            "devices": { "results": [
                { "request": "gpu", "driver": dra::DRIVER, "pool": node, "device": format!("gpu-{gpu}") } ] },
            "nodeSelector": { "nodeSelectorTerms": [{ "matchFields": [
                { "key": "metadata.name", "operator": "In", "values": [node] } ] }] },
        },
        "reservedFor": [{ "resource": "pods", "name": name, "uid": pod.metadata.uid }],
    } });
    claims
        .patch_status(&format!("{name}-gpu"), &PatchParams::default(), &Patch::Merge(status))
        .await
        .expect("claim allocated");
}

/// A fault on GPU `index` of `node`, for `incident`.
fn gpu_fault(node: &str, index: usize, incident: &str, action: Action) -> Remediation {
    Remediation {
        gpu: Some(GpuRef { uuid: uuid(node, index), pci_bus_id: String::new(), index: Some(index as u32) }),
        incident_id: incident.into(),
        reason: "EccDoubleBit".into(),
        message: "an uncorrectable ECC error".into(),
        ..request(node, action)
    }
}

/// gpumedic's rules on `node`: name -> selected device.
async fn rules(client: &kube::Client, node: &str) -> BTreeMap<String, String> {
    dra::rules_on(client, node)
        .await
        .expect("rules listed")
        .into_iter()
        .map(|r| {
            let sel = r.spec.device_selector.clone().unwrap_or_default();
            let device = format!(
                "{}/{}/{}",
                sel.driver.unwrap_or_default(),
                sel.pool.unwrap_or_default(),
                sel.device.unwrap_or_default()
            );
            (r.metadata.name.unwrap_or_default(), device)
        })
        .collect()
}

/// Starts `r`'s GPU quarantine caches, as the service does, and waits until both have listed.
/// Cancel the token to stop them.
async fn watching(r: &gpumedic_remediator::apply::Remediator) -> tokio_util::sync::CancellationToken {
    let token = tokio_util::sync::CancellationToken::new();
    tokio::spawn(r.clone().watch_dra(token.clone()));
    let cache = r.dra_cache().clone();
    gpumedic_testkit::eventually("the GPU quarantine caches to list", std::time::Duration::from_secs(30), async || {
        cache.ready().then_some(())
    })
    .await;
    token
}

fn settings_with(max_share: f64) -> Settings {
    Settings { gpu_quarantine: GpuQuarantine { enabled: true, max_share }, ..settings() }
}

async fn cleanup_dra(client: &kube::Client, slices: &[&str], node: &str) {
    for s in slices {
        let _ = Api::<ResourceSlice>::all(client.clone()).delete(s, &DeleteParams::default()).await;
    }
    let rules: Api<DeviceTaintRule> = Api::all(client.clone());
    for name in rules_on_any(client, node).await {
        let _ = rules.delete(&name, &DeleteParams::default()).await;
    }
}

async fn rules_on_any(client: &kube::Client, node: &str) -> Vec<String> {
    let rules: Api<DeviceTaintRule> = Api::all(client.clone());
    rules
        .list(&ListParams::default())
        .await
        .map(|l| l.items)
        .unwrap_or_default()
        .into_iter()
        .filter(|r| r.metadata.name.as_deref().is_some_and(|n| n.contains(node)))
        .filter_map(|r| r.metadata.name)
        .collect()
}

#[tokio::test]
async fn one_faulty_gpu_gets_one_rule_and_only_its_pods_leave() {
    let client = admin().await;
    require_device_taint_rules(&client).await;
    let node = gpu_node(&client).await;
    let ns = namespace(&client).await;
    let slice = publish_gpus(&client, &node, 4).await;
    for (pod, gpu) in [("job-0", 0), ("job-1", 1), ("job-2", 2)] {
        pod_on_gpu(&client, &ns, pod, &node, gpu).await;
    }
    common::pod(&client, &ns, "cpu-only", &node, json!({})).await;
    // Someone else's rule on another of the node's GPUs: gpumedic never touches it.
    let theirs: DeviceTaintRule = serde_json::from_value(json!({
        "apiVersion": "resource.k8s.io/v1beta2", "kind": "DeviceTaintRule",
        "metadata": { "name": format!("ops-{node}-gpu-3") },
        "spec": { "deviceSelector": { "driver": dra::DRIVER, "pool": node, "device": "gpu-3" },
                  "taint": { "key": "example.com/maintenance", "effect": "NoSchedule" } }
    }))
    .unwrap();
    Api::<DeviceTaintRule>::all(client.clone()).create(&PostParams::default(), &theirs).await.expect("their rule");

    let r = remediator(settings()).await;
    let fault = gpu_fault(&node, 1, "i-gpu1", Action::Drain);
    let outcome = r.remediate(&fault, 10).await.expect("remediated");
    let Outcome::Applied { plan, drain: Some(report) } = outcome else { panic!("expected a drain, got {outcome:?}") };
    let rule_name = dra::rule_name(&node, &uuid(&node, 1));
    assert_eq!(plan.gpu_rule.as_deref(), Some(rule_name.as_str()));
    assert_eq!(report.evicted.iter().map(|p| p.name.as_str()).collect::<Vec<_>>(), ["job-1"], "{report:?}");
    assert!(report.complete());
    assert_eq!(pods_left(&client, &ns).await, ["cpu-only", "job-0", "job-2"]);

    // One rule, on that device, NoSchedule, gpumedic's.
    assert_eq!(
        rules(&client, &node).await,
        BTreeMap::from([(rule_name.clone(), format!("gpu.nvidia.com/{node}/gpu-1"))])
    );
    let rule = Api::<DeviceTaintRule>::all(client.clone()).get(&rule_name).await.expect("rule");
    assert_eq!(rule.spec.taint.effect, "NoSchedule");
    assert_eq!(rule.spec.taint.key, "gpumedic.io/unhealthy");
    assert_eq!(rule.metadata.labels.unwrap_or_default()[dra::MANAGED_BY_LABEL], "gpumedic");

    // The node stays schedulable, and names the GPU.
    let n = get_node(&client, &node).await;
    assert!(!cordoned(&n), "the node stays schedulable");
    assert!(gpumedic_taints(&n).is_empty(), "{:?}", taints(&n));
    assert_eq!(labels(&n).get(dra::GPU_LABEL), Some(&uuid(&node, 1)));
    let condition =
        n.status.and_then(|s| s.conditions).unwrap_or_default().into_iter().find(|c| c.type_ == "GpuUnhealthy");
    let condition = condition.expect("the GPU condition");
    assert_eq!(condition.status, "True");
    assert!(condition.message.unwrap_or_default().contains(&uuid(&node, 1)), "the condition names the GPU");
    let events = event_reasons(&client, &node).await;
    assert!(events.iter().any(|e| e == "GpuQuarantined"), "{events:?}");

    // The same verdict again (redelivery, a restart) makes no second rule and drains nothing.
    assert_eq!(r.remediate(&fault, 10).await.expect("again"), Outcome::AlreadyDone);
    assert_eq!(rules(&client, &node).await.len(), 1);

    // Recovery deletes gpumedic's rule, and only it.
    r.remediate(&recovery(&fault), 10).await.expect("recovered");
    assert!(rules(&client, &node).await.is_empty());
    let names = rules_on_any(&client, &node).await;
    assert_eq!(names, [format!("ops-{node}-gpu-3")], "their rule stays");
    let n = get_node(&client, &node).await;
    assert!(conditions(&n).iter().any(|(t, s, _)| t == "GpuUnhealthy" && s == "False"));
    assert!(!labels(&n).contains_key(dra::GPU_LABEL));

    cleanup_dra(&client, &[&slice], &node).await;
    cleanup(&client, &[&node], &[&ns]).await;
}

#[tokio::test]
async fn more_than_the_share_of_a_nodes_gpus_quarantines_the_node() {
    let client = admin().await;
    require_device_taint_rules(&client).await;
    let node = gpu_node(&client).await;
    let ns = namespace(&client).await;
    let slice = publish_gpus(&client, &node, 4).await;
    for (pod, gpu) in [("job-0", 0), ("job-1", 1), ("job-2", 2), ("job-3", 3)] {
        pod_on_gpu(&client, &ns, pod, &node, gpu).await;
    }
    // With the caches, as the service runs: the rules the first two verdicts write are counted
    // by the third at once, though the watch may not have delivered them yet.
    let r = remediator(settings_with(0.5)).await;
    let caches = watching(&r).await;
    // Two of four is the share, not more: GPU by GPU.
    for (gpu, incident) in [(0, "i0"), (1, "i1")] {
        let outcome = r.remediate(&gpu_fault(&node, gpu, incident, Action::Drain), 10).await.expect("remediated");
        assert!(matches!(&outcome, Outcome::Applied { plan, .. } if plan.gpu_rule.is_some()), "{outcome:?}");
    }
    assert!(!cordoned(&get_node(&client, &node).await));
    assert_eq!(pods_left(&client, &ns).await, ["job-2", "job-3"]);
    // The third is more than half: the node goes out whole.
    let third = gpu_fault(&node, 2, "i2", Action::Drain);
    let outcome = r.remediate(&third, 10).await.expect("remediated");
    let Outcome::Applied { plan, drain: Some(report) } = outcome else { panic!("expected a drain, got {outcome:?}") };
    assert!(plan.gpu_rule.is_none() && plan.cordon == Some(true), "{plan:?}");
    assert!(report.complete());
    let n = get_node(&client, &node).await;
    assert!(cordoned(&n));
    assert_eq!(gpumedic_taints(&n).len(), 1);
    assert!(pods_left(&client, &ns).await.is_empty());
    assert_eq!(rules(&client, &node).await.len(), 2, "no rule for the GPU the node quarantine covers");
    assert!(event_reasons(&client, &node).await.iter().any(|e| e == "GpuQuarantineEscalated"));

    // The escalating incident's recovery returns the node; the two GPUs stay out.
    r.remediate(&recovery(&third), 10).await.expect("recovered");
    assert!(!cordoned(&get_node(&client, &node).await));
    assert_eq!(rules(&client, &node).await.len(), 2);
    assert_eq!(r.dra_cache().misses(), 0, "every GPU verdict read the node's GPUs and rules from the caches");
    caches.cancel();

    cleanup_dra(&client, &[&slice], &node).await;
    cleanup(&client, &[&node], &[&ns]).await;
}

#[tokio::test]
async fn gpus_published_after_the_caches_listed_are_quarantined_one_by_one() {
    let client = admin().await;
    require_device_taint_rules(&client).await;
    let node = gpu_node(&client).await;
    let r = remediator(settings()).await;
    let caches = watching(&r).await;
    // The driver publishes the node's GPUs now, and the fault follows at once: whether or not the
    // watch has delivered the slice, the GPU is found (the apiserver is asked when the cache
    // does not know it).
    let slice = publish_gpus(&client, &node, 8).await;
    let fault = gpu_fault(&node, 5, "i-late", Action::Cordon);
    let outcome = r.remediate(&fault, 10).await.expect("remediated");
    assert!(matches!(&outcome, Outcome::Applied { plan, .. } if plan.gpu_rule.is_some()), "{outcome:?}");
    assert!(!cordoned(&get_node(&client, &node).await));
    // The watch delivers the slice, and the rule gpumedic wrote, to the caches.
    let cache = r.dra_cache().clone();
    let (late, uuid5) = (node.clone(), uuid(&node, 5));
    gpumedic_testkit::eventually(
        "the watch to deliver the node's slice",
        std::time::Duration::from_secs(30),
        async || cache.gpus_on(&late).filter(|g| g.len() == 8 && dra::find_device(g, &uuid5).is_some()),
    )
    .await;
    let cached: Vec<_> =
        r.dra_cache().rules_on(&node).expect("listed").into_iter().filter_map(|r| r.metadata.name).collect();
    assert_eq!(cached, [dra::rule_name(&node, &uuid(&node, 5))]);
    // A second GPU of the node now reads only the caches.
    let misses = r.dra_cache().misses();
    let second = gpu_fault(&node, 6, "i-late-2", Action::Cordon);
    let outcome = r.remediate(&second, 10).await.expect("remediated");
    assert!(matches!(&outcome, Outcome::Applied { plan, .. } if plan.gpu_rule.is_some()), "{outcome:?}");
    assert_eq!(r.dra_cache().misses(), misses, "the second GPU was found in the caches");
    // Recovery deletes the rule, and the cache forgets it at once.
    r.remediate(&recovery(&fault), 10).await.expect("recovered");
    let left: Vec<_> =
        r.dra_cache().rules_on(&node).expect("listed").into_iter().filter_map(|r| r.metadata.name).collect();
    assert_eq!(left, [dra::rule_name(&node, &uuid(&node, 6))]);
    caches.cancel();
    cleanup_dra(&client, &[&slice], &node).await;
    cleanup(&client, &[&node], &[]).await;
}

#[tokio::test]
async fn a_node_without_resource_slices_is_quarantined_whole_and_names_the_gpu() {
    let client = admin().await;
    let node = gpu_node(&client).await;
    let ns = namespace(&client).await;
    common::pod(&client, &ns, "job-0", &node, json!({})).await;
    let r = remediator(settings()).await;
    let fault = gpu_fault(&node, 1, "i1", Action::Drain);
    let outcome = r.remediate(&fault, 10).await.expect("remediated");
    let Outcome::Applied { plan, drain: Some(report) } = outcome else { panic!("expected a drain, got {outcome:?}") };
    assert!(plan.gpu_rule.is_none());
    assert_eq!(report.evicted.len(), 1);
    let n = get_node(&client, &node).await;
    assert!(cordoned(&n));
    assert_eq!(gpumedic_taints(&n).len(), 1);
    assert_eq!(labels(&n)["gpumedic.io/state"], "drained");
    assert_eq!(labels(&n).get(dra::GPU_LABEL), Some(&uuid(&node, 1)));
    let message = n
        .status
        .and_then(|s| s.conditions)
        .unwrap_or_default()
        .into_iter()
        .find(|c| c.type_ == "GpuUnhealthy")
        .and_then(|c| c.message)
        .unwrap_or_default();
    assert_eq!(message, format!("an uncorrectable ECC error (GPU {})", uuid(&node, 1)));
    assert!(rules_on_any(&client, &node).await.is_empty());

    r.remediate(&recovery(&fault), 10).await.expect("recovered");
    let n = get_node(&client, &node).await;
    assert!(!cordoned(&n) && gpumedic_taints(&n).is_empty());
    assert!(!labels(&n).contains_key(dra::GPU_LABEL));
    cleanup(&client, &[&node], &[&ns]).await;
}

#[tokio::test]
async fn the_breaker_counts_gpus_with_their_own_limit() {
    let client = admin().await;
    require_device_taint_rules(&client).await;
    let node = gpu_node(&client).await;
    let slice = publish_gpus(&client, &node, 8).await;
    let r = remediator_with(settings(), roomy_gate().with_max_gpus(2)).await;
    for (gpu, incident) in [(0, "i0"), (1, "i1")] {
        let outcome = r.remediate(&gpu_fault(&node, gpu, incident, Action::Cordon), 10).await.expect("remediated");
        assert!(matches!(&outcome, Outcome::Applied { plan, .. } if plan.gpu_rule.is_some()), "{outcome:?}");
    }
    let outcome = r.remediate(&gpu_fault(&node, 2, "i2", Action::Cordon), 10).await.expect("remediated");
    assert!(
        matches!(&outcome, Outcome::Skipped { reason: gpumedic_remediator::plan::Skip::BreakerOpen(why), .. } if why.contains("3 GPUs")),
        "{outcome:?}"
    );
    assert_eq!(rules(&client, &node).await.len(), 2);
    assert!(r.gate().lock().unwrap().breaker.trip().is_some());
    cleanup_dra(&client, &[&slice], &node).await;
    cleanup(&client, &[&node], &[]).await;
}

/// Reads the remediator's shipped ClusterRole.
fn cluster_role() -> k8s_openapi::api::rbac::v1::ClusterRole {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("rbac").join("clusterrole.yaml");
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    serde_yaml::from_str(&text).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

fn forbidden<T: std::fmt::Debug>(result: Result<T, kube::Error>, what: &str) {
    match result {
        Err(kube::Error::Api(s)) if s.code == 403 => {}
        other => panic!("{what} should be refused with 403, got {other:?}"),
    }
}

#[tokio::test]
async fn the_cluster_role_is_enough_to_quarantine_a_gpu_and_refuses_writing_slices_and_claims() {
    use k8s_openapi::api::authentication::v1::{TokenRequest, TokenRequestSpec};
    use k8s_openapi::api::core::v1::ServiceAccount;
    use k8s_openapi::api::rbac::v1::{ClusterRole, ClusterRoleBinding};

    let admin = admin().await;
    require_device_taint_rules(&admin).await;
    let node = gpu_node(&admin).await;
    let ns = namespace(&admin).await;
    let slice = publish_gpus(&admin, &node, 4).await;
    pod_on_gpu(&admin, &ns, "job-1", &node, 1).await;
    pod_on_gpu(&admin, &ns, "job-2", &node, 2).await;
    let sas: Api<ServiceAccount> = Api::namespaced(admin.clone(), &ns);
    sas.create(
        &PostParams::default(),
        &serde_json::from_value(json!({ "metadata": { "name": "remediator" } })).unwrap(),
    )
    .await
    .expect("service account");
    let mut role = cluster_role();
    let role_name = gpumedic_testkit::unique_name("gpumedic-remediator-dra");
    role.metadata.name = Some(role_name.clone());
    Api::<ClusterRole>::all(admin.clone()).create(&PostParams::default(), &role).await.expect("cluster role");
    let binding: ClusterRoleBinding = serde_json::from_value(json!({
        "metadata": { "name": role_name },
        "roleRef": { "apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": role_name },
        "subjects": [{ "kind": "ServiceAccount", "name": "remediator", "namespace": ns }]
    }))
    .unwrap();
    Api::<ClusterRoleBinding>::all(admin.clone()).create(&PostParams::default(), &binding).await.expect("binding");
    let request = TokenRequest {
        spec: Some(TokenRequestSpec { expiration_seconds: Some(600), ..Default::default() }),
        ..Default::default()
    };
    let token: TokenRequest =
        sas.create_subresource("token", "remediator", &PostParams::default(), &request).await.expect("token");
    let mut config = admin_config().await;
    config.auth_info = kube::config::AuthInfo {
        token: Some(secrecy::SecretString::from(token.status.and_then(|s| s.token).expect("token"))),
        ..Default::default()
    };
    let restricted = kube::Client::try_from(config.clone()).expect("restricted client");

    let r = gpumedic_remediator::apply::Remediator::new(config, settings(), roomy_gate()).expect("remediator");
    // The role lets the caches list and watch: a slice published after they listed arrives.
    let caches = watching(&r).await;
    let later = gpu_node(&admin).await;
    let later_slice = publish_gpus(&admin, &later, 2).await;
    let cache = r.dra_cache().clone();
    gpumedic_testkit::eventually(
        "the role's watch to deliver a new slice",
        std::time::Duration::from_secs(30),
        async || cache.gpus_on(&later).filter(|g| g.len() == 2),
    )
    .await;
    let fault = gpu_fault(&node, 1, "i-rbac", Action::Drain);
    let outcome = r.remediate(&fault, 10).await.expect("the role allows a GPU quarantine and its drain");
    let Outcome::Applied { plan, drain: Some(report) } = outcome else { panic!("expected a drain, got {outcome:?}") };
    assert!(plan.gpu_rule.is_some() && report.complete(), "{plan:?} {report:?}");
    assert_eq!(pods_left(&admin, &ns).await, ["job-2"]);
    r.remediate(&recovery(&fault), 10).await.expect("the role allows releasing the GPU");
    assert!(rules(&admin, &node).await.is_empty());

    // Read only: slices and claims are the driver's and the scheduler's.
    forbidden(
        Api::<ResourceSlice>::all(restricted.clone()).delete(&slice, &DeleteParams::default()).await,
        "deleting a ResourceSlice",
    );
    let claims: Api<ResourceClaim> = Api::namespaced(restricted.clone(), &ns);
    forbidden(
        claims
            .patch_status(
                "job-2-gpu",
                &PatchParams::default(),
                &Patch::Merge(json!({ "status": { "reservedFor": [] } })),
            )
            .await,
        "writing a claim's allocation",
    );
    forbidden(claims.delete("job-2-gpu", &DeleteParams::default()).await, "deleting a claim");

    caches.cancel();
    cleanup_dra(&admin, &[&later_slice], &later).await;
    cleanup(&admin, &[&later], &[]).await;
    let _ = Api::<ClusterRoleBinding>::all(admin.clone()).delete(&role_name, &DeleteParams::default()).await;
    let _ = Api::<ClusterRole>::all(admin.clone()).delete(&role_name, &DeleteParams::default()).await;
    cleanup_dra(&admin, &[&slice], &node).await;
    cleanup(&admin, &[&node], &[&ns]).await;
}
