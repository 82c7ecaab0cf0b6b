//! Agents that stay inside the quota they were given: a fake LLM API enforcing 60 requests and
//! 40,000 tokens a minute (429 with `Retry-After` and the `x-ratelimit-*` headers an LLM API
//! sends), 20 agent tasks of 10 calls each weighing 500 to 4,000 tokens, on tokio's paused
//! clock. Backstop reacting to 429s alone, against Backstop pacing to the advertised quota.

use backstop::{
    Backstop, BoxError, ErrorKind, Outcome,
    quota::{Cost, Quotas},
};
use bytes::Bytes;
use http::{Request, Response};
use http_body_util::Full;
use rand::{RngExt, SeedableRng, rngs::SmallRng};
use std::{
    sync::{Arc, Mutex},
    time::Duration,
};
use tokio::time::Instant;
use tower::{Layer, ServiceExt, service_fn};

type Body = Full<Bytes>;

const REQUESTS_PER_MINUTE: u64 = 60;
const TOKENS_PER_MINUTE: u64 = 40_000;
const MINUTE: Duration = Duration::from_secs(60);

/// The API's ledger: each attempt it saw (when, and whether it answered 429), the tokens it
/// served, and the current window's counts.
#[derive(Default)]
pub(super) struct Ledger {
    pub(super) arrivals: Vec<(Duration, bool)>,
    pub(super) served_tokens: u64,
    pub(super) window: u64,
    pub(super) requests: u64,
    pub(super) tokens: u64,
}

/// A fake LLM API: fixed one-minute windows from `start`; every answer carries the
/// `x-ratelimit-*` headers; an attempt over either quota gets 429 and `Retry-After` (seconds to
/// the window's end, rounded up). The request's `x-tokens` header is its weight in tokens.
fn llm_api(
    start: Instant,
    ledger: Arc<Mutex<Ledger>>,
) -> impl tower::Service<Request<Body>, Response = Response<Body>, Error = BoxError, Future: Send> + Clone
{
    service_fn(move |req: Request<Body>| {
        let ledger = ledger.clone();
        async move {
            let tokens: u64 = req
                .headers()
                .get("x-tokens")
                .and_then(|v| v.to_str().ok())
                .and_then(|v| v.parse().ok())
                .unwrap_or(0);
            let now = start.elapsed();
            let window = now.as_secs() / 60;
            let left = MINUTE.saturating_sub(Duration::from_secs(now.as_secs() % 60))
                - Duration::from_nanos(u64::from(now.subsec_nanos()));
            let mut l = ledger.lock().unwrap();
            if window != l.window {
                (l.window, l.requests, l.tokens) = (window, 0, 0);
            }
            let over =
                l.requests + 1 > REQUESTS_PER_MINUTE || l.tokens + tokens > TOKENS_PER_MINUTE;
            l.arrivals.push((now, over));
            if !over {
                l.requests += 1;
                l.tokens += tokens;
                l.served_tokens += tokens;
            }
            let reset = format!("{:.3}s", left.as_secs_f64());
            let res = Response::builder()
                .status(if over { 429 } else { 200 })
                .header("x-ratelimit-limit-requests", REQUESTS_PER_MINUTE)
                .header(
                    "x-ratelimit-remaining-requests",
                    REQUESTS_PER_MINUTE - l.requests,
                )
                .header("x-ratelimit-reset-requests", &reset)
                .header("x-ratelimit-limit-tokens", TOKENS_PER_MINUTE)
                .header("x-ratelimit-remaining-tokens", TOKENS_PER_MINUTE - l.tokens)
                .header("x-ratelimit-reset-tokens", &reset);
            let res = if over {
                res.header(
                    "retry-after",
                    left.as_secs() + u64::from(left.subsec_nanos() > 0),
                )
            } else {
                res
            };
            Ok::<_, BoxError>(res.body(Body::from("ok"))?)
        }
    })
}

/// A prompt of `tokens`: its weight in the header the fake API reads, and its `Cost` for pacing.
fn prompt(tokens: u64) -> Request<Body> {
    let mut req = Request::post("http://llm.local/v1/messages")
        .header("x-tokens", tokens)
        .body(Body::default())
        .unwrap();
    req.extensions_mut().insert(Cost::tokens(tokens));
    req
}

