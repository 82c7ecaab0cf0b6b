//! The journal's metrics, through the `metrics` facade when the `metrics` feature is on,
//! and `tracing` events always (target `backstop::journal`):
//! `backstop_journal_transitions_total{tool, to}`, `backstop_journal_unknown_outcomes_total{tool}`
//! (the unknown-result rate over `..._transitions_total{to="sent"}`),
//! `backstop_journal_duplicates_prevented_total{tool}` (a done step asked again, answered from
//! the journal), `backstop_journal_reconciliation_seconds{tool}`,
//! `backstop_journal_human_total{tool}` (steps handed to a person) and
//! `backstop_journal_success_after_attempt_total{tool, attempt}`.

use crate::model::{Step, StepState};
use std::time::Duration;

pub(crate) fn transition(step: &Step, from: StepState, in_previous_ms: i64) {
    tracing::debug!(
        target: "backstop::journal",
        step = %step.id,
        tool = %step.tool,
        from = from.as_str(),
        to = step.state.as_str(),
        attempts = step.attempts,
        in_previous_ms,
        "step moved"
    );
    #[cfg(feature = "metrics")]
    metrics::counter!("backstop_journal_transitions_total", "tool" => step.tool.clone(), "to" => step.state.as_str())
        .increment(1);
}

pub(crate) fn unknown(step: &Step) {
    tracing::warn!(target: "backstop::journal", step = %step.id, tool = %step.tool, "outcome unknown");
    #[cfg(feature = "metrics")]
    metrics::counter!("backstop_journal_unknown_outcomes_total", "tool" => step.tool.clone())
        .increment(1);
}

pub(crate) fn duplicate_prevented(step: &Step) {
    tracing::info!(target: "backstop::journal", step = %step.id, tool = %step.tool, "already done: not sent again");
    #[cfg(feature = "metrics")]
    metrics::counter!("backstop_journal_duplicates_prevented_total", "tool" => step.tool.clone())
        .increment(1);
}

pub(crate) fn reconciled(step: &Step, took: Duration) {
    tracing::info!(target: "backstop::journal", step = %step.id, tool = %step.tool, took_ms = took.as_millis() as u64, "reconciled");
    #[cfg(feature = "metrics")]
    metrics::histogram!("backstop_journal_reconciliation_seconds", "tool" => step.tool.clone())
        .record(took.as_secs_f64());
}

pub(crate) fn human(step: &Step) {
    tracing::warn!(target: "backstop::journal", step = %step.id, tool = %step.tool, why = step.attention.as_deref().unwrap_or(""), "needs a person");
    #[cfg(feature = "metrics")]
    metrics::counter!("backstop_journal_human_total", "tool" => step.tool.clone()).increment(1);
}

pub(crate) fn succeeded(step: &Step) {
    #[cfg(feature = "metrics")]
    {
        const ATTEMPTS: [&str; 8] = ["1", "2", "3", "4", "5", "6", "7", "8"];
        let n = ATTEMPTS
            .get(step.attempts.saturating_sub(1) as usize)
            .copied()
            .unwrap_or("9+");
        metrics::counter!("backstop_journal_success_after_attempt_total", "tool" => step.tool.clone(), "attempt" => n)
            .increment(1);
    }
    let _ = step;
}
