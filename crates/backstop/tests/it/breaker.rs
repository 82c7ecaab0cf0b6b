//! The breaker's state machine on paused time, its fail-fast path, and its place under the
//! retry layer.

use backstop_backoff::{Backoff, RngSource};
use backstop_breaker::{
    Breaker, BreakerConfig, BreakerLayer, CircuitOpen, CircuitState, CircuitTransition,
};
use backstop_budget::Budget;
use backstop_core::{AttemptTimedOut, Dependency};
use backstop_retry::{RetryLayer, StopReason};
use http::{Request, Response};
use std::{
    future::Future,
    io,
    pin::pin,
    sync::{
        Arc, Mutex,
        atomic::{AtomicUsize, Ordering},
    },
    task::{Context, Poll, Waker},
    time::Duration,
};
use tokio::time::{Instant, advance};
use tower::{Layer, Service, ServiceExt, service_fn};

/// What the dependency answers. `Hang` never answers.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Answer {
    Ok,
    Status(u16),
    Timeout,
    Slow(Duration),
    Hang,
}

/// A dependency whose answer the test switches, counting the calls that reach it.
#[derive(Clone)]
struct Dep {
    answer: Arc<Mutex<Answer>>,
    calls: Arc<AtomicUsize>,
}

type Req = Request<()>;
type Res = Response<()>;

impl Dep {
    fn new(a: Answer) -> Self {
        Dep {
            answer: Arc::new(Mutex::new(a)),
            calls: Arc::default(),
        }
    }
    fn set(&self, a: Answer) {
        *self.answer.lock().unwrap() = a;
    }
    fn calls(&self) -> usize {
        self.calls.load(Ordering::SeqCst)
    }
    fn service(
        &self,
    ) -> impl Service<Req, Response = Res, Error = io::Error, Future: Send> + Clone + Send + use<>
    {
        let this = self.clone();
        service_fn(move |_req: Req| {
            this.calls.fetch_add(1, Ordering::SeqCst);
            let a = *this.answer.lock().unwrap();
            async move {
                match a {
                    Answer::Ok => Ok(Response::new(())),
                    Answer::Status(s) => Ok(Response::builder().status(s).body(()).unwrap()),
                    Answer::Timeout => Err(io::Error::new(
                        io::ErrorKind::TimedOut,
                        AttemptTimedOut::new(None, Duration::from_secs(1)),
                    )),
                    Answer::Slow(d) => {
                        tokio::time::sleep(d).await;
                        Ok(Response::new(()))
                    }
                    Answer::Hang => std::future::pending().await,
                }
            }
        })
    }
}

fn carrier() -> Dependency {
    Dependency::new("breaker-carrier-api")
}

/// The transitions a hook saw, as (from, to).
type Seen = Arc<Mutex<Vec<(CircuitState, CircuitState)>>>;

fn recorder() -> (Seen, impl Fn(&CircuitTransition) + Send + Sync + 'static) {
    let seen: Seen = Arc::default();
    let s = seen.clone();
    (seen, move |t: &CircuitTransition| {
        assert_eq!(t.dependency.as_str(), "breaker-carrier-api");
        s.lock().unwrap().push((t.from, t.to));
    })
}

async fn call<S>(svc: &S) -> Result<Res, backstop_core::BoxError>
where
    S: Service<Req, Response = Res, Error: Into<backstop_core::BoxError>> + Clone,
{
    svc.clone()
        .oneshot(Request::new(()))
        .await
        .map_err(Into::into)
}

fn open_error(e: backstop_core::BoxError) -> CircuitOpen {
    e.downcast_ref::<CircuitOpen>()
        .cloned()
        .unwrap_or_else(|| panic!("not CircuitOpen: {e}"))
}

