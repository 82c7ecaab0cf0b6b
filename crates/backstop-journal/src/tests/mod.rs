//! The journal against real databases, through the worker's claim protocol as well as the
//! public API: a module per concern.

mod journal;
mod model;
mod worker;

use crate::{StepId, model::NewStep};

/// The action `run`/`step`/`call` calling `tool` with `args`, as a test hands it to
/// `Journal::execute_new` (the step described in full, so that a test can read its id).
fn new_step(run: &str, step: &str, call: &str, tool: &str, args: &[u8]) -> NewStep {
    NewStep::action(&StepId::new(run, step, call), tool, args)
}
