//! Where the journal keeps its records: one private trait, [`Store`], the only way the journal
//! reaches its database. Its statements are written once, over sqlx, for every database a
//! [`Backend`] describes; each backend's module (`sqlite.rs`, `postgres.rs`) holds its pool, its
//! migrations and the statements its dialect writes its own way: the two writes every step
//! makes, and the claim of the next run.
//!
//! Parameters are numbered (`$1`), which PostgreSQL and sqlx's SQLite driver both bind by
//! number. The claim's list of workflows is bound through sqlx's `QueryBuilder`, which writes
//! each database's own placeholders; a run's move joins the guards it needs as text, from the
//! journal's own state names and numbered parameters, never from input.

#[cfg(feature = "postgres")]
mod postgres;
#[cfg(feature = "sqlite")]
mod sqlite;

#[cfg(feature = "postgres")]
pub(crate) use postgres::Postgres;
#[cfg(feature = "sqlite")]
pub(crate) use sqlite::Sqlite;

use crate::{
    JournalError, RunEvent, RunFilter, RunRecord, RunState, RunSummary,
    journal::millis,
    model::{NewStep, Step, StepId, StepState, StepTransition},
    rows::{EventRow, RunRow, StepRow, SummaryRow, TransitionRow},
    steps::Change,
};
use async_trait::async_trait;
use sqlx::{
    Database, Encode, Executor, FromRow, IntoArguments, Pool, QueryBuilder, Row, Type, query::Query,
};
use std::future::Future;

/// What the journal asks of its database. Each method is one statement, or one transaction;
/// what the records mean (which moves are allowed, what a refusal says) is the journal's.
#[async_trait]
pub(crate) trait Store: Send + Sync {
    /// `sqlite` or `postgres`.
    fn name(&self) -> &'static str;

    /// Applies the schema's migrations.
    async fn migrate(&self) -> Result<(), JournalError>;

    /// Records `new` as `pending` with its history row, and its run: `false` when a step with
    /// its ids is recorded already (nothing written).
    async fn insert_step(&self, new: &NewStep, now: i64) -> Result<bool, JournalError>;

    /// Records `new`, never seen before, as `sent` in one write; `None` when a step with its
    /// ids is recorded already (nothing written).
    async fn send_new(&self, new: &NewStep, now: i64) -> Result<Option<Step>, JournalError>;

    /// Records how sent step `id` ended, as `to` with `change`, in one write; `None` when it
    /// is not `sent` (nothing written).
    async fn finish_sent(
        &self,
        id: &StepId,
        to: StepState,
        change: &Change,
        now: i64,
    ) -> Result<Option<Step>, JournalError>;

