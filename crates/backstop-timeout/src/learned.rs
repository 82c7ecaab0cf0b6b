//! The attempt timeout learned from the dependency's latency: [`LearnedTimeoutLayer`].

use crate::{
    LatencyTimeouts,
    timed::{AttemptCutoff, TimedFuture},
};
use backstop_core::{
    BoxError, CallContext, Classify, Deadline, Dependency, HasExtensions, ReplaySafe, Verdict,
};
use pin_project::pin_project;
use std::{
    fmt,
    future::Future,
    marker::PhantomData,
    pin::Pin,
    sync::Arc,
    task::{Context, Poll, ready},
    time::Duration,
};
use tokio::time::Instant;
use tower_layer::Layer;
use tower_service::Service;

/// Applies [`LearnedTimeout`] to a service: each attempt's limit learned from the dependency's
/// observed latency ([`LatencyTimeouts`](crate::LatencyTimeouts)), instead of a fixed one.
///
/// The limit is a high percentile of the dependency's successful attempts, doubled for each
/// retry (the attempt's number, from the call context a retry layer outside wrote), within a
/// floor and a ceiling, and a fallback until enough samples exist. Every successful attempt
/// (as `classifier` judges it) is recorded, and every attempt the learned limit cut is counted
/// apart. Only replay-safe requests (an idempotent method, a key the dependency honours,
/// [`ReplaySafe`]) are planned from and recorded in the record: an attempt cut there may be sent
/// again. Any other request keeps the fixed `limit`, since a cut would leave its outcome unknown
/// for good. The request's [`Deadline`](backstop_core::Deadline) still bounds every attempt.
///
/// ```
/// use backstop_classify::HttpClassifier;
/// use backstop_core::{AttemptTimedOut, BoxError, Dependency};
/// use backstop_timeout::{LatencyConfig, LatencyTimeouts, LearnedTimeoutLayer};
/// use std::time::Duration;
/// use tower::{Layer, ServiceExt, service_fn};
///
/// # #[tokio::main(flavor = "current_thread", start_paused = true)]
/// # async fn main() {
/// let timeouts = LatencyTimeouts::new(LatencyConfig::default()).unwrap();
/// let latency = timeouts.bind(&Dependency::new("search-api"));
/// let hangs = service_fn(|_req: http::Request<()>| async {
///     tokio::time::sleep(Duration::from_secs(3600)).await;
///     Ok::<_, BoxError>(http::Response::new(()))
/// });
/// let svc = LearnedTimeoutLayer::new(latency, HttpClassifier::new(), Duration::from_secs(5))
///     .layer(hangs);
/// // A GET is replay-safe: nothing learned yet, so the fallback (2 s) bounds it.
/// let err = svc.oneshot(http::Request::new(())).await.unwrap_err();
/// assert_eq!(err.downcast_ref::<AttemptTimedOut>().unwrap().limit(), Duration::from_secs(2));
/// # }
/// ```
#[derive(Debug)]
pub struct LearnedTimeoutLayer<C> {
    latency: LatencyTimeouts,
    /// The dependency of requests that name none: the one `latency` is bound to.
    dependency: Dependency,
    classifier: Arc<C>,
    fixed: Duration,
}

impl<C> Clone for LearnedTimeoutLayer<C> {
    fn clone(&self) -> Self {
        LearnedTimeoutLayer {
            latency: self.latency.clone(),
            dependency: self.dependency.clone(),
            classifier: self.classifier.clone(),
            fixed: self.fixed,
        }
    }
}

impl<C> LearnedTimeoutLayer<C> {
    /// Limits learned in `latency`'s records, successes judged by `classifier`, and `fixed` for
    /// requests that are not replay-safe. A request that names no dependency is timed as the
    /// one `latency` is [bound](LatencyTimeouts::bind) to (unbound: as an unnamed one).
    pub fn new(latency: LatencyTimeouts, classifier: C, fixed: Duration) -> Self {
        let dependency = latency
            .dependency()
            .cloned()
            .unwrap_or_else(Dependency::unnamed);
        LearnedTimeoutLayer {
            latency: latency.bind(&dependency),
            dependency,
            classifier: Arc::new(classifier),
            fixed,
        }
    }
}

