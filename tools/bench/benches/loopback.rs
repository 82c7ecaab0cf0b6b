//! Real loopback HTTP: a hyper server and hyper-util's client, bare, with the Backstop stack and
//! with tower's retry + timeout. Requests per second, p50/p99 latency and CPU per request, same
//! server, same concurrency, interleaved rounds in one run.
//!
//! `cargo bench -p backstop-bench --bench loopback`; under `cargo test` a short run checks that
//! both paths work and asserts nothing about time.

use backstop_bench::{full_run, stacks};
use bytes::Bytes;
use http::Request;
use http_body_util::{BodyExt, Full};
use std::time::Duration;
use tokio::time::Instant;
use tower::{Layer as _, Service, ServiceExt};

struct Run {
    rps: f64,
    p50: Duration,
    p99: Duration,
    /// CPU time (user + system, every thread of the process: client, server and load) of the
    /// round.
    cpu: Duration,
}

/// CPU time the whole process has used so far, from `/proc/self/stat` (Linux; clock ticks of
/// 10 ms, so a round of a few CPU-seconds is measured to well under 1 %). `None` elsewhere.
fn process_cpu() -> Option<Duration> {
    let stat = std::fs::read_to_string("/proc/self/stat").ok()?;
    // Fields after the command name (which is in parentheses and may hold spaces).
    let rest = &stat[stat.rfind(')')? + 2..];
    let f: Vec<&str> = rest.split_whitespace().collect();
    let utime: u64 = f.get(11)?.parse().ok()?;
    let stime: u64 = f.get(12)?.parse().ok()?;
    Some(Duration::from_millis((utime + stime) * 10))
}

async fn load<S, B>(svc: S, url: String, total: usize, concurrency: usize) -> Run
where
    S: Service<Request<Full<Bytes>>, Response = http::Response<B>> + Clone + Send + 'static,
    S::Future: Send,
    S::Error: std::fmt::Debug + Send,
    B: http_body::Body + Send + 'static,
    B::Data: Send,
    B::Error: std::fmt::Debug,
{
    let start = Instant::now();
    let cpu_start = process_cpu();
    let mut tasks = tokio::task::JoinSet::new();
    for w in 0..concurrency {
        let (svc, url) = (svc.clone(), url.clone());
        let n = total / concurrency + usize::from(w < total % concurrency);
        tasks.spawn(async move {
            let mut lat = Vec::with_capacity(n);
            for _ in 0..n {
                let t = Instant::now();
                let res = svc
                    .clone()
                    .oneshot(Request::get(&url).body(Full::default()).unwrap())
                    .await
                    .unwrap();
                assert!(res.status().is_success());
                res.into_body().collect().await.unwrap();
                lat.push(t.elapsed());
            }
            lat
        });
    }
    let mut all = Vec::with_capacity(total);
    while let Some(l) = tasks.join_next().await {
        all.extend(l.unwrap());
    }
    let elapsed = start.elapsed();
    let cpu = match (cpu_start, process_cpu()) {
        (Some(a), Some(b)) => b.saturating_sub(a),
        _ => Duration::ZERO,
    };
    all.sort();
    Run {
        rps: total as f64 / elapsed.as_secs_f64(),
        p50: all[all.len() / 2],
        p99: all[all.len() * 99 / 100],
        cpu,
    }
}

/// The median of `v` (sorted in place).
fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// Throughput of `other` as a percentage of `bare`'s, round by round.
fn ratios(bare: &[Run], other: &[Run]) -> Vec<f64> {
    bare.iter()
        .zip(other)
        .map(|(b, o)| 100.0 * o.rps / b.rps)
        .collect()
}

/// A 95 % interval for the median of `ratios`: the percentile bootstrap (2,000 resamples, a
/// seeded generator, so the same rounds give the same interval).
fn median_interval(ratios: &[f64]) -> (f64, f64) {
    use rand::{RngExt, SeedableRng, rngs::SmallRng};
    let mut rng = SmallRng::seed_from_u64(6);
    let mut medians: Vec<f64> = (0..2_000)
        .map(|_| {
            let mut sample: Vec<f64> = (0..ratios.len())
                .map(|_| ratios[rng.random_range(0..ratios.len())])
                .collect();
            median(&mut sample)
        })
        .collect();
    medians.sort_by(f64::total_cmp);
    (medians[50], medians[1_949])
}

