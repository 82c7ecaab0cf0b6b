use crate::policy::{ToolHints, ToolPolicy};
use backstop_core::{
    AttemptLimit, BoxError, HasExtensions, Outcome, ReplaySafe, ReportsOutcome, Run,
};
use backstop_idempotency::{ActionContext, IdempotencyKey, KeyedRequest};
use serde_json::{Map, Value};
use std::{error::Error, fmt, time::Duration};

/// Where a tool call carries its idempotency key: `_meta["dev.backstop/idempotency-key"]`.
///
/// MCP reserves `_meta` for metadata and asks for reverse-DNS prefixes on names of one's own;
/// the key is metadata about the call, not an argument of the tool, so it does not go in
/// `arguments` (where a tool's input schema would reject it or the tool would see it as data).
/// The client side also writes [`META_KEY_ALIAS`], the name of the closed MCP proposal
/// (SEP-3182), which servers that rolled their own deduplication are the likeliest to read;
/// the server side reads either (both present and different: the call is refused).
pub const META_KEY: &str = "dev.backstop/idempotency-key";

/// The un-prefixed name the closed idempotency proposal used (`idempotencyKey`), written beside
/// [`META_KEY`] and read when it is absent.
pub const META_KEY_ALIAS: &str = "idempotencyKey";

/// Set to `true` in a result's `_meta` when a tool server's replay layer answered with the
/// stored result of an earlier call instead of running the tool again.
pub const META_REPLAYED: &str = "dev.backstop/replayed";

/// Where a tool result with `isError: true` carries a JSON-RPC error of Backstop's (code,
/// message, data), for transports that can only answer a tool call with a result (tower-mcp's
/// tool layers): `_meta["dev.backstop/error"]`. [`McpClassifier`](crate::McpClassifier)
/// classifies such a result as that error.
pub const META_ERROR: &str = "dev.backstop/error";

/// JSON-RPC error codes: the standard ones MCP uses, and Backstop's own for the replay layer
/// (in the range JSON-RPC leaves to implementations, -32000 to -32099).
pub mod codes {
    /// Invalid JSON was received.
    pub const PARSE_ERROR: i64 = -32700;
    /// The JSON sent is not a valid request.
    pub const INVALID_REQUEST: i64 = -32600;
    /// The method (or tool) does not exist.
    pub const METHOD_NOT_FOUND: i64 = -32601;
    /// Invalid parameters: the tool's arguments were rejected.
    pub const INVALID_PARAMS: i64 = -32602;
    /// The server failed while handling the call: it may have run part of it.
    pub const INTERNAL_ERROR: i64 = -32603;
    /// MCP: the resource was not found.
    pub const RESOURCE_NOT_FOUND: i64 = -32002;
    /// Backstop: the server is overloaded and did not run the call; `data.retryAfterMs` says
    /// when to come back.
    pub const OVERLOADED: i64 = -32090;
    /// Backstop replay (HTTP's 409): a call with this key is still running; ask again after
    /// `data.retryAfterMs` to get its result.
    pub const KEY_IN_FLIGHT: i64 = -32091;
    /// Backstop replay (HTTP's 409 `outcome-unknown`): a call with this key started and ended
    /// without a result; it may or may not have taken effect and is not run again.
    pub const OUTCOME_UNKNOWN: i64 = -32092;
    /// Backstop replay (HTTP's 422): this key was used for a different call (another tool or
    /// other arguments).
    pub const KEY_REUSED: i64 = -32093;
    /// Backstop replay (HTTP's 503): the store of keys is unreachable, and the call was not
    /// run unprotected.
    pub const REPLAY_UNAVAILABLE: i64 = -32094;
    /// Backstop replay (HTTP's 500 `principal-missing`): the server is misconfigured (the call
    /// reached the replay layer without an authenticated principal) and the call was not run.
    pub const REPLAY_MISCONFIGURED: i64 = -32095;
}

