//! Serving one request: the key and body read, the identity and principal found, the claim
//! asked for, and the claimed request handed to its own task.

use crate::{
    claim::run_claimed,
    config::{Config, SINGLE_TENANT},
    inner::call_inner,
    key::{Identity, fingerprint, read_key, store_key},
    lease::Lease,
    problem::{
        BodyError, ReplayRequestBody, ReplayResponseBody, count, mismatch, principal_missing,
        problem, replayed, retry_later, store_unavailable, unknown_outcome,
    },
    store::{Claim, Fingerprint},
};
use backstop_core::{BoxError, Deadline};
use bytes::Bytes;
use http::{Request, Response, StatusCode, request::Parts};
use http_body::Body;
use http_body_util::{BodyExt, Full, LengthLimitError, Limited};
use std::sync::Arc;
use tower_service::Service;
use tracing::Instrument;

/// A request the layer guards: read whole, with the store key and fingerprint it is filed under.
struct Keyed {
    parts: Parts,
    bytes: Bytes,
    store_key: String,
    fingerprint: Fingerprint,
    /// Identified by the business key: a repeat with another body is the same action.
    is_business: bool,
}

/// What reading a request found.
enum Read {
    /// Guarded: claim it.
    Keyed(Keyed),
    /// No key and none required: run it as it is.
    Unkeyed(Request<ReplayRequestBody>),
    /// Refused before the handler: the answer.
    Refused(Response<ReplayResponseBody>),
}

pub(crate) async fn serve<S, B, ResB>(
    cfg: Arc<Config>,
    svc: S,
    req: Request<B>,
) -> Result<Response<ReplayResponseBody>, S::Error>
where
    S: Service<Request<ReplayRequestBody>, Response = Response<ResB>> + Send + 'static,
    S::Future: Send,
    S::Error: Send + 'static,
    B: Body<Data = Bytes> + Send + 'static,
    B::Error: Into<BoxError>,
    ResB: Body<Data = Bytes> + Send + 'static,
    ResB::Error: Into<BoxError>,
{
    let (parts, body) = req.into_parts();
    if !cfg.methods.contains(&parts.method) {
        let body = body.map_err(|e| BodyError(e.into())).boxed_unsync();
        return call_inner(svc, Request::from_parts(parts, body)).await;
    }
    let keyed = match read(&cfg, parts, body).await {
        Read::Keyed(keyed) => keyed,
        Read::Unkeyed(req) => return call_inner(svc, req).await,
        Read::Refused(res) => return Ok(res),
    };
    let token = match cfg
        .store
        .claim(&keyed.store_key, keyed.fingerprint, cfg.lease)
        .await
    {
        Ok(Claim::Claimed { token }) => token,
        Ok(Claim::Done {
            fingerprint,
            response,
        }) => {
            if fingerprint != keyed.fingerprint && !keyed.is_business {
                return Ok(mismatch());
            }
            count("replayed");
            return Ok(replayed(&response));
        }
        Ok(Claim::InFlight { fingerprint }) => {
            if fingerprint != keyed.fingerprint && !keyed.is_business {
                return Ok(mismatch());
            }
            count("in_flight");
            return Ok(retry_later(problem(
                StatusCode::CONFLICT,
                "request-in-flight",
                "Request in progress",
                "a request with this idempotency key is still being processed; retry after it completes to get its result",
            )));
        }
        Err(e) if cfg.fail_open => {
            tracing::warn!(target: "backstop::replay", error = %backstop_core::plumbing::CauseChain(&e), "store unavailable; running the request without deduplication (fail_open)");
            return call_inner(svc, rebuilt(keyed.parts, keyed.bytes)).await;
        }
        Err(e) => {
            tracing::warn!(target: "backstop::replay", error = %backstop_core::plumbing::CauseChain(&e), "store unavailable; refusing the request");
            return Ok(store_unavailable());
        }
    };
    run_detached(cfg, svc, keyed, token).await
}

