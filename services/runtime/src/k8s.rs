//! The Kubernetes client every service that talks to the API uses: `KUBECONFIG` (or
//! `~/.kube/config`) when present, the in-cluster ServiceAccount otherwise.

/// What went wrong building a Kubernetes client.
#[derive(Debug, thiserror::Error)]
pub enum KubeError {
    /// No configuration was found, or it is unusable.
    #[error("no usable Kubernetes configuration (KUBECONFIG, ~/.kube/config or in-cluster): {0}")]
    Config(#[source] kube::config::InferConfigError),
    /// The client could not be built from the configuration.
    #[error("cannot build the Kubernetes client: {0}")]
    Client(#[source] kube::Error),
}

/// A client from the inferred configuration.
pub async fn client() -> Result<kube::Client, KubeError> {
    let config = kube::Config::infer().await.map_err(KubeError::Config)?;
    kube::Client::try_from(config).map_err(KubeError::Client)
}

/// Keeps `ready` true while the API server answers, checking every `every` until `token` is
/// cancelled. Runs as one of a service's long tasks.
pub async fn watch_reachability(
    client: kube::Client,
    ready: crate::admin::ReadyFlag,
    every: std::time::Duration,
    token: tokio_util::sync::CancellationToken,
) -> Result<(), KubeError> {
    loop {
        let ok = tokio::time::timeout(std::time::Duration::from_secs(5), client.apiserver_version()).await;
        match ok {
            Ok(Ok(_)) => ready.set(true),
            Ok(Err(e)) => {
                ready.set(false);
                tracing::warn!(error = %e, "The Kubernetes API is not answering.");
            }
            Err(_) => {
                ready.set(false);
                tracing::warn!("The Kubernetes API did not answer within 5 s.");
            }
        }
        tokio::select! {
            () = token.cancelled() => return Ok(()),
            () = tokio::time::sleep(every) => {}
        }
    }
}
