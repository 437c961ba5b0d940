//! The node-token directory: every collector's current token, read from its topic
//! ([`topics::NODE_TOKENS`](gpumedic_schemas::topics::NODE_TOKENS)), so a raw record can carry a
//! key id and a signature instead of the token itself
//! ([`node_proof`](gpumedic_runtime::kafka::node_proof)).
//!
//! Each replica reads the whole topic from its start, with no consumer group (every replica
//! needs every node's token, whichever partitions of the raw topic it owns), and keeps the
//! tokens by key id. A directory entry proves nothing by itself: its token is reviewed like a
//! token in a header ([`crate::auth::Verifier`]), and a record signed with it is accepted only
//! if that review binds the token to the record's node.
//!
//! A collector publishes its token and waits for the acknowledgement before it signs with it,
//! so when a record names a key id this replica has not read yet, the entry is already in the
//! topic: [`Directory::catch_up`] reads up to the end as it was when asked, and a key id still
//! unknown then is refused. Entries leave when their token's `exp` passes, and the directory
//! holds at most `max_entries` (the oldest read go first): a collector that floods it with
//! tokens of its own can push out other nodes' entries, which costs their records a
//! dead-lettering until their collector publishes again (every [`REPUBLISH_EVERY`]), never an
//! acceptance.

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, PoisonError, RwLock, RwLockReadGuard};
use std::time::Duration;

use gpumedic_runtime::kafka::node_proof::{NodeKey, key_id};
use gpumedic_runtime::kafka::{KafkaSettings, Record, record_headers};
use rdkafka::consumer::{BaseConsumer, Consumer as _, StreamConsumer};
use rdkafka::{Message as _, Offset, TopicPartitionList};
use tokio_util::sync::CancellationToken;

use crate::auth::{Accepted, Refusal, Review, Reviewer, Verifier, unverified_expiry};
use crate::events::names;

/// How often a collector publishes its current token again, whether or not it rotated (the
/// directory topic keeps entries for two hours).
pub const REPUBLISH_EVERY: Duration = Duration::from_secs(600);

/// Why the directory cannot answer.
#[derive(Debug, thiserror::Error)]
pub enum DirectoryError {
    /// The directory's consumer could not be created or assigned.
    #[error("cannot read the node-token directory {topic}: {source}")]
    Consumer {
        /// The topic.
        topic: String,
        /// librdkafka's error.
        #[source]
        source: rdkafka::error::KafkaError,
    },
    /// The directory's topic could not be created (at start).
    #[error("cannot create the node-token directory {topic}: {reason}")]
    Topic {
        /// The topic.
        topic: String,
        /// Why.
        reason: String,
    },
    /// The topic's end could not be asked, or was not reached in time (transient: the batch
    /// waiting on it is retried).
    #[error("the node-token directory {topic} did not catch up: {reason}")]
    Behind {
        /// The topic.
        topic: String,
        /// Why.
        reason: String,
    },
}

/// One token of the directory.
#[derive(Debug, Clone)]
pub struct Known {
    /// The token, for its review.
    pub token: Arc<[u8]>,
    /// Its signing key.
    pub key: NodeKey,
    /// Its `exp` claim (unverified; used only to forget the entry).
    exp: i64,
}

#[derive(Default)]
struct Inner {
    by_id: HashMap<String, Arc<Known>>,
    /// Key ids in the order read, for eviction.
    order: VecDeque<String>,
    /// The next offset to read, per partition.
    next: HashMap<i32, i64>,
}

/// The tokens read so far; cheap to clone.
#[derive(Clone)]
pub struct Directory {
    topic: String,
    /// Written by the reading task, read by every batch: a read lock per look-up.
    inner: Arc<RwLock<Inner>>,
    /// For the topic's watermarks; `None` for a directory that reads no topic.
    watermarks: Option<Arc<BaseConsumer>>,
    max_entries: usize,
}

