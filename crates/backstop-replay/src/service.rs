//! The service: readiness passed through, the request served on the handle polled ready.

use crate::{
    config::Config,
    problem::{ReplayRequestBody, ReplayResponseBody},
    serve::serve,
};
use backstop_core::BoxError;
use bytes::Bytes;
use http::{Request, Response};
use http_body::Body;
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
        // The handler is called only once the request is read and claimed, or not at all (a
        // replay): the readiness this handle was granted goes back at once, and the call
        // readies a clone of its own when the handler's turn comes.
        let svc = self.inner.clone();
        drop(std::mem::replace(&mut self.inner, svc.clone()));
        Box::pin(serve(self.cfg.clone(), svc, req))
    }
}
