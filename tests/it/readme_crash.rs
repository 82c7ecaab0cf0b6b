//! The README's typed workflow in a real worker process (`examples/support/bin/readme_worker.rs`,
//! the same workflow code), killed with SIGKILL just before and just after each step's effect,
//! then resumed by a second process. With a reconcile hook per step (asking the shop whether a
//! call with the step's key happened), every run ends done and every effect happens once. With
//! none, as the README's worker registers none, a step whose outcome the journal cannot know goes
//! to a person and is not sent again.

use backstop_workspace::invoice::worker_exit;
use std::path::Path;

const WORKER: &str = env!("CARGO_BIN_EXE_readme_worker");
const STEPS: [&str; 3] = ["refund", "restock", "email"];

/// Runs a worker process on journal `db`, killed at `kill_at` (`None`: to the end), and returns
/// how it ended (`Err("killed")` when it died).
fn worker(db: &str, effects: &Path, kill_at: Option<&str>, hooks: bool) -> Result<i32, String> {
    let mut cmd = std::process::Command::new(WORKER);
    cmd.arg(db).arg(effects).arg(kill_at.unwrap_or("-"));
    if hooks {
        cmd.arg("hooks");
    }
    worker_exit(cmd.status().expect("the worker runs"))
}

/// The steps whose effect the shop performed, in order.
fn effects(path: &Path) -> Vec<String> {
    let done = std::fs::read_to_string(path).unwrap_or_default();
    done.lines()
        .map(|l| l.split(' ').next().unwrap_or_default().to_owned())
        .collect()
}

/// Kills a worker at `kill_at` and resumes the run in a second process; returns how the second
/// ended and the effects.
fn crash_and_resume(
    db: &str,
    dir: &Path,
    kill_at: &str,
    hooks: bool,
) -> (Result<i32, String>, Vec<String>) {
    let file = dir.join("effects");
    let first = worker(db, &file, Some(kill_at), hooks);
    assert_eq!(
        first,
        Err("killed".to_owned()),
        "{kill_at}: the worker died there"
    );
    let resumed = worker(db, &file, None, hooks);
    (resumed, effects(&file))
}

#[test]
fn killed_beside_each_effect_and_resumed_each_step_acts_once() {
    let dir = backstop_testkit::scratch_dir("readme-crash");
    let points: Vec<String> = STEPS
        .iter()
        .flat_map(|step| [format!("{step}:before"), format!("{step}:after")])
        .collect();
    std::thread::scope(|s| {
        for (n, kill_at) in points.iter().enumerate() {
            let point = dir.path().join(n.to_string());
            std::fs::create_dir_all(&point).unwrap();
            s.spawn(move || {
                let db = format!("sqlite://{}", point.join("journal.db").display());
                let (resumed, done) = crash_and_resume(&db, &point, kill_at, true);
                assert_eq!(resumed, Ok(0), "{kill_at}: the run ends done");
                assert_eq!(done, STEPS, "{kill_at}: each effect once, in order");
            });
        }
    });
}

#[test]
fn with_no_hook_an_effect_the_journal_cannot_know_goes_to_a_person() {
    let dir = backstop_testkit::scratch_dir("readme-crash-no-hook");
    let db = format!("sqlite://{}", dir.path().join("journal.db").display());
    let (resumed, done) = crash_and_resume(&db, dir.path(), "restock:after", false);
    assert_eq!(resumed, Ok(4), "the run waits for a person");
    assert_eq!(done, ["refund", "restock"], "the restock not sent again");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_postgres_killed_after_an_effect_and_resumed_each_step_acts_once() {
    let pg = backstop_testkit::PostgresServer::start().await;
    let dir = backstop_testkit::scratch_dir("readme-crash-pg");
    let (url, path) = (pg.url(), dir.path().to_owned());
    let (resumed, done) =
        tokio::task::spawn_blocking(move || crash_and_resume(&url, &path, "email:after", true))
            .await
            .unwrap();
    assert_eq!(resumed, Ok(0), "the run ends done");
    assert_eq!(done, STEPS, "each effect once, in order");
}
