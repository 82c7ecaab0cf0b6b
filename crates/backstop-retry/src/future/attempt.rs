//! One attempt in flight: the service's future, cut short at the attempt's cutoff.

use super::{
    Attempted, Ended,
    call::{Call, own_verdict},
};
use crate::layer::Policy;
use backstop_classify::{Classify, Verdict};
use backstop_core::{BoxError, HasExtensions};
use backstop_timeout::Expiry;
use pin_project::pin_project;
use std::{
    future::Future,
    pin::Pin,
    task::{Context, Poll, ready},
};
use tokio::time::{Sleep, sleep_until};
use tower_service::Service;

/// The service's future for one attempt, and its timer: created on the first `Pending` only,
/// in place, so an attempt that finishes at once pays for no timer and one that waits for no
/// allocation.
#[pin_project]
pub(super) struct InFlight<F> {
    #[pin]
    fut: F,
    #[pin]
    timer: Option<Sleep>,
}

impl<F> InFlight<F> {
    pub(super) fn new(fut: F) -> Self {
        InFlight { fut, timer: None }
    }

    /// Polls the attempt to its end: a success, or anything else with its verdict (the
    /// service's result, or this layer's own timeout once the cutoff passes). The gate learns
    /// how it ended either way.
    #[inline(always)]
    pub(super) fn poll_end<S, Req, C, P, H>(
        self: Pin<&mut Self>,
        call: &mut Call<S, Req>,
        policy: &Policy<C, P, H>,
        cx: &mut Context<'_>,
    ) -> Poll<Attempted<S::Response, S::Error>>
    where
        S: Service<Req, Future = F>,
        F: Future<Output = Result<S::Response, S::Error>>,
        S::Error: Into<BoxError>,
        Req: HasExtensions,
        C: Classify<Req, S::Response, S::Error>,
    {
        let mut this = self.project();
        let polled = {
            let _entered = call.span.enter();
            this.fut.poll(cx)
        };
        if let Poll::Ready(result) = polled {
            let verdict = policy.classifier.classify(result.as_ref());
            return Poll::Ready(match result {
                Ok(res) if verdict == Verdict::Success => {
                    call.end_attempt(policy, Some(verdict));
                    Attempted::Succeeded(res)
                }
                result => Attempted::Other(call.ended(policy, result, verdict), verdict),
            });
        }
        // The response wins a tie with the timer: it was polled first.
        let Some(cutoff) = call.cutoff else {
            return Poll::Pending;
        };
        if this.timer.is_none() {
            this.timer.set(Some(sleep_until(cutoff.at)));
        }
        ready!(this.timer.as_pin_mut().expect("set above").poll(cx));
        // A learned timeout counts the attempt it cut at its limit (it took at least that):
        // recording successes alone, a timeout learned from a few fast answers would cut the
        // slow ones forever and never learn them.
        if let (Some(latency), Expiry::Attempt { limit }) =
            (&policy.settings.latency, cutoff.expiry)
        {
            latency.record_cut(&call.dependency, limit);
        }
        let error = cutoff.error(Some(call.dependency.clone()));
        let verdict = own_verdict(&error);
        call.end_attempt(policy, Some(verdict));
        Poll::Ready(Attempted::Other(Ended::Own(error), verdict))
    }
}
