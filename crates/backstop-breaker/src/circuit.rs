//! One dependency's circuit and the state machine over it: admission (closed, open, half-open
//! with its trial slots, isolated), what each finished call records, and the transitions those
//! records make, told to the fleet when there is one.

use crate::BreakerConfig;
use crate::slots::TrialSlots;
use backstop_core::{CircuitOpen, CircuitState, Dependency};
use backstop_state::{Registry, SlidingCount};
use std::{
    sync::{
        Arc, Mutex,
        atomic::{AtomicU8, AtomicU32, AtomicU64, Ordering},
    },
    time::Duration,
};
use tokio::time::Instant;

const CLOSED: u8 = 0;
const OPEN: u8 = 1;
const HALF_OPEN: u8 = 2;
const ISOLATED: u8 = 3;

fn state_from_u8(v: u8) -> CircuitState {
    match v {
        CLOSED => CircuitState::Closed,
        OPEN => CircuitState::Open,
        HALF_OPEN => CircuitState::HalfOpen,
        _ => CircuitState::Isolated,
    }
}

/// A change of a circuit's state, as reported to the `on_transition` hook.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct CircuitTransition {
    /// The dependency.
    pub dependency: Dependency,
    /// The state before.
    pub from: CircuitState,
    /// The state after.
    pub to: CircuitState,
    /// How long it stays open, for a transition to [`CircuitState::Open`].
    pub cooldown: Option<Duration>,
}

/// What a circuit has counted.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct CircuitStats {
    /// The state.
    pub state: CircuitState,
    /// Calls counted in the failure-ratio window (0 when the ratio rule is off).
    pub calls: u64,
    /// Failures counted in the window.
    pub failures: u64,
    /// Failures in a row.
    pub consecutive_failures: u32,
    /// Time until the next trial call, while open.
    pub retry_in: Option<Duration>,
}

/// What a finished call tells the circuit.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Signal {
    Success,
    Failure,
    /// Not sent, or cancelled: counts for nothing.
    Ignore,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Kind {
    Normal,
    Trial,
}

/// What a breaker shares its circuits through (the fleet, feature `fleet`): told of this
/// process's own transitions, and asked before a circuit whose cooldown is over lets trials
/// through.
pub(crate) trait Shared: Send + Sync {
    /// A transition this process made itself, with the calls that backed it (the failures in a
    /// row, or the calls in the ratio window, that tripped it; 1 for a trial).
    fn local(&self, transition: &CircuitTransition, calls: u64);
    /// Whether this process may send `dependency`'s trial calls now.
    fn may_trial(&self, dependency: &Dependency) -> bool;
}

/// Who moved a circuit.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Source {
    /// This process: its own calls, an operator, a cooldown's end.
    Local,
    /// The fleet: another process's report.
    #[cfg_attr(not(feature = "fleet"), allow(dead_code))]
    Fleet,
}

/// One dependency's circuit.
pub(crate) struct Circuit {
    pub(crate) dependency: Dependency,
    state: AtomicU8,
    /// Bumped on every transition; a permit from an older generation no longer counts.
    generation: AtomicU64,
    /// Milliseconds since the breaker's origin.
    open_until: AtomicU64,
    consecutive: AtomicU32,
    calls: Option<SlidingCount>,
    failures: Option<SlidingCount>,
    /// The trial slots left, tagged with the generation they belong to.
    trials: TrialSlots,
    /// Opens in a row without a successful trial, for the growing cooldown.
    opens: AtomicU32,
    /// The calls behind the last trip (failures in a row, or calls in the window).
    tripped_on: AtomicU64,
    transition: Mutex<()>,
}

pub(crate) struct Inner {
    pub(crate) config: BreakerConfig,
    pub(crate) circuits: Registry<Circuit>,
    origin: Instant,
    /// The fleet this breaker shares its circuits with, once it joined one.
    pub(crate) shared: std::sync::OnceLock<Arc<dyn Shared>>,
}

