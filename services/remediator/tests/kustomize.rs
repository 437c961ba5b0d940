//! The Kustomize deployment in k8s/, as an operator applies it. Every overlay is rendered with the
//! kubectl the testbed builds (Kustomize v5 inside), and the rendered objects must say what the
//! services need to run: probes on the admin port, the remediator's mode, the collector's node
//! name, tolerations and host access, least-privilege RBAC that binds to the right accounts, the
//! hardening the `restricted` Pod Security profile asks for, and alerts on metrics the code emits.
//! The files k8s/base copies (the classifier's default rules, the remediator's RBAC) must equal
//! their originals byte for byte. Finally each overlay is applied to the testbed's kube-apiserver
//! with a server-side dry run, and every object must be accepted.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Component, Path, PathBuf};
use std::process::{Command, Stdio};

use serde::Deserialize;
use serde_json::Value;

/// The overlays, each named after the remediator mode it deploys.
const OVERLAYS: [&str; 3] = ["monitor-only", "cordon-drain", "full-remediation"];

/// The admin port every service serves /healthz, /readyz and /metrics on.
const ADMIN_PORT: u64 = 9400;

fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..").canonicalize().expect("repository root")
}

/// The kubectl `compose/up` builds, found the way compose/lib/common.sh places it.
fn kubectl() -> PathBuf {
    let cache = match (std::env::var_os("GPUMEDIC_CACHE"), std::env::var_os("XDG_CACHE_HOME")) {
        (Some(c), _) => PathBuf::from(c),
        (None, Some(x)) => PathBuf::from(x).join("gpumedic"),
        (None, None) => PathBuf::from(std::env::var_os("HOME").expect("HOME is set")).join(".cache/gpumedic"),
    };
    let version = std::env::var("KUBERNETES_VERSION").unwrap_or_else(|_| "v1.36.3".to_owned());
    let path = cache.join("bin").join(format!("kubernetes-{version}")).join("kubectl");
    assert!(
        path.is_file(),
        "kubectl is not at {}: run compose/up, which builds kubectl (with Kustomize) from the Kubernetes sources",
        path.display()
    );
    path
}

/// Runs `kubectl kustomize DIR` and returns the rendered objects.
fn kustomize(dir: &Path) -> Vec<Value> {
    let out = Command::new(kubectl()).arg("kustomize").arg(dir).output().expect("run kubectl kustomize");
    assert!(
        out.status.success(),
        "kubectl kustomize {} failed:\n{}",
        dir.display(),
        String::from_utf8_lossy(&out.stderr)
    );
    parse_documents(&String::from_utf8(out.stdout).expect("UTF-8 output"))
}

fn parse_documents(text: &str) -> Vec<Value> {
    serde_yaml::Deserializer::from_str(text)
        .map(|doc| Value::deserialize(doc).expect("rendered YAML parses"))
        .filter(|v| !v.is_null())
        .collect()
}

fn overlay(mode: &str) -> Vec<Value> {
    kustomize(&repo_root().join("k8s/overlays").join(mode))
}

/// A path from `from` to `to` made of `..` and names: Kustomize refuses absolute resource paths.
fn relative(from: &Path, to: &Path) -> PathBuf {
    let from: Vec<Component> = from.components().collect();
    let to: Vec<Component> = to.components().collect();
    let common = from.iter().zip(&to).take_while(|(a, b)| a == b).count();
    let mut path = PathBuf::new();
    for _ in common..from.len() {
        path.push("..");
    }
    for c in &to[common..] {
        path.push(c);
    }
    path
}

/// A throwaway kustomization under the target directory: `resources` and `components` are folders
/// of k8s/ (such as `overlays/cordon-drain`), `namespace` replaces the deployment's namespace.
fn kustomization(resources: &[&str], components: &[&str], namespace: Option<&str>) -> PathBuf {
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join(gpumedic_testkit::unique_name("kustomize"));
    std::fs::create_dir_all(&dir).expect("create the kustomization folder");
    let dir = dir.canonicalize().expect("kustomization folder");
    let k8s = repo_root().join("k8s");
    let list = |items: &[&str]| -> String {
        items.iter().map(|i| format!("  - {}\n", relative(&dir, &k8s.join(i)).display())).collect()
    };
    let mut text = format!("resources:\n{}", list(resources));
    if !components.is_empty() {
        text.push_str(&format!("components:\n{}", list(components)));
    }
    if let Some(ns) = namespace {
        text.push_str(&format!("namespace: {ns}\n"));
    }
    std::fs::write(dir.join("kustomization.yaml"), text).expect("write kustomization.yaml");
    dir
}

fn str_at<'a>(v: &'a Value, pointer: &str) -> Option<&'a str> {
    v.pointer(pointer).and_then(Value::as_str)
}

fn kind(v: &Value) -> &str {
    str_at(v, "/kind").unwrap_or_default()
}

