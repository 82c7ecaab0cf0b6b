//! The retry layer's future.
//!
//! A call's first attempt runs in place, in [`RetryFuture`]: the gate, the attempt's timer, the
//! classification and the success that most calls end with. A call whose first attempt does not
//! end it, or whose service was not ready at `call`, goes on in [`Retrying`], boxed once it is
//! needed (the shape of linkerd2-proxy's retry): the waits, the later attempts and the history
//! are paid for by the calls that use them.
//!
//! - [`call`]: a call's state between attempts, [`Call::begin`] for each attempt, and
//!   [`Call::finish`], the one exit every end of a call passes (its metrics, its history, its
//!   error).
//! - [`attempt`]: one attempt in flight and its timer ([`InFlight`]).
//! - [`decide`]: after an attempt that did not succeed at once, the one [`Decision`].
//! - [`answer`]: the end of the attempt that answered, for a body timer outside the layer.
//! - [`retrying`]: the loop of waits, readiness and attempts.
//!
//! `Retrying` is a hand-written future, not an `async fn`: a boxed `async fn` must be
//! `dyn Future + Send`, which would ask every service, request and response to be
//! `Send + 'static`, and rustc cannot yet prove `Send` for an `async` block holding some
//! ordinary inner futures (one that ends in `.map_err(BoxError::from)`, say).

mod answer;
mod attempt;
mod call;
mod decide;
mod retrying;

pub use answer::{Answer, AttemptEnd};
pub(crate) use call::Call;

use crate::{CallHook, Resend, layer::Policy};
use attempt::InFlight;
use backstop_classify::{Classify, Verdict};
use backstop_core::{BoxError, HasExtensions, Outcome};
use decide::{Decision, Retries};
use pin_project::{pin_project, pinned_drop};
use retrying::Retrying;
use std::{
    fmt,
    future::Future,
    pin::Pin,
    sync::Arc,
    task::{Context, Poll, ready},
};
use tower_service::Service;
use tracing::Span;

/// Response future of [`Retry`](crate::Retry).
#[pin_project(PinnedDrop)]
pub struct RetryFuture<S, Req, C, P, H = crate::NoHook>
where
    S: Service<Req>,
    H: CallHook<Req, S::Response>,
{
    policy: Arc<Policy<C, P, H>>,
    #[pin]
    state: State<S, Req, C, P, H>,
    /// The hook's state for the call; `None` when the hook refused it, or when an outer retry
    /// layer owns the call (the call-level work is that layer's).
    hooked: Option<H::State>,
}

// The first attempt is large on purpose: it runs in place, and the rest is boxed.
#[allow(clippy::large_enum_variant)]
#[pin_project(project = StateProj, project_replace = StateOwn)]
enum State<S: Service<Req>, Req, C, P, H: CallHook<Req, S::Response>> {
    /// The first attempt is in flight.
    First {
        #[pin]
        attempt: InFlight<S::Future>,
        call: Call<S, Req>,
    },
    /// Everything after a first attempt that did not end the call, or before one the service
    /// was not ready for.
    Retrying(Rest<S, Req, C, P, H>),
    /// The call has ended: its result, until it is taken (a first attempt's end, or a call that
    /// ended before anything was polled: the gate refused it, or the deadline had passed).
    Ended(Option<Result<S::Response, BoxError>>),
    /// The hook refused the call: nothing was sent.
    Refused(Option<H::Error>),
}

/// How an attempt ended: the inner service's result, or this layer's own error (timed out,
/// refused by the gate, no time left).
pub(super) enum Ended<T, E> {
    Inner(Result<T, E>),
    Own(BoxError),
}

impl<T, E: Into<BoxError>> Ended<T, E> {
    /// The result as it is, for the outer retry layer that owns the call to classify.
    #[inline]
    pub(super) fn raw(self) -> Result<T, BoxError> {
        match self {
            Ended::Inner(r) => r.map_err(Into::into),
            Ended::Own(e) => Err(e),
        }
    }
}

/// An attempt's end and its verdict.
pub(super) type EndedWith<T, E> = (Ended<T, E>, Verdict);

/// The retrying part of a call, boxed.
type Rest<S, Req, C, P, H> = Pin<Box<Retrying<S, Req, C, P, H>>>;

/// What polling an attempt gives: a success (kept apart so that the first attempt's success
/// goes back at once), or anything else with its verdict.
pub(super) enum Attempted<T, E> {
    Succeeded(T),
    Other(Ended<T, E>, Verdict),
}

/// The verdict on an attempt that was never sent.
pub(super) const NOT_SENT: Verdict = Verdict::Fatal {
    outcome: Outcome::NotSent,
};

