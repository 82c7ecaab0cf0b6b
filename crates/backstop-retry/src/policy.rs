//! The policy's part of a call, as tower's `Policy` is the retry future's: what it asks before
//! each attempt (the budget's admission, the learned limit), what it is told after each (the
//! gate, the budget, the latency record), and whether an attempt that did not end the call is
//! retried, and after what wait: every rule of the crate docs, in order.

use crate::{
    AttemptRecord, Resend, StopReason,
    future::Call,
    parts::{Policy, PolicyOf, Retryable},
};
use backstop_classify::{Classify, Verdict};
use backstop_core::{AttemptLimit, BoxError, Outcome, ReplaySafe, Run, UnvouchedKey};
use std::time::Duration;

impl<T: Retryable> Call<T> {
    /// Before an attempt: the budget's admission (client-side throttling) and the learned
    /// limit (the fixed one otherwise); `Err` refuses it, nothing sent.
    #[cold]
    #[inline(never)]
    pub(crate) fn before_attempt(
        &mut self,
        policy: &PolicyOf<T>,
    ) -> Result<Option<Duration>, BoxError> {
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

    /// The rules, in order: `Ok` is the wait before the next attempt, `Err` the first rule that
    /// stops the call.
    fn rules(
        &mut self,
        policy: &Policy<T::Classifier, T::Resend>,
        verdict: Verdict,
    ) -> Result<Duration, StopReason> {
        let (outcome, after) = match verdict {
            Verdict::Success => return Err(StopReason::Succeeded),
            Verdict::Fatal { .. } => return Err(StopReason::NotRetryable),
            Verdict::Retryable { outcome, after } => (outcome, after),
        };
        let settings = &policy.settings;
        let template = self.template.kept();
        // A request may carry a lower cap of its own (a destructive tool: one attempt).
        let max_attempts = match template.as_ref().ok().and_then(|t| AttemptLimit::of(*t)) {
            Some(limit) => limit.min(settings.max_attempts),
            None => settings.max_attempts,
        };
        if self.attempt >= max_attempts {
            return Err(StopReason::AttemptsExhausted { max_attempts });
        }
        let template = template.map_err(StopReason::NotCopyable)?;
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
                let (schedule, rng) = &mut **self.schedule.get_or_insert_with(|| {
                    Box::new((settings.backoff.schedule(), settings.rng.rng()))
                });
                schedule.next_delay(rng)
            }
        };
        if let Some(deadline) = self.deadline {
            let left = deadline.remaining();
            if wait >= left {
                return Err(StopReason::DeadlineTooClose { wait, left });
            }
        }
        // The run's budget first (its refusal takes nothing from the dependency's), then the
        // dependency's; a retry the dependency refuses goes back to the run.
        let run = Run::of(template);
        if let Some(run) = run
            && !run.take_retry(&self.dependency)
        {
            crate::obs::run_budget_refused(&self.dependency);
            return Err(StopReason::RunBudgetExhausted {
                retries: run.budget().unwrap_or(0),
            });
        }
        if !settings.budget.withdraw(&self.dependency) {
            if let Some(run) = run {
                run.give_back(&self.dependency);
            }
            crate::obs::budget_refused(&self.dependency);
            return Err(StopReason::BudgetExhausted);
        }
        if run.is_some() {
            crate::obs::run_retry(&self.dependency);
        }
        tracing::debug!(
            target: "backstop::retry",
            dependency = %self.dependency,
            run = run.map_or("", Run::id),
            attempt = self.attempt,
            outcome = outcome.as_str(),
            wait_ms = u64::try_from(wait.as_millis()).unwrap_or(u64::MAX),
            server_asked = after.is_some(),
            "retrying"
        );
        Ok(wait)
    }
}
