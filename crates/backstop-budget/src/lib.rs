//! A per-dependency retry budget.
//!
//! "Three attempts" bounds the load one call adds, but not the load an outage adds: when every
//! call fails, three attempts each is 3x the traffic on a dependency that is already failing
//! (27x with three nested retry layers). A budget bounds retries as a share of requests instead:
//! every logical call deposits, every retry withdraws, and a retry is allowed only while
//!
//! ```text
//! retries in the window <= max(ratio * requests in the window, min_retries_per_sec * window)
//! ```
//!
//! The floor is a minimum, not an addition: at high traffic the ratio alone bounds the load
//! retries add (10 % means at most 1.10 attempts per call in an outage), and at low traffic the
//! floor still lets a few retries through.
//!
//! Defaults: **10 % over a 10 s window, at least 1 retry per second** (10 per window), after the
//! Google SRE book's per-client retry budget ("Addressing Cascading Failures": retries at most
//! 10 % of requests). The floor keeps a low-traffic dependency able to retry at all: an agent
//! making a handful of calls a minute still gets its transient failures retried.
//!
//! | | ratio | window | floor |
//! |---|---|---|---|
//! | Backstop | 10 % | 10 s | 1 retry/s |
//! | tower `TpsBudget` (typical use) | 20 % (`retry_percent`) | 10 s (`ttl`) | 10 retries/s (`min_per_sec`) |
//! | Finagle `RetryBudget` | 20 % | 10 s | 10 retries/s |
//! | Envoy `retry_budget` | 20 % of *active* requests | concurrent, no window | 3 concurrent retries |
//!
//! Backstop's floor is lower than tower's and Finagle's because its users are often agents on
//! low traffic, where 10 retries per second would let an outage multiply a small load many
//! times; 1 per second still covers a burst of transient failures. With the defaults, 1,000
//! requests in a window to a dependency that always fails make at most 1,000 + 100 attempts
//! (tower's `TpsBudget` and Finagle add the floor to the ratio instead).
//!
//! The counters are lock-free sliding windows ([`backstop_state::SlidingCount`]); a withdrawal
//! is counted first and undone when over budget, so concurrent retries can never overshoot.
//!
//! ```
//! use backstop_budget::{Budget, BudgetConfig};
//! use backstop_core::Dependency;
//! use backstop_core::RetryBudget;
//!
//! # #[tokio::main(flavor = "current_thread", start_paused = true)]
//! # async fn main() {
//! let budget = Budget::new(BudgetConfig::default().min_retries_per_sec(0.0)).unwrap();
//! let carrier = Dependency::new("carrier-api");
//! for _ in 0..100 {
//!     budget.deposit(&carrier, tokio::time::Instant::now());
//! }
//! let granted = (0..50).filter(|_| budget.withdraw(&carrier)).count();
//! assert_eq!(granted, 10); // 10 % of 100 requests
//! # }
//! ```
#![forbid(unsafe_code)]
// docs.rs (nightly, `--cfg docsrs`) badges every item behind a feature with it.
#![cfg_attr(docsrs, feature(doc_cfg))]
#![deny(missing_docs)]

mod layer;
mod throttle;

pub use layer::{Throttle, ThrottleLayer};

/// Future types.
pub mod future {
    pub use crate::layer::ThrottleFuture;
}
pub use throttle::{AdaptiveThrottle, ThrottleConfig, ThrottleStats};

use backstop_core::Dependency;
use backstop_core::InvalidConfig;
pub use backstop_core::{NoBudget, RetryBudget};
use backstop_state::{Registry, SlidingCount};
use std::{fmt, sync::Arc, time::Duration};
use tokio::time::Instant;

/// The number of buckets each sliding window is cut into.
const BUCKETS: usize = 10;

/// Configuration of a [`Budget`].
#[derive(Clone, Debug, PartialEq)]
pub struct BudgetConfig {
    ratio: f64,
    window: Duration,
    min_retries_per_sec: f64,
    max_dependencies: usize,
}

impl Default for BudgetConfig {
    /// 10 % over 10 s, plus 1 retry per second, at most 1,000 dependencies tracked.
    fn default() -> Self {
        BudgetConfig {
            ratio: 0.1,
            window: Duration::from_secs(10),
            min_retries_per_sec: 1.0,
            max_dependencies: 1_000,
        }
    }
}

impl BudgetConfig {
    /// Retries allowed per request in the window (0.1 = 10 %).
    #[must_use]
    pub fn ratio(mut self, ratio: f64) -> Self {
        self.ratio = ratio;
        self
    }

    /// The sliding window.
    #[must_use]
    pub fn window(mut self, window: Duration) -> Self {
        self.window = window;
        self
    }

    /// Retries per second allowed whatever the ratio says: the budget is never lower than this
    /// over its window (a minimum, not added to the ratio).
    #[must_use]
    pub fn min_retries_per_sec(mut self, n: f64) -> Self {
        self.min_retries_per_sec = n;
        self
    }

