//! The end of the attempt that answered a call, handed out with its result
//! ([`RetryFuture::poll_answer`](super::RetryFuture::poll_answer)).

use super::Call;
use backstop_timeout::AttemptCutoff;

/// A call's result and the end of the attempt that gave it (`None` when that attempt had
/// neither an attempt timeout nor a deadline, or when no attempt gave the result).
pub type Answer<T> = (T, Option<AttemptEnd>);

/// When the attempt that answered a call is cut, and the dependency it went to (for the
/// error of a body still arriving then).
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct AttemptEnd {
    /// The instant and the limit: its attempt timeout, or the deadline when that comes first.
    pub cutoff: AttemptCutoff,
    /// The dependency the attempt went to.
    pub dependency: backstop_core::Dependency,
}

impl AttemptEnd {
    /// Records the end of `call`'s attempt in `end`, when the caller wants it (`END`).
    #[inline]
    pub(super) fn record<const END: bool, S, Req>(end: &mut Option<Self>, call: &Call<S, Req>) {
        if END {
            *end = call.cutoff.map(|cutoff| AttemptEnd {
                cutoff,
                dependency: call.dependency.clone(),
            });
        }
    }
}
