use crate::{
    ToolResult,
    call::{META_REPLAYED, ToolCall},
    error::{RpcError, ToolError, codes},
};
use backstop_core::{HasExtensions, InvalidConfig};
use backstop_replay::{Action, Once, Principal, ReplayLayer, ReplayStore, Settle, StoredResponse};
use http::{HeaderName, HeaderValue};
use serde_json::{Value, json};
use std::{
    fmt,
    future::Future,
    pin::Pin,
    sync::Arc,
    task::{Context, Poll},
    time::Duration,
};
use tower_layer::Layer;
use tower_service::Service;

/// The header that marks a stored JSON-RPC error (the tool's own refusal) in a stored result.
const RPC_ERROR: HeaderName = HeaderName::from_static("x-backstop-mcp-error");

/// How long a caller told "in flight" or "store unavailable" is asked to wait.
const RETRY_AFTER_MS: u64 = 1_000;

type BusinessFn = dyn Fn(&ToolCall) -> Option<String> + Send + Sync;

/// Replay for MCP tool servers: a `tools/call` whose `_meta` carries a key runs once; every
/// repeat with the same key gets the stored result, marked `_meta["dev.backstop/replayed"]`.
///
/// It stands on `backstop_replay::ReplayLayer::once`, the claim, run and settle that the HTTP
/// replay layer stands on (the same contract, on the same stores: memory, Redis, PostgreSQL),
/// speaking MCP:
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
/// The tool service sees the claim's `backstop_replay::Lease` in the call's extensions. A stored
/// result larger than the replay layer's `max_stored_body` is not kept: a repeat is told the
/// call ran and its result cannot be replayed.
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
    require_key: bool,
    business_key: Option<Arc<BusinessFn>>,
}

impl fmt::Debug for ToolReplayLayer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ToolReplayLayer")
            .field("replay", &self.replay)
            .field("require_key", &self.require_key)
            .field("business_key", &self.business_key.is_some())
            .finish()
    }
}

impl ToolReplayLayer {
    /// Replay on `store`, with `ReplayLayer`'s defaults (24 h, a 30 s lease renewed every 10 s)
    /// and keys optional.
    pub fn new(store: impl ReplayStore) -> Self {
        ToolReplayLayer::from_replay(ReplayLayer::new(store))
    }

    /// Replay configured as `layer` is (store, TTL, lease, principal scope, the size of a
    /// stored result, failing open). What is HTTP's alone in it (methods, the key's header,
    /// which statuses are stored, a business key read from a request) does not apply to tool
    /// calls; say [`require_key`](ToolReplayLayer::require_key) and
    /// [`business_key`](ToolReplayLayer::business_key) here.
    pub fn from_replay(layer: ReplayLayer) -> Self {
        ToolReplayLayer {
            replay: layer,
            require_key: false,
            business_key: None,
        }
    }

    /// The server has one tenant: calls without a principal share one scope.
    #[must_use]
    pub fn single_tenant(mut self) -> Self {
        self.replay = self.replay.single_tenant();
        self
    }

    /// Whether a call without a key is refused (`INVALID_PARAMS`) instead of run without
    /// deduplication (the default).
    #[must_use]
    pub fn require_key(mut self, required: bool) -> Self {
        self.require_key = required;
        self
    }

    /// How long results are kept (24 h); refused when shorter than the lease.
    pub fn ttl(mut self, ttl: Duration) -> Result<Self, InvalidConfig> {
        self.replay = self.replay.ttl(ttl)?;
        Ok(self)
    }

    /// The claim's lease (30 s), renewed every third of it while the tool runs; refused under
    /// 30 ms or longer than the ttl.
    pub fn lease(mut self, lease: Duration) -> Result<Self, InvalidConfig> {
        self.replay = self.replay.lease(lease)?;
        Ok(self)
    }

    /// A business identity of a call ("refund of order 4812"): calls with the same one are the
    /// same action even when their keys or arguments differ.
    #[must_use]
    pub fn business_key(
        mut self,
        f: impl Fn(&ToolCall) -> Option<String> + Send + Sync + 'static,
    ) -> Self {
        self.business_key = Some(Arc::new(f));
        self
    }

