//! Repair hooks: how a step of the escalation ladder ([`crate::ladder`]) reaches whatever repairs
//! nodes. Two kinds, either or both:
//!
//! - a **webhook**: an HTTPS POST of a JSON body ([`WebhookBody`]) signed with HMAC-SHA256 under
//!   shared keys ([`sign`]: `X-Gpumedic-Timestamp`, `X-Gpumedic-Key-Id`,
//!   `X-Gpumedic-Signature: v1=<hex>` over `<key id>.<timestamp>.<body>`, one signature per key
//!   during a rotation), with an `Idempotency-Key` of `<verdict id>:<step>`, the same across
//!   retries, restarts and failovers, so the receiver does each step once. [`verify`] is what a
//!   receiver does (`gpumedic hooks verify` runs it on a dumped request). Connection errors, timeouts, 5xx and 429 are retried
//!   with exponential backoff; any other answer but 2xx fails the step at once. A 2xx means the
//!   receiver took the work, not that the node is repaired: success then comes from healthy
//!   evidence (a recovery verdict) before the step's timeout.
//! - a **custom resource** for a repair controller, rendered from a template of any
//!   apiVersion/kind with the node, GPU, action and verdict filled in, and created under a name
//!   derived from the verdict and the step ([`resource_name`]), so a retry or a new leader finds it
//!   instead of creating a second. The controller reports through a status field (`status.phase`
//!   by default): `Succeeded` ends the ladder, `Failed` escalates.
//!
//! The same hooks validate a node before it returns to service (`--validation webhook|resource`,
//! see [`crate::validate`]): asked for the action [`VALIDATE_ACTION`], the webhook under its own
//! idempotency key ([`validation_key`]) at every look, answering with the validation's state
//! ([`answer_of`]), the custom resource under the validation's name, reporting as a repair does.
//!
//! The signature and its check, the body, the retry classification, the template rendering and the phase
//! reading are pure and tested here; [`Webhook`], [`CustomResource`] and [`Hooks`] are the edge.

use std::sync::Arc;
use std::time::Duration;

use chrono::{DateTime, Utc};
use kube::api::{Api, ApiResource, DynamicObject, PostParams};
use kube::core::GroupVersionKind;
use kube::discovery::Scope;
use serde::Serialize;
use serde_json::{Value, json};

use crate::ladder::{Ladder, Report};

/// The header carrying the signatures: `v1=<hex>`, one per signing key, comma separated, in the
/// order of [`KEY_ID_HEADER`].
pub const SIGNATURE_HEADER: &str = "X-Gpumedic-Signature";
/// The header carrying the time of the attempt (Unix seconds); it is signed.
pub const TIMESTAMP_HEADER: &str = "X-Gpumedic-Timestamp";
/// The header naming the keys that signed, comma separated (the current key first); each id is
/// signed by its own signature.
pub const KEY_ID_HEADER: &str = "X-Gpumedic-Key-Id";
/// The header carrying the idempotency key.
pub const IDEMPOTENCY_HEADER: &str = "Idempotency-Key";
/// The id of a key configured without one (the single secret of `--repair-webhook-secret`).
pub const DEFAULT_KEY_ID: &str = "default";
/// The longest key id.
pub const MAX_KEY_ID_LEN: usize = 64;
/// The label on every custom resource gpumedic creates, naming the node.
pub const NODE_LABEL: &str = "gpumedic.io/node";
/// The label on every custom resource gpumedic creates, naming the verdict (sanitised).
pub const VERDICT_LABEL: &str = "gpumedic.io/verdict-id";

/// The prefix of a signature of the current scheme (HMAC-SHA256 of `<key id>.<timestamp>.<body>`).
const SCHEME_V1: &str = "v1=";

/// Why a step could not be handed to the hooks.
#[derive(Debug, thiserror::Error)]
pub enum HookError {
    /// The receiver refused the step for good (a 4xx other than 429, a template the API server
    /// rejects): the step has failed.
    #[error("the repair hook refused the step: {0}")]
    Refused(String),
    /// The receiver could not be reached or kept failing through every retry: the step stays
    /// pending and is tried again at the next look, until its timeout.
    #[error("the repair hook is unavailable: {0}")]
    Unavailable(String),
    /// The webhook client could not be built (a bad CA bundle).
    #[error("cannot build the webhook client: {0}")]
    Client(String),
}

/// A secret that does not print itself.
#[derive(Clone, PartialEq, Eq)]
pub struct Secret(pub Vec<u8>);

impl std::fmt::Debug for Secret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Secret(<redacted>)")
    }
}

/// Reads a secret from a file (a mounted Secret); trailing newlines are not part of it.
pub fn read_secret(path: &std::path::Path) -> Result<Secret, String> {
    let mut bytes = std::fs::read(path).map_err(|e| format!("cannot read {}: {e}", path.display()))?;
    while bytes.last().is_some_and(|c| *c == b'\n' || *c == b'\r') {
        bytes.pop();
    }
    Ok(Secret(bytes))
}

/// Why a signing key is unusable.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum KeyError {
    /// The id is empty.
    #[error("the key id is empty")]
    EmptyId,
    /// The id is longer than [`MAX_KEY_ID_LEN`].
    #[error("the key id '{0}' is longer than {MAX_KEY_ID_LEN} characters")]
    LongId(String),
    /// The id holds a character outside `[A-Za-z0-9._-]` (a comma would split the header).
    #[error("the key id '{id}' holds {bad:?}; use letters, digits, '.', '_' and '-' only")]
    BadId {
        /// The id as given.
        id: String,
        /// The first character not allowed.
        bad: char,
    },
    /// The secret is empty.
    #[error("the key '{0}' is empty")]
    EmptySecret(String),
    /// Two keys share an id, so a receiver could not tell them apart.
    #[error("two keys have the id '{0}'")]
    DuplicateId(String),
}

/// Checks a key id: 1 to [`MAX_KEY_ID_LEN`] characters of `[A-Za-z0-9._-]`.
pub fn check_key_id(id: &str) -> Result<(), KeyError> {
    if id.is_empty() {
        return Err(KeyError::EmptyId);
    }
    if let Some(bad) = id.chars().find(|c| !(c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-'))) {
        return Err(KeyError::BadId { id: id.to_owned(), bad });
    }
    if id.len() > MAX_KEY_ID_LEN {
        return Err(KeyError::LongId(id.to_owned()));
    }
    Ok(())
}

/// A signing key and the id receivers know it by.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Key {
    id: String,
    secret: Secret,
}

impl Key {
    /// A key named `id`; refuses a bad id ([`check_key_id`]) or an empty secret.
    pub fn new(id: &str, secret: Secret) -> Result<Self, KeyError> {
        check_key_id(id)?;
        if secret.0.is_empty() {
            return Err(KeyError::EmptySecret(id.to_owned()));
        }
        Ok(Self { id: id.to_owned(), secret })
    }