impl<S, C> Layer<S> for LearnedTimeoutLayer<C> {
    type Service = LearnedTimeout<S, C>;
    fn layer(&self, inner: S) -> Self::Service {
        LearnedTimeout {
            inner,
            layer: self.clone(),
        }
    }
}

/// See [`LearnedTimeoutLayer`]. Fails an attempt still running at its limit with
/// [`AttemptTimedOut`](backstop_core::AttemptTimedOut), or with
/// [`DeadlineExceeded`](backstop_core::DeadlineExceeded) when the deadline came first.
#[derive(Debug)]
pub struct LearnedTimeout<S, C> {
    inner: S,
    layer: LearnedTimeoutLayer<C>,
}

impl<S: Clone, C> Clone for LearnedTimeout<S, C> {
    fn clone(&self) -> Self {
        LearnedTimeout {
            inner: self.inner.clone(),
            layer: self.layer.clone(),
        }
    }
}

impl<S, C> LearnedTimeout<S, C> {
    /// The inner service.
    pub fn get_ref(&self) -> &S {
        &self.inner
    }
}

impl<S, Req, C> Service<Req> for LearnedTimeout<S, C>
where
    S: Service<Req>,
    S::Error: Into<BoxError>,
    Req: HasExtensions,
    C: Classify<Req, S::Response, BoxError>,
{
    type Response = S::Response;
    type Error = BoxError;
    type Future = LearnedFuture<S::Future, C, Req>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx).map_err(Into::into)
    }

    fn call(&mut self, mut req: Req) -> Self::Future {
        let layer = &self.layer;
        let dependency = Dependency::of(&req).unwrap_or_else(|| layer.dependency.clone());
        let learned = ReplaySafe::is_marked(&req) || layer.classifier.is_replay_safe(&req);
        let limit = if learned {
            let attempt = CallContext::attempt_of(&req).unwrap_or(1);
            let limit = layer.latency.timeout(&dependency, attempt);
            crate::obs::attempt_timeout(&dependency, limit);
            tracing::Span::current().record("attempt_timeout_ms", limit.as_millis() as u64);
            limit
        } else {
            layer.fixed
        };
        let now = Instant::now();
        let timed = match AttemptCutoff::plan(now, Some(limit), Deadline::of(&req)) {
            Ok(end) => {
                if let Some(end) = end {
                    end.hand_down(&mut req);
                }
                TimedFuture::new(self.inner.call(req), end, Some(dependency.clone()))
            }
            Err(passed) => TimedFuture::too_late(passed, Some(dependency.clone())),
        };
        LearnedFuture {
            timed,
            learning: learned.then(|| Learning {
                latency: layer.latency.clone(),
                classifier: layer.classifier.clone(),
                dependency,
                limit,
                started: now,
            }),
            _req: PhantomData,
        }
    }
}

/// What an attempt planned from the record tells it when it ends.
struct Learning<C> {
    latency: LatencyTimeouts,
    classifier: Arc<C>,
    dependency: Dependency,
    limit: Duration,
    started: Instant,
}

/// Response future of [`LearnedTimeout`].
#[pin_project]
pub struct LearnedFuture<F, C, Req> {
    #[pin]
    timed: TimedFuture<F>,
    learning: Option<Learning<C>>,
    _req: PhantomData<fn(Req)>,
}

impl<F, C, Req> fmt::Debug for LearnedFuture<F, C, Req> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LearnedFuture").finish_non_exhaustive()
    }
}

impl<F, C, Req, T, E> Future for LearnedFuture<F, C, Req>
where
    F: Future<Output = Result<T, E>>,
    E: Into<BoxError>,
    C: Classify<Req, T, BoxError>,
{
    type Output = Result<T, BoxError>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let this = self.project();
        let result = ready!(this.timed.poll(cx));
        if let Some(learning) = this.learning.take() {
            learning.tell(&result);
        }
        Poll::Ready(result)
    }
}

