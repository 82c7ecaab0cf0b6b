//! The stacks compared in the benchmarks.

use backstop::{
    Backstop, BackstopLayer,
    backoff::RngSource,
    breaker::{Breaker, BreakerConfig, BreakerLayer, CircuitBreaker},
    budget::Budget,
    classify::HttpClassifier,
    idempotency::HttpKeys,
    idempotency::IdempotencyLayer,
    retry::{HttpResend, Retry, RetryLayer},
    timeout::{AttemptTimeout, AttemptTimeoutLayer, DeadlineLayer, WithDeadline},
};
use bytes::Bytes;
use http::{Request, Response, StatusCode};
use http_body_util::Full;
use std::{
    future::{Ready, ready},
    io,
    sync::Arc,
    time::Duration,
};
use tower::{
    BoxError, Layer, Service, ServiceBuilder, ServiceExt,
    retry::{
        Policy,
        budget::{Budget as _, TpsBudget},
    },
    util::BoxCloneSyncService,
};

/// The request every benchmark sends.
pub type Req = Request<Full<Bytes>>;
/// The response every service returns.
pub type Res = Response<Full<Bytes>>;
/// A type-erased service under test.
pub type Svc = BoxCloneSyncService<Req, Res, BoxError>;

/// A GET with an empty body.
pub fn get() -> Req {
    Request::get("http://carrier.local/rates")
        .body(Full::default())
        .unwrap()
}

/// A realistic request: five headers and a 64-byte body (a GET still, so that every stack,
/// tower's included, treats it the same).
pub fn realistic() -> Req {
    Request::get("http://carrier.local/rates?from=SFO&to=JFK")
        .header("accept", "application/json")
        .header("content-type", "application/json")
        .header("authorization", "Bearer 0123456789abcdef0123456789abcdef")
        .header("user-agent", "backstop-bench/0.1")
        .header("x-request-id", "3f2a9c1e-7b4d-4e8a-9c0f-5d6e7f8a9b0c")
        .body(Full::new(Bytes::from_static(
            b"{\"parcel\":{\"kg\":2.5,\"cm\":[30,20,10]},\"service\":\"express\"}       ",
        )))
        .unwrap()
}

static REALISTIC: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// Makes [`drive`] send [`realistic`] requests instead of [`get`]'s.
pub fn use_realistic_requests() {
    REALISTIC.store(true, std::sync::atomic::Ordering::Relaxed);
}

/// The dependency: answers `200 OK` at once.
pub fn ok_service()
-> impl Service<Req, Response = Res, Error = io::Error, Future = Ready<Result<Res, io::Error>>>
+ Clone
+ Send
+ Sync
+ 'static {
    tower::service_fn(|_req: Req| ready(Ok(Response::new(Full::default()))))
}

/// A dependency that always answers with `status`.
pub fn status_service(
    status: u16,
) -> impl Service<Req, Response = Res, Error = io::Error, Future = Ready<Result<Res, io::Error>>>
+ Clone
+ Send
+ Sync
+ 'static {
    tower::service_fn(move |_req: Req| {
        ready(Ok(Response::builder()
            .status(StatusCode::from_u16(status).unwrap())
            .body(Full::default())
            .unwrap()))
    })
}

fn boxed<S>(s: S) -> Svc
where
    S: Service<Req, Response = Res> + Clone + Send + Sync + 'static,
    S::Error: Into<BoxError>,
    S::Future: Send + 'static,
{
    BoxCloneSyncService::new(s.map_err(Into::into))
}

/// A service under test, as the benchmarks need it.
pub trait Bench:
    Service<Req, Response: Send + 'static, Error: Into<BoxError>> + Clone + Send + Sync + 'static
{
}

impl<S> Bench for S where
    S: Service<Req, Response: Send + 'static, Error: Into<BoxError>>
        + Clone
        + Send
        + Sync
        + 'static
{
}

/// No middleware.
pub fn bare() -> impl Bench {
    ok_service()
}

/// What users reach for today: tower's `retry` with a `Policy` over a `TpsBudget`, and
/// tower's `timeout`.
pub fn tower_stack() -> impl Bench {
    ServiceBuilder::new()
        .retry(tower_policy())
        .timeout(Duration::from_secs(3))
        .service(ok_service())
}

/// A tower retry policy as users write it: retry errors and 5xx up to `attempts` times, within
/// the budget, cloning `Full` bodies.
#[derive(Clone, Debug)]
pub struct TowerPolicy {
    /// The shared budget.
    pub budget: Arc<TpsBudget>,
    /// Retries left.
    pub attempts: usize,
}

impl<B, E> Policy<Req, Response<B>, E> for TowerPolicy {
    type Future = Ready<()>;

