//! Who may read a service's read-only HTTP API: the kube-rbac-proxy pattern, in process. Used by
//! the classifier's incident API and the console, which authorize alike.
//!
//! A service's admin port listens on every address (kubelet probes and Prometheus reach it there),
//! so an API under `/api/` cannot rely on where a request comes from. Each request carries
//! `Authorization: Bearer <token>`; the token is checked with a `TokenReview`
//! (authentication.k8s.io/v1) and the user it names with a `SubjectAccessReview`
//! (authorization.k8s.io/v1) for verb `list` (a list) or `get` (one item) on resource
//! [`RESOURCE`] in API group [`API_GROUP`], cluster-wide. RBAC grants it like any resource: the
//! ClusterRole `gpumedic-incident-reader` in `k8s/base`.
//!
//! No token, or one the apiserver does not authenticate: 401 with `WWW-Authenticate: Bearer`.
//! Authenticated but not allowed: 403 naming the user, verb and resource. The apiserver not
//! answering (or refusing the service's own reviews): 503, never allowed. Decisions are cached
//! per token and verb for `--api-auth-cache-ttl`, allowed and refused alike, so a dashboard that
//! polls does not send a review per request; errors are never cached. `/metrics` and the probes
//! are served by the admin router beside these routes and stay open. Outcomes are counted in
//! `gpumedic_<service>_api_auth_total{result}` and reviews in
//! `gpumedic_<service>_api_auth_reviews_total{review}`.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::extract::{Request, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use futures::future::BoxFuture;
use k8s_openapi::api::authentication::v1::{TokenReview, TokenReviewSpec};
use k8s_openapi::api::authorization::v1::{ResourceAttributes, SubjectAccessReview, SubjectAccessReviewSpec};
use kube::api::{Api, PostParams};

use crate::events::{metric_name, names};

/// The API group of the resource the APIs are authorized as.
pub const API_GROUP: &str = "gpumedic.io";
/// The resource the APIs are authorized as (it exists only in RBAC rules).
pub const RESOURCE: &str = "incidents";
/// The longest bearer token looked at; longer ones are refused without a review (a
/// ServiceAccount token is about 1 KiB), which also bounds what the cache holds.
pub const MAX_TOKEN_BYTES: usize = 8192;
/// How long one review may take before the request is answered 503.
const REVIEW_TIMEOUT: Duration = Duration::from_secs(5);

/// How requests to the API are authenticated (`--api-auth`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// A bearer token, TokenReview and SubjectAccessReview.
    Kubernetes,
    /// Nobody is asked: whoever reaches the admin port reads the history. Local use only.
    None,
}

impl Mode {
    /// Parses the flag's value; the error says what is accepted.
    pub fn parse(s: &str) -> Result<Mode, String> {
        match s {
            "kubernetes" => Ok(Mode::Kubernetes),
            "none" => Ok(Mode::None),
            other => Err(format!("'{other}' is not kubernetes or none")),
        }
    }
}

/// The validated `--api-auth*` flags.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Settings {
    /// How requests are authenticated.
    pub mode: Mode,
    /// How long a decision about a token is reused.
    pub cache_ttl: Duration,
    /// At most this many decisions are kept.
    pub cache_size: usize,
}

/// The `--api-auth*` flags of a service that serves the incident history over HTTP (the
/// classifier's incident API, the console), flattened into its arguments.
#[derive(Debug, Clone, clap::Args)]
pub struct ApiAuthArgs {
    /// How the API authenticates requests: `kubernetes` (a bearer token, checked with a
    /// TokenReview, whose user needs `get`/`list` on `incidents.gpumedic.io` by a
    /// SubjectAccessReview) or `none` (anyone who reaches the admin port; local use only).
    #[arg(long = "api-auth", env = "GPUMEDIC_API_AUTH", default_value = "kubernetes")]
    pub mode: String,
    /// How long a decision about a token (allowed or refused) is reused, so a dashboard that
    /// polls does not review its token on every request. A revoked grant keeps working this long;
    /// `0s` reviews every request.
    #[arg(long = "api-auth-cache-ttl", env = "GPUMEDIC_API_AUTH_CACHE_TTL", default_value = "10s")]
    pub cache_ttl: String,
    /// At most this many decisions about tokens are kept.
    #[arg(long = "api-auth-cache-size", env = "GPUMEDIC_API_AUTH_CACHE_SIZE", default_value_t = 1024)]
    pub cache_size: usize,
}

