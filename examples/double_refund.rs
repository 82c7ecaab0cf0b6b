//! The lost-reply double refund, over real loopback HTTP.
//!
//! A payment service books a refund and then loses its reply. The caller sees a failure and
//! does not know whether the refund happened. This demo makes the same call three ways:
//!
//! 1. a naive retry loop against an unprotected service: two refunds;
//! 2. Backstop's retry layer without an idempotency key: it refuses to repeat a POST whose
//!    outcome is unknown, and says so in words a model can act on: one refund, outcome unknown;
//! 3. the full Backstop client stack (a key derived from the action, sent on every attempt)
//!    against the service guarded by Backstop's replay layer: the repeat is recognised and the
//!    original result comes back: one refund, and a proper reply.
//!
//! Run it with `cargo run --example double_refund`.

use backstop::{
    BoxError,
    backoff::RngSource,
    idempotency::{ActionContext, IdempotencyLayer},
    replay::{BodyError, MemoryStore, ReplayLayer, ReplayRequestBody, ReplayResponseBody},
    retry::{RetryError, RetryHistory, RetryLayer},
    timeout::{AttemptTimeoutLayer, DeadlineLayer},
};
use backstop_testkit::TestServer;
use bytes::Bytes;
use http::{Request, Response};
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper_util::{client::legacy::Client, rt::TokioExecutor};
use std::{
    convert::Infallible,
    sync::{
        Arc, Mutex,
        atomic::{AtomicBool, Ordering},
    },
    time::Duration,
};
use tower::{Layer, ServiceBuilder, ServiceExt, service_fn, util::BoxCloneSyncService};

type Server =
    BoxCloneSyncService<Request<ReplayRequestBody>, Response<ReplayResponseBody>, BoxError>;

/// The refund endpoint: books a refund, answers with its id, and loses the reply to the very
/// first request (after booking). `protected` puts Backstop's replay layer in front of it.
async fn payment_service(protected: bool) -> (TestServer, Arc<Mutex<Vec<String>>>) {
    let refunds: Arc<Mutex<Vec<String>>> = Arc::default();
    let booked = refunds.clone();
    let handler = service_fn(move |req: Request<ReplayRequestBody>| {
        let booked = booked.clone();
        async move {
            let body = req.into_body().collect().await.map_err(|e| e.0)?.to_bytes();
            let mut refunds = booked.lock().unwrap();
            refunds.push(String::from_utf8_lossy(&body).into_owned());
            let result = format!(r#"{{"refund_id":"R{}","amount":49.0}}"#, refunds.len());
            Ok::<_, BoxError>(Response::new(Full::new(Bytes::from(result))))
        }
    });
    let svc: Server = if protected {
        BoxCloneSyncService::new(
            ReplayLayer::new(MemoryStore::default())
                .single_tenant()
                .layer(handler),
        )
    } else {
        BoxCloneSyncService::new(handler.map_response(|r: Response<Full<Bytes>>| {
            r.map(|b| b.map_err(|e: Infallible| match e {}).boxed_unsync())
        }))
    };
    let svc = svc.map_request(|r: Request<Incoming>| {
        r.map(|b| b.map_err(|e| BodyError(e.into())).boxed_unsync())
    });
    // The network loses the first reply, after the refund was booked.
    let lost = Arc::new(AtomicBool::new(false));
    let svc = svc.and_then(move |res| {
        let lose = !lost.swap(true, Ordering::SeqCst);
        async move {
            if lose {
                return Err::<Response<ReplayResponseBody>, BoxError>("reply lost".into());
            }
            Ok(res)
        }
    });
    (TestServer::serve(svc).await, refunds)
}

fn refund_request(url: &str) -> Request<Full<Bytes>> {
    Request::post(url)
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from_static(
            br#"{"order_id":"A-7","amount":49.0}"#,
        )))
        .unwrap()
}

#[tokio::main(flavor = "current_thread")]
pub(crate) async fn main() -> Result<(), BoxError> {
    let client = Client::builder(TokioExecutor::new()).build_http::<Full<Bytes>>();

    println!("1. naive retry (any error, up to three times), unprotected service:");
    let (server, refunds) = payment_service(false).await;
    for attempt in 1..=3 {
        match client
            .request(refund_request(&server.url("/refunds")))
            .await
        {
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

    let retry = || {
        RetryLayer::http()
            .dependency("payments-api")
            .rng(RngSource::seeded(42))
    };

    println!("2. Backstop's retry layer, no idempotency key, unprotected service:");
    let (server, refunds) = payment_service(false).await;
    let unkeyed = ServiceBuilder::new()
        .layer(DeadlineLayer::new(Duration::from_secs(10)))
        .layer(retry())
        .layer(AttemptTimeoutLayer::new(Duration::from_secs(3)))
        .service(client.clone());
    let err = unkeyed
        .oneshot(refund_request(&server.url("/refunds")))
        .await
        .expect_err("the reply is lost");
    let err = err.downcast::<RetryError>().expect("a RetryError");
    println!("   error for the model: {err}");
    let without_key = refunds.lock().unwrap().len();
    println!("   refunds booked: {without_key}\n");

    println!(
        "3. the Backstop stack with a key derived from the action, service behind the replay layer:"
    );
    let (server, refunds) = payment_service(true).await;
    let keyed = ServiceBuilder::new()
        // The refund service runs the replay layer: it honours keys.
        .layer(IdempotencyLayer::http().vouched(true))
        .layer(DeadlineLayer::new(Duration::from_secs(10)))
        .layer(retry())
        .layer(AttemptTimeoutLayer::new(Duration::from_secs(3)))
        .service(client);
    let mut req = refund_request(&server.url("/refunds"));
    let args = serde_json::json!({"order_id": "A-7", "amount": 49.0});
    let action = ActionContext::action_json("run-42", "issue_refund", &args)?;
    println!(
        "   key = sha256(run-42, issue_refund, canonical args) = {}",
        action.key()
    );
    req.extensions_mut().insert(action);
    let res = keyed.oneshot(req).await?;
    let attempts = RetryHistory::of(&res).map_or(1, |h| h.attempts.len());
    let replayed = res.headers().contains_key("idempotent-replayed");
    let body = res.into_body().collect().await?.to_bytes();
    println!(
        "   {attempts} attempts, same key on each; result: {} (replayed: {replayed})",
        String::from_utf8_lossy(&body)
    );
    let with_key = refunds.lock().unwrap().len();
    println!("   refunds booked: {with_key}\n");

    println!(
        "naive retry: {naive} refunds. Backstop: {without_key} without a key (and the outcome reported \
         as unknown), {with_key} with one (and the original result returned)."
    );
    assert_eq!(
        (naive, without_key, with_key),
        (2, 1, 1),
        "Backstop must never refund twice"
    );
    Ok(())
}