impl Inner {
    /// A breaker's state with `config` (validated by the caller).
    pub(crate) fn new(config: BreakerConfig) -> Inner {
        let ratio = config.failure_ratio.is_some();
        let window = config.window;
        let circuits = Registry::new(config.max_dependencies, move |dep: &Dependency| Circuit {
            dependency: dep.clone(),
            state: AtomicU8::new(CLOSED),
            generation: AtomicU64::new(0),
            open_until: AtomicU64::new(0),
            consecutive: AtomicU32::new(0),
            calls: ratio.then(|| SlidingCount::new(window, 10)),
            failures: ratio.then(|| SlidingCount::new(window, 10)),
            trials: TrialSlots::new(),
            opens: AtomicU32::new(0),
            tripped_on: AtomicU64::new(0),
            transition: Mutex::new(()),
        })
        // At the bound, only a closed circuit with no failures in a row makes room: an open,
        // half-open or isolated circuit, or one that is failing, is never forgotten.
        .evict_when(|c: &Circuit| {
            c.state.load(Ordering::Acquire) == CLOSED && c.consecutive.load(Ordering::Acquire) == 0
        });
        Inner {
            config,
            circuits,
            origin: Instant::now(),
            shared: std::sync::OnceLock::new(),
        }
    }

    /// What `dependency`'s circuit has counted.
    pub(crate) fn stats(&self, dependency: &Dependency) -> CircuitStats {
        let Some(c) = self.circuits.tracked(dependency) else {
            return CircuitStats {
                state: CircuitState::Closed,
                calls: 0,
                failures: 0,
                consecutive_failures: 0,
                retry_in: None,
            };
        };
        let now = Instant::now();
        let state = state_from_u8(c.state.load(Ordering::Acquire));
        CircuitStats {
            state,
            calls: c.calls.as_ref().map_or(0, |w| w.sum(now)),
            failures: c.failures.as_ref().map_or(0, |w| w.sum(now)),
            consecutive_failures: c.consecutive.load(Ordering::Acquire),
            retry_in: (state == CircuitState::Open).then(|| {
                let until = c.open_until.load(Ordering::Acquire);
                Duration::from_millis(until.saturating_sub(self.now_ms()))
            }),
        }
    }

    /// Opens `dependency`'s circuit until [`reset`](Self::reset).
    pub(crate) fn isolate(&self, dependency: &Dependency) {
        let c = self.circuits.get(dependency);
        self.transition(&c, None, ISOLATED, None);
    }

    /// Closes `dependency`'s circuit and forgets its failures.
    pub(crate) fn reset(&self, dependency: &Dependency) {
        if let Some(c) = self.circuits.tracked(dependency) {
            self.transition(&c, None, CLOSED, None);
        }
    }

    fn now_ms(&self) -> u64 {
        u64::try_from(
            Instant::now()
                .saturating_duration_since(self.origin)
                .as_millis(),
        )
        .unwrap_or(u64::MAX)
    }

    /// Admits one call through `circuit`, or says why not.
    pub(crate) fn admit(
        &self,
        circuit: &Circuit,
        dependency: &Dependency,
    ) -> Result<(Kind, u64), CircuitOpen> {
        loop {
            match circuit.state.load(Ordering::Acquire) {
                CLOSED => {
                    let generation = circuit.generation.load(Ordering::Acquire);
                    return Ok((Kind::Normal, generation));
                }
                OPEN => {
                    let generation = circuit.generation.load(Ordering::Acquire);
                    let now = self.now_ms();
                    let until = circuit.open_until.load(Ordering::Acquire);
                    if now < until {
                        return Err(CircuitOpen::new(
                            dependency.clone(),
                            CircuitState::Open,
                            Some(Duration::from_millis(until - now)),
                        ));
                    }
                    // In a fleet, one process sends the trials for all of them.
                    if let Some(shared) = self.shared.get()
                        && !shared.may_trial(dependency)
                    {
                        return Err(CircuitOpen::new(
                            dependency.clone(),
                            CircuitState::Open,
                            None,
                        ));
                    }
                    // The cooldown is over: let trials through (unless the circuit changed since).
                    self.transition(circuit, Some(OPEN), HALF_OPEN, Some(generation));
                }
                HALF_OPEN => {
                    let generation = circuit.generation.load(Ordering::Acquire);
                    if circuit.trials.take(generation) {
                        return Ok((Kind::Trial, generation));
                    }
                    if circuit.generation.load(Ordering::Acquire) != generation {
                        // The circuit moved on between the two reads: look again.
                        continue;
                    }
                    return Err(CircuitOpen::new(
                        dependency.clone(),
                        CircuitState::HalfOpen,
                        None,
                    ));
                }
                _ => {
                    return Err(CircuitOpen::new(
                        dependency.clone(),
                        CircuitState::Isolated,
                        None,
                    ));
                }
            }
        }
    }

