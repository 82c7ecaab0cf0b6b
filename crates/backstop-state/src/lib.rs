//! Per-dependency shared state: a bounded `Registry` and lock-free `SlidingCount`ers.
//!
//! **Internal to Backstop.** The budget, the breaker, the throttle and the learned timeouts keep
//! their state with these; nothing here is a public API (the items are hidden from the docs and
//! may change in any release). What they promise is described here for people who change them.
//!
//! The retry budget and the circuit breaker keep their state per dependency, shared by every
//! clone of a service and every stack that uses the same budget or breaker. Two pieces make that
//! cheap and safe:
//!
//! - `Registry` maps a `Dependency` to its state. It is sharded (a lookup takes one shard's
//!   read lock, never held across an `.await`) and **bounded**: past `max` dependencies, a new
//!   name takes the place of the least recently used idle entry, or gets state of its own that
//!   is not kept, so requests to a million distinct hosts cannot exhaust memory and no two
//!   dependencies ever share a budget or a circuit.
//! - `SlidingCount` counts events over a sliding window in buckets. Each bucket is one
//!   `AtomicU64` holding the bucket's epoch and count together, so an increment is one
//!   compare-and-swap and no update is lost when a bucket rolls over.
//!
//! ```
//! use backstop_state::{Registry, SlidingCount};
//! use backstop_core::Dependency;
//! use std::time::Duration;
//! use tokio::time::Instant;
//!
//! let registry = Registry::new(2, |_dep: &Dependency| {
//!     SlidingCount::new(Duration::from_secs(10), 10)
//! });
//! let now = Instant::now();
//! registry.get(&Dependency::new("carrier-api")).add(now, 3);
//! assert_eq!(registry.get(&Dependency::new("carrier-api")).sum(now), 3);
//! let held = registry.get(&Dependency::new("billing-api"));
//! // The bound is reached: a third name takes the place of the idle "carrier-api" (the
//! // least recently used entry nobody holds); "billing-api" is held, so it stays.
//! registry.get(&Dependency::new("a-third-host")).add(now, 1);
//! assert_eq!(registry.len(), 2);
//! assert!(registry.tracked(&Dependency::new("carrier-api")).is_none());
//! assert_eq!(held.sum(now), 0, "never shared with the third host");
//! ```
#![forbid(unsafe_code)]
// docs.rs (nightly, `--cfg docsrs`) badges every item behind a feature with it.
#![cfg_attr(docsrs, feature(doc_cfg))]
#![deny(missing_docs)]

mod draws;
mod registry;
mod sync;
mod window;

#[doc(hidden)]
pub use draws::Draws;
#[doc(hidden)]
pub use registry::Registry;
#[doc(hidden)]
pub use window::SlidingCount;
