//! A raw record's proof of its node, in a few dozen bytes instead of the token itself.
//!
//! A collector's projected ServiceAccount token (1 to 2 KiB) is what proves which node it runs on
//! (docs/security.md). Carrying it in every raw record multiplies the raw topic's bytes by six; so
//! the token travels once per rotation, in the node-token directory (a topic of its own, read by
//! the enrichers), and each record carries:
//!
//! - [`record_headers::NODE_KEY_ID`](super::record_headers::NODE_KEY_ID): which token, as the
//!   first 16 bytes of its SHA-256 in hex ([`NodeKey::id`]);
//! - [`record_headers::NODE_SIGNATURE`](super::record_headers::NODE_SIGNATURE): an HMAC-SHA256 of
//!   the record's key and value under a key derived from the token ([`NodeKey::sign`]).
//!
//! Only a holder of the token can derive the key, so a valid signature proves what the token
//! proves, once the enricher has reviewed the token (TokenReview) and found it bound to the
//! record's node. The key and value are both signed, so neither can be moved to another record;
//! the derivation is labelled, so the key is good for nothing but this.

use ring::{digest, hmac};

/// How long the node-token directory keeps an entry: twice a projected token's life (one hour),
/// while collectors publish their current token every ten minutes.
pub const DIRECTORY_RETENTION_MS: i64 = 2 * 3600 * 1000;

/// The node-token directory topic as a service creates it when missing: three partitions (it is
/// small: one entry per node and token), compacted by key (node and key id) and deleted after
/// [`DIRECTORY_RETENTION_MS`].
pub fn directory_topic(name: &str) -> super::TopicSpec {
    super::TopicSpec::new(name, 3)
        .with_config("cleanup.policy", "compact,delete")
        .with_config("retention.ms", DIRECTORY_RETENTION_MS.to_string())
}

/// The key of a directory record: the node, a slash, the key id (so compaction keeps one record
/// per token, and a rotation leaves the old token's record until it ages out).
pub fn directory_key(node: &str, id: &str) -> String {
    format!("{node}/{id}")
}

/// The label of the key derivation: the key is `HMAC-SHA256(token, LABEL)`.
const LABEL: &[u8] = b"gpumedic node record signature v1";
/// The length of a key id in bytes before hex (16 bytes of the token's SHA-256).
const ID_BYTES: usize = 16;
/// The length of a signature in bytes (a whole HMAC-SHA256).
pub const SIGNATURE_BYTES: usize = 32;

/// The signing key of one token. Its `Debug` never shows the key.
#[derive(Clone)]
pub struct NodeKey {
    id: String,
    key: hmac::Key,
}

impl std::fmt::Debug for NodeKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NodeKey").field("id", &self.id).finish_non_exhaustive()
    }
}

impl NodeKey {
    /// The key of `token`.
    pub fn of(token: &[u8]) -> Self {
        let derived = hmac::sign(&hmac::Key::new(hmac::HMAC_SHA256, token), LABEL);
        Self { id: key_id(token), key: hmac::Key::new(hmac::HMAC_SHA256, derived.as_ref()) }
    }

    /// The token's key id ([`key_id`]).
    pub fn id(&self) -> &str {
        &self.id
    }

    /// The signature of a record with `key` and `value`.
    pub fn sign(&self, key: &[u8], value: &[u8]) -> [u8; SIGNATURE_BYTES] {
        let mut ctx = hmac::Context::with_key(&self.key);
        framed(&mut ctx, key, value);
        let tag = ctx.sign();
        let mut out = [0u8; SIGNATURE_BYTES];
        out.copy_from_slice(tag.as_ref());
        out
    }

    /// Whether `signature` is this key's signature of a record with `key` and `value` (compared
    /// in constant time).
    pub fn verify(&self, key: &[u8], value: &[u8], signature: &[u8]) -> bool {
        let mut ctx = hmac::Context::with_key(&self.key);
        framed(&mut ctx, key, value);
        let tag = ctx.sign();
        let tag = tag.as_ref();
        // Constant time: every byte compared, whatever the first difference.
        tag.len() == signature.len() && tag.iter().zip(signature).fold(0u8, |d, (a, b)| d | (a ^ b)) == 0
    }
}

/// The key id of `token`: the first 16 bytes of its SHA-256, in lowercase hex (32 characters).
pub fn key_id(token: &[u8]) -> String {
    let d = digest::digest(&digest::SHA256, token);
    let mut s = String::with_capacity(ID_BYTES * 2);
    for b in &d.as_ref()[..ID_BYTES] {
        use std::fmt::Write as _;
        let _ = write!(s, "{b:02x}");
    }
    s
}

/// The key's length, then the key, then the value: no two (key, value) pairs sign alike.
fn framed(ctx: &mut hmac::Context, key: &[u8], value: &[u8]) {
    ctx.update(&(key.len() as u64).to_be_bytes());
    ctx.update(key);
    ctx.update(value);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_signature_verifies_only_for_its_key_value_and_token() {
        let k = NodeKey::of(b"token-a");
        let sig = k.sign(b"node-a", b"payload");
        assert!(k.verify(b"node-a", b"payload", &sig));
        assert!(!k.verify(b"node-b", b"payload", &sig), "another key");
        assert!(!k.verify(b"node-a", b"payload!", &sig), "another value");
        assert!(!k.verify(b"node-a", b"payload", &sig[..31]), "a truncated signature");
        assert!(!NodeKey::of(b"token-b").verify(b"node-a", b"payload", &sig), "another token");
        // The boundary between key and value is signed.
        assert!(!k.verify(b"node-", b"apayload", &k.sign(b"node-a", b"payload")));
    }

    #[test]
    fn the_key_id_names_the_token_and_not_the_key() {
        let k = NodeKey::of(b"token-a");
        assert_eq!(k.id(), key_id(b"token-a"));
        assert_eq!(k.id().len(), 32);
        assert_ne!(k.id(), NodeKey::of(b"token-b").id());
        assert!(!format!("{k:?}").contains("key:"), "Debug shows no key material");
    }
}