/// Runs a claimed request in a task of its own, decoupled from this request's future: a client
/// that gives up (and drops it) cannot stop a handler that has started, nor release its claim.
/// The task runs the handler, reads its response, stores it, and hands it back.
async fn run_detached<S, ResB>(
    cfg: Arc<Config>,
    svc: S,
    keyed: Keyed,
    token: u64,
) -> Result<Response<ReplayResponseBody>, S::Error>
where
    S: Service<Request<ReplayRequestBody>, Response = Response<ResB>> + Send + 'static,
    S::Future: Send,
    S::Error: Send + 'static,
    ResB: Body<Data = Bytes> + Send + 'static,
    ResB::Error: Into<BoxError>,
{
    let (lease, held) = Lease::new(token);
    let mut req = rebuilt(keyed.parts, keyed.bytes);
    req.extensions_mut().insert(lease);
    // The handler's own task continues the request's span (and so its trace).
    // The handler's task inherits the caller's deadline, as the request's own task did.
    let inherited = match (Deadline::of(&req), Deadline::current()) {
        (Some(on_request), Some(task)) => Some(on_request.min(task)),
        (on_request, task) => on_request.or(task),
    };
    let claimed = run_claimed(cfg.clone(), svc, req, keyed.store_key, token, held);
    let claimed = async move {
        match inherited {
            Some(deadline) => deadline.scope(claimed).await,
            None => claimed.await,
        }
    };
    match tokio::spawn(claimed.in_current_span()).await {
        Ok(result) => result,
        // The handler panicked: the task's guard recorded the outcome as unknown, or, in a
        // transaction, rolled everything back and freed the key.
        Err(_) if cfg.is_transactional() => Ok(problem(
            StatusCode::INTERNAL_SERVER_ERROR,
            "handler-failed",
            "Handler failed",
            "the handler failed before answering; its transaction was rolled back, so nothing \
             was committed; retry with the same idempotency key",
        )),
        Err(_) => Ok(unknown_outcome()),
    }
}

/// Reads a request of a guarded method: its key header, its body (up to the limit), the identity
/// its result is filed under and the principal it acts for.
async fn read<B>(cfg: &Config, parts: Parts, body: B) -> Read
where
    B: Body<Data = Bytes>,
    B::Error: Into<BoxError>,
{
    let key = match read_key(&parts, &cfg.header) {
        Ok(k) => k,
        Err(why) => {
            return Read::Refused(problem(
                StatusCode::BAD_REQUEST,
                "invalid-idempotency-key",
                "Invalid idempotency key",
                &why,
            ));
        }
    };
    let bytes = match read_body(cfg, body).await {
        Ok(bytes) => bytes,
        Err(refused) => return Read::Refused(refused),
    };
    let business = cfg.business_key.as_ref().and_then(|f| f(&parts, &bytes));
    let identity = match (business, key) {
        (Some(b), _) => Identity::Business(b),
        (None, Some(k)) => Identity::Key(k),
        (None, None) if cfg.require_key => {
            return Read::Refused(problem(
                StatusCode::BAD_REQUEST,
                "idempotency-key-missing",
                "Idempotency key required",
                &format!(
                    "this endpoint requires an {} header so that a retried request is not processed twice; \
                     send one key per intended action and reuse it on every retry",
                    cfg.header
                ),
            ));
        }
        (None, None) => return Read::Unkeyed(rebuilt(parts, bytes)),
    };
    let Some(principal) = principal(cfg, &parts) else {
        return Read::Refused(principal_missing());
    };
    Read::Keyed(Keyed {
        store_key: store_key(&principal, &identity),
        fingerprint: fingerprint(&parts, &bytes),
        is_business: matches!(identity, Identity::Business(_)),
        parts,
        bytes,
    })
}

/// The request body, whole, or the answer to a body too large or unreadable.
async fn read_body<B>(cfg: &Config, body: B) -> Result<Bytes, Response<ReplayResponseBody>>
where
    B: Body<Data = Bytes>,
    B::Error: Into<BoxError>,
{
    match Limited::new(body, cfg.max_request_body).collect().await {
        Ok(c) => Ok(c.to_bytes()),
        Err(e) if e.is::<LengthLimitError>() => Err(problem(
            StatusCode::PAYLOAD_TOO_LARGE,
            "request-too-large",
            "Request body too large",
            &format!(
                "the request body is larger than the {} bytes this endpoint accepts",
                cfg.max_request_body
            ),
        )),
        Err(e) => Err(problem(
            StatusCode::BAD_REQUEST,
            "unreadable-body",
            "Unreadable request body",
            &format!("the request body could not be read: {e}"),
        )),
    }
}

/// The principal a keyed request acts for (`None`: none, and the layer is not single-tenant).
fn principal(cfg: &Config, parts: &Parts) -> Option<String> {
    (cfg.principal)(parts).or_else(|| cfg.single_tenant.then(|| SINGLE_TENANT.to_owned()))
}

/// The request again, over the body read whole.
fn rebuilt(parts: Parts, bytes: Bytes) -> Request<ReplayRequestBody> {
    Request::from_parts(
        parts,
        Full::new(bytes).map_err(|e| match e {}).boxed_unsync(),
    )
}
