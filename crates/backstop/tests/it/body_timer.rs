//! The body timer follows the end the attempt timeout outside planned for the attempt, and plans
//! its own when none did. Paused clock.

use backstop::{
    BoxError,
    retry::RetryLayer,
    timeout::{AttemptTimeoutLayer, BodyTimedOut, BodyTimeoutLayer, DeadlineLayer},
};
use bytes::Bytes;
use http_body_util::{BodyExt, Full, StreamBody};
use std::time::Duration;
use tokio::time::Instant;
use tower::{Layer, ServiceBuilder, ServiceExt, service_fn};

/// A body that never ends.
type Stalled = StreamBody<futures_util::stream::Pending<Result<http_body::Frame<Bytes>, BoxError>>>;

/// Headers at once, then a body that never ends.
fn stalls() -> impl tower::Service<
    http::Request<Full<Bytes>>,
    Response = http::Response<Stalled>,
    Error = BoxError,
    Future: Send,
> + Clone {
    service_fn(|_req: http::Request<Full<Bytes>>| async {
        Ok::<_, BoxError>(http::Response::new(StreamBody::new(
            futures_util::stream::pending(),
        )))
    })
}

fn get() -> http::Request<Full<Bytes>> {
    http::Request::get("http://slow.local/x")
        .body(Full::default())
        .unwrap()
}

#[tokio::test(start_paused = true)]
async fn the_body_timer_ends_where_the_attempt_timeout_planned() {
    // The attempt timeout cuts attempts at 1 s; the body timer's own limit would be 5 s.
    let svc = ServiceBuilder::new()
        .layer(RetryLayer::http().dependency("slow-api"))
        .layer(AttemptTimeoutLayer::new(Duration::from_secs(1)))
        .layer(BodyTimeoutLayer::new(Some(Duration::from_secs(5))))
        .service(stalls());
    let started = Instant::now();
    let res = svc.oneshot(get()).await.unwrap();
    let err = res.into_body().collect().await.unwrap_err();
    assert!(err.is::<BodyTimedOut>(), "{err}");
    assert_eq!(
        started.elapsed(),
        Duration::from_secs(1),
        "the attempt timeout's plan"
    );
    assert!(err.to_string().contains("slow-api"), "{err}");

    // With no attempt timeout outside, nothing was planned: the layer plans its own 5 s.
    let alone = BodyTimeoutLayer::new(Some(Duration::from_secs(5))).layer(stalls());
    let started = Instant::now();
    let res = alone.oneshot(get()).await.unwrap();
    let err = res.into_body().collect().await.unwrap_err();
    assert!(err.is::<BodyTimedOut>(), "{err}");
    assert_eq!(started.elapsed(), Duration::from_secs(5));
}

#[tokio::test(start_paused = true)]
async fn a_handed_down_end_that_is_the_deadline_is_told_as_the_deadline() {
    let svc = ServiceBuilder::new()
        .layer(DeadlineLayer::new(Duration::from_millis(500)))
        .layer(RetryLayer::http().dependency("slow-api"))
        .layer(AttemptTimeoutLayer::new(Duration::from_secs(1)))
        .layer(BodyTimeoutLayer::new(Some(Duration::from_secs(1))))
        .service(stalls());
    let res = svc.oneshot(get()).await.unwrap();
    let err = res.into_body().collect().await.unwrap_err();
    assert!(err.to_string().contains("500 ms deadline"), "{err}");
}
