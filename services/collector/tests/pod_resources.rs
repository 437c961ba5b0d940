//! The kubelet PodResources reader against a PodResources server started here, on a unix socket
//! in a temp dir, speaking the kubelet's protocol (`v1.PodResourcesLister/List`).

mod common;

use std::time::Duration;

use common::{Kubelet, PodDevices};
use gpumedic_collector::pod_resources::{self, GPU_RESOURCE, PodRef};

/// A kubelet that answers `List` with two training pods on four GPUs and one MIG pod.
fn kubelet() -> Kubelet {
    let pod = |ns: &str, name: &str, resource: &str, ids: &[&str]| PodDevices::new(ns, name, "main", resource, ids);
    Kubelet {
        pods: vec![
            pod("ml", "train-a", GPU_RESOURCE, &["GPU-0", "GPU-1"]),
            pod("ml", "train-b", GPU_RESOURCE, &["GPU-2", "GPU-3"]),
            pod("inf", "serve", "nvidia.com/mig-3g.40gb", &["MIG-7"]),
        ],
        ..Kubelet::default()
    }
}

#[tokio::test]
async fn the_gpus_pods_come_from_the_kubelet_socket() {
    let dir = std::env::temp_dir().join(format!("gpumedic-podres-{}", uuid::Uuid::new_v4()));
    std::fs::create_dir_all(&dir).unwrap();
    let socket = dir.join("kubelet.sock");
    let server = common::serve_kubelet(kubelet(), &socket);
    let pods = pod_resources::list(&socket, Duration::from_secs(5)).await.expect("the kubelet answers");
    let one = |ns: &str, pod: &str| vec![PodRef { namespace: ns.into(), pod: pod.into(), container: "main".into() }];
    assert_eq!(pods.pods("GPU-1"), one("ml", "train-a"));
    assert_eq!(pods.pods("GPU-2"), one("ml", "train-b"));
    assert_eq!(pods.pods("MIG-7"), one("inf", "serve"));
    assert!(pods.pods("GPU-4").is_empty(), "a GPU no pod uses names no pod");

    // The kubelet goes away: the error says which socket.
    server.abort();
    let _ = server.await;
    std::fs::remove_file(&socket).unwrap();
    let err = pod_resources::list(&socket, Duration::from_secs(2)).await.unwrap_err();
    assert!(err.to_string().contains("kubelet.sock"), "{err}");
    std::fs::remove_dir_all(&dir).unwrap();
}
