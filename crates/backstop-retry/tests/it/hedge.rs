//! The hedge layer on its own, under `ServiceBuilder` over a leaf whose first copy of each
//! request hangs: what it hedges, after how long, and what stops it. Paused clock.

use backstop_classify::HttpClassifier;
use backstop_core::{Dependency, RetryBudget};
use backstop_retry::{HedgeLayer, Hedging, HttpResend};
use backstop_timeout::{LatencyConfig, LatencyTimeouts};
use bytes::Bytes;
use http::{Method, Request, Response};
use http_body_util::Full;
use std::{
    convert::Infallible,
    sync::{
        Arc,
        atomic::{AtomicU32, Ordering},
    },
    time::Duration,
};
use tokio::time::Instant;
use tower::{Service, ServiceBuilder, ServiceExt, service_fn};

type Req = Request<Full<Bytes>>;

/// A record of "catalog" answering in 10 ms, 20 times: enough samples to hedge after.
fn latency() -> LatencyTimeouts {
    let latency = LatencyTimeouts::new(LatencyConfig::default()).unwrap();
    let catalog = Dependency::from("catalog");
    for _ in 0..20 {
        latency.record(&catalog, Duration::from_millis(10));
    }
    latency
}

/// A leaf whose first copy of a request hangs for a minute and whose later copies answer at
/// once, counting the copies it was sent.
fn leaf(
    sent: Arc<AtomicU32>,
) -> impl Service<Req, Response = Response<u32>, Error = Infallible, Future: Send> + Clone {
    service_fn(move |_req: Req| {
        let n = sent.fetch_add(1, Ordering::SeqCst) + 1;
        async move {
            if n == 1 {
                tokio::time::sleep(Duration::from_secs(60)).await;
            }
            Ok::<_, Infallible>(Response::new(n))
        }
    })
}

fn request(method: Method) -> Req {
    Request::builder()
        .method(method)
        .uri("http://catalog.local/items")
        .body(Full::default())
        .unwrap()
}

/// A budget with no retries to give.
#[derive(Debug)]
struct Empty;

impl RetryBudget for Empty {
    fn deposit(&self, _: &Dependency, _: Instant) {}
    fn withdraw(&self, _: &Dependency) -> bool {
        false
    }
}

fn hedge() -> HedgeLayer<HttpClassifier, HttpResend> {
    HedgeLayer::http(latency()).dependency("catalog")
}

/// Sends `method` through `layer` over [`leaf`]: the answer (which copy), the copies sent and
/// how long it took.
async fn call(
    layer: HedgeLayer<HttpClassifier, HttpResend>,
    method: Method,
) -> (u32, u32, Duration) {
    let sent = Arc::new(AtomicU32::new(0));
    let svc = ServiceBuilder::new()
        .layer(layer)
        .service(leaf(sent.clone()));
    let started = Instant::now();
    let res = svc.oneshot(request(method)).await.unwrap();
    (*res.body(), sent.load(Ordering::SeqCst), started.elapsed())
}

#[tokio::test(start_paused = true)]
async fn a_read_still_unanswered_at_the_dependencys_latency_is_hedged_and_the_copy_wins() {
    let (answer, sent, took) = call(hedge(), Method::GET).await;
    assert_eq!((answer, sent), (2, 2), "the hedge answered");
    assert!(
        took < Duration::from_millis(100),
        "answered after the hedge's delay, not the minute: {took:?}"
    );
}

#[tokio::test(start_paused = true)]
async fn a_request_that_is_not_replay_safe_is_not_hedged() {
    let (answer, sent, took) = call(hedge(), Method::POST).await;
    assert_eq!((answer, sent), (1, 1), "a POST without a key is sent once");
    assert!(took >= Duration::from_secs(60), "{took:?}");
}

#[tokio::test(start_paused = true)]
async fn a_dependency_without_a_latency_record_is_not_hedged() {
    let unrecorded = hedge().dependency("inventory");
    let (_, sent, _) = call(unrecorded, Method::GET).await;
    assert_eq!(
        sent, 1,
        "no record of inventory's latency: no moment to hedge at"
    );
}

#[tokio::test(start_paused = true)]
async fn a_hedge_the_budget_refuses_is_not_sent() {
    let (_, sent, took) = call(hedge().budget(Arc::new(Empty)), Method::GET).await;
    assert_eq!(sent, 1, "the budget had no retry to pay for a hedge");
    assert!(took >= Duration::from_secs(60), "{took:?}");
}

#[tokio::test(start_paused = true)]
async fn no_hedge_goes_sooner_than_the_minimum_delay() {
    let late = hedge().hedging(Hedging::default().min_delay(Duration::from_secs(5)));
    let (answer, sent, took) = call(late, Method::GET).await;
    assert_eq!((answer, sent), (2, 2));
    assert!(
        took >= Duration::from_secs(5),
        "hedged before the minimum delay: {took:?}"
    );
}