impl ApiAuthArgs {
    /// The settings, or `None` with every problem added to `problems`.
    pub fn settings(&self, problems: &mut crate::config::Problems) -> Option<Settings> {
        let mode = problems.check("--api-auth", Mode::parse(&self.mode));
        let cache_ttl = problems.check("--api-auth-cache-ttl", crate::config::parse_duration(&self.cache_ttl));
        if cache_ttl.is_some_and(|t| t > Duration::from_secs(300)) {
            problems.push("--api-auth-cache-ttl", "must be at most 5m (a revoked grant keeps working that long)");
        }
        if !(1..=100_000).contains(&self.cache_size) {
            problems.push("--api-auth-cache-size", format!("{} is not from 1 to 100000", self.cache_size));
            return None;
        }
        Some(Settings {
            mode: mode?,
            cache_ttl: cache_ttl.filter(|t| *t <= Duration::from_secs(300))?,
            cache_size: self.cache_size,
        })
    }
}

/// What a request asks to do with incidents: the SubjectAccessReview's verb.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Verb {
    /// Read one incident.
    Get,
    /// List incidents.
    List,
}

impl Verb {
    /// The verb as RBAC writes it.
    pub fn as_str(self) -> &'static str {
        match self {
            Verb::Get => "get",
            Verb::List => "list",
        }
    }
}

/// A user the apiserver authenticated, as the SubjectAccessReview needs it.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Caller {
    /// The username (`system:serviceaccount:<namespace>:<name>` for a ServiceAccount).
    pub username: String,
    /// The user's uid, when the authenticator gives one.
    pub uid: Option<String>,
    /// The user's groups.
    pub groups: Vec<String>,
    /// Extra attributes the authenticator gave (authorizers may use them).
    pub extra: BTreeMap<String, Vec<String>>,
}

/// What is decided about a token and verb.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Decision {
    /// The user may.
    Allowed {
        /// Who.
        username: String,
    },
    /// The token is not one the apiserver authenticates (unknown, expired, malformed).
    Unauthenticated,
    /// The user is authenticated but RBAC does not grant the verb.
    Forbidden {
        /// Who.
        username: String,
    },
}

