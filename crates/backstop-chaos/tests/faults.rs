//! Each fault in its real form: the service's effect counted, the error the caller sees, the
//! rates over many seeded draws, the same faults for the same seed.

use backstop_chaos::{ChaosError, ChaosLayer, FaultPlan};
use std::{
    convert::Infallible,
    io,
    sync::{
        Arc,
        atomic::{AtomicU32, Ordering},
    },
    time::Duration,
};
use tower::{Layer, Service, ServiceExt, service_fn};

type Effects = Arc<AtomicU32>;

fn handler(
    effects: &Effects,
) -> impl Service<http::Request<()>, Response = http::Response<String>, Error = Infallible, Future: Send>
+ Clone {
    let e = effects.clone();
    service_fn(move |_req: http::Request<()>| {
        e.fetch_add(1, Ordering::SeqCst);
        async { Ok::<_, Infallible>(http::Response::new("refund R1".to_owned())) }
    })
}

fn io_kind(e: &(dyn std::error::Error + 'static)) -> io::ErrorKind {
    let chaos = e.downcast_ref::<ChaosError>().expect("an injected fault");
    std::error::Error::source(chaos)
        .and_then(|s| s.downcast_ref::<io::Error>())
        .expect("an io::Error inside")
        .kind()
}

#[tokio::test]
async fn each_fault_as_the_network_gives_it() {
    let effects = Effects::default();
    // A lost reply: the service acted.
    let lose = ChaosLayer::new(FaultPlan::default().lose_reply(1.0), 1).unwrap();
    let e = lose
        .layer(handler(&effects))
        .oneshot(http::Request::new(()))
        .await
        .unwrap_err();
    assert_eq!(io_kind(&*e), io::ErrorKind::ConnectionReset);
    assert!(e.downcast_ref::<ChaosError>().unwrap().service_acted());
    assert!(
        e.to_string().contains("lost after the service acted"),
        "{e}"
    );
    assert_eq!(effects.load(Ordering::SeqCst), 1);
    // A reset before the service saw it, and a refusal: no effect.
    for (plan, kind) in [
        (
            FaultPlan::default().reset(1.0),
            io::ErrorKind::ConnectionReset,
        ),
        (
            FaultPlan::default().refuse(1.0),
            io::ErrorKind::ConnectionRefused,
        ),
    ] {
        let layer = ChaosLayer::new(plan, 1).unwrap();
        let e = layer
            .layer(handler(&effects))
            .oneshot(http::Request::new(()))
            .await
            .unwrap_err();
        assert_eq!(io_kind(&*e), kind);
        assert!(!e.downcast_ref::<ChaosError>().unwrap().service_acted());
    }
    assert_eq!(
        effects.load(Ordering::SeqCst),
        1,
        "neither reached the service"
    );
    // A status, answered by the layer.
    let busy = ChaosLayer::new(FaultPlan::default().status(1.0, 503), 1).unwrap();
    let res = busy
        .layer(handler(&effects))
        .oneshot(http::Request::new(()))
        .await
        .unwrap();
    assert_eq!(res.status(), 503);
    assert_eq!(res.headers()["retry-after"], "1");
    assert_eq!(effects.load(Ordering::SeqCst), 1);
}

#[tokio::test(start_paused = true)]
async fn a_slow_reply_comes_after_the_service_acted() {
    let effects = Effects::default();
    let slow = ChaosLayer::new(
        FaultPlan::default().delay(1.0, Duration::from_millis(400)),
        1,
    )
    .unwrap();
    let start = tokio::time::Instant::now();
    let mut svc = slow.layer(handler(&effects));
    let fut = svc.ready().await.unwrap().call(http::Request::new(()));
    tokio::pin!(fut);
    // Not before its time, though the service already acted.
    assert!(
        tokio::time::timeout(Duration::from_millis(399), &mut fut)
            .await
            .is_err()
    );
    assert_eq!(effects.load(Ordering::SeqCst), 1);
    let res = fut.await.unwrap();
    assert_eq!(res.body(), "refund R1");
    assert!(start.elapsed() >= Duration::from_millis(400));
    assert_eq!(slow.stats().delays, 1);
}

#[tokio::test]
async fn rates_hold_and_one_seed_gives_one_sequence() {
    let plan = FaultPlan::default()
        .lose_reply(0.2)
        .reset(0.1)
        .status(0.05, 429);
    let run = |seed| {
        let plan = plan.clone();
        async move {
            let layer = ChaosLayer::new(plan, seed).unwrap();
            let effects = Effects::default();
            let mut svc = layer.layer(handler(&effects));
            let mut seen = Vec::new();
            for _ in 0..10_000 {
                let r = svc
                    .ready()
                    .await
                    .unwrap()
                    .call(http::Request::new(()))
                    .await;
                seen.push(match r {
                    Ok(res) => res.status().as_u16(),
                    Err(e) if e.downcast_ref::<ChaosError>().unwrap().service_acted() => 1,
                    Err(_) => 0,
                });
            }
            (seen, layer.stats(), effects.load(Ordering::SeqCst))
        }
    };
    let (a, stats, effects) = run(7).await;
    let (b, _, _) = run(7).await;
    let (c, _, _) = run(8).await;
    assert_eq!(a, b, "the same seed, the same faults");
    assert_ne!(a, c);
    let near = |n: u64, rate: f64| (n as f64 / 10_000.0 - rate).abs() < 0.015;
    assert_eq!(stats.requests, 10_000);
    assert!(near(stats.lost_replies, 0.2), "{stats:?}");
    assert!(near(stats.resets, 0.1), "{stats:?}");
    assert!(near(stats.statuses, 0.05), "{stats:?}");
    // The service acted for every request but the resets and the statuses.
    assert_eq!(u64::from(effects), 10_000 - stats.resets - stats.statuses);
}

#[tokio::test]
async fn a_limit_fails_the_first_requests_only() {
    let effects = Effects::default();
    let layer = ChaosLayer::new(FaultPlan::default().refuse(1.0).limit(2), 3).unwrap();
    let svc = layer.layer(handler(&effects));
    let mut failed = 0;
    for _ in 0..5 {
        failed += usize::from(svc.clone().oneshot(http::Request::new(())).await.is_err());
    }
    assert_eq!(failed, 2);
    assert_eq!(effects.load(Ordering::SeqCst), 3);
}

#[test]
fn a_plan_that_cannot_be_is_refused_with_words() {
    for (plan, words) in [
        (FaultPlan::default().lose_reply(1.5), "from 0 to 1"),
        (
            FaultPlan::default().delay(f64::NAN, Duration::ZERO),
            "from 0 to 1",
        ),
        (
            FaultPlan::default().lose_reply(0.6).reset(0.6),
            "add up to at most 1",
        ),
        (FaultPlan::default().status(0.1, 42), "HTTP status"),
    ] {
        let e = ChaosLayer::new(plan, 1).unwrap_err();
        assert!(e.to_string().contains(words), "{e}");
    }
}
