//! HTTP over the simulated network: the agent's leaf client (hyper, one connection per
//! attempt, as a client whose pooled connection broke would) and the replay server (hyper
//! serving Backstop's replay layer over a handler that commits refunds to the ledger).

use super::{World, store::RemoteStore};
use crate::stacks::{Req, Res};
use backstop::{
    BoxError,
    replay::{ReplayLayer, ReplayRequestBody},
};
use bytes::Bytes;
use http::{Method, Request, Response, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper::server::conn::http1;
use hyper_util::{rt::TokioIo, service::TowerToHyperService};
use rand::RngExt;
use std::{sync::Arc, time::Duration};
use tower::Layer;
use turmoil::net::{TcpListener, TcpStream};

/// The replay server's name and port.
pub(crate) const API: (&str, u16) = ("api", 80);

/// The header naming the logical call an attempt belongs to, for counting attempts per call.
pub(crate) const CALL_ID: &str = "x-sim-call";

/// One attempt: connect, send, read the whole reply. A refused connection is an `io::Error`
/// of kind `ConnectionRefused` (nothing was sent); everything after the connection is hyper's.
pub(crate) async fn send(world: Arc<World>, req: Req) -> Result<Res, BoxError> {
    if let Some(id) = req.headers().get(CALL_ID).and_then(|v| v.to_str().ok()) {
        world.attempted(id);
    }
    let stream = TcpStream::connect(API).await?;
    let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream)).await?;
    tokio::spawn(async move {
        let _ = conn.await;
    });
    let res = sender.send_request(req).await?;
    let (parts, body) = res.into_parts();
    let bytes = body.collect().await?.to_bytes();
    Ok(Response::from_parts(parts, Full::new(bytes)))
}

/// The dependency's handler, behind the replay layer. A refund (`POST`, its action in the
/// body) takes a while, commits to the ledger, then takes a while to answer: a crash or a
/// partition between the two loses the reply of an effect that happened. A read (`GET`) is
/// fast but for a seeded slow tail, and commits nothing.
async fn handle(world: Arc<World>, req: Request<ReplayRequestBody>) -> Result<Res, BoxError> {
    let method = req.method().clone();
    let body = req.into_body().collect().await.map_err(|e| e.0)?.to_bytes();
    let (before, after) = {
        let mut rng = world.server_rng.lock().unwrap();
        if method == Method::POST {
            (rng.random_range(5..40), rng.random_range(0..20))
        } else if rng.random::<f64>() < 0.05 {
            (rng.random_range(150..400), 0)
        } else {
            (rng.random_range(1..6), 0)
        }
    };
    tokio::time::sleep(Duration::from_millis(before)).await;
    if method == Method::POST {
        world.commit(&String::from_utf8_lossy(&body));
    }
    tokio::time::sleep(Duration::from_millis(after)).await;
    Ok(Response::builder()
        .status(StatusCode::OK)
        .body(Full::new(Bytes::from_static(b"{\"ok\":true}")))?)
}

/// The replay server's software: every connection served by hyper over the replay layer,
/// whose store is the store host. Killed with its host (every task of it dropped, handlers
/// mid-way included) and started again on a bounce.
pub(crate) async fn api_host(world: Arc<World>, lease: Duration) -> turmoil::Result {
    let handler = {
        let world = world.clone();
        tower::service_fn(move |req| handle(world.clone(), req))
    };
    let svc = ReplayLayer::new(RemoteStore)
        .single_tenant()
        .lease(lease)
        .expect("a valid lease")
        .layer(handler);
    let listener = TcpListener::bind(("0.0.0.0", API.1)).await?;
    loop {
        let (stream, _) = listener.accept().await?;
        let svc = TowerToHyperService::new(svc.clone());
        tokio::spawn(async move {
            let _ = http1::Builder::new()
                .serve_connection(TokioIo::new(stream), svc)
                .await;
        });
    }
}
