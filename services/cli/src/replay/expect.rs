//! The expected outcomes a backtest is judged against (`--expect`): the expectations part of a
//! decision-quality scenario file.

use std::collections::BTreeMap;
use std::path::Path;

use anyhow::{Context as _, bail};
use chrono::DateTime;
use gpumedic_classifier::quality::{Checkpoint, Expect, Expectations, Target};
use gpumedic_classifier::rules;
use serde::Deserialize;

/// The expectations part of a decision-quality scenario file.
#[derive(Debug, Deserialize)]
pub(super) struct ExpectFile {
    /// Per node: an [`Expect`], plus `gpus: {gpu: Expect}`.
    #[serde(default)]
    expect: BTreeMap<String, serde_yaml::Value>,
    #[serde(default)]
    checkpoints: Vec<ExpectCheckpoint>,
    #[serde(default)]
    oscillations: Option<usize>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct ExpectCheckpoint {
    at: String,
    node: String,
    #[serde(default)]
    gpu: Option<serde_yaml::Value>,
    in_service: bool,
}

/// A GPU as an expectations file names it: its UUID, or an index in the corpus's naming
/// (`GPU-<node>-<index>`).
fn gpu_name(node: &str, v: &serde_yaml::Value) -> anyhow::Result<String> {
    match v {
        serde_yaml::Value::String(s) => Ok(s.clone()),
        serde_yaml::Value::Number(n) if n.is_u64() => Ok(format!("GPU-{node}-{n}")),
        other => bail!("{other:?} is not a GPU name or index"),
    }
}

/// Reads an expectations file.
pub(super) fn read_expectations(path: &Path) -> anyhow::Result<ExpectFile> {
    let text = std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    serde_yaml::from_str(&text).with_context(|| format!("{} is not an expectations file", path.display()))
}

impl ExpectFile {
    /// Expectations with checkpoint times resolved (offsets count from `first`, the first event).
    pub(super) fn resolve(self, first: i64) -> anyhow::Result<Expectations> {
        let mut out = Expectations { oscillations: self.oscillations, ..Default::default() };
        for (node, mut value) in self.expect {
            let gpus = value.as_mapping_mut().and_then(|m| m.remove("gpus"));
            let e: Expect = serde_yaml::from_value(value).with_context(|| format!("expect.{node}"))?;
            out.targets.push((Target::node(&node), e));
            let Some(serde_yaml::Value::Mapping(gpus)) = gpus else { continue };
            for (gpu, value) in gpus {
                let gpu = gpu_name(&node, &gpu).with_context(|| format!("expect.{node}.gpus"))?;
                let e: Expect = serde_yaml::from_value(value).with_context(|| format!("expect.{node}.gpus.{gpu}"))?;
                out.targets.push((Target::gpu(&node, gpu), e));
            }
        }
        for c in self.checkpoints {
            let at = match DateTime::parse_from_rfc3339(&c.at) {
                Ok(t) => t.timestamp_micros(),
                Err(_) => {
                    let offset =
                        rules::parse_duration(&c.at).map_err(|e| anyhow::anyhow!("checkpoint at {}: {e}", c.at))?;
                    first.saturating_add(offset.micros())
                }
            };
            let target = match &c.gpu {
                Some(g) => Target::gpu(&c.node, gpu_name(&c.node, g)?),
                None => Target::node(&c.node),
            };
            out.checkpoints.push(Checkpoint { at_micros: at, target, in_service: c.in_service, label: c.at });
        }
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use gpumedic_classifier::quality::{self, Timeline};

    #[test]
    fn expectations_files_read_scenario_style_and_judge_decisions() {
        let text = r#"
description: ignored, as the rest of a scenario file
events: []
expect:
  node-a: {quarantined: true, released: false, action: reboot_node, gpus: {GPU-abc: {severity: none}, 3: {quarantined: true}}}
checkpoints:
  - {at: 20m, node: node-a, in_service: false}
  - {at: "2026-11-30T02:00:00Z", node: node-a, gpu: GPU-abc, in_service: true}
oscillations: 0
"#;
        let dir = std::env::temp_dir().join(format!("gpumedic-expect-{}", uuid::Uuid::new_v4()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("expect.yaml");
        std::fs::write(&path, text).unwrap();
        let file = read_expectations(&path).unwrap();
        std::fs::remove_dir_all(dir).unwrap();
        let first = 1_000_000_000_000;
        let e = file.resolve(first).unwrap();
        let targets: Vec<String> = e.targets.iter().map(|(t, _)| t.to_string()).collect();
        assert_eq!(targets, ["node-a", "node-a/GPU-abc", "node-a/GPU-node-a-3"]);
        assert_eq!(e.checkpoints[0].at_micros, first + 20 * 60_000_000);
        assert_eq!(e.oscillations, Some(0));
        // No decision at all: the node was never quarantined, so the file's expectations miss.
        let (summary, misses) = Timeline::of(quality::Options::default(), &[]).evaluate(Some(&e), Some(first));
        assert_eq!((summary.missed_faults, summary.checkpoint_misses), (2, 1));
        assert!(misses.iter().any(|m| m.to_string() == "node-a: quarantined: expected true, got false"), "{misses:?}");
        assert!(summary.to_string().contains("missed faults"));
    }
}
