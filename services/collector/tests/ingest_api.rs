//! The gRPC ingest API over a real unix socket, with the generated tonic client, publishing to a
//! unique topic on the testbed's Kafka through the collector's own publisher: batches and
//! streams are published with the collector's node; malformed requests, other nodes and
//! oversized messages are refused with the documented status codes.

use std::path::{Path, PathBuf};
use std::time::Duration;

use gpumedic_collector::ingest::{self, IngestSettings};
use gpumedic_collector::publisher::{Publisher, PublisherSettings};
use gpumedic_proto::ingest::v1 as pb;
use gpumedic_runtime::kafka::KafkaSettings;
use gpumedic_schemas::HealthEvent;
use gpumedic_schemas::health::Source;
use gpumedic_testkit as testkit;
use pb::health_event_ingest_client::HealthEventIngestClient;
use tokio_util::sync::CancellationToken;
use tonic::transport::Channel;

/// The boot id the in-process collector stamps on every event.
const BOOT_ID: &str = "7d9c1e2a-ingest-test-boot";

/// A publisher and an ingest server in this process, on a unique topic and socket.
struct Collector {
    node: String,
    topic: String,
    state: PathBuf,
    socket: PathBuf,
    token: CancellationToken,
}

impl Collector {
    async fn start(max_message_bytes: usize) -> Self {
        let bootstrap = testkit::require_kafka().await.unwrap_or_else(|e| panic!("{e}"));
        let node = testkit::unique_name("ingest-node");
        let topic = testkit::unique_name("ingest-test");
        let state = std::env::temp_dir().join(testkit::unique_name("collector-ingest"));
        let socket = state.join("ingest.sock");
        let kafka = KafkaSettings { bootstrap, options: Vec::new(), schema_registry: None, topic_replication: None };
        let producer = kafka.producer("ingest-test").expect("producer");
        let (publisher, sink) = Publisher::open(
            PublisherSettings {
                kafka,
                topic: topic.clone(),
                spool_dir: state.join("spool"),
                spool_max_bytes: 16 << 20,
            },
            producer,
            std::sync::Arc::new(gpumedic_schemas::Codec::embedded()),
            gpumedic_collector::identity::NodeIdentity::new(BOOT_ID),
        )
        .expect("spool opens");
        let token = CancellationToken::new();
        tokio::spawn(publisher.run(token.clone()));
        let settings = IngestSettings { socket: socket.clone(), node: node.clone(), max_message_bytes };
        tokio::spawn(ingest::serve(settings, sink, token.clone()));
        for _ in 0..100 {
            if socket.exists() {
                break;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        Self { node, topic, state, socket, token }
    }

    async fn client(&self) -> HealthEventIngestClient<Channel> {
        client(&self.socket).await
    }

    /// The events on the topic, read from the start until `n` arrived. A reader may start
    /// before its metadata knows the new topic ("unknown topic"): it then starts again.
    async fn events(&self, n: usize) -> Vec<HealthEvent> {
        let mut last = String::new();
        for _ in 0..10 {
            let mut got = Vec::new();
            let read = testkit::wait_for_record(
                &self.topic,
                |r| {
                    got.push(
                        gpumedic_schemas::decode::<HealthEvent>(r.payload.as_deref().unwrap_or_default())
                            .expect("decodes"),
                    );
                    got.len() >= n
                },
                Duration::from_secs(60),
            )
            .await;
            match read {
                Ok(_) => return got,
                Err(e) => last = e,
            }
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
        panic!("cannot read {n} events from {}: {last}", self.topic)
    }
}

impl Drop for Collector {
    fn drop(&mut self) {
        self.token.cancel();
        std::fs::remove_dir_all(&self.state).ok();
    }
}

async fn client(socket: &Path) -> HealthEventIngestClient<Channel> {
    let socket = socket.to_owned();
    // The URI is required by the API but unused: every connection goes to the socket.
    let channel = tonic::transport::Endpoint::from_static("http://collector.invalid")
        .connect_with_connector(tower::service_fn(move |_: http::Uri| {
            let socket = socket.clone();
            async move {
                Ok::<_, std::io::Error>(hyper_util::rt::TokioIo::new(tokio::net::UnixStream::connect(socket).await?))
            }
        }))
        .await
        .expect("connects to the ingest socket");
    HealthEventIngestClient::new(channel)
}

fn xid(code: i32) -> pb::IngestEvent {
    pb::IngestEvent {
        component: pb::Component::Gpu as i32,
        kind: pb::Kind::Xid as i32,
        entity: Some(pb::Entity { gpu_index: Some(0), ..Default::default() }),
        detail: Some(pb::ingest_event::Detail::Xid(pb::XidDetail {
            code,
            text: "ingest test".into(),
            ..Default::default()
        })),
        client_version: "ingest-test/1".into(),
        ..Default::default()
    }
}

fn stream_of(events: Vec<pb::IngestEvent>) -> impl tokio_stream::Stream<Item = pb::PublishStreamRequest> {
    tokio_stream::iter(events.into_iter().map(|e| pb::PublishStreamRequest { event: Some(e) }))
}

#[tokio::test]
async fn batches_and_streams_are_published_for_the_collectors_node() {
    let collector = Collector::start(4 << 20).await;
    let mut client = collector.client().await;

    let caller_id = uuid::Uuid::now_v7().to_string();
    let mut own_node = xid(79);
    own_node.event_id = caller_id.clone();
    own_node.node = collector.node.clone();
    let mut malformed = xid(13);
    malformed.entity = Some(pb::Entity { gpu_index: Some(-1), ..Default::default() });
    let batch = client
        .publish_batch(pb::PublishBatchRequest { events: vec![own_node, xid(48), malformed] })
        .await
        .expect("the batch is accepted")
        .into_inner();
    assert_eq!((batch.published, batch.rejected), (2, 1), "{batch:?}");
    assert_eq!(batch.results[0].event_id, caller_id, "the caller's id is kept");
    assert_eq!(batch.results[2].code, tonic::Code::InvalidArgument as i32);
    assert_eq!(batch.results[2].field, "entity.gpu_index");
    assert!(batch.results[2].message.contains("negative"), "{:?}", batch.results[2]);

    let stream = client.publish_stream(stream_of(vec![xid(31), xid(43), xid(45)])).await.expect("stream").into_inner();
    assert_eq!((stream.published, stream.rejected), (3, 0), "{stream:?}");

    let published: Vec<String> =
        batch.results.iter().chain(&stream.results).filter(|r| r.code == 0).map(|r| r.event_id.clone()).collect();
    let events = collector.events(5).await;
    let ids: Vec<String> = events.iter().map(|e| e.event_id.to_string()).collect();
    assert_eq!(ids, published, "every published event arrives, in order");
    for e in &events {
        assert_eq!(e.node, collector.node, "the collector stamps its own node");
        assert_eq!(e.source, Source::Ingest);
        assert_eq!(e.collector_version, "ingest-test/1");
        assert_eq!(e.boot_id.as_deref(), Some(BOOT_ID), "the collector stamps its node's boot id");
    }
}

#[tokio::test]
async fn malformed_requests_and_other_nodes_are_refused_clearly() {
    let collector = Collector::start(64 * 1024).await;
    let mut client = collector.client().await;

    let too_many = client
        .publish_batch(pb::PublishBatchRequest { events: vec![pb::IngestEvent::default(); 1001] })
        .await
        .expect_err("over the batch limit");
    assert_eq!(too_many.code(), tonic::Code::InvalidArgument);
    assert!(too_many.message().contains("at most 1000"), "{too_many:?}");

    let empty = client
        .publish_stream(tokio_stream::iter([pb::PublishStreamRequest { event: None }]))
        .await
        .expect_err("a stream message without an event");
    assert_eq!(empty.code(), tonic::Code::InvalidArgument);
    assert!(empty.message().contains("events[0]: event"), "{empty:?}");

    // A valid event before one for another node: nothing of the batch is published.
    let before = uuid::Uuid::now_v7().to_string();
    let mut valid = xid(79);
    valid.event_id = before.clone();
    let mut other = xid(79);
    other.node = "some-other-node".into();
    let denied =
        client.publish_batch(pb::PublishBatchRequest { events: vec![valid, other] }).await.expect_err("another node");
    assert_eq!(denied.code(), tonic::Code::PermissionDenied);
    assert!(denied.message().contains("events[1]") && denied.message().contains("some-other-node"), "{denied:?}");

    let oversized = pb::PublishBatchRequest {
        events: (0..100).map(|_| pb::IngestEvent { raw: Some("x".repeat(1024)), ..xid(79) }).collect(),
    };
    let too_big = client.publish_batch(oversized).await.expect_err("over the message limit");
    assert_eq!(too_big.code(), tonic::Code::ResourceExhausted, "{too_big:?}");

    // Afterwards a good batch goes through, and is the first record on the topic: the refused
    // batch left nothing behind.
    let after = client.publish_batch(pb::PublishBatchRequest { events: vec![xid(48)] }).await.expect("ok").into_inner();
    let events = collector.events(1).await;
    assert_eq!(events[0].event_id.to_string(), after.results[0].event_id);
    assert_ne!(events[0].event_id.to_string(), before);
}

#[tokio::test]
async fn a_live_socket_is_not_taken_over_and_a_stale_one_is_replaced() {
    let collector = Collector::start(4 << 20).await;
    let err = ingest::claim_socket(&collector.socket).expect_err("in use");
    assert!(matches!(err, ingest::ClaimError::InUse(_)), "{err}");
    let mode = std::os::unix::fs::PermissionsExt::mode(&std::fs::metadata(&collector.socket).unwrap().permissions());
    assert_eq!(mode & 0o777, 0o660);

    let stale = collector.state.join("stale.sock");
    drop(std::os::unix::net::UnixListener::bind(&stale).unwrap());
    assert!(stale.exists(), "a socket file without a listener");
    ingest::claim_socket(&stale).expect("a stale socket is replaced");
}
