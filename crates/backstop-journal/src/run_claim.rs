//! A run under a worker's claim: claimed once its lease runs out, its lease renewed, and given
//! back finished, deferred, to a person or cancelled, each move one guarded statement with its
//! event.

use crate::{
    JournalError, Operator,
    journal::{Journal, with_pool},
    run::{FINAL_STEPS, RunOutcome, RunRecord, RunState, insert_event},
};
use std::time::Duration;

fn lease_end(now: i64, lease: Duration) -> i64 {
    now.saturating_add(i64::try_from(lease.as_millis()).unwrap_or(i64::MAX))
}

impl Journal {
    /// Claims the pending run that has waited longest among those free to run: no live claim
    /// (a lease that ran out is free), no wake-up time still to come, and either a workflow to
    /// run it or steps not over (a run journaled without a workflow). On PostgreSQL the row is
    /// picked `FOR UPDATE SKIP LOCKED`, so workers claiming at the same moment take different
    /// runs.
    #[doc(hidden)] // The worker's claim protocol: the `Worker` runs it; not for users.
    pub async fn claim_next(
        &self,
        worker: &str,
        lease: Duration,
    ) -> Result<Option<String>, JournalError> {
        self.claim_next_of(worker, lease, None).await
    }

    /// [`claim_next`](Self::claim_next) among the runs of `workflows` only (what a worker
    /// can run).
    #[doc(hidden)] // The worker's claim protocol: the `Worker` runs it; not for users.
    pub async fn claim_next_for(
        &self,
        worker: &str,
        lease: Duration,
        workflows: &[&str],
    ) -> Result<Option<String>, JournalError> {
        if workflows.is_empty() {
            return Ok(None);
        }
        self.claim_next_of(worker, lease, Some(workflows)).await
    }

