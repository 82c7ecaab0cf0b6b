//! The journal against real databases: a SQLite file in a temporary directory, and a
//! PostgreSQL cluster of the test's own (initdb + pg_ctl on a free loopback port). Each
//! scenario runs on both.

use crate::steps::Change;
use crate::{
    CallResult, Journal, JournalError, JournalLayer, Next, Reconciled, Reconcilers, Resolution,
    RunFilter, RunState, Step, StepId, StepState,
};
use backstop_core::Outcome;
#[cfg(feature = "postgres")]
use backstop_testkit::PostgresServer;
use backstop_testkit::{ManualClock, TempDir, scratch_dir};
use std::{
    future::Future,
    path::PathBuf,
    sync::{
        Arc,
        atomic::{AtomicU32, Ordering},
    },
    time::Duration,
};
use tower::{Service, ServiceExt, service_fn};

/// A journal file's path in a scratch directory, removed when the guard drops.
fn temp_db(name: &str) -> (TempDir, PathBuf) {
    let dir = scratch_dir(&format!("journal-{name}"));
    let path = dir.path().join("journal.db");
    (dir, path)
}

/// A journal on a fresh SQLite file, and the guard of its directory.
async fn sqlite(name: &str, clock: &ManualClock) -> (TempDir, Journal) {
    let (dir, path) = temp_db(name);
    let j = Journal::sqlite(path)
        .await
        .unwrap()
        .with_clock(clock.reader());
    (dir, j)
}

fn ok(result: &str) -> CallResult {
    CallResult::Succeeded {
        result: Some(result.to_owned()),
        provider_ref: None,
    }
}

fn failed(outcome: Outcome, retry_after: Option<Duration>) -> CallResult {
    CallResult::Failed {
        outcome,
        error: format!("the carrier failed ({})", outcome.as_str()),
        retry_after,
    }
}

fn states(history: &[crate::StepTransition]) -> Vec<&'static str> {
    history.iter().map(|t| t.to.as_str()).collect()
}

// --- scenarios, each run on both stores ------------------------------------------------------

async fn a_done_step_is_not_called_again(j: &Journal, clock: &ManualClock) {
    let step = super::new_step("r-done", "invoice", "c1", "billing", b"{\"eur\":40}");
    let calls = AtomicU32::new(0);
    let done = j
        .execute_new(&step, |sent| {
            calls.fetch_add(1, Ordering::SeqCst);
            assert_eq!(sent.state, StepState::Sent);
            assert_eq!(sent.attempts, 1);
            assert_eq!(sent.key, step.key);
            async { ok("{\"invoice\":\"inv_1\"}") }
        })
        .await
        .unwrap();
    assert_eq!(done.state, StepState::Succeeded);
    clock.advance(Duration::from_secs(5));
    let again = j
        .execute_new(&step, |_| {
            calls.fetch_add(1, Ordering::SeqCst);
            async { ok("second") }
        })
        .await
        .unwrap();
    assert_eq!(
        calls.load(Ordering::SeqCst),
        1,
        "a done step is not called again"
    );
    assert_eq!(again.result.as_deref(), Some("{\"invoice\":\"inv_1\"}"));
    let history = j.runs().step_history(&step.id).await.unwrap();
    assert_eq!(states(&history), ["pending", "sent", "succeeded"]);
    assert!(history.windows(2).all(|w| w[0].at <= w[1].at));
    assert!(history.iter().all(|t| t.actor == "journal"));
    assert_eq!(j.plan("r-done").await.unwrap()[0].1, Next::Done);
}