#[tokio::test(start_paused = true)]
async fn opens_after_consecutive_failures_and_fails_fast_without_touching_the_dependency() {
    let (transitions, hook) = recorder();
    let breaker = Breaker::new(BreakerConfig::default().on_transition(hook)).unwrap();
    let dep = Dep::new(Answer::Status(503));
    let svc = backstop::breaker::BreakerLayer::http(breaker.clone())
        .dependency("breaker-carrier-api")
        .layer(dep.service());

    for _ in 0..5 {
        assert_eq!(call(&svc).await.unwrap().status(), 503);
    }
    assert_eq!(breaker.state(&carrier()), CircuitState::Open);
    let before = dep.calls();
    let start = Instant::now();
    for _ in 0..100 {
        let e = open_error(call(&svc).await.unwrap_err());
        assert_eq!(e.state(), CircuitState::Open);
    }
    assert_eq!(
        dep.calls(),
        before,
        "an open circuit never calls the dependency"
    );
    assert_eq!(start.elapsed(), Duration::ZERO, "and never waits");

    advance(Duration::from_secs(3)).await;
    let e = call(&svc).await.unwrap_err();
    assert_eq!(
        e.to_string(),
        "breaker-carrier-api is unavailable (circuit open); do not retry now; try again in 27 s"
    );
    assert_eq!(
        *transitions.lock().unwrap(),
        vec![(CircuitState::Closed, CircuitState::Open)]
    );
}

/// Growth is off unless asked for: a short cooldown stays what it is after a failed trial.
#[tokio::test(start_paused = true)]
async fn a_failed_trial_reopens_for_the_same_cooldown_by_default() {
    let config = BreakerConfig::default()
        .consecutive_failures(2)
        .cooldown(Duration::from_millis(100));
    let breaker = Breaker::new(config).unwrap();
    let dep = Dep::new(Answer::Status(500));
    let svc = backstop::breaker::BreakerLayer::http(breaker.clone())
        .dependency("breaker-carrier-api")
        .layer(dep.service());
    call(&svc).await.unwrap();
    call(&svc).await.unwrap();
    for _ in 0..3 {
        assert_eq!(
            breaker.stats(&carrier()).retry_in,
            Some(Duration::from_millis(100))
        );
        advance(Duration::from_millis(100)).await;
        // The trial fails: open again, for the same 100 ms.
        assert_eq!(call(&svc).await.unwrap().status(), 500);
        assert_eq!(breaker.state(&carrier()), CircuitState::Open);
    }
}

#[tokio::test(start_paused = true)]
async fn a_successful_trial_closes_and_a_failed_one_reopens_with_a_growing_cooldown() {
    let (transitions, hook) = recorder();
    let config = BreakerConfig::default()
        .consecutive_failures(2)
        .cooldown(Duration::from_secs(10))
        .cooldown_growth(Duration::from_secs(25))
        .on_transition(hook);
    let breaker = Breaker::new(config).unwrap();
    let dep = Dep::new(Answer::Status(500));
    let svc = backstop::breaker::BreakerLayer::http(breaker.clone())
        .dependency("breaker-carrier-api")
        .layer(dep.service());

    call(&svc).await.unwrap();
    call(&svc).await.unwrap();
    assert_eq!(
        breaker.stats(&carrier()).retry_in,
        Some(Duration::from_secs(10))
    );
    advance(Duration::from_secs(10)).await;
    // The trial fails: open again, for 20 s this time.
    assert_eq!(call(&svc).await.unwrap().status(), 500);
    assert_eq!(breaker.state(&carrier()), CircuitState::Open);
    assert_eq!(
        breaker.stats(&carrier()).retry_in,
        Some(Duration::from_secs(20))
    );
    advance(Duration::from_secs(20)).await;
    call(&svc).await.unwrap();
    // Growth stops at the maximum.
    assert_eq!(
        breaker.stats(&carrier()).retry_in,
        Some(Duration::from_secs(25))
    );
    advance(Duration::from_secs(25)).await;
    dep.set(Answer::Ok);
    call(&svc).await.unwrap();
    assert_eq!(breaker.state(&carrier()), CircuitState::Closed);
    // After closing, the cooldown starts from the beginning again.
    dep.set(Answer::Status(500));
    call(&svc).await.unwrap();
    call(&svc).await.unwrap();
    assert_eq!(
        breaker.stats(&carrier()).retry_in,
        Some(Duration::from_secs(10))
    );

    use CircuitState::*;
    assert_eq!(
        *transitions.lock().unwrap(),
        vec![
            (Closed, Open),
            (Open, HalfOpen),
            (HalfOpen, Open),
            (Open, HalfOpen),
            (HalfOpen, Open),
            (Open, HalfOpen),
            (HalfOpen, Closed),
            (Closed, Open),
        ]
    );
}

