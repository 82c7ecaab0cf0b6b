//! A policy of one's own: asked after every attempt with what it needs, cloned per call, and
//! composed from the standard policy's parts. On tokio's paused clock with seeded RNGs.

use backstop_backoff::{Backoff, RngSource};
use backstop_classify::Verdict;
use backstop_core::Outcome;
use backstop_core::{BoxError, Dependency, HasExtensions, ReplaySafe};
use backstop_retry::{
    Attempt, DeadlineFit, Error, MaxAttempts, Policy, ReplaySafety, RetryHistory, RetryLayer,
    StandardPolicy, StopReason, Waits,
};
use backstop_timeout::DeadlineLayer;
use http::{Request, Response};
use std::{
    borrow::Cow,
    sync::{
        Arc, Mutex,
        atomic::{AtomicU32, Ordering},
    },
    time::Duration,
};
use tokio::time::Instant;
use tower::{Layer, Service, ServiceBuilder, ServiceExt, service_fn};

type Req = Request<String>;
type Res = Response<String>;

/// Answers from `bodies` in turn (the last repeats), each with status 200, and counts attempts.
fn answers(
    bodies: &'static [&'static str],
    calls: Arc<AtomicU32>,
) -> impl Service<Req, Response = Res, Error = BoxError, Future: Send> + Clone {
    service_fn(move |_req: Req| {
        let n = calls.fetch_add(1, Ordering::SeqCst) as usize;
        let body = bodies[n.min(bodies.len() - 1)];
        async move { Ok::<_, BoxError>(Response::new(body.to_owned())) }
    })
}

fn read_only(body: &str) -> Req {
    let mut req = Request::post("http://tools.local/mcp")
        .body(body.to_owned())
        .unwrap();
    req.extensions_mut().insert(ReplaySafe);
    req
}

const BUSY: &str =
    r#"{"jsonrpc":"2.0","id":1,"error":{"code":-32603,"message":"worker restarted"}}"#;
const OK: &str = r#"{"jsonrpc":"2.0","id":1,"result":{"content":[]}}"#;

/// The docs' policy: a JSON-RPC internal error inside an `Ok` response is judged a lost reply,
/// and the standard policy decides the rest.
#[derive(Clone, Debug)]
struct JsonRpcErrors(StandardPolicy);

impl<R: HasExtensions> Policy<R, Res> for JsonRpcErrors {
    fn retry(&mut self, attempt: &Attempt<'_, R, Res>) -> Result<Duration, StopReason> {
        let internal = attempt.response().is_some_and(|res| {
            serde_json::from_str::<serde_json::Value>(res.body())
                .is_ok_and(|body| body["error"]["code"] == -32603)
        });
        if internal {
            let unknown = Verdict::Retryable {
                outcome: Outcome::Unknown,
                after: None,
            };
            return self.0.retry(&attempt.with_verdict(unknown));
        }
        self.0.retry(attempt)
    }

    fn may_retry(&self, request: &R) -> bool {
        Policy::<R, Res>::may_retry(&self.0, request)
    }
}

fn json_rpc_layer() -> RetryLayer<
    backstop_classify::HttpClassifier,
    backstop_retry::HttpResend,
    Dependency,
    JsonRpcErrors,
> {
    let standard = StandardPolicy::new().rng(RngSource::seeded(7));
    RetryLayer::http()
        .dependency("tools")
        .policy(JsonRpcErrors(standard))
}

#[tokio::test(start_paused = true)]
async fn a_json_rpc_error_inside_an_ok_response_is_retried_by_a_policy_of_ones_own() {
    let calls = Arc::new(AtomicU32::new(0));
    let svc = json_rpc_layer().layer(answers(&[BUSY, OK], calls.clone()));
    let res = svc.oneshot(read_only("{}")).await.unwrap();
    assert_eq!(res.body(), OK);
    assert_eq!(calls.load(Ordering::SeqCst), 2);
    let history = RetryHistory::of(&res).expect("a retried call keeps its history");
    assert_eq!(history.stopped, StopReason::Succeeded);
    assert_eq!(history.attempts.len(), 2);
    assert!(
        history.attempts[0].wait.is_some(),
        "the first attempt waited"
    );
}