impl Directory {
    /// Starts reading `topic` from its start, in a task that runs until `cancel`.
    ///
    /// # Errors
    /// [`DirectoryError::Consumer`] when the consumers cannot be created or assigned.
    pub async fn start(
        settings: &KafkaSettings,
        topic: &str,
        max_entries: usize,
        cancel: CancellationToken,
    ) -> Result<Self, DirectoryError> {
        let err = |source| DirectoryError::Consumer { topic: topic.to_owned(), source };
        // Assigned, not subscribed: every replica reads everything from the start, and nothing is
        // committed. librdkafka wants a group id all the same; it never joins it (so needs no
        // group ACL).
        let props = [
            ("group.id", "gpumedic-enricher-directory"),
            ("enable.auto.commit", "false"),
            ("enable.auto.offset.store", "false"),
            ("enable.partition.eof", "false"),
        ];
        let reader: StreamConsumer =
            settings.client_config_with("gpumedic-enricher-directory", &props).create().map_err(err)?;
        let watermarks: BaseConsumer =
            settings.client_config_with("gpumedic-enricher-directory-end", &props).create().map_err(err)?;
        let watermarks = Arc::new(watermarks);
        let partitions = partition_count(&watermarks, topic).await.map_err(err)?;
        let mut list = TopicPartitionList::new();
        for p in 0..partitions {
            list.add_partition_offset(topic, p, Offset::Beginning).map_err(err)?;
        }
        reader.assign(&list).map_err(err)?;
        let directory = Self {
            topic: topic.to_owned(),
            inner: Arc::new(RwLock::new(Inner::default())),
            watermarks: Some(watermarks),
            max_entries: max_entries.max(1),
        };
        let reading = directory.clone();
        tokio::spawn(async move {
            loop {
                let m = tokio::select! {
                    () = cancel.cancelled() => return,
                    m = reader.recv() => m,
                };
                match m {
                    Ok(m) => reading.read(m.partition(), m.offset(), m.key(), m.payload()),
                    Err(e) => {
                        tracing::warn!(error = %e, topic = %reading.topic, "Cannot read the node-token directory; retrying.");
                        tokio::time::sleep(Duration::from_secs(1)).await;
                    }
                }
            }
        });
        Ok(directory)
    }

    /// A directory that holds `tokens` and reads no topic ([`Directory::catch_up`] has nothing to
    /// wait for): for tests and benchmarks of the record checks, without a broker.
    #[must_use]
    pub fn of_tokens<'t>(tokens: impl IntoIterator<Item = &'t [u8]>, max_entries: usize) -> Self {
        let directory = Self {
            topic: String::new(),
            inner: Arc::new(RwLock::new(Inner::default())),
            watermarks: None,
            max_entries: max_entries.max(1),
        };
        for (offset, token) in (0_i64..).zip(tokens) {
            directory.read(0, offset, None, Some(token));
        }
        directory
    }

    /// Takes in one directory record: key the node, value its token.
    fn read(&self, partition: i32, offset: i64, node: Option<&[u8]>, token: Option<&[u8]>) {
        let mut inner = self.inner.write().unwrap_or_else(PoisonError::into_inner);
        inner.next.insert(partition, offset + 1);
        let Some(token) = token.map(<[u8]>::trim_ascii).filter(|t| !t.is_empty()) else { return };
        let Some(exp) = unverified_expiry(token) else {
            metrics::counter!(names::DIRECTORY_ENTRIES_IGNORED_TOTAL).increment(1);
            tracing::debug!(node = %String::from_utf8_lossy(node.unwrap_or_default()),
                "A node-token directory entry is not a token; ignoring it.");
            return;
        };
        let id = key_id(token);
        if inner.by_id.contains_key(&id) {
            return;
        }
        let now = chrono::Utc::now().timestamp();
        if exp <= now {
            return;
        }
        if inner.by_id.len() >= self.max_entries {
            inner.by_id.retain(|_, k| k.exp > now);
            let Inner { by_id, order, .. } = &mut *inner;
            order.retain(|id| by_id.contains_key(id));
            while inner.by_id.len() >= self.max_entries {
                let Some(oldest) = inner.order.pop_front() else { break };
                inner.by_id.remove(&oldest);
            }
        }
        let token: Arc<[u8]> = Arc::from(token);
        inner.by_id.insert(id.clone(), Arc::new(Known { key: NodeKey::of(&token), token, exp }));
        inner.order.push_back(id);
        metrics::gauge!(names::DIRECTORY_ENTRIES).set(inner.by_id.len() as f64);
    }

    /// The token with key id `id`, if read and not expired.
    pub fn get(&self, id: &[u8]) -> Option<Arc<Known>> {
        self.view().get(id)
    }

    /// A read view for many look-ups (a batch's): one lock and one reading of the clock for all.
    fn view(&self) -> View<'_> {
        View { inner: self.inner.read().unwrap_or_else(PoisonError::into_inner), now: chrono::Utc::now().timestamp() }
    }

    /// Waits until every record the topic held when called has been read, for at most `timeout`.
    ///
    /// # Errors
    /// [`DirectoryError::Behind`] when the end cannot be asked or is not reached in time.
    pub async fn catch_up(&self, timeout: Duration) -> Result<(), DirectoryError> {
        let behind = |reason: String| DirectoryError::Behind { topic: self.topic.clone(), reason };
        let Some(consumer) = self.watermarks.clone() else { return Ok(()) };
        let topic = self.topic.clone();
        let ends = tokio::task::spawn_blocking(move || -> Result<Vec<(i32, i64, i64)>, rdkafka::error::KafkaError> {
            let metadata = consumer.fetch_metadata(Some(&topic), Duration::from_secs(5))?;
            let count = metadata.topics().first().map_or(0, |t| t.partitions().len());
            (0..count as i32)
                .map(|p| consumer.fetch_watermarks(&topic, p, Duration::from_secs(5)).map(|(lo, hi)| (p, lo, hi)))
                .collect()
        })
        .await
        .map_err(|e| behind(e.to_string()))?
        .map_err(|e| behind(e.to_string()))?;
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            let lagging = {
                let inner = self.inner.read().unwrap_or_else(PoisonError::into_inner);
                ends.iter().filter(|(p, lo, hi)| hi > lo && inner.next.get(p).is_none_or(|n| n < hi)).count()
            };
            if lagging == 0 {
                return Ok(());
            }
            if tokio::time::Instant::now() >= deadline {
                return Err(behind(format!("{lagging} partitions not read to their end in {timeout:?}")));
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}

/// The directory as read when the view was taken.
struct View<'d> {
    inner: RwLockReadGuard<'d, Inner>,
    now: i64,
}

