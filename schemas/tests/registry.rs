//! The codec against a real schema registry: the testbed's Apicurio Registry (Confluent-compatible
//! API), started by `compose/up`. Needs `--features registry`.
//!
//! Each test registers this build's schemas under subjects of its own (a unique subject prefix),
//! so tests run in parallel and on a registry that other runs have used.

mod common;

use std::net::SocketAddr;
use std::time::Duration;

use apache_avro::Schema;
use apache_avro::reader::datum::GenericDatumReader;
use apache_avro::types::Value;
use apache_avro::writer::datum::GenericDatumWriter;
use gpumedic_schemas::framing::{self, DecodeError};
use gpumedic_schemas::health::{Detail, Kind, Source};
use gpumedic_schemas::registry::{RegistryClient, RegistryError};
use gpumedic_schemas::{
    ActionOutcome, Codec, DecodeFailure, EnrichedHealthEvent, HealthEvent, Record, RegistryOptions, RegistryStartError,
    Verdict, avro,
};
use tokio::net::{TcpListener, TcpStream};
use tokio::task::JoinSet;

const HEALTH_EVENT_V3: &str = include_str!("fixtures/health_event_v3.avsc");

/// The registry's Confluent-compatible URL: `SCHEMA_REGISTRY_URL`, or the testbed's default.
fn registry_url() -> String {
    std::env::var("SCHEMA_REGISTRY_URL").unwrap_or_else(|_| "http://127.0.0.1:18081/apis/ccompat/v7".to_owned())
}

/// Fails the test, saying how to start the testbed, when the registry does not answer.
async fn require_schema_registry() -> String {
    let url = registry_url();
    let client = RegistryClient::new(&url, Duration::from_secs(5)).expect("HTTP client");
    if let Err(e) = client.subjects().await {
        panic!(
            "the schema registry is not reachable at {url}: {e}; start the testbed with `compose/up` (or `just testbed-up`) from the repository root"
        );
    }
    url
}

fn unique_prefix() -> String {
    format!("test-{}.", &uuid::Uuid::new_v4().simple().to_string()[..12])
}

async fn codec(url: &str) -> Codec {
    let options = RegistryOptions { subject_prefix: unique_prefix(), ..RegistryOptions::default() };
    Codec::with_registry(url, options).await.expect("codec starts against the testbed registry")
}

fn id_of(payload: &[u8]) -> u32 {
    framing::split_frame(payload).expect("framed").0
}

fn v3() -> (Schema, String) {
    let mut texts = avro::self_contained_json(&[HEALTH_EVENT_V3]).expect("fixture parses");
    let text = texts.remove(0);
    (Schema::parse_str(&text).expect("fixture parses alone"), text)
}

fn field_mut<'a>(record: &'a mut Value, name: &str) -> &'a mut Value {
    let Value::Record(fields) = record else { panic!("not a record") };
    &mut fields.iter_mut().find(|(field, _)| field == name).unwrap_or_else(|| panic!("no field {name}")).1
}

/// `event` as a v3 writer (the next version, a fixture) would write it (unframed), with the
/// v3-only parts set.
fn written_by_v3(event: &HealthEvent, v3: &Schema) -> Vec<u8> {
    let body = &framing::encode(event).unwrap()[5..];
    let mut value = GenericDatumReader::builder(avro::health_event())
        .reader_schema(v3)
        .build()
        .unwrap()
        .read_value(&mut &body[..])
        .unwrap();
    *field_mut(&mut value, "sequence") = Value::Union(1, Box::new(Value::Long(7)));
    *field_mut(&mut value, "source") = Value::Enum(7, "bmc".into());
    GenericDatumWriter::builder(v3).build().unwrap().write_value_to_vec(value).expect("valid v3 datum")
}

fn frame(id: u32, body: &[u8]) -> Vec<u8> {
    let mut payload = vec![framing::MAGIC_BYTE];
    payload.extend_from_slice(&id.to_be_bytes());
    payload.extend_from_slice(body);
    payload
}

