//! The README's typed workflow in a worker process of its own, for the crash test
//! (`tests/it/readme_crash.rs`): `readme_worker DB EFFECTS KILL_AT|- [hooks]`. DB is the journal
//! (a SQLite path or a `postgres://` URL); EFFECTS a file the shop appends a line to, flushed to
//! disk, for each thing it does; KILL_AT `STEP:before` or `STEP:after` kills the process with
//! SIGKILL just before or just after that step's effect. `hooks` registers a reconcile hook per
//! step that asks the shop (the file) whether a call with the step's key happened. It starts
//! the run (again: the same start is the same run) and works until the journal is idle. Exit
//! codes: 0 the run succeeded, 4 it waits for a person, 3 it could not be claimed within 20 s, 1
//! anything else.

use backstop::journal::{
    Journal, Reconciled, Reconcilers, RunContext, RunEnd, RunError, Step, Worker, Workflow,
};
use serde::{Deserialize, Serialize};
use std::time::Duration;

// The README's workflow, as it is written there (a test compares the two).
#[derive(Serialize, Deserialize)]
struct Order {
    id: String,
    cents: u64,
}

const REFUND: Workflow<Order, String> = Workflow::new("refund");

async fn refund(ctx: RunContext, order: Order) -> Result<String, RunError> {
    let refund = ctx
        .run("refund", &order.id, |s| shop::refund(order.cents, s.key))
        .await?;
    ctx.run("restock", &order.id, |s| shop::restock(&order.id, s.key))
        .await?;
    ctx.run("email", &refund, |s| shop::email(&refund, s.key))
        .await?;
    Ok(refund) // the run's output
}
// The end of the README's workflow.

/// The shop: each effect a line in a file, flushed to disk before the call returns, with a
/// place to be killed on either side of it.
mod shop {
    use std::{io::Write, sync::OnceLock};

    /// The effects file, and the kill point.
    pub(crate) static SETUP: OnceLock<(String, Option<String>)> = OnceLock::new();

    fn act(step: &str, line: String) -> Result<String, backstop::Error> {
        let (effects, kill_at) = SETUP.get().expect("set up before the worker runs");
        let checkpoint = |point: &str| {
            if kill_at.as_deref() == Some(&format!("{step}:{point}")) {
                backstop_workspace::invoice::kill(std::process::id());
                // Not reached: the signal is taken on the way back from waiting for `kill`.
                std::process::abort();
            }
        };
        checkpoint("before");
        let mut file = (std::fs::OpenOptions::new().append(true).create(true))
            .open(effects)
            .expect("the effects file");
        writeln!(file, "{step} {line}").expect("an effect written");
        file.sync_all().expect("an effect on disk");
        checkpoint("after");
        Ok(line)
    }

    pub(crate) async fn refund(cents: u64, key: String) -> Result<String, backstop::Error> {
        act("refund", format!("refund {cents} (key {key})"))
    }

    pub(crate) async fn restock(order: &str, key: String) -> Result<String, backstop::Error> {
        act("restock", format!("restock {order} (key {key})"))
    }

    pub(crate) async fn email(about: &str, key: String) -> Result<String, backstop::Error> {
        act("email", format!("email about {about} (key {key})"))
    }

    /// What the shop answers when asked whether a call with `key` happened: the value it
    /// returned, if it did.
    pub(crate) fn lookup(key: &str) -> Option<String> {
        let (effects, _) = SETUP.get().expect("set up before the worker runs");
        let done = std::fs::read_to_string(effects).unwrap_or_default();
        let found = done
            .lines()
            .find(|l| l.ends_with(&format!("(key {key})")))?;
        found.split_once(' ').map(|(_, value)| value.to_owned())
    }
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let [db, effects, kill_at, rest @ ..] = &args[..] else {
        eprintln!("usage: readme_worker DB EFFECTS KILL_AT|- [hooks]");
        std::process::exit(2);
    };
    let hooks = rest.first().is_some_and(|a| a == "hooks");
    let kill_at = (kill_at != "-").then(|| kill_at.clone());
    shop::SETUP
        .set((effects.clone(), kill_at))
        .expect("set once");
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("a runtime");
    std::process::exit(rt.block_on(async {
        match work(db, hooks).await {
            Ok(code) => code,
            Err(e) => {
                eprintln!("readme_worker: {e}");
                1
            }
        }
    }));
}

/// Asks the shop whether the step's call happened.
async fn ask_the_shop(key: String) -> Reconciled {
    match shop::lookup(&key) {
        Some(value) => Reconciled::happened(&value),
        None => Reconciled::NotHappened,
    }
}

async fn work(db: &str, hooks: bool) -> Result<i32, Box<dyn std::error::Error>> {
    let journal = Journal::open(db).await?;
    let order = Order {
        id: "order-7".into(),
        cents: 4200,
    };
    REFUND.start(&journal, "refund-order-7", &order).await?;
    // A worker of this process's own, with the invoice worker's short lease: a killed worker's
    // run is claimed again once its lease has run out.
    let id = format!("worker-{}", std::process::id());
    let mut worker = (Worker::new(journal, &id).register(REFUND, refund))
        .lease(backstop_workspace::invoice::LEASE)
        .poll_interval(Duration::from_millis(50));
    if hooks {
        let ask = |step: &Step| ask_the_shop(step.key.clone());
        let reconcilers = Reconcilers::new()
            .tool("refund", ask)
            .tool("restock", ask)
            .tool("email", ask);
        worker = worker.reconcilers(reconcilers);
    }
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    loop {
        match worker.run_once().await?.map(|report| report.end) {
            Some(RunEnd::Succeeded { .. }) => return Ok(0),
            Some(RunEnd::NeedsHuman { why }) => {
                eprintln!("readme_worker: {why}");
                return Ok(4);
            }
            Some(other) => {
                eprintln!("readme_worker: the run ended {other:?}");
                return Ok(1);
            }
            None if tokio::time::Instant::now() > deadline => return Ok(3),
            None => tokio::time::sleep(Duration::from_millis(50)).await,
        }
    }
}
