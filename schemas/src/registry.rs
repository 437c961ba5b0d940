//! A client for the Confluent Schema Registry REST API: the subset a Kafka producer and consumer
//! need (register a schema under a subject, fetch a schema by id, list subjects).
//!
//! Any registry that serves this API works: Confluent Schema Registry, Apicurio Registry under
//! `/apis/ccompat/v7` (the testbed's), Karapace, Redpanda. Errors keep "the registry does not know
//! this" ([`RegistryError::NotFound`]) apart from "the registry cannot be asked right now"
//! ([`RegistryError::Unavailable`]): a consumer dead-letters a record for the first and retries on
//! the second.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use serde::Deserialize;

/// The media type the Confluent API speaks.
const CONTENT_TYPE: &str = "application/vnd.schemaregistry.v1+json";

/// Registration attempts while the registry answers but is busy (a reported race, a server
/// error): the pauses between them add up to about 10 s.
pub const BUSY_ATTEMPTS: u32 = 10;

/// How many attempts a registration failing with `error` gets in all: a busy registry is worth
/// waiting for, another conflict (an incompatible schema) is tried a few times, anything else
/// (no answer, a refusal) once.
fn registration_attempts(error: &RegistryError) -> u32 {
    match error {
        RegistryError::Rejected { status: 409, message, .. } if message.contains("already exists") => BUSY_ATTEMPTS,
        RegistryError::Rejected { status: 409, .. } => 4,
        RegistryError::Unavailable { status: Some(_), .. } => BUSY_ATTEMPTS,
        _ => 1,
    }
}

/// The pause after the `attempt`th busy answer: 100 ms doubling to at most 1.6 s, with up to half
/// again of jitter so that racing clients do not collide again in step.
fn busy_pause(attempt: u32) -> Duration {
    let base = 100u64 << attempt.saturating_sub(1).min(4);
    let jitter = u64::from(uuid::Uuid::new_v4().as_u128() as u16) % (base / 2 + 1);
    Duration::from_millis(base + jitter)
}

/// Why a registry request failed.
#[derive(Debug, thiserror::Error)]
pub enum RegistryError {
    /// The registry answered that the subject, version or schema does not exist (HTTP 404, or
    /// Confluent error codes 40401 to 40403).
    #[error("not found in the schema registry at {url}: {message}")]
    NotFound {
        /// The request URL.
        url: String,
        /// The registry's error code, when it sent one (40403: schema not found).
        error_code: Option<i64>,
        /// The registry's message.
        message: String,
    },
    /// The registry could not be reached, timed out, or failed on its side (5xx, 408, 429):
    /// transient, worth retrying.
    #[error("schema registry at {url} is unavailable: {detail}")]
    Unavailable {
        /// The request URL.
        url: String,
        /// The HTTP status when the registry answered (5xx, 408, 429); `None` when no answer came.
        status: Option<u16>,
        /// What failed.
        detail: String,
    },
    /// The registry refused the request (another 4xx: an invalid or incompatible schema, missing
    /// credentials).
    #[error("schema registry at {url} refused the request (HTTP {status}, error code {error_code:?}): {message}")]
    Rejected {
        /// The request URL.
        url: String,
        /// The HTTP status.
        status: u16,
        /// The registry's error code, when it sent one.
        error_code: Option<i64>,
        /// The registry's message.
        message: String,
    },
    /// The registry answered 2xx with a body that is not what the API promises.
    #[error("schema registry at {url} sent an unexpected response: {detail}")]
    InvalidResponse {
        /// The request URL.
        url: String,
        /// What was wrong.
        detail: String,
    },
    /// The HTTP client could not be built (TLS backend initialisation).
    #[error("cannot build the schema registry HTTP client: {0}")]
    Client(String),
}

/// A schema as the registry returns it by id.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RegisteredSchema {
    /// The schema text (for Avro, the schema's JSON).
    pub schema: String,
    /// `AVRO`, `PROTOBUF` or `JSON`; the API omits it for Avro.
    pub schema_type: String,
}

/// A Confluent Schema Registry REST client with timeouts on every request.
#[derive(Debug)]
pub struct RegistryClient {
    http: reqwest::Client,
    base: String,
    requests: AtomicU64,
}

#[derive(Deserialize)]
struct IdResponse {
    id: u32,
}

#[derive(Deserialize)]
struct SchemaResponse {
    schema: String,
    #[serde(rename = "schemaType")]
    schema_type: Option<String>,
}

