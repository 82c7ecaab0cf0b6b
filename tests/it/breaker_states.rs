//! The breaker's state machine, case by case as resilience4j's `CircuitBreakerStateMachineTest`
//! and Polly's circuit-state controller tests check theirs, in Backstop's words: each test names
//! the behaviour it ports and drives the breaker through its public permits (`Breaker::permit`,
//! then `Permit::record` with the call's verdict, or the permit dropped for a call that was
//! cancelled), on the paused clock.

use backstop::{
    Dependency, Outcome,
    breaker::{Breaker, BreakerConfig, CircuitState, CircuitTransition, Permit},
    classify::Verdict,
};
use std::{
    sync::{Arc, Mutex},
    time::Duration,
};

const COOLDOWN: Duration = Duration::from_secs(10);

fn dep() -> Dependency {
    Dependency::new("breaker-states-api")
}

/// The transitions a breaker made, from and to.
type Log = Arc<Mutex<Vec<(CircuitState, CircuitState)>>>;

/// A breaker with the ratio rule alone (50 % of at least 4 calls in 10 s), one trial call by
/// default, and a log of its transitions.
fn breaker(config: impl FnOnce(BreakerConfig) -> BreakerConfig) -> (Breaker, Log) {
    let log: Log = Arc::default();
    let seen = Arc::clone(&log);
    let cfg = BreakerConfig::default()
        .no_consecutive_rule()
        .failure_ratio(0.5, 4, Duration::from_secs(10))
        .cooldown(COOLDOWN)
        .on_transition(move |t: &CircuitTransition| seen.lock().unwrap().push((t.from, t.to)));
    (Breaker::new(config(cfg)).unwrap(), log)
}

fn failure() -> Verdict {
    Verdict::Retryable {
        outcome: Outcome::NotSent,
        after: None,
    }
}

/// One call through the breaker, ended with `verdict` (`None`: cancelled).
fn call(b: &Breaker, verdict: Option<Verdict>) -> Result<(), ()> {
    let permit = b.permit(&dep()).map_err(|_| ())?;
    if let Some(verdict) = verdict {
        permit.record(verdict);
    }
    Ok(())
}

fn admit(b: &Breaker) -> Option<Permit> {
    b.permit(&dep()).ok()
}

fn open_it(b: &Breaker) {
    for _ in 0..4 {
        call(b, Some(failure())).unwrap();
    }
    assert_eq!(b.state(&dep()), CircuitState::Open);
}

/// Polly: the circuit starts closed and lets calls through.
#[tokio::test(start_paused = true)]
async fn a_new_circuit_is_closed_and_lets_calls_through() {
    let (b, log) = breaker(|c| c);
    assert_eq!(b.state(&dep()), CircuitState::Closed);
    assert!(call(&b, Some(Verdict::Success)).is_ok());
    assert!(log.lock().unwrap().is_empty());
}

/// resilience4j: no transition to open before the minimum number of calls, whatever their
/// failure rate.
#[tokio::test(start_paused = true)]
async fn fewer_calls_than_the_minimum_never_open_the_circuit() {
    let (b, _) = breaker(|c| c);
    for _ in 0..3 {
        call(&b, Some(failure())).unwrap();
    }
    assert_eq!(
        b.state(&dep()),
        CircuitState::Closed,
        "3 failures of a minimum of 4"
    );
}

/// resilience4j: the failure rate at the threshold opens the circuit, below it does not.
#[tokio::test(start_paused = true)]
async fn the_failure_rate_at_its_threshold_opens_the_circuit() {
    let (below, _) = breaker(|c| c);
    for v in [
        Verdict::Success,
        Verdict::Success,
        Verdict::Success,
        failure(),
    ] {
        call(&below, Some(v)).unwrap();
    }
    assert_eq!(below.state(&dep()), CircuitState::Closed, "25 %");
    let (at, log) = breaker(|c| c);
    for v in [Verdict::Success, Verdict::Success, failure(), failure()] {
        call(&at, Some(v)).unwrap();
    }
    assert_eq!(at.state(&dep()), CircuitState::Open, "50 %");
    assert_eq!(
        *log.lock().unwrap(),
        [(CircuitState::Closed, CircuitState::Open)]
    );
}

/// resilience4j: an open circuit permits no call, and says when it lets calls through again.
#[tokio::test(start_paused = true)]
async fn an_open_circuit_permits_no_call_until_its_cooldown_ends() {
    let (b, _) = breaker(|c| c);
    open_it(&b);
    tokio::time::advance(COOLDOWN / 2).await;
    assert!(admit(&b).is_none());
    let stats = b.stats(&dep());
    assert_eq!(stats.retry_in, Some(COOLDOWN / 2));
}

/// resilience4j: open to half-open once the wait in the open state is over (on the next call).
#[tokio::test(start_paused = true)]
async fn after_the_cooldown_the_next_call_is_a_half_open_trial() {
    let (b, log) = breaker(|c| c);
    open_it(&b);
    tokio::time::advance(COOLDOWN).await;
    let trial = admit(&b).expect("the trial");
    assert_eq!(b.state(&dep()), CircuitState::HalfOpen);
    drop(trial);
    assert_eq!(
        log.lock().unwrap().last(),
        Some(&(CircuitState::Open, CircuitState::HalfOpen))
    );
}

/// resilience4j: only the configured number of calls is permitted in the half-open state.
#[tokio::test(start_paused = true)]
async fn half_open_permits_exactly_its_trial_calls() {
    let (b, _) = breaker(|c| c.trial_calls(3));
    open_it(&b);
    tokio::time::advance(COOLDOWN).await;
    let trials: Vec<Permit> = (0..3).map(|_| admit(&b).expect("a trial")).collect();
    assert!(admit(&b).is_none(), "a fourth call while three trials run");
    for t in trials {
        drop(t);
    }
}

