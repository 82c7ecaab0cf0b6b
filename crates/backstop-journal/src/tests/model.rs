//! The journal's run claim as a model, checked with `stateright`: two workers and one run of a
//! one-step workflow, a clock in ticks, leases renewed on time, an operator who may cancel, and
//! the faults a fleet meets: a worker killed at any step, a worker paused past its lease (a long
//! GC pause, a suspended VM) that then carries on. Properties: **the run is finished by one
//! worker**, never by one whose claim another live worker has taken; **the step's effect happens once** (a step found `sent` is reconciled, not sent
//! again); **a cancelled run sends nothing after its worker's next renewal**.
//!
//! The run's transitions ([`claim`], [`renew`], [`finish`], [`cancel`]) are the journal's SQL
//! guards; `the_model_claim_agrees_with_the_sqlite_journal` drives every sequence of two
//! workers' claims, renewals and finishes, an operator's cancel and clock ticks to depth 4
//! through the real journal (SQLite, a clock of the test's) and through the model, and compares
//! each answer.

use crate::{Journal, RunState, run::RunOutcome};
use stateright::{Checker, Model, Property};
use std::sync::{
    Arc,
    atomic::{AtomicI64, Ordering},
};

/// A lease, in clock ticks.
const LEASE: u8 = 2;
const HORIZON: u8 = 2 * LEASE + 2;
const WORKERS: usize = 2;

/// The run's row: its state and its claim.
#[derive(Clone, Copy, Debug, Hash, PartialEq, Eq)]
struct Run {
    state: Phase,
    claimed_by: Option<u8>,
    claim_until: u8,
}

#[derive(Clone, Copy, Debug, Hash, PartialEq, Eq)]
enum Phase {
    Pending,
    Succeeded,
    Cancelled,
}

/// `claim_next`: a pending run with no live claim (a lease that ran out is free).
fn claim(run: &mut Run, worker: u8, now: u8) -> bool {
    let free = run.claimed_by.is_none() || run.claim_until < now;
    if run.state == Phase::Pending && free {
        run.claimed_by = Some(worker);
        run.claim_until = now + LEASE;
        true
    } else {
        false
    }
}

/// `renew`: only the holder, and only while the run is pending.
fn renew(run: &mut Run, worker: u8, now: u8) -> bool {
    if run.state == Phase::Pending && run.claimed_by == Some(worker) {
        run.claim_until = now + LEASE;
        true
    } else {
        false
    }
}

/// `finish_run`: a pending run, by its holder or by anyone when nobody holds it; the claim goes.
fn finish(run: &mut Run, worker: u8) -> bool {
    let holder = run.claimed_by.is_none_or(|w| w == worker);
    if run.state == Phase::Pending && holder {
        run.state = Phase::Succeeded;
        run.claimed_by = None;
        true
    } else {
        false
    }
}

/// `cancel_run`: a pending run; the claim stays, so its holder learns at its next renewal.
fn cancel(run: &mut Run) -> bool {
    if run.state == Phase::Pending {
        run.state = Phase::Cancelled;
        true
    } else {
        false
    }
}

/// The step's journal state.
#[derive(Clone, Copy, Debug, Hash, PartialEq, Eq)]
enum Step {
    Pending,
    /// Sent, its answer not recorded.
    Sent,
    Succeeded,
}

#[derive(Clone, Copy, Debug, Hash, PartialEq, Eq)]
enum Worker {
    Idle,
    /// Runs the workflow (it believes it holds the run).
    Running,
    /// Its step's request is out.
    Waiting,
    /// It stopped (a renewal refused, or the run finished).
    Stopped,
    Killed,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq)]
struct State {
    now: u8,
    run: Run,
    step: Step,
    workers: [Worker; WORKERS],
    /// Whether each worker renewed since the run was cancelled.
    renewed_since_cancel: [bool; WORKERS],
    effects: u8,
    finished: u8,
    /// A run finished while another live worker held its claim.
    finished_under_holder: bool,
    sent_after_cancel_renewal: bool,
    pause_used: bool,
}

#[derive(Clone, Copy, Debug, Hash, PartialEq, Eq)]
enum Action {
    Claim(usize),
    Renew(usize),
    /// The workflow's step: sent if pending, reconciled if found sent, skipped if done.
    Step(usize),
    /// The step's answer comes back and is recorded.
    Answer(usize),
    Finish(usize),
    Cancel,
    Kill(usize),
    /// Time passes a worker's lease while it is paused; it carries on afterwards.
    PausePastLease,
    Tick,
}

