//! Server-side idempotency: run a keyed request once, replay its result to every repeat.
//!
//! The worked example behind Backstop: a payment service books a refund, its reply is lost, the
//! caller retries, and the customer is refunded twice. Put [`ReplayLayer`] in front of the
//! refund endpoint and the repeat is recognised by its `Idempotency-Key`: the handler does not
//! run again, and the caller gets the original response, marked `Idempotent-Replayed: true`.
//!
//! For each request to a deduplicated method (POST and PATCH by default):
//!
//! 1. The key is read: exactly one header line, 1 to 255 visible ASCII characters, as a bare
//!    token or an RFC 9651 string. Missing: `400`; invalid: `400`.
//! 2. The key is scoped by the authenticated [`Principal`] and hashed; the request is
//!    fingerprinted (method, path and query, body digest). A keyed request that reaches the
//!    layer without a principal is refused (`500`, `principal-missing`: the authentication
//!    layer must run first), unless the layer is built with [`ReplayLayer::single_tenant`].
//! 3. The store is asked to **claim** the key atomically. A completed key with the same
//!    fingerprint is replayed; with a different one: `422`. A key still in flight: `409` with
//!    `Retry-After: 1`. Errors are `application/problem+json` (RFC 9457), as the IETF
//!    `Idempotency-Key` draft asks.
//! 4. The claimant runs the handler **in a task of its own**: a client that gives up (its
//!    request future dropped) stops neither the handler nor the claim; repeats meanwhile get
//!    `409`, and after it the stored result. The claim's lease is renewed while the handler runs
//!    (every third of it), and the handler can see it ([`Lease`] in its request's extensions:
//!    whether it is still held, and the fencing token). A handler that ends without a response
//!    (it returned an error, or panicked) leaves the key's record saying the outcome is
//!    unknown: a repeat gets a `409` problem (`outcome-unknown`), never a second run. Every
//!    store operation carries the fencing token, so an owner whose lease expired can never
//!    overwrite the result of a newer one.
//! 5. The status, an allow-list of headers (never `Set-Cookie` or `Date`) and the body (up to
//!    1 MiB) are stored for 24 h; a store that fails for a moment is tried again while the
//!    claim is held. Which statuses are stored is a policy: all but 408, 425, 429
//!    and 503 by default, 5xx included (once the handler ran, replaying its error is safer than
//!    running it again, as Stripe does).
//!
//! With the `metrics` feature, `backstop_replay_total{outcome}` counts the requests answered
//! without running the handler: `replayed` (a duplicate prevented), `in_flight`, `mismatch`,
//! `store_unavailable`.
//!
//! If the store is unreachable the layer **fails closed**: `503` with `Retry-After`, and the
//! handler does not run unprotected (unless [`ReplayLayer::fail_open`]).
//!
//! The same claim, run and settling serve actions that are not HTTP requests (a tool call, a
//! message): [`ReplayLayer::once`] runs the work of an [`Action`] at most once, and says what it
//! found ([`Once`]); the MCP tool servers' replay stands on it.
//!
//! ## What middleware cannot do
//!
//! The claim and the stored result live apart from the handler's own database. If the process
//! crashes after the handler's effect is committed and before the result is stored, the lease
//! expires and a retry runs the handler again. The same happens when the store is unreachable
//! for longer than the lease (30 s by default, renewed every 10 s: an outage of up to about
//! 20 s is tolerated; past the lease the handler's [`Lease`] reports it lost, and a second
//! execution can start). Only the handler can close that window:
//!
//! - record the key in the same transaction as the effect: with the `postgres` feature,
//!   [`ReplayLayer::transactional`] does it for you (the handler writes through the
//!   `PgTransaction` in its extensions, the layer writes the stored result in the same
//!   transaction and commits both); or keep a `UNIQUE` column holding the key on the refunds
//!   table, so a second run finds the first one's row; or
//! - pass a key derived from this one to the downstream system that performs the effect (the
//!   payment provider's own idempotency key).
//!
//! ```
//! use backstop_replay::{MemoryStore, ReplayLayer, ReplayRequestBody};
//! use http::{Request, Response};
//! use http_body_util::{BodyExt, Full};
//! use bytes::Bytes;
//! use std::sync::{Arc, atomic::{AtomicU32, Ordering}};
//! use tower::{Layer, ServiceExt, service_fn};
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() {
//! let refunds = Arc::new(AtomicU32::new(0));
//! let booked = refunds.clone();
//! let refund = service_fn(move |_req: Request<ReplayRequestBody>| {
//!     let n = booked.fetch_add(1, Ordering::SeqCst) + 1;
//!     async move { Ok::<_, std::convert::Infallible>(Response::new(Full::new(Bytes::from(format!("R{n}"))))) }
//! });
//! let svc = ReplayLayer::new(MemoryStore::default()).single_tenant().layer(refund);
//!
//! let req = || Request::post("/refunds").header("idempotency-key", "refund-A-7").body(Full::new(Bytes::from("49.00"))).unwrap();
//! let first = svc.clone().oneshot(req()).await.unwrap();
//! let again = svc.clone().oneshot(req()).await.unwrap();
//! assert_eq!(again.headers()["idempotent-replayed"], "true");
//! assert_eq!(again.into_body().collect().await.unwrap().to_bytes(), "R1");
//! assert_eq!(refunds.load(Ordering::SeqCst), 1);
//! # }
//! ```
#![forbid(unsafe_code)]
// docs.rs (nightly, `--cfg docsrs`) badges every item behind a feature with it.
#![cfg_attr(docsrs, feature(doc_cfg))]
#![deny(missing_docs)]

mod body;
mod capture;
mod claim;
mod config;
mod guard;
mod inner;
mod key;
mod layer;
mod lease;
mod memory;
mod once;
#[cfg(feature = "postgres")]
mod pg_store;
mod problem;
#[cfg(feature = "redis")]
mod redis_store;
mod serve;
mod service;
mod store;
#[cfg(feature = "postgres")]
mod transaction;

pub use config::Principal;
pub use layer::ReplayLayer;
pub use lease::Lease;
pub use memory::MemoryStore;
pub use once::{Action, Once, Settle};
#[cfg(feature = "postgres")]
pub use pg_store::{PgStore, PgTransaction};
pub use problem::{BodyError, ReplayRequestBody, ReplayResponseBody};
#[cfg(feature = "redis")]
pub use redis_store::{OnVolatile, Persistence, RedisStore};
pub use service::Replay;

/// Future types.
pub mod future {
    pub use crate::service::ReplayFuture;
}
pub use store::{
    Claim, Fingerprint, ReplayStore, StoreError, StoreFuture, StoredResponse, decode, encode,
    scope_of,
};
