//! Records as handlers see them ([`Record`]), how a handler fails ([`HandleError`]), the headers
//! every record carries, and the trace context they continue.

use std::future::Future;

use rdkafka::message::Headers as _;

use gpumedic_schemas::Codec;

use crate::BoxError;
use crate::events::MetricLabel;
use crate::fault::{self, Labeled};

/// One consumed record, owned, as handlers see it.
#[derive(Debug, Clone)]
pub struct Record {
    /// Its topic.
    pub topic: String,
    /// Its partition.
    pub partition: i32,
    /// Its offset.
    pub offset: i64,
    /// Its key (the node name on every gpumedic topic).
    pub key: Option<Vec<u8>>,
    /// Its value.
    pub payload: Option<Vec<u8>>,
    /// Its headers in order.
    pub headers: Vec<(String, Vec<u8>)>,
    /// Its timestamp in milliseconds since the epoch, when it has one.
    pub timestamp_ms: Option<i64>,
}

impl Record {
    /// The value of the first header named `name`.
    pub fn header(&self, name: &str) -> Option<&[u8]> {
        self.headers.iter().find(|(n, _)| n == name).map(|(_, v)| v.as_slice())
    }

    /// Copies a consumed message.
    pub fn from_message<M: rdkafka::Message>(m: &M) -> Self {
        let headers = m
            .headers()
            .map(|h| h.iter().map(|h| (h.key.to_owned(), h.value.map(<[u8]>::to_vec).unwrap_or_default())).collect())
            .unwrap_or_default();
        Record {
            topic: m.topic().to_owned(),
            partition: m.partition(),
            offset: m.offset(),
            key: m.key().map(<[u8]>::to_vec),
            payload: m.payload().map(<[u8]>::to_vec),
            headers,
            timestamp_ms: m.timestamp().to_millis(),
        }
    }
}

/// How a handler failed.
#[derive(Debug, thiserror::Error)]
pub enum HandleError {
    /// The record can never be processed (undecodable, invalid): it goes to the dead-letter topic
    /// with this reason, and the consumer moves on.
    #[error("invalid record: {0}")]
    Invalid(String),
    /// A dependency failed (database down, topic unavailable): the record is retried with backoff
    /// and its offset is not stored until it succeeds.
    #[error("transient failure: {0}")]
    Retry(#[source] BoxError),
}

impl HandleError {
    /// A transient failure counted under the error's own kind ([`MetricLabel`]).
    pub fn retry<E: MetricLabel + std::error::Error + Send + Sync + 'static>(error: E) -> Self {
        Self::Retry(Box::new(Labeled::new(error)))
    }
}

impl MetricLabel for HandleError {
    /// `invalid` for a record that is dead-lettered at once; for a retried failure, its kind
    /// ([`fault::metric_label`]).
    fn metric_label(&self) -> &'static str {
        match self {
            Self::Invalid(_) => "invalid",
            Self::Retry(e) => fault::metric_label(e.as_ref()),
        }
    }
}

/// Processes one record. Must be idempotent: after a crash the same record may come again.
pub trait RecordHandler: Send {
    /// Makes the record's effect durable, or says why it could not.
    fn handle(&mut self, record: &Record) -> impl Future<Output = Result<(), HandleError>> + Send;
}

/// Decodes a record's payload with `codec` for a [`RecordHandler`]: a bad record is
/// [`HandleError::Invalid`] (dead-lettered with the reason), an unreachable schema registry is
/// [`HandleError::Retry`] (the record is probably fine).
pub async fn decode_payload<T: gpumedic_schemas::Record>(codec: &Codec, record: &Record) -> Result<T, HandleError> {
    let payload = record.payload.as_deref().ok_or_else(|| HandleError::Invalid("empty record".into()))?;
    codec.decode(payload).await.map_err(|e| {
        if e.is_transient() {
            HandleError::Retry(Box::new(e))
        } else {
            HandleError::Invalid(format!("{}: {e}", e.reason()))
        }
    })
}

