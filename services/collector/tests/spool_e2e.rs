//! The spool against a real broker that really goes away: a private Kafka broker
//! (compose/kafka-private, never the shared testbed broker) is down while the collector runs,
//! stops (SIGTERM) and crashes (SIGKILL) with events spooled; then the broker starts and every
//! event reaches the topic exactly once, in order.
//!
//! Exactly once here is about this run: the producer is idempotent and a segment is deleted only
//! after all its records are acknowledged, so nothing is sent twice unless the collector dies
//! between Kafka's acknowledgement and the segment's deletion (see publisher.rs); consumers
//! deduplicate on the event id for that case. The one exception the test allows: events made
//! while the broker is going away under a running collector. A send the broker took but never
//! acknowledged times out, is spooled and sent again, and the restarted broker cannot know the
//! copy (the idempotent producer's sequence does not survive the timeout): those arrive at least
//! once, and in order.

mod common;

use std::collections::HashMap;
use std::path::PathBuf;
use std::time::Duration;

use common::{CollectorEnv, inject_ids};
use gpumedic_runtime::kafka::record_headers;
use gpumedic_schemas::topics;
use gpumedic_testkit as testkit;
use rdkafka::consumer::{Consumer as _, StreamConsumer};

const SCRIPT: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../../compose/kafka-private");

/// A Kafka broker of this test's own, started and stopped by compose/kafka-private.
struct PrivateKafka {
    dir: PathBuf,
    port: u16,
    controller_port: u16,
}

impl PrivateKafka {
    fn new() -> Self {
        let port = testkit::free_local_addr().expect("a free port").port();
        let mut controller_port = testkit::free_local_addr().expect("a free port").port();
        while controller_port == port {
            controller_port = testkit::free_local_addr().expect("a free port").port();
        }
        Self { dir: std::env::temp_dir().join(testkit::unique_name("kafka-private")), port, controller_port }
    }

    fn bootstrap(&self) -> String {
        format!("127.0.0.1:{}", self.port)
    }

