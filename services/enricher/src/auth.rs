//! Node authentication: a raw record speaks for the node that produced it, or is refused.
//!
//! Every collector attaches its projected ServiceAccount token (audience `gpumedic`, bound to its
//! Pod) to each raw record, in header `gpumedic.node-token`. Before a record is enriched, the
//! enricher asks the apiserver who the token belongs to (a `TokenReview`); a Pod-bound token's
//! review names the node the Pod runs on (`authentication.kubernetes.io/node-name` in the user's
//! extra fields, Kubernetes 1.30 and later). The record is accepted only when:
//!
//! - the token is the collector's ServiceAccount (`--collector-service-account`),
//! - it is bound to a node, and that node is the record's `node` field and its key.
//!
//! A token of the operator ServiceAccount (`--operator-service-account`, for `gpumedic inject`)
//! is accepted for any node, counted and logged. Everything else goes to the dead-letter topic
//! with the reason ([`Refusal`]).
//!
//! Reviews are cached per token (by its SHA-256) until the token's `exp` claim, and for at most
//! [`MAX_CACHE_LIFETIME`] (the apiserver may extend a projected token's life to a year, and a
//! token stops being valid when its Pod is deleted). The claim is decoded without checking the
//! signature, and used for nothing but the cache's lifetime and refusing an already-expired
//! token without asking: a forger gains nothing by lying about it. A last-token-per-key memo makes
//! the common case (a node's records in a row, one token) a byte comparison, no hash.
//!
//! The apiserver not answering is an outage, never a verdict: the batch is retried
//! ([`AuthError::Review`] is transient for the consumer loop), and no record is accepted on the
//! strength of a review that did not happen.

use std::collections::HashMap;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use base64::Engine as _;
use futures::StreamExt as _;
use k8s_openapi::api::authentication::v1::{TokenReview, TokenReviewSpec};
use kube::api::{Api, PostParams};

use crate::events::names;

/// The audience collector tokens are minted for, and reviewed with.
pub const AUDIENCE: &str = "gpumedic";
/// The user extra field in which a Pod-bound ServiceAccount token's review names its node.
pub const NODE_NAME_EXTRA: &str = "authentication.kubernetes.io/node-name";
/// The longest a review is trusted before the token is reviewed again.
pub const MAX_CACHE_LIFETIME: Duration = Duration::from_secs(3600);
/// How long a refused token is remembered, so a flood of one forged token costs one review.
pub const REFUSED_CACHE_LIFETIME: Duration = Duration::from_secs(60);
/// Most token reviews in flight at once (at start, every node's token is new).
const CONCURRENT_REVIEWS: usize = 16;
/// A longer header is not a projected token (those are 1 to 2 KiB) and is refused without a
/// review: the apiserver would refuse the request, and a record must not stall its partition.
pub const MAX_TOKEN_BYTES: usize = 16 * 1024;

/// Whether raw records must carry a valid node token (`--node-auth`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NodeAuthMode {
    /// Records failing the check are dead-lettered.
    Enforce,
    /// Tokens are not checked (a pipeline without collectors in Kubernetes: the demo, tests).
    Off,
}

impl NodeAuthMode {
    /// Parses `enforce` or `off`.
    ///
    /// # Errors
    /// A message naming the allowed values.
    pub fn parse(raw: &str) -> Result<Self, String> {
        match raw {
            "enforce" => Ok(Self::Enforce),
            "off" => Ok(Self::Off),
            other => Err(format!("'{other}' is not a mode; use enforce or off")),
        }
    }
}

/// A ServiceAccount, as `namespace:name` on the command line.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ServiceAccountRef {
    /// Its namespace.
    pub namespace: String,
    /// Its name.
    pub name: String,
    /// The user name its tokens authenticate as, made once: it is compared for every record.
    username: String,
}

impl ServiceAccountRef {
    /// Parses `namespace:name`.
    ///
    /// # Errors
    /// A message when either part is missing.
    pub fn parse(raw: &str) -> Result<Self, String> {
        match raw.split_once(':') {
            Some((ns, name)) if !ns.is_empty() && !name.is_empty() && !name.contains(':') => Ok(Self {
                namespace: ns.to_owned(),
                name: name.to_owned(),
                username: format!("system:serviceaccount:{ns}:{name}"),
            }),
            _ => Err(format!("'{raw}' is not namespace:name")),
        }
    }

