//! Backstop: tower middleware that makes outbound calls safe to retry.
//!
//! A network call can succeed on the server while its reply is lost; the caller sees a timeout,
//! retries, and the customer is refunded twice. Backstop retries only what is safe to retry,
//! in one place, within a deadline:
//!
//! - [`classify`]: every attempt becomes a verdict (success, retryable, fatal) together with what
//!   is known of its side effect (not sent, unknown, completed). `Retry-After` is read in both
//!   forms.
//! - [`backoff`]: full jitter by default (`random(0, min(5 s, 200 ms * 2^n))`), seedable.
//! - [`timeout`]: a per-attempt timeout and an overall deadline that covers attempts and
//!   backoff sleeps, always inside the caller's own deadline.
//! - [`retry`]: the one retry layer. A timeout means *unknown*, so a request that is not
//!   replay-safe (a POST without an idempotency key) is not repeated after one.
//! - [`budget`]: retries per dependency stay within 10 % of requests (plus 1 per second), so an
//!   outage is not multiplied by the retry count.
//! - [`breaker`]: a circuit breaker per dependency that fails fast with an honest message
//!   ("carrier-api is unavailable (circuit open); do not retry now; try again in 27 s").
//! - [`idempotency`]: one key per intended action, derived deterministically and sent on every
//!   attempt, which makes a POST replay-safe.
//! - [`replay`]: the server side of the same contract: a layer that runs a keyed request once
//!   and replays its stored result to every repeat.
//!
//! Stack them in this order, outermost first: idempotency key, deadline, retry (with the
//! budget), breaker, attempt timeout, the client. The retry layer can keep the deadline, ask the
//! breaker before each attempt and time each attempt itself, which is what the [`Backstop`]
//! builder does (one future per call instead of five: its call-level work runs in the retry
//! future too, as a [`retry::CallHook`]; and the budget and the breaker account to the dependency
//! the retry layer names). By hand:
//!
//! ```
//! use backstop::{breaker::Breaker, budget::Budget, retry::RetryLayer, Dependency};
//! use std::sync::Arc;
//! use bytes::Bytes;
//! use http_body_util::Full;
//! use hyper_util::{client::legacy::Client, rt::TokioExecutor};
//! use std::time::Duration;
//! use tower::{ServiceBuilder, ServiceExt};
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), backstop::BoxError> {
//! # let server = backstop_testkit::TestServer::start(|_| backstop_testkit::Action::status(200)).await;
//! // One budget and one breaker for the whole process: every stack shares their state.
//! let budget = Budget::default();
//! let breaker = Breaker::default();
//! let carrier = Dependency::new("carrier-api");
//!
//! let client = Client::builder(TokioExecutor::new()).build_http::<Full<Bytes>>();
//! let carrier = ServiceBuilder::new()
//!     .layer(
//!         RetryLayer::http()
//!             .dependency(carrier.clone())
//!             .deadline(Duration::from_secs(10))
//!             .budget(Arc::new(budget.bind(&carrier)))
//!             .gate(Arc::new(breaker.bind(&carrier)))
//!             .attempt_timeout(Duration::from_secs(3)),
//!     )
//!     .service(client);
//!
//! let req = http::Request::get(server.url("/labels/4812")).body(Full::default())?;
//! let res = carrier.oneshot(req).await?;
//! assert_eq!(res.status(), 200);
//! # Ok(())
//! # }
//! ```
//!
//! The same jobs as separate layers (`DeadlineLayer`, `BreakerLayer`, `AttemptTimeoutLayer`),
//! for stacks that need something between them:
//!
//! ```
//! use backstop::{
//!     breaker::{Breaker, BreakerLayer},
//!     budget::Budget,
//!     retry::RetryLayer,
//!     timeout::{AttemptTimeoutLayer, DeadlineLayer},
//! };
//! use std::sync::Arc;
//! use bytes::Bytes;
//! use http_body_util::Full;
//! use hyper_util::{client::legacy::Client, rt::TokioExecutor};
//! use std::time::Duration;
//! use tower::{ServiceBuilder, ServiceExt};
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), backstop::BoxError> {
//! # let server = backstop_testkit::TestServer::start(|_| backstop_testkit::Action::status(200)).await;
//! let budget = Budget::default();
//! let breaker = Breaker::default();
//!
//! let client = Client::builder(TokioExecutor::new()).build_http::<Full<Bytes>>();
//! let carrier = ServiceBuilder::new()
//!     .layer(DeadlineLayer::new(Duration::from_secs(10)))
//!     .layer(RetryLayer::http().dependency("carrier-api").budget(Arc::new(budget.clone())))
//!     .layer(BreakerLayer::http(breaker.clone()))
//!     .layer(AttemptTimeoutLayer::new(Duration::from_secs(3)))
//!     .service(client);
//!
//! let req = http::Request::get(server.url("/labels/4812")).body(Full::default())?;
//! let res = carrier.oneshot(req).await?;
//! assert_eq!(res.status(), 200);
//! # Ok(())
//! # }
//! ```
#![forbid(unsafe_code)]
// docs.rs (nightly, `--cfg docsrs`) badges every item behind a feature with it.
#![cfg_attr(docsrs, feature(doc_cfg))]
#![deny(missing_docs)]

mod attempt_header;
mod box_errors;
mod builder;
mod dead_letter;
mod error;
mod finish;
#[cfg(feature = "journal")]
mod journaled;
#[cfg(feature = "mcp")]
mod mcp_stack;
#[cfg(feature = "reqwest")]
mod reqwest_client;

pub use box_errors::{BoxErrors, BoxErrorsFuture};
pub use builder::{
    Backstop, BackstopLayer, BackstopService, DEFAULT_ATTEMPT_TIMEOUT, DEFAULT_DEADLINE, Preset,
    Transport, TransportSettings,
};
#[cfg(feature = "json")]
pub use dead_letter::JsonLinesSink;
pub use dead_letter::{DeadLetter, DeadLetterSink, MemorySink};
pub use error::{Error, ErrorKind};

#[doc(inline)]
pub use backstop_core::{
    BoxError, CircuitOpen, Deadline, Dependency, DependencyKey, HasExtensions, Outcome, ReplaySafe,
    Run, WithExtensions,
};

// Each type has one path here: the vocabulary every layer shares is at the root or in `core`,
// each extension point in the module of its concern, and nothing twice.

/// Classification of attempts: [`Verdict`](classify::Verdict), [`Classify`](classify::Classify),
/// the HTTP classifier and the `Retry-After` parser.
pub mod classify {
    #[doc(inline)]
    pub use backstop_classify::{
        AsError, HttpClassifier, StatusClass, classify_error, is_attempt_timeout,
        parse_retry_after, parse_retry_after_value,
    };
    #[doc(inline)]
    pub use backstop_core::{Classify, Verdict};
}

/// Backoff schedules.
pub mod backoff {
    #[doc(hidden)]
    #[allow(deprecated)]
    pub use backstop_backoff::InvalidBackoff;
    #[doc(inline)]
    pub use backstop_backoff::{Backoff, DEFAULT_BASE, DEFAULT_CAP, RngSource, Schedule};
}

/// The attempt timeout, the overall deadline and response bodies under them.
pub mod timeout {
    #[doc(inline)]
    pub use backstop_timeout::{
        AttemptTimeout, AttemptTimeoutLayer, BodyTimedOut, BodyTimeout, BodyTimeoutLayer,
        DeadlineLayer, TimedBody, WithDeadline, future,
    };
}

/// The one retry layer.
pub mod retry {
    #[doc(inline)]
    pub use backstop_core::RetryScope;
    #[doc(inline)]
    pub use backstop_retry::{
        AttemptRecord, BufferBody, BufferBodyLayer, CallHook, CloneRequest, CopyableBody,
        DEFAULT_MAX_ATTEMPTS, Diagnosis, HttpResend, Limits, NoHook, NotCopyable, ReplayBody,
        Resend, Retry, RetryError, RetryHistory, RetryLayer, StopReason, Told, futures,
    };
    #[doc(hidden)]
    #[allow(deprecated)]
    pub use backstop_retry::{HttpReplay, NotReplayable};
}

/// The per-dependency retry budget.
pub mod budget {
    #[doc(hidden)]
    #[allow(deprecated)]
    pub use backstop_budget::BoundBudget;
    #[doc(inline)]
    pub use backstop_budget::{Budget, BudgetConfig, BudgetStats, DependencyBudget};
    #[doc(inline)]
    pub use backstop_core::{NoBudget, RetryBudget};
}

/// The per-dependency circuit breaker.
pub mod breaker {
    #[doc(hidden)]
    #[allow(deprecated)]
    pub use backstop_breaker::{BoundBreaker, State};
    #[doc(inline)]
    pub use backstop_breaker::{
        Breaker, BreakerConfig, BreakerLayer, CircuitBreaker, CircuitStats, DependencyBreaker,
        ResponseFuture, Transition,
    };
    #[doc(inline)]
    pub use backstop_core::{AttemptGate, CircuitState, Ticket};
}

/// Per-dependency shared state: the bounded registry and sliding counters.
pub mod state {
    #[doc(inline)]
    pub use backstop_state::{Registry, SlidingCount};
}

/// Idempotency keys on the client: derivation and injection once per logical call.
pub mod idempotency {
    #[doc(inline)]
    pub use backstop_idempotency::*;
}

/// Server-side replay of stored results for repeated keys (in memory; on Redis and PostgreSQL
/// with the `redis` and `postgres` features). Feature `replay`.
#[cfg(feature = "replay")]
pub mod replay {
    #[doc(inline)]
    pub use backstop_replay::*;
}

/// The durable step journal: every tool call's transitions written before they matter,
/// reconcile before retry, resume after a crash, park during outages (SQLite; PostgreSQL with
/// `journal-postgres`). Feature `journal`. [`HttpJudge`](journal::HttpJudge) reads an HTTP
/// response the way the retry layer does.
#[cfg(feature = "journal")]
pub mod journal {
    pub use crate::journaled::HttpJudge;
    #[doc(inline)]
    pub use backstop_journal::*;
}

/// `reqwest::Client` under the stack: [`ReqwestService`](reqwest::ReqwestService), or
/// [`BackstopLayer::reqwest`] in one call. Feature `reqwest`.
#[cfg(feature = "reqwest")]
pub mod reqwest {
    #[cfg(feature = "reqwest-middleware")]
    pub use crate::reqwest_client::BackstopMiddleware;
    pub use crate::reqwest_client::ReqwestService;
}

/// MCP tool calls both ways: [`Backstop::mcp`] builds the stack for a tool server's calls
/// ([`McpClassifier`](mcp::McpClassifier), keys in `_meta`, each tool's policy from its
/// annotations), and [`ToolReplayLayer`](mcp::ToolReplayLayer) runs a keyed call once on the
/// server. Feature `mcp`; with `rmcp`, the official SDK's client and server handler
/// ([`mcp::rmcp`]).
#[cfg(feature = "mcp")]
pub mod mcp {
    #[doc(inline)]
    pub use backstop_mcp::{
        META_ERROR, META_KEY, META_KEY_ALIAS, META_REPLAYED, McpClassifier, RpcError, ToolCall,
        ToolCatalog, ToolError, ToolHints, ToolPolicy, ToolReplay, ToolReplayLayer, ToolResult,
        codes, verdict_of, verdict_of_rpc,
    };

    /// tower-mcp's router under the stack, and its per-tool replay layer. Feature `tower-mcp`.
    #[cfg(feature = "tower-mcp")]
    pub mod tower_mcp {
        #[doc(inline)]
        pub use backstop_mcp::tower_mcp::*;
    }

    /// rmcp's client and server handler under the stack. Feature `rmcp`.
    #[cfg(feature = "rmcp")]
    pub mod rmcp {
        pub use crate::mcp_stack::error_result;
        #[doc(inline)]
        pub use backstop_mcp::rmcp::*;
    }
}

/// The rest of the vocabulary every layer shares (the most used of it is at the crate root).
pub mod core {
    #[doc(inline)]
    pub use backstop_core::{
        AttemptLimit, AttemptTimedOut, ByAuthority, CauseChain, DeadlineExceeded, DeadlineWords,
        HumanDuration, InvalidConfig, ReportsOutcome, UnvouchedKey, is_idempotent_method,
    };
}

/// Not part of the public API: the composed stack's own pieces, public only because
/// [`BackstopService`] names them. Anything here may change in any release.
#[doc(hidden)]
pub mod plumbing {
    pub use crate::attempt_header::AttemptCount;
    pub use crate::builder::KeyGenerator;
    pub use crate::finish::{StackCall, StackHook};
}
