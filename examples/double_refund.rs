//! The lost-reply double refund, over real loopback HTTP.
//!
//! A payment service books a refund and then loses its reply. The caller sees a failure and
//! does not know whether the refund happened. This demo runs the same call three ways:
//!
//! 1. a naive retry loop, which refunds twice;
//! 2. Backstop without an idempotency key, which refuses to repeat a POST whose outcome is
//!    unknown and says so;
//! 3. Backstop with an idempotency key, which retries with the same key; the service recognises
//!    the repeat and returns the original result: one refund, and a proper reply.
//!
//! Run it with `cargo run --example double_refund`.

use backstop::{
    BoxError,
    backoff::RngSource,
    retry::{RetryError, RetryHistory, RetryLayer},
    timeout::{AttemptTimeoutLayer, DeadlineLayer},
};
use backstop_testkit::{Action, Seen, TestServer};
use bytes::Bytes;
use http::Request;
use http_body_util::{BodyExt, Full};
use hyper_util::{client::legacy::Client, rt::TokioExecutor};
use std::{
    collections::HashMap,
    sync::{Arc, Mutex},
    time::Duration,
};
use tower::{ServiceBuilder, ServiceExt};

const REFUND: &str = r#"{"order_id":"A-7","amount":49.0}"#;

/// A payment service that loses the reply to the first request it receives. Like most payment
/// APIs it honours an `Idempotency-Key`: a repeated key gets the stored result back.
async fn payment_service() -> (TestServer, Arc<Mutex<Vec<String>>>) {
    let refunds: Arc<Mutex<Vec<String>>> = Arc::default();
    let stored: Arc<Mutex<HashMap<String, String>>> = Arc::default();
    let booked = refunds.clone();
    let server = TestServer::start(move |seen: &Seen| {
        let key = seen.header("idempotency-key").map(str::to_owned);
        if let Some(result) = key
            .as_ref()
            .and_then(|k| stored.lock().unwrap().get(k).cloned())
        {
            return Action::respond(200, &[("idempotent-replayed", "true")], result);
        }
        let mut refunds = booked.lock().unwrap();
        refunds.push(String::from_utf8_lossy(&seen.body).into_owned());
        let result = format!(r#"{{"refund_id":"R{}","amount":49.0}}"#, refunds.len());
        if let Some(k) = key {
            stored.lock().unwrap().insert(k, result.clone());
        }
        if seen.index == 0 {
            Action::DropReply // the refund is booked, the reply is lost
        } else {
            Action::respond(200, &[], result)
        }
    })
    .await;
    (server, refunds)
}

fn refund_request(url: &str, key: Option<&str>) -> Request<Full<Bytes>> {
    let mut b = Request::post(url).header("content-type", "application/json");
    if let Some(k) = key {
        b = b.header("idempotency-key", k);
    }
    b.body(Full::new(Bytes::from_static(REFUND.as_bytes())))
        .unwrap()
}

#[tokio::main(flavor = "current_thread")]
async fn main() -> Result<(), BoxError> {
    let client = Client::builder(TokioExecutor::new()).build_http::<Full<Bytes>>();

    println!("1. naive retry (any error, three times):");
    let (server, refunds) = payment_service().await;
    let url = server.url("/refunds");
    for attempt in 1..=3 {
        match client.request(refund_request(&url, None)).await {
            Ok(res) => {
                let body = res.into_body().collect().await?.to_bytes();
                println!("   attempt {attempt}: {}", String::from_utf8_lossy(&body));
                break;
            }
            Err(e) => println!("   attempt {attempt}: {e}; retrying"),
        }
    }
    let naive = refunds.lock().unwrap().len();
    println!("   refunds booked: {naive}\n");

    let backstop = ServiceBuilder::new()
        .layer(DeadlineLayer::new(Duration::from_secs(10)))
        .layer(
            RetryLayer::http()
                .dependency("payments-api")
                .rng(RngSource::seeded(42)),
        )
        .layer(AttemptTimeoutLayer::new(Duration::from_secs(3)))
        .service(client);

    println!("2. Backstop, no idempotency key:");
    let (server, refunds) = payment_service().await;
    let err = backstop
        .clone()
        .oneshot(refund_request(&server.url("/refunds"), None))
        .await
        .expect_err("the reply is lost");
    let err = err.downcast::<RetryError>().expect("a RetryError");
    println!("   error for the model: {err}");
    let unkeyed = refunds.lock().unwrap().len();
    println!("   refunds booked: {unkeyed}\n");

    println!("3. Backstop, with the key of the action (run-42, step 3, call 7):");
    let (server, refunds) = payment_service().await;
    let res = backstop
        .oneshot(refund_request(
            &server.url("/refunds"),
            Some("run-42.step-3.call-7"),
        ))
        .await?;
    let attempts = RetryHistory::of(&res).map_or(1, |h| h.attempts.len());
    let replayed = res.headers().contains_key("idempotent-replayed");
    let body = res.into_body().collect().await?.to_bytes();
    println!(
        "   {attempts} attempts, same key on each; result: {} (replayed: {replayed})",
        String::from_utf8_lossy(&body)
    );
    let keyed = refunds.lock().unwrap().len();
    println!("   refunds booked: {keyed}\n");

    println!(
        "naive retry: {naive} refunds; Backstop: {unkeyed} without a key (outcome reported unknown), {keyed} with one"
    );
    assert_eq!(
        (naive, unkeyed, keyed),
        (2, 1, 1),
        "Backstop must never refund twice"
    );
    Ok(())
}
