//! Future types: the retry layer's [`ResponseFuture`], the hedge's and the body buffer's.
//!
//! The retry layer's future is in tower's shape: an attempt in flight, a wait before the next,
//! the service getting ready for it. Every attempt, the first included, is begun by
//! `Call::begin`; every end of a call passes `Call::finish` (`call.rs`).

pub use crate::body::BufferBodyFuture;
pub use crate::hedge::HedgeFuture;

pub use crate::parts::Retryable;

use crate::{
    Resend, StopReason,
    call::{Call, State, StateProj},
    parts::{Ended, Fut, NOT_SENT, PolicyOf, Res},
};
use backstop_core::{BoxError, Dependency};
use backstop_timeout::AttemptCutoff;
use pin_project::{pin_project, pinned_drop};
use std::{
    fmt,
    future::Future,
    pin::Pin,
    sync::Arc,
    task::{Context, Poll, ready},
};
use tokio::time::{Instant, sleep};

const POLLED_AFTER: &str = "ResponseFuture polled after completion";

/// Response future of [`Retry`](crate::Retry).
#[pin_project(PinnedDrop)]
pub struct ResponseFuture<T: Retryable> {
    policy: Arc<PolicyOf<T>>,
    call: Call<T>,
    #[pin]
    state: State<Fut<T>>,
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
