//! From GPU samples to health events: report changes and threshold crossings, plus a periodic
//! heartbeat per GPU (the healthy evidence incidents recover on), never every sample.

use std::collections::HashMap;
use std::time::Duration;

use chrono::{DateTime, Utc};
use gpumedic_schemas::HealthEvent;
use gpumedic_schemas::health::{
    Component, Detail, EccDetail, Entity, GpuLostDetail, MonitorHealthDetail, MonitorState, PcieReplayDetail, Source,
    TemperatureDetail,
};

use crate::gpu::GpuSample;

/// Where a temperature sits against the GPU's own thresholds.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Band {
    Normal,
    Slowdown,
    Shutdown,
}

fn band(s: &GpuSample) -> Option<Band> {
    let t = s.temperature_c?;
    Some(match (s.slowdown_c, s.shutdown_c) {
        (_, Some(shut)) if t >= shut => Band::Shutdown,
        (Some(slow), _) if t >= slow => Band::Slowdown,
        _ => Band::Normal,
    })
}

/// Remembers the last sample and heartbeat of each GPU (by index) and turns new samples into events.
#[derive(Debug)]
pub struct Sampler {
    node: String,
    source: Source,
    heartbeat: Duration,
    last: HashMap<u32, (GpuSample, DateTime<Utc>)>,
}

impl Sampler {
    /// A sampler for `node` whose events come from `source`, with a heartbeat every `heartbeat`.
    pub fn new(node: impl Into<String>, source: Source, heartbeat: Duration) -> Self {
        Self { node: node.into(), source, heartbeat, last: HashMap::new() }
    }

    /// The events that `samples`, taken at `now`, call for.
    pub fn observe(&mut self, samples: &[GpuSample], now: DateTime<Utc>) -> Vec<HealthEvent> {
        let mut out = Vec::new();
        for s in samples {
            let entity = Entity {
                gpu_uuid: (!s.uuid.is_empty()).then(|| s.uuid.clone()),
                pci_bus_id: (!s.pci_bus_id.is_empty()).then(|| s.pci_bus_id.clone()),
                gpu_index: i32::try_from(s.index).ok(),
                ..Default::default()
            };
            let prev = self.last.get(&s.index).map(|(p, _)| p);
            // A lost GPU keeps its identity from before it was lost.
            let entity = match (s.lost, prev) {
                (true, Some(p)) => Entity {
                    gpu_uuid: (!p.uuid.is_empty()).then(|| p.uuid.clone()),
                    pci_bus_id: (!p.pci_bus_id.is_empty()).then(|| p.pci_bus_id.clone()),
                    ..entity
                },
                _ => entity,
            };
            let mut emit = |detail: Detail, healthy: bool| {
                let mut e = HealthEvent::new(&self.node, self.source, Component::Gpu, entity.clone(), detail);
                e.observed_at = now;
                e.healthy = healthy;
                out.push(e);
            };
            if s.lost {
                if !prev.is_some_and(|p| p.lost) {
                    emit(
                        Detail::GpuLost(GpuLostDetail { reason: "NVML reports the GPU is lost (GPU_IS_LOST)".into() }),
                        false,
                    );
                }
                let keep = self.last.get(&s.index).map(|(p, hb)| (GpuSample { lost: true, ..p.clone() }, *hb));
                self.last.insert(s.index, keep.unwrap_or((s.clone(), now)));
                continue;
            }
            if let Some(b) = band(s)
                && prev.and_then(band).is_none_or(|pb| pb != b)
                && (b != Band::Normal || prev.is_some())
            {
                emit(
                    Detail::Temperature(TemperatureDetail {
                        celsius: s.temperature_c.unwrap_or_default(),
                        slowdown_celsius: s.slowdown_c,
                        shutdown_celsius: s.shutdown_c,
                    }),
                    b == Band::Normal,
                );
            }
            let ecc_grew = prev.is_some_and(|p| {
                grew(p.ecc_sbe_volatile, s.ecc_sbe_volatile)
                    || grew(p.ecc_dbe_volatile, s.ecc_dbe_volatile)
                    || grew(p.ecc_dbe_aggregate, s.ecc_dbe_aggregate)
            });
            if ecc_grew {
                emit(
                    Detail::Ecc(EccDetail {
                        single_bit_volatile: s.ecc_sbe_volatile,
                        double_bit_volatile: s.ecc_dbe_volatile,
                        single_bit_aggregate: s.ecc_sbe_aggregate,
                        double_bit_aggregate: s.ecc_dbe_aggregate,
                        location: None,
                    }),
                    false,
                );
            }
            if let (Some(p), Some(count)) = (prev.and_then(|p| p.pcie_replay), s.pcie_replay)
                && count > p
            {
                emit(Detail::PcieReplay(PcieReplayDetail { count, delta: Some(count - p) }), false);
            }
            let last_beat = self.last.get(&s.index).map(|(_, hb)| *hb);
            let recovered = prev.is_some_and(|p| p.lost);
            let beat_due =
                last_beat.is_none_or(|hb| now - hb >= chrono::Duration::from_std(self.heartbeat).unwrap_or_default());
            let beat = if recovered || beat_due {
                emit(
                    Detail::MonitorHealth(MonitorHealthDetail {
                        monitor: self.source_name().into(),
                        state: MonitorState::Ok,
                        message: recovered.then(|| "the GPU answers again".to_owned()),
                    }),
                    true,
                );
                now
            } else {
                last_beat.unwrap_or(now)
            };
            self.last.insert(s.index, (s.clone(), beat));
        }
        out
    }

