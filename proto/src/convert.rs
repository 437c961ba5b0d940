//! From an ingest event to the raw [`HealthEvent`] the collector publishes: validation, and the
//! fields the caller may not choose.
//!
//! A pure function of the event and the collector's context (its node name, its clock reading
//! and its version), so the server stays a thin edge and every rule is tested here without one.
//! The only thing not fixed by the inputs is the random part of a generated UUIDv7.
//!
//! The node is the collector's, never the caller's: a monitor on node A cannot publish events
//! about node B, whatever it sends. An event that names another node is refused outright
//! ([`IngestError::NodeNotServed`], PERMISSION_DENIED) rather than silently re-stamped, because a
//! monitor that believes it runs elsewhere is misconfigured and its events may be about the wrong
//! machine.

use std::collections::BTreeMap;

use chrono::{DateTime, Duration, Utc};
use gpumedic_schemas::health::{self as h, HealthEvent};
use uuid::Uuid;

use crate::ingest::v1 as pb;
use pb::ingest_event::Detail as PbDetail;

/// Most events in one `PublishBatch` call.
pub const MAX_BATCH_EVENTS: usize = 1000;
/// Longest identifier-like string (entity ids, names, versions, keys), in bytes.
pub const MAX_NAME_BYTES: usize = 256;
/// Longest free text (log lines, messages, custom values), in bytes.
pub const MAX_TEXT_BYTES: usize = 16 * 1024;
/// Most entries in a custom detail's values, and most throttle reasons.
pub const MAX_ENTRIES: usize = 64;
/// How far ahead of the collector's clock an observation time may be (clock skew between the
/// monitor and the collector on one node is small; more means a unit mistake, e.g. nanoseconds).
pub const MAX_FUTURE_SKEW: Duration = Duration::minutes(5);

/// What the collector, not the caller, decides about every ingested event.
#[derive(Debug, Clone, Copy)]
pub struct IngestContext<'a> {
    /// The collector's node: the only node its ingest API publishes for.
    pub node: &'a str,
    /// The collector's clock: the publish time, and the observation time when the caller gives
    /// none.
    pub now: DateTime<Utc>,
    /// Recorded as `collector_version` when the caller gives no client version.
    pub collector_version: &'a str,
}

/// Why an ingest event cannot be published.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum IngestError {
    /// The event is malformed; `field` is its path in the event (e.g. `detail.xid.code`).
    #[error("{field}: {reason}")]
    InvalidArgument {
        /// Path of the offending field in the event, in proto field names.
        field: String,
        /// What is wrong with it.
        reason: String,
    },
    /// The event names a node other than the collector's.
    #[error("the event names node {claimed:?}, but this collector publishes for node {serving:?} only")]
    NodeNotServed {
        /// The node the event named.
        claimed: String,
        /// The collector's node.
        serving: String,
    },
}

impl IngestError {
    /// The gRPC status code documented for this error.
    pub fn code(&self) -> tonic::Code {
        match self {
            IngestError::InvalidArgument { .. } => tonic::Code::InvalidArgument,
            IngestError::NodeNotServed { .. } => tonic::Code::PermissionDenied,
        }
    }

    /// The offending field, for a malformed event.
    pub fn field(&self) -> Option<&str> {
        match self {
            IngestError::InvalidArgument { field, .. } => Some(field),
            IngestError::NodeNotServed { .. } => None,
        }
    }

    /// The status that fails a whole call because of the event at `index`.
    pub fn to_status(&self, index: usize) -> tonic::Status {
        tonic::Status::new(self.code(), format!("events[{index}]: {self}"))
    }
}

impl pb::EventResult {
    /// The result of a published event.
    pub fn published(index: u32, event_id: Uuid) -> Self {
        Self { index, event_id: event_id.to_string(), code: tonic::Code::Ok as i32, ..Default::default() }
    }

