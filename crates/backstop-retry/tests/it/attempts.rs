//! What the retry layer does around each attempt, and with the layers beside it: a deadline
//! outside and an attempt timeout inside (the composed stack's order), and the attempt scope
//! that tells layers further in (and nested retry layers) about the call. Paused clock, seeded
//! RNGs.

use crate::SourceCause;
use backstop_backoff::{Backoff, RngSource};
use backstop_classify::HttpClassifier;
use backstop_core::Outcome;
use backstop_core::ReportsOutcome;
use backstop_core::{
    AttemptTimedOut, BoxError, CallContext, Deadline, DeadlineExceeded, Dependency,
};
use backstop_core::{Claim, ScopeOwner};
use backstop_retry::{Error, HttpResend, RetryLayer, StopReason};
use backstop_timeout::{AttemptTimeoutLayer, DeadlineLayer};
use bytes::Bytes;
use http::{Request, Response};
use http_body_util::Full;
use std::{
    sync::{
        Arc, Mutex,
        atomic::{AtomicU32, Ordering},
    },
    task::Context,
    time::Duration,
};
use tokio::time::Instant;
use tower::{Layer, Service, ServiceBuilder, ServiceExt, service_fn};

type Req = Request<Full<Bytes>>;
type Res = Response<&'static str>;

fn get() -> Req {
    Request::get("http://carrier.local/rates")
        .body(Full::default())
        .unwrap()
}

fn layer() -> RetryLayer<HttpClassifier, HttpResend, Dependency> {
    RetryLayer::http()
        .dependency("carrier-api")
        .rng(RngSource::seeded(7))
        .backoff(Backoff::constant(Duration::from_millis(100)))
}

/// [`layer`] between a deadline outside and an attempt timeout inside, as the composed stack
/// has them.
fn stack<S>(
    deadline: Option<Duration>,
    attempt_timeout: Option<Duration>,
    svc: S,
) -> impl Service<Req, Response = Res, Error = BoxError, Future: Send> + Clone + Send + 'static
where
    S: Service<Req, Response = Res, Error = BoxError, Future: Send> + Clone + Send + 'static,
{
    ServiceBuilder::new()
        .option_layer(deadline.map(DeadlineLayer::new))
        .map_err(Into::<BoxError>::into)
        .layer(layer())
        .option_layer(attempt_timeout.map(AttemptTimeoutLayer::new))
        .service(svc)
}

/// A dependency that takes `delay` to answer 200, and records when each attempt arrived.
fn slow(
    delay: Duration,
    seen: Arc<Mutex<Vec<Instant>>>,
) -> impl Service<Req, Response = Res, Error = BoxError, Future: Send> + Clone {
    service_fn(move |_req: Req| {
        seen.lock().unwrap().push(Instant::now());
        async move {
            tokio::time::sleep(delay).await;
            Ok::<_, BoxError>(Response::new("ok"))
        }
    })
}

fn retry_error(e: impl Into<BoxError>) -> Box<Error> {
    e.into()
        .downcast::<Error>()
        .expect("a backstop_retry::Error")
}

#[tokio::test(start_paused = true)]
async fn each_attempt_is_cut_at_the_attempt_timeout_and_retried() {
    let seen = Arc::default();
    let start = Instant::now();
    let err = stack(
        None,
        Some(Duration::from_secs(1)),
        slow(Duration::from_secs(5), Arc::clone(&seen)),
    )
    .oneshot(get())
    .await
    .unwrap_err();
    let err = retry_error(err);
    assert!(err.source_cause().is::<AttemptTimedOut>(), "{err}");
    assert_eq!(err.outcome(), Outcome::Unknown);
    assert_eq!(
        err.history().expect("a history").stopped,
        StopReason::AttemptsExhausted { max_attempts: 3 }
    );
    // Three attempts of 1 s, 100 ms apart.
    let at: Vec<_> = seen.lock().unwrap().iter().map(|t| *t - start).collect();
    assert_eq!(
        at,
        [
            Duration::ZERO,
            Duration::from_millis(1_100),
            Duration::from_millis(2_200)
        ]
    );
    assert_eq!(start.elapsed(), Duration::from_millis(3_200));
}

#[tokio::test(start_paused = true)]
async fn an_attempt_that_answers_in_time_is_not_cut() {
    let seen = Arc::default();
    let res = stack(
        None,
        Some(Duration::from_secs(1)),
        slow(Duration::from_millis(999), Arc::clone(&seen)),
    )
    .oneshot(get())
    .await
    .unwrap();
    assert_eq!(*res.body(), "ok");
    assert_eq!(seen.lock().unwrap().len(), 1);
}

