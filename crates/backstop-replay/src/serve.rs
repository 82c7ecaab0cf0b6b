//! Serving one HTTP request: the key and body read, the identity and principal found, the
//! claim asked for (`once.rs`), and the claimed request handed to its own task.

use crate::{
    claim::settle,
    config::{Config, SINGLE_TENANT},
    inner::ready_and_call,
    key::{Identity, fingerprint, read_key, store_key},
    once::{Found, Panicked, claim, run_detached},
    problem::{
        ReplayRequestBody, ReplayResponseBody, mismatch, principal_missing, problem, replayed,
        retry_later, store_unavailable, unknown_outcome,
    },
    store::Fingerprint,
};
use backstop_core::{BoxError, Deadline};
use bytes::Bytes;
use http::{Request, Response, StatusCode, request::Parts};
use http_body::Body;
use http_body_util::{BodyExt, Full, LengthLimitError, Limited};
use std::sync::Arc;
use tower_service::Service;

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
    let keyed = match read(&cfg, parts, body).await {
        Read::Keyed(keyed) => keyed,
        Read::Unkeyed(req) => return ready_and_call(svc, req).await,
        Read::Refused(res) => return Ok(res),
    };
    let token = match claim(&cfg, &keyed.store_key, keyed.fingerprint, keyed.is_business).await {
        Ok(token) => token,
        Err(Found::Done(stored)) => return Ok(replayed(&stored)),
        Err(Found::InFlight) => {
            return Ok(retry_later(problem(
                StatusCode::CONFLICT,
                "request-in-flight",
                "Request in progress",
                "a request with this idempotency key is still being processed; retry after it completes to get its result",
            )));
        }
        Err(Found::KeyReused) => return Ok(mismatch()),
        Err(Found::Unavailable(_)) => return Ok(store_unavailable()),
        Err(Found::Unprotected) => {
            return ready_and_call(svc, rebuilt(keyed.parts, keyed.bytes)).await;
        }
    };
    let mut req = rebuilt(keyed.parts, keyed.bytes);
    // The handler's task inherits the caller's deadline, as the request's own task did.
    let deadline = match (Deadline::of(&req), Deadline::current()) {
        (Some(on_request), Some(task)) => Some(on_request.min(task)),
        (on_request, task) => on_request.or(task),
    };
    let transactional = cfg.is_transactional();
    let ran = run_detached(
        cfg.clone(),
        keyed.store_key,
        token,
        deadline,
        |lease, guard| {
            req.extensions_mut().insert(lease);
            settle(cfg, svc, req, guard)
        },
    )
    .await;
    match ran {
        Ok(result) => result,
        // The handler panicked: the task's guard recorded the outcome as unknown, or, in a
        // transaction, rolled everything back and freed the key.
        Err(Panicked) if transactional => Ok(problem(
            StatusCode::INTERNAL_SERVER_ERROR,
            "handler-failed",
            "Handler failed",
            "the handler failed before answering; its transaction was rolled back, so nothing \
             was committed; retry with the same idempotency key",
        )),
        Err(Panicked) => Ok(unknown_outcome()),
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
