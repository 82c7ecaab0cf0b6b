use crate::timed::{AttemptCutoff, DeadlinePassed, TimedFuture};
use backstop_core::{BoxError, Deadline, Dependency, HasExtensions};
use std::{
    fmt,
    future::Future,
    pin::Pin,
    task::{Context, Poll, ready},
    time::Duration,
};
use tokio::time::{Instant, Sleep, sleep};
use tower_layer::Layer;
use tower_service::Service;

/// Applies [`WithDeadline`] to a service: one overall time budget per logical call.
#[derive(Clone, Debug)]
pub struct DeadlineLayer {
    budget: Option<Duration>,
    dependency: Option<Dependency>,
}

impl DeadlineLayer {
    /// Each call, with all its attempts and backoff sleeps, must end within `budget` (or the
    /// caller's own [`Deadline`](backstop_core::Deadline), when that is earlier).
    pub const fn new(budget: Duration) -> Self {
        DeadlineLayer {
            budget: Some(budget),
            dependency: None,
        }
    }

    /// No budget of its own: a call ends by the [`Deadline`](backstop_core::Deadline) its caller put on the request, and
    /// runs unbounded without one.
    pub const fn inherited() -> Self {
        DeadlineLayer {
            budget: None,
            dependency: None,
        }
    }

    /// The dependency named in errors when the request does not name one in its extensions.
    #[must_use]
    pub fn dependency(mut self, name: impl Into<Dependency>) -> Self {
        self.dependency = Some(name.into());
        self
    }

    /// The configured budget (`None`: the caller's deadline only).
    pub fn budget(&self) -> Option<Duration> {
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
            unready: None,
            expired: false,
        }
    }
}

/// Records a [`Deadline`](backstop_core::Deadline) on each request (keeping a tighter one the caller set) and fails the
/// call with [`DeadlineExceeded`](backstop_core::DeadlineExceeded) when it passes.
///
/// In a task serving a request whose caller sent its time left
/// ([`CallerDeadlineLayer`](crate::CallerDeadlineLayer)), the caller's deadline
/// ([`Deadline::current`](backstop_core::Deadline::current)) is tightened onto every call as well:
/// a server's outbound calls end when its caller's time does.
///
/// Inner Backstop layers end the call by themselves before the deadline with a precise
/// verdict (the retry layer waits no longer than it, the attempt timeout cuts the last attempt
/// at it); this layer's own timer is the guarantee for inner services that do not look at the
/// deadline.
///
/// **Readiness.** `poll_ready` answers what the inner service answers. With a budget of its
/// own, a wait for readiness longer than the budget answers `Ready` instead, and the call that
/// follows ends at once with `DeadlineExceeded`, not sent, without touching the inner service:
/// a client that never becomes ready does not hold its caller past the deadline. This is the
/// one place a Backstop stack bounds readiness before the first attempt; the retry layer bounds
/// each retry's wait for readiness by the same deadline.
pub struct WithDeadline<S> {
    inner: S,
    budget: Option<Duration>,
    dependency: Option<Dependency>,
    /// The budget, running since the inner service first answered `Pending` in this wait for
    /// readiness.
    unready: Option<Pin<Box<Sleep>>>,
    /// The inner service did not become ready within the budget: the next call ends at once.
    expired: bool,
}

impl<S: Clone> Clone for WithDeadline<S> {
    fn clone(&self) -> Self {
        WithDeadline {
            inner: self.inner.clone(),
            budget: self.budget,
            dependency: self.dependency.clone(),
            unready: None,
            expired: false,
        }
    }
}

impl<S: fmt::Debug> fmt::Debug for WithDeadline<S> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("WithDeadline")
            .field("inner", &self.inner)
            .field("budget", &self.budget)
            .field("dependency", &self.dependency)
            .finish_non_exhaustive()
    }
}

