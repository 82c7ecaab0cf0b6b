//! The journal through the composed stack over real HTTP: a call with a tool-call
//! `ActionContext`, made through a stack built with a journal, is journaled without the caller
//! writing journal code, with the key the stack sends.

use backstop::{
    Backstop,
    idempotency::ActionContext,
    journal::{Journal, JournalError, StepId, StepState},
};
use backstop_testkit::{Action, Seen, TestServer};
use bytes::Bytes;
use http::Request;
use http_body_util::Full;
use hyper_util::{client::legacy::Client, rt::TokioExecutor};
use std::time::Duration;
use tower::{Layer, ServiceExt};

fn post(url: String, run: &str, step: &str) -> Request<Full<Bytes>> {
    let mut req = Request::post(url).body(Full::from("{\"eur\":40}")).unwrap();
    req.extensions_mut()
        .insert(ActionContext::tool_call(run, step, "c1"));
    req
}

#[tokio::test]
async fn a_stack_built_with_a_journal_journals_each_tool_call() {
    let server = TestServer::start(|s: &Seen| match s.path.as_str() {
        "/invoices" => Action::respond(201, &[], "{\"invoice\":\"inv_1\"}"),
        "/busy" => Action::respond(503, &[("retry-after", "30")], ""),
        _ => Action::Hang,
    })
    .await;
    let journal = Journal::in_memory().await.unwrap();
    let client = Client::builder(TokioExecutor::new()).build_http::<Full<Bytes>>();
    let svc = Backstop::http("billing")
        .p99(Duration::from_millis(100))
        .deadline(Duration::from_secs(2))
        .build()
        .unwrap()
        .journaled(journal.clone())
        .layer(client);

    // Done: journaled, with the key the server saw.
    let res = svc
        .clone()
        .oneshot(post(server.url("/invoices"), "r1", "invoice"))
        .await
        .unwrap();
    assert_eq!(res.status(), 201);
    let step = journal
        .runs()
        .step(&StepId::new("r1", "invoice", "c1"))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(step.state, StepState::Succeeded);
    assert_eq!(step.tool, "billing");
    assert_eq!(
        server.seen()[0].header("idempotency-key"),
        Some(step.key.as_str())
    );
    let history: Vec<_> = journal
        .runs()
        .step_history(&step.id)
        .await
        .unwrap()
        .iter()
        .map(|t| t.to)
        .collect();
    assert_eq!(
        history,
        [StepState::Pending, StepState::Sent, StepState::Succeeded]
    );

    // Asked again (a resumed run): not sent again.
    let again = svc
        .clone()
        .oneshot(post(server.url("/invoices"), "r1", "invoice"))
        .await;
    let e = again.unwrap_err();
    assert!(
        matches!(e.journal(), Some(JournalError::AlreadyDone(_))),
        "{e}"
    );
    assert_eq!(
        backstop::core::ReportsOutcome::outcome(&e),
        backstop::Outcome::Completed
    );
    assert_eq!(server.requests(), 1);

    // Busy for 30 s: not acted on, the step parks until then.
    let res = svc
        .clone()
        .oneshot(post(server.url("/busy"), "r2", "invoice"))
        .await
        .unwrap();
    assert_eq!(res.status(), 503);
    let parked = journal
        .runs()
        .step(&StepId::new("r2", "invoice", "c1"))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(parked.state, StepState::Parked);
    let wait = (parked.parked_until.unwrap() - journal.now()).num_milliseconds();
    assert!((29_000..=30_000).contains(&wait), "{wait}");

    // No answer: the outcome is unknown, and the step waits for reconciliation.
    let lost = svc
        .clone()
        .oneshot(post(server.url("/hang"), "r3", "invoice"))
        .await;
    // The stack's own typed error, kept.
    let typed = lost.unwrap_err();
    assert_eq!(
        typed.call().map(backstop::Error::outcome),
        Some(backstop::Outcome::Unknown)
    );
    let unknown = journal
        .runs()
        .step(&StepId::new("r3", "invoice", "c1"))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(unknown.state, StepState::Unknown);
    // The same call again (a different one under these ids would be refused as such).
    let refused = svc
        .clone()
        .oneshot(post(server.url("/hang"), "r3", "invoice"))
        .await;
    let e = refused.unwrap_err();
    assert!(
        e.to_string()
            .contains("reconcile it before sending it again"),
        "{e}"
    );

    // Without a tool-call context: not journaled.
    let plain = Request::post(server.url("/invoices"))
        .body(Full::from("{}"))
        .unwrap();
    assert_eq!(svc.oneshot(plain).await.unwrap().status(), 201);
    assert_eq!(
        journal
            .runs()
            .list(&backstop::journal::RunFilter::latest(10))
            .await
            .unwrap()
            .len(),
        3
    );
}
