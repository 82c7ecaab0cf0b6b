//! Circuits a fleet of processes shares through Redis (feature `fleet`): see [`Fleet`]. The
//! handle, its configuration and the link's view of the fleet are here; the tasks that write
//! and read the Redis stream are in `stream.rs`.

mod stream;

use crate::circuit::{Inner, Shared};
use crate::{Breaker, CircuitState, CircuitTransition};
use backstop_core::{Dependency, InvalidConfig};
use redis::Client;
use std::{
    collections::HashMap,
    fmt,
    sync::{
        Arc, Mutex, Weak,
        atomic::{AtomicBool, AtomicU64, Ordering},
    },
    time::Duration,
};
use stream::{read, write};
use tokio::{sync::mpsc, task::JoinHandle, time::Instant};

/// How a breaker joins a fleet ([`Breaker::join_fleet`]).
#[derive(Clone, Debug)]
pub struct FleetConfig {
    quorum: usize,
    min_calls: u64,
    stream: String,
    id: String,
}

impl Default for FleetConfig {
    /// A quorum of 2 processes, reports backed by at least 5 calls, the stream
    /// `backstop:breaker`, a random process id.
    fn default() -> Self {
        let mut id = [0u8; 8];
        rand_id(&mut id);
        FleetConfig {
            quorum: 2,
            min_calls: 5,
            stream: "backstop:breaker".to_owned(),
            id: id.iter().map(|b| format!("{b:02x}")).collect(),
        }
    }
}

fn rand_id(buf: &mut [u8; 8]) {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u32(std::process::id());
    h.write_u128(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos()),
    );
    *buf = h.finish().to_le_bytes();
}

impl FleetConfig {
    /// How many distinct processes must report a circuit open before the others open theirs
    /// (at least 1; 1 lets any one process open the fleet's circuit).
    #[must_use]
    pub fn quorum(mut self, processes: usize) -> Self {
        self.quorum = processes;
        self
    }

    /// The fewest calls a report must be backed by to count.
    #[must_use]
    pub fn min_calls(mut self, calls: u64) -> Self {
        self.min_calls = calls;
        self
    }

    /// The Redis stream the fleet's reports go on (and the prefix of its trial leases).
    #[must_use]
    pub fn stream(mut self, name: impl Into<String>) -> Self {
        self.stream = name.into();
        self
    }

    /// This process's name in its reports (random by default).
    #[must_use]
    pub fn process_id(mut self, id: impl Into<String>) -> Self {
        self.id = id.into();
        self
    }
}

/// What a process's fleet link has done, from [`Fleet::stats`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct FleetStats {
    /// Redis answered the last operation.
    pub connected: bool,
    /// Reports this process put on the stream.
    pub published: u64,
    /// Reports of other processes read.
    pub received: u64,
    /// Reports not sent: the link had not reached Redis yet, Redis was unreachable, or the
    /// queue to the writer was full.
    pub dropped: u64,
    /// Circuits this process opened on the fleet's quorum.
    pub opened_by_fleet: u64,
    /// Circuits this process closed on another process's successful trial.
    pub closed_by_fleet: u64,
    /// Trial leases this process won, and lost to another process.
    pub trials_won: u64,
    /// See `trials_won`.
    pub trials_lost: u64,
}

/// A breaker's link to the other processes that call the same dependencies
/// ([`Breaker::join_fleet`], feature `fleet`): a writer and a reader task on the runtime it
/// was joined from, stopped when this is dropped (the breaker then judges alone again).
///
/// Each process keeps judging by its own calls. What the fleet adds:
///
/// - **Open reports.** A circuit this process opens on its own calls is reported on a Redis
///   stream (`XADD`, with the calls that backed it). A process opens its own circuit for a
///   dependency once a **quorum** of distinct processes (itself included) has reported it open
///   within the report's cooldown, each report backed by at least `min_calls` calls: one faulty
///   replica (a bad network path, a bug of its own) cannot open the fleet's circuit alone, and
///   a report of two unlucky calls counts for nothing. Reports reach the others as soon as
///   Redis delivers them (`XREAD BLOCK`: a few milliseconds on one network).
/// - **Fleet-wide trials.** When a circuit's cooldown ends, a process sends trial calls only if
///   it holds the dependency's trial lease (`SET NX PX`, one holder in the fleet, for a
///   cooldown): the fleet sends one process's trial calls per cooldown, not one set per
///   replica. The holder's successful trial is reported and closes the circuit everywhere; a
///   failed one keeps it open.
/// - **Redis unreachable.** Reports are dropped (counted) and every process falls back to its
///   own breaker, trials included; [`FleetStats::connected`] and the gauge
///   `backstop_breaker_fleet_connected` (feature `metrics`) say so.
///
/// ```no_run
/// use backstop_breaker::{Breaker, FleetConfig};
///
/// # #[tokio::main]
/// # async fn main() -> Result<(), backstop_core::InvalidConfig> {
/// let breaker = Breaker::default();
/// // Two replicas must report a dependency failing before the others open its circuit.
/// let fleet = breaker.join_fleet("redis://127.0.0.1:6379/", FleetConfig::default().quorum(2))?;
/// // ... give `breaker` to the stacks; keep `fleet` alive as long as they run.
/// # drop(fleet); Ok(())
/// # }
/// ```
pub struct Fleet {
    link: Arc<Link>,
    tasks: Vec<JoinHandle<()>>,
}

