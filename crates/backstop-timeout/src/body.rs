//! The attempt's limit and the deadline over the response body.

use crate::timed::AttemptCutoff;
use backstop_core::{BoxError, CallContext, Deadline, Dependency, HasExtensions};
use http_body::{Body, Frame, SizeHint};
use pin_project::pin_project;
use std::{
    error::Error,
    fmt,
    future::Future,
    pin::Pin,
    task::{Context, Poll, ready},
    time::Duration,
};
use tokio::time::{Instant, Sleep, sleep_until};
use tower_layer::Layer;
use tower_service::Service;

/// Keeps an attempt's limit and the call's deadline running over the response body.
///
/// The attempt timeout and the deadline of the retry layer end at the response's headers; a
/// server that sends its headers at once and then stalls, or trickles a byte every few hundred
/// milliseconds, would otherwise hold the caller's `collect()` for as long as it likes. This
/// layer, inside the retry layer, gives each response body the same end as its attempt
/// (`min(attempt timeout, time left before the request's` [`Deadline`](backstop_core::Deadline)`)`, measured from when the
/// attempt started): a body still streaming then ends with a [`BodyTimedOut`] error. Dropping
/// the body drops its timer.
///
/// The limit is a fixed instant, not an idle timer reset by each frame (as tower-http's
/// `TimeoutBody` is): a trickle would reset an idle timer forever.
///
/// The retry decision is made at the headers: a body that fails later is not retried, and its
/// error says the outcome is unknown.
///
/// ```
/// use backstop_core::{BoxError, Deadline, HasExtensions};
/// use backstop_timeout::{BodyTimedOut, BodyTimeoutLayer};
/// use bytes::Bytes;
/// use http_body_util::{BodyExt, StreamBody};
/// use std::time::Duration;
/// use tower::{Layer, ServiceExt, service_fn};
///
/// # #[tokio::main(flavor = "current_thread", start_paused = true)]
/// # async fn main() {
/// // Headers at once, then a body that never ends.
/// let stalls = service_fn(|_req: http::Request<()>| async {
///     let body = StreamBody::new(futures_util::stream::pending::<
///         Result<http_body::Frame<Bytes>, BoxError>,
///     >());
///     Ok::<_, BoxError>(http::Response::new(body))
/// });
/// let svc = BodyTimeoutLayer::new(Some(Duration::from_secs(2))).layer(stalls);
/// let res = svc.oneshot(http::Request::new(())).await.unwrap();
/// let err = res.into_body().collect().await.unwrap_err();
/// let err = err.downcast::<BodyTimedOut>().unwrap();
/// assert_eq!(
///     err.to_string(),
///     "the dependency's response body was still arriving when the 2 s attempt timeout \
///      passed; the outcome is unknown (the request reached it), and it was not retried"
/// );
/// # }
/// ```
#[derive(Clone, Debug)]
pub struct BodyTimeoutLayer {
    limit: Option<Duration>,
    dependency: Option<Dependency>,
}

impl BodyTimeoutLayer {
    /// Bodies end by `limit` after their attempt started (`None`: only the request's
    /// deadline bounds them).
    pub const fn new(limit: Option<Duration>) -> Self {
        BodyTimeoutLayer {
            limit,
            dependency: None,
        }
    }

    /// The dependency named in errors when the request does not name one in its extensions.
    #[must_use]
    pub fn dependency(mut self, name: impl Into<Dependency>) -> Self {
        self.dependency = Some(name.into());
        self
    }
}

impl<S> Layer<S> for BodyTimeoutLayer {
    type Service = BodyTimeout<S>;
    fn layer(&self, inner: S) -> Self::Service {
        BodyTimeout {
            inner,
            limit: self.limit,
            dependency: self.dependency.clone(),
        }
    }
}

/// See [`BodyTimeoutLayer`].
#[derive(Clone, Debug)]
pub struct BodyTimeout<S> {
    inner: S,
    limit: Option<Duration>,
    dependency: Option<Dependency>,
}

impl<S> BodyTimeout<S> {
    /// The inner service.
    pub fn get_ref(&self) -> &S {
        &self.inner
    }
}

impl<S, Req, B> Service<Req> for BodyTimeout<S>
where
    S: Service<Req, Response = http::Response<B>>,
    Req: HasExtensions,
{
    type Response = http::Response<TimedBody<B>>;
    type Error = S::Error;
    type Future = BodyTimeoutFuture<S::Future>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: Req) -> Self::Future {
        // Under an attempt timeout (the composed stack's case), the body ends when its attempt
        // does.
        if let Some(ctx) = CallContext::of(&req)
            && let Some(end) = AttemptCutoff::handed_down(ctx)
        {
            let dependency = ctx
                .dependency()
                .cloned()
                .or_else(|| self.dependency.clone());
            return BodyTimeoutFuture {
                inner: self.inner.call(req),
                end: Some((end, dependency)),
            };
        }
        // A deadline already passed is the attempt's business (it is not sent); here it only
        // means the body has no time at all.
        let end = match AttemptCutoff::plan(Instant::now(), self.limit, Deadline::of(&req)) {
            Ok(end) => end,
            Err(passed) => Some(AttemptCutoff {
                at: Instant::now(),
                expiry: crate::timed::Expiry::Deadline {
                    length: passed.length,
                },
            }),
        };
        let dependency = end.and_then(|_| Dependency::of(&req).or_else(|| self.dependency.clone()));
        BodyTimeoutFuture {
            inner: self.inner.call(req),
            end: end.map(|end| (end, dependency)),
        }
    }
}

