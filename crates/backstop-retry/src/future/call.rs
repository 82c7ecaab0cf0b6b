//! One call's state between attempts, how an attempt begins, and the one exit of a call.

use super::{Ended, EndedWith, NOT_SENT};
use crate::{
    AttemptRecord, Diagnosis, ErrorKind, NotCopyable, Resend, RetryError, RetryHistory, StopReason,
    Ticket, layer::Policy,
};
use backstop_classify::Verdict;
use backstop_core::{BoxError, CallContext, Deadline, Dependency, HasExtensions, Outcome};
use backstop_timeout::AttemptCutoff;
use std::time::Duration;
use tokio::time::Instant;
use tower_service::Service;
use tracing::Span;

/// One call's state between attempts: what a call that succeeds at once builds, and no more.
pub(crate) struct Call<S, Req> {
    pub(super) svc: S,
    pub(super) template: Template<Req>,
    pub(super) dependency: Dependency,
    pub(super) deadline: Option<Deadline>,
    started: Instant,
    /// Attempts begun so far, the one in flight included.
    pub(super) attempt: u32,
    pub(super) attempt_started: Instant,
    /// Whether the current attempt was handed to the service (a gate refusal, a deadline that
    /// passed first or a service never ready is no attempt sent).
    pub(super) sent: bool,
    /// An outer retry layer owns retrying: this layer makes one attempt, still gated and timed,
    /// and hands the raw result back.
    pub(super) nested: bool,
    /// The gate's ticket for the attempt in flight.
    ticket: Option<Ticket>,
    /// When the attempt in flight is cut short, if it is.
    pub(super) cutoff: Option<AttemptCutoff>,
    /// The current attempt's span (disabled, and free, when nobody listens).
    pub(super) span: Span,
}

/// The caller's request, kept as the caller sent it: every attempt sends a copy.
pub(super) enum Template<Req> {
    /// One attempt only (`max_attempts` is 1, or an outer layer retries): nothing is kept.
    Unneeded,
    /// Kept for the copies.
    Kept(Req),
    /// It could not be copied, for this reason: the call has one attempt.
    Uncopyable(NotCopyable),
}

impl<Req> Template<Req> {
    /// Keeps `req` and returns a copy to send, or, when it cannot be copied, keeps why and
    /// returns `req` itself.
    #[inline(always)]
    pub(super) fn keep(&mut self, resend: &impl Resend<Req>, req: Req) -> Req {
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
    pub(super) fn kept(&self) -> Result<&Req, NotCopyable> {
        match self {
            Template::Kept(req) => Ok(req),
            Template::Uncopyable(why) => Err(why.clone()),
            Template::Unneeded => Err(NotCopyable::new("the request was not kept for a retry")),
        }
    }
}

impl<S, Req> Call<S, Req> {
    /// A call to `dependency` that has made no attempt yet.
    #[inline(always)]
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
            cutoff: None,
            span: Span::none(),
        }
    }

    /// When the call started.
    pub(super) fn started(&self) -> Instant {
        self.started
    }

    /// Tells the gate how the attempt it admitted ended (`None`: cancelled), once: every ticket
    /// goes back here.
    pub(super) fn end_attempt<C, P, H>(
        &mut self,
        policy: &Policy<C, P, H>,
        verdict: Option<Verdict>,
    ) {
        if let (Some(ticket), Some(gate)) = (self.ticket.take(), &policy.settings.gate) {
            gate.complete(&self.dependency, ticket, verdict, self.attempt_started);
        }
        if policy.settings.attempt_hooks && self.sent {
            self.after_attempt(policy, verdict);
        }
    }

    /// What the budget and the latency record learn from an attempt that was sent.
    #[cold]
    #[inline(never)]
    fn after_attempt<C, P, H>(&self, policy: &Policy<C, P, H>, verdict: Option<Verdict>) {
        let settings = &policy.settings;
        if settings.budget_admits
            && let Some(verdict) = verdict
        {
            settings.budget.observe(&self.dependency, &verdict);
        }
        if let Some(latency) = &settings.latency
            && verdict == Some(Verdict::Success)
        {
            latency.record(&self.dependency, self.attempt_started.elapsed());
        }
    }

    /// Before an attempt: its limit learned from latency (the fixed one otherwise), and the
    /// budget's admission (client-side throttling); `Err` refuses it, nothing sent.
    #[cold]
    #[inline(never)]
    fn before_attempt<C, P, H>(
        &mut self,
        policy: &Policy<C, P, H>,
    ) -> Result<Option<Duration>, BoxError> {
        let settings = &policy.settings;
        if settings.budget_admits {
            settings.budget.admit(&self.dependency)?;
        }
        let Some(latency) = &settings.latency else {
            return Ok(settings.attempt_timeout);
        };
        let limit = latency.timeout(&self.dependency, self.attempt);
        crate::obs::attempt_timeout(&self.dependency, limit);
        if !self.span.is_disabled() {
            self.span
                .record("attempt_timeout_ms", limit.as_millis() as u64);
        }
        Ok(Some(limit))
    }

    /// Counts the next attempt, begun at `now` and not sent yet.
    pub(super) fn next_attempt(&mut self, now: Instant) {
        self.attempt += 1;
        self.attempt_started = now;
        self.sent = false;
    }
}

