//! Whether an attempt that did not end the call is retried, and after what wait: every rule of
//! the crate docs, in order.

use crate::{
    Resend, StopReason,
    call::Call,
    parts::{Policy, Retryable},
};
use backstop_classify::{Classify, Verdict};
use backstop_core::{AttemptLimit, Outcome, ReplaySafe, Run, UnvouchedKey};
use std::time::Duration;

impl<T: Retryable> Call<T> {
    /// The rules, in order: `Ok` is the wait before the next attempt, `Err` the first rule that
    /// stops the call.
    pub(crate) fn rules(
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
