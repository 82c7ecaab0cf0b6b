//! The composed stack as tower's pieces: [`BackstopLayer`], the [`BackstopService`] it builds
//! over a client, and its [`BackstopFuture`]. The service does the call's work
//! ([`CallWork`]) once per logical call, outside the one retry layer it wraps.

use crate::{
    call::{CallState, CallWork},
    transport::{Deliver, Describe, Transport, TransportSettings},
};
use backstop_breaker::Breaker;
use backstop_classify::Classify;
use backstop_core::{BoxError, Dependency, HasExtensions, InvalidConfig, RetryBudget};
use backstop_idempotency::Inject;
use backstop_retry::{
    Hedging, Resend, Retry, RetryLayer, StandardPolicy,
    future::{ResponseFuture, Retryable},
};
use backstop_timeout::BoundLatency;
use pin_project::pin_project;
use std::{
    fmt,
    future::Future,
    pin::Pin,
    sync::Arc,
    task::{Context, Poll, ready},
    time::Duration,
};
use tower_layer::Layer;
use tower_service::Service;

/// The service a [`BackstopLayer`] builds over the client `S`: every error is an
/// [`Error`](crate::Error).
///
/// The call's work (idempotency key, call span, errors and dead letters), once per call, around
/// one retry layer over the client, whatever the configuration: it keeps the deadline, times
/// each attempt and asks the breaker before each one itself. For HTTP the response's body is
/// returned as a [`TimedBody`](backstop_timeout::TimedBody): the answering attempt's limit and
/// the deadline keep running while the caller reads it. `C` is the classifier, `P` how requests
/// are copied for each attempt (and so how the client is wrapped and its response handed back),
/// `I` where the idempotency key goes.
///
/// tower's readiness contract holds through it: `poll_ready` answers what the client answers
/// (see [`Retry`] for the deadline on a client that never becomes ready), and each attempt is
/// sent on the handle that was polled ready for it.
pub struct BackstopService<S, C, P: Transport<S>, I> {
    inner: Retry<P::Client, C, P, Dependency>,
    call: Arc<CallWork<I>>,
}

impl<S, C, P: Transport<S>, I> Clone for BackstopService<S, C, P, I>
where
    P::Client: Clone,
{
    fn clone(&self) -> Self {
        BackstopService {
            inner: self.inner.clone(),
            call: self.call.clone(),
        }
    }
}

impl<S, C, P: Transport<S>, I> fmt::Debug for BackstopService<S, C, P, I>
where
    P::Client: fmt::Debug,
{
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("BackstopService")
            .field("retry", &self.inner)
            .finish()
    }
}

/// The client's response type under the stack.
type ClientResponse<S, P, Req> = <<P as Transport<S>>::Client as Service<Req>>::Response;
/// The retry layer's parts under the stack.
type Parts<S, C, P, Req> = (<P as Transport<S>>::Client, Req, C, P, StandardPolicy);

impl<S, C, P, I, Req> Service<Req> for BackstopService<S, C, P, I>
where
    P: Transport<S> + Resend<Req> + Deliver<ClientResponse<S, P, Req>> + Describe<Req>,
    P::Client: Service<Req, Error: Into<BoxError>, Response: HasExtensions> + Clone,
    Req: HasExtensions,
    C: Classify<Req, ClientResponse<S, P, Req>, <P::Client as Service<Req>>::Error>,
    I: Inject<Req>,
{
    type Response = <P as Deliver<ClientResponse<S, P, Req>>>::Response;
    type Error = crate::Error;
    type Future = BackstopFuture<S, C, P, Req>;

    #[inline]
    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), crate::Error>> {
        self.inner.poll_ready(cx).map_err(|e| self.call.error(e))
    }

    #[inline]
    fn call(&mut self, mut req: Req) -> Self::Future {
        // Another Backstop stack outside owns this call: its work is that stack's, and the raw
        // error goes back to it (its `BoxErrors` takes it out again: one `Error` per call).
        if backstop_retry::retried_outside(&req) {
            let inner = self.inner.call(req);
            return BackstopFuture(Calling::Passed { inner });
        }
        match self.call.begin(&mut req, P::grpc_method) {
            Ok(state) => {
                // The first attempt is sent from here: its span is the call's child.
                let inner = {
                    let _entered = state.enter();
                    self.inner.call(req)
                };
                BackstopFuture(Calling::Owned { inner, state })
            }
            // Nothing is sent: the ready handle stays here for the next call.
            Err(refused) => BackstopFuture(Calling::Refused {
                error: Some(refused),
            }),
        }
    }
}

/// Response future of [`BackstopService`].
#[pin_project]
pub struct BackstopFuture<S, C, P, Req>(#[pin] Calling<ResponseFuture<Parts<S, C, P, Req>>>)
where
    P: Transport<S>,
    Parts<S, C, P, Req>: Retryable;

#[pin_project(project = CallingProj)]
enum Calling<F> {
    /// This stack owns the call.
    Owned {
        #[pin]
        inner: F,
        state: CallState,
    },
    /// A stack outside owns it.
    Passed {
        #[pin]
        inner: F,
    },
    /// Refused before anything was sent (a required key missing).
    Refused { error: Option<crate::Error> },
}

impl<S, C, P, Req> fmt::Debug for BackstopFuture<S, C, P, Req>
where
    P: Transport<S>,
    Parts<S, C, P, Req>: Retryable,
{
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.0 {
            Calling::Owned { inner, .. } | Calling::Passed { inner } => inner.fmt(f),
            Calling::Refused { .. } => f.write_str("BackstopFuture(refused)"),
        }
    }
}

