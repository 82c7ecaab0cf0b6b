//! Running a step through the journal: recorded before it is sent, `sent` written before the
//! call, then what came of it; a compensation, a park, a result recorded from outside. Resuming
//! a run after a crash is in `reconcile.rs`.

use crate::{
    JournalError,
    journal::Journal,
    model::{NewStep, Step, StepId, StepState},
    reconcile::Next,
    steps::Change,
};
use backstop_core::Outcome;
use std::{fmt, future::Future, time::Duration};

/// How a call ended, as the journal records it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum CallResult {
    /// The dependency did it.
    Succeeded {
        /// What it answered, to store and return on resume (JSON, say).
        result: Option<String>,
        /// Its own reference for what it did (a message id, an order number).
        provider_ref: Option<String>,
    },
    /// It failed, and this much is known of the side effect.
    Failed {
        /// Not sent (safe to send again), unknown (reconcile first) or completed (final).
        outcome: Outcome,
        /// The error, in words.
        error: String,
        /// When the dependency can be tried again, if it said (an open circuit, a
        /// `Retry-After`): a step not sent parks until then.
        retry_after: Option<Duration>,
    },
}

impl CallResult {
    /// The result of a call whose error reports its outcome (every Backstop error does).
    pub fn from_result<T, E>(
        result: &Result<T, E>,
        stored: impl FnOnce(&T) -> Option<String>,
    ) -> Self
    where
        E: backstop_core::ReportsOutcome + fmt::Display,
    {
        match result {
            Ok(value) => CallResult::Succeeded {
                result: stored(value),
                provider_ref: None,
            },
            Err(e) => CallResult::Failed {
                outcome: e.outcome(),
                error: e.to_string(),
                retry_after: e.retry_after(),
            },
        }
    }
}

/// Whether a step is to be sent.
pub(crate) enum ToSend {
    /// Sent: call it.
    Send(Step),
    /// Over: its stored result stands.
    Done(Step),
    /// Parked until its time.
    Parked(Step),
}

impl Journal {
    /// Runs one step through the journal: records it (`pending`), writes `sent` before
    /// calling, then what came of it. A step already over returns as it is, without calling
    /// (its stored result is in [`Step::result`]); a step whose outcome is unknown is refused
    /// ([`JournalError::NeedsReconciliation`]); a parked step not due yet returns parked.
    ///
    /// The step `id` calls `tool` with `args`: the key every attempt sends ([`Step::key`]) is
    /// derived from the ids, and a different tool or arguments under a recorded step's ids is
    /// refused ([`JournalError::ArgsChanged`]).
    pub async fn execute<F, Fut>(
        &self,
        id: &StepId,
        tool: &str,
        args: &[u8],
        call: F,
    ) -> Result<Step, JournalError>
    where
        F: FnOnce(Step) -> Fut,
        Fut: Future<Output = CallResult>,
    {
        self.execute_new(&NewStep::action(id, tool, args), call)
            .await
    }

    /// [`execute`](Self::execute) for a step described in full (an action or a compensation).
    pub(crate) async fn execute_new<F, Fut>(
        &self,
        new: &NewStep,
        call: F,
    ) -> Result<Step, JournalError>
    where
        F: FnOnce(Step) -> Fut,
        Fut: Future<Output = CallResult>,
    {
        match self.to_send(new).await? {
            ToSend::Send(sent) => {
                let result = call(sent).await;
                self.record(&new.id, result).await
            }
            ToSend::Done(step) | ToSend::Parked(step) => Ok(step),
        }
    }

    /// Makes `new` ready to send: a step never seen before is recorded as sent in one write;
    /// a recorded one is read and sent again only when the journal says so (not sent, or
    /// known not to have happened). A step whose outcome is unknown is refused.
    pub(crate) async fn to_send(&self, new: &NewStep) -> Result<ToSend, JournalError> {
        if let Some(sent) = self.send_new(new).await? {
            return Ok(ToSend::Send(sent));
        }
        let step = self.begin(new).await?;
        match Next::for_step(&step, self.now()) {
            Next::Done => {
                crate::obs::duplicate_prevented(&step);
                Ok(ToSend::Done(step))
            }
            Next::Wake { .. } => Ok(ToSend::Parked(step)),
            Next::Reconcile | Next::Human { .. } => {
                Err(JournalError::NeedsReconciliation(Box::new(step)))
            }
            Next::Resend => {
                let sent = self
                    .transition(&step.id, &[step.state], StepState::Sent, Change::attempt())
                    .await?;
                Ok(ToSend::Send(sent))
            }
        }
    }

