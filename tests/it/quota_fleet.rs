//! Three processes that share one quota: a fake LLM API on loopback (real HTTP, real time)
//! enforcing 60 requests and 40,000 tokens per window, the 20 agent tasks of `quota.rs` (10
//! calls each, 500 to 4,000 tokens) split over three child processes (this test binary run
//! again as `quota_fleet::child`), each pacing to the advertised quota. Alone, each process
//! paces against what the server says is left, and the three together send up to three times
//! it; joined through a real Redis (`Quotas::join_fleet`), they take from one account.
//!
//! The window is one second, a minute scaled down so that a run takes seconds; the spread of a
//! reset's waiters is scaled with it (50 ms).

use super::quota::Ledger;
use backstop::{
    Backstop,
    quota::{Cost, FleetConfig, Quotas},
};
use backstop_testkit::{Action, RedisServer, Seen, TestServer};
use bytes::Bytes;
use http::Request;
use http_body_util::Full;
use hyper_util::{client::legacy::Client, rt::TokioExecutor};
use rand::{RngExt, SeedableRng, rngs::SmallRng};
use std::{
    io::{BufRead, BufReader, Write},
    process::{Child, ChildStdin, Command, Stdio},
    sync::{Arc, Mutex},
    time::Duration,
};
use tokio::{sync::mpsc, time::Instant};
use tower::{Layer, ServiceExt};

type Body = Full<Bytes>;

const REQUESTS: u64 = 60;
const TOKENS: u64 = 40_000;
const WINDOW: Duration = Duration::from_secs(1);
const SPREAD: Duration = Duration::from_millis(50);

/// The fake LLM API: fixed windows from its start; every answer carries the `x-ratelimit-*`
/// headers (resets to the millisecond, rounded up); an attempt over either quota gets 429 with
/// `retry-after-ms`. The request's `x-tokens` header is its weight.
async fn llm_api(ledger: Arc<Mutex<Ledger>>) -> TestServer {
    let start = Instant::now();
    TestServer::start(move |seen: &Seen| {
        let tokens: u64 = seen
            .header("x-tokens")
            .and_then(|v| v.parse().ok())
            .unwrap_or(0);
        let now = start.elapsed();
        let window = now.as_nanos() / WINDOW.as_nanos();
        let ends = WINDOW * u32::try_from(window + 1).unwrap();
        let left_ms = (ends - now).as_nanos().div_ceil(1_000_000);
        let mut l = ledger.lock().unwrap();
        let window = u64::try_from(window).unwrap();
        if window != l.window {
            (l.window, l.requests, l.tokens) = (window, 0, 0);
        }
        let over = l.requests + 1 > REQUESTS || l.tokens + tokens > TOKENS;
        l.arrivals.push((now, over));
        if !over {
            l.requests += 1;
            l.tokens += tokens;
            l.served_tokens += tokens;
        }
        let reset = format!("{left_ms}ms");
        let (requests_left, tokens_left) = (
            (REQUESTS - l.requests).to_string(),
            (TOKENS - l.tokens).to_string(),
        );
        let mut headers = vec![
            ("x-ratelimit-limit-requests", REQUESTS.to_string()),
            ("x-ratelimit-remaining-requests", requests_left),
            ("x-ratelimit-reset-requests", reset.clone()),
            ("x-ratelimit-limit-tokens", TOKENS.to_string()),
            ("x-ratelimit-remaining-tokens", tokens_left),
            ("x-ratelimit-reset-tokens", reset),
        ];
        if over {
            headers.push(("retry-after-ms", left_ms.to_string()));
        }
        let headers: Vec<(&str, &str)> = headers.iter().map(|(k, v)| (*k, v.as_str())).collect();
        Action::respond(if over { 429 } else { 200 }, &headers, "ok")
    })
    .await
}

