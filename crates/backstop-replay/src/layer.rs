use crate::lease::Lease;
use crate::{
    body::PrefixedBody,
    problem::{BodyError, ReplayResponseBody, full, problem, problem_body},
    store::{Claim, Fingerprint, ReplayStore, StoredResponse},
};
use backstop_core::{BoxError, HumanDuration, InvalidConfig};
use backstop_idempotency::IdempotencyKey;
use bytes::{Bytes, BytesMut};
use http::{
    HeaderName, HeaderValue, Method, Request, Response, StatusCode, header, request::Parts,
};
use http_body::Body;
use http_body_util::{BodyExt, Full, LengthLimitError, Limited};
use sha2::{Digest, Sha256};
use std::{
    fmt,
    future::Future,
    pin::Pin,
    sync::Arc,
    task::{Context, Poll},
    time::Duration,
};
use tokio::sync::watch;
use tower_layer::Layer;
use tower_service::Service;
use tracing::Instrument;

/// The request body type the protected service receives.
pub type ReplayRequestBody = http_body_util::combinators::UnsyncBoxBody<Bytes, BodyError>;

/// The authenticated principal (tenant, user) a request acts for, put in the request's
/// extensions by the authentication middleware that runs before the replay layer.
///
/// Stored results are scoped by it: one principal can never receive another's stored response,
/// even with the same key. It must come from authentication, never from a header the client
/// chooses.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Principal(pub String);

type PrincipalFn = dyn Fn(&Parts) -> Option<String> + Send + Sync;
type BusinessFn = dyn Fn(&Parts, &Bytes) -> Option<String> + Send + Sync;
type StorePolicy = dyn Fn(StatusCode) -> bool + Send + Sync;

struct Config {
    store: Arc<dyn ReplayStore>,
    header: HeaderName,
    methods: Vec<Method>,
    require_key: bool,
    principal: Arc<PrincipalFn>,
    business_key: Option<Arc<BusinessFn>>,
    max_request_body: usize,
    max_stored_body: usize,
    ttl: Duration,
    lease: Duration,
    store_status: Arc<StorePolicy>,
    allow_headers: Vec<HeaderName>,
    fail_open: bool,
    single_tenant: bool,
    #[cfg(feature = "postgres")]
    transactional: Option<crate::PgStore>,
}

impl Config {
    fn is_transactional(&self) -> bool {
        #[cfg(feature = "postgres")]
        return self.transactional.is_some();
        #[cfg(not(feature = "postgres"))]
        false
    }
}

/// The principal of every request of a layer built with [`ReplayLayer::single_tenant`].
const SINGLE_TENANT: &str = "(single tenant)";

/// Makes non-idempotent endpoints safe to call twice; see the crate docs.
///
/// ```
/// use backstop_core::BoxError;
/// use backstop_replay::{MemoryStore, ReplayLayer, ReplayRequestBody};
/// use http_body_util::Full;
/// use std::sync::{Arc, atomic::{AtomicU32, Ordering}};
/// use tower::{Layer, ServiceExt, service_fn};
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), BoxError> {
/// let refunds = Arc::new(AtomicU32::new(0));
/// let booked = refunds.clone();
/// let handler = service_fn(move |_req: http::Request<ReplayRequestBody>| {
///     booked.fetch_add(1, Ordering::SeqCst);
///     async { Ok::<_, BoxError>(http::Response::builder().status(201).body(Full::<bytes::Bytes>::from("{\"refund\":\"rf_1\"}"))?) }
/// });
/// let svc = ReplayLayer::new(MemoryStore::default()).single_tenant().layer(handler);
/// let refund = || {
///     http::Request::post("http://payments.local/refunds")
///         .header("idempotency-key", "refund-ORD-4812")
///         .body(Full::<bytes::Bytes>::from("{\"eur\":40}"))
///         .unwrap()
/// };
/// let first = svc.clone().oneshot(refund()).await?;
/// let repeat = svc.oneshot(refund()).await?; // the client lost the first reply and asks again
/// assert_eq!((first.status().as_u16(), repeat.status().as_u16()), (201, 201));
/// assert_eq!(refunds.load(Ordering::SeqCst), 1, "refunded once; the repeat got the stored result");
/// # Ok(())
/// # }
/// ```
#[derive(Clone)]
pub struct ReplayLayer {
    cfg: Arc<Config>,
}

impl fmt::Debug for ReplayLayer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let c = &self.cfg;
        f.debug_struct("ReplayLayer")
            .field("store", &c.store)
            .field("header", &c.header)
            .field("methods", &c.methods)
            .field("require_key", &c.require_key)
            .field("max_request_body", &c.max_request_body)
            .field("max_stored_body", &c.max_stored_body)
            .field("ttl", &c.ttl)
            .field("lease", &c.lease)
            .field("fail_open", &c.fail_open)
            .finish()
    }
}

/// By default a response is stored unless its status says the request was refused before it
/// ran (408, 425, 429, 503): those are worth retrying with the same key.
fn default_store_status(s: StatusCode) -> bool {
    !matches!(s.as_u16(), 408 | 425 | 429 | 503)
}

fn default_principal(parts: &Parts) -> Option<String> {
    parts.extensions.get::<Principal>().map(|p| p.0.clone())
}