    /// The result of an event rejected for `error`; `event_id` as the caller sent it.
    pub fn rejected(index: u32, event_id: &str, error: &IngestError) -> Self {
        let (field, message) = match error {
            IngestError::InvalidArgument { field, reason } => (field.clone(), reason.clone()),
            IngestError::NodeNotServed { .. } => ("node".to_owned(), error.to_string()),
        };
        Self { index, event_id: event_id.to_owned(), code: error.code() as i32, field, message }
    }
}

/// Validates an ingest event and turns it into the raw event the collector publishes: node
/// stamped from `context`, source `ingest`, published now, event id generated when absent.
///
/// # Errors
/// [`IngestError::NodeNotServed`] when the event names another node (checked first, so it wins
/// over any other fault), [`IngestError::InvalidArgument`] naming the first malformed field.
pub fn to_health_event(event: pb::IngestEvent, context: &IngestContext<'_>) -> Result<HealthEvent, IngestError> {
    if !event.node.is_empty() && event.node != context.node {
        return Err(IngestError::NodeNotServed { claimed: event.node, serving: context.node.to_owned() });
    }
    let event_id = event_id(&event.event_id, context.now)?;
    let observed_at = observed_at(event.observed_at_micros, context.now)?;
    let component = component(event.component)?;
    let entity = entity(event.entity.unwrap_or_default())?;
    let kind = kind(event.kind)?;
    let detail = detail(event.detail.ok_or_else(|| invalid("detail", "required: set the field for the kind"))?)?;
    if kind != detail.kind() {
        return Err(invalid("kind", format!("is {kind:?}, but the detail set is for {:?}", detail.kind())));
    }
    let raw = optional_text("raw", event.raw, MAX_TEXT_BYTES)?;
    let client_version = text("client_version", event.client_version, MAX_NAME_BYTES, false)?;
    Ok(HealthEvent {
        event_id,
        observed_at,
        published_at: context.now,
        node: context.node.to_owned(),
        source: h::Source::Ingest,
        component,
        entity,
        kind: detail.kind(),
        detail,
        healthy: event.healthy,
        synthetic: event.synthetic,
        raw,
        collector_version: if client_version.is_empty() {
            context.collector_version.to_owned()
        } else {
            client_version
        },
        // The ingest API carries no boot id and the context has none to stamp; null is what the
        // schema documents for writers that do not know it.
        boot_id: None,
        // The collector attaches the GPU's pods when the event is handed to its publisher.
        workloads: None,
    })
}

fn invalid(field: impl Into<String>, reason: impl Into<String>) -> IngestError {
    IngestError::InvalidArgument { field: field.into(), reason: reason.into() }
}

fn event_id(raw: &str, now: DateTime<Utc>) -> Result<Uuid, IngestError> {
    if raw.is_empty() {
        let seconds = u64::try_from(now.timestamp()).unwrap_or(0);
        return Ok(Uuid::new_v7(uuid::Timestamp::from_unix(uuid::NoContext, seconds, now.timestamp_subsec_nanos())));
    }
    match Uuid::parse_str(raw) {
        Ok(id) if id.is_nil() => Err(invalid("event_id", "the nil UUID is not an id")),
        Ok(id) => Ok(id),
        Err(e) => Err(invalid("event_id", format!("not a UUID: {e}"))),
    }
}

fn micros(field: &str, value: i64) -> Result<DateTime<Utc>, IngestError> {
    if value < 0 {
        return Err(invalid(field, format!("{value} is before 1970")));
    }
    DateTime::from_timestamp_micros(value).ok_or_else(|| invalid(field, format!("{value} is out of range")))
}

fn observed_at(value: i64, now: DateTime<Utc>) -> Result<DateTime<Utc>, IngestError> {
    if value == 0 {
        return Ok(now);
    }
    let at = micros("observed_at_micros", value)?;
    if at > now + MAX_FUTURE_SKEW {
        return Err(invalid(
            "observed_at_micros",
            format!("{at} is more than {} minutes ahead of the collector's clock", MAX_FUTURE_SKEW.num_minutes()),
        ));
    }
    Ok(at)
}

