//! tower's idioms as a conformance suite: each way tower users drive a service, run against the
//! composed stack (over a leaf and with the call context), the retry layer alone, and each layer
//! crate's service. The inner service is `tower-test`'s mock, which panics when `call` comes
//! without a `poll_ready` that answered `Ready` on the very handle called: so every case also
//! checks that `poll_ready` is called before every call and every retry, and that the call uses
//! the handle whose readiness was reserved (tower's clone-and-swap). Each case names the idiom
//! and the promise it checks. The paused clock keeps time; nothing depends on the machine's.

use backstop::{
    Backstop, BoxError,
    backoff::{Backoff, RngSource},
    breaker::{Breaker, BreakerConfig, BreakerLayer},
    budget::{AdaptiveThrottle, Budget, ThrottleConfig, ThrottleLayer},
    chaos::{ChaosLayer, FaultPlan},
    classify::HttpClassifier,
    idempotency::{IdempotencyKey, IdempotencyLayer},
    mcp::{RpcError, ToolCall, ToolError, ToolHints, ToolReplayLayer, ToolResult},
    otel::AttemptMetricsLayer,
    replay::{MemoryStore, ReplayLayer, ReplayRequestBody},
    retry::{HedgeLayer, Hedging, RetryLayer, StandardPolicy},
    timeout::{
        AttemptTimeoutLayer, BodyTimeoutLayer, CallerDeadlineLayer, DeadlineLayer, LatencyConfig,
        LatencyTimeouts, LearnedTimeoutLayer,
    },
};
use bytes::Bytes;
use http::{Request, Response, StatusCode};
use http_body_util::Full;
use std::{
    sync::{
        Arc,
        atomic::{AtomicUsize, Ordering},
    },
    time::Duration,
};
use tokio::time::Instant;
use tower::{
    Layer, Service, ServiceExt,
    buffer::Buffer,
    limit::{ConcurrencyLimit, RateLimit},
    load::{CompleteOnResponse, PendingRequests},
    load_shed::LoadShed,
    util::BoxCloneService,
};
use tower_test::mock::{self, Handle, Mock};

pub(crate) type Req = Request<Full<Bytes>>;
pub(crate) type Res = Response<Full<Bytes>>;
/// What a subject wraps: the mock, or the mock under a limit, boxed so each subject is one type.
pub(crate) type Inner = BoxCloneService<Req, Res, BoxError>;
/// A subject as the idioms drive it: its answer is the status.
pub(crate) type Subject = BoxCloneService<Req, StatusCode, BoxError>;

/// Builds a subject over the inner service it is given.
pub(crate) type Wrap = fn(Inner) -> Subject;