async fn an_unknown_step_is_reconciled_before_it_is_sent_again(j: &Journal) {
    let step = super::new_step("r-unknown", "reserve", "c1", "inventory", b"{\"sku\":7}");
    let s = j
        .execute_new(&step, |_| async { failed(Outcome::Unknown, None) })
        .await
        .unwrap();
    assert_eq!(s.state, StepState::Unknown);
    // Nothing sends it again before it is reconciled.
    let refused = j.execute_new(&step, |_| async { unreachable!() }).await;
    assert!(
        matches!(refused, Err(JournalError::NeedsReconciliation(_))),
        "{refused:?}"
    );
    let asked = Arc::new(AtomicU32::new(0));
    let a = asked.clone();
    let hooks = Reconcilers::new().tool("inventory", move |s: &Step| {
        a.fetch_add(1, Ordering::SeqCst);
        let key = s.key.clone();
        async move {
            assert!(!key.is_empty());
            Reconciled::Happened {
                result: Some("{\"reservation\":\"res_9\"}".into()),
                provider_ref: Some("res_9".into()),
            }
        }
    });
    let report = j.reconcile_run("r-unknown", &hooks).await.unwrap();
    assert_eq!(report.reconciled, std::slice::from_ref(&step.id));
    assert_eq!(asked.load(Ordering::SeqCst), 1);
    let s = j.runs().step(&step.id).await.unwrap().unwrap();
    assert_eq!(s.state, StepState::ReconciledSucceeded);
    assert_eq!(s.provider_ref.as_deref(), Some("res_9"));
    assert_eq!(
        states(&j.runs().step_history(&step.id).await.unwrap()),
        [
            "pending",
            "sent",
            "unknown",
            "requires_reconciliation",
            "reconciled_succeeded"
        ]
    );
}

async fn a_step_left_sent_by_a_crash_is_unknown_and_resent_only_if_it_did_not_happen(j: &Journal) {
    let step = super::new_step("r-crash", "email", "c1", "mailer", b"{}");
    let s = j.begin(&step).await.unwrap();
    // The worker wrote `sent` and died before the answer.
    j.transition(
        &s.id,
        &[StepState::Pending],
        StepState::Sent,
        Change::attempt(),
    )
    .await
    .unwrap();
    assert_eq!(j.plan("r-crash").await.unwrap()[0].1, Next::Reconcile);
    let hooks = Reconcilers::new().tool("mailer", |_: &Step| async { Reconciled::NotHappened });
    let report = j.reconcile_run("r-crash", &hooks).await.unwrap();
    assert_eq!(report.resend, std::slice::from_ref(&step.id));
    let calls = AtomicU32::new(0);
    let s = j
        .execute_new(&step, |sent| {
            calls.fetch_add(1, Ordering::SeqCst);
            assert_eq!(sent.attempts, 2, "the second attempt, with the same key");
            async { ok("{\"message\":\"m_1\"}") }
        })
        .await
        .unwrap();
    assert_eq!(calls.load(Ordering::SeqCst), 1);
    assert_eq!(s.state, StepState::Succeeded);
    assert_eq!(
        states(&j.runs().step_history(&step.id).await.unwrap()),
        [
            "pending",
            "sent",
            "unknown",
            "requires_reconciliation",
            "pending",
            "sent",
            "succeeded"
        ]
    );
}

async fn what_nobody_can_tell_goes_to_a_person_who_resolves_it(j: &Journal, clock: &ManualClock) {
    let step = super::new_step("r-human", "refund", "c1", "payments", b"{\"eur\":12}");
    j.execute_new(&step, |_| async { failed(Outcome::Unknown, None) })
        .await
        .unwrap();
    struct Unsure;
    impl crate::Reconcile for Unsure {
        fn reconcile<'a>(
            &'a self,
            _step: &'a Step,
        ) -> std::pin::Pin<Box<dyn Future<Output = Reconciled> + Send + 'a>> {
            Box::pin(async {
                Reconciled::CannotTell {
                    why: "the payments API has no lookup by key".into(),
                }
            })
        }
        fn key_ttl(&self) -> Option<Duration> {
            Some(Duration::from_secs(24 * 3600))
        }
    }
    clock.advance(Duration::from_secs(25 * 3600));
    let report = j
        .reconcile_run("r-human", &Reconcilers::new().tool("payments", Unsure))
        .await
        .unwrap();
    assert_eq!(report.human, std::slice::from_ref(&step.id));
    let stuck = j.runs().stuck().await.unwrap();
    let s = stuck
        .iter()
        .find(|s| s.id == step.id)
        .expect("listed as stuck");
    let why = s.attention.as_deref().unwrap();
    assert!(
        why.contains("no lookup by key") && why.contains("time to live"),
        "{why}"
    );
    assert!(matches!(
        j.plan("r-human").await.unwrap()[0].1,
        Next::Human { .. }
    ));
    let summary = j.runs().list(&RunFilter::latest(100)).await.unwrap();
    let run = summary.iter().find(|r| r.run == "r-human").unwrap();
    assert_eq!(run.state, crate::RunState::NeedsHuman);

    let s = j
        .operator()
        .resolve(
            &step.id,
            Resolution::Retry,
            "ana",
            "the bank shows no refund",
        )
        .await
        .unwrap();
    assert_eq!(s.state, StepState::Pending);
    assert!(s.attention.is_none());
    let last = j
        .runs()
        .step_history(&step.id)
        .await
        .unwrap()
        .pop()
        .unwrap();
    assert_eq!(
        (last.actor.as_str(), last.reason.as_deref()),
        ("ana", Some("the bank shows no refund"))
    );
    j.execute_new(&step, |_| async { ok("{\"refund\":\"rf_1\"}") })
        .await
        .unwrap();
    // A step that is over cannot be "resolved" again.
    let again = j
        .operator()
        .resolve(&step.id, Resolution::Failed, "ana", "oops")
        .await;
    assert!(
        matches!(again, Err(JournalError::Conflict { .. })),
        "{again:?}"
    );
}