impl<C> Learning<C> {
    /// A success is recorded with its latency; an attempt this limit cut is counted apart.
    fn tell<Req, T>(self, result: &Result<T, BoxError>)
    where
        C: Classify<Req, T, BoxError>,
    {
        match result {
            Err(e)
                if e.downcast_ref::<backstop_core::AttemptTimedOut>()
                    .map(|t| t.limit())
                    == Some(self.limit) =>
            {
                self.latency.record_cut(&self.dependency);
            }
            result => {
                if self.classifier.classify(result.as_ref()) == Verdict::Success {
                    self.latency
                        .record(&self.dependency, self.started.elapsed());
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{LatencyConfig, LatencyTimeouts};
    use backstop_core::{AttemptTimedOut, Outcome};
    use backstop_core::{Claim, ScopeOwner};
    use tower::{ServiceExt, service_fn};

    /// Judges `Ok(true)` a success, anything else a failure; every request is replay-safe
    /// unless it says `false`.
    #[derive(Clone)]
    struct Judge;

    impl Classify<http::Request<bool>, bool, BoxError> for Judge {
        fn classify(&self, result: Result<&bool, &BoxError>) -> Verdict {
            match result {
                Ok(true) => Verdict::Success,
                _ => Verdict::Retryable {
                    outcome: Outcome::Unknown,
                    after: None,
                },
            }
        }
        fn is_replay_safe(&self, req: &http::Request<bool>) -> bool {
            *req.body()
        }
    }

    fn answers_after(
        delay: Duration,
        ok: bool,
    ) -> impl Service<http::Request<bool>, Response = bool, Error = BoxError> + Clone {
        service_fn(move |_req: http::Request<bool>| async move {
            tokio::time::sleep(delay).await;
            Ok::<_, BoxError>(ok)
        })
    }

    fn attempt(n: u32, replay_safe: bool) -> http::Request<bool> {
        let mut req = http::Request::new(replay_safe);
        struct Retries;
        CallContext::claim(
            &mut req,
            Claim::new(ScopeOwner::of::<Retries>(), "search-api").attempt(n),
        );
        req
    }

    fn latency() -> LatencyTimeouts {
        let config = LatencyConfig::default()
            .min_samples(10)
            .fallback(Duration::from_secs(2));
        LatencyTimeouts::new(config)
            .unwrap()
            .bind(&Dependency::new("search-api"))
    }

    async fn limit_of(
        svc: &LearnedTimeout<
            impl Service<http::Request<bool>, Response = bool, Error = BoxError> + Clone,
            Judge,
        >,
        req: http::Request<bool>,
    ) -> Duration {
        let hang = LearnedTimeoutLayer::new(svc.layer.latency.clone(), Judge, svc.layer.fixed)
            .layer(answers_after(Duration::from_secs(3600), true));
        let err = hang.oneshot(req).await.unwrap_err();
        err.downcast_ref::<AttemptTimedOut>()
            .expect("cut by its limit")
            .limit()
    }

    #[tokio::test(start_paused = true)]
    async fn successes_teach_the_limit_and_each_retry_doubles_it() {
        let latency = latency();
        let svc = LearnedTimeoutLayer::new(latency.clone(), Judge, Duration::from_secs(9))
            .layer(answers_after(Duration::from_millis(40), true));
        assert_eq!(
            limit_of(&svc, attempt(1, true)).await,
            Duration::from_secs(2),
            "the fallback"
        );
        for _ in 0..32 {
            svc.clone().oneshot(attempt(1, true)).await.unwrap();
        }
        let first = limit_of(&svc, attempt(1, true)).await;
        assert!(first < Duration::from_millis(200), "{first:?}");
        assert_eq!(limit_of(&svc, attempt(2, true)).await, first * 2);
        // A request that is not replay-safe keeps the fixed limit, and teaches nothing.
        assert_eq!(
            limit_of(&svc, attempt(1, false)).await,
            Duration::from_secs(9)
        );
    }

    #[tokio::test(start_paused = true)]
    async fn failures_and_unsafe_requests_teach_nothing() {
        let latency = latency();
        let failing = LearnedTimeoutLayer::new(latency.clone(), Judge, Duration::from_secs(9))
            .layer(answers_after(Duration::from_millis(40), false));
        let unsafe_ok = LearnedTimeoutLayer::new(latency.clone(), Judge, Duration::from_secs(9))
            .layer(answers_after(Duration::from_millis(40), true));
        for _ in 0..32 {
            failing.clone().oneshot(attempt(1, true)).await.unwrap();
            unsafe_ok.clone().oneshot(attempt(1, false)).await.unwrap();
        }
        assert_eq!(
            latency.timeout(&Dependency::new("search-api"), 1),
            Duration::from_secs(2)
        );
    }
}
