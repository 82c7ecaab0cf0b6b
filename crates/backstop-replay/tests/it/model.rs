//! The replay protocol as a model, checked with `stateright`: two server processes each serve a
//! request with the same key (a client's first try and its retry, on two replicas) over one
//! store, with a clock, leases renewed on time while the store answers, and the faults the
//! protocol meets: a store outage, a store restarted empty, a result write the store refuses,
//! a process killed at any step, a process whose clock runs slow past its renewals' margin. The property: **at most one execution of the handler**.
//!
//! The checker explores every interleaving to the model's bound. Without faults, and in the
//! transactional mode with outages and kills, no interleaving executes twice; each documented
//! limit appears as the shortest counterexample the checker finds, asserted step by step here and
//! written out in ARCHITECTURE.md ("The replay protocol, model-checked").
//!
//! The store's transitions ([`store_step`]) are the model's; `the_model_store_agrees_with_the_memory_store`
//! drives every sequence of store operations to a fixed depth through the real `MemoryStore`
//! (the `ReplayStore` trait, on the paused clock) and through [`store_step`], and compares each
//! answer.

use backstop_replay::{Claim, MemoryStore, ReplayStore, StoredResponse};
use stateright::{Checker, Model, Property};
use std::time::Duration;

/// A lease, in clock ticks.
const LEASE: u8 = 3;
/// How far the clock runs: long enough for a lease to pass twice.
const HORIZON: u8 = 2 * LEASE + 1;
/// Server processes serving the key.
const PROCS: usize = 2;

/// The store's record of the key.
#[derive(Clone, Copy, Debug, Hash, PartialEq, Eq)]
enum Slot {
    Free,
    InFlight { token: u8, until: u8 },
    Done,
}

/// A store operation (the `ReplayStore` trait's methods).
#[derive(Clone, Copy, Debug, Hash, PartialEq, Eq)]
enum StoreOp {
    Claim,
    Renew(u8),
    Complete(u8),
    Release(u8),
}

/// What the store answers.
#[derive(Clone, Copy, Debug, Hash, PartialEq, Eq)]
enum Answer {
    Claimed(u8),
    InFlight,
    Done,
    /// For renew, complete and release: whether the token still held the claim.
    Held(bool),
}

/// The store's transition at time `now`: a claim takes a free key or one whose lease has run
/// out, with the next fencing token; renew, complete and release act only for the token that
/// holds the claim (an expired claim nobody took again is still held).
fn store_step(slot: Slot, next_token: u8, now: u8, op: StoreOp) -> (Slot, u8, Answer) {
    let holds = |t| matches!(slot, Slot::InFlight { token, .. } if token == t);
    match op {
        StoreOp::Claim => match slot {
            Slot::InFlight { until, .. } if until > now => (slot, next_token, Answer::InFlight),
            Slot::Done => (slot, next_token, Answer::Done),
            _ => (
                Slot::InFlight {
                    token: next_token,
                    until: now + LEASE,
                },
                next_token + 1,
                Answer::Claimed(next_token),
            ),
        },
        StoreOp::Renew(t) if holds(t) => (
            Slot::InFlight {
                token: t,
                until: now + LEASE,
            },
            next_token,
            Answer::Held(true),
        ),
        StoreOp::Complete(t) if holds(t) => (Slot::Done, next_token, Answer::Held(true)),
        StoreOp::Release(t) if holds(t) => (Slot::Free, next_token, Answer::Held(true)),
        _ => (slot, next_token, Answer::Held(false)),
    }
}

/// One server process serving the key.
#[derive(Clone, Copy, Debug, Hash, PartialEq, Eq)]
enum Proc {
    /// Its request has not reached the store yet.
    Idle,
    /// It holds the claim (`token`); the handler has not run.
    Holding { token: u8 },
    /// The handler ran (in the transactional mode: its writes wait for the commit).
    Ran { token: u8 },
    /// It answered.
    Answered(Reply),
    /// Killed (SIGKILL): nothing more from it.
    Killed,
}

#[derive(Clone, Copy, Debug, Hash, PartialEq, Eq)]
enum Reply {
    Executed,
    Replayed,
    InFlight,
    Unavailable,
    LeaseLost,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq)]
struct State {
    now: u8,
    slot: Slot,
    next_token: u8,
    procs: [Proc; PROCS],
    /// Handler executions that took effect.
    effects: u8,
    store_down: bool,
    /// Each fault at most once per run, which bounds the space.
    outage_used: bool,
    restart_used: bool,
    refusal_used: bool,
}

