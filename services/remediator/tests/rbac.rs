//! The remediator's ClusterRole (rbac/clusterrole.yaml) and namespaced Role (rbac/role.yaml: the
//! leader-election Lease and the status object) against the testbed's kube-apiserver with RBAC
//! on: bound to a ServiceAccount, they are enough to quarantine and drain a node, lead, and keep
//! the breaker's state, and they refuse what the remediator must never do.

mod common;

use common::*;
use gpumedic_remediator::apply::{Outcome, Remediator};
use gpumedic_remediator::control::{self, StatusClient};
use gpumedic_remediator::lease::{LeaseClient, LeaseSettings};
use gpumedic_remediator::request::Action;
use k8s_openapi::api::authentication::v1::{TokenRequest, TokenRequestSpec};
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::{ConfigMap, Node, Pod, Secret, ServiceAccount};
use k8s_openapi::api::rbac::v1::{ClusterRole, ClusterRoleBinding, Role, RoleBinding};
use kube::api::{Api, DeleteParams, ListParams, PostParams};
use serde_json::json;

fn forbidden<T: std::fmt::Debug>(result: Result<T, kube::Error>, what: &str) {
    match result {
        Err(kube::Error::Api(s)) if s.code == 403 => {}
        other => panic!("{what} should be refused with 403, got {other:?}"),
    }
}