/// What one run measured.
#[derive(Debug)]
struct Figures {
    attempts: usize,
    refused: usize,
    failed_calls: usize,
    tokens_per_minute_share: f64,
    p99_task: Duration,
    /// The first three seconds after the first window's reset (the quota ran out before it):
    /// how long its arrivals took from first to last, and how many there were.
    herd: (Duration, usize),
}

/// 20 tasks of 10 calls, through a stack with or without pacing.
async fn agents(pace: bool) -> Figures {
    let start = Instant::now();
    let ledger: Arc<Mutex<Ledger>> = Arc::default();
    let mut builder = Backstop::http(if pace {
        "quota-paced"
    } else {
        "quota-reacting"
    })
    .max_attempts(30)
    .deadline(Duration::from_secs(3600))
    .attempt_timeout(Duration::from_secs(30))
    .no_budget()
    .no_breaker();
    if pace {
        builder = builder.pace(Quotas::seeded(Duration::from_secs(2), 11));
    }
    let llm = builder
        .build()
        .unwrap()
        .layer(llm_api(start, ledger.clone()));
    let mut rng = SmallRng::seed_from_u64(42);
    let tasks: Vec<Vec<u64>> = (0..20)
        .map(|_| (0..10).map(|_| rng.random_range(500..=4000)).collect())
        .collect();
    let mut running = tokio::task::JoinSet::new();
    for weights in tasks {
        let llm = llm.clone();
        running.spawn(async move {
            let began = Instant::now();
            let mut failed = 0;
            for tokens in weights {
                match llm.clone().oneshot(prompt(tokens)).await {
                    Ok(res) if res.status() == 200 => {}
                    _ => failed += 1,
                }
            }
            (began.elapsed(), failed)
        });
    }
    let mut task_times = Vec::new();
    let mut failed_calls = 0;
    while let Some(done) = running.join_next().await {
        let (took, failed) = done.unwrap();
        task_times.push(took);
        failed_calls += failed;
    }
    task_times.sort();
    let l = ledger.lock().unwrap();
    let elapsed = l.arrivals.iter().map(|a| a.0).max().unwrap_or_default();
    // The callers waiting for the first window's reset: when they arrived after it.
    let burst: Vec<Duration> = (l.arrivals.iter().map(|a| a.0))
        .filter(|a| *a >= MINUTE && *a < MINUTE + Duration::from_secs(3))
        .collect();
    let first = burst.iter().min().copied().unwrap_or(MINUTE);
    let herd = (
        burst.iter().max().copied().unwrap_or(MINUTE) - first,
        burst.len(),
    );
    // Of the quota of every window the run used.
    let windows = elapsed.as_secs() / 60 + 1;
    Figures {
        attempts: l.arrivals.len(),
        refused: l.arrivals.iter().filter(|a| a.1).count(),
        failed_calls,
        tokens_per_minute_share: l.served_tokens as f64 / (windows * TOKENS_PER_MINUTE) as f64,
        p99_task: task_times
            [task_times.len() * 99 / 100 - usize::from(task_times.len() * 99 % 100 == 0)],
        herd,
    }
}

fn row(name: &str, f: &Figures) -> String {
    format!(
        "| {name} | {} | {:.1} | {:.0} % | {} s | {} ms over {} arrivals | {} |",
        f.attempts,
        100.0 * f.refused as f64 / f.attempts as f64,
        100.0 * f.tokens_per_minute_share,
        f.p99_task.as_secs(),
        f.herd.0.as_millis(),
        f.herd.1,
        f.failed_calls,
    )
}