    /// The key's id.
    pub fn id(&self) -> &str {
        &self.id
    }

    fn hmac_key(&self) -> ring::hmac::Key {
        ring::hmac::Key::new(ring::hmac::HMAC_SHA256, &self.secret.0)
    }
}

/// The signed content: `<key id>.<timestamp>.<body>`, so neither the time nor the key id can be
/// changed without the key.
fn signed_content(key_id: &str, timestamp: &str, body: &[u8]) -> Vec<u8> {
    let mut content = Vec::with_capacity(key_id.len() + timestamp.len() + body.len() + 2);
    content.extend_from_slice(key_id.as_bytes());
    content.push(b'.');
    content.extend_from_slice(timestamp.as_bytes());
    content.push(b'.');
    content.extend_from_slice(body);
    content
}

/// The keys the remediator signs with: the current one and, during a rotation, the previous one.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Keyring {
    keys: Vec<Key>,
}

impl Keyring {
    /// The keys `current` and, while receivers move to it, `previous`; their ids must differ.
    pub fn new(current: Key, previous: Option<Key>) -> Result<Self, KeyError> {
        if let Some(p) = &previous
            && p.id == current.id
        {
            return Err(KeyError::DuplicateId(p.id.clone()));
        }
        Ok(Self { keys: std::iter::once(current).chain(previous).collect() })
    }

    /// The keys, the current one first.
    pub fn keys(&self) -> &[Key] {
        &self.keys
    }
}

/// The values of the three signature headers of one request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SignatureHeaders {
    /// [`TIMESTAMP_HEADER`]: Unix seconds.
    pub timestamp: String,
    /// [`KEY_ID_HEADER`]: the signing keys' ids, comma separated.
    pub key_ids: String,
    /// [`SIGNATURE_HEADER`]: `v1=<hex>` per key, comma separated, in the order of the ids.
    pub signatures: String,
}

impl SignatureHeaders {
    /// The headers as (name, value) pairs.
    pub fn pairs(&self) -> [(&'static str, &str); 3] {
        [(TIMESTAMP_HEADER, &self.timestamp), (KEY_ID_HEADER, &self.key_ids), (SIGNATURE_HEADER, &self.signatures)]
    }
}

/// Signs `body` sent at `timestamp` (Unix seconds) with every key in `keys`: for each key, the
/// HMAC-SHA256 of `<key id>.<timestamp>.<body>`, so a receiver holding any one of them verifies.
pub fn sign(keys: &[Key], timestamp: i64, body: &[u8]) -> SignatureHeaders {
    let timestamp = timestamp.to_string();
    let key_ids = keys.iter().map(Key::id).collect::<Vec<_>>().join(",");
    let signatures = keys
        .iter()
        .map(|k| {
            let tag = ring::hmac::sign(&k.hmac_key(), &signed_content(&k.id, &timestamp, body));
            format!("{SCHEME_V1}{}", hex::encode(tag.as_ref()))
        })
        .collect::<Vec<_>>()
        .join(",");
    SignatureHeaders { timestamp, key_ids, signatures }
}

/// A request as a receiver got it: the three signature headers (`None` when absent) and the raw
/// body bytes.
#[derive(Debug, Clone, Copy)]
pub struct Delivery<'a> {
    /// The [`TIMESTAMP_HEADER`] value.
    pub timestamp: Option<&'a str>,
    /// The [`KEY_ID_HEADER`] value.
    pub key_ids: Option<&'a str>,
    /// The [`SIGNATURE_HEADER`] value.
    pub signatures: Option<&'a str>,
    /// The body, exactly as received.
    pub body: &'a [u8],
}

impl<'a> Delivery<'a> {
    /// The delivery of `body` with the headers `header` finds by name (HTTP header names are
    /// case-insensitive: the lookup should be too).
    pub fn from_headers(body: &'a [u8], header: impl Fn(&str) -> Option<&'a str>) -> Self {
        Self {
            timestamp: header(TIMESTAMP_HEADER),
            key_ids: header(KEY_ID_HEADER),
            signatures: header(SIGNATURE_HEADER),
            body,
        }
    }
}

/// A request that passed [`verify`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Verified {
    /// The id of the key whose signature matched.
    pub key_id: String,
    /// Seconds between the signed timestamp and now; negative when the sender's clock is ahead.
    pub age_seconds: i64,
}

/// Why a receiver must refuse a request; each message starts with the short reason.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum VerifyError {
    /// A signature header is missing or empty.
    #[error("missing header: the request has no {0}")]
    MissingHeader(&'static str),
    /// A signature header cannot be read.
    #[error("malformed header: {header}: {why}")]
    Malformed {
        /// The header.
        header: &'static str,
        /// What is wrong with it.
        why: String,
    },
    /// None of the keys that signed is known here.
    #[error("unknown key id: the request is signed by {0}, and no key here has that id")]
    UnknownKeyId(String),
    /// A known key signed, but the signature does not match what arrived.
    #[error(
        "bad signature: the signature by key {0} does not match the body, timestamp and key id \
         (changed on the way, or signed with another key under that id)"
    )]
    BadSignature(String),
    /// Signed longer ago than the tolerance.
    #[error("too old: signed {} ago, more than the {} tolerance (a replay, or a request held too long)", human_seconds(*age_seconds), human_seconds(*tolerance_seconds))]
    TooOld {
        /// How long ago it was signed.
        age_seconds: u64,
        /// The tolerance.
        tolerance_seconds: u64,
    },
    /// Signed further in the future than the tolerance.
    #[error("too far in the future: signed {} ahead of this clock, more than the {} tolerance (check both clocks)", human_seconds(*ahead_seconds), human_seconds(*tolerance_seconds))]
    TooNew {
        /// How far ahead of now it was signed.
        ahead_seconds: u64,
        /// The tolerance.
        tolerance_seconds: u64,
    },
}

