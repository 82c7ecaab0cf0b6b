//! What [`Backstop::build`] does: validates the settings together (each error names the
//! setting to change), then composes the layers in their one order: the call's work outside,
//! the deadline, the retry layer (its policy with the budget), the adaptive throttle, the
//! breaker, the attempt timeout (fixed, or learned from latency), and hedging when latency is
//! learned.

use crate::{
    Backstop, BackstopLayer, DEFAULT_ATTEMPT_TIMEOUT, Preset,
    call::{CallWork, KeyGenerator},
    service::HedgeParts,
};
use backstop_breaker::{Breaker, BreakerLayer};
use backstop_budget::{Budget, ThrottleLayer};
use backstop_core::plumbing::HumanDuration;
use backstop_core::{InvalidConfig, RetryBudget};
use backstop_idempotency::IdempotencyLayer;
use backstop_retry::{RetryLayer, StandardPolicy};
use backstop_timeout::{AttemptTimeoutLayer, DeadlineLayer, LearnedTimeoutLayer};
use std::{sync::Arc, time::Duration};

/// The settings that [`Backstop::validate`] derives and checked.
struct Checked {
    attempt_timeout: Duration,
    max_attempts: u32,
    breaker: Option<Breaker>,
}

impl<C, P, I, Pol> Backstop<C, P, I, Pol> {
    fn effective_attempt_timeout(&self) -> Result<Duration, InvalidConfig> {
        if let Some(t) = self.attempt_timeout {
            return Ok(t);
        }
        match self.p99 {
            None => Ok(DEFAULT_ATTEMPT_TIMEOUT),
            Some(p) if p.is_zero() => Err(InvalidConfig::new("p99 must be greater than zero")),
            Some(p) => {
                let ms = (p.as_millis() * 5).div_ceil(2);
                let rounded = ms.div_ceil(100) * 100;
                Ok(Duration::from_millis(
                    u64::try_from(rounded).unwrap_or(u64::MAX),
                ))
            }
        }
    }

    /// The settings checked against each other.
    fn validate(&self) -> Result<Checked, InvalidConfig> {
        let timeout = self.effective_attempt_timeout()?;
        if timeout.is_zero() {
            return Err(InvalidConfig::new(
                "attempt_timeout must be greater than zero",
            ));
        }
        if let Some(d) = self.deadline {
            if d.is_zero() {
                return Err(InvalidConfig::new("deadline must be greater than zero"));
            }
            // A learned timeout is cut to the deadline when it is longer; a fixed one says so now.
            if timeout > d && self.latency.is_none() {
                return Err(InvalidConfig::new(format!(
                    "the attempt timeout ({}) is longer than the deadline ({}): shorten attempt_timeout \
                     (or give a lower p99), or lengthen the deadline",
                    HumanDuration(timeout),
                    HumanDuration(d)
                )));
            }
        }
        let breaker = match &self.breaker {
            Some(b) => b.clone(),
            None => Some(Breaker::process_wide()),
        };
        if let Some(window) = breaker.as_ref().and_then(|b| b.config().ratio_window())
            && window < timeout.saturating_mul(2)
        {
            return Err(InvalidConfig::new(format!(
                "the breaker's failure window ({}) is shorter than two attempt timeouts (2 x {}): \
                 lengthen the window (BreakerConfig::failure_ratio) or shorten attempt_timeout",
                HumanDuration(window),
                HumanDuration(timeout)
            )));
        }
        let max_attempts = match (self.preset, self.max_attempts) {
            (Preset::Destructive, Some(n)) if n > 1 => {
                return Err(InvalidConfig::new(
                    "the destructive preset is never retried automatically: remove max_attempts, or choose another preset",
                ));
            }
            (Preset::Destructive, _) => 1,
            (_, Some(n)) => n,
            (_, None) => backstop_retry::DEFAULT_MAX_ATTEMPTS,
        };
        if self.preset == Preset::Payment && self.reconcile.is_none() {
            return Err(InvalidConfig::new(
                "the payment preset needs a reconciliation hook for unknown outcomes: call reconcile(...)",
            ));
        }
        if !self.idempotency && matches!(self.preset, Preset::Create | Preset::Payment) {
            return Err(InvalidConfig::new(
                "the create and payment presets require idempotency keys: remove no_idempotency(), or choose another preset",
            ));
        }
        Ok(Checked {
            attempt_timeout: timeout,
            max_attempts,
            breaker,
        })
    }

