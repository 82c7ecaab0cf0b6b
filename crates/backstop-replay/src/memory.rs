use crate::store::{Claim, Fingerprint, ReplayStore, StoreError, StoreFuture, StoredResponse};
use std::{
    collections::{HashMap, VecDeque},
    fmt,
    sync::{
        Mutex,
        atomic::{AtomicU64, Ordering},
    },
    time::Duration,
};
use tokio::time::Instant;

enum Slot {
    InFlight {
        token: u64,
        lease_until: Instant,
    },
    Done {
        response: StoredResponse,
        expires: Instant,
    },
}

struct Entry {
    fingerprint: Fingerprint,
    slot: Slot,
}

impl Entry {
    fn live(&self, now: Instant) -> bool {
        match self.slot {
            Slot::InFlight { lease_until, .. } => lease_until > now,
            Slot::Done { expires, .. } => expires > now,
        }
    }
}

#[derive(Default)]
struct State {
    map: HashMap<String, Entry>,
    /// Keys in the order they were claimed, for eviction; may hold keys no longer in `map`.
    order: VecDeque<String>,
}

/// An in-memory store, for one server process: bounded, with TTL eviction.
///
/// At most `max_entries` keys are kept. When a new key arrives at the bound, expired entries and
/// then the oldest *completed* entries are evicted (a repeat of an evicted key runs again);
/// in-flight claims are never evicted, and if every entry is in flight the claim fails, so the
/// layer answers 503 rather than run a request it could not protect.
pub struct MemoryStore {
    state: Mutex<State>,
    max_entries: usize,
    tokens: AtomicU64,
}

impl fmt::Debug for MemoryStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MemoryStore")
            .field("entries", &self.len())
            .field("max_entries", &self.max_entries)
            .finish()
    }
}

impl Default for MemoryStore {
    /// 100,000 entries.
    fn default() -> Self {
        MemoryStore::new(100_000)
    }
}

impl MemoryStore {
    /// A store of at most `max_entries` keys (at least 1).
    pub fn new(max_entries: usize) -> Self {
        MemoryStore {
            state: Mutex::default(),
            max_entries: max_entries.max(1),
            tokens: AtomicU64::new(1),
        }
    }

    /// How many keys are held (in flight or completed, expired ones not yet swept included).
    pub fn len(&self) -> usize {
        self.lock().map.len()
    }

    /// Whether no key is held.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        // Every critical section leaves the maps consistent, so a poisoned lock is usable.
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn claim_now(
        &self,
        key: &str,
        fingerprint: Fingerprint,
        lease: Duration,
    ) -> Result<Claim, StoreError> {
        let now = Instant::now();
        let mut st = self.lock();
        if let Some(e) = st.map.get(key) {
            if e.live(now) {
                return Ok(match &e.slot {
                    Slot::InFlight { .. } => Claim::InFlight {
                        fingerprint: e.fingerprint,
                    },
                    Slot::Done { response, .. } => Claim::Done {
                        fingerprint: e.fingerprint,
                        response: response.clone(),
                    },
                });
            }
            st.map.remove(key);
        }
        if st.map.len() >= self.max_entries {
            evict(&mut st, now, self.max_entries);
            if st.map.len() >= self.max_entries {
                return Err(StoreError::new(format!(
                    "the in-memory idempotency store is full: {} requests are in flight",
                    st.map.len()
                )));
            }
        }
        let token = self.tokens.fetch_add(1, Ordering::Relaxed);
        st.map.insert(
            key.to_owned(),
            Entry {
                fingerprint,
                slot: Slot::InFlight {
                    token,
                    lease_until: now + lease,
                },
            },
        );
        st.order.push_back(key.to_owned());
        if st.order.len() > 2 * self.max_entries + 16 {
            compact(&mut st);
        }
        Ok(Claim::Claimed { token })
    }

    fn with_claim<T>(&self, key: &str, token: u64, f: impl FnOnce(&mut State) -> T) -> Option<T> {
        let mut st = self.lock();
        let held = matches!(
            st.map.get(key),
            Some(Entry { slot: Slot::InFlight { token: t, .. }, .. }) if *t == token
        );
        held.then(|| f(&mut st))
    }
}

/// Frees room, oldest claim first: a completed or expired entry is evicted, a live in-flight
/// claim is kept (moved to the back). Amortised O(1) per claim.
fn evict(st: &mut State, now: Instant, max: usize) {
    let mut budget = st.order.len();
    while st.map.len() >= max && budget > 0 {
        budget -= 1;
        let Some(key) = st.order.pop_front() else {
            break;
        };
        match st.map.get(&key) {
            Some(e) if matches!(e.slot, Slot::InFlight { .. }) && e.live(now) => {
                st.order.push_back(key);
            }
            Some(_) => {
                st.map.remove(&key);
            }
            None => {}
        }
    }
}

/// Drops queue entries for keys no longer held, and duplicates.
fn compact(st: &mut State) {
    let mut seen = std::collections::HashSet::new();
    let map = &st.map;
    st.order
        .retain(|k| map.contains_key(k) && seen.insert(k.clone()));
}

