//! MCP tool calls through the whole stack: against a real rmcp server on loopback (streamable
//! HTTP, the real clock, short durations), and run-level deadlines and budgets on tokio's
//! paused clock.

use backstop::{
    Backstop, Deadline, Dependency, ErrorKind, Outcome, Run,
    backoff::{Backoff, RngSource},
    mcp::{
        META_KEY, META_KEY_ALIAS, ToolCall, ToolCatalog, ToolError, ToolHints, ToolPolicy,
        ToolResult,
    },
    retry::StopReason,
};
use backstop_workspace::refunds_mcp::RefundServer;
use rmcp::{
    RoleClient, ServiceExt,
    service::RunningService,
    transport::{
        StreamableHttpClientTransport, streamable_http_client::StreamableHttpClientTransportConfig,
    },
};
use serde_json::json;
use std::{
    sync::{
        Arc, Mutex,
        atomic::{AtomicU32, Ordering},
    },
    time::Duration,
};
use tower::{Layer, ServiceExt as _, service_fn};

async fn connect(server: &RefundServer) -> RunningService<RoleClient, ()> {
    let transport = StreamableHttpClientTransport::with_client(
        reqwest::Client::new(),
        StreamableHttpClientTransportConfig::with_uri(server.url()),
    );
    tokio::time::timeout(Duration::from_secs(10), ().serve(transport))
        .await
        .expect("the client connects within 10 s")
        .expect("the client connects")
}

fn payments() -> Backstop<
    backstop::mcp::McpClassifier,
    backstop::retry::CloneResend,
    backstop::idempotency::ToolKeys,
