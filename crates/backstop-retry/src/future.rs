//! The retry layer's future, in two parts.
//!
//! The first attempt is driven in place ([`ResponseFuture`] in state `First`): the gate, the
//! attempt's timer, classification, and the success that most calls end with. Only a call whose
//! first attempt fails, or whose service was not ready at `call`, goes on to [`Retrying`],
//! boxed when it is needed (the shape of linkerd2-proxy's retry): the waits, the later
//! attempts, the history and the error are paid for by the calls that use them.
//!
//! Both parts begin an attempt with [`Call::begin`] and poll it with [`poll_attempt`];
//! [`Retrying::decide`] is the one place that chooses between another attempt and stopping,
//! and [`Retrying::finish`] the one place that builds a [`RetryError`].
//!
//! `Retrying` is a hand-written future, not an `async fn`: a boxed `async fn` must be
//! `dyn Future + Send`, which would ask every service, request and response to be
//! `Send + 'static`, and rustc cannot yet prove `Send` for an `async` block holding some
//! ordinary inner futures (one that ends in `.map_err(BoxError::from)`, say).

use crate::{
    AttemptRecord, CallHook, Diagnosis, ErrorKind, NotCopyable, Resend, RetryError, RetryHistory,
    StopReason, Ticket, layer::Policy,
};
use backstop_backoff::Schedule;
use backstop_classify::{Classify, Verdict};
use backstop_core::{
    AttemptLimit, BoxError, Deadline, DeadlineExceeded, Dependency, HasExtensions, Outcome,
    ReplaySafe, Run, UnvouchedKey,
};
use backstop_timeout::plumbing::AttemptCutoff;
use pin_project::{pin_project, pinned_drop};
use rand::rngs::SmallRng;
use std::{
    fmt,
    future::Future,
    pin::Pin,
    sync::Arc,
    task::{Context, Poll, ready},
    time::Duration,
};
use tokio::time::{Instant, Sleep, sleep, sleep_until};
use tower_service::Service;
use tracing::Span;

/// Response future of [`Retry`](crate::Retry).
#[pin_project(PinnedDrop)]
pub struct ResponseFuture<S, Req, C, P, K, H = crate::NoHook>
where
    S: Service<Req>,
    H: CallHook<Req, S::Response>,
{
    policy: Arc<Policy<C, P, K, H>>,
    #[pin]
    state: State<S, Req, C, P, K, H>,
    /// The hook's state for the call; `None` when the hook refused it, or when an outer retry
    /// layer owns the call (the call-level work is that layer's).
    hooked: Option<H::State>,
}

// The first attempt is large on purpose: it runs in place, and the rest is boxed.
#[allow(clippy::large_enum_variant)]
#[pin_project(project = StateProj, project_replace = StateOwn)]
enum State<S: Service<Req>, Req, C, P, K, H: CallHook<Req, S::Response>> {
    /// The first attempt is in flight. Its timer is created on the first `Pending` only, in
    /// place: an attempt that finishes at once pays for no timer, one that waits for no
    /// allocation.
    First {
        #[pin]
        fut: S::Future,
        #[pin]
        timer: Option<Sleep>,
        call: Call<S, Req>,
    },
    /// Everything after a first attempt that failed, or before one the service was not ready
    /// for.
    Rest(Rest<S, Req, C, P, K, H>),
    /// The call ended before anything was polled (the gate refused the first attempt, or the
    /// deadline had passed).
    Ended(Option<Result<S::Response, BoxError>>),
    /// The hook refused the call: nothing was sent.
    Refused(Option<H::Error>),
    Done,
}

/// One call's state between attempts (its hot part: a call that succeeds at once builds only
/// this).
pub(crate) struct Call<S, Req> {
    svc: S,
    template: Template<Req>,
    dependency: Dependency,
    deadline: Option<Deadline>,
    started: Instant,
    /// Attempts begun so far, the one in flight included.
    attempt: u32,
    attempt_started: Instant,
    /// Whether the current attempt was handed to the service (a gate refusal, a deadline
    /// that passed first or a service never ready is no attempt sent).
    sent: bool,
    /// An outer retry layer owns retrying: this layer makes one attempt, still gated and
    /// timed, and hands the raw result back.
    nested: bool,
    /// The gate's ticket for the attempt in flight.
    ticket: Option<Ticket>,
    /// When the attempt in flight is cut short, if it is.
    expiry: Option<AttemptCutoff>,
    /// The current attempt's span (disabled, and free, when nobody listens).
    span: Span,
}