    /// The user name the apiserver gives this ServiceAccount's tokens
    /// (`system:serviceaccount:<namespace>:<name>`).
    pub fn username(&self) -> &str {
        &self.username
    }
}

/// What the apiserver said about a token.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Review {
    /// The token is valid for [`AUDIENCE`]: its user, and the node its Pod is bound to.
    Authenticated {
        /// The user name (`system:serviceaccount:<namespace>:<name>` for a ServiceAccount).
        username: String,
        /// The node of the Pod the token is bound to, if any.
        node: Option<String>,
    },
    /// The token is not valid (forged, expired, its Pod deleted, another audience): the
    /// apiserver's reason.
    Refused(String),
}

/// Why a record is refused. Its `Display` is the dead-letter reason.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Refusal {
    /// No `gpumedic.node-token` header.
    #[error("node token missing")]
    Missing,
    /// Not a token, or the apiserver refused it.
    #[error("node token invalid: {0}")]
    Invalid(String),
    /// Its `exp` has passed (or the apiserver says it expired).
    #[error("node token expired")]
    Expired,
    /// Valid, but for another node than the record claims (in its `node` field or its key).
    #[error("node token for node {}, record claims {claimed}", bound.as_deref().unwrap_or("(none)"))]
    WrongNode {
        /// The node the token is bound to (`None`: a token bound to no Pod on a node).
        bound: Option<String>,
        /// The node the record claims.
        claimed: String,
    },
    /// Valid, but not the collector's ServiceAccount (nor the operator's).
    #[error("node token not the collector's service account: {0}")]
    NotCollector(String),
    /// Signed with a key id the node-token directory does not hold (never published, expired,
    /// or forged).
    #[error("node key id {0} unknown to the node-token directory")]
    UnknownKey(String),
    /// The token is valid for the record's node, but the signature is not its key's signature of
    /// this record's key and value.
    #[error("node signature does not match the record")]
    BadSignature,
}

impl Refusal {
    /// The metric label of this kind of refusal.
    pub fn label(&self) -> &'static str {
        match self {
            Self::Missing => "missing",
            Self::Invalid(_) => "invalid",
            Self::Expired => "expired",
            Self::WrongNode { .. } => "wrong_node",
            Self::NotCollector(_) => "not_collector",
            Self::UnknownKey(_) => "unknown_key",
            Self::BadSignature => "bad_signature",
        }
    }
}

/// Who a record was accepted from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Accepted {
    /// The collector of the node the record claims.
    Node,
    /// The operator ServiceAccount, which may speak for any node.
    Operator,
}

/// Whose tokens are accepted.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Policy {
    /// The collector DaemonSet's ServiceAccount.
    pub collector: ServiceAccountRef,
    /// The operator ServiceAccount of `gpumedic inject`, when one is allowed.
    pub operator: Option<ServiceAccountRef>,
}

/// The decision for one record, from its token's review: accepted from whom, or refused why.
/// `node` is the record's `node` field, `key` its Kafka key.
///
/// # Errors
/// The [`Refusal`].
pub fn decide(review: &Review, node: &str, key: Option<&[u8]>, policy: &Policy) -> Result<Accepted, Refusal> {
    let (username, bound) = match review {
        Review::Refused(why) if why.contains("expired") => return Err(Refusal::Expired),
        Review::Refused(why) => return Err(Refusal::Invalid(why.clone())),
        Review::Authenticated { username, node } => (username, node),
    };
    if policy.operator.as_ref().is_some_and(|o| username == o.username()) {
        return Ok(Accepted::Operator);
    }
    if username != policy.collector.username() {
        return Err(Refusal::NotCollector(username.clone()));
    }
    if bound.as_deref() != Some(node) {
        return Err(Refusal::WrongNode { bound: bound.clone(), claimed: node.to_owned() });
    }
    if key != Some(node.as_bytes()) {
        let claimed = key.map_or_else(|| "(no key)".to_owned(), |k| String::from_utf8_lossy(k).into_owned());
        return Err(Refusal::WrongNode { bound: bound.clone(), claimed });
    }
    Ok(Accepted::Node)
}

