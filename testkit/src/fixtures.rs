//! Builders for the records tests publish and read: a health event, an enriched event and a
//! verdict, each with the plain values most tests want and a method per thing a test varies.
//!
//! ```
//! use gpumedic_schemas::RecommendedAction;
//! use gpumedic_testkit::{event, verdict};
//!
//! let fault = event("node-1").xid(79).gpu("GPU-aaa").boot("boot-1").build();
//! let bytes = gpumedic_testkit::enriched(fault).encode();
//! let drain = verdict("node-1").action(RecommendedAction::Drain).build();
//! # let _ = (bytes, drain);
//! ```

use chrono::{DateTime, Utc};
use gpumedic_schemas::enriched::NodeContext;
use gpumedic_schemas::health::{Component, Entity, GpuIdentity, MonitorHealthDetail, MonitorState, Source, XidDetail};
use gpumedic_schemas::{Detail, EnrichedHealthEvent, HealthEvent, RecommendedAction, Severity, Verdict};
use uuid::Uuid;

/// A health event about `node`: NVML's healthy evidence for the node until a method says
/// otherwise ([`EventBuilder::xid`], [`EventBuilder::detail`]).
pub fn event(node: impl Into<String>) -> EventBuilder {
    EventBuilder {
        node: node.into(),
        source: Source::Nvml,
        component: Component::Gpu,
        entity: Entity::default(),
        detail: healthy_detail(),
        healthy: true,
        boot_id: None,
        observed_at: None,
    }
}

/// A [`HealthEvent`] under construction; [`EventBuilder::build`] gives it a fresh id and the
/// current time, as a collector would.
#[derive(Debug, Clone)]
#[must_use]
pub struct EventBuilder {
    node: String,
    source: Source,
    component: Component,
    entity: Entity,
    detail: Detail,
    healthy: bool,
    boot_id: Option<String>,
    observed_at: Option<DateTime<Utc>>,
}

impl EventBuilder {
    /// An Xid `code` from the kernel log (a fault), with the text `Xid <code>` until
    /// [`EventBuilder::text`] sets another.
    pub fn xid(mut self, code: i32) -> Self {
        self.source = Source::KernelLog;
        self.detail = Detail::Xid(XidDetail {
            code,
            text: format!("Xid {code}"),
            pid: None,
            process: None,
            nvlink5: None,
            recovery_action: None,
        });
        self.healthy = false;
        self
    }

    /// The Xid's message text. Panics unless the event is an Xid.
    pub fn text(mut self, text: impl Into<String>) -> Self {
        self.xid_detail().text = text.into();
        self
    }

    /// The process id the Xid names. Panics unless the event is an Xid.
    pub fn pid(mut self, pid: i32) -> Self {
        self.xid_detail().pid = Some(pid);
        self
    }

    /// NVML's healthy evidence (monitor `nvml`, state ok): the default.
    pub fn healthy(mut self) -> Self {
        self.source = Source::Nvml;
        self.detail = healthy_detail();
        self.healthy = true;
        self
    }

    /// Any other observation: `detail` from `source`, a fault unless [`EventBuilder::healthy_flag`]
    /// says otherwise.
    pub fn detail(mut self, source: Source, detail: Detail) -> Self {
        self.source = source;
        self.detail = detail;
        self.healthy = false;
        self
    }

    /// Sets the event's `healthy` flag as given (after [`EventBuilder::detail`]).
    pub fn healthy_flag(mut self, healthy: bool) -> Self {
        self.healthy = healthy;
        self
    }

    /// The hardware part the event is about (GPU by default).
    pub fn component(mut self, component: Component) -> Self {
        self.component = component;
        self
    }

    /// The GPU the event names, by UUID.
    pub fn gpu(mut self, uuid: impl Into<String>) -> Self {
        self.entity.gpu_uuid = Some(uuid.into());
        self
    }

    /// The GPU's index on the node.
    pub fn gpu_index(mut self, index: i32) -> Self {
        self.entity.gpu_index = Some(index);
        self
    }