    /// Moves step `id` from `from` (compare-and-set) to `to`, writing `change`, `attempts` and
    /// a history row: `false` when the step was no longer in `from` (nothing written).
    async fn update_step(&self, moved: &StepMove<'_>, now: i64) -> Result<bool, JournalError>;

    /// The step recorded under `id`.
    async fn step(&self, id: &StepId) -> Result<Option<Step>, JournalError>;

    /// Every step of `run`, in the order they were recorded.
    async fn steps(&self, run: &str) -> Result<Vec<Step>, JournalError>;

    /// Steps waiting for a person, and parked steps.
    async fn stuck(&self) -> Result<Vec<Step>, JournalError>;

    /// The transitions of `run` (of its step `step` only, when given), oldest first.
    async fn transitions(
        &self,
        run: &str,
        step: Option<&StepId>,
    ) -> Result<Vec<StepTransition>, JournalError>;

    /// Records run `run` of `workflow` with `input`, or adopts a run recorded without a
    /// workflow: `false` when it was started already (nothing written).
    async fn start_run(
        &self,
        run: &str,
        workflow: &str,
        input: Option<&str>,
        now: i64,
    ) -> Result<bool, JournalError>;

    /// The record of run `run`.
    async fn run(&self, run: &str) -> Result<Option<RunRecord>, JournalError>;

    /// The runs `filter` selects, with counts of their steps.
    async fn runs(&self, filter: &RunFilter) -> Result<Vec<RunSummary>, JournalError>;

    /// The runs forked from `run`, oldest first.
    async fn forks(&self, run: &str) -> Result<Vec<RunRecord>, JournalError>;

    /// What happened to run `run`, oldest first.
    async fn events(&self, run: &str) -> Result<Vec<RunEvent>, JournalError>;

    /// Writes `fork` in one transaction, the original's record locked while its steps are
    /// read: `false` when the original is not over (nothing written).
    async fn fork(&self, fork: &Fork<'_>, now: i64) -> Result<bool, JournalError>;

    /// Claims the pending run of the claim's workflows, free to run, that has waited longest.
    async fn claim_next(&self, claim: &NextClaim<'_>) -> Result<Option<String>, JournalError>;

    /// Extends `worker`'s claim on pending run `run` to `until`: `false` when it holds none.
    async fn renew(&self, run: &str, worker: &str, until: i64) -> Result<bool, JournalError>;

    /// Gives `worker`'s claim on `run` back.
    async fn release(&self, run: &str, worker: &str) -> Result<(), JournalError>;

    /// One guarded change of a run's state, with its event: `false` when the guard did not
    /// hold (nothing written).
    async fn move_run(&self, run: &str, m: &RunMove<'_>, now: i64) -> Result<bool, JournalError>;
}

/// A step's move ([`Store::update_step`]).
pub(crate) struct StepMove<'a> {
    pub(crate) id: &'a StepId,
    pub(crate) from: StepState,
    pub(crate) to: StepState,
    pub(crate) attempts: u32,
    pub(crate) change: &'a Change,
}

/// A claim of the next run ([`Store::claim_next`]).
pub(crate) struct NextClaim<'a> {
    pub(crate) worker: &'a str,
    pub(crate) until: i64,
    pub(crate) now: i64,
    /// Only runs of these workflows (at least one).
    pub(crate) workflows: &'a [&'a str],
}

/// A fork ([`Store::fork`]).
pub(crate) struct Fork<'a> {
    pub(crate) run: &'a str,
    pub(crate) from_step: &'a str,
    pub(crate) new_run: &'a str,
    pub(crate) who: &'a str,
    pub(crate) why: &'a str,
}

/// One change of a run's state ([`Store::move_run`]).
pub(crate) struct RunMove<'a> {
    pub(crate) to: RunState,
    /// The states it may move from.
    pub(crate) from: &'a [RunState],
    /// Only this worker (or anyone, when nobody holds the run), and the claim goes with it.
    pub(crate) holder: Option<&'a str>,
    pub(crate) output: Option<String>,
    pub(crate) error: Option<String>,
    pub(crate) wake_ms: Option<i64>,
    /// Not while one of its steps waits for a person.
    pub(crate) unless_attention: bool,
    pub(crate) actor: &'a str,
    /// The event written; `None`: none (a deferral).
    pub(crate) action: Option<&'a str>,
    pub(crate) reason: Option<String>,
}

/// A database the journal runs on: its pool, and what its dialect does its own way.
pub(crate) trait Backend: Send + Sync + 'static {
    /// sqlx's database.
    type Db: Database;
    /// `sqlite` or `postgres`.
    const NAME: &'static str;

    /// The pool the statements run on (PostgreSQL runs a step's two writes on connections of
    /// its own).
    fn pool(&self) -> &Pool<Self::Db>;

    /// How many rows a statement changed.
    fn rows_affected(done: &<Self::Db as Database>::QueryResult) -> u64;

    /// [`Store::migrate`].
    fn migrate(&self) -> impl Future<Output = Result<(), JournalError>> + Send;

    /// [`Store::send_new`].
    fn send_new(
        &self,
        new: &NewStep,
        now: i64,
    ) -> impl Future<Output = Result<Option<Step>, JournalError>> + Send;

    /// [`Store::finish_sent`].
    fn finish_sent(
        &self,
        id: &StepId,
        to: StepState,
        change: &Change,
        now: i64,
    ) -> impl Future<Output = Result<Option<Step>, JournalError>> + Send;

    /// [`Store::claim_next`].
    fn claim_next(
        &self,
        claim: &NextClaim<'_>,
    ) -> impl Future<Output = Result<Option<String>, JournalError>> + Send;
}

