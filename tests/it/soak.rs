//! The fault soak: many concurrent agent-style calls (reads and keyed writes) through the full
//! client stack, a fault-injecting proxy (real TCP on both sides), and a server guarded by the
//! replay layer on a Redis of the test's own, which is killed mid-run and restarted.
//!
//! Quick by default (CI); set `BACKSTOP_SOAK_CALLS` for a longer run (BENCHMARKS.md has one).
//! Real clock, bounded: every call has a 3 s deadline.

use backstop::{
    Backstop, Outcome,
    backoff::{Backoff, RngSource},
    breaker::{Breaker, BreakerConfig},
    budget::Budget,
    idempotency::ActionContext,
    replay::{RedisStore, ReplayLayer, ReplayRequestBody},
};
use backstop_testkit::{FaultPlan, FaultProxy, RedisServer, TestServer};
use bytes::Bytes;
use http::{Request, Response};
use http_body_util::{BodyExt, Full};
use hyper_util::{client::legacy::Client, rt::TokioExecutor};
use std::{
    collections::HashMap,
    convert::Infallible,
    sync::{
        Arc, Mutex,
        atomic::{AtomicU64, Ordering},
    },
    time::Duration,
};
use tokio::time::Instant;
use tower::{Layer, ServiceExt, service_fn};

const DEADLINE: Duration = Duration::from_secs(3);

