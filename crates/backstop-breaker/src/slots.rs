//! The half-open trial slots: how many trial calls a half-open period still admits, tagged with
//! the generation of that period, in one word.

use crate::sync::{AtomicU64, Ordering};

const SLOTS: u64 = 0xffff_ffff;

/// Trial slots tagged with their generation (high 32 bits: the generation's low bits; low 32
/// bits: slots left). Taking a slot checks the tag in the same compare-and-swap, so a caller
/// that read the generation before a transition cannot take (and then never give back) a slot
/// of the next half-open period; a slot given back goes only into the period it came from.
#[derive(Debug)]
pub(crate) struct TrialSlots(AtomicU64);

fn tag(generation: u64) -> u64 {
    generation & SLOTS
}

impl TrialSlots {
    /// No slots, for no generation.
    pub(crate) fn new() -> Self {
        TrialSlots(AtomicU64::new(0))
    }

    /// Opens the half-open period of `generation` with `slots` trial calls.
    pub(crate) fn open(&self, generation: u64, slots: u32) {
        self.0.store(
            (tag(generation) << 32) | u64::from(slots),
            Ordering::Release,
        );
    }

    /// Takes one slot of `generation`'s period, if it is the current one and has a slot left.
    pub(crate) fn take(&self, generation: u64) -> bool {
        let tag = tag(generation);
        self.0
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |w| {
                (w >> 32 == tag && w & SLOTS != 0).then(|| w - 1)
            })
            .is_ok()
    }

    /// Gives a slot of `generation`'s period back (a cancelled trial), if that period is still
    /// the current one.
    pub(crate) fn give_back(&self, generation: u64) {
        let tag = tag(generation);
        let _ = self
            .0
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |w| {
                (w >> 32 == tag).then(|| w + 1)
            });
    }

    /// The slots left in `generation`'s period (0 if another period is current).
    #[cfg(test)]
    pub(crate) fn left(&self, generation: u64) -> u32 {
        let w = self.0.load(Ordering::Acquire);
        if w >> 32 == tag(generation) {
            (w & SLOTS) as u32
        } else {
            0
        }
    }
}