    /// Records how a call ended, at `now` (the permit reads the clock when the call ends).
    pub(crate) fn record(
        &self,
        c: &Circuit,
        kind: Kind,
        generation: u64,
        signal: Signal,
        now: Instant,
    ) {
        let current = c.generation.load(Ordering::Acquire) == generation;
        match (kind, signal) {
            (Kind::Trial, Signal::Ignore) => {
                // Back into the generation it came from only: a slot of an earlier half-open
                // period never tops up a later one.
                c.trials.give_back(generation);
            }
            (Kind::Normal, Signal::Ignore) => {}
            (Kind::Trial, Signal::Success) => {
                if current {
                    self.transition(c, Some(HALF_OPEN), CLOSED, Some(generation));
                }
            }
            (Kind::Trial, Signal::Failure) => {
                if current {
                    self.transition(c, Some(HALF_OPEN), OPEN, Some(generation));
                }
            }
            (Kind::Normal, Signal::Success) => {
                if !current {
                    return;
                }
                if c.consecutive.load(Ordering::Relaxed) != 0 {
                    c.consecutive.store(0, Ordering::Release);
                }
                if let Some(calls) = &c.calls {
                    calls.add(now, 1);
                }
            }
            (Kind::Normal, Signal::Failure) => {
                if !current {
                    return;
                }
                let run = c.consecutive.fetch_add(1, Ordering::AcqRel) + 1;
                let cfg = &self.config;
                let mut trip = cfg.consecutive_failures.is_some_and(|n| run >= n);
                let mut backing = u64::from(run);
                if let (Some(calls), Some(failures), Some(ratio)) =
                    (&c.calls, &c.failures, cfg.failure_ratio)
                {
                    let now = Instant::now();
                    calls.add(now, 1);
                    failures.add(now, 1);
                    let n = calls.sum(now);
                    if n >= u64::from(cfg.minimum_calls)
                        && failures.sum(now) as f64 >= ratio * n as f64
                    {
                        trip = true;
                        backing = backing.max(n);
                    }
                }
                if trip {
                    c.tripped_on.store(backing, Ordering::Release);
                    self.transition(c, Some(CLOSED), OPEN, Some(generation));
                }
            }
        }
    }

    /// Moves `c` to `to` if it is in `from` (any state when `None`) and, when given, still in
    /// `generation`. Serialised per circuit; never held across an `.await`.
    fn transition(&self, c: &Circuit, from: Option<u8>, to: u8, generation: Option<u64>) {
        self.transition_as(c, from, to, generation, Source::Local, None);
    }

    #[cfg(feature = "fleet")]
    /// Opens `dependency`'s circuit, if it is closed, for `cooldown`: the fleet's quorum saw
    /// it fail. Not reported back to the fleet.
    pub(crate) fn open_by_fleet(&self, dependency: &Dependency, cooldown: Duration) -> bool {
        let c = self.circuits.get(dependency);
        self.transition_as(&c, Some(CLOSED), OPEN, None, Source::Fleet, Some(cooldown))
    }

    #[cfg(feature = "fleet")]
    /// Closes `dependency`'s circuit, if it is open or half-open: another process's trial
    /// succeeded. An isolated circuit stays isolated.
    pub(crate) fn close_by_fleet(&self, dependency: &Dependency) -> bool {
        let Some(c) = self.circuits.tracked(dependency) else {
            return false;
        };
        let closed = self.transition_as(&c, Some(OPEN), CLOSED, None, Source::Fleet, None);
        closed || self.transition_as(&c, Some(HALF_OPEN), CLOSED, None, Source::Fleet, None)
    }