/// A proto enum field: a known value, or INVALID_ARGUMENT (a value from a newer client).
fn enum_value<E: TryFrom<i32>>(field: &str, value: i32) -> Result<E, IngestError> {
    E::try_from(value).map_err(|_| invalid(field, format!("unknown value {value}")))
}

fn required<T>(field: &str, value: Option<T>) -> Result<T, IngestError> {
    value.ok_or_else(|| invalid(field, "required"))
}

fn text(field: &str, value: String, max: usize, required: bool) -> Result<String, IngestError> {
    if required && value.is_empty() {
        return Err(invalid(field, "required"));
    }
    if value.len() > max {
        return Err(invalid(field, format!("{} bytes, at most {max}", value.len())));
    }
    Ok(value)
}

fn name(field: &str, value: String) -> Result<String, IngestError> {
    text(field, value, MAX_NAME_BYTES, true)
}

/// An optional string that is set must not be empty: omit it instead (an empty id would look like
/// a value to every consumer).
fn optional_text(field: &str, value: Option<String>, max: usize) -> Result<Option<String>, IngestError> {
    value.map(|value| text(field, value, max, true)).transpose()
}

fn optional_name(field: &str, value: Option<String>) -> Result<Option<String>, IngestError> {
    optional_text(field, value, MAX_NAME_BYTES)
}

fn count<T: Default + PartialOrd + std::fmt::Display>(field: &str, value: T) -> Result<T, IngestError> {
    if value < T::default() {
        return Err(invalid(field, format!("{value} is negative")));
    }
    Ok(value)
}

fn optional_count<T: Default + PartialOrd + std::fmt::Display>(
    field: &str,
    value: Option<T>,
) -> Result<Option<T>, IngestError> {
    value.map(|value| count(field, value)).transpose()
}

fn component(value: i32) -> Result<h::Component, IngestError> {
    use pb::Component as P;
    Ok(match enum_value::<P>("component", value)? {
        P::Unspecified => return Err(invalid("component", "required")),
        P::Gpu => h::Component::Gpu,
        P::Nvswitch => h::Component::Nvswitch,
        P::Nvlink => h::Component::Nvlink,
        P::Pcie => h::Component::Pcie,
        P::Memory => h::Component::Memory,
        P::Cpu => h::Component::Cpu,
        P::Node => h::Component::Node,
    })
}

fn kind(value: i32) -> Result<h::Kind, IngestError> {
    use pb::Kind as P;
    Ok(match enum_value::<P>("kind", value)? {
        P::Unspecified => return Err(invalid("kind", "required")),
        P::Xid => h::Kind::Xid,
        P::Sxid => h::Kind::Sxid,
        P::GpuLost => h::Kind::GpuLost,
        P::Ecc => h::Kind::Ecc,
        P::RetiredPages => h::Kind::RetiredPages,
        P::RowRemap => h::Kind::RowRemap,
        P::Temperature => h::Kind::Temperature,
        P::Power => h::Kind::Power,
        P::Throttle => h::Kind::Throttle,
        P::Nvlink => h::Kind::Nvlink,
        P::PcieReplay => h::Kind::PcieReplay,
        P::Mce => h::Kind::Mce,
        P::PcieAer => h::Kind::PcieAer,
        P::Dcgm => h::Kind::Dcgm,
        P::CloudMaintenance => h::Kind::CloudMaintenance,
        P::MonitorHealth => h::Kind::MonitorHealth,
        P::Custom => h::Kind::Custom,
    })
}

