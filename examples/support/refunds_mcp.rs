//! A payments MCP server for the MCP agent example and its tests: an rmcp `ServerHandler`
//! with an `issue_refund` tool (destructive, not idempotent), `order_status` (read-only) and
//! `set_refund_note` (idempotent) and `export_statement` (long-running: it answers with a task),
//! behind Backstop's replay, served over rmcp's streamable HTTP
//! transport on loopback. A fault layer in front can lose the first reply of a `tools/call`
//! after the server has answered it (the refund booked and stored).

use backstop::mcp::{ToolReplayLayer, rmcp::ReplayHandler};
use backstop::replay::MemoryStore;
use backstop_testkit::TestServer;
use bytes::Bytes;
use http::{Request, Response};
use http_body_util::{BodyExt, Full, combinators::UnsyncBoxBody};
use rmcp::{
    ErrorData, RoleServer, ServerHandler,
    model::{
        CallToolRequestParams, CallToolResponse, CallToolResult, ContentBlock, CreateTaskResult,
        ErrorCode, ListToolsResult, PaginatedRequestParams, ServerCapabilities, ServerConfig, Task,
        TaskStatus, Tool, ToolAnnotations,
    },
    service::RequestContext,
    transport::streamable_http_server::{
        StreamableHttpServerConfig, StreamableHttpService, session::local::LocalSessionManager,
    },
};
use serde_json::{Value, json};
use std::{
    future::Future,
    pin::Pin,
    sync::{
        Arc, Mutex,
        atomic::{AtomicBool, AtomicU32, Ordering},
    },
    task::{Context, Poll},
};

type JsonObject = serde_json::Map<String, Value>;

/// One refund the server booked.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Refund {
    /// `R1`, `R2`, ...
    pub id: String,
    /// The order refunded.
    pub order: String,
    /// Euro cents.
    pub cents: u64,
}

/// The payments tools; clones share the ledger.
#[derive(Clone, Debug, Default)]
pub struct RefundTools {
    ledger: Arc<Mutex<Vec<Refund>>>,
    /// Tool calls that reached the handler (replays do not).
    pub handled: Arc<AtomicU32>,
    /// The `_meta` and the arguments of each call that reached the handler.
    pub seen: Arc<Mutex<Vec<(JsonObject, JsonObject)>>>,
    /// Tasks `export_statement` started.
    pub tasks: Arc<AtomicU32>,
    /// The time each call that reached the handler had left, as the Backstop stacks it would
    /// call inherit it (`Deadline::current`).
    pub time_left: Arc<Mutex<Vec<Option<std::time::Duration>>>>,
}

impl RefundTools {
    /// The refunds booked so far.
    pub fn refunds(&self) -> Vec<Refund> {
        self.ledger.lock().expect("ledger").clone()
    }

    fn tools() -> Vec<Tool> {
        let schema = |v: Value| Arc::new(v.as_object().cloned().unwrap_or_default());
        vec![
            Tool::new(
                "issue_refund",
                "Refund part of an order to the customer's card.",
                schema(json!({
                    "type": "object",
                    "properties": { "order": {"type": "string"}, "eur": {"type": "number"} },
                    "required": ["order", "eur"]
                })),
            )
            .annotate(ToolAnnotations::new().destructive(true).idempotent(false)),
            Tool::new(
                "order_status",
                "An order's status and its refunds.",
                schema(json!({"type": "object", "properties": {"order": {"type": "string"}}})),
            )
            .annotate(ToolAnnotations::new().read_only(true)),
            Tool::new(
                "set_refund_note",
                "Set the note on a refund (setting it again changes nothing).",
                schema(json!({"type": "object"})),
            )
            .annotate(ToolAnnotations::new().idempotent(true).destructive(false)),
            Tool::new(
                "export_statement",
                "Export an order's statement: a long-running task, polled with tasks/get.",
                schema(json!({"type": "object", "properties": {"order": {"type": "string"}}})),
            ),
        ]
    }

