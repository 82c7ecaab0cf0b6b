//! Deterministic simulations: tokio's paused clock, seeded RNGs, the real Backstop stack and
//! replay layer in process. They measure counts (clean tasks, attempts, duplicate effects), never
//! time.

use crate::stacks::{Req, Res, TowerPolicy};
use backstop::{
    Backstop, BoxError, Preset,
    backoff::RngSource,
    breaker::{Breaker, BreakerConfig},
    budget::Budget,
    idempotency::ActionContext,
    replay::{MemoryStore, ReplayLayer, ReplayRequestBody},
};
use bytes::Bytes;
use http::{Request, Response};
use http_body_util::{BodyExt, Full};
use rand::{SeedableRng, rngs::SmallRng};
use std::{
    collections::HashMap,
    future::ready,
    io,
    sync::{
        Arc, Mutex,
        atomic::{AtomicU64, Ordering},
    },
    time::Duration,
};
use tower::{
    Layer, Service, ServiceBuilder, ServiceExt, retry::budget::TpsBudget, util::BoxCloneSyncService,
};

/// What happens to one attempt at the dependency.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Fate {
    Ok,
    /// Refused before doing anything (a 503).
    Refused,
    /// The effect is committed, then the reply is lost.
    LostReply,
}

/// The dependency of the reliability simulation: every attempt draws its fate from a seeded RNG;
/// `effects` counts committed effects per action (the order id in the body).
#[derive(Clone)]
struct Flaky {
    rng: Arc<Mutex<SmallRng>>,
    failure_rate: f64,
    effects: Arc<Mutex<HashMap<String, u32>>>,
    attempts: Arc<AtomicU64>,
}

impl Flaky {
    fn new(seed: u64, failure_rate: f64) -> Self {
        Flaky {
            rng: Arc::new(Mutex::new(SmallRng::seed_from_u64(seed))),
            failure_rate,
            effects: Arc::default(),
            attempts: Arc::default(),
        }
    }

    fn fate(&self) -> Fate {
        self.attempts.fetch_add(1, Ordering::Relaxed);
        let u = rand::RngExt::random::<f64>(&mut *self.rng.lock().unwrap());
        if u < self.failure_rate / 2.0 {
            Fate::Refused
        } else if u < self.failure_rate {
            Fate::LostReply
        } else {
            Fate::Ok
        }
    }

    fn duplicates(&self) -> u64 {
        self.effects
            .lock()
            .unwrap()
            .values()
            .map(|n| u64::from(n.saturating_sub(1)))
            .sum()
    }

    /// The handler: commits the effect for the action named in the body.
    fn commit(&self, body: &[u8]) -> Response<Full<Bytes>> {
        let action = String::from_utf8_lossy(body).into_owned();
        *self.effects.lock().unwrap().entry(action).or_default() += 1;
        Response::new(Full::new(Bytes::from_static(b"done")))
    }

    /// The dependency as a service: `replay` puts Backstop's replay layer in front of the
    /// handler; the fate is applied outside it (the network).
    fn service(&self, replay: bool) -> BoxCloneSyncService<Req, Res, BoxError> {
        let this = self.clone();
        let handler = tower::service_fn(move |req: Request<ReplayRequestBody>| {
            let this = this.clone();
            async move {
                let body = req.into_body().collect().await.map_err(|e| e.0)?.to_bytes();
                Ok::<_, BoxError>(this.commit(&body))
            }
        });
        let inner: BoxCloneSyncService<
            Req,
            Response<backstop::replay::ReplayResponseBody>,
            BoxError,
        > = if replay {
            BoxCloneSyncService::new(
                ReplayLayer::new(MemoryStore::new(1_000_000))
                    .single_tenant()
                    .layer(handler),
            )
        } else {
            BoxCloneSyncService::new(
                handler
                    .map_request(|r: Req| r.map(|b| b.map_err(|e| match e {}).boxed_unsync()))
                    .map_response(|r: Res| r.map(|b| b.map_err(|e| match e {}).boxed_unsync())),
            )
        };
        let this = self.clone();
        BoxCloneSyncService::new(tower::service_fn(move |req: Req| {
            let fate = this.fate();
            let mut inner = inner.clone();
            async move {
                if fate == Fate::Refused {
                    return Ok(Response::builder().status(503).body(Full::default())?);
                }
                let res = inner.ready().await?.call(req).await?;
                if fate == Fate::LostReply {
                    return Err(io::Error::new(io::ErrorKind::ConnectionReset, "reply lost").into());
                }
                let (parts, body) = res.into_parts();
                let bytes = body.collect().await.map_err(|e| e.0)?.to_bytes();
                Ok(Response::from_parts(parts, Full::new(bytes)))
            }
        }))
    }
}

