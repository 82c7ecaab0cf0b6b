//! The simulations' safety figures at a small size, on every `cargo test`: counts only.

use backstop_bench::sim;
use std::time::Duration;

#[tokio::test(start_paused = true)]
async fn keys_and_replay_prevent_every_duplicate() {
    let r = sim::reliability(100, 20, 0.02, 7).await;
    assert_eq!(r.duplicates_backstop, 0);
    assert!(r.duplicates_naive > 0);
    assert!(r.clean_with_backstop >= r.clean_without_retries);
    assert!(r.extra_load > 0.0 && r.extra_load < 0.1, "{}", r.extra_load);
}

#[tokio::test(start_paused = true)]
async fn an_outage_is_not_multiplied() {
    let rows = sim::outage(Duration::from_secs(30), Duration::from_millis(10)).await;
    assert_eq!(rows[0].attempts, rows[0].requests * 27);
    assert_eq!(rows[1].attempts, rows[1].requests * 3);
    assert!(
        rows[4].amplification() <= 1.1,
        "{}",
        rows[4].amplification()
    );
}
