//! Replay for one tower-mcp tool (feature `server`).

use super::{from_result, to_result};
use crate::{
    META_ERROR, ToolCall, ToolError, ToolReplay, ToolReplayLayer, ToolResult,
    error::{RpcError, codes},
};
use backstop_core::HasExtensions;
use backstop_idempotency::IdempotencyKey;
use backstop_replay::Principal;
use serde_json::{Map, Value};
use std::{
    fmt,
    future::Future,
    pin::Pin,
    sync::Arc,
    task::{Context, Poll},
};
use tower::ServiceExt;
use tower_layer::Layer;
use tower_mcp::{CallToolResult, ToolRequest};
use tower_service::Service;

type BoxFuture<T> = Pin<Box<dyn Future<Output = T> + Send>>;

/// The replay layer's refusal as a tool result that says what it is: `isError: true`, the
/// message as text, and the JSON-RPC error under `_meta["dev.backstop/error"]`.
fn refusal(e: &RpcError) -> CallToolResult {
    let mut meta = Map::new();
    meta.insert(META_ERROR.to_owned(), e.to_json());
    let result = ToolResult {
        meta,
        ..ToolResult::error_text(e.message.clone())
    };
    to_result(&result)
}

/// A per-tool layer for tower-mcp's `ToolBuilder::layer`: keyed calls of the tool run once.
///
/// ```
/// use backstop_mcp::{ToolReplayLayer, tower_mcp::PerToolReplayLayer};
/// use backstop_replay::MemoryStore;
/// use tower_mcp::{CallToolResult, ToolBuilder};
///
/// let replay = ToolReplayLayer::new(MemoryStore::default()).single_tenant();
/// let refund = ToolBuilder::new("issue_refund")
///     .description("Refund part of an order")
///     .handler(|args: serde_json::Value| async move { Ok(CallToolResult::text(format!("booked {args}"))) })
///     .layer(PerToolReplayLayer::new("issue_refund", replay))
///     .build();
/// # let _ = refund;
/// ```
#[derive(Clone, Debug)]
pub struct PerToolReplayLayer {
    tool: Arc<str>,
    replay: ToolReplayLayer,
}

impl PerToolReplayLayer {
    /// Replay for the tool named `tool` (the name is part of what a key stands for).
    pub fn new(tool: impl Into<Arc<str>>, replay: ToolReplayLayer) -> Self {
        PerToolReplayLayer {
            tool: tool.into(),
            replay,
        }
    }
}

impl<S> Layer<S> for PerToolReplayLayer
where
    S: Clone,
{
    type Service = PerToolReplay<S>;

    fn layer(&self, inner: S) -> PerToolReplay<S> {
        PerToolReplay {
            tool: self.tool.clone(),
            direct: inner.clone(),
            replay: self.replay.layer(RunToolRequest { inner }),
        }
    }
}

/// A tower-mcp tool behind [`PerToolReplayLayer`].
#[derive(Clone)]
pub struct PerToolReplay<S> {
    tool: Arc<str>,
    direct: S,
    replay: ToolReplay<RunToolRequest<S>>,
}

impl<S> fmt::Debug for PerToolReplay<S> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PerToolReplay")
            .field("tool", &self.tool)
            .finish_non_exhaustive()
    }
}

/// The request a replayed tool runs with, carried through the replay layer.
#[derive(Clone)]
struct Received(ToolRequest);

#[derive(Clone)]
struct RunToolRequest<S> {
    inner: S,
}

impl<S> Service<ToolCall> for RunToolRequest<S>
where
    S: Service<ToolRequest, Response = CallToolResult> + Clone + Send + 'static,
    S::Error: fmt::Display,
    S::Future: Send + 'static,
{
    type Response = ToolResult;
    type Error = ToolError;
    type Future = BoxFuture<Result<ToolResult, ToolError>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), ToolError>> {
        // A tool that cannot take the call was never called.
        self.inner
            .poll_ready(cx)
            .map_err(|e| ToolError::NotSent(e.to_string().into()))
    }

    fn call(&mut self, mut call: ToolCall) -> Self::Future {
        // The handle polled ready runs the tool; a clone stays for the next call.
        let clone = self.inner.clone();
        let mut ready = std::mem::replace(&mut self.inner, clone);
        let Some(Received(req)) = call.extensions_mut().remove::<Received>() else {
            return Box::pin(async {
                Err(ToolError::Lost(
                    "the tool call lost its tower-mcp request".into(),
                ))
            });
        };
        let ran = ready.call(req);
        Box::pin(async move {
            match ran.await {
                Ok(result) => from_result(&result),
                // The tool failed without a result: its outcome is unknown.
                Err(e) => Err(ToolError::Lost(e.to_string().into())),
            }
        })
    }
}

/// A failure of the replayed tool, as tower-mcp reports a layer's errors (a tool result with
/// `isError: true` and this text).
#[derive(Debug)]
pub struct PerToolReplayError(String);

impl fmt::Display for PerToolReplayError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for PerToolReplayError {}