fn entity(entity: pb::Entity) -> Result<h::Entity, IngestError> {
    Ok(h::Entity {
        gpu_uuid: optional_name("entity.gpu_uuid", entity.gpu_uuid)?,
        pci_bus_id: optional_name("entity.pci_bus_id", entity.pci_bus_id)?,
        gpu_index: optional_count("entity.gpu_index", entity.gpu_index)?,
        nvlink_link: optional_count("entity.nvlink_link", entity.nvlink_link)?,
        nvswitch_id: optional_name("entity.nvswitch_id", entity.nvswitch_id)?,
        mig_instance: optional_name("entity.mig_instance", entity.mig_instance)?,
    })
}

fn detail(detail: PbDetail) -> Result<h::Detail, IngestError> {
    Ok(match detail {
        PbDetail::Xid(d) => h::Detail::Xid(h::XidDetail {
            code: count("detail.xid.code", d.code)?,
            text: text("detail.xid.text", d.text, MAX_TEXT_BYTES, false)?,
            pid: optional_count("detail.xid.pid", d.pid)?,
            process: optional_name("detail.xid.process", d.process)?,
            nvlink5: d.nvlink5.map(nvlink5).transpose()?,
            recovery_action: recovery_action(d.recovery_action)?,
        }),
        PbDetail::Sxid(d) => h::Detail::Sxid(h::SxidDetail {
            code: count("detail.sxid.code", d.code)?,
            text: text("detail.sxid.text", d.text, MAX_TEXT_BYTES, false)?,
            fatal: d.fatal,
            link: optional_count("detail.sxid.link", d.link)?,
        }),
        PbDetail::GpuLost(d) => h::Detail::GpuLost(h::GpuLostDetail {
            reason: text("detail.gpu_lost.reason", d.reason, MAX_TEXT_BYTES, true)?,
        }),
        PbDetail::Ecc(d) => h::Detail::Ecc(h::EccDetail {
            single_bit_volatile: optional_count("detail.ecc.single_bit_volatile", d.single_bit_volatile)?,
            double_bit_volatile: optional_count("detail.ecc.double_bit_volatile", d.double_bit_volatile)?,
            single_bit_aggregate: optional_count("detail.ecc.single_bit_aggregate", d.single_bit_aggregate)?,
            double_bit_aggregate: optional_count("detail.ecc.double_bit_aggregate", d.double_bit_aggregate)?,
            location: optional_name("detail.ecc.location", d.location)?,
        }),
        PbDetail::RetiredPages(d) => h::Detail::RetiredPages(h::RetiredPagesDetail {
            single_bit: count("detail.retired_pages.single_bit", d.single_bit)?,
            double_bit: count("detail.retired_pages.double_bit", d.double_bit)?,
            pending: d.pending,
        }),
        PbDetail::RowRemap(d) => h::Detail::RowRemap(h::RowRemapDetail {
            correctable: count("detail.row_remap.correctable", d.correctable)?,
            uncorrectable: count("detail.row_remap.uncorrectable", d.uncorrectable)?,
            pending: d.pending,
            failure: d.failure,
        }),
        PbDetail::Temperature(d) => h::Detail::Temperature(h::TemperatureDetail {
            celsius: d.celsius,
            slowdown_celsius: d.slowdown_celsius,
            shutdown_celsius: d.shutdown_celsius,
        }),
        PbDetail::Power(d) => h::Detail::Power(h::PowerDetail {
            watts: watts("detail.power.watts", d.watts)?,
            limit_watts: d.limit_watts.map(|w| watts("detail.power.limit_watts", w)).transpose()?,
        }),
        PbDetail::Throttle(d) => {
            if d.reasons.len() > MAX_ENTRIES {
                return Err(invalid(
                    "detail.throttle.reasons",
                    format!("{} reasons, at most {MAX_ENTRIES}", d.reasons.len()),
                ));
            }
            let reasons = d
                .reasons
                .into_iter()
                .enumerate()
                .map(|(i, reason)| name(&format!("detail.throttle.reasons[{i}]"), reason))
                .collect::<Result<_, _>>()?;
            h::Detail::Throttle(h::ThrottleDetail { reasons, mask: d.mask })
        }
        PbDetail::Nvlink(d) => h::Detail::Nvlink(h::NvlinkDetail {
            link: count("detail.nvlink.link", d.link)?,
            active: d.active,
            crc_flit_errors: optional_count("detail.nvlink.crc_flit_errors", d.crc_flit_errors)?,
            crc_data_errors: optional_count("detail.nvlink.crc_data_errors", d.crc_data_errors)?,
            replay_errors: optional_count("detail.nvlink.replay_errors", d.replay_errors)?,
            recovery_errors: optional_count("detail.nvlink.recovery_errors", d.recovery_errors)?,
        }),
        PbDetail::PcieReplay(d) => h::Detail::PcieReplay(h::PcieReplayDetail {
            count: count("detail.pcie_replay.count", d.count)?,
            // A counter reset makes the increase negative; that is information, not an error.
            delta: d.delta,
        }),
        PbDetail::Mce(d) => h::Detail::Mce(h::MceDetail {
            text: text("detail.mce.text", d.text, MAX_TEXT_BYTES, false)?,
            cpu: optional_count("detail.mce.cpu", d.cpu)?,
            bank: optional_count("detail.mce.bank", d.bank)?,
            status: optional_name("detail.mce.status", d.status)?,
            corrected: d.corrected,
        }),
        PbDetail::PcieAer(d) => h::Detail::PcieAer(h::PcieAerDetail {
            severity: aer_severity(d.severity)?,
            device: name("detail.pcie_aer.device", d.device)?,
            error_type: optional_name("detail.pcie_aer.error_type", d.error_type)?,
            text: text("detail.pcie_aer.text", d.text, MAX_TEXT_BYTES, false)?,
        }),
        PbDetail::Dcgm(d) => h::Detail::Dcgm(h::DcgmDetail {
            check: name("detail.dcgm.check", d.check)?,
            result: dcgm_result(d.result)?,
            error_code: d.error_code,
            message: optional_text("detail.dcgm.message", d.message, MAX_TEXT_BYTES)?,
        }),
        PbDetail::CloudMaintenance(d) => {
            let window_start = d.window_start_micros.map(|m| micros("detail.cloud_maintenance.window_start_micros", m));
            let window_start = window_start.transpose()?;
            let window_end = d.window_end_micros.map(|m| micros("detail.cloud_maintenance.window_end_micros", m));
            let window_end = window_end.transpose()?;
            if let (Some(start), Some(end)) = (window_start, window_end)
                && end < start
            {
                return Err(invalid("detail.cloud_maintenance.window_end_micros", "before the window's start"));
            }
            h::Detail::CloudMaintenance(h::CloudMaintenanceDetail {
                provider: cloud_provider(d.provider)?,
                event_type: name("detail.cloud_maintenance.event_type", d.event_type)?,
                provider_event_id: optional_name("detail.cloud_maintenance.provider_event_id", d.provider_event_id)?,
                window_start,
                window_end,
                description: optional_text("detail.cloud_maintenance.description", d.description, MAX_TEXT_BYTES)?,
            })
        }
        PbDetail::MonitorHealth(d) => h::Detail::MonitorHealth(h::MonitorHealthDetail {
            monitor: name("detail.monitor_health.monitor", d.monitor)?,
            state: monitor_state(d.state)?,
            message: optional_text("detail.monitor_health.message", d.message, MAX_TEXT_BYTES)?,
        }),
        PbDetail::Custom(d) => h::Detail::Custom(custom(d)?),
    })
}

