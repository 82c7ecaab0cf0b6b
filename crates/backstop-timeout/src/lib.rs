//! Timeouts everywhere: a per-attempt timeout and an overall deadline.
//!
//! Without a timeout one hung connection holds a call, and everything waiting on it, forever.
//! Two limits work together:
//!
//! - [`DeadlineLayer`] bounds the whole logical call, every attempt and every backoff sleep. It
//!   records a [`Deadline`](backstop_core::Deadline) in the request's extensions; a deadline the caller already put there
//!   wins when it is tighter, so a call never outlives its caller. A request whose deadline has
//!   already passed fails at once without reaching the inner service.
//! - [`AttemptTimeoutLayer`] bounds one attempt, inside the retry layer. It reads the deadline
//!   from the request and uses `min(attempt timeout, time left)`, so the last attempt ends
//!   exactly at the deadline with a verdict instead of being cut off from outside.
//!   [`LearnedTimeoutLayer`] does the same with a limit learned from the dependency's latency.
//!
//! The composed stack puts the deadline outside its retry layer and the attempt timeout inside
//! it; each layer works alone too.
//!
//! Choose the attempt timeout from the dependency's observed latency (a high percentile plus
//! margin, for example p99 1.2 s -> 3 s), not from hope. A timed-out attempt's side effect is
//! *unknown*, never "failed": the errors say so ([`AttemptTimedOut`](backstop_core::AttemptTimedOut), [`DeadlineExceeded`](backstop_core::DeadlineExceeded)).
//!
//! - [`BodyTimeoutLayer`] keeps the attempt's limit and the deadline running over the
//!   response body, which the layers above stop at when the headers arrive. Inside an attempt
//!   timeout it ends each body when its attempt ends (the composed HTTP stack's order).
//!
//! Readiness: [`WithDeadline`] with a budget of its own bounds the wait for readiness by it (a
//! client never ready ends the call at its deadline, not sent); the attempt timeouts and the
//! body timer pass `poll_ready` through untouched, as tower's `Timeout` does.
//!
//! ```
//! use backstop_timeout::{AttemptTimeoutLayer, DeadlineLayer};
//! use backstop_core::{AttemptTimedOut, BoxError};
//! use std::time::Duration;
//! use tower::{ServiceBuilder, ServiceExt, service_fn};
//!
//! # #[tokio::main(flavor = "current_thread", start_paused = true)]
//! # async fn main() {
//! let hangs = service_fn(|_req: http::Request<()>| async {
//!     tokio::time::sleep(Duration::from_secs(3600)).await;
//!     Ok::<_, BoxError>("never")
//! });
//! let svc = ServiceBuilder::new()
//!     .layer(DeadlineLayer::new(Duration::from_secs(10)))
//!     .layer(AttemptTimeoutLayer::new(Duration::from_secs(2)).dependency("carrier-api"))
//!     .service(hangs);
//! let err = svc.oneshot(http::Request::new(())).await.unwrap_err();
//! assert!(err.is::<AttemptTimedOut>());
//! assert_eq!(err.to_string(), "carrier-api did not reply within the 2 s attempt timeout");
//! # }
//! ```
#![forbid(unsafe_code)]
// docs.rs (nightly, `--cfg docsrs`) badges every item behind a feature with it.
#![cfg_attr(docsrs, feature(doc_cfg))]
#![deny(missing_docs)]

mod adaptive;
mod attempt;
mod body;
mod caller;
mod deadline;
mod latency_record;
mod learned;
mod obs;
mod timed;

pub use adaptive::{LatencyConfig, LatencyTimeouts};
pub use attempt::{AttemptTimeout, AttemptTimeoutLayer};
pub use body::{BodyTimedOut, BodyTimeout, BodyTimeoutLayer, TimedBody};
pub use caller::{CallerDeadline, CallerDeadlineLayer};
pub use deadline::{DeadlineLayer, WithDeadline};
pub use learned::{LearnedTimeout, LearnedTimeoutLayer};

/// Not part of the public API: what the Backstop crates use to reach each other (the facade's
/// gRPC transport writes `grpc-timeout` from the attempt's end). Anything here may change in any
/// release.
#[doc(hidden)]
pub mod plumbing {
    pub use crate::timed::{AttemptCutoff, DeadlinePassed, Expiry};
}

/// Future types.
pub mod future {
    pub use crate::body::BodyTimeoutFuture;
    pub use crate::caller::CallerDeadlineFuture;
    pub use crate::learned::LearnedFuture;
    pub use crate::timed::TimedFuture;
}