#[tokio::test(start_paused = true)]
async fn the_deadline_cuts_an_attempt_in_flight_with_an_unknown_outcome() {
    let seen = Arc::default();
    let start = Instant::now();
    let slow = slow(Duration::from_secs(10), Arc::clone(&seen));
    let err = stack(
        Some(Duration::from_secs(2)),
        Some(Duration::from_secs(60)),
        slow,
    )
    .oneshot(get())
    .await
    .unwrap_err();
    assert_eq!(start.elapsed(), Duration::from_secs(2));
    let err = retry_error(err);
    let cut = err
        .source_cause()
        .downcast_ref::<DeadlineExceeded>()
        .expect("DeadlineExceeded");
    assert_eq!(cut.outcome(), Outcome::Unknown);
    assert_eq!(cut.dependency().unwrap().as_str(), "carrier-api");
    assert_eq!(seen.lock().unwrap().len(), 1, "no time left for a retry");
}

#[tokio::test(start_paused = true)]
async fn the_last_attempt_is_cut_to_the_deadline_not_to_the_attempt_timeout() {
    let seen = Arc::default();
    let start = Instant::now();
    let slow = slow(Duration::from_secs(10), Arc::clone(&seen));
    let err = stack(
        Some(Duration::from_millis(1_500)),
        Some(Duration::from_secs(1)),
        slow,
    )
    .oneshot(get())
    .await
    .unwrap_err();
    // Attempt 1: 0..1 s (timed out); wait 100 ms; attempt 2: 1.1 s..1.5 s, cut by the deadline.
    assert_eq!(start.elapsed(), Duration::from_millis(1_500));
    assert_eq!(seen.lock().unwrap().len(), 2);
    assert!(retry_error(err).source_cause().is::<DeadlineExceeded>());
}

#[tokio::test(start_paused = true)]
async fn a_caller_deadline_already_passed_sends_nothing() {
    let seen = Arc::default();
    let mut req = get();
    req.extensions_mut().insert(Deadline::at(Instant::now()));
    let err = stack(
        None,
        Some(Duration::from_secs(1)),
        slow(Duration::ZERO, Arc::clone(&seen)),
    )
    .oneshot(req)
    .await
    .unwrap_err();
    let err = retry_error(err);
    let d = err
        .source_cause()
        .downcast_ref::<DeadlineExceeded>()
        .expect("DeadlineExceeded");
    assert_eq!(d.outcome(), Outcome::NotSent);
    assert!(seen.lock().unwrap().is_empty());
}

/// What a layer further in saw: the retry mark, the deadline, the dependency.
type Seen = (bool, Option<Deadline>, Option<Dependency>);

#[tokio::test(start_paused = true)]
async fn layers_further_in_see_the_attempt_scope() {
    let seen: Arc<Mutex<Vec<Seen>>> = Arc::default();
    let s = Arc::clone(&seen);
    let start = Instant::now();
    let inner = service_fn(move |req: Req| {
        s.lock().unwrap().push((
            CallContext::of(&req).is_some_and(CallContext::in_retry_scope),
            Deadline::of(&req),
            Dependency::of(&req),
        ));
        async { Ok::<_, BoxError>(Response::new("ok")) }
    });
    stack(Some(Duration::from_secs(5)), None, inner)
        .oneshot(get())
        .await
        .unwrap();
    let seen = seen.lock().unwrap();
    assert_eq!(seen.len(), 1);
    let (marked, deadline, dependency) = &seen[0];
    assert!(marked);
    assert_eq!(deadline.unwrap().instant(), start + Duration::from_secs(5));
    assert_eq!(dependency.as_ref().unwrap().as_str(), "carrier-api");
    // Outside the call, nothing is current.
    assert!(!CallContext::of(&get()).is_some_and(CallContext::in_retry_scope));
    assert!(Deadline::of(&get()).is_none());
}

/// A service that hands each request to a spawned task, as a `tower::buffer::Buffer` or a
/// worker pool does: the attempt scope does not cross that boundary.
fn across_a_task<S>(inner: S) -> impl Service<Req, Response = Res, Error = BoxError> + Clone
where
    S: Service<Req, Response = Res, Error: Into<BoxError> + Send, Future: Send>
        + Clone
        + Send
        + 'static,
{
    service_fn(move |req: Req| {
        let inner = inner.clone();
        async move {
            tokio::spawn(inner.oneshot(req))
                .await
                .expect("the worker does not panic")
                .map_err(Into::into)
        }
    })
}

fn always_503(
    attempts: Arc<AtomicU32>,
) -> impl Service<Req, Response = Res, Error = BoxError, Future: Send> + Clone {
    service_fn(move |_req: Req| {
        attempts.fetch_add(1, Ordering::SeqCst);
        async { Ok::<_, BoxError>(Response::builder().status(503).body("busy").unwrap()) }
    })
}

