//! The services under test, built the same way for every benchmark and simulation, and the
//! simulations themselves.
//!
//! Each constructor wraps the same trivial inner service (an immediately ready `200 OK`), so the
//! difference between two of them is the cost of the middleware alone.
#![forbid(unsafe_code)]
#![deny(missing_docs)]

pub mod netsim;
pub mod sim;
pub mod stacks;

/// Whether a harness-less bench binary should run its full size: only under `cargo bench`
/// (which passes `--bench`) and without `--quick`. Under `cargo test` it runs in quick mode, as a
/// smoke test.
pub fn full_run() -> bool {
    let args: Vec<String> = std::env::args().collect();
    args.iter().any(|a| a == "--bench") && !args.iter().any(|a| a == "--quick")
}
