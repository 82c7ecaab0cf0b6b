//! What the journal records: steps, their states, and every transition.

use backstop_core::Outcome;
use chrono::{DateTime, Utc};
use serde::{Serialize, Serializer};
use std::{fmt, str::FromStr, sync::Arc};

/// Identifies one step of a run: the run, the step within it, and the tool call within the
/// step (empty when a step makes one call).
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize)]
pub struct StepId {
    /// The run (an agent task, a workflow instance).
    pub run: Arc<str>,
    /// The step within the run.
    pub step: Arc<str>,
    /// The tool call within the step ("" when there is one).
    pub call: Arc<str>,
}

impl StepId {
    /// A step's id.
    pub fn new(run: &str, step: &str, call: &str) -> Self {
        StepId {
            run: Arc::from(run),
            step: Arc::from(step),
            call: Arc::from(call),
        }
    }
}

impl fmt::Display for StepId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.call.is_empty() {
            write!(f, "{}/{}", self.run, self.step)
        } else {
            write!(f, "{}/{}/{}", self.run, self.step, self.call)
        }
    }
}

/// Where a step is. Every change is written durably, with the time, the attempt count and the
/// last error, before anything that depends on it happens.
///
/// ```text
/// pending -> sent -> succeeded
///                 -> failed_before_execution   (not sent: safe to send again)
///                 -> failed_after_execution    (the dependency answered with an error)
///                 -> unknown -> requires_reconciliation -> reconciled_succeeded
///                                                       -> reconciled_failed
///                                                       -> pending (it did not happen)
/// pending | failed_before_execution -> parked (until a time) -> sent | pending
/// succeeded | reconciled_succeeded -> compensated
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum StepState {
    /// Recorded, not sent yet.
    Pending,
    /// Handed to the dependency; what happened is not known yet. A step found here after a
    /// crash is unknown.
    Sent,
    /// The dependency answered with success.
    Succeeded,
    /// It never took effect (not sent, refused before doing anything): safe to send again.
    FailedBeforeExecution,
    /// The dependency answered with an error: final.
    FailedAfterExecution,
    /// Sent, and no answer came (a timeout, a lost reply, a crash): it may have happened.
    Unknown,
    /// Unknown, and waiting for the tool's reconcile hook (or a person) to find out.
    RequiresReconciliation,
    /// Reconciliation found that it happened.
    ReconciledSucceeded,
    /// Reconciliation found that it was processed and failed.
    ReconciledFailed,
    /// Its effect was undone by a compensation (journaled as a step of its own).
    Compensated,
    /// Waiting on a durable timer (the dependency's circuit is open) instead of spinning.
    Parked,
}

impl StepState {
    /// Every state, in the order of the diagram above.
    pub(crate) const ALL: [StepState; 11] = [
        StepState::Pending,
        StepState::Sent,
        StepState::Succeeded,
        StepState::FailedBeforeExecution,
        StepState::FailedAfterExecution,
        StepState::Unknown,
        StepState::RequiresReconciliation,
        StepState::ReconciledSucceeded,
        StepState::ReconciledFailed,
        StepState::Compensated,
        StepState::Parked,
    ];

