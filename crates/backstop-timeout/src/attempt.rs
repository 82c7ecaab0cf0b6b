use crate::timed::{AttemptCutoff, TimedFuture};
use backstop_core::{BoxError, Deadline, Dependency, HasExtensions};
use std::{
    task::{Context, Poll},
    time::Duration,
};
use tokio::time::Instant;
use tower_layer::Layer;
use tower_service::Service;

/// Applies [`AttemptTimeout`] to a service.
#[derive(Clone, Debug)]
pub struct AttemptTimeoutLayer {
    limit: Duration,
    dependency: Option<Dependency>,
}

impl AttemptTimeoutLayer {
    /// Each attempt may take at most `limit` (or the time left before the request's
    /// [`Deadline`](backstop_core::Deadline), when that is shorter).
    pub const fn new(limit: Duration) -> Self {
        AttemptTimeoutLayer {
            limit,
            dependency: None,
        }
    }

    /// The dependency named in errors when the request does not name one in its extensions.
    #[must_use]
    pub fn dependency(mut self, name: impl Into<Dependency>) -> Self {
        self.dependency = Some(name.into());
        self
    }

    /// The configured limit.
    pub fn limit(&self) -> Duration {
        self.limit
    }
}

impl<S> Layer<S> for AttemptTimeoutLayer {
    type Service = AttemptTimeout<S>;
    fn layer(&self, inner: S) -> Self::Service {
        AttemptTimeout {
            inner,
            limit: self.limit,
            dependency: self.dependency.clone(),
        }
    }
}

/// Fails an attempt that takes longer than its limit with [`AttemptTimedOut`](backstop_core::AttemptTimedOut) (outcome
/// unknown), or with [`DeadlineExceeded`](backstop_core::DeadlineExceeded) when the request's deadline was the tighter limit.
#[derive(Clone, Debug)]
pub struct AttemptTimeout<S> {
    inner: S,
    limit: Duration,
    dependency: Option<Dependency>,
}

impl<S> AttemptTimeout<S> {
    /// Wraps `inner`.
    pub fn new(inner: S, limit: Duration) -> Self {
        AttemptTimeout {
            inner,
            limit,
            dependency: None,
        }
    }
    /// The inner service.
    pub fn get_ref(&self) -> &S {
        &self.inner
    }
    /// The inner service, mutably.
    pub fn get_mut(&mut self) -> &mut S {
        &mut self.inner
    }
    /// Unwraps the inner service.
    pub fn into_inner(self) -> S {
        self.inner
    }
}

impl<S, Req> Service<Req> for AttemptTimeout<S>
where
    S: Service<Req>,
    S::Error: Into<BoxError>,
    Req: HasExtensions,
{
    type Response = S::Response;
    type Error = BoxError;
    type Future = TimedFuture<S::Future>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx).map_err(Into::into)
    }

    fn call(&mut self, mut req: Req) -> Self::Future {
        let dependency = Dependency::of(&req).or_else(|| self.dependency.clone());
        match AttemptCutoff::plan(Instant::now(), Some(self.limit), Deadline::of(&req)) {
            Ok(end) => {
                if let Some(end) = end {
                    end.hand_down(&mut req);
                }
                TimedFuture::new(self.inner.call(req), end, dependency)
            }
            Err(passed) => TimedFuture::too_late(passed, dependency),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use backstop_core::ReportsOutcome;
    use backstop_core::{AttemptTimedOut, DeadlineExceeded, Outcome};
    use tower::{ServiceExt, service_fn};

    fn slow(
        delay: Duration,
    ) -> impl Service<http::Request<()>, Response = &'static str, Error = BoxError, Future: Send> + Clone
    {
        service_fn(move |_req: http::Request<()>| async move {
            tokio::time::sleep(delay).await;
            Ok::<_, BoxError>("done")
        })
    }

    #[tokio::test(start_paused = true)]
    async fn fast_attempts_pass() {
        let svc = AttemptTimeoutLayer::new(Duration::from_secs(1))
            .layer(slow(Duration::from_millis(999)));
        assert_eq!(svc.oneshot(http::Request::new(())).await.unwrap(), "done");
    }

    #[tokio::test(start_paused = true)]
    async fn slow_attempts_time_out_with_an_unknown_outcome() {
        let start = Instant::now();
        let svc =
            AttemptTimeoutLayer::new(Duration::from_secs(1)).layer(slow(Duration::from_secs(5)));
        let mut req = http::Request::new(());
        req.extensions_mut().insert(Dependency::new("search-api"));
        let err = svc.oneshot(req).await.unwrap_err();
        let t = err
            .downcast_ref::<AttemptTimedOut>()
            .expect("AttemptTimedOut");
        assert_eq!(t.dependency().unwrap().as_str(), "search-api");
        assert_eq!(t.outcome(), Outcome::Unknown);
        assert_eq!(start.elapsed(), Duration::from_secs(1));
    }

    #[tokio::test(start_paused = true)]
    async fn the_deadline_shortens_the_attempt() {
        let start = Instant::now();
        let svc =
            AttemptTimeoutLayer::new(Duration::from_secs(10)).layer(slow(Duration::from_secs(60)));
        let mut req = http::Request::new(());
        Deadline::after(Duration::from_secs(3)).tighten(&mut req);
        let err = svc.oneshot(req).await.unwrap_err();
        let d = err
            .downcast_ref::<DeadlineExceeded>()
            .expect("DeadlineExceeded");
        assert_eq!(d.outcome(), Outcome::Unknown);
        assert_eq!(start.elapsed(), Duration::from_secs(3));
    }

    #[tokio::test(start_paused = true)]
    async fn a_passed_deadline_is_not_sent() {
        let calls = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let c = calls.clone();
        let inner = service_fn(move |_req: http::Request<()>| {
            c.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            async { Ok::<_, BoxError>(()) }
        });
        let svc = AttemptTimeoutLayer::new(Duration::from_secs(1)).layer(inner);
        let mut req = http::Request::new(());
        Deadline::at(Instant::now()).tighten(&mut req);
        let err = svc.oneshot(req).await.unwrap_err();
        assert_eq!(
            err.downcast_ref::<DeadlineExceeded>().unwrap().outcome(),
            Outcome::NotSent
        );
        assert_eq!(calls.load(std::sync::atomic::Ordering::SeqCst), 0);
    }
}
