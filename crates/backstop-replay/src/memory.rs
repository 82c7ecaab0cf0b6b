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
    scope: Box<str>,
}

impl Entry {
    fn live(&self, now: Instant) -> bool {
        match self.slot {
            Slot::InFlight { lease_until, .. } => lease_until > now,
            Slot::Done { expires, .. } => expires > now,
        }
    }

    fn in_flight(&self, now: Instant) -> bool {
        matches!(self.slot, Slot::InFlight { .. }) && self.live(now)
    }
}

/// One principal's entries: how many, and their keys in claim order (may hold keys no longer
/// there).
#[derive(Default)]
struct Scope {
    len: usize,
    order: VecDeque<String>,
}

#[derive(Default)]
struct State {
    map: HashMap<String, Entry>,
    /// Every key in claim order, for sweeping expired entries; may hold keys no longer there.
    order: VecDeque<String>,
    scopes: HashMap<Box<str>, Scope>,
}

impl State {
    fn remove(&mut self, key: &str) {
        if let Some(e) = self.map.remove(key)
            && let Some(scope) = self.scopes.get_mut(&e.scope)
        {
            scope.len -= 1;
            if scope.len == 0 {
                self.scopes.remove(&e.scope);
            }
        }
    }

    /// Removes `scope`'s oldest entries that are not in flight (completed or expired) until it
    /// holds fewer than `keep`, or the whole store fewer than `total`.
    fn evict_own(&mut self, scope: &str, now: Instant, keep: usize, total: usize) {
        let Some(mut budget) = self.scopes.get(scope).map(|s| s.order.len()) else {
            return;
        };
        while budget > 0 {
            let len = self.scopes.get(scope).map_or(0, |s| s.len);
            if len < keep && self.map.len() < total {
                return;
            }
            budget -= 1;
            let Some(key) = self.scopes.get_mut(scope).and_then(|s| s.order.pop_front()) else {
                return;
            };
            match self.map.get(&key) {
                Some(e) if &*e.scope == scope && e.in_flight(now) => {
                    if let Some(s) = self.scopes.get_mut(scope) {
                        s.order.push_back(key);
                    }
                }
                Some(e) if &*e.scope == scope => self.remove(&key),
                _ => {}
            }
        }
    }

    /// Removes expired entries, whoever's they are (an expired result protects nobody), until
    /// the store holds fewer than `total`; at most one pass over the claim order.
    fn sweep_expired(&mut self, now: Instant, total: usize) {
        let mut budget = self.order.len();
        while self.map.len() >= total && budget > 0 {
            budget -= 1;
            let Some(key) = self.order.pop_front() else {
                return;
            };
            match self.map.get(&key) {
                Some(e) if e.live(now) => self.order.push_back(key),
                Some(_) => self.remove(&key),
                None => {}
            }
        }
    }
}

/// An in-memory store, for one server process: bounded in total and per principal, with TTL
/// eviction.
///
/// At most `max_entries` keys are kept in all, and at most `max_per_principal` (a tenth of
/// that by default) for any one principal (the scope of the key, see
/// [`scope_of`](crate::scope_of)). When a principal claims a new key at its share, its own
/// expired and then oldest *completed* entries make room (a repeat of an evicted key runs
/// again); when the whole store is full, expired entries of anyone go first, then the
/// claimer's own completed ones. Another principal's live entries are never evicted, and
/// in-flight claims never are: when no room can be made the claim fails, so the layer answers
/// 503 rather than run a request it could not protect. The total is shared: size it for the
/// principals you serve times their share.
///
/// ```
/// use backstop_replay::MemoryStore;
///
/// // At most 10,000 records in all, and at most 500 of them for any one principal.
/// let store = MemoryStore::new(10_000).max_per_principal(500);
/// assert!(store.is_empty());
/// ```
pub struct MemoryStore {
    state: Mutex<State>,
    max_entries: usize,
    max_per_principal: usize,
    tokens: AtomicU64,
}

impl fmt::Debug for MemoryStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MemoryStore")
            .field("entries", &self.len())
            .field("max_entries", &self.max_entries)
            .field("max_per_principal", &self.max_per_principal)
            .finish()
    }
}

impl Default for MemoryStore {
    /// 100,000 entries, 10,000 per principal.
    fn default() -> Self {
        MemoryStore::new(100_000)
    }
}

impl MemoryStore {
    /// A store of at most `max_entries` keys (at least 1), a tenth of them (at least 1) per
    /// principal.
    pub fn new(max_entries: usize) -> Self {
        let max_entries = max_entries.max(1);
        MemoryStore {
            state: Mutex::default(),
            max_entries,
            max_per_principal: (max_entries / 10).max(1),
            tokens: AtomicU64::new(1),
        }
    }