#[tokio::test]
async fn registration_returns_ids_and_encode_writes_them() {
    let url = require_schema_registry().await;
    let codec = codec(&url).await;
    let ids = [
        codec.writer_id::<HealthEvent>(),
        codec.writer_id::<EnrichedHealthEvent>(),
        codec.writer_id::<Verdict>(),
        codec.writer_id::<ActionOutcome>(),
    ];
    let mut distinct = ids.to_vec();
    distinct.dedup();
    assert_eq!(distinct.len(), 4, "four schemas, four ids: {ids:?}");

    let event = common::health_event(common::all_details().remove(0));
    assert_eq!(id_of(&codec.encode(&event).unwrap()), ids[0]);
    assert_eq!(id_of(&codec.encode(&common::verdict()).unwrap()), ids[2]);

    // The registry stores exactly this build's schema under the id the codec writes.
    let client = RegistryClient::new(&url, Duration::from_secs(5)).unwrap();
    for (id, ours) in
        ids.iter().zip([avro::health_event(), avro::enriched_health_event(), avro::verdict(), avro::action_outcome()])
    {
        let registered = client.schema_by_id(*id).await.unwrap();
        assert_eq!(registered.schema_type, "AVRO");
        assert_eq!(&Schema::parse_str(&registered.schema).unwrap(), ours);
    }

    // Registering again (a second replica starting) gets the same ids.
    let again = Codec::with_registry(&url, RegistryOptions::default()).await.unwrap();
    assert_eq!(again.writer_id::<HealthEvent>(), ids[0]);
}

#[tokio::test]
async fn the_v1_schemas_are_earlier_versions_of_the_same_subjects_and_stay_readable() {
    let url = require_schema_registry().await;
    let prefix = unique_prefix();
    let options = RegistryOptions { subject_prefix: prefix.clone(), ..RegistryOptions::default() };
    let codec = Codec::with_registry(&url, options).await.unwrap();
    let client = RegistryClient::new(&url, Duration::from_secs(5)).unwrap();
    let v1_texts = avro::self_contained_json(&avro::V1_AVSC).unwrap();

    // The codec registered v1 under the record's subject before v2: registering it again returns
    // its id, another than the one the codec writes.
    let subject = format!("{prefix}{}-value", Verdict::TOPIC);
    let v1_id = client.register(&subject, &v1_texts[2]).await.unwrap();
    assert_ne!(v1_id, codec.writer_id::<Verdict>());
    let registered = client.schema_by_id(v1_id).await.unwrap();
    assert_eq!(&Schema::parse_str(&registered.schema).unwrap(), &avro::v1()[2]);

    // A record a v1 producer wrote under that id decodes into this build's type, new fields at
    // their defaults.
    let verdict = common::verdict();
    let v1_value = GenericDatumReader::builder(avro::verdict())
        .reader_schema(&avro::v1()[2])
        .build()
        .unwrap()
        .read_value(&mut &framing::encode(&verdict).unwrap()[5..])
        .unwrap();
    let body = GenericDatumWriter::builder(&avro::v1()[2]).build().unwrap().write_value_to_vec(v1_value).unwrap();
    let read: Verdict = codec.decode(&frame(v1_id, &body)).await.unwrap();
    assert_eq!(read, Verdict { not_before: None, deferrable: false, workload: None, ..verdict });
}

#[tokio::test]
async fn all_four_records_round_trip_through_registry_ids() {
    let url = require_schema_registry().await;
    let codec = codec(&url).await;
    for detail in common::all_details() {
        let event = common::health_event(detail);
        let bytes = codec.encode(&event).unwrap();
        assert_eq!(codec.decode::<HealthEvent>(&bytes).await.unwrap(), event);
    }
    let enriched = common::enriched(common::all_details().remove(1));
    let bytes = codec.encode(&enriched).unwrap();
    assert_eq!(codec.decode::<EnrichedHealthEvent>(&bytes).await.unwrap(), enriched);
    let verdict = common::verdict();
    let bytes = codec.encode(&verdict).unwrap();
    assert_eq!(codec.decode::<Verdict>(&bytes).await.unwrap(), verdict);
    let action = common::action_outcome();
    let bytes = codec.encode(&action).unwrap();
    assert_eq!(codec.decode::<ActionOutcome>(&bytes).await.unwrap(), action);

    // A record read as another type is a bad record, named by its registry id.
    let err = codec.decode::<Verdict>(&bytes).await.unwrap_err();
    assert!(
        matches!(&err, DecodeFailure::Invalid(DecodeError::WrongRecordType { id, .. }) if *id == codec.writer_id::<ActionOutcome>()),
        "{err:?}"
    );
    assert!(!err.is_transient());
}

