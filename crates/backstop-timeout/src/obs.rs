//! What the timeout layers tell through the `metrics` facade when the `metrics` feature is on
//! (no-ops otherwise): `backstop_attempt_timeout_seconds{dependency}`, the limit a learned
//! attempt timeout last planned.

use backstop_core::Dependency;
use std::time::Duration;

pub(crate) fn attempt_timeout(d: &Dependency, limit: Duration) {
    #[cfg(feature = "metrics")]
    metrics::gauge!(
        "backstop_attempt_timeout_seconds",
        "dependency" => metrics::SharedString::from(d.metric_label())
    )
    .set(limit.as_secs_f64());
    let _ = (d, limit);
}
