//! Backstop's spans exported through OpenTelemetry.
//!
//! `tracing-opentelemetry` turns Backstop's `tracing` spans into OpenTelemetry spans: one `call`
//! span per logical call (target `backstop::call`: dependency, run and key, attempts, outcome),
//! and inside it one span per attempt (target `backstop::retry`, at debug level), named and
//! attributed as the HTTP semantic conventions ask: its name the method (`GET`), its kind
//! client, `http.request.method`, `server.address`, `server.port`, `url.full`,
//! `http.response.status_code`, `error.type` for an error status, and
//! `http.request.resend_count` on resends; Backstop adds the dependency and the attempt's
//! number. Backoff is the time between attempt spans, apart from the server's time inside
//! them. Here the SDK's in-memory exporter stands where an OTLP exporter would, and the
//! example prints what it received: a GET answered 503 once, then 200.
//!
//! Run it with `cargo run --example otel_export`.

use backstop::{Backstop, BoxError, backoff::RngSource};
use backstop_testkit::{Action, TestServer};
use bytes::Bytes;
use http_body_util::Full;
use hyper_util::{client::legacy::Client, rt::TokioExecutor};
use opentelemetry::{KeyValue, trace::TracerProvider as _};
use opentelemetry_sdk::trace::{InMemorySpanExporter, SdkTracerProvider, SpanData};
use std::sync::{
    Arc,
    atomic::{AtomicU32, Ordering},
};
use tower::{Layer, ServiceExt};
use tracing_subscriber::{Registry, filter::Targets, layer::SubscriberExt};

fn attribute<'a>(span: &'a SpanData, key: &str) -> Option<&'a KeyValue> {
    span.attributes.iter().find(|kv| kv.key.as_str() == key)
}

pub(crate) fn main() -> Result<(), BoxError> {
    let exporter = InMemorySpanExporter::default();
    let provider = SdkTracerProvider::builder()
        .with_simple_exporter(exporter.clone())
        .build();
    let otel = tracing_opentelemetry::layer().with_tracer(provider.tracer("backstop-example"));
    // Backstop's call spans are at info, its attempt spans at debug.
    let subscriber = Registry::default()
        .with(Targets::new().with_target("backstop", tracing::Level::DEBUG))
        .with(otel);

    tracing::subscriber::with_default(subscriber, || {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()?
            .block_on(call_once_retried())
    })?;
    provider.force_flush()?;

    let spans = exporter.get_finished_spans()?;
    let call = spans
        .iter()
        .find(|s| s.name == "call")
        .ok_or("no call span exported")?;
    let attempts: Vec<&SpanData> = spans
        .iter()
        .filter(|s| s.parent_span_id == call.span_context.span_id())
        .collect();
    println!(
        "call span: {} attributes: {:?}",
        call.span_context.trace_id(),
        call.attributes
            .iter()
            .map(|kv| format!("{}={}", kv.key, kv.value))
            .collect::<Vec<_>>()
    );
    for a in &attempts {
        println!(
            "  attempt span: {:?} ({} ms)",
            a.attributes
                .iter()
                .map(|kv| format!("{}={}", kv.key, kv.value))
                .collect::<Vec<_>>(),
            a.end_time
                .duration_since(a.start_time)
                .unwrap_or_default()
                .as_millis()
        );
    }
    assert_eq!(attempts.len(), 2, "one span per attempt, inside the call's");
    for (a, status) in attempts.iter().zip(["503", "200"]) {
        assert_eq!(a.name, "GET", "named after the method");
        assert_eq!(a.span_kind, opentelemetry::trace::SpanKind::Client);
        assert_eq!(
            attribute(a, "http.response.status_code").map(|kv| kv.value.to_string()),
            Some(status.to_owned())
        );
    }
    assert_eq!(
        attribute(attempts[0], "error.type").map(|kv| kv.value.to_string()),
        Some("503".to_owned())
    );
    assert!(
        attempts
            .iter()
            .all(|a| a.span_context.trace_id() == call.span_context.trace_id())
    );
    assert!(attribute(attempts[0], "http.request.resend_count").is_none());
    assert_eq!(
        attribute(attempts[1], "http.request.resend_count").map(|kv| kv.value.to_string()),
        Some("1".to_owned())
    );
    assert_eq!(
        attribute(call, "attempts").map(|kv| kv.value.to_string()),
        Some("2".to_owned())
    );
    provider.shutdown()?;
    Ok(())
}

async fn call_once_retried() -> Result<(), BoxError> {
    let answered = Arc::new(AtomicU32::new(0));
    let seen = answered.clone();
    let server = TestServer::start(move |_| {
        if seen.fetch_add(1, Ordering::SeqCst) == 0 {
            Action::status(503)
        } else {
            Action::status(200)
        }
    })
    .await;
    let client = Client::builder(TokioExecutor::new()).build_http::<Full<Bytes>>();
    let rates = Backstop::http("rates-api")
        .rng(RngSource::seeded(3))
        .no_breaker()
        .build()?
        .layer(client);
    let req = http::Request::get(server.url("/eur")).body(Full::default())?;
    let res = rates.oneshot(req).await?;
    assert_eq!(res.status(), 200);
    Ok(())
}
