//! Smoke test against the testbed's real kube-apiserver: create a Node, cordon it, set a condition
//! through the status subresource; then act as a ServiceAccount bound to a narrow Role and be
//! refused what the Role does not grant.

use gpumedic_testkit as testkit;
use k8s_openapi::api::authentication::v1::{TokenRequest, TokenRequestSpec};
use k8s_openapi::api::core::v1::{Namespace, Node, Pod, ServiceAccount};
use k8s_openapi::api::rbac::v1::{Role, RoleBinding};
use kube::api::{Api, DeleteParams, Patch, PatchParams, PostParams};
use serde_json::json;

#[tokio::test]
async fn node_cordon_condition_and_rbac_refusal() {
    let client = testkit::require_kubernetes().await.unwrap_or_else(|e| panic!("{e}"));

    // A Node, cordoned, with a condition written through the status subresource.
    let name = testkit::unique_name("smoke-node");
    let nodes: Api<Node> = Api::all(client.clone());
    testkit::NodeBuilder::new(&name).label("nvidia.com/gpu.present", "true").create(&client).await;
    nodes
        .patch(&name, &PatchParams::default(), &Patch::Merge(json!({ "spec": { "unschedulable": true } })))
        .await
        .expect("cordon");
    let condition = json!({
        "type": "GpuHealthy", "status": "False", "reason": "Xid79",
        "message": "GPU has fallen off the bus", "lastTransitionTime": "2026-11-30T00:00:00Z"
    });
    nodes
        .patch_status(&name, &PatchParams::default(), &Patch::Merge(json!({ "status": { "conditions": [condition] } })))
        .await
        .expect("status patched");
    let got = nodes.get(&name).await.expect("node read back");
    assert_eq!(got.spec.as_ref().and_then(|s| s.unschedulable), Some(true));
    let conditions = got.status.and_then(|s| s.conditions).unwrap_or_default();
    let gpu = conditions.iter().find(|c| c.type_ == "GpuHealthy").expect("condition present");
    assert_eq!((gpu.status.as_str(), gpu.reason.as_deref()), ("False", Some("Xid79")));

    // A namespace with a pod, and a ServiceAccount that may only get pods there.
    let ns = testkit::unique_name("smoke-ns");
    let namespaces: Api<Namespace> = Api::all(client.clone());
    namespaces
        .create(&PostParams::default(), &serde_json::from_value(json!({ "metadata": { "name": ns } })).unwrap())
        .await
        .expect("namespace");
    let pods: Api<Pod> = Api::namespaced(client.clone(), &ns);
    let pod: Pod = serde_json::from_value(json!({
        "metadata": { "name": "trainer" },
        "spec": { "nodeName": name, "containers": [{ "name": "main", "image": "busybox" }] }
    }))
    .unwrap();
    pods.create(&PostParams::default(), &pod).await.expect("pod bound to the node");
    let sas: Api<ServiceAccount> = Api::namespaced(client.clone(), &ns);
    sas.create(&PostParams::default(), &serde_json::from_value(json!({ "metadata": { "name": "reader" } })).unwrap())
        .await
        .expect("service account");
    let roles: Api<Role> = Api::namespaced(client.clone(), &ns);
    roles
        .create(
            &PostParams::default(),
            &serde_json::from_value(json!({
                "metadata": { "name": "pod-reader" },
                "rules": [{ "apiGroups": [""], "resources": ["pods"], "verbs": ["get"] }]
            }))
            .unwrap(),
        )
        .await
        .expect("role");
    let bindings: Api<RoleBinding> = Api::namespaced(client.clone(), &ns);
    bindings
        .create(
            &PostParams::default(),
            &serde_json::from_value(json!({
                "metadata": { "name": "reader-reads-pods" },
                "roleRef": { "apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "pod-reader" },
                "subjects": [{ "kind": "ServiceAccount", "name": "reader", "namespace": ns }]
            }))
            .unwrap(),
        )
        .await
        .expect("role binding");

    // A token for the ServiceAccount from the TokenRequest API, and a client that uses only it.
    let request = TokenRequest {
        spec: Some(TokenRequestSpec { expiration_seconds: Some(600), ..Default::default() }),
        ..Default::default()
    };
    let token: TokenRequest =
        sas.create_subresource("token", "reader", &PostParams::default(), &request).await.expect("token issued");
    let token = token.status.and_then(|s| s.token).expect("token in status");
    let kubeconfig = kube::config::Kubeconfig::read_from(testkit::kubeconfig_path()).unwrap();
    let mut config = kube::Config::from_custom_kubeconfig(kubeconfig, &Default::default()).await.unwrap();
    config.auth_info = kube::config::AuthInfo { token: Some(secrecy::SecretString::from(token)), ..Default::default() };
    let restricted = kube::Client::try_from(config).expect("restricted client");

    // Granted: get the pod. Refused: delete it, and delete the Node.
    let their_pods: Api<Pod> = Api::namespaced(restricted.clone(), &ns);
    their_pods.get("trainer").await.expect("the Role grants get");
    let refused = their_pods.delete("trainer", &DeleteParams::default()).await.expect_err("delete must be refused");
    assert!(matches!(refused, kube::Error::Api(ref s) if s.code == 403), "expected 403 Forbidden, got {refused:?}");
    let their_nodes: Api<Node> = Api::all(restricted);
    let refused = their_nodes.delete(&name, &DeleteParams::default()).await.expect_err("node delete must be refused");
    assert!(matches!(refused, kube::Error::Api(ref s) if s.code == 403), "expected 403 Forbidden, got {refused:?}");
    pods.get("trainer").await.expect("the pod is still there");

    // Clean up what the test made.
    nodes.delete(&name, &DeleteParams::default()).await.expect("node deleted");
    namespaces.delete(&ns, &DeleteParams::default()).await.expect("namespace deleted");
}