    /// The retry budget the stack spends: the one given or the process's.
    fn retry_budget(&mut self) -> Option<Arc<dyn RetryBudget>> {
        let budget = match self.budget.take() {
            Some(b) => b,
            None => Some(Budget::process_wide()),
        };
        #[cfg(feature = "otel")]
        if let (Some(telemetry), Some(b)) = (&self.otel.telemetry, &budget) {
            let (b, dependency) = (b.clone(), self.dependency.clone());
            telemetry.observe_budget(&self.dependency, move || {
                let stats = b.stats(&dependency);
                (stats.allowance - stats.retries as f64).max(0.0)
            });
        }
        budget.map(|b| Arc::new(b.bind(&self.dependency)) as Arc<dyn RetryBudget>)
    }

    /// How the call's work makes keys: none for reads (or with keys off); required and vouched
    /// for by the create and payment presets; random otherwise.
    fn key_layer(&self) -> Option<IdempotencyLayer<I, KeyGenerator>>
    where
        I: Clone,
    {
        (self.idempotency && self.preset != Preset::ReadOnly).then(|| match self.preset {
            // Requiring keys is declaring that the dependency honours them.
            Preset::Create | Preset::Payment => self
                .keys
                .clone()
                .generator(KeyGenerator::CallerOnly)
                .require_key()
                .vouched(true),
            _ => self
                .keys
                .clone()
                .generator(KeyGenerator::Random)
                .vouched(self.honours_keys),
        })
    }

    /// Validates the configuration and builds the layer.
    pub fn build(mut self) -> Result<BackstopLayer<C, P, I, Pol>, InvalidConfig>
    where
        C: Clone,
        P: Clone,
        I: Clone,
    {
        let checked = self.validate()?;
        let budget = self.retry_budget();
        let keys = self.key_layer();
        let inject = self.keys.injector().clone();
        let transport = self.resend.clone();
        let classifier = self.classifier.clone();
        let mut standard = StandardPolicy::new()
            .backoff(self.backoff)
            .max_attempts(checked.max_attempts)?;
        if let Some(rng) = self.rng {
            standard = standard.rng(rng);
        }
        if let Some(b) = &budget {
            standard = standard.budget(b.clone());
        }
        let retry = RetryLayer::new(self.classifier)
            .resend(self.resend)
            .dependency(self.dependency.clone())
            .policy((self.policy)(standard));
        let deadline = match self.deadline {
            Some(d) => DeadlineLayer::new(d),
            None => DeadlineLayer::inherited(),
        }
        .dependency(self.dependency.clone());
        let attempt_timeout =
            AttemptTimeoutLayer::new(checked.attempt_timeout).dependency(self.dependency.clone());
        let latency = self.latency.as_ref().map(|l| l.bind(&self.dependency));
        let learned = latency.as_ref().map(|latency| {
            LearnedTimeoutLayer::new(latency.clone(), classifier.clone(), checked.attempt_timeout)
        });
        let breaker = (checked.breaker.clone())
            .map(|b| BreakerLayer::new(b, classifier.clone()).dependency(self.dependency.clone()));
        let throttle = (self.throttle.take())
            .map(|t| ThrottleLayer::new(t, classifier.clone()).dependency(self.dependency.clone()));
        #[cfg(feature = "quota")]
        let pace = (self.quotas.take())
            .map(|q| backstop_quota::QuotaLayer::new(q).dependency(self.dependency.clone()));
        let hedging = latency.map(|latency| HedgeParts {
            classifier,
            latency,
            budget: budget.unwrap_or_else(|| Arc::new(backstop_core::NoBudget)),
        });
        // The call's work (key, span, errors, dead letters), once per logical call, outside the
        // retry layer.
        let call = Arc::new(CallWork {
            dependency: self.dependency.clone(),
            inject,
            keys,
            read_only: self.preset == Preset::ReadOnly,
            sink: self.sink,
            reconcile: self.reconcile,
            otel: self.otel.clone(),
        });
        Ok(BackstopLayer {
            dependency: self.dependency,
            call,
            deadline,
            retry,
            attempt_timeout,
            learned,
            max_attempts: checked.max_attempts,
            hedging,
            transport,
            attempt_header: self.attempt_header,
            time_left_header: self.time_left_header,
            otel: self.otel,
            throttle,
            #[cfg(feature = "quota")]
            pace,
            breaker,
        })
    }
}
