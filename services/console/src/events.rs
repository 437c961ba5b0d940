//! The console's notable events and the names of its metrics ([`names`]), in one place.
//!
//! An event is a small type whose [`InternalEvent::emit`] writes the log line and updates the
//! metric together (the runtime's pattern, `gpumedic_runtime::events`).

use std::fmt::Display;

pub(crate) use gpumedic_runtime::events::InternalEvent;

/// The console's metric names. Dashboards and the tests read them: they never change.
pub(crate) mod names {
    /// Open live event streams.
    pub(crate) const LIVE_CLIENTS: &str = "gpumedic_console_live_clients";
    /// Verdicts handed to the open pages.
    pub(crate) const LIVE_VERDICTS_TOTAL: &str = "gpumedic_console_live_verdicts_total";
    /// Verdict records the console could not decode.
    pub(crate) const LIVE_UNDECODABLE_TOTAL: &str = "gpumedic_console_live_undecodable_total";
    /// The share of the fleet's GPUs in service.
    pub(crate) const FLEET_GPU_IN_SERVICE_RATIO: &str = "gpumedic_console_fleet_gpu_in_service_ratio";
    /// The fleet's GPUs, by `service` (`in`, `out`).
    pub(crate) const FLEET_GPUS: &str = "gpumedic_console_fleet_gpus";
    /// The fleet's nodes, by `state`.
    pub(crate) const FLEET_NODES: &str = "gpumedic_console_fleet_nodes";
}

/// A verdict record the console cannot decode was skipped (the classifier's consumers
/// dead-letter it; here it is only a debug line).
pub(crate) struct LiveVerdictUndecodable<'a, E: Display> {
    pub(crate) error: &'a E,
    pub(crate) partition: i32,
    pub(crate) offset: i64,
}

impl<E: Display> InternalEvent for LiveVerdictUndecodable<'_, E> {
    fn emit(self) {
        metrics::counter!(names::LIVE_UNDECODABLE_TOTAL).increment(1);
        tracing::debug!(error = %self.error, partition = self.partition, offset = self.offset,
            "Skipped a verdict record the console cannot decode (the classifier's consumers dead-letter it).");
    }
}
