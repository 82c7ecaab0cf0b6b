//! The forms that act on a run and its steps, each with the who-and-why fields and the
//! console's token: only those the run's and the step's states allow.

use super::encode;
use backstop_journal::{RunRecord, Step, StepState};
use maud::{Markup, html};

/// The who-and-why fields and the token every form carries.
fn who_fields(token: &str) -> Markup {
    html! {
        input type="hidden" name="token" value=(token);
        label { "Who " input name="who" required; }
        label { "Why " input name="why" required size="40"; }
    }
}

/// The forms for run `record` and its `steps`: those its state allows.
pub(crate) fn forms(token: &str, record: &RunRecord, steps: &[Step]) -> Markup {
    let run = encode(&record.id);
    html! {
        @if !record.state.is_final() {
            form method="post" action=(format!("/runs/{run}/cancel")) {
                strong { "Cancel the run " } (who_fields(token))
                button type="submit" { "Cancel run" }
            }
        } @else if !steps.is_empty() {
            form method="post" action=(format!("/runs/{run}/fork")) {
                strong { "Fork from step " }
                select name="from" { @for s in dedup(steps) { option value=(s) { (s) } } }
                label { " as run " input name="new_run" required; }
                (who_fields(token))
                button type="submit" { "Fork" }
            }
        }
        @for s in steps {
            @let step = encode(&s.id.step);
            @if retryable(s) {
                form method="post" action=(format!("/runs/{run}/steps/{step}/retry")) {
                    input type="hidden" name="call" value=(&*s.id.call);
                    strong { "Send " (&*s.id.step) " again " } (who_fields(token))
                    button type="submit" { "Retry step" }
                }
            }
            @if !s.state.succeeded() && s.state != StepState::Compensated {
                form method="post" action=(format!("/runs/{run}/steps/{step}/stub")) {
                    input type="hidden" name="call" value=(&*s.id.call);
                    strong { "Stub " (&*s.id.step) " " }
                    label { "result (JSON) " input name="result" required; }
                    (who_fields(token))
                    button type="submit" { "Stub step" }
                }
            }
            @if s.attention.is_some() || !s.state.is_final() {
                form method="post" action=(format!("/runs/{run}/steps/{step}/resolve")) {
                    input type="hidden" name="call" value=(&*s.id.call);
                    strong { "Resolve " (&*s.id.step) " " }
                    select name="resolution" {
                        option value="succeeded" { "it happened" }
                        option value="failed" { "it did not happen: do not retry" }
                        option value="retry" { "it did not happen: send it again" }
                    }
                    label { " result (JSON, optional) " input name="result"; }
                    (who_fields(token))
                    button type="submit" { "Resolve step" }
                }
            }
        }
    }
}

/// The step names, in order, each once.
fn dedup(steps: &[Step]) -> Vec<&str> {
    let mut names: Vec<&str> = Vec::new();
    for s in steps {
        if !names.contains(&&*s.id.step) {
            names.push(&s.id.step);
        }
    }
    names
}

/// Whether a step can be sent again by an operator, as `retry_step` decides.
fn retryable(s: &Step) -> bool {
    matches!(
        s.state,
        StepState::FailedBeforeExecution
            | StepState::FailedAfterExecution
            | StepState::ReconciledFailed
            | StepState::Parked
    ) || s.attention.is_some()
}