/// The caller's request, kept as the caller sent it: every attempt sends a copy.
enum Template<Req> {
    /// One attempt only (`max_attempts` is 1, or an outer layer retries): nothing is kept.
    Unneeded,
    /// Kept for the copies.
    Kept(Req),
    /// It could not be copied, for this reason: the call has one attempt.
    Uncopyable(NotCopyable),
}

/// How an attempt ended: the inner service's result, or this layer's own error (timed out,
/// refused by the gate, no time left).
enum Ended<T, E> {
    Inner(Result<T, E>),
    Own(BoxError),
}

impl<T, E: Into<BoxError>> Ended<T, E> {
    /// The result as it is, for the outer retry layer that owns the call to classify.
    fn raw(self) -> Result<T, BoxError> {
        match self {
            Ended::Inner(r) => r.map_err(Into::into),
            Ended::Own(e) => Err(e),
        }
    }
}

/// An attempt's end and its verdict.
type EndedWith<T, E> = (Ended<T, E>, Verdict);

/// The retrying part of a call, boxed.
type Rest<S, Req, C, P, K, H> = Pin<Box<Retrying<S, Req, C, P, K, H>>>;

/// What polling an attempt gives: a success (kept apart so that the first attempt's success
/// goes back at once), or anything else with its verdict.
enum Attempted<T, E> {
    Succeeded(T),
    Other(Ended<T, E>, Verdict),
}

const NOT_SENT: Verdict = Verdict::Fatal {
    outcome: Outcome::NotSent,
};

impl<S, Req, C, P, K, H> fmt::Debug for ResponseFuture<S, Req, C, P, K, H>
where
    S: Service<Req>,
    H: CallHook<Req, S::Response>,
{
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let (dependency, attempt) = match &self.state {
            State::First { call, .. } => (call.dependency.as_str(), 1),
            State::Rest(rest) => (rest.call.dependency.as_str(), rest.call.attempt),
            State::Ended(_) | State::Refused(_) | State::Done => ("", 0),
        };
        f.debug_struct("ResponseFuture")
            .field("dependency", &dependency)
            .field("attempt", &attempt)
            .finish()
    }
}

impl<S, Req> Call<S, Req> {
    /// A call to `dependency` that has made no attempt yet.
    #[inline]
    pub(crate) fn new(
        svc: S,
        dependency: Dependency,
        deadline: Option<Deadline>,
        now: Instant,
        nested: bool,
    ) -> Self {
        Call {
            svc,
            template: Template::Unneeded,
            dependency,
            deadline,
            started: now,
            attempt: 0,
            attempt_started: now,
            sent: false,
            nested,
            ticket: None,
            expiry: None,
            span: Span::none(),
        }
    }

    /// Tells the gate how the attempt it admitted ended (`None`: cancelled), once.
    fn end_attempt<C, P, K, H>(&mut self, policy: &Policy<C, P, K, H>, verdict: Option<Verdict>) {
        if let (Some(ticket), Some(gate)) = (self.ticket.take(), &policy.settings.gate) {
            gate.complete(&self.dependency, ticket, verdict, self.attempt_started);
        }
    }
}

