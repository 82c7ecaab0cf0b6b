//! rmcp, the official Rust SDK, both ways (feature `rmcp`).
//!
//! **Client.** [`RmcpClient`] is an rmcp client's `call_tool` as a tower service of
//! [`ToolCall`]s: put the Backstop stack on it (`Backstop::mcp(..).build()?.layer(..)` in the
//! facade, or `BackstopLayer::rmcp(peer)`). Each attempt sends the call's key in `_meta`;
//! rmcp's errors become [`ToolError`]s that say whether the call left. [`ToolCatalog`] reads
//! the server's tool annotations once (`ToolCatalog::discover`), so each call gets its tool's
//! policy.
//!
//! **Server.** [`ReplayHandler`] wraps any rmcp `ServerHandler` (one made with the
//! `#[tool_router]` macros too): a `tools/call` whose `_meta` carries a key goes through
//! [`ToolReplayLayer`](crate::ToolReplayLayer); everything else (calls without a key, follow-up rounds of a tool that
//! asked for input, every other method) goes to the handler untouched.
//!
//! The key is read from rmcp's `RequestContext::meta`, where rmcp moves a request's `_meta` on
//! the server: never from the tool's arguments.

use crate::{
    META_KEY, ToolCall, ToolCatalog, ToolError, ToolHints, ToolResult,
    error::{RpcError, codes},
};
use backstop_classify::classify_error;
use backstop_core::{Outcome, ReplyLost, Verdict};
use backstop_idempotency::{IdempotencyKey, KeyFormat};
use http::{HeaderName, HeaderValue};
use rmcp::transport::{
    common::client_side_sse::BoxedSseResponse,
    streamable_http_client::{
        StreamableHttpClient, StreamableHttpError, StreamableHttpPostResponse,
        StreamableHttpResponseLimits,
    },
};
use rmcp::{ErrorData as McpError, RoleClient, ServiceError, model::*, service::Peer};
use std::{
    collections::HashMap,
    fmt,
    future::Future,
    pin::Pin,
    sync::Arc,
    task::{Context, Poll},
};
use tower_service::Service;

#[cfg(feature = "server")]
mod replay_handler;
#[cfg(feature = "server")]
pub use replay_handler::ReplayHandler;

type BoxFuture<T> = Pin<Box<dyn Future<Output = T> + Send>>;

/// An rmcp client's `call_tool` as a tower service.
///
/// ```no_run
/// # async fn example(peer: rmcp::service::Peer<rmcp::RoleClient>) -> Result<(), backstop_mcp::ToolError> {
/// use backstop_mcp::{ToolCall, rmcp::RmcpClient};
/// use tower::ServiceExt;
///
/// let tools = RmcpClient::new(peer);
/// let call = ToolCall::new("search_orders", serde_json::json!({"customer": "C-17"}))?;
/// let result = tools.oneshot(call).await?;
/// println!("{}", result.joined_text());
/// # Ok(()) }
/// ```
#[derive(Clone)]
pub struct RmcpClient {
    peer: Peer<RoleClient>,
}

impl fmt::Debug for RmcpClient {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RmcpClient").finish_non_exhaustive()
    }
}

impl RmcpClient {
    /// Calls tools through `peer` (a running rmcp client's `peer()`, or the client itself
    /// dereferenced).
    pub fn new(peer: Peer<RoleClient>) -> Self {
        RmcpClient { peer }
    }

    /// The peer.
    pub fn peer(&self) -> &Peer<RoleClient> {
        &self.peer
    }
}

