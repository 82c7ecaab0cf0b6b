use backstop_core::Dependency;
use std::{
    collections::HashMap,
    fmt,
    hash::{BuildHasherDefault, Hasher},
    sync::{
        Arc, RwLock,
        atomic::{AtomicU64, AtomicUsize, Ordering},
    },
};
use tokio::time::Instant;

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
type Evictable<T> = dyn Fn(&T) -> bool + Send + Sync;
type Shard<T> = RwLock<HashMap<Dependency, Slot<T>, BuildHasherDefault<Prehashed>>>;

struct Slot<T> {
    state: Arc<T>,
    /// When it was last looked up, in milliseconds since the registry's origin.
    used: AtomicU64,
}

/// A bounded, sharded map from [`Dependency`] to shared state.
///
/// No two dependencies ever share state. Past `max` tracked dependencies, a new name takes the
/// place of the least recently used entry of its shard that nobody holds (no bound budget or
/// breaker, no call in flight) and that the owner allows to go ([`evict_when`]; the breaker
/// keeps every circuit that is not closed). When no entry can go, the new name gets fresh
/// state of its own that is not kept: it is governed by nothing that outlives the lookup (no
/// breaker, a budget of one call), rather than by another dependency's.
///
/// [`evict_when`]: Registry::evict_when
pub struct Registry<T> {
    shards: Box<[Shard<T>]>,
    len: AtomicUsize,
    max: usize,
    origin: Instant,
    make: Box<Make<T>>,
    evictable: Box<Evictable<T>>,
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
            origin: Instant::now(),
            make: Box::new(make),
            evictable: Box::new(|_| true),
        }
    }

    /// Which entries may make room for a new dependency at the bound (besides being held by
    /// nobody, which is always required): all of them by default.
    #[must_use]
    pub fn evict_when(mut self, f: impl Fn(&T) -> bool + Send + Sync + 'static) -> Self {
        self.evictable = Box::new(f);
        self
    }

    fn shard(&self, dep: &Dependency) -> &Shard<T> {
        // Bits 32.. pick the shard; the map inside uses the low bits and the top seven.
        &self.shards[(backstop_core::plumbing::prehash(dep) >> 32) as usize % SHARDS]
    }

    fn now_ms(&self) -> u64 {
        u64::try_from(
            Instant::now()
                .saturating_duration_since(self.origin)
                .as_millis(),
        )
        .unwrap_or(u64::MAX)
    }

    /// The state of `dep`, created on first use. At the bound it takes the place of an idle
    /// entry, or, when none can go, is fresh state that is not kept (see the type's docs).
    pub fn get(&self, dep: &Dependency) -> Arc<T> {
        let shard = self.shard(dep);
        if let Some(s) = read(shard).get(dep) {
            s.used.store(self.now_ms(), Ordering::Relaxed);
            return s.state.clone();
        }
        let mut map = write(shard);
        let now = self.now_ms();
        if let Some(s) = map.get(dep) {
            s.used.store(now, Ordering::Relaxed);
            return s.state.clone();
        }
        let state = Arc::new((self.make)(dep));
        // Reserve a slot; at the bound, make room (in this shard first, then the next ones)
        // or keep nothing.
        if self.len.fetch_add(1, Ordering::AcqRel) >= self.max {
            self.len.fetch_sub(1, Ordering::AcqRel);
            drop(map);
            if !self.evict_one(dep) {
                return state;
            }
            if self.len.fetch_add(1, Ordering::AcqRel) >= self.max {
                // Another new name took the room meanwhile.
                self.len.fetch_sub(1, Ordering::AcqRel);
                return state;
            }
            map = write(shard);
            if let Some(s) = map.get(dep) {
                // Another caller tracked it meanwhile.
                self.len.fetch_sub(1, Ordering::AcqRel);
                return s.state.clone();
            }
        }
        map.insert(
            dep.clone(),
            Slot {
                state: state.clone(),
                used: AtomicU64::new(now),
            },
        );
        state
    }

    /// Removes the least recently used entry that may go from the first shard, starting at
    /// `dep`'s, that has one (one shard lock at a time).
    fn evict_one(&self, dep: &Dependency) -> bool {
        let start = (backstop_core::plumbing::prehash(dep) >> 32) as usize % SHARDS;
        for i in 0..SHARDS {
            let mut map = write(&self.shards[(start + i) % SHARDS]);
            let victim = map
                .iter()
                .filter(|(_, s)| Arc::strong_count(&s.state) == 1 && (self.evictable)(&s.state))
                .min_by_key(|(_, s)| s.used.load(Ordering::Relaxed))
                .map(|(k, _)| k.clone());
            if let Some(k) = victim {
                map.remove(&k);
                self.len.fetch_sub(1, Ordering::AcqRel);
                return true;
            }
        }
        false
    }

    /// The state of `dep` if it is tracked.
    pub fn tracked(&self, dep: &Dependency) -> Option<Arc<T>> {
        read(self.shard(dep)).get(dep).map(|s| s.state.clone())
    }

    /// Whether `dep` is not tracked and the bound is reached (its next lookup must make room
    /// or go untracked).
    pub fn is_overflowing(&self, dep: &Dependency) -> bool {
        self.tracked(dep).is_none() && self.len() >= self.max
    }

    /// How many dependencies are tracked.
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
                f(k, &v.state);
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
        let mut entries = 0;
        r.for_each(|_, v| {
            entries += 1;
            assert_eq!(v.load(Ordering::Relaxed), 1, "no entry is shared");
        });
        assert_eq!(entries, 1_000);
    }

    #[test]
    fn past_the_bound_no_two_dependencies_share_state() {
        let r =
            Registry::new(32, |_| AtomicU64::new(0)).evict_when(|v| v.load(Ordering::Relaxed) == 0);
        // 32 entries that may not go (a non-zero count stands for an open circuit), held by
        // nobody.
        for i in 0..32 {
            r.get(&Dependency::new(format!("busy-{i}")))
                .store(1, Ordering::Relaxed);
        }
        let a = r.get(&Dependency::new("fresh-a"));
        let b = r.get(&Dependency::new("fresh-b"));
        assert!(!Arc::ptr_eq(&a, &b), "two new names never share state");
        a.store(7, Ordering::Relaxed);
        assert_eq!(b.load(Ordering::Relaxed), 0);
        assert_eq!(r.len(), 32);
        // An entry held elsewhere (a bound breaker, a call in flight) stays too.
        let r = Registry::new(1, |_| AtomicU64::new(0));
        let held = r.get(&Dependency::new("held"));
        let other = r.get(&Dependency::new("other"));
        assert!(!Arc::ptr_eq(&held, &other));
        assert!(r.tracked(&Dependency::new("held")).is_some());
        drop(held);
        // Idle now: the least recently used entry makes room.
        let _ = r.get(&Dependency::new("third"));
        assert!(r.tracked(&Dependency::new("held")).is_none());
        assert!(r.tracked(&Dependency::new("third")).is_some());
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
