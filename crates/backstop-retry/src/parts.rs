//! What every call of a layer shares, written once: [`Shared`] (the classifier and the copier),
//! and the sealed [`Retryable`] with its aliases.

use crate::{Policy, Resend};
use backstop_classify::{Classify, Verdict};
use backstop_core::{BoxError, HasExtensions, Outcome};
use tower_service::Service;

/// What every call's future reads: shared by the layer's services through one `Arc`.
pub(crate) struct Shared<C, P> {
    pub(crate) classifier: C,
    pub(crate) resend: P,
}

/// What the retry layer asks of the service it wraps (`Svc`), the request (`Req`), the
/// classifier, the copier and the policy: the bounds, written once. Implemented for the tuple
/// `(S, Req, C, P, Pol)` whenever they hold, and sealed: a layer wrapping
/// [`ResponseFuture`](crate::future::ResponseFuture) names its parts through it, and nothing
/// else implements it.
pub trait Retryable: sealed::Sealed {
    /// The request.
    type Req: HasExtensions;
    /// The service each attempt goes to.
    type Svc: Service<Self::Req, Error: Into<BoxError>, Response: HasExtensions>;
    /// Judges each attempt.
    type Classifier: Classify<Self::Req, Res<Self>, Err<Self>>;
    /// Copies the request for each attempt.
    type Resend: Resend<Self::Req>;
    /// Decides after each attempt.
    type Policy: Policy<Self::Req, Res<Self>>;
}

mod sealed {
    #[allow(unreachable_pub)] // Public in name only: no one outside can implement `Retryable`.
    pub trait Sealed {}
    impl<S, Req, C, P, Pol> Sealed for (S, Req, C, P, Pol) {}
}

impl<S, Req, C, P, Pol> Retryable for (S, Req, C, P, Pol)
where
    S: Service<Req, Error: Into<BoxError>, Response: HasExtensions>,
    Req: HasExtensions,
    C: Classify<Req, S::Response, S::Error>,
    P: Resend<Req>,
    Pol: Policy<Req, S::Response>,
{
    type Req = Req;
    type Svc = S;
    type Classifier = C;
    type Resend = P;
    type Policy = Pol;
}

pub(crate) type Res<T> = <<T as Retryable>::Svc as Service<<T as Retryable>::Req>>::Response;
pub(crate) type Err<T> = <<T as Retryable>::Svc as Service<<T as Retryable>::Req>>::Error;
pub(crate) type Fut<T> = <<T as Retryable>::Svc as Service<<T as Retryable>::Req>>::Future;
pub(crate) type SharedOf<T> = Shared<<T as Retryable>::Classifier, <T as Retryable>::Resend>;
/// How an attempt ended (the inner service's result, its error boxed, or this layer's own
/// error), and its verdict.
pub(crate) type EndOf<T> = (Result<Res<T>, BoxError>, Verdict);

/// The verdict on an attempt that was never sent.
pub(crate) const NOT_SENT: Verdict = Verdict::Fatal {
    outcome: Outcome::NotSent,
};
