//! The steps' journal: each step recorded, moved from state to state with compare-and-set in a
//! transaction with its history row, read back, and repaired by an operator.

use crate::{
    JournalError, Operator, Runs,
    journal::{CallIdentity, Journal, STEP_COLUMNS, with_pool},
    model::{NewStep, Resolution, Step, StepId, StepState, StepTransition},
    rows::TransitionRow,
};
use std::time::Duration;

/// What a transition writes besides the state.
#[derive(Clone, Debug, Default)]
pub struct Change {
    /// Count one more attempt.
    pub attempt: bool,
    /// The error that caused it.
    pub error: Option<String>,
    /// The result to store.
    pub result: Option<String>,
    /// The provider's reference.
    pub provider_ref: Option<String>,
    /// When a parked step wakes.
    pub park_until: Option<i64>,
    /// Why it needs a person (cleared when `None`).
    pub attention: Option<String>,
    /// Who: `journal` unless an operator.
    pub actor: Option<String>,
    /// Why, in words.
    pub reason: Option<String>,
}

impl Change {
    /// One more attempt, nothing else: what a move to `sent` writes.
    pub fn attempt() -> Self {
        Change {
            attempt: true,
            ..Change::default()
        }
    }
}

/// Writes one history row inside the transaction `$tx`.
macro_rules! insert_transition {
    ($tx:expr, $id:expr, $from:expr, $to:expr, $at:expr, $attempts:expr, $change:expr) => {{
        let change: &Change = $change;
        let from: Option<StepState> = $from;
        let to: StepState = $to;
        sqlx::query(
            "INSERT INTO backstop_journal_transitions
                (run_id, step_id, call_id, from_state, to_state, at_ms, attempts, error, actor, reason)
             VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10)",
        )
        .bind(&*$id.run)
        .bind(&*$id.step)
        .bind(&*$id.call)
        .bind(from.map(StepState::as_str))
        .bind(to.as_str())
        .bind($at)
        .bind(i64::from($attempts))
        .bind(change.error.clone())
        .bind(change.actor.as_deref().unwrap_or("journal"))
        .bind(change.reason.clone())
        .execute(&mut *$tx)
        .await?;
    }};
}

