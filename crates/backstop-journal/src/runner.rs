//! Running a step through the journal, and resuming a run after a crash: done steps return
//! their stored result, unsent ones are sent, unknown ones are reconciled first, parked ones
//! wake at their time, and what nobody can tell goes to a person.

use crate::{
    JournalError,
    journal::Journal,
    model::{NewStep, Step, StepId, StepState},
    steps::Change,
};
use backstop_core::Outcome;
use std::{collections::HashMap, fmt, future::Future, pin::Pin, sync::Arc, time::Duration};
use tokio::time::Instant;

/// How a call ended, as the journal records it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum CallResult {
    /// The dependency did it.
    Succeeded {
        /// What it answered, to store and return on resume (JSON, say).
        result: Option<String>,
        /// Its own reference for what it did (a message id, an order number).
        provider_ref: Option<String>,
    },
    /// It failed, and this much is known of the side effect.
    Failed {
        /// Not sent (safe to send again), unknown (reconcile first) or completed (final).
        outcome: Outcome,
        /// The error, in words.
        error: String,
        /// When the dependency can be tried again, if it said (an open circuit, a
        /// `Retry-After`): a step not sent parks until then.
        retry_after: Option<Duration>,
    },
}

impl CallResult {
    /// The result of a call whose error reports its outcome (every Backstop error does).
    pub fn from_result<T, E>(
        result: &Result<T, E>,
        stored: impl FnOnce(&T) -> Option<String>,
    ) -> Self
    where
        E: backstop_core::ReportsOutcome + fmt::Display,
    {
        match result {
            Ok(value) => CallResult::Succeeded {
                result: stored(value),
                provider_ref: None,
            },
            Err(e) => CallResult::Failed {
                outcome: e.outcome(),
                error: e.to_string(),
                retry_after: e.retry_after(),
            },
        }
    }
}

/// Whether a step is to be sent.
pub(crate) enum ToSend {
    /// Sent: call it.
    Send(Step),
    /// Over: its stored result stands.
    Done(Step),
    /// Parked until its time.
    Parked(Step),
}

/// What resuming a run does with a step.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Next {
    /// Over: return its stored result, do not call again.
    Done,
    /// Not sent (or known not to have happened): send it, with the same key.
    Resend,
    /// Sent and unknown: ask the tool's [`Reconcile`] hook before anything else.
    Reconcile,
    /// Parked until this time (milliseconds since the Unix epoch).
    Wake {
        /// When.
        at_ms: i64,
    },
    /// A person must decide (`backstop journal resolve`).
    Human {
        /// Why.
        why: String,
    },
}

impl Next {
    /// What to do with `step` at `now_ms`.
    pub fn for_step(step: &Step, now_ms: i64) -> Next {
        if let Some(why) = &step.attention {
            return Next::Human { why: why.clone() };
        }
        match step.state {
            s if s.is_final() => Next::Done,
            StepState::Pending | StepState::FailedBeforeExecution => Next::Resend,
            StepState::Parked => match step.park_until {
                Some(at_ms) if at_ms > now_ms => Next::Wake { at_ms },
                _ => Next::Resend,
            },
            _ => Next::Reconcile,
        }
    }
}

/// What a tool's reconcile hook found out about a step whose outcome was unknown.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Reconciled {
    /// It happened (the provider has it, by key or by business identity).
    Happened {
        /// What it answered, to store.
        result: Option<String>,
        /// Its reference.
        provider_ref: Option<String>,
    },
    /// It was processed and failed: final.
    Failed {
        /// The provider's error.
        error: String,
    },
    /// The provider has no trace of it: it is safe to send again.
    NotHappened,
    /// The provider cannot say: a person decides.
    CannotTell {
        /// Why.
        why: String,
    },
}

/// Asks a tool's provider what became of a step that was sent and not answered, by its key
/// or by business identity, before anything sends it again.
pub trait Reconcile: Send + Sync {
    /// What became of `step`.
    fn reconcile<'a>(
        &'a self,
        step: &'a Step,
    ) -> Pin<Box<dyn Future<Output = Reconciled> + Send + 'a>>;

    /// How long the provider honours a key. A step whose key may have expired there, and that
    /// the hook cannot tell about, goes to a person: resending it could act twice.
    fn key_ttl(&self) -> Option<Duration> {
        None
    }
}

