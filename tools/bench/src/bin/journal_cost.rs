//! What the step journal adds to a step, on SQLite and PostgreSQL over loopback:
//! `cargo run --release -p backstop-bench --features stores --bin journal_cost [N]`.
//!
//! Each step runs through `Journal::execute` with a call that answers at once, so the time is
//! the journal's: `sent` (one write: the step, its history, its run), the outcome (one). The SQLite file
//! is in WAL mode with `synchronous=FULL` on this machine's disk; the PostgreSQL is a cluster of
//! the bench's own (`initdb`, `fsync=off`: its figures leave out the disk flush PostgreSQL
//! would do in production).

use backstop::journal::{CallResult, Journal, StepId};
use backstop_testkit::PostgresServer;
use std::time::Duration;
use tokio::time::Instant;

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[i]
}

async fn measure(name: &str, journal: &Journal, n: usize) {
    let mut took = Vec::with_capacity(n);
    for i in 0..n {
        let step = StepId::new(&format!("bench-{}", i / 10), &format!("s{i}"), "");
        let start = Instant::now();
        journal
            .execute(&step, "tool", b"{}", |_| async {
                CallResult::Succeeded {
                    result: Some("{\"ok\":true}".into()),
                    provider_ref: None,
                }
            })
            .await
            .expect("the step runs");
        took.push(start.elapsed());
    }
    took.sort();
    println!(
        "| {name} | {} | {:.2} ms | {:.2} ms | {:.2} ms |",
        n,
        percentile(&took, 0.5).as_secs_f64() * 1e3,
        percentile(&took, 0.99).as_secs_f64() * 1e3,
        took.iter().sum::<Duration>().as_secs_f64() * 1e3 / n as f64,
    );
}

#[tokio::main(flavor = "current_thread")]
async fn main() {
    let n: usize = std::env::args()
        .nth(1)
        .and_then(|a| a.parse().ok())
        .unwrap_or(1000);
    println!("| store | steps | p50 per step | p99 per step | mean |");
    println!("|---|---:|---:|---:|---:|");
    let dir = std::env::temp_dir().join(format!("backstop-journal-cost-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("a directory");
    let sqlite = Journal::sqlite(dir.join("journal.db"))
        .await
        .expect("SQLite");
    measure("SQLite file (WAL, synchronous=FULL)", &sqlite, n).await;
    let pg = PostgresServer::start().await;
    let postgres = Journal::postgres(&pg.url()).await.expect("PostgreSQL");
    measure("PostgreSQL on loopback (fsync=off)", &postgres, n).await;
    let _ = std::fs::remove_dir_all(&dir);
}
