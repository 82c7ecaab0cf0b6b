use crate::{
    AttemptRecord, NotReplayable, Replay, RetryError, RetryHistory, StopReason, layer::Policy,
};
use backstop_backoff::Schedule;
use backstop_classify::{Classify, Verdict};
use backstop_core::{BoxError, CallContext, Deadline, Dependency, HasExtensions, Outcome};
use pin_project::pin_project;
use rand::rngs::SmallRng;
use std::{
    fmt,
    future::Future,
    pin::Pin,
    sync::Arc,
    task::{Context, Poll, ready},
    time::Duration,
};
use tokio::time::{Instant, Sleep, sleep};
use tower_service::Service;

/// Response future of [`Retry`](crate::Retry).
#[pin_project]
pub struct ResponseFuture<S, Req, C, P, K>
where
    S: Service<Req>,
{
    #[pin]
    state: State<S::Future>,
    /// `None` when an outer retry layer owns retrying.
    call: Option<CallState<S, Req, C, P, K>>,
}

#[pin_project(project = StateProj)]
enum State<F> {
    Calling {
        #[pin]
        fut: F,
    },
    /// Boxed: only a call that retries pays for the timer, and the future stays small (it is
    /// moved through every outer layer on every call).
    Waiting {
        sleep: Pin<Box<Sleep>>,
    },
    Readying,
    Done,
}

struct CallState<S, Req, C, P, K> {
    policy: Arc<Policy<C, P, K>>,
    svc: S,
    /// The original request, kept for replays; `None` when it cannot be replayed.
    template: Option<Req>,
    not_replayable: Option<NotReplayable>,
    dependency: Dependency,
    deadline: Option<Deadline>,
    started: Instant,
    attempt_started: Instant,
    attempt: u32,
    /// Boxed for the same reason: created on the first backoff.
    schedule: Option<Box<(Schedule, SmallRng)>>,
    history: Vec<AttemptRecord>,
    /// The current attempt's span (disabled, and free, when nobody listens).
    span: tracing::Span,
}

enum Next {
    Stop(StopReason),
    Wait(Duration),
}

impl<S, Req, C, P, K> fmt::Debug for ResponseFuture<S, Req, C, P, K>
where
    S: Service<Req>,
{
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut d = f.debug_struct("ResponseFuture");
        if let Some(call) = &self.call {
            d.field("dependency", &call.dependency)
                .field("attempt", &call.attempt);
        } else {
            d.field("passthrough", &true);
        }
        d.finish()
    }
}

impl<S, Req, C, P, K> ResponseFuture<S, Req, C, P, K>
where
    S: Service<Req>,
    P: Replay<Req>,
{
    pub(crate) fn passthrough(fut: S::Future) -> Self {
        ResponseFuture {
            state: State::Calling { fut },
            call: None,
        }
    }

    pub(crate) fn start(
        policy: Arc<Policy<C, P, K>>,
        mut svc: S,
        mut req: Req,
        dependency: Dependency,
        deadline: Option<Deadline>,
    ) -> Self
    where
        Req: HasExtensions,
    {
        // The template stays as the caller sent it; each attempt is a copy that carries the
        // call's context (dependency, deadline, retry scope) in one extension.
        let ctx = CallContext::for_retry(dependency.clone(), deadline);
        let (first, template, not_replayable) = if policy.max_attempts > 1 {
            match policy.replay.replay(&req) {
                Ok(mut copy) => {
                    copy.extensions_mut().insert(ctx);
                    (copy, Some(req), None)
                }
                Err(why) => {
                    req.extensions_mut().insert(ctx);
                    (req, None, Some(why))
                }
            }
        } else {
            req.extensions_mut().insert(ctx);
            (req, None, None)
        };
        let now = Instant::now();
        crate::obs::call(&dependency);
        let span = attempt_span(&dependency, 1);
        let fut = span.in_scope(|| svc.call(first));
        ResponseFuture {
            state: State::Calling { fut },
            call: Some(CallState {
                policy,
                svc,
                template,
                not_replayable,
                dependency,
                deadline,
                started: now,
                attempt_started: now,
                attempt: 1,
                schedule: None,
                history: Vec::new(),
                span,
            }),
        }
    }
}

