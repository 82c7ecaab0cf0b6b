use std::{
    cmp::Ordering,
    fmt,
    hash::{BuildHasher, Hash, Hasher, RandomState},
    sync::{Arc, OnceLock},
};

/// The name of a downstream dependency, such as `"carrier-api"`.
///
/// Cheap to clone (a reference-counted string and its hash). The retry layer names it once per
/// logical call and makes it current for the layers its attempts reach (see
/// call context), so that the budget, the breaker, the attempt timeout and
/// every error message name the same dependency.
///
/// The name is hashed once, when the `Dependency` is made, with a per-process random key (so
/// names chosen by an attacker cannot be made to collide); per-dependency registries look it
/// up by that hash without hashing the string again on every call.
#[derive(Clone)]
pub struct Dependency {
    name: Arc<str>,
    pub(crate) hash: u64,
}

fn keys() -> &'static RandomState {
    static KEYS: OnceLock<RandomState> = OnceLock::new();
    KEYS.get_or_init(RandomState::new)
}

impl Dependency {
    /// A dependency with the given name.
    pub fn new(name: impl AsRef<str>) -> Self {
        Self::from_arc(Arc::from(name.as_ref()))
    }

    /// A dependency for a layer nobody named: unlike any other (each call makes a new one,
    /// `unnamed dependency #1`, `#2`, ...), so two unnamed layers given the same budget or
    /// breaker never share an account or a circuit. Name the dependency for errors, metrics and
    /// sharing that mean something.
    ///
    /// ```
    /// use backstop_core::Dependency;
    /// assert_ne!(Dependency::unnamed(), Dependency::unnamed());
    /// assert!(Dependency::unnamed().as_str().starts_with("unnamed dependency #"));
    /// ```
    pub fn unnamed() -> Self {
        static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);
        let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        Dependency::new(format!("unnamed dependency #{n}"))
    }

    fn from_arc(name: Arc<str>) -> Self {
        let hash = keys().hash_one(&*name);
        Dependency { name, hash }
    }

    /// The name.
    pub fn as_str(&self) -> &str {
        &self.name
    }

    /// The name to label metrics with, bounded per process: the first
    /// [`MAX_METRIC_LABELS`](Self::MAX_METRIC_LABELS) distinct names keep their own label, any
    /// later one is labelled `"(other)"`, so a flood of hostile host names cannot make a
    /// metrics backend's series unbounded.
    #[doc(hidden)] // How Backstop's layers reach each other; not for users.
    pub fn metric_label(&self) -> Arc<str> {
        use std::{
            collections::HashSet,
            sync::{OnceLock, RwLock},
        };
        static SEEN: OnceLock<RwLock<HashSet<Arc<str>>>> = OnceLock::new();
        static OTHER: OnceLock<Arc<str>> = OnceLock::new();
        let seen = SEEN.get_or_init(RwLock::default);
        {
            let set = seen.read().unwrap_or_else(|p| p.into_inner());
            if set.contains(&self.name) {
                return self.name.clone();
            }
            if set.len() >= Self::MAX_METRIC_LABELS {
                return OTHER.get_or_init(|| Arc::from("(other)")).clone();
            }
        }
        let mut set = seen.write().unwrap_or_else(|p| p.into_inner());
        if set.contains(&self.name) || set.len() < Self::MAX_METRIC_LABELS {
            set.insert(self.name.clone());
            return self.name.clone();
        }
        OTHER.get_or_init(|| Arc::from("(other)")).clone()
    }

    /// How many distinct dependency names a process labels metrics with.
    #[doc(hidden)] // How Backstop's layers reach each other; not for users.
    pub const MAX_METRIC_LABELS: usize = 1_000;

    /// The dependency recorded on a request: the one in its
    /// call context extension, or else a bare `Dependency` a caller
    /// inserted.
    pub fn of<R: crate::HasExtensions + ?Sized>(req: &R) -> Option<Dependency> {
        Dependency::on(req).cloned()
    }

    /// The dependency a request names, borrowed: [`of`](Self::of) without the clone.
    #[doc(hidden)] // How Backstop's layers reach each other; not for users.
    pub fn on<R: crate::HasExtensions + ?Sized>(req: &R) -> Option<&Dependency> {
        let ext = req.extensions();
        ext.get::<crate::context::CallContext>()
            .and_then(|c| c.dependency.as_ref())
            .or_else(|| ext.get::<Dependency>())
    }

    /// Records this dependency on the request, for the layers further in.
    pub fn attach<R: crate::HasExtensions + ?Sized>(self, req: &mut R) {
        crate::context::CallContext::of_mut(req).dependency = Some(self);
    }
}

impl PartialEq for Dependency {
    fn eq(&self, other: &Self) -> bool {
        self.hash == other.hash && (Arc::ptr_eq(&self.name, &other.name) || self.name == other.name)
    }
}

impl Eq for Dependency {}

impl Hash for Dependency {
    fn hash<H: Hasher>(&self, state: &mut H) {
        state.write_u64(self.hash);
    }
}

impl PartialOrd for Dependency {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}

impl Ord for Dependency {
    fn cmp(&self, other: &Self) -> Ordering {
        self.name.cmp(&other.name)
    }
}

impl fmt::Debug for Dependency {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(&*self.name, f)
    }
}

impl fmt::Display for Dependency {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.name)
    }
}

impl From<&str> for Dependency {
    fn from(s: &str) -> Self {
        Dependency::new(s)
    }
}

impl From<String> for Dependency {
    fn from(s: String) -> Self {
        Dependency::from_arc(Arc::from(s))
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

#[cfg(test)]
mod label_tests {
    use super::*;

    #[test]
    fn metric_labels_are_bounded_per_process() {
        let first = Dependency::new("label-test-first");
        assert_eq!(&*first.metric_label(), "label-test-first");
        for i in 0..Dependency::MAX_METRIC_LABELS * 2 {
            let _ = Dependency::new(format!("flood-{i}.example")).metric_label();
        }
        assert_eq!(
            &*first.metric_label(),
            "label-test-first",
            "a known name keeps its label"
        );
        assert_eq!(&*Dependency::new("one-too-many").metric_label(), "(other)");
    }
}