    /// The most keys one principal may hold (a tenth of the total by default).
    #[must_use]
    pub fn max_per_principal(mut self, n: usize) -> Self {
        self.max_per_principal = n.clamp(1, self.max_entries);
        self
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
            st.remove(key);
        }
        let scope = crate::store::scope_of(key);
        let held = st.scopes.get(scope).map_or(0, |s| s.len);
        if held >= self.max_per_principal {
            st.evict_own(scope, now, self.max_per_principal, usize::MAX);
            let held = st.scopes.get(scope).map_or(0, |s| s.len);
            if held >= self.max_per_principal {
                return Err(StoreError::new(format!(
                    "this principal's share of the in-memory idempotency store is full: {held} of \
                     its requests are in flight"
                )));
            }
        }
        if st.map.len() >= self.max_entries {
            st.sweep_expired(now, self.max_entries);
            st.evict_own(scope, now, usize::MAX, self.max_entries);
            if st.map.len() >= self.max_entries {
                return Err(StoreError::new(format!(
                    "the in-memory idempotency store is full ({} entries) with other requests' \
                     live results and claims",
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
                    lease_until: backstop_core::plumbing::instant_after(now, lease),
                },
                scope: scope.into(),
            },
        );
        let sc = st.scopes.entry(scope.into()).or_default();
        sc.len += 1;
        sc.order.push_back(key.to_owned());
        if sc.order.len() > 2 * sc.len + 16 {
            let State { map, scopes, .. } = &mut *st;
            if let Some(sc) = scopes.get_mut(scope) {
                let mut seen = std::collections::HashSet::new();
                sc.order.retain(|k| {
                    map.get(k).is_some_and(|e| &*e.scope == scope) && seen.insert(k.clone())
                });
            }
        }
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

/// Drops claim-order entries for keys no longer held, and duplicates.
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
                    *lease_until = backstop_core::plumbing::instant_after(Instant::now(), lease);
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
                        expires: backstop_core::plumbing::instant_after(Instant::now(), ttl),
                    };
                }
            })
            .is_some();
        Box::pin(async move { Ok(r) })
    }

    fn release<'a>(&'a self, key: &'a str, token: u64) -> StoreFuture<'a, bool> {
        let r = self.with_claim(key, token, |st| st.remove(key)).is_some();
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
    async fn a_million_keys_stay_within_the_bound() {
        let s = MemoryStore::new(100).max_per_principal(100);
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
        let s = MemoryStore::new(2).max_per_principal(2);
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

#[cfg(test)]
mod principal_tests {
    use super::*;
    use bytes::Bytes;

    const LEASE: Duration = Duration::from_secs(30);
    const TTL: Duration = Duration::from_secs(3600);

    fn done(s: &MemoryStore, key: &str) -> bool {
        let Ok(Claim::Claimed { token }) = s.claim_now(key, [0; 32], LEASE) else {
            return false;
        };
        let r = StoredResponse {
            status: 201,
            headers: vec![],
            body: Bytes::from_static(b"paid"),
            body_omitted: None,
        };
        s.with_claim(key, token, |st| {
            st.map.get_mut(key).unwrap().slot = Slot::Done {
                response: r,
                expires: Instant::now() + TTL,
            };
        })
        .is_some()
    }

    #[tokio::test(start_paused = true)]
    async fn a_flood_from_one_principal_never_evicts_another_principals_results() {
        let s = MemoryStore::new(1_000).max_per_principal(100);
        // The victim's payment, completed.
        assert!(done(&s, "victim:payment-1"));
        // A flood of junk keys from one principal, completed ones and then in-flight ones.
        for i in 0..1_000 {
            assert!(done(&s, &format!("flooder:junk-{i}")));
        }
        assert!(matches!(
            s.claim_now("victim:payment-1", [0; 32], LEASE).unwrap(),
            Claim::Done { .. }
        ));
        let flooder = s.lock().scopes.get("flooder").map_or(0, |sc| sc.len);
        assert_eq!(flooder, 100, "the flooder evicts its own oldest results");
        for i in 0..100 {
            let _ = s.claim_now(&format!("flooder:stuck-{i}"), [0; 32], LEASE);
        }
        let refused = s.claim_now("flooder:one-more", [0; 32], LEASE).unwrap_err();
        assert!(refused.to_string().contains("share"), "{refused}");
        // The victim is untouched and can still claim.
        assert!(matches!(
            s.claim_now("victim:payment-1", [0; 32], LEASE).unwrap(),
            Claim::Done { .. }
        ));
        assert!(done(&s, "victim:payment-2"));
    }

    #[tokio::test(start_paused = true)]
    async fn when_the_whole_store_is_full_a_claimer_evicts_only_its_own() {
        let s = MemoryStore::new(20).max_per_principal(10);
        for p in ["a", "b"] {
            for i in 0..10 {
                assert!(done(&s, &format!("{p}:{i}")));
            }
        }
        // Full: "c" has nothing of its own to evict, so it is refused; "a" evicts its own.
        assert!(s.claim_now("c:0", [0; 32], LEASE).is_err());
        assert!(done(&s, "a:new"));
        assert!(matches!(
            s.claim_now("b:0", [0; 32], LEASE).unwrap(),
            Claim::Done { .. }
        ));
        // Once results expire, anyone may use their room.
        tokio::time::advance(TTL).await;
        assert!(done(&s, "c:0"));
    }
}
