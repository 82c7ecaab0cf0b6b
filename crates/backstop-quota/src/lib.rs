//! Pacing to the quota a server advertises.
//!
//! LLM APIs, and many HTTP APIs, say on every response how much more they will take: requests
//! and tokens per window, what is left, when it resets. A client that only reacts to `429`
//! spends attempts learning what it was told, and a fleet told `Retry-After: 60` wakes in the
//! same millisecond. [`QuotaLayer`] reads what each response advertises ([`advertised`]: the
//! IETF `RateLimit` fields, the `x-ratelimit-*` family with its `-requests` and `-tokens`
//! variants, Anthropic's `anthropic-ratelimit-*`, `retry-after-ms`) into [`Quotas`] shared by
//! the process, and paces each attempt to them: it goes when the quota has room for it (one
//! request, and its [`Cost`] in tokens), waits for the reset within its deadline when it has
//! not, spreading the callers of one reset over a window, and ends at once, *not sent*, with
//! when to come back, when the reset comes too late.
//!
//! In a Backstop stack it sits inside the retry layer and outside the breaker; `Backstop`'s
//! builder puts it there with `pace(quotas)`. With the feature `fleet`, processes that share a
//! quota take from one account in Redis (`Quotas::join_fleet`).
#![forbid(unsafe_code)]
// docs.rs (nightly, `--cfg docsrs`) badges every item behind a feature with it.
#![cfg_attr(docsrs, feature(doc_cfg))]
#![deny(missing_docs)]

#[cfg(feature = "fleet")]
mod fleet;
mod headers;
mod layer;
mod quotas;

#[cfg(feature = "fleet")]
pub use fleet::{Fleet, FleetConfig, FleetStats};
pub use headers::{Advertised, Unit, advertised};
pub use layer::{Paced, QuotaLayer, ReadQuotas, ReadQuotasLayer, Told};
pub use quotas::{Cost, Quotas};

/// Response futures.
pub mod future {
    pub use crate::layer::{PacedFuture, ReadQuotasFuture};
}
