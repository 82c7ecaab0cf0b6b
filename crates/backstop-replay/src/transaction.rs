//! The transactional mode: the handler's writes and the stored result in one PostgreSQL
//! transaction, fenced by the claim's token.

use crate::{
    capture::buffer,
    config::Config,
    guard::{ClaimGuard, OnDrop},
    inner::call_inner,
    problem::{
        ReplayRequestBody, ReplayResponseBody, count, problem, retry_later, store_unavailable,
    },
};
use backstop_core::BoxError;
use bytes::Bytes;
use http::{Request, Response, StatusCode};
use http_body::Body;
use std::sync::Arc;
use tower_service::Service;

/// Runs a claimed request in one database transaction with its record: the handler writes
/// through the [`PgTransaction`](crate::PgTransaction) in its extensions, the layer writes the
/// stored response in the same transaction (fenced by the claim's token) and commits. A crash
/// before the commit leaves neither the effect nor the record, and the key is free again once
/// the lease expires; a handler that fails, or answers with a status that is not stored, is
/// rolled back and its key released.
pub(crate) async fn run_in_transaction<S, ResB>(
    cfg: Arc<Config>,
    pg: &crate::PgStore,
    svc: S,
    mut req: Request<ReplayRequestBody>,
    mut guard: ClaimGuard,
) -> Result<Response<ReplayResponseBody>, S::Error>
where
    S: Service<Request<ReplayRequestBody>, Response = Response<ResB>>,
    ResB: Body<Data = Bytes> + Send + 'static,
    ResB::Error: Into<BoxError>,
{
    // Dropped before the commit (a panic, a stopped task), the transaction rolls back: nothing
    // happened, so the key is released rather than marked unknown.
    guard.on_drop = OnDrop::Release;
    let tx = match pg.begin().await {
        Ok(tx) => tx,
        Err(e) => {
            tracing::warn!(target: "backstop::replay", error = %backstop_core::plumbing::CauseChain(&e), "could not open a transaction; refusing the request");
            guard.release().await;
            return Ok(store_unavailable());
        }
    };
    let shared = crate::PgTransaction::new(tx);
    req.extensions_mut().insert(shared.clone());
    let res = match call_inner(svc, req).await {
        Ok(res) => res,
        Err(e) => {
            drop(shared.take().await);
            guard.release().await;
            return Err(e);
        }
    };
    if !(cfg.store_status)(res.status()) {
        drop(shared.take().await);
        guard.release().await;
        return Ok(res);
    }
    let (stored, res) = buffer(&cfg, res).await;
    let Some(mut tx) = shared.take().await else {
        guard.release().await;
        return Ok(store_unavailable());
    };
    match pg
        .complete_in(&mut tx, guard.key(), guard.token(), &stored, cfg.ttl)
        .await
    {
        Ok(true) => match tx.commit().await {
            Ok(()) => {
                guard.done();
                Ok(res)
            }
            Err(e) => {
                tracing::warn!(target: "backstop::replay", error = %backstop_core::plumbing::CauseChain(&e), "the commit failed: nothing happened; the key is released");
                guard.release().await;
                Ok(store_unavailable())
            }
        },
        Ok(false) => {
            // The lease was lost and another request owns the key: commit nothing.
            drop(tx);
            guard.done();
            count("lease_lost");
            Ok(retry_later(problem(
                StatusCode::CONFLICT,
                "lease-lost",
                "Request superseded",
                "this request's claim on its idempotency key expired while it ran and another \
                 request took it over, so nothing it did was committed; retry with the same key \
                 to get that request's result",
            )))
        }
        Err(e) => {
            tracing::warn!(target: "backstop::replay", error = %backstop_core::plumbing::CauseChain(&e), "could not record the result: nothing was committed; the key is released");
            drop(tx);
            guard.release().await;
            Ok(store_unavailable())
        }
    }
}
