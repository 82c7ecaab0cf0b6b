use crate::{
    AttemptRecord, CallHook, Diagnosis, ErrorKind, NotReplayable, Replay, RetryError, RetryHistory,
    StopReason, Ticket,
    layer::{Policy, Settings},
};
use backstop_backoff::Schedule;
use backstop_classify::{Classify, Verdict};
use backstop_core::{
    BoxError, CallContext, Deadline, DeadlineExceeded, Dependency, HasExtensions, Outcome,
};
use backstop_timeout::AttemptEnd;
use pin_project::pin_project;
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

/// Response future of [`Retry`](crate::Retry).
#[pin_project]
pub struct ResponseFuture<S, Req, C, P, K, H = crate::NoHook>
where
    S: Service<Req>,
    H: CallHook<Req, S::Response>,
{
    // One struct, built in place: a wrapper (an enum of "running" and "refused", say) would
    // cost every call one more copy of the whole future.
    #[pin]
    state: State<S::Future, H::Error, Req>,
    call: CallState<S, Req, C, P, K, H>,
    /// The hook's state for the call; `None` when the hook refused it, or when an outer retry
    /// layer owns the call (the call-level work is that layer's).
    hooked: Option<H::State>,
}

#[pin_project(project = StateProj)]
enum State<F, E, Req> {
    Calling {
        #[pin]
        fut: F,
        /// Created on the first `Pending` only, in place: an attempt that finishes at once
        /// pays for no timer, and one that waits pays for no allocation.
        #[pin]
        timer: Option<Sleep>,
    },
    /// The attempt ended before it was sent (the gate refused it, or no time was left).
    Stopped {
        error: Option<BoxError>,
        verdict: Verdict,
    },
    /// Boxed: only a call that retries pays for the timer, and the future stays small (it is
    /// moved through every outer layer on every call).
    Waiting {
        sleep: Option<Pin<Box<Sleep>>>,
    },
    /// Waiting for the service to be ready, under the deadline: `sleep` is the deadline's
    /// timer once one is needed (the backoff's, reset), `first` the first attempt's request
    /// when the service was not ready at `call` (boxed: only that case pays for it).
    Readying {
        sleep: Option<Pin<Box<Sleep>>>,
        first: Option<Box<Req>>,
    },
    /// The hook refused the call before anything was sent; taken when the future completes.
    Refused {
        error: Option<E>,
    },
    Done,
}

/// What only a call that fails needs: boxed on first use, so a call that succeeds at once
/// neither allocates it nor moves it around.
#[derive(Default)]
struct Cold {
    history: Vec<AttemptRecord>,
    schedule: Option<(Schedule, SmallRng)>,
    not_replayable: Option<NotReplayable>,
}

struct CallState<S, Req, C, P, K, H> {
    policy: Arc<Policy<C, P, K, H>>,
    svc: S,
    /// The original request, kept for replays; `None` when it cannot be replayed.
    template: Option<Req>,
    dependency: Dependency,
    deadline: Option<Deadline>,
    started: Instant,
    attempt_started: Instant,
    attempt: u32,
    /// Whether the current attempt was handed to the service (a gate refusal, a deadline
    /// that passed first or a service never ready is no attempt sent).
    handed: bool,
    /// 1 when an outer retry layer owns retrying.
    max_attempts: u32,
    /// An outer retry layer owns retrying: this layer makes one attempt, still gated and
    /// timed, and hands the raw result back.
    nested: bool,
    /// The gate's ticket for the attempt in flight.
    ticket: Option<Ticket>,
    /// When the attempt in flight is cut short, if it is.
    expiry: Option<AttemptEnd>,
    cold: Option<Box<Cold>>,
    /// The current attempt's span (disabled, and free, when nobody listens).
    span: tracing::Span,
}

impl<S, Req, C, P, K, H> CallState<S, Req, C, P, K, H> {
    /// Tells the gate how the attempt it admitted ended (`None`: cancelled), once.
    fn end_attempt(&mut self, verdict: Option<Verdict>) {
        if let (Some(ticket), Some(gate)) = (self.ticket.take(), &self.policy.settings.gate) {
            gate.complete(&self.dependency, ticket, verdict, self.attempt_started);
        }
    }
}

