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
//! [`ToolReplayLayer`]; everything else (calls without a key, follow-up rounds of a tool that
//! asked for input, every other method) goes to the handler untouched.
//!
//! The key is read from rmcp's `RequestContext::meta`, where rmcp moves a request's `_meta` on
//! the server: never from the tool's arguments.

use crate::{
    META_KEY, ToolCall, ToolCatalog, ToolError, ToolHints, ToolReplay, ToolReplayLayer, ToolResult,
    call::{RpcError, codes},
};
use backstop_classify::classify_error;
use backstop_core::{HasExtensions, Outcome, ReplyLost, Verdict};
use backstop_idempotency::{IdempotencyKey, KeyFormat};
use backstop_replay::Principal;
use http::{HeaderName, HeaderValue};
use rmcp::transport::{
    common::client_side_sse::BoxedSseResponse,
    streamable_http_client::{
        StreamableHttpClient, StreamableHttpError, StreamableHttpPostResponse,
        StreamableHttpResponseLimits,
    },
};
use rmcp::{
    ErrorData as McpError, RoleClient, ServerHandler, ServiceError,
    model::*,
    service::{
        MaybeSendFuture, NotificationContext, Peer, RequestContext, RoleServer, SubscriptionContext,
    },
};
use std::{
    borrow::Cow,
    collections::HashMap,
    fmt,
    future::Future,
    pin::Pin,
    sync::Arc,
    task::{Context, Poll},
};
use tower_layer::Layer;
use tower_service::Service;

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

/// rmcp's error as a [`ToolError`]: the server's JSON-RPC error as it is; a transport failure
/// as not sent when its cause shows the call never left (a refused connection), else as lost.
pub fn from_service_error(e: ServiceError) -> ToolError {
    match e {
        ServiceError::McpError(data) => ToolError::Rpc(from_error_data(data)),
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

fn tool_error_data(e: ToolError) -> McpError {
    match e {
        ToolError::Rpc(rpc) => to_error_data(&rpc),
        other => McpError::internal_error(other.to_string(), None),
    }
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
/// also sends a keyed `tools/call`'s key as an `Idempotency-Key` header, for servers and
/// gateways that read the header rather than `_meta`.
///
/// ```no_run
/// use backstop_mcp::rmcp::KeyHeader;
/// use rmcp::transport::{StreamableHttpClientTransport, streamable_http_client::{StreamableHttpClient, StreamableHttpClientTransportConfig}};
///
/// // `http_client`: rmcp's reqwest client (`reqwest::Client`, rmcp's feature
/// // `transport-streamable-http-client-reqwest`), or one of your own.
/// fn transport<C: StreamableHttpClient>(http_client: C) -> StreamableHttpClientTransport<KeyHeader<C>> {
///     StreamableHttpClientTransport::with_client(
///         KeyHeader::new(http_client),
///         StreamableHttpClientTransportConfig::with_uri("http://127.0.0.1:8080/mcp"),
///     )
/// }
/// ```
#[derive(Clone, Debug, Default)]
pub struct KeyHeader<C> {
    inner: C,
}

impl<C> KeyHeader<C> {
    /// Sends through `inner`.
    pub fn new(inner: C) -> Self {
        KeyHeader { inner }
    }
}

/// Adds the `Idempotency-Key` header when `message` is a `tools/call` whose `_meta` carries a
/// key.
fn key_header(message: &ClientJsonRpcMessage, headers: &mut HashMap<HeaderName, HeaderValue>) {
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
}

impl<C: StreamableHttpClient> StreamableHttpClient for KeyHeader<C> {
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
        key_header(&message, &mut custom_headers);
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
        key_header(&message, &mut custom_headers);
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
        key_header(&message, &mut custom_headers);
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

/// What the tool service behind the replay layer needs to run an rmcp tool.
#[derive(Clone)]
struct Received {
    params: CallToolRequestParams,
    context: RequestContext<RoleServer>,
}

/// The handler's tools as a tower service, for the replay layer.
struct HandlerTools<H> {
    handler: Arc<H>,
}

impl<H> Clone for HandlerTools<H> {
    fn clone(&self) -> Self {
        HandlerTools {
            handler: self.handler.clone(),
        }
    }
}

impl<H: ServerHandler> Service<ToolCall> for HandlerTools<H> {
    type Response = ToolResult;
    type Error = ToolError;
    type Future = BoxFuture<Result<ToolResult, ToolError>>;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), ToolError>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, mut call: ToolCall) -> Self::Future {
        let handler = self.handler.clone();
        let received = call.extensions_mut().remove::<Received>();
        Box::pin(async move {
            let Some(Received { params, context }) = received else {
                return Err(ToolError::Lost(
                    "the tool call lost its rmcp context".into(),
                ));
            };
            match handler.call_tool(params, context).await {
                Ok(response) => from_rmcp_response(response),
                Err(e) => Err(ToolError::Rpc(from_error_data(e))),
            }
        })
    }
}

type PrincipalFn = dyn Fn(&RequestContext<RoleServer>) -> Option<String> + Send + Sync;

/// An rmcp `ServerHandler` whose keyed tool calls run once: a repeat with the same key in
/// `_meta` gets the stored result (see [`ToolReplayLayer`]). Every other request goes to the
/// handler as it is.
///
/// ```no_run
/// use backstop_mcp::{ToolReplayLayer, rmcp::ReplayHandler};
/// use backstop_replay::MemoryStore;
///
/// # fn example<H: rmcp::ServerHandler>(billing_tools: H) {
/// let server = ReplayHandler::new(billing_tools, ToolReplayLayer::new(MemoryStore::default()))
///     // Whose results are whose: here the authenticated user that the HTTP layer put in the
///     // request's parts (without a principal, keyed calls are refused unless single-tenant).
///     .principal(|ctx| {
///         ctx.extensions
///             .get::<http::request::Parts>()
///             .and_then(|p| p.headers.get("x-user"))
///             .and_then(|v| v.to_str().ok())
///             .map(str::to_owned)
///     });
/// // Serve `server` as you served the handler: rmcp's stdio or streamable HTTP transport.
/// # let _ = server;
/// # }
/// ```
pub struct ReplayHandler<H> {
    handler: Arc<H>,
    replay: ToolReplay<HandlerTools<H>>,
    principal: Option<Arc<PrincipalFn>>,
}

impl<H> Clone for ReplayHandler<H> {
    fn clone(&self) -> Self {
        ReplayHandler {
            handler: self.handler.clone(),
            replay: self.replay.clone(),
            principal: self.principal.clone(),
        }
    }
}

impl<H> fmt::Debug for ReplayHandler<H> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ReplayHandler").finish_non_exhaustive()
    }
}

