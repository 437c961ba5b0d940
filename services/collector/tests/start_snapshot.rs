//! The start snapshot through the collector binary and the testbed's Kafka: after a start, and
//! again after a restart, every simulated GPU publishes each of its readings once, marked as the
//! snapshot and healthy when normal, so an incident opened before the restart can see the clear
//! evidence it waits for.

mod common;

use std::time::Duration;

use common::CollectorEnv;
use gpumedic_collector::sampler::SNAPSHOT_RAW;
use gpumedic_schemas::{Detail, HealthEvent, Kind, topics};
use gpumedic_testkit as testkit;

/// The readings a simulated (H100-like) GPU has, as snapshot kinds.
const KINDS: [Kind; 7] =
    [Kind::Temperature, Kind::Ecc, Kind::RowRemap, Kind::Power, Kind::Throttle, Kind::PcieReplay, Kind::Nvlink];

/// Snapshot events of `node` on the raw topic, read until each of `gpus` GPUs has one of every
/// kind `rounds` times (once per start).
async fn snapshots(node: &str, gpus: i32, rounds: usize) -> Vec<HealthEvent> {
    let mut seen = Vec::new();
    testkit::wait_for_record(
        topics::HEALTH_RAW,
        |r| {
            if r.key.as_deref() != Some(node.as_bytes()) {
                return false;
            }
            let e: HealthEvent = gpumedic_schemas::decode(r.payload.as_deref().unwrap_or_default()).expect("decodes");
            if e.raw.as_deref() == Some(SNAPSHOT_RAW) {
                seen.push(e);
            }
            (0..gpus).all(|g| {
                KINDS
                    .iter()
                    .all(|k| seen.iter().filter(|e| e.entity.gpu_index == Some(g) && e.kind == *k).count() >= rounds)
            })
        },
        Duration::from_secs(60),
    )
    .await
    .unwrap_or_else(|e| panic!("waiting for {rounds} snapshot(s) of {gpus} GPUs: {e}"));
    seen
}

#[tokio::test]
async fn every_reading_is_published_once_at_start_and_again_after_a_restart() {
    let bootstrap = testkit::require_kafka().await.unwrap_or_else(|e| panic!("{e}"));
    let node = testkit::unique_name("snapshot");
    let state = std::env::temp_dir().join(testkit::unique_name("collector-snapshot"));
    let env = CollectorEnv::new(bootstrap, &node, &state)
        .simulated(2)
        .set("GPUMEDIC_SAMPLE_INTERVAL", "200ms")
        .set("GPUMEDIC_CLOUD_PROVIDER", "none");
    let mut collector = env.start().await;
    let first = snapshots(&node, 2, 1).await;
    assert!(first.iter().all(|e| e.healthy), "a healthy simulated GPU's readings are clear evidence: {first:#?}");
    let nvlink = first.iter().find(|e| e.kind == Kind::Nvlink).unwrap();
    assert!(matches!(&nvlink.detail, Detail::Nvlink(d) if d.active == Some(true)), "every link up: state up");
    let ecc = first.iter().find(|e| e.kind == Kind::Ecc).unwrap();
    assert!(matches!(&ecc.detail, Detail::Ecc(d) if d.double_bit_volatile == Some(0)));
    // Sampled again and again, unchanged: no second snapshot until the restart.
    tokio::time::sleep(Duration::from_secs(1)).await;
    collector.terminate(Duration::from_secs(15)).await.expect("stops");

    let mut restarted = env.start().await;
    let both = snapshots(&node, 2, 2).await;
    for g in 0..2 {
        for k in KINDS {
            let n = both.iter().filter(|e| e.entity.gpu_index == Some(g) && e.kind == k).count();
            assert_eq!(n, 2, "GPU {g} {k:?}: once per start, not on every sample");
        }
    }
    restarted.terminate(Duration::from_secs(15)).await.expect("stops");
    std::fs::remove_dir_all(&state).ok();
}
