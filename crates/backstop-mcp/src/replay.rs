use crate::{
    ToolResult,
    call::{META_REPLAYED, ToolCall},
    error::{RpcError, ToolError, codes},
};
use backstop_core::{HasExtensions, InvalidConfig};
use backstop_idempotency::KeyFormat;
use backstop_replay::{Lease, Principal, Replay, ReplayLayer, ReplayRequestBody, ReplayStore};
use bytes::Bytes;
use http::{HeaderValue, Method, Request, Response, StatusCode, header};
use http_body_util::{BodyExt, Full};
use serde_json::{Value, json};
use std::{
    fmt,
    future::Future,
    pin::Pin,
    task::{Context, Poll},
    time::Duration,
};
use tower_layer::Layer;
use tower_service::Service;

/// The header that marks a stored JSON-RPC error (the tool's own refusal), apart from the
/// replay layer's own problems.
const RPC_ERROR: &str = "x-backstop-mcp-error";

/// Replay for MCP tool servers: a `tools/call` whose `_meta` carries a key runs once; every
/// repeat with the same key gets the stored result, marked `_meta["dev.backstop/replayed"]`.
///
/// It is `backstop_replay::ReplayLayer` itself (the same claim, run-once, store and replay
/// contract, on the same stores: memory, Redis, PostgreSQL), speaking MCP:
///
/// - the key is read from `_meta` ([`META_KEY`](crate::META_KEY), or
///   [`META_KEY_ALIAS`](crate::META_KEY_ALIAS)); the fingerprint is the canonical JSON of the
///   tool's name and arguments, so the same key for another tool or other arguments is refused
///   ([`codes::KEY_REUSED`], HTTP's 422);
/// - the tool runs in a task of its own from the claim on: a client that gives up stops neither
///   the tool nor the claim; a repeat meanwhile gets [`codes::KEY_IN_FLIGHT`] (HTTP's 409) with
///   `data.retryAfterMs`, and the stored result once it is done;
/// - a tool that ends without a result (its service returned an error other than a JSON-RPC
///   one, or panicked) leaves the key recorded as [`codes::OUTCOME_UNKNOWN`]: never run twice;
/// - the tool's JSON-RPC errors are stored and replayed too (invalid params, internal error),
///   except [`codes::OVERLOADED`], which frees the key for a later try;
/// - an unreachable store refuses the call ([`codes::REPLAY_UNAVAILABLE`], with
///   `data.retryAfterMs`) rather than run it unprotected;
/// - a keyed call without a principal on a multi-tenant server is refused, not run
///   ([`codes::REPLAY_MISCONFIGURED`]).
///
/// Stored results are scoped by the call's principal (`backstop_replay::Principal` in the call's
/// extensions, put there by whatever authenticated the session), or built with
/// [`single_tenant`](ToolReplayLayer::single_tenant). A call without a key runs without
/// deduplication unless the layer is built with [`require_key`](ToolReplayLayer::require_key).
///
/// The tool service sees the claim's `backstop_replay::Lease` in the call's extensions.
///
/// ```
/// use backstop_mcp::{META_KEY, ToolCall, ToolError, ToolReplayLayer, ToolResult};
/// use backstop_replay::MemoryStore;
/// use serde_json::json;
/// use std::sync::{Arc, atomic::{AtomicU32, Ordering}};
/// use tower::{Layer, ServiceExt, service_fn};
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() {
/// let refunds = Arc::new(AtomicU32::new(0));
/// let booked = refunds.clone();
/// let tool = service_fn(move |_call: ToolCall| {
///     let n = booked.fetch_add(1, Ordering::SeqCst) + 1;
///     async move { Ok::<_, ToolError>(ToolResult::text(format!("refund R{n} booked"))) }
/// });
/// let server = ToolReplayLayer::new(MemoryStore::default()).single_tenant().layer(tool);
///
/// let meta = json!({ META_KEY: "refund-ORD-4812" }).as_object().cloned().unwrap();
/// let call = || ToolCall::received("issue_refund", json!({"eur": 40}).as_object().cloned(), meta.clone()).unwrap();
/// let first = server.clone().oneshot(call()).await.unwrap();
/// let again = server.oneshot(call()).await.unwrap(); // the client lost the first reply
/// assert_eq!(again.joined_text(), "refund R1 booked");
/// assert!(again.is_replayed() && !first.is_replayed());
/// assert_eq!(refunds.load(Ordering::SeqCst), 1);
/// # }
/// ```
#[derive(Clone)]
pub struct ToolReplayLayer {
    replay: ReplayLayer,
}

impl fmt::Debug for ToolReplayLayer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ToolReplayLayer")
            .field("replay", &self.replay)
            .finish()
    }
}

