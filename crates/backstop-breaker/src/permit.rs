//! What a call gets from its circuit: a permit that records the call's result, or gives a
//! trial slot back when it is dropped, and the count of calls refused.

use crate::circuit::{Circuit, Inner, Kind, Signal};
use backstop_core::{CircuitOpen, Dependency};
use std::{fmt, sync::Arc};
use tokio::time::Instant;

/// Admission to make one call; reports its result, or gives a trial slot back when dropped.
/// Counts a call the breaker refused (`backstop_breaker_rejections_total`, feature `metrics`).
#[inline]
pub(crate) fn count_rejection(open: &CircuitOpen) {
    #[cfg(feature = "metrics")]
    metrics::counter!(
        "backstop_breaker_rejections_total",
        "dependency" => metrics::SharedString::from(open.dependency().metric_label())
    )
    .increment(1);
    let _ = open;
}

pub(crate) struct Permit {
    pub(crate) breaker: Arc<Inner>,
    pub(crate) circuit: Arc<Circuit>,
    pub(crate) kind: Kind,
    pub(crate) generation: u64,
    pub(crate) done: bool,
}

impl fmt::Debug for Permit {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Permit")
            .field("dependency", &self.circuit.dependency)
            .field("kind", &self.kind)
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
        let (kind, generation) = breaker.admit(&circuit, dependency)?;
        Ok(Permit {
            breaker: breaker.clone(),
            circuit,
            kind,
            generation,
            done: false,
        })
    }

    pub(crate) fn record(mut self, signal: Signal) {
        self.done = true;
        self.breaker.record(
            &self.circuit,
            self.kind,
            self.generation,
            signal,
            Instant::now(),
        );
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