impl<H: ServerHandler> ReplayHandler<H> {
    /// `handler`'s keyed tool calls through `replay`.
    pub fn new(handler: H, replay: ToolReplayLayer) -> Self {
        let handler = Arc::new(handler);
        ReplayHandler {
            replay: replay.layer(HandlerTools {
                handler: handler.clone(),
            }),
            handler,
            principal: None,
        }
    }

    /// How to find the principal a call acts for, from its request context (what the
    /// transport or an authentication layer put there).
    #[must_use]
    pub fn principal(
        mut self,
        f: impl Fn(&RequestContext<RoleServer>) -> Option<String> + Send + Sync + 'static,
    ) -> Self {
        self.principal = Some(Arc::new(f));
        self
    }

    /// The handler.
    pub fn handler(&self) -> &H {
        &self.handler
    }

    /// The call in its `tool` span, a child of the trace context the call carried.
    async fn traced(
        &self,
        request: CallToolRequestParams,
        context: RequestContext<RoleServer>,
    ) -> Result<CallToolResponse, McpError> {
        use tracing::Instrument;
        let span = crate::trace::tool_span(&request.name, &context.meta.0.0);
        self.replayed(request, context).instrument(span).await
    }

    async fn replayed(
        &self,
        request: CallToolRequestParams,
        context: RequestContext<RoleServer>,
    ) -> Result<CallToolResponse, McpError> {
        let meta = context.meta.0.0.clone();
        // Follow-up rounds of a tool that asked for input, and calls without a key, are the
        // handler's alone.
        let keyed = meta.contains_key(META_KEY) || meta.contains_key(crate::META_KEY_ALIAS);
        if !keyed || request.input_responses.is_some() || request.request_state.is_some() {
            return self.handler.call_tool(request, context).await;
        }
        let mut call =
            ToolCall::received(request.name.to_string(), request.arguments.clone(), meta)
                .map_err(tool_error_data)?;
        if let Some(who) = self.principal.as_ref().and_then(|f| f(&context)) {
            call.extensions_mut().insert(Principal(who));
        }
        call.extensions_mut().insert(Received {
            params: request,
            context,
        });
        let mut replay = self.replay.clone();
        let result = tower::ServiceExt::ready(&mut replay)
            .await
            .map_err(tool_error_data)?
            .call(call)
            .await
            .map_err(tool_error_data)?;
        to_rmcp_response(&result)
    }
}