fn nvlink5(fields: pb::Nvlink5XidFields) -> Result<h::Nvlink5XidFields, IngestError> {
    Ok(h::Nvlink5XidFields {
        unit: name("detail.xid.nvlink5.unit", fields.unit)?,
        severity: text("detail.xid.nvlink5.severity", fields.severity, MAX_NAME_BYTES, false)?,
        link: optional_count("detail.xid.nvlink5.link", fields.link)?,
        intr_info: optional_name("detail.xid.nvlink5.intr_info", fields.intr_info)?,
        error_status: fields.error_status,
    })
}

fn watts(field: &str, value: f64) -> Result<f64, IngestError> {
    if !value.is_finite() || value < 0.0 {
        return Err(invalid(field, format!("{value} is not a finite, non-negative number of watts")));
    }
    Ok(value)
}

fn custom(detail: pb::CustomDetail) -> Result<h::CustomDetail, IngestError> {
    if detail.values.len() > MAX_ENTRIES {
        return Err(invalid("detail.custom.values", format!("{} entries, at most {MAX_ENTRIES}", detail.values.len())));
    }
    let mut values = BTreeMap::new();
    for (key, value) in detail.values {
        let key = name("detail.custom.values", key).map_err(|e| match e {
            IngestError::InvalidArgument { field, reason } => invalid(field, format!("a key: {reason}")),
            other => other,
        })?;
        let value = text(&format!("detail.custom.values[{key:?}]"), value, MAX_TEXT_BYTES, false)?;
        values.insert(key, value);
    }
    Ok(h::CustomDetail { monitor: name("detail.custom.monitor", detail.monitor)?, values })
}