impl ReplayLayer {
    /// A replay layer over `store` with the defaults: keys required on POST and PATCH in the
    /// `Idempotency-Key` header, results kept 24 h, claims leased for 30 s (renewed while the
    /// handler runs), request and stored response bodies up to 1 MiB.
    pub fn new(store: impl ReplayStore) -> Self {
        Self::with_store(Arc::new(store))
    }

    /// The same, with a shared store.
    pub fn with_store(store: Arc<dyn ReplayStore>) -> Self {
        ReplayLayer {
            cfg: Arc::new(Config {
                store,
                header: HeaderName::from_static("idempotency-key"),
                methods: vec![Method::POST, Method::PATCH],
                require_key: true,
                principal: Arc::new(default_principal),
                business_key: None,
                max_request_body: 1 << 20,
                max_stored_body: 1 << 20,
                ttl: Duration::from_secs(24 * 60 * 60),
                lease: Duration::from_secs(30),
                store_status: Arc::new(default_store_status),
                allow_headers: [
                    "content-type",
                    "content-language",
                    "content-location",
                    "location",
                    "etag",
                    "last-modified",
                    "cache-control",
                ]
                .into_iter()
                .map(HeaderName::from_static)
                .collect(),
                fail_open: false,
                single_tenant: false,
                #[cfg(feature = "postgres")]
                transactional: None,
            }),
        }
    }

    /// A replay layer whose handler runs in a database transaction shared with the store: it
    /// finds a [`PgTransaction`](crate::PgTransaction) in its request's extensions, writes its
    /// business rows through it, and the layer writes the stored response in the same
    /// transaction and commits both. The key is then stored atomically with the effect: a
    /// crash between them leaves neither, and a retry runs the handler once more, for the
    /// first time as far as the database is concerned. A handler whose lease was lost before
    /// the commit commits nothing (409 `lease-lost`). Effects outside the transaction (an
    /// e-mail, another service's API) are not covered: give those the key.
    #[cfg(feature = "postgres")]
    pub fn transactional(store: crate::PgStore) -> Self {
        let layer = Self::with_store(Arc::new(store.clone()));
        layer.edit(|c| c.transactional = Some(store))
    }

    fn edit(mut self, f: impl FnOnce(&mut Config)) -> Self {
        let cfg = Arc::get_mut(&mut self.cfg).expect("configure a ReplayLayer before cloning it");
        f(cfg);
        self
    }

    /// The key header (`Idempotency-Key`).
    #[must_use]
    pub fn header(self, name: HeaderName) -> Self {
        self.edit(|c| c.header = name)
    }

    /// The methods that are deduplicated (POST and PATCH). Others pass through untouched.
    #[must_use]
    pub fn methods(self, methods: impl IntoIterator<Item = Method>) -> Self {
        let m = methods.into_iter().collect();
        self.edit(|c| c.methods = m)
    }

    /// Whether a request to a deduplicated method without a key is refused with 400 (the
    /// default) or passed through unprotected.
    #[must_use]
    pub fn require_key(self, required: bool) -> Self {
        self.edit(|c| c.require_key = required)
    }

    /// How to find the request's principal. The default reads the [`Principal`] extension. A
    /// keyed request with no principal is refused (500, `principal-missing`: the server is
    /// misconfigured, most often because the authentication layer sits inside this one),
    /// unless the layer is built for a [`single_tenant`](Self::single_tenant) service.
    #[must_use]
    pub fn principal(self, f: impl Fn(&Parts) -> Option<String> + Send + Sync + 'static) -> Self {
        self.edit(|c| c.principal = Arc::new(f))
    }

    /// The service has one tenant: requests without a principal share one scope instead of
    /// being refused. Do not use it for a service with several tenants: their stored results
    /// would be shared.
    #[must_use]
    pub fn single_tenant(self) -> Self {
        self.edit(|c| c.single_tenant = true)
    }

    /// A business identity for a request ("label for order 4812"): requests with the same one
    /// are the same action even when their keys or arguments differ, so a model re-calling a
    /// tool with slightly different arguments still gets the original result instead of a
    /// second effect.
    #[must_use]
    pub fn business_key(
        self,
        f: impl Fn(&Parts, &Bytes) -> Option<String> + Send + Sync + 'static,
    ) -> Self {
        self.edit(|c| c.business_key = Some(Arc::new(f)))
    }

    /// How long results are kept (24 h).
    #[must_use]
    pub fn ttl(self, ttl: Duration) -> Self {
        self.edit(|c| c.ttl = ttl)
    }

    /// How long a claim lasts without renewal (30 s). The layer renews it every third of that
    /// while the handler runs, so it only expires when the process stops or hangs.
    #[must_use]
    pub fn lease(self, lease: Duration) -> Self {
        self.edit(|c| c.lease = lease)
    }

    /// The largest request body read (1 MiB); larger requests get 413.
    #[must_use]
    pub fn max_request_body(self, bytes: usize) -> Self {
        self.edit(|c| c.max_request_body = bytes)
    }

    /// The largest response body stored (1 MiB). A larger response is returned to its caller in
    /// full, but only its status is kept; a repeat gets a 409 problem saying the request was
    /// processed and its response cannot be replayed.
    #[must_use]
    pub fn max_stored_body(self, bytes: usize) -> Self {
        self.edit(|c| c.max_stored_body = bytes)
    }

