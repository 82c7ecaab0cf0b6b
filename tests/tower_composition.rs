//! tower's `ConcurrencyLimit`, `RateLimit` and `hedge` composed with the stack, where the
//! README puts them: under the stack, around the client, so they see attempts. Against real
//! loopback servers, on the real clock with short durations.

use backstop::{Backstop, ErrorKind, Outcome, Preset};
use backstop_testkit::{Action, TestServer};
use bytes::Bytes;
use http_body_util::Full;
use hyper_util::{client::legacy::Client, rt::TokioExecutor};
use std::{
    sync::{
        Arc,
        atomic::{AtomicUsize, Ordering},
    },
    time::Duration,
};
use tokio::time::Instant;
use tower::{Layer, ServiceBuilder, ServiceExt, hedge::Hedge};

type Body = Full<Bytes>;

fn client() -> Client<hyper_util::client::legacy::connect::HttpConnector, Body> {
    Client::builder(TokioExecutor::new()).build_http::<Body>()
}

fn get(url: String) -> http::Request<Body> {
    http::Request::get(url).body(Body::default()).unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_concurrency_limit_under_the_stack_bounds_attempts_in_flight() {
    let now = Arc::new(AtomicUsize::new(0));
    let peak = Arc::new(AtomicUsize::new(0));
    let (n, p) = (now.clone(), peak.clone());
    let server = TestServer::serve(tower::service_fn(
        move |_req: http::Request<hyper::body::Incoming>| {
            let (n, p) = (n.clone(), p.clone());
            async move {
                let inflight = n.fetch_add(1, Ordering::SeqCst) + 1;
                p.fetch_max(inflight, Ordering::SeqCst);
                tokio::time::sleep(Duration::from_millis(60)).await;
                n.fetch_sub(1, Ordering::SeqCst);
                Ok::<_, std::convert::Infallible>(http::Response::new(Body::default()))
            }
        },
    ))
    .await;
    // README block 7's shape: the limit around the client, the stack on top.
    let limited = ServiceBuilder::new().concurrency_limit(2).service(client());
    let search = Backstop::http("search-api")
        .preset(Preset::ReadOnly)
        .no_breaker()
        .build()
        .unwrap()
        .layer(limited);
    let calls = (0..6).map(|_| search.clone().oneshot(get(server.url("/q"))));
    for res in futures_join_all(calls).await {
        assert_eq!(res.unwrap().status(), 200);
    }
    assert!(
        peak.load(Ordering::SeqCst) <= 2,
        "{}",
        peak.load(Ordering::SeqCst)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rate_limit_under_the_stack_waits_within_the_deadline_and_no_longer() {
    let server = TestServer::start(|_| Action::status(200)).await;
    // RateLimit is not Clone: a Buffer in front of it makes it shareable.
    let limited = ServiceBuilder::new()
        .buffer(16)
        .rate_limit(1, Duration::from_millis(400))
        .service(client());
    let api = Backstop::http("rated-api")
        .preset(Preset::ReadOnly)
        .no_breaker()
        .deadline(Duration::from_millis(250))
        .attempt_timeout(Duration::from_millis(200))
        .build()
        .unwrap()
        .layer(limited);
    assert_eq!(
        api.clone()
            .oneshot(get(server.url("/1")))
            .await
            .unwrap()
            .status(),
        200
    );
    // The next attempt may not start for 400 ms; the call's deadline is 250 ms.
    let started = Instant::now();
    let err = api.oneshot(get(server.url("/2"))).await.unwrap_err();
    let waited = started.elapsed();
    assert!(waited < Duration::from_millis(390), "waited {waited:?}");
    assert_eq!(err.kind(), ErrorKind::DeadlineExceeded, "{err}");
    // The Buffer took the request, so to the stack it was handed over: its outcome is unknown
    // (a read, here, so nothing is lost by saying so), though it never reached the server.
    assert_eq!(err.outcome(), Outcome::Unknown, "{err}");
    assert_eq!(
        server.requests(),
        1,
        "the second call never reached the server"
    );
}

/// Hedges only requests that are safe to send twice: reads with a body that can be copied.
#[derive(Clone)]
struct ReadsOnly;

impl tower::hedge::Policy<http::Request<Body>> for ReadsOnly {
    fn clone_request(&self, req: &http::Request<Body>) -> Option<http::Request<Body>> {
        if !matches!(*req.method(), http::Method::GET | http::Method::HEAD) {
            return None;
        }
        let mut copy = http::Request::new(req.body().clone());
        *copy.method_mut() = req.method().clone();
        *copy.uri_mut() = req.uri().clone();
        *copy.headers_mut() = req.headers().clone();
        *copy.extensions_mut() = req.extensions().clone();
        Some(copy)
    }
    fn can_retry(&self, _req: &http::Request<Body>) -> bool {
        true
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hedge_under_the_stack_sends_a_second_read_but_never_a_second_write() {
    let seen = Arc::new(AtomicUsize::new(0));
    let s = seen.clone();
    // The read's first request never answers and the hedge's copy answers at once; the write
    // is answered after 300 ms, long after a hedge (due at 20 ms) would have reached the server.
    let server = TestServer::start(move |seen| {
        let n = s.fetch_add(1, Ordering::SeqCst);
        match (seen.method.as_str(), n) {
            ("GET", 0) => Action::Hang,
            ("GET", _) => Action::status(200),
            _ => Action::Delay(
                Duration::from_millis(300),
                backstop_testkit::response(200, &[], ""),
            ),
        }
    })
    .await;
    // Hedge after the 90th percentile of past latencies (here, mocked at 20 ms). Hedge is not
    // Clone: a Buffer in front of it makes it shareable.
    let hedged = tower::buffer::Buffer::new(
        Hedge::new_with_mock_latencies(
            client(),
            ReadsOnly,
            10,
            0.9,
            Duration::from_secs(10),
            &[20; 20],
        ),
        64,
    );
    let layer = Backstop::http("catalog-api")
        .no_breaker()
        .attempt_timeout(Duration::from_secs(2))
        .build()
        .unwrap();
    let reads = layer.layer(hedged.clone());
    // The first request hangs: only the hedge can answer.
    let res = reads.oneshot(get(server.url("/item/7"))).await.unwrap();
    assert_eq!(res.status(), 200);
    assert_eq!(seen.load(Ordering::SeqCst), 2, "one read, one hedge");

    // A write is never hedged: one request, however slow.
    seen.store(0, Ordering::SeqCst);
    let writes = layer.layer(hedged);
    let post = http::Request::post(server.url("/orders"))
        .body(Body::from("{}"))
        .unwrap();
    let res = writes.oneshot(post).await.unwrap();
    assert_eq!(res.status(), 200);
    assert_eq!(seen.load(Ordering::SeqCst), 1);
}

async fn futures_join_all<F>(futs: impl Iterator<Item = F>) -> Vec<F::Output>
where
    F: std::future::Future + Send + 'static,
    F::Output: Send + 'static,
{
    let handles: Vec<_> = futs.map(tokio::spawn).collect();
    let mut out = Vec::new();
    for h in handles {
        out.push(h.await.unwrap());
    }
    out
}

/// tower's readiness contract, and what the stack does with it: its `poll_ready` is always
/// ready, and a call whose client is not ready waits inside the call, bounded by its deadline.
/// A `load_shed` outside the stack therefore never sheds; the call ends at its deadline instead,
/// not sent. Without the stack, the same `load_shed` sheds at once. Paused clock.
#[tokio::test(start_paused = true)]
async fn load_shed_outside_sees_no_backpressure_and_the_deadline_bounds_the_wait_instead() {
    use backstop::{BoxError, Deadline};
    let client = || {
        tower::service_fn(|req: http::Request<Body>| async move {
            if req.uri().path() == "/hold" {
                std::future::pending::<()>().await;
            }
            Ok::<_, BoxError>(http::Response::new(Body::default()))
        })
    };
    // One call at a time: the first holds the client's only permit.
    let limited = ServiceBuilder::new().concurrency_limit(1).service(client());
    let api = Backstop::http("limited-api")
        .preset(Preset::ReadOnly)
        .no_breaker()
        .deadline(Duration::from_secs(1))
        .attempt_timeout(Duration::from_millis(800))
        .build()
        .unwrap()
        .layer(limited);
    let shed = ServiceBuilder::new().load_shed().service(api);
    let holding = tokio::spawn(
        shed.clone()
            .oneshot(get("http://limited.local/hold".into())),
    );
    tokio::task::yield_now().await;
    // The second call is not shed: the stack says it is ready, and waits for the client.
    let mut second = get("http://limited.local/quick".into());
    second
        .extensions_mut()
        .insert(Deadline::after(Duration::from_millis(100)));
    let started = Instant::now();
    let err = shed.clone().oneshot(second).await.unwrap_err();
    assert!(
        !err.is::<tower::load_shed::error::Overloaded>(),
        "the stack's readiness hides the limit from load_shed: {err}"
    );
    let err = backstop::Error::from_box(err);
    assert_eq!(err.kind(), ErrorKind::DeadlineExceeded, "{err}");
    assert_eq!(err.outcome(), Outcome::NotSent, "{err}");
    assert_eq!(
        started.elapsed(),
        Duration::from_millis(100),
        "its own deadline"
    );
    // Once the first call's attempt times out and frees the permit, calls go through again.
    let first = backstop::Error::from_box(holding.await.unwrap().unwrap_err());
    assert_eq!(first.outcome(), Outcome::Unknown, "{first}");
    let res = shed.oneshot(get("http://limited.local/quick".into())).await;
    assert!(res.is_ok());

    // Without the stack, load_shed sees the limit and sheds the second call at once.
    let bare = ServiceBuilder::new()
        .load_shed()
        .concurrency_limit(1)
        .service(client());
    let _holding = tokio::spawn(
        bare.clone()
            .oneshot(get("http://limited.local/hold".into())),
    );
    tokio::task::yield_now().await;
    let err = bare
        .oneshot(get("http://limited.local/quick".into()))
        .await
        .unwrap_err();
    assert!(err.is::<tower::load_shed::error::Overloaded>(), "{err}");
}