impl View<'_> {
    fn get(&self, id: &[u8]) -> Option<Arc<Known>> {
        let id = std::str::from_utf8(id).ok()?;
        self.inner.by_id.get(id).filter(|k| k.exp > self.now).cloned()
    }
}

/// The partition count of `topic`.
async fn partition_count(consumer: &Arc<BaseConsumer>, topic: &str) -> Result<i32, rdkafka::error::KafkaError> {
    let (consumer, topic) = (consumer.clone(), topic.to_owned());
    tokio::task::spawn_blocking(move || {
        let metadata = consumer.fetch_metadata(Some(&topic), Duration::from_secs(10))?;
        Ok(metadata.topics().first().map_or(0, |t| t.partitions().len() as i32))
    })
    .await
    .unwrap_or(Ok(0))
}

/// How long a batch waits for the directory to read an entry it names before refusing it.
const CATCH_UP: Duration = Duration::from_secs(10);

/// How a raw record proves its node.
#[derive(Debug, Clone)]
pub enum Proof {
    /// The token itself, in its header.
    Token,
    /// A key id the directory knows, and a signature to check against it.
    Signed(Arc<Known>),
    /// A key id the directory does not know, even after catching up.
    UnknownKey,
    /// Neither.
    Missing,
}

impl Proof {
    /// The token to review for `record`: its header's, or the directory's for its key id.
    pub fn token<'r>(&'r self, record: &'r Record) -> Option<&'r [u8]> {
        match self {
            Self::Token => record.header(record_headers::NODE_TOKEN),
            Self::Signed(k) => Some(&k.token),
            Self::UnknownKey | Self::Missing => None,
        }
    }
}

/// Node authentication: token reviews, and the directory of the tokens signed records name.
pub struct NodeAuth<R> {
    /// Reviews tokens and decides.
    pub verifier: Verifier<R>,
    /// The collectors' tokens by key id.
    pub directory: Directory,
}

