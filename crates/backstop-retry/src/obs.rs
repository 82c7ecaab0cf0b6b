//! What the layer tells of its calls: each attempt's `tracing` span, a `stopped` event for a call
//! that failed, and metrics, through the `metrics` facade when the `metrics` feature is on
//! (no-ops otherwise).
//!
//! Logical calls and attempts are counted apart (as Finagle and Polly do), per dependency:
//! `backstop_calls_total`, `backstop_attempts_total`, `backstop_retries_total`,
//! `backstop_budget_refusals_total`, `backstop_run_retries_total` and
//! `backstop_run_budget_refusals_total` (retries of calls that belong to a `Run`, per dependency:
//! which tool spent the run's retries), `backstop_unknown_outcomes_total` (calls that ended with
//! an unknown side effect), `backstop_success_after_attempt_total{attempt}`, and for hedged
//! reads `backstop_hedges_total` and `backstop_hedges_cancelled_total`.

use crate::{RetryHistory, StopReason};
use backstop_classify::Verdict;
use backstop_core::{Dependency, Outcome, Run};
use std::borrow::Cow;
use std::time::Duration;
use tracing::Span;

#[cfg(feature = "metrics")]
fn label(d: &Dependency) -> metrics::SharedString {
    metrics::SharedString::from(d.metric_label())
}

pub(crate) fn call(d: &Dependency) {
    #[cfg(feature = "metrics")]
    {
        metrics::counter!("backstop_calls_total", "dependency" => label(d)).increment(1);
        metrics::counter!("backstop_attempts_total", "dependency" => label(d)).increment(1);
    }
    let _ = d;
}

pub(crate) fn retry(d: &Dependency) {
    #[cfg(feature = "metrics")]
    {
        metrics::counter!("backstop_retries_total", "dependency" => label(d)).increment(1);
        metrics::counter!("backstop_attempts_total", "dependency" => label(d)).increment(1);
    }
    let _ = d;
}

/// The policy's decision after an attempt: a `retrying` event for a retry, and the budgets'
/// metrics (`run` is the call's run, when it belongs to one and the call is retried).
pub(crate) fn decided(
    d: &Dependency,
    decision: &Result<Duration, StopReason>,
    attempt: u32,
    verdict: Verdict,
    run: Option<&Run>,
) {
    #[cfg(feature = "metrics")]
    match decision {
        Ok(_) if run.is_some() => {
            metrics::counter!("backstop_run_retries_total", "dependency" => label(d)).increment(1);
        }
        Err(StopReason::BudgetExhausted) => {
            metrics::counter!("backstop_budget_refusals_total", "dependency" => label(d))
                .increment(1);
        }
        Err(StopReason::RunBudgetExhausted { .. }) => {
            metrics::counter!("backstop_run_budget_refusals_total", "dependency" => label(d))
                .increment(1);
        }
        _ => {}
    }
    if let Ok(wait) = decision {
        let (outcome, server_asked) = match verdict {
            Verdict::Retryable { outcome, after } => (outcome, after == Some(*wait)),
            verdict => (verdict.outcome(), false),
        };
        tracing::debug!(
            target: "backstop::retry",
            dependency = %d,
            run = run.map_or("", Run::id),
            attempt,
            outcome = outcome.as_str(),
            wait_ms = u64::try_from(wait.as_millis()).unwrap_or(u64::MAX),
            server_asked,
            "retrying"
        );
    }
}

pub(crate) fn finished(d: &Dependency, attempt: u32, success: bool, unknown: bool) {
    #[cfg(feature = "metrics")]
    {
        if success {
            const ATTEMPTS: [&str; 8] = ["1", "2", "3", "4", "5", "6", "7", "8"];
            let n = ATTEMPTS.get(attempt as usize - 1).copied().unwrap_or("9+");
            metrics::counter!("backstop_success_after_attempt_total", "dependency" => label(d), "attempt" => n)
                .increment(1);
        }
        if unknown {
            metrics::counter!("backstop_unknown_outcomes_total", "dependency" => label(d))
                .increment(1);
        }
    }
    let _ = (d, attempt, success, unknown);
}

