//! The retrying part of a call, boxed: waits, readiness, later attempts, until a decision stops
//! the call.

use super::{
    Attempted, Ended, NOT_SENT,
    attempt::InFlight,
    call::Call,
    decide::{Decision, Retries},
};
use crate::{CallHook, Resend, StopReason, layer::Policy};
use backstop_classify::{Classify, Verdict};
use backstop_core::{BoxError, DeadlineExceeded, HasExtensions, Outcome};
use pin_project::pin_project;
use std::{
    future::Future,
    pin::Pin,
    sync::Arc,
    task::{Context, Poll, ready},
    time::Duration,
};
use tokio::time::{Instant, Sleep, sleep, sleep_until};
use tower_service::Service;
use tracing::Span;

/// A call after a first attempt that did not end it, or before one its service was not ready
/// for: everything only a retrying call pays for.
#[pin_project]
pub(super) struct Retrying<S: Service<Req>, Req, C, P, H> {
    pub(super) policy: Arc<Policy<C, P, H>>,
    pub(super) call: Call<S, Req>,
    retries: Retries,
    /// The call's span, which each attempt's span is created in.
    parent: Option<Span>,
    #[pin]
    step: Step<S::Future, Req>,
}

/// Where a retrying call is.
#[pin_project(project = StepProj)]
enum Step<F, Req> {
    /// Waiting before the next attempt.
    Waiting {
        #[pin]
        sleep: Sleep,
    },
    /// Waiting for the service to be ready, never past the deadline (`deadline`: its timer, once
    /// needed). `first`: the first attempt's request, when the service was not ready for it at
    /// `call`.
    Readying {
        #[pin]
        deadline: Option<Sleep>,
        first: Option<Req>,
    },
    /// An attempt in flight.
    Calling {
        #[pin]
        attempt: InFlight<F>,
    },
}

impl<S: Service<Req>, Req, C, P, H> Retrying<S, Req, C, P, H> {
    /// The call, waiting `wait` before its next attempt.
    pub(super) fn after(
        policy: Arc<Policy<C, P, H>>,
        call: Call<S, Req>,
        retries: Retries,
        wait: Duration,
        parent: Option<&Span>,
    ) -> Pin<Box<Self>> {
        Self::boxed(
            policy,
            call,
            retries,
            Step::Waiting { sleep: sleep(wait) },
            parent,
        )
    }

    /// The call, waiting for its service to be ready for the first attempt, `first`.
    pub(super) fn unready(
        policy: Arc<Policy<C, P, H>>,
        call: Call<S, Req>,
        first: Req,
        parent: Option<&Span>,
    ) -> Pin<Box<Self>> {
        let step = Step::Readying {
            deadline: None,
            first: Some(first),
        };
        Self::boxed(policy, call, Retries::default(), step, parent)
    }

    fn boxed(
        policy: Arc<Policy<C, P, H>>,
        call: Call<S, Req>,
        retries: Retries,
        step: Step<S::Future, Req>,
        parent: Option<&Span>,
    ) -> Pin<Box<Self>> {
        Box::pin(Retrying {
            policy,
            call,
            retries,
            parent: parent.cloned(),
            step,
        })
    }
}

impl<S, Req, C, P, H> Future for Retrying<S, Req, C, P, H>
where
    S: Service<Req>,
    S::Error: Into<BoxError>,
    S::Response: HasExtensions,
    Req: HasExtensions,
    C: Classify<Req, S::Response, S::Error>,
    P: Resend<Req>,
    H: CallHook<Req, S::Response>,
{
    type Output = Result<S::Response, BoxError>;

    /// Waits, waits for readiness, makes the attempt, decides; again, until the decision is to
    /// stop.
    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let mut this = self.project();
        let (policy, call) = (&**this.policy, &mut *this.call);
        loop {
            let (ended, verdict) = match this.step.as_mut().project() {
                StepProj::Waiting { sleep } => {
                    ready!(sleep.poll(cx));
                    this.step.set(Step::Readying {
                        deadline: None,
                        first: None,
                    });
                    continue;
                }
                StepProj::Readying { deadline, first } => {
                    if let Err(error) = ready!(poll_ready(call, deadline, cx)) {
                        // Not ready, or never before the deadline: nothing was sent.
                        call.next_attempt(Instant::now());
                        (Ended::Own(error), NOT_SENT)
                    } else {
                        let req = match first.take() {
                            Some(req) => req,
                            None => match copy(policy, call) {
                                Ok(req) => req,
                                Err(why) => {
                                    let stopped = StopReason::NotCopyable(why.clone());
                                    let verdict =
                                        this.retries.history.last().map_or(NOT_SENT, |a| a.verdict);
                                    let history = std::mem::take(&mut this.retries.history);
                                    return Poll::Ready(call.finish(
                                        history,
                                        Ended::Own(Box::new(why)),
                                        verdict,
                                        stopped,
                                    ));
                                }
                            },
                        };
                        if call.attempt > 0 {
                            crate::obs::retry(&call.dependency);
                        }
                        let parent = this.parent.as_ref();
                        match call.begin(policy, Instant::now(), parent, |_| req) {
                            Ok(fut) => {
                                let attempt = InFlight::new(fut);
                                this.step.set(Step::Calling { attempt });
                                continue;
                            }
                            Err(ended) => ended,
                        }
                    }
                }
                StepProj::Calling { attempt } => match ready!(attempt.poll_end(call, policy, cx)) {
                    Attempted::Succeeded(res) => (Ended::Inner(Ok(res)), Verdict::Success),
                    Attempted::Other(ended, verdict) => (ended, verdict),
                },
            };
            if call.nested {
                return Poll::Ready(ended.raw());
            }
            match this.retries.decide(policy, call, verdict) {
                Decision::Retry(wait) => this.step.set(Step::Waiting { sleep: sleep(wait) }),
                Decision::Stop(stopped) => {
                    let history = std::mem::take(&mut this.retries.history);
                    return Poll::Ready(call.finish(history, ended, verdict, stopped));
                }
            }
        }
    }
}

/// A copy of the kept request for the next attempt.
fn copy<S, Req, C, P: Resend<Req>, H>(
    policy: &Policy<C, P, H>,
    call: &Call<S, Req>,
) -> Result<Req, crate::NotCopyable> {
    call.template.kept().and_then(|t| policy.resend.copy(t))
}

/// Polls the service for readiness, and ends the wait with `DeadlineExceeded` (not sent) when
/// the call's deadline passes first (`timer`: the deadline's, once needed).
fn poll_ready<S, Req>(
    call: &mut Call<S, Req>,
    mut timer: Pin<&mut Option<Sleep>>,
    cx: &mut Context<'_>,
) -> Poll<Result<(), BoxError>>
where
    S: Service<Req>,
    S::Error: Into<BoxError>,
{
    if let Poll::Ready(ready) = call.svc.poll_ready(cx) {
        return Poll::Ready(ready.map_err(Into::into));
    }
    let Some(deadline) = call.deadline else {
        return Poll::Pending;
    };
    if timer.is_none() {
        timer.set(Some(sleep_until(deadline.instant())));
    }
    ready!(timer.as_pin_mut().expect("set above").poll(cx));
    let error = DeadlineExceeded::new(Some(call.dependency.clone()), Outcome::NotSent)
        .with_length(deadline.length());
    Poll::Ready(Err(Box::new(error)))
}