fn attempt_span(dependency: &Dependency, attempt: u32) -> tracing::Span {
    tracing::debug_span!(target: "backstop::retry", "attempt", dependency = %dependency, attempt)
}

impl<S, Req, C, P, K> CallState<S, Req, C, P, K>
where
    S: Service<Req>,
    C: Classify<Req, S::Response, S::Error>,
{
    fn record(&mut self, verdict: Verdict) {
        self.history.push(AttemptRecord {
            attempt: self.attempt,
            verdict,
            took: self.attempt_started.elapsed(),
            wait: None,
        });
    }

    fn next(&mut self, verdict: Verdict) -> Next {
        let (outcome, after) = match verdict {
            Verdict::Success => {
                // A first-attempt success records nothing: the hot path does not allocate.
                if !self.history.is_empty() {
                    self.record(verdict);
                }
                return Next::Stop(StopReason::Succeeded);
            }
            Verdict::Fatal { .. } => {
                self.record(verdict);
                return Next::Stop(StopReason::NotRetryable);
            }
            Verdict::Retryable { outcome, after } => (outcome, after),
        };
        self.record(verdict);
        let policy = &self.policy;
        if self.attempt >= policy.max_attempts {
            return Next::Stop(StopReason::AttemptsExhausted {
                max_attempts: policy.max_attempts,
            });
        }
        let Some(template) = &self.template else {
            let why = self
                .not_replayable
                .clone()
                .unwrap_or_else(|| NotReplayable::new("the request could not be copied"));
            return Next::Stop(StopReason::NotReplayable(why));
        };
        if outcome == Outcome::Unknown && !policy.classifier.is_replay_safe(template) {
            return Next::Stop(StopReason::NotReplaySafe);
        }
        let wait = match after {
            Some(after) => after,
            None => {
                let state = self
                    .schedule
                    .get_or_insert_with(|| Box::new((policy.backoff.schedule(), policy.rng.rng())));
                let (schedule, rng) = &mut **state;
                schedule.next_delay(rng)
            }
        };
        if let Some(deadline) = self.deadline {
            let left = deadline.remaining();
            if wait >= left {
                return Next::Stop(StopReason::DeadlineTooClose { wait, left });
            }
        }
        if !policy.budget.withdraw(&self.dependency) {
            crate::obs::budget_refused(&self.dependency);
            return Next::Stop(StopReason::BudgetExhausted);
        }
        if let Some(last) = self.history.last_mut() {
            last.wait = Some(wait);
        }
        tracing::debug!(
            target: "backstop::retry",
            dependency = %self.dependency,
            attempt = self.attempt,
            outcome = outcome.as_str(),
            wait_ms = u64::try_from(wait.as_millis()).unwrap_or(u64::MAX),
            server_asked = after.is_some(),
            "retrying"
        );
        Next::Wait(wait)
    }

    fn history(&mut self, stopped: StopReason) -> RetryHistory {
        RetryHistory {
            dependency: self.dependency.clone(),
            attempts: std::mem::take(&mut self.history),
            elapsed: self.started.elapsed(),
            stopped,
        }
    }

    fn finish(
        &mut self,
        result: Result<S::Response, S::Error>,
        verdict: Verdict,
        stopped: StopReason,
    ) -> Result<S::Response, BoxError>
    where
        S::Response: HasExtensions,
        S::Error: Into<BoxError>,
    {
        let succeeded = matches!(stopped, StopReason::Succeeded);
        let unknown = self
            .history
            .iter()
            .any(|a| a.verdict.outcome() == Outcome::Unknown)
            && !succeeded;
        crate::obs::finished(&self.dependency, self.attempt, succeeded, unknown);
        if !succeeded {
            tracing::debug!(
                target: "backstop::retry",
                dependency = %self.dependency,
                attempts = self.attempt,
                outcome = verdict.outcome().as_str(),
                reason = ?stopped,
                "stopped"
            );
        }
        match result {
            Ok(mut res) => {
                if !self.history.is_empty() {
                    let history = self.history(stopped);
                    res.extensions_mut().insert(history);
                }
                Ok(res)
            }
            Err(e) => {
                let history = self.history(stopped);
                Err(Box::new(RetryError::new(history, verdict, e.into())))
            }
        }
    }
}