fn name(v: &Value) -> &str {
    str_at(v, "/metadata/name").unwrap_or_default()
}

fn find<'a>(objects: &'a [Value], kind_: &str, name_: &str) -> &'a Value {
    objects
        .iter()
        .find(|o| kind(o) == kind_ && name(o) == name_)
        .unwrap_or_else(|| panic!("no {kind_} {name_} in the rendered objects"))
}

fn workloads(objects: &[Value]) -> Vec<&Value> {
    objects.iter().filter(|o| matches!(kind(o), "Deployment" | "DaemonSet")).collect()
}

fn containers(workload: &Value) -> &Vec<Value> {
    workload.pointer("/spec/template/spec/containers").and_then(Value::as_array).expect("containers")
}

/// One container's environment as the kubelet builds it: each `envFrom` ConfigMap in order, then
/// `env`, each overriding the one before. A value from a Secret or the downward API is kept as
/// its `valueFrom`.
fn environment(objects: &[Value], container: &Value) -> BTreeMap<String, Value> {
    let mut env = BTreeMap::new();
    for source in container.pointer("/envFrom").and_then(Value::as_array).into_iter().flatten() {
        let cm = str_at(source, "/configMapRef/name").expect("envFrom names a ConfigMap");
        let data = find(objects, "ConfigMap", cm).pointer("/data").and_then(Value::as_object).expect("data");
        env.extend(data.iter().map(|(k, v)| (k.clone(), v.clone())));
    }
    for var in container.pointer("/env").and_then(Value::as_array).into_iter().flatten() {
        let key = str_at(var, "/name").expect("env name").to_owned();
        let value = var.get("value").or_else(|| var.get("valueFrom")).cloned().unwrap_or(Value::Null);
        env.insert(key, value);
    }
    env
}

fn seconds(duration: &str) -> u64 {
    let (number, unit) = duration.split_at(duration.find(|c: char| !c.is_ascii_digit()).unwrap_or(duration.len()));
    let n: u64 = number.parse().unwrap_or_else(|_| panic!("'{duration}' is not a duration"));
    match unit {
        "s" => n,
        "m" => n * 60,
        "h" => n * 3600,
        _ => panic!("'{duration}' has a unit this test does not know"),
    }
}

fn labels_match(selector: &Value, labels: &Value) -> bool {
    let wanted = selector.as_object().expect("selector");
    wanted.iter().all(|(k, v)| labels.get(k) == Some(v))
}

/// The probes, ports, environment, resources and shutdown deadline every service shares.
fn assert_service_basics(objects: &[Value]) {
    let workloads = workloads(objects);
    let names: BTreeSet<&str> = workloads.iter().map(|w| name(w)).collect();
    assert_eq!(
        names,
        BTreeSet::from([
            "gpumedic-collector",
            "gpumedic-enricher",
            "gpumedic-classifier",
            "gpumedic-remediator",
            "gpumedic-console"
        ]),
        "the four services and the console"
    );
    for w in &workloads {
        let who = format!("{} {}", kind(w), name(w));
        let grace =
            w.pointer("/spec/template/spec/terminationGracePeriodSeconds").and_then(Value::as_u64).unwrap_or(30);
        for c in containers(w) {
            let port = c
                .pointer("/ports")
                .and_then(Value::as_array)
                .and_then(|ps| ps.iter().find(|p| str_at(p, "/name") == Some("admin")))
                .unwrap_or_else(|| panic!("{who}: no container port named admin"));
            assert_eq!(port.pointer("/containerPort").and_then(Value::as_u64), Some(ADMIN_PORT), "{who}: admin port");
            for (probe, path) in [("livenessProbe", "/healthz"), ("readinessProbe", "/readyz")] {
                let get = c.pointer(&format!("/{probe}/httpGet")).unwrap_or_else(|| panic!("{who}: no HTTP {probe}"));
                assert_eq!(str_at(get, "/path"), Some(path), "{who}: {probe} path");
                assert!(
                    get.get("port") == Some(&Value::from("admin")) || get.get("port") == Some(&Value::from(ADMIN_PORT)),
                    "{who}: {probe} must use the admin port, not {:?}",
                    get.get("port")
                );
            }
            let env = environment(objects, c);
            let admin = env.get("GPUMEDIC_ADMIN_ADDR").and_then(Value::as_str).expect("GPUMEDIC_ADMIN_ADDR");
            assert_eq!(admin, format!("0.0.0.0:{ADMIN_PORT}"), "{who}: the admin server listens where the probes look");
            assert!(env.contains_key("GPUMEDIC_KAFKA_BOOTSTRAP"), "{who}: GPUMEDIC_KAFKA_BOOTSTRAP");
            assert_eq!(env.get("GPUMEDIC_LOG_FORMAT").and_then(Value::as_str), Some("json"), "{who}: JSON logs");
            let deadline = env.get("GPUMEDIC_SHUTDOWN_DEADLINE").and_then(Value::as_str).expect("shutdown deadline");
            assert!(
                seconds(deadline) < grace,
                "{who}: GPUMEDIC_SHUTDOWN_DEADLINE {deadline} must be below terminationGracePeriodSeconds {grace}"
            );
            for (section, resource) in [("requests", "cpu"), ("requests", "memory"), ("limits", "memory")] {
                assert!(
                    c.pointer(&format!("/resources/{section}/{resource}")).is_some(),
                    "{who}: resources.{section}.{resource}"
                );
            }
        }
        // A Service with the admin port selects the pods, for Prometheus.
        let pod_labels = w.pointer("/spec/template/metadata/labels").expect("pod labels");
        let service = objects
            .iter()
            .filter(|o| kind(o) == "Service")
            .find(|s| s.pointer("/spec/selector").is_some_and(|sel| labels_match(sel, pod_labels)))
            .unwrap_or_else(|| panic!("{who}: no Service selects its pods"));
        let ports = service.pointer("/spec/ports").and_then(Value::as_array).expect("service ports");
        assert!(
            ports.iter().any(|p| str_at(p, "/name") == Some("admin") && str_at(p, "/targetPort") == Some("admin")),
            "{who}: Service {} needs a port named admin to the admin port",
            name(service)
        );
    }
}

