//! What a workflow is and gets: the function a worker runs for a run, the context it journals
//! its steps through, the errors that tell the worker what to do with the run next, and the
//! report of how the worker's turn with the run ended.

use crate::{
    JournalError,
    journal::Journal,
    model::{Step, StepId, StepState},
    reconcile::ResumeReport,
    runner::CallResult,
};
use chrono::{DateTime, Utc};
use std::{fmt, future::Future, pin::Pin, sync::Arc};

/// What a workflow returns: its output (JSON, say), or why it stopped.
pub type WorkflowResult = Result<Option<String>, RunError>;

pub(crate) type WorkflowFn =
    Arc<dyn Fn(RunContext) -> Pin<Box<dyn Future<Output = WorkflowResult> + Send>> + Send + Sync>;

/// Why a workflow stopped before finishing. Most come from [`RunContext::step`] through `?`,
/// and the worker does what each says with the run.
#[derive(Debug)]
#[non_exhaustive]
pub enum RunError {
    /// A step waits on its durable timer (its dependency said when to come back): the run is
    /// deferred until then, and claimed again when it is due.
    Parked {
        /// The step.
        step: StepId,
        /// When it wakes.
        until: DateTime<Utc>,
    },
    /// A step was not sent, or its outcome is not known yet: the run is deferred by the
    /// worker's retry delay, and on the next claim unknown steps are reconciled before
    /// anything is sent.
    NotYet {
        /// The step.
        step: StepId,
        /// What happened, in words.
        error: String,
    },
    /// A step failed for good (the dependency answered with an error, or reconciliation found
    /// it failed): the run fails.
    StepFailed(Box<Step>),
    /// A person must decide (a step nobody could reconcile, or a step whose ids were reused
    /// for a different call): the run waits for an operator.
    NeedsHuman {
        /// Why.
        why: String,
    },
    /// The workflow's own failure: the run fails with it.
    Failed(String),
    /// The journal failed: the worker gives the run back, to be claimed again.
    Journal(JournalError),
}

impl RunError {
    /// The workflow's own failure, in words.
    pub fn failed(why: impl Into<String>) -> Self {
        RunError::Failed(why.into())
    }
}

impl fmt::Display for RunError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            RunError::Parked { step, until } => write!(f, "step {step} is parked until {until}"),
            RunError::NotYet { step, error } => write!(f, "step {step} is not done yet: {error}"),
            RunError::StepFailed(step) => write!(
                f,
                "step {} failed ({}): {}",
                step.id,
                step.state,
                step.last_error.as_deref().unwrap_or("no error recorded")
            ),
            RunError::NeedsHuman { why } => write!(f, "a person must decide: {why}"),
            RunError::Failed(why) => f.write_str(why),
            RunError::Journal(e) => e.fmt(f),
        }
    }
}

impl std::error::Error for RunError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            RunError::Journal(e) => Some(e),
            _ => None,
        }
    }
}

impl From<JournalError> for RunError {
    fn from(e: JournalError) -> Self {
        match e {
            JournalError::Parked(step) => RunError::Parked {
                until: step.parked_until.unwrap_or_default(),
                step: step.id,
            },
            JournalError::NeedsReconciliation(step) => match &step.attention {
                Some(why) => RunError::NeedsHuman {
                    why: format!("step {}: {why}", step.id),
                },
                None => RunError::NotYet {
                    error: format!("its outcome is unknown ({})", step.state),
                    step: step.id,
                },
            },
            // The workflow asked for a different call under a recorded step's ids: it is not
            // deterministic, and only a person can say which call is meant.
            e @ JournalError::ArgsChanged { .. } => RunError::NeedsHuman { why: e.to_string() },
            e => RunError::Journal(e),
        }
    }
}

/// What a workflow gets: its run, its input, and [`step`](Self::step) to journal each call.
#[derive(Clone, Debug)]
pub struct RunContext {
    journal: Journal,
    run: Arc<str>,
    workflow: Arc<str>,
    input: Option<Arc<str>>,
}

impl RunContext {
    pub(crate) fn new(journal: Journal, run: &str, workflow: &str, input: Option<&str>) -> Self {
        Self {
            journal,
            run: Arc::from(run),
            workflow: Arc::from(workflow),
            input: input.map(Arc::from),
        }
    }

    /// The run's id.
    pub fn run_id(&self) -> &str {
        &self.run
    }