    /// How many accounts are kept (1,000 by default). Past that, a new dependency takes the
    /// place of the least recently used account nobody holds; when there is none, it gets an
    /// account for that call alone. Two dependencies never share a budget.
    #[must_use]
    pub fn max_dependencies(mut self, n: usize) -> Self {
        self.max_dependencies = n;
        self
    }

    fn validate(&self) -> Result<(), InvalidConfig> {
        let bad = |reason: &'static str| Err(InvalidConfig::new(reason));
        if !self.ratio.is_finite() || self.ratio < 0.0 {
            return bad("budget ratio must be a finite number of at least 0 (0.1 means 10 %)");
        }
        if !self.min_retries_per_sec.is_finite() || self.min_retries_per_sec < 0.0 {
            return bad("budget min_retries_per_sec must be a finite number of at least 0");
        }
        if self.window < Duration::from_millis(BUCKETS as u64) {
            return bad("budget window must be at least 10 ms");
        }
        if self.max_dependencies == 0 {
            return bad("budget max_dependencies must be at least 1");
        }
        Ok(())
    }
}

struct Account {
    requests: SlidingCount,
    retries: SlidingCount,
}

struct Inner {
    config: BudgetConfig,
    floor: f64,
    accounts: Registry<Account>,
}

/// A retry budget per dependency. `Clone`: clones share every account, so one `Budget` given
/// to several stacks governs them together.
///
/// Retries may be at most 10 % of requests over the window, or the floor (1 per second over
/// 10 s) when that is more:
///
/// ```
/// use backstop_budget::{Budget, BudgetConfig};
/// use backstop_core::{Dependency, RetryBudget};
/// use tokio::time::Instant;
///
/// # #[tokio::main(flavor = "current_thread", start_paused = true)]
/// # async fn main() {
/// let budget = Budget::new(BudgetConfig::default().min_retries_per_sec(0.0)).unwrap();
/// let carrier = Dependency::new("carrier-api");
/// let account = budget.bind(&carrier);
/// for _ in 0..200 {
///     account.deposit(&carrier, Instant::now()); // every logical call deposits
/// }
/// let allowed = (0..100).filter(|_| account.withdraw(&carrier)).count();
/// assert_eq!(allowed, 20); // 10 % of 200
/// # }
/// ```
#[derive(Clone)]
pub struct Budget {
    inner: Arc<Inner>,
}

impl fmt::Debug for Budget {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Budget")
            .field("config", &self.inner.config)
            .field("dependencies", &self.inner.accounts.len())
            .finish()
    }
}

/// What a budget has counted for one dependency over its window.
#[derive(Clone, Copy, Debug, PartialEq)]
#[non_exhaustive]
pub struct BudgetStats {
    /// Logical calls (deposits).
    pub requests: u64,
    /// Retries granted.
    pub retries: u64,
    /// Retries the budget allows in this window in all.
    pub allowance: f64,
}

impl Budget {
    /// A budget with `config`, or why the configuration is invalid.
    pub fn new(config: BudgetConfig) -> Result<Self, InvalidConfig> {
        config.validate()?;
        let window = config.window;
        let floor = config.min_retries_per_sec * window.as_secs_f64();
        Ok(Budget {
            inner: Arc::new(Inner {
                floor,
                accounts: Registry::new(config.max_dependencies, move |_| Account {
                    requests: SlidingCount::new(window, BUCKETS),
                    retries: SlidingCount::new(window, BUCKETS),
                }),
                config,
            }),
        })
    }

    /// The configuration.
    pub fn config(&self) -> &BudgetConfig {
        &self.inner.config
    }

    /// What has been counted for `dependency` in the current window.
    pub fn stats(&self, dependency: &Dependency) -> BudgetStats {
        let now = Instant::now();
        let (requests, retries) = match self.inner.accounts.tracked(dependency) {
            Some(a) => (a.requests.sum(now), a.retries.sum(now)),
            None => (0, 0),
        };
        BudgetStats {
            requests,
            retries,
            allowance: self.allowance(requests),
        }
    }

    /// How many dependencies have an account of their own.
    pub fn tracked(&self) -> usize {
        self.inner.accounts.len()
    }

    fn allowance(&self, requests: u64) -> f64 {
        (self.inner.config.ratio * requests as f64).max(self.inner.floor)
    }
}

impl Default for Budget {
    fn default() -> Self {
        Budget::new(BudgetConfig::default()).expect("the default configuration is valid")
    }
}

impl Budget {
    /// The one budget of the whole process, with the default configuration: what every
    /// `Backstop` stack uses unless given another, so that every stack calling a dependency
    /// spends from that dependency's one account. Choose it by name when a hand-composed
    /// stack should share it too; give a stack `Budget::new(..)` for an account of its own.
    pub fn process_wide() -> Budget {
        static PROCESS: std::sync::OnceLock<Budget> = std::sync::OnceLock::new();
        PROCESS.get_or_init(Budget::default).clone()
    }

