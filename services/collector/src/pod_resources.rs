//! Which pods use which GPU, from the kubelet's PodResources API.
//!
//! The kubelet serves `v1.PodResourcesLister` on a unix socket
//! (`/var/lib/kubelet/pod-resources/kubelet.sock`); `List` gives every pod of the node with the
//! devices assigned to each container. With the NVIDIA device plugin the devices of resource
//! `nvidia.com/gpu` are GPU UUIDs (`GPU-...`, with `::N` appended per replica under time-slicing),
//! and those of `nvidia.com/mig-<profile>` (the mixed MIG strategy) are MIG device UUIDs
//! (`MIG-...`). [`GpuPods`] maps each of those ids to the pods using it, so a fault on one GPU
//! names the workload on that GPU rather than every GPU pod of the node.
//!
//! [`poll`] asks the kubelet every interval and hands the answer to the node identity, which
//! attaches the pods of each event's GPU to the event when it is handed to the publisher
//! ([`NodeIdentity::stamp`]).

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::time::Duration;

use gpumedic_proto::podresources::v1::pod_resources_lister_client::PodResourcesListerClient;
use gpumedic_proto::podresources::v1::{ListPodResourcesRequest, ListPodResourcesResponse};
use gpumedic_schemas::HealthEvent;
use gpumedic_schemas::health::{GpuWorkload, MonitorState, Source};
use tokio_util::sync::CancellationToken;

use crate::identity::NodeIdentity;
use crate::publisher::Sink;

/// The kubelet's PodResources socket.
pub const DEFAULT_SOCKET: &str = "/var/lib/kubelet/pod-resources/kubelet.sock";

/// The device plugin's resource for whole GPUs (and time-sliced replicas of them).
pub const GPU_RESOURCE: &str = "nvidia.com/gpu";

/// The prefix of the device plugin's MIG resources (`nvidia.com/mig-1g.10gb`).
pub const MIG_RESOURCE_PREFIX: &str = "nvidia.com/mig-";

/// A container using a GPU.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct PodRef {
    /// The pod's namespace.
    pub namespace: String,
    /// The pod's name.
    pub pod: String,
    /// The container the device is assigned to.
    pub container: String,
}

/// The pods using each GPU (by UUID) or MIG device (by MIG UUID) of the node.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct GpuPods {
    by_device: BTreeMap<String, BTreeSet<PodRef>>,
}

impl GpuPods {
    /// The pods using `device` (a GPU UUID or a MIG UUID); empty when none or unknown.
    pub fn pods(&self, device: &str) -> Vec<PodRef> {
        self.by_device.get(device).map(|p| p.iter().cloned().collect()).unwrap_or_default()
    }

    /// Every device some pod uses, sorted.
    pub fn devices(&self) -> Vec<&str> {
        self.by_device.keys().map(String::as_str).collect()
    }

    /// No pod uses a GPU.
    pub fn is_empty(&self) -> bool {
        self.by_device.is_empty()
    }

    /// The containers using GPU `gpu_uuid`, each with the devices of that GPU it holds: the GPU
    /// itself, and the MIG devices on it (`mig_parents` maps a MIG UUID to its GPU's UUID). When
    /// the event names one MIG device (`mig_device`, a `MIG-` UUID), only the containers on that
    /// device. UUIDs compare without regard to case; the result is sorted.
    pub fn workloads_of(
        &self,
        gpu_uuid: &str,
        mig_device: Option<&str>,
        mig_parents: &BTreeMap<String, String>,
    ) -> Vec<GpuWorkload> {
        let mig_device = mig_device.filter(|m| m.get(..4).is_some_and(|p| p.eq_ignore_ascii_case("MIG-")));
        let on_the_gpu = |device: &str| match mig_device {
            Some(mig) => device.eq_ignore_ascii_case(mig),
            None => {
                device.eq_ignore_ascii_case(gpu_uuid)
                    || mig_parents
                        .iter()
                        .any(|(mig, parent)| mig.eq_ignore_ascii_case(device) && parent.eq_ignore_ascii_case(gpu_uuid))
            }
        };
        let mut held: BTreeMap<&PodRef, Vec<String>> = BTreeMap::new();
        for (device, pods) in self.by_device.iter().filter(|(device, _)| on_the_gpu(device)) {
            for pod in pods {
                held.entry(pod).or_default().push(device.clone());
            }
        }
        held.into_iter()
            .map(|(pod, gpu_uuids)| GpuWorkload {
                namespace: pod.namespace.clone(),
                pod: pod.pod.clone(),
                container: pod.container.clone(),
                gpu_uuids,
            })
            .collect()
    }
}

