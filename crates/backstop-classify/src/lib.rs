//! Decides, for one attempt of a call, whether it succeeded, may be tried again, or must not
//! be, and what is known about its side effect.
//!
//! Retrying is only safe when two questions have answers. *Is the failure transient?* A `503`
//! or a connection reset may pass; a `400` will fail identically every time. *Could the first
//! attempt have taken effect?* A refused connection did nothing, but a timeout only says the
//! reply was lost: the refund may already be booked. A [`Verdict`] answers both, and the retry
//! layer repeats a request whose side effect is [`Outcome::Unknown`](backstop_core::Outcome::Unknown) only when the request is
//! replay-safe (an idempotent method, an `Idempotency-Key`, or an explicit [`ReplaySafe`](backstop_core::ReplaySafe)
//! marker).
//!
//! [`Classify`] is generic over request, response and error types, so a non-HTTP tool call
//! classifies its own results; [`HttpClassifier`] is the HTTP implementation, and
//! [`parse_retry_after`] reads `Retry-After` in both of its forms.
//!
//! ```
//! use backstop_classify::{Classify, HttpClassifier, Verdict};
//! use backstop_core::{BoxError, Outcome};
//! use http::{Request, Response, StatusCode};
//! use std::time::Duration;
//!
//! let classifier = HttpClassifier::new();
//! let post = Request::post("http://payments.local/refunds").body(()).unwrap();
//! let busy = Response::builder()
//!     .status(StatusCode::TOO_MANY_REQUESTS)
//!     .header("retry-after", "2")
//!     .body(())
//!     .unwrap();
//!
//! let verdict = Classify::<Request<()>, _, BoxError>::classify(&classifier, Ok(&busy));
//! assert_eq!(
//!     verdict,
//!     Verdict::Retryable { outcome: Outcome::NotSent, after: Some(Duration::from_secs(2)) }
//! );
//! // A POST without an idempotency key is not replay-safe.
//! assert!(!Classify::<_, Response<()>, BoxError>::is_replay_safe(&classifier, &post));
//! ```
#![forbid(unsafe_code)]
// docs.rs (nightly, `--cfg docsrs`) badges every item behind a feature with it.
#![cfg_attr(docsrs, feature(doc_cfg))]
#![deny(missing_docs)]

mod error;
#[cfg(feature = "grpc")]
mod grpc;
mod http_classifier;
mod retry_after;

pub use backstop_core::{Classify, Verdict};
#[doc(hidden)] // How Backstop's layers reach each other; not for users.
pub use error::is_attempt_timeout;
pub use error::{AsError, classify_error};
#[cfg(feature = "grpc")]
pub use grpc::{GrpcClassifier, grpc_timeout};
pub use http_classifier::{HttpClassifier, StatusClass};
pub use retry_after::parse_retry_after;
