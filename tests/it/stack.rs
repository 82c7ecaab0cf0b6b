//! The composed stack: one builder, validated configuration, presets, the unified error,
//! dead letters, tracing and metrics. Real loopback HTTP through hyper-util's client.

use backstop::timeout::TimedBody;
use backstop::{
    Backstop, BoxError, DeadLetterSink, Error, ErrorKind, HasExtensions, JsonLinesSink, MemorySink,
    Outcome, Preset,
    backoff::{Backoff, RngSource},
    breaker::{Breaker, BreakerConfig},
    budget::Budget,
    idempotency::ActionContext,
    retry::RetryHistory,
};
use backstop_testkit::{Action, Seen, TestServer};
use bytes::Bytes;
use http::{Request, Response};
use http_body_util::Full;
use hyper::body::Incoming;
use hyper_util::{client::legacy::Client, rt::TokioExecutor};
use std::{
    sync::{Arc, Mutex},
    time::Duration,
};
use tower::{Layer, Service, ServiceExt};

type Body = Full<Bytes>;

fn client() -> Client<hyper_util::client::legacy::connect::HttpConnector, Body> {
    Client::builder(TokioExecutor::new()).build_http()
}

/// A stack with its own budget and breaker (tests run in parallel) and fast waits.
fn builder(
    dep: &str,
) -> Backstop<
    backstop::classify::HttpClassifier,
    backstop::retry::HttpResend,
    backstop::idempotency::HttpKeys,
> {
    Backstop::http(dep)
        .budget(Budget::default())
        .breaker(Breaker::new(BreakerConfig::default().consecutive_failures(3)).unwrap())
        .backoff(Backoff::full_jitter(Duration::from_millis(5), Duration::from_millis(20)).unwrap())
        .rng(RngSource::seeded(4))
        .deadline(Duration::from_secs(5))
        .attempt_timeout(Duration::from_millis(500))
}

fn stack(
    b: Backstop<
        backstop::classify::HttpClassifier,
        backstop::retry::HttpResend,
        backstop::idempotency::HttpKeys,
    >,
) -> impl Service<Request<Body>, Response = Response<TimedBody<Incoming>>, Error = Error, Future: Send>
+ Clone
+ Send {
    b.build().unwrap().layer(client())
}

