//! What an operator does to a run's steps, each recorded in the step's history with who and
//! why: send a failed step again ([`Operator::retry`](crate::Operator::retry)) or write the result the workflow
//! will see ([`Operator::stub`](crate::Operator::stub)). Either puts a failed run, or one waiting for a person,
//! back to pending, and a worker takes it from there.

use crate::{
    JournalError,
    journal::Journal,
    model::{Step, StepId, StepState},
    run::{RETRYABLE, RunState},
    steps::Change,
};

impl Journal {
    /// [`Operator::retry`](crate::Operator::retry).
    pub(crate) async fn retry_step(
        &self,
        id: &StepId,
        who: &str,
        why: &str,
    ) -> Result<Step, JournalError> {
        let step = self.operator_step(id).await?;
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
        let step = self
            .move_step(id, &[step.state], StepState::Pending, change, true)
            .await?;
        self.reopen_run(&id.run, who, &format!("step {id} sent again: {why}"))
            .await?;
        Ok(step)
    }

    /// [`Operator::stub`](crate::Operator::stub).
    pub(crate) async fn stub_step(
        &self,
        id: &StepId,
        result: &str,
        who: &str,
        why: &str,
    ) -> Result<Step, JournalError> {
        let step = self.operator_step(id).await?;
        if step.state.succeeded() || step.state == StepState::Compensated {
            return Err(JournalError::AlreadyDone(Box::new(step)));
        }
        let change = Change {
            result: Some(result.to_owned()),
            actor: Some(who.to_owned()),
            reason: Some(format!("stub: {why}")),
            ..Change::default()
        };
        let step = self
            .move_step(
                id,
                &[step.state],
                StepState::ReconciledSucceeded,
                change,
                true,
            )
            .await?;
        self.reopen_run(&id.run, who, &format!("step {id} stubbed: {why}"))
            .await?;
        Ok(step)
    }

    /// The step an operator names, when its run can still be steered.
    async fn operator_step(&self, id: &StepId) -> Result<Step, JournalError> {
        let step = self
            .step(id)
            .await?
            .ok_or_else(|| JournalError::NotFound(format!("step {id}")))?;
        if let Some(run) = self.run_record(&id.run).await?
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