#[derive(Deserialize, Default)]
struct ErrorBody {
    error_code: Option<i64>,
    message: Option<String>,
}

impl RegistryClient {
    /// A client for the registry at `base_url` (for Apicurio, ending in `/apis/ccompat/v7`);
    /// `timeout` bounds each request, connecting included.
    ///
    /// # Errors
    /// [`RegistryError::Client`] when the HTTP client cannot be built.
    pub fn new(base_url: &str, timeout: Duration) -> Result<Self, RegistryError> {
        let http = reqwest::Client::builder()
            .connect_timeout(timeout)
            .timeout(timeout)
            .build()
            .map_err(|e| RegistryError::Client(e.to_string()))?;
        Ok(Self { http, base: base_url.trim_end_matches('/').to_owned(), requests: AtomicU64::new(0) })
    }

    /// The registry's base URL.
    pub fn base_url(&self) -> &str {
        &self.base
    }

    /// How many HTTP requests this client has sent: lets a caller (and the tests) see that a
    /// cached schema is not fetched again.
    pub fn requests_sent(&self) -> u64 {
        self.requests.load(Ordering::Relaxed)
    }

    /// Registers an Avro `schema` under `subject` and returns its id. Registering a schema the
    /// subject already has returns the existing id.
    ///
    /// A registry that answers but is busy is given time. Replicas (or test binaries) starting
    /// together register schemas at once, and Apicurio answers the losers of such races HTTP 409
    /// "artifact already exists" (the schema may well be there) or, on a fresh registry, HTTP 500
    /// (a lock timeout in its database). After a conflict the client asks whether the subject now
    /// holds this schema (`POST /subjects/{subject}`, the lookup) and returns its id if so; then
    /// it registers again after a growing, jittered pause: up to [`BUSY_ATTEMPTS`] attempts (about
    /// 10 s) for a reported race or a server error, up to four for any other conflict (a real
    /// incompatibility fails every attempt). A registry that does not answer at all fails at once.
    ///
    /// # Errors
    /// [`RegistryError::Rejected`] for an invalid schema or one the subject's compatibility
    /// setting refuses (HTTP 409/422), [`RegistryError::Unavailable`] and the others.
    pub async fn register(&self, subject: &str, schema: &str) -> Result<u32, RegistryError> {
        let url = format!("{}/subjects/{}/versions", self.base, encode_path_segment(subject));
        let body = serde_json::json!({ "schemaType": "AVRO", "schema": schema });
        let mut attempt: u32 = 1;
        loop {
            let request = self.http.post(&url).header(reqwest::header::CONTENT_TYPE, CONTENT_TYPE).json(&body);
            match self.send::<IdResponse>(&url, request).await {
                Err(e) if attempt < registration_attempts(&e) => {
                    if matches!(e, RegistryError::Rejected { status: 409, .. })
                        && let Some(id) = self.lookup(subject, &body).await
                    {
                        return Ok(id);
                    }
                    tokio::time::sleep(busy_pause(attempt)).await;
                    attempt += 1;
                }
                result => return result.map(|response| response.id),
            }
        }
    }

    /// The id of `body`'s schema under `subject`, when the subject holds it; `None` when it does
    /// not or the registry cannot say.
    async fn lookup(&self, subject: &str, body: &serde_json::Value) -> Option<u32> {
        let url = format!("{}/subjects/{}", self.base, encode_path_segment(subject));
        let request = self.http.post(&url).header(reqwest::header::CONTENT_TYPE, CONTENT_TYPE).json(body);
        self.send::<IdResponse>(&url, request).await.ok().map(|response| response.id)
    }

    /// The schema registered with `id`.
    ///
    /// # Errors
    /// [`RegistryError::NotFound`] when the registry has no schema with that id,
    /// [`RegistryError::Unavailable`] and the others.
    pub async fn schema_by_id(&self, id: u32) -> Result<RegisteredSchema, RegistryError> {
        let url = format!("{}/schemas/ids/{id}", self.base);
        let response: SchemaResponse = self.send(&url, self.http.get(&url)).await?;
        Ok(RegisteredSchema {
            schema: response.schema,
            schema_type: response.schema_type.unwrap_or_else(|| "AVRO".into()),
        })
    }

    /// Every subject the registry has: a cheap request that proves the registry answers.
    ///
    /// # Errors
    /// [`RegistryError::Unavailable`] and the others.
    pub async fn subjects(&self) -> Result<Vec<String>, RegistryError> {
        let url = format!("{}/subjects", self.base);
        self.send(&url, self.http.get(&url)).await
    }