async fn an_open_circuit_parks_the_step_until_its_time(j: &Journal, clock: &ManualClock) {
    let step = super::new_step("r-park", "label", "c1", "carrier", b"{}");
    let s = j
        .execute_new(&step, |_| async {
            failed(Outcome::NotSent, Some(Duration::from_secs(30)))
        })
        .await
        .unwrap();
    assert_eq!(s.state, StepState::Parked);
    let at = s.parked_until.unwrap();
    assert_eq!(
        at,
        clock.now() + Duration::from_secs(30),
        "the time it was told"
    );
    assert_eq!(j.plan("r-park").await.unwrap()[0].1, Next::Wake { at });
    let early = j
        .execute_new(&step, |_| async { unreachable!() })
        .await
        .unwrap();
    assert_eq!(early.state, StepState::Parked, "not sent before its time");
    clock.advance(Duration::from_secs(31));
    let s = j.execute_new(&step, |_| async { ok("{}") }).await.unwrap();
    assert_eq!(s.state, StepState::Succeeded);
    assert_eq!(s.attempts, 2);
}

async fn moves_are_compare_and_set_and_arguments_are_checked(j: &Journal) {
    let step = super::new_step("r-cas", "invoice", "c1", "billing", b"{\"eur\":1}");
    j.begin(&step).await.unwrap();
    let wrong = j
        .transition(
            &step.id,
            &[StepState::Sent],
            StepState::Succeeded,
            Change::default(),
        )
        .await;
    assert!(matches!(
        wrong,
        Err(JournalError::Conflict {
            found: Some(StepState::Pending),
            ..
        })
    ));
    let skip = j
        .transition(
            &step.id,
            &[StepState::Pending],
            StepState::Succeeded,
            Change::default(),
        )
        .await;
    assert!(
        matches!(skip, Err(JournalError::Conflict { .. })),
        "pending cannot jump to succeeded"
    );
    // Naming an actor is no way around the rules: only `resolve` repairs.
    let named = Change {
        actor: Some("mallory".into()),
        ..Change::default()
    };
    let named = j
        .transition(&step.id, &[StepState::Pending], StepState::Succeeded, named)
        .await;
    assert!(
        matches!(named, Err(JournalError::Conflict { .. })),
        "{named:?}"
    );
    assert_eq!(
        j.runs().step_history(&step.id).await.unwrap().len(),
        1,
        "nothing written"
    );
    let other = super::new_step("r-cas", "invoice", "c1", "billing", b"{\"eur\":2}");
    assert!(matches!(
        j.begin(&other).await,
        Err(JournalError::ArgsChanged { .. })
    ));
}