/// One MCP `tools/call` request, as it goes through the Backstop stack: the tool's name, its
/// arguments, the `_meta` to send, and the extensions the layers talk through (deadline,
/// dependency, key, run).
///
/// Its [`policy`](ToolCall::policy) (from the tool's annotations, unless the caller chose one)
/// decides how the stack treats it: see [`ToolPolicy`].
///
/// ```
/// use backstop_mcp::{ToolCall, ToolHints, ToolPolicy};
/// use serde_json::json;
///
/// let call = ToolCall::new("issue_refund", json!({"order": "ORD-4812", "eur": 40}))
///     .unwrap()
///     .hints(ToolHints { destructive: Some(true), ..ToolHints::default() });
/// assert_eq!(call.policy(), ToolPolicy::NeverRetry);
/// ```
#[derive(Clone, Debug, Default)]
pub struct ToolCall {
    name: String,
    arguments: Map<String, Value>,
    meta: Map<String, Value>,
    key: Option<IdempotencyKey>,
    policy: ToolPolicy,
    chosen: bool,
    extensions: http::Extensions,
}

impl ToolCall {
    /// A call of `name` with `arguments`, which must be a JSON object (or `null`: none).
    pub fn new(name: impl Into<String>, arguments: Value) -> Result<Self, ToolError> {
        let arguments = match arguments {
            Value::Object(map) => map,
            Value::Null => Map::new(),
            other => {
                return Err(ToolError::Rpc(RpcError::new(
                    codes::INVALID_PARAMS,
                    format!(
                        "a tool's arguments must be a JSON object, not {}",
                        kind_of(&other)
                    ),
                )));
            }
        };
        Ok(ToolCall {
            name: name.into(),
            arguments,
            ..ToolCall::default()
        })
    }

    /// The tool's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The arguments.
    pub fn arguments(&self) -> &Map<String, Value> {
        &self.arguments
    }

    /// The `_meta` object to send (without the key, which is written when the call is sent).
    pub fn meta(&self) -> &Map<String, Value> {
        &self.meta
    }

    /// The `_meta` object, to add entries of one's own.
    pub fn meta_mut(&mut self) -> &mut Map<String, Value> {
        &mut self.meta
    }

    /// The `_meta` object as it goes on the wire: [`meta`](ToolCall::meta) with the key under
    /// [`META_KEY`] and [`META_KEY_ALIAS`], when the call has one.
    pub fn wire_meta(&self) -> Map<String, Value> {
        let mut meta = self.meta.clone();
        if let Some(key) = &self.key {
            meta.insert(META_KEY.to_owned(), Value::from(key.as_str()));
            meta.insert(META_KEY_ALIAS.to_owned(), Value::from(key.as_str()));
        }
        meta
    }

    /// The call with the tool's annotations: they choose its policy unless the caller chose
    /// one with [`with_policy`](ToolCall::with_policy).
    #[must_use]
    pub fn hints(self, hints: ToolHints) -> Self {
        if self.chosen {
            return self;
        }
        self.apply(ToolPolicy::from_hints(&hints), false)
    }

    /// The call with a policy the caller chose (annotations no longer change it).
    #[must_use]
    pub fn with_policy(self, policy: ToolPolicy) -> Self {
        self.apply(policy, true)
    }

    fn apply(mut self, policy: ToolPolicy, chosen: bool) -> Self {
        self.policy = policy;
        self.chosen = chosen;
        let ext = &mut self.extensions;
        ext.remove::<ReplaySafe>();
        ext.remove::<AttemptLimit>();
        match policy {
            ToolPolicy::ReadOnly | ToolPolicy::KeyHonouring => {
                ext.insert(ReplaySafe);
            }
            ToolPolicy::NeverRetry => {
                ext.insert(AttemptLimit(1));
            }
            ToolPolicy::Standard => {}
        }
        self
    }

    /// How the stack treats this call.
    pub fn policy(&self) -> ToolPolicy {
        self.policy
    }

    /// The call's idempotency key: the caller's, the stack's, or (on a tool server) the one
    /// `_meta` carried.
    pub fn key(&self) -> Option<&IdempotencyKey> {
        self.key.as_ref()
    }