/// Response future of [`BodyTimeout`].
#[pin_project]
#[derive(Debug)]
pub struct BodyTimeoutFuture<F> {
    #[pin]
    inner: F,
    end: Option<(AttemptCutoff, Option<Dependency>)>,
}

impl<F, B, E> Future for BodyTimeoutFuture<F>
where
    F: Future<Output = Result<http::Response<B>, E>>,
{
    type Output = Result<http::Response<TimedBody<B>>, E>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let this = self.project();
        let res = ready!(this.inner.poll(cx))?;
        let end = this.end.take();
        Poll::Ready(Ok(res.map(|body| TimedBody::new(body, end))))
    }
}

/// A response body that ends with [`BodyTimedOut`] if it is still streaming at its attempt's
/// end. Built by [`BodyTimeoutLayer`]; the timer is only created once the body has to wait.
#[pin_project]
pub struct TimedBody<B> {
    #[pin]
    body: B,
    /// Boxed: the response that carries this body is moved through every layer on its way
    /// out, and only a body that has to wait needs the timer.
    sleep: Option<Pin<Box<Sleep>>>,
    end: Option<(AttemptCutoff, Option<Dependency>)>,
    done: bool,
}

impl<B> fmt::Debug for TimedBody<B> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("TimedBody")
            .field("end", &self.end.as_ref().map(|e| e.0))
            .finish_non_exhaustive()
    }
}

impl<B> TimedBody<B> {
    /// `body`, ended at `end` (never, when `None`), naming the dependency in its error.
    pub(crate) fn new(body: B, end: Option<(AttemptCutoff, Option<Dependency>)>) -> Self {
        TimedBody {
            body,
            sleep: None,
            end,
            done: false,
        }
    }

    /// The body inside.
    pub fn into_inner(self) -> B {
        self.body
    }
}

impl<B> Body for TimedBody<B>
where
    B: Body,
    B::Error: Into<BoxError>,
{
    type Data = B::Data;
    type Error = BoxError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Self::Data>, Self::Error>>> {
        let this = self.project();
        if *this.done {
            return Poll::Ready(None);
        }
        // The body wins a tie with the timer, as the response does.
        if let Poll::Ready(frame) = this.body.poll_frame(cx) {
            return Poll::Ready(frame.map(|f| f.map_err(Into::into)));
        }
        let Some((end, dependency)) = this.end.as_ref() else {
            return Poll::Pending;
        };
        let sleep = this
            .sleep
            .get_or_insert_with(|| Box::pin(sleep_until(end.at)));
        ready!(sleep.as_mut().poll(cx));
        *this.done = true;
        let cause = end.error(dependency.clone());
        Poll::Ready(Some(Err(Box::new(BodyTimedOut { cause }))))
    }

    fn is_end_stream(&self) -> bool {
        self.done || self.body.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.body.size_hint()
    }
}

/// A response body that was still arriving when its attempt's limit or the call's deadline
/// passed. The outcome of the call is unknown (its response had begun), and it was not
/// retried: the retry decision is made at the headers. `source()` is the limit that passed
/// (`AttemptTimedOut` or `DeadlineExceeded`).
#[derive(Debug)]
pub struct BodyTimedOut {
    cause: BoxError,
}

impl BodyTimedOut {
    /// The limit that passed: an `AttemptTimedOut` or a `DeadlineExceeded`.
    pub fn limit(&self) -> &(dyn Error + Send + Sync + 'static) {
        &*self.cause
    }

    /// Always unknown: the request reached the dependency, whose reply did not end in time.
    pub fn outcome(&self) -> backstop_core::Outcome {
        backstop_core::Outcome::Unknown
    }
}

impl fmt::Display for BodyTimedOut {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        use backstop_core::plumbing::{DeadlineWords, HumanDuration};
        use backstop_core::{AttemptTimedOut, DeadlineExceeded};
        let (dependency, limit) = if let Some(t) = self.cause.downcast_ref::<AttemptTimedOut>() {
            (
                t.dependency(),
                format!("the {} attempt timeout", HumanDuration(t.limit())),
            )
        } else if let Some(d) = self.cause.downcast_ref::<DeadlineExceeded>() {
            (
                d.dependency(),
                DeadlineWords(d.length())
                    .to_string()
                    .replacen("its", "the call's", 1),
            )
        } else {
            (None, self.cause.to_string())
        };
        match dependency {
            Some(d) => write!(f, "the response body from {d}")?,
            None => f.write_str("the dependency's response body")?,
        }
        write!(
            f,
            " was still arriving when {limit} passed; the outcome is unknown (the request \
             reached it), and it was not retried"
        )
    }
}

impl Error for BodyTimedOut {
    fn source(&self) -> Option<&(dyn Error + 'static)> {
        Some(&*self.cause)
    }
}