/// The figures of the reliability simulation.
#[derive(Clone, Debug, PartialEq)]
pub struct Reliability {
    /// Tasks of `calls` tool calls each.
    pub tasks: u64,
    /// Tool calls per task.
    pub calls: u64,
    /// Share of tasks whose every call succeeded at the first attempt (no retries).
    pub clean_without_retries: f64,
    /// Share of tasks whose every call succeeded with the Backstop stack.
    pub clean_with_backstop: f64,
    /// Extra attempts the stack made, as a share of calls.
    pub extra_load: f64,
    /// Duplicate side effects with the Backstop stack and the replay layer.
    pub duplicates_backstop: u64,
    /// Duplicate side effects with a naive retry (any error, 3 attempts, no keys, no replay).
    pub duplicates_naive: u64,
}

fn order(task: u64, call: u64) -> Req {
    let mut req = Request::post("http://payments.local/refunds")
        .body(Full::new(Bytes::from(format!("task-{task}-call-{call}"))))
        .unwrap();
    req.extensions_mut().insert(ActionContext::tool_call(
        &format!("run-{task}"),
        &format!("step-{call}"),
        "call-1",
    ));
    req
}

/// 20 tool calls per task, `failure_rate` transient failures per attempt, half of them replies
/// lost after the effect was committed. Runs on a paused clock; call it from a runtime started
/// paused (`start_paused = true`).
pub async fn reliability(tasks: u64, calls: u64, failure_rate: f64, seed: u64) -> Reliability {
    // Without retries: one attempt each.
    let dep = Flaky::new(seed, failure_rate);
    let mut svc = dep.service(false);
    let mut clean = 0;
    for t in 0..tasks {
        let mut ok = true;
        for c in 0..calls {
            let r = svc.ready().await.unwrap().call(order(t, c)).await;
            ok &= matches!(r, Ok(ref res) if res.status().is_success());
        }
        clean += u64::from(ok);
    }
    let clean_without_retries = clean as f64 / tasks as f64;

    // The Backstop stack, keys derived from the action, replay layer on the dependency.
    let dep = Flaky::new(seed, failure_rate);
    let stack = Backstop::http("payments-api")
        .preset(Preset::Create)
        .budget(Budget::default())
        .breaker(Breaker::new(BreakerConfig::default()).unwrap())
        .rng(RngSource::seeded(seed))
        .build()
        .unwrap();
    let mut svc = stack.layer(dep.service(true));
    let mut clean = 0;
    for t in 0..tasks {
        let mut ok = true;
        for c in 0..calls {
            let r = svc.ready().await.unwrap().call(order(t, c)).await;
            ok &= matches!(r, Ok(ref res) if res.status().is_success());
        }
        clean += u64::from(ok);
    }
    let total = tasks * calls;
    let extra_load = (dep.attempts.load(Ordering::Relaxed) - total) as f64 / total as f64;
    let duplicates_backstop = dep.duplicates();

    // A naive retry: any error or 5xx, three attempts, no key, no replay layer.
    let dep = Flaky::new(seed, failure_rate);
    let naive = ServiceBuilder::new()
        .retry(TowerPolicy {
            budget: Arc::new(TpsBudget::new(Duration::from_secs(10), 1_000_000, 1000.0)),
            attempts: 2,
        })
        .service(dep.service(false));
    for t in 0..tasks {
        for c in 0..calls {
            let _ = naive.clone().oneshot(order(t, c)).await;
        }
    }
    Reliability {
        tasks,
        calls,
        clean_without_retries,
        clean_with_backstop: clean as f64 / tasks as f64,
        extra_load,
        duplicates_backstop,
        duplicates_naive: dep.duplicates(),
    }
}