/// What a receiver does with a request: checks that a key it knows (`keys`, by id) signed the
/// timestamp, the key id and the body, in constant time, and then that the timestamp is within
/// `tolerance` of `now` (Unix seconds) either way, so a captured request cannot be replayed later.
/// The signature is checked first: a refusal for age is about a request that is authentic.
pub fn verify(delivery: &Delivery<'_>, keys: &[Key], tolerance: Duration, now: i64) -> Result<Verified, VerifyError> {
    fn present<'v>(value: Option<&'v str>, header: &'static str) -> Result<&'v str, VerifyError> {
        value.map(str::trim).filter(|v| !v.is_empty()).ok_or(VerifyError::MissingHeader(header))
    }
    let timestamp = present(delivery.timestamp, TIMESTAMP_HEADER)?;
    let key_ids = present(delivery.key_ids, KEY_ID_HEADER)?;
    let signatures = present(delivery.signatures, SIGNATURE_HEADER)?;
    let signed_at =
        timestamp.bytes().all(|b| b.is_ascii_digit()).then(|| timestamp.parse::<i64>().ok()).flatten().ok_or_else(
            || VerifyError::Malformed { header: TIMESTAMP_HEADER, why: format!("'{timestamp}' is not Unix seconds") },
        )?;
    let ids: Vec<&str> = key_ids.split(',').map(str::trim).collect();
    let tags: Vec<&str> = signatures.split(',').map(str::trim).collect();
    if ids.len() != tags.len() {
        return Err(VerifyError::Malformed {
            header: SIGNATURE_HEADER,
            why: format!("{} signature(s) for {} key id(s) in {KEY_ID_HEADER}", tags.len(), ids.len()),
        });
    }
    let mut known = Vec::new();
    let mut matched = None;
    for (id, tag) in ids.iter().zip(&tags) {
        let Some(key) = keys.iter().find(|k| k.id == *id) else { continue };
        known.push(*id);
        // Another scheme's signature (a later version) is no match for this one.
        let Some(tag) = tag.strip_prefix(SCHEME_V1).and_then(|h| hex::decode(h).ok()) else { continue };
        if ring::hmac::verify(&key.hmac_key(), &signed_content(id, timestamp, delivery.body), &tag).is_ok() {
            matched = Some(key.id.clone());
            break;
        }
    }
    let Some(key_id) = matched else {
        return Err(if known.is_empty() {
            VerifyError::UnknownKeyId(ids.join(", "))
        } else {
            VerifyError::BadSignature(known.join(", "))
        });
    };
    let age_seconds = now.saturating_sub(signed_at);
    let tolerance_seconds = tolerance.as_secs();
    if age_seconds.unsigned_abs() > tolerance_seconds {
        return Err(if age_seconds > 0 {
            VerifyError::TooOld { age_seconds: age_seconds.unsigned_abs(), tolerance_seconds }
        } else {
            VerifyError::TooNew { ahead_seconds: age_seconds.unsigned_abs(), tolerance_seconds }
        });
    }
    Ok(Verified { key_id, age_seconds })
}

/// Seconds as a short human duration: `45s`, `10m`, `9m 58s`, `2h 5m`, `3d 4h`.
pub fn human_seconds(secs: u64) -> String {
    let (d, h, m, s) = (secs / 86_400, secs / 3_600 % 24, secs / 60 % 60, secs % 60);
    let parts: Vec<String> = [(d, "d"), (h, "h"), (m, "m"), (s, "s")]
        .iter()
        .skip_while(|(n, _)| *n == 0)
        .take(2)
        .filter(|(n, _)| *n > 0)
        .map(|(n, unit)| format!("{n}{unit}"))
        .collect();
    if parts.is_empty() { "0s".to_owned() } else { parts.join(" ") }
}

/// The idempotency key of step `step` (from 1) of the ladder started by `verdict_id`.
pub fn idempotency_key(verdict_id: &str, step: usize) -> String {
    format!("{verdict_id}:{step}")
}

/// The action a validation step asks of the hooks (`--validation webhook` or `resource`): the
/// webhook body's `action`, the resource template's `{{action}}`.
pub const VALIDATE_ACTION: &str = "validate";

/// The idempotency key of the validation after step `step` of the ladder started by
/// `verdict_id`: the step's key with `:validate`, the same at every look (a second validation at
/// the same step adds [`crate::ladder::Ladder::validation_suffix`]).
pub fn validation_key(verdict_id: &str, step: usize) -> String {
    format!("{}:{VALIDATE_ACTION}", idempotency_key(verdict_id, step))
}

/// The GPU in a webhook body.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct WebhookGpu {
    /// The GPU's UUID.
    pub uuid: String,
    /// Its PCI bus id.
    pub pci_bus_id: String,
    /// Its NVML index; `null` when the verdict does not know it.
    pub index: Option<u32>,
}

/// The JSON body of a webhook call (see docs/operations.md for the contract).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct WebhookBody {
    /// The verdict that started the ladder.
    pub verdict_id: String,
    /// Its incident.
    pub incident_id: String,
    /// The node to repair.
    pub node: String,
    /// The faulty GPU, when the verdict names one.
    pub gpu: Option<WebhookGpu>,
    /// The repair asked for (`reset_gpu`, `reboot_node`, `replace_node`, `contact_support`).
    pub action: String,
    /// The step's number in the ladder, from 1.
    pub step: usize,
    /// How many steps the ladder has.
    pub steps: usize,
    /// The attempt of this step's call, from 1 (a receiver deduplicates on the key, not on this).
    pub attempt: u32,
    /// The step's timeout: the receiver has this long before gpumedic escalates.
    pub timeout_seconds: u64,
    /// The condition reason (`Xid79`).
    pub reason: String,
    /// The verdict's sentence for humans.
    pub message: String,
    /// When this attempt was sent (RFC 3339); receivers should refuse stale ones.
    pub timestamp: String,
}

impl WebhookBody {
    /// The body for attempt `attempt` of the current step of `ladder`, sent at `now`.
    pub fn new(ladder: &Ladder, attempt: u32, now: DateTime<Utc>) -> Self {
        Self::asking(ladder, ladder.step_name(), ladder.step().timeout_seconds, attempt, now)
    }

    /// The body asking for `action` (a repair, a custom action's name, or [`VALIDATE_ACTION`])
    /// about the current step of `ladder`, within `timeout_seconds`: attempt `attempt`, sent at `now`.
    pub fn asking(ladder: &Ladder, action: String, timeout_seconds: u64, attempt: u32, now: DateTime<Utc>) -> Self {
        let r = &ladder.request;
        Self {
            verdict_id: ladder.verdict_id.clone(),
            incident_id: r.incident_id.clone(),
            node: r.node.clone(),
            gpu: r.gpu.as_ref().map(|g| WebhookGpu {
                uuid: g.uuid.clone(),
                pci_bus_id: g.pci_bus_id.clone(),
                index: g.index,
            }),
            action,
            step: ladder.step_number(),
            steps: ladder.steps.len(),
            attempt,
            timeout_seconds,
            reason: r.reason.clone(),
            message: r.message.clone(),
            timestamp: now.to_rfc3339_opts(chrono::SecondsFormat::Secs, true),
        }
    }
}

/// What one webhook answer means.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Answer {
    /// Taken.
    Accepted,
    /// Try again after a backoff (5xx, 429, 408).
    Retry,
    /// Refused for good (any other status).
    Refused,
}

/// Classifies an HTTP status of a webhook answer.
pub fn classify(status: u16) -> Answer {
    match status {
        200..=299 => Answer::Accepted,
        408 | 429 | 500..=599 => Answer::Retry,
        _ => Answer::Refused,
    }
}

/// The wait before retry `attempt` (from 1): `initial` doubled each time, at most 30 s.
pub fn backoff(initial: Duration, attempt: u32) -> Duration {
    initial.saturating_mul(1 << attempt.saturating_sub(1).min(16)).min(Duration::from_secs(30))
}