    fn source_name(&self) -> &'static str {
        match self.source {
            Source::Synthetic => "simulated",
            _ => "nvml",
        }
    }
}

fn grew(before: Option<i64>, after: Option<i64>) -> bool {
    matches!((before, after), (Some(b), Some(a)) if a > b)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gpu::{GpuBackend as _, Simulated};
    use gpumedic_schemas::Kind;

    fn at(s: i64) -> DateTime<Utc> {
        DateTime::from_timestamp(1_800_000_000 + s, 0).unwrap()
    }

    #[test]
    fn heartbeat_first_then_only_on_schedule() {
        let (mut sim, _) = Simulated::new("n", 2);
        let mut s = Sampler::new("n", Source::Nvml, Duration::from_secs(60));
        let first = s.observe(&sim.sample().unwrap(), at(0));
        assert_eq!(first.len(), 2, "one heartbeat per GPU at start");
        assert!(first.iter().all(|e| e.healthy && e.kind == Kind::MonitorHealth));
        assert!(s.observe(&sim.sample().unwrap(), at(10)).is_empty(), "no change, no heartbeat due");
        assert_eq!(s.observe(&sim.sample().unwrap(), at(60)).len(), 2);
    }

    #[test]
    fn faults_are_reported_once_and_recovery_beats_at_once() {
        let (mut sim, control) = Simulated::new("n", 2);
        let mut s = Sampler::new("n", Source::Nvml, Duration::from_secs(60));
        s.observe(&sim.sample().unwrap(), at(0));
        control.update(1, |g| g.lost = true);
        let lost = s.observe(&sim.sample().unwrap(), at(10));
        assert_eq!(lost.len(), 1);
        assert_eq!(lost[0].kind, Kind::GpuLost);
        assert_eq!(lost[0].entity.gpu_uuid.as_deref(), Some(crate::gpu::simulated_uuid("n", 1).as_str()));
        assert!(s.observe(&sim.sample().unwrap(), at(20)).is_empty(), "still lost: not reported again");
        control.update(1, |g| g.lost = false);
        let back = s.observe(&sim.sample().unwrap(), at(30));
        assert_eq!(back.len(), 1);
        assert!(back[0].healthy, "the GPU answering again is healthy evidence at once");
    }

    #[test]
    fn thresholds_and_counters() {
        let (mut sim, control) = Simulated::new("n", 1);
        let mut s = Sampler::new("n", Source::Nvml, Duration::from_secs(3600));
        s.observe(&sim.sample().unwrap(), at(0));
        control.update(0, |g| g.temperature_c = Some(88));
        let hot = s.observe(&sim.sample().unwrap(), at(1));
        assert_eq!(hot.len(), 1);
        assert!(
            matches!(hot[0].detail, Detail::Temperature(ref t) if t.celsius == 88 && t.slowdown_celsius == Some(87))
        );
        control.update(0, |g| g.temperature_c = Some(89));
        assert!(s.observe(&sim.sample().unwrap(), at(2)).is_empty(), "same band");
        control.update(0, |g| g.temperature_c = Some(50));
        let cool = s.observe(&sim.sample().unwrap(), at(3));
        assert!(cool[0].healthy, "back below slowdown");
        control.update(0, |g| {
            g.ecc_dbe_volatile = Some(1);
            g.pcie_replay = Some(5);
        });
        let kinds: Vec<Kind> = s.observe(&sim.sample().unwrap(), at(4)).iter().map(|e| e.kind).collect();
        assert_eq!(kinds, [Kind::Ecc, Kind::PcieReplay]);
        assert!(s.observe(&sim.sample().unwrap(), at(5)).is_empty(), "counters unchanged: nothing");
    }
}