impl<S, Req> Call<S, Req>
where
    S: Service<Req>,
    S::Error: Into<BoxError>,
    Req: HasExtensions,
{
    /// Begins the next attempt at `now`: checks the deadline, asks the gate, and only then
    /// makes the request (`req`: the first attempt's copy is made there, so a call the gate
    /// refuses copies nothing) and hands it to the service. `Err`: the attempt ended before
    /// it was sent.
    #[inline]
    fn begin<C, P, K, H>(
        &mut self,
        policy: &Policy<C, P, K, H>,
        now: Instant,
        parent: Option<&Span>,
        req: impl FnOnce(&mut Template<Req>) -> Req,
    ) -> Result<S::Future, EndedWith<S::Response, S::Error>> {
        self.attempt += 1;
        self.attempt_started = now;
        self.sent = false;
        self.span = attempt_span(parent, &self.dependency, self.attempt);
        self.expiry = match AttemptCutoff::plan(now, policy.settings.attempt_timeout, self.deadline)
        {
            Ok(end) => end,
            Err(passed) => {
                let error = passed.error(Some(self.dependency.clone()));
                let verdict = own_verdict(&error);
                return Err((Ended::Own(error), verdict));
            }
        };
        if let Some(gate) = &policy.settings.gate {
            match gate.admit(&self.dependency) {
                Ok(ticket) => self.ticket = Some(ticket),
                Err(refused) => return Err((Ended::Own(refused), NOT_SENT)),
            }
        }
        // The call's context travels with each attempt's request, across tasks and futures: put
        // on the copy it sends (the template stays as the caller gave it, and a request that
        // carries no other extension pays for the map once per attempt, not twice).
        let mut req = req(&mut self.template);
        // A nested layer leaves the outer layer's attempt number in place.
        let attempt = (!self.nested).then_some(self.attempt);
        backstop_core::plumbing::CallContext::claim(
            &mut req,
            self.dependency.clone(),
            self.deadline,
            attempt,
        );
        self.sent = true;
        // A span the service makes in its own `call` (tower-http's `TraceLayer`) is the
        // attempt's child, or the call's when attempt spans are filtered out: the first attempt
        // is begun from `call`, outside any poll, so the call's span is not entered by then.
        let _entered = match parent {
            Some(call) if self.span.is_disabled() => call.enter(),
            _ => self.span.enter(),
        };
        Ok(self.svc.call(req))
    }

    /// The attempt's end when it did not succeed: the gate learns it, and an error by which
    /// a Backstop layer further in refused the attempt makes it one not sent.
    fn ended<C, P, K, H>(
        &mut self,
        policy: &Policy<C, P, K, H>,
        result: Result<S::Response, S::Error>,
        verdict: Verdict,
    ) -> Attempted<S::Response, S::Error> {
        self.end_attempt(policy, Some(verdict));
        let ended = match result {
            Err(e) if verdict == NOT_SENT => {
                let e: BoxError = e.into();
                if refused_before_sending(&*e) {
                    self.sent = false;
                }
                Ended::Own(e)
            }
            r => Ended::Inner(r),
        };
        Attempted::Other(ended, verdict)
    }
}

/// Polls the attempt in flight (`fut`, cut short by `timer` at the call's expiry) to its end.
#[inline]
fn poll_attempt<S, Req, C, P, K, H>(
    fut: Pin<&mut S::Future>,
    mut timer: Pin<&mut Option<Sleep>>,
    call: &mut Call<S, Req>,
    policy: &Policy<C, P, K, H>,
    cx: &mut Context<'_>,
) -> Poll<Attempted<S::Response, S::Error>>
where
    S: Service<Req>,
    S::Error: Into<BoxError>,
    Req: HasExtensions,
    C: Classify<Req, S::Response, S::Error>,
{
    let polled = {
        let _entered = call.span.enter();
        fut.poll(cx)
    };
    match polled {
        Poll::Ready(result) => {
            let verdict = policy.classifier.classify(result.as_ref());
            Poll::Ready(match result {
                Ok(res) if verdict == Verdict::Success => {
                    call.end_attempt(policy, Some(verdict));
                    Attempted::Succeeded(res)
                }
                result => call.ended(policy, result, verdict),
            })
        }
        Poll::Pending => {
            let Some(end) = call.expiry else {
                return Poll::Pending;
            };
            if timer.is_none() {
                timer.set(Some(sleep_until(end.at)));
            }
            ready!(timer.as_pin_mut().expect("set above").poll(cx));
            let error = end.error(Some(call.dependency.clone()));
            let verdict = own_verdict(&error);
            call.end_attempt(policy, Some(verdict));
            Poll::Ready(Attempted::Other(Ended::Own(error), verdict))
        }
    }
}

