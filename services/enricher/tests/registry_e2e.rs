//! The enricher with a schema registry (the testbed's Apicurio, Confluent-compatible API): it
//! reads a raw event written with the registry's schema id, writes the enriched event with the
//! registry's id for its own schema, and dead-letters a record whose id the registry does not
//! know.

mod common;

use std::time::Duration;

use gpumedic_runtime::kafka::{dlq_headers, publish};
use gpumedic_schemas::framing::split_frame;
use gpumedic_schemas::{Codec, EnrichedHealthEvent, HealthEvent, RegistryOptions, topics};
use gpumedic_testkit as testkit;

#[tokio::test]
async fn registry_ids_are_read_and_written_and_unknown_ids_are_dead_lettered() {
    let settings = common::shared_topics().await;
    testkit::require_kubernetes().await.unwrap_or_else(|e| panic!("{e}"));
    let registry = testkit::require_schema_registry().await.unwrap_or_else(|e| panic!("{e}"));
    // The same subjects the services use, so the same ids.
    let codec = Codec::with_registry(&registry, RegistryOptions::default()).await.expect("registry codec");

    // Only this test's records: older ones on the shared topic were written without a registry,
    // and their embedded ids mean nothing to it.
    let mut enricher = common::shared_topic_enricher(
        &settings,
        "enricher-registry",
        &[("GPUMEDIC_SCHEMA_REGISTRY_URL", registry.clone())],
    )
    .await;

    let node = testkit::unique_name("reg-node");
    let event = testkit::event(&node).xid(79).text("GPU has fallen off the bus.").build();
    let payload = codec.encode(&event).unwrap();
    assert_eq!(split_frame(&payload).unwrap().0, codec.writer_id::<HealthEvent>(), "written with the registry's id");
    let producer = settings.producer("enricher-registry-test").unwrap();
    publish(&producer, topics::HEALTH_RAW, &node, &payload, &[]).await.unwrap();
    // An id no schema has in the registry.
    let unknown_key = format!("{node}-unknown-id");
    let mut unknown = vec![0u8];
    unknown.extend_from_slice(&0x7fff_fff0u32.to_be_bytes());
    unknown.extend_from_slice(b"body");
    publish(&producer, topics::HEALTH_RAW, &unknown_key, &unknown, &[]).await.unwrap();

    let out = testkit::wait_for_record(
        topics::HEALTH_ENRICHED,
        |r| r.key.as_deref() == Some(node.as_bytes()),
        Duration::from_secs(60),
    )
    .await
    .unwrap_or_else(|e| panic!("{e}"));
    let bytes = out.payload.as_deref().unwrap();
    assert_eq!(split_frame(bytes).unwrap().0, codec.writer_id::<EnrichedHealthEvent>());
    let enriched: EnrichedHealthEvent = codec.decode(bytes).await.expect("decodes through the registry");
    assert_eq!(enriched.event, event);
    assert_eq!(enriched.xid_catalog.as_ref().map(|c| c.name.as_str()), Some("GPU has fallen off the bus"));

    let dead = common::shared_dead_letter(&unknown_key).await;
    let reason = String::from_utf8_lossy(dead.header(dlq_headers::REASON).unwrap()).into_owned();
    assert!(reason.starts_with("unknown_schema_id"), "{reason}");
    let status = enricher.terminate(Duration::from_secs(20)).await.unwrap_or_else(|e| panic!("{e}"));
    assert!(status.success());
}
