//! The path every step takes, in two writes: one records a step never seen before as `sent`
//! (with its `pending` and `sent` history rows and its run's touch), the other records how the
//! call ended (with its history row and the run's touch). On PostgreSQL each is one statement
//! (data-modifying `WITH` clauses), so one round trip and one commit; on SQLite, one
//! transaction. Everything else (a resumed step, an operator's repair) takes the general path
//! of [`Journal::transition`].

use crate::{
    JournalError,
    journal::{Journal, STEP_COLUMNS},
    model::{NewStep, Step, StepId, StepState},
    steps::Change,
};

/// A history row's columns.
const HISTORY: &str = "INSERT INTO backstop_journal_transitions
    (run_id, step_id, call_id, from_state, to_state, at_ms, attempts, error, actor, reason)";

impl Journal {
    /// Records `new`, never seen before, as `sent` in one write: `Some(step)` to send. `None`
    /// when a step with its ids is recorded already (a resumed run, or a different call under
    /// the same ids): nothing is written, and the caller reads it and decides.
    pub(crate) async fn send_new(&self, new: &NewStep) -> Result<Option<Step>, JournalError> {
        let now = self.now_ms();
        let step = match &self.backend {
            #[cfg(feature = "postgres")]
            crate::journal::Backend::Postgres(pool) => {
                let query = format!(
                    "WITH step AS (
                        INSERT INTO backstop_journal_steps ({STEP_COLUMNS})
                        VALUES ($1, $2, $3, $4, $5, $6, $7, 'sent', 1, NULL, NULL, NULL, NULL,
                                NULL, $8, $8, $8)
                        ON CONFLICT (run_id, step_id, call_id) DO NOTHING
                        RETURNING {STEP_COLUMNS}),
                     history AS ({HISTORY}
                        SELECT s.run_id, s.step_id, s.call_id, v.from_state, v.to_state, $8,
                               v.attempts, NULL, 'journal', NULL
                        FROM step s CROSS JOIN (VALUES (1, NULL::text, 'pending', 0::bigint),
                                                       (2, 'pending', 'sent', 1::bigint))
                            AS v (n, from_state, to_state, attempts)
                        ORDER BY v.n),
                     run AS (
                        INSERT INTO backstop_journal_runs (run_id, created_ms, updated_ms)
                        SELECT run_id, $8, $8 FROM step
                        ON CONFLICT (run_id) DO UPDATE SET updated_ms = $8)
                     SELECT {STEP_COLUMNS} FROM step"
                );
                let row = self
                    .fetch_pg(pool, bind_new(sqlx::query(&query), new, now))
                    .await?;
                match row {
                    Some(row) => Some(crate::rows::step(&row)?),
                    None => None,
                }
            }
            #[cfg(feature = "sqlite")]
            crate::journal::Backend::Sqlite(pool) => {
                let mut tx = pool.begin().await?;
                let insert = format!(
                    "INSERT INTO backstop_journal_steps ({STEP_COLUMNS})
                     VALUES ($1, $2, $3, $4, $5, $6, $7, 'sent', 1, NULL, NULL, NULL, NULL, NULL,
                             $8, $8, $8)
                     ON CONFLICT (run_id, step_id, call_id) DO NOTHING
                     RETURNING {STEP_COLUMNS}"
                );
                let row = bind_new(sqlx::query(&insert), new, now)
                    .fetch_optional(&mut *tx)
                    .await?;
                let step = match row {
                    Some(row) => crate::rows::step(&row)?,
                    None => return Ok(None),
                };
                let id = &new.id;
                sqlx::query(&format!(
                    "{HISTORY} VALUES
                        ($1, $2, $3, NULL, 'pending', $4, 0, NULL, 'journal', NULL),
                        ($1, $2, $3, 'pending', 'sent', $4, 1, NULL, 'journal', NULL)"
                ))
                .bind(&*id.run)
                .bind(&*id.step)
                .bind(&*id.call)
                .bind(now)
                .execute(&mut *tx)
                .await?;
                sqlx::query(
                    "INSERT INTO backstop_journal_runs (run_id, created_ms, updated_ms)
                     VALUES ($1, $2, $2) ON CONFLICT (run_id) DO UPDATE SET updated_ms = $2",
                )
                .bind(&*id.run)
                .bind(now)
                .execute(&mut *tx)
                .await?;
                tx.commit().await?;
                Some(step)
            }
        };
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
        let set = "state = $1, last_error = COALESCE($2, last_error),
            result = COALESCE($3, result), provider_ref = COALESCE($4, provider_ref),
            park_until = $5, attention = $6, updated_ms = $7";
        let which = "run_id = $8 AND step_id = $9 AND call_id = $10 AND state = 'sent'";
        let step = match &self.backend {
            #[cfg(feature = "postgres")]
            crate::journal::Backend::Postgres(pool) => {
                let query = format!(
                    "WITH step AS (
                        UPDATE backstop_journal_steps SET {set} WHERE {which}
                        RETURNING {STEP_COLUMNS}),
                     history AS ({HISTORY}
                        SELECT run_id, step_id, call_id, 'sent', $1, $7, attempts, $2, $11, $12
                        FROM step),
                     run AS (UPDATE backstop_journal_runs SET updated_ms = $7
                        WHERE run_id = $8 AND EXISTS (SELECT 1 FROM step))
                     SELECT {STEP_COLUMNS} FROM step"
                );
                let row = self
                    .fetch_pg(
                        pool,
                        bind_outcome(sqlx::query(&query), id, to, change, now, true),
                    )
                    .await?;
                match row {
                    Some(row) => Some(crate::rows::step(&row)?),
                    None => None,
                }
            }
            #[cfg(feature = "sqlite")]
            crate::journal::Backend::Sqlite(pool) => {
                let mut tx = pool.begin().await?;
                let update = format!(
                    "UPDATE backstop_journal_steps SET {set} WHERE {which} RETURNING {STEP_COLUMNS}"
                );
                let row = bind_outcome(sqlx::query(&update), id, to, change, now, false)
                    .fetch_optional(&mut *tx)
                    .await?;
                let step = match row {
                    Some(row) => crate::rows::step(&row)?,
                    None => return Ok(None),
                };
                sqlx::query(&format!(
                    "{HISTORY} VALUES ($1, $2, $3, 'sent', $4, $5, $6, $7, $8, $9)"
                ))
                .bind(&*id.run)
                .bind(&*id.step)
                .bind(&*id.call)
                .bind(to.as_str())
                .bind(now)
                .bind(i64::from(step.attempts))
                .bind(&change.error)
                .bind(change.actor.as_deref().unwrap_or("journal"))
                .bind(&change.reason)
                .execute(&mut *tx)
                .await?;
                sqlx::query("UPDATE backstop_journal_runs SET updated_ms = $1 WHERE run_id = $2")
                    .bind(now)
                    .bind(&*id.run)
                    .execute(&mut *tx)
                    .await?;
                tx.commit().await?;
                Some(step)
            }
        };
        if let Some(step) = &step {
            let sent_for = step.sent_ms.map_or(0, |sent| now - sent);
            crate::obs::transition(step, StepState::Sent, sent_for);
        }
        Ok(step)
    }
}