impl fmt::Debug for Fleet {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Fleet")
            .field("id", &self.link.config.id)
            .field("stats", &self.stats())
            .finish()
    }
}

impl Fleet {
    /// What the link has done so far.
    pub fn stats(&self) -> FleetStats {
        self.link.stats()
    }
}

impl Drop for Fleet {
    fn drop(&mut self) {
        self.link.connected.store(false, Ordering::Release);
        for t in &self.tasks {
            t.abort();
        }
    }
}

impl Breaker {
    /// Shares this breaker's circuits with the other processes that join the fleet on the
    /// Redis at `url` (see the module's docs). Spawns the link's tasks on the current tokio
    /// runtime; a breaker joins one fleet at most.
    ///
    /// It returns before the link has reached Redis. Until it has (`Fleet::stats().connected`,
    /// typically within a second), and whenever Redis is unreachable, this process's reports
    /// are not sent but dropped and counted (`FleetStats::dropped`): a circuit that opens then
    /// is judged by this process alone and is not heard by the fleet. Reports are not queued
    /// for later, since a report written late would be dated by its write and count for a
    /// whole cooldown it no longer has. Wait for `connected` before relying on the fleet.
    pub fn join_fleet(&self, url: &str, config: FleetConfig) -> Result<Fleet, InvalidConfig> {
        if config.quorum == 0 {
            return Err(InvalidConfig::new(
                "a fleet's quorum must be at least 1 process",
            ));
        }
        let client = Client::open(url)
            .map_err(|e| InvalidConfig::new(format!("the fleet's Redis URL: {e}")))?;
        let (tx, rx) = mpsc::channel(1024);
        let link = Arc::new(Link {
            breaker: Arc::downgrade(&self.inner),
            config,
            tx,
            connected: AtomicBool::new(false),
            reports: Mutex::new(HashMap::new()),
            trials: Mutex::new(HashMap::new()),
            counts: Counts::default(),
        });
        if self.inner.shared.set(link.clone()).is_err() {
            return Err(InvalidConfig::new(
                "this breaker has joined a fleet already",
            ));
        }
        let tasks = vec![
            tokio::spawn(write(link.clone(), client.clone(), rx)),
            tokio::spawn(read(link.clone(), client)),
        ];
        Ok(Fleet { link, tasks })
    }
}

/// What the writer task is asked to do.
enum Out {
    Report {
        dependency: Dependency,
        open: bool,
        cooldown: Duration,
        calls: u64,
    },
    AskTrial {
        dependency: Dependency,
        lease: Duration,
    },
}

#[derive(Default)]
struct Counts {
    published: AtomicU64,
    received: AtomicU64,
    dropped: AtomicU64,
    opened: AtomicU64,
    closed: AtomicU64,
    won: AtomicU64,
    lost: AtomicU64,
}

/// A process's right to send a dependency's trials.
#[derive(Clone, Copy, Debug)]
enum Trial {
    /// Asked of Redis, no answer yet.
    Asked(Instant),
    /// This process holds the lease until then.
    Won(Instant),
    /// Another process holds it until then.
    Lost(Instant),
}

struct Link {
    breaker: Weak<Inner>,
    config: FleetConfig,
    tx: mpsc::Sender<Out>,
    connected: AtomicBool,
    /// Per dependency, the processes that reported it open, until when their report counts.
    reports: Mutex<HashMap<Dependency, HashMap<String, Instant>>>,
    trials: Mutex<HashMap<Dependency, Trial>>,
    counts: Counts,
}