/// The services under test, by name.
fn subjects() -> Vec<(&'static str, Wrap)> {
    vec![
        ("the composed stack", |inner| {
            let layer = stack_builder("conformance-stack").build().unwrap();
            status_of(layer.layer(inner))
        }),
        (
            "the composed stack, reads hedged on learned latency",
            |inner| {
                // Learned from the first answer on, never under the other subjects' 1 s: a call
                // queued inside (a rate limit behind a buffer) is an attempt in flight.
                let learned = LatencyConfig::default()
                    .min_samples(1)
                    .floor(Duration::from_secs(1));
                let timeouts = LatencyTimeouts::new(learned).unwrap();
                let layer = stack_builder("conformance-hedged")
                    .attempt_timeout_from_latency(timeouts)
                    .build()
                    .unwrap();
                status_of(layer.layer(layer.hedge(inner, Hedging::default()).unwrap()))
            },
        ),
        ("the composed stack for MCP tool calls", mcp_stack),
        ("the call's work alone", |inner| {
            let layer = stack_builder("conformance-call").build().unwrap();
            status_of(layer.call_layer().layer(inner))
        }),
        ("the call's work over the retry layer", |inner| {
            let call = stack_builder("conformance-call-retry")
                .build()
                .unwrap()
                .call_layer();
            let retry = RetryLayer::http()
                .dependency("conformance-call-retry")
                .rng(RngSource::seeded(7))
                .backoff(Backoff::constant(Duration::from_millis(20)));
            status_of(call.layer(retry.layer(inner)))
        }),
        ("the retry layer", |inner| {
            let layer = RetryLayer::http()
                .dependency("conformance-retry")
                .rng(RngSource::seeded(7))
                .backoff(Backoff::constant(Duration::from_millis(20)));
            status_of(layer.layer(inner))
        }),
        ("the retry layer with a policy of one's own", |inner| {
            let policy = StandardPolicy::new()
                .rng(RngSource::seeded(7))
                .backoff(Backoff::constant(Duration::from_millis(20)));
            let layer = RetryLayer::http()
                .dependency("conformance-policy")
                .policy(policy);
            status_of(layer.layer(inner))
        }),
        (
            "the hedge layer, reads hedged on a latency record",
            |inner| {
                // The record knows one answer, at once: each read unanswered 5 ms on is hedged.
                let latency =
                    LatencyTimeouts::new(LatencyConfig::default().min_samples(1)).unwrap();
                latency.record(&"conformance-hedge".into(), Duration::ZERO);
                let layer = HedgeLayer::http(latency).dependency("conformance-hedge");
                status_of(layer.layer(inner))
            },
        ),
        ("the quota headers' reader", |inner| {
            status_of(backstop::quota::ReadQuotasLayer.layer(inner))
        }),
        ("the quota layer", |inner| {
            let quotas = backstop::quota::Quotas::seeded(Duration::from_millis(10), 7);
            status_of(backstop::quota::QuotaLayer::new(quotas).layer(inner))
        }),
        ("the caller's deadline, on a server", |inner| {
            status_of(CallerDeadlineLayer::new(Duration::from_secs(60)).layer(inner))
        }),
        ("the attempt timeout", |inner| {
            status_of(AttemptTimeoutLayer::new(Duration::from_secs(1)).layer(inner))
        }),
        ("the learned attempt timeout", |inner| {
            let learned = LatencyConfig::default()
                .min_samples(1)
                .floor(Duration::from_secs(1));
            let latency = LatencyTimeouts::new(learned)
                .unwrap()
                .bind(&"conformance-learned".into());
            let layer = LearnedTimeoutLayer::new(
                latency,
                HttpClassifier::default(),
                Duration::from_secs(1),
            );
            status_of(layer.layer(inner))
        }),
        ("the deadline", |inner| {
            status_of(DeadlineLayer::new(Duration::from_secs(2)).layer(inner))
        }),
        ("the caller's deadline alone", |inner| {
            status_of(DeadlineLayer::inherited().layer(inner))
        }),
        ("the body timeout", |inner| {
            status_of(BodyTimeoutLayer::new(Some(Duration::from_secs(1))).layer(inner))
        }),
        ("the breaker", |inner| {
            let breaker = Breaker::new(BreakerConfig::default()).unwrap();
            status_of(BreakerLayer::new(breaker, HttpClassifier::default()).layer(inner))
        }),
        ("the idempotency key", |inner| {
            status_of(IdempotencyLayer::http().layer(inner))
        }),
        ("the adaptive throttle", |inner| {
            let throttle = AdaptiveThrottle::new(ThrottleConfig::default(), 7).unwrap();
            let layer = ThrottleLayer::new(throttle, HttpClassifier::default())
                .dependency("conformance-throttle");
            status_of(layer.layer(inner))
        }),
        ("the attempt metrics", |inner| {
            status_of(AttemptMetricsLayer::new(None).layer(inner))
        }),
        ("the replay layer, keyed writes", |inner| {
            // Each request becomes a POST with a key of its own: claimed, run once (in a task of
            // its own) on a handle readied when its turn comes, its result stored.
            static KEYS: AtomicUsize = AtomicUsize::new(0);
            let handler =
                inner.map_request(|req: Request<ReplayRequestBody>| req.map(|_| Full::default()));
            let replay = ReplayLayer::new(MemoryStore::new(10_000))
                .single_tenant()
                .layer(handler);
            status_of(replay.map_request(|req: Req| {
                let (mut parts, body) = req.into_parts();
                parts.method = http::Method::POST;
                let key = format!("conformance-{}", KEYS.fetch_add(1, Ordering::SeqCst));
                parts
                    .headers
                    .insert("idempotency-key", key.parse().unwrap());
                Request::from_parts(parts, body)
            }))
        }),
        ("the MCP tool replay layer, keyed tool calls", |inner| {
            // Each request becomes a tool call with a key of its own, claimed and run once (in
            // a task of its own) on a handle readied when its turn comes, its result stored.
            static KEYS: AtomicUsize = AtomicUsize::new(0);
            let replay = ToolReplayLayer::new(MemoryStore::new(10_000))
                .single_tenant()
                .layer(ToolTransport(inner));
            let svc = replay
                .map_request(|req: Req| {
                    let key = format!("conformance-tool-{}", KEYS.fetch_add(1, Ordering::SeqCst));
                    ToolCall::new(
                        req.uri().path().trim_start_matches('/'),
                        serde_json::json!({}),
                    )
                    .unwrap()
                    .with_key(IdempotencyKey::new(key).unwrap())
                })
                .map_response(|result: ToolResult| {
                    StatusCode::from_bytes(result.joined_text().as_bytes()).expect("a status")
                });
            BoxCloneService::new(svc.map_err(Into::into))
        }),
        ("the MCP server's key from a header", |inner| {
            status_of(backstop::mcp::tower_mcp::KeyFromHeaderLayer::new().layer(inner))
        }),
        ("the fault layer, with no faults", |inner| {
            status_of(
                ChaosLayer::new(FaultPlan::default(), 1)
                    .unwrap()
                    .layer(inner),
            )
        }),
    ]
}

