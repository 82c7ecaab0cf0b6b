//! What every call of a layer shares, and the bounds on the layer's parts, written once:
//! [`Policy`] (the classifier, the copier and the [`Settings`]), the sealed [`Retryable`] with
//! its aliases, and a call's backoff schedule.

use crate::{AttemptGate, Resend, RetryBudget};
use backstop_backoff::{Backoff, RngSource};
use backstop_classify::{Classify, Verdict};
use backstop_core::{BoxError, HasExtensions, Outcome};
use backstop_timeout::BoundLatency;
use rand::rngs::SmallRng;
use std::{sync::Arc, time::Duration};
use tower_service::Service;

/// What every call's future reads: shared by the layer's services through one `Arc`.
pub(crate) struct Policy<C, P> {
    pub(crate) classifier: C,
    pub(crate) resend: P,
    pub(crate) settings: Settings,
}

/// The settings that do not depend on the layer's type parameters.
#[derive(Clone)]
pub(crate) struct Settings {
    pub(crate) max_attempts: u32,
    pub(crate) backoff: Backoff,
    pub(crate) rng: RngSource,
    pub(crate) budget: Arc<dyn RetryBudget>,
    /// The budget admits each attempt too ([`RetryBudget::admits`]).
    pub(crate) budget_admits: bool,
    /// Something is asked before and told after every attempt (`budget_admits`, or a latency
    /// record): one check on the path of an attempt when nothing is.
    pub(crate) attempt_hooks: bool,
    pub(crate) deadline: Option<Duration>,
    pub(crate) attempt_timeout: Option<Duration>,
    /// Attempt timeouts learned from observed latency, instead of `attempt_timeout`.
    pub(crate) latency: Option<BoundLatency>,
    pub(crate) gate: Option<Arc<dyn AttemptGate>>,
    /// The inner service is a leaf client: no call context is written on the attempts.
    pub(crate) leaf: bool,
}

/// How an attempt ended: the inner service's result, or this layer's own error.
pub(crate) enum Ended<T, E> {
    Inner(Result<T, E>),
    Own(BoxError),
}

impl<T, E: Into<BoxError>> Ended<T, E> {
    /// The result as it came, every error boxed.
    pub(crate) fn into_result(self) -> Result<T, BoxError> {
        match self {
            Ended::Inner(r) => r.map_err(Into::into),
            Ended::Own(e) => Err(e),
        }
    }
}

/// A call's backoff, created at its first retry.
pub(crate) type Schedule = (backstop_backoff::Schedule, SmallRng);

/// What the retry layer asks of the service it wraps (`Svc`), the request (`Req`), the
/// classifier and the copier: the bounds, written once. Implemented for the tuple
/// `(S, Req, C, P)` whenever they hold, and sealed: a layer wrapping [`ResponseFuture`](crate::future::ResponseFuture) names
/// its parts through it, and nothing else implements it.
pub trait Retryable: sealed::Sealed {
    /// The request.
    type Req: HasExtensions;
    /// The service each attempt goes to.
    type Svc: Service<Self::Req, Error: Into<BoxError>, Response: HasExtensions>;
    /// Judges each attempt.
    type Classifier: Classify<Self::Req, Res<Self>, Err<Self>>;
    /// Copies the request for each attempt.
    type Resend: Resend<Self::Req>;
}

mod sealed {
    #[allow(unreachable_pub)] // Public in name only: no one outside can implement `Retryable`.
    pub trait Sealed {}
    impl<S, Req, C, P> Sealed for (S, Req, C, P) {}
}

impl<S, Req, C, P> Retryable for (S, Req, C, P)
where
    S: Service<Req, Error: Into<BoxError>, Response: HasExtensions>,
    Req: HasExtensions,
    C: Classify<Req, S::Response, S::Error>,
    P: Resend<Req>,
{
    type Req = Req;
    type Svc = S;
    type Classifier = C;
    type Resend = P;
}

pub(crate) type Res<T> = <<T as Retryable>::Svc as Service<<T as Retryable>::Req>>::Response;
pub(crate) type Err<T> = <<T as Retryable>::Svc as Service<<T as Retryable>::Req>>::Error;
pub(crate) type Fut<T> = <<T as Retryable>::Svc as Service<<T as Retryable>::Req>>::Future;
pub(crate) type PolicyOf<T> = Policy<<T as Retryable>::Classifier, <T as Retryable>::Resend>;
/// An attempt's end and its verdict.
pub(crate) type EndOf<T> = (Ended<Res<T>, Err<T>>, Verdict);

/// The verdict on an attempt that was never sent.
pub(crate) const NOT_SENT: Verdict = Verdict::Fatal {
    outcome: Outcome::NotSent,
};
