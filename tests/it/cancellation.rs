//! Dropping a call at every await point leaks nothing: a harness polls the full client stack
//! (with the server's replay layer in process) `k` times, advancing the paused clock between
//! polls, then drops it, for every `k` until the call would have finished. After each drop:
//! the key is free again (no claim outlives its caller), the breaker admits calls (never stuck
//! half-open), and the budget's counts stay within their bounds.

use backstop::{
    Backstop, BoxError, Dependency,
    backoff::{Backoff, RngSource},
    breaker::{Breaker, BreakerConfig, CircuitState},
    budget::Budget,
    idempotency::ActionContext,
    replay::{MemoryStore, ReplayLayer, ReplayRequestBody},
};
use bytes::Bytes;
use http::{Request, Response};
use http_body_util::{BodyExt, Full};
use std::{
    collections::HashMap,
    future::Future,
    pin::pin,
    sync::{
        Arc, Mutex,
        atomic::{AtomicU32, Ordering},
    },
    task::{Context, Poll, Waker},
    time::Duration,
};
use tower::{Layer, Service, ServiceExt, service_fn, util::BoxCloneSyncService};

type Effects = Arc<Mutex<HashMap<String, u32>>>;

/// The dependency, in process: the network loses the first reply of each order (after the
/// handler committed), and every handler takes 200 ms.
fn dependency(
    effects: Effects,
) -> BoxCloneSyncService<
    Request<Full<Bytes>>,
    Response<backstop::replay::ReplayResponseBody>,
    BoxError,
> {
    let handler = service_fn(move |req: Request<ReplayRequestBody>| {
        let effects = effects.clone();
        async move {
            let body = req.into_body().collect().await.map_err(|e| e.0)?.to_bytes();
            tokio::time::sleep(Duration::from_millis(200)).await;
            *effects
                .lock()
                .unwrap()
                .entry(String::from_utf8_lossy(&body).into_owned())
                .or_default() += 1;
            Ok::<_, BoxError>(Response::new(Full::new(Bytes::from_static(b"refunded"))))
        }
    });
    let replay = BoxCloneSyncService::new(
        ReplayLayer::new(MemoryStore::default())
            .single_tenant()
            .lease(Duration::from_secs(5))
            .unwrap()
            .layer(handler),
    );
    let seen: Arc<Mutex<HashMap<Vec<u8>, u32>>> = Arc::default();
    BoxCloneSyncService::new(service_fn(move |req: Request<Full<Bytes>>| {
        let mut inner = replay.clone();
        let seen = seen.clone();
        async move {
            let key = req
                .headers()
                .get("idempotency-key")
                .map(|v| v.as_bytes().to_vec())
                .unwrap_or_default();
            let first = {
                let mut s = seen.lock().unwrap();
                let n = s.entry(key).or_default();
                *n += 1;
                *n == 1
            };
            let res = inner.ready().await?.call(req).await?;
            if first {
                return Err::<_, BoxError>(
                    std::io::Error::new(std::io::ErrorKind::ConnectionReset, "reply lost").into(),
                );
            }
            Ok(res)
        }
    }))
}

fn poll_once<F: Future>(f: std::pin::Pin<&mut F>) -> Poll<F::Output> {
    f.poll(&mut Context::from_waker(Waker::noop()))
}

fn refund(order: &str) -> Request<Full<Bytes>> {
    let mut req = Request::post("http://payments.local/refunds")
        .body(Full::new(Bytes::from(order.to_owned())))
        .unwrap();
    req.extensions_mut()
        .insert(ActionContext::tool_call("run-1", order, "call-1"));
    req
}

