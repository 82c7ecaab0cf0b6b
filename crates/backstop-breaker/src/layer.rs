use crate::{Breaker, circuit::Signal, permit::Permit};
use backstop_core::{BoxError, CircuitOpen, Dependency, DependencyKey, HasExtensions, Outcome};
use backstop_core::{Classify, Verdict};
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

/// Applies [`CircuitBreaker`] to a service.
///
/// Place it inside the retry layer (each attempt counts) and outside the attempt timeout (a
/// timed-out attempt is a failure). `C` judges each result (an HTTP classifier, say: the facade's
/// `backstop::breaker::http_layer` gives one); `K` finds each request's dependency.
#[derive(Clone, Debug)]
pub struct BreakerLayer<C, K = Dependency> {
    breaker: Breaker,
    classifier: Arc<C>,
    key: K,
}

impl<C> BreakerLayer<C> {
    /// A breaker judging results with `classifier`, for one dependency:
    /// a dependency of its own ([`Dependency::unnamed`]) until
    /// [`dependency`](Self::dependency) names it.
    pub fn new(breaker: Breaker, classifier: C) -> Self {
        BreakerLayer {
            breaker,
            classifier: Arc::new(classifier),
            key: Dependency::unnamed(),
        }
    }
}

impl<C, K> BreakerLayer<C, K> {
    /// Names the one dependency every request goes to. A [`Dependency`] the request carries (in
    /// its extensions, or the one a retry layer outside made current for the attempt, see
    /// [`Dependency::of`]) wins, so the retry budget and the breaker always agree.
    pub fn dependency(self, name: impl Into<Dependency>) -> BreakerLayer<C, Dependency> {
        self.dependency_key(name.into())
    }

    /// Derives the dependency from each request when neither it nor the attempt names one.
    pub fn dependency_key<K2>(self, key: K2) -> BreakerLayer<C, K2> {
        BreakerLayer {
            breaker: self.breaker,
            classifier: self.classifier,
            key,
        }
    }

    /// Replaces the classifier.
    pub fn classifier<C2>(self, classifier: C2) -> BreakerLayer<C2, K> {
        BreakerLayer {
            breaker: self.breaker,
            classifier: Arc::new(classifier),
            key: self.key,
        }
    }
}

impl<S, C, K: Clone> Layer<S> for BreakerLayer<C, K> {
    type Service = CircuitBreaker<S, C, K>;
    fn layer(&self, inner: S) -> Self::Service {
        CircuitBreaker {
            inner,
            breaker: self.breaker.clone(),
            classifier: self.classifier.clone(),
            key: self.key.clone(),
        }
    }
}

/// Fails calls fast while a dependency's circuit is open; see the crate docs.
#[derive(Clone)]
pub struct CircuitBreaker<S, C, K = Dependency> {
    inner: S,
    breaker: Breaker,
    classifier: Arc<C>,
    key: K,
}

impl<S: fmt::Debug, C, K: fmt::Debug> fmt::Debug for CircuitBreaker<S, C, K> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CircuitBreaker")
            .field("inner", &self.inner)
            .field("breaker", &self.breaker)
            .field("dependency", &self.key)
            .finish()
    }
}

impl<S, C, K> CircuitBreaker<S, C, K> {
    /// The breaker.
    pub fn breaker(&self) -> &Breaker {
        &self.breaker
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

impl<S, Req, C, K> Service<Req> for CircuitBreaker<S, C, K>
where
    S: Service<Req>,
    S::Error: Into<BoxError>,
    Req: HasExtensions,
    C: Classify<Req, S::Response, S::Error>,
    K: DependencyKey<Req>,
{
    type Response = S::Response;
    type Error = BoxError;
    type Future = BreakerFuture<S::Future, C, Req>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), BoxError>> {
        self.inner.poll_ready(cx).map_err(Into::into)
    }

    fn call(&mut self, req: Req) -> Self::Future {
        let permit = match Dependency::of(&req) {
            Some(d) => self.breaker.acquire(&d),
            None => self.breaker.acquire(&self.key.dependency(&req)),
        };
        match permit {
            // Open: fail at once; the inner service is not touched.
            Err(open) => {
                crate::permit::count_rejection(&open);
                BreakerFuture {
                    state: State::Rejected { error: Some(open) },
                    _req: PhantomData,
                }
            }
            Ok(permit) => {
                let slow = self.breaker.inner.config.slow_call;
                BreakerFuture {
                    state: State::Running {
                        fut: self.inner.call(req),
                        permit: Some(permit),
                        classifier: self.classifier.clone(),
                        slow: slow.map(|t| (Instant::now(), t)),
                    },
                    _req: PhantomData,
                }
            }
        }
    }
}

/// Response future of [`CircuitBreaker`].
#[pin_project]
pub struct BreakerFuture<F, C, Req> {
    #[pin]
    state: State<F, C>,
    _req: PhantomData<fn(Req)>,
}

impl<F, C, Req> fmt::Debug for BreakerFuture<F, C, Req> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("BreakerFuture").finish_non_exhaustive()
    }
}

#[pin_project(project = StateProj)]
enum State<F, C> {
    Running {
        #[pin]
        fut: F,
        permit: Option<Permit>,
        classifier: Arc<C>,
        slow: Option<(Instant, Duration)>,
    },
    Rejected {
        error: Option<CircuitOpen>,
    },
}

#[inline]
pub(crate) fn signal(verdict: Verdict) -> Signal {
    match verdict {
        Verdict::Success
        | Verdict::Fatal {
            outcome: Outcome::Completed,
        } => Signal::Success,
        Verdict::Fatal {
            outcome: Outcome::NotSent,
        } => Signal::Ignore,
        Verdict::Retryable { .. }
        | Verdict::Fatal {
            outcome: Outcome::Unknown,
        } => Signal::Failure,
    }
}

impl<F, C, Req, T, E> Future for BreakerFuture<F, C, Req>
where
    F: Future<Output = Result<T, E>>,
    E: Into<BoxError>,
    C: Classify<Req, T, E>,
{
    type Output = Result<T, BoxError>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        match self.project().state.project() {
            StateProj::Rejected { error } => Poll::Ready(Err(error
                .take()
                .expect("breaker future polled after completion")
                .into())),
            StateProj::Running {
                fut,
                permit,
                classifier,
                slow,
            } => {
                let result = ready!(fut.poll(cx));
                let mut s = signal(classifier.classify(result.as_ref()));
                if let (Signal::Success, Some((started, limit))) = (s, *slow)
                    && started.elapsed() > limit
                {
                    s = Signal::Failure;
                }
                if let Some(p) = permit.take() {
                    p.record(s);
                }
                Poll::Ready(result.map_err(Into::into))
            }
        }
    }
}