> {
    Backstop::mcp("payments-mcp")
        .no_breaker()
        .backoff(Backoff::full_jitter(Duration::from_millis(5), Duration::from_millis(20)).unwrap())
        .attempt_timeout(Duration::from_secs(3))
        .deadline(Duration::from_secs(8))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lost_refund_reply_and_the_model_repeating_itself_books_one_refund() {
    let server = RefundServer::start(Some("issue_refund")).await;
    let client = connect(&server).await;
    let catalog = ToolCatalog::discover(client.peer()).await.unwrap();
    let tools = payments().build().unwrap().rmcp(client.peer().clone());
    let run = Run::new("run-7f3a");
    let refund = || {
        catalog
            .call("issue_refund", json!({"order": "ORD-4812", "eur": 40}))
            .unwrap()
            .in_run(&run)
    };
    assert_eq!(refund().policy(), ToolPolicy::NeverRetry);

    let err = tools.clone().oneshot(refund()).await.unwrap_err();
    assert_eq!(err.outcome(), Outcome::Unknown, "{err}");
    assert_eq!(
        err.attempts(),
        1,
        "a destructive tool is never repeated by the stack: {err}"
    );
    assert_eq!(server.lost.load(Ordering::SeqCst), 1);
    assert!(
        err.to_string().contains("may or may not have taken effect"),
        "{err}"
    );
    // Said first: the reply was lost; then the transport's words.
    assert!(
        err.to_string()
            .starts_with("the reply from payments-mcp was lost (1 attempt in "),
        "{err}"
    );
    // What the model receives: the error as a tool result, via rmcp's own type.
    let told: rmcp::model::CallToolResult =
        serde_json::from_value(err.to_tool_result(None)).expect("rmcp reads it");
    assert_eq!(told.is_error, Some(true));
    assert_eq!(
        told.structured_content.as_ref().unwrap()["outcome"],
        "unknown"
    );

    // The model repeats the same action: same run, tool and arguments, so the same key.
    let again: ToolResult = tools.clone().oneshot(refund()).await.unwrap();
    assert!(again.is_replayed(), "{:?}", again.to_json());
    assert_eq!(
        again.joined_text(),
        "refund R1 of 40.00 EUR booked for ORD-4812"
    );
    assert_eq!(server.tools.refunds().len(), 1, "one refund");
    assert_eq!(server.tools.handled.load(Ordering::SeqCst), 1);

    // The key went in `_meta` under the documented names, never in the arguments.
    let seen = server.tools.seen.lock().unwrap().clone();
    let (meta, args) = &seen[0];
    let key = meta[META_KEY].as_str().expect("the key in _meta");
    assert_eq!(meta[META_KEY_ALIAS], key);
    assert!(!args.contains_key(META_KEY) && !args.contains_key(META_KEY_ALIAS));

    // Another amount is another action: a new key, a second refund.
    let other = catalog
        .call("issue_refund", json!({"order": "ORD-4812", "eur": 5}))
        .unwrap()
        .in_run(&run);
    assert!(!tools.oneshot(other).await.unwrap().is_replayed());
    assert_eq!(server.tools.refunds().len(), 2);
    client.cancel().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn over_http_the_key_can_travel_as_an_idempotency_key_header_too() {
    let server = RefundServer::start(None).await;
    let transport = StreamableHttpClientTransport::with_client(
        backstop::mcp::rmcp::MetaHeaders::new(reqwest::Client::new()),
        StreamableHttpClientTransportConfig::with_uri(server.url()),
    );
    let client = ().serve(transport).await.unwrap();
    let catalog = ToolCatalog::discover(client.peer()).await.unwrap();
    let tools = payments().build().unwrap().rmcp(client.peer().clone());
    let run = Run::new("run-header");
    let call = catalog
        .call("issue_refund", json!({"order": "ORD-9", "eur": 3}))
        .unwrap()
        .in_run(&run);
    tools.clone().oneshot(call).await.unwrap();
    let read_only = catalog
        .call("order_status", json!({"order": "ORD-9"}))
        .unwrap();
    tools.oneshot(read_only).await.unwrap();
    let headers = server.key_headers.lock().unwrap().clone();
    let seen = server.tools.seen.lock().unwrap().clone();
    assert_eq!(headers.len(), 2);
    assert_eq!(
        headers[0].as_deref(),
        seen[0].0[META_KEY].as_str(),
        "the header is the _meta key"
    );
    assert_eq!(headers[1], None, "a read carries no key");
    client.cancel().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_keyed_call_answered_with_a_task_gets_the_same_task_when_repeated() {
    let server = RefundServer::start(None).await;
    // A client that declares MCP's tasks extension, so the server may answer with tasks.
    let mut config = rmcp::model::ClientConfig::default();
    config.capabilities = rmcp::model::ClientCapabilities::builder()
        .enable_tasks()
        .build();
    let transport = StreamableHttpClientTransport::with_client(
        reqwest::Client::new(),
        StreamableHttpClientTransportConfig::with_uri(server.url()),
    );
    let client = config.serve(transport).await.unwrap();
    let tools = payments().build().unwrap().rmcp(client.peer().clone());
    let run = Run::new("run-export");
    let export = || {
        ToolCall::new("export_statement", json!({"order": "ORD-4812"}))
            .unwrap()
            .in_run(&run)
    };
    let first = tools.clone().oneshot(export()).await.unwrap();
    assert_eq!(first.task_id(), Some("task-1"), "{:?}", first.to_json());
    assert!(first.content.is_empty() && !first.is_error);
    // The model repeats the call while the task runs: the same task, not a second one.
    let again = tools.clone().oneshot(export()).await.unwrap();
    assert!(again.is_replayed(), "{:?}", again.to_json());
    assert_eq!(again.task_id(), Some("task-1"));
    assert_eq!(again.task.as_ref().unwrap()["status"], "working");
    assert_eq!(
        server.tools.tasks.load(Ordering::SeqCst),
        1,
        "one execution"
    );
    // Without a key, each call is its own task.
    let unkeyed = ToolCall::new("export_statement", json!({"order": "ORD-1"})).unwrap();
    let unkeyed = tools
        .clone()
        .oneshot(unkeyed.with_policy(ToolPolicy::ReadOnly))
        .await
        .unwrap();
    assert_eq!(unkeyed.task_id(), Some("task-2"));
    client.cancel().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_user_s_key_never_replays_another_user_s_result() {
    let server = RefundServer::start_multi_tenant().await;
    let connect_as = |user: Option<&'static str>| {
        let mut config = StreamableHttpClientTransportConfig::with_uri(server.url());
        if let Some(user) = user {
            config
                .custom_headers
                .insert("x-user".parse().unwrap(), user.parse().unwrap());
        }
        ().serve(StreamableHttpClientTransport::with_client(
            reqwest::Client::new(),
            config,
        ))
    };
    let key = backstop::idempotency::IdempotencyKey::new("refund-ORD-4812").unwrap();
    let refund = || {
        ToolCall::new("issue_refund", json!({"order": "ORD-4812", "eur": 40}))
            .unwrap()
            .with_key(key.clone())
    };
    let mut answers = Vec::new();
    for user in ["alice", "bob", "alice"] {
        let client = connect_as(Some(user)).await.unwrap();
        let tools = payments().build().unwrap().rmcp(client.peer().clone());
        answers.push(tools.oneshot(refund()).await.unwrap());
        client.cancel().await.unwrap();
    }
    assert!(!answers[0].is_replayed() && !answers[1].is_replayed());
    assert_ne!(
        answers[0].joined_text(),
        answers[1].joined_text(),
        "bob's refund is bob's"
    );
    assert!(
        answers[2].is_replayed(),
        "alice's repeat gets alice's result"
    );
    assert_eq!(answers[2].joined_text(), answers[0].joined_text());
    assert_eq!(server.tools.refunds().len(), 2);
    // No principal on a multi-tenant server: refused, nothing booked.
    let client = connect_as(None).await.unwrap();
    let tools = payments().build().unwrap().rmcp(client.peer().clone());
    let err = tools.oneshot(refund()).await.unwrap_err();
    assert_eq!(
        (err.outcome(), err.attempts()),
        (Outcome::NotSent, 1),
        "{err}"
    );
    assert_eq!(server.tools.refunds().len(), 2);
    client.cancel().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_idempotent_tool_s_lost_reply_is_repeated_with_the_same_key() {
    let server = RefundServer::start(Some("set_refund_note")).await;
    let client = connect(&server).await;
    let catalog = ToolCatalog::discover(client.peer()).await.unwrap();
    let tools = payments().build().unwrap().rmcp(client.peer().clone());
    let note = catalog
        .call("set_refund_note", json!({"refund": "R1", "note": "late"}))
        .unwrap();
    assert_eq!(note.policy(), ToolPolicy::KeyHonouring);
    let result = tools.oneshot(note).await.unwrap();
    assert_eq!(server.lost.load(Ordering::SeqCst), 1);
    assert!(
        result.is_replayed(),
        "the second attempt carried the first one's key"
    );
    assert_eq!(server.tools.handled.load(Ordering::SeqCst), 1);
    client.cancel().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn refusals_go_back_to_the_model_and_are_not_retried() {
    let server = RefundServer::start(None).await;
    let client = connect(&server).await;
    let catalog = ToolCatalog::discover(client.peer()).await.unwrap();
    let tools = payments().build().unwrap().rmcp(client.peer().clone());

    // The tool's own refusal (`isError: true`) is its answer.
    let negative = catalog
        .call("issue_refund", json!({"order": "ORD-4812", "eur": -5}))
        .unwrap();
    let answer = tools.clone().oneshot(negative).await.unwrap();
    assert!(answer.is_error);
    assert!(answer.joined_text().contains("ask the user for the amount"));

    // The server's JSON-RPC refusal (invalid params): final, told in words.
    let no_order = catalog.call("issue_refund", json!({"eur": 5})).unwrap();
    let err = tools.clone().oneshot(no_order).await.unwrap_err();
    assert_eq!(
        (err.kind(), err.outcome(), err.attempts()),
        (ErrorKind::Failed, Outcome::Completed, 1)
    );
    assert!(err.to_string().contains("needs `order`"), "{err}");
    assert!(
        err.next_action().contains("change the request"),
        "{}",
        err.next_action()
    );

    // An unknown tool: method not found, final.
    let missing = ToolCall::new("refund_everything", json!({})).unwrap();
    let err = tools.oneshot(missing).await.unwrap_err();
    assert_eq!(err.attempts(), 1, "{err}");
    assert_eq!(
        server.tools.handled.load(Ordering::SeqCst),
        3,
        "each ran once"
    );
    assert!(server.tools.refunds().is_empty());
    client.cancel().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_catalog_reads_the_server_s_annotations() {
    let server = RefundServer::start(None).await;
    let client = connect(&server).await;
    let catalog = ToolCatalog::discover(client.peer()).await.unwrap();
    let policy = |tool| catalog.call(tool, json!({})).unwrap().policy();
    assert_eq!(policy("issue_refund"), ToolPolicy::NeverRetry);
    assert_eq!(policy("order_status"), ToolPolicy::ReadOnly);
    assert_eq!(policy("set_refund_note"), ToolPolicy::KeyHonouring);
    assert_eq!(policy("not_listed"), ToolPolicy::Standard);
    // The caller's choice wins over the annotations.
    let chosen = ToolCall::new("issue_refund", json!({}))
        .unwrap()
        .with_policy(ToolPolicy::KeyHonouring)
        .hints(catalog.hints("issue_refund"));
    assert_eq!(chosen.policy(), ToolPolicy::KeyHonouring);
    client.cancel().await.unwrap();
}

/// Each call a transport saw: the tool and the key it carried.
type Seen = Arc<Mutex<Vec<(String, Option<String>)>>>;

/// A transport whose every call fails as `fail` says, counting the calls per tool.
fn failing(
    fail: fn() -> ToolError,
) -> (
    impl tower::Service<ToolCall, Response = ToolResult, Error = ToolError, Future: Send> + Clone,
    Seen,
) {
    let calls: Seen = Arc::default();
    let seen = calls.clone();
    let svc = service_fn(move |call: ToolCall| {
        seen.lock().unwrap().push((
            call.name().to_owned(),
            call.key().map(|k| k.as_str().to_owned()),
        ));
        async move { Err::<ToolResult, _>(fail()) }
    });
    (svc, calls)
}

fn lost() -> ToolError {
    ToolError::Lost("connection reset by peer".into())
}

fn refused() -> ToolError {
    ToolError::NotSent(Box::new(std::io::Error::from(
        std::io::ErrorKind::ConnectionRefused,
    )))
}

fn read_only(name: &str) -> ToolCall {
    ToolCall::new(name, json!({"q": 1}))
        .unwrap()
        .hints(ToolHints {
            read_only: Some(true),
            ..ToolHints::default()
        })
}

#[tokio::test(start_paused = true)]
async fn each_policy_s_attempts_after_a_lost_reply() {
    let (transport, calls) = failing(lost);
    let tools = payments()
        .max_attempts(3)
        .rng(RngSource::seeded(7))
        .build()
        .unwrap()
        .layer(transport);
    let attempts = |policy| {
        let tools = tools.clone();
        let calls = calls.clone();
        async move {
            calls.lock().unwrap().clear();
            let call = ToolCall::new("t", json!({})).unwrap().with_policy(policy);
            let err = tools.oneshot(call).await.unwrap_err();
            let seen = calls.lock().unwrap().clone();
            (err.attempts(), seen)
        }
    };
    let (n, seen) = attempts(ToolPolicy::ReadOnly).await;
    assert_eq!(n, 3);
    assert!(seen.iter().all(|(_, k)| k.is_none()), "a read needs no key");
    let (n, seen) = attempts(ToolPolicy::KeyHonouring).await;
    assert_eq!(n, 3);
    let first = seen[0].1.clone().expect("a key");
    assert!(
        seen.iter().all(|(_, k)| k.as_ref() == Some(&first)),
        "one key on every attempt"
    );
    let (n, _) = attempts(ToolPolicy::NeverRetry).await;
    assert_eq!(n, 1);
    // The standard policy: the stack's own key does not make a lost reply repeatable...
    let (n, _) = attempts(ToolPolicy::Standard).await;
    assert_eq!(n, 1);
    // ...but a call that never left is sent again, whatever the policy but "never".
    let (transport, calls) = failing(refused);
    let tools = payments()
        .rng(RngSource::seeded(7))
        .build()
        .unwrap()
        .layer(transport);
    let call = ToolCall::new("t", json!({})).unwrap();
    assert_eq!(tools.clone().oneshot(call).await.unwrap_err().attempts(), 3);
    calls.lock().unwrap().clear();
    let once = ToolCall::new("t", json!({}))
        .unwrap()
        .with_policy(ToolPolicy::NeverRetry);
    let err = tools.oneshot(once).await.unwrap_err();
    assert_eq!((err.attempts(), err.outcome()), (1, Outcome::NotSent));
}

/// The stack's call's work over a retry layer of one's own, for tool calls: the key goes in
/// each attempt's `_meta`, the same on every attempt, and each call's tool policy still decides
/// whether a lost reply is repeated; one `Error` per call.
#[tokio::test(start_paused = true)]
async fn the_calls_work_over_a_retry_layer_of_ones_own_keys_every_tool_attempt() {
    let (transport, calls) = failing(lost);
    let call = payments().build().unwrap().call_layer();
    let retry = backstop::retry::RetryLayer::new(backstop::mcp::McpClassifier)
        .dependency("payments-mcp")
        .rng(RngSource::seeded(7))
        .backoff(Backoff::constant(Duration::from_millis(10)));
    let tools = tower::ServiceBuilder::new()
        .layer(call)
        .layer(retry)
        .service(transport);
    let keyed = ToolCall::new("set_refund_note", json!({"refund": "R1"}))
        .unwrap()
        .with_policy(ToolPolicy::KeyHonouring);
    let err: backstop::Error = tools.clone().oneshot(keyed).await.unwrap_err();
    assert_eq!(
        (err.attempts(), err.outcome()),
        (3, Outcome::Unknown),
        "{err}"
    );
    let seen = calls.lock().unwrap().clone();
    assert_eq!(seen.len(), 3);
    let first = seen[0].1.clone().expect("a key in _meta");
    assert!(seen.iter().all(|(_, k)| k.as_ref() == Some(&first)));
    calls.lock().unwrap().clear();
    let once = ToolCall::new("issue_refund", json!({"refund": "R1"}))
        .unwrap()
        .with_policy(ToolPolicy::NeverRetry);
    let err = tools.oneshot(once).await.unwrap_err();
    assert_eq!(
        (err.attempts(), err.outcome()),
        (1, Outcome::Unknown),
        "{err}"
    );
    assert_eq!(calls.lock().unwrap().len(), 1);
}

#[tokio::test(start_paused = true)]
async fn a_call_gets_what_is_left_of_the_run_s_deadline() {
    let run = Run::new("run-deadline").deadline(Duration::from_secs(120));
    tokio::time::advance(Duration::from_secs(100)).await;
    let left = Arc::new(Mutex::new(None));
    let seen = left.clone();
    let slow = service_fn(move |call: ToolCall| {
        *seen.lock().unwrap() = Deadline::of(&call).map(Deadline::remaining);
        async {
            tokio::time::sleep(Duration::from_secs(600)).await;
            Ok::<_, ToolError>(ToolResult::text("late"))
        }
    });
    // The stack's own deadline is 30 s, the attempt timeout 25 s: the run has 20 s left.
    let tools = Backstop::mcp("search-mcp")
        .no_breaker()
        .attempt_timeout(Duration::from_secs(25))
        .build()
        .unwrap()
        .layer(slow);
    let started = tokio::time::Instant::now();
    let err = tools
        .oneshot(read_only("search").in_run(&run))
        .await
        .unwrap_err();
    assert_eq!(*left.lock().unwrap(), Some(Duration::from_secs(20)));
    assert_eq!(started.elapsed(), Duration::from_secs(20), "{err}");
    assert_eq!(err.kind(), ErrorKind::DeadlineExceeded, "{err}");
    // A call whose own deadline is earlier keeps it.
    let mut call = read_only("search");
    Deadline::after(Duration::from_secs(5)).tighten(&mut call);
    let call = call.in_run(&Run::new("r2").deadline(Duration::from_secs(120)));
    assert_eq!(
        Deadline::of(&call).unwrap().remaining(),
        Duration::from_secs(5)
    );
}

#[tokio::test(start_paused = true)]
async fn one_failing_tool_cannot_spend_more_than_the_run_s_retries() {
    let (carrier, carrier_calls) = failing(refused);
    let (search, search_calls) = failing(refused);
    let stack = |name: &str| {
        Backstop::mcp(name)
            .no_breaker()
            .no_budget()
            .max_attempts(5)
            .rng(RngSource::seeded(1))
            .backoff(
                Backoff::full_jitter(Duration::from_millis(10), Duration::from_millis(50)).unwrap(),
            )
            .build()
            .unwrap()
    };
    let carrier = stack("carrier-mcp").layer(carrier);
    let search = stack("search-mcp").layer(search);
    let run = Run::new("run-budget").retry_budget(6);

    // The carrier is down: its calls spend the run's retries, four at a time, until none are left.
    let e1 = carrier
        .clone()
        .oneshot(read_only("quote").in_run(&run))
        .await
        .unwrap_err();
    assert_eq!(e1.attempts(), 5);
    let e2 = carrier
        .clone()
        .oneshot(read_only("quote").in_run(&run))
        .await
        .unwrap_err();
    assert_eq!(e2.attempts(), 3, "two retries were left: {e2}");
    assert_eq!(e2.kind(), ErrorKind::BudgetExhausted);
    assert!(
        e2.to_string()
            .contains("this run has spent all 6 of its retries"),
        "{e2}"
    );
    assert!(
        e2.next_action()
            .contains("this run has used all of its retries"),
        "{}",
        e2.next_action()
    );
    assert!(matches!(
        e2.history().map(|h| &h.stopped),
        Some(StopReason::RunBudgetExhausted { retries: 6 })
    ));
    // Another tool of the same run gets its first attempt, and no retry.
    let e3 = search
        .clone()
        .oneshot(read_only("find").in_run(&run))
        .await
        .unwrap_err();
    assert_eq!(e3.attempts(), 1, "{e3}");
    assert_eq!(search_calls.lock().unwrap().len(), 1);
    assert_eq!(carrier_calls.lock().unwrap().len(), 8);
    // The spend is attributed to the tool that made it.
    assert_eq!(run.spent_by(), vec![(Dependency::new("carrier-mcp"), 6)]);
    // A call outside the run keeps the stack's own limits.
    assert_eq!(
        search
            .oneshot(read_only("find"))
            .await
            .unwrap_err()
            .attempts(),
        5
    );
}

#[tokio::test(start_paused = true)]
async fn a_retry_the_dependency_s_budget_refuses_goes_back_to_the_run() {
    let (down, _) = failing(refused);
    let budget = backstop::budget::Budget::new(
        backstop::budget::BudgetConfig::default()
            .ratio(0.0)
            .min_retries_per_sec(0.0),
    )
    .unwrap();
    let tools = Backstop::mcp("thin-mcp")
        .no_breaker()
        .budget(budget)
        .rng(RngSource::seeded(3))
        .build()
        .unwrap()
        .layer(down);
    let run = Run::new("run-refund").retry_budget(3);
    let err = tools
        .oneshot(read_only("x").in_run(&run))
        .await
        .unwrap_err();
    assert_eq!(err.kind(), ErrorKind::BudgetExhausted, "{err}");
    assert_eq!(run.retries_spent(), 0, "nothing was retried, nothing spent");
}

/// tower-mcp: a payments router in process, its refund tool behind the per-tool replay layer.
mod tower_mcp_router {
    use super::*;
    use backstop::mcp::{
        META_ERROR, ToolReplayLayer, codes,
        tower_mcp::{PerToolReplayLayer, RouterClient},
    };
    use backstop::replay::MemoryStore;
    use tower_mcp::{CallToolResult, McpRouter, ToolBuilder};

    fn router(booked: Arc<AtomicU32>, delay: Duration) -> McpRouter {
        let replay = ToolReplayLayer::new(MemoryStore::default()).single_tenant();
        let refund = ToolBuilder::new("issue_refund")
            .description("Refund part of an order")
            .destructive()
            .handler(move |args: serde_json::Value| {
                let booked = booked.clone();
                async move {
                    tokio::time::sleep(delay).await;
                    let n = booked.fetch_add(1, Ordering::SeqCst) + 1;
                    Ok(CallToolResult::text(format!(
                        "refund R{n} booked for {}",
                        args["order"]
                    )))
                }
            })
            .layer(PerToolReplayLayer::new("issue_refund", replay))
            .build();
        let status = ToolBuilder::new("order_status")
            .description("An order's status")
            .read_only()
            .handler(|_args: serde_json::Value| async { Ok(CallToolResult::text("delivered")) })
            .build();
        McpRouter::new()
            .server_info("payments", "1.0")
            .tool(refund)
            .tool(status)
    }

    /// The router's first reply is lost after the tool ran.
    #[derive(Clone)]
    struct LoseFirst<S> {
        inner: S,
        lost: Arc<AtomicU32>,
    }

    impl<S> tower::Service<ToolCall> for LoseFirst<S>
    where
        S: tower::Service<ToolCall, Response = ToolResult, Error = ToolError>
            + Clone
            + Send
            + 'static,
        S::Future: Send,
    {
        type Response = ToolResult;
        type Error = ToolError;
        type Future = std::pin::Pin<
            Box<dyn std::future::Future<Output = Result<ToolResult, ToolError>> + Send>,
        >;
        fn poll_ready(
            &mut self,
            cx: &mut std::task::Context<'_>,
        ) -> std::task::Poll<Result<(), ToolError>> {
            self.inner.poll_ready(cx)
        }
        fn call(&mut self, call: ToolCall) -> Self::Future {
            let fut = self.inner.call(call);
            let lost = self.lost.clone();
            Box::pin(async move {
                let result = fut.await?;
                if lost.fetch_add(1, Ordering::SeqCst) == 0 {
                    return Err(ToolError::Lost("the reply was lost on the way back".into()));
                }
                Ok(result)
            })
        }
    }

    /// The refund's reply is lost after the tool ran (one attempt: it is destructive), and
    /// the model repeats the action: the same key, the stored result, one refund.
    async fn lost_refund_then_repeated<S>(
        tools: &S,
        catalog: &ToolCatalog,
        run: &str,
        booked: &AtomicU32,
    ) where
        S: tower::Service<ToolCall, Response = ToolResult, Error = backstop::Error> + Clone,
    {
        let run = Run::new(run);
        let refund = || {
            catalog
                .call("issue_refund", json!({"order": "ORD-4812", "eur": 40}))
                .unwrap()
                .in_run(&run)
        };
        let err = tools.clone().oneshot(refund()).await.unwrap_err();
        assert_eq!(
            (err.outcome(), err.attempts()),
            (Outcome::Unknown, 1),
            "{err}"
        );
        assert_eq!(booked.load(Ordering::SeqCst), 1);
        let again = tools.clone().oneshot(refund()).await.unwrap();
        assert!(again.is_replayed(), "{:?}", again.to_json());
        assert_eq!(again.joined_text(), "refund R1 booked for \"ORD-4812\"");
        assert_eq!(booked.load(Ordering::SeqCst), 1, "one refund");
    }

    #[tokio::test(start_paused = true)]
    async fn the_stack_on_an_mcp_router_with_a_replayed_tool() {
        let booked = Arc::new(AtomicU32::new(0));
        let client = RouterClient::connect(router(booked.clone(), Duration::ZERO))
            .await
            .unwrap();
        let catalog = client.catalog().await.unwrap();
        assert_eq!(
            catalog.call("issue_refund", json!({})).unwrap().policy(),
            ToolPolicy::NeverRetry
        );
        assert_eq!(
            catalog.call("order_status", json!({})).unwrap().policy(),
            ToolPolicy::ReadOnly
        );
        let lost = Arc::new(AtomicU32::new(0));
        let tools = payments().build().unwrap().layer(LoseFirst {
            inner: client,
            lost: lost.clone(),
        });
        lost_refund_then_repeated(&tools, &catalog, "run-tower", &booked).await;
        // A call without a key runs as it would without the layer.
        let unkeyed = ToolCall::new("issue_refund", json!({"order": "ORD-1"}))
            .unwrap()
            .with_policy(ToolPolicy::ReadOnly);
        assert!(!tools.oneshot(unkeyed).await.unwrap().is_replayed());
        assert_eq!(booked.load(Ordering::SeqCst), 2);
    }

    /// tower-mcp's HTTP transport on loopback, the key read from rmcp's `Idempotency-Key`
    /// header into the tool's request.
    async fn serve_over_http(booked: Arc<AtomicU32>) -> backstop_testkit::TestServer {
        use backstop::{idempotency::IdempotencyKey, mcp::tower_mcp::KeyFromHeaderLayer};
        let app = tower_mcp::HttpTransport::new(router(booked, Duration::ZERO))
            .bridge_extension::<IdempotencyKey>()
            .into_router_at("/mcp")
            .layer(KeyFromHeaderLayer::new());
        backstop_testkit::TestServer::serve(app).await
    }

    /// rmcp's client over streamable HTTP to `server`'s `/mcp`, sending `_meta`'s key and time
    /// left as headers too.
    async fn connect_over_http(
        server: &backstop_testkit::TestServer,
    ) -> rmcp::service::RunningService<rmcp::RoleClient, ()> {
        let transport = StreamableHttpClientTransport::with_client(
            backstop::mcp::rmcp::MetaHeaders::new(reqwest::Client::new()),
            StreamableHttpClientTransportConfig::with_uri(server.url("/mcp")),
        );
        tokio::time::timeout(Duration::from_secs(10), ().serve(transport))
            .await
            .expect("the client connects within 10 s")
            .expect("the client connects")
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn over_http_a_lost_reply_and_the_model_s_repeat_book_one_refund() {
        let booked = Arc::new(AtomicU32::new(0));
        let server = serve_over_http(booked.clone()).await;
        let client = connect_over_http(&server).await;
        let catalog = ToolCatalog::discover(client.peer()).await.unwrap();
        let lost = Arc::new(AtomicU32::new(0));
        let tools = payments().build().unwrap().layer(LoseFirst {
            inner: backstop::mcp::rmcp::RmcpClient::new(client.peer().clone()),
            lost: lost.clone(),
        });
        lost_refund_then_repeated(&tools, &catalog, "run-http", &booked).await;
        client.cancel().await.unwrap();
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn over_http_a_malformed_key_header_is_refused_before_the_tool_runs() {
        let booked = Arc::new(AtomicU32::new(0));
        let server = serve_over_http(booked.clone()).await;
        let body = json!({"jsonrpc": "2.0", "id": 1, "method": "tools/call",
            "params": {"name": "issue_refund", "arguments": {"order": "ORD-1"}}});
        let res = reqwest::Client::new()
            .post(server.url("/mcp"))
            .header("idempotency-key", "")
            .header("content-type", "application/json")
            .header("accept", "application/json, text/event-stream")
            .body(body.to_string())
            .send()
            .await
            .unwrap();
        assert_eq!(res.status(), 400);
        assert_eq!(booked.load(Ordering::SeqCst), 0);
    }

    /// Over tower-mcp's HTTP transport (which drops `_meta` keys it does not know), a call's
    /// time left travels as the `backstop-time-left-ms` header rmcp's client sends beside it
    /// (`MetaHeaders`), and `CallerDeadlineLayer` in front of the transport makes it the tool's
    /// deadline: what the Backstop stacks the tool calls inherit.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn over_http_the_tool_runs_within_its_callers_deadline() {
        let clock = ToolBuilder::new("time_left")
            .description("The time the call has left")
            .read_only()
            .handler(|_args: serde_json::Value| async {
                let left = backstop::Deadline::current().map(|d| d.remaining().as_millis());
                Ok(CallToolResult::text(format!("{left:?}")))
            })
            .build();
        let router = McpRouter::new().server_info("clock", "1.0").tool(clock);
        let app = tower_mcp::HttpTransport::new(router)
            .into_router_at("/mcp")
            .layer(backstop::timeout::CallerDeadlineLayer::new(
                Duration::from_secs(30),
            ));
        let server = backstop_testkit::TestServer::serve(app).await;
        let client = connect_over_http(&server).await;
        let tools = payments()
            .attempt_timeout(Duration::from_secs(2))
            .deadline(Duration::from_secs(2))
            .build()
            .unwrap()
            .layer(backstop::mcp::rmcp::RmcpClient::new(client.peer().clone()));
        let call = ToolCall::new("time_left", json!({}))
            .unwrap()
            .with_policy(ToolPolicy::ReadOnly);
        let answer = tools.oneshot(call).await.unwrap().joined_text();
        let left: u128 = answer
            .strip_prefix("Some(")
            .and_then(|v| v.strip_suffix(')'))
            .and_then(|v| v.parse().ok())
            .unwrap_or_else(|| panic!("the tool ran without a deadline: {answer}"));
        assert!(left > 0 && left <= 2_000, "{left} ms");
        client.cancel().await.unwrap();
    }

    #[tokio::test(start_paused = true)]
    async fn a_repeat_while_the_first_runs_is_told_to_wait_and_then_gets_the_result() {
        let booked = Arc::new(AtomicU32::new(0));
        let client = RouterClient::connect(router(booked.clone(), Duration::from_millis(1500)))
            .await
            .unwrap();
        // Straight to the router: the refusal is a result carrying the JSON-RPC error.
        let key = backstop::idempotency::IdempotencyKey::new("refund-ORD-4812").unwrap();
        let call = || {
            ToolCall::new("issue_refund", json!({"order": "ORD-4812"}))
                .unwrap()
                .with_key(key.clone())
        };
        let first = tokio::spawn(client.clone().oneshot(call()));
        tokio::time::sleep(Duration::from_millis(100)).await;
        let meanwhile = client.clone().oneshot(call()).await.unwrap();
        assert!(meanwhile.is_error);
        let carried = meanwhile.carried_error().expect("the refusal's code");
        assert_eq!(
            carried.code,
            codes::KEY_IN_FLIGHT,
            "{:?}",
            meanwhile.meta[META_ERROR]
        );
        // Through the stack: the refusal is retried after the server's pushback (1 s), and the
        // repeat gets the first call's result.
        let tools = Backstop::mcp("payments-mcp")
            .no_breaker()
            .build()
            .unwrap()
            .layer(client.clone());
        let started = tokio::time::Instant::now();
        let repeat = tools
            .oneshot(call().with_policy(ToolPolicy::NeverRetry))
            .await;
        // A destructive call is not retried even on a refusal: it comes back as the refusal.
        assert!(repeat.unwrap().carried_error().is_some());
        let tools = Backstop::mcp("payments-mcp")
            .no_breaker()
            .build()
            .unwrap()
            .layer(client);
        let repeat = tools.oneshot(call()).await.unwrap();
        assert!(repeat.is_replayed(), "{:?}", repeat.to_json());
        assert!(started.elapsed() >= Duration::from_secs(1));
        first.await.unwrap().unwrap();
        assert_eq!(booked.load(Ordering::SeqCst), 1);
    }
}

/// Each attempt of a tool call carries its time left in `_meta`; the tool server's replay
/// handler makes it the deadline every stack the tool calls inherits, and does not start a call
/// whose time is spent (nor claim its key).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tool_call_carries_its_time_left_and_a_spent_one_is_not_started() {
    use backstop::mcp::{META_TIME_LEFT, codes, rmcp::to_params};
    use rmcp::{
        ServiceError,
        model::{MetaObject, RequestMetaObject},
    };

    let server = RefundServer::start(None).await;
    let client = connect(&server).await;
    let catalog = ToolCatalog::discover(client.peer()).await.unwrap();
    // The attempt timeout is 3 s, the deadline 8 s: an attempt has at most 3 s.
    let tools = payments().build().unwrap().rmcp(client.peer().clone());
    let status = catalog
        .call("order_status", json!({"order": "ORD-7"}))
        .unwrap();
    tools.oneshot(status).await.unwrap();
    let meta = server.tools.seen.lock().unwrap()[0].0.clone();
    let sent = meta[META_TIME_LEFT].as_u64().expect("the time left, in ms");
    assert!(sent > 0 && sent <= 3000, "{sent}");
    let inherited = server.tools.time_left.lock().unwrap()[0].expect("inherited by the tool");
    assert!(inherited <= Duration::from_millis(sent), "{inherited:?}");

    // A keyed refund whose caller's time is spent: refused, not started.
    let keyed = |left: u64| {
        let call = ToolCall::new("issue_refund", json!({"order": "ORD-8", "eur": 5})).unwrap();
        let mut params = to_params(&call);
        let mut meta = serde_json::Map::new();
        meta.insert(META_KEY.to_owned(), json!("spent-refund-1"));
        meta.insert(META_TIME_LEFT.to_owned(), json!(left));
        params.meta = Some(RequestMetaObject(MetaObject(meta)));
        params
    };
    let handled = server.tools.handled.load(Ordering::SeqCst);
    match client.peer().call_tool_once(keyed(0)).await {
        Err(ServiceError::McpError(e)) => {
            assert_eq!(i64::from(e.code.0), codes::DEADLINE_SPENT, "{e:?}")
        }
        other => panic!("a spent call must be refused: {other:?}"),
    }
    assert_eq!(server.tools.handled.load(Ordering::SeqCst), handled);
    assert!(server.tools.refunds().is_empty());
    // Its key was not claimed: with time left the refund is booked, once.
    client.peer().call_tool_once(keyed(5000)).await.unwrap();
    client.peer().call_tool_once(keyed(5000)).await.unwrap();
    assert_eq!(server.tools.refunds().len(), 1);
    client.cancel().await.unwrap();
}