/// The `exp` claim (seconds since the epoch) of a JWT, read without checking its signature;
/// `None` when `token` is not a JWT with one.
pub fn unverified_expiry(token: &[u8]) -> Option<i64> {
    #[derive(serde::Deserialize)]
    struct Claims {
        exp: i64,
    }
    let mut parts = token.split(|b| *b == b'.');
    let (_header, payload, _signature) = (parts.next()?, parts.next()?, parts.next()?);
    if parts.next().is_some() {
        return None;
    }
    let json = base64::engine::general_purpose::URL_SAFE_NO_PAD.decode(payload).ok()?;
    serde_json::from_slice::<Claims>(&json).ok().map(|c| c.exp)
}

/// Why tokens could not be checked. Never a reason to accept a record.
#[derive(Debug, thiserror::Error)]
pub enum AuthError {
    /// The apiserver did not answer a TokenReview (transient: the batch is retried).
    #[error("cannot review a node token with the apiserver: {0}")]
    Review(#[source] kube::Error),
}

/// Asks the apiserver about a token. The service's is [`KubeReviewer`]; unit tests and the bench
/// use fakes.
pub trait Reviewer: Send + Sync {
    /// Reviews `token` for [`AUDIENCE`].
    fn review(&self, token: &str) -> impl Future<Output = Result<Review, AuthError>> + Send;
}

/// Reviews tokens with `TokenReview` (authentication.k8s.io/v1); the enricher's ServiceAccount
/// may create them (k8s/base/enricher.yaml).
#[derive(Clone)]
pub struct KubeReviewer {
    api: Api<TokenReview>,
}

impl KubeReviewer {
    /// A reviewer through `client`.
    pub fn new(client: kube::Client) -> Self {
        Self { api: Api::all(client) }
    }
}

/// Reads a TokenReview's answer.
pub fn review_of(answer: &TokenReview) -> Review {
    let Some(status) = &answer.status else { return Review::Refused("the apiserver gave no status".into()) };
    if status.authenticated != Some(true) {
        return Review::Refused(status.error.clone().unwrap_or_else(|| "not authenticated".into()));
    }
    if !status.audiences.as_ref().is_some_and(|a| a.iter().any(|a| a == AUDIENCE)) {
        return Review::Refused(format!("not a token for audience {AUDIENCE}"));
    }
    let user = status.user.as_ref();
    let username = user.and_then(|u| u.username.clone()).unwrap_or_default();
    let node = user
        .and_then(|u| u.extra.as_ref())
        .and_then(|extra| extra.get(NODE_NAME_EXTRA))
        .and_then(|values| values.first())
        .cloned();
    Review::Authenticated { username, node }
}

impl Reviewer for KubeReviewer {
    async fn review(&self, token: &str) -> Result<Review, AuthError> {
        let request = TokenReview {
            spec: TokenReviewSpec { token: token.to_owned(), audiences: Some(vec![AUDIENCE.to_owned()]) },
            ..TokenReview::default()
        };
        match self.api.create(&PostParams::default(), &request).await {
            Ok(answer) => Ok(review_of(&answer)),
            // The apiserver refuses this request for what it carries (the token): a verdict on the
            // token, not an outage, or one bad record would stall its partition for ever.
            // Unauthorized and forbidden are about the enricher's own credentials, a timeout or
            // throttling about load: those are retried.
            Err(kube::Error::Api(status)) if refuses_the_token(status.code) => {
                Ok(Review::Refused(format!("the apiserver refused to review it ({}): {}", status.code, status.message)))
            }
            Err(e) => Err(AuthError::Review(e)),
        }
    }
}

/// Whether an apiserver error status answering a TokenReview is about the token sent (400, 413,
/// 422 and the like) rather than about the enricher's credentials (401, 403), an apiserver that
/// does not serve the API (404), or load (408, 429).
pub fn refuses_the_token(code: u16) -> bool {
    (400..500).contains(&code) && !matches!(code, 401 | 403 | 404 | 408 | 429)
}

type Digest = [u8; 32];

fn digest(token: &[u8]) -> Digest {
    let d = ring::digest::digest(&ring::digest::SHA256, token);
    let mut out = [0u8; 32];
    out.copy_from_slice(d.as_ref());
    out
}

#[derive(Debug, Clone)]
struct Entry {
    review: Arc<Review>,
    /// Unix seconds after which the review is not used.
    until: i64,
}

/// Checks records' tokens against [`Policy`], with the review cache. One per consumer task: no
/// lock on the hot path.
pub struct Verifier<R> {
    reviewer: R,
    policy: Policy,
    max_entries: usize,
    cache: HashMap<Digest, Entry>,
    /// The last token seen under each record key, and its cache entry: a node's records in a row
    /// are checked with a byte comparison.
    memo: HashMap<Vec<u8>, (Vec<u8>, Entry)>,
}

impl<R: Reviewer> Verifier<R> {
    /// A verifier keeping at most `max_entries` reviews.
    pub fn new(reviewer: R, policy: Policy, max_entries: usize) -> Self {
        Self { reviewer, policy, max_entries: max_entries.max(1), cache: HashMap::new(), memo: HashMap::new() }
    }

