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
pub fn instant_after(now: Instant, d: Duration) -> Instant {
    now.checked_add(d)
        .or_else(|| now.checked_add(FAR_FUTURE))
        .unwrap_or(now)
}

tokio::task_local! {
    /// The deadline of the request the current task serves: see [`Deadline::scope`].
    static INHERITED: Deadline;
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
    pub fn of<R: HasExtensions + ?Sized>(req: &R) -> Option<Deadline> {
        let ext = req.extensions();
        ext.get::<crate::context::CallContext>()
            .and_then(|c| c.deadline)
            .or_else(|| ext.get::<Deadline>().copied())
    }

    /// The time `req` has left on the wire: until its attempt is cut (the end an attempt
    /// timeout planned for it, within the deadline), else until its deadline; `None` when
    /// nothing limits it. What a client sends onward so that the server can stop working for a
    /// caller that has given up ([`TIME_LEFT_HEADER`](crate::TIME_LEFT_HEADER)).
    ///
    /// ```
    /// use backstop_core::Deadline;
    /// use std::time::Duration;
    ///
    /// # #[tokio::main(flavor = "current_thread", start_paused = true)]
    /// # async fn main() {
    /// let mut req = http::Request::new(());
    /// assert_eq!(Deadline::time_left(&req), None);
    /// Deadline::after(Duration::from_secs(2)).tighten(&mut req);
    /// assert_eq!(Deadline::time_left(&req), Some(Duration::from_secs(2)));
    /// # }
    /// ```
    pub fn time_left<R: HasExtensions + ?Sized>(req: &R) -> Option<Duration> {
        let end = crate::context::CallContext::of(req)
            .and_then(crate::context::CallContext::attempt_end)
            .map(|(at, _)| at)
            .or_else(|| Deadline::of(req).map(Deadline::instant))?;
        Some(end.saturating_duration_since(Instant::now()))
    }

    /// [`time_left`](Self::time_left) as it goes on the wire: whole milliseconds, rounded up.
    pub fn time_left_ms<R: HasExtensions + ?Sized>(req: &R) -> Option<u64> {
        let left = Deadline::time_left(req)?;
        Some(u64::try_from(left.as_micros().div_ceil(1000)).unwrap_or(u64::MAX))
    }

    /// The deadline the current task inherited from the request it serves
    /// ([`scope`](Self::scope)), if any. Backstop's deadline layer tightens every call made in
    /// that task to it, so a server's outbound calls end when its caller's time does.
    pub fn current() -> Option<Deadline> {
        INHERITED.try_with(|d| *d).ok()
    }

    /// Runs `fut` with this deadline inherited by every Backstop stack it calls
    /// ([`current`](Self::current)), tightened to the deadline it already inherits, if that is
    /// earlier: a scope never extends a deadline. What a server layer that reads its caller's
    /// time left does around the handler; a task spawned inside does not inherit it (wrap the
    /// spawned future in its own scope).
    ///
    /// ```
    /// use backstop_core::Deadline;
    /// use std::time::Duration;
    ///
    /// # #[tokio::main(flavor = "current_thread", start_paused = true)]
    /// # async fn main() {
    /// let caller = Deadline::after(Duration::from_secs(2));
    /// let seen = caller.scope(async {
    ///     // A later deadline nested inside does not extend the caller's.
    ///     Deadline::after(Duration::from_secs(60)).scope(async { Deadline::current() }).await
    /// }).await;
    /// assert_eq!(seen, Some(caller));
    /// assert_eq!(Deadline::current(), None);
    /// # }
    /// ```
    pub fn scope<F: Future>(self, fut: F) -> tokio::task::futures::TaskLocalFuture<Deadline, F> {
        INHERITED.scope(self.within_current(), fut)
    }

    /// Runs `f` now with this deadline inherited, as [`scope`](Self::scope) does for a future:
    /// for the work a service does in `call` itself, before it returns its future.
    ///
    /// ```
    /// use backstop_core::Deadline;
    /// use std::time::Duration;
    ///
    /// # #[tokio::main(flavor = "current_thread", start_paused = true)]
    /// # async fn main() {
    /// let caller = Deadline::after(Duration::from_secs(2));
    /// assert_eq!(caller.in_scope(Deadline::current), Some(caller));
    /// # }
    /// ```
    pub fn in_scope<R>(self, f: impl FnOnce() -> R) -> R {
        INHERITED.sync_scope(self.within_current(), f)
    }

    /// This deadline, or the one the task already inherits when that is earlier.
    fn within_current(self) -> Deadline {
        match Deadline::current() {
            Some(outer) if outer <= self => outer,
            _ => self,
        }
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
