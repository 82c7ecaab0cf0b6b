//! Client-side adaptive throttling beside the ratio budget, a layer of its own ([`ThrottleLayer`](crate::ThrottleLayer); Google SRE book,
//! "Handling Overload"): each client tracks, per dependency over a window, the attempts it made
//! (`requests`) and those the dependency accepted (`accepts`: it answered, with success or a
//! final error of the caller's own, rather than shedding the load with a `429`, a `503` or no
//! answer in time), and refuses an attempt locally with probability
//!
//! ```text
//! max(0, (requests - K * accepts) / (requests + 1))
//! ```
//!
//! With `K = 2` a healthy dependency is never throttled (accepts close to requests); when it
//! sheds most of its load, the client sheds it first, before it is sent: what reaches it is
//! about `K` times what it accepts. What still goes out keeps the estimate fresh, so the
//! throttle opens again as accepts come back: the share refused about halves with each window
//! of full accepts, so a throttle that refused 99 % of calls is open again after about seven
//! windows. An attempt counts as a request when it ends (an attempt in flight is not yet
//! evidence either way), and a local refusal when it is refused.

use backstop_core::{Dependency, InvalidConfig, Throttled, Verdict};
use backstop_state::{Draws, Registry, SlidingCount};
use std::{fmt, sync::Arc, time::Duration};
use tokio::time::Instant;

const BUCKETS: usize = 12;

/// Configuration of an [`AdaptiveThrottle`].
#[derive(Clone, Debug, PartialEq)]
pub struct ThrottleConfig {
    k: f64,
    window: Duration,
    max_dependencies: usize,
}

impl Default for ThrottleConfig {
    /// K = 2 over 2 minutes (the SRE book's values), at most 1,000 dependencies tracked.
    fn default() -> Self {
        ThrottleConfig {
            k: 2.0,
            window: Duration::from_secs(120),
            max_dependencies: 1_000,
        }
    }
}

impl ThrottleConfig {
    /// The multiplier `K`: attempts go out freely while they stay under `K` times the accepts.
    /// Lower throttles sooner (1.1 in the SRE book's aggressive setting); at least 1.
    #[must_use]
    pub fn k(mut self, k: f64) -> Self {
        self.k = k;
        self
    }

    /// The window requests and accepts are counted over.
    #[must_use]
    pub fn window(mut self, window: Duration) -> Self {
        self.window = window;
        self
    }

    /// How many dependencies are tracked (1,000 by default; past that the least recently used
    /// account nobody holds is reused).
    #[must_use]
    pub fn max_dependencies(mut self, n: usize) -> Self {
        self.max_dependencies = n;
        self
    }

    fn validate(&self) -> Result<(), InvalidConfig> {
        if !self.k.is_finite() || self.k < 1.0 {
            return Err(InvalidConfig::new(
                "throttle k must be a finite number of at least 1 (2 means: throttle once fewer than half the attempts are accepted)",
            ));
        }
        if self.window < Duration::from_millis(BUCKETS as u64) {
            return Err(InvalidConfig::new("throttle window must be at least 12 ms"));
        }
        if self.max_dependencies == 0 {
            return Err(InvalidConfig::new(
                "throttle max_dependencies must be at least 1",
            ));
        }
        Ok(())
    }
}

struct Account {
    requests: SlidingCount,
    accepts: SlidingCount,
}

struct Inner {
    config: ThrottleConfig,
    accounts: Registry<Account>,
    draws: Draws,
}

/// Client-side adaptive throttling per dependency. `Clone`: clones share every account, so one
/// throttle given to several stacks (or several clients of one dependency) learns from all of
/// them.
///
/// ```
/// use backstop_budget::{AdaptiveThrottle, ThrottleConfig};
/// use backstop_core::{Dependency, Outcome, Verdict};
/// use tokio::time::Instant;
///
/// # #[tokio::main(flavor = "current_thread", start_paused = true)]
/// # async fn main() {
/// let throttle = AdaptiveThrottle::new(ThrottleConfig::default(), 7).unwrap();
/// let api = Dependency::new("search-api");
/// let shed = Verdict::Retryable { outcome: Outcome::NotSent, after: None };
/// // The dependency sheds every attempt for a while (429s).
/// let mut sent = 0;
/// for _ in 0..1_000 {
///     if throttle.admit(&api).is_ok() {
///         sent += 1;
///         throttle.observe(&api, &shed);
///     }
/// }
/// // The client stops sending most of them itself.
/// assert!(sent < 100, "{sent}");
/// # }
/// ```
#[derive(Clone)]
pub struct AdaptiveThrottle {
    inner: Arc<Inner>,
}