/// The `restricted` Pod Security profile's rules, for every service but the collector; the
/// collector still keeps a read-only root filesystem.
fn assert_hardening(objects: &[Value]) {
    for w in workloads(objects) {
        let who = name(w);
        let pod = w.pointer("/spec/template/spec").expect("pod spec");
        for c in containers(w) {
            assert_eq!(
                c.pointer("/securityContext/readOnlyRootFilesystem"),
                Some(&Value::Bool(true)),
                "{who}: read-only root"
            );
        }
        if who == "gpumedic-collector" {
            continue;
        }
        assert_eq!(pod.pointer("/securityContext/runAsNonRoot"), Some(&Value::Bool(true)), "{who}: runAsNonRoot");
        assert_eq!(
            str_at(pod, "/securityContext/seccompProfile/type"),
            Some("RuntimeDefault"),
            "{who}: seccomp profile"
        );
        for c in containers(w) {
            assert_eq!(
                c.pointer("/securityContext/allowPrivilegeEscalation"),
                Some(&Value::Bool(false)),
                "{who}: allowPrivilegeEscalation"
            );
            assert_eq!(
                c.pointer("/securityContext/capabilities/drop"),
                Some(&serde_json::json!(["ALL"])),
                "{who}: drop ALL"
            );
            assert!(c.pointer("/securityContext/privileged").is_none(), "{who}: not privileged");
        }
    }
}

/// What the collector needs on a GPU node.
fn assert_collector(objects: &[Value]) {
    let ds = find(objects, "DaemonSet", "gpumedic-collector");
    let pod = ds.pointer("/spec/template/spec").expect("pod spec");
    let tolerations = pod.pointer("/tolerations").and_then(Value::as_array).expect("tolerations");
    assert!(
        tolerations.iter().any(|t| {
            str_at(t, "/operator") == Some("Exists") && t.get("key").is_none() && t.get("effect").is_none()
        }),
        "the collector must tolerate every taint (operator Exists, no key, no effect), including gpumedic.io/unhealthy: {tolerations:?}"
    );
    assert_eq!(str_at(pod, "/nodeSelector/nvidia.com~1gpu.present"), Some("true"), "GPU nodes only");
    assert_eq!(str_at(pod, "/runtimeClassName"), Some("nvidia"), "the NVIDIA runtime mounts NVML");
    let c = &containers(ds)[0];
    let env = environment(objects, c);
    assert_eq!(
        env.get("GPUMEDIC_NODE_NAME").and_then(|v| str_at(v, "/fieldRef/fieldPath")),
        Some("spec.nodeName"),
        "GPUMEDIC_NODE_NAME from the downward API"
    );
    assert_eq!(env.get("NVIDIA_VISIBLE_DEVICES").and_then(Value::as_str), Some("all"));
    assert_eq!(env.get("NVIDIA_DRIVER_CAPABILITIES").and_then(Value::as_str), Some("utility"));
    assert!(
        c.pointer("/resources/requests/nvidia.com~1gpu").is_none(),
        "the collector must not take a GPU from workloads"
    );
    // /dev/kmsg and the state directory come from the host, where the environment says.
    let mounts = c.pointer("/volumeMounts").and_then(Value::as_array).expect("volume mounts");
    let volumes = pod.pointer("/volumes").and_then(Value::as_array).expect("volumes");
    let host_path_at = |mount_path: &str| -> Option<&str> {
        let m = mounts.iter().find(|m| str_at(m, "/mountPath") == Some(mount_path))?;
        let v = volumes.iter().find(|v| v.get("name") == m.get("name"))?;
        str_at(v, "/hostPath/path")
    };
    let kmsg = env.get("GPUMEDIC_KMSG_PATH").and_then(Value::as_str).unwrap_or("/dev/kmsg");
    assert_eq!(host_path_at(kmsg), Some("/dev/kmsg"), "the host's kernel log at {kmsg}");
    let state = env.get("GPUMEDIC_STATE_DIR").and_then(Value::as_str).unwrap_or("/var/lib/gpumedic");
    assert_eq!(host_path_at(state), Some("/var/lib/gpumedic"), "the state directory on the host at {state}");
    assert_eq!(
        c.pointer("/securityContext/privileged"),
        Some(&Value::Bool(true)),
        "/dev/kmsg needs a privileged container"
    );
}