impl<Req> Template<Req> {
    /// Keeps `req` and returns a copy to send, or, when it cannot be copied, keeps why and
    /// returns `req` itself.
    #[inline]
    fn keep(&mut self, resend: &impl Resend<Req>, req: Req) -> Req {
        let req = resend.prepare(req);
        match resend.copy(&req) {
            Ok(copy) => {
                *self = Template::Kept(req);
                copy
            }
            Err(why) => {
                *self = Template::Uncopyable(why);
                req
            }
        }
    }

    /// The kept request, or why there is none.
    fn kept(&self) -> Result<&Req, NotCopyable> {
        match self {
            Template::Kept(req) => Ok(req),
            Template::Uncopyable(why) => Err(why.clone()),
            Template::Unneeded => Err(NotCopyable::new("the request was not kept for a retry")),
        }
    }
}

impl<S, Req, C, P, K, H> ResponseFuture<S, Req, C, P, K, H>
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
    pub(crate) fn refused(policy: Arc<Policy<C, P, K, H>>, error: H::Error) -> Self {
        ResponseFuture {
            policy,
            state: State::Refused(Some(error)),
            hooked: None,
        }
    }

    /// Starts `call` with its first attempt: at once when the service is `ready`, else once
    /// it is (within the deadline). `hooked` is `None` when the call is nested.
    #[inline]
    pub(crate) fn start(
        policy: Arc<Policy<C, P, K, H>>,
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
            let now = call.started;
            let begun = call.begin(&policy, now, parent, |template| {
                if copies {
                    template.keep(&policy.resend, req)
                } else {
                    req
                }
            });
            match begun {
                Ok(fut) => State::First {
                    fut,
                    timer: None,
                    call,
                },
                Err((ended, verdict)) => Self::conclude(&policy, call, ended, verdict, parent),
            }
        } else {
            let first = if copies {
                call.template.keep(&policy.resend, req)
            } else {
                req
            };
            let step = Step::Readying {
                deadline: None,
                first: Some(first),
            };
            State::Rest(Retrying::boxed(
                policy.clone(),
                call,
                Retries::default(),
                step,
                parent,
            ))
        };
        ResponseFuture {
            policy,
            state,
            hooked,
        }
    }

    /// The first attempt ended with `ended` and `verdict`, and did not succeed: the call's next
    /// state, ended (nested: the result as it is; or stopped) or retrying.
    fn conclude(
        policy: &Arc<Policy<C, P, K, H>>,
        mut call: Call<S, Req>,
        ended: Ended<S::Response, S::Error>,
        verdict: Verdict,
        parent: Option<&Span>,
    ) -> State<S, Req, C, P, K, H> {
        if call.nested {
            return State::Ended(Some(ended.raw()));
        }
        // Decided before anything is boxed: a call that stops after one attempt allocates only
        // its history and its error.
        let mut retries = Retries::default();
        match retries.decide(policy, &mut call, ended, verdict) {
            Ok(result) => State::Ended(Some(result)),
            Err(wait) => {
                let step = Step::Waiting { sleep: sleep(wait) };
                State::Rest(Retrying::boxed(policy.clone(), call, retries, step, parent))
            }
        }
    }

    /// Polls the call, in whichever state it is, to its result.
    #[inline]
    fn drive(
        mut state: Pin<&mut State<S, Req, C, P, K, H>>,
        policy: &Arc<Policy<C, P, K, H>>,
        parent: Option<&Span>,
        cx: &mut Context<'_>,
    ) -> Poll<Result<S::Response, BoxError>> {
        loop {
            let (ended, verdict) = match state.as_mut().project() {
                StateProj::First { fut, timer, call } => {
                    match ready!(poll_attempt(fut, timer, call, policy, cx)) {
                        Attempted::Succeeded(res) => {
                            // The common case, kept short: nothing to report.
                            if !call.nested {
                                crate::obs::finished(&call.dependency, 1, true, false);
                            }
                            state.set(State::Done);
                            return Poll::Ready(Ok(res));
                        }
                        Attempted::Other(ended, verdict) => (ended, verdict),
                    }
                }
                StateProj::Rest(rest) => {
                    let result = ready!(rest.as_mut().poll(cx));
                    state.set(State::Done);
                    return Poll::Ready(result);
                }
                StateProj::Ended(result) => {
                    let result = result.take();
                    return Poll::Ready(
                        result.expect("retry ResponseFuture polled after completion"),
                    );
                }
                StateProj::Refused(_) | StateProj::Done => {
                    panic!("retry ResponseFuture polled after completion")
                }
            };
            let StateOwn::First { call, .. } = state.as_mut().project_replace(State::Done) else {
                unreachable!("only the first attempt ends here");
            };
            state.set(Self::conclude(policy, call, ended, verdict, parent));
        }
    }
}