impl fmt::Debug for AdaptiveThrottle {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("AdaptiveThrottle")
            .field("config", &self.inner.config)
            .finish_non_exhaustive()
    }
}

/// What a throttle has counted for one dependency over its window.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct ThrottleStats {
    /// Attempts asked for (refused ones included).
    pub requests: u64,
    /// Attempts the dependency accepted.
    pub accepts: u64,
    /// The probability the next attempt is refused.
    pub reject_probability: f64,
}

impl AdaptiveThrottle {
    /// A throttle with `config`, its draws from `seed`, or why the configuration is invalid.
    /// [`ThrottleLayer`](crate::ThrottleLayer) puts it in front of each attempt.
    pub fn new(config: ThrottleConfig, seed: u64) -> Result<Self, InvalidConfig> {
        config.validate()?;
        let window = config.window;
        Ok(AdaptiveThrottle {
            inner: Arc::new(Inner {
                accounts: Registry::new(config.max_dependencies, move |_| Account {
                    requests: SlidingCount::new(window, BUCKETS),
                    accepts: SlidingCount::new(window, BUCKETS),
                }),
                config,
                draws: Draws::new(seed),
            }),
        })
    }

    /// The configuration.
    pub fn config(&self) -> &ThrottleConfig {
        &self.inner.config
    }

    /// What has been counted for `dependency` in the current window.
    pub fn stats(&self, dependency: &Dependency) -> ThrottleStats {
        let now = Instant::now();
        let (requests, accepts) = match self.inner.accounts.tracked(dependency) {
            Some(a) => (a.requests.sum(now), a.accepts.sum(now)),
            None => (0, 0),
        };
        ThrottleStats {
            requests,
            accepts,
            reject_probability: self.probability(requests, accepts),
        }
    }

    fn probability(&self, requests: u64, accepts: u64) -> f64 {
        let (r, a) = (requests as f64, accepts as f64);
        ((r - self.inner.config.k * a) / (r + 1.0)).max(0.0)
    }
}

/// Whether the dependency accepted an attempt: it answered (a success, or a final answer about
/// the request itself), rather than shedding it or not answering at all.
fn accepted(verdict: &Verdict) -> bool {
    match verdict {
        Verdict::Success => true,
        Verdict::Fatal { outcome } => *outcome == backstop_core::Outcome::Completed,
        Verdict::Retryable { .. } => false,
    }
}

impl AdaptiveThrottle {
    /// Before an attempt to `dependency`: `Err` refuses it here, before it is sent, with the
    /// probability above (the call stops with that error).
    pub fn admit(&self, dependency: &Dependency) -> Result<(), Throttled> {
        let now = Instant::now();
        let account = self.inner.accounts.get(dependency);
        let requests = account.requests.sum(now);
        let accepts = account.accepts.sum(now);
        let p = self.probability(requests, accepts);
        if p > 0.0 && self.inner.draws.next() < p {
            // A refusal is a request too, which is what keeps the rate bounded.
            account.requests.add(now, 1);
            return Err(Throttled::new(dependency.clone(), requests + 1, accepts, p));
        }
        Ok(())
    }

    /// How an attempt [`admit`](Self::admit) let through ended.
    pub fn observe(&self, dependency: &Dependency, verdict: &Verdict) {
        // An attempt counts once it has ended, so attempts in flight at a cold start (none
        // answered yet) do not look like load the dependency refused.
        let now = Instant::now();
        let account = self.inner.accounts.get(dependency);
        account.requests.add(now, 1);
        if accepted(verdict) {
            account.accepts.add(now, 1);
        }
    }
}
