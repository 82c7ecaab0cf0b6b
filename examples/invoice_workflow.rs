//! An invoice workflow, killed mid-step and resumed from the journal.
//!
//! `cargo run --example invoice_workflow`. A worker process creates an invoice, reserves
//! inventory and sends the email, journaling every step in a SQLite file. It is killed with
//! SIGKILL during step 2, after the inventory service has reserved and before the worker hears
//! so. A second worker process, whose journal `Worker` loop is all the recovery there is, claims
//! the run once the first one's lease has run out: step 1 is done and is not called again, step
//! 2 is unknown and is reconciled with the inventory service (by the order it reserved for)
//! instead of being sent again, and the email goes out once. The operator's view (`backstop journal
//! show`) before and after, and then what the services did: one invoice, one reservation, one
//! email.

use backstop::BoxError;
use backstop_workspace::invoice::{self, World};
use std::path::Path;

// The test suite runs `run_demo` with the worker binary (tests/it/examples.rs).
#[allow(dead_code)]
pub(crate) fn main() -> Result<(), BoxError> {
    let args: Vec<String> = std::env::args().collect();
    if args.get(1).map(String::as_str) == Some("worker") {
        std::process::exit(invoice::worker_main(&args[2..]));
    }
    run_demo(&std::env::current_exe()?, Path::new("target/invoice-demo"))
}

/// The demo, with `worker` the program that runs the worker (this example itself, or the
/// `invoice_worker` binary) and the journal in `dir`.
pub(crate) fn run_demo(worker: &Path, dir: &Path) -> Result<(), BoxError> {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    rt.block_on(async {
        let world = World::start().await;
        let db = invoice::fresh_db(dir);
        let db_arg = db.to_string_lossy().into_owned();
        let run = "run-2026-12-01-ana";

        println!(
            "1. a worker runs the workflow and is killed during step 2, after inventory reserved"
        );
        let mut first = invoice::spawn_worker(worker, &db_arg, &world.url(), run, None, false);
        world.kill_after_effect("reserve-inventory", first.id());
        let status = tokio::task::spawn_blocking(move || first.wait()).await??;
        assert_eq!(invoice::worker_exit(status), Err("killed".to_owned()));
        println!("   killed; the services did {:?}\n", world.effects());
        println!("   $ backstop journal --db {} show {run}", db.display());
        invoice::show(&db, run).await;

        println!("\n2. a second worker claims the run once the first one's lease ran out, and recovers it");
        let mut second = invoice::spawn_worker(worker, &db_arg, &world.url(), run, None, false);
        let status = tokio::task::spawn_blocking(move || second.wait()).await??;
        assert_eq!(
            invoice::worker_exit(status),
            Ok(0),
            "the resumed run finishes"
        );
        println!("   $ backstop journal --db {} show {run}", db.display());
        invoice::show(&db, run).await;

        let effects = world.effects();
        println!("\nthe services did: {effects:?}");
        assert_eq!(
            effects,
            invoice::Effects {
                invoices: 1,
                reservations: 1,
                messages: 1
            }
        );
        println!("one invoice, one reservation, one email: step 2 was reconciled, not sent again");
        println!(
            "(the journal stays in {}; try `cargo run -p backstop-cli -- journal --db {} runs`)",
            db.display(),
            db.display()
        );
        Ok(())
    })
}
