//! The composed stack as tower's pieces: [`BackstopLayer`], the [`BackstopService`] it builds
//! over a client, and its [`BackstopFuture`]. The call's work ([`CallLayer`]) comes first, once
//! per logical call, then the layers in the README's order: the deadline, the retry layer, the
//! attempt timeout, then the client as its transport wraps it.

use crate::{
    call::{CallFuture, CallLayer, CallService, CallWork},
    transport::{Describe, Transport, TransportSettings, sealed::Wraps},
};
use backstop_breaker::{Breaker, BreakerLayer, CircuitBreaker};
use backstop_budget::{Throttle, ThrottleLayer};
use backstop_classify::Classify;
use backstop_core::{BoxError, Dependency, HasExtensions, InvalidConfig, RetryBudget};
use backstop_idempotency::Inject;
use backstop_retry::{
    Hedging, Policy, Resend, Retry, RetryLayer, StandardPolicy,
    future::{ResponseFuture, Retryable},
};
use backstop_timeout::{
    AttemptTimeout, AttemptTimeoutLayer, DeadlineLayer, LatencyTimeouts, LearnedTimeout,
    LearnedTimeoutLayer, WithDeadline, future::TimedFuture,
};
use pin_project::pin_project;
use std::{
    fmt,
    future::Future,
    pin::Pin,
    sync::Arc,
    task::{Context, Poll},
    time::Duration,
};
use tower::util::Either;
use tower_layer::Layer;
use tower_service::Service;

/// Each attempt's timeout over the client: learned from latency, or fixed.
type Timed<S, C> = Either<LearnedTimeout<S, C>, AttemptTimeout<S>>;

/// Through the breaker when the stack has one, then timed.
type Gated<S, C> = Either<CircuitBreaker<Timed<S, C>, C>, Timed<S, C>>;

/// Paced to the dependency's advertised quotas when the stack paces (feature `quota`).
#[cfg(feature = "quota")]
type Paced<G> = Either<backstop_quota::Paced<G>, G>;
#[cfg(not(feature = "quota"))]
type Paced<G> = G;

/// Each attempt: admitted by the adaptive throttle when the stack has one, paced, then gated.
type Attempt<S, C> = Either<Throttle<Paced<Gated<S, C>>, C>, Paced<Gated<S, C>>>;

/// The stack under the call's work: the deadline, the retry layer, the throttle, the breaker,
/// the attempt timeout, the client as its transport wraps it.
type Stack<S, C, P, Pol> =
    WithDeadline<Retry<Attempt<<P as Wraps<S>>::Client, C>, C, P, Dependency, Pol>>;

/// The service a [`BackstopLayer`] builds over the client `S`: every error is an
/// [`Error`](crate::Error).
///
/// The call's work ([`CallLayer`]: idempotency key, call span, errors and dead letters), once per
/// call, around tower layers in their one order: the deadline ([`DeadlineLayer`]), the retry layer
/// ([`RetryLayer`]), the adaptive throttle ([`ThrottleLayer`]), the breaker ([`BreakerLayer`]),
/// each attempt's timeout
/// ([`AttemptTimeoutLayer`], or [`LearnedTimeoutLayer`] when it is learned from latency), and the
/// client. For HTTP the response's body is returned as a
/// [`TimedBody`](backstop_timeout::TimedBody): the answering attempt's limit and the deadline
/// keep running while the caller reads it. `C` is the classifier, `P` how requests are copied
/// for each attempt (and so how the client is wrapped), `I` where the idempotency key goes, `Pol`
/// the retry layer's [`Policy`].
///
/// tower's readiness contract holds through it: `poll_ready` answers what the client answers
/// (see [`WithDeadline`] for the deadline on a client that never becomes ready), and each
/// attempt is sent on the handle that was polled ready for it.
pub struct BackstopService<S, C, P: Transport<S>, I, Pol = StandardPolicy> {
    inner: CallService<Stack<S, C, P, Pol>, I, P>,
}

impl<S, C, P: Transport<S>, I, Pol: Clone> Clone for BackstopService<S, C, P, I, Pol>
where
    P::Client: Clone,
    C: Clone,
{
    fn clone(&self) -> Self {
        BackstopService {
            inner: self.inner.clone(),
        }
    }
}

