//! Future types: the retry layer's [`ResponseFuture`] and the hedge's.
//!
//! The retry layer's future in tower's shape: an attempt in flight (`Called`), a wait before
//! the next (`Waiting`), the service getting ready for it (`Readying`). Every attempt, the
//! first included, is begun by `Call::begin`; after each, one decision (`Call::decide`, which
//! asks the call's [`Policy`]); every end of a call passes `Call::finish`. The
//! policy decides whether another attempt follows and after how long; this future drives.

pub use crate::hedge::HedgeFuture;

/// The sealed bound that names the parts of a [`ResponseFuture`] (its service, request,
/// classifier, copier and policy); a layer wrapping the future names them through it.
#[doc(hidden)]
pub use crate::parts::Retryable;

use crate::{
    Error, Policy, StopReason,
    call::Call,
    parts::{Fut, NOT_SENT, Res},
};
use backstop_core::BoxError;
use pin_project::pin_project;
use std::{
    fmt,
    future::Future,
    pin::Pin,
    task::{Context, Poll, ready},
};
use tokio::time::{Instant, Sleep, sleep};

const POLLED_AFTER: &str = "ResponseFuture polled after completion";

/// Response future of [`Retry`](crate::Retry).
#[pin_project]
pub struct ResponseFuture<T: Retryable> {
    call: Call<T>,
    #[pin]
    state: State<Fut<T>>,
}

#[pin_project(project = StateProj)]
enum State<F> {
    /// An attempt in flight.
    Called {
        #[pin]
        fut: F,
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
    Done,
}

impl<T: Retryable> ResponseFuture<T> {
    /// Starts `call` with its first attempt, `req`.
    pub(crate) fn new(mut call: Call<T>, req: T::Req) -> Self {
        if !call.nested {
            crate::obs::call(&call.dependency);
        }
        let copies = !call.nested && call.policy.may_retry(&req);
        let fut = call.begin(call.started, |template, resend| {
            if copies {
                template.keep(resend, req)
            } else {
                req
            }
        });
        ResponseFuture {
            call,
            state: State::Called { fut },
        }
    }
}

impl<T: Retryable> Future for ResponseFuture<T> {
    type Output = Result<Res<T>, Error>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let mut this = self.project();
        let call = &mut *this.call;
        loop {
            // How the attempt ended, and a stop that needs no decision.
            let (ended, verdict, stop) = match this.state.as_mut().project() {
                StateProj::Called { fut } => {
                    let (ended, verdict) = ready!(call.poll_attempt(fut, cx));
                    (ended, verdict, None)
                }
                StateProj::Waiting { sleep } => {
                    ready!(sleep.poll(cx));
                    this.state.set(State::Readying { timer: None });
                    continue;
                }
                StateProj::Readying { timer } => match ready!(call.poll_ready(timer, cx)) {
                    Ok(()) => match call.copy() {
                        Ok(req) => {
                            let fut = call.begin(Instant::now(), |_, _| req);
                            this.state.set(State::Called { fut });
                            continue;
                        }
                        // The copy failed after the policy allowed the retry: the last
                        // attempt's end stands.
                        Err(why) => {
                            let verdict = call.history.last().map_or(NOT_SENT, |a| a.verdict);
                            let error = Err(BoxError::from(why.clone()));
                            (error, verdict, Some(StopReason::NotCopyable(why)))
                        }
                    },
                    Err(error) => {
                        call.begin_attempt(Instant::now());
                        (Err(error), NOT_SENT, None)
                    }
                },
                StateProj::Done => panic!("{POLLED_AFTER}"),
            };
            let stopped = match stop {
                Some(stop) => Some(stop),
                None => match call.decide(&ended, verdict) {
                    Ok(wait) => {
                        this.state.set(State::Waiting { sleep: sleep(wait) });
                        continue;
                    }
                    Err(stopped) => stopped,
                },
            };
            // The call's one end.
            this.state.set(State::Done);
            return Poll::Ready(call.finish(ended, verdict, stopped));
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