#[tokio::test]
async fn a_record_written_with_v3_decodes_into_this_builds_types() {
    let url = require_schema_registry().await;
    let codec = codec(&url).await;
    let (v3, v3_text) = v3();
    let client = RegistryClient::new(&url, Duration::from_secs(5)).unwrap();
    let v3_id = client.register(&format!("{}v3-writer-value", unique_prefix()), &v3_text).await.unwrap();
    assert_ne!(v3_id, codec.writer_id::<HealthEvent>());

    let event = common::health_event(common::all_details().remove(3));
    let payload = frame(v3_id, &written_by_v3(&event, &v3));
    let read: HealthEvent = codec.decode(&payload).await.unwrap();
    // The symbol this build lacks falls back to the enum default; the rest is as written.
    assert_eq!(read.source, Source::Unknown);
    assert_eq!(read, HealthEvent { source: Source::Unknown, ..event });
}

#[tokio::test]
async fn a_record_of_this_build_decodes_with_a_v3_reader() {
    let url = require_schema_registry().await;
    let codec = codec(&url).await;
    let (v3, _) = v3();
    let event = common::health_event(common::all_details().remove(3));
    let payload = codec.encode(&event).unwrap();

    let mut value = codec.decode_value(&payload, &v3).await.unwrap();
    assert!(value.validate(&v3));
    assert_eq!(
        field_mut(&mut value, "sequence"),
        &Value::Union(0, Box::new(Value::Null)),
        "new field takes its default"
    );
    assert_eq!(field_mut(&mut value, "kind"), &Value::Enum(4, "ecc".into()));
    assert_eq!(field_mut(&mut value, "node"), &Value::String(event.node.clone()));
    assert_eq!(event.kind, Kind::Ecc);
    let detail = field_mut(&mut value, "detail");
    assert_eq!(field_mut(detail, "fabric_manager"), &Value::Union(0, Box::new(Value::Null)));
    assert!(matches!(event.detail, Detail::Ecc(_)));
}

#[tokio::test]
async fn an_id_the_registry_does_not_know_is_a_bad_record() {
    let url = require_schema_registry().await;
    let codec = codec(&url).await;
    let unknown = 2_000_000_000;
    let err = codec.decode::<HealthEvent>(&frame(unknown, &[0, 1, 2])).await.unwrap_err();
    assert!(matches!(err, DecodeFailure::Invalid(DecodeError::UnknownSchemaId(id)) if id == unknown), "{err:?}");
    assert_eq!(err.reason(), "unknown_schema_id");
    assert!(!err.is_transient());

    let client = RegistryClient::new(&url, Duration::from_secs(5)).unwrap();
    let err = client.schema_by_id(unknown).await.unwrap_err();
    assert!(matches!(err, RegistryError::NotFound { .. }), "{err:?}");
}

#[tokio::test]
async fn a_schema_the_registry_refuses_is_rejected_not_unavailable() {
    let url = require_schema_registry().await;
    let client = RegistryClient::new(&url, Duration::from_secs(5)).unwrap();
    let err =
        client.register(&format!("{}broken-value", unique_prefix()), "{\"type\": \"nonsense\"}").await.unwrap_err();
    assert!(matches!(err, RegistryError::Rejected { .. }), "{err:?}");
}