impl<S, Req, C, P, K, H> Future for ResponseFuture<S, Req, C, P, K, H>
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

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let mut this = self.project();
        let policy = &*this.policy;
        let Some(hooked) = this.hooked.as_mut() else {
            if let StateProj::Refused(error) = this.state.as_mut().project() {
                let error = error.take();
                return Poll::Ready(Err(
                    error.expect("retry ResponseFuture polled after completion")
                ));
            }
            // An outer retry layer owns the call: its raw result goes back, with no call-level
            // work of this layer's (no span, no error mapping, no dead letter).
            let result = ready!(Self::drive(this.state, this.policy, None, cx));
            return Poll::Ready(result.map_err(|e| policy.hook.pass(e)));
        };
        let result = {
            let parent = policy.hook.span(hooked);
            let _entered = parent.map(Span::enter);
            ready!(Self::drive(this.state, this.policy, parent, cx))
        };
        Poll::Ready(policy.hook.end(hooked, result))
    }
}

#[pinned_drop]
impl<S, Req, C, P, K, H> PinnedDrop for ResponseFuture<S, Req, C, P, K, H>
where
    S: Service<Req>,
    H: CallHook<Req, S::Response>,
{
    fn drop(self: Pin<&mut Self>) {
        let this = self.project();
        if let StateProj::First { call, .. } = this.state.project() {
            // Cancelled mid-attempt: the gate learns it ended without a verdict.
            call.end_attempt(this.policy, None);
        }
    }
}

/// A call after its first attempt failed, or before one its service was not ready for:
/// everything only a retrying call pays for, boxed.
#[pin_project(PinnedDrop)]
pub(crate) struct Retrying<S: Service<Req>, Req, C, P, K, H> {
    policy: Arc<Policy<C, P, K, H>>,
    call: Call<S, Req>,
    retries: Retries,
    /// The call's span, which each attempt's span is created in.
    parent: Option<Span>,
    #[pin]
    step: Step<S::Future, Req>,
}

/// Where a retrying call is.
#[pin_project(project = StepProj)]
enum Step<F, Req> {
    /// Waiting before the next attempt.
    Waiting {
        #[pin]
        sleep: Sleep,
    },
    /// Waiting for the service to be ready, never past the deadline (`deadline`: its timer,
    /// once needed). `first`: the first attempt's request, when the service was not ready for
    /// it at `call`.
    Readying {
        #[pin]
        deadline: Option<Sleep>,
        first: Option<Req>,
    },
    /// An attempt in flight, as in [`State::First`].
    Calling {
        #[pin]
        fut: F,
        #[pin]
        timer: Option<Sleep>,
    },
}

/// What a retrying call keeps: the attempts so far and the backoff.
#[derive(Default)]
struct Retries {
    history: Vec<AttemptRecord>,
    schedule: Option<(Schedule, SmallRng)>,
}

#[pinned_drop]
impl<S: Service<Req>, Req, C, P, K, H> PinnedDrop for Retrying<S, Req, C, P, K, H> {
    fn drop(self: Pin<&mut Self>) {
        let this = self.project();
        // Cancelled mid-attempt: the gate learns it ended without a verdict.
        this.call.end_attempt(this.policy, None);
    }
}

impl<S, Req, C, P, K, H> Retrying<S, Req, C, P, K, H>
where
    S: Service<Req>,
{
    fn boxed(
        policy: Arc<Policy<C, P, K, H>>,
        call: Call<S, Req>,
        retries: Retries,
        step: Step<S::Future, Req>,
        parent: Option<&Span>,
    ) -> Rest<S, Req, C, P, K, H> {
        Box::pin(Retrying {
            policy,
            call,
            retries,
            parent: parent.cloned(),
            step,
        })
    }
}