    fn retry(
        &mut self,
        _req: &mut Req,
        result: &mut Result<Response<B>, E>,
    ) -> Option<Self::Future> {
        match result {
            Ok(r) if !r.status().is_server_error() => {
                self.budget.deposit();
                None
            }
            _ if self.attempts > 0 && self.budget.withdraw() => {
                self.attempts -= 1;
                Some(ready(()))
            }
            _ => None,
        }
    }

    fn clone_request(&mut self, req: &Req) -> Option<Req> {
        let mut r = Request::new(req.body().clone());
        *r.method_mut() = req.method().clone();
        *r.uri_mut() = req.uri().clone();
        *r.headers_mut() = req.headers().clone();
        Some(r)
    }
}

/// The closest Rust peer: tower-resilience's retry (with its token-bucket budget) and circuit
/// breaker.
pub fn tower_resilience_stack() -> impl Bench {
    use tower_resilience::{
        circuitbreaker::CircuitBreakerLayer,
        retry::{RetryBudgetBuilder, RetryLayer as TrRetry},
    };
    let budget = RetryBudgetBuilder::new()
        .token_bucket()
        .tokens_per_second(10.0)
        .max_tokens(100)
        .build()
        .unwrap();
    let retry = TrRetry::<Req, Res, io::Error>::builder()
        .max_attempts(3)
        .exponential_backoff(Duration::from_millis(200))
        .budget(budget)
        .build();
    let breaker = CircuitBreakerLayer::builder()
        .failure_rate_threshold(0.5)
        .build()
        .unwrap();
    let inner = ServiceBuilder::new()
        .layer(breaker)
        .service(ok_service())
        .map_err(|e| io::Error::other(format!("{e:?}")));
    retry.layer(inner)
}

/// The full Backstop layer for `dependency` (idempotency, call span and errors, deadline, retry
/// with budget, breaker, attempt timeout), with its own budget and breaker and a seeded RNG.
pub fn backstop_layer(
    dependency: &str,
    attempt_timeout: Duration,
) -> BackstopLayer<HttpClassifier, HttpResend, HttpKeys> {
    Backstop::http(dependency)
        .budget(Budget::default())
        .breaker(Breaker::default())
        .rng(RngSource::seeded(1))
        .attempt_timeout(attempt_timeout)
        .build()
        .unwrap()
}

/// The policy of [`tower_stack`]: two retries within a `TpsBudget` (20 %, 10/s, 10 s).
pub fn tower_policy() -> TowerPolicy {
    TowerPolicy {
        budget: Arc::new(TpsBudget::new(Duration::from_secs(10), 10, 0.2)),
        attempts: 2,
    }
}

/// The full Backstop stack whose breaker is isolated for `carrier-api`: every call fails fast.
pub fn backstop_open() -> impl Bench {
    let breaker = Breaker::new(BreakerConfig::default()).unwrap();
    breaker.isolate(&"carrier-api".into());
    Backstop::http("carrier-api")
        .budget(Budget::default())
        .breaker(breaker)
        .rng(RngSource::seeded(1))
        .attempt_timeout(Duration::from_secs(3))
        .build()
        .unwrap()
        .layer(ok_service())
}

/// The full Backstop stack over the immediately ready service, as over any inner service it
/// knows nothing of (`Layer::layer`): each attempt carries the call context.
pub fn backstop_stack() -> impl Bench {
    backstop_layer("carrier-api", Duration::from_secs(3)).layer(ok_service())
}

/// The full stack with some pieces turned off, to see what each costs inside it.
pub fn backstop_without(piece: &str) -> impl Bench {
    let b = Backstop::http("carrier-api")
        .budget(Budget::default())
        .breaker(Breaker::default())
        .rng(RngSource::seeded(1))
        .attempt_timeout(Duration::from_secs(3));
    let b = match piece {
        "breaker" => b.no_breaker(),
        "budget" => b.no_budget(),
        "idempotency" => b.no_idempotency(),
        "deadline" => b.no_deadline(),
        _ => b,
    };
    b.build().unwrap().layer(ok_service())
}

/// The deadline layer alone.
pub fn deadline_only() -> impl Bench {
    DeadlineLayer::new(Duration::from_secs(30)).layer(ok_service())
}

/// The attempt timeout alone.
pub fn attempt_timeout_only() -> impl Bench {
    AttemptTimeoutLayer::new(Duration::from_secs(3)).layer(ok_service())
}

/// The retry layer alone (no budget).
pub fn retry_only() -> impl Bench {
    RetryLayer::http()
        .dependency("carrier-api")
        .rng(RngSource::seeded(1))
        .layer(ok_service())
}

/// The retry layer with a budget.
pub fn retry_budget() -> impl Bench {
    RetryLayer::http()
        .dependency("carrier-api")
        .rng(RngSource::seeded(1))
        .budget(Arc::new(Budget::default()))
        .layer(ok_service())
}

