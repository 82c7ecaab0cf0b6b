//! Attempt timeouts learned from latency in the composed stack, on the paused clock: after the
//! dependency's successes have been seen, a hung attempt is cut at twice its p99, not at the
//! fixed timeout; the retry gets twice that; the deadline still bounds every attempt.

use backstop::{
    Backstop, ErrorKind,
    backoff::{Backoff, RngSource},
    timeout::{LatencyConfig, LatencyTimeouts},
};
use http::{Request, Response};
use std::{
    sync::{
        Arc,
        atomic::{AtomicU64, Ordering},
    },
    time::Duration,
};
use tokio::time::Instant;
use tower::{Layer, ServiceExt, service_fn};

/// Answers in 40 ms, or never for a request to `/hang`.
fn dependency(
    calls: &Arc<AtomicU64>,
) -> impl tower::Service<Request<String>, Response = Response<()>, Error = std::io::Error, Future: Send>
+ Clone
+ Send
+ 'static {
    let calls = calls.clone();
    service_fn(move |req: Request<String>| {
        calls.fetch_add(1, Ordering::SeqCst);
        let hang = req.uri().path() == "/hang";
        async move {
            if hang {
                std::future::pending::<()>().await;
            }
            tokio::time::sleep(Duration::from_millis(40)).await;
            Ok::<_, std::io::Error>(Response::new(()))
        }
    })
}

fn get(path: &str) -> Request<String> {
    Request::get(format!("http://search.local{path}"))
        .body(String::new())
        .unwrap()
}

#[tokio::test(start_paused = true)]
async fn a_hung_attempt_is_cut_at_the_learned_limit() {
    let calls = Arc::new(AtomicU64::new(0));
    let latency = LatencyTimeouts::new(LatencyConfig::default()).unwrap();
    let stack = Backstop::http("adaptive-timeout-search-api")
        .attempt_timeout(Duration::from_secs(10)) // what a guess would be
        .attempt_timeout_from_latency(latency.clone())
        .backoff(Backoff::constant(Duration::from_millis(1)))
        .rng(RngSource::seeded(1))
        .no_breaker()
        .no_budget()
        .build()
        .unwrap()
        .layer(dependency(&calls));
    // Before any success is seen: the fallback (2 s).
    let start = Instant::now();
    let e = stack
        .clone()
        .oneshot(get("/hang"))
        .await
        .expect_err("it hangs");
    let cold = start.elapsed();
    assert_eq!(e.kind(), ErrorKind::TimedOut);
    assert!(
        cold >= Duration::from_secs(2 + 4 + 8),
        "three attempts at the fallback: {cold:?}"
    );

    for _ in 0..100 {
        stack.clone().oneshot(get("/ok")).await.unwrap();
    }
    let learned = latency.timeout(&"adaptive-timeout-search-api".into(), 1);
    assert!(
        learned >= Duration::from_millis(80) && learned <= Duration::from_millis(110),
        "2 x p99 of 40 ms: {learned:?}"
    );
    let before = calls.load(Ordering::SeqCst);
    let start = Instant::now();
    let e = stack
        .clone()
        .oneshot(get("/hang"))
        .await
        .expect_err("it hangs");
    let warm = start.elapsed();
    assert_eq!(e.kind(), ErrorKind::TimedOut);
    assert_eq!(calls.load(Ordering::SeqCst) - before, 3, "three attempts");
    // learned + 2 x learned + 4 x learned, and the two 1 ms waits: far from 3 x 10 s.
    let expected = learned * 7 + Duration::from_millis(2);
    assert!(
        warm >= learned * 7 && warm <= expected + Duration::from_millis(5),
        "{warm:?} for {expected:?}"
    );
}

#[tokio::test(start_paused = true)]
async fn the_deadline_still_bounds_a_learned_attempt() {
    let calls = Arc::new(AtomicU64::new(0));
    let latency =
        LatencyTimeouts::new(LatencyConfig::default().fallback(Duration::from_secs(20))).unwrap();
    let stack = Backstop::http("adaptive-timeout-search-api")
        .attempt_timeout_from_latency(latency)
        .deadline(Duration::from_secs(1))
        .no_breaker()
        .build()
        .unwrap()
        .layer(dependency(&calls));
    let start = Instant::now();
    let e = stack.oneshot(get("/hang")).await.expect_err("it hangs");
    assert_eq!(e.kind(), ErrorKind::DeadlineExceeded);
    assert_eq!(start.elapsed(), Duration::from_secs(1));
}

/// One dependency's reads and writes: the limit learned from fast reads does not time a slow
/// write that is not replay-safe (a cut would leave it unknown for good), and the write's
/// latency does not pull the reads' limit.
#[tokio::test(start_paused = true)]
async fn a_slow_write_beside_fast_reads_is_not_cut_by_their_limit() {
    let latency = LatencyTimeouts::new(LatencyConfig::default()).unwrap();
    let writes = Arc::new(AtomicU64::new(0));
    let seen = writes.clone();
    let stack = Backstop::http("adaptive-timeout-billing-api")
        .no_idempotency()
        .attempt_timeout(Duration::from_secs(2))
        .attempt_timeout_from_latency(latency.clone())
        .no_breaker()
        .no_budget()
        .build()
        .unwrap()
        .layer(service_fn(move |req: Request<String>| {
            let write = req.method() == http::Method::POST;
            if write {
                seen.fetch_add(1, Ordering::SeqCst);
            }
            async move {
                // Reads in 8 ms, writes in 150 ms.
                let took = if write { 150 } else { 8 };
                tokio::time::sleep(Duration::from_millis(took)).await;
                Ok::<_, std::io::Error>(Response::new(()))
            }
        }));
    for _ in 0..200 {
        stack.clone().oneshot(get("/q")).await.unwrap();
    }
    let reads = latency.timeout(&"adaptive-timeout-billing-api".into(), 1);
    assert!(
        reads < Duration::from_millis(150),
        "the reads' limit: {reads:?}"
    );
    for _ in 0..50 {
        let post = Request::post("http://billing.local/invoices")
            .body(String::new())
            .unwrap();
        let started = Instant::now();
        stack.clone().oneshot(post).await.expect("no write cut");
        assert_eq!(started.elapsed(), Duration::from_millis(150));
    }
    assert_eq!(writes.load(Ordering::SeqCst), 50, "each write sent once");
    assert_eq!(
        latency.timeout(&"adaptive-timeout-billing-api".into(), 1),
        reads,
        "the writes did not teach the reads' record"
    );
}
