//! Against the testbed's Kafka: an event Kafka refuses for good (over the topic's
//! `max.message.bytes`) does not block the spool's head: it is removed, the events behind it are
//! published and the spool drains, also when it was sent together with a good event.

use std::time::Duration;

use gpumedic_collector::publisher::{Outcome, Publisher, PublisherSettings};
use gpumedic_collector::spool::{Spool, SpoolRecord};
use gpumedic_runtime::kafka::{KafkaSettings, TopicSpec};
use gpumedic_schemas::health::Detail;
use gpumedic_testkit as testkit;
use tokio_util::sync::CancellationToken;

/// Bytes no compression shrinks, so the broker sees their real size.
fn incompressible(len: usize) -> String {
    const ALPHABET: &[u8] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789";
    let mut state = 0x9E37_79B9_7F4A_7C15u64;
    (0..len)
        .map(|_| {
            // xorshift64: enough disorder that lz4 finds nothing to shrink.
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            char::from(ALPHABET[(state % ALPHABET.len() as u64) as usize])
        })
        .collect()
}

#[tokio::test]
async fn an_event_kafka_refuses_leaves_the_spool_head_and_the_rest_drain() {
    let bootstrap = testkit::require_kafka().await.unwrap_or_else(|e| panic!("{e}"));
    let kafka = KafkaSettings { bootstrap, options: Vec::new(), schema_registry: None, topic_replication: None };
    let topic = testkit::unique_name("spool-refused");
    kafka.ensure_topics(&[TopicSpec::new(&topic, 1).with_config("max.message.bytes", "4096")]).await.expect("topic");
    let dir = std::env::temp_dir().join(testkit::unique_name("spool-refused"));
    let spool_dir = dir.join("spool");

    // Three events waiting in the spool from an earlier outage; the middle one is too large.
    let record = |id: &str, len: usize| SpoolRecord {
        key: "node-a".into(),
        id: id.into(),
        kind: "xid".into(),
        droppable: false,
        value: incompressible(len).into_bytes(),
    };
    {
        let mut spool = Spool::open(&spool_dir, 16 << 20).expect("spool");
        for r in [record("first", 100), record("too-large", 20_000), record("behind", 100)] {
            spool.append(&r).expect("appended");
        }
        spool.sync().expect("synced");
    }

    let producer = kafka.producer("spool-refused-test").expect("producer");
    let (publisher, sink) = Publisher::open(
        PublisherSettings { kafka, topic: topic.clone(), spool_dir: spool_dir.clone(), spool_max_bytes: 16 << 20 },
        producer,
        std::sync::Arc::new(gpumedic_schemas::Codec::embedded()),
        gpumedic_collector::identity::NodeIdentity::new("spool-refused-boot"),
    )
    .expect("publisher");
    let token = CancellationToken::new();
    let task = tokio::spawn(publisher.run(token.clone()));

    let behind = testkit::wait_for_event(&topic, "behind", Duration::from_secs(60))
        .await
        .unwrap_or_else(|e| panic!("the event behind the refused one was never published: {e}"));
    assert_eq!(behind.offset, 1, "published after 'first', the refused one in between left no record");

    // Handed over directly, an event that large is refused by the broker after it left: it is
    // spooled, sent alone, refused alone and removed; the event behind it is published.
    let big = || {
        let mut event = gpumedic_collector::synthetic::xid79_event("node-a", "0000:17:00.0");
        if let Detail::Xid(x) = &mut event.detail {
            x.text = incompressible(20_000);
        }
        event
    };
    let small = gpumedic_collector::synthetic::xid79_event("node-a", "0000:17:00.0");
    let wanted = small.event_id.to_string();
    let (big, small) = (big(), small);
    let outcomes = tokio::join!(sink.emit(&big), sink.emit(&small));
    assert!(outcomes.0.is_ok() && outcomes.1.is_ok(), "{outcomes:?}");
    testkit::wait_for_event(&topic, &wanted, Duration::from_secs(60))
        .await
        .unwrap_or_else(|e| panic!("the event sent with the refused one was never published: {e}"));

    // Its first copy can reach Kafka from a send the publisher then discards (a request refused
    // as a whole is rewound and its events sent again one at a time), so being seen is not being
    // out of the spool. The publisher sends an event directly only when its spool is empty: a
    // probe acknowledged as published says the spool drained.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    loop {
        let probe = gpumedic_collector::synthetic::xid79_event("node-a", "0000:17:00.0");
        match sink.emit(&probe).await.expect("probe handed over") {
            Outcome::Published => break,
            other => assert!(
                tokio::time::Instant::now() < deadline,
                "the spool never drained: a probe was still {other:?} after 60 s"
            ),
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }

    token.cancel();
    task.await.expect("joins").expect("publisher stops cleanly");
    let spool = Spool::open(&spool_dir, 16 << 20).expect("spool reopens");
    assert!(spool.is_empty(), "the spool drained: {} records left", spool.len());
    std::fs::remove_dir_all(&dir).ok();
}
