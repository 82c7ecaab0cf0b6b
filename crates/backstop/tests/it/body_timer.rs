//! The composed stack's body timer follows the end the retry layer planned for the attempt
//! (`BodyTimeoutLayer::handed_down`), and plans its own when no retry layer planned one. Paused
//! clock.

use backstop::{
    BoxError,
    retry::RetryLayer,
    timeout::{BodyTimedOut, BodyTimeoutLayer},
};
use bytes::Bytes;
use http_body_util::{BodyExt, Full, StreamBody};
use std::time::Duration;
use tokio::time::Instant;
use tower::{Layer, ServiceExt, service_fn};

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
async fn a_handed_down_body_timer_ends_where_the_retry_layer_planned() {
    // The retry layer cuts attempts at 1 s; the body timer's own limit would be 5 s.
    let svc = RetryLayer::http()
        .dependency("slow-api")
        .attempt_timeout(Duration::from_secs(1))
        .layer(
            BodyTimeoutLayer::new(Some(Duration::from_secs(5)))
                .handed_down()
                .layer(stalls()),
        );
    let started = Instant::now();
    let res = svc.oneshot(get()).await.unwrap();
    let err = res.into_body().collect().await.unwrap_err();
    assert!(err.is::<BodyTimedOut>(), "{err}");
    assert_eq!(
        started.elapsed(),
        Duration::from_secs(1),
        "the retry layer's plan"
    );
    assert!(err.to_string().contains("slow-api"), "{err}");

    // With no retry layer outside, nothing was planned: the layer plans its own 5 s.
    let alone = BodyTimeoutLayer::new(Some(Duration::from_secs(5)))
        .handed_down()
        .layer(stalls());
    let started = Instant::now();
    let res = alone.oneshot(get()).await.unwrap();
    let err = res.into_body().collect().await.unwrap_err();
    assert!(err.is::<BodyTimedOut>(), "{err}");
    assert_eq!(started.elapsed(), Duration::from_secs(5));
}

#[tokio::test(start_paused = true)]
async fn a_handed_down_end_that_is_the_deadline_is_told_as_the_deadline() {
    let svc = RetryLayer::http()
        .dependency("slow-api")
        .deadline(Duration::from_millis(500))
        .attempt_timeout(Duration::from_secs(1))
        .layer(
            BodyTimeoutLayer::new(Some(Duration::from_secs(1)))
                .handed_down()
                .layer(stalls()),
        );
    let res = svc.oneshot(get()).await.unwrap();
    let err = res.into_body().collect().await.unwrap_err();
    assert!(err.to_string().contains("500 ms deadline"), "{err}");
}
