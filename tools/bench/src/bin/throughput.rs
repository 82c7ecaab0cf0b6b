//! How much one replay server and one journal database sustain:
//! `cargo run --release -p backstop-bench --features stores --bin throughput [SECONDS]`.
//!
//! - **Replay**: one replay layer (in process, no HTTP framing) over its store, a Redis with an
//!   append-only file and a PostgreSQL, each a server of the bench's own on loopback; 1, 16 and
//!   64 callers send keyed requests at once, each with a key of its own (a first execution:
//!   claim, handler, stored result), for SECONDS each. Keyed requests per second, and the p50
//!   and p99 of each request's time.
//! - **Journal**: a PostgreSQL of the bench's own; 1, 4 and 16 workers (each its own pool, as
//!   separate processes would have) run a typed workflow of five steps whose calls answer at
//!   once, over runs started ahead. Journal steps per second, and the p50 and p99 of each step's
//!   time (two writes: `sent`, then the outcome).
//!
//! The PostgreSQL clusters run with `fsync=off` (the test kit's): their figures leave out the
//! disk flush a production server does at each commit. Client, servers and databases share
//! this machine's two cores.

use backstop::journal::{Journal, RunContext, RunError, Worker, Workflow};
use backstop::replay::{OnVolatile, PgStore, RedisStore, ReplayLayer, ReplayStore};
use backstop::{BoxError, Outcome, core::ReportsOutcome};
use bytes::Bytes;
use http::{Request, Response};
use http_body_util::Full;
use std::{
    fmt,
    sync::{
        Arc, Mutex,
        atomic::{AtomicU64, Ordering},
    },
    time::Duration,
};
use tokio::time::Instant;
use tower::{Layer, ServiceExt, service_fn};

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[i]
}

fn ms(d: Duration) -> String {
    format!("{:.2} ms", d.as_secs_f64() * 1e3)
}