/// Attempts that reached a dependency during a total outage.
#[derive(Clone, Debug, PartialEq)]
pub struct Outage {
    /// The strategy.
    pub name: &'static str,
    /// Logical requests made.
    pub requests: u64,
    /// Attempts that reached the dependency.
    pub attempts: u64,
}

impl Outage {
    /// Attempts per logical request.
    pub fn amplification(&self) -> f64 {
        self.attempts as f64 / self.requests as f64
    }
}

fn counting_503() -> (BoxCloneSyncService<Req, Res, BoxError>, Arc<AtomicU64>) {
    let n = Arc::new(AtomicU64::new(0));
    let c = n.clone();
    let svc = tower::service_fn(move |_req: Req| {
        c.fetch_add(1, Ordering::Relaxed);
        ready(Ok::<_, BoxError>(
            Response::builder()
                .status(503)
                .body(Full::default())
                .unwrap(),
        ))
    });
    (BoxCloneSyncService::new(svc), n)
}

fn naive_policy() -> TowerPolicy {
    TowerPolicy {
        budget: Arc::new(TpsBudget::new(Duration::from_secs(10), 1_000_000, 1000.0)),
        attempts: 2,
    }
}

async fn drive_outage<S>(
    name: &'static str,
    svc: S,
    attempts: Arc<AtomicU64>,
    duration: Duration,
    every: Duration,
) -> Outage
where
    S: Service<Req> + Clone + Send + 'static,
    S::Future: Send,
    S::Response: Send,
    S::Error: Send,
{
    // Requests arrive on a fixed schedule, whatever the earlier ones are doing (as callers do),
    // so every strategy sees the same number of requests.
    let start = tokio::time::Instant::now();
    let mut requests = 0;
    let mut tasks = tokio::task::JoinSet::new();
    while start.elapsed() < duration {
        requests += 1;
        let get = Request::get("http://carrier.local/rates")
            .body(Full::default())
            .unwrap();
        let svc = svc.clone();
        tasks.spawn(async move {
            let _ = svc.oneshot(get).await;
        });
        tokio::time::sleep(every).await;
    }
    while tasks.join_next().await.is_some() {}
    Outage {
        name,
        requests,
        attempts: attempts.load(Ordering::Relaxed),
    }
}

