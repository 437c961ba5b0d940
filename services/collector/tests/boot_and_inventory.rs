//! The collector binary against the testbed's Kafka, with the simulated GPU backend: every event
//! it publishes carries the boot id of `--boot-id-file`; the GPU inventory is published at start
//! and on a change; a simulated GPU that falls off the bus is named fully (UUID, index) in the
//! kernel-log-shaped Xid 79 though the line gives only its PCI bus id, stops beating and leaves
//! the inventory; a simulated reboot brings a new boot id, a `start` inventory with every GPU and
//! the lost GPU's heartbeat, and the new boot id outlives a collector restart.

mod common;

use std::time::Duration;

use common::{CollectorEnv, inject};
use gpumedic_collector::gpu::{SIMULATED_PRODUCT, simulated_pci, simulated_uuid};
use gpumedic_schemas::health::{GpuInventoryDetail, Source};
use gpumedic_schemas::{Detail, HealthEvent, Kind, topics};
use gpumedic_testkit as testkit;

/// Every event of `node` on the raw topic, in order, read until `done` holds for them.
async fn events_until(node: &str, what: &str, mut done: impl FnMut(&[HealthEvent]) -> bool) -> Vec<HealthEvent> {
    let mut events = Vec::new();
    testkit::wait_for_record(
        topics::HEALTH_RAW,
        |r| {
            if r.key.as_deref() != Some(node.as_bytes()) {
                return false;
            }
            events.push(
                gpumedic_schemas::decode::<HealthEvent>(r.payload.as_deref().unwrap_or_default()).expect("decodes"),
            );
            done(&events)
        },
        Duration::from_secs(60),
    )
    .await
    .unwrap_or_else(|e| panic!("waiting for {what}: {e}"));
    events
}

fn inventory(e: &HealthEvent) -> Option<&GpuInventoryDetail> {
    match &e.detail {
        Detail::GpuInventory(d) => Some(d),
        _ => None,
    }
}

fn is_inventory(e: &HealthEvent, reason: &str, boot: &str) -> bool {
    inventory(e).is_some_and(|d| d.reason == reason) && e.boot_id.as_deref() == Some(boot)
}

fn is_heartbeat(e: &HealthEvent, gpu: i32, boot: &str) -> bool {
    e.kind == Kind::MonitorHealth && e.healthy && e.entity.gpu_index == Some(gpu) && e.boot_id.as_deref() == Some(boot)
}