#[derive(Clone, Copy, Debug, Hash, PartialEq, Eq)]
enum Action {
    /// Process `i`'s request claims the key.
    Claim(usize),
    /// Process `i`'s handler runs.
    Run(usize),
    /// Process `i` renews its lease (on time: every third of the lease).
    Renew(usize),
    /// Process `i` stores its result (in the transactional mode: and commits).
    Settle(usize),
    /// The store refuses process `i`'s result for good; it gives up on it.
    RefuseWrite(usize),
    /// Process `i` gives up storing while the store is down and its lease has run out.
    GiveUp(usize),
    Kill(usize),
    StoreDown,
    StoreUp,
    /// The store comes back empty (a Redis restarted without persistence).
    StoreRestartsEmpty,
    Tick,
}

/// The protocol and the faults a run may meet.
#[derive(Clone, Debug, Default)]
struct ReplayModel {
    transactional: bool,
    kills: bool,
    outage: bool,
    restart_empty: bool,
    write_refused: bool,
    /// Process 0's clock runs slow past the renewal margin (its renewals, every third of the
    /// lease by its own clock, come after the lease's end by the store's): the store's clock,
    /// the only one that ends a lease, may pass its lease while it still works.
    slow_clock: bool,
}

impl ReplayModel {
    fn store(&self, s: &mut State, op: StoreOp) -> Answer {
        let (slot, next, answer) = store_step(s.slot, s.next_token, s.now, op);
        s.slot = slot;
        s.next_token = next;
        answer
    }

    /// Whether the clock may move: a process that holds a live lease renews it on time, so
    /// time passes a lease's end only while the store cannot be reached.
    fn may_tick(&self, s: &State) -> bool {
        s.now < HORIZON
            && (s.store_down
                || s.procs.iter().enumerate().all(|(i, p)| match p {
                    _ if self.slow_clock && i == 0 => true,
                    Proc::Holding { token } | Proc::Ran { token } => match s.slot {
                        Slot::InFlight { token: t, until } if t == *token => until > s.now + 1,
                        _ => true,
                    },
                    _ => true,
                }))
    }
}

impl Model for ReplayModel {
    type State = State;
    type Action = Action;

    fn init_states(&self) -> Vec<State> {
        vec![State {
            now: 0,
            slot: Slot::Free,
            next_token: 1,
            procs: [Proc::Idle; PROCS],
            effects: 0,
            store_down: false,
            outage_used: false,
            restart_used: false,
            refusal_used: false,
        }]
    }

    fn actions(&self, s: &State, actions: &mut Vec<Action>) {
        for (i, p) in s.procs.iter().enumerate() {
            match p {
                Proc::Idle => actions.push(Action::Claim(i)),
                Proc::Holding { .. } => {
                    actions.push(Action::Run(i));
                    if !s.store_down {
                        actions.push(Action::Renew(i));
                    }
                }
                Proc::Ran { token } => {
                    if !s.store_down {
                        actions.push(Action::Renew(i));
                        actions.push(Action::Settle(i));
                        if self.write_refused && !s.refusal_used {
                            actions.push(Action::RefuseWrite(i));
                        }
                    } else if !matches!(s.slot, Slot::InFlight { token: t, until } if t == *token && until > s.now)
                    {
                        actions.push(Action::GiveUp(i));
                    }
                }
                _ => {}
            }
            if self.kills && matches!(p, Proc::Holding { .. } | Proc::Ran { .. }) {
                actions.push(Action::Kill(i));
            }
        }
        if self.outage && !s.store_down && !s.outage_used {
            actions.push(Action::StoreDown);
        }
        if s.store_down {
            actions.push(Action::StoreUp);
        }
        if self.restart_empty && !s.restart_used && !s.store_down {
            actions.push(Action::StoreRestartsEmpty);
        }
        if self.may_tick(s) {
            actions.push(Action::Tick);
        }
    }