#[tokio::test(start_paused = true)]
async fn half_open_admits_exactly_the_trial_calls_and_fails_the_rest_fast() {
    let breaker = Breaker::new(
        BreakerConfig::default()
            .consecutive_failures(1)
            .trial_calls(3),
    )
    .unwrap();
    let dep = Dep::new(Answer::Status(503));
    let svc = backstop::breaker::BreakerLayer::http(breaker.clone())
        .dependency("breaker-carrier-api")
        .layer(dep.service());
    call(&svc).await.unwrap();
    advance(Duration::from_secs(30)).await;

    dep.set(Answer::Slow(Duration::from_secs(1)));
    let before = dep.calls();
    let mut callers = tokio::task::JoinSet::new();
    for _ in 0..10 {
        let svc = svc.clone();
        callers.spawn(async move { call(&svc).await.map(|r| r.status().as_u16()) });
    }
    let (mut ok, mut busy) = (0, 0);
    while let Some(r) = callers.join_next().await {
        match r.unwrap() {
            Ok(200) => ok += 1,
            Err(e) => {
                assert_eq!(open_error(e).state(), CircuitState::HalfOpen);
                busy += 1;
            }
            Ok(other) => panic!("{other}"),
        }
    }
    assert_eq!((ok, busy), (3, 7));
    assert_eq!(dep.calls() - before, 3);
    assert_eq!(breaker.state(&carrier()), CircuitState::Closed);
}

fn poll_once<F: Future>(f: std::pin::Pin<&mut F>) -> Poll<F::Output> {
    f.poll(&mut Context::from_waker(Waker::noop()))
}

#[tokio::test(start_paused = true)]
async fn a_cancelled_trial_gives_its_slot_back() {
    let breaker = Breaker::new(BreakerConfig::default().consecutive_failures(1)).unwrap();
    let dep = Dep::new(Answer::Status(503));
    let svc = backstop::breaker::BreakerLayer::http(breaker.clone())
        .dependency("breaker-carrier-api")
        .layer(dep.service());
    call(&svc).await.unwrap();
    cancelled_trials_give_their_slots_back(&svc, &breaker, &dep).await;
}

/// With the circuit open: after the cooldown, three trials are admitted one at a time, hang and
/// are dropped by their callers; while each is in flight other calls fail fast. Each released its
/// slot, so the next call is admitted and its success closes the circuit.
async fn cancelled_trials_give_their_slots_back<S>(svc: &S, breaker: &Breaker, dep: &Dep)
where
    S: Service<Req, Response = Res, Error: Into<backstop_core::BoxError>> + Clone,
{
    advance(Duration::from_secs(30)).await;
    dep.set(Answer::Hang);
    for _ in 0..3 {
        let mut s = svc.clone();
        let fut = s.call(Request::new(()));
        let mut fut = pin!(fut);
        assert!(poll_once(fut.as_mut()).is_pending());
        assert_eq!(breaker.state(&carrier()), CircuitState::HalfOpen);
        let e = call(svc).await.unwrap_err();
        // Alone, the breaker's own error comes back; under the retry layer, as its cause.
        let open = match e.downcast::<backstop_retry::Error>() {
            Ok(r) => std::error::Error::source(&*r)
                .unwrap()
                .downcast_ref::<CircuitOpen>()
                .cloned()
                .unwrap(),
            Err(e) => open_error(e),
        };
        assert_eq!(open.state(), CircuitState::HalfOpen);
    }
    dep.set(Answer::Ok);
    assert_eq!(call(svc).await.unwrap().status(), 200);
    assert_eq!(breaker.state(&carrier()), CircuitState::Closed);
    let s = breaker.stats(&carrier());
    assert_eq!(
        (s.consecutive_failures, s.failures),
        (0, 0),
        "a cancellation is no failure"
    );
}

