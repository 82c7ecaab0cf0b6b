//! tower's `ConcurrencyLimit`, `RateLimit` and `hedge` composed with the stack, where the
//! guide puts them: under the stack, around the client, so they see attempts. Against real
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
    // The guide's shape (composing by hand): the limit around the client, the stack on top.
    let limited = ServiceBuilder::new().concurrency_limit(2).service(client());
    let search = Backstop::http("tower-composition-search-api")
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
    // The deadline, not the rate, ends the call: had the stack waited the 400 ms out, the
    // request would have reached the server (counted below), whatever the machine's load.
    let started = Instant::now();
    let err = api.oneshot(get(server.url("/2"))).await.unwrap_err();
    // Ended by the stack's own limits (the 200 ms attempt timeout comes first), never early.
    assert!(
        started.elapsed() >= Duration::from_millis(200),
        "ended by its limits"
    );
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

/// tower's readiness contract through the stack, on the paused clock: `poll_ready` answers what
/// the client under it answers, and each attempt goes out on the handle that was polled ready.
/// `ConcurrencyLimit` panics when `call` comes on a handle that holds no permit, so every test
/// here also checks that the call used the reserved handle.
mod readiness {
    use super::*;
    use backstop::{BoxError, Error};
    use std::{
        future::Future,
        pin::Pin,
        task::{Context, Poll},
    };
    use tower::{Service, buffer::Buffer, limit::ConcurrencyLimit};

    /// A client that answers after 100 ms, and counts its calls.
    fn slow(
        calls: Arc<AtomicUsize>,
    ) -> ConcurrencyLimit<
        impl Service<
            http::Request<Body>,
            Response = http::Response<Body>,
            Error = BoxError,
            Future: Send,
        > + Clone,
    > {
        ConcurrencyLimit::new(
            tower::service_fn(move |_req: http::Request<Body>| {
                calls.fetch_add(1, Ordering::SeqCst);
                async {
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    Ok::<_, BoxError>(http::Response::new(Body::default()))
                }
            }),
            1,
        )
    }

    fn stack(
        deadline: Option<Duration>,
    ) -> backstop::BackstopLayer<
        backstop::classify::HttpClassifier,
        backstop::retry::HttpResend,
        backstop::idempotency::HttpKeys,
    > {
        let b = Backstop::http("limited-api")
            .no_breaker()
            .no_budget()
            .attempt_timeout(Duration::from_secs(1));
        match deadline {
            Some(d) => b.deadline(d),
            None => b.no_deadline(),
        }
        .build()
        .unwrap()
    }

    fn quick() -> http::Request<Body> {
        get("http://limited.local/quick".into())
    }

    /// One long-lived handle (`ready().await`, then `call`, twice) over a limit of one: each
    /// call is answered right after the one before, with and without a deadline.
    #[tokio::test(start_paused = true)]
    async fn a_kept_handle_over_a_limit_of_one_serves_each_call_in_turn() {
        for deadline in [Some(Duration::from_secs(5)), None] {
            let calls = Arc::new(AtomicUsize::new(0));
            let mut svc = stack(deadline).layer(slow(calls.clone()));
            let started = Instant::now();
            let first = tokio::spawn(svc.ready().await.unwrap().call(quick()));
            // Ready again once the first call's attempt gives its permit back.
            let second = svc.ready().await.unwrap().call(quick()).await;
            let first = first.await.unwrap();
            assert!(
                first.is_ok() && second.is_ok(),
                "{deadline:?}: {first:?} {second:?}"
            );
            assert_eq!(
                started.elapsed(),
                Duration::from_millis(200),
                "{deadline:?}"
            );
            assert_eq!(calls.load(Ordering::SeqCst), 2);
        }
    }

    /// The usual way to share a service across tasks: a `Buffer` in front, its worker driving
    /// one handle. Three callers at once over a limit of one inside: answered at 100, 200 and
    /// 300 ms, none at the deadline.
    #[tokio::test(start_paused = true)]
    async fn a_buffer_in_front_of_a_limit_inside_serves_every_caller() {
        let calls = Arc::new(AtomicUsize::new(0));
        let shared = Buffer::new(
            stack(Some(Duration::from_secs(5))).layer(slow(calls.clone())),
            8,
        );
        let started = Instant::now();
        let callers: Vec<_> = (0..3)
            .map(|_| {
                let svc = shared.clone();
                tokio::spawn(async move { svc.oneshot(quick()).await.map(|_| Instant::now()) })
            })
            .collect();
        let mut ends = Vec::new();
        for caller in callers {
            ends.push(
                caller
                    .await
                    .unwrap()
                    .expect("answered")
                    .duration_since(started),
            );
        }
        ends.sort();
        let ms = |n| Duration::from_millis(n);
        assert_eq!(ends, [ms(100), ms(200), ms(300)]);
        assert_eq!(calls.load(Ordering::SeqCst), 3);
    }

