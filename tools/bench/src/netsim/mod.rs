//! The whole path simulated: agents' client stacks, the network and a replay server with its
//! store, as hosts of one deterministic `turmoil` simulation (seeded message latency, links
//! that fail, partitions, held links, a server killed and started again, a store that refuses
//! commands), and what must hold after every run checked against what actually happened.
//!
//! Three hosts: `agent` runs the workload (agents making keyed refunds, some through a stack
//! nested in another, and hedged reads, every stack spending one retry budget), `api` serves
//! Backstop's replay layer over a handler that commits refunds to a ledger kept outside the
//! simulation (the bank's books survive the server), and `store` keeps the replay entries. The
//! faults come from a schedule drawn from the seed, so a seed names one run:
//! [`run`] with one seed gives the same [`Report`] in any process, whatever ran before it
//! (the kill, which would otherwise depend on that, says how).

mod check;
mod store;
mod wire;
mod workload;

use rand::{RngExt, SeedableRng, rngs::SmallRng};
use std::{
    collections::BTreeMap,
    sync::{Arc, Mutex},
    time::Duration,
};

pub use check::Violation;

/// What a simulated run is made of.
#[derive(Clone, Debug)]
pub struct Config {
    /// Agents working at once.
    pub agents: u32,
    /// Calls each agent makes.
    pub calls: u32,
    /// The deadline of every call.
    pub deadline: Duration,
    /// The attempt timeout of the writes.
    pub attempt_timeout: Duration,
    /// The replay server's claim lease. The guarantee of one effect per key under a killed
    /// server or a failing store holds while the lease outlasts the caller's deadline: a claim
    /// left by a dead owner then expires only after every attempt of the call is over.
    pub lease: Duration,
    /// The share of store commands the store refuses.
    pub store_fail_rate: f64,
    /// The share of calls the shared budget grants as retries and hedges, over the whole run
    /// (no floor): what the checker holds the extra attempts to.
    pub budget_ratio: f64,
    /// Whether the seed's faults (partitions, holds, a killed server) are applied.
    pub faults: bool,
    /// Whether the writes carry idempotency keys (off: the checker must find duplicates).
    pub keys: bool,
}

impl Default for Config {
    fn default() -> Self {
        Config {
            agents: 3,
            calls: 8,
            deadline: Duration::from_secs(1),
            attempt_timeout: Duration::from_millis(450),
            lease: Duration::from_secs(3),
            store_fail_rate: 0.03,
            budget_ratio: 0.2,
            faults: true,
            keys: true,
        }
    }
}

/// How a logical call ended, as its caller saw it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum End {
    /// The stack returned a response with this status.
    Answered(u16),
    /// The stack returned an error.
    Failed {
        /// What the error says of the side effect.
        outcome: backstop::Outcome,
        /// The attempts it says were sent.
        attempts: u32,
        /// Its message, as a model would read it.
        message: String,
    },
}

/// One logical call of the workload.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CallRecord {
    /// Its id (`a<agent>-c<n>`).
    pub id: String,
    /// The refund it asks for (`None` for a read).
    pub action: Option<String>,
    /// Whether it went through a stack nested in another.
    pub nested: bool,
    /// How it ended.
    pub end: End,
    /// From the call to its end, in simulated time.
    pub elapsed: Duration,
}

/// What one seed's run did, and what of it broke a guarantee.
#[derive(Clone, Debug, PartialEq)]
pub struct Report {
    /// The seed.
    pub seed: u64,
    /// Every logical call, in the order they ended.
    pub calls: Vec<CallRecord>,
    /// Effects committed per refund.
    pub effects: BTreeMap<String, u32>,
    /// Attempts that reached the leaf client, per call.
    pub attempts: BTreeMap<String, u32>,
    /// The faults applied, in order, with when.
    pub faults: Vec<(Duration, String)>,
    /// What the shared budget counted: logical calls and retries granted.
    pub budget: (u64, u64),
    /// Every guarantee the run broke.
    pub violations: Vec<Violation>,
}

impl Report {
    /// Writes whose caller got a 2xx.
    pub fn writes_answered(&self) -> usize {
        self.count(|c| c.action.is_some() && matches!(c.end, End::Answered(s) if s < 300))
    }