    fn script(&self, args: &[String]) {
        let out = std::process::Command::new(SCRIPT).args(args).output().expect("compose/kafka-private runs");
        assert!(
            out.status.success(),
            "compose/kafka-private {args:?} failed: {}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }

    fn start(&self) {
        self.script(&[
            "start".into(),
            self.dir.display().to_string(),
            self.port.to_string(),
            self.controller_port.to_string(),
        ]);
    }

    fn stop(&self) {
        self.script(&["stop".into(), self.dir.display().to_string()]);
    }
}

impl Drop for PrivateKafka {
    fn drop(&mut self) {
        let _ = std::process::Command::new(SCRIPT).args(["stop", &self.dir.display().to_string()]).status();
        std::fs::remove_dir_all(&self.dir).ok();
    }
}

/// Every record on the raw topic of `bootstrap`, as (event id, partition, offset), read until all
/// of `want` arrived and then a few quiet seconds more (to catch late copies).
async fn read_all(bootstrap: &str, want: &[String]) -> Vec<(String, i32, i64)> {
    let consumer: StreamConsumer = rdkafka::ClientConfig::new()
        .set("bootstrap.servers", bootstrap)
        .set("group.id", testkit::unique_name("spool-reader"))
        .set("auto.offset.reset", "earliest")
        .set("enable.auto.commit", "false")
        .set("topic.metadata.refresh.interval.ms", "1000")
        .create()
        .expect("consumer");
    consumer.subscribe(&[topics::HEALTH_RAW]).expect("subscribe");
    let mut seen = Vec::new();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(180);
    let mut complete_at: Option<tokio::time::Instant> = None;
    loop {
        let now = tokio::time::Instant::now();
        if complete_at.is_some_and(|t| now >= t) {
            return seen;
        }
        assert!(
            now < deadline,
            "not every injected event arrived within 180 s: {} records seen, missing {:?}",
            seen.len(),
            want.iter().filter(|w| !seen.iter().any(|(id, _, _)| id == *w)).collect::<Vec<_>>()
        );
        let Ok(message) = tokio::time::timeout(Duration::from_millis(500), consumer.recv()).await else { continue };
        // The topic may appear only after the reader subscribed: errors until then are expected.
        let Ok(message) = message else { continue };
        let record = gpumedic_runtime::kafka::Record::from_message(&message);
        let id = String::from_utf8_lossy(record.header(record_headers::EVENT_ID).unwrap_or_default()).into_owned();
        seen.push((id, record.partition, record.offset));
        if complete_at.is_none() && want.iter().all(|w| seen.iter().any(|(id, _, _)| id == w)) {
            complete_at = Some(tokio::time::Instant::now() + Duration::from_secs(5));
        }
    }
}

#[tokio::test]
async fn spooled_events_survive_sigterm_and_sigkill_and_arrive_exactly_once() {
    let kafka = PrivateKafka::new();
    let node = testkit::unique_name("spool-node");
    let state = std::env::temp_dir().join(testkit::unique_name("collector-spool"));
    let synthetic = testkit::free_local_addr().expect("a free port");
    let env = CollectorEnv::new(kafka.bootstrap(), &node, &state)
        .simulated(2)
        .set("GPUMEDIC_SAMPLE_INTERVAL", "200ms")
        .set("GPUMEDIC_HEARTBEAT_INTERVAL", "1s")
        .set("GPUMEDIC_SYNTHETIC_ADDR", synthetic.to_string())
        .set("GPUMEDIC_DELIVERY_TIMEOUT", "3s")
        .set("GPUMEDIC_SHUTDOWN_DEADLINE", "15s");

    // 1. Kafka is down (never started yet): events go to the spool; SIGTERM.
    let mut collector = env.start().await;
    let mut injected = inject_ids(synthetic, r#"{"xid": 79, "count": 5}"#).await;
    tokio::time::sleep(Duration::from_secs(1)).await;
    let status = collector.terminate(Duration::from_secs(30)).await.unwrap_or_else(|e| panic!("{e}"));
    assert!(status.success(), "the collector exits cleanly with Kafka down: {status}");
    assert!(state.join("spool").read_dir().unwrap().any(|e| e.unwrap().path().extension().is_some_and(|x| x == "seg")));

    // 2. Restarted, still no Kafka: more events, then SIGKILL (a crash).
    let collector = env.start().await;
    injected.extend(inject_ids(synthetic, r#"{"gpu_lost": true, "gpu_index": 1, "count": 3}"#).await);
    tokio::time::sleep(Duration::from_millis(500)).await;
    drop(collector); // SIGKILL

    // 3. Restarted again; Kafka comes up; everything drains.
    let mut collector = env.start().await;
    injected.extend(inject_ids(synthetic, r#"{"xid": 48}"#).await);
    kafka.start();
    // Kafka goes away again for a moment while the collector runs, and comes back.
    tokio::time::sleep(Duration::from_secs(2)).await;
    kafka.stop();
    let during_the_flap = inject_ids(synthetic, r#"{"xid": 94, "count": 2}"#).await;
    injected.extend(during_the_flap.iter().cloned());
    kafka.start();

    let seen = read_all(&kafka.bootstrap(), &injected).await;
    let mut copies: HashMap<&str, usize> = HashMap::new();
    for (id, _, _) in &seen {
        *copies.entry(id.as_str()).or_default() += 1;
    }
    let duplicated: Vec<_> =
        copies.iter().filter(|(id, n)| **n > 1 && !during_the_flap.iter().any(|f| f == *id)).collect();
    assert!(duplicated.is_empty(), "events spooled across SIGTERM and SIGKILL arrived more than once: {duplicated:?}");
    for id in &injected {
        let n = copies.get(id.as_str()).copied().unwrap_or(0);
        if during_the_flap.contains(id) {
            assert!(n >= 1, "{id} arrives");
        } else {
            assert_eq!(n, 1, "{id} arrives exactly once");
        }
    }
    // One node, one key, one partition: the injected events keep the order they were made in
    // (a copy of a flap event repeats it in place, so the order is read without repeats).
    let mut order: Vec<&String> = seen.iter().filter(|(id, _, _)| injected.contains(id)).map(|(id, _, _)| id).collect();
    order.dedup();
    assert_eq!(order, injected.iter().collect::<Vec<_>>(), "spool order is kept");
    assert!(seen.len() > injected.len(), "the sampler's heartbeats were spooled too");

    collector.terminate(Duration::from_secs(30)).await.unwrap_or_else(|e| panic!("{e}"));
    std::fs::remove_dir_all(&state).ok();
}
