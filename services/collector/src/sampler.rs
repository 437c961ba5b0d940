//! From GPU samples to health events: report changes and threshold crossings, plus a periodic
//! heartbeat per GPU (the healthy evidence incidents recover on), never every sample.

use std::collections::HashMap;
use std::time::Duration;

use chrono::{DateTime, Utc};
use gpumedic_schemas::HealthEvent;
use gpumedic_schemas::health::{
    Component, CustomDetail, Detail, EccDetail, Entity, GpuLostDetail, MonitorHealthDetail, MonitorState, NvlinkDetail,
    PcieReplayDetail, PowerDetail, RetiredPagesDetail, RowRemapDetail, Source, TemperatureDetail, ThrottleDetail,
};

use crate::gpu::{GpuSample, NvlinkSample, throttle};

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

/// The `raw` text of every start-snapshot event ([`Sampler::observe_with_snapshot`]): readings
/// published because the collector (or the node) just started, not because they changed. It is
/// the schema crate's, so that readers (the classifier) know it without the collector.
pub use gpumedic_schemas::health::SNAPSHOT_RAW;

/// Remembers the last sample and heartbeat of each GPU (by index) and turns new samples into events.
#[derive(Debug)]
pub struct Sampler {
    node: String,
    source: Source,
    heartbeat: Duration,
    last: HashMap<u32, (GpuSample, DateTime<Utc>)>,
    /// GPUs whose last read failed, by index: their error was reported once.
    failing: HashMap<u32, String>,
}

impl Sampler {
    /// A sampler for `node` whose events come from `source`, with a heartbeat every `heartbeat`.
    pub fn new(node: impl Into<String>, source: Source, heartbeat: Duration) -> Self {
        Self { node: node.into(), source, heartbeat, last: HashMap::new(), failing: HashMap::new() }
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
            // A lost or unreadable GPU keeps its identity from before.
            let entity = match (s.lost || s.error.is_some(), prev) {
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
            if let Some(error) = &s.error {
                // One GPU that cannot be read: reported once, no readings and no heartbeat (it
                // is not evidence of health), its last good sample kept for when it answers.
                if self.failing.get(&s.index) != Some(error) {
                    emit(
                        Detail::MonitorHealth(MonitorHealthDetail {
                            monitor: self.source_name().into(),
                            state: MonitorState::Error,
                            message: Some(format!("GPU {} cannot be read: {error}", s.index)),
                        }),
                        false,
                    );
                    self.failing.insert(s.index, error.clone());
                }
                continue;
            }
            let was_failing = self.failing.remove(&s.index).is_some();
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
            for (detail, healthy) in memory_events(prev, s) {
                emit(detail, healthy);
            }
            if let Some((detail, healthy)) = power_event(prev, s) {
                emit(detail, healthy);
            }
            if let Some((detail, healthy)) = throttle_event(prev, s) {
                emit(detail, healthy);
            }
            let mut gray = Vec::new();
            if let Some((values, healthy)) = pcie_link_event(prev, s) {
                gray.push((Component::Pcie, values, healthy));
            }
            if let Some((values, healthy)) = slowdown_event(prev, s) {
                gray.push((Component::Gpu, values, healthy));
            }
            let links = nvlink_events(prev, s);
            let last_beat = self.last.get(&s.index).map(|(_, hb)| *hb);
            let recovered = prev.is_some_and(|p| p.lost) || was_failing;
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
            for (component, values, healthy) in gray {
                let detail = Detail::Custom(CustomDetail { monitor: self.source_name().into(), values });
                let mut e = HealthEvent::new(&self.node, self.source, component, entity.clone(), detail);
                e.observed_at = now;
                e.healthy = healthy;
                out.push(e);
            }
            for (link, detail, healthy) in links {
                let mut e = HealthEvent::new(
                    &self.node,
                    self.source,
                    Component::Nvlink,
                    Entity { nvlink_link: i32::try_from(link).ok(), ..entity.clone() },
                    detail,
                );
                e.observed_at = now;
                e.healthy = healthy;
                out.push(e);
            }
            self.last.insert(s.index, (s.clone(), beat));
        }
        out
    }

    /// Like [`Sampler::observe`], and for every GPU seen for the first time (at the collector's
    /// start, in a new boot, or a GPU that answers for the first time) one event per reading it
    /// has, whatever its value: the start snapshot. Readings that are normal at first sight are
    /// otherwise never published, so an incident opened before a restart (ECC, row remap,
    /// NVLink, temperature, ...) would never see the clear evidence it waits for. Each snapshot
    /// event has `raw` set to [`SNAPSHOT_RAW`] and is healthy when its value is normal; it
    /// replaces the first-sight events [`Sampler::observe`] gives for the same GPU.
    pub fn observe_with_snapshot(&mut self, samples: &[GpuSample], now: DateTime<Utc>) -> Vec<HealthEvent> {
        let first: Vec<&GpuSample> =
            samples.iter().filter(|s| !s.lost && s.error.is_none() && !self.last.contains_key(&s.index)).collect();
        let mut out = self.observe(samples, now);
        if first.is_empty() {
            return out;
        }
        // Heartbeats and the gray-failure events (`custom`: a PCIe link below its maximum, an
        // unexplained slowdown) stay: the snapshot has no form of its own for those.
        let is_first = |e: &HealthEvent| {
            e.kind != gpumedic_schemas::Kind::MonitorHealth
                && e.kind != gpumedic_schemas::Kind::Custom
                && first.iter().any(|s| e.entity.gpu_index == i32::try_from(s.index).ok())
        };
        out.retain(|e| !is_first(e));
        for s in first {
            out.extend(self.snapshot(s, now));
        }
        out
    }

