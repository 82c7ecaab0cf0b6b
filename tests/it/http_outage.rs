//! A dependency outage over real loopback HTTP: the breaker opens, fails fast without sending,
//! lets a trial through after its cooldown, and closes when the dependency is back. The budget
//! bounds what retries add meanwhile. Real clock, short durations.

use backstop::{
    BoxError, Dependency, Outcome,
    backoff::{Backoff, RngSource},
    breaker::{Breaker, BreakerConfig, CircuitState},
    budget::Budget,
    core::CircuitOpen,
    retry::RetryLayer,
    timeout::{AttemptTimeoutLayer, DeadlineLayer},
};
use backstop_testkit::{Action, Seen, TestServer};
use bytes::Bytes;
use http::{Request, Response};
use http_body_util::Full;
use hyper::body::Incoming;
use hyper_util::{client::legacy::Client, rt::TokioExecutor};
use std::{
    sync::{
        Arc,
        atomic::{AtomicBool, Ordering},
    },
    time::Duration,
};
use tower::{Service, ServiceBuilder, ServiceExt};

fn stack(
    breaker: &Breaker,
    budget: &Budget,
) -> impl Service<Request<Full<Bytes>>, Response = Response<Incoming>, Error = BoxError, Future: Send>
+ Clone
+ Send
+ use<> {
    ServiceBuilder::new()
        .layer(DeadlineLayer::new(Duration::from_secs(5)))
        .layer(
            RetryLayer::http()
                .dependency("http-outage-carrier-api")
                .backoff(
                    Backoff::full_jitter(Duration::from_millis(5), Duration::from_millis(20))
                        .unwrap(),
                )
                .rng(RngSource::seeded(2))
                .budget(Arc::new(budget.clone())),
        )
        .layer(backstop::breaker::BreakerLayer::http(breaker.clone()))
        .layer(AttemptTimeoutLayer::new(Duration::from_secs(1)))
        .service(Client::builder(TokioExecutor::new()).build_http())
}

fn get(url: String) -> Request<Full<Bytes>> {
    Request::get(url).body(Full::default()).unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_breaker_opens_during_an_outage_and_closes_after_it() {
    let down = Arc::new(AtomicBool::new(true));
    let d = down.clone();
    let server = TestServer::start(move |_: &Seen| {
        if d.load(Ordering::SeqCst) {
            Action::status(503)
        } else {
            Action::status(200)
        }
    })
    .await;
    // The 50 refusals below take about a millisecond; the cooldown is long enough that no
    // trial is let through while they run, even on two loaded cores.
    let cooldown = Duration::from_secs(2);
    let breaker = Breaker::new(BreakerConfig::default().cooldown(cooldown)).unwrap();
    let budget = Budget::default();
    let svc = stack(&breaker, &budget);
    let carrier = Dependency::new("http-outage-carrier-api");

    // Two calls of three attempts: the fifth failure in a row opens the circuit.
    for _ in 0..2 {
        let _ = svc.clone().oneshot(get(server.url("/rates"))).await;
    }
    assert_eq!(breaker.state(&carrier), CircuitState::Open);
    let sent = server.requests();
    assert_eq!(sent, 5);

    // While open: honest, not sent, and no attempt waited for (fast: BENCHMARKS.md measures
    // the refusal's cost).
    for _ in 0..50 {
        let e = svc
            .clone()
            .oneshot(get(server.url("/rates")))
            .await
            .unwrap_err();
        let e = e.downcast::<backstop::Error>().unwrap();
        let open = std::error::Error::source(&*e)
            .unwrap()
            .downcast_ref::<CircuitOpen>()
            .expect("refused by the circuit");
        assert_eq!(e.outcome(), Outcome::NotSent);
        assert_eq!(e.attempts(), 0, "refused by the circuit: nothing sent");
        assert!(
            open.retry_in().is_some_and(|after| after <= cooldown),
            "the refusal says when to come back: {e}"
        );
    }
    assert_eq!(
        server.requests(),
        sent,
        "nothing reached the server while the circuit was open"
    );

    // The dependency recovers; after the cooldown a trial goes through and closes the circuit.
    down.store(false, Ordering::SeqCst);
    // Waiting for the cooldown itself: the clock is what is tested here.
    tokio::time::sleep(cooldown + Duration::from_millis(50)).await;
    let res = svc
        .clone()
        .oneshot(get(server.url("/rates")))
        .await
        .unwrap();
    assert_eq!(res.status(), 200);
    assert_eq!(breaker.state(&carrier), CircuitState::Closed);
    assert_eq!(server.requests(), sent + 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_budget_bounds_attempts_during_a_total_outage() {
    let server = TestServer::start(|_: &Seen| Action::status(503)).await;
    // A breaker that never opens here, to see the budget alone.
    let breaker = Breaker::new(
        BreakerConfig::default()
            .consecutive_failures(u32::MAX)
            .no_ratio_rule(),
    )
    .unwrap();
    let budget = Budget::default();
    let svc = stack(&breaker, &budget);
    let mut tasks = tokio::task::JoinSet::new();
    for w in 0..20 {
        let (svc, url) = (svc.clone(), server.url(&format!("/rates/{w}")));
        tasks.spawn(async move {
            for _ in 0..25 {
                let res = svc.clone().oneshot(get(url.clone())).await.unwrap();
                assert_eq!(res.status(), 503);
            }
        });
    }
    while let Some(r) = tasks.join_next().await {
        r.unwrap();
    }
    let attempts = server.requests();
    // 500 logical calls: at most 500 + 10 % + the floor of 1/s over the 10 s window.
    assert!(
        attempts <= 500 + 50 + 10,
        "{attempts} attempts for 500 calls"
    );
    assert!(attempts >= 500 + 50, "{attempts}");
}
