//! What the workspace's examples, test processes and crash tests share (not published): the
//! invoice workflow ([`invoice`]) and the MCP refunds service ([`refunds_mcp`]). The crash
//! tests' child processes are this package's binaries, beside this file in `bin/`.
#![forbid(unsafe_code)]
#![deny(missing_docs)]

pub mod invoice;
pub mod refunds_mcp;