fn post(url: String) -> Request<Body> {
    Request::post(url)
        .body(Full::from(r#"{"order_id":"4812"}"#))
        .unwrap()
}

#[test]
fn the_configuration_is_validated_with_the_setting_to_change() {
    let cases: Vec<(Backstop<_, _, _>, &str)> = vec![
        (
            Backstop::http("a")
                .deadline(Duration::from_secs(1))
                .attempt_timeout(Duration::from_secs(2)),
            "shorten attempt_timeout",
        ),
        (
            Backstop::http("a")
                .deadline(Duration::from_secs(2))
                .p99(Duration::from_secs(1)),
            "give a lower p99",
        ),
        (
            Backstop::http("a")
                .attempt_timeout(Duration::from_secs(20))
                .breaker(
                    Breaker::new(BreakerConfig::default().failure_ratio(
                        0.5,
                        20,
                        Duration::from_secs(30),
                    ))
                    .unwrap(),
                ),
            "lengthen the window",
        ),
        (
            Backstop::http("a").preset(Preset::Payment),
            "reconciliation hook",
        ),
        (
            Backstop::http("a")
                .preset(Preset::Destructive)
                .max_attempts(3),
            "never retried automatically",
        ),
        (
            Backstop::http("a").preset(Preset::Create).no_idempotency(),
            "require idempotency keys",
        ),
        (
            Backstop::http("a").max_attempts(0),
            "max_attempts must be at least 1",
        ),
        (
            Backstop::http("a").p99(Duration::ZERO),
            "p99 must be greater than zero",
        ),
    ];
    for (b, needle) in cases {
        let e = b.build().unwrap_err();
        assert!(
            e.to_string().contains(needle),
            "{e} should mention {needle}"
        );
    }
    let layer = Backstop::http("a").build().unwrap();
    assert_eq!(layer.max_attempts(), 3);
    assert_eq!(layer.deadline(), Some(Duration::from_secs(30)));
    assert_eq!(layer.attempt_timeout(), Duration::from_secs(10));
    assert_eq!(
        Backstop::http("a")
            .preset(Preset::Destructive)
            .build()
            .unwrap()
            .max_attempts(),
        1
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_open_circuit_comes_back_as_an_honest_error() {
    let server = TestServer::start(|_: &Seen| Action::status(503)).await;
    let svc = stack(builder("stack-carrier-api"));
    // Three failed attempts open the circuit (consecutive_failures(3)).
    assert_eq!(
        svc.clone()
            .oneshot(
                Request::get(server.url("/rates"))
                    .body(Body::default())
                    .unwrap()
            )
            .await
            .unwrap()
            .status(),
        503
    );
    let err = svc
        .oneshot(
            Request::get(server.url("/rates"))
                .body(Body::default())
                .unwrap(),
        )
        .await
        .unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Unavailable);
    assert_eq!(err.outcome(), Outcome::NotSent);
    assert_eq!(err.dependency().unwrap().as_str(), "stack-carrier-api");
    assert!(err.is_retryable_later());
    let retry_after = err.retry_after().unwrap();
    assert!(retry_after > Duration::from_secs(25) && retry_after <= Duration::from_secs(30));
    assert_eq!(
        err.to_string(),
        "stack-carrier-api is unavailable (circuit open); do not retry now; it can be tried again in 30 s; the request did not take effect, so it is safe to try again later; tell the user"
    );
    assert_eq!(server.requests(), 3);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lost_reply_to_an_unkeyed_post_is_not_retried_and_is_reported_unknown() {
    let server = TestServer::start(|_: &Seen| Action::DropReply).await;
    let sink = Arc::new(MemorySink::default());
    let svc = stack(
        builder("stack-payments-api")
            .no_idempotency()
            .dead_letters(sink.clone()),
    );
    let mut req = post(server.url("/refunds"));
    req.extensions_mut()
        .insert(ActionContext::tool_call("run-7", "step-2", "call-9"));
    let err = svc.oneshot(req).await.unwrap_err();
    assert_eq!(err.kind(), ErrorKind::NotRetried);
    assert_eq!(err.outcome(), Outcome::Unknown);
    assert!(!err.is_retryable_later());
    let text = err.to_string();
    assert!(
        text.starts_with("the call to stack-payments-api may or may not have taken effect"),
        "{text}"
    );
    assert!(
        text.ends_with("check its status before repeating it"),
        "{text}"
    );
    assert_eq!(server.requests(), 1);
    let letters = sink.take();
    assert_eq!(letters.len(), 1);
    assert_eq!(letters[0].run_id.as_deref(), Some("run-7"));
    assert_eq!(letters[0].tool_call_id.as_deref(), Some("call-9"));
    assert_eq!(letters[0].outcome, Outcome::Unknown);
    assert_eq!(letters[0].idempotency_key, None);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_key_the_stack_minted_is_sent_but_does_not_make_a_lost_post_retryable() {
    // A server that ignores keys and whose replies are lost: three sends would be three charges.
    for derived in [false, true] {
        let server = TestServer::start(|_: &Seen| Action::DropReply).await;
        let svc = stack(builder("stack-payments-api"));
        let mut req = post(server.url("/charges"));
        if derived {
            req.extensions_mut()
                .insert(ActionContext::tool_call("run-7", "step-2", "call-9"));
        }
        let err = svc.oneshot(req).await.unwrap_err();
        assert_eq!(server.requests(), 1, "derived key: {derived}");
        assert!(server.seen()[0].header("idempotency-key").is_some());
        assert_eq!(err.kind(), ErrorKind::NotRetried);
        assert_eq!(err.outcome(), Outcome::Unknown);
        let text = err.to_string();
        assert!(
            text.contains("it was not repeated because nobody declared that stack-payments-api honours idempotency keys"),
            "{text}"
        );
        assert!(text.contains("honours_keys()"), "{text}");
    }
    // A key the caller set itself is its word: retried.
    let server = TestServer::start(|_: &Seen| Action::DropReply).await;
    let mut req = post(server.url("/charges"));
    req.headers_mut()
        .insert("idempotency-key", "caller-key-1".parse().unwrap());
    let err = stack(builder("stack-payments-api"))
        .oneshot(req)
        .await
        .unwrap_err();
    assert_eq!(server.requests(), 3, "{err}");
    // So does a preset that requires keys.
    let server = TestServer::start(|_: &Seen| Action::DropReply).await;
    let mut req = post(server.url("/charges"));
    req.extensions_mut()
        .insert(ActionContext::tool_call("run-7", "step-2", "call-9"));
    let err = stack(builder("stack-payments-api").preset(Preset::Create))
        .oneshot(req)
        .await
        .unwrap_err();
    assert_eq!(server.requests(), 3, "{err}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn keyed_posts_are_retried_and_dead_letters_carry_the_key() {
    let server = TestServer::start(|_: &Seen| Action::DropReply).await;
    let sink = Arc::new(MemorySink::default());
    let svc = stack(
        builder("stack-payments-api")
            .honours_keys()
            .dead_letters(sink.clone()),
    );
    let mut req = post(server.url("/refunds"));
    req.extensions_mut()
        .insert(ActionContext::tool_call("run-7", "step-2", "call-9"));
    let err = svc.oneshot(req).await.unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Failed);
    assert_eq!(err.attempts(), 3);
    assert_eq!(server.requests(), 3);
    let keys: Vec<_> = server
        .seen()
        .iter()
        .map(|s| s.header("idempotency-key").unwrap().to_owned())
        .collect();
    let want = backstop::idempotency::ActionContext::tool_call("run-7", "step-2", "call-9").key();
    assert!(keys.iter().all(|k| k == want.as_str()), "{keys:?}");
    assert_eq!(sink.take()[0].idempotency_key, Some(want));
}

/// The call's work as a layer of its own, over a retry layer the user composed: the key it
/// attaches once is on every attempt the retry layer sends (and, declared honoured, lets a lost
/// reply be repeated); the call ends in one `Error` and one dead letter. Without the
/// declaration the same stack sends once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_calls_work_over_a_retry_layer_of_ones_own_keys_every_attempt_once() {
    for honoured in [true, false] {
        let server = TestServer::start(|_: &Seen| Action::DropReply).await;
        let sink = Arc::new(MemorySink::default());
        let mut builder = Backstop::http("call-payments-api").dead_letters(sink.clone());
        if honoured {
            builder = builder.honours_keys();
        }
        let call = builder.build().unwrap().call_layer();
        let retry = backstop::retry::RetryLayer::http()
            .dependency("call-payments-api")
            .backoff(Backoff::constant(Duration::from_millis(5)));
        let svc = tower::ServiceBuilder::new()
            .layer(call)
            .layer(retry)
            .service(client());
        let mut req = post(server.url("/refunds"));
        req.extensions_mut()
            .insert(ActionContext::tool_call("run-7", "step-2", "call-9"));
        let err: Error = svc.oneshot(req).await.unwrap_err();
        let sent = if honoured { 3 } else { 1 };
        assert_eq!(server.requests(), sent, "honoured: {honoured}; {err}");
        assert_eq!(err.attempts(), sent as u32, "{err}");
        assert_eq!(err.outcome(), Outcome::Unknown, "{err}");
        assert_eq!(
            err.dependency().map(|d| d.as_str()),
            Some("call-payments-api")
        );
        let want = ActionContext::tool_call("run-7", "step-2", "call-9").key();
        assert!(
            server
                .seen()
                .iter()
                .all(|s| s.header("idempotency-key") == Some(want.as_str())),
            "one key on every attempt"
        );
        let letters = sink.take();
        assert_eq!(letters.len(), 1, "one dead letter for the call");
        assert_eq!(letters[0].idempotency_key, Some(want));
        assert_eq!(letters[0].outcome, Outcome::Unknown);
    }
}

/// Under a retry layer the call's work stands aside: the call is the retry layer's, so no key
/// is minted per attempt (a POST without one is not repeated after a lost reply) and no letter
/// is written for an attempt.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_calls_work_under_a_retry_layer_stands_aside() {
    let server = TestServer::start(|_: &Seen| Action::DropReply).await;
    let sink = Arc::new(MemorySink::default());
    let call = Backstop::http("call-inside-api")
        .honours_keys()
        .dead_letters(sink.clone())
        .build()
        .unwrap()
        .call_layer();
    let svc = tower::ServiceBuilder::new()
        .layer(backstop::retry::RetryLayer::http().dependency("call-inside-api"))
        .layer(call)
        .service(client());
    let err = svc.oneshot(post(server.url("/refunds"))).await.unwrap_err();
    assert_eq!(err.outcome(), Outcome::Unknown, "{err}");
    assert_eq!(server.requests(), 1, "{err}");
    assert_eq!(server.seen()[0].header("idempotency-key"), None);
    assert!(sink.take().is_empty());
}

/// A call the call's work refuses (a required key missing) sends nothing and keeps the
/// readiness it was given for the next call: over `tower-test`'s mock, which allows one request
/// and panics at a call on a handle whose readiness was spent, the keyed call that follows goes
/// out without another `poll_ready`.
#[tokio::test]
async fn the_calls_work_refuses_a_call_without_its_required_key_and_sends_nothing() {
    let call = Backstop::http("call-charges-api")
        .preset(Preset::Create)
        .build()
        .unwrap()
        .call_layer();
    let (mock, mut handle) = tower_test::mock::pair::<Request<Body>, Response<Body>>();
    handle.allow(1);
    let mut svc = call.layer(mock);
    let unkeyed = post("http://charges.test/charges".to_owned());
    let err = svc.ready().await.unwrap().call(unkeyed).await.unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Misconfigured, "{err}");
    assert_eq!(err.outcome(), Outcome::NotSent);
    let mut keyed = post("http://charges.test/charges".to_owned());
    keyed
        .headers_mut()
        .insert("idempotency-key", "charge-1".parse().unwrap());
    let answer = svc.call(keyed);
    // The first request the client sees is the keyed one: the refused call never reached it.
    let (sent, reply) = handle.next_request().await.expect("the keyed call is sent");
    assert_eq!(sent.headers()["idempotency-key"], "charge-1");
    reply.send_response(Response::new(Body::default()));
    assert_eq!(answer.await.unwrap().status(), 200);
}

/// A POST that carries its own `Idempotency-Key` header: its dead letter names that key.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_letter_names_the_key_the_caller_set_in_the_header() {
    let server = TestServer::start(|_: &Seen| Action::DropReply).await;
    let sink = Arc::new(MemorySink::default());
    let svc = stack(builder("stack-payments-api").dead_letters(sink.clone()));
    let mut req = post(server.url("/refunds"));
    req.headers_mut().insert(
        "idempotency-key",
        http::HeaderValue::from_static("refund-4812"),
    );
    let err = svc.oneshot(req).await.unwrap_err();
    assert_eq!(err.outcome(), Outcome::Unknown, "{err}");
    assert!(
        server
            .seen()
            .iter()
            .all(|s| s.header("idempotency-key") == Some("refund-4812")),
        "the caller's key is sent as it is"
    );
    let letters = sink.take();
    assert_eq!(letters.len(), 1, "{letters:?}");
    let want = backstop::idempotency::IdempotencyKey::new("refund-4812").unwrap();
    assert_eq!(letters[0].idempotency_key, Some(want));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn presets_follow_the_tool_policy_table() {
    // Read-only: a POST search is retried after a lost reply, without a key.
    let server = TestServer::start(|s: &Seen| {
        if s.index == 0 {
            Action::DropReply
        } else {
            Action::status(200)
        }
    })
    .await;
    let res = stack(builder("stack-search-api").preset(Preset::ReadOnly))
        .oneshot(post(server.url("/search")))
        .await
        .unwrap();
    assert_eq!(res.status(), 200);
    assert!(
        server
            .seen()
            .iter()
            .all(|s| s.header("idempotency-key").is_none())
    );

    // Create: without an action identity, nothing is sent.
    let server = TestServer::start(|_: &Seen| Action::status(201)).await;
    let svc = stack(builder("orders-api").preset(Preset::Create));
    let err = svc
        .clone()
        .oneshot(post(server.url("/orders")))
        .await
        .unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Misconfigured);
    assert_eq!(err.outcome(), Outcome::NotSent);
    assert!(
        err.to_string().contains("needs an idempotency key"),
        "{err}"
    );
    assert_eq!(server.requests(), 0);
    let mut req = post(server.url("/orders"));
    req.extensions_mut()
        .insert(ActionContext::tool_call("run-1", "step-1", "call-1"));
    assert_eq!(svc.oneshot(req).await.unwrap().status(), 201);

    // Payment: unknown outcomes go to reconciliation.
    let server = TestServer::start(|_: &Seen| Action::DropReply).await;
    let reconciled = Arc::new(Mutex::new(Vec::new()));
    let r = reconciled.clone();
    let svc = stack(
        builder("stack-payments-api")
            .preset(Preset::Payment)
            .reconcile(move |l| r.lock().unwrap().push(l.idempotency_key.clone())),
    );
    let mut req = post(server.url("/charges"));
    req.extensions_mut()
        .insert(ActionContext::tool_call("run-2", "step-1", "call-1"));
    let err = svc.oneshot(req).await.unwrap_err();
    assert_eq!(err.outcome(), Outcome::Unknown);
    assert_eq!(reconciled.lock().unwrap().len(), 1);
    assert!(reconciled.lock().unwrap()[0].is_some());

    // Destructive: one attempt, even on a 503.
    let server = TestServer::start(|_: &Seen| Action::status(503)).await;
    let res = stack(builder("infra-api").preset(Preset::Destructive))
        .oneshot(
            Request::delete(server.url("/servers/1"))
                .body(Body::default())
                .unwrap(),
        )
        .await
        .unwrap();
    assert_eq!(res.status(), 503);
    assert_eq!(server.requests(), 1);
    assert_eq!(RetryHistory::of(&res).unwrap().attempts.len(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_json_lines_sink_writes_one_object_per_line() {
    let dir = backstop_testkit::scratch_dir("dlq");
    let path = dir.path().join("dead-letters.jsonl");
    let sink = Arc::new(JsonLinesSink::open(&path).unwrap());
    let server = TestServer::start(|_: &Seen| Action::DropReply).await;
    let svc = stack(
        builder("stack-payments-api")
            .honours_keys()
            .dead_letters(sink.clone() as Arc<dyn DeadLetterSink>),
    );
    for call in ["call-1", "call-2"] {
        let mut req = post(server.url("/refunds"));
        req.extensions_mut()
            .insert(ActionContext::tool_call("run-9", "step-1", call));
        svc.clone().oneshot(req).await.unwrap_err();
    }
    let text = std::fs::read_to_string(&path).unwrap();
    let lines: Vec<serde_json::Value> = text
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(lines.len(), 2);
    assert_eq!(lines[1]["run_id"], "run-9");
    assert_eq!(lines[1]["tool_call_id"], "call-2");
    assert_eq!(lines[1]["dependency"], "stack-payments-api");
    assert_eq!(lines[0]["outcome"], "unknown");
    assert_eq!(lines[0]["kind"], "failed");
    assert_eq!(lines[0]["attempts"], 3);
    // The first call's three failures opened the circuit: the second was never sent.
    assert_eq!(lines[1]["outcome"], "not_sent");
    assert_eq!(lines[1]["kind"], "unavailable");
    assert_eq!(lines[1]["idempotency_key"].as_str().unwrap().len(), 64);
    assert_ne!(lines[0]["idempotency_key"], lines[1]["idempotency_key"]);
    let _ = std::fs::remove_dir_all(&dir);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn errors_that_did_not_come_from_backstop_keep_their_text() {
    let err = Error::new(None, "tls handshake failed");
    assert_eq!(err.kind(), ErrorKind::Failed);
    assert_eq!(err.outcome(), Outcome::Unknown);
    assert!(err.to_string().contains("tls handshake failed"), "{err}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn behind_a_buffer_a_second_stack_makes_one_attempt_per_outer_attempt() {
    let server = TestServer::start(|_: &Seen| Action::status(503)).await;
    // A stack shared through a `tower::buffer::Buffer` (its worker task makes the calls), used
    // inside another stack: the call's context travels in the request, so the worker's stack
    // knows it is nested. No breakers here: they would open on the 503s and stop the
    // multiplication themselves.
    let stack = || builder("stack-rates-api").no_breaker().build().unwrap();
    let inner = tower::buffer::Buffer::new(stack().layer(client()), 16);
    let get = Request::get(server.url("/rates"))
        .body(Body::default())
        .unwrap();
    let res = stack().layer(inner).oneshot(get).await.unwrap();
    assert_eq!(res.status(), 503);
    assert_eq!(server.requests(), 3, "one retry layer, not 3 x 3");
}

/// A client that cannot take requests: its pool is shut.
#[derive(Clone)]
struct Shut;

impl Service<Request<Body>> for Shut {
    type Response = Response<Body>;
    type Error = BoxError;
    type Future = std::future::Ready<Result<Response<Body>, BoxError>>;
    fn poll_ready(
        &mut self,
        _cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Result<(), BoxError>> {
        std::task::Poll::Ready(Err("the connection pool is shut".into()))
    }
    fn call(&mut self, _req: Request<Body>) -> Self::Future {
        unreachable!("never ready")
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_is_not_ready_fails_with_an_error_naming_the_dependency() {
    let svc = builder("stack-rates-api").build().unwrap().layer(Shut);
    let err = svc
        .oneshot(
            Request::get("http://rates.local/")
                .body(Body::default())
                .unwrap(),
        )
        .await
        .unwrap_err();
    assert_eq!(
        err.dependency().map(|d| d.as_str()),
        Some("stack-rates-api")
    );
    assert!(
        err.to_string().contains("the connection pool is shut"),
        "{err}"
    );
}

/// A request body that counts its copies.
struct CountedBody(Arc<std::sync::atomic::AtomicUsize>);

impl Clone for CountedBody {
    fn clone(&self) -> Self {
        self.0.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        CountedBody(self.0.clone())
    }
}

impl http_body::Body for CountedBody {
    type Data = Bytes;
    type Error = std::convert::Infallible;
    fn poll_frame(
        self: std::pin::Pin<&mut Self>,
        _cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<http_body::Frame<Bytes>, Self::Error>>> {
        std::task::Poll::Ready(None)
    }
}

#[tokio::test(start_paused = true)]
async fn an_open_circuit_fails_fast_without_calling_the_client() {
    let breaker = Breaker::new(BreakerConfig::default()).unwrap();
    breaker.isolate(&"stack-rates-api".into());
    let calls = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let seen = calls.clone();
    let client = tower::service_fn(move |_req: Request<CountedBody>| {
        seen.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        async { Ok::<_, BoxError>(Response::new(Full::<Bytes>::default())) }
    });
    let svc = Backstop::http("stack-rates-api")
        .breaker(breaker)
        .budget(Budget::default())
        .build()
        .unwrap()
        .layer(client);
    let copies = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let req = Request::get("http://rates.local/")
        .body(CountedBody(copies.clone()))
        .unwrap();
    let err = svc.oneshot(req).await.unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Unavailable);
    assert_eq!(err.attempts(), 0);
    assert_eq!(
        calls.load(std::sync::atomic::Ordering::SeqCst),
        0,
        "the client is not called"
    );
    // The retry layer keeps its copy before the breaker inside it is asked: one copy, no more.
    assert_eq!(
        copies.load(std::sync::atomic::Ordering::SeqCst),
        1,
        "one copy for a call the circuit refuses"
    );
}

/// The first request is acted on and its reply lost; later ones get a 201.
fn lose_the_first_reply(s: &Seen) -> Action {
    if s.index == 0 {
        Action::DropReply
    } else {
        Action::respond(201, &[], "{}")
    }
}

/// The builder names the key's header and format, and the classifier reads the same header: the
/// key the stack sends is the one that makes the request replay-safe (they cannot disagree).
#[tokio::test]
async fn the_idempotency_header_is_named_once_for_the_key_and_the_classifier() {
    /// (the named header, the default one) on each request.
    type Headers = Vec<(Option<String>, Option<String>)>;
    let seen: Arc<Mutex<Headers>> = Arc::default();
    let log = seen.clone();
    let server = TestServer::start(move |s: &Seen| {
        log.lock().unwrap().push((
            s.header("x-idempotency-key").map(str::to_owned),
            s.header("idempotency-key").map(str::to_owned),
        ));
        lose_the_first_reply(s)
    })
    .await;
    let client = Client::builder(TokioExecutor::new()).build_http::<Full<Bytes>>();
    let svc = Backstop::http("stack-payments-api")
        .idempotency_header(
            http::HeaderName::from_static("x-idempotency-key"),
            backstop::idempotency::KeyFormat::StructuredField,
        )
        .honours_keys()
        .rng(RngSource::seeded(5))
        .build()
        .unwrap()
        .layer(client);
    let res = svc
        .oneshot(
            Request::post(server.url("/charges"))
                .body(Full::from("{}"))
                .unwrap(),
        )
        .await
        .unwrap();
    assert_eq!(res.status(), 201);
    let seen = seen.lock().unwrap().clone();
    assert_eq!(
        seen.len(),
        2,
        "the lost reply was repeated: the key is in the header the classifier reads"
    );
    let key = seen[0].0.clone().expect("the key is in x-idempotency-key");
    assert!(
        key.starts_with('"') && key.ends_with('"'),
        "structured-field string: {key}"
    );
    assert_eq!(
        seen[1].0.as_deref(),
        Some(key.as_str()),
        "the same key on every attempt"
    );
    assert!(
        seen.iter().all(|(_, default)| default.is_none()),
        "not also under the default name"
    );
}

#[tokio::test]
async fn a_callers_key_under_the_named_header_makes_a_post_replay_safe_without_the_key_layer() {
    let server = TestServer::start(|s: &Seen| lose_the_first_reply(s)).await;
    let client = Client::builder(TokioExecutor::new()).build_http::<Full<Bytes>>();
    let svc = Backstop::http("stack-payments-api")
        .idempotency_header(
            http::HeaderName::from_static("x-idempotency-key"),
            backstop::idempotency::KeyFormat::Plain,
        )
        .no_idempotency()
        .rng(RngSource::seeded(5))
        .build()
        .unwrap()
        .layer(client);
    let req = Request::post(server.url("/charges"))
        .header("x-idempotency-key", "charge-7")
        .body(Full::from("{}"))
        .unwrap();
    assert_eq!(svc.oneshot(req).await.unwrap().status(), 201);
    assert_eq!(
        server.requests(),
        2,
        "the classifier reads the named header"
    );
}

/// reqwest in one call: the key derived from the action reaches the server, the deadline ends a
/// call to a server that never answers, and the error is a typed `backstop::Error`.
#[tokio::test]
async fn reqwest_under_the_stack_keeps_the_keys_the_deadline_and_the_typed_error() {
    let server = TestServer::start(|s: &Seen| match s.path.as_str() {
        "/labels" => Action::respond(201, &[], "{}"),
        _ => Action::Hang,
    })
    .await;
    let svc = Backstop::http("stack-labels-api")
        .deadline(Duration::from_millis(600))
        .p99(Duration::from_millis(100))
        .build()
        .unwrap()
        .reqwest(reqwest::Client::new());
    let mut req = Request::post(server.url("/labels"))
        .body(Full::from("{}"))
        .unwrap();
    let action = ActionContext::tool_call("run-9", "label", "c1");
    req.extensions_mut().insert(action.clone());
    assert_eq!(svc.clone().oneshot(req).await.unwrap().status(), 201);
    assert_eq!(
        server.seen()[0].header("idempotency-key"),
        Some(action.key().as_str())
    );

    // The bound only tells a call ended by its 600 ms deadline from one that hangs with the
    // server: it is far past the deadline so that two loaded cores cannot trip it.
    let err = tokio::time::timeout(
        Duration::from_secs(5),
        svc.oneshot(
            Request::get(server.url("/hang"))
                .body(Full::default())
                .unwrap(),
        ),
    )
    .await
    .expect("the deadline ends the call")
    .unwrap_err();
    assert!(
        matches!(
            err.kind(),
            backstop::ErrorKind::DeadlineExceeded | backstop::ErrorKind::TimedOut
        ),
        "{err}"
    );
}

/// Opt-in: each attempt carries its number, so the server can tell a retry from a first try;
/// a stack nested inside another sends the outer layer's numbers.
#[tokio::test]
async fn the_attempt_number_goes_onward_under_the_named_header() {
    let server = TestServer::start(|s: &Seen| {
        if s.index % 3 < 2 {
            Action::status(503)
        } else {
            Action::respond(200, &[], "{}")
        }
    })
    .await;
    let seen = |server: &TestServer| -> Vec<Option<String>> {
        server
            .seen()
            .iter()
            .map(|s| s.header("x-attempt-count").map(str::to_owned))
            .collect()
    };
    let client = Client::builder(TokioExecutor::new()).build_http::<Full<Bytes>>();
    let counted = |name: &str| {
        Backstop::http(name)
            .attempt_header(http::HeaderName::from_static("x-attempt-count"))
            .rng(RngSource::seeded(1))
            .backoff(
                Backoff::full_jitter(Duration::from_millis(1), Duration::from_millis(5)).unwrap(),
            )
            .build()
            .unwrap()
    };
    let svc = counted("stack-rates-api").layer(client.clone());
    let get = || {
        Request::get(server.url("/rates"))
            .body(Full::default())
            .unwrap()
    };
    assert_eq!(svc.clone().oneshot(get()).await.unwrap().status(), 200);
    let one = |n: &str| Some(n.to_owned());
    assert_eq!(seen(&server), [one("1"), one("2"), one("3")]);

    // Nested through a lazy future: the inner layer makes one attempt per outer attempt and
    // leaves the outer layer's number in place.
    let inner = counted("rates-inner").layer(client.clone());
    let lazy = tower::service_fn(move |req: Request<Full<Bytes>>| {
        let inner = inner.clone();
        async move { inner.oneshot(req).await }
    });
    let outer = counted("stack-rates-api").layer(lazy);
    assert_eq!(outer.oneshot(get()).await.unwrap().status(), 200);
    assert_eq!(seen(&server)[3..], [one("1"), one("2"), one("3")]);

    // Off by default.
    let plain = Backstop::http("stack-rates-api")
        .build()
        .unwrap()
        .layer(client);
    let _ = plain.oneshot(get()).await.unwrap();
    assert_eq!(seen(&server)[6], None);
}

/// The stack as a reqwest-middleware `Middleware`: retries down the chain, the action's key from
/// the middleware's extensions, and the typed error inside reqwest-middleware's.
#[tokio::test]
async fn as_a_reqwest_middleware_the_stack_keeps_keys_retries_and_the_typed_error() {
    let server = TestServer::start(|s: &Seen| match (s.path.as_str(), s.index) {
        ("/rates", 0 | 1) => Action::status(503),
        ("/rates", _) => Action::respond(200, &[], "{\"ground\":8.40}"),
        _ => Action::respond(201, &[], "{}"),
    })
    .await;
    let stack = Backstop::http("rates-mw-api")
        .rng(RngSource::seeded(2))
        .backoff(Backoff::full_jitter(Duration::from_millis(1), Duration::from_millis(5)).unwrap())
        .build()
        .unwrap();
    let client = reqwest_middleware::ClientBuilder::new(reqwest::Client::new())
        .with(backstop::reqwest::BackstopMiddleware::new(stack))
        .build();
    let res = client.get(server.url("/rates")).send().await.unwrap();
    assert_eq!(res.status(), 200);
    assert_eq!(res.text().await.unwrap(), "{\"ground\":8.40}");
    assert_eq!(server.requests(), 3, "two 503s retried down the chain");

    let action = ActionContext::tool_call("run-mw", "label", "c1");
    let res = client
        .post(server.url("/labels"))
        .with_extension(action.clone())
        .body("{}")
        .send()
        .await
        .unwrap();
    assert_eq!(res.status(), 201);
    assert_eq!(
        server.seen()[3].header("idempotency-key"),
        Some(action.key().as_str())
    );

    let nowhere = backstop_testkit::refused_addr().await;
    let err = client
        .get(format!("http://{nowhere}/rates"))
        .send()
        .await
        .unwrap_err();
    let reqwest_middleware::Error::Middleware(inner) = err else {
        panic!("not the middleware's error: {err}");
    };
    let typed = inner
        .downcast_ref::<backstop::Error>()
        .expect("the typed error");
    assert_eq!(typed.outcome(), backstop::Outcome::NotSent);
    assert_eq!(typed.attempts(), 3);
}

/// A foreign request and result type under the stack, with no newtype: `WithExtensions`.
#[tokio::test(start_paused = true)]
async fn a_foreign_tool_call_type_goes_under_the_stack_in_with_extensions() {
    use backstop::{
        Preset, WithExtensions,
        classify::{AsError, Classify, Verdict},
        idempotency::{IdempotencyKey, KeyedRequest},
    };
    /// A type from another crate (an MCP SDK's, say): Clone, no extensions of its own.
    #[derive(Clone, Debug)]
    struct CallTool {
        name: String,
    }
    #[derive(Clone, Copy, Debug)]
    struct Rules;
    impl<E: AsError> Classify<WithExtensions<CallTool>, WithExtensions<String>, E> for Rules {
        fn classify(&self, result: Result<&WithExtensions<String>, &E>) -> Verdict {
            match result {
                Ok(_) => Verdict::Success,
                Err(_) => Verdict::Retryable {
                    outcome: backstop::Outcome::Unknown,
                    after: None,
                },
            }
        }
        fn is_replay_safe(&self, _req: &WithExtensions<CallTool>) -> bool {
            false
        }
    }
    let keys: Arc<Mutex<Vec<IdempotencyKey>>> = Arc::default();
    let seen = keys.clone();
    let tool = tower::service_fn(move |call: WithExtensions<CallTool>| {
        let seen = seen.clone();
        async move {
            assert_eq!(call.get().name, "issue_refund");
            let mut seen = seen.lock().unwrap();
            seen.push(
                call.idempotency_key()
                    .cloned()
                    .expect("the key travels in the extensions"),
            );
            if seen.len() == 1 {
                // The refund was booked and the reply lost.
                return Err::<WithExtensions<String>, BoxError>("connection reset".into());
            }
            Ok(WithExtensions::new("{\"refund\":\"rf_1\"}".to_owned()))
        }
    });
    let svc = Backstop::tools("refund-tool", Rules)
        .preset(Preset::Create)
        .build()
        .unwrap()
        .layer(tool);
    let mut call = WithExtensions::new(CallTool {
        name: "issue_refund".into(),
    });
    let action = ActionContext::tool_call("run-7", "step-2", "call-1");
    call.extensions_mut().insert(action.clone());
    let res = svc.oneshot(call).await.unwrap();
    assert_eq!(res.get(), "{\"refund\":\"rf_1\"}");
    assert!(
        RetryHistory::of(&res).is_some(),
        "the result carries the history"
    );
    assert_eq!(
        *keys.lock().unwrap(),
        [action.key(), action.key()],
        "one key, on both attempts"
    );
}

/// A lost reply to a POST, as the model receives it: unknown, not safe to repeat, check first.
#[tokio::test]
async fn an_unknown_outcome_becomes_a_tool_result_that_says_check_before_repeating() {
    let reset = tower::service_fn(|_req: Request<Full<Bytes>>| async {
        Err::<Response<Full<Bytes>>, _>(std::io::Error::from(std::io::ErrorKind::ConnectionReset))
    });
    let svc = Backstop::http("payments-tool-api")
        .build()
        .unwrap()
        .layer(reset);
    let err = svc
        .oneshot(
            Request::post("http://payments.local/refunds")
                .body(Full::from("{}"))
                .unwrap(),
        )
        .await
        .unwrap_err();
    let result = err.to_tool_result(None);
    let s = &result["structuredContent"];
    assert_eq!(s["outcome"], "unknown");
    assert_eq!(s["safe_to_repeat"], false);
    assert_eq!(s["idempotency_key"], serde_json::Value::Null);
    assert!(
        s["next_action"]
            .as_str()
            .unwrap()
            .contains("check its status"),
        "{s}"
    );
    assert_eq!(result["content"][0]["text"], err.to_string());
}

/// `Duration::MAX` for every limit, and no deadline at all, mean "never": nothing panics on an
/// instant it cannot represent, and each layer still answers (paused clock, a service that takes
/// a moment, so that every timer is created).
#[tokio::test(start_paused = true)]
async fn duration_max_and_no_deadline_never_panic() {
    use backstop::{
        retry::RetryLayer,
        timeout::{AttemptTimeoutLayer, BodyTimeoutLayer, DeadlineLayer},
    };
    let slow = || {
        tower::service_fn(|_req: Request<Full<Bytes>>| async {
            tokio::time::sleep(Duration::from_millis(5)).await;
            Ok::<_, BoxError>(Response::new(Full::<Bytes>::default()))
        })
    };
    let get = || {
        Request::get("http://limits.local/x")
            .body(Full::default())
            .unwrap()
    };
    let stacks = [
        Backstop::http("limits-api")
            .no_deadline()
            .attempt_timeout(Duration::MAX),
        Backstop::http("limits-api")
            .deadline(Duration::MAX)
            .attempt_timeout(Duration::MAX),
        Backstop::http("limits-api").no_deadline(),
    ];
    for b in stacks {
        let b = b
            .budget(
                Budget::new(backstop::budget::BudgetConfig::default().window(Duration::MAX))
                    .unwrap(),
            )
            .breaker(
                Breaker::new(
                    BreakerConfig::default()
                        .cooldown(Duration::MAX)
                        .no_ratio_rule(),
                )
                .unwrap(),
            );
        let res = b.build().unwrap().layer(slow()).oneshot(get()).await;
        assert_eq!(res.unwrap().status(), 200);
    }
    // A ratio rule's window cannot hold two endless attempts: said, not panicked.
    let refused = Backstop::http("limits-api")
        .no_deadline()
        .attempt_timeout(Duration::MAX)
        .build()
        .unwrap_err();
    assert!(refused.to_string().contains("failure window"), "{refused}");
    let layered = tower::ServiceBuilder::new()
        .layer(DeadlineLayer::new(Duration::MAX))
        .layer(RetryLayer::http())
        .layer(AttemptTimeoutLayer::new(Duration::MAX))
        .layer(BodyTimeoutLayer::new(Some(Duration::MAX)))
        .service(slow());
    assert_eq!(layered.oneshot(get()).await.unwrap().status(), 200);
    // A caller's deadline of `Duration::MAX` on the request itself.
    let mut req = get();
    req.extensions_mut()
        .insert(backstop::Deadline::after(Duration::MAX));
    let res = Backstop::http("limits-api")
        .build()
        .unwrap()
        .layer(slow())
        .oneshot(req)
        .await;
    assert_eq!(res.unwrap().status(), 200);
}