    /// Which statuses are stored. By default every status except 408, 425, 429 and 503 (the
    /// request was refused before it ran). Storing 5xx follows Stripe: once the handler ran,
    /// its effect may be partial, and running it again is worse than replaying the error.
    #[must_use]
    pub fn store_status(self, f: impl Fn(StatusCode) -> bool + Send + Sync + 'static) -> Self {
        self.edit(|c| c.store_status = Arc::new(f))
    }

    /// Adds a response header to the stored allow-list (content type, language and location,
    /// `Location`, `ETag`, `Last-Modified`, `Cache-Control` by default). `Set-Cookie` and `Date`
    /// are never stored, whatever the list says.
    #[must_use]
    pub fn allow_header(self, name: HeaderName) -> Self {
        self.edit(|c| c.allow_headers.push(name))
    }

    /// When the store is unreachable, run requests without deduplication instead of answering
    /// 503 (off: the layer fails closed).
    #[must_use]
    pub fn fail_open(self, open: bool) -> Self {
        self.edit(|c| c.fail_open = open)
    }

    /// Checks the configuration.
    pub fn validate(&self) -> Result<(), InvalidConfig> {
        let c = &self.cfg;
        if c.lease < Duration::from_millis(30) {
            return Err(InvalidConfig::new("replay lease must be at least 30 ms"));
        }
        if c.ttl < c.lease {
            return Err(InvalidConfig::new(
                "replay ttl must not be shorter than the lease",
            ));
        }
        if c.methods.is_empty() {
            return Err(InvalidConfig::new(
                "replay methods must name at least one method",
            ));
        }
        Ok(())
    }
}

impl<S> Layer<S> for ReplayLayer {
    type Service = Replay<S>;
    fn layer(&self, inner: S) -> Self::Service {
        Replay {
            inner,
            cfg: self.cfg.clone(),
        }
    }
}

/// See [`ReplayLayer`].
#[derive(Clone)]
pub struct Replay<S> {
    inner: S,
    cfg: Arc<Config>,
}

impl<S: fmt::Debug> fmt::Debug for Replay<S> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Replay")
            .field("inner", &self.inner)
            .finish()
    }
}

/// Response future of [`Replay`]: boxed, since serving a keyed request awaits the store, the
/// handler and the response body in turn.
pub type ReplayFuture<E> =
    Pin<Box<dyn Future<Output = Result<Response<ReplayResponseBody>, E>> + Send>>;

impl<S, B, ResB> Service<Request<B>> for Replay<S>
where
    S: Service<Request<ReplayRequestBody>, Response = Response<ResB>> + Clone + Send + 'static,
    S::Future: Send,
    S::Error: Send + 'static,
    B: Body<Data = Bytes> + Send + 'static,
    B::Error: Into<BoxError>,
    ResB: Body<Data = Bytes> + Send + 'static,
    ResB::Error: Into<BoxError>,
{
    type Response = Response<ReplayResponseBody>;
    type Error = S::Error;
    type Future = ReplayFuture<S::Error>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), S::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: Request<B>) -> Self::Future {
        let clone = self.inner.clone();
        let svc = std::mem::replace(&mut self.inner, clone);
        Box::pin(serve(self.cfg.clone(), svc, req))
    }
}

fn boxed_response<ResB>(res: Response<ResB>) -> Response<ReplayResponseBody>
where
    ResB: Body<Data = Bytes> + Send + 'static,
    ResB::Error: Into<BoxError>,
{
    res.map(|b| b.map_err(|e| BodyError(e.into())).boxed_unsync())
}

fn field(h: &mut Sha256, bytes: &[u8]) {
    h.update(u32::try_from(bytes.len()).unwrap_or(u32::MAX).to_be_bytes());
    h.update(bytes);
}

/// Where the key of a stored result comes from.
enum Identity {
    Key(IdempotencyKey),
    Business(String),
}

/// The store key, `<scope>:<digest>`: the scope stands for the principal alone (16 hex digits,
/// so a store can bound each principal's entries; a 64-bit FNV-1a of it, which hides nothing
/// that a SHA-256 of a guessable name would), the digest is a SHA-256 of the principal and the
/// identity. Keys and principals are never stored in clear.
fn store_key(principal: &str, id: &Identity) -> String {
    let mut scope: u64 = 0xcbf2_9ce4_8422_2325;
    for b in b"backstop-replay-scope/v2\0"
        .iter()
        .chain(principal.as_bytes())
    {
        scope = (scope ^ u64::from(*b)).wrapping_mul(0x0000_0100_0000_01b3);
    }
    let mut h = Sha256::new();
    h.update(b"backstop-replay-key/v2\0");
    field(&mut h, principal.as_bytes());
    match id {
        Identity::Key(k) => {
            field(&mut h, b"key");
            field(&mut h, k.as_str().as_bytes());
        }
        Identity::Business(b) => {
            field(&mut h, b"business");
            field(&mut h, b.as_bytes());
        }
    }
    let mut out = [0u8; 16 + 1 + 64];
    hex::encode_to_slice(scope.to_be_bytes(), &mut out[..16]).expect("16 hex digits");
    out[16] = b':';
    hex::encode_to_slice(h.finalize(), &mut out[17..]).expect("64 hex digits");
    String::from_utf8(out.to_vec()).expect("hex is ASCII")
}