    /// The whole affected part, replacing what [`EventBuilder::gpu`] set.
    pub fn entity(mut self, entity: Entity) -> Self {
        self.entity = entity;
        self
    }

    /// The node's boot id when the event was observed (none by default).
    pub fn boot(mut self, boot_id: impl Into<String>) -> Self {
        self.boot_id = Some(boot_id.into());
        self
    }

    /// When the source observed the condition (now by default).
    pub fn at(mut self, observed_at: DateTime<Utc>) -> Self {
        self.observed_at = Some(observed_at);
        self
    }

    /// The event, with a fresh UUIDv7 and published now.
    pub fn build(self) -> HealthEvent {
        let mut e = HealthEvent::new(self.node, self.source, self.component, self.entity, self.detail);
        e.healthy = self.healthy;
        e.boot_id = self.boot_id;
        if let Some(at) = self.observed_at {
            e.observed_at = at;
        }
        e
    }

    /// The event as the enricher would pass it on, knowing nothing of the node.
    pub fn enriched(self) -> EnrichedBuilder {
        enriched(self.build())
    }

    fn xid_detail(&mut self) -> &mut XidDetail {
        match &mut self.detail {
            Detail::Xid(x) => x,
            other => panic!("the event is not an Xid: {other:?}"),
        }
    }
}

fn healthy_detail() -> Detail {
    Detail::MonitorHealth(MonitorHealthDetail { monitor: "nvml".into(), state: MonitorState::Ok, message: None })
}

/// `event` as the enricher would publish it: no node context, no workloads, no catalog entry, no
/// GPU identity, until a method adds one.
pub fn enriched(event: HealthEvent) -> EnrichedBuilder {
    EnrichedBuilder(EnrichedHealthEvent {
        event,
        node_context: NodeContext::default(),
        node_unknown: false,
        xid_catalog: None,
        workloads: vec![],
        enriched_at: Utc::now(),
        gpu: None,
        gpu_unresolved: false,
    })
}

/// An [`EnrichedHealthEvent`] under construction.
#[derive(Debug, Clone)]
#[must_use]
pub struct EnrichedBuilder(EnrichedHealthEvent);

impl EnrichedBuilder {
    /// The canonical identity of the GPU the event names.
    pub fn gpu(mut self, identity: GpuIdentity) -> Self {
        self.0.gpu = Some(identity);
        self
    }

    /// What the cluster knows about the node.
    pub fn context(mut self, context: NodeContext) -> Self {
        self.0.node_context = context;
        self
    }

    /// When the enricher published it (now by default).
    pub fn enriched_at(mut self, at: DateTime<Utc>) -> Self {
        self.0.enriched_at = at;
        self
    }

    /// The enriched event.
    pub fn build(self) -> EnrichedHealthEvent {
        self.0
    }

    /// The enriched event in its wire format, as the classifier reads it.
    pub fn encode(self) -> Vec<u8> {
        gpumedic_schemas::encode(&self.0).expect("an enriched event encodes")
    }
}

/// A verdict about `node`: a new incident's critical Xid 79 verdict (rule
/// `xid-79-fallen-off-the-bus`, version 1) recommending no action, issued now, until methods say
/// otherwise.
pub fn verdict(node: impl Into<String>) -> VerdictBuilder {
    VerdictBuilder(Verdict {
        verdict_id: Uuid::new_v4(),
        incident_id: Uuid::new_v4(),
        node: node.into(),
        entity: Entity::default(),
        severity: Severity::Critical,
        rule_id: "xid-79-fallen-off-the-bus".into(),
        rule_version: 1,
        action: RecommendedAction::None,
        custom_action: None,
        reason: "GPU has fallen off the bus".into(),
        evidence: vec![],
        issued_at: Utc::now(),
        recovery: false,
        not_before: None,
        deferrable: false,
        workload: None,
    })
}

/// A [`Verdict`] under construction.
#[derive(Debug, Clone)]
#[must_use]
pub struct VerdictBuilder(Verdict);

