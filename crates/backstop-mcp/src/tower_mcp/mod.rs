//! tower-mcp, the tower-native MCP implementation, both ways (feature `tower-mcp`).
//!
//! **Client.** tower-mcp's `McpRouter` is a tower `Service<RouterRequest>`: [`RouterClient`]
//! turns it (or the router under layers of your own) into a service of [`ToolCall`]s for the
//! Backstop stack, for a runtime that hosts its tools in process. The call's key travels in
//! the `RouterRequest`'s extensions, which tower-mcp hands to the tool's `RequestContext`.
//!
//! **Server.** [`PerToolReplayLayer`] is a per-tool layer (`ToolBuilder::..layer(..)`): a call
//! that carries a key runs once and repeats get the stored result, with
//! [`ToolReplayLayer`](crate::ToolReplayLayer)'s guarantees. The layer's own refusals (a call with this key still
//! running, a key reused for other arguments) come back as tool results with `isError: true`
//! (tower-mcp turns a tool layer's errors into those) that carry the JSON-RPC error under
//! `_meta["dev.backstop/error"]`, which [`McpClassifier`](crate::McpClassifier) reads.
//!
//! **Where the key is read.** tower-mcp 0.25 parses `_meta` into a closed struct: keys it does
//! not know (Backstop's included) are dropped before a tool sees them, and its client cannot
//! set them. So with tower-mcp the key is read from the call's extensions only
//! (`backstop_idempotency::IdempotencyKey` in the `RequestContext`'s extensions), never from
//! the arguments. In process, [`RouterClient`] puts it there. Over tower-mcp's HTTP transport,
//! [`KeyFromHeaderLayer`] in front of the transport reads the `Idempotency-Key` header (what
//! rmcp's client sends with [`MetaHeaders`](crate::rmcp::MetaHeaders)) into the HTTP request's
//! extensions, and the transport's `bridge_extension::<IdempotencyKey>()` hands it to the
//! tool:
//!
//! ```no_run
//! # fn example(router: tower_mcp::McpRouter) {
//! use backstop_idempotency::IdempotencyKey;
//! use backstop_mcp::tower_mcp::KeyFromHeaderLayer;
//!
//! let app = tower_mcp::HttpTransport::new(router)
//!     .bridge_extension::<IdempotencyKey>()
//!     .into_router_at("/mcp")
//!     .layer(KeyFromHeaderLayer::new());
//! # let _ = app;
//! # }
//! ```
//!
//! **Trace context.** [`PerToolReplay`] runs the tool in a `tool` span whose parent is the W3C
//! trace context tower-mcp read from the call's `_meta` (see [`crate::trace`]).

use crate::{
    ToolCall, ToolCatalog, ToolError, ToolHints, ToolResult,
    error::{RpcError, codes},
};
#[cfg(feature = "server")]
use backstop_core::HasExtensions;
use backstop_idempotency::IdempotencyKey;
use serde_json::{Value, json};
use std::{
    convert::Infallible,
    fmt,
    future::Future,
    pin::Pin,
    sync::{
        Arc,
        atomic::{AtomicI64, Ordering},
    },
    task::{Context, Poll},
};
use tower::ServiceExt;
use tower_layer::Layer;
use tower_mcp::{
    CallToolResult, McpRouter, RouterRequest, RouterResponse,
    protocol::{McpNotification, McpRequest, McpResponse, RequestId},
};
use tower_service::Service;

#[cfg(feature = "server")]
mod per_tool_replay;
#[cfg(feature = "server")]
pub use per_tool_replay::{PerToolReplay, PerToolReplayError, PerToolReplayLayer};

type BoxFuture<T> = Pin<Box<dyn Future<Output = T> + Send>>;

