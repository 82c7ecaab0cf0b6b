//! The invoice workflow's worker, a real child process, killed with SIGKILL at every point
//! (`examples/support/invoice.rs`: before the first step; for each of the three steps after it
//! is written as `sent`, in the service after it acted and before it answers,
//! after the outcome is written, which is between two steps or after the last one), then
//! recovered by a second worker process whose worker loop is the only recovery there is; also
//! killed while it recovers another's run, and while the run waits for a parked step. Each
//! point has services, a run and a journal of its own, so the points run side by side. Counted:
//! duplicate effects (must be 0), runs that converged to a known state, runs handed to a
//! person.
//!
//! The same kill points with a resume that does not reconcile (it sends unknown steps again)
//! show what the guard is worth: inventory and the mailer do not honour keys, so that resume
//! reserves and emails twice.
//!
//! A failed run forked at its failed step, and the fork run by a worker process.

use backstop_journal::{Journal, RunState, StepId, StepState};
use backstop_workspace::invoice::{self, World};
use std::path::Path;

#[derive(Debug, Default)]
struct Tally {
    points: usize,
    duplicates: usize,
    converged: usize,
    human: usize,
}

/// A new, empty database for kill point `n` on the PostgreSQL server at `url`: its URL.
async fn database_of_its_own(url: &str, n: usize) -> String {
    use sqlx::Executor as _;
    let mut conn = <sqlx::PgConnection as sqlx::Connection>::connect(url)
        .await
        .unwrap();
    let name = format!("kill_point_{n}");
    conn.execute(&*format!("CREATE DATABASE {name}"))
        .await
        .unwrap();
    let (server, _) = url.rsplit_once('/').unwrap();
    format!("{server}/{name}")
}

/// Kills the worker at `kill_at` and resumes the run; `pg`: the journal in this PostgreSQL
/// database instead of a SQLite file. The future owns what it is given, so each point can be a task.
fn crash_and_resume(
    kill_at: &str,
    naive: bool,
    n: usize,
    pg: Option<&str>,
) -> impl Future<Output = (String, usize, bool, bool)> + Send + 'static {
    let (kill_at, pg) = (kill_at.to_owned(), pg.map(str::to_owned));
    async move { crash_and_resume_at(&kill_at, naive, n, pg.as_deref()).await }
}

async fn crash_and_resume_at(
    kill_at: &str,
    naive: bool,
    n: usize,
    pg: Option<&str>,
) -> (String, usize, bool, bool) {
    let worker = Path::new(env!("CARGO_BIN_EXE_invoice_worker"));
    let world = World::start().await;
    let scratch = backstop_testkit::scratch_dir(&format!(
        "journal-crash-{n}-{}",
        if naive { "naive" } else { "journal" }
    ));
    let dir = scratch.path();
    let db = match pg {
        Some(url) => url.to_owned(),
        None => invoice::fresh_db(dir).to_string_lossy().into_owned(),
    };
    let run = format!("run-{n}-{}", if naive { "naive" } else { "journal" });
    let mut first = invoice::spawn_worker(worker, &db, &world.url(), &run, Some(kill_at), false);
    if let Some(step) = kill_at.strip_suffix(":effect") {
        world.kill_after_effect(step, first.id());
    }
    let status = tokio::task::spawn_blocking(move || first.wait())
        .await
        .unwrap()
        .unwrap();
    assert_eq!(
        invoice::worker_exit(status),
        Err("killed".to_owned()),
        "{kill_at}: the worker died there"
    );

    let mut second = invoice::spawn_worker(worker, &db, &world.url(), &run, None, naive);
    let status = tokio::task::spawn_blocking(move || second.wait())
        .await
        .unwrap()
        .unwrap();
    let code = invoice::worker_exit(status).unwrap();
    let journal = Journal::open(&db).await.unwrap();
    let steps = journal.runs().steps(&run).await.unwrap();
    let converged = code == 0
        && steps.len() == 3
        && steps
            .iter()
            .all(|s| s.state.succeeded() || s.state == StepState::Compensated);
    let human = code == 4
        || journal
            .runs()
            .stuck()
            .await
            .unwrap()
            .iter()
            .any(|s| s.attention.is_some());
    let effects = world.effects();
    if !naive {
        assert!(
            converged || human,
            "{kill_at}: resume ended {code} with {steps:?}"
        );
    }
    (kill_at.to_owned(), effects.duplicates(), converged, human)
}