    /// Undoes an action that succeeded, deliberately: the compensation is a step of its own
    /// (`<step>:compensate`, its own key, its own states, run through [`execute`](Self::execute)
    /// and so resumable like any step), and once it succeeds the action is marked
    /// `compensated`. An action that did not succeed is refused: there is nothing to undo.
    pub async fn compensate<F, Fut>(
        &self,
        action: &StepId,
        tool: &str,
        args: &[u8],
        call: F,
    ) -> Result<Step, JournalError>
    where
        F: FnOnce(Step) -> Fut,
        Fut: Future<Output = CallResult>,
    {
        let done = [StepState::Succeeded, StepState::ReconciledSucceeded];
        let original = self
            .runs()
            .step(action)
            .await?
            .ok_or_else(|| JournalError::NotFound(format!("step {action}")))?;
        if original.state == StepState::Compensated {
            return Ok(original);
        }
        if !done.contains(&original.state) {
            return Err(JournalError::Conflict {
                id: action.clone(),
                expected: done.to_vec(),
                found: Some(original.state),
                to: StepState::Compensated,
            });
        }
        let undo = NewStep::compensation_of(action, tool, args);
        let undone = self.execute_new(&undo, call).await?;
        if !undone.state.succeeded() {
            return Ok(undone);
        }
        let change = Change {
            reason: Some(format!("compensated by step {}", undone.id)),
            ..Change::default()
        };
        self.transition(action, &done, StepState::Compensated, change)
            .await
    }

    /// Records how a sent step's call ended.
    pub(crate) async fn record(
        &self,
        id: &StepId,
        result: CallResult,
    ) -> Result<Step, JournalError> {
        match result {
            CallResult::Succeeded {
                result,
                provider_ref,
            } => {
                let change = Change {
                    result,
                    provider_ref,
                    ..Change::default()
                };
                let step = self.outcome(id, StepState::Succeeded, change).await?;
                crate::obs::succeeded(&step);
                Ok(step)
            }
            CallResult::Failed {
                outcome,
                error,
                retry_after,
            } => {
                let to = match outcome {
                    Outcome::NotSent => StepState::FailedBeforeExecution,
                    Outcome::Completed => StepState::FailedAfterExecution,
                    Outcome::Unknown => StepState::Unknown,
                };
                let change = Change {
                    error: Some(error),
                    ..Change::default()
                };
                let step = self.outcome(id, to, change).await?;
                if to == StepState::Unknown {
                    crate::obs::unknown(&step);
                }
                match retry_after {
                    // The dependency said when: park on a durable timer instead of spinning.
                    Some(after) if to == StepState::FailedBeforeExecution => {
                        self.park(id, after).await
                    }
                    _ => Ok(step),
                }
            }
        }
    }

    /// Sent step `id` ended as `to`: one write, or the general move's refusal when the step is
    /// not `sent` any more.
    async fn outcome(
        &self,
        id: &StepId,
        to: StepState,
        change: Change,
    ) -> Result<Step, JournalError> {
        match self.finish_sent(id, to, &change).await? {
            Some(step) => Ok(step),
            None => self.transition(id, &[StepState::Sent], to, change).await,
        }
    }

    /// Parks a step that was not sent until `after` from now.
    pub async fn park(&self, id: &StepId, after: Duration) -> Result<Step, JournalError> {
        let at = crate::journal::millis(crate::journal::later(self.now(), after));
        self.transition(
            id,
            &[StepState::Pending, StepState::FailedBeforeExecution],
            StepState::Parked,
            Change {
                park_until: Some(at),
                ..Change::default()
            },
        )
        .await
    }
}
