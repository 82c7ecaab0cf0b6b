//! A durable step journal for tool calls: the missing third goal, correctness after partial
//! failure.
//!
//! Retries keep a call alive inside one process; the journal keeps a *run* correct across
//! processes. Every step of a run (a tool call, identified by run, step and call ids) is written
//! durably at each transition, before anything that depends on it happens: `pending`, then
//! `sent` before the call leaves, then what came of it. After a crash a recovery worker claims
//! the run (a [`Worker`]: `FOR UPDATE SKIP LOCKED` on PostgreSQL) and resumes it:
//! a done step returns its stored result and is not called again, a step never sent is sent,
//! a step whose outcome is unknown is *reconciled* with its provider first
//! ([`Journal::reconcile_run`] with a [`Reconcile`] hook per tool: by key or by business
//! identity), a parked step waits for its time, and whatever nobody can tell goes to a person
//! (`backstop journal stuck`, `backstop journal resolve`).
//!
//! Stores: one SQLite file, the default ([`Journal::sqlite`]; in memory for unit tests), or
//! PostgreSQL for several workers ([`Journal::postgres`], feature `postgres`); the same schema,
//! applied on open by sqlx's migrations (`migrations/`, one directory per store).
//!
//! ```
//! use backstop_journal::{CallResult, Journal, StepId, StepState};
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), backstop_journal::JournalError> {
//! let journal = Journal::in_memory().await?;
//! let step = StepId::new("run-7", "create-invoice", "c1");
//! let args = br#"{"amount":40}"#;
//! let done = journal
//!     .execute(&step, "billing", args, |sent| async move {
//!         // `sent.key` is the idempotency key every attempt sends.
//!         assert_eq!(sent.state, StepState::Sent);
//!         CallResult::Succeeded { result: Some(r#"{"invoice":"inv_1"}"#.into()), provider_ref: None }
//!     })
//!     .await?;
//! assert_eq!(done.state, StepState::Succeeded);
//!
//! // The run resumes after a crash: the step is done and is not called again.
//! let again = journal.execute(&step, "billing", args, |_| async { unreachable!("not called") }).await?;
//! assert_eq!(again.result.as_deref(), Some(r#"{"invoice":"inv_1"}"#));
//! # Ok(())
//! # }
//! ```
#![forbid(unsafe_code)]
// docs.rs (nightly, `--cfg docsrs`) badges every item behind a feature with it.
#![cfg_attr(docsrs, feature(doc_cfg))]
#![deny(missing_docs)]

#[cfg(not(any(feature = "sqlite", feature = "postgres")))]
compile_error!(
    "backstop-journal needs a store: enable its `sqlite` feature (the default), `postgres`, or both"
);

mod audience;
mod error;
mod fork;
mod journal;
mod layer;
mod model;
mod obs;
mod operator;
mod reconcile;
mod rows;
mod run;
mod run_claim;
mod runner;
mod send;
mod steps;
mod store;
#[cfg(test)]
mod tests;
mod typed;
mod worker;
mod workflow;

pub use audience::{Operator, Runs};
pub use error::{ErrorKind, JournalError};
pub use journal::{CallIdentity, Clock, Journal};
pub use layer::{
    ByOutcome, CallArgs, JournalLayer, Journaled, JournaledError, Judge, RequestLine, StatedArgs,
    StepArgs,
};
pub use model::{
    Resolution, RunSummary, Step, StepId, StepKind, StepState, StepTransition, UnknownState,
};
pub use reconcile::{Next, Reconcile, Reconciled, Reconcilers, ResumeReport};
pub use run::{ForkPoint, RunEvent, RunFilter, RunRecord, RunState};
pub use runner::CallResult;
pub use typed::Workflow;
pub use worker::Worker;
pub use workflow::{RunContext, RunEnd, RunError, RunReport, WorkflowResult};

/// The crate the journal's times come from: every time it records is a
/// `chrono::DateTime<chrono::Utc>`, kept to the millisecond.
///
/// ```
/// use backstop_journal::chrono::TimeDelta;
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), backstop_journal::JournalError> {
/// let journal = backstop_journal::Journal::in_memory().await?;
/// let run = journal.start_run("refund-7", "refund", None).await?;
/// assert!(journal.now() - run.created_at < TimeDelta::minutes(1));
/// # Ok(())
/// # }
/// ```
pub use chrono;