/// The classifier's Secret, rules and synthetic-event policy.
fn assert_classifier(objects: &[Value]) {
    let deploy = find(objects, "Deployment", "gpumedic-classifier");
    let c = &containers(deploy)[0];
    let env = environment(objects, c);
    assert!(
        env.get("GPUMEDIC_DATABASE_URL").and_then(|v| str_at(v, "/secretKeyRef/name")).is_some(),
        "GPUMEDIC_DATABASE_URL comes from a Secret"
    );
    assert!(
        !env.contains_key("GPUMEDIC_ALLOW_SYNTHETIC"),
        "injected (synthetic) events must stay ignored in a deployment"
    );
    let rules_dir = env.get("GPUMEDIC_RULES_DIR").and_then(Value::as_str).expect("GPUMEDIC_RULES_DIR");
    let mount = c
        .pointer("/volumeMounts")
        .and_then(Value::as_array)
        .and_then(|ms| ms.iter().find(|m| str_at(m, "/mountPath") == Some(rules_dir)))
        .unwrap_or_else(|| panic!("nothing is mounted at GPUMEDIC_RULES_DIR {rules_dir}"));
    let volume = deploy
        .pointer("/spec/template/spec/volumes")
        .and_then(Value::as_array)
        .and_then(|vs| vs.iter().find(|v| v.get("name") == mount.get("name")))
        .expect("the rules volume");
    let cm = find(objects, "ConfigMap", str_at(volume, "/configMap/name").expect("the rules come from a ConfigMap"));
    // What the cluster gets is exactly the default rule set.
    let data: BTreeMap<String, String> =
        serde_json::from_value(cm.pointer("/data").cloned().expect("rules data")).expect("string data");
    let originals = dir_files(&repo_root().join("services/classifier/rules"));
    let originals: BTreeMap<String, String> =
        originals.into_iter().map(|(file, bytes)| (file, String::from_utf8(bytes).expect("UTF-8 rules"))).collect();
    assert_eq!(data, originals, "the rules ConfigMap must hold services/classifier/rules/*.yaml, unchanged");
}

/// The remediator's mode; a leader and a standby, each knowing its pod name and namespace (the
/// lease identity, and where the lease and status object live); its namespaced Role covers the
/// Lease and the status object by name.
fn assert_remediator(objects: &[Value], mode: &str) {
    let deploy = find(objects, "Deployment", "gpumedic-remediator");
    let env = environment(objects, &containers(deploy)[0]);
    assert_eq!(env.get("GPUMEDIC_MODE").and_then(Value::as_str), Some(mode), "the remediator's GPUMEDIC_MODE");
    assert_eq!(deploy.pointer("/spec/replicas").and_then(Value::as_u64), Some(2), "a leader and a standby");
    for (var, field) in [("POD_NAME", "metadata.name"), ("POD_NAMESPACE", "metadata.namespace")] {
        assert_eq!(
            env.get(var).and_then(|v| v.pointer("/fieldRef/fieldPath")).and_then(Value::as_str),
            Some(field),
            "{var} from the downward API"
        );
    }
    let role = find(objects, "Role", "gpumedic-remediator");
    let rules = role.pointer("/rules").and_then(Value::as_array).expect("rules");
    let named = |resource: &str, name: &str, verb: &str| {
        rules.iter().any(|r| {
            let has = |key: &str, v: &str| r[key].as_array().is_some_and(|a| a.iter().any(|x| x == v));
            has("resources", resource) && has("resourceNames", name) && has("verbs", verb)
        })
    };
    assert!(named("leases", "gpumedic-remediator", "update"), "the Lease, by name");
    assert!(named("configmaps", "gpumedic-remediator-status", "patch"), "the status object, by name");
    for r in rules {
        let verbs: BTreeSet<&str> = r["verbs"].as_array().expect("verbs").iter().filter_map(Value::as_str).collect();
        assert!(
            r.get("resourceNames").is_some() || verbs == BTreeSet::from(["create"]),
            "only create goes unnamed: {r}"
        );
    }
}