impl Service<ToolCall> for RmcpClient {
    type Response = ToolResult;
    type Error = ToolError;
    type Future = BoxFuture<Result<ToolResult, ToolError>>;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), ToolError>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, call: ToolCall) -> Self::Future {
        let mut params = to_params(&call);
        // This attempt's trace context (the retry layer calls inside the attempt's span).
        let mut meta = params.meta.take().map(|m| m.0.0).unwrap_or_default();
        crate::trace::inject_current(&mut meta);
        // This attempt's time left, for the tool server to stop when the caller does.
        if let Some(ms) = backstop_core::Deadline::time_left_ms(&call) {
            meta.insert(crate::META_TIME_LEFT.to_owned(), ms.into());
        }
        if !meta.is_empty() {
            params.meta = Some(RequestMetaObject(MetaObject(meta)));
        }
        let peer = self.peer.clone();
        // Dropping the future (an attempt timeout) cancels the request: rmcp tells the server.
        Box::pin(async move {
            let response = peer
                .call_tool_once(params)
                .await
                .map_err(from_service_error)?;
            from_rmcp_response(response)
        })
    }
}

/// The call as rmcp's parameters, with the key in `_meta`.
pub fn to_params(call: &ToolCall) -> CallToolRequestParams {
    let mut params = CallToolRequestParams::new(call.name().to_owned());
    params.arguments = Some(call.arguments().clone());
    let meta = call.wire_meta();
    if !meta.is_empty() {
        params.meta = Some(RequestMetaObject(MetaObject(meta)));
    }
    params
}

/// rmcp's error as a [`ToolError`]: the server's JSON-RPC error as it is; an HTTP status the
/// server answered without a JSON-RPC message as that status (rmcp's `HttpStatusError`, as its
/// reqwest client reports it: feature `rmcp-reqwest`); a transport failure as not sent when its
/// cause shows the call never left (a refused connection), else as lost.
pub fn from_service_error(e: ServiceError) -> ToolError {
    match e {
        ServiceError::McpError(data) => ToolError::Rpc(from_error_data(data)),
        ServiceError::TransportSend(t) if http_status(&*t.error).is_some() => {
            let answered = http_status(&*t.error).expect("checked by the guard");
            ToolError::Status {
                status: http::StatusCode::from_u16(answered.status)
                    .unwrap_or(http::StatusCode::BAD_GATEWAY),
                retry_after: answered.retry_after.clone(),
            }
        }
        ServiceError::TransportSend(t) => {
            let never_left = matches!(
                classify_error(&t),
                Some(Verdict::Retryable {
                    outcome: Outcome::NotSent,
                    ..
                })
            );
            // The transport's own error, without rmcp's wrapper (whose text is a type name).
            if never_left {
                ToolError::NotSent(t.error)
            } else {
                ToolError::Lost(Box::new(ReplyLost::new(t.error)))
            }
        }
        other => ToolError::Lost(Box::new(ReplyLost::new(other))),
    }
}

/// The HTTP status rmcp's streamable HTTP client reports in `error`'s chain, if any: a custom
/// client's boxed `HttpStatusError`, or the reqwest client's (feature `rmcp-reqwest`).
fn http_status<'a>(
    error: &'a (dyn std::error::Error + 'static),
) -> Option<&'a rmcp::transport::streamable_http_client::HttpStatusError> {
    #[cfg(feature = "rmcp-reqwest")]
    type ReqwestError =
        rmcp::transport::streamable_http_client::StreamableHttpError<reqwest::Error>;
    let mut current = Some(error);
    while let Some(e) = current {
        if let Some(status) = e.downcast_ref() {
            return Some(status);
        }
        #[cfg(feature = "rmcp-reqwest")]
        if let Some(ReqwestError::HttpStatus(status)) = e.downcast_ref() {
            return Some(status);
        }
        current = e.source();
    }
    None
}

/// rmcp's error object as an [`RpcError`].
pub fn from_error_data(data: McpError) -> RpcError {
    RpcError {
        code: i64::from(data.code.0),
        message: data.message.into_owned(),
        data: data.data,
    }
}

/// An [`RpcError`] as rmcp's error object.
pub fn to_error_data(e: &RpcError) -> McpError {
    McpError::new(
        ErrorCode(i32::try_from(e.code).unwrap_or(codes::INTERNAL_ERROR as i32)),
        e.message.clone(),
        e.data.clone(),
    )
}

