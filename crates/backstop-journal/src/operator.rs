//! What an operator does to a run's steps, each recorded in the step's history with who and
//! why: send a failed step again ([`Operator::retry`]) or write the result the workflow will see
//! ([`Operator::stub`]). Either puts a failed run, or one waiting for a person, back to
//! pending, and a worker takes it from there.

use crate::{
    JournalError, Operator,
    journal::Journal,
    model::{Step, StepId, StepState},
    run::{RETRYABLE, RunState},
    steps::Change,
};

impl Journal {
    /// The step an operator names, when its run can still be steered.
    async fn operator_step(&self, id: &StepId) -> Result<Step, JournalError> {
        let step = self
            .runs()
            .step(id)
            .await?
            .ok_or_else(|| JournalError::NotFound(format!("step {id}")))?;
        if let Some(run) = self.runs().get(&id.run).await?
            && matches!(run.state, RunState::Cancelled | RunState::Succeeded)
        {
            return Err(JournalError::RunRefused {
                run: run.id,
                why: format!("it is {}: its steps are not sent again", run.state),
            });
        }
        Ok(step)
    }
}

impl Operator<'_> {
    /// Sends step `id` again, with the same key: a step that failed (before or after
    /// execution, or by reconciliation), a parked one now, or one waiting for a person. The
    /// step goes back to `pending`, and its run to pending. A step that succeeded, or one
    /// whose outcome is unknown and not yet handed to a person (reconcile it first), is
    /// refused, as is a step of a cancelled run.
    pub async fn retry(self, id: &StepId, who: &str, why: &str) -> Result<Step, JournalError> {
        let journal = self.0;
        let step = journal.operator_step(id).await?;
        if !(RETRYABLE.contains(&step.state) || step.attention.is_some()) {
            let mut expected = RETRYABLE.to_vec();
            expected.push(StepState::RequiresReconciliation);
            return Err(JournalError::Conflict {
                id: id.clone(),
                expected,
                found: Some(step.state),
                to: StepState::Pending,
            });
        }
        let change = Change {
            actor: Some(who.to_owned()),
            reason: Some(format!("retry: {why}")),
            ..Change::default()
        };
        let step = journal
            .move_step(id, &[step.state], StepState::Pending, change, true)
            .await?;
        journal
            .reopen_run(&id.run, who, &format!("step {id} sent again: {why}"))
            .await?;
        Ok(step)
    }

    /// Writes `result` as step `id`'s result, as if it had succeeded: the workflow sees it and
    /// does not call the tool. Any step not succeeded may be stubbed (one in flight too: the
    /// worker's own record of it is then refused, and the stub stands). Its run goes back to
    /// pending.
    pub async fn stub(
        self,
        id: &StepId,
        result: &str,
        who: &str,
        why: &str,
    ) -> Result<Step, JournalError> {
        let journal = self.0;
        let step = journal.operator_step(id).await?;
        if step.state.succeeded() || step.state == StepState::Compensated {
            return Err(JournalError::AlreadyDone(Box::new(step)));
        }
        let change = Change {
            result: Some(result.to_owned()),
            actor: Some(who.to_owned()),
            reason: Some(format!("stub: {why}")),
            ..Change::default()
        };
        let step = journal
            .move_step(
                id,
                &[step.state],
                StepState::ReconciledSucceeded,
                change,
                true,
            )
            .await?;
        journal
            .reopen_run(&id.run, who, &format!("step {id} stubbed: {why}"))
            .await?;
        Ok(step)
    }
}
