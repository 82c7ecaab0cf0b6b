//! Typed workflows against real databases (a SQLite file, and a PostgreSQL cluster of the
//! test's own): a workflow of three typed steps runs once, a worker killed after a step's
//! effect and before its record resumes without doing anything twice, and input, output and
//! stored results that do not read as their types are refused in words.

use backstop_core::{Outcome, ReportsOutcome};
use backstop_journal::{
    Journal, JournalError, Reconciled, Reconcilers, RunContext, RunEnd, RunError, RunState, Step,
    Worker, Workflow,
};
use backstop_testkit::{ManualClock, scratch_dir};
use serde::{Deserialize, Serialize};
use std::{
    fmt,
    sync::{Arc, Mutex},
    time::Duration,
};
use tokio::sync::Notify;

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
struct Order {
    id: String,
    cents: u64,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
struct Receipt {
    refund: String,
    emailed: bool,
}

const REFUND: Workflow<Order, Receipt> = Workflow::new("refund");

const LEASE: Duration = Duration::from_millis(300);

/// The shop's refusal: nothing was done.
#[derive(Debug)]
struct Refused;

impl fmt::Display for Refused {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("the shop refused")
    }
}

impl ReportsOutcome for Refused {
    fn outcome(&self) -> Outcome {
        Outcome::NotSent
    }
}

/// What the steps call. Every effect is kept with the key it came with; `hang_on` makes one
/// step's call do its effect and then never answer, as a worker killed after the effect and
/// before its record leaves it.
/// The step whose call does its effect and never answers, and who to tell when it did.
type Hang = Option<(String, Arc<Notify>)>;

#[derive(Clone, Default)]
struct Shop {
    done: Arc<Mutex<Vec<(String, String)>>>,
    hang_on: Arc<Mutex<Hang>>,
}

impl Shop {
    async fn act(&self, what: &str, key: String) -> Result<String, Refused> {
        self.done.lock().unwrap().push((what.to_owned(), key));
        let hang = self.hang_on.lock().unwrap().take();
        match hang {
            Some((step, done)) if step == what => {
                done.notify_one();
                std::future::pending::<()>().await;
                unreachable!()
            }
            other => *self.hang_on.lock().unwrap() = other,
        }
        Ok(format!("{what}-done"))
    }

    fn did(&self, what: &str) -> usize {
        self.done
            .lock()
            .unwrap()
            .iter()
            .filter(|(w, _)| w == what)
            .count()
    }
}

async fn refund(ctx: RunContext, order: Order, shop: Shop) -> Result<Receipt, RunError> {
    let refund = ctx
        .run("refund", &order, |s| shop.act("refund", s.key))
        .await?;
    ctx.run("restock", &order.id, |s| shop.act("restock", s.key))
        .await?;
    let emailed: String = ctx
        .run("email", &refund, |s| shop.act("email", s.key))
        .await?;
    Ok(Receipt {
        refund,
        emailed: !emailed.is_empty(),
    })
}

fn worker(j: &Journal, id: &str, shop: &Shop) -> Worker {
    let shop = shop.clone();
    Worker::new(j.clone(), id)
        .register(REFUND, move |ctx, order| refund(ctx, order, shop.clone()))
        .lease(LEASE)
        .poll_interval(Duration::from_millis(10))
}

fn order() -> Order {
    Order {
        id: "order-7".into(),
        cents: 4200,
    }
}

