//! Makes `N` GETs over real loopback HTTP (a hyper server and hyper-util's client in this
//! process, one at a time), for instruction counting under `valgrind --tool=callgrind`: the
//! difference between two values of `N`, divided by the difference, is the user-space
//! instructions per request of client and server together. Wall-clock throughput on a shared
//! 2-core VM drifts by tens of percent between rounds; this does not.
//!
//! `cargo build --release -p backstop-bench --bin loopback_cost` then
//! `valgrind --tool=callgrind --callgrind-out-file=/dev/null target/release/loopback_cost CLIENT N`
//! with CLIENT one of: bare, bare-with-a-timer, backstop (the full stack), retry-gate-timeout,
//! tower.

use backstop_bench::stacks;
use bytes::Bytes;
use http::Request;
use http_body_util::{BodyExt, Full};
use std::time::Duration;
use tower::{Layer, Service, ServiceExt};

async fn run<S, B>(svc: S, url: &str, n: u64)
where
    S: Service<Request<Full<Bytes>>, Response = http::Response<B>> + Clone + Send + 'static,
    S::Future: Send,
    S::Error: std::fmt::Debug + Send,
    B: http_body::Body + Send + 'static,
    B::Data: Send,
    B::Error: std::fmt::Debug,
{
    let tasks: u64 = std::env::var("LOOPBACK_TASKS")
        .ok()
        .and_then(|t| t.parse().ok())
        .unwrap_or(1);
    if tasks > 1 {
        // Concurrent: `tasks` tasks share the N requests, as in the wall-clock bench.
        let mut set = tokio::task::JoinSet::new();
        for t in 0..tasks {
            let (svc, url) = (svc.clone(), url.to_owned());
            let share = n / tasks + u64::from(t < n % tasks);
            set.spawn(async move { sequential(svc, &url, share).await });
        }
        while let Some(r) = set.join_next().await {
            r.unwrap();
        }
    } else {
        sequential(svc, url, n).await;
    }
}

async fn sequential<S, B>(svc: S, url: &str, n: u64)
where
    S: Service<Request<Full<Bytes>>, Response = http::Response<B>> + Clone,
    S::Error: std::fmt::Debug,
    B: http_body::Body,
    B::Error: std::fmt::Debug,
{
    for _ in 0..n {
        let res = svc
            .clone()
            .oneshot(Request::get(url).body(Full::default()).unwrap())
            .await
            .unwrap();
        assert!(res.status().is_success());
        res.into_body().collect().await.unwrap();
    }
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let which = args.get(1).cloned().unwrap_or_else(|| "backstop".into());
    let n: u64 = args.get(2).and_then(|a| a.parse().ok()).unwrap_or(1_000);
    // LOOPBACK_WORKERS=2 LOOPBACK_TASKS=32: the wall-clock bench's set-up (a 2-worker runtime,
    // 32 requests in flight); by default one thread, one request at a time.
    let workers: usize = std::env::var("LOOPBACK_WORKERS")
        .ok()
        .and_then(|t| t.parse().ok())
        .unwrap_or(0);
    let rt = if workers > 0 {
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(workers)
            .enable_all()
            .build()
            .unwrap()
    } else {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap()
    };
    rt.block_on(async {
        let stacks::Loopback {
            server: _server,
            url,
            client,
        } = stacks::loopback().await;
        match which.as_str() {
            "bare" => run(client, &url, n).await,
            "bare-with-a-timer" => {
                // The bare client in a runtime that has one unrelated live timer, as nearly every
                // service has (a pool's idle timer, a keep-alive, a periodic task): the time
                // driver then does its bookkeeping on every park, timeouts or not.
                let _timer = tokio::spawn(tokio::time::sleep(Duration::from_secs(3_600)));
                tokio::task::yield_now().await;
                run(client, &url, n).await;
            }
            "backstop" => {
                let stack =
                    stacks::backstop_layer("rates-api", Duration::from_secs(5)).layer(client);
                run(stack, &url, n).await;
            }
            "retry-gate-timeout" => {
                let stack = stacks::retry_gate_stack("rates-api", Duration::from_secs(5), client);
                run(stack, &url, n).await;
            }
            "tower" => {
                let stack = tower::ServiceBuilder::new()
                    .retry(stacks::tower_policy())
                    .timeout(Duration::from_secs(5))
                    .service(client);
                run(stack, &url, n).await;
            }
            other => panic!("unknown client {other}: bare, bare-with-a-timer, backstop, retry-gate-timeout or tower"),
        }
    });
}