    /// The start snapshot of one GPU: every reading it has, healthy when normal.
    fn snapshot(&self, s: &GpuSample, now: DateTime<Utc>) -> Vec<HealthEvent> {
        let entity = Entity {
            gpu_uuid: (!s.uuid.is_empty()).then(|| s.uuid.clone()),
            pci_bus_id: (!s.pci_bus_id.is_empty()).then(|| s.pci_bus_id.clone()),
            gpu_index: i32::try_from(s.index).ok(),
            ..Default::default()
        };
        let mut readings: Vec<(Component, Entity, Detail, bool)> = Vec::new();
        let mut add = |detail: Detail, healthy: bool| readings.push((Component::Gpu, entity.clone(), detail, healthy));
        if let Some(celsius) = s.temperature_c {
            add(
                Detail::Temperature(TemperatureDetail {
                    celsius,
                    slowdown_celsius: s.slowdown_c,
                    shutdown_celsius: s.shutdown_c,
                }),
                band(s) == Some(Band::Normal),
            );
        }
        if s.ecc_sbe_volatile.is_some()
            || s.ecc_dbe_volatile.is_some()
            || s.ecc_sbe_aggregate.is_some()
            || s.ecc_dbe_aggregate.is_some()
        {
            add(
                Detail::Ecc(EccDetail {
                    single_bit_volatile: s.ecc_sbe_volatile,
                    double_bit_volatile: s.ecc_dbe_volatile,
                    single_bit_aggregate: s.ecc_sbe_aggregate,
                    double_bit_aggregate: s.ecc_dbe_aggregate,
                    location: None,
                }),
                s.ecc_dbe_volatile.unwrap_or(0) == 0,
            );
        }
        if s.retired_pages_sbe.is_some() || s.retired_pages_dbe.is_some() || s.retired_pages_pending.is_some() {
            let pending = s.retired_pages_pending.unwrap_or(false);
            add(
                Detail::RetiredPages(RetiredPagesDetail {
                    single_bit: s.retired_pages_sbe.unwrap_or(0),
                    double_bit: s.retired_pages_dbe.unwrap_or(0),
                    pending,
                }),
                !pending,
            );
        }
        if s.remapped_rows_correctable.is_some() || s.remap_pending.is_some() || s.remap_failure.is_some() {
            let (pending, failure) = (s.remap_pending.unwrap_or(false), s.remap_failure.unwrap_or(false));
            add(
                Detail::RowRemap(RowRemapDetail {
                    correctable: s.remapped_rows_correctable.unwrap_or(0),
                    uncorrectable: s.remapped_rows_uncorrectable.unwrap_or(0),
                    pending,
                    failure,
                }),
                !pending && !failure,
            );
        }
        if let (Some(watts), Some(limit)) = (s.power_w, s.power_limit_w) {
            add(Detail::Power(PowerDetail { watts, limit_watts: Some(limit) }), watts <= limit);
        }
        if let Some(mask) = s.throttle_mask {
            let concerning = mask & throttle::CONCERNING;
            add(
                Detail::Throttle(ThrottleDetail {
                    reasons: throttle::names(concerning),
                    mask: i64::try_from(mask).ok(),
                }),
                concerning == 0,
            );
        }
        if let Some(count) = s.pcie_replay {
            // No delta: nothing is known about growth before the start.
            add(Detail::PcieReplay(PcieReplayDetail { count, delta: None }), true);
        }
        if let Some(first_link) = s.nvlinks.first() {
            // One event per GPU, counters summed over its links as in every NVLink event. The
            // state is `up` only when every link is up: a link down at start may be unused, so
            // it is neither reported down nor claimed up.
            let all_up = s.nvlinks.iter().all(|l| l.active == Some(true));
            let sum = |f: fn(&NvlinkSample) -> Option<i64>| -> Option<i64> {
                s.nvlinks.iter().filter_map(f).fold(None, |acc, v| Some(acc.unwrap_or(0) + v))
            };
            readings.push((
                Component::Nvlink,
                Entity { nvlink_link: i32::try_from(first_link.link).ok(), ..entity.clone() },
                Detail::Nvlink(NvlinkDetail {
                    link: i32::try_from(first_link.link).unwrap_or(i32::MAX),
                    active: all_up.then_some(true),
                    crc_flit_errors: sum(|l| l.crc_flit),
                    crc_data_errors: sum(|l| l.crc_data),
                    replay_errors: sum(|l| l.replay),
                    recovery_errors: sum(|l| l.recovery),
                }),
                all_up,
            ));
        }
        readings
            .into_iter()
            .map(|(component, entity, detail, healthy)| {
                let mut e = HealthEvent::new(&self.node, self.source, component, entity, detail);
                e.observed_at = now;
                e.healthy = healthy;
                e.raw = Some(SNAPSHOT_RAW.to_owned());
                e
            })
            .collect()
    }

