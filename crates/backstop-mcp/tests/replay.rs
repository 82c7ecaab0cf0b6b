//! The replay contract for tool servers, with the failures in their real form: the tool's
//! effect committed and then the caller's future dropped, a tool that fails without a result,
//! concurrent repeats, and a real Redis store.

use backstop_mcp::{META_KEY, ToolCall, ToolError, ToolReplayLayer, ToolResult, codes};
use backstop_replay::{MemoryStore, Principal, RedisStore};
use serde_json::{Map, Value, json};
use std::{
    sync::{
        Arc,
        atomic::{AtomicU32, Ordering},
    },
    time::Duration,
};
use tower::{Layer, ServiceExt, service_fn, util::BoxCloneSyncService};

type Tool = BoxCloneSyncService<ToolCall, ToolResult, ToolError>;

fn meta(key: Option<&str>) -> Map<String, Value> {
    match key {
        Some(k) => json!({ META_KEY: k }).as_object().cloned().unwrap(),
        None => Map::new(),
    }
}

fn call(key: Option<&str>, eur: u32) -> ToolCall {
    ToolCall::received(
        "issue_refund",
        json!({"order": "ORD-4812", "eur": eur})
            .as_object()
            .cloned(),
        meta(key),
    )
    .unwrap()
}

/// A refund tool that books a refund (counted) after `delay`, then answers as `answer` says.
fn refund_tool(
    booked: Arc<AtomicU32>,
    delay: Duration,
    answer: fn(u32) -> Result<ToolResult, ToolError>,
) -> Tool {
    BoxCloneSyncService::new(service_fn(move |_call: ToolCall| {
        let booked = booked.clone();
        async move {
            tokio::time::sleep(delay).await;
            let n = booked.fetch_add(1, Ordering::SeqCst) + 1;
            answer(n)
        }
    }))
}

fn ok(n: u32) -> Result<ToolResult, ToolError> {
    Ok(ToolResult::text(format!("refund R{n} booked")))
}

fn code(e: &ToolError) -> i64 {
    e.rpc().map_or(0, |r| r.code)
}

#[tokio::test]
async fn a_repeat_gets_the_stored_result_and_the_tool_runs_once() {
    let booked = Arc::new(AtomicU32::new(0));
    let server = ToolReplayLayer::new(MemoryStore::default())
        .single_tenant()
        .layer(refund_tool(booked.clone(), Duration::ZERO, ok));
    let first = server.clone().oneshot(call(Some("k-1"), 40)).await.unwrap();
    let again = server.clone().oneshot(call(Some("k-1"), 40)).await.unwrap();
    assert_eq!(first.joined_text(), "refund R1 booked");
    assert_eq!(again.joined_text(), "refund R1 booked");
    assert!(again.is_replayed() && !first.is_replayed());
    assert_eq!(booked.load(Ordering::SeqCst), 1);

    // The same key for other arguments: refused, as HTTP's 422, and nothing runs.
    let other = server
        .clone()
        .oneshot(call(Some("k-1"), 41))
        .await
        .unwrap_err();
    assert_eq!(code(&other), codes::KEY_REUSED, "{other}");
    // Arguments in another order are the same call.
    let reordered = ToolCall::received(
        "issue_refund",
        json!({"eur": 40, "order": "ORD-4812"}).as_object().cloned(),
        meta(Some("k-1")),
    )
    .unwrap();
    assert!(
        server
            .clone()
            .oneshot(reordered)
            .await
            .unwrap()
            .is_replayed()
    );
    // Another key is another action.
    server.oneshot(call(Some("k-2"), 40)).await.unwrap();
    assert_eq!(booked.load(Ordering::SeqCst), 2);
}

// The paused clock: the caller gives up at 50 ms, the tool ends at 300 ms and the repeat comes
// at 400 ms, whatever else the machine is doing.
#[tokio::test(start_paused = true)]
async fn a_caller_that_gives_up_stops_neither_the_tool_nor_its_record() {
    let booked = Arc::new(AtomicU32::new(0));
    let server = ToolReplayLayer::new(MemoryStore::default())
        .single_tenant()
        .layer(refund_tool(booked.clone(), Duration::from_millis(300), ok));
    // The client's own timeout drops the call while the tool is running.
    let gave_up = tokio::time::timeout(
        Duration::from_millis(50),
        server.clone().oneshot(call(Some("k"), 40)),
    )
    .await;
    assert!(gave_up.is_err());
    // A repeat meanwhile is told to come back, with when.
    let meanwhile = server
        .clone()
        .oneshot(call(Some("k"), 40))
        .await
        .unwrap_err();
    assert_eq!(code(&meanwhile), codes::KEY_IN_FLIGHT, "{meanwhile}");
    assert_eq!(
        meanwhile.rpc().unwrap().retry_after(),
        Some(Duration::from_secs(1))
    );
    let data = meanwhile.rpc().unwrap().data.clone().unwrap();
    assert_eq!(
        (&data["type"], &data["status"]),
        (
            &json!("urn:backstop:problem:request-in-flight"),
            &json!(409)
        ),
        "{data}"
    );
    tokio::time::sleep(Duration::from_millis(400)).await;
    // The tool ran to the end once; the repeat gets its result.
    let again = server.oneshot(call(Some("k"), 40)).await.unwrap();
    assert_eq!(again.joined_text(), "refund R1 booked");
    assert!(again.is_replayed());
    assert_eq!(booked.load(Ordering::SeqCst), 1);
}