impl<F, Fut> Reconcile for F
where
    F: Fn(&Step) -> Fut + Send + Sync,
    Fut: Future<Output = Reconciled> + Send + 'static,
{
    fn reconcile<'a>(
        &'a self,
        step: &'a Step,
    ) -> Pin<Box<dyn Future<Output = Reconciled> + Send + 'a>> {
        Box::pin(self(step))
    }
}

/// The reconcile hooks of a runtime's tools, by tool name.
#[derive(Clone, Default)]
pub struct Reconcilers {
    hooks: HashMap<String, Arc<dyn Reconcile>>,
}

impl fmt::Debug for Reconcilers {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Reconcilers")
            .field("tools", &self.hooks.keys().collect::<Vec<_>>())
            .finish()
    }
}

impl Reconcilers {
    /// No hooks: every unknown step goes to a person.
    pub fn new() -> Self {
        Reconcilers::default()
    }

    /// `hook` reconciles the steps of `tool`.
    #[must_use]
    pub fn tool(mut self, tool: &str, hook: impl Reconcile + 'static) -> Self {
        self.hooks.insert(tool.to_owned(), Arc::new(hook));
        self
    }
}

/// What [`Journal::reconcile_run`] did to a run.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct ResumeReport {
    /// Steps over.
    pub done: Vec<StepId>,
    /// Steps to send (again), with their keys: not sent, or known not to have happened.
    pub resend: Vec<StepId>,
    /// Steps reconciled to a known state just now.
    pub reconciled: Vec<StepId>,
    /// Steps waiting for a person.
    pub human: Vec<StepId>,
    /// Parked steps and when they wake.
    pub parked: Vec<(StepId, i64)>,
}

impl Journal {
    /// Runs one step through the journal: records it (`pending`), writes `sent` before
    /// calling, then what came of it. A step already over returns as it is, without calling
    /// (its stored result is in [`Step::result`]); a step whose outcome is unknown is refused
    /// ([`JournalError::NeedsReconciliation`]); a parked step not due yet returns parked.
    pub async fn execute<F, Fut>(&self, new: &NewStep, call: F) -> Result<Step, JournalError>
    where
        F: FnOnce(Step) -> Fut,
        Fut: Future<Output = CallResult>,
    {
        match self.to_send(new).await? {
            ToSend::Send(sent) => {
                let result = call(sent).await;
                self.record(&new.id, result).await
            }
            ToSend::Done(step) | ToSend::Parked(step) => Ok(step),
        }
    }

    /// Makes `new` ready to send: a step never seen before is recorded as sent in one write;
    /// a recorded one is read and sent again only when the journal says so (not sent, or
    /// known not to have happened). A step whose outcome is unknown is refused.
    pub(crate) async fn to_send(&self, new: &NewStep) -> Result<ToSend, JournalError> {
        if let Some(sent) = self.send_new(new).await? {
            return Ok(ToSend::Send(sent));
        }
        let step = self.begin(new).await?;
        match Next::for_step(&step, self.now_ms()) {
            Next::Done => {
                crate::obs::duplicate_prevented(&step);
                Ok(ToSend::Done(step))
            }
            Next::Wake { .. } => Ok(ToSend::Parked(step)),
            Next::Reconcile | Next::Human { .. } => {
                Err(JournalError::NeedsReconciliation(Box::new(step)))
            }
            Next::Resend => {
                let sent = self
                    .transition(&step.id, &[step.state], StepState::Sent, Change::attempt())
                    .await?;
                Ok(ToSend::Send(sent))
            }
        }
    }