#[tokio::test(start_paused = true)]
async fn the_standard_policy_behind_it_still_caps_attempts_and_keeps_replay_safety() {
    // Always busy: three attempts, then the last response with its history.
    let calls = Arc::new(AtomicU32::new(0));
    let svc = json_rpc_layer().layer(answers(&[BUSY], calls.clone()));
    let res = svc.oneshot(read_only("{}")).await.unwrap();
    assert_eq!(calls.load(Ordering::SeqCst), 3);
    let history = RetryHistory::of(&res).unwrap();
    assert_eq!(
        history.stopped,
        StopReason::AttemptsExhausted { max_attempts: 3 }
    );

    // A tool that is not read-only: its effect is unknown, so it is not repeated.
    let calls = Arc::new(AtomicU32::new(0));
    let svc = json_rpc_layer().layer(answers(&[BUSY], calls.clone()));
    let req = Request::post("http://tools.local/mcp")
        .body(String::from("{}"))
        .unwrap();
    let res = svc.oneshot(req).await.unwrap();
    assert_eq!(calls.load(Ordering::SeqCst), 1);
    assert_eq!(
        RetryHistory::of(&res).unwrap().stopped,
        StopReason::NotReplaySafe
    );
}

/// What a policy saw of one attempt.
#[derive(Debug, Clone, PartialEq)]
struct Seen {
    number: u32,
    verdict: Verdict,
    left: Option<Duration>,
    body: Option<String>,
    request: Option<String>,
    dependency: String,
}

/// Records every attempt it is asked about, retries once after 1 s, then stops.
#[derive(Clone)]
struct Recorder {
    seen: Arc<Mutex<Vec<Seen>>>,
    retried: bool,
}

impl Policy<Req, Res> for Recorder {
    fn retry(&mut self, attempt: &Attempt<'_, Req, Res>) -> Result<Duration, StopReason> {
        self.seen.lock().unwrap().push(Seen {
            number: attempt.number(),
            verdict: attempt.verdict(),
            left: attempt.left(),
            body: attempt.response().map(|r| r.body().clone()),
            request: attempt.request().map(|r| r.body().clone()),
            dependency: attempt.dependency().as_str().to_owned(),
        });
        if std::mem::replace(&mut self.retried, true) {
            return Err(StopReason::Policy(Cow::Borrowed(
                "the recorder retries each call once",
            )));
        }
        Ok(Duration::from_secs(1))
    }
}

#[tokio::test(start_paused = true)]
async fn the_policy_is_asked_after_every_attempt_with_the_request_the_result_and_the_time_left() {
    let seen = Arc::new(Mutex::new(Vec::new()));
    let policy = Recorder {
        seen: seen.clone(),
        retried: false,
    };
    let calls = Arc::new(AtomicU32::new(0));
    let retry = RetryLayer::http().dependency("tools").policy(policy);
    let svc = ServiceBuilder::new()
        .layer(DeadlineLayer::new(Duration::from_secs(10)))
        .layer(retry)
        .service(service_fn({
            let calls = calls.clone();
            move |_req: Req| {
                let calls = calls.clone();
                async move {
                    calls.fetch_add(1, Ordering::SeqCst);
                    tokio::time::sleep(Duration::from_secs(2)).await;
                    Ok::<_, BoxError>(Response::new(String::from("fine")))
                }
            }
        }));
    let res = svc.oneshot(read_only("ask")).await.unwrap();
    assert_eq!(res.body(), "fine");
    assert_eq!(calls.load(Ordering::SeqCst), 2, "a success retried once");
    let seen = seen.lock().unwrap().clone();
    let at = |number, left| Seen {
        number,
        verdict: Verdict::Success,
        left: Some(Duration::from_secs(left)),
        body: Some(String::from("fine")),
        request: Some(String::from("ask")),
        dependency: String::from("tools"),
    };
    // 2 s the first attempt, 1 s the wait, 2 s the second: 8 s left, then 5 s.
    assert_eq!(seen, vec![at(1, 8), at(2, 5)]);
    let history = RetryHistory::of(&res).unwrap();
    assert_eq!(
        history.stopped,
        StopReason::Policy(Cow::Borrowed("the recorder retries each call once"))
    );
}

