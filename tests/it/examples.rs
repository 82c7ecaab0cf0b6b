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
#[path = "../../examples/typed_workflow.rs"]
mod typed_workflow;

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

/// In a process of its own ([`in_own_process`](crate::common::in_own_process)): the example
/// reads its spans through a scoped subscriber.
#[test]
fn otel_export_runs() {
    if crate::common::in_own_process(module_path!(), "otel_export_runs") {
        otel_export::main().unwrap();
    }
}

#[test]
fn reqwest_client_runs() {
    reqwest_client::main().unwrap();
}

/// The README's typed workflow, on a PostgreSQL of the test's own: three steps, each once, each
/// with a key of its own.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn typed_workflow_runs_on_postgres() {
    let pg = backstop_testkit::PostgresServer::start().await;
    let (output, done) = typed_workflow::run(&pg.url()).await.unwrap();
    assert!(output.starts_with("refund 4200 (key "), "{output}");
    assert_eq!(done.len(), 3, "{done:?}");
    assert_eq!(done[0], output);
    assert!(done[1].starts_with("restock order-7 (key "), "{done:?}");
    assert!(
        done[2].starts_with(&format!("email about {output} (key ")),
        "{done:?}"
    );
    let keys: std::collections::HashSet<_> =
        done.iter().map(|d| d.rsplit("(key ").next()).collect();
    assert_eq!(keys.len(), 3, "a key per step: {done:?}");
}

/// The workflow the README and the guide show is the one the example runs (and the test above
/// runs on PostgreSQL), and the one the crash test's worker process runs: the same code,
/// whitespace and trailing commas aside.
#[test]
fn the_readme_and_the_guide_show_the_workflow_the_example_runs() {
    fn workflow(text: &str) -> String {
        let start = (text.find("#[derive(Serialize, Deserialize)]")).expect("the workflow's input");
        let end = start + (text[start..].find("Ok(refund)")).expect("the workflow's output");
        let code: String = text[start..end].split_whitespace().collect();
        code.replace(",}", "}")
    }
    let example = workflow(include_str!("../../examples/typed_workflow.rs"));
    assert_eq!(workflow(include_str!("../../README.md")), example);
    assert_eq!(
        workflow(include_str!("../../docs/guide/05-step-journal.md")),
        example
    );
    // And the worker process the crash test kills (readme_crash.rs).
    assert_eq!(
        workflow(include_str!("../../examples/support/bin/readme_worker.rs")),
        example
    );
}

#[test]
fn invoice_workflow_runs() {
    let dir = backstop_testkit::scratch_dir("invoice-example");
    invoice_workflow::run_demo(
        std::path::Path::new(env!("CARGO_BIN_EXE_invoice_worker")),
        dir.path(),
    )
    .unwrap();
}
