//! What the workspace's examples, test processes and crash tests share (not published): the
//! invoice workflow ([`invoice`]) and the MCP refunds service ([`refunds_mcp`]). The crash
//! tests' child processes are this package's binaries, beside this file in `bin/`.
#![forbid(unsafe_code)]
#![deny(missing_docs)]

pub mod invoice;
pub mod refunds_mcp;

/// The README and the guide: `cargo test` compiles every Rust block of each as a doc test, and
/// runs each one that needs nothing outside its own process (a block marked `no_run` needs a
/// server, and the example its chapter names runs the same code against one).
#[cfg(doctest)]
pub mod docs {
    #[doc = include_str!("../../README.md")]
    pub struct Readme;
    #[doc = include_str!("../../docs/guide/01-http-clients.md")]
    pub struct HttpClients;
    #[doc = include_str!("../../docs/guide/02-grpc.md")]
    pub struct Grpc;
    #[doc = include_str!("../../docs/guide/03-agents-and-mcp.md")]
    pub struct AgentsAndMcp;
    #[doc = include_str!("../../docs/guide/04-replay-server.md")]
    pub struct ReplayServer;
    #[doc = include_str!("../../docs/guide/05-step-journal.md")]
    pub struct StepJournal;
    #[doc = include_str!("../../docs/guide/06-worker.md")]
    pub struct Worker;
    #[doc = include_str!("../../docs/guide/07-cli-and-console.md")]
    pub struct CliAndConsole;
    #[doc = include_str!("../../docs/guide/08-telemetry.md")]
    pub struct Telemetry;
    #[doc = include_str!("../../docs/guide/09-composing-by-hand.md")]
    pub struct ComposingByHand;
    #[doc = include_str!("../../docs/guide/10-fault-layer.md")]
    pub struct FaultLayer;
    #[doc = include_str!("../../docs/guide/11-replay-security.md")]
    pub struct ReplaySecurity;
    #[doc = include_str!("../../docs/guide/12-troubleshooting.md")]
    pub struct Troubleshooting;
}