    fn source_name(&self) -> &'static str {
        match self.source {
            Source::Synthetic => "simulated",
            Source::Dcgm => "dcgm",
            _ => "nvml",
        }
    }
}

fn grew(before: Option<i64>, after: Option<i64>) -> bool {
    matches!((before, after), (Some(b), Some(a)) if a > b)
}

fn flipped(before: Option<bool>, after: Option<bool>) -> bool {
    matches!((before, after), (Some(b), Some(a)) if a != b)
}

/// Retired pages and row remapping: an event when a count grows or a pending/failure flag
/// flips, and at first sight when a flag is already set (a node that comes up with a pending
/// remap must say so). Healthy only when a flag cleared and nothing grew.
fn memory_events(prev: Option<&GpuSample>, s: &GpuSample) -> Vec<(Detail, bool)> {
    let mut out = Vec::new();
    if s.retired_pages_sbe.is_some() || s.retired_pages_dbe.is_some() || s.retired_pages_pending.is_some() {
        let counts_grew = prev.is_some_and(|p| {
            grew(p.retired_pages_sbe, s.retired_pages_sbe) || grew(p.retired_pages_dbe, s.retired_pages_dbe)
        });
        let pending = s.retired_pages_pending.unwrap_or(false);
        let changed = match prev {
            Some(p) => counts_grew || flipped(p.retired_pages_pending, s.retired_pages_pending),
            None => pending,
        };
        if changed {
            out.push((
                Detail::RetiredPages(RetiredPagesDetail {
                    single_bit: s.retired_pages_sbe.unwrap_or(0),
                    double_bit: s.retired_pages_dbe.unwrap_or(0),
                    pending,
                }),
                !counts_grew && !pending,
            ));
        }
    }
    if s.remapped_rows_correctable.is_some() || s.remap_pending.is_some() || s.remap_failure.is_some() {
        let counts_grew = prev.is_some_and(|p| {
            grew(p.remapped_rows_correctable, s.remapped_rows_correctable)
                || grew(p.remapped_rows_uncorrectable, s.remapped_rows_uncorrectable)
        });
        let pending = s.remap_pending.unwrap_or(false);
        let failure = s.remap_failure.unwrap_or(false);
        let changed = match prev {
            Some(p) => {
                counts_grew || flipped(p.remap_pending, s.remap_pending) || flipped(p.remap_failure, s.remap_failure)
            }
            None => pending || failure,
        };
        if changed {
            out.push((
                Detail::RowRemap(RowRemapDetail {
                    correctable: s.remapped_rows_correctable.unwrap_or(0),
                    uncorrectable: s.remapped_rows_uncorrectable.unwrap_or(0),
                    pending,
                    failure,
                }),
                !counts_grew && !pending && !failure,
            ));
        }
    }
    out
}

/// Power draw crossing the enforced limit, up (unhealthy) or back down (healthy). Drawing at
/// the limit is normal under load; only drawing above it is news.
fn power_event(prev: Option<&GpuSample>, s: &GpuSample) -> Option<(Detail, bool)> {
    let over = |g: &GpuSample| match (g.power_w, g.power_limit_w) {
        (Some(w), Some(limit)) => Some(w > limit),
        _ => None,
    };
    let now = over(s)?;
    let before = prev.and_then(over);
    let report = match before {
        Some(b) => b != now,
        None => now,
    };
    report.then(|| {
        (Detail::Power(PowerDetail { watts: s.power_w.unwrap_or_default(), limit_watts: s.power_limit_w }), !now)
    })
}

/// Clock-event reasons that point at the hardware ([`throttle::CONCERNING`]): an event when that
/// set changes (and at first sight when it is not empty); healthy when it becomes empty.
fn throttle_event(prev: Option<&GpuSample>, s: &GpuSample) -> Option<(Detail, bool)> {
    let mask = s.throttle_mask?;
    let concerning = mask & throttle::CONCERNING;
    let before = prev.and_then(|p| p.throttle_mask).map(|m| m & throttle::CONCERNING);
    let report = match before {
        Some(b) => b != concerning,
        None => concerning != 0,
    };
    report.then(|| {
        (
            Detail::Throttle(ThrottleDetail { reasons: throttle::names(concerning), mask: i64::try_from(mask).ok() }),
            concerning == 0,
        )
    })
}

