//! Each dependency's quotas as its responses advertise them, and the attempts admitted against
//! them.

use crate::headers::{Advertised, Unit};
use backstop_core::Dependency;
use rand::{RngExt, SeedableRng, rngs::SmallRng};
use std::{
    collections::HashMap,
    fmt,
    future::Future,
    pin::Pin,
    sync::{Arc, Mutex, MutexGuard},
    time::Duration,
};
use tokio::time::Instant;

/// What an attempt will cost beyond its one request: tokens, for an LLM API. Put it in the
/// request's extensions; it is charged against every token quota the dependency advertises
/// (tokens, input tokens, output tokens) until the response's own figures correct it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Cost {
    /// Tokens the call is expected to use.
    pub tokens: u64,
}

impl Cost {
    /// A call expected to use `tokens`.
    pub const fn tokens(tokens: u64) -> Self {
        Cost { tokens }
    }

    /// What it costs of `unit`.
    pub(crate) fn of(self, unit: Unit) -> u64 {
        match unit {
            Unit::Requests => 1,
            Unit::Tokens | Unit::InputTokens | Unit::OutputTokens => self.tokens,
        }
    }
}

/// How many dependencies' quotas are kept; a process calling more is not paced for the rest.
const MAX_DEPENDENCIES: usize = 4096;

/// The quotas of the dependencies a process calls, learned from their responses; clones share
/// them, so every stack calling one dependency paces against one account.
#[derive(Clone)]
pub struct Quotas {
    inner: Arc<Inner>,
}

struct Inner {
    dependencies: Mutex<HashMap<Dependency, Account>>,
    spread: Duration,
    rng: Mutex<SmallRng>,
    /// The fleet these quotas joined, while its handle lives.
    #[cfg(feature = "fleet")]
    fleet: Mutex<std::sync::Weak<crate::fleet::Link>>,
}

impl fmt::Debug for Quotas {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Quotas")
            .field("spread", &self.inner.spread)
            .finish_non_exhaustive()
    }
}

impl Default for Quotas {
    fn default() -> Self {
        Quotas::new(Duration::from_secs(2), rand::make_rng())
    }
}

/// One dependency's quotas, by unit.
#[derive(Debug, Default)]
struct Account {
    windows: HashMap<Unit, Window>,
}

impl Account {
    /// Reserves `cost` in every window until its attempt is answered.
    fn reserve(&mut self, cost: Cost) {
        for (&unit, window) in &mut self.windows {
            let need = cost.of(unit);
            window.remaining = window.remaining.saturating_sub(need);
            window.in_flight = window.in_flight.saturating_add(need);
        }
    }
}

/// One quota: what is left of it (the server's figure less what is in flight since), and when
/// it resets.
#[derive(Debug, Clone, Copy)]
struct Window {
    limit: Option<u64>,
    remaining: u64,
    reset_at: Option<Instant>,
    /// Reserved by attempts admitted and not yet answered.
    in_flight: u64,
    /// Set once the window has run out: attempts arriving around its reset are spread over the
    /// quotas' spread after it, instead of all at once.
    ran_out: bool,
    /// The reset of a window that had run out, while attempts after it are still spread.
    spread_from: Option<Instant>,
}

/// What an attempt is told.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Admission {
    /// Go now; its cost is reserved.
    Now,
    /// Wait until then, and ask again.
    At(Instant),
    /// The wait would not end before the deadline (or the cost is more than the whole quota):
    /// not sent.
    Refused(Refusal),
}

/// The fleet's answer to an attempt ([`Quotas::join_fleet`](crate::Fleet)).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[cfg_attr(
    not(feature = "fleet"),
    expect(dead_code, reason = "only a fleet answers")
)]
pub(crate) enum Answer {
    /// Go now: its cost was taken from the fleet's account, in this generation of its windows.
    Go { generation: i64 },
    /// Not enough left: wait for the reset (`after`), or end not sent if it comes too late.
    Wait(Refusal),
    /// More than the whole quota: never.
    Never(Refusal),
}

/// The fleet's answer on its way, or `None` when it gave none: the process paces alone.
pub(crate) type Asking = Pin<Box<dyn Future<Output = Option<Answer>> + Send>>;

