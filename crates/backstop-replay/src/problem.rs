//! What the layer answers itself, as RFC 9457 problems: a replayed result, a request in
//! flight, a reused key, an unknown outcome, a store that is down; and the bodies it answers with.

use crate::store::StoredResponse;
use bytes::Bytes;
use http::{HeaderValue, Response, StatusCode, header};
use http_body_util::{BodyExt, Full, combinators::UnsyncBoxBody};

use backstop_core::BoxError;
use std::{error::Error, fmt};

/// The error of the replay layer's request and response bodies: the underlying body's error.
///
/// A named type rather than `Box<dyn Error>` itself, so that futures holding these bodies can be
/// proven `Send` (rustc cannot, for a boxed trait object inside a generic body type).
#[derive(Debug)]
pub struct BodyError(pub BoxError);

impl fmt::Display for BodyError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(&self.0, f)
    }
}

impl Error for BodyError {
    fn source(&self) -> Option<&(dyn Error + 'static)> {
        self.0.source()
    }
}

/// The request body type the protected service receives.
pub type ReplayRequestBody = UnsyncBoxBody<Bytes, BodyError>;

/// The body type of every response the replay layer returns.
pub type ReplayResponseBody = UnsyncBoxBody<Bytes, BodyError>;

/// Builds an RFC 9457 `application/problem+json` response. `kind` becomes the problem type
/// `urn:backstop:problem:<kind>`.
pub(crate) fn problem(
    status: StatusCode,
    kind: &str,
    title: &str,
    detail: &str,
) -> Response<ReplayResponseBody> {
    let mut res = Response::new(full(problem_body(status, kind, title, detail)));
    *res.status_mut() = status;
    res.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/problem+json"),
    );
    res
}

/// The JSON of a problem response.
pub(crate) fn problem_body(status: StatusCode, kind: &str, title: &str, detail: &str) -> Bytes {
    let body = serde_json::json!({
        "type": format!("urn:backstop:problem:{kind}"),
        "title": title,
        "status": status.as_u16(),
        "detail": detail,
    });
    Bytes::from(body.to_string())
}

pub(crate) fn full(bytes: Bytes) -> ReplayResponseBody {
    Full::new(bytes).map_err(|e| match e {}).boxed_unsync()
}

pub(crate) fn replayed(stored: &StoredResponse) -> Response<ReplayResponseBody> {
    if let Some(read) = stored.body_omitted {
        return problem(
            StatusCode::CONFLICT,
            "response-not-stored",
            "Already processed",
            &format!(
                "a request with this idempotency key was already processed (status {}), but its \
                 response ({read} bytes or more) was too large to store, so it cannot be replayed; \
                 look the result up instead of repeating the request",
                stored.status
            ),
        );
    }
    let mut res = Response::new(full(stored.body.clone()));
    *res.status_mut() =
        StatusCode::from_u16(stored.status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    for (k, v) in &stored.headers {
        res.headers_mut().append(k.clone(), v.clone());
    }
    res.headers_mut()
        .insert("idempotent-replayed", HeaderValue::from_static("true"));
    res
}

pub(crate) fn retry_later(mut res: Response<ReplayResponseBody>) -> Response<ReplayResponseBody> {
    res.headers_mut()
        .insert(header::RETRY_AFTER, HeaderValue::from_static("1"));
    res
}

/// The record of a claimed request whose handler ended without a response (it returned an
/// error, panicked, or its task was stopped): its outcome is unknown, and a repeat is told so
/// instead of running the handler a second time.
pub(crate) fn unknown_record() -> StoredResponse {
    StoredResponse {
        status: StatusCode::CONFLICT.as_u16(),
        headers: vec![(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/problem+json"),
        )],
        body: problem_body(
            StatusCode::CONFLICT,
            "outcome-unknown",
            "Outcome unknown",
            UNKNOWN_DETAIL,
        ),
        body_omitted: None,
    }
}

/// Whether `stored` is the record of an unknown outcome.
pub(crate) fn is_unknown_record(stored: &StoredResponse) -> bool {
    stored.status == StatusCode::CONFLICT.as_u16() && stored.body == unknown_record().body
}

const UNKNOWN_DETAIL: &str = "a request with this idempotency key started processing and ended \
    without a response (the handler failed or the server stopped), so it may or may not have \
    taken effect; it was not run again. Check the result before repeating the action with a new \
    key.";

/// What the first caller of a handler that panicked gets: the record its repeats get.
pub(crate) fn unknown_outcome() -> Response<ReplayResponseBody> {
    let record = unknown_record();
    let mut res = Response::new(full(record.body));
    *res.status_mut() = StatusCode::CONFLICT;
    for (k, v) in record.headers {
        res.headers_mut().insert(k, v);
    }
    res
}

/// Counts what the layer answered without running the handler (`replayed` is a duplicate
/// prevented), with the `metrics` feature.
pub(crate) fn count(outcome: &'static str) {
    #[cfg(feature = "metrics")]
    metrics::counter!("backstop_replay_total", "outcome" => outcome).increment(1);
    let _ = outcome;
}

pub(crate) fn mismatch() -> Response<ReplayResponseBody> {
    count("mismatch");
    problem(
        StatusCode::UNPROCESSABLE_ENTITY,
        "idempotency-key-reused",
        "Idempotency key reused",
        "this idempotency key was already used for a different request (method, path or body); \
         use a new key for a different action",
    )
}

pub(crate) fn store_unavailable() -> Response<ReplayResponseBody> {
    count("store_unavailable");
    retry_later(problem(
        StatusCode::SERVICE_UNAVAILABLE,
        "replay-store-unavailable",
        "Deduplication unavailable",
        "the idempotency store is unavailable, so the request was not processed (it could not \
         be protected against duplicates); retry later with the same key",
    ))
}

/// A keyed request without a principal: refused, since its stored result could be shared with
/// another tenant.
pub(crate) fn principal_missing() -> Response<ReplayResponseBody> {
    count("no_principal");
    tracing::error!(target: "backstop::replay", "a keyed request reached the replay layer without a principal; refused");
    problem(
        StatusCode::INTERNAL_SERVER_ERROR,
        "principal-missing",
        "Server misconfigured",
        "the server is misconfigured: the request reached the idempotency layer without an \
         authenticated principal, so its stored result could be shared with another \
         tenant; it was not processed. (Operators: put the authentication layer outside \
         the replay layer, or build the layer with single_tenant() if the service has \
         one tenant.)",
    )
}
