//! A claimed action run to its end: its work beside its lease's renewals; for an HTTP request,
//! the handler and the guard that settles the claim (the result stored, the key released, or
//! the outcome recorded as unknown when the handler ends without a response).

#[cfg(feature = "postgres")]
use crate::transaction::run_in_transaction;
use crate::{
    capture::capture,
    config::Config,
    guard::ClaimGuard,
    inner::{call_inner, ready},
    problem::{ReplayRequestBody, ReplayResponseBody, unknown_record},
};
use backstop_core::{BoxError, Deadline};
use bytes::Bytes;
use http::{Request, Response};
use http_body::Body;
use std::{
    future::{Future, poll_fn},
    pin::pin,
    sync::Arc,
    task::Poll,
};
use tokio::sync::watch;
use tower_service::Service;

/// Runs the work of a claimed action to its end, with the claim's lease renewed beside it in
/// the same task until the work settles the claim; both within `deadline`, when there is one.
/// The work's future is made here, in the place it is polled from: passed in made, it would be
/// held twice, as this function's argument and as its pinned local.
pub(crate) async fn renewing<T, Fut: Future<Output = T>>(
    cfg: Arc<Config>,
    key: String,
    token: u64,
    held: Arc<watch::Sender<bool>>,
    deadline: Option<Deadline>,
    work: impl FnOnce() -> Fut,
) -> T {
    let renewals = renew_while_running(cfg, key, token, held);
    let (mut work, mut renewals) = (pin!(work()), pin!(renewals));
    poll_fn(|cx| {
        let mut poll = || {
            if let Poll::Ready(done) = work.as_mut().poll(cx) {
                return Poll::Ready(done);
            }
            match renewals.as_mut().poll(cx) {
                Poll::Ready(never) => match never {},
                Poll::Pending => Poll::Pending,
            }
        };
        match deadline {
            Some(deadline) => deadline.in_scope(poll),
            None => poll(),
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

/// A claimed request's handler, its response and its record: what settles the claim.
pub(crate) async fn settle<S, ResB>(
    cfg: Arc<Config>,
    mut svc: S,
    req: Request<ReplayRequestBody>,
    guard: ClaimGuard,
) -> Result<Response<ReplayResponseBody>, S::Error>
where
    S: Service<Request<ReplayRequestBody>, Response = Response<ResB>>,
    ResB: Body<Data = Bytes> + Send + 'static,
    ResB::Error: Into<BoxError>,
{
    if let Err(e) = ready(&mut svc).await {
        // The handler was never called: the key is free for a retry.
        guard.release().await;
        return Err(e);
    }
    #[cfg(feature = "postgres")]
    if let Some(pg) = cfg.transactional.clone() {
        // Boxed: the transaction's state is large, and a request served without one would
        // carry it in its task too.
        return Box::pin(run_in_transaction(cfg, &pg, svc, req, guard)).await;
    }
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
