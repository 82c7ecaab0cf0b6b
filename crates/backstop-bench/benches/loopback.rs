//! Real loopback HTTP: a hyper server and hyper-util's client, with and without the Backstop
//! stack. Requests per second and p50/p99 latency, same server, same concurrency, one run.
//!
//! `cargo bench -p backstop-bench --bench loopback`; under `cargo test` a short run checks that
//! both paths work and asserts nothing about time.

use backstop::{Backstop, backoff::RngSource, breaker::Breaker, budget::Budget};
use backstop_bench::full_run;
use backstop_testkit::{Action, TestServer};
use bytes::Bytes;
use http::Request;
use http_body_util::{BodyExt, Full};
use hyper_util::{client::legacy::Client, rt::TokioExecutor};
use std::time::Duration;
use tokio::time::Instant;
use tower::{Layer, Service, ServiceExt};

struct Run {
    rps: f64,
    p50: Duration,
    p99: Duration,
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
    all.sort();
    Run {
        rps: total as f64 / elapsed.as_secs_f64(),
        p50: all[all.len() / 2],
        p99: all[all.len() * 99 / 100],
    }
}

fn main() {
    let full = full_run();
    let (total, concurrency, rounds) = if full { (50_000, 32, 3) } else { (400, 8, 1) };
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let server = TestServer::start(|_| Action::respond(200, &[], r#"{"ground":8.40}"#)).await;
        let url = server.url("/rates");
        let client = Client::builder(TokioExecutor::new()).build_http::<Full<Bytes>>();
        let stack = Backstop::http("rates-api")
            .budget(Budget::default())
            .breaker(Breaker::default())
            .rng(RngSource::seeded(1))
            .attempt_timeout(Duration::from_secs(5))
            .build()
            .unwrap()
            .layer(client.clone());
        // Warm the connection pools.
        load(client.clone(), url.clone(), 200, concurrency).await;
        load(stack.clone(), url.clone(), 200, concurrency).await;
        let (mut bare, mut with) = (Vec::new(), Vec::new());
        // Interleave the rounds so drift on the machine hits both alike.
        for _ in 0..rounds {
            bare.push(load(client.clone(), url.clone(), total, concurrency).await);
            with.push(load(stack.clone(), url.clone(), total, concurrency).await);
        }
        let best = |v: &[Run]| {
            v.iter()
                .max_by(|a, b| a.rps.total_cmp(&b.rps))
                .map(|r| (r.rps, r.p50, r.p99))
                .unwrap()
        };
        let (b_rps, b50, b99) = best(&bare);
        let (w_rps, w50, w99) = best(&with);
        println!("Loopback HTTP: {total} GETs, {concurrency} concurrent, best of {rounds} rounds");
        println!("| client | requests/s | p50 | p99 |");
        println!("|---|---:|---:|---:|");
        println!("| hyper-util, bare | {b_rps:.0} | {b50:?} | {b99:?} |");
        println!("| hyper-util + Backstop | {w_rps:.0} | {w50:?} | {w99:?} |");
        println!(
            "\nthroughput with Backstop: {:.1} % of the bare client",
            100.0 * w_rps / b_rps
        );
    });
}