impl<S, C, P: Transport<S>, I, Pol: fmt::Debug> fmt::Debug for BackstopService<S, C, P, I, Pol>
where
    P::Client: fmt::Debug,
    C: fmt::Debug,
{
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("BackstopService")
            .field("inner", &self.inner)
            .finish()
    }
}

/// The client's response type under the stack.
type ClientResponse<S, P, Req> = <<P as Wraps<S>>::Client as Service<Req>>::Response;
/// The retry layer's parts under the stack.
type Parts<S, C, P, Req, Pol> = (Attempt<<P as Wraps<S>>::Client, C>, Req, C, P, Pol);

impl<S, C, P, I, Pol, Req> Service<Req> for BackstopService<S, C, P, I, Pol>
where
    Pol: Policy<Req, ClientResponse<S, P, Req>>,
    P: Transport<S> + Resend<Req> + Describe<Req>,
    P::Client: Service<Req, Error = BoxError, Response: HasExtensions> + Clone,
    Req: HasExtensions,
    C: Classify<Req, ClientResponse<S, P, Req>, BoxError> + Clone,
    I: Inject<Req>,
{
    type Response = ClientResponse<S, P, Req>;
    type Error = crate::Error;
    type Future = BackstopFuture<S, C, P, Req, Pol>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), crate::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: Req) -> Self::Future {
        BackstopFuture(self.inner.call(req))
    }
}

/// The stack's future under the call's work.
type Inner<S, C, P, Req, Pol> = TimedFuture<ResponseFuture<Parts<S, C, P, Req, Pol>>>;

/// Response future of [`BackstopService`].
#[pin_project]
pub struct BackstopFuture<S, C, P, Req, Pol = StandardPolicy>(
    #[pin] CallFuture<Inner<S, C, P, Req, Pol>>,
)
where
    P: Transport<S>,
    Parts<S, C, P, Req, Pol>: Retryable;

impl<S, C, P, Req, Pol> fmt::Debug for BackstopFuture<S, C, P, Req, Pol>
where
    P: Transport<S>,
    Parts<S, C, P, Req, Pol>: Retryable,
{
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.fmt(f)
    }
}

impl<S, C, P, Req, Pol> Future for BackstopFuture<S, C, P, Req, Pol>
where
    P: Transport<S>,
    P::Client: Service<Req>,
    Attempt<P::Client, C>: Service<Req, Response = ClientResponse<S, P, Req>>,
    Parts<S, C, P, Req, Pol>: Retryable<Req = Req, Svc = Attempt<P::Client, C>>,
    ClientResponse<S, P, Req>: HasExtensions,
{
    type Output = Result<ClientResponse<S, P, Req>, crate::Error>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        self.project().0.poll(cx)
    }
}

/// The validated stack, as a tower `Layer`: `ServiceBuilder::new().layer(layer).service(client)`.
/// `Clone`; every service it builds shares the budget, the breaker and the random source.
#[derive(Clone)]
pub struct BackstopLayer<C, P, I, Pol = StandardPolicy> {
    pub(crate) dependency: Dependency,
    pub(crate) call: Arc<CallWork<I>>,
    pub(crate) deadline: DeadlineLayer,
    pub(crate) retry: RetryLayer<C, P, Dependency, Pol>,
    pub(crate) attempt_timeout: AttemptTimeoutLayer,
    /// Each attempt's timeout learned from latency, instead of `attempt_timeout`.
    pub(crate) learned: Option<LearnedTimeoutLayer<C>>,
    pub(crate) max_attempts: u32,
    /// What hedged reads need: the stack's classifier, its latency record and its budget.
    pub(crate) hedging: Option<HedgeParts<C>>,
    pub(crate) transport: P,
    pub(crate) attempt_header: Option<http::HeaderName>,
    pub(crate) time_left_header: Option<http::HeaderName>,
    pub(crate) otel: crate::telemetry::Otel,
    pub(crate) throttle: Option<ThrottleLayer<C>>,
    #[cfg(feature = "quota")]
    pub(crate) pace: Option<backstop_quota::QuotaLayer>,
    pub(crate) breaker: Option<BreakerLayer<C>>,
}

/// The parts of a stack that its hedged reads share.
#[derive(Clone)]
pub(crate) struct HedgeParts<C> {
    pub(crate) classifier: C,
    pub(crate) latency: LatencyTimeouts,
    pub(crate) budget: Arc<dyn RetryBudget>,
}

