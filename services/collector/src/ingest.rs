//! The gRPC ingest server (`proto/`, docs/ingest.md): custom monitors on the node publish health
//! events through the collector, on a unix socket (`--ingest-socket`).
//!
//! Every event goes through [`gpumedic_proto::to_health_event`], which stamps the collector's own
//! node, and then through the same [`Sink`] as every other source, so it is spooled like them
//! while Kafka is down. A call is answered once each of its valid events is acknowledged by Kafka
//! or durable in the spool.
//!
//! Limits: a batch holds at most [`MAX_BATCH_EVENTS`] events (INVALID_ARGUMENT beyond), a stream
//! at most [`MAX_STREAM_EVENTS`] (RESOURCE_EXHAUSTED beyond), and a message at most
//! `--ingest-max-message-bytes` (RESOURCE_EXHAUSTED; tonic itself says OUT_OF_RANGE, which this
//! server rewrites to the code gRPC documents for a message over the limit).

use std::path::PathBuf;
use std::time::Duration;

use gpumedic_proto::convert::MAX_BATCH_EVENTS;
use gpumedic_proto::ingest::v1 as pb;
use gpumedic_proto::{IngestContext, IngestError};
use gpumedic_schemas::HealthEvent;
use pb::health_event_ingest_server::{HealthEventIngest, HealthEventIngestServer};
use tokio::sync::oneshot;
use tokio_util::sync::CancellationToken;
use tonic::{Request, Response, Status};

use crate::events::{IngestCallRefused, InternalEvent as _, names};
use crate::publisher::{Outcome, PublishError, Sink};
// The socket claim lives in its own module (the spool uses it as its lock); re-exported here,
// where callers have always found it.
pub use crate::socket_claim::{ClaimError, claim_socket};

/// Most events in one `PublishStream` call: its answer holds one result per event.
pub const MAX_STREAM_EVENTS: usize = 100_000;
/// How long a call waits for room in the publisher's channel before answering UNAVAILABLE.
const SUBMIT_TIMEOUT: Duration = Duration::from_secs(10);

/// What the ingest server needs.
#[derive(Debug, Clone)]
pub struct IngestSettings {
    /// The socket path.
    pub socket: PathBuf,
    /// The collector's node: the only node events may be about.
    pub node: String,
    /// Largest accepted message, in bytes.
    pub max_message_bytes: usize,
}