impl Link {
    fn stats(&self) -> FleetStats {
        let c = &self.counts;
        FleetStats {
            connected: self.connected.load(Ordering::Acquire),
            published: c.published.load(Ordering::Relaxed),
            received: c.received.load(Ordering::Relaxed),
            dropped: c.dropped.load(Ordering::Relaxed),
            opened_by_fleet: c.opened.load(Ordering::Relaxed),
            closed_by_fleet: c.closed.load(Ordering::Relaxed),
            trials_won: c.won.load(Ordering::Relaxed),
            trials_lost: c.lost.load(Ordering::Relaxed),
        }
    }

    fn send(&self, out: Out) {
        if !self.connected.load(Ordering::Acquire) || self.tx.try_send(out).is_err() {
            self.counts.dropped.fetch_add(1, Ordering::Relaxed);
        }
    }

    fn set_connected(&self, up: bool) {
        if self.connected.swap(up, Ordering::AcqRel) != up {
            if up {
                tracing::info!(target: "backstop::breaker", "fleet: connected to Redis");
            } else {
                tracing::warn!(
                    target: "backstop::breaker",
                    "fleet: Redis unreachable; each circuit is judged by this process alone"
                );
            }
            #[cfg(feature = "metrics")]
            metrics::gauge!("backstop_breaker_fleet_connected").set(if up { 1.0 } else { 0.0 });
        }
    }

    /// Counts `process`'s open report for `dependency` until `until`, and opens this
    /// process's circuit once the live reports reach the quorum.
    fn reported_open(&self, dependency: &Dependency, process: &str, cooldown: Duration) {
        let now = Instant::now();
        let live = {
            let mut reports = self.reports.lock().unwrap_or_else(|p| p.into_inner());
            let by = reports.entry(dependency.clone()).or_default();
            by.insert(process.to_owned(), now + cooldown);
            by.retain(|_, until| *until > now);
            by.len()
        };
        if live >= self.config.quorum
            && let Some(inner) = self.breaker.upgrade()
            && inner.open_by_fleet(dependency, cooldown)
        {
            self.counts.opened.fetch_add(1, Ordering::Relaxed);
            tracing::warn!(
                target: "backstop::breaker",
                dependency = %dependency,
                reporters = live,
                "fleet: circuit opened on the fleet's reports"
            );
        }
    }

    fn reported_closed(&self, dependency: &Dependency) {
        self.reports
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(dependency);
        self.trials
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(dependency);
        if let Some(inner) = self.breaker.upgrade()
            && inner.close_by_fleet(dependency)
        {
            self.counts.closed.fetch_add(1, Ordering::Relaxed);
        }
    }
}

impl Shared for Link {
    fn local(&self, t: &CircuitTransition, calls: u64) {
        match (t.from, t.to) {
            (CircuitState::Closed | CircuitState::HalfOpen, CircuitState::Open) => {
                let cooldown = t.cooldown.unwrap_or(Duration::from_secs(30));
                if t.from == CircuitState::Closed && calls < self.config.min_calls {
                    return;
                }
                if t.from == CircuitState::Closed {
                    // Its own report counts toward the quorum too.
                    self.reported_open(&t.dependency, &self.config.id.clone(), cooldown);
                }
                self.send(Out::Report {
                    dependency: t.dependency.clone(),
                    open: true,
                    cooldown,
                    calls,
                });
            }
            (CircuitState::HalfOpen, CircuitState::Closed) => {
                self.reports
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .remove(&t.dependency);
                self.send(Out::Report {
                    dependency: t.dependency.clone(),
                    open: false,
                    cooldown: Duration::ZERO,
                    calls,
                });
            }
            _ => {}
        }
    }

    fn may_trial(&self, dependency: &Dependency) -> bool {
        if !self.connected.load(Ordering::Acquire) {
            return true;
        }
        let now = Instant::now();
        let mut trials = self.trials.lock().unwrap_or_else(|p| p.into_inner());
        match trials.get(dependency) {
            Some(Trial::Won(until)) if *until > now => return true,
            Some(Trial::Lost(until)) if *until > now => return false,
            // An answer is on its way (for up to a second).
            Some(Trial::Asked(at)) if now.duration_since(*at) < Duration::from_secs(1) => {
                return false;
            }
            _ => {}
        }
        trials.insert(dependency.clone(), Trial::Asked(now));
        drop(trials);
        let lease = self
            .breaker
            .upgrade()
            .map_or(Duration::from_secs(30), |b| b.config.cooldown);
        self.send(Out::AskTrial {
            dependency: dependency.clone(),
            lease,
        });
        false
    }
}
