//! Shared vocabulary of the Backstop middleware.
//!
//! Every Backstop layer speaks about a call in the same few words, and they live here so that the
//! layers can be used alone or together without depending on each other:
//!
//! - [`Outcome`]: what is known about the side effect of an attempt (not sent, unknown, completed).
//! - [`Dependency`] and [`DependencyKey`]: which downstream service a request goes to. One name
//!   governs the retry budget, the circuit breaker and every error message.
//! - [`Run`]: one agent run's deadline and retry budget, shared by all of its tool calls;
//!   [`AttemptLimit`], a per-request cap on attempts.
//! - [`Deadline`]: the instant by which a whole logical call must be finished, carried in the
//!   request's extensions so inner layers can see the time left.
//! - [`HasExtensions`]: how a layer reaches those extensions. `http::Request` and `http::Response`
//!   implement it; a non-HTTP tool call implements it with one field.
//! - The extension points the layers meet at: [`Classify`] and its [`Verdict`], and a
//!   [`RetryBudget`]. They live here so that the budget and the breaker implement or use them
//!   without depending on the retry layer.
//! - [`CallContext`]: what one layer decided and the layers inside it read (the retry scope, the
//!   dependency, the deadline, the attempt's number and end).
//! - The errors Backstop's own layers produce ([`AttemptTimedOut`], [`DeadlineExceeded`],
//!   [`CircuitOpen`]), which
//!   classifiers recognise by walking an error's `source()` chain.
//!
//! ```
//! use backstop_core::{Deadline, HasExtensions, Outcome};
//! use std::time::Duration;
//!
//! let mut req = http::Request::new(());
//! Deadline::after(Duration::from_secs(2)).tighten(&mut req);
//! assert!(Deadline::of(&req).is_some());
//! assert!(Outcome::Unknown.is_uncertain());
//! ```
#![forbid(unsafe_code)]
// docs.rs (nightly, `--cfg docsrs`) badges every item behind a feature with it.
#![cfg_attr(docsrs, feature(doc_cfg))]
#![deny(missing_docs)]

mod budget;
mod context;
mod deadline;
mod dependency;
mod error;
mod extensions;
mod outcome;
mod run;
mod verdict;

pub use budget::{NoBudget, RetryBudget};
pub use context::{CallContext, Claim, ScopeOwner};
pub use deadline::Deadline;

/// The header a Backstop client sends on each HTTP attempt with the time that attempt has left,
/// in whole milliseconds rounded up ([`Deadline::time_left`]), and a server's deadline layer
/// reads: `backstop-time-left-ms`. gRPC calls carry `grpc-timeout` instead, MCP tool calls
/// `_meta["dev.backstop/time-left-ms"]`.
pub const TIME_LEFT_HEADER: http::HeaderName =
    http::HeaderName::from_static("backstop-time-left-ms");
pub use dependency::{ByAuthority, Dependency, DependencyKey};
pub use error::{
    AttemptTimedOut, BoxError, CircuitOpen, CircuitState, DeadlineExceeded, InvalidConfig,
    OverQuota, ReplyLost, Throttled,
};
pub use extensions::{HasExtensions, ReplaySafe, UnvouchedKey, WithExtensions};
pub use outcome::{Outcome, ReportsOutcome};
pub use run::{AttemptLimit, Run, RunSpent};
pub use verdict::{Classify, Verdict};

/// Not part of the public API: what the Backstop crates use to reach each other. Anything here
/// may change in any release; nothing else in this crate is public for that reason alone.
#[doc(hidden)]
pub mod plumbing {
    pub use crate::deadline::instant_after;
    pub use crate::error::{CauseChain, DeadlineWords, HumanDuration};
    pub use crate::extensions::{is_idempotent_method, known_method};

    /// The dependency name's hash (per process, randomly keyed), which picks a registry shard.
    pub fn prehash(dependency: &crate::Dependency) -> u64 {
        dependency.hash
    }
}