#[derive(Clone, Debug, Default)]
struct ClaimModel {
    kills: bool,
    pauses: bool,
    cancels: bool,
}

impl ClaimModel {
    /// Workers holding a live claim renew on time: the clock passes a lease's end only for a
    /// worker that is dead or paused.
    fn may_tick(&self, s: &State) -> bool {
        s.now < HORIZON
            && s.workers.iter().enumerate().all(|(w, st)| {
                !matches!(st, Worker::Running | Worker::Waiting)
                    || s.run.claimed_by != Some(w as u8)
                    || s.run.claim_until > s.now
            })
    }
}

impl Model for ClaimModel {
    type State = State;
    type Action = Action;

    fn init_states(&self) -> Vec<State> {
        vec![State {
            now: 0,
            run: Run {
                state: Phase::Pending,
                claimed_by: None,
                claim_until: 0,
            },
            step: Step::Pending,
            workers: [Worker::Idle; WORKERS],
            renewed_since_cancel: [false; WORKERS],
            effects: 0,
            finished: 0,
            finished_under_holder: false,
            sent_after_cancel_renewal: false,
            pause_used: false,
        }]
    }

    fn actions(&self, s: &State, actions: &mut Vec<Action>) {
        for (w, st) in s.workers.iter().enumerate() {
            match st {
                Worker::Idle => actions.push(Action::Claim(w)),
                Worker::Running => {
                    actions.push(Action::Renew(w));
                    if s.step == Step::Succeeded {
                        actions.push(Action::Finish(w));
                    } else {
                        actions.push(Action::Step(w));
                    }
                }
                Worker::Waiting => {
                    actions.push(Action::Renew(w));
                    actions.push(Action::Answer(w));
                }
                _ => {}
            }
            if self.kills && matches!(st, Worker::Running | Worker::Waiting) {
                actions.push(Action::Kill(w));
            }
        }
        if self.cancels && s.run.state == Phase::Pending {
            actions.push(Action::Cancel);
        }
        if self.pauses && !s.pause_used && s.run.claimed_by.is_some() {
            actions.push(Action::PausePastLease);
        }
        if self.may_tick(s) {
            actions.push(Action::Tick);
        }
    }

    fn next_state(&self, last: &State, action: Action) -> Option<State> {
        let mut s = last.clone();
        match action {
            Action::Claim(w) => {
                if !claim(&mut s.run, w as u8, s.now) {
                    return None;
                }
                s.workers[w] = Worker::Running;
            }
            Action::Renew(w) => {
                if s.run.state == Phase::Cancelled {
                    s.renewed_since_cancel[w] = true;
                }
                if !renew(&mut s.run, w as u8, s.now) {
                    // The worker stops running the run.
                    s.workers[w] = Worker::Stopped;
                }
            }
            Action::Step(w) => {
                if s.run.state == Phase::Cancelled && s.renewed_since_cancel[w] {
                    s.sent_after_cancel_renewal = true;
                }
                match s.step {
                    Step::Pending => {
                        // pending -> sent, guarded: one worker moves it; the request goes out.
                        s.step = Step::Sent;
                        s.effects += 1;
                        s.workers[w] = Worker::Waiting;
                    }
                    // Found sent by a worker that is gone: reconciled with the dependency,
                    // which tells the effect happened (the request carried the step's key).
                    Step::Sent => s.step = Step::Succeeded,
                    Step::Succeeded => {}
                }
            }
            Action::Answer(w) => {
                if s.step == Step::Sent {
                    s.step = Step::Succeeded;
                }
                s.workers[w] = Worker::Running;
            }
            Action::Finish(w) => {
                let holder = s.run.claimed_by.map(usize::from);
                if finish(&mut s.run, w as u8) {
                    s.finished += 1;
                    s.finished_under_holder |= holder.is_some_and(|h| {
                        h != w && matches!(s.workers[h], Worker::Running | Worker::Waiting)
                    });
                }
                s.workers[w] = Worker::Stopped;
            }
            Action::Cancel => {
                cancel(&mut s.run);
            }
            Action::Kill(w) => s.workers[w] = Worker::Killed,
            Action::PausePastLease => {
                s.pause_used = true;
                s.now = s.now.max(s.run.claim_until + 1);
                if s.now > HORIZON {
                    return None;
                }
            }
            Action::Tick => s.now += 1,
        }
        Some(s)
    }

