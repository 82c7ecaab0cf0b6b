//! Hedged reads paid from the retry budget.
//!
//! [`HedgeLayer`] goes under the retry layer, around the client: an attempt that is replay-safe
//! (an idempotent method, or a key the dependency honours) and still unanswered after the
//! dependency's latency at a high percentile (its [`LatencyTimeouts`] record, p95 by default) gets a
//! second copy sent; the first success wins and the others are dropped (their requests
//! cancelled). Each hedge withdraws one retry from the same per-dependency budget as retries do
//! (and from the call's [`Run`] when it has one), so hedges stop when the dependency is failing
//! and the budget runs dry, and at most `max_in_flight` copies of an attempt are in flight.
//! The layers outside see one attempt: the breaker's permit, the attempt timeout and the retry
//! layer's classification cover the copies together. Counted apart from retries:
//! `backstop_hedges_total{dependency}` and a `hedge` span per copy.
//!
//! A request that is not replay-safe, a dependency whose latency is not known yet, and a
//! request that cannot be copied are passed through as they are, without a copy.

use crate::{CloneResend, HttpResend, Resend, obs};
use backstop_classify::{Classify, HttpClassifier};
use backstop_core::{Dependency, HasExtensions, NoBudget, ReplaySafe, RetryBudget, Run};
use backstop_timeout::LatencyTimeouts;
use pin_project::pin_project;
use std::{
    fmt,
    future::Future,
    marker::PhantomData,
    pin::Pin,
    sync::Arc,
    task::{Context, Poll},
    time::Duration,
};
use tokio::time::Sleep;
use tower_layer::Layer;
use tower_service::Service;
use tracing::Span;

/// How hedged reads are made.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Hedging {
    max_in_flight: u32,
    min_delay: Duration,
}

impl Default for Hedging {
    /// Two copies of an attempt in flight at most (one hedge), never sooner than 5 ms.
    fn default() -> Self {
        Hedging {
            max_in_flight: 2,
            min_delay: Duration::from_millis(5),
        }
    }
}

impl Hedging {
    /// At most `n` copies of one attempt in flight, the first included (at least 2).
    #[must_use]
    pub fn max_in_flight(mut self, n: u32) -> Self {
        self.max_in_flight = n.max(2);
        self
    }

    /// Never hedge sooner than `delay` after the attempt (or the previous hedge) was sent.
    #[must_use]
    pub fn min_delay(mut self, delay: Duration) -> Self {
        self.min_delay = delay;
        self
    }
}

/// Sends a hedge of each replay-safe attempt still unanswered at the dependency's high
/// percentile of latency, paid from the retry budget.
///
/// Built as [`RetryLayer`](crate::RetryLayer) is: the classifier that says which requests are
/// replay-safe and the latency record to hedge after, then what differs from the defaults.
/// Give it the retry layer's budget (the same `Arc`) so that retries and hedges draw on one.
///
/// ```
/// use backstop_classify::HttpClassifier;
/// use backstop_core::RetryBudget;
/// use backstop_retry::{HedgeLayer, Hedging, HttpResend};
/// use backstop_timeout::LatencyTimeouts;
/// use std::{sync::Arc, time::Duration};
///
/// fn hedged_reads(
///     latency: LatencyTimeouts,
///     budget: Arc<dyn RetryBudget>,
/// ) -> HedgeLayer<HttpClassifier, HttpResend> {
///     HedgeLayer::http(latency)
///         .dependency("catalog")
///         .budget(budget)
///         .hedging(Hedging::default().min_delay(Duration::from_millis(20)))
/// }
/// # let _ = hedged_reads;
/// ```
#[derive(Clone)]
pub struct HedgeLayer<C, P = CloneResend> {
    hedging: Hedging,
    classifier: C,
    resend: P,
    latency: LatencyTimeouts,
    budget: Arc<dyn RetryBudget>,
    dependency: Dependency,
}

impl<C, P> fmt::Debug for HedgeLayer<C, P> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("HedgeLayer")
            .field("hedging", &self.hedging)
            .field("dependency", &self.dependency)
            .finish_non_exhaustive()
    }
}

impl<C> HedgeLayer<C> {
    /// Hedges the requests `classifier` says are replay-safe, after the dependency's latency
    /// as `latency` records it; copied with [`CloneResend`], for an unnamed dependency, with
    /// no budget (only [`Hedging`]'s bound on copies in flight), as [`Hedging::default`] says.
    pub fn new(classifier: C, latency: LatencyTimeouts) -> Self {
        HedgeLayer {
            hedging: Hedging::default(),
            classifier,
            resend: CloneResend,
            latency,
            budget: Arc::new(NoBudget),
            dependency: Dependency::unnamed(),
        }
    }
}