    /// Calls that ended with an unknown outcome.
    pub fn unknown(&self) -> usize {
        self.count(|c| {
            matches!(
                c.end,
                End::Failed {
                    outcome: backstop::Outcome::Unknown,
                    ..
                }
            )
        })
    }

    /// Calls that ended not sent.
    pub fn not_sent(&self) -> usize {
        self.count(|c| {
            matches!(
                c.end,
                End::Failed {
                    outcome: backstop::Outcome::NotSent,
                    ..
                }
            )
        })
    }

    /// Attempts beyond the first of each call, at the leaf.
    pub fn extra_attempts(&self) -> u64 {
        self.attempts
            .values()
            .map(|&n| u64::from(n.saturating_sub(1)))
            .sum()
    }

    fn count(&self, f: impl Fn(&CallRecord) -> bool) -> usize {
        self.calls.iter().filter(|c| f(c)).count()
    }
}

/// What the hosts share: the ledger (outside the simulation, as a bank's books are), the
/// attempts the leaf client saw, the calls as their callers saw them, and the server's RNG.
pub(crate) struct World {
    server_rng: Mutex<SmallRng>,
    ledger: Mutex<BTreeMap<String, u32>>,
    attempts: Mutex<BTreeMap<String, u32>>,
    calls: Mutex<Vec<CallRecord>>,
    budget: Mutex<(u64, u64)>,
}

impl World {
    fn new(seed: u64) -> Self {
        World {
            server_rng: Mutex::new(SmallRng::seed_from_u64(seed ^ 0x5eed)),
            ledger: Mutex::default(),
            attempts: Mutex::default(),
            calls: Mutex::default(),
            budget: Mutex::default(),
        }
    }

    pub(crate) fn commit(&self, action: &str) {
        *self
            .ledger
            .lock()
            .unwrap()
            .entry(action.to_owned())
            .or_default() += 1;
    }

    pub(crate) fn attempted(&self, call: &str) {
        *self
            .attempts
            .lock()
            .unwrap()
            .entry(call.to_owned())
            .or_default() += 1;
    }

    pub(crate) fn ended(&self, call: CallRecord) {
        self.calls.lock().unwrap().push(call);
    }
}

/// One fault of the schedule.
#[derive(Clone, Copy, Debug)]
enum Fault {
    /// The agent and the server cannot reach each other for a while.
    PartitionClient(Duration),
    /// The server cannot reach its store for a while.
    PartitionStore(Duration),
    /// Messages between the agent and the server are held, then delivered at once.
    Hold(Duration),
    /// The server is killed (every task dropped, nothing more sent: [`kill`]) and started again
    /// after a while.
    Kill(Duration),
}

impl Fault {
    /// Applies the fault, with the faults still in force beside it; returns how long it lasts.
    fn start(self, sim: &mut turmoil::Sim<'_>, active: &[Fault]) -> Duration {
        match self {
            Fault::PartitionClient(d) => {
                sim.partition("agent", wire::API.0);
                d
            }
            Fault::PartitionStore(d) => {
                sim.partition(wire::API.0, store::STORE.0);
                d
            }
            Fault::Hold(d) => {
                sim.hold("agent", wire::API.0);
                d
            }
            Fault::Kill(d) => {
                kill(sim, active);
                d
            }
        }
    }

