//! Attempt timeouts learned from observed latency: per dependency, a bounded latency record
//! (a log-scale histogram of atomic counters, in two alternating windows so that what is older
//! than two windows is forgotten), and the timeout derived from a high percentile of it:
//!
//! ```text
//! timeout(attempt) = clamp(factor * p(percentile) * 2^(attempt - 1), floor, ceiling)
//! ```
//!
//! with `fallback` (doubled per attempt, clamped the same) until the record holds `min_samples`
//! successful attempts. The shape of the `adaptive-timeout` crate's rule, which Restate runs in
//! production; the deadline still bounds every attempt. Recording is a few atomic adds, with no
//! allocation and no lock; the timeout is recomputed from the histogram every 16 samples and
//! read as one atomic load.

use crate::latency_record::{BUCKETS, Record, bucket, upper_edge};
use backstop_core::{Dependency, InvalidConfig};
use backstop_state::Registry;
use std::{
    fmt,
    sync::{Arc, atomic::Ordering},
    time::Duration,
};
use tokio::time::Instant;

/// Configuration of [`LatencyTimeouts`].
#[derive(Clone, Debug, PartialEq)]
pub struct LatencyConfig {
    percentile: f64,
    hedge_percentile: f64,
    factor: f64,
    floor: Duration,
    ceiling: Duration,
    fallback: Duration,
    min_samples: u64,
    window: Duration,
    max_dependencies: usize,
}

impl Default for LatencyConfig {
    /// 2 x p99, at least 50 ms, at most 30 s, 2 s until 20 samples, a 30 s window (a shift is
    /// followed within 60 s), at most 1,000 dependencies.
    fn default() -> Self {
        LatencyConfig {
            percentile: 0.99,
            hedge_percentile: 0.95,
            factor: 2.0,
            floor: Duration::from_millis(50),
            ceiling: Duration::from_secs(30),
            fallback: Duration::from_secs(2),
            min_samples: 20,
            window: Duration::from_secs(30),
            max_dependencies: 1_000,
        }
    }
}

impl LatencyConfig {
    /// The percentile the timeout follows (0.99 = p99).
    #[must_use]
    pub fn percentile(mut self, p: f64) -> Self {
        self.percentile = p;
        self
    }

    /// The percentile after which a hedged read sends a second attempt (0.95 = p95).
    #[must_use]
    pub fn hedge_percentile(mut self, p: f64) -> Self {
        self.hedge_percentile = p;
        self
    }

    /// The multiplier on that percentile.
    #[must_use]
    pub fn factor(mut self, factor: f64) -> Self {
        self.factor = factor;
        self
    }

    /// The shortest timeout, whatever the record says.
    #[must_use]
    pub fn floor(mut self, floor: Duration) -> Self {
        self.floor = floor;
        self
    }

    /// The longest timeout, whatever the record says.
    #[must_use]
    pub fn ceiling(mut self, ceiling: Duration) -> Self {
        self.ceiling = ceiling;
        self
    }

    /// The timeout until the record holds enough samples.
    #[must_use]
    pub fn fallback(mut self, fallback: Duration) -> Self {
        self.fallback = fallback;
        self
    }

    /// How many successful attempts the record needs before the timeout follows it.
    #[must_use]
    pub fn min_samples(mut self, n: u64) -> Self {
        self.min_samples = n;
        self
    }

    /// How long each of the record's two windows lasts: a latency is forgotten within two
    /// windows, so a shift is followed within that.
    #[must_use]
    pub fn window(mut self, window: Duration) -> Self {
        self.window = window;
        self
    }

    /// How many dependencies are tracked.
    #[must_use]
    pub fn max_dependencies(mut self, n: usize) -> Self {
        self.max_dependencies = n;
        self
    }

    fn validate(&self) -> Result<(), InvalidConfig> {
        let bad = |why: &'static str| Err(InvalidConfig::new(why));
        if !(self.percentile > 0.0 && self.percentile < 1.0) {
            return bad("latency percentile must be between 0 and 1 (0.99 is p99)");
        }
        if !(self.hedge_percentile > 0.0 && self.hedge_percentile < 1.0) {
            return bad("latency hedge_percentile must be between 0 and 1 (0.95 is p95)");
        }
        if !self.factor.is_finite() || self.factor < 1.0 {
            return bad("latency factor must be a finite number of at least 1");
        }
        if self.floor.is_zero() || self.floor > self.ceiling {
            return bad("latency floor must be above zero and at most the ceiling");
        }
        if self.fallback.is_zero() {
            return bad("latency fallback must be above zero");
        }
        if self.window < Duration::from_millis(10) {
            return bad("latency window must be at least 10 ms");
        }
        if self.max_dependencies == 0 {
            return bad("latency max_dependencies must be at least 1");
        }
        Ok(())
    }
}

struct Inner {
    config: LatencyConfig,
    records: Registry<Record>,
}

