//! Metrics, through the `metrics` facade when the `metrics` feature is on; no-ops otherwise.
//!
//! Logical calls and attempts are counted apart (as Finagle and Polly do), per dependency:
//! `backstop_calls_total`, `backstop_attempts_total`, `backstop_retries_total`,
//! `backstop_budget_refusals_total`, `backstop_run_retries_total` and
//! `backstop_run_budget_refusals_total` (retries of calls that belong to a `Run`, per dependency:
//! which tool spent the run's retries), `backstop_unknown_outcomes_total` (calls that ended with
//! an unknown side effect), `backstop_success_after_attempt_total{attempt}`, and for hedged
//! reads `backstop_hedges_total` and `backstop_hedges_cancelled_total`.

use backstop_core::Dependency;

#[cfg(feature = "metrics")]
fn label(d: &Dependency) -> metrics::SharedString {
    metrics::SharedString::from(d.metric_label())
}

#[inline]
pub(crate) fn call(d: &Dependency) {
    #[cfg(feature = "metrics")]
    {
        metrics::counter!("backstop_calls_total", "dependency" => label(d)).increment(1);
        metrics::counter!("backstop_attempts_total", "dependency" => label(d)).increment(1);
    }
    let _ = d;
}

#[inline]
pub(crate) fn retry(d: &Dependency) {
    #[cfg(feature = "metrics")]
    {
        metrics::counter!("backstop_retries_total", "dependency" => label(d)).increment(1);
        metrics::counter!("backstop_attempts_total", "dependency" => label(d)).increment(1);
    }
    let _ = d;
}

#[inline]
pub(crate) fn budget_refused(d: &Dependency) {
    #[cfg(feature = "metrics")]
    metrics::counter!("backstop_budget_refusals_total", "dependency" => label(d)).increment(1);
    let _ = d;
}

#[inline]
pub(crate) fn run_budget_refused(d: &Dependency) {
    #[cfg(feature = "metrics")]
    metrics::counter!("backstop_run_budget_refusals_total", "dependency" => label(d)).increment(1);
    let _ = d;
}

#[inline]
pub(crate) fn run_retry(d: &Dependency) {
    #[cfg(feature = "metrics")]
    metrics::counter!("backstop_run_retries_total", "dependency" => label(d)).increment(1);
    let _ = d;
}

#[inline]
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

/// The attempt timeout learned from latency, as planned for an attempt:
/// `backstop_attempt_timeout_seconds{dependency}`.
#[inline]
pub(crate) fn attempt_timeout(d: &Dependency, limit: std::time::Duration) {
    #[cfg(feature = "metrics")]
    metrics::gauge!("backstop_attempt_timeout_seconds", "dependency" => label(d))
        .set(limit.as_secs_f64());
    let _ = (d, limit);
}

/// Copies still in flight when another answered, dropped:
/// `backstop_hedges_cancelled_total{dependency}`.
#[inline]
pub(crate) fn hedges_cancelled(d: &Dependency, n: usize) {
    #[cfg(feature = "metrics")]
    if n > 0 {
        metrics::counter!("backstop_hedges_cancelled_total", "dependency" => label(d))
            .increment(n as u64);
    }
    let _ = (d, n);
}

/// A hedge sent: `backstop_hedges_total{dependency}` (counted apart from retries).
#[inline]
pub(crate) fn hedge(d: &Dependency) {
    #[cfg(feature = "metrics")]
    metrics::counter!("backstop_hedges_total", "dependency" => label(d)).increment(1);
    let _ = d;
}
