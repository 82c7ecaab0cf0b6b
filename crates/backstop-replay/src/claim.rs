//! A claimed request run to its end: the handler beside its lease's renewals, and the guard
//! that settles the claim (the result stored, the key released, or the outcome recorded as
//! unknown when the handler ends without a response).

#[cfg(feature = "postgres")]
use crate::transaction::run_in_transaction;
use crate::{
    capture::capture,
    config::Config,
    guard::ClaimGuard,
    inner::call_inner,
    problem::{ReplayRequestBody, ReplayResponseBody, unknown_record},
};
use backstop_core::BoxError;
use bytes::Bytes;
use http::{Request, Response};
use http_body::Body;
use std::{future::Future, sync::Arc, task::Poll};
use tokio::sync::watch;
use tower_service::Service;

/// Runs a claimed request to the end, whatever its client does: the handler, its response
/// body up to the storage limit, and the store's record.
pub(crate) async fn run_claimed<S, ResB>(
    cfg: Arc<Config>,
    svc: S,
    req: Request<ReplayRequestBody>,
    key: String,
    token: u64,
    held: watch::Sender<bool>,
) -> Result<Response<ReplayResponseBody>, S::Error>
where
    S: Service<Request<ReplayRequestBody>, Response = Response<ResB>>,
    ResB: Body<Data = Bytes> + Send + 'static,
    ResB::Error: Into<BoxError>,
{
    // The lease is renewed beside the work, in the same task, until the claim is settled.
    let held = Arc::new(held);
    let renewals = renew_while_running(cfg.clone(), key.clone(), token, held.clone());
    let work = settle(cfg, svc, req, key, token, held);
    let (mut work, mut renewals) = (std::pin::pin!(work), std::pin::pin!(renewals));
    std::future::poll_fn(|cx| {
        if let Poll::Ready(done) = work.as_mut().poll(cx) {
            return Poll::Ready(done);
        }
        match renewals.as_mut().poll(cx) {
            Poll::Ready(never) => match never {},
            Poll::Pending => Poll::Pending,
        }
    })
    .await
}

/// Renews the claim every third of its lease, forever (the caller stops polling once the
/// claim is settled), and reports the lease lost when the store refuses a renewal or none
/// succeeded for a whole lease.
async fn renew_while_running(
    cfg: Arc<Config>,
    key: String,
    token: u64,
    held: Arc<watch::Sender<bool>>,
) -> std::convert::Infallible {
    let lease = cfg.lease;
    let mut last = tokio::time::Instant::now();
    loop {
        tokio::time::sleep(lease / 3).await;
        if !*held.borrow() {
            continue;
        }
        match cfg.store.renew(&key, token, lease).await {
            Ok(true) => last = tokio::time::Instant::now(),
            Ok(false) => {
                tracing::error!(target: "backstop::replay", "the claim was taken over (its lease expired); a repeat may run the handler again");
                held.send_replace(false);
            }
            Err(e) => {
                tracing::warn!(target: "backstop::replay", error = %backstop_core::plumbing::CauseChain(&e), "could not renew a claim");
                if last.elapsed() >= lease {
                    tracing::error!(target: "backstop::replay", "no renewal for a whole lease: the claim may have expired, and a repeat may run the handler again");
                    held.send_replace(false);
                }
            }
        }
    }
}

/// The handler, its response and its record: what settles a claim.
async fn settle<S, ResB>(
    cfg: Arc<Config>,
    svc: S,
    req: Request<ReplayRequestBody>,
    key: String,
    token: u64,
    held: Arc<watch::Sender<bool>>,
) -> Result<Response<ReplayResponseBody>, S::Error>
where
    S: Service<Request<ReplayRequestBody>, Response = Response<ResB>>,
    ResB: Body<Data = Bytes> + Send + 'static,
    ResB::Error: Into<BoxError>,
{
    #[cfg(feature = "postgres")]
    if let Some(pg) = cfg.transactional.clone() {
        return run_in_transaction(cfg, &pg, svc, req, key, token, held).await;
    }
    let guard = ClaimGuard::new(cfg.clone(), key, token, held);
    let res = match call_inner(svc, req).await {
        Ok(res) => res,
        Err(e) => {
            // No response: whatever the handler did is unknown.
            guard.complete(&unknown_record()).await;
            return Err(e);
        }
    };
    if !(cfg.store_status)(res.status()) {
        // The handler says it refused the request before acting (503, 429, ...): the key is
        // free for a retry.
        guard.release().await;
        return Ok(res);
    }
    Ok(capture(&cfg, guard, res).await)
}