/// A tower-mcp router (or any `Service<RouterRequest>`) as a service of [`ToolCall`]s.
///
/// ```
/// use backstop_mcp::{ToolCall, tower_mcp::RouterClient};
/// use tower::ServiceExt;
/// use tower_mcp::{CallToolResult, McpRouter, ToolBuilder};
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() {
/// let echo = ToolBuilder::new("echo")
///     .description("Says it back")
///     .handler(|args: serde_json::Value| async move { Ok(CallToolResult::text(args.to_string())) })
///     .build();
/// let router = McpRouter::new().server_info("tools", "1.0").tool(echo);
/// let tools = RouterClient::connect(router).await.unwrap();
/// let call = ToolCall::new("echo", serde_json::json!({"hi": 1})).unwrap();
/// assert_eq!(tools.oneshot(call).await.unwrap().joined_text(), r#"{"hi":1}"#);
/// # }
/// ```
pub struct RouterClient<S> {
    inner: S,
    ids: Arc<AtomicI64>,
}

impl<S: Clone> Clone for RouterClient<S> {
    fn clone(&self) -> Self {
        RouterClient {
            inner: self.inner.clone(),
            ids: self.ids.clone(),
        }
    }
}

impl<S> fmt::Debug for RouterClient<S> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RouterClient").finish_non_exhaustive()
    }
}

impl RouterClient<McpRouter> {
    /// Opens a session on `router` (`initialize`, then `notifications/initialized`) and calls
    /// its tools.
    pub async fn connect(router: McpRouter) -> Result<Self, ToolError> {
        let client = RouterClient::new(router.clone());
        let params = serde_json::from_value(json!({
            "protocolVersion": "2025-11-25",
            "capabilities": {},
            "clientInfo": { "name": "backstop", "version": env!("CARGO_PKG_VERSION") }
        }))
        .map_err(|e| ToolError::NotSent(Box::new(e)))?;
        let res = router
            .clone()
            .oneshot(RouterRequest::new(
                client.next_id(),
                McpRequest::Initialize(params),
            ))
            .await
            .unwrap_or_else(|never| match never {});
        if let Err(e) = res.inner {
            return Err(ToolError::Rpc(from_jsonrpc(&e)));
        }
        router.handle_notification(McpNotification::Initialized);
        Ok(client)
    }
}

impl<S> RouterClient<S> {
    /// Calls tools through `inner`, a router whose session is open (for example one that
    /// [`connect`](RouterClient::connect) opened, under layers of your own).
    pub fn new(inner: S) -> Self {
        RouterClient {
            inner,
            ids: Arc::new(AtomicI64::new(1)),
        }
    }

    /// Lists the router's tools (every page) and keeps their annotations.
    pub async fn catalog(&self) -> Result<ToolCatalog, ToolError>
    where
        S: Service<RouterRequest, Response = RouterResponse, Error = Infallible> + Clone,
    {
        let mut tools = Vec::new();
        let mut cursor: Option<String> = None;
        loop {
            let params = serde_json::from_value(match &cursor {
                Some(c) => json!({ "cursor": c }),
                None => json!({}),
            })
            .map_err(|e| ToolError::NotSent(Box::new(e)))?;
            let req = RouterRequest::new(self.next_id(), McpRequest::ListTools(params));
            let res = self
                .inner
                .clone()
                .oneshot(req)
                .await
                .unwrap_or_else(|never| match never {});
            let listed = match res.inner {
                Ok(McpResponse::ListTools(listed)) => {
                    serde_json::to_value(&listed).map_err(|e| ToolError::Lost(Box::new(e)))?
                }
                Ok(_) => {
                    return Err(ToolError::Lost(
                        "tools/list got another kind of answer".into(),
                    ));
                }
                Err(e) => return Err(ToolError::Rpc(from_jsonrpc(&e))),
            };
            for tool in listed["tools"].as_array().into_iter().flatten() {
                if let Some(name) = tool["name"].as_str() {
                    let hints = ToolHints::from_json(&tool["annotations"]);
                    tools.push((name.to_owned(), hints));
                }
            }
            cursor = listed["nextCursor"].as_str().map(str::to_owned);
            if cursor.is_none() {
                return Ok(ToolCatalog::new(tools));
            }
        }
    }

    fn next_id(&self) -> RequestId {
        RequestId::Number(self.ids.fetch_add(1, Ordering::Relaxed))
    }
}