impl HedgeLayer<HttpClassifier, HttpResend> {
    /// Hedges HTTP reads: replay-safe as the default [`HttpClassifier`] says (idempotent
    /// methods, keys the dependency honours), copied with [`HttpResend`].
    pub fn http(latency: LatencyTimeouts) -> Self {
        HedgeLayer::new(HttpClassifier::new(), latency).resend(HttpResend)
    }
}

impl<C, P> HedgeLayer<C, P> {
    /// How many copies of an attempt may be in flight, and how soon each is sent.
    #[must_use]
    pub fn hedging(mut self, hedging: Hedging) -> Self {
        self.hedging = hedging;
        self
    }

    /// How a request is copied for its hedge; a request it cannot copy is not hedged.
    pub fn resend<P2>(self, resend: P2) -> HedgeLayer<C, P2> {
        HedgeLayer {
            hedging: self.hedging,
            classifier: self.classifier,
            resend,
            latency: self.latency,
            budget: self.budget,
            dependency: self.dependency,
        }
    }

    /// The dependency whose latency decides when to hedge, named in metrics and spans.
    #[must_use]
    pub fn dependency(mut self, name: impl Into<Dependency>) -> Self {
        self.dependency = name.into();
        self
    }

    /// The retry budget each hedge withdraws one retry from.
    #[must_use]
    pub fn budget(mut self, budget: Arc<dyn RetryBudget>) -> Self {
        self.budget = budget;
        self
    }
}

impl<S, C: Clone, P: Clone> Layer<S> for HedgeLayer<C, P> {
    type Service = Hedge<S, C, P>;

    fn layer(&self, inner: S) -> Self::Service {
        Hedge {
            inner,
            shared: Arc::new(self.clone()),
        }
    }
}

/// See [`HedgeLayer`].
pub struct Hedge<S, C, P> {
    inner: S,
    shared: Arc<HedgeLayer<C, P>>,
}

impl<S: Clone, C, P> Clone for Hedge<S, C, P> {
    fn clone(&self) -> Self {
        Hedge {
            inner: self.inner.clone(),
            shared: self.shared.clone(),
        }
    }
}

impl<S: fmt::Debug, C, P> fmt::Debug for Hedge<S, C, P> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Hedge")
            .field("inner", &self.inner)
            .field("hedging", &self.shared.hedging)
            .finish()
    }
}

impl<S, C, P, Req> Service<Req> for Hedge<S, C, P>
where
    S: Service<Req> + Clone,
    Req: HasExtensions,
    C: Classify<Req, S::Response, S::Error>,
    P: Resend<Req>,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future = HedgeFuture<S, Req, C, P>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), S::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: Req) -> Self::Future {
        let shared = &self.shared;
        let safe = ReplaySafe::is_marked(&req) || shared.classifier.is_replay_safe(&req);
        let delay = safe
            .then(|| shared.latency.hedge_delay(&shared.dependency))
            .flatten();
        let plan = delay.and_then(|delay| {
            let template = shared.resend.copy(&req).ok()?;
            Some((delay.max(shared.hedging.min_delay), template))
        });
        let run = Run::of(&req).cloned();
        // The readied service makes the first copy and asks for readiness before each hedge;
        // its clone stays for the next call.
        let clone = self.inner.clone();
        let mut svc = std::mem::replace(&mut self.inner, clone);
        let primary = svc.call(req);
        match plan {
            None => HedgeFuture {
                state: State::Plain { fut: primary },
            },
            Some((delay, template)) => HedgeFuture {
                state: State::Hedged {
                    race: Box::pin(Race {
                        primary,
                        primary_done: false,
                        timer: tokio::time::sleep(delay),
                        delay,
                        hedges: Vec::new(),
                        more: Some((svc, template)),
                        run,
                        shared: shared.clone(),
                        failed: None,
                        _req: PhantomData,
                    }),
                },
            },
        }
    }
}

/// Response future of [`Hedge`].
#[pin_project]
pub struct HedgeFuture<S: Service<Req>, Req, C, P> {
    #[pin]
    state: State<S, Req, C, P>,
}

#[pin_project(project = StateProj)]
enum State<S: Service<Req>, Req, C, P> {
    /// No hedge for this attempt: the service's future as it is.
    Plain {
        #[pin]
        fut: S::Future,
    },
    /// An attempt that may be hedged, boxed (only these pay for it).
    Hedged { race: Pin<Box<Race<S, Req, C, P>>> },
}

impl<S: Service<Req>, Req, C, P> fmt::Debug for HedgeFuture<S, Req, C, P> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.state {
            State::Plain { .. } => f.write_str("HedgeFuture::Plain"),
            State::Hedged { race } => f
                .debug_struct("HedgeFuture::Hedged")
                .field(
                    "in_flight",
                    &(race.hedges.len() + usize::from(!race.primary_done)),
                )
                .finish(),
        }
    }
}