/// Attempt timeouts from observed latency, per dependency. `Clone`: clones share every
/// record, so stacks given one `LatencyTimeouts` learn together.
///
/// ```
/// use backstop_timeout::{LatencyConfig, LatencyTimeouts};
/// use backstop_core::Dependency;
/// use std::time::Duration;
///
/// # #[tokio::main(flavor = "current_thread", start_paused = true)]
/// # async fn main() {
/// let timeouts = LatencyTimeouts::new(LatencyConfig::default()).unwrap();
/// let api = Dependency::new("search-api");
/// assert_eq!(timeouts.timeout(&api, 1), Duration::from_secs(2)); // the fallback, at first
/// for _ in 0..200 {
///     timeouts.record(&api, Duration::from_millis(40));
/// }
/// // 2 x p99 of ~40 ms (reported at the top of its 25 % bucket), the second attempt twice that.
/// let first = timeouts.timeout(&api, 1);
/// assert!(first >= Duration::from_millis(80) && first <= Duration::from_millis(110), "{first:?}");
/// assert_eq!(timeouts.timeout(&api, 2), first * 2);
/// # }
/// ```
#[derive(Clone)]
pub struct LatencyTimeouts {
    inner: Arc<Inner>,
    /// The dependency this handle is bound to ([`bind`](Self::bind)), with its record looked
    /// up once.
    bound: Option<(Dependency, Arc<Record>)>,
}

impl fmt::Debug for LatencyTimeouts {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LatencyTimeouts")
            .field("config", &self.inner.config)
            .field("dependencies", &self.inner.records.len())
            .field("bound", &self.dependency())
            .finish()
    }
}

impl LatencyTimeouts {
    /// Timeouts with `config`, or why the configuration is invalid.
    pub fn new(config: LatencyConfig) -> Result<Self, InvalidConfig> {
        config.validate()?;
        Ok(LatencyTimeouts {
            inner: Arc::new(Inner {
                records: Registry::new(config.max_dependencies, |_| Record::new()),
                config,
            }),
            bound: None,
        })
    }

    /// The configuration.
    pub fn config(&self) -> &LatencyConfig {
        &self.inner.config
    }

    /// The same timeouts, bound to `dependency`: its record is looked up once (what a stack
    /// with a fixed dependency keeps), and it names the dependency of requests that carry none.
    /// Every other dependency is still looked up by name.
    #[must_use]
    pub fn bind(&self, dependency: &Dependency) -> LatencyTimeouts {
        LatencyTimeouts {
            inner: self.inner.clone(),
            bound: Some((dependency.clone(), self.inner.records.get(dependency))),
        }
    }

    /// The dependency this handle is bound to, if it is.
    pub fn dependency(&self) -> Option<&Dependency> {
        self.bound.as_ref().map(|(dependency, _)| dependency)
    }

    /// The bound record when `dependency` is the bound one.
    fn bound_to(&self, dependency: &Dependency) -> Option<&Arc<Record>> {
        match &self.bound {
            Some((bound, record)) if bound == dependency => Some(record),
            _ => None,
        }
    }

    /// Records a successful attempt to `dependency` that took `latency`.
    pub fn record(&self, dependency: &Dependency, latency: Duration) {
        match self.bound_to(dependency) {
            Some(record) => self.record_in(record, latency),
            None => self.record_in(&self.inner.records.get(dependency), latency),
        }
    }

    /// Records an attempt to `dependency` that a learned timeout cut (it took at least its
    /// limit). Cuts are counted apart from answers: a few (within twice the percentile's
    /// tail, 2 % for p99: attempts that hang) leave the limit on the answered attempts'
    /// percentile; more than that mean the percentile lies past the limit, which then rises by
    /// `factor` at each recomputation until answers fit under it. Without them a timeout learned
    /// from fast answers would cut the slow ones and never learn them. An attempt cut at the
    /// fallback is not recorded (the fallback is a guess, not evidence).
    pub fn record_cut(&self, dependency: &Dependency) {
        let cut = |record: &Record| {
            if record.timeout.load(Ordering::Relaxed) != 0 {
                self.record_cut_in(record);
            }
        };
        match self.bound_to(dependency) {
            Some(record) => cut(record),
            None => cut(&self.inner.records.get(dependency)),
        }
    }

    /// The timeout for attempt `attempt` (1 for the first) to `dependency`, now.
    pub fn timeout(&self, dependency: &Dependency, attempt: u32) -> Duration {
        if let Some(record) = self.bound_to(dependency) {
            return self.timeout_in(record, attempt);
        }
        match self.inner.records.tracked(dependency) {
            Some(record) => self.timeout_in(&record, attempt),
            None => self.scaled(self.inner.config.fallback, attempt),
        }
    }

    fn record_in(&self, record: &Record, latency: Duration) {
        let epoch = record.epoch(Instant::now(), self.inner.config.window);
        record.window_for(epoch).counts[bucket(latency)].fetch_add(1, Ordering::Relaxed);
        self.counted(record, epoch);
    }

