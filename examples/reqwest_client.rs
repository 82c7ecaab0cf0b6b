//! The whole stack on reqwest, through reqwest's own tower support.
//!
//! `reqwest::Client` is a `tower::Service<reqwest::Request>`; Backstop's HTTP stack speaks
//! `http::Request`. The adapter below converts one to the other (reqwest supports both
//! conversions), and then everything else is the same as on hyper-util: the classifier finds
//! hyper's and hyper-util's errors inside reqwest's, so a refused connection is still *not sent*
//! and a cut-off reply still *unknown*.
//!
//! Run it with `cargo run --example reqwest_client`.

use backstop::{Backstop, BoxError, Outcome, retry::RetryHistory};
use backstop_testkit::{Action, Seen, TestServer, refused_addr};
use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use std::{
    future::Future,
    pin::Pin,
    task::{Context, Poll},
    time::Duration,
};
use tower::{Layer, Service, ServiceExt};

/// `reqwest::Client` as a `Service<http::Request<Full<Bytes>>>`.
#[derive(Clone, Debug)]
struct Reqwest(reqwest::Client);

impl Service<http::Request<Full<Bytes>>> for Reqwest {
    type Response = http::Response<reqwest::Body>;
    type Error = BoxError;
    type Future = Pin<Box<dyn Future<Output = Result<Self::Response, BoxError>> + Send>>;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), BoxError>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, req: http::Request<Full<Bytes>>) -> Self::Future {
        let client = self.0.clone();
        Box::pin(async move {
            let (parts, body) = req.into_parts();
            let body = body.collect().await?.to_bytes();
            let req = reqwest::Request::try_from(http::Request::from_parts(parts, body))?;
            Ok(http::Response::from(client.execute(req).await?))
        })
    }
}

#[tokio::main(flavor = "current_thread")]
pub(crate) async fn main() -> Result<(), BoxError> {
    let carrier = Backstop::http("rates-api")
        .p99(Duration::from_millis(200))
        .deadline(Duration::from_secs(5))
        .build()?
        .layer(Reqwest(reqwest::Client::new()));

    // A flaky read: two 503s, then an answer.
    let rates = TestServer::start(|s: &Seen| {
        if s.index < 2 {
            Action::status(503)
        } else {
            Action::respond(200, &[], r#"{"ground":8.40}"#)
        }
    })
    .await;
    let res = carrier
        .clone()
        .oneshot(http::Request::get(rates.url("/rates")).body(Full::default())?)
        .await?;
    let attempts = RetryHistory::of(&res).map_or(1, |h| h.attempts.len());
    let status = res.status();
    let body = res.into_body().collect().await?.to_bytes();
    println!(
        "GET /rates over reqwest -> {status} after {attempts} attempts: {}",
        String::from_utf8_lossy(&body)
    );
    assert_eq!((status.as_u16(), attempts), (200, 3));

    // Nobody listening: the classifier sees the connect error inside reqwest's error.
    let nowhere = refused_addr().await;
    let err = carrier
        .oneshot(http::Request::get(format!("http://{nowhere}/rates")).body(Full::default())?)
        .await
        .unwrap_err();
    println!("GET to a closed port -> {err}");
    assert_eq!(err.outcome(), Outcome::NotSent);
    assert_eq!(err.attempts(), 3);
    Ok(())
}
