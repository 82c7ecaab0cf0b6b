//! One attempt's record: what is known when it is sent, and what is written once it ends
//! (answered, failed, or dropped before either).

use crate::Telemetry;
use backstop_core::{BoxError, CallContext, Dependency};
use opentelemetry::KeyValue;
use tokio::time::Instant;
use tracing::Span;

/// What an attempt records once it ends.
pub(crate) struct Started {
    telemetry: Option<Telemetry>,
    at: Instant,
    /// When the retry layer cuts the attempt, if it does.
    cut_at: Option<Instant>,
    attrs: Vec<KeyValue>,
    span: Span,
}

impl Started {
    pub(crate) fn new<B>(telemetry: Option<Telemetry>, req: &http::Request<B>, span: Span) -> Self {
        let uri = req.uri();
        let method = backstop_core::plumbing::known_method(req.method()).unwrap_or("_OTHER");
        let https = uri.scheme() == Some(&http::uri::Scheme::HTTPS);
        let port = uri.port_u16().unwrap_or(if https { 443 } else { 80 });
        // The instrument's attributes, made only when there is an instrument to record into.
        let mut attrs = Vec::new();
        if telemetry.is_some() {
            attrs.extend([
                KeyValue::new("http.request.method", method),
                KeyValue::new("server.address", uri.host().unwrap_or_default().to_owned()),
                KeyValue::new("server.port", i64::from(port)),
                KeyValue::new("url.scheme", if https { "https" } else { "http" }),
            ]);
            // The semantic conventions set it only on a request that was resent, as the span.
            if let Some(resend) = CallContext::attempt_of(req).filter(|n| *n > 1) {
                attrs.push(KeyValue::new(
                    "http.request.resend_count",
                    i64::from(resend - 1),
                ));
            }
            if let Some(d) = Dependency::on(req) {
                attrs.push(KeyValue::new("backstop.dependency", d.metric_label()));
            }
        }
        if !span.is_disabled() {
            span.record("http.request.method", method);
            span.record("server.address", uri.host().unwrap_or_default());
            span.record("server.port", port);
            span.record("url.full", uri.to_string());
        }
        Started {
            telemetry,
            at: Instant::now(),
            cut_at: CallContext::of(req)
                .and_then(CallContext::attempt_end)
                .map(|(at, _)| at),
            attrs,
            span,
        }
    }

    /// The attempt answered with `status`.
    pub(crate) fn answered(self, status: http::StatusCode) {
        let code = status.as_u16();
        let error = (code >= 400).then(|| code.to_string());
        if !self.span.is_disabled() {
            self.span.record("http.response.status_code", code);
            if let Some(e) = &error {
                self.span.record("error.type", e.as_str());
            }
        }
        let mut more = vec![KeyValue::new("http.response.status_code", i64::from(code))];
        more.extend(error.map(|e| KeyValue::new("error.type", e)));
        self.record(more);
    }

    /// The attempt failed with `error` before any answer.
    pub(crate) fn failed(self, error: &BoxError) {
        let kind = crate::telemetry::transport_error_type(&**error);
        if !self.span.is_disabled() {
            self.span.record("error.type", kind.as_str());
        }
        self.record(vec![KeyValue::new("error.type", kind)]);
    }

    /// The attempt was dropped before its answer: cut at its limit, or given up.
    pub(crate) fn dropped(self) {
        let kind = match self.cut_at {
            Some(at) if Instant::now() >= at => "timeout",
            _ => "cancelled",
        };
        if !self.span.is_disabled() {
            self.span.record("error.type", kind);
        }
        self.record(vec![KeyValue::new("error.type", kind)]);
    }

    fn record(mut self, more: Vec<KeyValue>) {
        if let Some(t) = &self.telemetry {
            self.attrs.extend(more);
            let took = Instant::now().saturating_duration_since(self.at);
            t.inner
                .attempt_duration
                .record(took.as_secs_f64(), &self.attrs);
        }
    }
}