/// Reads one of the remediator's RBAC manifests from the crate's rbac/ folder.
fn manifest<T: serde::de::DeserializeOwned>(file: &str) -> T {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("rbac").join(file);
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    serde_yaml::from_str(&text).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// A configuration that authenticates as `sa` in `ns` only, with a token from the TokenRequest API.
async fn config_as(admin: &kube::Client, ns: &str, sa: &str) -> kube::Config {
    let sas: Api<ServiceAccount> = Api::namespaced(admin.clone(), ns);
    let request = TokenRequest {
        spec: Some(TokenRequestSpec { expiration_seconds: Some(600), ..Default::default() }),
        ..Default::default()
    };
    let token: TokenRequest =
        sas.create_subresource("token", sa, &PostParams::default(), &request).await.expect("token");
    let token = token.status.and_then(|s| s.token).expect("token in status");
    let mut config = admin_config().await;
    config.auth_info = kube::config::AuthInfo { token: Some(secrecy::SecretString::from(token)), ..Default::default() };
    config
}

#[tokio::test]
async fn the_cluster_role_is_enough_to_quarantine_and_drain_and_refuses_the_rest() {
    let admin = admin().await;
    let ns = namespace(&admin).await;
    let other_ns = namespace(&admin).await;
    let name = gpu_node(&admin).await;
    pod(&admin, &ns, "job-0", &name, json!({})).await;
    let sas: Api<ServiceAccount> = Api::namespaced(admin.clone(), &ns);
    sas.create(
        &PostParams::default(),
        &serde_json::from_value(json!({ "metadata": { "name": "remediator" } })).unwrap(),
    )
    .await
    .expect("service account");

    // The ClusterRole exactly as shipped, under a unique name so parallel runs do not collide.
    let mut role: ClusterRole = manifest("clusterrole.yaml");
    let role_name = gpumedic_testkit::unique_name("gpumedic-remediator");
    role.metadata.name = Some(role_name.clone());
    Api::<ClusterRole>::all(admin.clone()).create(&PostParams::default(), &role).await.expect("cluster role");
    let binding: ClusterRoleBinding = serde_json::from_value(json!({
        "metadata": { "name": role_name },
        "roleRef": { "apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": role_name },
        "subjects": [{ "kind": "ServiceAccount", "name": "remediator", "namespace": ns }]
    }))
    .unwrap();
    Api::<ClusterRoleBinding>::all(admin.clone()).create(&PostParams::default(), &binding).await.expect("binding");
    // The leader-election Role, in the remediator's own namespace.
    let mut leases: Role = manifest("role.yaml");
    leases.metadata.namespace = Some(ns.clone());
    Api::<Role>::namespaced(admin.clone(), &ns).create(&PostParams::default(), &leases).await.expect("role");
    let lease_binding: RoleBinding = serde_json::from_value(json!({
        "metadata": { "name": "remediator-namespaced" },
        "roleRef": { "apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": leases.metadata.name },
        "subjects": [{ "kind": "ServiceAccount", "name": "remediator", "namespace": ns }]
    }))
    .unwrap();
    Api::<RoleBinding>::namespaced(admin.clone(), &ns)
        .create(&PostParams::default(), &lease_binding)
        .await
        .expect("rb");

    let config = config_as(&admin, &ns, "remediator").await;
    let restricted = kube::Client::try_from(config.clone()).expect("restricted client");
    let r = Remediator::new(config, settings(), roomy_gate()).expect("remediator as the ServiceAccount");
    let outcome =
        r.remediate(&request(&name, Action::Drain), 10).await.expect("the role allows a quarantine and drain");
    let Outcome::Applied { drain: Some(report), .. } = outcome else { panic!("expected a drain, got {outcome:?}") };
    assert_eq!(report.evicted.len(), 1, "{report:?}");
    assert!(report.complete());
    let node = get_node(&admin, &name).await;
    assert!(cordoned(&node));
    assert_eq!(labels(&node)["gpumedic.io/state"], "drained");
    assert!(conditions(&node).iter().any(|(t, s, _)| t == "GpuUnhealthy" && s == "True"));
    let events = event_reasons(&admin, &name).await;
    assert!(events.iter().any(|e| e == "Cordoned") && events.iter().any(|e| e == "Drained"), "{events:?}");
    // Recovery under the same role.
    r.remediate(&recovery(&request(&name, Action::Drain)), 10).await.expect("recovery");
    assert!(!cordoned(&get_node(&admin, &name).await));

    // Leader election: its Lease in its own namespace (create, renew, release), and nowhere else.
    let settings = LeaseSettings {
        namespace: ns.clone(),
        name: "gpumedic-remediator".into(),
        identity: "remediator-0".into(),
        duration: std::time::Duration::from_secs(15),
        renew: std::time::Duration::from_secs(5),
    };
    let mut elector = LeaseClient::new(restricted.clone(), settings);
    assert!(elector.try_lead().await.expect("the role allows creating the lease"), "first comer leads");
    assert!(elector.try_lead().await.expect("the role allows renewing the lease"), "the holder renews");
    elector.release().await.expect("the role allows releasing the lease");
    let lease: Lease = serde_json::from_value(json!({ "metadata": { "name": "gpumedic-remediator" } })).unwrap();
    forbidden(
        Api::<Lease>::namespaced(restricted.clone(), &other_ns).create(&PostParams::default(), &lease).await,
        "a lease elsewhere",
    );
    forbidden(Api::<Lease>::namespaced(restricted.clone(), &ns).get("another-lease").await, "reading another lease");

    // The status object: created and patched by name; no other ConfigMap is readable.
    let status = StatusClient::new(restricted.clone(), &ns, control::STATUS_CONFIGMAP);
    status
        .patch(&control::trip_patch("test trip", &control::now(), 3))
        .await
        .expect("the role allows the status object");
    assert!(status.read().await.expect("readable").breaker_open);
    forbidden(
        Api::<ConfigMap>::namespaced(restricted.clone(), &ns).get("gpumedic-config").await,
        "reading another ConfigMap",
    );
    forbidden(
        Api::<ConfigMap>::namespaced(restricted.clone(), &other_ns).get(control::STATUS_CONFIGMAP).await,
        "the status object elsewhere",
    );

    // Outside the role.
    forbidden(Api::<Node>::all(restricted.clone()).delete(&name, &DeleteParams::default()).await, "deleting a node");
    forbidden(Api::<Secret>::namespaced(restricted.clone(), &ns).list(&ListParams::default()).await, "listing secrets");
    forbidden(
        Api::<Secret>::all(restricted.clone()).list(&ListParams::default()).await,
        "listing secrets cluster-wide",
    );
    pod(&admin, &ns, "job-1", &name, json!({})).await;
    forbidden(
        Api::<Pod>::namespaced(restricted.clone(), &ns).delete("job-1", &DeleteParams::default()).await,
        "deleting a pod",
    );
    assert!(get_node(&admin, &name).await.metadata.name.is_some(), "the node is still there");

    let _ = Api::<ClusterRoleBinding>::all(admin.clone()).delete(&role_name, &DeleteParams::default()).await;
    let _ = Api::<ClusterRole>::all(admin.clone()).delete(&role_name, &DeleteParams::default()).await;
    cleanup(&admin, &[&name], &[&ns, &other_ns]).await;
}
