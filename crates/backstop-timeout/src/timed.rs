use backstop_core::{AttemptTimedOut, BoxError, DeadlineExceeded, Dependency, Outcome};
use pin_project::pin_project;
use std::{
    future::Future,
    pin::Pin,
    task::{Context, Poll, ready},
    time::Duration,
};
use tokio::time::{Instant, Sleep, sleep_until};

/// What running out of time means for a [`TimedFuture`].
#[derive(Debug)]
pub(crate) enum Expiry {
    /// The attempt timeout: an [`AttemptTimedOut`] error.
    Attempt { limit: Duration },
    /// The call's deadline: a [`DeadlineExceeded`] error with an unknown outcome.
    Deadline,
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
        at: Instant,
        expiry: Expiry,
        dependency: Option<Dependency>,
    },
    Failed {
        error: Option<BoxError>,
    },
}

impl<F> TimedFuture<F> {
    pub(crate) fn new(
        inner: F,
        at: Instant,
        expiry: Expiry,
        dependency: Option<Dependency>,
    ) -> Self {
        TimedFuture {
            state: State::Running {
                inner,
                sleep: None,
                at,
                expiry,
                dependency,
            },
        }
    }

    /// A call refused before it started: its deadline had already passed.
    pub(crate) fn too_late(dependency: Option<Dependency>) -> Self {
        TimedFuture {
            state: State::Failed {
                error: Some(DeadlineExceeded::new(dependency, Outcome::NotSent).into()),
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
                at,
                expiry,
                dependency,
            } => {
                // The response wins a tie with the timer.
                if let Poll::Ready(r) = inner.poll(cx) {
                    return Poll::Ready(r.map_err(Into::into));
                }
                if sleep.is_none() {
                    sleep.set(Some(sleep_until(*at)));
                }
                ready!(sleep.as_pin_mut().expect("set above").poll(cx));
                let dependency = dependency.take();
                Poll::Ready(Err(match *expiry {
                    Expiry::Attempt { limit } => AttemptTimedOut::new(dependency, limit).into(),
                    Expiry::Deadline => DeadlineExceeded::new(dependency, Outcome::Unknown).into(),
                }))
            }
            StateProj::Failed { error } => Poll::Ready(Err(error
                .take()
                .expect("timeout future polled after completion"))),
        }
    }
}
