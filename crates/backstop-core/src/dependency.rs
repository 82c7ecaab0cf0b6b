use std::{borrow::Borrow, fmt, sync::Arc};

/// The name of a downstream dependency, such as `"carrier-api"`.
///
/// Cheap to clone (a reference-counted string). Backstop stores it in a request's extensions
/// once per logical call so that every inner layer (budget, breaker, attempt timeout) and every
/// error message names the same dependency.
#[derive(Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Dependency(Arc<str>);

impl Dependency {
    /// A dependency with the given name.
    pub fn new(name: impl AsRef<str>) -> Self {
        Dependency(Arc::from(name.as_ref()))
    }

    /// The name.
    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// The name as a shared string (a metrics label without copying it).
    pub fn as_arc(&self) -> Arc<str> {
        self.0.clone()
    }

    /// The dependency recorded in a request's extensions, if a layer put one there.
    pub fn of<R: crate::HasExtensions + ?Sized>(req: &R) -> Option<&Dependency> {
        req.extensions().get::<Dependency>()
    }
}

impl fmt::Debug for Dependency {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(&*self.0, f)
    }
}

impl fmt::Display for Dependency {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl From<&str> for Dependency {
    fn from(s: &str) -> Self {
        Dependency::new(s)
    }
}

impl From<String> for Dependency {
    fn from(s: String) -> Self {
        Dependency(Arc::from(s))
    }
}

impl Borrow<str> for Dependency {
    fn borrow(&self) -> &str {
        &self.0
    }
}

/// Derives the [`Dependency`] a request goes to.
///
/// A fixed [`Dependency`] is itself a key (every request goes to that one dependency);
/// [`ByAuthority`] names HTTP requests after their URI's authority. Agent runtimes implement it
/// for their own request types (for example, one dependency per tool).
pub trait DependencyKey<Req> {
    /// The dependency this request goes to.
    fn dependency(&self, req: &Req) -> Dependency;
}

impl<Req> DependencyKey<Req> for Dependency {
    fn dependency(&self, _req: &Req) -> Dependency {
        self.clone()
    }
}

/// Names an HTTP request's dependency after its URI authority (`host:port`), or `"unknown"`
/// for a request with a relative URI.
#[derive(Clone, Copy, Debug, Default)]
pub struct ByAuthority;

impl<B> DependencyKey<http::Request<B>> for ByAuthority {
    fn dependency(&self, req: &http::Request<B>) -> Dependency {
        match req.uri().authority() {
            Some(a) => Dependency::new(a.as_str()),
            None => Dependency::new("unknown"),
        }
    }
}

impl<Req, F> DependencyKey<Req> for F
where
    F: Fn(&Req) -> Dependency,
{
    fn dependency(&self, req: &Req) -> Dependency {
        self(req)
    }
}
