//! Runs as records: a run is started with its workflow's name and input and stays `pending`
//! until the workflow finishes it (or an operator cancels it, or a person must decide), so a
//! run killed anywhere (before its first step, between two steps, after its last) is still
//! pending, and once its lease runs out a worker claims it again.

#[cfg(feature = "sqlite")]
use crate::journal::to_sqlite;
use crate::{
    JournalError,
    journal::{Journal, with_pool},
    model::{RunSummary, StepState},
};
use std::{fmt, str::FromStr, time::Duration};

/// Where a run is. Only `pending` runs are claimed and run.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum RunState {
    /// Not finished: a worker runs it (or will, once its lease or its wake-up time has come).
    Pending,
    /// The workflow finished it.
    Succeeded,
    /// The workflow failed (a step failed for good, or the workflow's own error).
    Failed,
    /// An operator cancelled it: no worker runs it again.
    Cancelled,
    /// A person must decide a step before it goes on (`backstop journal resolve|retry|stub`).
    NeedsHuman,
}

impl RunState {
    /// Every state.
    pub const ALL: [RunState; 5] = [
        RunState::Pending,
        RunState::Succeeded,
        RunState::Failed,
        RunState::Cancelled,
        RunState::NeedsHuman,
    ];

    /// The name stored and shown: `pending`, `succeeded`, `failed`, `cancelled`, `needs_human`.
    pub const fn as_str(self) -> &'static str {
        match self {
            RunState::Pending => "pending",
            RunState::Succeeded => "succeeded",
            RunState::Failed => "failed",
            RunState::Cancelled => "cancelled",
            RunState::NeedsHuman => "needs_human",
        }
    }

    /// The run is over: nothing runs it again (an operator's `retry` or `stub` reopens a
    /// failed run).
    pub const fn is_final(self) -> bool {
        matches!(
            self,
            RunState::Succeeded | RunState::Failed | RunState::Cancelled
        )
    }
}

impl fmt::Display for RunState {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for RunState {
    type Err = crate::UnknownState;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        RunState::ALL
            .into_iter()
            .find(|st| st.as_str() == s)
            .ok_or_else(|| crate::UnknownState(s.to_owned()))
    }
}

/// A run as the journal records it.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct RunRecord {
    /// The run's id.
    pub id: String,
    /// The workflow that runs it (`None`: a run whose steps were journaled without a workflow,
    /// through [`Journal::execute`] or the layer; whoever made them finishes it).
    pub workflow: Option<String>,
    /// The workflow's input, as given to [`Journal::start_run`] (JSON, say).
    pub input: Option<String>,
    /// Where it is.
    pub state: RunState,
    /// What the workflow returned, once it succeeded.
    pub output: Option<String>,
    /// Why it failed, was cancelled or waits for a person.
    pub error: Option<String>,
    /// The worker holding it, if one does.
    pub claimed_by: Option<String>,
    /// Until when that worker's lease lasts (milliseconds since the Unix epoch).
    pub claim_until: Option<i64>,
    /// Not claimed before this time: a parked step's durable timer, or a step not sent waiting
    /// to be tried again.
    pub wake_ms: Option<i64>,
    /// When it was recorded.
    pub created_ms: i64,
    /// When it last changed.
    pub updated_ms: i64,
}

/// How a workflow finished a run.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum RunOutcome {
    /// It succeeded, with this output.
    Succeeded {
        /// What the workflow returned (JSON, say).
        output: Option<String>,
    },
    /// It failed.
    Failed {
        /// Why, in words.
        error: String,
    },
}

/// One thing that happened to a run (started, finished, cancelled, reopened), with who and
/// why; a step's own changes are in its history ([`Journal::history`]).
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct RunEvent {
    /// When (milliseconds since the Unix epoch).
    pub at_ms: i64,
    /// Who: `journal`, a worker's id, or an operator's name.
    pub actor: String,
    /// What: `started`, `succeeded`, `failed`, `cancelled`, `needs_human`, `reopened`.
    pub action: String,
    /// Why, in words.
    pub reason: Option<String>,
}

pub(crate) const RUN_COLUMNS: &str = "run_id, workflow, input, state, output, error, claimed_by, \
     claim_until, wake_ms, created_ms, updated_ms";

/// The step states that are over, as SQL.
const FINAL_STEPS: &str = "('succeeded', 'failed_after_execution', 'reconciled_succeeded', \
     'reconciled_failed', 'compensated')";

macro_rules! run_from_row {
    ($row:expr) => {{
        use sqlx::Row;
        let row = $row;
        let state: String = row.try_get("state")?;
        RunRecord {
            id: row.try_get("run_id")?,
            workflow: row.try_get("workflow")?,
            input: row.try_get("input")?,
            state: state
                .parse()
                .map_err(|e: crate::UnknownState| JournalError::Store(e.to_string()))?,
            output: row.try_get("output")?,
            error: row.try_get("error")?,
            claimed_by: row.try_get("claimed_by")?,
            claim_until: row.try_get("claim_until")?,
            wake_ms: row.try_get("wake_ms")?,
            created_ms: row.try_get("created_ms")?,
            updated_ms: row.try_get("updated_ms")?,
        }
    }};
}