    async fn send<T: serde::de::DeserializeOwned>(
        &self,
        url: &str,
        request: reqwest::RequestBuilder,
    ) -> Result<T, RegistryError> {
        self.requests.fetch_add(1, Ordering::Relaxed);
        let unavailable =
            |status: Option<u16>, detail: String| RegistryError::Unavailable { url: url.to_owned(), status, detail };
        let response = request.header(reqwest::header::ACCEPT, CONTENT_TYPE).send().await.map_err(|e| {
            // Connect errors and timeouts, and anything else that left no response: transient.
            unavailable(None, describe(&e))
        })?;
        let status = response.status();
        let bytes = response.bytes().await.map_err(|e| unavailable(None, describe(&e)))?;
        if status.is_success() {
            return serde_json::from_slice(&bytes)
                .map_err(|e| RegistryError::InvalidResponse { url: url.to_owned(), detail: e.to_string() });
        }
        let error: ErrorBody = serde_json::from_slice(&bytes).unwrap_or_default();
        let message = error.message.unwrap_or_else(|| String::from_utf8_lossy(&bytes).chars().take(200).collect());
        let code = status.as_u16();
        if status.is_server_error() || code == 408 || code == 429 {
            return Err(unavailable(Some(code), format!("HTTP {code}: {message}")));
        }
        if code == 404 || matches!(error.error_code, Some(40401..=40403)) {
            return Err(RegistryError::NotFound { url: url.to_owned(), error_code: error.error_code, message });
        }
        Err(RegistryError::Rejected { url: url.to_owned(), status: code, error_code: error.error_code, message })
    }
}

/// reqwest's top-level message is generic ("error sending request"); the cause says why.
fn describe(error: &reqwest::Error) -> String {
    let mut text = error.to_string();
    let mut source = std::error::Error::source(error);
    while let Some(cause) = source {
        text.push_str(": ");
        text.push_str(&cause.to_string());
        source = cause.source();
    }
    text
}

/// Percent-encodes a subject for a URL path: subjects are topic names plus `-value`, which may
/// hold characters such as `/` or spaces in other deployments.
fn encode_path_segment(segment: &str) -> String {
    let mut out = String::with_capacity(segment.len());
    for byte in segment.bytes() {
        if byte.is_ascii_alphanumeric() || matches!(byte, b'-' | b'.' | b'_' | b'~') {
            out.push(byte as char);
        } else {
            out.push_str(&format!("%{byte:02X}"));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn subjects_are_encoded_for_the_path() {
        assert_eq!(encode_path_segment("gpumedic.verdicts.v1-value"), "gpumedic.verdicts.v1-value");
        assert_eq!(encode_path_segment("a b/c"), "a%20b%2Fc");
    }

    #[test]
    fn the_base_url_loses_its_trailing_slash() {
        let client = RegistryClient::new("http://127.0.0.1:1/apis/ccompat/v7/", Duration::from_secs(1)).unwrap();
        assert_eq!(client.base_url(), "http://127.0.0.1:1/apis/ccompat/v7");
    }

    #[test]
    fn a_busy_registry_is_waited_for_and_a_silent_one_is_not() {
        let rejected = |status: u16, message: &str| RegistryError::Rejected {
            url: String::new(),
            status,
            error_code: None,
            message: message.into(),
        };
        let unavailable = |status| RegistryError::Unavailable { url: String::new(), status, detail: String::new() };
        let race = rejected(409, "An artifact with ID 'x-value' in group 'null' already exists.");
        assert_eq!(registration_attempts(&race), BUSY_ATTEMPTS);
        assert_eq!(registration_attempts(&rejected(409, "Schema being registered is incompatible")), 4);
        assert_eq!(registration_attempts(&rejected(422, "Invalid schema")), 1);
        assert_eq!(registration_attempts(&unavailable(Some(500))), BUSY_ATTEMPTS);
        assert_eq!(registration_attempts(&unavailable(None)), 1);
        let total: Duration = (1..BUSY_ATTEMPTS).map(busy_pause).sum();
        assert!((Duration::from_secs(9)..Duration::from_secs(15)).contains(&total), "{total:?}");
        for attempt in 1..BUSY_ATTEMPTS {
            let base = Duration::from_millis(100 << (attempt - 1).min(4));
            let pause = busy_pause(attempt);
            assert!(pause >= base && pause <= base * 3 / 2, "attempt {attempt}: {pause:?}");
        }
    }
}
