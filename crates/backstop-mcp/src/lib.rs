//! MCP tool calls under the Backstop stack, both ways.
//!
//! **Client side.** A [`ToolCall`] goes through the same stack as an HTTP request (the facade's
//! `Backstop::mcp(..)`): deadline, attempt timeout, full-jitter retries, the dependency's budget
//! and breaker, and an idempotency key per intended action, sent in the call's `_meta` under
//! [`META_KEY`] (and [`META_KEY_ALIAS`]) on every attempt. [`McpClassifier`] judges MCP results:
//! transport failures by whether the call left, JSON-RPC errors by code, and a result with
//! `isError: true` as the tool's answer (returned as it is, for the model to read). The tool's
//! annotations choose how each call is treated ([`ToolPolicy`]) unless the caller does.
//!
//! **Server side** (feature `server`). [`ToolReplayLayer`] runs a keyed `tools/call` once and replays its stored
//! result to every repeat, with the replay layer's stores and guarantees, its refusals told as
//! JSON-RPC errors ([`codes`]).
//!
//! **rmcp** (feature `rmcp`): [`rmcp::RmcpClient`] is an rmcp client's `call_tool` as a tower
//! service, and [`rmcp::ReplayHandler`] puts replay in front of an rmcp `ServerHandler`'s tools.
//!
//! **tower-mcp** (feature `tower-mcp`): [`tower_mcp::RouterClient`] calls an `McpRouter`'s
//! tools as a service of [`ToolCall`]s, and [`tower_mcp::PerToolReplayLayer`] is a per-tool layer.
//!
//! ```
//! use backstop_core::{Classify, Outcome, Verdict};
//! use backstop_mcp::{McpClassifier, ToolCall, ToolError, ToolHints, ToolPolicy, ToolResult};
//! use serde_json::json;
//!
//! // The server said the tool is idempotent: a lost reply may be repeated with the same key.
//! let call = ToolCall::new("set_shipping_address", json!({"order": "ORD-4812", "city": "Lyon"}))
//!     .unwrap()
//!     .hints(ToolHints { idempotent: Some(true), ..ToolHints::default() });
//! assert_eq!(call.policy(), ToolPolicy::KeyHonouring);
//! assert!(Classify::<ToolCall, ToolResult, ToolError>::is_replay_safe(&McpClassifier, &call));
//! ```
#![forbid(unsafe_code)]
// docs.rs (nightly, `--cfg docsrs`) badges every item behind a feature with it.
#![cfg_attr(docsrs, feature(doc_cfg))]
#![deny(missing_docs)]

mod call;
mod classify;
mod error;
mod policy;
#[cfg(feature = "server")]
mod replay;
mod result;
#[cfg(feature = "rmcp")]
pub mod rmcp;
#[cfg(feature = "tower-mcp")]
pub mod tower_mcp;
pub mod trace;

pub use call::{
    META_ERROR, META_KEY, META_KEY_ALIAS, META_REPLAYED, META_TIME_LEFT, ToolCall, time_left,
};
pub use classify::{McpClassifier, verdict_of, verdict_of_rpc};
pub use error::{RpcError, ToolError, codes};
pub use policy::{ToolCatalog, ToolHints, ToolPolicy};
#[cfg(feature = "server")]
pub use replay::{ToolReplay, ToolReplayLayer};
pub use result::ToolResult;
