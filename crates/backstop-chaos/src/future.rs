//! The response future of [`Chaos`](crate::Chaos).

use crate::{ChaosError, LOST};
use backstop_core::BoxError;
use pin_project::pin_project;
use std::{
    fmt,
    future::Future,
    io,
    pin::Pin,
    task::{Context, Poll, ready},
    time::Duration,
};
use tokio::time::Sleep;

/// Response future of [`Chaos`](crate::Chaos).
#[pin_project]
pub struct ChaosFuture<F, T> {
    #[pin]
    state: State<F, T>,
}

impl<F, T> ChaosFuture<F, T> {
    pub(crate) fn new(state: State<F, T>) -> Self {
        ChaosFuture { state }
    }
}

#[pin_project(project = ChaosProj)]
pub(crate) enum State<F, T> {
    /// Answered by the layer itself.
    Now {
        /// The answer, until taken.
        result: Option<Result<T, BoxError>>,
    },
    /// The service is answering.
    Calling {
        /// Its future.
        #[pin]
        fut: F,
        /// Lose what it answers.
        lose: bool,
        /// Hold it this long first.
        delay: Option<Duration>,
    },
    /// Holding the answer.
    Holding {
        /// The timer.
        #[pin]
        sleep: Sleep,
        /// The answer.
        result: Option<Result<T, BoxError>>,
    },
}

impl<F, T, E> Future for ChaosFuture<F, T>
where
    F: Future<Output = Result<T, E>>,
    E: Into<BoxError>,
{
    type Output = Result<T, BoxError>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        loop {
            match self.as_mut().project().state.project() {
                ChaosProj::Now { result } => {
                    return Poll::Ready(result.take().expect("polled after completion"));
                }
                ChaosProj::Calling { fut, lose, delay } => {
                    let answer = ready!(fut.poll(cx)).map_err(Into::into);
                    let result = if *lose && answer.is_ok() {
                        Err(ChaosError::new(io::ErrorKind::ConnectionReset, LOST).into())
                    } else {
                        answer
                    };
                    match *delay {
                        Some(by) => self.as_mut().project().state.set(State::Holding {
                            sleep: tokio::time::sleep(by),
                            result: Some(result),
                        }),
                        None => return Poll::Ready(result),
                    }
                }
                ChaosProj::Holding { sleep, result } => {
                    ready!(sleep.poll(cx));
                    return Poll::Ready(result.take().expect("polled after completion"));
                }
            }
        }
    }
}

impl<F, T> fmt::Debug for ChaosFuture<F, T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self.state {
            State::Now { .. } => "ChaosFuture(answered)",
            State::Calling { .. } => "ChaosFuture(calling)",
            State::Holding { .. } => "ChaosFuture(holding)",
        })
    }
}