    /// A `load_shed` outside the stack sees the limit inside: while the only permit is held, the
    /// next call is shed at once, not sent; once it is free, calls go through again.
    #[tokio::test(start_paused = true)]
    async fn a_load_shed_outside_sheds_while_the_limit_inside_is_full() {
        let calls = Arc::new(AtomicUsize::new(0));
        let shed = ServiceBuilder::new()
            .load_shed()
            .service(stack(Some(Duration::from_secs(5))).layer(slow(calls.clone())));
        let holding = tokio::spawn(shed.clone().oneshot(quick()));
        tokio::task::yield_now().await;
        let started = Instant::now();
        let err = shed.clone().oneshot(quick()).await.unwrap_err();
        assert!(err.is::<tower::load_shed::error::Overloaded>(), "{err}");
        assert_eq!(started.elapsed(), Duration::ZERO, "shed at once");
        assert_eq!(
            calls.load(Ordering::SeqCst),
            1,
            "the shed call was not sent"
        );
        holding.await.unwrap().unwrap();
        shed.oneshot(quick()).await.unwrap();
        assert_eq!(calls.load(Ordering::SeqCst), 2);
    }

    /// A balancer over two stacks (`tower::balance::p2c`) sees each one's readiness: while one
    /// stack's client has its only permit reserved (by a handle beside the stack), every call
    /// goes to the other and is answered in 100 ms, none waits behind the full one.
    #[tokio::test(start_paused = true)]
    async fn a_balancer_over_two_stacks_sends_each_call_to_the_ready_one() {
        use tower::{
            balance::p2c::Balance,
            discover::ServiceList,
            load::{CompleteOnResponse, PendingRequests},
        };
        let (full, free) = (Arc::new(AtomicUsize::new(0)), Arc::new(AtomicUsize::new(0)));
        let a = slow(full.clone());
        let b = slow(free.clone());
        // A's only permit, reserved beside the stack (a ready handle holds it) and never used.
        let mut beside = a.clone();
        beside.ready().await.unwrap();
        let stacks = [a, b].map(|client| {
            PendingRequests::new(
                stack(Some(Duration::from_secs(5))).layer(client),
                CompleteOnResponse::default(),
            )
        });
        let mut balance = Balance::new(ServiceList::new(stacks.into_iter().collect::<Vec<_>>()));
        for _ in 0..10 {
            let started = Instant::now();
            let res = balance.ready().await.unwrap().call(quick()).await;
            assert!(res.is_ok(), "{res:?}");
            assert_eq!(started.elapsed(), Duration::from_millis(100));
        }
        assert_eq!(
            free.load(Ordering::SeqCst),
            10,
            "every call went to the ready stack"
        );
        assert_eq!(full.load(Ordering::SeqCst), 0, "none reached the full one");
        drop(beside);
    }

    /// A client that is never ready and is never called.
    #[derive(Clone)]
    struct NeverReady;

