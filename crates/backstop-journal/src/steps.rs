//! The steps' journal: each step recorded, moved from state to state with compare-and-set in a
//! transaction with its history row, read back, and repaired by an operator.

use crate::{
    JournalError, Operator, Runs,
    journal::{CallIdentity, Journal},
    model::{NewStep, Resolution, Step, StepId, StepState, StepTransition},
    store::StepMove,
};

/// What a transition writes besides the state.
#[derive(Clone, Debug, Default)]
pub(crate) struct Change {
    /// Count one more attempt.
    pub(crate) attempt: bool,
    /// The error that caused it.
    pub(crate) error: Option<String>,
    /// The result to store.
    pub(crate) result: Option<String>,
    /// The provider's reference.
    pub(crate) provider_ref: Option<String>,
    /// When a parked step wakes.
    pub(crate) park_until: Option<i64>,
    /// Why it needs a person (cleared when `None`).
    pub(crate) attention: Option<String>,
    /// Who: `journal` unless an operator.
    pub(crate) actor: Option<String>,
    /// Why, in words.
    pub(crate) reason: Option<String>,
}

impl Change {
    /// One more attempt, nothing else: what a move to `sent` writes.
    pub(crate) fn attempt() -> Self {
        Change {
            attempt: true,
            ..Change::default()
        }
    }
}

impl Journal {
    /// Records `new` as `pending`, or returns the step already recorded under its ids (a
    /// resumed run). A step recorded with other arguments is refused.
    pub(crate) async fn begin(&self, new: &NewStep) -> Result<Step, JournalError> {
        let now = self.now_ms();
        let id = &new.id;
        let inserted = self.store.insert_step(new, now).await?;
        let step = self
            .runs()
            .step(id)
            .await?
            .ok_or_else(|| JournalError::NotFound(format!("step {id}")))?;
        if !inserted && (step.args_digest != new.args_digest || step.tool != new.tool) {
            return Err(JournalError::ArgsChanged {
                id: id.clone(),
                recorded: Box::new(CallIdentity {
                    tool: step.tool,
                    args_digest: step.args_digest,
                }),
                refused: Box::new(CallIdentity {
                    tool: new.tool.clone(),
                    args_digest: new.args_digest.clone(),
                }),
            });
        }
        Ok(step)
    }

    /// Moves step `id` from one of `from` to `to`, writing `change` and a history row in one
    /// transaction. Refused (nothing written) when the step is elsewhere, or when the journal
    /// does not allow the move ([`StepState::can_move_to`]); only an operator's repair
    /// ([`resolve`](Self::resolve)) goes further.
    pub(crate) async fn transition(
        &self,
        id: &StepId,
        from: &[StepState],
        to: StepState,
        change: Change,
    ) -> Result<Step, JournalError> {
        self.move_step(id, from, to, change, false).await
    }

    /// [`transition`](Self::transition), and with `repair` any move (an operator's repair, or
    /// the journal handing a step to a person, which keeps its state).
    pub(crate) async fn move_step(
        &self,
        id: &StepId,
        from: &[StepState],
        to: StepState,
        change: Change,
        repair: bool,
    ) -> Result<Step, JournalError> {
        let now = self.now_ms();
        let conflict = |found: Option<StepState>| JournalError::Conflict {
            id: id.clone(),
            expected: from.to_vec(),
            found,
            to,
        };
        let current = self.runs().step(id).await?.ok_or_else(|| conflict(None))?;
        if !from.contains(&current.state) || (!repair && !current.state.can_move_to(to)) {
            return Err(conflict(Some(current.state)));
        }
        let attempts = current.attempts.saturating_add(u32::from(change.attempt));
        let step_move = StepMove {
            id,
            from: current.state,
            to,
            attempts,
            change: &change,
        };
        let moved = self.store.update_step(&step_move, now).await?;
        let step = self.runs().step(id).await?.ok_or_else(|| conflict(None))?;
        if !moved {
            // Another worker moved it between the read and the write.
            return Err(conflict(Some(step.state)));
        }
        let in_previous = now - crate::journal::millis(current.updated_at);
        crate::obs::transition(&step, current.state, in_previous);
        Ok(step)
    }

    /// Gives `run` back (only `worker`'s own claim).
    pub(crate) async fn release(&self, run: &str, worker: &str) -> Result<(), JournalError> {
        self.store.release(run, worker).await
    }
}

impl Runs<'_> {
    /// Every step of `run`, in the order they were recorded.
    pub async fn steps(self, run: &str) -> Result<Vec<Step>, JournalError> {
        let journal = self.0;
        journal.store.steps(run).await
    }

    /// Every recorded transition of every step of `run`, oldest first, in one query.
    pub async fn history(self, run: &str) -> Result<Vec<StepTransition>, JournalError> {
        let journal = self.0;
        journal.store.transitions(run, None).await
    }

    /// The step recorded under `id`.
    pub async fn step(self, id: &StepId) -> Result<Option<Step>, JournalError> {
        let journal = self.0;
        journal.store.step(id).await
    }

    /// Every recorded transition of step `id`, oldest first.
    pub async fn step_history(self, id: &StepId) -> Result<Vec<StepTransition>, JournalError> {
        let journal = self.0;
        journal.store.transitions(&id.run, Some(id)).await
    }

    /// Steps waiting for a person, and parked steps (with when they wake).
    pub async fn stuck(self) -> Result<Vec<Step>, JournalError> {
        let journal = self.0;
        journal.store.stuck().await
    }
}

impl Operator<'_> {
    /// An operator's repair of a step that is not over, recorded with `who` and `why`.
    pub async fn resolve(
        self,
        id: &StepId,
        resolution: Resolution,
        who: &str,
        why: &str,
    ) -> Result<Step, JournalError> {
        let journal = self.0;
        let step = journal
            .runs()
            .step(id)
            .await?
            .ok_or_else(|| JournalError::NotFound(format!("step {id}")))?;
        if step.state.is_final() {
            return Err(JournalError::Conflict {
                id: id.clone(),
                expected: StepState::ALL
                    .into_iter()
                    .filter(|s| !s.is_final())
                    .collect(),
                found: Some(step.state),
                to: match resolution {
                    Resolution::Succeeded { .. } => StepState::ReconciledSucceeded,
                    Resolution::Failed => StepState::ReconciledFailed,
                    Resolution::Retry => StepState::Pending,
                },
            });
        }
        let (to, result) = match resolution {
            Resolution::Succeeded { result } => (StepState::ReconciledSucceeded, result),
            Resolution::Failed => (StepState::ReconciledFailed, None),
            Resolution::Retry => (StepState::Pending, None),
        };
        let change = Change {
            result,
            actor: Some(who.to_owned()),
            reason: Some(why.to_owned()),
            ..Change::default()
        };
        let step = journal
            .move_step(id, &[step.state], to, change, true)
            .await?;
        journal
            .reopen_run(&id.run, who, &format!("step {id} resolved: {why}"))
            .await?;
        Ok(step)
    }
}