/// The most common tower idiom: the inner stack is called from the future, not from `call`.
fn lazily<S>(
    inner: S,
) -> impl Service<Req, Response = Res, Error = BoxError, Future: Send> + Clone + Send + 'static
where
    S: Service<Req, Response = Res, Error: Into<BoxError>, Future: Send> + Clone + Send + 'static,
{
    service_fn(move |req: Req| {
        let inner = inner.clone();
        async move { inner.oneshot(req).await.map_err(Into::into) }
    })
}

#[tokio::test(start_paused = true)]
async fn nested_layers_make_one_set_of_attempts_across_tasks_and_lazy_futures() {
    // Behind a spawned task (a Buffer's worker), and behind `async move { inner.oneshot(req) }`:
    // the inner layer sees the mark in the request and makes one attempt per outer attempt.
    for wrap in [0, 1] {
        let attempts = Arc::new(AtomicU32::new(0));
        let inner = layer().layer(always_503(Arc::clone(&attempts)));
        let res = if wrap == 0 {
            layer().layer(across_a_task(inner)).oneshot(get()).await
        } else {
            layer().layer(lazily(inner)).oneshot(get()).await
        }
        .unwrap();
        assert_eq!(res.status(), 503);
        assert_eq!(attempts.load(Ordering::SeqCst), 3, "wrapper {wrap}");
    }
    // Three stacks deep, lazily: 3 attempts, not 27.
    let attempts = Arc::new(AtomicU32::new(0));
    let inner = layer().layer(always_503(Arc::clone(&attempts)));
    let middle = layer().layer(lazily(inner));
    let res = layer().layer(lazily(middle)).oneshot(get()).await.unwrap();
    assert_eq!(res.status(), 503);
    assert_eq!(attempts.load(Ordering::SeqCst), 3);
}

#[tokio::test(start_paused = true)]
async fn no_caller_can_make_the_retry_layer_stand_aside() {
    // A caller (or a retrying layer of its own) claims the request under an owner of its own:
    // Backstop's retry layer still sees someone retrying outside, and still retries, because
    // only its own mark, under a type no other crate can name, makes it stand aside.
    struct NotBackstop;
    let attempts = Arc::new(AtomicU32::new(0));
    let mut req = get();
    CallContext::claim(
        &mut req,
        Claim::new(ScopeOwner::of::<NotBackstop>(), "carrier-api").attempt(1),
    );
    assert!(CallContext::of(&req).is_some_and(CallContext::in_retry_scope));
    let res = layer()
        .layer(always_503(Arc::clone(&attempts)))
        .oneshot(req)
        .await
        .unwrap();
    assert_eq!(res.status(), 503);
    assert_eq!(attempts.load(Ordering::SeqCst), 3);
}

/// A retrying layer of the caller's own: it claims each request under its own owner, then
/// calls the stack inside it.
fn claiming<S>(
    inner: S,
) -> impl Service<Req, Response = Res, Error = BoxError, Future: Send> + Clone + Send + 'static
where
    S: Service<Req, Response = Res, Error: Into<BoxError>, Future: Send> + Clone + Send + 'static,
{
    struct TheirRetries;
    service_fn(move |mut req: Req| {
        CallContext::claim(
            &mut req,
            Claim::new(ScopeOwner::of::<TheirRetries>(), "carrier-api"),
        );
        let inner = inner.clone();
        async move { inner.oneshot(req).await.map_err(Into::into) }
    })
}

#[tokio::test(start_paused = true)]
async fn a_claim_further_in_leaves_the_outer_retry_layer_owning_the_call() {
    // Backstop's layer, a retrying layer of the caller's that claims the call, and a second
    // Backstop layer further in: the inner claim does not take the call from the outer layer,
    // so the inner Backstop layer stands aside (3 attempts, not 9).
    let attempts = Arc::new(AtomicU32::new(0));
    let inner = layer().layer(always_503(Arc::clone(&attempts)));
    let res = layer().layer(claiming(inner)).oneshot(get()).await.unwrap();
    assert_eq!(res.status(), 503);
    assert_eq!(attempts.load(Ordering::SeqCst), 3);
}

#[tokio::test(start_paused = true)]
async fn nested_retry_layers_under_a_callers_claim_make_one_set_of_attempts() {
    // The caller's claim comes first: Backstop's outer layer is recorded beside it, so the one
    // nested inside still sees it and stands aside (3 attempts, not 9).
    let attempts = Arc::new(AtomicU32::new(0));
    let inner = layer().layer(always_503(Arc::clone(&attempts)));
    let outer = layer().layer(lazily(inner));
    let res = claiming(outer).oneshot(get()).await.unwrap();
    assert_eq!(res.status(), 503);
    assert_eq!(attempts.load(Ordering::SeqCst), 3);
}