/// Why an attempt was refused: the quota it would exceed, and when it could go.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Refusal {
    pub(crate) unit: Unit,
    pub(crate) limit: Option<u64>,
    pub(crate) remaining: u64,
    pub(crate) cost: u64,
    /// When it could be sent; `None`: never (it costs more than the whole quota).
    pub(crate) after: Option<Duration>,
}

impl Quotas {
    /// Quotas whose waiters, woken by one reset, are spread over up to `spread` after it, with
    /// `rng`'s draws (seed it for a reproducible spread).
    pub(crate) fn new(spread: Duration, rng: SmallRng) -> Self {
        Quotas {
            inner: Arc::new(Inner {
                dependencies: Mutex::default(),
                spread,
                rng: Mutex::new(rng),
                #[cfg(feature = "fleet")]
                fleet: Mutex::default(),
            }),
        }
    }

    /// Quotas whose waiters are spread over up to `spread` after a reset (2 s unless set), with
    /// reproducible draws from `seed`.
    pub fn seeded(spread: Duration, seed: u64) -> Self {
        Quotas::new(spread, SmallRng::seed_from_u64(seed))
    }

    /// Quotas whose waiters are spread over up to `spread` after a reset.
    pub fn with_spread(spread: Duration) -> Self {
        Quotas::new(spread, rand::make_rng())
    }

    /// What is left of `dependency`'s quota in `unit`, as this process knows it (the server's
    /// last figure less the attempts in flight since), if it advertised one.
    pub fn remaining(&self, dependency: &Dependency, unit: Unit) -> Option<u64> {
        let now = Instant::now();
        let mut all = self.lock();
        let window = all.get_mut(dependency)?.windows.get_mut(&unit)?;
        roll(window, now);
        Some(window.remaining)
    }

    fn lock(&self) -> MutexGuard<'_, HashMap<Dependency, Account>> {
        // A panic while the map was held leaves it as it was: still the best figures there are.
        self.inner
            .dependencies
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    fn jitter(&self, up_to: Duration) -> Duration {
        if up_to.is_zero() {
            return Duration::ZERO;
        }
        let mut rng = self.inner.rng.lock().unwrap_or_else(|p| p.into_inner());
        let nanos = u64::try_from(up_to.as_nanos()).unwrap_or(u64::MAX);
        Duration::from_nanos(rng.random_range(0..nanos))
    }

    /// An instant drawn over the quotas' spread after `from`, before `deadline`: when one of
    /// the callers woken by one reset goes.
    pub(crate) fn spread_after(&self, from: Instant, deadline: Option<Instant>) -> Instant {
        let end = deadline.map_or(from + self.inner.spread, |d| {
            d.min(from + self.inner.spread)
        });
        from + self.jitter(end.saturating_duration_since(from))
    }

    /// The fleet these quotas are in, while its handle lives.
    #[cfg(feature = "fleet")]
    pub(crate) fn fleet_slot(&self) -> MutexGuard<'_, std::sync::Weak<crate::fleet::Link>> {
        self.inner.fleet.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Asks the fleet for an attempt of `cost` to `dependency`; `None` when the process paces
    /// it alone: no fleet, or none that can answer now.
    pub(crate) fn ask_fleet(&self, dependency: &Dependency, cost: Cost) -> Option<Asking> {
        #[cfg(feature = "fleet")]
        {
            let link = self.fleet_slot().upgrade()?;
            link.ask(dependency, cost)
        }
        #[cfg(not(feature = "fleet"))]
        {
            let _ = (dependency, cost);
            None
        }
    }

    /// Shares what a response said of `dependency`'s quotas with the fleet, if any.
    fn share(&self, dependency: &Dependency, advertised: &[Advertised]) {
        if advertised.is_empty() {
            return;
        }
        #[cfg(feature = "fleet")]
        if let Some(link) = self.fleet_slot().upgrade() {
            link.learn(dependency, advertised);
        }
        #[cfg(not(feature = "fleet"))]
        let _ = (dependency, advertised);
    }

