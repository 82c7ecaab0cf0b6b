//! The README's Rust blocks are compiled: each one is here, between `README block N` markers,
//! inside code that compiles (and is type-checked by `cargo test`), and the test below fails
//! when the README's block and this file's differ by a character. (Rustdoc's hidden `# ` lines
//! would let the README itself be a doc test, but GitHub shows those lines.)

#![allow(dead_code, unused_variables, unused_mut)]

use backstop::{
    Backstop, BoxError, Preset,
    classify::{AsError, Classify, Verdict},
    idempotency::{ActionContext, KeyedRequest},
    journal::Journal,
    replay::{OnVolatile, RedisStore, ReplayLayer, ReplayRequestBody},
};
use bytes::Bytes;
use http_body_util::Full;
use hyper_util::{client::legacy::Client, rt::TokioExecutor};
use tower::{Layer, service_fn};

#[rustfmt::skip]
async fn one_screen() -> Result<(), BoxError> {
    // README block 1
    use backstop::{Backstop, Preset, idempotency::ActionContext};
    use bytes::Bytes;
    use http_body_util::Full;
    use hyper_util::{client::legacy::Client, rt::TokioExecutor};
    use std::time::Duration;
    use tower::{Layer, ServiceExt};

    let client = Client::builder(TokioExecutor::new()).build_http::<Full<Bytes>>();
    let carrier = Backstop::http("carrier-api")     // one name for budget, breaker, errors, metrics
        .preset(Preset::Create)                    // a key is required (derived from the action)
        .p99(Duration::from_millis(1200))          // attempt timeout 3 s
        .deadline(Duration::from_secs(30))         // the whole call, backoff included
        .build()?                                  // validated: says which setting to change
        .layer(client);                            // over the client: a tower Service

    let mut req = http::Request::post("http://carrier.local/labels")
        .body(Full::from(r#"{"order_id":"ORD-4812"}"#))?;
    req.extensions_mut().insert(ActionContext::tool_call("run-91f2", "step-3", "call-07"));
    match carrier.oneshot(req).await {
        Ok(res) => { /* the label, or the carrier's own 4xx answer */ }
        Err(e) => { /* e.to_string() is written for the model; e.outcome(), e.retry_after() for code */ }
    }
    // end
    Ok(())
}

#[rustfmt::skip]
async fn replay_server() -> Result<(), BoxError> {
    let refund_handler = service_fn(|_req: http::Request<ReplayRequestBody>| async {
        Ok::<_, BoxError>(http::Response::new(Full::<Bytes>::default()))
    });
    // README block 2
    let refunds = ReplayLayer::new(RedisStore::connect("redis://127.0.0.1:6379/", OnVolatile::Refuse).await?)
        .single_tenant() // or let your authentication layer, outside this one, set a Principal
        .layer(refund_handler);
    // end
    Ok(())
}

#[rustfmt::skip]
fn telemetry(
    meter_provider: opentelemetry_sdk::metrics::SdkMeterProvider,
    client: Client<hyper_util::client::legacy::connect::HttpConnector, Full<Bytes>>,
) -> Result<(), BoxError> {
    use opentelemetry::metrics::MeterProvider;
    // README block 3
    let telemetry = backstop::otel::Telemetry::new(&meter_provider.meter("backstop"));
    metrics::set_global_recorder(backstop::otel::OtelRecorder::new(&telemetry))?;
    let rates = Backstop::http("rates-api").telemetry(telemetry).build()?.layer(client);
    // end
    Ok(())
}

/// What the README's workflow calls: the shop's API (through a Backstop stack, in a real one).
#[derive(Clone)]
struct Shop;

impl Shop {
    async fn refund(
        &self,
        order: &impl serde::Serialize,
        key: String,
    ) -> Result<String, backstop::Error> {
        Ok(format!("refund under {key}"))
    }
    async fn restock(&self, order: &str, key: String) -> Result<(), backstop::Error> {
        Ok(())
    }
    async fn email(&self, refund: &str, key: String) -> Result<(), backstop::Error> {
        Ok(())
    }
}

#[rustfmt::skip]
async fn journal() -> Result<(), BoxError> {
    use backstop::journal::{RunContext, RunError, Worker, Workflow};
    use serde::{Deserialize, Serialize};
    let shop = Shop;
    let shutdown = std::future::ready(());
    // README block 4
    #[derive(Serialize, Deserialize)]
    struct Order { id: String, cents: u64 }

    const REFUND: Workflow<Order, String> = Workflow::new("refund");

    async fn refund(ctx: RunContext, order: Order, shop: Shop) -> Result<String, RunError> {
        let refund = ctx.run("refund", &order, |s| shop.refund(&order, s.key)).await?; // once, one key for every attempt
        ctx.run("restock", &order.id, |s| shop.restock(&order.id, s.key)).await?;
        ctx.run("email", &refund, |s| shop.email(&refund, s.key)).await?;
        Ok(refund)                                                     // the run's output
    }

    let journal = Journal::open("postgres://localhost/shop").await?;   // or a SQLite file
    REFUND.start(&journal, "refund-order-7", &Order { id: "order-7".into(), cents: 4200 }).await?;
    Worker::new(journal.clone(), "worker-1")
        .register(REFUND, move |ctx, order| refund(ctx, order, shop.clone()))
        .run_until(shutdown).await?;                                   // until `shutdown` (any future) completes
    // end
    let _ = ActionContext::tool_call("r", "s", "c");
    Ok(())
}

#[rustfmt::skip]
fn chaos() -> Result<(), BoxError> {
    use backstop::chaos::{ChaosLayer, FaultPlan};
    use std::time::Duration;
    let refund_handler = service_fn(|_req: http::Request<()>| async {
        Ok::<_, std::convert::Infallible>(http::Response::new(()))
    });
    // README block 5
    let faults = FaultPlan::default()
        .lose_reply(0.25)                  // the service acted, the caller gets a connection reset
        .reset(0.05)                       // reset before the service saw the request
        .status(0.05, 503)                 // answered by the layer, with Retry-After: 1
        .delay(0.1, Duration::from_millis(800)); // a slow reply, after the service acted
    let chaos = ChaosLayer::new(faults, 11)?;    // the same seed, the same faults in the same order
    let refunds = chaos.layer(refund_handler);   // serve this; chaos.stats() counts what was injected
    // end
    Ok(())
}

#[rustfmt::skip]
async fn grpc() -> Result<(), BoxError> {
    // README block 6
    let channel = tonic::transport::Endpoint::from_static("http://127.0.0.1:50051").connect_lazy();
    let refunds = Backstop::grpc("refunds-grpc").honours_keys().build()?.layer(channel);
    let mut client = tonic::client::Grpc::new(refunds);         // or YourGeneratedClient::new(refunds)
    // end
    Ok(())
}

#[rustfmt::skip]
fn tower_limits() -> Result<(), BoxError> {
    use std::time::Duration;
    use tower::ServiceBuilder;
    let hyper_client = Client::builder(TokioExecutor::new()).build_http::<Full<Bytes>>();
    // README block 7
    let client = ServiceBuilder::new()
        .concurrency_limit(64)                            // attempts in flight; a call waiting to retry holds no permit
        .buffer(1024)                                     // RateLimit and Hedge are not Clone: a Buffer shares them
        .rate_limit(100, Duration::from_secs(1))          // attempts per second, retries included
        .service(hyper_client);
    let search = Backstop::http("search-api").preset(Preset::ReadOnly).build()?.layer(client);
    // end
    Ok(())
}

#[derive(Clone, Debug)]
struct ToolCall {
    ext: http::Extensions,
}

impl backstop::HasExtensions for ToolCall {
    fn extensions(&self) -> &http::Extensions {
        &self.ext
    }
    fn extensions_mut(&mut self) -> &mut http::Extensions {
        &mut self.ext
    }
}

impl KeyedRequest for ToolCall {
    fn needs_key(&self) -> bool {
        true
    }
    fn idempotency_key(&self) -> Option<&backstop::idempotency::IdempotencyKey> {
        None
    }
    fn set_idempotency_key(&mut self, _key: backstop::idempotency::IdempotencyKey) {}
}

#[derive(Clone, Copy, Debug)]
struct ToolRules;

impl<E: AsError> Classify<ToolCall, String, E> for ToolRules {
    fn classify(&self, result: Result<&String, &E>) -> Verdict {
        match result {
            Ok(_) => Verdict::Success,
            Err(_) => Verdict::Fatal {
                outcome: backstop::Outcome::Unknown,
            },
        }
    }
    fn is_replay_safe(&self, _req: &ToolCall) -> bool {
        false
    }
}

#[rustfmt::skip]
fn tools_stack() -> Result<(), BoxError> {
    let tools = service_fn(|_call: ToolCall| async { Ok::<_, BoxError>(String::new()) });
    // README block 8
    let runtime = Backstop::tools("payments-tool", ToolRules).preset(Preset::Create).build()?.layer(tools);
    // end
    Ok(())
}

#[rustfmt::skip]
async fn mcp_rmcp(
    client: rmcp::service::RunningService<rmcp::RoleClient, ()>,
    payments_tools: backstop_workspace::refunds_mcp::RefundTools,
) -> Result<(), BoxError> {
    use backstop::{Run, mcp::{ToolCatalog, ToolReplayLayer, rmcp::ReplayHandler}, replay::MemoryStore};
    use serde_json::json;
    use std::time::Duration;
    use tower::ServiceExt;
    // README block 9
    let run = Run::new("run-7f3a").deadline(Duration::from_secs(120)).retry_budget(10); // shared by the run's calls
    let catalog = ToolCatalog::discover(client.peer()).await?;     // the tools' annotations choose each call's policy
    let payments = Backstop::mcp("payments-mcp").build()?.rmcp(client.peer().clone());
    let call = catalog.call("issue_refund", json!({"order": "ORD-4812", "eur": 40}))?.in_run(&run);
    match payments.oneshot(call).await {
        Ok(result) => { /* the tool's answer; `isError: true` is an answer too, for the model */ }
        Err(e) => { let for_the_model = e.to_tool_result(None); }
    }
    // the server side: a keyed tools/call runs once, repeats get the stored result
    let server = ReplayHandler::new(payments_tools, ToolReplayLayer::new(MemoryStore::default()).single_tenant());
    // end
    Ok(())
}

async fn issue_refund(args: serde_json::Value) -> tower_mcp::Result<tower_mcp::CallToolResult> {
    Ok(tower_mcp::CallToolResult::text(args.to_string()))
}

#[rustfmt::skip]
async fn mcp_tower() -> Result<(), BoxError> {
    use backstop::{mcp::{ToolReplayLayer, tower_mcp::{PerToolReplayLayer, RouterClient}}, replay::MemoryStore};
    use tower_mcp::{McpRouter, ToolBuilder};
    // README block 10
    let refund = ToolBuilder::new("issue_refund").description("Refund part of an order").destructive()
        .handler(issue_refund)
        .layer(PerToolReplayLayer::new("issue_refund", ToolReplayLayer::new(MemoryStore::default()).single_tenant()))
        .build();
    let router = McpRouter::new().server_info("payments", "1.0").tool(refund);
    let payments = Backstop::mcp("payments-mcp").build()?.layer(RouterClient::connect(router).await?);
    // end
    Ok(())
}

#[tokio::test]
async fn the_tower_mcp_block_runs() {
    mcp_tower().await.unwrap();
}

/// The Rust blocks of the README, in order.
fn readme_blocks() -> Vec<String> {
    let readme = include_str!("../../README.md");
    let mut blocks = Vec::new();
    let mut lines = readme.lines();
    while let Some(line) = lines.next() {
        if line.trim() == "```rust" {
            let block: Vec<&str> = lines.by_ref().take_while(|l| l.trim() != "```").collect();
            blocks.push(block.join("\n"));
        }
    }
    blocks
}

/// The blocks of this file, their common indentation taken off.
fn compiled_blocks() -> Vec<String> {
    let me = include_str!("readme_code.rs");
    let mut blocks = Vec::new();
    let mut lines = me.lines();
    while let Some(line) = lines.next() {
        if line.trim().starts_with("// README block ") {
            let block: Vec<&str> = lines
                .by_ref()
                .take_while(|l| l.trim() != "// end")
                .collect();
            let indent = block
                .iter()
                .filter(|l| !l.trim().is_empty())
                .map(|l| l.len() - l.trim_start().len())
                .min()
                .unwrap_or(0);
            blocks.push(
                block
                    .iter()
                    .map(|l| l.get(indent..).unwrap_or("").trim_end())
                    .collect::<Vec<_>>()
                    .join("\n"),
            );
        }
    }
    blocks
}

#[test]
fn every_rust_block_of_the_readme_is_compiled_here_as_it_is_written() {
    let readme = readme_blocks();
    let compiled = compiled_blocks();
    assert_eq!(
        readme.len(),
        compiled.len(),
        "one compiled copy per README block"
    );
    for (i, (r, c)) in readme.iter().zip(&compiled).enumerate() {
        assert_eq!(
            r.trim_end(),
            c.trim_end(),
            "README block {} differs from tests/it/readme_code.rs",
            i + 1
        );
    }
}
