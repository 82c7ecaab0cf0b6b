//! One contract every replay store keeps, run against each store Backstop ships: the memory
//! store (on tokio's paused clock), Redis, a Redis Cluster and PostgreSQL (each a server of the
//! test's own, on real time). A store of one's own can be held to it the same way.
//!
//! Time only ever runs past a lease or a TTL here (a check made *within* a lease uses a lease
//! of 30 s, a renewal made right after its claim a first lease of 1 s), so a slow machine cannot
//! turn a pass into a failure.

use backstop_replay::{Claim, ReplayStore, StoredResponse};
use bytes::Bytes;
use std::{future::Future, pin::Pin, sync::Arc, time::Duration};

const LONG: Duration = Duration::from_secs(30);
const SHORT: Duration = Duration::from_millis(200);
/// The lease a claim is made with before it is renewed.
const FIRST: Duration = Duration::from_secs(1);

fn response(body: &'static str) -> StoredResponse {
    StoredResponse {
        status: 201,
        headers: vec![],
        body: Bytes::from_static(body.as_bytes()),
        body_omitted: None,
    }
}

/// How a test lets time pass: the paused clock's `advance`, or a real sleep.
type Pass = fn(Duration) -> Pin<Box<dyn Future<Output = ()> + Send>>;

fn advance(by: Duration) -> Pin<Box<dyn Future<Output = ()> + Send>> {
    Box::pin(tokio::time::advance(by))
}

#[cfg(any(feature = "redis", feature = "postgres"))]
fn sleep(by: Duration) -> Pin<Box<dyn Future<Output = ()> + Send>> {
    Box::pin(tokio::time::sleep(by))
}

async fn claimed<S: ReplayStore>(s: &S, key: &str, fingerprint: u8, lease: Duration) -> u64 {
    match s.claim(key, [fingerprint; 32], lease).await.unwrap() {
        Claim::Claimed { token } => token,
        other => panic!("{key} is free, yet: {other:?}"),
    }
}

/// The contract, on `s`. `pass` lets time run past a lease.
async fn contract<S: ReplayStore + Send + Sync + 'static>(s: S, pass: Pass) {
    let s = Arc::new(s);
    // A free key is claimed; while the claim holds, the key is in flight, with the first
    // request's fingerprint.
    let token = claimed(&*s, "c:k", 1, LONG).await;
    assert_eq!(
        s.claim("c:k", [2; 32], LONG).await.unwrap(),
        Claim::InFlight {
            fingerprint: [1; 32]
        }
    );
    // Keys are separate.
    claimed(&*s, "c:other", 1, LONG).await;
    // Only the owner's token renews, completes or releases.
    assert!(s.renew("c:k", token, LONG).await.unwrap());
    let wrong = token.wrapping_add(1000);
    assert!(!s.renew("c:k", wrong, LONG).await.unwrap());
    assert!(
        !s.complete("c:k", wrong, &response("stale"), LONG)
            .await
            .unwrap()
    );
    assert!(!s.release("c:k", wrong).await.unwrap());
    // Completed: every later claim gets the stored response and the first fingerprint.
    assert!(
        s.complete("c:k", token, &response("R1"), LONG)
            .await
            .unwrap()
    );
    assert_eq!(
        s.claim("c:k", [2; 32], LONG).await.unwrap(),
        Claim::Done {
            fingerprint: [1; 32],
            response: response("R1")
        }
    );
    // A completed key is not claimed, released or completed again.
    assert!(!s.release("c:k", token).await.unwrap());
    assert!(
        !s.complete("c:k", token, &response("again"), LONG)
            .await
            .unwrap()
    );

    // Renewed, a claim outlives the lease it was made with. That first lease is a second long,
    // so the renewal right after the claim cannot miss it on a stalled machine.
    let token = claimed(&*s, "c:renewed", 6, FIRST).await;
    assert!(s.renew("c:renewed", token, LONG).await.unwrap());
    pass(FIRST * 2).await;
    assert_eq!(
        s.claim("c:renewed", [6; 32], LONG).await.unwrap(),
        Claim::InFlight {
            fingerprint: [6; 32]
        }
    );

    // Released by its owner, a key is free again.
    let token = claimed(&*s, "c:released", 1, LONG).await;
    assert!(s.release("c:released", token).await.unwrap());
    claimed(&*s, "c:released", 1, LONG).await;

    // A lease that runs out lets a newer claim in, with a larger token; the old owner is
    // fenced out of renewing, completing and releasing.
    let old = claimed(&*s, "c:lapsed", 3, SHORT).await;
    pass(SHORT * 2).await;
    let new = claimed(&*s, "c:lapsed", 3, LONG).await;
    assert!(new > old, "fencing tokens grow: {old} then {new}");
    assert!(!s.renew("c:lapsed", old, LONG).await.unwrap());
    assert!(
        !s.complete("c:lapsed", old, &response("stale"), LONG)
            .await
            .unwrap()
    );
    assert!(!s.release("c:lapsed", old).await.unwrap());
    assert!(
        s.complete("c:lapsed", new, &response("fresh"), LONG)
            .await
            .unwrap()
    );
    assert_eq!(
        s.claim("c:lapsed", [3; 32], LONG).await.unwrap(),
        Claim::Done {
            fingerprint: [3; 32],
            response: response("fresh")
        }
    );

    // A stored response lives for its TTL, then the key is free.
    let token = claimed(&*s, "c:ttl", 4, LONG).await;
    assert!(
        s.complete("c:ttl", token, &response("R"), SHORT)
            .await
            .unwrap()
    );
    pass(SHORT * 2).await;
    claimed(&*s, "c:ttl", 4, LONG).await;

    // Twenty claims of one free key at once: one owner.
    let mut racing = tokio::task::JoinSet::new();
    for _ in 0..20 {
        let s = s.clone();
        racing.spawn(async move { s.claim("c:race", [5; 32], LONG).await.unwrap() });
    }
    let mut owners = 0;
    while let Some(claim) = racing.join_next().await {
        match claim.unwrap() {
            Claim::Claimed { .. } => owners += 1,
            Claim::InFlight { fingerprint } => assert_eq!(fingerprint, [5; 32]),
            other => panic!("{other:?}"),
        }
    }
    assert_eq!(owners, 1);
}

#[tokio::test(start_paused = true)]
async fn the_memory_store_keeps_the_contract() {
    contract(backstop_replay::MemoryStore::new(1000), advance).await;
}

#[cfg(feature = "redis")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_redis_store_keeps_the_contract() {
    let redis = backstop_testkit::RedisServer::start().await;
    let store = backstop_replay::RedisStore::open(&redis.url()).unwrap();
    contract(store.prefix("contract:"), sleep).await;
}

#[cfg(feature = "redis")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_redis_cluster_store_keeps_the_contract() {
    let cluster = backstop_testkit::RedisCluster::start(3).await;
    let store = backstop_replay::RedisStore::cluster(&cluster.urls()).unwrap();
    contract(store, sleep).await;
}

#[cfg(feature = "postgres")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_postgres_store_keeps_the_contract() {
    let pg = backstop_testkit::PostgresServer::start().await;
    let store = backstop_replay::PgStore::connect(&pg.url()).await.unwrap();
    contract(store, sleep).await;
}
