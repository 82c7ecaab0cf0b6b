use crate::timed::{AttemptCutoff, TimedFuture};
use backstop_core::{BoxError, Deadline, Dependency, HasExtensions};
use std::{
    task::{Context, Poll},
    time::Duration,
};
use tokio::time::Instant;
use tower_layer::Layer;
use tower_service::Service;

/// Applies [`WithDeadline`] to a service: one overall time budget per logical call.
#[derive(Clone, Debug)]
pub struct DeadlineLayer {
    budget: Duration,
    dependency: Option<Dependency>,
}

impl DeadlineLayer {
    /// Each call, with all its attempts and backoff sleeps, must end within `budget` (or the
    /// caller's own [`Deadline`], when that is earlier).
    pub const fn new(budget: Duration) -> Self {
        DeadlineLayer {
            budget,
            dependency: None,
        }
    }

    /// The dependency named in errors when the request does not name one in its extensions.
    #[must_use]
    pub fn dependency(mut self, name: impl Into<Dependency>) -> Self {
        self.dependency = Some(name.into());
        self
    }

    /// The configured budget.
    pub fn budget(&self) -> Duration {
        self.budget
    }
}

impl<S> Layer<S> for DeadlineLayer {
    type Service = WithDeadline<S>;
    fn layer(&self, inner: S) -> Self::Service {
        WithDeadline {
            inner,
            budget: self.budget,
            dependency: self.dependency.clone(),
        }
    }
}

/// Records a [`Deadline`] on each request (keeping a tighter one the caller set) and fails the
/// call with [`DeadlineExceeded`](crate::DeadlineExceeded) when it passes.
///
/// Inner Backstop layers end the call by themselves before the deadline with a precise
/// verdict; this layer's own timer is the guarantee for inner services that do not look at the
/// deadline.
#[derive(Clone, Debug)]
pub struct WithDeadline<S> {
    inner: S,
    budget: Duration,
    dependency: Option<Dependency>,
}

impl<S> WithDeadline<S> {
    /// Wraps `inner`.
    pub fn new(inner: S, budget: Duration) -> Self {
        WithDeadline {
            inner,
            budget,
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

impl<S, Req> Service<Req> for WithDeadline<S>
where
    S: Service<Req>,
    S::Error: Into<BoxError>,
    Req: HasExtensions,
{
    type Response = S::Response;
    type Error = BoxError;
    type Future = DeadlineFuture<S::Future>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx).map_err(Into::into)
    }

    fn call(&mut self, mut req: Req) -> Self::Future {
        let now = Instant::now();
        let deadline = Deadline::after_from(now, self.budget).tighten(&mut req);
        let dependency = Dependency::of(&req).or_else(|| self.dependency.clone());
        match AttemptCutoff::plan(now, None, Some(deadline)) {
            Ok(end) => TimedFuture::new(
                self.inner.call(req),
                end.expect("a deadline always sets an end"),
                dependency,
            ),
            Err(passed) => TimedFuture::too_late(passed, dependency),
        }
    }
}

/// Response future of [`WithDeadline`].
pub type DeadlineFuture<F> = TimedFuture<F>;

#[cfg(test)]
mod tests {
    use super::*;
    use backstop_core::{DeadlineExceeded, Outcome};
    use tokio::time::Instant;
    use tower::{ServiceExt, service_fn};

    fn echo_deadline()
    -> impl Service<http::Request<()>, Response = Option<Deadline>, Error = BoxError> + Clone {
        service_fn(|req: http::Request<()>| async move { Ok::<_, BoxError>(Deadline::of(&req)) })
    }

    #[tokio::test(start_paused = true)]
    async fn records_the_deadline() {
        let now = Instant::now();
        let svc = DeadlineLayer::new(Duration::from_secs(10)).layer(echo_deadline());
        let seen = svc.oneshot(http::Request::new(())).await.unwrap().unwrap();
        assert_eq!(seen.instant(), now + Duration::from_secs(10));
    }

    #[tokio::test(start_paused = true)]
    async fn a_tighter_caller_deadline_wins_and_a_looser_one_loses() {
        let now = Instant::now();
        let svc = DeadlineLayer::new(Duration::from_secs(10)).layer(echo_deadline());
        let mut req = http::Request::new(());
        req.extensions_mut()
            .insert(Deadline::at(now + Duration::from_secs(2)));
        let seen = svc.clone().oneshot(req).await.unwrap().unwrap();
        assert_eq!(seen.instant(), now + Duration::from_secs(2));

        let mut req = http::Request::new(());
        req.extensions_mut()
            .insert(Deadline::at(now + Duration::from_secs(60)));
        let seen = svc.oneshot(req).await.unwrap().unwrap();
        assert_eq!(seen.instant(), now + Duration::from_secs(10));
    }

    #[tokio::test(start_paused = true)]
    async fn expired_deadlines_fail_at_once() {
        let svc = DeadlineLayer::new(Duration::from_secs(10))
            .dependency("billing-api")
            .layer(echo_deadline());
        let mut req = http::Request::new(());
        req.extensions_mut().insert(Deadline::at(Instant::now()));
        let err = svc.oneshot(req).await.unwrap_err();
        let d = err.downcast_ref::<DeadlineExceeded>().unwrap();
        assert_eq!(d.outcome(), Outcome::NotSent);
        assert!(err.to_string().contains("billing-api"), "{err}");
    }

    #[tokio::test(start_paused = true)]
    async fn the_timer_bounds_an_inner_service_that_ignores_it() {
        let start = Instant::now();
        let hang = service_fn(|_req: http::Request<()>| async {
            std::future::pending::<()>().await;
            Ok::<(), BoxError>(())
        });
        let svc = DeadlineLayer::new(Duration::from_millis(1500)).layer(hang);
        let err = svc.oneshot(http::Request::new(())).await.unwrap_err();
        assert_eq!(
            err.downcast_ref::<DeadlineExceeded>().unwrap().outcome(),
            Outcome::Unknown
        );
        assert_eq!(start.elapsed(), Duration::from_millis(1500));
    }
}
