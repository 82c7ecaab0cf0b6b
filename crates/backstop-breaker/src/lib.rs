//! A per-dependency circuit breaker.
//!
//! When a dependency is down, every call to it waits for a timeout, and every retry adds load to
//! a service that is already failing. A breaker watches each dependency's recent results; after
//! repeated failures it **opens** and fails calls at once, without sending them, with an error a
//! model can act on:
//!
//! ```text
//! carrier-api is unavailable (circuit open); do not retry now; try again in 27 s
//! ```
//!
//! After a cooldown it turns **half-open** and lets a few trial calls through; other calls keep
//! failing fast. A trial that succeeds **closes** the circuit; one that fails opens it again
//! (optionally for a longer cooldown). A trial whose future is dropped gives its slot back, so
//! the breaker can never stay half-open for good.
//!
//! What counts comes from the [classifier](backstop_core::Classify): retryable failures
//! (5xx, 429, timeouts, connection errors) and unrecognised errors are failures; a response the
//! dependency chose to give (2xx, 3xx, 4xx) is a success, since the dependency answered; a call
//! that was never sent, or that the caller cancelled, counts for nothing.
//!
//! ## Defaults, and where they come from
//!
//! | setting | Backstop | Polly v8 | resilience4j |
//! |---|---|---|---|
//! | consecutive failures to open | 5 | (not used) | (not used) |
//! | failure ratio to open | 50 % | 10 % | 50 % |
//! | minimum calls in the window | 20 | 100 | 100 |
//! | window | 30 s, time-based | 30 s | last 100 calls |
//! | cooldown while open | 30 s (growth off) | 5 s | 60 s |
//! | trial calls when half-open | 1 | 1 | 10 |
//! | slow call threshold | off | (n/a) | 60 s, off by rate |
//!
//! Backstop trips on whichever rule fires first. The ratio rule follows resilience4j's 50 %
//! (Polly's 10 % trips on a level of errors that a retry layer absorbs well); its minimum of 20
//! calls is lower than both because agents' dependencies see little traffic, and the
//! consecutive-failures rule (5, from the classic Nygard breaker) covers the case of too little
//! traffic to fill the window at all. The 30 s cooldown sits between Polly and resilience4j:
//! long enough to stop hammering, short enough for an agent's run to recover.
//!
//! Every transition emits a `tracing` event (target `backstop::breaker`) and calls the
//! `on_transition` hook; with the `metrics` feature, `backstop_breaker_transitions_total{from,to}`
//! and `backstop_breaker_rejections_total` are counted per dependency.
//!
//! State lives per [`Dependency`](backstop_core::Dependency) in a [`Breaker`], shared by every clone and every stack given
//! the same `Breaker`. The success path is lock-free: an atomic state load, and a sliding-window
//! increment when the ratio rule is on; a mutex per dependency is taken only for state
//! transitions, and never across an `.await`.
//!
//! ```
//! use backstop_breaker::{Breaker, BreakerConfig, BreakerLayer};
//! use backstop_classify::HttpClassifier;
//! use backstop_core::{BoxError, CircuitOpen};
//! use std::time::Duration;
//! use tower::{Layer, ServiceExt, service_fn};
//!
//! # #[tokio::main(flavor = "current_thread", start_paused = true)]
//! # async fn main() {
//! let breaker = Breaker::new(BreakerConfig::default().consecutive_failures(2)).unwrap();
//! let down = service_fn(|_req: http::Request<()>| async {
//!     Ok::<_, std::io::Error>(http::Response::builder().status(503).body(()).unwrap())
//! });
//! let svc = BreakerLayer::new(breaker.clone(), HttpClassifier::new())
//!     .dependency("carrier-api")
//!     .layer(down);
//!
//! for _ in 0..2 {
//!     let res = svc.clone().oneshot(http::Request::new(())).await.unwrap();
//!     assert_eq!(res.status(), 503);
//! }
//! let err = svc.oneshot(http::Request::new(())).await.unwrap_err();
//! assert!(err.is::<CircuitOpen>());
//! assert_eq!(
//!     err.to_string(),
//!     "carrier-api is unavailable (circuit open); do not retry now; try again in 30 s"
//! );
//! # }
//! ```
#![forbid(unsafe_code)]
// docs.rs (nightly, `--cfg docsrs`) badges every item behind a feature with it.
#![cfg_attr(docsrs, feature(doc_cfg))]
#![deny(missing_docs)]

mod breaker;
mod circuit;
mod config;
#[cfg(feature = "fleet")]
mod fleet;
mod layer;
mod permit;
mod slots;
mod sync;

pub use backstop_core::{CircuitOpen, CircuitState};
pub use breaker::Breaker;
pub use circuit::{CircuitStats, CircuitTransition};
pub use config::BreakerConfig;
#[cfg(feature = "fleet")]
pub use fleet::{Fleet, FleetConfig, FleetStats};
pub use layer::{BreakerLayer, CircuitBreaker};
pub use permit::Permit;

/// Future types.
pub mod future {
    pub use crate::layer::BreakerFuture;
}
