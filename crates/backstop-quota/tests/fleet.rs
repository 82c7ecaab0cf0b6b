//! Quotas shared through a real Redis: two `Quotas`, each with its own link and connection as
//! two processes have, pacing against one account; the account's rules for a window that
//! resets, a late reply and an attempt that never left; and a Redis that hangs or was never
//! there, which leaves each process pacing alone, never waiting on it.
#![cfg(feature = "fleet")]

use backstop_core::{BoxError, DeadlineExceeded, Dependency, Outcome, OverQuota};
use backstop_quota::{Advertised, Cost, Fleet, FleetConfig, QuotaLayer, Quotas, Unit};
use backstop_testkit::RedisServer;
use std::{
    future::Future,
    sync::{
        Arc,
        atomic::{AtomicU64, Ordering},
    },
    time::Duration,
};
use tokio::time::Instant;
use tower::{Layer, Service, ServiceExt, service_fn};

const DEP: &str = "llm-api";
const PREFIX: &str = "test:quota";

/// A process: its quotas and its link to the fleet, once the link has reached Redis.
async fn process(redis: &str, ask_timeout: Duration) -> (Quotas, Fleet) {
    let quotas = Quotas::seeded(Duration::from_millis(50), 7);
    let fleet = quotas
        .join_fleet(
            redis,
            FleetConfig::default()
                .prefix(PREFIX)
                .ask_timeout(ask_timeout),
        )
        .unwrap();
    until("the link reaches Redis", || async {
        fleet.stats().connected
    })
    .await;
    (quotas, fleet)
}

/// A Redis, a process in its fleet, and the account holding 3,000 of 10,000 tokens for a
/// minute.
async fn a_fleet(ask_timeout: Duration) -> (RedisServer, Quotas, Fleet) {
    let redis = RedisServer::start().await;
    let (a, fa) = process(&redis.url(), ask_timeout).await;
    learn(
        &redis.url(),
        &a,
        tokens(10_000, 3_000, Duration::from_secs(60)),
        3_000,
    )
    .await;
    (redis, a, fa)
}

