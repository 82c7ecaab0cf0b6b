//! The whole stack on reqwest, in one call: `BackstopLayer::reqwest(client)`.
//!
//! `reqwest::Request` keeps its extensions private, so the stack speaks `http::Request` and
//! `backstop::reqwest::ReqwestService` converts each attempt (reqwest supports both
//! conversions). Everything else is the same as on hyper-util: the classifier finds hyper's and
//! reqwest's errors in the chain, so a refused connection is still *not sent* and a cut-off reply
//! still *unknown*, and every error is a typed `backstop::Error`.
//!
//! Run it with `cargo run --example reqwest_client`.

use backstop::{Backstop, BoxError, Outcome, retry::RetryHistory};
use backstop_testkit::{Action, Seen, TestServer, refused_addr};
use http_body_util::{BodyExt, Full};
use std::time::Duration;
use tower::ServiceExt;

#[tokio::main(flavor = "current_thread")]
pub(crate) async fn main() -> Result<(), BoxError> {
    let carrier = Backstop::http("rates-api")
        .p99(Duration::from_millis(200))
        .deadline(Duration::from_secs(5))
        .build()?
        .reqwest(reqwest::Client::new());

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
