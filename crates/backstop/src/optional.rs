use backstop_core::BoxError;
use pin_project::pin_project;
use std::{
    future::Future,
    pin::Pin,
    task::{Context, Poll},
};
use tower_layer::Layer;
use tower_service::Service;

/// A layer that may be turned off: `Some(layer)` applies it, `None` passes requests through.
///
/// Unlike tower's `Either`, the two branches may have different error types; both become
/// `BoxError`.
#[derive(Clone, Debug)]
pub struct OptionalLayer<L>(pub Option<L>);

impl<L: Layer<S>, S> Layer<S> for OptionalLayer<L> {
    type Service = Optional<L::Service, S>;
    fn layer(&self, inner: S) -> Self::Service {
        match &self.0 {
            Some(l) => Optional::On(l.layer(inner)),
            None => Optional::Off(inner),
        }
    }
}

/// The service of an [`OptionalLayer`].
#[derive(Clone, Debug)]
pub enum Optional<A, B> {
    /// The layer is on.
    On(A),
    /// The layer is off.
    Off(B),
}

impl<A, B, Req> Service<Req> for Optional<A, B>
where
    A: Service<Req>,
    A::Error: Into<BoxError>,
    B: Service<Req, Response = A::Response>,
    B::Error: Into<BoxError>,
{
    type Response = A::Response;
    type Error = BoxError;
    type Future = OptionalFuture<A::Future, B::Future>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), BoxError>> {
        match self {
            Optional::On(a) => a.poll_ready(cx).map_err(Into::into),
            Optional::Off(b) => b.poll_ready(cx).map_err(Into::into),
        }
    }

    fn call(&mut self, req: Req) -> Self::Future {
        match self {
            Optional::On(a) => OptionalFuture::On(a.call(req)),
            Optional::Off(b) => OptionalFuture::Off(b.call(req)),
        }
    }
}

/// Response future of [`Optional`].
#[pin_project(project = OptionalProj)]
#[derive(Debug)]
pub enum OptionalFuture<A, B> {
    /// The layer is on.
    On(#[pin] A),
    /// The layer is off.
    Off(#[pin] B),
}

impl<A, B, T, EA, EB> Future for OptionalFuture<A, B>
where
    A: Future<Output = Result<T, EA>>,
    B: Future<Output = Result<T, EB>>,
    EA: Into<BoxError>,
    EB: Into<BoxError>,
{
    type Output = Result<T, BoxError>;
    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        match self.project() {
            OptionalProj::On(a) => a.poll(cx).map_err(Into::into),
            OptionalProj::Off(b) => b.poll(cx).map_err(Into::into),
        }
    }
}