/// The MCP stack as a subject: each request the idioms send becomes a tool call (its path the
/// tool's name, a `GET` a read-only tool, anything else a tool that changes things), and each
/// attempt's tool call reaches the mock as a request again ([`ToolTransport`]); the answer's
/// status comes back as the result's text.
fn mcp_stack(inner: Inner) -> Subject {
    let tools = the_subjects_settings(Backstop::mcp("conformance-mcp"))
        .build()
        .unwrap();
    let svc = tools
        .layer(ToolTransport(inner))
        .map_request(|req: Req| {
            let read_only = req.method() == http::Method::GET;
            ToolCall::new(
                req.uri().path().trim_start_matches('/'),
                serde_json::json!({}),
            )
            .unwrap()
            .hints(ToolHints {
                read_only: Some(read_only),
                ..ToolHints::default()
            })
        })
        .map_response(|result: ToolResult| {
            StatusCode::from_bytes(result.joined_text().as_bytes()).expect("a status")
        });
    BoxCloneService::new(svc.map_err(Into::into))
}

/// A tool server's transport over the conformance mock: a tool call is sent as a request (a
/// read-only tool's as a `GET`, its key in `Idempotency-Key`); a 503 is MCP's overloaded error,
/// any other answer a result whose text is its status; a reset is a lost reply, a refused
/// connection a call not sent, any other error a JSON-RPC error (fatal). Readiness is the
/// mock's.
#[derive(Clone)]
struct ToolTransport(Inner);

impl Service<ToolCall> for ToolTransport {
    type Response = ToolResult;
    type Error = ToolError;
    type Future = std::pin::Pin<
        Box<dyn std::future::Future<Output = Result<ToolResult, ToolError>> + Send + 'static>,
    >;

