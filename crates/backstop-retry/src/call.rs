//! One call of the retry layer: the handle polled ready, the caller's request, its attempts.
//! Every attempt, the first included, is begun by [`Call::begin`]; after each, one decision
//! ([`Call::decide`], the rules in `policy.rs`); every end passes [`Call::finish`].

use crate::error_kind::Diagnosis;
use crate::{
    AttemptRecord, ErrorKind, NotCopyable, Resend, RetryError, RetryHistory, StopReason, Ticket,
    parts::{EndOf, Ended, Err, Fut, NOT_SENT, PolicyOf, Res, Retryable, Schedule},
};
use backstop_classify::{Classify, Verdict};
use backstop_core::{
    BoxError, CallContext, Deadline, DeadlineExceeded, Dependency, HasExtensions, Outcome,
};
use backstop_timeout::{AttemptCutoff, Expiry};
use pin_project::pin_project;
use std::{
    future::Future,
    pin::Pin,
    task::{Context, Poll, ready},
    time::Duration,
};
use tokio::time::{Instant, Sleep, sleep_until};
use tower_service::Service;
use tracing::Span;

#[pin_project(project = StateProj)]
pub(crate) enum State<F> {
    /// An attempt in flight, and its timer (created at its first `Pending`).
    Called {
        #[pin]
        fut: F,
        #[pin]
        timer: Option<Sleep>,
    },
    /// Waiting before the next attempt.
    Waiting {
        #[pin]
        sleep: Sleep,
    },
    /// The service getting ready for the next attempt, never past the deadline (`timer`).
    Readying {
        #[pin]
        timer: Option<Sleep>,
    },
    /// The attempt ended before it was sent; its error is taken at the next poll.
    Unsent(Option<(BoxError, Verdict)>),
    Done,
}

/// One call: the service whose readiness it holds, the caller's request, and its attempts.
pub(crate) struct Call<T: Retryable> {
    pub(crate) svc: T::Svc,
    pub(crate) template: Template<T::Req>,
    pub(crate) dependency: Dependency,
    pub(crate) deadline: Option<Deadline>,
    pub(crate) started: Instant,
    /// Attempts begun so far, the one in flight included.
    pub(crate) attempt: u32,
    pub(crate) attempt_started: Instant,
    /// Whether the current attempt was handed to the service.
    pub(crate) sent: bool,
    /// An outer retry layer owns retrying: one attempt, its raw result handed back.
    pub(crate) nested: bool,
    /// The attempts are planned from, and recorded in, the learned latency record: a layer
    /// with one, and a request that is replay-safe (a cut one may be sent again). Any other
    /// keeps the fixed attempt timeout, and its latency stays out of the record.
    pub(crate) learned: bool,
    pub(crate) ticket: Option<Ticket>,
    pub(crate) cutoff: Option<AttemptCutoff>,
    pub(crate) span: AttemptSpan,
    pub(crate) history: Vec<AttemptRecord>,
    /// The backoff and its random source, boxed at the first wait they decide: only a call
    /// that retries pays for them, and the future every call moves stays smaller.
    pub(crate) schedule: Option<Box<Schedule>>,
}

/// The caller's request, kept as the caller sent it: every attempt sends a copy.
pub(crate) enum Template<Req> {
    /// One attempt only (`max_attempts` is 1, or an outer layer retries): nothing is kept.
    Unneeded,
    Kept(Req),
    /// It could not be copied, for this reason: the call has one attempt.
    Uncopyable(NotCopyable),
}

impl<Req> Template<Req> {
    /// Keeps `req` (prepared for copying) and returns a copy to send, or, when it cannot be
    /// copied, keeps why and returns `req` itself.
    #[inline]
    pub(crate) fn keep(&mut self, resend: &impl Resend<Req>, req: Req) -> Req {
        // Kept in place first and copied from there: the request is moved once, not twice.
        *self = Template::Kept(resend.prepare(req));
        let Template::Kept(kept) = &*self else {
            unreachable!("kept above")
        };
        match resend.copy(kept) {
            Ok(copy) => copy,
            Err(why) => match std::mem::replace(self, Template::Uncopyable(why)) {
                Template::Kept(req) => req,
                _ => unreachable!("kept above"),
            },
        }
    }

    /// The kept request, or why there is none.
    pub(crate) fn kept(&self) -> Result<&Req, NotCopyable> {
        match self {
            Template::Kept(req) => Ok(req),
            Template::Uncopyable(why) => Err(why.clone()),
            Template::Unneeded => Err(NotCopyable::new("the request was not kept for a retry")),
        }
    }
}