    fn next_state(&self, last: &State, action: Action) -> Option<State> {
        let mut s = last.clone();
        match action {
            Action::Claim(i) => {
                s.procs[i] = if s.store_down {
                    // Fail closed: refused, not run.
                    Proc::Answered(Reply::Unavailable)
                } else {
                    match self.store(&mut s, StoreOp::Claim) {
                        Answer::Claimed(token) => Proc::Holding { token },
                        Answer::InFlight => Proc::Answered(Reply::InFlight),
                        Answer::Done => Proc::Answered(Reply::Replayed),
                        Answer::Held(_) => unreachable!("a claim answers a claim"),
                    }
                };
            }
            Action::Run(i) => {
                let Proc::Holding { token } = s.procs[i] else {
                    return None;
                };
                if !self.transactional {
                    s.effects += 1;
                }
                s.procs[i] = Proc::Ran { token };
            }
            Action::Renew(i) => {
                let (Proc::Holding { token } | Proc::Ran { token }) = s.procs[i] else {
                    return None;
                };
                // A refused renewal reports the lease lost; the handler goes on.
                self.store(&mut s, StoreOp::Renew(token));
            }
            Action::Settle(i) => {
                let Proc::Ran { token } = s.procs[i] else {
                    return None;
                };
                let stored = self.store(&mut s, StoreOp::Complete(token)) == Answer::Held(true);
                s.procs[i] = if self.transactional {
                    // The result's fenced write and the handler's writes commit together.
                    if stored {
                        s.effects += 1;
                        Proc::Answered(Reply::Executed)
                    } else {
                        Proc::Answered(Reply::LeaseLost)
                    }
                } else {
                    Proc::Answered(Reply::Executed)
                };
            }
            Action::RefuseWrite(i) => {
                let Proc::Ran { .. } = s.procs[i] else {
                    return None;
                };
                s.refusal_used = true;
                // The transactional mode rolls back; otherwise the effect stands unrecorded.
                s.procs[i] = Proc::Answered(if self.transactional {
                    Reply::Unavailable
                } else {
                    Reply::Executed
                });
            }
            Action::GiveUp(i) => {
                s.procs[i] = Proc::Answered(if self.transactional {
                    Reply::Unavailable
                } else {
                    Reply::Executed
                });
            }
            Action::Kill(i) => s.procs[i] = Proc::Killed,
            Action::StoreDown => {
                s.store_down = true;
                s.outage_used = true;
            }
            Action::StoreUp => s.store_down = false,
            Action::StoreRestartsEmpty => {
                s.slot = Slot::Free;
                s.restart_used = true;
            }
            Action::Tick => s.now += 1,
        }
        Some(s)
    }

    fn properties(&self) -> Vec<Property<Self>> {
        vec![
            Property::always("at most one execution", |_, s: &State| s.effects <= 1),
            Property::sometimes("a repeat gets the stored result", |_, s: &State| {
                s.effects == 1 && s.procs.contains(&Proc::Answered(Reply::Replayed))
            }),
        ]
    }
}

const ONE: &str = "at most one execution";

fn check(model: ReplayModel) -> impl Checker<ReplayModel> {
    model.checker().spawn_bfs().join()
}

#[test]
fn without_faults_no_interleaving_executes_twice() {
    let checker = check(ReplayModel::default());
    checker.assert_no_discovery(ONE);
    checker.assert_any_discovery("a repeat gets the stored result");
    eprintln!("no faults: {} states", checker.unique_state_count());
}

#[test]
fn the_transactional_mode_executes_once_through_outages_and_kills() {
    let checker = check(ReplayModel {
        transactional: true,
        kills: true,
        outage: true,
        write_refused: true,
        ..ReplayModel::default()
    });
    checker.assert_no_discovery(ONE);
    eprintln!(
        "transactional, outage, kills, refused write: {} states",
        checker.unique_state_count()
    );
}

/// Documented limit: a process killed between its effect and its record.
#[test]
fn a_kill_between_effect_and_record_executes_twice() {
    use Action::*;
    let checker = check(ReplayModel {
        kills: true,
        ..ReplayModel::default()
    });
    eprintln!("kills: {} states", checker.unique_state_count());
    checker.assert_discovery(
        ONE,
        vec![
            Claim(0),
            Run(0),
            Kill(0),
            Tick,
            Tick,
            Tick,
            Claim(1),
            Run(1),
        ],
    );
}

/// Documented limit: a store outage longer than the lease.
#[test]
fn an_outage_past_the_lease_executes_twice() {
    use Action::*;
    let checker = check(ReplayModel {
        outage: true,
        ..ReplayModel::default()
    });
    eprintln!("outage: {} states", checker.unique_state_count());
    checker.assert_discovery(
        ONE,
        vec![
            Claim(0),
            Run(0),
            StoreDown,
            Tick,
            Tick,
            Tick,
            StoreUp,
            Claim(1),
            Run(1),
        ],
    );
}

/// Documented limit: a process whose clock runs slow past the renewal margin renews after its
/// lease has ended by the store's clock, and another process claims the key meanwhile.
#[test]
fn a_clock_slow_past_the_renewal_margin_executes_twice() {
    use Action::*;
    let checker = check(ReplayModel {
        slow_clock: true,
        ..ReplayModel::default()
    });
    eprintln!("slow clock: {} states", checker.unique_state_count());
    checker.assert_discovery(
        ONE,
        vec![Claim(0), Run(0), Tick, Tick, Tick, Claim(1), Run(1)],
    );
}

