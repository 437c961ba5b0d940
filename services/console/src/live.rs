//! Live verdicts: every replica reads the verdict topic in a consumer group of its own, committed
//! at the end of the topic before it joins (so it shows what happens from its start, and no
//! verdict published after it is ready is missed), and hands each verdict to the open pages as a
//! Server-Sent Event. Nothing is stored and no offset matters beyond the replica's life: a
//! restarted replica starts at the end again, and the page's tables come from PostgreSQL.

use std::convert::Infallible;
use std::sync::Arc;
use std::time::Duration;

use axum::response::sse::{Event, KeepAlive, Sse};
use chrono::{DateTime, Utc};
use futures::Stream;
use gpumedic_runtime::admin::ReadyFlag;
use gpumedic_runtime::kafka::{KafkaError, KafkaSettings, Record};
use gpumedic_schemas::verdict::Verdict;
use rdkafka::Message as _;
use rdkafka::consumer::Consumer as _;
use serde::{Deserialize, Serialize};
use tokio::sync::broadcast;
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

use crate::events::{InternalEvent as _, LiveVerdictUndecodable, names};

/// How many verdicts a slow page may fall behind before it skips some (it is told, and reloads).
pub const CHANNEL_CAPACITY: usize = 1024;

/// A verdict as pages receive it (`event: verdict`, this as JSON in `data`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct LiveVerdict {
    /// Its id.
    pub verdict_id: Uuid,
    /// Its incident.
    pub incident_id: Uuid,
    /// The node.
    pub node: String,
    /// The rule.
    pub rule_id: String,
    /// `info`, `warning` or `critical`.
    pub severity: String,
    /// The recommended action.
    pub action: String,
    /// A recovery verdict.
    pub recovery: bool,
    /// Why.
    pub reason: String,
    /// When it was issued.
    pub issued_at: DateTime<Utc>,
}

fn snake(v: impl Serialize) -> String {
    serde_json::to_value(v).ok().and_then(|v| v.as_str().map(str::to_owned)).unwrap_or_else(|| "unknown".into())
}

impl From<&Verdict> for LiveVerdict {
    fn from(v: &Verdict) -> Self {
        LiveVerdict {
            verdict_id: v.verdict_id,
            incident_id: v.incident_id,
            node: v.node.clone(),
            rule_id: v.rule_id.clone(),
            severity: snake(v.severity),
            action: v.custom_action.clone().unwrap_or_else(|| snake(v.action)),
            recovery: v.recovery,
            reason: v.reason.clone(),
            issued_at: v.issued_at,
        }
    }
}

/// The hub pages subscribe to.
#[derive(Clone)]
pub struct Live {
    sender: broadcast::Sender<Arc<LiveVerdict>>,
}

impl Default for Live {
    fn default() -> Self {
        Live { sender: broadcast::channel(CHANNEL_CAPACITY).0 }
    }
}

impl Live {
    /// Hands `verdict` to every open page.
    pub fn publish(&self, verdict: LiveVerdict) {
        metrics::counter!(names::LIVE_VERDICTS_TOTAL).increment(1);
        // No page open is not an error.
        let _ = self.sender.send(Arc::new(verdict));
    }

    /// The Server-Sent Events of one page: `verdict` events, only those of `node` when given,
    /// and `lagged` when the page fell behind and missed some. The stream holds nothing but its
    /// receiver: it is dropped, and counted out, as soon as the page goes.
    pub fn events(&self, node: Option<String>) -> Sse<impl Stream<Item = Result<Event, Infallible>> + use<>> {
        let page = Page { rx: self.sender.subscribe(), node, _clients: Clients::enter(), opened: false };
        let stream = futures::stream::unfold(page, |mut page| async move {
            if !page.opened {
                // A first comment, so a client sees the stream open before any verdict.
                page.opened = true;
                return Some((Ok(Event::default().comment("connected")), page));
            }
            loop {
                match page.rx.recv().await {
                    Ok(v) if page.node.as_ref().is_none_or(|n| *n == v.node) => {
                        if let Ok(e) = Event::default().event("verdict").json_data(&*v) {
                            return Some((Ok(e), page));
                        }
                    }
                    Ok(_) => {}
                    Err(broadcast::error::RecvError::Lagged(n)) => {
                        return Some((Ok(Event::default().event("lagged").data(n.to_string())), page));
                    }
                    Err(broadcast::error::RecvError::Closed) => return None,
                }
            }
        });
        Sse::new(stream).keep_alive(KeepAlive::new().interval(Duration::from_secs(15)))
    }
}

