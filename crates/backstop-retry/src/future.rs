//! Future types: the retry layer's [`ResponseFuture`], the hedge's and the body buffer's.
//!
//! The retry layer's future is in tower's shape: an attempt in flight, a wait before the next,
//! the service getting ready for it. Every attempt, the first included, is begun by
//! `Call::begin`; every end of a call passes `Call::finish` (`call.rs`).

pub use crate::body::BufferBodyFuture;
pub use crate::hedge::HedgeFuture;

use crate::{
    Resend, StopReason,
    call::{Call, Ended},
    layer::Policy,
};
use backstop_classify::{Classify, Verdict};
use backstop_core::{BoxError, Dependency, HasExtensions, Outcome};
use backstop_timeout::AttemptCutoff;
use pin_project::{pin_project, pinned_drop};
use std::{
    fmt,
    future::Future,
    pin::Pin,
    sync::Arc,
    task::{Context, Poll, ready},
};
use tokio::time::{Instant, Sleep, sleep};
use tower_service::Service;

/// What the retry layer asks of the service it wraps (`Svc`), the request (`Req`), the
/// classifier and the copier: the bounds, written once. Implemented for the tuple
/// `(S, Req, C, P)` whenever they hold, and sealed: a layer wrapping [`ResponseFuture`] names
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
const POLLED_AFTER: &str = "ResponseFuture polled after completion";

/// Response future of [`Retry`](crate::Retry).
#[pin_project(PinnedDrop)]
pub struct ResponseFuture<T: Retryable> {
    policy: Arc<PolicyOf<T>>,
    call: Call<T>,
    #[pin]
    state: State<Fut<T>>,
}

#[pin_project(project = StateProj)]
pub(crate) enum State<F> {
    /// An attempt in flight, and its timer (created at its first `Pending`).
    Called {
        #[pin]
        fut: F,
        #[pin]
        timer: Option<Sleep>,
    },
    /// Waiting before the next attempt.
    Waiting {
        #[pin]
        sleep: Sleep,
    },
    /// The service getting ready for the next attempt, never past the deadline (`timer`).
    Readying {
        #[pin]
        timer: Option<Sleep>,
    },
    /// The attempt ended before it was sent; its error is taken at the next poll.
    Unsent(Option<(BoxError, Verdict)>),
    Done,
}

/// When the attempt that answered a call is cut, and the dependency it went to (for the error
/// of a body still arriving then).
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct AttemptEnd {
    /// The instant and the limit: its attempt timeout, or the deadline when that comes first.
    pub cutoff: AttemptCutoff,
    /// The dependency the attempt went to.
    pub dependency: Dependency,
}

impl<T: Retryable> ResponseFuture<T> {
    /// Starts `call` with its first attempt, `req` (`ready`: false when the service's
    /// readiness wait outlasted the deadline, and the call ends at once, not sent).
    #[inline]
    pub(crate) fn new(
        policy: Arc<PolicyOf<T>>,
        mut call: Call<T>,
        req: T::Req,
        ready: bool,
    ) -> Self {
        let nested = call.nested;
        let now = call.started;
        if !nested {
            crate::obs::call(&call.dependency);
        }
        let state = if ready {
            let copies = !nested && policy.settings.max_attempts > 1;
            call.begin(&policy, now, |template| {
                if copies {
                    template.keep(&policy.resend, req)
                } else {
                    req
                }
            })
        } else {
            call.begin_attempt(now);
            State::Unsent(Some((call.not_ready(), NOT_SENT)))
        };
        ResponseFuture {
            policy,
            call,
            state,
        }
    }

    /// When the attempt that answered the call is cut, and its dependency: for a timer on the
    /// response's body, outside the layer (`None` when that attempt had no limit).
    pub fn attempt_end(&self) -> Option<AttemptEnd> {
        let call = &self.call;
        call.cutoff.map(|cutoff| AttemptEnd {
            cutoff,
            dependency: call.dependency.clone(),
        })
    }
}

impl<T: Retryable> Future for ResponseFuture<T> {
    type Output = Result<Res<T>, BoxError>;

    #[inline]
    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let mut this = self.project();
        let (policy, call) = (&**this.policy, &mut *this.call);
        loop {
            let (ended, verdict) = match this.state.as_mut().project() {
                StateProj::Called { fut, timer } => {
                    ready!(call.poll_attempt(policy, fut, timer, cx))
                }
                StateProj::Waiting { sleep } => {
                    ready!(sleep.poll(cx));
                    this.state.set(State::Readying { timer: None });
                    continue;
                }
                StateProj::Readying { timer } => match ready!(call.poll_ready(timer, cx)) {
                    Ok(()) => {
                        let copy = call.template.kept().and_then(|t| policy.resend.copy(t));
                        let next = match copy {
                            Ok(req) => call.begin(policy, Instant::now(), |_| req),
                            Err(why) => {
                                let verdict = call.history.last().map_or(NOT_SENT, |a| a.verdict);
                                let error = Ended::Own(Box::new(why.clone()));
                                this.state.set(State::Done);
                                let stopped = Some(StopReason::NotCopyable(why));
                                return Poll::Ready(call.finish(error, verdict, stopped));
                            }
                        };
                        this.state.set(next);
                        continue;
                    }
                    Err(error) => {
                        call.begin_attempt(Instant::now());
                        (Ended::Own(error), NOT_SENT)
                    }
                },
                StateProj::Unsent(ended) => {
                    let (error, verdict) = ended.take().expect(POLLED_AFTER);
                    (Ended::Own(error), verdict)
                }
                StateProj::Done => panic!("{POLLED_AFTER}"),
            };
            match call.decide(policy, verdict) {
                Ok(wait) => this.state.set(State::Waiting { sleep: sleep(wait) }),
                Err(stopped) => {
                    this.state.set(State::Done);
                    return Poll::Ready(call.finish(ended, verdict, stopped));
                }
            }
        }
    }
}

#[pinned_drop]
impl<T: Retryable> PinnedDrop for ResponseFuture<T> {
    /// A call dropped mid-attempt: the gate learns the attempt ended without a verdict.
    fn drop(self: Pin<&mut Self>) {
        let this = self.project();
        if let StateProj::Called { .. } = this.state.project() {
            this.call.end_attempt(this.policy, None);
        }
    }
}

impl<T: Retryable> fmt::Debug for ResponseFuture<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ResponseFuture")
            .field("dependency", &self.call.dependency.as_str())
            .field("attempt", &self.call.attempt)
            .finish_non_exhaustive()
    }
}
