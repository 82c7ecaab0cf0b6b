//! The rows the journal reads, as sqlx maps them (`FromRow`, by column name), and the records
//! they become. One definition serves both stores: the derive is generic over the row type.

use crate::{
    ForkPoint, JournalError, RunEvent, RunRecord, RunSummary,
    journal::at_millis,
    model::{Step, StepId, StepKind, StepState, StepTransition},
};
use sqlx::FromRow;

/// A count or attempt number stored as `BIGINT`, as the records hold it.
fn count(n: i64) -> u32 {
    u32::try_from(n).unwrap_or(u32::MAX)
}

/// A state stored by its name.
fn state<S: std::str::FromStr<Err = crate::UnknownState>>(name: &str) -> Result<S, JournalError> {
    name.parse().map_err(JournalError::store)
}

/// A row of `backstop_journal_steps`.
#[derive(FromRow)]
pub(crate) struct StepRow {
    run_id: String,
    step_id: String,
    call_id: String,
    tool: String,
    idem_key: String,
    args_digest: String,
    kind: String,
    state: String,
    attempts: i64,
    last_error: Option<String>,
    result: Option<String>,
    provider_ref: Option<String>,
    park_until: Option<i64>,
    attention: Option<String>,
    created_ms: i64,
    updated_ms: i64,
    sent_ms: Option<i64>,
}

impl TryFrom<StepRow> for Step {
    type Error = JournalError;

    fn try_from(r: StepRow) -> Result<Step, JournalError> {
        Ok(Step {
            id: StepId::new(&r.run_id, &r.step_id, &r.call_id),
            tool: r.tool,
            key: r.idem_key,
            args_digest: r.args_digest,
            kind: StepKind::parse(&r.kind),
            state: state(&r.state)?,
            attempts: count(r.attempts),
            last_error: r.last_error,
            result: r.result,
            provider_ref: r.provider_ref,
            parked_until: r.park_until.map(at_millis),
            attention: r.attention,
            created_at: at_millis(r.created_ms),
            updated_at: at_millis(r.updated_ms),
            sent_at: r.sent_ms.map(at_millis),
        })
    }
}

/// A row of `backstop_journal_runs`.
#[derive(FromRow)]
pub(crate) struct RunRow {
    run_id: String,
    workflow: Option<String>,
    input: Option<String>,
    state: String,
    output: Option<String>,
    error: Option<String>,
    claimed_by: Option<String>,
    claim_until: Option<i64>,
    wake_ms: Option<i64>,
    created_ms: i64,
    updated_ms: i64,
    forked_from: Option<String>,
    forked_at_step: Option<String>,
}

impl TryFrom<RunRow> for RunRecord {
    type Error = JournalError;

    fn try_from(r: RunRow) -> Result<RunRecord, JournalError> {
        Ok(RunRecord {
            id: r.run_id,
            workflow: r.workflow,
            input: r.input,
            state: state(&r.state)?,
            output: r.output,
            error: r.error,
            claimed_by: r.claimed_by,
            claim_until: r.claim_until.map(at_millis),
            wake_at: r.wake_ms.map(at_millis),
            created_at: at_millis(r.created_ms),
            updated_at: at_millis(r.updated_ms),
            forked_from: match (r.forked_from, r.forked_at_step) {
                (Some(run), Some(step)) => Some(ForkPoint { run, step }),
                _ => None,
            },
        })
    }
}

/// A run with counts of its steps (the query of `Runs::list`, its columns named so).
#[derive(FromRow)]
pub(crate) struct SummaryRow {
    run_id: String,
    workflow: Option<String>,
    state: String,
    updated_ms: i64,
    claimed_by: Option<String>,
    wake_ms: Option<i64>,
    error: Option<String>,
    steps: i64,
    done: i64,
    needs_human: i64,
    parked: i64,
    unknown: i64,
}

impl TryFrom<SummaryRow> for RunSummary {
    type Error = JournalError;

    fn try_from(r: SummaryRow) -> Result<RunSummary, JournalError> {
        Ok(RunSummary {
            run: r.run_id,
            workflow: r.workflow,
            state: state(&r.state)?,
            steps: count(r.steps),
            done: count(r.done),
            needs_human: count(r.needs_human),
            parked: count(r.parked),
            unknown: count(r.unknown),
            updated_at: at_millis(r.updated_ms),
            claimed_by: r.claimed_by,
            wake_at: r.wake_ms.map(at_millis),
            error: r.error,
        })
    }
}

/// A row of `backstop_journal_transitions`.
#[derive(FromRow)]
pub(crate) struct TransitionRow {
    step_id: String,
    call_id: String,
    from_state: Option<String>,
    to_state: String,
    at_ms: i64,
    attempts: i64,
    error: Option<String>,
    actor: String,
    reason: Option<String>,
}

impl TransitionRow {
    /// The transition of a step of `run`.
    pub(crate) fn of_run(self, run: &str) -> Result<StepTransition, JournalError> {
        Ok(StepTransition {
            id: StepId::new(run, &self.step_id, &self.call_id),
            from: self.from_state.as_deref().map(state).transpose()?,
            to: state::<StepState>(&self.to_state)?,
            at: at_millis(self.at_ms),
            attempts: count(self.attempts),
            error: self.error,
            actor: self.actor,
            reason: self.reason,
        })
    }
}

/// A row of `backstop_journal_run_events`.
#[derive(FromRow)]
pub(crate) struct EventRow {
    at_ms: i64,
    actor: String,
    action: String,
    reason: Option<String>,
}

impl From<EventRow> for RunEvent {
    fn from(r: EventRow) -> RunEvent {
        RunEvent {
            at: at_millis(r.at_ms),
            actor: r.actor,
            action: r.action,
            reason: r.reason,
        }
    }
}
