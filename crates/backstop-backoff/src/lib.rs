//! Backoff schedules: how long to wait before each retry.
//!
//! Many clients that fail together and retry on the same fixed schedule hit the recovering
//! dependency together, again and again. Randomising the wait ("jitter") spreads them out.
//! The default is **full jitter**, `sleep = random(0, min(cap, base * 2^n))` with a 200 ms base
//! and a 5 s cap, which the AWS Architecture Blog's comparison ("Exponential Backoff and
//! Jitter") found to do the least total work. Equal jitter, decorrelated jitter, plain
//! exponential and constant delays are there too.
//!
//! A [`Backoff`] is validated configuration (an invalid one is an error when it is built, not a
//! panic later); [`Backoff::schedule`] starts the per-call state, and
//! [`Schedule::next_delay`] draws each delay from an RNG you pass in, so tests and simulations
//! seed it and get the same delays every run. Drawing a delay does not allocate.
//!
//! ```
//! use backstop_backoff::{Backoff, RngSource};
//! use std::time::Duration;
//!
//! let backoff = Backoff::default(); // full jitter, 200 ms base, 5 s cap
//! let source = RngSource::seeded(7);
//! let mut rng = source.rng();
//! let mut schedule = backoff.schedule();
//! for n in 0..6 {
//!     let d = schedule.next_delay(&mut rng);
//!     let bound = (Duration::from_millis(200) * 2u32.pow(n)).min(Duration::from_secs(5));
//!     assert!(d <= bound);
//! }
//!
//! assert!(Backoff::full_jitter(Duration::from_secs(1), Duration::from_millis(10)).is_err());
//! ```
#![forbid(unsafe_code)]
// docs.rs (nightly, `--cfg docsrs`) badges every item behind a feature with it.
#![cfg_attr(docsrs, feature(doc_cfg))]
#![deny(missing_docs)]

mod rng;

pub use rng::RngSource;

use rand::{Rng, RngExt};
use std::time::Duration;

/// The default base delay: 200 ms.
pub const DEFAULT_BASE: Duration = Duration::from_millis(200);
/// The default cap: 5 s.
pub const DEFAULT_CAP: Duration = Duration::from_secs(5);

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    Full,
    Equal,
    Decorrelated,
    Exponential,
    Constant,
}

/// A validated backoff configuration. `Copy`, and cheap to pass around.
///
/// ```
/// use backstop_backoff::{Backoff, RngSource};
/// use std::time::Duration;
///
/// // Full jitter between 0 and min(2 s, 100 ms * 2^n), the same delays every run for a seed.
/// let backoff = Backoff::full_jitter(Duration::from_millis(100), Duration::from_secs(2)).unwrap();
/// let mut rng = RngSource::seeded(42).rng();
/// let mut schedule = backoff.schedule();
/// let delays: Vec<Duration> = (0..6).map(|_| schedule.next_delay(&mut rng)).collect();
/// assert!(delays.iter().all(|d| *d <= Duration::from_secs(2)));
/// assert!(delays[0] <= Duration::from_millis(100));
/// // A cap below the base is a configuration error, said when it is built.
/// assert!(Backoff::full_jitter(Duration::from_secs(3), Duration::from_secs(1)).is_err());
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Backoff {
    kind: Kind,
    base: Duration,
    cap: Duration,
}

impl Default for Backoff {
    /// Full jitter with a 200 ms base and a 5 s cap.
    fn default() -> Self {
        Backoff {
            kind: Kind::Full,
            base: DEFAULT_BASE,
            cap: DEFAULT_CAP,
        }
    }
}

use backstop_core::InvalidConfig;

impl Backoff {
    fn exp(kind: Kind, base: Duration, cap: Duration) -> Result<Self, InvalidConfig> {
        if base.is_zero() {
            return Err(InvalidConfig::new("backoff base must be greater than zero"));
        }
        if cap < base {
            return Err(InvalidConfig::new(format!(
                "backoff cap ({cap:?}) must not be less than its base ({base:?})"
            )));
        }
        Ok(Backoff { kind, base, cap })
    }

