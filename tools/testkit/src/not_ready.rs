//! A service whose readiness fails once, at a poll the test chooses.

use std::{
    error::Error,
    future::Future,
    pin::Pin,
    sync::{
        Arc,
        atomic::{AtomicU32, Ordering},
    },
    task::{Context, Poll},
};
use tower_service::Service;

type BoxError = Box<dyn Error + Send + Sync>;

/// `inner`, except that its readiness fails at its `at`-th poll (counted from 1, over every
/// clone), and only then: a pool that had a connection when the caller asked and none when the
/// call's turn came. Its errors are boxed.
#[derive(Clone, Debug)]
pub struct NotReadyAt<S> {
    polls: Arc<AtomicU32>,
    at: u32,
    inner: S,
}

impl<S> NotReadyAt<S> {
    /// `inner`, its readiness failing at poll `at`.
    pub fn new(inner: S, at: u32) -> Self {
        NotReadyAt {
            polls: Arc::default(),
            at,
            inner,
        }
    }
}

impl<S, R> Service<R> for NotReadyAt<S>
where
    S: Service<R, Error: Into<BoxError>, Future: Send + 'static>,
{
    type Response = S::Response;
    type Error = BoxError;
    type Future = Pin<Box<dyn Future<Output = Result<S::Response, BoxError>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), BoxError>> {
        if self.polls.fetch_add(1, Ordering::SeqCst) + 1 == self.at {
            return Poll::Ready(Err("no connection left".into()));
        }
        self.inner.poll_ready(cx).map_err(Into::into)
    }

    fn call(&mut self, req: R) -> Self::Future {
        let fut = self.inner.call(req);
        Box::pin(async move { fut.await.map_err(Into::into) })
    }
}
