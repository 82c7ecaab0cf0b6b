//! Runs `N` successful calls through one stack, for instruction counting under
//! `valgrind --tool=callgrind` (deterministic, unlike wall-clock time on a shared machine).
//!
//! `cargo build --release -p backstop-bench --bin per_call` then
//! `valgrind --tool=callgrind --callgrind-out-file=/dev/null target/release/per_call STACK N`
//! for two values of N: the difference divided by the difference in N is the cost per call.
//! STACK is one of: bare, tower, tower-resilience, backstop, backstop-open (its breaker open),
//! retry, retry-budget, retry-budget-timeout, retry-gate-timeout, breaker, deadline,
//! attempt-timeout; a third argument
//! `realistic` sends a request with five headers and a 64-byte body instead of a bare GET.
//! `per_call sizes` prints the size
//! of each stack's response future (every outer layer moves it once more on every call).

use backstop_bench::stacks::{self, Bench, drive};
use tower::{Layer, Service};

fn run<S: Bench>(svc: S, n: u64) {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .build()
        .unwrap();
    let mut svc = svc;
    rt.block_on(drive(&mut svc, n));
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let n: u64 = args.get(2).and_then(|a| a.parse().ok()).unwrap_or(10_000);
    if args.get(3).map(String::as_str) == Some("realistic") {
        stacks::use_realistic_requests();
    }
    match args.get(1).map(String::as_str).unwrap_or("backstop") {
        "bare" => run(stacks::bare(), n),
        "tower" => run(stacks::tower_stack(), n),
        "tower-resilience" => run(stacks::tower_resilience_stack(), n),
        "backstop" => run(stacks::backstop_stack(), n),
        "backstop-open" => run(stacks::backstop_open(), n),
        "retry" => run(stacks::retry_only(), n),
        "retry-budget" => run(stacks::retry_budget(), n),
        "retry-budget-timeout" => run(stacks::retry_budget_timeout(), n),
        "retry-gate-timeout" => run(stacks::retry_gate_timeout(), n),
        "breaker" => run(stacks::breaker_only(), n),
        "deadline" => run(stacks::deadline_only(), n),
        "attempt-timeout" => run(stacks::attempt_timeout_only(), n),
        "sizes" => tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap()
            .block_on(sizes()),
        other => panic!("unknown stack {other}"),
    }
}

async fn sizes() {
    fn size<S: Bench>(name: &str, mut s: S) {
        let f = s.call(stacks::get());
        println!("{name}: {} bytes", std::mem::size_of_val(&f));
    }
    size("tower retry + timeout", stacks::tower_stack());
    size("tower-resilience", stacks::tower_resilience_stack());
    size("backstop full stack", stacks::backstop_stack());
    size("backstop retry", stacks::retry_only());
    println!(
        "(tokio Sleep: {} bytes; Option<Sleep>: {} bytes; Instant: {} bytes)",
        std::mem::size_of::<tokio::time::Sleep>(),
        std::mem::size_of::<Option<tokio::time::Sleep>>(),
        std::mem::size_of::<tokio::time::Instant>()
    );
    println!(
        "(the request: {} bytes)",
        std::mem::size_of::<stacks::Req>()
    );
    let lb = stacks::loopback().await;
    let mut over_hyper = stacks::backstop_layer("rates-api", std::time::Duration::from_secs(5))
        .layer(lb.client.clone());
    let f = over_hyper.call(stacks::get());
    println!(
        "backstop full stack over hyper-util: {} bytes",
        std::mem::size_of_val(&f)
    );
    let f = lb.client.clone().call(stacks::get());
    println!(
        "(hyper-util's client: {} bytes; its response future: {} bytes)",
        std::mem::size_of_val(&lb.client),
        std::mem::size_of_val(&f)
    );
}
