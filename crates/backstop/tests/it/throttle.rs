//! Client-side adaptive throttling in the composed stack: a dependency that sheds its load is
//! shed by the client first, each refusal an error that says what it is, nothing sent; a
//! healthy one is never throttled; one throttle shared by two stacks learns from both.

use backstop::{
    Backstop, ErrorKind, Outcome,
    budget::{AdaptiveThrottle, ThrottleConfig},
};
use http::{Request, Response};
use std::{
    sync::{
        Arc,
        atomic::{AtomicU64, Ordering},
    },
    time::Duration,
};
use tower::{Layer, ServiceExt, service_fn};

fn dependency(
    status: u16,
    seen: &Arc<AtomicU64>,
) -> impl tower::Service<Request<String>, Response = Response<()>, Error = std::io::Error, Future: Send>
+ Clone
+ Send
+ 'static {
    let seen = seen.clone();
    service_fn(move |_req: Request<String>| {
        seen.fetch_add(1, Ordering::SeqCst);
        async move { Ok::<_, std::io::Error>(Response::builder().status(status).body(()).unwrap()) }
    })
}

fn get() -> Request<String> {
    Request::get("http://search.local/q")
        .body(String::new())
        .unwrap()
}

fn throttle() -> AdaptiveThrottle {
    AdaptiveThrottle::new(ThrottleConfig::default().window(Duration::from_secs(10)), 9).unwrap()
}

#[tokio::test(start_paused = true)]
async fn a_shedding_dependency_is_shed_by_the_client_with_honest_errors() {
    let seen = Arc::new(AtomicU64::new(0));
    let t = throttle();
    let stack = Backstop::http("throttle-search-api")
        .max_attempts(1)
        .no_breaker()
        .adaptive_throttle(t.clone())
        .build()
        .unwrap()
        .layer(dependency(503, &seen));
    let mut throttled = 0;
    for _ in 0..1_000 {
        if let Err(e) = stack.clone().oneshot(get()).await
            && e.kind() == ErrorKind::Throttled
        {
            throttled += 1;
            assert_eq!(e.outcome(), Outcome::NotSent);
            assert_eq!(e.attempts(), 0, "nothing was sent");
            assert!(e.is_retryable_later());
            let words = e.to_string();
            assert!(
                words.contains("throttle-search-api is shedding load")
                    && words.contains("without sending it")
                    && words.contains(Outcome::NotSent.guidance()),
                "{words}"
            );
            assert!(
                e.next_action().contains("do not retry now"),
                "{}",
                e.next_action()
            );
        }
        tokio::time::advance(Duration::from_millis(5)).await;
    }
    let sent = seen.load(Ordering::SeqCst);
    println!("1000 calls: {sent} sent, {throttled} refused by the client");
    assert_eq!(sent + throttled, 1_000);
    assert!(
        sent < 150,
        "the client shed most of them itself: {sent} sent"
    );
}

#[tokio::test(start_paused = true)]
async fn a_healthy_dependency_is_never_throttled_and_one_throttle_learns_from_two_stacks() {
    let seen = Arc::new(AtomicU64::new(0));
    let t = throttle();
    let healthy = Backstop::http("throttle-search-api")
        .adaptive_throttle(t.clone())
        .build()
        .unwrap()
        .layer(dependency(200, &seen));
    for _ in 0..500 {
        healthy.clone().oneshot(get()).await.unwrap();
    }
    assert_eq!(seen.load(Ordering::SeqCst), 500);
    // A second stack to the same dependency, through the same throttle, meets an outage: the
    // first stack's calls are shed too, before they are sent.
    let failing = Backstop::http("throttle-search-api")
        .max_attempts(1)
        .no_breaker()
        .adaptive_throttle(t.clone())
        .build()
        .unwrap()
        .layer(dependency(503, &seen));
    for _ in 0..3_000 {
        let _ = failing.clone().oneshot(get()).await;
    }
    assert!(t.stats(&"throttle-search-api".into()).reject_probability > 0.5);
    let mut refused = 0;
    for _ in 0..20 {
        if let Err(e) = healthy.clone().oneshot(get()).await {
            assert_eq!(e.kind(), ErrorKind::Throttled);
            refused += 1;
        }
    }
    assert!(
        refused > 5,
        "the shared throttle sheds the other stack's calls too: {refused}"
    );
}