    async fn claim_next_of(
        &self,
        worker: &str,
        lease: Duration,
        workflows: Option<&[&str]>,
    ) -> Result<Option<String>, JournalError> {
        let now = self.now_ms();
        let until = lease_end(now, lease);
        // $1 now; the workflows from $2.
        let runnable = match workflows {
            Some(names) => {
                let params: Vec<String> = (0..names.len()).map(|i| format!("${}", i + 2)).collect();
                format!("r.workflow IN ({})", params.join(", "))
            }
            None => format!(
                "(r.workflow IS NOT NULL OR EXISTS (SELECT 1 FROM backstop_journal_steps s
                   WHERE s.run_id = r.run_id AND s.state NOT IN {FINAL_STEPS}
                   AND s.attention IS NULL))"
            ),
        };
        let pick = format!(
            "SELECT r.run_id FROM backstop_journal_runs r
             WHERE r.state = 'pending' AND (r.claim_until IS NULL OR r.claim_until < $1)
               AND (r.wake_ms IS NULL OR r.wake_ms <= $1) AND {runnable}
             ORDER BY COALESCE(r.wake_ms, r.updated_ms), r.run_id LIMIT 1"
        );
        let names = workflows.unwrap_or_default();
        match &self.backend {
            #[cfg(feature = "postgres")]
            crate::journal::Backend::Postgres(pool) => {
                let mut tx = pool.begin().await?;
                let statement = format!("{pick} FOR UPDATE SKIP LOCKED");
                let mut q = sqlx::query_scalar(&statement).bind(now);
                for name in names {
                    q = q.bind(*name);
                }
                let run: Option<String> = q.fetch_optional(&mut *tx).await?;
                if let Some(run) = &run {
                    sqlx::query(
                        "UPDATE backstop_journal_runs SET claimed_by = $1, claim_until = $2,
                            wake_ms = NULL
                         WHERE run_id = $3",
                    )
                    .bind(worker)
                    .bind(until)
                    .bind(run)
                    .execute(&mut *tx)
                    .await?;
                }
                tx.commit().await?;
                Ok(run)
            }
            #[cfg(feature = "sqlite")]
            crate::journal::Backend::Sqlite(pool) => {
                // SQLite has one writer at a time: the statement is the claim.
                let n = names.len();
                let statement = format!(
                    "UPDATE backstop_journal_runs SET claimed_by = ${w}, claim_until = ${u},
                        wake_ms = NULL
                     WHERE run_id = ({pick})
                     RETURNING run_id",
                    w = n + 2,
                    u = n + 3
                );
                let mut q = sqlx::query_scalar(&statement).bind(now);
                for name in names {
                    q = q.bind(*name);
                }
                let run: Option<String> = q.bind(worker).bind(until).fetch_optional(pool).await?;
                Ok(run)
            }
        }
    }

    /// Extends `worker`'s lease on `run`: `false` when the worker no longer holds it (another
    /// worker claimed it after the lease ran out) or the run is no longer pending (an operator
    /// cancelled it): the worker stops running it.
    #[doc(hidden)] // The worker's claim protocol: the `Worker` runs it; not for users.
    pub async fn renew(
        &self,
        run: &str,
        worker: &str,
        lease: Duration,
    ) -> Result<bool, JournalError> {
        let until = lease_end(self.now_ms(), lease);
        with_pool!(self, |pool| {
            let renewed = sqlx::query(
                "UPDATE backstop_journal_runs SET claim_until = $1
                 WHERE run_id = $2 AND claimed_by = $3 AND state = 'pending'",
            )
            .bind(until)
            .bind(run)
            .bind(worker)
            .execute(pool)
            .await?
            .rows_affected();
            Ok(renewed == 1)
        })
    }

    /// Finishes `run` as `outcome` says: only a pending run, and only by the worker holding it
    /// (or by anyone when nobody does). Its claim goes with it.
    #[doc(hidden)] // The worker's claim protocol: the `Worker` runs it; not for users.
    pub async fn finish_run(
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
    #[doc(hidden)] // The worker's claim protocol: the `Worker` runs it; not for users.
    pub async fn run_needs_human(
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

    /// Gives `run` back, pending, not to be claimed before `wake_ms`: a parked step's timer,
    /// or a step that was not sent and is tried again later.
    #[doc(hidden)] // The worker's claim protocol: the `Worker` runs it; not for users.
    pub async fn defer_run(
        &self,
        run: &str,
        worker: &str,
        wake_ms: i64,
        why: &str,
    ) -> Result<RunRecord, JournalError> {
        self.end_claim(
            run,
            worker,
            RunMove {
                error: Some(why.to_owned()),
                wake_ms: Some(wake_ms),
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
        let now = self.now_ms();
        // The states are the journal's own names, not input.
        let from: Vec<String> = m.from.iter().map(|s| format!("'{}'", s.as_str())).collect();
        let (release, holder) = if m.holder.is_some() {
            (
                ", claimed_by = NULL, claim_until = NULL",
                "AND (claimed_by = $7 OR claimed_by IS NULL)",
            )
        } else {
            ("", "")
        };
        let attention = if m.unless_attention {
            "AND NOT EXISTS (SELECT 1 FROM backstop_journal_steps s
                WHERE s.run_id = $6 AND s.attention IS NOT NULL)"
        } else {
            ""
        };
        let query = format!(
            "UPDATE backstop_journal_runs SET state = $1, output = COALESCE($2, output),
                error = $3, wake_ms = $4, updated_ms = $5 {release}
             WHERE run_id = $6 AND state IN ({}) {holder} {attention}",
            from.join(", ")
        );
        with_pool!(self, |pool| {
            let mut tx = pool.begin().await?;
            let mut q = sqlx::query(&query)
                .bind(m.to.as_str())
                .bind(&m.output)
                .bind(&m.error)
                .bind(m.wake_ms)
                .bind(now)
                .bind(run);
            if let Some(worker) = m.holder {
                q = q.bind(worker);
            }
            let moved = q.execute(&mut *tx).await?.rows_affected() == 1;
            if moved && let Some(action) = m.action {
                insert_event!(tx, run, now, m.actor, action, m.reason.as_deref());
            }
            tx.commit().await?;
            Ok(moved)
        })
    }
}

/// One change of a run's state ([`Journal::move_run`]).
struct RunMove<'a> {
    to: RunState,
    /// The states it may move from.
    from: &'a [RunState],
    /// Only this worker (or anyone, when nobody holds the run), and the claim goes with it.
    holder: Option<&'a str>,
    output: Option<String>,
    error: Option<String>,
    wake_ms: Option<i64>,
    /// Not while one of its steps waits for a person.
    unless_attention: bool,
    actor: &'a str,
    /// The event written; `None`: none (a deferral).
    action: Option<&'a str>,
    reason: Option<String>,
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
