//! Where a timed fault's time goes between its produce call and its cordon, from the records it
//! causes: each fault is sent with a `traceparent` whose trace id names it, every service continues
//! that trace on the record it produces, and Kafka stamps each record with its producer's clock at
//! the produce call (`CreateTime`). A reader from the end of the enriched, verdict and action
//! topics keeps, per fault, the first such time on each; with the fault's own send time and the
//! time a watch saw the cordon, that splits the latency into:
//!
//! - **to enriched**: the raw record's produce linger and acknowledgement, the enricher's fetch,
//!   batch and enrichment, up to its produce call;
//! - **enriched to verdict**: that record's produce linger, the classifier's fetch, batch (the
//!   Postgres look-ups before the engine and the batch before it), up to the verdict's produce;
//! - **verdict to cordon**: the verdict's linger, the remediator's fetch, plan and apiserver
//!   calls, and the watch event that shows the cordon.
//!
//! All clocks are this machine's wall clock in milliseconds, so each stage is good to about 1 ms.
//! The topics are read once the faults are timed, from the ends they had when the run began to
//! the ends they have then: the timestamps are the producers', so reading late changes nothing,
//! and no extra consumer loads the broker while the faults are timed (a reader that followed the
//! whole enriched topic live cost the broker about as many requests as the classifier did).

use std::collections::HashMap;
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use rdkafka::message::{Headers as _, Message as _};

/// The stages, in the order of a fault's path.
pub const STAGES: [&str; 3] = ["to_enriched", "enriched_to_verdict", "verdict_to_cordon"];

/// Where the topics began, and the run's trace-id tag.
pub struct Stages {
    tag: u64,
    bootstrap: String,
    names: Vec<String>,
    /// Each partition of the topics (topic, partition) at the end it had when the run began.
    from: Vec<(String, i32, i64)>,
    sent: HashMap<u64, i64>,
}

/// One stage's percentiles over the faults that reached it, in milliseconds.
#[derive(Debug, Clone, serde::Serialize)]
pub struct Stage {
    pub stage: &'static str,
    pub faults: usize,
    pub p50_ms: f64,
    pub p99_ms: f64,
    pub max_ms: f64,
}

/// The milliseconds since the epoch now, on the clock Kafka's `CreateTime` uses.
pub fn wall_ms() -> i64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_millis() as i64).unwrap_or_default()
}

/// `at` on the wall clock, by its distance from now.
pub fn instant_ms(at: Instant) -> i64 {
    let now = Instant::now();
    let ms = if at <= now { -((now - at).as_millis() as i64) } else { (at - now).as_millis() as i64 };
    wall_ms() + ms
}

impl Stages {
    /// Notes the current ends of `topics` (enriched, verdicts, in that order; more may be given,
    /// they are not split), from which [`finish`](Self::finish) reads.
    pub fn start(bootstrap: &str, topics: &[&str]) -> anyhow::Result<Self> {
        let consumer = crate::topic_reader(bootstrap)?;
        let mut from = Vec::new();
        for topic in topics {
            let partitions = crate::watermarks(consumer, topic)?;
            anyhow::ensure!(!partitions.is_empty(), "topic {topic} has no metadata");
            from.extend(partitions.into_iter().map(|(p, _, high)| ((*topic).to_owned(), p, high)));
        }
        Ok(Stages {
            tag: fastrand::u64(1..),
            bootstrap: bootstrap.to_owned(),
            names: topics.iter().map(|t| (*t).to_owned()).collect(),
            from,
            sent: HashMap::new(),
        })
    }

    /// Per fault and topic, the earliest `CreateTime` of a record carrying the fault's trace:
    /// every partition read from where it began to the end it has now.
    fn first_times(&self) -> anyhow::Result<HashMap<(u64, usize), i64>> {
        let consumer = crate::topic_reader(&self.bootstrap)?;
        let mut ranges = Vec::new();
        for topic in &self.names {
            for (partition, _, high) in crate::watermarks(consumer, topic)? {
                let start = self.from.iter().find(|(t, p, _)| t == topic && *p == partition).map_or(0, |f| f.2);
                ranges.push((topic.clone(), partition, start, high));
            }
        }
        let mut first: HashMap<(u64, usize), i64> = HashMap::new();
        crate::read_ranges(consumer, &ranges, |m| {
            let Some(tp) = m.headers().and_then(|h| h.iter().find(|h| h.key == "traceparent")).and_then(|h| h.value)
            else {
                return;
            };
            let (Some(fault), Some(at)) = (fault_of(tp, self.tag), m.timestamp().to_millis()) else { return };
            let topic = self.names.iter().position(|n| n == m.topic()).unwrap_or(usize::MAX);
            first.entry((fault, topic)).and_modify(|t| *t = (*t).min(at)).or_insert(at);
        })?;
        Ok(first)
    }

