//! The journal by audience: [`Runs`], what anyone may read (runs, their steps and histories),
//! and [`Operator`], what an operator does to a run or a step, each recorded with who and why.
//! A workflow's author needs neither: [`Workflow`](crate::Workflow), the
//! [`Worker`](crate::Worker) and [`RunContext`](crate::RunContext) are theirs.

use crate::Journal;

impl Journal {
    /// Reads: runs, their steps, their histories, what is stuck.
    pub fn runs(&self) -> Runs<'_> {
        Runs(self)
    }

    /// An operator's actions: cancel, fork, resolve, retry, stub.
    pub fn operator(&self) -> Operator<'_> {
        Operator(self)
    }
}

/// What anyone may read of a journal: from [`Journal::runs`].
#[derive(Clone, Copy, Debug)]
pub struct Runs<'a>(pub(crate) &'a Journal);

/// What an operator does to a journal's runs and steps, each recorded with who and why: from
/// [`Journal::operator`].
#[derive(Clone, Copy, Debug)]
pub struct Operator<'a>(pub(crate) &'a Journal);
