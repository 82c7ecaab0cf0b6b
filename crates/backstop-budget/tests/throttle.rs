//! Client-side adaptive throttling on the paused clock: a healthy dependency is never
//! throttled; one that sheds load is shed by the client first, down to about K times what it
//! accepts; the throttle opens again as accepts come back; clones share what they learn.

use backstop_budget::{AdaptiveThrottle, ThrottleConfig};
use backstop_core::{Dependency, Outcome, Verdict};
use std::time::Duration;

const ACCEPTED: Verdict = Verdict::Success;
const SHED: Verdict = Verdict::Retryable {
    outcome: Outcome::NotSent,
    after: None,
};

fn throttle() -> AdaptiveThrottle {
    AdaptiveThrottle::new(ThrottleConfig::default().window(Duration::from_secs(10)), 3).unwrap()
}

/// Offers `n` attempts, one every `every`; the dependency accepts an attempt when `accepts`
/// says so. Returns (sent, accepted).
async fn offer(
    t: &AdaptiveThrottle,
    dep: &Dependency,
    n: u32,
    every: Duration,
    mut accepts: impl FnMut(u32) -> bool,
) -> (u32, u32) {
    let (mut sent, mut accepted) = (0, 0);
    for i in 0..n {
        if t.admit(dep).is_ok() {
            sent += 1;
            let ok = accepts(i);
            accepted += u32::from(ok);
            t.observe(dep, if ok { &ACCEPTED } else { &SHED });
        }
        tokio::time::advance(every).await;
    }
    (sent, accepted)
}

#[tokio::test(start_paused = true)]
async fn a_healthy_dependency_is_never_throttled() {
    let t = throttle();
    let dep = Dependency::new("search-api");
    let (sent, _) = offer(&t, &dep, 5_000, Duration::from_millis(2), |_| true).await;
    assert_eq!(sent, 5_000);
    // Final answers about the request itself (a 4xx) are accepts too.
    let fatal = Verdict::Fatal {
        outcome: Outcome::Completed,
    };
    for _ in 0..1_000 {
        assert!(t.admit(&dep).is_ok());
        t.observe(&dep, &fatal);
    }
    assert_eq!(t.stats(&dep).reject_probability, 0.0);
}

#[tokio::test(start_paused = true)]
async fn a_dependency_at_capacity_gets_about_k_times_what_it_accepts() {
    let t = throttle();
    let dep = Dependency::new("search-api");
    // 1,000 attempts a second offered; the dependency serves 100 a second and sheds the rest.
    let mut served_this_second = (0u32, 0u32);
    let every = Duration::from_millis(1);
    let capacity = move |i: u32| {
        let second = i / 1_000;
        if served_this_second.0 != second {
            served_this_second = (second, 0);
        }
        served_this_second.1 += 1;
        served_this_second.1 <= 100
    };
    // Warm up one window, then measure the next.
    offer(&t, &dep, 10_000, every, capacity).await;
    let (sent, accepted) = offer(&t, &dep, 10_000, every, capacity).await;
    println!("offered 10000, sent {sent}, accepted {accepted}");
    assert!(
        accepted >= 900,
        "what the dependency can serve still reaches it: {accepted}"
    );
    let k = 2.0;
    assert!(
        f64::from(sent) <= k * f64::from(accepted) * 1.15,
        "sent {sent} for {accepted} accepted: at most about K times"
    );
    assert!(
        sent < 3_000,
        "most of the excess shed by the client: {sent}"
    );
    let e = t
        .admit(&dep)
        .err()
        .or_else(|| (0..50).find_map(|_| t.admit(&dep).err()));
    let e = e.expect("some attempts are refused");
    let words = e.to_string();
    assert!(
        words.contains("search-api is shedding load") && words.contains("without sending it"),
        "{words}"
    );
    assert!(t.stats(&dep).reject_probability > 0.5);
}

#[tokio::test(start_paused = true)]
async fn the_throttle_opens_again_as_accepts_come_back() {
    let t = throttle();
    let dep = Dependency::new("search-api");
    let every = Duration::from_millis(5);
    let (sent, _) = offer(&t, &dep, 2_000, every, |_| false).await;
    assert!(
        sent < 200,
        "an outage: almost everything shed locally ({sent})"
    );
    // The dependency is back: the share sent about doubles with each 10 s window.
    let mut shares = Vec::new();
    for _ in 0..10 {
        let (sent, _) = offer(&t, &dep, 2_000, every, |_| true).await;
        shares.push(sent);
    }
    println!("sent per window after the outage: {shares:?}");
    assert!(
        shares.windows(2).all(|w| w[1] >= w[0] / 2),
        "it opens, it does not flap: {shares:?}"
    );
    assert_eq!(*shares.last().unwrap(), 2_000, "open again: {shares:?}");
}

#[tokio::test(start_paused = true)]
async fn clones_share_what_they_learn_and_dependencies_do_not() {
    let t = throttle();
    let other = t.clone();
    let dep = Dependency::new("search-api");
    offer(&t, &dep, 1_000, Duration::from_millis(1), |_| false).await;
    assert!(other.stats(&dep).reject_probability > 0.9);
    let fine = Dependency::new("billing-api");
    assert!(other.admit(&fine).is_ok());
    assert_eq!(other.stats(&fine).reject_probability, 0.0);
}

#[test]
fn a_configuration_that_cannot_be_is_refused_with_words() {
    for (config, words) in [
        (ThrottleConfig::default().k(0.5), "at least 1"),
        (ThrottleConfig::default().k(f64::NAN), "at least 1"),
        (
            ThrottleConfig::default().window(Duration::ZERO),
            "at least 12 ms",
        ),
        (ThrottleConfig::default().max_dependencies(0), "at least 1"),
    ] {
        let e = AdaptiveThrottle::new(config, 1).unwrap_err();
        assert!(e.to_string().contains(words), "{e}");
    }
}
