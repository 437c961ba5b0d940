//! A restarted classifier keeps following the incidents the store holds open, against the real
//! Kafka and PostgreSQL. Two ways a rebuild from events alone lost one (and with it, the node's
//! release, since the remediator holds a node while its incident is open):
//! - a restart under a new version of the rule: the replayed fault opened the incident again
//!   under a new id, so the recovery named an incident nobody had opened and the stored one
//!   stayed open for good;
//! - an incident older than `--rebuild-window`: no event was left to replay, so nothing followed
//!   it and its healthy evidence closed nothing.

use std::time::Duration;

use gpumedic_testkit as testkit;

mod support;
use support::{Bed, healthy, rules_dir, xid, xid79_rule};

/// Xid 48 on one GPU cordons until that GPU's healthy evidence has stood 2 s.
const XID48_RULE: &str = "rules:\n  - id: xid-48-test\n    version: 1\n    description: double-bit ECC error\n    match:\n      - {kind: xid, xid: [48]}\n    severity: warning\n    action: cordon\n    clear: {evidence: {healthy: true}, quiet: 2s}\n";

#[tokio::test]
async fn a_restart_under_a_new_rule_version_recovers_the_incident_it_opened_not_a_new_one() {
    let bed = Bed::new("reattach-version").await;
    let rules = rules_dir(&xid79_rule(1));
    let node = testkit::unique_name("reattach-node");
    let mut c = bed.start(&rules, "48h", &[]).await;
    bed.send(&node, xid(&node, 79)).await;
    let opened = bed.verdict(&node, |v| !v.recovery, "the fault's verdict").await;
    c.terminate(Duration::from_secs(20)).await.unwrap_or_else(|e| panic!("{e}"));

    // An upgrade bumps the rule's version; the classifier restarts under it.
    std::fs::write(rules.join("rules.yaml"), xid79_rule(2)).unwrap();
    let mut c = bed.start(&rules, "48h", &[]).await;
    bed.send(&node, healthy(&node, "boot-after")).await;
    let recovery = bed.verdict(&node, |v| v.recovery, "the recovery after the reboot").await;
    assert_eq!(recovery.incident_id, opened.incident_id, "the recovery closes the incident the remediator holds");
    assert_ne!(recovery.verdict_id, opened.verdict_id);
    assert_eq!(
        bed.incidents_once(&node, (1, 1), Duration::from_secs(15)).await,
        (1, 1),
        "one incident, and it is closed"
    );
    c.terminate(Duration::from_secs(20)).await.unwrap_or_else(|e| panic!("{e}"));
    std::fs::remove_dir_all(&rules).ok();
}

#[tokio::test]
async fn an_incident_older_than_the_rebuild_window_is_still_followed_after_a_restart() {
    let bed = Bed::new("reattach-window").await;
    let rules = rules_dir(XID48_RULE);
    let node = testkit::unique_name("reattach-node");
    let mut c = bed.start(&rules, "48h", &[]).await;
    bed.send(&node, xid(&node, 48)).await;
    let opened = bed.verdict(&node, |v| !v.recovery, "the fault's verdict").await;
    c.terminate(Duration::from_secs(20)).await.unwrap_or_else(|e| panic!("{e}"));

    // The fault is now older than the window the restarted classifier replays.
    tokio::time::sleep(Duration::from_secs(4)).await;
    let mut c = bed.start(&rules, "3s", &[]).await;
    bed.send(&node, healthy(&node, "boot-before")).await;
    let recovery = bed.verdict(&node, |v| v.recovery, "the recovery on the GPU's healthy evidence").await;
    assert_eq!(recovery.incident_id, opened.incident_id);
    assert_eq!(
        bed.incidents_once(&node, (1, 1), Duration::from_secs(15)).await,
        (1, 1),
        "one incident, and it is closed"
    );
    c.terminate(Duration::from_secs(20)).await.unwrap_or_else(|e| panic!("{e}"));
    std::fs::remove_dir_all(&rules).ok();
}
