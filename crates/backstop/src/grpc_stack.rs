//! The composed stack for gRPC calls (tonic's channel, or any gRPC-over-HTTP/2 client).

use crate::{
    Backstop,
    attempt_header::AttemptHeaders,
    box_errors::BoxErrors,
    transport::{Attempts, TransportSettings, attempts, sealed},
};
use backstop_classify::{GrpcClassifier, grpc_timeout};
use backstop_core::{BoxError, CallContext, Deadline, Dependency};
use backstop_idempotency::{HttpKeys, IdempotencyLayer};
use backstop_retry::StreamingResend;
use backstop_timeout::{BodyTimeout, BodyTimeoutLayer, plumbing::AttemptCutoff};
use pin_project::pin_project;
use std::{
    future::Future,
    pin::Pin,
    task::{Context, Poll, ready},
    time::Duration,
};
use tokio::time::Instant;
use tower_layer::Layer;
use tower_service::Service;

impl Backstop<GrpcClassifier, StreamingResend, HttpKeys> {
    /// The stack for the gRPC calls to `dependency`, over tonic's `Channel` (or any service of
    /// `http::Request<tonic::body::Body>`): [`GrpcClassifier`] judges each attempt at its
    /// headers (gRPC's retry design, A6: `UNAVAILABLE` and `RESOURCE_EXHAUSTED` retried,
    /// `grpc-retry-pushback-ms` honoured, a negative one obeyed), and each attempt carries
    /// `grpc-timeout` (what is left of the attempt and of the deadline) and, on retries,
    /// `grpc-previous-rpc-attempts`. Request bodies are copied while they stream, up to
    /// [`body_limit`](Backstop::body_limit) (64 KiB): nothing waits for the whole body before
    /// the first send, and a body past the limit is sent once and not retried. Errors are the
    /// typed [`Error`](crate::Error) (tonic's `Status` carries it as its source). Defaults as
    /// for [`Backstop::http`]. Feature `grpc`.
    pub fn grpc(dependency: impl Into<Dependency>) -> Self {
        Self::with(
            dependency.into(),
            GrpcClassifier::new(),
            StreamingResend::default(),
            IdempotencyLayer::http(),
        )
    }

    /// The most of each request body kept for retries (64 KiB).
    #[must_use]
    pub fn body_limit(mut self, bytes: usize) -> Self {
        self.resend = StreamingResend::new(bytes);
        self
    }
}

/// A gRPC call's method is its request's path (`/package.Service/Method`), its target the
/// authority it goes to.
impl<B> sealed::Describes<http::Request<B>> for StreamingResend {
    fn grpc_method(req: &http::Request<B>) -> Option<(String, String)> {
        let uri = req.uri();
        let target = uri.authority().map(|a| a.to_string()).unwrap_or_default();
        Some((uri.path().to_owned(), target))
    }
}

impl<S> sealed::Wraps<S> for StreamingResend {
    type Client = Attempts<BoxErrors<BodyTimeout<GrpcAttempt<AttemptHeaders<S>>>>>;
    fn wrap(&self, client: S, settings: &TransportSettings) -> Self::Client {
        // The time left travels as `grpc-timeout` (below).
        let client = AttemptHeaders {
            inner: client,
            attempt: settings.attempt_header.clone(),
            time_left: None,
        };
        let client = GrpcAttempt {
            inner: client,
            attempt_timeout: settings.attempt_timeout,
        };
        let client = BoxErrors(BodyTimeoutLayer::new(settings.attempt_timeout).layer(client));
        attempts(client, settings)
    }
}

/// Sets gRPC's per-attempt metadata, `grpc-timeout` (the time the attempt has: its timeout and
/// the call's deadline, whichever ends first, as the stack's attempt timeout planned it with
/// [`AttemptCutoff::plan`] and handed it down in the call context) and, on a retry,
/// `grpc-previous-rpc-attempts`, and keeps the attempt's end the stack's own.
///
/// The `grpc-timeout` sent starts two more timers for the same instant: the client's (tonic's
/// channel ends the call with its `TimeoutExpired`) and the server's (tonic's server answers
/// `CANCELLED`, others `DEADLINE_EXCEEDED`). Whichever is polled first wins the tie, so an
/// attempt that ends once its time is up with an error, or with `CANCELLED` or
/// `DEADLINE_EXCEEDED` in its headers, ended by the limit the stack sent: it becomes the
/// stack's own [`AttemptTimedOut`](backstop_core::AttemptTimedOut) or
/// [`DeadlineExceeded`](backstop_core::DeadlineExceeded) (outcome unknown), judged as the
/// stack's timer would have judged it.
#[derive(Clone, Debug)]
pub struct GrpcAttempt<S> {
    inner: S,
    attempt_timeout: Option<Duration>,
}

