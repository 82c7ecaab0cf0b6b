//! A claimed request run to its end: the handler beside its lease's renewals, and the guard
//! that settles the claim (the result stored, the key released, or the outcome recorded as
//! unknown when the handler ends without a response).

#[cfg(feature = "postgres")]
use crate::transaction::run_in_transaction;
use crate::{
    capture::capture,
    layer::Config,
    problem::{ReplayRequestBody, ReplayResponseBody, unknown_record},
    service::call_inner,
    store::StoredResponse,
};
use backstop_core::{BoxError, HumanDuration};
use bytes::Bytes;
use http::{Request, Response};
use http_body::Body;
use std::{future::Future, sync::Arc, task::Poll, time::Duration};
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
                tracing::warn!(target: "backstop::replay", error = %e, "could not renew a claim");
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

/// What a guard dropped before its claim was settled does.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(crate) enum OnDrop {
    /// The handler started and may have acted: record the outcome as unknown.
    RecordUnknown,
    /// Nothing can have happened (its transaction rolled back): free the key.
    #[cfg_attr(not(feature = "postgres"), allow(dead_code))]
    Release,
}

/// Holds a claim while its handler runs (the lease is renewed beside it, by
/// [`renew_while_running`]): stores the result (retrying while the lease holds), and, if it is
/// dropped before that (the handler panicked, or the runtime stopped its task), records the
/// outcome as unknown.
pub(crate) struct ClaimGuard {
    cfg: Arc<Config>,
    key: String,
    token: u64,
    held: Arc<watch::Sender<bool>>,
    armed: bool,
    pub(crate) on_drop: OnDrop,
}

impl ClaimGuard {
    pub(crate) fn new(
        cfg: Arc<Config>,
        key: String,
        token: u64,
        held: Arc<watch::Sender<bool>>,
    ) -> Self {
        ClaimGuard {
            cfg,
            key,
            token,
            held,
            armed: true,
            on_drop: OnDrop::RecordUnknown,
        }
    }

    /// The claim was settled elsewhere (in the handler's transaction).
    #[cfg_attr(not(feature = "postgres"), allow(dead_code))]
    pub(crate) fn done(mut self) {
        self.disarm();
    }

    fn disarm(&mut self) {
        self.armed = false;
    }

    /// Stores the result. A store that fails for a moment is tried again, with the lease still
    /// renewed (repeats meanwhile get 409), for as long as the lease is held.
    pub(crate) async fn complete(mut self, stored: &StoredResponse) {
        let mut wait = Duration::from_millis(20);
        loop {
            match self
                .cfg
                .store
                .complete(&self.key, self.token, stored, self.cfg.ttl)
                .await
            {
                Ok(true) => break,
                Ok(false) => {
                    tracing::error!(
                        target: "backstop::replay",
                        "the claim expired before the handler finished (lease {}); a newer request owns the key and this result was not stored",
                        HumanDuration(self.cfg.lease)
                    );
                    break;
                }
                Err(e) if *self.held.borrow() => {
                    tracing::warn!(target: "backstop::replay", error = %e, "could not store a result; trying again while the claim is held");
                    tokio::time::sleep(wait).await;
                    wait = (wait * 2).min(self.cfg.lease / 3);
                }
                Err(e) => {
                    tracing::error!(target: "backstop::replay", error = %e, "could not store a result before the claim was lost; a repeat may run the handler again");
                    break;
                }
            }
        }
        self.disarm();
    }

    /// Gives the claim back: the handler refused the request before acting.
    pub(crate) async fn release(mut self) {
        self.disarm();
        if let Err(e) = self.cfg.store.release(&self.key, self.token).await {
            tracing::warn!(target: "backstop::replay", error = %e, "could not release a claim; it will expire with its lease");
        }
    }
}

impl Drop for ClaimGuard {
    fn drop(&mut self) {
        if !self.armed {
            return;
        }
        self.disarm();
        // The handler started and ended without a response (it panicked, or its task was
        // stopped): record that its outcome is unknown, rather than free the key for a second
        // run. If the runtime is shutting down this cannot run, and the lease expires instead.
        if let Ok(h) = tokio::runtime::Handle::try_current() {
            let (store, key, token, ttl, on_drop) = (
                self.cfg.store.clone(),
                std::mem::take(&mut self.key),
                self.token,
                self.cfg.ttl,
                self.on_drop,
            );
            h.spawn(async move {
                let _ = match on_drop {
                    OnDrop::RecordUnknown => {
                        store.complete(&key, token, &unknown_record(), ttl).await
                    }
                    OnDrop::Release => store.release(&key, token).await,
                };
            });
        }
    }
}