/// Why no decision could be made: answered 503, never allowed.
#[derive(Debug, thiserror::Error)]
pub enum AuthError {
    /// The service has no Kubernetes client (no configuration found at start).
    #[error("no Kubernetes client to review tokens with: {0}")]
    NoClient(String),
    /// A review request failed (apiserver unreachable, or the service may not create it).
    #[error("the {review} failed: {source}")]
    Review {
        /// `TokenReview` or `SubjectAccessReview`.
        review: &'static str,
        /// The client's error.
        #[source]
        source: kube::Error,
    },
    /// A review took longer than it may.
    #[error("the {0} did not answer within 5 s")]
    Timeout(&'static str),
    /// The SubjectAccessReview could not be evaluated (an authorizer failed).
    #[error("the SubjectAccessReview could not be evaluated: {0}")]
    Evaluation(String),
}

/// Asks the apiserver about tokens and users. A trait so the cache and the decision can be tested
/// without a server; the service uses [`KubeReviewer`].
pub trait Reviewer: Send + Sync {
    /// The user `token` belongs to, or `None` when the apiserver does not authenticate it.
    fn authenticate<'a>(&'a self, token: &'a str) -> BoxFuture<'a, Result<Option<Caller>, AuthError>>;
    /// Whether `caller` may `verb` incidents.
    fn authorize<'a>(&'a self, caller: &'a Caller, verb: Verb) -> BoxFuture<'a, Result<bool, AuthError>>;
}

/// The reviewer that asks the apiserver with the service's own credentials (its
/// ServiceAccount needs `create` on tokenreviews and subjectaccessreviews).
pub struct KubeReviewer {
    client: kube::Client,
    service: &'static str,
}

impl KubeReviewer {
    /// A reviewer over `client`, counting its reviews as `service`'s.
    pub fn new(client: kube::Client, service: &'static str) -> Self {
        KubeReviewer { client, service }
    }
}

async fn within<T>(
    service: &'static str,
    review: &'static str,
    call: impl Future<Output = Result<T, kube::Error>>,
) -> Result<T, AuthError> {
    metrics::counter!(metric_name(service, names::API_AUTH_REVIEWS_TOTAL), "review" => review).increment(1);
    match tokio::time::timeout(REVIEW_TIMEOUT, call).await {
        Err(_) => Err(AuthError::Timeout(review)),
        Ok(r) => r.map_err(|source| AuthError::Review { review, source }),
    }
}

impl Reviewer for KubeReviewer {
    fn authenticate<'a>(&'a self, token: &'a str) -> BoxFuture<'a, Result<Option<Caller>, AuthError>> {
        Box::pin(async move {
            let review = TokenReview {
                spec: TokenReviewSpec { token: token.to_owned(), audiences: None },
                ..TokenReview::default()
            };
            let api = Api::<TokenReview>::all(self.client.clone());
            let answer = within(self.service, "TokenReview", api.create(&PostParams::default(), &review)).await?;
            let status = answer.status.unwrap_or_default();
            if status.authenticated != Some(true) {
                return Ok(None);
            }
            let user = status.user.unwrap_or_default();
            Ok(user.username.filter(|u| !u.is_empty()).map(|username| Caller {
                username,
                uid: user.uid.filter(|u| !u.is_empty()),
                groups: user.groups.unwrap_or_default(),
                extra: user.extra.unwrap_or_default(),
            }))
        })
    }

    fn authorize<'a>(&'a self, caller: &'a Caller, verb: Verb) -> BoxFuture<'a, Result<bool, AuthError>> {
        Box::pin(async move {
            let review =
                SubjectAccessReview { spec: access_review_spec(caller, verb), ..SubjectAccessReview::default() };
            let api = Api::<SubjectAccessReview>::all(self.client.clone());
            let answer =
                within(self.service, "SubjectAccessReview", api.create(&PostParams::default(), &review)).await?;
            let status = answer.status.unwrap_or_default();
            // An authorizer that failed may still leave a later one to allow; only a failure
            // with no answer is an error (RBAC never fails this way, webhooks can).
            match (status.allowed, status.evaluation_error.filter(|e| !e.is_empty())) {
                (true, _) => Ok(true),
                (false, Some(e)) if status.denied != Some(true) => Err(AuthError::Evaluation(e)),
                (false, _) => Ok(false),
            }
        })
    }
}

/// The SubjectAccessReview's spec: `verb` on incidents.gpumedic.io, cluster-wide, for `caller`.
pub fn access_review_spec(caller: &Caller, verb: Verb) -> SubjectAccessReviewSpec {
    SubjectAccessReviewSpec {
        user: Some(caller.username.clone()),
        uid: caller.uid.clone(),
        groups: Some(caller.groups.clone()),
        extra: (!caller.extra.is_empty()).then(|| caller.extra.clone()),
        resource_attributes: Some(ResourceAttributes {
            group: Some(API_GROUP.to_owned()),
            resource: Some(RESOURCE.to_owned()),
            verb: Some(verb.as_str().to_owned()),
            ..ResourceAttributes::default()
        }),
        ..SubjectAccessReviewSpec::default()
    }
}

/// Decisions kept for a while, by token and verb, bounded in size.
#[derive(Debug)]
pub struct Cache {
    ttl: Duration,
    capacity: usize,
    entries: HashMap<(String, Verb), (Decision, Instant)>,
}

impl Cache {
    /// An empty cache keeping at most `capacity` decisions for `ttl` each.
    pub fn new(ttl: Duration, capacity: usize) -> Self {
        Cache { ttl, capacity: capacity.max(1), entries: HashMap::new() }
    }

