//! What a call gets from its circuit: a [`Permit`] that records the call's result, or gives a
//! trial slot back when it is dropped, and the count of calls refused.

use crate::circuit::{Circuit, Inner, Kind, Signal};
use backstop_core::{CircuitOpen, Dependency, Outcome, Verdict};
use std::{fmt, sync::Arc};
use tokio::time::Instant;

/// Counts a call the breaker refused (`backstop_breaker_rejections_total`, feature `metrics`).
pub(crate) fn count_rejection(open: &CircuitOpen) {
    #[cfg(feature = "metrics")]
    metrics::counter!(
        "backstop_breaker_rejections_total",
        "dependency" => metrics::SharedString::from(open.dependency().metric_label())
    )
    .increment(1);
    let _ = open;
}

/// Admission to make one call through a dependency's circuit, from
/// [`Breaker::permit`](crate::Breaker::permit): [`record`](Permit::record) tells the circuit how
/// the call ended. A permit dropped unrecorded is a call the caller cancelled: it counts for
/// nothing, and a trial call gives its slot back, so the breaker never stays half-open for good.
///
/// ```
/// use backstop_breaker::{Breaker, BreakerConfig};
/// use backstop_core::{Dependency, Outcome, Verdict};
///
/// # #[tokio::main(flavor = "current_thread", start_paused = true)]
/// # async fn main() {
/// let breaker = Breaker::new(BreakerConfig::default().consecutive_failures(2)).unwrap();
/// let carrier = Dependency::new("carrier-api");
/// let failed = Verdict::Retryable { outcome: Outcome::Unknown, after: None };
/// for _ in 0..2 {
///     breaker.permit(&carrier).unwrap().record(failed);
/// }
/// let open = breaker.permit(&carrier).unwrap_err();
/// assert!(open.to_string().contains("circuit open"));
/// # }
/// ```
pub struct Permit {
    breaker: Arc<Inner>,
    circuit: Arc<Circuit>,
    kind: Kind,
    generation: u64,
    /// When the call began, for the slow-call rule (only when it is on).
    started: Option<Instant>,
    done: bool,
}

impl fmt::Debug for Permit {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Permit")
            .field("dependency", &self.circuit.dependency)
            .field("trial", &(self.kind == Kind::Trial))
            .finish()
    }
}

impl Permit {
    /// Admission through `circuit` for one call of `dependency`, or why not.
    pub(crate) fn acquire(
        breaker: &Arc<Inner>,
        circuit: Arc<Circuit>,
        dependency: &Dependency,
    ) -> Result<Permit, CircuitOpen> {
        let (kind, generation) = breaker
            .admit(&circuit, dependency)
            .inspect_err(count_rejection)?;
        Ok(Permit {
            started: breaker.config.slow_call.map(|_| Instant::now()),
            breaker: breaker.clone(),
            circuit,
            kind,
            generation,
            done: false,
        })
    }

    /// The call ended with `verdict`: a failure (a retryable verdict, or a fatal one whose
    /// outcome is unknown) counts against the circuit; an answer the dependency chose to give
    /// counts for it, unless it took longer than the slow-call threshold; a call never sent
    /// counts for nothing.
    pub fn record(mut self, verdict: Verdict) {
        self.done = true;
        let now = Instant::now();
        let mut signal = signal(verdict);
        if let (Signal::Success, Some(started), Some(limit)) =
            (signal, self.started, self.breaker.config.slow_call)
            && now.saturating_duration_since(started) > limit
        {
            signal = Signal::Failure;
        }
        self.breaker
            .record(&self.circuit, self.kind, self.generation, signal, now);
    }
}

impl Drop for Permit {
    fn drop(&mut self) {
        if !self.done {
            // Cancelled: no failure, and a trial gives its slot back.
            self.breaker.record(
                &self.circuit,
                self.kind,
                self.generation,
                Signal::Ignore,
                Instant::now(),
            );
        }
    }
}

/// What a verdict tells the circuit.
fn signal(verdict: Verdict) -> Signal {
    match verdict {
        Verdict::Success
        | Verdict::Fatal {
            outcome: Outcome::Completed,
        } => Signal::Success,
        Verdict::Fatal {
            outcome: Outcome::NotSent,
        } => Signal::Ignore,
        Verdict::Retryable { .. }
        | Verdict::Fatal {
            outcome: Outcome::Unknown,
        } => Signal::Failure,
    }
}
