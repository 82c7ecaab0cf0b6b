//! The client's promises under the conditions that break them in the field: a body that stalls
//! after its headers, a client that is never ready, stacks nested through lazy futures.

use backstop::{
    Backstop, BoxError, Error, ErrorKind, MemorySink, Outcome,
    backoff::{Backoff, RngSource},
    budget::Budget,
    core::{AttemptTimedOut, DeadlineExceeded},
    timeout::BodyTimedOut,
};
use backstop_testkit::{Action, Seen, TestServer};
use bytes::Bytes;
use http::{Request, Response};
use http_body_util::{BodyExt, Full};
use hyper_util::{client::legacy::Client, rt::TokioExecutor};
use std::{
    sync::Arc,
    task::{Context, Poll},
    time::Duration,
};
use tokio::{
    io::{AsyncReadExt, AsyncWriteExt},
    net::TcpListener,
    time::Instant,
};
use tower::{Layer, Service, ServiceExt, service_fn};

type Body = Full<Bytes>;

fn client() -> Client<hyper_util::client::legacy::connect::HttpConnector, Body> {
    Client::builder(TokioExecutor::new()).build_http()
}

fn builder(
    dep: &str,
) -> Backstop<
    backstop::classify::HttpClassifier,
    backstop::retry::HttpResend,
    backstop::idempotency::HttpKeys,
> {
    Backstop::http(dep)
        .budget(Budget::default())
        .no_breaker()
        .backoff(Backoff::full_jitter(Duration::from_millis(5), Duration::from_millis(20)).unwrap())
        .rng(RngSource::seeded(4))
}