/// How a GPU's PCIe link falls short of its maximum: `width` (fewer lanes than the slot and GPU
/// allow: a seating, riser or lane fault, never power management), `gen` (a lower generation
/// while the GPU is busy; an idle GPU trains its link down to save power, so an idle GPU's
/// generation is not judged), both (`gen,width`), or `None` when the link is at its maximum.
/// Unknown when NVML does not tell the readings.
fn pcie_shortfall(s: &GpuSample) -> Option<Option<&'static str>> {
    let width = match (s.pcie_link_width, s.pcie_link_width_max) {
        (Some(w), Some(max)) => w < max,
        _ => false,
    };
    let busy = s.throttle_mask.is_some_and(|m| m & throttle::GPU_IDLE == 0);
    let gen_low = match (s.pcie_link_gen, s.pcie_link_gen_max) {
        (Some(g), Some(max)) => busy && g < max,
        _ => false,
    };
    if s.pcie_link_width.is_none() && s.pcie_link_gen.is_none() {
        return None;
    }
    Some(match (gen_low, width) {
        (true, true) => Some("gen,width"),
        (false, true) => Some("width"),
        (true, false) => Some("gen"),
        (false, false) => None,
    })
}

fn opt_text(v: Option<u32>) -> String {
    v.map_or_else(String::new, |v| v.to_string())
}

/// PCIe link downtraining: an event when the shortfall ([`pcie_shortfall`]) changes, and at first
/// sight when there is one; healthy when the link is back at its maximum. `custom` values:
/// `check: pcie_link`, `degraded` (`width`, `gen`, `gen,width` or `none`), the four readings.
fn pcie_link_event(
    prev: Option<&GpuSample>,
    s: &GpuSample,
) -> Option<(std::collections::BTreeMap<String, String>, bool)> {
    let now = pcie_shortfall(s)?;
    let report = match prev.and_then(pcie_shortfall) {
        Some(before) => before != now,
        None => now.is_some(),
    };
    report.then(|| {
        let values = [
            ("check", "pcie_link".to_owned()),
            ("degraded", now.unwrap_or("none").to_owned()),
            ("link_gen", opt_text(s.pcie_link_gen)),
            ("max_link_gen", opt_text(s.pcie_link_gen_max)),
            ("link_width", opt_text(s.pcie_link_width)),
            ("max_link_width", opt_text(s.pcie_link_width_max)),
        ]
        .into_iter()
        .filter(|(_, v)| !v.is_empty())
        .map(|(k, v)| (k.to_owned(), v))
        .collect();
        (values, now.is_none())
    })
}

/// A hardware slowdown nothing explains: `HW_SLOWDOWN` set while no thermal or power-brake reason
/// is, the temperature is below the slowdown threshold and the draw within the limit. NVML sets
/// `HW_SLOWDOWN` with the thermal or power-brake bit when those are the cause; alone it points at
/// the board, a sensor or the power supply. Unknown without a throttle reading.
fn unexplained_slowdown(s: &GpuSample) -> Option<bool> {
    let mask = s.throttle_mask?;
    let hot = band(s).is_some_and(|b| b != Band::Normal);
    let over = matches!((s.power_w, s.power_limit_w), (Some(w), Some(l)) if w > l);
    Some(mask & throttle::HW_SLOWDOWN != 0 && mask & throttle::EXPLAINS_SLOWDOWN == 0 && !hot && !over)
}

/// An unexplained slowdown ([`unexplained_slowdown`]) starting (also at first sight) or ending
/// (healthy). `custom` values: `check: clock_slowdown`, `explained: false`, the mask, the
/// temperature and the draw.
fn slowdown_event(
    prev: Option<&GpuSample>,
    s: &GpuSample,
) -> Option<(std::collections::BTreeMap<String, String>, bool)> {
    let now = unexplained_slowdown(s)?;
    let report = match prev.and_then(unexplained_slowdown) {
        Some(before) => before != now,
        None => now,
    };
    report.then(|| {
        let mut values = std::collections::BTreeMap::new();
        values.insert("check".to_owned(), "clock_slowdown".to_owned());
        values.insert("slowing".to_owned(), now.to_string());
        values.insert(
            "reasons".to_owned(),
            throttle::names(s.throttle_mask.unwrap_or(0) & throttle::CONCERNING).join(","),
        );
        if let Some(mask) = s.throttle_mask {
            values.insert("mask".to_owned(), format!("{mask:#x}"));
        }
        if let Some(t) = s.temperature_c {
            values.insert("temperature".to_owned(), t.to_string());
        }
        if let Some(w) = s.power_w {
            values.insert("power".to_owned(), format!("{w:.0}"));
        }
        (values, !now)
    })
}