#[tokio::test(start_paused = true)]
async fn each_call_gets_a_fresh_clone_of_the_policy() {
    let seen = Arc::new(Mutex::new(Vec::new()));
    let calls = Arc::new(AtomicU32::new(0));
    let mut svc = RetryLayer::http()
        .dependency("tools")
        .policy(Recorder {
            seen: seen.clone(),
            retried: false,
        })
        .layer(answers(&[OK], calls.clone()));
    // Two calls on one service: each is retried once, whatever the other's clone did.
    for _ in 0..2 {
        svc.ready()
            .await
            .unwrap()
            .call(read_only("{}"))
            .await
            .unwrap();
    }
    assert_eq!(calls.load(Ordering::SeqCst), 4);
    let numbers: Vec<u32> = seen.lock().unwrap().iter().map(|s| s.number).collect();
    assert_eq!(numbers, vec![1, 2, 1, 2]);
}

#[tokio::test(start_paused = true)]
async fn a_policys_own_words_reach_the_error() {
    let seen = Arc::new(Mutex::new(Vec::new()));
    let svc = RetryLayer::http()
        .dependency("tools")
        .policy(Recorder {
            seen,
            retried: true,
        })
        .layer(service_fn(|_req: Req| async {
            Err::<Res, BoxError>(std::io::Error::from(std::io::ErrorKind::ConnectionRefused).into())
        }));
    let err = svc.oneshot(read_only("{}")).await.unwrap_err();
    assert_eq!(
        err.history().expect("a history").stopped,
        StopReason::Policy(Cow::Borrowed("the recorder retries each call once"))
    );
    assert!(
        err.to_string()
            .contains("not retried because the recorder retries each call once"),
        "{err}"
    );
}

/// The standard policy's parts, composed without any budget and with a higher cap: five
/// attempts, one second apart, within the deadline.
#[derive(Clone, Debug)]
struct Patient {
    attempts: MaxAttempts,
}

impl<R: HasExtensions> Policy<R, Res> for Patient {
    fn retry(&mut self, attempt: &Attempt<'_, R, Res>) -> Result<Duration, StopReason> {
        if attempt.verdict() == Verdict::Success {
            return Err(StopReason::Succeeded);
        }
        self.attempts.check(attempt)?;
        ReplaySafety.check(attempt)?;
        let wait = Waits::new(
            Backoff::constant(Duration::from_secs(1)),
            RngSource::seeded(1),
        )
        .for_call()
        .next_wait();
        DeadlineFit.check(attempt, wait)?;
        Ok(wait)
    }
}

#[tokio::test(start_paused = true)]
async fn a_policy_composed_of_the_standard_parts_keeps_each_parts_rule() {
    let times = Arc::new(Mutex::new(Vec::new()));
    let failing = {
        let times = times.clone();
        service_fn(move |_req: Req| {
            times.lock().unwrap().push(Instant::now());
            async {
                Err::<Res, BoxError>(
                    std::io::Error::from(std::io::ErrorKind::ConnectionRefused).into(),
                )
            }
        })
    };
    let patient = Patient {
        attempts: MaxAttempts::new(5).unwrap(),
    };
    let start = Instant::now();
    let err = RetryLayer::http()
        .dependency("tools")
        .policy(patient.clone())
        .layer(failing.clone())
        .oneshot(read_only("{}"))
        .await
        .unwrap_err();
    assert_eq!(
        err.history().expect("a history").stopped,
        StopReason::AttemptsExhausted { max_attempts: 5 }
    );
    let offsets: Vec<u64> = (times.lock().unwrap().iter())
        .map(|t| (*t - start).as_secs())
        .collect();
    assert_eq!(offsets, vec![0, 1, 2, 3, 4]);

    // The deadline part: 2.5 s leaves room for two waits of a second, not a third.
    times.lock().unwrap().clear();
    let retry = RetryLayer::http().dependency("tools").policy(patient);
    let err = ServiceBuilder::new()
        .layer(DeadlineLayer::new(Duration::from_millis(2500)))
        .layer(retry)
        .service(failing)
        .oneshot(read_only("{}"))
        .await
        .unwrap_err()
        .downcast::<Error>()
        .unwrap();
    assert!(
        matches!(
            err.history().expect("a history").stopped,
            StopReason::DeadlineTooClose { .. }
        ),
        "{:?}",
        err.history().expect("a history").stopped
    );
    assert_eq!(times.lock().unwrap().len(), 3);
}

