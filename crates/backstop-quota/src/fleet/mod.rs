//! Quotas a fleet of processes shares through Redis (feature `fleet`): see [`Fleet`].

use crate::{
    Cost, Quotas,
    headers::{Advertised, Unit},
    quotas::{Answer, Asking, Refusal},
};
use backstop_core::{Dependency, InvalidConfig};
use redis::{AsyncConnectionConfig, Client, Script, aio::MultiplexedConnection};
use std::{
    fmt,
    sync::{
        Arc, Mutex, MutexGuard,
        atomic::{AtomicBool, AtomicU64, Ordering},
    },
    time::Duration,
};
use tokio::{
    sync::{Notify, mpsc},
    task::JoinHandle,
};

/// How a process's quotas join a fleet ([`Quotas::join_fleet`]).
#[derive(Clone, Debug)]
pub struct FleetConfig {
    prefix: String,
    ask_timeout: Duration,
}

impl Default for FleetConfig {
    /// Accounts under `backstop:quota:`, an answer awaited 100 ms at most.
    fn default() -> Self {
        FleetConfig {
            prefix: "backstop:quota".to_owned(),
            ask_timeout: Duration::from_millis(100),
        }
    }
}

impl FleetConfig {
    /// The prefix of the fleet's Redis keys (one hash per dependency, `<prefix>:<dependency>`):
    /// fleets that share one Redis and not their quotas use different prefixes.
    #[must_use]
    pub fn prefix(mut self, prefix: impl Into<String>) -> Self {
        self.prefix = prefix.into();
        self
    }

    /// How long an attempt waits for the fleet's answer before it is paced by this process
    /// alone (and the process stops asking for a second, so that a Redis that hangs costs
    /// one wait, not one a call).
    #[must_use]
    pub fn ask_timeout(mut self, timeout: Duration) -> Self {
        self.ask_timeout = timeout;
        self
    }
}

/// What a process's fleet link has done, from [`Fleet::stats`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct FleetStats {
    /// A connection to Redis is open.
    pub connected: bool,
    /// Attempts the fleet's account answered (go, wait or never).
    pub asked: u64,
    /// Attempts this process paced alone: no connection, no answer in time, or Redis failed.
    pub alone: u64,
    /// Of those, the ones that asked and got no answer (no reply within the ask timeout, or an
    /// error). After each, the process paces alone for a second without asking, so a Redis that
    /// hangs costs one ask timeout a second, not one a call.
    pub unanswered: u64,
    /// What responses said of the quotas, and costs given back, not written to the fleet's
    /// account (no connection, or the queue to the writer was full).
    pub dropped: u64,
}

/// A process's link to the other processes that pace against the same quotas
/// ([`Quotas::join_fleet`], feature `fleet`): a task that keeps a connection to Redis and one
/// that writes what responses say, on the runtime it was joined from; stopped when this is
/// dropped (the process then paces alone again).
///
/// Alone, each process paces against what the server says is left, and N processes can each
/// send what is left at a window's start: N times the quota. In a fleet, the account of each
/// dependency is a hash in Redis, kept by one Lua script:
///
/// - **Every attempt takes from it** before it goes (one round trip): one request, and its
///   [`Cost`] in tokens. When a quota has not enough left, the attempt waits for its reset
///   (the fleet's waiters spread over the quotas' spread after it, as one process's are), or
///   ends *not sent* when the reset comes after its deadline.
/// - **Every response's figures** go to the account (off the call's path): what is left only
///   falls within a window, since the server does not count the fleet's attempts still in
///   flight and the account does. A reply made before a reset that the account has already
///   rolled past is recognised by its own reset and ignored.
/// - **Resets** are the account's, on Redis's clock: processes' clocks never meet.
/// - **Redis unreachable, slow or failing**: the attempt is paced by this process alone, as
///   without a fleet, after at most the [ask timeout](FleetConfig::ask_timeout); the process
///   then stops asking for a second. Nothing waits on Redis beyond that.
///
/// Before the first response anyone in the fleet has seen, nothing is known and nothing waits.
///
/// ```no_run
/// use backstop_quota::{FleetConfig, Quotas};
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), backstop_core::InvalidConfig> {
/// let quotas = Quotas::default();
/// let fleet = quotas.join_fleet("redis://127.0.0.1:6379/", FleetConfig::default())?;
/// // ... give `quotas` to the stacks (`Backstop::pace`); keep `fleet` alive as long as they run.
/// # drop(fleet); Ok(())
/// # }
/// ```
pub struct Fleet {
    link: Arc<Link>,
    tasks: [JoinHandle<()>; 2],
}

impl fmt::Debug for Fleet {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Fleet")
            .field("prefix", &self.link.config.prefix)
            .field("stats", &self.stats())
            .finish()
    }
}

