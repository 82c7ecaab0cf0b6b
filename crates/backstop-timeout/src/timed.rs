use backstop_core::{
    AttemptTimedOut, BoxError, CallContext, Deadline, DeadlineExceeded, Dependency, HasExtensions,
    Outcome,
};
use pin_project::pin_project;
use std::{
    future::Future,
    pin::Pin,
    task::{Context, Poll, ready},
    time::Duration,
};
use tokio::time::{Instant, Sleep, sleep_until};

/// Which limit ends an attempt that runs out of time.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Expiry {
    /// Its own attempt timeout: an [`AttemptTimedOut`](backstop_core::AttemptTimedOut) error (outcome unknown).
    Attempt {
        /// The attempt timeout.
        limit: Duration,
    },
    /// The call's deadline, which came first: a [`DeadlineExceeded`](backstop_core::DeadlineExceeded) error (outcome unknown).
    Deadline {
        /// How long the deadline was, when known.
        length: Option<Duration>,
    },
}

/// When an attempt must end, and why: the one rule the timeout layers and the body timer
/// follow. The attempt gets `min(attempt timeout, time left before the
/// deadline)`, so the last attempt ends at the deadline with a verdict instead of being cut off
/// from outside.
///
/// ```
/// use backstop_core::Deadline;
/// use backstop_timeout::plumbing::{AttemptCutoff, Expiry};
/// use std::time::Duration;
/// use tokio::time::Instant;
///
/// # #[tokio::main(flavor = "current_thread", start_paused = true)]
/// # async fn main() {
/// let now = Instant::now();
/// let limit = Some(Duration::from_secs(3));
/// let end = AttemptCutoff::plan(now, limit, Some(Deadline::at(now + Duration::from_secs(2))));
/// assert!(matches!(end.unwrap().unwrap().expiry, Expiry::Deadline { .. }));
/// let end = AttemptCutoff::plan(now, limit, Some(Deadline::at(now + Duration::from_secs(10))));
/// assert_eq!(end.unwrap().unwrap().expiry, Expiry::Attempt { limit: Duration::from_secs(3) });
/// assert!(AttemptCutoff::plan(now, limit, Some(Deadline::at(now))).is_err());
/// # }
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AttemptCutoff {
    /// The instant the attempt is cut at.
    pub at: Instant,
    /// Which limit that is.
    pub expiry: Expiry,
}

/// The call's deadline had already passed when the attempt was to start: nothing is sent.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DeadlinePassed {
    /// How long the deadline was, when known.
    pub length: Option<Duration>,
}

impl DeadlinePassed {
    /// The error for it: [`DeadlineExceeded`](backstop_core::DeadlineExceeded), outcome not sent.
    pub fn error(self, dependency: Option<Dependency>) -> BoxError {
        Box::new(DeadlineExceeded::new(dependency, Outcome::NotSent).with_length(self.length))
    }
}

impl AttemptCutoff {
    /// When an attempt starting at `now` ends, given its own `limit` and the call's `deadline`
    /// (`Ok(None)`: neither is set). Instants are compared, never subtracted.
    pub fn plan(
        now: Instant,
        limit: Option<Duration>,
        deadline: Option<Deadline>,
    ) -> Result<Option<AttemptCutoff>, DeadlinePassed> {
        let own = limit.map(|limit| AttemptCutoff {
            at: backstop_core::plumbing::instant_after(now, limit),
            expiry: Expiry::Attempt { limit },
        });
        let Some(deadline) = deadline else {
            return Ok(own);
        };
        let end = deadline.instant();
        if end <= now {
            return Err(DeadlinePassed {
                length: deadline.length(),
            });
        }
        Ok(Some(match own {
            Some(own) if own.at < end => own,
            _ => AttemptCutoff {
                at: end,
                expiry: Expiry::Deadline {
                    length: deadline.length(),
                },
            },
        }))
    }

    /// The end an attempt timeout outside planned for this attempt and put in its call
    /// context ([`CallContext::set_attempt_end`]): read by a layer further in (the body timer),
    /// not planned again. `None` when no attempt timeout planned one.
    pub fn handed_down(ctx: &CallContext) -> Option<AttemptCutoff> {
        let (at, limit) = ctx.attempt_end()?;
        let expiry = match limit {
            Some(limit) => Expiry::Attempt { limit },
            None => Expiry::Deadline {
                length: ctx.deadline().and_then(Deadline::length),
            },
        };
        Some(AttemptCutoff { at, expiry })
    }

    /// Records this end in `req`'s call context, for the layers further in.
    pub fn hand_down<R: HasExtensions + ?Sized>(self, req: &mut R) {
        let limit = match self.expiry {
            Expiry::Attempt { limit } => Some(limit),
            Expiry::Deadline { .. } => None,
        };
        CallContext::set_attempt_end(req, self.at, limit);
    }

    /// The error of an attempt cut at this end.
    pub fn error(self, dependency: Option<Dependency>) -> BoxError {
        match self.expiry {
            Expiry::Attempt { limit } => Box::new(AttemptTimedOut::new(dependency, limit)),
            Expiry::Deadline { length } => {
                Box::new(DeadlineExceeded::new(dependency, Outcome::Unknown).with_length(length))
            }
        }
    }
}

/// Response future of both timeout layers: the inner future, bounded by an instant.
#[pin_project]
#[derive(Debug)]
pub struct TimedFuture<F> {
    #[pin]
    state: State<F>,
}

#[pin_project(project = StateProj)]
#[derive(Debug)]
enum State<F> {
    Running {
        #[pin]
        inner: F,
        /// Created on the first poll that finds the inner future pending: a call that completes
        /// at once never touches the timer.
        #[pin]
        sleep: Option<Sleep>,
        /// `None`: nothing bounds this call.
        end: Option<AttemptCutoff>,
        dependency: Option<Dependency>,
    },
    Failed {
        error: Option<BoxError>,
    },
}

impl<F> TimedFuture<F> {
    /// `inner`, cut at `end`.
    pub(crate) fn new(
        inner: F,
        end: Option<AttemptCutoff>,
        dependency: Option<Dependency>,
    ) -> Self {
        TimedFuture {
            state: State::Running {
                inner,
                sleep: None,
                end,
                dependency,
            },
        }
    }

    /// A call refused before it started: its deadline had already passed.
    pub(crate) fn too_late(passed: DeadlinePassed, dependency: Option<Dependency>) -> Self {
        TimedFuture {
            state: State::Failed {
                error: Some(passed.error(dependency)),
            },
        }
    }
}

impl<F, T, E> Future for TimedFuture<F>
where
    F: Future<Output = Result<T, E>>,
    E: Into<BoxError>,
{
    type Output = Result<T, BoxError>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        match self.project().state.project() {
            StateProj::Running {
                inner,
                mut sleep,
                end,
                dependency,
            } => {
                // The response wins a tie with the timer.
                if let Poll::Ready(r) = inner.poll(cx) {
                    return Poll::Ready(r.map_err(Into::into));
                }
                let Some(end) = end else {
                    return Poll::Pending;
                };
                if sleep.is_none() {
                    sleep.set(Some(sleep_until(end.at)));
                }
                ready!(sleep.as_pin_mut().expect("set above").poll(cx));
                Poll::Ready(Err(end.error(dependency.take())))
            }
            StateProj::Failed { error } => Poll::Ready(Err(error
                .take()
                .expect("timeout future polled after completion"))),
        }
    }
}