/// The device id as the GPU (or MIG device) it names: a time-sliced replica `GPU-x::3` is `GPU-x`.
fn device_id(raw: &str) -> &str {
    raw.split_once("::").map_or(raw, |(id, _)| id).trim()
}

/// Whether `resource` is one of the NVIDIA device plugin's GPU resources.
fn is_gpu_resource(resource: &str) -> bool {
    resource == GPU_RESOURCE || resource.starts_with(MIG_RESOURCE_PREFIX)
}

/// The GPU assignments in a `List` answer. Pure; the rest of the module is transport.
pub fn gpu_pods(response: &ListPodResourcesResponse) -> GpuPods {
    let mut by_device: BTreeMap<String, BTreeSet<PodRef>> = BTreeMap::new();
    for pod in &response.pod_resources {
        for container in &pod.containers {
            for devices in container.devices.iter().filter(|d| is_gpu_resource(&d.resource_name)) {
                for raw in &devices.device_ids {
                    let id = device_id(raw);
                    if id.is_empty() {
                        continue;
                    }
                    by_device.entry(id.to_owned()).or_default().insert(PodRef {
                        namespace: pod.namespace.clone(),
                        pod: pod.name.clone(),
                        container: container.name.clone(),
                    });
                }
            }
        }
    }
    GpuPods { by_device }
}

/// Why the kubelet could not be asked.
#[derive(Debug, thiserror::Error)]
pub enum PodResourcesError {
    /// The socket is not there: not a kubelet node, or the path is not mounted.
    #[error("the kubelet's PodResources socket {0} does not exist")]
    Absent(PathBuf),
    /// The connection failed.
    #[error("cannot connect to the kubelet's PodResources socket {path}: {source}")]
    Connect {
        /// The socket.
        path: PathBuf,
        /// The error.
        source: tonic::transport::Error,
    },
    /// `List` failed.
    #[error("the kubelet's PodResources List failed: {0}")]
    List(#[from] tonic::Status),
    /// No answer in time.
    #[error("the kubelet's PodResources List did not answer within {0:?}")]
    Timeout(Duration),
}

/// Asks the kubelet on `socket` which pods use which GPU, within `timeout`.
///
/// # Errors
/// [`PodResourcesError`]: the socket absent, the connection or the call failed, or no answer in
/// time.
pub async fn list(socket: &Path, timeout: Duration) -> Result<GpuPods, PodResourcesError> {
    if !socket.exists() {
        return Err(PodResourcesError::Absent(socket.to_owned()));
    }
    let call = async {
        let path = socket.to_owned();
        // The URI is a placeholder: the connector dials the unix socket.
        let channel = tonic::transport::Endpoint::from_static("http://kubelet.invalid")
            .connect_with_connector(tower::service_fn(move |_: http::Uri| {
                let path = path.clone();
                async move {
                    Ok::<_, std::io::Error>(hyper_util::rt::TokioIo::new(tokio::net::UnixStream::connect(path).await?))
                }
            }))
            .await
            .map_err(|source| PodResourcesError::Connect { path: socket.to_owned(), source })?;
        let answer = PodResourcesListerClient::new(channel).list(ListPodResourcesRequest {}).await?;
        Ok(gpu_pods(answer.get_ref()))
    };
    tokio::time::timeout(timeout, call).await.map_err(|_| PodResourcesError::Timeout(timeout))?
}

/// The `monitor` of the `monitor_health` events the poller publishes.
pub const MONITOR: &str = "pod-resources";

/// How [`poll`] asks the kubelet.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PodResourcesSettings {
    /// The node, for the `monitor_health` events.
    pub node: String,
    /// The kubelet's PodResources socket.
    pub socket: PathBuf,
    /// Time between two `List` calls.
    pub interval: Duration,
    /// How long one `List` may take.
    pub timeout: Duration,
}