// Every method goes to the handler, rmcp's legacy ones too (logging/setLevel,
// resources/subscribe and unsubscribe, deprecated by rmcp for newer protocol versions): a client
// on an older version sees the handler as it is.
#[allow(deprecated)]
impl<H: ServerHandler> ServerHandler for ReplayHandler<H> {
    fn call_tool(
        &self,
        request: CallToolRequestParams,
        context: RequestContext<RoleServer>,
    ) -> impl Future<Output = Result<CallToolResponse, McpError>> + MaybeSendFuture + '_ {
        self.traced(request, context)
    }

    fn ping(
        &self,
        context: RequestContext<RoleServer>,
    ) -> impl Future<Output = Result<(), McpError>> + MaybeSendFuture + '_ {
        self.handler.ping(context)
    }

    fn initialize(
        &self,
        request: InitializeRequestParams,
        context: RequestContext<RoleServer>,
    ) -> impl Future<Output = Result<InitializeResult, McpError>> + MaybeSendFuture + '_ {
        self.handler.initialize(request, context)
    }

    fn negotiate_initialize(
        &self,
        request: &InitializeRequestParams,
    ) -> Result<InitializeResult, McpError> {
        self.handler.negotiate_initialize(request)
    }

    fn supported_protocol_versions(&self) -> Cow<'static, [ProtocolVersion]> {
        self.handler.supported_protocol_versions()
    }

    fn discover(
        &self,
        context: RequestContext<RoleServer>,
    ) -> impl Future<Output = Result<DiscoverResult, McpError>> + MaybeSendFuture + '_ {
        self.handler.discover(context)
    }

    fn complete(
        &self,
        request: CompleteRequestParams,
        context: RequestContext<RoleServer>,
    ) -> impl Future<Output = Result<CompleteResult, McpError>> + MaybeSendFuture + '_ {
        self.handler.complete(request, context)
    }

    fn set_level(
        &self,
        request: SetLevelRequestParams,
        context: RequestContext<RoleServer>,
    ) -> impl Future<Output = Result<(), McpError>> + MaybeSendFuture + '_ {
        self.handler.set_level(request, context)
    }

    fn get_prompt(
        &self,
        request: GetPromptRequestParams,
        context: RequestContext<RoleServer>,
    ) -> impl Future<Output = Result<GetPromptResponse, McpError>> + MaybeSendFuture + '_ {
        self.handler.get_prompt(request, context)
    }

    fn list_prompts(
        &self,
        request: Option<PaginatedRequestParams>,
        context: RequestContext<RoleServer>,
    ) -> impl Future<Output = Result<ListPromptsResult, McpError>> + MaybeSendFuture + '_ {
        self.handler.list_prompts(request, context)
    }

    fn list_resources(
        &self,
        request: Option<PaginatedRequestParams>,
        context: RequestContext<RoleServer>,
    ) -> impl Future<Output = Result<ListResourcesResult, McpError>> + MaybeSendFuture + '_ {
        self.handler.list_resources(request, context)
    }

    fn list_resource_templates(
        &self,
        request: Option<PaginatedRequestParams>,
        context: RequestContext<RoleServer>,
    ) -> impl Future<Output = Result<ListResourceTemplatesResult, McpError>> + MaybeSendFuture + '_
    {
        self.handler.list_resource_templates(request, context)
    }

    fn read_resource(
        &self,
        request: ReadResourceRequestParams,
        context: RequestContext<RoleServer>,
    ) -> impl Future<Output = Result<ReadResourceResponse, McpError>> + MaybeSendFuture + '_ {
        self.handler.read_resource(request, context)
    }

    fn accepted_subscription_filter(
        &self,
        requested: &SubscriptionFilter,
    ) -> Option<SubscriptionFilter> {
        self.handler.accepted_subscription_filter(requested)
    }

    fn listen(
        &self,
        context: SubscriptionContext,
    ) -> impl Future<Output = Result<(), McpError>> + MaybeSendFuture + '_ {
        self.handler.listen(context)
    }

    fn subscribe(
        &self,
        request: SubscribeRequestParams,
        context: RequestContext<RoleServer>,
    ) -> impl Future<Output = Result<(), McpError>> + MaybeSendFuture + '_ {
        self.handler.subscribe(request, context)
    }

    fn unsubscribe(
        &self,
        request: UnsubscribeRequestParams,
        context: RequestContext<RoleServer>,
    ) -> impl Future<Output = Result<(), McpError>> + MaybeSendFuture + '_ {
        self.handler.unsubscribe(request, context)
    }

    fn list_tools(
        &self,
        request: Option<PaginatedRequestParams>,
        context: RequestContext<RoleServer>,
    ) -> impl Future<Output = Result<ListToolsResult, McpError>> + MaybeSendFuture + '_ {
        self.handler.list_tools(request, context)
    }

    fn get_tool(&self, name: &str) -> Option<Tool> {
        self.handler.get_tool(name)
    }

    fn on_custom_request(
        &self,
        request: CustomRequest,
        context: RequestContext<RoleServer>,
    ) -> impl Future<Output = Result<CustomResult, McpError>> + MaybeSendFuture + '_ {
        self.handler.on_custom_request(request, context)
    }

    fn on_cancelled(
        &self,
        notification: CancelledNotificationParam,
        context: NotificationContext<RoleServer>,
    ) -> impl Future<Output = ()> + MaybeSendFuture + '_ {
        self.handler.on_cancelled(notification, context)
    }

    fn on_progress(
        &self,
        notification: ProgressNotificationParam,
        context: NotificationContext<RoleServer>,
    ) -> impl Future<Output = ()> + MaybeSendFuture + '_ {
        self.handler.on_progress(notification, context)
    }

    fn on_initialized(
        &self,
        context: NotificationContext<RoleServer>,
    ) -> impl Future<Output = ()> + MaybeSendFuture + '_ {
        self.handler.on_initialized(context)
    }

    fn on_roots_list_changed(
        &self,
        context: NotificationContext<RoleServer>,
    ) -> impl Future<Output = ()> + MaybeSendFuture + '_ {
        self.handler.on_roots_list_changed(context)
    }

    fn on_custom_notification(
        &self,
        notification: CustomNotification,
        context: NotificationContext<RoleServer>,
    ) -> impl Future<Output = ()> + MaybeSendFuture + '_ {
        self.handler.on_custom_notification(notification, context)
    }

    fn get_info(&self) -> ServerConfig {
        self.handler.get_info()
    }

    fn get_task(
        &self,
        request: GetTaskParams,
        context: RequestContext<RoleServer>,
    ) -> impl Future<Output = Result<GetTaskResult, McpError>> + MaybeSendFuture + '_ {
        self.handler.get_task(request, context)
    }

    fn update_task(
        &self,
        request: UpdateTaskParams,
        context: RequestContext<RoleServer>,
    ) -> impl Future<Output = Result<(), McpError>> + MaybeSendFuture + '_ {
        self.handler.update_task(request, context)
    }

    fn cancel_task(
        &self,
        request: CancelTaskParams,
        context: RequestContext<RoleServer>,
    ) -> impl Future<Output = Result<(), McpError>> + MaybeSendFuture + '_ {
        self.handler.cancel_task(request, context)
    }

    fn list_skills(
        &self,
        request: Option<PaginatedRequestParams>,
        context: RequestContext<RoleServer>,
    ) -> impl Future<Output = Result<ListSkillsResult, McpError>> + MaybeSendFuture + '_ {
        self.handler.list_skills(request, context)
    }

    fn get_skill(
        &self,
        request: GetSkillRequestParams,
        context: RequestContext<RoleServer>,
    ) -> impl Future<Output = Result<GetSkillResult, McpError>> + MaybeSendFuture + '_ {
        self.handler.get_skill(request, context)
    }

    fn read_resource_directory(
        &self,
        request: ReadResourceDirectoryRequestParams,
        context: RequestContext<RoleServer>,
    ) -> impl Future<Output = Result<ReadResourceDirectoryResult, McpError>> + MaybeSendFuture + '_
    {
        self.handler.read_resource_directory(request, context)
    }
}