    /// An attempt the fleet let go (in `generation`) never left: its cost goes back to the
    /// fleet's account.
    pub(crate) fn give_back(&self, dependency: &Dependency, cost: Cost, generation: i64) {
        #[cfg(feature = "fleet")]
        if let Some(link) = self.fleet_slot().upgrade() {
            link.give_back(dependency, cost, generation);
        }
        #[cfg(not(feature = "fleet"))]
        let _ = (dependency, cost, generation);
    }

    /// Reserves `cost` in this process's account for an attempt the fleet let go, so that the
    /// process's own figures stay right should it pace alone.
    pub(crate) fn reserve(&self, dependency: &Dependency, cost: Cost, now: Instant) {
        let mut all = self.lock();
        if let Some(account) = all.get_mut(dependency) {
            for window in account.windows.values_mut() {
                roll(window, now);
            }
            account.reserve(cost);
        }
    }

    /// Asks to send an attempt of `cost` to `dependency` at `now`, before `deadline`. `spread`
    /// is false for an attempt that already waited for its turn (it is not spread twice).
    pub(crate) fn admit(
        &self,
        dependency: &Dependency,
        cost: Cost,
        now: Instant,
        deadline: Option<Instant>,
        spread: bool,
    ) -> Admission {
        let mut all = self.lock();
        let Some(account) = all.get_mut(dependency) else {
            return Admission::Now;
        };
        // The latest instant any quota lets it go, and a quota it would exceed.
        let mut wake: Option<Instant> = None;
        let mut spread_from: Option<Instant> = None;
        let mut short: Option<Refusal> = None;
        for (&unit, window) in &mut account.windows {
            let need = cost.of(unit);
            roll(window, now);
            if need == 0 {
                continue;
            }
            if window.limit.is_some_and(|limit| need > limit) {
                return Admission::Refused(Refusal {
                    unit,
                    limit: window.limit,
                    remaining: window.remaining,
                    cost: need,
                    after: None,
                });
            }
            if let Some(reset) = window.spread_from {
                if now < reset + self.inner.spread {
                    // Reset after running out: everyone woken by it goes within the spread.
                    spread_from = Some(spread_from.map_or(reset, |s: Instant| s.max(reset)));
                } else {
                    window.spread_from = None;
                }
            }
            if need <= window.remaining {
                continue;
            }
            // Not enough left: it waits for the reset (a window whose reset is unknown cannot be
            // waited for; the server says no if it must).
            let Some(reset_at) = window.reset_at else {
                continue;
            };
            window.ran_out = true;
            if wake.is_none_or(|w| reset_at > w) {
                wake = Some(reset_at);
                short = Some(Refusal {
                    unit,
                    limit: window.limit,
                    remaining: window.remaining,
                    cost: need,
                    after: Some(reset_at.saturating_duration_since(now)),
                });
            }
        }
        if let Some(wake) = wake {
            if deadline.is_some_and(|d| wake >= d) {
                return Admission::Refused(short.expect("a quota it waits for"));
            }
            // Spread the waiters of one reset over the spread after it, within the deadline.
            return Admission::At(self.spread_after(wake, deadline));
        }
        if spread
            && let Some(from) = spread_from
            && now < from + self.inner.spread
        {
            let at = self.spread_after(from, deadline);
            if at > now {
                return Admission::At(at);
            }
        }
        account.reserve(cost);
        Admission::Now
    }

