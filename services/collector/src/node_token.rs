//! The node's credential on Kafka: the collector's projected ServiceAccount token, bound to its Pod
//! and so to its node, attached to every raw record it produces (header
//! [`record_headers::NODE_TOKEN`](gpumedic_runtime::kafka::record_headers::NODE_TOKEN)). The
//! enricher verifies it with a TokenReview and refuses a record whose token is bound to another
//! node than the one the record claims (docs/security.md).
//!
//! The token is 1 to 2 KiB, several times a record; so by default (`--node-auth-proof signature`)
//! it travels once per rotation, published to the node-token directory topic and acknowledged
//! ([`NodeToken::publish_keys`]), and each record then carries only the token's key id and an
//! HMAC of the record under a key derived from the token
//! ([`node_proof`](gpumedic_runtime::kafka::node_proof)). Until the directory has acknowledged the
//! current token (at start, after a rotation, while the topic is unreachable), records carry the
//! token itself, which the enricher accepts as well: no record waits for the directory.
//!
//! The kubelet rotates the projected file well before the token expires (at 80% of its life), so
//! the file is watched: re-read when its modification time or size changes (checked every
//! [`CHECK_EVERY`]) and at least every [`REREAD_EVERY`]. The token is read when a record is
//! produced, not when it is spooled, so a record that waited in the spool through a long outage
//! leaves with the current token, never an expired one.

use std::path::{Path, PathBuf};
use std::sync::{Arc, RwLock};
use std::time::{Duration, SystemTime};

use gpumedic_runtime::kafka::node_proof::{self, NodeKey};
use gpumedic_runtime::kafka::{KafkaSettings, Producer};
use tokio_util::sync::CancellationToken;

use crate::events::{InternalEvent as _, NodeTokenReadFailed, names};

/// Where the collector DaemonSet projects the token (k8s/base/collector.yaml).
pub const DEFAULT_TOKEN_FILE: &str = "/var/run/secrets/gpumedic/token";
/// How often the file's metadata is checked for a rotation.
pub const CHECK_EVERY: Duration = Duration::from_secs(5);
/// The file is re-read at least this often, whatever its metadata says.
pub const REREAD_EVERY: Duration = Duration::from_secs(60);

/// Why the token file cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum TokenFileError {
    /// The file cannot be read (missing, no permission).
    #[error("cannot read the node token file {path}: {source}")]
    Read {
        /// The file.
        path: PathBuf,
        /// What the read said.
        #[source]
        source: std::io::Error,
    },
    /// The file holds no token.
    #[error("the node token file {0} is empty")]
    Empty(PathBuf),
}

/// Reads the token in `path`, without surrounding whitespace.
///
/// # Errors
/// [`TokenFileError`] when the file cannot be read or is empty.
pub fn read_token(path: &Path) -> Result<Arc<[u8]>, TokenFileError> {
    let raw = std::fs::read(path).map_err(|source| TokenFileError::Read { path: path.to_owned(), source })?;
    let token = raw.trim_ascii();
    if token.is_empty() {
        return Err(TokenFileError::Empty(path.to_owned()));
    }
    Ok(Arc::from(token))
}

/// How often the current token is published to the directory again, rotated or not (the topic
/// keeps entries for two hours).
pub const REPUBLISH_EVERY: Duration = Duration::from_secs(600);

/// How a record proves its node.
#[derive(Clone)]
pub enum Proof {
    /// The key of the current token, acknowledged by the directory: a key id and a signature.
    Signed(NodeKey),
    /// The token itself.
    Token(Arc<[u8]>),
    /// Nothing (no token file, or it was never readable).
    None,
}

/// The token records are produced with; cheap to clone and to read. Holds nothing when the
/// collector runs without one (then records carry no token header).
#[derive(Clone, Default)]
pub struct NodeToken {
    current: Arc<RwLock<Option<Arc<[u8]>>>>,
    /// The token the directory acknowledged last, and its key.
    signing: Arc<RwLock<Signing>>,
}