impl<S, Req, C, P, H> fmt::Debug for RetryFuture<S, Req, C, P, H>
where
    S: Service<Req>,
    H: CallHook<Req, S::Response>,
{
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let (dependency, attempt) = match &self.state {
            State::First { call, .. } => (call.dependency.as_str(), 1),
            State::Retrying(rest) => (rest.call.dependency.as_str(), rest.call.attempt),
            State::Ended(_) | State::Refused(_) => ("", 0),
        };
        f.debug_struct("RetryFuture")
            .field("dependency", &dependency)
            .field("attempt", &attempt)
            .finish()
    }
}

impl<S, Req, C, P, H> RetryFuture<S, Req, C, P, H>
where
    S: Service<Req>,
    S::Error: Into<BoxError>,
    S::Response: HasExtensions,
    Req: HasExtensions,
    C: Classify<Req, S::Response, S::Error>,
    P: Resend<Req>,
    H: CallHook<Req, S::Response>,
{
    /// A call the hook refused: it ends with `error` when first polled, without sending.
    pub(crate) fn refused(policy: Arc<Policy<C, P, H>>, error: H::Error) -> Self {
        RetryFuture {
            policy,
            state: State::Refused(Some(error)),
            hooked: None,
        }
    }

    /// Starts `call` with its first attempt: at once when the service is `ready`, else once it
    /// is (within the deadline). `hooked` is `None` when the call is nested.
    #[inline(always)]
    pub(crate) fn start(
        policy: Arc<Policy<C, P, H>>,
        mut call: Call<S, Req>,
        req: Req,
        ready: bool,
        hooked: Option<H::State>,
    ) -> Self {
        if !call.nested {
            crate::obs::call(&call.dependency);
        }
        // The template stays as the caller sent it; each attempt is a copy.
        let copies = !call.nested && policy.settings.max_attempts > 1;
        let parent = hooked.as_ref().and_then(|h| policy.hook.span(h));
        let state = if ready {
            let now = call.started();
            let begun = call.begin(&policy, now, parent, |template| {
                if copies {
                    template.keep(&policy.resend, req)
                } else {
                    req
                }
            });
            match begun {
                Ok(fut) => State::First {
                    attempt: InFlight::new(fut),
                    call,
                },
                Err((ended, verdict)) => Self::after_first(&policy, call, ended, verdict, parent),
            }
        } else {
            let first = if copies {
                call.template.keep(&policy.resend, req)
            } else {
                req
            };
            State::Retrying(Retrying::unready(policy.clone(), call, first, parent))
        };
        RetryFuture {
            policy,
            state,
            hooked,
        }
    }

    /// The first attempt ended with `ended` and `verdict` without succeeding: the call's next state,
    /// ended (nested: the result as it is; or stopped) or retrying. Decided before anything is
    /// boxed: a call that stops after one attempt allocates only its history and its error.
    fn after_first(
        policy: &Arc<Policy<C, P, H>>,
        call: Call<S, Req>,
        ended: Ended<S::Response, S::Error>,
        verdict: Verdict,
        parent: Option<&Span>,
    ) -> State<S, Req, C, P, H> {
        if call.nested {
            return State::Ended(Some(ended.raw()));
        }
        let mut retries = Retries::default();
        match retries.decide(policy, &call, verdict) {
            Decision::Stop(stopped) => {
                let history = std::mem::take(&mut retries.history);
                State::Ended(Some(call.finish(history, ended, verdict, stopped)))
            }
            Decision::Retry(wait) => {
                State::Retrying(Retrying::after(policy.clone(), call, retries, wait, parent))
            }
        }
    }

    /// Polls the call, in whichever state it is, to its result (the hook's `end` aside) and
    /// the end of the attempt that gave it, into `end` (when `END`: kept out of the returned
    /// value, which every poll moves).
    #[inline(always)]
    fn drive<const END: bool>(
        mut state: Pin<&mut State<S, Req, C, P, H>>,
        policy: &Arc<Policy<C, P, H>>,
        parent: Option<&Span>,
        cx: &mut Context<'_>,
        end: &mut Option<AttemptEnd>,
    ) -> Poll<Result<S::Response, BoxError>> {
        loop {
            let next = match state.as_mut().project() {
                StateProj::First { attempt, call } => {
                    match ready!(attempt.poll_end(call, policy, cx)) {
                        // The common case, kept short: the response goes back as it is.
                        Attempted::Succeeded(res) => {
                            if !call.nested {
                                call.finish_at_once();
                            }
                            // The state stays as it is, the attempt over (its ticket given
                            // back, nothing left to learn when it is dropped): rewriting a
                            // state this large costs a copy of all of it.
                            call.sent = false;
                            AttemptEnd::record::<END, _, _>(end, call);
                            return Poll::Ready(Ok(res));
                        }
                        Attempted::Other(ended, verdict) => {
                            // The call moves on: out of the first state, into its next.
                            AttemptEnd::record::<END, _, _>(end, call);
                            let call = take_call(state.as_mut());
                            state.set(Self::after_first(policy, call, ended, verdict, parent));
                            continue;
                        }
                    }
                }
                StateProj::Retrying(rest) => {
                    let result = ready!(rest.as_mut().poll(cx));
                    AttemptEnd::record::<END, _, _>(end, &rest.call);
                    result
                }
                StateProj::Ended(result) => {
                    result.take().expect("RetryFuture polled after completion")
                }
                StateProj::Refused(_) => panic!("RetryFuture polled after completion"),
            };
            state.set(State::Ended(None));
            return Poll::Ready(next);
        }
    }
}

