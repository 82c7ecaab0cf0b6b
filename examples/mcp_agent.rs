//! An agent's MCP tool calls through the Backstop stack, against a real MCP server.
//!
//! The payments server is an rmcp `ServerHandler` with three annotated tools (`issue_refund`:
//! destructive, not idempotent; `order_status`: read-only; `set_refund_note`: idempotent),
//! behind Backstop's tool replay (`ReplayHandler`), served over rmcp's streamable HTTP
//! transport on loopback. The agent is an rmcp client under `Backstop::mcp(..)`, and its
//! "model" is a script that reads each tool result, or each error turned into a tool result,
//! and decides what to do next the way a model would.
//!
//! 1. The reply to `issue_refund` is lost after the refund is booked. The tool is destructive,
//!    so the stack does not repeat it; the model is told the outcome is unknown. It repeats the
//!    same action: the key (derived from the run, the tool and the arguments) is the same, the
//!    server replays the stored result. One refund, the original result.
//! 2. The reply to `set_refund_note` is lost: the tool is idempotent, so the stack repeats it
//!    with the same key at once, and the model never sees the loss.
//! 3. A refund of -5 EUR: the tool refuses (`isError: true`) and the model reads why; a refund
//!    without an order: a JSON-RPC `invalid params` error, not retried, told to the model.
//! 4. A 20-minute outage of the payments server (tokio's paused clock): the breaker opens after
//!    a few failures and every later call is refused at once; the model is told to stop and
//!    tell the user, and does.
//!
//! Run it with `cargo run --example mcp_agent`.

use backstop::{
    Backstop, BoxError, Error, Run,
    breaker::{Breaker, BreakerConfig},
    mcp::{ToolCall, ToolCatalog, ToolError, ToolResult},
};
use backstop_workspace::refunds_mcp::RefundServer;
use rmcp::{
    ServiceExt,
    transport::{
        StreamableHttpClientTransport, streamable_http_client::StreamableHttpClientTransportConfig,
    },
};
use serde_json::{Value, json};
use std::{
    sync::{
        Arc,
        atomic::{AtomicU32, Ordering},
    },
    time::Duration,
};
use tower::{Layer, Service, ServiceExt as _, service_fn};

/// What the stack handed back, as the model sees it: a tool result, or the error as one.
fn as_model_sees_it(outcome: &Result<ToolResult, Error>, key: Option<&str>) -> Value {
    match outcome {
        Ok(result) => result.to_json(),
        Err(e) => e.to_tool_result(key),
    }
}

/// The scripted model's reading of a tool result: what it says, and what it does next.
fn model_reads(what: &Value) -> (&str, &str) {
    let text = what["content"][0]["text"].as_str().unwrap_or("");
    let next = what["structuredContent"]["next_action"]
        .as_str()
        .unwrap_or("");
    (text, next)
}

fn print_turn(tool: &str, what: &Value) {
    let (text, next) = model_reads(what);
    println!(
        "   {tool} -> {}",
        if what["isError"] == true {
            "error"
        } else {
            "ok"
        }
    );
    println!("     text: {text}");
    if !next.is_empty() {
        println!("     outcome: {}", what["structuredContent"]["outcome"]);
        println!("     next action: {next}");
    }
}

pub(crate) fn main() -> Result<(), BoxError> {
    // Real loopback HTTP on the real clock, then the outage on a paused one.
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?
        .block_on(over_http())?;
    println!("4. the payments server is down for 20 minutes (paused clock):");
    outage()
}