/// Bindings point at roles and ServiceAccounts that are deployed, in the right namespace, and
/// only the enricher, the classifier (its incident API's token reviews) and the remediator are
/// bound at all.
fn assert_rbac(objects: &[Value]) {
    let mut bound = BTreeSet::new();
    for b in objects.iter().filter(|o| matches!(kind(o), "RoleBinding" | "ClusterRoleBinding")) {
        let role_kind = str_at(b, "/roleRef/kind").expect("roleRef kind");
        let role = find(objects, role_kind, str_at(b, "/roleRef/name").expect("roleRef name"));
        if role_kind == "Role" {
            assert_eq!(
                role.pointer("/metadata/namespace"),
                b.pointer("/metadata/namespace"),
                "{}: Role namespace",
                name(b)
            );
        }
        for s in b.pointer("/subjects").and_then(Value::as_array).expect("subjects") {
            assert_eq!(str_at(s, "/kind"), Some("ServiceAccount"), "{}: subjects", name(b));
            let sa = find(objects, "ServiceAccount", str_at(s, "/name").expect("subject name"));
            assert_eq!(
                s.pointer("/namespace"),
                sa.pointer("/metadata/namespace"),
                "{}: the subject must be the deployed ServiceAccount, in its namespace",
                name(b)
            );
            bound.insert(name(sa).to_owned());
        }
    }
    assert_eq!(
        bound,
        BTreeSet::from([
            "gpumedic-classifier".to_owned(),
            "gpumedic-console".to_owned(),
            "gpumedic-enricher".to_owned(),
            "gpumedic-remediator".to_owned()
        ])
    );
    // The console reads Nodes and their Events and creates token reviews; in its namespace it
    // reads the remediator's status object, nothing else.
    let console = find(objects, "ClusterRole", "gpumedic-console");
    for rule in console.pointer("/rules").and_then(Value::as_array).expect("rules") {
        let verbs: BTreeSet<&str> = rule["verbs"].as_array().expect("verbs").iter().filter_map(Value::as_str).collect();
        let reviews = rule["apiGroups"] == serde_json::json!(["authentication.k8s.io"])
            || rule["apiGroups"] == serde_json::json!(["authorization.k8s.io"]);
        if reviews {
            assert_eq!(verbs, BTreeSet::from(["create"]), "the console only creates reviews there: {rule}");
        } else {
            assert!(verbs.is_subset(&BTreeSet::from(["get", "list", "watch"])), "the console only reads: {rule}");
            assert_eq!(rule["apiGroups"], serde_json::json!([""]), "the console reads core objects: {rule}");
        }
    }
    let status_reader = find(objects, "Role", "gpumedic-console");
    assert_eq!(
        status_reader.pointer("/rules"),
        Some(&serde_json::json!([{"apiGroups": [""], "resources": ["configmaps"],
            "resourceNames": ["gpumedic-remediator-status"], "verbs": ["get", "list", "watch"]}])),
        "the console reads the remediator's status object only"
    );
    // The classifier creates token and access reviews, nothing else: no read, no write.
    let classifier = find(objects, "ClusterRole", "gpumedic-classifier");
    let mut reviews = BTreeSet::new();
    for rule in classifier.pointer("/rules").and_then(Value::as_array).expect("rules") {
        assert_eq!(rule["verbs"], serde_json::json!(["create"]), "the classifier only creates reviews: {rule}");
        for (group, resource) in
            [("authentication.k8s.io", "tokenreviews"), ("authorization.k8s.io", "subjectaccessreviews")]
        {
            if rule["apiGroups"] == serde_json::json!([group]) && rule["resources"] == serde_json::json!([resource]) {
                reviews.insert(resource);
            }
        }
    }
    assert_eq!(reviews.len(), 2, "the classifier creates tokenreviews and subjectaccessreviews: {classifier}");
    // Granted to nobody by the base: operators bind it to who may read incident history.
    let reader = find(objects, "ClusterRole", "gpumedic-incident-reader");
    assert_eq!(
        reader.pointer("/rules"),
        Some(
            &serde_json::json!([{"apiGroups": ["gpumedic.io"], "resources": ["incidents"], "verbs": ["get", "list"]}])
        ),
        "the incident reader gets and lists incidents.gpumedic.io only"
    );
    let enricher = find(objects, "ClusterRole", "gpumedic-enricher");
    for rule in enricher.pointer("/rules").and_then(Value::as_array).expect("rules") {
        let verbs: BTreeSet<&str> = rule["verbs"].as_array().expect("verbs").iter().filter_map(Value::as_str).collect();
        assert!(verbs.is_subset(&BTreeSet::from(["get", "list", "watch"])), "the enricher only reads: {verbs:?}");
        let resources: BTreeSet<&str> =
            rule["resources"].as_array().expect("resources").iter().filter_map(Value::as_str).collect();
        assert!(
            resources.is_subset(&BTreeSet::from(["nodes", "pods"])),
            "the enricher reads nodes and pods: {resources:?}"
        );
    }
    assert_eq!(
        find(objects, "ServiceAccount", "gpumedic-collector").pointer("/automountServiceAccountToken"),
        Some(&Value::Bool(false)),
        "gpumedic-collector never calls the API, so it gets no token"
    );
}

