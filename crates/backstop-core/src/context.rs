use crate::{Deadline, Dependency, HasExtensions};
use tokio::time::Instant;

/// The per-call facts Backstop's layers share: the deadline, the dependency and the retry-scope
/// mark.
///
/// It travels **with the request**, in its extensions. The outermost retry layer puts it on
/// the request once, before it keeps the request for replays, so every attempt's copy carries
/// it: a layer further in sees it whatever runs between the two (a `service_fn` whose future
/// calls the next stack with `oneshot`, a `tower::buffer::Buffer` and its worker task, a
/// request body buffering layer), and work that is not this request (a new call made inside
/// another's `call`, to another dependency) never sees it. Nested retry layers, the attempt
/// timeout, breaker and idempotency layers and any leaf read it through [`Deadline::of`],
/// [`Dependency::of`] and [`RetryScope::is_marked`](crate::RetryScope::is_marked).
///
/// Those readers also accept a bare `Deadline` or `Dependency` that a caller put in the
/// extensions itself; the retry-scope mark is only ever set by a retry layer ([`claim`]).
///
/// [`claim`]: CallContext::claim
///
/// ```
/// use backstop_core::plumbing::CallContext;
/// use backstop_core::{Deadline, Dependency, HasExtensions, RetryScope};
/// use std::time::Duration;
///
/// let mut req = http::Request::new(());
/// assert!(!RetryScope::is_marked(&req));
/// let deadline = Deadline::after(Duration::from_secs(2));
/// CallContext::claim(&mut req, Dependency::new("search-api"), Some(deadline), None, None);
/// assert!(RetryScope::is_marked(&req));
/// assert_eq!(Dependency::of(&req).unwrap().as_str(), "search-api");
/// assert_eq!(Deadline::of(&req), Some(deadline));
/// ```
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct CallContext {
    pub(crate) deadline: Option<Deadline>,
    pub(crate) dependency: Option<Dependency>,
    pub(crate) retry_scope: bool,
    /// The outermost retry layer's attempt number (1 for the first), 0 before any.
    pub(crate) attempt: u32,
    /// When the retry layer that made this attempt cuts it (its attempt timeout or the
    /// deadline, whichever ends first), if it does.
    pub(crate) attempt_end: Option<Instant>,
}

impl CallContext {
    /// The context on a request, if a layer put one there.
    #[inline]
    pub fn of<R: HasExtensions + ?Sized>(req: &R) -> Option<&CallContext> {
        req.extensions().get::<CallContext>()
    }

    /// The context on a request, created empty if absent.
    #[inline]
    pub fn of_mut<R: HasExtensions + ?Sized>(req: &mut R) -> &mut CallContext {
        let ext = req.extensions_mut();
        if ext.get::<CallContext>().is_none() {
            ext.insert(CallContext::default());
        }
        ext.get_mut::<CallContext>().expect("just inserted")
    }

    /// Records that a retry layer owns the call to `dependency`, within `deadline`: what a
    /// retry layer does to a request before its first attempt.
    /// `attempt_end` is when the retry layer cuts this attempt (a layer further in that keeps
    /// the same limit, the composed stack's body timer, reads it instead of planning again).
    #[inline]
    pub fn claim<R: HasExtensions + ?Sized>(
        req: &mut R,
        dependency: Dependency,
        deadline: Option<Deadline>,
        attempt: Option<u32>,
        attempt_end: Option<Instant>,
    ) {
        let ctx = CallContext::of_mut(req);
        ctx.retry_scope = true;
        ctx.dependency = Some(dependency);
        ctx.deadline = deadline;
        ctx.attempt_end = attempt_end;
        if let Some(attempt) = attempt {
            ctx.attempt = attempt;
        }
    }

    /// When the retry layer that made this attempt cuts it, if it does.
    pub fn attempt_end(&self) -> Option<Instant> {
        self.attempt_end
    }

    /// The attempt number of the retry layer that owns the call (1 for the first attempt), if
    /// a retry layer put this request on its way.
    pub fn attempt_of<R: HasExtensions + ?Sized>(req: &R) -> Option<u32> {
        req.extensions()
            .get::<CallContext>()
            .map(|c| c.attempt)
            .filter(|n| *n > 0)
    }

    /// The deadline recorded here.
    pub fn deadline(&self) -> Option<Deadline> {
        self.deadline
    }

    /// The dependency recorded here.
    pub fn dependency(&self) -> Option<&Dependency> {
        self.dependency.as_ref()
    }

    /// Whether a retry layer owns this call.
    pub fn in_retry_scope(&self) -> bool {
        self.retry_scope
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::RetryScope;

    #[test]
    fn claim_marks_the_request_and_nothing_else() {
        let mut req = http::Request::new(());
        CallContext::claim(&mut req, Dependency::new("outer"), None, Some(1), None);
        assert!(RetryScope::is_marked(&req));
        assert_eq!(Dependency::of(&req).unwrap().as_str(), "outer");
        // Another request made meanwhile carries nothing.
        let other = http::Request::new(());
        assert!(!RetryScope::is_marked(&other));
        assert!(Dependency::of(&other).is_none());
    }
}