impl<T: Retryable> Call<T> {
    /// A call begun at `now`, to `dependency` on `svc`, the service polled ready for it.
    #[inline]
    pub(crate) fn new(
        svc: T::Svc,
        dependency: Dependency,
        deadline: Option<Deadline>,
        nested: bool,
        learned: bool,
        now: Instant,
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
            learned,
            ticket: None,
            cutoff: None,
            span: AttemptSpan::default(),
            history: Vec::new(),
            schedule: None,
        }
    }

    /// Counts the next attempt, begun at `now` and not sent yet.
    pub(crate) fn begin_attempt(&mut self, now: Instant) {
        self.attempt += 1;
        self.attempt_started = now;
        self.sent = false;
    }

    /// Begins the next attempt at `now` on the ready service: asks the budget's admission and
    /// the learned limit (when there are), plans its cutoff within the deadline, asks the gate,
    /// and only then makes the request (`req`, so a refused attempt copies nothing) and sends it.
    #[inline]
    pub(crate) fn begin(
        &mut self,
        policy: &PolicyOf<T>,
        now: Instant,
        req: impl FnOnce(&mut Template<T::Req>) -> T::Req,
    ) -> State<Fut<T>> {
        self.begin_attempt(now);
        self.span = AttemptSpan::new(&self.dependency, self.attempt);
        let limit = if policy.settings.attempt_hooks {
            match self.before_attempt(policy) {
                Ok(limit) => limit,
                Err(refused) => return State::Unsent(Some((refused, NOT_SENT))),
            }
        } else {
            policy.settings.attempt_timeout
        };
        self.cutoff = match AttemptCutoff::plan(now, limit, self.deadline) {
            Ok(cutoff) => cutoff,
            Err(passed) => {
                let error = passed.error(Some(self.dependency.clone()));
                let verdict = own_verdict(&error);
                return State::Unsent(Some((error, verdict)));
            }
        };
        if let Some(gate) = &policy.settings.gate {
            match gate.admit(&self.dependency) {
                Ok(ticket) => self.ticket = Some(ticket),
                Err(refused) => return State::Unsent(Some((refused, NOT_SENT))),
            }
        }
        let mut req = req(&mut self.template);
        // The call's context travels with each attempt's copy, across tasks and futures; a leaf
        // client reads none of it. A nested layer leaves the outer layer's attempt number.
        if !policy.settings.leaf {
            let attempt = (!self.nested).then_some(self.attempt);
            CallContext::claim(
                &mut req,
                crate::owner(),
                self.dependency.clone(),
                self.deadline,
                attempt,
                self.cutoff.map(|c| c.at),
            );
        }
        if self.attempt > 1 {
            crate::obs::retry(&self.dependency);
        }
        self.sent = true;
        if let Some(span) = self.span.get()
            && let Some(name) = policy.resend.attempt_name(&req)
        {
            // Before the span is first entered, while OpenTelemetry's span can still be named.
            span.record("otel.name", &*name);
        }
        // A span the service makes in its own `call` is the attempt's child.
        let _entered = self.span.get().map(Span::enter);
        State::Called {
            fut: self.svc.call(req),
            timer: None,
        }
    }

    /// Polls the attempt in flight to its end: the service's result, or this layer's own
    /// timeout once the cutoff passes (the response wins a tie: it is polled first).
    #[inline]
    pub(crate) fn poll_attempt(
        &mut self,
        policy: &PolicyOf<T>,
        fut: Pin<&mut Fut<T>>,
        mut timer: Pin<&mut Option<Sleep>>,
        cx: &mut Context<'_>,
    ) -> Poll<EndOf<T>> {
        let polled = {
            let _entered = self.span.get().map(Span::enter);
            fut.poll(cx)
        };
        if let Poll::Ready(result) = polled {
            let verdict = policy.classifier.classify(result.as_ref());
            self.end_attempt(policy, Some(verdict));
            let ended = match result {
                // A Backstop layer further in refused the attempt: it was not sent.
                Err(e) if verdict == NOT_SENT => {
                    let e: BoxError = e.into();
                    self.sent &= !refused_before_sending(&*e);
                    Ended::Own(e)
                }
                r => Ended::Inner(r),
            };
            return Poll::Ready((ended, verdict));
        }
        let Some(cutoff) = self.cutoff else {
            return Poll::Pending;
        };
        if timer.is_none() {
            timer.set(Some(sleep_until(cutoff.at)));
        }
        ready!(timer.as_pin_mut().expect("set above").poll(cx));
        // A learned timeout counts the attempts it cut (each took at least its limit).
        if let (true, Some(latency), Expiry::Attempt { .. }) =
            (self.learned, &policy.settings.latency, cutoff.expiry)
        {
            latency.record_cut(&self.dependency);
        }
        let error = cutoff.error(Some(self.dependency.clone()));
        let verdict = own_verdict(&error);
        self.end_attempt(policy, Some(verdict));
        Poll::Ready((Ended::Own(error), verdict))
    }

    /// Polls the service's readiness for the next attempt; the deadline ends the wait, not sent.
    pub(crate) fn poll_ready(
        &mut self,
        mut timer: Pin<&mut Option<Sleep>>,
        cx: &mut Context<'_>,
    ) -> Poll<Result<(), BoxError>> {
        if let Poll::Ready(ready) = self.svc.poll_ready(cx) {
            return Poll::Ready(ready.map_err(Into::into));
        }
        let Some(deadline) = self.deadline else {
            return Poll::Pending;
        };
        if timer.is_none() {
            timer.set(Some(sleep_until(deadline.instant())));
        }
        ready!(timer.as_pin_mut().expect("set above").poll(cx));
        Poll::Ready(Err(self.not_ready()))
    }

    /// The error of a service that did not become ready within the deadline: not sent.
    pub(crate) fn not_ready(&self) -> BoxError {
        let length = self.deadline.and_then(Deadline::length);
        Box::new(
            DeadlineExceeded::new(Some(self.dependency.clone()), Outcome::NotSent)
                .with_length(length),
        )
    }

    /// Tells the gate, the budget and the latency record how the attempt ended (`None`:
    /// cancelled), once.
    #[inline]
    pub(crate) fn end_attempt(&mut self, policy: &PolicyOf<T>, verdict: Option<Verdict>) {
        let settings = &policy.settings;
        if let (Some(ticket), Some(gate)) = (self.ticket.take(), &settings.gate) {
            gate.complete(&self.dependency, ticket, verdict, self.attempt_started);
        }
        if !(settings.attempt_hooks && self.sent) {
            return;
        }
        if settings.budget_admits
            && let Some(verdict) = verdict
        {
            settings.budget.observe(&self.dependency, &verdict);
        }
        if let Some(latency) = &settings.latency
            && self.learned
            && verdict == Some(Verdict::Success)
        {
            latency.record(&self.dependency, self.attempt_started.elapsed());
        }
    }

    /// Before an attempt: the budget's admission (client-side throttling) and the learned
    /// limit (the fixed one otherwise); `Err` refuses it, nothing sent.
    #[cold]
    #[inline(never)]
    fn before_attempt(&mut self, policy: &PolicyOf<T>) -> Result<Option<Duration>, BoxError> {
        let settings = &policy.settings;
        if settings.budget_admits {
            settings.budget.admit(&self.dependency)?;
        }
        let Some(latency) = settings.latency.as_ref().filter(|_| self.learned) else {
            return Ok(settings.attempt_timeout);
        };
        let limit = latency.timeout(&self.dependency, self.attempt);
        crate::obs::attempt_timeout(&self.dependency, limit);
        if let Some(span) = self.span.get() {
            span.record("attempt_timeout_ms", limit.as_millis() as u64);
        }
        Ok(Some(limit))
    }

    /// Records the attempt that ended with `verdict` and decides: another after a wait, or a
    /// stop (`None`: an outer layer owns the call, and decides).
    #[inline]
    pub(crate) fn decide(
        &mut self,
        policy: &PolicyOf<T>,
        verdict: Verdict,
    ) -> Result<Duration, Option<StopReason>> {
        if self.nested {
            return Err(None);
        }
        // A success stops the call without the rules (the common case, kept short).
        let decision = match verdict {
            Verdict::Success => Err(StopReason::Succeeded),
            verdict => self.rules(policy, verdict),
        };
        // A call that succeeds at once keeps no history.
        if verdict != Verdict::Success || !self.history.is_empty() {
            self.history.push(AttemptRecord {
                attempt: self.attempt,
                sent: self.sent,
                verdict,
                took: self.attempt_started.elapsed(),
                wait: decision.as_ref().ok().copied(),
            });
        }
        decision.map_err(Some)
    }

    /// The one exit of every call: its metrics, once, and its result with the history of its
    /// attempts, on the response or in the [`RetryError`] (`stopped` is `None` for a nested
    /// call: its raw result goes to the layer outside).
    #[inline]
    pub(crate) fn finish(
        &mut self,
        ended: Ended<Res<T>, Err<T>>,
        verdict: Verdict,
        stopped: Option<StopReason>,
    ) -> Result<Res<T>, BoxError> {
        let Some(stopped) = stopped else {
            return match ended {
                Ended::Inner(r) => r.map_err(Into::into),
                Ended::Own(e) => Err(e),
            };
        };
        // A first attempt that succeeded: no history to keep, the response as it is.
        if self.history.is_empty()
            && let Ended::Inner(Ok(res)) = ended
        {
            crate::obs::finished(&self.dependency, self.attempt, true, false);
            return Ok(res);
        }
        self.finish_with_history(ended, verdict, stopped)
    }

    /// [`finish`](Self::finish) for every other end: the history goes on the response or into
    /// the [`RetryError`].
    #[cold]
    #[inline(never)]
    fn finish_with_history(
        &mut self,
        ended: Ended<Res<T>, Err<T>>,
        verdict: Verdict,
        stopped: StopReason,
    ) -> Result<Res<T>, BoxError> {
        let attempts = std::mem::take(&mut self.history);
        let succeeded = stopped == StopReason::Succeeded;
        let unknown = !succeeded
            && attempts
                .iter()
                .any(|a| a.verdict.outcome() == Outcome::Unknown);
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
        let history = RetryHistory {
            dependency: self.dependency.clone(),
            attempts,
            elapsed: self.started.elapsed(),
            deadline: self.deadline.and_then(Deadline::length),
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

/// The verdict the classifiers give this layer's own error (timed out, no time left): one rule
/// for the layer and the layers further in.
fn own_verdict(error: &BoxError) -> Verdict {
    backstop_classify::classify_error(&**error).unwrap_or(Verdict::Fatal {
        outcome: Outcome::Unknown,
    })
}

/// Whether a Backstop layer further in refused the attempt before sending it (an open circuit,
/// a deadline already passed).
fn refused_before_sending(error: &(dyn std::error::Error + 'static)) -> bool {
    let d = Diagnosis::of(error);
    d.outcome == Some(Outcome::NotSent)
        && matches!(
            d.kind,
            Some(ErrorKind::Unavailable | ErrorKind::Throttled | ErrorKind::DeadlineExceeded)
        )
}

/// The attempt's span when a subscriber records it, boxed: the future every call moves keeps 8
/// bytes for it, against a `Span`'s 40, and a call no subscriber traces allocates nothing for it.
#[derive(Default)]
pub(crate) struct AttemptSpan(Option<Box<Span>>);

impl AttemptSpan {
    #[inline]
    fn new(dependency: &Dependency, attempt: u32) -> Self {
        let span = attempt_span(dependency, attempt);
        AttemptSpan((!span.is_disabled()).then(|| Box::new(span)))
    }

    /// The span, when it is recorded.
    #[inline]
    fn get(&self) -> Option<&Span> {
        self.0.as_deref()
    }
}

/// The attempt's span, inside whatever span is current (the call's). A resend carries
/// OpenTelemetry's `http.request.resend_count` (1 on the second attempt), as the HTTP semantic
/// conventions ask; the first attempt has none.
#[inline]
fn attempt_span(dependency: &Dependency, attempt: u32) -> Span {
    let span = tracing::debug_span!(
        target: "backstop::retry",
        "attempt",
        dependency = %dependency,
        attempt,
        http.request.resend_count = tracing::field::Empty,
        attempt_timeout_ms = tracing::field::Empty,
        // Recorded by an HTTP attempt layer inside (`backstop-otel`), as the HTTP semantic
        // conventions name them.
        otel.name = tracing::field::Empty,
        otel.kind = "client",
        http.request.method = tracing::field::Empty,
        server.address = tracing::field::Empty,
        server.port = tracing::field::Empty,
        url.full = tracing::field::Empty,
        http.response.status_code = tracing::field::Empty,
        error.type = tracing::field::Empty,
    );
    if attempt > 1 && !span.is_disabled() {
        span.record("http.request.resend_count", attempt - 1);
    }
    span
}