impl<R: Reviewer> NodeAuth<R> {
    /// Each record's proof. When a record names a key id not read yet, the directory first reads
    /// to its end (the collector published the entry before signing with it).
    ///
    /// # Errors
    /// [`DirectoryError::Behind`] when the directory cannot catch up: the batch is retried.
    pub async fn proofs(&self, records: &[Record]) -> Result<Vec<Proof>, DirectoryError> {
        let mut proofs = self.look_up(records);
        if proofs.iter().any(|p| matches!(p, Proof::UnknownKey)) {
            self.directory.catch_up(CATCH_UP).await?;
            let view = self.directory.view();
            for (p, r) in proofs.iter_mut().zip(records) {
                if matches!(p, Proof::UnknownKey) {
                    *p = Self::proof(&view, r);
                }
            }
        }
        Ok(proofs)
    }

    /// Each record's proof from the directory as read now, under one read lock.
    fn look_up(&self, records: &[Record]) -> Vec<Proof> {
        let view = self.directory.view();
        let mut proofs: Vec<Proof> = Vec::with_capacity(records.len());
        for r in records {
            // A node's records come in a row with one key id: one look-up for the run.
            let same = proofs.last().zip(records.get(proofs.len().wrapping_sub(1))).and_then(|(p, prev)| match p {
                Proof::Signed(k)
                    if prev.header(record_headers::NODE_KEY_ID) == r.header(record_headers::NODE_KEY_ID)
                        && r.header(record_headers::NODE_TOKEN).is_none() =>
                {
                    Some(Proof::Signed(k.clone()))
                }
                _ => None,
            });
            proofs.push(same.unwrap_or_else(|| Self::proof(&view, r)));
        }
        proofs
    }

    fn proof(view: &View<'_>, r: &Record) -> Proof {
        if r.header(record_headers::NODE_TOKEN).is_some() {
            return Proof::Token;
        }
        match (r.header(record_headers::NODE_KEY_ID), r.header(record_headers::NODE_SIGNATURE)) {
            (Some(id), Some(_)) => view.get(id).map_or(Proof::UnknownKey, Proof::Signed),
            _ => Proof::Missing,
        }
    }

    /// The decision for `record`, whose `node` field is `node`, after [`Verifier::prepare`]
    /// reviewed the token of its `proof` (`review`): as [`Verifier::check_reviewed`], and for a
    /// signed record, its signature over the record's key and value.
    ///
    /// # Errors
    /// The [`Refusal`].
    pub fn check(
        &self,
        review: Option<&Review>,
        proof: &Proof,
        record: &Record,
        node: &str,
        now: i64,
    ) -> Result<Accepted, Refusal> {
        let key = record.key.as_deref();
        if matches!(proof, Proof::UnknownKey) {
            let id = record.header(record_headers::NODE_KEY_ID).unwrap_or_default();
            return Err(Refusal::UnknownKey(String::from_utf8_lossy(&id[..id.len().min(64)]).into_owned()));
        }
        let accepted = self.verifier.check_reviewed(review, proof.token(record), node, key, now)?;
        if let Proof::Signed(k) = proof {
            let signature = record.header(record_headers::NODE_SIGNATURE).unwrap_or_default();
            let value = record.payload.as_deref().unwrap_or_default();
            if !k.key.verify(key.unwrap_or_default(), value, signature) {
                return Err(Refusal::BadSignature);
            }
        }
        Ok(accepted)
    }
}

#[cfg(test)]
mod tests {
    use base64::Engine as _;

    use super::*;
    use crate::auth::{AuthError, Policy, ServiceAccountRef};