impl<S, Req, C, P, K> Future for ResponseFuture<S, Req, C, P, K>
where
    S: Service<Req>,
    S::Error: Into<BoxError>,
    S::Response: HasExtensions,
    Req: HasExtensions,
    C: Classify<Req, S::Response, S::Error>,
    P: Replay<Req>,
{
    type Output = Result<S::Response, BoxError>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let mut this = self.project();
        loop {
            match this.state.as_mut().project() {
                StateProj::Calling { fut } => {
                    let result = match this.call.as_ref() {
                        Some(call) => {
                            let _entered = call.span.enter();
                            ready!(fut.poll(cx))
                        }
                        None => ready!(fut.poll(cx)),
                    };
                    let Some(call) = this.call.as_mut() else {
                        this.state.set(State::Done);
                        return Poll::Ready(result.map_err(Into::into));
                    };
                    let verdict = call.policy.classifier.classify(result.as_ref());
                    match call.next(verdict) {
                        Next::Wait(wait) => {
                            drop(result);
                            this.state.set(State::Waiting {
                                sleep: Box::pin(sleep(wait)),
                            });
                        }
                        Next::Stop(stopped) => {
                            this.state.set(State::Done);
                            return Poll::Ready(call.finish(result, verdict, stopped));
                        }
                    }
                }
                StateProj::Waiting { sleep } => {
                    ready!(sleep.as_mut().poll(cx));
                    this.state.set(State::Readying);
                }
                StateProj::Readying => {
                    let call = this
                        .call
                        .as_mut()
                        .expect("only a retrying future waits for readiness");
                    // Readiness is polled again before every attempt.
                    if let Err(e) = ready!(call.svc.poll_ready(cx)) {
                        this.state.set(State::Done);
                        let verdict = Verdict::Fatal {
                            outcome: Outcome::NotSent,
                        };
                        let history = call.history(StopReason::NotRetryable);
                        return Poll::Ready(Err(Box::new(RetryError::new(
                            history,
                            verdict,
                            e.into(),
                        ))));
                    }
                    let template = call
                        .template
                        .as_ref()
                        .expect("only a replayable request is retried");
                    let mut req =
                        match call.policy.replay.replay(template) {
                            Ok(req) => req,
                            Err(why) => {
                                this.state.set(State::Done);
                                let verdict = call.history.last().map(|a| a.verdict).unwrap_or(
                                    Verdict::Fatal {
                                        outcome: Outcome::NotSent,
                                    },
                                );
                                let history = call.history(StopReason::NotReplayable(why.clone()));
                                return Poll::Ready(Err(Box::new(RetryError::new(
                                    history,
                                    verdict,
                                    Box::new(why),
                                ))));
                            }
                        };
                    req.extensions_mut().insert(CallContext::for_retry(
                        call.dependency.clone(),
                        call.deadline,
                    ));
                    call.attempt += 1;
                    call.attempt_started = Instant::now();
                    call.span = attempt_span(&call.dependency, call.attempt);
                    crate::obs::retry(&call.dependency);
                    let fut = call.span.in_scope(|| call.svc.call(req));
                    this.state.set(State::Calling { fut });
                }
                StateProj::Done => panic!("retry ResponseFuture polled after completion"),
            }
        }
    }
}
