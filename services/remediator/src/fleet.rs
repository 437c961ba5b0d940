//! The managed fleet: the GPU nodes gpumedic acts on, and their count (the breaker's
//! denominator).

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use crate::apply;

/// The GPU nodes gpumedic manages (those matching `--gpu-node-selector`): it acts on no other
/// node, and the breaker's share is measured against their number.
#[derive(Clone)]
pub struct Fleet {
    pub(crate) client: kube::Client,
    pub(crate) selector: String,
    pub(crate) names: Arc<std::sync::RwLock<std::collections::HashSet<String>>>,
    pub(crate) count: Arc<AtomicUsize>,
}

impl Fleet {
    pub(crate) async fn refresh(&self) -> Result<usize, kube::Error> {
        let names = apply::managed_nodes(&self.client, &self.selector).await?;
        let n = names.len();
        *self.names.write().expect("fleet lock") = names;
        self.count.store(n, Ordering::Release);
        metrics::gauge!(crate::events::names::GPU_NODES).set(n as f64);
        Ok(n)
    }

    /// Whether `node` is managed; a node not seen yet triggers one fresh listing, so a node that
    /// joined since the last refresh is not refused.
    pub(crate) async fn manages(&self, node: &str) -> Result<bool, kube::Error> {
        if self.names.read().expect("fleet lock").contains(node) {
            return Ok(true);
        }
        self.refresh().await?;
        Ok(self.names.read().expect("fleet lock").contains(node))
    }
}

/// Keeps the fleet (the breaker's denominator) current; ready once listed.
pub(crate) async fn count_gpu_nodes(
    fleet: Fleet,
    ready: gpumedic_runtime::admin::ReadyFlag,
    token: tokio_util::sync::CancellationToken,
) -> Result<(), kube::Error> {
    loop {
        match fleet.refresh().await {
            Ok(_) => ready.set(true),
            Err(e) => {
                ready.set(false);
                tracing::warn!(error = %e, "Cannot count GPU nodes; the breaker keeps the last count.");
            }
        }
        tokio::select! {
            () = token.cancelled() => return Ok(()),
            () = tokio::time::sleep(Duration::from_secs(30)) => {}
        }
    }
}