/// The webhook's settings, from the flags.
#[derive(Debug, Clone)]
pub struct WebhookSettings {
    /// Where to POST.
    pub url: reqwest::Url,
    /// The keys shared with the receiver: every request is signed with each.
    pub keys: Keyring,
    /// One request's time limit.
    pub timeout: Duration,
    /// Attempts per call, the first included.
    pub attempts: u32,
    /// The first backoff; it doubles.
    pub backoff: Duration,
    /// Extra trusted CA certificates (PEM), for a receiver behind a private CA.
    pub ca_pem: Option<Vec<u8>>,
}

/// The webhook edge.
#[derive(Clone)]
pub struct Webhook {
    client: reqwest::Client,
    settings: WebhookSettings,
}

impl Webhook {
    /// A client for `settings`: rustls, no redirects (a signed POST is not re-sent elsewhere).
    pub fn new(settings: WebhookSettings) -> Result<Self, HookError> {
        let mut builder = reqwest::Client::builder()
            .use_rustls_tls()
            .timeout(settings.timeout)
            .redirect(reqwest::redirect::Policy::none())
            .user_agent(concat!("gpumedic-remediator/", env!("CARGO_PKG_VERSION")));
        if let Some(pem) = &settings.ca_pem {
            let certs = reqwest::Certificate::from_pem_bundle(pem).map_err(|e| HookError::Client(e.to_string()))?;
            if certs.is_empty() {
                return Err(HookError::Client("the CA bundle holds no certificate".to_owned()));
            }
            for cert in certs {
                builder = builder.add_root_certificate(cert);
            }
        }
        let client = builder.build().map_err(|e| HookError::Client(e.to_string()))?;
        let key_ids: Vec<&str> = settings.keys.keys().iter().map(Key::id).collect();
        tracing::info!(url = %settings.url, key_ids = %key_ids.join(","), "The repair webhook signs every request with each of these keys.");
        Ok(Self { client, settings })
    }

    /// Calls the webhook for the current step of `ladder`, retrying what may be retried;
    /// returns how many attempts it took.
    pub async fn call(&self, ladder: &Ladder) -> Result<u32, HookError> {
        let key = idempotency_key(&ladder.verdict_id, ladder.step_number());
        let delivered = self.deliver(&key, |attempt, now| WebhookBody::new(ladder, attempt, now)).await?;
        Ok(delivered.attempts)
    }

    /// Asks the webhook how the validation after the current step of `ladder` goes (`timeout`:
    /// how long it may take in all), under the same key at every look: the receiver starts the
    /// validation on the first request and answers each with its state, in the shape of a repair
    /// resource's status (`{"status": {"phase": "Succeeded", "message": "..."}}`; `Failed`, or
    /// anything else while it runs). See [`answer_of`]. `key` is the validation's idempotency
    /// key as recorded when it started ([`validation_key`], with the ladder's
    /// [`Ladder::validation_suffix`] for a second validation at the same step).
    pub async fn validate(
        &self,
        ladder: &Ladder,
        key: &str,
        timeout: Duration,
    ) -> Result<(Report, Option<String>), HookError> {
        let secs = timeout.as_secs().max(1);
        let delivered = self
            .deliver(key, |attempt, now| WebhookBody::asking(ladder, VALIDATE_ACTION.to_owned(), secs, attempt, now))
            .await?;
        Ok(answer_of(&delivered.body))
    }

    /// POSTs the body `make_body` makes for each attempt (attempt number, time) under `key`,
    /// signed, retrying what may be retried; returns the attempts it took and the accepted
    /// answer's body.
    async fn deliver(
        &self,
        key: &str,
        make_body: impl Fn(u32, DateTime<Utc>) -> WebhookBody,
    ) -> Result<Delivered, HookError> {
        let mut last = String::new();
        for attempt in 1..=self.settings.attempts.max(1) {
            if attempt > 1 {
                tokio::time::sleep(backoff(self.settings.backoff, attempt - 1)).await;
            }
            let now = Utc::now();
            let body = serde_json::to_vec(&make_body(attempt, now)).expect("the body serializes");
            let mut request = self
                .client
                .post(self.settings.url.clone())
                .header(reqwest::header::CONTENT_TYPE, "application/json")
                .header(IDEMPOTENCY_HEADER, key);
            for (name, value) in sign(self.settings.keys.keys(), now.timestamp(), &body).pairs() {
                request = request.header(name, value);
            }
            let sent = request.body(body).send().await;
            let (answer, what, answered) = match sent {
                Ok(response) => {
                    let status = response.status().as_u16();
                    let answer = classify(status);
                    // Only a taken request's answer is read (a validation's state); a body that
                    // cannot be read reads as empty (still running).
                    let answered = if answer == Answer::Accepted {
                        response.bytes().await.map(|b| b.to_vec()).unwrap_or_default()
                    } else {
                        Vec::new()
                    };
                    (answer, format!("HTTP {status}"), answered)
                }
                Err(e) => (Answer::Retry, format!("{e}"), Vec::new()),
            };
            let result = match answer {
                Answer::Accepted => "accepted",
                Answer::Retry => "retried",
                Answer::Refused => "refused",
            };
            metrics::counter!(crate::events::names::WEBHOOK_REQUESTS_TOTAL, "result" => result).increment(1);
            match answer {
                Answer::Accepted => return Ok(Delivered { attempts: attempt, body: answered }),
                Answer::Refused => return Err(HookError::Refused(format!("{what} for {key}"))),
                Answer::Retry => {
                    tracing::warn!(%key, attempt, answer = %what, "The repair webhook did not take the step; retrying.");
                    last = what;
                }
            }
        }
        Err(HookError::Unavailable(format!("{last} after {} attempts for {key}", self.settings.attempts.max(1))))
    }
}

/// A request the webhook took.
struct Delivered {
    /// The attempts it took, from 1.
    attempts: u32,
    /// The body of the answer.
    body: Vec<u8>,
}

/// What a webhook's answer to a validation request says: the answer read as a repair resource's
/// status (`status.phase`, see [`report_of`]), with its `status.message`; an empty or unreadable
/// body, or one without a phase, is a validation still running.
pub fn answer_of(body: &[u8]) -> (Report, Option<String>) {
    let answer: Value = serde_json::from_slice(body).unwrap_or(Value::Null);
    (report_from(&answer, "status.phase", "the validation webhook"), status_message(&answer))
}

/// The custom resource hook's settings, from the flags.
#[derive(Debug, Clone)]
pub struct ResourceSettings {
    /// The template (YAML parsed to JSON), with `{{...}}` placeholders in its strings.
    pub template: Value,
    /// The dotted path of the field the repair controller reports in (`status.phase`).
    pub status_path: String,
    /// The namespace of a namespaced kind whose template names none (the remediator's own).
    pub default_namespace: String,
}

