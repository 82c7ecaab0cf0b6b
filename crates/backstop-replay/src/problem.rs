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