impl<S, Req, C, P, K, H> Future for Retrying<S, Req, C, P, K, H>
where
    S: Service<Req>,
    S::Error: Into<BoxError>,
    S::Response: HasExtensions,
    Req: HasExtensions,
    C: Classify<Req, S::Response, S::Error>,
    P: Resend<Req>,
    H: CallHook<Req, S::Response>,
{
    type Output = Result<S::Response, BoxError>;

    /// Waits, waits for readiness, makes the attempt, decides; again, until a result is final.
    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let mut this = self.project();
        let (policy, call) = (&**this.policy, &mut *this.call);
        loop {
            let (ended, verdict) = match this.step.as_mut().project() {
                StepProj::Waiting { sleep } => {
                    ready!(sleep.poll(cx));
                    this.step.set(Step::Readying {
                        deadline: None,
                        first: None,
                    });
                    continue;
                }
                StepProj::Readying { deadline, first } => {
                    match ready!(poll_ready(call, deadline, cx)) {
                        Err(error) => {
                            // Not ready, or never before the deadline: nothing was sent.
                            call.attempt += 1;
                            call.attempt_started = Instant::now();
                            call.sent = false;
                            (Ended::Own(error), NOT_SENT)
                        }
                        Ok(()) => {
                            let req = match first.take() {
                                Some(req) => req,
                                None => match this.retries.copy(policy, call) {
                                    Ok(req) => req,
                                    Err(stopped) => return Poll::Ready(stopped),
                                },
                            };
                            if call.attempt > 0 {
                                crate::obs::retry(&call.dependency);
                            }
                            let parent = this.parent.as_ref();
                            match call.begin(policy, Instant::now(), parent, |_| req) {
                                Ok(fut) => {
                                    this.step.set(Step::Calling { fut, timer: None });
                                    continue;
                                }
                                Err(stopped) => stopped,
                            }
                        }
                    }
                }
                StepProj::Calling { fut, timer } => {
                    match ready!(poll_attempt(fut, timer, call, policy, cx)) {
                        Attempted::Succeeded(res) => (Ended::Inner(Ok(res)), Verdict::Success),
                        Attempted::Other(ended, verdict) => (ended, verdict),
                    }
                }
            };
            if call.nested {
                return Poll::Ready(ended.raw());
            }
            match this.retries.decide(policy, call, ended, verdict) {
                Ok(result) => return Poll::Ready(result),
                Err(wait) => this.step.set(Step::Waiting { sleep: sleep(wait) }),
            }
        }
    }
}

/// Polls the service for readiness, and ends the wait with `DeadlineExceeded` (not sent) when
/// the call's deadline passes first (`timer`: the deadline's, once needed).
fn poll_ready<S, Req>(
    call: &mut Call<S, Req>,
    mut timer: Pin<&mut Option<Sleep>>,
    cx: &mut Context<'_>,
) -> Poll<Result<(), BoxError>>
where
    S: Service<Req>,
    S::Error: Into<BoxError>,
{
    if let Poll::Ready(ready) = call.svc.poll_ready(cx) {
        return Poll::Ready(ready.map_err(Into::into));
    }
    let Some(deadline) = call.deadline else {
        return Poll::Pending;
    };
    if timer.is_none() {
        timer.set(Some(sleep_until(deadline.instant())));
    }
    ready!(timer.as_pin_mut().expect("set above").poll(cx));
    let error = DeadlineExceeded::new(Some(call.dependency.clone()), Outcome::NotSent)
        .with_length(deadline.length());
    Poll::Ready(Err(Box::new(error)))
}

