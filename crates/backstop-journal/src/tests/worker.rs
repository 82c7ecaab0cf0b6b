//! Runs as records and the worker, against real databases (a SQLite file, and a PostgreSQL
//! cluster of the test's own): a run killed anywhere is pending and recovered by a worker with
//! no person, parked steps wake by themselves, an operator cancels, retries and stubs, and
//! several workers on one PostgreSQL never run one run twice at once.

use crate::{
    CallResult, Journal, JournalError, Reconciled, Reconcilers, Resolution, RunContext, RunEnd,
    RunFilter, RunState, Step, StepId, StepState, Worker,
};
use backstop_core::Outcome;
use backstop_testkit::{ManualClock, TempDir, scratch_dir};
use std::{
    collections::HashMap,
    path::PathBuf,
    sync::{
        Arc, Mutex,
        atomic::{AtomicU32, Ordering},
    },
    time::Duration,
};
use tokio::sync::Notify;

/// A journal file's path in a scratch directory, removed when the guard drops.
fn temp_db(name: &str) -> (TempDir, PathBuf) {
    let dir = scratch_dir(&format!("worker-{name}"));
    let path = dir.path().join("journal.db");
    (dir, path)
}

/// How many times each (run, step) was called.
#[derive(Clone, Default)]
struct Calls(Arc<Mutex<HashMap<(String, String), u32>>>);

impl Calls {
    fn hit(&self, run: &str, step: &str) {
        *self
            .0
            .lock()
            .unwrap()
            .entry((run.to_owned(), step.to_owned()))
            .or_default() += 1;
    }
    fn of(&self, run: &str, step: &str) -> u32 {
        self.0
            .lock()
            .unwrap()
            .get(&(run.to_owned(), step.to_owned()))
            .copied()
            .unwrap_or(0)
    }
}

const LEASE: Duration = Duration::from_millis(300);

/// The two-step workflow `ship`: label then notify, each counted; the output names both.
fn ship(calls: &Calls) -> impl Fn(RunContext) -> futures_like::Boxed + Send + Sync + 'static {
    let calls = calls.clone();
    move |ctx: RunContext| {
        let calls = calls.clone();
        Box::pin(async move {
            let run = ctx.run_id().to_owned();
            let c = calls.clone();
            let label = ctx
                .step("label", "carrier", b"{\"parcel\":1}", |_| async move {
                    c.hit(&run, "label");
                    CallResult::Succeeded {
                        result: Some("\"lbl_1\"".into()),
                        provider_ref: None,
                    }
                })
                .await?;
            let run = ctx.run_id().to_owned();
            let c = calls.clone();
            let notify = ctx
                .step("notify", "mailer", b"{}", |_| async move {
                    c.hit(&run, "notify");
                    CallResult::Succeeded {
                        result: Some("\"msg_1\"".into()),
                        provider_ref: None,
                    }
                })
                .await?;
            Ok(Some(format!(
                "{}+{}",
                label.result.unwrap_or_default(),
                notify.result.unwrap_or_default()
            )))
        })
    }
}

mod futures_like {
    use crate::WorkflowResult;
    use std::{future::Future, pin::Pin};
    pub(crate) type Boxed = Pin<Box<dyn Future<Output = WorkflowResult> + Send>>;
}

fn worker(j: &Journal, id: &str, calls: &Calls) -> Worker {
    Worker::new(j.clone(), id)
        .workflow("ship", ship(calls))
        .lease(LEASE)
        .poll_interval(Duration::from_millis(10))
        .retry_delay(Duration::from_millis(50))
}

/// A worker that claimed `run` and died after `steps` of its steps (no release, no record of
/// the run's end: what SIGKILL leaves), on the journal directly.
async fn died_after(j: &Journal, run: &str, steps: &[&str]) {
    assert_eq!(
        j.claim_next("dead", LEASE, &["ship"])
            .await
            .unwrap()
            .as_deref(),
        Some(run)
    );
    for step in steps {
        let args: &[u8] = if *step == "label" {
            b"{\"parcel\":1}"
        } else {
            b"{}"
        };
        let tool = if *step == "label" {
            "carrier"
        } else {
            "mailer"
        };
        let new = super::new_step(run, step, "", tool, args);
        j.execute_new(&new, |_| async {
            CallResult::Succeeded {
                result: Some(format!("\"{step}-first\"")),
                provider_ref: None,
            }
        })
        .await
        .unwrap();
    }
}