#[tokio::test]
async fn a_registry_where_nothing_listens_fails_the_start_clearly() {
    let nowhere = format!("http://{}/apis/ccompat/v7", free_local_addr());
    let options = RegistryOptions { request_timeout: Duration::from_secs(2), ..RegistryOptions::default() };
    let err = Codec::with_registry(&nowhere, options).await.unwrap_err();
    let RegistryStartError::Register { source: RegistryError::Unavailable { .. }, .. } = &err else {
        panic!("expected an unavailable registry, got {err:?}");
    };
    let message = err.to_string();
    assert!(message.contains("is unavailable") && message.contains(&nowhere), "{message}");
}

#[tokio::test]
async fn an_unreachable_registry_is_transient_and_a_cached_id_needs_no_registry() {
    let url = require_schema_registry().await;
    // The codec talks to the real registry through a forwarder this test can cut.
    let upstream: SocketAddr = url
        .trim_start_matches("http://")
        .split('/')
        .next()
        .and_then(|authority| authority.parse().ok())
        .expect("registry URL is http://<ip>:<port>/...");
    let path = url.trim_start_matches("http://").split_once('/').map(|(_, path)| path).unwrap_or_default();
    let forwarder = Forwarder::start(upstream).await;
    let via = format!("http://{}/{path}", forwarder.addr);
    let codec = codec(&via).await;

    // A v3 writer's id: not this build's, so the codec must fetch it once.
    let (v3, v3_text) = v3();
    let client = RegistryClient::new(&url, Duration::from_secs(5)).unwrap();
    let v3_id = client.register(&format!("{}v3-writer-value", unique_prefix()), &v3_text).await.unwrap();
    let event = common::health_event(common::all_details().remove(2));
    let v3_payload = frame(v3_id, &written_by_v3(&event, &v3));
    let own_payload = codec.encode(&event).unwrap();

    let before = codec.registry_requests();
    codec.decode::<HealthEvent>(&v3_payload).await.unwrap();
    assert_eq!(codec.registry_requests(), before + 1, "a new id is fetched once");
    codec.decode::<HealthEvent>(&v3_payload).await.unwrap();
    codec.decode::<HealthEvent>(&own_payload).await.unwrap();
    assert_eq!(codec.registry_requests(), before + 1, "known ids are not fetched again");

    forwarder.stop().await;
    // Known ids decode with the registry gone...
    assert_eq!(codec.decode::<HealthEvent>(&own_payload).await.unwrap(), event);
    codec.decode::<HealthEvent>(&v3_payload).await.unwrap();
    // ...and a new id is a transient failure, never a bad record.
    let (_, other_text) = v3_other();
    let other_id = client.register(&format!("{}other-value", unique_prefix()), &other_text).await.unwrap();
    let err = codec.decode::<HealthEvent>(&frame(other_id, &[])).await.unwrap_err();
    assert!(matches!(err, DecodeFailure::RegistryUnavailable { id, .. } if id == other_id), "{err:?}");
    assert!(err.is_transient());
    assert_eq!(err.reason(), "registry_unavailable");
}

/// Another schema the registry has not seen in this test: v3 with one more documented field.
fn v3_other() -> (Schema, String) {
    let text = HEALTH_EVENT_V3.replace("Per-collector sequence number.", &format!("Sequence {}.", unique_prefix()));
    let text = avro::self_contained_json(&[&text]).unwrap().remove(0);
    (Schema::parse_str(&text).unwrap(), text)
}

fn free_local_addr() -> SocketAddr {
    std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap()
}

/// A TCP forwarder to the registry that the test can stop: afterwards, connections to its
/// address are refused.
struct Forwarder {
    addr: SocketAddr,
    tasks: JoinSet<()>,
}

impl Forwarder {
    async fn start(upstream: SocketAddr) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let mut tasks = JoinSet::new();
        tasks.spawn(async move {
            let mut connections = JoinSet::new();
            while let Ok((mut inbound, _)) = listener.accept().await {
                connections.spawn(async move {
                    if let Ok(mut outbound) = TcpStream::connect(upstream).await {
                        let _ = tokio::io::copy_bidirectional(&mut inbound, &mut outbound).await;
                    }
                });
            }
        });
        Self { addr, tasks }
    }

    /// Stops listening and cuts every open connection (the accept task owns them all).
    async fn stop(mut self) {
        self.tasks.shutdown().await;
    }
}