#[tokio::test]
async fn a_tool_that_ends_without_a_result_is_never_run_twice() {
    let booked = Arc::new(AtomicU32::new(0));
    let server = ToolReplayLayer::new(MemoryStore::default())
        .single_tenant()
        .layer(refund_tool(booked.clone(), Duration::ZERO, |_| {
            Err(ToolError::Lost(
                "the bank's connection dropped after the transfer".into(),
            ))
        }));
    let _ = server.clone().oneshot(call(Some("k"), 40)).await;
    let again = server.oneshot(call(Some("k"), 40)).await.unwrap_err();
    assert_eq!(code(&again), codes::OUTCOME_UNKNOWN, "{again}");
    assert_eq!(booked.load(Ordering::SeqCst), 1);
}

/// A tool that panics after its effect: its caller and every repeat are told the outcome is
/// unknown, and it is not run again.
#[tokio::test]
async fn a_tool_that_panics_is_told_unknown_and_never_run_twice() {
    let booked = Arc::new(AtomicU32::new(0));
    let server = ToolReplayLayer::new(MemoryStore::default())
        .single_tenant()
        .layer(refund_tool(booked.clone(), Duration::ZERO, |_| {
            panic!("the tool's bug, after the transfer")
        }));
    let first = server
        .clone()
        .oneshot(call(Some("k"), 40))
        .await
        .unwrap_err();
    assert_eq!(code(&first), codes::OUTCOME_UNKNOWN, "{first}");
    assert!(
        first
            .to_string()
            .contains("may or may not have taken effect"),
        "{first}"
    );
    let again = server.oneshot(call(Some("k"), 40)).await.unwrap_err();
    assert_eq!(code(&again), codes::OUTCOME_UNKNOWN, "{again}");
    assert_eq!(booked.load(Ordering::SeqCst), 1);
}

#[tokio::test]
async fn tool_errors_are_replayed_except_an_overload() {
    let booked = Arc::new(AtomicU32::new(0));
    let invalid = ToolReplayLayer::new(MemoryStore::default())
        .single_tenant()
        .layer(refund_tool(booked.clone(), Duration::ZERO, |_| {
            Err(ToolError::Rpc(backstop_mcp::RpcError::new(
                codes::INVALID_PARAMS,
                "eur exceeds the order's total",
            )))
        }));
    for _ in 0..2 {
        let e = invalid
            .clone()
            .oneshot(call(Some("k"), 400))
            .await
            .unwrap_err();
        assert_eq!(code(&e), codes::INVALID_PARAMS);
        assert_eq!(e.rpc().unwrap().message, "eur exceeds the order's total");
    }
    assert_eq!(booked.load(Ordering::SeqCst), 1, "the refusal was stored");

    let busy = Arc::new(AtomicU32::new(0));
    let overloaded = ToolReplayLayer::new(MemoryStore::default())
        .single_tenant()
        .layer(refund_tool(busy.clone(), Duration::ZERO, |_| {
            Err(ToolError::Rpc(backstop_mcp::RpcError::new(
                codes::OVERLOADED,
                "busy",
            )))
        }));
    for _ in 0..2 {
        let e = overloaded
            .clone()
            .oneshot(call(Some("k"), 40))
            .await
            .unwrap_err();
        assert_eq!(code(&e), codes::OVERLOADED, "{e:?}");
    }
    assert_eq!(busy.load(Ordering::SeqCst), 2, "an overload frees the key");
}

#[tokio::test]
async fn principals_never_share_results_and_keys_can_be_required() {
    let booked = Arc::new(AtomicU32::new(0));
    let server = ToolReplayLayer::new(MemoryStore::default()).layer(refund_tool(
        booked.clone(),
        Duration::ZERO,
        ok,
    ));
    let as_ = |who: &str| {
        let mut c = call(Some("same-key"), 40);
        backstop_core::HasExtensions::extensions_mut(&mut c).insert(Principal(who.into()));
        c
    };
    let alice = server.clone().oneshot(as_("alice")).await.unwrap();
    let bob = server.clone().oneshot(as_("bob")).await.unwrap();
    assert!(!bob.is_replayed());
    assert_ne!(alice.joined_text(), bob.joined_text());
    // No principal on a multi-tenant server: refused, nothing runs.
    let nobody = server
        .clone()
        .oneshot(call(Some("k"), 40))
        .await
        .unwrap_err();
    assert_eq!(code(&nobody), codes::REPLAY_MISCONFIGURED, "{nobody}");
    assert_eq!(booked.load(Ordering::SeqCst), 2);

    // Without a key a call runs every time, unless keys are required.
    let open = ToolReplayLayer::new(MemoryStore::default())
        .single_tenant()
        .layer(refund_tool(booked.clone(), Duration::ZERO, ok));
    open.clone().oneshot(call(None, 40)).await.unwrap();
    open.oneshot(call(None, 40)).await.unwrap();
    assert_eq!(booked.load(Ordering::SeqCst), 4);
    let strict = ToolReplayLayer::new(MemoryStore::default())
        .single_tenant()
        .require_key(true)
        .layer(refund_tool(booked.clone(), Duration::ZERO, ok));
    let e = strict.oneshot(call(None, 40)).await.unwrap_err();
    assert_eq!(code(&e), codes::INVALID_PARAMS, "{e}");
    assert_eq!(booked.load(Ordering::SeqCst), 4);
}

