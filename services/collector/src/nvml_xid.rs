//! Xid events from NVML's event set, as raw `xid` events.
//!
//! NVML keeps only the last Xid between two waits and gives no message text, so the kernel log is
//! the primary Xid source and this one is a fallback: with `--nvml-xids auto` (the default) it
//! runs only when the kernel log is off (for example when `/dev/kmsg` cannot be read), because
//! running both would report every Xid twice and double the classifier's counts.

use gpumedic_runtime::kafka::KafkaError;
use gpumedic_schemas::HealthEvent;
use gpumedic_schemas::health::{Component, Detail, Entity, Source, XidDetail};
use tokio_util::sync::CancellationToken;

use crate::gpu::{GpuBackend, NvmlXid};
use crate::publisher::Sink;

/// Whether the NVML Xid watcher runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum XidChoice {
    /// Only when the kernel log is off.
    Auto,
    /// Always.
    On,
    /// Never.
    Off,
}

impl XidChoice {
    /// Reads the flag's value.
    pub fn parse(raw: &str) -> Result<Self, String> {
        match raw.trim() {
            "auto" => Ok(Self::Auto),
            "on" => Ok(Self::On),
            "off" => Ok(Self::Off),
            other => Err(format!("'{other}' is not a choice; use auto, on or off")),
        }
    }

    /// Whether the watcher runs, given whether the kernel log is followed.
    pub fn runs(self, kernel_log_on: bool) -> bool {
        match self {
            Self::Auto => !kernel_log_on,
            Self::On => true,
            Self::Off => false,
        }
    }
}

/// The raw event for an Xid from NVML.
pub fn xid_event(node: &str, source: Source, xid: &NvmlXid) -> HealthEvent {
    let entity = Entity {
        gpu_uuid: xid.uuid.clone(),
        pci_bus_id: xid.pci_bus_id.clone(),
        gpu_index: xid.index.and_then(|i| i32::try_from(i).ok()),
        ..Default::default()
    };
    HealthEvent::new(
        node,
        source,
        Component::Gpu,
        entity,
        Detail::Xid(XidDetail {
            code: i32::try_from(xid.code).unwrap_or(i32::MAX),
            text: "reported by the NVML event set; NVML gives no message text".into(),
            pid: None,
            process: None,
            nvlink5: None,
            recovery_action: None,
        }),
    )
}

/// Starts `backend`'s Xid watcher and publishes what it reports until `token` is cancelled. A
/// backend without Xid events, or a watcher that stops, leaves this task idle rather than ended,
/// so that the service goes on.
pub fn forward_xids(
    node: String,
    source: Source,
    backend: &dyn GpuBackend,
    emitter: Sink,
    token: CancellationToken,
) -> impl Future<Output = Result<(), KafkaError>> + Send + 'static {
    let (tx, mut rx) = tokio::sync::mpsc::channel::<NvmlXid>(64);
    let started = match backend.watch_xids(tx) {
        Ok(started) => started,
        Err(e) => {
            tracing::warn!(error = %e, "Cannot watch NVML Xid events; the kernel log remains the Xid source.");
            false
        }
    };
    async move {
        if started {
            while let Some(xid) = tokio::select! {
                () = token.cancelled() => None,
                x = rx.recv() => x,
            } {
                tracing::info!(code = xid.code, gpu = ?xid.uuid, "NVML reported an Xid.");
                if !emitter.emit_until_done(&xid_event(&node, source, &xid), &token).await {
                    return Ok(());
                }
            }
        }
        // Dropping the receiver tells the watcher thread to stop at its next wait.
        drop(rx);
        token.cancelled().await;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gpu::Simulated;

    #[test]
    fn auto_runs_only_without_the_kernel_log() {
        assert!(XidChoice::parse("auto").unwrap().runs(false));
        assert!(!XidChoice::parse("auto").unwrap().runs(true));
        assert!(XidChoice::parse("on").unwrap().runs(true));
        assert!(!XidChoice::parse("off").unwrap().runs(false));
        assert!(XidChoice::parse("sometimes").is_err());
    }

    #[tokio::test]
    async fn simulated_xids_arrive_through_the_watcher_thread() {
        let (sim, control) = Simulated::new("n", 4);
        let (tx, mut rx) = tokio::sync::mpsc::channel(8);
        assert!(sim.watch_xids(tx.clone()).unwrap());
        assert!(!sim.watch_xids(tx).unwrap(), "one watcher per backend");
        control.xid(2, 79);
        let xid = rx.recv().await.expect("an Xid");
        assert_eq!((xid.index, xid.code), (Some(2), 79));
        let e = xid_event("n", Source::Nvml, &xid);
        assert_eq!(e.entity.gpu_uuid.as_deref(), Some(crate::gpu::simulated_uuid("n", 2).as_str()));
        assert!(matches!(&e.detail, Detail::Xid(x) if x.code == 79 && x.pid.is_none()));
        assert!(!e.healthy);
    }
}
