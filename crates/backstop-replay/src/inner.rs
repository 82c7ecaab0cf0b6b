//! The handler called: its answer boxed into the layer's response body.

use crate::problem::{BodyError, ReplayRequestBody, ReplayResponseBody};
use backstop_core::BoxError;
use bytes::Bytes;
use http::{Request, Response};
use http_body::Body;
use http_body_util::BodyExt;
use tower_service::Service;

/// The handler's response with its body boxed as the layer's.
pub(crate) fn boxed_response<ResB>(res: Response<ResB>) -> Response<ReplayResponseBody>
where
    ResB: Body<Data = Bytes> + Send + 'static,
    ResB::Error: Into<BoxError>,
{
    res.map(|b| b.map_err(|e| BodyError(e.into())).boxed_unsync())
}

/// Calls the handler `svc` with `req`.
pub(crate) async fn call_inner<S, ResB>(
    mut svc: S,
    req: Request<ReplayRequestBody>,
) -> Result<Response<ReplayResponseBody>, S::Error>
where
    S: Service<Request<ReplayRequestBody>, Response = Response<ResB>>,
    ResB: Body<Data = Bytes> + Send + 'static,
    ResB::Error: Into<BoxError>,
{
    svc.call(req).await.map(boxed_response)
}