    /// The name stored and shown: `pending`, `sent`, `succeeded`, ...
    pub const fn as_str(self) -> &'static str {
        match self {
            StepState::Pending => "pending",
            StepState::Sent => "sent",
            StepState::Succeeded => "succeeded",
            StepState::FailedBeforeExecution => "failed_before_execution",
            StepState::FailedAfterExecution => "failed_after_execution",
            StepState::Unknown => "unknown",
            StepState::RequiresReconciliation => "requires_reconciliation",
            StepState::ReconciledSucceeded => "reconciled_succeeded",
            StepState::ReconciledFailed => "reconciled_failed",
            StepState::Compensated => "compensated",
            StepState::Parked => "parked",
        }
    }

    /// What is known of the step's side effect, in Backstop's terms.
    pub const fn outcome(self) -> Outcome {
        match self {
            StepState::Pending | StepState::FailedBeforeExecution | StepState::Parked => {
                Outcome::NotSent
            }
            StepState::Sent | StepState::Unknown | StepState::RequiresReconciliation => {
                Outcome::Unknown
            }
            StepState::Succeeded
            | StepState::FailedAfterExecution
            | StepState::ReconciledSucceeded
            | StepState::ReconciledFailed
            | StepState::Compensated => Outcome::Completed,
        }
    }

    /// The step is over: it will not be sent again (a compensation is a step of its own).
    pub const fn is_final(self) -> bool {
        matches!(
            self,
            StepState::Succeeded
                | StepState::FailedAfterExecution
                | StepState::ReconciledSucceeded
                | StepState::ReconciledFailed
                | StepState::Compensated
        )
    }

    /// Whether the step ended with its effect in place.
    pub const fn succeeded(self) -> bool {
        matches!(self, StepState::Succeeded | StepState::ReconciledSucceeded)
    }

    /// Whether the journal lets a step move from `self` to `to` on its own (an operator's
    /// repair, [`Resolution`], may do more).
    pub(crate) const fn can_move_to(self, to: StepState) -> bool {
        use StepState::*;
        matches!(
            (self, to),
            (Pending, Sent | FailedBeforeExecution | Parked)
                | (
                    Sent,
                    Succeeded | FailedBeforeExecution | FailedAfterExecution | Unknown
                )
                | (Unknown, RequiresReconciliation)
                | (
                    RequiresReconciliation,
                    ReconciledSucceeded | ReconciledFailed | Pending
                )
                | (FailedBeforeExecution, Sent | Parked)
                | (Parked, Sent | Pending)
                | (Succeeded | ReconciledSucceeded, Compensated)
        )
    }
}

/// Serialized as its name ([`StepState::as_str`]), as stored and shown.
impl Serialize for StepState {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.serialize_str(self.as_str())
    }
}

impl fmt::Display for StepState {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for StepState {
    type Err = UnknownState;

    fn from_str(s: &str) -> Result<Self, UnknownState> {
        StepState::ALL
            .into_iter()
            .find(|st| st.as_str() == s)
            .ok_or_else(|| UnknownState(s.to_owned()))
    }
}

/// A state name the journal does not know (a newer schema, or a hand-edited row).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct UnknownState(pub(crate) String);

impl fmt::Display for UnknownState {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "unknown step state {:?}", self.0)
    }
}

impl std::error::Error for UnknownState {}

/// What a step is for: an action, or the compensation of one.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum StepKind {
    /// A tool call that does something.
    Action,
    /// A deliberate undoing of an action that succeeded, with its own key and states.
    Compensation,
}

/// Serialized as its name ([`StepKind::as_str`]), as stored and shown.
impl Serialize for StepKind {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.serialize_str(self.as_str())
    }
}

impl StepKind {
    /// `action` or `compensation`.
    pub const fn as_str(self) -> &'static str {
        match self {
            StepKind::Action => "action",
            StepKind::Compensation => "compensation",
        }
    }

    pub(crate) fn parse(s: &str) -> StepKind {
        if s == "compensation" {
            StepKind::Compensation
        } else {
            StepKind::Action
        }
    }
}

/// A step to record before it is sent: its id, the tool it calls, and what is derived from
/// them (the key every attempt sends, the arguments' digest).
#[derive(Clone, Debug)]
pub(crate) struct NewStep {
    pub(crate) id: StepId,
    pub(crate) tool: String,
    /// Derived from the ids, so a resumed run sends the same key.
    pub(crate) key: String,
    /// Tells a resumed step from a different call made under the same ids.
    pub(crate) args_digest: String,
    pub(crate) kind: StepKind,
}

impl NewStep {
    /// The action `id`, calling `tool` with `args`, its key derived from the ids as
    /// [`ActionContext::tool_call`](backstop_idempotency::ActionContext::tool_call) does.
    pub(crate) fn action(id: &StepId, tool: &str, args: &[u8]) -> Self {
        let key = backstop_idempotency::ActionContext::tool_call(&id.run, &id.step, &id.call).key();
        NewStep {
            id: id.clone(),
            tool: tool.to_owned(),
            key: key.as_str().to_owned(),
            args_digest: digest(args),
            kind: StepKind::Action,
        }
    }