/// The rows a transaction writes beside its main statement, for every database sqlx can bind
/// the journal's values on.
trait Writes: Database {
    /// A step's history row.
    fn history(
        conn: &mut Self::Connection,
        row: History<'_>,
    ) -> impl Future<Output = Result<(), JournalError>> + Send;

    /// A run's event.
    fn event(
        conn: &mut Self::Connection,
        event: Event<'_>,
    ) -> impl Future<Output = Result<(), JournalError>> + Send;

    /// Touches run `run` (its `updated_ms`), recording it when it is new.
    fn touch_run(
        conn: &mut Self::Connection,
        run: &str,
        now: i64,
    ) -> impl Future<Output = Result<(), JournalError>> + Send;

    /// A copy of step `step` into run `run`, with a history row saying where it came from.
    fn copy_step(
        conn: &mut Self::Connection,
        step: &Step,
        run: &str,
        now: i64,
        who: &str,
        why: &str,
    ) -> impl Future<Output = Result<(), JournalError>> + Send;
}

/// A step's history row.
struct History<'a> {
    id: &'a StepId,
    from: Option<StepState>,
    to: StepState,
    at: i64,
    attempts: u32,
    change: &'a Change,
}

/// A run's event.
struct Event<'a> {
    run: &'a str,
    at: i64,
    actor: &'a str,
    action: &'a str,
    reason: Option<&'a str>,
}

impl<DB> Writes for DB
where
    DB: Database,
    for<'c> &'c mut DB::Connection: Executor<'c, Database = DB>,
    for<'q> DB::Arguments<'q>: IntoArguments<'q, DB>,
    for<'q> &'q str: Encode<'q, DB> + Type<DB>,
    for<'q> Option<&'q str>: Encode<'q, DB> + Type<DB>,
    for<'q> i64: Encode<'q, DB> + Type<DB>,
    for<'q> Option<i64>: Encode<'q, DB> + Type<DB>,
{
    async fn history(conn: &mut DB::Connection, row: History<'_>) -> Result<(), JournalError> {
        sqlx::query(
            "INSERT INTO backstop_journal_transitions
                (run_id, step_id, call_id, from_state, to_state, at_ms, attempts, error, actor,
                 reason)
             VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10)",
        )
        .bind(&*row.id.run)
        .bind(&*row.id.step)
        .bind(&*row.id.call)
        .bind(row.from.map(StepState::as_str))
        .bind(row.to.as_str())
        .bind(row.at)
        .bind(i64::from(row.attempts))
        .bind(row.change.error.as_deref())
        .bind(row.change.actor.as_deref().unwrap_or("journal"))
        .bind(row.change.reason.as_deref())
        .execute(conn)
        .await?;
        Ok(())
    }

    async fn event(conn: &mut DB::Connection, event: Event<'_>) -> Result<(), JournalError> {
        sqlx::query(
            "INSERT INTO backstop_journal_run_events (run_id, at_ms, actor, action, reason)
             VALUES ($1, $2, $3, $4, $5)",
        )
        .bind(event.run)
        .bind(event.at)
        .bind(event.actor)
        .bind(event.action)
        .bind(event.reason)
        .execute(conn)
        .await?;
        Ok(())
    }

    async fn touch_run(conn: &mut DB::Connection, run: &str, now: i64) -> Result<(), JournalError> {
        sqlx::query(
            "INSERT INTO backstop_journal_runs (run_id, created_ms, updated_ms) VALUES ($1, $2, $2)
             ON CONFLICT (run_id) DO UPDATE SET updated_ms = $2",
        )
        .bind(run)
        .bind(now)
        .execute(conn)
        .await?;
        Ok(())
    }

    async fn copy_step(
        conn: &mut DB::Connection,
        step: &Step,
        run: &str,
        now: i64,
        who: &str,
        why: &str,
    ) -> Result<(), JournalError> {
        sqlx::query(
            "INSERT INTO backstop_journal_steps
                (run_id, step_id, call_id, tool, idem_key, args_digest, kind, state, attempts,
                 last_error, result, provider_ref, created_ms, updated_ms, sent_ms)
             VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13, $14, $15)",
        )
        .bind(run)
        .bind(&*step.id.step)
        .bind(&*step.id.call)
        .bind(step.tool.as_str())
        .bind(step.key.as_str())
        .bind(step.args_digest.as_str())
        .bind(step.kind.as_str())
        .bind(step.state.as_str())
        .bind(i64::from(step.attempts))
        .bind(step.last_error.as_deref())
        .bind(step.result.as_deref())
        .bind(step.provider_ref.as_deref())
        .bind(millis(step.created_at))
        .bind(now)
        .bind(step.sent_at.map(millis))
        .execute(&mut *conn)
        .await?;
        let change = Change {
            actor: Some(who.to_owned()),
            reason: Some(why.to_owned()),
            ..Change::default()
        };
        let id = StepId::new(run, &step.id.step, &step.id.call);
        let history = History {
            id: &id,
            from: None,
            to: step.state,
            at: now,
            attempts: step.attempts,
            change: &change,
        };
        DB::history(conn, history).await
    }
}

