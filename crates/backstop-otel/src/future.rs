//! Future types: [`AttemptMetricsFuture`].

use crate::record::Started;
use backstop_core::BoxError;
use pin_project::{pin_project, pinned_drop};
use std::{
    fmt,
    future::Future,
    pin::Pin,
    task::{Context, Poll, ready},
};

/// Response future of [`AttemptMetrics`](crate::AttemptMetrics).
#[pin_project(PinnedDrop)]
pub struct AttemptMetricsFuture<F> {
    #[pin]
    inner: F,
    started: Option<Started>,
}

impl<F> AttemptMetricsFuture<F> {
    pub(crate) fn new(inner: F, started: Option<Started>) -> Self {
        AttemptMetricsFuture { inner, started }
    }
}

impl<F, RB> Future for AttemptMetricsFuture<F>
where
    F: Future<Output = Result<http::Response<RB>, BoxError>>,
{
    type Output = F::Output;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let this = self.project();
        let result = ready!(this.inner.poll(cx));
        if let Some(started) = this.started.take() {
            match &result {
                Ok(res) => started.answered(res.status()),
                Err(e) => started.failed(e),
            }
        }
        Poll::Ready(result)
    }
}

#[pinned_drop]
impl<F> PinnedDrop for AttemptMetricsFuture<F> {
    fn drop(self: Pin<&mut Self>) {
        if let Some(started) = self.project().started.take() {
            started.dropped();
        }
    }
}

impl<F> fmt::Debug for AttemptMetricsFuture<F> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("AttemptMetricsFuture")
            .field("recording", &self.started.is_some())
            .finish_non_exhaustive()
    }
}
