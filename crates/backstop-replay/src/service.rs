//! The service: readiness passed through; a request the layer does not guard sent on the handle
//! polled ready, a guarded one served on a clone readied when the handler's turn comes.

use crate::{
    config::Config,
    inner::call_inner,
    problem::{BodyError, ReplayRequestBody, ReplayResponseBody},
    serve::serve,
};
use backstop_core::BoxError;
use bytes::Bytes;
use http::{Request, Response};
use http_body::Body;
use http_body_util::BodyExt;
use std::{
    fmt,
    future::Future,
    pin::Pin,
    sync::Arc,
    task::{Context, Poll},
};
use tower_service::Service;

/// See [`ReplayLayer`](crate::ReplayLayer).
#[derive(Clone)]
pub struct Replay<S> {
    inner: S,
    cfg: Arc<Config>,
}

impl<S> Replay<S> {
    pub(crate) fn new(inner: S, cfg: Arc<Config>) -> Self {
        Replay { inner, cfg }
    }
}

impl<S: fmt::Debug> fmt::Debug for Replay<S> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Replay")
            .field("inner", &self.inner)
            .finish()
    }
}

/// Response future of [`Replay`]: boxed, since serving a keyed request awaits the store, the
/// handler and the response body in turn.
pub type ReplayFuture<E> =
    Pin<Box<dyn Future<Output = Result<Response<ReplayResponseBody>, E>> + Send>>;

impl<S, B, ResB> Service<Request<B>> for Replay<S>
where
    S: Service<Request<ReplayRequestBody>, Response = Response<ResB>> + Clone + Send + 'static,
    S::Future: Send,
    S::Error: Send + 'static,
    B: Body<Data = Bytes> + Send + 'static,
    B::Error: Into<BoxError>,
    ResB: Body<Data = Bytes> + Send + 'static,
    ResB::Error: Into<BoxError>,
{
    type Response = Response<ReplayResponseBody>;
    type Error = S::Error;
    type Future = ReplayFuture<S::Error>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), S::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: Request<B>) -> Self::Future {
        let clone = self.inner.clone();
        let ready = std::mem::replace(&mut self.inner, clone);
        if !self.cfg.methods.contains(req.method()) {
            // Not guarded: it goes on as it came, on the handle polled ready.
            return Box::pin(pass(ready, req));
        }
        // The handler is called only once the request is read and claimed, or not at all (a
        // replay): the readiness granted goes back at once, and a clone is readied when the
        // handler's turn comes.
        let svc = self.inner.clone();
        drop(ready);
        Box::pin(serve(self.cfg.clone(), svc, req))
    }
}

/// A request the layer does not guard, sent on `svc` (polled ready) with its body boxed.
async fn pass<S, B, ResB>(svc: S, req: Request<B>) -> Result<Response<ReplayResponseBody>, S::Error>
where
    S: Service<Request<ReplayRequestBody>, Response = Response<ResB>>,
    B: Body<Data = Bytes> + Send + 'static,
    B::Error: Into<BoxError>,
    ResB: Body<Data = Bytes> + Send + 'static,
    ResB::Error: Into<BoxError>,
{
    let req = req.map(|b| b.map_err(|e| BodyError(e.into())).boxed_unsync());
    call_inner(svc, req).await
}
