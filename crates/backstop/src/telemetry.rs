//! The stack's OpenTelemetry instruments (feature `otel`, [`Backstop::telemetry`]): each
//! attempt through `backstop_otel`'s attempt layer (the transport puts it over the client),
//! each call at its end here. Without the feature, or without a [`Telemetry`], nothing of it
//! is in the call's path but one branch.
//!
//! [`Backstop::telemetry`]: crate::Backstop::telemetry
//! [`Telemetry`]: backstop_otel::Telemetry

use backstop_core::{Dependency, Outcome};
use backstop_retry::RetryHistory;

/// The telemetry a stack was given, if any.
#[derive(Clone, Debug, Default)]
pub(crate) struct Otel {
    #[cfg(feature = "otel")]
    pub(crate) telemetry: Option<backstop_otel::Telemetry>,
}

impl Otel {
    /// The call's start, when the stack records telemetry; `grpc`: its method and target.
    pub(crate) fn begin(
        &self,
        dependency: &Dependency,
        grpc: impl FnOnce() -> Option<(String, String)>,
    ) -> Slot {
        #[cfg(feature = "otel")]
        if let Some(telemetry) = &self.telemetry {
            return Slot(Some(Box::new(OtelCall {
                telemetry: telemetry.clone(),
                dependency: dependency.clone(),
                started: tokio::time::Instant::now(),
                grpc: grpc(),
            })));
        }
        let _ = (dependency, grpc);
        Slot::default()
    }
}

/// A call's start for its telemetry, kept in the call's state: nothing at all (no byte of the
/// future every call moves) without the feature.
#[derive(Debug, Default)]
pub(crate) struct Slot(#[cfg(feature = "otel")] Option<Box<OtelCall>>);

impl Slot {
    /// Whether the call records telemetry.
    pub(crate) fn is_some(&self) -> bool {
        #[cfg(feature = "otel")]
        return self.0.is_some();
        #[cfg(not(feature = "otel"))]
        false
    }

    /// The call's start, once.
    pub(crate) fn take(&mut self) -> Option<Box<OtelCall>> {
        #[cfg(feature = "otel")]
        return self.0.take();
        #[cfg(not(feature = "otel"))]
        None
    }
}

/// One call's start, for its record at the end.
#[derive(Debug)]
pub(crate) struct OtelCall {
    #[cfg(feature = "otel")]
    telemetry: backstop_otel::Telemetry,
    #[cfg(feature = "otel")]
    dependency: Dependency,
    #[cfg(feature = "otel")]
    started: tokio::time::Instant,
    #[cfg(feature = "otel")]
    grpc: Option<(String, String)>,
}

impl OtelCall {
    /// Records the call's end: `attempts` sent, its `history` when it has one, its outcome
    /// and, when it failed, its kind of error.
    pub(crate) fn end(
        self,
        attempts: u32,
        history: Option<&RetryHistory>,
        outcome: Outcome,
        error: Option<&'static str>,
    ) {
        #[cfg(feature = "otel")]
        {
            let took = tokio::time::Instant::now().saturating_duration_since(self.started);
            let (mut transparent, mut delay) = (0, std::time::Duration::ZERO);
            if let Some(h) = history {
                for pair in h.attempts.windows(2) {
                    if !pair[0].sent || pair[0].verdict.outcome() == Outcome::NotSent {
                        transparent += 1;
                    }
                }
                delay = h.attempts.iter().filter_map(|a| a.wait).sum();
            }
            let mut record =
                backstop_otel::CallRecord::new(self.dependency, took, attempts, outcome)
                    .retries(transparent, delay);
            if let Some(kind) = error {
                record = record.error(kind);
            }
            if let Some((method, target)) = self.grpc {
                record = record.grpc(method, target);
            }
            self.telemetry.record_call(&record);
        }
        #[cfg(not(feature = "otel"))]
        let _ = (self, attempts, history, outcome, error);
    }
}
