use crate::{Deadline, Dependency, HasExtensions};
use std::{any::TypeId, time::Duration};
use tokio::time::Instant;

/// Who owns a call's retries: a retry layer names itself by a type of its own, so no other
/// code can claim a call in its name.
///
/// A retry layer makes one attempt and leaves retrying to the outer one when the request's
/// context is owned by the same kind of layer as itself. Backstop's retry layer owns calls
/// under a type private to it: a caller cannot name that type, so no caller can set the mark
/// that silences Backstop's retry layers; it can only claim calls for a retrying layer of its
/// own ([`CallContext::claim`]), which Backstop's layers see as "someone outside retries"
/// ([`CallContext::in_retry_scope`]) and nothing more.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct ScopeOwner(TypeId);

impl ScopeOwner {
    /// The owner named by the type `T`.
    pub fn of<T: ?Sized + 'static>() -> Self {
        ScopeOwner(TypeId::of::<T>())
    }
}

/// The per-call facts Backstop's layers share: the deadline, the dependency, the attempt and
/// who owns the call's retries.
///
/// It travels **with the request**, in its extensions. The outermost retry layer puts it on
/// each attempt's copy, so a layer further in sees it whatever runs between the two (a
/// `service_fn` whose future calls the next stack with `oneshot`, a `tower::buffer::Buffer` and
/// its worker task, a request body buffering layer), and work that is not this request (a new
/// call made inside another's `call`, to another dependency) never sees it. The deadline layer
/// writes the deadline, the attempt timeout the attempt's end; nested retry layers, the
/// attempt timeout, the breaker, the body timer, the idempotency layer and any client read it
/// through
/// [`Deadline::of`], [`Dependency::of`] and the readers here.
///
/// Those readers also accept a bare `Deadline` or `Dependency` that a caller put in the
/// extensions itself.
///
/// ```
/// use backstop_core::{CallContext, Claim, Deadline, Dependency, ScopeOwner};
/// use std::time::Duration;
///
/// // A retrying layer of one's own claims calls under a type of its own.
/// struct MyRetries;
/// let mut req = http::Request::new(());
/// assert!(!CallContext::of(&req).is_some_and(CallContext::in_retry_scope));
/// let deadline = Deadline::after(Duration::from_secs(2));
/// let claim = Claim::new(ScopeOwner::of::<MyRetries>(), "search-api").deadline(deadline).attempt(1);
/// CallContext::claim(&mut req, claim);
/// assert!(CallContext::of(&req).is_some_and(CallContext::in_retry_scope));
/// assert!(CallContext::of(&req).is_some_and(|c| c.owned_by(ScopeOwner::of::<MyRetries>())));
/// assert_eq!(Dependency::of(&req).unwrap().as_str(), "search-api");
/// assert_eq!(Deadline::of(&req), Some(deadline));
/// ```
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct CallContext {
    pub(crate) deadline: Option<Deadline>,
    pub(crate) dependency: Option<Dependency>,
    /// The retrying layer that owns the call (the first to claim it), if one does.
    pub(crate) owner: Option<ScopeOwner>,
    /// A retrying layer of another kind that claimed the call inside the owner's (Backstop's
    /// retry layer under a retrying layer of the caller's own), so that its own nested layers
    /// still see it.
    pub(crate) inner_owner: Option<ScopeOwner>,
    /// The outermost retry layer's attempt number (1 for the first), 0 before any.
    pub(crate) attempt: u32,
    /// When the attempt timeout that bounds this attempt cuts it (its limit or the deadline,
    /// whichever ends first), if one does, and that limit.
    pub(crate) attempt_end: Option<(Instant, Option<Duration>)>,
}

/// What a retrying layer records on each attempt's request with [`CallContext::claim`]: who
/// owns the call, the dependency, the call's deadline and the attempt's number.
#[derive(Clone, Debug)]
pub struct Claim {
    owner: ScopeOwner,
    dependency: Dependency,
    deadline: Option<Deadline>,
    attempt: Option<u32>,
}

impl Claim {
    /// A claim by `owner` for a call to `dependency`, with no deadline, leaving the attempt
    /// number an outer layer recorded in place.
    pub fn new(owner: ScopeOwner, dependency: impl Into<Dependency>) -> Self {
        Claim {
            owner,
            dependency: dependency.into(),
            deadline: None,
            attempt: None,
        }
    }

    /// The call's deadline.
    #[must_use]
    pub fn deadline(mut self, deadline: Deadline) -> Self {
        self.deadline = Some(deadline);
        self
    }

    /// This attempt's number (1 for the first).
    #[must_use]
    pub fn attempt(mut self, n: u32) -> Self {
        self.attempt = Some(n);
        self
    }
}

impl CallContext {
    /// The context on a request, if a layer put one there.
    pub fn of<R: HasExtensions + ?Sized>(req: &R) -> Option<&CallContext> {
        req.extensions().get::<CallContext>()
    }

    /// The context on a request, created empty if absent.
    pub(crate) fn of_mut<R: HasExtensions + ?Sized>(req: &mut R) -> &mut CallContext {
        req.extensions_mut().get_or_insert_default()
    }