impl<S> Service<ToolCall> for RouterClient<S>
where
    S: Service<RouterRequest, Response = RouterResponse, Error = Infallible>
        + Clone
        + Send
        + 'static,
    S::Future: Send + 'static,
{
    type Response = ToolResult;
    type Error = ToolError;
    type Future = BoxFuture<Result<ToolResult, ToolError>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), ToolError>> {
        self.inner.poll_ready(cx).map_err(|never| match never {})
    }

    fn call(&mut self, call: ToolCall) -> Self::Future {
        let params = serde_json::from_value(json!({
            "name": call.name(),
            "arguments": Value::Object(call.arguments().clone()),
        }));
        let params = match params {
            Ok(p) => p,
            Err(e) => return Box::pin(async move { Err(ToolError::NotSent(Box::new(e))) }),
        };
        let mut req = RouterRequest::new(self.next_id(), McpRequest::CallTool(params));
        if let Some(key) = call.key() {
            req.extensions.insert(key.clone());
        }
        #[cfg(feature = "server")]
        if let Some(principal) = call.extensions().get::<backstop_replay::Principal>() {
            req.extensions.insert(principal.clone());
        }
        let fut = self.inner.call(req);
        Box::pin(async move {
            let res = fut.await.unwrap_or_else(|never| match never {});
            match res.inner {
                Ok(McpResponse::CallTool(result)) => from_result(&result),
                Ok(_) => Err(ToolError::Lost(
                    "the router answered a tools/call with another kind of response".into(),
                )),
                Err(e) => Err(ToolError::Rpc(from_jsonrpc(&e))),
            }
        })
    }
}

fn from_jsonrpc(e: &impl serde::Serialize) -> RpcError {
    serde_json::to_value(e)
        .ok()
        .and_then(|v| RpcError::from_json(&v))
        .unwrap_or_else(|| RpcError::new(codes::INTERNAL_ERROR, "an unreadable JSON-RPC error"))
}

/// tower-mcp's result as a [`ToolResult`].
pub fn from_result(result: &CallToolResult) -> Result<ToolResult, ToolError> {
    let json = serde_json::to_value(result)
        .map_err(|e| ToolError::Lost(format!("the tool's result could not be read: {e}").into()))?;
    ToolResult::from_json(json)
}

/// A [`ToolResult`] as tower-mcp's result.
pub fn to_result(result: &ToolResult) -> CallToolResult {
    serde_json::from_value(result.to_json()).unwrap_or_else(|e| {
        CallToolResult::error(format!("a stored tool result could not be read: {e}"))
    })
}

/// Reads an HTTP request's `Idempotency-Key` header (or another) into its extensions as an
/// [`IdempotencyKey`], for tower-mcp's HTTP transport to bridge to the tool (see the
/// [module docs](self)). A header that is not a valid key is refused with `400 Bad Request`
/// before anything runs: a caller who sent a key expects it to count.
#[derive(Clone, Debug)]
pub struct KeyFromHeaderLayer {
    header: http::HeaderName,
}

impl Default for KeyFromHeaderLayer {
    fn default() -> Self {
        KeyFromHeaderLayer::new()
    }
}

impl KeyFromHeaderLayer {
    /// Reads `Idempotency-Key`.
    pub fn new() -> Self {
        KeyFromHeaderLayer {
            header: http::HeaderName::from_static("idempotency-key"),
        }
    }

    /// Reads `header` instead.
    #[must_use]
    pub fn header(mut self, header: http::HeaderName) -> Self {
        self.header = header;
        self
    }
}

impl<S> Layer<S> for KeyFromHeaderLayer {
    type Service = KeyFromHeader<S>;

    fn layer(&self, inner: S) -> KeyFromHeader<S> {
        KeyFromHeader {
            inner,
            header: self.header.clone(),
        }
    }
}

/// The service of [`KeyFromHeaderLayer`].
#[derive(Clone, Debug)]
pub struct KeyFromHeader<S> {
    inner: S,
    header: http::HeaderName,
}

impl<S, B, ResB> Service<http::Request<B>> for KeyFromHeader<S>
where
    S: Service<http::Request<B>, Response = http::Response<ResB>>,
    S::Future: Send + 'static,
    S::Error: Send + 'static,
    ResB: Default + Send + 'static,
{
    type Response = http::Response<ResB>;
    type Error = S::Error;
    type Future = BoxFuture<Result<http::Response<ResB>, S::Error>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), S::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, mut req: http::Request<B>) -> Self::Future {
        if let Some(value) = req.headers().get(&self.header) {
            match IdempotencyKey::from_header(value) {
                Ok(key) => {
                    req.extensions_mut().insert(key);
                }
                Err(_) => {
                    let mut res = http::Response::new(ResB::default());
                    *res.status_mut() = http::StatusCode::BAD_REQUEST;
                    return Box::pin(std::future::ready(Ok(res)));
                }
            }
        }
        Box::pin(self.inner.call(req))
    }
}
