//! Each attempt in the HTTP semantic conventions' words: `http.client.request.duration` and
//! the attempt span's HTTP attributes, from the request that goes out and what comes back.

use crate::{Telemetry, future::AttemptMetricsFuture, record::Started};
use backstop_core::BoxError;
use std::task::{Context, Poll};
use tower_layer::Layer;
use tower_service::Service;
use tracing::Span;

/// Puts [`AttemptMetrics`] around a client: every request it sends is one attempt.
///
/// The composed stack puts it between its retry layer and the client when it is given a
/// [`Telemetry`]; over a client of one's own, put it where each attempt passes (inside the
/// retry layer), over a service whose errors are boxed.
#[derive(Clone, Debug)]
pub struct AttemptMetricsLayer {
    telemetry: Option<Telemetry>,
}

impl AttemptMetricsLayer {
    /// Records each attempt into `telemetry` (`None`: only the attempt span's attributes).
    pub fn new(telemetry: Option<Telemetry>) -> Self {
        AttemptMetricsLayer { telemetry }
    }
}

impl<S> Layer<S> for AttemptMetricsLayer {
    type Service = AttemptMetrics<S>;

    fn layer(&self, inner: S) -> Self::Service {
        AttemptMetrics {
            inner,
            telemetry: self.telemetry.clone(),
        }
    }
}

/// Records each request it passes on as one attempt: its duration to the response's head
/// (`http.client.request.duration`), with `http.request.method`, `server.address`,
/// `server.port`, `url.scheme`, `http.response.status_code`, `error.type` and
/// `http.request.resend_count` (on a resend: the retry layer's attempt number less one), and the same
/// attributes on the span current when it is called (the retry layer's attempt span). An
/// attempt dropped before its answer (cut by its limit, a hedge that lost) is recorded too.
#[derive(Clone, Debug)]
pub struct AttemptMetrics<S> {
    inner: S,
    telemetry: Option<Telemetry>,
}

impl<S, B, RB> Service<http::Request<B>> for AttemptMetrics<S>
where
    S: Service<http::Request<B>, Response = http::Response<RB>, Error = BoxError>,
{
    type Response = S::Response;
    type Error = BoxError;
    type Future = AttemptMetricsFuture<S::Future>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), BoxError>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: http::Request<B>) -> Self::Future {
        let span = Span::current();
        let started = if self.telemetry.is_some() || !span.is_disabled() {
            Some(Started::new(self.telemetry.clone(), &req, span))
        } else {
            None
        };
        AttemptMetricsFuture::new(self.inner.call(req), started)
    }
}
