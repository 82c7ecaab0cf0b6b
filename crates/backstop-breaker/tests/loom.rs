//! The half-open trial slots, model-checked: loom runs every interleaving of an admitting
//! caller and a transition on this very `slots.rs`, compiled against loom's atomics.

#![allow(unreachable_pub, dead_code, missing_docs)]

mod sync {
    pub(crate) use loom::sync::atomic::{AtomicU64, Ordering};
}

#[path = "../src/slots.rs"]
mod slots;

use loom::{
    sync::{
        Arc,
        atomic::{AtomicU64, Ordering},
    },
    thread,
};
use slots::TrialSlots;

/// What the breaker's `admit` does while half-open: read the generation, take a slot of it;
/// if none, look again when the generation moved on.
fn admit(generation: &AtomicU64, slots: &TrialSlots) -> Option<u64> {
    loop {
        let g = generation.load(Ordering::Acquire);
        if slots.take(g) {
            return Some(g);
        }
        if generation.load(Ordering::Acquire) == g {
            return None;
        }
    }
}

#[test]
fn a_caller_admitted_during_a_transition_holds_a_slot_of_the_period_it_names() {
    loom::model(|| {
        // Half-open period 2, its one trial slot taken by the trial in flight.
        let generation = Arc::new(AtomicU64::new(2));
        let slots = Arc::new(TrialSlots::new());
        slots.open(2, 0);
        // The trial fails (open: generation 3); the cooldown passes (half-open: generation 4,
        // one slot), in the order the breaker's transition writes them.
        let transition = {
            let (generation, slots) = (generation.clone(), slots.clone());
            thread::spawn(move || {
                generation.store(3, Ordering::Release);
                slots.open(4, 1);
                generation.store(4, Ordering::Release);
            })
        };
        let caller = {
            let (generation, slots) = (generation.clone(), slots.clone());
            thread::spawn(move || admit(&generation, &slots))
        };
        transition.join().unwrap();
        let admitted = caller.join().unwrap();
        if let Some(g) = admitted {
            assert_eq!(g, 4, "a ticket of a period whose slot it did not take");
        }
        // Every slot of the current period is either held by a caller of that period or free.
        let held = u32::from(admitted == Some(4));
        assert_eq!(slots.left(4) + held, 1);
    });
}

#[test]
fn a_slot_given_back_late_never_tops_up_a_later_period() {
    loom::model(|| {
        let slots = Arc::new(TrialSlots::new());
        slots.open(2, 0); // period 2's one slot is held by a trial
        let cancel = {
            let slots = slots.clone();
            thread::spawn(move || slots.give_back(2)) // that trial is cancelled, late
        };
        let next = {
            let slots = slots.clone();
            thread::spawn(move || slots.open(4, 1))
        };
        cancel.join().unwrap();
        next.join().unwrap();
        assert!(
            slots.left(4) <= 1,
            "period 4 got more slots than it was given"
        );
    });
}
