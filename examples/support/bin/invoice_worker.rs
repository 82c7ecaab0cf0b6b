//! The invoice workflow's worker, a real child process that the crash test and the example kill
//! with SIGKILL: `invoice_worker worker DB URL RUN KILL_AT|- [naive]` (see `examples/support/invoice.rs`).

fn main() {
    let args: Vec<String> = std::env::args().skip(2).collect();
    std::process::exit(backstop_workspace::invoice::worker_main(&args));
}