/// What stops the ingest server.
#[derive(Debug, thiserror::Error)]
pub enum IngestServerError {
    /// The socket could not be claimed.
    #[error(transparent)]
    Claim(#[from] ClaimError),
    /// The gRPC server failed.
    #[error("the ingest server failed: {0}")]
    Serve(#[from] tonic::transport::Error),
}

/// Serves the ingest API on the unix socket until `token` is cancelled; removes the socket then.
///
/// # Errors
/// [`IngestServerError`].
pub async fn serve(settings: IngestSettings, sink: Sink, token: CancellationToken) -> Result<(), IngestServerError> {
    let std_listener = claim_socket(&settings.socket)?;
    std_listener.set_nonblocking(true).map_err(|source| ClaimError::Io { path: settings.socket.clone(), source })?;
    let listener = tokio::net::UnixListener::from_std(std_listener)
        .map_err(|source| ClaimError::Io { path: settings.socket.clone(), source })?;
    tracing::info!(socket = %settings.socket.display(), node = %settings.node, "Serving the gRPC ingest API.");
    let service = HealthEventIngestServer::new(IngestService { node: settings.node.clone(), sink })
        .max_decoding_message_size(settings.max_message_bytes);
    let result = tonic::transport::Server::builder()
        .layer(tower::util::MapResponseLayer::new(oversize_is_resource_exhausted as fn(_) -> _))
        .add_service(service)
        .serve_with_incoming_shutdown(
            tokio_stream::wrappers::UnixListenerStream::new(listener),
            token.cancelled_owned(),
        )
        .await;
    let _ = std::fs::remove_file(&settings.socket);
    result.map_err(Into::into)
}

const OVERSIZE: &str = "message length too large";

/// tonic rejects a message over the limit with OUT_OF_RANGE before the handler runs; gRPC
/// documents RESOURCE_EXHAUSTED for that, and so does docs/ingest.md.
fn oversize_is_resource_exhausted(
    mut response: http::Response<tonic::body::Body>,
) -> http::Response<tonic::body::Body> {
    let headers = response.headers_mut();
    let out_of_range = headers.get("grpc-status").is_some_and(|v| v.as_bytes() == b"11");
    // grpc-message is percent-encoded (a space is %20).
    let oversize = headers
        .get("grpc-message")
        .and_then(|v| v.to_str().ok())
        .is_some_and(|m| m.replace("%20", " ").contains(OVERSIZE));
    if out_of_range && oversize {
        headers.insert("grpc-status", http::HeaderValue::from_static("8"));
    }
    response
}

fn map_stream_status(status: Status) -> Status {
    if status.code() == tonic::Code::OutOfRange && status.message().contains(OVERSIZE) {
        Status::resource_exhausted(status.message().to_owned())
    } else {
        status
    }
}

struct IngestService {
    node: String,
    sink: Sink,
}

/// An event handed to the publisher, waiting for its outcome.
enum Pending {
    Submitted { index: u32, event_id: uuid::Uuid, outcome: oneshot::Receiver<Outcome> },
    Rejected(pb::EventResult),
}

impl IngestService {
    fn context(&self) -> IngestContext<'_> {
        let now = chrono::Utc::now();
        // The wire carries microseconds.
        let now = chrono::DateTime::from_timestamp_micros(now.timestamp_micros()).unwrap_or(now);
        IngestContext { node: &self.node, now, collector_version: env!("CARGO_PKG_VERSION") }
    }

    async fn submit(&self, index: u32, event: HealthEvent) -> Result<Pending, Status> {
        let submitted = tokio::time::timeout(SUBMIT_TIMEOUT, self.sink.submit(&event)).await;
        match submitted {
            Ok(Ok(outcome)) => Ok(Pending::Submitted { index, event_id: event.event_id, outcome }),
            Ok(Err(PublishError::Closed)) => Err(Status::unavailable("the collector is shutting down; retry")),
            Ok(Err(e @ PublishError::Encode(_))) => Ok(Pending::Rejected(pb::EventResult::rejected(
                index,
                &event.event_id.to_string(),
                &IngestError::InvalidArgument { field: String::new(), reason: e.to_string() },
            ))),
            Err(_) => Err(Status::unavailable(
                "the collector cannot take events now (its spool is full of faults while Kafka is down); retry with backoff and the same event_ids",
            )),
        }
    }

    async fn answer(pending: Vec<Pending>) -> Result<Response<pb::PublishResponse>, Status> {
        let mut response = pb::PublishResponse::default();
        for p in pending {
            let result = match p {
                Pending::Rejected(r) => r,
                Pending::Submitted { index, event_id, outcome } => match outcome.await {
                    Ok(Outcome::Published | Outcome::Spooled) => pb::EventResult::published(index, event_id),
                    Ok(Outcome::Dropped) => pb::EventResult {
                        index,
                        event_id: event_id.to_string(),
                        code: tonic::Code::ResourceExhausted as i32,
                        field: String::new(),
                        message: "the collector's spool is full of faults; healthy evidence is dropped first".into(),
                    },
                    Ok(Outcome::Refused) => pb::EventResult {
                        index,
                        event_id: event_id.to_string(),
                        code: tonic::Code::InvalidArgument as i32,
                        field: String::new(),
                        message: "Kafka refuses this event for good (for example it is larger than the topic allows)"
                            .into(),
                    },
                    Err(_) => return Err(Status::unavailable("the collector is shutting down; retry")),
                },
            };
            if result.code == tonic::Code::Ok as i32 {
                response.published += 1;
            } else {
                response.rejected += 1;
            }
            response.results.push(result);
        }
        metrics::counter!(names::INGEST_EVENTS_TOTAL, "outcome" => "published")
            .increment(u64::from(response.published));
        metrics::counter!(names::INGEST_EVENTS_TOTAL, "outcome" => "rejected").increment(u64::from(response.rejected));
        Ok(Response::new(response))
    }
}

fn refuse(index: usize, error: &IngestError) -> Status {
    IngestCallRefused { index, error, code: format!("{:?}", error.code()) }.emit();
    error.to_status(index)
}

#[tonic::async_trait]
impl HealthEventIngest for IngestService {
    async fn publish_batch(
        &self,
        request: Request<pb::PublishBatchRequest>,
    ) -> Result<Response<pb::PublishResponse>, Status> {
        let events = request.into_inner().events;
        if events.len() > MAX_BATCH_EVENTS {
            return Err(Status::invalid_argument(format!(
                "events: {} events in one batch, at most {MAX_BATCH_EVENTS}; split the batch",
                events.len()
            )));
        }
        let context = self.context();
        // Everything is checked before anything is published: a refused batch publishes nothing.
        let mut checked = Vec::with_capacity(events.len());
        for (i, event) in events.into_iter().enumerate() {
            let caller_id = event.event_id.clone();
            match gpumedic_proto::to_health_event(event, &context) {
                Ok(e) => checked.push(Ok(e)),
                Err(e @ IngestError::NodeNotServed { .. }) => return Err(refuse(i, &e)),
                Err(e) => checked.push(Err(pb::EventResult::rejected(i as u32, &caller_id, &e))),
            }
        }
        let mut pending = Vec::with_capacity(checked.len());
        for (i, c) in checked.into_iter().enumerate() {
            pending.push(match c {
                Ok(event) => self.submit(i as u32, event).await?,
                Err(result) => Pending::Rejected(result),
            });
        }
        Self::answer(pending).await
    }

    async fn publish_stream(
        &self,
        request: Request<tonic::Streaming<pb::PublishStreamRequest>>,
    ) -> Result<Response<pb::PublishResponse>, Status> {
        let mut stream = request.into_inner();
        let mut pending = Vec::new();
        while let Some(message) = stream.message().await.map_err(map_stream_status)? {
            let i = pending.len();
            if i >= MAX_STREAM_EVENTS {
                return Err(Status::resource_exhausted(format!(
                    "more than {MAX_STREAM_EVENTS} events in one stream; close it and open another"
                )));
            }
            let Some(event) = message.event else {
                return Err(Status::invalid_argument(format!(
                    "events[{i}]: event: required: each stream message carries one event"
                )));
            };
            let caller_id = event.event_id.clone();
            // Events before a refused one are already on their way: they stay published.
            pending.push(match gpumedic_proto::to_health_event(event, &self.context()) {
                Ok(e) => self.submit(i as u32, e).await?,
                Err(e @ IngestError::NodeNotServed { .. }) => return Err(refuse(i, &e)),
                Err(e) => Pending::Rejected(pb::EventResult::rejected(i as u32, &caller_id, &e)),
            });
        }
        Self::answer(pending).await
    }
}
