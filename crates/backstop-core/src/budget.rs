use crate::{Dependency, Throttled, Verdict};
use std::fmt;
use tokio::time::Instant;

/// A per-dependency allowance of retries, consulted by the retry layer.
///
/// Every logical call [deposits](RetryBudget::deposit); every retry must
/// [withdraw](RetryBudget::withdraw) first. During an outage the budget, not the attempt count,
/// caps the load retries add to a dependency that is already failing. The retry layer withdraws
/// only after deciding that the failure was the dependency's and that a retry would otherwise
/// happen, so bad requests never drain it.
pub trait RetryBudget: Send + Sync + fmt::Debug {
    /// A logical call to `dependency` started at `now` (the retry layer reads the clock once
    /// per call and passes it on).
    fn deposit(&self, dependency: &Dependency, now: Instant);

    /// Asks for one retry of a call to `dependency`; `false` refuses it.
    fn withdraw(&self, dependency: &Dependency) -> bool;

    /// Whether this budget also admits each attempt ([`admit`](Self::admit) and
    /// [`observe`](Self::observe)): the retry layer asks only a budget that says so, read once
    /// when the layer is built. A ratio budget does not; client-side adaptive throttling does.
    fn admits(&self) -> bool {
        false
    }

    /// Before each attempt to `dependency`, first or retry: `Err` refuses it here, before
    /// it is sent, and the call stops with that error.
    fn admit(&self, dependency: &Dependency) -> Result<(), Throttled> {
        let _ = dependency;
        Ok(())
    }

    /// How an attempt [`admit`](Self::admit) let through ended.
    fn observe(&self, dependency: &Dependency, verdict: &Verdict) {
        let _ = (dependency, verdict);
    }
}

/// No budget: every retry the other rules allow is made.
#[derive(Clone, Copy, Debug, Default)]
pub struct NoBudget;

impl RetryBudget for NoBudget {
    fn deposit(&self, _dependency: &Dependency, _now: Instant) {}
    fn withdraw(&self, _dependency: &Dependency) -> bool {
        true
    }
}
