//! The whole path simulated (`backstop_bench::netsim`): `cargo bench -p backstop-bench --bench
//! netsim` runs 10,000 seeds (two threads, one simulation each at a time) and prints what the
//! runs did and every guarantee any of them broke, with the seed to replay it; under
//! `cargo test` it runs 10 seeds, as a smoke test. The figures are counts, never a timing.

use backstop_bench::{
    full_run,
    netsim::{Config, Report, run},
};
#[allow(clippy::disallowed_types)]
use std::time::Instant;
use std::{sync::mpsc, thread};

// How long the seeds took to run is read off the real clock (each simulation keeps its own).
#[allow(clippy::disallowed_types)]
fn main() {
    let seeds: u64 = if full_run() { 10_000 } else { 10 };
    let config = Config::default();
    let started = Instant::now();
    let (tx, rx) = mpsc::channel();
    let workers: Vec<_> = (0..2)
        .map(|w| {
            let (tx, config) = (tx.clone(), config.clone());
            thread::spawn(move || {
                for seed in (w..seeds).step_by(2) {
                    tx.send(run(seed, &config)).unwrap();
                }
            })
        })
        .collect();
    drop(tx);
    let reports: Vec<Report> = rx.iter().collect();
    for w in workers {
        w.join().unwrap();
    }
    let secs = started.elapsed().as_secs_f64();
    let calls: usize = reports.iter().map(|r| r.calls.len()).sum();
    let writes: usize = reports
        .iter()
        .map(|r| r.calls.iter().filter(|c| c.action.is_some()).count())
        .sum();
    let sum = |f: fn(&Report) -> usize| reports.iter().map(f).sum::<usize>();
    let extra: u64 = reports.iter().map(Report::extra_attempts).sum();
    let effects: u32 = reports.iter().flat_map(|r| r.effects.values()).sum();
    let faults: usize = reports
        .iter()
        .map(|r| r.faults.iter().filter(|(_, f)| f.contains('(')).count())
        .sum();
    let killed = reports
        .iter()
        .filter(|r| r.faults.iter().any(|(_, f)| f.starts_with("Kill")))
        .count();
    let broken: Vec<&Report> = reports
        .iter()
        .filter(|r| !r.violations.is_empty())
        .collect();
    println!(
        "netsim: {seeds} seeds, {calls} calls ({writes} refunds), {faults} faults ({killed} seeds with the server killed)"
    );
    println!("| figure | count |");
    println!("|---|---:|");
    println!(
        "| refunds answered 2xx | {} |",
        sum(Report::writes_answered)
    );
    println!("| refunds that took effect (ledger) | {effects} |");
    println!("| calls ended unknown | {} |", sum(Report::unknown));
    println!("| calls ended not sent | {} |", sum(Report::not_sent));
    println!(
        "| attempts beyond the first (retries and hedges) | {extra} ({:.1} % of calls) |",
        extra as f64 * 100.0 / calls.max(1) as f64
    );
    println!("| seeds with a broken guarantee | {} |", broken.len());
    for r in &broken {
        println!(
            "seed {} (NETSIM_SEED={}): {:?}",
            r.seed, r.seed, r.violations
        );
    }
    println!("{seeds} seeds in {secs:.1} s");
    println!(
        "every report, hashed in seed order: {:016x}",
        digest(&reports)
    );
    assert!(
        broken.is_empty(),
        "{} seeds broke a guarantee",
        broken.len()
    );
}

/// One hash over every report in seed order (their `Debug` text, SipHash with fixed keys): two
/// runs of the bench, in any processes, print the same digest when every seed replayed exactly.
fn digest(reports: &[Report]) -> u64 {
    use std::hash::{DefaultHasher, Hash, Hasher};
    let mut sorted: Vec<&Report> = reports.iter().collect();
    sorted.sort_by_key(|r| r.seed);
    let mut hasher = DefaultHasher::new();
    for r in sorted {
        format!("{r:?}").hash(&mut hasher);
    }
    hasher.finish()
}
