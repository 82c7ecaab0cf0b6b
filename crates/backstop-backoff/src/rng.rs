use rand::{SeedableRng, rngs::SmallRng};
use std::sync::{
    Arc,
    atomic::{AtomicU64, Ordering},
};

/// Hands out one small, fast RNG per logical call.
///
/// Seeded, it makes every run of a test or simulation draw the same delays in the same call
/// order; unseeded, it takes its seed from the operating system once. Clones share the counter,
/// so two clones never hand out the same stream. No lock is taken: each call's RNG is seeded
/// from the base seed and an atomic counter.
#[derive(Clone, Debug)]
pub struct RngSource {
    seed: u64,
    counter: Arc<AtomicU64>,
}

impl RngSource {
    /// A reproducible source.
    pub fn seeded(seed: u64) -> Self {
        RngSource {
            seed,
            counter: Arc::new(AtomicU64::new(0)),
        }
    }

    /// A source seeded from the operating system's entropy.
    pub fn from_entropy() -> Self {
        let mut os: SmallRng = rand::make_rng();
        Self::seeded(rand::Rng::next_u64(&mut os))
    }

    /// The RNG for the next call.
    pub fn rng(&self) -> SmallRng {
        let n = self.counter.fetch_add(1, Ordering::Relaxed);
        SmallRng::seed_from_u64(splitmix64(self.seed ^ splitmix64(n)))
    }
}

impl Default for RngSource {
    fn default() -> Self {
        Self::from_entropy()
    }
}

/// SplitMix64's finaliser: turns neighbouring counters into unrelated seeds.
fn splitmix64(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}
