//! Why a tool call got no result: the JSON-RPC error a server sent (with its codes), or the
//! transport's failure, with what each says about the call's effect.

use backstop_core::BoxError;
use serde_json::Value;
use std::{error::Error, fmt, time::Duration};

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
    /// Backstop (HTTP's 408 from a `CallerDeadlineLayer`): the caller's time was spent when the
    /// call arrived, and it was not started.
    pub const DEADLINE_SPENT: i64 = -32096;
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
    /// The HTTP server in front of the MCP server answered with a status and no JSON-RPC message
    /// (a proxy's `503`, a gateway's `429`): judged as the HTTP stack judges that status and its
    /// `Retry-After`.
    Status {
        /// The HTTP status.
        status: http::StatusCode,
        /// The `Retry-After` value it sent, as it was.
        retry_after: Option<String>,
    },
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
            ToolError::Status {
                status,
                retry_after,
            } => {
                write!(f, "the MCP server answered HTTP {status}")?;
                match retry_after {
                    Some(after) => write!(f, " (Retry-After: {after})"),
                    None => Ok(()),
                }
            }
        }
    }
}

impl Error for ToolError {
    fn source(&self) -> Option<&(dyn Error + 'static)> {
        match self {
            ToolError::NotSent(e) | ToolError::Lost(e) => Some(&**e),
            ToolError::Rpc(e) => Some(e),
            ToolError::Status { .. } => None,
        }
    }
}