    /// Records that the retrying layer `owner` retries the call to `dependency` within
    /// `deadline`, and which attempt this request is: its number (`None` leaves the outer
    /// layer's in place, for a nested layer). What a retry layer does to each attempt's request
    /// before it sends it.
    ///
    /// A claim never takes the call from an owner already recorded: the first retrying layer
    /// to claim it owns it, and a layer of another kind further in is recorded beside it
    /// ([`owned_by`](Self::owned_by) answers for both), so no
    /// layer inside can unmark the call for the layers outside. Returns whether `owner` is
    /// recorded; `false` only when two other kinds already are.
    ///
    /// ```
    /// use backstop_core::{CallContext, Claim, ScopeOwner};
    ///
    /// struct Outer;
    /// struct Inner;
    /// let mut req = http::Request::new(());
    /// assert!(CallContext::claim(&mut req, Claim::new(ScopeOwner::of::<Outer>(), "search-api").attempt(1)));
    /// assert!(CallContext::claim(&mut req, Claim::new(ScopeOwner::of::<Inner>(), "search-api")));
    /// // The outer layer still owns the call; the inner one is recorded beside it.
    /// assert!(CallContext::of(&req).is_some_and(|c| c.owned_by(ScopeOwner::of::<Outer>())));
    /// assert!(CallContext::of(&req).is_some_and(|c| c.owned_by(ScopeOwner::of::<Inner>())));
    /// assert_eq!(CallContext::attempt_of(&req), Some(1));
    /// ```
    pub fn claim<R: HasExtensions + ?Sized>(req: &mut R, claim: Claim) -> bool {
        let Claim {
            owner,
            dependency,
            deadline,
            attempt,
        } = claim;
        let ctx = CallContext::of_mut(req);
        let recorded = match (ctx.owner, ctx.inner_owner) {
            (None, _) => {
                ctx.owner = Some(owner);
                true
            }
            (Some(o), _) if o == owner => true,
            (Some(_), None) => {
                ctx.inner_owner = Some(owner);
                true
            }
            (Some(_), Some(i)) => i == owner,
        };
        ctx.dependency = Some(dependency);
        ctx.deadline = deadline;
        ctx.attempt_end = None;
        if let Some(attempt) = attempt {
            ctx.attempt = attempt;
        }
        recorded
    }

    /// Records when the attempt timeout bounding this attempt cuts it, and its own limit
    /// (`None`: the deadline cuts it first): a body timer further in ends the response's body at
    /// the same instant.
    #[doc(hidden)] // How Backstop's layers reach each other; not for users.
    pub fn set_attempt_end<R: HasExtensions + ?Sized>(
        req: &mut R,
        at: Instant,
        limit: Option<Duration>,
    ) {
        CallContext::of_mut(req).attempt_end = Some((at, limit));
    }

    /// When the attempt timeout that bounds this attempt cuts it, and its own limit (`None`:
    /// the deadline), if one does.
    #[doc(hidden)] // How Backstop's layers reach each other; not for users.
    pub fn attempt_end(&self) -> Option<(Instant, Option<Duration>)> {
        self.attempt_end
    }

    /// The attempt number of the retry layer that owns the call (1 for the first attempt), if
    /// a retry layer put this request on its way.
    #[doc(hidden)] // How Backstop's layers reach each other; not for users.
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
        self.owner.is_some()
    }

    /// Whether the retrying layer `owner` owns this call, or claimed it inside the owner's.
    pub fn owned_by(&self, owner: ScopeOwner) -> bool {
        self.owner == Some(owner) || self.inner_owner == Some(owner)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn claim_marks_the_request_and_nothing_else() {
        let mut req = http::Request::new(());
        struct Outer;
        CallContext::claim(
            &mut req,
            Claim::new(ScopeOwner::of::<Outer>(), "outer").attempt(1),
        );
        assert!(CallContext::of(&req).is_some_and(CallContext::in_retry_scope));
        assert!(CallContext::of(&req).is_some_and(|c| c.owned_by(ScopeOwner::of::<Outer>())));
        assert!(!CallContext::of(&req).is_some_and(|c| c.owned_by(ScopeOwner::of::<()>())));
        assert_eq!(CallContext::attempt_of(&req), Some(1));
        assert_eq!(Dependency::of(&req).unwrap().as_str(), "outer");
        // Another request made meanwhile carries nothing.
        let other = http::Request::new(());
        assert!(!CallContext::of(&other).is_some_and(CallContext::in_retry_scope));
        assert!(Dependency::of(&other).is_none());
    }

    #[test]
    fn a_claim_never_takes_the_call_from_its_owner() {
        struct Outer;
        struct Inner;
        struct Third;
        let mut req = http::Request::new(());
        let claim =
            |req: &mut http::Request<()>, owner| CallContext::claim(req, Claim::new(owner, "d"));
        assert!(claim(&mut req, ScopeOwner::of::<Outer>()));
        assert!(claim(&mut req, ScopeOwner::of::<Inner>()));
        assert!(
            claim(&mut req, ScopeOwner::of::<Outer>()),
            "the owner again"
        );
        assert!(
            claim(&mut req, ScopeOwner::of::<Inner>()),
            "the inner one again"
        );
        assert!(
            !claim(&mut req, ScopeOwner::of::<Third>()),
            "no room for a third"
        );
        let ctx = CallContext::of(&req).unwrap();
        assert_eq!(ctx.owner, Some(ScopeOwner::of::<Outer>()));
        assert!(ctx.owned_by(ScopeOwner::of::<Outer>()));
        assert!(ctx.owned_by(ScopeOwner::of::<Inner>()));
        assert!(!ctx.owned_by(ScopeOwner::of::<Third>()));
    }
}