    fn issue_refund(
        &self,
        args: &serde_json::Map<String, Value>,
    ) -> Result<CallToolResult, ErrorData> {
        let Some(order) = args.get("order").and_then(Value::as_str) else {
            return Err(ErrorData::new(
                ErrorCode::INVALID_PARAMS,
                "issue_refund needs `order`, the order's id (for example \"ORD-4812\")",
                None,
            ));
        };
        let eur = args.get("eur").and_then(Value::as_f64).unwrap_or(0.0);
        if !(eur > 0.0 && eur <= 500.0) {
            // The tool's own refusal: an answer the model reads and acts on.
            return Ok(CallToolResult::error(vec![ContentBlock::text(format!(
                "a refund must be between 0.01 and 500.00 EUR, not {eur}; ask the user for the amount"
            ))]));
        }
        let mut ledger = self.ledger.lock().expect("ledger");
        let refund = Refund {
            id: format!("R{}", ledger.len() + 1),
            order: order.to_owned(),
            cents: (eur * 100.0).round() as u64,
        };
        ledger.push(refund.clone());
        let text = format!("refund {} of {eur:.2} EUR booked for {order}", refund.id);
        let mut result = CallToolResult::success(vec![ContentBlock::text(text)]);
        result.structured_content =
            Some(json!({"refund_id": refund.id, "order": order, "eur": eur}));
        Ok(result)
    }
}

impl ServerHandler for RefundTools {
    fn get_info(&self) -> ServerConfig {
        ServerConfig::new(ServerCapabilities::builder().enable_tools().build())
    }

    async fn list_tools(
        &self,
        _request: Option<PaginatedRequestParams>,
        _context: RequestContext<RoleServer>,
    ) -> Result<ListToolsResult, ErrorData> {
        Ok(ListToolsResult::with_all_items(Self::tools()))
    }

    async fn call_tool(
        &self,
        request: CallToolRequestParams,
        context: RequestContext<RoleServer>,
    ) -> Result<CallToolResponse, ErrorData> {
        // The tool's own work, in a span of its own (a child of the replay layer's `tool` span,
        // and so of the caller's attempt when trace context travels).
        let _span =
            tracing::info_span!(target: "refunds", "handle", tool = %request.name).entered();
        self.handled.fetch_add(1, Ordering::SeqCst);
        self.time_left
            .lock()
            .expect("time left")
            .push(backstop::Deadline::current().map(backstop::Deadline::remaining));
        let args = request.arguments.unwrap_or_default();
        self.seen
            .lock()
            .expect("seen")
            .push((context.meta.0.0.clone(), args.clone()));
        let result = match request.name.as_ref() {
            "issue_refund" => self.issue_refund(&args)?,
            "order_status" => {
                let order = args.get("order").and_then(Value::as_str).unwrap_or("");
                let ids: Vec<String> = self
                    .refunds()
                    .into_iter()
                    .filter(|r| r.order == order)
                    .map(|r| r.id)
                    .collect();
                CallToolResult::success(vec![ContentBlock::text(format!(
                    "{order}: delivered; refunds: {}",
                    if ids.is_empty() {
                        "none".to_owned()
                    } else {
                        ids.join(", ")
                    }
                ))])
            }
            "set_refund_note" => CallToolResult::success(vec![ContentBlock::text("note saved")]),
            // A long-running tool (MCP's tasks extension): it answers with a task, each run a
            // new one, and the client polls `tasks/get` for the statement.
            "export_statement" => {
                let n = self.tasks.fetch_add(1, Ordering::SeqCst) + 1;
                let now = "2026-12-01T10:00:00Z";
                let task = Task::new(format!("task-{n}"), TaskStatus::Working, now, now);
                return Ok(CallToolResponse::Task(CreateTaskResult::new(task)));
            }
            other => {
                return Err(ErrorData::new(
                    ErrorCode::METHOD_NOT_FOUND,
                    format!("no tool named {other}"),
                    None,
                ));
            }
        };
        Ok(CallToolResponse::Complete(result))
    }
}

/// Loses the reply of the first `tools/call` of one tool once the server has answered it: the
/// answer is read in full (the effect done and its result stored), then the connection is
/// dropped instead of the reply being written.
#[derive(Clone, Debug)]
pub struct LoseFirstReply<S> {
    inner: S,
    tool: Option<&'static str>,
    armed: Arc<AtomicBool>,
    /// Replies lost so far.
    pub lost: Arc<AtomicU32>,
    /// The `Idempotency-Key` header of each `tools/call` POST (`None`: no header).
    pub key_headers: Arc<Mutex<Vec<Option<String>>>>,
}

type Boxed = UnsyncBoxBody<Bytes, Box<dyn std::error::Error + Send + Sync>>;

