//! Seeded uniform draws shared by threads without a lock.

use std::sync::atomic::{AtomicU64, Ordering};

/// A sequence of uniform numbers in `[0, 1)` from a seed: the `n`th draw is SplitMix64 of the
/// seed and `n`, so one seed gives one sequence, in the order the draws are taken, whichever
/// thread takes them. For decisions that must be reproducible in a test (a fault to inject, a
/// request to throttle), not for anything secret.
///
/// ```
/// use backstop_state::Draws;
///
/// let (a, b) = (Draws::new(7), Draws::new(7));
/// let first: Vec<f64> = (0..3).map(|_| a.next()).collect();
/// assert_eq!(first, (0..3).map(|_| b.next()).collect::<Vec<_>>());
/// assert!(first.iter().all(|x| (0.0..1.0).contains(x)));
/// ```
#[derive(Debug)]
pub struct Draws {
    seed: u64,
    taken: AtomicU64,
}

impl Draws {
    /// The draws of `seed`.
    pub fn new(seed: u64) -> Self {
        Draws {
            seed,
            taken: AtomicU64::new(0),
        }
    }

    /// The next draw.
    pub fn next(&self) -> f64 {
        let n = self.taken.fetch_add(1, Ordering::Relaxed);
        let mut z = self
            .seed
            .wrapping_add(n.wrapping_mul(0x9E37_79B9_7F4A_7C15));
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^= z >> 31;
        (z >> 11) as f64 / (1u64 << 53) as f64
    }
}