async fn over_http() -> Result<(), BoxError> {
    // The first reply to each of these is lost after the server has answered.
    let server = RefundServer::start(Some("issue_refund")).await;
    let notes = RefundServer::start(Some("set_refund_note")).await;
    let connect = |url: String| async move {
        let transport = StreamableHttpClientTransport::with_client(
            reqwest::Client::new(),
            StreamableHttpClientTransportConfig::with_uri(url),
        );
        ().serve(transport).await
    };
    let client = connect(server.url()).await?;
    let notes_client = connect(notes.url()).await?;

    // The annotations choose each call's policy; the stack is the standard one.
    let catalog = ToolCatalog::discover(client.peer()).await?;
    let stack = Backstop::mcp("payments-mcp")
        .attempt_timeout(Duration::from_secs(2))
        .deadline(Duration::from_secs(6))
        .breaker(Breaker::new(BreakerConfig::default())?)
        .build()?;
    let payments = stack.rmcp(client.peer().clone());
    let run = Run::new("run-7f3a").deadline(Duration::from_secs(120));

    println!("1. issue_refund (destructive); its reply is lost after the refund is booked:");
    let refund = || -> Result<ToolCall, ToolError> {
        Ok(catalog
            .call("issue_refund", json!({"order": "ORD-4812", "eur": 40}))?
            .in_run(&run))
    };
    let key = backstop::idempotency::ActionContext::action(
        run.id(),
        "issue_refund",
        &refund()?.canonical(),
    )
    .key();
    let first = payments.clone().oneshot(refund()?).await;
    let seen = as_model_sees_it(&first, Some(key.as_str()));
    print_turn("issue_refund", &seen);
    let err = first
        .as_ref()
        .err()
        .ok_or("the lost reply must be an error")?;
    assert_eq!(
        err.attempts(),
        1,
        "a destructive tool is not repeated by the stack"
    );
    assert_eq!(seen["structuredContent"]["outcome"], "unknown");
    println!("   model: the outcome is unknown; I repeat the same action (same key)");
    let again = payments.clone().oneshot(refund()?).await?;
    print_turn("issue_refund", &again.to_json());
    assert!(again.is_replayed(), "the server replays the stored result");
    assert_eq!(
        again.joined_text(),
        "refund R1 of 40.00 EUR booked for ORD-4812"
    );
    let refunds = server.tools.refunds();
    println!(
        "   refunds booked: {} ({}), tool runs: {}",
        refunds.len(),
        refunds
            .iter()
            .map(|r| r.id.as_str())
            .collect::<Vec<_>>()
            .join(", "),
        server.tools.handled.load(Ordering::SeqCst)
    );
    assert_eq!(refunds.len(), 1);

    println!("2. set_refund_note (idempotent); its reply is lost:");
    let note = catalog
        .call(
            "set_refund_note",
            json!({"refund": "R1", "note": "late delivery"}),
        )?
        .in_run(&run);
    let noted = stack
        .rmcp(notes_client.peer().clone())
        .oneshot(note)
        .await?;
    print_turn("set_refund_note", &noted.to_json());
    println!(
        "   repeated by the stack with the same key: replayed = {}, tool runs: {}",
        noted.is_replayed(),
        notes.tools.handled.load(Ordering::SeqCst)
    );
    assert!(noted.is_replayed());
    assert_eq!(notes.tools.handled.load(Ordering::SeqCst), 1);

    println!("3. a refund the tool refuses, and one the server rejects:");
    let before = server.tools.handled.load(Ordering::SeqCst);
    let negative = catalog
        .call("issue_refund", json!({"order": "ORD-4812", "eur": -5}))?
        .in_run(&run);
    let refused = payments.clone().oneshot(negative).await?;
    print_turn("issue_refund", &refused.to_json());
    assert!(
        refused.is_error,
        "the tool's refusal is its answer, for the model to read"
    );
    let no_order = catalog
        .call("issue_refund", json!({"eur": 5}))?
        .in_run(&run);
    let rejected = payments.clone().oneshot(no_order).await;
    let seen = as_model_sees_it(&rejected, None);
    print_turn("issue_refund", &seen);
    assert_eq!(seen["structuredContent"]["outcome"], "completed");
    assert_eq!(
        server.tools.handled.load(Ordering::SeqCst),
        before + 2,
        "neither was retried"
    );
    assert_eq!(server.tools.refunds().len(), 1);
    client.cancel().await?;
    notes_client.cancel().await?;
    Ok(())
}

/// The outage, on tokio's paused clock: the transport refuses every call for 20 minutes.
fn outage() -> Result<(), BoxError> {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .start_paused(true)
        .build()?;
    rt.block_on(async {
        let reached = Arc::new(AtomicU32::new(0));
        let seen = reached.clone();
        let down = service_fn(move |_call: ToolCall| {
            seen.fetch_add(1, Ordering::SeqCst);
            async {
                Err::<ToolResult, _>(ToolError::NotSent(Box::new(std::io::Error::from(
                    std::io::ErrorKind::ConnectionRefused,
                ))))
            }
        });
        let mut payments = Backstop::mcp("payments-mcp")
            .breaker(Breaker::new(BreakerConfig::default())?)
            .build()?
            .layer(down);
        let run = Run::new("run-outage");
        let started = tokio::time::Instant::now();
        let mut turns = 0;
        // The model asks for the order's status once a minute until it is told to stop.
        while started.elapsed() < Duration::from_secs(20 * 60) {
            turns += 1;
            let call = ToolCall::new("order_status", json!({"order": "ORD-4812"}))?
                .hints(backstop::mcp::ToolHints {
                    read_only: Some(true),
                    ..Default::default()
                })
                .in_run(&run);
            let outcome = payments.ready().await?.call(call).await;
            let seen = as_model_sees_it(&outcome, None);
            let (text, next) = model_reads(&seen);
            if seen["structuredContent"]["kind"] == "unavailable" {
                println!("   turn {turns} at {:?}: {text}", started.elapsed());
                println!("     next action: {next}");
                println!("   model: payments is down; I stop and tell the user");
                break;
            }
            println!("   turn {turns} at {:?}: {text}", started.elapsed());
            tokio::time::sleep(Duration::from_secs(60)).await;
        }
        let reached = reached.load(Ordering::SeqCst);
        println!(
            "   {turns} turns, {reached} attempts reached the dead server, {} retries spent",
            run.retries_spent()
        );
        assert!(turns < 20, "the model stopped before the outage ended");
        assert!(reached <= 15, "the breaker kept calls away: {reached}");
        Ok::<_, BoxError>(())
    })
}