/// Ingress denied by default, the admin port open to the monitoring namespace.
fn assert_network_policies(objects: &[Value]) {
    let policies: Vec<&Value> = objects.iter().filter(|o| kind(o) == "NetworkPolicy").collect();
    assert!(
        policies.iter().any(|p| p.pointer("/spec/podSelector") == Some(&serde_json::json!({}))
            && p.pointer("/spec/ingress").is_none()
            && p.pointer("/spec/policyTypes") == Some(&serde_json::json!(["Ingress"]))),
        "a default-deny ingress policy for the whole namespace"
    );
    assert!(
        policies.iter().any(|p| {
            p.pointer("/spec/ingress/0/ports/0/port").and_then(Value::as_u64) == Some(ADMIN_PORT)
                && p.pointer("/spec/ingress/0/from/0/namespaceSelector").is_some()
        }),
        "the admin port open to the monitoring namespace"
    );
}

/// Every admin Service is scraped, and the alerts use metrics the services emit.
fn assert_monitoring(objects: &[Value]) {
    let monitors: Vec<&Value> = objects.iter().filter(|o| kind(o) == "ServiceMonitor").collect();
    for s in objects.iter().filter(|o| kind(o) == "Service") {
        let labels = s.pointer("/metadata/labels").expect("service labels");
        let component = str_at(labels, "/app.kubernetes.io~1component").unwrap_or_default();
        let scraped = monitors.iter().any(|m| {
            let selector = m.pointer("/spec/selector").expect("selector");
            let by_labels = selector.get("matchLabels").is_none_or(|ml| labels_match(ml, labels));
            let by_expressions = selector.get("matchExpressions").and_then(Value::as_array).is_none_or(|es| {
                es.iter().all(|e| {
                    str_at(e, "/operator") == Some("In")
                        && e["values"].as_array().is_some_and(|vs| vs.iter().any(|v| v.as_str() == Some(component)))
                })
            });
            let port = m.pointer("/spec/endpoints/0/port").and_then(Value::as_str) == Some("admin");
            by_labels && by_expressions && port
        });
        assert!(scraped, "Service {} is not scraped by any ServiceMonitor on its admin port", name(s));
    }

    let rules = objects.iter().find(|o| kind(o) == "PrometheusRule").expect("a PrometheusRule");
    let exprs: Vec<&str> = rules
        .pointer("/spec/groups")
        .and_then(Value::as_array)
        .expect("groups")
        .iter()
        .flat_map(|g| g["rules"].as_array().expect("rules"))
        .map(|r| r["expr"].as_str().expect("expr"))
        .collect();
    let all = exprs.join("\n");
    let source = rust_sources(&repo_root().join("services"));
    // Every literal metric name the alerts use is written somewhere in the services' code.
    let mut literal = 0;
    for word in all.split(|c: char| !(c.is_ascii_alphanumeric() || c == '_')) {
        if word.starts_with("gpumedic_") && !word.ends_with('_') {
            literal += 1;
            assert!(source.contains(&format!("\"{word}\"")), "the alerts use {word}, which no service emits");
        }
    }
    assert!(literal > 0, "the alerts use gpumedic's own metrics");
    // The runtime's per-service names: gpumedic_{service}_... with these suffixes and labels.
    // The suffixes are constants in the runtime's events module, joined by `metric_name`.
    let runtime = rust_sources(&repo_root().join("services/runtime/src"));
    assert!(runtime.contains("format!(\"gpumedic_{service}_{suffix}\")"), "the runtime names its metrics so");
    for (needle, in_alerts) in [
        ("\"consumer_lag\"", "_consumer_lag"),
        ("\"records_total\"", "_records_total"),
        ("\"handler_retries_total\"", "_handler_retries_total"),
        ("\"dead_lettered\"", "outcome=\"dead_lettered\""),
    ] {
        assert!(runtime.contains(needle), "the runtime no longer emits {needle}");
        assert!(all.contains(in_alerts), "an alert on {in_alerts}");
    }
    for status in ["failed", "blocked_by_breaker"] {
        assert!(all.contains(status), "an alert on the remediator's outcomes with status {status}");
    }
}