async fn three_steps_run_once_with_typed_values(j: &Journal) {
    let shop = Shop::default();
    REFUND.start(j, "typed-once", &order()).await.unwrap();
    assert_eq!(
        REFUND.output(j, "typed-once").await.unwrap(),
        None,
        "pending"
    );
    let reports = worker(j, "w1", &shop).run_until_idle().await.unwrap();
    assert!(
        matches!(reports[0].end, RunEnd::Succeeded { .. }),
        "{reports:?}"
    );
    assert_eq!(
        REFUND.output(j, "typed-once").await.unwrap(),
        Some(Receipt {
            refund: "refund-done".into(),
            emailed: true
        })
    );
    assert_eq!(
        (shop.did("refund"), shop.did("restock"), shop.did("email")),
        (1, 1, 1)
    );
    // The input and the output are stored as JSON: another language reads the same records.
    let record = j.runs().get("typed-once").await.unwrap().unwrap();
    assert_eq!(
        record.input.as_deref(),
        Some(r#"{"id":"order-7","cents":4200}"#)
    );
    assert_eq!(
        record.output.as_deref(),
        Some(r#"{"refund":"refund-done","emailed":true}"#)
    );
    // Started again with the same input: the run as it is; with other input: refused.
    REFUND.start(j, "typed-once", &order()).await.unwrap();
    let other = Order {
        cents: 1,
        ..order()
    };
    let e = REFUND.start(j, "typed-once", &other).await.unwrap_err();
    assert!(matches!(e, JournalError::RunRefused { .. }), "{e}");
}

/// The worker is dropped after the restock's effect and before its record (what SIGKILL
/// leaves: the step sent, its outcome unknown). Once its lease lapses, another worker asks the
/// shop, finds the restock done, and finishes the run: every effect once, the same keys.
async fn a_worker_killed_after_an_effect_resumes_without_doing_it_again(
    j: &Journal,
    clock: &ManualClock,
) {
    let shop = Shop::default();
    let hit = Arc::new(Notify::new());
    *shop.hang_on.lock().unwrap() = Some(("restock".into(), hit.clone()));
    REFUND.start(j, "typed-crash", &order()).await.unwrap();
    let first = worker(j, "w1", &shop);
    let running = tokio::spawn(async move { first.run_once().await });
    hit.notified().await;
    running.abort();
    let _ = running.await;
    assert_eq!(shop.did("restock"), 1);
    let keys: Vec<String> = shop
        .done
        .lock()
        .unwrap()
        .iter()
        .map(|(_, k)| k.clone())
        .collect();

    clock.advance(LEASE * 2);
    let asked = shop.clone();
    let hooks = Reconcilers::new().tool("restock", move |s: &Step| {
        let found = asked
            .done
            .lock()
            .unwrap()
            .iter()
            .any(|(what, key)| what == "restock" && *key == s.key);
        async move {
            if found {
                Reconciled::happened("restock-done")
            } else {
                Reconciled::NotHappened
            }
        }
    });
    let reports = worker(j, "w2", &shop)
        .reconcilers(hooks)
        .run_until_idle()
        .await
        .unwrap();
    assert!(
        matches!(reports.last().unwrap().end, RunEnd::Succeeded { .. }),
        "{reports:?}"
    );
    assert_eq!(
        (shop.did("refund"), shop.did("restock"), shop.did("email")),
        (1, 1, 1),
        "nothing done twice"
    );
    let done = shop.done.lock().unwrap().clone();
    assert_eq!(&done[0].1, &keys[0], "the refund's key, unchanged");
    assert_eq!(&done[1].1, &keys[1], "the restock's key, unchanged");
    assert_eq!(
        REFUND
            .output(j, "typed-crash")
            .await
            .unwrap()
            .unwrap()
            .refund,
        "refund-done"
    );
}

/// A step the shop refused (not sent) defers the run; the next turn sends it again.
async fn a_step_not_sent_is_sent_again_later(j: &Journal, clock: &ManualClock) {
    #[derive(Clone, Default)]
    struct Flaky(Arc<Mutex<u32>>);
    const PING: Workflow<(), u32> = Workflow::new("ping");
    let flaky = Flaky::default();
    let f = flaky.clone();
    let w = Worker::new(j.clone(), "w-ping")
        .register(PING, move |ctx, ()| {
            let f = f.clone();
            async move {
                ctx.run("ping", &(), |_| async move {
                    let mut n = f.0.lock().unwrap();
                    *n += 1;
                    if *n == 1 { Err(Refused) } else { Ok(*n) }
                })
                .await
            }
        })
        .retry_delay(Duration::from_millis(50));
    PING.start(j, "typed-ping", &()).await.unwrap();
    let first = w.run_once().await.unwrap().unwrap();
    assert!(matches!(first.end, RunEnd::Deferred { .. }), "{first:?}");
    clock.advance(Duration::from_secs(1));
    w.run_until_idle().await.unwrap();
    assert_eq!(PING.output(j, "typed-ping").await.unwrap(), Some(2));
}

/// Input, output and stored results that do not read as their types are refused in words,
/// and nothing is sent for a run whose input is wrong.
async fn values_that_do_not_read_as_their_types_are_refused(j: &Journal) {
    let shop = Shop::default();
    j.start_run("typed-bad-input", "refund", Some("{\"id\":7}"))
        .await
        .unwrap();
    worker(j, "w-bad", &shop).run_until_idle().await.unwrap();
    let record = j.runs().get("typed-bad-input").await.unwrap().unwrap();
    assert_eq!(record.state, RunState::Failed);
    let why = record.error.unwrap();
    assert!(
        why.contains("does not read as") && why.contains("Order"),
        "{why}"
    );
    assert_eq!(shop.done.lock().unwrap().len(), 0, "nothing sent");

    // A completed step's value read as another type: a person decides.
    const CHANGED: Workflow<(), u64> = Workflow::new("changed");
    let w = Worker::new(j.clone(), "w-changed").register(CHANGED, |ctx, ()| async move {
        ctx.run("count", &(), |_| async { Ok::<_, Refused>(3u64) })
            .await
    });
    CHANGED.start(j, "typed-changed", &()).await.unwrap();
    w.run_until_idle().await.unwrap();
    // A second run reads a completed step's value as another type (the same step asked
    // twice, as a changed workflow would).
    j.start_run("typed-changed-2", "changed", Some("null"))
        .await
        .unwrap();
    let reader = Worker::new(j.clone(), "w-reader").register(CHANGED, |ctx, ()| async move {
        let n: u64 = ctx
            .run("count", &(), |_| async { Ok::<_, Refused>(3u64) })
            .await?;
        let as_text: Result<String, RunError> = ctx
            .run("count", &(), |_| async { Ok::<_, Refused>("x".to_owned()) })
            .await;
        match as_text {
            Err(RunError::NeedsHuman { why }) => Err(RunError::failed(format!("{n}: {why}"))),
            other => Err(RunError::failed(format!("unexpected: {other:?}"))),
        }
    });
    reader.run_until_idle().await.unwrap();
    let record = j.runs().get("typed-changed-2").await.unwrap().unwrap();
    let why = record.error.unwrap();
    assert!(
        why.starts_with("3: ")
            && why.contains("stored result does not read as alloc::string::String"),
        "{why}"
    );
    // A value that cannot be written as JSON cannot be replayed: the run fails, saying so.
    const UNKEPT: Workflow<(), usize> = Workflow::new("unkept");
    let w = Worker::new(j.clone(), "w-unkept").register(UNKEPT, |ctx, ()| async move {
        let by_pair: std::collections::HashMap<(u8, u8), u8> = ctx
            .run("pairs", &(), |_| async {
                Ok::<_, Refused>([((1, 2), 3)].into_iter().collect())
            })
            .await?;
        Ok(by_pair.len())
    });
    UNKEPT.start(j, "typed-unkept", &()).await.unwrap();
    w.run_until_idle().await.unwrap();
    let record = j.runs().get("typed-unkept").await.unwrap().unwrap();
    assert_eq!(record.state, RunState::Failed);
    let why = record.error.unwrap();
    assert!(why.contains("cannot be written as JSON"), "{why}");

    // The output of a run of another workflow does not read as this one's.
    const OTHER: Workflow<(), Vec<String>> = Workflow::new("changed");
    let e = OTHER.output(j, "typed-changed").await.unwrap_err();
    assert!(e.to_string().contains("does not read as"), "{e}");
}

async fn all(j: Journal, clock: ManualClock) {
    three_steps_run_once_with_typed_values(&j).await;
    a_worker_killed_after_an_effect_resumes_without_doing_it_again(&j, &clock).await;
    a_step_not_sent_is_sent_again_later(&j, &clock).await;
    values_that_do_not_read_as_their_types_are_refused(&j).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn typed_workflows_on_sqlite() {
    let dir = scratch_dir("typed");
    let clock = ManualClock::new();
    let j = Journal::sqlite(dir.path().join("journal.db"))
        .await
        .unwrap()
        .with_clock(clock.reader());
    all(j, clock).await;
}

#[cfg(feature = "postgres")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn typed_workflows_on_postgres() {
    let pg = backstop_testkit::PostgresServer::start().await;
    let clock = ManualClock::new();
    let j = Journal::postgres(&pg.url())
        .await
        .unwrap()
        .with_clock(clock.reader());
    all(j, clock).await;
}
