use serde_json::Value;

/// A tool's annotations (MCP `ToolAnnotations`): hints the server gives about what the tool
/// does. `None` is "not said".
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ToolHints {
    /// `readOnlyHint`: the tool changes nothing.
    pub read_only: Option<bool>,
    /// `destructiveHint`: the tool may destroy or change things irreversibly.
    pub destructive: Option<bool>,
    /// `idempotentHint`: calling it again with the same arguments has no further effect.
    pub idempotent: Option<bool>,
    /// `openWorldHint`: the tool reaches outside systems.
    pub open_world: Option<bool>,
}

impl ToolHints {
    /// Reads MCP's JSON for a tool's annotations (`{"readOnlyHint": true, ...}`); missing or
    /// non-boolean fields are "not said".
    pub fn from_json(annotations: &Value) -> Self {
        let hint = |name: &str| annotations.get(name).and_then(Value::as_bool);
        ToolHints {
            read_only: hint("readOnlyHint"),
            destructive: hint("destructiveHint"),
            idempotent: hint("idempotentHint"),
            open_world: hint("openWorldHint"),
        }
    }
}

/// How the stack treats a tool call: the presets, per call.
///
/// | annotations | policy | what the stack does |
/// |---|---|---|
/// | `readOnlyHint: true` | [`ReadOnly`](ToolPolicy::ReadOnly) | no key; retried freely (a lost reply too) |
/// | `idempotentHint: true` | [`KeyHonouring`](ToolPolicy::KeyHonouring) | a key in `_meta`; a lost reply is repeated with it |
/// | `destructiveHint: true` without `idempotentHint: true` | [`NeverRetry`](ToolPolicy::NeverRetry) | a key in `_meta`; one attempt, never repeated automatically |
/// | none of these | [`Standard`](ToolPolicy::Standard) | a key in `_meta`; retried when it did not reach the tool, not after a lost reply unless the key is the caller's (or the stack is built with `honours_keys()`) |
///
/// `readOnlyHint` wins over the others (a read-only tool destroys nothing). MCP's own default
/// for a tool without annotations is "destructive"; the standard policy is already careful
/// (a lost reply is not repeated on the stack's own key), so no annotations keeps the standard
/// policy rather than forbidding every retry. A caller's choice
/// ([`ToolCall::with_policy`](crate::ToolCall::with_policy)) overrides the annotations.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum ToolPolicy {
    /// The standard preset.
    #[default]
    Standard,
    /// Read-only: repeated freely.
    ReadOnly,
    /// The tool (or its server) honours keys: a lost reply is repeated with the same key.
    KeyHonouring,
    /// Destructive and not idempotent: one attempt.
    NeverRetry,
}

impl ToolPolicy {
    /// The policy the annotations choose (the table above).
    pub fn from_hints(hints: &ToolHints) -> Self {
        if hints.read_only == Some(true) {
            ToolPolicy::ReadOnly
        } else if hints.idempotent == Some(true) {
            ToolPolicy::KeyHonouring
        } else if hints.destructive == Some(true) {
            ToolPolicy::NeverRetry
        } else {
            ToolPolicy::Standard
        }
    }

    /// A short name for logs.
    pub fn as_str(self) -> &'static str {
        match self {
            ToolPolicy::Standard => "standard",
            ToolPolicy::ReadOnly => "read_only",
            ToolPolicy::KeyHonouring => "key_honouring",
            ToolPolicy::NeverRetry => "never_retry",
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn every_combination_of_annotations() {
        let p = |v: Value| ToolPolicy::from_hints(&ToolHints::from_json(&v));
        assert_eq!(p(json!({})), ToolPolicy::Standard);
        assert_eq!(p(json!({"readOnlyHint": true})), ToolPolicy::ReadOnly);
        assert_eq!(
            p(json!({"readOnlyHint": true, "destructiveHint": true})),
            ToolPolicy::ReadOnly
        );
        assert_eq!(p(json!({"idempotentHint": true})), ToolPolicy::KeyHonouring);
        assert_eq!(
            p(json!({"destructiveHint": true, "idempotentHint": true})),
            ToolPolicy::KeyHonouring
        );
        assert_eq!(p(json!({"destructiveHint": true})), ToolPolicy::NeverRetry);
        assert_eq!(
            p(json!({"destructiveHint": true, "idempotentHint": false})),
            ToolPolicy::NeverRetry
        );
        assert_eq!(p(json!({"destructiveHint": false})), ToolPolicy::Standard);
        assert_eq!(p(json!({"readOnlyHint": false})), ToolPolicy::Standard);
        assert_eq!(p(json!({"readOnlyHint": "yes"})), ToolPolicy::Standard);
        assert_eq!(p(json!({"openWorldHint": true})), ToolPolicy::Standard);
    }
}