fn recovery_action(value: i32) -> Result<Option<h::XidRecoveryAction>, IngestError> {
    use pb::XidRecoveryAction as P;
    Ok(Some(match enum_value::<P>("detail.xid.recovery_action", value)? {
        P::Unspecified => return Ok(None),
        P::None => h::XidRecoveryAction::None,
        P::GpuReset => h::XidRecoveryAction::GpuReset,
        P::NodeReboot => h::XidRecoveryAction::NodeReboot,
        P::DrainP2p => h::XidRecoveryAction::DrainP2p,
        P::DrainAndReset => h::XidRecoveryAction::DrainAndReset,
    }))
}

fn aer_severity(value: i32) -> Result<h::AerSeverity, IngestError> {
    use pb::AerSeverity as P;
    let field = "detail.pcie_aer.severity";
    required(
        field,
        match enum_value::<P>(field, value)? {
            P::Unspecified => None,
            P::Corrected => Some(h::AerSeverity::Corrected),
            P::NonFatal => Some(h::AerSeverity::NonFatal),
            P::Fatal => Some(h::AerSeverity::Fatal),
        },
    )
}

fn dcgm_result(value: i32) -> Result<h::DcgmResult, IngestError> {
    use pb::DcgmResult as P;
    let field = "detail.dcgm.result";
    required(
        field,
        match enum_value::<P>(field, value)? {
            P::Unspecified => None,
            P::Pass => Some(h::DcgmResult::Pass),
            P::Warn => Some(h::DcgmResult::Warn),
            P::Fail => Some(h::DcgmResult::Fail),
            P::Skip => Some(h::DcgmResult::Skip),
        },
    )
}

fn cloud_provider(value: i32) -> Result<h::CloudProvider, IngestError> {
    use pb::CloudProvider as P;
    let field = "detail.cloud_maintenance.provider";
    required(
        field,
        match enum_value::<P>(field, value)? {
            P::Unspecified => None,
            P::Aws => Some(h::CloudProvider::Aws),
            P::Gcp => Some(h::CloudProvider::Gcp),
            P::Azure => Some(h::CloudProvider::Azure),
            P::Other => Some(h::CloudProvider::Other),
        },
    )
}

fn monitor_state(value: i32) -> Result<h::MonitorState, IngestError> {
    use pb::MonitorState as P;
    let field = "detail.monitor_health.state";
    required(
        field,
        match enum_value::<P>(field, value)? {
            P::Unspecified => None,
            P::Ok => Some(h::MonitorState::Ok),
            P::Hung => Some(h::MonitorState::Hung),
            P::Unavailable => Some(h::MonitorState::Unavailable),
            P::Error => Some(h::MonitorState::Error),
        },
    )
}

#[cfg(test)]
mod tests;