/// The token the directory acknowledged last, and its key.
type Signing = Option<(Arc<[u8]>, NodeKey)>;

impl std::fmt::Debug for NodeToken {
    // Never prints the credential.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NodeToken").field("present", &self.get().is_some()).finish()
    }
}

impl NodeToken {
    /// A token holding `token`.
    pub fn new(token: Option<Arc<[u8]>>) -> Self {
        Self { current: Arc::new(RwLock::new(token)), signing: Arc::default() }
    }

    /// The current token, if any.
    pub fn get(&self) -> Option<Arc<[u8]>> {
        self.current.read().unwrap_or_else(std::sync::PoisonError::into_inner).clone()
    }

    fn set(&self, token: Arc<[u8]>) {
        *self.current.write().unwrap_or_else(std::sync::PoisonError::into_inner) = Some(token);
    }

    /// How the next record proves its node: signed when the directory acknowledged the current
    /// token, else the token itself.
    pub fn proof(&self) -> Proof {
        let Some(current) = self.get() else { return Proof::None };
        let signing = self.signing.read().unwrap_or_else(std::sync::PoisonError::into_inner);
        match &*signing {
            Some((token, key)) if Arc::ptr_eq(token, &current) || token[..] == current[..] => {
                Proof::Signed(key.clone())
            }
            _ => Proof::Token(current),
        }
    }

    /// Publishes the current token to the node-token directory `topic` (creating it when
    /// missing) as `node`'s, at start, after each rotation and every [`REPUBLISH_EVERY`], until
    /// `cancel`; once Kafka acknowledges an entry, records are signed with that token's key. A
    /// failure is logged once until a publish succeeds again, and records carry the token
    /// meanwhile.
    pub async fn publish_keys(
        self,
        kafka: KafkaSettings,
        producer: Producer,
        topic: String,
        node: String,
        cancel: CancellationToken,
    ) -> Result<(), std::convert::Infallible> {
        let spec = node_proof::directory_topic(&topic);
        let mut topic_ready = false;
        let mut published: Option<(Arc<[u8]>, std::time::Instant)> = None;
        let mut failing = false;
        loop {
            let current = self.get();
            let due = match (&current, &published) {
                (None, _) => false,
                (Some(_), None) => true,
                (Some(c), Some((p, at))) => c[..] != p[..] || at.elapsed() >= REPUBLISH_EVERY,
            };
            if let Some(token) = current.filter(|_| due) {
                let key = NodeKey::of(&token);
                let outcome = async {
                    if !topic_ready {
                        kafka.ensure_topics(std::slice::from_ref(&spec)).await?;
                        topic_ready = true;
                    }
                    gpumedic_runtime::kafka::publish(
                        &producer,
                        &topic,
                        &node_proof::directory_key(&node, key.id()),
                        &token,
                        &[],
                    )
                    .await
                }
                .await;
                match outcome {
                    Ok(()) => {
                        if failing {
                            tracing::info!(topic = %topic, "The node-token directory takes this node's token again.");
                            failing = false;
                        }
                        tracing::debug!(topic = %topic, key_id = key.id(), "Published this node's token to the directory; records are signed with its key.");
                        *self.signing.write().unwrap_or_else(std::sync::PoisonError::into_inner) =
                            Some((token.clone(), key));
                        published = Some((token, std::time::Instant::now()));
                    }
                    Err(e) => {
                        metrics::counter!(names::NODE_KEY_PUBLISH_FAILURES_TOTAL).increment(1);
                        if !failing {
                            tracing::warn!(error = %e, topic = %topic,
                                "Cannot publish this node's token to the node-token directory; records carry the token itself until it can.");
                            failing = true;
                        }
                    }
                }
            }
            tokio::select! {
                () = cancel.cancelled() => return Ok(()),
                () = tokio::time::sleep(CHECK_EVERY) => {}
            }
        }
    }