    /// The decision about `token` and `verb` made less than the TTL before `now`.
    pub fn get(&self, token: &str, verb: Verb, now: Instant) -> Option<Decision> {
        // The key owns its token; a borrowed lookup would need a second map type for no gain at
        // this size.
        self.entries
            .get(&(token.to_owned(), verb))
            .filter(|(_, at)| now.saturating_duration_since(*at) < self.ttl)
            .map(|(d, _)| d.clone())
    }

    /// Keeps `decision`, made at `now`. When full, expired decisions go first, then the oldest.
    pub fn put(&mut self, token: &str, verb: Verb, decision: Decision, now: Instant) {
        if self.ttl.is_zero() {
            return;
        }
        let key = (token.to_owned(), verb);
        if self.entries.len() >= self.capacity && !self.entries.contains_key(&key) {
            let ttl = self.ttl;
            self.entries.retain(|_, (_, at)| now.saturating_duration_since(*at) < ttl);
            if self.entries.len() >= self.capacity
                && let Some(oldest) = self.entries.iter().min_by_key(|(_, (_, at))| *at).map(|(k, _)| k.clone())
            {
                self.entries.remove(&oldest);
            }
        }
        self.entries.insert(key, (decision, now));
    }

    /// How many decisions are kept (expired ones included until they are pushed out).
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// True when nothing is kept.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }
}

/// Decides whether a token may use a verb: the cache, else a TokenReview and a
/// SubjectAccessReview.
pub struct Gate {
    reviewer: Result<Box<dyn Reviewer>, String>,
    cache: Mutex<Cache>,
    service: &'static str,
}

impl Gate {
    /// A gate of `service` asking `reviewer`, caching as `settings` say.
    pub fn new(service: &'static str, reviewer: Box<dyn Reviewer>, settings: &Settings) -> Self {
        Gate { reviewer: Ok(reviewer), cache: Mutex::new(Cache::new(settings.cache_ttl, settings.cache_size)), service }
    }

    /// A gate of `service` that can ask nobody (no Kubernetes client): every request is answered
    /// 503.
    pub fn unavailable(service: &'static str, reason: String) -> Self {
        Gate { reviewer: Err(reason), cache: Mutex::new(Cache::new(Duration::ZERO, 1)), service }
    }

    fn cached(&self, token: &str, verb: Verb) -> Option<Decision> {
        self.cache.lock().ok().and_then(|c| c.get(token, verb, Instant::now()))
    }

