//! The journal on SQLite: one file (WAL, `synchronous=FULL`), or in memory for tests. A step's
//! two writes are each one transaction; the next run is claimed by one `UPDATE`, since SQLite
//! has one writer at a time.

use super::{Backend, NextClaim, Writes, bind_new, bind_outcome, step_of};
use crate::{
    JournalError,
    model::{NewStep, Step, StepId, StepState},
    steps::Change,
};
use sqlx::{
    QueryBuilder, SqlitePool,
    sqlite::{SqliteConnectOptions, SqliteJournalMode, SqlitePoolOptions, SqliteSynchronous},
};
use std::{path::Path, time::Duration};

pub(crate) struct Sqlite {
    pool: SqlitePool,
}

impl Sqlite {
    /// The database in the file at `path`, created when missing.
    pub(crate) async fn open(path: &Path) -> Result<Sqlite, JournalError> {
        let options = SqliteConnectOptions::new()
            .filename(path)
            .create_if_missing(true)
            .journal_mode(SqliteJournalMode::Wal)
            .synchronous(SqliteSynchronous::Full)
            .busy_timeout(Duration::from_secs(10));
        let pool = SqlitePoolOptions::new()
            .max_connections(4)
            .connect_with(options)
            .await?;
        Ok(Sqlite { pool })
    }

    /// A database in memory, gone with the process.
    pub(crate) async fn in_memory() -> Result<Sqlite, JournalError> {
        // One connection: every connection to `:memory:` is a database of its own.
        let pool = SqlitePoolOptions::new()
            .max_connections(1)
            .connect("sqlite::memory:")
            .await?;
        Ok(Sqlite { pool })
    }
}

impl Backend for Sqlite {
    type Db = sqlx::Sqlite;
    const NAME: &'static str = "sqlite";

    fn pool(&self) -> &SqlitePool {
        &self.pool
    }

    fn rows_affected(done: &sqlx::sqlite::SqliteQueryResult) -> u64 {
        done.rows_affected()
    }

    async fn migrate(&self) -> Result<(), JournalError> {
        sqlx::migrate!("migrations/sqlite").run(&self.pool).await?;
        Ok(())
    }

    async fn send_new(&self, new: &NewStep, now: i64) -> Result<Option<Step>, JournalError> {
        let id = &new.id;
        let mut tx = self.pool.begin().await?;
        let insert = sqlx::query(
            "INSERT INTO backstop_journal_steps
                (run_id, step_id, call_id, tool, idem_key, args_digest, kind, state, attempts,
                 created_ms, updated_ms, sent_ms)
             VALUES ($1, $2, $3, $4, $5, $6, $7, 'sent', 1, $8, $8, $8)
             ON CONFLICT (run_id, step_id, call_id) DO NOTHING
             RETURNING *",
        );
        let row = bind_new(insert, new, now).fetch_optional(&mut *tx).await?;
        let Some(step) = row.as_ref().map(step_of).transpose()? else {
            return Ok(None);
        };
        sqlx::query(
            "INSERT INTO backstop_journal_transitions
                (run_id, step_id, call_id, from_state, to_state, at_ms, attempts, actor)
             VALUES ($1, $2, $3, NULL, 'pending', $4, 0, 'journal'),
                    ($1, $2, $3, 'pending', 'sent', $4, 1, 'journal')",
        )
        .bind(&*id.run)
        .bind(&*id.step)
        .bind(&*id.call)
        .bind(now)
        .execute(&mut *tx)
        .await?;
        sqlx::Sqlite::touch_run(&mut tx, &id.run, now).await?;
        tx.commit().await?;
        Ok(Some(step))
    }

    async fn finish_sent(
        &self,
        id: &StepId,
        to: StepState,
        change: &Change,
        now: i64,
    ) -> Result<Option<Step>, JournalError> {
        let mut tx = self.pool.begin().await?;
        let update = sqlx::query(
            "UPDATE backstop_journal_steps SET state = $1, last_error = COALESCE($2, last_error),
                result = COALESCE($3, result), provider_ref = COALESCE($4, provider_ref),
                park_until = $5, attention = $6, updated_ms = $7
             WHERE run_id = $8 AND step_id = $9 AND call_id = $10 AND state = 'sent'
             RETURNING *",
        );
        let row = bind_outcome(update, id, to, change, now)
            .fetch_optional(&mut *tx)
            .await?;
        let Some(step) = row.as_ref().map(step_of).transpose()? else {
            return Ok(None);
        };
        sqlx::query(
            "INSERT INTO backstop_journal_transitions
                (run_id, step_id, call_id, from_state, to_state, at_ms, attempts, error, actor,
                 reason)
             VALUES ($1, $2, $3, 'sent', $4, $5, $6, $7, $8, $9)",
        )
        .bind(&*id.run)
        .bind(&*id.step)
        .bind(&*id.call)
        .bind(to.as_str())
        .bind(now)
        .bind(i64::from(step.attempts))
        .bind(change.error.as_deref())
        .bind(change.actor.as_deref().unwrap_or("journal"))
        .bind(change.reason.as_deref())
        .execute(&mut *tx)
        .await?;
        sqlx::query("UPDATE backstop_journal_runs SET updated_ms = $1 WHERE run_id = $2")
            .bind(now)
            .bind(&*id.run)
            .execute(&mut *tx)
            .await?;
        tx.commit().await?;
        Ok(Some(step))
    }

    async fn claim_next(&self, claim: &NextClaim<'_>) -> Result<Option<String>, JournalError> {
        // One writer at a time: the statement is the claim.
        let mut q = QueryBuilder::new("UPDATE backstop_journal_runs SET claimed_by = ");
        q.push_bind(claim.worker)
            .push(", claim_until = ")
            .push_bind(claim.until)
            .push(", wake_ms = NULL WHERE run_id = (");
        super::push_next_run(&mut q, claim);
        q.push(") RETURNING run_id");
        Ok(q.build_query_scalar().fetch_optional(&self.pool).await?)
    }
}
