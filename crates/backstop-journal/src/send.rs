//! The path every step takes, in two writes: one records a step never seen before as `sent`
//! (with its `pending` and `sent` history rows and its run's touch), the other records how the
//! call ended (with its history row and the run's touch). Each is one write of the store's
//! (one statement on PostgreSQL, one transaction on SQLite). Everything else (a resumed step,
//! an operator's repair) takes the general path of [`Journal::transition`].

use crate::{
    JournalError,
    journal::Journal,
    model::{NewStep, Step, StepId, StepState},
    steps::Change,
};

impl Journal {
    /// Records `new`, never seen before, as `sent` in one write: `Some(step)` to send. `None`
    /// when a step with its ids is recorded already (a resumed run, or a different call under
    /// the same ids): nothing is written, and the caller reads it and decides.
    pub(crate) async fn send_new(&self, new: &NewStep) -> Result<Option<Step>, JournalError> {
        let step = self.store.send_new(new, self.now_ms()).await?;
        if let Some(step) = &step {
            crate::obs::transition(step, StepState::Pending, 0);
        }
        Ok(step)
    }

    /// Records how sent step `id` ended, as `to` with `change`, in one write. `None` when it is
    /// not `sent` (an operator or another worker moved it): nothing is written.
    pub(crate) async fn finish_sent(
        &self,
        id: &StepId,
        to: StepState,
        change: &Change,
    ) -> Result<Option<Step>, JournalError> {
        let now = self.now_ms();
        let step = self.store.finish_sent(id, to, change, now).await?;
        if let Some(step) = &step {
            let sent_for = step
                .sent_at
                .map_or(0, |sent| now - crate::journal::millis(sent));
            crate::obs::transition(step, StepState::Sent, sent_for);
        }
        Ok(step)
    }
}