async fn two_workers_never_hold_one_run(j: &Journal, clock: &ManualClock) {
    j.start_run("r-claim", "claimed", None).await.unwrap();
    let lease = Duration::from_secs(60);
    let next = |worker: &'static str| j.claim_next(worker, lease, &["claimed"]);
    assert_eq!(next("worker-a").await.unwrap().as_deref(), Some("r-claim"));
    assert_eq!(next("worker-b").await.unwrap(), None, "worker-a holds it");
    assert!(
        j.renew("r-claim", "worker-a", lease).await.unwrap(),
        "renewal"
    );
    clock.advance(Duration::from_secs(61));
    assert_eq!(
        next("worker-b").await.unwrap().as_deref(),
        Some("r-claim"),
        "an expired lease is free"
    );
    assert!(
        !j.renew("r-claim", "worker-a", lease).await.unwrap(),
        "a lease another worker took is not renewed"
    );
    j.release("r-claim", "worker-a").await.unwrap();
    assert_eq!(
        next("worker-c").await.unwrap(),
        None,
        "only the holder releases"
    );
    j.release("r-claim", "worker-b").await.unwrap();
    assert_eq!(next("worker-c").await.unwrap().as_deref(), Some("r-claim"));
    j.release("r-claim", "worker-c").await.unwrap();
}

async fn the_layer_journals_tool_calls_through_the_stack(j: &Journal) {
    type Req = http::Request<()>;
    let calls = Arc::new(AtomicU32::new(0));
    let c = calls.clone();
    let inner = service_fn(move |_req: Req| {
        c.fetch_add(1, Ordering::SeqCst);
        async { Ok::<_, backstop_core::CircuitOpen>(http::Response::new(())) }
    });
    let mut svc = JournalLayer::new(j.clone())
        .tool("carrier")
        .layer_into(inner);
    let with_context = || {
        let mut req = http::Request::new(());
        req.extensions_mut()
            .insert(backstop_idempotency::ActionContext::tool_call(
                "r-layer", "label", "c1",
            ));
        req
    };
    svc.ready()
        .await
        .unwrap()
        .call(with_context())
        .await
        .unwrap();
    let id = StepId::new("r-layer", "label", "c1");
    let s = j.runs().step(&id).await.unwrap().unwrap();
    assert_eq!(
        (s.state, s.tool.as_str()),
        (StepState::Succeeded, "carrier")
    );
    assert_eq!(
        s.key,
        backstop_idempotency::ActionContext::tool_call("r-layer", "label", "c1")
            .key()
            .as_str(),
        "the key the idempotency layer sends"
    );
    let again = svc.ready().await.unwrap().call(with_context()).await;
    let e = again.unwrap_err();
    assert!(e.to_string().contains("not sent again"), "{e}");
    assert_eq!(calls.load(Ordering::SeqCst), 1);
    // The same ids for another call (another URI, or other stated arguments): refused, named,
    // and not sent.
    let mut elsewhere = with_context();
    *elsewhere.uri_mut() = "/labels?parcel=2".parse().unwrap();
    let refused = svc
        .ready()
        .await
        .unwrap()
        .call(elsewhere)
        .await
        .unwrap_err();
    let why = refused.journal().expect("the journal refused it");
    assert!(
        matches!(why, JournalError::ArgsChanged { recorded, refused, .. }
            if recorded.tool == "carrier" && recorded.args_digest != refused.args_digest),
        "{why:?}"
    );
    let words = refused.to_string();
    assert!(
        words.contains("r-layer/label/c1")
            && words.contains("a different call cannot reuse a step's ids")
            && words.contains("not sent"),
        "{words}"
    );
    let mut stated = with_context();
    stated
        .extensions_mut()
        .insert(crate::StepArgs::new(b"{\"parcel\":2}"));
    let refused = svc.ready().await.unwrap().call(stated).await.unwrap_err();
    assert!(matches!(
        refused.journal(),
        Some(JournalError::ArgsChanged { .. })
    ));
    assert_eq!(calls.load(Ordering::SeqCst), 1, "neither was sent");
    // No tool-call context: passes through, unjournaled.
    svc.ready()
        .await
        .unwrap()
        .call(http::Request::new(()))
        .await
        .unwrap();
    assert_eq!(calls.load(Ordering::SeqCst), 2);
}