impl<C: fmt::Debug, P: fmt::Debug, I: fmt::Debug, Pol: fmt::Debug> fmt::Debug
    for BackstopLayer<C, P, I, Pol>
{
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("BackstopLayer")
            .field("retry", &self.retry)
            .field("breaker", &self.breaker)
            .finish()
    }
}

impl<C, P, I, Pol> BackstopLayer<C, P, I, Pol> {
    /// The dependency the stack calls.
    pub fn dependency(&self) -> &Dependency {
        &self.dependency
    }

    /// The fixed attempt timeout in force (a learned one's limit for calls that are not
    /// replay-safe).
    pub fn attempt_timeout(&self) -> Duration {
        self.attempt_timeout.limit()
    }

    /// The deadline in force (`None`: the caller's alone).
    pub fn deadline(&self) -> Option<Duration> {
        self.deadline.budget()
    }

    /// The attempts per call.
    pub fn max_attempts(&self) -> u32 {
        self.max_attempts
    }

    /// The stack's call's work as a layer of its own, for a stack whose other layers are
    /// composed by hand: see [`CallLayer`].
    pub fn call_layer(&self) -> CallLayer<I, P> {
        CallLayer::new(self.call.clone())
    }

    /// The circuit breaker each attempt goes through, if the stack has one.
    pub fn breaker(&self) -> Option<&Breaker> {
        self.breaker.as_ref().map(BreakerLayer::breaker)
    }

    /// `client` with hedged reads, to build this stack over (`layer.layer(layer.hedge(client,
    /// Hedging::default())?)`): a replay-safe attempt still unanswered at the dependency's p95
    /// of latency (the stack's [`attempt_timeout_from_latency`](crate::Backstop::attempt_timeout_from_latency)
    /// record) gets a copy sent, the first success wins, and each hedge is paid from the
    /// stack's retry budget (and the call's run), so hedges stop when the dependency is
    /// failing. A stack without a latency record cannot know when to hedge: that is an error.
    pub fn hedge<S>(
        &self,
        client: S,
        hedging: Hedging,
    ) -> Result<backstop_retry::Hedge<S, C, P>, InvalidConfig>
    where
        C: Clone,
        P: Clone,
    {
        let Some(parts) = &self.hedging else {
            return Err(InvalidConfig::new(
                "hedged reads send their copy after the dependency's observed latency: build the \
                 stack with attempt_timeout_from_latency(..) first",
            ));
        };
        let layer =
            backstop_retry::HedgeLayer::new(parts.classifier.clone(), parts.latency.clone())
                .resend(self.transport.clone())
                .dependency(self.dependency.clone())
                .budget(parts.budget.clone())
                .hedging(hedging);
        Ok(Layer::layer(&layer, client))
    }
}

impl<S, C: Clone, P: Clone + Transport<S>, I: Clone, Pol: Clone> Layer<S>
    for BackstopLayer<C, P, I, Pol>
{
    type Service = BackstopService<S, C, P, I, Pol>;

    fn layer(&self, client: S) -> Self::Service {
        let settings = TransportSettings {
            attempt_timeout: Some(self.attempt_timeout.limit()),
            attempt_header: self.attempt_header.clone(),
            time_left_header: self.time_left_header.clone(),
            #[cfg(feature = "quota")]
            read_quotas: self.pace.is_some(),
            otel: self.otel.clone(),
        };
        let client = self.transport.wrap(client, &settings);
        let timed = match &self.learned {
            Some(learned) => Either::Left(learned.layer(client)),
            None => Either::Right(self.attempt_timeout.layer(client)),
        };
        let gated = match &self.breaker {
            Some(breaker) => Either::Left(breaker.layer(timed)),
            None => Either::Right(timed),
        };
        #[cfg(feature = "quota")]
        let gated = match &self.pace {
            Some(pace) => Either::Left(pace.layer(gated)),
            None => Either::Right(gated),
        };
        let attempt = match &self.throttle {
            Some(throttle) => Either::Left(throttle.layer(gated)),
            None => Either::Right(gated),
        };
        BackstopService {
            inner: self
                .call_layer()
                .layer(self.deadline.layer(self.retry.layer(attempt))),
        }
    }
}