/// The same three jobs as [`tower_stack`]: the retry layer with a budget, over the attempt
/// timeout.
pub fn retry_budget_timeout() -> impl Bench {
    let budget = Budget::default();
    let retry = RetryLayer::http()
        .dependency("carrier-api")
        .rng(RngSource::seeded(1))
        .budget(Arc::new(budget.bind(&"carrier-api".into())));
    ServiceBuilder::new()
        .layer(retry)
        .layer(AttemptTimeoutLayer::new(Duration::from_secs(3)))
        .service(ok_service())
}

/// Each attempt of [`retry_gate_stack`]: through the breaker, then timed.
pub type Gated<S> = CircuitBreaker<AttemptTimeout<S>, HttpClassifier>;

/// The composed stack without its call layer, for `dependency`, over `inner`: a 30 s deadline,
/// the retry layer with its own budget, its own breaker and the attempt timeout.
pub fn retry_gate_stack<S>(
    dependency: &str,
    attempt_timeout: Duration,
    inner: S,
) -> WithDeadline<Retry<Gated<S>, HttpClassifier, HttpResend, backstop::Dependency>> {
    let dependency = backstop::Dependency::new(dependency);
    let retry = RetryLayer::http()
        .dependency(dependency.clone())
        .rng(RngSource::seeded(1))
        .budget(Arc::new(Budget::default().bind(&dependency)));
    let breaker =
        BreakerLayer::new(Breaker::default(), HttpClassifier::default()).dependency(dependency);
    ServiceBuilder::new()
        .layer(DeadlineLayer::new(Duration::from_secs(30)))
        .layer(retry)
        .layer(breaker)
        .layer(AttemptTimeoutLayer::new(attempt_timeout))
        .service(inner)
}

/// [`retry_gate_stack`] over the immediately ready service.
pub fn retry_gate_timeout() -> impl Bench {
    retry_gate_stack("carrier-api", Duration::from_secs(3), ok_service())
}

/// The breaker alone.
pub fn breaker_only() -> impl Bench {
    backstop::breaker::BreakerLayer::http(Breaker::default())
        .dependency("carrier-api")
        .layer(ok_service())
}

/// The idempotency layer alone (a GET needs no key: the check only).
pub fn idempotency_only() -> impl Bench {
    IdempotencyLayer::http().layer(ok_service())
}

/// A breaker that is open for `carrier-api`, in front of a service that counts its calls.
pub fn open_breaker() -> (Svc, Arc<std::sync::atomic::AtomicU64>) {
    let calls = Arc::new(std::sync::atomic::AtomicU64::new(0));
    let c = calls.clone();
    let counting = tower::service_fn(move |_req: Req| {
        c.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        ready(Ok::<_, io::Error>(Response::new(Full::default())))
    });
    let breaker = Breaker::new(BreakerConfig::default()).unwrap();
    breaker.isolate(&"carrier-api".into());
    (
        boxed(
            backstop::breaker::BreakerLayer::http(breaker)
                .dependency("carrier-api")
                .layer(counting),
        ),
        calls,
    )
}

/// A retry layer whose budget refuses every retry, in front of an always-503 service.
pub fn refused_budget() -> Svc {
    let budget = Budget::new(
        backstop::budget::BudgetConfig::default()
            .ratio(0.0)
            .min_retries_per_sec(0.0),
    )
    .unwrap();
    boxed(
        RetryLayer::http()
            .dependency("carrier-api")
            .budget(Arc::new(budget))
            .rng(RngSource::seeded(1))
            .layer(status_service(503)),
    )
}

/// Drives `n` calls through `svc` one after another.
pub async fn drive<S: Bench>(svc: &mut S, n: u64) {
    for _ in 0..n {
        let res = match svc.ready().await {
            Ok(s) => {
                let req = if REALISTIC.load(std::sync::atomic::Ordering::Relaxed) {
                    realistic()
                } else {
                    get()
                };
                s.call(req).await
            }
            Err(e) => Err(e),
        };
        std::hint::black_box(res.is_ok());
    }
}

/// A loopback HTTP server answering every request with a small JSON body, and a hyper-util
/// client for it: what the loopback benchmarks send their GETs through.
pub struct Loopback {
    /// The server (stopped when dropped).
    pub server: backstop_testkit::TestServer,
    /// The URL to GET.
    pub url: String,
    /// hyper-util's pooled HTTP/1 client.
    pub client: hyper_util::client::legacy::Client<
        hyper_util::client::legacy::connect::HttpConnector,
        Full<Bytes>,
    >,
}

impl std::fmt::Debug for Loopback {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Loopback").field("url", &self.url).finish()
    }
}

/// Starts a [`Loopback`] server and client on the current runtime.
pub async fn loopback() -> Loopback {
    use backstop_testkit::{Action, TestServer};
    let server = TestServer::start(|_| Action::respond(200, &[], r#"{"ground":8.40}"#)).await;
    let url = server.url("/rates");
    let client = hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
        .build_http::<Full<Bytes>>();
    Loopback {
        server,
        url,
        client,
    }
}
