//! The throttle as a layer: [`ThrottleLayer`] asks an [`AdaptiveThrottle`] before every attempt
//! and tells it how each ended.

use crate::AdaptiveThrottle;
use backstop_core::{
    BoxError, Classify, Dependency, DependencyKey, HasExtensions, Outcome, Throttled, Verdict,
};
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

/// Applies [`Throttle`] to a service: each attempt admitted by an [`AdaptiveThrottle`] or refused
/// before it is sent ([`Throttled`], outcome not sent), and each attempt sent counted as
/// accepted or not by `classifier`'s verdict.
///
/// Place it inside the retry layer (each attempt is admitted on its own) and outside the
/// breaker. An attempt that a Backstop layer further in refused before sending it (an open
/// circuit: a fatal verdict, not sent) is no evidence about the dependency and is not counted.
///
/// ```
/// use backstop_budget::{AdaptiveThrottle, ThrottleConfig, ThrottleLayer};
/// use backstop_classify::HttpClassifier;
/// use backstop_core::{BoxError, Throttled};
/// use tower::{Layer, ServiceExt, service_fn};
///
/// # #[tokio::main(flavor = "current_thread", start_paused = true)]
/// # async fn main() {
/// let throttle = AdaptiveThrottle::new(ThrottleConfig::default(), 7).unwrap();
/// // A dependency that sheds every attempt.
/// let shedding = service_fn(|_req: http::Request<()>| async {
///     Ok::<_, BoxError>(http::Response::builder().status(429).body(()).unwrap())
/// });
/// let svc = ThrottleLayer::new(throttle, HttpClassifier::new())
///     .dependency("search-api")
///     .layer(shedding);
/// let mut refused = 0;
/// for _ in 0..100 {
///     if let Err(e) = svc.clone().oneshot(http::Request::new(())).await {
///         assert!(e.is::<Throttled>());
///         refused += 1;
///     }
/// }
/// assert!(refused > 50, "{refused}");
/// # }
/// ```
#[derive(Debug)]
pub struct ThrottleLayer<C, K = Dependency> {
    throttle: AdaptiveThrottle,
    classifier: Arc<C>,
    key: K,
}

impl<C, K: Clone> Clone for ThrottleLayer<C, K> {
    fn clone(&self) -> Self {
        ThrottleLayer {
            throttle: self.throttle.clone(),
            classifier: self.classifier.clone(),
            key: self.key.clone(),
        }
    }
}

impl<C> ThrottleLayer<C> {
    /// Attempts admitted by `throttle`, judged by `classifier`, for one dependency: a
    /// dependency of its own ([`Dependency::unnamed`]) until
    /// [`dependency`](Self::dependency) names it.
    pub fn new(throttle: AdaptiveThrottle, classifier: C) -> Self {
        ThrottleLayer {
            throttle,
            classifier: Arc::new(classifier),
            key: Dependency::unnamed(),
        }
    }
}

impl<C, K> ThrottleLayer<C, K> {
    /// Names the one dependency every request goes to. A [`Dependency`] the request carries (the
    /// retry layer's, in its call context) wins.
    pub fn dependency(self, name: impl Into<Dependency>) -> ThrottleLayer<C, Dependency> {
        ThrottleLayer {
            throttle: self.throttle,
            classifier: self.classifier,
            key: name.into(),
        }
    }

    /// Derives the dependency from each request when it names none.
    pub fn dependency_key<K2>(self, key: K2) -> ThrottleLayer<C, K2> {
        ThrottleLayer {
            throttle: self.throttle,
            classifier: self.classifier,
            key,
        }
    }

    /// The throttle it asks.
    pub fn throttle(&self) -> &AdaptiveThrottle {
        &self.throttle
    }
}

impl<S, C, K: Clone> Layer<S> for ThrottleLayer<C, K> {
    type Service = Throttle<S, C, K>;
    fn layer(&self, inner: S) -> Self::Service {
        Throttle {
            inner,
            layer: self.clone(),
        }
    }
}

/// See [`ThrottleLayer`].
#[derive(Debug)]
pub struct Throttle<S, C, K = Dependency> {
    inner: S,
    layer: ThrottleLayer<C, K>,
}

impl<S: Clone, C, K: Clone> Clone for Throttle<S, C, K> {
    fn clone(&self) -> Self {
        Throttle {
            inner: self.inner.clone(),
            layer: self.layer.clone(),
        }
    }
}

impl<S, C, K> Throttle<S, C, K> {
    /// The inner service.
    pub fn get_ref(&self) -> &S {
        &self.inner
    }
}

