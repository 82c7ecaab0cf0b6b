//! Attempt timeouts learned from latency, on the paused clock: the fallback until enough
//! samples, then factor x the percentile, doubled per attempt within the floor and the ceiling;
//! a shift in latency followed within two windows; a silent dependency's record forgotten.

use backstop_core::Dependency;
use backstop_timeout::{LatencyConfig, LatencyTimeouts};
use std::time::Duration as D;
use std::time::Duration;

fn ms(n: u64) -> Duration {
    Duration::from_millis(n)
}

fn timeouts() -> LatencyTimeouts {
    LatencyTimeouts::new(LatencyConfig::default().window(Duration::from_secs(10))).unwrap()
}

/// `n` samples around `median` (a spread of 20 %, one in fifty at 2x), one every `every`.
async fn samples(t: &LatencyTimeouts, dep: &Dependency, n: u32, median: Duration, every: Duration) {
    for i in 0..n {
        let spread = 0.8 + 0.4 * f64::from(i % 10) / 10.0;
        let tail = if i % 50 == 0 { 2.0 } else { 1.0 };
        t.record(dep, median.mul_f64(spread * tail));
        tokio::time::advance(every).await;
    }
}

#[tokio::test(start_paused = true)]
async fn the_fallback_then_the_percentile_doubled_per_attempt() {
    let t = timeouts();
    let dep = Dependency::new("search-api");
    assert_eq!(t.timeout(&dep, 1), Duration::from_secs(2));
    assert_eq!(t.timeout(&dep, 2), Duration::from_secs(4));
    samples(&t, &dep, 19, ms(50), ms(10)).await;
    assert_eq!(
        t.timeout(&dep, 1),
        Duration::from_secs(2),
        "19 samples: not yet"
    );
    samples(&t, &dep, 200, ms(50), ms(10)).await;
    let first = t.timeout(&dep, 1);
    // p99 is the slow tail (1 in 50 at twice 40 ms: 80 ms), reported at the top of its 25 %
    // bucket, times 2.
    assert!(first >= ms(160) && first <= ms(200), "{first:?}");
    assert_eq!(t.timeout(&dep, 2), first * 2);
    assert_eq!(t.timeout(&dep, 3), first * 4);
    // Within the ceiling, however many attempts.
    assert_eq!(t.timeout(&dep, 40), Duration::from_secs(30));
}

#[tokio::test(start_paused = true)]
async fn the_floor_and_the_ceiling_hold() {
    let t = LatencyTimeouts::new(
        LatencyConfig::default()
            .floor(ms(100))
            .ceiling(ms(500))
            .min_samples(5),
    )
    .unwrap();
    let fast = Dependency::new("cache");
    let slow = Dependency::new("batch");
    for _ in 0..50 {
        t.record(&fast, Duration::from_micros(300));
        t.record(&slow, Duration::from_secs(3));
    }
    assert_eq!(t.timeout(&fast, 1), ms(100));
    assert_eq!(t.timeout(&slow, 1), ms(500));
}

#[tokio::test(start_paused = true)]
async fn a_shift_is_followed_within_two_windows() {
    let t = timeouts();
    let dep = Dependency::new("search-api");
    samples(&t, &dep, 1_000, ms(50), ms(10)).await; // 10 s at 50 ms
    let before = t.timeout(&dep, 1);
    assert!(before < ms(300), "{before:?}");
    // The median moves to 400 ms; 100 samples a second.
    let mut followed_after = None;
    for second in 1..=30 {
        samples(&t, &dep, 100, ms(400), ms(10)).await;
        if followed_after.is_none() && t.timeout(&dep, 1) >= ms(800) {
            followed_after = Some(second);
        }
    }
    let after = followed_after.expect("the timeout follows the shift");
    println!("50 ms -> 400 ms: the timeout was {before:?}, followed after {after} s");
    assert!(after <= 20, "within two 10 s windows: {after} s");
    let now = t.timeout(&dep, 1);
    assert!(now >= ms(800) && now <= Duration::from_secs(2), "{now:?}");
}