    /// [`transition`](Self::transition), by `source`, with `cooldown` instead of the grown one
    /// when given. `true` when it moved.
    fn transition_as(
        &self,
        c: &Circuit,
        from: Option<u8>,
        to: u8,
        generation: Option<u64>,
        source: Source,
        cooldown_given: Option<Duration>,
    ) -> bool {
        let guard = c.transition.lock().unwrap_or_else(|p| p.into_inner());
        let was = c.state.load(Ordering::Acquire);
        if from.is_some_and(|f| f != was)
            || generation.is_some_and(|g| g != c.generation.load(Ordering::Acquire))
        {
            return false;
        }
        let mut cooldown = None;
        match to {
            OPEN => {
                let opens = c.opens.fetch_add(1, Ordering::AcqRel);
                let grown = cooldown_given.unwrap_or_else(|| match self.config.max_cooldown {
                    Some(max) => self
                        .config
                        .cooldown
                        .saturating_mul(2u32.saturating_pow(opens.min(31)))
                        .min(max),
                    None => self.config.cooldown,
                });
                let until = self
                    .now_ms()
                    .saturating_add(u64::try_from(grown.as_millis()).unwrap_or(u64::MAX));
                c.open_until.store(until, Ordering::Release);
                cooldown = Some(grown);
            }
            HALF_OPEN => {
                // Tagged with the generation this transition starts.
                let next = c.generation.load(Ordering::Acquire).wrapping_add(1);
                c.trials.open(next, self.config.trial_calls);
            }
            CLOSED => {
                c.opens.store(0, Ordering::Release);
            }
            _ => {}
        }
        // A new state starts with clean counts.
        c.consecutive.store(0, Ordering::Release);
        if let Some(w) = &c.calls {
            w.reset();
        }
        if let Some(w) = &c.failures {
            w.reset();
        }
        c.generation.fetch_add(1, Ordering::AcqRel);
        c.state.store(to, Ordering::Release);
        drop(guard);

        let t = CircuitTransition {
            dependency: c.dependency.clone(),
            from: state_from_u8(was),
            to: state_from_u8(to),
            cooldown,
        };
        match t.to {
            CircuitState::Open | CircuitState::Isolated => tracing::warn!(
                target: "backstop::breaker",
                dependency = %t.dependency,
                from = t.from.as_str(),
                to = t.to.as_str(),
                cooldown_ms = cooldown.map(|d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX)),
                "circuit state changed"
            ),
            _ => tracing::info!(
                target: "backstop::breaker",
                dependency = %t.dependency,
                from = t.from.as_str(),
                to = t.to.as_str(),
                "circuit state changed"
            ),
        }
        #[cfg(feature = "metrics")]
        metrics::counter!(
            "backstop_breaker_transitions_total",
            "dependency" => metrics::SharedString::from(t.dependency.metric_label()),
            "from" => t.from.as_str(),
            "to" => t.to.as_str()
        )
        .increment(1);
        if let Some(hook) = &self.config.on_transition {
            hook(&t);
        }
        if source == Source::Local
            && let Some(shared) = self.shared.get()
        {
            let calls = match (was, to) {
                (CLOSED, OPEN) => c.tripped_on.load(Ordering::Acquire),
                _ => 1,
            };
            shared.local(&t, calls);
        }
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Breaker;

    /// A caller reads the generation of one half-open period, is paused for longer than a
    /// cooldown, and only then takes its trial slot: by then the trial failed, the circuit
    /// opened and went half-open again. The late caller must not take the new period's slot
    /// (its permit would carry the old generation, the slot would never come back, and with one
    /// trial the circuit would stay half-open for good).
    #[tokio::test(start_paused = true)]
    async fn a_caller_paused_between_reading_the_generation_and_taking_a_slot_takes_none() {
        let cfg = BreakerConfig::default()
            .consecutive_failures(1)
            .cooldown(Duration::from_secs(1));
        let breaker = Breaker::new(cfg).unwrap();
        let inner = &breaker.inner;
        let dep = Dependency::new("carrier-api");
        let circuit = inner.circuits.get(&dep);
        // Open, then half-open after the cooldown.
        let (kind, g) = inner.admit(&circuit, &dep).unwrap();
        inner.record(&circuit, kind, g, Signal::Failure, Instant::now());
        tokio::time::advance(Duration::from_secs(2)).await;
        let (kind, trial_gen) = inner.admit(&circuit, &dep).unwrap();
        assert_eq!(kind, Kind::Trial);
        // The late caller read the generation now...
        let late_gen = circuit.generation.load(Ordering::Acquire);
        // ... the trial fails, the cooldown passes, the circuit is half-open again.
        inner.record(
            &circuit,
            Kind::Trial,
            trial_gen,
            Signal::Failure,
            Instant::now(),
        );
        tokio::time::advance(Duration::from_secs(10)).await;
        assert!(
            inner.admit(&circuit, &dep).is_ok(),
            "the new period's trial"
        );
        let (_, new_gen) = {
            // Give that trial's slot back (cancelled), so one slot is free again.
            let g = circuit.generation.load(Ordering::Acquire);
            inner.record(&circuit, Kind::Trial, g, Signal::Ignore, Instant::now());
            (Kind::Trial, g)
        };
        assert_ne!(late_gen, new_gen);
        // The paused caller wakes up: no slot for it in a period it did not read.
        assert!(!circuit.trials.take(late_gen));
        assert_eq!(circuit.trials.left(new_gen), 1);
        // The new period's slot is still there for a caller of that period.
        assert!(circuit.trials.take(new_gen));
    }
}