    /// Follows `path` until `cancel` is cancelled: re-reads it when its modification time or
    /// size changes, and at least every [`REREAD_EVERY`]. A read that fails keeps the last token
    /// (the kubelet replaces the file atomically, so a failure is the file gone, not half
    /// written) and is logged once until a read succeeds again.
    pub async fn follow(self, path: PathBuf, cancel: CancellationToken) -> Result<(), std::convert::Infallible> {
        let mut watch = Watch::new(path);
        loop {
            tokio::select! {
                () = cancel.cancelled() => return Ok(()),
                () = tokio::time::sleep(CHECK_EVERY) => {}
            }
            let due = watch.read_at.elapsed().is_ok_and(|e| e >= REREAD_EVERY);
            watch.check(&self, due);
        }
    }
}

/// One followed token file: what was seen of it last.
struct Watch {
    path: PathBuf,
    seen: Option<(Option<SystemTime>, u64)>,
    read_at: SystemTime,
    failing: bool,
}

impl Watch {
    fn new(path: PathBuf) -> Self {
        let seen = Self::stamp(&path);
        Self { path, seen, read_at: SystemTime::now(), failing: false }
    }

    fn stamp(path: &Path) -> Option<(Option<SystemTime>, u64)> {
        std::fs::metadata(path).ok().map(|m| (m.modified().ok(), m.len()))
    }

    /// Re-reads the file into `token` when it changed, or when `due`.
    fn check(&mut self, token: &NodeToken, due: bool) {
        let now = Self::stamp(&self.path);
        if now == self.seen && !due {
            return;
        }
        self.seen = now;
        self.read_at = SystemTime::now();
        match read_token(&self.path) {
            Ok(read) => {
                if self.failing {
                    tracing::info!(path = %self.path.display(), "The node token file is readable again.");
                    self.failing = false;
                }
                if token.get().as_deref() != Some(&read[..]) {
                    tracing::info!(path = %self.path.display(), "The node token was rotated; new records carry the new one.");
                    token.set(read);
                }
            }
            Err(e) => {
                NodeTokenReadFailed { error: &e, first: !self.failing }.emit();
                self.failing = true;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_token_is_read_without_its_newline_and_an_empty_file_is_refused() {
        let dir = std::env::temp_dir().join(format!("gpumedic-token-{}", uuid::Uuid::new_v4()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("token");
        std::fs::write(&file, b"eyJhbGciOi.payload.sig\n").unwrap();
        assert_eq!(&read_token(&file).unwrap()[..], b"eyJhbGciOi.payload.sig");
        std::fs::write(&file, b" \n").unwrap();
        assert!(matches!(read_token(&file), Err(TokenFileError::Empty(_))));
        assert!(matches!(read_token(&dir.join("missing")), Err(TokenFileError::Read { .. })));
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_rotated_file_is_picked_up_and_a_vanished_one_keeps_the_last_token() {
        let dir = std::env::temp_dir().join(format!("gpumedic-token-{}", uuid::Uuid::new_v4()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("token");
        std::fs::write(&file, b"first").unwrap();
        let token = NodeToken::new(Some(read_token(&file).unwrap()));
        let mut watch = Watch::new(file.clone());
        watch.check(&token, false);
        assert_eq!(token.get().as_deref(), Some(&b"first"[..]));
        // The kubelet writes a new file (another size here, so the change is seen without a clock).
        std::fs::write(&file, b"second, longer").unwrap();
        watch.check(&token, false);
        assert_eq!(token.get().as_deref(), Some(&b"second, longer"[..]));
        std::fs::remove_file(&file).unwrap();
        watch.check(&token, true);
        assert_eq!(token.get().as_deref(), Some(&b"second, longer"[..]));
        assert!(watch.failing);
        std::fs::write(&file, b"third").unwrap();
        watch.check(&token, true);
        assert_eq!(token.get().as_deref(), Some(&b"third"[..]));
        assert!(!format!("{token:?}").contains("third"), "Debug never shows the token");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
