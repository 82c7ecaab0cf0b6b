//! The journal by audience: [`Runs`], what anyone may read (runs, their steps and histories),
//! and [`Operator`], what an operator does to a run or a step, each recorded with who and why.
//! A workflow's author needs neither: [`Workflow`](crate::Workflow), the
//! [`Worker`](crate::Worker) and [`RunContext`](crate::RunContext) are theirs.

use crate::{
    Journal, JournalError, Resolution, RunEvent, RunFilter, RunRecord, RunSummary, Step, StepId,
    StepTransition,
};

impl Journal {
    /// Reads: runs, their steps, their histories, what is stuck.
    pub fn runs(&self) -> Runs<'_> {
        Runs(self)
    }

    /// An operator's actions: cancel, fork, resolve, retry, stub.
    pub fn operator(&self) -> Operator<'_> {
        Operator(self)
    }
}

/// What anyone may read of a journal: from [`Journal::runs`].
#[derive(Clone, Copy, Debug)]
pub struct Runs<'a>(&'a Journal);

impl Runs<'_> {
    /// The most recently changed runs that `filter` selects (in a state, of a workflow), at
    /// most its limit, in one query: the filter is applied before the limit, so a workflow's
    /// runs are found however many runs of other workflows changed since.
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() {
    /// use backstop_journal::{Journal, RunFilter, RunState};
    ///
    /// let journal = Journal::in_memory().await.unwrap();
    /// let failed_refunds = RunFilter::latest(20)
    ///     .state(RunState::Failed)
    ///     .workflow("refund");
    /// assert!(journal.runs().list(&failed_refunds).await.unwrap().is_empty());
    /// # }
    /// ```
    pub async fn list(self, filter: &RunFilter) -> Result<Vec<RunSummary>, JournalError> {
        self.0.list_runs(filter).await
    }

    /// The record of run `run`.
    pub async fn get(self, run: &str) -> Result<Option<RunRecord>, JournalError> {
        self.0.run_record(run).await
    }

    /// What happened to run `run`, oldest first.
    pub async fn events(self, run: &str) -> Result<Vec<RunEvent>, JournalError> {
        self.0.run_events(run).await
    }

    /// Every step of `run`, in the order they were recorded.
    pub async fn steps(self, run: &str) -> Result<Vec<Step>, JournalError> {
        self.0.run(run).await
    }

    /// Every recorded transition of every step of `run`, oldest first, in one query.
    pub async fn history(self, run: &str) -> Result<Vec<StepTransition>, JournalError> {
        self.0.run_history(run).await
    }

    /// The runs forked from run `run`, oldest first.
    pub async fn forks(self, run: &str) -> Result<Vec<RunRecord>, JournalError> {
        self.0.forks(run).await
    }

    /// The step recorded under `id`.
    pub async fn step(self, id: &StepId) -> Result<Option<Step>, JournalError> {
        self.0.step(id).await
    }

    /// Every recorded transition of step `id`, oldest first.
    pub async fn step_history(self, id: &StepId) -> Result<Vec<StepTransition>, JournalError> {
        self.0.history(id).await
    }

    /// Steps waiting for a person, and parked steps (with when they wake).
    pub async fn stuck(self) -> Result<Vec<Step>, JournalError> {
        self.0.stuck().await
    }
}

/// What an operator does to a journal's runs and steps, each recorded with who and why: from
/// [`Journal::operator`].
#[derive(Clone, Copy, Debug)]
pub struct Operator<'a>(&'a Journal);

impl Operator<'_> {
    /// An operator cancels `run` (pending or waiting for a person), recorded with `who` and
    /// `why`: no worker runs it again, and the worker running it stops at its next lease
    /// renewal. A run that is over is refused.
    pub async fn cancel(self, run: &str, who: &str, why: &str) -> Result<RunRecord, JournalError> {
        self.0.cancel_run(run, who, why).await
    }

    /// Forks run `run` at step `from_step` into a new pending run `new_run` of the same
    /// workflow and input, recorded with who and why on both runs; a [`Worker`] runs it.
    ///
    /// The steps recorded before `from_step` (in the order they were recorded) are copied with
    /// their state, result, provider reference and key: the workflow gets their results back
    /// and calls nothing for them. `from_step` and every step after it are not copied: they run
    /// anew, with keys derived from `new_run`, so their effects happen again (once each).
    /// The original keeps its steps and history; its events name the fork, and the new run's
    /// record names where it came from ([`RunRecord::forked_from`], [`Runs::forks`](crate::Runs::forks)).
    ///
    /// Refused, with the reason and nothing written, when `run` is still pending or waits for
    /// a person (it could still act: cancel it first), when it has no step `from_step`, when
    /// a step before the fork point is not over (its outcome must be known before the new
    /// run relies on it), and when `new_run` is another run already. Forking again with the
    /// same arguments returns the fork as it is, so an operator whose command was cut off may
    /// repeat it.
    ///
    /// The copied steps keep their arguments' digests: a workflow whose arguments name its own
    /// run id gets [`JournalError::ArgsChanged`] at the first copied step.
    ///
    /// [`Worker`]: crate::Worker
    pub async fn fork(
        self,
        run: &str,
        from_step: &str,
        new_run: &str,
        who: &str,
        why: &str,
    ) -> Result<RunRecord, JournalError> {
        self.0.fork_run(run, from_step, new_run, who, why).await
    }

    /// An operator's repair of a step that is not over, recorded with `who` and `why`.
    pub async fn resolve(
        self,
        id: &StepId,
        resolution: Resolution,
        who: &str,
        why: &str,
    ) -> Result<Step, JournalError> {
        self.0.resolve(id, resolution, who, why).await
    }

    /// Sends step `id` again, with the same key: a step that failed (before or after
    /// execution, or by reconciliation), a parked one now, or one waiting for a person. The
    /// step goes back to `pending`, and its run to pending. A step that succeeded, or one
    /// whose outcome is unknown and not yet handed to a person (reconcile it first), is
    /// refused, as is a step of a cancelled run.
    pub async fn retry(self, id: &StepId, who: &str, why: &str) -> Result<Step, JournalError> {
        self.0.retry_step(id, who, why).await
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
        self.0.stub_step(id, result, who, why).await
    }
}