impl<S> Service<ToolRequest> for PerToolReplay<S>
where
    S: Service<ToolRequest, Response = CallToolResult> + Clone + Send + 'static,
    S::Error: fmt::Display,
    S::Future: Send + 'static,
{
    type Response = CallToolResult;
    type Error = PerToolReplayError;
    type Future = BoxFuture<Result<CallToolResult, PerToolReplayError>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), PerToolReplayError>> {
        self.direct
            .poll_ready(cx)
            .map_err(|e| PerToolReplayError(e.to_string()))
    }

    fn call(&mut self, req: ToolRequest) -> Self::Future {
        use tracing::Instrument;
        let span = crate::trace::tool_span(&self.tool, &trace_meta(&req));
        // The handle polled ready goes with the call; a clone stays for the next one.
        let clone = self.direct.clone();
        let mut ready = std::mem::replace(&mut self.direct, clone);
        let key = req.ctx.extensions().get::<IdempotencyKey>().cloned();
        let Some(key) = key else {
            // No key: the tool runs as it would without the layer.
            let ran = ready.call(req);
            return Box::pin(
                async move { ran.await.map_err(|e| PerToolReplayError(e.to_string())) }
                    .instrument(span),
            );
        };
        // A keyed call reaches the tool only once its key is claimed, or never (a replay): the
        // readiness granted goes back at once, and the replay readies a handle of its own when
        // the tool's turn comes.
        drop(ready);
        let arguments = match &req.args {
            Value::Object(map) => Some(map.clone()),
            _ => None,
        };
        let principal = req.ctx.extensions().get::<Principal>().cloned();
        let call = ToolCall::received(self.tool.to_string(), arguments, Map::new());
        let replay = self.replay.clone();
        Box::pin(
            async move {
                let mut call = match call {
                    Ok(call) => call.with_key(key),
                    Err(e) => return Ok(refusal(&rpc_of(e))),
                };
                if let Some(principal) = principal {
                    call.extensions_mut().insert(principal);
                }
                call.extensions_mut().insert(Received(req));
                match replay.oneshot(call).await {
                    Ok(result) => Ok(to_result(&result)),
                    Err(e) => Ok(refusal(&rpc_of(e))),
                }
            }
            .instrument(span),
        )
    }
}

/// The W3C trace context tower-mcp read from the call's `_meta`, as `_meta` entries.
fn trace_meta(req: &ToolRequest) -> Map<String, Value> {
    req.ctx
        .trace_context()
        .map(|t| {
            t.entries()
                .map(|(k, v)| (k.to_owned(), Value::String(v)))
                .collect()
        })
        .unwrap_or_default()
}

fn rpc_of(e: ToolError) -> RpcError {
    match e {
        ToolError::Rpc(rpc) => rpc,
        other => RpcError::new(codes::INTERNAL_ERROR, other.to_string()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use backstop_replay::MemoryStore;
    use std::sync::atomic::{AtomicU32, Ordering};
    use tokio::sync::Semaphore;
    use tower::limit::ConcurrencyLimit;
    use tower_mcp::{context::RequestContext, protocol::RequestId};

    /// A tool that takes one call at a time (a concurrency limit of one) and answers each call
    /// once `gate` gives it a permit, counting the calls it ran.
    fn tool(
        gate: Arc<Semaphore>,
        ran: Arc<AtomicU32>,
    ) -> impl Service<ToolRequest, Response = CallToolResult, Error = tower::BoxError, Future: Send>
    + Clone
    + Send
    + 'static {
        ConcurrencyLimit::new(
            tower::service_fn(move |_req: ToolRequest| {
                let (gate, ran) = (gate.clone(), ran.clone());
                async move {
                    gate.acquire().await.unwrap().forget();
                    ran.fetch_add(1, Ordering::SeqCst);
                    Ok::<_, tower::BoxError>(CallToolResult::text("booked"))
                }
            }),
            1,
        )
    }

    fn request(key: Option<&str>) -> ToolRequest {
        let mut ctx = RequestContext::new(RequestId::Number(1));
        if let Some(key) = key {
            ctx.extensions_mut()
                .insert(IdempotencyKey::new(key).unwrap());
        }
        ToolRequest::new(ctx, serde_json::json!({"order": "ORD-1"}))
    }

    /// The layer answers readiness as the tool does: while a call holds the tool's only permit,
    /// keyed or not, the layer is not ready; once it ends, it is, and each call runs on the
    /// handle polled ready (a concurrency limit panics on a call it gave no permit for).
    #[tokio::test]
    async fn readiness_is_the_tools_own_and_each_call_runs_on_the_handle_polled_ready() {
        let (gate, ran) = (Arc::new(Semaphore::new(0)), Arc::new(AtomicU32::new(0)));
        let replay = ToolReplayLayer::new(MemoryStore::default()).single_tenant();
        let svc =
            PerToolReplayLayer::new("issue_refund", replay).layer(tool(gate.clone(), ran.clone()));
        let mut cx = Context::from_waker(std::task::Waker::noop());
        for key in [Some("refund-ORD-1"), None] {
            let first = tokio::spawn(svc.clone().oneshot(request(key)));
            // Once the first call holds the tool's permit, the layer is not ready.
            let mut held = false;
            for _ in 0..1_000 {
                let mut other = svc.clone();
                if other.poll_ready(&mut cx).is_pending() {
                    held = true;
                    break;
                }
                drop(other);
                tokio::task::yield_now().await;
            }
            assert!(held, "{key:?}: ready while the tool's only permit is held");
            gate.add_permits(1);
            assert!(!first.await.unwrap().unwrap().is_error, "{key:?}");
            let mut next = svc.clone();
            std::future::poll_fn(|cx| next.poll_ready(cx))
                .await
                .unwrap();
            gate.add_permits(1);
            next.call(request(None)).await.unwrap();
        }
        assert_eq!(ran.load(Ordering::SeqCst), 4);
    }
}
