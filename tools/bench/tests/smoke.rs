//! The simulations' safety figures at a small size, on every `cargo test`: counts only.

use backstop_bench::sim;
use std::time::Duration;

#[tokio::test(start_paused = true)]
async fn keys_and_replay_prevent_every_duplicate() {
    let r = sim::reliability(100, 20, 0.02, 7).await;
    assert_eq!(r.duplicates_backstop, 0);
    assert!(r.duplicates_naive > 0);
    assert!(r.clean_with_backstop >= r.clean_without_retries);
    assert!(r.extra_load > 0.0 && r.extra_load < 0.1, "{}", r.extra_load);
}

#[tokio::test(start_paused = true)]
async fn an_outage_is_not_multiplied() {
    let rows = sim::outage(Duration::from_secs(30), Duration::from_millis(10)).await;
    assert_eq!(rows[0].attempts, rows[0].requests * 27);
    assert_eq!(rows[1].attempts, rows[1].requests * 3);
    assert!(
        rows[4].amplification() <= 1.1,
        "{}",
        rows[4].amplification()
    );
}

/// The whole path under turmoil: every guarantee checked after each seed's run.
mod netsim {
    use backstop_bench::netsim::{Config, Report, Violation, run};
    use std::time::Duration;

    /// The seeds a test run tries; `NETSIM_SEED=n` runs one seed alone (to replay a failure).
    fn seeds(n: u64) -> Vec<u64> {
        match std::env::var("NETSIM_SEED")
            .ok()
            .and_then(|s| s.parse().ok())
        {
            Some(seed) => vec![seed],
            None => (0..n).collect(),
        }
    }

    /// Runs every seed, on as many threads as the machine has cores (each seed's simulation is
    /// a world of its own, which no other run shares), and gives the reports in seed order.
    fn run_all(seeds: Vec<u64>, config: &Config) -> Vec<Report> {
        let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
        let chunk = seeds.len().div_ceil(threads).max(1);
        std::thread::scope(|scope| {
            let handles: Vec<_> = seeds
                .chunks(chunk)
                .map(|part| {
                    scope.spawn(move || {
                        part.iter()
                            .map(|&seed| run(seed, config))
                            .collect::<Vec<_>>()
                    })
                })
                .collect();
            handles
                .into_iter()
                .flat_map(|h| h.join().expect("a simulation thread panicked"))
                .collect()
        })
    }

    fn broken(reports: &[Report]) -> String {
        reports
            .iter()
            .filter(|r| !r.violations.is_empty())
            .map(|r| {
                format!(
                    "seed {} (replay: NETSIM_SEED={} cargo test -p backstop-bench --test smoke netsim): faults {:?}: {:?}",
                    r.seed, r.seed, r.faults, r.violations
                )
            })
            .collect::<Vec<_>>()
            .join("\n")
    }

    #[test]
    fn every_guarantee_holds_under_partitions_kills_and_a_failing_store() {
        let reports = run_all(seeds(200), &Config::default());
        let failures = broken(&reports);
        assert!(failures.is_empty(), "{failures}");
        if reports.len() > 1 {
            // The faults bite: calls end answered, unknown and not sent, and retries happen.
            let sum = |f: fn(&Report) -> usize| reports.iter().map(f).sum::<usize>();
            assert!(sum(Report::writes_answered) > 1_000);
            assert!(sum(Report::unknown) > 10, "{}", sum(Report::unknown));
            assert!(sum(Report::not_sent) > 10, "{}", sum(Report::not_sent));
            assert!(reports.iter().map(Report::extra_attempts).sum::<u64>() > 100);
            let killed = reports
                .iter()
                .filter(|r| r.faults.iter().any(|(_, f)| f.starts_with("Kill")))
                .count();
            assert!(killed > 50, "{killed}");
        }
    }

    /// Runs `f` while another thread spawns tokio tasks as fast as it can (a core's worth, for
    /// the few seconds of the runs it is used for): tokio counts task ids per process and a
    /// runtime drops its tasks in their ids' order, so the ids `f`'s runtimes get are spread as
    /// a busy process spreads them.
    fn beside_other_tasks<T>(f: impl FnOnce() -> T) -> T {
        use std::sync::atomic::{AtomicBool, Ordering};
        let done = AtomicBool::new(false);
        std::thread::scope(|scope| {
            scope.spawn(|| {
                let rt = tokio::runtime::Builder::new_current_thread()
                    .build()
                    .unwrap();
                rt.block_on(async {
                    while !done.load(Ordering::Relaxed) {
                        tokio::spawn(async {}).await.unwrap();
                    }
                });
            });
            let out = f();
            done.store(true, Ordering::Relaxed);
            out
        })
    }

    /// A seed's run repeats to the last field, whatever else the process runs: seeds whose
    /// server is killed mid-run (its tasks dropped with its runtime; in 1623 two kills overlap),
    /// each run alone and then twice beside a thread that spawns tasks.
    #[test]
    fn a_seed_replays_exactly() {
        let config = Config::default();
        for seed in [9, 12, 13, 22, 39, 64, 67, 80, 85, 1623] {
            let alone = run(seed, &config);
            assert!(
                alone.faults.iter().any(|(_, f)| f.starts_with("Kill")),
                "{seed}"
            );
            for _ in 0..2 {
                let beside = beside_other_tasks(|| run(seed, &config));
                assert_eq!(alone, beside, "seed {seed}");
            }
        }
    }

    /// A seed printed by a failing run, rerun in a process of its own as a developer reruns it
    /// (`NETSIM_SEED`), repeats the run to the last field: this test runs itself again as a
    /// child process with `NETSIM_RERUN_OF` set and compares the child's report with its own.
    #[test]
    fn a_seed_replays_exactly_in_another_process() {
        const MARK: &str = "netsim rerun: ";
        const SEED: u64 = 39;
        if let Some(seed) = std::env::var("NETSIM_RERUN_OF")
            .ok()
            .and_then(|s| s.parse().ok())
        {
            println!("{MARK}{:?}", run(seed, &Config::default()));
            return;
        }
        let out = std::process::Command::new(std::env::current_exe().unwrap())
            .args([
                "--exact",
                "netsim::a_seed_replays_exactly_in_another_process",
                "--nocapture",
                "--test-threads=1",
            ])
            .env("NETSIM_RERUN_OF", SEED.to_string())
            .output()
            .expect("the test binary runs again");
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let stdout = String::from_utf8_lossy(&out.stdout);
        let theirs = stdout
            .lines()
            .find_map(|l| l.split_once(MARK).map(|(_, rerun)| rerun))
            .unwrap_or_else(|| panic!("the child printed nothing: {stdout}"));
        let ours = format!("{:?}", beside_other_tasks(|| run(SEED, &Config::default())));
        assert!(ours.contains("Kill") && ours.contains("refund"), "{ours}");
        assert_eq!(theirs, ours);
    }

    /// The checker is not blind: with a claim lease shorter than the caller's deadline (the
    /// documented limit), a claim left by a killed server or an unrenewed lease expires while
    /// the call still retries, and some seed runs a refund twice.
    #[test]
    fn a_lease_shorter_than_the_deadline_is_caught_running_a_refund_twice() {
        let config = Config {
            lease: Duration::from_millis(30),
            ..Config::default()
        };
        let found = (0..200).map(|seed| run(seed, &config)).find(|r| {
            r.violations
                .iter()
                .any(|v| matches!(v, Violation::DuplicateEffect { .. }))
        });
        assert!(found.is_some(), "no seed of 200 found the second execution");
    }
}