/// Waits (real time, 20 s at most) for `check` to hold.
async fn until<F: Future<Output = bool>>(what: &str, mut check: impl FnMut() -> F) {
    let began = Instant::now();
    while !check().await {
        assert!(
            began.elapsed() < Duration::from_secs(20),
            "{what}: not within 20 s"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// What the fleet's account holds for `field` (`tokens:r`, what is left of the tokens).
async fn account(redis: &str, field: &str) -> Option<u64> {
    let mut conn = redis::Client::open(redis)
        .unwrap()
        .get_multiplexed_async_connection()
        .await
        .unwrap();
    redis::cmd("HGET")
        .arg(format!("{PREFIX}:{DEP}"))
        .arg(field)
        .query_async::<Option<u64>>(&mut conn)
        .await
        .unwrap()
}

fn tokens(limit: u64, remaining: u64, reset: Duration) -> Advertised {
    Advertised {
        unit: Unit::Tokens,
        limit: Some(limit),
        remaining: Some(remaining),
        reset: Some(reset),
    }
}

/// `quotas.learn`, and wait until the fleet's account holds what is left.
async fn learn(redis: &str, quotas: &Quotas, advertised: Advertised, left: u64) {
    quotas.learn(&Dependency::new(DEP), &[advertised]);
    until("the account learns it", || async {
        account(redis, "tokens:r").await == Some(left)
    })
    .await;
}

/// Waits until the fleet's account has what `quotas` said before: a report of requests (a
/// unit the test does not otherwise read), `left` of them, written after the rest.
async fn written(redis: &str, quotas: &Quotas, left: u64) {
    quotas.learn(
        &Dependency::new(DEP),
        &[Advertised {
            unit: Unit::Requests,
            limit: Some(1_000),
            remaining: Some(left),
            reset: Some(Duration::from_secs(600)),
        }],
    );
    until("the account has what was said", || async {
        account(redis, "requests:r").await == Some(left)
    })
    .await;
}

/// A stack of one process over a dependency that counts the calls it is sent.
fn stack(
    quotas: &Quotas,
    sent: Arc<AtomicU64>,
) -> impl Service<http::Request<()>, Response = http::Response<()>, Error = BoxError, Future: Send> + Clone
{
    QuotaLayer::new(quotas.clone())
        .dependency(DEP)
        .layer(service_fn(move |_req: http::Request<()>| {
            sent.fetch_add(1, Ordering::Relaxed);
            async { Ok::<_, BoxError>(http::Response::new(())) }
        }))
}

fn prompt(tokens: u64, deadline: Duration) -> http::Request<()> {
    let mut req = http::Request::new(());
    req.extensions_mut().insert(Cost::tokens(tokens));
    backstop_core::Deadline::after(deadline).tighten(&mut req);
    req
}

/// What one process learned, the other paces by: B, which never called, takes 2,000 of the
/// 3,000 left, and A's own 2,000 no longer fit; its deadline is before the reset, so it ends at
/// once, not sent, where alone it would have gone over the quota.
#[tokio::test]
async fn two_processes_pace_against_one_account() {
    let (redis, a, _fa) = a_fleet(Duration::from_secs(2)).await;
    let (b, fb) = process(&redis.url(), Duration::from_secs(2)).await;
    let sent = Arc::new(AtomicU64::new(0));
    stack(&b, sent.clone())
        .oneshot(prompt(2_000, Duration::from_secs(5)))
        .await
        .unwrap();
    assert_eq!(account(&redis.url(), "tokens:r").await, Some(1_000));
    // A's own figure still says 3,000 left; the fleet's says 1,000.
    assert_eq!(
        a.remaining(&Dependency::new(DEP), Unit::Tokens),
        Some(3_000)
    );
    let err = stack(&a, sent.clone())
        .oneshot(prompt(2_000, Duration::from_secs(5)))
        .await
        .unwrap_err();
    let over = err.downcast_ref::<OverQuota>().expect("over the quota");
    let back = over.retry_in().expect("when the quota comes back");
    assert!(
        back > Duration::from_secs(50) && back <= Duration::from_secs(60),
        "{back:?}"
    );
    assert!(err.to_string().contains("needs 2000 tokens"), "{err}");
    assert_eq!(sent.load(Ordering::Relaxed), 1, "A's call was not sent");
    assert!(fb.stats().asked >= 1, "{:?}", fb.stats());
}

/// Within a window, what is left only falls: a reply the server made before the fleet's last
/// take (its figure higher) does not give the take back.
#[tokio::test]
async fn a_higher_figure_within_the_window_does_not_give_back_what_the_fleet_took() {
    let (redis, a, _fa) = a_fleet(Duration::from_secs(2)).await;
    let sent = Arc::new(AtomicU64::new(0));
    stack(&a, sent.clone())
        .oneshot(prompt(2_000, Duration::from_secs(5)))
        .await
        .unwrap();
    assert_eq!(account(&redis.url(), "tokens:r").await, Some(1_000));
    // A reply that left the server before the 2,000 were counted.
    a.learn(
        &Dependency::new(DEP),
        &[tokens(10_000, 2_500, Duration::from_secs(59))],
    );
    written(&redis.url(), &a, 900).await;
    assert_eq!(account(&redis.url(), "tokens:r").await, Some(1_000));
    // One the server made after, and after a call from outside the fleet: it falls.
    learn(
        &redis.url(),
        &a,
        tokens(10_000, 800, Duration::from_secs(59)),
        800,
    )
    .await;
}

/// A window past its reset is full again, the waiter woken by it goes, and a reply the server
/// made before the reset, arriving after it, neither closes the new window nor resets it again.
#[tokio::test]
async fn a_reset_fills_the_window_and_a_late_reply_from_the_old_one_is_ignored() {
    let redis = RedisServer::start().await;
    let (a, _fa) = process(&redis.url(), Duration::from_secs(2)).await;
    let (b, _fb) = process(&redis.url(), Duration::from_secs(2)).await;
    learn(
        &redis.url(),
        &a,
        tokens(5_000, 0, Duration::from_secs(3)),
        0,
    )
    .await;
    let sent = Arc::new(AtomicU64::new(0));
    let began = Instant::now();
    stack(&b, sent.clone())
        .oneshot(prompt(1_000, Duration::from_secs(30)))
        .await
        .unwrap();
    assert!(
        began.elapsed() >= Duration::from_millis(2_900),
        "it waited for the reset: {:?}",
        began.elapsed()
    );
    assert_eq!(account(&redis.url(), "tokens:r").await, Some(4_000));
    // The old window's last reply: nothing left, resetting in 5 ms.
    a.learn(
        &Dependency::new(DEP),
        &[tokens(5_000, 0, Duration::from_millis(5))],
    );
    written(&redis.url(), &a, 900).await;
    assert_eq!(account(&redis.url(), "tokens:r").await, Some(4_000));
    stack(&b, sent)
        .oneshot(prompt(1_000, Duration::from_secs(30)))
        .await
        .unwrap();
    assert_eq!(account(&redis.url(), "tokens:r").await, Some(3_000));
}

/// An attempt the fleet let go that a layer further in refused before it left gives its cost
/// back to the fleet's account; one that may have reached the server keeps it spent.
#[tokio::test]
async fn an_attempt_that_never_left_gives_its_cost_back_to_the_fleet() {
    let (redis, a, _fa) = a_fleet(Duration::from_secs(2)).await;
    let failing = |outcome: Outcome| {
        QuotaLayer::new(a.clone()).dependency(DEP).layer(service_fn(
            move |_req: http::Request<()>| async move {
                Err::<http::Response<()>, BoxError>(DeadlineExceeded::new(None, outcome).into())
            },
        ))
    };
    let _ = failing(Outcome::NotSent)
        .oneshot(prompt(1_000, Duration::from_secs(5)))
        .await
        .unwrap_err();
    until("the cost comes back", || async {
        account(&redis.url(), "tokens:r").await == Some(3_000)
    })
    .await;
    let _ = failing(Outcome::Unknown)
        .oneshot(prompt(1_000, Duration::from_secs(5)))
        .await
        .unwrap_err();
    written(&redis.url(), &a, 900).await;
    assert_eq!(account(&redis.url(), "tokens:r").await, Some(2_000));
}

/// Redis hangs (SIGSTOP) while a process is linked: the first attempt waits for the ask timeout
/// and is paced alone, and so are the next, without asking, by what the process itself learned;
/// when Redis is back, the process asks the fleet again.
#[tokio::test]
async fn a_redis_that_hangs_leaves_each_process_pacing_alone() {
    let (redis, a, fa) = a_fleet(Duration::from_millis(200)).await;
    redis.freeze();
    let sent = Arc::new(AtomicU64::new(0));
    let calls = async {
        for _ in 0..5 {
            stack(&a, sent.clone())
                .oneshot(prompt(500, Duration::from_secs(30)))
                .await
                .unwrap();
        }
        // Alone, the process still paces: 500 left by its own figures, 2,000 do not fit
        // before this deadline.
        let err = stack(&a, sent.clone())
            .oneshot(prompt(2_000, Duration::from_secs(5)))
            .await
            .unwrap_err();
        assert!(err.is::<OverQuota>(), "{err}");
    };
    tokio::time::timeout(Duration::from_secs(20), calls)
        .await
        .expect("never blocked by a Redis that hangs");
    assert_eq!(sent.load(Ordering::Relaxed), 5);
    let stats = fa.stats();
    assert!(stats.alone >= 6, "{stats:?}");
    // The first ask waited for the timeout; the next calls did not ask (each would have waited
    // 200 ms for nothing): only a stall of over a second between every two calls could make
    // them all ask.
    assert!(stats.unanswered < 6, "{stats:?}");
    redis.thaw();
    let asked = fa.stats().asked;
    until("the process asks the fleet again", || async {
        let _ = stack(&a, sent.clone())
            .oneshot(prompt(1, Duration::from_secs(5)))
            .await;
        fa.stats().asked > asked
    })
    .await;
}

/// A fleet whose Redis is not there at all: every attempt is paced alone at once.
#[tokio::test]
async fn a_fleet_without_redis_paces_alone() {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let quotas = Quotas::seeded(Duration::ZERO, 1);
    let fleet = quotas
        .join_fleet(
            &format!("redis://127.0.0.1:{port}/"),
            FleetConfig::default(),
        )
        .unwrap();
    let sent = Arc::new(AtomicU64::new(0));
    let calls = async {
        for _ in 0..5 {
            stack(&quotas, sent.clone())
                .oneshot(prompt(100, Duration::from_secs(5)))
                .await
                .unwrap();
        }
    };
    tokio::time::timeout(Duration::from_secs(20), calls)
        .await
        .expect("never blocked");
    let stats = fleet.stats();
    assert!(!stats.connected && stats.alone == 5, "{stats:?}");
    // A second fleet for the same quotas is refused while the first lives; once it is
    // dropped, they may join again.
    assert!(
        quotas
            .join_fleet("redis://127.0.0.1:1/", FleetConfig::default())
            .is_err()
    );
    drop(fleet);
    assert!(
        quotas
            .join_fleet("redis://127.0.0.1:1/", FleetConfig::default())
            .is_ok()
    );
    assert!(
        quotas
            .join_fleet(
                "redis://127.0.0.1:1/",
                FleetConfig::default().ask_timeout(Duration::ZERO)
            )
            .is_err()
    );
}

/// Outside a tokio runtime there is nothing to run the link on: refused, with words.
#[test]
fn joining_outside_a_runtime_is_refused() {
    let err = Quotas::default()
        .join_fleet("redis://127.0.0.1:1/", FleetConfig::default())
        .unwrap_err();
    assert!(err.to_string().contains("tokio runtime"), "{err}");
}

/// An attempt the fleet let go that never left gives its cost back only to the window it was
/// taken from: once another process's attempt has rolled the account to the next window, the
/// give-back would grant the new window more than the server allows, and is dropped.
#[tokio::test]
async fn a_cost_is_given_back_only_to_the_window_it_was_taken_from() {
    let redis = RedisServer::start().await;
    let (a, _fa) = process(&redis.url(), Duration::from_secs(2)).await;
    let (b, _fb) = process(&redis.url(), Duration::from_secs(2)).await;
    learn(
        &redis.url(),
        &a,
        tokens(10_000, 3_000, Duration::from_secs(1)),
        3_000,
    )
    .await;
    // A's attempt is let go (2,000 taken), and is refused further in, not sent, 3 s later.
    let refused_late = QuotaLayer::new(a.clone()).dependency(DEP).layer(service_fn(
        |_req: http::Request<()>| async {
            tokio::time::sleep(Duration::from_secs(3)).await;
            Err::<http::Response<()>, BoxError>(
                DeadlineExceeded::new(None, Outcome::NotSent).into(),
            )
        },
    ));
    let a_call = tokio::spawn(refused_late.oneshot(prompt(2_000, Duration::from_secs(30))));
    until("A's cost is taken", || async {
        account(&redis.url(), "tokens:r").await == Some(1_000)
    })
    .await;
    // Past the reset, B's attempt rolls the account to a full window and takes 1,000 of it.
    tokio::time::sleep(Duration::from_millis(1_200)).await;
    let sent = Arc::new(AtomicU64::new(0));
    stack(&b, sent)
        .oneshot(prompt(1_000, Duration::from_secs(5)))
        .await
        .unwrap();
    assert_eq!(account(&redis.url(), "tokens:r").await, Some(9_000));
    let _ = a_call.await.unwrap().unwrap_err();
    written(&redis.url(), &a, 900).await;
    assert_eq!(
        account(&redis.url(), "tokens:r").await,
        Some(9_000),
        "A's 2,000 were taken in the ended window"
    );
}