    fn poll_ready(
        &mut self,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Result<(), ToolError>> {
        self.0.poll_ready(cx).map_err(ToolError::NotSent)
    }

    fn call(&mut self, call: ToolCall) -> Self::Future {
        let read_only = call.policy() == backstop::mcp::ToolPolicy::ReadOnly;
        let mut req = Request::builder()
            .method(if read_only { "GET" } else { "POST" })
            .uri(format!("http://conformance.local/{}", call.name()));
        if let Some(key) = call.key() {
            req = req.header("idempotency-key", key.as_str());
        }
        let fut = self.0.call(req.body(Full::default()).unwrap());
        Box::pin(async move {
            match fut.await {
                Ok(res) if res.status() == StatusCode::SERVICE_UNAVAILABLE => {
                    let mut result = ToolResult::error_text("503");
                    result.meta.insert(
                        backstop::mcp::META_ERROR.into(),
                        RpcError::new(backstop::mcp::codes::OVERLOADED, "503").to_json(),
                    );
                    Ok(result)
                }
                Ok(res) => Ok(ToolResult::text(res.status().as_str())),
                Err(e) => Err(
                    match e.downcast_ref::<std::io::Error>().map(|io| io.kind()) {
                        Some(std::io::ErrorKind::ConnectionReset) => ToolError::Lost(e),
                        Some(std::io::ErrorKind::ConnectionRefused) => ToolError::NotSent(e),
                        _ => ToolError::Rpc(RpcError::new(
                            backstop::mcp::codes::INVALID_PARAMS,
                            e.to_string(),
                        )),
                    },
                ),
            }
        })
    }
}

/// Runs a case to its end, or fails it: on the paused clock a case waiting for a request that
/// never comes (a call the mock refused, in a task of its own) would otherwise wait forever.
pub(crate) async fn within<F: std::future::Future>(case: F) -> F::Output {
    tokio::time::timeout(Duration::from_secs(600), case)
        .await
        .expect("the case never ended: a request or an answer it waited for never came")
}

/// Runs `case` once for each subject that `keep` selects, each over a mock of its own (the
/// mock to wrap and the handle to answer through), the whole bounded as [`within`] bounds it.
pub(crate) async fn each_subject(
    keep: fn(&str) -> bool,
    case: impl AsyncFn(&'static str, Wrap, Mock<Req, Res>, Handle<Req, Res>),
) {
    within(async {
        for (name, subject) in subjects() {
            if keep(name) {
                let (mock, handle) = mock::pair::<Req, Res>();
                case(name, subject, mock, handle).await;
            }
        }
    })
    .await;
}

/// Subjects that finish a request's handler after its caller has gone (the replay layers run a
/// claimed request or tool call to its end, so that its result is stored): what the handler
/// holds is freed when it ends, not when the caller drops its future.
pub(crate) fn finishes_after_the_caller_leaves(name: &str) -> bool {
    name.starts_with("the replay layer") || name.starts_with("the MCP tool replay layer")
}

/// Subjects that retry a 503 themselves.
pub(crate) fn retries(name: &str) -> bool {
    name.starts_with("the composed stack")
        || name.starts_with("the retry layer")
        || name == "the call's work over the retry layer"
}

pub(crate) fn stack_builder(
    dependency: &'static str,
) -> Backstop<HttpClassifier, backstop::retry::HttpResend, backstop::idempotency::HttpKeys> {
    the_subjects_settings(Backstop::http(dependency))
}

/// What every composed subject is built with: a budget, a breaker, a constant 20 ms backoff on
/// a seeded RNG, a 1 s attempt timeout and a 2 s deadline.
fn the_subjects_settings<C, R, K>(builder: Backstop<C, R, K>) -> Backstop<C, R, K> {
    builder
        .budget(Budget::default())
        .breaker(Breaker::new(BreakerConfig::default()).unwrap())
        .backoff(Backoff::constant(Duration::from_millis(20)))
        .rng(RngSource::seeded(7))
        .attempt_timeout(Duration::from_secs(1))
        .deadline(Duration::from_secs(2))
}

pub(crate) fn status_of<S, B>(svc: S) -> Subject
where
    S: Service<Req, Response = Response<B>> + Clone + Send + 'static,
    S::Error: Into<BoxError>,
    S::Future: Send + 'static,
{
    BoxCloneService::new(svc.map_response(|r| r.status()).map_err(Into::into))
}

pub(crate) fn boxed<S>(svc: S) -> Inner
where
    S: Service<Req, Response = Res> + Clone + Send + 'static,
    S::Error: Into<BoxError>,
    S::Future: Send + 'static,
{
    BoxCloneService::new(svc.map_err(Into::into))
}

fn get() -> Req {
    Request::get("http://conformance.local/item")
        .body(Full::default())
        .unwrap()
}

pub(crate) fn answer(status: u16) -> Res {
    Response::builder()
        .status(status)
        .body(Full::default())
        .unwrap()
}

/// A mock and a task answering every request it receives with `status`, counting them.
fn answered(status: u16) -> (Mock<Req, Res>, Arc<AtomicUsize>) {
    let (mock, handle) = mock::pair::<Req, Res>();
    let seen = Arc::new(AtomicUsize::new(0));
    tokio::spawn(respond(handle, Arc::clone(&seen), move |_| status));
    (mock, seen)
}

/// Answers each request with what `status` says for its number (0 for the first).
async fn respond(
    mut handle: Handle<Req, Res>,
    seen: Arc<AtomicUsize>,
    status: impl Fn(usize) -> u16 + Send + 'static,
) {
    while let Some((_req, reply)) = handle.next_request().await {
        let n = seen.fetch_add(1, Ordering::SeqCst);
        reply.send_response(answer(status(n)));
    }
}

/// `oneshot` on a clone: readiness, then the call, on the clone; the answer comes back.
#[tokio::test(start_paused = true)]
async fn oneshot_on_a_clone_is_answered() {
    within(async {
        for (name, subject) in subjects() {
            let (mock, seen) = answered(200);
            let svc = subject(boxed(mock));
            let status = svc.clone().oneshot(get()).await.unwrap();
            assert_eq!(status, 200, "{name}");
            assert_eq!(seen.load(Ordering::SeqCst), 1, "{name}: one request");
        }
    })
    .await;
}

/// One long-lived handle, `ready().await` then `call`, many times: each call goes out on the
/// handle polled ready (the mock panics otherwise) and is answered.
#[tokio::test(start_paused = true)]
async fn a_kept_handle_serves_call_after_call() {
    within(async {
        for (name, subject) in subjects() {
            let (mock, seen) = answered(200);
            let mut svc = subject(boxed(mock));
            for i in 0..5 {
                let status = svc.ready().await.unwrap().call(get()).await.unwrap();
                assert_eq!(status, 200, "{name}: call {i}");
            }
            assert_eq!(seen.load(Ordering::SeqCst), 5, "{name}");
        }
    })
    .await;
}

/// A retry polls readiness before it goes out: the mock panics on a call that was not polled
/// ready, so a retried 503 that ends 200 proves it. Subjects that do not retry hand the 503 back.
#[tokio::test(start_paused = true)]
async fn every_retry_is_polled_ready_before_it_is_sent() {
    within(async {
        for (name, subject) in subjects() {
            let (mock, handle) = mock::pair::<Req, Res>();
            let seen = Arc::new(AtomicUsize::new(0));
            tokio::spawn(respond(handle, Arc::clone(&seen), |n| {
                if n == 0 { 503 } else { 200 }
            }));
            let status = subject(boxed(mock)).oneshot(get()).await.unwrap();
            if retries(name) {
                assert_eq!(status, 200, "{name}: retried");
                assert_eq!(seen.load(Ordering::SeqCst), 2, "{name}");
            } else {
                assert_eq!(status, 503, "{name}: handed back");
                assert_eq!(seen.load(Ordering::SeqCst), 1, "{name}");
            }
        }
    })
    .await;
}

/// The readiness a handle reserved is used by the call that follows it: with one call allowed,
/// the kept handle's `ready()` reserves it, its `call` spends it, and the next `poll_ready` waits
/// until more are allowed.
#[tokio::test(start_paused = true)]
async fn a_reservation_is_spent_by_the_call_that_follows_it() {
    within(async {
        for (name, subject) in subjects() {
            let (mock, mut handle) = mock::pair::<Req, Res>();
            handle.allow(1);
            let mut svc = subject(boxed(mock));
            let fut = tokio::spawn(svc.ready().await.unwrap().call(get()));
            let (_req, reply) = handle
                .next_request()
                .await
                .expect("the reserved call went out");
            reply.send_response(answer(200));
            assert_eq!(fut.await.unwrap().unwrap(), 200, "{name}");
            let mut next = tokio_test::task::spawn(svc.ready());
            assert!(next.poll().is_pending(), "{name}: nothing left to reserve");
            handle.allow(1);
            assert!(
                next.is_woken(),
                "{name}: woken when the mock allows another"
            );
            assert!(next.poll().is_ready(), "{name}");
        }
    })
    .await;
}

/// `Buffer` in front, a limit of one inside, three callers at once: each is served in turn (the
/// buffer's worker drives one handle; its reservation is the one its call uses).
#[tokio::test(start_paused = true)]
async fn a_buffer_in_front_of_a_limit_serves_every_caller() {
    within(async {
        for (name, subject) in subjects() {
            let (mock, handle) = mock::pair::<Req, Res>();
            let seen = Arc::new(AtomicUsize::new(0));
            tokio::spawn(respond_slowly(handle, Arc::clone(&seen)));
            let svc = Buffer::new(subject(boxed(ConcurrencyLimit::new(mock, 1))), 8);
            let started = Instant::now();
            let calls: Vec<_> = (0..3)
                .map(|_| tokio::spawn(svc.clone().oneshot(get())))
                .collect();
            for call in calls {
                assert_eq!(call.await.unwrap().unwrap(), 200, "{name}");
            }
            assert_eq!(seen.load(Ordering::SeqCst), 3, "{name}");
            assert_eq!(
                started.elapsed(),
                Duration::from_millis(300),
                "{name}: one after another"
            );
        }
    })
    .await;
}

/// Answers each request after 100 ms (each in a task of its own, so a limit decides the order).
async fn respond_slowly(mut handle: Handle<Req, Res>, seen: Arc<AtomicUsize>) {
    while let Some((_req, reply)) = handle.next_request().await {
        seen.fetch_add(1, Ordering::SeqCst);
        tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(100)).await;
            reply.send_response(answer(200));
        });
    }
}