impl<S, Req> Call<S, Req>
where
    S: Service<Req>,
    S::Error: Into<BoxError>,
    Req: HasExtensions,
{
    /// Begins the next attempt at `now`: checks the deadline, asks the gate, and only then makes
    /// the request (`req`: the first attempt's copy is made there, so a call the gate refuses
    /// copies nothing) and hands it to the service. `Err`: the attempt ended before it was sent.
    #[inline(always)]
    pub(super) fn begin<C, P, H>(
        &mut self,
        policy: &Policy<C, P, H>,
        now: Instant,
        parent: Option<&Span>,
        req: impl FnOnce(&mut Template<Req>) -> Req,
    ) -> Result<S::Future, EndedWith<S::Response, S::Error>> {
        self.next_attempt(now);
        self.span = attempt_span(parent, &self.dependency, self.attempt);
        // Client-side throttling and a learned limit, when there are: a throttle's refusal
        // holds no gate ticket.
        let limit = if policy.settings.attempt_hooks {
            match self.before_attempt(policy) {
                Ok(limit) => limit,
                Err(refused) => return Err((Ended::Own(refused), NOT_SENT)),
            }
        } else {
            policy.settings.attempt_timeout
        };
        self.cutoff = match AttemptCutoff::plan(now, limit, self.deadline) {
            Ok(cutoff) => cutoff,
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
        // carries no other extension pays for the map once per attempt, not twice). A leaf
        // client reads none of it.
        let mut req = req(&mut self.template);
        if !policy.settings.leaf {
            // A nested layer leaves the outer layer's attempt number in place.
            let attempt = (!self.nested).then_some(self.attempt);
            CallContext::claim(
                &mut req,
                crate::owner(),
                self.dependency.clone(),
                self.deadline,
            )
            .for_attempt(attempt, self.cutoff.map(|c| c.at));
        }
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

    /// The attempt's end when it did not succeed: the gate learns it, and an error by which a
    /// Backstop layer further in refused the attempt makes it one not sent.
    pub(super) fn ended<C, P, H>(
        &mut self,
        policy: &Policy<C, P, H>,
        result: Result<S::Response, S::Error>,
        verdict: Verdict,
    ) -> Ended<S::Response, S::Error> {
        self.end_attempt(policy, Some(verdict));
        match result {
            Err(e) if verdict == NOT_SENT => {
                let e: BoxError = e.into();
                if refused_before_sending(&*e) {
                    self.sent = false;
                }
                Ended::Own(e)
            }
            r => Ended::Inner(r),
        }
    }
}

impl<S, Req> Call<S, Req>
where
    S: Service<Req>,
    S::Error: Into<BoxError>,
    S::Response: HasExtensions,
{
    /// The one exit of a call that this layer owns, for a first attempt that succeeded: its
    /// metrics, and nothing kept (the response goes back as it is, so a call that succeeds at
    /// once allocates nothing for its history). Every other end passes [`finish`](Self::finish).
    #[inline]
    pub(super) fn finish_at_once(&self) {
        crate::obs::finished(&self.dependency, self.attempt, true, false);
    }

    /// The one exit of a call that this layer owns, for every end but a first attempt's
    /// success: its metrics, once, and its result with the history of every attempt, on the
    /// response or in the [`RetryError`].
    pub(super) fn finish(
        &self,
        attempts: Vec<AttemptRecord>,
        ended: Ended<S::Response, S::Error>,
        verdict: Verdict,
        stopped: StopReason,
    ) -> Result<S::Response, BoxError> {
        let succeeded = matches!(stopped, StopReason::Succeeded);
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

/// An attempt this layer ended itself (timed out, or no time left), with the verdict the
/// classifiers give that error everywhere else: one rule for the layer and the layers further
/// in.
pub(super) fn own_verdict(error: &BoxError) -> Verdict {
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
            Some(ErrorKind::Unavailable | ErrorKind::Throttled | ErrorKind::DeadlineExceeded)
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
            attempt_timeout_ms = tracing::field::Empty,
        ),
        _ => tracing::debug_span!(
            target: "backstop::retry",
            "attempt",
            dependency = %dependency,
            attempt,
            http.request.resend_count = tracing::field::Empty,
            attempt_timeout_ms = tracing::field::Empty,
        ),
    };
    if attempt > 1 && !span.is_disabled() {
        span.record("http.request.resend_count", attempt - 1);
    }
    span
}