/// Checks a template: an object with apiVersion and kind. Returns its group/version/kind.
pub fn template_kind(template: &Value) -> Result<GroupVersionKind, String> {
    let api_version = template["apiVersion"].as_str().ok_or("the template has no apiVersion")?;
    let kind = template["kind"].as_str().ok_or("the template has no kind")?;
    let (group, version) = api_version.rsplit_once('/').unwrap_or(("", api_version));
    if version.is_empty() || kind.is_empty() {
        return Err(format!("'{api_version}' / '{kind}' does not name a kind"));
    }
    Ok(GroupVersionKind::gvk(group, version, kind))
}

/// The name of the resource for step `step` of the ladder started by `verdict_id`: the same for
/// every attempt, so creating it twice finds the first.
pub fn resource_name(verdict_id: &str, step: usize) -> String {
    let id: String =
        verdict_id.to_ascii_lowercase().chars().map(|c| if c.is_ascii_alphanumeric() { c } else { '-' }).collect();
    let mut name = format!("gpumedic-{}-{step}", id.trim_matches('-'));
    name.truncate(253);
    name
}

/// Renders the template for the current step of `ladder`: every `{{key}}` in its strings is
/// replaced (`node`, `gpu_uuid`, `gpu_index`, `pci_bus_id`, `action`, `step`, `verdict_id`,
/// `incident_id`, `reason`, `message`, `name`), working on parsed values so a value cannot change the
/// document's shape; then the name and gpumedic's labels are set.
pub fn render(template: &Value, ladder: &Ladder) -> Value {
    render_as(template, ladder, &ladder.step_name(), &resource_name(&ladder.verdict_id, ladder.step_number()))
}

/// Renders the template as [`render`] does, asking for `action` under the name `name` (the
/// validation after a step: [`VALIDATE_ACTION`], under the validation's own name).
pub fn render_as(template: &Value, ladder: &Ladder, action: &str, name: &str) -> Value {
    let r = &ladder.request;
    let name = name.to_owned();
    let gpu = r.gpu.as_ref();
    let vars: [(&str, String); 11] = [
        ("node", r.node.clone()),
        ("gpu_uuid", gpu.map(|g| g.uuid.clone()).unwrap_or_default()),
        ("gpu_index", gpu.and_then(|g| g.index).map(|i| i.to_string()).unwrap_or_default()),
        ("pci_bus_id", gpu.map(|g| g.pci_bus_id.clone()).unwrap_or_default()),
        ("action", action.to_owned()),
        ("step", ladder.step_number().to_string()),
        ("verdict_id", ladder.verdict_id.clone()),
        ("incident_id", r.incident_id.clone()),
        ("reason", r.reason.clone()),
        ("message", r.message.clone()),
        ("name", name.clone()),
    ];
    let mut object = template.clone();
    fill_template(&mut object, &vars);
    if !object["metadata"].is_object() {
        object["metadata"] = json!({});
    }
    object["metadata"]["name"] = json!(name);
    if !object["metadata"]["labels"].is_object() {
        object["metadata"]["labels"] = json!({});
    }
    let label = |s: &str| -> String {
        let mut v: String =
            s.chars().map(|c| if c.is_ascii_alphanumeric() || "-_.".contains(c) { c } else { '-' }).collect();
        v.truncate(63);
        v.trim_matches(|c: char| !c.is_ascii_alphanumeric()).to_owned()
    };
    object["metadata"]["labels"][NODE_LABEL] = json!(label(&r.node));
    object["metadata"]["labels"][VERDICT_LABEL] = json!(label(&ladder.verdict_id));
    object
}

/// What the repair controller reports in `object` at the dotted `path`: `Succeeded` or `Failed`
/// (any case), with `status.message` as the reason of a failure; anything else is still working.
pub fn report_of(object: &Value, path: &str) -> Report {
    report_from(object, path, "the repair controller")
}

/// What `who` reports in `object` at the dotted `path`, as [`report_of`] reads it.
pub fn report_from(object: &Value, path: &str, who: &str) -> Report {
    let phase = path.split('.').filter(|p| !p.is_empty()).try_fold(object, |v, key| v.get(key)).and_then(Value::as_str);
    match phase.map(str::to_ascii_lowercase).as_deref() {
        Some("succeeded") => Report::Succeeded,
        Some("failed") => Report::Failed(
            status_message(object)
                .map_or_else(|| format!("{who} reported Failed"), |m| format!("{who} reported Failed: {m}")),
        ),
        _ => Report::Working,
    }
}

/// The `status.message` a hook reported beside its phase, if any (trimmed, at most 512
/// characters: it goes into outcomes and Events).
pub fn status_message(object: &Value) -> Option<String> {
    let m = object["status"]["message"].as_str().map(str::trim).filter(|m| !m.is_empty())?;
    Some(m.chars().take(512).collect())
}

/// The custom resource edge; the kind is looked up (discovery) on first use, so the remediator
/// starts before the repair controller's CRD is installed.
#[derive(Clone)]
pub struct CustomResource {
    client: kube::Client,
    settings: ResourceSettings,
    gvk: GroupVersionKind,
    resolved: Arc<tokio::sync::OnceCell<(ApiResource, bool)>>,
}

impl CustomResource {
    /// The hook for `settings`, creating resources with `client`.
    pub fn new(client: kube::Client, settings: ResourceSettings) -> Result<Self, String> {
        let gvk = template_kind(&settings.template)?;
        Ok(Self { client, settings, gvk, resolved: Arc::new(tokio::sync::OnceCell::new()) })
    }

    async fn api(&self, object: &Value) -> Result<Api<DynamicObject>, HookError> {
        let (resource, namespaced) = self
            .resolved
            .get_or_try_init(|| async {
                let (ar, caps) = kube::discovery::pinned_kind(&self.client, &self.gvk).await.map_err(|e| {
                    HookError::Unavailable(format!(
                        "cannot find {}/{} {}: {e}",
                        self.gvk.group, self.gvk.version, self.gvk.kind
                    ))
                })?;
                Ok::<_, HookError>((ar, caps.scope == Scope::Namespaced))
            })
            .await?;
        Ok(if *namespaced {
            let ns = object["metadata"]["namespace"].as_str().unwrap_or(&self.settings.default_namespace);
            Api::namespaced_with(self.client.clone(), ns, resource)
        } else {
            Api::all_with(self.client.clone(), resource)
        })
    }

    /// Creates the resource for the current step of `ladder`; one that exists already (a retry,
    /// a new leader) is fine. Returns its name.
    pub async fn create(&self, ladder: &Ladder) -> Result<String, HookError> {
        self.create_object(render(&self.settings.template, ladder)).await
    }