    /// The call with a key of the caller's: its word that the server honours it, so a lost
    /// reply may be repeated with it.
    #[must_use]
    pub fn with_key(mut self, key: IdempotencyKey) -> Self {
        self.extensions.insert(key.clone());
        self.key = Some(key);
        self
    }

    /// The call as one step of `run`: it shares the run's deadline and retry budget, and its
    /// key is derived from the run's id, the tool's name and the canonical arguments, so the
    /// same intended action (a model repeating itself) carries the same key.
    #[must_use]
    pub fn in_run(mut self, run: &Run) -> Self {
        run.attach(&mut self);
        let action = ActionContext::action(run.id(), &self.name, &self.canonical());
        self.extensions.insert(action);
        self
    }

    /// A tool server's view of a call: the key read from `_meta` ([`META_KEY`], else
    /// [`META_KEY_ALIAS`]). A key that is not a string, is invalid, or differs between the two
    /// names is an `INVALID_PARAMS` error.
    pub fn received(
        name: impl Into<String>,
        arguments: Option<Map<String, Value>>,
        meta: Map<String, Value>,
    ) -> Result<Self, ToolError> {
        let key = key_in(&meta)?;
        let mut call = ToolCall {
            name: name.into(),
            arguments: arguments.unwrap_or_default(),
            meta,
            ..ToolCall::default()
        };
        call.key = key;
        Ok(call)
    }

    /// The canonical form of what the call asks for (RFC 8785 JSON of the name and the
    /// arguments): the same call gives the same bytes, whatever the order of its keys.
    pub fn canonical(&self) -> Vec<u8> {
        let value = serde_json::json!({ "name": self.name, "arguments": self.arguments });
        serde_json_canonicalizer::to_vec(&value).unwrap_or_else(|_| value.to_string().into_bytes())
    }
}

