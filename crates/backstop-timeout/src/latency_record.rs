//! A dependency's latency record: a log-scale histogram of atomic counters in two alternating
//! windows, so that what is older than two windows is forgotten.

use std::{
    sync::atomic::{AtomicU64, Ordering},
    time::Duration,
};
use tokio::time::Instant;

/// Histogram buckets: bucket `i` holds latencies from `MIN * R^i` to `MIN * R^(i+1)`, with `MIN`
/// 100 us and `R` 1.25: 80 buckets reach about 5.6 hours, each within 25 % of its value.
pub(crate) const BUCKETS: usize = 80;
pub(crate) const MIN_NANOS: f64 = 100_000.0;
pub(crate) const RATIO: f64 = 1.25;

/// One window's histogram.
pub(crate) struct Window {
    /// The window's number (time since the record's start, in windows).
    pub(crate) epoch: AtomicU64,
    /// Answered attempts, by latency.
    pub(crate) counts: [AtomicU64; BUCKETS],
    /// Attempts the learned limit cut: each took at least its limit, how much more is unknown.
    pub(crate) cuts: AtomicU64,
}

impl Window {
    pub(crate) fn new() -> Self {
        Window {
            epoch: AtomicU64::new(0),
            counts: std::array::from_fn(|_| AtomicU64::new(0)),
            cuts: AtomicU64::new(0),
        }
    }
}

/// One dependency's latency record.
pub(crate) struct Record {
    pub(crate) windows: [Window; 2],
    pub(crate) origin: Instant,
    pub(crate) samples: AtomicU64,
    /// The current timeout for a first attempt, in nanoseconds (0: not computed yet).
    pub(crate) timeout: AtomicU64,
    /// The latency at the hedge percentile, in nanoseconds (0: not computed yet).
    pub(crate) hedge: AtomicU64,
}

impl Record {
    pub(crate) fn new() -> Self {
        Record {
            windows: [Window::new(), Window::new()],
            origin: Instant::now(),
            samples: AtomicU64::new(0),
            timeout: AtomicU64::new(0),
            hedge: AtomicU64::new(0),
        }
    }

    pub(crate) fn epoch(&self, now: Instant, window: Duration) -> u64 {
        let since = now.saturating_duration_since(self.origin).as_nanos();
        u64::try_from(since / window.as_nanos().max(1)).unwrap_or(u64::MAX)
    }

    /// The window for `epoch`, emptied first when it still holds an older epoch's counts.
    pub(crate) fn window_for(&self, epoch: u64) -> &Window {
        let w = &self.windows[(epoch % 2) as usize];
        let seen = w.epoch.load(Ordering::Acquire);
        if seen != epoch
            && w.epoch
                .compare_exchange(seen, epoch, Ordering::AcqRel, Ordering::Acquire)
                .is_ok()
        {
            // A sample another thread adds meanwhile may be lost or kept: an estimate.
            for c in &w.counts {
                c.store(0, Ordering::Relaxed);
            }
            w.cuts.store(0, Ordering::Relaxed);
        }
        w
    }
}

pub(crate) fn bucket(latency: Duration) -> usize {
    let nanos = latency.as_nanos() as f64;
    if nanos <= MIN_NANOS {
        return 0;
    }
    ((nanos / MIN_NANOS).ln() / RATIO.ln())
        .floor()
        .clamp(0.0, (BUCKETS - 1) as f64) as usize
}

/// The upper edge of bucket `i`: a percentile is reported at the top of its bucket.
pub(crate) fn upper_edge(i: usize) -> Duration {
    Duration::from_nanos((MIN_NANOS * RATIO.powi(i as i32 + 1)) as u64)
}