impl<S, Req, C, P, K, H> Drop for CallState<S, Req, C, P, K, H> {
    fn drop(&mut self) {
        // Cancelled mid-attempt: the gate learns it ended without a verdict.
        self.end_attempt(None);
    }
}

enum Next {
    Stop(StopReason),
    Wait(Duration),
}

/// How an attempt ended: the inner service's result, or this layer's own error (timed out,
/// refused by the gate, no time left).
enum Ended<T, E> {
    Inner(Result<T, E>),
    Own(BoxError),
}

impl<S, Req, C, P, K, H> fmt::Debug for ResponseFuture<S, Req, C, P, K, H>
where
    S: Service<Req>,
    H: CallHook<Req, S::Response>,
{
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ResponseFuture")
            .field("dependency", &self.call.dependency)
            .field("attempt", &self.call.attempt)
            .field("max_attempts", &self.call.max_attempts)
            .field("refused", &self.hooked.is_none())
            .finish()
    }
}

impl<S, Req, C, P, K, H> ResponseFuture<S, Req, C, P, K, H>
where
    S: Service<Req>,
    Req: HasExtensions,
    P: Replay<Req>,
    H: CallHook<Req, S::Response>,
{
    /// A call the hook refused: it ends with `error` when first polled, without sending.
    pub(crate) fn refused(
        policy: Arc<Policy<C, P, K, H>>,
        svc: S,
        dependency: Dependency,
        now: Instant,
        error: H::Error,
    ) -> Self {
        ResponseFuture {
            state: State::Refused { error: Some(error) },
            call: CallState {
                policy,
                svc,
                template: None,
                dependency,
                deadline: None,
                started: now,
                attempt_started: now,
                attempt: 0,
                handed: false,
                max_attempts: 0,
                nested: false,
                ticket: None,
                expiry: None,
                cold: None,
                span: tracing::Span::none(),
            },
            hooked: None,
        }
    }

    /// Starts the call: its first attempt at once when `svc` is `ready`, else once it is
    /// (within the deadline). `nested`: an outer retry layer owns retrying, and `hooked` is
    /// `None`.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn start(
        policy: Arc<Policy<C, P, K, H>>,
        svc: S,
        req: Req,
        dependency: Dependency,
        deadline: Option<Deadline>,
        now: Instant,
        nested: bool,
        ready: bool,
        hooked: Option<H::State>,
    ) -> Self {
        let max_attempts = if nested {
            1
        } else {
            policy.settings.max_attempts
        };
        // The template stays as the caller sent it; each attempt is a copy. Made only once the
        // first attempt is admitted: a call the open circuit refuses copies nothing.
        let mut template = None;
        let mut cold = None;
        let replay = &policy.replay;
        let split = |req: Req, template: &mut Option<Req>, cold: &mut Option<Box<Cold>>| {
            if max_attempts <= 1 {
                return req;
            }
            match replay.replay(&req) {
                Ok(copy) => {
                    *template = Some(req);
                    copy
                }
                Err(why) => {
                    *cold = Some(Box::new(Cold {
                        not_replayable: Some(why),
                        ..Cold::default()
                    }));
                    req
                }
            }
        };
        if !nested {
            crate::obs::call(&dependency);
        }
        let mut svc = svc;
        let (began, attempt) = if ready {
            let began = begin_attempt(
                &policy.settings,
                &mut svc,
                || split(req, &mut template, &mut cold),
                &dependency,
                deadline,
                1,
                now,
                hooked.as_ref().and_then(|h| policy.hook.span(h)),
            );
            (began, 1)
        } else {
            let first = split(req, &mut template, &mut cold);
            let began = Began {
                state: State::Readying {
                    sleep: None,
                    first: Some(Box::new(first)),
                },
                span: tracing::Span::none(),
                expiry: None,
                ticket: None,
                handed: false,
            };
            (began, 0)
        };
        let Began {
            state,
            span,
            expiry,
            ticket,
            handed,
        } = began;
        // Built in place, field by field: the call state is not moved again on the way out.
        ResponseFuture {
            state,
            call: CallState {
                policy,
                svc,
                template,
                dependency,
                deadline,
                started: now,
                attempt_started: now,
                attempt,
                handed,
                max_attempts,
                nested,
                ticket,
                expiry,
                cold,
                span,
            },
            hooked,
        }
    }
}

