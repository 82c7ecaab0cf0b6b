use sha2::{Digest, Sha256};
use std::{borrow::Borrow, error::Error, fmt, sync::Arc};

/// The longest key accepted, in bytes.
pub(crate) const MAX_KEY_LEN: usize = 255;

/// An idempotency key: 1 to 255 visible ASCII characters other than `"` and `\`.
///
/// Cheap to clone. Its `Debug` shows the key; treat keys derived from guessable inputs as
/// guessable (the server scopes them per principal).
///
/// ```
/// use backstop_idempotency::{ActionContext, IdempotencyKey, KeyFormat};
///
/// let chosen = IdempotencyKey::new("refund-ORD-4812")?;
/// assert_eq!(chosen.as_str(), "refund-ORD-4812");
/// assert!(IdempotencyKey::new("has \"quotes\"").is_err()); // rejected with a reason
///
/// // Derived from what identifies the action: a resumed run derives the same key.
/// let a = ActionContext::tool_call("run-91f2", "step-3", "call-07").key();
/// assert_eq!(a, ActionContext::tool_call("run-91f2", "step-3", "call-07").key());
/// assert_ne!(a, ActionContext::tool_call("run-91f2", "step-3", "call-08").key());
/// assert_eq!(a.header_value(KeyFormat::StructuredField).to_str().unwrap(), format!("\"{a}\""));
/// # Ok::<(), backstop_idempotency::InvalidKey>(())
/// ```
#[derive(Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct IdempotencyKey(Arc<str>);

/// Why a string is not a valid idempotency key.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct InvalidKey {
    reason: String,
}

impl InvalidKey {
    fn new(reason: impl Into<String>) -> Self {
        InvalidKey {
            reason: reason.into(),
        }
    }
}

impl fmt::Display for InvalidKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.reason)
    }
}

impl Error for InvalidKey {}

/// How the key is written in a header.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub enum KeyFormat {
    /// The bare key, `Idempotency-Key: 62c3...` (what most payment APIs accept).
    #[default]
    Plain,
    /// An RFC 9651 structured-field string, `Idempotency-Key: "62c3..."`, as the IETF
    /// `Idempotency-Key` header draft specifies.
    StructuredField,
}

impl IdempotencyKey {
    /// A key from a string the caller chose, validated.
    pub fn new(key: impl AsRef<str>) -> Result<Self, InvalidKey> {
        let k = key.as_ref();
        validate(k)?;
        Ok(IdempotencyKey(Arc::from(k)))
    }

    /// The key of one tool call: run id, step id and tool-call id. A replay of the same step
    /// (a retry, a resumed run) reuses it; a new step gets a new one.
    pub(crate) fn for_tool_call(run_id: &str, step_id: &str, call_id: &str) -> Self {
        derive(
            b"tool-call",
            [run_id.as_bytes(), step_id.as_bytes(), call_id.as_bytes()],
        )
    }

    /// The key of an action: run id, tool name and the arguments in a canonical byte form (the
    /// same arguments must always give the same bytes; see `ActionContext::action_json`).
    pub(crate) fn for_action(run_id: &str, tool: &str, canonical_args: &[u8]) -> Self {
        derive(
            b"action",
            [run_id.as_bytes(), tool.as_bytes(), canonical_args],
        )
    }

    /// The key as text.
    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// The header value in the given format.
    pub fn header_value(&self, format: KeyFormat) -> http::HeaderValue {
        let v = match format {
            KeyFormat::Plain => http::HeaderValue::from_str(&self.0),
            KeyFormat::StructuredField => http::HeaderValue::from_str(&format!("\"{}\"", self.0)),
        };
        v.expect("a validated key is a valid header value")
    }