impl ToolReplayLayer {
    /// Replay on `store`, with `ReplayLayer`'s defaults (24 h, a 30 s lease renewed every 10 s)
    /// and keys optional.
    pub fn new(store: impl ReplayStore) -> Self {
        ToolReplayLayer::from_replay(ReplayLayer::new(store))
    }

    /// Replay configured as `layer` is (store, TTL, lease, principal, failure policy). The
    /// method, the key's header and whether a key is required are the adapter's own and are
    /// replaced (keys are optional; say [`require_key`](ToolReplayLayer::require_key) here).
    pub fn from_replay(layer: ReplayLayer) -> Self {
        let layer = layer
            .methods([Method::POST])
            .expect("a list with POST in it is not empty, and the rest was checked when set");
        ToolReplayLayer {
            replay: layer
                .header(http::HeaderName::from_static("idempotency-key"))
                .require_key(false)
                // Stored with the result, so a replayed tool error is told as one.
                .allow_header(http::HeaderName::from_static(RPC_ERROR)),
        }
    }

    fn edit(self, f: impl FnOnce(ReplayLayer) -> ReplayLayer) -> Self {
        ToolReplayLayer {
            replay: f(self.replay),
        }
    }

    /// The server has one tenant: calls without a principal share one scope.
    #[must_use]
    pub fn single_tenant(self) -> Self {
        self.edit(ReplayLayer::single_tenant)
    }

    /// Whether a call without a key is refused (`INVALID_PARAMS`) instead of run without
    /// deduplication (the default).
    #[must_use]
    pub fn require_key(self, required: bool) -> Self {
        self.edit(|r| r.require_key(required))
    }

    /// How long results are kept (24 h); refused when shorter than the lease.
    pub fn ttl(self, ttl: Duration) -> Result<Self, InvalidConfig> {
        Ok(ToolReplayLayer {
            replay: self.replay.ttl(ttl)?,
        })
    }

    /// The claim's lease (30 s), renewed every third of it while the tool runs; refused under
    /// 30 ms or longer than the ttl.
    pub fn lease(self, lease: Duration) -> Result<Self, InvalidConfig> {
        Ok(ToolReplayLayer {
            replay: self.replay.lease(lease)?,
        })
    }

    /// A business identity of a call ("refund of order 4812"): calls with the same one are the
    /// same action even when their keys or arguments differ (see
    /// `backstop_replay::ReplayLayer::business_key`).
    #[must_use]
    pub fn business_key(
        self,
        f: impl Fn(&ToolCall) -> Option<String> + Send + Sync + 'static,
    ) -> Self {
        self.edit(|r| {
            r.business_key(move |parts, _body| parts.extensions.get::<ToolCall>().and_then(&f))
        })
    }
}

impl<S> Layer<S> for ToolReplayLayer {
    type Service = ToolReplay<S>;

    fn layer(&self, inner: S) -> ToolReplay<S> {
        ToolReplay {
            inner: self.replay.layer(RunTool { inner }),
        }
    }
}

/// A tool service behind [`ToolReplayLayer`].
#[derive(Clone)]
pub struct ToolReplay<S> {
    inner: Replay<RunTool<S>>,
}

impl<S: fmt::Debug> fmt::Debug for ToolReplay<S> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ToolReplay")
            .field("inner", &self.inner)
            .finish()
    }
}

/// The tool under the HTTP replay layer: it takes the call back out of the request, runs it,
/// and answers with its result (200) or its JSON-RPC error (a status the layer stores or, for
/// an overload, frees the key on).
#[derive(Clone, Debug)]
struct RunTool<S> {
    inner: S,
}

type BoxFuture<T> = Pin<Box<dyn Future<Output = T> + Send>>;

impl<S> Service<Request<ReplayRequestBody>> for RunTool<S>
where
    S: Service<ToolCall, Response = ToolResult, Error = ToolError>,
    S::Future: Send + 'static,
{
    type Response = Response<Full<Bytes>>;
    type Error = ToolError;
    type Future = BoxFuture<Result<Response<Full<Bytes>>, ToolError>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), ToolError>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: Request<ReplayRequestBody>) -> Self::Future {
        let (mut parts, _body) = req.into_parts();
        let Some(mut call) = parts.extensions.remove::<ToolCall>() else {
            return Box::pin(async {
                Err(ToolError::Lost(
                    "the replay layer lost the tool call (a layer between dropped its extensions)"
                        .into(),
                ))
            });
        };
        if let Some(lease) = parts.extensions.remove::<Lease>() {
            call.extensions_mut().insert(lease);
        }
        let fut = self.inner.call(call);
        Box::pin(async move {
            match fut.await {
                Ok(result) => Ok(json_response(StatusCode::OK, &result.to_json(), false)),
                Err(ToolError::Rpc(e)) => Ok(json_response(status_for(e.code), &e.to_json(), true)),
                Err(other) => Err(other),
            }
        })
    }
}

