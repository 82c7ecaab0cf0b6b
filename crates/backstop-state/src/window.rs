// Through `crate::sync`, so that the loom model (`tests/loom.rs`) runs this very file on
// loom's atomics.
use crate::sync::{AtomicU64, Ordering};
use std::{fmt, time::Duration};
use tokio::time::Instant;

// 24 bits of count (16.7 million events per bucket, saturating) and 40 bits of period, compared
// modulo 2^40: uptime never matters, and an idle bucket is only mistaken for a live one after a
// gap within a window (or `MAX_LATE`) of a multiple of 2^40 periods: 34.8 years at the finest
// 1 ms bucket, 3,484 years at the breaker's 100 ms, 34,842 years at the budget's 1 s.
const COUNT_BITS: u32 = 24;
/// How many periods late an event may be dated (a caller passing the time its call started)
/// and still be told from an idle bucket: 2^20 (17 minutes at the finest 1 ms bucket).
const MAX_LATE: u64 = 1 << 20;
const COUNT_MASK: u64 = (1 << COUNT_BITS) - 1;
const EPOCH_MASK: u64 = (1 << (64 - COUNT_BITS)) - 1;

/// Counts events over a sliding window, in buckets, without locks.
///
/// The window is `buckets` buckets of `window / buckets` each; an event counts until its bucket
/// falls out of the window, so the window slides in steps of one bucket. Each bucket packs its
/// epoch (which bucket-period it belongs to) and its count into one `AtomicU64`: an increment is
/// a compare-and-swap loop that either adds to the current period or starts a new one, so no
/// increment is ever lost to a rollover.
pub struct SlidingCount {
    buckets: Box<[AtomicU64]>,
    width_nanos: u64,
    origin: Instant,
}

impl fmt::Debug for SlidingCount {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SlidingCount")
            .field("buckets", &self.buckets.len())
            .field("bucket_width", &Duration::from_nanos(self.width_nanos))
            .finish()
    }
}

impl SlidingCount {
    /// A counter over `window`, in `buckets` buckets (at least one; the bucket width at least
    /// one millisecond).
    pub fn new(window: Duration, buckets: usize) -> Self {
        let buckets = buckets.max(1);
        let width = (window.as_nanos() / buckets as u128).max(1_000_000);
        SlidingCount {
            buckets: (0..buckets).map(|_| AtomicU64::new(0)).collect(),
            width_nanos: u64::try_from(width).unwrap_or(u64::MAX),
            origin: Instant::now(),
        }
    }

    /// The window length.
    pub fn window(&self) -> Duration {
        Duration::from_nanos(self.width_nanos.saturating_mul(self.buckets.len() as u64))
    }

    fn period(&self, now: Instant) -> u64 {
        // u64 nanoseconds (584 years) rather than `as_nanos`' u128: a 128-bit division costs a
        // library call on every count.
        let since = now.saturating_duration_since(self.origin);
        let nanos = since
            .as_secs()
            .saturating_mul(1_000_000_000)
            .saturating_add(u64::from(since.subsec_nanos()));
        nanos / self.width_nanos
    }

    fn slot(&self, period: u64) -> &AtomicU64 {
        &self.buckets[(period % self.buckets.len() as u64) as usize]
    }

    /// Adds `n` events at `now`.
    pub fn add(&self, now: Instant, n: u64) {
        let period = self.period(now);
        let epoch = period & EPOCH_MASK;
        let slot = self.slot(period);
        let mut current = slot.load(Ordering::Relaxed);
        loop {
            let held = current >> COUNT_BITS;
            // A slot already holding a later period means `now` is a whole window old (a caller
            // passing the time its call started): the event is outside the window, drop it
            // rather than overwrite the newer bucket.
            // Only a bucket a little ahead is newer: an event is late by the length of a call
            // at most, while a bucket left idle for ages is simply old, however its period
            // compares modulo 2^40.
            // An empty bucket (never used, or reset) holds nothing to protect: it is taken.
            let ahead = held.wrapping_sub(epoch) & EPOCH_MASK;
            if held != epoch && ahead < MAX_LATE && current & COUNT_MASK != 0 {
                return;
            }
            let next = if held == epoch {
                (current & !COUNT_MASK) | ((current & COUNT_MASK).saturating_add(n) & COUNT_MASK)
            } else {
                (epoch << COUNT_BITS) | (n & COUNT_MASK)
            };
            match slot.compare_exchange_weak(current, next, Ordering::AcqRel, Ordering::Relaxed) {
                Ok(_) => return,
                Err(actual) => current = actual,
            }
        }
    }

    /// Removes one event added at `now`, if its bucket is still current and non-empty
    /// (used to undo a tentative increment).
    pub fn remove_one(&self, now: Instant) {
        let period = self.period(now);
        let epoch = period & EPOCH_MASK;
        let slot = self.slot(period);
        let mut current = slot.load(Ordering::Relaxed);
        while current >> COUNT_BITS == epoch && current & COUNT_MASK > 0 {
            match slot.compare_exchange_weak(
                current,
                current - 1,
                Ordering::AcqRel,
                Ordering::Relaxed,
            ) {
                Ok(_) => return,
                Err(actual) => current = actual,
            }
        }
    }

    /// The events counted in the window ending at `now`.
    pub fn sum(&self, now: Instant) -> u64 {
        let period = self.period(now);
        let n = self.buckets.len() as u64;
        self.buckets
            .iter()
            .map(|b| {
                let v = b.load(Ordering::Acquire);
                let age = (period & EPOCH_MASK).wrapping_sub(v >> COUNT_BITS) & EPOCH_MASK;
                if age < n { v & COUNT_MASK } else { 0 }
            })
            .sum()
    }

    /// Forgets every event. Each bucket keeps its period and loses its count, so the next add
    /// counts as usual whenever it comes (a reset never makes a bucket look newer than it is).
    pub fn reset(&self) {
        for b in self.buckets.iter() {
            b.fetch_and(!COUNT_MASK, Ordering::AcqRel);
        }
    }
}
