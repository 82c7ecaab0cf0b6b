//! The retry layer's rules, on tokio's paused clock with seeded RNGs.

use crate::SourceCause;
use backstop_backoff::{Backoff, RngSource};
use backstop_classify::{Classify, Verdict};
use backstop_core::Outcome;
use backstop_core::{AttemptTimedOut, BoxError, Deadline, Dependency, HasExtensions, RetryBudget};
use backstop_retry::{Error, NotCopyable, Resend, RetryHistory, RetryLayer, StopReason};
use bytes::Bytes;
use http::{Request, Response, StatusCode};
use http_body_util::{BodyExt, Full, StreamBody};
use std::{
    convert::Infallible,
    io,
    sync::{
        Arc, Mutex,
        atomic::{AtomicU32, AtomicUsize, Ordering},
    },
    task::{Context, Poll},
    time::Duration,
};
use tokio::time::Instant;
use tower::{Layer, Service, ServiceExt, service_fn};

type Req = Request<Full<Bytes>>;
type Res = Response<&'static str>;

/// What the scripted dependency does on its n-th attempt.
#[derive(Clone, Debug)]
enum Step {
    Status(u16),
    StatusAfter(u16, &'static str),
    Refused,
    TimedOut,
}

/// A scripted dependency: records when each attempt arrived and answers from the script (the
/// last step repeats).
#[derive(Clone)]
struct Script {
    steps: Arc<Vec<Step>>,
    seen: Arc<Mutex<Vec<Arrival>>>,
}

/// When an attempt arrived, and the idempotency key it carried.
type Arrival = (Instant, Option<String>);

impl Script {
    fn new(steps: &[Step]) -> Self {
        Script {
            steps: Arc::new(steps.to_vec()),
            seen: Arc::default(),
        }
    }
    fn attempts(&self) -> usize {
        self.seen.lock().unwrap().len()
    }
    fn times(&self) -> Vec<Instant> {
        self.seen.lock().unwrap().iter().map(|s| s.0).collect()
    }
    fn keys(&self) -> Vec<Option<String>> {
        self.seen
            .lock()
            .unwrap()
            .iter()
            .map(|s| s.1.clone())
            .collect()
    }
    fn service(&self) -> impl Service<Req, Response = Res, Error = BoxError, Future: Send> + Clone {
        let this = self.clone();
        service_fn(move |req: Req| {
            let mut seen = this.seen.lock().unwrap();
            let key = req
                .headers()
                .get("idempotency-key")
                .map(|v| v.to_str().unwrap().to_owned());
            seen.push((Instant::now(), key));
            let step = this.steps[(seen.len() - 1).min(this.steps.len() - 1)].clone();
            async move {
                match step {
                    Step::Status(s) => Ok(Response::builder().status(s).body("body").unwrap()),
                    Step::StatusAfter(s, after) => Ok(Response::builder()
                        .status(s)
                        .header("retry-after", after)
                        .body("body")
                        .unwrap()),
                    Step::Refused => Err(io::Error::from(io::ErrorKind::ConnectionRefused).into()),
                    Step::TimedOut => {
                        Err(AttemptTimedOut::new(None, Duration::from_secs(1)).into())
                    }
                }
            }
        })
    }
}

fn layer() -> RetryLayer<backstop_classify::HttpClassifier, backstop_retry::HttpResend, Dependency>
{
    RetryLayer::http()
        .dependency("carrier-api")
        .rng(RngSource::seeded(42))
}

fn get() -> Req {
    Request::get("http://carrier.local/labels/1")
        .body(Full::default())
        .unwrap()
}

fn post() -> Req {
    Request::post("http://carrier.local/labels")
        .body(Full::new(Bytes::from_static(b"{\"order\":4812}")))
        .unwrap()
}

fn keyed_post() -> Req {
    let mut r = post();
    r.headers_mut()
        .insert("idempotency-key", "k-4812".parse().unwrap());
    r
}

fn retry_error(e: impl Into<BoxError>) -> Box<Error> {
    e.into()
        .downcast::<Error>()
        .expect("a backstop_retry::Error")
}

#[tokio::test(start_paused = true)]
async fn retries_503_three_times_then_returns_the_last_response_with_its_history() {
    let script = Script::new(&[Step::Status(503)]);
    let res = layer()
        .layer(script.service())
        .oneshot(get())
        .await
        .unwrap();
    assert_eq!(res.status(), StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(script.attempts(), 3);
    let h = RetryHistory::of(&res).expect("history on the response");
    assert_eq!(h.attempts.len(), 3);
    assert_eq!(h.stopped, StopReason::AttemptsExhausted { max_attempts: 3 });
    assert_eq!(h.dependency.as_str(), "carrier-api");
    assert!(h.attempts[..2].iter().all(|a| a.wait.is_some()));
    assert_eq!(h.attempts[2].wait, None);
}

#[tokio::test(start_paused = true)]
async fn recovers_after_transient_failures() {
    let script = Script::new(&[Step::Status(502), Step::Refused, Step::Status(200)]);
    let res = layer()
        .layer(script.service())
        .oneshot(get())
        .await
        .unwrap();
    assert_eq!(res.status(), StatusCode::OK);
    assert_eq!(script.attempts(), 3);
    assert_eq!(
        RetryHistory::of(&res).unwrap().stopped,
        StopReason::Succeeded
    );
}

#[tokio::test(start_paused = true)]
async fn a_first_attempt_success_records_nothing() {
    let script = Script::new(&[Step::Status(200)]);
    let res = layer()
        .layer(script.service())
        .oneshot(get())
        .await
        .unwrap();
    assert!(RetryHistory::of(&res).is_none());
    assert_eq!(script.attempts(), 1);
}

#[tokio::test(start_paused = true)]
async fn never_retries_a_400() {
    let script = Script::new(&[Step::Status(400), Step::Status(200)]);
    let res = layer()
        .layer(script.service())
        .oneshot(keyed_post())
        .await
        .unwrap();
    assert_eq!(res.status(), StatusCode::BAD_REQUEST);
    assert_eq!(script.attempts(), 1);
    assert_eq!(
        RetryHistory::of(&res).unwrap().stopped,
        StopReason::NotRetryable
    );
}

#[tokio::test(start_paused = true)]
async fn honours_retry_after_instead_of_the_backoff() {
    let script = Script::new(&[Step::StatusAfter(429, "2"), Step::Status(200)]);
    let res = layer()
        .layer(script.service())
        .oneshot(post())
        .await
        .unwrap();
    assert_eq!(res.status(), StatusCode::OK);
    let t = script.times();
    assert_eq!(t[1] - t[0], Duration::from_secs(2));
}

#[tokio::test(start_paused = true)]
async fn waits_follow_the_seeded_full_jitter_schedule() {
    let run = || async {
        let script = Script::new(&[Step::Status(503)]);
        let svc = layer().max_attempts(5).unwrap().layer(script.service());
        svc.oneshot(get()).await.unwrap();
        let t = script.times();
        t.windows(2).map(|w| w[1] - w[0]).collect::<Vec<_>>()
    };
    let waits = run().await;
    assert_eq!(waits.len(), 4);
    let backoff = Backoff::default();
    for (n, w) in waits.iter().enumerate() {
        assert!(*w <= backoff.bound(n as u32), "wait {n} was {w:?}");
    }
    // The same seed gives the same waits.
    assert_eq!(run().await, waits);
}

#[tokio::test(start_paused = true)]
async fn an_unknown_outcome_is_not_retried_for_a_post_without_a_key() {
    let script = Script::new(&[Step::TimedOut, Step::Status(200)]);
    let err = layer()
        .layer(script.service())
        .oneshot(post())
        .await
        .unwrap_err();
    assert_eq!(
        script.attempts(),
        1,
        "a lost reply to a POST must not be repeated"
    );
    let err = retry_error(err);
    assert_eq!(
        err.history().expect("a history").stopped,
        StopReason::NotReplaySafe
    );
    assert_eq!(err.outcome(), Outcome::Unknown);
    let text = err.to_string();
    assert!(
        text.contains(
            "it was not repeated because it is not idempotent and has no idempotency key"
        ),
        "{text}"
    );
    assert!(
        text.contains("check its status before repeating it"),
        "{text}"
    );
}

#[tokio::test(start_paused = true)]
async fn an_unknown_outcome_is_retried_with_the_same_key() {
    let script = Script::new(&[Step::TimedOut, Step::Status(500), Step::Status(201)]);
    let res = layer()
        .layer(script.service())
        .oneshot(keyed_post())
        .await
        .unwrap();
    assert_eq!(res.status(), StatusCode::CREATED);
    assert_eq!(script.keys(), vec![Some("k-4812".to_owned()); 3]);
}

#[tokio::test(start_paused = true)]
async fn a_500_to_a_post_without_a_key_is_not_retried() {
    let script = Script::new(&[Step::Status(500), Step::Status(200)]);
    let res = layer()
        .layer(script.service())
        .oneshot(post())
        .await
        .unwrap();
    assert_eq!(res.status(), StatusCode::INTERNAL_SERVER_ERROR);
    assert_eq!(script.attempts(), 1);
    assert_eq!(
        RetryHistory::of(&res).unwrap().stopped,
        StopReason::NotReplaySafe
    );
}

#[tokio::test(start_paused = true)]
async fn a_refused_connection_is_retried_even_for_a_post() {
    let script = Script::new(&[Step::Refused, Step::Status(201)]);
    let res = layer()
        .layer(script.service())
        .oneshot(post())
        .await
        .unwrap();
    assert_eq!(res.status(), StatusCode::CREATED);
    assert_eq!(script.attempts(), 2);
}

#[tokio::test(start_paused = true)]
async fn errors_name_dependency_attempts_time_cause_and_outcome() {
    let script = Script::new(&[Step::Refused]);
    let backoff = Backoff::constant(Duration::from_millis(250));
    let err = layer()
        .backoff(backoff)
        .layer(script.service())
        .oneshot(get())
        .await
        .unwrap_err();
    let err = retry_error(err);
    assert_eq!(err.attempts(), 3);
    assert_eq!(err.elapsed(), Duration::from_millis(500));
    assert_eq!(err.outcome(), Outcome::NotSent);
    assert_eq!(
        err.to_string(),
        "the call to carrier-api failed (3 attempts in 500 ms): connection refused; \
         the request did not take effect, so it is safe to try again later"
    );
    assert!(err.source_cause().downcast_ref::<io::Error>().is_some());
}

#[tokio::test(start_paused = true)]
async fn stops_at_once_when_the_wait_would_overrun_the_deadline() {
    let start = Instant::now();
    let script = Script::new(&[Step::StatusAfter(503, "30"), Step::Status(200)]);
    let mut req = get();
    Deadline::after(Duration::from_secs(10)).tighten(&mut req);
    let res = layer().layer(script.service()).oneshot(req).await.unwrap();
    assert_eq!(res.status(), StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(
        start.elapsed(),
        Duration::ZERO,
        "it must not sleep towards the deadline"
    );
    match &RetryHistory::of(&res).unwrap().stopped {
        StopReason::DeadlineTooClose { wait, left } => {
            assert_eq!(*wait, Duration::from_secs(30));
            assert_eq!(*left, Duration::from_secs(10));
        }
        other => panic!("{other:?}"),
    }
}

#[tokio::test(start_paused = true)]
async fn nested_retry_layers_make_three_attempts_not_twenty_seven() {
    let script = Script::new(&[Step::Status(503)]);
    let svc = layer().layer(layer().layer(layer().layer(script.service())));
    let res = svc.oneshot(get()).await.unwrap();
    assert_eq!(res.status(), StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(script.attempts(), 3);
}

#[derive(Debug, Default)]
struct Counting {
    deposits: AtomicU32,
    withdrawals: AtomicU32,
    allow: u32,
}

impl RetryBudget for Counting {
    fn deposit(&self, dependency: &Dependency, _now: tokio::time::Instant) {
        assert_eq!(dependency.as_str(), "carrier-api");
        self.deposits.fetch_add(1, Ordering::SeqCst);
    }
    fn withdraw(&self, _dependency: &Dependency) -> bool {
        self.withdrawals.fetch_add(1, Ordering::SeqCst) < self.allow
    }
}

#[tokio::test(start_paused = true)]
async fn the_budget_is_consulted_before_each_retry() {
    let budget = Arc::new(Counting {
        allow: 1,
        ..Counting::default()
    });
    let script = Script::new(&[Step::Refused]);
    let err = layer()
        .budget(budget.clone())
        .layer(script.service())
        .oneshot(get())
        .await
        .unwrap_err();
    assert_eq!(script.attempts(), 2);
    assert_eq!(budget.deposits.load(Ordering::SeqCst), 1);
    assert_eq!(budget.withdrawals.load(Ordering::SeqCst), 2);
    let err = retry_error(err);
    assert_eq!(
        err.history().expect("a history").stopped,
        StopReason::BudgetExhausted
    );
    assert!(
        err.to_string()
            .contains("and its retry budget is exhausted after 2 attempts"),
        "{err}"
    );
}

#[tokio::test(start_paused = true)]
async fn a_fatal_error_does_not_touch_the_budget() {
    let budget = Arc::new(Counting::default());
    let script = Script::new(&[Step::Status(422)]);
    layer()
        .budget(budget.clone())
        .layer(script.service())
        .oneshot(post())
        .await
        .unwrap();
    assert_eq!(budget.withdrawals.load(Ordering::SeqCst), 0);
}

/// A service that counts `poll_ready` calls and refuses to be called unready.
#[derive(Clone)]
struct Readiness<S> {
    inner: S,
    ready_calls: Arc<AtomicUsize>,
    armed: bool,
}

impl<S: Service<Req>> Service<Req> for Readiness<S> {
    type Response = S::Response;
    type Error = S::Error;
    type Future = S::Future;
    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), S::Error>> {
        self.ready_calls.fetch_add(1, Ordering::SeqCst);
        self.armed = true;
        self.inner.poll_ready(cx)
    }
    fn call(&mut self, req: Req) -> S::Future {
        assert!(self.armed, "called without poll_ready");
        self.armed = false;
        self.inner.call(req)
    }
}

#[tokio::test(start_paused = true)]
async fn readiness_is_polled_again_before_every_attempt() {
    let script = Script::new(&[Step::Status(503)]);
    let ready_calls = Arc::new(AtomicUsize::new(0));
    let inner = Readiness {
        inner: script.service(),
        ready_calls: ready_calls.clone(),
        armed: false,
    };
    layer().layer(inner).oneshot(get()).await.unwrap();
    assert_eq!(script.attempts(), 3);
    assert_eq!(ready_calls.load(Ordering::SeqCst), 3);
}

#[tokio::test(start_paused = true)]
async fn streamed_bodies_are_replayed_and_oversized_ones_are_sent_once() {
    let bodies = Arc::new(Mutex::new(Vec::new()));
    let seen = bodies.clone();
    type Boxed = http_body_util::combinators::UnsyncBoxBody<Bytes, BoxError>;
    let inner = service_fn(move |req: Request<Boxed>| {
        let seen = seen.clone();
        async move {
            let body = req.into_body().collect().await?.to_bytes();
            seen.lock().unwrap().push(body);
            Ok::<_, BoxError>(Response::builder().status(503).body(()).unwrap())
        }
    });
    let svc = layer()
        .resend(backstop_retry::StreamingResend::new(16))
        .layer(inner);
    let stream = |chunks: &'static [&'static [u8]]| {
        let frames = chunks
            .iter()
            .map(|c| Ok::<_, Infallible>(http_body::Frame::data(Bytes::from_static(c))));
        StreamBody::new(futures_lite_iter(frames))
            .map_err(|never| match never {})
            .boxed_unsync()
    };

    let small = Request::put("http://carrier.local/x")
        .body(stream(&[b"abc", b"def"]))
        .unwrap();
    let res = svc.clone().oneshot(small).await.unwrap();
    assert_eq!(RetryHistory::of(&res).unwrap().attempts.len(), 3);
    assert_eq!(bodies.lock().unwrap().len(), 3);
    assert!(bodies.lock().unwrap().iter().all(|b| b == "abcdef"));

    bodies.lock().unwrap().clear();
    let big = Request::put("http://carrier.local/x")
        .body(stream(&[b"0123456789", b"0123456789", b"tail"]))
        .unwrap();
    let res = svc.oneshot(big).await.unwrap();
    assert_eq!(
        *bodies.lock().unwrap(),
        vec![Bytes::from_static(b"01234567890123456789tail")]
    );
    match &RetryHistory::of(&res).unwrap().stopped {
        StopReason::NotCopyable(why) => {
            assert!(why.reason().contains("16 bytes kept for a retry"), "{why}")
        }
        other => panic!("{other:?}"),
    }
}

/// A stream over an iterator, without pulling in a futures crate.
fn futures_lite_iter<I: Iterator + Unpin>(iter: I) -> IterStream<I> {
    IterStream(iter)
}

struct IterStream<I>(I);

impl<I: Iterator + Unpin> futures_core::Stream for IterStream<I> {
    type Item = I::Item;
    fn poll_next(self: std::pin::Pin<&mut Self>, _cx: &mut Context<'_>) -> Poll<Option<I::Item>> {
        Poll::Ready(self.get_mut().0.next())
    }
}

/// A non-HTTP tool call, replayed by `Clone`, classified by its own rules.
#[derive(Clone, Debug)]
struct ToolCall {
    tool: &'static str,
    extensions: http::Extensions,
}

impl HasExtensions for ToolCall {
    fn extensions(&self) -> &http::Extensions {
        &self.extensions
    }
    fn extensions_mut(&mut self) -> &mut http::Extensions {
        &mut self.extensions
    }
}

#[derive(Debug)]
struct ToolResult(http::Extensions);

impl HasExtensions for ToolResult {
    fn extensions(&self) -> &http::Extensions {
        &self.0
    }
    fn extensions_mut(&mut self) -> &mut http::Extensions {
        &mut self.0
    }
}

#[derive(Clone, Debug)]
struct ToolRules;

impl Classify<ToolCall, ToolResult, BoxError> for ToolRules {
    fn classify(&self, result: Result<&ToolResult, &BoxError>) -> Verdict {
        match result {
            Ok(_) => Verdict::Success,
            Err(_) => Verdict::Retryable {
                outcome: Outcome::Unknown,
                after: None,
            },
        }
    }
    fn is_replay_safe(&self, req: &ToolCall) -> bool {
        req.tool.starts_with("get_") || backstop_core::ReplaySafe::is_marked(req)
    }
}

#[tokio::test(start_paused = true)]
async fn non_http_tool_calls_work_the_same_way() {
    let calls = Arc::new(AtomicU32::new(0));
    let c = calls.clone();
    let tool = service_fn(move |_call: ToolCall| {
        let n = c.fetch_add(1, Ordering::SeqCst);
        async move {
            // Attempts 0, 2 and 3 lose their reply.
            if matches!(n, 0 | 2 | 3) {
                Err::<ToolResult, BoxError>("lost reply".into())
            } else {
                Ok(ToolResult(http::Extensions::new()))
            }
        }
    });
    let svc = RetryLayer::new(ToolRules)
        .dependency("tools")
        .rng(RngSource::seeded(1))
        .layer(tool);
    let read = ToolCall {
        tool: "get_order",
        extensions: http::Extensions::new(),
    };
    svc.clone().oneshot(read).await.unwrap();
    assert_eq!(calls.load(Ordering::SeqCst), 2);

    let write = ToolCall {
        tool: "issue_refund",
        extensions: http::Extensions::new(),
    };
    let err = retry_error(svc.clone().oneshot(write.clone()).await.unwrap_err());
    assert_eq!(
        err.history().expect("a history").stopped,
        StopReason::NotReplaySafe
    );
    assert_eq!(calls.load(Ordering::SeqCst), 3);

    let mut marked = write;
    marked.extensions.insert(backstop_core::ReplaySafe);
    svc.oneshot(marked).await.unwrap();
    assert_eq!(calls.load(Ordering::SeqCst), 5);
}

#[tokio::test(start_paused = true)]
async fn a_request_that_cannot_be_copied_is_sent_once() {
    #[derive(Clone, Copy, Debug)]
    struct Never;
    impl Resend<ToolCall> for Never {
        fn copy(&self, _req: &ToolCall) -> Result<ToolCall, NotCopyable> {
            Err(NotCopyable::new("the tool call holds a one-shot stream"))
        }
    }
    let calls = Arc::new(AtomicU32::new(0));
    let c = calls.clone();
    let tool = service_fn(move |_call: ToolCall| {
        c.fetch_add(1, Ordering::SeqCst);
        async { Err::<ToolResult, BoxError>("lost reply".into()) }
    });
    let svc = RetryLayer::new(ToolRules).resend(Never).layer(tool);
    let call = ToolCall {
        tool: "get_stream",
        extensions: http::Extensions::new(),
    };
    let err = retry_error(svc.oneshot(call).await.unwrap_err());
    assert_eq!(calls.load(Ordering::SeqCst), 1);
    assert!(
        err.to_string()
            .contains("it was not retried because the tool call holds a one-shot stream"),
        "{err}"
    );
}

#[test]
fn zero_attempts_is_rejected() {
    let e = RetryLayer::http().max_attempts(0).unwrap_err();
    assert!(e.to_string().contains("max_attempts must be at least 1"));
}

/// tower's readiness contract, the retry layer alone: `poll_ready` answers what the service
/// under it answers, and the call goes out on the handle polled ready (`ConcurrencyLimit`
/// panics otherwise).
mod readiness {
    use super::*;
    use backstop_timeout::DeadlineLayer;
    use tower::{ServiceBuilder, buffer::Buffer, limit::ConcurrencyLimit, load_shed::LoadShed};

    /// Answers 200 after 100 ms, one call at a time.
    fn limited()
    -> ConcurrencyLimit<impl Service<Req, Response = Res, Error = BoxError, Future: Send> + Clone>
    {
        ConcurrencyLimit::new(
            service_fn(|_req: Req| async {
                tokio::time::sleep(Duration::from_millis(100)).await;
                Ok::<_, BoxError>(Response::new("ok"))
            }),
            1,
        )
    }

    #[tokio::test(start_paused = true)]
    async fn poll_ready_is_pending_while_the_service_is_not_ready() {
        let mut svc = ServiceBuilder::new()
            .layer(DeadlineLayer::new(Duration::from_secs(5)))
            .layer(layer())
            .service(limited());
        let started = Instant::now();
        let first = tokio::spawn(svc.ready().await.unwrap().call(get()));
        // The only permit went with the first call: the handle is not ready until it ends.
        let waker = futures_task_noop();
        let mut cx = Context::from_waker(&waker);
        assert!(svc.poll_ready(&mut cx).is_pending());
        let second = svc.ready().await.unwrap().call(get()).await;
        let first = first.await.unwrap();
        assert_eq!(
            (first.unwrap().into_body(), second.unwrap().into_body()),
            ("ok", "ok")
        );
        assert_eq!(started.elapsed(), Duration::from_millis(200));
    }

    #[tokio::test(start_paused = true)]
    async fn a_buffer_and_a_load_shed_see_the_limit_through_the_layer() {
        let stack = ServiceBuilder::new()
            .layer(DeadlineLayer::new(Duration::from_secs(5)))
            .layer(layer())
            .service(limited());
        let shared = Buffer::new(stack, 4);
        let started = Instant::now();
        let calls: Vec<_> = (0..3)
            .map(|_| tokio::spawn(shared.clone().oneshot(get())))
            .collect();
        for call in calls {
            call.await.unwrap().unwrap();
        }
        assert_eq!(started.elapsed(), Duration::from_millis(300));

        let shed = LoadShed::new(layer().layer(limited()));
        let holding = tokio::spawn(shed.clone().oneshot(get()));
        tokio::task::yield_now().await;
        let err = shed.clone().oneshot(get()).await.unwrap_err();
        assert!(err.is::<tower::load_shed::error::Overloaded>(), "{err}");
        holding.await.unwrap().unwrap();
    }

    fn futures_task_noop() -> std::task::Waker {
        std::task::Waker::noop().clone()
    }
}
