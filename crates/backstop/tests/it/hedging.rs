//! Hedged reads on the paused clock, seeded: a slow tail cut by a hedge at the dependency's
//! p95, paid from the retry budget (so an outage gets no extra load), never for a request that
//! is not replay-safe, and the losing copy cancelled.

use backstop::{
    Backstop, BoxError,
    backoff::{Backoff, RngSource},
    budget::{Budget, BudgetConfig},
    retry::Hedging,
    timeout::{LatencyConfig, LatencyTimeouts},
};
use http::{Request, Response};
use rand::{RngExt, SeedableRng, rngs::SmallRng};
use std::{
    sync::{
        Arc, Mutex,
        atomic::{AtomicU64, Ordering},
    },
    time::Duration,
};
use tokio::time::Instant;
use tower::{Layer, ServiceExt, service_fn};

#[derive(Clone, Default)]
struct Counts {
    attempts: Arc<AtomicU64>,
    cancelled: Arc<AtomicU64>,
}

/// Counts an attempt dropped before it answered.
struct Cancelled(Arc<AtomicU64>, bool);

impl Drop for Cancelled {
    fn drop(&mut self) {
        if !self.1 {
            self.0.fetch_add(1, Ordering::SeqCst);
        }
    }
}

/// 95 % of attempts answer in 20 ms, 5 % in 1 s; `status` is what they answer.
fn dependency(
    counts: &Counts,
    seed: u64,
    status: u16,
) -> impl tower::Service<Request<String>, Response = Response<()>, Error = std::io::Error, Future: Send>
+ Clone
+ Send
+ 'static {
    let rng = Arc::new(Mutex::new(SmallRng::seed_from_u64(seed)));
    let counts = counts.clone();
    service_fn(move |_req: Request<String>| {
        counts.attempts.fetch_add(1, Ordering::SeqCst);
        let slow = rng.lock().unwrap().random::<f64>() < 0.05;
        let guard = Cancelled(counts.cancelled.clone(), false);
        async move {
            let mut guard = guard;
            let took = if slow { 1_000 } else { 20 };
            tokio::time::sleep(Duration::from_millis(took)).await;
            guard.1 = true;
            Ok::<_, std::io::Error>(Response::builder().status(status).body(()).unwrap())
        }
    })
}

fn get() -> Request<String> {
    Request::get("http://search.local/q")
        .body(String::new())
        .unwrap()
}

fn p99(mut took: Vec<Duration>) -> Duration {
    took.sort();
    took[(took.len() * 99) / 100]
}