/// `ConcurrencyLimit` outside: the subject's readiness is asked only with a permit held, and two
/// callers through a limit of one are served in turn.
#[tokio::test(start_paused = true)]
async fn a_concurrency_limit_outside_serves_callers_in_turn() {
    within(async {
        for (name, subject) in subjects() {
            let (mock, handle) = mock::pair::<Req, Res>();
            let seen = Arc::new(AtomicUsize::new(0));
            tokio::spawn(respond_slowly(handle, Arc::clone(&seen)));
            let svc = ConcurrencyLimit::new(subject(boxed(mock)), 1);
            let started = Instant::now();
            let (a, b) = tokio::join!(svc.clone().oneshot(get()), svc.clone().oneshot(get()));
            assert_eq!(
                (a.unwrap().as_u16(), b.unwrap().as_u16()),
                (200, 200),
                "{name}"
            );
            assert_eq!(started.elapsed(), Duration::from_millis(200), "{name}");
        }
    })
    .await;
}

/// `RateLimit` inside (behind a `Buffer`, which makes it shareable) and outside: two calls per
/// 400 ms, so four calls take 400 ms (well within the attempt timeout: a call waiting in the
/// buffer is an attempt in flight).
#[tokio::test(start_paused = true)]
async fn a_rate_limit_inside_or_outside_paces_the_calls() {
    within(async {
        for (name, subject) in subjects() {
            let (mock, _seen) = answered(200);
            let limited = Buffer::new(
                RateLimit::new(
                    mock,
                    tower::limit::rate::Rate::new(2, Duration::from_millis(400)),
                ),
                8,
            );
            let mut inside = subject(boxed(limited));
            let started = Instant::now();
            for _ in 0..4 {
                assert_eq!(
                    inside.ready().await.unwrap().call(get()).await.unwrap(),
                    200,
                    "{name}"
                );
            }
            if name.contains("hedged") {
                // A call queued behind the limit is unanswered past the hedge's delay: its copy
                // queues too, and is paced like the rest (never faster than the rate).
                assert_eq!(
                    started.elapsed(),
                    Duration::from_millis(800),
                    "{name}: paced inside, copies included"
                );
            } else {
                assert_eq!(
                    started.elapsed(),
                    Duration::from_millis(400),
                    "{name}: paced inside"
                );
            }

            let (mock, _seen) = answered(200);
            let mut outside = RateLimit::new(
                subject(boxed(mock)),
                tower::limit::rate::Rate::new(2, Duration::from_millis(400)),
            );
            let started = Instant::now();
            for _ in 0..4 {
                assert_eq!(
                    outside.ready().await.unwrap().call(get()).await.unwrap(),
                    200,
                    "{name}"
                );
            }
            assert_eq!(
                started.elapsed(),
                Duration::from_millis(400),
                "{name}: paced outside"
            );
        }
    })
    .await;
}