/// Writes one run event inside the transaction `$tx`.
macro_rules! insert_event {
    ($tx:expr, $sql:expr, $run:expr, $at:expr, $actor:expr, $action:expr, $reason:expr) => {{
        sqlx::query(&$sql(
            "INSERT INTO backstop_journal_run_events (run_id, at_ms, actor, action, reason)
             VALUES ($1, $2, $3, $4, $5)",
        ))
        .bind($run)
        .bind($at)
        .bind($actor)
        .bind($action)
        .bind($reason)
        .execute(&mut *$tx)
        .await?;
    }};
}

fn lease_end(now: i64, lease: Duration) -> i64 {
    now.saturating_add(i64::try_from(lease.as_millis()).unwrap_or(i64::MAX))
}

impl Journal {
    /// Starts run `run` of `workflow` with `input`, pending and unclaimed: a [`Worker`] that
    /// knows the workflow claims it and runs it. Starting it again with the same workflow and
    /// input returns the run as it is (a caller that crashed after starting it may start it
    /// again); another workflow or input under the same id is refused. A run whose steps were
    /// journaled before it was started is adopted.
    ///
    /// [`Worker`]: crate::Worker
    pub async fn start_run(
        &self,
        run: &str,
        workflow: &str,
        input: Option<&str>,
    ) -> Result<RunRecord, JournalError> {
        let now = self.now_ms();
        with_pool!(self, |pool, sql| {
            let mut tx = pool.begin().await?;
            let started = sqlx::query(&sql("INSERT INTO backstop_journal_runs
                    (run_id, created_ms, updated_ms, workflow, input, state)
                 VALUES ($1, $2, $2, $3, $4, 'pending')
                 ON CONFLICT (run_id) DO UPDATE SET workflow = $3, input = $4, updated_ms = $2
                 WHERE backstop_journal_runs.workflow IS NULL"))
            .bind(run)
            .bind(now)
            .bind(workflow)
            .bind(input)
            .execute(&mut *tx)
            .await?
            .rows_affected()
                == 1;
            if started {
                insert_event!(tx, sql, run, now, "journal", "started", Some(workflow));
            }
            tx.commit().await?;
        });
        let found = self.existing_run(run).await?;
        if found.workflow.as_deref() != Some(workflow) || found.input.as_deref() != input {
            return Err(JournalError::RunRefused {
                run: run.to_owned(),
                why: format!(
                    "it was started as workflow {:?} with other input: a different run cannot reuse its id",
                    found.workflow.unwrap_or_default()
                ),
            });
        }
        Ok(found)
    }

    /// The record of run `run`.
    pub async fn run_record(&self, run: &str) -> Result<Option<RunRecord>, JournalError> {
        with_pool!(self, |pool, sql| {
            let row = sqlx::query(&sql(&format!(
                "SELECT {RUN_COLUMNS} FROM backstop_journal_runs WHERE run_id = $1"
            )))
            .bind(run)
            .fetch_optional(pool)
            .await?;
            match row {
                Some(row) => Ok(Some(run_from_row!(row))),
                None => Ok(None),
            }
        })
    }

    /// The record of run `run`, or `NotFound`.
    pub(crate) async fn existing_run(&self, run: &str) -> Result<RunRecord, JournalError> {
        self.run_record(run)
            .await?
            .ok_or_else(|| JournalError::NotFound(format!("run {run}")))
    }

    /// What happened to run `run`, oldest first.
    pub async fn run_events(&self, run: &str) -> Result<Vec<RunEvent>, JournalError> {
        let rows: Vec<(i64, String, String, Option<String>)> = with_pool!(self, |pool, sql| {
            sqlx::query_as(&sql(
                "SELECT at_ms, actor, action, reason FROM backstop_journal_run_events
                 WHERE run_id = $1 ORDER BY id",
            ))
            .bind(run)
            .fetch_all(pool)
            .await?
        });
        Ok(rows
            .into_iter()
            .map(|(at_ms, actor, action, reason)| RunEvent {
                at_ms,
                actor,
                action,
                reason,
            })
            .collect())
    }

    /// The most recently changed runs, at most `limit`, in one query.
    pub async fn runs(&self, limit: u32) -> Result<Vec<RunSummary>, JournalError> {
        self.summaries(None, limit).await
    }

    /// The most recently changed runs in `state`, at most `limit`, in one query.
    pub async fn runs_in(
        &self,
        state: RunState,
        limit: u32,
    ) -> Result<Vec<RunSummary>, JournalError> {
        self.summaries(Some(state), limit).await
    }

    async fn summaries(
        &self,
        state: Option<RunState>,
        limit: u32,
    ) -> Result<Vec<RunSummary>, JournalError> {
        type Row = (
            String,
            Option<String>,
            String,
            i64,
            Option<String>,
            Option<i64>,
            Option<String>,
            i64,
            i64,
            i64,
            i64,
            i64,
        );
        let filter = if state.is_some() {
            "WHERE r.state = $2"
        } else {
            ""
        };
        let query = format!(
            "SELECT r.run_id, r.workflow, r.state, r.updated_ms, r.claimed_by, r.wake_ms, r.error,
                COUNT(s.step_id),
                COALESCE(SUM(CASE WHEN s.state IN {FINAL_STEPS} THEN 1 ELSE 0 END), 0),
                COALESCE(SUM(CASE WHEN s.attention IS NOT NULL THEN 1 ELSE 0 END), 0),
                COALESCE(SUM(CASE WHEN s.state = 'parked' THEN 1 ELSE 0 END), 0),
                COALESCE(SUM(CASE WHEN s.state IN ('sent', 'unknown', 'requires_reconciliation')
                    THEN 1 ELSE 0 END), 0)
             FROM backstop_journal_runs r
             LEFT JOIN backstop_journal_steps s ON s.run_id = r.run_id
             {filter}
             GROUP BY r.run_id, r.workflow, r.state, r.updated_ms, r.claimed_by, r.wake_ms, r.error
             ORDER BY r.updated_ms DESC, r.run_id LIMIT $1"
        );
        let rows: Vec<Row> = with_pool!(self, |pool, sql| {
            let statement = sql(&query);
            let mut q = sqlx::query_as(&statement).bind(i64::from(limit));
            if let Some(state) = state {
                q = q.bind(state.as_str());
            }
            q.fetch_all(pool).await?
        });
        let count = |n: i64| u32::try_from(n).unwrap_or(u32::MAX);
        rows.into_iter()
            .map(
                |(
                    run,
                    workflow,
                    st,
                    updated_ms,
                    claimed_by,
                    wake_ms,
                    error,
                    steps,
                    done,
                    human,
                    parked,
                    unknown,
                )| {
                    Ok(RunSummary {
                        run,
                        workflow,
                        state: st
                            .parse()
                            .map_err(|e: crate::UnknownState| JournalError::Store(e.to_string()))?,
                        steps: count(steps),
                        done: count(done),
                        needs_human: count(human),
                        parked: count(parked),
                        unknown: count(unknown),
                        updated_ms,
                        claimed_by,
                        wake_ms,
                        error,
                    })
                },
            )
            .collect()
    }

    /// Claims the pending run that has waited longest among those free to run: no live claim
    /// (a lease that ran out is free), no wake-up time still to come, and either a workflow to
    /// run it or steps not over (a run journaled without a workflow). On PostgreSQL the row is
    /// picked `FOR UPDATE SKIP LOCKED`, so workers claiming at the same moment take different
    /// runs.
    pub async fn claim_next(
        &self,
        worker: &str,
        lease: Duration,
    ) -> Result<Option<String>, JournalError> {
        self.claim_next_of(worker, lease, None).await
    }

    /// [`claim_next`](Self::claim_next) among the runs of `workflows` only (what a worker
    /// can run).
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
                let statement = to_sqlite(&format!(
                    "UPDATE backstop_journal_runs SET claimed_by = ${w}, claim_until = ${u},
                        wake_ms = NULL
                     WHERE run_id = ({pick})
                     RETURNING run_id",
                    w = n + 2,
                    u = n + 3
                ));
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
    pub async fn renew(
        &self,
        run: &str,
        worker: &str,
        lease: Duration,
    ) -> Result<bool, JournalError> {
        let until = lease_end(self.now_ms(), lease);
        with_pool!(self, |pool, sql| {
            let renewed = sqlx::query(&sql("UPDATE backstop_journal_runs SET claim_until = $1
                 WHERE run_id = $2 AND claimed_by = $3 AND state = 'pending'"))
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

    /// An operator cancels `run` (pending or waiting for a person), recorded with `who` and
    /// `why`: no worker runs it again, and the worker running it stops at its next lease
    /// renewal. A run that is over is refused.
    pub async fn cancel_run(
        &self,
        run: &str,
        who: &str,
        why: &str,
    ) -> Result<RunRecord, JournalError> {
        let moved = self
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
        let found = self.existing_run(run).await?;
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
        with_pool!(self, |pool, sql| {
            let mut tx = pool.begin().await?;
            let statement = sql(&query);
            let mut q = sqlx::query(&statement)
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
                insert_event!(tx, sql, run, now, m.actor, action, m.reason.as_deref());
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

/// Step states an operator's `retry` sends again from.
pub(crate) const RETRYABLE: [StepState; 4] = [
    StepState::FailedBeforeExecution,
    StepState::FailedAfterExecution,
    StepState::ReconciledFailed,
    StepState::Parked,
];