/// One call every 10 ms for `n` calls, each in its own task; the calls' durations.
async fn drive<S>(svc: S, n: usize) -> Vec<Result<Duration, BoxError>>
where
    S: tower::Service<
            Request<String>,
            Response = Response<backstop::timeout::TimedBody<()>>,
            Error = backstop::Error,
        > + Clone
        + Send
        + 'static,
    S::Future: Send,
{
    let mut tasks = tokio::task::JoinSet::new();
    for _ in 0..n {
        let svc = svc.clone();
        tasks.spawn(async move {
            let start = Instant::now();
            match svc.oneshot(get()).await {
                Ok(res) if res.status().is_success() => Ok(start.elapsed()),
                Ok(res) => Err(format!("{}", res.status()).into()),
                Err(e) => Err(e.into()),
            }
        });
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let mut out = Vec::new();
    while let Some(r) = tasks.join_next().await {
        out.push(r.unwrap());
    }
    out
}

fn stack_layer(
    latency: &LatencyTimeouts,
    budget: &Budget,
) -> backstop::BackstopLayer<
    backstop::classify::HttpClassifier,
    backstop::retry::HttpResend,
    backstop::idempotency::HttpKeys,
> {
    Backstop::http("hedging-search-api")
        .attempt_timeout_from_latency(latency.clone())
        .deadline(Duration::from_secs(5))
        .budget(budget.clone())
        .backoff(Backoff::constant(Duration::from_millis(1)))
        .rng(RngSource::seeded(4))
        .no_breaker()
        .build()
        .unwrap()
}

fn latency() -> LatencyTimeouts {
    // The attempt timeout, 2 x p99 (the 1 s tail), never cuts the slow 5 %: what differs is
    // the hedge alone.
    LatencyTimeouts::new(
        LatencyConfig::default()
            .ceiling(Duration::from_secs(3))
            .fallback(Duration::from_secs(3)),
    )
    .unwrap()
}

#[tokio::test(start_paused = true)]
async fn a_hedge_at_p95_cuts_the_tail_at_a_few_percent_more_attempts() {
    let mut rows = Vec::new();
    for hedged in [false, true] {
        let counts = Counts::default();
        let latency = latency();
        let budget = Budget::default();
        let layer = stack_layer(&latency, &budget);
        let client = dependency(&counts, 21, 200);
        // Warm the latency record up (the same for both), then measure.
        let plain = layer.clone().layer(client.clone());
        drive(plain.clone(), 300).await;
        counts.attempts.store(0, Ordering::SeqCst);
        let results = if hedged {
            let svc = layer.layer(layer.hedge(client, Hedging::default()).unwrap());
            drive(svc, 2_000).await
        } else {
            drive(plain, 2_000).await
        };
        let took: Vec<Duration> = results.into_iter().map(|r| r.unwrap()).collect();
        let attempts = counts.attempts.load(Ordering::SeqCst);
        rows.push((p99(took), attempts, counts.cancelled.load(Ordering::SeqCst)));
    }
    let (plain, hedged) = (rows[0], rows[1]);
    println!(
        "p99 without hedging {:?} ({} attempts), with {:?} ({} attempts, {} cancelled)",
        plain.0, plain.1, hedged.0, hedged.1, hedged.2
    );
    assert!(
        plain.0 >= Duration::from_millis(1_000),
        "the tail: {:?}",
        plain.0
    );
    assert!(
        hedged.0 * 2 <= plain.0,
        "p99 at least halved: {:?} against {:?}",
        hedged.0,
        plain.0
    );
    let extra = hedged.1 as f64 / 2_000.0 - 1.0;
    assert!(extra <= 0.10, "at most 10 % more attempts: {extra:.3}");
    assert!(hedged.2 > 0, "the losing copies were cancelled");
}

#[tokio::test(start_paused = true)]
async fn an_outage_gets_no_more_than_the_budget_from_hedges_and_retries_together() {
    let counts = Counts::default();
    let latency = latency();
    let budget = Budget::new(BudgetConfig::default()).unwrap();
    let layer = stack_layer(&latency, &budget);
    // Healthy first, so that the record knows when to hedge.
    let healthy = layer.clone().layer(dependency(&counts, 5, 200));
    drive(healthy, 300).await;
    counts.attempts.store(0, Ordering::SeqCst);
    // Then every attempt answers 503 (and the slow 5 % take a second): hedges and retries are
    // both paid from the budget.
    let failing = layer.layer(
        layer
            .hedge(dependency(&counts, 6, 503), Hedging::default())
            .unwrap(),
    );
    // Two minutes of outage (a call every 10 ms): long enough that the healthy calls still in
    // the budget's window when it began weigh little.
    let n = 12_000;
    let results = drive(failing, n).await;
    assert!(results.iter().all(|r| r.is_err()));
    let attempts = counts.attempts.load(Ordering::SeqCst);
    let per_call = attempts as f64 / n as f64;
    println!("outage: {attempts} attempts for {n} calls, {per_call:.4} per call");
    // Retries and hedges: 10 % of the calls (the budget's ratio; its floor of one a second is
    // the smaller here), and of the 300 healthy calls of the warm-up, still in its window.
    assert!(
        attempts as f64 <= n as f64 + 0.1 * (n + 300) as f64,
        "{attempts} attempts"
    );
    assert!(per_call <= 1.1 + 30.0 / n as f64, "{per_call:.4}");
}

#[tokio::test(start_paused = true)]
async fn a_request_that_is_not_replay_safe_is_never_hedged_and_hedging_needs_a_record() {
    let counts = Counts::default();
    let latency = latency();
    let layer = stack_layer(&latency, &Budget::default());
    let client = dependency(&counts, 9, 200);
    drive(layer.clone().layer(client.clone()), 300).await;
    counts.attempts.store(0, Ordering::SeqCst);
    let svc = layer.layer(layer.hedge(client, Hedging::default()).unwrap());
    for _ in 0..200 {
        let post = Request::post("http://search.local/orders")
            .body(String::new())
            .unwrap();
        // No key the dependency honours: a POST is one attempt, never hedged.
        let _ = svc.clone().oneshot(post).await;
    }
    assert_eq!(counts.attempts.load(Ordering::SeqCst), 200);

    let without = Backstop::http("hedging-search-api").build().unwrap();
    let Err(e) = without.hedge(dependency(&counts, 1, 200), Hedging::default()) else {
        panic!("a stack without a latency record cannot hedge");
    };
    assert!(
        e.to_string().contains("attempt_timeout_from_latency"),
        "{e}"
    );
}

/// A hedge waits for the service's readiness, and a copy that is never sent takes no token:
/// under a concurrency limit of one, the slow first copy holds the only permit.
#[tokio::test(start_paused = true)]
async fn a_hedge_the_service_cannot_take_costs_nothing() {
    let counts = Counts::default();
    let latency = latency();
    // A window longer than the test, so that the budget's count covers all of it.
    let budget = Budget::new(
        BudgetConfig::default()
            .min_retries_per_sec(0.0)
            .window(Duration::from_secs(3_600)),
    )
    .unwrap();
    let layer = stack_layer(&latency, &budget);
    let limited = tower::limit::ConcurrencyLimitLayer::new(1).layer(dependency(&counts, 21, 200));
    // Learn the latency one call at a time (the limit lets nothing overlap).
    for _ in 0..300 {
        layer
            .clone()
            .layer(limited.clone())
            .oneshot(get())
            .await
            .unwrap();
    }
    let before = budget.stats(&"hedging-search-api".into()).retries;
    counts.attempts.store(0, Ordering::SeqCst);
    let svc = layer.layer(layer.hedge(limited, Hedging::default()).unwrap());
    for _ in 0..300 {
        svc.clone().oneshot(get()).await.unwrap();
    }
    assert_eq!(
        counts.attempts.load(Ordering::SeqCst),
        300,
        "no copy was sent"
    );
    assert_eq!(
        budget.stats(&"hedging-search-api".into()).retries,
        before,
        "and none was paid for"
    );
}

/// A hedge the budget refuses gives back the readiness it was granted at once: under a
/// concurrency limit of two, a slow call whose hedge was refused holds one permit, not both,
/// and the next call goes through while it is still out.
#[tokio::test(start_paused = true)]
async fn a_hedge_the_budget_refuses_leaves_the_service_free() {
    // The attempt timeout at least 2 s, so that the slow call's one attempt is not cut.
    let latency = LatencyTimeouts::new(
        LatencyConfig::default()
            .floor(Duration::from_secs(2))
            .ceiling(Duration::from_secs(3))
            .fallback(Duration::from_secs(3)),
    )
    .unwrap();
    let no_retries = BudgetConfig::default()
        .ratio(0.0)
        .min_retries_per_sec(0.0)
        .window(Duration::from_secs(3_600));
    let budget = Budget::new(no_retries).unwrap();
    let layer = stack_layer(&latency, &budget);
    // 20 ms, or 1 s for a request marked slow.
    let dependency = service_fn(|req: Request<String>| async move {
        let took = if req.headers().contains_key("x-slow") {
            1_000
        } else {
            20
        };
        tokio::time::sleep(Duration::from_millis(took)).await;
        Ok::<_, std::io::Error>(Response::new(()))
    });
    let limited = tower::limit::ConcurrencyLimitLayer::new(2).layer(dependency);
    for _ in 0..300 {
        let svc = layer.clone().layer(limited.clone());
        svc.oneshot(get()).await.unwrap();
    }
    let svc = layer.layer(layer.hedge(limited, Hedging::default()).unwrap());
    let mut slow = get();
    slow.headers_mut().insert("x-slow", "1".parse().unwrap());
    let started = Instant::now();
    let slow = tokio::spawn(svc.clone().oneshot(slow));
    // Past the hedge's due time (the record's p95, 20 ms): the refused hedge has come and gone.
    tokio::time::sleep(Duration::from_millis(100)).await;
    svc.clone().oneshot(get()).await.unwrap();
    let next = started.elapsed();
    assert!(
        next < Duration::from_millis(500),
        "the next call waited {next:?} for a permit the refused hedge kept"
    );
    slow.await.unwrap().unwrap();
}