    fn record_cut_in(&self, record: &Record) {
        let epoch = record.epoch(Instant::now(), self.inner.config.window);
        record
            .window_for(epoch)
            .cuts
            .fetch_add(1, Ordering::Relaxed);
        self.counted(record, epoch);
    }

    /// One more sample: the timeout is recomputed every 16, and at the first `min_samples`.
    fn counted(&self, record: &Record, epoch: u64) {
        let n = record.samples.fetch_add(1, Ordering::Relaxed) + 1;
        if n.is_multiple_of(16) || n == self.inner.config.min_samples {
            self.recompute(record, epoch);
        }
    }

    fn recompute(&self, record: &Record, epoch: u64) {
        let c = &self.inner.config;
        // This window and the one before it, if it is the one just before.
        let mut counts = [0u64; BUCKETS];
        let (mut total, mut cuts) = (0, 0);
        for w in &record.windows {
            let e = w.epoch.load(Ordering::Acquire);
            if e == epoch || e + 1 == epoch {
                for (sum, c) in counts.iter_mut().zip(&w.counts) {
                    let n = c.load(Ordering::Relaxed);
                    *sum += n;
                    total += n;
                }
                cuts += w.cuts.load(Ordering::Relaxed);
            }
        }
        if total + cuts < c.min_samples {
            record.timeout.store(0, Ordering::Relaxed);
            record.hedge.store(0, Ordering::Relaxed);
            return;
        }
        let at = |p: f64| {
            let rank = ((total as f64) * p).ceil() as u64;
            let mut seen = 0;
            for (i, n) in counts.iter().enumerate() {
                seen += n;
                if seen >= rank {
                    return upper_edge(i);
                }
            }
            upper_edge(BUCKETS - 1)
        };
        let nanos = |d: Duration| u64::try_from(d.as_nanos()).unwrap_or(u64::MAX).max(1);
        // Cuts are censored: each took at least its limit. A share of them within twice the
        // percentile's tail (2 % for p99: attempts that hang, say) says nothing of the answered
        // attempts' percentile, which the limit follows. A larger share means the percentile
        // itself lies past the limit: it rises by `factor` from the limit in force, until the
        // answers fit under it again.
        let tail = (1.0 - c.percentile) * 2.0;
        let past = total == 0 || (cuts as f64) > tail * ((total + cuts) as f64);
        let timeout = if past {
            let current = Duration::from_nanos(record.timeout.load(Ordering::Relaxed));
            current.max(if total == 0 {
                c.floor
            } else {
                at(c.percentile)
            })
        } else {
            at(c.percentile)
        };
        let timeout = timeout.mul_f64(c.factor).clamp(c.floor, c.ceiling);
        record.timeout.store(nanos(timeout), Ordering::Relaxed);
        record
            .hedge
            .store(nanos(at(c.hedge_percentile)), Ordering::Relaxed);
    }

    fn timeout_in(&self, record: &Record, attempt: u32) -> Duration {
        let c = &self.inner.config;
        let base = match record.timeout.load(Ordering::Relaxed) {
            0 => c.fallback,
            nanos => Duration::from_nanos(nanos),
        };
        // Stale: nothing recorded for two windows, so the value is forgotten too.
        let epoch = record.epoch(Instant::now(), c.window);
        let fresh = record.windows.iter().any(|w| {
            let e = w.epoch.load(Ordering::Relaxed);
            e == epoch || e + 1 == epoch
        });
        self.scaled(if fresh { base } else { c.fallback }, attempt)
    }

    fn hedge_in(&self, record: &Record) -> Option<Duration> {
        let epoch = record.epoch(Instant::now(), self.inner.config.window);
        let fresh = record.windows.iter().any(|w| {
            let e = w.epoch.load(Ordering::Relaxed);
            e == epoch || e + 1 == epoch
        });
        match record.hedge.load(Ordering::Relaxed) {
            0 => None,
            _ if !fresh => None,
            nanos => Some(Duration::from_nanos(nanos)),
        }
    }

    /// The latency at the hedge percentile for `dependency`, once the record holds enough
    /// samples: when a hedged read sends its second attempt.
    pub fn hedge_delay(&self, dependency: &Dependency) -> Option<Duration> {
        if let Some(record) = self.bound_to(dependency) {
            return self.hedge_in(record);
        }
        self.inner
            .records
            .tracked(dependency)
            .and_then(|record| self.hedge_in(&record))
    }

    /// `base` doubled for each attempt after the first, within the floor and the ceiling.
    fn scaled(&self, base: Duration, attempt: u32) -> Duration {
        let c = &self.inner.config;
        let doublings = attempt.saturating_sub(1).min(20);
        base.saturating_mul(1 << doublings)
            .clamp(c.floor, c.ceiling)
    }
}