/// A journaled call reaches its service only after the journal's round trip: while it waits
/// for the journal it holds none of the service's capacity (a concurrency limit's permit), and
/// a service that then cannot be readied leaves the step not sent, to be sent again.
async fn the_layer_readies_the_service_when_the_step_is_sent(j: &Journal) {
    type Req = http::Request<()>;
    let calls = Arc::new(AtomicU32::new(0));
    let c = calls.clone();
    let inner = service_fn(move |_req: Req| {
        c.fetch_add(1, Ordering::SeqCst);
        async { Ok::<_, backstop_core::CircuitOpen>(http::Response::new(())) }
    });
    let svc = JournalLayer::new(j.clone())
        .tool("carrier")
        .layer_into(tower::limit::ConcurrencyLimit::new(inner, 1));
    let with_context = |run: &str| {
        let mut req = http::Request::new(());
        req.extensions_mut()
            .insert(backstop_idempotency::ActionContext::tool_call(
                run, "label", "c1",
            ));
        req
    };
    let mut cx = std::task::Context::from_waker(std::task::Waker::noop());
    let mut journaled = svc.clone();
    assert!(journaled.poll_ready(&mut cx).is_ready());
    let waiting = journaled.call(with_context("r-free"));
    let mut other = svc.clone();
    assert!(
        other.poll_ready(&mut cx).is_ready(),
        "a call waiting for the journal holds the service's only permit"
    );
    other.call(http::Request::new(())).await.unwrap();
    waiting.await.unwrap();
    let s = j.runs().step(&StepId::new("r-free", "label", "c1")).await;
    assert_eq!(s.unwrap().unwrap().state, StepState::Succeeded);
    assert_eq!(calls.load(Ordering::SeqCst), 2);

    // Readiness fails once, at the layer's own poll (the second): not sent, sent again later.
    let flaky = tower::service_fn(|_req: Req| async {
        Ok::<_, backstop_core::BoxError>(http::Response::new(()))
    });
    let flaky = backstop_testkit::NotReadyAt::new(flaky, 2);
    // Its judge would call any error of the call an unknown outcome.
    let judge = |r: &Result<http::Response<()>, backstop_core::BoxError>| match r {
        Ok(_) => CallResult::Succeeded {
            result: None,
            provider_ref: None,
        },
        Err(e) => CallResult::Failed {
            outcome: Outcome::Unknown,
            error: e.to_string(),
            retry_after: None,
        },
    };
    let mut svc = tower::Layer::layer(
        &JournalLayer::new(j.clone()).tool("carrier").judge(judge),
        flaky,
    );
    let e = svc
        .ready()
        .await
        .unwrap()
        .call(with_context("r-unready"))
        .await
        .unwrap_err();
    assert!(e.call().is_some(), "the service's own error: {e}");
    let id = StepId::new("r-unready", "label", "c1");
    let s = j.runs().step(&id).await.unwrap().unwrap();
    assert_eq!(
        s.state,
        StepState::FailedBeforeExecution,
        "not sent, not unknown"
    );
    svc.ready()
        .await
        .unwrap()
        .call(with_context("r-unready"))
        .await
        .unwrap();
    let s = j.runs().step(&id).await.unwrap().unwrap();
    assert_eq!(s.state, StepState::Succeeded);
}

trait LayerInto {
    fn layer_into<S>(&self, inner: S) -> crate::Journaled<S>;
}

impl LayerInto for JournalLayer {
    fn layer_into<S>(&self, inner: S) -> crate::Journaled<S> {
        tower::Layer::layer(self, inner)
    }
}

