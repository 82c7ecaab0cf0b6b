//! What the workspace's examples, test processes and crash tests share (not published).
#![forbid(unsafe_code)]
#![deny(missing_docs)]

pub mod invoice;
pub mod refunds_mcp;