#[tokio::test]
async fn on_redis_too_and_an_unreachable_store_runs_nothing() {
    let mut redis = backstop_testkit::RedisServer::start_persistent().await;
    let store = RedisStore::connect(&redis.url(), backstop_replay::OnVolatile::Refuse)
        .await
        .unwrap();
    let booked = Arc::new(AtomicU32::new(0));
    let server = ToolReplayLayer::new(store)
        .single_tenant()
        .layer(refund_tool(booked.clone(), Duration::ZERO, ok));
    server.clone().oneshot(call(Some("k"), 40)).await.unwrap();
    assert!(
        server
            .clone()
            .oneshot(call(Some("k"), 40))
            .await
            .unwrap()
            .is_replayed()
    );
    assert_eq!(booked.load(Ordering::SeqCst), 1);

    redis.kill();
    let e = server.oneshot(call(Some("k-2"), 40)).await.unwrap_err();
    assert_eq!(code(&e), codes::REPLAY_UNAVAILABLE, "{e}");
    assert!(e.rpc().unwrap().retry_after().is_some());
    assert_eq!(booked.load(Ordering::SeqCst), 1, "not run unprotected");
}

/// The tool runs in a task of its own, and within its caller's deadline: the outbound calls it
/// makes through Backstop stacks end by it.
#[tokio::test]
async fn the_tool_runs_within_its_callers_deadline() {
    let seen: Arc<std::sync::Mutex<Vec<Option<backstop_core::Deadline>>>> = Arc::default();
    let saw = seen.clone();
    let server = ToolReplayLayer::new(MemoryStore::default())
        .single_tenant()
        .layer(service_fn(move |_call: ToolCall| {
            saw.lock().unwrap().push(backstop_core::Deadline::current());
            async { Ok::<_, ToolError>(ToolResult::text("ok")) }
        }));
    let deadline = backstop_core::Deadline::after(Duration::from_secs(2));
    deadline
        .scope(server.clone().oneshot(call(Some("k"), 40)))
        .await
        .unwrap();
    // Without a key the tool runs in the caller's own task, within the deadline as well.
    deadline
        .scope(server.oneshot(call(None, 40)))
        .await
        .unwrap();
    assert_eq!(*seen.lock().unwrap(), [Some(deadline), Some(deadline)]);
}

/// A keyed call reaches the tool only once its key is claimed: while it waits for the store it
/// holds none of the tool's capacity (a concurrency limit's permit).
#[tokio::test]
async fn a_call_waiting_for_its_claim_leaves_the_tool_free() {
    use std::task::{Context, Waker};
    use tower::Service;
    let booked = Arc::new(AtomicU32::new(0));
    let tool = refund_tool(booked.clone(), Duration::ZERO, ok);
    let server = ToolReplayLayer::new(MemoryStore::default())
        .single_tenant()
        .layer(tower::limit::ConcurrencyLimit::new(tool, 1));
    let mut cx = Context::from_waker(Waker::noop());
    let mut keyed = server.clone();
    assert!(keyed.poll_ready(&mut cx).is_ready());
    let waiting = keyed.call(call(Some("k-free"), 40));
    let mut other = server.clone();
    assert!(
        other.poll_ready(&mut cx).is_ready(),
        "a call waiting for its claim holds the tool's only permit"
    );
    other.call(call(None, 1)).await.unwrap();
    waiting.await.unwrap();
    assert_eq!(booked.load(Ordering::SeqCst), 2);
}

/// A tool that could not be readied when its turn came was never called: the error goes back,
/// and its key is free for the retry, which runs the tool.
#[tokio::test]
async fn a_tool_that_was_never_ready_leaves_the_key_free() {
    let booked = Arc::new(AtomicU32::new(0));
    // Its readiness fails at the second poll: the layer's own, after the caller's.
    let tool =
        backstop_testkit::NotReadyAt::new(refund_tool(booked.clone(), Duration::ZERO, ok), 2)
            .map_err(ToolError::NotSent);
    let server = ToolReplayLayer::new(MemoryStore::default())
        .single_tenant()
        .layer(tool);
    let first = server.clone().oneshot(call(Some("k-ready"), 40)).await;
    assert!(first.is_err(), "the readiness error goes back");
    assert_eq!(booked.load(Ordering::SeqCst), 0);
    let again = server.oneshot(call(Some("k-ready"), 40)).await.unwrap();
    assert!(
        !again.is_replayed(),
        "the key was freed, not held as unknown"
    );
    assert_eq!(booked.load(Ordering::SeqCst), 1);
}