/// The call out of the `First` state, leaving the state ended.
fn take_call<S, Req, C, P, H>(mut state: Pin<&mut State<S, Req, C, P, H>>) -> Call<S, Req>
where
    S: Service<Req>,
    H: CallHook<Req, S::Response>,
{
    match state.as_mut().project_replace(State::Ended(None)) {
        StateOwn::First { call, .. } => call,
        _ => unreachable!("only the first attempt's call is taken"),
    }
}

impl<S, Req, C, P, H> Future for RetryFuture<S, Req, C, P, H>
where
    S: Service<Req>,
    S::Error: Into<BoxError>,
    S::Response: HasExtensions,
    Req: HasExtensions,
    C: Classify<Req, S::Response, S::Error>,
    P: Resend<Req>,
    H: CallHook<Req, S::Response>,
{
    type Output = Result<S::Response, H::Error>;

    #[inline]
    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        self.poll_to_end::<false>(cx, &mut None)
    }
}

impl<S, Req, C, P, H> RetryFuture<S, Req, C, P, H>
where
    S: Service<Req>,
    S::Error: Into<BoxError>,
    S::Response: HasExtensions,
    Req: HasExtensions,
    C: Classify<Req, S::Response, S::Error>,
    P: Resend<Req>,
    H: CallHook<Req, S::Response>,
{
    /// Polls the call as [`poll`](Future::poll) does, and hands back with its result when the
    /// attempt that answered is cut: a body timer outside the retry layer (the composed
    /// stack's) ends the response's body there, the attempt's own limit running on over it.
    #[inline]
    pub fn poll_answer(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Answer<Result<S::Response, H::Error>>> {
        let mut end = None;
        let result = ready!(self.poll_to_end::<true>(cx, &mut end));
        Poll::Ready((result, end))
    }

    /// Polls the call to its result, and to the answering attempt's end when `END`.
    #[inline]
    fn poll_to_end<const END: bool>(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        end: &mut Option<AttemptEnd>,
    ) -> Poll<Result<S::Response, H::Error>> {
        let mut this = self.project();
        let policy = &*this.policy;
        let Some(hooked) = this.hooked.as_mut() else {
            if let StateProj::Refused(error) = this.state.as_mut().project() {
                let error = error.take();
                return Poll::Ready(Err(error.expect("RetryFuture polled after completion")));
            }
            // An outer retry layer owns the call: its raw result goes back, with no call-level
            // work of this layer's (no span, no error mapping, no dead letter).
            let result = ready!(Self::drive::<END>(this.state, this.policy, None, cx, end));
            return Poll::Ready(result.map_err(|e| policy.hook.pass(e)));
        };
        let result = {
            let parent = policy.hook.span(hooked);
            let _entered = parent.map(Span::enter);
            ready!(Self::drive::<END>(this.state, this.policy, parent, cx, end))
        };
        Poll::Ready(policy.hook.end(hooked, result))
    }
}

#[pinned_drop]
impl<S, Req, C, P, H> PinnedDrop for RetryFuture<S, Req, C, P, H>
where
    S: Service<Req>,
    H: CallHook<Req, S::Response>,
{
    /// A call dropped mid-attempt: the gate learns the attempt ended without a verdict.
    fn drop(self: Pin<&mut Self>) {
        let this = self.project();
        match this.state.project() {
            StateProj::First { call, .. } => call.end_attempt(this.policy, None),
            StateProj::Retrying(rest) => {
                let rest = rest.as_mut().project();
                rest.call.end_attempt(rest.policy, None);
            }
            StateProj::Ended(_) | StateProj::Refused(_) => {}
        }
    }
}