/// The transactional mode holds whatever the processes' clocks do: the store's clock alone
/// ends a lease, and a late owner's commit is refused by its fencing token.
#[test]
fn the_transactional_mode_executes_once_with_a_slow_clock_and_kills() {
    let checker = check(ReplayModel {
        transactional: true,
        kills: true,
        slow_clock: true,
        ..ReplayModel::default()
    });
    checker.assert_no_discovery(ONE);
    eprintln!(
        "transactional, slow clock, kills: {} states",
        checker.unique_state_count()
    );
}

/// Documented limit: a store restarted empty (Redis without persistence).
#[test]
fn a_store_restarted_empty_executes_twice() {
    use Action::*;
    let checker = check(ReplayModel {
        restart_empty: true,
        ..ReplayModel::default()
    });
    eprintln!("restart empty: {} states", checker.unique_state_count());
    checker.assert_discovery(
        ONE,
        vec![Claim(0), Run(0), StoreRestartsEmpty, Claim(1), Run(1)],
    );
}

/// Documented limit: a store that refuses the result when it is written.
#[test]
fn a_refused_result_write_executes_twice() {
    use Action::*;
    let checker = check(ReplayModel {
        write_refused: true,
        ..ReplayModel::default()
    });
    eprintln!("refused write: {} states", checker.unique_state_count());
    checker.assert_discovery(
        ONE,
        vec![
            Claim(0),
            Run(0),
            RefuseWrite(0),
            Tick,
            Tick,
            Tick,
            Claim(1),
            Run(1),
        ],
    );
}

/// The model's store is the real one: every sequence of store operations by two owners and the
/// clock, to depth 5, gives the same answers from `MemoryStore` (through `ReplayStore`, on the
/// paused clock, a tick a second) as from [`store_step`].
#[tokio::test(start_paused = true)]
async fn the_model_store_agrees_with_the_memory_store() {
    #[derive(Clone, Copy, Debug)]
    enum Op {
        Claim(usize),
        Renew(usize),
        Complete(usize),
        Release(usize),
        Tick,
    }
    let alphabet = [
        Op::Claim(0),
        Op::Claim(1),
        Op::Renew(0),
        Op::Renew(1),
        Op::Complete(0),
        Op::Complete(1),
        Op::Release(0),
        Op::Release(1),
        Op::Tick,
    ];
    let tick = Duration::from_secs(1);
    let lease = tick * u32::from(LEASE);
    let response = StoredResponse {
        status: 201,
        headers: vec![],
        body: bytes::Bytes::from_static(b"{}"),
        body_omitted: None,
    };
    let depth = 5;
    let mut sequences = 0;
    for n in 0..alphabet.len().pow(depth) {
        let ops: Vec<Op> = (0..depth)
            .map(|d| alphabet[n / alphabet.len().pow(d) % alphabet.len()])
            .collect();
        let store = MemoryStore::default();
        let key = "0123456789abcdef:model";
        let (mut slot, mut next, mut now) = (Slot::Free, 1u8, 0u8);
        // Each owner's last token, in the model's numbering and the store's.
        let mut tokens: [Option<(u8, u64)>; 2] = [None, None];
        for op in &ops {
            let (model_op, real) = match *op {
                Op::Tick => {
                    tokio::time::advance(tick).await;
                    now += 1;
                    continue;
                }
                Op::Claim(_) => (StoreOp::Claim, None),
                Op::Renew(o) | Op::Complete(o) | Op::Release(o) => {
                    let Some((m, r)) = tokens[o] else { continue };
                    let model_op = match *op {
                        Op::Renew(_) => StoreOp::Renew(m),
                        Op::Complete(_) => StoreOp::Complete(m),
                        _ => StoreOp::Release(m),
                    };
                    (model_op, Some(r))
                }
            };
            let (s2, n2, expected) = store_step(slot, next, now, model_op);
            let got = match (*op, real) {
                (Op::Claim(o), _) => match store.claim(key, [0; 32], lease).await.unwrap() {
                    Claim::Claimed { token } => {
                        let Answer::Claimed(m) = expected else {
                            panic!("{ops:?}: the store claimed, the model says {expected:?}")
                        };
                        tokens[o] = Some((m, token));
                        Answer::Claimed(m)
                    }
                    Claim::InFlight { .. } => Answer::InFlight,
                    Claim::Done { .. } => Answer::Done,
                },
                (Op::Renew(_), Some(t)) => Answer::Held(store.renew(key, t, lease).await.unwrap()),
                (Op::Complete(_), Some(t)) => {
                    Answer::Held(store.complete(key, t, &response, lease * 10).await.unwrap())
                }
                (Op::Release(_), Some(t)) => Answer::Held(store.release(key, t).await.unwrap()),
                _ => unreachable!(),
            };
            assert_eq!(got, expected, "{ops:?}, at {op:?}");
            (slot, next) = (s2, n2);
        }
        sequences += 1;
    }
    assert_eq!(sequences, alphabet.len().pow(depth));
}