impl Retries {
    /// The one decision after an attempt, unless it was the first and succeeded: `Ok`, the
    /// call's result; `Err`, how long to wait before the next attempt.
    fn decide<S, Req, C, P, K, H>(
        &mut self,
        policy: &Policy<C, P, K, H>,
        call: &mut Call<S, Req>,
        ended: Ended<S::Response, S::Error>,
        verdict: Verdict,
    ) -> Result<Result<S::Response, BoxError>, Duration>
    where
        S: Service<Req>,
        S::Error: Into<BoxError>,
        Req: HasExtensions,
        S::Response: HasExtensions,
        C: Classify<Req, S::Response, S::Error>,
        P: Resend<Req>,
    {
        self.history.push(AttemptRecord {
            attempt: call.attempt,
            sent: call.sent,
            verdict,
            took: call.attempt_started.elapsed(),
            wait: None,
        });
        match self.next(policy, call, verdict) {
            Ok(wait) => {
                if let Some(last) = self.history.last_mut() {
                    last.wait = Some(wait);
                }
                Err(wait)
            }
            Err(stopped) => Ok(self.finish(call, ended, verdict, stopped)),
        }
    }

    /// Whether another attempt is made, and after how long: every rule of the crate docs, in
    /// order.
    fn next<S, Req, C, P, K, H>(
        &mut self,
        policy: &Policy<C, P, K, H>,
        call: &Call<S, Req>,
        verdict: Verdict,
    ) -> Result<Duration, StopReason>
    where
        S: Service<Req>,
        Req: HasExtensions,
        C: Classify<Req, S::Response, S::Error>,
        P: Resend<Req>,
    {
        let (outcome, after) = match verdict {
            Verdict::Success => return Err(StopReason::Succeeded),
            Verdict::Fatal { .. } => return Err(StopReason::NotRetryable),
            Verdict::Retryable { outcome, after } => (outcome, after),
        };
        let settings = &policy.settings;
        // A request may carry a lower cap of its own (a destructive tool: one attempt).
        let max_attempts = match call.template.kept().ok().and_then(AttemptLimit::of) {
            Some(limit) => limit.min(settings.max_attempts),
            None => settings.max_attempts,
        };
        if call.attempt >= max_attempts {
            return Err(StopReason::AttemptsExhausted { max_attempts });
        }
        let template = call.template.kept().map_err(StopReason::NotCopyable)?;
        policy
            .resend
            .check(template)
            .map_err(StopReason::NotCopyable)?;
        // Backstop's own marker counts whatever the classifier says: a key the caller vouched
        // for, or a preset that requires keys, makes the request safe to repeat.
        let replay_safe =
            ReplaySafe::is_marked(template) || policy.classifier.is_replay_safe(template);
        if outcome == Outcome::Unknown && !replay_safe {
            return Err(if UnvouchedKey::is_marked(template) {
                StopReason::KeyNotVouched
            } else {
                StopReason::NotReplaySafe
            });
        }
        let wait = match after {
            Some(after) => after,
            None => {
                let (schedule, rng) = self
                    .schedule
                    .get_or_insert_with(|| (settings.backoff.schedule(), settings.rng.rng()));
                schedule.next_delay(rng)
            }
        };
        if let Some(deadline) = call.deadline {
            let left = deadline.remaining();
            if wait >= left {
                return Err(StopReason::DeadlineTooClose { wait, left });
            }
        }
        // The run's budget first (its refusal takes nothing from the dependency's), then the
        // dependency's; a retry the dependency refuses goes back to the run.
        let run = Run::of(template);
        if let Some(run) = run
            && !run.take_retry(&call.dependency)
        {
            crate::obs::run_budget_refused(&call.dependency);
            return Err(StopReason::RunBudgetExhausted {
                retries: run.budget().unwrap_or(0),
            });
        }
        if !settings.budget.withdraw(&call.dependency) {
            if let Some(run) = run {
                run.give_back(&call.dependency);
            }
            crate::obs::budget_refused(&call.dependency);
            return Err(StopReason::BudgetExhausted);
        }
        if run.is_some() {
            crate::obs::run_retry(&call.dependency);
        }
        tracing::debug!(
            target: "backstop::retry",
            dependency = %call.dependency,
            run = run.map_or("", Run::id),
            attempt = call.attempt,
            outcome = outcome.as_str(),
            wait_ms = u64::try_from(wait.as_millis()).unwrap_or(u64::MAX),
            server_asked = after.is_some(),
            "retrying"
        );
        Ok(wait)
    }

