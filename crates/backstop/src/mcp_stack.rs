//! The composed stack for MCP tool calls.

use crate::Backstop;
use backstop_idempotency::ToolKeys;
use backstop_mcp::McpClassifier;
use backstop_retry::CloneResend;

impl Backstop<McpClassifier, CloneResend, ToolKeys> {
    /// The stack for the tool calls ([`ToolCall`](crate::mcp::ToolCall)s) of one MCP server,
    /// named `dependency`: [`McpClassifier`] judges results, each call carries a key per
    /// intended action in its `_meta` on every attempt, and each call's
    /// [`ToolPolicy`](crate::mcp::ToolPolicy) (its tool's annotations, unless the caller chose)
    /// says whether a lost reply may be repeated. Defaults as for [`Backstop::http`].
    ///
    /// ```
    /// use backstop::{Backstop, mcp::{ToolCall, ToolError, ToolHints, ToolResult}};
    /// use serde_json::json;
    /// use std::sync::{Arc, atomic::{AtomicU32, Ordering}};
    /// use tower::{Layer, ServiceExt, service_fn};
    ///
    /// # #[tokio::main(flavor = "current_thread", start_paused = true)]
    /// # async fn main() {
    /// // A tool whose first reply is lost after it ran.
    /// let runs = Arc::new(AtomicU32::new(0));
    /// let seen = runs.clone();
    /// let transport = service_fn(move |call: ToolCall| {
    ///     let n = seen.fetch_add(1, Ordering::SeqCst);
    ///     async move {
    ///         assert!(call.key().is_some(), "every attempt carries the key");
    ///         if n == 0 { Err(ToolError::Lost("connection reset after the call".into())) }
    ///         else { Ok(ToolResult::text("address updated")) }
    ///     }
    /// });
    /// let tools = Backstop::mcp("shipping-tools").build().unwrap().layer(transport);
    /// // The server annotated the tool `idempotentHint: true`: the lost reply is repeated.
    /// let call = ToolCall::new("set_address", json!({"order": "ORD-4812", "city": "Lyon"}))
    ///     .unwrap()
    ///     .hints(ToolHints { idempotent: Some(true), ..ToolHints::default() });
    /// let result = tools.oneshot(call).await.unwrap();
    /// assert_eq!(result.joined_text(), "address updated");
    /// assert_eq!(runs.load(Ordering::SeqCst), 2);
    /// # }
    /// ```
    pub fn mcp(dependency: impl Into<crate::Dependency>) -> Self {
        Backstop::tools(dependency, McpClassifier)
    }
}

#[cfg(feature = "rmcp")]
impl crate::BackstopLayer<McpClassifier, CloneResend, ToolKeys> {
    /// The stack over an rmcp client's `call_tool`: every error a typed [`Error`](crate::Error), keys in
    /// `_meta`, the deadline and the retries as for any other client.
    pub fn rmcp(
        &self,
        peer: rmcp::service::Peer<rmcp::RoleClient>,
    ) -> crate::BackstopService<backstop_mcp::rmcp::RmcpClient, McpClassifier, CloneResend, ToolKeys>
    {
        tower_layer::Layer::layer(self, backstop_mcp::rmcp::RmcpClient::new(peer))
    }
}