impl PodResourcesSettings {
    /// How long the last answer is used while the kubelet fails: five intervals. Past it, events
    /// carry no list (the enricher falls back to the pod annotation) rather than a stale one.
    pub fn stale_after(&self) -> Duration {
        self.interval.saturating_mul(5)
    }
}

fn monitor(node: &str, state: MonitorState, message: String) -> HealthEvent {
    crate::sources::monitor_event(node, Source::KernelLog, MONITOR, state, message)
}

/// Asks the kubelet which pods use which GPU every `settings.interval` and keeps the answer in
/// `sink`'s node identity, which attaches each event's pods when the event is handed to the
/// publisher.
///
/// A missing socket (not a kubelet node, or the folder not mounted) is logged once and the
/// collector runs on without the lists: events then carry none and the enricher falls back to
/// the pod annotation. A socket that is there but fails is a `monitor_health` `error` (`hung`
/// when it does not answer in time; monitor `pod-resources`, once until it answers again, then a
/// healthy one); the last answer is used
/// until [`PodResourcesSettings::stale_after`]. The task ends only with the collector.
///
/// # Errors
/// None today; the signature is that of every source task.
pub async fn poll(
    settings: PodResourcesSettings,
    sink: Sink,
    token: CancellationToken,
) -> Result<(), PodResourcesError> {
    let identity: NodeIdentity = sink.identity().clone();
    let mut absent_said = false;
    let mut failing = false;
    let mut last_answer: Option<tokio::time::Instant> = None;
    loop {
        let event = match list(&settings.socket, settings.timeout).await {
            Ok(pods) => {
                absent_said = false;
                if last_answer.is_none() {
                    tracing::info!(
                        socket = %settings.socket.display(),
                        gpus = pods.devices().len(),
                        "The kubelet's PodResources API answers: events name the pods on their GPU."
                    );
                }
                identity.set_gpu_pods(Some(pods));
                last_answer = Some(tokio::time::Instant::now());
                std::mem::take(&mut failing).then(|| {
                    monitor(&settings.node, MonitorState::Ok, "the kubelet's PodResources API answers again".into())
                })
            }
            Err(PodResourcesError::Absent(path)) => {
                if !std::mem::replace(&mut absent_said, true) {
                    tracing::warn!(
                        socket = %path.display(),
                        "The kubelet's PodResources socket does not exist: events carry no pods of their own, and the enricher falls back to the gpumedic.io/gpu-uuids pod annotation."
                    );
                }
                identity.set_gpu_pods(None);
                last_answer = None;
                None
            }
            Err(e) => {
                metrics::counter!("gpumedic_collector_pod_resources_failures_total").increment(1);
                tracing::warn!(error = %e, "The kubelet's PodResources API failed; asking again at the next interval.");
                if last_answer.is_none_or(|at| at.elapsed() >= settings.stale_after()) {
                    identity.set_gpu_pods(None);
                }
                let state =
                    if matches!(e, PodResourcesError::Timeout(_)) { MonitorState::Hung } else { MonitorState::Error };
                (!std::mem::replace(&mut failing, true)).then(|| monitor(&settings.node, state, e.to_string()))
            }
        };
        if let Some(event) = event
            && !sink.emit_until_done(&event, &token).await
        {
            return Ok(());
        }
        tokio::select! {
            () = token.cancelled() => return Ok(()),
            () = tokio::time::sleep(settings.interval) => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use gpumedic_proto::podresources::v1::{ContainerDevices, ContainerResources, PodResources};

    fn pod(ns: &str, name: &str, containers: Vec<ContainerResources>) -> PodResources {
        PodResources { name: name.into(), namespace: ns.into(), containers }
    }

    fn container(name: &str, devices: &[(&str, &[&str])]) -> ContainerResources {
        ContainerResources {
            name: name.into(),
            devices: devices
                .iter()
                .map(|(r, ids)| ContainerDevices {
                    resource_name: (*r).into(),
                    device_ids: ids.iter().map(|s| (*s).to_owned()).collect(),
                })
                .collect(),
        }
    }

    fn r(ns: &str, pod: &str, c: &str) -> PodRef {
        PodRef { namespace: ns.into(), pod: pod.into(), container: c.into() }
    }

    #[test]
    fn each_gpu_names_the_containers_it_is_assigned_to() {
        let response = ListPodResourcesResponse {
            pod_resources: vec![
                pod("ml", "train-0", vec![container("main", &[(GPU_RESOURCE, &["GPU-a", "GPU-b"])])]),
                pod("ml", "train-1", vec![container("main", &[(GPU_RESOURCE, &["GPU-c"])])]),
                // Time-slicing: two replicas of GPU-d in two pods.
                pod("dev", "nb-1", vec![container("jupyter", &[(GPU_RESOURCE, &["GPU-d::0"])])]),
                pod("dev", "nb-2", vec![container("jupyter", &[(GPU_RESOURCE, &["GPU-d::1"])])]),
                // Mixed MIG strategy.
                pod("inf", "serve", vec![container("triton", &[("nvidia.com/mig-1g.10gb", &["MIG-e"])])]),
                // Other devices are not GPUs.
                pod("net", "rdma", vec![container("c", &[("rdma/hca_shared_devices_a", &["1"])])]),
                pod("kube-system", "no-devices", vec![container("c", &[])]),
            ],
        };
        let pods = gpu_pods(&response);
        assert_eq!(pods.pods("GPU-a"), vec![r("ml", "train-0", "main")]);
        assert_eq!(pods.pods("GPU-c"), vec![r("ml", "train-1", "main")]);
        assert_eq!(pods.pods("GPU-d"), vec![r("dev", "nb-1", "jupyter"), r("dev", "nb-2", "jupyter")]);
        assert_eq!(pods.pods("MIG-e"), vec![r("inf", "serve", "triton")]);
        assert_eq!(pods.devices(), vec!["GPU-a", "GPU-b", "GPU-c", "GPU-d", "MIG-e"]);
        assert!(pods.pods("GPU-unused").is_empty());
    }

    #[test]
    fn an_events_gpu_names_its_containers_and_those_on_its_mig_devices() {
        let response = ListPodResourcesResponse {
            pod_resources: vec![
                pod("ml", "train-0", vec![container("main", &[(GPU_RESOURCE, &["GPU-a", "GPU-b"])])]),
                pod("dev", "nb-1", vec![container("jupyter", &[(GPU_RESOURCE, &["GPU-a::0"])])]),
                pod("inf", "serve", vec![container("triton", &[("nvidia.com/mig-1g.10gb", &["MIG-c1"])])]),
                pod("inf", "batch", vec![container("worker", &[("nvidia.com/mig-1g.10gb", &["MIG-c2"])])]),
            ],
        };
        let pods = gpu_pods(&response);
        let w = |ns: &str, pod: &str, c: &str, ids: &[&str]| GpuWorkload {
            namespace: ns.into(),
            pod: pod.into(),
            container: c.into(),
            gpu_uuids: ids.iter().map(|s| (*s).to_owned()).collect(),
        };
        let none = BTreeMap::new();
        assert_eq!(
            pods.workloads_of("gpu-A", None, &none),
            vec![w("dev", "nb-1", "jupyter", &["GPU-a"]), w("ml", "train-0", "main", &["GPU-a"])],
            "by UUID, whatever the case; time-sliced replicas count as the GPU"
        );
        assert!(pods.workloads_of("GPU-c", None, &none).is_empty(), "MIG devices of unknown parent");
        let parents =
            BTreeMap::from([("MIG-c1".to_owned(), "GPU-c".to_owned()), ("MIG-c2".to_owned(), "GPU-c".into())]);
        assert_eq!(
            pods.workloads_of("GPU-c", None, &parents),
            vec![w("inf", "batch", "worker", &["MIG-c2"]), w("inf", "serve", "triton", &["MIG-c1"])],
            "the parent GPU names the pods of its MIG devices"
        );
        assert_eq!(
            pods.workloads_of("GPU-c", Some("MIG-c1"), &parents),
            vec![w("inf", "serve", "triton", &["MIG-c1"])],
            "an event on one MIG device names that device's pods"
        );
        assert_eq!(pods.workloads_of("GPU-c", Some("1/0"), &parents).len(), 2, "a MIG instance id is not a device");
        assert!(pods.workloads_of("GPU-unused", None, &parents).is_empty());
    }

    #[tokio::test]
    async fn an_absent_socket_says_so() {
        let err = list(Path::new("/nonexistent/kubelet.sock"), Duration::from_secs(1)).await.unwrap_err();
        assert!(matches!(err, PodResourcesError::Absent(_)), "{err}");
    }
}