/// A raw TCP server: reads one request's headers, sends response headers promising 1,000
/// bytes, then either says nothing more or sends one byte every 250 ms.
async fn stalling_server(trickle: bool) -> (String, tokio::task::JoinHandle<()>) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let task = tokio::spawn(async move {
        loop {
            let Ok((mut sock, _)) = listener.accept().await else {
                return;
            };
            tokio::spawn(async move {
                let mut buf = Vec::new();
                let mut chunk = [0u8; 1024];
                while !buf.windows(4).any(|w| w == b"\r\n\r\n") {
                    match sock.read(&mut chunk).await {
                        Ok(0) | Err(_) => return,
                        Ok(n) => buf.extend_from_slice(&chunk[..n]),
                    }
                }
                let head = "HTTP/1.1 200 OK\r\ncontent-length: 1000\r\n\r\n";
                if sock.write_all(head.as_bytes()).await.is_err() {
                    return;
                }
                // Bounded: at most 40 bytes over 10 s, then the connection closes.
                for _ in 0..40 {
                    tokio::time::sleep(Duration::from_millis(250)).await;
                    if trickle && sock.write_all(b"x").await.is_err() {
                        return;
                    }
                }
            });
        }
    });
    (format!("http://{addr}/report"), task)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_attempt_timeout_covers_a_body_that_stalls_or_trickles() {
    for trickle in [false, true] {
        let (url, server) = stalling_server(trickle).await;
        let svc = builder("reports-api")
            .deadline(Duration::from_secs(5))
            .attempt_timeout(Duration::from_millis(600))
            .build()
            .unwrap()
            .layer(client());
        let start = Instant::now();
        let res = svc
            .oneshot(Request::get(&url).body(Body::default()).unwrap())
            .await
            .unwrap();
        assert_eq!(res.status(), 200, "the headers arrive at once");
        let err = res.into_body().collect().await.unwrap_err();
        let took = start.elapsed();
        // Which limit cut the body is read off the error (the 600 ms attempt timeout, not the
        // deadline); the clock only shows it was not cut early, which load cannot change.
        assert!(
            took >= Duration::from_millis(590),
            "trickle {trickle}: {took:?}"
        );
        let err = err.downcast::<BodyTimedOut>().unwrap();
        assert_eq!(err.outcome(), Outcome::Unknown);
        assert!(err.limit().is::<AttemptTimedOut>(), "{err}");
        assert_eq!(
            err.to_string(),
            "the response body from reports-api was still arriving when the 600 ms attempt \
             timeout passed; the outcome is unknown (the request reached it), and it was not \
             retried"
        );
        server.abort();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_deadline_covers_the_body_when_it_comes_first() {
    let (url, server) = stalling_server(true).await;
    let svc = builder("reports-api")
        .deadline(Duration::from_secs(1))
        .attempt_timeout(Duration::from_secs(1))
        .build()
        .unwrap()
        .layer(client());
    // The caller's own deadline is tighter than the stack's.
    let mut req = Request::get(&url).body(Body::default()).unwrap();
    backstop::Deadline::after(Duration::from_millis(700)).tighten(&mut req);
    let start = Instant::now();
    let res = svc.oneshot(req).await.unwrap();
    let err = res.into_body().collect().await.unwrap_err();
    let took = start.elapsed();
    assert!(
        took >= Duration::from_millis(690),
        "not cut early: {took:?}"
    );
    // The caller's 700 ms deadline cut it, as the error says, not the stack's 1 s one.
    let err = err.downcast::<BodyTimedOut>().unwrap();
    assert!(err.limit().is::<DeadlineExceeded>(), "{err}");
    assert!(
        err.to_string()
            .contains("when the call's 700 ms deadline passed"),
        "{err}"
    );
    server.abort();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_body_that_ends_in_time_is_whole() {
    let server = TestServer::start(|_: &Seen| Action::respond(200, &[], "all of it")).await;
    let svc = builder("reports-api").build().unwrap().layer(client());
    let res = svc
        .oneshot(
            Request::get(server.url("/r"))
                .body(Body::default())
                .unwrap(),
        )
        .await
        .unwrap();
    let body = res.into_body().collect().await.unwrap().to_bytes();
    assert_eq!(&body[..], b"all of it");
}

/// A client whose `poll_ready` never says yes (a pool that stays exhausted), after `ready_for`
/// ready calls that answer 503.
#[derive(Clone)]
struct Exhausted {
    ready_for: Arc<std::sync::atomic::AtomicU32>,
    sent: Arc<std::sync::atomic::AtomicU32>,
}

impl Service<Request<Body>> for Exhausted {
    type Response = Response<Body>;
    type Error = BoxError;
    type Future = std::future::Ready<Result<Response<Body>, BoxError>>;
    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), BoxError>> {
        use std::sync::atomic::Ordering;
        let left = self.ready_for.load(Ordering::SeqCst);
        if left == 0 {
            return Poll::Pending;
        }
        Poll::Ready(Ok(()))
    }
    fn call(&mut self, _req: Request<Body>) -> Self::Future {
        use std::sync::atomic::Ordering;
        self.ready_for.fetch_sub(1, Ordering::SeqCst);
        self.sent.fetch_add(1, Ordering::SeqCst);
        std::future::ready(Ok(Response::builder()
            .status(503)
            .body(Body::default())
            .unwrap()))
    }
}

fn exhausted(ready_for: u32) -> Exhausted {
    Exhausted {
        ready_for: Arc::new(ready_for.into()),
        sent: Arc::default(),
    }
}

/// One GET through a stack with a 500 ms deadline over `client`: it must end at the deadline.
async fn call_within_500_ms(client: &Exhausted) -> Error {
    let svc = builder("client-guarantees-rates-api")
        .deadline(Duration::from_millis(500))
        .attempt_timeout(Duration::from_millis(200))
        .build()
        .unwrap()
        .layer(client.clone());
    let start = Instant::now();
    let call = svc.oneshot(
        Request::get("http://rates.local/")
            .body(Body::default())
            .unwrap(),
    );
    let err = tokio::time::timeout(Duration::from_secs(5), call)
        .await
        .expect("the call ends at its deadline, not when the client is ready")
        .unwrap_err();
    assert_eq!(start.elapsed(), Duration::from_millis(500));
    err
}

#[tokio::test(start_paused = true)]
async fn the_deadline_bounds_readiness_before_the_first_attempt() {
    let client = exhausted(0);
    let err = call_within_500_ms(&client).await;
    assert_eq!(err.kind(), ErrorKind::DeadlineExceeded);
    assert_eq!(err.outcome(), Outcome::NotSent);
    assert_eq!(err.attempts(), 0);
    assert_eq!(client.sent.load(std::sync::atomic::Ordering::SeqCst), 0);
    assert!(err.to_string().contains("its 500 ms deadline"), "{err}");
}

#[tokio::test(start_paused = true)]
async fn the_deadline_bounds_readiness_before_a_retry() {
    let client = exhausted(1);
    let err = call_within_500_ms(&client).await;
    assert_eq!(err.kind(), ErrorKind::DeadlineExceeded);
    assert_eq!(
        err.attempts(),
        1,
        "one attempt was sent, the second never was"
    );
    assert_eq!(client.sent.load(std::sync::atomic::Ordering::SeqCst), 1);
}

/// The common tower idiom: call the next stack from the future.
fn lazily<S>(
    inner: S,
) -> impl Service<Request<Body>, Response = S::Response, Error = BoxError, Future: Send>
+ Clone
+ Send
+ 'static
where
    S: Service<Request<Body>, Error: Into<BoxError>, Future: Send, Response: Send>
        + Clone
        + Send
        + 'static,
{
    service_fn(move |req: Request<Body>| {
        let inner = inner.clone();
        async move { inner.oneshot(req).await.map_err(Into::into) }
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_nested_stacks_through_lazy_futures_make_one_call() {
    let server = TestServer::start(|_: &Seen| Action::status(503)).await;
    let sinks: Vec<Arc<MemorySink>> = (0..3).map(|_| Arc::new(MemorySink::default())).collect();
    let layer = |i: usize| {
        builder("client-guarantees-payments-api")
            .dead_letters(sinks[i].clone())
            .build()
            .unwrap()
    };
    let innermost = layer(2).layer(client());
    let middle = layer(1).layer(lazily(innermost));
    let outer = layer(0).layer(lazily(middle));
    let post = Request::post(server.url("/charges"))
        .body(Body::from(r#"{"amount":100}"#))
        .unwrap();
    let res = outer.oneshot(post).await.unwrap();
    assert_eq!(res.status(), 503);
    assert_eq!(server.requests(), 3, "3 attempts, not 27");
    // All three attempts carried the one key the outer stack attached.
    let keys: Vec<_> = server
        .seen()
        .iter()
        .map(|s| s.header("idempotency-key").map(str::to_owned))
        .collect();
    assert!(keys[0].is_some());
    assert!(keys.iter().all(|k| k == &keys[0]), "{keys:?}");

    // An error, end to end: one dead letter, one `Error`, not wrapped in another.
    let refused = backstop_testkit::refused_addr().await;
    let innermost = layer(2).layer(client());
    let middle = layer(1).layer(lazily(innermost));
    let outer = layer(0).layer(lazily(middle));
    let post = Request::post(format!("http://{refused}/charges"))
        .body(Body::from(r#"{"amount":100}"#))
        .unwrap();
    let err = outer.oneshot(post).await.unwrap_err();
    assert_eq!(err.attempts(), 3, "{err}");
    let letters: Vec<usize> = sinks.iter().map(|s| s.letters().len()).collect();
    assert_eq!(
        letters,
        vec![1, 0, 0],
        "the outer stack alone writes the dead letter"
    );
    let mut next: Option<&(dyn std::error::Error + 'static)> = std::error::Error::source(&err);
    while let Some(e) = next {
        assert!(!e.is::<Error>(), "an Error inside the Error: {err}");
        next = e.source();
    }
    assert_eq!(
        err.to_string()
            .matches("client-guarantees-payments-api")
            .count(),
        1,
        "{err}"
    );
}

#[tokio::test(start_paused = true)]
async fn a_timeout_raised_under_the_stack_is_an_attempt_timeout() {
    // tower's `TimeoutLayer` under the stack, around a client that never answers: a GET is
    // retried (outcome unknown, but safe to repeat), not failed as "unrecognised".
    let sent = Arc::new(std::sync::atomic::AtomicU32::new(0));
    let count = sent.clone();
    let hangs = service_fn(move |_req: Request<Body>| {
        count.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        async {
            std::future::pending::<()>().await;
            Ok::<Response<Body>, BoxError>(Response::new(Body::default()))
        }
    });
    let client = tower::ServiceBuilder::new()
        .timeout(Duration::from_millis(100))
        .service(hangs);
    let svc = builder("client-guarantees-rates-api")
        .deadline(Duration::from_secs(10))
        .attempt_timeout(Duration::from_secs(1))
        .build()
        .unwrap()
        .layer(client);
    let err = svc
        .oneshot(
            Request::get("http://rates.local/")
                .body(Body::default())
                .unwrap(),
        )
        .await
        .unwrap_err();
    assert_eq!(sent.load(std::sync::atomic::Ordering::SeqCst), 3, "{err}");
    assert_eq!(err.attempts(), 3);
    assert_eq!(err.outcome(), Outcome::Unknown);
    assert_eq!(err.kind(), ErrorKind::TimedOut, "{err}");
    assert!(
        err.to_string()
            .starts_with("client-guarantees-rates-api did not reply in time"),
        "{err}"
    );
}

/// `reqwest::Client` as a `Service<http::Request<Full<Bytes>>>`, as in
/// `examples/reqwest_client.rs`.
#[derive(Clone)]
struct Reqwest(reqwest::Client);

impl Service<Request<Body>> for Reqwest {
    type Response = Response<reqwest::Body>;
    type Error = BoxError;
    type Future = std::pin::Pin<
        Box<dyn std::future::Future<Output = Result<Self::Response, BoxError>> + Send>,
    >;
    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), BoxError>> {
        Poll::Ready(Ok(()))
    }
    fn call(&mut self, req: Request<Body>) -> Self::Future {
        let client = self.0.clone();
        Box::pin(async move {
            let (parts, body) = req.into_parts();
            let body = body.collect().await?.to_bytes();
            let req = reqwest::Request::try_from(Request::from_parts(parts, body))?;
            Ok(Response::from(client.execute(req).await?))
        })
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reqwest_timeout_is_an_attempt_timeout() {
    // A server that reads the request and never answers.
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}/rates", listener.local_addr().unwrap());
    let seen = Arc::new(std::sync::atomic::AtomicU32::new(0));
    let count = seen.clone();
    let server = tokio::spawn(async move {
        while let Ok((mut sock, _)) = listener.accept().await {
            count.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            tokio::spawn(async move {
                let mut buf = [0u8; 1024];
                while let Ok(n) = sock.read(&mut buf).await {
                    if n == 0 {
                        return;
                    }
                }
            });
        }
    });
    let client = reqwest::Client::builder()
        .timeout(Duration::from_millis(150))
        .build()
        .unwrap();
    let svc = builder("client-guarantees-rates-api")
        .deadline(Duration::from_secs(5))
        .attempt_timeout(Duration::from_secs(2))
        .build()
        .unwrap()
        .layer(Reqwest(client));
    let err = svc
        .oneshot(Request::get(&url).body(Body::default()).unwrap())
        .await
        .unwrap_err();
    assert_eq!(err.attempts(), 3, "{err}");
    assert_eq!(seen.load(std::sync::atomic::Ordering::SeqCst), 3);
    assert_eq!(err.outcome(), Outcome::Unknown);
    assert_eq!(err.kind(), ErrorKind::TimedOut, "{err}");
    server.abort();
}
