//! The whole stack on hyper-util's client, against a real server on 127.0.0.1.
//!
//! A rates endpoint that fails twice with 503 and then answers, and a labels endpoint behind
//! Backstop's replay layer whose first reply is lost, called exactly as the README's "one
//! screen" shows (the create preset, `p99`, a 30 s deadline, an `ActionContext`). Run it with
//! `cargo run --example hyper_client`.

use backstop::{
    Backstop, BoxError, Preset,
    idempotency::ActionContext,
    replay::{MemoryStore, ReplayLayer, ReplayRequestBody},
    retry::RetryHistory,
};
use backstop_testkit::{Action, Seen, TestServer};
use bytes::Bytes;
use http::{Request, Response};
use http_body_util::{BodyExt, Full};
use hyper_util::{client::legacy::Client, rt::TokioExecutor};
use std::{
    sync::{
        Arc,
        atomic::{AtomicBool, AtomicU32, Ordering},
    },
    time::Duration,
};
use tower::{Layer, ServiceExt, service_fn};

#[tokio::main(flavor = "current_thread")]
pub(crate) async fn main() -> Result<(), BoxError> {
    // The client: hyper-util's, with the Backstop stack on top. Nothing else changes.
    let client = Client::builder(TokioExecutor::new()).build_http::<Full<Bytes>>();
    // The carrier runs Backstop's replay layer: it honours keys, so a key the stack attaches
    // makes a lost reply safe to repeat.
    let carrier = Backstop::http("carrier-api")
        .honours_keys()
        .p99(Duration::from_millis(200))
        .deadline(Duration::from_secs(5))
        .build()?
        .layer(client); // hyper-util's client is a leaf: no call context to pass on

    // 1. A flaky read.
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
        .oneshot(Request::get(rates.url("/rates")).body(Full::default())?)
        .await?;
    let attempts = RetryHistory::of(&res).map_or(1, RetryHistory::sent);
    println!(
        "GET /rates -> {} after {attempts} attempts: {}",
        res.status(),
        String::from_utf8_lossy(&res.into_body().collect().await?.to_bytes())
    );

    // 2. A write whose first reply is lost, against a server with the replay layer.
    let labels = Arc::new(AtomicU32::new(0));
    let bought = labels.clone();
    let handler = service_fn(move |_req: Request<ReplayRequestBody>| {
        let n = bought.fetch_add(1, Ordering::SeqCst) + 1;
        async move {
            Ok::<_, BoxError>(Response::new(Full::new(Bytes::from(format!(
                r#"{{"label_id":"LBL-{n}"}}"#
            )))))
        }
    });
    let lost = Arc::new(AtomicBool::new(false));
    let server = ReplayLayer::new(MemoryStore::default())
        .single_tenant()
        .layer(handler);
    let server = tower::ServiceBuilder::new()
        .map_request(|r: Request<hyper::body::Incoming>| r)
        .service(server)
        .and_then(move |res| {
            let lose = !lost.swap(true, Ordering::SeqCst);
            async move {
                if lose {
                    Err::<_, BoxError>("connection dropped".into())
                } else {
                    Ok(res)
                }
            }
        });
    let api = TestServer::serve(server).await;
    // The README's one screen, as written there: the create preset requires the key (derived
    // from the action) and declares that the carrier honours it.
    let client = Client::builder(TokioExecutor::new()).build_http::<Full<Bytes>>();
    let carrier = Backstop::http("carrier-api")
        .preset(Preset::Create)
        .p99(Duration::from_millis(1200))
        .deadline(Duration::from_secs(30))
        .build()?
        .layer(client);
    let mut req =
        Request::post(api.url("/labels")).body(Full::from(r#"{"order_id":"ORD-4812"}"#))?;
    req.extensions_mut()
        .insert(ActionContext::tool_call("run-91f2", "step-3", "call-07"));
    let res = carrier.oneshot(req).await?;
    let replayed = res.headers().contains_key("idempotent-replayed");
    let attempts = RetryHistory::of(&res).map_or(1, RetryHistory::sent);
    println!(
        "POST /labels -> {} after {attempts} attempts (replayed: {replayed}): {}; labels bought: {}",
        res.status(),
        String::from_utf8_lossy(&res.into_body().collect().await?.to_bytes()),
        labels.load(Ordering::SeqCst)
    );
    assert_eq!(labels.load(Ordering::SeqCst), 1);
    Ok(())
}
