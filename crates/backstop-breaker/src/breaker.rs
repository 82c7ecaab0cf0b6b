//! The breaker's handle: per-dependency circuits shared by every clone, read and steered by an
//! operator. The state machine behind it, and what a circuit reports, are in `circuit.rs`.

use crate::BreakerConfig;
use crate::{
    circuit::{CircuitStats, Inner},
    permit::Permit,
};
use backstop_core::{CircuitOpen, CircuitState, Dependency, InvalidConfig};
use std::{fmt, sync::Arc};

/// Per-dependency circuits. `Clone`: clones share every circuit, so one `Breaker` given to
/// several stacks governs them together.
///
/// ```
/// use backstop_breaker::{Breaker, BreakerConfig, BreakerLayer, CircuitOpen};
/// use backstop_classify::HttpClassifier;
/// use backstop_core::{BoxError, CircuitState, Dependency};
/// use tower::{Layer, ServiceExt, service_fn};
///
/// # #[tokio::main(flavor = "current_thread", start_paused = true)]
/// # async fn main() -> Result<(), BoxError> {
/// let breaker = Breaker::new(BreakerConfig::default().consecutive_failures(2))?;
/// let down = service_fn(|_req: http::Request<()>| async {
///     Ok::<_, BoxError>(http::Response::builder().status(503).body(())?)
/// });
/// let svc = BreakerLayer::new(breaker.clone(), HttpClassifier::new())
///     .dependency("carrier-api")
///     .layer(down);
/// for _ in 0..2 {
///     svc.clone().oneshot(http::Request::new(())).await?; // two 503s in a row
/// }
/// let carrier = Dependency::new("carrier-api");
/// assert_eq!(breaker.state(&carrier), CircuitState::Open);
/// let refused = svc.oneshot(http::Request::new(())).await.unwrap_err();
/// assert!(refused.downcast_ref::<CircuitOpen>().is_some()); // not sent: it fails fast
///
/// // An operator can isolate a dependency, and reset it.
/// breaker.isolate(&carrier);
/// assert_eq!(breaker.state(&carrier), CircuitState::Isolated);
/// breaker.reset(&carrier);
/// assert_eq!(breaker.state(&carrier), CircuitState::Closed);
/// # Ok(())
/// # }
/// ```
#[derive(Clone)]
pub struct Breaker {
    pub(crate) inner: Arc<Inner>,
}

impl fmt::Debug for Breaker {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Breaker")
            .field("config", &self.inner.config)
            .field("dependencies", &self.inner.circuits.len())
            .finish()
    }
}

impl Default for Breaker {
    fn default() -> Self {
        Breaker::new(BreakerConfig::default()).expect("the default configuration is valid")
    }
}

impl Breaker {
    /// The one breaker of the whole process, with the default configuration: what every
    /// `Backstop` stack asks unless given another, so that a dependency has one circuit
    /// however many stacks call it. Choose it by name when a hand-composed stack should share
    /// it too; give a stack `Breaker::new(..)` for circuits of its own.
    pub fn process_wide() -> Breaker {
        static PROCESS: std::sync::OnceLock<Breaker> = std::sync::OnceLock::new();
        PROCESS.get_or_init(Breaker::default).clone()
    }

    /// A breaker with `config`, or why the configuration is invalid.
    pub fn new(config: BreakerConfig) -> Result<Self, InvalidConfig> {
        config.validate()?;
        Ok(Breaker {
            inner: Arc::new(Inner::new(config)),
        })
    }

    /// The configuration.
    pub fn config(&self) -> &BreakerConfig {
        &self.inner.config
    }

    /// The state of `dependency`'s circuit (closed if it was never used).
    pub fn state(&self, dependency: &Dependency) -> CircuitState {
        self.stats(dependency).state
    }

    /// What `dependency`'s circuit has counted.
    pub fn stats(&self, dependency: &Dependency) -> CircuitStats {
        self.inner.stats(dependency)
    }

    /// Opens `dependency`'s circuit until [`reset`](Self::reset): every call fails fast.
    pub fn isolate(&self, dependency: &Dependency) {
        self.inner.isolate(dependency);
    }

    /// Closes `dependency`'s circuit and forgets its failures.
    pub fn reset(&self, dependency: &Dependency) {
        self.inner.reset(dependency);
    }

    /// How many dependencies have a circuit of their own.
    pub fn tracked(&self) -> usize {
        self.inner.circuits.len()
    }

    /// Admission to make one call to `dependency`, or, while its circuit is open (or its trial
    /// slots are taken), the refusal to hand the caller: the call is not sent.
    pub fn permit(&self, dependency: &Dependency) -> Result<Permit, CircuitOpen> {
        let circuit = self.inner.circuits.get(dependency);
        Permit::acquire(&self.inner, circuit, dependency)
    }
}