    /// Parses a header value in either format: a structured-field string (`"..."`) or a bare
    /// token. Rejects anything that is not a valid key.
    pub fn from_header(value: &http::HeaderValue) -> Result<Self, InvalidKey> {
        let text = value
            .to_str()
            .map_err(|_| InvalidKey::new("the idempotency key must be visible ASCII"))?
            .trim_matches([' ', '\t']);
        let inner = match text.strip_prefix('"') {
            Some(rest) => rest.strip_suffix('"').ok_or_else(|| {
                InvalidKey::new(
                    "the idempotency key opens a structured-field string but does not close it",
                )
            })?,
            None => text,
        };
        Self::new(inner)
    }
}

fn validate(k: &str) -> Result<(), InvalidKey> {
    if k.is_empty() {
        return Err(InvalidKey::new("the idempotency key is empty"));
    }
    if k.len() > MAX_KEY_LEN {
        return Err(InvalidKey::new(format!(
            "the idempotency key is {} bytes long; at most {MAX_KEY_LEN} are allowed",
            k.len()
        )));
    }
    if let Some(b) = k
        .bytes()
        .find(|b| !(0x21..=0x7e).contains(b) || *b == b'"' || *b == b'\\')
    {
        return Err(InvalidKey::new(format!(
            "the idempotency key contains the byte 0x{b:02x}; only visible ASCII other than '\"' and '\\' is allowed"
        )));
    }
    Ok(())
}

fn derive(kind: &[u8], fields: [&[u8]; 3]) -> IdempotencyKey {
    let mut h = Sha256::new();
    h.update(b"backstop-idempotency-key/v1\0");
    for f in std::iter::once(kind).chain(fields) {
        let len = u32::try_from(f.len()).unwrap_or(u32::MAX);
        h.update(len.to_be_bytes());
        h.update(f);
    }
    IdempotencyKey(Arc::from(hex::encode(h.finalize())))
}

#[cfg(feature = "json")]
fn canonical_json(v: &serde_json::Value) -> Result<Vec<u8>, InvalidKey> {
    fn check(v: &serde_json::Value) -> Result<(), InvalidKey> {
        const LIMIT: u64 = 1 << 53;
        match v {
            serde_json::Value::Number(n) => {
                let big = n.as_u64().is_some_and(|u| u > LIMIT)
                    || n.as_i64().is_some_and(|i| i.unsigned_abs() > LIMIT);
                if big {
                    return Err(InvalidKey::new(format!(
                        "the argument {n} is an integer beyond 2^53, which RFC 8785 cannot represent exactly; pass it as a string"
                    )));
                }
                Ok(())
            }
            serde_json::Value::Array(a) => a.iter().try_for_each(check),
            serde_json::Value::Object(o) => o.values().try_for_each(check),
            _ => Ok(()),
        }
    }
    check(v)?;
    serde_json_canonicalizer::to_vec(v)
        .map_err(|e| InvalidKey::new(format!("the arguments could not be canonicalised: {e}")))
}

impl fmt::Debug for IdempotencyKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(&*self.0, f)
    }
}

impl fmt::Display for IdempotencyKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl Borrow<str> for IdempotencyKey {
    fn borrow(&self) -> &str {
        &self.0
    }
}

/// What an agent runtime knows about the action a request performs, put in the request's
/// extensions so the [`IdempotencyLayer`](crate::IdempotencyLayer) can derive its key (and logs,
/// traces and dead letters can name the run and the call). Cheap to clone.
///
/// ```
/// use backstop_idempotency::{ActionContext, IdempotencyKey};
///
/// let action = ActionContext::tool_call("run-91f2", "step-3", "call-07");
/// assert_eq!(action.key(), ActionContext::tool_call("run-91f2", "step-3", "call-07").key());
/// assert_eq!((action.run_id(), action.call_id()), ("run-91f2", Some("call-07")));
///
/// // The runtime puts it on the request; the idempotency layer derives the key from it.
/// let mut req = http::Request::post("http://carrier.local/labels").body(()).unwrap();
/// req.extensions_mut().insert(action);
/// ```
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ActionContext {
    /// A tool call identified by its run, step and call ids.
    ToolCall {
        /// The agent run.
        run_id: Arc<str>,
        /// The step within the run.
        step_id: Arc<str>,
        /// The tool call within the step.
        call_id: Arc<str>,
    },
    /// An action identified by its run, tool and canonical arguments.
    Action {
        /// The agent run.
        run_id: Arc<str>,
        /// The tool.
        tool: Arc<str>,
        /// The arguments in canonical form.
        canonical_args: Arc<[u8]>,
    },
}