fn kind_of(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

fn key_in(meta: &Map<String, Value>) -> Result<Option<IdempotencyKey>, ToolError> {
    let read = |name: &str| -> Result<Option<IdempotencyKey>, ToolError> {
        match meta.get(name) {
            None | Some(Value::Null) => Ok(None),
            Some(Value::String(s)) => IdempotencyKey::new(s).map(Some).map_err(|e| {
                ToolError::Rpc(RpcError::new(
                    codes::INVALID_PARAMS,
                    format!("the idempotency key in _meta[\"{name}\"] is invalid: {e}"),
                ))
            }),
            Some(other) => Err(ToolError::Rpc(RpcError::new(
                codes::INVALID_PARAMS,
                format!(
                    "the idempotency key in _meta[\"{name}\"] must be a string, not {}",
                    kind_of(other)
                ),
            ))),
        }
    };
    let main = read(META_KEY)?;
    let alias = read(META_KEY_ALIAS)?;
    match (main, alias) {
        (Some(a), Some(b)) if a != b => Err(ToolError::Rpc(RpcError::new(
            codes::INVALID_PARAMS,
            format!(
                "_meta carries two different idempotency keys (\"{META_KEY}\" and \
                 \"{META_KEY_ALIAS}\"); send one"
            ),
        ))),
        (Some(a), _) => Ok(Some(a)),
        (None, b) => Ok(b),
    }
}

impl HasExtensions for ToolCall {
    fn extensions(&self) -> &http::Extensions {
        &self.extensions
    }
    fn extensions_mut(&mut self) -> &mut http::Extensions {
        &mut self.extensions
    }
}

/// A read-only tool needs no key; every other call gets one (a key on a call that does not
/// need it is harmless).
impl KeyedRequest for ToolCall {
    fn needs_key(&self) -> bool {
        self.policy != ToolPolicy::ReadOnly
    }
    fn idempotency_key(&self) -> Option<&IdempotencyKey> {
        self.key.as_ref()
    }
    fn set_idempotency_key(&mut self, key: IdempotencyKey) {
        self.key = Some(key);
    }
}

/// What a tool answered: MCP's `CallToolResult`, as JSON, or the task a long-running tool
/// started instead (MCP's tasks extension, `resultType: "task"`).
///
/// A result with `isError: true` is an answer too: the tool ran (or refused) and said why, and
/// the text goes back to the model; the stack does not retry it. So is a task: the tool runs
/// on, and the caller polls `tasks/get` with its id.
#[derive(Clone, Debug, Default)]
#[non_exhaustive]
pub struct ToolResult {
    /// The task the tool started, when it answered with one (`taskId`, `status`, `createdAt`,
    /// ... as sent, without `_meta`, which is [`meta`](Self::meta)); `content` is then empty.
    pub task: Option<Map<String, Value>>,
    /// The content blocks (`{"type": "text", "text": ...}` and the others), as sent.
    pub content: Vec<Value>,
    /// `structuredContent`, when the tool gave one.
    pub structured_content: Option<Value>,
    /// `isError`.
    pub is_error: bool,
    /// The result's `_meta`.
    pub meta: Map<String, Value>,
    /// The extensions the layers see.
    pub extensions: http::Extensions,
}

impl ToolResult {
    /// A successful result with one text block.
    pub fn text(text: impl Into<String>) -> Self {
        ToolResult {
            content: vec![serde_json::json!({"type": "text", "text": text.into()})],
            ..ToolResult::default()
        }
    }

    /// A result with `isError: true` and one text block: the tool's own failure, told to the
    /// model.
    pub fn error_text(text: impl Into<String>) -> Self {
        ToolResult {
            is_error: true,
            ..ToolResult::text(text)
        }
    }

    /// The text blocks, joined by newlines.
    pub fn joined_text(&self) -> String {
        self.content
            .iter()
            .filter_map(|c| c.get("text").and_then(Value::as_str))
            .collect::<Vec<_>>()
            .join("\n")
    }

    /// The JSON-RPC error an `isError` result carries under [`META_ERROR`], if any.
    pub fn carried_error(&self) -> Option<RpcError> {
        if !self.is_error {
            return None;
        }
        self.meta.get(META_ERROR).and_then(RpcError::from_json)
    }

    /// Whether a tool server's replay layer answered with a stored result ([`META_REPLAYED`]).
    pub fn is_replayed(&self) -> bool {
        self.meta.get(META_REPLAYED) == Some(&Value::Bool(true))
    }

    /// The task the tool started, with its id, when it answered with one.
    pub fn task_id(&self) -> Option<&str> {
        self.task.as_ref()?.get("taskId")?.as_str()
    }

    /// The result as MCP's JSON (`content`, `structuredContent`, `isError`, `_meta`; a task's
    /// fields with `resultType: "task"`).
    pub fn to_json(&self) -> Value {
        if let Some(task) = &self.task {
            let mut out = task.clone();
            out.insert("resultType".into(), Value::from("task"));
            if !self.meta.is_empty() {
                out.insert("_meta".into(), Value::Object(self.meta.clone()));
            }
            return Value::Object(out);
        }
        let mut out = Map::new();
        out.insert("content".into(), Value::Array(self.content.clone()));
        if let Some(s) = &self.structured_content {
            out.insert("structuredContent".into(), s.clone());
        }
        if self.is_error {
            out.insert("isError".into(), Value::Bool(true));
        }
        if !self.meta.is_empty() {
            out.insert("_meta".into(), Value::Object(self.meta.clone()));
        }
        Value::Object(out)
    }

    /// Reads MCP's JSON for a `CallToolResult`, or a `CreateTaskResult` (`resultType: "task"`
    /// with a `taskId`); anything that is not one is an error.
    pub fn from_json(value: Value) -> Result<Self, ToolError> {
        let Value::Object(mut map) = value else {
            return Err(ToolError::Lost(
                "the tool's result is not a JSON object".into(),
            ));
        };
        if map.get("resultType").and_then(Value::as_str) == Some("task") {
            if !map.get("taskId").is_some_and(Value::is_string) {
                return Err(ToolError::Lost(
                    "the tool answered with a task that has no `taskId`".into(),
                ));
            }
            map.remove("resultType");
            let meta = match map.remove("_meta") {
                Some(Value::Object(m)) => m,
                _ => Map::new(),
            };
            return Ok(ToolResult {
                task: Some(map),
                meta,
                ..ToolResult::default()
            });
        }
        let content = match map.remove("content") {
            Some(Value::Array(c)) => c,
            None | Some(Value::Null) => Vec::new(),
            Some(_) => {
                return Err(ToolError::Lost(
                    "the tool's result has a `content` that is not an array".into(),
                ));
            }
        };
        let is_error = map
            .remove("isError")
            .and_then(|v| v.as_bool())
            .unwrap_or(false);
        let meta = match map.remove("_meta") {
            Some(Value::Object(m)) => m,
            _ => Map::new(),
        };
        Ok(ToolResult {
            task: None,
            content,
            structured_content: map.remove("structuredContent"),
            is_error,
            meta,
            extensions: http::Extensions::new(),
        })
    }
}

impl HasExtensions for ToolResult {
    fn extensions(&self) -> &http::Extensions {
        &self.extensions
    }
    fn extensions_mut(&mut self) -> &mut http::Extensions {
        &mut self.extensions
    }
}

/// A JSON-RPC error object, as an MCP server sends it.
#[derive(Clone, Debug, PartialEq)]
#[non_exhaustive]
pub struct RpcError {
    /// The code (see [`codes`]).
    pub code: i64,
    /// The message.
    pub message: String,
    /// `data`, when the server gave it.
    pub data: Option<Value>,
}

impl RpcError {
    /// An error with a code and a message.
    pub fn new(code: i64, message: impl Into<String>) -> Self {
        RpcError {
            code,
            message: message.into(),
            data: None,
        }
    }

    /// The same error with `data`.
    #[must_use]
    pub fn with_data(mut self, data: Value) -> Self {
        self.data = Some(data);
        self
    }

    /// When the server asked to be called again: `data.retryAfterMs` (milliseconds) or
    /// `data.retryAfter` (seconds), capped at an hour.
    pub fn retry_after(&self) -> Option<Duration> {
        let data = self.data.as_ref()?;
        let d = if let Some(ms) = data.get("retryAfterMs").and_then(Value::as_u64) {
            Duration::from_millis(ms)
        } else {
            Duration::from_secs(data.get("retryAfter").and_then(Value::as_u64)?)
        };
        Some(d.min(Duration::from_secs(3600)))
    }

    /// The error as JSON (`code`, `message`, `data`).
    pub fn to_json(&self) -> Value {
        let mut v = serde_json::json!({ "code": self.code, "message": self.message });
        if let Some(d) = &self.data {
            v["data"] = d.clone();
        }
        v
    }

    /// Reads a JSON-RPC error object.
    pub fn from_json(value: &Value) -> Option<Self> {
        Some(RpcError {
            code: value.get("code")?.as_i64()?,
            message: value.get("message")?.as_str()?.to_owned(),
            data: value.get("data").cloned(),
        })
    }
}

impl fmt::Display for RpcError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "the server answered with error {}: {}",
            self.code, self.message
        )
    }
}