/// `load_shed` outside, the service inside not ready: the call is shed at once, and nothing
/// reaches the service.
#[tokio::test(start_paused = true)]
async fn load_shed_outside_sheds_when_the_service_inside_is_not_ready() {
    within(async {
        for (name, subject) in subjects() {
            let (mock, mut handle) = mock::pair::<Req, Res>();
            handle.allow(0);
            let started = Instant::now();
            let err = LoadShed::new(subject(boxed(mock)))
                .oneshot(get())
                .await
                .unwrap_err();
            assert!(
                err.is::<tower::load_shed::error::Overloaded>(),
                "{name}: {err}"
            );
            assert_eq!(started.elapsed(), Duration::ZERO, "{name}: at once");
            assert!(
                !matches!(
                    tokio_test::task::spawn(handle.next_request()).poll(),
                    std::task::Poll::Ready(Some(_))
                ),
                "{name}: nothing sent"
            );
        }
    })
    .await;
}

/// A balancer (`p2c`) over two instances, one of whose services is never ready: every call goes
/// to the ready one, since the balancer sees each instance's readiness.
#[tokio::test(start_paused = true)]
async fn a_balancer_sends_every_call_to_the_ready_instance() {
    within(async {
        for (name, subject) in subjects() {
            let (stuck, mut stuck_handle) = mock::pair::<Req, Res>();
            stuck_handle.allow(0);
            let (ready, seen) = answered(200);
            let load = |svc| PendingRequests::new(svc, CompleteOnResponse::default());
            let list = tower::discover::ServiceList::new(vec![
                load(subject(boxed(stuck))),
                load(subject(boxed(ready))),
            ]);
            let mut balance = tower::balance::p2c::Balance::new(list);
            for _ in 0..6 {
                let status = balance.ready().await.unwrap().call(get()).await.unwrap();
                assert_eq!(status, 200, "{name}");
            }
            assert_eq!(
                seen.load(Ordering::SeqCst),
                6,
                "{name}: all to the ready one"
            );
        }
    })
    .await;
}