/// The child: one process's share of the tasks, through a Backstop stack that paces, alone or
/// in the fleet on `QUOTA_FLEET_REDIS`. It prints `READY`; on `PROBE` it makes one call of 500
/// tokens and prints `PROBED`; on `GO` it runs its tasks and prints `DONE <calls failed>
/// <each task's time in ms>`.
#[test]
fn child() {
    let Ok(api) = std::env::var("QUOTA_FLEET_API") else {
        return; // run as a test of its own: nothing to do
    };
    let redis = std::env::var("QUOTA_FLEET_REDIS").unwrap();
    let seed: u64 = std::env::var("QUOTA_FLEET_SEED").unwrap().parse().unwrap();
    let tasks: Vec<Vec<u64>> = std::env::var("QUOTA_FLEET_TASKS")
        .unwrap()
        .split(';')
        .map(|t| t.split(',').map(|w| w.parse().unwrap()).collect())
        .collect();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async move {
        let quotas = Quotas::seeded(SPREAD, seed);
        let _fleet = if redis.is_empty() {
            None
        } else {
            let fleet = quotas
                .join_fleet(
                    &redis,
                    FleetConfig::default().ask_timeout(Duration::from_secs(2)),
                )
                .unwrap();
            while !fleet.stats().connected {
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
            Some(fleet)
        };
        let client = Client::builder(TokioExecutor::new()).build_http::<Body>();
        let llm = Backstop::http("quota-fleet-llm")
            .max_attempts(30)
            .deadline(Duration::from_secs(120))
            .attempt_timeout(Duration::from_secs(10))
            .no_budget()
            .no_breaker()
            .pace(quotas)
            .build()
            .unwrap()
            .layer(client);
        let call = move |tokens: u64| {
            let mut req = Request::post(api.as_str())
                .header("x-tokens", tokens)
                .body(Body::default())
                .unwrap();
            req.extensions_mut().insert(Cost::tokens(tokens));
            llm.clone().oneshot(req)
        };
        let (tx, mut commands) = mpsc::unbounded_channel::<String>();
        std::thread::spawn(move || {
            for line in std::io::stdin().lock().lines().map_while(Result::ok) {
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        println!("READY");
        while let Some(command) = commands.recv().await {
            match command.as_str() {
                "PROBE" => {
                    let ok = call(500).await.is_ok_and(|r| r.status() == 200);
                    println!("PROBED {ok}");
                }
                "GO" => {
                    let mut running = tokio::task::JoinSet::new();
                    for weights in tasks.clone() {
                        let call = call.clone();
                        running.spawn(async move {
                            let began = Instant::now();
                            let mut failed = 0;
                            for tokens in weights {
                                if !call(tokens).await.is_ok_and(|r| r.status() == 200) {
                                    failed += 1;
                                }
                            }
                            (began.elapsed(), failed)
                        });
                    }
                    let (mut failed, mut times) = (0, Vec::new());
                    while let Some(done) = running.join_next().await {
                        let (took, f) = done.unwrap();
                        failed += f;
                        times.push(took.as_millis().to_string());
                    }
                    println!("DONE {failed} {}", times.join(","));
                    return;
                }
                _ => println!("?"),
            }
        }
    });
}

/// One agent process and the lines it prints.
struct Agent {
    child: Child,
    stdin: ChildStdin,
    lines: mpsc::UnboundedReceiver<String>,
}

impl Agent {
    fn start(api: &str, redis: &str, seed: u64, tasks: &[Vec<u64>]) -> Agent {
        let tasks: Vec<String> = tasks
            .iter()
            .map(|t| t.iter().map(u64::to_string).collect::<Vec<_>>().join(","))
            .collect();
        let mut child = Command::new(std::env::current_exe().unwrap())
            .args([
                "--exact",
                "quota_fleet::child",
                "--nocapture",
                "--test-threads=1",
                "-q",
            ])
            .env("QUOTA_FLEET_API", api)
            .env("QUOTA_FLEET_REDIS", redis)
            .env("QUOTA_FLEET_SEED", seed.to_string())
            .env("QUOTA_FLEET_TASKS", tasks.join(";"))
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        let stdin = child.stdin.take().unwrap();
        let out = child.stdout.take().unwrap();
        let (tx, lines) = mpsc::unbounded_channel();
        std::thread::spawn(move || {
            for line in BufReader::new(out).lines().map_while(Result::ok) {
                if tx.send(line).is_err() {
                    return;
                }
            }
        });
        Agent {
            child,
            stdin,
            lines,
        }
    }

    fn send(&mut self, command: &str) {
        writeln!(self.stdin, "{command}").unwrap();
        self.stdin.flush().unwrap();
    }

    /// The next line that starts with `prefix`, without it (other lines, the test harness's
    /// own, skipped).
    async fn expect(&mut self, prefix: &str) -> String {
        let wait = async {
            loop {
                let line = self.lines.recv().await.expect("the agent is running");
                if let Some(rest) = line.strip_prefix(prefix) {
                    return rest.trim().to_owned();
                }
            }
        };
        tokio::time::timeout(Duration::from_secs(300), wait)
            .await
            .unwrap_or_else(|_| panic!("the agent never printed {prefix}"))
    }
}

impl Drop for Agent {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// What one run of the three processes measured.
#[derive(Debug)]
struct Figures {
    attempts: usize,
    refused: usize,
    failed_calls: u32,
    tokens_share: f64,
    p99_task: Duration,
}

/// The 20 tasks over three processes, alone or joined through `redis`.
async fn three_processes(redis: Option<&RedisServer>) -> Figures {
    let ledger: Arc<Mutex<Ledger>> = Arc::default();
    let api = llm_api(ledger.clone()).await;
    let mut rng = SmallRng::seed_from_u64(42);
    let tasks: Vec<Vec<u64>> = (0..20)
        .map(|_| (0..10).map(|_| rng.random_range(500..=4000)).collect())
        .collect();
    let url = redis.map(RedisServer::url).unwrap_or_default();
    let mut agents: Vec<Agent> = [&tasks[..7], &tasks[7..14], &tasks[14..]]
        .iter()
        .enumerate()
        .map(|(i, share)| Agent::start(&api.url("/v1/messages"), &url, 11 + i as u64, share))
        .collect();
    for agent in &mut agents {
        agent.expect("READY").await;
    }
    // Each process makes one call first, one after the other: what the server says of its
    // quota is then known to each of them (alone) or to the fleet.
    for agent in &mut agents {
        agent.send("PROBE");
        assert_eq!(agent.expect("PROBED").await, "true");
    }
    let began = Instant::now();
    for agent in &mut agents {
        agent.send("GO");
    }
    let (mut failed_calls, mut times) = (0, Vec::new());
    for agent in &mut agents {
        let done = agent.expect("DONE").await;
        let (failed, took) = done.split_once(' ').unwrap();
        failed_calls += failed.parse::<u32>().unwrap();
        times.extend(
            took.split(',')
                .map(|ms| Duration::from_millis(ms.parse().unwrap())),
        );
    }
    let elapsed = began.elapsed();
    times.sort();
    let l = ledger.lock().unwrap();
    let windows = (elapsed.as_nanos() / WINDOW.as_nanos() + 1) as f64;
    Figures {
        attempts: l.arrivals.len(),
        refused: l.arrivals.iter().filter(|a| a.1).count(),
        failed_calls,
        tokens_share: l.served_tokens as f64 / (windows * TOKENS as f64),
        p99_task: times[times.len() * 99 / 100 - usize::from(times.len() * 99 % 100 == 0)],
    }
}

fn row(name: &str, f: &Figures) -> String {
    format!(
        "| {name} | {} | {:.1} | {:.0} % | {:.1} s | {} |",
        f.attempts,
        100.0 * f.refused as f64 / f.attempts as f64,
        100.0 * f.tokens_share,
        f.p99_task.as_secs_f64(),
        f.failed_calls,
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_processes_stay_inside_one_quota_through_redis() {
    let redis = RedisServer::start().await;
    let alone = three_processes(None).await;
    let fleet = three_processes(Some(&redis)).await;
    println!(
        "| three processes | attempts | 429s per 100 attempts | tokens served, of the quota of the windows used | p99 task time | calls failed |"
    );
    println!("|---|---:|---:|---:|---:|---:|");
    println!("{}", row("each pacing alone", &alone));
    println!("{}", row("sharing the quota through Redis", &fleet));
    assert_eq!(fleet.failed_calls, 0, "{fleet:?}");
    assert!(
        (fleet.refused as f64) <= fleet.attempts as f64 / 100.0,
        "at most 1 429 per 100 attempts: {fleet:?}"
    );
    assert!(alone.refused > fleet.refused, "{alone:?} {fleet:?}");
}
