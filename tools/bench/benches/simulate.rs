//! The figures Backstop is built on, measured on the real stack: reliability of 20-call agent tasks
//! with 2 % transient failures, duplicates with and without keys, and the load a total outage
//! puts on the dependency under each retry strategy.
//!
//! `cargo bench -p backstop-bench --bench simulate` (10,000 tasks, a 20-minute outage); under
//! `cargo test` it runs a small version and asserts the safety figures (no duplicates, bounded
//! load), never a timing.

use backstop_bench::{full_run, sim};
use std::time::Duration;

fn main() {
    let full = full_run();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .start_paused(true)
        .build()
        .unwrap();
    let tasks = if full { 10_000 } else { 200 };
    let r = rt.block_on(sim::reliability(tasks, 20, 0.02, 42));
    println!(
        "Reliability: {} tasks x {} tool calls, 2 % transient failures per attempt, half of them replies lost after the effect was committed",
        r.tasks, r.calls
    );
    println!("| figure | measured | expected (arithmetic) |");
    println!("|---|---:|---:|");
    println!(
        "| clean tasks without retries | {:.2} % | 66.8 % |",
        r.clean_without_retries * 100.0
    );
    println!(
        "| clean tasks with Backstop (3 attempts) | {:.3} % | 99.98 % |",
        r.clean_with_backstop * 100.0
    );
    println!(
        "| extra load from retries | {:.2} % | 2.04 % |",
        r.extra_load * 100.0
    );
    println!(
        "| duplicate side effects per {} runs, Backstop (keys + replay layer) | {} | 0 |",
        r.tasks, r.duplicates_backstop
    );
    println!(
        "| duplicate side effects per {} runs, naive retry | {} | - |",
        r.tasks, r.duplicates_naive
    );
    assert_eq!(
        r.duplicates_backstop, 0,
        "keys and the replay layer must prevent every duplicate"
    );
    assert!(
        r.duplicates_naive > 0,
        "the naive retry duplicates lost-reply effects"
    );
    assert!(r.clean_with_backstop > r.clean_without_retries);
    if full {
        assert!(r.clean_with_backstop >= 0.9998, "{}", r.clean_with_backstop);
    }

    latency_shift(&rt, full);
    tail_latency(&rt, full);

    let minutes = if full { 20 } else { 2 };
    let every = Duration::from_millis(10);
    let rows = rt.block_on(sim::outage(Duration::from_secs(minutes * 60), every));
    println!();
    println!(
        "Total outage of {minutes} min, one logical request every 10 ms (100/s), dependency always 503:"
    );
    println!("| strategy | requests | attempts at the dependency | attempts per request |");
    println!("|---|---:|---:|---:|");
    for o in &rows {
        println!(
            "| {} | {} | {} | {:.3} |",
            o.name,
            o.requests,
            o.attempts,
            o.amplification()
        );
    }
    assert!(
        (rows[0].amplification() - 27.0).abs() < 1e-9,
        "three nested layers of 3 attempts are 27x"
    );
    let budget_only = &rows[3];
    let full_stack = &rows[4];
    // At 100 requests/s the ratio is above the floor: 10 % of the requests (and one window's
    // worth of slack at the window's edges).
    let bound = budget_only.requests as f64 * 1.1 + 10.0;
    assert!(
        budget_only.attempts as f64 <= bound,
        "the budget caps load: {} > {bound}",
        budget_only.attempts
    );
    assert!(
        full_stack.amplification() <= 1.1,
        "budget and breaker: {}",
        full_stack.amplification()
    );
    assert!(
        full_stack.attempts <= budget_only.attempts,
        "the breaker only ever removes load"
    );
    // One request every 100 ms (10/s): the floor (1/s = 10 %) and the ratio meet.
    let slow = rt.block_on(sim::outage(
        Duration::from_secs(minutes * 60),
        Duration::from_millis(100),
    ));
    println!(
        "\nthe same outage at one request every 100 ms: budget only {:.3} attempts per request",
        slow[3].amplification()
    );
    assert!(
        slow[3].attempts as f64 <= slow[3].requests as f64 * 1.1 + 10.0,
        "the floor is a minimum, not an addition: {}",
        slow[3].amplification()
    );
    println!(
        "\nthe breaker spared the dependency {} of {} attempts ({:.1} %) over the outage",
        budget_only.attempts - full_stack.attempts,
        budget_only.attempts,
        100.0 * (budget_only.attempts - full_stack.attempts) as f64 / budget_only.attempts as f64
    );
}

/// The dependency's latency shifts from a 50 ms to a 400 ms median: a fixed attempt timeout
/// against one learned from latency.
fn latency_shift(rt: &tokio::runtime::Runtime, full: bool) {
    let phase = Duration::from_secs(if full { 120 } else { 20 });
    let rows = rt.block_on(sim::latency_shift(phase, Duration::from_millis(10), 7));
    println!(
        "\nLatency shift: a GET every 10 ms, {} s at a 50 ms median then {} s at 400 ms (lognormal, 1 % ten times slower):",
        phase.as_secs(),
        phase.as_secs()
    );
    println!(
        "| timeout | median | calls | failed | attempts per call | attempts cut | p99 | p99.9 | timeout at the end |"
    );
    println!("|---|---:|---:|---:|---:|---:|---:|---:|---:|");
    for r in &rows {
        println!(
            "| {} | {} ms | {} | {} | {:.3} | {} | {} ms | {} ms | {} ms |",
            r.name,
            r.median.as_millis(),
            r.calls,
            r.failed,
            r.attempts as f64 / r.calls as f64,
            r.cut,
            r.p99.as_millis(),
            r.p999.as_millis(),
            r.timeout_at_end.as_millis()
        );
    }
    let (fixed_after, learned_after) = (&rows[1], &rows[3]);
    assert!(
        learned_after.cut < fixed_after.cut,
        "after the shift the learned timeout wastes fewer attempts: {} against {}",
        learned_after.cut,
        fixed_after.cut
    );
    assert!(learned_after.failed <= fixed_after.failed);
    assert!(
        learned_after.timeout_at_end >= Duration::from_millis(800),
        "it reached the new latency: {:?}",
        learned_after.timeout_at_end
    );
}

/// A heavy tail in steady state: timeouts and hedges, Backstop's and tower's.
fn tail_latency(rt: &tokio::runtime::Runtime, full: bool) {
    let calls = if full { 12_000 } else { 2_000 };
    let rows = rt.block_on(sim::tail_latency(calls, Duration::from_millis(10), 3));
    println!(
        "\nTail latency: a GET every 10 ms, {calls} calls, 50 ms median (lognormal), 2 % of attempts ten times slower:"
    );
    println!("| strategy | calls | failed | attempts per call | p99 | p99.9 |");
    println!("|---|---:|---:|---:|---:|---:|");
    for r in &rows {
        println!(
            "| {} | {} | {} | {:.3} | {} ms | {} ms |",
            r.name,
            r.calls,
            r.failed,
            r.attempts as f64 / r.calls as f64,
            r.p99.as_millis(),
            r.p999.as_millis()
        );
    }
    let (learned, hedged) = (&rows[1], &rows[2]);
    assert!(
        hedged.p99 * 2 <= learned.p99,
        "hedging at least halves p99: {:?} against {:?}",
        hedged.p99,
        learned.p99
    );
    assert!(
        hedged.attempts as f64 <= learned.attempts as f64 * 1.10,
        "at most 10 % more attempts"
    );
}
