//! The journal on PostgreSQL, shared by several workers. Each of a step's two writes is one
//! statement (data-modifying `WITH` clauses), so one round trip and one commit, run on the
//! journal's own step connections; the next run is picked `FOR UPDATE SKIP LOCKED`, so workers
//! claiming at the same moment take different runs.

mod step_conns;

use super::{Backend, NextClaim, bind_new, bind_outcome, step_of};
use crate::{
    JournalError,
    model::{NewStep, Step, StepId, StepState},
    steps::Change,
};
use sqlx::{
    PgPool, QueryBuilder,
    postgres::{PgArguments, PgConnectOptions, PgPoolOptions},
    query::Query,
};
use std::{sync::Arc, time::Duration};
use step_conns::StepConnections;

pub(crate) struct Postgres {
    pool: PgPool,
    steps: Arc<StepConnections>,
}

impl Postgres {
    /// The database at `url`.
    pub(crate) async fn connect(url: &str) -> Result<Postgres, JournalError> {
        // A database that cannot be reached is an error within seconds, not a hang.
        let options: PgConnectOptions = url.parse()?;
        let pool = PgPoolOptions::new()
            .max_connections(8)
            .acquire_timeout(Duration::from_secs(5))
            .connect_with(options.clone())
            .await?;
        Ok(Postgres {
            pool,
            steps: StepConnections::new(options),
        })
    }

    /// Runs a step's write on one of the step connections, reading it to its end
    /// (`fetch_optional` would stop early and cost the connection a second `Sync`).
    async fn step_write<'q>(
        &self,
        query: Query<'q, sqlx::Postgres, PgArguments>,
    ) -> Result<Option<Step>, JournalError> {
        let mut conn = self.steps.checkout().await?;
        let rows = query.fetch_all(conn.conn()).await?;
        conn.keep();
        rows.first().map(step_of).transpose()
    }
}

impl Backend for Postgres {
    type Db = sqlx::Postgres;
    const NAME: &'static str = "postgres";

    fn pool(&self) -> &PgPool {
        &self.pool
    }

    fn rows_affected(done: &sqlx::postgres::PgQueryResult) -> u64 {
        done.rows_affected()
    }

    /// Under sqlx's advisory lock, so workers starting together apply them once.
    async fn migrate(&self) -> Result<(), JournalError> {
        sqlx::migrate!("migrations/postgres")
            .run(&self.pool)
            .await?;
        Ok(())
    }

    async fn send_new(&self, new: &NewStep, now: i64) -> Result<Option<Step>, JournalError> {
        let insert = sqlx::query(
            "WITH step AS (
                INSERT INTO backstop_journal_steps
                    (run_id, step_id, call_id, tool, idem_key, args_digest, kind, state,
                     attempts, created_ms, updated_ms, sent_ms)
                VALUES ($1, $2, $3, $4, $5, $6, $7, 'sent', 1, $8, $8, $8)
                ON CONFLICT (run_id, step_id, call_id) DO NOTHING
                RETURNING *),
             history AS (
                INSERT INTO backstop_journal_transitions
                    (run_id, step_id, call_id, from_state, to_state, at_ms, attempts, actor)
                SELECT s.run_id, s.step_id, s.call_id, v.from_state, v.to_state, $8,
                       v.attempts, 'journal'
                FROM step s CROSS JOIN (VALUES (1, NULL::text, 'pending', 0::bigint),
                                               (2, 'pending', 'sent', 1::bigint))
                    AS v (n, from_state, to_state, attempts)
                ORDER BY v.n),
             run AS (
                INSERT INTO backstop_journal_runs (run_id, created_ms, updated_ms)
                SELECT run_id, $8, $8 FROM step
                ON CONFLICT (run_id) DO UPDATE SET updated_ms = $8)
             SELECT * FROM step",
        );
        self.step_write(bind_new(insert, new, now)).await
    }

    async fn finish_sent(
        &self,
        id: &StepId,
        to: StepState,
        change: &Change,
        now: i64,
    ) -> Result<Option<Step>, JournalError> {
        let update = sqlx::query(
            "WITH step AS (
                UPDATE backstop_journal_steps SET state = $1,
                    last_error = COALESCE($2, last_error), result = COALESCE($3, result),
                    provider_ref = COALESCE($4, provider_ref), park_until = $5, attention = $6,
                    updated_ms = $7
                WHERE run_id = $8 AND step_id = $9 AND call_id = $10 AND state = 'sent'
                RETURNING *),
             history AS (
                INSERT INTO backstop_journal_transitions
                    (run_id, step_id, call_id, from_state, to_state, at_ms, attempts, error,
                     actor, reason)
                SELECT run_id, step_id, call_id, 'sent', $1, $7, attempts, $2, $11, $12
                FROM step),
             run AS (UPDATE backstop_journal_runs SET updated_ms = $7
                WHERE run_id = $8 AND EXISTS (SELECT 1 FROM step))
             SELECT * FROM step",
        );
        let query = bind_outcome(update, id, to, change, now)
            .bind(change.actor.as_deref().unwrap_or("journal"))
            .bind(change.reason.as_deref());
        self.step_write(query).await
    }

    async fn claim_next(&self, claim: &NextClaim<'_>) -> Result<Option<String>, JournalError> {
        let mut tx = self.pool.begin().await?;
        let mut pick = QueryBuilder::new("");
        super::push_next_run(&mut pick, claim);
        pick.push(" FOR UPDATE SKIP LOCKED");
        let run: Option<String> = pick.build_query_scalar().fetch_optional(&mut *tx).await?;
        if let Some(run) = &run {
            sqlx::query(
                "UPDATE backstop_journal_runs SET claimed_by = $1, claim_until = $2, wake_ms = NULL
                 WHERE run_id = $3",
            )
            .bind(claim.worker)
            .bind(claim.until)
            .bind(run)
            .execute(&mut *tx)
            .await?;
        }
        tx.commit().await?;
        Ok(run)
    }
}