/// rmcp's answer to a `tools/call` as a [`ToolResult`]: a result, or the task a long-running
/// tool started (MCP's tasks extension). A tool that asks for more input first cannot be
/// replayed: its answer depends on a conversation, not on the call.
pub fn from_rmcp_response(response: CallToolResponse) -> Result<ToolResult, ToolError> {
    match response {
        CallToolResponse::Complete(result) => from_rmcp_result(result),
        CallToolResponse::Task(task) => {
            let json = serde_json::to_value(&task).map_err(|e| {
                ToolError::Lost(format!("the tool's task could not be read: {e}").into())
            })?;
            ToolResult::from_json(json)
        }
        _ => Err(ToolError::Rpc(RpcError::new(
            codes::INTERNAL_ERROR,
            "the tool asked for more input on a call with an idempotency key: replay covers \
             tools that answer with a result or a task",
        ))),
    }
}

/// A [`ToolResult`] as rmcp's answer to a `tools/call`: the task, when the tool started one.
pub fn to_rmcp_response(result: &ToolResult) -> Result<CallToolResponse, McpError> {
    if result.task.is_none() {
        return to_rmcp_result(result).map(CallToolResponse::Complete);
    }
    serde_json::from_value::<CreateTaskResult>(result.to_json())
        .map(CallToolResponse::Task)
        .map_err(|e| {
            McpError::internal_error(format!("a stored task could not be read: {e}"), None)
        })
}

/// rmcp's result as a [`ToolResult`].
pub fn from_rmcp_result(result: CallToolResult) -> Result<ToolResult, ToolError> {
    let json = serde_json::to_value(&result)
        .map_err(|e| ToolError::Lost(format!("the tool's result could not be read: {e}").into()))?;
    ToolResult::from_json(json)
}

/// A [`ToolResult`] as rmcp's result.
pub fn to_rmcp_result(result: &ToolResult) -> Result<CallToolResult, McpError> {
    serde_json::from_value(result.to_json()).map_err(|e| {
        McpError::internal_error(format!("a stored tool result could not be read: {e}"), None)
    })
}

/// A tool's annotations as [`ToolHints`].
pub fn hints_of(tool: &Tool) -> ToolHints {
    match &tool.annotations {
        // Annotations that leave a hint out mean MCP's default for it (see `ToolHints::from_json`).
        Some(a) => ToolHints {
            read_only: Some(a.read_only_hint.unwrap_or(false)),
            destructive: Some(a.destructive_hint.unwrap_or(true)),
            idempotent: Some(a.idempotent_hint.unwrap_or(false)),
            open_world: Some(a.open_world_hint.unwrap_or(true)),
        },
        None => ToolHints::default(),
    }
}

impl ToolCatalog {
    /// Lists an rmcp server's tools (every page) and keeps their annotations.
    ///
    /// ```no_run
    /// # async fn example(peer: rmcp::service::Peer<rmcp::RoleClient>) -> Result<(), backstop_mcp::ToolError> {
    /// use backstop_mcp::{ToolCatalog, ToolPolicy};
    ///
    /// let catalog = ToolCatalog::discover(&peer).await?;
    /// let refund = catalog.call("issue_refund", serde_json::json!({"order": "ORD-4812"}))?;
    /// // The server annotated it `destructiveHint: true`: one attempt, never repeated by the stack.
    /// assert_eq!(refund.policy(), ToolPolicy::NeverRetry);
    /// # Ok(()) }
    /// ```
    pub async fn discover(peer: &Peer<RoleClient>) -> Result<Self, ToolError> {
        let tools = peer.list_all_tools().await.map_err(from_service_error)?;
        Ok(ToolCatalog::new(
            tools.iter().map(|t| (t.name.to_string(), hints_of(t))),
        ))
    }
}