    /// Reviews in the cache.
    pub fn len(&self) -> usize {
        self.cache.len()
    }

    /// True when no review is cached.
    pub fn is_empty(&self) -> bool {
        self.cache.is_empty()
    }

    /// The cached review of `token` under `key` at `now`, if any.
    fn cached(&mut self, key: &[u8], token: &[u8], now: i64) -> Option<Arc<Review>> {
        if let Some((t, e)) = self.memo.get(key)
            && t == token
            && e.until > now
        {
            return Some(e.review.clone());
        }
        let entry = self.cache.get(&digest(token)).filter(|e| e.until > now)?.clone();
        if self.memo.len() >= self.max_entries {
            self.memo.clear();
        }
        let review = entry.review.clone();
        self.memo.insert(key.to_vec(), (token.to_vec(), entry));
        Some(review)
    }

    /// Makes sure every token among `records` (key, token; `None`: the record has no token) that
    /// needs a review has one: reviews the tokens not cached, a few at a time. Tokens that are not
    /// JWTs or have expired by their own claim are refused without asking. Returns each record's
    /// review, in the order given, for [`Verifier::check_reviewed`]: one cache look-up per record.
    ///
    /// # Errors
    /// [`AuthError::Review`] when the apiserver did not answer: nothing is cached for that token.
    pub async fn prepare<'a>(
        &mut self,
        records: impl IntoIterator<Item = (&'a [u8], Option<&'a [u8]>)>,
        now: i64,
    ) -> Result<Vec<Option<Arc<Review>>>, AuthError> {
        let mut found = Vec::new();
        let mut wanted: HashMap<Digest, (&'a [u8], i64)> = HashMap::new();
        // The records whose token was not cached, with its digest, filled in after the reviews.
        let mut pending: Vec<(usize, Digest)> = Vec::new();
        for (i, (key, token)) in records.into_iter().enumerate() {
            let review = token.filter(|t| t.len() <= MAX_TOKEN_BYTES).and_then(|t| self.cached(key, t, now));
            found.push(review.clone());
            let Some(token) = token.filter(|t| review.is_none() && t.len() <= MAX_TOKEN_BYTES) else { continue };
            let Some(exp) = unverified_expiry(token) else { continue };
            if exp <= now {
                continue;
            }
            let d = digest(token);
            wanted.entry(d).or_insert((token, exp));
            pending.push((i, d));
        }
        if wanted.is_empty() {
            return Ok(found);
        }
        // Owned, so the review futures borrow nothing of the batch (they must be Send for any
        // lifetime of it). A token that is not UTF-8 is not a JWT: unverified_expiry refused it.
        let wanted: Vec<(Digest, String, i64)> =
            wanted.into_iter().map(|(d, (token, exp))| (d, String::from_utf8_lossy(token).into_owned(), exp)).collect();
        let reviewer = &self.reviewer;
        let mut answers = futures::stream::iter(wanted)
            .map(|(d, text, exp)| async move { (d, exp, reviewer.review(&text).await) })
            .buffer_unordered(CONCURRENT_REVIEWS);
        let mut reviewed = Vec::new();
        let mut failed = None;
        while let Some((d, exp, answer)) = answers.next().await {
            match answer {
                Ok(review) => reviewed.push((d, exp, review)),
                Err(e) => failed = Some(e),
            }
        }
        drop(answers);
        metrics::counter!(names::TOKEN_REVIEWS_TOTAL).increment(reviewed.len() as u64);
        let mut fresh: HashMap<Digest, Arc<Review>> = HashMap::with_capacity(reviewed.len());
        for (d, exp, review) in reviewed {
            let lifetime = match review {
                Review::Authenticated { .. } => MAX_CACHE_LIFETIME,
                Review::Refused(_) => REFUSED_CACHE_LIFETIME,
            };
            let until = exp.min(now.saturating_add(lifetime.as_secs() as i64));
            let review = Arc::new(review);
            fresh.insert(d, review.clone());
            self.insert(d, Entry { review, until }, now);
        }
        if let Some(e) = failed {
            return Err(e);
        }
        for (i, d) in pending {
            found[i] = fresh.get(&d).cloned();
        }
        Ok(found)
    }

    fn insert(&mut self, d: Digest, entry: Entry, now: i64) {
        if self.cache.len() >= self.max_entries {
            self.cache.retain(|_, e| e.until > now);
        }
        if self.cache.len() >= self.max_entries {
            // Full of live reviews: forget the tenth that would expire first.
            let mut untils: Vec<i64> = self.cache.values().map(|e| e.until).collect();
            let cut = untils.len() / 10;
            let (_, limit, _) = untils.select_nth_unstable(cut);
            let limit = *limit;
            self.cache.retain(|_, e| e.until > limit);
            self.memo.clear();
        }
        self.cache.insert(d, entry);
        metrics::gauge!(names::TOKEN_CACHE_ENTRIES).set(self.cache.len() as f64);
    }

    /// The decision for one record after [`Verifier::prepare`] saw its token: `token` its header
    /// (`None`: missing), `node` its node field, `key` its key. Looks the review up again: the
    /// consumer uses [`Verifier::check_reviewed`] with what `prepare` returned.
    ///
    /// # Errors
    /// The [`Refusal`]. A token `prepare` could not review (it failed) is never accepted; the
    /// caller retries the batch instead of calling this.
    pub fn check(
        &mut self,
        token: Option<&[u8]>,
        node: &str,
        key: Option<&[u8]>,
        now: i64,
    ) -> Result<Accepted, Refusal> {
        let review = token
            .filter(|t| !t.is_empty() && t.len() <= MAX_TOKEN_BYTES)
            .and_then(|t| self.cached(key.unwrap_or_default(), t, now));
        self.check_reviewed(review.as_deref(), token, node, key, now)
    }

    /// The decision for one record, given the review [`Verifier::prepare`] returned for it
    /// (`None`: none, because the token is missing, oversized, not a JWT or expired by its claim).
    ///
    /// # Errors
    /// The [`Refusal`].
    pub fn check_reviewed(
        &self,
        review: Option<&Review>,
        token: Option<&[u8]>,
        node: &str,
        key: Option<&[u8]>,
        now: i64,
    ) -> Result<Accepted, Refusal> {
        let Some(token) = token.filter(|t| !t.is_empty()) else { return Err(Refusal::Missing) };
        if token.len() > MAX_TOKEN_BYTES {
            return Err(Refusal::Invalid(format!("longer than {MAX_TOKEN_BYTES} bytes")));
        }
        // A live cache entry never outlives the token's exp, so the hot path decodes nothing.
        if let Some(review) = review {
            return decide(review, node, key, &self.policy);
        }
        match unverified_expiry(token) {
            None => Err(Refusal::Invalid("not a JSON web token with an expiry".into())),
            Some(exp) if exp <= now => Err(Refusal::Expired),
            // Only when prepare was skipped or failed: refuse rather than accept unreviewed.
            Some(_) => Err(Refusal::Invalid("not reviewed".into())),
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Mutex;

    use super::*;

    fn policy() -> Policy {
        Policy {
            collector: ServiceAccountRef::parse("gpumedic:gpumedic-collector").unwrap(),
            operator: Some(ServiceAccountRef::parse("gpumedic:gpumedic-operator").unwrap()),
        }
    }

    fn collector_on(node: &str) -> Review {
        Review::Authenticated {
            username: "system:serviceaccount:gpumedic:gpumedic-collector".into(),
            node: Some(node.into()),
        }
    }

    /// A JWT-shaped token with this `exp` (the signature is not checked here; the fake reviewer
    /// decides).
    fn jwt(name: &str, exp: i64) -> Vec<u8> {
        let b64 = |s: &str| base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(s);
        format!("{}.{}.{}", b64(r#"{"alg":"RS256"}"#), b64(&format!(r#"{{"exp":{exp},"sub":"{name}"}}"#)), "sig")
            .into_bytes()
    }

    #[derive(Default)]
    struct Fake {
        answers: HashMap<Vec<u8>, Review>,
        asked: Mutex<Vec<Vec<u8>>>,
        down: bool,
    }

    impl Reviewer for &Fake {
        async fn review(&self, token: &str) -> Result<Review, AuthError> {
            self.asked.lock().unwrap().push(token.as_bytes().to_vec());
            if self.down {
                return Err(AuthError::Review(kube::Error::Service("the apiserver is down".into())));
            }
            Ok(self.answers.get(token.as_bytes()).cloned().unwrap_or(Review::Refused("invalid bearer token".into())))
        }
    }

    #[test]
    fn decisions_follow_the_node_the_token_is_bound_to() {
        let p = policy();
        let a = collector_on("node-a");
        assert_eq!(decide(&a, "node-a", Some(b"node-a"), &p), Ok(Accepted::Node));
        let wrong = decide(&a, "node-b", Some(b"node-b"), &p).unwrap_err();
        assert_eq!(wrong.to_string(), "node token for node node-a, record claims node-b");
        assert_eq!(wrong.label(), "wrong_node");
        // The key must agree as well: it decides the partition, and so the node's order.
        let wrong = decide(&a, "node-a", Some(b"node-b"), &p).unwrap_err();
        assert_eq!(wrong.to_string(), "node token for node node-a, record claims node-b");
        let unbound =
            Review::Authenticated { username: "system:serviceaccount:gpumedic:gpumedic-collector".into(), node: None };
        assert_eq!(
            decide(&unbound, "node-a", Some(b"node-a"), &p).unwrap_err().to_string(),
            "node token for node (none), record claims node-a"
        );
        let other =
            Review::Authenticated { username: "system:serviceaccount:ml:trainer".into(), node: Some("node-a".into()) };
        assert_eq!(
            decide(&other, "node-a", Some(b"node-a"), &p).unwrap_err().to_string(),
            "node token not the collector's service account: system:serviceaccount:ml:trainer"
        );
        let operator =
            Review::Authenticated { username: "system:serviceaccount:gpumedic:gpumedic-operator".into(), node: None };
        assert_eq!(decide(&operator, "node-b", Some(b"node-b"), &p), Ok(Accepted::Operator));
        let no_operator = Policy { operator: None, ..p.clone() };
        assert_eq!(decide(&operator, "node-b", Some(b"node-b"), &no_operator).unwrap_err().label(), "not_collector");
        assert_eq!(
            decide(&Review::Refused("service account token has expired".into()), "n", None, &p),
            Err(Refusal::Expired)
        );
        assert_eq!(
            decide(&Review::Refused("invalid bearer token".into()), "n", None, &p).unwrap_err().label(),
            "invalid"
        );
    }

    #[test]
    fn only_errors_about_the_token_are_verdicts_on_it() {
        for code in [400, 413, 422] {
            assert!(refuses_the_token(code), "{code}");
        }
        for code in [401, 403, 404, 408, 429, 500, 503] {
            assert!(!refuses_the_token(code), "{code}");
        }
    }

    #[tokio::test]
    async fn an_oversized_token_is_refused_without_asking() {
        let now = 1_800_000_000;
        let mut huge = jwt("huge", now + 600);
        huge.extend(std::iter::repeat_n(b'x', MAX_TOKEN_BYTES));
        let fake = Fake::default();
        let mut v = Verifier::new(&fake, policy(), 100);
        v.prepare([(&b"n"[..], Some(&huge[..]))], now).await.unwrap();
        assert!(fake.asked.lock().unwrap().is_empty());
        assert_eq!(v.check(Some(&huge), "n", Some(b"n"), now).unwrap_err().label(), "invalid");
    }

    #[test]
    fn the_expiry_is_read_from_a_jwt_and_anything_else_has_none() {
        assert_eq!(unverified_expiry(&jwt("a", 1_900_000_000)), Some(1_900_000_000));
        assert_eq!(unverified_expiry(b"garbage"), None);
        assert_eq!(unverified_expiry(b"a.b.c"), None);
        assert_eq!(unverified_expiry(b"a.e30.c"), None, "no exp claim");
        assert_eq!(unverified_expiry(b"a.b.c.d"), None);
    }

    #[test]
    fn parses_modes_and_service_accounts() {
        assert_eq!(NodeAuthMode::parse("enforce"), Ok(NodeAuthMode::Enforce));
        assert_eq!(NodeAuthMode::parse("off"), Ok(NodeAuthMode::Off));
        assert!(NodeAuthMode::parse("on").is_err());
        assert_eq!(ServiceAccountRef::parse("ns:sa").unwrap().username(), "system:serviceaccount:ns:sa");
        for bad in ["ns", ":sa", "ns:", "a:b:c"] {
            assert!(ServiceAccountRef::parse(bad).is_err(), "{bad}");
        }
    }

    #[tokio::test]
    async fn one_review_per_token_until_it_expires_and_none_for_what_is_not_a_live_jwt() {
        let now = 1_800_000_000;
        let a = jwt("a", now + 600);
        let forged = jwt("forged", now + 600);
        let old = jwt("old", now - 1);
        let fake = Fake { answers: HashMap::from([(a.clone(), collector_on("node-a"))]), ..Fake::default() };
        let mut v = Verifier::new(&fake, policy(), 100);
        let batch: Vec<(&[u8], Option<&[u8]>)> = vec![
            (b"node-a", Some(&a)),
            (b"node-a", Some(&a)),
            (b"node-b", Some(&a)),
            (b"node-b", Some(&forged)),
            (b"node-c", Some(&old)),
            (b"node-c", Some(b"garbage")),
            (b"node-c", None),
        ];
        let reviews = v.prepare(batch.iter().copied(), now).await.unwrap();
        // What prepare returns decides each record as check does.
        let decided: Vec<_> = batch
            .iter()
            .zip(&reviews)
            .map(|((key, token), review)| {
                let node = std::str::from_utf8(key).unwrap();
                v.check_reviewed(review.as_deref(), *token, node, Some(key), now).map_err(|r| r.label())
            })
            .collect();
        assert_eq!(
            decided,
            [
                Ok(Accepted::Node),
                Ok(Accepted::Node),
                Err("wrong_node"),
                Err("invalid"),
                Err("expired"),
                Err("invalid"),
                Err("missing")
            ]
        );
        assert_eq!(fake.asked.lock().unwrap().len(), 2, "a and the forged token, once each");
        assert_eq!(v.check(Some(&a), "node-a", Some(b"node-a"), now), Ok(Accepted::Node));
        assert_eq!(v.check(Some(&a), "node-b", Some(b"node-b"), now).unwrap_err().label(), "wrong_node");
        assert_eq!(v.check(Some(&forged), "node-b", Some(b"node-b"), now).unwrap_err().label(), "invalid");
        assert_eq!(v.check(Some(&old), "node-c", Some(b"node-c"), now), Err(Refusal::Expired));
        assert_eq!(v.check(Some(b"garbage"), "node-c", Some(b"node-c"), now).unwrap_err().label(), "invalid");
        assert_eq!(v.check(None, "node-c", Some(b"node-c"), now), Err(Refusal::Missing));
        // Cached: the next batch asks nothing.
        let again = v.prepare(batch.iter().copied(), now + 30).await.unwrap();
        assert_eq!(fake.asked.lock().unwrap().len(), 2);
        assert_eq!(again, reviews, "the same reviews, from the cache");
        // Past its exp the cached review is not used, and the token is expired by its claim.
        assert_eq!(v.check(Some(&a), "node-a", Some(b"node-a"), now + 600), Err(Refusal::Expired));
    }

    #[tokio::test]
    async fn an_apiserver_that_does_not_answer_accepts_nothing() {
        let now = 1_800_000_000;
        let a = jwt("a", now + 600);
        let fake =
            Fake { answers: HashMap::from([(a.clone(), collector_on("node-a"))]), down: true, ..Fake::default() };
        let mut v = Verifier::new(&fake, policy(), 100);
        assert!(v.prepare([(&b"node-a"[..], Some(&a[..]))], now).await.is_err());
        assert!(v.is_empty());
        assert!(v.check(Some(&a), "node-a", Some(b"node-a"), now).is_err(), "never accepted unreviewed");
    }

    #[tokio::test]
    async fn the_cache_stays_within_its_bound() {
        let now = 1_800_000_000;
        let tokens: Vec<Vec<u8>> = (0..50).map(|i| jwt(&format!("t{i}"), now + 100 + i)).collect();
        let fake = Fake { answers: tokens.iter().map(|t| (t.clone(), collector_on("n"))).collect(), ..Fake::default() };
        let mut v = Verifier::new(&fake, policy(), 20);
        for t in &tokens {
            v.prepare([(&b"n"[..], Some(&t[..]))], now).await.unwrap();
            assert!(v.len() <= 20);
        }
        assert_eq!(v.check(Some(&tokens[49]), "n", Some(b"n"), now), Ok(Accepted::Node), "the newest is kept");
    }
}
