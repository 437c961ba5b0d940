//! Unit tests of the Kafka rooms: settings, validation, partitioning, record sizes and names. They
//! need no server; the tests against the testbed's Kafka are an integration test
//! (`tests/kafka_rooms.rs`).

use super::batch::record_bytes;
use super::*;
use crate::config::Validate as _;

fn args(bootstrap: &str, options: &[&str]) -> KafkaArgs {
    KafkaArgs {
        kafka_bootstrap: bootstrap.to_owned(),
        kafka_options: options.iter().map(|s| (*s).to_owned()).collect(),
        schema_registry_url: None,
        topic_replication: None,
    }
}

#[test]
fn a_schema_registry_url_must_be_http() {
    let mut a = args("k:9092", &[]);
    a.schema_registry_url = Some("registry:8081".into());
    assert!(a.validate().unwrap_err().list().iter().any(|p| p.field == "--schema-registry-url"));
    let mut a = args("k:9092", &[]);
    a.schema_registry_url = Some("http://registry:8081".into());
    assert_eq!(a.validate().unwrap().schema_registry.as_deref(), Some("http://registry:8081"));
    let mut a = args("k:9092", &[]);
    a.schema_registry_url = Some(String::new());
    assert_eq!(a.validate().unwrap().schema_registry, None);
}

#[test]
fn settings_validate_bootstrap_and_options() {
    let ok = args("127.0.0.1:19092,kafka-1:9092", &["security.protocol=SSL"]).validate().expect("valid");
    assert_eq!(ok.options, vec![("security.protocol".to_owned(), "SSL".to_owned())]);
    let err = args("localhost", &["novalue", "=x"]).validate().expect_err("invalid");
    assert_eq!(err.list().len(), 3, "{:?}", err.list());
}

#[test]
fn traceparent_continues_the_incoming_trace() {
    let incoming = b"00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
    let tp = traceparent(Some(incoming));
    assert!(tp.starts_with("00-4bf92f3577b34da6a3ce929d0e0e4736-"), "{tp}");
    assert_ne!(tp.as_bytes(), incoming, "a new span id");
    let fresh = traceparent(None);
    assert_eq!(fresh.len(), 55, "{fresh}");
    assert_ne!(traceparent(Some(b"garbage")).split('-').nth(1), Some("garbage"));
}

#[test]
fn partition_for_is_the_crc32_of_the_key_modulo_the_count() {
    // CRC-32 reference values (zlib): "" -> 0, "123456789" -> 0xCBF43926.
    assert_eq!(partition_for(b"", 12), 0);
    assert_eq!(partition_for(b"123456789", i32::MAX), (0xCBF4_3926u32 % i32::MAX as u32) as i32);
    assert_eq!(partition_for(b"123456789", 12), (0xCBF4_3926u32 % 12) as i32);
    assert_eq!(partition_for(b"node", 0), 0, "no partitions: no panic");
}

#[test]
fn topic_replication_is_validated_and_kept_from_librdkafka() {
    let mut a = args("k:9092", &["acks=all"]);
    a.topic_replication = Some(3);
    let s = a.validate().expect("valid");
    assert_eq!(s.topic_replication(), Some(3));
    let c = s.client_config_with("t", &[]);
    assert!(c.config_map().keys().all(|k| !k.contains("replication")), "not a librdkafka property");
    assert_eq!(c.get("acks"), Some("all"));
    let mut a = args("k:9092", &[]);
    a.topic_replication = Some(0);
    assert!(a.validate().unwrap_err().list().iter().any(|p| p.field == "--topic-replication"));
    assert_eq!(args("k:9092", &[]).validate().unwrap().topic_replication(), None);
}

#[test]
fn replication_is_three_or_every_broker() {
    assert_eq!(replication_for(1, None), 1);
    assert_eq!(replication_for(2, None), 2);
    assert_eq!(replication_for(3, None), 3);
    assert_eq!(replication_for(9, None), 3);
    assert_eq!(replication_for(0, None), 1, "no metadata: at least one");
    assert_eq!(replication_for(9, Some(5)), 5);
}

#[test]
fn batch_limits_are_validated() {
    let ok = BatchLimitArgs { batch_max_bytes: DEFAULT_BATCH_MAX_BYTES, poison_attempts: 5 }.validate().unwrap();
    assert_eq!(ok, BatchLimits::default());
    let err = BatchLimitArgs { batch_max_bytes: 10, poison_attempts: 0 }.validate().unwrap_err();
    assert_eq!(err.list().len(), 2, "{:?}", err.list());
}

#[test]
fn a_record_counts_its_key_value_and_headers() {
    let r = Record {
        topic: "t".into(),
        partition: 0,
        offset: 0,
        key: Some(b"node".to_vec()),
        payload: Some(vec![0; 100]),
        headers: vec![("h".into(), b"vv".to_vec())],
        timestamp_ms: None,
    };
    assert_eq!(record_bytes(&r), 4 + 100 + 3);
}

#[test]
fn dead_letter_topic_is_suffixed() {
    assert_eq!(dead_letter_topic("gpumedic.health.raw.v1"), "gpumedic.health.raw.v1.dlq");
}
