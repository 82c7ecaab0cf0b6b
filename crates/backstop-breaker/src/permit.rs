//! What a call gets from its circuit: a permit that records the call's result, or gives a
//! trial slot back when it is dropped, and the count of calls refused.

use crate::circuit::{Circuit, Inner};
use backstop_core::CircuitOpen;
use std::{fmt, sync::Arc};
use tokio::time::Instant;

/// What a finished call tells the circuit.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Signal {
    Success,
    Failure,
    /// Not sent, or cancelled: counts for nothing.
    Ignore,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Kind {
    Normal,
    Trial,
}

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