async fn a_compensation_is_a_journaled_step_of_its_own(j: &Journal) {
    let charge = super::new_step("r-comp", "charge", "c1", "payments", b"{\"eur\":9}");
    j.execute_new(&charge, |_| async { ok("{\"charge\":\"ch_1\"}") })
        .await
        .unwrap();
    // The refund fails with an unknown outcome first: the charge stays as it is.
    let first = j
        .compensate(
            &charge.id,
            "payments",
            b"{\"refund\":\"ch_1\"}",
            |_| async { failed(Outcome::Unknown, None) },
        )
        .await
        .unwrap();
    assert_eq!(first.state, StepState::Unknown);
    assert_eq!(&*first.id.step, "charge:compensate");
    assert_ne!(first.key, charge.key, "its own key");
    assert_eq!(first.kind, crate::StepKind::Compensation);
    let hooks = Reconcilers::new().tool("payments", |_: &Step| async { Reconciled::NotHappened });
    j.reconcile_run("r-comp", &hooks).await.unwrap();
    let charge_step = j
        .compensate(
            &charge.id,
            "payments",
            b"{\"refund\":\"ch_1\"}",
            |_| async { ok("{\"refund\":\"rf_1\"}") },
        )
        .await
        .unwrap();
    assert_eq!(charge_step.state, StepState::Compensated);
    // Two steps in one run: each step's history is its own, the run's holds both.
    let history = j.runs().step_history(&charge.id).await.unwrap();
    assert!(history.iter().all(|t| t.id == charge.id), "{history:?}");
    assert_eq!(
        states(&history),
        ["pending", "sent", "succeeded", "compensated"]
    );
    let all = j.runs().history("r-comp").await.unwrap();
    assert!(all.iter().any(|t| t.id == first.id) && all.len() > history.len());
    let pending = super::new_step("r-comp", "other", "c1", "payments", b"{}");
    j.begin(&pending).await.unwrap();
    let refused = j
        .compensate(&pending.id, "payments", b"{}", |_| async { unreachable!() })
        .await;
    assert!(
        matches!(refused, Err(JournalError::Conflict { .. })),
        "nothing to undo"
    );
}

/// Runs listed by workflow and state: the filter applies before the limit, so the two most
/// recent runs of a workflow are found behind five newer runs of another, most recent first.
async fn runs_are_listed_by_workflow_and_state_before_the_limit(j: &Journal, clock: &ManualClock) {
    for i in 0..3 {
        j.start_run(&format!("listed-refund-{i}"), "listed-refund", None)
            .await
            .unwrap();
        clock.advance(Duration::from_millis(10));
    }
    for i in 0..5 {
        j.start_run(&format!("listed-ship-{i}"), "listed-ship", None)
            .await
            .unwrap();
        clock.advance(Duration::from_millis(10));
    }
    let ids =
        |runs: Vec<crate::RunSummary>| -> Vec<String> { runs.into_iter().map(|r| r.run).collect() };
    let refunds = j
        .runs()
        .list(&RunFilter::latest(2).workflow("listed-refund"))
        .await
        .unwrap();
    assert_eq!(ids(refunds), ["listed-refund-2", "listed-refund-1"]);
    j.operator()
        .cancel("listed-refund-0", "ops", "listed apart")
        .await
        .unwrap();
    clock.advance(Duration::from_millis(10));
    let cancelled = j
        .runs()
        .list(
            &RunFilter::latest(5)
                .workflow("listed-refund")
                .state(RunState::Cancelled),
        )
        .await
        .unwrap();
    assert_eq!(ids(cancelled), ["listed-refund-0"]);
    let latest = j.runs().list(&RunFilter::latest(5)).await.unwrap();
    assert_eq!(ids(latest)[0], "listed-refund-0", "the latest change first");
    let none = j
        .runs()
        .list(&RunFilter::latest(5).workflow("listed-nothing"))
        .await
        .unwrap();
    assert!(none.is_empty());
}

async fn all(j: Journal, clock: ManualClock) {
    runs_are_listed_by_workflow_and_state_before_the_limit(&j, &clock).await;
    a_compensation_is_a_journaled_step_of_its_own(&j).await;
    a_done_step_is_not_called_again(&j, &clock).await;
    an_unknown_step_is_reconciled_before_it_is_sent_again(&j).await;
    a_step_left_sent_by_a_crash_is_unknown_and_resent_only_if_it_did_not_happen(&j).await;
    what_nobody_can_tell_goes_to_a_person_who_resolves_it(&j, &clock).await;
    an_open_circuit_parks_the_step_until_its_time(&j, &clock).await;
    moves_are_compare_and_set_and_arguments_are_checked(&j).await;
    two_workers_never_hold_one_run(&j, &clock).await;
    the_layer_journals_tool_calls_through_the_stack(&j).await;
    the_layer_readies_the_service_when_the_step_is_sent(&j).await;
    a_repair_made_while_the_call_is_out_is_kept(&j).await;
    a_run_waits_until_every_step_a_person_holds_is_resolved(&j).await;
}