    /// The decision about `token` and `verb`; an error when the apiserver could not tell.
    pub async fn decide(&self, token: &str, verb: Verb) -> Result<Decision, AuthError> {
        if let Some(d) = self.cached(token, verb) {
            return Ok(d);
        }
        let reviewer = self.reviewer.as_ref().map_err(|reason| AuthError::NoClient(reason.clone()))?;
        let decision = match reviewer.authenticate(token).await? {
            None => Decision::Unauthenticated,
            Some(caller) => {
                if reviewer.authorize(&caller, verb).await? {
                    Decision::Allowed { username: caller.username }
                } else {
                    Decision::Forbidden { username: caller.username }
                }
            }
        };
        if let Ok(mut c) = self.cache.lock() {
            c.put(token, verb, decision.clone(), Instant::now());
        }
        Ok(decision)
    }
}

/// How the API's routes are guarded: shared by every request.
#[derive(Clone)]
pub enum Access {
    /// Not at all (`--api-auth none`).
    Open,
    /// By the gate.
    Kubernetes(Arc<Gate>),
}

impl Access {
    /// The access of `service`'s API under `settings`: for `kubernetes`, a gate over the
    /// inferred Kubernetes client (in-cluster, or KUBECONFIG); without one, a gate that answers
    /// 503 to every request. Logs how the API is guarded.
    pub async fn start(service: &'static str, settings: &Settings) -> Access {
        match settings.mode {
            Mode::None => {
                tracing::warn!(
                    service,
                    "The API is open to anyone who reaches the admin port (--api-auth none); use it only on a trusted machine."
                );
                Access::Open
            }
            Mode::Kubernetes => match crate::k8s::client().await {
                Ok(client) => {
                    tracing::info!(service, ttl = ?settings.cache_ttl, group = API_GROUP, resource = RESOURCE,
                        "The API asks the apiserver about every bearer token (TokenReview, SubjectAccessReview).");
                    let reviewer = KubeReviewer::new(client, service);
                    Access::Kubernetes(Arc::new(Gate::new(service, Box::new(reviewer), settings)))
                }
                Err(e) => {
                    tracing::error!(service, error = %e,
                        "The API cannot review tokens without a Kubernetes client; it answers 503 to every request.");
                    Access::Kubernetes(Arc::new(Gate::unavailable(service, e.to_string())))
                }
            },
        }
    }
}

/// The bearer token of `headers`, when there is exactly one well-formed one.
pub fn bearer(headers: &HeaderMap) -> Option<&str> {
    let mut values = headers.get_all(header::AUTHORIZATION).iter();
    let value = values.next()?;
    if values.next().is_some() {
        return None;
    }
    let (scheme, token) = value.to_str().ok()?.split_once(' ')?;
    let token = token.trim();
    (scheme.eq_ignore_ascii_case("bearer")
        && !token.is_empty()
        && token.len() <= MAX_TOKEN_BYTES
        && !token.contains(char::is_whitespace))
    .then_some(token)
}

/// The outcome of one request, counted and logged in one place.
fn record(service: &'static str, result: &'static str, verb: Verb, username: Option<&str>, error: Option<&AuthError>) {
    metrics::counter!(metric_name(service, names::API_AUTH_TOTAL), "result" => result).increment(1);
    match (result, error) {
        (_, Some(e)) => {
            tracing::warn!(service, verb = verb.as_str(), error = %e, "Cannot tell whether an API request is allowed; answered 503.");
        }
        ("forbidden", None) => {
            tracing::info!(
                service,
                verb = verb.as_str(),
                user = username.unwrap_or("-"),
                "Refused an API request: RBAC does not grant the user this verb on incidents.gpumedic.io."
            );
        }
        ("allowed", None) => {
            tracing::debug!(service, verb = verb.as_str(), user = username.unwrap_or("-"), "Allowed an API request.")
        }
        _ => tracing::debug!(
            service,
            verb = verb.as_str(),
            reason = result,
            "Refused an API request without a valid bearer token."
        ),
    }
}

fn answer(status: StatusCode, challenge: Option<&'static str>, reason: String) -> Response {
    let mut response = (status, axum::Json(serde_json::json!({ "error": reason }))).into_response();
    if let Some(c) = challenge {
        response.headers_mut().insert(header::WWW_AUTHENTICATE, HeaderValue::from_static(c));
    }
    response
}

/// Middleware of one API route: lets the request through only when its token may `verb`.
pub async fn require(State((access, verb)): State<(Access, Verb)>, request: Request, next: Next) -> Response {
    let Access::Kubernetes(gate) = access else {
        return next.run(request).await;
    };
    let Some(token) = bearer(request.headers()) else {
        record(gate.service, "no_token", verb, None, None);
        return answer(
            StatusCode::UNAUTHORIZED,
            Some("Bearer realm=\"gpumedic\""),
            "a bearer token is required (Authorization: Bearer <token>)".into(),
        );
    };
    match gate.decide(token, verb).await {
        Ok(Decision::Allowed { username }) => {
            record(gate.service, "allowed", verb, Some(&username), None);
            next.run(request).await
        }
        Ok(Decision::Unauthenticated) => {
            record(gate.service, "unauthenticated", verb, None, None);
            answer(
                StatusCode::UNAUTHORIZED,
                Some("Bearer realm=\"gpumedic\", error=\"invalid_token\""),
                "the bearer token is not valid (unknown or expired)".into(),
            )
        }
        Ok(Decision::Forbidden { username }) => {
            record(gate.service, "forbidden", verb, Some(&username), None);
            answer(
                StatusCode::FORBIDDEN,
                None,
                format!(
                    "user \"{username}\" cannot {} resource \"{RESOURCE}\" in API group \"{API_GROUP}\"",
                    verb.as_str()
                ),
            )
        }
        Err(e) => {
            record(gate.service, "unavailable", verb, None, Some(&e));
            answer(StatusCode::SERVICE_UNAVAILABLE, None, "cannot check the bearer token right now".into())
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicUsize, Ordering};

    use super::*;

    /// Tokens `good-<user>` authenticate as `<user>`; `alice` may list and get, `bob` nothing;
    /// `broken` fails the review. Counts reviews.
    #[derive(Default)]
    struct Fake {
        reviews: Arc<AtomicUsize>,
    }

    impl Reviewer for Fake {
        fn authenticate<'a>(&'a self, token: &'a str) -> BoxFuture<'a, Result<Option<Caller>, AuthError>> {
            self.reviews.fetch_add(1, Ordering::SeqCst);
            Box::pin(async move {
                if token == "broken" {
                    return Err(AuthError::Timeout("TokenReview"));
                }
                Ok(token.strip_prefix("good-").map(|u| Caller { username: u.to_owned(), ..Caller::default() }))
            })
        }

        fn authorize<'a>(&'a self, caller: &'a Caller, _verb: Verb) -> BoxFuture<'a, Result<bool, AuthError>> {
            self.reviews.fetch_add(1, Ordering::SeqCst);
            Box::pin(async move { Ok(caller.username == "alice") })
        }
    }

    fn settings(ttl: Duration) -> Settings {
        Settings { mode: Mode::Kubernetes, cache_ttl: ttl, cache_size: 16 }
    }

    #[tokio::test]
    async fn a_token_is_authenticated_then_authorized_and_both_outcomes_are_cached() {
        let fake = Fake::default();
        let reviews = fake.reviews.clone();
        let gate = Gate::new("test", Box::new(fake), &settings(Duration::from_secs(60)));
        assert_eq!(
            gate.decide("good-alice", Verb::List).await.unwrap(),
            Decision::Allowed { username: "alice".into() }
        );
        assert_eq!(gate.decide("good-bob", Verb::List).await.unwrap(), Decision::Forbidden { username: "bob".into() });
        assert_eq!(gate.decide("garbage", Verb::Get).await.unwrap(), Decision::Unauthenticated);
        assert_eq!(reviews.load(Ordering::SeqCst), 5);
        // Again: every answer from the cache, no review.
        gate.decide("good-alice", Verb::List).await.unwrap();
        gate.decide("good-bob", Verb::List).await.unwrap();
        gate.decide("garbage", Verb::Get).await.unwrap();
        assert_eq!(reviews.load(Ordering::SeqCst), 5);
        // Another verb is another question.
        gate.decide("good-alice", Verb::Get).await.unwrap();
        assert_eq!(reviews.load(Ordering::SeqCst), 7);
    }

    #[tokio::test]
    async fn a_failed_review_is_an_error_and_never_cached() {
        let fake = Fake::default();
        let reviews = fake.reviews.clone();
        let gate = Gate::new("test", Box::new(fake), &settings(Duration::from_secs(60)));
        assert!(gate.decide("broken", Verb::List).await.is_err());
        assert!(gate.decide("broken", Verb::List).await.is_err());
        assert_eq!(reviews.load(Ordering::SeqCst), 2);
        let none = Gate::unavailable("test", "no kubeconfig".into());
        assert!(matches!(none.decide("good-alice", Verb::List).await, Err(AuthError::NoClient(_))));
    }

    #[test]
    fn the_cache_forgets_after_its_ttl_and_stays_within_its_size() {
        let t0 = Instant::now();
        let mut c = Cache::new(Duration::from_secs(10), 2);
        c.put("a", Verb::Get, Decision::Unauthenticated, t0);
        assert_eq!(c.get("a", Verb::Get, t0 + Duration::from_secs(9)), Some(Decision::Unauthenticated));
        assert_eq!(c.get("a", Verb::Get, t0 + Duration::from_secs(10)), None);
        assert_eq!(c.get("a", Verb::List, t0), None);
        c.put("b", Verb::Get, Decision::Unauthenticated, t0 + Duration::from_secs(1));
        c.put("c", Verb::Get, Decision::Unauthenticated, t0 + Duration::from_secs(2));
        assert_eq!(c.len(), 2);
        // The oldest went.
        assert_eq!(c.get("a", Verb::Get, t0 + Duration::from_secs(2)), None);
        assert!(c.get("b", Verb::Get, t0 + Duration::from_secs(2)).is_some());
        // A TTL of zero keeps nothing.
        let mut off = Cache::new(Duration::ZERO, 2);
        off.put("a", Verb::Get, Decision::Unauthenticated, t0);
        assert!(off.is_empty());
    }

    #[test]
    fn only_one_well_formed_bearer_token_is_taken() {
        let headers = |values: &[&str]| {
            let mut h = HeaderMap::new();
            for v in values {
                h.append(header::AUTHORIZATION, HeaderValue::from_str(v).unwrap());
            }
            h
        };
        assert_eq!(bearer(&headers(&["Bearer abc.def"])), Some("abc.def"));
        assert_eq!(bearer(&headers(&["bearer abc"])), Some("abc"));
        for bad in
            [&[][..], &["Basic dXNlcjpwYXNz"], &["Bearer "], &["Bearer a b"], &["Bearer a", "Bearer b"], &["abc"]]
        {
            assert_eq!(bearer(&headers(bad)), None, "{bad:?}");
        }
        let long = format!("Bearer {}", "a".repeat(MAX_TOKEN_BYTES + 1));
        assert_eq!(bearer(&headers(&[&long])), None);
    }

    #[test]
    fn the_access_review_asks_for_the_verb_on_incidents_cluster_wide() {
        let caller = Caller {
            username: "system:serviceaccount:team:dash".into(),
            uid: Some("u-1".into()),
            groups: vec!["system:serviceaccounts".into()],
            extra: BTreeMap::new(),
        };
        let spec = access_review_spec(&caller, Verb::List);
        let r = spec.resource_attributes.expect("resource attributes");
        assert_eq!(
            (r.group.as_deref(), r.resource.as_deref(), r.verb.as_deref(), r.namespace.as_deref()),
            (Some("gpumedic.io"), Some("incidents"), Some("list"), None)
        );
        assert_eq!(spec.user.as_deref(), Some("system:serviceaccount:team:dash"));
        assert_eq!(spec.groups, Some(vec!["system:serviceaccounts".to_owned()]));
        assert_eq!(spec.extra, None);
    }

    #[test]
    fn the_mode_is_kubernetes_or_none() {
        assert_eq!(Mode::parse("kubernetes"), Ok(Mode::Kubernetes));
        assert_eq!(Mode::parse("none"), Ok(Mode::None));
        assert!(Mode::parse("off").unwrap_err().contains("kubernetes or none"));
    }
}