/// How a write ended, as the client saw it.
#[derive(Debug)]
enum Verdict {
    Success,
    Answered,
    Failed(Outcome),
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_stack_survives_faults_and_a_redis_crash_without_a_duplicate() {
    let calls: usize = std::env::var("BACKSTOP_SOAK_CALLS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(480);
    let workers = 16;
    let mut redis = RedisServer::start_persistent().await;

    // The server: reads, and refunds behind the replay layer. Effects counted per order.
    let effects: Arc<Mutex<HashMap<String, u32>>> = Arc::default();
    let booked = effects.clone();
    let handler = service_fn(move |req: Request<ReplayRequestBody>| {
        let booked = booked.clone();
        async move {
            let method = req.method().clone();
            let body = req
                .into_body()
                .collect()
                .await
                .map(|b| b.to_bytes())
                .unwrap_or_default();
            if method == http::Method::POST {
                *booked
                    .lock()
                    .unwrap()
                    .entry(String::from_utf8_lossy(&body).into_owned())
                    .or_default() += 1;
            }
            Ok::<_, Infallible>(Response::new(Full::new(Bytes::from_static(b"ok"))))
        }
    });
    let store = RedisStore::open(&redis.url()).unwrap();
    let server = TestServer::serve(
        ReplayLayer::new(store)
            .single_tenant()
            .lease(Duration::from_secs(5))
            .unwrap()
            .layer(handler),
    )
    .await;
    let plan = FaultPlan {
        reset_before: 0.03,
        reset_after: 0.04,
        throttle: 0.005,
        burst_503: 0.005,
        burst_len: 3,
        hang: 0.01,
        delay: 0.03,
        delay_by: Duration::from_millis(100),
    };
    let proxy = FaultProxy::start(server.addr(), plan, 2026).await;

    let budget = Budget::default();
    let breaker =
        Breaker::new(BreakerConfig::default().cooldown(Duration::from_millis(200))).unwrap();
    // The server runs each keyed write once (its replay layer): a lost reply may be repeated.
    let stack = Backstop::http("refunds-api")
        .honours_keys()
        .budget(budget.clone())
        .breaker(breaker.clone())
        .backoff(
            Backoff::full_jitter(Duration::from_millis(10), Duration::from_millis(100)).unwrap(),
        )
        .rng(RngSource::seeded(7))
        .deadline(DEADLINE)
        .attempt_timeout(Duration::from_millis(400))
        .build()
        .unwrap()
        .layer(Client::builder(TokioExecutor::new()).build_http::<Full<Bytes>>());

    // Warm the connection pools, then count the runtime's tasks: the run must not grow them.
    let mut warm = tokio::task::JoinSet::new();
    for _ in 0..workers {
        let (stack, url) = (stack.clone(), proxy.url("/orders/0"));
        warm.spawn(async move {
            let req = Request::get(url).body(Full::default()).unwrap();
            stack.oneshot(req).await.is_ok()
        });
    }
    while warm.join_next().await.is_some() {}
    let tasks_before = tokio::runtime::Handle::current()
        .metrics()
        .num_alive_tasks();
    let started = Instant::now();
    let done = Arc::new(AtomicU64::new(0));
    let mut workers_set = tokio::task::JoinSet::new();
    for w in 0..workers {
        let (stack, done) = (stack.clone(), done.clone());
        let (read_url, write_url) = (proxy.url("/orders/1"), proxy.url("/refunds"));
        let per_worker = calls / workers;
        workers_set.spawn(async move {
            let mut writes = Vec::new();
            let mut late = 0u32;
            for i in 0..per_worker {
                let t = Instant::now();
                if i % 2 == 0 {
                    let req = Request::get(&read_url).body(Full::default()).unwrap();
                    let _ = stack.clone().oneshot(req).await;
                } else {
                    let order = format!("order-{w}-{i}");
                    let mut req = Request::post(&write_url)
                        .body(Full::new(Bytes::from(order.clone())))
                        .unwrap();
                    req.extensions_mut().insert(ActionContext::tool_call(
                        &format!("run-{w}"),
                        &format!("step-{i}"),
                        "call-1",
                    ));
                    let verdict = match stack.clone().oneshot(req).await {
                        Ok(res) if res.status().is_success() => Verdict::Success,
                        Ok(_) => Verdict::Answered,
                        Err(e) => Verdict::Failed(e.outcome()),
                    };
                    writes.push((order, verdict));
                }
                // The deadline's exact end is tested on the paused clock; here the slack is
                // for two shared cores scheduling 1,000 calls and a Redis restart.
                if t.elapsed() > DEADLINE + Duration::from_secs(1) {
                    late += 1;
                }
                done.fetch_add(1, Ordering::Relaxed);
                // Agents think between tool calls.
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
            (writes, late)
        });
    }

    // A third of the way in, Redis crashes; it comes back 300 ms later with its data.
    let third = (calls / 3) as u64;
    while done.load(Ordering::Relaxed) < third {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    redis.kill();
    tokio::time::sleep(Duration::from_millis(300)).await;
    redis.restart().await;

    let mut writes = Vec::new();
    let mut late = 0;
    while let Some(r) = workers_set.join_next().await {
        let (w, l) = r.unwrap();
        writes.extend(w);
        late += l;
    }
    let elapsed = started.elapsed();

    let effects = effects.lock().unwrap().clone();
    let duplicates: u32 = effects.values().map(|n| n.saturating_sub(1)).sum();
    let (mut ok, mut answered, mut not_sent, mut unknown) = (0, 0, 0, 0);
    for (order, verdict) in &writes {
        let n = effects.get(order).copied().unwrap_or(0);
        match verdict {
            Verdict::Success => {
                ok += 1;
                assert_eq!(n, 1, "{order} succeeded, so it happened exactly once");
            }
            Verdict::Answered => answered += 1,
            Verdict::Failed(Outcome::NotSent) => {
                not_sent += 1;
                assert_eq!(
                    n, 0,
                    "{order} was reported not sent, so it must not have happened"
                );
            }
            Verdict::Failed(_) => unknown += 1,
        }
    }
    let c = proxy.counts();
    let attempts = c.received.load(Ordering::Relaxed);
    let stats = budget.stats(&"refunds-api".into());
    let retries = stats.retries;
    println!(
        "soak: {calls} calls ({} writes) by {workers} workers in {elapsed:?}; writes: {ok} succeeded, {answered} answered with an error status, \
         {not_sent} failed not sent, {unknown} failed with an unknown outcome; duplicates: {duplicates}; \
         attempts at the proxy: {attempts}; retries in the budget's last window: {retries}; faults: {} resets before, {} replies lost, {} throttled, {} 503s, {} hung, {} delayed",
        writes.len(),
        c.reset_before.load(Ordering::Relaxed),
        c.replies_lost.load(Ordering::Relaxed),
        c.throttled.load(Ordering::Relaxed),
        c.unavailable.load(Ordering::Relaxed),
        c.hung.load(Ordering::Relaxed),
        c.delayed.load(Ordering::Relaxed),
    );
    assert_eq!(duplicates, 0, "zero duplicate side effects");
    assert_eq!(late, 0, "every call ended within its deadline");
    assert!(ok > 0, "writes succeed through the faults");
    // Retries stay within the budget: in its 10 s window, 10 % of the requests plus 1/s; over
    // the whole run, the attempts at the proxy are the calls plus at most that many retries.
    let allowance = stats.requests as f64 * 0.1 + 10.0;
    assert!(
        (stats.retries as f64) <= allowance,
        "{} retries > budget {allowance}",
        stats.retries
    );
    let requests = (calls + workers) as f64;
    let bound = requests * 1.1 + elapsed.as_secs_f64() + 10.0;
    assert!((attempts as f64) <= bound, "{attempts} attempts > {bound}");
    // Shared state stays bounded, and no task outlives its call (connection pools aside).
    assert_eq!(budget.tracked(), 1);
    assert_eq!(breaker.tracked(), 1);
    // Tasks of calls that ended (a replay layer's own task finishing its record) wind down:
    // wait for that, up to 5 s, rather than for a fixed time.
    let alive = || {
        tokio::runtime::Handle::current()
            .metrics()
            .num_alive_tasks()
    };
    let waited = Instant::now();
    while alive() > tasks_before + 2 * workers && waited.elapsed() < Duration::from_secs(5) {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let tasks_after = alive();
    assert!(
        tasks_after <= tasks_before + 2 * workers,
        "tasks grew from {tasks_before} to {tasks_after}"
    );

    // Redis is back: the replay layer recovers (its connection manager reconnects) and writes
    // go through again. Wait for the first (up to 10 s), then count.
    let write = |name: String| {
        let mut req = Request::post(proxy.url("/refunds"))
            .body(Full::new(Bytes::from(name.clone())))
            .unwrap();
        req.extensions_mut()
            .insert(ActionContext::tool_call("run-after", &name, "call-1"));
        let stack = stack.clone();
        async move {
            stack
                .oneshot(req)
                .await
                .is_ok_and(|r| r.status().is_success())
        }
    };
    let waited = Instant::now();
    let mut probe = 0;
    while !write(format!("probe-{probe}")).await {
        assert!(
            waited.elapsed() < Duration::from_secs(10),
            "no write went through within 10 s of Redis's return"
        );
        probe += 1;
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let mut recovered = 0;
    for i in 0..20 {
        if write(format!("after-{i}")).await {
            recovered += 1;
        }
    }
    println!("after the run: {recovered} of 20 writes succeeded");
    assert!(
        recovered >= 10,
        "the stack and the replay layer recover after Redis returns: {recovered} of 20"
    );
}
