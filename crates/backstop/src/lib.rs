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
//! Stack them in this order, outermost first: idempotency key, deadline, retry (its policy with
//! the budget), breaker, attempt timeout, the client. Each is a tower `Layer` of its own; the
//! [`Backstop`] builder stacks them in this order behind the call's work ([`CallLayer`]: key,
//! span, one error, dead letters). By hand:
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
//! // One budget and one breaker for the whole process: every stack shares their state.
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
mod build;
mod builder;
mod call;
mod dead_letter;
#[cfg(feature = "dead-letters-redis")]
mod dead_letter_stream;
#[cfg(feature = "grpc")]
mod grpc_stack;
#[cfg(feature = "journal")]
mod journaled;
#[cfg(feature = "mcp")]
mod mcp_stack;
#[cfg(feature = "reqwest")]
mod reqwest_client;
mod service;
mod telemetry;
mod transport;

pub use backstop_retry::{Error, ErrorKind};
pub use builder::{Backstop, DEFAULT_ATTEMPT_TIMEOUT, DEFAULT_DEADLINE, Preset};
pub use call::{CallLayer, CallService};
#[cfg(feature = "json")]
pub use dead_letter::JsonLinesSink;
pub use dead_letter::{DeadLetter, DeadLetterSink, MemorySink};
pub use service::{BackstopLayer, BackstopService};
pub use transport::{Describe, Transport};

/// The response futures of the stack and of its call's work.
pub mod future {
    pub use crate::call::CallFuture;
    pub use crate::service::BackstopFuture;
}

pub use backstop_core::{
    BoxError, Deadline, Dependency, HasExtensions, Outcome, ReplaySafe, Run, TIME_LEFT_HEADER,
    WithExtensions,
};
#[cfg(feature = "journal")]
pub use journaled::HttpJudge;

// Each concern is its crate, whole, under the concern's name: the builder stacks their layers,
// and a stack composed by hand (or a part swapped) names them there.
pub use backstop_backoff as backoff;
pub use backstop_breaker as breaker;
pub use backstop_budget as budget;
#[cfg(feature = "chaos")]
pub use backstop_chaos as chaos;
pub use backstop_classify as classify;
pub use backstop_core as core;
pub use backstop_idempotency as idempotency;
#[cfg(feature = "journal")]
pub use backstop_journal as journal;
#[cfg(feature = "mcp")]
pub use backstop_mcp as mcp;
#[cfg(feature = "otel")]
pub use backstop_otel as otel;
#[cfg(feature = "quota")]
pub use backstop_quota as quota;
#[cfg(feature = "replay")]
pub use backstop_replay as replay;
pub use backstop_retry as retry;
pub use backstop_timeout as timeout;

/// `reqwest::Client` under the stack: [`ReqwestService`](reqwest::ReqwestService), or
/// [`BackstopLayer::reqwest`] in one call. Feature `reqwest`.
#[cfg(feature = "reqwest")]
pub mod reqwest {
    #[cfg(feature = "reqwest-middleware")]
    pub use crate::reqwest_client::BackstopMiddleware;
    pub use crate::reqwest_client::ReqwestService;
}

/// Dead letters on a Redis stream: [`RedisStreamSink`](dead_letters_redis::RedisStreamSink)
/// writes them off the call's path (a bounded queue, drops counted), and
/// [`DeadLetterStream`](dead_letters_redis::DeadLetterStream) reads them with a consumer group
/// and acknowledges the settled ones. Feature `dead-letters-redis`.
#[cfg(feature = "dead-letters-redis")]
pub mod dead_letters_redis {
    pub use crate::dead_letter_stream::{
        DeadLetterStream, RedisStreamSink, StreamConfig, StreamLetter, StreamStats,
    };
}