impl<S, B, ResB> Service<http::Request<B>> for GrpcAttempt<S>
where
    S: Service<http::Request<B>, Response = http::Response<ResB>>,
    S::Error: Into<BoxError>,
{
    type Response = S::Response;
    type Error = BoxError;
    type Future = GrpcAttemptFuture<S::Future>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), BoxError>> {
        self.inner.poll_ready(cx).map_err(Into::into)
    }

    fn call(&mut self, mut req: http::Request<B>) -> Self::Future {
        let now = Instant::now();
        let context = CallContext::of(&req);
        let dependency = context.and_then(CallContext::dependency).cloned();
        // The end the attempt timeout planned for the attempt, or, under none, planned here.
        let handed = context.and_then(AttemptCutoff::handed_down);
        let cutoff = match handed {
            Some(cutoff) => Some(cutoff),
            None => match AttemptCutoff::plan(now, self.attempt_timeout, Deadline::of(&req)) {
                Ok(cutoff) => cutoff,
                // No time left: nothing is sent.
                Err(passed) => return GrpcAttemptFuture::failed(passed.error(dependency)),
            },
        };
        if let Some(cutoff) = cutoff {
            req.headers_mut().insert(
                "grpc-timeout",
                grpc_timeout(cutoff.at.saturating_duration_since(now)),
            );
        }
        if let Some(n) = CallContext::attempt_of(&req).filter(|n| *n > 1) {
            req.headers_mut()
                .insert("grpc-previous-rpc-attempts", http::HeaderValue::from(n - 1));
        }
        GrpcAttemptFuture {
            state: AttemptState::Sent {
                inner: self.inner.call(req),
                cutoff,
                dependency,
            },
        }
    }
}

/// Response future of [`GrpcAttempt`].
#[pin_project]
#[derive(Debug)]
pub struct GrpcAttemptFuture<F> {
    #[pin]
    state: AttemptState<F>,
}

#[pin_project(project = AttemptStateProj)]
#[derive(Debug)]
enum AttemptState<F> {
    Sent {
        #[pin]
        inner: F,
        cutoff: Option<AttemptCutoff>,
        dependency: Option<Dependency>,
    },
    Failed(Option<BoxError>),
}

impl<F> GrpcAttemptFuture<F> {
    fn failed(error: BoxError) -> Self {
        GrpcAttemptFuture {
            state: AttemptState::Failed(Some(error)),
        }
    }
}

impl<F, ResB, E> Future for GrpcAttemptFuture<F>
where
    F: Future<Output = Result<http::Response<ResB>, E>>,
    E: Into<BoxError>,
{
    type Output = Result<http::Response<ResB>, BoxError>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        match self.project().state.project() {
            AttemptStateProj::Sent {
                inner,
                cutoff,
                dependency,
            } => {
                let result = ready!(inner.poll(cx));
                // The limit sent ended the attempt: the stack's own verdict, whoever's timer
                // fired first.
                let timed_out = cutoff.filter(|c| Instant::now() >= c.at);
                Poll::Ready(match (result, timed_out) {
                    (Err(_), Some(cutoff)) => Err(cutoff.error(dependency.take())),
                    (Ok(res), Some(cutoff)) if ended_by_its_deadline(&res) => {
                        Err(cutoff.error(dependency.take()))
                    }
                    (result, _) => result.map_err(Into::into),
                })
            }
            AttemptStateProj::Failed(error) => Poll::Ready(Err(error
                .take()
                .expect("GrpcAttemptFuture polled after completion"))),
        }
    }
}

/// A trailers-only answer of `CANCELLED` (1) or `DEADLINE_EXCEEDED` (4): how servers end a
/// call whose `grpc-timeout` ran out.
fn ended_by_its_deadline<B>(res: &http::Response<B>) -> bool {
    matches!(
        res.headers()
            .get("grpc-status")
            .map(http::HeaderValue::as_bytes),
        Some(b"1" | b"4")
    )
}
