use crate::Dependency;
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
    /// A logical call to `dependency` started at `now` (its policy pays in once per call).
    fn deposit(&self, dependency: &Dependency, now: Instant);

    /// Asks for one retry of a call to `dependency`; `false` refuses it.
    fn withdraw(&self, dependency: &Dependency) -> bool;
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