#[async_trait]
impl<B> Store for B
where
    B: Backend,
    B::Db: Writes,
    for<'c> &'c mut <B::Db as Database>::Connection: Executor<'c, Database = B::Db>,
    for<'q> <B::Db as Database>::Arguments<'q>: IntoArguments<'q, B::Db>,
    for<'q> &'q str: Encode<'q, B::Db> + Type<B::Db>,
    for<'q> Option<&'q str>: Encode<'q, B::Db> + Type<B::Db>,
    for<'q> i64: Encode<'q, B::Db> + Type<B::Db>,
    for<'q> Option<i64>: Encode<'q, B::Db> + Type<B::Db>,
    for<'r> StepRow: FromRow<'r, <B::Db as Database>::Row>,
    for<'r> RunRow: FromRow<'r, <B::Db as Database>::Row>,
    for<'r> SummaryRow: FromRow<'r, <B::Db as Database>::Row>,
    for<'r> TransitionRow: FromRow<'r, <B::Db as Database>::Row>,
    for<'r> EventRow: FromRow<'r, <B::Db as Database>::Row>,
{
    fn name(&self) -> &'static str {
        B::NAME
    }

    async fn migrate(&self) -> Result<(), JournalError> {
        Backend::migrate(self).await
    }

    async fn insert_step(&self, new: &NewStep, now: i64) -> Result<bool, JournalError> {
        let mut tx = self.pool().begin().await?;
        let insert = sqlx::query(
            "INSERT INTO backstop_journal_steps
                (run_id, step_id, call_id, tool, idem_key, args_digest, kind, state, attempts,
                 created_ms, updated_ms)
             VALUES ($1, $2, $3, $4, $5, $6, $7, 'pending', 0, $8, $8)
             ON CONFLICT (run_id, step_id, call_id) DO NOTHING",
        );
        let done = bind_new(insert, new, now).execute(&mut *tx).await?;
        let inserted = B::rows_affected(&done) == 1;
        if inserted {
            let history = History {
                id: &new.id,
                from: None,
                to: StepState::Pending,
                at: now,
                attempts: 0,
                change: &Change::default(),
            };
            B::Db::history(&mut *tx, history).await?;
            B::Db::touch_run(&mut *tx, &new.id.run, now).await?;
        }
        tx.commit().await?;
        Ok(inserted)
    }

    async fn send_new(&self, new: &NewStep, now: i64) -> Result<Option<Step>, JournalError> {
        Backend::send_new(self, new, now).await
    }

    async fn finish_sent(
        &self,
        id: &StepId,
        to: StepState,
        change: &Change,
        now: i64,
    ) -> Result<Option<Step>, JournalError> {
        Backend::finish_sent(self, id, to, change, now).await
    }

    async fn update_step(&self, m: &StepMove<'_>, now: i64) -> Result<bool, JournalError> {
        let (id, change) = (m.id, m.change);
        let mut tx = self.pool().begin().await?;
        let update = sqlx::query(
            "UPDATE backstop_journal_steps SET state = $1, last_error = COALESCE($2, last_error),
                result = COALESCE($3, result), provider_ref = COALESCE($4, provider_ref),
                park_until = $5, attention = $6, updated_ms = $7,
                sent_ms = CASE WHEN $1 = 'sent' THEN $7 ELSE sent_ms END, attempts = $11
             WHERE run_id = $8 AND step_id = $9 AND call_id = $10 AND state = $12",
        );
        let done = bind_outcome(update, id, m.to, change, now)
            .bind(i64::from(m.attempts))
            .bind(m.from.as_str())
            .execute(&mut *tx)
            .await?;
        let moved = B::rows_affected(&done) == 1;
        if moved {
            let history = History {
                id,
                from: Some(m.from),
                to: m.to,
                at: now,
                attempts: m.attempts,
                change,
            };
            B::Db::history(&mut *tx, history).await?;
            sqlx::query("UPDATE backstop_journal_runs SET updated_ms = $1 WHERE run_id = $2")
                .bind(now)
                .bind(&*id.run)
                .execute(&mut *tx)
                .await?;
            tx.commit().await?;
        }
        Ok(moved)
    }

    async fn step(&self, id: &StepId) -> Result<Option<Step>, JournalError> {
        let row: Option<StepRow> = sqlx::query_as(
            "SELECT * FROM backstop_journal_steps
             WHERE run_id = $1 AND step_id = $2 AND call_id = $3",
        )
        .bind(&*id.run)
        .bind(&*id.step)
        .bind(&*id.call)
        .fetch_optional(self.pool())
        .await?;
        row.map(Step::try_from).transpose()
    }

    async fn steps(&self, run: &str) -> Result<Vec<Step>, JournalError> {
        let rows: Vec<StepRow> = sqlx::query_as(
            "SELECT * FROM backstop_journal_steps WHERE run_id = $1
             ORDER BY created_ms, step_id, call_id",
        )
        .bind(run)
        .fetch_all(self.pool())
        .await?;
        rows.into_iter().map(Step::try_from).collect()
    }

    async fn stuck(&self) -> Result<Vec<Step>, JournalError> {
        let rows: Vec<StepRow> = sqlx::query_as(
            "SELECT * FROM backstop_journal_steps
             WHERE attention IS NOT NULL OR state = 'parked'
             ORDER BY updated_ms, run_id, step_id",
        )
        .fetch_all(self.pool())
        .await?;
        rows.into_iter().map(Step::try_from).collect()
    }

    async fn transitions(
        &self,
        run: &str,
        step: Option<&StepId>,
    ) -> Result<Vec<StepTransition>, JournalError> {
        let rows: Vec<TransitionRow> = match step {
            None => {
                sqlx::query_as(
                    "SELECT * FROM backstop_journal_transitions WHERE run_id = $1 ORDER BY id",
                )
                .bind(run)
                .fetch_all(self.pool())
                .await?
            }
            Some(id) => {
                sqlx::query_as(
                    "SELECT * FROM backstop_journal_transitions
                     WHERE run_id = $1 AND step_id = $2 AND call_id = $3 ORDER BY id",
                )
                .bind(run)
                .bind(&*id.step)
                .bind(&*id.call)
                .fetch_all(self.pool())
                .await?
            }
        };
        rows.into_iter().map(|row| row.of_run(run)).collect()
    }

    async fn start_run(
        &self,
        run: &str,
        workflow: &str,
        input: Option<&str>,
        now: i64,
    ) -> Result<bool, JournalError> {
        let mut tx = self.pool().begin().await?;
        let done = sqlx::query(
            "INSERT INTO backstop_journal_runs
                (run_id, created_ms, updated_ms, workflow, input, state)
             VALUES ($1, $2, $2, $3, $4, 'pending')
             ON CONFLICT (run_id) DO UPDATE SET workflow = $3, input = $4, updated_ms = $2
             WHERE backstop_journal_runs.workflow IS NULL",
        )
        .bind(run)
        .bind(now)
        .bind(workflow)
        .bind(input)
        .execute(&mut *tx)
        .await?;
        let started = B::rows_affected(&done) == 1;
        if started {
            let event = Event {
                run,
                at: now,
                actor: "journal",
                action: "started",
                reason: Some(workflow),
            };
            B::Db::event(&mut *tx, event).await?;
        }
        tx.commit().await?;
        Ok(started)
    }

    async fn run(&self, run: &str) -> Result<Option<RunRecord>, JournalError> {
        let row: Option<RunRow> =
            sqlx::query_as("SELECT * FROM backstop_journal_runs WHERE run_id = $1")
                .bind(run)
                .fetch_optional(self.pool())
                .await?;
        row.map(RunRecord::try_from).transpose()
    }

    async fn runs(&self, filter: &RunFilter) -> Result<Vec<RunSummary>, JournalError> {
        let rows: Vec<SummaryRow> = sqlx::query_as(
            "SELECT r.run_id, r.workflow, r.state, r.updated_ms, r.claimed_by, r.wake_ms, r.error,
                COUNT(s.step_id) AS steps,
                COALESCE(SUM(CASE WHEN s.state IN ('succeeded', 'failed_after_execution',
                    'reconciled_succeeded', 'reconciled_failed', 'compensated')
                    THEN 1 ELSE 0 END), 0) AS done,
                COALESCE(SUM(CASE WHEN s.attention IS NOT NULL THEN 1 ELSE 0 END), 0)
                    AS needs_human,
                COALESCE(SUM(CASE WHEN s.state = 'parked' THEN 1 ELSE 0 END), 0) AS parked,
                COALESCE(SUM(CASE WHEN s.state IN ('sent', 'unknown', 'requires_reconciliation')
                    THEN 1 ELSE 0 END), 0) AS unknown
             FROM backstop_journal_runs r
             LEFT JOIN backstop_journal_steps s ON s.run_id = r.run_id
             WHERE ($2 IS NULL OR r.state = $2) AND ($3 IS NULL OR r.workflow = $3)
             GROUP BY r.run_id, r.workflow, r.state, r.updated_ms, r.claimed_by, r.wake_ms,
                r.error
             ORDER BY r.updated_ms DESC, r.run_id LIMIT $1",
        )
        .bind(i64::from(filter.limit))
        .bind(filter.state.map(RunState::as_str))
        .bind(filter.workflow.as_deref())
        .fetch_all(self.pool())
        .await?;
        rows.into_iter().map(RunSummary::try_from).collect()
    }

    async fn forks(&self, run: &str) -> Result<Vec<RunRecord>, JournalError> {
        let rows: Vec<RunRow> = sqlx::query_as(
            "SELECT * FROM backstop_journal_runs WHERE forked_from = $1
             ORDER BY created_ms, run_id",
        )
        .bind(run)
        .fetch_all(self.pool())
        .await?;
        rows.into_iter().map(RunRecord::try_from).collect()
    }

    async fn events(&self, run: &str) -> Result<Vec<RunEvent>, JournalError> {
        let rows: Vec<EventRow> = sqlx::query_as(
            "SELECT at_ms, actor, action, reason FROM backstop_journal_run_events
             WHERE run_id = $1 ORDER BY id",
        )
        .bind(run)
        .fetch_all(self.pool())
        .await?;
        Ok(rows.into_iter().map(RunEvent::from).collect())
    }

    async fn fork(&self, fork: &Fork<'_>, now: i64) -> Result<bool, JournalError> {
        let (run, new_run) = (fork.run, fork.new_run);
        let mut tx = self.pool().begin().await?;
        // Locks the original's record (a row lock on PostgreSQL, the write lock on SQLite)
        // while it is over, so no operator reopens it while it is copied.
        let original: Option<RunRow> = sqlx::query_as(
            "UPDATE backstop_journal_runs SET updated_ms = $2
             WHERE run_id = $1 AND state IN ('succeeded', 'failed', 'cancelled')
             RETURNING *",
        )
        .bind(run)
        .bind(now)
        .fetch_optional(&mut *tx)
        .await?;
        let Some(original) = original.map(RunRecord::try_from).transpose()? else {
            return Ok(false);
        };
        let rows: Vec<StepRow> = sqlx::query_as(
            "SELECT * FROM backstop_journal_steps s WHERE run_id = $1
             ORDER BY (SELECT MIN(t.id) FROM backstop_journal_transitions t
                       WHERE t.run_id = s.run_id AND t.step_id = s.step_id
                         AND t.call_id = s.call_id), created_ms, step_id, call_id",
        )
        .bind(run)
        .fetch_all(&mut *tx)
        .await?;
        let steps = rows
            .into_iter()
            .map(Step::try_from)
            .collect::<Result<Vec<_>, _>>()?;
        let copied = crate::fork::copied_steps(&steps, run, fork.from_step)?;
        let Some(workflow) = original.workflow.as_deref() else {
            return Err(JournalError::RunRefused {
                run: run.to_owned(),
                why: "it was not started as a workflow: no worker could run a fork of it".into(),
            });
        };
        let done = sqlx::query(
            "INSERT INTO backstop_journal_runs
                (run_id, created_ms, updated_ms, workflow, input, state, forked_from,
                 forked_at_step)
             VALUES ($1, $2, $2, $3, $4, 'pending', $5, $6)
             ON CONFLICT (run_id) DO NOTHING",
        )
        .bind(new_run)
        .bind(now)
        .bind(workflow)
        .bind(original.input.as_deref())
        .bind(run)
        .bind(fork.from_step)
        .execute(&mut *tx)
        .await?;
        let made = B::rows_affected(&done) == 1;
        if !made {
            return Err(JournalError::RunRefused {
                run: new_run.to_owned(),
                why: "a run of that id was made meanwhile: a fork needs an id of its own".into(),
            });
        }
        let why = fork.why;
        let from_step = fork.from_step;
        let reason = format!("copied from run {run} (fork at {from_step}): {why}");
        for step in copied {
            B::Db::copy_step(&mut *tx, step, new_run, now, fork.who, &reason).await?;
        }
        let into = format!("into run {new_run} at step {from_step}: {why}");
        let from = format!("from run {run} at step {from_step}: {why}");
        for (run, reason) in [(run, into), (new_run, from)] {
            let event = Event {
                run,
                at: now,
                actor: fork.who,
                action: "forked",
                reason: Some(&reason),
            };
            B::Db::event(&mut *tx, event).await?;
        }
        tx.commit().await?;
        Ok(true)
    }

    async fn claim_next(&self, claim: &NextClaim<'_>) -> Result<Option<String>, JournalError> {
        Backend::claim_next(self, claim).await
    }

    async fn renew(&self, run: &str, worker: &str, until: i64) -> Result<bool, JournalError> {
        let renewed = sqlx::query(
            "UPDATE backstop_journal_runs SET claim_until = $1
             WHERE run_id = $2 AND claimed_by = $3 AND state = 'pending'",
        )
        .bind(until)
        .bind(run)
        .bind(worker)
        .execute(self.pool())
        .await?;
        Ok(B::rows_affected(&renewed) == 1)
    }

    async fn release(&self, run: &str, worker: &str) -> Result<(), JournalError> {
        sqlx::query(
            "UPDATE backstop_journal_runs SET claimed_by = NULL, claim_until = NULL
             WHERE run_id = $1 AND claimed_by = $2",
        )
        .bind(run)
        .bind(worker)
        .execute(self.pool())
        .await?;
        Ok(())
    }

    async fn move_run(&self, run: &str, m: &RunMove<'_>, now: i64) -> Result<bool, JournalError> {
        // The states are the journal's own names, not input.
        let from: Vec<String> = m.from.iter().map(|s| format!("'{}'", s.as_str())).collect();
        let (release, holder) = match m.holder {
            Some(_) => (
                ", claimed_by = NULL, claim_until = NULL",
                "AND (claimed_by = $7 OR claimed_by IS NULL)",
            ),
            None => ("", ""),
        };
        let attention = if m.unless_attention {
            "AND NOT EXISTS (SELECT 1 FROM backstop_journal_steps s
                WHERE s.run_id = $6 AND s.attention IS NOT NULL)"
        } else {
            ""
        };
        let statement = format!(
            "UPDATE backstop_journal_runs SET state = $1, output = COALESCE($2, output),
                error = $3, wake_ms = $4, updated_ms = $5 {release}
             WHERE run_id = $6 AND state IN ({}) {holder} {attention}",
            from.join(", ")
        );
        let mut tx = self.pool().begin().await?;
        let mut q = sqlx::query(&statement)
            .bind(m.to.as_str())
            .bind(m.output.as_deref())
            .bind(m.error.as_deref())
            .bind(m.wake_ms)
            .bind(now)
            .bind(run);
        if let Some(worker) = m.holder {
            q = q.bind(worker);
        }
        let done = q.execute(&mut *tx).await?;
        let moved = B::rows_affected(&done) == 1;
        if moved && let Some(action) = m.action {
            let event = Event {
                run,
                at: now,
                actor: m.actor,
                action,
                reason: m.reason.as_deref(),
            };
            B::Db::event(&mut *tx, event).await?;
        }
        tx.commit().await?;
        Ok(moved)
    }
}