    /// The compensation of `action`: a step of its own (`<step>:compensate`), with its own key.
    pub(crate) fn compensation_of(action: &StepId, tool: &str, args: &[u8]) -> Self {
        let step = format!("{}:compensate", action.step);
        let id = StepId::new(&action.run, &step, &action.call);
        NewStep {
            kind: StepKind::Compensation,
            ..NewStep::action(&id, tool, args)
        }
    }
}

/// The arguments' digest as stored: an idempotency-key derivation over the bytes (SHA-256,
/// hex), so equal arguments give equal digests across processes.
pub(crate) fn digest(args: &[u8]) -> String {
    backstop_idempotency::ActionContext::action("", "args", args)
        .key()
        .as_str()
        .to_owned()
}

/// A step as the journal has it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
#[non_exhaustive]
pub struct Step {
    /// Its id.
    pub id: StepId,
    /// The tool it calls.
    pub tool: String,
    /// The idempotency key every attempt sends.
    pub key: String,
    /// The digest of its arguments (a SHA-256 key derivation over their bytes, hex): equal
    /// arguments give equal digests in every process.
    pub args_digest: String,
    /// Action or compensation.
    pub kind: StepKind,
    /// Where it is.
    pub state: StepState,
    /// Attempts sent so far.
    pub attempts: u32,
    /// The last error, in words.
    pub last_error: Option<String>,
    /// What the dependency answered, as the caller recorded it (JSON, say).
    pub result: Option<String>,
    /// The provider's own reference (a message id, an order number), when known.
    pub provider_ref: Option<String>,
    /// When a parked step wakes.
    pub parked_until: Option<DateTime<Utc>>,
    /// Why it waits for a person, when it does.
    pub attention: Option<String>,
    /// When it was recorded.
    pub created_at: DateTime<Utc>,
    /// When it last changed.
    pub updated_at: DateTime<Utc>,
    /// When it was last sent, if ever.
    pub sent_at: Option<DateTime<Utc>>,
}

/// One recorded change of a step's state.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
#[non_exhaustive]
pub struct StepTransition {
    /// The step.
    pub id: StepId,
    /// From (`None`: the step was recorded).
    pub from: Option<StepState>,
    /// To.
    pub to: StepState,
    /// When.
    pub at: DateTime<Utc>,
    /// The attempt count after it.
    pub attempts: u32,
    /// The error that caused it, if any.
    pub error: Option<String>,
    /// Who made it: `journal` for the journal itself, else the operator's name.
    pub actor: String,
    /// Why, in words (an operator's repair says why).
    pub reason: Option<String>,
}

/// A run, summarised: its record and counts of its steps.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
#[non_exhaustive]
pub struct RunSummary {
    /// The run.
    pub run: String,
    /// Its workflow, when it was started as one.
    pub workflow: Option<String>,
    /// Where it is, as its record says.
    pub state: crate::RunState,
    /// Its steps.
    pub steps: u32,
    /// Steps over (succeeded, failed, reconciled, compensated).
    pub done: u32,
    /// Steps waiting for a person.
    pub needs_human: u32,
    /// Steps parked.
    pub parked: u32,
    /// Steps whose outcome is unknown (sent, unknown, requires reconciliation).
    pub unknown: u32,
    /// When it last changed.
    pub updated_at: DateTime<Utc>,
    /// The worker holding the run, if one does.
    pub claimed_by: Option<String>,
    /// Not claimed before this time, if set.
    pub wake_at: Option<DateTime<Utc>>,
    /// Why it failed, was cancelled, waits for a person or was deferred.
    pub error: Option<String>,
}

/// An operator's repair of a step, recorded with who and why.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Resolution {
    /// It happened (the operator checked with the provider); optionally what it answered.
    Succeeded {
        /// The result to store.
        result: Option<String>,
    },
    /// It did not take effect and must not be retried: final.
    Failed,
    /// It did not take effect: send it again (same key).
    Retry,
}