/// One open page's stream.
struct Page {
    rx: broadcast::Receiver<Arc<LiveVerdict>>,
    node: Option<String>,
    _clients: Clients,
    opened: bool,
}

/// Counts open event streams in `gpumedic_console_live_clients`.
struct Clients;

impl Clients {
    fn enter() -> Clients {
        metrics::gauge!(names::LIVE_CLIENTS).increment(1.0);
        Clients
    }
}

impl Drop for Clients {
    fn drop(&mut self) {
        metrics::gauge!(names::LIVE_CLIENTS).decrement(1.0);
    }
}

/// Reads `topic` in a new group named `group` from its current end, handing each verdict to
/// `live`, until `token` is cancelled. `assigned` turns ready once the group has its partitions.
pub async fn run(
    settings: KafkaSettings,
    group: String,
    topic: String,
    live: Live,
    assigned: ReadyFlag,
    token: CancellationToken,
) -> Result<(), KafkaError> {
    // The console creates no topic (its Kafka principal may only read): a topic that does not
    // exist yet is read from its beginning once the classifier creates it.
    settings.start_group_at_end(&group, &[topic.as_str()]).await?;
    let codec = settings.codec().await?;
    let consumer = settings.consumer(crate::NAME, &group, &[topic.as_str()], assigned)?;
    tracing::info!(%group, %topic, "Reading verdicts for the live view from the end of the topic.");
    loop {
        let message = tokio::select! {
            () = token.cancelled() => break,
            m = consumer.recv() => m,
        };
        let message = match message {
            Ok(m) => m,
            Err(e) => {
                tracing::warn!(error = %e, "Cannot read the verdict topic; retrying.");
                tokio::time::sleep(Duration::from_secs(1)).await;
                continue;
            }
        };
        let record = Record::from_message(&message);
        let Some(payload) = message.payload() else { continue };
        match codec.decode::<Verdict>(payload).await {
            Ok(v) => live.publish(LiveVerdict::from(&v)),
            Err(e) => {
                LiveVerdictUndecodable { error: &e, partition: record.partition, offset: record.offset }.emit();
            }
        }
    }
    consumer.unsubscribe();
    Ok(())
}

#[cfg(test)]
mod tests {
    use gpumedic_schemas::health::Entity;
    use gpumedic_schemas::verdict::{RecommendedAction, Severity};

    use super::*;

    #[test]
    fn a_verdict_reads_as_pages_show_it() {
        let v = Verdict {
            verdict_id: Uuid::new_v4(),
            incident_id: Uuid::new_v4(),
            node: "gpu-1".into(),
            entity: Entity::default(),
            severity: Severity::Critical,
            rule_id: "xid-79-fallen-off-the-bus".into(),
            rule_version: 1,
            action: RecommendedAction::Cordon,
            custom_action: None,
            reason: "GPU fell off the bus".into(),
            evidence: vec![],
            issued_at: Utc::now(),
            recovery: false,
            not_before: None,
            deferrable: false,
            workload: None,
        };
        let l = LiveVerdict::from(&v);
        assert_eq!((l.severity.as_str(), l.action.as_str()), ("critical", "cordon"));
    }

    #[tokio::test]
    async fn a_page_hears_every_verdict_published_after_it_opened() {
        let live = Live::default();
        let mut rx = live.sender.subscribe();
        let v = LiveVerdict {
            verdict_id: Uuid::new_v4(),
            incident_id: Uuid::new_v4(),
            node: "n".into(),
            rule_id: "r".into(),
            severity: "info".into(),
            action: "none".into(),
            recovery: true,
            reason: "ok".into(),
            issued_at: Utc::now(),
        };
        live.publish(v.clone());
        assert_eq!(*rx.recv().await.unwrap(), v);
    }
}
