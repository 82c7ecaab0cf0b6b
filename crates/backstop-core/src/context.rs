use crate::{Deadline, Dependency, HasExtensions};

/// The per-call facts Backstop's layers share, kept together in **one** request extension.
///
/// Each value put in `http::Extensions` is a separate heap allocation, and the retry layer
/// copies the extensions for every attempt. Keeping the deadline, the dependency and the
/// retry-scope mark in one small struct makes that one allocation instead of three (and one
/// more, not three, per copy). Read it through [`Deadline::of`], [`Dependency::of`] and
/// [`RetryScope::is_marked`](crate::RetryScope::is_marked); those also accept a bare
/// `Deadline`, `Dependency` or `RetryScope` that a caller inserted itself.
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
