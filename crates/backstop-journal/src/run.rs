//! Runs as records: a run is started with its workflow's name and input and stays `pending`
//! until the workflow finishes it (or an operator cancels it, or a person must decide), so a
//! run killed anywhere (before its first step, between two steps, after its last) is still
//! pending, and once its lease runs out a worker claims it again. The run's claim and its moves
//! are in `run_claim.rs`.

use crate::{
    JournalError, Runs,
    journal::Journal,
    model::{RunSummary, StepState},
};
use chrono::{DateTime, Utc};
use serde::{Serialize, Serializer};
use std::{fmt, str::FromStr};

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

/// Serialized as its name ([`RunState::as_str`]), as stored and shown.
impl Serialize for RunState {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.serialize_str(self.as_str())
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
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
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
    /// Until when that worker's lease lasts.
    pub claim_until: Option<DateTime<Utc>>,
    /// Not claimed before this time: a parked step's durable timer, or a step not sent waiting
    /// to be tried again.
    pub wake_at: Option<DateTime<Utc>>,
    /// When it was recorded.
    pub created_at: DateTime<Utc>,
    /// When it last changed.
    pub updated_at: DateTime<Utc>,
    /// The run and step it was forked from ([`Operator::fork`](crate::Operator::fork)), when it was.
    pub forked_from: Option<ForkPoint>,
}

/// Where a forked run came from: the original run and the step it was forked at.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
#[non_exhaustive]
pub struct ForkPoint {
    /// The original run.
    pub run: String,
    /// The step from which the fork runs anew.
    pub step: String,
}

/// How a workflow finished a run.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum RunOutcome {
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
/// why; a step's own changes are in its history ([`Runs::step_history`]).
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
#[non_exhaustive]
pub struct RunEvent {
    /// When.
    pub at: DateTime<Utc>,
    /// Who: `journal`, a worker's id, or an operator's name.
    pub actor: String,
    /// What: `started`, `succeeded`, `failed`, `cancelled`, `needs_human`, `reopened`.
    pub action: String,
    /// Why, in words.
    pub reason: Option<String>,
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
        self.store.start_run(run, workflow, input, now).await?;
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

    /// The record of run `run`, or `NotFound`.
    pub(crate) async fn existing_run(&self, run: &str) -> Result<RunRecord, JournalError> {
        self.runs()
            .get(run)
            .await?
            .ok_or_else(|| JournalError::NotFound(format!("run {run}")))
    }
}

/// Which runs [`Runs::list`] lists: the most recently changed first, at most `limit`, in a
/// state and of a workflow when asked.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct RunFilter {
    /// At most this many runs.
    pub limit: u32,
    /// Only runs in this state.
    pub state: Option<RunState>,
    /// Only runs of this workflow.
    pub workflow: Option<String>,
}

impl RunFilter {
    /// The `limit` most recently changed runs, whatever their state and workflow.
    pub fn latest(limit: u32) -> Self {
        RunFilter {
            limit,
            state: None,
            workflow: None,
        }
    }

    /// Only runs in `state`.
    #[must_use]
    pub fn state(mut self, state: RunState) -> Self {
        self.state = Some(state);
        self
    }

    /// Only runs of `workflow`.
    #[must_use]
    pub fn workflow(mut self, workflow: impl Into<String>) -> Self {
        self.workflow = Some(workflow.into());
        self
    }
}

/// Step states an operator's `retry` sends again from.
pub(crate) const RETRYABLE: [StepState; 4] = [
    StepState::FailedBeforeExecution,
    StepState::FailedAfterExecution,
    StepState::ReconciledFailed,
    StepState::Parked,
];

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
        self.0.store.runs(filter).await
    }

    /// The record of run `run`.
    pub async fn get(self, run: &str) -> Result<Option<RunRecord>, JournalError> {
        self.0.store.run(run).await
    }

    /// What happened to run `run`, oldest first.
    pub async fn events(self, run: &str) -> Result<Vec<RunEvent>, JournalError> {
        self.0.store.events(run).await
    }
}
