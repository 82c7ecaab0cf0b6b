//! What a tool answered: a result, a tool's error, or a task it started.

use crate::call::{META_ERROR, META_REPLAYED};
use crate::error::{RpcError, ToolError};
use backstop_core::HasExtensions;
use serde_json::{Map, Value};

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

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

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
