//! Typed workflows: a workflow is an `async fn` of its context and a typed input, and each step
//! returns a typed value. Inputs, outputs, step arguments and step results are stored as JSON
//! (`serde_json`), so a run started by another language or by the CLI reads the same records.
//!
//! The string layer stays underneath: [`Workflow::start`] is [`Journal::start_run`] with the
//! input as JSON, [`Worker::register`] is [`Worker::workflow`] decoding that input, and
//! [`RunContext::run`] is [`RunContext::step`] with the arguments and the result as JSON.

use crate::{
    Journal, JournalError, RunRecord, RunState, Worker,
    model::Step,
    runner::CallResult,
    workflow::{RunContext, RunError},
};
use backstop_core::{Outcome, ReportsOutcome};
use serde::{Serialize, de::DeserializeOwned};
use std::{any::type_name, fmt, future::Future, marker::PhantomData, sync::Arc};

/// A workflow's name with the types of its input and output: what starts a run, registers the
/// workflow with a worker, and reads the run's output, each typed.
///
/// ```
/// use backstop_journal::Workflow;
///
/// /// Refunds an order; its output is the refund's id.
/// const REFUND: Workflow<u64, String> = Workflow::new("refund");
/// assert_eq!(REFUND.name(), "refund");
/// ```
pub struct Workflow<In, Out> {
    name: &'static str,
    types: PhantomData<fn(In) -> Out>,
}

impl<In, Out> Workflow<In, Out> {
    /// The workflow named `name` (unique among a journal's workflows).
    pub const fn new(name: &'static str) -> Self {
        Workflow {
            name,
            types: PhantomData,
        }
    }

    /// Its name.
    pub const fn name(&self) -> &'static str {
        self.name
    }
}

impl<In, Out> Clone for Workflow<In, Out> {
    fn clone(&self) -> Self {
        *self
    }
}

impl<In, Out> Copy for Workflow<In, Out> {}

impl<In, Out> fmt::Debug for Workflow<In, Out> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Workflow")
            .field("name", &self.name)
            .field("input", &type_name::<In>())
            .field("output", &type_name::<Out>())
            .finish()
    }
}

impl<In: Serialize, Out: DeserializeOwned> Workflow<In, Out> {
    /// Starts run `run` of this workflow with `input`, as [`Journal::start_run`] does: starting
    /// it again with the same input returns the run as it is; other input under the same id is
    /// refused.
    pub async fn start(
        &self,
        journal: &Journal,
        run: &str,
        input: &In,
    ) -> Result<RunRecord, JournalError> {
        let input = serde_json::to_string(input).map_err(|e| JournalError::RunRefused {
            run: run.to_owned(),
            why: format!("its input cannot be written as JSON: {e}"),
        })?;
        journal.start_run(run, self.name, Some(&input)).await
    }

    /// The output of run `run` once the workflow finished it; `None` while it has not (pending,
    /// failed, cancelled or waiting for a person: [`Runs::get`](crate::Runs::get) says
    /// which).
    /// [`JournalError::NotFound`] when the journal has no such run.
    pub async fn output(&self, journal: &Journal, run: &str) -> Result<Option<Out>, JournalError> {
        let Some(record) = journal.runs().get(run).await? else {
            return Err(JournalError::NotFound(format!("run {run}")));
        };
        if record.state != RunState::Succeeded {
            return Ok(None);
        }
        let output = record.output.as_deref().unwrap_or("null");
        serde_json::from_str(output)
            .map(Some)
            .map_err(|e| JournalError::RunRefused {
                run: run.to_owned(),
                why: format!(
                    "its output does not read as {} (is it a run of workflow {}?): {e}",
                    type_name::<Out>(),
                    self.name
                ),
            })
    }
}

