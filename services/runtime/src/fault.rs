//! Which failures are about the record being handled and which are about a dependency.
//!
//! A consumer loop retries a failed handler with backoff, which is right while Postgres, Kafka or
//! the apiserver is away: the record is fine and will go through once they are back. It is wrong
//! for a record the dependency refuses every time (a record over the broker's size limit, a text
//! field with a NUL byte that Postgres does not store): retrying it forever stalls its partition.
//! [`is_permanent`] tells the two apart from the error's source chain, so the loops can give such
//! a record to the dead-letter topic after a bounded number of attempts instead
//! (`docs/runtime.md`). Anything not known to be permanent counts as transient: an outage must
//! never dead-letter good records.

use rdkafka::error::{KafkaError as RdKafkaError, RDKafkaErrorCode};

use crate::BoxError;
use crate::events::MetricLabel;

/// Wraps an error a handler knows is caused by the records it was given, not by a dependency:
/// the same records fail the same way every time. The consumer loops treat it as permanent
/// ([`is_permanent`]) and, after a bounded number of attempts, find the records at fault and
/// dead-letter them with this error as the reason.
#[derive(Debug, thiserror::Error)]
#[error(transparent)]
pub struct RecordFault(pub BoxError);

impl RecordFault {
    /// Marks `error` as caused by the records being handled.
    pub fn new(error: impl Into<BoxError>) -> Self {
        Self(error.into())
    }
}

/// An error carrying its own kind for the failure counters ([`MetricLabel`]), so the consumer
/// loops count a handler's typed failure under its kind (`handler_retries_total{kind}`) although
/// they see it boxed. It shows and chains exactly as the error it wraps.
#[derive(Debug)]
pub struct Labeled {
    kind: &'static str,
    error: BoxError,
}

impl Labeled {
    /// Wraps `error`, keeping its [`MetricLabel::metric_label`].
    pub fn new<E: MetricLabel + std::error::Error + Send + Sync + 'static>(error: E) -> Self {
        Self { kind: error.metric_label(), error: Box::new(error) }
    }
}

impl std::fmt::Display for Labeled {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.error.fmt(f)
    }
}

impl std::error::Error for Labeled {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        self.error.source()
    }
}

/// The kinds [`metric_label`] gives errors it knows by their type; a [`Labeled`] error gives its own.
pub const KINDS: [&str; 5] = ["record", "kafka", "postgres", "kubernetes", "other"];