impl<S, C, P, Req> Future for BackstopFuture<S, C, P, Req>
where
    P: Transport<S> + Deliver<ClientResponse<S, P, Req>>,
    P::Client: Service<Req>,
    Parts<S, C, P, Req>: Retryable<Svc = P::Client, Req = Req>,
    ClientResponse<S, P, Req>: HasExtensions,
{
    type Output = Result<<P as Deliver<ClientResponse<S, P, Req>>>::Response, crate::Error>;

    #[inline]
    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let (result, end) = match self.project().0.project() {
            CallingProj::Owned { mut inner, state } => {
                let result = {
                    let _entered = state.enter();
                    ready!(inner.as_mut().poll(cx))
                };
                (state.end(result), inner.attempt_end())
            }
            CallingProj::Passed { mut inner } => {
                let result = ready!(inner.as_mut().poll(cx));
                (result.map_err(crate::Error::passing), inner.attempt_end())
            }
            CallingProj::Refused { error } => {
                let error = error
                    .take()
                    .expect("BackstopFuture polled after completion");
                return Poll::Ready(Err(error));
            }
        };
        Poll::Ready(result.map(|res| P::deliver(res, end)))
    }
}

/// The validated stack, as a tower `Layer`: `ServiceBuilder::new().layer(layer).service(client)`.
/// `Clone`; every service it builds shares the budget, the breaker and the random source.
#[derive(Clone)]
pub struct BackstopLayer<C, P, I> {
    pub(crate) dependency: Dependency,
    pub(crate) call: Arc<CallWork<I>>,
    pub(crate) retry: RetryLayer<C, P, Dependency>,
    /// What hedged reads need: the stack's classifier, its latency record and its budget.
    pub(crate) hedging: Option<HedgeParts<C>>,
    pub(crate) transport: P,
    pub(crate) attempt_header: Option<http::HeaderName>,
    pub(crate) otel: crate::telemetry::Otel,
    pub(crate) breaker: Option<Breaker>,
}

/// The parts of a stack that its hedged reads share.
#[derive(Clone)]
pub(crate) struct HedgeParts<C> {
    pub(crate) classifier: C,
    pub(crate) latency: BoundLatency,
    pub(crate) budget: Arc<dyn RetryBudget>,
}

impl<C: fmt::Debug, P: fmt::Debug, I: fmt::Debug> fmt::Debug for BackstopLayer<C, P, I> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("BackstopLayer")
            .field("retry", &self.retry)
            .field("breaker", &self.breaker)
            .finish()
    }
}

impl<C, P, I> BackstopLayer<C, P, I> {
    /// The dependency the stack calls.
    pub fn dependency(&self) -> &Dependency {
        &self.dependency
    }

    /// The attempt timeout in force.
    pub fn attempt_timeout(&self) -> Option<Duration> {
        self.retry.limits().attempt_timeout
    }

    /// The deadline in force.
    pub fn deadline(&self) -> Option<Duration> {
        self.retry.limits().deadline
    }

    /// The attempts per call.
    pub fn max_attempts(&self) -> u32 {
        self.retry.limits().max_attempts
    }

    /// The circuit breaker the stack asks before each attempt, if it has one.
    pub fn breaker(&self) -> Option<&Breaker> {
        self.breaker.as_ref()
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
        let layer = backstop_retry::HedgeLayer::new(
            hedging,
            self.dependency.clone(),
            parts.latency.clone(),
            parts.budget.clone(),
            parts.classifier.clone(),
            self.transport.clone(),
        );
        Ok(Layer::layer(&layer, client))
    }
}

impl<C: Clone, P: Clone, I: Clone> BackstopLayer<C, P, I> {
    /// The stack over a **leaf client**: hyper-util's `Client`, a `reqwest::Client` (which
    /// [`reqwest`](Self::reqwest) builds this way), tonic's `Channel`, or a client of one's own
    /// that calls no Backstop layer. The attempts' requests then go without the call context
    /// (the retry-scope mark, the deadline, the attempt's end), which nothing in a leaf reads:
    /// each call is spared the request's extension map (three allocations and about a quarter
    /// of the stack's cost per call). With an [`attempt_header`](crate::Backstop::attempt_header)
    /// the context is written all the same: the header is set from it.
    ///
    /// Not for a service that holds another Backstop stack or retry layer: that one would not
    /// see that this stack retries, and would retry too. [`Layer::layer`] (and
    /// `ServiceBuilder`) gives every inner service the context, wherever it runs.
    pub fn leaf<S>(&self, client: S) -> BackstopService<S, C, P, I>
    where
        P: Transport<S>,
    {
        if self.attempt_header.is_some() || self.otel.is_on() {
            return Layer::layer(self, client);
        }
        self.build_over(client, self.retry.clone().leaf_client())
    }

    fn build_over<S>(
        &self,
        inner: S,
        retry: RetryLayer<C, P, Dependency>,
    ) -> BackstopService<S, C, P, I>
    where
        P: Transport<S>,
    {
        let settings = TransportSettings {
            attempt_timeout: self.retry.limits().attempt_timeout,
            attempt_header: self.attempt_header.clone(),
            otel: self.otel.clone(),
        };
        let client = self.transport.wrap(inner, &settings);
        BackstopService {
            inner: retry.layer(client),
            call: self.call.clone(),
        }
    }
}

impl<S, C: Clone, P: Clone + Transport<S>, I: Clone> Layer<S> for BackstopLayer<C, P, I> {
    type Service = BackstopService<S, C, P, I>;

    fn layer(&self, inner: S) -> Self::Service {
        self.build_over(inner, self.retry.clone())
    }
}