/// Two steps of one run go to a person: resolving the first leaves the run waiting, resolving
/// the second puts it back to pending.
async fn a_run_waits_until_every_step_a_person_holds_is_resolved(j: &Journal) {
    j.start_run("r-two-unknown", "refunds", None).await.unwrap();
    let steps = ["first", "second"]
        .map(|name| super::new_step("r-two-unknown", name, "", "ledger", name.as_bytes()));
    for step in &steps {
        j.execute_new(step, |_| async { failed(Outcome::Unknown, None) })
            .await
            .unwrap();
    }
    let nobody_knows = Reconcilers::new().tool("ledger", |_: &Step| async {
        Reconciled::CannotTell {
            why: "the ledger has no lookup".into(),
        }
    });
    let report = j
        .reconcile_run("r-two-unknown", &nobody_knows)
        .await
        .unwrap();
    assert_eq!(report.human.len(), 2);
    let state = || async { j.runs().get("r-two-unknown").await.unwrap().unwrap().state };
    assert_eq!(state().await, RunState::NeedsHuman);
    // The first resolved, the second still waits for a person; then both.
    for (step, then) in steps.iter().zip([RunState::NeedsHuman, RunState::Pending]) {
        j.operator()
            .resolve(&step.id, Resolution::Failed, "ops", "checked the ledger")
            .await
            .unwrap();
        assert_eq!(state().await, then, "after {}", step.id);
    }
}

/// An operator settles a step while its call is out (the worker seemed stuck): the call's own
/// outcome, when it comes back, is refused and writes nothing, so the operator's word stands.
async fn a_repair_made_while_the_call_is_out_is_kept(j: &Journal) {
    let step = super::new_step("r-repaired-in-flight", "s", "c", "t", b"");
    let by_hand = Resolution::Succeeded {
        result: Some("settled by hand".into()),
    };
    let outcome = j
        .execute_new(&step, |sent| async move {
            j.operator()
                .resolve(&sent.id, by_hand, "ops", "the worker looked stuck")
                .await
                .unwrap();
            ok("the call's own")
        })
        .await;
    assert!(
        matches!(
            outcome,
            Err(JournalError::Conflict {
                found: Some(StepState::ReconciledSucceeded),
                ..
            })
        ),
        "{outcome:?}"
    );
    let s = j.runs().step(&step.id).await.unwrap().unwrap();
    assert_eq!(
        (s.state, s.result.as_deref()),
        (StepState::ReconciledSucceeded, Some("settled by hand"))
    );
    let moves: Vec<StepState> = j
        .runs()
        .step_history(&step.id)
        .await
        .unwrap()
        .into_iter()
        .map(|t| t.to)
        .collect();
    assert_eq!(
        moves,
        [
            StepState::Pending,
            StepState::Sent,
            StepState::ReconciledSucceeded
        ]
    );
}

#[tokio::test]
async fn every_scenario_on_sqlite() {
    let clock = ManualClock::new();
    let (_dir, j) = sqlite("all", &clock).await;
    all(j, clock).await;
}

// The PostgreSQL tests need the `postgres` feature: `cargo test --workspace` has it (the
// workspace package's dev-dependency turns it on), as does
// `cargo test -p backstop-journal --features postgres`.
#[cfg(feature = "postgres")]
#[tokio::test]
async fn every_scenario_on_postgres() {
    let pg = PostgresServer::start().await;
    let clock = ManualClock::new();
    let j = Journal::postgres(&pg.url())
        .await
        .unwrap()
        .with_clock(clock.reader());
    all(j, clock).await;
}