/// The request's fingerprint: method, path and query, and body, in one pass over the body.
fn fingerprint(parts: &Parts, body: &Bytes) -> Fingerprint {
    let mut h = Sha256::new();
    h.update(b"backstop-replay-fingerprint/v2\0");
    field(&mut h, parts.method.as_str().as_bytes());
    field(
        &mut h,
        parts
            .uri
            .path_and_query()
            .map_or("/", |p| p.as_str())
            .as_bytes(),
    );
    field(&mut h, body);
    h.finalize().into()
}

/// Reads the key header: exactly one line, a valid key (bare or as a structured-field string).
fn read_key(parts: &Parts, name: &HeaderName) -> Result<Option<IdempotencyKey>, String> {
    let mut values = parts.headers.get_all(name).iter();
    let Some(v) = values.next() else {
        return Ok(None);
    };
    if values.next().is_some() {
        return Err(format!(
            "the request has more than one {name} header; send exactly one"
        ));
    }
    IdempotencyKey::from_header(v)
        .map(Some)
        .map_err(|why| format!("the {name} header is invalid: {why}"))
}

fn replayed(stored: &StoredResponse) -> Response<ReplayResponseBody> {
    if let Some(read) = stored.body_omitted {
        return problem(
            StatusCode::CONFLICT,
            "response-not-stored",
            "Already processed",
            &format!(
                "a request with this idempotency key was already processed (status {}), but its \
                 response ({read} bytes or more) was too large to store, so it cannot be replayed; \
                 look the result up instead of repeating the request",
                stored.status
            ),
        );
    }
    let mut res = Response::new(full(stored.body.clone()));
    *res.status_mut() =
        StatusCode::from_u16(stored.status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    for (k, v) in &stored.headers {
        res.headers_mut().append(k.clone(), v.clone());
    }
    res.headers_mut()
        .insert("idempotent-replayed", HeaderValue::from_static("true"));
    res
}

fn retry_later(mut res: Response<ReplayResponseBody>) -> Response<ReplayResponseBody> {
    res.headers_mut()
        .insert(header::RETRY_AFTER, HeaderValue::from_static("1"));
    res
}

async fn call_inner<S, ResB>(
    mut svc: S,
    req: Request<ReplayRequestBody>,
) -> Result<Response<ReplayResponseBody>, S::Error>
where
    S: Service<Request<ReplayRequestBody>, Response = Response<ResB>>,
    ResB: Body<Data = Bytes> + Send + 'static,
    ResB::Error: Into<BoxError>,
{
    svc.call(req).await.map(boxed_response)
}

async fn serve<S, B, ResB>(
    cfg: Arc<Config>,
    svc: S,
    req: Request<B>,
) -> Result<Response<ReplayResponseBody>, S::Error>
where
    S: Service<Request<ReplayRequestBody>, Response = Response<ResB>> + Send + 'static,
    S::Future: Send,
    S::Error: Send + 'static,
    B: Body<Data = Bytes> + Send + 'static,
    B::Error: Into<BoxError>,
    ResB: Body<Data = Bytes> + Send + 'static,
    ResB::Error: Into<BoxError>,
{
    let (parts, body) = req.into_parts();
    if !cfg.methods.contains(&parts.method) {
        let body = body.map_err(|e| BodyError(e.into())).boxed_unsync();
        return call_inner(svc, Request::from_parts(parts, body)).await;
    }
    let key = match read_key(&parts, &cfg.header) {
        Ok(k) => k,
        Err(why) => {
            return Ok(problem(
                StatusCode::BAD_REQUEST,
                "invalid-idempotency-key",
                "Invalid idempotency key",
                &why,
            ));
        }
    };
    let bytes = match Limited::new(body, cfg.max_request_body).collect().await {
        Ok(c) => c.to_bytes(),
        Err(e) if e.is::<LengthLimitError>() => {
            return Ok(problem(
                StatusCode::PAYLOAD_TOO_LARGE,
                "request-too-large",
                "Request body too large",
                &format!(
                    "the request body is larger than the {} bytes this endpoint accepts",
                    cfg.max_request_body
                ),
            ));
        }
        Err(e) => {
            return Ok(problem(
                StatusCode::BAD_REQUEST,
                "unreadable-body",
                "Unreadable request body",
                &format!("the request body could not be read: {e}"),
            ));
        }
    };
    let rebuilt = |parts: Parts, bytes: Bytes| {
        Request::from_parts(
            parts,
            Full::new(bytes).map_err(|e| match e {}).boxed_unsync(),
        )
    };
    let business = cfg.business_key.as_ref().and_then(|f| f(&parts, &bytes));
    let identity = match (business, key) {
        (Some(b), _) => Identity::Business(b),
        (None, Some(k)) => Identity::Key(k),
        (None, None) if cfg.require_key => {
            return Ok(problem(
                StatusCode::BAD_REQUEST,
                "idempotency-key-missing",
                "Idempotency key required",
                &format!(
                    "this endpoint requires an {} header so that a retried request is not processed twice; \
                     send one key per intended action and reuse it on every retry",
                    cfg.header
                ),
            ));
        }
        (None, None) => return call_inner(svc, rebuilt(parts, bytes)).await,
    };
    let is_business = matches!(identity, Identity::Business(_));
    let principal = match (cfg.principal)(&parts) {
        Some(p) => p,
        None if cfg.single_tenant => SINGLE_TENANT.to_owned(),
        None => {
            count("no_principal");
            tracing::error!(target: "backstop::replay", "a keyed request reached the replay layer without a principal; refused");
            return Ok(problem(
                StatusCode::INTERNAL_SERVER_ERROR,
                "principal-missing",
                "Server misconfigured",
                "the server is misconfigured: the request reached the idempotency layer without an \
                 authenticated principal, so its stored result could be shared with another \
                 tenant; it was not processed. (Operators: put the authentication layer outside \
                 the replay layer, or build the layer with single_tenant() if the service has \
                 one tenant.)",
            ));
        }
    };
    let skey = store_key(&principal, &identity);
    let fp = fingerprint(&parts, &bytes);

    let token = match cfg.store.claim(&skey, fp, cfg.lease).await {
        Ok(Claim::Claimed { token }) => token,
        Ok(Claim::Done {
            fingerprint,
            response,
        }) => {
            if fingerprint != fp && !is_business {
                return Ok(mismatch());
            }
            count("replayed");
            return Ok(replayed(&response));
        }
        Ok(Claim::InFlight { fingerprint }) => {
            if fingerprint != fp && !is_business {
                return Ok(mismatch());
            }
            count("in_flight");
            return Ok(retry_later(problem(
                StatusCode::CONFLICT,
                "request-in-flight",
                "Request in progress",
                "a request with this idempotency key is still being processed; retry after it completes to get its result",
            )));
        }
        Err(e) if cfg.fail_open => {
            tracing::warn!(target: "backstop::replay", error = %e, "store unavailable; running the request without deduplication (fail_open)");
            return call_inner(svc, rebuilt(parts, bytes)).await;
        }
        Err(e) => {
            tracing::warn!(target: "backstop::replay", error = %e, "store unavailable; refusing the request");
            return Ok(store_unavailable());
        }
    };

    // From here on the handler's work is decoupled from this request's future: a client that
    // gives up (and drops it) cannot stop a handler that has started, nor release its claim.
    // The task runs the handler, reads its response, stores it, and hands it back.
    let (lease, held) = Lease::new(token);
    let mut req = rebuilt(parts, bytes);
    req.extensions_mut().insert(lease);
    // The handler's own task continues the request's span (and so its trace).
    let task =
        tokio::spawn(run_claimed(cfg.clone(), svc, req, skey, token, held).in_current_span());
    match task.await {
        Ok(result) => result,
        // The handler panicked: the task's guard recorded the outcome as unknown, or, in a
        // transaction, rolled everything back and freed the key.
        Err(_) if cfg.is_transactional() => Ok(problem(
            StatusCode::INTERNAL_SERVER_ERROR,
            "handler-failed",
            "Handler failed",
            "the handler failed before answering; its transaction was rolled back, so nothing \
             was committed; retry with the same idempotency key",
        )),
        Err(_) => Ok(unknown_outcome()),
    }
}

/// The record of a claimed request whose handler ended without a response (it returned an
/// error, panicked, or its task was stopped): its outcome is unknown, and a repeat is told so
/// instead of running the handler a second time.
fn unknown_record() -> StoredResponse {
    StoredResponse {
        status: StatusCode::CONFLICT.as_u16(),
        headers: vec![(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/problem+json"),
        )],
        body: problem_body(
            StatusCode::CONFLICT,
            "outcome-unknown",
            "Outcome unknown",
            UNKNOWN_DETAIL,
        ),
        body_omitted: None,
    }
}

const UNKNOWN_DETAIL: &str = "a request with this idempotency key started processing and ended \
    without a response (the handler failed or the server stopped), so it may or may not have \
    taken effect; it was not run again. Check the result before repeating the action with a new \
    key.";

/// What the first caller of a handler that panicked gets: the record its repeats get.
fn unknown_outcome() -> Response<ReplayResponseBody> {
    let record = unknown_record();
    let mut res = Response::new(full(record.body));
    *res.status_mut() = StatusCode::CONFLICT;
    for (k, v) in record.headers {
        res.headers_mut().insert(k, v);
    }
    res
}

/// Runs a claimed request to the end, whatever its client does: the handler, its response
/// body up to the storage limit, and the store's record.
async fn run_claimed<S, ResB>(
    cfg: Arc<Config>,
    svc: S,
    req: Request<ReplayRequestBody>,
    key: String,
    token: u64,
    held: watch::Sender<bool>,
) -> Result<Response<ReplayResponseBody>, S::Error>
where
    S: Service<Request<ReplayRequestBody>, Response = Response<ResB>>,
    ResB: Body<Data = Bytes> + Send + 'static,
    ResB::Error: Into<BoxError>,
{
    // The lease is renewed beside the work, in the same task, until the claim is settled.
    let held = Arc::new(held);
    let renewals = renew_while_running(cfg.clone(), key.clone(), token, held.clone());
    let work = settle(cfg, svc, req, key, token, held);
    let (mut work, mut renewals) = (std::pin::pin!(work), std::pin::pin!(renewals));
    std::future::poll_fn(|cx| {
        if let Poll::Ready(done) = work.as_mut().poll(cx) {
            return Poll::Ready(done);
        }
        match renewals.as_mut().poll(cx) {
            Poll::Ready(never) => match never {},
            Poll::Pending => Poll::Pending,
        }
    })
    .await
}

/// Renews the claim every third of its lease, forever (the caller stops polling once the
/// claim is settled), and reports the lease lost when the store refuses a renewal or none
/// succeeded for a whole lease.
async fn renew_while_running(
    cfg: Arc<Config>,
    key: String,
    token: u64,
    held: Arc<watch::Sender<bool>>,
) -> std::convert::Infallible {
    let lease = cfg.lease;
    let mut last = tokio::time::Instant::now();
    loop {
        tokio::time::sleep(lease / 3).await;
        if !*held.borrow() {
            continue;
        }
        match cfg.store.renew(&key, token, lease).await {
            Ok(true) => last = tokio::time::Instant::now(),
            Ok(false) => {
                tracing::error!(target: "backstop::replay", "the claim was taken over (its lease expired); a repeat may run the handler again");
                held.send_replace(false);
            }
            Err(e) => {
                tracing::warn!(target: "backstop::replay", error = %e, "could not renew a claim");
                if last.elapsed() >= lease {
                    tracing::error!(target: "backstop::replay", "no renewal for a whole lease: the claim may have expired, and a repeat may run the handler again");
                    held.send_replace(false);
                }
            }
        }
    }
}

/// The handler, its response and its record: what settles a claim.
async fn settle<S, ResB>(
    cfg: Arc<Config>,
    svc: S,
    req: Request<ReplayRequestBody>,
    key: String,
    token: u64,
    held: Arc<watch::Sender<bool>>,
) -> Result<Response<ReplayResponseBody>, S::Error>
where
    S: Service<Request<ReplayRequestBody>, Response = Response<ResB>>,
    ResB: Body<Data = Bytes> + Send + 'static,
    ResB::Error: Into<BoxError>,
{
    #[cfg(feature = "postgres")]
    if let Some(pg) = cfg.transactional.clone() {
        return run_in_transaction(cfg, &pg, svc, req, key, token, held).await;
    }
    let guard = ClaimGuard::new(cfg.clone(), key, token, held);
    let res = match call_inner(svc, req).await {
        Ok(res) => res,
        Err(e) => {
            // No response: whatever the handler did is unknown.
            guard.complete(&unknown_record()).await;
            return Err(e);
        }
    };
    if !(cfg.store_status)(res.status()) {
        // The handler says it refused the request before acting (503, 429, ...): the key is
        // free for a retry.
        guard.release().await;
        return Ok(res);
    }
    Ok(capture(&cfg, guard, res).await)
}

/// Counts what the layer answered without running the handler (`replayed` is a duplicate
/// prevented), with the `metrics` feature.
fn count(outcome: &'static str) {
    #[cfg(feature = "metrics")]
    metrics::counter!("backstop_replay_total", "outcome" => outcome).increment(1);
    let _ = outcome;
}

fn mismatch() -> Response<ReplayResponseBody> {
    count("mismatch");
    problem(
        StatusCode::UNPROCESSABLE_ENTITY,
        "idempotency-key-reused",
        "Idempotency key reused",
        "this idempotency key was already used for a different request (method, path or body); \
         use a new key for a different action",
    )
}

/// Reads the response body up to the storage limit, stores the result, and returns the full
/// response to the caller.
async fn capture(
    cfg: &Config,
    guard: ClaimGuard,
    res: Response<ReplayResponseBody>,
) -> Response<ReplayResponseBody> {
    let (stored, res) = buffer(cfg, res).await;
    guard.complete(&stored).await;
    res
}

/// Reads the response body up to the storage limit: the record to store, and the response to
/// return (the part read, then the rest of a body too large to store).
async fn buffer(
    cfg: &Config,
    res: Response<ReplayResponseBody>,
) -> (StoredResponse, Response<ReplayResponseBody>) {
    let (parts, body) = res.into_parts();
    let mut body = body;
    let mut buf = BytesMut::new();
    let mut failed: Option<BoxError> = None;
    // `body` is the boxed response body: its errors are `BodyError`.
    let mut over = false;
    loop {
        match body.frame().await {
            None => break,
            Some(Err(e)) => {
                failed = Some(e.0);
                break;
            }
            Some(Ok(frame)) => {
                if let Ok(data) = frame.into_data() {
                    buf.extend_from_slice(&data);
                    if buf.len() > cfg.max_stored_body {
                        over = true;
                        break;
                    }
                }
            }
        }
    }
    let headers = parts
        .headers
        .iter()
        .filter(|(k, _)| {
            *k != header::SET_COOKIE && *k != header::DATE && cfg.allow_headers.contains(k)
        })
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect();
    let read = buf.len() as u64;
    let prefix = buf.freeze();
    let stored = StoredResponse {
        status: parts.status.as_u16(),
        headers,
        body: if over || failed.is_some() {
            Bytes::new()
        } else {
            prefix.clone()
        },
        body_omitted: (over || failed.is_some()).then_some(read),
    };
    let body = if over || failed.is_some() {
        PrefixedBody {
            prefix: (!prefix.is_empty()).then_some(prefix),
            rest: over.then_some(body),
            error: failed,
        }
        .boxed_unsync()
    } else {
        full(prefix)
    };
    (stored, Response::from_parts(parts, body))
}

/// Runs a claimed request in one database transaction with its record: the handler writes
/// through the [`PgTransaction`](crate::PgTransaction) in its extensions, the layer writes the
/// stored response in the same transaction (fenced by the claim's token) and commits. A crash
/// before the commit leaves neither the effect nor the record, and the key is free again once
/// the lease expires; a handler that fails, or answers with a status that is not stored, is
/// rolled back and its key released.
#[cfg(feature = "postgres")]
async fn run_in_transaction<S, ResB>(
    cfg: Arc<Config>,
    pg: &crate::PgStore,
    svc: S,
    mut req: Request<ReplayRequestBody>,
    key: String,
    token: u64,
    held: Arc<watch::Sender<bool>>,
) -> Result<Response<ReplayResponseBody>, S::Error>
where
    S: Service<Request<ReplayRequestBody>, Response = Response<ResB>>,
    ResB: Body<Data = Bytes> + Send + 'static,
    ResB::Error: Into<BoxError>,
{
    let mut guard = ClaimGuard::new(cfg.clone(), key.clone(), token, held);
    // Dropped before the commit (a panic, a stopped task), the transaction rolls back: nothing
    // happened, so the key is released rather than marked unknown.
    guard.on_drop = OnDrop::Release;
    let tx = match pg.begin().await {
        Ok(tx) => tx,
        Err(e) => {
            tracing::warn!(target: "backstop::replay", error = %e, "could not open a transaction; refusing the request");
            guard.release().await;
            return Ok(store_unavailable());
        }
    };
    let shared = crate::PgTransaction::new(tx);
    req.extensions_mut().insert(shared.clone());
    let res = match call_inner(svc, req).await {
        Ok(res) => res,
        Err(e) => {
            drop(shared.take().await);
            guard.release().await;
            return Err(e);
        }
    };
    if !(cfg.store_status)(res.status()) {
        drop(shared.take().await);
        guard.release().await;
        return Ok(res);
    }
    let (stored, res) = buffer(&cfg, res).await;
    let Some(mut tx) = shared.take().await else {
        guard.release().await;
        return Ok(store_unavailable());
    };
    match pg.complete_in(&mut tx, &key, token, &stored, cfg.ttl).await {
        Ok(true) => match tx.commit().await {
            Ok(()) => {
                guard.done();
                Ok(res)
            }
            Err(e) => {
                tracing::warn!(target: "backstop::replay", error = %e, "the commit failed: nothing happened; the key is released");
                guard.release().await;
                Ok(store_unavailable())
            }
        },
        Ok(false) => {
            // The lease was lost and another request owns the key: commit nothing.
            drop(tx);
            guard.done();
            count("lease_lost");
            Ok(retry_later(problem(
                StatusCode::CONFLICT,
                "lease-lost",
                "Request superseded",
                "this request's claim on its idempotency key expired while it ran and another \
                 request took it over, so nothing it did was committed; retry with the same key \
                 to get that request's result",
            )))
        }
        Err(e) => {
            tracing::warn!(target: "backstop::replay", error = %e, "could not record the result: nothing was committed; the key is released");
            drop(tx);
            guard.release().await;
            Ok(store_unavailable())
        }
    }
}

fn store_unavailable() -> Response<ReplayResponseBody> {
    count("store_unavailable");
    retry_later(problem(
        StatusCode::SERVICE_UNAVAILABLE,
        "replay-store-unavailable",
        "Deduplication unavailable",
        "the idempotency store is unavailable, so the request was not processed (it could not \
         be protected against duplicates); retry later with the same key",
    ))
}

/// What a guard dropped before its claim was settled does.
#[derive(Clone, Copy, PartialEq, Eq)]
enum OnDrop {
    /// The handler started and may have acted: record the outcome as unknown.
    RecordUnknown,
    /// Nothing can have happened (its transaction rolled back): free the key.
    #[cfg_attr(not(feature = "postgres"), allow(dead_code))]
    Release,
}

/// Holds a claim while its handler runs (the lease is renewed beside it, by
/// [`renew_while_running`]): stores the result (retrying while the lease holds), and, if it is
/// dropped before that (the handler panicked, or the runtime stopped its task), records the
/// outcome as unknown.
struct ClaimGuard {
    cfg: Arc<Config>,
    key: String,
    token: u64,
    held: Arc<watch::Sender<bool>>,
    armed: bool,
    on_drop: OnDrop,
}

impl ClaimGuard {
    fn new(cfg: Arc<Config>, key: String, token: u64, held: Arc<watch::Sender<bool>>) -> Self {
        ClaimGuard {
            cfg,
            key,
            token,
            held,
            armed: true,
            on_drop: OnDrop::RecordUnknown,
        }
    }

    /// The claim was settled elsewhere (in the handler's transaction).
    #[cfg_attr(not(feature = "postgres"), allow(dead_code))]
    fn done(mut self) {
        self.disarm();
    }

    fn disarm(&mut self) {
        self.armed = false;
    }

    /// Stores the result. A store that fails for a moment is tried again, with the lease still
    /// renewed (repeats meanwhile get 409), for as long as the lease is held.
    async fn complete(mut self, stored: &StoredResponse) {
        let mut wait = Duration::from_millis(20);
        loop {
            match self
                .cfg
                .store
                .complete(&self.key, self.token, stored, self.cfg.ttl)
                .await
            {
                Ok(true) => break,
                Ok(false) => {
                    tracing::error!(
                        target: "backstop::replay",
                        "the claim expired before the handler finished (lease {}); a newer request owns the key and this result was not stored",
                        HumanDuration(self.cfg.lease)
                    );
                    break;
                }
                Err(e) if *self.held.borrow() => {
                    tracing::warn!(target: "backstop::replay", error = %e, "could not store a result; trying again while the claim is held");
                    tokio::time::sleep(wait).await;
                    wait = (wait * 2).min(self.cfg.lease / 3);
                }
                Err(e) => {
                    tracing::error!(target: "backstop::replay", error = %e, "could not store a result before the claim was lost; a repeat may run the handler again");
                    break;
                }
            }
        }
        self.disarm();
    }

    /// Gives the claim back: the handler refused the request before acting.
    async fn release(mut self) {
        self.disarm();
        if let Err(e) = self.cfg.store.release(&self.key, self.token).await {
            tracing::warn!(target: "backstop::replay", error = %e, "could not release a claim; it will expire with its lease");
        }
    }
}

impl Drop for ClaimGuard {
    fn drop(&mut self) {
        if !self.armed {
            return;
        }
        self.disarm();
        // The handler started and ended without a response (it panicked, or its task was
        // stopped): record that its outcome is unknown, rather than free the key for a second
        // run. If the runtime is shutting down this cannot run, and the lease expires instead.
        if let Ok(h) = tokio::runtime::Handle::try_current() {
            let (store, key, token, ttl, on_drop) = (
                self.cfg.store.clone(),
                std::mem::take(&mut self.key),
                self.token,
                self.cfg.ttl,
                self.on_drop,
            );
            h.spawn(async move {
                let _ = match on_drop {
                    OnDrop::RecordUnknown => {
                        store.complete(&key, token, &unknown_record(), ttl).await
                    }
                    OnDrop::Release => store.release(&key, token).await,
                };
            });
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parts(headers: &[(&str, &str)]) -> Parts {
        let mut b = Request::post("/refunds");
        for (k, v) in headers {
            b = b.header(*k, *v);
        }
        b.body(()).unwrap().into_parts().0
    }

    #[test]
    fn key_header_rules() {
        let h = HeaderName::from_static("idempotency-key");
        assert_eq!(read_key(&parts(&[]), &h), Ok(None));
        assert_eq!(
            read_key(&parts(&[("idempotency-key", "abc")]), &h),
            Ok(Some(IdempotencyKey::new("abc").unwrap()))
        );
        assert_eq!(
            read_key(&parts(&[("idempotency-key", "\"abc\"")]), &h),
            Ok(Some(IdempotencyKey::new("abc").unwrap()))
        );
        for bad in ["\"abc", "a b", "\"\"", "a\"b"] {
            assert!(
                read_key(&parts(&[("idempotency-key", bad)]), &h).is_err(),
                "{bad}"
            );
        }
        let long = "k".repeat(256);
        assert!(read_key(&parts(&[("idempotency-key", &long)]), &h).is_err());
        let two = parts(&[("idempotency-key", "a"), ("idempotency-key", "a")]);
        assert!(read_key(&two, &h).unwrap_err().contains("more than one"));
    }

    #[test]
    fn store_keys_are_scoped_hashed_and_distinct() {
        let k = || Identity::Key(IdempotencyKey::new("k").unwrap());
        let a = store_key("tenant-a", &k());
        let b = store_key("tenant-b", &k());
        let c = store_key("tenant-a", &Identity::Business("k".into()));
        assert_ne!(a, b);
        assert_ne!(a, c);
        assert_eq!(a.len(), 16 + 1 + 64);
        let (scope, digest) = a.split_once(':').unwrap();
        assert_eq!(crate::store::scope_of(&a), scope);
        assert_eq!(
            scope,
            crate::store::scope_of(&c),
            "one principal, one scope"
        );
        assert_ne!(scope, crate::store::scope_of(&b));
        assert!(
            (scope.to_owned() + digest)
                .chars()
                .all(|ch| ch.is_ascii_hexdigit()),
            "stored as a hash: {a}"
        );
    }

    #[test]
    fn fingerprints_cover_method_path_and_body() {
        let p = |m: &str, u: &str| {
            Request::builder()
                .method(m)
                .uri(u)
                .body(())
                .unwrap()
                .into_parts()
                .0
        };
        let body = Bytes::from_static(b"{}");
        let base = fingerprint(&p("POST", "/refunds"), &body);
        assert_eq!(base, fingerprint(&p("POST", "/refunds"), &body));
        assert_ne!(base, fingerprint(&p("PATCH", "/refunds"), &body));
        assert_ne!(base, fingerprint(&p("POST", "/refunds?x=1"), &body));
        assert_ne!(
            base,
            fingerprint(&p("POST", "/refunds"), &Bytes::from_static(b"{ }"))
        );
    }
}