    /// `random(0, min(cap, base * 2^n))` for the n-th retry (n from 0).
    pub fn full_jitter(base: Duration, cap: Duration) -> Result<Self, InvalidConfig> {
        Self::exp(Kind::Full, base, cap)
    }

    /// `t / 2 + random(0, t / 2)` with `t = min(cap, base * 2^n)`: never shorter than half the
    /// exponential delay.
    pub fn equal_jitter(base: Duration, cap: Duration) -> Result<Self, InvalidConfig> {
        Self::exp(Kind::Equal, base, cap)
    }

    /// `sleep = min(cap, random(base, previous_sleep * 3))`, starting from `base`.
    pub fn decorrelated_jitter(base: Duration, cap: Duration) -> Result<Self, InvalidConfig> {
        Self::exp(Kind::Decorrelated, base, cap)
    }

    /// `min(cap, base * 2^n)` without jitter. Clients that fail together retry together; prefer
    /// a jittered schedule unless you are the only client.
    pub fn exponential(base: Duration, cap: Duration) -> Result<Self, InvalidConfig> {
        Self::exp(Kind::Exponential, base, cap)
    }

    /// The same delay before every retry. Zero is allowed (retry at once).
    pub fn constant(delay: Duration) -> Self {
        Backoff {
            kind: Kind::Constant,
            base: delay,
            cap: delay,
        }
    }

    /// The upper bound of the delay before retry `n` (counting from 0).
    pub fn bound(&self, n: u32) -> Duration {
        match self.kind {
            Kind::Constant => self.base,
            Kind::Decorrelated => self.cap,
            _ => self.exponential_delay(n),
        }
    }

    fn exponential_delay(&self, n: u32) -> Duration {
        self.base
            .saturating_mul(2u32.saturating_pow(n))
            .min(self.cap)
    }

    /// Starts the per-call schedule.
    pub fn schedule(&self) -> Schedule {
        Schedule {
            backoff: *self,
            retries: 0,
            previous: self.base,
        }
    }
}

/// The per-call state of a [`Backoff`]: which retry comes next, and (for decorrelated jitter)
/// the previous delay.
#[derive(Clone, Debug)]
pub struct Schedule {
    backoff: Backoff,
    retries: u32,
    previous: Duration,
}

impl Schedule {
    /// How many delays have been drawn.
    pub fn retries(&self) -> u32 {
        self.retries
    }

    /// Draws the delay before the next retry.
    pub fn next_delay<R: Rng + ?Sized>(&mut self, rng: &mut R) -> Duration {
        let b = &self.backoff;
        let n = self.retries;
        self.retries = self.retries.saturating_add(1);
        match b.kind {
            Kind::Constant => b.base,
            Kind::Exponential => b.exponential_delay(n),
            Kind::Full => uniform(rng, Duration::ZERO, b.exponential_delay(n)),
            Kind::Equal => {
                let t = b.exponential_delay(n);
                let half = t / 2;
                half + uniform(rng, Duration::ZERO, t - half)
            }
            Kind::Decorrelated => {
                let upper = self.previous.saturating_mul(3).max(b.base);
                let d = uniform(rng, b.base, upper).min(b.cap);
                self.previous = d;
                d
            }
        }
    }
}

