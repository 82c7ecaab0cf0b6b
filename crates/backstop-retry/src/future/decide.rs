//! After an attempt that did not end the call at once: the one decision, another attempt after
//! a wait or a stop with its reason, by every rule of the crate docs in order.

use super::call::Call;
use crate::{AttemptRecord, Resend, StopReason, layer::Policy};
use backstop_backoff::Schedule;
use backstop_classify::{Classify, Verdict};
use backstop_core::{AttemptLimit, HasExtensions, Outcome, ReplaySafe, Run, UnvouchedKey};
use rand::rngs::SmallRng;
use std::time::Duration;
use tower_service::Service;

/// What comes after an attempt.
#[derive(Debug)]
pub(super) enum Decision {
    /// Another attempt, after this wait.
    Retry(Duration),
    /// No further attempt, for this reason.
    Stop(StopReason),
}

/// What a call that did not succeed at once keeps: its attempts so far and its backoff.
#[derive(Default)]
pub(super) struct Retries {
    pub(super) history: Vec<AttemptRecord>,
    schedule: Option<(Schedule, SmallRng)>,
}

impl Retries {
    /// Records the attempt that just ended with `verdict` and decides what comes next.
    pub(super) fn decide<S, Req, C, P, H>(
        &mut self,
        policy: &Policy<C, P, H>,
        call: &Call<S, Req>,
        verdict: Verdict,
    ) -> Decision
    where
        S: Service<Req>,
        Req: HasExtensions,
        C: Classify<Req, S::Response, S::Error>,
        P: Resend<Req>,
    {
        let took = call.attempt_started.elapsed();
        let decision = match self.rules(policy, call, verdict) {
            Ok(wait) => Decision::Retry(wait),
            Err(stopped) => Decision::Stop(stopped),
        };
        self.history.push(AttemptRecord {
            attempt: call.attempt,
            sent: call.sent,
            verdict,
            took,
            wait: match decision {
                Decision::Retry(wait) => Some(wait),
                Decision::Stop(_) => None,
            },
        });
        decision
    }

    /// The rules, in order; `Err` is the first that stops the call.
    fn rules<S, Req, C, P, H>(
        &mut self,
        policy: &Policy<C, P, H>,
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
}
