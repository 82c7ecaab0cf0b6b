use backstop_core::BoxError;
use pin_project::pin_project;
use std::{
    future::Future,
    pin::Pin,
    task::{Context, Poll, ready},
};
use tower_service::Service;

/// Turns a service's errors into `BoxError`, so that one classifier (which walks a boxed
/// error's chain) serves every client the stack wraps. A named type rather than tower's
/// `MapErr` with a function: the compiler then proves `Send` for the whole stack without
/// tripping over a higher-ranked function pointer.
#[derive(Clone, Debug)]
pub struct BoxErrors<S>(pub S);

impl<S, Req> Service<Req> for BoxErrors<S>
where
    S: Service<Req>,
    S::Error: Into<BoxError>,
{
    type Response = S::Response;
    type Error = BoxError;
    type Future = BoxErrorsFuture<S::Future>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), BoxError>> {
        self.0.poll_ready(cx).map_err(Into::into)
    }

    fn call(&mut self, req: Req) -> Self::Future {
        BoxErrorsFuture(self.0.call(req))
    }
}

/// Response future of [`BoxErrors`].
#[pin_project]
#[derive(Debug)]
pub struct BoxErrorsFuture<F>(#[pin] F);

impl<F, T, E> Future for BoxErrorsFuture<F>
where
    F: Future<Output = Result<T, E>>,
    E: Into<BoxError>,
{
    type Output = Result<T, BoxError>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        Poll::Ready(ready!(self.project().0.poll(cx)).map_err(Into::into))
    }
}