/// A uniformly drawn duration in `[low, high]`, at nanosecond resolution.
fn uniform<R: Rng + ?Sized>(rng: &mut R, low: Duration, high: Duration) -> Duration {
    let lo = u64::try_from(low.as_nanos()).unwrap_or(u64::MAX);
    let hi = u64::try_from(high.as_nanos()).unwrap_or(u64::MAX);
    if hi <= lo {
        return low;
    }
    Duration::from_nanos(rng.random_range(lo..=hi))
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const MS: Duration = Duration::from_millis(1);

    #[test]
    fn rejects_invalid_configuration() {
        let e = Backoff::full_jitter(Duration::ZERO, DEFAULT_CAP).unwrap_err();
        assert_eq!(e.to_string(), "backoff base must be greater than zero");
        let e = Backoff::decorrelated_jitter(DEFAULT_CAP, DEFAULT_BASE).unwrap_err();
        assert!(
            e.to_string().contains("must not be less than its base"),
            "{e}"
        );
        assert!(Backoff::exponential(MS, MS).is_ok());
    }

    #[test]
    fn exponential_doubles_then_caps() {
        let b = Backoff::exponential(100 * MS, 1_000 * MS).unwrap();
        let mut rng = RngSource::seeded(1).rng();
        let mut s = b.schedule();
        let got: Vec<_> = (0..6).map(|_| s.next_delay(&mut rng)).collect();
        assert_eq!(
            got,
            [
                100 * MS,
                200 * MS,
                400 * MS,
                800 * MS,
                1_000 * MS,
                1_000 * MS
            ]
        );
        // Huge exponents saturate instead of overflowing.
        assert_eq!(b.bound(u32::MAX), 1_000 * MS);
    }

    #[test]
    fn seeded_schedules_repeat() {
        let b = Backoff::default();
        let draw = |seed| {
            let mut rng = RngSource::seeded(seed).rng();
            let mut s = b.schedule();
            (0..8).map(|_| s.next_delay(&mut rng)).collect::<Vec<_>>()
        };
        assert_eq!(draw(42), draw(42));
        assert_ne!(draw(42), draw(43));
    }

    #[test]
    fn full_jitter_spreads_over_the_whole_range() {
        // Over many draws of the first retry, the mean sits near base / 2.
        let b = Backoff::default();
        let mut rng = RngSource::seeded(3).rng();
        let n = 10_000u32;
        let total: Duration = (0..n).map(|_| b.schedule().next_delay(&mut rng)).sum();
        let mean = total / n;
        assert!(mean > 90 * MS && mean < 110 * MS, "mean {mean:?}");
    }

    #[test]
    fn constant_is_constant() {
        let b = Backoff::constant(30 * MS);
        let mut rng = RngSource::seeded(0).rng();
        let mut s = b.schedule();
        assert!((0..5).all(|_| s.next_delay(&mut rng) == 30 * MS));
        assert_eq!(s.retries(), 5);
    }

    fn any_backoff() -> impl Strategy<Value = Backoff> {
        (0u8..4, 1u64..10_000, 0u64..100_000).prop_map(|(k, base, extra)| {
            let base = Duration::from_millis(base);
            let cap = base + Duration::from_millis(extra);
            match k {
                0 => Backoff::full_jitter(base, cap),
                1 => Backoff::equal_jitter(base, cap),
                2 => Backoff::decorrelated_jitter(base, cap),
                _ => Backoff::exponential(base, cap),
            }
            .unwrap()
        })
    }

    proptest! {
        #[test]
        fn every_delay_lies_within_its_bound(b in any_backoff(), seed in any::<u64>(), n in 1usize..40) {
            let mut rng = RngSource::seeded(seed).rng();
            let mut s = b.schedule();
            for i in 0..n {
                let d = s.next_delay(&mut rng);
                prop_assert!(d <= b.bound(i as u32), "retry {} delay {:?} over {:?}", i, d, b.bound(i as u32));
                prop_assert!(d <= b.cap);
                match b.kind {
                    Kind::Equal => prop_assert!(d >= b.bound(i as u32) / 2),
                    Kind::Decorrelated | Kind::Exponential => prop_assert!(d >= b.base),
                    _ => {}
                }
            }
        }

        #[test]
        fn construction_never_panics(base in any::<u64>(), cap in any::<u64>()) {
            let (base, cap) = (Duration::from_nanos(base), Duration::from_nanos(cap));
            let ok = Backoff::full_jitter(base, cap).is_ok();
            prop_assert_eq!(ok, !base.is_zero() && cap >= base);
        }
    }
}
