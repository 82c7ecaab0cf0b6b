//! The budget under the retry layer, and under contention.

use backstop_backoff::{Backoff, RngSource};
use backstop_budget::{Budget, BudgetConfig, RetryBudget};
use backstop_core::Dependency;
use backstop_retry::{RetryHistory, RetryLayer, StopReason};
use http::{Request, Response};
use std::{
    sync::{
        Arc,
        atomic::{AtomicU64, Ordering},
    },
    time::Duration,
};
use tower::{Layer, ServiceExt, service_fn};

#[tokio::test(start_paused = true)]
async fn a_thousand_requests_to_an_always_503_dependency_stay_within_the_budget() {
    let attempts = Arc::new(AtomicU64::new(0));
    let seen = attempts.clone();
    let always_503 = service_fn(move |_req: Request<String>| {
        seen.fetch_add(1, Ordering::SeqCst);
        // A concrete error type: with `BoxError` here, spawning the stack inline hits rustc's
        // "implementation of `From` is not general enough" (see the guide's troubleshooting chapter).
        async { Ok::<_, std::io::Error>(Response::builder().status(503).body(()).unwrap()) }
    });
    let budget = Budget::default();
    let svc = RetryLayer::http()
        .dependency("budget-carrier-api")
        .backoff(Backoff::constant(Duration::from_millis(5)))
        .rng(RngSource::seeded(3))
        .budget(Arc::new(budget.clone()))
        .layer(always_503);

    // 100 callers, 10 requests each, all within one budget window.
    let mut tasks = tokio::task::JoinSet::new();
    for _ in 0..100 {
        let svc = svc.clone();
        tasks.spawn(async move {
            let mut refused = 0;
            for _ in 0..10 {
                let res = svc
                    .clone()
                    .oneshot(
                        Request::get("http://carrier/x")
                            .body(String::new())
                            .unwrap(),
                    )
                    .await
                    .unwrap();
                if RetryHistory::of(&res).unwrap().stopped == StopReason::BudgetExhausted {
                    refused += 1;
                }
            }
            refused
        });
    }
    let mut refused = 0;
    while let Some(r) = tasks.join_next().await {
        refused += r.unwrap();
    }
    let attempts = attempts.load(Ordering::SeqCst);
    let floor = 10; // 1 retry/s over the 10 s window
    assert!(attempts <= 1_000 + 100 + floor, "{attempts} attempts");
    assert!(
        attempts >= 1_000 + 100,
        "the budget allows (and retries use) 10 %: {attempts}"
    );
    assert!(
        refused >= 800,
        "most calls were told the budget is exhausted: {refused}"
    );
    let stats = budget.stats(&Dependency::new("budget-carrier-api"));
    assert_eq!(stats.requests, 1_000);
    assert_eq!(stats.retries, attempts - 1_000);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn many_tasks_hammering_one_dependency_lose_no_update_and_never_overshoot() {
    let budget = Budget::new(
        BudgetConfig::default()
            .window(Duration::from_secs(3600))
            .min_retries_per_sec(0.0),
    )
    .unwrap();
    let dep = Dependency::new("budget-carrier-api");
    let granted = Arc::new(AtomicU64::new(0));
    let mut tasks = Vec::new();
    for _ in 0..8 {
        let (budget, dep, granted) = (budget.clone(), dep.clone(), granted.clone());
        tasks.push(tokio::spawn(async move {
            for i in 0..10_000 {
                budget.deposit(&dep, tokio::time::Instant::now());
                if i % 2 == 0 && budget.withdraw(&dep) {
                    granted.fetch_add(1, Ordering::Relaxed);
                }
            }
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
    let stats = budget.stats(&dep);
    assert_eq!(stats.requests, 80_000);
    let granted = granted.load(Ordering::Relaxed);
    assert_eq!(stats.retries, granted);
    assert!(
        granted <= 8_000,
        "never more than 10 % of requests: {granted}"
    );
    // Nearly all of the allowance is used: withdrawals happen throughout, as deposits grow.
    assert!(granted >= 7_900, "{granted}");
}

#[tokio::test(start_paused = true)]
async fn a_bound_budget_charges_its_own_account_and_sends_others_to_theirs() {
    let budget = Budget::new(BudgetConfig::default().min_retries_per_sec(0.0)).unwrap();
    let carrier = Dependency::new("budget-carrier-api");
    let labels = Dependency::new("budget-label-api");
    let bound = budget.bind(&carrier);
    let now = tokio::time::Instant::now();
    for _ in 0..20 {
        bound.deposit(&carrier, now);
    }
    bound.deposit(&labels, now);
    assert_eq!(budget.stats(&carrier).requests, 20);
    assert_eq!(budget.stats(&labels).requests, 1);
    // 10 % of 20: two retries through the bound account, then refused.
    assert_eq!((0..5).filter(|_| bound.withdraw(&carrier)).count(), 2);
    assert_eq!(budget.stats(&carrier).retries, 2);
    // 10 % of 1 rounds to none for the other dependency.
    assert!(!bound.withdraw(&labels));
}
