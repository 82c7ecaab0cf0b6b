//! The fault layer as a user runs it: the same seeded faults (a quarter of the replies lost after
//! the refund was booked, some connections reset before the server saw the request) in front
//! of a refund service behind the replay layer, on real loopback HTTP, called by a naive retry
//! loop and by the Backstop stack. Counted: refunds booked twice for one order.

use backstop::{
    Backstop, BoxError,
    backoff::{Backoff, RngSource},
    chaos::{ChaosLayer, ChaosStats, FaultPlan},
    idempotency::ActionContext,
    replay::{BodyError, MemoryStore, ReplayLayer, ReplayRequestBody},
};
use backstop_testkit::TestServer;
use bytes::Bytes;
use http::{Request, Response};
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper_util::{client::legacy::Client, rt::TokioExecutor};
use std::{
    collections::HashMap,
    sync::{Arc, Mutex},
    time::Duration,
};
use tower::{Layer, ServiceExt, service_fn};

const ORDERS: usize = 150;

fn faults() -> FaultPlan {
    FaultPlan::default().lose_reply(0.25).reset(0.05)
}

/// Bookings per order.
type Ledger = Arc<Mutex<HashMap<String, u32>>>;

/// The refund service, behind the replay layer (it honours keys), behind the seeded faults.
async fn refund_service(seed: u64) -> (TestServer, Ledger, ChaosLayer) {
    let ledger: Ledger = Arc::default();
    let l = ledger.clone();
    let handler = service_fn(move |req: Request<ReplayRequestBody>| {
        let l = l.clone();
        async move {
            let body = req.into_body().collect().await.map_err(|e| e.0)?.to_bytes();
            let order = String::from_utf8_lossy(&body).into_owned();
            *l.lock().unwrap().entry(order).or_default() += 1;
            Ok::<_, BoxError>(Response::new(Full::new(Bytes::from_static(
                b"{\"refund\":\"ok\"}",
            ))))
        }
    });
    // A request without a key runs as it comes (what the naive client sends).
    let replay = ReplayLayer::new(MemoryStore::default())
        .single_tenant()
        .require_key(false)
        .layer(handler)
        .map_request(|r: Request<Incoming>| {
            r.map(|b| b.map_err(|e| BodyError(e.into())).boxed_unsync())
        });
    let chaos = ChaosLayer::new(faults(), seed).unwrap();
    let server = TestServer::serve(chaos.layer(replay)).await;
    (server, ledger, chaos)
}

fn refund(url: &str, order: usize) -> Request<Full<Bytes>> {
    Request::post(url)
        .header("content-type", "text/plain")
        .body(Full::new(Bytes::from(format!("order-{order}"))))
        .unwrap()
}

struct Tally {
    duplicates: u32,
    refunded: usize,
    failed: usize,
    faults: ChaosStats,
}

fn tally(ledger: &Ledger, failed: usize, faults: ChaosStats) -> Tally {
    let l = ledger.lock().unwrap();
    Tally {
        duplicates: l.values().map(|n| n.saturating_sub(1)).sum(),
        refunded: l.len(),
        failed,
        faults,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn under_the_same_faults_a_naive_retry_refunds_twice_and_backstop_never_does() {
    let client = Client::builder(TokioExecutor::new()).build_http::<Full<Bytes>>();

    // A naive retry: any error, up to three attempts, no key.
    let (server, ledger, chaos) = refund_service(11).await;
    let mut failed = 0;
    for order in 0..ORDERS {
        let mut ok = false;
        for _ in 0..3 {
            if let Ok(res) = client.request(refund(&server.url("/refunds"), order)).await
                && res.status().is_success()
            {
                ok = true;
                break;
            }
        }
        failed += usize::from(!ok);
    }
    let naive = tally(&ledger, failed, chaos.stats());

    // The Backstop stack: a key per refund, the server honours it. Budget and breaker off, so
    // that both clients retry as often and the difference is the key alone.
    let (server, ledger, chaos) = refund_service(11).await;
    let stack = Backstop::http("refunds")
        .honours_keys()
        .max_attempts(3)
        .backoff(Backoff::full_jitter(Duration::from_millis(1), Duration::from_millis(5)).unwrap())
        .rng(RngSource::seeded(5))
        .no_budget()
        .no_breaker()
        .build()
        .unwrap()
        .layer(client);
    let mut failed = 0;
    for order in 0..ORDERS {
        let mut req = refund(&server.url("/refunds"), order);
        req.extensions_mut().insert(ActionContext::tool_call(
            "run-chaos",
            &format!("refund-{order}"),
            "",
        ));
        let ok = stack
            .clone()
            .oneshot(req)
            .await
            .is_ok_and(|r| r.status().is_success());
        failed += usize::from(!ok);
    }
    let backstop = tally(&ledger, failed, chaos.stats());

    for (name, t) in [("naive retry", &naive), ("backstop", &backstop)] {
        println!(
            "{name}: {} orders refunded, {} duplicates ({:.1} %), {} calls failed; faults {:?}",
            t.refunded,
            t.duplicates,
            100.0 * f64::from(t.duplicates) / ORDERS as f64,
            t.failed,
            t.faults
        );
    }
    assert!(
        naive.faults.lost_replies > 20,
        "the faults happened: {:?}",
        naive.faults
    );
    assert!(
        naive.duplicates > 10,
        "a lost reply retried without a key refunds twice"
    );
    assert_eq!(
        backstop.duplicates, 0,
        "with a key the repeat is replayed, not booked"
    );
    assert!(backstop.faults.lost_replies > 20, "{:?}", backstop.faults);
    assert!(
        backstop.refunded >= ORDERS - 3 && backstop.failed <= 3,
        "and almost every call still succeeded: {} refunded, {} failed",
        backstop.refunded,
        backstop.failed
    );
}
