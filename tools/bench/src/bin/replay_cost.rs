//! What the server-side replay layer costs per request, by store. Build it with
//! `cargo build --release -p backstop-bench --features stores --bin replay_cost`.
//!
//! - `replay_cost STORE N` (STORE: `bare`, `memory-first`, `memory-replay`) runs N requests
//!   in one process, for instruction counting under
//!   `valgrind --tool=callgrind --callgrind-out-file=/dev/null` (two values of N; the
//!   difference divided by the difference in N is the cost per request). `bare` is the handler
//!   alone; `memory-first` gives every request a new key (claim, handler, store the result);
//!   `memory-replay` repeats one key (claim finds the stored result).
//! - `replay_cost latency N` starts a Redis (append-only file) and a PostgreSQL of its own on
//!   loopback and, for each store, times N first executions and N replays one at a time, next
//!   to the bare handler, and counts the store's round trips per request. It prints p50 and
//!   p99 of the time each request takes, and what the layer adds to the bare handler's.

use backstop::replay::{
    Claim, Fingerprint, MemoryStore, OnVolatile, PgStore, RedisStore, ReplayLayer,
    ReplayRequestBody, ReplayStore, StoreFuture, StoredResponse,
};
use bytes::Bytes;
use http::{Request, Response};
use http_body_util::{BodyExt, Full};
use std::{
    convert::Infallible,
    sync::{
        Arc,
        atomic::{AtomicU64, Ordering},
    },
    time::Duration,
};
use tokio::time::Instant;
use tower::{Layer, Service, ServiceExt, service_fn};

fn handler() -> impl Service<
    Request<ReplayRequestBody>,
    Response = Response<Full<Bytes>>,
    Error = Infallible,
    Future: Send,
> + Clone
+ Send
+ 'static {
    service_fn(|req: Request<ReplayRequestBody>| async move {
        let body = req
            .into_body()
            .collect()
            .await
            .map(|b| b.to_bytes())
            .unwrap_or_default();
        Ok(Response::builder()
            .status(201)
            .header("content-type", "application/json")
            .body(Full::new(Bytes::from(format!(
                r#"{{"refund_id":"R1","bytes":{}}}"#,
                body.len()
            ))))
            .unwrap())
    })
}

/// A realistic refund request: five headers and a 64-byte JSON body.
fn request(key: &str) -> Request<Full<Bytes>> {
    Request::post("http://payments.local/refunds")
        .header("content-type", "application/json")
        .header("accept", "application/json")
        .header("user-agent", "agent-runtime/1.0")
        .header("x-request-id", "4bf92f3577b34da6")
        .header("idempotency-key", key)
        .body(Full::from(
            r#"{"order_id":"ORD-4812","amount_cents":4900,"reason":"damaged item"}"#,
        ))
        .unwrap()
}

/// Counts a store's operations: each is one round trip on Redis and PostgreSQL.
#[derive(Debug)]
struct Counted {
    inner: Arc<dyn ReplayStore>,
    ops: Arc<AtomicU64>,
}

impl ReplayStore for Counted {
    fn claim<'a>(&'a self, k: &'a str, f: Fingerprint, l: Duration) -> StoreFuture<'a, Claim> {
        self.ops.fetch_add(1, Ordering::Relaxed);
        self.inner.claim(k, f, l)
    }
    fn renew<'a>(&'a self, k: &'a str, t: u64, l: Duration) -> StoreFuture<'a, bool> {
        self.ops.fetch_add(1, Ordering::Relaxed);
        self.inner.renew(k, t, l)
    }
    fn complete<'a>(
        &'a self,
        k: &'a str,
        t: u64,
        r: &'a StoredResponse,
        ttl: Duration,
    ) -> StoreFuture<'a, bool> {
        self.ops.fetch_add(1, Ordering::Relaxed);
        self.inner.complete(k, t, r, ttl)
    }
    fn release<'a>(&'a self, k: &'a str, t: u64) -> StoreFuture<'a, bool> {
        self.ops.fetch_add(1, Ordering::Relaxed);
        self.inner.release(k, t)
    }
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let n: u64 = args.get(2).and_then(|a| a.parse().ok()).unwrap_or(2_000);
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    match args.get(1).map(String::as_str).unwrap_or("memory-first") {
        "bare" => rt.block_on(async {
            let svc = handler();
            for i in 0..n {
                let req =
                    request(&format!("key-{i}")).map(|b| b.map_err(|e| match e {}).boxed_unsync());
                let res = svc.clone().oneshot(req).await.unwrap();
                let _ = res.into_body().collect().await;
            }
        }),
        "memory-first" | "memory-replay" => rt.block_on(async {
            let replay = args[1] == "memory-replay";
            let svc = ReplayLayer::new(MemoryStore::new(1_000_000))
                .single_tenant()
                .layer(handler());
            for i in 0..n {
                let key = if replay {
                    "one-key".to_owned()
                } else {
                    format!("key-{i}")
                };
                let res = svc.clone().oneshot(request(&key)).await.unwrap();
                let _ = res.into_body().collect().await;
            }
        }),
        "latency" => rt.block_on(latency(n)),
        other => panic!("unknown mode {other}"),
    }
}

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[i]
}