    /// The `traceparent` header for fault `index`; records that it is sent now.
    pub fn traceparent(&mut self, index: u64) -> String {
        self.sent.insert(index, wall_ms());
        format!("00-{:016x}{index:016x}-{:016x}-01", self.tag, fastrand::u64(1..))
    }

    /// Reads the topics and splits each fault's latency; `cordoned` is, per fault index, when
    /// the cordon was seen (milliseconds on the wall clock). Blocks while it reads.
    pub fn finish(self, cordoned: &HashMap<u64, i64>) -> anyhow::Result<Vec<Stage>> {
        let first = self.first_times()?;
        let mut by_stage: Vec<Vec<f64>> = vec![Vec::new(); STAGES.len()];
        for (index, sent) in &self.sent {
            let points = [
                Some(*sent),
                first.get(&(*index, 0)).copied(),
                first.get(&(*index, 1)).copied(),
                cordoned.get(index).copied(),
            ];
            for (s, pair) in points.windows(2).enumerate() {
                if let [Some(from), Some(to)] = pair {
                    by_stage[s].push((to - from) as f64);
                }
            }
        }
        Ok(STAGES
            .iter()
            .zip(by_stage)
            .map(|(stage, mut ms)| {
                ms.sort_by(f64::total_cmp);
                Stage {
                    stage,
                    faults: ms.len(),
                    p50_ms: crate::latency::percentile(&ms, 0.50),
                    p99_ms: crate::latency::percentile(&ms, 0.99),
                    max_ms: ms.last().copied().unwrap_or(f64::NAN),
                }
            })
            .collect())
    }
}

/// The fault index a `traceparent` names under `tag`, if it is one of this run's.
fn fault_of(traceparent: &[u8], tag: u64) -> Option<u64> {
    let tp = std::str::from_utf8(traceparent).ok()?;
    let trace = tp.split('-').nth(1)?;
    if trace.len() != 32 || u64::from_str_radix(&trace[..16], 16).ok()? != tag {
        return None;
    }
    u64::from_str_radix(&trace[16..], 16).ok()
}

/// The remediator's own split of the last stage from its `/metrics`: the mean time from a
/// verdict's record timestamp to its handling (`delivered`), and of the handling (`acted`), in
/// milliseconds over every verdict it handled.
pub fn remediator_means(metrics: &str) -> [f64; 2] {
    ["delivered", "acted"].map(|stage| {
        let sum =
            crate::classify::metric(metrics, &format!("gpumedic_remediator_verdict_seconds_sum{{stage=\"{stage}\"}}"));
        let count = crate::classify::metric(
            metrics,
            &format!("gpumedic_remediator_verdict_seconds_count{{stage=\"{stage}\"}}"),
        );
        if count > 0.0 { sum / count * 1000.0 } else { f64::NAN }
    })
}

/// The classifier's batches from its `/metrics`, per stage of a batch (decode, classify, publish,
/// write; and rollups, the rollup writer's writes beside the batches): how many, their seconds in
/// all, and how many took longer than half a second, the stalls a fault waits behind.
#[derive(Debug, Clone, serde::Serialize)]
pub struct BatchStage {
    pub stage: &'static str,
    pub batches: f64,
    pub seconds: f64,
    pub over_half_second: f64,
}

/// [`BatchStage`] for each stage, from the classifier's `/metrics` text.
pub fn classifier_batches(metrics: &str) -> Vec<BatchStage> {
    let name = "gpumedic_classifier_batch_stage_seconds";
    ["decode", "classify", "publish", "write", "rollups"]
        .into_iter()
        .map(|stage| {
            let batches = crate::classify::metric(metrics, &format!("{name}_count{{stage=\"{stage}\"}}"));
            let quick = crate::classify::metric(metrics, &format!("{name}_bucket{{stage=\"{stage}\",le=\"0.5\"}}"));
            BatchStage {
                stage,
                batches,
                seconds: crate::classify::metric(metrics, &format!("{name}_sum{{stage=\"{stage}\"}}")),
                over_half_second: batches - quick,
            }
        })
        .collect()
}

/// One line per stage, indented under a scenario's latency line.
pub fn print(stages: &[Stage]) {
    for s in stages {
        println!(
            "    {:<20} p50 {:>6.0} ms, p99 {:>6.0} ms, max {:>6.0} ms ({} faults)",
            s.stage, s.p50_ms, s.p99_ms, s.max_ms, s.faults
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_traceparent_names_its_fault_only_under_its_runs_tag() {
        let tp = format!("00-{:016x}{:016x}-{:016x}-01", 0xabcu64, 17u64, 5u64);
        assert_eq!(fault_of(tp.as_bytes(), 0xabc), Some(17));
        assert_eq!(fault_of(tp.as_bytes(), 0xabd), None);
        assert_eq!(fault_of(b"00-short-01", 0xabc), None);
    }
}