#[tokio::test(start_paused = true)]
async fn a_cancelled_call_while_closed_is_no_failure() {
    let breaker = Breaker::new(BreakerConfig::default().consecutive_failures(1)).unwrap();
    let dep = Dep::new(Answer::Hang);
    let svc = backstop::breaker::BreakerLayer::http(breaker.clone())
        .dependency("breaker-carrier-api")
        .layer(dep.service());
    for _ in 0..10 {
        let mut s = svc.clone();
        let fut = s.call(Request::new(()));
        let mut fut = pin!(fut);
        assert!(poll_once(fut.as_mut()).is_pending());
    }
    assert_eq!(breaker.state(&carrier()), CircuitState::Closed);
}

#[tokio::test(start_paused = true)]
async fn opens_on_the_failure_ratio_when_failures_are_not_consecutive() {
    let breaker = Breaker::new(BreakerConfig::default()).unwrap();
    let dep = Dep::new(Answer::Ok);
    let svc = backstop::breaker::BreakerLayer::http(breaker.clone())
        .dependency("breaker-carrier-api")
        .layer(dep.service());
    // Alternate success and failure: never 5 in a row.
    for i in 0..19 {
        dep.set(if i % 2 == 1 {
            Answer::Timeout
        } else {
            Answer::Ok
        });
        let _ = call(&svc).await;
        assert_eq!(breaker.state(&carrier()), CircuitState::Closed, "call {i}");
    }
    let s = breaker.stats(&carrier());
    assert_eq!((s.calls, s.failures), (19, 9));
    // The 20th call fails: 10 failures of 20 calls is 50 %.
    dep.set(Answer::Timeout);
    let _ = call(&svc).await;
    assert_eq!(breaker.state(&carrier()), CircuitState::Open);
}

#[tokio::test(start_paused = true)]
async fn old_failures_leave_the_window() {
    let breaker = Breaker::new(BreakerConfig::default().no_consecutive_rule()).unwrap();
    let dep = Dep::new(Answer::Status(502));
    let svc = backstop::breaker::BreakerLayer::http(breaker.clone())
        .dependency("breaker-carrier-api")
        .layer(dep.service());
    for _ in 0..15 {
        call(&svc).await.unwrap();
    }
    advance(Duration::from_secs(31)).await;
    dep.set(Answer::Ok);
    for _ in 0..10 {
        call(&svc).await.unwrap();
    }
    dep.set(Answer::Status(502));
    for _ in 0..5 {
        call(&svc).await.unwrap();
    }
    // 5 failures in the last 15 calls (the first 15 failures left the window).
    assert_eq!(breaker.state(&carrier()), CircuitState::Closed);
}

#[tokio::test(start_paused = true)]
async fn client_errors_are_successes_for_the_breaker() {
    let breaker = Breaker::new(BreakerConfig::default().consecutive_failures(2)).unwrap();
    let dep = Dep::new(Answer::Status(400));
    let svc = backstop::breaker::BreakerLayer::http(breaker.clone())
        .dependency("breaker-carrier-api")
        .layer(dep.service());
    for status in [400, 404, 409, 422, 400, 401, 403, 400] {
        dep.set(Answer::Status(status));
        call(&svc).await.unwrap();
    }
    assert_eq!(breaker.state(&carrier()), CircuitState::Closed);
    assert_eq!(breaker.stats(&carrier()).failures, 0);
}

