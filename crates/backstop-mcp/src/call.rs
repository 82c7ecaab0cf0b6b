use crate::error::{RpcError, ToolError, codes};
use crate::policy::{ToolHints, ToolPolicy};
use backstop_core::{AttemptLimit, HasExtensions, ReplaySafe, Run};
use backstop_idempotency::{ActionContext, IdempotencyKey, KeyedRequest};
use serde_json::{Map, Value};

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

/// Where each attempt of a tool call carries the time it has left, in whole milliseconds
/// (rounded up): `_meta["dev.backstop/time-left-ms"]`, as HTTP attempts carry
/// [`TIME_LEFT_HEADER`](backstop_core::TIME_LEFT_HEADER). A tool server's `ReplayHandler`
/// reads it: a call whose time is spent is not started, and every Backstop stack the tool calls
/// ends when the caller's time does.
pub const META_TIME_LEFT: &str = "dev.backstop/time-left-ms";

/// The time a call's `_meta` says it has left ([`META_TIME_LEFT`]), capped at `max`: `None`
/// when it says nothing usable (absent, not a whole number of milliseconds).
///
/// ```
/// use backstop_mcp::{META_TIME_LEFT, time_left};
/// use serde_json::json;
/// use std::time::Duration;
///
/// let meta = |v| json!({ META_TIME_LEFT: v }).as_object().unwrap().clone();
/// let max = Duration::from_secs(60);
/// assert_eq!(time_left(&meta(json!(1500)), max), Some(Duration::from_millis(1500)));
/// assert_eq!(time_left(&meta(json!(1e30)), max), Some(max));
/// assert_eq!(time_left(&meta(json!("soon")), max), None);
/// assert_eq!(time_left(&meta(json!(-1)), max), None);
/// ```
pub fn time_left(
    meta: &Map<String, Value>,
    max: std::time::Duration,
) -> Option<std::time::Duration> {
    let value = meta.get(META_TIME_LEFT)?;
    let ms = value.as_u64().or_else(|| {
        value
            .as_f64()
            .filter(|f| *f >= 0.0 && f.is_finite())
            .map(|f| f.ceil() as u64)
    });
    match ms {
        Some(ms) => Some(std::time::Duration::from_millis(ms).min(max)),
        None => {
            tracing::debug!(
                target: "backstop::deadline",
                value = %value,
                "ignored a malformed time left in _meta (whole milliseconds expected)"
            );
            None
        }
    }
}

/// Set to `true` in a result's `_meta` when a tool server's replay layer answered with the
/// stored result of an earlier call instead of running the tool again.
pub const META_REPLAYED: &str = "dev.backstop/replayed";

/// Where a tool result with `isError: true` carries a JSON-RPC error of Backstop's (code,
/// message, data), for transports that can only answer a tool call with a result (tower-mcp's
/// tool layers): `_meta["dev.backstop/error"]`. [`McpClassifier`](crate::McpClassifier)
/// classifies such a result as that error.
pub const META_ERROR: &str = "dev.backstop/error";

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
}
