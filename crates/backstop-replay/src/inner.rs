//! The handler readied and called: its answer boxed into the layer's response body.

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

/// Waits until the handler `svc` is ready. The layer readies its own handle only once a
/// request is read and claimed, so that a slow upload or a store's round trip holds none of the
/// handler's capacity (a concurrency limit's permit).
pub(crate) async fn ready<S: Service<R>, R>(svc: &mut S) -> Result<(), S::Error> {
    std::future::poll_fn(|cx| svc.poll_ready(cx)).await
}

/// Readies the handler `svc` and calls it with `req`, for a request that holds no claim.
pub(crate) async fn ready_and_call<S, ResB>(
    mut svc: S,
    req: Request<ReplayRequestBody>,
) -> Result<Response<ReplayResponseBody>, S::Error>
where
    S: Service<Request<ReplayRequestBody>, Response = Response<ResB>>,
    ResB: Body<Data = Bytes> + Send + 'static,
    ResB::Error: Into<BoxError>,
{
    ready(&mut svc).await?;
    call_inner(svc, req).await
}

/// Calls the handler `svc`, readied, with `req`.
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