    /// Corrects `dependency`'s token quotas for a call charged `charged` that used `used`, as
    /// the caller learned it from the response's body (an LLM API's `usage`, read as the
    /// caller streams it: nothing is buffered for this). The difference goes back to, or comes
    /// off, what is left in the current windows; the server's next remaining figure replaces it
    /// anyway.
    ///
    /// ```
    /// use backstop_core::Dependency;
    /// use backstop_quota::{Cost, Quotas, Unit};
    /// use std::time::Duration;
    ///
    /// # #[tokio::main(flavor = "current_thread", start_paused = true)]
    /// # async fn main() {
    /// # let quotas = Quotas::seeded(Duration::ZERO, 1);
    /// # let llm = Dependency::from("llm-api");
    /// # quotas.learn(&llm, &[backstop_quota::Advertised {
    /// #     unit: Unit::Tokens, limit: Some(40_000), remaining: Some(30_000), reset: Some(Duration::from_secs(60)),
    /// # }]);
    /// // 4,000 tokens were charged for a call whose body reported 1,500.
    /// quotas.settle(&llm, Cost::tokens(4_000), Cost::tokens(1_500));
    /// assert_eq!(quotas.remaining(&llm, Unit::Tokens), Some(32_500));
    /// # }
    /// ```
    pub fn settle(&self, dependency: &Dependency, charged: Cost, used: Cost) {
        let now = Instant::now();
        let mut all = self.lock();
        let Some(account) = all.get_mut(dependency) else {
            return;
        };
        for (&unit, window) in &mut account.windows {
            if unit == Unit::Requests {
                continue;
            }
            roll(window, now);
            let limit = window.limit.unwrap_or(u64::MAX);
            window.remaining = if used.tokens <= charged.tokens {
                window
                    .remaining
                    .saturating_add(charged.tokens - used.tokens)
                    .min(limit)
            } else {
                window
                    .remaining
                    .saturating_sub(used.tokens - charged.tokens)
            };
        }
    }

    /// Learns what a response (or anything else) said of `dependency`'s quotas, as
    /// [`QuotaLayer`](crate::QuotaLayer) does from each response it sees: for quotas learned
    /// another way, before the first call.
    pub fn learn(&self, dependency: &Dependency, advertised: &[Advertised]) {
        absorb(&mut self.lock(), dependency, Instant::now(), advertised);
        self.share(dependency, advertised);
    }

    /// An attempt admitted with `cost` has ended: its reservation is released, and what the
    /// response said of the quotas (as of `now`) replaces what was known. `sent` is false for
    /// an attempt that never left (its cost is given back).
    pub(crate) fn ended(
        &self,
        dependency: &Dependency,
        cost: Cost,
        now: Instant,
        sent: bool,
        advertised: &[Advertised],
    ) {
        let mut all = self.lock();
        if let Some(account) = all.get_mut(dependency) {
            for (&unit, window) in &mut account.windows {
                let need = cost.of(unit);
                window.in_flight = window.in_flight.saturating_sub(need);
                if !sent {
                    window.remaining = window.remaining.saturating_add(need);
                }
            }
        }
        absorb(&mut all, dependency, now, advertised);
        drop(all);
        self.share(dependency, advertised);
    }
}

/// What a response said of `dependency`'s quotas, as of `now`, replacing what was known.
fn absorb(
    all: &mut HashMap<Dependency, Account>,
    dependency: &Dependency,
    now: Instant,
    advertised: &[Advertised],
) {
    if advertised.is_empty() {
        return;
    }
    if !all.contains_key(dependency) {
        if all.len() >= MAX_DEPENDENCIES {
            return;
        }
        all.insert(dependency.clone(), Account::default());
    }
    let account = all.get_mut(dependency).expect("inserted");
    for a in advertised {
        let window = account.windows.entry(a.unit).or_insert(Window {
            limit: None,
            remaining: u64::MAX,
            reset_at: None,
            in_flight: 0,
            ran_out: false,
            spread_from: None,
        });
        window.limit = a.limit.or(window.limit);
        if let Some(reset) = a.reset {
            window.reset_at = Some(now + reset);
        }
        if let Some(remaining) = a.remaining {
            // The server counted every attempt it answered; those still in flight it has not
            // seen.
            window.remaining = remaining.saturating_sub(window.in_flight);
        }
        if window.remaining == 0 {
            window.ran_out = true;
        }
    }
}

