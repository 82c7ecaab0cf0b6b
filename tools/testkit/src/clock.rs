//! A wall clock a test moves by hand, and a scratch directory per test.

use chrono::{DateTime, Utc};
use std::{
    sync::{
        Arc,
        atomic::{AtomicI64, Ordering},
    },
    time::Duration,
};

/// A wall clock, to the millisecond, that moves only when the test says so (a lease that runs
/// out, a key's time to live, a clock advanced by years). Starts at 2026-01-01.
#[derive(Clone, Debug)]
pub struct ManualClock(Arc<AtomicI64>);

impl Default for ManualClock {
    fn default() -> Self {
        ManualClock(Arc::new(AtomicI64::new(1_767_225_600_000)))
    }
}

impl ManualClock {
    /// A clock at 2026-01-01T00:00:00Z.
    pub fn new() -> Self {
        ManualClock::default()
    }

    /// Moves the clock forward by `by`.
    pub fn advance(&self, by: Duration) {
        let by = i64::try_from(by.as_millis()).unwrap_or(i64::MAX);
        self.0.fetch_add(by, Ordering::SeqCst);
    }

    /// The time now.
    pub fn now(&self) -> DateTime<Utc> {
        at(self.0.load(Ordering::SeqCst))
    }

    /// The clock as a function, for a component that takes one (`Journal::with_clock`).
    pub fn reader(&self) -> Arc<dyn Fn() -> DateTime<Utc> + Send + Sync> {
        let t = self.0.clone();
        Arc::new(move || at(t.load(Ordering::SeqCst)))
    }
}

fn at(ms: i64) -> DateTime<Utc> {
    DateTime::from_timestamp_millis(ms).expect("a time chrono can hold")
}

/// A fresh, empty directory under the system's temporary directory, named after `name`; it
/// and what it holds are removed when the returned guard drops, however the test ends.
pub fn scratch_dir(name: &str) -> tempfile::TempDir {
    tempfile::Builder::new()
        .prefix(&format!("backstop-{name}-"))
        .tempdir()
        .expect("a temporary directory")
}
