//! A durable workflow in typed Rust, the README's: three steps, a worker, a journal (PostgreSQL
//! when `BACKSTOP_JOURNAL_URL` names one, else a SQLite file). Each step runs once, with an
//! idempotency key that is the same on every attempt and after a crash; a run killed anywhere
//! resumes where it stopped. `cargo run --example typed_workflow`.

use backstop::journal::{Journal, RunContext, RunError, Worker, Workflow};
use serde::{Deserialize, Serialize};

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

/// Starts a refund, runs a worker until the journal has nothing left to do, and returns the
/// run's output and what the shop did.
pub(crate) async fn run(url: &str) -> Result<(String, Vec<String>), Box<dyn std::error::Error>> {
    let journal = Journal::open(url).await?;
    let order = Order {
        id: "order-7".into(),
        cents: 4200,
    };
    REFUND.start(&journal, "refund-order-7", &order).await?;
    Worker::new(journal.clone(), "worker-1")
        .register(REFUND, refund)
        .run_until_idle()
        .await?;
    let output = REFUND
        .output(&journal, "refund-order-7")
        .await?
        .ok_or("the run did not finish")?;
    Ok((output, shop::done()))
}

/// What the steps call: a shop that keeps a line for each thing it did, with the key it got.
mod shop {
    use std::sync::Mutex;

    static DONE: Mutex<Vec<String>> = Mutex::new(Vec::new());

    fn did(what: String) -> Result<String, backstop::Error> {
        DONE.lock().unwrap().push(what.clone());
        Ok(what)
    }

    pub(crate) async fn refund(cents: u64, key: String) -> Result<String, backstop::Error> {
        did(format!("refund {cents} (key {key})"))
    }

    pub(crate) async fn restock(order: &str, key: String) -> Result<String, backstop::Error> {
        did(format!("restock {order} (key {key})"))
    }

    pub(crate) async fn email(about: &str, key: String) -> Result<String, backstop::Error> {
        did(format!("email about {about} (key {key})"))
    }

    /// What the shop did, in order.
    pub(crate) fn done() -> Vec<String> {
        DONE.lock().unwrap().clone()
    }
}

#[allow(dead_code)] // The tests call `run`.
#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let dir = std::env::temp_dir().join(format!("backstop-typed-workflow-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    let url = std::env::var("BACKSTOP_JOURNAL_URL")
        .unwrap_or_else(|_| format!("sqlite://{}", dir.join("journal.db").display()));
    let (output, done) = run(&url).await?;
    for line in done {
        println!("the shop did: {line}");
    }
    println!("the run's output: {output}");
    Ok(())
}