#[tokio::test(start_paused = true)]
async fn slow_calls_count_as_failures_when_configured() {
    let config = BreakerConfig::default()
        .consecutive_failures(3)
        .slow_call(Duration::from_millis(500));
    let breaker = Breaker::new(config).unwrap();
    let dep = Dep::new(Answer::Slow(Duration::from_millis(400)));
    let svc = backstop::breaker::BreakerLayer::http(breaker.clone())
        .dependency("breaker-carrier-api")
        .layer(dep.service());
    for _ in 0..5 {
        call(&svc).await.unwrap();
    }
    assert_eq!(breaker.state(&carrier()), CircuitState::Closed);
    dep.set(Answer::Slow(Duration::from_millis(600)));
    for _ in 0..3 {
        call(&svc).await.unwrap();
    }
    assert_eq!(breaker.state(&carrier()), CircuitState::Open);
}

#[tokio::test(start_paused = true)]
async fn isolate_and_reset_by_hand() {
    let (transitions, hook) = recorder();
    let breaker = Breaker::new(BreakerConfig::default().on_transition(hook)).unwrap();
    let dep = Dep::new(Answer::Ok);
    let svc = backstop::breaker::BreakerLayer::http(breaker.clone())
        .dependency("breaker-carrier-api")
        .layer(dep.service());
    breaker.isolate(&carrier());
    let e = call(&svc).await.unwrap_err();
    assert!(
        e.to_string()
            .ends_with("(circuit isolated by an operator); do not retry now; tell the user"),
        "{e}"
    );
    advance(Duration::from_secs(3600)).await;
    assert_eq!(
        open_error(call(&svc).await.unwrap_err()).state(),
        CircuitState::Isolated
    );
    assert_eq!(dep.calls(), 0);
    breaker.reset(&carrier());
    call(&svc).await.unwrap();
    assert_eq!(
        *transitions.lock().unwrap(),
        vec![
            (CircuitState::Closed, CircuitState::Isolated),
            (CircuitState::Isolated, CircuitState::Closed)
        ]
    );
}

#[tokio::test(start_paused = true)]
async fn each_dependency_has_its_own_circuit_and_stacks_share_one_breaker() {
    let breaker = Breaker::new(BreakerConfig::default().consecutive_failures(1)).unwrap();
    let down = Dep::new(Answer::Status(503));
    let up = Dep::new(Answer::Ok);
    let carrier_a = backstop::breaker::BreakerLayer::http(breaker.clone())
        .dependency("breaker-carrier-api")
        .layer(down.service());
    let carrier_b = backstop::breaker::BreakerLayer::http(breaker.clone())
        .dependency("breaker-carrier-api")
        .layer(up.service());
    let billing = backstop::breaker::BreakerLayer::http(breaker.clone())
        .dependency("breaker-billing-api")
        .layer(up.service());
    call(&carrier_a).await.unwrap();
    // Another stack naming the same dependency sees the open circuit.
    assert!(call(&carrier_b).await.unwrap_err().is::<CircuitOpen>());
    call(&billing).await.unwrap();
    assert_eq!(breaker.tracked(), 2);
}