async fn a_run_killed_anywhere_is_pending_and_recovered(j: &Journal, clock: &ManualClock) {
    let calls = Calls::default();
    let w = worker(j, "w2", &calls);
    for (run, done) in [
        ("before-first", &[][..]),
        ("between", &["label"][..]),
        ("after-last", &["label", "notify"][..]),
    ] {
        j.start_run(run, "ship", Some("{}")).await.unwrap();
        died_after(j, run, done).await;
        // It is not done: its record says pending, whatever its steps say.
        let record = j.runs().get(run).await.unwrap().unwrap();
        assert_eq!(record.state, RunState::Pending, "{run}");
        assert_eq!(record.claimed_by.as_deref(), Some("dead"));
        let pending = j
            .runs()
            .list(&RunFilter::latest(50).state(RunState::Pending))
            .await
            .unwrap();
        assert!(pending.iter().any(|r| r.run == run), "{run}");
        // The dead worker's lease still holds: nobody takes it yet.
        assert!(w.run_once().await.unwrap().is_none(), "{run}");
        clock.advance(LEASE * 2);
        let report = w.run_once().await.unwrap().expect("the run is offered");
        assert_eq!(report.run, run);
        let expected_output = match run {
            "before-first" => "\"lbl_1\"+\"msg_1\"",
            "between" => "\"label-first\"+\"msg_1\"",
            _ => "\"label-first\"+\"notify-first\"",
        };
        assert_eq!(
            report.end,
            RunEnd::Succeeded {
                output: Some(expected_output.into())
            },
            "{run}"
        );
        // Steps that completed were not called again.
        let again = |s: &str| done.contains(&s);
        assert_eq!(calls.of(run, "label"), u32::from(!again("label")), "{run}");
        assert_eq!(
            calls.of(run, "notify"),
            u32::from(!again("notify")),
            "{run}"
        );
        let record = j.runs().get(run).await.unwrap().unwrap();
        assert_eq!(record.state, RunState::Succeeded);
        assert_eq!(record.claimed_by, None);
        // Over: never offered again.
        clock.advance(LEASE * 2);
        assert!(w.run_once().await.unwrap().is_none());
    }
    let events = j.runs().events("between").await.unwrap();
    let actions: Vec<_> = events.iter().map(|e| e.action.as_str()).collect();
    assert_eq!(actions, ["started", "succeeded"]);
    assert_eq!(events[1].actor, "w2");
}

/// Starts `run` and leaves it as a worker killed after writing its label step `sent` does.
async fn died_while_sent(j: &Journal, run: &str) -> Step {
    j.start_run(run, "ship", None).await.unwrap();
    assert!(
        j.claim_next("dead", LEASE, &["ship"])
            .await
            .unwrap()
            .is_some()
    );
    let new = super::new_step(run, "label", "", "carrier", b"{\"parcel\":1}");
    let label = j.begin(&new).await.unwrap();
    let sent = crate::steps::Change::attempt();
    j.transition(&label.id, &[StepState::Pending], StepState::Sent, sent)
        .await
        .unwrap()
}