/// Keyed requests from `callers` at once for `for_how_long`, each with a key of its own.
async fn replay<S: ReplayStore + Send + Sync + 'static>(
    store: &str,
    s: S,
    callers: usize,
    for_how_long: Duration,
) {
    let svc = ReplayLayer::new(s)
        .single_tenant()
        .layer(service_fn(|_req| async {
            Ok::<_, std::convert::Infallible>(
                Response::builder()
                    .status(201)
                    .body(Full::new(Bytes::from_static(br#"{"refund_id":"R1"}"#)))
                    .unwrap(),
            )
        }));
    let until = Instant::now() + for_how_long;
    let started = Instant::now();
    let mut tasks = tokio::task::JoinSet::new();
    for c in 0..callers {
        let svc = svc.clone();
        tasks.spawn(async move {
            let mut took = Vec::new();
            let mut n = 0u64;
            while Instant::now() < until {
                let req = Request::post("http://refunds.local/refunds")
                    .header("idempotency-key", format!("\"{c}-{n}\""))
                    .header("content-type", "application/json")
                    .body(Full::new(Bytes::from_static(
                        br#"{"order":"A-7","eur":49}"#,
                    )))
                    .unwrap();
                let start = Instant::now();
                let res = svc.clone().oneshot(req).await.unwrap();
                assert_eq!(res.status(), 201);
                took.push(start.elapsed());
                n += 1;
            }
            took
        });
    }
    let mut took = Vec::new();
    while let Some(t) = tasks.join_next().await {
        took.extend(t.unwrap());
    }
    let elapsed = started.elapsed();
    took.sort();
    println!(
        "| {store} | {callers} | {:.0} | {} | {} |",
        took.len() as f64 / elapsed.as_secs_f64(),
        ms(percentile(&took, 0.5)),
        ms(percentile(&took, 0.99)),
    );
}

/// A call that answers at once.
#[derive(Debug)]
struct Never;

impl fmt::Display for Never {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("never")
    }
}

impl ReportsOutcome for Never {
    fn outcome(&self) -> Outcome {
        Outcome::NotSent
    }
}

const FIVE_STEPS: Workflow<u32, u32> = Workflow::new("five-steps");

async fn five_steps(
    ctx: RunContext,
    n: u32,
    took: Arc<Mutex<Vec<Duration>>>,
    calls: Arc<AtomicU64>,
) -> Result<u32, RunError> {
    let mut sum = n;
    for step in ["one", "two", "three", "four", "five"] {
        let start = Instant::now();
        let calls = calls.clone();
        sum += ctx
            .run(step, &sum, |_| async move {
                calls.fetch_add(1, Ordering::Relaxed);
                Ok::<_, Never>(1u32)
            })
            .await?;
        took.lock().unwrap().push(start.elapsed());
    }
    Ok(sum)
}

/// `workers` workers, each its own pool, run `runs` runs of five steps started ahead.
async fn journal(url: &str, workers: usize, runs: usize) -> Result<(), BoxError> {
    let journal = Journal::postgres(url).await?;
    let prefix = format!("w{workers}");
    for r in 0..runs {
        FIVE_STEPS
            .start(&journal, &format!("{prefix}-{r}"), &(r as u32))
            .await?;
    }
    let took = Arc::new(Mutex::new(Vec::new()));
    let calls = Arc::new(AtomicU64::new(0));
    let started = Instant::now();
    let mut tasks = tokio::task::JoinSet::new();
    for w in 0..workers {
        let own = Journal::postgres(url).await?;
        let (took, calls) = (took.clone(), calls.clone());
        let worker = Worker::new(own, &format!("{prefix}-worker-{w}"))
            .register(FIVE_STEPS, move |ctx, n| {
                five_steps(ctx, n, took.clone(), calls.clone())
            })
            .poll_interval(Duration::from_millis(5));
        tasks.spawn(async move { worker.run_until_idle().await });
    }
    let mut ends = std::collections::BTreeMap::new();
    while let Some(reports) = tasks.join_next().await {
        for report in reports?? {
            let end = format!("{:?}", report.end);
            let kind = end.split([' ', '{']).next().unwrap_or_default().to_owned();
            *ends.entry(kind).or_insert(0) += 1;
            if !matches!(report.end, backstop::journal::RunEnd::Succeeded { .. }) {
                eprintln!("{}: {end}", report.run);
            }
        }
    }
    let elapsed = started.elapsed();
    assert_eq!(
        ends.get("Succeeded").copied().unwrap_or(0),
        runs,
        "every run once: {ends:?}"
    );
    assert_eq!(
        calls.load(Ordering::Relaxed),
        runs as u64 * 5,
        "every step's call once"
    );
    let mut took = std::mem::take(&mut *took.lock().unwrap());
    took.sort();
    println!(
        "| {workers} | {} | {:.0} | {} | {} |",
        took.len(),
        took.len() as f64 / elapsed.as_secs_f64(),
        ms(percentile(&took, 0.5)),
        ms(percentile(&took, 0.99)),
    );
    Ok(())
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() -> Result<(), BoxError> {
    let seconds: u64 = std::env::args()
        .nth(1)
        .and_then(|a| a.parse().ok())
        .unwrap_or(5);
    let for_how_long = Duration::from_secs(seconds);
    let only_journal = std::env::args().nth(2).as_deref() == Some("journal");

    if !only_journal {
        println!("| store | callers at once | keyed requests per second | p50 | p99 |");
        println!("|---|---:|---:|---:|---:|");
        let redis = backstop_testkit::RedisServer::start_persistent().await;
        let pg = backstop_testkit::PostgresServer::start().await;
        for callers in [1, 16, 64] {
            let store = RedisStore::connect(&redis.url(), OnVolatile::Refuse).await?;
            replay("Redis (append-only file)", store, callers, for_how_long).await;
        }
        for callers in [1, 16, 64] {
            let store = PgStore::connect(&pg.url()).await?;
            replay("PostgreSQL", store, callers, for_how_long).await;
        }
    }

    println!();
    println!("| workers | steps | journal steps per second | p50 per step | p99 per step |");
    println!("|---:|---:|---:|---:|---:|");
    let runs = (seconds as usize * 60).max(60);
    for workers in [1, 4, 16] {
        let db = backstop_testkit::PostgresServer::start().await;
        journal(&db.url(), workers, runs).await?;
    }
    Ok(())
}