impl Fleet {
    /// What the link has done so far.
    pub fn stats(&self) -> FleetStats {
        let c = &self.link.counts;
        FleetStats {
            connected: self.link.connection().is_some(),
            asked: c.asked.load(Ordering::Relaxed),
            alone: c.alone.load(Ordering::Relaxed),
            unanswered: c.unanswered.load(Ordering::Relaxed),
            dropped: c.dropped.load(Ordering::Relaxed),
        }
    }
}

impl Drop for Fleet {
    fn drop(&mut self) {
        self.link.stopped.store(true, Ordering::Release);
        for t in &self.tasks {
            t.abort();
        }
    }
}

impl Quotas {
    /// Shares these quotas with the other processes that join the fleet on the Redis at `url`
    /// (see [`Fleet`]). Spawns the link's tasks on the current tokio runtime; quotas join one
    /// fleet at most.
    ///
    /// It returns before the link has reached Redis; until it has (`Fleet::stats().connected`),
    /// attempts are paced by this process alone.
    pub fn join_fleet(&self, url: &str, config: FleetConfig) -> Result<Fleet, InvalidConfig> {
        if config.ask_timeout.is_zero() {
            return Err(InvalidConfig::new(
                "a quota fleet's ask timeout must be more than zero",
            ));
        }
        let client = Client::open(url)
            .map_err(|e| InvalidConfig::new(format!("the quota fleet's Redis URL: {e}")))?;
        let runtime = tokio::runtime::Handle::try_current().map_err(|_| {
            InvalidConfig::new(
                "join_fleet runs the fleet's link on the current tokio runtime: call it inside one",
            )
        })?;
        let mut joined = self.fleet_slot();
        if joined
            .upgrade()
            .is_some_and(|l| !l.stopped.load(Ordering::Acquire))
        {
            return Err(InvalidConfig::new("these quotas are already in a fleet"));
        }
        let (tx, rx) = mpsc::channel(1024);
        let link = Arc::new(Link {
            config,
            script: Script::new(include_str!("account.lua")),
            conn: Mutex::new(None),
            lost: Notify::new(),
            tx,
            stopped: AtomicBool::new(false),
            counts: Counts::default(),
        });
        *joined = Arc::downgrade(&link);
        let tasks = [
            runtime.spawn(keep_connected(link.clone(), client)),
            runtime.spawn(write(link.clone(), rx)),
        ];
        Ok(Fleet { link, tasks })
    }
}

/// What goes to the fleet's account off the call's path.
enum Report {
    Learn(Dependency, Vec<Advertised>),
    Give(Dependency, Cost, i64),
}

#[derive(Default)]
struct Counts {
    asked: AtomicU64,
    alone: AtomicU64,
    unanswered: AtomicU64,
    dropped: AtomicU64,
}