#[test]
fn invalid_configurations_are_rejected() {
    for (config, needle) in [
        (
            BreakerConfig::default().consecutive_failures(0),
            "consecutive_failures",
        ),
        (
            BreakerConfig::default().failure_ratio(1.5, 10, Duration::from_secs(1)),
            "failure_ratio",
        ),
        (
            BreakerConfig::default().failure_ratio(0.5, 0, Duration::from_secs(1)),
            "minimum_calls",
        ),
        (
            BreakerConfig::default().cooldown(Duration::ZERO),
            "cooldown",
        ),
        (BreakerConfig::default().trial_calls(0), "trial_calls"),
        (
            BreakerConfig::default()
                .no_consecutive_rule()
                .no_ratio_rule(),
            "a rule to open on",
        ),
        (
            BreakerConfig::default()
                .cooldown(Duration::from_secs(10))
                .cooldown_growth(Duration::from_secs(5)),
            "cooldown_growth",
        ),
    ] {
        let e = Breaker::new(config).unwrap_err();
        assert!(e.to_string().contains(needle), "{e}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn many_tasks_hammering_one_dependency_lose_no_count() {
    let breaker = Breaker::new(
        BreakerConfig::default()
            .no_consecutive_rule()
            .failure_ratio(0.9, 1_000_000, Duration::from_secs(3600)),
    )
    .unwrap();
    let dep = Dep::new(Answer::Ok);
    let svc = backstop::breaker::BreakerLayer::http(breaker.clone())
        .dependency("breaker-carrier-api")
        .layer(dep.service());
    let failing = Dep::new(Answer::Status(503));
    let bad = backstop::breaker::BreakerLayer::http(breaker.clone())
        .dependency("breaker-carrier-api")
        .layer(failing.service());
    let mut tasks = Vec::new();
    for t in 0..8 {
        let (svc, bad) = (svc.clone(), bad.clone());
        tasks.push(tokio::spawn(async move {
            for i in 0..2_000 {
                if (i + t) % 4 == 0 {
                    call(&bad).await.unwrap();
                } else {
                    call(&svc).await.unwrap();
                }
            }
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
    let s = breaker.stats(&carrier());
    assert_eq!(s.state, CircuitState::Closed);
    assert_eq!(s.calls, 16_000);
    assert_eq!(s.failures, 4_000);
    assert_eq!(dep.calls() + failing.calls(), 16_000);
}

/// The breaker inside the retry layer: each attempt counts, an open circuit is not retried, and
/// the budget and the breaker follow the same dependency name.
#[tokio::test(start_paused = true)]
async fn under_the_retry_layer_an_open_circuit_stops_retries_at_once() {
    let (breaker, budget, dep) = story_parts();
    let svc = story_retry()
        .budget(Arc::new(budget.bind(&carrier())))
        .layer(backstop::breaker::BreakerLayer::http(breaker.clone()).layer(dep.service()));
    an_open_circuit_stops_retries_at_once(&svc, &dep, &breaker, &budget).await;

    // After the cooldown a trial is admitted; its success closes the circuit.
    advance(Duration::from_secs(30)).await;
    dep.set(Answer::Ok);
    assert_eq!(call(&svc).await.unwrap().status(), 200);
    assert_eq!(breaker.state(&carrier()), CircuitState::Closed);
}

/// A breaker that opens after 4 failures in a row, a budget, and an always-503 dependency.
fn story_parts() -> (Breaker, Budget, Dep) {
    (
        Breaker::new(BreakerConfig::default().consecutive_failures(4)).unwrap(),
        Budget::default(),
        Dep::new(Answer::Status(503)),
    )
}

/// The retry layer of that story: "breaker-carrier-api", 100 ms waits, seeded.
fn story_retry()
-> RetryLayer<backstop_classify::HttpClassifier, backstop_retry::HttpResend, Dependency> {
    RetryLayer::http()
        .dependency("breaker-carrier-api")
        .backoff(Backoff::constant(Duration::from_millis(100)))
        .rng(RngSource::seeded(9))
}

/// Call 1: three attempts, three failures. Call 2: the fourth attempt opens the circuit, the
/// fifth is refused by it and the retry layer stops. Later calls fail fast.
async fn an_open_circuit_stops_retries_at_once<S>(
    svc: &S,
    dep: &Dep,
    breaker: &Breaker,
    budget: &Budget,
) where
    S: Service<Req, Response = Res, Error: Into<backstop_core::BoxError>> + Clone,
{
    assert_eq!(call(svc).await.unwrap().status(), 503);
    let e = call(svc).await.unwrap_err();
    assert_eq!(dep.calls(), 4);
    let e = e.downcast::<backstop_retry::Error>().unwrap();
    // Two attempts were made; the second was refused by the circuit, so only one was sent.
    assert_eq!(e.history().expect("a history").attempts.len(), 2);
    assert_eq!(e.attempts(), 1);
    assert_eq!(
        e.history().expect("a history").stopped,
        StopReason::NotRetryable
    );
    assert!(std::error::Error::source(&*e).unwrap().is::<CircuitOpen>());
    assert!(
        e.to_string()
            .contains("breaker-carrier-api is unavailable (circuit open); do not retry now"),
        "{e}"
    );

    // Later calls fail fast: one attempt, no wait, nothing reaches the dependency.
    let start = Instant::now();
    let e = call(svc)
        .await
        .unwrap_err()
        .downcast::<backstop_retry::Error>()
        .unwrap();
    assert_eq!(
        e.attempts(),
        0,
        "a refusal by the circuit is no attempt sent"
    );
    assert_eq!(start.elapsed(), Duration::ZERO);
    assert_eq!(dep.calls(), 4);
    // The breaker's circuit and the budget's account are both "breaker-carrier-api".
    assert_eq!(breaker.state(&carrier()), CircuitState::Open);
    assert_eq!(budget.stats(&carrier()).requests, 3);
    assert_eq!(budget.stats(&carrier()).retries, 3);
}

#[tokio::test(start_paused = true)]
async fn per_authority_circuits_when_no_name_is_given() {
    let breaker = Breaker::new(BreakerConfig::default().consecutive_failures(1)).unwrap();
    let dep = Dep::new(Answer::Status(503));
    let svc = backstop::breaker::BreakerLayer::http(breaker.clone()).layer(dep.service());
    svc.clone()
        .oneshot(Request::get("http://a.example/x").body(()).unwrap())
        .await
        .unwrap();
    let e = svc
        .clone()
        .oneshot(Request::get("http://a.example/y").body(()).unwrap())
        .await
        .unwrap_err();
    assert!(e.to_string().starts_with("a.example is unavailable"), "{e}");
    svc.oneshot(Request::get("http://b.example/x").body(()).unwrap())
        .await
        .unwrap();
    assert_eq!(
        dep.calls(),
        2,
        "the open circuit of a.example did not stop b.example"
    );
}

/// One attempt per call, through `breaker` inside the retry layer.
fn gated(
    breaker: &Breaker,
    dep: &Dep,
) -> impl Service<Req, Response = Res, Error = backstop_retry::Error> + Clone + use<> {
    RetryLayer::http()
        .dependency("breaker-carrier-api")
        .max_attempts(1)
        .unwrap()
        .layer(
            backstop::breaker::BreakerLayer::http(breaker.clone())
                .dependency("breaker-carrier-api")
                .layer(dep.service()),
        )
}

#[tokio::test(start_paused = true)]
async fn under_the_retry_layer_a_cancelled_trial_gives_its_slot_back() {
    let breaker = Breaker::new(BreakerConfig::default().consecutive_failures(1)).unwrap();
    let dep = Dep::new(Answer::Status(503));
    let svc = gated(&breaker, &dep);
    assert_eq!(call(&svc).await.unwrap().status(), 503);
    assert_eq!(breaker.state(&carrier()), CircuitState::Open);
    cancelled_trials_give_their_slots_back(&svc, &breaker, &dep).await;
}

#[tokio::test(start_paused = true)]
async fn a_request_naming_another_dependency_goes_to_that_circuit() {
    let breaker = Breaker::new(BreakerConfig::default().consecutive_failures(1)).unwrap();
    let dep = Dep::new(Answer::Status(503));
    let svc = gated(&breaker, &dep);
    let mut req = Request::new(());
    req.extensions_mut()
        .insert(Dependency::new("breaker-label-api"));
    assert_eq!(svc.clone().oneshot(req).await.unwrap().status(), 503);
    assert_eq!(
        breaker.state(&Dependency::new("breaker-label-api")),
        CircuitState::Open
    );
    assert_eq!(breaker.state(&carrier()), CircuitState::Closed);
}

#[tokio::test(start_paused = true)]
async fn a_result_from_before_a_transition_counts_for_nothing() {
    use backstop_classify::Verdict;
    use backstop_core::Outcome;
    let failure = Verdict::Retryable {
        outcome: Outcome::Unknown,
        after: None,
    };
    let breaker = Breaker::new(
        BreakerConfig::default()
            .consecutive_failures(2)
            .cooldown(Duration::from_secs(1)),
    )
    .unwrap();
    let dep = carrier();
    // A slow call is admitted while the circuit is closed...
    let slow = breaker.permit(&dep).unwrap();
    // ... meanwhile two failures open it, and a trial after the cooldown closes it again.
    for _ in 0..2 {
        breaker.permit(&dep).unwrap().record(failure);
    }
    assert_eq!(breaker.state(&dep), CircuitState::Open);
    advance(Duration::from_secs(2)).await;
    breaker.permit(&dep).unwrap().record(Verdict::Success);
    assert_eq!(breaker.state(&dep), CircuitState::Closed);
    // The slow call's failure arrives now: it belongs to the closed period before, so it does
    // not count towards this one. One fresh failure then leaves the circuit closed.
    slow.record(failure);
    breaker.permit(&dep).unwrap().record(failure);
    assert_eq!(breaker.state(&dep), CircuitState::Closed);
    assert_eq!(breaker.stats(&dep).consecutive_failures, 1);
}

#[tokio::test(start_paused = true)]
async fn past_the_bound_one_failing_host_opens_no_other_hosts_circuit() {
    use backstop_classify::Verdict;
    use backstop_core::Outcome;
    let failure = Verdict::Retryable {
        outcome: Outcome::Unknown,
        after: None,
    };
    let breaker = Breaker::new(
        BreakerConfig::default()
            .consecutive_failures(2)
            .max_dependencies(4),
    )
    .unwrap();
    let fail = |dep: &Dependency| {
        for _ in 0..2 {
            if let Ok(permit) = breaker.permit(dep) {
                permit.record(failure);
            }
        }
    };
    // Four open circuits fill the registry; none of them may be forgotten.
    for i in 0..4 {
        let dep = Dependency::new(format!("down-{i}"));
        fail(&dep);
        assert_eq!(breaker.state(&dep), CircuitState::Open);
    }
    // Past the bound, a failing host and a thousand healthy ones.
    fail(&Dependency::new("failing-host"));
    for i in 0..1_000 {
        let healthy = Dependency::new(format!("healthy-{i}"));
        let permit = breaker
            .permit(&healthy)
            .expect("a healthy host is never refused for another's failures");
        permit.record(Verdict::Success);
    }
    for i in 0..4 {
        assert_eq!(
            breaker.state(&Dependency::new(format!("down-{i}"))),
            CircuitState::Open
        );
    }
}

#[tokio::test(start_paused = true)]
async fn two_unnamed_layers_on_one_breaker_have_a_circuit_each() {
    // Neither layer names its dependency: a failing one must not open the other's circuit.
    let breaker = Breaker::new(BreakerConfig::default()).unwrap();
    let failing = Dep::new(Answer::Status(503));
    let healthy = Dep::new(Answer::Status(200));
    let classifier = backstop_classify::HttpClassifier::new();
    let a = BreakerLayer::new(breaker.clone(), classifier.clone()).layer(failing.service());
    let b = BreakerLayer::new(breaker.clone(), classifier).layer(healthy.service());
    for _ in 0..10 {
        let _ = call(&a).await;
    }
    assert!(
        call(&a).await.is_err(),
        "the failing layer's circuit is open"
    );
    assert_eq!(call(&b).await.unwrap().status(), 200);
    assert_eq!(healthy.calls(), 1);
}

#[test]
fn the_process_wide_breaker_is_one_breaker() {
    let dep = Dependency::new("process-wide-probe");
    Breaker::process_wide().isolate(&dep);
    assert_eq!(Breaker::process_wide().state(&dep), CircuitState::Isolated);
    Breaker::process_wide().reset(&dep);
}