impl ActionContext {
    /// A tool call's context.
    pub fn tool_call(run_id: &str, step_id: &str, call_id: &str) -> Self {
        ActionContext::ToolCall {
            run_id: Arc::from(run_id),
            step_id: Arc::from(step_id),
            call_id: Arc::from(call_id),
        }
    }

    /// An action's context from arguments already in canonical form.
    pub fn action(run_id: &str, tool: &str, canonical_args: &[u8]) -> Self {
        ActionContext::Action {
            run_id: Arc::from(run_id),
            tool: Arc::from(tool),
            canonical_args: Arc::from(canonical_args),
        }
    }

    /// An action's context from JSON arguments, canonicalised per RFC 8785 (JSON
    /// Canonicalization Scheme) with `serde_json_canonicalizer`: object keys sorted, numbers in
    /// their shortest ECMAScript form, so `{"b":1.0,"a":2}` and `{"a":2,"b":1}` give one key.
    ///
    /// RFC 8785 writes every number as an IEEE double, so integers beyond ±2^53 would lose
    /// precision and two different amounts could share a key. They are rejected: pass them as
    /// strings.
    #[cfg(feature = "json")]
    pub fn action_json(
        run_id: &str,
        tool: &str,
        args: &serde_json::Value,
    ) -> Result<Self, InvalidKey> {
        Ok(Self::action(run_id, tool, &canonical_json(args)?))
    }

    /// The agent run.
    pub fn run_id(&self) -> &str {
        match self {
            ActionContext::ToolCall { run_id, .. } | ActionContext::Action { run_id, .. } => run_id,
        }
    }

    /// The tool-call id, when the context has one.
    pub fn call_id(&self) -> Option<&str> {
        match self {
            ActionContext::ToolCall { call_id, .. } => Some(call_id),
            ActionContext::Action { .. } => None,
        }
    }

