//! Success-path cost per call, and the failure paths, with criterion.
//!
//! `cargo bench -p backstop-bench --bench overhead` (add `-- --quick` for a fast run).

use backstop::Dependency;
use backstop_bench::stacks::{self, Bench, drive};
use criterion::{Criterion, criterion_group, criterion_main};
use tokio::runtime::{Builder, Runtime};
use tokio::time::Instant;

fn runtime() -> Runtime {
    Builder::new_current_thread().enable_time().build().unwrap()
}

fn bench<S: Bench>(c: &mut Criterion, rt: &Runtime, name: &str, svc: S) {
    c.bench_function(name, |b| {
        b.iter_custom(|iters| {
            let mut svc = svc.clone();
            rt.block_on(async {
                let start = Instant::now();
                drive(&mut svc, iters).await;
                start.elapsed()
            })
        })
    });
}

fn success_path(c: &mut Criterion) {
    let rt = runtime();
    bench(c, &rt, "success/bare", stacks::bare());
    bench(
        c,
        &rt,
        "success/tower retry+TpsBudget+timeout",
        stacks::tower_stack(),
    );
    bench(
        c,
        &rt,
        "success/tower-resilience retry+budget+breaker",
        stacks::tower_resilience_stack(),
    );
    bench(
        c,
        &rt,
        "success/backstop full stack",
        stacks::backstop_stack(),
    );
    bench(c, &rt, "layer/deadline", stacks::deadline_only());
    bench(
        c,
        &rt,
        "layer/attempt timeout",
        stacks::attempt_timeout_only(),
    );
    bench(c, &rt, "layer/retry", stacks::retry_only());
    bench(c, &rt, "layer/retry+budget", stacks::retry_budget());
    bench(
        c,
        &rt,
        "layer/retry+budget+attempt timeout (tower's three jobs)",
        stacks::retry_budget_timeout(),
    );
    bench(c, &rt, "layer/breaker", stacks::breaker_only());
    bench(
        c,
        &rt,
        "layer/idempotency (GET)",
        stacks::idempotency_only(),
    );
}

fn failure_paths(c: &mut Criterion) {
    let rt = runtime();
    let (open, calls) = stacks::open_breaker();
    bench(c, &rt, "failure/open breaker fail-fast", open);
    assert_eq!(
        calls.load(std::sync::atomic::Ordering::Relaxed),
        0,
        "an open breaker never touches the service"
    );
    bench(
        c,
        &rt,
        "failure/budget refuses the retry",
        stacks::refused_budget(),
    );

    // Two threads hammering one dependency's shared state.
    let budget = backstop::budget::Budget::default();
    let dep = Dependency::new("carrier-api");
    c.bench_function("contention/budget deposit, 2 threads", |b| {
        b.iter_custom(|iters| {
            let start = Instant::now();
            std::thread::scope(|s| {
                for _ in 0..2 {
                    let (budget, dep) = (budget.clone(), dep.clone());
                    s.spawn(move || {
                        for _ in 0..iters {
                            backstop::budget::RetryBudget::deposit(
                                &budget,
                                &dep,
                                tokio::time::Instant::now(),
                            );
                        }
                    });
                }
            });
            start.elapsed()
        })
    });
    let svc = stacks::breaker_only();
    let runtimes = [runtime(), runtime()];
    c.bench_function("contention/breaker success path, 2 threads", |b| {
        b.iter_custom(|iters| {
            let start = Instant::now();
            std::thread::scope(|s| {
                for rt in &runtimes {
                    let mut svc = svc.clone();
                    s.spawn(move || rt.block_on(drive(&mut svc, iters)));
                }
            });
            start.elapsed()
        })
    });
}

criterion_group!(benches, success_path, failure_paths);
criterion_main!(benches);
