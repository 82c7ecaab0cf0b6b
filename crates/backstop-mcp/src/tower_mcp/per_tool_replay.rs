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

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), ToolError>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, mut call: ToolCall) -> Self::Future {
        let received = call.extensions_mut().remove::<Received>();
        let inner = self.inner.clone();
        Box::pin(async move {
            let Some(Received(req)) = received else {
                return Err(ToolError::Lost(
                    "the tool call lost its tower-mcp request".into(),
                ));
            };
            match inner.oneshot(req).await {
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

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), PerToolReplayError>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, req: ToolRequest) -> Self::Future {
        use tracing::Instrument;
        let span = crate::trace::tool_span(&self.tool, &trace_meta(&req));
        let key = req.ctx.extensions().get::<IdempotencyKey>().cloned();
        let Some(key) = key else {
            // No key: the tool runs as it would without the layer.
            let direct = self.direct.clone();
            return Box::pin(
                async move {
                    direct
                        .oneshot(req)
                        .await
                        .map_err(|e| PerToolReplayError(e.to_string()))
                }
                .instrument(span),
            );
        };
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
