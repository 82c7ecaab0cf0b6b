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
//!
//! Stack them in this order, outermost first: deadline, retry, attempt timeout, the client.
//!
//! ```
//! use backstop::{
//!     retry::RetryLayer,
//!     timeout::{AttemptTimeoutLayer, DeadlineLayer},
//! };
//! use bytes::Bytes;
//! use http_body_util::Full;
//! use hyper_util::{client::legacy::Client, rt::TokioExecutor};
//! use std::time::Duration;
//! use tower::{ServiceBuilder, ServiceExt};
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), backstop::BoxError> {
//! # let server = backstop_testkit::TestServer::start(|_| backstop_testkit::Action::status(200)).await;
//! let client = Client::builder(TokioExecutor::new()).build_http::<Full<Bytes>>();
//! let carrier = ServiceBuilder::new()
//!     .layer(DeadlineLayer::new(Duration::from_secs(10)))
//!     .layer(RetryLayer::http().dependency("carrier-api"))
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
#![deny(missing_docs)]

#[doc(inline)]
pub use backstop_core::{
    BoxError, Deadline, Dependency, DependencyKey, HasExtensions, Outcome, ReplaySafe,
};

/// Classification of attempts: [`Verdict`](classify::Verdict), [`Classify`](classify::Classify),
/// the HTTP classifier and the `Retry-After` parser.
pub mod classify {
    #[doc(inline)]
    pub use backstop_classify::*;
}

/// Backoff schedules.
pub mod backoff {
    #[doc(inline)]
    pub use backstop_backoff::*;
}

/// The attempt timeout and the overall deadline.
pub mod timeout {
    #[doc(inline)]
    pub use backstop_timeout::*;
}

/// The one retry layer.
pub mod retry {
    #[doc(inline)]
    pub use backstop_retry::*;
}

/// The vocabulary every layer shares.
pub mod core {
    #[doc(inline)]
    pub use backstop_core::*;
}