/// The link's state, shared by the quotas, the handle and the tasks.
pub(crate) struct Link {
    config: FleetConfig,
    script: Script,
    conn: Mutex<Option<MultiplexedConnection>>,
    /// Wakes the connection task when the connection failed.
    lost: Notify,
    tx: mpsc::Sender<Report>,
    stopped: AtomicBool,
    counts: Counts,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl Link {
    fn connection(&self) -> Option<MultiplexedConnection> {
        lock(&self.conn).clone()
    }

    fn key(&self, dependency: &Dependency) -> String {
        format!("{}:{}", self.config.prefix, dependency.as_str())
    }

    /// The connection failed: without one the process paces alone, until the connection task
    /// connects again a second later.
    fn failed(&self, error: &dyn fmt::Display) {
        tracing::debug!(target: "backstop::quota", error = %error, "fleet: Redis failed; pacing alone");
        *lock(&self.conn) = None;
        self.lost.notify_one();
    }

    /// Asks the fleet's account for an attempt of `cost` to `dependency`; `None` when the
    /// process paces it alone without asking (stopped, or not connected: after a failure, for a
    /// second at least).
    pub(crate) fn ask(self: &Arc<Self>, dependency: &Dependency, cost: Cost) -> Option<Asking> {
        if self.stopped.load(Ordering::Acquire) {
            return None;
        }
        let Some(mut conn) = self.connection() else {
            self.counts.alone.fetch_add(1, Ordering::Relaxed);
            return None;
        };
        let link = self.clone();
        let key = self.key(dependency);
        Some(Box::pin(async move {
            let mut take = link.script.prepare_invoke();
            take.key(key).arg("take").arg(cost.tokens);
            let asked = tokio::time::timeout(
                link.config.ask_timeout,
                take.invoke_async::<(i64, String, i64, i64, i64, i64)>(&mut conn),
            )
            .await;
            let answer = match asked {
                Ok(Ok(reply)) => answer(reply, cost),
                Ok(Err(e)) => {
                    link.failed(&e);
                    None
                }
                Err(_) => {
                    link.failed(&"no answer within the ask timeout");
                    None
                }
            };
            if answer.is_some() {
                link.counts.asked.fetch_add(1, Ordering::Relaxed);
            } else {
                link.counts.alone.fetch_add(1, Ordering::Relaxed);
                link.counts.unanswered.fetch_add(1, Ordering::Relaxed);
            }
            answer
        }))
    }

    /// What a response said of `dependency`'s quotas, for the fleet's account.
    pub(crate) fn learn(&self, dependency: &Dependency, advertised: &[Advertised]) {
        self.send(Report::Learn(dependency.clone(), advertised.to_vec()));
    }

    /// An attempt the account let go (in generation `gen`) never left: its cost goes back.
    pub(crate) fn give_back(&self, dependency: &Dependency, cost: Cost, gen_: i64) {
        self.send(Report::Give(dependency.clone(), cost, gen_));
    }

    fn send(&self, report: Report) {
        if self.stopped.load(Ordering::Acquire)
            || self.connection().is_none()
            || self.tx.try_send(report).is_err()
        {
            self.counts.dropped.fetch_add(1, Ordering::Relaxed);
        }
    }
}

/// How long a process paces alone, without asking, after Redis failed it: the wait before it
/// connects again.
const QUIET: Duration = Duration::from_secs(1);

/// The account's reply to `take`, as an answer.
fn answer(
    (code, unit, limit, left, wait_ms, gen_): (i64, String, i64, i64, i64, i64),
    cost: Cost,
) -> Option<Answer> {
    let refusal = |after| {
        let unit = Unit::from_key(&unit)?;
        Some(Refusal {
            unit,
            limit: u64::try_from(limit).ok(),
            remaining: u64::try_from(left).unwrap_or(0),
            cost: cost.of(unit),
            after,
        })
    };
    match code {
        0 => Some(Answer::Go { generation: gen_ }),
        1 => {
            let after = Duration::from_millis(u64::try_from(wait_ms).unwrap_or(0));
            Some(Answer::Wait(refusal(Some(after))?))
        }
        2 => Some(Answer::Never(refusal(None)?)),
        _ => None,
    }
}

fn config() -> AsyncConnectionConfig {
    AsyncConnectionConfig::new()
        .set_connection_timeout(Some(Duration::from_secs(1)))
        .set_response_timeout(Some(Duration::from_secs(2)))
}

/// Keeps a connection open: connects, and connects again (a second later) each time it fails.
async fn keep_connected(link: Arc<Link>, client: Client) {
    loop {
        match client
            .get_multiplexed_async_connection_with_config(&config())
            .await
        {
            Ok(conn) => {
                let lost = link.lost.notified();
                *lock(&link.conn) = Some(conn);
                lost.await;
            }
            Err(e) => {
                tracing::debug!(target: "backstop::quota", error = %e, "fleet: cannot reach Redis");
            }
        }
        tokio::time::sleep(QUIET).await;
    }
}

/// Writes what responses said, and costs given back, to the fleet's account.
async fn write(link: Arc<Link>, mut rx: mpsc::Receiver<Report>) {
    while let Some(report) = rx.recv().await {
        let Some(mut conn) = link.connection() else {
            link.counts.dropped.fetch_add(1, Ordering::Relaxed);
            continue;
        };
        let mut call = link.script.prepare_invoke();
        match &report {
            Report::Learn(dependency, advertised) => {
                call.key(link.key(dependency)).arg("learn");
                for a in advertised {
                    let or_none =
                        |v: Option<u64>| v.map_or(-1, |v| i64::try_from(v).unwrap_or(i64::MAX));
                    call.arg(a.unit.key())
                        .arg(or_none(a.limit))
                        .arg(or_none(a.remaining))
                        .arg(or_none(a.reset.map(|r| {
                            // Rounded up: the fleet's window never ends before the server's.
                            u64::try_from(r.as_nanos().div_ceil(1_000_000)).unwrap_or(u64::MAX)
                        })));
                }
            }
            Report::Give(dependency, cost, gen_) => {
                call.key(link.key(dependency))
                    .arg("give")
                    .arg(cost.tokens)
                    .arg(*gen_);
            }
        }
        if let Err(e) = call.invoke_async::<i64>(&mut conn).await {
            link.counts.dropped.fetch_add(1, Ordering::Relaxed);
            link.failed(&e);
        }
    }
}