    /// The workflow's name.
    pub fn workflow(&self) -> &str {
        &self.workflow
    }

    /// The input the run was started with.
    pub fn input(&self) -> Option<&str> {
        self.input.as_deref()
    }

    /// The journal.
    pub fn journal(&self) -> &Journal {
        &self.journal
    }

    /// Runs step `step` of this run, calling `tool` with `args` through `call` (which gets the
    /// step as sent: its key is [`Step::key`]). A step that completed before returns its
    /// recorded result ([`Step::result`]) without a call. `Err` says why the workflow cannot
    /// go on now; pass it up with `?` and the worker does what it says with the run.
    pub async fn step<F, Fut>(
        &self,
        step: &str,
        tool: &str,
        args: &[u8],
        call: F,
    ) -> Result<Step, RunError>
    where
        F: FnOnce(Step) -> Fut,
        Fut: Future<Output = CallResult>,
    {
        self.execute(&StepId::new(&self.run, step, ""), tool, args, call)
            .await
    }

    /// [`step`](Self::step) for a step named by its whole id: one of the several tool calls a
    /// step makes (an agent's turn that asks for three tools), each under its call id, each
    /// journaled and keyed on its own. The id must be of this run.
    pub async fn execute<F, Fut>(
        &self,
        id: &StepId,
        tool: &str,
        args: &[u8],
        call: F,
    ) -> Result<Step, RunError>
    where
        F: FnOnce(Step) -> Fut,
        Fut: Future<Output = CallResult>,
    {
        self.owns(id)?;
        let step = self.journal.execute(id, tool, args, call).await?;
        Self::went_on(step)
    }

    /// Undoes the action `action` of this run, deliberately, through `call`, as
    /// [`Journal::compensate`] does: the compensation is a step of its own
    /// (`<step>:compensate`), and once it succeeds the action is marked
    /// [`Compensated`](StepState::Compensated), which this returns. A compensation that did not
    /// succeed says why the workflow cannot go on, as [`step`](Self::step) does.
    pub async fn compensate<F, Fut>(
        &self,
        action: &StepId,
        tool: &str,
        args: &[u8],
        call: F,
    ) -> Result<Step, RunError>
    where
        F: FnOnce(Step) -> Fut,
        Fut: Future<Output = CallResult>,
    {
        self.owns(action)?;
        let step = self.journal.compensate(action, tool, args, call).await?;
        Self::went_on(step)
    }

    /// Refuses a step of another run: a workflow journals and undoes its own steps only.
    fn owns(&self, id: &StepId) -> Result<(), RunError> {
        if *id.run == *self.run {
            return Ok(());
        }
        Err(RunError::failed(format!(
            "step {id} belongs to another run than {}",
            self.run
        )))
    }

    /// A step as the journal left it: done (its result stands), or why the run cannot go on.
    fn went_on(step: Step) -> Result<Step, RunError> {
        match step.state {
            s if s.succeeded() || s == StepState::Compensated => Ok(step),
            StepState::Parked => Err(RunError::Parked {
                until: step.parked_until.unwrap_or_default(),
                step: step.id,
            }),
            StepState::FailedAfterExecution | StepState::ReconciledFailed => {
                Err(RunError::StepFailed(Box::new(step)))
            }
            state => Err(RunError::NotYet {
                error: step.last_error.unwrap_or_else(|| format!("it is {state}")),
                step: step.id,
            }),
        }
    }
}

/// How a worker's turn with a run ended.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum RunEnd {
    /// The workflow finished it, with this output.
    Succeeded {
        /// The output.
        output: Option<String>,
    },
    /// It failed.
    Failed {
        /// Why.
        error: String,
    },
    /// An operator cancelled it: the worker stopped running it.
    Cancelled,
    /// It waits for a person.
    NeedsHuman {
        /// Why.
        why: String,
    },
    /// It is pending, and not claimed again before `until` (a parked step's timer, or a step
    /// to try again).
    Deferred {
        /// When it can be claimed again.
        until: DateTime<Utc>,
        /// Why.
        why: String,
    },
    /// The worker gave it back, pending (it shut down, it lost its lease, or the journal
    /// failed): another claim runs it.
    Released {
        /// Why.
        why: String,
    },
}

/// What a worker did with one run.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct RunReport {
    /// The run.
    pub run: String,
    /// What reconciliation did before the workflow ran.
    pub reconciled: ResumeReport,
    /// How it ended.
    pub end: RunEnd,
}
