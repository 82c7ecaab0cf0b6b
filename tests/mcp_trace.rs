//! Trace context across MCP tool calls, in a test binary of its own: its subscriber is the
//! process's global one, so every task and thread of the client and the server reports to it
//! (a scoped subscriber races with other tests' threads over tracing's per-callsite interest).

use backstop::{Backstop, Run, backoff::Backoff, mcp::ToolCatalog};
use backstop_workspace::refunds_mcp::RefundServer;
use rmcp::{
    ServiceExt,
    transport::{
        StreamableHttpClientTransport, streamable_http_client::StreamableHttpClientTransportConfig,
    },
};
use serde_json::json;
use std::time::Duration;
use tower::ServiceExt as _;

/// One trace from the model's turn to the tool's own work: the stack's call and attempt spans
/// on the client, the replay handler's `tool` span on the server (its parent the attempt that
/// sent it, by the `traceparent` in `_meta`), and the tool's span inside it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_trace_spans_the_model_s_call_every_attempt_and_the_tool_s_work() {
    use opentelemetry::{
        propagation::TextMapCompositePropagator,
        trace::{TraceContextExt, TracerProvider as _},
    };
    use opentelemetry_sdk::{
        propagation::{BaggagePropagator, TraceContextPropagator},
        trace::{InMemorySpanExporter, SdkTracerProvider},
    };
    use tracing::Instrument;
    use tracing_opentelemetry::OpenTelemetrySpanExt;
    use tracing_subscriber::{Registry, filter::Targets, layer::SubscriberExt};

    opentelemetry::global::set_text_map_propagator(TextMapCompositePropagator::new(vec![
        Box::new(TraceContextPropagator::new()),
        Box::new(BaggagePropagator::new()),
    ]));
    let exporter = InMemorySpanExporter::default();
    let provider = SdkTracerProvider::builder()
        .with_simple_exporter(exporter.clone())
        .build();
    let subscriber = Registry::default()
        .with(
            Targets::new()
                .with_target("backstop", tracing::Level::DEBUG)
                .with_target("refunds", tracing::Level::INFO)
                .with_target("model", tracing::Level::INFO),
        )
        .with(tracing_opentelemetry::layer().with_tracer(provider.tracer("mcp-trace-test")));
    tracing::subscriber::set_global_default(subscriber).expect("the only subscriber");

    // The idempotent tool's first reply is lost: two attempts, the second replayed.
    let server = RefundServer::start(Some("set_refund_note")).await;
    let transport = StreamableHttpClientTransport::with_client(
        reqwest::Client::new(),
        StreamableHttpClientTransportConfig::with_uri(server.url()),
    );
    let client = ().serve(transport).await.unwrap();
    let catalog = ToolCatalog::discover(client.peer()).await.unwrap();
    let tools = Backstop::mcp("payments-mcp")
        .no_breaker()
        .backoff(Backoff::full_jitter(Duration::from_millis(5), Duration::from_millis(20)).unwrap())
        .build()
        .unwrap()
        .rmcp(client.peer().clone());
    let run = Run::new("run-traced");
    let note = catalog
        .call("set_refund_note", json!({"refund": "R1", "note": "late"}))
        .unwrap()
        .in_run(&run);
    let turn = tracing::info_span!(target: "model", "model_turn");
    let model_trace = turn.context().span().span_context().trace_id();
    let result = tools.oneshot(note).instrument(turn).await.unwrap();
    assert!(result.is_replayed(), "{:?}", result.to_json());
    client.cancel().await.unwrap();
    drop(server);
    provider.force_flush().unwrap();

    let spans = exporter.get_finished_spans().unwrap();
    let named = |name: &str| -> Vec<_> { spans.iter().filter(|s| s.name == name).collect() };
    let summary: Vec<_> = spans
        .iter()
        .map(|s| (s.name.clone(), s.span_context.trace_id(), s.parent_span_id))
        .collect();
    let attempts = named("attempt");
    let servers = named("tool");
    let handled = named("handle");
    assert_eq!(attempts.len(), 2, "{summary:?}");
    assert_eq!(servers.len(), 2, "one server span per attempt: {summary:?}");
    assert_eq!(handled.len(), 1, "the tool ran once: {summary:?}");
    for s in attempts.iter().chain(&servers).chain(&handled) {
        assert_eq!(
            s.span_context.trace_id(),
            model_trace,
            "{} in the model's trace: {summary:?}",
            s.name
        );
    }
    // Each server span's parent is the attempt that sent it, one each.
    let mut parents: Vec<_> = servers
        .iter()
        .map(|s| s.parent_span_id.to_string())
        .collect();
    let mut sent: Vec<_> = attempts
        .iter()
        .map(|a| a.span_context.span_id().to_string())
        .collect();
    parents.sort();
    sent.sort();
    assert_eq!(parents, sent, "{summary:?}");
    // The tool's work is inside the first attempt's server span.
    assert!(
        servers
            .iter()
            .any(|s| s.span_context.span_id() == handled[0].parent_span_id),
        "{summary:?}"
    );
}