    fn jwt(node: &str, exp: i64) -> Vec<u8> {
        let b64 = |s: &str| base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(s);
        format!("{}.{}.{node}", b64(r#"{"alg":"RS256"}"#), b64(&format!(r#"{{"exp":{exp}}}"#))).into_bytes()
    }

    /// Answers every token as the collector's on the node its last part names.
    struct Apiserver;

    impl Reviewer for Apiserver {
        async fn review(&self, token: &str) -> Result<Review, AuthError> {
            Ok(Review::Authenticated {
                username: "system:serviceaccount:gpumedic:gpumedic-collector".into(),
                node: token.rsplit('.').next().map(str::to_owned),
            })
        }
    }

    fn signed(node: &str, token: &[u8], value: &[u8]) -> Record {
        let key = NodeKey::of(token);
        Record {
            topic: "raw".into(),
            partition: 0,
            offset: 0,
            key: Some(node.as_bytes().to_vec()),
            payload: Some(value.to_vec()),
            headers: vec![
                (record_headers::NODE_KEY_ID.into(), key.id().as_bytes().to_vec()),
                (record_headers::NODE_SIGNATURE.into(), key.sign(node.as_bytes(), value).to_vec()),
            ],
            timestamp_ms: None,
        }
    }

    /// Each record's decision, as the handler makes it.
    async fn decide(auth: &mut NodeAuth<Apiserver>, records: &[Record]) -> Vec<Result<Accepted, Refusal>> {
        let now = chrono::Utc::now().timestamp();
        let proofs = auth.proofs(records).await.unwrap();
        let tokens = records.iter().zip(&proofs).map(|(r, p)| (r.key.as_deref().unwrap_or_default(), p.token(r)));
        let reviews = auth.verifier.prepare(tokens, now).await.unwrap();
        records
            .iter()
            .zip(&proofs)
            .zip(&reviews)
            .map(|((r, p), review)| {
                let node = std::str::from_utf8(r.key.as_deref().unwrap_or_default()).unwrap();
                auth.check(review.as_deref(), p, r, node, now)
            })
            .collect()
    }

    #[tokio::test]
    async fn signed_records_are_accepted_only_with_a_known_key_and_their_own_signature() {
        let exp = chrono::Utc::now().timestamp() + 3600;
        let (a, b) = (jwt("node-a", exp), jwt("node-b", exp));
        let stale = jwt("node-c", chrono::Utc::now().timestamp() - 1);
        let directory = Directory::of_tokens([&a[..], &b[..], &stale[..]], 10);
        assert!(directory.get(NodeKey::of(&a).id().as_bytes()).is_some());
        assert!(directory.get(NodeKey::of(&stale).id().as_bytes()).is_none(), "an expired token is not held");
        directory.catch_up(Duration::from_millis(1)).await.expect("nothing to read");
        let policy =
            Policy { collector: ServiceAccountRef::parse("gpumedic:gpumedic-collector").unwrap(), operator: None };
        let mut auth = NodeAuth { verifier: Verifier::new(Apiserver, policy, 10), directory };

        let good = signed("node-a", &a, b"event 1");
        let mut flipped = signed("node-a", &a, b"event 2");
        flipped.headers[1].1[0] ^= 1;
        let mut moved = signed("node-a", &a, b"event 3");
        moved.payload = Some(b"event 4".to_vec());
        // node-b's key, claiming node-a: its token is bound to node-b.
        let borrowed = signed("node-a", &b, b"event 5");
        let unknown = signed("node-c", &jwt("node-c", exp), b"event 6");
        let mut unsigned = signed("node-a", &a, b"event 7");
        unsigned.headers.truncate(1);

        let decisions = decide(&mut auth, &[good, flipped, moved, borrowed, unknown, unsigned]).await;
        assert_eq!(decisions[0], Ok(Accepted::Node));
        assert_eq!(decisions[1], Err(Refusal::BadSignature));
        assert_eq!(decisions[2], Err(Refusal::BadSignature), "the signature covers the value");
        assert_eq!(decisions[3].as_ref().unwrap_err().label(), "wrong_node");
        assert_eq!(decisions[4].as_ref().unwrap_err().label(), "unknown_key");
        assert_eq!(decisions[5], Err(Refusal::Missing));
    }

    #[test]
    fn a_full_directory_forgets_the_oldest_entry_first() {
        let exp = chrono::Utc::now().timestamp() + 3600;
        let tokens: Vec<Vec<u8>> = (0..3).map(|i| jwt(&format!("node-{i}"), exp)).collect();
        let directory = Directory::of_tokens(tokens.iter().map(Vec::as_slice), 2);
        assert!(directory.get(NodeKey::of(&tokens[0]).id().as_bytes()).is_none(), "the oldest went");
        assert!(directory.get(NodeKey::of(&tokens[1]).id().as_bytes()).is_some());
        assert!(directory.get(NodeKey::of(&tokens[2]).id().as_bytes()).is_some());
    }
}