    /// A copy of the kept request for the next attempt, or the call's end.
    fn copy<S, Req, C, P, K, H>(
        &mut self,
        policy: &Policy<C, P, K, H>,
        call: &Call<S, Req>,
    ) -> Result<Req, Result<S::Response, BoxError>>
    where
        S: Service<Req>,
        S::Error: Into<BoxError>,
        S::Response: HasExtensions,
        P: Resend<Req>,
    {
        let copied = call.template.kept().and_then(|t| policy.resend.copy(t));
        copied.map_err(|why| {
            let verdict = self.history.last().map_or(NOT_SENT, |a| a.verdict);
            let cause = Box::new(why.clone());
            self.finish(
                call,
                Ended::Own(cause),
                verdict,
                StopReason::NotCopyable(why),
            )
        })
    }

    /// The call's end, `stopped` after `ended`: a response with its history, or the one
    /// [`RetryError`].
    fn finish<S, Req>(
        &mut self,
        call: &Call<S, Req>,
        ended: Ended<S::Response, S::Error>,
        verdict: Verdict,
        stopped: StopReason,
    ) -> Result<S::Response, BoxError>
    where
        S: Service<Req>,
        S::Error: Into<BoxError>,
        S::Response: HasExtensions,
    {
        let succeeded = matches!(stopped, StopReason::Succeeded);
        let unknown = !succeeded
            && self
                .history
                .iter()
                .any(|a| a.verdict.outcome() == Outcome::Unknown);
        crate::obs::finished(&call.dependency, call.attempt, succeeded, unknown);
        if !succeeded {
            tracing::debug!(
                target: "backstop::retry",
                dependency = %call.dependency,
                attempts = call.attempt,
                outcome = verdict.outcome().as_str(),
                reason = ?stopped,
                "stopped"
            );
        }
        let history = RetryHistory {
            dependency: call.dependency.clone(),
            attempts: std::mem::take(&mut self.history),
            elapsed: call.started.elapsed(),
            deadline: call.deadline.and_then(Deadline::length),
            stopped,
        };
        let cause = match ended {
            Ended::Inner(Ok(mut res)) => {
                res.extensions_mut().insert(history);
                return Ok(res);
            }
            Ended::Inner(Err(e)) => e.into(),
            Ended::Own(e) => e,
        };
        Err(Box::new(RetryError::new(history, verdict, cause)))
    }
}

/// An attempt this layer ended itself (timed out, or no time left), with the verdict the
/// classifiers give that error everywhere else: one rule for the layer and the layers further
/// in.
fn own_verdict(error: &BoxError) -> Verdict {
    backstop_classify::classify_error(&**error).unwrap_or(Verdict::Fatal {
        outcome: Outcome::Unknown,
    })
}

/// Whether a Backstop layer further in refused the attempt before anything was sent (an open
/// circuit, a deadline already passed): then it is no attempt sent. The same reading of the
/// cause chain as the errors' words ([`Diagnosis`]).
fn refused_before_sending(error: &(dyn std::error::Error + 'static)) -> bool {
    let d = Diagnosis::of(error);
    d.outcome == Some(Outcome::NotSent)
        && matches!(
            d.kind,
            Some(ErrorKind::Unavailable | ErrorKind::DeadlineExceeded)
        )
}

/// The attempt's span: inside the call's span when the hook keeps one, else inside whatever
/// span is current. A resend carries OpenTelemetry's `http.request.resend_count` (1 on the
/// second attempt), as the HTTP semantic conventions (1.23 and later) ask; the first attempt
/// has none.
fn attempt_span(parent: Option<&Span>, dependency: &Dependency, attempt: u32) -> Span {
    let span = match parent {
        Some(call) if !call.is_disabled() => tracing::debug_span!(
            target: "backstop::retry",
            parent: call,
            "attempt",
            dependency = %dependency,
            attempt,
            http.request.resend_count = tracing::field::Empty,
        ),
        _ => tracing::debug_span!(
            target: "backstop::retry",
            "attempt",
            dependency = %dependency,
            attempt,
            http.request.resend_count = tracing::field::Empty,
        ),
    };
    if attempt > 1 && !span.is_disabled() {
        span.record("http.request.resend_count", attempt - 1);
    }
    span
}