#[test]
fn zero_attempts_is_refused_with_the_setting_to_change() {
    let err = MaxAttempts::new(0).unwrap_err();
    assert!(err.to_string().contains("max_attempts"), "{err}");
    assert!(StandardPolicy::new().max_attempts(0).is_err());
}

/// A tool runner's own error: the tool was busy and did nothing. The HTTP classifier does not
/// know it, so it judges it fatal with an unknown outcome.
#[derive(Debug)]
struct ToolBusy;

impl std::fmt::Display for ToolBusy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("the tool was busy and did nothing")
    }
}

impl std::error::Error for ToolBusy {}

/// Reads the attempt's error: `ToolBusy` is judged not sent and retryable, and the standard
/// policy decides the rest.
#[derive(Clone, Debug)]
struct BusyIsNotSent(StandardPolicy);

impl<R: HasExtensions> Policy<R, Res> for BusyIsNotSent {
    fn retry(&mut self, attempt: &Attempt<'_, R, Res>) -> Result<Duration, StopReason> {
        if attempt.error().is_some_and(|e| e.is::<ToolBusy>()) {
            let retryable = Verdict::Retryable {
                outcome: Outcome::NotSent,
                after: None,
            };
            return self.0.retry(&attempt.with_verdict(retryable));
        }
        self.0.retry(attempt)
    }
}

/// Busy on the first attempt, then answers; counts attempts.
fn busy_once(
    calls: Arc<AtomicU32>,
) -> impl Service<Req, Response = Res, Error = BoxError, Future: Send> + Clone {
    service_fn(move |_req: Req| {
        let first = calls.fetch_add(1, Ordering::SeqCst) == 0;
        async move {
            if first {
                return Err::<Res, BoxError>(Box::new(ToolBusy));
            }
            Ok(Response::new(String::from(OK)))
        }
    })
}

#[tokio::test(start_paused = true)]
async fn a_policy_reads_the_attempts_error_and_retries_one_the_classifier_calls_fatal() {
    // A POST with no key and no replay-safe mark: only an error known not to have been acted
    // on may be repeated.
    let unmarked = || {
        Request::post("http://tools.local/run")
            .body(String::from("{}"))
            .unwrap()
    };
    let calls = Arc::new(AtomicU32::new(0));
    let res = RetryLayer::http()
        .dependency("tools")
        .policy(BusyIsNotSent(StandardPolicy::new()))
        .layer(busy_once(calls.clone()))
        .oneshot(unmarked())
        .await
        .unwrap();
    assert_eq!(res.body(), OK);
    assert_eq!(calls.load(Ordering::SeqCst), 2, "the busy attempt retried");

    // The standard policy alone follows the classifier: one attempt, and the error says so.
    let calls = Arc::new(AtomicU32::new(0));
    let err = RetryLayer::http()
        .dependency("tools")
        .layer(busy_once(calls.clone()))
        .oneshot(unmarked())
        .await
        .unwrap_err();
    assert_eq!(calls.load(Ordering::SeqCst), 1);
    assert!(err.to_string().contains("the tool was busy"), "{err}");
}

/// What a policy saw of an attempt's result: whether it had a response, and its error's words.
type Side = (bool, Option<String>);

/// Records each attempt's side, and never retries.
#[derive(Clone, Default)]
struct Sides(Arc<Mutex<Vec<Side>>>);

impl Policy<Req, Res> for Sides {
    fn retry(&mut self, attempt: &Attempt<'_, Req, Res>) -> Result<Duration, StopReason> {
        let error = attempt.error().map(|e| e.to_string());
        self.0
            .lock()
            .unwrap()
            .push((attempt.response().is_some(), error));
        Err(StopReason::Succeeded)
    }
}

#[tokio::test(start_paused = true)]
async fn an_attempt_has_a_response_or_an_error_never_both() {
    let sides = Sides::default();
    let calls = Arc::new(AtomicU32::new(0));
    let mut svc = RetryLayer::http()
        .dependency("tools")
        .policy(sides.clone())
        .layer(busy_once(calls));
    let _ = svc.ready().await.unwrap().call(read_only("{}")).await;
    let _ = svc.ready().await.unwrap().call(read_only("{}")).await;
    assert_eq!(
        *sides.0.lock().unwrap(),
        vec![
            (
                false,
                Some(String::from("the tool was busy and did nothing"))
            ),
            (true, None),
        ]
    );
}