    /// Ends the fault; says how.
    fn end(self, sim: &mut turmoil::Sim<'_>) -> &'static str {
        match self {
            Fault::PartitionClient(_) => {
                sim.repair("agent", wire::API.0);
                "repair agent-api"
            }
            Fault::PartitionStore(_) => {
                sim.repair(wire::API.0, store::STORE.0);
                "repair api-store"
            }
            Fault::Hold(_) => {
                sim.release("agent", wire::API.0);
                "release agent-api"
            }
            // A server that an earlier kill's end started again is left running: starting it
            // again would kill it without [`kill`].
            Fault::Kill(_) if sim.is_host_running(wire::API.0) => "api running already",
            Fault::Kill(_) => {
                sim.bounce(wire::API.0);
                "start api"
            }
        }
    }
}

/// Kills the server as a machine that loses its power stops: every task dropped, and nothing
/// leaves it any more, not even what it had sent that is still on the wire; its peers find out
/// by their own timeouts. (A process killed on a live machine would have its sockets' closing
/// segments sent as its tasks drop; tokio drops them in an order it keeps per process, by task
/// ids no run controls, and each segment would draw its latency from the seed's generator in
/// that order: the rest of the run would then depend on the process it ran in.) The links of
/// faults still in force stay as those faults left them.
fn kill(sim: &mut turmoil::Sim<'_>, active: &[Fault]) {
    let peers = ["agent", store::STORE.0];
    for peer in peers {
        sim.partition_oneway(wire::API.0, peer);
    }
    sim.crash(wire::API.0);
    for peer in peers {
        let on_link: Vec<_> = active.iter().filter(|f| peer_of(f) == Some(peer)).collect();
        // A partition in force keeps the link cut both ways.
        if on_link.iter().any(|f| !matches!(f, Fault::Hold(_))) {
            continue;
        }
        sim.repair_oneway(wire::API.0, peer);
        // A hold in force holds it again.
        if !on_link.is_empty() {
            sim.hold(peer, wire::API.0);
        }
    }
}

/// The server's peer whose link the fault cuts or holds.
fn peer_of(fault: &Fault) -> Option<&'static str> {
    match fault {
        Fault::PartitionClient(_) | Fault::Hold(_) => Some("agent"),
        Fault::PartitionStore(_) => Some(store::STORE.0),
        Fault::Kill(_) => None,
    }
}

/// The seed's faults: two to four, in the first two seconds.
fn schedule(rng: &mut SmallRng) -> Vec<(Duration, Fault)> {
    let n = rng.random_range(2..=4);
    let mut faults: Vec<_> = (0..n)
        .map(|_| {
            let at = Duration::from_millis(rng.random_range(0..2_000));
            let span = Duration::from_millis(rng.random_range(20..600));
            let fault = match rng.random_range(0..4) {
                0 => Fault::PartitionClient(span),
                1 => Fault::PartitionStore(span),
                2 => Fault::Hold(span),
                _ => Fault::Kill(span / 4),
            };
            (at, fault)
        })
        .collect();
    faults.sort_by_key(|(at, _)| *at);
    faults
}

/// Runs one seed of `config`, and checks it.
pub fn run(seed: u64, config: &Config) -> Report {
    let world = Arc::new(World::new(seed));
    let mut rng = SmallRng::seed_from_u64(seed);
    let mut sim = turmoil::Builder::new()
        .rng_seed(seed)
        .simulation_duration(Duration::from_secs(120))
        .tick_duration(Duration::from_millis(1))
        .min_message_latency(Duration::from_millis(1))
        .max_message_latency(Duration::from_millis(15))
        .build();
    let store_seed = rng.random();
    let fail_rate = config.store_fail_rate;
    sim.host(store::STORE.0, move || store::host(store_seed, fail_rate));
    let (w, lease) = (world.clone(), config.lease);
    sim.host(wire::API.0, move || wire::api_host(w.clone(), lease));
    sim.client(
        "agent",
        workload::agents(world.clone(), config.clone(), rng.random()),
    );
    let mut pending = if config.faults {
        schedule(&mut rng)
    } else {
        Vec::new()
    };
    let mut ends: Vec<(Duration, Fault)> = Vec::new();
    let mut applied = Vec::new();
    loop {
        let now = sim.elapsed();
        while pending.first().is_some_and(|(at, _)| *at <= now) {
            let (_, fault) = pending.remove(0);
            applied.push((now, format!("{fault:?}")));
            let active: Vec<Fault> = ends.iter().map(|(_, f)| *f).collect();
            ends.push((now + fault.start(&mut sim, &active), fault));
        }
        ends.sort_by_key(|(at, _)| *at);
        while ends.first().is_some_and(|(at, _)| *at <= now) {
            let (_, fault) = ends.remove(0);
            applied.push((now, fault.end(&mut sim).to_owned()));
        }
        match sim.step() {
            Ok(true) => break,
            Ok(false) => {}
            Err(e) => panic!("seed {seed}: the simulation failed: {e}"),
        }
    }
    drop(sim);
    check::report(seed, config, &world, applied)
}
