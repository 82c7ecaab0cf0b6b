//! The instruments, made once from the user's meter, and what each attempt and each call
//! records into them.

use backstop_core::{Dependency, Outcome};
use opentelemetry::{
    KeyValue,
    metrics::{Counter, Histogram, Meter},
};
use std::{fmt, sync::Arc, time::Duration};

/// The HTTP semantic conventions' advised boundaries for request durations, in seconds.
const DURATION_BOUNDS: [f64; 14] = [
    0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
];
/// Boundaries for counts per call (attempts, retries, hedges).
const COUNT_BOUNDS: [f64; 6] = [0.0, 1.0, 2.0, 3.0, 5.0, 10.0];

/// Backstop's OpenTelemetry instruments, made from one [`Meter`]; cheap to clone. Give it to
/// the composed stack (`Backstop::telemetry`, feature `otel` of `backstop`) and, for the
/// counts the crates keep through the `metrics` facade, install [`OtelRecorder`] with it.
///
/// [`OtelRecorder`]: crate::OtelRecorder
#[derive(Clone)]
pub struct Telemetry {
    pub(crate) inner: Arc<Instruments>,
}

pub(crate) struct Instruments {
    pub(crate) meter: Meter,
    pub(crate) attempt_duration: Histogram<f64>,
    call_duration: Histogram<f64>,
    call_attempts: Histogram<u64>,
    grpc_retries: Histogram<u64>,
    grpc_transparent: Histogram<u64>,
    grpc_hedges: Histogram<u64>,
    grpc_retry_delay: Histogram<f64>,
    throttled: Counter<u64>,
}

impl fmt::Debug for Telemetry {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Telemetry").finish_non_exhaustive()
    }
}

impl Telemetry {
    /// Makes the instruments of the table in the crate's docs from `meter`.
    ///
    /// ```
    /// use opentelemetry::metrics::MeterProvider;
    ///
    /// let provider = opentelemetry_sdk::metrics::SdkMeterProvider::builder().build();
    /// let telemetry = backstop_otel::Telemetry::new(&provider.meter("backstop"));
    /// # let _ = telemetry;
    /// ```
    pub fn new(meter: &Meter) -> Self {
        let seconds = |name: &'static str, what: &'static str| {
            meter
                .f64_histogram(name)
                .with_unit("s")
                .with_description(what)
                .with_boundaries(DURATION_BOUNDS.to_vec())
                .build()
        };
        let counts = |name: &'static str, unit: &'static str, what: &'static str| {
            meter
                .u64_histogram(name)
                .with_unit(unit)
                .with_description(what)
                .with_boundaries(COUNT_BOUNDS.to_vec())
                .build()
        };
        let instruments = Instruments {
            meter: meter.clone(),
            attempt_duration: seconds(
                "http.client.request.duration",
                "Duration of HTTP client requests: one per attempt.",
            ),
            call_duration: seconds(
                "backstop.client.call.duration",
                "Duration of logical calls through a Backstop stack, every attempt and wait included.",
            ),
            call_attempts: counts(
                "backstop.client.call.attempts",
                "{attempt}",
                "Attempts sent per logical call.",
            ),
            grpc_retries: counts(
                "grpc.client.call.retries",
                "{retry}",
                "Retries per gRPC call (A96).",
            ),
            grpc_transparent: counts(
                "grpc.client.call.transparent_retries",
                "{transparent_retry}",
                "Retries per gRPC call after an attempt that never left the client (A96).",
            ),
            grpc_hedges: counts(
                "grpc.client.call.hedges",
                "{hedge}",
                "Hedges per gRPC call (A96).",
            ),
            grpc_retry_delay: meter
                .f64_histogram("grpc.client.call.retry_delay")
                .with_unit("s")
                .with_description("Time a gRPC call spent waiting between attempts (A96).")
                .with_boundaries(DURATION_BOUNDS.to_vec())
                .build(),
            throttled: meter
                .u64_counter("backstop.throttled.calls")
                .with_unit("{call}")
                .with_description("Calls refused by adaptive throttling, nothing sent.")
                .build(),
        };
        Telemetry {
            inner: Arc::new(instruments),
        }
    }

    /// Reports `remaining()`, the retries `dependency`'s budget still grants in its window, as
    /// `backstop.budget.remaining` each time the meter is read (the composed stack does this
    /// for its budget).
    pub fn observe_budget(
        &self,
        dependency: &Dependency,
        remaining: impl Fn() -> f64 + Send + Sync + 'static,
    ) {
        let label = dependency.metric_label();
        let attrs = [
            KeyValue::new("backstop.dependency", label.clone()),
            KeyValue::new("server.address", label),
        ];
        let _registered = self
            .inner
            .meter
            .f64_observable_gauge("backstop.budget.remaining")
            .with_unit("{retry}")
            .with_description("Retries the dependency's budget still grants in its window.")
            .with_callback(move |observer| observer.observe(remaining(), &attrs))
            .build();
    }

    /// Records one logical call's end.
    pub fn record_call(&self, call: &CallRecord) {
        let i = &self.inner;
        let dependency = call.dependency.metric_label();
        let mut attrs = vec![
            KeyValue::new("backstop.dependency", dependency.clone()),
            KeyValue::new("server.address", dependency),
            KeyValue::new("backstop.outcome", call.outcome.as_str()),
        ];
        i.call_attempts.record(u64::from(call.attempts), &attrs);
        if let Some(kind) = call.error {
            attrs.push(KeyValue::new("error.type", kind));
            if kind == "throttled" {
                i.throttled.add(1, &attrs[..2]);
            }
        }
        i.call_duration.record(call.duration.as_secs_f64(), &attrs);
        if let Some(method) = &call.grpc_method {
            let grpc = [
                KeyValue::new("grpc.method", method.clone()),
                KeyValue::new("grpc.target", call.target.clone().unwrap_or_default()),
            ];
            i.grpc_retries
                .record(u64::from(call.attempts.saturating_sub(1)), &grpc);
            i.grpc_transparent
                .record(u64::from(call.transparent_retries), &grpc);
            i.grpc_hedges.record(0, &grpc);
            i.grpc_retry_delay
                .record(call.retry_delay.as_secs_f64(), &grpc);
        }
    }
}

