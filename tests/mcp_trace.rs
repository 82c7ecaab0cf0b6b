//! Trace context across MCP tool calls, in a test binary of its own: its subscriber is the
//! process's global one, so every task and thread of the client and the server reports to it
//! (a scoped subscriber races with other tests' threads over tracing's per-callsite interest).
//! Each test reads back only the spans of its own trace.

use backstop::{Backstop, Run, backoff::Backoff, mcp::ToolCatalog};
use backstop_workspace::refunds_mcp::RefundServer;
use opentelemetry::trace::{TraceContextExt, TraceId, TracerProvider as _};
use opentelemetry_sdk::trace::{InMemorySpanExporter, SdkTracerProvider, SpanData};
use rmcp::{
    ServiceExt,
    transport::{
        StreamableHttpClientTransport, streamable_http_client::StreamableHttpClientTransportConfig,
    },
};
use serde_json::json;
use std::{sync::OnceLock, time::Duration};
use tower::ServiceExt as _;
use tracing::Instrument;
use tracing_opentelemetry::OpenTelemetrySpanExt;

/// The W3C propagators, and the process's subscriber exporting to memory, installed once.
fn telemetry() -> &'static (InMemorySpanExporter, SdkTracerProvider) {
    static TELEMETRY: OnceLock<(InMemorySpanExporter, SdkTracerProvider)> = OnceLock::new();
    TELEMETRY.get_or_init(|| {
        use opentelemetry::propagation::TextMapCompositePropagator;
        use opentelemetry_sdk::propagation::{BaggagePropagator, TraceContextPropagator};
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
        (exporter, provider)
    })
}

/// The exported spans of one trace.
fn spans_of(trace: TraceId) -> Vec<SpanData> {
    let (exporter, provider) = telemetry();
    provider.force_flush().unwrap();
    exporter
        .get_finished_spans()
        .unwrap()
        .into_iter()
        .filter(|s| s.span_context.trace_id() == trace)
        .collect()
}

/// One trace from the model's turn to the tool's own work: the stack's call and attempt spans
/// on the client, the replay handler's `tool` span on the server (its parent the attempt that
/// sent it, by the `traceparent` in `_meta`), and the tool's span inside it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_trace_spans_the_model_s_call_every_attempt_and_the_tool_s_work() {
    telemetry();
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

    let spans = spans_of(model_trace);
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

/// The same over tower-mcp's HTTP transport: the per-tool replay layer's `tool` span continues
/// the attempt's trace context, which tower-mcp reads from `_meta`, and the tool's own span is
/// inside it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn over_tower_mcp_the_tool_s_span_continues_the_attempt_s_trace() {
    use backstop::{
        idempotency::IdempotencyKey,
        mcp::{
            ToolCall, ToolReplayLayer,
            tower_mcp::{KeyFromHeaderLayer, PerToolReplayLayer},
        },
        replay::MemoryStore,
    };
    use tower_mcp::{CallToolResult, McpRouter, ToolBuilder};
    telemetry();
    let replay = ToolReplayLayer::new(MemoryStore::default()).single_tenant();
    let refund = ToolBuilder::new("issue_refund")
        .description("Refund part of an order")
        .idempotent()
        .handler(|_args: serde_json::Value| async {
            let _work = tracing::info_span!(target: "refunds", "handle").entered();
            Ok(CallToolResult::text("refund R1 booked"))
        })
        .layer(PerToolReplayLayer::new("issue_refund", replay))
        .build();
    let router = McpRouter::new().server_info("payments", "1.0").tool(refund);
    let app = tower_mcp::HttpTransport::new(router)
        .bridge_extension::<IdempotencyKey>()
        .into_router_at("/mcp")
        .layer(KeyFromHeaderLayer::new());
    let server = backstop_testkit::TestServer::serve(app).await;
    let transport = StreamableHttpClientTransport::with_client(
        backstop::mcp::rmcp::MetaHeaders::new(reqwest::Client::new()),
        StreamableHttpClientTransportConfig::with_uri(server.url("/mcp")),
    );
    let client = ().serve(transport).await.unwrap();
    let tools = Backstop::mcp("payments-mcp")
        .no_breaker()
        .build()
        .unwrap()
        .rmcp(client.peer().clone());
    let call = ToolCall::new("issue_refund", json!({"order": "ORD-4812"}))
        .unwrap()
        .in_run(&Run::new("run-tower-traced"));
    let turn = tracing::info_span!(target: "model", "model_turn");
    let model_trace = turn.context().span().span_context().trace_id();
    tools.oneshot(call).instrument(turn).await.unwrap();
    client.cancel().await.unwrap();

    let spans = spans_of(model_trace);
    let summary: Vec<_> = spans
        .iter()
        .map(|s| (s.name.clone(), s.parent_span_id))
        .collect();
    let attempt = spans
        .iter()
        .find(|s| s.name == "attempt")
        .unwrap_or_else(|| panic!("an attempt span: {summary:?}"));
    let tool = spans
        .iter()
        .find(|s| s.name == "tool")
        .unwrap_or_else(|| panic!("the server's tool span in the model's trace: {summary:?}"));
    assert_eq!(
        tool.parent_span_id,
        attempt.span_context.span_id(),
        "{summary:?}"
    );
    let handle = spans
        .iter()
        .find(|s| s.name == "handle")
        .unwrap_or_else(|| panic!("the tool's own span in the model's trace: {summary:?}"));
    assert_eq!(
        handle.parent_span_id,
        tool.span_context.span_id(),
        "{summary:?}"
    );
}