/// Copies still in flight when another answered, dropped:
/// `backstop_hedges_cancelled_total{dependency}`.
pub(crate) fn hedges_cancelled(d: &Dependency, n: usize) {
    #[cfg(feature = "metrics")]
    if n > 0 {
        metrics::counter!("backstop_hedges_cancelled_total", "dependency" => label(d))
            .increment(n as u64);
    }
    let _ = (d, n);
}

/// A hedge sent: `backstop_hedges_total{dependency}` (counted apart from retries).
pub(crate) fn hedge(d: &Dependency) {
    #[cfg(feature = "metrics")]
    metrics::counter!("backstop_hedges_total", "dependency" => label(d)).increment(1);
    let _ = d;
}

/// A call that ended with a history (it failed, or succeeded after a retry): its metrics, and
/// a `stopped` event with the reason when it failed.
pub(crate) fn stopped(history: &RetryHistory, attempts: u32, verdict: Verdict) {
    let d = &history.dependency;
    let succeeded = history.stopped == StopReason::Succeeded;
    let unknown =
        !succeeded && (history.attempts.iter()).any(|a| a.verdict.outcome() == Outcome::Unknown);
    finished(d, attempts, succeeded, unknown);
    if !succeeded {
        tracing::debug!(
            target: "backstop::retry",
            dependency = %d,
            attempts,
            outcome = verdict.outcome().as_str(),
            reason = ?history.stopped,
            "stopped"
        );
    }
}

/// The attempt's span when a subscriber records it, boxed: the future every call moves keeps 8
/// bytes for it, against a `Span`'s 40, and a call no subscriber traces allocates nothing for it.
#[derive(Default)]
pub(crate) struct AttemptSpan(Option<Box<Span>>);

impl AttemptSpan {
    pub(crate) fn new(dependency: &Dependency, attempt: u32) -> Self {
        let span = attempt_span(dependency, attempt);
        AttemptSpan((!span.is_disabled()).then(|| Box::new(span)))
    }

    /// The span, when it is recorded.
    pub(crate) fn get(&self) -> Option<&Span> {
        self.0.as_deref()
    }

    /// Names the recorded span in OpenTelemetry (`otel.name`) after `name`, asked only when
    /// the span is recorded; before it is first entered, while it can still be renamed.
    pub(crate) fn name_after(&self, name: impl FnOnce() -> Option<Cow<'static, str>>) {
        if let Some(span) = self.get()
            && let Some(name) = name()
        {
            span.record("otel.name", &*name);
        }
    }
}

/// The attempt's span, inside whatever span is current (the call's). A resend carries
/// OpenTelemetry's `http.request.resend_count` (1 on the second attempt), as the HTTP semantic
/// conventions ask; the first attempt has none.
fn attempt_span(dependency: &Dependency, attempt: u32) -> Span {
    let span = tracing::debug_span!(
        target: "backstop::retry",
        "attempt",
        dependency = %dependency,
        attempt,
        http.request.resend_count = tracing::field::Empty,
        attempt_timeout_ms = tracing::field::Empty,
        // Recorded by an HTTP attempt layer inside (`backstop-otel`), as the HTTP semantic
        // conventions name them.
        otel.name = tracing::field::Empty,
        otel.kind = "client",
        http.request.method = tracing::field::Empty,
        server.address = tracing::field::Empty,
        server.port = tracing::field::Empty,
        url.full = tracing::field::Empty,
        http.response.status_code = tracing::field::Empty,
        error.type = tracing::field::Empty,
    );
    if attempt > 1 && !span.is_disabled() {
        span.record("http.request.resend_count", attempt - 1);
    }
    span
}