    fn properties(&self) -> Vec<Property<Self>> {
        vec![
            Property::always("finished by one worker", |_, s: &State| {
                s.finished <= 1 && !s.finished_under_holder
            }),
            Property::always("the step's effect once", |_, s: &State| s.effects <= 1),
            Property::always(
                "nothing sent after a cancelled run's renewal",
                |_, s: &State| !s.sent_after_cancel_renewal,
            ),
            Property::sometimes("the run finishes", |_, s: &State| {
                s.run.state == Phase::Succeeded
            }),
        ]
    }
}

#[test]
fn the_run_claim_holds_through_kills_pauses_and_cancels() {
    let checker = ClaimModel {
        kills: true,
        pauses: true,
        cancels: true,
    }
    .checker()
    .spawn_bfs()
    .join();
    eprintln!(
        "run claim, kills, pauses, cancels: {} states",
        checker.unique_state_count()
    );
    checker.assert_no_discovery("finished by one worker");
    checker.assert_no_discovery("the step's effect once");
    checker.assert_no_discovery("nothing sent after a cancelled run's renewal");
    checker.assert_any_discovery("the run finishes");
}

/// The model's run row is the journal's: every sequence of two workers' claims, renewals and
/// finishes, an operator's cancel and clock ticks, to depth 4, answers the same from the SQLite
/// journal (its clock the test's: a tick is a second) as from the model.
#[tokio::test]
async fn the_model_claim_agrees_with_the_sqlite_journal() {
    #[derive(Clone, Copy, Debug)]
    enum Op {
        Claim(u8),
        Renew(u8),
        Finish(u8),
        Cancel,
        Tick,
    }
    let alphabet = [
        Op::Claim(0),
        Op::Claim(1),
        Op::Renew(0),
        Op::Renew(1),
        Op::Finish(0),
        Op::Finish(1),
        Op::Cancel,
        Op::Tick,
    ];
    let lease = std::time::Duration::from_secs(u64::from(LEASE));
    let depth = 4;
    let clock = Arc::new(AtomicI64::new(0));
    let reading = Arc::clone(&clock);
    let journal = Journal::in_memory()
        .await
        .unwrap()
        .with_clock(Arc::new(move || {
            chrono::DateTime::from_timestamp_millis(reading.load(Ordering::SeqCst)).unwrap()
        }));
    for n in 0..alphabet.len().pow(depth) {
        let ops: Vec<Op> = (0..depth)
            .map(|d| alphabet[n / alphabet.len().pow(d) % alphabet.len()])
            .collect();
        // A run of its own for each sequence, started at t=0 on a clock of its own.
        let id = format!("run-{n}");
        clock.store(0, Ordering::SeqCst);
        journal.start_run(&id, "invoice", None).await.unwrap();
        let mut model = Run {
            state: Phase::Pending,
            claimed_by: None,
            claim_until: 0,
        };
        let mut now = 0u8;
        for op in &ops {
            let worker = |w: u8| format!("worker-{w}");
            let (expected, got) = match *op {
                Op::Tick => {
                    now += 1;
                    clock.store(i64::from(now) * 1000, Ordering::SeqCst);
                    continue;
                }
                Op::Claim(w) => {
                    let claimed = journal
                        .claim_next(&worker(w), lease, &["invoice"])
                        .await
                        .unwrap();
                    // Earlier sequences' runs are over or cancelled, or claimed at another
                    // time: the one claimable run is this one.
                    (
                        claim(&mut model, w, now),
                        claimed.as_deref() == Some(id.as_str()),
                    )
                }
                Op::Renew(w) => (
                    renew(&mut model, w, now),
                    journal.renew(&id, &worker(w), lease).await.unwrap(),
                ),
                Op::Finish(w) => (
                    finish(&mut model, w),
                    journal
                        .finish_run(&id, &worker(w), RunOutcome::Succeeded { output: None })
                        .await
                        .is_ok(),
                ),
                Op::Cancel => (
                    cancel(&mut model),
                    journal
                        .operator()
                        .cancel(&id, "operator", "model")
                        .await
                        .is_ok(),
                ),
            };
            assert_eq!(got, expected, "{ops:?}, at {op:?}");
        }
        // Out of the way of the next sequences: over, whatever this one left.
        let record = journal.runs().get(&id).await.unwrap().unwrap();
        if record.state == RunState::Pending {
            journal
                .operator()
                .cancel(&id, "operator", "next sequence")
                .await
                .unwrap();
        }
    }
}