impl Journal {
    /// Records `new` as `pending`, or returns the step already recorded under its ids (a
    /// resumed run). A step recorded with other arguments is refused.
    #[doc(hidden)] // The worker's claim protocol: the `Worker` runs it; not for users.
    pub async fn begin(&self, new: &NewStep) -> Result<Step, JournalError> {
        let now = self.now_ms();
        let id = &new.id;
        let inserted = with_pool!(self, |pool| {
            let mut tx = pool.begin().await?;
            let inserted = sqlx::query(&format!(
                "INSERT INTO backstop_journal_steps ({STEP_COLUMNS})
                 VALUES ($1, $2, $3, $4, $5, $6, $7, 'pending', 0, NULL, NULL, NULL, NULL, NULL,
                         $8, $8, NULL)
                 ON CONFLICT (run_id, step_id, call_id) DO NOTHING"
            ))
            .bind(&*id.run)
            .bind(&*id.step)
            .bind(&*id.call)
            .bind(&new.tool)
            .bind(&new.key)
            .bind(&new.args_digest)
            .bind(new.kind.as_str())
            .bind(now)
            .execute(&mut *tx)
            .await?
            .rows_affected()
                == 1;
            if inserted {
                insert_transition!(
                    tx,
                    id,
                    None,
                    StepState::Pending,
                    now,
                    0u32,
                    &Change::default()
                );
                sqlx::query(
                    "INSERT INTO backstop_journal_runs (run_id, created_ms, updated_ms)
                     VALUES ($1, $2, $2)
                     ON CONFLICT (run_id) DO UPDATE SET updated_ms = $2",
                )
                .bind(&*id.run)
                .bind(now)
                .execute(&mut *tx)
                .await?;
            }
            tx.commit().await?;
            inserted
        });
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
    #[doc(hidden)] // The worker's claim protocol: the `Worker` runs it; not for users.
    pub async fn transition(
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
        let moved = with_pool!(self, |pool| {
            let mut tx = pool.begin().await?;
            let attempts = i64::from(current.attempts) + i64::from(change.attempt);
            let done = sqlx::query(
                "UPDATE backstop_journal_steps SET state = $1, attempts = $2,
                    last_error = COALESCE($3, last_error), result = COALESCE($4, result),
                    provider_ref = COALESCE($5, provider_ref), park_until = $6, attention = $7,
                    updated_ms = $8, sent_ms = CASE WHEN $1 = 'sent' THEN $8 ELSE sent_ms END
                 WHERE run_id = $9 AND step_id = $10 AND call_id = $11 AND state = $12",
            )
            .bind(to.as_str())
            .bind(attempts)
            .bind(&change.error)
            .bind(&change.result)
            .bind(&change.provider_ref)
            .bind(change.park_until)
            .bind(&change.attention)
            .bind(now)
            .bind(&*id.run)
            .bind(&*id.step)
            .bind(&*id.call)
            .bind(current.state.as_str())
            .execute(&mut *tx)
            .await?
            .rows_affected()
                == 1;
            if done {
                let from = Some(current.state);
                let attempts = u32::try_from(attempts).unwrap_or(u32::MAX);
                insert_transition!(tx, id, from, to, now, attempts, &change);
                sqlx::query("UPDATE backstop_journal_runs SET updated_ms = $1 WHERE run_id = $2")
                    .bind(now)
                    .bind(&*id.run)
                    .execute(&mut *tx)
                    .await?;
                tx.commit().await?;
            }
            done
        });
        let step = self.runs().step(id).await?.ok_or_else(|| conflict(None))?;
        if !moved {
            // Another worker moved it between the read and the write.
            return Err(conflict(Some(step.state)));
        }
        crate::obs::transition(&step, current.state, now - current.updated_ms);
        Ok(step)
    }

    async fn transitions(
        &self,
        run: &str,
        step: Option<&StepId>,
    ) -> Result<Vec<StepTransition>, JournalError> {
        let one = if step.is_some() {
            "AND step_id = $2 AND call_id = $3"
        } else {
            ""
        };
        let query = format!(
            "SELECT step_id, call_id, from_state, to_state, at_ms, attempts, error, actor, reason
             FROM backstop_journal_transitions WHERE run_id = $1 {one} ORDER BY id"
        );
        let rows: Vec<TransitionRow> = with_pool!(self, |pool| {
            let mut q = sqlx::query_as(&query).bind(run);
            if let Some(id) = step {
                q = q.bind(&*id.step).bind(&*id.call);
            }
            q.fetch_all(pool).await?
        });
        rows.into_iter().map(|row| row.of_run(run)).collect()
    }

    /// Claims `run` for `worker` for `lease`: `true` when no other worker holds it (a claim
    /// whose lease ran out is free). Two workers never both hold a run.
    #[doc(hidden)] // The worker's claim protocol: the `Worker` runs it; not for users.
    pub async fn claim(
        &self,
        run: &str,
        worker: &str,
        lease: Duration,
    ) -> Result<bool, JournalError> {
        let now = self.now_ms();
        let until = now.saturating_add(i64::try_from(lease.as_millis()).unwrap_or(i64::MAX));
        with_pool!(self, |pool| {
            let claimed = sqlx::query(
                "UPDATE backstop_journal_runs SET claimed_by = $1, claim_until = $2
                 WHERE run_id = $3 AND (claimed_by IS NULL OR claimed_by = $1 OR claim_until < $4)",
            )
            .bind(worker)
            .bind(until)
            .bind(run)
            .bind(now)
            .execute(pool)
            .await?
            .rows_affected();
            Ok(claimed == 1)
        })
    }

    /// Gives `run` back (only `worker`'s own claim).
    #[doc(hidden)] // The worker's claim protocol: the `Worker` runs it; not for users.
    pub async fn release(&self, run: &str, worker: &str) -> Result<(), JournalError> {
        with_pool!(self, |pool| {
            sqlx::query(
                "UPDATE backstop_journal_runs SET claimed_by = NULL, claim_until = NULL
                 WHERE run_id = $1 AND claimed_by = $2",
            )
            .bind(run)
            .bind(worker)
            .execute(pool)
            .await?;
            Ok(())
        })
    }
}

impl Runs<'_> {
    /// Every step of `run`, in the order they were recorded.
    pub async fn steps(self, run: &str) -> Result<Vec<Step>, JournalError> {
        let journal = self.0;
        with_pool!(journal, |pool| {
            let rows = sqlx::query(&format!(
                "SELECT {STEP_COLUMNS} FROM backstop_journal_steps WHERE run_id = $1
                 ORDER BY created_ms, step_id, call_id"
            ))
            .bind(run)
            .fetch_all(pool)
            .await?;
            rows.iter().map(crate::rows::step).collect()
        })
    }

    /// Every recorded transition of every step of `run`, oldest first, in one query.
    pub async fn history(self, run: &str) -> Result<Vec<StepTransition>, JournalError> {
        let journal = self.0;
        journal.transitions(run, None).await
    }

    /// The step recorded under `id`.
    pub async fn step(self, id: &StepId) -> Result<Option<Step>, JournalError> {
        let journal = self.0;
        with_pool!(journal, |pool| {
            let row = sqlx::query(&format!(
                "SELECT {STEP_COLUMNS} FROM backstop_journal_steps
                 WHERE run_id = $1 AND step_id = $2 AND call_id = $3"
            ))
            .bind(&*id.run)
            .bind(&*id.step)
            .bind(&*id.call)
            .fetch_optional(pool)
            .await?;
            match row {
                Some(row) => Ok(Some(crate::rows::step(&row)?)),
                None => Ok(None),
            }
        })
    }

    /// Every recorded transition of step `id`, oldest first.
    pub async fn step_history(self, id: &StepId) -> Result<Vec<StepTransition>, JournalError> {
        let journal = self.0;
        journal.transitions(&id.run, Some(id)).await
    }

    /// Steps waiting for a person, and parked steps (with when they wake).
    pub async fn stuck(self) -> Result<Vec<Step>, JournalError> {
        let journal = self.0;
        with_pool!(journal, |pool| {
            let rows = sqlx::query(&format!(
                "SELECT {STEP_COLUMNS} FROM backstop_journal_steps
                 WHERE attention IS NOT NULL OR state = 'parked'
                 ORDER BY updated_ms, run_id, step_id"
            ))
            .fetch_all(pool)
            .await?;
            rows.iter().map(crate::rows::step).collect()
        })
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
