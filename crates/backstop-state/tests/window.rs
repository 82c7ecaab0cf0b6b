//! The sliding window, through its public API.

use backstop_state::SlidingCount;
use std::time::Duration;
use tokio::time::Instant;

use std::sync::Arc;

#[tokio::test(start_paused = true)]
async fn an_event_dated_a_whole_window_ago_does_not_overwrite_a_newer_bucket() {
    let c = SlidingCount::new(Duration::from_secs(10), 10);
    let t0 = Instant::now();
    // Bucket 0 (0 s..1 s) is reused by period 10 (10 s..11 s).
    c.add(t0 + Duration::from_millis(10_500), 3);
    c.add(t0 + Duration::from_millis(500), 1);
    assert_eq!(c.sum(t0 + Duration::from_millis(10_600)), 3);
    // An event in the past that is still inside the window counts.
    c.add(t0 + Duration::from_millis(9_500), 1);
    assert_eq!(c.sum(t0 + Duration::from_millis(10_600)), 4);
}

#[tokio::test(start_paused = true)]
async fn events_leave_the_window() {
    let c = SlidingCount::new(Duration::from_secs(10), 10);
    let t0 = Instant::now();
    c.add(t0, 5);
    c.add(t0 + Duration::from_millis(4_500), 2);
    assert_eq!(c.sum(t0 + Duration::from_secs(5)), 7);
    assert_eq!(c.sum(t0 + Duration::from_millis(9_999)), 7);
    // The first bucket (0 s..1 s) leaves after 10 s; the one of 4 s..5 s after 14 s.
    assert_eq!(c.sum(t0 + Duration::from_secs(10)), 2);
    assert_eq!(c.sum(t0 + Duration::from_millis(13_999)), 2);
    assert_eq!(c.sum(t0 + Duration::from_secs(14)), 0);
    // A bucket reused after a full turn starts from zero.
    c.add(t0 + Duration::from_secs(20), 1);
    assert_eq!(c.sum(t0 + Duration::from_secs(20)), 1);
}

#[tokio::test(start_paused = true)]
async fn remove_one_undoes_and_reset_forgets() {
    let c = SlidingCount::new(Duration::from_secs(1), 4);
    let t = Instant::now();
    c.add(t, 2);
    c.remove_one(t);
    assert_eq!(c.sum(t), 1);
    c.reset();
    assert_eq!(c.sum(t), 0);
    c.add(t, 1);
    assert_eq!(c.sum(t), 1);
}

/// Years of uptime, idle gaps of any length up to years, and resets late in any epoch:
/// every add counts and every old event leaves the window.
#[tokio::test(start_paused = true)]
async fn counts_correctly_after_years_of_uptime_idle_gaps_and_resets() {
    const YEAR: Duration = Duration::from_secs(365 * 86_400);
    // The breaker's finest default: a 1 s window in 10 buckets of 100 ms.
    let c = SlidingCount::new(Duration::from_secs(1), 10);
    let t0 = Instant::now();
    let mut t = t0;
    for gap in [
        Duration::from_secs(97 * 86_400), // 2^23 one-second periods and more
        Duration::from_secs(10 * 86_400), // 2^23 periods of 100 ms: 9.7 days
        YEAR,
        3 * YEAR,
        Duration::from_millis(100) * (1 << 23),
        Duration::from_millis(100) * (1 << 24),
        Duration::from_millis(100) * ((1 << 24) + 5),
        20 * YEAR,
    ] {
        t += gap;
        c.add(t, 1);
        c.add(t + Duration::from_millis(150), 2);
        assert_eq!(c.sum(t + Duration::from_millis(150)), 3, "after {gap:?}");
        assert_eq!(c.sum(t + Duration::from_millis(1_200)), 0, "after {gap:?}");
        c.reset();
        assert_eq!(c.sum(t + Duration::from_millis(150)), 0);
        c.add(t + Duration::from_millis(160), 1);
        assert_eq!(
            c.sum(t + Duration::from_millis(160)),
            1,
            "reset, after {gap:?}"
        );
    }
    // The finest buckets (1 ms), past half of the 40-bit epoch (17.4 years), with a reset.
    let fine = SlidingCount::new(Duration::from_millis(10), 10);
    let late = t0 + 18 * YEAR;
    fine.add(late, 1);
    fine.reset();
    fine.add(late + Duration::from_millis(1), 1);
    assert_eq!(fine.sum(late + Duration::from_millis(1)), 1);
    // A reset at the very end of the epoch (2^40 ms, 34.8 years), and past it, with every
    // bucket in use (a bucket idle for exactly 2^40 periods is the documented limit).
    let edge = t0 + Duration::from_millis((1 << 40) - 500);
    for i in 1..=10 {
        fine.add(edge - Duration::from_millis(i), 1);
    }
    for at in [edge, edge + Duration::from_millis(600)] {
        fine.add(at, 1);
        fine.reset();
        fine.add(at + Duration::from_millis(1), 1);
        assert_eq!(fine.sum(at + Duration::from_millis(1)), 1, "at {at:?}");
    }
    // The budget's shape: a 10 s window of 1 s buckets, years on.
    let b = SlidingCount::new(Duration::from_secs(10), 10);
    let late = t0 + 50 * YEAR;
    for i in 0..10u64 {
        b.add(late + Duration::from_secs(i), 1);
    }
    assert_eq!(b.sum(late + Duration::from_millis(9_500)), 10);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn no_increment_is_lost_under_contention() {
    let c = Arc::new(SlidingCount::new(Duration::from_secs(3600), 10));
    let mut tasks = Vec::new();
    for _ in 0..8 {
        let c = c.clone();
        tasks.push(tokio::spawn(async move {
            for _ in 0..50_000 {
                c.add(Instant::now(), 1);
            }
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
    assert_eq!(c.sum(Instant::now()), 400_000);
}
