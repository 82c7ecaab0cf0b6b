//! The workspace's integration tests in one binary, a module per concern: one binary links
//! once. `tests/mcp_trace.rs` is a binary of its own, since it installs a global tracing
//! subscriber.

mod breaker_states;
mod cancellation;
mod chaos;
mod client_guarantees;
mod common;
mod conformance;
mod crash_replay;
mod deadline_wire;
mod examples;
mod grpc;
mod http_outage;
mod http_replay;
mod http_retry;
mod journal_crash;
mod journal_stack;
mod mcp;
mod observability;
mod otel_metrics;
mod quota;
mod quota_fleet;
mod readme_crash;
mod readme_texts;
mod soak;
mod stack;
mod tower_cases;
mod tower_composition;
mod tower_http;
mod tracing_fields;
