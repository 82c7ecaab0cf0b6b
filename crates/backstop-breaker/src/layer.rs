use crate::{Breaker, circuit::Circuit, permit::Permit};
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
/// timed-out attempt is a failure). `C` judges each result (an HTTP classifier, say:
/// [`BreakerLayer::http`] takes the default one); `K` finds each request's dependency.
#[derive(Clone, Debug)]
pub struct BreakerLayer<C, K = Dependency> {
    breaker: Breaker,
    classifier: Arc<C>,
    key: K,
    /// The named dependency's circuit, looked up once.
    bound: Option<Bound>,
}

/// A dependency's circuit, looked up once in the breaker's registry.
#[derive(Clone)]
struct Bound {
    dependency: Dependency,
    circuit: Arc<Circuit>,
}

impl fmt::Debug for Bound {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.dependency.fmt(f)
    }
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
            bound: None,
        }
    }
}

impl BreakerLayer<backstop_classify::HttpClassifier, backstop_core::ByAuthority> {
    /// A breaker for HTTP: the default [`HttpClassifier`](backstop_classify::HttpClassifier)
    /// judges each result, and each URI authority has its own circuit unless
    /// [`dependency`](Self::dependency) names one.
    ///
    /// ```
    /// use backstop_breaker::{Breaker, BreakerConfig, BreakerLayer};
    /// use tower::{Layer, ServiceExt, service_fn};
    ///
    /// # #[tokio::main(flavor = "current_thread", start_paused = true)]
    /// # async fn main() {
    /// let breaker = Breaker::new(BreakerConfig::default().consecutive_failures(1)).unwrap();
    /// let down = service_fn(|_req: http::Request<()>| async {
    ///     Ok::<_, std::io::Error>(http::Response::builder().status(503).body(()).unwrap())
    /// });
    /// let svc = BreakerLayer::http(breaker).dependency("carrier-api").layer(down);
    /// assert_eq!(svc.clone().oneshot(http::Request::new(())).await.unwrap().status(), 503);
    /// assert!(svc.oneshot(http::Request::new(())).await.is_err(), "open: refused");
    /// # }
    /// ```
    pub fn http(breaker: Breaker) -> Self {
        BreakerLayer::new(breaker, backstop_classify::HttpClassifier::new())
            .dependency_key(backstop_core::ByAuthority)
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
        let dependency = name.into();
        let circuit = self.breaker.inner.circuits.get(&dependency);
        BreakerLayer {
            bound: Some(Bound {
                dependency: dependency.clone(),
                circuit,
            }),
            ..self.dependency_key(dependency)
        }
    }

    /// Derives the dependency from each request when neither it nor the attempt names one.
    pub fn dependency_key<K2>(self, key: K2) -> BreakerLayer<C, K2> {
        BreakerLayer {
            breaker: self.breaker,
            classifier: self.classifier,
            key,
            bound: None,
        }
    }

    /// Replaces the classifier.
    pub fn classifier<C2>(self, classifier: C2) -> BreakerLayer<C2, K> {
        BreakerLayer {
            breaker: self.breaker,
            classifier: Arc::new(classifier),
            key: self.key,
            bound: self.bound,
        }
    }
}

impl Bound {
    fn permit(&self, breaker: &Breaker) -> Result<Permit, CircuitOpen> {
        Permit::acquire(&breaker.inner, self.circuit.clone(), &self.dependency)
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
            bound: self.bound.clone(),
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
    bound: Option<Bound>,
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
        // The layer's own dependency goes to its circuit without a lookup; any other that the
        // request names, to that one's.
        let permit = match (Dependency::of(&req), &self.bound) {
            (None, Some(b)) => b.permit(&self.breaker),
            (Some(d), Some(b)) if d == b.dependency => b.permit(&self.breaker),
            (Some(d), _) => self.breaker.permit(&d),
            (None, None) => self.breaker.permit(&self.key.dependency(&req)),
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
