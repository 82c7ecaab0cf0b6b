//! The composed stack over a client: every attempt carries the call context (its number, its
//! deadline, its end), and each response body ends at its own attempt's end, which the attempt
//! timeout hands down to the body timer inside it. Paused clock.

use backstop::{
    Backstop, BoxError,
    backoff::{Backoff, RngSource},
    core::CallContext,
    timeout::BodyTimedOut,
};
use bytes::Bytes;
use http_body_util::{BodyExt, Full, StreamBody};
use std::sync::{
    Arc, Mutex,
    atomic::{AtomicU32, Ordering},
};
use std::time::Duration;
use tokio::time::Instant;
use tower::{Layer, Service, ServiceExt, service_fn};

/// A body that never ends.
type Stalled = StreamBody<futures_util::stream::Pending<Result<http_body::Frame<Bytes>, BoxError>>>;

type Req = http::Request<Full<Bytes>>;

/// What the client saw of each attempt: whether it carried a call context, and its attempt
/// header.
#[derive(Clone, Default)]
struct Seen(Arc<Mutex<Vec<Attempt>>>);

/// One attempt as the client saw it: a call context or none, and the attempt header.
type Attempt = (bool, Option<String>);

impl Seen {
    fn all(&self) -> Vec<Attempt> {
        self.0.lock().unwrap().clone()
    }
}

/// Answers `503` to the first `busy` attempts, then headers at once and a body that never
/// ends; records what each attempt carried.
fn client(
    busy: u32,
    seen: Seen,
) -> impl Service<Req, Response = http::Response<Stalled>, Error = BoxError, Future: Send>
+ Clone
+ Send
+ 'static {
    let n = Arc::new(AtomicU32::new(0));
    service_fn(move |req: Req| {
        let header = req
            .headers()
            .get("x-attempt")
            .map(|v| v.to_str().unwrap().to_owned());
        seen.0
            .lock()
            .unwrap()
            .push((CallContext::of(&req).is_some(), header));
        let status = if n.fetch_add(1, Ordering::SeqCst) < busy {
            503
        } else {
            200
        };
        async move {
            let mut res = http::Response::new(StreamBody::new(futures_util::stream::pending()));
            *res.status_mut() = http::StatusCode::from_u16(status).unwrap();
            Ok::<_, BoxError>(res)
        }
    })
}

/// The error the body ends with (a body the timer never ends fails the test, at a minute).
async fn body_error(res: http::Response<impl http_body::Body<Error = BoxError>>) -> BoxError {
    tokio::time::timeout(Duration::from_secs(60), res.into_body().collect())
        .await
        .expect("the body timer ends the body")
        .err()
        .expect("a body that never ends cannot end well")
}

fn get() -> Req {
    http::Request::get("http://slow.local/x")
        .body(Full::default())
        .unwrap()
}

fn stack() -> Backstop<
    backstop::classify::HttpClassifier,
    backstop::retry::HttpResend,
    backstop::idempotency::HttpKeys,
> {
    Backstop::http("slow-api")
        .rng(RngSource::seeded(3))
        .backoff(Backoff::constant(Duration::from_millis(100)))
        .attempt_timeout(Duration::from_secs(1))
}

#[tokio::test(start_paused = true)]
async fn every_attempt_carries_the_context_and_its_body_ends_at_the_attempts_end() {
    let seen = Seen::default();
    let svc = stack().build().unwrap().layer(client(0, seen.clone()));
    let started = Instant::now();
    let res = svc.oneshot(get()).await.unwrap();
    let err = body_error(res).await;
    assert!(err.is::<BodyTimedOut>(), "{err}");
    assert_eq!(started.elapsed(), Duration::from_secs(1));
    assert!(err.to_string().contains("slow-api"), "{err}");
    assert!(err.to_string().contains("1 s attempt timeout"), "{err}");
    assert_eq!(seen.all(), [(true, None)]);
}

#[tokio::test(start_paused = true)]
async fn a_retried_answers_body_ends_at_its_own_attempts_end() {
    // 503 at once, 100 ms of backoff, then headers and a stalled body: the body ends 1 s after
    // the second attempt began, not after the first.
    let seen = Seen::default();
    let layer = stack().build().unwrap();
    let started = Instant::now();
    let res = layer.layer(client(1, seen.clone())).oneshot(get()).await;
    let res = res.unwrap();
    assert_eq!(res.status(), 200);
    let err = body_error(res).await;
    assert!(err.is::<BodyTimedOut>(), "{err}");
    assert_eq!(started.elapsed(), Duration::from_millis(1100));
    assert_eq!(seen.all().len(), 2);
}

#[tokio::test(start_paused = true)]
async fn a_body_cut_by_the_deadline_says_so() {
    // Two 503s, then the third attempt begins at 200 ms: its 900 ms would pass the 1 s
    // deadline, so the deadline ends its body.
    let svc = stack()
        .attempt_timeout(Duration::from_millis(900))
        .deadline(Duration::from_secs(1))
        .build()
        .unwrap()
        .layer(client(2, Seen::default()));
    let started = Instant::now();
    let res = svc.oneshot(get()).await.unwrap();
    let err = body_error(res).await;
    assert_eq!(started.elapsed(), Duration::from_secs(1));
    assert!(err.to_string().contains("1 s deadline"), "{err}");
}

#[tokio::test(start_paused = true)]
async fn the_attempt_header_numbers_every_attempt() {
    let seen = Seen::default();
    let svc = stack()
        .attempt_header(http::HeaderName::from_static("x-attempt"))
        .build()
        .unwrap()
        .layer(client(1, seen.clone()));
    let res = svc.oneshot(get()).await.unwrap();
    assert_eq!(res.status(), 200);
    assert_eq!(
        seen.all(),
        [(true, Some("1".to_owned())), (true, Some("2".to_owned()))]
    );
}