    /// Undoes an action that succeeded, deliberately: the compensation is a step of its own
    /// (`<step>:compensate`, its own key, its own states, run through [`execute`](Self::execute)
    /// and so resumable like any step), and once it succeeds the action is marked
    /// `compensated`. An action that did not succeed is refused: there is nothing to undo.
    pub async fn compensate<F, Fut>(
        &self,
        action: &StepId,
        tool: &str,
        args: &[u8],
        call: F,
    ) -> Result<Step, JournalError>
    where
        F: FnOnce(Step) -> Fut,
        Fut: Future<Output = CallResult>,
    {
        let done = [StepState::Succeeded, StepState::ReconciledSucceeded];
        let original = self
            .step(action)
            .await?
            .ok_or_else(|| JournalError::NotFound(format!("step {action}")))?;
        if original.state == StepState::Compensated {
            return Ok(original);
        }
        if !done.contains(&original.state) {
            return Err(JournalError::Conflict {
                id: action.clone(),
                expected: done.to_vec(),
                found: Some(original.state),
                to: StepState::Compensated,
            });
        }
        let undo = NewStep::compensation_of(action, tool, args);
        let undone = self.execute(&undo, call).await?;
        if !undone.state.succeeded() {
            return Ok(undone);
        }
        let change = Change {
            reason: Some(format!("compensated by step {}", undone.id)),
            ..Change::default()
        };
        self.transition(action, &done, StepState::Compensated, change)
            .await
    }

    /// Records how a sent step's call ended.
    pub async fn record(&self, id: &StepId, result: CallResult) -> Result<Step, JournalError> {
        match result {
            CallResult::Succeeded {
                result,
                provider_ref,
            } => {
                let change = Change {
                    result,
                    provider_ref,
                    ..Change::default()
                };
                let step = self.outcome(id, StepState::Succeeded, change).await?;
                crate::obs::succeeded(&step);
                Ok(step)
            }
            CallResult::Failed {
                outcome,
                error,
                retry_after,
            } => {
                let to = match outcome {
                    Outcome::NotSent => StepState::FailedBeforeExecution,
                    Outcome::Completed => StepState::FailedAfterExecution,
                    Outcome::Unknown => StepState::Unknown,
                };
                let change = Change {
                    error: Some(error),
                    ..Change::default()
                };
                let step = self.outcome(id, to, change).await?;
                if to == StepState::Unknown {
                    crate::obs::unknown(&step);
                }
                match retry_after {
                    // The dependency said when: park on a durable timer instead of spinning.
                    Some(after) if to == StepState::FailedBeforeExecution => {
                        self.park(id, after).await
                    }
                    _ => Ok(step),
                }
            }
        }
    }

    /// Sent step `id` ended as `to`: one write, or the general move's refusal when the step is
    /// not `sent` any more.
    async fn outcome(
        &self,
        id: &StepId,
        to: StepState,
        change: Change,
    ) -> Result<Step, JournalError> {
        match self.finish_sent(id, to, &change).await? {
            Some(step) => Ok(step),
            None => self.transition(id, &[StepState::Sent], to, change).await,
        }
    }

    /// Parks a step that was not sent until `after` from now.
    pub async fn park(&self, id: &StepId, after: Duration) -> Result<Step, JournalError> {
        let at = self
            .now_ms()
            .saturating_add(i64::try_from(after.as_millis()).unwrap_or(i64::MAX));
        self.transition(
            id,
            &[StepState::Pending, StepState::FailedBeforeExecution],
            StepState::Parked,
            Change {
                park_until: Some(at),
                ..Change::default()
            },
        )
        .await
    }

    /// What resuming `run` does with each of its steps, now.
    pub async fn plan(&self, run: &str) -> Result<Vec<(Step, Next)>, JournalError> {
        let now = self.now_ms();
        let steps = self.run(run).await?;
        if steps.is_empty() {
            return Err(JournalError::NotFound(format!("run {run}")));
        }
        Ok(steps
            .into_iter()
            .map(|s| {
                let next = Next::for_step(&s, now);
                (s, next)
            })
            .collect())
    }