#[tokio::test(start_paused = true)]
async fn a_call_dropped_at_any_point_leaves_no_claim_no_stuck_breaker_and_no_duplicate() {
    let effects = Effects::default();
    let budget = Budget::default();
    let breaker = Breaker::new(BreakerConfig::default()).unwrap();
    // The dependency is a ReplayLayer server: it honours keys.
    let stack = Backstop::http("cancellation-payments-api")
        .honours_keys()
        .budget(budget.clone())
        .breaker(breaker.clone())
        .backoff(Backoff::constant(Duration::from_millis(100)))
        .rng(RngSource::seeded(3))
        .attempt_timeout(Duration::from_secs(1))
        .deadline(Duration::from_secs(10))
        .build()
        .unwrap()
        .layer(dependency(effects.clone()));

    // How many polls a call needs when left alone (with 50 ms between polls).
    let mut complete_after = 0;
    {
        let mut s = stack.clone();
        let fut = s.call(refund("probe"));
        let mut fut = pin!(fut);
        loop {
            complete_after += 1;
            if let Poll::Ready(r) = poll_once(fut.as_mut()) {
                assert!(r.unwrap().status().is_success());
                break;
            }
            tokio::time::advance(Duration::from_millis(50)).await;
        }
    }
    assert!(
        complete_after > 5,
        "the call has several await points: {complete_after}"
    );

    for k in 1..complete_after {
        let order = format!("order-{k}");
        {
            let mut s = stack.clone();
            let fut = s.call(refund(&order));
            let mut fut = pin!(fut);
            for _ in 0..k {
                assert!(
                    poll_once(fut.as_mut()).is_pending(),
                    "cancelled before the end ({k} polls)"
                );
                tokio::time::advance(Duration::from_millis(50)).await;
            }
            // The caller gives up here: the future is dropped.
        }
        // Let the released claim's cleanup run.
        for _ in 0..5 {
            tokio::task::yield_now().await;
        }
        // The same action again: never "in flight" forever, never done twice.
        let res = stack.clone().oneshot(refund(&order)).await.unwrap();
        assert!(
            res.status().is_success(),
            "after a drop at poll {k}: {}",
            res.status()
        );
        let n = effects.lock().unwrap().get(&order).copied().unwrap_or(0);
        assert!(
            n <= 1,
            "order {order} refunded {n} times after a drop at poll {k}"
        );
        assert_ne!(
            breaker.state(&Dependency::new("cancellation-payments-api")),
            CircuitState::Open,
            "after a drop at poll {k}"
        );
    }
    let stats = budget.stats(&Dependency::new("cancellation-payments-api"));
    assert!(stats.retries as f64 <= stats.allowance, "{stats:?}");
}

#[tokio::test(start_paused = true)]
async fn a_half_open_trial_dropped_at_any_point_gives_its_slot_back() {
    let calls = Arc::new(AtomicU32::new(0));
    let healthy = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let (c, h) = (calls.clone(), healthy.clone());
    let dep = service_fn(move |_req: Request<Full<Bytes>>| {
        c.fetch_add(1, Ordering::SeqCst);
        let up = h.load(Ordering::SeqCst);
        async move {
            tokio::time::sleep(Duration::from_millis(150)).await;
            let status = if up { 200 } else { 503 };
            Ok::<_, std::io::Error>(
                Response::builder()
                    .status(status)
                    .body(Full::<Bytes>::default())
                    .unwrap(),
            )
        }
    });
    let breaker = Breaker::new(
        BreakerConfig::default()
            .consecutive_failures(1)
            .cooldown(Duration::from_secs(5)),
    )
    .unwrap();
    let stack = Backstop::http("cancellation-search-api")
        .preset(backstop::Preset::ReadOnly)
        .budget(Budget::default())
        .breaker(breaker.clone())
        .backoff(Backoff::constant(Duration::from_millis(100)))
        .rng(RngSource::seeded(4))
        .attempt_timeout(Duration::from_secs(1))
        .build()
        .unwrap()
        .layer(dep);
    let search = || {
        Request::get("http://search.local/q")
            .body(Full::default())
            .unwrap()
    };
    let dep_name = Dependency::new("cancellation-search-api");

    // Open the circuit.
    let _ = stack.clone().oneshot(search()).await;
    assert_eq!(breaker.state(&dep_name), CircuitState::Open);
    healthy.store(true, Ordering::SeqCst);

    for k in 1..=8 {
        tokio::time::advance(Duration::from_secs(6)).await;
        {
            let mut s = stack.clone();
            let fut = s.call(search());
            let mut fut = pin!(fut);
            for _ in 0..k {
                if poll_once(fut.as_mut()).is_ready() {
                    break;
                }
                tokio::time::advance(Duration::from_millis(40)).await;
            }
        }
        // Whatever point the trial was dropped at, the circuit is not stuck: the next call is
        // admitted (as the trial, or because the circuit closed).
        let res = stack.clone().oneshot(search()).await.unwrap();
        assert_eq!(res.status(), 200, "after dropping the trial at poll {k}");
        assert_eq!(breaker.state(&dep_name), CircuitState::Closed);
        // Open it again for the next round.
        healthy.store(false, Ordering::SeqCst);
        let _ = stack.clone().oneshot(search()).await;
        assert_eq!(breaker.state(&dep_name), CircuitState::Open);
        healthy.store(true, Ordering::SeqCst);
    }
}