/// An attempt and its hedges in flight.
#[pin_project]
struct Race<S: Service<Req>, Req, C, P> {
    #[pin]
    primary: S::Future,
    primary_done: bool,
    #[pin]
    timer: Sleep,
    delay: Duration,
    hedges: Vec<(Pin<Box<S::Future>>, Span)>,
    /// The service each hedge is sent on and the request it sends a copy of; `None` once no
    /// more hedges will be sent, so that readiness the service granted a hedge that was not
    /// sent (a permit of a concurrency limit, say) is given back at once.
    more: Option<(S, Req)>,
    run: Option<Run>,
    shared: Arc<HedgeLayer<C, P>>,
    /// The last failure, kept while another copy is still in flight.
    failed: Option<S::Error>,
    _req: PhantomData<fn() -> Req>,
}

impl<S, Req, C, P> Future for HedgeFuture<S, Req, C, P>
where
    S: Service<Req>,
    P: Resend<Req>,
{
    type Output = Result<S::Response, S::Error>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        match self.project().state.project() {
            StateProj::Plain { fut } => fut.poll(cx),
            StateProj::Hedged { race } => race.as_mut().poll(cx),
        }
    }
}

impl<S, Req, C, P> Future for Race<S, Req, C, P>
where
    S: Service<Req>,
    P: Resend<Req>,
{
    type Output = Result<S::Response, S::Error>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let mut this = self.project();
        loop {
            // The first success wins; the others are dropped with this future.
            if !*this.primary_done
                && let Poll::Ready(result) = this.primary.as_mut().poll(cx)
            {
                match result {
                    Ok(res) => {
                        obs::hedges_cancelled(&this.shared.dependency, this.hedges.len());
                        return Poll::Ready(Ok(res));
                    }
                    Err(e) => {
                        *this.primary_done = true;
                        *this.failed = Some(e);
                    }
                }
            }
            let mut i = 0;
            while i < this.hedges.len() {
                let (fut, span) = &mut this.hedges[i];
                let polled = {
                    let _entered = span.enter();
                    fut.as_mut().poll(cx)
                };
                match polled {
                    Poll::Ready(Ok(res)) => {
                        let others = this.hedges.len() - 1 + usize::from(!*this.primary_done);
                        obs::hedges_cancelled(&this.shared.dependency, others);
                        return Poll::Ready(Ok(res));
                    }
                    Poll::Ready(Err(e)) => {
                        drop(this.hedges.swap_remove(i));
                        *this.failed = Some(e);
                    }
                    Poll::Pending => i += 1,
                }
            }
            let in_flight = this.hedges.len() + usize::from(!*this.primary_done);
            // Every copy failed: the last failure goes back for the retry layer to judge (a
            // failure is the retry layer's to repeat, never a reason to hedge at once).
            if in_flight == 0 {
                let failed = this.failed.take().expect("a copy failed");
                return Poll::Ready(Err(failed));
            }
            let room = in_flight < this.shared.hedging.max_in_flight as usize;
            let Some((svc, template)) = this.more.as_mut() else {
                return Poll::Pending;
            };
            if !room || *this.primary_done {
                return Poll::Pending;
            }
            if this.timer.as_mut().poll(cx).is_pending() {
                return Poll::Pending;
            }
            // Due: one more copy, once the service is ready (a hedge waits for readiness while
            // the copies in flight go on), if it can be copied and the run and the budget pay
            // for it: a token is taken only for a copy that is sent.
            match svc.poll_ready(cx) {
                Poll::Ready(Ok(())) => {}
                Poll::Pending => return Poll::Pending,
                Poll::Ready(Err(_)) => {
                    *this.more = None;
                    return Poll::Pending;
                }
            }
            let Ok(copy) = this.shared.resend.copy(template) else {
                *this.more = None;
                return Poll::Pending;
            };
            let dependency = &this.shared.dependency;
            let run_pays = this.run.as_ref().is_none_or(|r| r.take_retry(dependency));
            if !run_pays || !this.shared.budget.withdraw(dependency) {
                if run_pays && let Some(run) = this.run.as_ref() {
                    run.give_back(dependency);
                }
                *this.more = None;
                return Poll::Pending;
            }
            let n = this.hedges.len() as u32 + 1;
            let span = tracing::debug_span!(target: "backstop::retry", "hedge", dependency = %dependency, hedge = n);
            obs::hedge(dependency);
            let fut = {
                let _entered = span.enter();
                svc.call(copy)
            };
            this.hedges.push((Box::pin(fut), span));
            let next = tokio::time::Instant::now() + *this.delay;
            this.timer.as_mut().reset(next);
        }
    }
}