/// What beginning an attempt sets up: the state the call is in, the attempt's span, when the
/// attempt is cut short, and the gate's ticket.
struct Began<F, E, Req> {
    state: State<F, E, Req>,
    span: tracing::Span,
    expiry: Option<AttemptEnd>,
    ticket: Option<Ticket>,
    /// The request was handed to the service.
    handed: bool,
}

/// Begins attempt number `attempt` at `now`: checks the deadline, asks the gate, and only then
/// makes the request (`req`: the first attempt's copy is made there) and calls the service.
#[allow(clippy::too_many_arguments)]
fn begin_attempt<S, Req, E>(
    settings: &Settings,
    svc: &mut S,
    req: impl FnOnce() -> Req,
    dependency: &Dependency,
    deadline: Option<Deadline>,
    attempt: u32,
    now: Instant,
    parent: Option<&tracing::Span>,
) -> Began<S::Future, E, Req>
where
    S: Service<Req>,
    Req: HasExtensions,
{
    let span = attempt_span(parent, dependency, attempt);
    let expiry = match AttemptEnd::plan(now, settings.attempt_timeout, deadline) {
        Ok(end) => end,
        Err(passed) => {
            let error = passed.error(Some(dependency.clone()));
            return Began {
                state: State::Stopped {
                    verdict: own_verdict(&error),
                    error: Some(error),
                },
                span,
                expiry: None,
                ticket: None,
                handed: false,
            };
        }
    };
    let mut ticket = None;
    if let Some(gate) = &settings.gate {
        match gate.admit(dependency) {
            Ok(t) => ticket = Some(t),
            Err(refused) => {
                return Began {
                    state: State::Stopped {
                        error: Some(refused),
                        verdict: Verdict::Fatal {
                            outcome: Outcome::NotSent,
                        },
                    },
                    span,
                    expiry,
                    ticket: None,
                    handed: false,
                };
            }
        }
    }
    // The call's context travels with each attempt's request, across tasks and futures: put
    // on the copy it sends (the template stays as the caller gave it, and a request that
    // carries no other extension pays for the map once per attempt, not twice).
    let mut req = req();
    CallContext::claim(&mut req, dependency.clone(), deadline);
    let fut = {
        let _entered = span.enter();
        svc.call(req)
    };
    Began {
        state: State::Calling { fut, timer: None },
        span,
        expiry,
        ticket,
        handed: true,
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
/// span is current.
fn attempt_span(
    parent: Option<&tracing::Span>,
    dependency: &Dependency,
    attempt: u32,
) -> tracing::Span {
    match parent {
        Some(call) if !call.is_disabled() => tracing::debug_span!(
            target: "backstop::retry",
            parent: call,
            "attempt",
            dependency = %dependency,
            attempt
        ),
        _ => tracing::debug_span!(
            target: "backstop::retry",
            "attempt",
            dependency = %dependency,
            attempt
        ),
    }
}

impl<S, Req, C, P, K, H> CallState<S, Req, C, P, K, H>
where
    S: Service<Req>,
    Req: HasExtensions,
    H: CallHook<Req, S::Response>,
{
    fn cold(&mut self) -> &mut Cold {
        self.cold.get_or_insert_with(Box::default)
    }

    fn history_is_empty(&self) -> bool {
        self.cold.as_ref().is_none_or(|c| c.history.is_empty())
    }

    /// Begins the next attempt at `now` (see [`begin_attempt`]) and keeps what it set up.
    fn begin(
        &mut self,
        req: Req,
        now: Instant,
        parent: Option<&tracing::Span>,
    ) -> State<S::Future, H::Error, Req> {
        self.attempt_started = now;
        let began = begin_attempt(
            &self.policy.settings,
            &mut self.svc,
            || req,
            &self.dependency,
            self.deadline,
            self.attempt,
            now,
            parent,
        );
        self.span = began.span;
        self.expiry = began.expiry;
        self.ticket = began.ticket;
        self.handed = began.handed;
        began.state
    }

    fn record(&mut self, verdict: Verdict) {
        let took = self.attempt_started.elapsed();
        let attempt = self.attempt;
        let sent = self.handed;
        self.cold().history.push(AttemptRecord {
            attempt,
            sent,
            verdict,
            took,
            wait: None,
        });
    }

    fn next(&mut self, verdict: Verdict) -> Next
    where
        C: Classify<Req, S::Response, S::Error>,
    {
        let (outcome, after) = match verdict {
            Verdict::Success => {
                // A first-attempt success records nothing: the hot path does not allocate.
                if !self.history_is_empty() {
                    self.record(verdict);
                }
                return Next::Stop(StopReason::Succeeded);
            }
            Verdict::Fatal { .. } => {
                self.record(verdict);
                return Next::Stop(StopReason::NotRetryable);
            }
            Verdict::Retryable { outcome, after } => (outcome, after),
        };
        self.record(verdict);
        if self.attempt >= self.max_attempts {
            return Next::Stop(StopReason::AttemptsExhausted {
                max_attempts: self.max_attempts,
            });
        }
        let policy = self.policy.clone();
        let Some(template) = &self.template else {
            let why = self
                .cold()
                .not_replayable
                .clone()
                .unwrap_or_else(|| NotReplayable::new("the request could not be copied"));
            return Next::Stop(StopReason::NotReplayable(why));
        };
        if outcome == Outcome::Unknown && !policy.classifier.is_replay_safe(template) {
            return Next::Stop(if backstop_core::UnvouchedKey::is_marked(template) {
                StopReason::KeyNotVouched
            } else {
                StopReason::NotReplaySafe
            });
        }
        let wait = match after {
            Some(after) => after,
            None => {
                let (schedule, rng) = self.cold().schedule.get_or_insert_with(|| {
                    (
                        policy.settings.backoff.schedule(),
                        policy.settings.rng.rng(),
                    )
                });
                schedule.next_delay(rng)
            }
        };
        if let Some(deadline) = self.deadline {
            let left = deadline.remaining();
            if wait >= left {
                return Next::Stop(StopReason::DeadlineTooClose { wait, left });
            }
        }
        if !policy.settings.budget.withdraw(&self.dependency) {
            crate::obs::budget_refused(&self.dependency);
            return Next::Stop(StopReason::BudgetExhausted);
        }
        if let Some(last) = self.cold().history.last_mut() {
            last.wait = Some(wait);
        }
        tracing::debug!(
            target: "backstop::retry",
            dependency = %self.dependency,
            attempt = self.attempt,
            outcome = outcome.as_str(),
            wait_ms = u64::try_from(wait.as_millis()).unwrap_or(u64::MAX),
            server_asked = after.is_some(),
            "retrying"
        );
        Next::Wait(wait)
    }

    fn history(&mut self, stopped: StopReason) -> RetryHistory {
        RetryHistory {
            dependency: self.dependency.clone(),
            attempts: self
                .cold
                .as_mut()
                .map(|c| std::mem::take(&mut c.history))
                .unwrap_or_default(),
            elapsed: self.started.elapsed(),
            deadline: self.deadline.and_then(Deadline::length),
            stopped,
        }
    }

    fn finish(
        &mut self,
        ended: Ended<S::Response, S::Error>,
        verdict: Verdict,
        stopped: StopReason,
    ) -> Result<S::Response, BoxError>
    where
        S::Response: HasExtensions,
        S::Error: Into<BoxError>,
    {
        let succeeded = matches!(stopped, StopReason::Succeeded);
        let unknown = !succeeded
            && self.cold.as_ref().is_some_and(|c| {
                c.history
                    .iter()
                    .any(|a| a.verdict.outcome() == Outcome::Unknown)
            });
        crate::obs::finished(&self.dependency, self.attempt, succeeded, unknown);
        if !succeeded {
            tracing::debug!(
                target: "backstop::retry",
                dependency = %self.dependency,
                attempts = self.attempt,
                outcome = verdict.outcome().as_str(),
                reason = ?stopped,
                "stopped"
            );
        }
        let cause = match ended {
            Ended::Inner(Ok(mut res)) => {
                if !self.history_is_empty() {
                    let history = self.history(stopped);
                    res.extensions_mut().insert(history);
                }
                return Ok(res);
            }
            Ended::Inner(Err(e)) => e.into(),
            Ended::Own(e) => e,
        };
        let history = self.history(stopped);
        Err(Box::new(RetryError::new(history, verdict, cause)))
    }
}

impl<S, Req, C, P, K, H> Future for ResponseFuture<S, Req, C, P, K, H>
where
    S: Service<Req>,
    S::Error: Into<BoxError>,
    S::Response: HasExtensions,
    Req: HasExtensions,
    C: Classify<Req, S::Response, S::Error>,
    P: Replay<Req>,
    H: CallHook<Req, S::Response>,
{
    type Output = Result<S::Response, H::Error>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let mut this = self.project();
        let call = this.call;
        let Some(hooked) = this.hooked.as_mut() else {
            if let StateProj::Refused { error } = this.state.as_mut().project() {
                return Poll::Ready(Err(error
                    .take()
                    .expect("retry ResponseFuture polled after completion")));
            }
            // An outer retry layer owns the call: its raw result goes back, with no call-level
            // work of this layer's (no span, no error mapping, no dead letter).
            let result = ready!(poll_call(this.state, call, None, cx));
            return Poll::Ready(result.map_err(|e| call.policy.hook.pass(e)));
        };
        let result = {
            let parent = call.policy.hook.span(hooked);
            let _entered = parent.map(tracing::Span::enter);
            ready!(poll_call(this.state, call, parent, cx))
        };
        Poll::Ready(call.policy.hook.end(hooked, result))
    }
}

/// The attempt has ended with `ended` and `verdict`: tell the gate, then hand the result back
/// (nested), wait for the next attempt, or stop. Continues the caller's loop or returns.
macro_rules! finish_attempt {
    ($state:ident, $call:ident, $ended:expr, $verdict:expr) => {{
        let ended = $ended;
        let verdict = $verdict;
        $call.end_attempt(Some(verdict));
        if $call.nested {
            // An outer retry layer owns the call: the result goes back as it is, for that
            // layer to classify.
            $state.set(State::Done);
            return Poll::Ready(match ended {
                Ended::Inner(r) => r.map_err(Into::into),
                Ended::Own(e) => Err(e),
            });
        }
        match $call.next(verdict) {
            Next::Wait(wait) => {
                drop(ended);
                $state.set(State::Waiting {
                    sleep: Some(Box::pin(sleep(wait))),
                });
                continue;
            }
            Next::Stop(stopped) => {
                $state.set(State::Done);
                return Poll::Ready($call.finish(ended, verdict, stopped));
            }
        }
    }};
}

/// Drives the call's attempts until one result is final.
fn poll_call<S, Req, C, P, K, H>(
    mut state: Pin<&mut State<S::Future, H::Error, Req>>,
    call: &mut CallState<S, Req, C, P, K, H>,
    parent: Option<&tracing::Span>,
    cx: &mut Context<'_>,
) -> Poll<Result<S::Response, BoxError>>
where
    S: Service<Req>,
    S::Error: Into<BoxError>,
    S::Response: HasExtensions,
    Req: HasExtensions,
    C: Classify<Req, S::Response, S::Error>,
    P: Replay<Req>,
    H: CallHook<Req, S::Response>,
{
    loop {
        let (ended, verdict) = match state.as_mut().project() {
            StateProj::Calling { fut, mut timer } => {
                let polled = {
                    let _entered = call.span.enter();
                    fut.poll(cx)
                };
                match polled {
                    Poll::Ready(result) => {
                        let verdict = call.policy.classifier.classify(result.as_ref());
                        if verdict == Verdict::Success && call.cold.is_none() {
                            // The common case, kept short: a success with nothing to report.
                            call.end_attempt(Some(verdict));
                            if !call.nested {
                                crate::obs::finished(&call.dependency, call.attempt, true, false);
                            }
                            state.set(State::Done);
                            return Poll::Ready(result.map_err(Into::into));
                        }
                        let ended = match result {
                            Err(e)
                                if verdict
                                    == (Verdict::Fatal {
                                        outcome: Outcome::NotSent,
                                    }) =>
                            {
                                let e: BoxError = e.into();
                                if refused_before_sending(&*e) {
                                    // A breaker or deadline layer further in refused it.
                                    call.handed = false;
                                }
                                Ended::Own(e)
                            }
                            r => Ended::Inner(r),
                        };
                        (ended, verdict)
                    }
                    Poll::Pending => {
                        let Some(expiry) = call.expiry else {
                            return Poll::Pending;
                        };
                        if timer.is_none() {
                            timer.set(Some(sleep_until(expiry.at)));
                        }
                        ready!(timer.as_pin_mut().expect("set above").poll(cx));
                        let error = expiry.error(Some(call.dependency.clone()));
                        let verdict = own_verdict(&error);
                        (Ended::Own(error), verdict)
                    }
                }
            }
            StateProj::Stopped { error, verdict } => (
                Ended::Own(
                    error
                        .take()
                        .expect("retry ResponseFuture polled after completion"),
                ),
                *verdict,
            ),
            StateProj::Waiting { sleep } => {
                let timer = sleep.as_mut().expect("a wait always has its timer");
                ready!(timer.as_mut().poll(cx));
                // The same timer bounds the wait for readiness: reset to the deadline.
                let mut sleep = sleep.take();
                match (call.deadline, sleep.as_mut()) {
                    (Some(deadline), Some(timer)) => timer.as_mut().reset(deadline.instant()),
                    _ => sleep = None,
                }
                state.set(State::Readying { sleep, first: None });
                continue;
            }
            StateProj::Readying { sleep, first } => {
                // Readiness is polled again before every attempt, and never past the deadline.
                match call.svc.poll_ready(cx) {
                    Poll::Ready(Ok(())) => {}
                    Poll::Ready(Err(e)) => {
                        state.set(State::Done);
                        let verdict = Verdict::Fatal {
                            outcome: Outcome::NotSent,
                        };
                        let history = call.history(StopReason::NotRetryable);
                        return Poll::Ready(Err(Box::new(RetryError::new(
                            history,
                            verdict,
                            e.into(),
                        ))));
                    }
                    Poll::Pending => {
                        let Some(deadline) = call.deadline else {
                            return Poll::Pending;
                        };
                        let timer =
                            sleep.get_or_insert_with(|| Box::pin(sleep_until(deadline.instant())));
                        ready!(timer.as_mut().poll(cx));
                        // The deadline passed before the service was ready: nothing was sent.
                        call.attempt += 1;
                        call.handed = false;
                        call.attempt_started = Instant::now();
                        let error: BoxError = Box::new(
                            DeadlineExceeded::new(Some(call.dependency.clone()), Outcome::NotSent)
                                .with_length(deadline.length()),
                        );
                        let verdict = Verdict::Fatal {
                            outcome: Outcome::NotSent,
                        };
                        first.take();
                        finish_attempt!(state, call, Ended::Own(error), verdict);
                    }
                }
                let req = match first.take() {
                    Some(req) => *req,
                    None => {
                        let template = call
                            .template
                            .as_ref()
                            .expect("only a replayable request is retried");
                        match call.policy.replay.replay(template) {
                            Ok(req) => req,
                            Err(why) => {
                                state.set(State::Done);
                                let verdict = call
                                    .cold
                                    .as_ref()
                                    .and_then(|c| c.history.last())
                                    .map(|a| a.verdict)
                                    .unwrap_or(Verdict::Fatal {
                                        outcome: Outcome::NotSent,
                                    });
                                let history = call.history(StopReason::NotReplayable(why.clone()));
                                return Poll::Ready(Err(Box::new(RetryError::new(
                                    history,
                                    verdict,
                                    Box::new(why),
                                ))));
                            }
                        }
                    }
                };
                call.attempt += 1;
                if call.attempt > 1 {
                    crate::obs::retry(&call.dependency);
                }
                let next = call.begin(req, Instant::now(), parent);
                state.set(next);
                continue;
            }
            StateProj::Done | StateProj::Refused { .. } => {
                panic!("retry ResponseFuture polled after completion")
            }
        };

        finish_attempt!(state, call, ended, verdict);
    }
}