    /// This budget's account for one dependency, looked up once: a stack whose dependency is
    /// fixed deposits and withdraws through it without a registry lookup per call. A call that
    /// names another dependency still goes to that one's account.
    pub fn bind(&self, dependency: &Dependency) -> DependencyBudget {
        DependencyBudget {
            account: self.inner.accounts.get(dependency),
            dependency: dependency.clone(),
            budget: self.clone(),
        }
    }

    fn withdraw_from(&self, account: &Account) -> bool {
        let now = Instant::now();
        // Count first, then check: concurrent withdrawals see each other and cannot overshoot.
        account.retries.add(now, 1);
        let retries = account.retries.sum(now);
        if retries as f64 > self.allowance(account.requests.sum(now)) {
            account.retries.remove_one(now);
            return false;
        }
        true
    }
}

impl RetryBudget for Budget {
    fn deposit(&self, dependency: &Dependency, now: Instant) {
        self.inner.accounts.get(dependency).requests.add(now, 1);
    }

    fn withdraw(&self, dependency: &Dependency) -> bool {
        self.withdraw_from(&self.inner.accounts.get(dependency))
    }
}

/// A [`Budget`]'s account for one dependency, from [`Budget::bind`].
#[derive(Clone)]
pub struct DependencyBudget {
    account: Arc<Account>,
    dependency: Dependency,
    budget: Budget,
}

impl fmt::Debug for DependencyBudget {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("DependencyBudget")
            .field("dependency", &self.dependency)
            .field("budget", &self.budget)
            .finish()
    }
}

impl RetryBudget for DependencyBudget {
    fn deposit(&self, dependency: &Dependency, now: Instant) {
        if *dependency == self.dependency {
            self.account.requests.add(now, 1);
        } else {
            self.budget.deposit(dependency, now);
        }
    }

    fn withdraw(&self, dependency: &Dependency) -> bool {
        if *dependency == self.dependency {
            self.budget.withdraw_from(&self.account)
        } else {
            self.budget.withdraw(dependency)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn invalid_configurations_are_rejected() {
        for (config, needle) in [
            (BudgetConfig::default().ratio(-0.1), "ratio"),
            (BudgetConfig::default().ratio(f64::NAN), "ratio"),
            (
                BudgetConfig::default().min_retries_per_sec(f64::INFINITY),
                "min_retries_per_sec",
            ),
            (BudgetConfig::default().window(Duration::ZERO), "window"),
            (
                BudgetConfig::default().max_dependencies(0),
                "max_dependencies",
            ),
        ] {
            let e = Budget::new(config).unwrap_err();
            assert!(e.to_string().contains(needle), "{e}");
        }
    }

    #[tokio::test(start_paused = true)]
    async fn the_floor_lets_a_quiet_dependency_retry() {
        let b = Budget::default();
        let d = Dependency::new("quiet");
        b.deposit(&d, Instant::now());
        // 0.1 * 1 + 1/s * 10 s = 10.1 retries.
        let granted = (0..20).filter(|_| b.withdraw(&d)).count();
        assert_eq!(granted, 10);
        let s = b.stats(&d);
        assert_eq!((s.requests, s.retries), (1, 10));
    }

    #[tokio::test(start_paused = true)]
    async fn the_allowance_recovers_as_the_window_slides() {
        let b = Budget::new(BudgetConfig::default().min_retries_per_sec(0.0)).unwrap();
        let d = Dependency::new("carrier-api");
        for _ in 0..50 {
            b.deposit(&d, Instant::now());
        }
        assert_eq!((0..10).filter(|_| b.withdraw(&d)).count(), 5);
        tokio::time::advance(Duration::from_secs(11)).await;
        // The old requests and retries have left the window.
        assert!(!b.withdraw(&d));
        for _ in 0..10 {
            b.deposit(&d, Instant::now());
        }
        assert!(b.withdraw(&d));
        assert!(!b.withdraw(&d));
    }

    #[tokio::test(start_paused = true)]
    async fn a_million_distinct_dependencies_stay_within_the_bound() {
        let b = Budget::new(BudgetConfig::default().max_dependencies(1_000)).unwrap();
        for i in 0..1_000_000u32 {
            let d = Dependency::new(format!("host-{i}.example:443"));
            b.deposit(&d, Instant::now());
            let _ = b.withdraw(&d);
        }
        assert_eq!(b.tracked(), 1_000);
    }

    #[tokio::test(start_paused = true)]
    async fn dependencies_have_separate_accounts() {
        let b = Budget::new(BudgetConfig::default().min_retries_per_sec(0.0)).unwrap();
        let (a, c) = (Dependency::new("a"), Dependency::new("c"));
        for _ in 0..10 {
            b.deposit(&a, Instant::now());
        }
        assert!(b.withdraw(&a));
        assert!(!b.withdraw(&c));
        assert_eq!(b.tracked(), 2);
    }
}