#[tokio::test(start_paused = true)]
async fn a_leaf_reads_the_deadline_in_its_future() {
    let seen: Arc<std::sync::Mutex<Vec<Option<Deadline>>>> = Arc::default();
    let log = Arc::clone(&seen);
    let leaf = service_fn(move |req: Req| {
        let log = Arc::clone(&log);
        async move {
            tokio::task::yield_now().await;
            log.lock().unwrap().push(Deadline::of(&req));
            Ok::<_, BoxError>(Response::new("ok"))
        }
    });
    let start = Instant::now();
    stack(Some(Duration::from_secs(2)), None, lazily(leaf))
        .oneshot(get())
        .await
        .unwrap();
    let seen = seen.lock().unwrap();
    assert_eq!(
        seen[0].map(Deadline::instant),
        Some(start + Duration::from_secs(2))
    );
}

#[tokio::test(start_paused = true)]
async fn work_inside_call_that_is_not_this_request_sees_no_context() {
    // A service whose `call` makes a new request of its own (to another dependency) through
    // another retry layer: that one is not nested, and owns its own three attempts.
    let other = Arc::new(AtomicU32::new(0));
    let side = layer()
        .dependency("audit-log")
        .layer(always_503(Arc::clone(&other)));
    let unmarked = Arc::new(AtomicU32::new(0));
    let seen = Arc::clone(&unmarked);
    let svc = service_fn(move |req: Req| {
        assert!(CallContext::of(&req).is_some_and(CallContext::in_retry_scope));
        let fresh = get();
        if !CallContext::of(&fresh).is_some_and(CallContext::in_retry_scope)
            && Deadline::of(&fresh).is_none()
        {
            seen.fetch_add(1, Ordering::SeqCst);
        }
        let side = side.clone();
        async move {
            let res = side.oneshot(fresh).await?;
            assert_eq!(res.status(), 503);
            Ok::<_, BoxError>(Response::new("ok"))
        }
    });
    let res = stack(Some(Duration::from_secs(30)), None, svc)
        .oneshot(get())
        .await
        .unwrap();
    assert_eq!(res.status(), 200);
    assert_eq!(unmarked.load(Ordering::SeqCst), 1);
    assert_eq!(other.load(Ordering::SeqCst), 3);
}

#[tokio::test(start_paused = true)]
async fn a_nested_layer_still_applies_its_own_attempt_timeout() {
    let seen = Arc::default();
    let inner = stack(
        None,
        Some(Duration::from_secs(1)),
        slow(Duration::from_secs(5), Arc::clone(&seen)),
    );
    let start = Instant::now();
    let err = layer()
        .max_attempts(2)
        .unwrap()
        .layer(inner)
        .oneshot(get())
        .await
        .unwrap_err();
    // The outer layer owns retrying (2 attempts); the inner one times each at 1 s and hands
    // back its raw `AttemptTimedOut`, which the outer one classifies.
    assert_eq!(seen.lock().unwrap().len(), 2);
    assert_eq!(start.elapsed(), Duration::from_millis(2_100));
    let err = retry_error(err);
    assert!(err.source_cause().is::<AttemptTimedOut>(), "{err}");
    assert_eq!(err.history().expect("a history").attempts.len(), 2);
}

/// Answers 503 to its first call, then is never ready again.
#[derive(Clone)]
struct BusyThenStuck(Arc<AtomicU32>);

impl Service<Req> for BusyThenStuck {
    type Response = Res;
    type Error = BoxError;
    type Future = std::future::Ready<Result<Res, BoxError>>;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> std::task::Poll<Result<(), BoxError>> {
        if self.0.load(Ordering::SeqCst) == 0 {
            std::task::Poll::Ready(Ok(()))
        } else {
            std::task::Poll::Pending
        }
    }

    fn call(&mut self, _req: Req) -> Self::Future {
        self.0.fetch_add(1, Ordering::SeqCst);
        std::future::ready(Ok(Response::builder().status(503).body("busy").unwrap()))
    }
}

#[tokio::test(start_paused = true)]
async fn a_retry_still_waiting_for_readiness_at_the_deadline_ends_the_call_not_sent() {
    let calls = Arc::new(AtomicU32::new(0));
    let start = Instant::now();
    let svc = stack(
        Some(Duration::from_secs(2)),
        None,
        BusyThenStuck(Arc::clone(&calls)),
    );
    let err = retry_error(svc.oneshot(get()).await.unwrap_err());
    assert_eq!(start.elapsed(), Duration::from_secs(2));
    assert_eq!(calls.load(Ordering::SeqCst), 1, "the retry was never sent");
    let cut = err
        .source_cause()
        .downcast_ref::<DeadlineExceeded>()
        .expect("DeadlineExceeded");
    assert_eq!(cut.outcome(), Outcome::NotSent);
    let attempts = &err.history().expect("a history").attempts;
    assert_eq!(attempts.len(), 2);
    assert!(attempts[0].sent && !attempts[1].sent);
}