/// The kind `error` is counted under: its own when it is [`Labeled`], else the first error of its
/// source chain the runtime knows (a [`RecordFault`], Kafka, PostgreSQL, the Kubernetes API), else
/// `other`.
pub fn metric_label(error: &(dyn std::error::Error + 'static)) -> &'static str {
    let mut next = Some(error);
    while let Some(e) = next {
        if let Some(l) = e.downcast_ref::<Labeled>() {
            return l.kind;
        }
        if e.is::<RecordFault>() {
            return "record";
        }
        if e.is::<RdKafkaError>() {
            return "kafka";
        }
        #[cfg(feature = "postgres")]
        if e.is::<sqlx::Error>() {
            return "postgres";
        }
        #[cfg(feature = "k8s")]
        if e.is::<kube::Error>() {
            return "kubernetes";
        }
        next = e.source();
    }
    "other"
}

/// Whether Kafka refuses a produced record for good: retrying it cannot succeed (it is too large
/// for the broker or topic, malformed, or the producer may not write the topic). Timeouts, a
/// missing leader, an unknown topic (it may be created soon) and broker outages are transient.
pub fn is_permanent_produce_error(code: RDKafkaErrorCode) -> bool {
    use RDKafkaErrorCode as C;
    matches!(
        code,
        C::MessageSizeTooLarge
            | C::InvalidMessageSize
            | C::MessageBatchTooLarge
            | C::InvalidRecord
            | C::InvalidTimestamp
            | C::InvalidTopic
            | C::InvalidRequiredAcks
            | C::UnsupportedForMessageFormat
            | C::UnsupportedCompressionType
            | C::PolicyViolation
            | C::TopicAuthorizationFailed
            | C::ClusterAuthorizationFailed
            | C::BadMessage
            | C::InvalidArgument
    )
}

/// Whether a PostgreSQL error (by its SQLSTATE) is about the data sent: a data exception (class
/// 22: a NUL byte in text, a value out of range), an integrity constraint violation (23), or a
/// program limit exceeded (54: a row too large for an index). Connection loss, timeouts,
/// serialization failures, and errors in the statement itself (42: a code or schema mismatch
/// would otherwise dead-letter every record) are not.
pub fn is_permanent_sqlstate(sqlstate: &str) -> bool {
    matches!(sqlstate.get(..2), Some("22" | "23" | "54"))
}

/// Whether `error`, or any error in its source chain, is known to be permanent: a
/// [`RecordFault`], a produce error Kafka does not retry ([`is_permanent_produce_error`]), or a
/// PostgreSQL error about the data sent ([`is_permanent_sqlstate`]). Everything else is
/// transient.
pub fn is_permanent(error: &(dyn std::error::Error + 'static)) -> bool {
    let mut next = Some(error);
    while let Some(e) = next {
        if e.is::<RecordFault>() {
            return true;
        }
        if let Some(l) = e.downcast_ref::<Labeled>() {
            next = Some(l.error.as_ref());
            continue;
        }
        if let Some(k) = e.downcast_ref::<RdKafkaError>() {
            if let RdKafkaError::MessageProduction(code) = k {
                return is_permanent_produce_error(*code);
            }
            return false;
        }
        #[cfg(feature = "postgres")]
        if let Some(s) = e.downcast_ref::<sqlx::Error>() {
            return match s {
                sqlx::Error::Database(db) => db.code().is_some_and(|c| is_permanent_sqlstate(&c)),
                sqlx::Error::Encode(_) => true,
                _ => false,
            };
        }
        next = e.source();
    }
    false
}

/// `error` and its sources, joined with ": ", for a dead-letter reason or a log line.
pub fn error_chain(error: &(dyn std::error::Error + 'static)) -> String {
    let mut text = error.to_string();
    let mut next = error.source();
    while let Some(e) = next {
        let more = e.to_string();
        // thiserror's `{0}` messages often repeat their source's text already.
        if !text.contains(&more) {
            text.push_str(": ");
            text.push_str(&more);
        }
        next = e.source();
    }
    text
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kafka::KafkaError;

    #[test]
    fn size_and_authorization_refusals_are_permanent_outages_are_not() {
        let produce = |code| KafkaError::Produce { topic: "t".into(), source: RdKafkaError::MessageProduction(code) };
        for code in [
            RDKafkaErrorCode::MessageSizeTooLarge,
            RDKafkaErrorCode::InvalidRecord,
            RDKafkaErrorCode::MessageBatchTooLarge,
            RDKafkaErrorCode::TopicAuthorizationFailed,
        ] {
            assert!(is_permanent(&produce(code)), "{code:?}");
        }
        for code in [
            RDKafkaErrorCode::MessageTimedOut,
            RDKafkaErrorCode::AllBrokersDown,
            RDKafkaErrorCode::UnknownTopicOrPartition,
            RDKafkaErrorCode::NotLeaderForPartition,
            RDKafkaErrorCode::QueueFull,
        ] {
            assert!(!is_permanent(&produce(code)), "{code:?}");
        }
        assert!(!is_permanent(&KafkaError::Commit(RdKafkaError::Canceled)));
    }

    #[test]
    fn a_record_fault_is_permanent_wherever_it_is_in_the_chain() {
        #[derive(Debug, thiserror::Error)]
        #[error("cannot write the batch")]
        struct Outer(#[source] RecordFault);
        let fault = RecordFault::new("a NUL byte in the message");
        assert!(is_permanent(&fault));
        assert!(is_permanent(&Outer(RecordFault::new("bad"))));
        let plain: BoxError = "the database is down".into();
        assert!(!is_permanent(plain.as_ref()));
        #[cfg(feature = "postgres")]
        assert!(!is_permanent(&sqlx::Error::PoolTimedOut));
    }

    #[test]
    fn failures_are_counted_by_the_kind_they_name_or_the_dependency_in_their_chain() {
        #[derive(Debug, thiserror::Error)]
        #[error("node n changed under every attempt")]
        struct Conflict(#[source] RecordFault);
        impl MetricLabel for Conflict {
            fn metric_label(&self) -> &'static str {
                "conflict"
            }
        }
        let labeled = Labeled::new(Conflict(RecordFault::new("bad")));
        assert_eq!(metric_label(&labeled), "conflict");
        assert_eq!(labeled.to_string(), "node n changed under every attempt", "shown as the error it wraps");
        assert!(is_permanent(&labeled), "what it wraps still decides whether it is permanent");
        assert_eq!(metric_label(&KafkaError::Commit(RdKafkaError::Canceled)), "kafka");
        assert_eq!(metric_label(&RecordFault::new("bad")), "record");
        let plain: BoxError = "the database is down".into();
        assert_eq!(metric_label(plain.as_ref()), "other");
        #[cfg(feature = "postgres")]
        assert_eq!(metric_label(&sqlx::Error::PoolTimedOut), "postgres");
    }

    #[test]
    fn sqlstates_about_data_are_permanent() {
        assert!(is_permanent_sqlstate("22021"), "character not in repertoire (a NUL byte)");
        assert!(is_permanent_sqlstate("23505"), "unique violation");
        assert!(is_permanent_sqlstate("54000"), "program limit exceeded");
        assert!(!is_permanent_sqlstate("57014"), "statement timeout");
        assert!(!is_permanent_sqlstate("40001"), "serialization failure");
        assert!(!is_permanent_sqlstate("42P01"), "undefined table: the code, not the record");
        assert!(!is_permanent_sqlstate("08006"), "connection failure");
        assert!(!is_permanent_sqlstate(""));
    }

    #[test]
    fn the_chain_names_every_cause_once() {
        let e = KafkaError::Produce {
            topic: "t".into(),
            source: RdKafkaError::MessageProduction(RDKafkaErrorCode::MessageSizeTooLarge),
        };
        let text = error_chain(&e);
        assert!(text.starts_with("cannot produce to 't': "), "{text}");
        assert_eq!(text.matches("Message production error").count(), 1, "{text}");
    }
}