#[tokio::test(start_paused = true)]
async fn a_record_nobody_adds_to_is_forgotten() {
    let t = timeouts();
    let dep = Dependency::new("search-api");
    samples(&t, &dep, 200, ms(50), ms(10)).await;
    assert!(t.timeout(&dep, 1) < Duration::from_secs(1));
    tokio::time::advance(Duration::from_secs(25)).await;
    assert_eq!(
        t.timeout(&dep, 1),
        Duration::from_secs(2),
        "back to the fallback"
    );
}

#[test]
fn a_configuration_that_cannot_be_is_refused_with_words() {
    for (config, words) in [
        (LatencyConfig::default().percentile(1.0), "between 0 and 1"),
        (LatencyConfig::default().factor(0.5), "at least 1"),
        (
            LatencyConfig::default().floor(Duration::from_secs(60)),
            "at most the ceiling",
        ),
        (
            LatencyConfig::default().fallback(Duration::ZERO),
            "above zero",
        ),
        (
            LatencyConfig::default().window(Duration::ZERO),
            "at least 10 ms",
        ),
    ] {
        let e = LatencyTimeouts::new(config).unwrap_err();
        assert!(e.to_string().contains(words), "{e}");
    }
}

/// A GET every 10 ms at a 20 ms median, 1 % of attempts hanging and cut at the learned limit:
/// the limit stays on the answered attempts' own p99, the hangs cut there, instead of the cuts
/// becoming the p99 and doubling the limit each time it is computed.
#[tokio::test(start_paused = true)]
async fn attempts_that_hang_do_not_ratchet_the_limit() {
    let t = LatencyTimeouts::new(LatencyConfig::default()).unwrap();
    let dep = Dependency::new("search-api");
    let bound = t.bind(&dep);
    samples(&t, &dep, 200, ms(20), ms(10)).await;
    let answered = t.timeout(&dep, 1);
    assert!(
        answered <= ms(100),
        "2 x p99 of ~20 ms (40 ms tail): {answered:?}"
    );
    // Four 30 s windows: 99 answers, then one attempt hanging until the limit cuts it.
    let mut worst = D::ZERO;
    for round in 0..120 {
        samples(&t, &dep, 99, ms(20), ms(10)).await;
        let limit = t.timeout(&dep, 1);
        tokio::time::advance(limit).await;
        bound.record_cut(&dep);
        if round >= 60 {
            worst = worst.max(t.timeout(&dep, 1));
        }
    }
    println!("1 % hanging: the limit {answered:?} before, at most {worst:?} after two windows");
    assert!(
        worst <= answered * 2,
        "no ratchet: {worst:?} against {answered:?}"
    );
}

/// When most attempts are cut (the dependency slowed past the limit), the cuts raise the
/// limit until the slow answers fit under it: a limit never learns what it always cuts.
#[tokio::test(start_paused = true)]
async fn cuts_beyond_the_tail_let_the_limit_rise_past_what_it_cuts() {
    let t = LatencyTimeouts::new(LatencyConfig::default()).unwrap();
    let dep = Dependency::new("search-api");
    let bound = t.bind(&dep);
    samples(&t, &dep, 200, ms(20), ms(10)).await;
    // Every attempt takes 600 ms now: cut while the limit is under it, answered once above.
    let mut answered_after = None;
    for i in 0..2_000 {
        let limit = t.timeout(&dep, 1);
        if limit > ms(600) {
            tokio::time::advance(ms(600)).await;
            t.record(&dep, ms(600));
            answered_after.get_or_insert(i);
        } else {
            tokio::time::advance(limit).await;
            bound.record_cut(&dep);
        }
    }
    let after = answered_after.expect("the limit rises past 600 ms");
    println!("20 ms -> 600 ms: answered after {after} attempts");
    let now = t.timeout(&dep, 1);
    assert!(
        now > ms(600) && now <= ms(2_000),
        "on the answers' p99 again: {now:?}"
    );
}
