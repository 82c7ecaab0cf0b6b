use crate::{Deadline, Dependency, HasExtensions};
use std::cell::RefCell;

thread_local! {
    static CURRENT: RefCell<Option<CallContext>> = const { RefCell::new(None) };
}

/// Keeps a [`CallContext`] current on this thread until dropped, then puts the previous one
/// back (also when the code in between panics). From [`CallContext::make_current`].
#[derive(Debug)]
#[must_use = "the context is current only until the guard is dropped"]
pub struct ScopeGuard {
    prev: Option<CallContext>,
}

impl Drop for ScopeGuard {
    #[inline]
    fn drop(&mut self) {
        let prev = self.prev.take();
        // `try_with`: during thread teardown there is nothing to restore.
        let _ = CURRENT.try_with(|c| *c.borrow_mut() = prev);
    }
}

/// The per-call facts Backstop's layers share: the deadline, the dependency and the retry-scope
/// mark.
///
/// They reach the layers of an attempt in one of two ways:
///
/// - **the attempt scope** (the default, free): while a retry layer calls the service it wraps,
///   it makes the context *current* on that thread with [`CallContext::enter`]. Every layer
///   whose `call` runs inside (a nested retry layer, an attempt timeout, a breaker, the
///   idempotency layer) sees it through [`Deadline::of`], [`Dependency::of`] and
///   [`RetryScope::is_marked`](crate::RetryScope::is_marked). Nothing is allocated.
/// - **the request's extensions**: one `CallContext` value in the attempt's copy of the request.
///   That survives a task boundary (a `tower::buffer::Buffer`, a service that hands requests to
///   a spawned worker), which the scope does not, at the price of the extension map's
///   allocations; retry layers do it when asked to (`mark_requests`).
///
/// Those readers also accept a bare `Deadline`, `Dependency` or `RetryScope` that a caller put in
/// the extensions itself.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct CallContext {
    pub(crate) deadline: Option<Deadline>,
    pub(crate) dependency: Option<Dependency>,
    pub(crate) retry_scope: bool,
}

impl CallContext {
    /// The context of a call owned by a retry layer: its dependency and deadline, marked.
    pub fn for_retry(dependency: Dependency, deadline: Option<Deadline>) -> Self {
        CallContext {
            deadline,
            dependency: Some(dependency),
            retry_scope: true,
        }
    }

    /// Runs `f` with this context as the current attempt scope on this thread, and puts the
    /// previous scope back afterwards (also if `f` panics). A retry layer wraps its inner
    /// service's `call` in it, so the layers that `call` reaches see the attempt's deadline,
    /// dependency and retry mark without any allocation.
    ///
    /// ```
    /// use backstop_core::{CallContext, Dependency, RetryScope};
    ///
    /// let req = http::Request::new(());
    /// assert!(!RetryScope::is_marked(&req));
    /// CallContext::for_retry(Dependency::new("search-api"), None).enter(|| {
    ///     assert!(RetryScope::is_marked(&req));
    ///     assert_eq!(Dependency::of(&req).unwrap().as_str(), "search-api");
    /// });
    /// assert!(!RetryScope::is_marked(&req));
    /// ```
    pub fn enter<T>(self, f: impl FnOnce() -> T) -> T {
        let _guard = self.make_current();
        f()
    }

    /// Makes this context the current attempt scope on this thread until the guard is dropped:
    /// [`enter`](Self::enter) without a closure.
    #[inline]
    pub fn make_current(self) -> ScopeGuard {
        ScopeGuard {
            prev: CURRENT.with(|c| c.replace(Some(self))),
        }
    }

    /// Calls `f` with the current attempt scope, if a retry layer's call is in progress on this
    /// thread. `f` sees a copy, so it may itself enter a scope (call a service) safely.
    pub fn with_current<T>(f: impl FnOnce(Option<&CallContext>) -> T) -> T {
        let current = CURRENT.with(|c| c.borrow().clone());
        f(current.as_ref())
    }

    /// The current attempt scope's retry mark and deadline: what a retry layer reads on every
    /// call, without copying the scope (`(false, None)` outside any scope).
    #[inline]
    pub fn current_mark_and_deadline() -> (bool, Option<Deadline>) {
        CURRENT.with(|c| {
            c.borrow()
                .as_ref()
                .map_or((false, None), |c| (c.retry_scope, c.deadline))
        })
    }

    /// The current attempt scope's dependency, if any.
    pub fn current_dependency() -> Option<Dependency> {
        CURRENT.with(|c| c.borrow().as_ref().and_then(|c| c.dependency.clone()))
    }

    /// The context on a request, if a layer put one there.
    pub fn of<R: HasExtensions + ?Sized>(req: &R) -> Option<&CallContext> {
        req.extensions().get::<CallContext>()
    }

    /// The context on a request, created empty if absent.
    pub fn of_mut<R: HasExtensions + ?Sized>(req: &mut R) -> &mut CallContext {
        let ext = req.extensions_mut();
        if ext.get::<CallContext>().is_none() {
            ext.insert(CallContext::default());
        }
        ext.get_mut::<CallContext>().expect("just inserted")
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

    fn current_name() -> Option<String> {
        CallContext::with_current(|c| c.and_then(|c| c.dependency().map(|d| d.as_str().to_owned())))
    }

    #[test]
    fn scopes_nest_and_unwind_in_order() {
        assert_eq!(current_name(), None);
        CallContext::for_retry(Dependency::new("outer"), None).enter(|| {
            assert_eq!(current_name().as_deref(), Some("outer"));
            CallContext::for_retry(Dependency::new("inner"), None).enter(|| {
                assert_eq!(current_name().as_deref(), Some("inner"));
            });
            assert_eq!(current_name().as_deref(), Some("outer"));
        });
        assert_eq!(current_name(), None);
        assert!(!RetryScope::is_marked(&http::Request::new(())));
    }

    #[test]
    fn code_that_reads_the_scope_may_enter_another() {
        CallContext::for_retry(Dependency::new("outer"), None).enter(|| {
            let seen = CallContext::with_current(|c| {
                assert!(c.is_some());
                // A service called while reading the scope enters its own: no borrow conflict.
                CallContext::for_retry(Dependency::new("inner"), None).enter(current_name)
            });
            assert_eq!(seen.as_deref(), Some("inner"));
        });
    }
}