    impl Service<http::Request<Body>> for NeverReady {
        type Response = http::Response<Body>;
        type Error = BoxError;
        type Future = Pin<Box<dyn Future<Output = Result<Self::Response, BoxError>> + Send>>;
        fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), BoxError>> {
            Poll::Pending
        }
        fn call(&mut self, _req: http::Request<Body>) -> Self::Future {
            panic!("called without being ready")
        }
    }

    /// The deadline bounds a client that never becomes ready: `poll_ready` answers `Ready` when
    /// the stack's deadline has passed since the first `Pending`, and the call ends at once,
    /// `DeadlineExceeded`, not sent, the client never called. Without a deadline the stack
    /// stays pending, as the client does.
    #[tokio::test(start_paused = true)]
    async fn the_deadline_bounds_a_client_that_never_becomes_ready() {
        let started = Instant::now();
        let call = stack(Some(Duration::from_secs(2)))
            .layer(NeverReady)
            .oneshot(quick());
        let err = tokio::time::timeout(Duration::from_secs(10), call)
            .await
            .expect("ended by the deadline")
            .unwrap_err();
        assert_eq!(started.elapsed(), Duration::from_secs(2));
        assert_eq!(err.kind(), ErrorKind::DeadlineExceeded, "{err}");
        assert_eq!(err.outcome(), Outcome::NotSent, "{err}");
        assert!(err.to_string().contains("limited-api"), "{err}");

        // A kept handle: the next wait starts the deadline again.
        let mut svc = stack(Some(Duration::from_secs(2))).layer(NeverReady);
        for _ in 0..2 {
            let started = Instant::now();
            let ready = tokio::time::timeout(Duration::from_secs(10), svc.ready()).await;
            let err: Error = ready
                .expect("ended by the deadline")
                .unwrap()
                .call(quick())
                .await
                .unwrap_err();
            assert_eq!(started.elapsed(), Duration::from_secs(2));
            assert_eq!(err.outcome(), Outcome::NotSent, "{err}");
        }

        let pending = stack(None).layer(NeverReady).oneshot(quick());
        let waited = tokio::time::timeout(Duration::from_secs(3600), pending).await;
        assert!(
            waited.is_err(),
            "no deadline: pending as long as the client is"
        );
    }

    /// A wait that outlasted the deadline answered `Ready`, but the caller did not call; once the
    /// client is ready after all, the next `poll_ready` says so and the call is sent on that
    /// handle, not ended as never ready.
    #[tokio::test(start_paused = true)]
    async fn a_handle_ready_again_after_an_expired_wait_sends_its_call() {
        let calls = Arc::new(AtomicUsize::new(0));
        let seen = calls.clone();
        let limited = ConcurrencyLimit::new(
            tower::service_fn(move |req: http::Request<Body>| {
                seen.fetch_add(1, Ordering::SeqCst);
                async move {
                    let hold = if req.uri().path() == "/hold" {
                        3_000
                    } else {
                        100
                    };
                    tokio::time::sleep(Duration::from_millis(hold)).await;
                    Ok::<_, BoxError>(http::Response::new(Body::default()))
                }
            }),
            1,
        );
        // The limit's only permit is held for 3 s by a caller beside the stack (clones of a
        // `ConcurrencyLimit` share it), longer than the stack's 1 s deadline.
        let mut beside = limited.clone();
        let holding = tokio::spawn(
            beside
                .ready()
                .await
                .unwrap()
                .call(get("http://limited.local/hold".into())),
        );
        let mut svc = stack(Some(Duration::from_secs(1))).layer(limited);
        // The wait answers Ready at the 1 s deadline, and again at once when asked again, as
        // tower's contract wants.
        let started = Instant::now();
        svc.ready().await.unwrap();
        svc.ready().await.unwrap();
        assert_eq!(started.elapsed(), Duration::from_secs(1));
        // The caller does not call; the holding call ends and frees the permit.
        holding.await.unwrap().unwrap();
        let res = svc.ready().await.unwrap().call(quick()).await;
        assert!(res.is_ok(), "sent on the handle ready again: {res:?}");
        assert_eq!(calls.load(Ordering::SeqCst), 2);
    }

    /// Each retry waits for its own handle's readiness: a retried call holds the limit's permit
    /// only while an attempt is in flight, so a second caller's call goes between its attempts.
    #[tokio::test(start_paused = true)]
    async fn each_retry_waits_for_readiness_on_its_own_handle() {
        let calls = Arc::new(AtomicUsize::new(0));
        let seen = calls.clone();
        let busy_once = ConcurrencyLimit::new(
            tower::service_fn(move |req: http::Request<Body>| {
                let n = seen.fetch_add(1, Ordering::SeqCst);
                async move {
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    // The first attempt of the retried call is answered 503.
                    let status = if n == 0 && req.uri().path() == "/retried" {
                        503
                    } else {
                        200
                    };
                    Ok::<_, BoxError>(
                        http::Response::builder()
                            .status(status)
                            .body(Body::default())
                            .unwrap(),
                    )
                }
            }),
            1,
        );
        let svc = Backstop::http("limited-api")
            .no_breaker()
            .no_budget()
            .backoff(backstop::backoff::Backoff::constant(Duration::from_millis(
                50,
            )))
            .rng(backstop::backoff::RngSource::seeded(1))
            .build()
            .unwrap()
            .layer(busy_once);
        let started = Instant::now();
        let retried = tokio::spawn(
            svc.clone()
                .oneshot(get("http://limited.local/retried".into())),
        );
        tokio::time::sleep(Duration::from_millis(120)).await;
        // Sent during the retried call's backoff: the permit is free then.
        let other = svc.oneshot(quick()).await.unwrap();
        assert_eq!(other.status(), 200);
        assert_eq!(started.elapsed(), Duration::from_millis(220));
        let res = retried.await.unwrap().unwrap();
        assert_eq!(res.status(), 200);
        // Its retry waited for the permit the other call held, then took 100 ms.
        assert_eq!(started.elapsed(), Duration::from_millis(320));
        assert_eq!(calls.load(Ordering::SeqCst), 3);
    }
}
