use crate::HasExtensions;
use std::time::Duration;
use tokio::time::Instant;

/// How far ahead an instant stands for "never": 30 years, where a limit too long for the clock
/// to represent (`Duration::MAX`, say) ends.
const FAR_FUTURE: Duration = Duration::from_secs(86_400 * 365 * 30);

/// `now + d`, or 30 years from `now` when that instant cannot be represented: the one rule for
/// every limit Backstop turns into an instant (deadlines, attempt timeouts, leases, TTLs), so
/// that `Duration::MAX` means "never" and never panics.
///
/// ```
/// use backstop_core::plumbing::instant_after;
/// use std::time::Duration;
/// use tokio::time::Instant;
///
/// let now = Instant::now();
/// assert_eq!(instant_after(now, Duration::from_secs(2)), now + Duration::from_secs(2));
/// assert!(instant_after(now, Duration::MAX) > now + Duration::from_secs(86_400 * 365));
/// ```
#[inline]
pub fn instant_after(now: Instant, d: Duration) -> Instant {
    now.checked_add(d)
        .or_else(|| now.checked_add(FAR_FUTURE))
        .unwrap_or(now)
}

/// The instant by which a whole logical call (every attempt and every backoff sleep) must end.
///
/// The deadline layer and the retry layer store it in the request's extensions (see
/// call context), so every layer further in sees it; the retry
/// layer refuses to sleep past it and the attempt timeout shortens the last attempt to fit
/// inside it. A caller that has its own, tighter deadline puts it in the request first: the
/// tighter one always wins.
///
/// It uses tokio's clock, so tests on paused time control it.
///
/// A deadline made with [`after`](Self::after) also knows its length, so an error can say
/// "its 2 s deadline"; ordering and equality are by instant first.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Deadline {
    at: Instant,
    length: Option<Duration>,
}

impl Deadline {
    /// A deadline at the given instant (of no known length).
    pub const fn at(instant: Instant) -> Self {
        Deadline {
            at: instant,
            length: None,
        }
    }

    /// A deadline `budget` from now (saturating far in the future on overflow).
    pub fn after(budget: Duration) -> Self {
        Deadline::after_from(Instant::now(), budget)
    }

    /// A deadline `budget` after `now` (saturating far in the future on overflow): for a caller
    /// that has already read the clock.
    #[inline]
    #[doc(hidden)] // How Backstop's layers reach each other; not for users.
    pub fn after_from(now: Instant, budget: Duration) -> Self {
        Deadline {
            at: instant_after(now, budget),
            length: Some(budget),
        }
    }

    /// The instant.
    pub const fn instant(self) -> Instant {
        self.at
    }

    /// How long the call was given, when the deadline was made with [`after`](Self::after).
    pub const fn length(self) -> Option<Duration> {
        self.length
    }

    /// Time left until the deadline, zero once it has passed.
    pub fn remaining(self) -> Duration {
        self.at.saturating_duration_since(Instant::now())
    }

    /// The deadline in force for a request: the one in its call context
    /// extension (a retry layer's or a deadline layer's), or else a bare `Deadline` a caller
    /// inserted.
    #[inline]
    pub fn of<R: HasExtensions + ?Sized>(req: &R) -> Option<Deadline> {
        let ext = req.extensions();
        ext.get::<crate::context::CallContext>()
            .and_then(|c| c.deadline)
            .or_else(|| ext.get::<Deadline>().copied())
    }

    /// Records this deadline on the request unless it already carries an earlier one, and
    /// returns the deadline now in force.
    pub fn tighten<R: HasExtensions + ?Sized>(self, req: &mut R) -> Deadline {
        let effective = match Deadline::of(req) {
            Some(existing) if existing <= self => existing,
            _ => self,
        };
        crate::context::CallContext::of_mut(req).deadline = Some(effective);
        effective
    }
}