impl<S> WithDeadline<S> {
    /// Wraps `inner`.
    pub fn new(inner: S, budget: Duration) -> Self {
        DeadlineLayer::new(budget).layer(inner)
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
    type Future = TimedFuture<S::Future>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        if let Poll::Ready(ready) = self.inner.poll_ready(cx) {
            // Ready after all (or failed): whatever the wait did is over.
            self.unready = None;
            self.expired = false;
            return Poll::Ready(ready.map_err(Into::into));
        }
        // Readiness already answered stays answered until the call.
        if self.expired {
            return Poll::Ready(Ok(()));
        }
        let Some(budget) = self.budget else {
            return Poll::Pending;
        };
        let timer = self.unready.get_or_insert_with(|| Box::pin(sleep(budget)));
        ready!(timer.as_mut().poll(cx));
        self.unready = None;
        self.expired = true;
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, mut req: Req) -> Self::Future {
        let dependency = Dependency::of(&req).or_else(|| self.dependency.clone());
        if std::mem::take(&mut self.expired) {
            // The whole budget went waiting for readiness: nothing is sent.
            let passed = DeadlinePassed {
                length: self.budget,
            };
            return TimedFuture::too_late(passed, dependency);
        }
        // A server serving a caller's request inherits the caller's deadline.
        if let Some(inherited) = Deadline::current() {
            inherited.tighten(&mut req);
        }
        let now = Instant::now();
        let deadline = match self.budget {
            Some(budget) => Some(Deadline::after_from(now, budget).tighten(&mut req)),
            None => Deadline::of(&req),
        };
        match AttemptCutoff::plan(now, None, deadline) {
            Ok(end) => TimedFuture::new(self.inner.call(req), end, dependency),
            Err(passed) => TimedFuture::too_late(passed, dependency),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use backstop_core::ReportsOutcome;
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

    #[tokio::test(start_paused = true)]
    async fn an_inherited_deadline_is_the_callers_alone() {
        let now = Instant::now();
        let svc = DeadlineLayer::inherited().layer(echo_deadline());
        let seen = svc.clone().oneshot(http::Request::new(())).await.unwrap();
        assert_eq!(seen, None, "no deadline of its own");
        let mut req = http::Request::new(());
        req.extensions_mut()
            .insert(Deadline::at(now + Duration::from_secs(2)));
        let seen = svc.oneshot(req).await.unwrap().unwrap();
        assert_eq!(seen.instant(), now + Duration::from_secs(2));
    }

    /// A service that is never ready, and counts the calls it gets.
    #[derive(Clone)]
    struct NeverReady(std::sync::Arc<std::sync::atomic::AtomicU32>);

    impl Service<http::Request<()>> for NeverReady {
        type Response = ();
        type Error = BoxError;
        type Future = std::future::Ready<Result<(), BoxError>>;
        fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), BoxError>> {
            Poll::Pending
        }
        fn call(&mut self, _req: http::Request<()>) -> Self::Future {
            self.0.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            std::future::ready(Ok(()))
        }
    }

    #[tokio::test(start_paused = true)]
    async fn a_service_never_ready_ends_the_call_at_the_deadline_not_sent() {
        let calls = std::sync::Arc::default();
        let start = Instant::now();
        let svc = DeadlineLayer::new(Duration::from_secs(3))
            .dependency("billing-api")
            .layer(NeverReady(std::sync::Arc::clone(&calls)));
        let err =
            tokio::time::timeout(Duration::from_secs(60), svc.oneshot(http::Request::new(())))
                .await
                .expect("the deadline ends the wait for readiness")
                .unwrap_err();
        assert_eq!(start.elapsed(), Duration::from_secs(3));
        let d = err.downcast_ref::<DeadlineExceeded>().unwrap();
        assert_eq!(d.outcome(), Outcome::NotSent);
        assert_eq!(calls.load(std::sync::atomic::Ordering::SeqCst), 0);

        // Without a budget of its own, readiness is the inner service's alone.
        let svc = DeadlineLayer::inherited().layer(NeverReady(std::sync::Arc::clone(&calls)));
        let waited = tokio::time::timeout(
            Duration::from_secs(3600),
            svc.oneshot(http::Request::new(())),
        )
        .await;
        assert!(waited.is_err(), "still waiting for readiness");
    }
}