/// `ServiceExt::call_all`: a stream of requests through one handle, each answered in order.
#[tokio::test(start_paused = true)]
async fn call_all_answers_a_stream_of_requests() {
    within(async {
        use tokio_stream::StreamExt as _;
        for (name, subject) in subjects() {
            let (mock, seen) = answered(200);
            let requests = tokio_stream::iter((0..5).map(|_| get()));
            let answers: Vec<_> = subject(boxed(mock)).call_all(requests).collect().await;
            assert_eq!(answers.len(), 5, "{name}");
            assert!(
                answers.iter().all(|a| matches!(a, Ok(s) if *s == 200)),
                "{name}"
            );
            assert_eq!(seen.load(Ordering::SeqCst), 5, "{name}");
        }
    })
    .await;
}

/// A `MakeService` (`tower::make::Shared`, as hyper and axum take one): each made service is a
/// clone that serves on its own.
#[tokio::test(start_paused = true)]
async fn a_make_service_hands_out_clones_that_serve() {
    within(async {
        use tower::make::MakeService as _;
        for (name, subject) in subjects() {
            let (mock, seen) = answered(200);
            let mut make = tower::make::Shared::new(subject(boxed(mock)));
            for _ in 0..2 {
                let svc = make.make_service(()).await.unwrap();
                assert_eq!(svc.oneshot(get()).await.unwrap(), 200, "{name}");
            }
            assert_eq!(seen.load(Ordering::SeqCst), 2, "{name}");
        }
    })
    .await;
}