impl Error for RpcError {}

/// Why a tool call got no result.
#[derive(Debug)]
#[non_exhaustive]
pub enum ToolError {
    /// The call never left (the connection was refused, the session was not open): nothing
    /// happened, and it is safe to send again.
    NotSent(BoxError),
    /// The transport failed after the call may have left (a reset, a lost reply, a timeout):
    /// the tool may or may not have run.
    Lost(BoxError),
    /// The server answered with a JSON-RPC error.
    Rpc(RpcError),
}

impl ToolError {
    /// The JSON-RPC error, when the server sent one.
    pub fn rpc(&self) -> Option<&RpcError> {
        match self {
            ToolError::Rpc(e) => Some(e),
            _ => None,
        }
    }
}

impl fmt::Display for ToolError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ToolError::NotSent(e) => write!(f, "the tool call was not sent: {e}"),
            ToolError::Lost(e) => write!(f, "the tool call may or may not have run: {e}"),
            ToolError::Rpc(e) => e.fmt(f),
        }
    }
}

impl Error for ToolError {
    fn source(&self) -> Option<&(dyn Error + 'static)> {
        match self {
            ToolError::NotSent(e) | ToolError::Lost(e) => Some(&**e),
            ToolError::Rpc(e) => Some(e),
        }
    }
}

