//! Backstop against the peers, in one run: nanoseconds and heap allocations per successful
//! call, and the ratio of the full Backstop stack to each peer.
//!
//! `cargo bench -p backstop-bench --bench compare` (under `cargo test` it runs a few thousand
//! calls per stack as a smoke test and asserts nothing about time).

use backstop_bench::{
    full_run,
    stacks::{self, Bench, drive},
};
use stats_alloc::{INSTRUMENTED_SYSTEM, Region, StatsAlloc};
use std::alloc::System;
use tokio::time::Instant;

#[global_allocator]
static GLOBAL: &StatsAlloc<System> = &INSTRUMENTED_SYSTEM;

struct Row {
    name: &'static str,
    ns: f64,
    allocs: f64,
}

fn measure<S: Bench>(
    rt: &tokio::runtime::Runtime,
    name: &'static str,
    svc: S,
    calls: u64,
    rounds: u32,
) -> Row {
    let mut svc = svc;
    // Warm up (first-use registry entries, lazily allocated state).
    rt.block_on(drive(&mut svc, calls / 10 + 1));
    let mut best = f64::MAX;
    for _ in 0..rounds {
        let start = Instant::now();
        rt.block_on(drive(&mut svc, calls));
        best = best.min(start.elapsed().as_nanos() as f64 / calls as f64);
    }
    let region = Region::new(GLOBAL);
    rt.block_on(drive(&mut svc, calls));
    let stats = region.change();
    // The request each call builds (its headers map and URI) is counted in every row alike.
    Row {
        name,
        ns: best,
        allocs: stats.allocations as f64 / calls as f64,
    }
}

fn main() {
    let (calls, rounds) = if full_run() { (200_000, 7) } else { (2_000, 1) };
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .build()
        .unwrap();
    let rows = [
        measure(&rt, "bare service", stacks::bare(), calls, rounds),
        measure(
            &rt,
            "tower: retry (Policy + TpsBudget) + timeout",
            stacks::tower_stack(),
            calls,
            rounds,
        ),
        measure(
            &rt,
            "tower-resilience: retry (budget) + circuit breaker",
            stacks::tower_resilience_stack(),
            calls,
            rounds,
        ),
        measure(
            &rt,
            "Backstop: full stack (6 jobs)",
            stacks::backstop_stack(),
            calls,
            rounds,
        ),
        measure(
            &rt,
            "Backstop: full stack without breaker",
            stacks::backstop_without("breaker"),
            calls,
            rounds,
        ),
        measure(
            &rt,
            "Backstop: full stack without budget",
            stacks::backstop_without("budget"),
            calls,
            rounds,
        ),
        measure(
            &rt,
            "Backstop: full stack without idempotency",
            stacks::backstop_without("idempotency"),
            calls,
            rounds,
        ),
        measure(
            &rt,
            "Backstop: full stack without deadline",
            stacks::backstop_without("deadline"),
            calls,
            rounds,
        ),
        measure(
            &rt,
            "Backstop: deadline",
            stacks::deadline_only(),
            calls,
            rounds,
        ),
        measure(
            &rt,
            "Backstop: attempt timeout",
            stacks::attempt_timeout_only(),
            calls,
            rounds,
        ),
        measure(&rt, "Backstop: retry", stacks::retry_only(), calls, rounds),
        measure(
            &rt,
            "Backstop: retry + budget",
            stacks::retry_budget(),
            calls,
            rounds,
        ),
        measure(
            &rt,
            "Backstop: retry + budget + attempt timeout (tower's three jobs)",
            stacks::retry_budget_timeout(),
            calls,
            rounds,
        ),
        measure(
            &rt,
            "Backstop: breaker",
            stacks::breaker_only(),
            calls,
            rounds,
        ),
        measure(
            &rt,
            "Backstop: idempotency (GET)",
            stacks::idempotency_only(),
            calls,
            rounds,
        ),
        measure(
            &rt,
            "Backstop: full stack, circuit open (refused, not sent)",
            stacks::backstop_open(),
            calls,
            rounds,
        ),
    ];
    let bare = &rows[0];
    println!("| stack | ns/call | overhead ns | allocations/call | extra allocations |");
    println!("|---|---:|---:|---:|---:|");
    for r in &rows {
        println!(
            "| {} | {:.0} | {:.0} | {:.2} | {:.2} |",
            r.name,
            r.ns,
            r.ns - bare.ns,
            r.allocs,
            r.allocs - bare.allocs
        );
    }
    let (tower, resilience, backstop) = (&rows[1], &rows[2], &rows[3]);
    println!();
    println!(
        "full Backstop stack / tower stack: {:.2}",
        backstop.ns / tower.ns
    );
    println!(
        "full Backstop stack / tower-resilience stack: {:.2}",
        backstop.ns / resilience.ns
    );
}
