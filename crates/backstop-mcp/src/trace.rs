//! Trace context across a tool call: the W3C `traceparent`, `tracestate` and `baggage` that
//! MCP reserves in a request's `_meta`.
//!
//! The client side puts the trace context of the span in force when an attempt is made (the
//! retry layer's attempt span, or the call's span when attempt spans are filtered out) in the
//! call's `_meta`, so each attempt is its own parent; the server side runs the tool in a
//! `tool` span (target `backstop::mcp`) whose parent is the context the call carried. With
//! `tracing-opentelemetry` on both sides, one trace then holds the model's call, every attempt
//! and the tool's own work.
//!
//! Contexts are written and read by OpenTelemetry's global text-map propagator, as every
//! OpenTelemetry integration does: install the W3C ones once at start-up
//! (`opentelemetry::global::set_text_map_propagator`, with the SDK's `TraceContextPropagator`
//! and, for baggage, `BaggagePropagator` in a `TextMapCompositePropagator`). Without the
//! feature `otel`, or with OpenTelemetry's default propagator (which writes nothing), calls
//! carry no context and servers start a trace of their own. A `traceparent` the caller put in
//! `_meta` itself is kept.

use serde_json::{Map, Value};
use tracing::Span;

/// The `_meta` keys of W3C trace context that MCP reserves.
pub const TRACE_KEYS: [&str; 3] = ["traceparent", "tracestate", "baggage"];

/// Puts the trace context of the span in force in `meta` (feature `otel`; otherwise nothing),
/// keeping any of the keys that `meta` already has.
pub fn inject_current(meta: &mut Map<String, Value>) {
    #[cfg(feature = "otel")]
    otel::inject(&Span::current(), meta);
    #[cfg(not(feature = "otel"))]
    let _ = meta;
}

/// The span a server runs the tool `name` in: a child of the trace context in `meta`, when
/// it carries one (feature `otel`).
pub fn tool_span(name: &str, meta: &Map<String, Value>) -> Span {
    let span = tracing::info_span!(target: "backstop::mcp", "tool", tool = name);
    #[cfg(feature = "otel")]
    otel::continue_from(&span, meta);
    #[cfg(not(feature = "otel"))]
    let _ = meta;
    span
}

#[cfg(feature = "otel")]
mod otel {
    use opentelemetry::{
        global,
        propagation::{Extractor, Injector},
        trace::TraceContextExt,
    };
    use serde_json::{Map, Value};
    use tracing::Span;
    use tracing_opentelemetry::OpenTelemetrySpanExt;

    struct MetaInjector<'a>(&'a mut Map<String, Value>);

    impl Injector for MetaInjector<'_> {
        fn set(&mut self, key: &str, value: String) {
            self.0
                .entry(key.to_owned())
                .or_insert_with(|| Value::String(value));
        }
    }

    struct MetaExtractor<'a>(&'a Map<String, Value>);

    impl Extractor for MetaExtractor<'_> {
        fn get(&self, key: &str) -> Option<&str> {
            self.0.get(key)?.as_str()
        }

        fn keys(&self) -> Vec<&str> {
            self.0.keys().map(String::as_str).collect()
        }
    }

    pub(super) fn inject(span: &Span, meta: &mut Map<String, Value>) {
        if span.is_disabled() {
            return;
        }
        let cx = span.context();
        global::get_text_map_propagator(|p| p.inject_context(&cx, &mut MetaInjector(meta)));
    }

    pub(super) fn continue_from(span: &Span, meta: &Map<String, Value>) {
        if span.is_disabled() {
            return;
        }
        let cx = global::get_text_map_propagator(|p| p.extract(&MetaExtractor(meta)));
        if cx.span().span_context().is_valid() {
            // Fails only when no OpenTelemetry layer listens: then there is nothing to join.
            let _ = span.set_parent(cx);
        }
    }
}