impl Journal {
    /// Runs a step's write on PostgreSQL, on one of the journal's step connections, reading it
    /// to its end (`fetch_optional` would stop early and cost the connection a second `Sync`).
    #[cfg(feature = "postgres")]
    async fn fetch_pg<'q>(
        &self,
        pool: &sqlx::PgPool,
        query: sqlx::query::Query<'q, sqlx::Postgres, sqlx::postgres::PgArguments>,
    ) -> Result<Option<sqlx::postgres::PgRow>, JournalError> {
        let rows = match &self.step_conns {
            Some(conns) => {
                let mut conn = conns.checkout().await?;
                let rows = query.fetch_all(conn.conn()).await?;
                conn.keep();
                rows
            }
            None => query.fetch_all(pool).await?,
        };
        Ok(rows.into_iter().next())
    }
}

/// Binds a new step's columns: `$1`-`$7` its ids, tool, key, digest and kind, `$8` now.
fn bind_new<'q, DB>(
    q: sqlx::query::Query<'q, DB, <DB as sqlx::Database>::Arguments<'q>>,
    new: &'q NewStep,
    now: i64,
) -> sqlx::query::Query<'q, DB, <DB as sqlx::Database>::Arguments<'q>>
where
    DB: sqlx::Database,
    &'q str: sqlx::Encode<'q, DB> + sqlx::Type<DB>,
    i64: sqlx::Encode<'q, DB> + sqlx::Type<DB>,
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

/// Binds an outcome: `$1` the state, `$2`-`$6` the change, `$7` now, `$8`-`$10` the ids, and
/// with `history` `$11` who and `$12` why.
fn bind_outcome<'q, DB>(
    q: sqlx::query::Query<'q, DB, <DB as sqlx::Database>::Arguments<'q>>,
    id: &'q StepId,
    to: StepState,
    change: &'q Change,
    now: i64,
    history: bool,
) -> sqlx::query::Query<'q, DB, <DB as sqlx::Database>::Arguments<'q>>
where
    DB: sqlx::Database,
    &'q str: sqlx::Encode<'q, DB> + sqlx::Type<DB>,
    Option<&'q str>: sqlx::Encode<'q, DB> + sqlx::Type<DB>,
    Option<i64>: sqlx::Encode<'q, DB> + sqlx::Type<DB>,
    i64: sqlx::Encode<'q, DB> + sqlx::Type<DB>,
{
    let q = q
        .bind(to.as_str())
        .bind(change.error.as_deref())
        .bind(change.result.as_deref())
        .bind(change.provider_ref.as_deref())
        .bind(change.park_until)
        .bind(change.attention.as_deref())
        .bind(now)
        .bind(&*id.run)
        .bind(&*id.step)
        .bind(&*id.call);
    if !history {
        return q;
    }
    q.bind(change.actor.as_deref().unwrap_or("journal"))
        .bind(change.reason.as_deref())
}
