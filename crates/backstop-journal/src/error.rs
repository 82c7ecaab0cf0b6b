//! Why a journal operation failed.

use crate::{
    journal::CallIdentity,
    model::{Step, StepId, StepState},
};
use backstop_core::BoxError;
use std::{error::Error, fmt};

/// What kind of failure a [`JournalError`] is: the one classification the CLI's exit codes and
/// the console's HTTP statuses both come from.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum ErrorKind {
    /// No such run or step (the CLI exits 3, the console answers 404).
    NotFound,
    /// The run or the step is not in a state that allows it, or another worker moved it first:
    /// nothing was written (the CLI exits 4, the console answers 409).
    Refused,
    /// The journal's database failed (the CLI exits 1, the console answers 503).
    Store,
}

/// Why a journal operation failed. Nothing is half-written: each operation is one transaction.
#[derive(Debug)]
#[non_exhaustive]
pub enum JournalError {
    /// The database could not be reached, refused the statement, or holds a row this journal
    /// cannot read: the database's own error is the `source()`.
    Store(BoxError),
    /// The step is not where the caller expected (another worker moved it, or the move is not
    /// allowed): nothing was written.
    Conflict {
        /// The step.
        id: StepId,
        /// Where the caller expected it.
        expected: Vec<StepState>,
        /// Where it is (`None`: not recorded).
        found: Option<StepState>,
        /// The move asked for.
        to: StepState,
    },
    /// A step with these ids was recorded for another call (another tool, or other
    /// arguments): the new call is refused, and nothing is sent.
    ArgsChanged {
        /// The step.
        id: StepId,
        /// The recorded call.
        recorded: Box<CallIdentity>,
        /// The refused call.
        refused: Box<CallIdentity>,
    },
    /// The step's outcome is unknown: it must be reconciled before anything sends it again.
    NeedsReconciliation(Box<Step>),
    /// No such run or step.
    NotFound(String),
    /// The step is over already: it was not sent again (its stored result is in the step).
    AlreadyDone(Box<Step>),
    /// The step is parked until its time: it was not sent.
    Parked(Box<Step>),
    /// The run cannot do what was asked (it is over, it was started as another workflow, or
    /// another worker holds it): nothing was written.
    RunRefused {
        /// The run.
        run: String,
        /// Why, in words.
        why: String,
    },
}

impl fmt::Display for JournalError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            JournalError::Store(_) => f.write_str("the journal's database failed"),
            JournalError::Conflict {
                id,
                expected,
                found,
                to,
            } => {
                let expected: Vec<_> = expected.iter().map(|s| s.as_str()).collect();
                match found {
                    Some(found) => write!(
                        f,
                        "step {id} is {found}, not {}: it was not moved to {to}",
                        expected.join(" or ")
                    ),
                    None => write!(
                        f,
                        "step {id} is not in the journal: it was not moved to {to}"
                    ),
                }
            }
            JournalError::ArgsChanged {
                id,
                recorded,
                refused,
            } => write!(
                f,
                "step {id} was recorded for a call to {} with arguments {}, and this call to {} \
                 has arguments {}: a different call cannot reuse a step's ids (it was not sent)",
                recorded.tool,
                short(&recorded.args_digest),
                refused.tool,
                short(&refused.args_digest)
            ),
            JournalError::NeedsReconciliation(step) => write!(
                f,
                "step {} was sent and its outcome is unknown ({}): reconcile it before sending it again",
                step.id, step.state
            ),
            JournalError::NotFound(what) => write!(f, "{what} is not in the journal"),
            JournalError::AlreadyDone(step) => write!(
                f,
                "step {} is already {} (the journal has its result): it was not sent again",
                step.id, step.state
            ),
            JournalError::Parked(step) => write!(
                f,
                "step {} is parked until {} (its dependency asked to wait): it was not sent",
                step.id,
                step.parked_until.unwrap_or_default()
            ),
            JournalError::RunRefused { run, why } => write!(f, "run {run}: {why}"),
        }
    }
}

impl Error for JournalError {
    fn source(&self) -> Option<&(dyn Error + 'static)> {
        match self {
            JournalError::Store(e) => Some(&**e),
            _ => None,
        }
    }
}

impl JournalError {
    /// The database failed with `cause`.
    pub(crate) fn store(cause: impl Into<BoxError>) -> Self {
        JournalError::Store(cause.into())
    }

    /// What kind of failure this is.
    ///
    /// ```
    /// use backstop_journal::{ErrorKind, JournalError};
    ///
    /// let missing = JournalError::NotFound("run r-1".into());
    /// assert_eq!(missing.kind(), ErrorKind::NotFound);
    /// ```
    pub fn kind(&self) -> ErrorKind {
        match self {
            JournalError::Store(_) => ErrorKind::Store,
            JournalError::NotFound(_) => ErrorKind::NotFound,
            JournalError::Conflict { .. }
            | JournalError::ArgsChanged { .. }
            | JournalError::NeedsReconciliation(_)
            | JournalError::AlreadyDone(_)
            | JournalError::Parked(_)
            | JournalError::RunRefused { .. } => ErrorKind::Refused,
        }
    }
}

/// A digest as shown in words: its first 12 characters.
fn short(digest: &str) -> String {
    match digest.get(..12) {
        Some(head) if digest.len() > 12 => format!("{head}…"),
        _ => digest.to_owned(),
    }
}

impl From<sqlx::Error> for JournalError {
    fn from(e: sqlx::Error) -> Self {
        JournalError::store(e)
    }
}

/// The schema could not be applied: a store failure, its cause kept.
impl From<sqlx::migrate::MigrateError> for JournalError {
    fn from(e: sqlx::migrate::MigrateError) -> Self {
        JournalError::store(e)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_database_failure_keeps_the_databases_error_as_its_source() {
        let e = JournalError::from(sqlx::Error::PoolTimedOut);
        assert_eq!(e.kind(), ErrorKind::Store);
        let source = e.source().expect("the database's error");
        assert!(source.is::<sqlx::Error>(), "{source:?}");
        assert_eq!(e.to_string(), "the journal's database failed");
    }

    #[test]
    fn every_refusal_is_one_kind() {
        let refusal = JournalError::RunRefused {
            run: "r-1".into(),
            why: "it is over".into(),
        };
        assert_eq!(refusal.kind(), ErrorKind::Refused);
        assert_eq!(
            JournalError::NotFound("run r-1".into()).kind(),
            ErrorKind::NotFound
        );
        assert!(refusal.source().is_none());
    }
}
