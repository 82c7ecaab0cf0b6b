use std::{
    fmt,
    sync::atomic::{AtomicU64, Ordering},
    time::Duration,
};
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

    #[inline]
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

    #[inline]
    fn slot(&self, period: u64) -> &AtomicU64 {
        &self.buckets[(period % self.buckets.len() as u64) as usize]
    }

    /// Adds `n` events at `now`.
    #[inline]
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

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    #[tokio::test(start_paused = true)]
    async fn an_event_dated_a_whole_window_ago_does_not_overwrite_a_newer_bucket() {
        let c = SlidingCount::new(Duration::from_secs(10), 10);
        let t0 = Instant::now();
        // Bucket 0 (0 s..1 s) is reused by period 10 (10 s..11 s).
        c.add(t0 + Duration::from_millis(10_500), 3);
        c.add(t0 + Duration::from_millis(500), 1);
        assert_eq!(c.sum(t0 + Duration::from_millis(10_600)), 3);
        // An event in the past that is still inside the window counts.
        c.add(t0 + Duration::from_millis(9_500), 1);
        assert_eq!(c.sum(t0 + Duration::from_millis(10_600)), 4);
    }

    #[tokio::test(start_paused = true)]
    async fn events_leave_the_window() {
        let c = SlidingCount::new(Duration::from_secs(10), 10);
        let t0 = Instant::now();
        c.add(t0, 5);
        c.add(t0 + Duration::from_millis(4_500), 2);
        assert_eq!(c.sum(t0 + Duration::from_secs(5)), 7);
        assert_eq!(c.sum(t0 + Duration::from_millis(9_999)), 7);
        // The first bucket (0 s..1 s) leaves after 10 s; the one of 4 s..5 s after 14 s.
        assert_eq!(c.sum(t0 + Duration::from_secs(10)), 2);
        assert_eq!(c.sum(t0 + Duration::from_millis(13_999)), 2);
        assert_eq!(c.sum(t0 + Duration::from_secs(14)), 0);
        // A bucket reused after a full turn starts from zero.
        c.add(t0 + Duration::from_secs(20), 1);
        assert_eq!(c.sum(t0 + Duration::from_secs(20)), 1);
    }

    #[tokio::test(start_paused = true)]
    async fn remove_one_undoes_and_reset_forgets() {
        let c = SlidingCount::new(Duration::from_secs(1), 4);
        let t = Instant::now();
        c.add(t, 2);
        c.remove_one(t);
        assert_eq!(c.sum(t), 1);
        c.reset();
        assert_eq!(c.sum(t), 0);
        c.add(t, 1);
        assert_eq!(c.sum(t), 1);
    }

    /// Years of uptime, idle gaps of any length up to years, and resets late in any epoch:
    /// every add counts and every old event leaves the window.
    #[tokio::test(start_paused = true)]
    async fn counts_correctly_after_years_of_uptime_idle_gaps_and_resets() {
        const YEAR: Duration = Duration::from_secs(365 * 86_400);
        // The breaker's finest default: a 1 s window in 10 buckets of 100 ms.
        let c = SlidingCount::new(Duration::from_secs(1), 10);
        let t0 = Instant::now();
        let mut t = t0;
        for gap in [
            Duration::from_secs(97 * 86_400), // 2^23 one-second periods and more
            Duration::from_secs(10 * 86_400), // 2^23 periods of 100 ms: 9.7 days
            YEAR,
            3 * YEAR,
            Duration::from_millis(100) * (1 << 23),
            Duration::from_millis(100) * (1 << 24),
            Duration::from_millis(100) * ((1 << 24) + 5),
            20 * YEAR,
        ] {
            t += gap;
            c.add(t, 1);
            c.add(t + Duration::from_millis(150), 2);
            assert_eq!(c.sum(t + Duration::from_millis(150)), 3, "after {gap:?}");
            assert_eq!(c.sum(t + Duration::from_millis(1_200)), 0, "after {gap:?}");
            c.reset();
            assert_eq!(c.sum(t + Duration::from_millis(150)), 0);
            c.add(t + Duration::from_millis(160), 1);
            assert_eq!(
                c.sum(t + Duration::from_millis(160)),
                1,
                "reset, after {gap:?}"
            );
        }
        // The finest buckets (1 ms), past half of the 40-bit epoch (17.4 years), with a reset.
        let fine = SlidingCount::new(Duration::from_millis(10), 10);
        let late = t0 + 18 * YEAR;
        fine.add(late, 1);
        fine.reset();
        fine.add(late + Duration::from_millis(1), 1);
        assert_eq!(fine.sum(late + Duration::from_millis(1)), 1);
        // A reset at the very end of the epoch (2^40 ms, 34.8 years), and past it, with every
        // bucket in use (a bucket idle for exactly 2^40 periods is the documented limit).
        let edge = t0 + Duration::from_millis((1 << 40) - 500);
        for i in 1..=10 {
            fine.add(edge - Duration::from_millis(i), 1);
        }
        for at in [edge, edge + Duration::from_millis(600)] {
            fine.add(at, 1);
            fine.reset();
            fine.add(at + Duration::from_millis(1), 1);
            assert_eq!(fine.sum(at + Duration::from_millis(1)), 1, "at {at:?}");
        }
        // The budget's shape: a 10 s window of 1 s buckets, years on.
        let b = SlidingCount::new(Duration::from_secs(10), 10);
        let late = t0 + 50 * YEAR;
        for i in 0..10u64 {
            b.add(late + Duration::from_secs(i), 1);
        }
        assert_eq!(b.sum(late + Duration::from_millis(9_500)), 10);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn no_increment_is_lost_under_contention() {
        let c = Arc::new(SlidingCount::new(Duration::from_secs(3600), 10));
        let mut tasks = Vec::new();
        for _ in 0..8 {
            let c = c.clone();
            tasks.push(tokio::spawn(async move {
                for _ in 0..50_000 {
                    c.add(Instant::now(), 1);
                }
            }));
        }
        for t in tasks {
            t.await.unwrap();
        }
        assert_eq!(c.sum(Instant::now()), 400_000);
    }
}
