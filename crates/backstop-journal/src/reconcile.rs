//! Resuming a run after a crash: done steps return their stored result, unsent ones are sent,
//! unknown ones are reconciled first through their tool's hook, parked ones wake at their time,
//! and what nobody can tell goes to a person.

use crate::{
    JournalError,
    journal::{Journal, later},
    model::{Step, StepId, StepState},
    steps::Change,
};
use chrono::{DateTime, Utc};
use std::{collections::HashMap, fmt, future::Future, pin::Pin, sync::Arc, time::Duration};
use tokio::time::Instant;

/// What resuming a run does with a step.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Next {
    /// Over: return its stored result, do not call again.
    Done,
    /// Not sent (or known not to have happened): send it, with the same key.
    Resend,
    /// Sent and unknown: ask the tool's [`Reconcile`] hook before anything else.
    Reconcile,
    /// Parked until this time.
    Wake {
        /// When.
        at: DateTime<Utc>,
    },
    /// A person must decide (`backstop journal resolve`).
    Human {
        /// Why.
        why: String,
    },
}

impl Next {
    /// What to do with `step` at `now`.
    pub(crate) fn for_step(step: &Step, now: DateTime<Utc>) -> Next {
        if let Some(why) = &step.attention {
            return Next::Human { why: why.clone() };
        }
        match step.state {
            s if s.is_final() => Next::Done,
            StepState::Pending | StepState::FailedBeforeExecution => Next::Resend,
            StepState::Parked => match step.parked_until {
                Some(at) if at > now => Next::Wake { at },
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

impl Reconciled {
    /// It happened, and the provider's answer was `value`: what a typed step
    /// ([`RunContext::run`](crate::RunContext::run)) stores, as JSON, so the workflow reads it
    /// as the value it would have returned. A value that cannot be written as JSON cannot be
    /// stored: a person decides.
    ///
    /// ```
    /// use backstop_journal::Reconciled;
    ///
    /// assert_eq!(
    ///     Reconciled::happened(&"refund 4200"),
    ///     Reconciled::Happened { result: Some("\"refund 4200\"".into()), provider_ref: None },
    /// );
    /// ```
    pub fn happened<T: serde::Serialize + ?Sized>(value: &T) -> Reconciled {
        match serde_json::to_string(value) {
            Ok(json) => Reconciled::Happened {
                result: Some(json),
                provider_ref: None,
            },
            Err(e) => Reconciled::CannotTell {
                why: format!("it happened, and its answer cannot be written as JSON: {e}"),
            },
        }
    }
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
    pub parked: Vec<(StepId, DateTime<Utc>)>,
}

impl Journal {
    /// What resuming `run` does with each of its steps, now.
    pub async fn plan(&self, run: &str) -> Result<Vec<(Step, Next)>, JournalError> {
        let now = self.now();
        let steps = self.runs().steps(run).await?;
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
                Next::Wake { at } => report.parked.push((id, at)),
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
                let expired = hook
                    .key_ttl()
                    .zip(step.sent_at)
                    .is_some_and(|(ttl, sent)| self.now() > later(sent, ttl));
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