#[tokio::test]
async fn boot_id_on_every_event_and_the_inventory_through_a_fall_off_the_bus_and_a_reboot() {
    let bootstrap = testkit::require_kafka().await.unwrap_or_else(|e| panic!("{e}"));
    let node = testkit::unique_name("boot-inv");
    let state = common::scratch("collector-boot-inv");
    let boot_file = state.join("boot_id");
    let host_boot = uuid::Uuid::new_v4().to_string();
    std::fs::write(&boot_file, format!("{host_boot}\n")).unwrap();
    let synthetic = testkit::free_local_addr().unwrap();
    let env = CollectorEnv::new(bootstrap, &node, &state.join("state"))
        .simulated(4)
        .set("GPUMEDIC_SAMPLE_INTERVAL", "200ms")
        .set("GPUMEDIC_HEARTBEAT_INTERVAL", "1s")
        .set("GPUMEDIC_INVENTORY_REFRESH", "1h")
        .set("GPUMEDIC_BOOT_ID_FILE", boot_file.display().to_string())
        .set("GPUMEDIC_SYNTHETIC_ADDR", synthetic.to_string());
    let mut collector = env.start().await;

    // At start: the inventory of every GPU, by every name, in the boot of the file.
    let events =
        events_until(&node, "the start inventory", |ev| ev.iter().any(|e| is_inventory(e, "start", &host_boot))).await;
    let start = events.iter().find(|e| is_inventory(e, "start", &host_boot)).unwrap();
    assert_eq!((start.source, start.entity.gpu_uuid.clone()), (Source::Nvml, None), "about the node");
    assert!(start.healthy);
    let d = inventory(start).unwrap();
    assert_eq!((d.gpus.len(), d.expected), (4, Some(4)));
    for (i, g) in (0u32..).zip(&d.gpus) {
        assert_eq!(g.index, Some(i as i32));
        assert_eq!(g.uuid.as_deref(), Some(simulated_uuid(&node, i).as_str()));
        assert_eq!(g.pci_bus_id.as_deref(), Some(simulated_pci(i).as_str()));
        assert_eq!(g.product.as_deref(), Some(SIMULATED_PRODUCT));
        assert!(g.serial.is_some());
    }

    // GPU 2 falls off the bus.
    let (code, answer) = inject(synthetic, r#"{"fall_off_bus": true, "gpu_index": 2}"#).await;
    assert_eq!(code, 200, "{answer}");
    assert_eq!(answer["pci_bus_id"], simulated_pci(2));
    let xid_id = answer["event_ids"][0].as_str().expect("the Xid's id").to_owned();
    let (code, answer) = inject(synthetic, r#"{"fall_off_bus": true, "gpu_index": 2}"#).await;
    assert_eq!(code, 409, "already lost: {answer}");
    let lost = |e: &HealthEvent| e.kind == Kind::GpuLost && e.entity.gpu_index == Some(2);
    let events = events_until(&node, "the Xid 79, the inventory change and NVML's lost GPU", |ev| {
        ev.iter().any(|e| e.event_id.to_string() == xid_id)
            && ev.iter().any(|e| is_inventory(e, "change", &host_boot))
            && ev.iter().any(lost)
    })
    .await;
    let xid = events.iter().find(|e| e.event_id.to_string() == xid_id).unwrap();
    assert!(matches!(&xid.detail, Detail::Xid(x) if x.code == 79));
    assert!(xid.synthetic && xid.source == Source::Synthetic);
    assert!(xid.raw.as_deref().is_some_and(|r| r.starts_with("NVRM: Xid (PCI:")), "{:?}", xid.raw);
    assert_eq!(xid.entity.pci_bus_id.as_deref(), Some(simulated_pci(2).as_str()));
    assert_eq!(
        (xid.entity.gpu_uuid.as_deref(), xid.entity.gpu_index),
        (Some(simulated_uuid(&node, 2).as_str()), Some(2)),
        "the PCI-only line is named fully from the inventory"
    );
    let change = events.iter().find(|e| is_inventory(e, "change", &host_boot)).unwrap();
    let d = inventory(change).unwrap();
    assert_eq!((d.gpus.len(), d.expected, change.healthy), (3, Some(4), false));
    assert!(d.gpus.iter().all(|g| g.index != Some(2)));
    let lost = events.iter().find(|e| lost(e)).unwrap();
    assert_eq!(lost.entity.gpu_uuid.as_deref(), Some(simulated_uuid(&node, 2).as_str()), "NVML reports the GPU lost");

    // The other GPUs beat on; GPU 2 is silent until the reboot.
    tokio::time::sleep(Duration::from_secs(3)).await;
    let (code, answer) = inject(synthetic, r#"{"reboot": true}"#).await;
    assert_eq!(code, 200, "{answer}");
    let new_boot = answer["boot_id"].as_str().expect("the new boot id").to_owned();
    assert_ne!(new_boot, host_boot);
    let events = events_until(&node, "the new boot's inventory and GPU 2's heartbeat", |ev| {
        ev.iter().any(|e| is_inventory(e, "start", &new_boot)) && ev.iter().any(|e| is_heartbeat(e, 2, &new_boot))
    })
    .await;
    let after_change = events.iter().position(|e| e.event_id == change.event_id).unwrap();
    let first_new = events.iter().position(|e| e.boot_id.as_deref() == Some(new_boot.as_str())).unwrap();
    let between = &events[after_change..first_new];
    assert!(
        !between.iter().any(|e| e.kind == Kind::MonitorHealth && e.entity.gpu_index == Some(2)),
        "GPU 2 was silent"
    );
    let others = between.iter().filter(|e| e.kind == Kind::MonitorHealth && e.healthy).count();
    assert!(others >= 3, "the other GPUs beat on ({others} heartbeats)");
    let start = events.iter().find(|e| is_inventory(e, "start", &new_boot)).unwrap();
    let d = inventory(start).unwrap();
    assert_eq!((d.gpus.len(), d.expected, start.healthy), (4, Some(4), true));
    let inv_at = events.iter().position(|e| e.event_id == start.event_id).unwrap();
    let beat_at = events.iter().position(|e| is_heartbeat(e, 2, &new_boot)).unwrap();
    assert!(inv_at < beat_at, "the complete inventory comes before the lost GPU's heartbeat");
    // Every event carries a boot id, and after the first of the new boot none of the old.
    for (i, e) in events.iter().enumerate() {
        let want = if i < first_new { [host_boot.as_str(), new_boot.as_str()] } else { [new_boot.as_str(); 2] };
        assert!(e.boot_id.as_deref().is_some_and(|b| want.contains(&b)), "{:?} {:?}", e.kind, e.boot_id);
    }

    // Plain injected events are stamped too.
    let (code, answer) = inject(synthetic, r#"{"healthy": true}"#).await;
    assert_eq!(code, 200, "{answer}");
    let id = answer["event_ids"][0].as_str().unwrap().to_owned();
    let events = events_until(&node, "the injected event", |ev| ev.iter().any(|e| e.event_id.to_string() == id)).await;
    let injected = events.iter().find(|e| e.event_id.to_string() == id).unwrap();
    assert_eq!(injected.boot_id.as_deref(), Some(new_boot.as_str()));

    // A restart of the collector keeps the simulated node in its new boot (its start inventory
    // is in the new boot, not back in the file's).
    collector.terminate(Duration::from_secs(15)).await.expect("stops");
    let mut collector = env.start().await;
    events_until(&node, "the restarted collector's inventory", |ev| {
        ev.iter().filter(|e| is_inventory(e, "start", &new_boot)).count() == 2
    })
    .await;
    collector.terminate(Duration::from_secs(15)).await.expect("stops");
    std::fs::remove_dir_all(&state).ok();
}

#[test]
fn a_missing_boot_id_file_stops_the_start_with_the_problem_listed() {
    let stderr = common::refused(&["--boot-id-file", "/nonexistent/boot_id"]);
    assert!(stderr.contains("--boot-id-file") && stderr.contains("/nonexistent/boot_id"), "{stderr}");
}