/// A total outage of `duration`, one logical request every `every`, against each strategy.
/// Runs on a paused clock.
pub async fn outage(duration: Duration, every: Duration) -> Vec<Outage> {
    let mut out = Vec::new();

    let (dep, n) = counting_503();
    let nested = ServiceBuilder::new()
        .retry(naive_policy())
        .retry(naive_policy())
        .retry(naive_policy())
        .service(dep);
    out.push(
        drive_outage(
            "three nested naive retry layers (3 attempts each)",
            nested,
            n,
            duration,
            every,
        )
        .await,
    );

    let (dep, n) = counting_503();
    let tower_plain = ServiceBuilder::new().retry(naive_policy()).service(dep);
    out.push(
        drive_outage(
            "tower retry, 3 attempts, no budget",
            tower_plain,
            n,
            duration,
            every,
        )
        .await,
    );

    let (dep, n) = counting_503();
    let budget = Arc::new(TpsBudget::new(Duration::from_secs(10), 10, 0.2));
    let tower_budget = ServiceBuilder::new()
        .retry(TowerPolicy {
            budget,
            attempts: 2,
        })
        .service(dep);
    out.push(
        drive_outage(
            "tower retry + TpsBudget (20 %, 10/s)",
            tower_budget,
            n,
            duration,
            every,
        )
        .await,
    );

    let (dep, n) = counting_503();
    let budget_only = Backstop::http("carrier-api")
        .budget(Budget::default())
        .no_breaker()
        .rng(RngSource::seeded(1))
        .build()
        .unwrap()
        .layer(dep);
    out.push(drive_outage("Backstop, budget only", budget_only, n, duration, every).await);

    let (dep, n) = counting_503();
    let full = Backstop::http("carrier-api")
        .budget(Budget::default())
        .breaker(Breaker::new(BreakerConfig::default()).unwrap())
        .rng(RngSource::seeded(1))
        .build()
        .unwrap()
        .layer(dep);
    out.push(drive_outage("Backstop, budget + breaker", full, n, duration, every).await);
    out
}

/// What one timeout strategy did in one phase of [`latency_shift`].
#[derive(Clone, Debug)]
pub struct ShiftPhase {
    /// The strategy.
    pub name: &'static str,
    /// The phase: the dependency's median latency.
    pub median: Duration,
    /// Logical calls.
    pub calls: u64,
    /// Calls that failed.
    pub failed: u64,
    /// Attempts made.
    pub attempts: u64,
    /// Attempts cut by the attempt timeout (work the dependency did for nothing).
    pub cut: u64,
    /// p99 of successful calls.
    pub p99: Duration,
    /// p99.9 of successful calls.
    pub p999: Duration,
    /// The attempt timeout in force at the phase's end.
    pub timeout_at_end: Duration,
}

/// A dependency whose latency is lognormal (`sigma` 0.4) around a median that the test moves,
/// with a share of attempts ten times slower (a heavy tail); seeded.
#[derive(Clone)]
struct Lognormal {
    rng: Arc<Mutex<SmallRng>>,
    median_micros: Arc<AtomicU64>,
    attempts: Arc<AtomicU64>,
    /// The share of attempts ten times slower.
    tail: f64,
}

impl Lognormal {
    fn latency(&self) -> Duration {
        use rand::RngExt;
        let mut rng = self.rng.lock().expect("rng");
        // Box-Muller.
        let (u1, u2): (f64, f64) = (rng.random::<f64>().max(1e-12), rng.random::<f64>());
        let z = (-2.0 * u1.ln()).sqrt() * (2.0 * std::f64::consts::PI * u2).cos();
        let tail = if rng.random::<f64>() < self.tail {
            10.0
        } else {
            1.0
        };
        let median = self.median_micros.load(Ordering::Relaxed) as f64;
        Duration::from_micros((median * (0.4 * z).exp() * tail) as u64)
    }

    fn service(
        &self,
    ) -> impl Service<Req, Response = Res, Error = io::Error, Future: Send> + Clone + Send + 'static
    {
        let dep = self.clone();
        tower::service_fn(move |_req: Req| {
            dep.attempts.fetch_add(1, Ordering::Relaxed);
            let latency = dep.latency();
            async move {
                tokio::time::sleep(latency).await;
                Ok::<_, io::Error>(Response::new(Full::default()))
            }
        })
    }
}

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    if sorted.is_empty() {
        return Duration::ZERO;
    }
    sorted[((sorted.len() as f64 - 1.0) * p).round() as usize]
}

