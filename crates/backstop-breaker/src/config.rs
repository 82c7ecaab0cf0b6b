use crate::CircuitTransition;
use backstop_core::InvalidConfig;
use std::{fmt, sync::Arc, time::Duration};

pub(crate) type Hook = Arc<dyn Fn(&CircuitTransition) + Send + Sync>;

/// Configuration of a [`Breaker`](crate::Breaker); see the crate docs for the defaults.
#[derive(Clone)]
pub struct BreakerConfig {
    pub(crate) consecutive_failures: Option<u32>,
    pub(crate) failure_ratio: Option<f64>,
    pub(crate) minimum_calls: u32,
    pub(crate) window: Duration,
    pub(crate) cooldown: Duration,
    /// The most a cooldown grows to, doubling after each failed trial (`None`: no growth).
    pub(crate) max_cooldown: Option<Duration>,
    pub(crate) trial_calls: u32,
    pub(crate) slow_call: Option<Duration>,
    pub(crate) max_dependencies: usize,
    pub(crate) on_transition: Option<Hook>,
}

impl fmt::Debug for BreakerConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("BreakerConfig")
            .field("consecutive_failures", &self.consecutive_failures)
            .field("failure_ratio", &self.failure_ratio)
            .field("minimum_calls", &self.minimum_calls)
            .field("window", &self.window)
            .field("cooldown", &self.cooldown)
            .field("max_cooldown", &self.max_cooldown)
            .field("trial_calls", &self.trial_calls)
            .field("slow_call", &self.slow_call)
            .field("max_dependencies", &self.max_dependencies)
            .field("on_transition", &self.on_transition.is_some())
            .finish()
    }
}

impl Default for BreakerConfig {
    fn default() -> Self {
        BreakerConfig {
            consecutive_failures: Some(5),
            failure_ratio: Some(0.5),
            minimum_calls: 20,
            window: Duration::from_secs(30),
            cooldown: Duration::from_secs(30),
            max_cooldown: None,
            trial_calls: 1,
            slow_call: None,
            max_dependencies: 1_000,
            on_transition: None,
        }
    }
}

impl BreakerConfig {
    /// Open after this many failures in a row (5 by default).
    #[must_use]
    pub fn consecutive_failures(mut self, n: u32) -> Self {
        self.consecutive_failures = Some(n);
        self
    }

    /// Do not open on a run of consecutive failures, only on the ratio.
    #[must_use]
    pub fn no_consecutive_rule(mut self) -> Self {
        self.consecutive_failures = None;
        self
    }

    /// Open when at least `ratio` of the calls in `window` failed, once `minimum_calls` calls
    /// were made in it (50 %, 20 calls, 30 s by default). The ratio is checked when a failure is
    /// recorded, so a success never pays for it and never opens the circuit.
    #[must_use]
    pub fn failure_ratio(mut self, ratio: f64, minimum_calls: u32, window: Duration) -> Self {
        self.failure_ratio = Some(ratio);
        self.minimum_calls = minimum_calls;
        self.window = window;
        self
    }

    /// Do not open on the failure ratio, only on consecutive failures (and no window is kept,
    /// which makes the success path a single atomic load).
    #[must_use]
    pub fn no_ratio_rule(mut self) -> Self {
        self.failure_ratio = None;
        self
    }

    /// How long the circuit stays open before a trial (30 s by default).
    #[must_use]
    pub fn cooldown(mut self, cooldown: Duration) -> Self {
        self.cooldown = cooldown;
        self
    }

    /// Doubles the cooldown each time a trial fails, up to `max` (off by default).
    #[must_use]
    pub fn cooldown_growth(mut self, max: Duration) -> Self {
        self.max_cooldown = Some(max);
        self
    }

    /// How many trial calls the half-open circuit lets through at once (1 by default).
    #[must_use]
    pub fn trial_calls(mut self, n: u32) -> Self {
        self.trial_calls = n;
        self
    }

    /// Count a successful call that took longer than `threshold` as a failure (off by default).
    #[must_use]
    pub fn slow_call(mut self, threshold: Duration) -> Self {
        self.slow_call = Some(threshold);
        self
    }

    /// How many circuits are kept (1,000 by default). Past that, a new dependency takes the
    /// place of the least recently used closed, healthy circuit nobody holds; when there is
    /// none, its calls pass with no breaker. Two dependencies never share a circuit.
    #[must_use]
    pub fn max_dependencies(mut self, n: usize) -> Self {
        self.max_dependencies = n;
        self
    }

    /// Called on every state change (as well as the `tracing` event `backstop::breaker`).
    #[must_use]
    pub fn on_transition(
        mut self,
        hook: impl Fn(&CircuitTransition) + Send + Sync + 'static,
    ) -> Self {
        self.on_transition = Some(Arc::new(hook));
        self
    }

    /// The failure-ratio rule's window, when the rule is on.
    #[doc(hidden)] // How Backstop's layers reach each other; not for users.
    pub fn ratio_window(&self) -> Option<Duration> {
        self.failure_ratio.map(|_| self.window)
    }

    pub(crate) fn validate(&self) -> Result<(), InvalidConfig> {
        let bad = |reason: &'static str| Err(InvalidConfig::new(reason));
        if self.consecutive_failures.is_none() && self.failure_ratio.is_none() {
            return bad(
                "breaker needs a rule to open on: set consecutive_failures or failure_ratio",
            );
        }
        if self.consecutive_failures == Some(0) {
            return bad("breaker consecutive_failures must be at least 1");
        }
        if let Some(r) = self.failure_ratio {
            if !(r > 0.0 && r <= 1.0) {
                return bad("breaker failure_ratio must be above 0 and at most 1 (0.5 means 50 %)");
            }
            if self.minimum_calls == 0 {
                return bad("breaker minimum_calls must be at least 1");
            }
            if self.window < Duration::from_millis(10) {
                return bad("breaker window must be at least 10 ms");
            }
        }
        if self.cooldown.is_zero() {
            return bad("breaker cooldown must be greater than zero");
        }
        if self.max_cooldown.is_some_and(|max| max < self.cooldown) {
            return bad("breaker cooldown_growth maximum must not be less than the cooldown");
        }
        if self.trial_calls == 0 {
            return bad("breaker trial_calls must be at least 1");
        }
        if self.max_dependencies == 0 {
            return bad("breaker max_dependencies must be at least 1");
        }
        Ok(())
    }
}
