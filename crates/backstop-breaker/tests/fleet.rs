//! A fleet of real processes sharing circuits through a real Redis: each child is this test
//! binary run again as `child` (a small command loop over stdin and stdout around one
//! `Breaker` that joined the fleet), and the parent drives them. Prints the time an open
//! circuit takes to reach the others, checks that one process sends the trial call of a
//! cooldown, and kills Redis.
#![cfg(feature = "fleet")]

use backstop_breaker::{Breaker, BreakerConfig, FleetConfig};
use backstop_core::{Dependency, Outcome, Verdict};
use backstop_testkit::RedisServer;
use std::{
    io::{BufRead, BufReader, Write},
    process::{Child, ChildStdin, ChildStdout, Command, Stdio},
    time::Duration,
};
use tokio::time::Instant;

const DEP: &str = "carrier-api";
const COOLDOWN: Duration = Duration::from_secs(1);

/// The child: one breaker (5 failures in a row open it, 1 s cooldown, one trial call) in the
/// fleet on `FLEET_REDIS`, as process `FLEET_ID`, answering one line per command.
#[test]
fn child() {
    let (Ok(url), Ok(id)) = (std::env::var("FLEET_REDIS"), std::env::var("FLEET_ID")) else {
        return; // run as a test of its own: nothing to do
    };
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async move {
        let breaker = Breaker::new(
            BreakerConfig::default()
                .consecutive_failures(5)
                .cooldown(COOLDOWN)
                .trial_calls(1),
        )
        .unwrap();
        let fleet = breaker
            .join_fleet(
                &url,
                FleetConfig::default().process_id(id).quorum(2).min_calls(5),
            )
            .unwrap();
        let dep = Dependency::new(DEP);
        let fail = Verdict::Retryable {
            outcome: Outcome::Unknown,
            after: None,
        };
        let mut held = None;
        let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel::<String>();
        std::thread::spawn(move || {
            for line in std::io::stdin().lock().lines() {
                let Ok(line) = line else { break };
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        while let Some(line) = rx.recv().await {
            let reply = match line.split_whitespace().collect::<Vec<_>>().as_slice() {
                ["fail", n] => {
                    for _ in 0..n.parse::<u32>().unwrap() {
                        if let Ok(permit) = breaker.permit(&dep) {
                            permit.record(fail);
                        }
                    }
                    format!("state {}", breaker.state(&dep).as_str())
                }
                ["state"] => format!(
                    "state {} connected {}",
                    breaker.state(&dep).as_str(),
                    fleet.stats().connected
                ),
                ["try"] => match breaker.permit(&dep) {
                    Ok(permit) => {
                        held = Some(permit);
                        "admitted".to_owned()
                    }
                    Err(_) => "refused".to_owned(),
                },
                ["succeed"] => {
                    if let Some(permit) = held.take() {
                        permit.record(Verdict::Success);
                    }
                    format!("state {}", breaker.state(&dep).as_str())
                }
                ["stats"] => format!("{:?}", fleet.stats()),
                _ => "?".to_owned(),
            };
            println!("{reply}");
        }
    });
}

/// One child process and its command line.
struct Replica {
    child: Child,
    stdin: ChildStdin,
    stdout: BufReader<ChildStdout>,
}

impl Replica {
    async fn start(url: &str, id: &str) -> Replica {
        let mut child = Command::new(std::env::current_exe().unwrap())
            .args(["--exact", "child", "--nocapture", "--test-threads=1", "-q"])
            .env("FLEET_REDIS", url)
            .env("FLEET_ID", id)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        let stdin = child.stdin.take().unwrap();
        let stdout = BufReader::new(child.stdout.take().unwrap());
        let mut r = Replica {
            child,
            stdin,
            stdout,
        };
        // Joined, and connected to Redis.
        let started = Instant::now();
        while !r.ask("state").ends_with("connected true") {
            assert!(
                started.elapsed() < Duration::from_secs(10),
                "{id} never connected"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        r
    }

    /// Sends `command`, returns the reply line (the test harness's own lines skipped).
    fn ask(&mut self, command: &str) -> String {
        writeln!(self.stdin, "{command}").unwrap();
        self.stdin.flush().unwrap();
        loop {
            let mut line = String::new();
            assert!(
                self.stdout.read_line(&mut line).unwrap() > 0,
                "the child exited"
            );
            let line = line.trim();
            if line.starts_with("state ")
                || line == "admitted"
                || line == "refused"
                || line.starts_with("FleetStats")
                || line == "?"
            {
                return line.to_owned();
            }
        }
    }

    fn state(&mut self) -> String {
        self.ask("state")
    }
}

impl Drop for Replica {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Polls `replica` until its circuit is `state`, or `within` passes; how long it took.
async fn until_state(replica: &mut Replica, state: &str, within: Duration) -> Option<Duration> {
    let started = Instant::now();
    while started.elapsed() < within {
        if replica.state().starts_with(&format!("state {state}")) {
            return Some(started.elapsed());
        }
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    None
}

/// The trial leases `replica` won and lost, once the fleet has answered its ask for one.
async fn until_trial_answered(replica: &mut Replica) -> (u64, u64) {
    let count = |stats: &str, field: &str| -> u64 {
        let at = stats.find(field).expect(field) + field.len();
        let digits: String = stats[at..]
            .chars()
            .take_while(char::is_ascii_digit)
            .collect();
        digits.parse().unwrap()
    };
    let started = Instant::now();
    loop {
        let stats = replica.ask("stats");
        let answered = (
            count(&stats, "trials_won: "),
            count(&stats, "trials_lost: "),
        );
        if answered != (0, 0) {
            return answered;
        }
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "never answered: {stats}"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_open_circuit_reaches_the_fleet_on_a_quorum_and_trials_are_fleet_wide() {
    let redis = RedisServer::start().await;
    let url = redis.url();
    let mut a = Replica::start(&url, "a").await;
    let mut b = Replica::start(&url, "b").await;
    let mut c = Replica::start(&url, "c").await;

    // One faulty replica cannot open the fleet's circuit alone.
    assert_eq!(a.ask("fail 5"), "state open");
    assert!(
        until_state(&mut c, "open", Duration::from_millis(500))
            .await
            .is_none(),
        "c opened on a single report"
    );
    assert!(b.state().starts_with("state closed"));

    // A second reporter makes the quorum: c, which saw no failure, opens (how soon is a
    // measurement, printed here and kept in BENCHMARKS.md, not a condition of the test).
    assert_eq!(b.ask("fail 5"), "state open");
    let reached = until_state(&mut c, "open", Duration::from_secs(10))
        .await
        .expect("c never opened");
    eprintln!("an open circuit reached another process in {reached:?}");

    // After the cooldown, the fleet sends one trial call, not one per process: one process
    // wins the trial lease (for a cooldown) and is admitted; while it holds the lease, the
    // others are refused.
    tokio::time::sleep(COOLDOWN + Duration::from_millis(50)).await;
    let started = Instant::now();
    let admitted = loop {
        let mut admitted = None;
        for (name, r) in [("a", &mut a), ("b", &mut b), ("c", &mut c)] {
            if r.ask("try") == "admitted" {
                admitted = Some(name);
                break;
            }
        }
        if let Some(name) = admitted {
            break name;
        }
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "no process was admitted a trial"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    };
    // Each of the others asked for the lease in the rounds before, and lost it.
    for (name, r) in [("a", &mut a), ("b", &mut b), ("c", &mut c)] {
        let (won, lost) = until_trial_answered(r).await;
        if name == admitted {
            assert_eq!((won, lost), (1, 0), "{name}, the trial's process");
        } else {
            assert_eq!((won, lost), (0, 1), "{name}, beside {admitted}'s trial");
            assert_eq!(r.ask("try"), "refused", "{name}, beside {admitted}'s trial");
        }
    }
    eprintln!("the fleet's one trial call in the cooldown: {admitted}'s");
    // The trial succeeds: every process's circuit closes.
    let winner = match admitted {
        "a" => &mut a,
        "b" => &mut b,
        _ => &mut c,
    };
    assert_eq!(winner.ask("succeed"), "state closed");
    for r in [&mut a, &mut b, &mut c] {
        assert!(
            until_state(r, "closed", Duration::from_secs(10))
                .await
                .is_some(),
            "{}",
            r.ask("stats")
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_redis_gone_each_process_judges_alone() {
    let mut redis = RedisServer::start().await;
    let url = redis.url();
    let mut a = Replica::start(&url, "a").await;
    let mut b = Replica::start(&url, "b").await;
    redis.kill();
    for r in [&mut a, &mut b] {
        let started = Instant::now();
        while !r.state().ends_with("connected false") {
            assert!(
                started.elapsed() < Duration::from_secs(5),
                "still connected"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
    // Its own failures still open a process's circuit, and it sends its own trial after the
    // cooldown; the other process knows nothing of it.
    assert_eq!(a.ask("fail 5"), "state open");
    assert!(b.state().starts_with("state closed"));
    tokio::time::sleep(COOLDOWN + Duration::from_millis(50)).await;
    assert_eq!(a.ask("try"), "admitted");
    assert_eq!(a.ask("succeed"), "state closed");
}