/// rmcp's streamable HTTP client (`reqwest::Client`, or any other `StreamableHttpClient`) that
/// also sends what a `tools/call`'s `_meta` says as HTTP headers, for servers and gateways that
/// read headers rather than `_meta` (tower-mcp's HTTP transport drops what `_meta` keys it does
/// not know): its key as `Idempotency-Key`, its time left as `backstop-time-left-ms`
/// ([`TIME_LEFT_HEADER`](backstop_core::TIME_LEFT_HEADER), which `CallerDeadlineLayer` reads).
///
/// ```no_run
/// use backstop_mcp::rmcp::MetaHeaders;
/// use rmcp::transport::{StreamableHttpClientTransport, streamable_http_client::{StreamableHttpClient, StreamableHttpClientTransportConfig}};
///
/// // `http_client`: rmcp's reqwest client (`reqwest::Client`, rmcp's feature
/// // `transport-streamable-http-client-reqwest`), or one of your own.
/// fn transport<C: StreamableHttpClient>(http_client: C) -> StreamableHttpClientTransport<MetaHeaders<C>> {
///     StreamableHttpClientTransport::with_client(
///         MetaHeaders::new(http_client),
///         StreamableHttpClientTransportConfig::with_uri("http://127.0.0.1:8080/mcp"),
///     )
/// }
/// ```
#[derive(Clone, Debug, Default)]
pub struct MetaHeaders<C> {
    inner: C,
}

impl<C> MetaHeaders<C> {
    /// Sends through `inner`.
    pub fn new(inner: C) -> Self {
        MetaHeaders { inner }
    }
}

/// Adds the `Idempotency-Key` header when `message` is a `tools/call` whose `_meta` carries a
/// key, and the time-left header when it carries its time left.
fn meta_headers(message: &ClientJsonRpcMessage, headers: &mut HashMap<HeaderName, HeaderValue>) {
    let ClientJsonRpcMessage::Request(_) = message else {
        return;
    };
    let Ok(json) = serde_json::to_value(message) else {
        return;
    };
    if json["method"] != "tools/call" {
        return;
    }
    let meta = &json["params"]["_meta"];
    let key = meta[META_KEY]
        .as_str()
        .or_else(|| meta[crate::META_KEY_ALIAS].as_str());
    if let Some(key) = key.and_then(|k| IdempotencyKey::new(k).ok()) {
        headers.insert(
            HeaderName::from_static("idempotency-key"),
            key.header_value(KeyFormat::Plain),
        );
    }
    if let Some(ms) = meta[crate::META_TIME_LEFT].as_u64() {
        headers.insert(backstop_core::TIME_LEFT_HEADER, HeaderValue::from(ms));
    }
}

impl<C: StreamableHttpClient> StreamableHttpClient for MetaHeaders<C> {
    type Error = C::Error;