    /// Creates the resource asking for the validation after the current step of `ladder`, named
    /// `name` (as [`create`](Self::create), with [`VALIDATE_ACTION`]). Returns its kind and name.
    pub async fn create_validation(&self, ladder: &Ladder, name: &str) -> Result<String, HookError> {
        let name = self.create_object(render_as(&self.settings.template, ladder, VALIDATE_ACTION, name)).await?;
        Ok(format!("{} {name}", self.gvk.kind))
    }

    /// What the controller reports about the validation resource `name` of `ladder`'s current
    /// step: `None` when the resource is gone, else its report and the message beside it.
    pub async fn validation_report(
        &self,
        ladder: &Ladder,
        name: &str,
    ) -> Result<Option<(Report, Option<String>)>, HookError> {
        let object = render_as(&self.settings.template, ladder, VALIDATE_ACTION, name);
        let found = self.read_object(&object).await?;
        Ok(found.map(|v| {
            (
                report_from(&v, &self.settings.status_path, &format!("the {} controller", self.gvk.kind)),
                status_message(&v),
            )
        }))
    }

    /// Creates `object` (a rendered template); one that exists already is fine. Returns its name.
    async fn create_object(&self, object: Value) -> Result<String, HookError> {
        let api = self.api(&object).await?;
        let name = object["metadata"]["name"].as_str().unwrap_or_default().to_owned();
        let dynamic: DynamicObject =
            serde_json::from_value(object).map_err(|e| HookError::Refused(format!("the rendered template: {e}")))?;
        match api.create(&PostParams::default(), &dynamic).await {
            Ok(_) => Ok(name),
            Err(kube::Error::Api(s)) if s.is_already_exists() => Ok(name),
            // The API server refuses the object itself (schema, admission, RBAC): no retry mends that.
            Err(kube::Error::Api(s)) if (400..500).contains(&s.code) && s.code != 429 && s.code != 409 => {
                Err(HookError::Refused(format!("{} {name}: {}", self.gvk.kind, s.message)))
            }
            Err(e) => Err(HookError::Unavailable(format!("{} {name}: {e}", self.gvk.kind))),
        }
    }

    /// What the repair controller reports about the current step of `ladder`.
    pub async fn report(&self, ladder: &Ladder) -> Result<Report, HookError> {
        match self.read_object(&render(&self.settings.template, ladder)).await? {
            Some(value) => Ok(report_of(&value, &self.settings.status_path)),
            // Deleted by someone: nothing to read; the step's timeout decides.
            None => Ok(Report::Working),
        }
    }

    /// Reads the resource `object` (a rendered template) names; `None` when it is gone.
    async fn read_object(&self, object: &Value) -> Result<Option<Value>, HookError> {
        let api = self.api(object).await?;
        let name = object["metadata"]["name"].as_str().unwrap_or_default();
        match api.get_opt(name).await {
            Ok(found) => Ok(found.map(|f| serde_json::to_value(&f).unwrap_or_default())),
            Err(e) => Err(HookError::Unavailable(format!("{} {name}: {e}", self.gvk.kind))),
        }
    }
}

/// The configured hooks together.
#[derive(Clone, Default)]
pub struct Hooks {
    /// The webhook, when configured.
    pub webhook: Option<Webhook>,
    /// The custom resource, when configured.
    pub resource: Option<CustomResource>,
}

impl Hooks {
    /// Whether any hook is configured.
    pub fn any(&self) -> bool {
        self.webhook.is_some() || self.resource.is_some()
    }

    /// Hands the current step of `ladder` to every hook: the webhook first, then the resource.
    /// Returns a sentence for the step's Event and outcome.
    pub async fn start(&self, ladder: &Ladder) -> Result<String, HookError> {
        let mut parts = Vec::new();
        if let Some(w) = &self.webhook {
            let attempts = w.call(ladder).await?;
            parts.push(format!("webhook accepted it after {attempts} attempt(s)"));
        }
        if let Some(r) = &self.resource {
            let name = r.create(ladder).await?;
            parts.push(format!("{} {name} created", r.gvk.kind));
        }
        Ok(parts.join("; "))
    }

    /// What the hooks report about the current (running) step; a webhook does not report back,
    /// so without the custom resource the answer is [`Report::Silent`].
    pub async fn report(&self, ladder: &Ladder) -> Result<Report, HookError> {
        match &self.resource {
            Some(r) => r.report(ladder).await,
            None => Ok(Report::Silent),
        }
    }
}

