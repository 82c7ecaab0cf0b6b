use crate::{ToolCall, ToolError};
use serde_json::Value;
use std::{collections::HashMap, sync::Arc};

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
    /// Reads MCP's JSON for a tool's annotations (`{"readOnlyHint": true, ...}`).
    ///
    /// No annotations at all (`null`, or not an object) say nothing. Annotations that leave a
    /// hint out mean MCP's default for it: `destructiveHint` and `openWorldHint` default to
    /// `true` (which is why SDKs such as tower-mcp do not write `destructiveHint: true`), the
    /// others to `false`. Non-boolean values count as left out.
    pub fn from_json(annotations: &Value) -> Self {
        if !annotations.is_object() {
            return ToolHints::default();
        }
        let hint = |name: &str| annotations.get(name).and_then(Value::as_bool);
        ToolHints {
            read_only: Some(hint("readOnlyHint").unwrap_or(false)),
            destructive: Some(hint("destructiveHint").unwrap_or(true)),
            idempotent: Some(hint("idempotentHint").unwrap_or(false)),
            open_world: Some(hint("openWorldHint").unwrap_or(true)),
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
/// | none of these (no annotations; or `destructiveHint: false`) | [`Standard`](ToolPolicy::Standard) | a key in `_meta`; retried when it did not reach the tool, not after a lost reply unless the key is the caller's (or the stack is built with `honours_keys()`) |
///
/// `readOnlyHint` wins over the others (a read-only tool destroys nothing). Annotations that
/// leave `destructiveHint` out mean MCP's default, destructive ([`ToolHints::from_json`]). A
/// tool with no annotations at all keeps the standard policy, which is already careful (a lost
/// reply is not repeated on the stack's own key), rather than forbidding every retry. A caller's choice
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

/// A server's tools and their annotations, read once: [`call`](ToolCatalog::call) makes a
/// [`ToolCall`] with its tool's policy. With rmcp, `ToolCatalog::discover(&peer)` (feature
/// `rmcp`); with tower-mcp, `RouterClient::catalog` (feature `tower-mcp`).
///
/// ```
/// use backstop_mcp::{ToolCatalog, ToolHints, ToolPolicy};
/// use serde_json::json;
///
/// let catalog = ToolCatalog::new([(
///     "issue_refund",
///     ToolHints::from_json(&json!({"destructiveHint": true})),
/// )]);
/// let refund = catalog.call("issue_refund", json!({"order": "ORD-4812"})).unwrap();
/// assert_eq!(refund.policy(), ToolPolicy::NeverRetry);
/// assert_eq!(catalog.call("unknown", json!({})).unwrap().policy(), ToolPolicy::Standard);
/// ```
#[derive(Clone, Debug, Default)]
pub struct ToolCatalog {
    hints: Arc<HashMap<String, ToolHints>>,
}

impl ToolCatalog {
    /// A catalog of tools and their hints.
    pub fn new<N: Into<String>>(tools: impl IntoIterator<Item = (N, ToolHints)>) -> Self {
        ToolCatalog {
            hints: Arc::new(tools.into_iter().map(|(n, h)| (n.into(), h)).collect()),
        }
    }

    /// The hints of a tool (none for a tool the server did not list).
    pub fn hints(&self, tool: &str) -> ToolHints {
        self.hints.get(tool).copied().unwrap_or_default()
    }

    /// A call of `tool` with `arguments`, with the tool's policy.
    pub fn call(&self, tool: &str, arguments: Value) -> Result<ToolCall, ToolError> {
        Ok(ToolCall::new(tool, arguments)?.hints(self.hints(tool)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn every_combination_of_annotations() {
        let p = |v: Value| ToolPolicy::from_hints(&ToolHints::from_json(&v));
        // No annotations at all: the standard policy.
        assert_eq!(p(Value::Null), ToolPolicy::Standard);
        // Annotations that leave destructiveHint out: MCP's default, destructive.
        assert_eq!(p(json!({})), ToolPolicy::NeverRetry);
        assert_eq!(p(json!({"title": "Refund"})), ToolPolicy::NeverRetry);
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
        assert_eq!(p(json!({"readOnlyHint": false})), ToolPolicy::NeverRetry);
        assert_eq!(p(json!({"readOnlyHint": "yes"})), ToolPolicy::NeverRetry);
        assert_eq!(
            p(json!({"openWorldHint": false, "destructiveHint": false})),
            ToolPolicy::Standard
        );
        assert_eq!(
            p(json!({"idempotentHint": false, "destructiveHint": false})),
            ToolPolicy::Standard
        );
        // Explicit hints as Rust values.
        let h = |read_only, destructive, idempotent| {
            ToolPolicy::from_hints(&ToolHints {
                read_only,
                destructive,
                idempotent,
                open_world: None,
            })
        };
        assert_eq!(h(None, None, None), ToolPolicy::Standard);
        assert_eq!(h(None, Some(true), None), ToolPolicy::NeverRetry);
        assert_eq!(h(None, Some(true), Some(false)), ToolPolicy::NeverRetry);
        assert_eq!(h(None, Some(true), Some(true)), ToolPolicy::KeyHonouring);
        assert_eq!(h(Some(true), Some(true), None), ToolPolicy::ReadOnly);
    }
}
