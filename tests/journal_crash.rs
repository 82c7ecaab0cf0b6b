//! The invoice workflow's worker, a real child process, killed with SIGKILL at every
//! transition point in turn (`src/invoice.rs`: after `pending` is written, after `sent` is
//! written, in the service after it acted and before it answers, after the outcome is
//! written, for each of the three steps), then resumed by a second worker. Counted: duplicate
//! effects (must be 0), runs that converged to a known state, runs handed to a person.
//!
//! The same kill points with a resume that does not reconcile (it sends unknown steps again)
//! show what the guard is worth: inventory and the mailer do not honour keys, so that resume
//! reserves and emails twice.

use backstop_journal::{Journal, StepState};
use backstop_workspace::invoice::{self, World};
use std::path::Path;

#[derive(Debug, Default)]
struct Tally {
    points: usize,
    duplicates: usize,
    converged: usize,
    human: usize,
}

/// Kills the worker at `kill_at` and resumes the run; `pg`: the journal on this PostgreSQL
/// instead of a SQLite file.
async fn crash_and_resume(
    kill_at: &str,
    naive: bool,
    n: usize,
    pg: Option<&str>,
) -> (usize, bool, bool) {
    let worker = Path::new(env!("CARGO_BIN_EXE_invoice_worker"));
    let world = World::start().await;
    let dir = std::env::temp_dir().join(format!(
        "backstop-journal-crash-{}-{n}-{}",
        std::process::id(),
        if naive { "naive" } else { "journal" }
    ));
    let db = match pg {
        Some(url) => url.to_owned(),
        None => invoice::fresh_db(&dir).to_string_lossy().into_owned(),
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
    let steps = journal.run(&run).await.unwrap();
    let converged = code == 0
        && steps.len() == 3
        && steps
            .iter()
            .all(|s| s.state.succeeded() || s.state == StepState::Compensated);
    let human = code == 4
        || journal
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
    (effects.duplicates(), converged, human)
}

async fn every_kill_point(naive: bool, pg: Option<&str>) -> Tally {
    let mut tally = Tally::default();
    for (n, point) in invoice::kill_points().iter().enumerate() {
        let (duplicates, converged, human) = crash_and_resume(point, naive, n, pg).await;
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
    assert_eq!(t.points, 12);
    assert_eq!(t.duplicates, 0, "{t:?}");
    assert_eq!(
        t.converged, 12,
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
    let dir = std::env::temp_dir().join(format!(
        "backstop-journal-crash-{}-human",
        std::process::id()
    ));
    let db = invoice::fresh_db(&dir).to_string_lossy().into_owned();
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
    let stuck = Journal::open(&db).await.unwrap().stuck().await.unwrap();
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
        (12, 0, 12, 0),
        "{t:?}"
    );
}