/// One logical call as [`Telemetry::record_call`] records it.
#[derive(Clone, Debug)]
pub struct CallRecord {
    dependency: Dependency,
    duration: Duration,
    attempts: u32,
    transparent_retries: u32,
    retry_delay: Duration,
    outcome: Outcome,
    error: Option<&'static str>,
    grpc_method: Option<String>,
    target: Option<String>,
}

impl CallRecord {
    /// A call to `dependency` that took `duration` and ended with `outcome` after `attempts`
    /// attempts sent.
    pub fn new(
        dependency: Dependency,
        duration: Duration,
        attempts: u32,
        outcome: Outcome,
    ) -> Self {
        CallRecord {
            dependency,
            duration,
            attempts,
            transparent_retries: 0,
            retry_delay: Duration::ZERO,
            outcome,
            error: None,
            grpc_method: None,
            target: None,
        }
    }

    /// It failed, with this kind of error (`error.type`).
    #[must_use]
    pub fn error(mut self, kind: &'static str) -> Self {
        self.error = Some(kind);
        self
    }

    /// Of its retries, `transparent` followed an attempt that was not sent, and it waited
    /// `delay` between attempts in all.
    #[must_use]
    pub fn retries(mut self, transparent: u32, delay: Duration) -> Self {
        self.transparent_retries = transparent;
        self.retry_delay = delay;
        self
    }

    /// It was a gRPC call of `method` (`/package.Service/Method`) to `target`: the A96
    /// instruments are recorded too.
    #[must_use]
    pub fn grpc(mut self, method: impl Into<String>, target: impl Into<String>) -> Self {
        self.grpc_method = Some(method.into());
        self.target = Some(target.into());
        self
    }
}

/// Which `error.type` an attempt's transport error gets: the kind of the first I/O error in
/// its chain of causes (`ConnectionReset`, `TimedOut`, ...), else `_OTHER`.
pub(crate) fn transport_error_type(e: &(dyn std::error::Error + 'static)) -> String {
    std::iter::successors(Some(e), |e| e.source())
        .find_map(|e| e.downcast_ref::<std::io::Error>())
        .map_or_else(|| "_OTHER".to_owned(), |io| format!("{:?}", io.kind()))
}