async fn a_step_left_sent_is_reconciled_before_the_workflow_runs_again(
    j: &Journal,
    clock: &ManualClock,
) {
    let calls = Calls::default();
    // The worker wrote `sent` and died before the label's outcome was recorded.
    let label = died_while_sent(j, "in-flight").await;
    clock.advance(LEASE * 2);
    // The carrier has it, by key: the label is not bought twice.
    let asked = Arc::new(AtomicU32::new(0));
    let a = asked.clone();
    let hooks = Reconcilers::new().tool("carrier", move |s: &Step| {
        a.fetch_add(1, Ordering::SeqCst);
        let key = s.key.clone();
        async move {
            Reconciled::Happened {
                result: Some(format!("\"found-by-{}\"", &key[..8])),
                provider_ref: None,
            }
        }
    });
    let report = worker(j, "w2", &calls)
        .reconcilers(hooks)
        .run_once()
        .await
        .unwrap()
        .unwrap();
    assert_eq!(asked.load(Ordering::SeqCst), 1);
    assert_eq!(report.reconciled.reconciled, vec![label.id.clone()]);
    assert_eq!(calls.of("in-flight", "label"), 0, "reconciled, not resent");
    assert_eq!(calls.of("in-flight", "notify"), 1);
    assert!(matches!(report.end, RunEnd::Succeeded { .. }));

    // Without a hook nobody can tell: the run waits for a person, not out again.
    let label = died_while_sent(j, "in-doubt").await;
    clock.advance(LEASE * 2);
    let w = worker(j, "w2", &calls);
    let report = w.run_once().await.unwrap().unwrap();
    assert!(
        matches!(report.end, RunEnd::NeedsHuman { .. }),
        "{report:?}"
    );
    assert_eq!(calls.of("in-doubt", "label"), 0);
    let human = j
        .runs()
        .list(&RunFilter::latest(10).state(RunState::NeedsHuman))
        .await
        .unwrap();
    assert!(human.iter().any(|r| r.run == "in-doubt"));
    clock.advance(LEASE * 2);
    assert!(
        w.run_once().await.unwrap().is_none(),
        "a person decides first"
    );
    // The operator checked with the carrier: it happened. The run goes on by itself.
    j.operator()
        .resolve(
            &label.id,
            Resolution::Succeeded {
                result: Some("\"lbl_ops\"".into()),
            },
            "ana",
            "the carrier shows the label",
        )
        .await
        .unwrap();
    assert_eq!(
        j.runs().get("in-doubt").await.unwrap().unwrap().state,
        RunState::Pending
    );
    let report = w.run_once().await.unwrap().unwrap();
    assert_eq!(
        report.end,
        RunEnd::Succeeded {
            output: Some("\"lbl_ops\"+\"msg_1\"".into())
        }
    );
    assert_eq!(calls.of("in-doubt", "label"), 0);
}

async fn an_operator_cancels_a_running_run(j: &Journal) {
    let calls = Calls::default();
    let entered = Arc::new(Notify::new());
    let (c, e) = (calls.clone(), entered.clone());
    let w = Worker::new(j.clone(), "w1")
        .lease(Duration::from_millis(90))
        .workflow("slow", move |ctx: RunContext| {
            let (c, e) = (c.clone(), e.clone());
            async move {
                ctx.step("wait", "slow-api", b"{}", |_| async move {
                    c.hit("cancel-me", "wait");
                    e.notify_one();
                    std::future::pending::<CallResult>().await
                })
                .await?;
                Ok(None)
            }
        });
    j.start_run("cancel-me", "slow", None).await.unwrap();
    let running = tokio::spawn({
        let w = w.clone();
        async move { w.run_once().await }
    });
    entered.notified().await;
    let cancelled = j
        .operator()
        .cancel("cancel-me", "ana", "the customer withdrew the order")
        .await
        .unwrap();
    assert_eq!(cancelled.state, RunState::Cancelled);
    // The worker stops at its next renewal (a third of its lease).
    let report = tokio::time::timeout(Duration::from_secs(5), running)
        .await
        .expect("the worker stops")
        .unwrap()
        .unwrap()
        .unwrap();
    assert_eq!(report.end, RunEnd::Cancelled);
    assert_eq!(calls.of("cancel-me", "wait"), 1);
    assert!(w.run_once().await.unwrap().is_none(), "never offered again");
    let events = j.runs().events("cancel-me").await.unwrap();
    let last = events.last().unwrap();
    assert_eq!(
        (
            last.action.as_str(),
            last.actor.as_str(),
            last.reason.as_deref()
        ),
        ("cancelled", "ana", Some("the customer withdrew the order"))
    );
    // Over: cancelling again is refused, and says why.
    let again = j
        .operator()
        .cancel("cancel-me", "ana", "again")
        .await
        .unwrap_err();
    assert!(
        matches!(&again, JournalError::RunRefused { why, .. } if why.contains("cancelled")),
        "{again}"
    );
    assert!(matches!(
        j.operator().cancel("no-such-run", "ana", "x").await,
        Err(JournalError::NotFound(_))
    ));
}