impl<S, B> tower::Service<Request<hyper::body::Incoming>> for LoseFirstReply<S>
where
    S: tower::Service<Request<Full<Bytes>>, Response = Response<B>> + Clone + Send + 'static,
    S::Future: Send,
    S::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
    B: http_body::Body<Data = Bytes> + Send + 'static,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    type Response = Response<Boxed>;
    type Error = Box<dyn std::error::Error + Send + Sync>;
    type Future = Pin<Box<dyn Future<Output = Result<Self::Response, Self::Error>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx).map_err(Into::into)
    }

    fn call(&mut self, req: Request<hyper::body::Incoming>) -> Self::Future {
        let clone = self.inner.clone();
        let mut inner = std::mem::replace(&mut self.inner, clone);
        let (armed, lost, tool) = (self.armed.clone(), self.lost.clone(), self.tool);
        let key_headers = self.key_headers.clone();
        Box::pin(async move {
            let (parts, body) = req.into_parts();
            let bytes = body.collect().await?.to_bytes();
            if std::str::from_utf8(&bytes).is_ok_and(|s| s.contains("\"tools/call\"")) {
                let header = parts.headers.get("idempotency-key");
                key_headers
                    .lock()
                    .expect("headers")
                    .push(header.and_then(|v| v.to_str().ok()).map(str::to_owned));
            }
            let targeted = tool.is_some_and(|tool| {
                std::str::from_utf8(&bytes).is_ok_and(|s| {
                    s.contains("\"tools/call\"") && s.contains(&format!("\"{tool}\""))
                })
            });
            let res = inner
                .call(Request::from_parts(parts, Full::new(bytes)))
                .await
                .map_err(Into::into)?;
            let (parts, body) = res.into_parts();
            let body = body.collect().await.map_err(Into::into)?.to_bytes();
            if targeted && armed.swap(false, Ordering::SeqCst) {
                lost.fetch_add(1, Ordering::SeqCst);
                // The server answered; the reply never reaches the client.
                return Err("the reply was lost on the way back".into());
            }
            let body: Boxed = Full::new(body).map_err(|e| match e {}).boxed_unsync();
            Ok(Response::from_parts(parts, body))
        })
    }
}

/// A running payments server.
#[derive(Debug)]
pub struct RefundServer {
    /// The tools (their ledger).
    pub tools: RefundTools,
    /// Replies the fault layer lost.
    pub lost: Arc<AtomicU32>,
    /// The `Idempotency-Key` header of each `tools/call` POST.
    pub key_headers: Arc<Mutex<Vec<Option<String>>>>,
    server: TestServer,
}

impl RefundServer {
    /// Starts the server on loopback; the first reply to a call of `lose_first_reply_of` (a
    /// tool's name) is lost.
    pub async fn start(lose_first_reply_of: Option<&'static str>) -> RefundServer {
        let replay = ToolReplayLayer::new(MemoryStore::default()).single_tenant();
        let tools = RefundTools::default();
        RefundServer::serve(
            ReplayHandler::new(tools.clone(), replay),
            tools,
            lose_first_reply_of,
        )
        .await
    }

    /// A server with several tenants: a call's principal is its HTTP request's `x-user`
    /// header (what an authentication layer would set), read from rmcp's request context.
    pub async fn start_multi_tenant() -> RefundServer {
        let replay = ToolReplayLayer::new(MemoryStore::default());
        let tools = RefundTools::default();
        let handler = ReplayHandler::new(tools.clone(), replay).principal(|ctx| {
            ctx.extensions
                .get::<http::request::Parts>()
                .and_then(|p| p.headers.get("x-user"))
                .and_then(|v| v.to_str().ok())
                .map(str::to_owned)
        });
        RefundServer::serve(handler, tools, None).await
    }

    async fn serve(
        handler: ReplayHandler<RefundTools>,
        tools: RefundTools,
        lose_first_reply_of: Option<&'static str>,
    ) -> RefundServer {
        let config = StreamableHttpServerConfig::default().with_json_response(true);
        let mcp = StreamableHttpService::new(
            move || Ok(handler.clone()),
            Arc::new(LocalSessionManager::default()),
            config,
        );
        let lost = Arc::new(AtomicU32::new(0));
        let key_headers: Arc<Mutex<Vec<Option<String>>>> = Arc::default();
        let svc = LoseFirstReply {
            key_headers: key_headers.clone(),
            inner: mcp,
            tool: lose_first_reply_of,
            armed: Arc::new(AtomicBool::new(true)),
            lost: lost.clone(),
        };
        let server = TestServer::serve(svc).await;
        RefundServer {
            tools,
            lost,
            key_headers,
            server,
        }
    }

    /// The MCP endpoint.
    pub fn url(&self) -> String {
        self.server.url("/mcp")
    }
}
