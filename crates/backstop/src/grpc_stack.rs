//! The composed stack for gRPC calls (tonic's channel, or any gRPC-over-HTTP/2 client).

use crate::{Backstop, BoxErrors, Transport, TransportSettings, attempt_header::AttemptCount};
use backstop_classify::{GrpcClassifier, grpc_timeout};
use backstop_core::{Deadline, Dependency, plumbing::CallContext};
use backstop_idempotency::{HttpKeys, IdempotencyLayer};
use backstop_retry::StreamingResend;
use backstop_timeout::{BodyTimeout, BodyTimeoutLayer};
use std::{
    task::{Context, Poll},
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

impl<S> Transport<S> for StreamingResend {
    type Client = BoxErrors<BodyTimeout<GrpcAttempt<AttemptCount<S>>>>;
    fn wrap(&self, client: S, settings: &TransportSettings) -> Self::Client {
        let client = AttemptCount {
            inner: client,
            header: settings.attempt_header.clone(),
        };
        let client = GrpcAttempt {
            inner: client,
            attempt_timeout: settings.attempt_timeout,
        };
        BoxErrors(BodyTimeoutLayer::new(settings.attempt_timeout).layer(client))
    }
}

/// Sets gRPC's per-attempt metadata: `grpc-timeout`, the time the attempt has (its timeout and
/// the call's deadline, whichever ends first), and `grpc-previous-rpc-attempts` on a retry.
#[derive(Clone, Debug)]
pub struct GrpcAttempt<S> {
    inner: S,
    attempt_timeout: Option<Duration>,
}

impl<S, B> Service<http::Request<B>> for GrpcAttempt<S>
where
    S: Service<http::Request<B>>,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future = S::Future;

    #[inline]
    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), S::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, mut req: http::Request<B>) -> S::Future {
        let now = Instant::now();
        let by_attempt = self.attempt_timeout.map(|t| now + t);
        let by_deadline = Deadline::of(&req).map(Deadline::instant);
        let end = match (by_attempt, by_deadline) {
            (Some(a), Some(d)) => Some(a.min(d)),
            (a, d) => a.or(d),
        };
        if let Some(end) = end {
            req.headers_mut().insert(
                "grpc-timeout",
                grpc_timeout(end.saturating_duration_since(now)),
            );
        }
        if let Some(n) = CallContext::attempt_of(&req).filter(|n| *n > 1) {
            req.headers_mut()
                .insert("grpc-previous-rpc-attempts", http::HeaderValue::from(n - 1));
        }
        self.inner.call(req)
    }
}