fn dir_files(dir: &Path) -> BTreeMap<String, Vec<u8>> {
    std::fs::read_dir(dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .map(|e| e.expect("directory entry").path())
        .filter(|p| p.is_file())
        .map(|p| (p.file_name().expect("file name").to_string_lossy().into_owned(), std::fs::read(&p).expect("read")))
        .collect()
}

fn rust_sources(dir: &Path) -> String {
    let mut text = String::new();
    for entry in std::fs::read_dir(dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display())) {
        let path = entry.expect("directory entry").path();
        if path.is_dir() {
            if path.file_name().is_some_and(|n| n != "target") {
                text.push_str(&rust_sources(&path));
            }
        } else if path.extension().is_some_and(|x| x == "rs") && !path.ends_with("tests/kustomize.rs") {
            text.push_str(&std::fs::read_to_string(&path).expect("read source"));
        }
    }
    text
}

#[test]
fn every_overlay_renders_a_deployment_that_can_run() {
    for mode in OVERLAYS {
        let objects = overlay(mode);
        for o in &objects {
            let cluster_scoped = matches!(kind(o), "Namespace" | "ClusterRole" | "ClusterRoleBinding");
            assert!(
                cluster_scoped || str_at(o, "/metadata/namespace") == Some("gpumedic"),
                "{mode}: {} {} must be in namespace gpumedic",
                kind(o),
                name(o)
            );
        }
        assert_service_basics(&objects);
        assert_hardening(&objects);
        assert_collector(&objects);
        assert_classifier(&objects);
        assert_remediator(&objects, mode);
        assert_rbac(&objects);
        assert_network_policies(&objects);
        assert_monitoring(&objects);
        assert_kafka_principals(&objects);
    }
}

/// Each workload talks to Kafka as its own principal: its options (with its SASL password) come
/// from its own Secret, `gpumedic-kafka-<service>`, never from one shared by all four.
fn assert_kafka_principals(objects: &[Value]) {
    for w in workloads(objects) {
        let env = environment(objects, &containers(w)[0]);
        let options =
            env.get("GPUMEDIC_KAFKA_OPTIONS").unwrap_or_else(|| panic!("{}: GPUMEDIC_KAFKA_OPTIONS", name(w)));
        let own = format!("gpumedic-kafka-{}", name(w).trim_start_matches("gpumedic-"));
        assert_eq!(
            str_at(options, "/secretKeyRef/name"),
            Some(own.as_str()),
            "{}: options from its own Secret",
            name(w)
        );
        assert_eq!(str_at(options, "/secretKeyRef/key"), Some("options"), "{}: the Secret's key", name(w));
    }
}

#[test]
fn the_base_alone_is_monitor_only() {
    let objects = kustomize(&repo_root().join("k8s/base"));
    assert_remediator(&objects, "monitor-only");
    assert_service_basics(&objects);
    assert_rbac(&objects);
}

#[test]
fn the_kafka_and_otel_components_reach_every_service() {
    let dir = kustomization(
        &["overlays/cordon-drain"],
        &["components/kafka-tls-sasl", "components/otel"],
        Some("gpumedic-elsewhere"),
    );
    let objects = kustomize(&dir);
    std::fs::remove_dir_all(&dir).ok();
    // Another namespace moves every binding's subject with it.
    assert_rbac(&objects);
    assert_remediator(&objects, "cordon-drain");
    for w in workloads(&objects) {
        let c = &containers(w)[0];
        let env = environment(&objects, c);
        let options =
            env.get("GPUMEDIC_KAFKA_OPTIONS").unwrap_or_else(|| panic!("{}: GPUMEDIC_KAFKA_OPTIONS", name(w)));
        // Each workload's own Secret (one Kafka principal per service); the shared Secret
        // gpumedic-kafka is gone.
        assert_eq!(
            str_at(options, "/secretKeyRef/name"),
            Some(format!("gpumedic-kafka-{}", name(w).trim_start_matches("gpumedic-")).as_str()),
            "{}: options from the Secret",
            name(w)
        );
        assert!(
            env.get("GPUMEDIC_OTLP_ENDPOINT").and_then(Value::as_str).is_some_and(|e| e.starts_with("http")),
            "{}: GPUMEDIC_OTLP_ENDPOINT",
            name(w)
        );
        let mounts = c.pointer("/volumeMounts").and_then(Value::as_array).expect("mounts");
        assert!(
            mounts.iter().any(|m| str_at(m, "/mountPath") == Some("/etc/gpumedic/kafka")),
            "{}: the Kafka CA at /etc/gpumedic/kafka",
            name(w)
        );
        // The patches add to the base; they must not have replaced its variables or mounts.
        assert!(env.contains_key("GPUMEDIC_KAFKA_BOOTSTRAP"), "{}: bootstrap kept", name(w));
        assert!(mounts.iter().any(|m| str_at(m, "/mountPath") == Some("/tmp")), "{}: /tmp kept", name(w));
    }
    assert_collector(&objects);
    assert_classifier(&objects);
}