#[tokio::test]
async fn the_sqlite_file_keeps_everything_across_reopening() {
    let clock = ManualClock::new();
    let (_dir, path) = temp_db("reopen");
    let j = Journal::sqlite(&path)
        .await
        .unwrap()
        .with_clock(clock.reader());
    let step = super::new_step("r-reopen", "s", "c", "t", b"");
    j.execute_new(&step, |_| async { ok("kept") })
        .await
        .unwrap();
    drop(j);
    let j = Journal::sqlite(&path).await.unwrap();
    let s = j.runs().step(&step.id).await.unwrap().unwrap();
    assert_eq!(
        (s.state, s.result.as_deref()),
        (StepState::Succeeded, Some("kept"))
    );
}

/// Many workers claiming at once on PostgreSQL (`FOR UPDATE SKIP LOCKED`): each run is taken
/// by exactly one of them.
#[cfg(feature = "postgres")]
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn postgres_workers_claiming_together_take_different_runs() {
    let pg = PostgresServer::start().await;
    let j = Journal::postgres(&pg.url()).await.unwrap();
    for i in 0..20 {
        j.start_run(&format!("run-{i:02}"), "w", None)
            .await
            .unwrap();
    }
    let mut workers = Vec::new();
    for w in 0..8 {
        let j = j.clone();
        workers.push(tokio::spawn(async move {
            // Bounded: a claim that hands out runs already held shows as more than 20.
            let mut mine = Vec::new();
            let worker = format!("worker-{w}");
            for _ in 0..=20 {
                let claim = j.claim_next(&worker, Duration::from_secs(60), &["w"]);
                match claim.await.unwrap() {
                    Some(run) => mine.push(run),
                    None => break,
                }
            }
            mine
        }));
    }
    let mut all = Vec::new();
    for w in workers {
        all.extend(w.await.unwrap());
    }
    all.sort();
    let n = all.len();
    all.dedup();
    assert_eq!(n, 20, "every run claimed once: {all:?}");
    assert_eq!(all.len(), 20);
}

#[tokio::test]
async fn sqlite_claim_next_takes_each_run_once() {
    let clock = ManualClock::new();
    let (_dir, j) = sqlite("claim-next", &clock).await;
    for i in 0..5 {
        j.start_run(&format!("run-{i}"), "wf", None).await.unwrap();
    }
    let lease = Duration::from_secs(60);
    // Bounded: a claim that hands out runs already held shows as more than 5.
    let mut got = Vec::new();
    for _ in 0..=5 {
        match j.claim_next("w", lease, &["wf"]).await.unwrap() {
            Some(run) => got.push(run),
            None => break,
        }
    }
    assert_eq!(got.len(), 5, "{got:?}");
    clock.advance(Duration::from_secs(61));
    assert!(j.claim_next("w2", lease, &["wf"]).await.unwrap().is_some());
}

/// Workers racing to move one step: the state is compare-and-set in the database, so exactly
/// one moves it and the others are told it moved.
async fn racing_moves_let_exactly_one_through(j: Journal) {
    for round in 0..10 {
        let step = super::new_step(&format!("r-race-{round}"), "s", "c", "t", b"");
        j.begin(&step).await.unwrap();
        let mut racers = Vec::new();
        for _ in 0..8 {
            let j = j.clone();
            let id = step.id.clone();
            racers.push(tokio::spawn(async move {
                j.transition(
                    &id,
                    &[StepState::Pending],
                    StepState::Sent,
                    Change::attempt(),
                )
                .await
            }));
        }
        let mut moved = 0;
        for r in racers {
            match r.await.unwrap() {
                Ok(_) => moved += 1,
                Err(JournalError::Conflict { .. }) => {}
                Err(e) => panic!("{e}"),
            }
        }
        assert_eq!(moved, 1, "round {round}");
        let s = j.runs().step(&step.id).await.unwrap().unwrap();
        assert_eq!(s.attempts, 1);
        assert_eq!(j.runs().step_history(&step.id).await.unwrap().len(), 2);
    }
}

#[cfg(feature = "postgres")]
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn postgres_racing_moves_let_exactly_one_through() {
    let pg = PostgresServer::start().await;
    racing_moves_let_exactly_one_through(Journal::postgres(&pg.url()).await.unwrap()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn sqlite_racing_moves_let_exactly_one_through() {
    let clock = ManualClock::new();
    let (_dir, j) = sqlite("race", &clock).await;
    racing_moves_let_exactly_one_through(j).await;
}
