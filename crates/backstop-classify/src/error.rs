use crate::Verdict;
use backstop_core::{
    AttemptTimedOut, BoxError, CircuitOpen, DeadlineExceeded, Outcome, OverQuota, ReportsOutcome,
    RunSpent, Throttled,
};
use std::{error::Error, io};

/// Views an error as `&dyn Error` so that its `source()` chain can be walked.
///
/// `Box<dyn Error + Send + Sync>` (what tower middleware returns) does not implement `Error`
/// itself, so classifiers take `E: AsError`. Implemented for the boxed error types, for
/// `std::io::Error`, for Backstop's own errors and, behind features, for hyper's and
/// hyper-util's. For another error type, implement it (one line) or box the error.
pub trait AsError {
    /// The error as a trait object.
    fn as_error(&self) -> &(dyn Error + 'static);
}

impl AsError for BoxError {
    fn as_error(&self) -> &(dyn Error + 'static) {
        &**self
    }
}

impl AsError for Box<dyn Error + Send> {
    fn as_error(&self) -> &(dyn Error + 'static) {
        &**self
    }
}

impl AsError for Box<dyn Error> {
    fn as_error(&self) -> &(dyn Error + 'static) {
        &**self
    }
}

macro_rules! as_error_for {
    ($($t:ty),* $(,)?) => {$(
        impl AsError for $t {
            fn as_error(&self) -> &(dyn Error + 'static) {
                self
            }
        }
    )*};
}

as_error_for!(
    io::Error,
    AttemptTimedOut,
    DeadlineExceeded,
    CircuitOpen,
    Throttled,
    OverQuota,
    RunSpent
);

#[cfg(feature = "hyper")]
as_error_for!(hyper::Error);

#[cfg(feature = "hyper-util")]
as_error_for!(hyper_util::client::legacy::Error);

impl AsError for std::convert::Infallible {
    fn as_error(&self) -> &(dyn Error + 'static) {
        match *self {}
    }
}

/// Classifies an error by walking its `source()` chain, outermost first.
///
/// The first error that is recognised decides:
///
/// | error | verdict | outcome |
/// |---|---|---|
/// | [`AttemptTimedOut`], tower's `timeout::error::Elapsed`, tokio's `time::error::Elapsed`, tonic's `TimeoutExpired` (feature `grpc`) | retryable | unknown |
/// | [`DeadlineExceeded`] | fatal (no time left) | as recorded |
/// | [`CircuitOpen`] | fatal (do not call it now) | not sent |
/// | [`Throttled`] (client-side adaptive throttling) | fatal (do not call it now) | not sent |
/// | [`OverQuota`] (the dependency's advertised quota, paced by `backstop-quota`) | fatal (the quota does not come back in time) | not sent |
/// | [`RunSpent`] (the run's spend ceiling) | fatal | not sent |
/// | hyper-util connect error (refused, DNS, connect timeout) | retryable | not sent |
/// | reqwest: connect error / timeout (feature `reqwest`) | retryable | not sent / unknown |
/// | hyper: request cancelled before it was written | retryable | not sent |
/// | hyper: connection closed before the reply completed, read timeout | retryable | unknown |
/// | HTTP/2 `REFUSED_STREAM` (feature `grpc`) | retryable | not sent |
/// | `io::ErrorKind::ConnectionRefused` | retryable | not sent |
/// | `io::ErrorKind::{ConnectionReset, ConnectionAborted, BrokenPipe, UnexpectedEof, TimedOut}` | retryable | unknown |
///
/// Returns `None` when nothing in the chain is recognised; [`HttpClassifier`](crate::HttpClassifier)
/// then treats the error as fatal with an unknown outcome.
pub fn classify_error(error: &(dyn Error + 'static)) -> Option<Verdict> {
    let mut current = Some(error);
    while let Some(e) = current {
        if let Some(v) = recognise(e) {
            return Some(v);
        }
        current = e.source();
    }
    None
}

/// Whether `error` (this error itself, not its sources) is an attempt that ran out of time
/// after it was sent: an [`AttemptTimedOut`], tower's or tokio's `Elapsed`, or (feature
/// `reqwest`) a reqwest timeout that is not a connect timeout. An `io::ErrorKind::TimedOut`
/// is not one: it may be a connect timeout, before anything was sent.
pub fn is_attempt_timeout(e: &(dyn Error + 'static)) -> bool {
    if e.is::<AttemptTimedOut>()
        || e.is::<tower::timeout::error::Elapsed>()
        || e.is::<tokio::time::error::Elapsed>()
    {
        return true;
    }
    // tonic's channel, at its `Endpoint::timeout` or the `grpc-timeout` the request carries.
    #[cfg(feature = "grpc")]
    if e.is::<tonic::TimeoutExpired>() {
        return true;
    }
    #[cfg(feature = "reqwest")]
    if let Some(r) = e.downcast_ref::<reqwest::Error>()
        && r.is_timeout()
        && !r.is_connect()
    {
        return true;
    }
    false
}

fn recognise(e: &(dyn Error + 'static)) -> Option<Verdict> {
    let retry = |outcome| {
        Some(Verdict::Retryable {
            outcome,
            after: None,
        })
    };
    // Attempt timeouts, Backstop's own and those of layers under the stack (tower's
    // `TimeoutLayer`, tokio's `timeout`): the request went out, the reply did not come.
    if is_attempt_timeout(e) {
        return retry(Outcome::Unknown);
    }
    if e.is::<CircuitOpen>() || e.is::<Throttled>() || e.is::<OverQuota>() || e.is::<RunSpent>() {
        return Some(Verdict::Fatal {
            outcome: Outcome::NotSent,
        });
    }
    if let Some(d) = e.downcast_ref::<DeadlineExceeded>() {
        return Some(Verdict::Fatal {
            outcome: d.outcome(),
        });
    }
    #[cfg(feature = "hyper-util")]
    if let Some(h) = e.downcast_ref::<hyper_util::client::legacy::Error>()
        && h.is_connect()
    {
        return retry(Outcome::NotSent);
    }
    #[cfg(feature = "reqwest")]
    if let Some(r) = e.downcast_ref::<reqwest::Error>() {
        if r.is_connect() {
            return retry(Outcome::NotSent);
        }
        if r.is_timeout() {
            return retry(Outcome::Unknown);
        }
    }
    #[cfg(feature = "hyper")]
    if let Some(h) = e.downcast_ref::<hyper::Error>() {
        if h.is_canceled() {
            return retry(Outcome::NotSent);
        }
        if h.is_incomplete_message() || h.is_timeout() {
            return retry(Outcome::Unknown);
        }
    }
    // HTTP/2 guarantees that a stream reset with REFUSED_STREAM was not processed (RFC 9113
    // §8.7): a gRPC `UNAVAILABLE` that comes this way never left.
    #[cfg(feature = "grpc")]
    if let Some(h) = e.downcast_ref::<h2::Error>()
        && h.reason() == Some(h2::Reason::REFUSED_STREAM)
    {
        return retry(Outcome::NotSent);
    }
    if let Some(io) = e.downcast_ref::<io::Error>() {
        use io::ErrorKind::*;
        return match io.kind() {
            ConnectionRefused => retry(Outcome::NotSent),
            ConnectionReset | ConnectionAborted | BrokenPipe | UnexpectedEof | TimedOut => {
                retry(Outcome::Unknown)
            }
            _ => None,
        };
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::{fmt, time::Duration};

    #[derive(Debug)]
    struct Wrapper(Box<dyn Error + Send + Sync>);
    impl fmt::Display for Wrapper {
        fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
            f.write_str("wrapped")
        }
    }
    impl Error for Wrapper {
        fn source(&self) -> Option<&(dyn Error + 'static)> {
            Some(&*self.0)
        }
    }

    #[test]
    fn walks_the_source_chain() {
        let reset = Wrapper(Box::new(io::Error::from(io::ErrorKind::ConnectionReset)));
        assert_eq!(
            classify_error(&reset),
            Some(Verdict::Retryable {
                outcome: Outcome::Unknown,
                after: None
            })
        );
        let refused = Wrapper(Box::new(Wrapper(Box::new(io::Error::from(
            io::ErrorKind::ConnectionRefused,
        )))));
        assert_eq!(
            classify_error(&refused).unwrap().outcome(),
            Outcome::NotSent
        );
    }

    #[test]
    fn backstop_errors() {
        let t = AttemptTimedOut::new(None, Duration::from_secs(1));
        assert_eq!(classify_error(&t).unwrap().outcome(), Outcome::Unknown);
        assert!(classify_error(&t).unwrap().is_retryable());
        let open = backstop_core::CircuitOpen::new(
            "carrier-api".into(),
            backstop_core::CircuitState::Open,
            None,
        );
        assert_eq!(
            classify_error(&open),
            Some(Verdict::Fatal {
                outcome: Outcome::NotSent
            })
        );
        let d = DeadlineExceeded::new(None, Outcome::NotSent);
        assert_eq!(
            classify_error(&d),
            Some(Verdict::Fatal {
                outcome: Outcome::NotSent
            })
        );
    }

    #[tokio::test(start_paused = true)]
    async fn timeouts_raised_under_the_stack_are_attempt_timeouts() {
        let unknown = Some(Verdict::Retryable {
            outcome: Outcome::Unknown,
            after: None,
        });
        let tower_elapsed: BoxError = Box::new(tower::timeout::error::Elapsed::new());
        assert_eq!(classify_error(&*tower_elapsed), unknown);
        let tokio_elapsed =
            tokio::time::timeout(Duration::from_millis(1), std::future::pending::<()>())
                .await
                .unwrap_err();
        assert_eq!(classify_error(&tokio_elapsed), unknown);
        assert_eq!(classify_error(&Wrapper(Box::new(tokio_elapsed))), unknown);
    }

    #[test]
    fn unknown_errors_are_not_recognised() {
        let other = io::Error::other("validation failed");
        assert_eq!(classify_error(&other), None);
        let denied = io::Error::from(io::ErrorKind::PermissionDenied);
        assert_eq!(classify_error(&denied), None);
    }
}