#[test]
fn the_copies_in_k8s_base_equal_their_originals() {
    let root = repo_root();
    let rules = dir_files(&root.join("services/classifier/rules"));
    let copies = dir_files(&root.join("k8s/base/rules"));
    assert_eq!(
        copies.keys().collect::<Vec<_>>(),
        rules.keys().collect::<Vec<_>>(),
        "k8s/base/rules must hold exactly services/classifier/rules/*.yaml (and the base's configMapGenerator list them)"
    );
    for (file, bytes) in &rules {
        assert!(
            copies[file] == *bytes,
            "k8s/base/rules/{file} differs from services/classifier/rules/{file}: copy it again \
             (cp services/classifier/rules/*.yaml k8s/base/rules/)"
        );
    }
    for file in ["clusterrole.yaml", "role.yaml"] {
        let original = std::fs::read(root.join("services/remediator/rbac").join(file)).expect("original");
        let copy = std::fs::read(root.join("k8s/base/remediator-rbac").join(file)).expect("copy");
        assert!(
            copy == original,
            "k8s/base/remediator-rbac/{file} differs from services/remediator/rbac/{file}: copy it again"
        );
    }
}

/// Runs kubectl against the testbed's apiserver; returns (success, stdout, stderr).
fn kubectl_on_testbed(args: &[&str], stdin: Option<&str>) -> (bool, String, String) {
    use std::io::Write as _;
    let mut child = Command::new(kubectl())
        .args(args)
        .env("KUBECONFIG", gpumedic_testkit::kubeconfig_path())
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("run kubectl");
    let mut pipe = child.stdin.take().expect("stdin");
    // A kubectl that gave up before reading closes the pipe; its stderr says why, so a failed
    // write is left for the exit status to report.
    let _ = pipe.write_all(stdin.unwrap_or_default().as_bytes());
    drop(pipe);
    let out = child.wait_with_output().expect("kubectl output");
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// Deletes the test's namespace however the test ends. The testbed runs no controller-manager,
/// so there the namespace stays `Terminating`; it is empty (the dry run created nothing in it).
struct NamespaceGuard(String);

impl Drop for NamespaceGuard {
    fn drop(&mut self) {
        let _ = kubectl_on_testbed(&["delete", "namespace", &self.0, "--wait=false", "--ignore-not-found"], None);
    }
}

fn to_yaml(objects: &[&Value]) -> String {
    objects.iter().map(|o| serde_yaml::to_string(o).expect("YAML")).collect::<Vec<_>>().join("---\n")
}

#[test]
fn every_overlay_is_accepted_by_the_apiserver() {
    let (reachable, _, stderr) = kubectl_on_testbed(&["get", "--raw", "/readyz", "--request-timeout=10s"], None);
    assert!(
        reachable,
        "the testbed's kube-apiserver does not answer with {} ({}): run compose/up",
        gpumedic_testkit::kubeconfig_path().display(),
        stderr.trim()
    );
    for mode in OVERLAYS {
        // The overlay in a namespace of its own, so parallel runs and a real deployment on the
        // same apiserver never meet. With the Kafka and OTel components too, so their patches are
        // checked by the server as well.
        let ns = gpumedic_testkit::unique_name("gpumedic-kt");
        let dir =
            kustomization(&[&format!("overlays/{mode}")], &["components/kafka-tls-sasl", "components/otel"], Some(&ns));
        let objects = kustomize(&dir);
        std::fs::remove_dir_all(&dir).ok();
        // The testbed has no Prometheus Operator CRDs: ServiceMonitor and PrometheusRule are
        // checked by the rendering test only.
        let objects: Vec<&Value> = objects
            .iter()
            .filter(|o| !str_at(o, "/apiVersion").unwrap_or_default().starts_with("monitoring.coreos.com/"))
            .collect();
        // A dry run creates nothing, so namespaced objects need their namespace to exist for real.
        let namespace: Vec<&Value> = objects.iter().copied().filter(|o| kind(o) == "Namespace").collect();
        assert_eq!(namespace.len(), 1, "{mode}: one Namespace");
        let _guard = NamespaceGuard(ns.clone());
        let (ok, _, stderr) = kubectl_on_testbed(&["apply", "-f", "-"], Some(&to_yaml(&namespace)));
        assert!(ok, "{mode}: creating namespace {ns} failed: {stderr}");

        let (ok, stdout, stderr) =
            kubectl_on_testbed(&["apply", "--dry-run=server", "-f", "-"], Some(&to_yaml(&objects)));
        assert!(ok, "{mode}: the apiserver refused part of the overlay:\n{stderr}\n{stdout}");
        let accepted = stdout.lines().filter(|l| l.ends_with("(server dry run)")).count();
        assert_eq!(accepted, objects.len(), "{mode}: every object accepted:\n{stdout}");
        assert!(!stderr.contains("Warning"), "{mode}: the apiserver warned about the overlay:\n{stderr}");
    }
}