impl ReportsOutcome for ToolError {
    fn outcome(&self) -> Outcome {
        crate::classify::verdict_of(self).outcome()
    }

    fn retry_after(&self) -> Option<Duration> {
        self.rpc().and_then(RpcError::retry_after)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn keys_in_meta() {
        let meta = |v: Value| v.as_object().unwrap().clone();
        let call = ToolCall::received("t", None, meta(json!({META_KEY: "k-1"}))).unwrap();
        assert_eq!(call.key().unwrap().as_str(), "k-1");
        let call = ToolCall::received("t", None, meta(json!({META_KEY_ALIAS: "k-2"}))).unwrap();
        assert_eq!(call.key().unwrap().as_str(), "k-2");
        let both = ToolCall::received("t", None, meta(json!({META_KEY: "a", META_KEY_ALIAS: "b"})));
        assert_eq!(both.unwrap_err().rpc().unwrap().code, codes::INVALID_PARAMS);
        let number = ToolCall::received("t", None, meta(json!({META_KEY: 7})));
        assert!(number.unwrap_err().to_string().contains("must be a string"));
        assert!(ToolCall::received("t", None, meta(json!({META_KEY: ""}))).is_err());
        let none = ToolCall::received("t", None, Map::new()).unwrap();
        assert!(none.key().is_none());
    }

    #[test]
    fn the_key_goes_on_the_wire_under_both_names() {
        let call = ToolCall::new("t", json!({}))
            .unwrap()
            .with_key(IdempotencyKey::new("k").unwrap());
        let meta = call.wire_meta();
        assert_eq!(meta[META_KEY], "k");
        assert_eq!(meta[META_KEY_ALIAS], "k");
        assert!(ToolCall::new("t", json!([1])).is_err());
    }

    #[test]
    fn canonical_form_ignores_key_order() {
        let a = ToolCall::new("t", json!({"a": 1, "b": 2})).unwrap();
        let b = ToolCall::new("t", json!({"b": 2, "a": 1})).unwrap();
        assert_eq!(a.canonical(), b.canonical());
        let c = ToolCall::new("t", json!({"a": 1, "b": 3})).unwrap();
        assert_ne!(a.canonical(), c.canonical());
    }

    #[test]
    fn results_round_trip() {
        let r = ToolResult::from_json(json!({
            "content": [{"type": "text", "text": "done"}],
            "structuredContent": {"id": 1},
            "isError": true,
            "_meta": {META_REPLAYED: true}
        }))
        .unwrap();
        assert!(r.is_error && r.is_replayed());
        assert_eq!(r.joined_text(), "done");
        assert_eq!(
            ToolResult::from_json(r.to_json()).unwrap().to_json(),
            r.to_json()
        );
        assert!(ToolResult::from_json(json!("x")).is_err());
    }

    #[test]
    fn a_task_round_trips_with_its_meta() {
        let task = json!({
            "resultType": "task",
            "taskId": "t-1",
            "status": "working",
            "createdAt": "2026-12-01T10:00:00Z",
            "lastUpdatedAt": "2026-12-01T10:00:00Z",
            "ttlMs": null,
            "_meta": {META_REPLAYED: true}
        });
        let r = ToolResult::from_json(task.clone()).unwrap();
        assert_eq!(r.task_id(), Some("t-1"));
        assert!(r.is_replayed() && r.content.is_empty());
        assert_eq!(r.to_json(), task);
        let no_id = json!({"resultType": "task", "status": "working"});
        assert!(ToolResult::from_json(no_id).is_err());
    }
}
