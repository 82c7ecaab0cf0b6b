//! Latency: a dependency whose latency shifts under learned timeouts, and the tail that hedged
//! reads cut.

use crate::stacks::{Req, Res};
use backstop::{Backstop, backoff::RngSource, budget::Budget};
use http::{Request, Response};
use http_body_util::Full;
use rand::{SeedableRng, rngs::SmallRng};
use std::{
    io,
    sync::{
        Arc, Mutex,
        atomic::{AtomicU64, Ordering},
    },
    time::Duration,
};
use tower::{Layer, Service, ServiceExt};

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