async fn time<F, Fut>(n: u64, mut f: F) -> (Duration, Duration)
where
    F: FnMut(u64) -> Fut,
    Fut: std::future::Future<Output = ()>,
{
    let mut took = Vec::with_capacity(n as usize);
    for i in 0..n {
        let start = Instant::now();
        f(i).await;
        took.push(start.elapsed());
    }
    took.sort();
    (percentile(&took, 0.5), percentile(&took, 0.99))
}

async fn latency(n: u64) {
    let redis = backstop_testkit::RedisServer::start_persistent().await;
    let pg = backstop_testkit::PostgresServer::start().await;
    let bare = handler();
    let (b50, b99) = time(n, |i| {
        let svc = bare.clone();
        async move {
            let req = request(&format!("k{i}")).map(|b| b.map_err(|e| match e {}).boxed_unsync());
            let _ = svc.oneshot(req).await.unwrap().into_body().collect().await;
        }
    })
    .await;
    println!("bare handler: p50 {b50:?}, p99 {b99:?}");
    let stores: Vec<(&str, Arc<dyn ReplayStore>)> = vec![
        ("memory", Arc::new(MemoryStore::new(1_000_000))),
        (
            "redis",
            Arc::new(
                RedisStore::connect(&redis.url(), OnVolatile::Refuse)
                    .await
                    .unwrap(),
            ),
        ),
        (
            "postgres",
            Arc::new(PgStore::connect(&pg.url()).await.unwrap()),
        ),
    ];
    for (name, store) in stores {
        let ops = Arc::new(AtomicU64::new(0));
        let counted: Arc<dyn ReplayStore> = Arc::new(Counted {
            inner: store,
            ops: ops.clone(),
        });
        let svc = ReplayLayer::with_store(counted)
            .single_tenant()
            .layer(handler());
        // Warm the connection (and Redis's script cache) first.
        let _ = svc.clone().oneshot(request("warm-up")).await.unwrap();
        ops.store(0, Ordering::Relaxed);
        let (f50, f99) = time(n, |i| {
            let svc = svc.clone();
            async move {
                let res = svc
                    .oneshot(request(&format!("{name}-first-{i}")))
                    .await
                    .unwrap();
                let _ = res.into_body().collect().await;
            }
        })
        .await;
        let first_ops = ops.swap(0, Ordering::Relaxed) as f64 / n as f64;
        let (r50, r99) = time(n, |_| {
            let svc = svc.clone();
            async move {
                let res = svc.oneshot(request("warm-up")).await.unwrap();
                let _ = res.into_body().collect().await;
            }
        })
        .await;
        let replay_ops = ops.swap(0, Ordering::Relaxed) as f64 / n as f64;
        println!(
            "{name}: first execution p50 {f50:?} p99 {f99:?} (added p50 {:?} p99 {:?}), \
             {first_ops:.2} round trips; replay p50 {r50:?} p99 {r99:?}, {replay_ops:.2} round trips",
            f50.saturating_sub(b50),
            f99.saturating_sub(b99),
        );
    }
}