    /// Brings every step of `run` whose outcome is unknown to a known state before anything
    /// is sent again: a step left `sent` by a crash becomes `unknown`, then
    /// `requires_reconciliation`, and its tool's hook decides (happened, failed, not
    /// happened: to be sent again; or it cannot tell, and a person decides). Returns what each
    /// step needs now.
    pub async fn reconcile_run(
        &self,
        run: &str,
        hooks: &Reconcilers,
    ) -> Result<ResumeReport, JournalError> {
        let mut report = ResumeReport::default();
        for (step, next) in self.plan(run).await? {
            let id = step.id.clone();
            match next {
                Next::Done => report.done.push(id),
                Next::Resend => report.resend.push(id),
                Next::Wake { at_ms } => report.parked.push((id, at_ms)),
                Next::Human { .. } => report.human.push(id),
                Next::Reconcile => match self.reconcile_step(step, hooks).await? {
                    Next::Done => report.reconciled.push(id),
                    Next::Resend => report.resend.push(id),
                    _ => report.human.push(id),
                },
            }
        }
        Ok(report)
    }

    async fn reconcile_step(&self, step: Step, hooks: &Reconcilers) -> Result<Next, JournalError> {
        let started = Instant::now();
        let id = step.id.clone();
        let mut step = step;
        if step.state == StepState::Sent {
            step = self
                .transition(
                    &id,
                    &[StepState::Sent],
                    StepState::Unknown,
                    Change {
                        error: Some("no outcome was recorded for this attempt (the worker stopped while it was sent)".into()),
                        ..Change::default()
                    },
                )
                .await?;
            crate::obs::unknown(&step);
        }
        if step.state == StepState::Unknown {
            step = self
                .transition(
                    &id,
                    &[StepState::Unknown],
                    StepState::RequiresReconciliation,
                    Change::default(),
                )
                .await?;
        }
        let Some(hook) = hooks.hooks.get(&step.tool) else {
            let why = format!(
                "no reconcile hook for tool {:?}: check with the provider by key {}",
                step.tool, step.key
            );
            return self.needs_human(&step, why).await;
        };
        let found = hook.reconcile(&step).await;
        crate::obs::reconciled(&step, started.elapsed());
        let from = [StepState::RequiresReconciliation];
        match found {
            Reconciled::Happened {
                result,
                provider_ref,
            } => {
                let change = Change {
                    result,
                    provider_ref,
                    reason: Some("the provider has it".into()),
                    ..Change::default()
                };
                self.transition(&id, &from, StepState::ReconciledSucceeded, change)
                    .await?;
                Ok(Next::Done)
            }
            Reconciled::Failed { error } => {
                let change = Change {
                    error: Some(error),
                    reason: Some("the provider processed it and it failed".into()),
                    ..Change::default()
                };
                self.transition(&id, &from, StepState::ReconciledFailed, change)
                    .await?;
                Ok(Next::Done)
            }
            Reconciled::NotHappened => {
                let change = Change {
                    reason: Some("the provider has no trace of it: safe to send again".into()),
                    ..Change::default()
                };
                self.transition(&id, &from, StepState::Pending, change)
                    .await?;
                Ok(Next::Resend)
            }
            Reconciled::CannotTell { why } => {
                let expired = hook.key_ttl().zip(step.sent_ms).is_some_and(|(ttl, sent)| {
                    let ttl = i64::try_from(ttl.as_millis()).unwrap_or(i64::MAX);
                    self.now_ms() > sent.saturating_add(ttl)
                });
                let why = if expired {
                    format!(
                        "{why}; the key's time to live at the provider has passed, so sending it again could act twice"
                    )
                } else {
                    why
                };
                self.needs_human(&step, why).await
            }
        }
    }

    /// Marks `step` as waiting for a person (it keeps its state).
    async fn needs_human(&self, step: &Step, why: String) -> Result<Next, JournalError> {
        let change = Change {
            attention: Some(why.clone()),
            reason: Some(why.clone()),
            ..Change::default()
        };
        let step = self
            .move_step(&step.id, &[step.state], step.state, change, true)
            .await?;
        self.run_waits_for_person(&step.id.run, &format!("step {}: {why}", step.id))
            .await?;
        crate::obs::human(&step);
        Ok(Next::Human { why })
    }
}