    /// The derived key.
    pub fn key(&self) -> IdempotencyKey {
        match self {
            ActionContext::ToolCall {
                run_id,
                step_id,
                call_id,
            } => IdempotencyKey::for_tool_call(run_id, step_id, call_id),
            ActionContext::Action {
                run_id,
                tool,
                canonical_args,
            } => IdempotencyKey::for_action(run_id, tool, canonical_args),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// Computed independently with Python's hashlib (see the crate docs for the script).
    #[test]
    fn test_vectors() {
        assert_eq!(
            IdempotencyKey::for_tool_call("run-91f2", "step-3", "call-07").as_str(),
            "62c365e88817e25626ebbb4f2483d275b4594ce9369da9139952f99edd3dcfa8"
        );
        assert_eq!(
            IdempotencyKey::for_tool_call("", "", "").as_str(),
            "72f1cd417ec609d3bf2450e20fdc76076d9f7b42ce737aad5d86f70f536bc32f"
        );
        assert_eq!(
            IdempotencyKey::for_action(
                "run-42",
                "issue_refund",
                br#"{"amount":49,"order_id":"A-7"}"#
            )
            .as_str(),
            "7697a49728b09b6b9db44d764ecba2e2886c4c562495586630792dcc0b35890e"
        );
    }

    #[cfg(feature = "json")]
    #[test]
    fn json_arguments_are_canonical() {
        let a = serde_json::json!({"order_id": "A-7", "amount": 49.0});
        let b: serde_json::Value =
            serde_json::from_str(r#"{ "amount" : 49, "order_id":"A-7" }"#).unwrap();
        let ka = ActionContext::action_json("run-42", "issue_refund", &a)
            .map(|a| a.key())
            .unwrap();
        assert_eq!(
            ka,
            ActionContext::action_json("run-42", "issue_refund", &b)
                .map(|a| a.key())
                .unwrap()
        );
        // The same vector as the Python one above.
        assert_eq!(
            ka.as_str(),
            "7697a49728b09b6b9db44d764ecba2e2886c4c562495586630792dcc0b35890e"
        );
        let other = serde_json::json!({"order_id": "A-7", "amount": 50});
        assert_ne!(
            ka,
            ActionContext::action_json("run-42", "issue_refund", &other)
                .map(|a| a.key())
                .unwrap()
        );
        let big = serde_json::json!({"amount": 9_007_199_254_740_993u64});
        let e = ActionContext::action_json("r", "t", &big).unwrap_err();
        assert!(e.to_string().contains("beyond 2^53"), "{e}");
        assert!(
            ActionContext::action_json(
                "r",
                "t",
                &serde_json::json!({"n": 9_007_199_254_740_992u64})
            )
            .is_ok()
        );
    }

    #[test]
    fn fields_are_length_prefixed() {
        assert_ne!(
            IdempotencyKey::for_tool_call("ab", "c", "d"),
            IdempotencyKey::for_tool_call("a", "bc", "d")
        );
        assert_ne!(
            IdempotencyKey::for_tool_call("r", "s", "c"),
            IdempotencyKey::for_action("r", "s", b"c")
        );
    }

    #[test]
    fn validation() {
        assert!(IdempotencyKey::new("k-4812_ok.~").is_ok());
        for bad in [
            "",
            "has space",
            "tab\there",
            "quote\"",
            "back\\slash",
            "cr\rlf\n",
            "é",
        ] {
            assert!(IdempotencyKey::new(bad).is_err(), "{bad:?}");
        }
        assert!(IdempotencyKey::new("x".repeat(255)).is_ok());
        let e = IdempotencyKey::new("x".repeat(256)).unwrap_err();
        assert!(e.to_string().contains("at most 255"), "{e}");
    }

    #[test]
    fn header_forms() {
        let k = IdempotencyKey::new("abc-123").unwrap();
        assert_eq!(k.header_value(KeyFormat::Plain), "abc-123");
        assert_eq!(k.header_value(KeyFormat::StructuredField), "\"abc-123\"");
        for v in ["abc-123", "\"abc-123\"", " \"abc-123\" "] {
            let parsed =
                IdempotencyKey::from_header(&http::HeaderValue::from_str(v).unwrap()).unwrap();
            assert_eq!(parsed, k, "{v}");
        }
        for v in ["\"abc", "\"a\\\"b\"", "a b", "\"\""] {
            assert!(
                IdempotencyKey::from_header(&http::HeaderValue::from_str(v).unwrap()).is_err(),
                "{v}"
            );
        }
    }

    proptest! {
        #[test]
        fn parsing_never_panics_and_accepted_keys_round_trip(bytes in proptest::collection::vec(any::<u8>(), 0..300)) {
            if let Ok(v) = http::HeaderValue::from_bytes(&bytes)
                && let Ok(k) = IdempotencyKey::from_header(&v) {
                    for f in [KeyFormat::Plain, KeyFormat::StructuredField] {
                        let hv = k.header_value(f);
                        prop_assert!(!hv.as_bytes().iter().any(|b| *b == b'\r' || *b == b'\n'));
                        prop_assert_eq!(IdempotencyKey::from_header(&hv).unwrap(), k.clone());
                    }
                }
            if let Ok(s) = std::str::from_utf8(&bytes) {
                let _ = IdempotencyKey::new(s);
            }
        }

        #[test]
        fn derived_keys_are_valid(run in ".{0,40}", step in ".{0,40}", call in ".{0,40}") {
            let k = IdempotencyKey::for_tool_call(&run, &step, &call);
            prop_assert_eq!(k.as_str().len(), 64);
            prop_assert!(IdempotencyKey::new(k.as_str()).is_ok());
        }
    }
}