impl<S, Req, C, K> Service<Req> for Throttle<S, C, K>
where
    S: Service<Req>,
    S::Error: Into<BoxError>,
    Req: HasExtensions,
    C: Classify<Req, S::Response, S::Error>,
    K: DependencyKey<Req>,
{
    type Response = S::Response;
    type Error = BoxError;
    type Future = ThrottleFuture<S::Future, C, Req>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), BoxError>> {
        self.inner.poll_ready(cx).map_err(Into::into)
    }

    fn call(&mut self, req: Req) -> Self::Future {
        let layer = &self.layer;
        let dependency = Dependency::of(&req).unwrap_or_else(|| layer.key.dependency(&req));
        let state = match layer.throttle.admit(&dependency) {
            Err(refused) => State::Refused(Some(refused)),
            Ok(()) => State::Sent {
                fut: self.inner.call(req),
                told: Some((layer.throttle.clone(), layer.classifier.clone(), dependency)),
            },
        };
        ThrottleFuture {
            state,
            _req: PhantomData,
        }
    }
}

/// Response future of [`Throttle`].
#[pin_project]
pub struct ThrottleFuture<F, C, Req> {
    #[pin]
    state: State<F, C>,
    _req: PhantomData<fn(Req)>,
}

impl<F, C, Req> fmt::Debug for ThrottleFuture<F, C, Req> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ThrottleFuture").finish_non_exhaustive()
    }
}

#[pin_project(project = StateProj)]
enum State<F, C> {
    /// Admitted: the attempt in flight, and whom to tell how it ended.
    Sent {
        #[pin]
        fut: F,
        told: Option<(AdaptiveThrottle, Arc<C>, Dependency)>,
    },
    /// Refused before it was sent.
    Refused(Option<Throttled>),
}

impl<F, C, Req, T, E> Future for ThrottleFuture<F, C, Req>
where
    F: Future<Output = Result<T, E>>,
    E: Into<BoxError>,
    C: Classify<Req, T, E>,
{
    type Output = Result<T, BoxError>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        match self.project().state.project() {
            StateProj::Sent { fut, told } => {
                let result = ready!(fut.poll(cx));
                if let Some((throttle, classifier, dependency)) = told.take() {
                    let verdict = classifier.classify(result.as_ref());
                    // Refused further in before it was sent: no evidence either way.
                    let unsent = Verdict::Fatal {
                        outcome: Outcome::NotSent,
                    };
                    if verdict != unsent {
                        throttle.observe(&dependency, &verdict);
                    }
                }
                Poll::Ready(result.map_err(Into::into))
            }
            StateProj::Refused(refused) => Poll::Ready(Err(Box::new(
                refused
                    .take()
                    .expect("ThrottleFuture polled after completion"),
            ))),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ThrottleConfig;
    use tower::{ServiceExt, service_fn};

    /// `Ok(true)`: accepted; `Ok(false)`: shed; an error: refused further in, never sent.
    #[derive(Clone)]
    struct Judge;

    impl Classify<http::Request<()>, bool, BoxError> for Judge {
        fn classify(&self, result: Result<&bool, &BoxError>) -> Verdict {
            match result {
                Ok(true) => Verdict::Success,
                Ok(false) => Verdict::Retryable {
                    outcome: Outcome::NotSent,
                    after: None,
                },
                Err(_) => Verdict::Fatal {
                    outcome: Outcome::NotSent,
                },
            }
        }
        fn is_replay_safe(&self, _req: &http::Request<()>) -> bool {
            true
        }
    }

    fn layer() -> ThrottleLayer<Judge> {
        let throttle = AdaptiveThrottle::new(ThrottleConfig::default(), 5).unwrap();
        ThrottleLayer::new(throttle, Judge).dependency("search-api")
    }

    #[tokio::test(start_paused = true)]
    async fn attempts_refused_further_in_are_no_evidence_and_sent_ones_are() {
        let dep = Dependency::new("search-api");
        let layer = layer();
        let refused = layer.layer(service_fn(|_req: http::Request<()>| async {
            Err::<bool, BoxError>("circuit open".into())
        }));
        for _ in 0..10 {
            refused
                .clone()
                .oneshot(http::Request::new(()))
                .await
                .unwrap_err();
        }
        assert_eq!(layer.throttle().stats(&dep).requests, 0);

        let shed = layer.layer(service_fn(|_req: http::Request<()>| async {
            Ok::<_, BoxError>(false)
        }));
        let mut throttled = 0;
        for _ in 0..100 {
            match shed.clone().oneshot(http::Request::new(())).await {
                Ok(_) => {}
                Err(e) => {
                    assert!(e.is::<Throttled>(), "{e}");
                    throttled += 1;
                }
            }
        }
        let stats = layer.throttle().stats(&dep);
        assert_eq!(stats.requests, 100, "each attempt, sent or refused here");
        assert_eq!(stats.accepts, 0);
        assert!(throttled > 50, "{throttled}");
    }
}
