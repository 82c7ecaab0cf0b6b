//! A run under a worker's claim: claimed once its lease runs out, its lease renewed, and given
//! back finished, deferred, to a person or cancelled, each move one guarded statement with its
//! event ([`RunMove`]).

use crate::{
    JournalError, Operator,
    journal::Journal,
    run::{RunOutcome, RunRecord, RunState},
    store::{NextClaim, RunMove},
};
use chrono::{DateTime, Utc};
use std::time::Duration;

/// The end of a lease taken at `now`, as the store keeps times.
fn lease_end(now: DateTime<Utc>, lease: Duration) -> i64 {
    crate::journal::millis(crate::journal::later(now, lease))
}

impl Journal {
    /// Claims, among the runs of `workflows` (what a worker can run), the pending run that has
    /// waited longest of those free to run: no live claim (a lease that ran out is free) and no
    /// wake-up time still to come. On PostgreSQL the row is picked `FOR UPDATE SKIP LOCKED`, so
    /// workers claiming at the same moment take different runs.
    pub(crate) async fn claim_next(
        &self,
        worker: &str,
        lease: Duration,
        workflows: &[&str],
    ) -> Result<Option<String>, JournalError> {
        if workflows.is_empty() {
            return Ok(None);
        }
        let now = self.now();
        let claim = NextClaim {
            worker,
            until: lease_end(now, lease),
            now: crate::journal::millis(now),
            workflows,
        };
        self.store.claim_next(&claim).await
    }

    /// Extends `worker`'s lease on `run`: `false` when the worker no longer holds it (another
    /// worker claimed it after the lease ran out) or the run is no longer pending (an operator
    /// cancelled it): the worker stops running it.
    pub(crate) async fn renew(
        &self,
        run: &str,
        worker: &str,
        lease: Duration,
    ) -> Result<bool, JournalError> {
        let until = lease_end(self.now(), lease);
        self.store.renew(run, worker, until).await
    }

    /// Finishes `run` as `outcome` says: only a pending run, and only by the worker holding it
    /// (or by anyone when nobody does). Its claim goes with it.
    pub(crate) async fn finish_run(
        &self,
        run: &str,
        worker: &str,
        outcome: RunOutcome,
    ) -> Result<RunRecord, JournalError> {
        let (to, output, error) = match outcome {
            RunOutcome::Succeeded { output } => (RunState::Succeeded, output, None),
            RunOutcome::Failed { error } => (RunState::Failed, None, Some(error)),
        };
        let reason = error.clone();
        self.end_claim(
            run,
            worker,
            RunMove {
                output,
                error,
                reason,
                action: Some(to.as_str()),
                ..RunMove::new(to, &[RunState::Pending], worker)
            },
        )
        .await
    }

    /// Hands `run` to a person: no worker runs it until an operator resolves, retries or stubs
    /// the step that stopped it.
    pub(crate) async fn run_needs_human(
        &self,
        run: &str,
        worker: &str,
        why: &str,
    ) -> Result<RunRecord, JournalError> {
        self.end_claim(
            run,
            worker,
            RunMove {
                error: Some(why.to_owned()),
                reason: Some(why.to_owned()),
                action: Some("needs_human"),
                ..RunMove::new(RunState::NeedsHuman, &[RunState::Pending], worker)
            },
        )
        .await
    }

    /// Gives `run` back, pending, not to be claimed before `wake`: a parked step's timer, or a
    /// step that was not sent and is tried again later.
    pub(crate) async fn defer_run(
        &self,
        run: &str,
        worker: &str,
        wake: DateTime<Utc>,
        why: &str,
    ) -> Result<RunRecord, JournalError> {
        self.end_claim(
            run,
            worker,
            RunMove {
                error: Some(why.to_owned()),
                wake_ms: Some(crate::journal::millis(wake)),
                ..RunMove::new(RunState::Pending, &[RunState::Pending], worker)
            },
        )
        .await
    }

    /// `change` by the worker holding `run`, which gives its claim back with it.
    async fn end_claim(
        &self,
        run: &str,
        worker: &str,
        change: RunMove<'_>,
    ) -> Result<RunRecord, JournalError> {
        let moved = self.move_run(run, change).await?;
        let found = self.existing_run(run).await?;
        if moved {
            return Ok(found);
        }
        let why = match &found.claimed_by {
            _ if found.state != RunState::Pending => format!("it is {}, not pending", found.state),
            Some(other) => format!("worker {other} holds it, not {worker}"),
            None => "it changed meanwhile".to_owned(),
        };
        Err(JournalError::RunRefused {
            run: run.to_owned(),
            why,
        })
    }

    /// Puts a failed run, or one waiting for a person, back to pending once none of its steps
    /// waits for a person: what an operator's repair of a step does to its run. A run pending
    /// already, or succeeded or cancelled, is left as it is.
    pub(crate) async fn reopen_run(
        &self,
        run: &str,
        who: &str,
        why: &str,
    ) -> Result<bool, JournalError> {
        self.move_run(
            run,
            RunMove {
                holder: None,
                unless_attention: true,
                reason: Some(why.to_owned()),
                action: Some("reopened"),
                ..RunMove::new(
                    RunState::Pending,
                    &[RunState::Failed, RunState::NeedsHuman],
                    who,
                )
            },
        )
        .await
    }

    /// Marks `run` as waiting for a person because one of its steps does (the journal handed
    /// the step over), unless it is over.
    pub(crate) async fn run_waits_for_person(
        &self,
        run: &str,
        why: &str,
    ) -> Result<(), JournalError> {
        self.move_run(
            run,
            RunMove {
                holder: None,
                error: Some(why.to_owned()),
                reason: Some(why.to_owned()),
                action: Some("needs_human"),
                ..RunMove::new(RunState::NeedsHuman, &[RunState::Pending], "journal")
            },
        )
        .await
        .map(drop)
    }

    /// One change of a run's state: one guarded statement, and its event, in a transaction.
    /// `false` when the guard did not hold (nothing written).
    async fn move_run(&self, run: &str, m: RunMove<'_>) -> Result<bool, JournalError> {
        self.store.move_run(run, &m, self.now_ms()).await
    }
}

impl<'a> RunMove<'a> {
    /// A move to `to` from `from` by `worker`, which holds the run and gives it back.
    fn new(to: RunState, from: &'a [RunState], worker: &'a str) -> Self {
        RunMove {
            to,
            from,
            holder: Some(worker),
            output: None,
            error: None,
            wake_ms: None,
            unless_attention: false,
            actor: worker,
            action: None,
            reason: None,
        }
    }
}

impl Operator<'_> {
    /// An operator cancels `run` (pending or waiting for a person), recorded with `who` and
    /// `why`: no worker runs it again, and the worker running it stops at its next lease
    /// renewal. A run that is over is refused.
    pub async fn cancel(self, run: &str, who: &str, why: &str) -> Result<RunRecord, JournalError> {
        let journal = self.0;
        let moved = journal
            .move_run(
                run,
                RunMove {
                    holder: None,
                    error: Some(why.to_owned()),
                    reason: Some(why.to_owned()),
                    action: Some("cancelled"),
                    actor: who,
                    ..RunMove::new(
                        RunState::Cancelled,
                        &[RunState::Pending, RunState::NeedsHuman],
                        who,
                    )
                },
            )
            .await?;
        let found = journal.existing_run(run).await?;
        if !moved {
            return Err(JournalError::RunRefused {
                run: run.to_owned(),
                why: format!(
                    "it is {}: only a pending run or one waiting for a person can be cancelled",
                    found.state
                ),
            });
        }
        Ok(found)
    }
}