/// A window past its reset starts again: full when its limit is known, unknown otherwise; if it
/// had run out, the attempts that waited for its reset are spread after it.
fn roll(window: &mut Window, now: Instant) {
    if let Some(reset) = window.reset_at
        && reset <= now
    {
        if std::mem::take(&mut window.ran_out) {
            window.spread_from = Some(reset);
        }
        window.remaining = window
            .limit
            .map_or(u64::MAX, |limit| limit.saturating_sub(window.in_flight));
        window.reset_at = None;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tokens(limit: u64, remaining: u64, reset: Duration) -> Advertised {
        Advertised {
            unit: Unit::Tokens,
            limit: Some(limit),
            remaining: Some(remaining),
            reset: Some(reset),
        }
    }

    #[tokio::test(start_paused = true)]
    async fn an_attempt_waits_for_the_reset_when_the_quota_is_spent() {
        let quotas = Quotas::seeded(Duration::ZERO, 1);
        let dep = Dependency::from("llm");
        let now = Instant::now();
        quotas.ended(
            &dep,
            Cost::default(),
            now,
            true,
            &[tokens(40_000, 3_000, Duration::from_secs(20))],
        );
        assert_eq!(
            quotas.admit(&dep, Cost::tokens(2_000), now, None, true),
            Admission::Now
        );
        assert_eq!(quotas.remaining(&dep, Unit::Tokens), Some(1_000));
        assert_eq!(
            quotas.admit(&dep, Cost::tokens(2_000), now, None, true),
            Admission::At(now + Duration::from_secs(20))
        );
        // Past the deadline: refused, with when it could go.
        let refused = quotas.admit(
            &dep,
            Cost::tokens(2_000),
            now,
            Some(now + Duration::from_secs(5)),
            true,
        );
        let Admission::Refused(r) = refused else {
            panic!("{refused:?}")
        };
        assert_eq!(
            (r.unit, r.after),
            (Unit::Tokens, Some(Duration::from_secs(20)))
        );
        // More than the whole quota: never.
        let Admission::Refused(r) = quotas.admit(&dep, Cost::tokens(50_000), now, None, true)
        else {
            panic!()
        };
        assert_eq!(r.after, None);
    }

    #[tokio::test(start_paused = true)]
    async fn the_servers_figure_counts_what_is_still_in_flight() {
        let quotas = Quotas::seeded(Duration::ZERO, 1);
        let dep = Dependency::from("llm");
        let now = Instant::now();
        quotas.ended(
            &dep,
            Cost::default(),
            now,
            true,
            &[tokens(10_000, 10_000, Duration::from_secs(60))],
        );
        for _ in 0..3 {
            assert_eq!(
                quotas.admit(&dep, Cost::tokens(1_000), now, None, true),
                Admission::Now
            );
        }
        // One of the three answers: the server says 9,000 left; two are still in flight.
        quotas.ended(
            &dep,
            Cost::tokens(1_000),
            now,
            true,
            &[tokens(10_000, 9_000, Duration::from_secs(60))],
        );
        assert_eq!(quotas.remaining(&dep, Unit::Tokens), Some(7_000));
        // One never left: its cost comes back.
        quotas.ended(&dep, Cost::tokens(1_000), now, false, &[]);
        assert_eq!(quotas.remaining(&dep, Unit::Tokens), Some(8_000));
    }

    #[tokio::test(start_paused = true)]
    async fn waiters_of_one_reset_are_spread_within_the_deadline() {
        let spread = Duration::from_secs(2);
        let quotas = Quotas::seeded(spread, 7);
        let dep = Dependency::from("llm");
        let now = Instant::now();
        let reset = now + Duration::from_secs(10);
        quotas.ended(
            &dep,
            Cost::default(),
            now,
            true,
            &[tokens(100, 0, Duration::from_secs(10))],
        );
        let wakes: Vec<Instant> = (0..50)
            .map(
                |_| match quotas.admit(&dep, Cost::tokens(1), now, None, true) {
                    Admission::At(at) => at,
                    other => panic!("{other:?}"),
                },
            )
            .collect();
        assert!(wakes.iter().all(|w| *w >= reset && *w < reset + spread));
        let first = wakes.iter().min().unwrap();
        let last = wakes.iter().max().unwrap();
        assert!(
            *last - *first > Duration::from_secs(1),
            "spread out: {:?}",
            *last - *first
        );
        // Within a deadline shorter than the spread.
        let deadline = reset + Duration::from_millis(300);
        for _ in 0..50 {
            match quotas.admit(&dep, Cost::tokens(1), now, Some(deadline), true) {
                Admission::At(at) => assert!(at >= reset && at < deadline),
                other => panic!("{other:?}"),
            }
        }
    }
}