/// The dependency's median moves from 50 ms to 400 ms halfway through; a logical GET every
/// `every` for `phase` in each half, on the paused clock. Two stacks: a fixed attempt timeout
/// tuned for the first half (`p99(150 ms)`: 375 ms), and one learned from latency. Both keep a
/// retry budget and a 5 s deadline, no breaker (so what differs is the timeout alone).
pub async fn latency_shift(phase: Duration, every: Duration, seed: u64) -> Vec<ShiftPhase> {
    use backstop::timeout::{LatencyConfig, LatencyTimeouts};
    let mut out = Vec::new();
    for learned in [false, true] {
        let dep = Lognormal {
            rng: Arc::new(Mutex::new(SmallRng::seed_from_u64(seed))),
            median_micros: Arc::new(AtomicU64::new(50_000)),
            attempts: Arc::default(),
            tail: 0.01,
        };
        let latency =
            LatencyTimeouts::new(LatencyConfig::default().window(Duration::from_secs(10)))
                .expect("a valid configuration");
        let mut b = Backstop::http("search-api")
            .p99(Duration::from_millis(150))
            .deadline(Duration::from_secs(5))
            .budget(Budget::default())
            .no_breaker()
            .rng(RngSource::seeded(seed));
        if learned {
            b = b.attempt_timeout_from_latency(latency.clone());
        }
        let name = if learned {
            "attempt timeout learned from latency"
        } else {
            "fixed attempt timeout (p99 150 ms -> 375 ms)"
        };
        let stack = b.build().expect("a valid stack").layer(dep.service());
        let fixed = Duration::from_millis(375);
        for median in [Duration::from_millis(50), Duration::from_millis(400)] {
            dep.median_micros
                .store(median.as_micros() as u64, Ordering::Relaxed);
            let before = dep.attempts.load(Ordering::Relaxed);
            let calls = (phase.as_nanos() / every.as_nanos()) as u64;
            let (took, failed) = gets(&stack, calls, every).await;
            let attempts = dep.attempts.load(Ordering::Relaxed) - before;
            let succeeded = took.len() as u64;
            out.push(ShiftPhase {
                name,
                median,
                calls,
                failed,
                attempts,
                // Every attempt that did not end a successful call was cut by a timeout (the
                // dependency never fails otherwise).
                cut: attempts - succeeded,
                p99: percentile(&took, 0.99),
                p999: percentile(&took, 0.999),
                timeout_at_end: if learned {
                    latency.timeout(&"search-api".into(), 1)
                } else {
                    fixed
                },
            });
        }
    }
    out
}

/// What one strategy did in [`tail_latency`].
#[derive(Clone, Debug)]
pub struct TailRow {
    /// The strategy.
    pub name: &'static str,
    /// Logical calls.
    pub calls: u64,
    /// Calls that failed.
    pub failed: u64,
    /// Attempts at the dependency.
    pub attempts: u64,
    /// p99 of successful calls.
    pub p99: Duration,
    /// p99.9 of successful calls.
    pub p999: Duration,
}

