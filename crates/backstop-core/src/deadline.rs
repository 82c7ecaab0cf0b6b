use crate::HasExtensions;
use std::time::Duration;
use tokio::time::Instant;

/// The instant by which a whole logical call (every attempt and every backoff sleep) must end.
///
/// The deadline layer stores it in the request's extensions and the retry layer keeps its own
/// (making it current for its attempts, see [`CallContext`](crate::CallContext)); the retry
/// layer refuses to sleep past it and the attempt timeout shortens the last attempt to fit
/// inside it. A caller that has its own, tighter deadline puts it in the request first: the
/// tighter one always wins.
///
/// It uses tokio's clock, so tests on paused time control it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Deadline(Instant);

impl Deadline {
    /// A deadline at the given instant.
    pub const fn at(instant: Instant) -> Self {
        Deadline(instant)
    }

    /// A deadline `budget` from now (saturating far in the future on overflow).
    pub fn after(budget: Duration) -> Self {
        Deadline::after_from(Instant::now(), budget)
    }

    /// A deadline `budget` after `now` (saturating far in the future on overflow): for a caller
    /// that has already read the clock.
    #[inline]
    pub fn after_from(now: Instant, budget: Duration) -> Self {
        Deadline(
            now.checked_add(budget)
                .unwrap_or_else(|| now + Duration::from_secs(86_400 * 365 * 30)),
        )
    }

    /// The instant.
    pub const fn instant(self) -> Instant {
        self.0
    }

    /// Time left until the deadline, zero once it has passed.
    pub fn remaining(self) -> Duration {
        self.0.saturating_duration_since(Instant::now())
    }

    /// Whether the deadline has passed.
    pub fn has_passed(self) -> bool {
        Instant::now() >= self.0
    }

    /// The deadline in force for a request: the earliest of the one in its
    /// [`CallContext`](crate::CallContext) extension (or else a bare `Deadline` a caller
    /// inserted) and the one of the attempt scope a retry layer made current on this thread
    /// ([`CallContext::enter`](crate::CallContext::enter)).
    pub fn of<R: HasExtensions + ?Sized>(req: &R) -> Option<Deadline> {
        let (_, scoped) = crate::CallContext::current_mark_and_deadline();
        [Deadline::on(req), scoped].into_iter().flatten().min()
    }

    /// The deadline a request carries itself, in its extensions (its
    /// [`CallContext`](crate::CallContext), or a bare `Deadline` a caller inserted); unlike
    /// [`of`](Self::of), not the attempt scope's.
    pub fn on<R: HasExtensions + ?Sized>(req: &R) -> Option<Deadline> {
        let ext = req.extensions();
        ext.get::<crate::CallContext>()
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
        crate::CallContext::of_mut(req).deadline = Some(effective);
        effective
    }
}
