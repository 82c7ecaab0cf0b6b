//! The retry core against real hyper servers on 127.0.0.1, through hyper-util's client.
//!
//! These run on the real clock with short, bounded durations: a paused clock auto-advances
//! while a task waits on a socket and would fire the timeouts early.

use backstop::{
    BoxError, Outcome,
    backoff::{Backoff, RngSource},
    classify::HttpClassifier,
    retry::{RetryHistory, RetryLayer, StopReason},
    timeout::{AttemptTimeoutLayer, DeadlineLayer},
};
use backstop_testkit::{Action, Seen, TestServer, refused_addr};
use bytes::Bytes;
use http::{Request, Response, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper_util::{client::legacy::Client, rt::TokioExecutor};
use std::{
    collections::HashMap,
    sync::{Arc, Mutex},
    time::Duration,
};
use tokio::time::Instant;
use tower::{Layer, Service, ServiceBuilder, ServiceExt};

type Body = Full<Bytes>;

fn client() -> Client<hyper_util::client::legacy::connect::HttpConnector, Body> {
    Client::builder(TokioExecutor::new()).build_http()
}

/// Small waits so the suite stays fast: full jitter from 10 ms up to 40 ms.
fn fast_backoff() -> Backoff {
    Backoff::full_jitter(Duration::from_millis(10), Duration::from_millis(40)).unwrap()
}

/// The stack of the README: deadline -> retry -> attempt timeout -> hyper-util's client.
fn stack(
    deadline: Duration,
    attempt: Duration,
) -> impl Service<Request<Body>, Response = Response<Incoming>, Error = BoxError, Future: Send>
+ Clone
+ Send {
    ServiceBuilder::new()
        .layer(DeadlineLayer::new(deadline))
        .layer(
            RetryLayer::http()
                .dependency("http-retry-payments-api")
                .backoff(fast_backoff())
                .rng(RngSource::seeded(11)),
        )
        .layer(AttemptTimeoutLayer::new(attempt))
        .service(client())
}

fn post(url: String, key: Option<&str>) -> Request<Body> {
    let mut b = Request::post(url).header("content-type", "application/json");
    if let Some(k) = key {
        b = b.header("idempotency-key", k);
    }
    b.body(Full::new(Bytes::from_static(
        br#"{"order_id":"A-7","amount":49}"#,
    )))
    .unwrap()
}

fn get(url: String) -> Request<Body> {
    Request::get(url).body(Full::default()).unwrap()
}

async fn text(res: Response<Incoming>) -> String {
    String::from_utf8(res.into_body().collect().await.unwrap().to_bytes().to_vec()).unwrap()
}

fn retry_error(e: BoxError) -> Box<backstop::Error> {
    match e.downcast::<backstop::Error>() {
        Ok(e) => e,
        Err(e) => panic!("expected a got {e}"),
    }
}

/// A payment service that books the refund, then loses the reply to the first request. It
/// remembers idempotency keys (as a payment API that supports them does) and replays the
/// stored result for a repeated key.
async fn lossy_payments() -> (TestServer, Arc<Mutex<Vec<String>>>) {
    let refunds: Arc<Mutex<Vec<String>>> = Arc::default();
    let results: Arc<Mutex<HashMap<String, String>>> = Arc::default();
    let booked = refunds.clone();
    let server = TestServer::start(move |seen: &Seen| {
        if let Some(key) = seen.header("idempotency-key")
            && let Some(stored) = results.lock().unwrap().get(key)
        {
            return Action::respond(200, &[("idempotent-replayed", "true")], stored.clone());
        }
        let mut refunds = booked.lock().unwrap();
        refunds.push(String::from_utf8_lossy(&seen.body).into_owned());
        let result = format!(r#"{{"refund_id":"R{}"}}"#, refunds.len());
        if let Some(key) = seen.header("idempotency-key") {
            results
                .lock()
                .unwrap()
                .insert(key.to_owned(), result.clone());
        }
        if seen.index == 0 {
            Action::DropReply
        } else {
            Action::respond(200, &[], result)
        }
    })
    .await;
    (server, refunds)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lost_reply_to_a_post_without_a_key_is_not_repeated() {
    let (server, refunds) = lossy_payments().await;
    let err = stack(Duration::from_secs(5), Duration::from_secs(2))
        .oneshot(post(server.url("/refunds"), None))
        .await
        .unwrap_err();
    let err = retry_error(err);
    assert_eq!(server.requests(), 1);
    assert_eq!(refunds.lock().unwrap().len(), 1, "exactly one refund");
    assert_eq!(err.outcome(), Outcome::Unknown);
    assert_eq!(
        err.history().expect("a history").stopped,
        StopReason::NotReplaySafe
    );
    let text = err.to_string();
    assert!(
        text.starts_with("the call to http-retry-payments-api may or may not have taken effect"),
        "{text}"
    );
    assert!(
        text.contains("check its status before repeating it"),
        "{text}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lost_reply_to_a_keyed_post_is_retried_and_the_original_result_comes_back() {
    let (server, refunds) = lossy_payments().await;
    let res = stack(Duration::from_secs(5), Duration::from_secs(2))
        .oneshot(post(server.url("/refunds"), Some("refund-A-7")))
        .await
        .unwrap();
    assert_eq!(res.status(), StatusCode::OK);
    assert_eq!(res.headers()["idempotent-replayed"], "true");
    let history = RetryHistory::of(&res).unwrap().clone();
    assert_eq!(history.attempts.len(), 2);
    assert_eq!(history.attempts[0].verdict.outcome(), Outcome::Unknown);
    assert_eq!(text(res).await, r#"{"refund_id":"R1"}"#);
    assert_eq!(server.requests(), 2);
    assert_eq!(refunds.lock().unwrap().len(), 1, "one refund, not two");
    let keys: Vec<_> = server
        .seen()
        .iter()
        .map(|s| s.header("idempotency-key").map(str::to_owned))
        .collect();
    assert_eq!(keys, vec![Some("refund-A-7".to_owned()); 2]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_429_with_retry_after_in_seconds_is_honoured() {
    let server = TestServer::start(|seen: &Seen| match seen.index {
        0 => Action::respond(429, &[("retry-after", "1")], ""),
        _ => Action::status(200),
    })
    .await;
    // A backoff far longer than the deadline: only the server's Retry-After (capped at 150 ms
    // here to keep the test short) can make the retry fit.
    let svc = ServiceBuilder::new()
        .layer(DeadlineLayer::new(Duration::from_secs(5)))
        .layer(
            RetryLayer::http()
                .classifier(HttpClassifier::new().max_retry_after(Duration::from_millis(150)))
                .backoff(Backoff::constant(Duration::from_secs(60))),
        )
        .service(client());
    let start = Instant::now();
    let res = svc
        .oneshot(post(server.url("/labels"), None))
        .await
        .unwrap();
    assert_eq!(res.status(), StatusCode::OK);
    assert_eq!(
        server.requests(),
        2,
        "a 429 did nothing, so even a POST is retried"
    );
    let h = RetryHistory::of(&res).unwrap();
    assert_eq!(h.attempts[0].wait, Some(Duration::from_millis(150)));
    assert!(start.elapsed() >= Duration::from_millis(150));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_503_with_retry_after_as_a_date_is_honoured() {
    let server = TestServer::start(|seen: &Seen| match seen.index {
        0 => {
            let at = std::time::SystemTime::now() + Duration::from_secs(2);
            Action::respond(503, &[("retry-after", &httpdate::fmt_http_date(at))], "")
        }
        1 => Action::respond(503, &[("retry-after", "Thu, 01 Jan 1970 00:00:00 GMT")], ""),
        _ => Action::status(200),
    })
    .await;
    let svc = RetryLayer::http()
        .classifier(HttpClassifier::new().max_retry_after(Duration::from_millis(200)))
        .backoff(Backoff::constant(Duration::from_secs(60)))
        .layer(client());
    let res = svc.oneshot(get(server.url("/status"))).await.unwrap();
    assert_eq!(res.status(), StatusCode::OK);
    let waits: Vec<_> = RetryHistory::of(&res)
        .unwrap()
        .attempts
        .iter()
        .map(|a| a.wait)
        .collect();
    // The future date is at least a second away (HTTP dates have whole seconds), so the cap
    // applies; the date in the past means "now".
    assert_eq!(
        waits,
        vec![Some(Duration::from_millis(200)), Some(Duration::ZERO), None]
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_400_is_returned_at_once() {
    let server = TestServer::start(|_: &Seen| {
        Action::respond(
            400,
            &[("content-type", "application/json")],
            r#"{"error":"address_unverifiable"}"#,
        )
    })
    .await;
    let res = stack(Duration::from_secs(5), Duration::from_secs(2))
        .oneshot(post(server.url("/labels"), Some("k")))
        .await
        .unwrap();
    assert_eq!(res.status(), StatusCode::BAD_REQUEST);
    assert_eq!(server.requests(), 1);
    assert_eq!(
        RetryHistory::of(&res).unwrap().stopped,
        StopReason::NotRetryable
    );
    assert_eq!(text(res).await, r#"{"error":"address_unverifiable"}"#);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_503s_make_three_attempts_and_return_the_last_response() {
    let server = TestServer::start(|_: &Seen| Action::respond(503, &[], "down")).await;
    let res = stack(Duration::from_secs(5), Duration::from_secs(2))
        .oneshot(get(server.url("/rates")))
        .await
        .unwrap();
    assert_eq!(res.status(), StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(server.requests(), 3);
    let h = RetryHistory::of(&res).unwrap();
    assert_eq!(h.stopped, StopReason::AttemptsExhausted { max_attempts: 3 });
    assert_eq!(text(res).await, "down");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hanging_server_meets_the_attempt_timeout() {
    let server = TestServer::start(|_: &Seen| Action::Hang).await;
    let start = Instant::now();
    let err = stack(Duration::from_secs(5), Duration::from_millis(100))
        .oneshot(get(server.url("/slow")))
        .await
        .unwrap_err();
    let elapsed = start.elapsed();
    let err = retry_error(err);
    assert_eq!(server.requests(), 3);
    assert_eq!(err.attempts(), 3);
    assert_eq!(err.outcome(), Outcome::Unknown);
    assert!(
        err.to_string()
            .contains("http-retry-payments-api did not reply within the 100 ms attempt timeout"),
        "{err}"
    );
    // Three 100 ms attempts and two waits of at most 40 ms, with slack for a loaded machine.
    assert!(elapsed >= Duration::from_millis(300), "{elapsed:?}");
    assert!(elapsed < Duration::from_secs(3), "{elapsed:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hanging_server_meets_the_deadline() {
    let server = TestServer::start(|_: &Seen| Action::Hang).await;
    let start = Instant::now();
    let err = stack(Duration::from_millis(250), Duration::from_millis(200))
        .oneshot(get(server.url("/slow")))
        .await
        .unwrap_err();
    let elapsed = start.elapsed();
    let err = retry_error(err);
    // The first attempt times out at 200 ms; the second is cut to what is left of 250 ms and
    // ends exactly at the deadline (or the wait does not fit and the layer stops).
    assert!(err.attempts() <= 2, "{err}");
    assert_eq!(err.outcome(), Outcome::Unknown);
    assert!(elapsed >= Duration::from_millis(200), "{elapsed:?}");
    assert!(elapsed < Duration::from_secs(2), "{elapsed:?}");
    let text = err.to_string();
    assert!(text.contains("deadline"), "{text}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_connection_is_not_sent_and_is_retried_even_for_a_post() {
    let addr = refused_addr().await;
    let err = stack(Duration::from_secs(5), Duration::from_secs(1))
        .oneshot(post(format!("http://{addr}/refunds"), None))
        .await
        .unwrap_err();
    let err = retry_error(err);
    assert_eq!(err.attempts(), 3);
    assert_eq!(err.outcome(), Outcome::NotSent);
    assert_eq!(
        err.history().expect("a history").stopped,
        StopReason::AttemptsExhausted { max_attempts: 3 }
    );
    assert!(err.to_string().contains("safe to try again later"), "{err}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_nested_stacks_make_three_attempts_not_twenty_seven() {
    let server = TestServer::start(|_: &Seen| Action::status(503)).await;
    let retry = || {
        RetryLayer::http()
            .backoff(fast_backoff())
            .rng(RngSource::seeded(5))
    };
    // An HTTP client wrapper, a tool wrapper and an agent loop, each with its own retry layer.
    let svc = ServiceBuilder::new()
        .layer(retry())
        .layer(retry())
        .layer(retry())
        .layer(AttemptTimeoutLayer::new(Duration::from_secs(1)))
        .service(client());
    let res = svc.oneshot(get(server.url("/rates"))).await.unwrap();
    assert_eq!(res.status(), StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(server.requests(), 3);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn clones_of_the_stack_serve_concurrent_calls() {
    // Each path fails once, then answers.
    let counts: Arc<Mutex<HashMap<String, u32>>> = Arc::default();
    let server = TestServer::start(move |seen: &Seen| {
        let mut counts = counts.lock().unwrap();
        let n = counts.entry(seen.path.clone()).or_default();
        *n += 1;
        if *n == 1 {
            Action::status(503)
        } else {
            Action::status(200)
        }
    })
    .await;
    let svc = stack(Duration::from_secs(5), Duration::from_secs(1));
    let mut tasks = tokio::task::JoinSet::new();
    for i in 0..20 {
        let svc = svc.clone();
        let url = server.url(&format!("/rates/{i}"));
        tasks.spawn(async move { svc.oneshot(get(url)).await.map(|r| r.status()) });
    }
    let mut ok = 0;
    while let Some(r) = tasks.join_next().await {
        if r.unwrap().unwrap() == StatusCode::OK {
            ok += 1;
        }
    }
    assert_eq!(ok, 20, "every call succeeds on its second attempt");
    assert_eq!(server.requests(), 40);
}

/// A policy of one's own around the standard one: an MCP server's JSON-RPC internal error,
/// carried in a `200 OK`, is retried like a lost reply (so only for a replay-safe call).
#[derive(Clone)]
struct JsonRpcErrors(backstop::retry::StandardPolicy);

impl<R: backstop::HasExtensions, B: http_body::Body>
    backstop::retry::Policy<R, Response<backstop::timeout::TimedBody<B>>> for JsonRpcErrors
{
    fn retry(
        &mut self,
        attempt: &backstop::retry::Attempt<'_, R, Response<backstop::timeout::TimedBody<B>>>,
    ) -> Result<Duration, StopReason> {
        let internal = attempt
            .response()
            .and_then(|res| res.headers().get("x-jsonrpc-error"))
            .is_some_and(|code| code == "-32603");
        if internal {
            let unknown = backstop::classify::Verdict::Retryable {
                outcome: Outcome::Unknown,
                after: None,
            };
            return self.0.retry(&attempt.with_verdict(unknown));
        }
        self.0.retry(attempt)
    }
}

#[tokio::test]
async fn the_builders_stack_asks_a_policy_of_ones_own() {
    // The first answer is a JSON-RPC internal error in a 200, the next a result.
    let server = TestServer::start(|s: &Seen| {
        if s.index == 0 {
            Action::respond(
                200,
                &[("x-jsonrpc-error", "-32603")],
                r#"{"error":{"code":-32603}}"#,
            )
        } else {
            Action::respond(200, &[], r#"{"result":{}}"#)
        }
    })
    .await;
    let stack = backstop::Backstop::http("http-retry-tools")
        .backoff(fast_backoff())
        .rng(RngSource::seeded(5))
        .policy(JsonRpcErrors)
        .build()
        .unwrap()
        .layer(client());
    // A read: replay-safe, so the internal error is retried.
    let req = Request::get(server.url("/mcp"))
        .body(Body::default())
        .unwrap();
    let res = stack.clone().oneshot(req).await.unwrap();
    let history = RetryHistory::of(&res)
        .expect("retried, so it keeps its history")
        .clone();
    let body = res.into_body().collect().await.unwrap().to_bytes();
    assert_eq!(&body[..], br#"{"result":{}}"#);
    assert_eq!(history.attempts.len(), 2);
    assert_eq!(history.stopped, StopReason::Succeeded);
    assert_eq!(server.requests(), 2);
}