/// Header names every gpumedic record carries (see docs/events.md).
pub mod record_headers {
    /// W3C trace context.
    pub const TRACEPARENT: &str = "traceparent";
    /// The record's id as text (event id, or verdict id).
    pub const EVENT_ID: &str = "gpumedic.event-id";
    /// The record's media type.
    pub const CONTENT_TYPE: &str = "content-type";
    /// On a raw health record: the producing collector's projected ServiceAccount token (audience
    /// `gpumedic`), bound to its Pod and so to its node. The enricher verifies it against the
    /// record's node (docs/security.md).
    pub const NODE_TOKEN: &str = "gpumedic.node-token";
    /// On a raw health record instead of the token: the key id of the collector's token, published
    /// once per rotation in the node-token directory ([`crate::kafka::node_proof`]).
    pub const NODE_KEY_ID: &str = "gpumedic.node-key-id";
    /// With [`NODE_KEY_ID`]: the HMAC-SHA256 of the record's key and value under the key derived
    /// from that token ([`crate::kafka::node_proof::NodeKey::sign`]).
    pub const NODE_SIGNATURE: &str = "gpumedic.node-signature";
}

/// The OpenTelemetry context a `traceparent` header carries, if it is a valid one.
fn parent_context(traceparent: Option<&[u8]>) -> Option<opentelemetry::Context> {
    use opentelemetry::propagation::TextMapPropagator as _;
    use opentelemetry::trace::TraceContextExt as _;

    let tp = std::str::from_utf8(traceparent?).ok()?;
    let carrier = std::collections::HashMap::from([("traceparent".to_owned(), tp.to_owned())]);
    let cx = opentelemetry_sdk::propagation::TraceContextPropagator::new().extract(&carrier);
    cx.span().span_context().is_valid().then_some(cx)
}

/// A span for handling `record`, a child of the trace its `traceparent` header carries, so one
/// fault is one trace across the services (when tracing export is on; otherwise a plain span).
pub fn record_span(service: &'static str, record: &Record) -> tracing::Span {
    use tracing_opentelemetry::OpenTelemetrySpanExt as _;

    let span = tracing::info_span!("handle_record", service, topic = %record.topic, partition = record.partition,
        offset = record.offset);
    if let Some(cx) = parent_context(record.header(record_headers::TRACEPARENT)) {
        let _ = span.set_parent(cx);
    }
    span
}

/// The `traceparent` for a record produced now. With tracing export on, it names a new `publish`
/// span: a child of the record being handled (`incoming`) when there is one, else of the current
/// span, so each service adds its span to the fault's trace. With export off, the incoming trace
/// is continued with a new span id, or a new trace is started. Every record thus carries one, and
/// one fault keeps one trace id.
pub fn traceparent(incoming: Option<&[u8]>) -> String {
    use opentelemetry::propagation::TextMapPropagator as _;
    use opentelemetry::trace::TraceContextExt as _;
    use tracing_opentelemetry::OpenTelemetrySpanExt as _;

    let span = tracing::info_span!("publish");
    if let Some(cx) = parent_context(incoming) {
        let _ = span.set_parent(cx);
    }
    let cx = span.context();
    if cx.span().span_context().is_valid() {
        let mut carrier = std::collections::HashMap::new();
        opentelemetry_sdk::propagation::TraceContextPropagator::new().inject_context(&cx, &mut carrier);
        if let Some(tp) = carrier.remove("traceparent") {
            return tp;
        }
    }
    // Ids from a thread-local generator: a UUID per record cost a getrandom system call each
    // (docs/profiles.md). Zero is not a valid id.
    let span_id = fastrand::u64(1..);
    let trace_id = incoming
        .and_then(|v| std::str::from_utf8(v).ok())
        .and_then(|tp| {
            let mut parts = tp.split('-');
            let trace_id = parts.nth(1)?;
            (parts.count() == 2 && trace_id.len() == 32 && trace_id.bytes().all(|b| b.is_ascii_hexdigit()))
                .then(|| trace_id.to_owned())
        })
        .unwrap_or_else(|| format!("{:032x}", fastrand::u128(1..)));
    format!("00-{trace_id}-{span_id:016x}-01")
}
