//! The sliding window's compare-and-swap protocol, model-checked: loom runs every interleaving
//! of the threads below on this very `window.rs`, compiled against loom's atomics.

#![allow(unreachable_pub, dead_code, missing_docs)]

mod sync {
    pub(crate) use loom::sync::atomic::{AtomicU64, Ordering};
}

#[path = "../src/window.rs"]
mod window;

use loom::{sync::Arc, thread};
use std::time::Duration;
use tokio::time::Instant;
use window::SlidingCount;

/// A window of two 500 ms buckets; `at(ms)` is that long after its origin (plus a margin so
/// that the origin, read a moment before, never moves an instant across a bucket boundary).
fn window() -> (Arc<SlidingCount>, impl Fn(u64) -> Instant + Clone) {
    let c = Arc::new(SlidingCount::new(Duration::from_secs(1), 2));
    let t0 = Instant::now();
    (c, move |ms| t0 + Duration::from_millis(ms + 10))
}

#[test]
fn two_adds_that_roll_a_bucket_over_both_count() {
    loom::model(|| {
        let (c, at) = window();
        c.add(at(100), 5); // period 0, bucket 0
        let threads: Vec<_> = (0..2)
            .map(|_| {
                let (c, at) = (c.clone(), at.clone());
                thread::spawn(move || c.add(at(1_100), 1)) // period 2, bucket 0 again
            })
            .collect();
        for t in threads {
            t.join().unwrap();
        }
        assert_eq!(c.sum(at(1_200)), 2);
    });
}

#[test]
fn a_late_event_never_overwrites_the_current_period() {
    loom::model(|| {
        let (c, at) = window();
        c.add(at(100), 5);
        let late = {
            let (c, at) = (c.clone(), at.clone());
            thread::spawn(move || c.add(at(200), 1)) // period 0: a whole window late
        };
        let now = {
            let (c, at) = (c.clone(), at.clone());
            thread::spawn(move || c.add(at(1_100), 1))
        };
        late.join().unwrap();
        now.join().unwrap();
        assert_eq!(c.sum(at(1_200)), 1);
    });
}

#[test]
fn an_add_beside_a_reset_is_counted_or_forgotten_never_doubled_and_the_next_one_counts() {
    loom::model(|| {
        let (c, at) = window();
        c.add(at(100), 1);
        let adder = {
            let (c, at) = (c.clone(), at.clone());
            thread::spawn(move || c.add(at(100), 1))
        };
        let resetter = {
            let c = c.clone();
            thread::spawn(move || c.reset())
        };
        adder.join().unwrap();
        resetter.join().unwrap();
        let n = c.sum(at(150));
        assert!(n <= 1, "{n}");
        c.add(at(150), 1);
        assert_eq!(c.sum(at(150)), n + 1);
    });
}

#[test]
fn an_undo_beside_an_add_leaves_exactly_one() {
    loom::model(|| {
        let (c, at) = window();
        c.add(at(100), 1);
        let undo = {
            let (c, at) = (c.clone(), at.clone());
            thread::spawn(move || c.remove_one(at(100)))
        };
        let add = {
            let (c, at) = (c.clone(), at.clone());
            thread::spawn(move || c.add(at(100), 1))
        };
        undo.join().unwrap();
        add.join().unwrap();
        assert_eq!(c.sum(at(150)), 1);
    });
}
