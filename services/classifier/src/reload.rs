//! Rules reload without a restart: the files of `--rules-dir` are polled every `--rules-poll`
//! (names, sizes and modification times, which also catches a Kubernetes ConfigMap's symlink
//! swap), and on any change the whole directory is checked again. A valid set replaces the rules
//! in force; an invalid one is refused with every problem logged, and the old rules stay.
//! Each outcome is logged and counted in `gpumedic_classifier_rule_reloads_total{result}`.
//!
//! The engine keys its per-node state by rule id and GPU and records the rule version it was
//! built under; [`Engine::replace_rules`](crate::rules::Engine::replace_rules) keeps the state
//! (counts, bursts, open incidents) of every rule whose id and version are unchanged; a changed
//! rule (which must bump its version) starts counting afresh but keeps following its open
//! incidents, so they clear on the new version's evidence; a removed rule's state is dropped.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use tokio::sync::Mutex;
use tokio_util::sync::CancellationToken;

use crate::classifier::Classifier;
use crate::events::{InternalEvent as _, RulesRefused, RulesReloaded};
use crate::rules::{RuleError, RuleSet, SyntheticPolicy, check_dir};

/// What identifies the state of a rules directory: each rule file's name, size and modification
/// time, sorted. An unreadable directory has an empty fingerprint.
pub type Fingerprint = Vec<(PathBuf, u64, Option<SystemTime>)>;

/// The fingerprint of `dir` now.
pub fn fingerprint(dir: &Path) -> Fingerprint {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return Vec::new();
    };
    let mut fp: Fingerprint = entries
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "yaml" || x == "yml"))
        .map(|p| {
            // Follows symlinks, so a ConfigMap update (a new target) is seen.
            let meta = std::fs::metadata(&p).ok();
            let len = meta.as_ref().map_or(0, std::fs::Metadata::len);
            let modified = meta.and_then(|m| m.modified().ok());
            (p, len, modified)
        })
        .collect();
    fp.sort();
    fp
}

/// Watches one rules directory.
#[derive(Debug)]
pub struct RulesWatch {
    dir: PathBuf,
    seen: Fingerprint,
}

impl RulesWatch {
    /// Starts watching `dir` from its current state (the rules loaded at start).
    pub fn new(dir: PathBuf) -> Self {
        let seen = fingerprint(&dir);
        RulesWatch { dir, seen }
    }

    /// `None` when nothing changed since the last poll; otherwise the directory checked again.
    pub fn poll(&mut self) -> Option<Result<RuleSet, Vec<RuleError>>> {
        let now = fingerprint(&self.dir);
        if now == self.seen {
            return None;
        }
        self.seen = now;
        Some(check_dir(&self.dir))
    }
}

/// The watcher task: polls `dir` every `every` and swaps valid rules into the engine.
pub(crate) async fn watch(
    classifier: Arc<Mutex<Classifier>>,
    dir: PathBuf,
    allow_synthetic: bool,
    every: Duration,
    token: CancellationToken,
) -> Result<(), std::convert::Infallible> {
    let mut watch = RulesWatch::new(dir.clone());
    loop {
        tokio::select! {
            () = token.cancelled() => return Ok(()),
            () = tokio::time::sleep(every) => {}
        }
        match watch.poll() {
            None => {}
            Some(Ok(rules)) => {
                let rules = if allow_synthetic { rules.with_synthetic(SyntheticPolicy::Allowed) } else { rules };
                let count = rules.rules.len();
                classifier.lock().await.replace_rules(rules);
                RulesReloaded { dir: &dir.display(), rules: count }.emit();
            }
            Some(Err(errors)) => {
                for e in &errors {
                    tracing::warn!(problem = %e, "Rule file problem.");
                }
                RulesRefused { dir: &dir.display(), problems: errors.len() }.emit();
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const RULE: &str = "rules:\n  - id: xid-79\n    version: 1\n    description: fallen off the bus\n    match: {kind: xid, xid: [79]}\n    severity: critical\n    action: reboot_node\n    clear: {evidence: {healthy: true}, proof: reboot, quiet: 30m}\n";

    #[test]
    fn a_change_is_seen_once_and_a_bad_file_is_refused_with_its_problems() {
        let dir = std::env::temp_dir().join(format!("gpumedic-reload-{}", uuid::Uuid::new_v4().simple()));
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join("a.yaml"), RULE).unwrap();
        let mut watch = RulesWatch::new(dir.clone());
        assert!(watch.poll().is_none(), "nothing changed");

        std::fs::write(dir.join("b.yaml"), RULE.replace("xid-79", "xid-79-again")).unwrap();
        let set = watch.poll().expect("a new file is a change").expect("valid");
        assert_eq!(set.rules.len(), 2);
        assert!(watch.poll().is_none(), "seen once");

        std::fs::write(dir.join("c.yaml"), "rules:\n  - id: Bad Id\n    severity: fatal\n").unwrap();
        let errors = watch.poll().expect("changed").expect_err("refused");
        assert!(errors.len() >= 2, "every problem is listed: {errors:?}");
        assert!(errors.iter().all(|e| e.file.ends_with("c.yaml")), "{errors:?}");

        std::fs::remove_file(dir.join("c.yaml")).unwrap();
        assert!(watch.poll().expect("changed").is_ok(), "fixed");
        std::fs::remove_dir_all(&dir).ok();
    }
}