impl ReplayStore for MemoryStore {
    fn claim<'a>(
        &'a self,
        key: &'a str,
        fingerprint: Fingerprint,
        lease: Duration,
    ) -> StoreFuture<'a, Claim> {
        let r = self.claim_now(key, fingerprint, lease);
        Box::pin(async move { r })
    }

    fn renew<'a>(&'a self, key: &'a str, token: u64, lease: Duration) -> StoreFuture<'a, bool> {
        let r = self
            .with_claim(key, token, |st| {
                if let Some(Entry {
                    slot: Slot::InFlight { lease_until, .. },
                    ..
                }) = st.map.get_mut(key)
                {
                    *lease_until = Instant::now() + lease;
                }
            })
            .is_some();
        Box::pin(async move { Ok(r) })
    }

    fn complete<'a>(
        &'a self,
        key: &'a str,
        token: u64,
        response: &'a StoredResponse,
        ttl: Duration,
    ) -> StoreFuture<'a, bool> {
        let r = self
            .with_claim(key, token, |st| {
                if let Some(e) = st.map.get_mut(key) {
                    e.slot = Slot::Done {
                        response: response.clone(),
                        expires: Instant::now() + ttl,
                    };
                }
            })
            .is_some();
        Box::pin(async move { Ok(r) })
    }

    fn release<'a>(&'a self, key: &'a str, token: u64) -> StoreFuture<'a, bool> {
        let r = self
            .with_claim(key, token, |st| {
                st.map.remove(key);
            })
            .is_some();
        Box::pin(async move { Ok(r) })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use bytes::Bytes;

    fn response(body: &'static str) -> StoredResponse {
        StoredResponse {
            status: 200,
            headers: vec![],
            body: Bytes::from_static(body.as_bytes()),
            body_omitted: None,
        }
    }

    const LEASE: Duration = Duration::from_secs(30);
    const TTL: Duration = Duration::from_secs(3600);

    #[tokio::test(start_paused = true)]
    async fn claim_complete_replay_expire() {
        let s = MemoryStore::new(10);
        let Claim::Claimed { token } = s.claim("k", [1; 32], LEASE).await.unwrap() else {
            panic!()
        };
        assert_eq!(
            s.claim("k", [1; 32], LEASE).await.unwrap(),
            Claim::InFlight {
                fingerprint: [1; 32]
            }
        );
        assert!(s.complete("k", token, &response("R1"), TTL).await.unwrap());
        assert_eq!(
            s.claim("k", [2; 32], LEASE).await.unwrap(),
            Claim::Done {
                fingerprint: [1; 32],
                response: response("R1")
            }
        );
        tokio::time::advance(TTL).await;
        assert!(matches!(
            s.claim("k", [2; 32], LEASE).await.unwrap(),
            Claim::Claimed { .. }
        ));
    }

    #[tokio::test(start_paused = true)]
    async fn a_stale_owner_is_fenced_out() {
        let s = MemoryStore::new(10);
        let Claim::Claimed { token: old } = s.claim("k", [1; 32], LEASE).await.unwrap() else {
            panic!()
        };
        tokio::time::advance(LEASE).await;
        // The lease expired: a newer request takes the key.
        let Claim::Claimed { token: new } = s.claim("k", [1; 32], LEASE).await.unwrap() else {
            panic!()
        };
        assert_ne!(old, new);
        assert!(!s.complete("k", old, &response("stale"), TTL).await.unwrap());
        assert!(!s.release("k", old).await.unwrap());
        assert!(!s.renew("k", old, LEASE).await.unwrap());
        assert!(s.complete("k", new, &response("fresh"), TTL).await.unwrap());
        assert_eq!(
            s.claim("k", [1; 32], LEASE).await.unwrap(),
            Claim::Done {
                fingerprint: [1; 32],
                response: response("fresh")
            }
        );
    }

    #[tokio::test(start_paused = true)]
    async fn renewing_keeps_a_long_request_in_flight() {
        let s = MemoryStore::new(10);
        let Claim::Claimed { token } = s.claim("k", [1; 32], LEASE).await.unwrap() else {
            panic!()
        };
        for _ in 0..5 {
            tokio::time::advance(LEASE / 2).await;
            assert!(s.renew("k", token, LEASE).await.unwrap());
        }
        assert!(matches!(
            s.claim("k", [1; 32], LEASE).await.unwrap(),
            Claim::InFlight { .. }
        ));
    }

    #[tokio::test(start_paused = true)]
    async fn a_million_keys_stay_within_the_bound() {
        let s = MemoryStore::new(100);
        let done = response("ok");
        for i in 0..1_000_000u32 {
            let key = format!("key-{i}");
            if let Claim::Claimed { token } = s.claim_now(&key, [0; 32], LEASE).unwrap() {
                let stored = s.with_claim(&key, token, |st| {
                    st.map.get_mut(key.as_str()).unwrap().slot = Slot::Done {
                        response: done.clone(),
                        expires: Instant::now() + TTL,
                    };
                });
                assert!(stored.is_some());
            }
            if i % 1000 == 0 {
                assert!(s.len() <= 100);
            }
        }
        assert!(s.len() <= 100);
        assert!(s.lock().order.len() <= 2 * 100 + 16);
    }

    #[tokio::test(start_paused = true)]
    async fn full_of_in_flight_claims_it_refuses() {
        let s = MemoryStore::new(2);
        s.claim("a", [0; 32], LEASE).await.unwrap();
        s.claim("b", [0; 32], LEASE).await.unwrap();
        let e = s.claim("c", [0; 32], LEASE).await.unwrap_err();
        assert!(e.to_string().contains("full"), "{e}");
        // Once a lease expires, its room is reused.
        tokio::time::advance(LEASE).await;
        assert!(matches!(
            s.claim("c", [0; 32], LEASE).await.unwrap(),
            Claim::Claimed { .. }
        ));
    }
}
