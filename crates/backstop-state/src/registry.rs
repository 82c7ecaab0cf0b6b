use backstop_core::Dependency;
use std::{
    collections::HashMap,
    fmt,
    hash::{BuildHasherDefault, Hasher},
    sync::{
        Arc, OnceLock, RwLock,
        atomic::{AtomicUsize, Ordering},
    },
};

/// Uses the hash a [`Dependency`] carries (computed once, randomly keyed, when it was made)
/// instead of hashing its name again on every lookup.
#[derive(Default)]
struct Prehashed(u64);

impl Hasher for Prehashed {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        // Only `write_u64` is used by `Dependency`'s `Hash`; fold anything else in.
        for b in bytes {
            self.0 = (self.0 ^ u64::from(*b)).wrapping_mul(0x0000_0100_0000_01b3);
        }
    }
    fn write_u64(&mut self, n: u64) {
        self.0 = n;
    }
}

const SHARDS: usize = 16;

type Make<T> = dyn Fn(&Dependency) -> T + Send + Sync;
type Shard<T> = RwLock<HashMap<Dependency, Arc<T>, BuildHasherDefault<Prehashed>>>;

/// A bounded, sharded map from [`Dependency`] to shared state.
///
/// Past `max` tracked dependencies, every dependency not yet tracked shares a single overflow
/// entry: memory stays bounded, and those dependencies are governed together (a budget shared by
/// all of them; a breaker that may open for all of them when they fail together). Raise `max`
/// if your set of dependencies is legitimately large.
pub struct Registry<T> {
    shards: Box<[Shard<T>]>,
    len: AtomicUsize,
    max: usize,
    overflow: OnceLock<Arc<T>>,
    make: Box<Make<T>>,
}

impl<T> fmt::Debug for Registry<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Registry")
            .field("len", &self.len())
            .field("max", &self.max)
            .finish()
    }
}

impl<T> Registry<T> {
    /// A registry of at most `max` dependencies, creating each one's state with `make`.
    pub fn new(max: usize, make: impl Fn(&Dependency) -> T + Send + Sync + 'static) -> Self {
        Registry {
            shards: (0..SHARDS).map(|_| RwLock::default()).collect(),
            len: AtomicUsize::new(0),
            max,
            overflow: OnceLock::new(),
            make: Box::new(make),
        }
    }

    fn shard(&self, dep: &Dependency) -> &Shard<T> {
        // Bits 32.. pick the shard; the map inside uses the low bits and the top seven.
        &self.shards[(dep.prehash() >> 32) as usize % SHARDS]
    }

    /// The state of `dep`, created on first use (or the overflow entry past the bound).
    pub fn get(&self, dep: &Dependency) -> Arc<T> {
        let shard = self.shard(dep);
        if let Some(s) = read(shard).get(dep) {
            return s.clone();
        }
        let mut map = write(shard);
        if let Some(s) = map.get(dep) {
            return s.clone();
        }
        // Reserve a slot; give it back if the bound is reached.
        if self.len.fetch_add(1, Ordering::AcqRel) >= self.max {
            self.len.fetch_sub(1, Ordering::AcqRel);
            drop(map);
            return self
                .overflow
                .get_or_init(|| Arc::new((self.make)(&Dependency::new("(overflow)"))))
                .clone();
        }
        let state = Arc::new((self.make)(dep));
        map.insert(dep.clone(), state.clone());
        state
    }

    /// The state of `dep` if it is tracked (the overflow entry is not returned).
    pub fn get_tracked(&self, dep: &Dependency) -> Option<Arc<T>> {
        read(self.shard(dep)).get(dep).cloned()
    }

    /// Whether `dep` is (or would be) served by the overflow entry.
    pub fn is_overflowing(&self, dep: &Dependency) -> bool {
        self.get_tracked(dep).is_none() && self.len() >= self.max
    }

    /// How many dependencies are tracked (the overflow entry not counted).
    pub fn len(&self) -> usize {
        self.len.load(Ordering::Acquire)
    }

    /// Whether no dependency is tracked yet.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The bound.
    pub fn max(&self) -> usize {
        self.max
    }

    /// Calls `f` for every tracked dependency.
    pub fn for_each(&self, mut f: impl FnMut(&Dependency, &T)) {
        for shard in self.shards.iter() {
            for (k, v) in read(shard).iter() {
                f(k, v);
            }
        }
    }
}

// A panic while holding a shard lock cannot leave the map inconsistent (inserts are single
// calls), so a poisoned lock is used as it is.
fn read<K, V, H>(l: &RwLock<HashMap<K, V, H>>) -> std::sync::RwLockReadGuard<'_, HashMap<K, V, H>> {
    l.read().unwrap_or_else(|p| p.into_inner())
}

fn write<K, V, H>(
    l: &RwLock<HashMap<K, V, H>>,
) -> std::sync::RwLockWriteGuard<'_, HashMap<K, V, H>> {
    l.write().unwrap_or_else(|p| p.into_inner())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicU64;

    #[test]
    fn same_name_same_state() {
        let r = Registry::new(10, |_| AtomicU64::new(0));
        let a = Dependency::new("a");
        r.get(&a).fetch_add(1, Ordering::SeqCst);
        r.get(&Dependency::new("a")).fetch_add(1, Ordering::SeqCst);
        assert_eq!(r.get(&a).load(Ordering::SeqCst), 2);
        assert_eq!(r.len(), 1);
    }

    #[test]
    fn a_million_names_stay_within_the_bound() {
        let r = Registry::new(1_000, |_| AtomicU64::new(0));
        for i in 0..1_000_000u32 {
            r.get(&Dependency::new(format!("host-{i}.example:443")))
                .fetch_add(1, Ordering::Relaxed);
        }
        assert_eq!(r.len(), 1_000);
        let mut tracked = 0u64;
        let mut entries = 0;
        r.for_each(|_, v| {
            entries += 1;
            tracked += v.load(Ordering::Relaxed);
        });
        assert_eq!(entries, 1_000);
        let overflow = r.get(&Dependency::new("one-more"));
        assert_eq!(tracked + overflow.load(Ordering::Relaxed), 1_000_000);
        assert!(r.is_overflowing(&Dependency::new("one-more")));
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn concurrent_first_use_creates_one_state() {
        let r = Arc::new(Registry::new(100, |_| AtomicU64::new(0)));
        let mut tasks = Vec::new();
        for _ in 0..8 {
            let r = r.clone();
            tasks.push(tokio::spawn(async move {
                for i in 0..1_000u64 {
                    r.get(&Dependency::new(format!("dep-{}", i % 50)))
                        .fetch_add(1, Ordering::Relaxed);
                }
            }));
        }
        for t in tasks {
            t.await.unwrap();
        }
        assert_eq!(r.len(), 50);
        let mut total = 0;
        r.for_each(|_, v| total += v.load(Ordering::Relaxed));
        assert_eq!(total, 8_000);
    }
}
