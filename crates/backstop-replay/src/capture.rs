//! A handler's response read up to the storage limit: the record to store, and the response
//! its caller gets whole.

use crate::{
    body::PrefixedBody,
    config::Config,
    guard::ClaimGuard,
    problem::{ReplayResponseBody, full},
    store::StoredResponse,
};
use backstop_core::BoxError;
use bytes::{Bytes, BytesMut};
use http::{Response, header};
use http_body_util::BodyExt;

/// Reads the response body up to the storage limit, stores the result, and returns the full
/// response to the caller.
pub(crate) async fn capture(
    cfg: &Config,
    guard: ClaimGuard,
    res: Response<ReplayResponseBody>,
) -> Response<ReplayResponseBody> {
    let (stored, res) = buffer(cfg, res).await;
    guard.complete(&stored).await;
    res
}

/// Reads the response body up to the storage limit: the record to store, and the response to
/// return (the part read, then the rest of a body too large to store).
pub(crate) async fn buffer(
    cfg: &Config,
    res: Response<ReplayResponseBody>,
) -> (StoredResponse, Response<ReplayResponseBody>) {
    let (parts, body) = res.into_parts();
    let mut body = body;
    let mut buf = BytesMut::new();
    let mut failed: Option<BoxError> = None;
    // `body` is the boxed response body: its errors are `BodyError`.
    let mut over = false;
    loop {
        match body.frame().await {
            None => break,
            Some(Err(e)) => {
                failed = Some(e.0);
                break;
            }
            Some(Ok(frame)) => {
                if let Ok(data) = frame.into_data() {
                    buf.extend_from_slice(&data);
                    if buf.len() > cfg.max_stored_body {
                        over = true;
                        break;
                    }
                }
            }
        }
    }
    let headers = parts
        .headers
        .iter()
        .filter(|(k, _)| {
            *k != header::SET_COOKIE && *k != header::DATE && cfg.allow_headers.contains(k)
        })
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect();
    let read = buf.len() as u64;
    let prefix = buf.freeze();
    let stored = StoredResponse {
        status: parts.status.as_u16(),
        headers,
        body: if over || failed.is_some() {
            Bytes::new()
        } else {
            prefix.clone()
        },
        body_omitted: (over || failed.is_some()).then_some(read),
    };
    let body = if over || failed.is_some() {
        PrefixedBody {
            prefix: (!prefix.is_empty()).then_some(prefix),
            rest: over.then_some(body),
            error: failed,
        }
        .boxed_unsync()
    } else {
        full(prefix)
    };
    (stored, Response::from_parts(parts, body))
}