/// Dropping a future releases what it holds: a call dropped while it waits for readiness, and
/// one dropped while its request is in flight, each leave the limit inside free for the next.
#[tokio::test(start_paused = true)]
async fn dropping_a_future_releases_what_it_holds() {
    within(async {
        for (name, subject) in subjects() {
            if finishes_after_the_caller_leaves(name) {
                continue;
            }
            let (mock, mut handle) = mock::pair::<Req, Res>();
            let svc = subject(boxed(ConcurrencyLimit::new(mock, 1)));
            // In flight, then dropped.
            let mut first = tokio_test::task::spawn(svc.clone().oneshot(get()));
            assert!(first.poll().is_pending(), "{name}");
            let (_req, _reply) = handle.next_request().await.expect("the first went out");
            drop(first);
            // Waiting for readiness behind a second caller, then dropped.
            handle.allow(0);
            let mut waiting = tokio_test::task::spawn(svc.clone().oneshot(get()));
            assert!(waiting.poll().is_pending(), "{name}");
            drop(waiting);
            // The permit and the reservation are free: the next call goes out and is answered.
            handle.allow(1);
            let next = tokio::spawn(svc.clone().oneshot(get()));
            let (_req, reply) = handle.next_request().await.expect("the next went out");
            reply.send_response(answer(200));
            assert_eq!(next.await.unwrap().unwrap(), 200, "{name}");
        }
    })
    .await;
}

/// A hedged read's copy goes out on a clone polled ready for it (the mock panics on a call
/// without a `poll_ready` that answered `Ready` on the handle called), while the first copy
/// still waits; the first answer wins.
#[tokio::test(start_paused = true)]
async fn a_hedged_copy_is_polled_ready_on_a_handle_of_its_own() {
    within(async {
        let (mock, mut handle) = mock::pair::<Req, Res>();
        let learned = LatencyConfig::default()
            .min_samples(1)
            .floor(Duration::from_secs(1));
        let layer = stack_builder("conformance-hedge-copy")
            .attempt_timeout_from_latency(LatencyTimeouts::new(learned).unwrap())
            .build()
            .unwrap();
        let svc = status_of(layer.layer(layer.hedge(boxed(mock), Hedging::default()).unwrap()));
        // The latency record learns 10 ms answers.
        for _ in 0..5 {
            let call = tokio::spawn(svc.clone().oneshot(get()));
            let (_req, reply) = handle.next_request().await.unwrap();
            tokio::time::sleep(Duration::from_millis(10)).await;
            reply.send_response(answer(200));
            assert_eq!(call.await.unwrap().unwrap(), 200);
        }
        let call = tokio::spawn(svc.clone().oneshot(get()));
        let sent = Instant::now();
        let (_first, _unanswered) = handle.next_request().await.unwrap();
        let (_copy, reply) = handle.next_request().await.unwrap();
        let after = sent.elapsed();
        assert!(
            after >= Duration::from_millis(10) && after < Duration::from_millis(100),
            "the copy went out {after:?} after the first, past the learned latency"
        );
        reply.send_response(answer(200));
        assert_eq!(call.await.unwrap().unwrap(), 200);
    })
    .await;
}

/// The replay layer runs a claimed request's handler to its end after its caller has gone (its
/// result is stored for the caller's repeat): the limit inside stays held while the handler
/// works, and is free for the next caller once the handler answers.
#[tokio::test(start_paused = true)]
async fn a_claimed_request_outlives_its_caller_and_then_frees_what_it_held() {
    within(async {
        let claiming: Vec<_> = subjects()
            .into_iter()
            .filter(|(name, _)| finishes_after_the_caller_leaves(name))
            .collect();
        assert_eq!(
            claiming.len(),
            2,
            "the replay layer and the MCP tool replay layer"
        );
        for (name, subject) in claiming {
            let (mock, mut handle) = mock::pair::<Req, Res>();
            let svc = subject(boxed(ConcurrencyLimit::new(mock, 1)));
            let mut first = tokio_test::task::spawn(svc.clone().oneshot(get()));
            assert!(first.poll().is_pending(), "{name}");
            let (_req, reply) = handle.next_request().await.expect("the first went out");
            drop(first);
            // The handler still holds the permit: the next caller waits for it.
            let next = tokio::spawn(svc.clone().oneshot(get()));
            tokio::time::sleep(Duration::from_millis(50)).await;
            assert!(
                !next.is_finished(),
                "{name}: the next waits while the first's handler works"
            );
            reply.send_response(answer(201));
            let (_req, reply) = handle.next_request().await.expect("the next went out");
            reply.send_response(answer(200));
            assert_eq!(next.await.unwrap().unwrap(), 200, "{name}");
        }
    })
    .await;
}
