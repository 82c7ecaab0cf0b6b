//! Every example runs, and holds the invariants it asserts (one refund, one label, the breaker
//! keeping calls away), as part of the test suite so none of them rots.

#[path = "../../examples/agent_tools.rs"]
mod agent_tools;
#[path = "../../examples/double_refund.rs"]
mod double_refund;
#[path = "../../examples/hyper_client.rs"]
mod hyper_client;
#[path = "../../examples/invoice_workflow.rs"]
mod invoice_workflow;
#[path = "../../examples/mcp_agent.rs"]
mod mcp_agent;
#[path = "../../examples/otel_export.rs"]
mod otel_export;
#[path = "../../examples/reqwest_client.rs"]
mod reqwest_client;
#[path = "../../examples/shipping_label.rs"]
mod shipping_label;

#[test]
fn double_refund_runs() {
    double_refund::main().unwrap();
}

#[test]
fn agent_tools_runs() {
    agent_tools::main().unwrap();
}

#[test]
fn shipping_label_runs() {
    shipping_label::main().unwrap();
}

#[test]
fn hyper_client_runs() {
    hyper_client::main().unwrap();
}

#[test]
fn mcp_agent_runs() {
    mcp_agent::main().unwrap();
}

/// In a process of its own (this test binary run again for this one test): the example's
/// scoped subscriber would otherwise race with other tests' threads over tracing's
/// per-callsite interest, and its attempt spans could go unrecorded.
#[test]
fn otel_export_runs() {
    if std::env::var_os("BACKSTOP_OTEL_EXAMPLE_CHILD").is_some() {
        otel_export::main().unwrap();
        return;
    }
    let out = std::process::Command::new(std::env::current_exe().unwrap())
        .args(["--exact", "examples::otel_export_runs", "--nocapture"])
        .env("BACKSTOP_OTEL_EXAMPLE_CHILD", "1")
        .output()
        .unwrap();
    let said = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success() && said.contains("1 passed"),
        "{said}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

#[test]
fn reqwest_client_runs() {
    reqwest_client::main().unwrap();
}

#[test]
fn invoice_workflow_runs() {
    let dir = std::env::temp_dir().join(format!("backstop-invoice-example-{}", std::process::id()));
    invoice_workflow::run_demo(
        std::path::Path::new(env!("CARGO_BIN_EXE_invoice_worker")),
        &dir,
    )
    .unwrap();
}