/// The status a tool's JSON-RPC error is stored under: an overload is 503 (not stored: the key
/// is free for a later try); a server failure 500 and anything else 400 (stored and replayed).
fn status_for(code: i64) -> StatusCode {
    match code {
        codes::OVERLOADED => StatusCode::SERVICE_UNAVAILABLE,
        codes::INTERNAL_ERROR | -32099..=-32000 => StatusCode::INTERNAL_SERVER_ERROR,
        _ => StatusCode::BAD_REQUEST,
    }
}

fn json_response(status: StatusCode, body: &Value, rpc_error: bool) -> Response<Full<Bytes>> {
    let mut res = Response::new(Full::new(Bytes::from(body.to_string())));
    *res.status_mut() = status;
    res.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    if rpc_error {
        res.headers_mut()
            .insert(RPC_ERROR, HeaderValue::from_static("1"));
    }
    res
}

impl<S> Service<ToolCall> for ToolReplay<S>
where
    S: Service<ToolCall, Response = ToolResult, Error = ToolError> + Clone + Send + 'static,
    S::Future: Send + 'static,
{
    type Response = ToolResult;
    type Error = ToolError;
    type Future = BoxFuture<Result<ToolResult, ToolError>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), ToolError>> {
        Service::<Request<Full<Bytes>>>::poll_ready(&mut self.inner, cx)
    }

    fn call(&mut self, call: ToolCall) -> Self::Future {
        let mut req = Request::new(Full::new(Bytes::from(call.canonical())));
        *req.method_mut() = Method::POST;
        *req.uri_mut() = http::Uri::from_static("/tools/call");
        if let Some(key) = call.key() {
            req.headers_mut().insert(
                "idempotency-key",
                key.header_value(KeyFormat::StructuredField),
            );
        }
        if let Some(principal) = call.extensions().get::<Principal>() {
            req.extensions_mut().insert(principal.clone());
        }
        req.extensions_mut().insert(call);
        let fut = self.inner.call(req);
        Box::pin(async move {
            let res = fut.await?;
            answer(res).await
        })
    }
}

/// The replay layer's response, in MCP's terms.
async fn answer(
    res: Response<backstop_replay::ReplayResponseBody>,
) -> Result<ToolResult, ToolError> {
    let (parts, body) = res.into_parts();
    let bytes = body
        .collect()
        .await
        .map_err(|e| ToolError::Lost(Box::new(e)))?
        .to_bytes();
    let json: Value = serde_json::from_slice(&bytes).unwrap_or(Value::Null);
    let replayed = parts
        .headers
        .get("idempotent-replayed")
        .is_some_and(|v| v == "true");
    if parts.headers.contains_key(RPC_ERROR) {
        return Err(ToolError::Rpc(RpcError::from_json(&json).unwrap_or_else(
            || RpcError::new(codes::INTERNAL_ERROR, "a stored tool error is unreadable"),
        )));
    }
    if parts.status == StatusCode::OK {
        let mut result = ToolResult::from_json(json)?;
        if replayed {
            result
                .meta
                .insert(META_REPLAYED.to_owned(), Value::Bool(true));
        }
        return Ok(result);
    }
    // The layer's own refusals, and the stored record of a call whose outcome is unknown.
    Err(problem(&parts, &json))
}

/// The replay layer's `application/problem+json` answers as JSON-RPC errors.
fn problem(parts: &http::response::Parts, json: &Value) -> ToolError {
    let kind = json
        .get("type")
        .and_then(Value::as_str)
        .unwrap_or("")
        .trim_start_matches("urn:backstop:problem:")
        .to_owned();
    let detail = json
        .get("detail")
        .and_then(Value::as_str)
        .unwrap_or("the tool server's replay layer refused the call")
        .to_owned();
    let retry_after_ms = parts
        .headers
        .get(header::RETRY_AFTER)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.trim().parse::<u64>().ok())
        .map(|s| s * 1000);
    let code = match (parts.status, kind.as_str()) {
        (_, "request-in-flight") => codes::KEY_IN_FLIGHT,
        (_, "outcome-unknown") => codes::OUTCOME_UNKNOWN,
        (_, "principal-missing") => codes::REPLAY_MISCONFIGURED,
        (StatusCode::UNPROCESSABLE_ENTITY, _) => codes::KEY_REUSED,
        (StatusCode::SERVICE_UNAVAILABLE, _) => codes::REPLAY_UNAVAILABLE,
        (StatusCode::BAD_REQUEST | StatusCode::PAYLOAD_TOO_LARGE, _) => codes::INVALID_PARAMS,
        _ => codes::INTERNAL_ERROR,
    };
    let mut data =
        json!({ "type": format!("urn:backstop:problem:{kind}"), "status": parts.status.as_u16() });
    if let Some(ms) = retry_after_ms {
        data["retryAfterMs"] = Value::from(ms);
    }
    ToolError::Rpc(RpcError::new(code, detail).with_data(data))
}