/// One GET every `every`, `calls` of them, to a dependency at a 50 ms median (lognormal) with
/// 2 % of attempts ten times slower, after a warm-up of 500 calls, on the paused clock: a fixed
/// attempt timeout, one learned from latency, that and hedged reads on the retry budget, and
/// tower's `hedge` (p95, 20 data points, a 10 s period) over the same dependency.
pub async fn tail_latency(calls: u64, every: Duration, seed: u64) -> Vec<TailRow> {
    use backstop::{
        retry::Hedging,
        timeout::{LatencyConfig, LatencyTimeouts},
    };
    let dependency = || Lognormal {
        rng: Arc::new(Mutex::new(SmallRng::seed_from_u64(seed))),
        median_micros: Arc::new(AtomicU64::new(50_000)),
        attempts: Arc::default(),
        tail: 0.02,
    };
    let backstop = |learned: Option<&LatencyTimeouts>| {
        let b = Backstop::http("search-api")
            .p99(Duration::from_millis(150))
            .deadline(Duration::from_secs(5))
            .budget(Budget::default())
            .no_breaker()
            .rng(RngSource::seeded(seed));
        match learned {
            Some(l) => b.attempt_timeout_from_latency(l.clone()),
            None => b,
        }
        .build()
        .expect("a valid stack")
    };
    let latency = || {
        LatencyTimeouts::new(LatencyConfig::default().window(Duration::from_secs(10)))
            .expect("a valid configuration")
    };
    let mut out = Vec::new();

    let dep = dependency();
    let svc = backstop(None).layer(dep.service());
    out.push(measure_tail("fixed attempt timeout (375 ms)", svc, &dep, calls, every).await);

    let dep = dependency();
    let learned = latency();
    let svc = backstop(Some(&learned)).layer(dep.service());
    out.push(
        measure_tail(
            "attempt timeout learned from latency",
            svc,
            &dep,
            calls,
            every,
        )
        .await,
    );

    let dep = dependency();
    let learned = latency();
    let layer = backstop(Some(&learned));
    let svc = layer.layer(
        layer
            .hedge(dep.service(), Hedging::default())
            .expect("a latency record"),
    );
    out.push(
        measure_tail(
            "learned timeout + hedged reads on the budget (p95)",
            svc,
            &dep,
            calls,
            every,
        )
        .await,
    );

    let dep = dependency();
    // tower's Hedge is not Clone: a Buffer shares it, as users do.
    let hedged = tower::buffer::Buffer::new(
        tower::hedge::Hedge::new(dep.service(), CloneGet, 20, 0.95, Duration::from_secs(10)),
        1024,
    );
    out.push(measure_tail("tower hedge (p95), no budget", hedged, &dep, calls, every).await);
    out
}

/// tower's hedge policy for the simulation's GETs: every request may be hedged.
#[derive(Clone, Copy, Debug)]
struct CloneGet;

impl tower::hedge::Policy<Req> for CloneGet {
    fn clone_request(&self, req: &Req) -> Option<Req> {
        let mut copy = Request::new(req.body().clone());
        *copy.method_mut() = req.method().clone();
        *copy.uri_mut() = req.uri().clone();
        Some(copy)
    }

    fn can_retry(&self, _req: &Req) -> bool {
        true
    }
}

async fn measure_tail<S, R, E>(
    name: &'static str,
    svc: S,
    dep: &Lognormal,
    calls: u64,
    every: Duration,
) -> TailRow
where
    S: Service<Req, Response = Response<R>, Error = E> + Clone + Send + 'static,
    S::Future: Send,
    R: Send + 'static,
    E: Send + 'static,
{
    gets(&svc, 500, every).await;
    let before = dep.attempts.load(Ordering::Relaxed);
    let (took, failed) = gets(&svc, calls, every).await;
    TailRow {
        name,
        calls,
        failed,
        attempts: dep.attempts.load(Ordering::Relaxed) - before,
        p99: percentile(&took, 0.99),
        p999: percentile(&took, 0.999),
    }
}

/// `n` GETs, one every `every`, each in a task of its own: the successful calls' durations,
/// sorted, and how many failed.
async fn gets<S, R, E>(svc: &S, n: u64, every: Duration) -> (Vec<Duration>, u64)
where
    S: Service<Req, Response = Response<R>, Error = E> + Clone + Send + 'static,
    S::Future: Send,
    R: Send + 'static,
    E: Send + 'static,
{
    let mut tasks = tokio::task::JoinSet::new();
    for _ in 0..n {
        let svc = svc.clone();
        tasks.spawn(async move {
            let start = tokio::time::Instant::now();
            let req = Request::get("http://search.local/q")
                .body(Full::default())
                .expect("a request");
            let ok = svc.oneshot(req).await.is_ok();
            (ok, start.elapsed())
        });
        tokio::time::sleep(every).await;
    }
    let (mut took, mut failed) = (Vec::new(), 0);
    while let Some(done) = tasks.join_next().await {
        match done.expect("the call's task") {
            (true, t) => took.push(t),
            (false, _) => failed += 1,
        }
    }
    took.sort();
    (took, failed)
}