    fn post_message(
        &self,
        uri: Arc<str>,
        message: ClientJsonRpcMessage,
        session_id: Option<Arc<str>>,
        auth_header: Option<String>,
        mut custom_headers: HashMap<HeaderName, HeaderValue>,
    ) -> impl Future<Output = Result<StreamableHttpPostResponse, StreamableHttpError<Self::Error>>>
    + Send
    + '_ {
        meta_headers(&message, &mut custom_headers);
        self.inner
            .post_message(uri, message, session_id, auth_header, custom_headers)
    }

    fn post_message_with_max_sse_event_size(
        &self,
        uri: Arc<str>,
        message: ClientJsonRpcMessage,
        session_id: Option<Arc<str>>,
        auth_header: Option<String>,
        mut custom_headers: HashMap<HeaderName, HeaderValue>,
        max_sse_event_size: usize,
    ) -> impl Future<Output = Result<StreamableHttpPostResponse, StreamableHttpError<Self::Error>>>
    + Send
    + '_ {
        meta_headers(&message, &mut custom_headers);
        self.inner.post_message_with_max_sse_event_size(
            uri,
            message,
            session_id,
            auth_header,
            custom_headers,
            max_sse_event_size,
        )
    }

    fn post_message_with_response_limits(
        &self,
        uri: Arc<str>,
        message: ClientJsonRpcMessage,
        session_id: Option<Arc<str>>,
        auth_header: Option<String>,
        mut custom_headers: HashMap<HeaderName, HeaderValue>,
        limits: StreamableHttpResponseLimits,
    ) -> impl Future<Output = Result<StreamableHttpPostResponse, StreamableHttpError<Self::Error>>>
    + Send
    + '_ {
        meta_headers(&message, &mut custom_headers);
        self.inner.post_message_with_response_limits(
            uri,
            message,
            session_id,
            auth_header,
            custom_headers,
            limits,
        )
    }

    fn delete_session(
        &self,
        uri: Arc<str>,
        session_id: Arc<str>,
        auth_header: Option<String>,
        custom_headers: HashMap<HeaderName, HeaderValue>,
    ) -> impl Future<Output = Result<(), StreamableHttpError<Self::Error>>> + Send + '_ {
        self.inner
            .delete_session(uri, session_id, auth_header, custom_headers)
    }

    fn get_stream(
        &self,
        uri: Arc<str>,
        session_id: Option<Arc<str>>,
        last_event_id: Option<String>,
        auth_header: Option<String>,
        custom_headers: HashMap<HeaderName, HeaderValue>,
    ) -> impl Future<Output = Result<BoxedSseResponse, StreamableHttpError<Self::Error>>> + Send + '_
    {
        self.inner
            .get_stream(uri, session_id, last_event_id, auth_header, custom_headers)
    }

    fn get_stream_with_max_sse_event_size(
        &self,
        uri: Arc<str>,
        session_id: Option<Arc<str>>,
        last_event_id: Option<String>,
        auth_header: Option<String>,
        custom_headers: HashMap<HeaderName, HeaderValue>,
        max_sse_event_size: usize,
    ) -> impl Future<Output = Result<BoxedSseResponse, StreamableHttpError<Self::Error>>> + Send + '_
    {
        self.inner.get_stream_with_max_sse_event_size(
            uri,
            session_id,
            last_event_id,
            auth_header,
            custom_headers,
            max_sse_event_size,
        )
    }
}

#[cfg(all(test, feature = "rmcp-reqwest"))]
mod tests {
    use super::*;
    use crate::verdict_of;
    use rmcp::transport::{
        DynamicTransportError,
        streamable_http_client::{HttpStatusError, StreamableHttpError},
    };
    use std::time::Duration;

    /// What rmcp's reqwest client reports for a status without a JSON-RPC message.
    fn answered(status: u16, retry_after: Option<&str>) -> ServiceError {
        let error: StreamableHttpError<reqwest::Error> =
            HttpStatusError::new(status, retry_after.map(str::to_owned)).into();
        ServiceError::TransportSend(DynamicTransportError::from_parts(
            "streamable-http",
            std::any::TypeId::of::<()>(),
            Box::new(error),
        ))
    }

    #[test]
    fn a_status_the_server_answered_is_judged_as_the_http_stack_judges_it() {
        let busy = from_service_error(answered(503, Some("2")));
        assert!(matches!(busy, ToolError::Status { .. }), "{busy:?}");
        assert_eq!(
            busy.to_string(),
            "the MCP server answered HTTP 503 Service Unavailable (Retry-After: 2)"
        );
        // Refused before anything ran: not sent, retried after the server's 2 s.
        assert_eq!(
            verdict_of(&busy),
            Verdict::Retryable {
                outcome: Outcome::NotSent,
                after: Some(Duration::from_secs(2)),
            }
        );
        let limited = from_service_error(answered(429, None));
        assert_eq!(
            verdict_of(&limited),
            Verdict::Retryable {
                outcome: Outcome::NotSent,
                after: None,
            }
        );
        // A 500: the server may have run the tool.
        let failed = verdict_of(&from_service_error(answered(500, None)));
        assert_eq!(failed.outcome(), Outcome::Unknown);
        // A reset is still a lost reply.
        let reset = ServiceError::TransportSend(DynamicTransportError::from_parts(
            "streamable-http",
            std::any::TypeId::of::<()>(),
            Box::new(std::io::Error::from(std::io::ErrorKind::ConnectionReset)),
        ));
        assert!(matches!(from_service_error(reset), ToolError::Lost(_)));
    }
}