impl Worker {
    /// Registers `workflow`, run by `f` from its context and its input (decoded from the run's
    /// JSON input), its output stored as JSON. Like every workflow, `f` runs again from the top
    /// whenever the run is recovered: steps that completed return their stored results without
    /// a call, so it must call the same steps with the same arguments each time.
    ///
    /// A run whose input does not read as `In` fails, saying why.
    #[must_use]
    pub fn register<In, Out, F, Fut>(self, workflow: Workflow<In, Out>, f: F) -> Self
    where
        In: DeserializeOwned + Send + 'static,
        Out: Serialize + 'static,
        F: Fn(RunContext, In) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = Result<Out, RunError>> + Send + 'static,
    {
        let f = Arc::new(f);
        self.workflow(workflow.name(), move |ctx: RunContext| {
            let f = f.clone();
            async move {
                let input = ctx.input_as::<In>()?;
                let output = f(ctx, input).await?;
                serde_json::to_string(&output).map(Some).map_err(|e| {
                    RunError::failed(format!(
                        "the workflow's output cannot be written as JSON: {e}"
                    ))
                })
            }
        })
    }
}

impl RunContext {
    /// Runs step `step` of this run: `call` gets the step as it is sent (its idempotency key is
    /// [`Step::key`], the same on every attempt and after a crash) and returns the step's value
    /// or an error that says what is known of the side effect ([`ReportsOutcome`]: every
    /// Backstop error does). A step that completed before returns its stored value without a
    /// call.
    ///
    /// The step's tool is its name: the CLI shows it, and a [`Reconcile`](crate::Reconcile)
    /// hook for it is registered under it (`Reconcilers::new().tool("refund", hook)`); a hook
    /// that finds the call happened answers with its value,
    /// [`Reconciled::happened(&value)`](crate::Reconciled::happened).
    ///
    /// `args` identify the call: they are stored as JSON, and a resumed step given other
    /// arguments under the same name is a different call, for a person to decide. The value is
    /// stored as JSON and read back, so the workflow sees the same value on its first run and
    /// on every replay. `Err` says why the workflow cannot go on now; pass it up with `?` and
    /// the worker does what it says with the run (an error not sent is tried again later, an
    /// unknown outcome is reconciled before anything is sent, a completed failure fails the
    /// run).
    pub async fn run<A, T, E, F, Fut>(&self, step: &str, args: &A, call: F) -> Result<T, RunError>
    where
        A: Serialize + ?Sized,
        T: Serialize + DeserializeOwned,
        E: ReportsOutcome + fmt::Display,
        F: FnOnce(Step) -> Fut,
        Fut: Future<Output = Result<T, E>>,
    {
        let args = serde_json::to_vec(args).map_err(|e| {
            RunError::failed(format!(
                "the arguments of step {step} cannot be written as JSON: {e}"
            ))
        })?;
        let done = self
            .step(step, step, &args, |sent| async move {
                match call(sent).await {
                    Ok(value) => match serde_json::to_string(&value) {
                        Ok(json) => CallResult::Succeeded {
                            result: Some(json),
                            provider_ref: None,
                        },
                        // It happened, and what it answered cannot be kept: the run fails
                        // rather than read something else on a replay.
                        Err(e) => CallResult::Failed {
                            outcome: Outcome::Completed,
                            error: format!(
                                "it happened, and its value cannot be written as JSON: {e}"
                            ),
                            retry_after: None,
                        },
                    },
                    Err(e) => CallResult::from_result(&Err::<(), _>(e), |_| None),
                }
            })
            .await?;
        let stored = done.result.as_deref().unwrap_or("null");
        serde_json::from_str(stored).map_err(|e| RunError::NeedsHuman {
            why: format!(
                "step {} completed, and its stored result does not read as {}: {e}",
                done.id,
                type_name::<T>()
            ),
        })
    }

    /// The run's input decoded from JSON: for a workflow registered with
    /// [`Worker::workflow`] that reads its input itself.
    pub fn input_as<In: DeserializeOwned>(&self) -> Result<In, RunError> {
        serde_json::from_str(self.input().unwrap_or("null")).map_err(|e| {
            RunError::failed(format!(
                "the run's input does not read as {}: {e}",
                type_name::<In>()
            ))
        })
    }
}