async fn a_parked_step_wakes_by_itself(j: &Journal) {
    let calls = Calls::default();
    let c = calls.clone();
    let w = Worker::new(j.clone(), "w1")
        .lease(LEASE)
        .poll_interval(Duration::from_millis(10))
        .workflow("remind", move |ctx: RunContext| {
            let c = c.clone();
            async move {
                let c2 = c.clone();
                let sent = ctx
                    .step("remind", "mailer", b"{}", |_| async move {
                        c2.hit("parked", "remind");
                        if c2.of("parked", "remind") == 1 {
                            // The circuit is open: come back in 150 ms.
                            CallResult::Failed {
                                outcome: Outcome::NotSent,
                                error: "mailer is unavailable".into(),
                                retry_after: Some(Duration::from_millis(150)),
                            }
                        } else {
                            CallResult::Succeeded {
                                result: Some("\"sent\"".into()),
                                provider_ref: None,
                            }
                        }
                    })
                    .await?;
                Ok(sent.result)
            }
        });
    j.start_run("parked", "remind", None).await.unwrap();
    let first = w.run_once().await.unwrap().unwrap();
    assert!(matches!(first.end, RunEnd::Deferred { .. }), "{first:?}");
    let record = j.runs().get("parked").await.unwrap().unwrap();
    assert_eq!(record.state, RunState::Pending);
    assert!(record.wake_at.is_some());
    // Not before its time.
    assert!(w.run_once().await.unwrap().is_none());
    // A worker loop, and nobody calling anything: the step is sent again when it is due.
    let shutdown = Arc::new(Notify::new());
    let looping = tokio::spawn({
        let (w, s) = (w.clone(), shutdown.clone());
        async move { w.run_until(s.notified()).await }
    });
    let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
    while j.runs().get("parked").await.unwrap().unwrap().state != RunState::Succeeded {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the parked run woke"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    shutdown.notify_one();
    looping.await.unwrap().unwrap();
    assert_eq!(calls.of("parked", "remind"), 2);
}

async fn a_worker_shut_down_gives_its_run_back_at_once(j: &Journal) {
    let entered = Arc::new(Notify::new());
    let e = entered.clone();
    let w = Worker::new(j.clone(), "w1")
        .lease(Duration::from_secs(60))
        .workflow("long", move |ctx: RunContext| {
            let e = e.clone();
            async move {
                ctx.step("wait", "slow-api", b"{}", |_| async move {
                    e.notify_one();
                    std::future::pending::<CallResult>().await
                })
                .await?;
                Ok(None)
            }
        });
    j.start_run("long-run", "long", None).await.unwrap();
    let shutdown = Arc::new(Notify::new());
    let looping = tokio::spawn({
        let (w, s) = (w.clone(), shutdown.clone());
        async move { w.run_until(s.notified()).await }
    });
    entered.notified().await;
    assert_eq!(
        j.runs()
            .get("long-run")
            .await
            .unwrap()
            .unwrap()
            .claimed_by
            .as_deref(),
        Some("w1")
    );
    shutdown.notify_one();
    looping.await.unwrap().unwrap();
    let record = j.runs().get("long-run").await.unwrap().unwrap();
    assert_eq!(record.state, RunState::Pending);
    assert_eq!(
        record.claimed_by, None,
        "released, not left to a 60 s lease"
    );
    // Another worker takes it at once; the step in flight is reconciled first (no hook here:
    // a person decides).
    let other =
        Worker::new(j.clone(), "w2").workflow("long", |_ctx: RunContext| async { Ok(None) });
    let report = other.run_once().await.unwrap().unwrap();
    assert_eq!(report.run, "long-run");
    assert!(
        matches!(report.end, RunEnd::NeedsHuman { .. }),
        "{report:?}"
    );
}

async fn the_operator_retries_and_stubs_failed_steps(j: &Journal) {
    let calls = Calls::default();
    let keys = Arc::new(Mutex::new(Vec::new()));
    let (c, k) = (calls.clone(), keys.clone());
    let w = Worker::new(j.clone(), "w1").workflow("charge", move |ctx: RunContext| {
        let (c, k) = (c.clone(), k.clone());
        async move {
            let run = ctx.run_id().to_owned();
            let charged = ctx
                .step("charge", "payments", b"{\"eur\":40}", |sent| async move {
                    c.hit(&run, "charge");
                    k.lock().unwrap().push((run.clone(), sent.key.clone()));
                    if c.of(&run, "charge") == 1 {
                        CallResult::Failed {
                            outcome: Outcome::Completed,
                            error: "payments answered 422: card declined".into(),
                            retry_after: None,
                        }
                    } else {
                        CallResult::Succeeded {
                            result: Some("\"ch_2\"".into()),
                            provider_ref: None,
                        }
                    }
                })
                .await?;
            Ok(charged.result)
        }
    });
    for run in ["retried", "stubbed"] {
        j.start_run(run, "charge", None).await.unwrap();
        let report = w.run_once().await.unwrap().unwrap();
        assert!(
            matches!(&report.end, RunEnd::Failed { error } if error.contains("card declined")),
            "{report:?}"
        );
        let failed = j
            .runs()
            .list(&RunFilter::latest(10).state(RunState::Failed))
            .await
            .unwrap();
        assert!(failed.iter().any(|r| r.run == run));
        assert!(
            w.run_once().await.unwrap().is_none(),
            "a failed run is over"
        );
    }
    let id = StepId::new("retried", "charge", "");
    let step = j
        .operator()
        .retry(&id, "ana", "the customer updated the card")
        .await
        .unwrap();
    assert_eq!(step.state, StepState::Pending);
    assert_eq!(
        j.runs().get("retried").await.unwrap().unwrap().state,
        RunState::Pending
    );
    let report = w.run_once().await.unwrap().unwrap();
    assert_eq!(
        report.end,
        RunEnd::Succeeded {
            output: Some("\"ch_2\"".into())
        }
    );
    {
        let keys: Vec<_> = keys
            .lock()
            .unwrap()
            .iter()
            .filter(|(run, _)| run == "retried")
            .map(|(_, key)| key.clone())
            .collect();
        assert_eq!(keys.len(), 2);
        assert_eq!(keys[0], keys[1], "the same key on the resend");
    }
    let history = j.runs().step_history(&id).await.unwrap();
    let by_ana = history.iter().find(|t| t.actor == "ana").unwrap();
    assert!(
        by_ana
            .reason
            .as_deref()
            .unwrap()
            .contains("updated the card")
    );

    let id = StepId::new("stubbed", "charge", "");
    let step = j
        .operator()
        .stub(&id, "\"ch_manual\"", "ana", "charged by hand at the till")
        .await
        .unwrap();
    assert_eq!(step.state, StepState::ReconciledSucceeded);
    let report = w.run_once().await.unwrap().unwrap();
    assert_eq!(
        report.end,
        RunEnd::Succeeded {
            output: Some("\"ch_manual\"".into())
        },
        "the workflow sees the operator's result"
    );
    assert_eq!(
        calls.of("stubbed", "charge"),
        1,
        "and the tool is not called"
    );

    // A step that succeeded is neither retried nor stubbed; nor is a step of a run that is over.
    let done = StepId::new("retried", "charge", "");
    assert!(matches!(
        j.operator().retry(&done, "ana", "again").await,
        Err(JournalError::RunRefused { .. })
    ));
    assert!(matches!(
        j.operator()
            .stub(&StepId::new("stubbed", "nope", ""), "1", "ana", "x")
            .await,
        Err(JournalError::NotFound(_))
    ));
}

async fn starting_a_run_twice(j: &Journal) {
    let first = j
        .start_run("order-9", "ship", Some("{\"order\":9}"))
        .await
        .unwrap();
    let again = j
        .start_run("order-9", "ship", Some("{\"order\":9}"))
        .await
        .unwrap();
    assert_eq!(first, again, "the same start is the same run");
    let other = j
        .start_run("order-9", "ship", Some("{\"order\":10}"))
        .await
        .unwrap_err();
    assert!(
        matches!(&other, JournalError::RunRefused { run, .. } if run == "order-9"),
        "{other}"
    );
    assert!(other.to_string().contains("cannot reuse its id"), "{other}");
}

async fn a_panicking_workflow_fails_its_run(j: &Journal) {
    let w = Worker::new(j.clone(), "w1").workflow("boom", |_ctx: RunContext| async {
        if true {
            panic!("the workflow's own bug");
        }
        Ok(None)
    });
    j.start_run("boom-1", "boom", None).await.unwrap();
    let report = w.run_once().await.unwrap().unwrap();
    assert!(
        matches!(&report.end, RunEnd::Failed { error } if error.contains("the workflow's own bug")),
        "{report:?}"
    );
}

/// A workflow undoes an action it took: the compensation is a step of its own, the action is
/// marked compensated, and a resumed run neither charges nor refunds again. A step of another
/// run is not the workflow's to undo.
async fn a_workflow_compensates_an_action_it_took(j: &Journal) {
    let calls = Calls::default();
    let ok = |value: &str| CallResult::Succeeded {
        result: Some(format!("\"{value}\"")),
        provider_ref: None,
    };
    let undo = |ctx: RunContext| {
        let calls = calls.clone();
        async move {
            let run = ctx.run_id().to_owned();
            let charge = ctx
                .step("charge", "payments", b"{\"eur\":9}", |_| async {
                    calls.hit(&run, "charge");
                    ok("ch_1")
                })
                .await?;
            let undone = ctx
                .compensate(&charge.id, "payments", b"{\"refund\":\"ch_1\"}", |sent| {
                    assert_eq!(sent.id.step.as_ref(), "charge:compensate");
                    calls.hit(&run, "refund");
                    async { ok("rf_1") }
                })
                .await?;
            crate::WorkflowResult::Ok(Some(undone.state.to_string()))
        }
    };
    let ctx = RunContext::new(j.clone(), "undo-1", "undo", None);
    assert_eq!(
        undo(ctx.clone()).await.unwrap().as_deref(),
        Some("compensated")
    );
    // Resumed: both steps are over, and neither is called again.
    assert_eq!(undo(ctx).await.unwrap().as_deref(), Some("compensated"));
    assert_eq!(
        (calls.of("undo-1", "charge"), calls.of("undo-1", "refund")),
        (1, 1)
    );
    let steps = j.runs().steps("undo-1").await.unwrap();
    let state = |name: &str| steps.iter().find(|s| &*s.id.step == name).map(|s| s.state);
    assert_eq!(state("charge"), Some(StepState::Compensated));
    assert_eq!(state("charge:compensate"), Some(StepState::Succeeded));

    let other = RunContext::new(j.clone(), "undo-2", "undo", None);
    let charge = StepId::new("undo-1", "charge", "");
    let refused = other
        .compensate(&charge, "payments", b"{}", |_| async { ok("rf_2") })
        .await
        .unwrap_err();
    assert!(
        refused.to_string().contains("belongs to another run"),
        "{refused}"
    );
    assert!(j.runs().steps("undo-2").await.unwrap().is_empty());
}

/// A step that makes several tool calls (an agent's turn asking for two tools) journals each
/// under its call id, with a key of its own; a resumed run calls neither again, and a step id
/// of another run is refused.
async fn a_step_journals_each_of_its_tool_calls(j: &Journal) {
    let calls = Calls::default();
    let turn = |ctx: RunContext| {
        let calls = calls.clone();
        async move {
            let run = ctx.run_id().to_owned();
            let mut answers = Vec::new();
            for call in ["call_a", "call_b"] {
                let id = StepId::new(&run, "turn-1", call);
                let done = ctx
                    .execute(&id, "search", call.as_bytes(), |_| {
                        calls.hit(&run, call);
                        async move {
                            CallResult::Succeeded {
                                result: Some(format!("\"{call}\"")),
                                provider_ref: None,
                            }
                        }
                    })
                    .await?;
                answers.push(done.result.unwrap_or_default());
            }
            crate::WorkflowResult::Ok(Some(answers.join("+")))
        }
    };
    let ctx = RunContext::new(j.clone(), "turn-run", "agent", None);
    let first = turn(ctx.clone()).await.unwrap();
    assert_eq!(
        turn(ctx.clone()).await.unwrap(),
        first,
        "resumed from the journal"
    );
    assert_eq!(first.as_deref(), Some("\"call_a\"+\"call_b\""));
    assert_eq!(
        (
            calls.of("turn-run", "call_a"),
            calls.of("turn-run", "call_b")
        ),
        (1, 1)
    );
    let steps = j.runs().steps("turn-run").await.unwrap();
    assert_eq!(steps.len(), 2, "{steps:?}");
    assert!(steps.iter().all(|s| &*s.id.step == "turn-1"));
    assert_ne!(steps[0].key, steps[1].key, "each call has its own key");

    let elsewhere = StepId::new("another-run", "turn-1", "call_a");
    let refused = ctx
        .execute(&elsewhere, "search", b"", |_| async {
            unreachable!("not called")
        })
        .await
        .unwrap_err();
    assert!(
        refused.to_string().contains("belongs to another run"),
        "{refused}"
    );
    assert!(j.runs().steps("another-run").await.unwrap().is_empty());
}

async fn all(j: Journal, clock: ManualClock) {
    a_run_killed_anywhere_is_pending_and_recovered(&j, &clock).await;
    a_step_left_sent_is_reconciled_before_the_workflow_runs_again(&j, &clock).await;
    starting_a_run_twice(&j).await;
    a_panicking_workflow_fails_its_run(&j).await;
    the_operator_retries_and_stubs_failed_steps(&j).await;
    a_workflow_compensates_an_action_it_took(&j).await;
    a_step_journals_each_of_its_tool_calls(&j).await;
}

/// Scenarios on the system clock (leases renewed, timers due in real time).
async fn all_in_real_time(j: Journal) {
    an_operator_cancels_a_running_run(&j).await;
    a_parked_step_wakes_by_itself(&j).await;
    a_worker_shut_down_gives_its_run_back_at_once(&j).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_scenario_on_sqlite() {
    let clock = ManualClock::new();
    let (_scenarios, path) = temp_db("scenarios");
    let j = Journal::sqlite(path)
        .await
        .unwrap()
        .with_clock(clock.reader());
    all(j, clock).await;
    let (_real_time, path) = temp_db("real-time");
    all_in_real_time(Journal::sqlite(path).await.unwrap()).await;
}

#[cfg(feature = "postgres")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_scenario_on_postgres() {
    let pg = backstop_testkit::PostgresServer::start().await;
    let clock = ManualClock::new();
    all(
        Journal::postgres(&pg.url())
            .await
            .unwrap()
            .with_clock(clock.reader()),
        clock,
    )
    .await;
    let real = backstop_testkit::PostgresServer::start().await;
    all_in_real_time(Journal::postgres(&real.url()).await.unwrap()).await;
}

/// Several workers on one PostgreSQL share the runs: every run once, no step twice, and no
/// run held by two workers at once.
#[cfg(feature = "postgres")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn workers_on_one_postgres_share_the_runs() {
    let pg = backstop_testkit::PostgresServer::start().await;
    let j = Journal::postgres(&pg.url()).await.unwrap();
    let calls = Calls::default();
    for n in 0..24 {
        j.start_run(&format!("run-{n}"), "ship", None)
            .await
            .unwrap();
    }
    let mut workers = Vec::new();
    for w in 0..4 {
        // Each worker its own pool, as separate processes would have.
        let own = Journal::postgres(&pg.url()).await.unwrap();
        // Sharing, not taking over: a lease long enough that no renewal a loaded machine
        // delays lets it lapse (at the other tests' 300 ms, one can, and another worker takes
        // the run over mid-step). Takeovers after a lease lapses are tested on the manual
        // clock above.
        let worker = worker(&own, &format!("w{w}"), &calls).lease(Duration::from_secs(30));
        workers.push(tokio::spawn(async move { worker.run_until_idle().await }));
    }
    // Each run finished, by one worker, and nothing else reported.
    let mut finished = std::collections::BTreeMap::new();
    for w in workers {
        for report in w.await.unwrap().unwrap() {
            match report.end {
                RunEnd::Succeeded { .. } => *finished.entry(report.run).or_insert(0) += 1,
                other => panic!("{}: {other:?}", report.run),
            }
        }
    }
    assert_eq!(finished.len(), 24, "every run finished: {finished:?}");
    assert!(
        finished.values().all(|&n| n == 1),
        "each once: {finished:?}"
    );
    for n in 0..24 {
        let run = format!("run-{n}");
        assert_eq!(calls.of(&run, "label"), 1, "{run}");
        assert_eq!(calls.of(&run, "notify"), 1, "{run}");
        assert_eq!(
            j.runs().get(&run).await.unwrap().unwrap().state,
            RunState::Succeeded
        );
    }
}
