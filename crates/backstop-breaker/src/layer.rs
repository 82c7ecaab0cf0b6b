use crate::{Breaker, permit::Permit};
use backstop_core::{BoxError, CircuitOpen, Classify, Dependency, DependencyKey, HasExtensions};
use pin_project::pin_project;
use std::{
    fmt,
    future::Future,
    marker::PhantomData,
    pin::Pin,
    sync::Arc,
    task::{Context, Poll, ready},
};
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
    /// The breaker whose circuits it keeps.
    pub fn breaker(&self) -> &Breaker {
        &self.breaker
    }

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
            Some(d) => self.breaker.permit(&d),
            None => self.breaker.permit(&self.key.dependency(&req)),
        };
        let state = match permit {
            // Open: fail at once; the inner service is not touched.
            Err(open) => State::Rejected { error: Some(open) },
            Ok(permit) => State::Running {
                fut: self.inner.call(req),
                permit: Some(permit),
                classifier: self.classifier.clone(),
            },
        };
        BreakerFuture {
            state,
            _req: PhantomData,
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
    },
    Rejected {
        error: Option<CircuitOpen>,
    },
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
            } => {
                let result = ready!(fut.poll(cx));
                if let Some(permit) = permit.take() {
                    permit.record(classifier.classify(result.as_ref()));
                }
                Poll::Ready(result.map_err(Into::into))
            }
        }
    }
}
