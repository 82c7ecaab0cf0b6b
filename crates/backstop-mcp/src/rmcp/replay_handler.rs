//! Replay inside an rmcp `ServerHandler` (feature `server`).

use super::{from_error_data, from_rmcp_response, to_error_data, to_rmcp_response};
use crate::{META_KEY, ToolCall, ToolError, ToolReplay, ToolReplayLayer, ToolResult};
use backstop_core::HasExtensions;
use backstop_replay::Principal;
use rmcp::{
    ErrorData as McpError, ServerHandler,
    model::*,
    service::{
        MaybeSendFuture, NotificationContext, RequestContext, RoleServer, SubscriptionContext,
    },
};
use std::{
    borrow::Cow,
    fmt,
    future::Future,
    pin::Pin,
    sync::Arc,
    task::{Context, Poll},
    time::Duration,
};
use tower_layer::Layer;
use tower_service::Service;

type BoxFuture<T> = Pin<Box<dyn Future<Output = T> + Send>>;

fn tool_error_data(e: ToolError) -> McpError {
    match e {
        ToolError::Rpc(rpc) => to_error_data(&rpc),
        other => McpError::internal_error(other.to_string(), None),
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
    max_time_left: Duration,
}

/// The most time a caller's `_meta` can give a call unless the server says otherwise.
const MAX_TIME_LEFT: Duration = Duration::from_secs(300);

impl<H> Clone for ReplayHandler<H> {
    fn clone(&self) -> Self {
        ReplayHandler {
            handler: self.handler.clone(),
            replay: self.replay.clone(),
            principal: self.principal.clone(),
            max_time_left: self.max_time_left,
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
            max_time_left: MAX_TIME_LEFT,
        }
    }

    /// The most time a caller can give a call through its `_meta`
    /// ([`META_TIME_LEFT`](crate::META_TIME_LEFT)): a larger value, an untrusted caller's or an
    /// absurd one, is cut to this. 5 minutes unless set.
    #[must_use]
    pub fn max_time_left(mut self, max: Duration) -> Self {
        self.max_time_left = max;
        self
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

    /// The call in its `tool` span, a child of the trace context the call carried, within the
    /// time its caller has left: not started when that is spent, and inherited by every
    /// Backstop stack the tool calls.
    async fn traced(
        &self,
        request: CallToolRequestParams,
        context: RequestContext<RoleServer>,
    ) -> Result<CallToolResponse, McpError> {
        use tracing::Instrument;
        let span = crate::trace::tool_span(&request.name, &context.meta.0.0);
        let left = crate::time_left(&context.meta.0.0, self.max_time_left);
        let served = self.replayed(request, context).instrument(span);
        match left {
            None => served.await,
            Some(left) if left.is_zero() => Err(McpError::new(
                ErrorCode(crate::codes::DEADLINE_SPENT as i32),
                "the caller's time was spent when the call arrived: it was not started",
                Some(serde_json::json!({
                    "type": "urn:backstop:problem:deadline-spent",
                    "status": 408,
                })),
            )),
            Some(left) => backstop_core::Deadline::after(left).scope(served).await,
        }
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