    /// The action a call is, if it is guarded: `None` when it carries no key (nor a business
    /// identity) and none is required; an error when one is required.
    fn action(&self, call: &ToolCall) -> Option<Result<Action, ToolError>> {
        let business = self.business_key.as_ref().and_then(|f| f(call));
        let action = match (business, call.key()) {
            (Some(id), _) => Action::business(id, &call.canonical()),
            (None, Some(key)) => Action::keyed(key.clone(), &call.canonical()),
            (None, None) if self.require_key => {
                return Some(Err(ToolError::Rpc(RpcError::new(
                    codes::INVALID_PARAMS,
                    format!(
                        "this tool server requires an idempotency key in the call's _meta \
                         (\"{}\") so that a repeated call is not run twice; send one key per \
                         intended action and reuse it on every retry",
                        crate::META_KEY
                    ),
                ))));
            }
            (None, None) => return None,
        };
        Some(Ok(match call.extensions().get::<Principal>() {
            Some(p) => action.for_principal(p.0.clone()),
            None => action,
        }))
    }
}

impl<S> Layer<S> for ToolReplayLayer {
    type Service = ToolReplay<S>;

    fn layer(&self, inner: S) -> ToolReplay<S> {
        ToolReplay {
            inner,
            layer: self.clone(),
        }
    }
}

/// A tool service behind [`ToolReplayLayer`].
#[derive(Clone)]
pub struct ToolReplay<S> {
    inner: S,
    layer: ToolReplayLayer,
}

impl<S: fmt::Debug> fmt::Debug for ToolReplay<S> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ToolReplay")
            .field("inner", &self.inner)
            .field("layer", &self.layer)
            .finish()
    }
}

type BoxFuture<T> = Pin<Box<dyn Future<Output = T> + Send>>;

impl<S> Service<ToolCall> for ToolReplay<S>
where
    S: Service<ToolCall, Response = ToolResult, Error = ToolError> + Clone + Send + 'static,
    S::Future: Send + 'static,
{
    type Response = ToolResult;
    type Error = ToolError;
    type Future = BoxFuture<Result<ToolResult, ToolError>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), ToolError>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, mut call: ToolCall) -> Self::Future {
        // The handle polled ready goes with the call; a clone stays behind.
        let clone = self.inner.clone();
        let mut ready = std::mem::replace(&mut self.inner, clone);
        let action = match self.layer.action(&call) {
            None => return Box::pin(ready.call(call)),
            Some(Err(refused)) => return Box::pin(async { Err(refused) }),
            Some(Ok(action)) => action,
        };
        // A keyed call reaches the tool only once its key is claimed, or never (a replay): the
        // readiness granted goes back at once, and a clone is readied when the tool's turn
        // comes.
        let mut tool = self.inner.clone();
        drop(ready);
        let replay = self.layer.replay.clone();
        Box::pin(async move {
            let once = replay
                .once(action, move |lease| async move {
                    if let Err(e) = std::future::poll_fn(|cx| tool.poll_ready(cx)).await {
                        // The tool was never called: its key is free for a retry.
                        return (Settle::Release, Err(e));
                    }
                    if let Some(lease) = lease {
                        call.extensions_mut().insert(lease);
                    }
                    let result = tool.call(call).await;
                    (settle(&result), result)
                })
                .await;
            answer(once)
        })
    }
}

/// How a tool's result settles its key: a result or a JSON-RPC error is stored and replayed;
/// an overload frees the key for a later try; any other end (the tool's service failed, the
/// call was lost) leaves its outcome unknown.
fn settle(result: &Result<ToolResult, ToolError>) -> Settle {
    let (body, rpc_error) = match result {
        Ok(result) => (result.to_json(), false),
        Err(ToolError::Rpc(e)) if e.code == codes::OVERLOADED => return Settle::Release,
        Err(ToolError::Rpc(e)) => (e.to_json(), true),
        Err(_) => return Settle::Unknown,
    };
    let mut headers = vec![(
        http::header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    )];
    if rpc_error {
        headers.push((RPC_ERROR, HeaderValue::from_static("1")));
    }
    Settle::Store(StoredResponse {
        status: if rpc_error { 400 } else { 200 },
        headers,
        body: body.to_string().into(),
        body_omitted: None,
    })
}