/// Replaces every `{{name}}` in the strings of `v` (objects and arrays included) with its value
/// from `vars`: the templates of repair custom resources and validation Jobs.
pub(crate) fn fill_template(v: &mut Value, vars: &[(&str, String)]) {
    match v {
        Value::String(s) => {
            for (k, value) in vars {
                let placeholder = format!("{{{{{k}}}}}");
                if s.contains(&placeholder) {
                    *s = s.replace(&placeholder, value);
                }
            }
        }
        Value::Array(items) => items.iter_mut().for_each(|i| fill_template(i, vars)),
        Value::Object(map) => map.values_mut().for_each(|i| fill_template(i, vars)),
        _ => {}
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ladder::{Ladder, parse_steps};
    use crate::request::{Action, GpuRef, Remediation, Subsystem};
    use gpumedic_schemas::verdict::RecommendedAction;

    fn ladder() -> Ladder {
        let request = Remediation {
            node: "gpu-1".into(),
            gpu: Some(GpuRef { uuid: "GPU-abc".into(), pci_bus_id: "0000:3b:00.0".into(), index: Some(2) }),
            action: Action::ResetGpu,
            subsystem: Subsystem::Gpu,
            reason: "Xid79".into(),
            message: "GPU has \"fallen\" off the bus".into(),
            verdict_id: "7b2c7a4e-0000-4000-8000-000000000001".into(),
            incident_id: "i1".into(),
            recovery: false,
            reissue: false,
            custom: None,
        };
        let steps = parse_steps("reset_gpu=10m,reboot_node=30m", Duration::from_secs(60)).unwrap();
        Ladder::new(&request.verdict_id, RecommendedAction::ResetGpu, &request, &steps, Utc::now())
    }

    fn key(id: &str, secret: &str) -> Key {
        Key::new(id, Secret(secret.as_bytes().to_vec())).unwrap()
    }

    const NOW: i64 = 1_700_000_000;
    const FIVE_MINUTES: Duration = Duration::from_secs(300);

    fn delivery<'a>(h: &'a SignatureHeaders, body: &'a [u8]) -> Delivery<'a> {
        Delivery { timestamp: Some(&h.timestamp), key_ids: Some(&h.key_ids), signatures: Some(&h.signatures), body }
    }

    #[test]
    fn the_signature_covers_key_id_timestamp_and_body_as_documented() {
        // Computed with Python's hmac, as in the receiver snippet of docs/operations.md:
        // hmac.new(b"Jefe", b'k-1.1700000000.{"a":1}', hashlib.sha256).hexdigest()
        let h = sign(&[key("k-1", "Jefe")], NOW, br#"{"a":1}"#);
        assert_eq!(h.timestamp, "1700000000");
        assert_eq!(h.key_ids, "k-1");
        assert_eq!(h.signatures, "v1=050040fa18ac5d95c7cb4cacb275c1277cfa6aaccbb845bb3f2c3aa3b0a85030");
        let ok = verify(&delivery(&h, br#"{"a":1}"#), &[key("k-1", "Jefe")], FIVE_MINUTES, NOW + 3).unwrap();
        assert_eq!(ok, Verified { key_id: "k-1".into(), age_seconds: 3 });
    }

    #[test]
    fn a_changed_body_timestamp_or_key_id_is_a_bad_signature() {
        let keys = [key("k-1", "Jefe")];
        let h = sign(&keys, NOW, b"body");
        assert_eq!(
            verify(&delivery(&h, b"bodY"), &keys, FIVE_MINUTES, NOW),
            Err(VerifyError::BadSignature("k-1".into()))
        );
        // A replay with a fresh timestamp: the old signature does not cover it.
        let mut fresh = h.clone();
        fresh.timestamp = (NOW + 600).to_string();
        assert_eq!(
            verify(&delivery(&fresh, b"body"), &keys, FIVE_MINUTES, NOW + 600),
            Err(VerifyError::BadSignature("k-1".into()))
        );
        // The same signature presented under another known key's id.
        let two = [key("k-1", "Jefe"), key("k-2", "Jefe")];
        let mut renamed = h.clone();
        renamed.key_ids = "k-2".into();
        assert_eq!(
            verify(&delivery(&renamed, b"body"), &two, FIVE_MINUTES, NOW),
            Err(VerifyError::BadSignature("k-2".into()))
        );
        // Signed with another secret under the right id.
        assert_eq!(
            verify(&delivery(&h, b"body"), &[key("k-1", "other")], FIVE_MINUTES, NOW),
            Err(VerifyError::BadSignature("k-1".into()))
        );
        let mut old_scheme = h.clone();
        old_scheme.signatures = old_scheme.signatures.replace("v1=", "sha256=");
        assert_eq!(
            verify(&delivery(&old_scheme, b"body"), &keys, FIVE_MINUTES, NOW),
            Err(VerifyError::BadSignature("k-1".into()))
        );
    }

    #[test]
    fn an_unknown_key_id_or_a_missing_header_is_refused_with_its_reason() {
        let h = sign(&[key("k-1", "Jefe")], NOW, b"body");
        let err = verify(&delivery(&h, b"body"), &[key("k-9", "Jefe")], FIVE_MINUTES, NOW).unwrap_err();
        assert_eq!(err, VerifyError::UnknownKeyId("k-1".into()));
        assert!(err.to_string().starts_with("unknown key id:"), "{err}");
        for (missing, header) in [(0, TIMESTAMP_HEADER), (1, KEY_ID_HEADER), (2, SIGNATURE_HEADER)] {
            let mut d = delivery(&h, b"body");
            match missing {
                0 => d.timestamp = None,
                1 => d.key_ids = Some(" "),
                _ => d.signatures = None,
            }
            assert_eq!(verify(&d, &[key("k-1", "Jefe")], FIVE_MINUTES, NOW), Err(VerifyError::MissingHeader(header)));
        }
        let mut d = delivery(&h, b"body");
        d.timestamp = Some("2023-11-14T22:13:20Z");
        assert!(matches!(
            verify(&d, &[key("k-1", "Jefe")], FIVE_MINUTES, NOW),
            Err(VerifyError::Malformed { header: TIMESTAMP_HEADER, .. })
        ));
        d = delivery(&h, b"body");
        d.key_ids = Some("k-1,k-2");
        assert!(matches!(
            verify(&d, &[key("k-1", "Jefe")], FIVE_MINUTES, NOW),
            Err(VerifyError::Malformed { header: SIGNATURE_HEADER, .. })
        ));
    }

    #[test]
    fn during_a_rotation_a_receiver_with_either_key_verifies() {
        let (new, old) = (key("2026-12", "new-secret"), key("default", "old-secret"));
        let ring = Keyring::new(new.clone(), Some(old.clone())).unwrap();
        let h = sign(ring.keys(), NOW, b"body");
        assert_eq!(h.key_ids, "2026-12,default");
        assert_eq!(h.signatures.split(',').count(), 2);
        for (knows, id) in [
            (vec![old.clone()], "default"),
            (vec![new.clone()], "2026-12"),
            (vec![old.clone(), new.clone()], "2026-12"),
        ] {
            assert_eq!(verify(&delivery(&h, b"body"), &knows, FIVE_MINUTES, NOW).unwrap().key_id, id);
        }
        // A receiver that already dropped the old key refuses what only the old key signed.
        let old_only = sign(std::slice::from_ref(&old), NOW, b"body");
        assert_eq!(
            verify(&delivery(&old_only, b"body"), std::slice::from_ref(&new), FIVE_MINUTES, NOW),
            Err(VerifyError::UnknownKeyId("default".into()))
        );
        assert_eq!(Keyring::new(new.clone(), Some(key("2026-12", "x"))), Err(KeyError::DuplicateId("2026-12".into())));
    }

    #[test]
    fn a_request_older_or_further_ahead_than_the_tolerance_is_refused() {
        let keys = [key("k-1", "Jefe")];
        let h = sign(&keys, NOW, b"body");
        assert_eq!(verify(&delivery(&h, b"body"), &keys, FIVE_MINUTES, NOW + 300).unwrap().age_seconds, 300);
        let old = verify(&delivery(&h, b"body"), &keys, FIVE_MINUTES, NOW + 600).unwrap_err();
        assert_eq!(old, VerifyError::TooOld { age_seconds: 600, tolerance_seconds: 300 });
        assert!(old.to_string().starts_with("too old: signed 10m ago, more than the 5m tolerance"), "{old}");
        assert_eq!(verify(&delivery(&h, b"body"), &keys, FIVE_MINUTES, NOW - 300).unwrap().age_seconds, -300);
        let ahead = verify(&delivery(&h, b"body"), &keys, FIVE_MINUTES, NOW - 301).unwrap_err();
        assert_eq!(ahead, VerifyError::TooNew { ahead_seconds: 301, tolerance_seconds: 300 });
        assert!(ahead.to_string().starts_with("too far in the future: signed 5m 1s ahead"), "{ahead}");
        // A forged request is refused for its signature, whatever its age.
        assert_eq!(
            verify(&delivery(&h, b"forged"), &keys, FIVE_MINUTES, NOW + 600),
            Err(VerifyError::BadSignature("k-1".into()))
        );
    }

    #[test]
    fn key_ids_are_checked() {
        assert_eq!(check_key_id("2026-12_a.b"), Ok(()));
        assert_eq!(check_key_id(""), Err(KeyError::EmptyId));
        assert_eq!(check_key_id("a,b"), Err(KeyError::BadId { id: "a,b".into(), bad: ',' }));
        assert!(matches!(check_key_id("a b"), Err(KeyError::BadId { bad: ' ', .. })));
        assert!(matches!(check_key_id(&"k".repeat(65)), Err(KeyError::LongId(_))));
        assert_eq!(Key::new("k", Secret(vec![])), Err(KeyError::EmptySecret("k".into())));
        assert!(!format!("{:?}", key("k", "hunter2")).contains("hunter2"), "the secret never prints");
    }

    #[test]
    fn durations_read_as_people_write_them() {
        let cases = [(0, "0s"), (45, "45s"), (600, "10m"), (598, "9m 58s"), (7_500, "2h 5m"), (273_600, "3d 4h")];
        for (secs, text) in cases {
            assert_eq!(human_seconds(secs), text);
        }
    }

    #[test]
    fn retries_are_for_5xx_429_and_408_only() {
        assert_eq!(classify(200), Answer::Accepted);
        assert_eq!(classify(202), Answer::Accepted);
        for s in [500, 502, 503, 429, 408] {
            assert_eq!(classify(s), Answer::Retry, "{s}");
        }
        for s in [400, 401, 403, 404, 409, 422, 301] {
            assert_eq!(classify(s), Answer::Refused, "{s}");
        }
        assert_eq!(backoff(Duration::from_millis(200), 1), Duration::from_millis(200));
        assert_eq!(backoff(Duration::from_millis(200), 3), Duration::from_millis(800));
        assert_eq!(backoff(Duration::from_secs(1), 40), Duration::from_secs(30));
    }

    #[test]
    fn the_key_and_the_name_depend_on_the_verdict_and_step_only() {
        let mut l = ladder();
        let a = WebhookBody::new(&l, 1, Utc::now());
        let b = WebhookBody::new(&l, 2, Utc::now());
        assert_ne!(a, b, "the attempt is in the body");
        assert_eq!(idempotency_key(&l.verdict_id, l.step_number()), "7b2c7a4e-0000-4000-8000-000000000001:1");
        assert_eq!(resource_name(&l.verdict_id, 1), "gpumedic-7b2c7a4e-0000-4000-8000-000000000001-1");
        l.escalate("timed out", Utc::now());
        let c = WebhookBody::new(&l, 1, Utc::now());
        assert_eq!((c.step, c.steps, c.action.as_str()), (2, 2, "reboot_node"));
        assert_eq!(resource_name("Verdict_X", 2), "gpumedic-verdict-x-2");
    }

    #[test]
    fn the_template_is_filled_without_changing_its_shape() {
        let template: Value = serde_yaml::from_str(
            "apiVersion: repair.example.com/v1\nkind: GpuRepair\nmetadata:\n  labels:\n    team: infra\n\
             spec:\n  nodeName: '{{node}}'\n  gpu: '{{gpu_uuid}} #{{gpu_index}}'\n  operation: '{{action}}'\n  \
             note: '{{message}}'\n  ref: '{{verdict_id}}/{{step}}'\n",
        )
        .unwrap();
        assert_eq!(template_kind(&template).unwrap(), GroupVersionKind::gvk("repair.example.com", "v1", "GpuRepair"));
        let object = render(&template, &ladder());
        assert_eq!(object["metadata"]["name"], "gpumedic-7b2c7a4e-0000-4000-8000-000000000001-1");
        assert_eq!(object["metadata"]["labels"]["team"], "infra");
        assert_eq!(object["metadata"]["labels"][NODE_LABEL], "gpu-1");
        assert_eq!(object["spec"]["nodeName"], "gpu-1");
        assert_eq!(object["spec"]["gpu"], "GPU-abc #2");
        assert_eq!(object["spec"]["operation"], "reset_gpu");
        assert_eq!(object["spec"]["note"], "GPU has \"fallen\" off the bus");
        assert_eq!(object["spec"]["ref"], "7b2c7a4e-0000-4000-8000-000000000001/1");
        assert!(template_kind(&json!({ "kind": "X" })).is_err());
    }

    #[test]
    fn a_validation_asks_for_validate_under_its_own_key_and_name() {
        let l = ladder();
        let body = WebhookBody::asking(&l, VALIDATE_ACTION.to_owned(), 900, 1, Utc::now());
        assert_eq!((body.action.as_str(), body.step, body.timeout_seconds), ("validate", 1, 900));
        assert_eq!(validation_key(&l.verdict_id, 1), "7b2c7a4e-0000-4000-8000-000000000001:1:validate");
        assert_ne!(validation_key(&l.verdict_id, 1), idempotency_key(&l.verdict_id, 1));
        let template: Value =
            serde_yaml::from_str("apiVersion: repair.example.com/v1\nkind: GpuRepair\nspec:\n  op: '{{action}}'\n")
                .unwrap();
        let object = render_as(&template, &l, VALIDATE_ACTION, "gpumedic-validate-x-1");
        assert_eq!(
            (object["metadata"]["name"].as_str(), object["spec"]["op"].as_str()),
            (Some("gpumedic-validate-x-1"), Some("validate"))
        );
        assert_eq!(object["metadata"]["labels"][NODE_LABEL], "gpu-1");
    }

    #[test]
    fn a_webhooks_answer_to_a_validation_reads_as_a_resources_status() {
        assert_eq!(answer_of(b""), (Report::Working, None), "an empty answer: still running");
        assert_eq!(answer_of(b"accepted").0, Report::Working);
        assert_eq!(answer_of(br#"{"status":{"phase":"Running"}}"#).0, Report::Working);
        assert_eq!(
            answer_of(br#"{"status":{"phase":"Succeeded","message":"passed"}}"#),
            (Report::Succeeded, Some("passed".to_owned()))
        );
        assert_eq!(
            answer_of(br#"{"status":{"phase":"failed","message":" PCIe FAIL "}}"#).0,
            Report::Failed("the validation webhook reported Failed: PCIe FAIL".into())
        );
        let long = json!({ "status": { "message": "m".repeat(2000) } });
        assert_eq!(status_message(&long).map(|m| m.len()), Some(512));
    }

    #[test]
    fn the_phase_is_read_at_the_configured_path() {
        assert_eq!(report_of(&json!({}), "status.phase"), Report::Working);
        assert_eq!(report_of(&json!({ "status": { "phase": "Running" } }), "status.phase"), Report::Working);
        assert_eq!(report_of(&json!({ "status": { "phase": "Succeeded" } }), "status.phase"), Report::Succeeded);
        assert!(matches!(
            report_of(&json!({ "status": { "phase": "Failed", "message": "BMC down" } }), "status.phase"),
            Report::Failed(m) if m.contains("BMC down")
        ));
        assert_eq!(
            report_of(&json!({ "status": { "result": { "state": "succeeded" } } }), "status.result.state"),
            Report::Succeeded
        );
    }
}