async fn every_kill_point(naive: bool, pg: Option<&str>) -> Tally {
    // Each point has services, a run and a journal of its own (a SQLite file, or a database of
    // its own on the PostgreSQL server: a worker takes any pending run in its journal), so the
    // points run side by side; on PostgreSQL four at a time, so that the pools in use (one a
    // point at a time, the worker's or the test's: up to 8 connections and a step's own) stay
    // within the test server's 50 connections.
    let points = invoice::kill_points();
    let at_once = if pg.is_some() { 4 } else { points.len() };
    let slots = std::sync::Arc::new(tokio::sync::Semaphore::new(at_once));
    let mut tasks = tokio::task::JoinSet::new();
    for (n, point) in points.iter().enumerate() {
        let db = match pg {
            Some(url) => Some(database_of_its_own(url, n).await),
            None => None,
        };
        let (slots, run) = (
            slots.clone(),
            crash_and_resume(point, naive, n, db.as_deref()),
        );
        tasks.spawn(async move {
            let _slot = slots.acquire_owned().await.unwrap();
            run.await
        });
    }
    let mut ends = Vec::new();
    while let Some(end) = tasks.join_next().await {
        ends.push(end.unwrap());
    }
    let mut tally = Tally::default();
    for (point, duplicates, converged, human) in ends {
        println!("{point}: {duplicates} duplicates, converged {converged}, human {human}");
        tally.points += 1;
        tally.duplicates += duplicates;
        tally.converged += usize::from(converged);
        tally.human += usize::from(human);
    }
    tally
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killed_at_every_transition_and_resumed_the_journal_allows_no_duplicate() {
    let t = every_kill_point(false, None).await;
    println!("journal and reconciliation: {t:?}");
    assert_eq!(t.points, 10);
    assert_eq!(t.duplicates, 0, "{t:?}");
    assert_eq!(
        t.converged, 10,
        "every run converged to a known state: {t:?}"
    );
    assert_eq!(t.human, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_resume_that_does_not_reconcile_acts_twice() {
    let t = every_kill_point(true, None).await;
    println!("resume without reconciliation: {t:?}");
    // Killed after inventory reserved or after the mailer sent, before the worker heard: the
    // naive resume sends again, and those services do not honour keys.
    assert_eq!(t.duplicates, 2, "{t:?}");
}

/// The provider cannot tell (the mailer's lookup is down): the run goes to a person, and the
/// email is not sent again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn what_the_provider_cannot_tell_goes_to_a_person_not_out_again() {
    let worker = Path::new(env!("CARGO_BIN_EXE_invoice_worker"));
    let world = World::start().await;
    let scratch = backstop_testkit::scratch_dir("journal-crash-human");
    let db = invoice::fresh_db(scratch.path())
        .to_string_lossy()
        .into_owned();
    let mut first = invoice::spawn_worker(worker, &db, &world.url(), "run-h", None, false);
    world.kill_after_effect("send-email", first.id());
    world.take_mailer_lookup_down();
    let status = tokio::task::spawn_blocking(move || first.wait())
        .await
        .unwrap()
        .unwrap();
    assert_eq!(invoice::worker_exit(status), Err("killed".to_owned()));
    let mut second = invoice::spawn_worker(worker, &db, &world.url(), "run-h", None, false);
    let status = tokio::task::spawn_blocking(move || second.wait())
        .await
        .unwrap()
        .unwrap();
    assert_eq!(invoice::worker_exit(status), Ok(4), "a step needs a person");
    let stuck = Journal::open(&db)
        .await
        .unwrap()
        .runs()
        .stuck()
        .await
        .unwrap();
    assert_eq!(stuck.len(), 1);
    assert_eq!(&*stuck[0].id.step, "send-email");
    assert!(
        stuck[0].attention.as_deref().unwrap().contains("503"),
        "{stuck:?}"
    );
    assert_eq!(world.effects().messages, 1, "not sent again");
}

/// The same, with the journal on PostgreSQL (a cluster of the test's own).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_postgres_killed_at_every_transition_and_resumed_no_duplicate() {
    let pg = backstop_testkit::PostgresServer::start().await;
    let t = every_kill_point(false, Some(&pg.url())).await;
    println!("journal on PostgreSQL: {t:?}");
    assert_eq!(
        (t.points, t.duplicates, t.converged, t.human),
        (10, 0, 10, 0),
        "{t:?}"
    );
}

/// Runs a worker process for `run` killed at `kill_at` (`None`: to the end) and returns its
/// exit (`Err("killed")` when it died).
async fn worker_process(
    world: &World,
    db: &str,
    run: &str,
    kill_at: Option<&str>,
    effect_of: Option<&str>,
) -> Result<i32, String> {
    let exe = Path::new(env!("CARGO_BIN_EXE_invoice_worker"));
    let mut child = invoice::spawn_worker(exe, db, &world.url(), run, kill_at, false);
    if let Some(step) = effect_of {
        world.kill_after_effect(step, child.id());
    }
    let status = tokio::task::spawn_blocking(move || child.wait())
        .await
        .unwrap()
        .unwrap();
    invoice::worker_exit(status)
}

/// A worker killed while it recovers a run (in the reconcile hook, asking inventory what
/// became of the reservation the first worker made): a third worker recovers both deaths.
async fn killed_during_recovery(db: &str, run: &str) {
    let world = World::start().await;
    let killed = Err("killed".to_owned());
    let first = worker_process(&world, db, run, None, Some("reserve-inventory")).await;
    assert_eq!(first, killed, "killed after inventory reserved");
    let second = worker_process(&world, db, run, Some("reconcile:inventory"), None).await;
    assert_eq!(second, killed, "killed while reconciling");
    let third = worker_process(&world, db, run, None, None).await;
    assert_eq!(third, Ok(0), "the third worker finishes the run");
    assert_eq!(
        world.effects(),
        invoice::Effects {
            invoices: 1,
            reservations: 1,
            messages: 1
        }
    );
    let journal = Journal::open(db).await.unwrap();
    let record = journal.runs().get(run).await.unwrap().unwrap();
    assert_eq!(record.state, RunState::Succeeded);
}

/// A worker killed while the run waits for a parked step (the mailer said to come back in a
/// second): the next worker claims it when it is due, with nobody calling anything, and the
/// email goes out once.
async fn killed_during_a_parked_wait(db: &str, run: &str) {
    let world = World::start().await;
    // Every attempt the stack makes is turned away, each saying when to come back.
    world.make_mailer_busy(backstop::retry::DEFAULT_MAX_ATTEMPTS);
    let first = worker_process(&world, db, run, Some("run:deferred"), None).await;
    assert_eq!(first, Err("killed".to_owned()), "killed while it waited");
    let journal = Journal::open(db).await.unwrap();
    let email = StepId::new(run, "send-email", "");
    assert_eq!(
        journal.runs().step(&email).await.unwrap().unwrap().state,
        StepState::Parked
    );
    assert_eq!(world.effects().messages, 0);
    let second = worker_process(&world, db, run, None, None).await;
    assert_eq!(second, Ok(0));
    assert_eq!(world.effects().messages, 1, "sent once, when it was due");
    assert_eq!(world.effects().duplicates(), 0);
    let history: Vec<_> = journal
        .runs()
        .step_history(&email)
        .await
        .unwrap()
        .iter()
        .map(|t| t.to.as_str())
        .collect();
    assert!(
        history.ends_with(&["parked", "sent", "succeeded"]),
        "{history:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killed_while_recovering_or_waiting_the_run_still_converges() {
    let scratch = backstop_testkit::scratch_dir("crash-recovery");
    let db = invoice::fresh_db(scratch.path())
        .to_string_lossy()
        .into_owned();
    killed_during_recovery(&db, "run-recovery").await;
    killed_during_a_parked_wait(&db, "run-parked").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_postgres_killed_while_recovering_or_waiting_the_run_still_converges() {
    let pg = backstop_testkit::PostgresServer::start().await;
    killed_during_recovery(&pg.url(), "run-recovery").await;
    killed_during_a_parked_wait(&pg.url(), "run-parked").await;
}

/// A run whose email the mailer refused for good (`422`, nothing sent) failed; the operator
/// forks it at that step once the address is fixed, and a worker process runs the fork: the
/// invoice and the reservation are read from the journal (made once, by the original), the
/// email goes out once, under the fork's key.
async fn a_failed_run_forked_at_its_failed_step_finishes(db: &str, run: &str) {
    let world = World::start().await;
    world.make_mailer_refuse(true);
    let first = worker_process(&world, db, run, None, None).await;
    assert_eq!(first, Ok(5), "the run failed at its email");
    let journal = Journal::open(db).await.unwrap();
    let email = StepId::new(run, "send-email", "");
    let refused = journal.runs().step(&email).await.unwrap().unwrap();
    assert_eq!(refused.state, StepState::FailedAfterExecution);

    world.make_mailer_refuse(false);
    let fork = format!("{run}-fork");
    let record = journal
        .operator()
        .fork(run, "send-email", &fork, "ana", "the address is fixed")
        .await
        .unwrap();
    assert_eq!(record.state, RunState::Pending);
    let second = worker_process(&world, db, &fork, None, None).await;
    assert_eq!(second, Ok(0), "the fork finishes");
    assert_eq!(
        world.effects(),
        invoice::Effects {
            invoices: 1,
            reservations: 1,
            messages: 1
        },
        "each earlier effect once, the forked step once"
    );

    let original = journal.runs().steps(run).await.unwrap();
    let forked = journal.runs().steps(&fork).await.unwrap();
    assert_eq!(forked.len(), 3, "{forked:?}");
    for (a, b) in original.iter().zip(&forked) {
        assert_eq!(a.id.step, b.id.step);
        if &*a.id.step == "send-email" {
            assert_ne!(a.key, b.key, "the forked step runs under the fork's key");
            assert_eq!(b.state, StepState::Succeeded);
        } else {
            assert_eq!(
                a.key, b.key,
                "a copied step keeps the key its effect was made with"
            );
            assert_eq!((a.state, &a.result), (b.state, &b.result));
        }
    }
    let done = journal.runs().get(&fork).await.unwrap().unwrap();
    assert_eq!(done.state, RunState::Succeeded);
    assert_eq!(done.output.as_deref(), Some(r#"{"invoice":"inv_1"}"#));
    assert_eq!(done.forked_from.as_ref().map(|f| f.run.as_str()), Some(run));
    let original_run = journal.runs().get(run).await.unwrap().unwrap();
    assert_eq!(
        original_run.state,
        RunState::Failed,
        "the original keeps its end"
    );
    assert_eq!(
        refused.key,
        journal.runs().step(&email).await.unwrap().unwrap().key
    );
    let forks = journal.runs().forks(run).await.unwrap();
    assert_eq!(forks.len(), 1);
    assert_eq!(forks[0].id, fork);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_run_forked_at_its_failed_step_finishes_on_sqlite() {
    let scratch = backstop_testkit::scratch_dir("crash-fork");
    let db = invoice::fresh_db(scratch.path())
        .to_string_lossy()
        .into_owned();
    a_failed_run_forked_at_its_failed_step_finishes(&db, "run-refused").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_run_forked_at_its_failed_step_finishes_on_postgres() {
    let pg = backstop_testkit::PostgresServer::start().await;
    a_failed_run_forked_at_its_failed_step_finishes(&pg.url(), "run-refused").await;
}