/// What the replay found, in MCP's terms.
fn answer(once: Once<Result<ToolResult, ToolError>>) -> Result<ToolResult, ToolError> {
    match once {
        Once::Ran(result) => result,
        Once::Replayed(stored) => replayed(&stored),
        Once::Unknown => Err(refusal(
            codes::OUTCOME_UNKNOWN,
            "outcome-unknown",
            "a call with this idempotency key started and ended without a result (the tool \
             failed or the server stopped), so it may or may not have taken effect; it was not \
             run again. Check the result before repeating the action with a new key.",
            None,
        )),
        Once::InFlight => Err(refusal(
            codes::KEY_IN_FLIGHT,
            "request-in-flight",
            "a call with this idempotency key is still running; retry after it completes to get \
             its result",
            Some(RETRY_AFTER_MS),
        )),
        Once::KeyReused => Err(refusal(
            codes::KEY_REUSED,
            "idempotency-key-reused",
            "this idempotency key was already used for a different call (another tool or other \
             arguments); use a new key for a different action",
            None,
        )),
        Once::Unavailable(_) => Err(refusal(
            codes::REPLAY_UNAVAILABLE,
            "replay-store-unavailable",
            "the tool server's idempotency store is unavailable, so the call was not run (it \
             could not be protected against duplicates); retry later with the same key",
            Some(RETRY_AFTER_MS),
        )),
        Once::PrincipalMissing => Err(refusal(
            codes::REPLAY_MISCONFIGURED,
            "principal-missing",
            "the tool server keeps results per principal and this call carries none, so it was \
             not run (its stored result could reach another tenant)",
            None,
        )),
        _ => Err(refusal(
            codes::INTERNAL_ERROR,
            "replay-failed",
            "the tool server's replay layer could not tell what became of the call",
            None,
        )),
    }
}

/// A stored result, replayed: the tool's result marked `_meta["dev.backstop/replayed"]`, or
/// its JSON-RPC error as it was.
fn replayed(stored: &StoredResponse) -> Result<ToolResult, ToolError> {
    if let Some(read) = stored.body_omitted {
        return Err(refusal(
            codes::INTERNAL_ERROR,
            "response-not-stored",
            &format!(
                "a call with this idempotency key was already run, but its result ({read} bytes \
                 or more) was too large to store, so it cannot be replayed; look the result up \
                 instead of repeating the call"
            ),
            None,
        ));
    }
    let json: Value = serde_json::from_slice(&stored.body).unwrap_or(Value::Null);
    if stored.headers.iter().any(|(name, _)| name == RPC_ERROR) {
        return Err(ToolError::Rpc(RpcError::from_json(&json).unwrap_or_else(
            || RpcError::new(codes::INTERNAL_ERROR, "a stored tool error is unreadable"),
        )));
    }
    let mut result = ToolResult::from_json(json)?;
    result
        .meta
        .insert(META_REPLAYED.to_owned(), Value::Bool(true));
    Ok(result)
}

/// One of the replay's own refusals, as a JSON-RPC error: `data.type` names it, `data.status`
/// is the HTTP status the replay layer gives the same refusal.
fn refusal(code: i64, kind: &str, detail: &str, retry_after_ms: Option<u64>) -> ToolError {
    let status = match code {
        codes::KEY_IN_FLIGHT | codes::OUTCOME_UNKNOWN => 409,
        codes::KEY_REUSED => 422,
        codes::REPLAY_UNAVAILABLE => 503,
        _ if kind == "response-not-stored" => 409,
        _ => 500,
    };
    let mut data = json!({ "type": format!("urn:backstop:problem:{kind}"), "status": status });
    if let Some(ms) = retry_after_ms {
        data["retryAfterMs"] = Value::from(ms);
    }
    ToolError::Rpc(RpcError::new(code, detail).with_data(data))
}