impl VerdictBuilder {
    /// The recommended action.
    pub fn action(mut self, action: RecommendedAction) -> Self {
        self.0.action = action;
        self
    }

    /// A site-specific action named `name` ([`RecommendedAction::Custom`]).
    pub fn custom(mut self, name: impl Into<String>) -> Self {
        self.0.action = RecommendedAction::Custom;
        self.0.custom_action = Some(name.into());
        self
    }

    /// The incident the verdict belongs to (a new one by default).
    pub fn incident(mut self, incident_id: Uuid) -> Self {
        self.0.incident_id = incident_id;
        self
    }

    /// How bad it is (critical by default).
    pub fn severity(mut self, severity: Severity) -> Self {
        self.0.severity = severity;
        self
    }

    /// Whether the verdict declares the incident recovered (not by default).
    pub fn recovery(mut self, recovery: bool) -> Self {
        self.0.recovery = recovery;
        self
    }

    /// The rule that fired and its version.
    pub fn rule(mut self, rule_id: impl Into<String>, version: i32) -> Self {
        self.0.rule_id = rule_id.into();
        self.0.rule_version = version;
        self
    }

    /// Why, for humans.
    pub fn reason(mut self, reason: impl Into<String>) -> Self {
        self.0.reason = reason.into();
        self
    }

    /// The affected part (node-wide by default).
    pub fn entity(mut self, entity: Entity) -> Self {
        self.0.entity = entity;
        self
    }

    /// The action may wait until the GPU is free or a maintenance window opens.
    pub fn deferrable(mut self, deferrable: bool) -> Self {
        self.0.deferrable = deferrable;
        self
    }

    /// The action must not be taken before `at`.
    pub fn not_before(mut self, at: DateTime<Utc>) -> Self {
        self.0.not_before = Some(at);
        self
    }

    /// The verdict.
    pub fn build(self) -> Verdict {
        self.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_xid_event_is_a_kernel_log_fault_on_its_gpu() {
        let e = event("n").xid(79).text("GPU has fallen off the bus.").pid(7).gpu("GPU-a").boot("b1").build();
        assert_eq!((e.node.as_str(), e.source, e.healthy), ("n", Source::KernelLog, false));
        assert_eq!(e.entity.gpu_uuid.as_deref(), Some("GPU-a"));
        assert_eq!(e.boot_id.as_deref(), Some("b1"));
        let Detail::Xid(x) = &e.detail else { panic!("{:?}", e.detail) };
        assert_eq!((x.code, x.text.as_str(), x.pid), (79, "GPU has fallen off the bus.", Some(7)));
    }

    #[test]
    fn the_default_event_is_nvml_healthy_evidence() {
        let e = event("n").xid(48).healthy().build();
        assert_eq!((e.source, e.healthy), (Source::Nvml, true));
        assert!(matches!(e.detail, Detail::MonitorHealth(MonitorHealthDetail { state: MonitorState::Ok, .. })));
    }

    #[test]
    fn an_enriched_event_round_trips() {
        let e = event("n").xid(79).enriched().gpu(GpuIdentity { index: Some(2), ..Default::default() }).build();
        let back: EnrichedHealthEvent =
            gpumedic_schemas::decode(&enriched(e.event.clone()).gpu(e.gpu.clone().unwrap()).encode()).unwrap();
        assert_eq!(back.event, e.event);
        assert_eq!(back.gpu.and_then(|g| g.index), Some(2));
    }

    #[test]
    fn verdicts_differ_in_ids_and_take_what_is_set() {
        let (a, b) = (verdict("n").build(), verdict("n").build());
        assert_ne!((a.verdict_id, a.incident_id), (b.verdict_id, b.incident_id));
        let v = verdict("n").action(RecommendedAction::Drain).severity(Severity::Warning).recovery(true).build();
        assert_eq!((v.action, v.severity, v.recovery), (RecommendedAction::Drain, Severity::Warning, true));
        assert_eq!(verdict("n").custom("reimage").build().custom_action.as_deref(), Some("reimage"));
    }
}