/// resilience4j and Polly: a trial that succeeds closes the circuit, and the closed circuit
/// starts counting anew.
#[tokio::test(start_paused = true)]
async fn a_trial_that_succeeds_closes_the_circuit_with_fresh_counts() {
    let (b, log) = breaker(|c| c);
    open_it(&b);
    tokio::time::advance(COOLDOWN).await;
    call(&b, Some(Verdict::Success)).unwrap();
    assert_eq!(b.state(&dep()), CircuitState::Closed);
    let stats = b.stats(&dep());
    assert_eq!((stats.calls, stats.failures), (0, 0), "{stats:?}");
    assert_eq!(
        *log.lock().unwrap(),
        [
            (CircuitState::Closed, CircuitState::Open),
            (CircuitState::Open, CircuitState::HalfOpen),
            (CircuitState::HalfOpen, CircuitState::Closed),
        ]
    );
    // Three failures after closing are below the minimum again.
    for _ in 0..3 {
        call(&b, Some(failure())).unwrap();
    }
    assert_eq!(b.state(&dep()), CircuitState::Closed);
}

/// resilience4j and Polly: a trial that fails opens the circuit again for a whole cooldown.
#[tokio::test(start_paused = true)]
async fn a_trial_that_fails_opens_the_circuit_for_another_cooldown() {
    let (b, log) = breaker(|c| c);
    open_it(&b);
    tokio::time::advance(COOLDOWN).await;
    call(&b, Some(failure())).unwrap();
    assert_eq!(b.state(&dep()), CircuitState::Open);
    tokio::time::advance(COOLDOWN - Duration::from_millis(1)).await;
    assert!(admit(&b).is_none(), "still open");
    tokio::time::advance(Duration::from_millis(1)).await;
    assert!(admit(&b).is_some(), "the next trial");
    assert_eq!(
        log.lock().unwrap()[2..],
        [
            (CircuitState::HalfOpen, CircuitState::Open),
            (CircuitState::Open, CircuitState::HalfOpen),
        ]
    );
}

/// resilience4j ("releasePermission"), Polly (a cancelled execution in half-open): a trial
/// that ends without a verdict gives its slot back, and the circuit stays half-open.
#[tokio::test(start_paused = true)]
async fn a_cancelled_trial_gives_its_slot_back() {
    let (b, _) = breaker(|c| c);
    open_it(&b);
    tokio::time::advance(COOLDOWN).await;
    let trial = admit(&b).expect("the trial");
    assert!(admit(&b).is_none(), "one trial at a time");
    drop(trial);
    assert_eq!(b.state(&dep()), CircuitState::HalfOpen);
    assert!(admit(&b).is_some(), "the slot is back");
}

/// resilience4j: a call slower than the slow-call limit counts as a failure, even when it
/// succeeds.
#[tokio::test(start_paused = true)]
async fn slow_successes_count_as_failures() {
    let (b, _) = breaker(|c| c.slow_call(Duration::from_secs(1)));
    for _ in 0..4 {
        let permit = admit(&b).unwrap();
        tokio::time::advance(Duration::from_secs(2)).await;
        permit.record(Verdict::Success);
    }
    assert_eq!(b.state(&dep()), CircuitState::Open);
}

/// resilience4j ("transitionToForcedOpenState", "reset"), Polly (`Isolate`, `Close`): an
/// operator isolates the circuit, which refuses every call whatever time passes, and resets it
/// closed.
#[tokio::test(start_paused = true)]
async fn an_isolated_circuit_refuses_until_it_is_reset() {
    let (b, log) = breaker(|c| c);
    b.isolate(&dep());
    assert_eq!(b.state(&dep()), CircuitState::Isolated);
    tokio::time::advance(COOLDOWN * 100).await;
    assert!(admit(&b).is_none(), "isolated for good");
    b.reset(&dep());
    assert_eq!(b.state(&dep()), CircuitState::Closed);
    assert!(call(&b, Some(Verdict::Success)).is_ok());
    let log = log.lock().unwrap();
    assert_eq!(
        log.first().map(|t| t.1),
        Some(CircuitState::Isolated),
        "{log:?}"
    );
    assert_eq!(
        log.last().map(|t| t.1),
        Some(CircuitState::Closed),
        "{log:?}"
    );
}

/// Polly (the break-duration generator): with growth asked for, each failed trial doubles the
/// cooldown up to its cap; without it the cooldown stays as set.
#[tokio::test(start_paused = true)]
async fn cooldowns_grow_only_when_asked() {
    for (growth, second_cooldown) in [(None, COOLDOWN), (Some(COOLDOWN * 4), COOLDOWN * 2)] {
        let (b, _) = breaker(|c| match growth {
            Some(max) => c.cooldown_growth(max),
            None => c,
        });
        open_it(&b);
        tokio::time::advance(COOLDOWN).await;
        call(&b, Some(failure())).unwrap();
        assert_eq!(
            b.stats(&dep()).retry_in,
            Some(second_cooldown),
            "growth {growth:?}"
        );
    }
}

/// Polly: an attempt that began before the circuit opened and ends after does not close it (its
/// success belongs to the closed period it started in).
#[tokio::test(start_paused = true)]
async fn a_late_success_from_before_the_circuit_opened_does_not_close_it() {
    let (b, _) = breaker(|c| c);
    let late = admit(&b).unwrap();
    open_it(&b);
    late.record(Verdict::Success);
    assert_eq!(b.state(&dep()), CircuitState::Open);
}
