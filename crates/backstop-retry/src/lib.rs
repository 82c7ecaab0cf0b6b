//! The one retry layer, and the policy that decides for it.
//!
//! Retries turn a transient failure into a success, and an unsafe retry turns a lost reply into
//! a second refund. The layer drives a call: it keeps a copy of the request, sends each attempt
//! on a handle polled ready, waits between attempts, and ends the call once. Whether another
//! attempt follows, and after how long, is its [`Policy`]'s to say. The [`StandardPolicy`]
//! retries only when all of these hold, each a part ([`MaxAttempts`], [`ReplaySafety`],
//! [`Waits`], [`DeadlineFit`], [`Budgets`]) a policy of one's own can keep, swap or drop:
//!
//! - the [classifier](backstop_classify::Classify) calls the attempt retryable (a timeout, a
//!   reset, a 429 or 5xx; never a validation error);
//! - the side effect of the attempt is known not to have happened, **or** the request is
//!   replay-safe (an idempotent method, an idempotency key, a [`ReplaySafe`](backstop_core::ReplaySafe) marker): a timeout
//!   means *unknown*, not *failed*;
//! - attempts are left (3 by default: one call and two retries);
//! - the wait (the server's `Retry-After`, else the [backoff](backstop_backoff::Backoff), full
//!   jitter from 200 ms up to 5 s) ends before the request's [`Deadline`](backstop_core::Deadline);
//! - the run's and the dependency's [`RetryBudget`](backstop_core::RetryBudget) allow another retry;
//! - the request can be copied ([`Resend`]): any `Clone` request, or an `http::Request` whose
//!   body can be cloned (`Full<Bytes>`, [`HttpResend`]), or a streaming body copied as it is
//!   sent, up to a limit ([`StreamingResend`]).
//!
//! The layers beside it each do one job: a deadline outside (`DeadlineLayer`, which it reads
//! from the request), and inside it the circuit breaker (`BreakerLayer`: a refusal stops the
//! call, not sent) and the attempt timeout (`AttemptTimeoutLayer`).
//!
//! **Retries happen in exactly one place.** The retry layer puts the call's context (the
//! retry-scope mark, the dependency, the deadline, the attempt's number:
//! `backstop_core::CallContext`) in each attempt's extensions; every retry layer further in sees
//! the mark and makes a single attempt, so three nested stacks against a failing dependency make
//! 3 attempts, not 27, whether the inner stack is called from `call`, from a future, or from
//! another task.
//!
//! It keeps tower's readiness contract: `poll_ready` answers what the inner service answers,
//! the first attempt goes out on the handle that was polled ready, and each retry waits for that
//! handle's readiness again, within the deadline.
//!
//! Each attempt runs inside a `tracing` span `attempt` (target `backstop::retry`, fields
//! `dependency` and `attempt`); each retry emits a `retrying` event with the outcome, the wait and
//! whether the server asked for it, and each failed call a `stopped` event with the reason. With
//! the `metrics` feature, calls, attempts, retries, budget refusals, unknown outcomes and
//! successes after attempt N are counted per dependency.
//!
//! When it stops, it says why. A retryable *response* that could not be retried is returned as
//! it is (HTTP callers expect the response) with a [`RetryHistory`] in its extensions; an
//! *error* becomes an [`Error`] naming the dependency, the attempts, the time spent, the last
//! cause, why it stopped and what is known of the side effect, in words a model can act on.
//!
//! ```
//! use backstop_retry::RetryLayer;
//! use backstop_backoff::{Backoff, RngSource};
//! use backstop_core::BoxError;
//! use std::sync::{Arc, atomic::{AtomicU32, Ordering}};
//! use http::{Request, Response, StatusCode};
//! use http_body_util::Full;
//! use bytes::Bytes;
//! use tower::{Layer, ServiceExt, service_fn};
//!
//! # #[tokio::main(flavor = "current_thread", start_paused = true)]
//! # async fn main() {
//! let calls = Arc::new(AtomicU32::new(0));
//! let seen = calls.clone();
//! // A dependency that is busy twice, then answers.
//! let flaky = service_fn(move |_req: Request<Full<Bytes>>| {
//!     let n = seen.fetch_add(1, Ordering::SeqCst);
//!     async move {
//!         let status = if n < 2 { StatusCode::SERVICE_UNAVAILABLE } else { StatusCode::OK };
//!         Ok::<_, BoxError>(Response::builder().status(status).body(()).unwrap())
//!     }
//! });
//! let svc = RetryLayer::http()
//!     .dependency("search-api")
//!     .rng(RngSource::seeded(1))
//!     .layer(flaky);
//! let res = svc.oneshot(Request::get("http://search.local/q").body(Full::default()).unwrap()).await.unwrap();
//! assert_eq!(res.status(), StatusCode::OK);
//! assert_eq!(calls.load(Ordering::SeqCst), 3);
//! # }
//! ```
#![forbid(unsafe_code)]
// docs.rs (nightly, `--cfg docsrs`) badges every item behind a feature with it.
#![cfg_attr(docsrs, feature(doc_cfg))]
#![deny(missing_docs)]

mod call;
mod error;
pub mod future;
mod hedge;
mod history;
mod layer;
mod obs;
mod parts;
mod policy;
mod resend;
mod stream_body;

pub use error::{Error, ErrorKind};
pub use hedge::{Hedge, HedgeLayer, Hedging};
pub use history::{AttemptRecord, RetryHistory, StopReason};
pub use layer::{DEFAULT_MAX_ATTEMPTS, Retry, RetryLayer};
pub use policy::{
    Attempt, Budgets, CallWaits, DeadlineFit, MaxAttempts, Policy, ReplaySafety, StandardPolicy,
    Waits,
};
pub use resend::{CloneResend, HttpResend, NotCopyable, Resend};
pub use stream_body::{StreamingResend, TeeReader, TeeableBody};

/// The owner under which this crate's retry layers claim calls: a type no other crate can
/// name, so no caller can set the mark that makes them stand aside.
struct Owner;

/// [`Owner`] as the context records it.
fn owner() -> backstop_core::ScopeOwner {
    backstop_core::ScopeOwner::of::<Owner>()
}

/// Whether a Backstop retry layer further out owns `req`'s retries: then every Backstop layer
/// inside makes one attempt and leaves the call-level work (the key, the call's span, the
/// error's words) to the stack outside.
pub fn retried_outside<R: backstop_core::HasExtensions + ?Sized>(req: &R) -> bool {
    backstop_core::CallContext::of(req).is_some_and(|c| c.owned_by(owner()))
}
