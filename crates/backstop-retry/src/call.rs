//! One call of the retry layer: the service whose readiness it holds, the kept request, each
//! attempt begun, judged and recorded, the decision asked of the policy, and the call's one end.

use crate::{
    Attempt, AttemptRecord, Error, NotCopyable, Policy, Resend, RetryHistory, StopReason,
    error::refused_before_sending,
    obs::AttemptSpan,
    parts::{EndOf, Fut, NOT_SENT, Res, Retryable, SharedOf},
    resend::Template,
};
use backstop_classify::{Classify, Verdict};

use backstop_core::{
    BoxError, CallContext, Claim, Deadline, DeadlineExceeded, Dependency, HasExtensions, Outcome,
    ReplaySafe, Run,
};
use std::{
    pin::Pin,
    sync::Arc,
    task::{Context, Poll, ready},
    time::Duration,
};
use tokio::time::{Instant, Sleep, sleep_until};
use tower_service::Service;
use tracing::Span;

/// One call: the service whose readiness it holds, the caller's request, and its attempts.
pub(crate) struct Call<T: Retryable> {
    pub(crate) svc: T::Svc,
    pub(crate) shared: Arc<SharedOf<T>>,
    /// The layer's policy, cloned for this call.
    pub(crate) policy: T::Policy,
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
    pub(crate) span: AttemptSpan,
    pub(crate) history: Vec<AttemptRecord>,
}

impl<T: Retryable> Call<T> {
    /// A call begun at `now`, to `dependency` on `svc`, the service polled ready for it.
    pub(crate) fn new(
        svc: T::Svc,
        shared: Arc<SharedOf<T>>,
        policy: T::Policy,
        dependency: Dependency,
        deadline: Option<Deadline>,
        nested: bool,
    ) -> Self {
        let now = Instant::now();
        Call {
            svc,
            shared,
            policy,
            template: Template::Unneeded,
            dependency,
            deadline,
            started: now,
            attempt: 0,
            attempt_started: now,
            sent: false,
            nested,
            span: AttemptSpan::default(),
            history: Vec::new(),
        }
    }

    /// Counts the next attempt, begun at `now` and not sent yet.
    pub(crate) fn begin_attempt(&mut self, now: Instant) {
        self.attempt += 1;
        self.attempt_started = now;
        self.sent = false;
    }

    /// Begins the next attempt at `now` on the ready service: the request (`req`), marked with
    /// the call's context and sent.
    pub(crate) fn begin(
        &mut self,
        now: Instant,
        req: impl FnOnce(&mut Template<T::Req>, &T::Resend) -> T::Req,
    ) -> Fut<T> {
        self.begin_attempt(now);
        self.span = AttemptSpan::new(&self.dependency, self.attempt);
        let shared = self.shared.clone();
        let mut req = req(&mut self.template, &shared.resend);
        // The call's context travels with each attempt's copy, across tasks and futures. A
        // nested layer leaves the outer layer's attempt number.
        let mut claim = Claim::new(crate::owner(), self.dependency.clone());
        if let Some(deadline) = self.deadline {
            claim = claim.deadline(deadline);
        }
        if !self.nested {
            claim = claim.attempt(self.attempt);
        }
        CallContext::claim(&mut req, claim);
        if self.attempt > 1 {
            crate::obs::retry(&self.dependency);
        }
        self.sent = true;
        // Named before the span is first entered, while OpenTelemetry's span can still be named.
        self.span.name_after(|| shared.resend.attempt_name(&req));
        // A span the service makes in its own `call` is the attempt's child.
        let _entered = self.span.get().map(Span::enter);
        self.svc.call(req)
    }

    /// Polls the attempt in flight to its end, and judges it.
    pub(crate) fn poll_attempt(
        &mut self,
        fut: Pin<&mut Fut<T>>,
        cx: &mut Context<'_>,
    ) -> Poll<EndOf<T>> {
        let result = {
            let _entered = self.span.get().map(Span::enter);
            ready!(fut.poll(cx))
        };
        let verdict = self.shared.classifier.classify(result.as_ref());
        let ended = result.map_err(Into::into);
        // A Backstop layer further in refused the attempt: it was not sent.
        if verdict == NOT_SENT
            && let Err(e) = &ended
        {
            self.sent &= !refused_before_sending(&**e);
        }
        Poll::Ready((ended, verdict))
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
        let error = DeadlineExceeded::new(Some(self.dependency.clone()), Outcome::NotSent);
        Poll::Ready(Err(Box::new(error.with_length(deadline.length()))))
    }

    /// The next attempt's copy of the kept request.
    pub(crate) fn copy(&self) -> Result<T::Req, NotCopyable> {
        (self.template.kept()).and_then(|req| self.shared.resend.copy(req))
    }

    /// Records the attempt that ended (`ended`, judged `verdict`) and asks the policy: another
    /// after a wait, or a stop (`None`: an outer layer owns the call, and decides). The one
    /// place a decision is told (the `retrying` event, the budgets' metrics).
    pub(crate) fn decide(
        &mut self,
        ended: &Result<Res<T>, BoxError>,
        verdict: Verdict,
    ) -> Result<Duration, Option<StopReason>> {
        if self.nested {
            return Err(None);
        }
        let resend = &self.shared.resend;
        let (request, copyable) = match &self.template {
            Template::Kept(req) => (Some(req), resend.check(req)),
            Template::Uncopyable(why) => (None, Err(why.clone())),
            Template::Unneeded => (None, Err(NotCopyable::new(Template::<T::Req>::NOT_KEPT))),
        };
        let classifier = &self.shared.classifier;
        let replay_safe =
            |req: &T::Req| ReplaySafe::is_marked(req) || classifier.is_replay_safe(req);
        let attempt = Attempt {
            request,
            copyable,
            result: ended.as_ref().map_err(|e| &**e),
            verdict,
            number: self.attempt,
            deadline: self.deadline,
            dependency: &self.dependency,
            started: self.started,
            replay_safe: &replay_safe,
        };
        let decision = self.policy.retry(&attempt);
        // The run is told only of a retry (the event's field and the run's metric).
        let run = (decision.is_ok())
            .then(|| request.and_then(Run::of))
            .flatten();
        crate::obs::decided(&self.dependency, &decision, self.attempt, verdict, run);
        // A call that succeeds at once keeps no history.
        if !(self.history.is_empty() && decision == Err(StopReason::Succeeded)) {
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
    /// attempts, on the response or in the [`Error`] (`stopped` is `None` for a nested call:
    /// its one attempt's result goes to the layer outside, which tells it).
    pub(crate) fn finish(
        &mut self,
        ended: Result<Res<T>, BoxError>,
        verdict: Verdict,
        stopped: Option<StopReason>,
    ) -> Result<Res<T>, Error> {
        let Some(stopped) = stopped else {
            return ended.map_err(|e| Error::new(Some(&self.dependency), e));
        };
        // A first attempt that succeeded: no history to keep, the response as it is.
        if self.history.is_empty()
            && let Ok(res) = ended
        {
            crate::obs::finished(&self.dependency, self.attempt, true, false);
            return Ok(res);
        }
        let history = RetryHistory {
            dependency: self.dependency.clone(),
            attempts: std::mem::take(&mut self.history),
            elapsed: self.started.elapsed(),
            deadline: self.deadline.and_then(Deadline::length),
            stopped,
        };
        crate::obs::stopped(&history, self.attempt, verdict);
        match ended {
            Ok(mut res) => {
                res.extensions_mut().insert(history);
                Ok(res)
            }
            Err(cause) => Err(Error::ended(history, verdict, cause)),
        }
    }
}