/// NVLink: an event per link that goes down or comes back up, and one per GPU when its error
/// counters grow. Counters in every NVLink event are summed over the GPU's links, so the
/// classifier sees one counter series per GPU (its rules judge growth per GPU); `link` names
/// the link the event is about (the one that changed state, or the one whose counters grew
/// most). A link down at first sight is not reported: unused links are legitimately down.
fn nvlink_events(prev: Option<&GpuSample>, s: &GpuSample) -> Vec<(u32, Detail, bool)> {
    let Some(p) = prev else { return Vec::new() };
    if s.nvlinks.is_empty() {
        return Vec::new();
    }
    let sum = |links: &[NvlinkSample], f: fn(&NvlinkSample) -> Option<i64>| -> Option<i64> {
        links.iter().filter_map(f).fold(None, |acc, v| Some(acc.unwrap_or(0) + v))
    };
    let detail = |link: u32, active: Option<bool>| NvlinkDetail {
        link: i32::try_from(link).unwrap_or(i32::MAX),
        active,
        crc_flit_errors: sum(&s.nvlinks, |l| l.crc_flit),
        crc_data_errors: sum(&s.nvlinks, |l| l.crc_data),
        replay_errors: sum(&s.nvlinks, |l| l.replay),
        recovery_errors: sum(&s.nvlinks, |l| l.recovery),
    };
    let all_up = s.nvlinks.iter().all(|l| l.active != Some(false));
    let mut out = Vec::new();
    let mut most_growth: Option<(u32, i64)> = None;
    for link in &s.nvlinks {
        let before = p.nvlinks.iter().find(|l| l.link == link.link);
        if let Some(b) = before
            && flipped(b.active, link.active)
        {
            let up = link.active == Some(true);
            // Back up is healthy only once every link of the GPU is up again.
            out.push((link.link, Detail::Nvlink(detail(link.link, link.active)), up && all_up));
        }
        let growth: i64 = [
            (before.and_then(|b| b.crc_flit), link.crc_flit),
            (before.and_then(|b| b.crc_data), link.crc_data),
            (before.and_then(|b| b.replay), link.replay),
            (before.and_then(|b| b.recovery), link.recovery),
        ]
        .into_iter()
        .filter_map(|(b, a)| Some(a? - b?).filter(|d| *d > 0))
        .sum();
        if growth > 0 && most_growth.is_none_or(|(_, g)| growth > g) {
            most_growth = Some((link.link, growth));
        }
    }
    if let Some((link, _)) = most_growth {
        // Counter growth says nothing about link state, so `active` stays unset: it must not
        // read as evidence that a down link is back.
        out.push((link, Detail::Nvlink(detail(link, None)), false));
    }
    out
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

#[cfg(test)]
mod field_tests {
    //! One test per NVML field the sampler judges, each driven through the simulated backend.

    use super::*;
    use crate::gpu::{GpuBackend as _, Simulated, SimulatedControl, throttle};
    use gpumedic_schemas::Kind;

    fn at(s: i64) -> DateTime<Utc> {
        DateTime::from_timestamp(1_800_000_000 + s, 0).unwrap()
    }

    /// A one-GPU node already sampled once, with no heartbeat due for an hour.
    fn started() -> (Simulated, SimulatedControl, Sampler) {
        let (mut sim, control) = Simulated::new("n", 1);
        let mut s = Sampler::new("n", Source::Nvml, Duration::from_secs(3600));
        s.observe(&sim.sample().unwrap(), at(0));
        (sim, control, s)
    }

    fn step(sim: &mut Simulated, s: &mut Sampler, t: i64) -> Vec<HealthEvent> {
        s.observe(&sim.sample().unwrap(), at(t))
    }

    #[test]
    fn ecc_counters_volatile_and_aggregate() {
        let (mut sim, control, mut s) = started();
        control.update(0, |g| g.ecc_sbe_volatile = Some(3));
        let e = step(&mut sim, &mut s, 1);
        assert_eq!(e.len(), 1);
        assert!(
            matches!(&e[0].detail, Detail::Ecc(d) if d.single_bit_volatile == Some(3) && d.double_bit_aggregate == Some(0))
        );
        control.update(0, |g| g.ecc_dbe_aggregate = Some(1));
        assert_eq!(step(&mut sim, &mut s, 2)[0].kind, Kind::Ecc, "lifetime double-bit growth");
        // A driver reload resets the volatile counters: not a fault.
        control.update(0, |g| g.ecc_sbe_volatile = Some(0));
        assert!(step(&mut sim, &mut s, 3).is_empty());
    }

    fn values(e: &HealthEvent) -> &std::collections::BTreeMap<String, String> {
        match &e.detail {
            Detail::Custom(c) => &c.values,
            other => panic!("custom expected, got {other:?}"),
        }
    }

    #[test]
    fn pcie_link_below_its_maximum_width_always_generation_only_when_busy() {
        let (mut sim, control, mut s) = started();
        // Idle: the link trains down to save power; not a fault.
        control.update(0, |g| g.pcie_link_gen = Some(1));
        assert!(step(&mut sim, &mut s, 1).is_empty(), "an idle GPU's generation is not judged");
        // Busy at Gen1: downtrained.
        control.update(0, |g| g.throttle_mask = Some(throttle::SW_POWER_CAP));
        let e = step(&mut sim, &mut s, 2);
        assert_eq!(e.len(), 1, "{e:?}");
        assert_eq!((e[0].kind, e[0].component, e[0].healthy), (Kind::Custom, Component::Pcie, false));
        let v = values(&e[0]);
        assert_eq!(v.get("check").map(String::as_str), Some("pcie_link"));
        assert_eq!(v.get("degraded").map(String::as_str), Some("gen"));
        assert_eq!((v["link_gen"].as_str(), v["max_link_gen"].as_str()), ("1", "5"));
        assert_eq!(e[0].entity.gpu_index, Some(0));
        // Fewer lanes too: a new shortfall.
        control.update(0, |g| g.pcie_link_width = Some(8));
        assert_eq!(values(&step(&mut sim, &mut s, 3)[0]).get("degraded").map(String::as_str), Some("gen,width"));
        assert!(step(&mut sim, &mut s, 4).is_empty(), "unchanged: no event");
        // Back at the maximum: healthy.
        control.update(0, |g| {
            g.pcie_link_gen = Some(5);
            g.pcie_link_width = Some(16);
        });
        let e = step(&mut sim, &mut s, 5);
        assert_eq!((e.len(), e[0].healthy), (1, true));
        assert_eq!(values(&e[0]).get("degraded").map(String::as_str), Some("none"));
    }

    #[test]
    fn a_narrow_link_at_first_sight_is_reported_even_through_the_snapshot() {
        let (mut sim, control) = Simulated::new("n", 1);
        control.update(0, |g| g.pcie_link_width = Some(4));
        let mut s = Sampler::new("n", Source::Nvml, Duration::from_secs(3600));
        let first = s.observe_with_snapshot(&sim.sample().unwrap(), at(0));
        let pcie: Vec<_> = first.iter().filter(|e| e.kind == Kind::Custom).collect();
        assert_eq!(pcie.len(), 1, "{first:#?}");
        assert_eq!(values(pcie[0]).get("degraded").map(String::as_str), Some("width"));
        assert!(!pcie[0].healthy);
    }

    #[test]
    fn a_hardware_slowdown_without_a_thermal_or_power_reason_is_a_gray_failure() {
        let (mut sim, control, mut s) = started();
        // Explained: the thermal bit is set with it. Only the throttle event.
        control.update(0, |g| g.throttle_mask = Some(throttle::HW_SLOWDOWN | throttle::HW_THERMAL_SLOWDOWN));
        let e = step(&mut sim, &mut s, 1);
        assert!(e.iter().all(|e| e.kind == Kind::Throttle), "{e:?}");
        // Explained by the draw over the limit (fast-trigger protection).
        control.update(0, |g| {
            g.throttle_mask = Some(throttle::HW_SLOWDOWN);
            g.power_w = Some(750.0);
        });
        assert!(step(&mut sim, &mut s, 2).iter().all(|e| e.kind != Kind::Custom));
        // Nothing explains it: the gray failure.
        control.update(0, |g| g.power_w = Some(400.0));
        let e = step(&mut sim, &mut s, 3);
        let slow: Vec<_> = e.iter().filter(|e| e.kind == Kind::Custom).collect();
        assert_eq!(slow.len(), 1, "{e:?}");
        assert_eq!(values(slow[0]).get("check").map(String::as_str), Some("clock_slowdown"));
        assert_eq!(values(slow[0]).get("reasons").map(String::as_str), Some("hw_slowdown"));
        assert!(!slow[0].healthy);
        assert!(step(&mut sim, &mut s, 4).is_empty());
        control.update(0, |g| g.throttle_mask = Some(0));
        let e = step(&mut sim, &mut s, 5);
        let slow: Vec<_> = e.iter().filter(|e| e.kind == Kind::Custom).collect();
        assert_eq!((slow.len(), slow[0].healthy), (1, true));
    }

    #[test]
    fn retired_pages_and_pending_retirement() {
        let (mut sim, control) = Simulated::new("n", 1);
        // An older GPU that retires pages, with a retirement already pending at start.
        control.update(0, |g| {
            g.retired_pages_sbe = Some(2);
            g.retired_pages_dbe = Some(0);
            g.retired_pages_pending = Some(true);
        });
        let mut s = Sampler::new("n", Source::Nvml, Duration::from_secs(3600));
        let first: Vec<_> = sim.sample().map(|x| s.observe(&x, at(0))).unwrap();
        let pages: Vec<_> = first.iter().filter(|e| e.kind == Kind::RetiredPages).collect();
        assert_eq!(pages.len(), 1, "pending at first sight is reported");
        assert!(!pages[0].healthy);
        control.update(0, |g| g.retired_pages_dbe = Some(1));
        let grew = step(&mut sim, &mut s, 1);
        assert!(
            matches!(&grew[0].detail, Detail::RetiredPages(d) if d.single_bit == 2 && d.double_bit == 1 && d.pending)
        );
        control.update(0, |g| g.retired_pages_pending = Some(false));
        let cleared = step(&mut sim, &mut s, 2);
        assert!(cleared[0].healthy, "the retirement applied");
        assert!(step(&mut sim, &mut s, 3).is_empty());
    }

    #[test]
    fn row_remapping_counts_pending_and_failure() {
        let (mut sim, control, mut s) = started();
        control.update(0, |g| {
            g.remapped_rows_uncorrectable = Some(1);
            g.remap_pending = Some(true);
        });
        let e = step(&mut sim, &mut s, 1);
        assert_eq!(e.len(), 1);
        assert!(matches!(&e[0].detail, Detail::RowRemap(d) if d.uncorrectable == 1 && d.pending && !d.failure));
        control.update(0, |g| g.remap_failure = Some(true));
        assert!(matches!(&step(&mut sim, &mut s, 2)[0].detail, Detail::RowRemap(d) if d.failure));
        control.update(0, |g| {
            g.remap_pending = Some(false);
            g.remap_failure = Some(false);
        });
        assert!(step(&mut sim, &mut s, 3)[0].healthy, "flags cleared after a reset");
        control.update(0, |g| g.remapped_rows_correctable = Some(4));
        let e = step(&mut sim, &mut s, 4);
        assert!(!e[0].healthy, "correctable remaps growing");
    }

    #[test]
    fn temperature_against_slowdown_and_shutdown() {
        let (mut sim, control, mut s) = started();
        control.update(0, |g| g.temperature_c = Some(92));
        let e = step(&mut sim, &mut s, 1);
        assert!(matches!(&e[0].detail, Detail::Temperature(t) if t.celsius == 92 && t.shutdown_celsius == Some(92)));
        control.update(0, |g| g.temperature_c = Some(88));
        assert_eq!(step(&mut sim, &mut s, 2).len(), 1, "shutdown band down to slowdown band");
        control.update(0, |g| g.temperature_c = Some(60));
        assert!(step(&mut sim, &mut s, 3)[0].healthy);
    }

    #[test]
    fn power_over_the_enforced_limit_and_back() {
        let (mut sim, control, mut s) = started();
        control.update(0, |g| g.power_w = Some(700.0));
        assert!(step(&mut sim, &mut s, 1).is_empty(), "at the limit is normal under load");
        control.update(0, |g| g.power_w = Some(760.5));
        let e = step(&mut sim, &mut s, 2);
        assert!(matches!(&e[0].detail, Detail::Power(p) if p.watts == 760.5 && p.limit_watts == Some(700.0)));
        assert!(!e[0].healthy);
        assert!(step(&mut sim, &mut s, 3).is_empty(), "still over: reported once");
        control.update(0, |g| g.power_w = Some(500.0));
        assert!(step(&mut sim, &mut s, 4)[0].healthy);
    }

    #[test]
    fn throttle_reasons_only_the_hardware_ones() {
        let (mut sim, control, mut s) = started();
        control.update(0, |g| g.throttle_mask = Some(throttle::SW_POWER_CAP));
        assert!(step(&mut sim, &mut s, 1).is_empty(), "a power cap under load is not news");
        control.update(0, |g| {
            g.throttle_mask = Some(throttle::SW_POWER_CAP | throttle::HW_THERMAL_SLOWDOWN | throttle::HW_SLOWDOWN)
        });
        let e = step(&mut sim, &mut s, 2);
        let Detail::Throttle(t) = &e[0].detail else { panic!("{e:?}") };
        assert_eq!(t.reasons, ["hw_slowdown", "hw_thermal_slowdown"], "most serious first");
        assert_eq!(t.mask, Some(0x4c));
        control.update(0, |g| g.throttle_mask = Some(throttle::GPU_IDLE));
        assert!(step(&mut sim, &mut s, 3)[0].healthy);
    }

    #[test]
    fn nvlink_state_and_counters_summed_per_gpu() {
        let (mut sim, control, mut s) = started();
        control.update(0, |g| {
            g.nvlinks[3].active = Some(false);
            g.nvlinks[5].crc_flit = Some(7);
            g.nvlinks[6].crc_data = Some(2);
            g.nvlinks[6].recovery = Some(1);
        });
        let e = step(&mut sim, &mut s, 1);
        assert_eq!(e.len(), 2, "{e:?}");
        assert!(e.iter().all(|e| e.component == Component::Nvlink && !e.healthy));
        let Detail::Nvlink(down) = &e[0].detail else { panic!() };
        assert_eq!((down.link, down.active), (3, Some(false)));
        assert_eq!(e[0].entity.nvlink_link, Some(3));
        let Detail::Nvlink(grew) = &e[1].detail else { panic!() };
        assert_eq!(grew.link, 5, "the link that grew most");
        assert_eq!(grew.active, None, "counter growth says nothing about link state");
        assert_eq!((grew.crc_flit_errors, grew.crc_data_errors, grew.recovery_errors), (Some(7), Some(2), Some(1)));
        control.update(0, |g| g.nvlinks[3].active = Some(true));
        let up = step(&mut sim, &mut s, 2);
        assert_eq!(up.len(), 1);
        assert!(up[0].healthy && matches!(&up[0].detail, Detail::Nvlink(d) if d.active == Some(true)));
    }

    #[test]
    fn pcie_replay_total_and_delta() {
        let (mut sim, control, mut s) = started();
        control.update(0, |g| g.pcie_replay = Some(40));
        control.update(0, |g| g.pcie_replay = Some(40));
        assert!(
            matches!(&step(&mut sim, &mut s, 1)[0].detail, Detail::PcieReplay(p) if p.count == 40 && p.delta == Some(40))
        );
        control.update(0, |g| g.pcie_replay = Some(45));
        assert!(matches!(&step(&mut sim, &mut s, 2)[0].detail, Detail::PcieReplay(p) if p.delta == Some(5)));
    }

    #[test]
    fn the_start_snapshot_publishes_every_reading_once_as_clear_evidence() {
        let (mut sim, control) = Simulated::new("n", 2);
        control.update(1, |g| {
            g.ecc_dbe_volatile = Some(2);
            g.nvlinks[4].active = Some(false);
        });
        let mut s = Sampler::new("n", Source::Nvml, Duration::from_secs(3600));
        let first = s.observe_with_snapshot(&sim.sample().unwrap(), at(0));
        let snapshot = |gpu: i32| -> Vec<&HealthEvent> {
            first.iter().filter(|e| e.entity.gpu_index == Some(gpu) && e.kind != Kind::MonitorHealth).collect()
        };
        let kinds: Vec<Kind> = snapshot(0).iter().map(|e| e.kind).collect();
        assert_eq!(
            kinds,
            [Kind::Temperature, Kind::Ecc, Kind::RowRemap, Kind::Power, Kind::Throttle, Kind::PcieReplay, Kind::Nvlink],
            "one event per reading the GPU has"
        );
        assert!(snapshot(0).iter().all(|e| e.raw.as_deref() == Some(SNAPSHOT_RAW)), "marked as the start snapshot");
        assert!(snapshot(0).iter().all(|e| e.healthy), "normal readings are healthy evidence");
        let nvlink = snapshot(0).into_iter().find(|e| e.kind == Kind::Nvlink).unwrap();
        assert!(matches!(&nvlink.detail, Detail::Nvlink(d) if d.active == Some(true)), "every link up: state up");
        // What the classifier's clear evidence asks for: the counter at 0, the state up.
        let ecc = snapshot(0).into_iter().find(|e| e.kind == Kind::Ecc).unwrap();
        assert!(matches!(&ecc.detail, Detail::Ecc(d) if d.double_bit_volatile == Some(0)));
        // A GPU that is not normal says so, without claiming a down link is up.
        let bad = snapshot(1);
        assert!(bad.iter().any(|e| e.kind == Kind::Ecc && !e.healthy));
        assert!(bad.iter().any(|e| matches!(&e.detail, Detail::Nvlink(d) if d.active.is_none()) && !e.healthy));
        assert!(first.iter().filter(|e| e.kind == Kind::MonitorHealth).count() == 2, "and the heartbeats");
        assert!(
            s.observe_with_snapshot(&sim.sample().unwrap(), at(10)).is_empty(),
            "a snapshot once, then changes only"
        );
        let restarted = Sampler::new("n", Source::Nvml, Duration::from_secs(3600))
            .observe_with_snapshot(&sim.sample().unwrap(), at(20));
        assert_eq!(restarted.len(), first.len(), "a restart (or a new boot) snapshots again");
    }

    #[test]
    fn the_snapshot_replaces_first_sight_events_and_skips_unreadable_gpus() {
        let (mut sim, control) = Simulated::new("n", 2);
        control.update(0, |g| g.remap_pending = Some(true));
        control.update(1, |g| g.error = Some("Unknown Error".into()));
        let mut s = Sampler::new("n", Source::Nvml, Duration::from_secs(3600));
        let first = s.observe_with_snapshot(&sim.sample().unwrap(), at(0));
        let remaps: Vec<_> = first.iter().filter(|e| e.kind == Kind::RowRemap).collect();
        assert_eq!(remaps.len(), 1, "one row-remap event, not the first-sight one and the snapshot");
        assert!(!remaps[0].healthy && remaps[0].raw.as_deref() == Some(SNAPSHOT_RAW));
        assert!(first.iter().all(|e| e.entity.gpu_index != Some(1) || e.kind == Kind::MonitorHealth));
        control.update(1, |g| g.error = None);
        let later = s.observe_with_snapshot(&sim.sample().unwrap(), at(10));
        assert!(
            later.iter().any(|e| e.entity.gpu_index == Some(1) && e.raw.as_deref() == Some(SNAPSHOT_RAW)),
            "{later:#?}"
        );
    }

    #[test]
    fn a_gpu_that_falls_off_the_bus() {
        let (mut sim, control, mut s) = started();
        control.update(0, |g| g.lost = true);
        let e = step(&mut sim, &mut s, 1);
        assert_eq!(e.len(), 1);
        assert_eq!(e[0].kind, Kind::GpuLost);
    }
}