fn main() {
    let full = full_run();
    // BACKSTOP_LOOPBACK_ROUNDS: more rounds, a narrower interval (each round is about 1 s).
    let rounds = std::env::var("BACKSTOP_LOOPBACK_ROUNDS")
        .ok()
        .and_then(|r| r.parse().ok())
        .filter(|r| *r > 0)
        .unwrap_or(21);
    // BACKSTOP_LOOPBACK_AA=1: the bare client in all three slots, to check that a slot's place
    // in the round favours no client (both ratios should sit at 100 %).
    let aa = std::env::var_os("BACKSTOP_LOOPBACK_AA").is_some();
    let (total, concurrency, rounds) = if full {
        (10_000, 32, rounds)
    } else {
        (400, 8, 1)
    };
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let stacks::Loopback {
            server: _server,
            url,
            client,
        } = stacks::loopback().await;
        let stack = stacks::backstop_layer("rates-api", Duration::from_secs(5)).layer(client.clone());
        // What users reach for today, for comparison: tower's retry (a Policy over a TpsBudget)
        // and timeout.
        let tower = tower::ServiceBuilder::new()
            .retry(stacks::tower_policy())
            .timeout(Duration::from_secs(5))
            .service(client.clone());
        // Warm the connection pools.
        load(client.clone(), url.clone(), 200, concurrency).await;
        load(stack.clone(), url.clone(), 200, concurrency).await;
        load(tower.clone(), url.clone(), 200, concurrency).await;
        let (mut bare, mut with, mut towers) = (Vec::new(), Vec::new(), Vec::new());
        // Interleave the rounds so drift on the machine hits every client alike.
        for _ in 0..rounds {
            bare.push(load(client.clone(), url.clone(), total, concurrency).await);
            if aa {
                with.push(load(client.clone(), url.clone(), total, concurrency).await);
                towers.push(load(client.clone(), url.clone(), total, concurrency).await);
            } else {
                with.push(load(stack.clone(), url.clone(), total, concurrency).await);
                towers.push(load(tower.clone(), url.clone(), total, concurrency).await);
            }
        }
        // Each round runs the bare client and then the stack back to back; the ratio of the pair
        // is what drifts least on a shared machine, so the headline is the median of the
        // per-round ratios (with every ratio shown), next to the median round of each client.
        let mut with_ratios = ratios(&bare, &with);
        let mut tower_ratios = ratios(&bare, &towers);
        let shown: Vec<String> = with_ratios.iter().map(|r| format!("{r:.1}")).collect();
        let (low, high) = median_interval(&with_ratios);
        let (t_low, t_high) = median_interval(&tower_ratios);
        let with_median = median(&mut with_ratios);
        let tower_median = median(&mut tower_ratios);
        let median_round = |v: &[Run]| {
            let mut v: Vec<&Run> = v.iter().collect();
            v.sort_by(|a, b| a.rps.total_cmp(&b.rps));
            let r = v[v.len() / 2];
            (r.rps, r.p50, r.p99)
        };
        let (b_rps, b50, b99) = median_round(&bare);
        let (w_rps, w50, w99) = median_round(&with);
        let (t_rps, t50, t99) = median_round(&towers);
        if aa {
            println!("A/A check: every slot below ran the bare client");
        }
        println!(
            "Loopback HTTP: {total} GETs, {concurrency} concurrent, {rounds} interleaved rounds (median round shown)"
        );
        println!("| client | requests/s | p50 | p99 |");
        println!("|---|---:|---:|---:|");
        println!("| hyper-util, bare | {b_rps:.0} | {b50:?} | {b99:?} |");
        println!("| hyper-util + Backstop | {w_rps:.0} | {w50:?} | {w99:?} |");
        println!("| hyper-util + tower retry (TpsBudget) + timeout | {t_rps:.0} | {t50:?} | {t99:?} |");
        println!(
            "\nthroughput with Backstop, per round: {} % of the bare client; median {with_median:.1} % (95 % interval {low:.1}-{high:.1} %)",
            shown.join(" / "),
        );
        println!(
            "throughput with tower's retry + timeout: median {tower_median:.1} % of the bare client (95 % interval {t_low:.1}-{t_high:.1} %)",
        );
        // CPU time per request, summed over every round of a client (the process's clock ticks
        // are 10 ms, so one round alone would be measured to a few percent; all rounds together
        // to a fraction of one). At saturation, throughput is the cores divided by it.
        let cpu = |v: &[Run]| -> f64 {
            v.iter().map(|r| r.cpu.as_secs_f64()).sum::<f64>() / (v.len() * total) as f64
        };
        let (cb, cw, ct) = (cpu(&bare), cpu(&with), cpu(&towers));
        if cb > 0.0 && cw > 0.0 && ct > 0.0 {
            println!(
                "CPU per request (process, both sides, all rounds): bare {:.2} us, with Backstop {:.2} us ({:.1} % of bare's throughput at saturation), with tower {:.2} us ({:.1} %)",
                cb * 1e6,
                cw * 1e6,
                100.0 * cb / cw,
                ct * 1e6,
                100.0 * cb / ct
            );
        }
    });
}