/// Writes the query that picks the next run a claim takes: pending, no live claim (a lease that
/// ran out is free), no wake-up time still to come, of one of the claim's workflows; the one
/// that has waited longest.
fn push_next_run<'a, DB: Database>(q: &mut QueryBuilder<'a, DB>, claim: &NextClaim<'a>)
where
    &'a str: Encode<'a, DB> + Type<DB>,
    i64: Encode<'a, DB> + Type<DB>,
{
    q.push(
        "SELECT r.run_id FROM backstop_journal_runs r
         WHERE r.state = 'pending' AND (r.claim_until IS NULL OR r.claim_until < ",
    )
    .push_bind(claim.now)
    .push(") AND (r.wake_ms IS NULL OR r.wake_ms <= ")
    .push_bind(claim.now)
    .push(")");
    q.push(" AND r.workflow IN (");
    let mut workflows = q.separated(", ");
    for name in claim.workflows {
        workflows.push_bind(*name);
    }
    q.push(")");
    q.push(" ORDER BY COALESCE(r.wake_ms, r.updated_ms), r.run_id LIMIT 1");
}

/// Binds the columns an outcome writes, in order: `$1` the state, `$2`-`$6` the change's error,
/// result, provider reference, park time and attention, `$7` now, `$8`-`$10` the step's ids.
fn bind_outcome<'q, DB: Database>(
    q: Query<'q, DB, DB::Arguments<'q>>,
    id: &'q StepId,
    to: StepState,
    change: &'q Change,
    now: i64,
) -> Query<'q, DB, DB::Arguments<'q>>
where
    &'q str: Encode<'q, DB> + Type<DB>,
    Option<&'q str>: Encode<'q, DB> + Type<DB>,
    Option<i64>: Encode<'q, DB> + Type<DB>,
    i64: Encode<'q, DB> + Type<DB>,
{
    q.bind(to.as_str())
        .bind(change.error.as_deref())
        .bind(change.result.as_deref())
        .bind(change.provider_ref.as_deref())
        .bind(change.park_until)
        .bind(change.attention.as_deref())
        .bind(now)
        .bind(&*id.run)
        .bind(&*id.step)
        .bind(&*id.call)
}

/// The step a row of `backstop_journal_steps` holds.
fn step_of<R: Row>(row: &R) -> Result<Step, JournalError>
where
    for<'r> StepRow: FromRow<'r, R>,
{
    StepRow::from_row(row)?.try_into()
}

/// Binds a new step's columns, in order: `$1`-`$7` its ids, tool, key, digest and kind, `$8` now.
fn bind_new<'q, DB: Database>(
    q: Query<'q, DB, DB::Arguments<'q>>,
    new: &'q NewStep,
    now: i64,
) -> Query<'q, DB, DB::Arguments<'q>>
where
    &'q str: Encode<'q, DB> + Type<DB>,
    i64: Encode<'q, DB> + Type<DB>,
{
    q.bind(&*new.id.run)
        .bind(&*new.id.step)
        .bind(&*new.id.call)
        .bind(new.tool.as_str())
        .bind(new.key.as_str())
        .bind(new.args_digest.as_str())
        .bind(new.kind.as_str())
        .bind(now)
}
