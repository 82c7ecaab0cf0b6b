//! Deterministic simulations: tokio's paused clock, seeded RNGs, the real Backstop stack and
//! replay layer in process. They measure counts (clean tasks, attempts, duplicate effects), never
//! time.

mod latency;
mod outage;
mod reliability;

pub use latency::{ShiftPhase, TailRow, latency_shift, tail_latency};
pub use outage::{Outage, outage};
pub use reliability::{Reliability, reliability};