#[tokio::test(start_paused = true)]
async fn pacing_keeps_agents_inside_the_quota_they_were_given() {
    let reacting = agents(false).await;
    let paced = agents(true).await;
    println!(
        "| stack | attempts | 429s per 100 attempts | tokens served, of the quota of the windows used | p99 task time | arrivals in the 3 s after the first reset | calls failed |"
    );
    println!("|---|---:|---:|---:|---:|---:|---:|");
    println!(
        "{}",
        row("Backstop reacting to 429 and Retry-After", &reacting)
    );
    println!("{}", row("Backstop pacing to the advertised quota", &paced));
    assert_eq!(paced.failed_calls, 0, "{paced:?}");
    assert!(
        (paced.refused as f64) <= paced.attempts as f64 / 100.0,
        "at most 1 429 per 100 attempts: {paced:?}"
    );
    assert!(paced.tokens_per_minute_share >= 0.9, "{paced:?}");
    assert!(paced.refused < reacting.refused, "{paced:?} {reacting:?}");
    // The callers of one reset are spread over the quotas' 2 s, not woken in one instant.
    assert_eq!(reacting.herd.0, Duration::ZERO, "{reacting:?}");
    assert!(paced.herd.0 >= Duration::from_millis(500), "{paced:?}");
}

/// An attempt the quota cannot take before the deadline ends at once, not sent, with when the
/// quota comes back, in words a model can act on.
#[tokio::test(start_paused = true)]
async fn a_wait_past_the_deadline_ends_at_once_not_sent() {
    let start = Instant::now();
    let ledger: Arc<Mutex<Ledger>> = Arc::default();
    let llm = Backstop::http("quota-deadline")
        .deadline(Duration::from_secs(10))
        .no_breaker()
        .pace(Quotas::seeded(Duration::from_secs(1), 3))
        .build()
        .unwrap()
        .layer(llm_api(start, ledger.clone()));
    let call = |tokens: u64| llm.clone().oneshot(prompt(tokens));
    assert_eq!(call(39_000).await.unwrap().status(), 200);
    let began = Instant::now();
    let err = call(2_000).await.unwrap_err();
    assert_eq!(began.elapsed(), Duration::ZERO, "ended at once");
    assert_eq!(
        (err.kind(), err.outcome()),
        (ErrorKind::OverQuota, Outcome::NotSent)
    );
    assert_eq!(err.retry_after(), Some(Duration::from_secs(60)));
    let words = err.to_string();
    assert!(words.contains("needs 2000 tokens"), "{words}");
    assert!(words.contains("comes back in 1 min"), "{words}");
    assert!(
        err.next_action().contains("try again in 1 min"),
        "{}",
        err.next_action()
    );
    assert_eq!(ledger.lock().unwrap().arrivals.len(), 1, "nothing sent");
    // More than the whole quota: never.
    let err = call(50_000).await.unwrap_err();
    assert_eq!(err.retry_after(), None);
    assert!(
        err.next_action().contains("make it smaller"),
        "{}",
        err.next_action()
    );
}

/// A run with a spend ceiling: its calls go until the next one would pass it; that one is not
/// sent, in the run's words, and repeating it in this run will not help.
#[tokio::test(start_paused = true)]
async fn a_run_stops_at_its_spend_ceiling() {
    let start = Instant::now();
    let ledger: Arc<Mutex<Ledger>> = Arc::default();
    let llm = Backstop::http("quota-run-ceiling")
        .no_breaker()
        .pace(Quotas::seeded(Duration::from_secs(1), 5))
        .build()
        .unwrap()
        .layer(llm_api(start, ledger.clone()));
    let run = backstop::Run::new("run-ceiling").spend_ceiling(10_000);
    let call = |tokens: u64| {
        let mut req = prompt(tokens);
        run.attach(&mut req);
        llm.clone().oneshot(req)
    };
    for _ in 0..3 {
        assert_eq!(call(3_000).await.unwrap().status(), 200);
    }
    let err = call(3_000).await.unwrap_err();
    assert_eq!(
        (err.kind(), err.outcome()),
        (ErrorKind::OverQuota, Outcome::NotSent)
    );
    assert!(
        err.to_string()
            .contains("run run-ceiling has spent 9000 of the 10000 it may spend"),
        "{err}"
    );
    assert!(
        err.next_action().contains("this run has spent what it may"),
        "{}",
        err.next_action()
    );
    assert_eq!(run.spent(), 9_000);
    assert_eq!(
        ledger.lock().unwrap().arrivals.len(),
        3,
        "the fourth was not sent"
    );
    // A smaller call still fits.
    assert_eq!(call(1_000).await.unwrap().status(), 200);
}
